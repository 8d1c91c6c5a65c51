"""The paged decode state of one layer: page pools shared by every sequence, read through
block tables (vLLM's and SGLang's layout), and the writes a step makes into them.

Each row ``b`` of a step is its own sequence, with its own length. Its tokens live in
pages of ``page_size`` tokens taken from one pool that every sequence shares; the page
bookkeeping (block tables, lengths, the free-page stack, all-or-nothing reservation and
release) is ``glm5_dsa_jax.cache.pages.PageTable``.

Invariants:

* **Positions are per sequence, from 0, with no holes.** A step appends row ``b``'s valid
  chunk tokens (its mask, anywhere in the chunk, in chunk order) at positions
  ``lengths[b], lengths[b] + 1, ...``; a masked-out entry consumes nothing. So a
  sequence's token ``t`` is the ``t``-th token it was given, its pool grid starts at 0
  (``first_key`` is 0) and every slot below ``lengths[b]`` is valid: no per-token validity
  byte, no ``first_key`` / ``n_valid`` per row (the contiguous cache needs them for left
  padding). Token ids in a top-k row are these positions.
* **Where a token lives.** Token ``t`` of sequence ``b`` is row ``t % page_size`` of page
  ``block_table[b, t // page_size]`` of ``latent_store [N, page_size, CR]``. Pooled keys
  page with their tokens (``page_size`` is a multiple of ``KP``): pool ``p`` is row
  ``p % PPP`` of page ``block_table[b, p // PPP]`` of ``pooled_store [N, PPP, D]``, ``PPP =
  page_size // KP``. A page therefore holds its tokens' latent rows *and* their pooled keys,
  and one reservation serves both pools.
* **The incomplete pool** (the last ``lengths[b] % KP`` tokens) is staged per sequence:
  ``stage_keys`` / ``stage_gate [max_seqs, H, D]`` hold the keys and gate logits of
  positions ``lengths[b] - H .. lengths[b] - 1`` (right-aligned; negative positions are
  empty; ``H = max(KP, KP - 1 + max_rollback)``, ``KP`` the static ``kpool``; the pipeline
  reads the last ``KP``). A pool is pooled once, when its last token arrives, like the
  contiguous cache.
* **Shared prefixes** (``fork``, ``glm5_dsa_jax.cache.fork``): a row can start as the first
  tokens of another, holding that prefix's complete pages by reference (``pages.refs``); a
  shared page is never written.
* **Drafts can be taken back** (``rollback`` / ``truncate``, ``glm5_dsa_jax.cache.rollback``):
  a sequence's last tokens are dropped as if never appended; the wider stage and
  ``stage_from`` are what that takes.
* **A row that cannot get its pages writes nothing** (``status[b]`` says why: ``pages.OK``,
  ``NO_FREE_PAGES``, ``TOO_LONG``, ``BAD_TABLE``); its outputs are zeros and its top-k
  ``-1``. Rows take pages in row order, so a failure never takes or touches another
  sequence's pages. Eager calls and ``PagedDecoder`` raise ``ValueError`` first
  (``check_chunk``, ``check_chunk_values``).
* **The page table is validated, not trusted** (``pages``' module doc): an eager call
  raises ``ValueError`` naming every broken row (``PagedCache.check``); under jit a broken
  row is ``BAD_TABLE`` and a broken free stack makes every row of its shard one, so no
  input lets a row read or write a page it does not own.
* Shapes never depend on lengths or on which sequences are live: one compiled step serves
  every step, join and release.
* **A sequence moves as its content, not its pages** (``export`` / ``load``,
  ``glm5_dsa_jax.cache.transfer``): an export holds a sequence's latent rows and complete
  pools in timeline order, as stored (fp8: e4m3 values and scales), its stage and length,
  and no page id, since page ids are this cache's bookkeeping; a load re-pages the content
  into another cache (another page count, page size or mesh) through ``pages.reserve``, so
  the target's page table stays valid and decoding there equals decoding here.

Bytes per token of capacity (``N * page_size`` tokens) at GLM-5.3-Flash dims in bf16: 1,024
latent + 64 pooled keys, plus the block tables (4 bytes per entry), the free stack and the
per-sequence stage: 1,088.6 for 8 sequences over 131,072-token-a-sequence worth of pages
(``bytes_per_token``; ``tests/test_paged.py`` keeps it <= 1,100). 16-bit pools are stored
as bits on a CPU, like the contiguous cache (``glm5_dsa_jax.cpu_policy``'s bit storage):
XLA:CPU scatters a ``uint16`` buffer in place but converts a bf16 one to float32 and back
around every write.

This is the paged implementation of the cache interface (``glm5_dsa_jax.cache.interface``):
``begin_chunk`` reserves the pages (``pages.reserve``, all or nothing per row, a row
without them masked out of the call) and gives each valid token the next position of its
sequence; ``row_slots`` maps positions to latent-pool slots (``token_slots``), so
``sparse_mla`` reads the shared pool ``[1, N * page_size, CR]`` only at the rows it
attends to; scoring reads each row's own pools through its block table.

**fp8** (``dtype="fp8"``, see ``glm5_dsa_jax.cache.fp8``): the latent and pooled pages hold e4m3
(``uint8`` bits on a CPU, for the same reason), and their float32 scales page with them:
``latent_scale [N, page_size]`` (one per token; ``[N, page_size, G]`` with the ``"group"``
layout's ``G > 1`` scales a row, a RoPE model's default, ``glm5_dsa_jax.cache.fp8``) and
``pooled_scale [N, PPP]`` (one per pool); ``None`` for a float cache. Rows are quantised
once, in ``write_latent`` and
``store_pools``; the stage stays in the compute dtype. Bytes per token of capacity
at GLM-5.3-Flash dims: 512 + 4 + (128 + 4) / 4 = 549, plus the block tables, stage and
free stack: 549.6 at 8 x 131,072 tokens (``tests/test_fp8_cache.py`` keeps it <= 560).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import pallas_kernels as pk
from glm5_dsa_jax.cache import eager
from glm5_dsa_jax.cache.contiguous import (
    check_cache_dtype, default_stage_dtype, index_fp8_format, latent_fp8_format, store_rows, visible_pools,
)
from glm5_dsa_jax.cache.fp8 import (
    IndexFormat, LatentFormat, check_rotate_index, is_fp8, quantize_index, quantize_latent_rows, rotate_index_rows,
)
from glm5_dsa_jax.cache.interface import Chunk, PoolWindow
from glm5_dsa_jax.cache.pages import (
    BAD_TABLE, NO_FREE_PAGES, OK, TOO_LONG, PageTable, init_page_table, release_mask,
)
from glm5_dsa_jax.cache.fork import fork_rows
from glm5_dsa_jax.cache.rollback import rollback_rows, stage_width
from glm5_dsa_jax.cache.transfer import ExportedSequence, export_sequence, load_sequence
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.cpu_policy import from_store, store_dtype, to_store
from glm5_dsa_jax.model.inputs import check_causal_topk

__all__ = ["PagedCache", "PagedPoolKeys", "init_paged_cache", "release_mask", "check_room",
           "check_chunk_values", "chunk_positions", "token_slots"]


@struct.dataclass
class PagedCache:
    """Paged decode state of one DSA layer (a pytree); shapes in the field comments
    (``N`` pages, ``PPP = page_size // KP``, "stored" as in ``cpu_policy.store_dtype``)."""

    pages: PageTable  # block tables [max_seqs, PG], lengths [max_seqs], free pages
    latent_store: jax.Array  # [N, page_size, kv_lora_rank], stored
    status: jax.Array  # [max_seqs] int32, of the last step (pages.OK / NO_FREE_PAGES / TOO_LONG / BAD_TABLE)
    pooled_store: jax.Array | None = None  # [N, PPP, index_head_dim], stored
    stage_keys: jax.Array | None = None  # [max_seqs, H, index_head_dim], cache dtype (H: stage_width)
    stage_gate: jax.Array | None = None  # [max_seqs, H, index_head_dim] float32
    latent_scale: jax.Array | None = None  # [N, page_size(, G)] float32, fp8 caches only
    pooled_scale: jax.Array | None = None  # [N, PPP(, G)] float32, fp8 caches only
    stage_from: jax.Array | None = None  # [max_seqs] int32: first position the stage may hold
    dtype: jnp.dtype = struct.field(pytree_node=False, default=jnp.dtype(jnp.bfloat16))
    kpool: int = struct.field(pytree_node=False, default=1)  # KP, the pool size (index_kpool)
    #: fp8 caches: how a latent row is scaled (``fp8.LatentFormat``; None for a float cache)
    latent_format: LatentFormat | None = struct.field(pytree_node=False, default=None)
    #: pooled keys stored Hadamard-rotated, indexer queries rotated by the layer (``fp8``)
    rotate_index: bool = struct.field(pytree_node=False, default=False)
    #: fp8 caches: how a pooled key is stored (``fp8.IndexFormat``; None for a float cache)
    index_format: IndexFormat | None = struct.field(pytree_node=False, default=None)

    #: The page pools (axis 0: the physical page): what a sequence axis splits (context
    #: parallelism, ``parallel.context_paged``); the page table, stage and status are replicated.
    PAGE_AXIS_FIELDS = ("latent_store", "latent_scale", "pooled_store", "pooled_scale")

    # ------------------------------------------------------------------ geometry
    @property
    def max_seqs(self) -> int:
        return self.pages.max_seqs

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    @property
    def num_pages(self) -> int:
        return self.latent_store.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.pages.pages_per_seq

    @property
    def max_length(self) -> int:
        """Most tokens one sequence can hold (``pages_per_seq * page_size``)."""
        return self.pages.max_length

    @property
    def max_pools(self) -> int:
        """Most pools one sequence can hold."""
        return self.pages_per_seq * self.pools_per_page

    @property
    def pools_per_page(self) -> int:
        return 0 if self.pooled_store is None else self.pooled_store.shape[1]

    @property
    def has_indexer(self) -> bool:
        return self.pooled_store is not None

    @property
    def lengths(self) -> jax.Array:
        """``[max_seqs]`` int32 tokens each sequence holds."""
        return self.pages.lengths

    @property
    def block_table(self) -> jax.Array:
        return self.pages.block_table

    @property
    def latent_pool(self) -> jax.Array:
        """``[N * page_size, CR]`` every page's latent rows, in the cache ``dtype``."""
        lat = self.latent_store
        return from_store(lat.reshape(-1, lat.shape[-1]), self.dtype)

    @property
    def latent_pool_scale(self) -> jax.Array | None:
        """``[N * page_size(, G)]`` the fp8 scale(s) of every latent row of ``latent_pool``
        (None for a float cache)."""
        sc = self.latent_scale
        return None if sc is None else sc.reshape((-1,) + sc.shape[2:])

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    @property
    def pooled_dtype(self) -> jnp.dtype:
        """The dtype the pooled-key pages read as (``DsaCache.pooled_dtype``)."""
        return self.dtype if self.index_format is None else self.index_format.dtype

    @property
    def stage_width(self) -> int:
        """``H``: raw entries the stage keeps per sequence, ``max(KP, KP - 1 + max_rollback)``
        (0 without an indexer); the pipeline reads its last ``KP``."""
        return 0 if self.stage_keys is None else self.stage_keys.shape[1]

    @property
    def max_rollback(self) -> int | None:
        """Tokens a sequence can always take back (``rollback``): ``H - KP + 1``; None (as
        many as it holds) without an indexer, which has no stage to restore."""
        return None if self.stage_keys is None else self.stage_width - self.kpool + 1

    def nbytes(self) -> int:
        """Bytes held on devices by this cache (pools, block tables, free stack, stage)."""
        return sum(x.nbytes for x in jax.tree.leaves(self))

    def bytes_per_token(self) -> float:
        """``nbytes()`` per token of capacity (``N * page_size``)."""
        return self.nbytes() / (self.num_pages * self.page_size)

    # ------------------------------------------------------------------ checks
    def check(self, cfg: DsaConfig, has_indexer: bool, max_seqs: int, dtype=None) -> None:
        """Raise ``ValueError`` unless this cache was made for ``cfg``, a layer with (or
        without) an indexer, ``max_seqs`` rows and (when given) ``dtype``; the difference is
        named. A concrete page table is validated too (``PageTable.check``: lengths, page
        ids, owners, the free stack), naming every broken row; under jit the same faults
        are each row's ``BAD_TABLE`` status instead (``PageTable.reserve``)."""
        lat = self.latent_store
        if lat.ndim != 3 or lat.shape[2] != cfg.kv_cache_dim:
            raise ValueError(
                f"paged cache latent pages are {tuple(lat.shape)}; this layer needs "
                f"[N, page_size, kv_lora_rank={cfg.kv_cache_dim}] (a cache made for another config?)")
        if self.max_seqs != max_seqs:
            raise ValueError(
                f"paged cache has {self.max_seqs} sequence rows but the input has B={max_seqs} "
                "rows: row b of the input is sequence b, so B must equal max_seqs")
        if dtype is not None and jnp.dtype(dtype) != self.dtype:
            raise ValueError(f"paged cache dtype is {self.dtype.name}, expected {jnp.dtype(dtype).name}")
        if self.has_indexer != has_indexer:
            what = "a full-indexer" if has_indexer else "a shared-indexer"
            raise ValueError(
                f"paged cache {'has' if self.has_indexer else 'lacks'} indexer state, but this "
                f"is {what} layer: make the cache with this layer's init_paged_cache")
        if has_indexer:
            kp, d = cfg.index_kpool, cfg.index_head_dim
            want = (self.num_pages, self.page_size // kp, d)
            # The stage this layer's KP needs for the cache's max_rollback.
            stage = (max_seqs, stage_width(kp, max(self.stage_width - self.kpool + 1, 0)), d)
            if tuple(self.pooled_store.shape) != want or self.kpool != kp or self.stage_keys.shape != stage:
                raise ValueError(
                    f"paged cache indexer state has pooled pages {tuple(self.pooled_store.shape)}, "
                    f"kpool {self.kpool} and stage {tuple(self.stage_keys.shape)}; this layer needs "
                    f"pooled {want} (index_kpool={kp}, index_head_dim={d}) and stage {stage}")
        if not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(self.pages)):
            self.pages.check()  # the table handed in: every row's bookkeeping, the free stack

    # ------------------------------------------------------------------ sequences
    def release(self, rows) -> "PagedCache":
        """Return the pages of every sequence where ``rows`` (``[max_seqs]`` bool) to the
        free pool; those rows then start a new sequence at position 0. A row that holds
        nothing is a no-op; releasing a row refused as ``BAD_TABLE`` repairs it
        (``PageTable.release``). Usable inside jit (no shape changes, no recompilation).

        ``rows`` must be a bool mask (``release_mask``): an integer array is refused even
        when it holds only 0 and 1, since row ids (``[2, 0, 1]``) and a 0/1 mask cannot be
        told apart and releasing the wrong sequences loses their tokens."""
        rows = release_mask(rows, self.max_seqs)
        if not eager.traced(self, rows):  # one program, placed as the cache (``cache.eager``)
            return eager.run(PagedCache.release, self, rows)
        upd = dict(pages=self.pages.release(rows), status=jnp.where(rows, OK, self.status))
        if self.has_indexer:
            upd.update(stage_keys=jnp.where(rows[:, None, None], 0, self.stage_keys).astype(self.stage_keys.dtype),
                       stage_gate=jnp.where(rows[:, None, None], 0.0, self.stage_gate),
                       stage_from=jnp.where(rows, 0, self.stage_from))
        return self.replace(**upd)

    def rollback(self, rows, n_tokens) -> "PagedCache":
        """Drop the last ``n_tokens[b]`` tokens of every sequence where ``rows`` (``[max_seqs]``
        bool; ``n_tokens`` ``[max_seqs]`` int): rejected draft tokens. Each such row is as if
        those tokens had never been appended (``glm5_dsa_jax.cache.rollback``' module doc): its
        length, its pages (``PageTable.truncate``: freed in reverse order of taking), its
        stage and its visible pools. Jit-safe, no shape depends on ``n_tokens``.

        A row asked to drop more than it holds, or more than its stage can restore (the new
        incomplete pool's raw keys: at least ``max_rollback`` tokens, see ``rollback``' doc),
        raises ``ValueError`` naming the row, ``n_tokens`` and the sizes in an eager call,
        nothing changed; under jit it is left untouched and ``status[b]`` is
        ``BAD_ROLLBACK`` (``BAD_TABLE`` for a broken page table, as ``reserve``)."""
        return rollback_rows(self, rows, n_tokens)

    def truncate(self, rows, lengths) -> "PagedCache":
        """``rollback(rows, self.lengths - lengths)``: shorten each sequence where ``rows`` to
        ``lengths[b]`` tokens (``[max_seqs]`` int; the same refusals)."""
        return rollback_rows(self, rows, lengths, to_lengths=True)

    def fork(self, src_rows, dst_rows, lengths) -> "PagedCache":
        """Start row ``dst_rows[i]`` as the first ``lengths[i]`` tokens of row ``src_rows[i]``
        (``[M]`` int arrays, M static): the prefix's complete pages shared by reference, a
        partly filled last page copied into one fresh page, the stage shifted from the
        source's (``glm5_dsa_jax.cache.fork``' module doc). Jit-safe; no shape depends on the
        values. Its outputs and top-k then equal those of the prefix run alone.

        Refused (a fork from an empty or released row, into a row in use, of no tokens or
        more than the source holds, across data shards, a row both source and destination,
        a prefix whose incomplete pool the source's stage no longer holds, no free page for
        the partial one): ``ValueError`` naming the row and the sizes in an eager call,
        nothing changed; under jit the destination row is untouched and ``status[d]`` is
        ``BAD_FORK`` (``NO_FREE_PAGES``, ``BAD_TABLE``)."""
        return fork_rows(self, src_rows, dst_rows, lengths)

    def export(self, row: int) -> ExportedSequence:
        """Sequence ``row`` as host arrays in timeline order, without page ids
        (``glm5_dsa_jax.cache.transfer``): its latent rows and complete pools as stored (fp8:
        e4m3 values and scales), its stage, its length. Eager; ``ValueError`` naming the row
        when it is empty or released. The cache is not changed."""
        return export_sequence(self, row)

    def load(self, row: int, exported: ExportedSequence) -> "PagedCache":
        """This cache with ``exported`` (``export`` of any paged cache of the same geometry,
        whatever its page count, page size or mesh) placed into the free row ``row``, its
        content re-paged onto pages of the row's data shard; the placement is kept. Eager;
        ``ValueError`` naming the row and the sizes, nothing written, when the geometry,
        layer kind or dtype differ, the row is in use, the sequence is longer than
        ``max_length`` or the row's shard lacks free pages (``transfer.check_load``)."""
        return load_sequence(self, row, exported)

    # ------------------------------------------------------------------ the cache interface
    #: ``"xla"`` streams every tile's selection through the block table (a row's pools are
    #: scattered over pages; only the live ones are read).
    STREAM_PREFILL = True
    #: ``PagedPoolKeys.tile`` past ``pages_per_seq`` pages finds no page (a ``-1`` entry:
    #: filled, not read, no candidate), so the score tiles need not shrink to a small pool.
    TILES_PAST_END = True

    @property
    def chunk_start(self) -> None:
        """None: positions are per sequence (a shared layer is kept causal in the step)."""
        return None

    def check_chunk(self, cfg: DsaConfig, has_indexer: bool, batch: int, mask, prev_topk=None) -> None:
        """``check`` (which validates a concrete page table), then, where the chunk's values
        are concrete, ``check_chunk_values``: room for the chunk, and a shared layer's
        ``prev_topk`` causal within each row's own sequence."""
        self.check(cfg, has_indexer, batch)
        concrete = (mask, self.pages.n_free) + (() if prev_topk is None else (prev_topk,))
        if not any(isinstance(a, jax.core.Tracer) for a in concrete):
            check_chunk_values(self, mask, prev_topk)

    def begin_chunk(self, mask: jax.Array) -> tuple["PagedCache", Chunk]:
        """Pages first: ``pages.reserve`` gives every row the pages its valid tokens need,
        all or nothing, in row order; a row that cannot have them (``status``) is masked
        out of the whole call. Each valid token gets the next position of its sequence
        (``chunk_positions``): ``q_pos`` and the default RoPE positions."""
        old = self.pages.lengths
        pages, status = self.pages.reserve(mask.sum(axis=1, dtype=jnp.int32))
        mask = mask & (status == OK)[:, None]
        q_pos = chunk_positions(old, mask)
        return self.replace(pages=pages, status=status), Chunk(
            mask=mask, q_pos=q_pos, positions=q_pos, n_vis=q_pos + 1, fits=True, start=old)

    def write_latent(self, latent: jax.Array, chunk: Chunk) -> "PagedCache":
        """The chunk's latent rows ``[B, S, CR]`` written at their positions (``-1``: not
        written), through the (already reserved) block table; an fp8 cache quantises them
        here, once, and writes their scales beside them."""
        return self.write_latent_held(latent, chunk, 0)

    def write_latent_held(self, latent: jax.Array, chunk: Chunk, page_offset) -> "PagedCache":
        """``write_latent`` into a store that holds pages ``page_offset ..`` only (a shard of
        a pool split over a sequence axis, ``parallel.context_paged``): rows on pages it
        does not hold are not written."""
        slots = token_slots(self.pages.block_table, chunk.q_pos, self.page_size)
        slots = _held_slots(slots, page_offset, self.page_size, self.num_pages)
        upd = {}
        if self.is_fp8:
            latent, scale = quantize_latent_rows(latent, self.latent_format)
            upd["latent_scale"] = _scatter_scales(self.latent_scale, scale, slots)
        rows = to_store(latent, self.dtype, self.latent_store.dtype)
        return self.replace(latent_store=_scatter_rows(self.latent_store, rows, slots), **upd)

    def attention_rows(self) -> tuple[jax.Array, jax.Array | None]:
        """``(latent_pool [1, N * page_size, CR], its scales [1, N * page_size(, G)] | None)``."""
        return self.latent_pool[None], None if self.latent_scale is None else self.latent_pool_scale[None]

    def row_slots(self, token_ids: jax.Array) -> jax.Array:
        """Positions to latent-pool slots (``token_slots``): only the rows attended are read,
        and they lie in the sequence's own pages."""
        return token_slots(self.pages.block_table, token_ids, self.page_size)

    def pool_window(self, keys: jax.Array, gate: jax.Array, chunk: Chunk) -> PoolWindow:
        """The window ``kpool_compress`` pools for a chunk: each row's stage (positions
        ``old - KP .. old - 1``) then its valid chunk tokens moved to the front (positions
        ``old ..``); ``first_pool = KP - old % KP`` is the window offset of the pool holding
        position ``old - old % KP`` (the sequence's pool grid starts at 0)."""
        mask = chunk.mask
        n_new = mask.sum(axis=1, dtype=jnp.int32)
        old_lengths = self.pages.lengths - n_new
        kp = self.kpool
        order = jnp.argsort(~mask, axis=1, stable=True)  # valid entries first, in chunk order
        s = mask.shape[1]
        stage_keys, stage_gate = self.stage_keys[:, -kp:], self.stage_gate[:, -kp:]
        win_keys = jnp.concatenate([stage_keys, _compact(keys, order).astype(stage_keys.dtype)], 1)
        win_gate = jnp.concatenate([stage_gate, _compact(gate, order).astype(jnp.float32)], 1)
        i = jnp.arange(kp + s, dtype=jnp.int32)[None]
        valid = jnp.where(i < kp, old_lengths[:, None] - kp + i >= 0, i - kp < n_new[:, None])
        first_pool = (kp - old_lengths % kp).astype(jnp.int32)
        return PoolWindow(win_keys, win_gate, valid, None, first_pool)

    def store_pools(self, window: PoolWindow, pooled: jax.Array, pooled_valid: jax.Array,
                    chunk: Chunk) -> "PagedCache":
        """``store_pools_held`` of the whole pool (``page_offset`` 0)."""
        return self.store_pools_held(window, pooled, pooled_valid, chunk, 0)

    def store_pools_held(self, window: PoolWindow, pooled: jax.Array, pooled_valid: jax.Array,
                         chunk: Chunk, page_offset) -> "PagedCache":
        """Write the pools of the window that complete in this chunk (their last token is at
        a position below the new length) into their pages, once, and keep each row's last
        ``H`` entries (positions ``new - H .. new - 1``) of the stage's first ``H - KP``
        then the window as its new stage.

        ``pooled [B, n, D]`` / ``pooled_valid [B, n]``: ``kpool_compress`` of the window from
        ``first_pool``; window pool ``q`` is the sequence's pool ``old // KP + q``.
        ``page_offset`` as ``write_latent_held``'s (the stage is every shard's, written alike)."""
        n_new = chunk.mask.sum(axis=1, dtype=jnp.int32)
        old_lengths = self.pages.lengths - n_new
        kp = self.kpool
        ppp = self.pools_per_page
        new_len = old_lengths + n_new
        pool_id = old_lengths[:, None] // kp + jnp.arange(pooled.shape[1], dtype=jnp.int32)[None]
        new = ((pool_id + 1) * kp <= new_len[:, None]) & pooled_valid
        j = jnp.clip(pool_id // ppp, 0, self.pages_per_seq - 1)
        page = jnp.take_along_axis(self.pages.block_table, j, axis=1)
        slots = jnp.where(new & (page >= 0), page * ppp + pool_id % ppp, -1)
        slots = _held_slots(slots, page_offset, ppp, self.num_pages)
        upd = {}
        pooled = rotate_index_rows(pooled, self.rotate_index)
        if self.is_fp8:  # quantised once, here
            pooled, scale = quantize_index(pooled, self.index_format)
            upd["pooled_scale"] = _scatter_scales(self.pooled_scale, scale, slots)
        rows = to_store(pooled, self.pooled_dtype, self.pooled_store.dtype)
        h = self.stage_width
        take = n_new[:, None] + jnp.arange(h, dtype=jnp.int32)[None]
        # Positions old - H .. new - 1: the stage's entries before the window's, then the window.
        keys = jnp.concatenate([self.stage_keys[:, :h - kp], window.keys], 1)
        gate = jnp.concatenate([self.stage_gate[:, :h - kp], window.gate], 1)
        return self.replace(
            **upd,
            pooled_store=_scatter_rows(self.pooled_store, rows, slots),
            stage_keys=_compact(keys, take),
            stage_gate=_compact(gate, take),
        )

    def live_pools(self, q_pos: jax.Array) -> jax.Array:
        """``[B, Q]`` the pools complete at each query (``visible_pools`` from position 0, up
        to the row's pool count)."""
        kp = self.kpool
        return visible_pools(q_pos, 0, kp, (self.pages.lengths // kp)[:, None])

    def held_pool_keys(self, logical: jax.Array, local: jax.Array):
        """The pooled keys of the pages a shard holds (``parallel.context_paged.held_pages``:
        per sequence the logical pages ``logical [B, PGL]`` and their local page ids
        ``local [B, PGL]``, ``-1`` after): keys ``[B, M = PGL * PPP, D]`` in the compute
        dtype, their fp8 scales (or None), logical pool ids ``[B, M]`` (``-1``: none) and
        validity (a complete pool of the sequence on a held page)."""
        ppp = self.pools_per_page
        b, pgl = local.shape
        page = jnp.maximum(local, 0).reshape(-1)
        keys = from_store(jnp.take(self.pooled_store, page, axis=0), self.pooled_dtype)
        keys = keys.reshape(b, pgl * ppp, keys.shape[-1])
        scale = None
        if self.pooled_scale is not None:
            g = self.pooled_scale.shape[2:]
            scale = jnp.take(self.pooled_scale, page, axis=0).reshape((b, pgl * ppp) + g)
        pool = (logical[..., None] * ppp + jnp.arange(ppp, dtype=jnp.int32)).reshape(b, -1)
        pool = jnp.where(jnp.repeat(local >= 0, ppp, axis=1), pool, -1)
        valid = (pool >= 0) & (pool < (self.lengths // self.kpool)[:, None])
        return keys, scale, pool, valid

    def gathered_pools(self, seq_axis: str) -> "PagedCache":
        """Inside a ``shard_map`` over ``seq_axis`` whose shards each hold a block of the page
        pools (context parallelism, ``parallel.context_paged``): this cache with its pooled-key
        pages (and an fp8 cache's scales) all-gathered in shard order, i.e. every page as the
        unsharded cache holds them, bit for bit, under the replicated block table. A view for
        the selection only (``pool_keys``, ``live_pools``; the layer's ``choose_pools``): the
        latent pages stay this shard's. Bytes in per device: ``(cp - 1) / cp`` of the pooled-key
        pages (``pool_row_bytes`` a pool)."""
        return self.replace(**{
            f: jax.lax.all_gather(getattr(self, f), seq_axis, axis=0, tiled=True)
            for f in ("pooled_store", "pooled_scale") if getattr(self, f) is not None})

    def pool_row_bytes(self) -> int:
        """Bytes of one pool in the pooled-key pages as stored (its key and any fp8 scale):
        what a pool costs to send (``gathered_pools``)."""
        return sum(a.dtype.itemsize * math.prod(a.shape[2:])
                   for a in (self.pooled_store, self.pooled_scale) if a is not None)

    def pool_keys(self) -> "PagedPoolKeys":
        """The pooled-key pages, block table and pool counts: ``index_scores_paged``' key source."""
        kp = self.kpool
        return PagedPoolKeys(self.pooled_store, self.pages.block_table, self.pages.lengths // kp,
                             self.pooled_scale, dtype=self.pooled_dtype)

    def pool_origin(self) -> jax.Array:
        """``[max_seqs]`` zeros: a sequence's pool grid starts at position 0."""
        return jnp.zeros(self.pages.lengths.shape, jnp.int32)

    def visible_tail(self, pools, n_vis, q_pos, kpool: int) -> jax.Array:
        """``[B, Q, KP - 1]`` the tokens of each query's incomplete visible pool (positions
        ``n_vis - n_vis % KP .. q``, ``n_vis = q + 1``; ``-1`` where empty or for a padding
        query): the contiguous tail of a sequence from position 0 with no holes, which
        never falls in a complete pool (``pools`` unused)."""
        count = n_vis % kpool
        off = jnp.arange(kpool - 1, dtype=jnp.int32)
        ids = (n_vis - count)[..., None] + off
        ok = (off < count[..., None]) & (q_pos[..., None] >= 0)
        return jnp.where(ok, ids, -1).astype(jnp.int32)

    def end_chunk(self, chunk: Chunk) -> "PagedCache":
        """Nothing: ``begin_chunk`` moved the lengths."""
        return self


_replace_fields = PagedCache.replace


def _replace(self, **updates) -> PagedCache:
    """``dataclasses.replace``, where ``latent=`` / ``pooled=`` are float rows (every page's;
    ``contiguous.store_rows``)."""
    return _replace_fields(self, **store_rows(self, updates))


PagedCache.replace = _replace


def init_paged_cache(
    cfg: DsaConfig,
    max_seqs: int,
    num_pages: int,
    page_size: int = 64,
    *,
    pages_per_seq: int | None = None,
    has_indexer: bool = True,
    dtype=jnp.bfloat16,
    stage_dtype=None,
    shards: int = 1,
    seq_shards: int = 1,
    max_rollback: int = 1,
    latent_layout: str = "group",
    rotate_index: bool = False,
    index_keys: str = "e4m3",
) -> PagedCache:
    """An empty paged cache: ``num_pages`` pages of ``page_size`` tokens shared by
    ``max_seqs`` sequences, each of up to ``pages_per_seq * page_size`` tokens (default
    ``pages_per_seq``: every page of a shard, capped at ``max_position_embeddings``).
    ``shards > 1``: the page table is that many independent tables (``pages.init_page_table``,
    which checks that ``max_seqs`` and ``num_pages`` divide by it; the data-parallel layout).
    ``seq_shards > 1``: each shard's pages are handed out round-robin over that many
    contiguous blocks (the devices of a sequence axis, ``pages.init_page_table``), so a
    sequence's pages spread evenly over them (context parallelism).

    ``page_size`` must be a multiple of ``index_kpool`` (a page holds whole pools) and
    ``dtype`` one of ``cache.CACHE_DTYPES`` or ``"fp8"``; anything else raises
    ``ValueError``. ``stage_dtype`` as ``cache.init_cache``'s. ``max_rollback`` (static, an
    int >= 0): tokens a sequence can always take back (``PagedCache.rollback``); the stage
    keeps ``max(KP, KP - 1 + max_rollback)`` raw positions (``glm5_dsa_jax.cache.rollback``).
    ``latent_layout``, ``rotate_index``, ``index_keys``: as ``cache.init_cache``'s.
    """
    dtype = check_cache_dtype(dtype)
    ifmt = index_fp8_format(cfg, dtype, index_keys)
    fmt = latent_fp8_format(cfg, dtype, latent_layout)
    stage_dtype = default_stage_dtype(dtype, stage_dtype)
    fp8 = is_fp8(dtype)
    kp = cfg.index_kpool
    h = stage_width(kp, max_rollback)
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0 or page_size % kp:
        raise ValueError(f"page_size must be a positive multiple of index_kpool={kp} (a page "
                         f"holds whole pools), got {page_size!r}")
    if pages_per_seq is None and isinstance(num_pages, int) and isinstance(shards, int) and shards > 0:
        pages_per_seq = max(1, min(num_pages // shards, cfg.max_position_embeddings // page_size))
    table = init_page_table(max_seqs, num_pages, page_size, pages_per_seq, shards=shards, seq_shards=seq_shards)
    if table.max_length > cfg.max_position_embeddings:
        raise ValueError(f"pages_per_seq * page_size = {table.max_length} exceeds "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    st = store_dtype(dtype)
    base = dict(
        pages=table,
        latent_store=jnp.zeros((num_pages, page_size, cfg.kv_cache_dim), st),
        status=jnp.zeros((max_seqs,), jnp.int32),
        latent_scale=None if fmt is None else jnp.ones((num_pages, page_size, *fmt.scale_shape), jnp.float32),
        dtype=dtype,
        kpool=kp,
        latent_format=fmt,
    )
    if not has_indexer:
        return PagedCache(**base)
    d = cfg.index_head_dim
    return PagedCache(
        **base,
        rotate_index=check_rotate_index(d, rotate_index),
        index_format=ifmt,
        pooled_store=jnp.zeros((num_pages, page_size // kp, d), st if ifmt is None else store_dtype(ifmt.dtype)),
        pooled_scale=None if ifmt is None else jnp.ones((num_pages, page_size // kp, *ifmt.scale_shape), jnp.float32),
        stage_keys=jnp.zeros((max_seqs, h, d), stage_dtype),
        stage_gate=jnp.zeros((max_seqs, h, d), jnp.float32),
        stage_from=jnp.zeros((max_seqs,), jnp.int32),
    )


def check_room(cache: PagedCache, mask) -> None:
    """Raise ``ValueError`` naming each sequence whose valid tokens in ``mask [max_seqs, S]``
    do not fit (too few free pages after the rows before it, or past ``max_length``);
    nothing is written. Needs concrete values (an eager call, ``PagedDecoder``)."""
    n_new = np.asarray(mask, bool).sum(axis=1, dtype=np.int32)
    # On a host copy (a small table): the same reservation, whatever mesh the cache is on.
    _, status = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), cache.pages).reserve(n_new)
    status = np.asarray(status)
    if (status == OK).all():
        return
    if (status == BAD_TABLE).any():
        cache.pages.check()  # raises, naming the broken rows
    lengths = np.asarray(cache.pages.lengths)
    n_free, ps = np.asarray(cache.pages.n_free).reshape(-1), cache.page_size
    m = cache.max_seqs // n_free.size  # rows per data shard, each with its own free pages
    problems = []
    for b in range(cache.max_seqs):
        if b % m == 0:
            left = int(n_free[b // m])
        have = -(-int(lengths[b]) // ps)
        need = -(-(int(lengths[b]) + int(n_new[b])) // ps) - have
        if status[b] == TOO_LONG:
            problems.append(
                f"sequence {b} would hold {int(lengths[b]) + int(n_new[b])} tokens, more than "
                f"pages_per_seq * page_size = {cache.max_length} (over by "
                f"{int(lengths[b]) + int(n_new[b]) - cache.max_length})")
        elif status[b] == NO_FREE_PAGES:
            where = "" if n_free.size == 1 else f" in data shard {b // m}"
            problems.append(f"sequence {b} needs {need} more page(s) of {ps} tokens but only {left} "
                            f"are free{where} after the rows before it (short by {need - left})")
        else:
            left -= max(need, 0)
    raise ValueError("chunk does not fit the paged cache; nothing was written: " + "; ".join(problems))


def check_chunk_values(cache: PagedCache, mask, prev_topk=None) -> None:
    """The checks of an eager paged call that need the chunk's values (``mask [max_seqs,
    S]``, a shared layer's ``prev_topk [max_seqs, S, W]``), before anything is written:
    ``check_room``, and a ``prev_topk`` id after its query's position within its own
    sequence (``chunk_positions``) raises ``ValueError`` naming ``prev_topk``, the row and
    the id, as the contiguous cache does (``inputs.check_causal_topk``)."""
    check_room(cache, mask)
    if prev_topk is not None:
        mask = np.asarray(mask, bool)
        check_causal_topk(np.asarray(prev_topk), mask,
                          np.asarray(chunk_positions(np.asarray(cache.pages.lengths), mask)))


# ---------------------------------------------------------------------------- chunk -> slots
def chunk_positions(lengths: jax.Array, mask: jax.Array) -> jax.Array:
    """``[B, S]`` int32 position of each valid chunk token within its sequence (valid
    tokens in chunk order from ``lengths[b]``), ``-1`` for a masked-out entry."""
    return jnp.where(mask, lengths[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, -1)


def token_slots(block_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """``[B, ...]`` flat slot (``page * page_size + row``) in the latent pool of each
    position of ``positions [B, ...]``; ``-1`` for a position < 0 or on no page."""
    b = positions.shape[0]
    flat = positions.reshape(b, -1)
    j = jnp.clip(flat // page_size, 0, block_table.shape[1] - 1)
    page = jnp.take_along_axis(block_table, j, axis=1)
    slot = page * page_size + flat % page_size
    return jnp.where((flat >= 0) & (page >= 0), slot, -1).reshape(positions.shape)


def _held_slots(slots: jax.Array, page_offset, per_page: int, n_pages: int) -> jax.Array:
    """Flat slots ``page * per_page + row`` of the whole pool -> slots of a store that holds
    pages ``page_offset .. page_offset + n_pages - 1`` (``-1`` elsewhere). ``page_offset``
    the int 0 (the whole pool): ``slots`` unchanged."""
    if isinstance(page_offset, int) and page_offset == 0:
        return slots
    local = slots - page_offset * per_page
    return jnp.where((slots >= 0) & (local >= 0) & (local < n_pages * per_page), local, -1)


def _scatter_rows(store: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """``store [N, per_page, width]`` (a page's ``page_size`` latent rows or ``PPP`` pooled
    keys, each ``width`` wide) with ``rows [..., width]`` written at flat row
    ``page * per_page + row`` = ``slots [...]`` (``-1``: dropped). A scatter on the donated buffer: in place (a ``uint16`` buffer on a
    CPU, see the module doc), so a step costs what it writes.

    Never a one-row scatter: one dropped row (index past the end) is always appended. XLA
    rewrites a one-row scatter (a batch-1 decode step) into a ``dynamic-update-slice``,
    which XLA:CPU (jax 0.10) then fused into the readers of the updated pool (the
    attention's gather) as well as writing it, and so kept the old pool alive: four
    whole-pool copies per step (a 131,072-token pool at batch 1: ~400 ms a step against
    6 ms; ``scripts/capacity_ratio.py small --cache paged``)."""
    n, per_page, width = store.shape
    flat = store.reshape(n * per_page, width)
    idx = jnp.where(slots >= 0, slots, n * per_page).reshape(-1)
    rows = rows.reshape(-1, width).astype(store.dtype)
    # One dropped row more, so never a one-row scatter (see the doc).
    idx = jnp.concatenate([idx, jnp.full((1,), n * per_page, idx.dtype)])
    rows = jnp.concatenate([rows, jnp.zeros((1, width), rows.dtype)])
    flat = flat.at[idx].set(rows, mode="drop")
    return flat.reshape(n, per_page, width)


def _scatter_scales(store: jax.Array, scale: jax.Array, slots: jax.Array) -> jax.Array:
    """``_scatter_rows`` of fp8 scales: ``store [N, per_page]`` (one a row) or ``[N,
    per_page, G]`` (group scales), ``scale [..., ]`` / ``[..., G]`` at ``slots [...]``."""
    if store.ndim == 2:
        return _scatter_rows(store[..., None], scale[..., None], slots)[..., 0]
    return _scatter_rows(store, scale, slots)


# ---------------------------------------------------------------------------- pooled keys
def _compact(a: jax.Array, order: jax.Array) -> jax.Array:
    return jnp.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 2)), axis=1)


@struct.dataclass
class PagedPoolKeys:
    """The key source of index scoring on a paged cache (``interface.PooledKeys``): the
    pooled-key pages ``[N, PPP, D]`` (stored), ``block_table [B, PG]``, ``pool_counts [B]``
    (each row's complete pools) and the fp8 scales ``[N, PPP(, G)]`` (or None)."""

    stored: jax.Array
    block_table: jax.Array
    pool_counts: jax.Array
    scale: jax.Array | None
    dtype: jnp.dtype = struct.field(pytree_node=False, default=jnp.dtype(jnp.bfloat16))

    @property
    def kernel(self):
        """``pk.index_scores_paged``: the scoring wrapper for this key source (looked up at the call)."""
        return pk.index_scores_paged

    def operands(self) -> tuple:
        """``(pooled-key pages, block_table, pool_counts)``: ``index_scores_paged``' key operands."""
        return from_store(self.stored, self.dtype), self.block_table, self.pool_counts

    def tile(self, start, tile: int, kpool: int) -> tuple:
        """Each sequence's pools ``start .. start + tile - 1``, read through its block table:
        only the pages of those pools that the sequence owns are read (a ``-1`` entry is
        filled, not read), pools at or past ``pool_counts[b]`` are no candidates, and the
        fp8 scales are gathered like the keys."""
        b = self.block_table.shape[0]
        n, ppp, d = self.stored.shape
        p = start + jnp.arange(tile, dtype=jnp.int32)
        # [B, tile]; a pool past pages_per_seq pages (``TILES_PAST_END``) finds no page.
        page = jnp.take(self.block_table, p // ppp, axis=1, mode="fill", fill_value=-1)
        slot = jnp.where(page >= 0, page * ppp + p % ppp, n * ppp)
        keys = jnp.take(self.stored.reshape(n * ppp, d), slot.reshape(-1), axis=0, mode="fill", fill_value=0)
        keys = from_store(keys.reshape(b, tile, d), self.dtype)
        scale = None
        if self.scale is not None:
            g = self.scale.shape[2:]  # () or (G,): int8 keys' group scales
            scale = jnp.take(self.scale.reshape((n * ppp,) + g), slot.reshape(-1), axis=0, mode="fill",
                             fill_value=0).reshape((b, tile) + g)
        valid = (page >= 0) & (p[None] < self.pool_counts[:, None])
        return keys, valid, jnp.full((b,), start * kpool, jnp.int32), scale
