"""The call stack of a layer call is short and flat (issue 22, "How it is checked").

For a decode step (a prefill, then one token; ``"pallas_interpret"``, the tiny preset),
unplaced with a contiguous and with a paged cache, on TP 2 and on data 2 x tp 2 with a
paged cache, the Python stack from ``DsaAttention.__call__`` down to each Pallas kernel
wrapper (``pallas_kernels``' public functions, wrapped here to record the stack at their
call) crosses at most 4 modules of the project with at most 4 module switches, and
``DsaAttention.__call__`` is on it once: the call never re-enters itself.

The two calls are traced (``jax.make_jaxpr``), not compiled: an eager call traces the same
project functions inside its cached program (``parallel.execution``), only jax's frames
differ, and tracing keeps the test to seconds. What counts: the frames of files in
``glm5_dsa_jax/`` and ``pallas_kernels/`` from the outermost ``DsaAttention.__call__``
down, then the wrapper's own module; jax's frames in
between (``jit``, ``shard_map``, ``lax.map``) are not the project's and are skipped. A
module switch is a change of module between consecutive project frames. On main before
issue 22 the data 2 x tp 2 paged step measured 6 modules, 9 switches and one re-entry.
"""

from __future__ import annotations

import inspect
import traceback
from pathlib import Path

import jax
import numpy as np
import pytest

import pallas_kernels as pk
from glm5_dsa_jax.parallel.sharding import shard_layer
from helpers import dp_mesh, f32_layer, tiny8, tp_mesh

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tuple(str(ROOT / p) + "/" for p in ("glm5_dsa_jax", "pallas_kernels"))
MAX_MODULES = MAX_SWITCHES = 4


def _module(filename: str) -> str:
    rel = Path(filename).resolve().relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def chain(stack, wrapper_module: str) -> list[tuple[str, str]]:
    """``(module, function)`` of the project frames from the outermost
    ``DsaAttention.__call__`` down, then the wrapper's own module."""
    frames = [(_module(f.filename), f.name) for f in stack if f.filename.startswith(PROJECT)]
    start = next(i for i, (m, n) in enumerate(frames) if _is_layer_call(m, n))
    return frames[start:] + [(wrapper_module, "")]


def _is_layer_call(module: str, name: str) -> bool:
    return name == "__call__" and module.rpartition(".")[2] == "layer"  # wherever layer.py lives


def measure(links):
    """``(modules, switches, calls of DsaAttention.__call__)`` of one chain."""
    mods = [m for m, _ in links]
    switches = sum(a != b for a, b in zip(mods, mods[1:]))
    calls = sum(_is_layer_call(m, n) for m, n in links)
    return len(set(mods)), switches, calls


@pytest.fixture
def recorded(monkeypatch):
    """Wrap every public function of ``pallas_kernels``: each call appends ``(name,
    chain)`` to the list returned."""
    seen = []
    for name in pk.__all__:
        fn = getattr(pk, name)
        if not inspect.isfunction(fn) or fn.__module__ in ("typing", "pallas_kernels._common"):
            continue

        def wrapper(*args, __fn=fn, __name=name, **kwargs):
            seen.append((__name, chain(traceback.extract_stack()[:-1], __fn.__module__)))
            return __fn(*args, **kwargs)

        monkeypatch.setattr(pk, name, wrapper)
    return seen


CASES = {
    "contiguous": (None, "contiguous"),
    "paged": (None, "paged"),
    "tp2": ("tp2", "contiguous"),
    "tp2-paged": ("tp2", "paged"),
    "dp2xtp2-paged": ("dp2xtp2", "paged"),
}

@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_step_stack_is_flat(case, recorded):
    placement, kind = CASES[case]
    cfg = tiny8()
    layer = f32_layer(cfg, 1, implementation="pallas_interpret")
    if placement == "tp2":
        shard_layer(layer, tp_mesh(2), "tp")
    elif placement == "dp2xtp2":
        shard_layer(layer, dp_mesh((2, 2)), "tp", batch_axis="data")
    b, s = 2, 6
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, s + 1, cfg.hidden_size)).astype(np.float32)
    cache = layer.init_cache(b, 16) if kind == "contiguous" else layer.init_paged_cache(b, 8, 4)

    def prefill_then_decode(cache):
        _, _, cache = layer(x[:, :s], cache=cache)
        recorded.clear()  # only the decode step's calls
        return layer(x[:, s:], cache=cache)

    jax.make_jaxpr(prefill_then_decode)(cache)
    scoring = "index_scores" if kind == "contiguous" else "index_scores_paged"
    assert {"kpool_compress", scoring, "topk_pools", "expand_selection", "sparse_mla"} <= {
        n for n, _ in recorded}, recorded
    report = []
    for name, links in recorded:
        modules, switches, calls = measure(links)
        report.append(f"{name}: {modules} modules, {switches} switches, {calls} x __call__: "
                      + " -> ".join(m for i, (m, _) in enumerate(links) if i == 0 or m != links[i - 1][0]))
    print("\n".join(report))
    for (name, links), line in zip(recorded, report):
        modules, switches, calls = measure(links)
        assert calls == 1, line
        assert modules <= MAX_MODULES and switches <= MAX_SWITCHES, line


def test_measure_counts_a_known_chain():
    # The measurement on main (data x tp, paged): the checker finds its numbers.
    mods = ["layer", "data_parallel", "layer", "paged_step", "ops", "paged_step", "layer",
            "parallel", "ops", "selection"]
    links = [(f"glm5_dsa_jax.{m}", "__call__" if i in (0, 2) else "f") for i, m in enumerate(mods)]
    assert measure(links) == (6, 9, 2)
