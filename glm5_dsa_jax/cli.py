"""``glm5-dsa``: the command line. Each subcommand lives with the code it drives.

Every numeric flag is parsed by one of the validating types below, so a bad value (``0``
iterations, a negative size) is an argparse usage error, exit status 2, before any work
starts, never a traceback or a negative figure printed with status 0.
"""

from __future__ import annotations

import argparse
import sys


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1."""
    v = _int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {v}")
    return v


def nonnegative_int(s: str) -> int:
    """argparse type: an integer >= 0."""
    v = _int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer (>= 0), got {v}")
    return v


def positive_int_list(s: str) -> list[int]:
    """argparse type: comma-separated integers, each >= 1, at least one."""
    vals = [positive_int(v.strip()) for v in s.split(",") if v.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {s!r}")
    return vals


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
