"""DSA geometry of one GLM-5.3-Flash model, read from a Hugging Face ``glm5_next`` config.

Invariants:

* A ``DsaConfig`` returned by ``from_hf_config`` or a preset has passed ``validate``:
  ``index_topk`` is a nonzero multiple of ``index_kpool``, every width and head count is
  positive, ``q_lora_rank`` is set, ``qk_rope_head_dim == 0`` and ``indexer_types`` /
  ``layer_types`` have one entry per layer.
* Head counts are the *full* model's: this config never holds a per-rank head count (the
  CUDA seed did). The tensor-parallel split lives in ``glm5_dsa_jax.sharding``.

The seed engine also refused ``index_kpool > 8`` and ``kv_lora_rank != 512``. Those were
limits of its CUDA kernels (a ``float lg[8]`` register array and a compile-time latent
width), not of the model, so they are not rules here: every kernel of this project takes any
``index_kpool >= 1`` and any latent width.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

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
        positive = (
            "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "v_head_dim", "index_n_heads", "index_head_dim", "index_kpool", "index_topk",
        )
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"DsaConfig.{name} must be a positive integer, got {v!r}")
        if self.q_lora_rank is None:
            raise ValueError(
                "DsaConfig.q_lora_rank is None: DSA needs the low-rank query path "
                "(the indexer reads q_resid = q_a_layernorm(q_a_proj(x)))"
            )
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0:
            raise ValueError(f"DsaConfig.q_lora_rank must be a positive integer, got {self.q_lora_rank!r}")
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
        if not self.rms_norm_eps > 0:
            raise ValueError(f"DsaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
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
            raw = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no glm5_next config.json at {path!r}")
            with open(path) as f:
                raw = json.load(f)
        text = raw.get("text_config") or raw
        if not isinstance(text, Mapping):
            raise ValueError(f"config text_config must be a dict, got {type(text).__name__}")
        d = _HF_DEFAULTS | {k: v for k, v in text.items() if v is not None or k == "q_lora_rank"}
        n_layers = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is None:
            layer_types = [
                "indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)
            ]
        layer_types = ["indexed_attention" if t == "full_attention" else t for t in layer_types]
        indexer_types = d.get("indexer_types")
        if indexer_types is None:
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = (
                    [{"F": "full", "S": "shared"}[c] for c in pattern]
                    if isinstance(pattern, str) else list(pattern)
                )
            else:
                freq = max(int(d.get("index_topk_freq", 1)), 1)
                offset = int(d.get("index_skip_topk_offset", 2))
                indexer_types = [
                    "full" if (max(i - offset + 1, 0) % freq) == 0 else "shared"
                    for i in range(n_layers)
                ]
        if len(layer_types) != n_layers:
            raise ValueError(
                f"config layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}"
            )
        cfg = cls(
            hidden_size=d["hidden_size"],
            num_attention_heads=d["num_attention_heads"],
            q_lora_rank=d["q_lora_rank"],
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            index_n_heads=d["index_n_heads"],
            index_head_dim=d["index_head_dim"],
            index_topk=d["index_topk"],
            index_kpool=d["index_kpool"],
            index_kpool_always_select_tail=bool(d["index_kpool_always_select_tail"]),
            layer_types=tuple(layer_types),
            indexer_types=tuple(indexer_types),
            rms_norm_eps=float(d["rms_norm_eps"]),
            max_position_embeddings=int(d["max_position_embeddings"]),
            attention_bias=bool(d["attention_bias"]),
        )
        heads_kv = text.get("num_key_value_heads") or cfg.num_attention_heads
        if heads_kv != cfg.num_attention_heads:
            raise ValueError(
                f"config num_key_value_heads ({heads_kv}) must equal num_attention_heads "
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

        The HF default is ``index_kpool=16``; the seed's figures (65,536 pools at 262,144
        tokens) imply 4, which is what the served checkpoint uses.
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
