"""DSA geometry of one GLM-5.3-Flash model, read from a Hugging Face ``glm5_next`` config.

Invariants:

* A ``DsaConfig`` returned by ``from_hf_config`` or a preset has passed ``validate``:
  ``index_topk`` is a nonzero multiple of ``index_kpool``, every width and head count is
  positive, ``q_lora_rank`` is set, ``qk_rope_head_dim == 0`` and ``indexer_types`` /
  ``layer_types`` have one entry per layer.
* ``from_hf_config`` reads every field with its JSON type and refuses anything else with a
  ``ValueError`` naming the file (or ``config`` for a dict) and the field: integers must be
  JSON integers, booleans JSON ``true``/``false`` (the string ``"false"`` is refused, not
  read: ``bool("false")`` is True), floats finite numbers. Sizes are checked positive before
  any cross-field rule, so ``num_attention_heads: 0`` says "must be positive". A file that
  is not JSON, or not a JSON object, is a ``ValueError`` naming the file.
* Head counts are the *full* model's: this config never holds a per-rank head count (the
  CUDA serving engine whose DSA pipeline and TP plan this project was specified from did;
  that engine is not in this repository). The tensor-parallel split lives in
  ``glm5_dsa_jax.sharding``.

That engine also refused ``index_kpool > 8`` and ``kv_lora_rank != 512``. Those were
limits of its CUDA kernels (a ``float lg[8]`` register array and a compile-time latent
width), not of the model, so they are not rules here: every kernel of this project takes any
``index_kpool >= 1`` and any latent width.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

__all__ = ["DsaConfig"]


@dataclasses.dataclass(frozen=True)
class DsaConfig:
    """Geometry of the DSA layers of one model (full head counts, not per rank)."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1_048_576
    attention_bias: bool = False
    #: ``indexer.k_norm`` is ``nn.LayerNorm(head_dim, eps=1e-6)`` in the reference, fixed.
    index_norm_eps: float = 1e-6

    def __post_init__(self):
        # Lists from JSON become tuples so the config stays hashable (it is a static jit arg).
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))

    # ------------------------------------------------------------------ derived geometry
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one latent cache row: ``kv_lora_rank`` (no RoPE tail on GLM-5.3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def max_select_k(self) -> int:
        """Pools a query may select when the context holds enough of them."""
        return self.index_topk // self.index_kpool

    def select_k(self, n_pools: int) -> int:
        """Pools selected per query: ``min(index_topk // index_kpool, n_pools)``."""
        return min(self.max_select_k, n_pools)

    @property
    def tail_width(self) -> int:
        """Token slots for the incomplete pool: ``index_kpool - 1`` with the tail, else 0."""
        return self.index_kpool - 1 if self.index_kpool_always_select_tail else 0

    @property
    def out_width(self) -> int:
        """Width of one top-k row: ``index_topk`` (+ ``index_kpool - 1`` with the tail)."""
        return self.index_topk + self.tail_width

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        """Indices of the ``indexed_attention`` (DSA) layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "indexed_attention")

    def has_indexer(self, layer_idx: int) -> bool:
        self.check_layer(layer_idx)
        return self.indexer_types[layer_idx] == "full"

    def check_layer(self, layer_idx: int) -> None:
        """Raise ``ValueError`` unless ``layer_idx`` names a DSA layer of this config."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_hidden_layers:
            raise ValueError(
                f"layer_idx {layer_idx!r} is outside the config's {self.num_hidden_layers} layers"
            )
        if self.layer_types[layer_idx] != "indexed_attention":
            raise ValueError(
                f"layer_idx {layer_idx} is a {self.layer_types[layer_idx]!r} layer, not a DSA "
                f"('indexed_attention') layer; DSA layers are {list(self.dsa_layers)}"
            )

    # ------------------------------------------------------------------ validation
    def validate(self) -> "DsaConfig":
        """Check the model's rules; raise ``ValueError`` naming the field and its value."""
        for name in _POSITIVE_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"DsaConfig.{name} must be a positive integer, got {v!r}")
        if self.q_lora_rank is None:
            raise ValueError(
                "DsaConfig.q_lora_rank is None: DSA needs the low-rank query path "
                "(the indexer reads q_resid = q_a_layernorm(q_a_proj(x)))"
            )
        if not isinstance(self.q_lora_rank, int) or isinstance(self.q_lora_rank, bool) or self.q_lora_rank <= 0:
            raise ValueError(f"DsaConfig.q_lora_rank must be a positive integer, got {self.q_lora_rank!r}")
        for name in ("index_kpool_always_select_tail", "attention_bias"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"DsaConfig.{name} must be a bool (true/false), got {v!r}")
        for name in ("rms_norm_eps", "index_norm_eps"):
            v = getattr(self, name)
            if (not isinstance(v, (int, float, np.floating)) or isinstance(v, bool)
                    or not math.isfinite(v) or v <= 0):
                raise ValueError(f"DsaConfig.{name} must be a finite number > 0, got {v!r}")
        if not isinstance(self.qk_rope_head_dim, int) or isinstance(self.qk_rope_head_dim, bool):
            raise ValueError(f"DsaConfig.qk_rope_head_dim must be an integer, got {self.qk_rope_head_dim!r}")
        if self.qk_rope_head_dim != 0:
            raise ValueError(
                f"DsaConfig.qk_rope_head_dim is {self.qk_rope_head_dim}: GLM-5.3 DSA is NoPE and "
                "this project does not implement a RoPE tail yet (qk_rope_head_dim must be 0)"
            )
        if self.index_topk % self.index_kpool:
            raise ValueError(
                f"DsaConfig.index_topk ({self.index_topk}) must be a multiple of index_kpool "
                f"({self.index_kpool}): the pool budget is index_topk // index_kpool"
            )
        if len(self.indexer_types) != len(self.layer_types):
            raise ValueError(
                f"DsaConfig.indexer_types has {len(self.indexer_types)} entries but layer_types "
                f"has {len(self.layer_types)}: one per layer expected"
            )
        for i, t in enumerate(self.layer_types):
            if t not in ("indexed_attention", "linear_attention"):
                raise ValueError(
                    f"DsaConfig.layer_types[{i}] is {t!r}; expected 'indexed_attention' or "
                    "'linear_attention'"
                )
        for i, t in enumerate(self.indexer_types):
            if t not in ("full", "shared"):
                raise ValueError(f"DsaConfig.indexer_types[{i}] is {t!r}; expected 'full' or 'shared'")
        dsa = self.dsa_layers
        if dsa and self.indexer_types[dsa[0]] == "shared":
            raise ValueError(
                f"DsaConfig.indexer_types[{dsa[0]}] is 'shared' but it is the first DSA layer: "
                "a shared layer reuses the top-k of an earlier 'full' layer"
            )
        return self

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "DsaConfig":
        """Read a ``glm5_next`` config: a dict, a ``config.json`` path or its directory.

        The text fields may sit at the top level or under ``text_config``. Defaults are the
        ones ``transformers``' ``Glm5NextTextConfig`` applies, including its derivation of
        ``layer_types`` and ``indexer_types`` when they are absent.
        """
        if isinstance(path_or_dict, Mapping):
            raw, where = dict(path_or_dict), "config"
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no glm5_next config.json at {path!r}")
            where = f"config {path!r}"
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{where} is not valid JSON: {e}") from None
            if not isinstance(raw, Mapping):
                raise ValueError(
                    f"{where} must hold a JSON object (a dict of config fields), got "
                    f"{'null' if raw is None else type(raw).__name__}"
                )
        text = raw.get("text_config") or raw
        if not isinstance(text, Mapping):
            raise ValueError(f"{where}: text_config must be a dict, got {type(text).__name__}")
        d = _HF_DEFAULTS | {k: v for k, v in text.items() if v is not None or k == "q_lora_rank"}
        n_layers = _read_int(d, "num_hidden_layers", where)
        if n_layers <= 0:
            raise ValueError(f"{where}: num_hidden_layers must be a positive integer, got {n_layers}")
        layer_types = _read_str_list(d, "layer_types", where)
        if layer_types is None:
            layer_types = [
                "indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)
            ]
        layer_types = ["indexed_attention" if t == "full_attention" else t for t in layer_types]
        indexer_types = _read_str_list(d, "indexer_types", where)
        if indexer_types is None:
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = _read_pattern(pattern, n_layers, where)
            else:
                freq = max(_read_int(d, "index_topk_freq", where, 1), 1)
                offset = _read_int(d, "index_skip_topk_offset", where, 2)
                indexer_types = [
                    "full" if (max(i - offset + 1, 0) % freq) == 0 else "shared"
                    for i in range(n_layers)
                ]
        if len(layer_types) != n_layers:
            raise ValueError(
                f"{where}: layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}"
            )
        ints = {name: _read_int(d, name, where) for name in _INT_FIELDS}
        q_lora = d["q_lora_rank"]
        if q_lora is not None:
            q_lora = _read_int(d, "q_lora_rank", where)
        for name in _POSITIVE_FIELDS:  # before any cross-field rule, so 0 heads says so
            if ints[name] <= 0:
                raise ValueError(f"{where}: {name} must be a positive integer, got {ints[name]}")
        cfg = cls(
            **ints,
            q_lora_rank=q_lora,
            index_kpool_always_select_tail=_read_bool(d, "index_kpool_always_select_tail", where),
            layer_types=tuple(layer_types),
            indexer_types=tuple(indexer_types),
            rms_norm_eps=_read_float(d, "rms_norm_eps", where),
            attention_bias=_read_bool(d, "attention_bias", where),
        )
        heads_kv = text.get("num_key_value_heads")
        heads_kv = cfg.num_attention_heads if heads_kv is None else _read_int(text, "num_key_value_heads", where)
        if heads_kv != cfg.num_attention_heads:
            raise ValueError(
                f"{where}: num_key_value_heads ({heads_kv}) must equal num_attention_heads "
                f"({cfg.num_attention_heads}): MLA has one latent shared by all heads"
            )
        return cfg.validate()

    def to_hf_dict(self) -> dict[str, Any]:
        """The text-config fields of a ``glm5_next`` config.json for this geometry."""
        return {
            "model_type": "glm5_next_text",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "index_kpool": self.index_kpool,
            "index_kpool_always_select_tail": self.index_kpool_always_select_tail,
            "layer_types": list(self.layer_types),
            "indexer_types": list(self.indexer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
        }

    def replace(self, **changes: Any) -> "DsaConfig":
        """A copy with ``changes`` applied, validated."""
        return dataclasses.replace(self, **changes).validate()

    # ------------------------------------------------------------------ presets
    @classmethod
    def glm53_flash(cls, **overrides: Any) -> "DsaConfig":
        """GLM-5.3-Flash: the ``Glm5NextTextConfig`` defaults with ``index_kpool=4``.

        The HF default is ``index_kpool=16``; the figures of the CUDA serving engine this
        project was specified from (65,536 pools at 262,144 tokens; the engine is not in this
        repository) imply 4, which is what the served checkpoint uses.
        """
        d = dict(_HF_DEFAULTS)
        d["index_kpool"] = 4
        d.update(overrides)
        return cls.from_hf_config(d)

    @classmethod
    def tiny(cls, **overrides: Any) -> "DsaConfig":
        """A small geometry for tests and the CPU demo: 4 layers, two of them DSA
        (a full indexer then a shared one), dims that are not powers of two."""
        d = dict(
            hidden_size=48,
            num_attention_heads=4,
            q_lora_rank=24,
            kv_lora_rank=40,
            qk_nope_head_dim=20,
            qk_rope_head_dim=0,
            v_head_dim=12,
            index_n_heads=3,
            index_head_dim=16,
            index_topk=16,
            index_kpool=4,
            index_kpool_always_select_tail=True,
            num_hidden_layers=4,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"],
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
        )
        d.update(overrides)
        return cls.from_hf_config(d)

    @classmethod
    def preset(cls, name: str) -> "DsaConfig":
        presets = {"glm53-flash": cls.glm53_flash, "tiny": cls.tiny}
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(presets)}")
        return presets[name]()


# The defaults of transformers 5.23.0 ``Glm5NextTextConfig`` for the fields read here.
_HF_DEFAULTS: dict[str, Any] = dict(
    hidden_size=4096,
    num_attention_heads=64,
    num_hidden_layers=45,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    qk_rope_head_dim=0,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_kpool=16,
    index_kpool_always_select_tail=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=1_048_576,
    attention_bias=False,
)


# ------------------------------------------------------------------ reading config.json fields
# HF config.json files are JSON, so every field has a JSON type: a string where a number or
# a boolean belongs is a user error (``bool("false")`` is True), refused here with the field
# named, never coerced.

#: Integer fields of ``DsaConfig`` read from a config (all but ``qk_rope_head_dim`` positive).
_INT_FIELDS = (
    "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "index_kpool",
    "max_position_embeddings",
)
_POSITIVE_FIELDS = tuple(n for n in _INT_FIELDS if n != "qk_rope_head_dim")
#: The letters of ``index_topk_pattern``: one per layer.
_PATTERN_LETTERS = {"F": "full", "S": "shared"}


def _read_int(d: Mapping[str, Any], name: str, where: str, default: Any = None) -> int:
    v = d.get(name, default)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{where}: {name} must be an integer, got {v!r} ({type(v).__name__})")
    return int(v)


def _read_float(d: Mapping[str, Any], name: str, where: str) -> float:
    v = d.get(name)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{where}: {name} must be a number, got {v!r} ({type(v).__name__})")
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: {name} must be a finite number > 0, got {v!r}")
    return v


def _read_bool(d: Mapping[str, Any], name: str, where: str) -> bool:
    v = d.get(name)
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(
            f"{where}: {name} must be a JSON boolean (true or false), got {v!r} "
            f"({type(v).__name__}); a string such as \"false\" is not read as a boolean"
        )
    return bool(v)


def _read_str_list(d: Mapping[str, Any], name: str, where: str) -> list[str] | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not all(
        isinstance(t, str) for t in v
    ):
        raise ValueError(f"{where}: {name} must be a list of strings, got {v!r}")
    return list(v)


def _read_pattern(pattern: Any, n_layers: int, where: str) -> list[str]:
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
