"""``kpool_compress``: pool the indexer keys of every ``index_kpool`` consecutive tokens.

Invariants:

* Pools start at ``first_key``, the first valid token of the row (``L`` when the row has
  none). Pool ``p`` covers tokens ``first_key + p*KP + [0, KP)``.
* A pool is valid only if every slot is a valid token inside the row: a trailing partial
  pool is not a pool. Invalid pools have a pooled key of exactly 0.
* ``pooled[p, c] = sum_s softmax_s(gate[slot s, c] + ape[s, c]) * keys[slot s, c]``: the
  softmax runs over the slot axis, per channel, in float32; the probabilities are cast to
  the key dtype (as the reference does), the weighted sum accumulates in float32 and is
  stored in the key dtype.
* ``P = max(1, L // KP)`` pools are emitted, the most a row of ``L`` tokens can hold, so
  shapes are static; ``P`` is never 0 so that kernels never see an empty axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_implementation, check_rank

__all__ = ["kpool_compress", "kpool_compress_reference", "first_valid", "num_pools"]


def num_pools(length: int, kpool: int) -> int:
    """Static pool count for a row of ``length`` tokens: ``max(1, length // kpool)``."""
    return max(1, length // kpool)


def first_valid(key_valid: jax.Array) -> jax.Array:
    """``[B, L] bool -> [B] int32``: index of the first valid token, ``L`` if none."""
    length = key_valid.shape[-1]
    return jnp.where(
        key_valid.any(-1), jnp.argmax(key_valid, axis=-1), length
    ).astype(jnp.int32)


def kpool_compress_reference(
    keys: jax.Array,
    gate: jax.Array,
    key_valid: jax.Array,
    ape: jax.Array,
    first_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-jnp pooling.

    Args:
      keys: ``[B, L, D]`` normalised indexer keys (any float dtype).
      gate: ``[B, L, D]`` gate logits ``x @ index_kpool_compress_gate.T``.
      key_valid: ``[B, L]`` bool, False for padding.
      ape: ``[KP, D]`` the per-slot bias ``index_kpool_compress_ape``.
      first_key: optional ``[B]`` int32 start of pool 0 (default: ``first_valid(key_valid)``).
        The decode cache pools a window of the timeline whose pool grid is fixed by a
        ``first_key`` that may lie before the window, so it passes the aligned start.

    Returns:
      ``pooled [B, P, D]`` (keys' dtype), ``first_key [B]`` int32, ``pool_valid [B, P]`` bool.
    """
    b, length, d = keys.shape
    kpool = ape.shape[0]
    n_pools = num_pools(length, kpool)
    if first_key is None:
        first_key = first_valid(key_valid)
    slots = first_key[:, None, None] + jnp.arange(n_pools * kpool, dtype=jnp.int32).reshape(
        1, n_pools, kpool
    )
    in_row = slots < length
    safe = jnp.clip(slots, 0, length - 1)
    take = jax.vmap(lambda a, i: a[i])
    slot_valid = take(key_valid, safe) & in_row  # [B, P, KP]
    pool_valid = slot_valid.all(-1)
    logits = take(gate, safe).astype(jnp.float32) + ape.astype(jnp.float32)[None, None]
    logits = jnp.where(slot_valid[..., None], logits, -jnp.inf)
    m = jnp.max(logits, axis=2, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    probs = (e / jnp.maximum(e.sum(axis=2, keepdims=True), 1e-30)).astype(keys.dtype)
    pooled = jnp.sum(
        probs.astype(jnp.float32) * take(keys, safe).astype(jnp.float32), axis=2
    )
    pooled = jnp.where(pool_valid[..., None], pooled, 0.0).astype(keys.dtype)
    return pooled, first_key, pool_valid


def kpool_compress(
    keys: jax.Array,
    gate: jax.Array,
    key_valid: jax.Array,
    ape: jax.Array,
    first_key: jax.Array | None = None,
    *,
    implementation: str = "xla",
    **block_sizes,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pool the indexer keys; see the module doc. Shapes as ``kpool_compress_reference``."""
    check_implementation(implementation)
    check_rank("keys", keys, 3, "[B, L, D]")
    if gate.shape != keys.shape:
        raise ValueError(f"gate must match keys {tuple(keys.shape)}, got {tuple(gate.shape)}")
    if key_valid.shape != keys.shape[:2]:
        raise ValueError(f"key_valid must be [B, L] = {tuple(keys.shape[:2])}, got {tuple(key_valid.shape)}")
    if ape.ndim != 2 or ape.shape[1] != keys.shape[2]:
        raise ValueError(f"ape must be [KP, D={keys.shape[2]}], got {tuple(ape.shape)}")
    if first_key is not None and first_key.shape != keys.shape[:1]:
        raise ValueError(f"first_key must be [B] = ({keys.shape[0]},), got {tuple(first_key.shape)}")
    if implementation == "xla":
        return kpool_compress_reference(keys, gate, key_valid, ape, first_key)
    return _kpool_compress_pallas(
        keys, gate, key_valid, ape, interpret=implementation == "pallas_interpret", **block_sizes
    )


def _kpool_compress_pallas(keys, gate, key_valid, ape, *, interpret: bool, **block_sizes):
    raise NotImplementedError("the kpool_compress Pallas kernel is not written yet")
