"""The order key: float32 scores as int32 keys whose signed order is the float order.

``topk_pools`` defines its tie rule on these keys, so every implementation of it shares
them: the reference (``selection``), the Triton kernels (``radix_select``), the Mosaic
kernel (``mosaic_selection``) and ``streaming_topk`` (``streaming_selection``). They live
here, apart from any kernel, so that no kernel module imports another one for a helper.

Invariants: the key is computed by integer ops on the float's bits only, so no float
compare and no platform denormal mode (XLA:CPU flushes denormals, GPUs need not) enters
it; ``-0.0`` and every denormal map to the key of ``+0.0``, NaN to the key of ``-inf``
(``NEG_INF_KEY``, never selected). ``threshold_select`` is the rule itself on a row of
keys (the reference's and ``streaming_topk``'s merge).

Every ``jnp.where`` here takes the array being keyed as its *true* operand and a constant
as its false one. Why: Mosaic GPU's Lane lowering (jax 0.11 and 0.12) gives a select the
signedness of its true operand, and a constant true operand hands it the predicate's,
which is unsigned; every comparison of the key after that is then unsigned, and negative
scores sort above positive ones. ``where(c, 0, bits)`` is what made the Mosaic
``topk_pools`` select wrong tokens on an H200 (2026-12-04) while interpret mode, which runs
jnp's signed semantics, was right. ``tests/test_kernels_mosaic_topk.py`` lowers the kernel
for CUDA and finds no unsigned integer comparison in it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["order_key", "NEG_INF_KEY", "dead_counts", "kth_largest_key", "threshold_select", "row_cumsum"]


def _canonical_bits(scores: jax.Array) -> jax.Array:
    # Each select keeps ``bits`` as its true operand (see the module doc: Mosaic GPU).
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
    mag = bits & jnp.int32(0x7FFFFFFF)
    bits = jnp.where(mag >= jnp.int32(0x00800000), bits, jnp.int32(0))  # -0, denormals -> +0
    return jnp.where(mag <= jnp.int32(0x7F800000), bits, jnp.int32(-8388608))  # NaN -> -inf


def order_key(scores: jax.Array) -> jax.Array:
    """float32 -> int32 whose signed order is the float order, by integer ops only.

    ``-0.0`` and every denormal count as ``+0.0`` and NaN as ``-inf`` (never selected).
    Integer ops make the rule the same on every backend: a float compare would flush
    denormals on some (XLA:CPU) and not on others.
    """
    bits = _canonical_bits(scores)
    return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


NEG_INF_KEY = -2139095041  # order_key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32
_SIGN = 0x80000000  # int32 order <-> uint32 order: flip the sign bit
_EXACT_FLOAT32_COUNT = 1 << 24  # float32 holds every integer up to 2**24 exactly


def kth_largest_key(key: jax.Array, k: int) -> jax.Array:
    """``[..., 1]`` int32: the ``k``-th largest of the keys ``key [..., N]`` (``1 <= k <= N``),
    by a radix select of one bit a pass: the answer is built from the top bit down, a bit
    kept where at least ``k`` keys are at or above the answer with it set (32 counting
    passes over the row, no sort). On a CPU this is several times faster than
    ``lax.top_k`` (a partial sort) at ``k`` in the thousands.

    Each pass counts in float32 where the row is shorter than ``2**24``: every partial sum
    is an integer below ``2**24``, so exact in any order, and XLA:CPU's float32 sum ran
    1.6x faster than its int32 one (``[8, 1, 8704]``, a streaming merge at batch 8: 0.56
    vs 0.92 ms for the 32 passes, measured 2026-12-04)."""
    u = jax.lax.bitcast_convert_type(key, jnp.uint32) ^ jnp.uint32(_SIGN)  # order-preserving
    count_dtype = jnp.float32 if key.shape[-1] < _EXACT_FLOAT32_COUNT else jnp.int32

    def bit(i, ans):
        cand = ans | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
        n_at_or_above = jnp.sum((u >= cand).astype(count_dtype), axis=-1, keepdims=True)
        return jnp.where(n_at_or_above >= k, cand, ans)

    ans = jax.lax.fori_loop(0, 32, bit, jnp.zeros(key.shape[:-1] + (1,), jnp.uint32))
    return jax.lax.bitcast_convert_type(ans ^ jnp.uint32(_SIGN), jnp.int32)


def dead_counts(cand: jax.Array, n_dead: jax.Array) -> jax.Array:
    """The count, for each candidate key ``cand``, of ``n_dead`` unread ``-inf`` pools
    (keys ``NEG_INF_KEY``) at or above it: what the pools past a row's live bound add to a
    counting pass of a radix select, so that the threshold is the one of the whole row with
    them at ``-inf`` (see "Live bound" in ``radix_select``)."""
    return jnp.where(cand <= jnp.int32(NEG_INF_KEY), n_dead, 0)


def row_cumsum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last axis. ``jax.lax.associative_scan``, not
    ``jnp.cumsum``: XLA:CPU runs the scan's log-depth adds about twice as fast as the
    ``reduce_window`` that ``jnp.cumsum`` lowers to (0.25 vs 0.45-0.57 ms over ``[8, 10240]``
    int32, measured); integer adds, so the result is the same."""
    return jax.lax.associative_scan(jnp.add, x, axis=-1)


_PACK_BITS = 16  # two counts of a row shorter than 2**16 share one uint32 prefix sum


def _two_counts(above: jax.Array, at: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(cumsum(above), cumsum(at))`` int32 along the last axis, from one scan where the row
    is shorter than ``2**16``: the tie count rides in the high half of a uint32 and neither
    half can carry into the other."""
    if above.shape[-1] < 1 << _PACK_BITS:
        packed = row_cumsum(above.astype(jnp.uint32) | (at.astype(jnp.uint32) << _PACK_BITS))
        low = packed & jnp.uint32((1 << _PACK_BITS) - 1)
        return low.astype(jnp.int32), (packed >> _PACK_BITS).astype(jnp.int32)
    return row_cumsum(above.astype(jnp.int32)), row_cumsum(at.astype(jnp.int32))


def threshold_select(key: jax.Array, select_k: int) -> jax.Array:
    """``[..., select_k]`` int32 positions of the ``select_k`` best keys of ``key [..., N]``
    by ``topk_pools``' rule, ascending, ``-1`` after the last: every key above ``T`` (the
    ``select_k``-th largest, ``kth_largest_key``), then the lowest positions whose key is
    ``T`` as many as fit (a prefix-sum rank), never a ``NEG_INF_KEY``; a stream compaction
    writes them in position order. No sort. ``1 <= select_k <= N``. The ties' rank and the
    taken keys' rank (and the count above ``T``) come from one prefix sum (``_two_counts``)."""
    n = key.shape[-1]
    threshold = kth_largest_key(key, select_k)
    above = (key > threshold) & (key > NEG_INF_KEY)
    at = key == threshold
    ties_ok = threshold > NEG_INF_KEY  # a -inf threshold: its ties are never selected
    n_above, n_at = _two_counts(above, at)
    room = select_k - n_above[..., -1:]  # the scan's last entry is the row's count
    # The ties taken are the first ``room``: up to position i, ``min(n_at_i, room)`` of them.
    take = above | (at & ties_ok & (n_at <= room))
    rank = n_above + jnp.where(ties_ok, jnp.minimum(n_at, room), 0)  # cumsum(take)
    slot = jnp.where(take, rank - 1, select_k)
    batch = key.shape[:-1]
    rows = take.reshape(-1, n).shape[0]
    out = jnp.full((rows, select_k), -1, jnp.int32)
    out = out.at[jnp.arange(rows)[:, None], slot.reshape(rows, n)].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n)), mode="drop"
    )
    return out.reshape(batch + (select_k,))
