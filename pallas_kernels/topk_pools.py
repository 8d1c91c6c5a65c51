"""``topk_pools``: the ``select_k`` best pools of every query row, by an explicit rule.

The tie rule (the same for every implementation and every TP size):

* Pools are ranked by score, higher first; among exactly equal scores the **lower pool
  index wins**. ``-0.0`` and ``+0.0`` are one score (``index_scores`` canonicalises).
* A ``-inf`` score (not a candidate, see ``index_scores``) is never selected: its slot
  is ``-1``.
* The row lists the selected pool ids in **ascending pool order**, then ``-1`` for every
  slot not filled. (The reference implementation's own order is by score; only the set is
  compared, and an ascending row makes the expanded token ids ascending too, which is what
  a sparse attention kernel wants to read.)

Equivalently: the selected set is ``{p : key(p) > T} ∪ {the lowest-indexed pools with
key(p) == T, as many as fit}``, where ``key`` is the order-preserving int32 image of the
float score and ``T`` the ``select_k``-th largest key. That is the form a radix select
computes without sorting; the reference below uses ``lax.sort`` on ``(key desc, index)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_implementation, check_rank

__all__ = ["topk_pools", "topk_pools_reference", "order_key"]


def order_key(scores: jax.Array) -> jax.Array:
    """float32 -> int32 whose signed order is the float order (``-0.0`` -> ``+0.0``).

    NaN is mapped to the key of ``-inf`` so it can never be selected.
    """
    s = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    s = jnp.where(s == 0.0, 0.0, s).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


NEG_INF_KEY = -2139095041  # order_key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32


def topk_pools_reference(scores: jax.Array, select_k: int) -> jax.Array:
    """``[..., P]`` float32 scores -> ``[..., select_k]`` int32 pool ids (see module doc)."""
    n_pools = scores.shape[-1]
    if not 0 <= select_k <= n_pools:
        raise ValueError(f"select_k must be in [0, P={n_pools}], got {select_k}")
    key = order_key(scores)
    idx = jnp.broadcast_to(jnp.arange(n_pools, dtype=jnp.int32), key.shape)
    # ~key reverses the order without overflow; sorting (~key, idx) ascending ranks by
    # score descending, then pool index ascending.
    _, order = jax.lax.sort((~key, idx), dimension=-1, num_keys=2)
    picked = order[..., :select_k]
    picked_key = jnp.take_along_axis(key, picked, axis=-1)
    picked = jnp.where(picked_key > NEG_INF_KEY, picked, n_pools)
    picked = jnp.sort(picked, axis=-1)
    return jnp.where(picked < n_pools, picked, -1).astype(jnp.int32)


def topk_pools(
    scores: jax.Array, select_k: int, *, implementation: str = "xla", **block_sizes
) -> jax.Array:
    """Top-``select_k`` pools of each row of ``scores [B, Q, P]`` -> ``[B, Q, select_k]`` int32."""
    check_implementation(implementation)
    check_rank("scores", scores, 3, "[B, Q, P]")
    if scores.dtype != jnp.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    if not isinstance(select_k, int) or not 0 <= select_k <= scores.shape[-1]:
        raise ValueError(f"select_k must be an int in [0, P={scores.shape[-1]}], got {select_k!r}")
    if implementation == "xla":
        return topk_pools_reference(scores, select_k)
    return _topk_pools_pallas(
        scores, select_k, interpret=implementation == "pallas_interpret", **block_sizes
    )


def _topk_pools_pallas(scores, select_k, *, interpret, **block_sizes):
    raise NotImplementedError("the topk_pools Pallas kernel is not written yet")
