"""The main attention's probability mass per pool: the target ``p`` of the indexer loss.

The indexer loss (issue 25) compares the indexer's softmax over pools with the main
attention's distribution summed over each pool's tokens and averaged over heads. This module
computes that mass, a constant of the loss (everything is under ``stop_gradient``: the
indexer learns from it, nothing learns through it), in plain JAX, for the two stages:

* ``dense_pool_mass`` (the dense warm-up): the softmax over *every* key a query sees
  (``slot <= q_slots[b, t]`` and ``key_valid[b, slot]``: ``pallas_kernels.causal_visible``,
  the key set of ``causal_mla``, the dense attention itself), summed over the ``KP`` slots of
  pool ``j`` (slots ``first_key[b] + j*KP ... + KP - 1``, the contiguous cache's pool grid;
  a fresh cache's slots are the prompt's positions) -> ``[B, Q, P]``.
* ``sparse_pool_mass`` (sparse training): the softmax ``sparse_mla`` itself uses, over the
  ``W`` ids of a ``token_ids`` row, summed over each selected pool's ``KP`` tokens ->
  ``[B, Q, K]``.

Axis letters as in ``pallas_kernels``' glossary. Invariants:

* Scores are ``sparse_mla``'s: ``(q . row) * scale`` over all ``CR`` columns of a row, with
  an fp8 row's scale on its score (``(q . row8) * s_row * scale``), in float32 (HIGHEST
  precision dots). A key that is not visible (or an id that names no slot) gets no weight
  and is never used arithmetically: a NaN in an invisible row goes nowhere.
* Heads are averaged over *all* heads: the mass is summed over this device's ``H`` heads,
  ``psum``-ed over ``reduce_axis`` when given (a tensor-parallel ``shard_map``'s head
  axis), and divided by the total head count (``H`` times the axis size). So a TP call
  equals the unsharded one, with one collective on the small ``[B, Q, P or K]`` result.
* A query with no visible key (``q_slots < 0``: a padding query) or no valid id gets zeros.
* A pool is only summed, never renormalised: the dense mass of an incomplete pool is the
  mass of its visible slots, and the caller picks the pools of its loss (``J_t``) and
  renormalises over them.
* Memory is bounded without a ``[B, Q, L]`` tensor per head: ``dense_pool_mass`` makes two
  passes over key tiles of ``key_tile`` slots (``lax.scan``; first the log-sum-exp, then
  the mass), peak ``[B, Q, H, key_tile]`` scores and ``[B, key_tile, CR]`` rows.
  ``sparse_pool_mass`` keeps the ``[B, Q, H, W]`` scores (what a softmax over ``W`` needs)
  and gathers rows ``ID_TILE`` ids at a time, never ``[B, Q, W, CR]``.

Why a layout rule for ``sparse_pool_mass`` (``expand_selection``'s, checked in
``tests/test_attention_mass.py``): ``topk_pools`` emits ascending pool ids, ``-1`` after,
and ``expand_selection`` lays them out compacted, ``KP`` tokens each, then the tail (the
incomplete visible pool: at most ``KP - 1`` tokens), then ``-1``. So block ``k`` of a row,
``token_ids[..., k*KP:(k+1)*KP]``, is the ``k``-th selected pool exactly when all of its
``KP`` ids are ``>= 0``: a block holding the tail (fewer than ``KP`` ids) or nothing is no
pool and gets mass 0, and index ``k`` of the result matches index ``k`` of the selection's
``pool_ids``. The tail's mass is in no pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels as pk

__all__ = ["dense_pool_mass", "sparse_pool_mass", "ID_TILE"]

_HI = lax.Precision.HIGHEST

#: Ids of a ``token_ids`` row whose latent rows ``sparse_pool_mass`` gathers at once.
ID_TILE = 256


def _check_int(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_shape(name: str, x, shape: tuple, spelled: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must be {spelled} = {tuple(shape)}, got {tuple(x.shape)}")


def _check_q_latent(q, latent, latent_scale, *, shared_ok: bool) -> tuple[int, int, int, int, int]:
    """``(B, Q, H, CR, L)`` of checked ``q [B, Q, H, CR]``, ``latent [B, L, CR]`` (or ``[1,
    L, CR]`` where ``shared_ok``) and ``latent_scale [B or 1, L]`` (fp8 rows) or None."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Q, H, CR] (rank 4), got shape {tuple(q.shape)}")
    b, nq, h, cr = q.shape
    if latent.ndim != 3 or latent.shape[2] != cr or latent.shape[0] not in ((b, 1) if shared_ok else (b,)):
        rows = "[B or 1, L, CR]" if shared_ok else "[B, L, CR]"
        raise ValueError(f"latent must be {rows} with B = {b}, CR = {cr} (q's), got {tuple(latent.shape)}")
    length = latent.shape[1]
    if latent_scale is not None:
        _check_shape("latent_scale", latent_scale, (latent.shape[0], length),
                     "[B, L] (one float32 scale per fp8 row, as latent's leading axes)")
    return b, nq, h, cr, length


def _take_rows(table, ids):
    """``table [B or 1, L, ...]`` at ``ids [B, ...]`` (in range): ``[B, ..., ...]``; a
    ``[1, L, ...]`` table is one pool of rows every batch row reads."""
    if table.shape[0] == 1:
        return table[0][ids]
    return jax.vmap(lambda t, i: t[i])(table, ids)


def _head_mean(mass_sum, heads: int, reduce_axis: str | None):
    """``mass_sum`` (summed over this device's ``heads``) -> averaged over all heads."""
    if reduce_axis is None:
        return mass_sum / heads
    return lax.psum(mass_sum, reduce_axis) / (heads * lax.axis_size(reduce_axis))


def dense_pool_mass(q, latent, q_slots, key_valid, first_key, latent_scale=None, *,
                    kpool: int, n_pools: int, scale: float, key_tile: int = 512,
                    reduce_axis: str | None = None) -> jax.Array:
    """The dense attention's head-averaged probability mass on each pool (module doc).

    Args:
      q: ``[B, Q, H, CR]`` absorbed queries (this device's heads), as ``sparse_mla`` takes.
      latent: ``[B, L, CR]`` cache rows (e4m3 with ``latent_scale`` for an fp8 cache).
      q_slots: ``[B, Q]`` int: each query's own slot (``-1``: a padding query, zeros).
      key_valid: ``[B, L]`` bool: slots holding a token (False: padding, holes).
      first_key: ``[B]`` int: the slot where row ``b``'s pool grid starts.
      latent_scale: ``[B, L]`` float32 row scales of an fp8 ``latent``, else None.
      kpool: ``KP``, slots per pool.
      n_pools: ``P``, pools of the result (pool ``j``'s slots past ``L`` count nothing).
      scale: the softmax scale ``sparse_mla`` takes.
      key_tile: slots per tile of the two passes, rounded up to a whole number of pools.
      reduce_axis: the head axis of an enclosing ``shard_map`` (TP), or None.

    Returns:
      ``[B, Q, P]`` float32: softmax over every visible key (``slot <= q_slots[b, t]`` and
      ``key_valid[b, slot]``), summed over the ``KP`` slots of each pool, averaged over all
      heads; no gradient flows through it.
    """
    b, nq, h, cr, length = _check_q_latent(q, latent, latent_scale, shared_ok=False)
    _check_shape("q_slots", q_slots, (b, nq), "[B, Q] (q's leading axes)")
    _check_shape("key_valid", key_valid, (b, length), "[B, L] (latent's leading axes)")
    _check_shape("first_key", first_key, (b,), "[B]")
    kpool = _check_int("kpool", kpool, 1)
    n_pools = _check_int("n_pools", n_pools, 0)
    key_tile = _check_int("key_tile", key_tile, 1)
    tile = -(-key_tile // kpool) * kpool  # a whole number of pools per tile of pass 2
    f32 = jnp.float32
    if n_pools == 0 or length == 0 or nq == 0 or b == 0:
        return jnp.zeros((b, nq, n_pools), f32)

    q = lax.stop_gradient(q).astype(f32)
    latent = lax.stop_gradient(latent)
    q_slots = q_slots.astype(jnp.int32)
    first_key = first_key.astype(jnp.int32)
    offsets = jnp.arange(tile, dtype=jnp.int32)

    def scores(slots):
        """Scaled scores ``[B, Q, H, T]`` at ``slots [B, T]`` (any ints) and their
        visibility ``[B, Q, 1, T]``; ``-inf`` where not visible."""
        inside = (slots >= 0) & (slots < length)
        safe = jnp.clip(slots, 0, length - 1)
        rows = _take_rows(latent, safe).astype(f32)  # [B, T, CR]
        s = jnp.einsum("bqhc,btc->bqht", q, rows, precision=_HI)
        if latent_scale is not None:  # sparse_mla's order: (q . row8) * s_row * scale
            s = s * _take_rows(lax.stop_gradient(latent_scale).astype(f32), safe)[:, None, None, :]
        seen = inside & _take_rows(key_valid, safe)  # [B, T]
        vis = pk.causal_visible(q_slots, seen, slots)[:, :, None, :]
        return jnp.where(vis, s * scale, -jnp.inf), vis

    # Pass 1: the log-sum-exp of every head's scores over every slot, an online softmax.
    # The first tile starts the carry (so it has q's type, varying over a shard_map's axes).
    def lse_step(carry, start):
        s, _ = scores(start + offsets[None, :] + jnp.zeros((b, 1), jnp.int32))
        m_new = s.max(-1) if carry is None else jnp.maximum(carry[0], s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        l = jnp.exp(s - m_safe[..., None]).sum(-1)
        if carry is not None:
            l = l + carry[1] * jnp.exp(carry[0] - m_safe)
        return (m_new, l), None

    carry0, _ = lse_step(None, jnp.int32(0))
    (m, l), _ = lax.scan(lse_step, carry0, jnp.arange(tile, length, tile, dtype=jnp.int32))
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)  # 0: no key (masked below)

    # Pass 2: the mass, tile by tile of the pool grid (slots first_key + r, r >= 0).
    def mass_step(_, start):
        s, vis = scores(first_key[:, None] + start + offsets[None, :])
        p = jnp.where(vis, jnp.exp(s - lse[..., None]), 0.0).sum(2)  # [B, Q, T], over heads
        return None, p.reshape(b, nq, tile // kpool, kpool).sum(-1)

    starts = jnp.arange(0, n_pools * kpool, tile, dtype=jnp.int32)
    _, per_tile = lax.scan(mass_step, None, starts)  # [n_tiles, B, Q, tile // KP]
    mass = jnp.moveaxis(per_tile, 0, 2).reshape(b, nq, -1)[:, :, :n_pools]
    return lax.stop_gradient(_head_mean(mass, h, reduce_axis))


def sparse_pool_mass(q, latent, token_ids, latent_scale=None, *, kpool: int, select_k: int,
                     scale: float, reduce_axis: str | None = None) -> jax.Array:
    """The sparse attention's head-averaged probability mass on each selected pool (module
    doc; the layout rule of ``token_ids`` it relies on is there).

    Args:
      q: ``[B, Q, H, CR]`` absorbed queries (this device's heads).
      latent: ``[B, L, CR]`` cache rows, or ``[1, L, CR]`` read by every batch row (e4m3
        with ``latent_scale`` for an fp8 cache).
      token_ids: ``[B, Q, W]`` int ids of ``expand_selection`` (``-1`` = none), ``W >=
        select_k * kpool``.
      latent_scale: ``[B or 1, L]`` float32 row scales of an fp8 ``latent``, else None.
      kpool: ``KP``, tokens per pool.
      select_k: ``K``, the selected pools a row holds at most.
      scale: the softmax scale ``sparse_mla`` takes.
      reduce_axis: the head axis of an enclosing ``shard_map`` (TP), or None.

    Returns:
      ``[B, Q, K]`` float32: the softmax ``sparse_mla`` uses over the row's valid ids (``0
      <= id < L``), summed over block ``k``'s ``KP`` ids where all of them are ``>= 0`` (a
      selected pool), else 0; averaged over all heads; no gradient flows through it.
    """
    b, nq, h, cr, length = _check_q_latent(q, latent, latent_scale, shared_ok=True)
    if token_ids.ndim != 3 or token_ids.shape[:2] != (b, nq):
        raise ValueError(f"token_ids must be [B, Q, W] with B, Q = {(b, nq)} (q's), got {tuple(token_ids.shape)}")
    kpool = _check_int("kpool", kpool, 1)
    select_k = _check_int("select_k", select_k, 0)
    width = token_ids.shape[2]
    if width < select_k * kpool:
        raise ValueError(
            f"token_ids is W = {width} wide, narrower than select_k * kpool = {select_k} * {kpool}: "
            "not a row of expand_selection (the selected pools first, KP ids each)")
    f32 = jnp.float32
    if select_k == 0 or b * nq == 0 or length == 0:
        return jnp.zeros((b, nq, select_k), f32)

    q = lax.stop_gradient(q).astype(f32)
    latent = lax.stop_gradient(latent)
    ids = token_ids.astype(jnp.int32)
    n_tiles = -(-width // ID_TILE)
    id_tile = -(-width // n_tiles)  # tiles as even as they come, ID_TILE ids at most
    padded = jnp.pad(ids, ((0, 0), (0, 0), (0, n_tiles * id_tile - width)), constant_values=-1)
    valid = (padded >= 0) & (padded < length)

    def tile_scores(_, tile_ids):  # tile_ids [B, Q, T] -> scores [B, Q, H, T]
        ok = (tile_ids >= 0) & (tile_ids < length)
        safe = jnp.where(ok, tile_ids, 0)
        rows = _take_rows(latent, safe).astype(f32)  # [B, Q, T, CR]
        s = jnp.einsum("bqhc,bqtc->bqht", q, rows, precision=_HI)
        if latent_scale is not None:
            s = s * _take_rows(lax.stop_gradient(latent_scale).astype(f32), safe)[:, :, None, :]
        return None, jnp.where(ok[:, :, None, :], s * scale, -jnp.inf)

    tiles = jnp.moveaxis(padded.reshape(b, nq, n_tiles, id_tile), 2, 0)
    _, s = lax.scan(tile_scores, None, tiles)  # [n_tiles, B, Q, H, T]
    s = jnp.moveaxis(s, 0, 3).reshape(b, nq, h, n_tiles * id_tile)
    m = s.max(-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(valid[:, :, None, :], jnp.exp(s - m), 0.0)
    denom = e.sum(-1, keepdims=True)
    p = (e / jnp.where(denom > 0, denom, 1.0)).sum(2)  # [B, Q, W_pad], summed over heads

    n_sel = select_k * kpool
    per_pool = p[:, :, :n_sel].reshape(b, nq, select_k, kpool).sum(-1)
    is_pool = (ids[:, :, :n_sel].reshape(b, nq, select_k, kpool) >= 0).all(-1)
    mass = jnp.where(is_pool, per_pool, 0.0)
    return lax.stop_gradient(_head_mean(mass, h, reduce_axis))
