#!/usr/bin/env python
"""The decode step's speed on a GPU, against its floor and issue 46's targets: the ``step``
part of ``scripts/gpu_check.py --all``.

Per case (``--cases``, default batch 1 at 4,096 tokens and batch 8 at 131,072; the
GLM-5.3-Flash layer with an indexer, bf16, ``make_step``'s step on a filled contiguous
cache), one row each:

* ``per call``: the median time of one step called from Python and waited for (what
  ``bench decode`` times), the cache threaded and donated;
* ``in loop``: one step inside a program of ``n`` and ``2n`` steps (``timing.step_loop_ms``:
  unrolled, the cache threaded), the device's own time per step (none where the machine's
  noise exceeded ``n`` steps);
* ``steps(n)``: ``DsaDecoder.steps`` over ``n`` tokens, per token, where the decoder has it;
* ``kernels``: the compiled step's kernels and control ops (fusions, custom calls, copies,
  conditionals and loops, counted into the branches and bodies:
  ``tools.gpu_compile.step.launched``; the deviceless compile for an H200 counts the same);
* ``dense fit`` (batch 1 at 4,096 only): the dense step (``bench``'s: absorbed MLA over every
  cached token, no indexer) on a cache sized to the context, per call and in loop.

Each row carries its floor (``max(bytes / bandwidth, FLOPs / bf16 rate)``: the roofline's
bytes and FLOPs of the step, ``timing.device_rates``: the roofline table's H200 figures on
an H200) and its ratio, and a ``check`` against the issue's targets: in loop at most
``FLOOR_TARGET`` x its floor, per call at most ``HOST_TARGET`` x in loop, at most
``KERNEL_TARGET`` kernels and control ops, sparse no slower than dense fit. A target missed
reads ``slow (...)`` (a speed, not a correctness fault: the summary lists it apart).
Then a profiler trace of ``TRACE_STEPS`` steps of the first case and its per-kernel
breakdown (``glm5_dsa_jax.tools.kernel_trace``): kernels a launch, busy time, gaps, the
slowest kernels.

``--smoke`` runs the same on the tiny preset with ``pallas_interpret`` (any device, what
the tests run); its times mean nothing, its rows and fields are the real run's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import glm5_dsa_jax as gd  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from glm5_dsa_jax.tools import bench, kernel_trace, roofline, timing  # noqa: E402
from glm5_dsa_jax.tools.gpu_compile.step import summary as hlo_summary  # noqa: E402

#: Issue 46's targets.
FLOOR_TARGET = 2.0  # in loop / floor
HOST_TARGET = 1.3  # per call / in loop
KERNEL_TARGET = 20  # kernels and control ops a step
#: Steps of the profiler trace.
TRACE_STEPS = 5


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def per_call_ms(call, cache, iters: int):
    """``(median ms, cache)`` of ``call(cache) -> (out, topk, cache)`` from Python, the
    cache threaded; one warm-up call first."""
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        out, _, cache = call(cache)
        jax.block_until_ready(out)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), cache


def _ratio_check(value: float, limit: float, what: str) -> str:
    return "ok" if value <= limit else f"slow ({what} x{value:.2f} > {limit:g})"


class Run:
    def __init__(self, args):
        self.args = args
        self.rows: list[dict] = []
        self.t0 = time.monotonic()
        smoke = args.smoke
        self.cfg = gd.DsaConfig.tiny(index_topk=8) if smoke else gd.DsaConfig.preset("glm53-flash")
        self.impl = args.impl or ("pallas_interpret" if smoke else "auto")
        idx = next(i for i in self.cfg.dsa_layers if self.cfg.has_indexer(i))
        self.layer = gd.DsaAttention(self.cfg, idx, rngs=nnx.Rngs(0), implementation=self.impl)
        self.step, self.params = gd.make_step(self.layer)
        self.rates = timing.device_rates([self.layer.dtype])
        self.bf16 = self.rates.flops[jnp.dtype(self.layer.dtype).name]

    def out_of_time(self) -> bool:
        return time.monotonic() - self.t0 > self.args.budget

    def floor_ms(self, batch: int, context: int, dense: bool = False) -> float:
        cfg = self.cfg
        if dense:
            n = roofline.weight_bytes(cfg, 2, has_indexer=False) + batch * context * cfg.kv_cache_dim * 2
            f = roofline.step_flops(cfg, context, batch, dense=True)["total"]
        else:
            n = roofline.step_read_bytes(cfg, context, batch)["total"]
            f = roofline.step_flops(cfg, context, batch)["total"]
        return max(n / self.rates.bandwidth, f / self.bf16) * 1e3

    def add(self, **row) -> dict:
        self.rows.append(row)
        log(json.dumps(row, default=float))
        return row

    def case(self, batch: int, context: int, trace_dir: str | None) -> None:
        a, layer, step = self.args, self.layer, self.step
        n = a.loop
        room = a.iters + 2 + 3 * n * (a.reps + 1) + (TRACE_STEPS + 1 if trace_dir else 0) + 8
        cache = bench.filled_cache(layer, batch, context, context + room)
        x = jax.random.normal(jax.random.key(1), (batch, 1, self.cfg.hidden_size), jnp.float32).astype(layer.dtype)
        m = jnp.ones((batch, 1), bool)
        common = dict(batch=batch, context=context, impl=self.impl, layer_impl=layer.implementation)
        floor = self.floor_ms(batch, context)
        # Kernels and control ops one step runs, counted into conditionals and loops
        # (``tools.gpu_compile.step.launched``), and any weight-sized intermediate.
        hlo = hlo_summary(step.lower(self.params, x, m, cache).compile().as_text())
        total = hlo["launched"]
        self.add(kernel="step", name="kernels", **common, ops=hlo["counts"], kernels=total,
                 weight_sized=hlo["weight_sized"],
                 check="ok" if total <= KERNEL_TARGET else f"slow ({total} kernels and control ops > {KERNEL_TARGET})")
        call = lambda c: step(self.params, x, m, c)  # noqa: E731
        t_call, cache = per_call_ms(call, cache, a.iters)
        loop = None
        if pk.jax_version() >= timing.IN_LOOP_MIN_JAX:
            loop, cache = timing.step_loop_ms(step.jitted(cache), step.compute_params(self.params, batch),
                                              x, m, cache, n, a.reps)
        self.add(kernel="step", name="in loop", **common, time_ms=loop, floor_ms=floor,
                 x_floor=None if loop is None else loop / floor,
                 check="-" if loop is None else _ratio_check(loop / floor, FLOOR_TARGET, "in loop / floor"))
        self.add(kernel="step", name="per call", **common, time_ms=t_call, floor_ms=floor, x_floor=t_call / floor,
                 x_in_loop=None if not loop else t_call / loop,
                 check="-" if not loop else _ratio_check(t_call / loop, HOST_TARGET, "per call / in loop"))
        if hasattr(gd.DsaDecoder, "steps") and not self.out_of_time():
            self.steps_row(common, batch, context, x, n)
        self._trace_cache = cache
        if trace_dir and not self.out_of_time():
            try:
                path = kernel_trace.capture(lambda: jax.block_until_ready(self._trace_step(x, m)), TRACE_STEPS,
                                            trace_dir)
                b = kernel_trace.breakdown(kernel_trace.load_trace(path), "jit_step_fn")
                self.add(kernel="step", name="trace", **common, check="-", **{k: v for k, v in b.items() if k != "kernels"},
                         top=b["kernels"][:16])
                self.breakdown = b
            except Exception as e:  # noqa: BLE001 - a profiler that cannot trace here loses only this row
                self.add(kernel="step", name="trace", **common, check=f"error: {type(e).__name__}: {str(e)[:200]}")
        if (batch, context) == (1, 4096) or (a.smoke and batch == 1):
            self.dense_row(common, batch, context, x, loop if loop else t_call, floor)

    def _trace_step(self, x, m):
        out, _, self._trace_cache = self.step(self.params, x, m, self._trace_cache)
        return out

    def steps_row(self, common, batch, context, x, n):
        dec = gd.DsaDecoder(self.layer, batch, context + 4 * n + 8)
        xs = jnp.broadcast_to(x, (batch, n, x.shape[-1]))
        jax.block_until_ready(dec.steps(xs))
        t0 = time.perf_counter()
        jax.block_until_ready(dec.steps(xs))
        ms = (time.perf_counter() - t0) * 1e3 / n
        self.add(kernel="step", name=f"steps({n})", **common, context_note="from an empty cache", time_ms=ms,
                 check="-")

    def dense_row(self, common, batch, context, x, sparse_ms, floor):
        dense, params_for, _ = bench._dense_layer_step(self.layer, self.step)
        n = self.args.loop
        cap = context + self.args.iters + 2 + 3 * n * (self.args.reps + 1) + 8
        dcache = bench.filled_cache(self.layer, batch, context, cap)
        dp = params_for(batch)
        t_call, dcache = per_call_ms(lambda c: (lambda o, c2: (o, None, c2))(*dense(dp, x, c)), dcache, self.args.iters)
        loop = None
        if pk.jax_version() >= timing.IN_LOOP_MIN_JAX:
            as_step = lambda p, h, _m, c: (lambda o, c2: (o, None, c2))(*dense(p, h, c))  # noqa: E731
            loop, dcache = timing.step_loop_ms(as_step, dp, x, None, dcache, n, self.args.reps)
        dense_ms = loop if loop else t_call
        dfloor = self.floor_ms(batch, context, dense=True)
        self.add(kernel="step", name="dense fit", **common, time_ms=dense_ms, per_call_ms=t_call,
                 floor_ms=dfloor, x_floor=dense_ms / dfloor, sparse_ms=sparse_ms,
                 check=_ratio_check(sparse_ms / dense_ms, 1.0, "sparse / dense"))


def run(args) -> tuple[list[dict], dict | None]:
    r = Run(args)
    r.breakdown = None
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",") if c]
    log(f"jax {jax.__version__} on {jax.default_backend()}; rates {r.rates}")
    for i, (b, ctx) in enumerate(cases):
        if r.out_of_time():
            r.add(kernel="step", name="-", batch=b, context=ctx, check="skipped (budget)")
            continue
        try:
            with tempfile.TemporaryDirectory() as d:
                # A CPU's trace has no device events (kernel_trace): the GPU's only.
                traced = i == 0 and not args.no_trace and jax.default_backend() == "gpu"
                r.case(b, ctx, d if traced else None)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: this case only
            r.add(kernel="step", name="-", batch=b, context=ctx, check=f"error: {type(e).__name__}: {str(e)[:300]}")
    meta = dict(jax=jax.__version__, backend=jax.default_backend(), impl=r.impl, layer_impl=r.layer.implementation,
                bandwidth=r.rates.bandwidth, bf16_flops=r.bf16, rates_source=r.rates.source,
                targets=dict(floor=FLOOR_TARGET, host=HOST_TARGET, kernels=KERNEL_TARGET))
    return r.rows, r.breakdown, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny preset, pallas_interpret (any device)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--impl", default=None, help="the layer's implementation (default auto; pallas_interpret with --smoke)")
    ap.add_argument("--cases", default=None, help="BxCONTEXT,... (default 1x4096,8x131072; 1x64 with --smoke)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per call row (default 10; 2 with --smoke)")
    ap.add_argument("--loop", type=int, default=None, help="steps of the in-loop program (default 8; 2 with --smoke)")
    ap.add_argument("--reps", type=int, default=None, help="runs of each in-loop program (default 3; 1 with --smoke)")
    ap.add_argument("--no-trace", action="store_true", help="no profiler trace")
    ap.add_argument("--budget", type=float, default=None, help="seconds; later cases are skipped (default 90)")
    args = ap.parse_args(argv)
    s = args.smoke
    args.cases = args.cases or ("1x64" if s else "1x4096,8x131072")
    args.iters = args.iters or (2 if s else 10)
    args.loop = args.loop or (2 if s else 8)
    args.reps = args.reps or (1 if s else 3)
    args.budget = math.inf if args.budget is None and s else (args.budget or 90.0)
    rows, b, meta = run(args)
    failed = any(str(r.get("check", "")).startswith("error") for r in rows)
    if args.json:
        print(json.dumps(dict(meta, rows=rows, breakdown=b), indent=1, default=float))
    else:
        for r in rows:
            t = r.get("time_ms")
            xf = r.get("x_floor")
            print(f"{r['batch']}x{r['context']:<7} {r['name']:<10} {'-' if t is None else f'{t:.3f} ms':>10}  "
                  f"{'-' if xf is None else f'x{xf:.2f}':>8} of floor  {r['check']}")
        if b:
            print(kernel_trace.format_breakdown(b))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
