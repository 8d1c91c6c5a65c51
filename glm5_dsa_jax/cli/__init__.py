"""``glm5-dsa``: the command line, one module of this package per subcommand.

Each subcommand module registers its parser and holds its ``main(args)``; the work itself
lives in the library (``glm5_dsa_jax.tools``: ``demo``, ``bench``, ``roofline``,
``memory_plan``, ``cache_accuracy``, ``gpu_compile``, ``indexer_training``; ``glm5_dsa_jax.plan``,
``glm5_dsa_jax.checkpoint``). Invariants:

* ``glm5-dsa CMD --help`` is the reference of every command: each flag's help ends with its
  default (``args.HelpFormatter``).
* Bad input never ends in a traceback: a bad flag value is an argparse usage error, a value
  wrong against the preset or the host, a missing extra or a jax too old is a
  ``UsageError`` raised by the command's checks before any work, printed as one line
  ``glm5-dsa CMD: error: ...`` on stderr; both exit with status 2.
* Before any work, ``host.pin_cpu_without_gpu`` pins jax to the CPU on a host without a GPU
  (so an installed CUDA plugin prints no traceback; see ``glm5_dsa_jax.cli.host``).
"""

from __future__ import annotations

import argparse
import sys

from glm5_dsa_jax.cli import accuracy, bench, convert, demo, gpu_compile, host, plan, roofline, train
from glm5_dsa_jax.cli.args import Parser, UsageError

DESCRIPTION = """\
DeepSeek Sparse Attention (DSA) of GLM-5.3-Flash in JAX, from the command line: run the
layer, measure it, plan its memory and convert checkpoints. Each command explains its flags:
glm5-dsa COMMAND --help.
"""

EPILOG = """\
examples:
  glm5-dsa demo                                 tiny layer, random weights, CPU, seconds
  glm5-dsa plan --tp 8 --context 131072         shard plan and memory per device
  glm5-dsa roofline --gpu h200 --context 131072 bytes, FLOPs and bound time per kernel
  glm5-dsa bench decode --preset tiny --contexts 256,1024
  glm5-dsa plan --cp 8 --context 1048576        a sequence's cache split over 8 devices
  glm5-dsa train-indexer --out run1             train the tiny layer's indexer, about a minute

environment: on a host without a GPU (no /dev/nvidia<N>, no nvidia-smi) the command pins
jax to the CPU unless JAX_PLATFORMS is set, so an installed CUDA plugin prints no "Unable to
load CUDA" traceback (elsewhere: set JAX_PLATFORMS=cpu before importing jax). A command
that needs N devices (convert --tp N, bench decode --cp N) makes N virtual CPU devices itself on such a host,
as XLA_FLAGS=--xla_force_host_platform_device_count=N would.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``glm5-dsa`` parser with every subcommand."""
    parser = Parser(prog="glm5-dsa", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for module in (demo, bench, plan, convert, roofline, accuracy, gpu_compile, train):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``glm5-dsa`` with ``argv`` (default: the process's arguments); returns the exit
    status: 0 done, 1 the work failed (a kernel, a checkpoint), 2 a usage or setup error."""
    host.pin_cpu_without_gpu()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"{args.prog}: error: {e}", file=sys.stderr)
        return 2
