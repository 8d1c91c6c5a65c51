"""Shared argument checks for the kernel wrappers.

Every wrapper takes ``implementation``:

* ``"xla"``: the plain-jnp reference in the same file (any device);
* ``"pallas"``: the Pallas kernel, Triton backend (NVIDIA Ampere and newer);
* ``"pallas_interpret"``: the same kernel in Pallas interpret mode (any device; how the
  tests run it on a CPU).

Checks run at trace time, before any launch, and raise ``ValueError`` naming the limit and
the value.
"""

from __future__ import annotations

IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret")


def check_implementation(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    return implementation


def check_power_of_two(name: str, value: int, *, minimum: int = 1) -> int:
    """Triton blocks must be powers of two; ``dot`` operands at least 16 wide."""
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ValueError(
            f"{name} must be a power of two >= {minimum} (a Triton block constraint), got {value!r}"
        )
    return value


def next_power_of_two(n: int, minimum: int = 1) -> int:
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must be {layout} (rank {rank}), got shape {tuple(x.shape)}")
