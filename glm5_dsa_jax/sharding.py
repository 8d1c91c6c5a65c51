"""Tensor parallelism for one DSA layer: the shard plan as data, as PartitionSpecs, and on a mesh.

Invariants:

* Only the attention heads are split. ``q_b_proj`` and ``kv_b_proj`` (our ``w_uk`` and
  ``w_uv``) shard by head rows, ``o_proj`` is row-parallel (its input dim, ``heads *
  v_head``, is split and its output is all-reduced once per call). Everything else is
  replicated: the low-rank down-projections and their norms, ``kv_a_proj_with_mqa`` (the
  shared latent has no head axis) and **the whole indexer**.
* The indexer is replicated because it emits a *selection*, not a partial sum:
  ``score[t, p] = sum_h w[t, h] * relu(q[t, h] . k[p])`` over the indexer heads. A
  head-sharded indexer would give each rank a partial score, and a per-rank top-k over
  partial scores can pick different pools on different ranks. Making it correct needs an
  all-reduce of the ``[q_rows, n_pools]`` scores before the top-k: at a 262,144-token
  context and ``index_kpool = 4`` that is 65,536 pools x 4 B = 256 KiB per decode token per
  layer (``TpPlan.indexer_allreduce_bytes``), against about 15 MB of replicated indexer
  weights per layer (``TpPlan.indexer_bytes``). The all-reduce would also change the order
  of the per-head sum, which can reorder pools that tie at the cutoff. Replicated, every
  rank computes the same scores from the same inputs in the same order, so the top-k is
  bit-identical on every rank and every TP size.
* Caches (``DsaCache``) are replicated over the whole mesh: the latent ``[B, L, C]`` has no
  head axis, every head reads every selected row, and the indexer state is replicated like
  the indexer. Each rank therefore reads its *local* copy of the latent rows it attends
  to: no step gathers a cache. Other mesh axes (a ``"data"`` axis, say) are allowed and
  everything that is not head-sharded is replicated over them; batch (data) parallelism
  over such an axis is not done by this module.
* ``TpPlan`` describes the Hugging Face tensors (PyTorch ``[out, in]`` layout, the names
  ``load_hf_weights`` takes) so its numbers match the seed's ``DsaTpPlan``; each entry also
  names the parameters of this project's layout it becomes (``kv_b_proj`` -> ``w_uk`` and
  ``w_uv``). ``partition_specs`` gives the PartitionSpec of every parameter in our layout;
  they are the same as the ``out_sharding`` metadata ``DsaAttention`` attaches to its
  ``nnx.Param``s, which survives ``nnx.split`` / ``nnx.merge`` and orbax restores.
* ``shard_layer`` places a layer: parameters by those specs, and the mesh recorded on the
  layer (``layer.mesh``), from which its caches (``init_cache``) and its concrete call
  inputs are replicated and its steps run on the mesh: the sparse attention per head
  shard, the indexer's Pallas kernels replicated on every device, the ``o_proj`` output
  all-reduced once per call; nothing is all-gathered. How each step runs on the mesh, and
  why, is ``glm5_dsa_jax.parallel``'s part. It works on meshes with ``Explicit`` axis types
  (``jax.make_mesh``'s default) and with ``Auto`` ones, eagerly and under ``jax.jit``, and
  on meshes that span processes (``jax.distributed``: every process passes the same host
  values).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import html
import json
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_dsa_jax.config import DsaConfig
from glm5_dsa_jax.layer import hf_tensor_shapes
from glm5_dsa_jax.parallel import put, replicate

__all__ = [
    "ShardKind", "TensorPlan", "TpPlan", "partition_specs", "shard_layer", "place_cache",
    "cache_shardings", "param_shardings",
    "add_parser",
]

BF16_BYTES = 2
SCORE_BYTES = 4  # the indexer's scores are float32


class ShardKind(str, enum.Enum):
    """How one tensor maps onto TP ranks (the seed's ``DsaShard``)."""

    #: Every rank holds the whole tensor.
    REPLICATED = "Replicated"
    #: PyTorch rows are ``heads * per_head``: each rank holds its heads' rows.
    HEAD_ROWS = "HeadRows"
    #: PyTorch columns (the input dim) are ``heads * v_head``: a row-parallel GEMM whose
    #: output is all-reduced.
    HEAD_COLS = "HeadCols"

    def __str__(self) -> str:
        return self.value


# ------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str  # the seed's / HF module name
    hf_name: str  # the HF tensor name, relative to ``self_attn.``
    kind: ShardKind
    #: our parameter paths and, per path, the index of its head axis (None = no head axis)
    params: tuple[tuple[tuple[str, ...], int | None], ...]
    indexer: bool = False


def _entries(cfg: DsaConfig, with_indexer: bool) -> list[_Entry]:
    R, ROWS, COLS = ShardKind.REPLICATED, ShardKind.HEAD_ROWS, ShardKind.HEAD_COLS
    e = [
        _Entry("q_a_proj", "q_a_proj.weight", R, ((("q_a_proj",), None),)),
        _Entry("q_a_layernorm", "q_a_layernorm.weight", R, ((("q_a_layernorm",), None),)),
        _Entry("q_b_proj", "q_b_proj.weight", ROWS, ((("q_b_proj",), 1),)),
        _Entry("kv_a_proj_with_mqa", "kv_a_proj_with_mqa.weight", R, ((("kv_a_proj_with_mqa",), None),)),
        _Entry("kv_a_layernorm", "kv_a_layernorm.weight", R, ((("kv_a_layernorm",), None),)),
        _Entry("kv_b_proj", "kv_b_proj.weight", ROWS, ((("w_uk",), 0), (("w_uv",), 0))),
        _Entry("o_proj", "o_proj.weight", COLS, ((("o_proj",), 0),)),
    ]
    if cfg.attention_bias:
        e += [
            _Entry("q_a_proj.bias", "q_a_proj.bias", R, ((("q_a_proj_bias",), None),)),
            _Entry("kv_a_proj_with_mqa.bias", "kv_a_proj_with_mqa.bias", R, ((("kv_a_proj_bias",), None),)),
            # Added once, after the all-reduce of the row-parallel o_proj.
            _Entry("o_proj.bias", "o_proj.bias", R, ((("o_proj_bias",), None),)),
        ]
    if with_indexer:
        ix = lambda name, hf, p: _Entry(name, hf, R, (((("indexer", p)), None),), indexer=True)
        e += [
            ix("indexer.wq_b", "indexer.wq_b.weight", "wq_b"),
            ix("indexer.wk", "indexer.wk.weight", "wk"),
            ix("indexer.k_norm.weight", "indexer.k_norm.weight", "k_norm_scale"),
            ix("indexer.k_norm.bias", "indexer.k_norm.bias", "k_norm_bias"),
            ix("indexer.weights_proj", "indexer.weights_proj.weight", "weights_proj"),
            ix("indexer.index_kpool_compress_gate", "indexer.index_kpool_compress_gate", "kpool_gate"),
            ix("indexer.index_kpool_compress_ape", "indexer.index_kpool_compress_ape", "kpool_ape"),
        ]
    return e


def _param_shapes(cfg: DsaConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Shapes of every parameter of our layout (a full-indexer layer, with biases if any)."""
    h, nh, c = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    d, hi = cfg.index_head_dim, cfg.index_n_heads
    s = {
        ("q_a_proj",): (h, cfg.q_lora_rank),
        ("q_a_layernorm",): (cfg.q_lora_rank,),
        ("q_b_proj",): (cfg.q_lora_rank, nh, cfg.qk_head_dim),
        ("kv_a_proj_with_mqa",): (h, cfg.kv_cache_dim),
        ("kv_a_layernorm",): (c,),
        ("w_uk",): (nh, cfg.qk_nope_head_dim, c),
        ("w_uv",): (nh, cfg.v_head_dim, c),
        ("o_proj",): (nh, cfg.v_head_dim, h),
        ("q_a_proj_bias",): (cfg.q_lora_rank,),
        ("kv_a_proj_bias",): (cfg.kv_cache_dim,),
        ("o_proj_bias",): (h,),
        ("indexer", "wq_b"): (cfg.q_lora_rank, hi, d),
        ("indexer", "wk"): (h, d),
        ("indexer", "k_norm_scale"): (d,),
        ("indexer", "k_norm_bias"): (d,),
        ("indexer", "weights_proj"): (h, hi),
        ("indexer", "kpool_gate"): (h, d),
        ("indexer", "kpool_ape"): (cfg.index_kpool, d),
    }
    return s


def _with_indexer(cfg: DsaConfig, layer_idx: int | None) -> bool:
    if layer_idx is None:
        return True
    return cfg.has_indexer(layer_idx)


def _check_sizes(cfg: DsaConfig, tp_size: int, axis: str | None = None) -> None:
    what = f"mesh axis {axis!r} of size {tp_size}" if axis is not None else f"tp_size {tp_size}"
    if not isinstance(tp_size, (int, np.integer)) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"{what}: the TP size must be a positive integer")
    if cfg.num_attention_heads % tp_size:
        raise ValueError(
            f"{what} does not divide num_attention_heads={cfg.num_attention_heads}: the head "
            "axis of q_b_proj, kv_b_proj (w_uk, w_uv) and o_proj must split evenly over the "
            f"ranks (TP sizes that work: {_divisors(cfg.num_attention_heads)})"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One HF tensor on one rank (the seed's ``DsaTensorPlan``, any rank).

    Shapes are the PyTorch ``[out, in]`` shapes (1-D for norms and biases); ``src_offset``
    is where this rank's slice starts in the full tensor. ``params`` are the parameters of
    this project's layout the tensor becomes, ``param_specs`` their PartitionSpecs.
    """

    name: str
    hf_name: str
    kind: ShardKind
    elem_bytes: int
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    src_offset: tuple[int, ...]
    params: tuple[str, ...]
    param_specs: tuple[P, ...]
    indexer: bool = False

    @property
    def full_bytes(self) -> int:
        return int(np.prod(self.full_shape)) * self.elem_bytes

    @property
    def local_bytes(self) -> int:
        return int(np.prod(self.local_shape)) * self.elem_bytes

    def to_row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hf_name": self.hf_name,
            "kind": self.kind.value,
            "full_shape": list(self.full_shape),
            "local_shape": list(self.local_shape),
            "src_offset": list(self.src_offset),
            "full_bytes": self.full_bytes,
            "local_bytes": self.local_bytes,
            "params": list(self.params),
            "param_specs": [str(s) for s in self.param_specs],
            "indexer": self.indexer,
        }


@dataclasses.dataclass(frozen=True, repr=False)
class TpPlan:
    """Per-rank shard plan of one DSA layer (the seed's ``DsaTpPlan``), pure data.

    Build it with ``TpPlan.build(cfg, tp_rank, tp_size)``. Bytes count ``elem_bytes`` per
    element (bf16, 2, by default: the checkpoint's dtype).
    """

    tp_rank: int
    tp_size: int
    full_heads: int
    local_heads: int
    elem_bytes: int
    axis: str
    tensors: tuple[TensorPlan, ...]
    cfg: DsaConfig = dataclasses.field(repr=False, compare=False, default=None)

    @classmethod
    def build(
        cls,
        cfg: DsaConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        *,
        elem_bytes: int = BF16_BYTES,
        layer_idx: int | None = None,
        axis: str = "tp",
    ) -> "TpPlan":
        """The plan of rank ``tp_rank`` of ``tp_size``.

        ``layer_idx`` picks a layer of ``cfg``: a ``"shared"`` indexer layer has no indexer
        tensors. ``None`` (the default) plans a layer with its own indexer, as the seed does.
        """
        cfg.validate()
        for name, v in (("tp_rank", tp_rank), ("tp_size", tp_size)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside 0 <= tp_rank < tp_size={tp_size}")
        _check_sizes(cfg, tp_size)
        nh = cfg.num_attention_heads
        local_heads = nh // tp_size
        hf = hf_tensor_shapes(cfg)
        specs = partition_specs(cfg, axis, layer_idx=layer_idx)
        tensors = []
        for e in _entries(cfg, _with_indexer(cfg, layer_idx)):
            full = hf[e.hf_name]
            if e.kind is ShardKind.HEAD_ROWS:
                per = full[0] // tp_size
                local, offset = (per,) + full[1:], (tp_rank * per,) + (0,) * (len(full) - 1)
            elif e.kind is ShardKind.HEAD_COLS:
                per = full[1] // tp_size
                local, offset = (full[0], per), (0, tp_rank * per)
            else:
                local, offset = full, (0,) * len(full)
            tensors.append(TensorPlan(
                name=e.name, hf_name=e.hf_name, kind=e.kind, elem_bytes=int(elem_bytes),
                full_shape=tuple(full), local_shape=tuple(local), src_offset=tuple(offset),
                params=tuple("/".join(p) for p, _ in e.params),
                param_specs=tuple(specs[p] for p, _ in e.params), indexer=e.indexer,
            ))
        return cls(int(tp_rank), int(tp_size), nh, local_heads, int(elem_bytes), axis, tuple(tensors), cfg)

    @classmethod
    def all_ranks(cls, cfg: DsaConfig, tp_size: int, **kwargs) -> list["TpPlan"]:
        """The plan of every rank of a ``tp_size``-way split."""
        return [cls.build(cfg, r, tp_size, **kwargs) for r in range(tp_size)]

    # ---------------------------------------------------------------- look-ups
    def get(self, name: str) -> TensorPlan:
        """A tensor by seed/HF name (``"q_b_proj"`` or ``"q_b_proj.weight"``) or by one of
        our parameter paths (``"w_uk"``, ``"indexer/wq_b"``)."""
        for t in self.tensors:
            if name in (t.name, t.hf_name) or name in t.params:
                return t
        raise KeyError(f"no tensor {name!r} in the plan; tensors: {[t.name for t in self.tensors]}")

    def __getitem__(self, name: str) -> TensorPlan:
        return self.get(name)

    # ---------------------------------------------------------------- totals
    @property
    def local_bytes(self) -> int:
        """Bytes of parameters this rank holds."""
        return sum(t.local_bytes for t in self.tensors)

    @property
    def full_bytes(self) -> int:
        """Bytes of the whole (unsharded) layer."""
        return sum(t.full_bytes for t in self.tensors)

    @property
    def replicated_bytes(self) -> int:
        """Bytes every rank holds in full."""
        return sum(t.full_bytes for t in self.tensors if t.kind is ShardKind.REPLICATED)

    @property
    def sharded_local_bytes(self) -> int:
        """This rank's bytes of the head-sharded tensors."""
        return sum(t.local_bytes for t in self.tensors if t.kind is not ShardKind.REPLICATED)

    @property
    def indexer_bytes(self) -> int:
        """Bytes of the (replicated) indexer, held by every rank."""
        return sum(t.full_bytes for t in self.tensors if t.indexer)

    @property
    def needs_output_all_reduce(self) -> bool:
        """``o_proj`` is row-parallel: above ``tp_size = 1`` its output is all-reduced."""
        return self.tp_size > 1

    def output_allreduce_bytes(self, tokens: int = 1, act_bytes: int | None = None) -> int:
        """Bytes each rank contributes to the ``o_proj`` all-reduce for ``tokens`` tokens
        (``hidden_size`` values per token, in ``act_bytes``, default ``elem_bytes``); 0 at TP 1."""
        if not self.needs_output_all_reduce:
            return 0
        return tokens * self.cfg.hidden_size * (act_bytes or self.elem_bytes)

    def indexer_allreduce_bytes(self, context: int | None = None, q_rows: int = 1) -> int:
        """The all-reduce a head-sharded indexer would need and this plan avoids.

        Scores are ``[q_rows, n_pools]`` float32 with ``n_pools = context // index_kpool``:
        bytes per layer for ``q_rows`` query rows (1 = one decode token). ``context``
        defaults to ``max_position_embeddings``.
        """
        context = self.cfg.max_position_embeddings if context is None else int(context)
        return q_rows * (context // self.cfg.index_kpool) * SCORE_BYTES

    # ---------------------------------------------------------------- display
    def to_rows(self) -> list[dict[str, Any]]:
        return [t.to_row() for t in self.tensors]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "axis": self.axis,
            "full_heads": self.full_heads,
            "local_heads": self.local_heads,
            "elem_bytes": self.elem_bytes,
            "tensors": self.to_rows(),
            "local_bytes": self.local_bytes,
            "full_bytes": self.full_bytes,
            "replicated_bytes": self.replicated_bytes,
            "indexer_bytes": self.indexer_bytes,
            "needs_output_all_reduce": self.needs_output_all_reduce,
        }

    _COLUMNS = ("tensor", "kind", "full shape", "local shape", "offset", "full", "local", "spec")

    def _table_rows(self) -> list[tuple[str, ...]]:
        rows = []
        for t in self.tensors:
            shp = lambda s: "x".join(map(str, s))
            rows.append((
                t.name, t.kind.value, shp(t.full_shape), shp(t.local_shape),
                ",".join(map(str, t.src_offset)), _fmt_bytes(t.full_bytes),
                _fmt_bytes(t.local_bytes),
                "; ".join(f"{p}{_spec_str(s)}" for p, s in zip(t.params, t.param_specs)),
            ))
        return rows

    def _summary(self) -> list[str]:
        ar = (
            f"yes, o_proj output ({self.cfg.hidden_size} values per token) once per call"
            if self.needs_output_all_reduce else "no (tp_size 1)"
        )
        return [
            f"rank {self.tp_rank} of {self.tp_size}: {self.local_heads} of {self.full_heads} heads",
            f"local bytes      {_fmt_bytes(self.local_bytes)} ({self.local_bytes:,} B)",
            f"full bytes       {_fmt_bytes(self.full_bytes)} ({self.full_bytes:,} B)",
            f"replicated bytes {_fmt_bytes(self.replicated_bytes)} ({self.replicated_bytes:,} B),"
            f" of which indexer {_fmt_bytes(self.indexer_bytes)} ({self.indexer_bytes / 1e6:.1f} MB)",
            f"output all-reduce: {ar}",
        ]

    def table(self) -> str:
        """A plain-text table of the tensors, then the totals."""
        rows = [self._COLUMNS] + self._table_rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._COLUMNS))]
        right = {5, 6}
        fmt = lambda r: "  ".join(
            (c.rjust(w) if i in right else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)]
        lines += [fmt(r) for r in rows[1:]]
        return "\n".join(lines + [""] + self._summary())

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (
            f"TpPlan(rank {self.tp_rank} of {self.tp_size}, {self.local_heads}/{self.full_heads} "
            f"heads, {len(self.tensors)} tensors, local {_fmt_bytes(self.local_bytes)}, "
            f"replicated {_fmt_bytes(self.replicated_bytes)}, axis {self.axis!r})"
        )

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th>{esc(c)}</th>" for c in self._COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in self._table_rows()
        )
        summary = "<br>".join(esc(s) for s in self._summary())
        return (
            f"<div><b>TpPlan</b> (axis {esc(repr(self.axis))})<table><thead><tr>{head}</tr>"
            f"</thead><tbody>{body}</tbody></table><p>{summary}</p></div>"
        )


def _spec_str(spec: P) -> str:
    return "[" + ", ".join("-" if a is None else str(a) for a in tuple(spec)) + "]"


def _fmt_bytes(n: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------- specs
def partition_specs(
    cfg: DsaConfig, axis: str = "tp", *, layer_idx: int | None = None
) -> dict[tuple[str, ...], P]:
    """``{param path: PartitionSpec}`` for every parameter of our layout.

    Paths are the tuples of ``nnx.state(layer, nnx.Param)`` (``("q_b_proj",)``,
    ``("indexer", "wq_b")``). The head axis of ``q_b_proj [q_lora, heads, qk_head]``,
    ``w_uk [heads, qk_nope, C]``, ``w_uv [heads, v_head, C]`` and ``o_proj [heads, v_head,
    hidden]`` is ``axis``; every other axis and parameter is replicated. ``layer_idx``
    picks a layer (a ``"shared"`` layer has no indexer); ``None`` = a full-indexer layer.
    """
    shapes = _param_shapes(cfg)
    out: dict[tuple[str, ...], P] = {}
    for e in _entries(cfg, _with_indexer(cfg, layer_idx)):
        for path, head_dim in e.params:
            spec = [None] * len(shapes[path])
            if head_dim is not None:
                spec[head_dim] = axis
            out[path] = P(*spec)
    return out


def param_shardings(layer) -> dict[tuple[str, ...], NamedSharding]:
    """``{param path: NamedSharding}`` of a layer placed by ``shard_layer``."""
    mesh = layer.mesh
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
    _check_sizes(layer.cfg, size, axis)
    old = layer.mesh
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
        var.set_value(put(var[...], NamedSharding(mesh, spec)))
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
    """``cache`` replicated on ``mesh`` (works on traced values too, as a constraint): the
    placement ``cache_shardings`` describes, done by ``parallel.replicate``."""
    return replicate(cache, mesh)


# ------------------------------------------------------------------------------- CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    """``glm5-dsa plan``: print the TP plan table and per-rank totals."""
    from glm5_dsa_jax.cli.args import nonnegative_int, positive_int

    p = subparsers.add_parser(
        "plan", help="print the tensor-parallel shard plan of one DSA layer",
        description=add_parser.__doc__,
    )
    p.add_argument("--tp", type=positive_int, default=8, help="TP size (default 8)")
    p.add_argument("--rank", type=nonnegative_int, default=0, help="rank whose tensor table is shown (default 0)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=("glm53-flash", "tiny"), default="glm53-flash")
    src.add_argument("--config", help="a glm5_next config.json (or its directory)")
    p.add_argument("--elem-bytes", type=positive_int, default=BF16_BYTES, help="bytes per element (bf16: 2)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="context for the indexer all-reduce figure (default max_position_embeddings)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_plan_main)
    return p


def _plan_main(args) -> int:
    import sys

    try:
        cfg = DsaConfig.from_hf_config(args.config) if args.config else DsaConfig.preset(args.preset)
        plans = TpPlan.all_ranks(cfg, args.tp, elem_bytes=args.elem_bytes)
        plan = TpPlan.build(cfg, args.rank, args.tp, elem_bytes=args.elem_bytes)
    except (ValueError, FileNotFoundError) as e:
        print(f"glm5-dsa plan: error: {e}", file=sys.stderr)
        return 2
    context = args.context or cfg.max_position_embeddings
    if args.json:
        d = plan.to_dict()
        d["per_rank_local_bytes"] = [p.local_bytes for p in plans]
        d["indexer_allreduce_bytes_per_token"] = plan.indexer_allreduce_bytes(context)
        d["context"] = context
        print(json.dumps(d, indent=2))
        return 0
    print(plan.table())
    print()
    print("per-rank totals:")
    for p in plans:
        print(f"  rank {p.tp_rank}: {_fmt_bytes(p.local_bytes):>10}  ({p.local_bytes:,} B, "
              f"{p.local_heads} heads)")
    print(f"  all ranks: {_fmt_bytes(sum(p.local_bytes for p in plans))} "
          f"(full layer {_fmt_bytes(plan.full_bytes)}; its {_fmt_bytes(plan.replicated_bytes)} "
          f"replicated part is held by each of the {args.tp} ranks)")
    print(
        f"indexer all-reduce avoided: {_fmt_bytes(plan.indexer_allreduce_bytes(context))} per "
        f"decode token per layer at {context:,} tokens "
        f"({context // cfg.index_kpool:,} pools x {SCORE_BYTES} B)"
    )
    return 0
