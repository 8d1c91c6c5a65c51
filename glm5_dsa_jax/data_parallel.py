"""Data-parallel attention: a layer's call with the batch split over one mesh axis and the
heads over another (``shard_layer(layer, mesh, axis="tp", batch_axis="data")``).

Why the batch is split, not only the heads: MLA's latent has one head, so tensor
parallelism alone keeps the whole cache (and the whole indexer's work) on every device.
Split by sequence, each data shard holds and reads only its own sequences' cache and runs
the indexer only for them; within the shard the heads are split as before.

How it runs: the whole layer call is one ``jax.shard_map`` *manual over every mesh axis*
(``dp_call``). Each device gets its data shard's rows of the inputs and of the cache and
its tp shard of the head-sharded parameters (``layout``'s specs), merges a copy of the
layer with no mesh and runs the plain, single-device pipeline on them; only the
row-parallel ``o_proj`` is followed by an explicit ``psum`` over the tp axis
(``DsaAttention.reduce_axis``). Why manual over every axis rather than over the data axis
only with the TP path (``glm5_dsa_jax.parallel``) nested inside: the body is then plain
per-device code, so none of the TP path's ``shard_map``s, ``device_put``s and output
shardings has to work inside a partially manual region (on jax 0.10 and 0.12, ``Explicit``
and ``Auto`` axes alike), and the step's collectives are exactly the one the body writes.
It runs eagerly as one cached ``jax.jit`` program (as ``parallel``'s do) and inline under a
trace.

Invariants:

* **Split over the data axis**: the call's rows (``x``, ``mask``, ``prev_topk``,
  ``position_ids``, ``out``, ``topk``) and every cache field with a leading batch, sequence
  or page axis (``cache_specs``: every array of rank >= 1 is split on its leading axis; a
  field added later, e.g. an fp8 scale ``[B, L]`` or ``[N, page, ...]``, is placed the same
  way). ``DsaCache.length`` (one timeline for the batch) is the only scalar, replicated.
* **Split over the tp axis**: the ``"heads"`` axis of the parameters that have one
  (``layout.partition_specs``, the TP plan's specs). Everything else (the indexer's parameters, hence its scores and top-k) is replicated
  within a tp group and computed once per sequence by that group: top-k rows are the
  unsharded layer's, bit for bit (each row's arithmetic does not depend on its neighbours).
* **One collective**: the ``psum`` of the ``o_proj`` partial sums within each tp group
  (one all-reduce, replica groups = the tp groups). No cache is gathered: a device reads
  only the cache rows of its own sequences, which it holds.
* **Paged caches are split by sequence and by page.** ``PagedCache`` pools ``[N, ...]`` are
  split in ``dp`` blocks of ``N / dp`` pages and the page table is ``dp`` independent
  tables (``pages.PageTable``'s shards: block tables of local page ids, a free stack and
  ``n_free[k]`` per shard), so a shard's block table names only its own pages and no step
  reads another shard's pages. Globally: ``lengths`` / ``status`` / ``block_table`` rows
  are per sequence as before (block-table entries are local page ids of the row's shard);
  ``n_free [dp]`` is each shard's free-page count (their sum is the global one); ``free``
  is the shards' stacks side by side; ``latent_pool`` (every page, flat) holds shard ``k``'s
  page ``j`` at page ``k * N / dp + j``. ``release`` takes global row masks.
* A cache handed to a data-parallel layer must be placed as ``cache_shardings`` says on the
  layer's mesh (``init_cache`` / ``init_paged_cache`` of the placed layer do it; another
  mesh or placement raises ``ValueError``): moving a cache silently would gather or copy it.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_dsa_jax import layout
from glm5_dsa_jax.cache import PagedCache, init_paged_cache
from glm5_dsa_jax.parallel import put

__all__ = [
    "check_dp_mesh", "check_batch", "cache_specs", "cache_shardings", "place_cache",
    "dp_paged_cache", "check_cache_placement", "dp_call",
]


def check_dp_mesh(mesh: jax.sharding.Mesh, axis: str, batch_axis: str) -> int:
    """The size of ``batch_axis`` on ``mesh``; ``ValueError`` when it is the head axis or
    not an axis of the mesh."""
    if batch_axis == axis:
        raise ValueError(f"batch_axis and axis are both {axis!r}: the batch and the heads must be "
                         "split over two different mesh axes")
    if batch_axis not in mesh.axis_names:
        raise ValueError(f"mesh has axes {tuple(mesh.axis_names)} (shape {dict(mesh.shape)}) but no "
                         f"axis {batch_axis!r} to split the batch over")
    return int(mesh.shape[batch_axis])


def check_batch(rows: int, mesh: jax.sharding.Mesh, batch_axis: str, what: str = "batch") -> None:
    """``ValueError`` unless ``rows`` divides by the size of ``batch_axis``."""
    dp = int(mesh.shape[batch_axis])
    if rows % dp:
        raise ValueError(f"{what} of {rows} rows is not divisible by the {dp} data shards of mesh "
                         f"axis {batch_axis!r} (each shard takes {what} / {dp} rows)")


def cache_specs(cache, batch_axis: str):
    """``PartitionSpec`` per field of a cache (``None`` leaves kept): ``P(batch_axis)`` on
    the leading axis of every array of rank >= 1, ``P()`` for a scalar (the module doc)."""
    return jax.tree.map(lambda a: P(batch_axis) if np.ndim(a) else P(), cache)


def cache_shardings(cache, mesh: jax.sharding.Mesh, batch_axis: str):
    """``cache_specs`` as ``NamedSharding``s on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cache, batch_axis),
                        is_leaf=lambda s: isinstance(s, P))


def _check_splits(cache, mesh, batch_axis) -> None:
    dp = int(mesh.shape[batch_axis])
    if isinstance(cache, PagedCache) and cache.pages.shards != dp:
        raise ValueError(
            f"paged cache has {cache.pages.shards} page shard(s) but mesh axis {batch_axis!r} has "
            f"{dp}: its sequences and pages cannot be split over the data shards; make it with "
            "the placed layer's init_paged_cache")
    for path, a in jax.tree_util.tree_flatten_with_path(cache)[0]:
        if np.ndim(a) and a.shape[0] % dp:
            raise ValueError(f"cache field {jax.tree_util.keystr(path)} has {a.shape[0]} rows, not "
                             f"divisible by the {dp} data shards of mesh axis {batch_axis!r}")


def place_cache(cache, mesh: jax.sharding.Mesh, batch_axis: str):
    """``cache`` placed as ``cache_shardings`` says (traced leaves: a constraint)."""
    _check_splits(cache, mesh, batch_axis)
    return jax.tree.map(put, cache, cache_shardings(cache, mesh, batch_axis))


def dp_paged_cache(layer, max_seqs: int, num_pages: int, page_size: int = 64,
                   pages_per_seq: int | None = None, **kw) -> PagedCache:
    """An empty paged cache of a data-parallel ``layer`` split over its ``batch_axis`` (size ``dp``):
    ``paged_cache.init_paged_cache`` (``kw``: ``has_indexer``, ``dtype``) with its page
    table made ``dp`` shards of ``max_seqs / dp`` sequences and ``num_pages / dp`` pages
    (``pages``' module doc), then placed. ``pages_per_seq`` defaults to a shard's pages
    (capped at ``max_position_embeddings``). ``ValueError`` unless both divide by ``dp``."""
    mesh, batch_axis = layer.mesh, layer.batch_axis
    cache = init_paged_cache(layer.cfg, max_seqs, num_pages, page_size, pages_per_seq=pages_per_seq,
                             shards=int(mesh.shape[batch_axis]), **kw)
    return place_cache(cache, mesh, batch_axis)


def _trim(spec) -> P:
    """``spec`` without trailing ``None``s (``P('data', None)`` and ``P('data')`` are one
    placement)."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def check_cache_placement(cache, mesh: jax.sharding.Mesh, batch_axis: str) -> None:
    """``ValueError`` unless every concrete field of ``cache`` is on ``mesh`` as
    ``cache_shardings`` says (a traced field is checked only when its type carries a
    sharding, i.e. under ``Explicit`` axes)."""
    _check_splits(cache, mesh, batch_axis)
    want = cache_specs(cache, batch_axis)
    leaves = jax.tree_util.tree_flatten_with_path(cache)[0]
    specs = jax.tree.leaves(want, is_leaf=lambda s: isinstance(s, P))
    for (path, a), spec in zip(leaves, specs):
        if isinstance(a, jax.core.Tracer):
            sh = getattr(jax.typeof(a), "sharding", None)
            if sh is None or sh.mesh.empty or not any(
                    t == jax.sharding.AxisType.Explicit for t in sh.mesh.axis_types):
                continue
            got_mesh, got = sh.mesh, sh.spec
            same_mesh = (tuple(got_mesh.axis_names), dict(got_mesh.shape)) == (
                tuple(mesh.axis_names), dict(mesh.shape))
        else:
            sh = getattr(a, "sharding", None)
            got_mesh = getattr(sh, "mesh", None)
            got = getattr(sh, "spec", None)
            same_mesh = got_mesh == mesh
        name = jax.tree_util.keystr(path)
        if not same_mesh:
            where = "no mesh" if got_mesh is None else f"mesh {dict(got_mesh.shape)}"
            raise ValueError(
                f"cache field {name} is on {where}, not on the layer's mesh {dict(mesh.shape)} "
                f"(devices {[d.id for d in mesh.devices.flat]}): make the cache with the placed "
                "layer's init_cache / init_paged_cache, or sharding.place_cache it")
        if _trim(got) != _trim(spec):
            raise ValueError(
                f"cache field {name} is placed as {_trim(got)} but a data-parallel layer needs {spec} "
                f"(split by sequence over {batch_axis!r}): make the cache with the placed layer's "
                "init_cache / init_paged_cache, or sharding.place_cache(cache, mesh, batch_axis=...)")


# ------------------------------------------------------------------------------- the call
def _param_specs(state, cfg, layer_idx, axis):
    """``PartitionSpec`` per leaf of an ``nnx.split`` state: the layout's head-split specs."""
    plan = layout.partition_specs(cfg, axis, layer_idx=layer_idx)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    specs = []
    for path, _ in leaves:
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        specs.append(plan.get(names, P()))
    return treedef, tuple(specs)


def _local(cache):
    """A shard's view inside the body: a one-shard page table has a scalar ``n_free``."""
    if isinstance(cache, PagedCache) and cache.pages.n_free.ndim == 1:
        return cache.replace(pages=cache.pages.replace(n_free=cache.pages.n_free[0]))
    return cache


def _global(local, like):
    if isinstance(like, PagedCache) and like.pages.n_free.ndim == 1:
        return local.replace(pages=local.pages.replace(n_free=local.pages.n_free.reshape(1)))
    return local


@functools.lru_cache(maxsize=64)
def _program(graphdef, mesh, axis, batch_axis, state_treedef, state_specs, arg_treedef, arg_specs,
             out_specs):
    """``(mapped, jitted)``: the layer call under a ``shard_map`` manual over every mesh axis
    (module doc), and its ``jax.jit``; cached so eager calls reuse one compiled program."""
    state_in = jax.tree.unflatten(state_treedef, state_specs)
    args_in = jax.tree.unflatten(arg_treedef, arg_specs)
    outs = jax.tree.unflatten(out_specs[0], out_specs[1])

    def body(state, args):
        module = nnx.merge(graphdef, state)
        module.mesh, module.batch_axis, module.reduce_axis = None, None, axis
        cache = args.get("cache")
        res = module(args["x"], attention_mask=args["mask"], cache=_local(cache),
                     prev_topk=args.get("prev_topk"), position_ids=args.get("position_ids"))
        if cache is None:
            return res
        out, topk, local = res
        return out, topk, _global(local, cache)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(state_in, args_in), out_specs=outs,
                           check_vma=False)
    return mapped, jax.jit(mapped)


def dp_call(layer, x, mask, cache, prev_topk, position_ids):
    """The call of a data-parallel layer on checked inputs (``DsaAttention.__call__`` has run
    its checks): ``(out, topk)`` without a cache, ``(out, topk, cache)`` with one."""
    mesh, axis, bax = layer.mesh, layer.tp_axis, layer.batch_axis
    check_batch(x.shape[0], mesh, bax)
    if cache is not None:
        check_cache_placement(cache, mesh, bax)
    rows = NamedSharding(mesh, P(bax))
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    args = {"x": x, "mask": mask, "prev_topk": prev_topk, "position_ids": position_ids}
    args = {k: v for k, v in args.items() if v is not None}
    for k, v in args.items():
        if not isinstance(v, jax.core.Tracer):
            args[k] = put(v, rows)
        elif explicit and getattr(jax.typeof(v), "sharding", rows).mesh.empty:
            args[k] = jax.device_put(v, rows)  # a jit argument passed as a host array
    specs = {k: P(bax) for k in args}
    if cache is not None:
        args["cache"], specs["cache"] = cache, cache_specs(cache, bax)
    graphdef, state = nnx.split(layer)
    state_treedef, state_specs = _param_specs(state, layer.cfg, layer.layer_idx, axis)
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    spec_leaves, arg_treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    out = (P(bax), P(bax)) if cache is None else (P(bax), P(bax), specs["cache"])
    out_leaves, out_treedef = jax.tree.flatten(out, is_leaf=is_spec)
    mapped, jitted = _program(graphdef, mesh, axis, bax, state_treedef, state_specs, arg_treedef,
                              tuple(spec_leaves), (out_treedef, tuple(out_leaves)))
    traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((state, args)))
    return (mapped if traced else jitted)(state, args)
