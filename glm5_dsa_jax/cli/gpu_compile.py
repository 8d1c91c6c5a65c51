"""``glm5-dsa gpu-compile``: compile every Pallas kernel for NVIDIA GPUs on a host without
one and print registers, spills, stack, shared memory and blocks per SM per launch.

How the compile works and when a kernel passes is ``glm5_dsa_jax.tools.gpu_compile``; this module
parses the flags, runs ``compile_cases`` and prints its table. Exit status 0: every kernel
passed; 1: one failed; 2: a setup error (a bad flag value, the ``gpu-compile`` extra
missing). ``python -m glm5_dsa_jax.tools.gpu_compile`` is the same command (its ``__main__``); the
compile worker process that ``compile_cases`` starts runs through it too, with the hidden
``--worker TARGET`` flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from glm5_dsa_jax.tools.gpu_compile import compile_cases, default_cases, failures, format_table, toolchain
from glm5_dsa_jax.tools.gpu_compile.cases import (
    BATCHES, CACHES, CONTEXTS, DTYPES, KERNELS, MOSAIC_KERNELS, STEPS,
)
from glm5_dsa_jax.tools.gpu_compile.worker import run_worker
from pallas_kernels import MOSAIC_MIN_JAX, jax_version


def add_parser(sub) -> None:
    """``glm5-dsa gpu-compile``: compile every Pallas kernel at the GLM-5.3-Flash shapes for
    sm_80 and sm_90 without a GPU; print registers, spills, stack, shared memory and blocks
    per SM. Exit 0: all ok; 1: a kernel failed; 2: setup error."""
    p = sub.add_parser("gpu-compile", help="compile every kernel for sm_80 / sm_90 without a GPU",
                       description=add_parser.__doc__)
    add_arguments(p)
    p.set_defaults(func=main)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default="sm_80,sm_90", help="comma list (default sm_80,sm_90)")
    kernels = list(KERNELS) + (list(MOSAIC_KERNELS) if jax_version() >= MOSAIC_MIN_JAX else [])
    p.add_argument("--kernels", default=",".join(kernels),
                   help="comma list (default: all; the Mosaic GPU ones on jax >= 0.11)")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                   help="cache lengths in tokens (default 4096,131072,1048576)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="default 1,8")
    p.add_argument("--steps", default=",".join(STEPS), help="decode,prefill,prompt (default all)")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="bfloat16 (default; the serving dtype), float32, or both")
    p.add_argument("--caches", default=",".join(CACHES),
                   help="contiguous,paged (default both; paged: the kernels the paged cache changes)")
    p.add_argument("--preset", help="the model's shapes (DsaConfig.preset; default glm53-flash)")
    p.add_argument("--compact", action="store_true", help="merge cases with equal numbers")
    p.add_argument("--json", help="write every report here")
    p.add_argument("--dump-dir", help="keep XLA's dumps (HLO, PTX, thunk sequence) here")
    p.add_argument("--worker", help=argparse.SUPPRESS)


def main(args) -> int:
    if args.worker:
        return run_worker(args.worker, args.dump_dir)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    try:
        cases = default_cases(split(args.kernels), contexts=[int(x) for x in split(args.contexts)],
                              batches=[int(x) for x in split(args.batches)],
                              steps=split(args.steps), dtypes=split(args.dtypes),
                              caches=split(args.caches))
        info = toolchain()
        print(f"jax {info['jax']}, jaxlib {info['jaxlib']}, jax-cuda12-plugin "
              f"{info['jax-cuda12-plugin']}, ptxas {info['ptxas_version']}", flush=True)
        t0 = time.time()
        reports = compile_cases(cases, split(args.targets), dump_dir=args.dump_dir,
                                config={"preset": args.preset} if args.preset else None,
                                log=lambda m: print(m, flush=True))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(reports, compact=args.compact))
    bad = [r for r in reports if not r.ok]
    if bad:
        print("\n" + failures(reports))
    print(f"\n{len(reports)} launches, {len(bad)} failed; {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(toolchain=info, reports=[dict(dataclasses.asdict(r), ok=r.ok)
                                                    for r in reports]), f, indent=1)
    return 1 if bad else 0
