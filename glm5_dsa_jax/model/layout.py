"""The one table of a DSA layer's tensors: Hugging Face names and shapes <-> our parameters.

``TENSORS`` describes each HF tensor of a layer once; parameter creation (``DsaAttention``,
``DsaIndexer``), ``hf_weight_shapes``, both directions of ``weights`` (``hf_to_params``,
``params_to_hf``), the TP plan and PartitionSpecs (``plan``), the sliced checkpoint import
and the roofline (``weight_bytes``, ``matmuls``) all read it. A fact about the layout is
changed here or not at all.

Invariants:

* HF tensors are PyTorch ``[out, in]`` (1-D for norms and biases), named relative to
  ``self_attn.``. Each HF axis is the row-major flattening of one or more *view axes*, each
  a size of the ``DsaConfig`` named in ``DIMS`` (``q_b_proj`` rows are ``heads x qk_head``).
  View-axis names are unique within a tensor.
* A parameter (``Param``) is stored in JAX layout: ``[in, out]``, heads as their own axis.
  It names its axes by the tensor's view axes, so the transform between the two is only
  "reshape the HF tensor into its view, take the parameter's part, transpose": a 1-D tensor
  is taken as-is, a matrix is transposed, an out-dim of ``heads * per_head`` rows becomes a
  head axis (``q_b_proj``; ``o_proj``'s in-dim likewise), and nothing else is possible.
* A view axis may be the concatenation of *parts* (``("qk_nope", "v_head")``: each head's
  ``kv_b_proj`` rows are ``W_UK`` rows then ``W_UV`` rows). A parameter naming a part holds
  only that range; every part is held by exactly one parameter of the tensor, every plain
  view axis by all of them: ``kv_b_proj -> w_uk + w_uv`` is a table row, not code.
  ``_check_table`` enforces these rules at import.
* Only the view axis ``"heads"`` (the attention heads) is split over tensor parallelism:
  its parameter axis is the TP axis (``Param.spec``), and the HF axis that holds it says
  whether the tensor shards by rows (``q_b_proj``, ``kv_b_proj``) or by columns
  (``o_proj``). ``"index_heads"`` is never split: the indexer is replicated (see ``plan``).
* One transform path: ``read_param`` builds any block of a parameter (per-axis ``[start,
  stop)`` bounds, a TP shard say) through a reader of HF ``(rows, cols)`` ranges, reading
  only the rows and columns the block needs (a contiguous range of the leading view axis of
  each HF axis). The whole-tensor import is the same call with full bounds
  (``array_reader`` of an in-memory tensor); ``assemble_hf`` is its inverse.
* Biases (``Tensor.bias``) exist only with ``attention_bias``; indexer tensors only on a
  layer with its own (``"full"``) indexer. ``layer_tensors`` applies both rules.
* ``Param.aliases`` are paths under which earlier versions of this project stored the
  parameter (``kv_a_proj`` was stored under its HF name, ``kv_a_proj_with_mqa``, until HF
  names were confined to this table): orbax checkpoints written then still restore.

* Which tensors a layer has depends on the model type only through ``Tensor.kpool``: the
  k-pool compression tensors (``index_kpool_compress_gate`` / ``_ape``) exist only where
  ``cfg.rules.kpool_compression`` (``glm5_next``); ``glm_moe_dsa`` and ``deepseek_v32`` have
  none. Every other HF name and layout is the same in the three model types (read from
  their transformers 5.23.0 classes): ``indexer.wq_b`` / ``wk`` / ``k_norm`` (LayerNorm with
  bias) / ``weights_proj``, ``q_b_proj`` rows ``heads x (qk_nope + qk_rope)`` (nope first),
  ``kv_a_proj_with_mqa`` rows ``kv_lora + qk_rope`` (latent first, then the shared key).

RoPE parts (``qk_rope_head_dim > 0``): ``"qk_head"`` and ``"kv_a"`` are whole view axes whose
width includes the RoPE part, so every shape, TP spec and transform is already right for the
RoPE models, and the layer slices ``q_nope``/``q_rope`` and latent/``k_rope`` itself. To hold
the parts as separate parameters instead, make them parts of those axes
(``("qk_nope", "qk_rope")`` and ``("kv_lora", "qk_rope")``), each with its own ``Param`` row,
plus a ``DIMS`` entry ``"qk_rope": "qk_rope_head_dim"``; reading, slicing, TP specs and
``params_to_hf`` then follow with no other change.

This module imports only ``config``, numpy and ``jax.sharding.PartitionSpec``: everything
else may import it (``partition_specs`` lives here, not in ``plan``, so that the
data-parallel call, which sits below ``plan`` in the import order, reads the same specs).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from glm5_dsa_jax.model.config import DsaConfig

__all__ = [
    "ParamFactory",
    "DIMS", "Param", "Tensor", "TENSORS", "layer_tensors", "hf_tensor_shapes", "hf_weight_shapes",
    "param_shapes", "find_param", "iter_params", "read_param", "array_reader", "assemble_hf", "Reader",
    "partition_specs", "head_split_names", "contraction_orders", "joined_products",
]

#: View-axis names -> the ``DsaConfig`` attribute that sizes them.
DIMS: dict[str, str] = {
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "q_lora": "q_lora_rank",
    "qk_head": "qk_head_dim",  # qk_nope + qk_rope (the RoPE part is 0 today)
    "qk_nope": "qk_nope_head_dim",
    "v_head": "v_head_dim",
    "kv_lora": "kv_lora_rank",
    "kv_a": "kv_cache_dim",  # kv_lora + qk_rope: the latent plus the (zero) shared RoPE key
    "index_heads": "index_n_heads",
    "index_dim": "index_head_dim",
    "kpool": "index_kpool",
}

#: The view axis split over tensor parallelism.
HEADS = "heads"

#: A view axis: one ``DIMS`` name, or a tuple of them (the concatenation of those parts).
Axis = str | tuple[str, ...]
#: ``read(rows, cols)`` -> the HF block ``[rows[0]:rows[1], cols[0]:cols[1]]`` (``cols`` is
#: None for a 1-D tensor).
Reader = Callable[[tuple[int, int], "tuple[int, int] | None"], np.ndarray]


def _size(cfg: DsaConfig, ax: Axis) -> int:
    if isinstance(ax, tuple):
        return sum(_size(cfg, p) for p in ax)
    return int(getattr(cfg, DIMS[ax]))


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of our layout, made from (part of) one HF tensor."""

    #: attribute path in the layer (``nnx.state`` path): ``("q_b_proj",)``, ``("indexer", "wk")``
    path: tuple[str, ...]
    #: its axes in our order, each a view axis (or one part of one) of its tensor
    axes: tuple[str, ...]
    #: initialiser: ``"normal"`` (std ``fan_in ** -0.5``), ``"ones"`` or ``"zeros"``
    init: str = "normal"
    #: the dims whose product is the fan-in of ``"normal"``; None = the first axis
    fan_in: tuple[str, ...] | None = None
    #: earlier paths of this parameter (read by ``restore_checkpoint``)
    aliases: tuple[tuple[str, ...], ...] = ()
    #: the axes the layer's product of it contracts (``ops.matmul``: the spec's weight
    #: letters absent from its output); empty: no product reads it. The CPU policy's
    #: contraction-last copies move them last (``contraction_orders``).
    contract: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """``"/".join(path)``, as the TP plan prints it."""
        return "/".join(self.path)

    def shape(self, cfg: DsaConfig) -> tuple[int, ...]:
        return tuple(_size(cfg, a) for a in self.axes)

    @property
    def heads_axis(self) -> int | None:
        """Index of the attention-head axis (split over TP), None = replicated."""
        return self.axes.index(HEADS) if HEADS in self.axes else None

    def spec(self, tp_axis: str | None) -> tuple[str | None, ...]:
        """The parameter's PartitionSpec entries: ``tp_axis`` on the head axis."""
        return tuple(tp_axis if a == HEADS else None for a in self.axes)

    @property
    def contraction_last(self) -> tuple[int, ...] | None:
        """The axis order that moves ``contract`` last (the other axes, then the contracted
        ones, each in stored order); None for a parameter no product reads."""
        if not self.contract:
            return None
        keep = [i for i, a in enumerate(self.axes) if a not in self.contract]
        return tuple(keep + [self.axes.index(a) for a in self.contract])

    def init_std(self, cfg: DsaConfig) -> float:
        dims = self.fan_in if self.fan_in is not None else self.axes[:1]
        return math.prod(_size(cfg, d) for d in dims) ** -0.5


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor of a layer and the parameters it becomes."""

    #: name relative to ``self_attn.``
    hf_name: str
    #: per PyTorch axis, the view axes flattened (row-major) into it
    hf_axes: tuple[tuple[Axis, ...], ...]
    params: tuple[Param, ...]
    #: belongs to the lightning indexer (present only on a ``"full"`` indexer layer)
    indexer: bool = False
    #: an ``attention_bias`` bias (present only with ``cfg.attention_bias``)
    bias: bool = False
    #: a k-pool compression tensor (present only when ``cfg.rules.kpool_compression``)
    kpool: bool = False
    #: the name in the seed's ``DsaTpPlan`` (the CUDA engine ``plan`` was specified from)
    #: when it is not ``hf_name`` less ``".weight"``
    plan_name: str | None = None

    @property
    def name(self) -> str:
        """The TP plan's name of the tensor (the seed's: the HF module)."""
        return self.plan_name or self.hf_name.removesuffix(".weight")

    def hf_shape(self, cfg: DsaConfig) -> tuple[int, ...]:
        """PyTorch shape."""
        return tuple(math.prod(_size(cfg, a) for a in group) for group in self.hf_axes)

    @property
    def view(self) -> tuple[Axis, ...]:
        return tuple(a for group in self.hf_axes for a in group)

    @property
    def heads_hf_axis(self) -> int | None:
        """The PyTorch axis that holds the TP-split heads (0: rows, 1: columns), or None
        when every parameter of the tensor is replicated."""
        if all(p.heads_axis is None for p in self.params):
            return None
        return next(i for i, g in enumerate(self.hf_axes) if HEADS in g)

    @property
    def transform(self) -> str:
        """How HF becomes ours: ``"as-is"``, ``"transpose"``, ``"heads"`` (an HF dim split
        into a head axis, then transposed) or ``"parts"`` (split into several parameters)."""
        if len(self.params) > 1:
            return "parts"
        if any(len(g) > 1 for g in self.hf_axes):
            return "heads"
        return "as-is" if self.params[0].axes == self.view else "transpose"

    def describe(self) -> str:
        """``"kv_b_proj.weight [heads*(qk_nope|v_head), kv_lora] -> w_uk[heads, qk_nope, kv_lora] + ..."``."""
        ax = lambda a: "(" + "|".join(a) + ")" if isinstance(a, tuple) else a
        hf = ", ".join("*".join(ax(a) for a in g) for g in self.hf_axes)
        ps = " + ".join(f"{p.name}[{', '.join(p.axes)}]" for p in self.params)
        return f"{self.hf_name} [{hf}] -> {ps} ({self.transform})"


def _w(hf_name, hf_axes, path, axes, **kw) -> Tensor:
    """A tensor that is one parameter (every row of the table but ``kv_b_proj``)."""
    tkw = {k: kw.pop(k) for k in ("indexer", "bias", "kpool", "plan_name") if k in kw}
    return Tensor(hf_name, hf_axes, (Param(path, axes, **kw),), **tkw)


# Table order is creation order: parameters draw their random init in this order.
TENSORS: tuple[Tensor, ...] = (
    _w("q_a_proj.weight", (("q_lora",), ("hidden",)), ("q_a_proj",), ("hidden", "q_lora"), contract=("hidden",)),
    _w("q_a_layernorm.weight", (("q_lora",),), ("q_a_layernorm",), ("q_lora",), init="ones"),
    _w("q_b_proj.weight", (("heads", "qk_head"), ("q_lora",)), ("q_b_proj",), ("q_lora", "heads", "qk_head"),
       contract=("q_lora",)),
    # The latent and the shared RoPE key in one matrix (hence the HF name); ours is kv_a_proj.
    _w("kv_a_proj_with_mqa.weight", (("kv_a",), ("hidden",)), ("kv_a_proj",), ("hidden", "kv_a"),
       aliases=(("kv_a_proj_with_mqa",),), contract=("hidden",)),
    _w("kv_a_layernorm.weight", (("kv_lora",),), ("kv_a_layernorm",), ("kv_lora",), init="ones"),
    # Split once, at load: attention runs in the kv_lora-wide latent space (absorb_q/absorb_o).
    Tensor("kv_b_proj.weight", (("heads", ("qk_nope", "v_head")), ("kv_lora",)), (
        Param(("w_uk",), ("heads", "qk_nope", "kv_lora"), fan_in=("kv_lora",), contract=("qk_nope",)),
        Param(("w_uv",), ("heads", "v_head", "kv_lora"), fan_in=("kv_lora",), contract=("kv_lora",)),
    )),
    _w("o_proj.weight", (("hidden",), ("heads", "v_head")), ("o_proj",), ("heads", "v_head", "hidden"),
       fan_in=("heads", "v_head"), contract=("heads", "v_head")),
    _w("q_a_proj.bias", (("q_lora",),), ("q_a_proj_bias",), ("q_lora",), init="zeros", bias=True),
    _w("kv_a_proj_with_mqa.bias", (("kv_a",),), ("kv_a_proj_bias",), ("kv_a",), init="zeros", bias=True),
    # Added once, after the all-reduce of the row-parallel o_proj.
    _w("o_proj.bias", (("hidden",),), ("o_proj_bias",), ("hidden",), init="zeros", bias=True),
    _w("indexer.wq_b.weight", (("index_heads", "index_dim"), ("q_lora",)), ("indexer", "wq_b"),
       ("q_lora", "index_heads", "index_dim"), indexer=True, contract=("q_lora",)),
    _w("indexer.wk.weight", (("index_dim",), ("hidden",)), ("indexer", "wk"), ("hidden", "index_dim"),
       indexer=True, contract=("hidden",)),
    _w("indexer.k_norm.weight", (("index_dim",),), ("indexer", "k_norm_scale"), ("index_dim",),
       init="ones", indexer=True, plan_name="indexer.k_norm.weight"),
    _w("indexer.k_norm.bias", (("index_dim",),), ("indexer", "k_norm_bias"), ("index_dim",),
       init="zeros", indexer=True),
    _w("indexer.weights_proj.weight", (("index_heads",), ("hidden",)), ("indexer", "weights_proj"),
       ("hidden", "index_heads"), indexer=True, contract=("hidden",)),
    _w("indexer.index_kpool_compress_gate", (("index_dim",), ("hidden",)), ("indexer", "kpool_gate"),
       ("hidden", "index_dim"), indexer=True, kpool=True, contract=("hidden",)),
    _w("indexer.index_kpool_compress_ape", (("kpool",), ("index_dim",)), ("indexer", "kpool_ape"),
       ("kpool", "index_dim"), init="zeros", indexer=True, kpool=True),
)


def _check_table(tensors: Sequence[Tensor]) -> None:
    """The rules of the module doc; a table that breaks one fails at import."""
    paths = set()
    for t in tensors:
        view = t.view
        plain = [a for a in view if isinstance(a, str)]
        assert len(set(plain)) == len(plain), t.hf_name
        for a in plain + [p for a in view if isinstance(a, tuple) for p in a]:
            assert a in DIMS, (t.hf_name, a)
        for p in t.params:
            assert p.path not in paths, p.path
            assert set(p.contract) <= set(p.axes), p.path
            paths.add(p.path)
            assert p.init in ("normal", "ones", "zeros"), p.path
            assert len(p.axes) == len(view) and len(set(p.axes)) == len(p.axes), p.path
            for a in view:  # each view axis once: whole, or one of its parts
                hits = [x for x in p.axes if x == a or (isinstance(a, tuple) and x in a)]
                assert len(hits) == 1, (p.path, a)
        for a in view:
            if isinstance(a, tuple):
                held = sorted(x for p in t.params for x in p.axes if x in a)
                assert held == sorted(a), (t.hf_name, a)
        assert len(t.hf_axes) in (1, 2), t.hf_name
        assert t.heads_hf_axis is None or all(p.heads_axis is not None for p in t.params), t.hf_name


_check_table(TENSORS)


# ---------------------------------------------------------------------------- look-ups
def layer_tensors(cfg: DsaConfig, layer_idx: int | None = None, *, indexer: bool | None = None) -> list[Tensor]:
    """The tensors of one layer of ``cfg``: biases only with ``attention_bias``, indexer
    tensors only when the layer has its own indexer (``layer_idx``; ``indexer=`` says it
    directly; neither = a ``"full"`` layer), k-pool tensors only in a model type with k-pool
    compression."""
    if indexer is None:
        indexer = True if layer_idx is None else cfg.has_indexer(layer_idx)
    return [t for t in _model_tensors(cfg) if (cfg.attention_bias or not t.bias) and (indexer or not t.indexer)]


def _model_tensors(cfg: DsaConfig) -> list[Tensor]:
    """The tensors ``cfg``'s model type can have (``Tensor.kpool`` rows only with pooling)."""
    return [t for t in TENSORS if cfg.rules.kpool_compression or not t.kpool]


def hf_tensor_shapes(cfg: DsaConfig) -> dict[str, tuple[int, ...]]:
    """PyTorch-layout shapes of every HF tensor a DSA layer of ``cfg`` can have (names
    after ``self_attn.``): biases and indexer included, whatever the layer (k-pool tensors
    only in a model type that has them)."""
    return {t.hf_name: t.hf_shape(cfg) for t in _model_tensors(cfg)}


def contraction_orders() -> dict[tuple[str, ...], tuple[int, ...]]:
    """``{param path: Param.contraction_last}`` of every parameter a product reads: the axis
    orders of the CPU policy's contraction-last copies (``cpu_policy.contraction_last_params``)."""
    return {p.path: p.contraction_last for t in TENSORS for p in t.params if p.contract}


#: The contracted axes whose products a GPU step joins: the hidden state's. Its five
#: products (q_a, kv_a and the indexer's wk, weights_proj, kpool_gate) feed norms and
#: elementwise work that fuse into the one product's consumers, so joining them saves
#: kernels (deviceless H200 compile: 3 of 44 at batch 1, 6 of 53 at batch 8). ``q_resid``'s
#: two (q_b, the indexer's wq_b) are not joined: each part feeds a product or a Pallas
#: kernel that takes it as a buffer of its own, so the join costs a slice kernel for
#: every kernel it saves (tried 2026-12-07: no count changed).
JOINED_CONTRACTIONS = (("hidden",),)


def joined_products() -> tuple[tuple[tuple[str, ...], ...], ...]:
    """The parameter paths of each group of products a GPU step multiplies as one
    (``JOINED_CONTRACTIONS``: those contracting the hidden state), in table order: each
    group multiplies one activation, against its members' contraction-last copies joined
    (``cpu_policy.contraction_last_params``, "Joined products")."""
    return tuple(tuple(p.path for t in TENSORS for p in t.params if p.contract == axes)
                 for axes in JOINED_CONTRACTIONS)


def hf_weight_shapes(cfg: DsaConfig, layer_idx: int) -> dict[str, tuple[int, ...]]:
    """PyTorch-layout shapes of the HF tensors of one DSA layer (names after ``self_attn.``):
    biases only with ``attention_bias``, indexer tensors only on a ``"full"`` layer."""
    cfg.check_layer(layer_idx)
    return {t.hf_name: t.hf_shape(cfg) for t in layer_tensors(cfg, layer_idx)}


def param_shapes(cfg: DsaConfig, layer_idx: int | None = None) -> dict[tuple[str, ...], tuple[int, ...]]:
    """``{param path: shape}`` of one layer (``layer_tensors``' rules)."""
    return {p.path: p.shape(cfg) for t in layer_tensors(cfg, layer_idx) for p in t.params}


def find_param(path: Sequence[str]) -> tuple[Tensor, Param]:
    """The tensor and parameter of a param path (or of one of its ``aliases``)."""
    path = tuple(path)
    for t in TENSORS:
        for p in t.params:
            if path == p.path or path in p.aliases:
                return t, p
    raise KeyError(f"no parameter {'/'.join(path)!r} in the layout")


# ---------------------------------------------------------------------------- transform
def _view_bounds(cfg: DsaConfig, p: Param, ax: Axis, bounds) -> tuple[int, int]:
    """``[start, stop)`` along view axis ``ax`` of the block ``bounds`` of ``p``."""
    if isinstance(ax, str):
        return bounds[p.axes.index(ax)]
    off = 0
    for part in ax:
        if part in p.axes:
            b0, b1 = bounds[p.axes.index(part)]
            return off + b0, off + b1
        off += _size(cfg, part)
    raise AssertionError((p.path, ax))  # _check_table rules this out


def _full_bounds(shape) -> list[tuple[int, int]]:
    return [(0, n) for n in shape]


def read_param(
    cfg: DsaConfig, tensor: Tensor, param: Param, read: Reader,
    bounds: Sequence[tuple[int, int]] | None = None,
) -> np.ndarray:
    """The block ``bounds`` (one ``(start, stop)`` per axis of ``param``; None = all of it)
    of ``param``, read from ``tensor`` through ``read``, in our layout and the reader's dtype.

    Per HF axis, only the rows (or columns) covering the block's range of the leading view
    axis are read; the other view axes of that HF axis are sliced after the read.
    """
    shape = param.shape(cfg)
    bounds = _full_bounds(shape) if bounds is None else [tuple(map(int, b)) for b in bounds]
    if len(bounds) != len(shape) or any(not 0 <= b0 <= b1 <= n for (b0, b1), n in zip(bounds, shape)):
        raise ValueError(f"bounds {bounds} do not fit {param.name} of shape {shape}")
    ranges, block, cut = [], [], []
    for group in tensor.hf_axes:
        vb = [_view_bounds(cfg, param, a, bounds) for a in group]
        sizes = [_size(cfg, a) for a in group]
        rest = math.prod(sizes[1:])
        ranges.append((vb[0][0] * rest, vb[0][1] * rest))
        block += [vb[0][1] - vb[0][0]] + sizes[1:]
        cut += [slice(None)] + [slice(b0, b1) for b0, b1 in vb[1:]]
    x = np.asarray(read(ranges[0], ranges[1] if len(ranges) > 1 else None))
    x = x.reshape(block)[tuple(cut)]
    return x.transpose(_to_param_order(tensor, param))


def _to_param_order(tensor: Tensor, param: Param) -> list[int]:
    """``perm`` with ``view_block.transpose(perm)`` in ``param``'s axis order."""
    where = {}
    for i, a in enumerate(tensor.view):
        for x in ((a,) if isinstance(a, str) else a):
            where[x] = i
    return [where[a] for a in param.axes]


def array_reader(a: np.ndarray) -> Reader:
    """A ``Reader`` of an in-memory HF tensor (the whole-tensor import)."""
    def read(rows, cols):
        return a[rows[0]:rows[1]] if cols is None else a[rows[0]:rows[1], cols[0]:cols[1]]

    return read


def assemble_hf(cfg: DsaConfig, tensor: Tensor, arrays: Mapping[tuple[str, ...], np.ndarray]) -> np.ndarray:
    """The inverse of ``read_param``: the whole HF tensor from its parameters' arrays
    (``{param path: array}``, each whole), float32."""
    view = tensor.view
    out = np.zeros([_size(cfg, a) for a in view], np.float32)
    for p in tensor.params:
        a = np.asarray(arrays[p.path], np.float32)
        if a.shape != p.shape(cfg):
            raise ValueError(f"{p.name} has shape {a.shape}, expected {p.shape(cfg)}")
        perm = _to_param_order(tensor, p)
        # param order -> view order, then into the parameter's part of each view axis
        a = a.transpose(np.argsort(perm))
        cut = tuple(slice(*_view_bounds(cfg, p, ax, _full_bounds(p.shape(cfg)))) for ax in view)
        out[cut] = a
    return out.reshape(tensor.hf_shape(cfg))


def iter_params(tensors: Iterable[Tensor]) -> Iterable[tuple[Tensor, Param]]:
    """``(tensor, param)`` for every parameter of ``tensors``, in table order."""
    for t in tensors:
        for p in t.params:
            yield t, p


def partition_specs(
    cfg: DsaConfig, axis: str = "tp", *, layer_idx: int | None = None
) -> dict[tuple[str, ...], PartitionSpec]:
    """``{param path: PartitionSpec}`` for every parameter of our layout (``Param.spec``).

    Paths are the tuples of ``nnx.state(layer, nnx.Param)`` (``("q_b_proj",)``,
    ``("indexer", "wq_b")``). The ``"heads"`` axis of every parameter that has one is
    ``axis`` (which parameters: ``head_split_names``); every other axis and parameter is
    replicated. ``layer_idx`` picks a layer (a ``"shared"`` layer has no indexer); ``None``
    = a full-indexer layer.
    """
    return {p.path: PartitionSpec(*p.spec(axis)) for _, p in iter_params(layer_tensors(cfg, layer_idx))}


def head_split_names() -> str:
    """The tensors whose head axis TP splits, as error messages name them, read from the
    table: ``"q_b_proj, kv_b_proj (w_uk, w_uv) and o_proj"`` (the parameters a tensor
    becomes in brackets where their names differ from the tensor's)."""
    names = []
    for t in TENSORS:
        if t.heads_hf_axis is None:
            continue
        params = [p.name for p in t.params]
        names.append(t.name if params == [t.name] else f"{t.name} ({', '.join(params)})")
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


# ---------------------------------------------------------------------------- parameter creation
# How a parameter is born: a row of the table becomes an ``nnx.Param`` with its
# tensor-parallel ``out_sharding`` metadata, here and nowhere else.
def _mesh_has(axis: str | None) -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return axis is not None and not mesh.empty and axis in mesh.axis_names


class ParamFactory:
    """Makes the ``nnx.Param`` of a ``Param`` row, with ``out_sharding`` metadata.

    The shape, initialiser and head axis come from the layout table. The metadata is kept
    even with no mesh in context (eager sharding is then switched off for the creation),
    so ``shard_layer`` or a user's ``nnx.get_partition_spec`` can place the parameters later.
    """

    def __init__(self, cfg: DsaConfig, rngs: nnx.Rngs, param_dtype, tp_axis: str | None):
        self.cfg, self.rngs, self.param_dtype, self.tp_axis = cfg, rngs, param_dtype, tp_axis

    def __call__(self, p: Param) -> nnx.Param:
        shape = p.shape(self.cfg)
        if p.init == "ones":
            value = jnp.ones(shape, self.param_dtype)
        elif p.init == "zeros":
            value = jnp.zeros(shape, self.param_dtype)
        else:
            std = p.init_std(self.cfg)
            value = (jax.random.normal(self.rngs.params(), shape, jnp.float32) * std).astype(self.param_dtype)
        spec = p.spec(self.tp_axis)
        if _mesh_has(self.tp_axis):
            return nnx.Param(value, out_sharding=spec)
        with nnx.use_eager_sharding(False):
            return nnx.Param(value, out_sharding=spec)

    def create(self, module: nnx.Module, tensors) -> None:
        """Set ``module.<name>`` for every parameter of ``tensors`` (table order: the order
        the random inits are drawn in)."""
        for _, p in iter_params(tensors):
            setattr(module, p.path[-1], self(p))
