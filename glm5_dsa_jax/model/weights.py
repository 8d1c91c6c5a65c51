"""Hugging Face tensors <-> this project's parameters for one DSA layer, both directions
derived from the layout table (``glm5_dsa_jax.model.layout``), plus the checks a load applies.

Invariants:

* Which tensors, their shapes and the transform (transpose, heads as an axis,
  ``kv_b_proj -> w_uk + w_uv``) come from ``layout`` only; ``hf_to_params`` is
  ``layout.read_param`` with full bounds (the sliced checkpoint import is the same call
  with a shard's bounds) and ``params_to_hf`` is ``layout.assemble_hf``.
* ``hf_to_params`` checks everything first (missing, unexpected, misshaped, non-float,
  non-finite tensors) and raises one ``ValueError`` listing every problem, so a caller
  that assigns only after it returns never half-loads a layer.
* Finiteness is checked on the values *as the layer will hold them*, i.e. after the cast
  to its parameter dtype: a finite float32 ``1e6`` becomes ``inf`` in float16 and is
  refused. ``count_nonfinite``/``nonfinite_problem`` are the one rule that both
  ``DsaAttention.load_hf_weights`` and ``checkpoint.load_hf_checkpoint`` apply.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from glm5_dsa_jax.model import layout
from glm5_dsa_jax.model.config import DsaConfig

__all__ = ["hf_to_params", "params_to_hf", "arrays_to_hf", "WeightError", "count_nonfinite", "nonfinite_problem",
           "param_variable"]


class WeightError(ValueError):
    """A set of weights does not fit the layer; ``problems`` lists every issue."""

    def __init__(self, where: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"{where}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))


def count_nonfinite(src: np.ndarray, cast: np.ndarray) -> tuple[int, int]:
    """``(non-finite values of cast, how many of them were finite in src)``: ``cast`` is
    ``src`` converted to the parameter dtype; the second count is values out of its range."""
    bad = ~np.isfinite(cast)
    n = int(np.count_nonzero(bad))
    if not n:
        return 0, 0
    with np.errstate(invalid="ignore"):
        over = int(np.count_nonzero(bad & np.isfinite(np.asarray(src, np.float32))))
    return n, over


def nonfinite_problem(name: str, n: int, overflow: int, dtype, how: str = "") -> str | None:
    """The problem line for a tensor with ``n`` non-finite values after the cast to ``dtype``
    (``overflow`` of them finite before it), or ``None`` when ``n == 0``."""
    if not n:
        return None
    dt = np.dtype(dtype).name
    msg = f"tensor {name!r} holds {n} non-finite values ({how}as {dt})"
    if overflow:
        msg += f"; {overflow} of them are finite in the checkpoint but outside the range of {dt}"
    return msg


def cast_to(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype`` (values out of range become inf, without a numpy warning)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(a).astype(np.dtype(dtype))


def _as_numpy(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):  # a torch tensor
        t = t.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            # The tensor's own torch, already imported by whoever made it: torch is not a
            # dependency (it is absent on Python 3.12), so this module never imports it.
            torch = sys.modules["torch"]
            return t.view(dtype=torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(t)


def hf_to_params(
    cfg: DsaConfig, layer_idx: int, weights: Mapping[str, Any], param_dtype=jnp.bfloat16
) -> dict[tuple[str, ...], Any]:
    """HF tensors (names relative to ``self_attn.``) -> ``{param path: array}``."""
    want = layout.hf_weight_shapes(cfg, layer_idx)
    problems: list[str] = []
    arrays: dict[str, np.ndarray] = {}
    for name in sorted(set(weights) - set(want)):
        problems.append(f"unexpected tensor {name!r}")
    for name, shape in want.items():
        if name not in weights:
            problems.append(f"missing tensor {name!r} (expected shape {shape})")
            continue
        a = _as_numpy(weights[name])
        if tuple(a.shape) != shape:
            problems.append(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
            continue
        if not (np.issubdtype(a.dtype, np.floating) or a.dtype.name in ("bfloat16", "float8_e4m3fn")):
            problems.append(f"tensor {name!r} has dtype {a.dtype}, expected a float dtype")
            continue
        a = a.astype(np.float32)
        n, over = count_nonfinite(a, cast_to(a, jnp.dtype(param_dtype)))
        if n:
            problems.append(nonfinite_problem(name, n, over, jnp.dtype(param_dtype)))
            continue
        arrays[name] = a
    if problems:
        raise WeightError(f"weights for DSA layer {layer_idx}", problems)
    return {
        p.path: jnp.asarray(np.ascontiguousarray(
            layout.read_param(cfg, t, p, layout.array_reader(arrays[t.hf_name]))), dtype=param_dtype)
        for t, p in layout.iter_params(layout.layer_tensors(cfg, layer_idx))
    }


def param_variable(module, path: tuple[str, ...]):
    """The ``nnx.Param`` of ``module`` (a ``DsaAttention``) at a layout path
    (``("indexer", "wq_b")``): the one walk from a ``layout.Param.path`` to the variable."""
    for part in path:
        module = getattr(module, part)
    return module


def params_to_hf(layer) -> dict[str, np.ndarray]:
    """The inverse of ``hf_to_params``: a ``DsaAttention``'s parameters as HF tensors
    (float32 numpy, PyTorch layout, names relative to ``self_attn.``)."""
    def value(path):
        return np.asarray(param_variable(layer, path)[...], dtype=np.float32)

    tensors = layout.layer_tensors(layer.cfg, indexer=layer.indexer is not None)
    return arrays_to_hf(layer.cfg, {p.path: value(p.path) for _, p in layout.iter_params(tensors)},
                        indexer=layer.indexer is not None)


def arrays_to_hf(cfg: DsaConfig, params: Mapping[tuple[str, ...], Any], *, indexer: bool = True
                 ) -> dict[str, np.ndarray]:
    """``params_to_hf`` of a ``{param path: array}`` dict (what ``hf_to_params`` or
    ``checkpoint.read_hf_params`` return) of a layer with (``indexer``) or without its own
    indexer: no layer needed, so any model type of ``MODEL_TYPES``."""
    return {
        t.hf_name: np.ascontiguousarray(layout.assemble_hf(cfg, t, {p.path: params[p.path] for p in t.params}))
        for t in layout.layer_tensors(cfg, indexer=indexer)
    }
