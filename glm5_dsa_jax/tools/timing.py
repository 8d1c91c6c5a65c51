"""Timing on a device: a call from Python against the same work inside one program, and the
rates a floor is timed at.

Invariants:

* A call's time from Python (``bench.time_steps``) includes the host: argument flattening,
  the dispatch, the wait. The device's own time per call is measured inside one jitted
  program of ``n`` calls and of ``2 n`` calls, ``(T(2n) - T(n)) / n``, so what a program
  run pays once (its launch, the host's wait, the first copy of the arguments) cancels.
  The ratio of the two is the host's share of a call (issue 46: at most 1.3 on a GPU).
* The calls in such a program are unrolled, never a rolled ``fori_loop``: on the H200
  (2026-12-04) a rolled loop's iterations cost 15-60 us each whatever the body read, 1 MB
  or 100 MB of weights, so it timed its own control, not the calls.
* Every call in such a program is real: a pure call's arguments come out of an
  ``optimization_barrier`` chained from the previous call's (``in_loop``), and every
  output is returned, so XLA can neither merge two equal calls nor drop one; a decode
  step's calls are chained by their cache (``step_program``: call ``i + 1`` reads the
  cache call ``i`` wrote, donated, in place, as a served decode does).
* A floor is timed at what the device can do (``device_rates``): on a GPU the roofline's
  table (``roofline.GPUS``: datasheet HBM bandwidth and dense bf16 rate) when the device is
  one of it, else a measurement large enough to reach the device's rate (a copy of
  ``GPU_COPY_BYTES``, a ``GPU_MATMUL_N``-square product); on a CPU a ``jnp.sum`` over
  ``CPU_READ_BYTES`` and a ``CPU_MATMUL_N``-square product. A one-row floor below the
  table's rate would make a row read under x1: the first GPU run's ``jnp.sum`` reached
  1.9 TB/s of the H200's 4.8 and its 1,024-square product 17 of 989 TFLOP/s, and dense
  rows read x0.24-0.75 of their "floor".
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from glm5_dsa_jax.tools.roofline import GPUS, gpu_for_device_kind

__all__ = ["IN_LOOP_MIN_JAX", "in_loop", "loop_time", "step_program", "step_loop_ms",
           "DeviceRates", "device_rates", "read_bandwidth", "copy_bandwidth", "matmul_rate"]

#: The oldest jax whose XLA keeps ``in_loop``'s barriers (jax 0.10's drops them on a CPU and
#: merges the calls, so the loop would time one call): older ones get no in-loop column
#: (``pallas_kernels.jax_version``).
IN_LOOP_MIN_JAX = (0, 11)

CPU_READ_BYTES = 1 << 29  # 512 MiB: larger than any cache of the CPUs this runs on
CPU_MATMUL_N = 1024  # a 2.1-GFLOP product: large enough to reach a CPU's matmul rate, 4 MiB operands
GPU_COPY_BYTES = 1 << 32  # 4 GiB read and 4 GiB written: ~2 ms at an H200's 4.8 TB/s
GPU_MATMUL_N = 8192  # a 1.1-TFLOP product: ~1 ms at a Hopper's bf16 rate


def in_loop(fn, n: int):
    """``looped(*args)``: ``fn(*args)`` called ``n`` times in one jitted program, unrolled,
    every call's output returned: ``n`` calls with no host dispatch and no loop control
    between them. Each call's arguments come out of an ``optimization_barrier`` on the
    previous call's, so XLA cannot prove two calls equal and compute one (it does, even
    behind a barrier with a loop index); every output is returned, so no call is dead."""
    def run(*args):
        outs, a = [], args
        for _ in range(n):
            a = jax.lax.optimization_barrier(a)
            outs.append(fn(*a))
        return outs
    return jax.jit(run)


def _median_s(call, reps: int) -> float:
    """Median seconds of ``call()`` (which blocks) over ``reps`` runs, after one unmeasured."""
    call()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _best_s(call, reps: int) -> float:
    """Least seconds of ``call()`` (which blocks) over ``reps`` runs, after one unmeasured."""
    call()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def loop_time(fn, args, n: int, reps: int) -> float:
    """Seconds one call of ``fn`` costs inside ``in_loop``: ``(T(2n) - T(n)) / n`` of the
    programs of ``2n`` and ``n`` calls (medians of ``reps`` runs each, after a compiling
    run)."""
    t = {k: _median_s(lambda f=in_loop(fn, k): jax.block_until_ready(f(*args)), reps) for k in (n, 2 * n)}
    return max(t[2 * n] - t[n], 0.0) / n


def step_program(step_fn, n: int):
    """``run(params, hidden, mask, cache) -> (outs, cache)``: ``n`` decode steps of
    ``step_fn`` (``(params, hidden, mask, cache) -> (out, topk, cache)``, e.g.
    ``make_step``'s ``step.jitted(cache)``) in one jitted program, unrolled, the cache
    donated and threaded from step to step; every step's output returned."""
    def run(params, hidden, mask, cache):
        outs = []
        for _ in range(n):
            out, _, cache = step_fn(params, hidden, mask, cache)
            outs.append(out)
        return outs, cache
    return jax.jit(run, donate_argnums=3)


def step_loop_ms(step_fn, params, hidden, mask, cache, n: int = 8, reps: int = 3):
    """``(ms, cache)``: milliseconds one decode step costs inside ``step_program`` (``(T(2n)
    - T(n)) / n``, each ``T`` the least of ``reps`` runs after a compiling run: noise only
    adds to a run, and the step's device time is what is left), and the cache after it;
    ``ms`` is None where ``T(2n) <= T(n)`` (the machine's noise exceeded ``n`` steps: no
    reading, rather than a zero). Each run appends its steps' tokens: the cache must have
    room for ``3 n (reps + 1)`` more tokens (a full cache's writes are dropped, which would
    time less work)."""
    state = {"cache": cache}

    def runner(k):
        prog = step_program(step_fn, k)

        def call():
            outs, state["cache"] = prog(params, hidden, mask, state["cache"])
            jax.block_until_ready(outs)
        return call

    t = {k: _best_s(runner(k), reps) for k in (n, 2 * n)}
    ms = (t[2 * n] - t[n]) / n * 1e3
    return (ms if ms > 0 else None), state["cache"]


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """What a floor is timed at: HBM (or memory) bandwidth in bytes/s, the matmul rate in
    FLOP/s of each product dtype (``{"bfloat16": ..., "float32": ...}``), and where they
    come from (``"table:h200"``: ``roofline.GPUS``; ``"measured"``)."""

    bandwidth: float
    flops: dict
    source: str


def read_bandwidth(n_bytes: int = CPU_READ_BYTES, iters: int = 5) -> float:
    """Bytes per second a jitted ``jnp.sum`` reads from a ``n_bytes`` float32 array (the
    best of ``iters``: the floor is what the machine can do, not its noise)."""
    a = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    best = min(_median_s(lambda: f(a).block_until_ready(), 1) for _ in range(iters))
    del a
    return n_bytes / best


def copy_bandwidth(n_bytes: int = GPU_COPY_BYTES, iters: int = 5) -> float:
    """Bytes per second a jitted elementwise copy of ``n_bytes`` moves (read + written; the
    best of ``iters``): a GPU's streaming rate, which a reduction does not reach."""
    a = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda v: v + 1.0)
    best = min(_median_s(lambda: f(a).block_until_ready(), 1) for _ in range(iters))
    del a
    return 2 * n_bytes / best


def matmul_rate(dtype=jnp.float32, n: int = CPU_MATMUL_N, iters: int = 5) -> float:
    """FLOP per second of a jitted ``[n, n] @ [n, n]`` in ``dtype`` into a float32
    accumulator, as the step's products are (``2 n^3`` FLOPs; the best of ``iters``).
    Why the accumulator: XLA:CPU runs a bf16 product with a bf16 output through float32
    (~280 GFLOP/s here), one into float32 on AMX (~1,350)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    best = min(_median_s(lambda: f(a, a).block_until_ready(), 1) for _ in range(iters))
    return 2 * n ** 3 / best


def device_rates(dtypes, device=None) -> DeviceRates:
    """The rates ``dtypes``' products and the step's reads are floored at on ``device``
    (default: the first device); see the module doc."""
    dev = device or jax.devices()[0]
    names = sorted({jnp.dtype(d).name for d in dtypes})
    if dev.platform == "cpu":
        return DeviceRates(read_bandwidth(), {d: matmul_rate(d, CPU_MATMUL_N) for d in names}, "measured")
    gpu = gpu_for_device_kind(getattr(dev, "device_kind", ""))
    if gpu is None:
        return DeviceRates(copy_bandwidth(), {d: matmul_rate(d, GPU_MATMUL_N) for d in names}, "measured")
    spec = GPUS[gpu]
    # The table gives the dense bf16 rate; a float32 product's is measured (TF32 or not is
    # XLA's choice), at a size that reaches it.
    flops = {d: spec.peak_flops if d in ("bfloat16", "float16") else matmul_rate(d, GPU_MATMUL_N) for d in names}
    return DeviceRates(spec.bandwidth, flops, f"table:{gpu}")
