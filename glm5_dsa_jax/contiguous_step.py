"""A layer call on a contiguous cache (``DsaCache``): one timeline for the whole batch.

``DsaAttention.__call__`` hands a ``DsaCache`` here (a call without a cache comes with a
fresh one sized to its input), as it hands a ``PagedCache`` to ``glm5_dsa_jax.paged_step``;
both calls run the layer's own step methods, in the same order, and differ only in how
positions, cache writes and the attended rows are laid out.

Invariants (see ``glm5_dsa_jax.cache`` for the layout):

1. Slot ``length + i`` holds the chunk's ``i``-th token, padding included (HF's
   ``DynamicCache`` timeline); a padding query has slot ``-1`` (``q_pos``) and so reads
   nothing, writes nothing that is ever read, outputs zeros and gets a top-k row of ``-1``.
2. A chunk that does not fit (``fits`` False; only possible under a trace, as the layer
   refuses it eagerly: ``cache.check_fits``) writes nothing and leaves ``length`` as is.
3. A query's latent row is written before any query reads (a query attends to its own
   token, as in HF); the pools completing in the chunk are pooled before scoring.
4. Steps 2-5 run per ``block_q`` query tile (``ops.by_query_tiles``), so no ``[S, P]`` or
   ``[S, S]`` tensor is built.
"""

from __future__ import annotations

import jax.numpy as jnp

from glm5_dsa_jax.cache import DsaCache, append_rows
from glm5_dsa_jax.ops import by_query_tiles

__all__ = ["contiguous_call"]


def contiguous_call(layer, x, mask, cache: DsaCache, prev_topk, position_ids=None, reduce_axis=None):
    """``(out, topk, cache)`` of ``layer`` on ``x [B, S, hidden]`` with ``mask`` (checked
    inputs) on the contiguous ``cache``: the pipeline of ``DsaAttention``'s class doc, steps
    2-5 per query tile (module doc). RoPE positions (``position_ids``, default) are the
    slots of HF's timeline, ``length + 0 .. S-1``, padding included, as HF's default."""
    b, s, _ = x.shape
    # Padding tokens are zeroed first: whatever they hold (NaN included) is never read.
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    length = cache.length
    fits = length + s <= cache.max_length
    if position_ids is None:
        position_ids = jnp.broadcast_to(length + jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    rope = layer.rope(position_ids)
    q_resid, q_lat, latent = layer.project(x, rope)
    cache = append_rows(cache, latent, mask, fits)
    q_pos = jnp.where(mask, length + jnp.arange(s, dtype=jnp.int32)[None], -1)

    if layer.indexer is not None:
        qi, w, ki, gate = layer.indexer.project(x, q_resid, rope)
        cache = layer.compress_pools(cache, ki, gate, mask, fits)
        n_vis = cache.n_valid[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32)
        select_k = layer.cfg.select_k(cache.max_pools)

        def tile(q_lat, q_pos, qi, w, n_vis):
            pools = layer.choose_pools(qi, w, cache, q_pos, select_k)
            token_ids = layer.expand_to_tokens(pools, cache, n_vis, q_pos)
            return token_ids, layer.sparse_attention(q_lat, cache.latent, token_ids, cache.latent_scale)

        topk, o_lat = by_query_tiles(tile, layer.block_q, (q_lat, 0), (q_pos, -1), (qi, 0), (w, 0), (n_vis, 0))
        cache = cache.replace(n_valid=jnp.where(fits, n_vis[:, -1], cache.n_valid))
    else:
        topk = layer.reused_token_ids(prev_topk, q_pos)

        def tile(q_lat, token_ids):
            return token_ids, layer.sparse_attention(q_lat, cache.latent, token_ids, cache.latent_scale)

        _, o_lat = by_query_tiles(tile, layer.block_q, (q_lat, 0), (topk, -1))

    out = layer.output_projection(o_lat, mask, reduce_axis=reduce_axis)
    cache = cache.replace(length=jnp.where(fits, length + s, length).astype(jnp.int32))
    return out, topk, cache
