"""Per-device memory of a model's DSA attention on a ``data x tp`` mesh: weights, caches,
and how many sequences fit. Pure shapes (no devices, nothing allocated).

Invariants:

* **Cache bytes come from the caches themselves.** ``cache_bytes`` is the byte total of
  ``jax.eval_shape`` of ``init_cache`` / ``init_paged_cache``: every field (latent rows,
  pooled keys, their fp8 scales, validity, stage, block tables, free stack) is counted
  exactly as a real cache holds it, and a field added to a cache is counted without a
  change here. No byte formula is written twice.
* **Weights come from the TP plan** (``TpPlan.local_bytes`` of each DSA layer: a
  ``"shared"`` indexer layer has no indexer tensors). Weights are split over ``tp`` and
  replicated over ``data``.
* **Caches are split over ``data`` by sequence and replicated over ``tp``**
  (``glm5_dsa_jax.parallel.sharding``): MLA's single latent head has no head axis to split, so a
  device of a ``tp`` group holds its group's whole cache; each ``data`` group holds the
  caches of ``batch / dp`` sequences. That is why data parallelism, not TP, is what
  multiplies the sequences a mesh can hold.
* What "fits" counts: this model's DSA attention weights (every DSA layer) and their
  caches, nothing else (no MoE / MLP weights, embeddings or activations): an upper bound on
  the sequences, for the part of device memory given to attention.
* A paged cache is sized for its sequences at full length (``ceil(context / page_size)``
  pages each); pages shared between shorter sequences make a paged cache hold more.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from glm5_dsa_jax.cache import init_cache
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.cache import init_paged_cache
from glm5_dsa_jax.parallel.plan import BF16_BYTES, TpPlan

__all__ = ["cache_bytes", "MemoryPlan", "CACHE_KINDS"]

#: Cache kinds ``MemoryPlan`` sizes (the ``init_cache`` / ``init_paged_cache`` caches).
CACHE_KINDS = ("contiguous", "paged")


@functools.lru_cache(maxsize=None)
def cache_bytes(cfg: DsaConfig, layer_idx: int, kind: str, dtype: str, seqs: int, context: int,
                page_size: int = 64) -> int:
    """Bytes of layer ``layer_idx``'s cache for ``seqs`` sequences of up to ``context``
    tokens (``kind`` in ``CACHE_KINDS``, ``dtype`` a cache dtype: ``"bfloat16"``,
    ``"fp8"``, ...), read from the shapes of a cache made by ``init_cache`` /
    ``init_paged_cache`` (``jax.eval_shape``: nothing is allocated)."""
    has_indexer = cfg.has_indexer(layer_idx)
    if kind == "contiguous":
        make = lambda: init_cache(cfg, seqs, context, has_indexer=has_indexer, dtype=dtype)
    elif kind == "paged":
        pages = math.ceil(context / page_size)
        make = lambda: init_paged_cache(cfg, seqs, seqs * pages, page_size, pages_per_seq=pages,
                                        has_indexer=has_indexer, dtype=dtype)
    else:
        raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {kind!r}")
    shapes = jax.eval_shape(make)
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(shapes))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of every DSA layer of ``cfg`` on a ``dp x tp`` mesh.

    ``batch`` sequences (a multiple of ``dp``) of up to ``context`` tokens; ``elem_bytes``
    per weight element (bf16: 2)."""

    cfg: DsaConfig
    tp: int = 1
    dp: int = 1
    batch: int = 8
    context: int = 32_768
    elem_bytes: int = BF16_BYTES
    page_size: int = 64

    def __post_init__(self):
        for name in ("tp", "dp", "batch", "context", "elem_bytes", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MemoryPlan.{name} must be an int >= 1, got {v!r}")
        if self.batch % self.dp:
            raise ValueError(
                f"MemoryPlan.batch {self.batch} is not divisible by dp={self.dp}: each data "
                "group holds batch / dp sequences")
        if self.context > self.cfg.max_position_embeddings:
            raise ValueError(f"MemoryPlan.context {self.context} exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        TpPlan.build(self.cfg, 0, self.tp)  # raises for a TP size that does not divide the heads

    @property
    def layers(self) -> tuple[int, ...]:
        return self.cfg.dsa_layers

    @property
    def weight_bytes(self) -> int:
        """Bytes of attention weights on one device (every DSA layer; split over ``tp``)."""
        return sum(TpPlan.build(self.cfg, 0, self.tp, elem_bytes=self.elem_bytes, layer_idx=i).local_bytes
                   for i in self.layers)

    def cache_bytes(self, kind: str = "contiguous", dtype: str = "bfloat16", seqs: int | None = None) -> int:
        """Bytes of cache on one device for ``seqs`` sequences per data group (default
        ``batch / dp``), every DSA layer."""
        seqs = self.batch // self.dp if seqs is None else seqs
        return sum(cache_bytes(self.cfg, i, kind, dtype, seqs, self.context, self.page_size)
                   for i in self.layers)

    def bytes_per_token(self, kind: str = "contiguous", dtype: str = "bfloat16") -> float:
        """Cache bytes per token of capacity of one layer with an indexer (its own), per
        sequence: the figure the cache docs quote."""
        i = next(j for j in self.layers if self.cfg.has_indexer(j))
        one = cache_bytes(self.cfg, i, kind, dtype, 8, self.context, self.page_size)
        return one / (8 * self.context)

    def sequences_that_fit(self, memory_bytes: int, kind: str = "contiguous", dtype: str = "bfloat16") -> int:
        """Most sequences of ``context`` tokens the whole mesh holds when each device gives
        ``memory_bytes`` to attention weights and caches: ``dp`` times what one device's
        share holds (0 when the weights alone do not fit)."""
        room = memory_bytes - self.weight_bytes
        one, two = self.cache_bytes(kind, dtype, 1), self.cache_bytes(kind, dtype, 2)
        per_seq, fixed = two - one, 2 * one - two  # caches grow linearly in sequences
        if room < fixed + per_seq:
            return 0
        return self.dp * ((room - fixed) // per_seq)

    def rows(self, memory_bytes: int, dtypes=("bfloat16", "fp8")) -> list[dict]:
        """One row per (cache kind, dtype): per-device cache bytes at ``batch`` x ``context``,
        bytes per token and the sequences that fit in ``memory_bytes`` per device."""
        out = []
        for kind in CACHE_KINDS:
            for dtype in dtypes:
                out.append(dict(
                    cache=kind, dtype=dtype, cache_bytes_per_device=self.cache_bytes(kind, dtype),
                    bytes_per_token=round(self.bytes_per_token(kind, dtype), 1),
                    sequences_that_fit=self.sequences_that_fit(memory_bytes, kind, dtype)))
        return out
