"""Flax NNX module of one DSA layer: the lightning indexer (``glm5_dsa_jax.model.layer``) and
weight-absorbed sparse MLA, for the three model types of ``DsaConfig`` (GLM-5.3-Flash's NoPE
``glm5_next``; ``glm_moe_dsa`` and ``deepseek_v32`` with a RoPE part).

Invariants:

* Parameters are the rows of the layout table (``glm5_dsa_jax.model.layout``: names, shapes,
  initialisers, creation order), stored in JAX layout (``[in, out]``, heads as their own
  axis), and carry their tensor-parallel placement as ``out_sharding`` metadata: the head
  axis of ``q_b_proj``, ``w_uk``, ``w_uv`` and ``o_proj`` is named ``tp_axis``; everything
  else, the whole indexer included, is replicated (see ``glm5_dsa_jax.parallel.plan`` for why).
* ``kv_b_proj`` is split once, at load, into ``w_uk [heads, qk_nope, kv_lora]`` and
  ``w_uv [heads, v_head, kv_lora]``; attention then runs in the ``kv_lora_rank``-wide
  latent space (``absorb_q`` before, ``absorb_o`` after), reading one latent row per
  selected token for all heads. With RoPE a row also carries the shared roped key (``[c,
  k_rot]``, ``kv_cache_dim`` wide) and the query its roped part: the score is ``q_lat . c
  + q_rot . k_rot``, the values ``c`` (``sparse_mla(..., value_width=kv_lora_rank)``).
* Two cache kinds: the contiguous ``DsaCache`` (one timeline for the batch, as HF's
  ``DynamicCache``; RoPE positions are its slots) and the paged ``PagedCache`` (a sequence
  per row, positions within it). Both implement the cache interface
  (``glm5_dsa_jax.cache.interface``); the layer never asks which kind it holds. Either may
  be fp8 (``glm5_dsa_jax.cache.fp8``): rows are quantised by the cache's writes, and the
  scales go with the rows to the kernels (``score_pools``, ``score_and_select``,
  ``sparse_attention``).
* Every call goes through one pipeline, ``forward``, with or without a cache and on
  either kind: a call without a cache runs on a fresh contiguous cache sized to the
  input. Why one function: the two caches differ only in where rows and pools live, which
  is the cache's part; a second path would repeat every step. Prefill rows are processed
  in tiles of ``block_q`` queries, so no ``[S, S]`` or ``[S, pools]`` tensor is ever built.
* The cache's order within a call: room first (``begin_chunk``: a paged row without pages
  is masked out of the whole call), the chunk's latent rows before any query reads (a
  query attends to its own token, as in HF), the pools completing in the chunk before any
  scoring, the cache's bookkeeping last (``end_chunk``).
* A padding query gets a top-k row of ``-1`` and an output of zeros; a padding token's
  hidden state is zeroed before any projection, so a NaN there goes nowhere.
* On a CPU the compiled step (``decode.make_step``) multiplies by cached copies of 16-bit
  parameters, never written back: bf16 with their contracted axes last (float32 for a
  placed layer), which XLA:CPU multiplies several times faster than the stored layout;
  each product still rounds to the activation dtype. The policy is
  ``glm5_dsa_jax.cpu_policy``'s, invisible here; ``cpu_float32=False`` opts out.
* One method per pipeline step (class doc), each under ``jax.named_scope`` of its own
  name (``glm5_dsa_jax.model.layer``): ``forward`` runs these methods, so no step is written
  twice. A step that reads the cache uses the cache's operations (its key source and
  kernel for scoring, its rows and slots for attention, its tail), never its kind. The
  steps are plain single-device code: ``forward`` reads no placement of the layer and runs
  as is inside a ``shard_map`` body.
* Training (``jax.grad`` / ``nnx.grad`` of a loss of ``out``; every implementation, jitted
  or eager, placed or not, with or without a cache): the kernels carry their own VJPs
  (``sparse_mla``, ``index_scores``, ``kpool_compress``); the integer steps (top-k,
  expansion) have none. ``forward`` stops the gradient of the indexer's outputs: the
  selection is discrete, so the indexer's parameters get exactly zero (as HF's ``no_grad``
  indexer) and nothing of it is kept for the backward pass. The chunk's latent rows reach
  the attention through the cache, whose buffer may hold bits (a 16-bit cache on a CPU):
  ``chunk_rows.rows_with_chunk_gradient`` routes their gradient around it (identity forward; an fp8
  cache refuses a gradient). Memory: each query tile's attention runs under
  ``jax.checkpoint`` (``remat_tiles``, ``remat.TILE_POLICY``: a tile keeps its ids), and the layer's residuals carry the
  names of ``glm5_dsa_jax.model.remat``, whose policies a model's ``jax.checkpoint`` uses:
  a training step's activation memory per token is flat in the context. Padding tokens get
  exactly zero gradient (their hidden states are zeroed first, their outputs are zeros).
* Training the indexer (``indexer_loss=``; definition: ``glm5_dsa_jax.model.indexer_loss``):
  the loss reaches only the indexer's parameters (DeepSeek-V3.2's routing). Its path
  projects ``stop_gradient(x)`` / ``stop_gradient(q_resid)``, pools the prompt's keys with
  ``kpool_compress`` itself (never through the cache buffer, which may hold bits), scores
  them with ``index_scores`` (its Pallas backward under Pallas); the mass ``p`` is a
  constant. The selection reads that projection through ``stop_gradient``: ``out`` reaches
  no indexer parameter. Per query tile (``"indexer_loss"``) under ``jax.checkpoint``
  (nothing saved): the stacked residuals are the tiles' inputs, memory linear in the
  context. The body returns per-row sums (no collective), ``__call__`` reduces them.
* ``attention="dense"`` (the warm-up stage): every visible slot (``pk.causal_mla``, same
  parameters); the indexer still selects. It reads the contiguous cache's ``key_valid``.
* A call checks its inputs, then runs through ``glm5_dsa_jax.parallel.execution.run``:
  on a layer placed by ``shard_layer`` (``self.placement``: mesh, head axis, optional
  batch axis) one ``shard_map`` over the mesh whose body is ``forward``; eagerly, one
  cached jitted program. The call never re-enters itself.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk
from glm5_dsa_jax.model import layout, remat
from glm5_dsa_jax.cache import Chunk, DsaCache, LayerCache, PagedCache, init_cache, init_paged_cache
from glm5_dsa_jax.cache.contiguous import live_pool_tiles
from glm5_dsa_jax.cache.fp8 import check_cache_readable, index_queries
from glm5_dsa_jax.cache.interface import tile_scorer
from glm5_dsa_jax.model.chunk_rows import rows_with_chunk_gradient
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.cpu_policy import clear_float32_copies, float32_params, uses_float32
from glm5_dsa_jax.model.indexer_loss import check_modes, dense_tile_kl, mean_loss, sparse_tile_kl
from glm5_dsa_jax.model.inputs import check_inputs, check_position_ids
from glm5_dsa_jax.model.layout import ParamFactory, hf_weight_shapes
from glm5_dsa_jax.model.ops import absorb_o, absorb_q, dense, layer_norm, matmul, query_tiles, rms_norm
from glm5_dsa_jax.parallel.context_paged import check_supported as check_paged_cp
from glm5_dsa_jax.parallel.execution import run, run_fn
from glm5_dsa_jax.parallel.placement import Placement, check_page_split, place_cache
from glm5_dsa_jax.model.rope import apply_rope, rope_cos_sin
from glm5_dsa_jax.model.weights import hf_to_params, param_variable

__all__ = ["DsaIndexer", "DsaAttention", "rms_norm", "layer_norm", "absorb_q", "absorb_o",
           "float32_params", "clear_float32_copies",
           "PROJECT", "INDEX_PROJECT", "COMPRESS_POOLS", "SCORE_POOLS", "SELECT_POOLS",
           "EXPAND_TO_TOKENS", "SPARSE_ATTENTION", "OUTPUT_PROJECTION", "INDEXER_LOSS", "FULL_STEPS",
           "SHARED_STEPS"]

# ---------------------------------------------------------------------------- step names
# The names of the layer's pipeline steps: the ``jax.named_scope`` each one runs under.
#
# Rule: a step's name is the name of the ``DsaAttention`` method that runs it (the indexer's
# projection, ``DsaIndexer.project``, is ``"index_project"``, to tell it from the layer's
# ``project``). The kernel a step calls (``kpool_compress``, ``index_scores``, ...) is not
# the step: a step also reads or writes the cache around its kernel, and the contiguous and
# paged caches run the same step over different kernels (``index_scores`` /
# ``index_scores_paged``). Why one home: the layer (``glm5_dsa_jax.layer``), the caches'
# tile scorer (wrapped by the layer), the indexer and the
# test that finds every step in a compiled step's HLO (``tests/test_layer_steps.py``) must
# spell each name the same way, or a profile silently loses a step.
#
# Invariants: every name is a distinct identifier-like string (an HLO op's metadata shows
# ``.../<name>/...``); ``FULL_STEPS`` lists, in pipeline order, the steps a layer with an
# indexer runs, ``SHARED_STEPS`` those of a ``"shared"`` layer (it reuses its full layer's
# token ids).
PROJECT = "project"
INDEX_PROJECT = "index_project"
COMPRESS_POOLS = "compress_pools"
SCORE_POOLS = "score_pools"
SELECT_POOLS = "select_pools"
EXPAND_TO_TOKENS = "expand_to_tokens"
SPARSE_ATTENTION = "sparse_attention"
OUTPUT_PROJECTION = "output_projection"
#: The indexer loss's step (a training call's only: in neither list below).
INDEXER_LOSS = "indexer_loss"

FULL_STEPS = (PROJECT, INDEX_PROJECT, COMPRESS_POOLS, SCORE_POOLS, SELECT_POOLS, EXPAND_TO_TOKENS,
              SPARSE_ATTENTION, OUTPUT_PROJECTION)
SHARED_STEPS = (PROJECT, SPARSE_ATTENTION, OUTPUT_PROJECTION)


# ---------------------------------------------------------------------------- indexer
# The lightning indexer's parameters and projections (``DsaIndexer``), replicated under TP.
#
# The indexer emits a *selection*, not a partial sum, so it is replicated on every device of a
# tensor-parallel mesh and computes the same top-k everywhere (``glm5_dsa_jax.parallel.placement``).
# Its tensors are the layout table's indexer rows for the config's model type (k-pool gate
# and APE only with k-pool compression, ``cfg.rules.kpool_compression``). The scoring,
# selection and expansion steps that read what it projects are ``DsaAttention``'s methods.
class DsaIndexer(nnx.Module):
    """The lightning indexer of one full DSA layer (replicated under TP).

    Parameters (the layout table's indexer rows, JAX layout): ``wq_b [q_lora, index_heads,
    D]``, ``wk [hidden, D]``, ``k_norm_scale/k_norm_bias [D]``, ``weights_proj [hidden,
    index_heads]``, ``kpool_gate [hidden, D]`` (HF ``index_kpool_compress_gate``
    transposed), ``kpool_ape [KP, D]``.
    """

    def __init__(self, cfg: DsaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.bfloat16, tp_axis="tp"):
        ParamFactory(cfg, rngs, param_dtype, tp_axis).create(
            self, [t for t in layout.layer_tensors(cfg, indexer=True) if t.indexer])
        self.cfg = cfg
        self.eps = cfg.index_norm_eps
        self.index_heads = cfg.index_n_heads

    def project(self, x: jax.Array, q_resid: jax.Array, rope=None):
        """``x [B, S, hidden]``, ``q_resid [B, S, q_lora]`` -> queries ``[B, S, Hi, D]``,
        weights ``[B, S, Hi]`` float32, keys ``[B, S, D]``, gate logits ``[B, S, D]`` float32.
        ``rope``: ``(cos, sin)`` at the tokens' positions (``rope.rope_cos_sin``) for a model
        whose indexer ropes the first ``qk_rope_head_dim`` channels of its queries and keys
        (in ``cfg.rules.indexer_rope_style``); keys are roped before they are pooled or
        cached, as HF caches them. Without k-pool compression the gate is zeros (a pool of
        one token is that token: ``kpool_compress`` then returns the keys exactly)."""
        cfg = self.cfg
        of_x = lambda name: dense(x, getattr(self, name)[...], part=("indexer", name))  # noqa: E731
        with jax.named_scope(INDEX_PROJECT):
            q = matmul("bsr,rhd->bshd", q_resid, self.wq_b[...])
            k = layer_norm(of_x("wk"), self.k_norm_scale[...], self.k_norm_bias[...], self.eps)
            if rope is not None and cfg.rules.indexer_rope_style is not None:
                r, style = cfg.qk_rope_head_dim, cfg.rules.indexer_rope_style
                cos, sin = rope
                q = jnp.concatenate([apply_rope(q[..., :r], cos[:, :, None], sin[:, :, None], style), q[..., r:]], -1)
                k = jnp.concatenate([apply_rope(k[..., :r], cos, sin, style), k[..., r:]], -1)
            if cfg.rules.kpool_compression:
                gate = of_x("kpool_gate").astype(jnp.float32)
            else:
                gate = jnp.zeros(k.shape, jnp.float32)
            w = of_x("weights_proj").astype(jnp.float32) * (self.index_heads**-0.5)
        return q, w, k, gate

    def pool_ape(self, dtype) -> jax.Array:
        """``[KP, D]`` the k-pool APE (zeros without k-pool compression: KP is 1 there)."""
        if self.cfg.rules.kpool_compression:
            return self.kpool_ape[...]
        return jnp.zeros((self.cfg.index_kpool, self.cfg.index_head_dim), dtype)


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
      cpu_float32: let the compiled step (``decode.make_step``) multiply by cached copies of
        16-bit parameters when every parameter lives on a CPU device: bf16 contraction-last
        copies, float32 ones for a placed layer (see the module doc; ``float32_compute()``).
        Also a plain attribute, read by ``make_step``.
      remat_tiles: under autodiff, each query tile's sparse attention runs under
        ``jax.checkpoint`` (``remat.TILE_POLICY``): a tile keeps its queries and ids, and the
        backward pass recomputes the attention's forward instead of keeping its residuals
        (with ``"xla"``, ``[W, CR]`` gathered rows per query; a kernel's output and
        log-sum-exp). Not under ``"mosaic_interpret"`` (ordered callbacks). No effect on a
        forward pass (module doc, "Training").

    Call: ``out, topk = layer(x, attention_mask=mask, prev_topk=None)`` without a cache;
    ``out, topk, cache = layer(x, attention_mask=mask, cache=cache)`` with one (a
    ``DsaCache`` or a ``PagedCache``). ``x`` is ``[B, S, hidden]``, ``mask`` ``[B, S]`` bool
    (or 0/1 ints; None = all valid), ``out`` ``[B, S, hidden]`` in ``dtype`` and ``topk``
    ``[B, S, out_width]`` int32 token slots (positions within each sequence on a paged
    cache). ``position_ids [B, S]`` override the RoPE positions. ``attention="dense"``
    attends to every visible token (``ATTENTION_MODES``; not on a paged cache);
    ``indexer_loss="dense" | "sparse"`` (a full layer, no cache) adds the indexer's loss:
    ``out, topk, loss = layer(x, attention_mask=mask, indexer_loss="dense")`` (module doc,
    ``glm5_dsa_jax.model.indexer_loss``).

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
       (``score_and_select``): scored tile by tile up to the live pools only, same ids. A
       tile whose queries see at most ``select_k`` pools skips both (``all_pools``:
       every pool is selected, the same ids without a score).
    4. ``expand_to_tokens`` (``expand_selection``): those pools' tokens and the visible
       tail as ``token_ids [B, Q, W]`` (returned as ``topk``).
    5. ``sparse_attention`` (``sparse_mla``): ``o_lat [B, Q, H, C]`` over the latent rows
       at ``token_ids``, per head shard on a placed layer.
    6. ``output_projection`` (``absorb_o``): ``[B, S, hidden]``, row-parallel.

    A ``"shared"`` layer runs 0, 5 and 6 on ``reused_token_ids(prev_topk)``.
    """

    #: The ``"xla"`` score + select loop's tiles (``pool_tile``): at most ``POOL_TILE`` pools
    #: (a merge costs ``select_k + tile``: large tiles read each live pool about once), fewer
    #: (not under ``MIN_POOL_TILE``) where ``[B, Q, Hi, tile]`` exceeds the float32 budget.
    POOL_TILE = 8192
    MIN_POOL_TILE = 512
    SCORE_TILE_ELEMENTS = 1 << 22

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
        remat_tiles: bool = True,
    ):
        cfg.validate()
        cfg.check_layer(layer_idx)
        implementation = pk.resolve_implementation(implementation)
        if not isinstance(block_q, int) or block_q <= 0:
            raise ValueError(f"block_q must be a positive int, got {block_q!r}")
        self.cfg, self.layer_idx, self.implementation = cfg, layer_idx, implementation
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self._tp_axis = tp_axis
        self.block_q = block_q
        self.cpu_float32 = bool(cpu_float32)
        self.remat_tiles = bool(remat_tiles)
        #: Where the layer runs (``parallel.placement.Placement``: mesh, head axis, optional
        #: batch axis), set once by ``shard_layer``; ``None``: not placed.
        self.placement: Placement | None = None
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

    @property
    def mesh(self) -> jax.sharding.Mesh | None:
        """The mesh ``shard_layer`` placed this layer on (``None`` before)."""
        return None if self.placement is None else self.placement.mesh

    @property
    def tp_axis(self) -> str | None:
        """The mesh axis the heads are split over: the placement's, else the constructor's
        ``tp_axis`` (the parameters' ``out_sharding`` metadata)."""
        return self._tp_axis if self.placement is None else self.placement.axis

    @property
    def batch_axis(self) -> str | None:
        """The mesh axis a placed layer splits its rows and caches over (data parallelism)."""
        return None if self.placement is None else self.placement.batch_axis

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
        """Whether ``make_step`` applies the CPU policy to this layer's products (cached
        copies of 16-bit parameters: bf16 contraction-last ones, or float32 ones for a
        placed layer; ``cpu_policy``): ``cpu_float32`` is set and every parameter lives on
        CPU devices only (decided by where the parameters are, e.g. a ``shard_layer``
        mesh, not by which backends exist)."""
        return uses_float32(nnx.state(self, nnx.Param), self.cpu_float32)

    # ------------------------------------------------------------------ cache
    def init_cache(self, batch_size: int, max_length: int, dtype=None, *, max_rollback: int = 1,
                   latent_layout: str = "group", rotate_index: bool = False,
                   index_keys: str = "e4m3") -> DsaCache:
        """An empty decode cache for this layer (``dtype`` defaults to the compute dtype;
        ``"fp8"``: e4m3 rows, the stage in the compute dtype), replicated on ``self.mesh``
        once the layer is placed, split by sequence over a ``batch_axis`` (``batch_size``
        must divide by its size) and by slot and pool over a ``seq_axis`` (``max_length``
        must divide by its size times ``index_kpool``, ``ValueError`` naming both).
        ``ValueError`` for an fp8 cache this layer's kernels cannot read
        (``fp8.check_readable``). ``max_rollback``: slots the batch can always take back
        (``DsaCache.rollback``); ``latent_layout``: how an fp8 cache scales a latent row,
        ``rotate_index``: whether its indexer keys are Hadamard-rotated, ``index_keys``: how an
        fp8 cache stores them, ``"e4m3"`` or ``"int8"`` (``cache.init_cache``)."""
        cache = init_cache(self.cfg, batch_size, max_length, has_indexer=self.has_indexer,
                           dtype=self.dtype if dtype is None else dtype, stage_dtype=self.dtype,
                           max_rollback=max_rollback, latent_layout=latent_layout, rotate_index=rotate_index,
                           index_keys=index_keys)
        check_cache_readable(cache, self.implementation)
        p = self.placement
        return cache if p is None else place_cache(cache, p.mesh, p.batch_axis, p.seq_axis)

    def init_paged_cache(self, max_seqs: int, num_pages: int, page_size: int = 64, dtype=None, *,
                         pages_per_seq: int | None = None, max_rollback: int = 1,
                         latent_layout: str = "group", rotate_index: bool = False,
                         index_keys: str = "e4m3") -> PagedCache:
        """An empty paged cache (``glm5_dsa_jax.cache.paged``): ``num_pages`` pages of
        ``page_size`` tokens shared by ``max_seqs`` sequences (row ``b`` of a call is
        sequence ``b``), each of up to ``pages_per_seq * page_size`` tokens; ``dtype``
        defaults to the compute dtype. Replicated on ``self.mesh`` once the layer is placed,
        split by sequence and page over a ``batch_axis``: one page table of ``max_seqs / dp``
        sequences and ``num_pages / dp`` pages per data shard (``pages``' module doc;
        ``pages_per_seq`` defaults to a shard's pages, capped at ``max_position_embeddings``;
        ``ValueError`` unless both divide by ``dp``), and its page pools by page over a
        ``seq_axis`` (``num_pages / dp`` must divide by its size ``cp``; pages handed out
        round-robin over the cp blocks, every step the layer's own kernels per shard:
        ``parallel.context_paged``). ``max_rollback``: tokens a sequence can
        always take back (``PagedCache.rollback``); ``latent_layout``, ``rotate_index``,
        ``index_keys`` as ``init_cache``'s."""
        p = self.placement
        if p is not None and p.seq_axis is not None:
            check_paged_cp(self.implementation, p.seq_axis)
            check_page_split(num_pages, p.data_shards, p.seq_shards, p.seq_axis)
        cache = init_paged_cache(self.cfg, max_seqs, num_pages, page_size, pages_per_seq=pages_per_seq,
                                 has_indexer=self.has_indexer, dtype=self.dtype if dtype is None else dtype,
                                 stage_dtype=self.dtype, shards=1 if p is None else p.data_shards,
                                 seq_shards=1 if p is None else p.seq_shards,
                                 max_rollback=max_rollback, latent_layout=latent_layout,
                                 rotate_index=rotate_index, index_keys=index_keys)
        if p is not None:
            cache = place_cache(cache, p.mesh, p.batch_axis, p.seq_axis)
        check_cache_readable(cache, self.implementation)
        return cache

    # ------------------------------------------------------------------ forward
    def check_inputs(self, hidden_states, attention_mask=None, prev_topk=None, *, start=None):
        """``(x, mask, prev_topk)`` after checking every input of a call (see
        ``glm5_dsa_jax.model.inputs``): ``x`` in the compute dtype, ``mask`` bool, ``prev_topk``
        int32 or None. ``start`` is the slot of the first query (the cache's length): with
        it, a concrete ``prev_topk`` is checked causal. Raises ``ValueError``."""
        return check_inputs(self.cfg, self.layer_idx, self.dtype, hidden_states, attention_mask,
                            prev_topk, start=start)

    def __call__(self, hidden_states: jax.Array, attention_mask: jax.Array | None = None, *,
                 cache: DsaCache | PagedCache | None = None, prev_topk: jax.Array | None = None,
                 position_ids: jax.Array | None = None, attention: str = "sparse",
                 indexer_loss: str | None = None):
        check_modes(attention, indexer_loss, self.has_indexer, self.layer_idx, cache)
        if position_ids is not None:
            position_ids = check_position_ids(position_ids, jnp.shape(hidden_states)[:2])
        if cache is not None:
            check_cache_readable(cache, self.implementation)
        start = 0 if cache is None else cache.chunk_start  # None: checked causal in the step
        x, mask, prev_topk = self.check_inputs(hidden_states, attention_mask, prev_topk, start=start)
        if cache is not None:
            cache.check_chunk(self.cfg, self.has_indexer, x.shape[0], mask, prev_topk)
        res = run(self, x, mask, cache, prev_topk, position_ids, attention=attention, indexer_loss=indexer_loss)
        if indexer_loss is None:
            return res
        out, topk, (kl_sum, n_loss) = res
        return out, topk, mean_loss(kl_sum, n_loss)

    def forward(self, x, mask, cache: LayerCache, prev_topk, position_ids=None, *, reduce_axis=None,
                attention: str = "sparse", indexer_loss: str | None = None):
        """``(out, topk, cache)`` of the layer on checked inputs ``x [B, S, hidden]``, ``mask
        [B, S]`` bool and a cache of either kind (never None): the one pipeline of a call
        (class doc), read top to bottom; every cache-specific part is an operation of the
        cache interface (``glm5_dsa_jax.cache.interface``). Steps 2-5 run per ``block_q``
        query tile (``by_query_tiles``), so no ``[S, P]`` or ``[S, S]`` tensor is built.
        RoPE positions (``position_ids``) default to the cache's (``Chunk.positions``).
        ``reduce_axis`` goes to ``output_projection``. Reads no placement of the layer:
        runs as is on one device or inside a ``shard_map`` body. ``attention`` and
        ``indexer_loss`` as the call's (checked there; a loss needs a fresh cache sized to
        the chunk): with a loss, ``(out, topk, cache, (kl_sum [B], n_loss_queries [B]))``."""
        cache, chunk = cache.begin_chunk(mask)  # room for the chunk; a row without it is masked out
        mask = chunk.mask
        # Padding tokens are zeroed first: whatever they hold (NaN included) is never read.
        x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
        rope = self.rope(chunk.positions if position_ids is None else position_ids)
        q_resid, q_lat, latent = self.project(x, rope)
        cache = cache.write_latent(latent, chunk)  # before any query reads: a query sees its own token
        rows, row_scale = cache.attention_rows()
        row_slots = cache.row_slots
        # The chunk's own rows reach the attention through the cache's buffer, which on a
        # CPU holds a 16-bit cache's bits (no gradient): their gradient is routed apart.
        rows = rows_with_chunk_gradient(rows, latent, row_slots(chunk.q_pos), chunk.fits, row_scale is not None)

        def attend(q_lat, token_ids):
            return self.sparse_attention(q_lat, rows, row_slots(token_ids), row_scale)

        if attention == "dense":  # the warm-up stage: every visible slot (a contiguous cache's mask)
            key_valid = cache.key_valid

            def attend(q_lat, token_ids, q_pos):  # noqa: F811 (the same step over other ids)
                del token_ids
                return self.dense_attention(q_lat, rows, row_slots(q_pos), key_valid, row_scale)
        else:
            attend = _ignoring_positions(attend)

        # Mosaic's interpret mode runs ordered callbacks, which jax.checkpoint cannot
        # differentiate: that debugging mode keeps the residuals per tile.
        remat_ok = self.implementation != "mosaic_interpret"
        if self.remat_tiles and remat_ok:
            attend = jax.checkpoint(attend, policy=remat.TILE_POLICY, prevent_cse=False)

        loss_rows = None
        if self.indexer is not None:
            # The indexer feeds only the discrete selection: no gradient reaches it (its
            # parameters get exactly zero, as HF's no_grad indexer), and nothing of it is a
            # residual of the backward pass. The indexer loss reads its projection of
            # constants apart (module doc, "Training the indexer").
            if indexer_loss is None:
                qi, w, ki, gate = jax.lax.stop_gradient(self.indexer.project(x, q_resid, rope))
            else:
                sg = jax.lax.stop_gradient
                qi_l, w_l, ki_l, gate_l = self.indexer.project(sg(x), sg(q_resid), rope)
                qi, w, ki, gate = sg((qi_l, w_l, ki_l, gate_l))
                pooled = self._indexer_kernel(pk.kpool_compress, ki_l, gate_l, mask, self.indexer.pool_ape(ki_l.dtype))
                loss_tile = functools.partial(self.indexer_loss_tile, indexer_loss, pooled, rows, row_scale, mask,
                                              reduce_axis=reduce_axis)
                if remat_ok:
                    loss_tile = jax.checkpoint(loss_tile, policy=jax.checkpoint_policies.nothing_saveable,
                                               prevent_cse=False)
            cache = self.compress_pools(cache, ki, gate, chunk)  # pooled before any query scores
            # A cache storing rotated pooled keys (``rotate_index``): the queries too, once.
            qi = index_queries(qi, cache.rotate_index, cache.index_format)
            select_k = self.cfg.select_k(cache.max_pools)

            def tile(q_lat, q_pos, qi, w, n_vis, *loss_queries):
                pools = self.choose_pools(qi, w, cache, q_pos, select_k)
                token_ids = remat.name(self.expand_to_tokens(pools, cache, n_vis, q_pos), remat.TOKEN_IDS)
                res = (token_ids, attend(q_lat, token_ids, q_pos))
                if not loss_queries:
                    return res
                return res + (loss_tile(*loss_queries, q_pos, q_lat, pools, row_slots(token_ids)),)

            loss_q = () if indexer_loss is None else ((qi_l, 0), (w_l, 0))
            topk, o_lat, *kl = self.by_query_tiles(tile, self.block_q, (q_lat, 0), (chunk.q_pos, -1), (qi, 0), (w, 0),
                                              (chunk.n_vis, 0), *loss_q)
            if kl:
                loss_rows = jax.tree.map(lambda a: a.sum(1), kl[0])
        else:
            topk = remat.name(self.reused_token_ids(prev_topk, chunk.q_pos), remat.TOKEN_IDS)
            _, o_lat = self.by_query_tiles(lambda q_lat, ids, q_pos: (ids, attend(q_lat, ids, q_pos)), self.block_q,
                                      (q_lat, 0), (topk, -1), (chunk.q_pos, -1))
        out = self.output_projection(remat.name(o_lat, remat.O_LAT), mask, reduce_axis=reduce_axis)
        if loss_rows is None:
            return out, topk, cache.end_chunk(chunk)
        return out, topk, cache.end_chunk(chunk), loss_rows

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
        (scores, first_key), _ = run_fn(self, _selection_scores, (x, mask))
        return scores, first_key

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
        with jax.named_scope(PROJECT):
            q_resid = rms_norm(self._dense(x, "q_a_proj"), self.q_a_layernorm[...], eps)
            q = matmul("bsr,rhd->bshd", q_resid, self.q_b_proj[...])
            q_lat = absorb_q(q[..., : cfg.qk_nope_head_dim], self.w_uk[...])
            kv = self._dense(x, "kv_a_proj")
            latent = rms_norm(kv[..., : cfg.kv_lora_rank], self.kv_a_layernorm[...], eps)
            if rope is not None:
                cos, sin = rope
                q_rot = apply_rope(q[..., cfg.qk_nope_head_dim:], cos[:, :, None], sin[:, :, None], "interleaved")
                q_lat = jnp.concatenate([q_lat, q_rot.astype(q_lat.dtype)], -1)
                k_rot = apply_rope(kv[..., cfg.kv_lora_rank:], cos, sin, "interleaved")
                latent = jnp.concatenate([latent, k_rot.astype(latent.dtype)], -1)
        return (remat.name(q_resid, remat.Q_RESID), remat.name(q_lat, remat.Q_LAT),
                remat.name(latent, remat.LATENT))

    def _dense(self, x, name: str):  # x @ self.<name>, plus its attention_bias bias if any
        y, bias = dense(x, getattr(self, name)[...], part=(name,)), getattr(self, name + "_bias")
        return y if bias is None else y + bias[...].astype(y.dtype)

    def compress_pools(self, cache: LayerCache, keys, gate, chunk: Chunk):
        """Step 1: pool the keys ``[B, S, D]`` of every pool that completes in this chunk,
        once, into the cache (``kpool_compress`` between the cache's ``pool_window`` and
        ``store_pools``; nothing written when the chunk does not fit)."""
        kernel = functools.partial(self._indexer_kernel, pk.kpool_compress)
        with jax.named_scope(COMPRESS_POOLS):
            win = cache.pool_window(keys, gate, chunk)
            pooled, _, pooled_valid = kernel(win.keys, win.gate, win.valid,
                                             self.indexer.pool_ape(win.keys.dtype), win.first_pool)
            return cache.store_pools(win, pooled, pooled_valid, chunk)

    def score_pools(self, qi, w, cache: LayerCache, q_pos) -> jax.Array:
        """Step 2: ``[B, Q, P]`` float32 scores of the cache's pools for the queries ``qi [B,
        Q, Hi, D]`` (weights ``w [B, Q, Hi]``) at slots ``q_pos [B, Q]``; ``-inf`` where a
        pool is not a candidate (invalid, or not yet complete). The kernel and its key
        source are the cache's (``pool_keys``: ``index_scores``, or ``index_scores_paged``
        through the block table, each row's own pools only)."""
        kp = self.cfg.index_kpool
        with jax.named_scope(SCORE_POOLS):
            keys = cache.pool_keys()
            return self._indexer_kernel(keys.kernel, qi, w, *keys.operands(), q_pos, keys.scale, kpool=kp)

    def select_pools(self, scores, select_k: int, n_live=None) -> jax.Array:
        """Step 3: ``[B, Q, select_k]`` pool ids of the best scores (``topk_pools``); with
        ``n_live [B, Q]`` (``live_pools``) a Pallas kernel reads only those (the rest are
        no candidates anyway)."""
        with jax.named_scope(SELECT_POOLS):
            if n_live is None or self.implementation == "xla":
                return self._indexer_kernel(pk.topk_pools, scores, select_k)
            return self._indexer_kernel(pk.topk_pools, scores, select_k, n_live=n_live)

    def choose_pools(self, qi, w, cache: LayerCache, q_pos, select_k: int, stream: bool = False) -> jax.Array:
        """Steps 2-3 of a query tile. A query whose complete pools all fit the selection
        (``live_pools <= select_k``: a short context) needs no score: its ids are every
        candidate, ascending (``all_pools``: ``topk_pools``' ids of any finite scores). The
        kernels score and select every row (no control flow, no second selection picked by
        a ``where``: issue 46). ``"xla"`` skips scoring under a ``lax.cond`` when every
        query is short and takes ``all_pools`` for each short row; it scores by
        ``score_and_select`` (live pools only) in a decode step, where the cache says so
        (``STREAM_PREFILL``) or ``stream``; else ``select_pools`` of ``score_pools``."""
        n_live = cache.live_pools(q_pos)
        if self.implementation != "xla":
            return self.select_pools(self.score_pools(qi, w, cache, q_pos), select_k, n_live)
        short = n_live <= select_k
        every = self.all_pools(cache, q_pos, select_k)

        def scored():
            if stream or cache.STREAM_PREFILL or q_pos.shape[1] == 1:
                pools = self.score_and_select(qi, w, cache, q_pos, select_k)
            else:
                pools = self.select_pools(self.score_pools(qi, w, cache, q_pos), select_k, n_live)
            return jnp.where(short[..., None], every, pools)

        return jax.lax.cond(short.all(), lambda: every, scored)

    def all_pools(self, cache: LayerCache, q_pos, select_k: int) -> jax.Array:
        """Steps 2-3 of a short query: ``[B, Q, select_k]`` every candidate among the first
        ``select_k`` pools, ascending, then ``-1`` (``pk.visible_pool_ids`` on the cache's
        candidate rule, ``PooledKeys.tile``; no key is read)."""
        kp = self.cfg.index_kpool
        with jax.named_scope(SELECT_POOLS):
            _, valid, first_key, _ = cache.pool_keys().tile(0, select_k, kp)
            return pk.visible_pool_ids(valid, first_key, q_pos, select_k=select_k, kpool=kp)

    def score_and_select(self, qi, w, cache: LayerCache, q_pos, select_k: int) -> jax.Array:
        """Steps 2-3 fused, as ``implementation="xla"`` runs them (``choose_pools``): ``[B,
        Q, select_k]`` pool ids, the same as ``select_pools(score_pools(...))`` bit for bit,
        but scored tile by tile (``pool_tile`` pools, ``cache.interface.tile_scorer`` over
        the cache's ``pool_keys``) only up to the batch's latest complete pool
        (``live_pool_tiles``) with a running top-k (``pk.streaming_topk``): the work follows
        the live tokens, not the capacity. Each tile is scored under ``"score_pools"``, the
        loop runs under ``"select_pools"``. Two tilings, one program: while the batch's live
        pools fit one large tile, tiles of ``2 * select_k`` (so a 4K context does not score
        a 32K-token tile); past it, ``pool_tile``'s (a ``lax.cond`` on the live count)."""
        kp, n_pools = self.cfg.index_kpool, cache.max_pools
        if cache.TILES_PAST_END:  # the same tiles whatever the capacity (``interface``)
            n_pools = max(n_pools, self.POOL_TILE)
        big = self.pool_tile(qi.shape, n_pools)
        small = min(big, max(self.MIN_POOL_TILE, 2 * select_k))
        operands = (qi, w, q_pos, cache.pool_keys())
        with jax.named_scope(SELECT_POOLS):
            n_live = cache.live_pools(q_pos)

            def run(tile):
                return pk.streaming_topk(_scoring_step(tile_scorer(tile, kp)), operands,
                                         live_pool_tiles(n_live, tile), tile=tile, n_pools=n_pools,
                                         select_k=select_k, rows=q_pos.shape)

            if small == big:
                return run(big)
            return jax.lax.cond(jnp.max(n_live) <= big, lambda: run(small), lambda: run(big))

    @staticmethod
    def by_query_tiles(fn, block_q: int, *arrays):
        """``fn`` over ``ops.query_tiles(block_q, *arrays)``, joined back to ``[B, S, ...]``:
        one tile (a decode step) a plain call, several a ``lax.map`` (every call is traced:
        an eager call runs as one jitted program). ``fn`` is called from this module, so a
        call's stack stays flat (``tests/test_call_stack.py``); ``parallel.context`` uses it too."""
        tiles, untile = query_tiles(block_q, *arrays)
        if tiles[0].shape[0] == 1:
            return untile(jax.tree.map(lambda a: a[None], fn(*(a[0] for a in tiles))))
        return untile(jax.lax.map(lambda t: fn(*t), tiles))

    def pool_tile(self, qi_shape, n_pools: int) -> int:
        """Pools per tile of ``score_and_select`` for queries ``qi [B, Q, Hi, D]`` over ``P =
        n_pools``: the largest power of two whose head scores fit ``SCORE_TILE_ELEMENTS``,
        between ``MIN_POOL_TILE`` and ``POOL_TILE``, at most ``P``."""
        b, q, hi = qi_shape[:3]
        fit = max(1, self.SCORE_TILE_ELEMENTS // (b * q * hi))
        tile = max(self.MIN_POOL_TILE, 1 << (fit.bit_length() - 1))
        return max(1, min(tile, self.POOL_TILE, n_pools))

    def expand_to_tokens(self, pools, cache: LayerCache, n_vis, q_pos) -> jax.Array:
        """Step 4: the selected pools' tokens and each query's visible tail (the cache's
        ``visible_tail``: the ``n_vis % KP`` valid slots after its last complete pool) as a
        row of ``W = out_width`` token ids ``[B, Q, W]`` (``expand_selection``); ``-1``
        pads. A padding query's row is all ``-1`` by the rules, not by a mask (a kernel
        less, issue 46): at ``q_pos = -1`` no pool is a candidate and no token is in its tail."""
        cfg = self.cfg
        with jax.named_scope(EXPAND_TO_TOKENS):
            tail = cache.visible_tail(pools, n_vis, q_pos, cfg.index_kpool) if cfg.tail_width else None
            return self._indexer_kernel(pk.expand_selection, pools, cache.pool_origin(), tail,
                                        kpool=cfg.index_kpool, out_width=cfg.out_width)

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
        with ``latent_scale [B, L(, G)]`` for an fp8 cache) at ``token_ids [B, Q, W]`` -> ``o_lat
        [B, Q, H, C]``. On a placed layer ``H`` is the device's heads: each device reads its
        own copy of the rows it attends to."""
        with jax.named_scope(SPARSE_ATTENTION):
            return pk.sparse_mla(q_lat, latent, token_ids, latent_scale, scale=self.cfg.softmax_scale,
                                 value_width=self.cfg.kv_lora_rank, implementation=self.implementation)

    def dense_attention(self, q_lat, latent, q_slots, key_valid, latent_scale=None) -> jax.Array:
        """Step 5 of ``attention="dense"`` (``causal_mla``): ``q_lat [B, Q, H, CR]`` over every
        row of ``latent [B, L, CR]`` at or before its slot ``q_slots [B, Q]`` with ``key_valid
        [B, L]`` -> ``o_lat [B, Q, H, C]``, the same parameters and scale as the sparse step
        (under its scope name: the attention step, whichever tokens it reads)."""
        with jax.named_scope(SPARSE_ATTENTION):
            return pk.causal_mla(q_lat, latent, q_slots, key_valid, latent_scale, scale=self.cfg.softmax_scale,
                                 value_width=self.cfg.kv_lora_rank, implementation=self.implementation)

    def indexer_loss_tile(self, mode, pooled, rows, row_scale, key_valid, qi, w, q_pos, q_lat, pools, token_ids,
                          *, reduce_axis=None):
        """The indexer loss of one query tile (``"indexer_loss"``): ``(kl [B, Q],
        is_loss_query [B, Q])`` (``indexer_loss.dense_tile_kl`` / ``sparse_tile_kl``) of the
        scores of ``qi, w`` over the prompt's pools ``pooled`` (``kpool_compress``'s three
        outputs; ``index_scores``, differentiable) against the attention mass of ``q_lat``
        over ``rows`` (dense: every slot ``key_valid`` up to ``q_pos``; sparse: the selected
        ``pools`` and their ``token_ids``). ``reduce_axis``: the head axis the mass is
        summed over."""
        kp = self.cfg.index_kpool
        keys, first_key, pool_valid = pooled
        with jax.named_scope(INDEXER_LOSS):
            scores = self._indexer_kernel(pk.index_scores, qi, w, keys, pool_valid, first_key, q_pos, kpool=kp)
            common = dict(kpool=kp, scale=self.cfg.softmax_scale, reduce_axis=reduce_axis)
            if mode == "dense":
                return dense_tile_kl(scores, q_lat, rows, q_pos, key_valid, first_key, row_scale, **common)
            return sparse_tile_kl(scores, pools, q_lat, rows, token_ids, row_scale, **common)

    def output_projection(self, o_lat, mask=None, *, reduce_axis: str | None = None) -> jax.Array:
        """Step 6: ``o_lat [B, S, H, C]`` -> ``[B, S, hidden]`` through ``w_uv`` and the
        row-parallel ``o_proj`` (plus its bias; ``absorb_o``). With the call's ``mask [B,
        S]``: zeros at padding queries, in the compute dtype (a call's ``out``).
        ``reduce_axis``: the head axis of a placed call's ``shard_map``, whose partial sums
        are ``psum``-ed over it (the call's one collective)."""
        bias = None if self.o_proj_bias is None else self.o_proj_bias[...]
        with jax.named_scope(OUTPUT_PROJECTION):
            out = absorb_o(o_lat, self.w_uv[...], self.o_proj[...], bias, reduce_axis=reduce_axis, mask=mask)
            return out if mask is None else out.astype(self.dtype)

    def _indexer_kernel(self, fn, *args, **kwargs):
        """``fn(*args, implementation=self.implementation, **kwargs)``: an indexer step's kernel."""
        return fn(*args, implementation=self.implementation, **kwargs)


def _selection_scores(layer: DsaAttention, rows, cache, reduce_axis):
    """``DsaAttention.selection_scores``' body on checked inputs ``rows = (x, mask)`` (run
    by ``parallel.execution.run_fn``, per data shard on a placed layer): steps 0-2 on a
    fresh cache. ``cache`` is None, and the indexer has no head-split parameter, so
    ``reduce_axis`` is unused."""
    del cache, reduce_axis
    x, mask = rows
    b, s, _ = x.shape
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    rope = layer.rope(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s)))
    q_resid, _, _ = layer.project(x, rope)
    qi, w, ki, gate = layer.indexer.project(x, q_resid, rope)
    fresh, chunk = init_cache(layer.cfg, b, s, dtype=layer.dtype).begin_chunk(mask)
    cache = layer.compress_pools(fresh, ki, gate, chunk)
    return (layer.score_pools(qi, w, cache, chunk.q_pos), cache.pool_origin()), None


def _ignoring_positions(attend):
    """``attend(q_lat, token_ids)`` as ``attend(q_lat, token_ids, q_pos)`` (the sparse
    attention reads the ids only; ``forward``'s tiles pass both modes the same operands)."""
    return lambda q_lat, token_ids, q_pos: attend(q_lat, token_ids)


@functools.lru_cache(maxsize=None)
def _scoring_step(scorer):
    """``scorer`` (a tile scorer, ``tile_scorer``) under the ``"score_pools"`` scope; one
    function per scorer, so the eager ``while_loop`` trace stays cached."""

    def scores(*args):
        with jax.named_scope(SCORE_POOLS):
            return scorer(*args)

    return scores
