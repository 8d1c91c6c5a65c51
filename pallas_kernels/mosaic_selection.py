"""``topk_pools`` as a Mosaic GPU kernel (``implementation="mosaic"`` / ``"mosaic_interpret"``).

The same radix select as the Triton kernel (``pallas_kernels.radix_select``), so the same
result bit for bit: ``T``, the ``select_k``-th largest ``order_key``, is built most
significant digit first in ``32 / radix_bits`` counting passes, then one compaction pass
writes the pools with ``key > T`` and the first ``select_k - #{key > T}`` pools with
``key == T`` (pool order), ascending, and ``-1`` after; ``-inf`` / NaN keys never. ``n_live``
bounds each row exactly as there: pools at or past it count as ``-inf`` and are never read
(``dead_counts``).

Kernel shape: ``plmgpu.kernel`` with one CTA (one warpgroup, 128 threads) per query row,
Lane lowering semantics, every ref in global memory (GMEM). A row is streamed in tiles of
``block_p`` pools read straight from GMEM (coalesced vector loads; nothing row-sized on
chip, so 262,144-pool rows cost what short ones do in SMEM).

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
* One CTA per row: no multi-program path (the Triton one's ``segmented_select``) yet, so a
  batch-1 decode over a very long row keeps one SM busy.

Invariants: ``flat [rows, P_pad]`` float32 with ``P_pad`` a multiple of ``block_p`` (the
wrapper pads; pools at or past ``P`` are masked by the live bound, so padding is never
read as a key), ``live [rows]`` int32 already clipped to ``[0, P]``, output ``[rows,
K_pad]`` int32 with ``K_pad`` a multiple of 128 (the wrapper slices ``[:, :select_k]``).
``order_key`` is the reference's own function, so no float compare enters a key.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_power_of_two, require_mosaic_gpu
from pallas_kernels.radix_select import NEG_INF_KEY, dead_counts, order_key

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
    """

    block_p: int = 1024
    radix_bits: int = 4

    MAX_BLOCK_P = 8192

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
        return self

    def resolve(self, n_pools: int) -> "MosaicTopkPoolsBlockSizes":
        """The sizes the kernel launches with for rows of ``P = n_pools``: ``block_p``
        capped at ``P`` rounded up to a multiple of 128 (a power of two no smaller)."""
        self.validate()
        cap = WARPGROUP
        while cap < n_pools:
            cap *= 2
        return dataclasses.replace(self, block_p=min(self.block_p, cap))


def _strided(plmgpu, x):
    """``x`` (``[size]``) in the layout a ``[size]`` int32 load gets: the strided layout,
    2-element vectors per thread when ``size >= 256`` (64-bit accesses). Mosaic cannot infer
    it for an iota or a constant, and a loop carry must keep one layout."""
    size = x.shape[0]
    return plmgpu.layout_cast(x, plmgpu.Layout.WG_STRIDED((size,), vec_size=min(2, size // WARPGROUP)))


def _iota(plmgpu, size):
    return _strided(plmgpu, jnp.arange(size, dtype=jnp.int32))


def _select_kernel(s_ref, live_ref, o_ref, tile_smem, *, plmgpu, n_pools, select_k, k_pad,
                   block_p, radix_bits):
    row = jax.lax.axis_index("row")
    live = live_ref[row]
    n_tiles = (live + (block_p - 1)) // block_p
    n_dead = n_pools - live
    lanes = _iota(plmgpu, block_p)

    def load_keys(start, size, lanes):
        key = order_key(s_ref[row, pl.ds(start, size)])
        return jnp.where(start + lanes < live, key, jnp.int32(_INT_MIN))

    # -- 1. threshold search (as radix_select's one-program kernel) ----------------------
    # Counting streams chunks of COUNT_CHUNK pools (two per thread) and keeps one vector of
    # per-lane counts per candidate digit: no cross-thread reduction (SMEM + barrier) until
    # the pass ends, then one per digit.
    n_digits = 1 << radix_bits
    chunk = min(block_p, COUNT_CHUNK)
    chunk_lanes = _iota(plmgpu, chunk)
    n_chunks = (live + (chunk - 1)) // chunk

    def radix_pass(i, carry):
        prefix, n_gt = carry
        shift = 32 - radix_bits * (i + 1)
        cands = [(prefix | (jnp.int32(j) << shift)) ^ jnp.int32(_INT_MIN) for j in range(n_digits)]

        def count_chunk(t, acc):
            key = load_keys(t * chunk, chunk, chunk_lanes)
            return tuple(a + (key >= cand).astype(jnp.int32) for a, cand in zip(acc, cands))

        zero = _strided(plmgpu, jnp.zeros((chunk,), jnp.int32))
        acc = jax.lax.fori_loop(0, n_chunks, count_chunk, (zero,) * n_digits)
        counts = [jnp.sum(a) for a in acc]
        digit = jnp.int32(-1)
        for c, cand in zip(counts, cands):
            c = c + dead_counts(cand, n_dead)
            enough = c >= select_k
            digit = digit + enough.astype(jnp.int32)
            n_gt = jnp.maximum(n_gt, jnp.where(enough, 0, c))
        return prefix | (digit << shift), n_gt

    prefix, n_gt = jax.lax.fori_loop(0, 32 // radix_bits, radix_pass, (jnp.int32(0), jnp.int32(0)))
    thresh = prefix ^ jnp.int32(_INT_MIN)
    real = thresh > jnp.int32(NEG_INF_KEY)  # T is -inf: only keys above it are taken
    n_take_eq = jnp.where(real, select_k - n_gt, 0)
    n_total = jnp.where(real, select_k, n_gt)

    # -- 2. -1 everywhere, then the ids over it, ascending --------------------------------
    for c in range(k_pad // WARPGROUP):
        o_ref[row, pl.ds(c * WARPGROUP, WARPGROUP)] = jnp.full((WARPGROUP,), -1, jnp.int32)

    def walk(start, key, n_sel, eq_left, n_tile):
        """Write the tile's ``n_tile`` takes, ascending, jumping from one to the next: each
        step finds the lowest candidate at or after ``lo`` (a ``min`` over the tile) and
        reads its key from ``tile_smem``. Candidates: ``key > T``, and ``key == T`` while
        the tie quota ``eq_left`` lasts (so the earliest ties win)."""
        def cond(c):
            return c[2] < n_tile

        def step(c):
            lo, sel, done, eq_left = c
            cand = (key > thresh) | ((key == thresh) & (eq_left > 0))
            j = jnp.min(jnp.where(cand & (lanes >= lo), lanes, block_p))
            o_ref[row, sel] = start + j
            is_eq = (tile_smem[j] == thresh).astype(jnp.int32)
            return j + 1, sel + 1, done + 1, eq_left - is_eq

        return jax.lax.while_loop(cond, step, (jnp.int32(0), n_sel, jnp.int32(0), eq_left))[1]

    def tile_cond(c):
        t, n_sel, _ = c
        return (t < n_tiles) & (n_sel < n_total)

    def compact_tile(c):
        t, n_sel, n_eq = c
        key = load_keys(t * block_p, block_p, lanes)
        gt = jnp.sum((key > thresh).astype(jnp.int32))
        eq = jnp.sum((key == thresh).astype(jnp.int32))
        n_tile = gt + jnp.clip(n_take_eq - n_eq, 0, eq)

        def with_takes(n_sel):
            tile_smem[...] = key
            return walk(t * block_p, key, n_sel, n_take_eq - n_eq, n_tile)

        n_sel = jax.lax.cond(n_tile > 0, with_takes, lambda n_sel: n_sel, n_sel)
        return t + 1, n_sel, n_eq + eq

    jax.lax.while_loop(tile_cond, compact_tile, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))


def mosaic_topk_pools(scores, select_k: int, n_live, *, interpret: bool,
                      block_sizes: MosaicTopkPoolsBlockSizes):
    """``scores [B, Q, P]`` float32 -> ``[B, Q, select_k]`` int32 through the Mosaic GPU
    kernel; ``n_live [B, Q]`` int32 or ``None`` (every pool). Arguments already checked by
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
    kernel = plmgpu.kernel(
        functools.partial(
            _select_kernel, plmgpu=plmgpu, n_pools=n_pools, select_k=select_k, k_pad=k_pad,
            block_p=blocks.block_p, radix_bits=blocks.radix_bits,
        ),
        out_type=jax.ShapeDtypeStruct((n_rows, k_pad), jnp.int32),
        scratch_types=[plmgpu.SMEM((blocks.block_p,), jnp.int32)],
        grid=(n_rows,), grid_names=("row",),
        compiler_params=plmgpu.CompilerParams(lowering_semantics=plmgpu.LoweringSemantics.Lane),
        kernel_name="topk_pools_mosaic",
        **({"interpret": plmgpu.InterpretGPUParams()} if interpret else {}),
    )
    out = kernel(flat, live)
    return out[:, :select_k].reshape(batch, n_q, select_k)
