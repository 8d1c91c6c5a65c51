"""Reading a Hugging Face ``config.json``: typed field readers, the three model types' HF
defaults and their ``rope_parameters``, for ``DsaConfig.from_hf_config``.

Why apart from ``config``: ``config`` says what a geometry *is* (its fields and rules);
this module says how transformers 5.23.0 *spells and defaults* it in each model type's
config class (``Glm5NextTextConfig``, ``GlmMoeDsaConfig``, ``DeepseekV32Config``).

Invariants:

* HF config.json files are JSON, so every field has a JSON type: a string where a number or
  a boolean belongs is a user error (``bool("false")`` is True), refused with a
  ``ValueError`` naming the file and the field, never coerced.
* ``HF_DEFAULTS[model_type]`` holds the defaults of that model type's config class for the
  fields ``DsaConfig`` reads, so a field absent from a file means what it means to HF.
  ``glm_moe_dsa`` and ``deepseek_v32`` have no k-pool compression: their tables fix
  ``index_kpool`` 1 without tail (each token is its own pool), and they are not read.
* ``read_rope`` resolves ``rope_parameters`` (or the legacy ``rope_scaling`` /
  ``rope_theta``) exactly as ``modeling_rope_utils`` standardises them: ``type`` is read as
  ``rope_type``, a YaRN ``factor`` of null is ``max_position_embeddings /
  original_max_position_embeddings``, a top-level ``original_max_position_embeddings`` wins
  over the one in the dict, ``beta_fast`` / ``beta_slow`` fall back to 32 / 1 when absent
  or 0 (HF's ``or``), ``truncate`` defaults to true. Only ``"default"`` and ``"yarn"`` are
  implemented; any other type, or a per-layer-type nested dict, is refused naming the field.

This module imports only numpy: ``config`` imports it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

__all__ = ["HF_DEFAULTS", "HF_TYPE_NAMES", "MODEL_TYPES", "ModelRules", "PRESET_CONFIGS", "ROPE_TYPES", "read_int", "read_float", "read_bool", "read_str_list",
           "read_pattern", "read_rope"]

#: RoPE scaling types this project implements (``rope_parameters["rope_type"]``).
ROPE_TYPES = ("default", "yarn")

_COMMON = dict(
    num_attention_heads=64, kv_lora_rank=512, index_head_dim=128, index_topk=2048,
    attention_bias=False,
)
#: transformers 5.23.0 config-class defaults per model type, for the fields read here.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm5_next": _COMMON | dict(  # Glm5NextTextConfig
        hidden_size=4096, num_hidden_layers=45, q_lora_rank=1536, qk_nope_head_dim=256,
        qk_rope_head_dim=0, v_head_dim=256, index_n_heads=32, index_kpool=16,
        index_kpool_always_select_tail=True, rms_norm_eps=1e-5, max_position_embeddings=1_048_576,
    ),
    "glm_moe_dsa": _COMMON | dict(  # GlmMoeDsaConfig (its docs name zai-org/GLM-5)
        hidden_size=6144, num_hidden_layers=78, q_lora_rank=2048, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_kpool=1,
        index_kpool_always_select_tail=False, rms_norm_eps=1e-5, max_position_embeddings=202_752,
    ),
    "deepseek_v32": _COMMON | dict(  # DeepseekV32Config (deepseek-ai/DeepSeek-V3.2-Exp)
        hidden_size=7168, num_attention_heads=128, num_hidden_layers=61, q_lora_rank=1536,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
        index_kpool=1, index_kpool_always_select_tail=False, rms_norm_eps=1e-6,
        max_position_embeddings=163_840,
    ),
}

@dataclasses.dataclass(frozen=True)
class ModelRules:
    """What one HF model type's DSA attention is (read from its transformers 5.23.0 classes)."""

    #: the ``model_type`` of its text config in config.json
    hf_text_model_type: str
    #: k-pool compression: the indexer pools ``index_kpool`` keys through a softmax gate
    #: (``index_kpool_compress_gate`` / ``_ape`` tensors); without it each token is a pool
    kpool_compression: bool
    #: ``indexer_types`` may hold ``"shared"`` layers (reuse of an earlier layer's top-k)
    shared_layers: bool
    #: layout of the indexer's RoPE on its first ``qk_rope_head_dim`` channels: ``"interleaved"``
    #: (pairs ``(x0, x1), (x2, x3)``) or ``"half"`` (``rotate_half``); None for a NoPE model
    indexer_rope_style: str | None
    #: eps of ``q_a_layernorm`` / ``kv_a_layernorm``: None = ``rms_norm_eps``; the DeepSeek-
    #: derived classes build them as ``RMSNorm(dim)`` with its default eps 1e-6
    latent_norm_eps: float | None


#: The model types this project reads. Main MLA RoPE is interleaved in both RoPE models.
MODEL_TYPES: dict[str, ModelRules] = {
    "glm5_next": ModelRules("glm5_next_text", True, True, None, None),
    "glm_moe_dsa": ModelRules("glm_moe_dsa", False, True, "interleaved", 1e-6),
    "deepseek_v32": ModelRules("deepseek_v32", False, False, "half", 1e-6),
}
#: config.json ``model_type`` values -> ours (the glm5_next text config has its own name).
HF_TYPE_NAMES = {"glm5_next": "glm5_next", "glm5_next_text": "glm5_next",
                  "glm_moe_dsa": "glm_moe_dsa", "deepseek_v32": "deepseek_v32"}


#: The published models' text configs, as config.json dicts (``DsaConfig.preset(name)``).
#:
#: * ``glm5``: GLM-5 / GLM-5.1 (``zai-org/GLM-5``): the ``GlmMoeDsaConfig`` defaults, whose
#:   docs name that checkpoint (NVIDIA's NeMo model pages and the GLM-5 report's table agree:
#:   hidden 6144, 64 heads, q_lora 2048, kv_lora 512, qk 192 + 64, v 256, indexer 32 x 128,
#:   78 layers, 202,752 positions); every layer has its own indexer; ``rope_theta`` 1,000,000
#:   with default RoPE, the value NVIDIA Megatron-Bridge's GLM-5 bridge test configures (HF's
#:   classes carry no GLM-5 theta).
#: * ``glm52``: GLM-5.2: GLM-5's dims, ``index_topk_freq`` 4 / ``index_skip_topk_offset`` 3
#:   (layers 0, 1, 2, 6, 10, ..., 74 full: 21 full, 57 shared), 1,048,576 positions,
#:   ``{"rope_theta": 8000000, "rope_type": "default"}``: its config.json as public serving
#:   projects transcribe it (their 78-entry ``indexer_types`` list exactly these 21 full).
#: * ``deepseek-v32``: DeepSeek-V3.2 (``deepseek-ai/DeepSeek-V3.2-Exp``): the
#:   ``DeepseekV32Config`` defaults, whose docs name that checkpoint (hidden 7168, 128 heads,
#:   q_lora 1536, qk 128 + 64, v 128, indexer 64 x 128, 61 layers, 163,840 positions, eps
#:   1e-6), and its config.json's (DeepSeek-V3's) YaRN ``rope_scaling``: theta 10000, factor
#:   40 (= 163840 / 4096), original 4096 positions, beta 32 / 1, mscale 1, mscale_all_dim 1.
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "glm5": dict(HF_DEFAULTS["glm_moe_dsa"], model_type="glm_moe_dsa",
                 rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    "glm52": dict(HF_DEFAULTS["glm_moe_dsa"], model_type="glm_moe_dsa", index_topk_freq=4,
                  index_skip_topk_offset=3, max_position_embeddings=1_048_576,
                  rope_parameters={"rope_type": "default", "rope_theta": 8_000_000.0}),
    "deepseek-v32": dict(HF_DEFAULTS["deepseek_v32"], model_type="deepseek_v32", rope_theta=10_000.0,
                         rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


#: The letters of ``index_topk_pattern``: one per layer.
_PATTERN_LETTERS = {"F": "full", "S": "shared"}


def read_int(d: Mapping[str, Any], name: str, where: str, default: Any = None) -> int:
    v = d.get(name, default)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{where}: {name} must be an integer, got {v!r} ({type(v).__name__})")
    return int(v)


def read_float(d: Mapping[str, Any], name: str, where: str, default: Any = None,
               positive: bool = True) -> float:
    v = d.get(name, default)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{where}: {name} must be a number, got {v!r} ({type(v).__name__})")
    v = float(v)
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{where}: {name} must be a finite number{' > 0' if positive else ''}, got {v!r}")
    return v


def read_bool(d: Mapping[str, Any], name: str, where: str, default: Any = None) -> bool:
    v = d.get(name, default)
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(
            f"{where}: {name} must be a JSON boolean (true or false), got {v!r} "
            f"({type(v).__name__}); a string such as \"false\" is not read as a boolean"
        )
    return bool(v)


def read_str_list(d: Mapping[str, Any], name: str, where: str) -> list[str] | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not all(
        isinstance(t, str) for t in v
    ):
        raise ValueError(f"{where}: {name} must be a list of strings, got {v!r}")
    return list(v)


def read_pattern(pattern: Any, n_layers: int, where: str) -> list[str]:
    """``index_topk_pattern``: a string of one letter per layer (``F`` full, ``S`` shared)
    or a list of ``"full"`` / ``"shared"``."""
    if isinstance(pattern, str):
        bad = sorted({c for c in pattern if c not in _PATTERN_LETTERS})
        if bad:
            raise ValueError(
                f"{where}: index_topk_pattern {pattern!r} has unknown letters {bad}; allowed "
                f"letters are {sorted(_PATTERN_LETTERS)} (F = full indexer, S = shared)"
            )
        types = [_PATTERN_LETTERS[c] for c in pattern]
    elif isinstance(pattern, (list, tuple)):
        types = list(pattern)
        bad = [t for t in types if t not in ("full", "shared")]
        if bad:
            raise ValueError(
                f"{where}: index_topk_pattern entries must be 'full' or 'shared', got {bad[:3]}"
            )
    else:
        raise ValueError(
            f"{where}: index_topk_pattern must be a string of F/S letters or a list, got {pattern!r}"
        )
    if len(types) != n_layers:
        raise ValueError(
            f"{where}: index_topk_pattern has {len(types)} entries, num_hidden_layers is {n_layers}"
        )
    return types


def read_rope(d: Mapping[str, Any], max_pos: int, where: str) -> dict[str, Any]:
    """The ``DsaConfig`` RoPE fields (``rope_theta``, ``rope_type``, ``rope_factor``, ...)
    of the text config ``d``, resolved as transformers does (see the module doc)."""
    rp = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rp, Mapping):
        raise ValueError(f"{where}: rope_parameters must be a dict, got {rp!r}")
    nested = [k for k, v in rp.items() if isinstance(v, Mapping)]
    if nested:
        raise ValueError(
            f"{where}: rope_parameters is nested per layer type ({nested}); one flat dict is "
            f"supported, with rope_type one of {list(ROPE_TYPES)}"
        )
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{where}: rope_parameters.rope_type is {rope_type!r}; supported: {list(ROPE_TYPES)}"
        )
    prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if prf is not None and prf != 1:
        raise ValueError(f"{where}: partial_rotary_factor is {prf!r}; only 1 (all of qk_rope_head_dim) is supported")
    theta_src = rp if "rope_theta" in rp else d
    out: dict[str, Any] = {
        "rope_theta": read_float(theta_src, "rope_theta", where, 10_000.0),
        "rope_type": rope_type,
    }
    if rope_type == "yarn":
        rd = dict(rp)
        if d.get("original_max_position_embeddings") is not None:
            rd["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        orig = read_int(rd, "original_max_position_embeddings", f"{where}: rope_parameters", max_pos)
        if orig <= 0:
            raise ValueError(f"{where}: rope_parameters.original_max_position_embeddings must be > 0, got {orig}")
        factor = rd.get("factor")
        factor = max_pos / orig if factor is None else read_float(rd, "factor", f"{where}: rope_parameters")
        opt = lambda k: None if rd.get(k) is None else read_float(rd, k, f"{where}: rope_parameters", positive=False)
        out.update(
            rope_factor=float(factor),
            rope_original_max_position_embeddings=orig,
            rope_beta_fast=opt("beta_fast") or 32.0,
            rope_beta_slow=opt("beta_slow") or 1.0,
            rope_mscale=opt("mscale"),
            rope_mscale_all_dim=opt("mscale_all_dim"),
            rope_attention_factor=opt("attention_factor"),
            rope_truncate=read_bool(rd, "truncate", f"{where}: rope_parameters", True),
        )
    return out
