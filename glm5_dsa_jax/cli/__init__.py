"""``glm5-dsa``: the command line, one module of this package per subcommand.

Each subcommand module holds its argparse parser (``add_parser``) and its ``main(args)``;
the work itself lives in the library (``demo``, ``bench``, ``roofline``, ``plan`` /
``memory_plan``, ``checkpoint``, ``cache_accuracy``, ``gpu_compile``). Numeric flags use the validating types of ``cli.args``.
"""

from __future__ import annotations

import argparse

from glm5_dsa_jax.cli import accuracy, bench, convert, demo, gpu_compile, plan, roofline


def build_parser() -> argparse.ArgumentParser:
    """The ``glm5-dsa`` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="glm5-dsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (demo, bench, plan, convert, roofline, accuracy, gpu_compile):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
