"""Where a placed layer's arrays live: the ``Placement`` value and the placement of inputs and caches.

``shard_layer`` (``glm5_dsa_jax.parallel.sharding``) records one ``Placement(mesh, axis,
batch_axis)`` on the layer; the layer's call then runs as one ``shard_map`` over that mesh
(``glm5_dsa_jax.parallel.execution``). This module says what is split and what is
replicated; it imports no layer, cache or plan code (the cache package places its page
tables with ``put``), so it sits low in the import order.

Invariants:

* **Split over the head axis** (``Placement.axis``): only the parameters with a
  ``"heads"`` axis (``layout.partition_specs``); everything else, the whole indexer
  included, is replicated, so every device of a head group computes the same selection.
* **Split over the batch axis** (``Placement.batch_axis``, data parallelism): the call's
  rows (``x``, ``mask``, ``prev_topk``, ``position_ids``, ``out``, ``topk``) and every
  cache field of rank >= 1 on its leading (batch / sequence / page) axis
  (``cache_specs``; a field added later is placed the same way). Scalars
  (``DsaCache.length``) are replicated. Without a batch axis (tensor parallelism alone)
  the rows and the caches are replicated: the same program with the batch unsplit.
* **Paged caches under a batch axis are split by sequence and by page**: ``dp``
  independent page tables (``pages.PageTable``'s shards), so no shard reads another's
  pages; ``n_free [dp]`` is each shard's free-page count.
* A cache handed to a data-parallel layer must be placed as ``cache_shardings`` says
  (``check_cache_placement``, ``ValueError`` otherwise): moving it silently would gather or
  copy it. Under tensor parallelism alone a cache not yet on the mesh is replicated onto
  it, as the call's inputs are.
* **Split over the sequence axis** (``Placement.seq_axis``, context parallelism; a
  contiguous cache): the cache's token-axis fields (its class's ``TOKEN_AXIS_FIELDS``: the latent
  rows, their validity and fp8 scales, the pooled keys, their validity and scales) are split on their
  axis 1 (slots / pools) into ``cp`` contiguous ranges, device ``i`` of the axis holding
  slots ``[i * L / cp, (i + 1) * L / cp)`` and pools ``[i * P / cp, (i + 1) * P / cp)``;
  everything else (``length``, the incomplete pool's stage, ``first_key``, ``n_valid``)
  is replicated over it (split by sequence over a batch axis as before). The capacity must
  divide by ``cp * kpool`` (``check_seq_split``), so that every device holds whole pools
  and ``P / cp`` of them. The call's rows are replicated over the sequence axis.
* **A paged cache over the sequence axis** splits its page pools (its class's
  ``PAGE_AXIS_FIELDS``) on their page axis into ``cp`` blocks of whole pages (within each
  data shard's block under a batch axis: ``P((batch_axis, seq_axis))``); the page table,
  stage and status are replicated over it. ``num_pages / dp`` must divide by ``cp``
  (``check_page_split``). ``parallel.context_paged`` says why.
* Host values are placed also when the mesh spans processes (``jax.distributed``: every
  process passes the same host values and keeps its shards); ``Explicit`` and ``Auto``
  axis types alike.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = [
    "Placement", "put", "replicate", "check_dp_mesh", "check_batch", "cache_specs",
    "cache_shardings", "place_cache", "check_cache_placement", "check_seq_mesh", "check_seq_split",
    "check_page_split",
]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a layer runs: ``mesh``, the head ``axis``, for data parallelism the
    ``batch_axis`` its rows and caches are split over, and for context parallelism the
    ``seq_axis`` its caches' tokens are split over. Set once, by ``shard_layer``."""

    mesh: jax.sharding.Mesh
    axis: str
    batch_axis: str | None = None
    seq_axis: str | None = None

    @property
    def seq_shards(self) -> int:
        """The size of the sequence axis (1 without one)."""
        return 1 if self.seq_axis is None else int(self.mesh.shape[self.seq_axis])

    @property
    def explicit(self) -> bool:
        """Whether the mesh has ``Explicit`` axes (traced values then carry shardings)."""
        return any(t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types)

    @property
    def data_shards(self) -> int:
        """The size of the batch axis (1 without one)."""
        return 1 if self.batch_axis is None else int(self.mesh.shape[self.batch_axis])

    @property
    def row_spec(self) -> P:
        """The ``PartitionSpec`` of a call's ``[B, ...]`` rows: split over the batch axis."""
        return P(self.batch_axis) if self.batch_axis else P()

    def place_rows(self, *arrays):
        """A call's row arrays placed as ``row_spec`` (``None`` kept). Concrete arrays are
        put there; a traced one is constrained only under ``Explicit`` axes when it carries
        no sharding yet (a jit argument passed as a host array): the ``shard_map`` of the
        call needs its operands on the mesh."""
        rows = NamedSharding(self.mesh, self.row_spec)
        out = []
        for a in arrays:
            if a is None or (isinstance(a, jax.core.Tracer) and not (
                    self.explicit and getattr(jax.typeof(a), "sharding", rows).mesh.empty)):
                out.append(a)
            else:
                out.append(put(a, rows))
        return tuple(out)

    def place_call_cache(self, cache):
        """The cache of a call, as the call's ``shard_map`` takes it: checked (a batch axis:
        ``check_cache_placement``) or replicated onto the mesh (tensor parallelism alone)."""
        if cache is None:
            return None
        if self.seq_axis is not None:
            check_cache_placement(cache, self.mesh, self.batch_axis, self.seq_axis)
            return cache
        if self.batch_axis is None:
            return replicate(cache, self.mesh)
        check_cache_placement(cache, self.mesh, self.batch_axis)
        return cache


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
    leaves constrained). ``mesh=None``: ``tree`` unchanged."""
    if mesh is None:
        return tree
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: put(a, rep), tree)


def check_dp_mesh(mesh: jax.sharding.Mesh, axis: str | None, batch_axis: str) -> int:
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


def check_seq_mesh(mesh: jax.sharding.Mesh, axis: str | None, batch_axis: str | None, seq_axis: str) -> int:
    """The size of ``seq_axis`` on ``mesh``; ``ValueError`` when it is the head or the batch
    axis, or not an axis of the mesh."""
    for other, what in ((axis, "axis (the heads)"), (batch_axis, "batch_axis (the sequences)")):
        if other is not None and seq_axis == other:
            raise ValueError(f"seq_axis and {what} are both {seq_axis!r}: a sequence's tokens must be "
                             "split over a mesh axis of their own")
    if seq_axis not in mesh.axis_names:
        raise ValueError(f"mesh has axes {tuple(mesh.axis_names)} (shape {dict(mesh.shape)}) but no "
                         f"axis {seq_axis!r} to split the sequence's tokens over")
    return int(mesh.shape[seq_axis])


def check_seq_split(max_length: int, kpool: int, cp: int, seq_axis: str) -> None:
    """``ValueError`` unless a contiguous cache of ``max_length`` slots splits into ``cp``
    ranges of whole pools (``max_length % (cp * kpool) == 0``)."""
    if max_length % (cp * kpool):
        raise ValueError(
            f"cache capacity max_length={max_length} is not divisible by cp * kpool = {cp} * {kpool} = "
            f"{cp * kpool}: the {cp} devices of mesh axis {seq_axis!r} each hold a contiguous range of "
            "whole pools; make the cache with a multiple of that")


def _seq_split_field(cache, path, kind: str) -> bool:
    last = path[-1] if path else None
    fields = getattr(cache, kind, ())
    return isinstance(last, jax.tree_util.GetAttrKey) and last.name in fields


def cache_specs(cache, batch_axis: str | None, seq_axis: str | None = None):
    """``PartitionSpec`` per field of a cache (``None`` leaves kept): ``P(batch_axis)`` on
    the leading axis of every array of rank >= 1, ``P()`` for a scalar (the module doc);
    every field ``P()`` without a batch axis. With a ``seq_axis`` a contiguous cache's
    ``TOKEN_AXIS_FIELDS`` are also split on their axis 1 over it (``P(batch_axis, seq_axis)``)
    and a paged cache's ``PAGE_AXIS_FIELDS`` (its page pools) on their page axis, within
    each data shard's block of pages (``P((batch_axis, seq_axis))``)."""
    def spec(path, a):
        if seq_axis is not None and _seq_split_field(cache, path, "TOKEN_AXIS_FIELDS"):
            return P(batch_axis, seq_axis)
        if seq_axis is not None and _seq_split_field(cache, path, "PAGE_AXIS_FIELDS"):
            return P((batch_axis, seq_axis) if batch_axis else seq_axis)
        return P(batch_axis) if batch_axis and np.ndim(a) else P()
    return jax.tree_util.tree_map_with_path(spec, cache)


def cache_shardings(cache, mesh: jax.sharding.Mesh, batch_axis: str | None, seq_axis: str | None = None):
    """``cache_specs`` as ``NamedSharding``s on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cache, batch_axis, seq_axis),
                        is_leaf=lambda s: isinstance(s, P))


def check_page_split(num_pages: int, data_shards: int, cp: int, seq_axis: str) -> None:
    """``ValueError`` unless a paged cache of ``num_pages`` pages (``data_shards`` blocks of
    them over a batch axis) splits each block into ``cp`` blocks of whole pages."""
    if num_pages % (data_shards * cp):
        raise ValueError(
            f"paged cache num_pages={num_pages} is not divisible by data shards * cp = {data_shards} * {cp} = "
            f"{data_shards * cp}: the {cp} devices of mesh axis {seq_axis!r} each hold a block of "
            f"every data shard's pages; make the cache with a multiple of that")


def _check_seq_splits(cache, mesh, seq_axis) -> None:
    cp = int(mesh.shape[seq_axis])
    pages = getattr(cache, "pages", None)
    if pages is not None:
        check_page_split(cache.num_pages, pages.shards, cp, seq_axis)
        return
    check_seq_split(cache.max_length, cache.kpool if cache.has_indexer else 1, cp, seq_axis)


def _check_splits(cache, mesh, batch_axis, seq_axis=None) -> None:
    if seq_axis is not None:
        _check_seq_splits(cache, mesh, seq_axis)
    if batch_axis is None:
        return
    dp = int(mesh.shape[batch_axis])
    pages = getattr(cache, "pages", None)  # a paged cache's page table
    if pages is not None and pages.shards != dp:
        raise ValueError(
            f"paged cache has {pages.shards} page shard(s) but mesh axis {batch_axis!r} has "
            f"{dp}: its sequences and pages cannot be split over the data shards; make it with "
            "the placed layer's init_paged_cache")
    for path, a in jax.tree_util.tree_flatten_with_path(cache)[0]:
        if np.ndim(a) and a.shape[0] % dp:
            what = "pages" if pages is not None and a.shape[0] != pages.max_seqs else "sequences"
            raise ValueError(f"the cache's batch of {a.shape[0]} {what} is not divisible by the {dp} data "
                             f"shards of mesh axis {batch_axis!r} (its field {jax.tree_util.keystr(path)}): "
                             f"make it with a multiple of {dp}")


def place_cache(cache, mesh: jax.sharding.Mesh, batch_axis: str | None, seq_axis: str | None = None):
    """``cache`` placed as ``cache_shardings`` says (traced leaves: a constraint)."""
    if batch_axis is None and seq_axis is None:
        return replicate(cache, mesh)
    _check_splits(cache, mesh, batch_axis, seq_axis)
    return jax.tree.map(put, cache, cache_shardings(cache, mesh, batch_axis, seq_axis))


def _trim(spec) -> P:
    """``spec`` without trailing ``None``s (``P('data', None)`` and ``P('data')`` are one
    placement)."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def check_cache_placement(cache, mesh: jax.sharding.Mesh, batch_axis: str | None,
                          seq_axis: str | None = None) -> None:
    """``ValueError`` unless every concrete field of ``cache`` is on ``mesh`` as
    ``cache_shardings`` says (a traced field is checked only when its type carries a
    sharding, i.e. under ``Explicit`` axes)."""
    _check_splits(cache, mesh, batch_axis, seq_axis)
    want = cache_specs(cache, batch_axis, seq_axis)
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
            if seq_axis is None:
                raise ValueError(
                    f"cache field {name} is placed as {_trim(got)} but a data-parallel layer needs {spec} "
                    f"(split by sequence over {batch_axis!r}): make the cache with the placed layer's "
                    "init_cache / init_paged_cache, or sharding.place_cache(cache, mesh, batch_axis=...)")
            raise ValueError(
                f"cache field {name} is placed as {_trim(got)} but a context-parallel layer needs {spec} "
                f"(split by sequence over batch_axis {batch_axis!r}, by slot over seq_axis {seq_axis!r}): "
                "make the cache with the placed layer's init_cache, or "
                "sharding.place_cache(cache, mesh, batch_axis=..., seq_axis=...)")
