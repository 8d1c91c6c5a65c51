"""Tensor parallelism for one DSA layer on a mesh: placement of parameters, caches and
inputs, and sharded execution. The plan itself (which tensor is split how, its
PartitionSpecs and byte figures) is data in ``glm5_dsa_jax.plan``, re-exported here.

Invariants:

* Only the attention heads are split (``plan``: ``q_b_proj``, ``w_uk``/``w_uv`` and the
  row-parallel ``o_proj``); everything else, the whole indexer included, is replicated.
* Caches (``DsaCache``) are replicated over the whole mesh: the latent ``[B, L, C]`` has no
  head axis, every head reads every selected row, and the indexer state is replicated like
  the indexer. Each rank therefore reads its *local* copy of the latent rows it attends
  to: no step gathers a cache. Other mesh axes (a ``"data"`` axis, say) are allowed and
  everything that is not head-sharded is replicated over them; batch (data) parallelism
  over such an axis is not done by this module.
* ``shard_layer`` places a layer: parameters by those specs, its caches from then on
  (``init_cache``) and its concrete call inputs replicated, its sparse attention kernel run
  per head shard under ``jax.shard_map`` (``check_vma=False``: a ``pallas_call`` has no
  varying-axis rule), and, for the Pallas implementations, the indexer's kernels run by
  every device on its replicated inputs under ``shard_map`` too (``replicated_call``). The
  ``o_proj`` output is all-reduced once per call (``row_parallel_out_sharding``); nothing
  is all-gathered. It works on meshes with ``Explicit`` axis types (``jax.make_mesh``'s
  default) and with ``Auto`` ones, eagerly and under ``jax.jit``, and on meshes that span
  processes (``jax.distributed``: every process passes the same host values).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_dsa_jax.plan import ShardKind, TensorPlan, TpPlan, check_tp_size, partition_specs

__all__ = [
    "ShardKind", "TensorPlan", "TpPlan", "partition_specs", "shard_layer", "place_cache",
    "cache_shardings", "param_shardings", "place_inputs", "sharded_sparse_mla", "replicated_call", "row_parallel_out_sharding",
]


def param_shardings(layer) -> dict[tuple[str, ...], NamedSharding]:
    """``{param path: NamedSharding}`` of a layer placed by ``shard_layer``."""
    mesh = _layer_mesh(layer)
    if mesh is None:
        raise ValueError("the layer is not placed on a mesh: call shard_layer(layer, mesh) first")
    specs = partition_specs(layer.cfg, layer.tp_axis, layer_idx=layer.layer_idx)
    return {p: NamedSharding(mesh, s) for p, s in specs.items() if p in dict(_param_vars(layer))}


def _param_vars(layer) -> list[tuple[tuple[str, ...], Any]]:
    from flax import nnx

    out = []
    for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        obj = layer
        for part in path:
            obj = getattr(obj, part)
        out.append((tuple(path), obj))
    return out


def _layer_mesh(layer):
    return getattr(layer, "mesh", None)


def _put(value, sharding: NamedSharding):
    """``value`` placed on ``sharding``, also when the mesh spans processes (each process
    then passes the same host value and keeps its own shards)."""
    if isinstance(value, jax.core.Tracer):
        return jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_layer(layer, mesh: jax.sharding.Mesh, axis: str = "tp"):
    """Place ``layer`` (a ``DsaAttention``) on ``mesh``, heads split over ``axis``.

    * Every parameter is put on ``NamedSharding(mesh, partition_specs(...)[path])`` and its
      ``out_sharding`` metadata is set to that spec (it survives ``nnx.split``/``merge``).
    * The mesh is recorded on the layer (``layer.mesh``): its ``init_cache`` caches are
      then replicated on the mesh, and its sparse attention runs under ``jax.shard_map``,
      each device on its own heads, reading its local copy of the latent.
    * The mesh's axis types may be ``Explicit`` or ``Auto``; other axes than ``axis`` are
      allowed (everything not head-sharded is replicated over them).

    Placing a layer again on the same mesh and axis is a no-op. Raises ``ValueError`` for a
    mesh without ``axis``, an axis size that does not divide the heads, or a layer (or one
    of its parameters) already placed on another mesh. Returns ``layer``.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(
            f"shard_layer needs a concrete jax.sharding.Mesh (e.g. jax.make_mesh((n,), "
            f"({axis!r},))), got {type(mesh).__name__}"
        )
    if axis not in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {tuple(mesh.axis_names)} (shape {dict(mesh.shape)}) but no axis "
            f"{axis!r} to split the heads of q_b_proj, kv_b_proj and o_proj over"
        )
    size = int(mesh.shape[axis])
    check_tp_size(layer.cfg, size, axis)
    old = _layer_mesh(layer)
    if old is not None and (old != mesh or layer.tp_axis != axis):
        raise ValueError(
            f"layer {layer.layer_idx} is already placed on mesh {dict(old.shape)} (axis "
            f"{layer.tp_axis!r}, devices {[d.id for d in old.devices.flat]}); cannot place it on "
            f"mesh {dict(mesh.shape)} (axis {axis!r}, devices "
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
        var.set_value(_put(var[...], NamedSharding(mesh, spec)))
        var.set_metadata(out_sharding=tuple(spec))
    layer.tp_axis = axis
    layer.mesh = mesh
    return layer


# ------------------------------------------------------------------------------- caches
def cache_shardings(cache, mesh: jax.sharding.Mesh):
    """The placement of a ``DsaCache`` on ``mesh`` (a pytree of ``NamedSharding``, ``None``
    leaves kept): every field replicated. Use it for a decode step's ``in_shardings`` /
    ``out_shardings`` so the cache never moves."""
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), cache)


def place_cache(cache, mesh: jax.sharding.Mesh):
    """``cache`` replicated on ``mesh`` (works on traced values too, as a constraint)."""
    return jax.tree.map(lambda a, s: _put(a, s), cache, cache_shardings(cache, mesh))


def place_inputs(mesh: jax.sharding.Mesh, *arrays):
    """What a placed layer does with its call's inputs: arrays not yet on ``mesh`` are
    replicated on it. ``None`` and arrays already on the mesh (any sharding) are returned
    unchanged. Traced values are placed only when ``mesh`` has ``Explicit`` axes and the
    value carries no sharding yet (a jit argument passed as a host array): ops that mix it
    with the replicated cache (``dynamic_update_slice``) need equal sharding types."""
    rep = NamedSharding(mesh, P())
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    out = []
    for a in arrays:
        if a is None:
            out.append(a)
        elif isinstance(a, jax.core.Tracer):
            typed = getattr(jax.typeof(a), "sharding", None)
            unplaced = typed is None or typed.mesh.empty
            out.append(jax.device_put(a, rep) if explicit and unplaced else a)
        elif isinstance(getattr(a, "sharding", None), NamedSharding) and a.sharding.mesh == mesh:
            out.append(a)
        else:
            out.append(_put(a, rep))
    return tuple(out)


# ------------------------------------------------------------------------------- execution
def sharded_sparse_mla(q_lat, latent, token_ids, *, mesh, axis: str, kernel):
    """Run ``kernel(q_lat, latent, token_ids)`` (a ``pk.sparse_mla`` partial) per head
    shard: ``q_lat [B, Q, H, C]`` split over ``axis`` on its head dim, the latent and the
    ids replicated, the output ``[B, Q, H, C]`` split like ``q_lat``. Each device reads only
    its local latent copy; nothing is gathered."""
    q_spec = P(None, None, axis, None)
    return jax.shard_map(
        kernel, mesh=mesh, in_specs=(q_spec, P(), P()), out_specs=q_spec, check_vma=False,
    )(q_lat, latent, token_ids)


def layer_attend(layer, q_lat, latent, token_ids, kernel):
    """``DsaAttention._attend`` on a placed layer: the kernel under ``shard_map``."""
    mesh = _layer_mesh(layer)
    if mesh is None:
        return kernel(q_lat, latent, token_ids)
    return sharded_sparse_mla(q_lat, latent, token_ids, mesh=mesh, axis=layer.tp_axis, kernel=kernel)


def replicated_call(mesh: jax.sharding.Mesh, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run by every device of ``mesh`` on its own full copy of the
    (replicated) array arguments, under ``jax.shard_map`` with replicated specs; the
    (identical) outputs come back replicated.

    How a placed layer runs the indexer's Pallas kernels: a ``pallas_call`` has no sharding
    rule, so outside ``shard_map`` it fails on ``Explicit`` mesh axes (interpret mode
    included), and under ``Auto`` axes XLA would have to guess how to partition a custom
    call. ``kwargs`` are static (sizes, ``implementation``)."""
    leaves, treedef = jax.tree.flatten(args)
    is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in leaves]
    arrays = [a for a, k in zip(leaves, is_array) if k]

    def body(*local):
        it = iter(local)
        full = [next(it) if k else a for a, k in zip(leaves, is_array)]  # Python scalars stay static
        return fn(*jax.tree.unflatten(treedef, full), **kwargs)

    return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(*arrays)


def row_parallel_out_sharding(o: jax.Array):
    """Output sharding for the row-parallel ``o_proj`` contraction ``[B, S, H, V] x [H, V,
    hidden] -> [B, S, hidden]``, whose contracted head axis may be sharded.

    Under ``Explicit`` mesh axes jax needs it given: ``o``'s batch and sequence sharding
    kept, ``hidden`` replicated, so the partial sums are all-reduced once. ``None`` (let
    XLA decide, which also all-reduces) when ``o`` carries no explicit sharding.
    """
    sh = getattr(jax.typeof(o), "sharding", None)
    mesh = getattr(sh, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return None
    spec = tuple(sh.spec) + (None,) * (o.ndim - len(tuple(sh.spec)))
    return NamedSharding(mesh, P(*spec[:-2], None))
