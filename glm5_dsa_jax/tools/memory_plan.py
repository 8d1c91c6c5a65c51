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
  A paged cache's page pools (``PagedCache.PAGE_AXIS_FIELDS``: the latent pages, the
  pooled-key pages and their fp8 scales) are split over ``cp`` on their page axis, each
  device holding ``N / cp`` of a data group's ``N`` pages (``parallel.context_paged``);
  its page table (block tables, lengths, free stack, owner, refs), the stage and the
  status are replicated (``paged_parts`` reads which is which from the field names). ``N``
  (``seqs * ceil(context / page_size)``) must divide by ``cp`` (``ValueError`` naming the
  sizes, as ``placement.check_page_split`` requires of a placed cache); the paged context
  that fits is counted in units of ``cp * page_size`` (every sequence's pages a multiple of
  ``cp``) and the paged sequences that fit in steps of ``cp / gcd(pages, cp)`` sequences.
  The sizing is of the pools' split, not of where one sequence's pages land: the free
  stack's round-robin spreads them evenly only on a fresh table (``context_paged``).
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
from glm5_dsa_jax.cache import PagedCache, init_paged_cache
from glm5_dsa_jax.parallel.plan import BF16_BYTES, TpPlan

__all__ = ["cache_bytes", "cache_parts", "paged_parts", "check_cp_pages", "MemoryPlan", "CACHE_KINDS",
           "CP_CACHE_KINDS"]

#: Cache kinds ``MemoryPlan`` sizes (the ``init_cache`` / ``init_paged_cache`` caches).
CACHE_KINDS = ("contiguous", "paged")
#: Cache kinds a sequence axis splits (both: token ranges, or page pools).
CP_CACHE_KINDS = ("contiguous", "paged")


@functools.lru_cache(maxsize=None)
def cache_parts(cfg: DsaConfig, layer_idx: int, dtype: str, seqs: int, context: int) -> tuple[int, int]:
    """``(token_bytes, other_bytes)`` of layer ``layer_idx``'s contiguous cache for ``seqs``
    sequences of ``context`` slots: the fields a sequence axis splits
    (``DsaCache.TOKEN_AXIS_FIELDS``) and the rest (replicated over it), read from the shapes
    of ``init_cache`` (``jax.eval_shape``)."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, seqs, context, has_indexer=cfg.has_indexer(layer_idx),
                                               dtype=dtype))
    return _split_bytes(shapes, DsaCache.TOKEN_AXIS_FIELDS)


def _split_bytes(shapes, fields) -> tuple[int, int]:
    """``(bytes of the named fields, bytes of the rest)`` of a cache's shapes."""
    split = other = 0
    for path, a in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        n = math.prod(a.shape) * a.dtype.itemsize
        if getattr(path[-1], "name", None) in fields:
            split += n
        else:
            other += n
    return split, other


def _paged_shapes(cfg: DsaConfig, layer_idx: int, dtype: str, seqs: int, context: int, page_size: int):
    pages = math.ceil(context / page_size)
    return jax.eval_shape(lambda: init_paged_cache(cfg, seqs, seqs * pages, page_size, pages_per_seq=pages,
                                                   has_indexer=cfg.has_indexer(layer_idx), dtype=dtype))


def check_cp_pages(seqs: int, context: int, page_size: int, cp: int) -> None:
    """``ValueError`` unless the ``seqs * ceil(context / page_size)`` pages of a paged cache
    for ``seqs`` sequences of ``context`` tokens split into ``cp`` blocks of whole pages."""
    pages = math.ceil(context / page_size)
    if (seqs * pages) % cp:
        raise ValueError(
            f"a paged cache of {seqs:,} sequences x {pages:,} pages (ceil(context {context:,} / page_size "
            f"{page_size})) = {seqs * pages:,} pages is not divisible by cp={cp}: each of the {cp} devices "
            f"holds a block of whole pages")


@functools.lru_cache(maxsize=None)
def paged_parts(cfg: DsaConfig, layer_idx: int, dtype: str, seqs: int, context: int,
                page_size: int = 64) -> tuple[int, int]:
    """``(pool_bytes, other_bytes)`` of layer ``layer_idx``'s paged cache for ``seqs``
    sequences of up to ``context`` tokens (``ceil(context / page_size)`` pages each, as
    ``cache_bytes`` sizes it): the page pools a sequence axis splits
    (``PagedCache.PAGE_AXIS_FIELDS``) and the rest (the page table, stage, status:
    replicated over it), read from the shapes of ``init_paged_cache``."""
    return _split_bytes(_paged_shapes(cfg, layer_idx, dtype, seqs, context, page_size), PagedCache.PAGE_AXIS_FIELDS)


@functools.lru_cache(maxsize=None)
def cache_bytes(cfg: DsaConfig, layer_idx: int, kind: str, dtype: str, seqs: int, context: int,
                page_size: int = 64, cp: int = 1) -> int:
    """Bytes of layer ``layer_idx``'s cache for ``seqs`` sequences of up to ``context``
    tokens (``kind`` in ``CACHE_KINDS``, ``dtype`` a cache dtype: ``"bfloat16"``,
    ``"fp8"``, ...), read from the shapes of a cache made by ``init_cache`` /
    ``init_paged_cache`` (``jax.eval_shape``: nothing is allocated). ``cp``: what one
    device of a sequence axis of that size holds: a contiguous cache's token fields over
    ``cp`` and the rest whole (``cache_parts``), a paged cache's page pools over ``cp`` and
    the rest whole (``paged_parts``; ``ValueError`` unless its pages divide by ``cp``)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {kind!r}")
    if kind == "paged":
        if cp != 1:
            check_cp_pages(seqs, context, page_size, cp)
        pools, other = paged_parts(cfg, layer_idx, dtype, seqs, context, page_size)
        return pools // cp + other
    token, other = cache_parts(cfg, layer_idx, dtype, seqs, context)
    return token // cp + other


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
        """The cache kinds this plan sizes: ``CACHE_KINDS`` (both also under ``cp``)."""
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
        ``cp > 1`` one device's ``1/cp`` of their token rows and pools (a paged cache: of its
        page pools) plus the replicated rest."""
        seqs = self.batch // self.dp if seqs is None else seqs
        context = self.context if context is None else context
        return sum(cache_bytes(self.cfg, i, kind, dtype, seqs, context, self.page_size, self.cp)
                   for i in self.layers)

    def replicated_cache_bytes(self, dtype: str = "bfloat16", seqs: int | None = None,
                               kind: str = "contiguous") -> int:
        """Bytes of the cache every device of the ``cp`` axis holds whole, every DSA layer:
        a contiguous cache's stage of the incomplete pool, ``first_key``, ``n_valid``,
        ``length``; a paged cache's page table (block tables, lengths, free stack, owner,
        refs), stage and status."""
        seqs = self.batch // self.dp if seqs is None else seqs
        parts = paged_parts if kind == "paged" else cache_parts
        extra = (self.page_size,) if kind == "paged" else ()
        return sum(parts(self.cfg, i, dtype, seqs, self.context, *extra)[1] for i in self.layers)

    def pages(self, seqs: int | None = None) -> int:
        """Pages of one data group's paged cache: ``seqs`` (default ``batch / dp``) times
        ``ceil(context / page_size)``; each device of the ``cp`` axis holds ``1/cp`` of them."""
        seqs = self.batch // self.dp if seqs is None else seqs
        return seqs * math.ceil(self.context / self.page_size)

    def context_that_fits(self, memory_bytes: int, kind: str = "contiguous", dtype: str = "bfloat16") -> int:
        """The longest context (tokens per sequence, a multiple of ``cp * index_kpool``, and
        of ``page_size`` for the paged cache) of which each device holds ``batch / dp``
        sequences' caches (``1/cp`` of their token rows on ``cp`` devices) next to the
        weights in ``memory_bytes``; 0 when not even one unit fits. Not capped at
        ``max_position_embeddings`` (``rows`` caps it and keeps the uncapped figure)."""
        # A paged cache: whole pages, a multiple of cp of them a sequence (a page holds whole
        # pools: cp * page_size is also a multiple of cp * index_kpool).
        unit = self.cp * (self.page_size if kind == "paged" else self.cfg.index_kpool)
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
        share holds (0 when the weights alone do not fit); a paged cache under ``cp``: a
        multiple of ``cp / gcd(pages a sequence, cp)`` per data group (its pages split over cp)."""
        room = memory_bytes - self.weight_bytes
        # In steps of sequences whose pages split over cp (1 for a contiguous cache).
        step = self.cp // math.gcd(self.pages(1), self.cp) if kind == "paged" else 1
        one, two = self.cache_bytes(kind, dtype, step), self.cache_bytes(kind, dtype, 2 * step)
        per_step, fixed = two - one, 2 * one - two  # caches grow linearly in sequences
        if room < fixed + per_step:
            return 0
        return self.dp * step * ((room - fixed) // per_step)

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
