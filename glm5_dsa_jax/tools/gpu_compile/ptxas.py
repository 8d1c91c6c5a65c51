"""The compile toolchain of ``glm5_dsa_jax.tools.gpu_compile``: finding it and reading ``ptxas -v``.

Invariants: ``toolchain()`` refuses (``ToolchainMissing``, naming the ``gpu-compile`` extra)
when the CUDA plugin or ptxas is absent, and refuses a plugin whose version differs from
jaxlib's (XLA and the plugin must be one build). ``parse_ptxas`` reads only what ``ptxas
-v`` printed: a missing number stays missing (the report then fails the kernel), it is
never defaulted to 0, except static shared memory, which ptxas omits when it is 0.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from importlib.metadata import PackageNotFoundError, version

__all__ = ["EXTRA", "INSTALL_HINT", "ToolchainMissing", "toolchain", "find_ptxas",
           "parse_ptxas", "ptxas_stats"]

EXTRA = "gpu-compile"
INSTALL_HINT = (
    f"install the {EXTRA!r} extra: pip install -e '.[{EXTRA}]' (jax-cuda12-plugin and "
    "jax-cuda12-pjrt of the installed jax's version, and ptxas from nvidia-cuda-nvcc-cu12)"
)


class ToolchainMissing(RuntimeError):
    """The compile toolchain (the ``gpu-compile`` extra) is not installed."""


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def find_ptxas() -> str | None:
    """ptxas of ``nvidia-cuda-nvcc-cu12`` (the one XLA itself finds), else on ``PATH``."""
    try:
        # Here, not at the top: the package is optional (the gpu-compile extra), and its
        # absence is an answer (ptxas from PATH), not an import error of this module.
        import nvidia.cuda_nvcc as nvcc  # noqa: PLC0415

        for base in getattr(nvcc, "__path__", []):
            path = os.path.join(base, "bin", "ptxas")
            if os.access(path, os.X_OK):
                return path
    except ImportError:
        pass
    return shutil.which("ptxas")


def toolchain() -> dict:
    """Versions of what the compile needs and the ptxas path. Raises ``ToolchainMissing``
    (the extra to install) when the plugin or ptxas is absent, and ``RuntimeError`` when
    the plugin's version differs from jaxlib's (XLA and the plugin must be one build)."""
    info = {d: _version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")}
    ptxas = find_ptxas()
    missing = [d for d in ("jax-cuda12-plugin", "jax-cuda12-pjrt") if info[d] is None]
    if ptxas is None:
        missing.append("ptxas (nvidia-cuda-nvcc-cu12)")
    if missing:
        raise ToolchainMissing(f"not installed: {', '.join(missing)}; {INSTALL_HINT}")
    for d in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        if info[d] != info["jaxlib"]:
            raise RuntimeError(
                f"{d} {info[d]} does not match jaxlib {info['jaxlib']}: the plugin must be the "
                f"same build as jaxlib; pip install -e '.[{EXTRA}]' (it pins them to jax's version)"
            )
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    info["ptxas"] = ptxas
    info["ptxas_version"] = (re.findall(r"V[\d.]+", out) or ["?"])[0]
    return info


def parse_ptxas(text: str) -> dict[str, dict]:
    """Per entry function of ``ptxas -v`` output: regs, spill stores/loads, stack, static
    shared memory."""
    funcs: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?", line)
        if m:
            cur = funcs.setdefault(m.group(1), {"smem_static": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                       spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem_static"] = int(s.group(1)) if s else 0
    return funcs


def ptxas_stats(ptxas: str, dump: str, names: set[str]) -> tuple[dict, list[str]]:
    """ptxas -v every dumped PTX file that defines one of ``names``."""
    stats, errors = {}, []
    for fn in sorted(os.listdir(dump)):
        if not fn.endswith(".ptx"):
            continue
        path = os.path.join(dump, fn)
        with open(path) as f:
            text = f.read()
        entries = set(re.findall(r"\.entry\s+([\w$.]+)\s*\(", text))
        target = re.search(r"^\s*\.target\s+(\w+)", text, re.M)
        if not entries & names or target is None:
            continue
        with tempfile.TemporaryDirectory() as td:
            proc = subprocess.run(
                [ptxas, f"-arch={target.group(1)}", "-v", path, "-o", os.path.join(td, "k.cubin")],
                capture_output=True, text=True)
        if proc.returncode:
            errors.append(f"ptxas {fn}: {(proc.stdout + proc.stderr).strip()[-2000:]}")
        stats.update({k: v for k, v in parse_ptxas(proc.stdout + proc.stderr).items() if k in names})
    return stats, errors
