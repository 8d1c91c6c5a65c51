"""Sequences that move: one paged sequence out of a cache as host arrays, and into a free row of
another paged cache (disaggregated serving: prefill on one mesh, decode on another; or a
paused sequence parked in host memory). ``PagedCache.export`` / ``PagedCache.load`` call
these functions; ``PagedDecoder.export`` / ``load`` wrap those.

Invariants:

* **An export is the sequence, not its pages.** ``ExportedSequence`` holds, in timeline
  order (position ``t`` is row ``t``): the latent rows ``[length, CR]`` and the pooled keys
  of the complete pools ``[length // KP, D]`` exactly as the cache holds them (the cache
  ``dtype``: an fp8 cache's e4m3 values and their float32 scales, one a row or ``G`` a row
  (``[length, G]``, the ``"group"`` layout), never dequantised; a 16-bit cache's floats, not
  a CPU's stored bits), and the rollback state: the whole stage (keys and gate logits ``[H,
  D]``, positions ``length - H .. length - 1``, ``H`` the source's ``stage_width``) and
  ``stage_from``, the first position whose raw key it holds (``glm5_dsa_jax.cache.rollback``),
  so a loaded sequence can take back what it could where it was. No page id, block table or
  page size: they are the source cache's bookkeeping and mean nothing in another cache, which
  re-pages the content at its own ``page_size``. The length is the rows' count
  (``latent.shape[0]``) and every geometry fact but ``kpool`` and ``rotate_index`` (static
  fields) is an array's shape or dtype, so an export cannot contradict itself
  (``check_exported`` checks one built by hand).
* **A load keeps what the target's stage can hold**: the last ``min(H_src, H_dst)`` stage
  entries, right-aligned, and ``stage_from`` raised to ``length - min(H_src, H_dst)`` where
  that is later. Into a stage as wide a sequence takes back what it could before; into a
  narrower one what that stage can restore (its ``max_rollback``, or down to a pool
  boundary).
* **What a load compares** (``geometry``): the latent row width, the layer kind (indexer
  state or not), ``KP`` and the index head dim, the cache dtype (fp8 included), an fp8
  cache's scales a latent row (``latent_scale_groups``: 1, or ``G`` of the ``"group"``
  layout), whether the pooled keys are rotated (``rotate_index``), an fp8 cache's pooled-key
  format (``index_keys``: e4m3, or int8 with group scales) and the stage dtype. Not compared: ``num_pages``, ``page_size``, ``max_seqs``, the mesh; a length
  past the target's ``max_length`` is refused.
* **A load refuses before it writes** (``check_load``, eager): a traced cache, a row out of
  range or in use, another geometry, too long, or too few free pages in the row's data
  shard raise ``ValueError`` naming the row and the sizes, and the cache is left as it was.
  Only then does the jitted write run: ``PageTable.reserve`` takes the row's pages from its
  shard's free stack (the same all-or-nothing path as a step; under the write's own guard a
  row that is not empty or does not get its pages writes nothing) and whole pages of
  content are scattered onto them. So a load is exactly a prefill of the same tokens as far
  as the page table is concerned, and ``PageTable.check`` holds after it.
* **Bounded compilation.** The content is padded on the host to a power of two of the
  target's pages (at most ``pages_per_seq``); the row and the length are traced. So a cache
  geometry and placement compiles at most ``ceil(log2(pages_per_seq)) + 1`` write programs
  (each for ``PagedCache.load`` and for the donating ``PagedDecoder.load``), whatever the
  lengths and rows; an export likewise gathers a power of two of pages.
* **Placement kept.** A placed cache's write is one program with its shardings as the
  output shardings (``glm5_dsa_jax.cache.eager``: replicated on a TP mesh, split by
  sequence and page over a data axis) run under ``jax.set_mesh`` of its mesh (``Explicit``
  axes: its gathers and scatters are told their output sharding). Over a data axis each shard scatters onto its own pages: the
  program all-reduces only int32 bookkeeping, never a pool (``load_hlo``, tested). An
  unplaced cache comes back uncommitted, as from a step, so the next step does not compile
  again. The export's host arrays carry no placement.
* Only paged caches move: the contiguous cache (``DsaCache``) holds one timeline for the
  whole batch, so one of its rows is not a sequence of its own to move.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_dsa_jax.cache.eager import explicit_sharding, mesh_of, program, run
from glm5_dsa_jax.cache.fp8 import is_fp8
from glm5_dsa_jax.cache.pages import OK
from glm5_dsa_jax.cpu_policy import from_store, to_store

__all__ = ["ExportedSequence", "export_sequence", "load_sequence", "check_load", "check_exported",
           "geometry", "load_hlo"]


@struct.dataclass
class ExportedSequence:
    """One paged sequence as host (numpy) arrays, in timeline order, without page ids (the
    module doc); a pytree, frozen. ``CR`` is the latent row width, ``KP`` the pool size,
    ``D`` the index head dim, ``H >= KP`` the source's stage width; the indexer fields are
    ``None`` for a shared-indexer layer and the scales ``None`` for a float cache. Only the
    last ``length - stage_from`` stage entries are specified (the rest are don't-care, as
    in the cache)."""

    latent: np.ndarray  # [length, CR], the cache dtype (e4m3 values for an fp8 cache)
    latent_scale: np.ndarray | None = None  # [length] or [length, G] float32, fp8 only
    pooled: np.ndarray | None = None  # [length // KP, D], the cache dtype (fp8: e4m3 or int8 keys): the complete pools
    pooled_scale: np.ndarray | None = None  # [length // KP] (e4m3) or [length // KP, G] (int8) float32, fp8 only
    stage_keys: np.ndarray | None = None  # [H, D], the stage dtype: positions length - H ..
    stage_gate: np.ndarray | None = None  # [H, D] float32
    stage_from: np.ndarray | None = None  # [] int32: first position whose raw key the stage holds
    kpool: int | None = struct.field(pytree_node=False, default=None)  # KP (None without an indexer)
    #: the pooled keys are stored Hadamard-rotated (the source cache's ``rotate_index``)
    rotate_index: bool = struct.field(pytree_node=False, default=False)

    @property
    def length(self) -> int:
        """Tokens the sequence holds (its next position)."""
        return int(self.latent.shape[0])

    @property
    def has_indexer(self) -> bool:
        return self.stage_keys is not None

    @property
    def dtype(self) -> np.dtype:
        """The cache dtype the rows are in (``float8_e4m3fn`` for fp8)."""
        return np.dtype(self.latent.dtype)

    def nbytes(self) -> int:
        """Host bytes of the export."""
        return sum(np.asarray(a).nbytes for a in jax.tree.leaves(self))


def geometry(source) -> dict:
    """What a load compares (the module doc), of a ``PagedCache`` or an ``ExportedSequence``:
    ``{name: value}`` with ``latent_width``, ``has_indexer``, ``kpool``, ``index_head_dim``
    (both None without an indexer), ``dtype``, ``latent_scale_groups`` (scales a latent
    row: 1 or the ``"group"`` layout's ``G``; None for a float cache), ``rotate_index``
    (rotated pooled keys), ``index_keys`` (an fp8 cache's pooled-key format, ``"e4m3"`` or
    ``"int8"``; None for a float cache or without an indexer), ``index_scale_groups`` (scales a
    pooled key: 1, or int8's ``G``), ``stage_dtype`` (None without an indexer)."""
    if isinstance(source, ExportedSequence):
        width, stage, kp = source.latent.shape[-1], source.stage_keys, source.kpool
        row_axes = 1  # [length(, G)]
        keys = None if source.pooled is None else np.dtype(source.pooled.dtype)
        pool_axes = 1  # [length // KP(, G)]
    else:
        width, stage, kp = source.latent_store.shape[-1], source.stage_keys, source.kpool
        row_axes = 2  # [N, page_size(, G)]
        keys = None if source.pooled_store is None else jnp.dtype(source.pooled_dtype)
        pool_axes = 2  # [N, PPP(, G)]
    sc = source.latent_scale
    groups = None if sc is None else int(np.prod(np.shape(sc)[row_axes:], dtype=int))
    return dict(latent_width=int(width), has_indexer=stage is not None, latent_scale_groups=groups,
                rotate_index=bool(source.rotate_index),
                index_keys=None if keys is None or sc is None else ("int8" if keys == np.int8 else "e4m3"),
                index_scale_groups=None if keys is None or source.pooled_scale is None else
                int(np.prod(np.shape(source.pooled_scale)[pool_axes:], dtype=int)),
                kpool=None if stage is None else kp,
                index_head_dim=None if stage is None else int(stage.shape[-1]),
                dtype=jnp.dtype(source.dtype).name,
                stage_dtype=None if stage is None else jnp.dtype(stage.dtype).name)


def _check_eager(cache, what: str) -> None:
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(cache)):
        raise ValueError(f"PagedCache.{what} is an eager (host) operation: call it outside jit, "
                         "on a concrete cache")


def _check_row(cache, row) -> int:
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < cache.max_seqs:
        raise ValueError(f"row must be an int in [0, max_seqs={cache.max_seqs}), got {row!r}")
    return int(row)


def _pow2_pages(n: int, cap: int) -> int:
    """``n`` pages padded to a power of two, at most ``cap`` (the module doc's compile bound)."""
    return min(1 << max(n - 1, 0).bit_length(), cap)


def _shard_of(cache, row):
    """The data shard of row ``row`` (``pages``' module doc: rows ``k * m .. (k+1) * m - 1``)."""
    return row // (cache.max_seqs // cache.pages.shards)


def _global_pages(cache, row, local):
    """Row ``row``'s local page ids as ids into the pools (a data shard's pages lie at
    ``shard * pages_per_shard``; ``pages``' module doc). ``row`` may be traced."""
    return _shard_of(cache, row) * cache.pages.pages_per_shard + local


# ---------------------------------------------------------------------------- export
def _gather(latent_store, latent_scale, pooled_store, pooled_scale, stage_keys, stage_gate, ids, row,
            *, dtype, pooled_dtype):
    """The pages ``ids`` of every pool (as the cache ``dtype``) and the stage of ``row``."""
    def take(a, at):
        if a is None:
            return None
        sharding = explicit_sharding(a)  # explicit axes: gathered onto every device
        return a.at[at].get(out_sharding=None if sharding is None else NamedSharding(sharding.mesh, P()))

    return (from_store(take(latent_store, ids), dtype), take(latent_scale, ids),
            None if pooled_store is None else from_store(take(pooled_store, ids), pooled_dtype),
            take(pooled_scale, ids),
            *(None if a is None else take(a, row[None])[0] for a in (stage_keys, stage_gate)))


_GATHER = jax.jit(_gather, static_argnames=("dtype", "pooled_dtype"))


def export_sequence(cache, row: int) -> ExportedSequence:
    """Sequence ``row`` of the paged ``cache`` as an ``ExportedSequence`` (the module doc).
    Eager only; ``ValueError`` naming the row for a row out of range, an empty or released
    row (length 0), or a broken page table (``PageTable.check``). The cache is not changed.
    Reads only the row's pages (padded to a power of two of pages: bounded compilations)."""
    _check_eager(cache, "export")
    row = _check_row(cache, row)
    cache.pages.check()
    length = int(np.asarray(cache.lengths)[row])
    if length == 0:
        raise ValueError(f"row {row} holds no sequence (length 0: empty or released): nothing to export")
    n = int(cache.pages.pages_needed(length))
    local = np.zeros(_pow2_pages(n, cache.pages_per_seq), np.int32)
    local[:n] = np.asarray(cache.block_table)[row, :n]
    with mesh_of(cache):
        got = _GATHER(cache.latent_store, cache.latent_scale, cache.pooled_store, cache.pooled_scale,
                      cache.stage_keys, cache.stage_gate, _global_pages(cache, row, local), np.int32(row),
                      dtype=cache.dtype, pooled_dtype=getattr(cache, "pooled_dtype", cache.dtype))
    lat, lat_scale, pooled, pooled_scale, stage_keys, stage_gate = (
        None if a is None else np.asarray(a) for a in got)
    width = lat.shape[-1]
    out = dict(latent=lat.reshape(-1, width)[:length],
               latent_scale=None if lat_scale is None else lat_scale.reshape((-1,) + lat_scale.shape[2:])[:length])
    if cache.has_indexer:
        kp = cache.kpool
        n_pools = length // kp
        # The whole stage and the first position it holds: the rollback state goes along.
        held = max(int(np.asarray(cache.stage_from)[row]), length - cache.stage_width, 0)
        out.update(pooled=pooled.reshape(-1, pooled.shape[-1])[:n_pools],
                   pooled_scale=None if pooled_scale is None else
                   pooled_scale.reshape((-1,) + pooled_scale.shape[2:])[:n_pools],
                   stage_keys=stage_keys, stage_gate=stage_gate, stage_from=np.int32(held), kpool=kp)
    return ExportedSequence(**out, rotate_index=cache.rotate_index)


# ---------------------------------------------------------------------------- load
def check_exported(exported) -> None:
    """``ValueError`` unless ``exported`` is an ``ExportedSequence`` whose arrays agree with
    each other (one built by hand or read back from storage), naming the field, the shape
    and dtype it must have and the ones it has."""
    if not isinstance(exported, ExportedSequence):
        raise ValueError(f"expected an ExportedSequence (PagedCache.export), got {type(exported).__name__}")
    e, lat = exported, exported.latent
    if not isinstance(lat, np.ndarray) or lat.ndim != 2 or lat.shape[0] < 1:
        raise ValueError(f"ExportedSequence.latent must be a numpy [length >= 1, CR] array, got "
                         f"{type(lat).__name__} {np.shape(lat)}")
    length, fp8 = lat.shape[0], is_fp8(lat.dtype)
    sc = e.latent_scale  # [length] or [length, G > 1] (group scales)
    groups = tuple(np.shape(sc)[1:2]) if sc is not None and np.ndim(sc) == 2 and np.shape(sc)[1] > 1 else ()
    want = {"latent_scale": ((length, *groups), np.float32) if fp8 else None}
    if e.stage_keys is None:
        want.update(pooled=None, pooled_scale=None, stage_gate=None, stage_from=None)
        if e.kpool is not None:
            raise ValueError(f"ExportedSequence.kpool must be None without indexer state (stage_keys None), "
                             f"got {e.kpool!r}")
    else:
        kp = e.kpool
        if isinstance(kp, bool) or not isinstance(kp, (int, np.integer)) or kp < 1:
            raise ValueError(f"ExportedSequence.kpool must be an int >= 1 (the pool size) with indexer state, "
                             f"got {kp!r}")
        if np.ndim(e.stage_keys) != 2 or np.shape(e.stage_keys)[0] < kp:
            raise ValueError(f"ExportedSequence.stage_keys must be [H >= kpool={kp}, D], got {np.shape(e.stage_keys)}")
        h, d = np.shape(e.stage_keys)
        # An fp8 cache's pooled keys: e4m3 with a scale each, or int8 with G scales each.
        int8 = fp8 and e.pooled is not None and np.asarray(e.pooled).dtype == np.int8
        pgroups = (np.shape(e.pooled_scale)[1] if np.ndim(e.pooled_scale) == 2 else "G",) if int8 else ()
        want.update(pooled=((length // kp, d), np.int8 if int8 else lat.dtype), stage_gate=((h, d), np.float32),
                    pooled_scale=((length // kp, *pgroups), np.float32) if fp8 else None, stage_from=((), np.int32))
    for name, spec in want.items():
        a = getattr(e, name)
        got = None if a is None else f"{np.asarray(a).dtype.name} {tuple(np.shape(a))}"
        if spec is None and a is not None:
            raise ValueError(f"ExportedSequence.{name} must be None (latent is {lat.dtype.name}, stage_keys "
                             f"{'None' if e.stage_keys is None else 'set'}), got {got}")
        if spec is not None and (a is None or got != f"{np.dtype(spec[1]).name} {spec[0]}"):
            raise ValueError(f"ExportedSequence.{name} must be {np.dtype(spec[1]).name} {spec[0]} for a "
                             f"sequence of {length} tokens, got {got}")
    if e.stage_keys is not None and int(e.stage_from) < max(length - h, 0):
        raise ValueError(f"ExportedSequence.stage_from = {int(e.stage_from)} but its stage of {h} entries "
                         f"holds positions {max(length - h, 0)} .. {length - 1} only (stage_from >= "
                         f"{max(length - h, 0)})")


def check_load(cache, row: int, exported: ExportedSequence) -> None:
    """Every refusal of ``load_sequence``, before anything is written (the module doc):
    ``ValueError`` naming the row, the field and the sizes. Needs a concrete cache."""
    _check_eager(cache, "load")
    row = _check_row(cache, row)
    check_exported(exported)
    have, want = geometry(cache), geometry(exported)
    if have["has_indexer"] != want["has_indexer"]:
        diff = [f"layer kind: the sequence {'has' if want['has_indexer'] else 'lacks'} indexer state, the "
                f"cache {'has' if have['has_indexer'] else 'lacks'} it (a full vs a shared-indexer layer)"]
    else:
        diff = [f"{k} {want[k]} (the cache's: {have[k]})" for k in have if have[k] != want[k]]
    if diff:
        raise ValueError(f"cannot load the sequence into row {row}: it differs from the cache in "
                         + "; ".join(diff) + "; nothing was written")
    cache.pages.check()
    lengths = np.asarray(cache.lengths)
    if lengths[row]:
        raise ValueError(f"cannot load into row {row}: it is in use (holds {int(lengths[row])} tokens); "
                         "release it first or pick a free row; nothing was written")
    if exported.length > cache.max_length:
        raise ValueError(f"cannot load a sequence of {exported.length} tokens into row {row}: more than "
                         f"pages_per_seq * page_size = {cache.max_length}; nothing was written")
    need, shard = int(cache.pages.pages_needed(exported.length)), _shard_of(cache, row)
    m = cache.max_seqs // cache.pages.shards
    free = int(np.asarray(cache.pages.n_free).reshape(-1)[shard])
    if need > free:
        where = "" if cache.pages.shards == 1 else f" in data shard {shard} (rows {shard * m} .. {shard * m + m - 1})"
        raise ValueError(f"cannot load a sequence of {exported.length} tokens into row {row}: it needs {need} "
                         f"pages of {cache.page_size} tokens but only {free} are free{where} (short by "
                         f"{need - free}); nothing was written")


def _paged(a, length: int, per_page: int, pages: int, fill):
    """Timeline rows ``a [length, ...]`` re-paged as ``[pages, per_page, ...]`` (padded with ``fill``)."""
    out = np.full((pages * per_page,) + a.shape[1:], fill, a.dtype)
    out[:length] = a[:length]
    return out.reshape((pages, per_page) + a.shape[1:])


def _payload(cache, exported: ExportedSequence) -> dict:
    """The export re-paged at the cache's page size, padded to a power of two of pages."""
    ps, e = cache.page_size, exported
    pages = _pow2_pages(int(cache.pages.pages_needed(e.length)), cache.pages_per_seq)
    out = dict(length=np.int32(e.length), latent=_paged(e.latent, e.length, ps, pages, 0),
               latent_scale=None if e.latent_scale is None else _paged(e.latent_scale, e.length, ps, pages, 1))
    if e.has_indexer:
        n, ppp = e.pooled.shape[0], ps // e.kpool
        kept = min(e.stage_keys.shape[0], cache.stage_width)  # the last entries the target holds
        out.update(pooled=_paged(e.pooled, n, ppp, pages, 0), stage_keys=e.stage_keys[-kept:],
                   stage_gate=e.stage_gate[-kept:],
                   stage_from=np.int32(max(int(e.stage_from), e.length - kept, 0)),
                   pooled_scale=None if e.pooled_scale is None else _paged(e.pooled_scale, n, ppp, pages, 1))
    return out


def _write(cache, payload: dict, row):
    """The jitted write of a load: reserve the row's pages, scatter whole pages of content.
    Guarded as a step is (``ok``): a row not empty, or refused its pages, writes nothing
    (``check_load`` refuses both before this runs)."""
    is_row = _placed_like(jnp.arange(cache.max_seqs, dtype=jnp.int32) == row, cache.lengths)
    empty = jnp.sum(jnp.where(is_row, cache.lengths, 0)) == 0
    pages, status = cache.pages.reserve(jnp.where(is_row & empty, payload["length"], 0))
    ok = empty & (jnp.sum(jnp.where(is_row, status, 0)) == OK)
    pages = jax.tree.map(lambda new, old: jnp.where(ok, new, old), pages, cache.pages)
    n = payload["latent"].shape[0]
    local = jnp.sum(jnp.where(is_row[:, None], pages.block_table[:, :n], 0), axis=0)
    dest = jnp.where(ok & (local >= 0), _global_pages(cache, row, local), cache.num_pages)

    def put(store, content, stored=True, dtype=cache.dtype):
        if store is None:
            return None
        content = to_store(content, dtype, store.dtype) if stored else content
        return store.at[dest].set(content.astype(store.dtype), mode="drop", out_sharding=explicit_sharding(store))

    upd = dict(pages=pages, status=jnp.where(is_row, status, cache.status),
               latent_store=put(cache.latent_store, payload["latent"]),
               latent_scale=put(cache.latent_scale, payload["latent_scale"], False))
    if cache.has_indexer:
        sel = (is_row & ok)[:, None, None]
        h = cache.stage_width

        def staged(a):  # the export's last entries right-aligned in the H-wide stage
            return jnp.concatenate([jnp.zeros((h - a.shape[0],) + a.shape[1:], a.dtype), a], 0)[None]

        upd.update(pooled_store=put(cache.pooled_store, payload["pooled"], dtype=cache.pooled_dtype),
                   pooled_scale=put(cache.pooled_scale, payload["pooled_scale"], False),
                   stage_keys=jnp.where(sel, staged(payload["stage_keys"]), cache.stage_keys),
                   stage_gate=jnp.where(sel, staged(payload["stage_gate"]), cache.stage_gate),
                   stage_from=jnp.where(is_row & ok, payload["stage_from"], cache.stage_from))
    return cache.replace(**upd)


def _placed_like(a, ref):
    """``a`` resharded as ``ref`` where ``ref``'s type carries an ``Explicit`` sharding (an
    elementwise op there wants its operands split alike), else ``a``."""
    sharding = explicit_sharding(ref)
    return a if sharding is None else jax.sharding.reshard(a, sharding)


def load_sequence(cache, row: int, exported: ExportedSequence, *, donate: bool = False):
    """``cache`` with ``exported`` placed into its free row ``row`` (the module doc): the
    sequence's pages reserved from the row's data shard and its content, stage and length
    written; ``status[row]`` is ``OK``. Refusals (``check_load``) raise ``ValueError`` before
    anything is written. ``donate=True`` donates ``cache``'s buffers to the write (in place;
    ``PagedDecoder.load``), else the result is a new cache and ``cache`` stays valid."""
    check_load(cache, row, exported)
    return run(_write, cache, _payload(cache, exported), np.int32(row), donate=donate)


def load_hlo(cache, row: int, exported: ExportedSequence) -> str:
    """The compiled program of ``load_sequence(cache, row, exported)``'s write as optimized
    HLO text, not run: for inspecting it (on a data x tp mesh each shard writes its own
    pages and only int32 bookkeeping is reduced, ``tests/test_move_sequence.py``)."""
    check_load(cache, row, exported)
    with mesh_of(cache):
        return program(_write, cache).lower(cache, _payload(cache, exported), np.int32(row)).compile().as_text()
