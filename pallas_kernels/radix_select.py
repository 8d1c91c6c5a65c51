"""The radix select behind ``topk_pools``: the Pallas kernels (Triton).

They select on ``order_key`` (``pallas_kernels._order_key``: the int32 image of a float32
score whose signed order is the float order, by integer ops only), on which ``topk_pools``
(``pallas_kernels.selection``) defines its tie rule. The kernels find ``T``, the
``select_k``-th largest key of a row, in ``32 / radix_bits`` counting passes, then write the
row's selected pool ids ascending in one compaction pass. Two paths, chosen by
``selection`` from the row length ``P``:

* ``one_program_select``: **one program per query row** does every pass (one launch, no
  work between passes): short rows (decode up to 32K tokens, prefill tiles).
* ``segmented_select``: **one program per ``split_p``-pool segment** of every row. One
  program per row would leave the GPU idle at batch-1 decode (at 1M tokens one program
  would stream 1 MiB nine times while the other SMs wait); here every pass is a launch of
  ``rows * cdiv(P, split_p)`` programs (128 per row at 262,144 pools) that each count their
  segment, and small XLA ops merge the per-segment counts between launches. The
  threshold's per-segment split (how many keys above ``T`` and equal to ``T`` each segment
  holds) falls out of the passes' own counts, so the compaction is also one parallel
  launch, each segment writing its ids from its own output slot and tie rank (exclusive
  prefix sums in pool order).

Invariants: both paths compute the same ``T``, take the same "first ``select_k - #above``
ties in pool order" and write the same ascending slots as ``topk_pools_reference``, bit for
bit, with no candidate list or second selection; both call ``order_key`` itself, so no
float compare (and no platform denormal mode) enters the key. Both take ``[rows, P]``
float32 scores with ``rows * (P + block_p)`` below 2**31 (Triton's int32 offsets; the
caller launches long batches in chunks), a live bound ``[rows]`` int32 per row (pools at
or past it count as ``-inf`` and are never read: work follows the live pools, not ``P``)
and block sizes already validated by ``TopkPoolsBlockSizes``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import next_power_of_two
from pallas_kernels._order_key import NEG_INF_KEY, dead_counts, order_key

__all__ = ["MAX_COMPARE", "one_program_select", "segmented_select"]

MAX_COMPARE = 1 << 16  # most elements of the per-tile [block_p, 2**radix_bits] compare
_INT_MIN = -(2**31)


# --------------------------------------------------------------------------------------
# The one-program path (``one_program_select``, Triton backend).
#
# One program per (batch, query) row. The row is streamed from global memory in tiles of
# ``block_p`` pools (``pl.ds`` + a mask at the row end); nothing row-sized lives on chip,
# so a 262,144-pool row costs the same registers as a 2,048-pool one.
#
# 1. Threshold search (``32 / radix_bits`` passes over the row). Keys are the int32
#    ``order_key`` values, computed in the kernel by ``order_key`` itself. Biasing a key
#    by ``^ INT_MIN`` turns signed order into unsigned order; the threshold ``T`` (the select_k-th largest
#    key) is built in that biased form, most significant digit first. A pass tests the
#    ``2**radix_bits`` candidates ``prefix | j << shift`` at once: ``count[j]`` = number of
#    keys >= candidate j (a ``[block_p, 2**radix_bits]`` compare, summed per tile). Counts
#    fall with j, so the next digit is ``#{j : count[j] >= select_k} - 1`` (count[0] is
#    always >= select_k: no argmax needed). Every tested candidate above ``T`` has a count
#    < select_k, the smallest of them is ``T + 1``, so ``n_gt = count(key > T)`` is the
#    largest count < select_k ever seen: no extra pass.
# 2. Compaction (one pass): in pool order, take ``key > T`` and the first
#    ``select_k - n_gt`` keys ``== T`` (an exclusive ``cumsum`` rank carried across tiles),
#    never ``-inf`` / NaN keys; each taken pool id is scattered to its running ``cumsum``
#    slot, so the row comes out ascending. Then ``-1`` goes into every slot from the number
#    taken up to ``select_k`` (disjoint from the scattered slots: no ordering question
#    between the two stores).
#
# Live bound (``n_live``): pools ``[live, P)`` of a row count as ``-inf`` without being
# read: the tile loops stop at ``live`` and every counting pass adds ``dead_counts``, their
# ``P - live`` keys ``NEG_INF_KEY`` at or above each candidate. So the counts, ``T`` and
# ``n_gt`` are exactly those of the row with those pools set to ``-inf`` (the reference's),
# and the compaction never takes a ``-inf`` key, so skipping them changes no output slot.
# With ``live = P`` (the default) ``dead_counts`` adds 0: the kernel is the unbounded one.
#
# Pool positions past the row end load as the key ``INT_MIN``, which no score maps to
# (the least real key is ``order_key(-inf)``): ``count[0]`` may include them, which is
# harmless, and no other candidate, ``T`` or the compaction ever matches them.
#
# Denormals: ``order_key`` maps every denormal (and ``-0.0``) to the key of ``+0.0`` by
# integer ops on the float's bits, so no float compare and no platform denormal mode
# (XLA:CPU flushes, GPUs need not) enters the key; both paths call ``order_key`` itself,
# so kernel and reference agree on every platform.
#
# Lanes not taken in the scatter point one past the row end (``select_k``) with the mask
# off: on a GPU a masked lane stores nothing; interpret mode re-stores the old value of
# each masked lane's address, which would race a taken lane writing the same address, and
# its out-of-bounds scatter updates are dropped.
# --------------------------------------------------------------------------------------

def _topk_pools_kernel(s_ref, live_ref, o_ref, *, n_pools, select_k, block_p, block_k,
                       radix_bits):
    row = pl.program_id(0)
    live = jnp.clip(live_ref[row], 0, n_pools)  # pools [live, P) are -inf and never read
    n_tiles = pl.cdiv(live, block_p)
    n_dead = n_pools - live
    lanes = jnp.arange(block_p, dtype=jnp.int32)

    def load_keys(t):
        start = t * block_p
        pool = start + lanes
        valid = pool < live
        s = plgpu.load(
            s_ref.at[row, pl.ds(start, block_p)], mask=valid, other=0.0,
            eviction_policy="evict_last",
        )
        key = order_key(s)  # the reference's own ops: see "Denormals" above
        return pool, jnp.where(valid, key, jnp.int32(_INT_MIN))

    # -- 1. threshold search, radix_bits per pass ------------------------------------
    n_digits = 1 << radix_bits
    digits = jnp.arange(n_digits, dtype=jnp.int32)

    def radix_pass(i, carry):
        prefix, n_gt = carry  # prefix: the threshold's biased bits found so far
        shift = 32 - radix_bits * (i + 1)
        cand = (prefix | (digits << shift)) ^ jnp.int32(_INT_MIN)  # back to signed keys

        def count_tile(t, counts):
            _, key = load_keys(t)
            ge = (key[:, None] >= cand[None, :]).astype(jnp.int32)
            return counts + jnp.sum(ge, axis=0)

        counts = jax.lax.fori_loop(0, n_tiles, count_tile, jnp.zeros((n_digits,), jnp.int32))
        counts = counts + dead_counts(cand, n_dead)
        enough = counts >= select_k
        digit = jnp.sum(enough.astype(jnp.int32)) - 1
        n_gt = jnp.maximum(n_gt, jnp.max(jnp.where(enough, 0, counts)))
        return prefix | (digit << shift), n_gt

    prefix, n_gt = jax.lax.fori_loop(
        0, 32 // radix_bits, radix_pass, (jnp.int32(0), jnp.int32(0))
    )
    thresh = prefix ^ jnp.int32(_INT_MIN)
    n_take_eq = select_k - n_gt

    # -- 2. ascending compaction --------------------------------------------------------
    def compact_tile(t, carry):
        n_sel, n_eq = carry
        pool, key = load_keys(t)
        eq = (key == thresh).astype(jnp.int32)
        eq_rank = n_eq + jnp.cumsum(eq) - eq
        take = (key > thresh) | ((eq == 1) & (eq_rank < n_take_eq))
        take = take & (key > jnp.int32(NEG_INF_KEY))
        take_i = take.astype(jnp.int32)
        slot = n_sel + jnp.cumsum(take_i) - take_i
        slot = jnp.where(take, slot, select_k)
        plgpu.store(o_ref.at[row, slot], pool, mask=take)
        return n_sel + jnp.sum(take_i), n_eq + jnp.sum(eq)

    n_sel, _ = jax.lax.fori_loop(0, n_tiles, compact_tile, (jnp.int32(0), jnp.int32(0)))

    # -- 3. -1 in the slots not filled --------------------------------------------------
    k_lanes = jnp.arange(block_k, dtype=jnp.int32)
    first = n_sel // block_k

    @pl.loop(first, pl.cdiv(select_k, block_k))
    def _fill_tile(t):
        start = t * block_k
        slot = start + k_lanes
        plgpu.store(
            o_ref.at[row, pl.ds(start, block_k)],
            jnp.full((block_k,), -1, jnp.int32),
            mask=(slot >= n_sel) & (slot < select_k),
        )


def one_program_select(flat, live, select_k, *, interpret, block_p, radix_bits,
                       compiler_params):
    """The one-program path on ``flat [rows, P]`` with ``live [rows]`` int32 (pools at or
    past it are ``-inf``, unread) -> ``[rows, select_k]`` int32; ``block_p`` already capped
    at the padded row length."""
    n_rows, n_pools = flat.shape
    block_k = min(max(block_p, 16), next_power_of_two(select_k))
    kernel = functools.partial(
        _topk_pools_kernel, n_pools=n_pools, select_k=select_k, block_p=block_p,
        block_k=block_k, radix_bits=radix_bits,
    )
    return pl.pallas_call(
        kernel,
        grid=(n_rows,),
        out_shape=jax.ShapeDtypeStruct((n_rows, select_k), jnp.int32),
        compiler_params=compiler_params,
        interpret=interpret,
        name="topk_pools",
    )(flat, live)


# --------------------------------------------------------------------------------------
# The multi-program path (long rows): the same radix select, with each row cut into
# ``split_p``-pool segments, one program per (row, segment), and the per-row decisions
# between passes made by small XLA ops on per-segment counts.
#
# * ``_count_kernel`` (one launch per radix pass, ``32 / radix_bits`` launches): program
#   (r, s) streams segment s of row r in ``block_p`` tiles and writes, for each of the
#   ``2**radix_bits`` candidate keys of row r (computed by XLA from the prefix found so
#   far, exactly as the one-program kernel does), the number of its keys >= the
#   candidate. XLA sums over segments and picks the digit by the one-program rule.
# * Per-segment split of the threshold ``T``: the per-segment count of ``key > T`` is the
#   largest per-segment count of any tested candidate whose *row* count is < select_k
#   (those candidates are exactly the tested ones above ``T``, the smallest of them is
#   ``T + 1``, and counts fall as the candidate rises), and the per-segment count of
#   ``key >= T`` is the last pass's count at ``T`` itself (the last pass tests ``T``).
#   So the per-segment counts of ``key > T`` and ``key == T`` come free with the passes.
# * XLA turns them into per-segment bases, by exclusive ``cumsum`` over segments in pool
#   order: the number of ``== T`` keys before the segment (their tie rank) and the number
#   of pools the row takes before the segment (its first output slot).
# * ``_compact_kernel`` (one launch): program (r, s) does the one-program compaction on its
#   segment, starting from those bases, into an output prefilled with ``-1`` (aliased:
#   every slot below the row's taken count is written by exactly one lane, the rest keep
#   ``-1``). So the ids come out ascending and the selected set is the reference's, tie
#   rule included, bit for bit.
#
# Passes over the scores: ``32 / radix_bits`` counting + 1 compaction, as on the
# one-program path, but spread over ``rows * cdiv(P, split_p)`` programs per launch.
# Live bound: segments past a row's ``live`` run no tile (they write zero counts and no
# id); XLA adds ``dead_counts`` to the row counts. The dead pools are ``-inf``, so never
# above ``T`` (``T >= NEG_INF_KEY``: a row has ``P >= select_k`` keys, none below it) and
# absent from the per-segment ``key > T`` counts, as they should be; they are missing from
# the per-segment ``key == T`` counts only when ``T`` is ``-inf``, where no tie is taken.
#
# Tiles past the row end load as ``INT_MIN`` keys (see above); every load is in bounds
# or masked, with a dynamic start (jax >= 0.12 bounds-checks static slices).
# --------------------------------------------------------------------------------------


def _segment_tiles(live, split_p, block_p):
    """(first pool of this program's segment, number of block_p tiles it holds below the
    row's live bound: 0 for a segment past it, which then reads nothing)."""
    seg_start = pl.program_id(1) * split_p
    seg_len = jnp.clip(live - seg_start, 0, split_p)
    return seg_start, (seg_len + block_p - 1) // block_p


def _load_tile_keys(s_ref, row, start, n_pools, block_p, **load_kw):
    pool = start + jnp.arange(block_p, dtype=jnp.int32)
    valid = pool < n_pools
    s = plgpu.load(s_ref.at[row, pl.ds(start, block_p)], mask=valid, other=0.0, **load_kw)
    return pool, jnp.where(valid, order_key(s), jnp.int32(_INT_MIN))


def _count_kernel(s_ref, live_ref, c_ref, o_ref, *, n_pools, split_p, block_p, n_digits):
    row = pl.program_id(0)
    live = jnp.clip(live_ref[row], 0, n_pools)
    seg_start, n_tiles = _segment_tiles(live, split_p, block_p)
    cand = c_ref[row, pl.ds(0, n_digits)]

    def count_tile(t, counts):
        # evict_last: the next launch reads the same scores (a 1M-token row is 1 MiB: L2)
        _, key = _load_tile_keys(s_ref, row, seg_start + t * block_p, live, block_p,
                                 eviction_policy="evict_last")
        return counts + jnp.sum((key[:, None] >= cand[None, :]).astype(jnp.int32), axis=0)

    counts = jax.lax.fori_loop(0, n_tiles, count_tile, jnp.zeros((n_digits,), jnp.int32))
    o_ref[row, pl.program_id(1), pl.ds(0, n_digits)] = counts


def _compact_kernel(s_ref, live_ref, t_ref, b_ref, _o_in_ref, o_ref, *, n_pools, split_p,
                    block_p, select_k):
    row = pl.program_id(0)
    seg = pl.program_id(1)
    live = jnp.clip(live_ref[row], 0, n_pools)
    seg_start, n_tiles = _segment_tiles(live, split_p, block_p)
    thresh = t_ref[row, 0]
    n_take_eq = t_ref[row, 1]

    def compact_tile(t, carry):
        n_sel, n_eq = carry
        pool, key = _load_tile_keys(s_ref, row, seg_start + t * block_p, live, block_p)
        eq = (key == thresh).astype(jnp.int32)
        eq_rank = n_eq + jnp.cumsum(eq) - eq
        take = (key > thresh) | ((eq == 1) & (eq_rank < n_take_eq))
        take = take & (key > jnp.int32(NEG_INF_KEY))
        take_i = take.astype(jnp.int32)
        slot = jnp.where(take, n_sel + jnp.cumsum(take_i) - take_i, select_k)
        plgpu.store(o_ref.at[row, slot], pool, mask=take)
        return n_sel + jnp.sum(take_i), n_eq + jnp.sum(eq)

    jax.lax.fori_loop(0, n_tiles, compact_tile, (b_ref[row, seg, 0], b_ref[row, seg, 1]))


def segmented_select(flat, live, select_k, *, interpret, block_p, split_p, radix_bits,
                     compiler_params):
    """The multi-program path on ``flat [rows, P]`` with ``live [rows]`` int32 (pools at or
    past it are ``-inf``; segments past it read nothing) -> ``[rows, select_k]``."""
    n_rows, n_pools = flat.shape
    n_dead = (n_pools - jnp.clip(live, 0, n_pools))[:, None]
    n_seg = pl.cdiv(n_pools, split_p)
    n_digits = 1 << radix_bits
    digits = jnp.arange(n_digits, dtype=jnp.int32)
    common = dict(n_pools=n_pools, split_p=split_p, block_p=block_p)
    count_call = pl.pallas_call(
        functools.partial(_count_kernel, n_digits=n_digits, **common),
        grid=(n_rows, n_seg),
        out_shape=jax.ShapeDtypeStruct((n_rows, n_seg, n_digits), jnp.int32),
        compiler_params=compiler_params, interpret=interpret, name="topk_pools_count",
    )

    prefix = jnp.zeros((n_rows, 1), jnp.int32)  # the threshold's biased bits found so far
    n_gt = jnp.zeros((n_rows, 1), jnp.int32)  # the row's count of key > T
    gt_seg = jnp.zeros((n_rows, n_seg), jnp.int32)  # the same per segment
    for i in range(32 // radix_bits):
        shift = 32 - radix_bits * (i + 1)
        cand = (prefix | (digits << shift)[None, :]) ^ jnp.int32(_INT_MIN)
        seg_counts = count_call(flat, live, cand)  # [rows, n_seg, n_digits]
        counts = jnp.sum(seg_counts, axis=1) + dead_counts(cand, n_dead)
        enough = counts >= select_k  # candidate <= T
        digit = jnp.sum(enough.astype(jnp.int32), axis=-1, keepdims=True) - 1
        n_gt = jnp.maximum(n_gt, jnp.max(jnp.where(enough, 0, counts), -1, keepdims=True))
        gt_seg = jnp.maximum(gt_seg, jnp.max(jnp.where(enough[:, None, :], 0, seg_counts), -1))
        prefix = prefix | (digit << shift)
    thresh = prefix ^ jnp.int32(_INT_MIN)
    ge_seg = jnp.take_along_axis(seg_counts, digit[:, :, None], axis=-1)[..., 0]  # key >= T
    eq_seg = ge_seg - gt_seg
    eq_before = jnp.cumsum(eq_seg, axis=1) - eq_seg
    n_take_eq = select_k - n_gt
    take_eq = jnp.clip(n_take_eq - eq_before, 0, eq_seg)
    take_eq = jnp.where(thresh > NEG_INF_KEY, take_eq, 0)  # -inf / NaN are never taken
    take_seg = gt_seg + take_eq
    slot_before = jnp.cumsum(take_seg, axis=1) - take_seg

    return pl.pallas_call(
        functools.partial(_compact_kernel, select_k=select_k, **common),
        grid=(n_rows, n_seg),
        out_shape=jax.ShapeDtypeStruct((n_rows, select_k), jnp.int32),
        input_output_aliases={4: 0},
        compiler_params=compiler_params, interpret=interpret, name="topk_pools_compact",
    )(
        flat,
        live,
        jnp.concatenate([thresh, n_take_eq], axis=1),
        jnp.stack([slot_before, eq_before], axis=-1),
        jnp.full((n_rows, select_k), -1, jnp.int32),
    )

