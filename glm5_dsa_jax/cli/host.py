"""What the ``glm5-dsa`` command sets up on the host before jax starts a backend.

jax reads its platform and its CPU device count when it creates its first backend (the first
``jax.devices()`` or array), not when it is imported, so the command sets both in
``glm5_dsa_jax.cli.main`` before any work; once a backend exists (the command called from a
program that already used jax), nothing is changed and only the checks remain.

* **CPU without a GPU.** On a host with no GPU (no ``/dev/nvidia<N>`` device file and no
  ``nvidia-smi`` on ``PATH``), and only when the user has not set ``JAX_PLATFORMS``, the
  command pins jax to the CPU (``jax_platforms="cpu"``, what ``JAX_PLATFORMS=cpu`` sets).
  Why: an installed CUDA plugin (the ``gpu-compile`` extra, ``jax[cuda12]``) otherwise
  tries to initialise on the first ``jax.devices()`` and prints a ~25-line "Jax plugin
  configuration error ... Unable to load CUDA" traceback before falling back to the CPU.
  ``gpu-compile`` is pinned too: its deviceless compile builds a compile-only CUDA device
  from the plugin's libraries (``jax.experimental.topologies``), which needs no CUDA
  platform (its worker processes run with ``JAX_PLATFORMS=cpu`` already). Elsewhere (a
  Python program, the notebook) set ``JAX_PLATFORMS=cpu`` before importing jax to silence
  it. The plugin still logs a few ``cudart_stub ... Could not find cuda drivers`` lines
  when jax is imported; they are harmless.
* **Virtual CPU devices.** A command that needs ``n`` devices (``convert --tp N``) on a
  CPU-only host gets them: ``need_devices`` sets ``jax_num_cpu_devices = n``, the same as
  ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax starts. When it
  cannot (a backend already started, ``XLA_FLAGS`` already fixing a count, a GPU host),
  fewer devices than ``n`` is a ``UsageError`` that says how to get them.
"""

from __future__ import annotations

import glob
import os
import shutil

import jax
from jax._src import xla_bridge

from glm5_dsa_jax.cli.args import UsageError

__all__ = ["has_gpu", "pin_cpu_without_gpu", "need_devices", "DEVICE_COUNT_FLAG"]

#: The XLA flag that gives a CPU host virtual devices (read when jax starts its backend).
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def has_gpu() -> bool:
    """An NVIDIA GPU is present: a ``/dev/nvidia<N>`` device file or ``nvidia-smi``."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def pin_cpu_without_gpu() -> bool:
    """Pin jax to the CPU when this host has no GPU, ``JAX_PLATFORMS`` is unset and no
    backend has started; returns whether it did."""
    if "JAX_PLATFORMS" in os.environ or xla_bridge.backends_are_initialized() or has_gpu():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


def need_devices(n: int, flag: str) -> list:
    """``n`` devices for ``flag`` (e.g. ``--tp``): on a CPU-only host whose backend has not
    started (and whose ``XLA_FLAGS`` fix no count), ``n`` virtual CPU devices are made;
    otherwise ``UsageError`` when the host has fewer than ``n``. Returns the first ``n``."""
    if (n > 1 and not xla_bridge.backends_are_initialized() and not has_gpu()
            and DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", "")
            and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"):
        jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))
    devices = jax.devices()
    if len(devices) < n:
        raise UsageError(
            f"{flag} {n} needs {n} devices; this host has {len(devices)} {devices[0].platform} "
            f"device(s) (on a CPU, set XLA_FLAGS={DEVICE_COUNT_FLAG}={n} before jax is "
            "imported, or run glm5-dsa in a fresh process: it makes them itself)")
    return devices[:n]
