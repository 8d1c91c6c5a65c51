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
(``lax.scan``) with the matching tiled backward (a ``jax.custom_vjp``, see the comment
above ``_tile``): the forward and the backward hold ``[B, Q, H, key_tile]`` scores at a
time, never ``[B, Q, H, L]``, and the forward saves only the output and its log-sum-exp.
The Pallas ones (``"pallas"``, ``"mosaic"``, their interpret modes; ``"auto"`` is
resolved first) call ``sparse_mla`` with
the visible slots as ids, ``[B, Q, L]`` int32 in slot order with ``-1`` at the others (both
kernels read exactly the valid ids of any layout and stop after the row's last one, so a
query's work follows its own slot), so the Pallas forward *and* backward kernels run; the
caller tiles the queries to bound the ids. ``causal_mla_reference`` is the plain
``[B, Q, H, L]`` computation the tests compare against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (
    Implementation, check_positive_int, check_rank, eager_jit, resolve_implementation,
)
from pallas_kernels._dtypes import check_key_scale
from pallas_kernels._mla import accumulation_dtype, check_group_scales, column_scales, one_scale_a_row
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
    if latent_scale is not None and latent_scale.ndim == 3:  # group scales [B, L, G]
        check_key_scale("latent", latent, "latent_scale", latent_scale[..., 0], "[B, L, G]")
    else:
        check_key_scale("latent", latent, "latent_scale", latent_scale, "[B, L]")


def _group_dequantised(rows, latent_scale, used, value_width, f):
    """``(rows, latent_scale)`` with group scales (``[B, L, G]``, ``G > 1``) folded into
    ``rows [B, T, CR]`` (those of slots ``used [B, T]``, already taken) and ``None`` for the
    scale; a row scale (or None) passes through."""
    if latent_scale is None or latent_scale.ndim == 2:
        return rows, latent_scale
    cols = column_scales(lax.stop_gradient(latent_scale).astype(f), rows.shape[2], value_width)
    return rows * jnp.where(used[..., None], cols, 0.0), None


def causal_visible(q_slots: jax.Array, key_valid: jax.Array, slots: jax.Array | None = None) -> jax.Array:
    """``[B, Q, T]`` bool: query ``t`` sees key ``l`` (``slots[l] <= q_slots[b, t]`` and
    ``key_valid[b, l]``); a padding query (``q_slots < 0``) sees nothing. ``key_valid [B,
    T]`` says which of the keys at ``slots`` (``[T]`` or ``[B, T]`` int; default: slots
    ``0 .. T - 1``, a whole row) hold a token. The one home of the dense attention's key
    rule (``glm5_dsa_jax.model.attention_mass`` applies it tile by tile too)."""
    if slots is None:
        slots = jnp.arange(key_valid.shape[1], dtype=jnp.int32)
    slots = jnp.broadcast_to(slots, key_valid.shape)
    return key_valid[:, None, :] & (slots[:, None, :] <= q_slots.astype(jnp.int32)[..., None])


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
    rows, latent_scale = _group_dequantised(rows, one_scale_a_row(latent_scale), used, v, f)
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
      latent_scale: ``[B, L]`` float32 row scales of an fp8 ``latent`` (or group scales
        ``[B, L, G]``, read as ``sparse_mla`` reads them), else None.
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
    implementation = resolve_implementation(implementation, "sparse_mla")
    # The Pallas path is sparse_mla's kernels, which read group scales.
    latent_scale = check_group_scales(latent_scale, q.shape[3], v, implementation, kernels_read=True)
    if implementation != "xla":
        vis = causal_visible(q_slots, key_valid)
        ids = jnp.where(vis, jnp.arange(latent.shape[1], dtype=jnp.int32), -1)
        # Rows no query sees are zeroed: the kernels never read an unnamed row forward, but
        # the latent gradient's row blocks load every row of a block some query touches.
        rows = jnp.where(vis.any(1)[..., None], latent, jnp.zeros((), latent.dtype))
        return sparse_mla(q, rows, ids, latent_scale, scale=scale, value_width=v,
                          implementation=implementation)
    b, nq, h, _ = q.shape
    if b * nq * h == 0 or latent.shape[1] == 0:
        return jnp.zeros((b, nq, h, v), q.dtype)
    if isinstance(scale, jax.core.Tracer):  # a traced scale: autodiff of the reference
        return causal_mla_reference(q, latent, q_slots, key_valid, latent_scale, scale=scale, value_width=v)
    return _causal_xla_eager(q, latent, q_slots.astype(jnp.int32), key_valid, latent_scale, scale=float(scale),
                             value_width=v, tile=min(key_tile, latent.shape[1]))


# ------------------------------------------------------------------------------ "xla"
# A flash-attention pair over key tiles of ``tile`` slots (tile ``i``: slots ``i*tile ...
# + tile - 1``, the last one cut at ``L``). The forward is an online softmax carrying the
# running max, sum and value accumulator ``[B, Q, H, V]``; it saves ``q``, ``latent``, the
# output and its log-sum-exp ``lse [B, Q, H]``, nothing per slot. The backward recomputes a
# tile's probabilities ``p = exp(z - lse)`` and, with ``D = d_out . out``: ``dz = p (d_out .
# v_row * s_row - D)``, ``dq += scale * dz * s_row @ row``, ``drow = scale * (dz * s_row)^T
# q + (p * s_row)^T d_out`` (value columns), tile by tile, so both directions hold ``[B, Q,
# H, tile]`` at most. ``s_row`` is an fp8 row's scale (1 for a float row). A jax.custom_vjp
# rather than autodiff of the scan: autodiff would save ``[B, Q, H, V]`` (or the
# probabilities) per tile, ``O(L)`` per query and head.


def _tile(q, latent, q_slots, key_valid, latent_scale, scale, start, tile, value_width):
    """Tile ``start .. start + tile - 1``: ``(rows [B, T, CR], row_scale [B, 1, 1, T] or
    None, vis [B, Q, 1, T], z [B, Q, H, T])``, rows no query sees zeroed, ``z`` the scaled
    scores (``-inf`` where not visible), all in the accumulation dtype."""
    length = latent.shape[1]
    f = accumulation_dtype(q, latent)
    slots = start + jnp.arange(tile, dtype=jnp.int32)
    safe = jnp.minimum(slots, length - 1)
    last_query = q_slots.max(1)  # [B]: a row past every query's slot is never read
    used = (slots < length)[None, :] & key_valid[:, safe] & (slots[None, :] <= last_query[:, None])
    rows = jnp.where(used[..., None], _float_rows(jnp.take(latent, safe, axis=1), f), 0.0)
    if latent_scale is not None and latent_scale.ndim == 3:  # group scales: dequantised rows
        rows, latent_scale = _group_dequantised(rows, jnp.take(latent_scale, safe, axis=1), used,
                                                value_width, f)
    z = jnp.einsum("bqhc,btc->bqht", q.astype(f), rows, precision=_HI)
    row_scale = None
    if latent_scale is not None:  # sparse_mla's order: (q . row8) * s_row * scale
        row_scale = jnp.where(used, lax.stop_gradient(latent_scale).astype(f)[:, safe], 0.0)[:, None, None, :]
        z = z * row_scale
    vis = causal_visible(q_slots, used, slots)[:, :, None, :]
    return rows, row_scale, vis, jnp.where(vis, z * scale, -jnp.inf)


def _over_tiles(step, length, tile):
    """``lax.scan`` of ``step(carry, start)`` over the tiles, the first one peeled to start
    the carry (so the carry has the operands' type, varying over a ``shard_map``'s axes):
    ``(carry, ys stacked [n_tiles, ...])``."""
    carry, y0 = step(None, jnp.int32(0))
    carry, ys = lax.scan(step, carry, jnp.arange(tile, length, tile, dtype=jnp.int32))
    return carry, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), y0, ys)


def _forward(q, latent, q_slots, key_valid, latent_scale, scale, value_width, tile):
    """``(out [B, Q, H, V] in q's dtype, lse [B, Q, H])``, ``lse = -inf`` where no key."""

    def step(carry, start):
        rows, row_scale, vis, z = _tile(q, latent, q_slots, key_valid, latent_scale, scale, start, tile, value_width)
        m_new = z.max(-1) if carry is None else jnp.maximum(carry[0], z.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(vis, jnp.exp(z - m_safe[..., None]), 0.0)
        pv = p if row_scale is None else p * row_scale
        acc = jnp.einsum("bqht,btc->bqhc", pv, rows[..., :value_width], precision=_HI)
        l = p.sum(-1)
        if carry is not None:  # the previous tiles' sums, rescaled to the new max
            alpha = jnp.exp(carry[0] - m_safe)
            l = l + carry[1] * alpha
            acc = acc + carry[2] * alpha[..., None]
        return (m_new, l, acc), None

    (m, l, acc), _ = _over_tiles(step, latent.shape[1], tile)
    safe = jnp.where(l > 0, l, 1.0)
    return (acc / safe[..., None]).astype(q.dtype), jnp.where(l > 0, m + jnp.log(safe), -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _causal_xla(q, latent, q_slots, key_valid, latent_scale, scale, value_width, tile):
    return _forward(q, latent, q_slots, key_valid, latent_scale, scale, value_width, tile)[0]


def _causal_xla_fwd(q, latent, q_slots, key_valid, latent_scale, scale, value_width, tile):
    out, lse = _forward(q, latent, q_slots, key_valid, latent_scale, scale, value_width, tile)
    return out, (q, latent, q_slots, key_valid, latent_scale, out, lse)


def _causal_xla_bwd(scale, value_width, tile, residuals, d_out):
    q, latent, q_slots, key_valid, latent_scale, out, lse = residuals
    f = accumulation_dtype(q, latent)
    qf, d_out = q.astype(f), d_out.astype(f)
    delta = jnp.sum(d_out * out.astype(f), -1)  # D [B, Q, H]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # no key: every p below is masked to 0

    def step(dq, start):
        rows, row_scale, vis, z = _tile(q, latent, q_slots, key_valid, latent_scale, scale, start, tile, value_width)
        p = jnp.where(vis, jnp.exp(z - lse[..., None]), 0.0)
        pv = p if row_scale is None else p * row_scale  # the weight of a row's value
        dp = jnp.einsum("bqhc,btc->bqht", d_out, rows[..., :value_width], precision=_HI)
        if row_scale is not None:
            dp = dp * row_scale
        dz = p * (dp - delta[..., None]) * scale
        if row_scale is not None:
            dz = dz * row_scale
        dq_tile = jnp.einsum("bqht,btc->bqhc", dz, rows, precision=_HI)
        drows = jnp.einsum("bqht,bqhc->btc", dz, qf, precision=_HI)
        drows = drows.at[..., :value_width].add(jnp.einsum("bqht,bqhc->btc", pv, d_out, precision=_HI))
        return (dq_tile if dq is None else dq + dq_tile), drows

    length = latent.shape[1]
    dq, drows = _over_tiles(step, length, tile)  # drows [n_tiles, B, T, CR]
    if latent.dtype.itemsize == 1:  # an fp8 cache: no gradient (sparse_mla's rule)
        dlatent = jnp.zeros_like(latent)
    else:  # the tiles are consecutive from slot 0; rows no query sees were zeroed: 0
        b, _, cr = latent.shape
        dlatent = jnp.moveaxis(drows, 0, 1).reshape(b, -1, cr)[:, :length].astype(latent.dtype)
    return dq.astype(q.dtype), dlatent, None, None, None


_causal_xla.defvjp(_causal_xla_fwd, _causal_xla_bwd)


@eager_jit("scale", "value_width", "tile")
def _causal_xla_eager(q, latent, q_slots, key_valid, latent_scale, *, scale, value_width, tile):
    """``_causal_xla`` as one compiled program when called eagerly (inlined when traced)."""
    return _causal_xla(q, latent, q_slots, key_valid, latent_scale, scale, value_width, tile)
