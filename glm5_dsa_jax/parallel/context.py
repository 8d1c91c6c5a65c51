"""Context parallelism: one sequence's contiguous cache split over a mesh axis, for decode and chunked prefill.

``shard_layer(layer, mesh, axis="tp", batch_axis=None, seq_axis="cp")`` records the
sequence axis on the layer's ``Placement``; its contiguous caches (``DsaCache``) then hold
a contiguous range of the timeline on each device of that axis (``DsaCache.TOKEN_AXIS_FIELDS``
on axis 1: device ``i`` of ``cp`` holds slots ``[i * L/cp, (i+1) * L/cp)`` of the latent
rows and their validity, and pools ``[i * P/cp, (i+1) * P/cp)`` of the pooled keys and their
validity), and a call with such a cache runs ``forward`` here as the body of the call's
one ``shard_map`` (``parallel.execution``), instead of ``DsaAttention.forward``. It reads and
writes a shard through the cache's own operations (``attention_rows``, ``pool_keys``,
``contiguous.scatter_rows``, ``window_of``, ``stored_pools``): only the cache package
touches the stored buffers.

``forward`` is the layer's pipeline (``DsaAttention``'s class doc) with the three steps that
read token-axis state done per shard and merged:

* **Projections** (``row_split``). The call's rows are replicated over the sequence axis;
  a prefill chunk of ``S`` rows is split: each device projects ``ceil(S / cp)`` of them
  (``DsaAttention.project`` and the indexer's), and the projected rows (``q_lat``, the
  latent rows, the indexer's queries, weights, keys and gate logits) are all-gathered once;
  after the attention each device runs ``output_projection`` (``absorb_o``, ``o_proj`` and
  its tp ``psum``) on its rows and the outputs are all-gathered. Every projection is row by
  row, so a gathered row is the row every device would have computed. Bytes in: per chunk
  row ``2 * (H_local * CR + CR + Hi * D + D) + 4 * (Hi + D)`` (bf16; ~19 KiB at
  GLM-5.3-Flash on tp 8, the ``q_lat`` of 8 local heads most of it), and ``2 * hidden`` out.
  A decode step (one row) is not split: its projections are a few rows' work.
* **Writes.** Every device writes only the latent rows and pools that fall in its range
  (``contiguous.scatter_rows``, ``contiguous.stored_pools``); the replicated bookkeeping (``length``,
  the incomplete pool's stage, ``first_key``, ``n_valid``) is computed identically on
  every device, so it stays replicated without a collective.
* **Selection** (a full layer), by the key split or the query split, whichever sends fewer
  bytes (``splits_queries``, from static shapes: a decode step and a short chunk the key
  split, a long prefill chunk the query split); both give the unsharded layer's ids bit
  for bit.

  *Query split* (``select_split``): the pool fields are all-gathered once
  (``contiguous.gathered_pools``: the pooled keys, 128 values a pool, are exchanged, not
  recomputed from the latent rows), and each device runs the unsharded layer's own
  ``choose_pools`` (its short-context path, its kernels, under ``"xla"`` streamed over pool
  tiles: ``stream=True``) for its rows of the chunk in the zig-zag order (``zigzag_split``:
  ``2 cp`` blocks, device ``i`` taking blocks ``i`` and ``2 cp - 1 - i``, so the causal work
  of early and late rows is shared evenly); the chosen ids are all-gathered. Bytes in per
  device: ``(cp - 1) / cp`` of ``P`` pools (``D`` stored values, a flag and any fp8 scale
  each) and of ``S * select_k * 4``. No device builds a ``[queries, pools]`` score matrix
  (a ``block_q`` tile of queries times a pool tile at a time).

  *Key split* (``_select``): each device scores the pools it holds
  (``pk.index_scores`` over its range, whose pool grid starts ``i * P/cp`` pools after
  ``first_key``: the same candidate rule and the same per-pool arithmetic as the whole
  row's) and keeps its best ``K' = min(select_k, P/cp)`` by ``pk.topk_pools``; the
  candidates (``order_key`` int32 and global pool id int32) are all-gathered over the
  sequence axis and merged by ``merge_candidates``: the ``select_k`` best under ``topk_pools``'
  total order (higher key first, the lower pool id on equal keys; ``-inf`` never), listed
  ascending, ``-1`` after. Each device's ``K'`` best under that order contain every one of
  its pools in the global best ``select_k``, so the merged ids are the unsharded layer's
  bit for bit. (Every row is scored: the unsharded layer's short-context path, which
  selects every candidate without a score, gives the same ids unless a score is NaN,
  which only non-finite inputs make; ``pk.visible_pool_ids``.) The expansion to tokens is replicated; the visible tail's validity
  (``key_valid`` at the ``KP - 1`` tail slots) is read where it lives and ``psum``-ed.
* **Attention**: each device attends over the selected tokens it holds (the others are
  ``-1`` for it: ``pk.sparse_mla_partial``), returning its partial output and log-sum-exp;
  the partials are merged by ``merge_partials`` (``pmax`` of the log-sum-exp, ``psum`` of
  the weighted outputs and weights), exact up to float rounding. Then ``o_proj`` as
  everywhere (its ``psum`` over the head axis).

Bytes crossing devices per step and query row, independent of the context length (the
collectives' operands; a ring all-gather or all-reduce moves about as much per device):
the candidates' all-gather ``cp * K' * 8`` (an int32 key and an int32 id each), the
tail's validity ``psum`` ``(KP - 1) * 4``, the partials' ``psum`` ``H_local * (V + 1) * 4``
(float32 outputs and weights) and ``pmax`` ``H_local * 4``. At GLM-5.3-Flash decode
(``select_k`` 512, ``KP`` 4, ``V`` 512, 64 heads on tp 8: 8 local heads) with cp 8: 32 KiB
of candidates and 16 KiB of partials per query, where a 1M-token cache is ~1 GiB per layer
(1,089 B a token in bf16). ``tests/test_context_parallel.py`` reads these collectives in
the compiled decode step: the same ops on the same shapes at 64 and 1024 slots.

**Kernels per shard.** Every step runs the layer's own implementation
(``layer.implementation``, one of ``CP_IMPLEMENTATIONS``: ``"xla"``, ``"pallas"``,
``"mosaic"`` and their interpret forms) on the device's shard: ``pk.kpool_compress`` on the
window, ``pk.index_scores`` over the pools it holds, ``pk.topk_pools`` for its ``K'``
candidates, ``pk.expand_selection``, and ``pk.sparse_mla_partial``, which returns the
output of the same kernel launch ``pk.sparse_mla`` makes and its log-sum-exp (Triton: the
kernel's ``lse`` output; Mosaic: ``return_lse``; a step or dtype without a Mosaic kernel
falls back to Triton as in the unsharded layer). The merges (``merge_candidates``,
``merge_partials``, the tail's ``psum``) are plain jnp and collectives whatever the
implementation. The live bound per shard: the Triton and Mosaic scoring kernels end a tile
past the pools its queries can see (the shard's pool grid starts ``pool_off`` pools after
``first_key``), and their top-k reads only the shard's visible pools (``n_live`` cut to the
shard's range), so a shard past the live tokens costs one empty pass. The ``"xla"`` path
runs the unsharded layer's streaming top-k per shard (``pk.streaming_topk`` over the live
pool tiles of the shard's grid, ``with_keys`` for the candidates' order keys): a shard
reads the pools its queries can see, ``[Q, Hi, tile]`` scores at a time.

Supported here (the first slices of issue 27): the contiguous cache, every implementation
above, float and fp8 caches (rows quantised as ``append_rows`` does, each shard writing its
own), ``attention="sparse"``, full and shared layers, NoPE and RoPE, combined with ``axis``
and ``batch_axis``, eager and under ``jax.jit``, ``DsaDecoder`` / ``make_step`` (one
compilation per chunk length; ``rollback`` through it). A chunk's queries are replicated
over the sequence axis and run in tiles of ``block_q`` (``DsaAttention.by_query_tiles``, as
in ``DsaAttention.forward``): a device builds one ``block_q`` tile's scores of one pool tile
(``"xla"``) or of its ``P/cp`` pools (the kernels) at a time, so the
indexer's scoring and the attention are split by the pools and tokens a device holds, and
the projections by rows (above), a long chunk's selection by zig-zag rows (the query split),
the attention by the tokens each device holds (every device attends every query of the
chunk over its own rows: a chunk's absorbed queries are on every device). Peak memory per
device against the unsharded prefill: docs/parallelism.md (XLA's memory analysis at 1M
tokens). Not supported yet (``ValueError``): ``attention="dense"``. The paged cache under
cp: ``parallel.context_paged`` (every implementation too). Autodiff: ``jax.grad`` of a chunk under
``"xla"`` equals the unsharded layer's (parameters and ``x``; ``tests/test_cp_grad.py``);
under the Pallas and Mosaic implementations not possible (``sparse_mla_partial`` has no
gradient there). Checked on CPU (``tests/test_context_parallel.py``): ``"xla"`` on every
mesh, ``"pallas_interpret"`` and ``"mosaic_interpret"`` against the unsharded layer, and
the decode step of GLM-5.3-Flash at cp 8 (tp 1 and 8) lowered for CUDA (``"pallas"``,
``"mosaic"``), and a 4,096-token prefill chunk at (cp, tp) = (8, 8); never run on a GPU here. A call without a cache runs the plain pipeline whole
on every device of the sequence axis (no split).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from glm5_dsa_jax.cache.contiguous import (gathered_pools, live_pool_tiles, pool_row_bytes, scatter_rows,
                                           stored_pools, window_of)
from glm5_dsa_jax.cache.fp8 import index_queries
from glm5_dsa_jax.cache.interface import Chunk, tile_scorer

__all__ = ["forward", "merge_candidates", "merge_partials", "held_ids", "row_split", "zigzag_split",
           "splits_queries", "select_split", "check_supported", "CP_IMPLEMENTATIONS"]

#: The implementations a context-parallel layer runs: every one a layer holds (``"auto"`` is
#: resolved when the layer is built). Each step of a shard runs the layer's own kernel.
CP_IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret")

_BIG = jnp.iinfo(jnp.int32).max


def _neg_inf_key():
    """``order_key(-inf)``: the key of a pool that is never selected."""
    return pk.order_key(jnp.full((), -jnp.inf, jnp.float32))


def check_supported(implementation: str, seq_axis: str) -> None:
    """``ValueError`` unless a layer of ``implementation`` can split its tokens over ``seq_axis``
    (one of ``CP_IMPLEMENTATIONS``: a resolved implementation)."""
    if implementation not in CP_IMPLEMENTATIONS:
        raise ValueError(
            f"context parallelism (seq_axis={seq_axis!r}) supports implementation in {CP_IMPLEMENTATIONS}, "
            f"got {implementation!r}: build the layer with one of them (a layer resolves 'auto' when built)")


def merge_candidates(keys: jax.Array, ids: jax.Array, select_k: int) -> jax.Array:
    """``[..., select_k]`` int32 pool ids: the ``select_k`` best of the candidates ``keys
    [..., N]`` (``order_key`` int32) with global pool ids ``ids [..., N]`` (``-1``: none)
    under ``topk_pools``' rule: higher key first, the lower id on equal keys, never a key
    of ``-inf`` (``NEG_INF_KEY``); listed in ascending id order, then ``-1``."""
    valid = (ids >= 0) & (keys > _neg_inf_key())
    neg = jnp.where(valid, -keys, _BIG)
    idk = jnp.where(valid, ids, _BIG)
    neg, idk = jax.lax.sort((neg, idk), dimension=-1, num_keys=2)
    n = idk.shape[-1]
    top = idk[..., :select_k]
    if n < select_k:
        top = jnp.concatenate([top, jnp.full(top.shape[:-1] + (select_k - n,), _BIG, jnp.int32)], -1)
    top = jnp.sort(top, axis=-1)
    return jnp.where(top < _BIG, top, -1).astype(jnp.int32)


def merge_partials(out: jax.Array, lse: jax.Array, seq_axis: str) -> jax.Array:
    """The attention over every device's tokens from each device's part ``out [B, Q, H,
    V]`` and ``lse [B, Q, H]`` (``pk.sparse_mla_partial``), in float32, inside a
    ``shard_map`` over ``seq_axis``; zeros where no device holds a token of the row."""
    m = jax.lax.pmax(jax.lax.stop_gradient(lse), seq_axis)  # a shift the result does not depend on
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)  # 0 where this device holds none (lse = -inf)
    num = jax.lax.psum(out.astype(jnp.float32) * w[..., None], seq_axis)
    den = jax.lax.psum(w, seq_axis)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def held_ids(ids, offset, size):
    """Global ids -> this shard's own index (``-1`` where another shard holds the id)."""
    local = ids - offset
    return jnp.where((ids >= 0) & (local >= 0) & (local < size), local, -1)


def _tail(cache, pools, n_vis, q_pos, kpool, length, tok_off, seq_axis):
    """``DsaCache.visible_tail`` with ``key_valid`` split over ``seq_axis``: the tail slots
    of ``pk.visible_tail``, their validity read by the shard that holds each and summed."""
    first_key = cache.first_key
    ids, ok = pk.tail_slots(first_key, n_vis, q_pos, kpool, length)
    size = cache.key_valid.shape[1]
    local = held_ids(jnp.where(ok, ids, -1), tok_off, size)
    held = jnp.take_along_axis(cache.key_valid, jnp.clip(local, 0, size - 1).reshape(local.shape[0], -1), axis=1)
    held = (held.reshape(local.shape) & (local >= 0)).astype(jnp.int32)
    ok &= jax.lax.psum(held, seq_axis) > 0
    tail = jnp.where(ok, ids, -1).astype(jnp.int32)
    t_pool = jnp.where(tail >= 0, (tail - first_key[:, None, None]) // kpool, -2)
    return jnp.where((t_pool[..., None] == pools[..., None, :]).any(-1), -1, tail)


def _select(layer, cache, qi, w, q_pos, select_k, pool_off, seq_axis):
    """The merged global top-``select_k`` pool ids ``[B, Q, select_k]`` (module doc)."""
    kp = layer.cfg.index_kpool
    p_loc = cache.max_pools  # this shard's
    k_loc = min(select_k, p_loc)
    if layer.implementation == "xla":  # the unsharded layer's streaming top-k over the live tiles
        with jax.named_scope("select_pools"):
            shard = cache.replace(first_key=cache.first_key + pool_off * kp)  # its grid from its first pool
            tile = layer.pool_tile(qi.shape, p_loc)
            local, key = pk.streaming_topk(tile_scorer(tile, kp), (qi, w, q_pos, shard.pool_keys()),
                                           live_pool_tiles(shard.live_pools(q_pos), tile), tile=tile,
                                           n_pools=p_loc, select_k=k_loc, rows=q_pos.shape, with_keys=True)
            return _merged(key, local, pool_off, select_k, seq_axis)
    source = cache.pool_keys()
    keys, valid, first_key = source.operands()
    with jax.named_scope("score_pools"):  # this shard's pool grid starts pool_off pools in
        scores = pk.index_scores(qi, w, keys, valid, first_key + pool_off * kp, q_pos, source.scale,
                                 kpool=kp, implementation=layer.implementation)
    with jax.named_scope("select_pools"):
        # The pools of this shard each query can see (its live bound: a Pallas top-k reads
        # no further, so a shard past the live tokens costs one empty pass, not P/cp pools).
        seen = jnp.maximum(q_pos - first_key[:, None] + 1, 0) // kp
        n_live = jnp.clip(seen - pool_off, 0, p_loc).astype(jnp.int32)
        local = pk.topk_pools(scores, k_loc, implementation=layer.implementation, n_live=n_live)
        key = pk.order_key(jnp.take_along_axis(scores, jnp.maximum(local, 0), axis=-1))
        return _merged(jnp.where(local >= 0, key, _neg_inf_key()), local, pool_off, select_k, seq_axis)


def _merged(key, local, pool_off, select_k, seq_axis):
    """The key split's merge: this shard's candidates (order keys ``key`` of its local pool
    ids ``local``, ``-1``: none) all-gathered over ``seq_axis`` with their global ids and
    merged (``merge_candidates``)."""
    ids = jnp.where(local >= 0, local + pool_off, -1)
    all_keys = jax.lax.all_gather(key, seq_axis, axis=2, tiled=True)  # [B, Q, cp * K']
    all_ids = jax.lax.all_gather(ids, seq_axis, axis=2, tiled=True)
    return merge_candidates(all_keys, all_ids, select_k)


def splits_queries(s: int, cp: int, select_k: int, p_loc: int, pool_bytes: int, k_loc: int | None = None) -> bool:
    """Whether a chunk of ``s`` queries selects by the query split (``select_split``: the
    pools gathered, each device selecting for its ``s / cp`` rows) rather than the key split
    (``_select``: each device's candidates merged): when it sends fewer bytes. Per device,
    the split receives ``(cp - 1)`` shards of ``p_loc`` pools of ``pool_bytes`` each and its
    ``s * select_k`` ids' ``(cp - 1) / cp``; the key split ``(cp - 1)`` shards of ``s * K'``
    candidates of 8 bytes (``k_loc``: ``K'``, default ``min(select_k, p_loc)``; a paged
    shard's is its scoring width's). So a decode step (``s = 1``) or a short verify chunk
    never splits (its bytes stay independent of the context) and a long prefill chunk does."""
    if s == 1 or cp == 1:
        return False
    k_loc = min(select_k, p_loc) if k_loc is None else k_loc
    return p_loc * pool_bytes + s * select_k * 4 / cp <= s * k_loc * 8


def select_split(layer, full, qi, w, q_pos, select_k, cp, shard, seq_axis):
    """The query split of a chunk's selection (module doc): ``[B, S, select_k]`` pool ids,
    each device running the unsharded layer's own ``choose_pools`` (every implementation,
    its short-context path, its streaming ``"xla"`` top-k) for its zig-zag rows of the
    chunk over ``full`` (``gathered_pools``: every pool of the timeline), in ``block_q``
    tiles, then the ids all-gathered. The unsharded layer's ids bit for bit: the same
    code on the same pools for each query."""
    rows_of, gathered = zigzag_split(q_pos.shape[1], cp, shard, seq_axis)

    def tile(qi, w, q_pos):
        return layer.choose_pools(qi, w, full, q_pos, select_k, stream=True)

    mine = layer.by_query_tiles(tile, layer.block_q, (rows_of(qi), 0), (rows_of(w), 0), (rows_of(q_pos, -1), -1))
    return gathered(mine)


def forward(layer, x, mask, cache, prev_topk, position_ids=None, *, reduce_axis=None, seq_axis: str,
            attention: str = "sparse"):
    """``(out, topk, cache)``: ``DsaAttention.forward`` of ``layer`` on this device's shard
    of a contiguous cache split over ``seq_axis`` (module doc), inside the call's
    ``shard_map``. Same inputs and outputs as ``DsaAttention.forward`` (``out`` and ``topk``
    replicated over ``seq_axis``)."""
    if attention != "sparse":
        raise ValueError(f"context parallelism (seq_axis={seq_axis!r}) supports attention='sparse' only, "
                         f"got attention={attention!r}")
    if getattr(cache, "pages", None) is not None:
        raise ValueError(f"context parallelism (seq_axis={seq_axis!r}) supports the contiguous cache "
                         "(DsaCache) only, not the paged one")
    cfg = layer.cfg
    cp = layer.placement.seq_shards
    shard = jax.lax.axis_index(seq_axis)
    l_loc = cache.max_length  # this shard's slots
    length = l_loc * cp  # the whole timeline's capacity
    tok_off = shard * l_loc
    b, s = mask.shape
    start = cache.length
    slots = start + jnp.arange(s, dtype=jnp.int32)[None]
    n_vis = None if cache.n_valid is None else cache.n_valid[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32)
    chunk = Chunk(mask=mask, q_pos=jnp.where(mask, slots, -1), positions=jnp.broadcast_to(slots, (b, s)),
                  n_vis=n_vis, fits=start + s <= length, start=start)
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    rope = layer.rope(chunk.positions if position_ids is None else position_ids)
    rows_of, gathered = row_split(s, cp, shard, seq_axis)
    x_mine, rope_mine = rows_of(x), None if rope is None else tuple(rows_of(r) for r in rope)
    q_resid, q_lat, latent = layer.project(x_mine, rope_mine)
    idx = None if layer.indexer is None else layer.indexer.project(x_mine, q_resid, rope_mine)
    q_lat, latent, idx = gathered((q_lat, latent, idx))
    local_slots = held_ids(jnp.broadcast_to(slots, (b, s)), tok_off, l_loc)[0]
    cache = scatter_rows(cache, latent, mask, local_slots, chunk.fits)
    rows, row_scale = cache.attention_rows()

    def attend(q_lat, token_ids):  # this shard's part, merged over the sequence axis
        with jax.named_scope("sparse_attention"):
            part, lse = pk.sparse_mla_partial(q_lat, rows, held_ids(token_ids, tok_off, l_loc), row_scale,
                                              scale=cfg.softmax_scale, value_width=cfg.kv_lora_rank,
                                              implementation=layer.implementation)
            return merge_partials(part, lse, seq_axis).astype(q_lat.dtype)

    if layer.indexer is not None:
        kp = cfg.index_kpool
        p_loc = cache.max_pools  # this shard's
        n_pools = p_loc * cp
        pool_off = shard * p_loc
        qi, w, ki, gate = idx
        with jax.named_scope("compress_pools"):
            win = window_of(cache, ki, gate, chunk, length)
            pooled, _, pooled_valid = pk.kpool_compress(win.keys, win.gate, win.valid,
                                                        layer.indexer.pool_ape(win.keys.dtype), win.first_pool,
                                                        implementation=layer.implementation)
            cache = stored_pools(cache, win, pooled, pooled_valid, chunk, max_pools=n_pools, pool_offset=pool_off)
        qi = index_queries(qi, cache.rotate_index, cache.index_format)
        select_k = cfg.select_k(n_pools)
        chosen = None
        if splits_queries(s, cp, select_k, p_loc, pool_row_bytes(cache)):
            chosen = select_split(layer, gathered_pools(cache, seq_axis), qi, w, chunk.q_pos, select_k, cp, shard,
                                   seq_axis)

        def tile(q_lat, q_pos, qi, w, n_vis, pools):
            if chosen is None:
                pools = _select(layer, cache, qi, w, q_pos, select_k, pool_off, seq_axis)
            with jax.named_scope("expand_to_tokens"):
                tail = _tail(cache, pools, n_vis, q_pos, kp, length, tok_off, seq_axis) if cfg.tail_width else None
                token_ids = pk.expand_selection(pools, cache.first_key, tail, kpool=kp, out_width=cfg.out_width,
                                                implementation=layer.implementation)
                token_ids = jnp.where(q_pos[..., None] >= 0, token_ids, -1)
            return token_ids, attend(q_lat, token_ids)

        pools = chosen if chosen is not None else jnp.zeros((b, s, 0), jnp.int32)  # unused without the split
        topk, o_lat = layer.by_query_tiles(tile, layer.block_q, (q_lat, 0), (chunk.q_pos, -1), (qi, 0), (w, 0),
                                           (chunk.n_vis, 0), (pools, -1))
    else:
        topk = layer.reused_token_ids(prev_topk, chunk.q_pos)
        _, o_lat = layer.by_query_tiles(lambda q_lat, ids: (ids, attend(q_lat, ids)), layer.block_q, (q_lat, 0),
                                  (topk, -1))
    out = gathered(layer.output_projection(rows_of(o_lat), rows_of(mask), reduce_axis=reduce_axis))
    return out, topk, cache.end_chunk(chunk)


def row_split(s: int, cp: int, shard, seq_axis: str):
    """``(rows_of, gathered)`` for a chunk of ``s`` rows: ``rows_of(a)`` this device's
    ``ceil(s / cp)`` rows of ``a [B, s, ...]`` (the chunk padded with zeros to a multiple of
    ``cp``), ``gathered(tree)`` the whole chunk's ``[B, s, ...]`` from every device's rows
    (``all_gather`` over ``seq_axis``). A decode step (``s = 1``) is not split: both are
    the identity. Row ``t`` of a projection depends on row ``t`` of its input only, so a
    row computed on one device and gathered is the row every device would compute."""
    if s == 1 or cp == 1:
        return (lambda a: a), (lambda tree: tree)
    n = -(-s // cp)

    def rows_of(a):
        a = jnp.pad(a, [(0, 0), (0, n * cp - s)] + [(0, 0)] * (a.ndim - 2))
        return jax.lax.dynamic_slice_in_dim(a, shard * n, n, axis=1)

    def gathered(tree):
        return jax.tree.map(lambda a: jax.lax.all_gather(a, seq_axis, axis=1, tiled=True)[:, :s], tree)

    return rows_of, gathered


def zigzag_split(s: int, cp: int, shard, seq_axis: str):
    """``(rows_of, gathered)`` as ``row_split``'s, with the zig-zag assignment of rows: the
    chunk (padded to ``2 * cp * m`` rows, ``m = ceil(s / (2 cp))``) cut into ``2 cp``
    blocks of ``m``, device ``i`` taking blocks ``i`` and ``2 cp - 1 - i``. A query's
    causal work grows with its row, so each device gets an early and a late block: equal
    work to a block's difference. ``rows_of(a, fill=0)`` pads with ``fill`` (``-1`` for a
    query position: a padding query); ``gathered`` joins every device's rows back in row
    order (one ``all_gather``)."""
    m = -(-s // (2 * cp))

    def rows_of(a, fill=0):
        a = jnp.pad(a, [(0, 0), (0, 2 * cp * m - s)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        early = jax.lax.dynamic_slice_in_dim(a, shard * m, m, axis=1)
        late = jax.lax.dynamic_slice_in_dim(a, (2 * cp - 1 - shard) * m, m, axis=1)
        return jnp.concatenate([early, late], axis=1)

    def join(a):  # [B, 2m, ...] on each device -> [B, s, ...]
        g = jax.lax.all_gather(a, seq_axis, axis=0)  # [cp, B, 2m, ...]
        early = jnp.moveaxis(g[:, :, :m], 0, 1)  # blocks 0 .. cp-1
        late = jnp.moveaxis(g[::-1, :, m:], 0, 1)  # blocks cp .. 2cp-1
        both = jnp.concatenate([early, late], axis=1)  # [B, 2cp, m, ...]
        return both.reshape((both.shape[0], 2 * cp * m) + both.shape[3:])[:, :s]

    return rows_of, lambda tree: jax.tree.map(join, tree)
