"""``glm5-dsa gpu-compile``: compile every Pallas kernel for NVIDIA GPUs on a host without
one and print registers, spills, stack, shared memory and blocks per SM per launch.

How the compile works and when a kernel passes is ``glm5_dsa_jax.tools.gpu_compile``; this module
parses the flags, runs ``compile_cases`` and prints its table. Exit status 0: every kernel
passed; 1: one failed; 2: a bad flag value or a setup error, checked in this order before
any compile: the flags (an unknown target is told before a missing extra), then jax's
version for the Mosaic GPU kernels, then the toolchain (the ``gpu-compile`` extra). ``python -m glm5_dsa_jax.tools.gpu_compile`` is the same command (its ``__main__``); the
compile worker process that ``compile_cases`` starts runs through it too, with the hidden
``--worker TARGET`` flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax

from glm5_dsa_jax.cli.args import UsageError, check_context
from glm5_dsa_jax.model.config import PRESETS, DsaConfig
from glm5_dsa_jax.tools.gpu_compile import (
    TARGETS, compile_cases, default_cases, failures, format_table, toolchain,
)
from glm5_dsa_jax.tools.gpu_compile.cases import (
    BATCHES, CACHES, CONTEXTS, DTYPES, INDEX_KEYS, KERNELS, MOSAIC_KERNELS, STEPS,
)
from glm5_dsa_jax.tools.gpu_compile.worker import run_worker
from pallas_kernels import MOSAIC_MIN_JAX, jax_version


def add_parser(sub) -> None:
    """``glm5-dsa gpu-compile``: compile every Pallas kernel at the GLM-5.3-Flash shapes (or
    --preset's) for NVIDIA GPUs without a GPU, and print registers, spills, stack, shared
    memory and blocks per SM per launch. Needs the gpu-compile extra (pip install -e
    '.[gpu-compile]'); the Mosaic GPU kernels need jax >= 0.11. Each target compiles in its
    own worker process (about a minute for the defaults; a line per target as it starts).
    Exit status 0: every kernel passed; 1: one failed; 2: a bad flag or a setup error (the
    extra missing, jax too old), checked before any compile."""
    p = sub.add_parser("gpu-compile", help="compile every kernel for sm_80 / sm_90 without a GPU",
                       description=add_parser.__doc__)
    add_arguments(p)
    p.set_defaults(func=main, prog=p.prog)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``gpu-compile`` flags on ``p``."""
    mosaic = ".".join(map(str, MOSAIC_MIN_JAX))
    p.add_argument("--targets", default="sm_80,sm_90",
                   help=f"comma-separated GPU targets, of {', '.join(TARGETS)}")
    p.add_argument("--kernels", default=None,
                   help=f"comma-separated kernels, of {', '.join(KERNELS)} and the Mosaic GPU ones "
                        f"{', '.join(MOSAIC_KERNELS)} (jax >= {mosaic}) (default: every kernel, the "
                        f"Mosaic GPU ones too on jax >= {mosaic})")
    p.add_argument("--mosaic", action="store_true",
                   help=f"the Mosaic GPU kernels only (jax >= {mosaic}; sm_90 and newer)")
    p.add_argument("--contexts", default=None,
                   help="comma-separated cache lengths in tokens, at most the preset's "
                        "max_position_embeddings (default: "
                        f"{','.join(map(str, CONTEXTS))}, the larger ones cut to the preset's maximum)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated steps, of {', '.join(STEPS)}")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="bfloat16 (the serving dtype), float32, or both")
    p.add_argument("--caches", default=",".join(CACHES),
                   help="contiguous,paged (paged: the kernels the paged cache changes)")
    p.add_argument("--index-keys", default=",".join(INDEX_KEYS),
                   help="float (pooled indexer keys in the step's dtype), int8 (an fp8 cache's int8 keys "
                        "with group scales: the scoring kernel only), or both")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="the model's shapes (DsaConfig.preset) (default: glm53-flash)")
    p.add_argument("--compact", action="store_true", help="merge cases with equal numbers")
    p.add_argument("--json", help="write every report to this file (default: none)")
    p.add_argument("--dump-dir", help="keep XLA's dumps (HLO, PTX, thunk sequence) here (default: a "
                                      "temporary directory, removed)")
    p.add_argument("--worker", help=argparse.SUPPRESS)


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in _split(s)]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {s!r}") from None


def cases_of(args) -> tuple[list, list[str]]:
    """The cases and targets the flags ask for; ``UsageError`` for an unknown target or
    kernel, a context beyond the preset, a Mosaic GPU kernel on a jax older than
    ``MOSAIC_MIN_JAX``, or a bad list. Reads no toolchain: flags are judged first."""
    targets = _split(args.targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise UsageError(f"--targets: unknown target(s) {unknown or [args.targets]}; known: {', '.join(TARGETS)}")
    new_jax = jax_version() >= MOSAIC_MIN_JAX
    if args.mosaic and args.kernels:
        raise UsageError("--mosaic and --kernels: give one (--mosaic is every Mosaic GPU kernel)")
    kernels = (list(MOSAIC_KERNELS) if args.mosaic else _split(args.kernels) if args.kernels
               else list(KERNELS) + (list(MOSAIC_KERNELS) if new_jax else []))
    mosaic = [k for k in kernels if k in MOSAIC_KERNELS]
    if mosaic and not new_jax:
        raise UsageError(
            f"the Mosaic GPU kernels ({', '.join(mosaic)}) need jax >= "
            f"{'.'.join(map(str, MOSAIC_MIN_JAX))}; this is jax {jax.__version__} (its Triton "
            "kernels compile without --mosaic)")
    cfg = DsaConfig.preset(args.preset or "glm53-flash")
    if args.contexts is None:
        contexts = sorted({min(c, cfg.max_position_embeddings) for c in CONTEXTS})
    else:
        contexts = _ints(args.contexts, "--contexts")
        for c in contexts:
            check_context(c, cfg, flag="--contexts")
    try:
        cases = default_cases(kernels, contexts=contexts, batches=_ints(args.batches, "--batches"),
                              steps=_split(args.steps), dtypes=_split(args.dtypes),
                              caches=_split(args.caches), index_keys=_split(args.index_keys))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cases, targets


def main(args) -> int:
    if args.worker:
        return run_worker(args.worker, args.dump_dir)
    cases, targets = cases_of(args)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"--json {args.json}: its directory does not exist")
    try:
        info = toolchain()
    except RuntimeError as e:  # ToolchainMissing, or a plugin of another jaxlib
        raise UsageError(str(e)) from None
    print(f"jax {info['jax']}, jaxlib {info['jaxlib']}, jax-cuda12-plugin "
          f"{info['jax-cuda12-plugin']}, ptxas {info['ptxas_version']}; {len(cases)} cases for "
          f"{', '.join(targets)}", flush=True)
    t0 = time.time()
    try:
        reports = compile_cases(cases, targets, dump_dir=args.dump_dir,
                                config={"preset": args.preset} if args.preset else None,
                                log=lambda m: print(m, flush=True))
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
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
