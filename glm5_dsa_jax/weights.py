"""Hugging Face tensor layout <-> this project's parameter layout, for one DSA layer.

Invariants:

* HF tensors are PyTorch ``[out, in]``; ours are ``[in, out]`` with heads as an axis:
  ``q_b_proj [q_lora, heads, qk_head]``, ``w_uk [heads, qk_nope, kv_lora]``,
  ``w_uv [heads, v_head, kv_lora]``, ``o_proj [heads, v_head, hidden]``.
* ``kv_b_proj`` rows are ``heads`` groups of ``qk_nope + v_head`` rows: the first
  ``qk_nope`` of each group are ``W_UK``, the rest ``W_UV``. The split happens here, once.
* ``hf_to_params`` checks everything first (missing, unexpected, misshaped, non-float,
  non-finite tensors) and raises one ``ValueError`` listing every problem, so a caller
  that assigns only after it returns never half-loads a layer.
* Finiteness is checked on the values *as the layer will hold them*, i.e. after the cast
  to its parameter dtype: a finite float32 ``1e6`` becomes ``inf`` in float16 and is
  refused. ``count_nonfinite``/``nonfinite_problem`` are the one rule that both
  ``DsaAttention.load_hf_weights`` and ``checkpoint.load_hf_checkpoint`` apply.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from glm5_dsa_jax.config import DsaConfig

__all__ = ["hf_to_params", "params_to_hf", "WeightError", "count_nonfinite", "nonfinite_problem"]


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
            import ml_dtypes

            return t.view(dtype=__import__("torch").int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(t)


def hf_to_params(
    cfg: DsaConfig, layer_idx: int, weights: Mapping[str, Any], param_dtype=jnp.bfloat16
) -> dict[tuple[str, ...], Any]:
    """HF tensors (names relative to ``self_attn.``) -> ``{param path: array}``."""
    from glm5_dsa_jax.layer import hf_weight_shapes

    want = hf_weight_shapes(cfg, layer_idx)
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

    nh, r = cfg.num_attention_heads, cfg.kv_lora_rank
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    kvb = arrays["kv_b_proj.weight"].reshape(nh, nope + v, r)
    out: dict[tuple[str, ...], np.ndarray] = {
        ("q_a_proj",): arrays["q_a_proj.weight"].T,
        ("q_a_layernorm",): arrays["q_a_layernorm.weight"],
        ("q_b_proj",): arrays["q_b_proj.weight"].reshape(nh, cfg.qk_head_dim, -1).transpose(2, 0, 1),
        ("kv_a_proj_with_mqa",): arrays["kv_a_proj_with_mqa.weight"].T,
        ("kv_a_layernorm",): arrays["kv_a_layernorm.weight"],
        ("w_uk",): kvb[:, :nope],
        ("w_uv",): kvb[:, nope:],
        ("o_proj",): arrays["o_proj.weight"].T.reshape(nh, v, cfg.hidden_size),
    }
    if cfg.attention_bias:
        out[("q_a_proj_bias",)] = arrays["q_a_proj.bias"]
        out[("kv_a_proj_bias",)] = arrays["kv_a_proj_with_mqa.bias"]
        out[("o_proj_bias",)] = arrays["o_proj.bias"]
    if cfg.has_indexer(layer_idx):
        hi, d = cfg.index_n_heads, cfg.index_head_dim
        out |= {
            ("indexer", "wq_b"): arrays["indexer.wq_b.weight"].reshape(hi, d, -1).transpose(2, 0, 1),
            ("indexer", "wk"): arrays["indexer.wk.weight"].T,
            ("indexer", "k_norm_scale"): arrays["indexer.k_norm.weight"],
            ("indexer", "k_norm_bias"): arrays["indexer.k_norm.bias"],
            ("indexer", "weights_proj"): arrays["indexer.weights_proj.weight"].T,
            ("indexer", "kpool_gate"): arrays["indexer.index_kpool_compress_gate"].T,
            ("indexer", "kpool_ape"): arrays["indexer.index_kpool_compress_ape"],
        }
    return {k: jnp.asarray(np.ascontiguousarray(a), dtype=param_dtype) for k, a in out.items()}


def params_to_hf(layer) -> dict[str, np.ndarray]:
    """The inverse of ``hf_to_params``: a ``DsaAttention``'s parameters as HF tensors
    (float32 numpy, PyTorch layout, names relative to ``self_attn.``)."""
    cfg = layer.cfg

    def g(*path):
        obj = layer
        for p in path:
            obj = getattr(obj, p)
        return np.asarray(obj[...], dtype=np.float32)

    nh = cfg.num_attention_heads
    out = {
        "q_a_proj.weight": g("q_a_proj").T,
        "q_a_layernorm.weight": g("q_a_layernorm"),
        "q_b_proj.weight": g("q_b_proj").transpose(1, 2, 0).reshape(nh * cfg.qk_head_dim, -1),
        "kv_a_proj_with_mqa.weight": g("kv_a_proj_with_mqa").T,
        "kv_a_layernorm.weight": g("kv_a_layernorm"),
        "kv_b_proj.weight": np.concatenate([g("w_uk"), g("w_uv")], axis=1).reshape(-1, cfg.kv_lora_rank),
        "o_proj.weight": g("o_proj").reshape(nh * cfg.v_head_dim, cfg.hidden_size).T,
    }
    if cfg.attention_bias:
        out["q_a_proj.bias"] = g("q_a_proj_bias")
        out["kv_a_proj_with_mqa.bias"] = g("kv_a_proj_bias")
        out["o_proj.bias"] = g("o_proj_bias")
    if layer.indexer is not None:
        hi, d = cfg.index_n_heads, cfg.index_head_dim
        out |= {
            "indexer.wq_b.weight": g("indexer", "wq_b").transpose(1, 2, 0).reshape(hi * d, -1),
            "indexer.wk.weight": g("indexer", "wk").T,
            "indexer.k_norm.weight": g("indexer", "k_norm_scale"),
            "indexer.k_norm.bias": g("indexer", "k_norm_bias"),
            "indexer.weights_proj.weight": g("indexer", "weights_proj").T,
            "indexer.index_kpool_compress_gate": g("indexer", "kpool_gate").T,
            "indexer.index_kpool_compress_ape": g("indexer", "kpool_ape"),
        }
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
