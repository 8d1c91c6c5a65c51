"""``glm5-dsa convert HF_DIR OUT_DIR [--tp N]``: a HF checkpoint's DSA layers (any model type
of ``config.MODEL_TYPES``: glm5_next, glm_moe_dsa, deepseek_v32) to an orbax checkpoint.

The work is ``checkpoint.load_hf_checkpoint`` then ``checkpoint.save_checkpoint``; this module
is the argparse parser and the exit statuses: 0 done, 1 a checkpoint problem (every problem
printed, nothing written; an existing OUT_DIR is left as it was), 2 a usage error, checked
before anything is read: HF_DIR not a directory, OUT_DIR a file or a non-empty directory
without ``--overwrite``, ``--tp`` beyond this host's devices (on a CPU-only host the command
makes ``--tp`` virtual devices itself: ``cli.host.need_devices``).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_dsa_jax.checkpoint import CheckpointError, load_hf_checkpoint, save_checkpoint
from glm5_dsa_jax.cli.args import UsageError, positive_int
from glm5_dsa_jax.cli.host import need_devices
from glm5_dsa_jax.model.config import MODEL_TYPES


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {s!r}") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices >= 0, got {s!r}")
    return vals


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``convert`` on the ``glm5-dsa`` subparsers."""
    types = ", ".join(MODEL_TYPES)
    p = subparsers.add_parser(
        "convert", help=f"convert a HF checkpoint's DSA layers ({types}) to an orbax checkpoint",
        description=f"Read the DSA layers of a Hugging Face safetensors checkpoint whose "
        f"config.json model_type is one of {types} (dequantizing NVFP4/fp8 weights), place them "
        "on a tensor-parallel mesh of --tp devices and save them as an orbax checkpoint that "
        "'glm5-dsa demo --checkpoint' and glm5_dsa_jax.checkpoint.restore_checkpoint read. "
        "OUT_DIR and --tp are checked before anything is read (exit 2); a checkpoint problem "
        "exits 1 with every problem named and nothing written.",
    )
    p.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("out_dir", help="output directory for the orbax checkpoint: absent or empty, or "
                                   "a checkpoint with --overwrite")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel devices to load onto (a CPU-only host makes them itself)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="parameter and compute dtype")
    p.add_argument("--layers", type=_int_list, default=None,
                   help="DSA layer indices, e.g. 3,7 (default: every DSA layer)")
    p.add_argument("--axis", default="tp", help="mesh axis name of tensor parallelism")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint at OUT_DIR (written beside it, then swapped in: "
                   "an interrupted convert leaves the old one intact)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main, prog=p.prog)
    return p


def check(args) -> list:
    """``UsageError`` for what the command cannot run with, before anything is read; returns
    the ``--tp`` devices."""
    if not os.path.isdir(args.hf_dir):
        raise UsageError(f"HF_DIR {args.hf_dir!r} is not a directory")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UsageError(f"OUT_DIR {args.out_dir!r} exists and is not a directory")
    if os.path.isdir(args.out_dir) and os.listdir(args.out_dir) and not args.overwrite:
        raise UsageError(f"OUT_DIR {args.out_dir!r} exists and is not empty (pass --overwrite to "
                         "replace a checkpoint there)")
    return need_devices(args.tp, "--tp")


def main(args) -> int:
    """Run ``glm5-dsa convert`` with parsed ``args``; returns the exit status."""
    devices = check(args)
    mesh = None if args.tp == 1 else jax.make_mesh((args.tp,), (args.axis,), devices=devices)
    dt = jnp.dtype(args.dtype)
    try:
        layers = load_hf_checkpoint(args.hf_dir, mesh=mesh, layers=args.layers, dtype=dt,
                                    axis=args.axis, progress=not args.no_progress)
        out = save_checkpoint(layers, args.out_dir, overwrite=args.overwrite)
    except FileExistsError as e:
        msg = str(e).replace("pass overwrite=True", "pass --overwrite").replace("overwrite replaces", "--overwrite replaces")
        print(f"glm5-dsa convert: {msg}", file=sys.stderr)
        return 1
    except (CheckpointError, FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"glm5-dsa convert: {e}", file=sys.stderr)
        return 1
    n_bytes = sum(
        x.nbytes for l in layers.values() for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(l, nnx.Param)))
    )
    print(f"converted {len(layers)} DSA layer(s) {sorted(layers)} ({n_bytes / 2**20:.1f} MiB of "
          f"{dt.name} parameters, tp={args.tp}) to {out}")
    return 0
