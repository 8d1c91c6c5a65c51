"""What ``glm5_dsa_jax.tools.gpu_compile`` compiles: one ``Case`` per kernel and layer ``Step``.

Invariants:

* A ``Step`` gives the kernels the shapes one layer step gives them (see
  ``contiguous_step.contiguous_call``); ``default_cases`` covers every kernel at decode,
  prefill-chunk and one-shot-prompt steps, 4K / 128K / 1M-token contexts, batch 1 and 8,
  in bfloat16, over the contiguous cache and, for the kernels whose inputs the paged cache changes
  (``PAGED_KERNELS``), over the paged one too.
* Paged steps (``Step.cache == "paged"``) use the paged cache's layout in pages of
  ``PAGE_SIZE`` tokens, ``context`` tokens of capacity per sequence and a page pool with
  room for every sequence's capacity: ``index_scores`` runs as ``index_scores_paged``
  (pooled-key pages through the block table), ``topk_pools`` with a ``n_live`` bound,
  ``sparse_mla`` over the shared latent pool ``[1, batch * context, C]``.
* ``Step.index_keys``: ``"float"``, pooled indexer keys in the step's dtype, or ``"int8"``,
  an fp8 cache's ``index_keys="int8"`` keys (``cache.fp8.index_format``: one float32 scale
  per ``INDEX_GROUP`` columns) scored by float32 rotated queries (``fp8.index_queries``);
  the Triton scoring kernels then gather the group scales and dequantise at the tile's load
  (another kernel body, so another register count). ``INT8_KEY_KERNELS`` have such cases,
  at the forward steps, contiguous and paged.
* Backward kernels (``BACKWARD_KERNELS``: ``sparse_mla``'s ``dq`` and token-major
  ``dlatent`` kernels) are cases at the steps a training step's gradient launches them
  (``TRAIN_STEPS``: a prefill chunk or a whole prompt, queries in tiles of ``block_q``
  over the context's latent rows), not at decode steps.
* Shapes follow the config: ``index_kpool`` (1 without a tail for the RoPE models, whose
  indexer selects tokens), and ``sparse_mla``'s query and cache rows ``kv_cache_dim =
  kv_lora_rank + qk_rope_head_dim`` wide (``[c, k_rot]``), its values the ``kv_lora_rank``
  latent columns (``value_width``).
* Adding a kernel is one ``KERNELS`` entry: a function from the model config, a ``Step``
  and block-size overrides to the public wrapper call (``implementation="pallas"``) and its
  abstract inputs. ``KERNEL_MODULES`` names the entry that launches each kernel module's
  ``pallas_call`` (``tests/test_gpu_compile.py`` requires every such module to have one), so
  a new kernel module cannot go uncompiled.
* Mosaic GPU kernels (``MOSAIC_KERNELS``, Hopper and newer, jax >= 0.11) are cases like the
  others, kept out of ``KERNELS`` (so out of the default cases and the Triton checks that
  read ``KERNELS``): ``mosaic_cases`` lists them, ``compile_cases`` compiles them only for
  targets of compute capability >= 9.0 (``sm_90a`` code). ``MOSAIC_LAUNCHES`` names each
  one's launches at a step (kernel names and grids: Mosaic's custom call carries neither in
  readable form; as CUDA launches them: Pallas' leading grid dims past three flattened, the
  order reversed), ``MOSAIC_THREADS`` its threads per block (one warpgroup of 128 per
  Pallas thread), ``MOSAIC_KERNEL_MODULES`` its ``pallas_kernels`` module. Each is built by
  its ``KERNELS`` entry's builder given ``implementation="mosaic"`` and the Mosaic
  block-size class: the same wrapper call at the same shapes. The ``wgmma``
  kernels (``MOSAIC_HOPPER_ONLY``: scoring and attention) exist for 9.x only: Blackwell
  has no ``wgmma`` (``mosaic_on_target``).
* The model: ``DsaConfig.glm53_flash`` with the worker's ``config`` overrides, or, when
  ``config`` holds ``"preset"``, that preset (``glm5``, ``glm52``, ``deepseek-v32``: the
  Mosaic kernels are compiled at every supported model's shapes).
* ``build`` returns, with the call, the key under which cases share a trace: the kernel,
  its input shapes and dtypes, the static arguments not visible in them, and the block sizes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable

import jax.numpy as jnp

import pallas_kernels as pk
from glm5_dsa_jax.cache.fp8 import index_format
from pallas_kernels.mosaic_attention_backward import (
    TRANSPOSE_ROWS, MosaicSparseMlaBackwardBlockSizes, mosaic_sparse_mla_backward,
)
from pallas_kernels.mosaic_attention_backward import launch_grids as mosaic_sparse_mla_backward_grids
from pallas_kernels.mosaic_scoring_backward import (
    MosaicIndexScoresBackwardBlockSizes, mosaic_index_scores_backward,
)
from pallas_kernels.mosaic_scoring_backward import launch_grids as mosaic_index_scores_backward_grids
from pallas_kernels.transpose import selection_transpose

__all__ = ["Step", "Case", "KERNELS", "KERNEL_MODULES", "default_cases", "switch_point_cases",
           "PREFILL_CHUNK", "CONTEXTS", "SWITCH_CONTEXTS", "BATCHES", "STEPS", "DTYPES", "CACHES", "PAGE_SIZE",
           "PAGED_KERNELS", "BACKWARD_KERNELS", "INDEX_KEYS", "INT8_KEY_KERNELS", "TRAIN_STEPS", "MOSAIC_KERNELS",
           "MOSAIC_KERNEL_MODULES", "MOSAIC_LAUNCHES", "MOSAIC_THREADS", "MOSAIC_HOPPER_ONLY", "mosaic_cases", "mosaic_on_target"]

PREFILL_CHUNK = 4096  # tokens of one prefill chunk (the layer takes chunks of any length)
CONTEXTS = (4096, 131072, 1 << 20)  # cache capacity in tokens; 1M = max_position_embeddings
#: Contexts (GLM-5.3-Flash, 4-token pools) where a kernel's code path or tiling changes, so
#: that each class of row length is compiled at least once (``switch_point_cases``):
#: 64 tokens, 16 pools: ``index_scores``' smallest pool tile, a ``select_k`` of 16
#: (``topk_pools``' ``block_k``, ``expand_selection``'s ``block_w`` follow it); 2,048
#: tokens, 512 pools: the whole selection budget (``max_select_k``), ``topk_pools``' tile
#: cut to the row; 8,192 tokens, 2,048 pools: the one-program ``topk_pools`` over two
#: tiles (it spilled on sm_80 at 4 warps); 32,764 and 32,768 tokens, 8,191 and 8,192
#: pools: the last one-program row and the first multi-program one. ``CONTEXTS`` hold the
#: other classes (a one-tile row, long multi-program rows).
SWITCH_CONTEXTS = (64, 2048, 8192, 32764, 32768)
BATCHES = (1, 8)
STEPS = ("decode", "prefill", "prompt")
DTYPES = ("bfloat16",)  # the serving dtype; "float32" is the layer's other compute dtype
CACHES = ("contiguous", "paged")  # init_cache's one timeline per batch; init_paged_cache's pages
PAGE_SIZE = 64  # tokens a page of the paged cache (its default; vLLM's and SGLang's too)
PAGED_KERNELS = ("index_scores", "topk_pools", "sparse_mla")  # their inputs differ when paged
#: Pooled-key formats of a step (``Step.index_keys``): in the step's dtype, or int8 with
#: group scales (an fp8 cache's ``index_keys="int8"``).
INDEX_KEYS = ("float", "int8")
INT8_KEY_KERNELS = ("index_scores",)  # the kernels int8 keys change (forward; Triton)
#: Backward kernels: launched by a training step's gradient, which the layer takes over
#: whole chunks of queries (``TRAIN_STEPS``; tiles of ``block_q`` queries, as the forward),
#: never at a decode step; their default cases are at those steps only.
BACKWARD_KERNELS = ("sparse_mla_backward", "sparse_mla_backward_mosaic", "index_scores_backward_mosaic")
TRAIN_STEPS = ("prefill", "prompt")


@dataclasses.dataclass(frozen=True)
class Step:
    """The shapes one layer step gives the kernels (see ``contiguous_step.contiguous_call``).

    ``decode``: one new token; ``prefill``: a chunk of ``PREFILL_CHUNK`` tokens;
    ``prompt``: a one-shot prefill of the whole context. The cache holds ``context`` slots
    (``pools = context // kpool`` pooled keys); queries go through the indexer and attention
    in tiles of ``block_q`` (the layer's default, 64); pooling runs over a window of the
    last ``kpool`` cached slots plus the chunk. ``cache``: ``"contiguous"`` or ``"paged"``
    (see the module doc; ``context`` is then the capacity of each sequence).
    """

    kind: str
    batch: int
    context: int
    dtype: str = "bfloat16"  # the layer's compute and cache dtype
    block_q: int = 64
    cache: str = "contiguous"
    index_keys: str = "float"

    def __post_init__(self):
        if self.kind not in STEPS:
            raise ValueError(f"Step.kind must be one of {STEPS}, got {self.kind!r}")
        if self.cache not in CACHES:
            raise ValueError(f"Step.cache must be one of {CACHES}, got {self.cache!r}")
        if self.index_keys not in INDEX_KEYS:
            raise ValueError(f"Step.index_keys must be one of {INDEX_KEYS}, got {self.index_keys!r}")
        if self.cache == "paged" and (not isinstance(self.context, int)
                                      or self.context % PAGE_SIZE):
            raise ValueError(
                f"Step.context must be a multiple of PAGE_SIZE ({PAGE_SIZE}) for a paged "
                f"step, got {self.context!r}")
        for name in ("batch", "context", "block_q"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Step.{name} must be a positive int, got {v!r}")

    @property
    def chunk(self) -> int:
        return {"decode": 1, "prefill": min(PREFILL_CHUNK, self.context),
                "prompt": self.context}[self.kind]

    @property
    def queries(self) -> int:
        return min(self.block_q, self.chunk)


def _kpool_compress(cfg, s: Step, blocks: dict):
    b, w, d, dt = s.batch, s.chunk + cfg.index_kpool, cfg.index_head_dim, jnp.dtype(s.dtype)
    bs = pk.KpoolCompressBlockSizes(**blocks)
    fn = lambda k, g, v, ape, first: pk.kpool_compress(  # noqa: E731
        k, g, v, ape, first, implementation="pallas", block_sizes=bs)
    return fn, [((b, w, d), dt), ((b, w, d), jnp.float32), ((b, w), jnp.bool_),
                ((cfg.index_kpool, d), dt), ((b,), jnp.int32)]


# A builder of a kernel with a Mosaic GPU form also takes the ``implementation`` and its
# block-size class (``sizes``): ``KERNELS`` uses the defaults (Triton), ``MOSAIC_KERNELS``
# passes ``"mosaic"`` and the Mosaic class.


def _index_scores(cfg, s: Step, blocks: dict, implementation="pallas",
                  sizes=pk.IndexScoresBlockSizes):
    b, q, p, dt = s.batch, s.queries, max(1, s.context // cfg.index_kpool), jnp.dtype(s.dtype)
    h, d, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    bs = sizes(**blocks)
    # int8 keys (Step.index_keys): float32 queries, and [..., G] float32 group scales last
    q_dt, k_dt = (jnp.float32, jnp.int8) if s.index_keys == "int8" else (dt, dt)
    groups = index_format(d, "int8").n_groups
    if s.cache == "paged":
        pg, ppp = s.context // PAGE_SIZE, PAGE_SIZE // kp
        fn = lambda qi, w, pages, bt, counts, qp, *scale: pk.index_scores_paged(  # noqa: E731
            qi, w, pages, bt, counts, qp, *scale, kpool=kp, implementation=implementation,
            block_sizes=bs)
        avals = [((b, q, h, d), q_dt), ((b, q, h), jnp.float32), ((b * pg, ppp, d), k_dt),
                 ((b, pg), jnp.int32), ((b,), jnp.int32), ((b, q), jnp.int32)]
        scale = ((b * pg, ppp, groups), jnp.float32)
    else:
        fn = lambda qi, w, pooled, pv, fk, qp, *scale: pk.index_scores(  # noqa: E731
            qi, w, pooled, pv, fk, qp, *scale, kpool=kp, implementation=implementation, block_sizes=bs)
        avals = [((b, q, h, d), q_dt), ((b, q, h), jnp.float32), ((b, p, d), k_dt),
                 ((b, p), jnp.bool_), ((b,), jnp.int32), ((b, q), jnp.int32)]
        scale = ((b, p, groups), jnp.float32)
    return fn, avals + ([scale] if s.index_keys == "int8" else [])


def _index_scores_backward(cfg, s: Step, blocks: dict):
    # The training step's scoring backward (contiguous keys; a paged step gathers its pools
    # and runs the same kernels): the inputs of ``_index_scores`` plus the scores' cotangent.
    b, q, p, dt = s.batch, s.queries, max(1, s.context // cfg.index_kpool), jnp.dtype(s.dtype)
    h, d, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    bs = pk.IndexScoresBackwardBlockSizes(**blocks)
    fn = lambda qi, w, pooled, pv, fk, qp, g: pk.index_scores_backward(  # noqa: E731
        qi, w, pooled, pv, fk, qp, g, kpool=kp, implementation="pallas", block_sizes=bs)
    return fn, [((b, q, h, d), dt), ((b, q, h), jnp.float32), ((b, p, d), dt),
                ((b, p), jnp.bool_), ((b,), jnp.int32), ((b, q), jnp.int32),
                ((b, q, p), jnp.float32)]


def _topk_pools(cfg, s: Step, blocks: dict, implementation="pallas",
                sizes=pk.TopkPoolsBlockSizes):
    p = max(1, s.context // cfg.index_kpool)
    k = cfg.select_k(p)
    bs = sizes(**blocks)
    if s.cache == "paged":  # each query's visible pools bound its row
        fn = lambda scores, n_live: pk.topk_pools(  # noqa: E731
            scores, k, implementation=implementation, block_sizes=bs, n_live=n_live)
        return fn, [((s.batch, s.queries, p), jnp.float32),
                    ((s.batch, s.queries), jnp.int32)], (k,)
    fn = lambda scores: pk.topk_pools(  # noqa: E731
        scores, k, implementation=implementation, block_sizes=bs)
    return fn, [((s.batch, s.queries, p), jnp.float32)], (k,)


def _expand_selection(cfg, s: Step, blocks: dict):
    b, q, kp, ow = s.batch, s.queries, cfg.index_kpool, cfg.out_width
    bs = pk.ExpandSelectionBlockSizes(**blocks)
    k = cfg.select_k(max(1, s.context // kp))
    avals = [((b, q, k), jnp.int32), ((b,), jnp.int32)]
    if cfg.tail_width:
        avals.append(((b, q, cfg.tail_width), jnp.int32))
        fn = lambda pools, fk, tail: pk.expand_selection(  # noqa: E731
            pools, fk, tail, kpool=kp, out_width=ow, implementation="pallas", block_sizes=bs)
    else:
        fn = lambda pools, fk: pk.expand_selection(  # noqa: E731
            pools, fk, None, kpool=kp, out_width=ow, implementation="pallas", block_sizes=bs)
    return fn, avals


def _sparse_mla(cfg, s: Step, blocks: dict, implementation="pallas",
                sizes=pk.SparseMlaBlockSizes):
    # A cache row is kv_cache_dim = kv_lora_rank + qk_rope_head_dim wide ([c, k_rot]); the
    # query [q_lat, q_rot] as wide; the values are the kv_lora_rank latent columns.
    b, q, dt, cr = s.batch, s.queries, jnp.dtype(s.dtype), cfg.kv_cache_dim
    scale, v = cfg.softmax_scale, cfg.kv_lora_rank
    bs = sizes(**blocks)
    fn = lambda qr, lat, ids: pk.sparse_mla(  # noqa: E731
        qr, lat, ids, scale=scale, value_width=v, implementation=implementation,
        block_sizes=bs)
    latent = (1, b * s.context, cr) if s.cache == "paged" else (b, s.context, cr)
    return fn, [((b, q, cfg.num_attention_heads, cr), dt), (latent, dt),
                ((b, q, cfg.out_width), jnp.int32)], (v,)


def _sparse_mla_backward(cfg, s: Step, blocks: dict):
    # sparse_mla's backward at the forward's shapes (the layer differentiates attention per
    # query tile of block_q): the dq kernel and the token-major dlatent kernel.
    b, q, dt, cr = s.batch, s.queries, jnp.dtype(s.dtype), cfg.kv_cache_dim
    h, scale, v = cfg.num_attention_heads, cfg.softmax_scale, cfg.kv_lora_rank
    bs = pk.SparseMlaBackwardBlockSizes(**blocks)
    fn = lambda qr, lat, ids, out, lse, d_out: pk.sparse_mla_backward(  # noqa: E731
        qr, lat, ids, out, lse, d_out, scale=scale, value_width=v, implementation="pallas",
        block_sizes=bs)
    latent = (1, b * s.context, cr) if s.cache == "paged" else (b, s.context, cr)
    return fn, [((b, q, h, cr), dt), (latent, dt), ((b, q, cfg.out_width), jnp.int32),
                ((b, q, h, v), dt), ((b, q, h), jnp.float32), ((b, q, h, v), dt)], (v,)


#: One entry per kernel: ``(cfg, step, blocks) -> (fn, [(shape, dtype), ...][, static])``.
#: ``fn`` calls the public wrapper with ``implementation="pallas"`` and ``block_sizes`` built
#: from ``blocks`` (the fields of the kernel's block-size dataclass to override; empty in the
#: default cases: the wrapper's own block sizes); the optional third item lists the
#: static arguments not visible in the input shapes (they join the key under which cases
#: share a trace).
KERNELS: dict[str, Callable] = {
    "kpool_compress": _kpool_compress,
    "index_scores": _index_scores,
    "index_scores_backward": _index_scores_backward,
    "topk_pools": _topk_pools,
    "expand_selection": _expand_selection,
    "sparse_mla": _sparse_mla,
    "sparse_mla_backward": _sparse_mla_backward,
}

#: Every kernel module of ``pallas_kernels`` that launches a ``pallas_call``, mapped to the
#: ``KERNELS`` entry whose wrapper launches its kernels. ``tests/test_gpu_compile.py``
#: requires every such module to be here.
KERNEL_MODULES: dict[str, str] = {
    "pooling": "kpool_compress",
    "scoring": "index_scores",  # index_scores_paged too, on paged steps
    "scoring_backward": "index_scores_backward",  # its two kernels (dq / dw, dpooled)
    "radix_select": "topk_pools",
    "expansion": "expand_selection",
    "attention": "sparse_mla",
    "attention_backward": "sparse_mla_backward",
}


def _sparse_mla_backward_mosaic(cfg, s: Step, blocks: dict):
    # The forward's shapes (``_sparse_mla``) plus out, lse and d_out; the transpose is built
    # inside the call (XLA), as the custom_vjp's backward builds it.
    _, avals, static = _sparse_mla(cfg, s, {})
    (q_shape, dt), (latent, _), ids = avals
    scale, v = cfg.softmax_scale, cfg.kv_lora_rank
    bs = MosaicSparseMlaBackwardBlockSizes(**blocks)
    out = (q_shape[:3] + (v,), dt)

    def fn(qr, lat, ids, o, lse, do):
        tr = selection_transpose(ids, lat.shape[1], shared=lat.shape[0] == 1,
                                 block_rows=TRANSPOSE_ROWS)
        return mosaic_sparse_mla_backward(qr, lat, ids, o, lse, do, tr, scale=scale, value_width=v,
                                          interpret=False, block_sizes=bs)
    return fn, [(q_shape, dt), (latent, dt), ids, out, (q_shape[:3], jnp.float32), out], static


def _index_scores_backward_mosaic(cfg, s: Step, blocks: dict):
    # Contiguous keys only (the paged backward gathers its pools into this layout): a paged
    # step compiles the same call at its pool count.
    b, q, p, dt = s.batch, s.queries, max(1, s.context // cfg.index_kpool), jnp.dtype(s.dtype)
    h, d, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    bs = MosaicIndexScoresBackwardBlockSizes(**blocks)
    fn = lambda qi, w, pooled, pv, fk, qp, g: mosaic_index_scores_backward(  # noqa: E731
        qi, w, pooled, pv, fk, qp, g, kpool=kp, interpret=False, block_sizes=bs)
    return fn, [((b, q, h, d), dt), ((b, q, h), jnp.float32), ((b, p, d), dt),
                ((b, p), jnp.bool_), ((b,), jnp.int32), ((b, q), jnp.int32),
                ((b, q, p), jnp.float32)]


#: The Mosaic GPU kernels, as ``KERNELS`` entries (``implementation="mosaic"``); see the
#: module doc. The backward kernels (``*_backward_mosaic``) are built from their own
#: functions (no public wrapper dispatches to them by ``implementation``).
MOSAIC_KERNELS: dict[str, Callable] = {
    "index_scores_mosaic": functools.partial(
        _index_scores, implementation="mosaic", sizes=pk.MosaicIndexScoresBlockSizes),
    "topk_pools_mosaic": functools.partial(
        _topk_pools, implementation="mosaic", sizes=pk.MosaicTopkPoolsBlockSizes),
    "sparse_mla_mosaic": functools.partial(
        _sparse_mla, implementation="mosaic", sizes=pk.MosaicSparseMlaBlockSizes),
    "sparse_mla_backward_mosaic": _sparse_mla_backward_mosaic,
    "index_scores_backward_mosaic": _index_scores_backward_mosaic,
}
MOSAIC_KERNEL_MODULES: dict[str, str] = {
    "mosaic_scoring": "index_scores_mosaic",  # index_scores_paged too, on paged steps
    "mosaic_selection": "topk_pools_mosaic",
    "mosaic_attention": "sparse_mla_mosaic",
    "mosaic_attention_backward": "sparse_mla_backward_mosaic",
    "mosaic_scoring_backward": "index_scores_backward_mosaic",
}
#: The Mosaic kernels whose MMAs are Hopper's ``wgmma``, which Blackwell (sm_100) does not
#: have (its tensor cores take ``tcgen05`` MMAs into tensor memory; LLVM cannot select
#: ``wgmma.fence`` for sm_100a): they compile only for compute capability 9.x.
MOSAIC_HOPPER_ONLY: tuple[str, ...] = ("index_scores_mosaic", "sparse_mla_mosaic",
                                       "sparse_mla_backward_mosaic", "index_scores_backward_mosaic")
#: One warpgroup (128 threads) per CTA in every Mosaic kernel of this package.
MOSAIC_THREADS: dict[str, int] = {k: 128 for k in MOSAIC_KERNELS}


def _cuda_grid(grid: tuple) -> tuple:
    """The CUDA launch grid of a Pallas Mosaic GPU ``grid``: its leading dims past the last
    two flattened into one, then reversed (Pallas iterates row-major, CUDA's x is minor);
    so a ``(rows,)`` grid launches ``(rows, 1, 1)``."""
    grid = tuple(grid)
    if len(grid) > 3:
        n = 1
        for g in grid[:-2]:
            n *= g
        grid = (n, *grid[-2:])
    return ((1,) * (3 - len(grid)) + grid)[::-1]


def _topk_pools_mosaic_launches(cfg, s: Step, blocks: dict) -> dict:
    p = max(1, s.context // cfg.index_kpool)
    bs = pk.MosaicTopkPoolsBlockSizes(**blocks)
    rows = s.batch * s.queries
    if bs.multi_program(p):
        grid = _cuda_grid((rows, -(-p // bs.split_p)))
        return {"topk_pools_mosaic_count": grid, "topk_pools_mosaic_compact": grid}
    return {"topk_pools_mosaic": _cuda_grid((rows,))}


def _index_scores_mosaic_launches(cfg, s: Step, blocks: dict) -> dict:
    # mosaic_scoring._launch: grid (query tiles, B, pool tiles of block_p)
    bs = pk.MosaicIndexScoresBlockSizes(**blocks).resolve(s.queries)
    p = s.context // PAGE_SIZE * (PAGE_SIZE // cfg.index_kpool) if s.cache == "paged" else \
        max(1, s.context // cfg.index_kpool)
    grid = (-(-s.queries // bs.block_q), s.batch, -(-p // bs.block_p))
    name = "mosaic_index_scores_paged" if s.cache == "paged" else "mosaic_index_scores"
    return {name: _cuda_grid(grid)}


def _sparse_mla_mosaic_launches(cfg, s: Step, blocks: dict) -> dict:
    # mosaic_attention.mosaic_sparse_mla: grid (B*Q rows, head blocks, value blocks, splits)
    from pallas_kernels.mosaic_attention import HEAD_TILE

    rows, n_h = s.batch * s.queries, -(-cfg.num_attention_heads // HEAD_TILE)
    v = -(-cfg.kv_lora_rank // 128) * 128
    bs = pk.MosaicSparseMlaBlockSizes(**blocks).resolve(rows, n_h, cfg.out_width, v)
    return {"mosaic_sparse_mla": _cuda_grid((rows, n_h, v // bs.block_v, bs.num_splits))}


def _sparse_mla_backward_mosaic_launches(cfg, s: Step, blocks: dict) -> dict:
    # dq over (B*Q rows, head tiles, column blocks); dlatent over (row tiles of the [B, L]
    # rows, or the paged pool's [1, B * L], column blocks)
    grids = mosaic_sparse_mla_backward_grids(
        s.batch * s.queries, cfg.num_attention_heads, s.batch * s.context, cfg.kv_cache_dim,
        cfg.kv_lora_rank, MosaicSparseMlaBackwardBlockSizes(**blocks))
    return {name: _cuda_grid(grid) for name, grid in grids.items()}


def _index_scores_backward_mosaic_launches(cfg, s: Step, blocks: dict) -> dict:
    grids = mosaic_index_scores_backward_grids(
        s.batch, s.queries, cfg.index_n_heads, max(1, s.context // cfg.index_kpool),
        MosaicIndexScoresBackwardBlockSizes(**blocks))
    return {name: _cuda_grid(grid) for name, grid in grids.items()}


#: Per Mosaic kernel: ``(cfg, step, blocks) -> {kernel name: CUDA grid}``, the launches its
#: wrapper makes (a kernel name ``N`` compiles to the PTX entry ``N_mosaic_gpu_kernel``).
MOSAIC_LAUNCHES: dict[str, Callable] = {
    "index_scores_mosaic": _index_scores_mosaic_launches,
    "topk_pools_mosaic": _topk_pools_mosaic_launches,
    "sparse_mla_mosaic": _sparse_mla_mosaic_launches,
    "sparse_mla_backward_mosaic": _sparse_mla_backward_mosaic_launches,
    "index_scores_backward_mosaic": _index_scores_backward_mosaic_launches,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel at one step; ``blocks`` (``(field, value)`` pairs of the kernel's
    block-size dataclass) overrides the wrapper's block sizes (none in the default cases)."""

    kernel: str
    step: Step
    blocks: tuple = ()

    @property
    def id(self) -> str:
        s = self.step
        dt = "" if s.dtype == "bfloat16" else f" {s.dtype}"
        bl = "".join(f" {k}={v}" for k, v in self.blocks)
        paged = " paged" if s.cache == "paged" else ""
        keys = " int8-keys" if s.index_keys == "int8" else ""
        return f"{self.kernel} {s.kind} b{s.batch} {_tokens(s.context)}{dt}{paged}{keys}{bl}"


def _tokens(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def default_cases(kernels: Iterable[str] | None = None, *, contexts=CONTEXTS, batches=BATCHES,
                  steps=STEPS, dtypes=DTYPES, caches=CACHES, index_keys=INDEX_KEYS) -> list[Case]:
    """Every kernel at every step, context, batch, dtype, cache kind and pooled-key format
    (by default bfloat16, the serving dtype, at 4K, 128K and 1M tokens, batch 1 and 8,
    contiguous and paged; a paged case only for ``PAGED_KERNELS``, the others being the same
    either way; a ``BACKWARD_KERNELS`` case only at the ``TRAIN_STEPS``; an int8-key case
    only for ``INT8_KEY_KERNELS``)."""
    kernels = list(KERNELS) if kernels is None else list(kernels)
    unknown = sorted(set(kernels) - set(KERNELS) - set(MOSAIC_KERNELS))
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; known: {sorted(KERNELS) + sorted(MOSAIC_KERNELS)}")
    for name, values in (("contexts", contexts), ("batches", batches)):
        if not values or any(not isinstance(v, int) or v <= 0 for v in values):
            raise ValueError(f"{name} must be positive ints, got {list(values)}")
    if not steps or set(steps) - set(STEPS):
        raise ValueError(f"steps must be among {STEPS}, got {list(steps)}")
    if not dtypes or set(dtypes) - {"bfloat16", "float32"}:
        raise ValueError(f"dtypes must be among ('bfloat16', 'float32'), got {list(dtypes)}")
    if not caches or set(caches) - set(CACHES):
        raise ValueError(f"caches must be among {CACHES}, got {list(caches)}")
    if not index_keys or set(index_keys) - set(INDEX_KEYS):
        raise ValueError(f"index_keys must be among {INDEX_KEYS}, got {list(index_keys)}")
    paged = set(PAGED_KERNELS) | set(MOSAIC_KERNELS)  # each Mosaic kernel has a paged form
    return [Case(k, Step(kind, b, n, dt, cache=c, index_keys=ik)) for c in CACHES if c in caches
            for k in kernels if c == "contiguous" or k in paged
            for ik in INDEX_KEYS if ik in index_keys and (ik == "float" or k in INT8_KEY_KERNELS)
            for dt in dtypes for n in contexts for kind in steps
            if k not in BACKWARD_KERNELS or kind in TRAIN_STEPS for b in batches]


def switch_point_cases(contexts=SWITCH_CONTEXTS) -> list[Case]:
    """The forward Triton kernels at a decode step (batch 1) of every ``SWITCH_CONTEXTS``
    row length: the path switch points ``default_cases`` (4K, 128K, 1M) step over; the
    scoring kernel with int8 keys too."""
    forward = [k for k in KERNELS if k not in BACKWARD_KERNELS and k != "index_scores_backward"]
    return default_cases(forward, contexts=contexts, batches=(1,), steps=("decode",), caches=("contiguous",))


def mosaic_cases(**kwargs) -> list[Case]:
    """``default_cases`` of the Mosaic GPU kernels (same keyword arguments)."""
    return default_cases(list(MOSAIC_KERNELS), **kwargs)


def mosaic_on_target(kernel: str, capability: tuple[int, int]) -> bool:
    """Whether ``kernel`` (any ``KERNELS`` or ``MOSAIC_KERNELS`` name) exists for a GPU of
    compute ``capability``: Triton kernels everywhere, Mosaic ones from 9.0 on (sm_90a
    code), the ``wgmma`` ones (``MOSAIC_HOPPER_ONLY``) on 9.x only."""
    if kernel not in MOSAIC_KERNELS:
        return True
    return capability >= (9, 0) and (kernel not in MOSAIC_HOPPER_ONLY or capability[0] == 9)


def build(cfg, case: Case):
    out = {**KERNELS, **MOSAIC_KERNELS}[case.kernel](cfg, case.step, dict(case.blocks))
    fn, avals = out[0], out[1]
    static = out[2] if len(out) > 2 else ()
    key = (case.kernel, tuple((tuple(sh), str(dt)) for sh, dt in avals), tuple(static),
           case.blocks)
    return fn, avals, key
