"""Per-device memory of a model's DSA attention on a ``data x cp x tp`` mesh: weights,
caches, how many sequences fit and (with ``cp``) the context that fits. Pure shapes (no
devices, nothing allocated).

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
* **Context parallelism** (``cp > 1``, ``glm5_dsa_jax.parallel.context``): a contiguous
  cache's token-axis fields (``DsaCache.TOKEN_AXIS_FIELDS``: latent rows, their validity
  and fp8 scales, pooled keys and theirs) are split over ``cp``, each device holding
  ``1/cp`` of a sequence's slots and pools; every other field (the incomplete pool's stage
  ``stage_keys`` / ``stage_gate`` / ``stage_valid``, ``first_key``, ``n_valid``,
  ``length``, ``stage_from``) is replicated over ``cp`` (``cache_parts`` reads which is
  which from the field names, so a new field is counted on the right side). The context
  must divide by ``cp * index_kpool`` (whole pools on every device, as
  ``placement.check_seq_split`` requires of a cache). Weights are replicated over ``cp``.
  A ``cp > 1`` plan sizes the contiguous cache only (``kinds``): the paged cache splits its
  page pools over ``cp`` (``parallel.context_paged``), but the plan does not size that yet.
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

from glm5_dsa_jax.cache import DsaCache, init_cache
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.cache import init_paged_cache
from glm5_dsa_jax.parallel.plan import BF16_BYTES, TpPlan

__all__ = ["cache_bytes", "cache_parts", "MemoryPlan", "CACHE_KINDS", "CP_CACHE_KINDS"]

#: Cache kinds ``MemoryPlan`` sizes (the ``init_cache`` / ``init_paged_cache`` caches).
CACHE_KINDS = ("contiguous", "paged")
#: Cache kinds a sequence axis splits (context parallelism's first slice).
CP_CACHE_KINDS = ("contiguous",)


@functools.lru_cache(maxsize=None)
def cache_parts(cfg: DsaConfig, layer_idx: int, dtype: str, seqs: int, context: int) -> tuple[int, int]:
    """``(token_bytes, other_bytes)`` of layer ``layer_idx``'s contiguous cache for ``seqs``
    sequences of ``context`` slots: the fields a sequence axis splits
    (``DsaCache.TOKEN_AXIS_FIELDS``) and the rest (replicated over it), read from the shapes
    of ``init_cache`` (``jax.eval_shape``)."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, seqs, context, has_indexer=cfg.has_indexer(layer_idx),
                                               dtype=dtype))
    token = other = 0
    for path, a in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        n = math.prod(a.shape) * a.dtype.itemsize
        if getattr(path[-1], "name", None) in DsaCache.TOKEN_AXIS_FIELDS:
            token += n
        else:
            other += n
    return token, other


@functools.lru_cache(maxsize=None)
def cache_bytes(cfg: DsaConfig, layer_idx: int, kind: str, dtype: str, seqs: int, context: int,
                page_size: int = 64, cp: int = 1) -> int:
    """Bytes of layer ``layer_idx``'s cache for ``seqs`` sequences of up to ``context``
    tokens (``kind`` in ``CACHE_KINDS``, ``dtype`` a cache dtype: ``"bfloat16"``,
    ``"fp8"``, ...), read from the shapes of a cache made by ``init_cache`` /
    ``init_paged_cache`` (``jax.eval_shape``: nothing is allocated). ``cp``: what one
    device of a sequence axis of that size holds (the contiguous cache only: its token
    fields over ``cp``, the rest whole; ``cache_parts``)."""
    has_indexer = cfg.has_indexer(layer_idx)
    if cp != 1:
        if kind not in CP_CACHE_KINDS:
            raise ValueError(f"the memory plan does not size a {kind} cache under context parallelism yet "
                             f"(cp={cp}): it sizes {CP_CACHE_KINDS} only")
        token, other = cache_parts(cfg, layer_idx, dtype, seqs, context)
        return token // cp + other
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
    """Per-device bytes of every DSA layer of ``cfg`` on a ``dp x cp x tp`` mesh.

    ``batch`` sequences (a multiple of ``dp``) of up to ``context`` tokens (a multiple of
    ``cp * index_kpool`` when ``cp > 1``); ``elem_bytes`` per weight element (bf16: 2)."""

    cfg: DsaConfig
    tp: int = 1
    dp: int = 1
    batch: int = 8
    context: int = 32_768
    elem_bytes: int = BF16_BYTES
    page_size: int = 64
    cp: int = 1

    def __post_init__(self):
        for name in ("tp", "dp", "cp", "batch", "context", "elem_bytes", "page_size"):
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
        if self.context % self.split_unit:
            raise ValueError(
                f"MemoryPlan.context {self.context:,} is not divisible by cp * index_kpool = {self.cp} * "
                f"{self.cfg.index_kpool} = {self.split_unit}: each of the cp={self.cp} devices holds a "
                f"contiguous range of whole pools (e.g. context {self.context // self.split_unit * self.split_unit:,})")

    @property
    def split_unit(self) -> int:
        """The context must be a multiple of this: ``cp * index_kpool`` (1 at ``cp`` 1)."""
        return 1 if self.cp == 1 else self.cp * self.cfg.index_kpool

    @property
    def kinds(self) -> tuple[str, ...]:
        """The cache kinds this plan sizes: ``CACHE_KINDS``, the contiguous one only when
        ``cp > 1`` (a paged cache under ``cp`` is not sized yet)."""
        return CACHE_KINDS if self.cp == 1 else CP_CACHE_KINDS

    @property
    def layers(self) -> tuple[int, ...]:
        return self.cfg.dsa_layers

    @property
    def weight_bytes(self) -> int:
        """Bytes of attention weights on one device (every DSA layer; split over ``tp``)."""
        return sum(TpPlan.build(self.cfg, 0, self.tp, elem_bytes=self.elem_bytes, layer_idx=i).local_bytes
                   for i in self.layers)

    def cache_bytes(self, kind: str = "contiguous", dtype: str = "bfloat16", seqs: int | None = None,
                    context: int | None = None) -> int:
        """Bytes of cache on one device for ``seqs`` sequences per data group (default
        ``batch / dp``) of ``context`` tokens (default the plan's), every DSA layer; with
        ``cp > 1`` one device's ``1/cp`` of their token rows and pools plus the replicated
        rest."""
        seqs = self.batch // self.dp if seqs is None else seqs
        context = self.context if context is None else context
        return sum(cache_bytes(self.cfg, i, kind, dtype, seqs, context, self.page_size, self.cp)
                   for i in self.layers)

    def replicated_cache_bytes(self, dtype: str = "bfloat16", seqs: int | None = None) -> int:
        """Bytes of the contiguous cache every device of the ``cp`` axis holds whole (the
        stage of the incomplete pool, ``first_key``, ``n_valid``, ``length``), every DSA layer."""
        seqs = self.batch // self.dp if seqs is None else seqs
        return sum(cache_parts(self.cfg, i, dtype, seqs, self.context)[1] for i in self.layers)

    def context_that_fits(self, memory_bytes: int, kind: str = "contiguous", dtype: str = "bfloat16") -> int:
        """The longest context (tokens per sequence, a multiple of ``cp * index_kpool``, and
        of ``page_size`` for the paged cache) of which each device holds ``batch / dp``
        sequences' caches (``1/cp`` of their token rows on ``cp`` devices) next to the
        weights in ``memory_bytes``; 0 when not even one unit fits. Not capped at
        ``max_position_embeddings`` (``rows`` caps it and keeps the uncapped figure)."""
        unit = self.cp * self.cfg.index_kpool
        if kind == "paged":
            unit = math.lcm(unit, self.page_size)
        room = memory_bytes - self.weight_bytes
        # Caches grow linearly in whole units: two sizes give the slope and the fixed part
        # (one and two units: a cache past max_position_embeddings cannot be made).
        a, b = self.cache_bytes(kind, dtype, context=unit), self.cache_bytes(kind, dtype, context=2 * unit)
        per_unit = b - a
        fixed = a - per_unit
        if room < fixed + per_unit:
            return 0
        return unit * ((room - fixed) // per_unit)

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
        for kind in self.kinds:
            for dtype in dtypes:
                fits = self.context_that_fits(memory_bytes, kind, dtype)
                out.append(dict(
                    cache=kind, dtype=dtype, cache_bytes_per_device=self.cache_bytes(kind, dtype),
                    bytes_per_token=round(self.bytes_per_token(kind, dtype), 1),
                    sequences_that_fit=self.sequences_that_fit(memory_bytes, kind, dtype),
                    context_that_fits=min(fits, self.cfg.max_position_embeddings),
                    context_that_fits_memory=fits))
        return out
