"""``glm5-dsa``: the command line, one module of this package per subcommand.

Each subcommand module holds its argparse parser (``add_parser``) and its ``main(args)``;
the work itself lives in the library (``demo``, ``bench``, ``roofline``, ``plan``,
``checkpoint``). Numeric flags use the validating types of ``cli.args``.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="glm5-dsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from glm5_dsa_jax import bench, demo, roofline, sharding
    from glm5_dsa_jax.cli import convert

    for module in (demo, bench, sharding, convert, roofline):
        module.add_parser(sub)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)

