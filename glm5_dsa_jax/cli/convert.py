"""``glm5-dsa convert HF_DIR OUT_DIR [--tp N]``: a HF ``glm5_next`` checkpoint's DSA layers to
an orbax checkpoint.

The work is ``checkpoint.load_hf_checkpoint`` then ``checkpoint.save_checkpoint``; this module
is the argparse parser and the exit statuses: 0 done, 1 a checkpoint problem (every problem
printed, nothing written; an existing OUT_DIR is left as it was), 2 a usage error (including
``--tp`` beyond this host's devices), checked before anything is read.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_dsa_jax.checkpoint import CheckpointError, load_hf_checkpoint, save_checkpoint


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {s!r}") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``convert`` on the ``glm5-dsa`` subparsers."""
    p = subparsers.add_parser(
        "convert", help="convert a HF glm5_next checkpoint's DSA layers to an orbax checkpoint",
        description="Read the DSA layers of a Hugging Face glm5_next safetensors checkpoint "
        "(dequantizing NVFP4/fp8 weights), place them on a tensor-parallel mesh of --tp devices "
        "and save them as an orbax checkpoint that 'glm5-dsa demo --checkpoint' and "
        "glm5_dsa_jax.checkpoint.restore_checkpoint read.",
    )
    p.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("out_dir", help="output directory for the orbax checkpoint")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices to load onto (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="parameter and compute dtype (default bfloat16)")
    p.add_argument("--layers", type=_int_list, default=None, help="DSA layer indices, e.g. 3,7 (default all)")
    p.add_argument("--axis", default="tp", help="mesh axis name of tensor parallelism (default tp)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint at OUT_DIR (written beside it, then swapped in: "
                   "an interrupted convert leaves the old one intact)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main, prog=p.prog)
    return p


def main(args) -> int:
    """Run ``glm5-dsa convert`` with parsed ``args``; returns the exit status."""
    devices = jax.devices()
    if args.tp < 1 or args.tp > len(devices):
        print(f"glm5-dsa convert: --tp {args.tp} needs between 1 and {len(devices)} devices "
              f"(this host has {len(devices)} {devices[0].platform} device(s); on CPU set "
              "XLA_FLAGS=--xla_force_host_platform_device_count=N)", file=sys.stderr)
        return 2
    mesh = None if args.tp == 1 else jax.make_mesh((args.tp,), (args.axis,), devices=devices[: args.tp])
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
