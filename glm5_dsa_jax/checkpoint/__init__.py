"""Checkpoints: import DSA layers from a Hugging Face safetensors directory, save and
restore them with orbax (``glm5-dsa convert`` is ``glm5_dsa_jax.cli.convert``).

Modules, in import order:

* ``errors``: ``CheckpointError``, the one exception of a failed load or save.
* ``safetensors_file``: ``SafetensorsFile``, a validating safetensors reader that reads
  slices with ``pread`` (no mmap; ``F8_E4M3`` supported, unlike safetensors' numpy backend).
* ``assembly``: the checkpoint directory and its JSON files, and building ``DsaAttention``
  layers from arrays placed straight into the shardings their parameters declare.
* ``hf_import``: ``load_hf_checkpoint``: a ``glm5_next`` / ``glm_moe_dsa`` / ``deepseek_v32``
  directory (``config.json`` plus ``model.safetensors`` or an index and its shards) ->
  ``{layer_idx: DsaAttention}``, every device reading only its own slices, NVFP4/fp8
  dequantized on the way; ``read_hf_params``: the same checks, our parameters as numpy.
* ``orbax_io``: ``save_checkpoint`` / ``read_checkpoint_meta`` / ``restore_checkpoint``
  (atomic save beside the target and swap, a digest per array verified on restore), and
  ``save_cache`` / ``restore_cache`` for a contiguous cache (restored onto any mesh, split
  over a data or ``cp`` axis included).

Names without an underscore that a module's ``__all__`` leaves out (``assembly``'s
functions, ``hf_import.read_config``, ``orbax_io.PARAMS_DIR``,
``safetensors_file.CHUNK_BYTES``) are the package's internal API: shared between its
modules, not exported by the package.

Invariants every loader here keeps: every problem found is reported in one
``CheckpointError`` naming each tensor or array, and a failed load returns nothing (all
layers are assembled and checked, finiteness included, before any is returned). The
package sits after ``sharding`` in the import order (it places what it loads with
``shard_layer``) and before the library's commands (``demo``, ``cli``).
"""

from __future__ import annotations

import os
from pathlib import Path

from glm5_dsa_jax.checkpoint.assembly import check_dir
from glm5_dsa_jax.checkpoint.errors import CheckpointError
from glm5_dsa_jax.checkpoint.hf_import import LAYER_PREFIXES, read_config, load_hf_checkpoint, read_hf_params
from glm5_dsa_jax.checkpoint.orbax_io import (
    PARAMS_DIR, META_FILE, read_checkpoint_meta, restore_cache, restore_checkpoint, save_cache, save_checkpoint,
)
from glm5_dsa_jax.checkpoint.safetensors_file import SafetensorsFile
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.model.layer import DsaAttention

__all__ = [
    "CheckpointError", "load_hf_checkpoint", "read_hf_params", "save_checkpoint", "restore_checkpoint",
    "read_checkpoint_meta", "load_for_demo", "save_cache", "restore_cache", "SafetensorsFile", "LAYER_PREFIXES", "META_FILE",
]


def load_for_demo(path: str | os.PathLike, **kwargs) -> tuple[DsaConfig, dict[int, DsaAttention]]:
    """``(cfg, {layer_idx: DsaAttention})`` from an orbax directory written by
    ``save_checkpoint`` / ``glm5-dsa convert``, or from a HF checkpoint directory.
    ``kwargs`` go to ``restore_checkpoint`` / ``load_hf_checkpoint`` (``mesh``,
    ``implementation``, ``axis``, ``dtype``, ``layers``...)."""
    path = Path(path)
    check_dir(path)
    if (path / META_FILE).is_file() or (path / PARAMS_DIR).is_dir():
        cfg = read_checkpoint_meta(path)[1]  # (an incomplete save without META_FILE: refused)
        return cfg, restore_checkpoint(path, **kwargs)
    if (path / "config.json").is_file():
        cfg = read_config(path)[1]
        return cfg, load_hf_checkpoint(path, **kwargs)
    raise FileNotFoundError(
        f"{str(path)!r} is neither an orbax checkpoint from 'glm5-dsa convert' (no {META_FILE}) "
        "nor a Hugging Face checkpoint directory (no config.json)"
    )
