"""``topk_pools`` as a Mosaic GPU kernel (``implementation="mosaic"`` / ``"mosaic_interpret"``).

The same radix select as the Triton kernel (``pallas_kernels.radix_select``), so the same
result bit for bit: ``T``, the ``select_k``-th largest ``order_key``, is built most
significant digit first in ``32 / radix_bits`` counting passes, then one compaction pass
writes the pools with ``key > T`` and the first ``select_k - #{key > T}`` pools with
``key == T`` (pool order), ascending, and ``-1`` after; ``-inf`` / NaN keys never. ``n_live``
bounds each row exactly as there: pools at or past it count as ``-inf`` and are never read
(``dead_counts``).

Kernel shape: ``plmgpu.kernel`` (a ``pallas_call`` with Mosaic GPU compiler params has no
CUDA lowering on jax 0.12), one warpgroup (128 threads) per CTA, Lane lowering semantics,
every ref in global memory (GMEM). Pools are streamed in tiles read straight from GMEM
(coalesced vector loads; nothing row-sized on chip, so 262,144-pool rows cost what short
ones do in SMEM). Two paths, as the Triton kernels, chosen by ``P``
(``MosaicTopkPoolsBlockSizes.multi_program``):

* one-program: one CTA per query row does every pass (rows of fewer than ``4 * split_p``
  pools: decode up to 32K tokens at ``index_kpool`` 4, prefill tiles);
* multi-program: one CTA per ``split_p``-pool segment of every row, a counting launch per
  pass and one compaction launch, the per-row decisions between them made by small XLA ops
  on per-segment counts, as ``radix_select.segmented_select`` did before it folded them into
  its kernels (issue 46; the same counts and the same result: a batch-1 decode over a
  1M-token row spreads over 128 CTAs instead of one).

Why this form (jax 0.12.0.1's Mosaic GPU array language, read from its lowering rules):

* Counting is vectorised: a pass streams the row in chunks of 256 pools (a 1-D array in
  the warpgroup's strided layout, two pools per thread) and adds ``key >= candidate`` into
  one vector of per-lane counters per candidate digit, kept in registers across the
  chunks; only at the pass end does ``jnp.sum`` (a warpgroup reduction through SMEM and a
  barrier) reduce each, ``2**radix_bits`` reductions per pass instead of per chunk.
* The compaction is only partly vectorised. Mosaic GPU lowers no ``cumsum`` (no scan), no
  scatter, no gather and no sort, and a 1-D array cannot be broadcast against a second
  axis in the strided layout, so the Triton kernel's ``cumsum`` slot ranking and masked
  scatter have no counterpart. The kernel counts each tile's takes with vector sums
  (``#{key > T}``, ``#{key == T}``; a tile with none costs no more), then writes them one
  by one in pool order: each step finds the next take with a vector ``min`` over the
  tile's candidate lanes and writes its id with a scalar store at the running slot (every
  thread runs the same scalar code), so a row costs about ``select_k`` steps, however
  sparse its takes; the tile loop stops once the row's ``min(select_k, #{key > -inf})``
  ids are written. A per-warp ballot compaction (``inline_mgpu``) would write a tile's
  ids at once but has no interpret mode to test it on a CPU.
* The multi-program compaction has no output pre-filled with ``-1`` (``plmgpu.kernel`` has
  no ``input_output_aliases``): each segment writes only its ids, and XLA writes ``-1``
  past each row's taken count afterwards.

Invariants: ``flat [rows, P_pad]`` float32 with ``P_pad`` a multiple of ``block_p`` (the
wrapper pads; pools at or past ``P`` are masked by the live bound, so padding is never read
as a key; ``block_p`` divides ``split_p`` on the multi-program path, so a segment's tiles
never cross into the next one), ``live [rows]`` int32 already clipped to ``[0, P]``, output
``[rows, K_pad]`` int32 with ``K_pad`` a multiple of 128 (the wrapper slices
``[:, :select_k]``).
``order_key`` is the reference's own function, so no float compare enters a key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_power_of_two, require_mosaic_gpu
from pallas_kernels._order_key import NEG_INF_KEY, dead_counts, order_key

__all__ = ["MosaicTopkPoolsBlockSizes", "mosaic_topk_pools"]

_INT_MIN = -(2**31)
WARPGROUP = 128  # threads of the kernel's one warpgroup: the strided layout's unit
COUNT_CHUNK = 2 * WARPGROUP  # pools a counting step loads: two per thread


@dataclasses.dataclass(frozen=True)
class MosaicTopkPoolsBlockSizes:
    """Tiling of the Mosaic GPU ``topk_pools`` (see the module doc).

    * ``block_p``: pools per streamed tile, a power of two in ``[128, 8192]`` (128: one
      element per thread of the warpgroup; 8192: the SMEM tile the compaction walks).
    * ``radix_bits``: threshold bits found per pass, one of 1, 2, 4: ``32 / radix_bits``
      counting passes, each thread keeping ``2**radix_bits`` pairs of per-lane counters in
      registers (8 bits would need 512 of them and spill).
    * ``split_p``: pools per CTA on the multi-program path, a power of two >= 128; rows of
      at least ``MIN_SEGMENTS * split_p`` pools take that path (``multi_program``).
    """

    block_p: int = 1024
    radix_bits: int = 4
    split_p: int = 2048

    MAX_BLOCK_P: ClassVar[int] = 8192
    MIN_SEGMENTS: ClassVar[int] = 4  # as TopkPoolsBlockSizes: rows of >= 4 segments split

    def validate(self) -> "MosaicTopkPoolsBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        name = "MosaicTopkPoolsBlockSizes."
        check_power_of_two(name + "block_p", self.block_p, minimum=WARPGROUP)
        if self.block_p > self.MAX_BLOCK_P:
            raise ValueError(
                f"{name}block_p must be <= {self.MAX_BLOCK_P} (the SMEM tile), got {self.block_p}")
        check_power_of_two(name + "radix_bits", self.radix_bits)
        if self.radix_bits > 4:
            raise ValueError(
                f"{name}radix_bits must be one of 1, 2, 4 (2**radix_bits per-lane counters in "
                f"registers), got {self.radix_bits!r}")
        check_power_of_two(name + "split_p", self.split_p, minimum=WARPGROUP)
        return self

    def multi_program(self, n_pools: int) -> bool:
        """Whether a row of ``P = n_pools`` pools takes the multi-program path."""
        return n_pools >= self.MIN_SEGMENTS * self.split_p

    def resolve(self, n_pools: int) -> "MosaicTopkPoolsBlockSizes":
        """The sizes the kernels launch with for rows of ``P = n_pools``: ``block_p`` capped
        at ``P`` rounded up to a power of two >= 128, and at ``split_p`` on the
        multi-program path (a segment is whole tiles)."""
        self.validate()
        cap = WARPGROUP
        while cap < n_pools:
            cap *= 2
        if self.multi_program(n_pools):
            cap = min(cap, self.split_p)
        return dataclasses.replace(self, block_p=min(self.block_p, cap))


def _strided(plmgpu, x):
    """``x`` (``[size]``) in the layout a ``[size]`` int32 load gets: the strided layout,
    2-element vectors per thread when ``size >= 256`` (64-bit accesses). Mosaic cannot infer
    it for an iota or a constant, and a loop carry must keep one layout."""
    size = x.shape[0]
    return plmgpu.layout_cast(x, plmgpu.Layout.WG_STRIDED((size,), vec_size=min(2, size // WARPGROUP)))


def _iota(plmgpu, size):
    return _strided(plmgpu, jnp.arange(size, dtype=jnp.int32))


class _Row:
    """One program's view of a row: pools ``[base, stop)`` of row ``row`` (``stop`` at most
    the live bound), read in chunks of ``size`` pools; lanes at or past ``stop`` load as
    ``INT_MIN`` keys, which no score maps to (the least real key is ``order_key(-inf)``)."""

    def __init__(self, plmgpu, s_ref, row, base, stop):
        self.plmgpu, self.s_ref, self.row, self.base, self.stop = plmgpu, s_ref, row, base, stop

    def n_chunks(self, size):
        return (jnp.maximum(self.stop - self.base, 0) + (size - 1)) // size

    def keys(self, t, size, lanes):
        start = self.base + t * size
        key = order_key(self.s_ref[self.row, pl.ds(start, size)])
        return jnp.where(start + lanes < self.stop, key, jnp.int32(_INT_MIN))

    def counts(self, cands, block_p):
        """``[#{key >= c} for c in cands]`` over the pools: per-lane counters in registers
        across chunks of ``COUNT_CHUNK`` pools, one warpgroup reduction per candidate."""
        size = min(block_p, COUNT_CHUNK)
        lanes = _iota(self.plmgpu, size)

        def count_chunk(t, acc):
            key = self.keys(t, size, lanes)
            return tuple(a + (key >= c).astype(jnp.int32) for a, c in zip(acc, cands))

        zero = _strided(self.plmgpu, jnp.zeros((size,), jnp.int32))
        acc = jax.lax.fori_loop(0, self.n_chunks(size), count_chunk, (zero,) * len(cands))
        return [jnp.sum(a) for a in acc]

    def compact(self, o_ref, tile_smem, block_p, thresh, n_sel, n_eq, n_take_eq, n_stop):
        """Write the takes (``key > T``, and ``key == T`` while the row's tie rank stays
        below ``n_take_eq``) at slots from ``n_sel`` on, ascending, tile by tile; ``n_eq``:
        the ``== T`` keys before ``base``; stops once ``n_sel`` reaches ``n_stop``."""
        lanes = _iota(self.plmgpu, block_p)
        row = self.row

        def walk(start, key, n_sel, eq_left, n_tile):
            # Jump from one take to the next: the lowest candidate at or after ``lo`` (a
            # ``min`` over the tile); ``== T`` ones while the tie quota ``eq_left`` lasts.
            def step(c):
                lo, sel, done, eq_left = c
                cand = (key > thresh) | ((key == thresh) & (eq_left > 0))
                j = jnp.min(jnp.where(cand & (lanes >= lo), lanes, block_p))
                o_ref[row, sel] = start + j
                is_eq = (tile_smem[j] == thresh).astype(jnp.int32)
                return j + 1, sel + 1, done + 1, eq_left - is_eq

            init = (jnp.int32(0), n_sel, jnp.int32(0), eq_left)
            return jax.lax.while_loop(lambda c: c[2] < n_tile, step, init)[1]

        def compact_tile(c):
            t, n_sel, n_eq = c
            key = self.keys(t, block_p, lanes)
            gt = jnp.sum((key > thresh).astype(jnp.int32))
            eq = jnp.sum((key == thresh).astype(jnp.int32))
            n_tile = gt + jnp.clip(n_take_eq - n_eq, 0, eq)

            def with_takes(n_sel):
                tile_smem[...] = key
                return walk(self.base + t * block_p, key, n_sel, n_take_eq - n_eq, n_tile)

            n_sel = jax.lax.cond(n_tile > 0, with_takes, lambda n_sel: n_sel, n_sel)
            return t + 1, n_sel, n_eq + eq

        n_tiles = self.n_chunks(block_p)
        jax.lax.while_loop(lambda c: (c[0] < n_tiles) & (c[1] < n_stop), compact_tile,
                           (jnp.int32(0), n_sel, n_eq))


def _candidates(prefix, i, radix_bits):
    """The ``2**radix_bits`` candidate keys of pass ``i`` (as radix_select's kernels)."""
    shift = 32 - radix_bits * (i + 1)
    return shift, [(prefix | (jnp.int32(j) << shift)) ^ jnp.int32(_INT_MIN)
                   for j in range(1 << radix_bits)]


# -- the one-program path: one CTA per row does every pass --------------------------------
def _threshold(view, live, *, n_pools, select_k, block_p, radix_bits):
    """``(T, n_gt)`` of one row: its ``select_k``-th largest key and ``#{key > T}`` (the
    radix select's passes; pools past ``live`` count as ``-inf``)."""
    def radix_pass(i, carry):
        prefix, n_gt = carry
        shift, cands = _candidates(prefix, i, radix_bits)
        digit = jnp.int32(-1)
        for c, cand in zip(view.counts(cands, block_p), cands):
            c = c + dead_counts(cand, n_pools - live)
            enough = c >= select_k
            digit = digit + enough.astype(jnp.int32)
            n_gt = jnp.maximum(n_gt, jnp.where(enough, 0, c))
        return prefix | (digit << shift), n_gt

    prefix, n_gt = jax.lax.fori_loop(0, 32 // radix_bits, radix_pass, (jnp.int32(0), jnp.int32(0)))
    return prefix ^ jnp.int32(_INT_MIN), n_gt


def _select_kernel(s_ref, live_ref, o_ref, tile_smem, *, plmgpu, n_pools, select_k, k_pad,
                   block_p, radix_bits):
    row = jax.lax.axis_index("row")
    live = live_ref[row]
    view = _Row(plmgpu, s_ref, row, jnp.int32(0), live)
    thresh, n_gt = _threshold(view, live, n_pools=n_pools, select_k=select_k, block_p=block_p,
                              radix_bits=radix_bits)
    real = thresh > jnp.int32(NEG_INF_KEY)  # T is -inf: only keys above it are taken
    for c in range(k_pad // WARPGROUP):  # -1 everywhere, then the ids over it
        o_ref[row, pl.ds(c * WARPGROUP, WARPGROUP)] = jnp.full((WARPGROUP,), -1, jnp.int32)
    view.compact(o_ref, tile_smem, block_p, thresh, jnp.int32(0), jnp.int32(0),
                 jnp.where(real, select_k - n_gt, 0), jnp.where(real, select_k, n_gt))


# -- the multi-program path: one CTA per (row, split_p-pool segment) ----------------------
# As radix_select's segmented_select before issue 46 (which folds each pass in its next
# launch's programs): a counting launch per pass writes per-segment counts
# of each candidate, XLA sums them and picks the digit; the per-segment counts of key > T
# and key == T fall out of the passes; XLA turns them into each segment's first output
# slot and tie rank; one compaction launch writes every segment's ids. XLA then writes -1
# past each row's taken count (a Mosaic kernel has no aliased, pre-filled output here).
def _segment_view(plmgpu, s_ref, live_ref, split_p):
    row, seg = jax.lax.axis_index("row"), jax.lax.axis_index("seg")
    base = seg * split_p
    return _Row(plmgpu, s_ref, row, base, jnp.minimum(live_ref[row], base + split_p)), row, seg


def _count_kernel(s_ref, live_ref, c_ref, o_ref, *, plmgpu, split_p, block_p, n_digits):
    view, row, seg = _segment_view(plmgpu, s_ref, live_ref, split_p)
    cands = [c_ref[row, j] for j in range(n_digits)]
    for j, c in enumerate(view.counts(cands, block_p)):
        o_ref[row, seg, j] = c


def _compact_kernel(s_ref, live_ref, t_ref, b_ref, o_ref, tile_smem, *, plmgpu, split_p,
                    block_p):
    view, row, seg = _segment_view(plmgpu, s_ref, live_ref, split_p)
    n_sel, n_eq, n_take = b_ref[row, seg, 0], b_ref[row, seg, 1], b_ref[row, seg, 2]
    view.compact(o_ref, tile_smem, block_p, t_ref[row, 0], n_sel, n_eq, t_ref[row, 1],
                 n_sel + n_take)


def _segmented(kernel_kw, flat, live, select_k, n_pools, blocks):
    plmgpu = kernel_kw["plmgpu"]
    n_rows = flat.shape[0]
    n_seg = -(-n_pools // blocks.split_p)
    n_digits = 1 << blocks.radix_bits
    n_dead = (n_pools - live)[:, None]
    params = dict(grid=(n_rows, n_seg), grid_names=("row", "seg"),
                  compiler_params=kernel_kw["compiler_params"], **kernel_kw["interpret"])
    common = dict(plmgpu=plmgpu, split_p=blocks.split_p, block_p=blocks.block_p)
    count = plmgpu.kernel(
        functools.partial(_count_kernel, n_digits=n_digits, **common),
        out_type=jax.ShapeDtypeStruct((n_rows, n_seg, n_digits), jnp.int32),
        kernel_name="topk_pools_mosaic_count", **params)
    digits = jnp.arange(n_digits, dtype=jnp.int32)
    prefix = jnp.zeros((n_rows, 1), jnp.int32)
    n_gt = jnp.zeros((n_rows, 1), jnp.int32)
    gt_seg = jnp.zeros((n_rows, n_seg), jnp.int32)
    for i in range(32 // blocks.radix_bits):
        shift = 32 - blocks.radix_bits * (i + 1)
        cand = (prefix | (digits << shift)[None, :]) ^ jnp.int32(_INT_MIN)
        seg_counts = count(flat, live, cand)
        counts = jnp.sum(seg_counts, axis=1) + dead_counts(cand, n_dead)
        enough = counts >= select_k
        digit = jnp.sum(enough.astype(jnp.int32), axis=-1, keepdims=True) - 1
        n_gt = jnp.maximum(n_gt, jnp.max(jnp.where(enough, 0, counts), -1, keepdims=True))
        gt_seg = jnp.maximum(gt_seg, jnp.max(jnp.where(enough[:, None, :], 0, seg_counts), -1))
        prefix = prefix | (digit << shift)
    thresh = prefix ^ jnp.int32(_INT_MIN)
    eq_seg = jnp.take_along_axis(seg_counts, digit[:, :, None], axis=-1)[..., 0] - gt_seg
    eq_before = jnp.cumsum(eq_seg, axis=1) - eq_seg
    n_take_eq = jnp.where(thresh > NEG_INF_KEY, select_k - n_gt, 0)  # -inf / NaN: never taken
    take_eq = jnp.clip(n_take_eq - eq_before, 0, eq_seg)
    take_seg = gt_seg + take_eq
    slot_before = jnp.cumsum(take_seg, axis=1) - take_seg
    compact = plmgpu.kernel(
        functools.partial(_compact_kernel, **common),
        out_type=jax.ShapeDtypeStruct((n_rows, kernel_kw["k_pad"]), jnp.int32),
        scratch_types=[plmgpu.SMEM((blocks.block_p,), jnp.int32)],
        kernel_name="topk_pools_mosaic_compact", **params)
    out = compact(flat, live, jnp.concatenate([thresh, n_take_eq], axis=1),
                  jnp.stack([slot_before, eq_before, take_seg], axis=-1))
    n_taken = jnp.sum(take_seg, axis=1, keepdims=True)
    return jnp.where(jnp.arange(out.shape[1])[None, :] < n_taken, out, -1)


def mosaic_topk_pools(scores, select_k: int, n_live, *, interpret: bool,
                      block_sizes: MosaicTopkPoolsBlockSizes):
    """``scores [B, Q, P]`` float32 -> ``[B, Q, select_k]`` int32 through the Mosaic GPU
    kernels; ``n_live [B, Q]`` int32 or ``None`` (every pool). Arguments already checked by
    ``topk_pools``; ``block_sizes`` validated."""
    plmgpu = require_mosaic_gpu("topk_pools(implementation='mosaic')")
    batch, n_q, n_pools = scores.shape
    n_rows = batch * n_q
    if select_k == 0 or n_rows == 0:
        return jnp.full((batch, n_q, select_k), -1, jnp.int32)
    blocks = block_sizes.resolve(n_pools)
    p_pad = -(-n_pools // blocks.block_p) * blocks.block_p
    k_pad = -(-select_k // WARPGROUP) * WARPGROUP
    flat = scores.reshape(n_rows, n_pools)
    if p_pad != n_pools:  # the last tile's loads stay in bounds; the live bound masks them
        flat = jnp.pad(flat, ((0, 0), (0, p_pad - n_pools)))
    if n_live is None:
        live = jnp.full((n_rows,), n_pools, jnp.int32)
    else:
        live = jnp.clip(n_live.reshape(n_rows).astype(jnp.int32), 0, n_pools)
    kernel_kw = dict(
        plmgpu=plmgpu, k_pad=k_pad,
        compiler_params=plmgpu.CompilerParams(lowering_semantics=plmgpu.LoweringSemantics.Lane),
        interpret={"interpret": plmgpu.InterpretGPUParams()} if interpret else {},
    )
    if blocks.multi_program(n_pools):
        out = _segmented(kernel_kw, flat, live, select_k, n_pools, blocks)
    else:
        out = plmgpu.kernel(
            functools.partial(
                _select_kernel, plmgpu=plmgpu, n_pools=n_pools, select_k=select_k, k_pad=k_pad,
                block_p=blocks.block_p, radix_bits=blocks.radix_bits,
            ),
            out_type=jax.ShapeDtypeStruct((n_rows, k_pad), jnp.int32),
            scratch_types=[plmgpu.SMEM((blocks.block_p,), jnp.int32)],
            grid=(n_rows,), grid_names=("row",), kernel_name="topk_pools_mosaic",
            compiler_params=kernel_kw["compiler_params"], **kernel_kw["interpret"],
        )(flat, live)
    return out[:, :select_k].reshape(batch, n_q, select_k)
