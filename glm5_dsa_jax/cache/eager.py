"""Eager operations on a concrete paged cache (``release``, ``rollback`` / ``truncate``, a
``load``'s write, ``export``'s gather): each runs as one jitted program, placed where the
cache is.

Invariants:

* **One program per (operation, cache structure, placement, donation)**, cached in
  ``_PROGRAMS`` (jax keys the shapes): an eager operation compiles once per cache
  geometry, however often it runs. Why not op by op: an eager ``release`` or ``rollback``
  is a few dozen small jax ops, each dispatched (and, for a new shape, compiled) on its
  own; one program is one dispatch.
* **Placement kept.** A placed cache's operation is traced under ``jax.set_mesh`` of its
  mesh (``mesh_of``) with the cache's own shardings as the output's, so a TP cache stays
  replicated and a data x tp cache stays split by sequence and page. Op by op on
  ``Explicit`` axes each op's result is put on one device, and jax (0.10) refuses the next
  op on a sharded operand ("Length of device assignment 1 is not equal to the size of
  the mesh"); inside one program under the mesh every op is told its mesh. An unplaced
  cache comes back uncommitted, as from a step, so the next step does not compile again.
* **Under a trace nothing is wrapped**: the caller's ``jit`` (a step, ``PagedDecoder``)
  places the operation; ``traced`` tells the two apart. Each operation's function is
  passed as a stable (module-level or class) function, so the program cache hits.
* Checks that need concrete values (``check_rollback``, ``check_load``) run before the
  program, on the host; the program itself is the jit-safe path.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import NamedSharding

__all__ = ["traced", "mesh_of", "is_placed", "explicit_sharding", "program", "run"]


def traced(*trees) -> bool:
    """Whether any leaf of ``trees`` is a tracer (the call is inside a ``jit`` / ``vmap``)."""
    return any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(trees))


def is_placed(cache) -> bool:
    """Whether ``cache`` lives on a mesh (its pools carry a ``NamedSharding``)."""
    return isinstance(getattr(cache.latent_store, "sharding", None), NamedSharding)


def mesh_of(cache):
    """``jax.set_mesh`` of the mesh ``cache`` is placed on (a no-op context for an unplaced
    one): a program over explicitly sharded values is traced under its mesh (newer jax
    refuses a sharded value's ops without it)."""
    return jax.set_mesh(cache.latent_store.sharding.mesh) if is_placed(cache) else contextlib.nullcontext()


def explicit_sharding(a):
    """``a``'s sharding where its type carries one (``Explicit`` mesh axes: a gather or
    scatter there must be told its output's), else None (placed by the program's output
    shardings)."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    explicit = sharding is not None and not sharding.mesh.empty and any(
        t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
    return sharding if explicit else None


_PROGRAMS: dict = {}


def program(fn, cache, *, donate: bool = False):
    """The jitted ``fn(cache, *args) -> cache`` for this cache's structure and placement (the
    module doc): a placed cache's shardings are the output's; ``donate`` donates the
    cache's buffers (in place; the caller's cache is then invalid)."""
    shardings = jax.tree.map(lambda a: a.sharding, cache) if is_placed(cache) else None
    key = (fn, jax.tree.structure(cache), tuple(jax.tree.leaves(shardings)), donate)
    if key not in _PROGRAMS:
        kw = {} if shardings is None else dict(out_shardings=shardings)
        _PROGRAMS[key] = jax.jit(fn, donate_argnums=(0,) if donate else (), **kw)
    return _PROGRAMS[key]


def run(fn, cache, *args, donate: bool = False):
    """``fn(cache, *args)`` as ``program`` (under the cache's mesh): the eager path of an
    operation whose traced path is ``fn`` itself."""
    with mesh_of(cache):
        return program(fn, cache, donate=donate)(cache, *args)
