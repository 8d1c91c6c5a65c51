"""A layer call on a paged cache: each row its own sequence, at its own positions.

``DsaAttention.__call__`` hands a ``PagedCache`` here, as it hands a ``DsaCache`` to
``glm5_dsa_jax.contiguous_step``. Every pipeline step is the layer's own method, the same
ones, under the same ``jax.named_scope`` names, as the contiguous call (``glm5_dsa_jax.steps``):
a step that reads the cache (``compress_pools``, ``score_pools``, ``choose_pools`` /
``score_and_select``, ``expand_to_tokens``) picks its paged kernel from the cache's kind.
What is paged-only lives here: page reservation, positions, latent writes, the mapping of
positions to latent-pool slots for ``sparse_attention``, and the paged tile scorer of the
``"xla"`` selection (``paged_tile_scorer``).

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
   (``token_slots``): ``sparse_mla`` reads the shared latent pool ``[1, N * page_size, CR]``
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
from glm5_dsa_jax.ops import by_query_tiles
from glm5_dsa_jax.pages import OK
from glm5_dsa_jax.paged_cache import (
    PagedCache, chunk_positions, paged_tile_scores, token_slots, write_latent,
)
from glm5_dsa_jax.steps import SCORE_POOLS

__all__ = ["paged_call", "paged_tile_scorer"]


@functools.lru_cache(maxsize=None)
def paged_tile_scorer(tile: int, ppp: int, kpool: int, dtype):
    """The scores of one pool tile read through the block table (``paged_tile_scores``),
    one function per statics so the eager ``while_loop`` trace is cached; the paged
    ``DsaAttention.score_and_select`` streams them (``pk.streaming_topk``)."""

    def scores(start, *operands):
        with jax.named_scope(SCORE_POOLS):
            return paged_tile_scores(start, *operands, tile=tile, ppp=ppp, kpool=kpool, dtype=dtype,
                                     score_fn=pk.index_scores_reference)

    return scores


def paged_call(layer, x, mask, cache: PagedCache, prev_topk, position_ids=None, reduce_axis=None):
    """``(out, topk, cache)`` of ``layer`` on ``x [max_seqs, S, hidden]`` with ``mask``
    (checked inputs; see the module doc). RoPE positions (``position_ids``, default) are
    each token's position within its sequence."""
    old = cache.pages.lengths
    pages, status = cache.pages.reserve(mask.sum(axis=1, dtype=jnp.int32))
    mask = mask & (status == OK)[:, None]
    cache = cache.replace(pages=pages, status=status)
    # Padding tokens are zeroed first: whatever they hold (NaN included) is never read.
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    q_pos = chunk_positions(old, mask)
    rope = layer.rope(q_pos if position_ids is None else position_ids)
    q_resid, q_lat, latent = layer.project(x, rope)
    cache = write_latent(cache, latent, q_pos)
    latent_pool = cache.latent_pool[None]
    pool_scale = None if cache.latent_scale is None else cache.latent_pool_scale[None]  # fp8

    def attend(q_lat, token_ids):
        slots = token_slots(cache.pages.block_table, token_ids, cache.page_size)
        return layer.sparse_attention(q_lat, latent_pool, slots, pool_scale)

    if layer.indexer is not None:
        qi, w, ki, gate = layer.indexer.project(x, q_resid, rope)
        cache = layer.compress_pools(cache, ki, gate, mask)
        select_k = layer.cfg.select_k(cache.max_pools)

        def tile(q_lat, q_pos, qi, w):
            pools = layer.choose_pools(qi, w, cache, q_pos, select_k)
            token_ids = layer.expand_to_tokens(pools, cache, None, q_pos)
            return token_ids, attend(q_lat, token_ids)

        topk, o_lat = by_query_tiles(tile, layer.block_q, (q_lat, 0), (q_pos, -1), (qi, 0), (w, 0))
    else:
        topk = layer.reused_token_ids(prev_topk, q_pos)
        _, o_lat = by_query_tiles(lambda q_lat, ids: (ids, attend(q_lat, ids)), layer.block_q,
                                  (q_lat, 0), (topk, -1))

    return layer.output_projection(o_lat, mask, reduce_axis=reduce_axis), topk, cache
