"""``sparse_mla``: weight-absorbed MLA attention over the selected latent rows only.

Invariants:

* Queries are already absorbed (``q_lat = q_nope @ W_UK``, ``[B, Q, H, C]`` with ``C =
  kv_lora_rank``) and keys and values are the same latent rows ``latent[b, id]``, so one
  gather of ``W`` rows of width ``C`` serves every head. The output is the latent
  attention output ``[B, Q, H, C]``; ``absorb_o`` applies ``W_UV`` and ``o_proj``.
* ``id < 0`` (and ``id >= L``) is not a token: it is never read and gets no weight.
* A row with no valid id returns zeros: never NaN, never an out-of-bounds read.
* Softmax in float32 with scale ``qk_head_dim**-0.5``; the output has ``q_lat``'s dtype.
* A row must not repeat an id (the selection never does): the dense oracle
  ``topk_to_mask`` counts a repeated id once, the sparse path would weigh it twice.

The dense oracle the seed keeps (``topk_to_mask`` + ``mla_masked_attention``) lives here
too: the same attention computed over every key with a boolean mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_implementation, check_rank

__all__ = ["sparse_mla", "sparse_mla_reference", "topk_to_mask", "mla_masked_attention"]

_HI = jax.lax.Precision.HIGHEST


def masked_softmax(s, valid):
    """Softmax of ``s`` over its last axis where ``valid``; all-invalid rows give zeros."""
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid, jnp.exp(s - m), 0.0)
    denom = p.sum(-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


def sparse_mla_reference(
    q_lat: jax.Array, latent: jax.Array, token_ids: jax.Array, *, scale: float
) -> jax.Array:
    """Plain-jnp sparse attention.

    Args:
      q_lat: ``[B, Q, H, C]`` absorbed queries.
      latent: ``[B, L, C]`` latent cache rows (keys and values at once).
      token_ids: ``[B, Q, W]`` int32 selected token ids, ``-1`` = none.
      scale: softmax scale, ``qk_head_dim**-0.5``.

    Returns:
      ``[B, Q, H, C]`` in ``q_lat.dtype``.
    """
    length = latent.shape[1]
    valid = (token_ids >= 0) & (token_ids < length)
    safe = jnp.clip(token_ids, 0, length - 1)
    kv = jax.vmap(lambda lat, ids: lat[ids])(latent, safe).astype(jnp.float32)  # [B,Q,W,C]
    s = jnp.einsum("bqhc,bqwc->bqhw", q_lat.astype(jnp.float32), kv, precision=_HI) * scale
    p = masked_softmax(s, valid[:, :, None, :])
    o = jnp.einsum("bqhw,bqwc->bqhc", p, kv, precision=_HI)
    return o.astype(q_lat.dtype)


def topk_to_mask(token_ids: jax.Array, length: int) -> jax.Array:
    """``[B, Q, W]`` token ids -> ``[B, Q, L]`` bool mask of the selected keys."""
    valid = (token_ids >= 0) & (token_ids < length)
    hit = (token_ids[..., None] == jnp.arange(length, dtype=token_ids.dtype)) & valid[..., None]
    return hit.any(-2)


def mla_masked_attention(
    q_lat: jax.Array, latent: jax.Array, mask: jax.Array, *, scale: float
) -> jax.Array:
    """The dense oracle: absorbed MLA over all ``L`` keys, restricted by ``mask [B, Q, L]``."""
    lat = latent.astype(jnp.float32)
    s = jnp.einsum("bqhc,blc->bqhl", q_lat.astype(jnp.float32), lat, precision=_HI) * scale
    p = masked_softmax(s, mask[:, :, None, :])
    o = jnp.einsum("bqhl,blc->bqhc", p, lat, precision=_HI)
    return o.astype(q_lat.dtype)


def sparse_mla(
    q_lat: jax.Array,
    latent: jax.Array,
    token_ids: jax.Array,
    *,
    scale: float,
    implementation: str = "xla",
    **block_sizes,
) -> jax.Array:
    """Sparse absorbed MLA; see the module doc. Shapes as ``sparse_mla_reference``."""
    check_implementation(implementation)
    check_rank("q_lat", q_lat, 4, "[B, Q, H, C]")
    check_rank("latent", latent, 3, "[B, L, C]")
    check_rank("token_ids", token_ids, 3, "[B, Q, W]")
    b, nq, _, c = q_lat.shape
    if latent.shape[0] != b or latent.shape[2] != c:
        raise ValueError(f"latent must be [B={b}, L, C={c}], got {tuple(latent.shape)}")
    if token_ids.shape[:2] != (b, nq):
        raise ValueError(f"token_ids must be [B={b}, Q={nq}, W], got {tuple(token_ids.shape)}")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be integer, got {token_ids.dtype}")
    if implementation == "xla":
        return sparse_mla_reference(q_lat, latent, token_ids, scale=scale)
    return _sparse_mla_pallas(
        q_lat, latent, token_ids, scale=scale,
        interpret=implementation == "pallas_interpret", **block_sizes,
    )


def _sparse_mla_pallas(q_lat, latent, token_ids, *, scale, interpret, **block_sizes):
    raise NotImplementedError("the sparse_mla Pallas kernel is not written yet")
