"""What the layer's pipeline asks of a cache: one small interface that the contiguous
``DsaCache`` and the paged ``PagedCache`` both implement, so the pipeline
(``DsaAttention.forward``) is written once and never asks which cache it holds.

Why an interface and not a branch per step: the two caches differ only in how a chunk's
tokens get their positions, where a row lives and how a pool is found (one timeline and
contiguous buffers, or a sequence per row and pages through a block table). Everything
else (projections, pooling, scoring, selection, attention) is the same arithmetic on what
the cache hands out. Each operation below is a method of both caches; its contract
(shapes, invariants) is written here, its two layouts in ``contiguous`` and ``paged``.

Axis letters: ``B`` rows of a call, ``S`` its tokens, ``Q`` the queries of one tile, ``CR``
the cache row width (``kv_cache_dim``), ``D`` the indexer head dim, ``KP`` the pool size,
``P`` a row's pool capacity (``max_pools``), ``W`` the top-k width.

The operations of a call, in pipeline order:

* ``chunk_start`` (property): the slot of the chunk's first query when the batch shares
  one timeline (``check_inputs`` checks a concrete ``prev_topk`` causal against it), or
  None when positions are per row (``check_chunk`` checks it per row, the step keeps a
  traced one causal).
* ``check_chunk(cfg, has_indexer, batch, mask, prev_topk=None)``: ``ValueError`` (nothing
  written) unless the cache was made for this layer and ``batch``, its bookkeeping is
  sound (paged: the page table is validated) and the chunk fits (checked where the values
  are concrete).
* ``begin_chunk(mask [B, S]) -> (cache, Chunk)``: claim room for the chunk (paged: pages
  reserved, all or nothing per row; a row without them is masked out of the whole call).
* ``write_latent(latent [B, S, CR], chunk) -> cache``: the chunk's cache rows, before any
  query reads (a query attends to its own token).
* ``attention_rows() -> (rows [B', L, CR], scale [B', L] | None)``: the rows
  ``sparse_mla`` reads, as floats of the cache dtype (e4m3 with their scales for fp8), and
  ``row_slots(token_ids [B, Q, W]) -> [B, Q, W]``: where in those rows each token id is
  (contiguous: the id itself; paged: the pool slot through the block table).
* ``pool_window(keys [B, S, D], gate [B, S, D], chunk) -> PoolWindow`` and
  ``store_pools(window, pooled [B, n, D], pooled_valid [B, n], chunk) -> cache``: the keys
  ``kpool_compress`` pools (the stage of the incomplete pool, then the chunk) and the write
  of every pool that completes in the chunk, once; the new stage is kept.
* ``live_pools(q_pos [B, Q]) -> [B, Q]``: the pools complete at each query (``visible_pools``):
  no pool past it is read.
* ``pool_keys() -> PooledKeys``: the key source of index scoring: the pooled keys and how a
  pool is found (``pool_valid`` / ``first_key``, or the block table and pool counts).
  ``kernel`` is the Pallas wrapper family's member for it (``index_scores`` /
  ``index_scores_paged``), called ``kernel(qi, w, *keys.operands(), q_pos, keys.scale,
  kpool=)``; ``tile(start, tile, kpool)`` is one tile of pools as ``index_scores_reference``
  takes them, what ``tile_scorer`` (the ``"xla"`` streaming selection) reads.
* ``STREAM_PREFILL`` (class attribute): whether ``"xla"`` streams the selection of prefill
  tiles too (a decode step always streams).
* ``TILES_PAST_END`` (class attribute): whether ``pool_keys().tile`` may be read past
  ``max_pools`` (such pools are no candidates, and nothing past a row's own pages is read):
  then ``"xla"`` sizes its score tiles as for a pool of at least ``POOL_TILE`` pools, so the
  compiled step is the same program, of the same cost, whatever the capacity (issue 48).
* ``pool_origin() -> [B]``: each row's slot of pool 0's first token (``first_key``; 0 paged),
  and ``visible_tail(pools [B, Q, K], n_vis [B, Q], q_pos, kpool) -> [B, Q, KP - 1]``: the
  tokens of each query's incomplete visible pool, none of them inside a selected pool.
* ``end_chunk(chunk) -> cache``: the bookkeeping after the chunk (contiguous: ``length``
  and ``n_valid``; paged: nothing, ``begin_chunk`` moved the lengths).

A ``Chunk`` holds, per call, what ``begin_chunk`` decided; the pipeline reads ``mask``,
``q_pos``, ``positions`` and ``n_vis`` and hands the chunk back to the cache's writes.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax

import pallas_kernels as pk

__all__ = ["Chunk", "PoolWindow", "PooledKeys", "LayerCache", "tile_scorer", "OPERATIONS"]


class Chunk(NamedTuple):
    """A chunk of ``S`` tokens as a cache placed it (``begin_chunk``).

    ``mask [B, S]``: the tokens the call processes (paged: rows that got no pages are
    masked out); ``q_pos [B, S]``: each query's slot (contiguous) or position in its
    sequence (paged), ``-1`` for padding; ``positions [B, S]``: the default RoPE
    positions (contiguous: the slots, padding included, HF's timeline; paged: ``q_pos``);
    ``n_vis [B, S]`` (None without an indexer): the valid tokens each query sees;
    ``fits``: whether the chunk is written (contiguous: it fits ``max_length``; paged:
    True, a row that does not fit is masked out); ``start``: the length before the chunk
    (``[]`` contiguous, ``[B]`` paged).
    """

    mask: jax.Array
    q_pos: jax.Array
    positions: jax.Array
    n_vis: Any
    fits: Any
    start: jax.Array


class PoolWindow(NamedTuple):
    """The positions that hold every token of any pool completing in a chunk of ``S``
    tokens: the cache's stage (the last ``KP`` before the chunk) then the chunk's.

    ``keys [B, KP+S, D]`` (stage dtype), ``gate [B, KP+S, D]`` float32, ``valid [B,
    KP+S]``; ``first_pool [B]`` int32, the window offset where the first whole pool on the
    row's pool grid starts (``KP + S`` when the row has no valid slot yet): what
    ``kpool_compress`` takes as its ``first_key``. ``first_key [B]``: the row's first valid
    slot after this chunk on a contiguous cache (``max_length`` while none); None on a
    paged one (its pool grid starts at position 0).
    """

    keys: jax.Array
    gate: jax.Array
    valid: jax.Array
    first_key: Any
    first_pool: jax.Array


class PooledKeys(Protocol):
    """The key source of index scoring (a pytree, so it can be a loop operand)."""

    kernel: Any  # class attribute: pk.index_scores or pk.index_scores_paged
    scale: Any  # the fp8 scales of the pooled keys, or None

    def operands(self) -> tuple:
        """The kernel's key operands after ``(qi, w)``: float keys, then the key source."""

    def tile(self, start, tile: int, kpool: int) -> tuple:
        """``(keys [B, tile, D], valid [B, tile], first_key [B], scale [B, tile] | None)``
        of pools ``start .. start + tile - 1``, read only there, with the whole row's
        candidate rule (``index_scores_reference``'s arguments)."""


class LayerCache(Protocol):
    """The interface (module doc): ``DsaCache`` and ``PagedCache`` implement every method."""

    STREAM_PREFILL: bool
    TILES_PAST_END: bool
    max_pools: int

    @property
    def chunk_start(self): ...
    def check_chunk(self, cfg, has_indexer: bool, batch: int, mask, prev_topk=None) -> None: ...
    def begin_chunk(self, mask) -> tuple["LayerCache", Chunk]: ...
    def write_latent(self, latent, chunk: Chunk) -> "LayerCache": ...
    def attention_rows(self) -> tuple: ...
    def row_slots(self, token_ids): ...
    def pool_window(self, keys, gate, chunk: Chunk) -> PoolWindow: ...
    def store_pools(self, window: PoolWindow, pooled, pooled_valid, chunk: Chunk) -> "LayerCache": ...
    def live_pools(self, q_pos): ...
    def pool_keys(self) -> PooledKeys: ...
    def pool_origin(self): ...
    def visible_tail(self, pools, n_vis, q_pos, kpool: int): ...
    def end_chunk(self, chunk: Chunk) -> "LayerCache": ...


#: Every operation of ``LayerCache`` (``tests/test_cache_interface.py`` checks both caches).
OPERATIONS = ("STREAM_PREFILL", "TILES_PAST_END", "max_pools", "chunk_start", "check_chunk", "begin_chunk", "write_latent",
              "attention_rows", "row_slots", "pool_window", "store_pools", "live_pools", "pool_keys",
              "pool_origin", "visible_tail", "end_chunk")


@functools.lru_cache(maxsize=None)
def tile_scorer(tile: int, kpool: int):
    """``scores(start, qi, w, q_pos, keys) -> [B, Q, tile]``: ``pk.index_scores_reference``
    of pools ``start .. start + tile - 1`` of the key source ``keys`` (``PooledKeys.tile``),
    the one tile scorer of both caches. One function per statics, so the eager
    ``while_loop`` trace of ``pk.streaming_topk`` is cached."""

    def scores(start, qi, w, q_pos, keys):
        k, valid, first_key, scale = keys.tile(start, tile, kpool)
        return pk.index_scores_reference(qi, w, k, valid, first_key, q_pos, scale, kpool=kpool)

    return scores
