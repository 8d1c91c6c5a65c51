"""Import DSA layers from a Hugging Face safetensors checkpoint directory of any model type
in ``config.MODEL_TYPES`` (``glm5_next``, ``glm_moe_dsa``, ``deepseek_v32``).

``load_hf_checkpoint(path, mesh=None)`` reads a checkpoint directory (``config.json`` plus
``model.safetensors`` or ``model.safetensors.index.json`` and its shards) and returns
``{layer_idx: DsaAttention}`` for every DSA layer; ``read_hf_params(path)`` runs the same
checks and returns our parameters as numpy arrays instead of layers.

Invariants:

* **Validate, then read, then return.** Every name, shape and dtype of every tensor the
  requested layers need is checked from the safetensors headers (and the index) before any
  data is read; every problem found -- missing, unexpected, misshaped, wrong dtype,
  truncated or unreadable file, config that does not match the weights -- goes into one
  ``CheckpointError`` that lists them all with their tensor names. Finiteness is checked on
  every slice as it is read; all layers are assembled before anything is returned, so a
  failed load returns nothing.
* **Sharded reads.** Every parameter is built with ``jax.make_array_from_callback``: each
  device's callback reads from the file only the rows/columns of the HF tensor that map to
  its shard of *our* parameter layout (e.g. heads ``h0:h1`` of ``q_b_proj`` are HF rows
  ``h0*qk_head:h1*qk_head``; heads of ``o_proj`` are HF *columns*), through
  ``SafetensorsFile`` (``pread``, no mmap, never a whole tensor per device). Replicated
  parameters are read once per distinct slice and handed to every device that holds it.
  The target shardings come from the parameters' metadata (``assembly``).
* Tensor names: ``model.language_model.layers.{i}.self_attn.*`` (what transformers'
  ``save_pretrained`` writes for ``Glm5NextForConditionalGeneration``) or the text-only
  ``model.layers.{i}.self_attn.*`` (``LAYER_PREFIXES``). Tensors outside the requested DSA
  layers' ``self_attn.`` namespaces (linear-attention layers, MLPs, embeddings, vision
  tower) are ignored; inside one, an unknown tensor is an error. ``"shared"`` indexer layers
  have no indexer tensors; model types without k-pool compression have no k-pool tensors
  (which tensors each type has is the layout table's, ``layout.layer_tensors``).
* config.json's ``model_type`` picks the rules (``DsaConfig.from_hf_config``); a type
  outside ``MODEL_TYPES`` is a ``CheckpointError`` naming the supported ones.
* Quantized weights (NVFP4 as NVIDIA ModelOpt writes it, block-scaled fp8 as DeepSeek-V3 /
  V3.2 ship it -- ``weight_scale_inv`` per 128 x 128 block -- and per-tensor fp8)
  are recognised from their names and dtypes and dequantized slice by slice
  (``glm5_dsa_jax.quant``); unquantized tensors are read as stored.
* Shard names from an index must stay inside the checkpoint directory (checked on the
  names, so symlinked shards of the Hugging Face cache still load).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from glm5_dsa_jax import quant
from glm5_dsa_jax.model import layout
from glm5_dsa_jax.checkpoint.assembly import (
    abstract_layer, check_dir, check_mesh, fill_layer, read_json, target_shardings, tree_get, tree_set,
)
from glm5_dsa_jax.checkpoint.errors import CheckpointError
from glm5_dsa_jax.checkpoint.safetensors_file import CHUNK_BYTES, SafetensorsFile, TensorInfo
from glm5_dsa_jax.model.config import MODEL_TYPES, DsaConfig
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.model.layout import hf_weight_shapes
from glm5_dsa_jax.model.weights import cast_to, count_nonfinite, nonfinite_problem
from pallas_kernels import check_implementation

__all__ = ["LAYER_PREFIXES", "load_hf_checkpoint", "read_hf_params"]

#: Where a layer's tensors may live (``{prefix}{i}.self_attn.<name>``), most specific first.
LAYER_PREFIXES = ("model.language_model.layers.", "model.layers.", "language_model.model.layers.")


# ============================================================================ locating
def _inside(fname: str) -> bool:
    """``fname`` (from an index) names a file below the checkpoint directory."""
    parts = fname.replace("\\", "/").split("/")
    return bool(fname) and not fname.startswith(("/", "\\")) and ":" not in parts[0] \
        and all(p not in ("", ".", "..") for p in parts)


def _weight_files(path: Path) -> tuple[Path | None, Path | None]:
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file():
        return index, None
    if single.is_file():
        return None, single
    others = sorted(p.name for p in path.glob("*.safetensors"))
    extra = f"; found {', '.join(others[:5])} but no index naming them" if others else ""
    raise FileNotFoundError(
        f"no weights in {str(path)!r}: looked for 'model.safetensors.index.json' (sharded) and "
        f"'model.safetensors' (single file){extra}"
    )


def read_config(path: Path) -> tuple[dict, DsaConfig]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"no config.json in {str(path)!r}: a checkpoint directory needs config.json "
            "(the model geometry) beside model.safetensors or model.safetensors.index.json"
        )
    raw = read_json(cfg_path, "config")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else None
    mt, text_mt = raw.get("model_type"), (text or {}).get("model_type")
    if mt is not None and text_mt is not None and mt in _TEXT_OF and _TEXT_OF[mt] != text_mt:
        raise CheckpointError(f"checkpoint {path}", [
            f"config.json model_type is {mt!r} but text_config.model_type is {text_mt!r}, "
            f"expected {_TEXT_OF[mt]!r}"])
    try:  # refuses a model type outside MODEL_TYPES, naming the supported ones
        cfg = DsaConfig.from_hf_config(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}", [f"config.json: {e}"]) from None
    return raw, cfg


#: config.json ``model_type`` -> the ``model_type`` its ``text_config`` must have.
_TEXT_OF = {"glm5_next": "glm5_next_text", **{m: m for m in MODEL_TYPES if m != "glm5_next"}}


# ============================================================================ sliced reading
# From here to "end of sliced reading": a logical HF tensor as a reader of row/column ranges
# (``_Source.read``, the ``layout.Reader`` that ``layout.read_param`` calls for one device's
# block of a parameter) and a device index as per-axis bounds (``_bounds``). Which tensors a
# layer has, and how each becomes our parameters, is the layout table's (``layout``).
@dataclasses.dataclass
class _Source:
    """One logical HF tensor of a layer (``rel`` relative to ``self_attn.``), possibly
    stored quantized as several tensors (``roles``)."""

    rel: str
    full: str
    shape: tuple[int, ...]
    fmt: str | None
    roles: dict[str, TensorInfo]
    spec: quant.QuantSpec

    def read(self, rows=None, cols=None) -> np.ndarray:
        w = self.roles["weight"]
        if self.fmt is None:
            return w.file.read(w, rows, cols)
        out, inn = self.shape
        by_name = {i.name: i for i in self.roles.values()}
        reader = lambda name, r, c: by_name[name].file.read(by_name[name], r, c)
        names = {role: i.name for role, i in self.roles.items()}
        return quant.read_dequantized(
            self.fmt, names, self.shape, reader,
            rows if rows is not None else (0, out), cols if cols is not None else (0, inn), self.spec,
        )


def _bounds(idx: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
    out = []
    for s, n in zip(idx, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append((start, stop))
    return out

# ============================================================================ end of sliced reading


# ============================================================================ HF import
def load_hf_checkpoint(
    path: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    layers: Iterable[int] | None = None,
    dtype=jnp.bfloat16,
    param_dtype=None,
    implementation: str = "xla",
    axis: str = "tp",
    *,
    progress: bool = True,
) -> dict[int, DsaAttention]:
    """``{layer_idx: DsaAttention}`` for the DSA layers of a HF checkpoint (``MODEL_TYPES``).

    Args:
      path: the checkpoint directory (``config.json`` + ``model.safetensors`` or
        ``model.safetensors.index.json``).
      mesh: place each parameter straight onto this mesh (head axis over ``axis``, the rest
        replicated); ``None`` puts everything on the default device.
      layers: DSA layer indices to load (default: every ``indexed_attention`` layer).
      dtype: the layers' compute dtype; param_dtype: their parameter dtype (default ``dtype``).
      implementation: ``"xla"``, ``"pallas"`` or ``"pallas_interpret"``.
      axis: the mesh axis name for tensor parallelism.
      progress: show a tqdm progress bar over tensors.

    Raises ``FileNotFoundError`` for a directory without ``config.json`` or weights, and
    one ``CheckpointError`` listing every problem with the weights (nothing is returned).
    """
    check_implementation(implementation)
    path = Path(path)
    check_dir(path)
    raw_cfg, cfg = read_config(path)
    index_path, single_path = _weight_files(path)
    param_dtype = dtype if param_dtype is None else param_dtype
    if layers is None:
        wanted = list(cfg.dsa_layers)
    else:
        wanted = sorted({int(i) for i in layers})
        for i in wanted:
            cfg.check_layer(i)
    check_mesh(cfg, mesh, axis)
    hq = path / "hf_quant_config.json"
    spec = quant.quant_spec_from_config(raw_cfg, read_json(hq, "ModelOpt config") if hq.is_file() else None)

    files: dict[str, SafetensorsFile] = {}
    try:
        sources, problems = _plan(path, cfg, wanted, spec, index_path, single_path, files)
        if problems:  # structural problems: add the bad values of what is readable, then raise
            problems += _scan_nonfinite(sources, np.dtype(jnp.dtype(param_dtype)))
            raise CheckpointError(f"checkpoint {path}", problems)
        return _materialize(cfg, wanted, sources, mesh, dtype, param_dtype, implementation, axis,
                            progress, where=f"checkpoint {path}")
    finally:
        for f in files.values():
            f.close()


def read_hf_params(
    path: str | os.PathLike, layers: Iterable[int] | None = None, param_dtype=np.float32,
) -> tuple[DsaConfig, dict[int, dict[tuple[str, ...], np.ndarray]]]:
    """``(cfg, {layer_idx: {param path: array}})``: the checkpoint's DSA layers as our
    parameters (the layout table's paths and shapes), in numpy, whole, dequantized.

    The same checks as ``load_hf_checkpoint`` (config, every name, shape and dtype, then
    finiteness; one ``CheckpointError`` listing every problem), without building layers:
    for inspection, conversion, and any model type ``DsaAttention`` cannot run yet.
    """
    path = Path(path)
    check_dir(path)
    raw_cfg, cfg = read_config(path)
    index_path, single_path = _weight_files(path)
    wanted = list(cfg.dsa_layers) if layers is None else sorted({int(i) for i in layers})
    for i in wanted:
        cfg.check_layer(i)
    hq = path / "hf_quant_config.json"
    spec = quant.quant_spec_from_config(raw_cfg, read_json(hq, "ModelOpt config") if hq.is_file() else None)
    np_dtype = np.dtype(jnp.dtype(param_dtype))
    files: dict[str, SafetensorsFile] = {}
    try:
        sources, problems = _plan(path, cfg, wanted, spec, index_path, single_path, files)
        problems += _scan_nonfinite(sources, np_dtype)
        if problems:
            raise CheckpointError(f"checkpoint {path}", problems)
        out = {
            i: {p.path: cast_to(layout.read_param(cfg, t, p, sources[i][t.hf_name].read), np_dtype)
                for t, p in layout.iter_params(layout.layer_tensors(cfg, i))}
            for i in wanted
        }
    finally:
        for f in files.values():
            f.close()
    return cfg, out


def _plan(path, cfg, wanted, spec, index_path, single_path, files) -> tuple[dict[int, dict[str, _Source]], list[str]]:
    """The sources of every requested layer's tensors and every structural problem found
    (raises at once only when nothing more can be checked: no usable index or file)."""
    where = f"checkpoint {path}"
    problems: list[str] = list(spec.problems)

    def open_file(fname: str) -> SafetensorsFile:
        if fname not in files:
            files[fname] = SafetensorsFile(path / fname)
        return files[fname]

    # ---- the names available, and where each lives
    locate: dict[str, str]  # full name -> file name
    if index_path is not None:
        idx = read_json(index_path, "index")
        wm = idx.get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(where, [f"{index_path.name} has no valid 'weight_map' (name -> file)"])
        locate = dict(wm)
        # A shard is a plain file name (or a relative path below the checkpoint): an entry
        # like "../other/model.safetensors" or "/abs/x.safetensors" would read weights from
        # outside the directory the user pointed at. Checked on the names, not on resolved
        # paths, so symlinked shards (the Hugging Face cache layout) still load.
        escaping = sorted({f for f in locate.values() if not _inside(f)})
        if escaping:
            names = {f: [n for n, g in locate.items() if g == f] for f in escaping}
            raise CheckpointError(where, [
                f"{index_path.name} maps {names[f][0]!r}" + (f" (and {len(names[f]) - 1} more)" if len(names[f]) > 1 else "")
                + f" to {f!r}, a path outside the checkpoint directory (shards must be relative file names)"
                for f in escaping])
    else:
        f = open_file(single_path.name)
        if f.error:
            raise CheckpointError(where, [f"{single_path.name} {f.error}"])
        locate = {n: single_path.name for n in f.tensors}

    counts = {p: sum(1 for n in locate if re.match(re.escape(p) + r"\d+\.self_attn\.", n)) for p in LAYER_PREFIXES}
    prefix = max(LAYER_PREFIXES, key=lambda p: counts[p])
    if counts[prefix] == 0:
        raise CheckpointError(where, [
            "no attention tensors found: looked for names "
            + " or ".join(f"'{p}{{i}}.self_attn.*'" for p in LAYER_PREFIXES)
        ])
    pat = re.compile(re.escape(prefix) + r"(\d+)\.self_attn\.(.+)$")
    by_layer: dict[int, dict[str, str]] = {i: {} for i in wanted}  # rel -> full
    for n in locate:
        m = pat.match(n)
        if m and int(m.group(1)) in by_layer:
            by_layer[int(m.group(1))][m.group(2)] = n

    # ---- headers of the files those tensors live in
    infos: dict[str, TensorInfo] = {}
    bad_files: dict[str, list[str]] = {}
    for i in wanted:
        for rel, full in by_layer[i].items():
            fname = locate[full]
            f = open_file(fname)
            if f.error:
                bad_files.setdefault(fname, []).append(full)
                continue
            info = f.tensors.get(full)
            if info is None:
                problems.append(f"tensor {full!r}: the index maps it to {fname} but that file does not hold it")
            elif info.problem:
                problems.append(info.problem)
            else:
                infos[full] = info
    for fname, names in bad_files.items():
        shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        problems.append(f"file {fname} {files[fname].error}; it should hold {shown}")

    # ---- every layer against its expected tensors
    quantized = spec.declared or any(i.dtype in ("U8", "F8_E4M3") for i in infos.values())
    sources: dict[int, dict[str, _Source]] = {}
    for i in wanted:
        present = by_layer[i]
        want = hf_weight_shapes(cfg, i)
        avail = {rel: (infos[f].dtype, infos[f].shape) for rel, f in present.items() if f in infos}
        used: set[str] = set()
        layer_sources: dict[str, _Source] = {}
        for rel, shape in want.items():
            full = f"{prefix}{i}.self_attn.{rel}"
            if rel not in present:
                problems.append(f"missing tensor {full!r} (expected shape {shape})")
                continue
            used.add(rel)
            if rel not in avail:
                continue  # its file/header problem is already listed
            fmt, roles, probs = quant.classify(rel, shape, avail, spec)
            problems += [_qualify(p, prefix, i) for p in probs]
            used.update(roles.values())
            if fmt is not None and rel.endswith(".weight"):
                base = rel[: -len("weight")]
                if base + "input_scale" in present:
                    used.add(base + "input_scale")
            if not probs:
                layer_sources[rel] = _Source(rel, full, shape, fmt, {r: infos[present[n]] for r, n in roles.items()}, spec)
        for rel in sorted(set(present) - used):
            if quantized and rel.rsplit(".", 1)[-1] in ("k_scale", "v_scale"):
                continue  # KV-cache quantization scales: not weights of this layer
            hint = ""
            if rel.startswith("indexer.") and not cfg.has_indexer(i):
                hint = f" (config.json makes layer {i} a 'shared' indexer layer: it has no indexer weights)"
            problems.append(f"unexpected tensor {present[rel]!r}{hint}")
        sources[i] = layer_sources
    return sources, problems


def _scan_nonfinite(sources: dict[int, dict[str, _Source]], np_dtype) -> list[str]:
    """Non-finite problems of every readable tensor (as ``np_dtype``), read in row blocks of
    at most ~8 MiB: run only when the structural check failed, so that one error lists the
    structural problems and the bad values together."""
    out: list[str] = []
    for layer_sources in sources.values():
        for src in layer_sources.values():
            n = over = 0
            try:
                if len(src.shape) < 2:
                    blocks = [src.read()]
                else:
                    rows = src.shape[0]
                    step = max(1, CHUNK_BYTES // max(1, 4 * math.prod(src.shape[1:])))
                    blocks = (src.read((r, min(r + step, rows))) for r in range(0, rows, step))
                for raw in blocks:
                    a, b = count_nonfinite(raw, cast_to(raw, np_dtype))
                    n, over = n + a, over + b
            except OSError as e:
                out.append(f"tensor {src.full!r}: read failed ({e})")
                continue
            p = nonfinite_problem(src.full, n, over, np_dtype, "" if src.fmt is None else f"dequantized {src.fmt}, ")
            if p:
                out.append(p)
    return out


def _qualify(problem: str, prefix: str, layer_idx: int) -> str:
    """Make the relative tensor names in a ``quant.classify`` problem full names."""
    return re.sub(r"'([^']+)'", lambda m: f"'{prefix}{layer_idx}.self_attn.{m.group(1)}'", problem)


def _materialize(cfg, wanted, sources, mesh, dtype, param_dtype, implementation, axis, progress, where):
    np_dtype = np.dtype(jnp.dtype(param_dtype))
    problems: list[str] = []
    built: dict[int, DsaAttention] = {}
    total = sum(len(s) for s in sources.values())
    bar = tqdm(total=total, unit="tensor", desc="loading DSA layers", disable=not progress, leave=False)
    try:
        for i in wanted:
            abstract = abstract_layer(cfg, i, implementation=implementation, dtype=dtype,
                                       param_dtype=param_dtype, axis=axis)
            shardings = target_shardings(abstract, mesh, axis)
            shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
            arrays: dict = {}
            ok = True
            for tensor in layout.layer_tensors(cfg, i):
                src = sources[i][tensor.hf_name]
                bar.set_postfix_str(src.full, refresh=False)
                nonfinite = overflow = 0
                for param in tensor.params:
                    ppath = param.path
                    shape = tuple(tree_get(shapes, ppath).shape)
                    sharding = shardings[ppath]
                    # A slice is read once and handed to every device that holds the same
                    # index (replication), then dropped: memory stays at one slice + shards.
                    pending: dict = {}
                    for idx in sharding.addressable_devices_indices_map(shape).values():
                        k = tuple(_bounds(idx, shape))
                        pending[k] = pending.get(k, 0) + 1
                    memo: dict = {}

                    def callback(idx, src=src, tensor=tensor, param=param, shape=shape, memo=memo,
                                 pending=pending):
                        nonlocal nonfinite, overflow
                        b = _bounds(idx, shape)
                        key = tuple(b)
                        x = memo.pop(key, None)
                        if x is None:
                            raw = layout.read_param(cfg, tensor, param, src.read, b)
                            x = np.ascontiguousarray(cast_to(raw, np_dtype))
                            n, o = count_nonfinite(raw, x)
                            nonfinite, overflow = nonfinite + n, overflow + o
                        pending[key] = pending.get(key, 1) - 1
                        if pending[key] > 0:
                            memo[key] = x
                        return x

                    try:
                        arr = jax.make_array_from_callback(shape, sharding, callback)
                    except OSError as e:
                        problems.append(f"tensor {src.full!r}: read failed ({e})")
                        ok = False
                        break
                    finally:
                        memo.clear()
                    tree_set(arrays, ppath, arr)
                if nonfinite:
                    problems.append(nonfinite_problem(
                        src.full, nonfinite, overflow, np_dtype, "" if src.fmt is None else f"dequantized {src.fmt}, "))
                    ok = False
                bar.update(1)
            if ok:
                built[i] = fill_layer(abstract, arrays, mesh, axis)
            del arrays
    finally:
        bar.close()
    if problems:
        built.clear()
        raise CheckpointError(where, problems)
    return built
