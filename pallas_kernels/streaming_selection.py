"""Streaming selection: ``streaming_topk``, ``topk_pools`` over a row that arrives tile by
tile, for as many tiles as are live.

Axis letters as in the package glossary (``pallas_kernels``). A decode step should score
only the pools a sequence has, not the cache's capacity. The scores then arrive one tile
of pools at a time, for a number of tiles known only on the device (the batch's latest
complete pool). This op keeps a running best set over the tiles seen so far, so no
``[B, Q, P]`` score row is ever built and the work follows the live tiles (a
``while_loop``: one compilation for every length). It is what ``implementation="xla"``
runs for steps 2-3 (``DsaAttention.score_and_select``) of a decode step on a contiguous
cache and of every step, prefill included, on a paged one (a contiguous prefill tile of
``Q`` queries keeps the whole-row ``topk_pools``: one selection per query, not one per tile).
The Pallas path scores the whole row, and its ``topk_pools`` reads each row only up to
``n_live``. It is an xla-only op: it takes neither ``implementation`` nor ``block_sizes``
(its ``tile`` is the pool tile of the caller's scorer, not a kernel block): it is a loop
of XLA ops around the caller's scorer, where the Pallas path has a kernel per step.

Invariants:

* The tie rule is ``topk_pools``'s, exactly (see ``pallas_kernels.selection``): rank by
  ``order_key`` (higher first), the lower pool id wins among equal keys, ``-inf`` (and NaN)
  is never selected, the row lists the ids in ascending order then ``-1``. The running
  set is kept in ascending id order (its unfilled slots last, at ``-inf``), so the running
  set followed by the next tile is a row in ascending id order, and merging is
  ``threshold_select`` of that ``K + tile`` row (the reference's own rule: a radix select
  of the ``K``-th key, then a compaction in row order; no sort). A pool's rank depends only
  on its own ``(key, id)`` pair, so the first ``K`` of the whole row are the first ``K`` of
  (first ``K`` of the tiles before) + (this tile): the result equals
  ``topk_pools_reference`` on the whole row, bit for bit, in any tiling.
* Cost: a merge is 32 counting passes and a compaction over ``K + tile`` entries, so a
  tile of a few times ``K`` keeps the merges near one pass over the live pools (the layer
  sizes its tiles so: ``DsaAttention.score_and_select``).
* Tile ``t`` covers pools ``t * tile ..``; the last tile of a row whose length ``P`` is
  not a multiple of ``tile`` is read from ``P - tile`` (no read past the row) and its
  pools already seen are masked to ``-inf``, so each pool is ranked once.
* The ``while_loop`` body is built once per ``(tile_scores, tile, P, K)`` and receives
  every array it reads as an operand: jax caches a traced body by the function and its
  operands' types, so an eager call (outside jit) compiles nothing after the first.
  ``tile_scores`` must be a stable (module-level or cached) function for the same reason.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels._order_key import NEG_INF_KEY, order_key, threshold_select

__all__ = ["streaming_topk"]


@functools.lru_cache(maxsize=None)
def _loop(tile_scores: Callable, tile: int, n_pools: int, select_k: int):
    """``(cond, body)`` of the ``while_loop`` (cached: the same functions for the same
    statics, so jax's trace caches hit)."""

    def cond(carry):
        return carry[0] < carry[1]

    def body(carry):
        t, n_tiles, best_key, ids, operands = carry
        start = jnp.minimum(t * tile, n_pools - tile)
        s = tile_scores(start, *operands)
        tile_ids = jnp.broadcast_to(start + jnp.arange(tile, dtype=jnp.int32), s.shape)
        s = jnp.where(tile_ids >= t * tile, s, -jnp.inf)  # the last tile's overlap: seen
        k_all = jnp.concatenate([best_key, order_key(s)], axis=-1)
        i_all = jnp.concatenate([ids, tile_ids], axis=-1)
        pos = threshold_select(k_all, select_k)  # ascending positions = ascending ids
        taken = pos >= 0
        pos = jnp.maximum(pos, 0)
        best_key = jnp.where(taken, jnp.take_along_axis(k_all, pos, axis=-1), NEG_INF_KEY)
        ids = jnp.where(taken, jnp.take_along_axis(i_all, pos, axis=-1), -1)
        return t + 1, n_tiles, best_key, ids, operands

    return cond, body


def streaming_topk(
    tile_scores: Callable[..., jax.Array],
    operands: tuple,
    n_tiles: jax.Array,
    *,
    tile: int,
    n_pools: int,
    select_k: int,
    rows: tuple[int, ...],
    with_keys: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The ``select_k`` (``K``) best pools of rows whose scores come in tiles.

    Args:
      tile_scores: ``(start, *operands) -> [*rows, tile]`` float32 scores of pools
        ``start .. start + tile - 1`` (``-inf`` for a pool that is no candidate). Called
        for tiles ``t < n_tiles`` only, inside a ``while_loop``; a stable function.
      operands: the arrays ``tile_scores`` reads.
      n_tiles: ``[]`` int32 tiles to read (on device), at most ``cdiv(P, tile)``.
      tile: pools per tile, ``1 <= tile <= P``.
      n_pools: ``P``, the row length.
      select_k: pools to keep per row.
      rows: the leading shape of a score tile (``(B, Q)``).
      with_keys: also return each chosen pool's ``order_key`` of its score.

    Returns:
      ``[*rows, K]`` int32 pool ids, ascending, ``-1`` after the last; with ``with_keys``
      ``(ids, keys)``, ``keys [*rows, K]`` int32 the ids' ``order_key`` (``NEG_INF_KEY``
      where the id is ``-1``): what a merge of several rows' candidates ranks by
      (``glm5_dsa_jax.parallel.context``).

    No gradient: the selection is discrete. ``operands`` enter through
    ``jax.lax.stop_gradient``, so under ``jax.grad`` / ``jax.jvp`` no tangent enters the loop
    (a ``while_loop`` cannot be transposed, and the scores need none).
    """
    operands = jax.tree.map(jax.lax.stop_gradient, tuple(operands))
    if not 1 <= tile <= n_pools:
        raise ValueError(f"tile must be in [1, P={n_pools}], got {tile}")
    if not 0 <= select_k <= n_pools:
        raise ValueError(f"select_k must be in [0, P={n_pools}], got {select_k}")
    if select_k == 0:
        empty = jnp.zeros(rows + (0,), jnp.int32)
        return (empty, empty) if with_keys else empty
    cond, body = _loop(tile_scores, tile, n_pools, select_k)
    init = (
        jnp.zeros((), jnp.int32),
        jnp.asarray(n_tiles, jnp.int32),
        jnp.full(rows + (select_k,), NEG_INF_KEY, jnp.int32),
        jnp.full(rows + (select_k,), -1, jnp.int32),
        tuple(operands),
    )
    _, _, keys, ids, _ = jax.lax.while_loop(cond, body, init)
    return (ids, keys) if with_keys else ids
