"""Checkpoints: import DSA layers from a Hugging Face safetensors directory, save and
restore them with orbax, and the ``glm5-dsa convert`` command.

``load_hf_checkpoint(path, mesh=None)`` reads a ``glm5_next`` checkpoint directory
(``config.json`` plus ``model.safetensors`` or ``model.safetensors.index.json`` and its
shards) and returns ``{layer_idx: DsaAttention}`` for every DSA layer.

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
  ``h0*qk_head:h1*qk_head``; heads of ``o_proj`` are HF *columns*). Reads go through
  ``pread`` into a buffer of the slice's size -- no mmap (whose touched pages would count
  as resident memory) and never a whole tensor per device. Replicated parameters are read
  once per distinct slice and handed to every device that holds it.
* **Target shardings come from the parameters' metadata**: the ``out_sharding`` that
  ``DsaAttention`` attaches to each ``nnx.Param`` (the head axis named ``axis`` for
  ``q_b_proj``, ``w_uk``, ``w_uv``, ``o_proj``; everything else replicated), turned into a
  ``NamedSharding`` on the given mesh.
* Tensor names: ``model.language_model.layers.{i}.self_attn.*`` (what transformers'
  ``save_pretrained`` writes for ``Glm5NextForConditionalGeneration``) or the text-only
  ``model.layers.{i}.self_attn.*``. Tensors outside the requested DSA layers' ``self_attn.``
  namespaces (linear-attention layers, MLPs, embeddings, vision tower) are ignored; inside
  one, an unknown tensor is an error. ``"shared"`` indexer layers have no indexer tensors.
* Quantized weights (NVFP4 as NVIDIA ModelOpt writes it, block-scaled and per-tensor fp8)
  are recognised from their names and dtypes and dequantized slice by slice
  (``glm5_dsa_jax.quant``); unquantized tensors are read as stored.

Why not ``safetensors.safe_open(..., "numpy").get_slice``: in safetensors 0.8 the numpy
backend cannot return ``F8_E4M3`` tensors (NVFP4 block scales, fp8 weights), and it reads
through an mmap. The headers are parsed here (the format is an 8-byte length, a JSON
header and raw little-endian data) and each slice is read with ``pread``; the tests check
the parsed headers against ``safe_open``. Because the reader replaces the library, it also
validates at least what the library does (header length, JSON, duplicate names, dtype x
shape = byte count, ranges that tile the data section exactly): a file the library refuses
is refused here, never read with aliased or shifted tensors. Shard names from an index must
stay inside the checkpoint directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import struct
import sys
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from pallas_kernels._common import check_implementation
from glm5_dsa_jax import quant
from glm5_dsa_jax.config import DsaConfig
from glm5_dsa_jax.layer import DsaAttention, hf_weight_shapes
from glm5_dsa_jax.weights import WeightError, cast_to, count_nonfinite, nonfinite_problem

__all__ = [
    "CheckpointError", "load_hf_checkpoint", "save_checkpoint", "restore_checkpoint",
    "read_checkpoint_meta", "load_for_demo", "SafetensorsFile", "add_parser", "LAYER_PREFIXES",
    "META_FILE",
]

#: Where a layer's tensors may live (``{prefix}{i}.self_attn.<name>``), most specific first.
LAYER_PREFIXES = ("model.language_model.layers.", "model.layers.", "language_model.model.layers.")
#: The metadata file ``save_checkpoint`` writes beside the orbax tree.
META_FILE = "glm5_dsa_jax.json"
_PARAMS_DIR = "params"
_FORMAT = "glm5_dsa_jax.orbax"
_CHUNK_BYTES = 8 << 20  # row block for column-sliced reads
_MAX_HEADER = 256 << 20


class CheckpointError(WeightError):
    """A checkpoint cannot be loaded; ``problems`` lists every issue found."""


# ============================================================================ safetensors
_ST_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header. ``problem`` is set when its entry is unusable."""

    name: str
    file: "SafetensorsFile"
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    problem: str | None = None


class SafetensorsFile:
    """A safetensors file: header parsed eagerly (``error`` set if it cannot be), data read
    lazily by slices with ``pread``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.error: str | None = None
        self._fd: int | None = None
        try:
            self.size = self.path.stat().st_size
            self._parse()
        except OSError as e:
            self.size = 0
            self.error = f"cannot be read ({e.strerror or e})"

    def _parse(self) -> None:
        # What ``safetensors`` (0.8) itself refuses is refused here too: a header length past
        # the file (or absurd, e.g. 2**63), a header that is not a UTF-8 JSON object, a
        # duplicate tensor name, a dtype/shape that does not match its byte range, and
        # ``data_offsets`` that do not tile the data section exactly (overlapping, gapped or
        # duplicate ranges, trailing bytes). A range past the end of the file is reported per
        # tensor ("truncated"), so a cut file names exactly the tensors it lost.
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                self.error = f"is {self.size} bytes, shorter than a safetensors header"
                return
            (n,) = struct.unpack("<Q", head)
            if n > min(self.size - 8, _MAX_HEADER):
                self.error = (
                    f"is not a valid safetensors file: its header length field says {n} bytes but "
                    f"the file has {self.size}"
                    + (f" and a header may be at most {_MAX_HEADER}" if n > _MAX_HEADER else "")
                    + " (truncated or corrupt)"
                )
                return
            raw = f.read(n)
        dups: list[str] = []

        def pairs(items):
            d = {}
            for k, v in items:
                if k in d:
                    dups.append(k)
                d[k] = v
            return d

        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs)
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            self.error = f"is not a valid safetensors file: corrupt header ({e})"
            return
        if dups:
            self.error = (f"is not a valid safetensors file: its header lists "
                          + ", ".join(repr(d) for d in sorted(set(dups))) + " more than once")
            return
        meta = header.get("__metadata__")
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            self.error = "is not a valid safetensors file: __metadata__ is not a map of strings"
            return
        start = 8 + n
        ranges: list[tuple[int, int, str]] = []
        for name, e in header.items():
            if name == "__metadata__":
                continue
            info, rng = self._entry(name, e, start)
            self.tensors[name] = info
            if rng is not None:
                ranges.append(rng + (name,))
        malformed = [i.problem for i in self.tensors.values() if i.dtype == "?"]
        if malformed:  # an entry without a usable range: the layout cannot be trusted either
            self.error = "is not a valid safetensors file: " + "; ".join(malformed[:6]) + (
                f"; and {len(malformed) - 6} more" if len(malformed) > 6 else "")
            return
        self.error = self._layout_error(ranges, self.size - start)

    def _layout_error(self, ranges: list[tuple[int, int, str]], data_len: int) -> str | None:
        """The tensors' byte ranges must tile ``[0, data_len)`` exactly, in any header order."""
        bad: list[str] = []
        end, prev = 0, None
        for b, e, name in sorted(ranges):
            if b < end:
                bad.append(f"tensor {name!r} data_offsets [{b}, {e}] overlap tensor {prev[2]!r} [{prev[0]}, {prev[1]}]")
            elif b > end:
                bad.append(f"{b - end} bytes before tensor {name!r} (data_offsets [{b}, {e}]) belong to no tensor")
            if e >= end:
                end, prev = e, (b, e, name)
        if bad:  # say which ranges also run past the end (a truncated file on top of it)
            bad += [f"tensor {name!r} (data_offsets [{b}, {e}]) ends past the {data_len}-byte data "
                    "section (file truncated?)" for b, e, name in sorted(ranges) if e > data_len]
        if end < data_len and not bad:
            bad.append(f"{data_len - end} bytes after the last tensor's data belong to no tensor")
        if not bad:
            return None
        shown = "; ".join(bad[:6]) + (f"; and {len(bad) - 6} more" if len(bad) > 6 else "")
        return f"is not a valid safetensors file: its data_offsets do not tile the data section ({shown})"

    def _entry(self, name: str, e: Any, start: int) -> tuple[TensorInfo, tuple[int, int] | None]:
        bad = lambda msg: (TensorInfo(name, self, "?", (), 0, f"tensor {name!r} in {self.path.name}: {msg}"), None)
        if not isinstance(e, dict):
            return bad(f"corrupt header entry {str(e)[:80]}")
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in _ST_DTYPES:
            return bad(f"unsupported dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            return bad(f"corrupt shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            return bad(f"corrupt data_offsets {offs!r}")
        shape = tuple(shape)
        want = math.prod(shape) * np.dtype(_ST_DTYPES[dtype]).itemsize
        info = TensorInfo(name, self, dtype, shape, start + offs[0])
        if offs[1] - offs[0] != want:
            return dataclasses.replace(info, problem=(
                f"tensor {name!r} in {self.path.name}: header gives {offs[1] - offs[0]} bytes for "
                f"{dtype} {list(shape)}, which needs {want} (corrupt)")), (offs[0], offs[1])
        if start + offs[1] > self.size:
            return dataclasses.replace(info, problem=(
                f"tensor {name!r}: its data ends at byte {start + offs[1]} but {self.path.name} "
                f"has {self.size} bytes (file truncated)")), (offs[0], offs[1])
        return info, (offs[0], offs[1])

    # ------------------------------------------------------------------ reading
    def _pread_into(self, arr: np.ndarray, offset: int) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        view = memoryview(arr.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            if hasattr(os, "preadv"):
                got = os.preadv(self._fd, [view[done:]], offset + done)
            else:  # pragma: no cover - platforms without preadv
                chunk = os.pread(self._fd, len(view) - done, offset + done)
                got = len(chunk)
                view[done:done + got] = chunk
            if got <= 0:
                raise OSError(f"{self.path.name} ended early (truncated while loading?)")
            done += got

    def read(self, info: TensorInfo, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor, or rows ``[r0, r1)`` (axis 0) and columns ``[c0, c1)`` (axis 1) of it,
        clamped to its shape. Only those bytes (plus, for a column slice, row blocks of at
        most 8 MiB at a time) are read."""
        if info.problem:
            raise OSError(info.problem)
        dt = np.dtype(_ST_DTYPES[info.dtype])
        shape = info.shape
        if not shape or (rows is None and cols is None):
            out = np.empty(shape, dt)
            self._pread_into(out, info.offset)
            return out
        n0 = shape[0]
        r0, r1 = rows if rows is not None else (0, n0)
        r0, r1 = max(0, min(r0, n0)), max(0, min(r1, n0))
        r1 = max(r1, r0)
        inner = shape[1:]
        row_bytes = math.prod(inner) * dt.itemsize
        if len(shape) == 1 or cols is None or (cols[0] <= 0 and cols[1] >= shape[1]):
            out = np.empty((r1 - r0,) + inner, dt)
            self._pread_into(out, info.offset + r0 * row_bytes)
            return out
        n1 = shape[1]
        c0, c1 = max(0, min(cols[0], n1)), max(0, min(cols[1], n1))
        c1 = max(c0, c1)
        out = np.empty((r1 - r0, c1 - c0) + inner[1:], dt)
        step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
        buf = np.empty((min(step, r1 - r0),) + inner, dt)
        for s in range(r0, r1, step):
            k = min(step, r1 - s)
            self._pread_into(buf[:k], info.offset + s * row_bytes)
            out[s - r0:s - r0 + k] = buf[:k, c0:c1]
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ============================================================================ locating
def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path.parent}", [f"{what} {path.name} cannot be read: {e}"]) from None
    if not isinstance(d, dict):
        raise CheckpointError(f"checkpoint {path.parent}", [f"{what} {path.name} is not a JSON object"])
    return d


def _check_dir(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint path {str(path)!r} is not a directory")


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


def _read_config(path: Path) -> tuple[dict, DsaConfig]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"no config.json in {str(path)!r}: a glm5_next checkpoint directory needs config.json "
            "(the model geometry) beside model.safetensors or model.safetensors.index.json"
        )
    raw = _read_json(cfg_path, "config")
    mt = raw.get("model_type")
    text_mt = (raw.get("text_config") or {}).get("model_type") if isinstance(raw.get("text_config"), dict) else None
    if mt is not None and mt not in ("glm5_next", "glm5_next_text"):
        raise CheckpointError(f"checkpoint {path}", [
            f"config.json model_type is {mt!r}, expected 'glm5_next' (or 'glm5_next_text')"])
    if text_mt is not None and text_mt != "glm5_next_text":
        raise CheckpointError(f"checkpoint {path}", [
            f"config.json text_config.model_type is {text_mt!r}, expected 'glm5_next_text'"])
    try:
        cfg = DsaConfig.from_hf_config(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}", [f"config.json: {e}"]) from None
    return raw, cfg


# ============================================================================ planning
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


# (HF name relative to self_attn., param path, kind, kind arguments)
def _param_plan(cfg: DsaConfig, layer_idx: int) -> list[tuple[str, list[tuple[tuple[str, ...], str, dict]]]]:
    nope, v, g = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    plan = [
        ("q_a_proj.weight", [(("q_a_proj",), "T", {})]),
        ("q_a_layernorm.weight", [(("q_a_layernorm",), "id", {})]),
        ("q_b_proj.weight", [(("q_b_proj",), "heads_in", {"d": cfg.qk_head_dim})]),
        ("kv_a_proj_with_mqa.weight", [(("kv_a_proj_with_mqa",), "T", {})]),
        ("kv_a_layernorm.weight", [(("kv_a_layernorm",), "id", {})]),
        ("kv_b_proj.weight", [(("w_uk",), "kvb", {"g": g, "off": 0}),
                              (("w_uv",), "kvb", {"g": g, "off": nope})]),
        ("o_proj.weight", [(("o_proj",), "o", {"v": v})]),
    ]
    if cfg.attention_bias:
        plan += [
            ("q_a_proj.bias", [(("q_a_proj_bias",), "id", {})]),
            ("kv_a_proj_with_mqa.bias", [(("kv_a_proj_bias",), "id", {})]),
            ("o_proj.bias", [(("o_proj_bias",), "id", {})]),
        ]
    if cfg.has_indexer(layer_idx):
        plan += [
            ("indexer.wq_b.weight", [(("indexer", "wq_b"), "heads_in", {"d": cfg.index_head_dim})]),
            ("indexer.wk.weight", [(("indexer", "wk"), "T", {})]),
            ("indexer.k_norm.weight", [(("indexer", "k_norm_scale"), "id", {})]),
            ("indexer.k_norm.bias", [(("indexer", "k_norm_bias"), "id", {})]),
            ("indexer.weights_proj.weight", [(("indexer", "weights_proj"), "T", {})]),
            ("indexer.index_kpool_compress_gate", [(("indexer", "kpool_gate"), "T", {})]),
            ("indexer.index_kpool_compress_ape", [(("indexer", "kpool_ape"), "id", {})]),
        ]
    return plan


def _slice_param(src: _Source, kind: str, kw: dict, b: list[tuple[int, int]]) -> np.ndarray:
    """Our parameter's block ``b`` (one ``(start, stop)`` per axis), read from ``src``."""
    if kind == "id":
        return src.read(b[0], b[1] if len(b) > 1 else None)
    if kind == "T":  # ours [in, out] = HF [out, in].T
        return src.read(b[1], b[0]).T
    if kind == "heads_in":  # ours [r, H, D] = HF [H*D, r] viewed [H, D, r], transposed
        (r0, r1), (h0, h1), (d0, d1) = b
        d = kw["d"]
        x = src.read((h0 * d, h1 * d), (r0, r1)).reshape(h1 - h0, d, r1 - r0)
        return x[:, d0:d1].transpose(2, 0, 1)
    if kind == "kvb":  # ours [H, k, C] = rows off:off+k of each head's g-row group of HF [H*g, C]
        (h0, h1), (k0, k1), (c0, c1) = b
        g, off = kw["g"], kw["off"]
        x = src.read((h0 * g, h1 * g), (c0, c1)).reshape(h1 - h0, g, c1 - c0)
        return x[:, off + k0:off + k1]
    if kind == "o":  # ours [H, V, O] = HF [O, H*V].T viewed [H, V, O]
        (h0, h1), (v0, v1), (o0, o1) = b
        v = kw["v"]
        x = src.read((o0, o1), (h0 * v, h1 * v)).T.reshape(h1 - h0, v, o1 - o0)
        return x[:, v0:v1]
    raise AssertionError(kind)


def _bounds(idx: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
    out = []
    for s, n in zip(idx, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append((start, stop))
    return out


def _abstract_layer(cfg, layer_idx, *, implementation, dtype, param_dtype, axis):
    """A ``DsaAttention`` whose parameters are shapes only (nothing allocated)."""
    return nnx.eval_shape(lambda: DsaAttention(
        cfg, layer_idx, rngs=nnx.Rngs(0), implementation=implementation, dtype=dtype,
        param_dtype=param_dtype, tp_axis=axis,
    ))


def _get(tree: Mapping, path: Sequence[str]):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: Sequence[str], value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _target_shardings(abstract, mesh, axis: str) -> dict:
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


def _check_mesh(cfg: DsaConfig, mesh, axis: str) -> None:
    if mesh is None:
        return
    if axis not in mesh.axis_names:
        raise ValueError(
            f"mesh axes are {tuple(mesh.axis_names)}; the head axis is sharded over {axis!r} "
            "(pass axis= the name of the tensor-parallel axis)"
        )
    tp = mesh.shape[axis]
    if cfg.num_attention_heads % tp:
        raise ValueError(
            f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by the mesh's "
            f"{axis!r} axis ({tp}): every device must hold whole heads"
        )


def _fill_layer(abstract, arrays: dict, mesh=None, axis: str = "tp") -> DsaAttention:
    state = nnx.state(abstract, nnx.Param)
    nnx.replace_by_pure_dict(state, arrays)
    nnx.update(abstract, state)
    if mesh is not None:
        # Records the mesh on the layer (sharded attention, placed caches); the parameters
        # are already there, so this adopts them without a copy.
        from glm5_dsa_jax.sharding import shard_layer

        shard_layer(abstract, mesh, axis=axis)
    return abstract


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
    """``{layer_idx: DsaAttention}`` for the DSA layers of a HF ``glm5_next`` checkpoint.

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
    _check_dir(path)
    raw_cfg, cfg = _read_config(path)
    index_path, single_path = _weight_files(path)
    param_dtype = dtype if param_dtype is None else param_dtype
    if layers is None:
        wanted = list(cfg.dsa_layers)
    else:
        wanted = sorted({int(i) for i in layers})
        for i in wanted:
            cfg.check_layer(i)
    _check_mesh(cfg, mesh, axis)
    hq = path / "hf_quant_config.json"
    spec = quant.quant_spec_from_config(raw_cfg, _read_json(hq, "ModelOpt config") if hq.is_file() else None)

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
        idx = _read_json(index_path, "index")
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
                    step = max(1, _CHUNK_BYTES // max(1, 4 * math.prod(src.shape[1:])))
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
    from tqdm.auto import tqdm

    np_dtype = np.dtype(jnp.dtype(param_dtype))
    problems: list[str] = []
    built: dict[int, DsaAttention] = {}
    total = sum(len(s) for s in sources.values())
    bar = tqdm(total=total, unit="tensor", desc="loading DSA layers", disable=not progress, leave=False)
    try:
        for i in wanted:
            abstract = _abstract_layer(cfg, i, implementation=implementation, dtype=dtype,
                                       param_dtype=param_dtype, axis=axis)
            shardings = _target_shardings(abstract, mesh, axis)
            shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
            arrays: dict = {}
            ok = True
            for rel, params in _param_plan(cfg, i):
                src = sources[i][rel]
                bar.set_postfix_str(src.full, refresh=False)
                nonfinite = overflow = 0
                for ppath, kind, kw in params:
                    shape = tuple(_get(shapes, ppath).shape)
                    sharding = shardings[ppath]
                    # A slice is read once and handed to every device that holds the same
                    # index (replication), then dropped: memory stays at one slice + shards.
                    pending: dict = {}
                    for idx in sharding.addressable_devices_indices_map(shape).values():
                        k = tuple(_bounds(idx, shape))
                        pending[k] = pending.get(k, 0) + 1
                    memo: dict = {}

                    def callback(idx, src=src, kind=kind, kw=kw, shape=shape, memo=memo, pending=pending):
                        nonlocal nonfinite, overflow
                        b = _bounds(idx, shape)
                        key = tuple(b)
                        x = memo.pop(key, None)
                        if x is None:
                            raw = _slice_param(src, kind, kw, b)
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
                    _set(arrays, ppath, arr)
                if nonfinite:
                    problems.append(nonfinite_problem(
                        src.full, nonfinite, overflow, np_dtype, "" if src.fmt is None else f"dequantized {src.fmt}, "))
                    ok = False
                bar.update(1)
            if ok:
                built[i] = _fill_layer(abstract, arrays, mesh, axis)
            del arrays
    finally:
        bar.close()
    if problems:
        built.clear()
        raise CheckpointError(where, problems)
    return built


# ============================================================================ orbax
# Orbax checkpoints (``save_checkpoint`` / ``restore_checkpoint``). Invariants:
#
# * **Never a lost or partial checkpoint.** Everything is written into a hidden sibling
#   directory ``.<name>.partial-<id>`` (orbax tree first, then the metadata file, fsynced),
#   and only a complete directory is moved to ``path``: by rename when ``path`` does not
#   exist, by an atomic ``renameat2(RENAME_EXCHANGE)`` swap when it does (Linux; elsewhere two
#   renames). An interruption before the swap leaves the previous checkpoint untouched (and
#   the partial sibling is removed on an exception, Ctrl-C included); after it, the new one
#   is complete. The metadata file is the completion marker: it is written last, and a
#   directory holding ``params/`` without it is refused as an interrupted save.
# * **Integrity.** The metadata records, per array, a 64-bit digest (two position-dependent
#   sums of mixed 32-bit element bits, computed under ``jit`` so it is the same for any
#   sharding and device count) of the values as saved. ``restore_checkpoint`` restores in
#   the saved dtype, recomputes the digests and the non-finite counts, and raises one
#   ``CheckpointError`` (every problem: metadata, missing/misshaped arrays, unreadable data
#   files, digest mismatches, non-finite values) before any layer is returned. Orbax/
#   TensorStore errors are caught and reported per array. ``save_checkpoint`` refuses a
#   layer holding NaN/inf before writing anything.
_META_VERSION = 2


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
    if x.dtype.itemsize == 4:
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
    return (path / META_FILE).is_file() or (path / _PARAMS_DIR).is_dir()


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
    import ctypes

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
    The directory is written beside ``path`` and moved there complete (see above), so an
    interrupted save leaves any previous checkpoint at ``path`` as it was.

    Raises ``FileExistsError`` if ``path`` is a non-empty directory and ``overwrite`` is
    false (or it is not a checkpoint directory: ``overwrite`` replaces only checkpoints),
    and ``CheckpointError`` if a parameter holds NaN/inf (nothing is written).
    """
    import orbax.checkpoint as ocp

    meta = _layer_meta(layers)
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{str(path)!r} exists and is not a directory")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{str(path)!r} exists and is not empty (pass overwrite=True to replace it)")
        if not _is_checkpoint_dir(path):
            raise FileExistsError(
                f"{str(path)!r} is not empty and is not a glm5_dsa_jax checkpoint (no {META_FILE} or "
                f"{_PARAMS_DIR}/): overwrite replaces only checkpoints; remove it yourself")
    tree = {f"layer_{i}": nnx.to_pure_dict(nnx.state(l, nnx.Param)) for i, l in layers.items()}
    digests, bad = _digest_report(tree)
    if bad:
        raise CheckpointError(f"save_checkpoint to {path}", [
            f"{name} holds {n} non-finite values (nothing was written)" for name, n in sorted(bad.items())])
    meta["checksums"] = digests
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
        ckptr.save(tmp / _PARAMS_DIR, tree)
        ckptr.wait_until_finished()
        if lead:
            _write_meta(tmp, meta)
            _swap_into(tmp, path)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

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
    _check_dir(path)
    mfile = path / META_FILE
    where = f"checkpoint {path}"
    if not mfile.is_file():
        if (path / _PARAMS_DIR).exists():
            raise CheckpointError(where, [
                f"{_PARAMS_DIR}/ is there but {META_FILE} is not: an incomplete (interrupted) save, "
                "not loaded; save again"])
        raise FileNotFoundError(f"{str(path)!r} is not a glm5_dsa_jax orbax checkpoint: no {META_FILE}")
    meta = _read_json(mfile, "metadata")
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
    import orbax.checkpoint as ocp

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
    layers: Iterable[int] | None = None,
    dtype=None,
    param_dtype=None,
) -> dict[int, DsaAttention]:
    """Restore ``save_checkpoint``'s layers onto ``mesh`` (any device count that divides the
    head count; ``None`` = the default device), each parameter directly into its target
    sharding. ``dtype``/``param_dtype`` default to the saved ones (``param_dtype`` casts).

    Every array is verified against the digest recorded at save and for finiteness; every
    problem (metadata, missing or misshaped arrays, unreadable or corrupted data files,
    non-finite values) is raised in one ``CheckpointError`` and no layer is returned."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta, cfg = read_checkpoint_meta(path)
    where = f"checkpoint {path}"
    saved = list(meta["layers"])
    wanted = saved if layers is None else sorted({int(i) for i in layers})
    missing = [i for i in wanted if i not in saved]
    if missing:
        raise ValueError(f"layers {missing} are not in the checkpoint (it holds {saved})")
    _check_mesh(cfg, mesh, axis)
    dtype = meta.get("dtype", "bfloat16") if dtype is None else dtype
    try:
        stored = ocp.StandardCheckpointer().metadata(path / _PARAMS_DIR)
        stored = getattr(getattr(stored, "item_metadata", stored), "tree", stored)
        if not isinstance(stored, Mapping):
            raise ValueError(f"unexpected orbax metadata {type(stored).__name__}")
    except Exception as e:  # orbax / TensorStore raise plain Exceptions
        raise CheckpointError(where, [f"{_PARAMS_DIR}/ cannot be read by orbax: {_short(e)}"]) from None

    abstracts, target, want_dt, problems = {}, {}, {}, []
    sums = meta["checksums"]
    for i in wanted:
        saved_dt = jnp.dtype(meta["param_dtype"][str(i)])
        want_dt[i] = jnp.dtype(param_dtype) if param_dtype is not None else saved_dt
        abstract = _abstract_layer(cfg, i, implementation=implementation, dtype=dtype, param_dtype=want_dt[i], axis=axis)
        shardings = _target_shardings(abstract, mesh, axis)
        shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
        tree: dict = {}
        for ppath, sh in shardings.items():
            s = _get(shapes, ppath)
            name = f"layer_{i}.{'.'.join(ppath)}"
            try:
                got = _get(stored[f"layer_{i}"], ppath)
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
            _set(tree, ppath, jax.ShapeDtypeStruct(s.shape, saved_dt, sharding=sh))
        abstracts[i], target[f"layer_{i}"] = abstract, tree
    target = {k: v for k, v in target.items() if v}

    restored: dict = {}
    if target:
        try:
            restored = _restore_tree(path / _PARAMS_DIR, target)
        except Exception:  # find which arrays cannot be read, one by one
            restored = {}
            for name, leaf in _flat(target).items():
                layer, *ppath = name.split(".")
                try:
                    one = _restore_tree(path / _PARAMS_DIR, {layer: _nest(ppath, leaf)})
                    _set(restored, [layer] + ppath, _get(one[layer], ppath))
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
        if want_dt[i] != jnp.dtype(meta["param_dtype"][str(i)]):
            arrays = jax.tree.map(lambda a: a.astype(want_dt[i]), arrays)
        out[i] = _fill_layer(abstracts[i], arrays, mesh, axis)
    return out


def _nest(path: Sequence[str], leaf) -> dict:
    tree: dict = {}
    _set(tree, path, leaf)
    return tree


def _short(e: BaseException, n: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= n else msg[:n] + "..."


# ============================================================================ demo / CLI
def load_for_demo(path: str | os.PathLike, **kwargs) -> tuple[DsaConfig, dict[int, DsaAttention]]:
    """``(cfg, {layer_idx: DsaAttention})`` from an orbax directory written by
    ``save_checkpoint`` / ``glm5-dsa convert``, or from a HF checkpoint directory.
    ``kwargs`` go to ``restore_checkpoint`` / ``load_hf_checkpoint`` (``mesh``,
    ``implementation``, ``axis``, ``dtype``, ``layers``...)."""
    path = Path(path)
    _check_dir(path)
    if (path / META_FILE).is_file() or (path / _PARAMS_DIR).is_dir():
        cfg = read_checkpoint_meta(path)[1]  # (an incomplete save without META_FILE: refused)
        return cfg, restore_checkpoint(path, **kwargs)
    if (path / "config.json").is_file():
        cfg = _read_config(path)[1]
        return cfg, load_hf_checkpoint(path, **kwargs)
    raise FileNotFoundError(
        f"{str(path)!r} is neither an orbax checkpoint from 'glm5-dsa convert' (no {META_FILE}) "
        "nor a Hugging Face checkpoint directory (no config.json)"
    )


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {s!r}") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``glm5-dsa convert HF_DIR OUT_DIR [--tp N]``."""
    p = subparsers.add_parser(
        "convert", help="convert a HF glm5_next checkpoint's DSA layers to an orbax checkpoint",
        description="Read the DSA layers of a Hugging Face glm5_next safetensors checkpoint "
        "(dequantizing NVFP4/fp8 weights), place them on a tensor-parallel mesh of --tp devices "
        "and save them as an orbax checkpoint that 'glm5-dsa demo --checkpoint' and "
        "glm5_dsa_jax.checkpoint.restore_checkpoint read.",
    )
    p.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("out_dir", help="output directory for the orbax checkpoint")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices to load onto (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="parameter and compute dtype (default bfloat16)")
    p.add_argument("--layers", type=_int_list, default=None, help="DSA layer indices, e.g. 3,7 (default all)")
    p.add_argument("--axis", default="tp", help="mesh axis name of tensor parallelism (default tp)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint at OUT_DIR (written beside it, then swapped in: "
                   "an interrupted convert leaves the old one intact)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_convert_main)
    return p


def _convert_main(args) -> int:
    devices = jax.devices()
    if args.tp < 1 or args.tp > len(devices):
        print(f"glm5-dsa convert: --tp {args.tp} needs between 1 and {len(devices)} devices "
              f"(this host has {len(devices)} {devices[0].platform} device(s); on CPU set "
              "XLA_FLAGS=--xla_force_host_platform_device_count=N)", file=sys.stderr)
        return 2
    mesh = None if args.tp == 1 else jax.make_mesh((args.tp,), (args.axis,), devices=devices[: args.tp])
    dt = jnp.dtype(args.dtype)
    try:
        layers = load_hf_checkpoint(args.hf_dir, mesh=mesh, layers=args.layers, dtype=dt,
                                    axis=args.axis, progress=not args.no_progress)
        out = save_checkpoint(layers, args.out_dir, overwrite=args.overwrite)
    except FileExistsError as e:
        msg = str(e).replace("pass overwrite=True", "pass --overwrite").replace("overwrite replaces", "--overwrite replaces")
        print(f"glm5-dsa convert: {msg}", file=sys.stderr)
        return 1
    except (CheckpointError, FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"glm5-dsa convert: {e}", file=sys.stderr)
        return 1
    n_bytes = sum(
        x.nbytes for l in layers.values() for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(l, nnx.Param)))
    )
    print(f"converted {len(layers)} DSA layer(s) {sorted(layers)} ({n_bytes / 2**20:.1f} MiB of "
          f"{dt.name} parameters, tp={args.tp}) to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m glm5_dsa_jax.checkpoint convert ...`` (the same as ``glm5-dsa convert``)."""
    parser = argparse.ArgumentParser(prog="python -m glm5_dsa_jax.checkpoint")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
