"""Where a compiled step's device time goes: the kernels of a profiler trace, per launch.

``capture(call, n, folder)`` runs ``call()`` ``n`` times under ``jax.profiler`` with a
Perfetto trace; ``breakdown(trace, module)`` reads that trace's device events and returns,
per launch of the jitted ``module`` (``"jit_step_fn"`` for ``make_step``'s step), the
number of kernels, the time the device was busy, the span from the first kernel's start to
the last one's end, and the gaps between them (span - busy), with each kernel's median time
over the launches, its named scope and its share of the busy time.

Invariants:

* Only device events count (a process whose name starts with ``/device:``), complete
  events (``"ph": "X"``) whose ``hlo_module`` is ``module``: the host's events and other
  programs (a warm-up, a barrier) are not the step's.
* A launch is the events of one ``correlation_id`` (one execution of the program; inside
  a CUDA graph every node of one launch shares it). A memcpy (``MemcpyD2D``, ...) is an
  event like a kernel and counts as one: it is a node of the step all the same.
* Kernel names are the trace's (XLA's fusion names with ``.`` as ``_``, Pallas kernels by
  their kernel name); the compiled HLO's op of the same name is what it ran.
* The first GPU run's trace (``benchmarks/gpu-runs/2026-12-04/trace-decode-b1-4k.json.gz``:
  GLM-5.3-Flash decode, batch 1, 4,096 tokens, ``pallas``, jax 0.11.2, one H200) reads 54
  kernels a launch, ~391 us busy in a ~450 us span; it is the tests' fixture.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import statistics

import jax

__all__ = ["load_trace", "find_trace", "device_events", "breakdown", "capture", "format_breakdown"]


def load_trace(path: str) -> dict:
    """A Perfetto / Chrome trace (``.json`` or ``.json.gz``) as a dict."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace if isinstance(trace, dict) else {"traceEvents": trace}


def find_trace(folder: str) -> str:
    """The Perfetto trace ``jax.profiler`` wrote under ``folder`` (``FileNotFoundError``
    naming the folder if there is none)."""
    found = sorted(glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {folder}: was the trace captured with "
                                "create_perfetto_trace=True?")
    return found[-1]


def device_events(trace: dict, module: str | None = None) -> list[dict]:
    """The device's complete events (kernels and memcpys) of ``module`` (every module when
    None), in time order."""
    events = trace.get("traceEvents", [])
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    out = [e for e in events if e.get("ph") == "X" and e.get("pid") in devices
           and (module is None or e.get("args", {}).get("hlo_module") == module)]
    return sorted(out, key=lambda e: e["ts"])


def breakdown(trace: dict, module: str = "jit_step_fn") -> dict:
    """Per launch of ``module``: kernels, busy, span and gap microseconds (medians over the
    launches), and each kernel's median microseconds, scope and share of the busy time,
    slowest first. ``ValueError`` naming the module when the trace has none of its events."""
    launches: dict[str, list[dict]] = {}
    for e in device_events(trace, module):
        launches.setdefault(str(e.get("args", {}).get("correlation_id", "")), []).append(e)
    if not launches:
        raise ValueError(f"the trace has no device events of module {module!r}")
    per = []
    for evs in launches.values():
        busy = sum(e["dur"] for e in evs)
        span = max(e["ts"] + e["dur"] for e in evs) - evs[0]["ts"]
        per.append((len(evs), busy, span))
    kernels: dict[str, list[float]] = {}
    scopes: dict[str, str] = {}
    for evs in launches.values():
        for e in evs:
            kernels.setdefault(e["name"], []).append(e["dur"])
            scope = e.get("args", {}).get("name")
            if scope:
                scopes.setdefault(e["name"], scope)
    busy = statistics.median(p[1] for p in per)
    n = len(launches)
    rows = [dict(kernel=k, us=statistics.median(v), per_launch=len(v) / n, scope=scopes.get(k, ""))
            for k, v in kernels.items()]
    for r in rows:
        r["share"] = r["us"] * r["per_launch"] / busy if busy else 0.0
    rows.sort(key=lambda r: -r["us"] * r["per_launch"])
    span = statistics.median(p[2] for p in per)
    return dict(module=module, launches=n, kernels_per_launch=statistics.median(p[0] for p in per),
                busy_us=busy, span_us=span, gap_us=max(span - busy, 0.0), kernels=rows)


def capture(call, n: int, folder: str) -> str:
    """Run ``call()`` (which blocks until its work is done) once unprofiled, then ``n``
    times under the profiler; the path of the Perfetto trace written under ``folder``."""
    call()
    jax.profiler.start_trace(folder, create_perfetto_trace=True)
    try:
        for _ in range(n):
            call()
    finally:
        jax.profiler.stop_trace()
    return find_trace(folder)


def format_breakdown(b: dict, top: int = 12) -> str:
    """A markdown table of ``breakdown``'s result: the launch line, then the ``top``
    kernels."""
    lines = [f"{b['module']}: {b['kernels_per_launch']:.0f} kernels a launch, {b['busy_us']:.1f} us busy in a "
             f"{b['span_us']:.1f} us span ({b['gap_us']:.1f} us of gaps), median of {b['launches']} launches",
             "", "| kernel | us | share | scope |", "|---|---|---|---|"]
    for r in b["kernels"][:top]:
        lines.append(f"| `{r['kernel']}` | {r['us']:.1f} | {100 * r['share']:.0f} % | {r['scope']} |")
    return "\n".join(lines)
