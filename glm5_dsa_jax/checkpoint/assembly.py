"""What the HF import and the orbax restore share: the checkpoint directory and its JSON
files, and the assembly of ``DsaAttention`` layers from arrays already on their devices.

Every function here is the ``checkpoint`` package's internal API (used by ``hf_import`` and
``orbax_io``), hence public names; the package's ``__init__`` exports none of them.

Invariants:

* **Target shardings come from the parameters' metadata**: the ``out_sharding`` that
  ``DsaAttention`` attaches to each ``nnx.Param`` (``layout.partition_specs`` with the TP
  axis ``axis``), turned into a ``NamedSharding`` on the given mesh (``SingleDeviceSharding`` on the default device
  without one). Both loaders place every array straight into that sharding, so a layer is
  never materialised whole on one device first.
* **Layers start abstract.** ``abstract_layer`` builds the layer under ``nnx.eval_shape``
  (shapes only, nothing allocated); ``fill_layer`` puts the loaded arrays in and, on a
  mesh, records the mesh on the layer with ``sharding.shard_layer`` (with the loader's
  ``batch_axis`` / ``seq_axis``: a layer restored onto a ``(data, cp, tp)`` mesh is placed
  for data and context parallelism), which adopts the already-placed parameters without a copy.
* **Whole heads per device**: a mesh is refused (``ValueError``) unless ``axis`` is one of
  its axes and it divides ``num_attention_heads`` (``sharding.check_tp_mesh``, the check
  ``shard_layer`` applies, so both say the same).
* Unreadable JSON (config, index, ModelOpt config, metadata) is a ``CheckpointError``; a
  missing directory is ``FileNotFoundError``, a file in its place ``NotADirectoryError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from glm5_dsa_jax.checkpoint.errors import CheckpointError
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.parallel.sharding import check_tp_mesh, shard_layer


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path.parent}", [f"{what} {path.name} cannot be read: {e}"]) from None
    if not isinstance(d, dict):
        raise CheckpointError(f"checkpoint {path.parent}", [f"{what} {path.name} is not a JSON object"])
    return d


def check_dir(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint path {str(path)!r} is not a directory")


def abstract_layer(cfg, layer_idx, *, implementation, dtype, param_dtype, axis):
    """A ``DsaAttention`` whose parameters are shapes only (nothing allocated)."""
    return nnx.eval_shape(lambda: DsaAttention(
        cfg, layer_idx, rngs=nnx.Rngs(0), implementation=implementation, dtype=dtype,
        param_dtype=param_dtype, tp_axis=axis,
    ))


def tree_get(tree: Mapping, path: Sequence[str]):
    for p in path:
        tree = tree[p]
    return tree


def tree_set(tree: dict, path: Sequence[str], value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def target_shardings(abstract, mesh, axis: str) -> dict:
    """``{param path: Sharding}`` from the parameters' ``out_sharding`` metadata."""
    state = nnx.state(abstract, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    dev = jax.local_devices()[0]
    out = {}

    def walk(tree, path):
        for k, v in tree.items():
            if isinstance(v, Mapping):
                walk(v, path + (k,))
            else:
                out[path + (k,)] = NamedSharding(mesh, v) if mesh is not None else SingleDeviceSharding(dev)

    walk(specs, ())
    return out


def check_mesh(cfg: DsaConfig, mesh, axis: str) -> None:
    """``sharding.check_tp_mesh`` (whole heads per device), or nothing without a mesh."""
    if mesh is not None:
        check_tp_mesh(cfg, mesh, axis)


def fill_layer(abstract, arrays: dict, mesh=None, axis: str = "tp", *, batch_axis: str | None = None,
               seq_axis: str | None = None) -> DsaAttention:
    state = nnx.state(abstract, nnx.Param)
    nnx.replace_by_pure_dict(state, arrays)
    nnx.update(abstract, state)
    if mesh is not None:
        # Records the mesh on the layer (sharded attention, placed caches); the parameters
        # are already there, so this adopts them without a copy.
        # ``batch_axis`` / ``seq_axis``: data and context parallelism, as shard_layer takes them.
        shard_layer(abstract, mesh, axis=axis, batch_axis=batch_axis, seq_axis=seq_axis)
    return abstract
