"""Argument types shared by the ``glm5-dsa`` subcommands.

Every numeric flag is parsed by one of these validating types, so a bad value (``0``
iterations, a negative size) is an argparse usage error, exit status 2, before any work
starts, never a traceback or a negative figure printed with status 0.
"""

from __future__ import annotations

import argparse


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


def positive_float(s: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v
