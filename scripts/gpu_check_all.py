#!/usr/bin/env python
"""Every part of the GPU check in one command, for a lent GPU: ``python scripts/gpu_check.py
--all --out DIR`` (or this script), in about eight minutes on an H200.

Parts, each a fresh process (a crash or an out-of-memory in one loses that part only),
each with its own time budget, its JSON written to ``DIR/<part>.json`` and its log to
``DIR/<part>.log``:

1. ``probe``: ``scripts/mosaic_topk_probe.py``, the Mosaic top-k's building blocks one by one;
2. ``kernels``: ``scripts/gpu_check.py``, every kernel at the real shapes against its
   reference, ``pallas`` and ``mosaic`` rows, timed per call and in a loop;
3. ``layer``: ``scripts/gpu_check_layer.py``, the whole layer under ``pallas``, ``mosaic``
   and ``auto`` against ``"xla"`` (prefill, decode, contiguous and paged caches, and the
   parameter gradients judged against float32);
4. ``train``: ``scripts/gpu_check_train.py``, the backward kernels under ``pallas`` and
   ``mosaic`` at 4,096 tokens (gradients against ``"xla"`` and float32);
5. ``step``: ``scripts/gpu_check_step.py``, the decode step's speed (batch 1 at 4K, batch 8
   at 131K): per call and inside one program against its floor, its kernel count, the
   dense step at 4K, and a per-kernel breakdown of a profiler trace (issue 46's targets);
6. ``products``: ``scripts/gpu_products_probe.py``, the projections' forms at 1 and 8 rows
   (contraction-last copies against two rows of the stored layout: the GPU product policy's
   choice, ``cpu_policy``).

Then ``DIR/summary.md``: each part's status and failed rows, and the hardware record the
run supports (``pallas_kernels._hardware_runs``, exported by ``pallas_kernels``): a kernel under an implementation is
proven when it has rows and every one passed, its backward by the ``train`` rows, and the
whole layer on that implementation passed too (a path is proven or refuted whole). The
summary prints those records with the fingerprints of the code that ran, ready to paste
into ``HARDWARE_RUNS``, then the speed rows against issue 46's targets (a target missed
reads ``slow``: a speed, not a fault, so it fails no part) and the step's kernel breakdown.
Exit status 0 when every part passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

#: (part, script, arguments, budget seconds): the budgets add to five and a half minutes
#: of checks and compiles (the layer's gradients compile eight programs); process starts
#: and the first compile of each part make up the rest of the six.
PARTS = [
    ("probe", "mosaic_topk_probe.py", ["--json"], 30),
    ("kernels", "gpu_check.py", ["--json", "--no-sweep", "--contexts", "8192,131072", "--reps", "3"], 50),
    ("layer", "gpu_check_layer.py", ["--json", "--impls", "pallas,mosaic,auto"], 110),
    ("train", "gpu_check_train.py", ["--json", "--tokens", "4096", "--impl", "pallas,mosaic",
                                     "--no-layer", "--reps", "3"], 60),
    ("step", "gpu_check_step.py", ["--json"], 60),
    ("products", "gpu_products_probe.py", ["--json", "--rows", "1,8", "--calls", "5",
                                           "--forms", "kn f32,nk f32,kn x2 f32",
                                           "--shapes", "q_a,kv_a,index wk,o_proj"], 25),
]
SMOKE_ARGS = {
    "probe": ["--interpret"], "kernels": ["--smoke"], "layer": ["--smoke", "--impls", "pallas_interpret"],
    "train": ["--smoke", "--tokens", "64", "--impl", "pallas_interpret", "--no-layer"],
    "step": ["--smoke"],
    "products": ["--rows", "1", "--calls", "2", "--forms", "kn x2 f32", "--shapes", "index wk"],
}


def _family(impl: str) -> str:
    """``"pallas"`` / ``"mosaic"`` / ``"xla"`` ... of a row's implementation label
    (``"pallas n_live"``, ``"mosaic (bf16 operands)"``, ``"pallas[block_h=16,...]"``,
    ``"mosaic_interpret"``)."""
    return impl.split()[0].split("[")[0].replace("_interpret", "")


def _failed(check) -> bool:
    """A row that ran and did not pass (rows that only time, reference rows and skipped
    rows did not fail)."""
    return str(check).startswith(("MISMATCH", "error"))


def _ok(check) -> bool:
    """A row that ran and passed."""
    return str(check).startswith("ok")


def proven_records(results: dict) -> dict[tuple[str, str], bool]:
    """``(kernel, family) -> passed`` for every kernel and family the run checked: all its
    rows passed (forward rows from ``kernels``, backward rows from ``train``) and the
    layer on that family passed (the ``layer`` part's rows of that implementation)."""
    seen: dict[tuple[str, str], bool] = {}

    def note(kernel, family, ok):
        if family in ("pallas", "mosaic"):
            seen[(kernel, family)] = seen.get((kernel, family), True) and ok

    for r in results.get("kernels", {}).get("rows", []):
        if r.get("impl") not in ("xla", "-") and (_ok(r.get("check")) or _failed(r.get("check"))):
            note(r["kernel"], _family(r["impl"]), _ok(r.get("check")))
    for r in results.get("train", {}).get("rows", []):
        if r.get("kernel") in ("sparse_mla", "index_scores") and r.get("impl") != "xla" and (
                _ok(r.get("check")) or _failed(r.get("check"))):
            note(f"{r['kernel']}_backward", _family(r["impl"]), _ok(r.get("check")))
    layer_rows = results.get("layer", {}).get("rows", [])
    for family in ("pallas", "mosaic"):
        rows = [r for r in layer_rows if _family(r.get("impl", "")) == family]
        layer_ok = any(_ok(r.get("check")) for r in rows) and not any(_failed(r.get("check")) for r in rows)
        for key in [k for k in seen if k[1] == family]:
            seen[key] = seen[key] and layer_ok
    return seen


def summary(results: dict, meta: dict) -> str:
    import pallas_kernels as hr

    lines = [f"# GPU check, {meta['date']}", "",
             f"{meta['device']}, jax {meta['jax']}, {meta['elapsed_s']:.0f} s", "",
             "| part | status | rows | failed | seconds |", "|---|---|---|---|---|"]
    for part, res in results.items():
        rows = res.get("rows", [])
        bad = [r for r in rows if _failed(r.get("check"))]
        lines.append(f"| {part} | {res.get('status')} | {len(rows)} | {len(bad)} | {res.get('seconds', 0):.0f} |")
    for part, res in results.items():
        bad = [r for r in res.get("rows", []) if _failed(r.get("check"))]
        if bad:
            lines += ["", f"## {part}: rows that did not pass", ""]
            lines += [f"* {json.dumps({k: v for k, v in r.items() if k in ('case', 'context', 'batch', 'part', 'kernel', 'impl', 'name', 'tokens', 'check')})}"
                      for r in bad[:40]]
    lines += ["", "## The hardware record this run supports", "",
              "| kernel | implementation | passed | fingerprint |", "|---|---|---|---|"]
    records = proven_records(results)
    for (kernel, family), ok in sorted(records.items()):
        fp = hr.source_fingerprint(kernel, family) if (kernel, family) in hr.KERNEL_SOURCES else "-"
        lines.append(f"| `{kernel}` | `{family}` | {'yes' if ok else 'no'} | {fp} |")
    dev_class = meta.get("device_class")
    paste = [f'    ("{k}", "{f}", "{dev_class}"): HardwareRun("{meta["device"]}", "{meta["jax"]}", '
             f'"{meta["date"]}", "{hr.source_fingerprint(k, f)}"),'
             for (k, f), ok in sorted(records.items()) if ok and (k, f) in hr.KERNEL_SOURCES]
    if paste and dev_class:
        lines += ["", "`HARDWARE_RUNS` entries (pallas_kernels/_hardware_runs.py):", "", "```python", *paste, "```"]
    step = results.get("step", {})
    speed = [r for r in step.get("rows", []) if r.get("name") not in ("trace", "-")]
    if speed:
        lines += ["", "## The decode step against issue 46's targets", "",
                  "| batch x context | row | ms | x floor | check |", "|---|---|---|---|---|"]
        for r in speed:
            t, xf = r.get("time_ms"), r.get("x_floor")
            extra = f" ({r['kernels']})" if "kernels" in r else ""
            lines.append(f"| {r['batch']} x {r['context']} | {r['name']}{extra} | "
                         f"{'-' if t is None else f'{t:.3f}'} | {'-' if xf is None else f'{xf:.2f}'} | {r['check']} |")
    probe = [r for r in results.get("products", {}).get("rows", []) if "us" in r]
    if probe:
        lines += ["", "## The projections' forms (GB/s of the weight's bytes; what XLA ran)", "",
                  "| product | rows | form | us | GB/s | ran |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['m']} | {r['form']} | {r['us']:.1f} | {r.get('gbps') or 0:.0f} | {r['ran']} |"
                  for r in probe]
    if step.get("breakdown"):
        from glm5_dsa_jax.tools.kernel_trace import format_breakdown

        lines += ["", "## Where one decode step's device time goes (profiler trace)", "",
                  format_breakdown(step["breakdown"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for each part's JSON and log and summary.md")
    ap.add_argument("--smoke", action="store_true", help="each part's CPU smoke run (tiny shapes, interpret)")
    ap.add_argument("--parts", default=",".join(p[0] for p in PARTS),
                    help="comma-separated parts to run (default: all)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's budget")
    ap.add_argument("--deadline", type=float, default=360.0,
                    help="seconds for the whole run (default 360): a part still running then is "
                         "stopped and reported, and later parts do not start")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import jax

    from pallas_kernels._common import target_device
    from pallas_kernels import device_class, fingerprints

    dev = jax.devices()[0]
    meta = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                device=getattr(dev, "device_kind", str(dev)),
                device_class=device_class(target_device()[1]), fingerprints=fingerprints())
    wanted = set(args.parts.split(","))
    results, t0 = {}, time.monotonic()
    for part, script, extra, budget in PARTS:
        if part not in wanted:
            continue
        cmd = [sys.executable, os.path.join(HERE, script), *extra]
        if args.smoke:
            cmd = [sys.executable, os.path.join(HERE, script), "--json", *SMOKE_ARGS[part]]
        elif part != "probe":
            cmd += ["--budget", str(budget * args.budget_scale)]
        left = args.deadline - (time.monotonic() - t0)
        if left < 20:
            results[part] = dict(rows=[], status="not run (deadline)", seconds=0.0)
            continue
        print(f"== {part}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t = time.monotonic()
        with open(os.path.join(args.out, f"{part}.log"), "w") as log:
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                                      timeout=left)
                out, status = proc.stdout, "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                status = f"stopped at the deadline ({args.deadline:.0f} s)"
        try:
            res = json.loads(out)
        except json.JSONDecodeError:
            res = {"rows": [], "stdout": out[-2000:]}
        res.update(status=status, seconds=time.monotonic() - t)
        results[part] = res
        with open(os.path.join(args.out, f"{part}.json"), "w") as f:
            json.dump(res, f, indent=1, default=float)
        print(f"   {res['status']} in {res['seconds']:.0f} s", file=sys.stderr, flush=True)
    meta["elapsed_s"] = time.monotonic() - t0
    text = summary(results, meta)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(text)
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
