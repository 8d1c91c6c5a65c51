"""``causal_mla``: absorbed MLA over every visible key, the attention of ``attention="dense"``
(the module is not named after it: a module defines no function of its own name, so the
package's re-export ``pallas_kernels.causal_mla`` shadows nothing).

DeepSeek-V3.2's indexer warm-up trains with the *dense* attention (every token a query sees)
and the same parameters as the sparse one. This is that attention, in the contract of
``sparse_mla`` (``pallas_kernels.attention``: rows as keys and values, ``q [B, Q, H, CR]``,
the first ``V = value_width`` columns of a row its value, fp8 rows with a scale each), with
the key set given by a causal rule instead of ``token_ids``. Axis letters as in the package
glossary. Invariants:

* Query ``t`` of row ``b`` sees slot ``l`` iff ``l <= q_slots[b, t]`` and ``key_valid[b,
  l]`` (``causal_visible``); ``q_slots = -1`` is a padding query: it sees nothing and gets
  zeros. ``latent`` is one row per sequence, ``[B, L, CR]`` (a paged cache's shared pool
  is refused by the layer before it gets here).
* The result equals ``sparse_mla`` over the visible slots as ids and ``mla_masked_attention``
  with the visible mask, to float rounding, under every implementation.
* A row no query of the call sees is never used arithmetically: a NaN or inf there changes
  nothing, forward or backward.
* Differentiable w.r.t. ``q`` and ``latent`` (not an fp8 ``latent``, not ``latent_scale``:
  a serving format, as in ``sparse_mla``).

Implementations: ``"xla"`` is an online softmax over key tiles of ``key_tile`` slots
(``lax.scan`` with a ``jax.checkpoint``-ed step, differentiated by autodiff): the forward
holds ``[B, Q, H, key_tile]`` scores at a time, never ``[B, Q, H, L]``, and the backward
recomputes a tile's scores from the carries. The Pallas ones (``"pallas"``,
``"mosaic"``, their interpret modes; ``"auto"`` is resolved first) call ``sparse_mla`` with
the visible slots as ids, ``[B, Q, L]`` int32 in slot order with ``-1`` at the others (both
kernels read exactly the valid ids of any layout and stop after the row's last one, so a
query's work follows its own slot), so the Pallas forward *and* backward kernels run; the
caller tiles the queries to bound the ids. ``causal_mla_reference`` is the plain
``[B, Q, H, L]`` computation the tests compare against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import Implementation, check_positive_int, check_rank, resolve_implementation
from pallas_kernels._dtypes import check_key_scale
from pallas_kernels._mla import accumulation_dtype
from pallas_kernels.attention import sparse_mla
from pallas_kernels.dense_mla import check_value_width, masked_softmax

__all__ = ["causal_mla", "causal_mla_reference", "causal_visible"]

_HI = lax.Precision.HIGHEST


def _check(q, latent, q_slots, key_valid, latent_scale) -> None:
    check_rank("q", q, 4, "[B, Q, H, CR]")
    check_rank("latent", latent, 3, "[B, L, CR]")
    b, nq, _, cr = q.shape
    if latent.shape[0] != b or latent.shape[2] != cr:
        raise ValueError(f"latent must be [B={b}, L, CR={cr}] (one row per sequence, as wide as q), "
                         f"got {tuple(latent.shape)}")
    if tuple(q_slots.shape) != (b, nq) or not jnp.issubdtype(q_slots.dtype, jnp.integer):
        raise ValueError(f"q_slots must be integer [B, Q] = {(b, nq)}, got {q_slots.dtype}{tuple(q_slots.shape)}")
    if tuple(key_valid.shape) != (b, latent.shape[1]) or key_valid.dtype != jnp.bool_:
        raise ValueError(f"key_valid must be bool [B, L] = {(b, latent.shape[1])}, "
                         f"got {key_valid.dtype}{tuple(key_valid.shape)}")
    check_key_scale("latent", latent, "latent_scale", latent_scale, "[B, L]")


def causal_visible(q_slots: jax.Array, key_valid: jax.Array) -> jax.Array:
    """``[B, Q, L]`` bool: query ``t`` sees slot ``l`` (``l <= q_slots[b, t]`` and
    ``key_valid[b, l]``); a padding query (``q_slots < 0``) sees nothing."""
    slots = jnp.arange(key_valid.shape[1], dtype=jnp.int32)
    return key_valid[:, None, :] & (slots <= q_slots.astype(jnp.int32)[..., None])


def causal_mla_reference(
    q: jax.Array, latent: jax.Array, q_slots: jax.Array, key_valid: jax.Array,
    latent_scale: jax.Array | None = None, *, scale: float, value_width: int | None = None,
) -> jax.Array:
    """Plain-jnp ``causal_mla``: every score ``[B, Q, H, L]`` at once. Shapes as
    ``causal_mla``."""
    _check(q, latent, q_slots, key_valid, latent_scale)
    v = check_value_width(value_width, q.shape[3])
    f = accumulation_dtype(q, latent)
    vis = causal_visible(q_slots, key_valid)
    used = vis.any(1)  # [B, L]: rows some query sees; the others are zeroed, never read
    rows = jnp.where(used[..., None], _float_rows(latent, f), 0.0)
    s = jnp.einsum("bqhc,blc->bqhl", q.astype(f), rows, precision=_HI)
    if latent_scale is not None:
        row_scale = jnp.where(used, lax.stop_gradient(latent_scale).astype(f), 0.0)[:, None, None, :]
        s = s * row_scale
    p = masked_softmax(s * scale, vis[:, :, None, :])
    if latent_scale is not None:
        p = p * row_scale
    return jnp.einsum("bqhl,blc->bqhc", p, rows[..., :v], precision=_HI).astype(q.dtype)


def _float_rows(latent, f):
    """``latent`` in the accumulation dtype ``f``; an fp8 ``latent`` gets no gradient."""
    if latent.dtype.itemsize == 1:
        latent = lax.stop_gradient(latent)
    return latent.astype(f)


def causal_mla(
    q: jax.Array, latent: jax.Array, q_slots: jax.Array, key_valid: jax.Array,
    latent_scale: jax.Array | None = None, *, scale: float, value_width: int | None = None,
    implementation: Implementation = "xla", key_tile: int = 512,
) -> jax.Array:
    """Absorbed MLA of every query over every slot it sees (module doc).

    Args:
      q: ``[B, Q, H, CR]`` absorbed queries, as ``sparse_mla`` takes them.
      latent: ``[B, L, CR]`` cache rows (e4m3 with ``latent_scale`` for an fp8 cache).
      q_slots: ``[B, Q]`` int: each query's own slot (``-1``: a padding query, zeros).
      key_valid: ``[B, L]`` bool: slots holding a token.
      latent_scale: ``[B, L]`` float32 row scales of an fp8 ``latent``, else None.
      scale: the softmax scale (``sparse_mla``'s).
      value_width: ``V``, the leading value columns of a row (``None``: all ``CR``).
      implementation: ``"xla"`` (tiled online softmax) or a Pallas one (``sparse_mla``
        over the visible slots); ``"auto"`` as the package resolves it.
      key_tile: slots per tile of the ``"xla"`` scan (an int >= 1; unused otherwise).

    Returns:
      ``[B, Q, H, V]`` in ``q``'s dtype.
    """
    _check(q, latent, q_slots, key_valid, latent_scale)
    v = check_value_width(value_width, q.shape[3])
    check_positive_int("key_tile", key_tile)
    implementation = resolve_implementation(implementation)
    if implementation != "xla":
        vis = causal_visible(q_slots, key_valid)
        ids = jnp.where(vis, jnp.arange(latent.shape[1], dtype=jnp.int32), -1)
        # Rows no query sees are zeroed: the kernels never read an unnamed row forward, but
        # the latent gradient's row blocks load every row of a block some query touches.
        rows = jnp.where(vis.any(1)[..., None], latent, jnp.zeros((), latent.dtype))
        return sparse_mla(q, rows, ids, latent_scale, scale=scale, value_width=v,
                          implementation=implementation)
    return _causal_scan(q, latent, q_slots.astype(jnp.int32), key_valid, latent_scale,
                        scale=scale, value_width=v, key_tile=key_tile)


def _causal_scan(q, latent, q_slots, key_valid, latent_scale, *, scale, value_width, key_tile):
    """``"xla"``: an online softmax over tiles of ``min(key_tile, L)`` slots."""
    b, nq, h, _ = q.shape
    length = latent.shape[1]
    if b * nq * h == 0 or length == 0:
        return jnp.zeros((b, nq, h, value_width), q.dtype)
    f = accumulation_dtype(q, latent)
    tile = min(key_tile, length)
    qf = q.astype(f)
    last_query = q_slots.max(1)  # [B]: a row past every query's slot is never read
    offsets = jnp.arange(tile, dtype=jnp.int32)
    scales = None if latent_scale is None else lax.stop_gradient(latent_scale).astype(f)

    @jax.checkpoint  # the backward recomputes a tile's scores: no [B, Q, H, L] residual
    def step(carry, start):
        slots = start + offsets
        safe = jnp.minimum(slots, length - 1)
        used = (slots < length)[None, :] & key_valid[:, safe] & (slots[None, :] <= last_query[:, None])
        rows = jnp.where(used[..., None], _float_rows(jnp.take(latent, safe, axis=1), f), 0.0)
        s = jnp.einsum("bqhc,btc->bqht", qf, rows, precision=_HI)
        if scales is not None:  # sparse_mla's order: (q . row8) * s_row * scale
            row_scale = jnp.where(used, scales[:, safe], 0.0)[:, None, None, :]
            s = s * row_scale
        vis = (used[:, None, :] & (slots <= q_slots[..., None]))[:, :, None, :]  # [B, Q, 1, T]
        s = jnp.where(vis, s * scale, -jnp.inf)
        # The running max only steadies the exponentials; the result does not depend on it.
        m_tile = lax.stop_gradient(s.max(-1))
        m_new = m_tile if carry is None else jnp.maximum(carry[0], m_tile)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
        pv = p if scales is None else p * row_scale
        acc = jnp.einsum("bqht,btc->bqhc", pv, rows[..., :value_width], precision=_HI)
        l = p.sum(-1)
        if carry is not None:  # rescale the previous tiles' sums to the new max
            alpha = jnp.exp(carry[0] - m_safe)
            l = l + carry[1] * alpha
            acc = acc + carry[2] * alpha[..., None]
        return (m_new, l, acc), None

    # The first tile starts the carry (so it has q's type, varying over a shard_map's axes).
    carry0, _ = step(None, jnp.int32(0))
    (_, l, acc), _ = lax.scan(step, carry0, jnp.arange(tile, length, tile, dtype=jnp.int32))
    return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(q.dtype)
