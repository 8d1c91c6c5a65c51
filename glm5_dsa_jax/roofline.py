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
  output activations once.

``weight_bytes`` and ``step_read_bytes`` are also the weight-read floor of
``glm5-dsa bench decode`` (the bytes a step must read at least): one home for those facts.
"""

from __future__ import annotations

import dataclasses
import math

from glm5_dsa_jax import layout
from glm5_dsa_jax.config import DsaConfig
from pallas_kernels import (
    ExpandSelectionBlockSizes, IndexScoresBlockSizes, KpoolCompressBlockSizes,
    SparseMlaBlockSizes, TopkPoolsBlockSizes,
)

__all__ = ["GPUS", "GpuSpec", "RooflineRow", "rows", "kernel_bounds", "gpu_for_device_kind",
           "weight_bytes", "matmul_weights", "step_read_bytes", "selected_ids"]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    bandwidth: float  # bytes / s, HBM
    peak_flops: float  # dense bf16 tensor-core FLOP / s
    source: str


# NVIDIA's datasheets (SXM parts; dense, i.e. without 2:4 sparsity).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM5 80GB", 3.35e12, 989e12, "NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOPS bf16 dense"),
    "h200": GpuSpec("H200 SXM 141GB", 4.8e12, 989e12, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOPS bf16 dense"),
    "a100": GpuSpec("A100 SXM4 80GB", 2.039e12, 312e12, "NVIDIA A100 datasheet: 2,039 GB/s HBM2e, 312 TFLOPS bf16 dense"),
    "b200": GpuSpec("B200 SXM 180GB", 8.0e12, 2250e12, "NVIDIA B200 (HGX) datasheet: 8 TB/s HBM3e, 2.25 PFLOPS bf16 dense"),
}


@dataclasses.dataclass(frozen=True)
class RooflineRow:
    phase: str  # "decode" | "prefill"
    kernel: str
    bytes: int
    flops: int
    programs: int  # grid size (0 for XLA ops)
    bound_s: float  # max(bytes / bandwidth, flops / peak)
    limit: str  # "memory" | "compute"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- shared facts
def matmul_weights(cfg: DsaConfig, has_indexer: bool = True) -> dict[str, tuple[int, int, int]]:
    """``name -> (weight elements, input width, output width)`` of every matmul of a layer
    (per token; ``w_uk``/``w_uv`` are per-head products, block-diagonal over the heads)."""
    h, nh, c = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    nope, v, ql = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    # Named after the HF modules (the layout table's names), w_uk/w_uv by their product.
    w = {
        "q_a_proj": (h * ql, h, ql),
        "q_b_proj": (ql * nh * cfg.qk_head_dim, ql, nh * cfg.qk_head_dim),
        "w_uk (absorb_q)": (nh * nope * c, nh * nope, nh * c),
        layout.find_param(("kv_a_proj",))[0].name: (h * cfg.kv_cache_dim, h, cfg.kv_cache_dim),
        "w_uv (absorb_o)": (nh * v * c, nh * c, nh * v),
        "o_proj": (nh * v * h, nh * v, h),
    }
    if has_indexer:
        d, hi = cfg.index_head_dim, cfg.index_n_heads
        w.update({"indexer.wq_b": (ql * hi * d, ql, hi * d), "indexer.wk": (h * d, h, d),
                  "indexer.weights_proj": (h * hi, h, hi), "indexer.kpool_gate": (h * d, h, d)})
    return w


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
    to). ``{"weights", "cache", "total"}``."""
    n = context
    pooled = (n // cfg.index_kpool) * cfg.index_head_dim * cache_elem_bytes
    latent = selected_ids(cfg, n) * cfg.kv_lora_rank * cache_elem_bytes
    w = weight_bytes(cfg, weight_elem_bytes)
    cache = batch * (pooled + latent)
    return {"weights": w, "cache": cache, "total": w + cache}


# ---------------------------------------------------------------------------- kernel tiling
def _kernel_rows(cfg: DsaConfig, context: int, batch: int, queries: int, eb: int):
    """(kernel, bytes, flops, programs) of the pipeline kernels for ``queries`` queries per
    sequence at positions ``context - queries .. context - 1``."""
    b, s, n = batch, queries, context
    kp, d, hi = cfg.index_kpool, cfg.index_head_dim, cfg.index_n_heads
    nh, c = cfg.num_attention_heads, cfg.kv_lora_rank
    pools = max(1, n // kp)  # cache capacity in pools (cache sized to the context)
    select_k = cfg.select_k(pools)
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
    by = b * (q_tiles * pools * (d * eb + 1) + s * hi * (d * eb + 4) + s * pools * 4)
    fl = b * s * pools * hi * (2 * d + 3)
    out.append(("index_scores", by, fl, q_tiles * b * p_tiles))

    # topk_pools: 32 / radix_bits counting passes and one compaction pass over the row's
    # float32 scores, then the ids written; one program per query row, or (a row of at
    # least TopkPoolsBlockSizes.MIN_SEGMENTS segments) one per split_p-pool segment of it.
    topk_blocks = TopkPoolsBlockSizes()
    passes = 32 // topk_blocks.radix_bits + 1
    by = b * s * (passes * pools * 4 + select_k * 4)
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
    blk = SparseMlaBlockSizes().resolve((b, s, nh, c), width)
    n_hb = -(-nh // blk.block_h)
    ids = sum(selected_ids(cfg, n - s + 1 + t) for t in range(s))  # valid ids over the chunk
    by = b * (n_hb * ids * c * eb + s * n_hb * width * 4 + 2 * s * nh * c * eb)
    if blk.num_splits > 1:  # float32 partials (acc, max, sum) written and merged
        by += 2 * b * s * blk.num_splits * nh * (c + 2) * 4
    fl = b * nh * ids * (4 * c + 5)
    out.append(("sparse_mla", by, fl, b * s * n_hb * blk.num_splits))
    return out


def _projection_rows(cfg: DsaConfig, batch: int, queries: int, eb: int):
    t = batch * queries
    out = []
    for name, (w, fin, fout) in matmul_weights(cfg).items():
        out.append((f"xla:{name}", w * eb + t * (fin + fout) * eb, 2 * t * w, 0))
    return out


def _cache_write_row(cfg: DsaConfig, batch: int, queries: int, eb: int):
    """The step's cache writes: latent rows, validity bytes, the staged keys/gates."""
    kp, d = cfg.index_kpool, cfg.index_head_dim
    by = batch * (queries * (cfg.kv_lora_rank * eb + 1) + kp * d * (eb + 4) * 2 + kp * 2)
    return ("cache_write", by, 0, 0)


def rows(cfg: DsaConfig, gpu: str | GpuSpec, context: int, batch: int = 1, *,
         chunk: int = 2048, elem_bytes: int = 2, phases=("decode", "prefill")) -> list[RooflineRow]:
    """The roofline rows of one layer: per phase, every kernel then ``"total"`` (the sums).

    ``context``: tokens in the cache after the step (the queries are its last tokens);
    ``chunk``: queries per sequence of the prefill chunk (at most ``context``).
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
    result = []
    for phase in phases:
        s = 1 if phase == "decode" else chunk
        items = (_projection_rows(cfg, batch, s, elem_bytes)
                 + _kernel_rows(cfg, context, batch, s, elem_bytes)
                 + [_cache_write_row(cfg, batch, s, elem_bytes)])
        tb = tf = 0
        tt = 0.0
        for kernel, by, fl, progs in items:
            tm, tc = by / spec.bandwidth, fl / spec.peak_flops
            result.append(RooflineRow(phase, kernel, int(by), int(fl), int(progs), max(tm, tc),
                                      "memory" if tm >= tc else "compute"))
            tb, tf, tt = tb + by, tf + fl, tt + max(tm, tc)
        result.append(RooflineRow(phase, "total", int(tb), int(tf), 0, tt,
                                  "memory" if tb / spec.bandwidth >= tf / spec.peak_flops else "compute"))
    return result


def kernel_bounds(cfg: DsaConfig, gpu: str | GpuSpec, context: int, batch: int, queries: int, *,
                  elem_bytes: int = 2) -> dict[str, RooflineRow]:
    """The pipeline kernels alone (no projections), ``queries`` queries per sequence over a
    cache of ``context`` tokens: ``{kernel: RooflineRow}`` (phase ``"q{queries}"``). What
    ``scripts/gpu_check.py`` prints beside its measured times."""
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    out = {}
    for kernel, by, fl, progs in _kernel_rows(cfg, context, batch, queries, elem_bytes):
        tm, tc = by / spec.bandwidth, fl / spec.peak_flops
        out[kernel] = RooflineRow(f"q{queries}", kernel, int(by), int(fl), int(progs), max(tm, tc),
                                  "memory" if tm >= tc else "compute")
    return out


def gpu_for_device_kind(kind: str) -> str | None:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``; None for a device not in ``GPUS``."""
    k = kind.lower()
    return next((g for g in GPUS if g in k), None)
