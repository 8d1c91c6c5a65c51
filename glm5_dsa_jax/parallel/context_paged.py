"""Context parallelism with a paged cache: the page pools split over a mesh axis, for decode and chunked prefill.

``shard_layer(layer, mesh, axis="tp", seq_axis="cp")`` then ``layer.init_paged_cache(...)``
(or ``PagedDecoder(layer, ...)``): the paged cache's **page pools** are split over the
sequence axis, its **page table stays replicated**, and a call with such a cache runs
``forward`` here as the body of the call's one ``shard_map`` (``parallel.execution``).

Design (why it is this way):

* **Where a page lives.** The pools (``PagedCache.PAGE_AXIS_FIELDS``: the latent pages,
  the pooled-key pages and their fp8 scales) are split on their page axis into ``cp``
  contiguous blocks: device ``i`` of the axis holds physical pages ``[i * N/cp, (i+1) *
  N/cp)`` (under a batch axis too: within each data shard's block of pages,
  ``P((batch_axis, seq_axis))``). A page's owner is a function of its physical id alone,
  so the block table, lengths, free stack, owner record, stage and status (all small)
  stay replicated and every device runs the page bookkeeping (``pages.reserve``) itself,
  identically, without a collective. ``N / dp`` not divisible by ``cp``: ``ValueError``
  naming the sizes (``placement.check_page_split``, ``pages.init_page_table``).
* **How pages spread.** A cp layer's ``init_paged_cache`` makes its page table with
  ``seq_shards=cp``: the fresh free stack hands pages out round-robin over the ``cp``
  blocks (``0, N/cp, 2N/cp, .., 1, N/cp + 1, ..``), so the pages taken lie evenly on the
  devices (to one page, on a fresh table), and one sequence taking pages alone (a long
  prefill, a lone decode) rotates over them. Rows that take pages in lockstep (rows take
  pages in row order, so ``B`` rows each taking one page a step with ``B % cp == 0``) can
  put one sequence's pages mostly on some devices, and churn (release, rollback, fork)
  reorders the stack. That costs nothing here but balance of memory per sequence: every
  step below is exact whatever device holds which page, and the scoring width is the
  static bound ``PGL`` below, not the actual spread. (Per-device free stacks, logical
  page ``j`` on device ``j % cp``, would bound it by ``pages_per_seq / cp``: not done.)
* **Writes** land on the owner only: a prefill chunk's projections are split by rows
  (``context.row_split``: each device projects ``ceil(S / cp)`` rows, gathered once; ``o_proj``
  the same) and ``PagedCache.write_latent_held`` / ``store_pools_held``
  with ``page_offset = i * N/cp`` drop the rows of pages it does not hold.
* **Selection** (a full layer), by the key split or the query split, whichever sends fewer
  bytes (``context.splits_queries``, from static shapes, with the shard's pool pages per
  sequence and ``K'`` of its scoring width): a decode step and a short chunk the key split,
  a long prefill chunk the query split. *Query split*: the pooled-key pages (and fp8 scales)
  are all-gathered (``PagedCache.gathered_pools``: every page as the unsharded cache holds
  it, under the replicated block table) and each device runs the unsharded layer's own
  ``choose_pools`` for its zig-zag rows of the chunk (``context.select_split``), the ids
  all-gathered: the unsharded paged layer's ids by construction. Bytes in per device:
  ``(cp - 1) / cp`` of the pooled-key pages (``N * PPP`` pools of ``pool_row_bytes``) and of
  the ids. *Key split*: each device gathers, per sequence, the pages of its block
  table that it holds (at most ``PGL = min(pages_per_seq, N/cp)`` of them, in logical
  order) and their pooled keys, ``[B, PGL * PPP, D]``, once per call; it scores them
  (``pk.index_scores``, the same per-pool arithmetic as the unsharded layer's) with the
  unsharded candidate rule applied on each pool's *logical* id ``p`` (``(p + 1) * KP - 1 <=
  q_pos`` and ``p`` below the sequence's complete pools), keeps its ``K' = min(select_k,
  PGL * PPP)`` best by ``pk.topk_pools`` (ties: the lower index, which is the lower logical
  id), and the candidates (``order_key`` and logical pool id, int32 each) are
  all-gathered and merged by ``context.merge_candidates``: the unsharded layer's ids bit
  for bit (``context``'s module doc says why; the unsharded short-context path, which
  takes every candidate unscored, agrees unless a score is NaN). Expanding pools to
  token positions (``pk.expand_selection``) and the visible tail (a paged sequence has no
  holes: no validity to read) are replicated.
* **Attention**: the token positions map to global latent slots through the replicated
  block table (``paged.token_slots``); a device attends over the slots it holds
  (``pk.sparse_mla_partial``, the others ``-1`` for it) and the partials are merged by
  their log-sum-exp (``context.merge_partials``); then ``o_proj`` as everywhere.

Bytes crossing devices per step and query row, independent of the context length: as the
contiguous cache's (``context``'s module doc) without the tail's validity ``psum``: the
candidates' all-gather ``cp * K' * 8`` and the partials' ``H_local * (V + 1) * 4 +
H_local * 4``. Work per device: scoring ``PGL * PPP`` pools a row (the static bound
``PGL = min(pages_per_seq, N/cp)`` pages, whatever the spread: ``1/cp`` of the unsharded
capacity only when ``pages_per_seq = N``; like the contiguous cp path, and unlike the
unsharded ``"xla"`` layer, which streams only the live pool tiles, it does not shrink with a
short context), attention over its own selected rows, the projections of ``ceil(S / cp)``
rows; the page bookkeeping and the pooling of the chunk's keys are replicated.

**Kernels per shard.** Every step runs the layer's own implementation
(``layer.implementation``, one of ``PAGED_CP_IMPLEMENTATIONS``: the contiguous path's
``context.CP_IMPLEMENTATIONS``, ``"xla"``, ``"pallas"``, ``"mosaic"`` and their interpret
forms) on the device's shard, as ``parallel.context`` does: ``pk.kpool_compress`` on the
window, ``pk.index_scores`` over the held pools gathered contiguous (``first_key`` 0 and
every query past them, so a kernel's causal tile end never cuts a held pool; the logical
candidate rule is applied after, in jnp: so the contiguous kernel, not the paged one
``index_scores_paged``, scores here, and the Mosaic paged kernel's ``PPP % 8`` rule does
not apply), ``pk.topk_pools`` for the ``K'`` candidates (a Pallas top-k bounded by
``n_live``: the held pools are in ascending logical order, so each query's candidates are
a prefix of them, counted per query), ``pk.expand_selection`` and ``pk.sparse_mla_partial``
(Triton's ``lse`` output; Mosaic's ``return_lse``, a step or dtype without a Mosaic kernel
falling back to Triton as in the unsharded layer). The merges (``merge_candidates``,
``merge_partials``) and the gather of the held pools are plain jnp and collectives
whatever the implementation. The scoring width is ``PGL * PPP`` pools a row under every
implementation (the Pallas scoring kernel cannot end early: a held pool's position in the
gathered buffer is not its logical position).

Supported: every implementation above, ``attention="sparse"``, float and fp8 caches, full
and shared layers, NoPE and RoPE, with ``axis`` (and a ``batch_axis``: one page table per
data shard as before, its pages split over cp within the shard), eager and jitted,
``PagedDecoder`` (one compilation per chunk length) including ``release``; ``rollback``,
``fork`` (its partial page copied by a gather onto every device and a scatter each device
applies to the pages it holds, ``cache.fork``) and ``export`` / ``load`` (an export of any
placement loads into a cp cache, the placement kept) run their jitted global-view
programs on the split pools (``tests/test_context_parallel_paged.py``: ``"xla"``,
``"pallas_interpret"`` and ``"mosaic_interpret"`` against the unsharded paged layer of the
same implementation, and the GLM-5.3-Flash decode step with a 1M-token paged cache at cp 8
lowered for CUDA, ``"pallas"`` at tp 1 and 8, ``"mosaic"`` at tp 1; never run on a GPU
here). Not supported: a name outside ``PAGED_CP_IMPLEMENTATIONS`` (``ValueError`` at
``init_paged_cache`` and at the call, ``check_supported``), ``attention="dense"``
(refused for any paged cache), autodiff under the Pallas and Mosaic implementations
(``sparse_mla_partial`` has no gradient there; under ``"xla"`` untested with a paged
cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from glm5_dsa_jax.cache.fp8 import index_queries
from glm5_dsa_jax.cache.paged import token_slots
from glm5_dsa_jax.parallel.context import (CP_IMPLEMENTATIONS, held_ids, merge_candidates, merge_partials, row_split,
                                           select_split, splits_queries)

__all__ = ["forward", "held_pages", "check_supported", "PAGED_CP_IMPLEMENTATIONS"]

#: The implementations a paged cache under context parallelism runs: every one the contiguous
#: cp path runs (``context.CP_IMPLEMENTATIONS``); each step of a shard runs the layer's own kernel.
PAGED_CP_IMPLEMENTATIONS = CP_IMPLEMENTATIONS


def check_supported(implementation: str, seq_axis: str) -> None:
    """``ValueError`` unless a layer of ``implementation`` can split a paged cache's pools
    over ``seq_axis``."""
    if implementation not in PAGED_CP_IMPLEMENTATIONS:
        raise ValueError(
            f"a paged cache under context parallelism (seq_axis={seq_axis!r}) supports implementation in "
            f"{PAGED_CP_IMPLEMENTATIONS}, got {implementation!r}: build the layer with one of them "
            "(a layer resolves 'auto' when built)")


def held_pages(block_table: jax.Array, page_offset, n_local: int) -> tuple[jax.Array, jax.Array]:
    """``(logical [B, PGL], local [B, PGL])`` int32: per sequence, the block-table slots
    (logical pages) whose physical page this shard holds (pages ``page_offset ..
    page_offset + n_local - 1``), ascending, and those pages' local ids; ``-1`` after.
    ``PGL = min(pages_per_seq, n_local)``: a sequence cannot hold more of this shard's pages."""
    pg = block_table.shape[1]
    local = held_ids(block_table, page_offset, n_local)
    order = jnp.argsort(local < 0, axis=1, stable=True)[:, :min(pg, n_local)]  # held first, in order
    local = jnp.take_along_axis(local, order, axis=1)
    return jnp.where(local >= 0, order, -1).astype(jnp.int32), local


def _select(layer, held, qi, w, q_pos, select_k, seq_axis):
    """The merged global top-``select_k`` logical pool ids ``[B, Q, select_k]`` (module doc)."""
    keys, scale, pool, valid = held
    b = keys.shape[0]
    kp = layer.cfg.index_kpool
    with jax.named_scope("score_pools"):  # every held pool a candidate here, then the logical rule
        big = jnp.full_like(q_pos, jnp.iinfo(jnp.int32).max // 2)
        scores = pk.index_scores(qi, w, keys, valid, jnp.zeros((b,), jnp.int32), big, scale, kpool=kp,
                                 implementation=layer.implementation)
        visible = (pool[:, None, :] + 1) * kp - 1 <= q_pos[..., None]
        scores = jnp.where(visible, scores, -jnp.inf)
    with jax.named_scope("select_pools"):
        k_loc = min(select_k, pool.shape[1])
        # The held pools are in ascending logical order, so each query's candidates are a
        # prefix of them: a Pallas top-k reads only that prefix (its live bound per shard).
        n_live = None
        if layer.implementation != "xla":
            n_live = jnp.sum(visible & valid[:, None, :], axis=-1, dtype=jnp.int32)
        local = pk.topk_pools(scores, k_loc, implementation=layer.implementation, n_live=n_live)
        key = pk.order_key(jnp.take_along_axis(scores, jnp.maximum(local, 0), axis=-1))
        key = jnp.where(local >= 0, key, pk.order_key(jnp.full((), -jnp.inf, jnp.float32)))
        ids = jnp.where(local >= 0, jnp.take_along_axis(jnp.broadcast_to(pool[:, None], scores.shape),
                                                        jnp.maximum(local, 0), axis=-1), -1)
        all_keys = jax.lax.all_gather(key, seq_axis, axis=2, tiled=True)  # [B, Q, cp * K']
        all_ids = jax.lax.all_gather(ids, seq_axis, axis=2, tiled=True)
        return merge_candidates(all_keys, all_ids, select_k)


def forward(layer, x, mask, cache, prev_topk, position_ids=None, *, reduce_axis=None, seq_axis: str,
            attention: str = "sparse"):
    """``(out, topk, cache)``: ``DsaAttention.forward`` of ``layer`` on this device's block
    of a paged cache's pools split over ``seq_axis`` (module doc), inside the call's
    ``shard_map``. Same inputs and outputs as ``DsaAttention.forward`` (``out`` and ``topk``
    replicated over ``seq_axis``)."""
    if attention != "sparse":
        raise ValueError(f"context parallelism (seq_axis={seq_axis!r}) supports attention='sparse' only, "
                         f"got attention={attention!r}")
    check_supported(layer.implementation, seq_axis)
    cfg = layer.cfg
    n_loc = cache.num_pages  # this shard's pages
    page_off = jax.lax.axis_index(seq_axis) * n_loc
    ps = cache.page_size
    cache, chunk = cache.begin_chunk(mask)  # the replicated page table: the same on every device
    mask = chunk.mask
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    rope = layer.rope(chunk.positions if position_ids is None else position_ids)
    rows_of, gathered = row_split(x.shape[1], layer.placement.seq_shards, jax.lax.axis_index(seq_axis), seq_axis)
    x_mine, rope_mine = rows_of(x), None if rope is None else tuple(rows_of(r) for r in rope)
    q_resid, q_lat, latent = layer.project(x_mine, rope_mine)
    idx = None if layer.indexer is None else layer.indexer.project(x_mine, q_resid, rope_mine)
    q_lat, latent, idx = gathered((q_lat, latent, idx))
    cache = cache.write_latent_held(latent, chunk, page_off)
    rows, row_scale = cache.attention_rows()

    def attend(q_lat, token_ids):  # this shard's part, merged over the sequence axis
        slots = held_ids(token_slots(cache.block_table, token_ids, ps), page_off * ps, n_loc * ps)
        with jax.named_scope("sparse_attention"):
            part, lse = pk.sparse_mla_partial(q_lat, rows, slots, row_scale, scale=cfg.softmax_scale,
                                              value_width=cfg.kv_lora_rank, implementation=layer.implementation)
            return merge_partials(part, lse, seq_axis).astype(q_lat.dtype)

    if layer.indexer is not None:
        kp = cfg.index_kpool
        qi, w, ki, gate = idx
        with jax.named_scope("compress_pools"):
            win = cache.pool_window(ki, gate, chunk)
            pooled, _, pooled_valid = pk.kpool_compress(win.keys, win.gate, win.valid,
                                                        layer.indexer.pool_ape(win.keys.dtype), win.first_pool,
                                                        implementation=layer.implementation)
            cache = cache.store_pools_held(win, pooled, pooled_valid, chunk, page_off)
        qi = index_queries(qi, cache.rotate_index, cache.index_format)
        select_k = cfg.select_k(cache.max_pools)
        cp, s = layer.placement.seq_shards, x.shape[1]
        logical, local = held_pages(cache.block_table, page_off, n_loc)
        width = local.shape[1] * cache.pools_per_page  # the pools a shard scores per sequence
        chosen = None
        if splits_queries(s, cp, select_k, max(1, n_loc * cache.pools_per_page // max(1, cache.max_seqs)),
                          cache.pool_row_bytes(), k_loc=min(select_k, width)):
            chosen = select_split(layer, cache.gathered_pools(seq_axis), qi, w, chunk.q_pos, select_k, cp,
                                  jax.lax.axis_index(seq_axis), seq_axis)
        held = None if chosen is not None else cache.held_pool_keys(logical, local)

        def tile(q_lat, q_pos, qi, w, n_vis, pools):
            if chosen is None:
                pools = _select(layer, held, qi, w, q_pos, select_k, seq_axis)
            with jax.named_scope("expand_to_tokens"):
                tail = cache.visible_tail(pools, n_vis, q_pos, kp) if cfg.tail_width else None
                token_ids = pk.expand_selection(pools, cache.pool_origin(), tail, kpool=kp, out_width=cfg.out_width,
                                                implementation=layer.implementation)
                token_ids = jnp.where(q_pos[..., None] >= 0, token_ids, -1)
            return token_ids, attend(q_lat, token_ids)

        pools = chosen if chosen is not None else jnp.zeros(chunk.q_pos.shape + (0,), jnp.int32)  # unused: key split
        topk, o_lat = layer.by_query_tiles(tile, layer.block_q, (q_lat, 0), (chunk.q_pos, -1), (qi, 0), (w, 0),
                                           (chunk.n_vis, 0), (pools, -1))
    else:
        topk = layer.reused_token_ids(prev_topk, chunk.q_pos)
        _, o_lat = layer.by_query_tiles(lambda q_lat, ids: (ids, attend(q_lat, ids)), layer.block_q, (q_lat, 0),
                                        (topk, -1))
    out = gathered(layer.output_projection(rows_of(o_lat), rows_of(mask), reduce_axis=reduce_axis))
    return out, topk, cache.end_chunk(chunk)
