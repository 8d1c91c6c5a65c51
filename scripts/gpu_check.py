#!/usr/bin/env python
"""Compile, check and time every kernel of the DSA pipeline at the real GLM-5.3-Flash shapes.

One command for a lent GPU (an H100/H200 with ``jax[cuda12]`` or ``jax[cuda13]``, jax 0.10
or 0.11)::

    python scripts/gpu_check.py            # table on stdout, progress on stderr
    python scripts/gpu_check.py --json     # the same rows as one JSON object on stdout
    python scripts/gpu_check.py --smoke    # tiny shapes, implementation="pallas_interpret"
                                           # (runs on a CPU; what the tests run)
    python scripts/gpu_check.py --all --out DIR  # every part (kernels, layer, training,
                                           # the Mosaic top-k probe) in ~6 minutes: JSON
                                           # and summary.md in DIR (scripts/gpu_check_all.py)
    python scripts/gpu_check.py --train --json   # the backward kernels and a layer's
                                           # training step at 4K / 16K tokens instead
                                           # (scripts/gpu_check_train.py: its doc, its flags)

Shapes: 64 heads, kv_lora_rank 512, indexer 32 heads x 128, index_topk 2048, index_kpool 4
(out_width 2051), decode (Q = 1) at batch 1 and 8 over contexts of 8K and 128K tokens, batch
1 at 1M tokens, and a Q = 64 prefill tile at 128K. Every batch row holds a slightly
different number of valid tokens (``L - 5*b``), so masks and tails are exercised.

Each pipeline step runs on the reference outputs of the step before it, so a wrong or
missing kernel never hides another one. Per step, per case, rows for:

* ``xla``: the plain-jnp reference (``implementation="xla"``), the output checked against;
* ``pallas``: the Pallas Triton kernel, with its check against ``xla`` (``ok (max err ..)``,
  ``MISMATCH ..``, ``not implemented`` when it still raises NotImplementedError, or
  ``error: ..``);
* ``mosaic``: the step's Mosaic GPU kernel (``implementation="mosaic"``; the smoke run
  ``"mosaic_interpret"``), checked against ``xla`` like ``pallas``, for every step whose
  wrapper has one (found by lowering it for CUDA: a ``mosaic_gpu`` custom call; a step
  without one would run its Triton kernel again and gets no row). jax >= 0.11 only (on
  0.10 one log line says so); ``--no-mosaic`` leaves the rows out. ``topk_pools`` also gets
  ``mosaic n_live``, ``index_scores_paged`` a ``mosaic`` row and ``sparse_mla`` ``mosaic
  shared latent``. The smoke run's geometry is float32, which the Mosaic scoring and
  attention kernels do not take (the wrappers run it on Triton): their rows run on bf16
  copies of the 16-bit operands, checked against the reference on the same copies, and
  say ``(bf16 operands)``;
* ``lax.top_k``: next to ``topk_pools``, a speed baseline only (its tie rule differs);
* ``index_scores_paged`` (kernel row) / ``topk_pools`` ``pallas n_live`` / ``sparse_mla``
  ``pallas shared latent``: the paged cache's kernels on the same data laid out in pages of
  ``--page-size`` tokens (64; the smoke run 32: 8 pools a page, the whole 8-row tiles the
  Mosaic paged scorer copies) through a random block table, checked
  against the contiguous results: the scores through the block table, the top-k bounded by
  each query's visible pools, attention over the flat latent pool ``[1, B * L, C]``;
* ``sparse_mla`` ``pallas rope``: the RoPE models' rows ``[c, k_rot]`` (``C + R`` wide, R =
  64; the smoke run 8) with ``value_width = C``, checked against the reference on them;
* ``pallas one-program`` / ``pallas split_p=N``: ``topk_pools`` on the path its defaults
  do not take for that row length (checked too): the one-program path where the
  multi-program one is the default (128K and 1M tokens), the multi-program one in
  quarter-row segments where it is not (8K tokens; the smoke run's short rows);
* a short block-size sweep of ``sparse_mla`` at the end, while time is left.

Two times a row. ``call``: the median over ``--reps`` runs of ``--inner`` back-to-back
dispatched calls, after a warm-up call (host dispatch included: what a call from Python
pays). ``in loop``: the median over ``--reps`` runs of ``--inner`` calls inside one jitted
program, unrolled (``in_loop``; ``loop_time``: the difference of programs of ``2 x
--inner`` and ``--inner`` calls, so a program's fixed costs cancel), the kernel's device
time with the launch gaps between kernels; a trivial body's is reported as
``loop_overhead_us`` (on by default on a GPU, ``--loop`` / ``--no-loop`` to choose). GB/s
is the bytes the step must move at least (gathered latent rows counted once per query
row), divided by the in-loop time where there is one; TF/s counts the matmul FLOPs. ``bound`` is the roofline time of the
kernel at that case (``glm5_dsa_jax.tools.roofline.kernel_bounds``: its bytes and FLOPs from the
kernels' tiling, at the GPU's datasheet bandwidth and bf16 peak; the GPU found by device
kind, or ``--roofline-gpu``) and ``x bound`` the in-loop time (else the call time) over it. ``kpool_compress``
has none: here it pools the whole context, in a layer step only a window. ``--budget`` seconds (default 180) caps
the whole run: cases left when it is spent are reported as skipped.

Exit status: 0 when no check failed (``not implemented`` and skipped rows are not
failures), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import MOSAIC_MIN_JAX, jax_version, lower_for_cuda  # noqa: E402
from glm5_dsa_jax.tools import roofline  # noqa: E402
from glm5_dsa_jax.tools.timing import IN_LOOP_MIN_JAX, in_loop, loop_time  # noqa: E402,F401
from glm5_dsa_jax.model.config import DsaConfig  # noqa: E402
from pallas_kernels.selection import topk_pools_lax_baseline  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Geometry:
    heads: int = 64
    latent: int = 512  # kv_lora_rank
    rope: int = 64  # qk_rope_head_dim of the RoPE models (GLM-5, DeepSeek-V3.2): the "rope" row
    index_heads: int = 32
    index_dim: int = 128
    topk: int = 2048
    kpool: int = 4
    qk_head_dim: int = 256  # softmax scale qk_head_dim**-0.5
    dtype: str = "bfloat16"

    @property
    def out_width(self) -> int:
        return self.topk + self.kpool - 1

    @property
    def scale(self) -> float:
        return self.qk_head_dim**-0.5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    length: int
    batch: int
    nq: int
    kernels: tuple[str, ...] = ("kpool_compress", "index_scores", "topk_pools",
                                "expand_selection", "sparse_mla")
    sweep: bool = False  # run the sparse_mla block sweep on this case (after the table)


KERNELS = ("kpool_compress", "index_scores", "topk_pools", "expand_selection", "sparse_mla")

REAL_CASES = [
    Case("decode", 131072, 1, 1, sweep=True),
    Case("decode", 131072, 8, 1, sweep=True),
    Case("decode", 8192, 1, 1),
    Case("decode", 8192, 8, 1),
    # 1M tokens: batch 1 only (every step is cheap there; batch 8 would add 8 GiB of latent
    # and minutes of compile-and-fill time for little information).
    Case("decode", 1048576, 1, 1),
    # kpool_compress does not depend on Q: its prefill row would repeat the decode one.
    Case("prefill", 131072, 1, 64, kernels=KERNELS[1:], sweep=True),
]
SMOKE_CASES = [
    Case("decode", 50, 2, 1, sweep=True),
    Case("prefill", 37, 1, 3, kernels=KERNELS[1:]),
]

# sparse_mla block sizes tried after the main table (the first is the default).
REAL_SWEEP = [
    dict(block_h=16, block_w=32, num_warps=4, num_stages=2),
    dict(block_h=16, block_w=64, num_warps=4, num_stages=2),
    dict(block_h=16, block_w=32, num_warps=4, num_stages=3),
    dict(block_h=16, block_w=16, num_warps=4, num_stages=2),
    dict(block_h=32, block_w=32, num_warps=8, num_stages=2),
    dict(block_h=64, block_w=32, num_warps=8, num_stages=2),
    dict(block_h=64, block_w=16, num_warps=8, num_stages=2),
    dict(block_h=16, block_w=32, num_warps=4, num_stages=2, num_splits=1),
]
SMOKE_SWEEP = [dict(block_h=16, block_w=16, num_splits=2)]


# ------------------------------------------------------------------------------ helpers
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _nbytes(*arrays) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in arrays))


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def _is_not_implemented(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, NotImplementedError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _timed(fn, args, reps: int, inner: int):
    """Compile + warm up, then the median per-call time of ``reps`` x ``inner`` calls."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / inner)
    return out, compile_s, statistics.median(times)


def _compare_close(got, want, rtol, atol) -> tuple[bool, str]:
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    if got.shape != want.shape:
        return False, f"MISMATCH shape {got.shape} != {want.shape}"
    same_inf = np.array_equal(np.isneginf(got), np.isneginf(want)) and np.array_equal(
        np.isnan(got), np.isnan(want))
    fin = np.isfinite(want) & np.isfinite(got)
    err = float(np.max(np.abs(got[fin] - want[fin]), initial=0.0))
    bad = ~np.isclose(got[fin], want[fin], rtol=rtol, atol=atol)
    if not same_inf:
        return False, f"MISMATCH -inf/NaN positions differ (max err {err:.2e})"
    if bad.any():
        return False, (f"MISMATCH {int(bad.sum())} of {bad.size} beyond rtol={rtol} "
                       f"atol={atol} (max err {err:.2e})")
    return True, f"ok (max err {err:.1e})"


def _compare_equal(got, want) -> tuple[bool, str]:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False, f"MISMATCH shape {got.shape} != {want.shape}"
    n = int(np.sum(got != want))
    return (n == 0), ("ok (exact)" if n == 0 else f"MISMATCH {n} of {got.size} elements differ")


def _compare_tuple(got, want, checks) -> tuple[bool, str]:
    msgs, ok = [], True
    for g, w, check in zip(got, want, checks):
        o, m = check(g, w)
        ok &= o
        msgs.append(m)
    return ok, msgs[0] if ok else "; ".join(m for m in msgs if not m.startswith("ok"))


def _topk_other_path(n_pools: int):
    """(label, block sizes) that run ``topk_pools`` on the path its defaults do not take
    for rows of ``n_pools``: the one-program path for long rows (the multi-program path
    is the default there, e.g. 262,144 pools at 1M tokens), the multi-program path in
    segments of a quarter row for short ones; None when the row is too short to split."""
    defaults = pk.TopkPoolsBlockSizes()
    min_segments = defaults.MIN_SEGMENTS
    if defaults.multi_program(n_pools):
        split_p = 1 << max(n_pools - 1, 1).bit_length()  # one segment: one program per row
        return "one-program", pk.TopkPoolsBlockSizes(split_p=split_p)
    split_p = 1 << max((n_pools // min_segments).bit_length() - 1, 0)
    if split_p < 2:
        return None
    block_p = min(defaults.resolve(n_pools).block_p, split_p)
    return f"split_p={split_p}", pk.TopkPoolsBlockSizes(split_p=split_p, block_p=block_p)


# ------------------------------------------------------------------------------ inputs
def _make_inputs(geom: Geometry, case: Case, seed: int = 0) -> dict:
    b, length, nq = case.batch, case.length, case.nq
    dt = jnp.dtype(geom.dtype)
    ks = jax.random.split(jax.random.key(seed), 8)
    lens = jnp.maximum(length - 5 * jnp.arange(b, dtype=jnp.int32), 1)
    inp = dict(
        keys=jax.random.normal(ks[0], (b, length, geom.index_dim), dt),
        gate=jax.random.normal(ks[1], (b, length, geom.index_dim), jnp.float32),
        key_valid=jnp.arange(length, dtype=jnp.int32)[None, :] < lens[:, None],
        ape=0.5 * jax.random.normal(ks[2], (geom.kpool, geom.index_dim), jnp.float32),
        q_idx=jax.random.normal(ks[3], (b, nq, geom.index_heads, geom.index_dim), dt),
        w=jax.random.normal(ks[4], (b, nq, geom.index_heads), jnp.float32) * geom.index_heads**-0.5,
        q_lat=jax.random.normal(ks[5], (b, nq, geom.heads, geom.latent), dt),
        latent=jax.random.normal(ks[6], (b, length, geom.latent), dt),
        # the last nq valid tokens of each row are the queries
        q_pos=(lens[:, None] - nq + jnp.arange(nq, dtype=jnp.int32)[None, :]).astype(jnp.int32),
    )
    return jax.block_until_ready(inp)


# ------------------------------------------------------------------------------ the run
class Runner:
    def __init__(self, args, geom: Geometry):
        self.args = args
        self.geom = geom
        self.pallas_impl = args.impl or ("pallas_interpret" if args.smoke else "pallas")
        # The Mosaic GPU rows (see the module doc): none on jax < 0.11 or with --no-mosaic.
        self.mosaic_impl = None
        if not args.no_mosaic and jax_version() >= MOSAIC_MIN_JAX:
            self.mosaic_impl = "mosaic_interpret" if self.pallas_impl == "pallas_interpret" else "mosaic"
        self._has_mosaic: dict[str, bool] = {}
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.failed = False
        # The config whose dims the geometry has (the roofline reads its kernels' tiling).
        self.roofline_cfg = DsaConfig.tiny() if args.smoke else DsaConfig.glm53_flash()

    def bound_us(self, case: Case, kernel: str, impl: str = ""):
        """The roofline time of ``kernel`` at this case, in microseconds (None if unmodelled;
        the sweep's rows run other block sizes than the model's defaults)."""
        if kernel == "kpool_compress" or impl.startswith("pallas[") or self.roofline_cfg is None:
            return None
        rows = roofline.kernel_bounds(self.roofline_cfg, self.args.roofline_gpu, case.length,
                                      case.batch, case.nq,
                                      elem_bytes=jnp.dtype(self.geom.dtype).itemsize)
        row = rows.get(kernel)
        return None if row is None else row.bound_s * 1e6

    def out_of_time(self) -> bool:
        return time.monotonic() - self.t0 > self.args.budget

    def add(self, case: Case, kernel: str, impl: str, **fields):
        row = dict(case=case.name, context=case.length, batch=case.batch, q=case.nq,
                   kernel=kernel, impl=impl, time_us=None, loop_us=None, gbps=None, tflops=None,
                   compile_s=None, check="", bound_us=self.bound_us(case, kernel, impl))
        row.update(fields)
        self.rows.append(row)
        _log(f"  {kernel:<16} {impl:<28} {_fmt(row['time_us'], '{:.1f} us'):>12} "
             f"{_fmt(row['loop_us'], '{:.1f} us'):>12}  {row['check']}")
        return row

    def measure(self, case, kernel, impl, fn, args, *, nbytes, flops=0, want=None,
                compare=None, extra=None):
        """Run one implementation; returns its output (None when it did not run)."""
        if self.out_of_time():
            self.add(case, kernel, impl, check="skipped (time budget)")
            return None
        try:
            out, compile_s, t = _timed(jax.jit(fn), args, self.args.reps, self.args.inner)
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            if _is_not_implemented(e):
                self.add(case, kernel, impl, check=f"not implemented ({_first_line(e)})")
            else:
                self.failed = True
                if self.args.verbose:
                    traceback.print_exc(file=sys.stderr)
                self.add(case, kernel, impl, check=f"error: {_first_line(e)}")
            return None
        check = "reference" if impl == "xla" else ""
        if compare is not None and want is not None:
            try:
                ok, check = compare(out, want)
            except Exception as e:  # noqa: BLE001
                ok, check = False, f"error in check: {_first_line(e)}"
            self.failed |= not ok
        elif extra is not None:
            check = extra
        loop_s = None
        if self.args.loop and not self.out_of_time():
            try:
                loop_s = loop_time(fn, args, self.args.inner, self.args.reps)
            except Exception as e:  # noqa: BLE001 - the dispatched time still stands
                _log(f"  {kernel} {impl}: in-loop timing failed: {_first_line(e)}")
        t_dev = loop_s or t  # rates from the device time where measured
        self.add(case, kernel, impl, time_us=t * 1e6, compile_s=round(compile_s, 2),
                 loop_us=None if loop_s is None else loop_s * 1e6,
                 gbps=nbytes / t_dev / 1e9 if nbytes else None,
                 tflops=flops / t_dev / 1e12 if flops else None, check=check)
        return out

    # One pipeline step: the reference, then the kernel checked against it.
    def step(self, case, kernel, make_fn, args, *, nbytes, flops=0, compare, timed=True,
             cast=()):
        ref_fn = make_fn("xla")
        if timed:
            want = self.measure(case, kernel, "xla", ref_fn, args, nbytes=nbytes, flops=flops)
        else:
            want = None
        if want is None:  # not timed, out of time, or the reference failed: still needed
            try:
                want = jax.block_until_ready(jax.jit(ref_fn)(*args))
            except Exception as e:  # noqa: BLE001
                self.failed = True
                _log(f"  {kernel}: reference failed: {_first_line(e)}")
                return None
        if timed:
            self.measure(case, kernel, "pallas", make_fn(self.pallas_impl), args, nbytes=nbytes,
                         flops=flops, want=want, compare=compare)
            self.mosaic_row(case, kernel, "mosaic", make_fn, args, cast=cast, want=want,
                            nbytes=nbytes, flops=flops, compare=compare)
        return want

    def mosaic_args(self, args, cast=()):
        """The operands of a Mosaic row: ``args``, with those at the positions ``cast`` made
        bfloat16 when the geometry is float32 (the smoke run). The Mosaic scoring and
        attention kernels take 16-bit operands only (wgmma's float32 is TF32: the wrappers
        run float32 on the Triton kernel), so the smoke run checks them on bf16 copies
        against the reference on the same copies; the real run is bf16 already."""
        if jnp.dtype(self.geom.dtype) != jnp.float32 or not cast:
            return args
        return tuple(a.astype(jnp.bfloat16) if i in cast else a for i, a in enumerate(args))

    def mosaic_row(self, case, kernel, label, make_fn, args, *, cast=(), want, nbytes, flops,
                   compare):
        """A Mosaic row (``label``) of ``kernel`` on ``mosaic_args(args, cast)``, checked
        against ``want`` (the reference on ``args``), or against the reference rerun on the
        bf16 copies when the operands were cast."""
        if not self.has_mosaic(kernel, make_fn, self.mosaic_args(args, cast)):
            return
        margs = self.mosaic_args(args, cast)
        if margs is not args:
            want = jax.block_until_ready(jax.jit(make_fn("xla"))(*margs))
            label += " (bf16 operands)"
        self.measure(case, kernel, label, make_fn(self.mosaic_impl), margs, nbytes=nbytes,
                     flops=flops, want=want, compare=compare)

    def has_mosaic(self, kernel, make_fn, args) -> bool:
        """Whether ``kernel``'s wrapper runs a Mosaic GPU kernel for ``"mosaic"``: its CUDA
        lowering holds a ``mosaic_gpu`` custom call (decided once per kernel)."""
        if self.mosaic_impl is None:
            return False
        if kernel not in self._has_mosaic:
            try:
                avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
                text = lower_for_cuda(make_fn("mosaic"), *avals).as_text()
                self._has_mosaic[kernel] = "mosaic_gpu" in text
            except Exception as e:  # noqa: BLE001 - reported as the kernel's row
                _log(f"  {kernel}: lowering implementation='mosaic' failed: {_first_line(e)}")
                self._has_mosaic[kernel] = True  # measure() reports the error as a row
        return self._has_mosaic[kernel]

    def run_case(self, case: Case):
        g = self.geom
        _log(f"{case.name}: context {case.length}, batch {case.batch}, Q {case.nq}")
        if self.out_of_time():
            for k in case.kernels:
                self.add(case, k, "-", check="skipped (time budget)")
            return None
        inp = _make_inputs(g, case)
        b, nq, length = case.batch, case.nq, case.length
        kp = g.kpool
        run = set(case.kernels)
        close_bf16 = lambda x, y: _compare_close(x, y, rtol=2e-2, atol=2e-2)  # noqa: E731

        # 1. kpool_compress
        args = (inp["keys"], inp["gate"], inp["key_valid"], inp["ape"])
        n_pools = pk.num_pools(length, kp)
        nbytes = _nbytes(*args) + n_pools * b * g.index_dim * inp["keys"].dtype.itemsize
        res = self.step(
            case, "kpool_compress",
            lambda impl: (lambda k, gt, v, a: pk.kpool_compress(k, gt, v, a, implementation=impl)),
            args, nbytes=nbytes, timed="kpool_compress" in run,
            compare=lambda x, y: _compare_tuple(x, y, (close_bf16, _compare_equal, _compare_equal)),
        )
        if res is None:
            return None
        pooled, first_key, pool_valid = res

        # 2. index_scores
        args = (inp["q_idx"], inp["w"], pooled, pool_valid, first_key, inp["q_pos"])
        nbytes = _nbytes(*args) + b * nq * n_pools * 4
        flops = 2 * b * nq * g.index_heads * n_pools * g.index_dim
        scores = self.step(
            case, "index_scores",
            lambda impl: (lambda *a: pk.index_scores(*a, kpool=kp, implementation=impl)),
            args, nbytes=nbytes, flops=flops, timed="index_scores" in run, cast=(0, 2),
            compare=lambda x, y: _compare_close(x, y, rtol=1e-3, atol=1e-3),
        )
        if scores is None:
            return None
        if "index_scores" in run:
            self.paged_scores_row(case, inp, pooled, pool_valid, scores, nbytes, flops)

        # 3. topk_pools (+ lax.top_k as a speed baseline)
        select_k = min(g.topk // kp, n_pools)
        nbytes = _nbytes(scores) + b * nq * select_k * 4
        pools = self.step(
            case, "topk_pools",
            lambda impl: (lambda s: pk.topk_pools(s, select_k, implementation=impl)),
            (scores,), nbytes=nbytes, timed="topk_pools" in run, compare=_compare_equal,
        )
        if pools is None:
            return None
        if "topk_pools" in run:
            self.measure(case, "topk_pools", "lax.top_k (baseline)",
                         lambda s: topk_pools_lax_baseline(s, select_k), (scores,), nbytes=nbytes,
                         extra="speed baseline only (other tie rule)")
            # The other topk_pools path, checked too: the row above took the default one.
            other = _topk_other_path(scores.shape[-1])
            if other is not None:
                label, blocks = other
                self.measure(case, "topk_pools", f"pallas {label}",
                             lambda s: pk.topk_pools(s, select_k, implementation=self.pallas_impl,
                                                     block_sizes=blocks),
                             (scores,), nbytes=nbytes, want=pools, compare=_compare_equal)
            # Bounded by each query's visible pools (what the paged step passes): the same ids.
            n_live = ((inp["q_pos"] + 1) // kp).astype(jnp.int32)
            self.measure(case, "topk_pools", "pallas n_live",
                         lambda s, n: pk.topk_pools(s, select_k, implementation=self.pallas_impl,
                                                    n_live=n),
                         (scores, n_live), nbytes=nbytes, want=pools, compare=_compare_equal)
            if self.mosaic_impl is not None:
                self.measure(case, "topk_pools", "mosaic n_live",
                             lambda s, n: pk.topk_pools(s, select_k, implementation=self.mosaic_impl,
                                                        n_live=n),
                             (scores, n_live), nbytes=nbytes, want=pools, compare=_compare_equal)

        # 4. expand_selection (tail = the incomplete visible pool)
        n_vis = jnp.maximum(inp["q_pos"] + 1 - first_key[:, None], 0).astype(jnp.int32)
        tail = pk.visible_tail(first_key, n_vis, inp["q_pos"], inp["key_valid"], kp)
        args = (pools, first_key, tail)
        nbytes = _nbytes(*args) + b * nq * g.out_width * 4
        ids = self.step(
            case, "expand_selection",
            lambda impl: (lambda p, f, t: pk.expand_selection(
                p, f, t, kpool=kp, out_width=g.out_width, implementation=impl)),
            args, nbytes=nbytes, timed="expand_selection" in run, compare=_compare_equal,
        )
        if ids is None:
            return None

        # 5. sparse_mla
        if "sparse_mla" in run:
            self.sparse_mla_rows(case, inp, ids)
        return inp, ids

    def paged_scores_row(self, case, inp, pooled, pool_valid, scores, nbytes, flops):
        """``index_scores_paged`` on ``pooled`` laid out in pages through a random block
        table (pages of every row interleaved in one pool), checked against ``scores``."""
        b, n_pools, d = pooled.shape
        ppp = self.args.page_size // self.geom.kpool
        pg = -(-n_pools // ppp)
        pad = jnp.pad(pooled, ((0, 0), (0, pg * ppp - n_pools), (0, 0)))
        perm = np.random.default_rng(0).permutation(b * pg)
        table = jnp.asarray(perm.reshape(b, pg), jnp.int32)
        pages = jnp.zeros((b * pg, ppp, d), pooled.dtype).at[table.reshape(-1)].set(
            pad.reshape(b * pg, ppp, d))
        counts = jnp.sum(pool_valid, axis=1, dtype=jnp.int32)  # valid pools are a prefix here
        args = (inp["q_idx"], inp["w"], pages, table, counts, inp["q_pos"])
        kp = self.geom.kpool
        make = lambda impl: (  # noqa: E731
            lambda *a: pk.index_scores_paged(*a, kpool=kp, implementation=impl)[..., :n_pools])
        close = lambda x, y: _compare_close(x, y, rtol=1e-3, atol=1e-3)  # noqa: E731
        self.measure(case, "index_scores_paged", "pallas", make(self.pallas_impl), args,
                     nbytes=nbytes, flops=flops, want=scores, compare=close)
        if self.mosaic_impl is not None:
            self.mosaic_row(case, "index_scores_paged", "mosaic", make, args, cast=(0, 2),
                            want=scores, nbytes=nbytes, flops=flops, compare=close)

    def _mla_cost(self, inp, ids):
        n_valid = int(jnp.sum(ids >= 0))
        itemsize = inp["latent"].dtype.itemsize
        nbytes = (n_valid * self.geom.latent * itemsize + _nbytes(ids)
                  + 2 * _nbytes(inp["q_lat"]))
        flops = 4 * n_valid * self.geom.heads * self.geom.latent
        return nbytes, flops

    def sparse_mla_rows(self, case, inp, ids, sweep=None):
        g = self.geom
        nbytes, flops = self._mla_cost(inp, ids)
        args = (inp["q_lat"], inp["latent"], ids)
        close = lambda x, y: _compare_close(x, y, rtol=2e-2, atol=2e-2)  # noqa: E731
        make = lambda impl, **bs: (  # noqa: E731  (block sizes: the sweep's Triton ones)
            lambda q, lat, i: pk.sparse_mla(q, lat, i, scale=g.scale, implementation=impl,
                                            block_sizes=pk.SparseMlaBlockSizes(**bs) if bs else None))
        if sweep is None:
            want = self.step(case, "sparse_mla", make, args, nbytes=nbytes, flops=flops,
                             compare=close, cast=(0, 1))
            # The same rows read from one flat pool shared by every batch row (the paged
            # cache's latent): ids become slots b * L + id.
            b, length, c = inp["latent"].shape
            slots = jnp.where(ids >= 0, ids + length * jnp.arange(b, dtype=ids.dtype)[:, None, None],
                              -1)
            shared = (inp["q_lat"], inp["latent"].reshape(1, b * length, c), slots)
            self.measure(case, "sparse_mla", "pallas shared latent", make(self.pallas_impl),
                         shared, nbytes=nbytes, flops=flops, want=want, compare=close)
            if self.mosaic_impl is not None:
                self.mosaic_row(case, "sparse_mla", "mosaic shared latent", make, shared,
                                cast=(0, 1), want=want, nbytes=nbytes, flops=flops, compare=close)
            self.rope_row(case, ids, nbytes, flops, close)
            return
        want = jax.block_until_ready(jax.jit(make("xla"))(*args))
        for bs in sweep:
            label = "pallas[" + ",".join(f"{k}={v}" for k, v in bs.items()) + "]"
            self.measure(case, "sparse_mla", label, make(self.pallas_impl, **bs), args,
                         nbytes=nbytes, flops=flops, want=want, compare=close)


    def rope_row(self, case, ids, nbytes, flops, close):
        """``sparse_mla`` over RoPE rows ``[c, k_rot]`` (``latent + rope`` wide) with
        ``value_width = latent``, checked against the reference on the same rows."""
        g = self.geom
        b, nq, width = ids.shape
        ks = jax.random.split(jax.random.key(1), 2)
        dt = jnp.dtype(g.dtype)
        q = jax.random.normal(ks[0], (b, nq, g.heads, g.latent + g.rope), dt)
        lat = jax.random.normal(ks[1], (b, case.length, g.latent + g.rope), dt)
        make = lambda impl: (  # noqa: E731
            lambda q, lat, i: pk.sparse_mla(q, lat, i, scale=g.scale, value_width=g.latent,
                                            implementation=impl))
        want = jax.block_until_ready(jax.jit(make("xla"))(q, lat, ids))
        self.measure(case, "sparse_mla", "pallas rope", make(self.pallas_impl), (q, lat, ids),
                     nbytes=nbytes * (g.latent + g.rope) // g.latent, flops=flops, want=want,
                     compare=close)


def _fmt(v, spec):
    return "-" if v is None else spec.format(v)


def _table(rows) -> str:
    head = ["case", "context", "B", "Q", "kernel", "impl", "call", "in loop", "bound", "x bound",
            "GB/s", "TF/s", "compile", "check"]
    lines = [head]
    for r in rows:
        lines.append([
            r["case"], str(r["context"]), str(r["batch"]), str(r["q"]), r["kernel"], r["impl"],
            _fmt(r["time_us"], "{:.1f} us"), _fmt(r.get("loop_us"), "{:.1f} us"),
            _fmt(r.get("bound_us"), "{:.3g} us"),
            _fmt((r.get("loop_us") or r["time_us"]) / r["bound_us"]
                 if r["time_us"] and r.get("bound_us") else None, "{:.1f}"),
            _fmt(r["gbps"], "{:.0f}"),
            _fmt(r["tflops"], "{:.1f}"), _fmt(r["compile_s"], "{:.1f} s"), r["check"],
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    out = []
    for line in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1])
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--all" in argv:  # every part, each in its own process: another script, its own flags
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_check_all
        return gpu_check_all.main([a for a in argv if a != "--all"])
    if "--train" in argv:  # the training rows: another script, its own flags
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_check_train
        return gpu_check_train.main([a for a in argv if a != "--train"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--all", action="store_true",
                    help="every part (probe, kernels, layer, train), each in its own process, "
                         "with --out DIR (scripts/gpu_check_all.py: its doc, its flags)")
    ap.add_argument("--train", action="store_true",
                    help="time and check the backward kernels and a layer's training step instead "
                         "(scripts/gpu_check_train.py, with the flags that follow)")
    ap.add_argument("--smoke", action="store_true",
                    help='tiny shapes with implementation="pallas_interpret" (any device)')
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default 180; 120 with --smoke)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per row (median)")
    ap.add_argument("--inner", type=int, default=None, help="back-to-back calls per timed run")
    ap.add_argument("--no-sweep", action="store_true", help="skip the sparse_mla block sweep")
    ap.add_argument("--loop", action=argparse.BooleanOptionalAction, default=None,
                    help="also time --inner calls inside one jitted loop, the device time (the "
                         "'in loop' column; default: on, off with --smoke)")
    ap.add_argument("--contexts", default=None,
                    help="comma-separated context lengths: only the cases at these lengths")
    ap.add_argument("--impl", choices=("pallas", "pallas_interpret"), default=None,
                    help="kernel implementation (default: pallas; pallas_interpret with --smoke)")
    ap.add_argument("--page-size", type=int, default=None,
                    help="tokens a page for the paged rows (default 64; 32 with --smoke); a "
                         "multiple of the kpool width")
    ap.add_argument("--no-mosaic", action="store_true",
                    help="leave out the Mosaic GPU rows (implementation='mosaic')")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    ap.add_argument("--roofline-gpu", choices=sorted(roofline.GPUS), default=None,
                    help="GPU whose datasheet numbers the bound column uses (default: found "
                         "from the device kind, else h100)")
    args = ap.parse_args(argv)
    if args.budget is None:
        args.budget = 120.0 if args.smoke else 180.0
    if args.loop is None:
        args.loop = not args.smoke
    if args.loop and jax_version() < IN_LOOP_MIN_JAX:
        _log(f"no in-loop column: jax {jax.__version__}'s XLA merges the calls (see in_loop)")
        args.loop = False
    if args.reps is None:
        args.reps = 1 if args.smoke else 5
    if args.inner is None:
        args.inner = 1 if args.smoke else 10
    if args.page_size is None:
        args.page_size = 32 if args.smoke else 64  # smoke: 8 pools a page (see the doc)

    if args.smoke:
        geom = Geometry(heads=4, latent=40, rope=8, index_heads=3, index_dim=16, topk=16,
                        kpool=4, qk_head_dim=20, dtype="float32")
        cases, sweep = SMOKE_CASES, SMOKE_SWEEP
    else:
        geom, cases, sweep = Geometry(), REAL_CASES, REAL_SWEEP
    if args.page_size < geom.kpool or args.page_size % geom.kpool:
        ap.error(f"--page-size must be a positive multiple of the kpool width {geom.kpool}, "
                 f"got {args.page_size}")

    if args.contexts:
        wanted = {int(x) for x in args.contexts.split(",") if x.strip()}
        cases = [c for c in cases if c.length in wanted]

    dev = jax.devices()[0]
    if args.roofline_gpu is None:
        args.roofline_gpu = roofline.gpu_for_device_kind(getattr(dev, "device_kind", "")) or "h100"
    meta = dict(jax=jax.__version__, backend=jax.default_backend(),
                device=getattr(dev, "device_kind", str(dev)), smoke=args.smoke,
                geometry=dataclasses.asdict(geom), reps=args.reps, inner=args.inner,
                budget_s=args.budget, roofline_gpu=args.roofline_gpu)
    _log(f"jax {meta['jax']} on {meta['backend']} ({meta['device']}), budget {args.budget:.0f} s")
    if not args.smoke and meta["backend"] != "gpu":
        _log("warning: no GPU backend; implementation='pallas' will not run here (use --smoke)")

    if args.loop:  # what an iteration of the timing loop costs by itself (module doc)
        x = jnp.ones((1024,), jnp.float32)
        meta["loop_overhead_us"] = 1e6 * loop_time(lambda v: v * 2.0, (x,), args.inner, args.reps)
        _log(f"in-loop timing: {meta['loop_overhead_us']:.1f} us a trivial iteration")
    runner = Runner(args, geom)
    if runner.mosaic_impl is None and not args.no_mosaic:
        _log(f"no Mosaic GPU rows: they need jax >= {MOSAIC_MIN_JAX}, this is jax {jax.__version__}")
    kept = []  # (case, (inputs, ids)) for the sweep, kept on the device meanwhile
    for case in cases:
        try:
            res = runner.run_case(case)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory filling the inputs
            runner.failed = True
            runner.add(case, "-", "-", check=f"error: {_first_line(e)}")
            res = None
        if res is not None and case.sweep and not args.no_sweep:
            kept.append((case, res))
    # Larger batches first: the sweep matters most where the GPU is busiest.
    kept.sort(key=lambda cr: -cr[0].batch * cr[0].nq)
    while kept and not runner.out_of_time():
        case, (inp, ids) = kept.pop(0)
        _log(f"sweep {case.name}: context {case.length}, batch {case.batch}, Q {case.nq}")
        runner.sparse_mla_rows(case, inp, ids, sweep=sweep)
    kept.clear()
    meta["elapsed_s"] = round(time.monotonic() - runner.t0, 1)
    meta["ok"] = not runner.failed
    if args.json:
        print(json.dumps(dict(meta, rows=runner.rows), indent=1, default=float))
    else:
        print(f"jax {meta['jax']}, {meta['device']}, {meta['elapsed_s']} s"
              f" (time: median of {args.reps} x {args.inner} back-to-back calls)")
        print(_table(runner.rows))
    return 0 if not runner.failed else 1


if __name__ == "__main__":
    sys.exit(main())
