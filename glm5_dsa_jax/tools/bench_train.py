"""``glm5-dsa bench train``: forward + backward time and peak memory of one DSA layer, sparse
against the dense-mask formulation.

A benchmark, not a test: ``run`` returns the rows and ``glm5_dsa_jax.cli.bench`` prints them
(a table, or one JSON object with ``--json``). For each batch size and token count ``S`` it
builds one full layer (with indexer) of the preset, random weights, random hidden states
``x [B, S, hidden]`` (every token valid, no cache: a training sequence) and a fixed random
cotangent ``g [B, S, hidden]``, and compiles, per row (``ROWS``, each row's ``measures``):

* ``sparse``: ``jax.jit(jax.value_and_grad(loss))`` of ``loss(params) = sum(layer(x)[0] *
  g)`` w.r.t. every parameter of the layer (``nnx.split`` / ``nnx.merge`` of the public
  call, ``DsaAttention.__call__``): the layer's own pipeline, top-k and expansion
  included, with whatever ``custom_vjp`` and checkpoint policy the layer and the kernels
  have. Nothing here picks a policy: the bench measures what a user's ``nnx.grad`` gets.
* ``dense_mask``: the formulation MaxText trains DSA with, on the same parameters and the
  same selection: the layer's projections (``project``), then attention of every query over
  *every* key with the selection as a dense boolean mask (``topk_to_mask`` of the sparse
  call's ``topk``, computed once outside the gradient: integers, no gradient either way),
  ``mla_masked_attention`` (scores ``[B, S, H, S]`` in float32), then ``output_projection``.
  The indexer's parameters get no gradient in either row (no indexer loss).
* ``indexer_loss_dense`` / ``indexer_loss_sparse``: a step of ``glm5-dsa train-indexer``'s
  two stages without the optimiser: ``jax.jit(jax.value_and_grad)`` of the layer's indexer
  loss (``layer(x, attention="dense", indexer_loss="dense")``, the warm-up; ``"sparse"``
  for both, sparse training) w.r.t. the indexer's parameters only (``INDEXER_PARAMS``; the
  rest of the layer is an argument, not a constant of the program). The dense loss is taken
  in query tiles with the attention's log-sum-exp, so its scratch memory per token should
  stay flat in the context where the dense mask's grows.

The loss is a fixed random projection of the output, so the output's gradient is dense
and does not depend on the output (a squared loss would fold the forward into it).

Per row: the compiled program's memory analysis (``temp_bytes``: XLA's scratch for the
step, the activations the backward keeps included; ``temp_bytes_per_token`` that over
``B * S``; ``argument_bytes``, ``output_bytes``), which costs a compilation and no run, and
the median milliseconds of ``iters`` steps after a warm-up (``median_ms``), only where the
step fits: ``argument + output + temp`` bytes within ``max_bytes`` (default
``default_max_bytes()``: half the host's available memory on a CPU, the device's
``bytes_limit`` on an accelerator). A row that does not fit says so in ``note`` and has
``median_ms`` None: its memory is still measured, which is the point (the dense mask's
grows with ``S**2``).

Why compile every row even when it cannot run: peak memory per token is the fact the
training issue is about, and XLA's memory analysis is exact for the compiled program
without allocating it. The time is what one device of this host does; a CPU's numbers are
no GPU's (``glm5-dsa roofline --train`` models those).
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.model.indexer_loss import INDEXER_PARAMS
from glm5_dsa_jax.model.layer import DsaAttention

__all__ = ["ROWS", "run", "train_layer", "sparse_step", "dense_mask_step", "indexer_loss_step",
           "default_max_bytes", "check_tokens"]

#: Each row of the benchmark and what it measures (printed by the CLI, in the JSON).
ROWS: dict[str, str] = {
    "sparse": "jitted jax.value_and_grad of sum(layer(x)[0] * g) w.r.t. every parameter: the "
              "layer's own call (indexer, top-k, sparse MLA) forward + backward",
    "dense_mask": "the same parameters and selection, attention over every key with the top-k "
                  "as a dense [B, S, S] mask (scores [B, S, H, S], MaxText's formulation), "
                  "forward + backward",
    "indexer_loss_dense": "jitted jax.value_and_grad of the layer's dense indexer loss (attention="
                          "'dense', indexer_loss='dense': the warm-up stage) w.r.t. the indexer's "
                          "parameters only",
    "indexer_loss_sparse": "the same with attention='sparse', indexer_loss='sparse' (sparse training: "
                           "the KL over the selected pools)",
}


def default_max_bytes(device=None) -> int:
    """The most bytes a timed step may need (arguments + outputs + scratch): the device's
    ``bytes_limit`` where it reports one (an accelerator), else half the host's available
    physical memory (``os.sysconf``; 8 GiB when it cannot say)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def check_tokens(cfg: DsaConfig, tokens: list[int]) -> None:
    """``ValueError`` unless every token count is a positive int within the preset's
    ``max_position_embeddings`` (a training sequence's positions are ``0 .. S - 1``)."""
    for s in tokens:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"tokens must be positive ints, got {s!r}")
        if s > cfg.max_position_embeddings:
            raise ValueError(f"tokens {s:,} exceed max_position_embeddings="
                             f"{cfg.max_position_embeddings:,} of the preset")


def train_layer(preset: str, implementation: str = "xla", dtype=jnp.bfloat16) -> DsaAttention:
    """One full layer (with indexer) of ``preset``, random weights, parameters and
    activations in ``dtype``."""
    cfg = DsaConfig.preset(preset)
    layer_idx = next(i for i in cfg.dsa_layers if cfg.has_indexer(i))
    return DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0), implementation=implementation,
                        dtype=dtype, param_dtype=dtype)


def _loss(out, g):
    return jnp.sum(out.astype(jnp.float32) * g)


def sparse_step(layer: DsaAttention):
    """``(step, params)``: ``step(params, x, g) -> (loss, grads)``, jitted, of the layer's
    own call (row ``"sparse"``)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x, g):
        out, _ = nnx.merge(graphdef, params, rest)(x)
        return _loss(out, g)

    return jax.jit(jax.value_and_grad(loss)), params


def dense_mask_step(layer: DsaAttention):
    """``(step, params)``: ``step(params, x, g, topk) -> (loss, grads)``, jitted: the
    layer's projections, masked MLA over every key with ``topk [B, S, W]`` as a dense
    mask, the output projection (row ``"dense_mask"``)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    cfg = layer.cfg

    def loss(params, x, g, topk):
        m = nnx.merge(graphdef, params, rest)
        b, s = x.shape[:2]
        _, q_lat, latent = m.project(x, m.rope(jnp.broadcast_to(jnp.arange(s), (b, s))))
        mask = pk.topk_to_mask(topk, s)
        o_lat = pk.mla_masked_attention(q_lat, latent, mask, scale=cfg.softmax_scale,
                                        value_width=cfg.kv_lora_rank)
        return _loss(m.output_projection(o_lat), g)

    return jax.jit(jax.value_and_grad(loss)), params


def indexer_loss_step(layer: DsaAttention, mode: str):
    """``(step, params, rest)``: ``step(params, rest, x) -> (loss, grads)``, jitted, of the
    layer's indexer loss in ``mode`` (``"dense"`` or ``"sparse"``, the attention's and the
    loss's) w.r.t. the indexer's parameters ``params`` (rows ``"indexer_loss_<mode>"``)."""
    graphdef, params, rest = nnx.split(layer, INDEXER_PARAMS, ...)

    def loss(params, rest, x):
        _, _, value = nnx.merge(graphdef, params, rest)(x, attention=mode, indexer_loss=mode)
        return value

    return jax.jit(jax.value_and_grad(loss)), params, rest


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return dict(temp_bytes=-1, argument_bytes=-1, output_bytes=-1)
    return dict(temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes),
                output_bytes=int(m.output_size_in_bytes))


def _median_ms(fn, args, iters: int) -> float:
    """Median milliseconds of ``fn(*args)`` over ``iters`` calls after one warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(preset: str, tokens: list[int], batches: list[int], iters: int, implementation: str = "xla",
        log=print, max_bytes: int | None = None, dtype: str = "bfloat16") -> dict:
    """The benchmark's rows (see the module doc): per batch size and token count, ``sparse``,
    ``dense_mask``, ``indexer_loss_dense`` then ``indexer_loss_sparse`` (``ROWS``), each ``dict(impl, batch, tokens, temp_bytes, temp_bytes_per_token,
    argument_bytes, output_bytes, compile_s, median_ms, note)``. ``max_bytes``: the most a
    timed step may need (None: ``default_max_bytes()``)."""
    cfg = DsaConfig.preset(preset)
    check_tokens(cfg, tokens)
    if max_bytes is None:
        max_bytes = default_max_bytes()
    layer = train_layer(preset, implementation, jnp.dtype(dtype))
    sparse, params = sparse_step(layer)
    dense, _ = dense_mask_step(layer)
    losses = {mode: indexer_loss_step(layer, mode) for mode in ("dense", "sparse")}
    rows = []
    for b in batches:
        for s in tokens:
            kx, kg = jax.random.split(jax.random.key(s * 1009 + b))
            x = jax.random.normal(kx, (b, s, cfg.hidden_size), jnp.float32).astype(layer.dtype)
            g = jax.random.normal(kg, (b, s, cfg.hidden_size), jnp.float32)
            topk = jax.ShapeDtypeStruct((b, s, cfg.out_width), jnp.int32)
            steps = [("sparse", sparse, (params, x, g)), ("dense_mask", dense, (params, x, g, topk))]
            steps += [(f"indexer_loss_{mode}", fn, (iparams, rest, x))
                      for mode, (fn, iparams, rest) in losses.items()]
            for impl, fn, args in steps:
                t0 = time.perf_counter()
                compiled = fn.lower(*args).compile()
                row = dict(impl=impl, batch=b, tokens=s, **_memory(compiled),
                           compile_s=round(time.perf_counter() - t0, 2), median_ms=None, note="")
                row["temp_bytes_per_token"] = row["temp_bytes"] / (b * s)
                need = row["temp_bytes"] + row["argument_bytes"] + row["output_bytes"]
                if need > max_bytes:
                    row["note"] = f"not run: needs {need / 2**30:.2f} GiB > {max_bytes / 2**30:.2f} GiB"
                else:
                    if impl == "dense_mask":  # the sparse call's selection, computed once
                        _, topk = layer(x)
                        args = (params, x, g, topk)
                    row["median_ms"] = _median_ms(compiled, args, iters)
                    del args
                rows.append(row)
                ms = "-" if row["median_ms"] is None else f"{row['median_ms']:.1f} ms"
                log(f"{impl:<19} B={b:<2} S={s:<7} temp {row['temp_bytes'] / 2**20:10.1f} MiB "
                    f"({row['temp_bytes_per_token'] / 1024:8.1f} KiB/token)  {ms:>12}  {row['note']}")
    return {"rows": rows, "measures": ROWS, "preset": preset, "implementation": implementation,
            "dtype": jnp.dtype(layer.dtype).name, "max_bytes": int(max_bytes),
            "device": str(jax.devices()[0].platform)}
