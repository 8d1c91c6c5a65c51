"""Tensor and data parallelism for one DSA layer: placing its parameters and caches on a mesh.

The plan (which tensor is split how, its PartitionSpecs and byte figures) is data in
``glm5_dsa_jax.parallel.plan``, re-exported here; what is split and replicated is
``glm5_dsa_jax.parallel.placement``; how a placed call runs is
``glm5_dsa_jax.parallel.execution`` (one ``shard_map`` over the mesh).

Invariants:

* Only the attention heads are split (the ``"heads"`` axis of the layout table:
  ``layout.partition_specs``); everything else, the whole indexer included, is replicated.
* Caches (``DsaCache``) are replicated over the whole mesh: the latent ``[B, L, C]`` has no
  head axis, every head reads every selected row, and the indexer state is replicated like
  the indexer. Each rank therefore reads its *local* copy of the latent rows it attends
  to: no step gathers a cache. Other mesh axes are allowed and everything that is not
  head-sharded is replicated over them, unless one is named ``batch_axis``:
* **Data parallelism** (``shard_layer(layer, mesh, axis="tp", batch_axis="data")``): the
  call's rows and every cache field with a batch / sequence / page axis are split over
  ``batch_axis`` (``DsaCache.length`` stays replicated; a ``PagedCache`` becomes one page
  table and one block of pages per data shard), the heads over ``axis`` as above. The
  indexer and top-k are replicated within each tp group and computed once per sequence,
  by its own data shard; the only collective of a step is the ``o_proj`` all-reduce
  within the tp group, and no cache is gathered, because each device holds the cache rows
  of exactly the sequences it computes.
* **Context parallelism** (``seq_axis="cp"``): a contiguous cache's slots and pools are
  split into ``cp`` contiguous ranges (``placement``'s module doc); decode and chunked
  prefill score, select and attend per range and merge (``glm5_dsa_jax.parallel.context``:
  what crosses devices, what is supported); a paged cache's page pools are split by page
  into ``cp`` blocks, its page table replicated (``glm5_dsa_jax.parallel.context_paged``).
* ``shard_layer`` places a layer: parameters by those specs, and one ``Placement(mesh,
  axis, batch_axis)`` recorded on the layer (``layer.placement``; ``layer.mesh`` reads
  it), the only attribute of the layer set from outside. Its caches (``init_cache``) and
  call inputs are then placed on the mesh and its call runs as one ``shard_map``: the
  sparse attention per head shard, the indexer replicated on every device of a head
  group, the ``o_proj`` output all-reduced once per call; nothing is all-gathered. It works
  on meshes with ``Explicit`` axis types
  (``jax.make_mesh``'s default) and with ``Auto`` ones, eagerly and under ``jax.jit``, and
  on meshes that span processes (``jax.distributed``: every process passes the same host
  values).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_dsa_jax.model import layout
from glm5_dsa_jax.parallel import placement as pl
from glm5_dsa_jax.parallel.context import check_supported
from glm5_dsa_jax.parallel.placement import Placement, put
from glm5_dsa_jax.parallel.plan import ShardKind, TensorPlan, TpPlan, check_tp_size, partition_specs
from glm5_dsa_jax.model.weights import param_variable

__all__ = [
    "ShardKind", "TensorPlan", "TpPlan", "partition_specs", "shard_layer", "place_cache",
    "cache_shardings", "param_shardings", "batch_sharding", "check_tp_mesh", "abstract_step_operands",
]


def param_shardings(layer) -> dict[tuple[str, ...], NamedSharding]:
    """``{param path: NamedSharding}`` of a layer placed by ``shard_layer``."""
    mesh = layer.mesh
    if mesh is None:
        raise ValueError("the layer is not placed on a mesh: call shard_layer(layer, mesh) first")
    specs = partition_specs(layer.cfg, layer.tp_axis, layer_idx=layer.layer_idx)
    return {p: NamedSharding(mesh, s) for p, s in specs.items() if p in dict(_param_vars(layer))}


def _param_vars(layer) -> list[tuple[tuple[str, ...], Any]]:
    return [(tuple(path), param_variable(layer, tuple(path)))
            for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))]


def check_tp_mesh(cfg, mesh: jax.sharding.Mesh, axis: str) -> None:
    """``ValueError`` unless ``mesh`` has the axis ``axis`` and its size divides the heads
    (``plan.check_tp_size``): every device holds whole heads. The one mesh check of
    ``shard_layer`` and of the checkpoint loaders."""
    if axis not in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {tuple(mesh.axis_names)} (shape {dict(mesh.shape)}) but no axis "
            f"{axis!r} to split the heads of {layout.head_split_names()} over"
        )
    check_tp_size(cfg, int(mesh.shape[axis]), axis)


def shard_layer(layer, mesh: jax.sharding.Mesh, axis: str = "tp", batch_axis: str | None = None,
                seq_axis: str | None = None):
    """Place ``layer`` (a ``DsaAttention``) on ``mesh``, heads split over ``axis`` (and the
    batch over ``batch_axis``, when given: data parallelism, see the module doc; and each
    contiguous cache's tokens over ``seq_axis``, when given: context parallelism,
    ``glm5_dsa_jax.parallel.context``).

    * Every parameter is put on ``NamedSharding(mesh, partition_specs(...)[path])`` and its
      ``out_sharding`` metadata is set to that spec (it survives ``nnx.split``/``merge``).
    * ``Placement(mesh, axis, batch_axis)`` is recorded on the layer (``layer.placement``,
      ``layer.mesh``): its ``init_cache`` caches are then placed on the mesh, and its call
      runs under one ``jax.shard_map``, each device on its own heads, reading its local
      copy of the latent.
    * The mesh's axis types may be ``Explicit`` or ``Auto``; other axes than ``axis`` are
      allowed (everything not head-sharded is replicated over them).
    * ``batch_axis``: the layer's calls split their rows, and its caches their sequences
      (and pages), over that axis; the batch of a call must divide by its size.
    * ``seq_axis``: the layer's contiguous caches split their slots and pools into
      contiguous ranges over that axis (capacity divisible by its size times ``kpool``);
      every step runs the layer's own kernels per shard (``parallel.context``); its
      paged caches split their page pools into blocks of pages (``num_pages / dp``
      divisible by its size; every step the layer's own kernels per shard too:
      ``parallel.context_paged``).

    Placing a layer again on the same mesh and axes is a no-op. Raises ``ValueError`` for a
    mesh without ``axis``, ``batch_axis`` or ``seq_axis``, two of them equal, an axis size
    that does not divide the heads, or a layer (or one of its parameters) already placed on
    another mesh or axes. Returns ``layer``.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(
            f"shard_layer needs a concrete jax.sharding.Mesh (e.g. jax.make_mesh((n,), "
            f"({axis!r},))), got {type(mesh).__name__}"
        )
    check_tp_mesh(layer.cfg, mesh, axis)
    if batch_axis is not None:
        pl.check_dp_mesh(mesh, axis, batch_axis)
    if seq_axis is not None:
        pl.check_seq_mesh(mesh, axis, batch_axis, seq_axis)
        check_supported(layer.implementation, seq_axis)
    placement = Placement(mesh, axis, batch_axis, seq_axis)
    old = layer.mesh
    if old is not None and layer.placement != placement:
        raise ValueError(
            f"layer {layer.layer_idx} is already placed on mesh {dict(old.shape)} (axis "
            f"{layer.tp_axis!r}, batch_axis {layer.batch_axis!r}, seq_axis {layer.placement.seq_axis!r}, "
            f"devices {[d.id for d in old.devices.flat]}); cannot place it on mesh {dict(mesh.shape)} "
            f"(axis {axis!r}, batch_axis {batch_axis!r}, seq_axis {seq_axis!r}, devices "
            f"{[d.id for d in mesh.devices.flat]}): build a new layer (or nnx.clone it before "
            "placing) to use another mesh"
        )
    specs = partition_specs(layer.cfg, axis, layer_idx=layer.layer_idx)
    variables = _param_vars(layer)
    # Check everything before changing anything.
    for path, var in variables:
        name = "/".join(path)
        if path not in specs:
            raise ValueError(f"parameter {name!r} is not in the TP plan of layer {layer.layer_idx}")
        value = var[...]
        sh = getattr(value, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh != mesh and old is None:
            raise ValueError(
                f"parameter {name!r} of layer {layer.layer_idx} is already on another mesh "
                f"{dict(sh.mesh.shape)} (spec {sh.spec}); cannot place it on mesh "
                f"{dict(mesh.shape)} along axis {axis!r}"
            )
    for path, var in variables:
        spec = specs[path]
        var.set_value(put(var[...], NamedSharding(mesh, spec)))
        var.set_metadata(out_sharding=tuple(spec))
    layer.placement = placement
    return layer


# ------------------------------------------------------------------------------- caches
def cache_shardings(cache, mesh: jax.sharding.Mesh, batch_axis: str | None = None,
                    seq_axis: str | None = None):
    """The placement of a cache (``DsaCache`` or ``PagedCache``) on ``mesh`` (a pytree of
    ``NamedSharding``, ``None`` leaves kept): every field replicated, or with a
    ``batch_axis`` every field of rank >= 1 split on its leading (batch / sequence / page)
    axis over it and the scalars replicated (``placement.cache_specs``). Use it for a
    decode step's ``in_shardings`` / ``out_shardings`` so the cache never moves. With a
    ``seq_axis`` the token-axis fields (``DsaCache.TOKEN_AXIS_FIELDS``) are split on axis 1
    too, a paged cache's pools (``PagedCache.PAGE_AXIS_FIELDS``) on their page axis."""
    return pl.cache_shardings(cache, mesh, batch_axis, seq_axis)


def place_cache(cache, mesh: jax.sharding.Mesh, batch_axis: str | None = None, seq_axis: str | None = None):
    """``cache`` placed as ``cache_shardings`` describes (works on traced values too, as a
    constraint). ``ValueError`` when a leading axis does not divide by ``batch_axis``'s
    size, a paged cache's page table was not made with that many shards, or (with a
    ``seq_axis``) a contiguous cache's capacity does not divide by ``cp * kpool`` or a paged
    cache's pages (per data shard) by ``cp``."""
    if batch_axis is not None:
        pl.check_dp_mesh(mesh, None, batch_axis)
    if seq_axis is not None:
        pl.check_seq_mesh(mesh, None, batch_axis, seq_axis)
    return pl.place_cache(cache, mesh, batch_axis, seq_axis)


def batch_sharding(layer) -> NamedSharding:
    """Where a placed layer's call inputs and outputs (``[B, ...]`` rows) live: split over
    its ``batch_axis``, or replicated on a layer without one."""
    if layer.mesh is None:
        raise ValueError("the layer is not placed on a mesh: call shard_layer(layer, mesh) first")
    return NamedSharding(layer.mesh, layer.placement.row_spec)



def abstract_step_operands(layer, params, cache):
    """``(params, cache)`` of a placed layer's step (``make_step``'s ``params``; a cache or its
    shapes) as ``jax.ShapeDtypeStruct`` s carrying the shardings the step is compiled with: a
    parameter split over the head axis as ``param_shardings`` says, else replicated; the cache
    as ``cache_shardings`` places it on the layer's ``batch_axis`` / ``seq_axis``. For
    compiling or lowering a step with no arrays (a layer built under ``nnx.eval_shape``, a mesh
    of abstract devices: ``pk.cuda_mesh``)."""
    shardings, replicated = param_shardings(layer), NamedSharding(layer.mesh, P())

    def placed(path, a):
        where = shardings.get(tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)), replicated)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)

    where = cache_shardings(cache, layer.mesh, layer.placement.batch_axis, layer.placement.seq_axis)
    return (jax.tree_util.tree_map_with_path(placed, params),
            jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache, where))
