"""Roofline of one DSA layer: bytes moved and FLOPs per kernel, and the time they bound.

``rows(cfg, gpu, context, batch)`` returns one ``RooflineRow`` per kernel of a decode step
(one query per sequence) and of a prefill chunk (``chunk`` queries per sequence, the last
of them at position ``context - 1``), plus a total row per phase; ``glm5-dsa roofline``
(``glm5_dsa_jax.cli.roofline``) prints them and ``scripts/gpu_check.py`` puts measured
times beside them.

Invariants and assumptions (why the numbers are what they are):

* One full layer (with indexer) of ``cfg``; weights, activations and the cache in
  ``elem_bytes`` (bf16: 2), index scores and gate logits in float32, ids int32. The cache
  is sized to the context (``max_length = context``): kernels that scan the pool axis
  (``index_scores``, ``topk_pools``) pay for its capacity, not for the valid pools.
  ``cache_dtype="fp8"`` makes each latent row and pooled key ``width`` e4m3 bytes plus a
  float32 scale (``cache_row_bytes``, as ``glm5_dsa_jax.cache.fp8`` stores them); the stage of
  the incomplete pool stays in the compute dtype.
* Every width is the model's, read from ``cfg`` as the layer uses it: latent rows and the
  absorbed query are ``CR = kv_cache_dim`` wide (``[c, k_rot]`` with RoPE, 576 in
  ``glm_moe_dsa`` / ``deepseek_v32``), the values and ``sparse_mla``'s output ``V =
  kv_lora_rank`` (its ``value_width``); pools are ``index_kpool`` tokens (1 without k-pool
  compression: ``kpool_compress`` then copies the window's keys, and the layer still runs
  it, so it is still counted).
* The projections are the layout table's (``matmuls``): every parameter with a product
  weight's initialiser (``"normal"``, ``fan_in ** -0.5``), its fan-in axes the input, so
  a model type's own tensors (no k-pool gate without k-pool compression, RoPE parts in
  ``q_b_proj`` and ``kv_a_proj_with_mqa``) are counted without a second list.
  ``kv_b_proj``'s parts are the absorbed per-head W_UK / W_UV (``_ABSORBED``).
* Bytes are DRAM bytes as the kernels' own tiling issues them: data a program loads once
  and reuses from registers/shared memory is counted once per program; data reloaded by a
  later pass or by another program is counted again (``index_scores`` reads every pool's
  key once per tile of ``block_q`` queries; ``topk_pools`` streams its row once per radix
  pass plus once to compact; ``sparse_mla`` gathers a row's valid latent rows once per
  block of ``block_h`` heads). Re-reads that an L2 may absorb are still counted, so the
  bound is the kernels' as written, not an ideal of the layer. Small operands a kernel
  re-reads per program (the query tile of ``index_scores``) are counted once: they are
  cache-resident.
* The block sizes are read from the kernels themselves (the defaults of their block-size
  dataclasses, resolved for the shapes as the wrappers resolve them), so a change of
  tiling changes the model.
* FLOPs count multiply-adds as 2; element-wise work (softmax, ReLU, masks) is counted
  roughly (one per operation) and never dominates. The bound is
  ``max(bytes / bandwidth, flops / peak)`` at the GPU's HBM bandwidth and dense bf16
  tensor-core peak (``GPUS``): a lower bound on the kernel's time, assuming full occupancy
  (the ``programs`` column says how many programs a kernel launches per pass; ``topk_pools``
  runs one per query row up to 32K-token contexts and one per 2,048-pool segment beyond).
* The projections are XLA matmuls: each reads its weight once per call and its input and
  output activations once. Element-wise work around them (RoPE, the norms, joining
  ``[q_lat, q_rot]`` and ``[c, k_rot]``) is fused by XLA and not counted.

Context parallelism (``cp_rows``, ``glm5-dsa roofline --cp N``): the decode step on one
device of a sequence axis of ``N`` devices, each holding ``1/N`` of the pools and latent
rows: the indexer's kernels over its ``P/N`` pools, ``sparse_mla`` over every selected row
(the worst case: the whole selection on one device), the merges, and what crosses devices
(``cp_crossing_bytes``) over the GPU's NVLink (``GpuSpec.interconnect``, one direction) or
a given bandwidth. ``cp_rows``' doc lists every row.

``weight_bytes`` and ``step_read_bytes`` (the bytes a step must read at least) and
``step_flops`` (the FLOPs it must do) are also the floor of ``glm5-dsa bench decode``: one
home for those facts.

Training (``train_rows``, ``glm5-dsa roofline --train``): one layer per training step of
``batch`` sequences of ``context`` tokens (every token a query, no cache: the pools are
the sequence's), forward then backward, against the dense-mask formulation MaxText trains
DSA with. The same invariants as above (bytes as the kernels' tiling issues them, FLOPs
with multiply-adds as 2, the bound at the datasheet's bandwidth and bf16 peak). Phases:

* ``train_fwd``: the prefill rows above with ``chunk = context`` (projections,
  ``kpool_compress``, ``index_scores``, ``topk_pools``, ``expand_selection``,
  ``sparse_mla``), plus the ``lse [B, S, H]`` float32 ``sparse_mla`` saves for its
  backward (``sparse_mla`` row). No cache write: a training step keeps no cache.
* ``train_bwd``, the sparse backward (``pallas_kernels.attention_backward``'s kernels):

  - ``xla:<matmul> bwd``, per projection: ``dX = dY W^T`` and ``dW = X^T dY``: twice the
    forward's FLOPs; the weight read and its gradient written once, ``X`` and ``dY``
    read twice, ``dX`` written once. The indexer's projections only with an indexer loss
    (``indexer_loss``): without one no cotangent reaches them (top-k is integers).
  - ``xla:lse_delta``: ``D = rowsum(d_out * out)`` per query and head: both read once,
    ``D`` written in float32.
  - The tiling is the kernels' own (``SparseMlaBackwardBlockSizes``,
    ``IndexScoresBackwardBlockSizes``: their defaults resolved for the shapes).
  - ``sparse_mla_bwd:dq``: query-major, one program per (query, ``block_h`` heads), as the
    forward: gathers the query's valid rows once per head block, reads its ``q``,
    ``d_out``, ``lse`` and ``D``, recomputes ``p`` (``2 CR`` per head and id), ``dp``
    (``2 V``), accumulates ``dq`` (``2 CR``), writes ``dq``.
  - ``selection_transpose``: the XLA sort of the ``N * W`` (row block, query) keys that
    makes ``dlatent`` deterministic: the ids read, then ``SORT_PASSES`` read + write
    passes over 8-byte (key, query) pairs (a radix sort of 32-bit keys in 8-bit digits),
    the CSR offsets and entries written.
  - ``sparse_mla_bwd:dlatent``: token-major, one program per block of ``block_rows``
    latent rows, walking its entries (a query that selects at least one of its rows):
    the rows read and their gradient written once per program; per entry the query's
    ``q [H, CR]``, ``d_out [H, V]``, ``lse`` and ``D`` re-read (the price of no atomics:
    a query is re-read once per row block it touches), and ``block_rows * H * (4 CR + 4
    V)`` FLOPs (``p`` and ``dp`` recomputed, ``dkv`` accumulated over every row of the
    block, the unselected ones masked). Entries per query: the expected number of
    distinct row blocks its selection touches when its ``select_k`` pools are spread
    uniformly at random over the visible ones (``_expected_blocks``; attention's locality
    clusters them, so fewer: an upper estimate), every visible block once the query
    selects every pool. The tail's block is not counted apart (at most one per query).
  - with an indexer loss (``indexer_loss``, the next issue's; off: these rows are
    absent): ``index_scores_bwd:dq_dw`` (query-major, ``dq_block_q`` queries a
    program, looping over the pools its queries can see: those pooled keys re-read per
    program, their ``d_scores`` read, ``zeta`` recomputed (``2 D`` per head and pool),
    ``dq`` (``2 D``) and ``dw`` (``2``) accumulated and written once) and
    ``index_scores_bwd:dpooled`` (pool-major, ``dk_block_p`` pools a program: a
    tile some query sees loops over every query of the row, re-reading its ``qi`` and
    ``w`` once per tile, ``zeta`` recomputed and ``dpooled`` accumulated, ``4 D`` per
    query, head and pool; ``d_scores`` read once); and ``xla:kpool_compress bwd`` (XLA's
    vjp of the pooling: keys and gate logits read, their gradients written).
* ``dense_mask``, the attention part of MaxText's formulation on the same projections and
  selection (its projections are the sparse ones, not repeated): ``xla:topk_to_mask``
  (the ids read, the ``[B, S, S]`` bool mask written), ``xla:masked_mla_fwd`` (scores
  ``[B, H, S, S]`` over ``CR`` and values over ``V`` for every key: ``2 B H S^2 (CR +
  V)`` FLOPs; the probabilities written once and read once in float32, the mask read
  per head) and ``xla:masked_mla_bwd`` (``dp``, ``dq``, ``dkv`` over every key: ``4 B H
  S^2 (CR + V)`` FLOPs; the saved probabilities read, ``ds`` written and read back);
  the queries and latent rows read once per pass. Every ``[B, H, S, S]`` tensor is
  counted as XLA materialises it without flash fusion (it does, on a GPU, for this
  formulation).
"""

from __future__ import annotations

import dataclasses
import math

from glm5_dsa_jax.model import layout
from glm5_dsa_jax.cache import check_cache_dtype
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.cache.fp8 import is_fp8
from pallas_kernels import (
    ExpandSelectionBlockSizes, IndexScoresBackwardBlockSizes, IndexScoresBlockSizes,
    KpoolCompressBlockSizes, SparseMlaBackwardBlockSizes, SparseMlaBlockSizes, TopkPoolsBlockSizes,
)

__all__ = ["GPUS", "GpuSpec", "RooflineRow", "rows", "kernel_bounds", "gpu_for_device_kind",
           "weight_bytes", "Matmul", "matmuls", "matmul_weights", "step_read_bytes", "selected_ids",
           "cache_row_bytes", "train_rows", "TRAIN_PHASES", "SORT_PASSES", "cp_rows", "cp_crossing_bytes"]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    bandwidth: float  # bytes / s, HBM
    peak_flops: float  # dense bf16 tensor-core FLOP / s
    source: str
    #: bytes / s one GPU sends (one direction) over NVLink: half the datasheet's total
    #: bidirectional NVLink bandwidth (0: none known, pass one to ``cp_rows``)
    interconnect: float = 0.0


# NVIDIA's datasheets (SXM parts; dense, i.e. without 2:4 sparsity).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM5 80GB", 3.35e12, 989e12,
                    "NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOPS bf16 dense, NVLink 900 GB/s", 450e9),
    "h200": GpuSpec("H200 SXM 141GB", 4.8e12, 989e12,
                    "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOPS bf16 dense, NVLink 900 GB/s", 450e9),
    "a100": GpuSpec("A100 SXM4 80GB", 2.039e12, 312e12,
                    "NVIDIA A100 datasheet: 2,039 GB/s HBM2e, 312 TFLOPS bf16 dense, NVLink 600 GB/s", 300e9),
    "b200": GpuSpec("B200 SXM 180GB", 8.0e12, 2250e12,
                    "NVIDIA B200 (HGX) datasheet: 8 TB/s HBM3e, 2.25 PFLOPS bf16 dense, NVLink 1.8 TB/s", 900e9),
}


@dataclasses.dataclass(frozen=True)
class RooflineRow:
    phase: str  # "decode" | "prefill"
    kernel: str
    bytes: int
    flops: int
    programs: int  # grid size (0 for XLA ops)
    bound_s: float  # max(memory_s, compute_s); a total row: the sum of its kernels' bounds
    limit: str  # "memory" | "compute": the larger of the two parts
    memory_s: float  # bytes / bandwidth
    compute_s: float  # flops / peak

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bounded(spec: "GpuSpec", phase: str, kernel: str, by: int, fl: int, progs: int,
             bound_s: float | None = None) -> RooflineRow:
    """A row with its two parts, ``bytes / bandwidth`` and ``flops / peak``; its bound the
    larger (``bound_s``: a total row's sum of its kernels' bounds)."""
    tm, tc = by / spec.bandwidth, fl / spec.peak_flops
    return RooflineRow(phase, kernel, int(by), int(fl), int(progs), max(tm, tc) if bound_s is None else bound_s,
                       "memory" if tm >= tc else "compute", tm, tc)


# ---------------------------------------------------------------------------- shared facts
@dataclasses.dataclass(frozen=True)
class Matmul:
    """One projection product of a layer, per token (read from the layout table)."""

    #: the row's name: the HF module (``q_b_proj``, ``kv_a_proj_with_mqa``), our parameter
    #: for an HF tensor that is no module's ``.weight`` (``indexer.kpool_gate``), or an
    #: absorbed per-head matrix and its step (``w_uk (absorb_q)``)
    name: str
    #: the parameter it reads (``layout.Param.path``)
    path: tuple[str, ...]
    #: weight elements read
    weights: int
    #: input and output widths per token
    fin: int
    fout: int


#: Weight absorption (``ops.absorb_q`` / ``absorb_o``): ``kv_b_proj`` is kept as one matrix
#: per head, never expanded into per-head keys and values. Its key part (W_UK, the
#: ``qk_nope`` rows) multiplies the query's nope part, transposed (``qk_nope -> kv_lora``),
#: before attention; its value part (W_UV, ``v_head``) the latent output (``kv_lora ->
#: v_head``) after it. View-axis part -> (the step, whether it runs transposed).
_ABSORBED = {"qk_nope": ("absorb_q", True), "v_head": ("absorb_o", False)}


def _matmul(cfg: DsaConfig, t: layout.Tensor, p: layout.Param) -> tuple[Matmul, str | None]:
    """The product of parameter ``p`` (of tensor ``t``) and its absorbed step (None for a
    plain product). A product weight is stored ``[in, out]``, its fan-in axes
    (``Param.fan_in``) the input; a parameter whose leading axis is the heads and not its
    fan-in is a per-head matrix (the heads a batch axis of the product)."""
    dims = dict(zip(p.axes, p.shape(cfg)))
    fan_in = p.fan_in if p.fan_in is not None else p.axes[:1]
    weights, fin = math.prod(dims.values()), math.prod(dims[a] for a in fan_in)
    if p.axes[0] != layout.HEADS or layout.HEADS in fan_in:
        name = t.name if t.hf_name.endswith(".weight") else ".".join(p.path)
        return Matmul(name, p.path, weights, fin, weights // fin), None
    (part,) = [a for a in p.axes if a != layout.HEADS and a not in fan_in]
    if part not in _ABSORBED:
        raise ValueError(f"{p.name}: a per-head matrix over {part!r}, which no absorbed step reads")
    step, transposed = _ABSORBED[part]
    heads = dims[layout.HEADS]
    rows, cols = heads * dims[part], heads * fin
    fin, fout = (rows, cols) if transposed else (cols, rows)
    return Matmul(f"{p.name} ({step})", p.path, weights, fin, fout), step


def matmuls(cfg: DsaConfig, has_indexer: bool = True) -> list[Matmul]:
    """Every product of one layer of ``cfg``, in the order the layer runs them: the
    parameters of ``layout.layer_tensors`` with a ``"normal"`` (``fan_in ** -0.5``, a product
    weight's) initialiser, in table order, with the absorbed W_UK right after the product
    whose output holds the heads (``q_b_proj``: the query it reads) and W_UV right before
    the one whose input holds them (``o_proj``: it reads its output)."""
    plain, absorbed = [], {}
    for t, p in layout.iter_params(layout.layer_tensors(cfg, indexer=has_indexer)):
        if p.init == "normal":
            m, step = _matmul(cfg, t, p)
            if step is None:
                plain.append((t.heads_hf_axis, m))
            else:
                absorbed[step] = m
    out = []
    for heads_axis, m in plain:
        if heads_axis == 1 and "absorb_o" in absorbed:  # o_proj: the heads are its input
            out.append(absorbed.pop("absorb_o"))
        out.append(m)
        if heads_axis == 0 and "absorb_q" in absorbed:  # q_b_proj: the heads are its output
            out.append(absorbed.pop("absorb_q"))
    return out + list(absorbed.values())


def matmul_weights(cfg: DsaConfig, has_indexer: bool = True) -> dict[str, tuple[int, int, int]]:
    """``name -> (weight elements, input width, output width)`` of every matmul of a layer
    (per token; ``w_uk``/``w_uv`` are per-head products, block-diagonal over the heads):
    ``matmuls`` as a dict."""
    return {m.name: (m.weights, m.fin, m.fout) for m in matmuls(cfg, has_indexer)}


def weight_bytes(cfg: DsaConfig, elem_bytes: int = 2, has_indexer: bool = True) -> int:
    """Bytes of every parameter of one layer (matmul weights, norms, biases when
    ``attention_bias``, the indexer's tensors when ``has_indexer``) at ``elem_bytes``."""
    return elem_bytes * sum(math.prod(t.hf_shape(cfg)) for t in layout.layer_tensors(cfg, indexer=has_indexer))


def selected_ids(cfg: DsaConfig, visible: int) -> int:
    """Valid token ids a query that sees ``visible`` tokens attends to: the selected pools'
    tokens plus the incomplete pool's tail."""
    kp = cfg.index_kpool
    pools = min(cfg.index_topk // kp, visible // kp)
    tail = visible % kp if cfg.index_kpool_always_select_tail else 0
    return pools * kp + tail


def step_read_bytes(cfg: DsaConfig, context: int, batch: int, *, weight_elem_bytes: int = 2,
                    cache_elem_bytes: int = 2) -> dict[str, int]:
    """The bytes a decode step must read at least: every weight once, and per sequence the
    pooled keys of the visible pools and the selected latent rows (the tokens it attends
    to, ``kv_cache_dim`` wide). ``{"weights", "pooled", "latent", "cache", "total"}``
    (``cache = pooled + latent``)."""
    n = context
    pooled = batch * (n // cfg.index_kpool) * cfg.index_head_dim * cache_elem_bytes
    latent = batch * selected_ids(cfg, n) * cfg.kv_cache_dim * cache_elem_bytes
    w = weight_bytes(cfg, weight_elem_bytes)
    cache = pooled + latent
    return {"weights": w, "pooled": pooled, "latent": latent, "cache": cache, "total": w + cache}


def step_flops(cfg: DsaConfig, context: int, batch: int, *, dense: bool = False) -> dict[str, int]:
    """The FLOPs a decode step must do at least (multiply-adds as 2), the compute half of
    ``glm5-dsa bench decode``'s floor beside ``step_read_bytes``: every projection once per
    sequence (``matmuls``), the indexer's scores over the visible pools (``2 D + 2`` per pool
    and index head: the product and the head weight) only where the selection matters, i.e.
    more visible complete pools than ``max_select_k`` (below, every pool is selected and no
    score is needed), and the attention over the selected tokens (``2 CR + 2 V`` per token
    and head: scores over the ``kv_cache_dim``-wide rows, values over ``kv_lora_rank``).
    ``dense``: the dense step's (no indexer; attention over every cached token).
    ``{"projections", "index", "attention", "total"}``."""
    proj = 2 * batch * sum(m.weights for m in matmuls(cfg, has_indexer=not dense))
    pools = context // cfg.index_kpool
    index = 0 if dense or pools <= cfg.max_select_k else batch * pools * cfg.index_n_heads * (2 * cfg.index_head_dim + 2)
    tokens = context if dense else selected_ids(cfg, context)
    attn = batch * cfg.num_attention_heads * tokens * (2 * cfg.kv_cache_dim + 2 * cfg.kv_lora_rank)
    return {"projections": proj, "index": index, "attention": attn, "total": proj + index + attn}


# ---------------------------------------------------------------------------- kernel tiling
def cache_row_bytes(width: int, elem_bytes: int = 2, cache_dtype=None) -> int:
    """Bytes of one cache row of ``width`` values (a latent row, a pooled key): ``width *
    elem_bytes`` for ``cache_dtype`` None (the cache in the elements' dtype), ``width *
    itemsize`` for a float dtype, and ``width`` e4m3 bytes plus one float32 scale for fp8
    (``"fp8"``, ``glm5_dsa_jax.cache.fp8``)."""
    if cache_dtype is None:
        return width * elem_bytes
    dt = check_cache_dtype(cache_dtype)
    return width * dt.itemsize + (4 if is_fp8(dt) else 0)


def _kernel_rows(cfg: DsaConfig, context: int, batch: int, queries: int, eb: int, cache_dtype=None,
                 cp: int = 1):
    """(kernel, bytes, flops, programs) of the pipeline kernels for ``queries`` queries per
    sequence at positions ``context - queries .. context - 1``; ``cp``: on one device of a
    sequence axis of that size (``cp_rows``: its ``P/cp`` pools scored, its best ``K'``
    kept, every selected row attended in the worst case, the log-sum-exp written)."""
    b, s, n = batch, queries, context
    kp, d, hi = cfg.index_kpool, cfg.index_head_dim, cfg.index_n_heads
    # Latent rows and queries are CR = kv_cache_dim wide ([c, k_rot] with RoPE), values and
    # outputs V = kv_lora_rank (the layer's value_width).
    nh, cr, v = cfg.num_attention_heads, cfg.kv_cache_dim, cfg.kv_lora_rank
    select_k = cfg.select_k(max(1, n // kp))  # cache capacity in pools (cache sized to the context)
    pools = max(1, n // kp // cp)  # the pools this device holds and scores
    k_loc = min(select_k, pools)  # its candidates (parallel.context: K')
    width = cfg.out_width
    out = []

    # kpool_compress over the window (last KP slots + the chunk): keys (elem) and gate
    # logits (f32) of every window slot once, the pooled keys written.
    win = kp + s
    n_win = max(1, win // kp)
    block_pools = KpoolCompressBlockSizes().resolve(n_win, d).block_pools
    by = b * (win * d * (eb + 4) + win + kp * d * eb + n_win * d * eb)
    fl = b * n_win * kp * d * 8  # add APE, max, sub, exp, sum, div, mul, add per slot
    out.append(("kpool_compress", by, fl, b * -(-n_win // block_pools)))

    # index_scores: grid (query tiles, B, pool tiles); each program loads its key tile once.
    scores_blocks = IndexScoresBlockSizes().resolve(s, pools)
    bq, bp = scores_blocks.block_q, scores_blocks.block_p
    q_tiles, p_tiles = -(-s // bq), -(-pools // bp)
    by = b * (q_tiles * pools * (cache_row_bytes(d, eb, cache_dtype) + 1) + s * hi * (d * eb + 4)
              + s * pools * 4)
    fl = b * s * pools * hi * (2 * d + 3)
    out.append(("index_scores", by, fl, q_tiles * b * p_tiles))

    # topk_pools: 32 / radix_bits counting passes and one compaction pass over the row's
    # float32 scores, then the ids written; one program per query row, or (a row of at
    # least TopkPoolsBlockSizes.MIN_SEGMENTS segments) one per split_p-pool segment of it.
    topk_blocks = TopkPoolsBlockSizes()
    passes = 32 // topk_blocks.radix_bits + 1
    by = b * s * (passes * pools * 4 + k_loc * 4)
    fl = b * s * pools * (passes - 1) * (2 ** topk_blocks.radix_bits) * 2
    out.append(("topk_pools", by, fl, b * s * topk_blocks.programs_per_row(pools)))

    # expand_selection: the pool ids (+ tail ids) in, out_width token ids out.
    n_src = select_k * kp + cfg.tail_width
    ebq = ExpandSelectionBlockSizes().resolve(s, n_src, width).block_q
    by = b * s * (select_k * 4 + cfg.tail_width * 4 + width * 4)
    fl = b * s * (select_k * kp + cfg.tail_width) * 4
    out.append(("expand_selection", by, fl, b * -(-s // ebq)))

    # sparse_mla: grid (B*Q*head blocks, splits); each program scans the id row and
    # gathers its share of the valid latent rows, so every head block gathers them all.
    blk = SparseMlaBlockSizes().resolve((b, s, nh, cr), width)
    n_hb = -(-nh // blk.block_h)
    ids = sum(selected_ids(cfg, n - s + 1 + t) for t in range(s))  # valid ids over the chunk
    by = b * (n_hb * ids * cache_row_bytes(cr, eb, cache_dtype) + s * n_hb * width * 4
              + s * nh * (cr + v) * eb)
    if blk.num_splits > 1:  # float32 partials (acc, max, sum) written and merged
        by += 2 * b * s * blk.num_splits * nh * (v + 2) * 4
    if cp > 1:  # sparse_mla_partial: the log-sum-exp too, float32
        by += b * s * nh * 4
    fl = b * nh * ids * (2 * cr + 2 * v + 5)  # scores over CR, values over V
    out.append(("sparse_mla", by, fl, b * s * n_hb * blk.num_splits))
    return out


def _projection_rows(cfg: DsaConfig, batch: int, queries: int, eb: int):
    t = batch * queries
    out = []
    for m in matmuls(cfg):
        out.append((f"xla:{m.name}", m.weights * eb + t * (m.fin + m.fout) * eb, 2 * t * m.weights, 0))
    return out


def _cache_write_row(cfg: DsaConfig, batch: int, queries: int, eb: int, cache_dtype=None):
    """The step's cache writes: latent rows, validity bytes, the staged keys/gates (the
    stage stays in the compute dtype in an fp8 cache)."""
    kp, d = cfg.index_kpool, cfg.index_head_dim
    row = cache_row_bytes(cfg.kv_cache_dim, eb, cache_dtype)
    by = batch * (queries * (row + 1) + kp * d * (eb + 4) * 2 + kp * 2)
    return ("cache_write", by, 0, 0)


def rows(cfg: DsaConfig, gpu: str | GpuSpec, context: int, batch: int = 1, *,
         chunk: int = 2048, elem_bytes: int = 2, phases=("decode", "prefill"),
         cache_dtype=None) -> list[RooflineRow]:
    """The roofline rows of one layer: per phase, every kernel then ``"total"`` (the sums).

    ``context``: tokens in the cache after the step (the queries are its last tokens);
    ``chunk``: queries per sequence of the prefill chunk (at most ``context``);
    ``cache_dtype``: the latent rows' and pooled keys' dtype (``cache_row_bytes``; None:
    ``elem_bytes``, ``"fp8"``: e4m3 rows and a float32 scale per row).
    """
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    for name, v in (("context", context), ("batch", batch), ("chunk", chunk), ("elem_bytes", elem_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if "prefill" in phases and chunk > context:
        raise ValueError(f"chunk ({chunk}) must be at most context ({context})")
    unknown = set(phases) - {"decode", "prefill"}
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; expected 'decode' and/or 'prefill'")
    cache_row_bytes(1, elem_bytes, cache_dtype)  # a ValueError naming a bad cache dtype
    result = []
    for phase in phases:
        s = 1 if phase == "decode" else chunk
        items = (_projection_rows(cfg, batch, s, elem_bytes)
                 + _kernel_rows(cfg, context, batch, s, elem_bytes, cache_dtype)
                 + [_cache_write_row(cfg, batch, s, elem_bytes, cache_dtype)])
        result += _with_total(spec, phase, items)
    return result


def _with_total(spec: "GpuSpec", phase: str, items) -> list[RooflineRow]:
    """Each ``(kernel, bytes, flops, programs)`` as a row, then the phase's ``"total"``: the
    sums, bound by the sum of the kernels' bounds (they run one after another)."""
    out = [_bounded(spec, phase, kernel, by, fl, progs) for kernel, by, fl, progs in items]
    return out + [_bounded(spec, phase, "total", sum(r.bytes for r in out), sum(r.flops for r in out), 0,
                           bound_s=sum(r.bound_s for r in out))]


def kernel_bounds(cfg: DsaConfig, gpu: str | GpuSpec, context: int, batch: int, queries: int, *,
                  elem_bytes: int = 2, cache_dtype=None) -> dict[str, RooflineRow]:
    """The pipeline kernels alone (no projections), ``queries`` queries per sequence over a
    cache of ``context`` tokens: ``{kernel: RooflineRow}`` (phase ``"q{queries}"``). What
    ``scripts/gpu_check.py`` prints beside its measured times."""
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    out = {}
    for kernel, by, fl, progs in _kernel_rows(cfg, context, batch, queries, elem_bytes, cache_dtype):
        out[kernel] = _bounded(spec, f"q{queries}", kernel, by, fl, progs)
    return out


def cp_crossing_bytes(cfg: DsaConfig, context: int, batch: int, cp: int) -> dict[str, int]:
    """Bytes one device sends per decode step (one query per sequence) on a sequence axis of
    ``cp`` devices (``parallel.context``'s collectives, as a ring moves them): the
    candidates' all-gather (``cp * K'`` int32 keys and ids, of which ``(cp - 1) * K' * 8``
    come from the others), the tail's validity ``psum`` (``KP - 1`` int32), the
    partials' ``psum`` (``H * (V + 1)`` float32: outputs and weights) and ``pmax`` (``H``
    float32); an all-reduce of ``n`` bytes sends ``2 (cp - 1) / cp * n``. ``H`` is every
    head (the roofline's layer has no tp; on tp ``t`` a device merges ``H / t``).
    Independent of the context once ``P/cp >= select_k``."""
    kp, nh, v = cfg.index_kpool, cfg.num_attention_heads, cfg.kv_lora_rank
    select_k = cfg.select_k(max(1, context // kp))
    k_loc = min(select_k, max(1, context // kp // cp))
    ring = lambda n: 2 * (cp - 1) * n // cp  # noqa: E731  an all-reduce's bytes sent per device
    out = {"candidates": batch * (cp - 1) * k_loc * 8,
           "tail_valid": batch * ring(cfg.tail_width * 4),
           "partials": batch * (ring(nh * (v + 1) * 4) + ring(nh * 4))}
    out["total"] = sum(out.values())
    return out


def cp_rows(cfg: DsaConfig, gpu: str | GpuSpec, context: int, batch: int = 1, cp: int = 2, *,
            elem_bytes: int = 2, cache_dtype=None, interconnect: float | None = None) -> list[RooflineRow]:
    """The decode step on one device of a sequence axis of ``cp`` devices (context
    parallelism, ``glm5_dsa_jax.parallel.context``), phase ``"decode_cp{cp}"``, every row
    then ``"total"``; compare with ``rows(..., phases=("decode",))`` (cp 1).

    Per device: the projections, ``kpool_compress`` and the cache write as at cp 1 (every
    device projects the step's token and keeps the replicated stage); ``index_scores`` and
    ``topk_pools`` over its ``P/cp`` pools (exact: each holds ``1/cp`` of them), its ``K' =
    min(select_k, P/cp)`` candidates; ``expand_selection`` of the merged ``select_k``;
    ``sparse_mla`` over **every** selected latent row (the worst case: the selection all on
    this device; balanced it reads ``1/cp`` of them) and its log-sum-exp written;
    ``cp:merge_candidates`` (the ``cp * K'`` candidates read, sorted, ``select_k`` ids
    written; FLOPs: a compare per element and sort level, roughly) and
    ``cp:merge_partials`` (the partial outputs and weights read, reduced, written, float32).
    Then one ``interconnect:`` row per collective (``cp_crossing_bytes``): ``bound_s`` is
    its bytes over ``interconnect`` (bytes / s one device sends; default the GPU's NVLink
    figure, ``GpuSpec.interconnect``), ``limit`` ``"interconnect"``, no memory or compute
    part; a collective's launch latency (microseconds) is not counted. The total is the
    sum of the bounds: nothing overlaps."""
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    for name, val in (("context", context), ("batch", batch), ("cp", cp), ("elem_bytes", elem_bytes)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    if context % (cp * cfg.index_kpool):
        raise ValueError(f"context {context} is not divisible by cp * index_kpool = {cp} * {cfg.index_kpool} = "
                         f"{cp * cfg.index_kpool}: each of the cp devices holds a contiguous range of whole pools")
    link = spec.interconnect if interconnect is None else interconnect
    if not link > 0:
        raise ValueError(f"no interconnect bandwidth for {spec.name}: pass interconnect (bytes / s)")
    cache_row_bytes(1, elem_bytes, cache_dtype)  # a ValueError naming a bad cache dtype
    b, nh, v = batch, cfg.num_attention_heads, cfg.kv_lora_rank
    select_k = cfg.select_k(max(1, context // cfg.index_kpool))
    k_loc = min(select_k, context // cfg.index_kpool // cp)
    n_cand = cp * k_loc
    items = (_projection_rows(cfg, b, 1, elem_bytes)
             + _kernel_rows(cfg, context, b, 1, elem_bytes, cache_dtype, cp=cp)
             + [_cache_write_row(cfg, b, 1, elem_bytes, cache_dtype)])
    if cp > 1:
        items += [("cp:merge_candidates", b * (n_cand * 8 + select_k * 4),
                   b * n_cand * max(1, math.ceil(math.log2(n_cand))), 0),
                  ("cp:merge_partials", b * nh * (2 * (v + 1) * 4 + 4 + v * elem_bytes), b * nh * (3 * v + 4), 0)]
    phase = f"decode_cp{cp}"
    out = [_bounded(spec, phase, kernel, by, fl, progs) for kernel, by, fl, progs in items]
    if cp > 1:
        for name, by in cp_crossing_bytes(cfg, context, b, cp).items():
            if name != "total" and by:
                out.append(RooflineRow(phase, f"interconnect:{name}", int(by), 0, 0, by / link, "interconnect",
                                       0.0, 0.0))
    return out + [_bounded(spec, phase, "total", sum(r.bytes for r in out), sum(r.flops for r in out), 0,
                           bound_s=sum(r.bound_s for r in out))]


def gpu_for_device_kind(kind: str) -> str | None:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``; None for a device not in ``GPUS``."""
    k = kind.lower()
    return next((g for g in GPUS if g in k), None)


# ---------------------------------------------------------------------------- training
#: ``train_rows``' phases, in order.
TRAIN_PHASES = ("train_fwd", "train_bwd", "dense_mask")
#: Read + write passes of ``selection_transpose``'s sort (8-bit digits of a 32-bit key).
SORT_PASSES = 4


def _expected_blocks(cfg: DsaConfig, visible: int, block_rows: int) -> float:
    """Distinct ``block_rows`` blocks of latent rows a query that sees ``visible`` tokens
    selects rows in: every visible block when it selects every complete pool, else the
    expectation for ``select_k`` of the ``P`` pools drawn uniformly (a block of ``block_rows
    / KP`` pools is missed with probability ``(1 - k / P) ** (block_rows / KP)``)."""
    kp = cfg.index_kpool
    n_pools, blocks = visible // kp, -(-visible // block_rows)
    k = min(cfg.max_select_k, n_pools)
    if k >= n_pools:
        return float(-(-(n_pools * kp) // block_rows))
    return blocks * (1.0 - (1.0 - k / n_pools) ** max(1, block_rows // kp))


def _train_bwd_rows(cfg: DsaConfig, context: int, batch: int, eb: int, indexer_loss: bool):
    b, s = batch, context
    t = b * s
    nh, cr, v, width = cfg.num_attention_heads, cfg.kv_cache_dim, cfg.kv_lora_rank, cfg.out_width
    out = []
    for m in matmuls(cfg):
        if m.path[0] == "indexer" and not indexer_loss:
            continue
        out.append((f"xla:{m.name} bwd", 2 * m.weights * eb + t * (2 * m.fin + 2 * m.fout) * eb + t * m.fin * eb,
                    4 * t * m.weights, 0))
    out.append(("xla:lse_delta", t * nh * (2 * v * eb + 4), 2 * t * nh * v, 0))
    ids = b * sum(selected_ids(cfg, q + 1) for q in range(s))  # valid (query, id) pairs
    blk = SparseMlaBackwardBlockSizes().resolve((b, s, nh, cr), width)
    n_hb = -(-nh // blk.block_h)
    by = n_hb * ids * cr * eb + t * n_hb * width * 4 + t * nh * (2 * cr * eb + v * eb + 8)
    out.append(("sparse_mla_bwd:dq", by, nh * ids * (4 * cr + 2 * v + 5), t * n_hb))
    e = t * width
    out.append(("selection_transpose", e * 4 + SORT_PASSES * 2 * e * 8 + e * 8, 0, 0))
    br = blk.block_rows
    entries = b * sum(_expected_blocks(cfg, q + 1, br) for q in range(s))
    n_blocks = -(-t // br)
    by = n_blocks * (2 * br * cr * eb + 8) + entries * (nh * (cr + v) * eb + nh * 8 + 8)
    out.append(("sparse_mla_bwd:dlatent", int(by), int(entries * br * nh * (4 * cr + 4 * v)), n_blocks))
    if indexer_loss:
        kp, d, hi = cfg.index_kpool, cfg.index_head_dim, cfg.index_n_heads
        pools = max(1, s // kp)
        sblk = IndexScoresBackwardBlockSizes().resolve(s, pools)
        bq, bp = sblk.dq_block_q, sblk.dk_block_p
        q_tiles, p_tiles = -(-s // bq), -(-pools // bp)
        # pools the queries of each dq program see (its last query's, the loop's bound)
        seen = sum(min(pools, min(s, (i + 1) * bq) // kp) for i in range(q_tiles))
        q_bytes = s * hi * (d * eb + 4)  # a sequence's queries and head weights
        out.append(("index_scores_bwd:dq_dw", b * (seen * (d * eb + bq * 4) + 2 * q_bytes),
                    b * seen * bq * hi * (4 * d + 2), b * q_tiles))
        out.append(("index_scores_bwd:dpooled", b * (p_tiles * q_bytes + s * pools * 4 + 2 * pools * d * eb),
                    b * s * pools * hi * 4 * d, b * p_tiles))
        out.append(("xla:kpool_compress bwd", b * (2 * s * d * (eb + 4) + pools * d * eb),
                    b * pools * kp * d * 8, 0))
    return out


def _dense_mask_rows(cfg: DsaConfig, context: int, batch: int, eb: int):
    b, s = batch, context
    nh, cr, v, width = cfg.num_attention_heads, cfg.kv_cache_dim, cfg.kv_lora_rank, cfg.out_width
    sq = b * nh * s * s  # elements of one [B, H, S, S] tensor
    qk = b * s * (nh * cr + cr) * eb  # queries and latent rows, read once
    return [
        ("xla:topk_to_mask", b * s * (width * 4 + s), b * s * width * s, 0),
        ("xla:masked_mla_fwd", qk + b * s * nh * v * eb + nh * b * s * s + 2 * sq * 4,
         2 * sq * (cr + v) + 5 * sq, 0),
        ("xla:masked_mla_bwd", 2 * qk + 2 * b * s * nh * v * eb + 3 * sq * 4,
         4 * sq * (cr + v) + 4 * sq, 0),
    ]


def train_rows(cfg: DsaConfig, gpu: str | GpuSpec, context: int, batch: int = 1, *,
               elem_bytes: int = 2, indexer_loss: bool = False) -> list[RooflineRow]:
    """The training roofline of one layer (module doc, "Training"): per phase of
    ``TRAIN_PHASES``, every row then ``"total"``. ``context``: tokens per sequence;
    ``indexer_loss``: the indexer's backward too (an indexer loss gives it a cotangent)."""
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    for name, val in (("context", context), ("batch", batch), ("elem_bytes", elem_bytes)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    fwd = _projection_rows(cfg, batch, context, elem_bytes) + _kernel_rows(cfg, context, batch, context, elem_bytes)
    lse = batch * context * cfg.num_attention_heads * 4
    fwd = [(k, by + lse if k == "sparse_mla" else by, fl, pr) for k, by, fl, pr in fwd]
    phases = {"train_fwd": fwd,
              "train_bwd": _train_bwd_rows(cfg, context, batch, elem_bytes, indexer_loss),
              "dense_mask": _dense_mask_rows(cfg, context, batch, elem_bytes)}
    return [r for phase in TRAIN_PHASES for r in _with_total(spec, phase, phases[phase])]
