"""The dense oracle of ``sparse_mla``: absorbed MLA over every key of the cache, restricted by
a boolean mask, as Hugging Face's references compute attention (an additive mask over all
keys, then a softmax).

Axis letters as in the package glossary (``pallas_kernels``; ``CR``: the width of a latent
row, ``V``: its leading value columns, see ``pallas_kernels.attention``). Invariants:

* ``topk_to_mask`` turns a row of selected ``token_ids`` into the ``[B, Q, L]`` mask of the
  keys it names: ``-1`` and ids ``>= L`` name none, a repeated id counts once.
* ``mla_masked_attention`` scores a query ``[B, Q, H, CR]`` against whole rows ``[B, L,
  CR]`` and takes the first ``V = value_width`` columns of each row as its value, exactly
  the split ``sparse_mla`` computes (with RoPE: ``q_lat . c + q_rot . k_rot`` over ``[c,
  k_rot]`` rows, values ``c``), so the two agree to float rounding on any row set.
* Softmax in float32; a query with no masked-in key gets zeros, never NaN
  (``masked_softmax``, which ``sparse_mla_reference`` shares).
* ``combine_splits`` merges flash-decoding split partials ``(acc, max, sum)`` the same way
  for both ``sparse_mla`` kernels (Triton, ``attention``; Mosaic, ``mosaic_attention``): a
  split with no valid id adds nothing, a row with none is exactly 0.

Its attention is ``O(L)`` per query: for tests, demos and benchmarks' baselines, never the
layer's path. The softmax arithmetic it shares (``masked_softmax``, ``combine_splits``) and
``check_value_width`` are on that path; they live here, in no kernel's module, so that
neither attention kernel imports the other for a helper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["topk_to_mask", "mla_masked_attention", "masked_softmax", "check_value_width",
           "combine_splits"]

_HI = jax.lax.Precision.HIGHEST


def check_value_width(value_width: int | None, row_width: int) -> int:
    """``V``: ``value_width`` checked against a latent row of ``CR = row_width`` columns
    (``None``: the whole row). A ``ValueError`` unless ``1 <= value_width <= CR``."""
    if value_width is None:
        return row_width
    if (not isinstance(value_width, int) or isinstance(value_width, bool)
            or not 1 <= value_width <= row_width):
        raise ValueError(
            f"value_width must be an int in [1, CR={row_width}] (the leading value columns "
            f"of a latent row), or None for all of them; got {value_width!r}"
        )
    return value_width


def masked_softmax(s, valid):
    """Softmax of ``s`` over its last axis where ``valid``; all-invalid rows give zeros."""
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid, jnp.exp(s - m), 0.0)
    denom = p.sum(-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


def topk_to_mask(token_ids: jax.Array, length: int) -> jax.Array:
    """``[B, Q, W]`` token ids -> ``[B, Q, L]`` bool mask of the selected keys."""
    valid = (token_ids >= 0) & (token_ids < length)
    hit = (token_ids[..., None] == jnp.arange(length, dtype=token_ids.dtype)) & valid[..., None]
    return hit.any(-2)


def mla_masked_attention(
    q: jax.Array, latent: jax.Array, mask: jax.Array, *, scale: float,
    value_width: int | None = None,
) -> jax.Array:
    """Absorbed MLA of ``q [B, Q, H, CR]`` over all ``L`` rows of ``latent [B, L, CR]``,
    restricted by ``mask [B, Q, L]``; values are the first ``value_width`` columns (default
    all ``CR``). Returns ``[B, Q, H, V]`` in ``q.dtype``."""
    v = check_value_width(value_width, latent.shape[-1])
    lat = latent.astype(jnp.float32)
    s = jnp.einsum("bqhc,blc->bqhl", q.astype(jnp.float32), lat, precision=_HI) * scale
    p = masked_softmax(s, mask[:, :, None, :])
    o = jnp.einsum("bqhl,blc->bqhc", p, lat[..., :v], precision=_HI)
    return o.astype(q.dtype)


def combine_splits(acc, m, l, *, return_lse: bool = False):
    """Merge per-split partials ``acc [..., S, H, V]``, ``m, l [..., S, H]`` (f32, ``S``
    splits, unnormalised) into ``[..., H, V]``; 0 where every split is empty. With
    ``return_lse``: ``(out, lse [..., H])``, the log-sum-exp of the scores over every split
    (``-inf`` where every split is empty), the attention backward's residual."""
    m_all = jnp.max(m, axis=-2, keepdims=True)
    m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.exp(m - m_all)  # 0 for an empty split (m = -inf)
    denom = jnp.sum(w * l, axis=-2)
    num = jnp.sum(w[..., None] * acc, axis=-3)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = num / safe[..., None]
    if not return_lse:
        return out
    return out, jnp.where(denom > 0, m_all[..., 0, :] + jnp.log(safe), -jnp.inf)
