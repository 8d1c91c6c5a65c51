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
  segment, after each has read the previous launch's per-segment counts of its row and
  picked the digit itself: nothing runs between the launches (``32 / radix_bits + 1``
  kernels a select, no XLA op). The threshold's per-segment split (how many keys above
  ``T`` and equal to ``T`` each segment holds) falls out of the passes' own counts, so the
  compaction is also one parallel launch, each segment writing its ids from its own output
  slot and tie rank (exclusive prefix sums in pool order).

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
    _fill_unfilled(o_ref, row, n_sel, select_k, block_k)


def _fill_unfilled(o_ref, row, n_filled, select_k, block_k):
    """``-1`` into slots ``[n_filled, select_k)`` of ``o_ref``'s ``row``, ``block_k`` at a
    time (disjoint from every slot the compaction scattered to)."""
    k_lanes = jnp.arange(block_k, dtype=jnp.int32)

    @pl.loop(n_filled // block_k, pl.cdiv(select_k, block_k))
    def _fill_tile(t):
        start = t * block_k
        slot = start + k_lanes
        plgpu.store(
            o_ref.at[row, pl.ds(start, block_k)],
            jnp.full((block_k,), -1, jnp.int32),
            mask=(slot >= n_filled) & (slot < select_k),
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
# ``split_p``-pool segments, one program per (row, segment), and no XLA work between the
# launches (issue 46: each XLA op between them was one more kernel and gap a step; a
# batch-8 decode at 128K ran 4 kernels a pass, 37 for the select, now 9).
#
# * ``_count_kernel`` (one launch per radix pass, ``32 / radix_bits`` launches): program
#   (r, s) first **folds the previous pass** (``_fold``): it reads the previous launch's
#   per-segment counts of row r (``[n_seg, 2**radix_bits]``, a few KiB), sums them over
#   segments and picks the digit by the one-program rule, exactly as every other program
#   of row r does (the same integers in the same order: the same digit). Then it streams
#   its segment in ``block_p`` tiles and writes, for each of the ``2**radix_bits``
#   candidates ``prefix | j << shift``, the number of its keys >= the candidate, and its
#   state ``(prefix, n_gt, gt_seg)`` for the next launch.
# * Per-segment split of the threshold ``T``: the per-segment count of ``key > T``
#   (``gt_seg``) is the largest per-segment count of any tested candidate whose *row*
#   count is < select_k (those candidates are exactly the tested ones above ``T``, the
#   smallest of them is ``T + 1``, and counts fall as the candidate rises), and the
#   per-segment count of ``key >= T`` is the last pass's count at ``T`` itself (the last
#   pass tests ``T``). So the per-segment counts of ``key > T`` and ``key == T`` come free
#   with the passes; each program carries its own segment's ``gt_seg``.
# * ``_compact_kernel`` (one launch): program (r, s) folds the last pass, then computes
#   from every segment's counts and states of row r their ``key == T`` and taken counts,
#   and from them, by exclusive prefix sums over segments in pool order, its own bases:
#   the number of ``== T`` keys before its segment (their tie rank) and the number of
#   pools the row takes before it (its first output slot). It compacts its segment as the
#   one-program kernel does, and the row's last program writes ``-1`` into the slots from
#   the row's taken count on (disjoint from every scattered slot). So the ids come out
#   ascending and the selected set is the reference's, tie rule included, bit for bit.
#
# Passes over the scores: ``32 / radix_bits`` counting + 1 compaction, as on the
# one-program path, but spread over ``rows * cdiv(P, split_p)`` programs per launch.
# Live bound: segments past a row's ``live`` run no tile (they write zero counts and no
# id); every fold adds ``dead_counts`` to the row counts. The dead pools are ``-inf``, so
# never above ``T`` (``T >= NEG_INF_KEY``: a row has ``P >= select_k`` keys, none below it)
# and absent from the per-segment ``key > T`` counts, as they should be; they are missing
# from the per-segment ``key == T`` counts only when ``T`` is ``-inf``, where no tie is
# taken.
#
# The per-segment arrays have ``n_seg_p = next_power_of_two(n_seg)`` segment rows (Triton
# loads power-of-two blocks; jax >= 0.12 bounds-checks static slices): rows ``>= n_seg``
# are never written and every read of them is masked to 0. Tiles past the row end load as
# ``INT_MIN`` keys (see above); every load is in bounds or masked, with a dynamic start.
# --------------------------------------------------------------------------------------

_STATE = 4  # per (row, segment): prefix, n_gt, gt_seg, 0 (a power-of-two vector)


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


def _lane(x, i):
    """``x[..., i]`` for an ``i`` known or traced, as a masked sum (no slicing of a value in
    a Triton kernel)."""
    return jnp.sum(jnp.where(jnp.arange(x.shape[-1], dtype=jnp.int32) == i, x, 0), axis=-1)


def _fold(c_ref, st_ref, row, n_seg, n_dead, *, select_k, n_digits, shift):
    """Fold the previous pass (candidates ``prefix | j << shift``) of ``row`` from every
    segment's counts ``c_ref`` and states ``st_ref``: ``(prefix with that pass's digit,
    n_gt, [n_seg_p] gt_seg of every segment, [n_seg_p, n_digits] counts, digit)``."""
    n_seg_p = c_ref.shape[1]
    live_seg = jnp.arange(n_seg_p, dtype=jnp.int32) < n_seg
    counts = plgpu.load(c_ref.at[row], mask=live_seg[:, None], other=0)  # [n_seg_p, n_digits]
    state = plgpu.load(st_ref.at[row], mask=live_seg[:, None], other=0)  # [n_seg_p, _STATE]
    prefix = _lane(_lane(state, 0), 0)  # the row's values: segment 0's copy (every
    n_gt = _lane(_lane(state, 1), 0)  # segment of the row holds the same)
    gt_seg = _lane(state, 2)
    digits = jnp.arange(n_digits, dtype=jnp.int32)
    cand = (prefix | (digits << shift)) ^ jnp.int32(_INT_MIN)
    row_counts = jnp.sum(counts, axis=0) + dead_counts(cand, n_dead)
    enough = row_counts >= select_k  # candidate <= T
    digit = jnp.sum(enough.astype(jnp.int32)) - 1
    n_gt = jnp.maximum(n_gt, jnp.max(jnp.where(enough, 0, row_counts)))
    gt_seg = jnp.maximum(gt_seg, jnp.max(jnp.where(enough[None, :], 0, counts), axis=1))
    return prefix | (digit << shift), n_gt, gt_seg, counts, digit


def _count_kernel(s_ref, live_ref, *refs, n_pools, split_p, block_p, radix_bits, shift,
                  select_k, n_seg):
    if len(refs) == 4:  # a later pass: fold the previous one first
        c_ref, st_ref, o_ref, so_ref = refs
    else:
        (o_ref, so_ref), c_ref = refs, None
    row = pl.program_id(0)
    seg = pl.program_id(1)
    live = jnp.clip(live_ref[row], 0, n_pools)
    seg_start, n_tiles = _segment_tiles(live, split_p, block_p)
    if c_ref is None:
        prefix = n_gt = gt_own = jnp.int32(0)
    else:
        prefix, n_gt, gt_seg, _, _ = _fold(
            c_ref, st_ref, row, n_seg, n_pools - live, select_k=select_k,
            n_digits=1 << radix_bits, shift=shift + radix_bits,  # the previous pass's
        )
        gt_own = _lane(gt_seg, seg)
    n_digits = 1 << radix_bits
    digits = jnp.arange(n_digits, dtype=jnp.int32)
    cand = (prefix | (digits << shift)) ^ jnp.int32(_INT_MIN)

    def count_tile(t, counts):
        # evict_last: the next launch reads the same scores (a 1M-token row is 1 MiB: L2)
        _, key = _load_tile_keys(s_ref, row, seg_start + t * block_p, live, block_p,
                                 eviction_policy="evict_last")
        return counts + jnp.sum((key[:, None] >= cand[None, :]).astype(jnp.int32), axis=0)

    counts = jax.lax.fori_loop(0, n_tiles, count_tile, jnp.zeros((n_digits,), jnp.int32))
    o_ref[row, seg, pl.ds(0, n_digits)] = counts
    lanes = jnp.arange(_STATE, dtype=jnp.int32)
    so_ref[row, seg, pl.ds(0, _STATE)] = jnp.where(
        lanes == 0, prefix, jnp.where(lanes == 1, n_gt, jnp.where(lanes == 2, gt_own, 0)))


def _compact_kernel(s_ref, live_ref, c_ref, st_ref, o_ref, *, n_pools, split_p, block_p,
                    select_k, n_seg, n_digits, block_k):
    row = pl.program_id(0)
    seg = pl.program_id(1)
    live = jnp.clip(live_ref[row], 0, n_pools)
    seg_start, n_tiles = _segment_tiles(live, split_p, block_p)

    # -- the last pass's fold, and every segment's share of T -------------------------
    prefix, n_gt, gt_seg, counts, digit = _fold(
        c_ref, st_ref, row, n_seg, n_pools - live, select_k=select_k, n_digits=n_digits,
        shift=0,
    )
    thresh = prefix ^ jnp.int32(_INT_MIN)
    n_take_eq = select_k - n_gt
    digits = jnp.arange(n_digits, dtype=jnp.int32)
    ge_seg = jnp.sum(jnp.where(digits[None, :] == digit, counts, 0), axis=1)  # key >= T
    eq_seg = ge_seg - gt_seg
    eq_before_seg = jnp.cumsum(eq_seg) - eq_seg
    take_eq = jnp.clip(n_take_eq - eq_before_seg, 0, eq_seg)
    take_eq = jnp.where(thresh > jnp.int32(NEG_INF_KEY), take_eq, 0)  # -inf / NaN: never
    take_seg = gt_seg + take_eq
    before = jnp.arange(take_seg.shape[0], dtype=jnp.int32) < seg
    slot_base = jnp.sum(jnp.where(before, take_seg, 0))
    eq_base = jnp.sum(jnp.where(before, eq_seg, 0))

    # -- compaction of this segment ------------------------------------------------------
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

    jax.lax.fori_loop(0, n_tiles, compact_tile, (slot_base, eq_base))

    # -- -1 in the row's slots not filled (the row's last program) ------------------------
    n_taken = jnp.sum(take_seg)

    @pl.when(seg == n_seg - 1)
    def _fill():
        _fill_unfilled(o_ref, row, n_taken, select_k, block_k)


def segmented_select(flat, live, select_k, *, interpret, block_p, split_p, radix_bits,
                     compiler_params):
    """The multi-program path on ``flat [rows, P]`` with ``live [rows]`` int32 (pools at or
    past it are ``-inf``; segments past it read nothing) -> ``[rows, select_k]``: ``32 /
    radix_bits`` counting launches and one compaction, nothing between them."""
    n_rows, n_pools = flat.shape
    n_seg = pl.cdiv(n_pools, split_p)
    n_seg_p = next_power_of_two(n_seg)
    n_digits = 1 << radix_bits
    common = dict(n_pools=n_pools, split_p=split_p, block_p=block_p, select_k=select_k,
                  n_seg=n_seg)
    per_segment = (jax.ShapeDtypeStruct((n_rows, n_seg_p, n_digits), jnp.int32),
                   jax.ShapeDtypeStruct((n_rows, n_seg_p, _STATE), jnp.int32))
    carry = ()
    for i in range(32 // radix_bits):
        carry = pl.pallas_call(
            functools.partial(_count_kernel, radix_bits=radix_bits,
                              shift=32 - radix_bits * (i + 1), **common),
            grid=(n_rows, n_seg),
            out_shape=per_segment,
            compiler_params=compiler_params, interpret=interpret, name="topk_pools_count",
        )(flat, live, *carry)
    return pl.pallas_call(
        functools.partial(_compact_kernel, n_digits=n_digits,
                          block_k=min(max(block_p, 16), next_power_of_two(select_k)),
                          **common),
        grid=(n_rows, n_seg),
        out_shape=jax.ShapeDtypeStruct((n_rows, select_k), jnp.int32),
        compiler_params=compiler_params, interpret=interpret, name="topk_pools_compact",
    )(flat, live, *carry)
