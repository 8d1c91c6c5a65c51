"""The GPU check's timing (``glm5_dsa_jax.tools.timing``, ``kernel_trace``) and its ``step``
part. ``in_loop``: ``n`` calls of a function in one jitted program, each a real call. XLA hoists a loop-invariant call out of a plain
``fori_loop`` (the loop would then time nothing); ``in_loop`` passes the arguments through
an ``optimization_barrier`` chained from call to call, unrolled, and returns every
output, so every call stays."""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import pallas_kernels as pk  # noqa: E402
from glm5_dsa_jax.tools import timing  # noqa: E402


def _computations(hlo: str) -> dict[str, str]:
    """Name -> body text of each computation of an HLO module's text."""
    return {m.group(1): m.group(2) for m in re.finditer(r"\n%?([\w.\-]+) \([^\n]*\{\n(.*?)\n\}", hlo, re.S)}


def _in_while_body(hlo: str, op: str) -> bool:
    """Whether ``op`` runs in the body of the module's while loop (directly or through the
    computations the body calls)."""
    comps = _computations(hlo)
    body = re.search(r"while\([^\n]*body=%?([\w.\-]+)", hlo).group(1)
    seen, todo = set(), [body]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        if f" {op}(" in comps[name]:
            return True
        todo += re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", comps[name])
    return False


def test_in_loop_keeps_every_call():
    x = jnp.linspace(0.0, 1.0, 64, dtype=jnp.float32)
    f = lambda v: jnp.sin(v) * 3.0  # noqa: E731
    looped = timing.in_loop(f, 4)
    np.testing.assert_array_equal(np.asarray(looped(x)[-1]), np.asarray(f(x)))
    hlo = looped.lower(x).compile().as_text()
    assert "while" not in hlo
    if pk.jax_version() >= timing.IN_LOOP_MIN_JAX:  # jax 0.10's XLA drops the barriers
        assert hlo.count(" sine(") == 4  # unrolled: four calls, none merged
    assert timing.loop_time(f, (x,), 4, 2) >= 0.0

    # Without the barrier XLA hoists the call: the check above can fail.
    plain = jax.jit(lambda v: jax.lax.fori_loop(0, 4, lambda i, c: f(v), jnp.zeros_like(v)))
    assert not _in_while_body(plain.lower(x).compile().as_text(), "sine")


def test_step_program_equals_the_steps_called_one_by_one():
    """``step_program``'s ``n`` steps in one program are ``n`` calls of the step: the same
    outputs and the same cache after them (the cache threaded, donated)."""
    import glm5_dsa_jax as gd
    from flax import nnx

    cfg = gd.DsaConfig.tiny(index_topk=8)
    layer = gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0), implementation="xla")
    step, params = gd.make_step(layer)
    xs = jax.random.normal(jax.random.key(3), (3, 2, 1, cfg.hidden_size), jnp.float32).astype(layer.dtype)
    m = jnp.ones((2, 1), bool)
    one = layer.init_cache(2, 16)
    want = []
    for x in xs[:1].repeat(3, 0):
        out, _, one = step(params, x, m, one)
        want.append(out)
    prog = timing.step_program(step.jitted(one), 3)
    outs, many = prog(step.compute_params(params, 2), xs[0], m, layer.init_cache(2, 16))
    for a, b in zip(outs, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(many), jax.tree.leaves(one)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(many.length) == 3


def test_step_loop_ms_reads_a_step_that_costs_time():
    """A step that costs milliseconds (a chain of 384-square products, its "cache" the
    carried matrix) reads positive in one program, and the cache comes back advanced by
    every run's steps. (How it compares with a call from Python is not asserted here: on
    two shared cores a neighbour's load moves either reading by 2x; the arithmetic is
    pinned by ``test_step_loop_ms_arithmetic``.)"""
    def step(p, h, m, c):
        for _ in range(8):
            c = jnp.tanh(c @ p)
        return h, None, c

    p = jax.random.normal(jax.random.key(0), (384, 384), jnp.float32) / 20.0
    c0 = jnp.eye(384, dtype=jnp.float32)
    ms, cache = timing.step_loop_ms(step, p, jnp.float32(0.0), None, c0 + 0.0, n=4, reps=3)  # donated
    assert ms is not None and ms > 0.0, ms
    want = c0
    for _ in range(3 * 4 * (3 + 1)):  # n and 2n steps, each program run reps + 1 times
        want = step(p, 0.0, None, want)[2]
    np.testing.assert_allclose(np.asarray(cache), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_step_loop_ms_arithmetic(monkeypatch):
    """``(T(2n) - T(n)) / n`` in milliseconds from the least runs of the ``n``- and
    ``2n``-step programs; None, never a zero or a negative, where ``T(2n) <= T(n)``."""
    def step(p, h, m, c):
        return h, None, c + 1.0

    for times, want in (([0.010, 0.030], 5.0), ([0.010, 0.010], None), ([0.010, 0.009], None)):
        seen = iter(times)
        monkeypatch.setattr(timing, "_best_s", lambda call, reps: next(seen))
        ms, _ = timing.step_loop_ms(step, 0.0, 0.0, None, jnp.zeros(()), n=4, reps=1)
        assert ms == (None if want is None else pytest.approx(want)), (times, ms)


def test_device_rates_take_the_gpu_table(monkeypatch):
    """On a GPU the roofline's table names (an H200: its datasheet bandwidth and bf16 rate),
    a floor is timed at the table's rates, not at a small measurement below them; a
    float32 product's rate is measured (at ``GPU_MATMUL_N``); an unknown GPU measures both."""
    from glm5_dsa_jax.tools.roofline import GPUS

    class Dev:
        platform, device_kind = "gpu", "NVIDIA H200"

    measured = []
    monkeypatch.setattr(timing, "matmul_rate", lambda d, n=0, iters=5: measured.append((d, n)) or 1.0)
    monkeypatch.setattr(timing, "copy_bandwidth", lambda *a: 2.0)
    r = timing.device_rates([jnp.bfloat16, jnp.float32], Dev())
    assert r.source == "table:h200"
    assert r.bandwidth == GPUS["h200"].bandwidth and r.flops["bfloat16"] == GPUS["h200"].peak_flops
    assert measured == [("float32", timing.GPU_MATMUL_N)]
    Dev.device_kind = "NVIDIA B300"
    r = timing.device_rates([jnp.bfloat16], Dev())
    assert (r.source, r.bandwidth, r.flops) == ("measured", 2.0, {"bfloat16": 1.0})


TRACE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "benchmarks", "gpu-runs", "2026-12-04", "trace-decode-b1-4k.json.gz")


def test_kernel_breakdown_of_the_first_gpu_trace():
    """The first H200 run's trace of five decode steps (batch 1, 4K, ``pallas``): 54 device
    events a launch, ~391 us busy, the indexer's column-reduce product (167 us) first;
    host events and other modules are not counted."""
    from glm5_dsa_jax.tools import kernel_trace as kt

    trace = kt.load_trace(TRACE)
    b = kt.breakdown(trace, "jit_step_fn")
    assert b["launches"] == 5 and b["kernels_per_launch"] == 54
    assert 385 < b["busy_us"] < 395 and b["span_us"] > b["busy_us"] and b["gap_us"] > 40
    top = b["kernels"][0]
    assert top["kernel"] == "input_concatenate_fusion_1" and 160 < top["us"] < 175
    # Each kernel's median over the launches against the median launch: within 2 % of whole.
    assert abs(sum(r["share"] for r in b["kernels"]) - 1.0) < 0.02
    names = {r["kernel"] for r in b["kernels"]}
    assert {"sparse_mla", "set_case_condition", "MemcpyD2D"} <= names
    assert all(e["args"].get("hlo_module") == "jit_step_fn" for e in kt.device_events(trace, "jit_step_fn"))
    assert len(kt.device_events(trace)) > len(kt.device_events(trace, "jit_step_fn"))  # other modules
    with pytest.raises(ValueError, match="no device events of module 'jit_other'"):
        kt.breakdown(trace, "jit_other")
    assert "54 kernels a launch" in kt.format_breakdown(b)


def test_capture_writes_a_trace(tmp_path):
    """``capture`` runs the call under the profiler and finds the Perfetto trace it wrote."""
    from glm5_dsa_jax.tools import kernel_trace as kt

    f = jax.jit(lambda v: jnp.sin(v) * 2.0)
    x = jnp.ones((8,), jnp.float32)
    path = kt.capture(lambda: jax.block_until_ready(f(x)), 2, str(tmp_path))
    assert path.endswith(".trace.json.gz") and kt.load_trace(path)["traceEvents"]
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz under"):
        kt.find_trace(str(tmp_path / "empty"))


@pytest.mark.e2e
def test_step_part_smoke(tmp_path):
    """``gpu_check.py --all --smoke --parts step``: the step part's rows (kernels, in loop,
    per call, dense fit) with floors and checks, and the summary's speed table."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "gpu_check.py"), "--all", "--smoke",
                           "--parts", "step", "--out", str(tmp_path)], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "step.log").read_text()[-3000:]
    import json

    res = json.loads((tmp_path / "step.json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert {"kernels", "per call", "dense fit"} <= set(rows)
    assert rows["kernels"]["kernels"] >= sum(rows["kernels"]["ops"].values()) > 0
    assert rows["per call"]["floor_ms"] > 0 and rows["per call"]["time_ms"] > 0
    assert res["rates_source"] == "measured"
    assert "against issue 46's targets" in (tmp_path / "summary.md").read_text()
