"""Flax NNX module of one DSA layer: the lightning indexer (``glm5_dsa_jax.indexer``) and
weight-absorbed sparse MLA, for the three model types of ``DsaConfig`` (GLM-5.3-Flash's NoPE
``glm5_next``; ``glm_moe_dsa`` and ``deepseek_v32`` with a RoPE part).

Invariants:

* Parameters are the rows of the layout table (``glm5_dsa_jax.layout``: names, shapes,
  initialisers, creation order), stored in JAX layout (``[in, out]``, heads as their own
  axis), and carry their tensor-parallel placement as ``out_sharding`` metadata: the head
  axis of ``q_b_proj``, ``w_uk``, ``w_uv`` and ``o_proj`` is named ``tp_axis``; everything
  else, the whole indexer included, is replicated (see ``glm5_dsa_jax.plan`` for why).
* ``kv_b_proj`` is split once, at load, into ``w_uk [heads, qk_nope, kv_lora]`` and
  ``w_uv [heads, v_head, kv_lora]``; attention then runs in the ``kv_lora_rank``-wide
  latent space (``absorb_q`` before, ``absorb_o`` after), reading one latent row per
  selected token for all heads. With RoPE a row also carries the shared roped key (``[c,
  k_rot]``, ``kv_cache_dim`` wide) and the query its roped part: the score is ``q_lat . c
  + q_rot . k_rot``, the values ``c`` (``sparse_mla(..., value_width=kv_lora_rank)``).
* Two cache kinds: the contiguous ``DsaCache`` (one timeline for the batch, as HF's
  ``DynamicCache``; RoPE positions are its slots) and the paged ``PagedCache`` (a sequence
  per row, positions within it; the call goes to ``glm5_dsa_jax.paged_step``). Either may be
  fp8 (``glm5_dsa_jax.fp8``): rows are quantised by the cache's writes, and the scales go
  with the rows to the kernels (``score_pools``, ``score_and_select``, ``sparse_attention``).
* Every call goes through the same path, with or without a cache: a call without a cache
  runs on a fresh cache sized to the input. Prefill rows are processed in tiles of
  ``block_q`` queries, so no ``[S, S]`` or ``[S, pools]`` tensor is ever built.
* A padding query gets a top-k row of ``-1`` and an output of zeros; a padding token's
  hidden state is zeroed before any projection, so a NaN there goes nowhere.
* On a CPU the compiled step (``decode.make_step``) multiplies by float32 copies of 16-bit
  parameters (XLA:CPU's bf16 matrix-vector product is over ten times slower), cached and
  never written back (``glm5_dsa_jax.float32_copies``); each product still rounds to the
  activation dtype. ``cpu_float32=False`` opts out; other platforms never use the copies.
* One method per pipeline step (class doc), each under ``jax.named_scope`` of its own
  name (``glm5_dsa_jax.steps``): the contiguous call (``contiguous_step.contiguous_call``), the paged one
  (``paged_step.paged_call``) and the data-parallel one (``data_parallel.dp_call``, which
  runs this call per device) all run these methods, so no step is written twice. A step
  that reads the cache takes either kind and picks its kernel by the cache's kind.
* The layer is placed on a mesh by ``shard_layer`` (``self.mesh``); how each step then
  runs (per head shard or replicated) is ``glm5_dsa_jax.parallel``'s part, and with a
  ``batch_axis`` (data parallelism) the whole call is ``glm5_dsa_jax.data_parallel``'s.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk
from glm5_dsa_jax import layout, steps
from glm5_dsa_jax.cache import (
    DsaCache, check_fits, from_store, init_cache, live_pool_tiles, pool_tile_scorer, pool_window,
    store_pools, visible_pools,
)
from glm5_dsa_jax.contiguous_step import contiguous_call
from glm5_dsa_jax.config import DsaConfig
from glm5_dsa_jax.data_parallel import dp_call, dp_paged_cache, place_cache
from glm5_dsa_jax.float32_copies import clear_float32_copies, float32_params
from glm5_dsa_jax.fp8 import check_cache_readable
from glm5_dsa_jax.inputs import check_inputs, check_position_ids
from glm5_dsa_jax.layout import hf_weight_shapes
from glm5_dsa_jax.ops import (
    absorb_o, absorb_q, dense, layer_norm, matmul, mla_kernel, rms_norm, topk_live,
)
from glm5_dsa_jax.indexer import DsaIndexer
from glm5_dsa_jax.param_init import ParamFactory
from glm5_dsa_jax.paged_cache import (
    PagedCache, check_chunk, init_paged_cache, paged_pool_window, paged_tail, store_paged_pools,
)
from glm5_dsa_jax.paged_step import paged_call, paged_tile_scorer
from glm5_dsa_jax.parallel import indexer_kernel_call, place_inputs, replicate, sharded_sparse_mla
from glm5_dsa_jax.rope import apply_rope, rope_cos_sin
from glm5_dsa_jax.weights import hf_to_params, param_variable

__all__ = ["DsaIndexer", "DsaAttention", "rms_norm", "layer_norm", "absorb_q", "absorb_o",
           "float32_params", "clear_float32_copies"]

# ---------------------------------------------------------------------------- attention
class DsaAttention(nnx.Module):
    """One GLM-5.3-Flash DSA layer: indexer (unless shared) + weight-absorbed sparse MLA.

    Args:
      cfg: the model's ``DsaConfig``.
      layer_idx: index of an ``indexed_attention`` layer of ``cfg``.
      rngs: initialisation randomness (weights are usually loaded after).
      implementation: an ``Implementation`` for every pipeline step (``"xla"``, ``"pallas"``,
        ``"mosaic"``, their ``*_interpret`` forms, or ``"auto"``: resolved here, for the default device).
      dtype: compute dtype of activations and of the default cache (bf16).
      param_dtype: storage dtype of the parameters (bf16).
      tp_axis: mesh axis name the head axis is sharded over (metadata only until the
        layer is placed on a mesh).
      block_q: queries per prefill tile (bounds the ``[block_q, pools]`` score tile).
      cpu_float32: let the compiled step (``decode.make_step``) multiply by cached float32
        copies of 16-bit parameters when every parameter lives on a CPU device (see the
        module doc; ``float32_compute()``). Also a plain attribute, read by ``make_step``.

    Call: ``out, topk = layer(x, attention_mask=mask, prev_topk=None)`` without a cache;
    ``out, topk, cache = layer(x, attention_mask=mask, cache=cache)`` with one (a
    ``DsaCache`` or a ``PagedCache``). ``x`` is ``[B, S, hidden]``, ``mask`` ``[B, S]`` bool
    (or 0/1 ints; None = all valid), ``out`` ``[B, S, hidden]`` in ``dtype`` and ``topk``
    ``[B, S, out_width]`` int32 token slots (positions within each sequence on a paged
    cache). ``position_ids [B, S]`` override the RoPE positions.

    Pipeline of a call, one method per step, each under ``jax.named_scope`` of the
    method's name (the indexer's ``project``: ``"index_project"``; kernel in brackets; axis
    letters as in ``pallas_kernels``' glossary; Q = the queries of one ``block_q`` tile,
    steps 2-5 run tile by tile):

    0. ``project``: ``x [B, S, hidden]`` -> ``q_lat [B, S, H, CR]`` and the cache rows
       ``[B, S, CR]``, appended to the cache; ``indexer.project``: queries ``[B, S, Hi,
       D]``, head weights ``[B, S, Hi]``, keys and gate logits ``[B, S, D]``.
    1. ``compress_pools`` (``kpool_compress``): each pool of KP keys completing in the
       chunk is pooled once into the cache, ``pooled [B, P, D]``.
    2. ``score_pools`` (``index_scores``, paged: ``index_scores_paged``): ``[B, Q, P]``.
    3. ``select_pools`` (``topk_pools``): ``[B, Q, select_k]`` pool ids. ``choose_pools``
       runs 2-3; with ``"xla"`` on a decode step or a paged cache fused
       (``score_and_select``): scored tile by tile up to the live pools only, same ids.
    4. ``expand_to_tokens`` (``expand_selection``): those pools' tokens and the visible
       tail as ``token_ids [B, Q, W]`` (returned as ``topk``).
    5. ``sparse_attention`` (``sparse_mla``): ``o_lat [B, Q, H, C]`` over the latent rows
       at ``token_ids``, per head shard on a placed layer.
    6. ``output_projection`` (``absorb_o``): ``[B, S, hidden]``, row-parallel.

    A ``"shared"`` layer runs 0, 5 and 6 on ``reused_token_ids(prev_topk)``.
    """

    #: Pools per tile of the ``"xla"`` score + select loop (``score_and_select``).
    POOL_TILE = 512

    def __init__(
        self,
        cfg: DsaConfig,
        layer_idx: int,
        *,
        rngs: nnx.Rngs,
        implementation: str = "xla",
        dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16,
        tp_axis: str | None = "tp",
        block_q: int = 64,
        cpu_float32: bool = True,
    ):
        cfg.validate()
        cfg.check_layer(layer_idx)
        implementation = pk.resolve_implementation(implementation)
        if not isinstance(block_q, int) or block_q <= 0:
            raise ValueError(f"block_q must be a positive int, got {block_q!r}")
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.implementation = implementation
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.tp_axis = tp_axis
        self.block_q = block_q
        self.cpu_float32 = bool(cpu_float32)
        #: The mesh ``shard_layer`` placed this layer on; ``None`` until then. Once set, the
        #: layer's caches and call inputs are replicated on it and its steps run through
        #: ``glm5_dsa_jax.parallel`` (attention per head shard, indexer replicated).
        self.mesh: jax.sharding.Mesh | None = None
        #: ``shard_layer(..., batch_axis=)``'s axis (calls go to ``data_parallel.dp_call``);
        #: ``reduce_axis``, the axis ``o_proj`` is ``psum``-ed over, is set only on the
        #: per-device copy that call merges inside its ``shard_map``.
        self.batch_axis: str | None = None
        self.reduce_axis: str | None = None
        #: Float32 products (``ops.matmul``): set only on the copy a compiled step merges
        #: (``decode.make_step``, when ``float32_compute()``), never on the user's layer.
        self.wide = False
        # The attention's own tensors (the indexer's are DsaIndexer's); without
        # attention_bias the bias attributes are None.
        ParamFactory(cfg, rngs, param_dtype, tp_axis).create(self, layout.layer_tensors(cfg, indexer=False))
        for t in layout.TENSORS:
            if t.bias and not cfg.attention_bias:
                setattr(self, t.params[0].path[-1], None)
        self.indexer = (
            DsaIndexer(cfg, rngs=rngs, param_dtype=param_dtype, tp_axis=tp_axis)
            if cfg.has_indexer(layer_idx)
            else None
        )

    # ------------------------------------------------------------------ weights
    @property
    def has_indexer(self) -> bool:
        return self.indexer is not None

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor names (relative to ``self_attn.``) and their PyTorch shapes."""
        return hf_weight_shapes(self.cfg, self.layer_idx)

    def load_hf_weights(self, weights: Mapping[str, Any]) -> None:
        """Load HF tensors (names relative to ``self_attn.``, PyTorch ``[out, in]`` layout).

        Every problem (missing, unexpected, misshaped, non-finite) is collected and raised
        as one ``ValueError`` before any parameter changes, so a failed load leaves the
        layer as it was.
        """
        params = hf_to_params(self.cfg, self.layer_idx, weights, self.param_dtype)
        for path, value in params.items():
            var = param_variable(self, path)
            old = var[...]
            if getattr(old, "sharding", None) is not None and not isinstance(
                old.sharding, jax.sharding.SingleDeviceSharding
            ):
                value = jax.device_put(value, old.sharding)
            var.set_value(value)

    def float32_compute(self) -> bool:
        """Whether ``make_step`` runs this layer's products in float32 (on cached float32
        copies of 16-bit parameters): ``cpu_float32`` is set and every parameter lives on
        CPU devices only (decided by where the parameters are, e.g. a ``shard_layer``
        mesh, not by which backends exist)."""
        if not self.cpu_float32:
            return False
        leaves = jax.tree.leaves(nnx.state(self, nnx.Param))
        platforms = {d.platform for a in leaves if isinstance(a, jax.Array) for d in a.devices()}
        return platforms == {"cpu"}

    # ------------------------------------------------------------------ cache
    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> DsaCache:
        """An empty decode cache for this layer (``dtype`` defaults to the compute dtype;
        ``"fp8"``: e4m3 rows, the stage in the compute dtype), replicated on ``self.mesh``
        once the layer is placed, split by sequence over a ``batch_axis`` (``batch_size``
        must divide by its size). ``ValueError`` for an fp8 cache this layer's kernels
        cannot read (``fp8.check_readable``)."""
        cache = init_cache(self.cfg, batch_size, max_length, has_indexer=self.has_indexer,
                           dtype=self.dtype if dtype is None else dtype, stage_dtype=self.dtype)
        check_cache_readable(cache, self.implementation)
        return replicate(cache, self.mesh) if self.batch_axis is None else place_cache(
            cache, self.mesh, self.batch_axis)

    def init_paged_cache(self, max_seqs: int, num_pages: int, page_size: int = 64, dtype=None, *,
                         pages_per_seq: int | None = None) -> PagedCache:
        """An empty paged cache (``glm5_dsa_jax.paged_cache``): ``num_pages`` pages of
        ``page_size`` tokens shared by ``max_seqs`` sequences (row ``b`` of a call is
        sequence ``b``), each of up to ``pages_per_seq * page_size`` tokens; ``dtype``
        defaults to the compute dtype. Replicated on ``self.mesh`` once the layer is placed,
        split by sequence and page over a ``batch_axis`` (``data_parallel.dp_paged_cache``)."""
        kw = dict(has_indexer=self.has_indexer, dtype=self.dtype if dtype is None else dtype,
                  stage_dtype=self.dtype)
        if self.batch_axis is not None:
            cache = dp_paged_cache(self, max_seqs, num_pages, page_size, pages_per_seq, **kw)
        else:
            cache = replicate(init_paged_cache(self.cfg, max_seqs, num_pages, page_size,
                                               pages_per_seq=pages_per_seq, **kw), self.mesh)
        check_cache_readable(cache, self.implementation)
        return cache

    # ------------------------------------------------------------------ forward
    def check_inputs(self, hidden_states, attention_mask=None, prev_topk=None, *, start=None):
        """``(x, mask, prev_topk)`` after checking every input of a call (see
        ``glm5_dsa_jax.inputs``): ``x`` in the compute dtype, ``mask`` bool, ``prev_topk``
        int32 or None. ``start`` is the slot of the first query (the cache's length): with
        it, a concrete ``prev_topk`` is checked causal. Raises ``ValueError``."""
        return check_inputs(self.cfg, self.layer_idx, self.dtype, hidden_states, attention_mask,
                            prev_topk, start=start)

    def __call__(self, hidden_states: jax.Array, attention_mask: jax.Array | None = None, *,
                 cache: DsaCache | PagedCache | None = None, prev_topk: jax.Array | None = None,
                 position_ids: jax.Array | None = None):
        if position_ids is not None:
            position_ids = check_position_ids(position_ids, jnp.shape(hidden_states)[:2])
        if cache is not None:
            check_cache_readable(cache, self.implementation)
        if isinstance(cache, PagedCache):
            # Positions are per sequence: a concrete prev_topk is checked causal per row
            # (check_chunk), a traced one kept causal inside the step.
            x, mask, prev_topk = self.check_inputs(hidden_states, attention_mask, prev_topk)
            cache.check(self.cfg, self.has_indexer, x.shape[0])  # validates a concrete page table
            concrete = (mask, cache.pages.n_free) + (() if prev_topk is None else (prev_topk,))
            if not any(isinstance(a, jax.core.Tracer) for a in concrete):
                check_chunk(cache, mask, prev_topk)  # room for the chunk, a causal prev_topk
            if self.batch_axis is not None:
                return dp_call(self, x, mask, cache, prev_topk, position_ids)
            x, mask, prev_topk = place_inputs(self.mesh, x, mask, prev_topk)
            return paged_call(self, x, mask, cache, prev_topk, position_ids)
        start = 0 if cache is None else cache.length
        x, mask, prev_topk = self.check_inputs(hidden_states, attention_mask, prev_topk, start=start)
        b, s, _ = x.shape
        if cache is not None:
            cache.check(self.cfg, self.has_indexer, b)
            check_fits(cache, s)
        if self.batch_axis is not None:
            return dp_call(self, x, mask, cache, prev_topk, position_ids)
        x, mask, prev_topk = place_inputs(self.mesh, x, mask, prev_topk)
        if cache is None:
            out, topk, _ = contiguous_call(self, x, mask, self.init_cache(b, s), prev_topk, position_ids)
            return out, topk
        return contiguous_call(self, x, mask, cache, prev_topk, position_ids)

    def selection_scores(self, hidden_states: jax.Array, attention_mask: jax.Array | None = None):
        """The indexer's view of a prompt, for inspection: ``scores [B, S, P]`` float32
        (``-inf`` = not a candidate) over the prompt's pools, and ``first_key [B]``: steps
        0-2 of the call on a fresh cache.

        Builds the full ``[S, P]`` score matrix: meant for short prompts in a notebook or
        a test, not for serving.
        """
        if self.indexer is None:
            raise ValueError(f"layer {self.layer_idx} is a 'shared' layer: it has no indexer")
        x, mask, _ = self.check_inputs(hidden_states, attention_mask)
        x, mask = place_inputs(self.mesh, x, mask)
        b, s, _ = x.shape
        x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
        rope = self.rope(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s)))
        q_resid, _, _ = self.project(x, rope)
        qi, w, ki, gate = self.indexer.project(x, q_resid, rope, wide=self.wide)
        fresh = replicate(init_cache(self.cfg, b, s, dtype=self.dtype), self.mesh)  # like x, also under DP
        cache = self.compress_pools(fresh, ki, gate, mask, jnp.bool_(True))
        q_pos = jnp.where(mask, jnp.arange(s, dtype=jnp.int32)[None], -1)
        return self.score_pools(qi, w, cache, q_pos), cache.first_key

    # ------------------------------------------------------------------ pipeline steps
    def rope(self, positions) -> tuple[jax.Array, jax.Array] | None:
        """``(cos, sin) [B, S, qk_rope_head_dim / 2]`` at ``positions [B, S]`` (negative:
        a padding entry, roped as position 0 and never read), or None for a NoPE model."""
        if self.cfg.qk_rope_head_dim == 0:
            return None
        return rope_cos_sin(self.cfg, jnp.maximum(positions, 0))

    def project(self, x: jax.Array, rope=None):
        """Step 0: ``x [B, S, hidden]`` -> ``q_resid [B, S, q_lora]``, the query ``q_lat [B,
        S, H, CR]`` and the cache rows ``[B, S, CR]``, all in ``x``'s dtype. ``CR =
        kv_cache_dim``: the absorbed query ``q_nope @ W_UK`` (``C`` wide) and, with RoPE
        (``rope``: ``self.rope(positions)``), the roped ``q_rot`` of each head after it; the
        row is ``kv_a_layernorm(c)`` then the shared roped ``k_rot`` (interleaved RoPE, as
        HF's attention, written in HF's de-interleaved layout)."""
        cfg = self.cfg
        eps = cfg.latent_norm_eps
        with jax.named_scope(steps.PROJECT):
            q_resid = rms_norm(self._dense(x, self.q_a_proj, self.q_a_proj_bias), self.q_a_layernorm[...], eps)
            q = matmul("bsr,rhd->bshd", q_resid, self.q_b_proj[...], self.wide)
            q_lat = absorb_q(q[..., : cfg.qk_nope_head_dim], self.w_uk[...], wide=self.wide)
            kv = self._dense(x, self.kv_a_proj, self.kv_a_proj_bias)
            latent = rms_norm(kv[..., : cfg.kv_lora_rank], self.kv_a_layernorm[...], eps)
            if rope is not None:
                cos, sin = rope
                q_rot = apply_rope(q[..., cfg.qk_nope_head_dim:], cos[:, :, None], sin[:, :, None], "interleaved")
                q_lat = jnp.concatenate([q_lat, q_rot.astype(q_lat.dtype)], -1)
                k_rot = apply_rope(kv[..., cfg.kv_lora_rank:], cos, sin, "interleaved")
                latent = jnp.concatenate([latent, k_rot.astype(latent.dtype)], -1)
        return q_resid, q_lat, latent

    def _dense(self, x, w, bias):
        y = dense(x, w[...], self.wide)
        return y if bias is None else y + bias[...].astype(y.dtype)

    def compress_pools(self, cache: DsaCache | PagedCache, keys, gate, mask, fits=True):
        """Step 1: pool the keys ``[B, S, D]`` of every pool that completes in this chunk,
        once, into the cache (``kpool_compress`` between the cache's window and store:
        ``pool_window`` / ``store_pools``, nothing written when not ``fits``; on a paged
        cache ``paged_pool_window`` / ``store_paged_pools`` after ``pages.reserve``)."""
        kernel = functools.partial(self._indexer_kernel, pk.kpool_compress)
        with jax.named_scope(steps.COMPRESS_POOLS):
            if isinstance(cache, PagedCache):  # mask is the reserved rows' (pages.reserve)
                n_new = mask.sum(axis=1, dtype=jnp.int32)
                old = cache.pages.lengths - n_new
                win = paged_pool_window(cache, old, keys, gate, mask)
                win_keys, win_gate, win_valid, first_pool = win
                pooled, _, pooled_valid = kernel(win_keys, win_gate, win_valid,
                                                 self.indexer.pool_ape(win_keys.dtype), first_pool)
                return store_paged_pools(cache, old, win, pooled, pooled_valid, n_new)
            win = pool_window(cache, keys, gate, mask)
            pooled, _, pooled_valid = kernel(win.keys, win.gate, win.valid,
                                             self.indexer.pool_ape(win.keys.dtype), win.first_pool)
            return store_pools(cache, win, pooled, pooled_valid, fits)

    def score_pools(self, qi, w, cache: DsaCache | PagedCache, q_pos) -> jax.Array:
        """Step 2: ``[B, Q, P]`` float32 scores of the cache's pools for the queries ``qi [B,
        Q, Hi, D]`` (weights ``w [B, Q, Hi]``) at slots ``q_pos [B, Q]``; ``-inf`` where a
        pool is not a candidate (invalid, or not yet complete). A paged cache is read
        through its block table, each row's own pools only (``index_scores_paged``)."""
        kp = self.cfg.index_kpool
        with jax.named_scope(steps.SCORE_POOLS):
            if isinstance(cache, PagedCache):
                return self._indexer_kernel(
                    pk.index_scores_paged, qi, w, from_store(cache.pooled_store, cache.dtype),
                    cache.pages.block_table, cache.pages.lengths // kp, q_pos, cache.pooled_scale, kpool=kp)
            return self._indexer_kernel(pk.index_scores, qi, w, cache.pooled, cache.pool_valid, cache.first_key,
                                        q_pos, cache.pooled_scale, kpool=kp)

    def select_pools(self, scores, select_k: int, n_live=None) -> jax.Array:
        """Step 3: ``[B, Q, select_k]`` pool ids of the best scores (``topk_pools``); with
        ``n_live [B, Q]`` (``live_pools``) a Pallas kernel reads only those (the rest are
        no candidates anyway)."""
        with jax.named_scope(steps.SELECT_POOLS):
            if n_live is None or self.implementation == "xla":
                return self._indexer_kernel(pk.topk_pools, scores, select_k)
            return self._indexer_kernel(topk_live, scores, n_live, select_k)

    def live_pools(self, cache: DsaCache | PagedCache, q_pos) -> jax.Array:
        """``[B, Q]`` the pools complete at each query (``cache.visible_pools``)."""
        kp = self.cfg.index_kpool
        if isinstance(cache, PagedCache):  # positions from 0, up to the row's pool count
            return visible_pools(q_pos, 0, kp, (cache.pages.lengths // kp)[:, None])
        return visible_pools(q_pos, cache.first_key[:, None], kp, cache.max_pools)

    def choose_pools(self, qi, w, cache: DsaCache | PagedCache, q_pos, select_k: int) -> jax.Array:
        """Steps 2-3 of a query tile: ``score_and_select`` where ``"xla"`` reads the live
        pools only (a decode step; every tile of a paged cache), else ``select_pools`` of
        ``score_pools``. A contiguous prefill tile keeps the whole row: its running sort of
        Q rows cost 1.5x the row's top-k at 1K tokens."""
        if self.implementation == "xla" and (isinstance(cache, PagedCache) or q_pos.shape[1] == 1):
            return self.score_and_select(qi, w, cache, q_pos, select_k)
        return self.select_pools(self.score_pools(qi, w, cache, q_pos), select_k, self.live_pools(cache, q_pos))

    def score_and_select(self, qi, w, cache: DsaCache | PagedCache, q_pos, select_k: int) -> jax.Array:
        """Steps 2-3 fused, as ``implementation="xla"`` runs them (``choose_pools``): ``[B,
        Q, select_k]`` pool ids, the same as ``select_pools(score_pools(...))`` bit for bit,
        but scored tile by tile (``POOL_TILE`` pools) only up to the batch's latest complete
        pool (``cache.live_pool_tiles``) with a running top-k (``pk.streaming_topk``): the
        work follows the live tokens, not the capacity. Each tile is scored under
        ``"score_pools"``, the loop runs under ``"select_pools"``."""
        kp, tile = self.cfg.index_kpool, min(self.POOL_TILE, cache.max_pools)
        with jax.named_scope(steps.SELECT_POOLS):
            if isinstance(cache, PagedCache):
                n_live = visible_pools(q_pos, 0, kp, cache.max_pools)
                scorer = paged_tile_scorer(tile, cache.pools_per_page, kp, cache.dtype)
                grid = (cache.pages.block_table, cache.pages.lengths // kp)
            else:
                n_live = visible_pools(q_pos, cache.first_key[:, None], kp, cache.max_pools)
                scorer = pool_tile_scorer(tile, kp, cache.dtype)
                grid = (cache.pool_valid, cache.first_key)
            return pk.streaming_topk(scorer, (qi, w, cache.pooled_store, *grid, q_pos, cache.pooled_scale),
                                     live_pool_tiles(n_live, tile), tile=tile, n_pools=cache.max_pools,
                                     select_k=select_k, rows=q_pos.shape)

    def expand_to_tokens(self, pools, cache: DsaCache | PagedCache, n_vis, q_pos) -> jax.Array:
        """Step 4: the selected pools' tokens and each query's visible tail (the ``n_vis %
        KP`` valid slots after its last complete pool; a paged row has no holes:
        ``paged_tail``, ``n_vis`` unused) as a row of ``W = out_width`` token ids ``[B, Q,
        W]`` (``expand_selection``); ``-1`` pads, and a padding query's row is all ``-1``."""
        cfg = self.cfg
        with jax.named_scope(steps.EXPAND_TO_TOKENS):
            paged, tail = isinstance(cache, PagedCache), None
            first_key = jnp.zeros(pools.shape[:1], jnp.int32) if paged else cache.first_key
            if cfg.tail_width and paged:
                tail = paged_tail(q_pos, cfg.index_kpool)
            elif cfg.tail_width:
                tail = pk.visible_tail(first_key, n_vis, q_pos, cache.key_valid, cfg.index_kpool)
                # With holes in the mask the tail (HF's rule: from first_key + visible
                # - visible % kpool) can fall inside a complete pool that is selected
                # too; drop those ids so no token is attended twice (HF builds a mask
                # from the ids, so it counts such a token once).
                t_pool = jnp.where(tail >= 0, (tail - first_key[:, None, None]) // cfg.index_kpool, -2)
                tail = jnp.where((t_pool[..., None] == pools[..., None, :]).any(-1), -1, tail)
            token_ids = self._indexer_kernel(pk.expand_selection, pools, first_key, tail, kpool=cfg.index_kpool,
                                             out_width=cfg.out_width)
            return jnp.where(q_pos[..., None] >= 0, token_ids, -1)

    @staticmethod
    def reused_token_ids(prev_topk, q_pos) -> jax.Array:
        """A ``"shared"`` layer's token ids: its full layer's ``prev_topk [B, Q, W]``, only
        the slots at or before each query's own (``q_pos``, ``-1`` for padding): it never
        attends to the future, even when a traced ``prev_topk`` (which ``check_inputs``
        cannot see) points there."""
        token_ids = prev_topk.astype(jnp.int32)
        return jnp.where((token_ids >= 0) & (token_ids <= q_pos[..., None]), token_ids, -1)

    def sparse_attention(self, q_lat, latent, token_ids, latent_scale=None) -> jax.Array:
        """Step 5 (``sparse_mla``): ``q_lat [B, Q, H, C]`` over ``latent [B, L, C]`` (e4m3
        with ``latent_scale [B, L]`` for an fp8 cache) at ``token_ids [B, Q, W]`` -> ``o_lat
        [B, Q, H, C]``. On a placed layer it runs per head shard, each device reading its
        local latent (``parallel.sharded_sparse_mla``)."""
        kernel = mla_kernel(self.cfg.softmax_scale, self.cfg.kv_lora_rank, self.implementation)
        rows = latent if latent_scale is None else (latent, latent_scale)  # placed alike
        with jax.named_scope(steps.SPARSE_ATTENTION):
            return sharded_sparse_mla(q_lat, rows, token_ids, mesh=self.mesh, axis=self.tp_axis,
                                      kernel=kernel)

    def output_projection(self, o_lat, mask=None) -> jax.Array:
        """Step 6: ``o_lat [B, S, H, C]`` -> ``[B, S, hidden]`` through ``w_uv`` and the
        row-parallel ``o_proj`` (plus its bias; ``absorb_o``). With the call's ``mask [B,
        S]``: zeros at padding queries, in the compute dtype (a call's ``out``)."""
        bias = None if self.o_proj_bias is None else self.o_proj_bias[...]
        with jax.named_scope(steps.OUTPUT_PROJECTION):
            out = absorb_o(o_lat, self.w_uv[...], self.o_proj[...], bias, wide=self.wide,
                           reduce_axis=self.reduce_axis)
            if mask is None:
                return out
            return jnp.where(mask[..., None], out, jnp.zeros((), out.dtype)).astype(self.dtype)

    def _indexer_kernel(self, fn, *args, **kwargs):
        """``fn(*args, implementation=self.implementation, **kwargs)``, replicated on a placed
        layer (``parallel.indexer_kernel_call``)."""
        return indexer_kernel_call(self.mesh, fn, *args, implementation=self.implementation, **kwargs)

