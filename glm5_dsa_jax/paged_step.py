"""A layer call on a paged cache: each row its own sequence, at its own positions.

``DsaAttention.__call__`` hands a ``PagedCache`` here; the pipeline steps are the layer's
own (``project``, the indexer's ``project``, ``sparse_attention``, ``output_projection``)
and those below, under the same ``jax.named_scope`` names as the contiguous path
(``"kpool_compress"``, ``"index_scores"``, ``"topk_pools"``, ``"expand_selection"``).

Invariants (see ``glm5_dsa_jax.paged_cache`` for the layout):

1. Pages first: ``pages.reserve`` gives every row the pages its valid tokens need, all or
   nothing, in row order. A row that cannot have them (``status``) is masked out of the
   whole call: it writes nothing, its output is zeros and its top-k ``-1``.
2. Each valid token gets the next position of its sequence (``chunk_positions``); its
   latent row is written to its page before any query reads (a query attends to its own
   token, as in HF).
3. Pools that complete in the chunk are pooled once and written to their pages; the
   incomplete pool is staged.
4. Scores and selection read only the pools the sequence owns, up to the batch's latest
   complete pool (``"xla"``: a ``while_loop`` over pool tiles through the block table,
   ``pk.streaming_topk``; Pallas: ``index_scores_paged`` and ``topk_pools`` bounded by
   each row's live pools).
5. Token ids (positions within the sequence) become pool slots only for the attention
   (``token_slots``): ``sparse_mla`` reads the shared latent pool ``[1, N * page_size, C]``
   at those slots, so it reads only the rows it attends to, which lie in the sequence's
   own pages.

Equivalence: with positions from 0 and no holes, a sequence's pools, candidates, tie rule
and tail are those of the same tokens run alone through a contiguous cache
(``init_cache(batch 1)``), whatever its neighbours, chunking, joins and releases: the top-k
is the same, bit for bit, as long as both caches allow the same ``select_k``
(``cfg.select_k(max_pools)``: both hold at least ``index_topk`` tokens per sequence).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from glm5_dsa_jax.cache import from_store
from glm5_dsa_jax.ops import by_query_tiles, topk_live
from glm5_dsa_jax.pages import OK
from glm5_dsa_jax.paged_cache import (
    PagedCache, chunk_positions, paged_pool_window, paged_tail, paged_tile_scores,
    store_paged_pools, token_slots, write_latent,
)

__all__ = ["paged_call"]


@functools.lru_cache(maxsize=None)
def _tile_scorer(tile: int, ppp: int, kpool: int, dtype):
    """The scores of one pool tile read through the block table (``paged_tile_scores``),
    one function per statics so the eager ``while_loop`` trace is cached."""

    def scores(start, *operands):
        with jax.named_scope("index_scores"):
            return paged_tile_scores(start, *operands, tile=tile, ppp=ppp, kpool=kpool, dtype=dtype,
                                     score_fn=pk.index_scores_reference)

    return scores


def paged_call(layer, x, mask, cache: PagedCache, prev_topk, position_ids=None):
    """``(out, topk, cache)`` of ``layer`` on ``x [max_seqs, S, hidden]`` with ``mask``
    (checked inputs; see the module doc). RoPE positions (``position_ids``, default) are
    each token's position within its sequence."""
    cfg = layer.cfg
    old = cache.pages.lengths
    pages, status = cache.pages.reserve(mask.sum(axis=1, dtype=jnp.int32))
    mask = mask & (status == OK)[:, None]
    n_new = mask.sum(axis=1, dtype=jnp.int32)
    cache = cache.replace(pages=pages, status=status)
    # Padding tokens are zeroed first: whatever they hold (NaN included) is never read.
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    q_pos = chunk_positions(old, mask)
    rope = layer.rope(q_pos if position_ids is None else position_ids)
    q_resid, q_lat, latent = layer.project(x, rope)
    cache = write_latent(cache, latent, q_pos)
    latent_pool = cache.latent_pool[None]
    pool_scale = None if cache.latent_scale is None else cache.latent_pool_scale[None]  # fp8
    ps = cache.page_size

    if layer.indexer is not None:
        qi, w, ki, gate = layer.indexer.project(x, q_resid, rope, wide=layer.wide)
        with jax.named_scope("kpool_compress"):
            window = paged_pool_window(cache, old, ki, gate, mask)
            keys, g, valid, first_pool = window
            pooled, _, pooled_valid = layer._replicated(
                pk.kpool_compress, keys, g, valid, layer.indexer.pool_ape(keys.dtype), first_pool,
                implementation=layer.implementation)
            cache = store_paged_pools(cache, old, window, pooled, pooled_valid, n_new)
        select_k = cfg.select_k(cache.max_pools)
        pool_counts = cache.pages.lengths // cfg.index_kpool

        def tile(q_lat, q_pos, qi, w):
            pools = _select(layer, qi, w, cache, pool_counts, q_pos, select_k)
            with jax.named_scope("expand_selection"):
                tail = paged_tail(q_pos, cfg.index_kpool) if cfg.tail_width else None
                token_ids = layer._replicated(
                    pk.expand_selection, pools, jnp.zeros(pools.shape[:1], jnp.int32), tail,
                    kpool=cfg.index_kpool, out_width=cfg.out_width, implementation=layer.implementation)
                token_ids = jnp.where(q_pos[..., None] >= 0, token_ids, -1)
            slots = token_slots(cache.pages.block_table, token_ids, ps)
            return token_ids, layer.sparse_attention(q_lat, latent_pool, slots, pool_scale)

        topk, o_lat = by_query_tiles(tile, layer.block_q, (q_lat, 0), (q_pos, -1), (qi, 0), (w, 0))
    else:
        # Only positions at or before the query's own: a shared layer never attends to the
        # future, even when a traced prev_topk points there.
        prev = prev_topk.astype(jnp.int32)
        topk = jnp.where((prev >= 0) & (prev <= q_pos[..., None]), prev, -1)

        def tile(q_lat, token_ids):
            slots = token_slots(cache.pages.block_table, token_ids, ps)
            return token_ids, layer.sparse_attention(q_lat, latent_pool, slots, pool_scale)

        _, o_lat = by_query_tiles(tile, layer.block_q, (q_lat, 0), (topk, -1))

    out = layer.output_projection(o_lat)
    out = jnp.where(mask[..., None], out, jnp.zeros((), out.dtype)).astype(layer.dtype)
    return out, topk, cache


def _select(layer, qi, w, cache: PagedCache, pool_counts, q_pos, select_k: int):
    """Steps 2-3 on the paged cache: ``[B, Q, select_k]`` pool ids of each query's best
    candidate pools, reading only its own sequence's live pools."""
    kp = layer.cfg.index_kpool
    b, q = q_pos.shape
    ppp = cache.pools_per_page
    if layer.implementation == "xla":
        tile = min(layer.POOL_TILE, cache.max_pools)
        with jax.named_scope("topk_pools"):
            n_live = jnp.clip(jnp.max((q_pos + 1) // kp), 0, cache.max_pools)
            n_tiles = ((n_live + tile - 1) // tile).astype(jnp.int32)
            return pk.streaming_topk(
                _tile_scorer(tile, ppp, kp, cache.dtype),
                (qi, w, cache.pooled_store, cache.pages.block_table, pool_counts, q_pos, cache.pooled_scale),
                n_tiles,
                tile=tile, n_pools=cache.max_pools, select_k=select_k, rows=(b, q))
    with jax.named_scope("index_scores"):
        scores = layer._replicated(
            pk.index_scores_paged, qi, w, from_store(cache.pooled_store, cache.dtype),
            cache.pages.block_table, pool_counts, q_pos, cache.pooled_scale, kpool=kp,
            implementation=layer.implementation)
    with jax.named_scope("topk_pools"):
        n_live = jnp.clip((q_pos + 1) // kp, 0, pool_counts[:, None])
        return layer._replicated(topk_live, scores, n_live, select_k, implementation=layer.implementation)
