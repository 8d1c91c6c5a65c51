"""Compile every Pallas kernel for NVIDIA GPUs on a host without one, and check what came out.

No GPU is needed: XLA compiles for a *compile-only* CUDA device built from a description of
the GPU (``jax.experimental.topologies.get_topology_desc(..., "cuda", target_config=...)``,
from ``jax-cuda12-plugin``; no driver is loaded). Per target and case:

1. the kernel's public wrapper (``implementation="pallas"``) is traced on abstract inputs
   at the shapes the layer gives it for one step (``KERNELS`` x ``default_cases``), with
   the compile-only device as the default device (jax >= 0.11's Pallas reads the compute
   capability from it; 0.10 assumes 9.0, which only affects fp8 casts, unused here);
2. ``.lower().compile()`` runs XLA's Triton -> LLVM -> PTX -> cubin pipeline, dumping the
   PTX and the thunk sequence (XLA itself rejects a kernel over the shared-memory limit);
3. ``ptxas -v`` on the dumped PTX of each Triton kernel gives registers, spills, stack frame
   and static shared memory; the thunk sequence gives the launch's threads and dynamic
   shared memory; blocks per SM follow from those by the CUDA occupancy rules
   (``GpuTarget.blocks_per_sm``).

A kernel passes when it compiled, spills nothing, has no stack frame (local memory is as
slow as a spill), fits the target's shared memory per block, and at least one block fits an
SM. Invariants:

* A number that cannot be read (no thunk, no ptxas line) fails the kernel: a check that has
  lost its data must not pass.
* Each target compiles in its own subprocess (``python -m glm5_dsa_jax.tools.gpu_compile
  --worker``): XLA aborts the process on some fatal errors, and the caller (pytest) must
  survive to report them; the caller's jax setup (8 virtual CPU devices) stays out of it.
* The worker compiles at XLA's default optimisation level, whatever the caller's
  ``XLA_FLAGS`` say (``worker_xla_flags``): ``--xla_backend_optimization_level=0`` (the test
  suite sets it to compile XLA:CPU faster) also turns LLVM's passes off for the Triton
  kernels' PTX, and that PTX keeps its values in local memory: every kernel would report
  a stack frame and spills a GPU build never has.
* Work is shared, never skipped: cases whose wrapper inputs are identical are traced once,
  and cases whose Triton kernels (IR bytes, warps, stages) are identical are compiled once
  (``Report.same_as`` names the case that compiled it). A kernel's registers and shared
  memory depend only on its IR and the target, not on the grid.

Mosaic GPU kernels (``MOSAIC_KERNELS``, ``mosaic_cases``; jax >= 0.11) compile the same way
for targets of compute capability >= 9.0 (``sm_90a``; a Mosaic kernel does not exist for
older GPUs, so ``compile_cases`` leaves those pairs out, and the ``wgmma`` ones,
``MOSAIC_HOPPER_ONLY``, none for Blackwell's sm_100 either): the CUDA plugin runs Mosaic's
passes to PTX and its ptxas during ``.compile()`` on the compile-only device and dumps the
PTX, ptxas's ``-v`` report (``*.ptxas``: registers, spills, stack) and the kernel's dynamic
shared memory (``*.resources.txt``); threads per block are ``MOSAIC_THREADS``.

Adding a kernel is one ``KERNELS`` entry: a function from the model config and a ``Step``
to the wrapper call and its abstract inputs (and its module in ``KERNEL_MODULES``). Needs
the ``gpu-compile`` extra (``toolchain()`` says what is missing).

Modules: ``targets`` (``GpuTarget``, ``TARGETS``, occupancy), ``cases`` (``Step``, ``Case``,
``KERNELS``, ``default_cases``), ``worker`` (the per-target compile process), ``ptxas``
(toolchain discovery, ``ptxas -v`` parsing), ``report`` (``Report``, the thunk parser, the
tables); this module runs the workers and reads their dumps (``compile_cases``). The
command line is ``glm5-dsa gpu-compile`` (``glm5_dsa_jax.cli.gpu_compile``);
``python -m glm5_dsa_jax.tools.gpu_compile`` (``__main__``) is the same command. Names the modules
share that are not in an ``__all__`` (``cases.build``, ``report.analyse``) are the package's
internal API.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

from glm5_dsa_jax.tools.gpu_compile.cases import (
    KERNEL_MODULES, KERNELS, MOSAIC_KERNELS, MOSAIC_THREADS, Case, Step, default_cases, mosaic_cases,
    mosaic_on_target, switch_point_cases,
)
from glm5_dsa_jax.tools.gpu_compile.ptxas import (
    ToolchainMissing, find_ptxas, parse_ptxas, ptxas_stats, toolchain,
)
from glm5_dsa_jax.tools.gpu_compile.report import (
    Report, analyse, failures, format_table, parse_thunks,
)
from glm5_dsa_jax.tools.gpu_compile.targets import TARGETS, GpuTarget

__all__ = [
    "GpuTarget", "TARGETS", "Step", "Case", "KERNELS", "KERNEL_MODULES", "default_cases",
    "switch_point_cases", "MOSAIC_KERNELS", "mosaic_cases", "mosaic_on_target",
    "Report", "ToolchainMissing", "toolchain", "compile_cases", "format_table", "failures",
    "parse_ptxas", "parse_thunks", "find_ptxas", "worker_xla_flags",
]


_OPT_LEVEL_FLAG = re.compile(r"--xla_backend_optimization_level(=\S*)?")


def worker_xla_flags(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) less any backend optimisation level (module doc)."""
    return " ".join(_OPT_LEVEL_FLAG.sub("", flags).split())


def _run_worker(target: GpuTarget, cases: list[Case], dump_root: str, timeout: float,
                config: dict) -> dict[str, dict]:
    """Run the worker for one target; after a crash, go on past the case that caused it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS=worker_xla_flags(os.environ.get("XLA_FLAGS", "")))
    # The repository root (above glm5_dsa_jax/tools/gpu_compile/), so the worker imports this code.
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    records: dict[str, dict] = {}
    todo = list(cases)
    deadline = time.time() + timeout
    while todo:
        spec = {"config": config, "cases": [
            {"kernel": c.kernel, "step": dataclasses.asdict(c.step), "blocks": c.blocks}
            for c in todo]}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "glm5_dsa_jax.tools.gpu_compile", "--worker", target.name,
                 "--dump-dir", dump_root], input=json.dumps(spec), capture_output=True,
                text=True, env=env, timeout=max(1.0, deadline - time.time()))
            out, err, how = proc.stdout, proc.stderr, f"exited with status {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            how = f"ran past the {timeout:.0f} s limit"
        ready = False
        for line in out.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            ready |= rec.get("event") == "ready"
            if rec.get("event") == "case":
                records[rec["id"]] = rec
        todo = [c for c in todo if c.id not in records]
        if todo:
            tail = "\n".join(err.strip().splitlines()[-30:])
            dead = todo if not ready or "limit" in how else todo[:1]
            for c in dead:
                records[c.id] = {"id": c.id, "ok": False, "error":
                                 f"the {target.name} compile process {how} "
                                 f"{'before it started' if not ready else 'on this case'}:\n{tail}"}
            todo = todo[len(dead):]
    return records


def _mosaic_compiled(rec: dict) -> dict:
    """A Mosaic GPU case's launches (threads; dynamic SMEM from the plugin's
    ``<kernel>_<n>.resources.txt``) and ptxas numbers (its ``*.ptxas``), read from its dump."""
    entries = {c["name"] for c in rec["calls"]}
    smem, stats, errors = {}, {}, []
    for fn in sorted(os.listdir(rec["dump"])):
        path = os.path.join(rec["dump"], fn)
        m = re.fullmatch(r"(.+)_\d+\.resources\.txt", fn)
        if m:
            with open(path) as f:
                b = re.search(r"smem_scratch_bytes=(\d+)", f.read())
            if b:
                smem[f"{m.group(1)}_mosaic_gpu_kernel"] = int(b.group(1))
        elif fn.endswith(".ptxas"):
            # The plugin's own ``ptxas -v`` of the cubin it built (its ptxas may be newer
            # than ``find_ptxas``'s: Mosaic emits the newest PTX ISA it knows).
            with open(path) as f:
                stats.update({k: v for k, v in parse_ptxas(f.read()).items() if k in entries})
    launches = []
    threads = MOSAIC_THREADS[rec["id"].split()[0]]
    for call in rec["calls"]:
        name = call["name"]
        if name not in stats:
            errors.append(f"the Mosaic GPU plugin dumped no ptxas report for {name}")
        if name not in smem:
            errors.append(f"the Mosaic GPU plugin wrote no resources (dynamic SMEM) for {name}")
            stats.pop(name, None)
        launches.append(dict(name=name, grid=tuple(call["grid"]), threads=threads,
                             smem=smem.get(name)))
    return dict(launches=launches, stats=stats, errors=errors)


def _share_mosaic_modules(records: dict, compiled: dict) -> None:
    """Fill a Mosaic launch's missing ptxas numbers from an earlier case that compiled the
    same module (``module``, the hash the worker records per launch): the plugin compiles,
    and dumps, one module once per process."""
    seen = {}
    for rec in records.values():
        for call in rec.get("calls", ()) if rec["id"] in compiled else ():
            st = compiled[rec["id"]].get("stats", {}).get(call["name"])
            if call.get("module") and st is not None:
                seen.setdefault((call["name"], call["module"]), st)
    for rec in records.values():
        comp = compiled.get(rec["id"])
        if not rec.get("mosaic") or comp is None or "stats" not in comp:
            continue
        for call in rec["calls"]:
            st = seen.get((call["name"], call.get("module")))
            if call["name"] not in comp["stats"] and st is not None:
                comp["stats"][call["name"]] = st
                missing = f"the Mosaic GPU plugin dumped no ptxas report for {call['name']}"
                comp["errors"] = [e for e in comp["errors"] if e != missing]


def compile_cases(cases: list[Case], targets: Iterable[str] = ("sm_80", "sm_90"), *,
                  dump_dir: str | None = None, timeout: float = 1800.0,
                  config: dict | None = None, log=None) -> list[Report]:
    """Compile ``cases`` for each target (one worker process per target, run one after
    the other: the compile is CPU-bound) and return one ``Report`` per Triton launch.
    ``dump_dir`` keeps XLA's dumps (HLO, PTX, thunks); ``config`` overrides fields of the
    GLM-5.3-Flash preset, or is ``{"preset": name}``: another model's shapes. Raises ``ToolchainMissing`` without the ``gpu-compile`` extra."""
    info = toolchain()
    names = list(targets)
    for n in names:
        if n not in TARGETS:
            raise ValueError(f"unknown target {n!r}; known: {sorted(TARGETS)}")
    ids = [c.id for c in cases]
    if len(set(ids)) != len(ids):
        raise ValueError("cases must be distinct")
    root = dump_dir or tempfile.mkdtemp(prefix="glm5_gpu_compile_")
    reports: list[Report] = []
    try:
        for n in names:
            t0 = time.time()
            target_dump = os.path.join(root, n)
            os.makedirs(target_dump, exist_ok=True)
            on_target = [c for c in cases
                         if mosaic_on_target(c.kernel, TARGETS[n].compute_capability)]
            if log:
                log(f"{n}: compiling {len(on_target)} cases in a worker process ...")
            records = _run_worker(TARGETS[n], on_target, target_dump, timeout, config or {})
            compiled = {}
            for rec in records.values():
                if rec.get("mosaic") and rec.get("dump") and os.path.isdir(rec["dump"]):
                    compiled[rec["id"]] = _mosaic_compiled(rec)
                elif rec.get("dump") and os.path.isdir(rec["dump"]):
                    # The Triton launches: thunks named after a Triton call of the lowered
                    # module (XLA may add "_1"...; its own fusions are kCustomKernel on 0.12).
                    triton = {c["name"] for c in rec["calls"]}
                    launches = []
                    for fn in sorted(os.listdir(rec["dump"])):
                        if fn.endswith(".thunk_sequence.txt"):
                            with open(os.path.join(rec["dump"], fn)) as f:
                                launches += [t for t in parse_thunks(f.read())
                                             if re.sub(r"(_\d+)+$", "", t["name"]) in triton
                                             or t["name"] in triton]
                    launches = list({t["name"]: t for t in launches}.values())
                    stats, errors = ptxas_stats(info["ptxas"], rec["dump"],
                                                 {t["name"] for t in launches})
                    compiled[rec["id"]] = dict(launches=launches, stats=stats, errors=errors)
                elif not rec.get("ok"):
                    compiled[rec["id"]] = dict(launches=[], error=rec.get("error"))
            _share_mosaic_modules(records, compiled)
            for c in on_target:
                rec = records[c.id]
                if rec.get("same_inputs_as"):  # traced once: same inputs as an earlier case
                    first = records[rec["same_inputs_as"]]
                    rec = dict(first, id=c.id, same_as=first.get("same_as") or first["id"])
                reports += analyse(TARGETS[n], rec, compiled, info["ptxas"])
            if log:
                log(f"{n}: {len(cases)} cases in {time.time() - t0:.0f} s")
    finally:
        if dump_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return reports
