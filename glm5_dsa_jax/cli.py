"""``glm5-dsa``: the command line. Each subcommand lives with the code it drives."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="glm5-dsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from glm5_dsa_jax import bench, checkpoint, demo, roofline, sharding

    for module in (demo, bench, sharding, checkpoint, roofline):
        module.add_parser(sub)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
