"""The compile worker of ``glm5_dsa_jax.tools.gpu_compile``: one process per target.

``compile_cases`` runs ``python -m glm5_dsa_jax.tools.gpu_compile --worker TARGET --dump-dir DIR``
(the ``glm5-dsa gpu-compile`` command's hidden flag) with the cases as JSON on stdin; the
worker prints one JSON line per case (after a ``ready`` line). Invariants:

* Its own process: XLA aborts the process on some fatal errors, and the caller (pytest)
  must survive to report them; the caller's jax setup (8 virtual CPU devices) stays out of it.
* The kernel's wrapper is traced with the compile-only CUDA device as the default device
  (jax >= 0.11's Pallas reads the compute capability from it; 0.10 assumes 9.0, which only
  affects fp8 casts, unused here).
* XLA compiles every case: jax's persistent compilation cache is off in the worker (a
  ``JAX_COMPILATION_CACHE_DIR`` the caller set, e.g. the test run's, would otherwise load
  an executable without compiling it, and the PTX and thunk dumps read here would be
  missing).
* Work is shared, never skipped: cases whose wrapper inputs are identical are traced once
  (``same_inputs_as``), cases whose Triton kernels (IR bytes, warps, stages) are identical
  are compiled once (``same_as``). A kernel's registers and shared memory depend only on
  its IR and the target, not on the grid.
* A Mosaic GPU case (``MOSAIC_KERNELS``) has no Triton launch: its lowered module holds a
  ``mosaic_gpu_v2`` custom call whose MLIR module the CUDA plugin compiles during
  ``.compile()`` (Mosaic's passes -> PTX -> ptxas -> cubin, on the compile-only device: no
  driver needed). The plugin dumps the PTX where ``MOSAIC_GPU_DUMP_TO`` says, read per
  compile, and the kernel's resources (its dynamic SMEM) at lowering, so both env vars are
  set per case before tracing. Same-module cases (hash of the custom call's module) compile
  once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time

import jax
from jax.experimental import topologies

from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.tools.gpu_compile.cases import MOSAIC_KERNELS, MOSAIC_LAUNCHES, Case, Step, build
from glm5_dsa_jax.tools.gpu_compile.targets import TARGETS
from pallas_kernels import triton_calls

__all__ = ["run_worker"]

_IR_RE = re.compile(r'\bir = "((?:\\.|[^"\\])*)"')
_MOSAIC_RE = re.compile(r'stablehlo\.custom_call @mosaic_gpu\w*\(.*?\bmodule = "((?:\\.|[^"\\])*)"')


def _mosaic_signature(cfg, lowered, case: Case) -> tuple:
    """(calls, signature) of a Mosaic GPU case: its launches (PTX entry and grid, from
    ``MOSAIC_LAUNCHES``) and a hash of every Mosaic custom call's module."""
    texts = [m.group(1) for m in _MOSAIC_RE.finditer(lowered.as_text())]
    mods = [hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts]
    launches = MOSAIC_LAUNCHES[case.kernel](cfg, case.step, dict(case.blocks))
    # Each launch's module (its kernel name is in the module's text): a case of several
    # launches may share a module with an earlier case, which the plugin then does not
    # compile (nor dump) again; its numbers are that earlier case's (``module``).
    calls = [dict(name=f"{name}_mosaic_gpu_kernel", grid=grid,
                  module=next((h for t, h in zip(texts, mods) if name in t), None))
             for name, grid in launches.items()]
    return (calls if mods else []), (case.kernel, tuple(sorted(set(mods))))


def _triton_signature(lowered) -> tuple:
    """What identifies the compiled Triton kernels of a lowered module: per launch its name,
    a hash of its IR bytes, warps and stages."""
    text = lowered.as_text()
    irs = [hashlib.sha256(m.group(1).encode()).hexdigest()[:16]
           for line in text.splitlines() if "__gpu$xla.gpu.triton" in line
           for m in [_IR_RE.search(line)] if m]
    calls = triton_calls(text)
    return calls, tuple(sorted((c["name"], ir, c["num_warps"], c["num_stages"])
                               for c, ir in zip(calls, irs)))


def run_worker(target_name: str, dump_root: str) -> int:
    """Compile the cases read from stdin for one target; one JSON line per case."""
    spec = json.load(sys.stdin)
    config = dict(spec.get("config", {}))
    preset = config.pop("preset", None)  # a supported model's shapes (see cases' doc)
    if preset and config:
        raise ValueError(f"config: a preset ({preset!r}) takes no overrides, got {sorted(config)}")
    cfg = DsaConfig.preset(preset) if preset else DsaConfig.glm53_flash(**config)
    jax.config.update("jax_enable_compilation_cache", False)  # see the module doc
    target = TARGETS[target_name]
    topo = topologies.get_topology_desc(
        f"glm5_dsa_{target.name}", "cuda", target_config=target.target_config(), topology="1x1x1")
    device = topo.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    print(json.dumps({"event": "ready", "device": str(device)}), flush=True)
    traced_as: dict = {}  # input key -> case id
    compiled_as: dict = {}  # Triton signature -> case id
    for item in spec["cases"]:
        case = Case(item["kernel"], Step(**item["step"]), tuple(map(tuple, item.get("blocks", ()))))
        rec = {"event": "case", "id": case.id, "ok": False, "stage": "trace", "error": None,
               "calls": [], "same_as": None, "dump": None}
        t0 = time.time()
        try:
            fn, avals, key = build(cfg, case)
            if key in traced_as:
                rec.update(ok=True, stage="done", same_inputs_as=traced_as[key])
                print(json.dumps(rec), flush=True)
                continue
            traced_as[key] = case.id
            avals = [jax.ShapeDtypeStruct(sh, dt, sharding=sharding) for sh, dt in avals]
            mosaic = case.kernel in MOSAIC_KERNELS
            dump = os.path.join(dump_root, re.sub(r"[^\w.-]+", "_", case.id))
            if mosaic:  # see the module doc: set before tracing (resources) and compiling (PTX)
                os.makedirs(dump, exist_ok=True)
                os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_RESOURCES="1",
                                  MOSAIC_GPU_DUMP_TO=dump)
            with jax.default_device(device):
                lowered = jax.jit(fn).trace(*avals).lower()
            rec["stage"] = "compile"
            calls, sig = _mosaic_signature(cfg, lowered, case) if mosaic else _triton_signature(lowered)
            rec["calls"], rec["mosaic"] = calls, mosaic
            if not calls:
                raise RuntimeError(
                    f"the lowered module has no {'Mosaic GPU' if mosaic else 'Triton'} kernel launch")
            if sig in compiled_as:
                rec["same_as"] = compiled_as[sig]
            else:
                rec["dump"] = dump
                lowered.compile(compiler_options={
                    "xla_dump_to": dump,
                    # jax >= 0.11 dumps Triton's PTX only when its emitter is named ("ptx":
                    # only the PTX, not the per-pass IR that ".*" also writes).
                    "xla_dump_emitter_re": "ptx",
                    "xla_gpu_force_compilation_parallelism": 1,
                })
                compiled_as[sig] = case.id
            rec.update(ok=True, stage="done")
        except Exception as e:  # noqa: BLE001 - every failure is reported, the rest go on
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["seconds"] = round(time.time() - t0, 2)
        print(json.dumps(rec), flush=True)
    return 0
