"""Execution of a layer's pipeline on a mesh: what runs per head shard, what runs replicated.

``shard_layer`` (``glm5_dsa_jax.sharding``) places a layer's parameters and records the mesh
on the layer (``layer.mesh``); the layer then runs its steps through the helpers here. Every
helper takes the mesh (``None`` = a layer not placed: a plain call) and the head axis, never
a layer, so this module imports no layer, plan or placement code.

Invariants:

* **Per head shard**: only the sparse attention (``sharded_sparse_mla``). Its queries
  ``q_lat [B, Q, H, C]`` are split over the head axis; the latent cache and the token ids
  are replicated, so each device reads its *local* copy of the rows it attends to and
  nothing is gathered. It runs under ``jax.shard_map`` with ``check_vma=False``: a
  ``pallas_call`` has no varying-axis rule.
* **Replicated**: the indexer's kernels (``kpool_compress``, ``index_scores``,
  ``topk_pools``, ``expand_selection``). The indexer emits a *selection*, not a partial
  sum: every device computes the same scores from the same replicated inputs in the same
  order, so the top-k is bit-identical on every device and every TP size (see
  ``glm5_dsa_jax.sharding`` for the all-reduce a head-sharded indexer would need instead).
  The ``"xla"`` implementation is plain jnp and XLA partitions it itself; the Pallas ones
  run under ``shard_map`` with replicated specs (``replicated_call``): a ``pallas_call``
  has no sharding rule, so outside ``shard_map`` it fails on ``Explicit`` mesh axes and
  under ``Auto`` ones XLA would have to guess how to partition a custom call.
* **Row-parallel**: ``o_proj`` contracts the sharded head axis; its partial sums are
  all-reduced once per call (``row_parallel_out_sharding`` spells the output sharding out,
  which ``Explicit`` axes require).
* Inputs and caches are replicated on the mesh (``place_inputs``, ``replicate``): ops that
  mix a call's inputs with the replicated cache (``dynamic_update_slice``) need both on the
  same mesh. Host values are placed also when the mesh spans processes
  (``jax.distributed``: every process passes the same host values and keeps its shards).
* Works with ``Explicit`` axis types (``jax.make_mesh``'s default) and ``Auto`` ones,
  eagerly and under ``jax.jit``.
* **Data parallelism is not run here.** A layer placed with a ``batch_axis`` runs its whole
  call under one ``shard_map`` manual over every mesh axis (``glm5_dsa_jax.data_parallel``):
  inside it the layer has no mesh, so these helpers make plain calls, and the one
  all-reduce is an explicit ``psum`` of the ``o_proj`` output over the head axis
  (``ops.absorb_o(..., reduce_axis=)``). What is split and replicated there is listed in
  ``glm5_dsa_jax.sharding``'s module doc.
* **No compilation per eager call.** A ``shard_map`` applied outside any trace compiles
  its body op by op, and those programs are not reused from one call to the next (a
  placed layer's eager decode step compiled 45 of them per step on a TP-2 mesh). So the
  ``shard_map`` of ``replicated_call`` and ``sharded_sparse_mla`` is built once per
  ``(function, mesh, static arguments)`` (an ``lru_cache``), and an eager call runs it
  as one cached ``jax.jit`` program; under a trace it is inlined as before. The cache
  key holds the function, so it must be a stable one (module-level or itself cached),
  as for every ``lax`` control-flow body (see ``glm5_dsa_jax.cache``): a closure made
  anew per call would get a new program, and a new compilation, every time.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = [
    "put", "replicate", "place_inputs", "replicated_call", "indexer_kernel_call",
    "sharded_sparse_mla", "row_parallel_out_sharding",
]


def _explicit(mesh) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def put(value, sharding: NamedSharding):
    """``value`` placed on ``sharding``, also when the mesh spans processes (each process
    then passes the same host value and keeps its own shards). A traced value gets
    ``device_put`` (a sharding constraint); an array already there is returned as is."""
    if isinstance(value, jax.core.Tracer):
        return jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def replicate(tree, mesh: jax.sharding.Mesh | None):
    """Every array leaf of ``tree`` replicated on ``mesh`` (``None`` leaves kept; traced
    leaves constrained). ``mesh=None``: ``tree`` unchanged. How a placed layer's caches
    live: the latent has no head axis and every head reads every selected row."""
    if mesh is None:
        return tree
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: put(a, rep), tree)


def place_inputs(mesh: jax.sharding.Mesh | None, *arrays):
    """What a placed layer does with its call's inputs: arrays not yet on ``mesh`` are
    replicated on it. ``None`` and arrays already on the mesh (any sharding) are returned
    unchanged. Traced values are placed only when ``mesh`` has ``Explicit`` axes and the
    value carries no sharding yet (a jit argument passed as a host array): ops that mix it
    with the replicated cache (``dynamic_update_slice``) need equal sharding types.
    ``mesh=None`` (a layer not placed): ``arrays`` unchanged."""
    if mesh is None:
        return arrays
    rep = NamedSharding(mesh, P())
    explicit = _explicit(mesh)
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
            out.append(put(a, rep))
    return tuple(out)


def _traced(arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


_ARRAY = object()  # marks an array leaf among the static leaves of a replicated_call


@functools.lru_cache(maxsize=256)
def _replicated_program(fn: Callable, mesh, treedef, statics: tuple, kwargs: tuple):
    """``(mapped, jitted)``: ``fn`` under ``shard_map`` with replicated specs, taking the
    array leaves of its arguments (``statics``: ``(type, value)`` per leaf, ``_ARRAY`` for
    an array), and its ``jax.jit``. Cached, so eager calls reuse one compiled program."""

    def body(*local):
        it = iter(local)
        full = [next(it) if s is _ARRAY else s[1] for s in statics]  # Python scalars stay static
        return fn(*jax.tree.unflatten(treedef, full), **dict(kwargs))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return mapped, jax.jit(mapped)


def _program(build, *key):
    """``build(*key)``, from its cache when ``key`` is hashable (it is for the layer's
    calls: functions, meshes, Python scalars, strings); built anew otherwise."""
    try:
        hash(key)
    except TypeError:
        return build.__wrapped__(*key)
    return build(*key)


def replicated_call(mesh: jax.sharding.Mesh | None, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` run by every device of ``mesh`` on its own full copy of the
    (replicated) array arguments, under ``jax.shard_map`` with replicated specs; the
    (identical) outputs come back replicated. ``mesh=None``: the plain call.

    How a placed layer runs the indexer's Pallas kernels (see the module doc). ``kwargs``
    and non-array arguments (Python scalars) are static: sizes, ``implementation``.
    Outside a trace the ``shard_map`` runs as one ``jax.jit`` program, compiled once per
    ``(fn, mesh, statics)`` and argument shapes: ``fn`` should be a stable function."""
    if mesh is None:
        return fn(*args, **kwargs)
    leaves, treedef = jax.tree.flatten(args)
    is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in leaves]
    arrays = [a for a, k in zip(leaves, is_array) if k]
    statics = tuple(_ARRAY if k else (type(a), a) for a, k in zip(leaves, is_array))
    mapped, jitted = _program(_replicated_program, fn, mesh, treedef, statics,
                              tuple(sorted(kwargs.items())))
    return (mapped if _traced(arrays) else jitted)(*arrays)


def indexer_kernel_call(mesh: jax.sharding.Mesh | None, fn: Callable, *args, implementation: str,
                        **kwargs):
    """``fn(*args, implementation=implementation, **kwargs)``: an indexer step's kernel
    (``kpool_compress``, ``index_scores``, ``topk_pools``, ``expand_selection``, ...). On a
    placed layer (``mesh``) a Pallas implementation runs on every device over its replicated
    inputs (``replicated_call``); ``"xla"`` is plain jnp that XLA partitions itself, so it,
    and any call without a mesh, is the plain call (module doc: the indexer is replicated)."""
    mesh = None if implementation == "xla" else mesh
    return replicated_call(mesh, fn, *args, implementation=implementation, **kwargs)


@functools.lru_cache(maxsize=256)
def _head_sharded_program(kernel: Callable, mesh, axis):
    """``(mapped, jitted)``: ``kernel`` under ``shard_map``, ``q_lat`` split on its head dim
    over ``axis``, and its ``jax.jit`` (cached as ``_replicated_program``)."""
    q_spec = P(None, None, axis, None)
    mapped = jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, P(), P()), out_specs=q_spec,
                           check_vma=False)
    return mapped, jax.jit(mapped)


def sharded_sparse_mla(q_lat, latent, token_ids, *, mesh: jax.sharding.Mesh | None, axis: str | None,
                       kernel: Callable):
    """Run ``kernel(q_lat, latent, token_ids)`` (a ``pk.sparse_mla`` partial) per head
    shard: ``q_lat [B, Q, H, C]`` split over ``axis`` on its head dim, the latent
    ``[B, L, C]`` and the ids ``[B, Q, W]`` replicated, the output ``[B, Q, H, C]`` split
    like ``q_lat``. Each device reads only its local latent copy; nothing is gathered.
    ``mesh=None``: the plain call. Outside a trace the ``shard_map`` runs as one
    ``jax.jit`` program cached per ``(kernel, mesh, axis)``: ``kernel`` should be a stable
    function (module-level or cached), not a closure made per call."""
    if mesh is None:
        return kernel(q_lat, latent, token_ids)
    mapped, jitted = _program(_head_sharded_program, kernel, mesh, axis)
    return (mapped if _traced((q_lat, latent, token_ids)) else jitted)(q_lat, latent, token_ids)


def row_parallel_out_sharding(o: jax.Array):
    """Output sharding for the row-parallel ``o_proj`` contraction ``[B, S, H, V] x [H, V,
    hidden] -> [B, S, hidden]``, whose contracted head axis may be sharded.

    Under ``Explicit`` mesh axes jax needs it given: ``o``'s batch and sequence sharding
    kept, ``hidden`` replicated, so the partial sums are all-reduced once. ``None`` (let
    XLA decide, which also all-reduces) when ``o`` carries no explicit sharding.
    """
    sh = getattr(jax.typeof(o), "sharding", None)
    if not isinstance(sh, NamedSharding) or sh.mesh.empty or not _explicit(sh.mesh):
        return None
    mesh = sh.mesh
    spec = tuple(sh.spec) + (None,) * (o.ndim - len(tuple(sh.spec)))
    return NamedSharding(mesh, P(*spec[:-2], None))
