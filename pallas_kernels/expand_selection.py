"""``expand_selection``: selected pools -> the row of token ids attention reads.

Invariants:

* Pool ``p`` expands to tokens ``first_key + p*KP + [0, KP)``; a ``-1`` pool expands to
  nothing.
* The tail (``index_kpool_always_select_tail``): with ``n_vis`` the number of tokens
  visible to the query, the last ``n_vis % KP`` visible tokens (the incomplete pool) are
  appended after the pools. ``visible_tail`` computes them as the reference does:
  ``first_key + n_vis - n_vis % KP + [0, KP - 1)``, each kept only if it is a valid token
  at or before the query.
* Output row, ``out_width`` wide: the expanded pools (ascending, since ``topk_pools`` emits
  ascending pool ids), then the tail, then ``-1`` in every remaining slot: every slot is
  written. A row with no pool and no tail is all ``-1``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_implementation, check_rank

__all__ = ["expand_selection", "expand_selection_reference", "visible_tail", "compact_row"]


def visible_tail(
    first_key: jax.Array,
    n_vis: jax.Array,
    q_pos: jax.Array,
    key_valid: jax.Array,
    kpool: int,
) -> jax.Array:
    """Token ids of the incomplete visible pool.

    Args:
      first_key: ``[B]`` int32.
      n_vis: ``[B, Q]`` int32, valid tokens at or before each query.
      q_pos: ``[B, Q]`` int32 query positions (``-1`` for a padding query: no tail).
      key_valid: ``[B, L]`` bool.
      kpool: tokens per pool.

    Returns:
      ``[B, Q, KP - 1]`` int32 token ids, ``-1`` where empty.
    """
    length = key_valid.shape[-1]
    width = kpool - 1
    count = n_vis % kpool
    start = first_key[:, None] + n_vis - count
    off = jnp.arange(width, dtype=jnp.int32)
    ids = start[..., None] + off
    ok = (off < count[..., None]) & (ids < length) & (ids <= q_pos[..., None])
    safe = jnp.clip(ids, 0, length - 1)
    ok &= jax.vmap(lambda v, i: v[i])(key_valid, safe)
    return jnp.where(ok, ids, -1).astype(jnp.int32)


def compact_row(ids: jax.Array, out_width: int) -> jax.Array:
    """Move the ids ``>= 0`` of each row to its front (order kept), ``-1`` after; pad or
    cut to ``out_width``."""
    n = ids.shape[-1]
    pos = jnp.arange(n, dtype=jnp.int32)
    rank = jnp.where(ids >= 0, pos, n + pos)
    _, ids = jax.lax.sort_key_val(rank, ids, dimension=-1)
    ids = jnp.where(ids >= 0, ids, -1)
    if n < out_width:
        pad = jnp.full(ids.shape[:-1] + (out_width - n,), -1, jnp.int32)
        ids = jnp.concatenate([ids, pad], axis=-1)
    return ids[..., :out_width].astype(jnp.int32)


def expand_selection_reference(
    pool_ids: jax.Array,
    first_key: jax.Array,
    tail: jax.Array | None,
    *,
    kpool: int,
    out_width: int,
) -> jax.Array:
    """``pool_ids [B, Q, K]`` (ascending, ``-1`` after) and ``tail [B, Q, T]`` (or None)
    -> ``[B, Q, out_width]`` int32 token ids."""
    b, nq, k = pool_ids.shape
    tok = first_key[:, None, None, None] + pool_ids[..., None] * kpool + jnp.arange(kpool, dtype=jnp.int32)
    tok = jnp.where(pool_ids[..., None] >= 0, tok, -1).reshape(b, nq, k * kpool)
    if tail is not None:
        tok = jnp.concatenate([tok, tail.astype(jnp.int32)], axis=-1)
    return compact_row(tok, out_width)


def expand_selection(
    pool_ids: jax.Array,
    first_key: jax.Array,
    tail: jax.Array | None,
    *,
    kpool: int,
    out_width: int,
    implementation: str = "xla",
    **block_sizes,
) -> jax.Array:
    """Expand pools to token ids and append the tail; see the module doc."""
    check_implementation(implementation)
    check_rank("pool_ids", pool_ids, 3, "[B, Q, K]")
    b, nq, k = pool_ids.shape
    if first_key.shape != (b,):
        raise ValueError(f"first_key must be [B] = ({b},), got {tuple(first_key.shape)}")
    width = k * kpool + (0 if tail is None else tail.shape[-1])
    if width > out_width:
        raise ValueError(
            f"out_width {out_width} is narrower than K*kpool + tail = {k}*{kpool} + "
            f"{width - k * kpool} = {width}"
        )
    if tail is not None and tail.shape[:2] != (b, nq):
        raise ValueError(f"tail must be [B, Q, T] with B, Q = {(b, nq)}, got {tuple(tail.shape)}")
    if implementation == "xla":
        return expand_selection_reference(pool_ids, first_key, tail, kpool=kpool, out_width=out_width)
    return _expand_selection_pallas(
        pool_ids, first_key, tail, kpool=kpool, out_width=out_width,
        interpret=implementation == "pallas_interpret", **block_sizes,
    )


def _expand_selection_pallas(pool_ids, first_key, tail, *, kpool, out_width, interpret, **block_sizes):
    raise NotImplementedError("the expand_selection Pallas kernel is not written yet")
