"""What the kernel wrappers share: the ``Implementation`` type, argument and block-size checks,
and the CUDA lowering helpers the tests and ``glm5_dsa_jax.gpu_compile`` use.

Every wrapper takes ``implementation`` (an ``Implementation``):

* ``"xla"``: the plain-jnp reference in the same file (any device);
* ``"pallas"``: the Pallas kernel, Triton backend (NVIDIA Ampere and newer);
* ``"pallas_interpret"``: the same kernel in Pallas interpret mode (any device; how the
  tests run it on a CPU).

and ``block_sizes``, an instance of the kernel's frozen block-size dataclass (``None``: its
defaults). Invariants:

* Checks run at trace time, before any launch, and raise ``ValueError`` naming the field (or
  argument), the limit and the value.
* Block sizes are validated under **every** implementation, ``"xla"`` included: a bad block
  size is an error whatever runs, so a CPU test run catches what a GPU run would refuse.
* A wrapper's Pallas path (``"pallas"``, ``"pallas_interpret"``) is ``eager_jit``: called
  outside any trace it runs as one ``jax.jit`` program, compiled once per shapes and static
  arguments. Why: a ``pallas_call`` bound eagerly traces its kernel anew on every call, and
  jax's compile cache keys the program by that (new) kernel jaxpr, so an eager decode step
  compiled every kernel on every step. Under a trace the path is inlined as before.
"""

from __future__ import annotations

import functools
import typing
from typing import Callable, Literal

import jax

Implementation = Literal["xla", "pallas", "pallas_interpret"]
IMPLEMENTATIONS: tuple[Implementation, ...] = typing.get_args(Implementation)


def check_implementation(implementation: str) -> Implementation:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    return implementation


_B = typing.TypeVar("_B")


def eager_jit(*static_argnames: str) -> Callable[[Callable], Callable]:
    """Decorator: the function, run through one ``jax.jit`` (``static_argnames`` static,
    every other argument a pytree of arrays or ``None``) when no argument is a tracer, and
    called as is (inlined into the caller's trace) when one is.

    For a wrapper's Pallas path (see the module doc): eager calls of the same shapes and
    statics then reuse one compiled program, while a jitted caller's program is what it was
    without the decorator."""

    def wrap(fn: Callable) -> Callable:
        jitted = jax.jit(fn, static_argnames=static_argnames)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            leaves = jax.tree.leaves((args, {k: v for k, v in kwargs.items() if k not in static_argnames}))
            if any(isinstance(a, jax.core.Tracer) for a in leaves):
                return fn(*args, **kwargs)
            return jitted(*args, **kwargs)

        return call

    return wrap


def check_block_sizes(block_sizes: _B | None, cls: type[_B]) -> _B:
    """``block_sizes`` validated (``cls()``, the defaults, when ``None``); a ``TypeError`` for
    anything but an instance of ``cls``, the kernel's block-size dataclass."""
    if block_sizes is None:
        block_sizes = cls()
    elif not isinstance(block_sizes, cls):
        raise TypeError(
            f"block_sizes must be a {cls.__name__} (or None for its defaults), "
            f"got {type(block_sizes).__name__}"
        )
    return block_sizes.validate()


def check_positive_int(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def check_triton_params(owner: str, num_warps: int, num_stages: int) -> None:
    """``num_warps`` a power of two, ``num_stages`` an int >= 1 (Triton's launch parameters)."""
    check_power_of_two(f"{owner}.num_warps", num_warps)
    check_positive_int(f"{owner}.num_stages", num_stages)


def check_power_of_two(name: str, value: int, *, minimum: int = 1) -> int:
    """Triton blocks must be powers of two; ``dot`` operands at least 16 wide."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or value & (value - 1):
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


# GPU kinds whose compute capability jax's Pallas lowering reads from an abstract device.
CUDA_DEVICE_KINDS = {"a100": "NVIDIA A100-SXM4-80GB", "h100": "NVIDIA H100", "h200": "NVIDIA H200"}


def cuda_lowering(gpu: str = "h100"):
    """A context in which ``jit(...).lower(lowering_platforms=("cuda",))`` works on a host
    without a GPU.

    Pallas' GPU lowering needs a compute capability. jax 0.10 assumed 9.0 when no GPU was
    present; jax >= 0.11 reads it from the device of the current mesh and, with none, raises
    "No supported GPU devices found". An abstract mesh of one abstract CUDA device supplies
    it (the API exists from 0.10.2 on). Its axis is ``Auto``: the layer's cache updates fail
    jax's sharding-in-types check under the default (Explicit) axis type.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    kind = CUDA_DEVICE_KINDS.get(gpu.lower())
    if kind is None:
        raise ValueError(f"gpu must be one of {sorted(CUDA_DEVICE_KINDS)}, got {gpu!r}")
    device = AbstractDevice(device_kind=kind, num_cores=None, platform="cuda")
    mesh = AbstractMesh((1,), ("cuda",), axis_types=(AxisType.Auto,), abstract_device=device)
    return use_abstract_mesh(mesh)


def lower_for_cuda(fn, *avals, gpu: str = "h100"):
    """``jax.jit(fn)`` traced on ``avals`` and lowered for CUDA without a GPU (see
    ``cuda_lowering``); returns the ``Lowered`` object."""
    import jax

    with cuda_lowering(gpu):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))


def triton_calls(lowered) -> list[dict]:
    """The Triton kernel launches in a module lowered for CUDA, in program order: for each,
    its ``name``, ``grid`` ``(x, y, z)``, ``num_warps`` and ``num_stages`` (read from the
    ``__gpu$xla.gpu.triton`` custom calls' backend config)."""
    import re

    calls = []
    text = lowered.as_text() if hasattr(lowered, "as_text") else str(lowered)
    for line in text.splitlines():
        if "__gpu$xla.gpu.triton" not in line:
            continue
        line = re.sub(r'ir = "(?:\\.|[^"\\])*"', "ir = ...", line)  # the kernel's bytecode
        field = lambda key: int(re.search(rf"\b{key} = (\d+)", line).group(1))
        calls.append(dict(
            name=re.search(r'\bname = "([^"]*)"', line).group(1),
            grid=(field("grid_x"), field("grid_y"), field("grid_z")),
            num_warps=field("num_warps"), num_stages=field("num_stages"),
        ))
    return calls
