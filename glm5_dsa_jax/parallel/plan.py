"""The tensor-parallel plan of one DSA layer as data: which tensor is split how, what each
rank holds, and the PartitionSpecs of our parameters. Pure data (no mesh, no devices);
placement is ``glm5_dsa_jax.parallel.sharding``.

Invariants:

* Everything here is derived from the layout table (``glm5_dsa_jax.model.layout``, which says
  which tensors hold the ``"heads"`` axis): a tensor is split exactly when one of its
  parameters has that axis, by rows when the heads are in its PyTorch out-dim, by columns
  when in its in-dim (row-parallel: its output is all-reduced once per call). Everything
  else is replicated, **the whole indexer** included.
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
* ``TpPlan`` describes the Hugging Face tensors (PyTorch ``[out, in]`` layout, the names
  ``load_hf_weights`` takes) so its numbers match ``DsaTpPlan`` of the CUDA serving engine
  whose DSA pipeline and TP plan this project was specified from (called "the seed" below;
  it is not in this repository); each entry also names the parameters of this project's layout
  it becomes (``kv_b_proj`` -> ``w_uk`` and ``w_uv``). ``partition_specs`` (defined in
  ``layout``, re-exported here) gives the PartitionSpec of every parameter in our layout;
  they are the same as the
  ``out_sharding`` metadata ``DsaAttention`` attaches to its ``nnx.Param``s (both are
  ``layout.Param.spec``), which survives ``nnx.split`` / ``nnx.merge`` and orbax restores.
* Bytes count ``elem_bytes`` per element (``BF16_BYTES``, the checkpoint's dtype, by
  default); the indexer's scores are float32 (``SCORE_BYTES``).
"""

from __future__ import annotations

import dataclasses
import enum
import html
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from glm5_dsa_jax.model import layout
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.model.layout import partition_specs  # re-exported: the plan's specs, one home in layout

__all__ = [
    "ShardKind", "TensorPlan", "TpPlan", "partition_specs", "check_tp_size", "fmt_bytes",
    "BF16_BYTES", "SCORE_BYTES",
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

    @classmethod
    def of(cls, tensor: layout.Tensor) -> "ShardKind":
        """The kind of a layout row: where its TP-split heads are, if anywhere."""
        return {None: cls.REPLICATED, 0: cls.HEAD_ROWS, 1: cls.HEAD_COLS}[tensor.heads_hf_axis]


def check_tp_size(cfg: DsaConfig, tp_size: int, axis: str | None = None) -> None:
    """``ValueError`` unless ``tp_size`` (the size of mesh axis ``axis``, if given) is a
    positive integer that divides the attention heads."""
    what = f"mesh axis {axis!r} of size {tp_size}" if axis is not None else f"tp_size {tp_size}"
    if not isinstance(tp_size, (int, np.integer)) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"{what}: the TP size must be a positive integer")
    if cfg.num_attention_heads % tp_size:
        raise ValueError(
            f"{what} does not divide num_attention_heads={cfg.num_attention_heads}: the head "
            f"axis of {layout.head_split_names()} must split evenly over the "
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
        check_tp_size(cfg, tp_size)
        nh = cfg.num_attention_heads
        local_heads = nh // tp_size
        specs = partition_specs(cfg, axis, layer_idx=layer_idx)
        tensors = []
        for t in layout.layer_tensors(cfg, layer_idx):
            full = t.hf_shape(cfg)
            kind = ShardKind.of(t)
            local, offset = list(full), [0] * len(full)
            if kind is not ShardKind.REPLICATED:  # the heads' axis, split evenly
                ax = t.heads_hf_axis
                local[ax] = full[ax] // tp_size
                offset[ax] = tp_rank * local[ax]
            tensors.append(TensorPlan(
                name=t.name, hf_name=t.hf_name, kind=kind, elem_bytes=int(elem_bytes),
                full_shape=tuple(full), local_shape=tuple(local), src_offset=tuple(offset),
                params=tuple(p.name for p in t.params),
                param_specs=tuple(specs[p.path] for p in t.params), indexer=t.indexer,
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
                ",".join(map(str, t.src_offset)), fmt_bytes(t.full_bytes),
                fmt_bytes(t.local_bytes),
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
            f"local bytes      {fmt_bytes(self.local_bytes)} ({self.local_bytes:,} B)",
            f"full bytes       {fmt_bytes(self.full_bytes)} ({self.full_bytes:,} B)",
            f"replicated bytes {fmt_bytes(self.replicated_bytes)} ({self.replicated_bytes:,} B),"
            f" of which indexer {fmt_bytes(self.indexer_bytes)} ({self.indexer_bytes / 1e6:.1f} MB)",
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
            f"heads, {len(self.tensors)} tensors, local {fmt_bytes(self.local_bytes)}, "
            f"replicated {fmt_bytes(self.replicated_bytes)}, axis {self.axis!r})"
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


def fmt_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches (``"4.00 MiB"``)."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"
