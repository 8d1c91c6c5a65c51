"""The order key: float32 scores as int32 keys whose signed order is the float order.

``topk_pools`` defines its tie rule on these keys, so every implementation of it shares
them: the reference (``selection``), the Triton kernels (``radix_select``), the Mosaic
kernel (``mosaic_selection``) and ``streaming_topk`` (``streaming_selection``). They live
here, apart from any kernel, so that no kernel module imports another one for a helper.

Invariants: the key is computed by integer ops on the float's bits only, so no float
compare and no platform denormal mode (XLA:CPU flushes denormals, GPUs need not) enters
it; ``-0.0`` and every denormal map to the key of ``+0.0``, NaN to the key of ``-inf``
(``NEG_INF_KEY``, never selected).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["order_key", "canonical_scores", "NEG_INF_KEY", "dead_counts"]


def _canonical_bits(scores: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
    mag = bits & jnp.int32(0x7FFFFFFF)
    bits = jnp.where(mag < jnp.int32(0x00800000), jnp.int32(0), bits)  # -0, denormals -> +0
    return jnp.where(mag > jnp.int32(0x7F800000), jnp.int32(-8388608), bits)  # NaN -> -inf


def order_key(scores: jax.Array) -> jax.Array:
    """float32 -> int32 whose signed order is the float order, by integer ops only.

    ``-0.0`` and every denormal count as ``+0.0`` and NaN as ``-inf`` (never selected).
    Integer ops make the rule the same on every backend: a float compare would flush
    denormals on some (XLA:CPU) and not on others.
    """
    bits = _canonical_bits(scores)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def canonical_scores(scores: jax.Array) -> jax.Array:
    """The scores with ``-0``/denormals made ``+0`` and NaN made ``-inf``: floats whose
    order is exactly ``order_key``'s, so a float ``top_k`` finds the same threshold."""
    return jax.lax.bitcast_convert_type(_canonical_bits(scores), jnp.float32)


NEG_INF_KEY = -2139095041  # order_key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32


def dead_counts(cand: jax.Array, n_dead: jax.Array) -> jax.Array:
    """The count, for each candidate key ``cand``, of ``n_dead`` unread ``-inf`` pools
    (keys ``NEG_INF_KEY``) at or above it: what the pools past a row's live bound add to a
    counting pass of a radix select, so that the threshold is the one of the whole row with
    them at ``-inf`` (see "Live bound" in ``radix_select``)."""
    return jnp.where(cand <= jnp.int32(NEG_INF_KEY), n_dead, 0)
