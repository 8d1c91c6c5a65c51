"""Orbax checkpoints of DSA layers: ``save_checkpoint``, ``read_checkpoint_meta``,
``restore_checkpoint``; and of a contiguous decode cache: ``save_cache``, ``restore_cache``.

Layout: ``path/params`` (an ``ocp.StandardCheckpointer`` tree ``{"layer_<i>": params}``)
and ``path/glm5_dsa_jax.json`` (``META_FILE``: format, version, the ``DsaConfig``, the layer
indices, dtypes and a digest per array).

Invariants:

* **Never a lost or partial checkpoint.** Everything is written into a hidden sibling
  directory ``.<name>.partial-<id>`` (orbax tree first, then the metadata file, fsynced),
  and only a complete directory is moved to ``path``: by rename when ``path`` does not
  exist, by an atomic ``renameat2(RENAME_EXCHANGE)`` swap when it does (Linux; elsewhere two
  renames). An interruption before the swap leaves the previous checkpoint untouched (and
  the partial sibling is removed on an exception, Ctrl-C included); after it, the new one
  is complete. The metadata file is the completion marker: it is written last, and a
  directory holding ``params/`` without it is refused as an interrupted save.
* **Integrity.** The metadata records, per array, a 64-bit digest (two position-dependent
  sums of mixed 32-bit element bits, computed under ``jit`` so it is the same for any
  sharding and device count) of the values as saved. ``restore_checkpoint`` restores in
  the saved dtype, recomputes the digests and the non-finite counts, and raises one
  ``CheckpointError`` (every problem: metadata, missing/misshaped/extra arrays, unreadable
  data files, digest mismatches, non-finite values) before any layer is returned: a
  problem found never stops the checks of the other arrays, so the error names them all. Orbax/
  TensorStore errors are caught and reported per array. ``save_checkpoint`` refuses a
  layer holding NaN/inf before writing anything.
* A parameter renamed since a checkpoint was written is found under its earlier path
  (``layout.Param.aliases``: ``kv_a_proj`` was once saved under its HF name), checked
  against the digest recorded under that name, and restored under its current one.
* Restored layers go straight into their target shardings on any mesh whose axis divides
  the head count (``assembly``), whatever the mesh they were saved from; with ``batch_axis``
  / ``seq_axis`` they are placed for data / context parallelism (``shard_layer``'s checks,
  before anything is read).
* **Caches** (``save_cache`` / ``restore_cache``, a ``DsaCache`` only): ``path/cache`` (one
  orbax array per field that is not ``None``, written shard by shard: a cache split over
  ``cp`` or data shards is never gathered) and the same ``META_FILE`` (format
  ``glm5_dsa_jax.orbax_cache``: the static fields, each array's shape and stored dtype, a
  digest per array), saved with the same atomic swap. A restore rebuilds the cache from
  the metadata and reads each field straight into its ``placement.cache_shardings`` place on
  the given mesh and axes (each ``cp`` device reads its ``1/cp`` of the slots and pools),
  whatever mesh it was saved from; a capacity or batch that does not split is a
  ``ValueError`` naming the sizes before anything is read; digests are verified. The stored
  rows come back in this platform's stored dtype (``cpu_policy``: a CPU keeps a 16-bit or
  fp8 cache's bits). A layer checkpoint is not a cache and a cache not a layer checkpoint:
  each restore refuses the other's format.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from glm5_dsa_jax.checkpoint.assembly import (
    abstract_layer, check_dir, check_mesh, fill_layer, read_json, target_shardings, tree_get, tree_set,
)
from glm5_dsa_jax.cache.contiguous import DsaCache, restored_cache
from glm5_dsa_jax.cache.fp8 import IndexFormat, LatentFormat
from glm5_dsa_jax.checkpoint.errors import CheckpointError
from glm5_dsa_jax.model import layout
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.parallel.context import check_supported
from glm5_dsa_jax.parallel.placement import cache_shardings, check_batch, check_dp_mesh, check_seq_mesh, check_seq_split

__all__ = ["META_FILE", "save_checkpoint", "read_checkpoint_meta", "restore_checkpoint", "save_cache", "restore_cache"]


#: The metadata file ``save_checkpoint`` writes beside the orbax tree.
META_FILE = "glm5_dsa_jax.json"
#: The orbax tree's directory inside a checkpoint (``load_for_demo`` looks for it too).
PARAMS_DIR = "params"
#: A saved cache's orbax tree (``save_cache``), beside the same ``META_FILE``.
CACHE_DIR = "cache"
_FORMAT = "glm5_dsa_jax.orbax"
_META_VERSION = 2
_CACHE_FORMAT = "glm5_dsa_jax.orbax_cache"
_CACHE_META_VERSION = 1


def _orbax():
    """``orbax.checkpoint``, imported on first use: it takes 1-2 s to import, which every
    ``import glm5_dsa_jax`` (this module is imported by the package) would otherwise pay."""
    import orbax.checkpoint as ocp

    return ocp


def _layer_meta(layers: Mapping[int, DsaAttention]) -> dict:
    if not layers:
        raise ValueError("save_checkpoint needs at least one layer")
    first = next(iter(layers.values()))
    for idx, layer in layers.items():
        if not isinstance(layer, DsaAttention):
            raise TypeError(f"layers[{idx!r}] is a {type(layer).__name__}, not a DsaAttention")
        if layer.layer_idx != idx:
            raise ValueError(f"layers[{idx}] holds layer {layer.layer_idx}: keys must be layer indices")
        if layer.cfg != first.cfg:
            raise ValueError(f"layer {idx} has a different DsaConfig than layer {first.layer_idx}")
    return {
        "format": _FORMAT,
        "version": _META_VERSION,
        "config": dataclasses.asdict(first.cfg),
        "layers": sorted(int(i) for i in layers),
        "dtype": jnp.dtype(first.dtype).name,
        "param_dtype": {str(i): jnp.dtype(l.param_dtype).name for i, l in layers.items()},
        "tp_axis": first.tp_axis,
    }


def _digest_one(x):
    """``(uint32[2] digest, int32 non-finite count)`` of one array (see the invariants)."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 4:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif x.dtype.itemsize == 1:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    else:
        raise TypeError(f"cannot digest {x.dtype} arrays")
    # Flat position of every element, built from per-axis iotas (no reshape of ``x``, which a
    # mesh with Explicit axes would need an output sharding for).
    pos = jnp.zeros((1,) * x.ndim, jnp.uint32)
    stride = 1
    for ax in reversed(range(x.ndim)):
        shape = [1] * x.ndim
        shape[ax] = x.shape[ax]
        pos = pos + jax.lax.iota(jnp.uint32, x.shape[ax]).reshape(shape) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= x.shape[ax]

    def mix(seed):
        h = bits * jnp.uint32(0x9E3779B1) ^ (pos * jnp.uint32(0x85EBCA77) + jnp.uint32(seed))
        h = h ^ (h >> 16)
        h = h * jnp.uint32(0x85EBCA6B)
        h = h ^ (h >> 13)
        h = h * jnp.uint32(0xC2B2AE35)
        return jnp.sum(h ^ (h >> 16), dtype=jnp.uint32)

    bad = jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)
    return jnp.stack([mix(0x2545F491), mix(0x68E31DA4)]), bad


@jax.jit
def _digests(tree):
    return jax.tree.map(_digest_one, tree)


def _flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out


def _digest_report(tree: dict) -> tuple[dict[str, str], dict[str, int]]:
    """``({"layer_i.param": digest hex}, {"layer_i.param": non-finite count > 0})``."""
    got = jax.device_get(_digests(tree))
    digests, bad = {}, {}
    for name, (d, n) in _flat_pairs(got).items():
        digests[name] = "%08x%08x" % (int(d[0]), int(d[1]))
        if int(n):
            bad[name] = int(n)
    return digests, bad


def _flat_pairs(tree: Mapping, prefix: str = "") -> dict[str, tuple]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, tuple):
            out[prefix + k] = v
        else:
            out |= _flat_pairs(v, f"{prefix}{k}.")
    return out


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / META_FILE).is_file() or (path / PARAMS_DIR).is_dir() or (path / CACHE_DIR).is_dir()


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_meta(directory: Path, meta: dict) -> None:
    """The metadata file, written last (it marks the directory complete)."""
    tmp = directory / (META_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / META_FILE)
    _fsync(directory)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem/kernel cannot
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _swap_into(tmp: Path, path: Path) -> None:
    """Move the complete directory ``tmp`` to ``path``; a previous ``path`` is replaced
    atomically where the OS allows it, and deleted only once the new one is in place."""
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    if not path.exists():
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # ``tmp`` now holds the previous checkpoint
    else:  # two renames: a crash between them leaves the old one at ``.<name>.old-*``
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _fsync(path.parent)


def save_checkpoint(layers: Mapping[int, DsaAttention], path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Save ``{layer_idx: DsaAttention}`` as an orbax checkpoint directory.

    Layout: ``path/params`` (an ``ocp.StandardCheckpointer`` tree ``{"layer_<i>": params}``,
    written shard by shard from wherever the arrays live) and ``path/glm5_dsa_jax.json``
    (the ``DsaConfig``, the layer indices, dtypes and a digest per array), written last.
    The directory is written beside ``path`` and moved there complete (see the module doc), so an
    interrupted save leaves any previous checkpoint at ``path`` as it was.

    Raises ``FileExistsError`` if ``path`` is a non-empty directory and ``overwrite`` is
    false (or it is not a checkpoint directory: ``overwrite`` replaces only checkpoints),
    and ``CheckpointError`` if a parameter holds NaN/inf (nothing is written).
    """
    meta = _layer_meta(layers)
    path = _check_target(path, overwrite)
    tree = {f"layer_{i}": nnx.to_pure_dict(nnx.state(l, nnx.Param)) for i, l in layers.items()}
    digests, bad = _digest_report(tree)
    if bad:
        raise CheckpointError(f"save_checkpoint to {path}", [
            f"{name} holds {n} non-finite values (nothing was written)" for name, n in sorted(bad.items())])
    meta["checksums"] = digests
    return _write_dir(path, PARAMS_DIR, tree, meta)


def _check_target(path, overwrite: bool) -> Path:
    """``path`` as an absolute ``Path`` a save may write: ``FileExistsError`` for a file, a
    non-empty directory without ``overwrite``, or a non-empty one that is no checkpoint."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{str(path)!r} exists and is not a directory")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{str(path)!r} exists and is not empty (pass overwrite=True to replace it)")
        if not _is_checkpoint_dir(path):
            raise FileExistsError(
                f"{str(path)!r} is not empty and is not a glm5_dsa_jax checkpoint (no {META_FILE} or "
                f"{PARAMS_DIR}/): overwrite replaces only checkpoints; remove it yourself")
    return path


def _write_dir(path: Path, subdir: str, tree: dict, meta: dict) -> Path:
    """The orbax ``tree`` at ``subdir`` and ``meta`` (last) into a hidden sibling of ``path``,
    then moved to ``path`` whole (the module doc's first invariant)."""
    ocp = _orbax()
    if jax.process_count() > 1:  # every process must name the same directory
        tmp = path.with_name(f".{path.name}.partial")
    else:
        tmp = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
    lead = jax.process_index() == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if lead and tmp.exists():
            shutil.rmtree(tmp)
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp / subdir, tree)
        ckptr.wait_until_finished()
        if lead:
            _write_meta(tmp, meta)
            _swap_into(tmp, path)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"glm5_dsa_jax save {path}")
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_checkpoint_meta(path: str | os.PathLike) -> tuple[dict, DsaConfig]:
    """The metadata ``save_checkpoint`` wrote, and its ``DsaConfig``; every problem of the
    metadata (format, version, config, layer list, dtypes, digests) in one ``CheckpointError``."""
    path = Path(path)
    check_dir(path)
    mfile = path / META_FILE
    where = f"checkpoint {path}"
    if not mfile.is_file():
        if (path / PARAMS_DIR).exists():
            raise CheckpointError(where, [
                f"{PARAMS_DIR}/ is there but {META_FILE} is not: an incomplete (interrupted) save, "
                "not loaded; save again"])
        raise FileNotFoundError(f"{str(path)!r} is not a glm5_dsa_jax orbax checkpoint: no {META_FILE}")
    meta = read_json(mfile, "metadata")
    if meta.get("format") != _FORMAT:
        raise CheckpointError(where, [f"{META_FILE} format is {meta.get('format')!r}, expected {_FORMAT!r}"])
    if meta.get("version") != _META_VERSION:
        raise CheckpointError(where, [
            f"{META_FILE} version is {meta.get('version')!r}, expected {_META_VERSION} (a checkpoint "
            "written before per-array digests: convert or save it again)"])
    try:
        cfg = DsaConfig(**meta["config"]).validate()
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(where, [f"{META_FILE} config: {e}"]) from None
    problems: list[str] = []
    layers = meta.get("layers")
    if not (isinstance(layers, list) and layers and all(type(i) is int for i in layers)
            and len(set(layers)) == len(layers)):
        raise CheckpointError(where, [f"{META_FILE} 'layers' is {layers!r}, expected a list of distinct layer indices"])
    for i in layers:
        try:
            cfg.check_layer(i)
        except ValueError as e:
            problems.append(f"{META_FILE} lists layer {i}: {e}")
    pdt = meta.get("param_dtype")
    sums = meta.get("checksums")
    if not isinstance(pdt, dict):
        problems.append(f"{META_FILE} 'param_dtype' is not a map of layer -> dtype")
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        problems.append(f"{META_FILE} 'checksums' is not a map of array -> digest")
    for key, val in [("dtype", meta.get("dtype"))] + [
            (f"param_dtype[{i}]", pdt.get(str(i))) for i in layers if isinstance(pdt, dict)]:
        try:
            if not (isinstance(val, str) and jnp.issubdtype(jnp.dtype(val), jnp.floating)):
                raise TypeError
        except TypeError:
            problems.append(f"{META_FILE} {key} is {val!r}, expected a float dtype name")
    if problems:
        raise CheckpointError(where, problems)
    return meta, cfg


def _restore_tree(path: Path, target: dict):
    ocp = _orbax()
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), target)
    return ocp.PyTreeCheckpointer().restore(
        path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))


def restore_checkpoint(
    path: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    *,
    implementation: str = "xla",
    axis: str = "tp",
    batch_axis: str | None = None,
    seq_axis: str | None = None,
    layers: Iterable[int] | None = None,
    dtype=None,
    param_dtype=None,
) -> dict[int, DsaAttention]:
    """Restore ``save_checkpoint``'s layers onto ``mesh`` (any device count that divides the
    head count; ``None`` = the default device), each parameter directly into its target
    sharding. ``dtype``/``param_dtype`` default to the saved ones (``param_dtype`` casts).
    ``batch_axis`` / ``seq_axis``: the layers are placed for data / context parallelism as
    ``shard_layer(layer, mesh, axis, batch_axis, seq_axis)`` places them (checked, with the
    same ``ValueError``, before anything is read).

    Every array is verified against the digest recorded at save and for finiteness; every
    problem (metadata, missing, misshaped or extra arrays, unreadable or corrupted data
    files, non-finite values) is raised in one ``CheckpointError`` and no layer is returned:
    every array is checked whatever was found before it."""
    ocp = _orbax()
    path = Path(path).absolute()
    meta, cfg = read_checkpoint_meta(path)
    where = f"checkpoint {path}"
    saved = list(meta["layers"])
    wanted = saved if layers is None else sorted({int(i) for i in layers})
    missing = [i for i in wanted if i not in saved]
    if missing:
        raise ValueError(f"layers {missing} are not in the checkpoint (it holds {saved})")
    check_mesh(cfg, mesh, axis)
    _check_axes(mesh, axis, batch_axis, seq_axis)
    dtype = meta.get("dtype", "bfloat16") if dtype is None else dtype
    try:
        stored = ocp.StandardCheckpointer().metadata(path / PARAMS_DIR)
        stored = getattr(getattr(stored, "item_metadata", stored), "tree", stored)
        if not isinstance(stored, Mapping):
            raise ValueError(f"unexpected orbax metadata {type(stored).__name__}")
    except Exception as e:  # orbax / TensorStore raise plain Exceptions
        raise CheckpointError(where, [f"{PARAMS_DIR}/ cannot be read by orbax: {_short(e)}"]) from None

    abstracts, target, want_dt, renamed, problems = {}, {}, {}, {}, []
    sums = meta["checksums"]
    for i in wanted:
        saved_dt = jnp.dtype(meta["param_dtype"][str(i)])
        want_dt[i] = jnp.dtype(param_dtype) if param_dtype is not None else saved_dt
        abstract = abstract_layer(cfg, i, implementation=implementation, dtype=dtype, param_dtype=want_dt[i], axis=axis)
        if seq_axis is not None:  # the resolved implementation, checked before anything is read
            check_supported(abstract.implementation, seq_axis)
        shardings = target_shardings(abstract, mesh, axis)
        shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
        tree: dict = {}
        renamed[i] = []
        for ppath, sh in shardings.items():
            s = tree_get(shapes, ppath)
            spath = _stored_path(stored.get(f"layer_{i}"), ppath)
            if spath != ppath:
                renamed[i].append((spath, ppath))
            name = f"layer_{i}.{'.'.join(spath)}"
            try:
                got = tree_get(stored[f"layer_{i}"], spath)
                shape, gdt = tuple(got.shape), getattr(got, "dtype", saved_dt)
            except (KeyError, TypeError, AttributeError):
                problems.append(f"{name}: not in the checkpoint")
                continue
            if shape != tuple(s.shape):
                problems.append(f"{name}: stored shape {shape}, expected {tuple(s.shape)}")
                continue
            if gdt is not None and jnp.dtype(gdt) != saved_dt:
                problems.append(f"{name}: stored dtype {jnp.dtype(gdt).name}, {META_FILE} says {saved_dt.name}")
                continue
            if name not in sums:
                problems.append(f"{name}: no digest in {META_FILE}")
                continue
            tree_set(tree, spath, jax.ShapeDtypeStruct(s.shape, saved_dt, sharding=sh))
        problems += _extra_entries(stored.get(f"layer_{i}"), shardings, i)
        abstracts[i], target[f"layer_{i}"] = abstract, tree
    target = {k: v for k, v in target.items() if v}

    restored: dict = {}
    if target:
        try:
            restored = _restore_tree(path / PARAMS_DIR, target)
        except Exception:  # find which arrays cannot be read, one by one
            restored = {}
            for name, leaf in _flat(target).items():
                layer, *ppath = name.split(".")
                try:
                    one = _restore_tree(path / PARAMS_DIR, {layer: _nest(ppath, leaf)})
                    tree_set(restored, [layer] + ppath, tree_get(one[layer], ppath))
                except Exception as e:
                    problems.append(f"{name}: the data cannot be read ({_short(e)})")
        if restored:
            digests, bad = _digest_report(restored)
            for name in sorted(digests):
                if digests[name] != sums[name]:
                    problems.append(f"{name}: digest {digests[name]} does not match {sums[name]} recorded at "
                                    "save (the data files are corrupted)")
            for name, n in sorted(bad.items()):
                problems.append(f"{name} holds {n} non-finite values")
    if problems:
        raise CheckpointError(where, problems)
    out = {}
    for i in wanted:
        arrays = restored[f"layer_{i}"]
        for spath, ppath in renamed[i]:  # saved under an earlier name: ours from now on
            tree_set(arrays, ppath, tree_get(arrays, spath))
            tree_get(arrays, spath[:-1]).pop(spath[-1])
        if want_dt[i] != jnp.dtype(meta["param_dtype"][str(i)]):
            arrays = jax.tree.map(lambda a: a.astype(want_dt[i]), arrays)
        out[i] = fill_layer(abstracts[i], arrays, mesh, axis, batch_axis=batch_axis, seq_axis=seq_axis)
    return out


def _extra_entries(stored_layer, shardings: Mapping, i: int) -> list[str]:
    """The problems of the arrays a stored layer holds that are no parameter of layer
    ``i`` (under its path or an earlier one, ``layout.Param.aliases``): a checkpoint of
    another config or version, or a damaged tree."""
    if not isinstance(stored_layer, Mapping):
        return []
    known = {".".join(c) for ppath in shardings for c in (ppath, *layout.find_param(ppath)[1].aliases)}
    return [f"layer_{i}.{name}: in the checkpoint but not a parameter of layer {i}"
            for name in sorted(_flat(stored_layer)) if name not in known]


def _stored_path(tree, ppath: tuple[str, ...]) -> tuple[str, ...]:
    """Where ``tree`` (one stored layer) holds parameter ``ppath``: its path, or the first
    of its earlier paths (``layout.Param.aliases``) found there; ``ppath`` if neither."""
    for cand in (ppath, *layout.find_param(ppath)[1].aliases):
        try:
            tree_get(tree, cand)
            return cand
        except (KeyError, TypeError):
            continue
    return ppath


def _nest(path: Sequence[str], leaf) -> dict:
    tree: dict = {}
    tree_set(tree, path, leaf)
    return tree


def _short(e: BaseException, n: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= n else msg[:n] + "..."


def _check_axes(mesh, axis: str | None, batch_axis: str | None, seq_axis: str | None) -> None:
    """``ValueError`` unless ``batch_axis`` / ``seq_axis`` are axes of ``mesh`` of their own
    (``placement.check_dp_mesh`` / ``check_seq_mesh``); either without a mesh is refused."""
    if mesh is None:
        if batch_axis is not None or seq_axis is not None:
            raise ValueError(f"batch_axis={batch_axis!r} / seq_axis={seq_axis!r} need a mesh to split over "
                             "(got mesh=None)")
        return
    if batch_axis is not None:
        check_dp_mesh(mesh, axis, batch_axis)
    if seq_axis is not None:
        check_seq_mesh(mesh, axis, batch_axis, seq_axis)


# ------------------------------------------------------------------------------- caches
def _cache_arrays(cache: DsaCache) -> dict[str, jax.Array]:
    """``{field: array}`` of the cache's array fields that are not ``None``."""
    return {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)
            if f.metadata.get("pytree_node", True) and getattr(cache, f.name) is not None}


def save_cache(cache: DsaCache, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Save a contiguous cache (``DsaCache``: a prompt's prefill, a paused batch) as an orbax
    directory: ``path/cache`` (one array per field, written shard by shard from wherever
    it lives: a cache split over a ``cp`` or data axis is never gathered) and
    ``path/glm5_dsa_jax.json`` (the static fields, every array's shape and stored dtype, a
    digest per array), written and moved into place as ``save_checkpoint`` does.

    ``TypeError`` for anything but a ``DsaCache`` (a paged sequence moves with
    ``PagedCache.export`` / ``load``), ``ValueError`` for a traced one, ``FileExistsError``
    as ``save_checkpoint``."""
    if not hasattr(cache, "TOKEN_AXIS_FIELDS"):  # the contiguous cache's (a paged one has page pools)
        raise TypeError(f"save_cache saves a DsaCache, got {type(cache).__name__} (a paged sequence moves "
                        "with PagedCache.export / load)")
    arrays = _cache_arrays(cache)
    if any(isinstance(a, jax.core.Tracer) for a in arrays.values()):
        raise ValueError("save_cache needs a concrete cache, not one traced under jit")
    path = _check_target(path, overwrite)
    meta = {
        "format": _CACHE_FORMAT,
        "version": _CACHE_META_VERSION,
        "dtype": jnp.dtype(cache.dtype).name,
        "kpool": cache.kpool,
        "rotate_index": bool(cache.rotate_index),
        "latent_format": None if cache.latent_format is None else dataclasses.asdict(cache.latent_format),
        "index_format": None if cache.index_format is None else dataclasses.asdict(cache.index_format),
        "arrays": {k: {"shape": list(a.shape), "dtype": jnp.dtype(a.dtype).name} for k, a in arrays.items()},
        "checksums": _digest_report(arrays)[0],
    }
    return _write_dir(path, CACHE_DIR, arrays, meta)


def _read_cache_meta(path: Path) -> dict:
    check_dir(path)
    where = f"cache checkpoint {path}"
    if not (path / META_FILE).is_file():
        if (path / CACHE_DIR).exists():
            raise CheckpointError(where, [f"{CACHE_DIR}/ is there but {META_FILE} is not: an incomplete "
                                          "(interrupted) save, not loaded; save again"])
        raise FileNotFoundError(f"{str(path)!r} is not a glm5_dsa_jax cache checkpoint: no {META_FILE}")
    meta = read_json(path / META_FILE, "metadata")
    if meta.get("format") != _CACHE_FORMAT or meta.get("version") != _CACHE_META_VERSION:
        raise CheckpointError(where, [
            f"{META_FILE} is format {meta.get('format')!r} version {meta.get('version')!r}, expected "
            f"{_CACHE_FORMAT!r} version {_CACHE_META_VERSION} (save_checkpoint's layers restore with "
            "restore_checkpoint)"])
    return meta


def restore_cache(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None, *,
                  batch_axis: str | None = None, seq_axis: str | None = None) -> DsaCache:
    """The ``DsaCache`` ``save_cache`` wrote, each field read straight into its place on
    ``mesh`` as ``sharding.place_cache(cache, mesh, batch_axis, seq_axis)`` places it
    (``None``: the default device), whatever mesh it was saved from: with a ``seq_axis``
    (context parallelism) each device of it reads only its ``1/cp`` of the slots and pools.

    Checked before anything is read (``ValueError`` naming the sizes): the axes (as
    ``place_cache``), the saved capacity divisible by ``cp * kpool`` and the saved batch by
    the data shards. Every array is verified against its digest (``CheckpointError``
    naming every problem). Rows stored as bits on one platform (a CPU's ``uint16`` for
    bfloat16) come back in this platform's stored dtype. Nothing on disk changes."""
    path = Path(path).absolute()
    meta = _read_cache_meta(path)
    try:
        saved = meta["arrays"]
        if not set(DsaCache.REQUIRED_FIELDS) <= set(saved):
            raise KeyError(f"arrays {sorted(saved)} lack one of {DsaCache.REQUIRED_FIELDS}")
        statics = dict(
            dtype=jnp.dtype(meta["dtype"]), kpool=int(meta["kpool"]), rotate_index=bool(meta["rotate_index"]),
            latent_format=None if meta["latent_format"] is None else LatentFormat(**meta["latent_format"]),
            index_format=None if meta["index_format"] is None else IndexFormat(**meta["index_format"]))
        abstract = DsaCache(**{k: jax.ShapeDtypeStruct(tuple(v["shape"]), jnp.dtype(v["dtype"]))
                               for k, v in saved.items()}, **statics)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"cache checkpoint {path}", [f"{META_FILE} does not describe a cache: {_short(e)}"]) \
            from None
    _check_axes(mesh, None, batch_axis, seq_axis)
    if mesh is None:
        shardings = {k: SingleDeviceSharding(jax.local_devices()[0]) for k in saved}
    else:
        if seq_axis is not None:
            check_seq_split(abstract.max_length, abstract.kpool if abstract.has_indexer else 1,
                            int(mesh.shape[seq_axis]), seq_axis)
        if batch_axis is not None:
            check_batch(abstract.batch_size, mesh, batch_axis, "the saved cache's batch")
        shardings = _cache_arrays(cache_shardings(abstract, mesh, batch_axis, seq_axis))
    target = {k: jax.ShapeDtypeStruct(tuple(v["shape"]), jnp.dtype(v["dtype"]), sharding=shardings[k])
              for k, v in saved.items()}
    where = f"cache checkpoint {path}"
    try:
        arrays = _restore_tree(path / CACHE_DIR, target)
    except Exception as e:  # orbax / TensorStore raise plain Exceptions
        raise CheckpointError(where, [f"{CACHE_DIR}/ cannot be read: {_short(e)}"]) from None
    sums = meta.get("checksums", {})
    got = _digest_report(arrays)[0]
    problems = [f"{k}: digest {got[k]} does not match {sums.get(k)} recorded at save (the data files are "
                "corrupted)" for k in sorted(got) if got[k] != sums.get(k)]
    if problems:
        raise CheckpointError(where, problems)
    return restored_cache(arrays, **statics)  # another platform's stored form converted
