"""What the kernel wrappers share: the ``Implementation`` type, argument and block-size checks,
and the CUDA lowering helpers the tests and ``glm5_dsa_jax.gpu_compile`` use.

Every wrapper takes ``implementation`` (an ``Implementation``):

* ``"xla"``: the plain-jnp reference in the same file (any device);
* ``"pallas"``: the Pallas kernel, Triton backend (NVIDIA Ampere and newer);
* ``"pallas_interpret"``: the same kernel in Pallas interpret mode (any device; how the
  tests run it on a CPU);
* ``"mosaic"``: the step's Mosaic GPU kernel (``pallas_kernels/mosaic_*.py``; NVIDIA Hopper
  and newer, jax >= 0.11). A step with no Mosaic kernel runs its Triton one instead
  (``without_mosaic``: ``"mosaic"`` -> ``"pallas"``), so that a whole layer can be asked
  for ``"mosaic"`` and get the Mosaic kernels that exist and Triton for the rest: the
  Triton backend runs on Hopper too, so the fallback is always runnable where Mosaic is.
* ``"mosaic_interpret"``: the Mosaic GPU kernel in its CPU interpret mode
  (``plmgpu.InterpretGPUParams``, jax >= 0.11; it simulates the warpgroup's threads, so it
  is slow: tests use small shapes); falls back to ``"pallas_interpret"`` like ``"mosaic"``;
* ``"auto"``: resolved when the wrapper is traced (``resolve_implementation``) from the
  device the program targets: on a CUDA device, ``"mosaic"`` where the step's Mosaic
  kernels (forward and backward) have run right on that class of GPU as their code stands
  (``pallas_kernels._hardware_runs``; a layer: every Mosaic kernel), else ``"pallas"``;
  anything else (CPU, TPU, ROCm) -> ``"xla"``. Why the record: interpret mode is not the
  hardware (the Mosaic top-k passed it and selected wrong tokens on an H200).

and ``block_sizes``, an instance of the kernel's frozen block-size dataclass (``None``: its
defaults). Invariants:

* Checks run at trace time, before any launch, and raise ``ValueError`` naming the field (or
  argument), the limit and the value. A Mosaic path on jax < 0.11 raises
  ``NotImplementedError`` naming the version (``require_mosaic_gpu``), after those checks.
* Block sizes are validated under **every** implementation, ``"xla"`` included: a bad block
  size is an error whatever runs, so a CPU test run catches what a GPU run would refuse.
* A wrapper's kernel paths (``"pallas"``, ``"mosaic"`` and their ``*_interpret`` forms) are
  ``eager_jit``: called outside any trace, one runs as one ``jax.jit`` program, compiled
  once per shapes and static arguments. Why: a ``pallas_call`` bound eagerly traces its
  kernel anew on every call, and jax's compile cache keys the program by that (new) kernel
  jaxpr, so an eager decode step compiled every kernel on every step. Under a trace the
  path is inlined as before.
* Importing this module settles jax's trace context: on jax >= 0.12 the Pallas fuser
  (``jax.experimental.pallas.fuser``) registers a config option that is part of every
  trace's cache key, and jax imports it lazily, inside the first interpret-mode
  ``pallas_call``. Loaded there, it changed the key of every jitted function traced
  before (a decode step traced once more after its first call); loaded here, before any
  trace, it changes nothing.
"""

from __future__ import annotations

import functools
import importlib
import re
import typing
from typing import Callable, Literal

import jax
from jax._src.interpreters import mlir as jax_mlir  # mosaic_modules: parse a kernel's MLIR
from jax._src.lib.mlir import ir
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, get_abstract_mesh, use_abstract_mesh

from pallas_kernels._hardware_runs import auto_picks_mosaic, device_class

try:  # jax >= 0.12: see the module doc (the trace context)
    import jax.experimental.pallas.fuser  # noqa: F401
except ImportError:  # older jax registers no such option
    pass

Implementation = Literal["xla", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret", "auto"]
IMPLEMENTATIONS: tuple[Implementation, ...] = typing.get_args(Implementation)
MOSAIC_IMPLEMENTATIONS: tuple[Implementation, ...] = ("mosaic", "mosaic_interpret")

# Compute capability of the GPU kinds an abstract device can name (``cuda_lowering``).
_KIND_CAPABILITY = {"NVIDIA A100-SXM4-80GB": (8, 0), "NVIDIA H100": (9, 0), "NVIDIA H200": (9, 0)}


def check_implementation(implementation: str) -> Implementation:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    return implementation


def target_device():
    """(platform, compute capability or None) of the device the current trace targets: the
    abstract device of an abstract mesh in use (``cuda_lowering``), else jax's default
    device."""
    try:
        device = getattr(get_abstract_mesh(), "abstract_device", None)
    except AttributeError:  # an abstract mesh without an abstract device
        device = None
    if device is not None and getattr(device, "platform", None):
        return device.platform, _KIND_CAPABILITY.get(device.device_kind)
    device = jax.devices()[0]
    if device.platform == "gpu" and "rocm" in getattr(device.client, "platform_version", "").lower():
        return "rocm", None
    try:
        capability = tuple(int(p) for p in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        capability = None
    return device.platform, capability


def resolve_implementation(implementation: str, kernel: str | None = None) -> Implementation:
    """``implementation`` checked, with ``"auto"`` resolved for the device the program
    targets (see the module doc) and the wrapper ``kernel`` (``None``: a whole layer):
    ``"mosaic"`` on a CUDA device whose class the Mosaic kernels of ``kernel`` (every
    one, for a layer) have passed on as their code stands (``_hardware_runs.auto_picks_mosaic``),
    ``"pallas"`` on any other CUDA device (Triton runs on every CUDA GPU Pallas supports,
    and is every Mosaic step's fallback), ``"xla"`` anywhere else."""
    check_implementation(implementation)
    if implementation != "auto":
        return implementation
    platform, capability = target_device()
    if platform not in ("cuda", "gpu"):
        return "xla"
    return "mosaic" if auto_picks_mosaic(kernel, device_class(capability)) else "pallas"


MOSAIC_MIN_JAX = (0, 11)  # Mosaic GPU's interpret mode and the kernels' API


def jax_version() -> tuple[int, int]:
    return tuple(int(p) for p in jax.__version__.split(".")[:2])


def require_mosaic_gpu(owner: str):
    """The ``jax.experimental.pallas.mosaic_gpu`` module, or a ``NotImplementedError`` naming
    ``owner`` and the jax version when it is older than ``MOSAIC_MIN_JAX`` (the project
    still imports and runs its other implementations on jax 0.10)."""
    if jax_version() < MOSAIC_MIN_JAX:
        raise NotImplementedError(
            f"{owner}: the mosaic implementations need jax >= "
            f"{'.'.join(map(str, MOSAIC_MIN_JAX))}, this is jax {jax.__version__}; use 'pallas' or 'xla'"
        )
    # The registration module holds the CUDA lowering of ``plmgpu.kernel`` (not imported by
    # ``plmgpu`` itself on jax 0.12).
    importlib.import_module("jax._src.pallas.mosaic_gpu.pallas_call_registration")
    return importlib.import_module("jax.experimental.pallas.mosaic_gpu")


def without_mosaic(implementation: str) -> Implementation:
    """For a step with no Mosaic GPU kernel: ``implementation`` resolved, with ``"mosaic"``
    -> ``"pallas"`` and ``"mosaic_interpret"`` -> ``"pallas_interpret"`` (see the module
    doc); any other name as ``resolve_implementation`` gives it."""
    implementation = resolve_implementation(implementation)
    return {"mosaic": "pallas", "mosaic_interpret": "pallas_interpret"}.get(
        implementation, implementation)


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


def kernel_family(implementation: str, block_sizes, triton_cls: type, mosaic_cls: type, *, kernel: str):
    """``(implementation, mosaic, blocks)`` for the wrapper ``kernel`` with a Triton and a
    Mosaic kernel: ``implementation`` resolved (``"auto"``, for ``kernel``), whether the Mosaic family is asked for (a
    ``"mosaic*"`` implementation, or ``"xla"`` given the Mosaic block sizes, which are then
    validated like any others), and ``block_sizes`` validated as that family's dataclass
    (``check_block_sizes``: a ``TypeError`` for the other family's)."""
    implementation = resolve_implementation(implementation, kernel)
    mosaic = implementation in MOSAIC_IMPLEMENTATIONS or (
        implementation == "xla" and isinstance(block_sizes, mosaic_cls))
    return implementation, mosaic, check_block_sizes(block_sizes, mosaic_cls if mosaic else triton_cls)


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


def cuda_mesh(gpu: str = "h100", shape: tuple[int, ...] = (1,), names: tuple[str, ...] = ("cuda",)) -> AbstractMesh:
    """An abstract mesh of ``prod(shape)`` abstract CUDA devices of kind ``gpu``, axes
    ``names`` of sizes ``shape`` (``Auto``: see ``cuda_lowering``); no device is needed.
    Under ``use_abstract_mesh(mesh)`` a ``jax.shard_map`` over it (e.g. a layer placed on it,
    ``tests/test_context_parallel.py``) lowers for CUDA as a program of that many devices."""
    kind = CUDA_DEVICE_KINDS.get(gpu.lower())
    if kind is None:
        raise ValueError(f"gpu must be one of {sorted(CUDA_DEVICE_KINDS)}, got {gpu!r}")
    device = AbstractDevice(device_kind=kind, num_cores=None, platform="cuda")
    return AbstractMesh(tuple(shape), tuple(names), axis_types=(AxisType.Auto,) * len(shape),
                        abstract_device=device)


def cuda_lowering(gpu: str = "h100"):
    """A context in which ``jit(...).lower(lowering_platforms=("cuda",))`` works on a host
    without a GPU.

    Pallas' GPU lowering needs a compute capability. jax 0.10 assumed 9.0 when no GPU was
    present; jax >= 0.11 reads it from the device of the current mesh and, with none, raises
    "No supported GPU devices found". An abstract mesh of one abstract CUDA device
    (``cuda_mesh``) supplies it (the API exists from 0.10.2 on). Its axis is ``Auto``: the
    layer's cache updates fail jax's sharding-in-types check under the default (Explicit)
    axis type.
    """
    return use_abstract_mesh(cuda_mesh(gpu))


def lower_for_cuda(fn, *avals, gpu: str = "h100"):
    """``jax.jit(fn)`` traced on ``avals`` and lowered for CUDA without a GPU (see
    ``cuda_lowering``); returns the ``Lowered`` object."""
    with cuda_lowering(gpu):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))


def triton_calls(lowered) -> list[dict]:
    """The Triton kernel launches in a module lowered for CUDA, in program order: for each,
    its ``name``, ``grid`` ``(x, y, z)``, ``num_warps`` and ``num_stages`` (read from the
    ``__gpu$xla.gpu.triton`` custom calls' backend config)."""
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


#: ``arith.cmpi`` predicates (MLIR's ``CmpIPredicate``) that compare as unsigned integers.
UNSIGNED_CMPI = {6: "ult", 7: "ule", 8: "ugt", 9: "uge"}


def _mlir_string_bytes(escaped: str) -> bytes:
    """The bytes of an MLIR string attribute's body (``\\XX`` hex, ``\\\\``, ``\\"``, ...)."""
    out, i, simple = bytearray(), 0, {"\\": 92, '"': 34, "n": 10, "t": 9}
    while i < len(escaped):
        if escaped[i] != "\\":
            out += escaped[i].encode("latin-1")
            i += 1
        elif escaped[i + 1] in simple:
            out.append(simple[escaped[i + 1]])
            i += 2
        else:
            out.append(int(escaped[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def mosaic_modules(lowered) -> list[str]:
    """The Mosaic GPU kernels of a module lowered for CUDA, in program order: each
    ``mosaic_gpu`` custom call's kernel module (MLIR bytecode in its backend config) as
    generic MLIR text, the code the kernel was lowered to (its comparisons' signedness,
    its barriers), without a GPU."""
    text = lowered.as_text() if hasattr(lowered, "as_text") else str(lowered)
    modules = []
    for line in text.splitlines():
        if "stablehlo.custom_call @mosaic_gpu" not in line:
            continue
        found = re.search(r'\bmodule = "((?:\\.|[^"\\])*)"', line)
        if found is None:
            raise ValueError(f"a mosaic_gpu custom call without a module: {line[:200]}")
        ctx = jax_mlir.make_ir_context()
        ctx.allow_unregistered_dialects = True  # Mosaic's own dialect: printed generically
        with ctx:
            modules.append(str(ir.Module.parse(_mlir_string_bytes(found.group(1)))))
    return modules


def unsigned_compares(module_text: str) -> list[str]:
    """The unsigned integer comparisons (``arith.cmpi`` ult/ule/ugt/uge) of a kernel module's
    text (``mosaic_modules``), each as ``"PRED TYPE"``."""
    # Serialized modules name ops with a version prefix: "stable_mosaic_gpu.arith.cmpi".
    found = re.findall(r'arith\.cmpi"\([^)]*\) \{predicate = (\d+) : i64\} : \(([^,)]+)', module_text)
    return [f"{UNSIGNED_CMPI[int(p)]} {t}" for p, t in found if int(p) in UNSIGNED_CMPI]

