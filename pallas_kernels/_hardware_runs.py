"""Which kernels have run right on which GPUs: the record ``"auto"`` chooses from.

A kernel that is right in interpret mode can still be wrong on hardware: the interpreter
runs jnp's semantics, not the code a kernel is lowered to (the Mosaic ``topk_pools``
selected wrong tokens on an H200 while its interpret tests passed, 2026-12-04: see
``pallas_kernels._order_key``). So ``"auto"`` picks a Mosaic GPU kernel on a device class
only once that kernel, *as its code stands*, has passed on such a device:

* ``HARDWARE_RUNS`` holds one ``HardwareRun`` per ``(kernel, implementation, device
  class)`` that passed the GPU check (``scripts/gpu_check.py --all``: the kernel against
  its reference, its gradients and the whole layer on its implementation against
  float32): the GPU, the jax version, the date
  and ``source``, the fingerprint (``source_fingerprint``) of the kernel's modules when
  it ran. The GPU check prints the fingerprints of the code it ran (``--json``:
  ``fingerprints``), and a record is written from that output, never by hand.
* ``proven(kernel, implementation, device_class)``: a record exists *and* its fingerprint
  is the code's today. Editing a Mosaic kernel (its code, not its comments or docstrings)
  therefore takes it out of ``"auto"`` until the next hardware run proves it again;
  nothing breaks, ``"auto"`` runs the Triton kernel meanwhile.
* A wrapper with a backward (``sparse_mla``, ``index_scores``, ``index_scores_paged``) is
  proven only with its backward (``AUTO_NEEDS``): ``"auto"`` resolves once per call and
  the backward runs the forward's implementation.
* Only the Mosaic family is gated. The Triton kernels are what ``"auto"`` runs on every
  CUDA GPU (they are the fallback of every Mosaic step); their records are kept for
  docs/kernels.md, which lists every record (``tests/test_hardware_runs.py`` holds the
  page to this table).

Device classes: ``"sm80"`` (Ampere: A100), ``"sm90"`` (Hopper: H100, H200), ``"sm100"``
(Blackwell), from the compute capability (``device_class``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import io
import pathlib
import tokenize

__all__ = ["HardwareRun", "HARDWARE_RUNS", "KERNEL_SOURCES", "AUTO_NEEDS", "device_class",
           "source_fingerprint", "fingerprints", "proven", "auto_picks_mosaic", "hardware_table"]


@dataclasses.dataclass(frozen=True)
class HardwareRun:
    """One kernel's pass on hardware: ``gpu`` (device kind), ``jax`` (version), ``date``
    (ISO), ``source`` (``source_fingerprint`` of its modules then)."""

    gpu: str
    jax: str
    date: str
    source: str


#: The modules (of ``pallas_kernels``) whose code each ``(kernel, implementation)`` runs:
#: what ``source_fingerprint`` covers. The wrappers' dispatch is shared by every
#: implementation and is checked by the CPU tests; these are the kernel bodies.
KERNEL_SOURCES: dict[tuple[str, str], tuple[str, ...]] = {
    ("kpool_compress", "pallas"): ("pooling",),
    ("index_scores", "pallas"): ("scoring", "_scores"),
    ("index_scores_paged", "pallas"): ("scoring", "_scores"),
    ("index_scores_backward", "pallas"): ("scoring_backward", "_scores"),
    ("topk_pools", "pallas"): ("selection", "radix_select", "_order_key"),
    ("expand_selection", "pallas"): ("expansion",),
    ("sparse_mla", "pallas"): ("attention", "_mla"),
    ("sparse_mla_backward", "pallas"): ("attention_backward", "transpose", "_mla"),
    ("index_scores", "mosaic"): ("mosaic_scoring", "_mosaic"),
    ("index_scores_paged", "mosaic"): ("mosaic_scoring", "_mosaic"),
    ("index_scores_backward", "mosaic"): ("mosaic_scoring_backward", "_mosaic"),
    ("topk_pools", "mosaic"): ("mosaic_selection", "_order_key"),
    ("sparse_mla", "mosaic"): ("mosaic_attention", "_mosaic"),
    ("sparse_mla_backward", "mosaic"): ("mosaic_attention_backward", "_mosaic"),
}

#: The kernels a wrapper's Mosaic path runs, forward and backward: ``"auto"`` picks Mosaic
#: for the wrapper only when every one is proven. A layer (no wrapper named) needs them all.
AUTO_NEEDS: dict[str, tuple[str, ...]] = {
    "index_scores": ("index_scores", "index_scores_backward"),
    "index_scores_paged": ("index_scores_paged", "index_scores_backward"),
    "topk_pools": ("topk_pools",),
    "sparse_mla": ("sparse_mla", "sparse_mla_backward"),
}

#: Every pass on hardware, from the GPU check's output (docs/kernels.md lists them). The
#: H200 runs of 2026-12-04 (benchmarks/gpu-runs/2026-12-04/): each kernel's rows against
#: its reference at the real shapes, the whole layer under "mosaic" against float32
#: (prefill of 2 x 4,096 tokens and 4 decode steps), sparse_mla's gradients against
#: float32. Not yet: the index_scores backward (its rows did not fit that run's time).
_H200 = functools.partial(HardwareRun, "NVIDIA H200", "0.11.2", "2026-12-04")
HARDWARE_RUNS: dict[tuple[str, str, str], HardwareRun] = {
    ("index_scores", "mosaic", "sm90"): _H200("7874b2cd84e2"),
    ("index_scores_paged", "mosaic", "sm90"): _H200("7874b2cd84e2"),
    ("topk_pools", "mosaic", "sm90"): _H200("59dca2429d13"),
    ("sparse_mla", "mosaic", "sm90"): _H200("b143771ace35"),
    ("sparse_mla_backward", "mosaic", "sm90"): _H200("087c1c897dca"),
}


def device_class(capability: tuple[int, int] | None) -> str | None:
    """``"sm80"`` / ``"sm90"`` / ``"sm100"`` ... for a CUDA compute capability (``None``:
    unknown)."""
    return None if capability is None else f"sm{capability[0]}{capability[1]}"


def _code_of(path: pathlib.Path) -> str:
    """A module's code without its comments, docstrings, blank lines and indentation
    widths: what a kernel runs, the same text on every Python that parses it (line
    positions from ``ast`` and ``tokenize``'s comments agree across versions)."""
    text = path.read_text()
    lines = text.splitlines()
    drop: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            drop.update(range(body[0].lineno, body[0].end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return "\n".join(line.strip() for i, line in enumerate(lines, 1)
                     if i not in drop and line.strip())


@functools.cache
def source_fingerprint(kernel: str, implementation: str) -> str:
    """The first 12 hex digits of the SHA-256 of the code (``_code_of``) of the modules
    ``KERNEL_SOURCES`` names for ``(kernel, implementation)``."""
    here = pathlib.Path(__file__).parent
    digest = hashlib.sha256()
    for module in KERNEL_SOURCES[(kernel, implementation)]:
        digest.update(module.encode() + b"\0" + _code_of(here / f"{module}.py").encode() + b"\0")
    return digest.hexdigest()[:12]


def fingerprints() -> dict[str, str]:
    """``"kernel/implementation"`` -> ``source_fingerprint`` for every entry of
    ``KERNEL_SOURCES`` (what the GPU check reports with its rows)."""
    return {f"{k}/{i}": source_fingerprint(k, i) for k, i in KERNEL_SOURCES}


def proven(kernel: str, implementation: str, dev_class: str | None) -> HardwareRun | None:
    """The record of ``kernel`` under ``implementation`` on ``dev_class`` when its code is
    the code that ran (``None`` otherwise: never run, or changed since)."""
    run = HARDWARE_RUNS.get((kernel, implementation, dev_class))
    if run is None or run.source != source_fingerprint(kernel, implementation):
        return None
    return run


def auto_picks_mosaic(kernel: str | None, dev_class: str | None) -> bool:
    """Whether ``"auto"`` runs the Mosaic path of wrapper ``kernel`` (``None``: a whole
    layer, every wrapper of ``AUTO_NEEDS``) on ``dev_class``: each kernel it needs proven."""
    wrappers = AUTO_NEEDS if kernel is None else {kernel: AUTO_NEEDS.get(kernel, (kernel,))}
    return all(proven(k, "mosaic", dev_class) is not None
               for needs in wrappers.values() for k in needs)


def hardware_table(dev_class: str = "sm90") -> str:
    """The hardware record on ``dev_class`` as the markdown table of docs/kernels.md: per
    kernel and implementation, the run that proved it (GPU, jax, date), or that none has,
    and whether ``"auto"`` picks it."""
    lines = ["| kernel | implementation | passed on hardware | picked by `\"auto\"` |",
             "|---|---|---|---|"]
    for kernel, impl in KERNEL_SOURCES:
        run = HARDWARE_RUNS.get((kernel, impl, dev_class))
        if run is None:
            seen = "no pass recorded"
        else:
            seen = f"{run.gpu}, jax {run.jax}, {run.date}"
            if proven(kernel, impl, dev_class) is None:
                seen += " (code changed since)"
        if impl == "pallas":
            picked = "unless the Mosaic one is" if (kernel, "mosaic") in KERNEL_SOURCES else "yes"
        else:
            wrappers = [w for w, needs in AUTO_NEEDS.items() if kernel in needs]
            picked = "yes" if any(auto_picks_mosaic(w, dev_class) for w in wrappers) else "no"
        lines.append(f"| `{kernel}` | `{impl}` | {seen} | {picked} |")
    return "\n".join(lines)
