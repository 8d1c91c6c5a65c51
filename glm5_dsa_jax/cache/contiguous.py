"""The per-layer decode state: the MLA latent cache and the indexer's pooled-key cache.

Invariants:

* All sequences of a batch share one timeline: slot ``i`` of every row is the ``i``-th
  token fed to the layer, padding included (as in Hugging Face's ``DynamicCache``).
  ``length`` is the number of slots written; token ids in a top-k row are slots.
* ``latent[b, i]`` is token ``i``'s cache row, ``kv_cache_dim`` wide: the latent ``c =
  kv_a_layernorm(kv_a_proj(x_i)[:kv_lora_rank])``, then (RoPE models) the shared roped key
  ``k_rot`` (``DsaAttention.project``). It is the only per-token tensor attention reads;
  ``key_valid[b, i]`` is False for padding.
* The indexer keeps *pooled* keys: ``pooled[b, p]`` is written once, when the last token
  of pool ``p`` arrives, and never recomputed. Only the last ``H`` slots' keys and gate
  logits (``stage_*``, the tokens an incomplete pool may still need; ``H = index_kpool``,
  wider with ``max_rollback``, ``glm5_dsa_jax.cache.rollback``) are kept per token. Per
  token that is ``kv_cache_dim`` row values, one validity byte and ``index_head_dim /
  index_kpool`` pooled values: 1,089 bytes in bf16 at GLM-5.3-Flash
  dims and kpool 4 (HF keeps the latent and every raw indexer key, 1,538 bytes).
* ``first_key[b]`` is the first valid slot, ``max_length`` until one arrives;
  ``n_valid[b]`` counts the valid slots written.
* Shared-indexer layers hold no indexer state (those fields are ``None``).

Shapes never depend on ``length``, so one compiled step serves every step of a decode.
``rollback(n)`` drops the last ``n`` slots of the batch's timeline (one count for every
row: ``glm5_dsa_jax.cache.rollback``).

On a CPU a 16-bit float (or fp8) cache stores the latent rows and pooled keys as their bits
(``latent_store`` / ``pooled_store``; ``glm5_dsa_jax.cpu_policy``'s bit storage says which
and why); ``cache.latent`` / ``cache.pooled`` are the float views (``dtype``, a static
field, says which float) and ``cache.replace(latent=..., pooled=...)`` takes float rows and
stores them. Only this package reads the stored buffers.

This is the contiguous implementation of the cache interface
(``glm5_dsa_jax.cache.interface``): a chunk's slots are ``length .. length + S - 1`` and
the attention reads ``latent`` at the token ids themselves.

The writes (``append_rows``, ``store_pools``) are in place: a step costs what it writes,
not the capacity (see ``write_rows`` and ``write_pools`` for how XLA:CPU is kept from
rewriting the buffers). An overflowing chunk (``fits`` False) writes nothing. Neither
write has a ``lax.cond`` or a loop, so a GPU step has no control flow between its kernels
(issue 46; ``tests/test_step_control_flow.py``): the rows are one ``dynamic_update_slice``
of the new rows where ``fits`` and of what the buffer holds there otherwise (a ``where``
over a ``dynamic_slice`` at the same index), the pools one scatter whose dropped indices
lie past the end. An eager layer call runs as one cached
jitted program (``glm5_dsa_jax.parallel.execution``), so it compiles nothing once a step of
its shapes has run (``tests/test_layer_steps.py`` counts the compilations).

The cache ``dtype`` must be a 16- or 32-bit float or fp8 (``CACHE_DTYPES``): an integer
or bool cache would silently round the activations it holds (``int8`` gave outputs off by
4), and ``float64`` would promote the attention to double.

**fp8 caches** (``glm5_dsa_jax.cache.fp8``): ``latent`` rows and ``pooled`` keys are e4m3 with
float32 scales, ``latent_scale [B, L]`` (one a row) or ``[B, L, G]`` (the static
``latent_format``'s ``G > 1`` groups: a RoPE model's default ``"group"`` layout) and
``pooled_scale [B, P]`` (``None`` for a float cache: nothing else changes for those). Rows are quantised once, in ``append_rows``
and ``store_pools``; the stage of the incomplete pool stays in the compute dtype
(``stage_dtype``), and the kernels dequantise (``index_scores``' and ``sparse_mla``'s scale
arguments). Per slot of capacity at GLM-5.3-Flash dims, kpool 4: 512 latent + 4 scale + 1
validity + (128 + 4) / 4 pooled = 550 bytes (+ the per-batch stage; ``<= 560`` is tested).
Why a NoPE model keeps one scale a row and a RoPE model's ``k_rot`` gets its own:
``glm5_dsa_jax.cache.fp8``'s module doc. On a
CPU the e4m3 buffers hold their bits as ``uint8``, for the reason 16-bit ones hold
``uint16`` (an e4m3 buffer went through f16 around each one-row write, jax 0.10).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

import pallas_kernels as pk
from glm5_dsa_jax.cache.fp8 import (
    FP8, IndexFormat, LatentFormat, check_latent_layout, check_rotate_index, index_format, is_fp8, latent_format,
    quantize_index, quantize_latent_rows, rotate_index_rows,
)
from glm5_dsa_jax.cache.interface import Chunk, PoolWindow
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.cpu_policy import from_store, store_dtype, to_store
from glm5_dsa_jax.cache.rollback import rollback_timeline, stage_width
from pallas_kernels import first_valid

__all__ = [
    "DsaCache", "init_cache", "CACHE_DTYPES", "ContiguousPoolKeys", "append_rows", "write_rows",
    "write_pools", "visible_pools", "live_pool_tiles", "check_fits", "check_cache_dtype",
    "default_stage_dtype", "latent_fp8_format", "index_fp8_format", "store_rows", "window_of", "stored_pools",
    "scatter_rows", "restored_cache", "gathered_pools", "pool_row_bytes",
]

#: The dtypes ``init_cache`` accepts for the latent and pooled-key buffers (``"fp8"`` is an
#: alias of ``float8_e4m3fn``).
CACHE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
_FLOATS = list(CACHE_DTYPES[:3])


def check_cache_dtype(dtype):
    """``jnp.dtype(dtype)`` if it is one of ``CACHE_DTYPES`` (or ``"fp8"``), else
    ``ValueError`` naming ``dtype``."""
    want = f"a 16- or 32-bit float, one of {_FLOATS}, or fp8 ('{FP8.name}', alias 'fp8')"
    if isinstance(dtype, str) and dtype.lower() == "fp8":
        return FP8
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"cache dtype must be {want}; got dtype={dtype!r}") from None
    if dt.name not in CACHE_DTYPES:
        raise ValueError(
            f"cache dtype must be {want}; got dtype={dt.name} (an integer or bool cache would "
            "silently round the latent rows)"
        )
    return dt


@struct.dataclass
class DsaCache:
    """Decode state of one DSA layer (a pytree). Shapes in the field comments; "stored"
    = ``store_dtype(dtype)`` (the bits of a 16-bit float cache on a CPU)."""

    latent_store: jax.Array  # [B, max_length, kv_lora_rank], stored
    key_valid: jax.Array  # [B, max_length] bool
    length: jax.Array  # [] int32, slots written
    pooled_store: jax.Array | None = None  # [B, max_pools, index_head_dim], stored
    pool_valid: jax.Array | None = None  # [B, max_pools] bool
    stage_keys: jax.Array | None = None  # [B, H, index_head_dim]: slots length-H .. length-1
    stage_gate: jax.Array | None = None  # [B, H, index_head_dim] float32
    stage_valid: jax.Array | None = None  # [B, H] bool
    first_key: jax.Array | None = None  # [B] int32
    n_valid: jax.Array | None = None  # [B] int32
    latent_scale: jax.Array | None = None  # [B, max_length(, G)] float32, fp8 caches only
    pooled_scale: jax.Array | None = None  # [B, max_pools(, G)] float32, fp8 caches only
    stage_from: jax.Array | None = None  # [] int32: first slot the stage may hold (rollback)
    dtype: jnp.dtype = struct.field(pytree_node=False, default=jnp.dtype(jnp.bfloat16))
    kpool: int = struct.field(pytree_node=False, default=1)  # KP, the pool size (index_kpool)
    #: fp8 caches: how a latent row is scaled (``fp8.LatentFormat``; None for a float cache)
    latent_format: LatentFormat | None = struct.field(pytree_node=False, default=None)
    #: pooled keys stored Hadamard-rotated, indexer queries rotated by the layer (``fp8``)
    rotate_index: bool = struct.field(pytree_node=False, default=False)
    #: fp8 caches: how a pooled key is stored (``fp8.IndexFormat``; None for a float cache)
    index_format: IndexFormat | None = struct.field(pytree_node=False, default=None)

    #: The fields with a token (slot or pool) axis, axis 1: what a sequence axis splits
    #: (context parallelism, ``parallel.placement``); everything else is per row or scalar.
    TOKEN_AXIS_FIELDS = ("latent_store", "key_valid", "latent_scale", "pooled_store", "pool_valid", "pooled_scale")
    #: The fields every cache has, with or without an indexer or fp8 (a saved cache's check).
    REQUIRED_FIELDS = ("latent_store", "key_valid", "length")

    @property
    def stage_width(self) -> int:
        """``H``: slots the stage keeps, ``max(KP, KP - 1 + max_rollback)`` (0 without an
        indexer); the pipeline reads its last ``KP`` (``glm5_dsa_jax.cache.rollback``)."""
        return 0 if self.stage_keys is None else self.stage_keys.shape[1]

    @property
    def max_rollback(self) -> int | None:
        """Tokens the batch can always take back (``rollback``): ``H - KP + 1``; None (all)
        without an indexer."""
        return None if self.stage_keys is None else self.stage_width - self.kpool + 1

    def rollback(self, n_tokens) -> "DsaCache":
        """Drop the last ``n_tokens`` slots of the batch's one timeline (rejected drafts):
        the cache is as if they had never been appended (``glm5_dsa_jax.cache.rollback``).
        One count for every row: a ``[B]`` array of different counts raises ``ValueError``
        (positions are slots shared by the batch; per-sequence rollback is the paged
        cache's). More slots than written, or past what a row's stage can restore: in an
        eager call ``ValueError`` naming ``n_tokens``, the row and the sizes, nothing
        changed; under jit the cache is returned unchanged. Jit-safe."""
        return rollback_timeline(self, n_tokens)

    @property
    def latent(self) -> jax.Array:
        """``[B, max_length, kv_lora_rank]`` latent rows in the cache ``dtype`` (e4m3 for
        an fp8 cache: times ``latent_scale`` to dequantise)."""
        return from_store(self.latent_store, self.dtype)

    @property
    def pooled(self) -> jax.Array | None:
        """``[B, max_pools, index_head_dim]`` pooled keys in the cache ``dtype`` (None on a
        shared-indexer layer; e4m3 for an fp8 cache: times ``pooled_scale``)."""
        return None if self.pooled_store is None else from_store(self.pooled_store, self.pooled_dtype)

    @property
    def pooled_dtype(self) -> jnp.dtype:
        """The dtype ``pooled`` reads as: the cache dtype, or the fp8 cache's ``index_format``'s
        (e4m3 or int8)."""
        return self.dtype if self.index_format is None else self.index_format.dtype

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    @property
    def batch_size(self) -> int:
        return self.latent_store.shape[0]

    @property
    def max_length(self) -> int:
        return self.latent_store.shape[1]

    @property
    def has_indexer(self) -> bool:
        return self.pooled_store is not None

    @property
    def max_pools(self) -> int:
        return self.pooled_store.shape[1] if self.pooled_store is not None else 0

    def nbytes(self) -> int:
        """Bytes held on devices by this cache."""
        return sum(x.nbytes for x in jax.tree.leaves(self))

    def check(self, cfg: DsaConfig, has_indexer: bool, batch_size: int) -> None:
        """Raise ``ValueError`` unless this cache was made for ``cfg`` and ``batch_size``."""
        want_c = cfg.kv_cache_dim
        lat = self.latent_store
        if lat.ndim != 3 or lat.shape[0] != batch_size or lat.shape[2] != want_c:
            raise ValueError(
                f"cache.latent is {tuple(lat.shape)}; this layer and batch need "
                f"[B={batch_size}, max_length, kv_lora_rank={want_c}] (a cache made for "
                "another config or batch size?)"
            )
        if self.has_indexer != has_indexer:
            what = "a full-indexer" if has_indexer else "a shared-indexer"
            raise ValueError(
                f"cache {'has' if self.has_indexer else 'lacks'} indexer state, but this is "
                f"{what} layer: make the cache with this layer's init_cache"
            )
        if has_indexer:
            h = self.stage_width
            want = (batch_size, h, cfg.index_head_dim)
            if (self.pooled_store.shape[2] != cfg.index_head_dim or self.stage_keys.shape != want
                    or self.kpool != cfg.index_kpool or h < cfg.index_kpool):
                raise ValueError(
                    f"cache indexer state has pooled {tuple(self.pooled_store.shape)}, kpool "
                    f"{self.kpool} and stage {tuple(self.stage_keys.shape)}; this layer needs "
                    f"index_head_dim={cfg.index_head_dim} and index_kpool={cfg.index_kpool}"
                )

    # ------------------------------------------------------------------ the cache interface
    #: ``"xla"`` keeps a contiguous prefill tile's whole score row (``score_pools``): one
    #: selection per query rather than one merge per pool tile. A decode step streams.
    STREAM_PREFILL = False
    #: ``pool_keys().tile`` reads the pool rows it names: never past ``max_pools``.
    TILES_PAST_END = False

    @property
    def chunk_start(self) -> jax.Array:
        """The slot of a chunk's first query: ``length`` (one timeline for the batch)."""
        return self.length

    def check_chunk(self, cfg: DsaConfig, has_indexer: bool, batch: int, mask, prev_topk=None) -> None:
        """``check`` and ``check_fits`` of a chunk of ``mask.shape[1]`` tokens (a concrete
        ``prev_topk`` is checked causal against ``chunk_start`` by the layer's input
        checks, as the batch shares one timeline)."""
        self.check(cfg, has_indexer, batch)
        check_fits(self, mask.shape[1])

    def begin_chunk(self, mask: jax.Array) -> tuple["DsaCache", Chunk]:
        """The chunk's slots ``length .. length + S - 1``, padding included (HF's
        ``DynamicCache`` timeline); a padding query has slot ``-1``. ``fits``: the chunk
        fits ``max_length`` (else nothing is written: only possible under a trace, an eager
        call is refused by ``check_fits``). Nothing is written here."""
        b, s = mask.shape
        length = self.length
        slots = length + jnp.arange(s, dtype=jnp.int32)[None]
        n_vis = None
        if self.n_valid is not None:
            n_vis = self.n_valid[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32)
        return self, Chunk(mask=mask, q_pos=jnp.where(mask, slots, -1),
                           positions=jnp.broadcast_to(slots, (b, s)), n_vis=n_vis,
                           fits=length + s <= self.max_length, start=length)

    def write_latent(self, latent: jax.Array, chunk: Chunk) -> "DsaCache":
        """``append_rows`` of the chunk's rows ``[B, S, CR]`` at its slots."""
        return append_rows(self, latent, chunk.mask, chunk.fits)

    def attention_rows(self) -> tuple[jax.Array, jax.Array | None]:
        """``(latent [B, max_length, CR], latent_scale [B, max_length(, G)] | None)``."""
        return self.latent, self.latent_scale

    def row_slots(self, token_ids: jax.Array) -> jax.Array:
        """Token ids are slots of ``attention_rows``: unchanged."""
        return token_ids

    def pool_window(self, keys: jax.Array, gate: jax.Array, chunk: Chunk) -> PoolWindow:
        """The ``PoolWindow`` of a chunk's indexer keys ``[B, S, D]`` and gate logits: slots
        ``length - KP .. length + S - 1`` (the stage, then the chunk); ``window_of``."""
        return window_of(self, keys, gate, chunk, self.max_length)

    def store_pools(self, window: PoolWindow, pooled: jax.Array, pooled_valid: jax.Array,
                    chunk: Chunk) -> "DsaCache":
        """Write the pools of ``window`` that complete in this chunk, once, and keep the last
        ``H`` slots of the stage's first ``H - KP`` then the window as the new stage (nothing
        when not ``chunk.fits``): ``stored_pools`` on the whole pool buffer."""
        return stored_pools(self, window, pooled, pooled_valid, chunk, max_pools=self.max_pools)

    def live_pools(self, q_pos: jax.Array) -> jax.Array:
        """``[B, Q]`` the pools complete at each query (``visible_pools`` from ``first_key``)."""
        return visible_pools(q_pos, self.first_key[:, None], self.kpool, self.max_pools)

    def pool_keys(self) -> "ContiguousPoolKeys":
        """The pooled keys, ``pool_valid`` and ``first_key``: ``index_scores``' key source."""
        return ContiguousPoolKeys(self.pooled_store, self.pool_valid, self.first_key, self.pooled_scale,
                                  dtype=self.pooled_dtype)

    def pool_origin(self) -> jax.Array:
        """``[B]`` the slot where each row's pool grid starts: ``first_key``."""
        return self.first_key

    def visible_tail(self, pools, n_vis, q_pos, kpool: int) -> jax.Array:
        """``[B, Q, KP - 1]`` each query's visible tail (``pk.visible_tail``: the ``n_vis %
        KP`` valid slots after its last complete pool) without the slots of a selected pool
        (``pools [B, Q, K]``)."""
        first_key = self.first_key
        tail = pk.visible_tail(first_key, n_vis, q_pos, self.key_valid, kpool)
        # With holes in the mask the tail (HF's rule: from first_key + visible - visible %
        # kpool) can fall inside a complete pool that is selected too; drop those ids so no
        # token is attended twice (HF builds a mask from the ids, so it counts such a token
        # once).
        t_pool = jnp.where(tail >= 0, (tail - first_key[:, None, None]) // kpool, -2)
        return jnp.where((t_pool[..., None] == pools[..., None, :]).any(-1), -1, tail)

    def end_chunk(self, chunk: Chunk) -> "DsaCache":
        """``length`` and ``n_valid`` past the chunk (unchanged when it does not fit)."""
        upd = {}
        if self.n_valid is not None:
            upd["n_valid"] = jnp.where(chunk.fits, chunk.n_vis[:, -1], self.n_valid)
        s = chunk.mask.shape[1]
        return self.replace(**upd, length=jnp.where(chunk.fits, chunk.start + s, chunk.start).astype(jnp.int32))


def window_of(cache: DsaCache, keys: jax.Array, gate: jax.Array, chunk: Chunk, max_length: int) -> PoolWindow:
    """``DsaCache.pool_window`` of ``cache`` whose timeline holds ``max_length`` slots
    (``first_key == max_length``: no valid slot yet). A context-parallel shard passes the
    whole timeline's capacity (``parallel.context``), the cache its own."""
    mask = chunk.mask
    kp = cache.kpool
    s = keys.shape[1]
    length, big = cache.length, max_length
    win_start = length - kp
    chunk_first = first_valid(mask)
    first_key = jnp.where(
        cache.first_key < big, cache.first_key,
        jnp.where(chunk_first < s, length + chunk_first, big),
    ).astype(jnp.int32)
    rel = first_key - win_start
    first_pool = jnp.where(first_key >= big, kp + s, jnp.where(rel >= 0, rel, jnp.mod(rel, kp)))
    return PoolWindow(
        keys=jnp.concatenate([cache.stage_keys[:, -kp:], keys.astype(cache.stage_keys.dtype)], axis=1),
        gate=jnp.concatenate([cache.stage_gate[:, -kp:], gate], axis=1),
        valid=jnp.concatenate([cache.stage_valid[:, -kp:], mask], axis=1),
        first_key=first_key,
        first_pool=first_pool.astype(jnp.int32),
    )


def stored_pools(cache: DsaCache, window: PoolWindow, pooled: jax.Array, pooled_valid: jax.Array,
                 chunk: Chunk, *, max_pools: int, pool_offset=0) -> DsaCache:
    """``DsaCache.store_pools`` on a timeline of ``max_pools`` pools of which ``cache``'s
    buffers hold pools ``pool_offset .. pool_offset + cache.max_pools - 1`` (a context-
    parallel shard, ``parallel.context``; the cache itself: 0 and all): the pools of
    ``window`` completing in this chunk are written once, those in the held range only,
    and the last ``H`` slots of the stage's first ``H - KP`` then the window are kept as
    the new stage (nothing when not ``chunk.fits``).

    ``pooled [B, n, D]`` / ``pooled_valid [B, n]`` are ``kpool_compress`` of the window
    from ``window.first_pool``; a pool is new when its last slot lies in the chunk.
    """
    fits = chunk.fits
    kp, h = cache.kpool, cache.stage_width
    s = window.keys.shape[1] - kp
    length = cache.length
    win_start = length - kp
    wfirst, first_key = window.first_pool[:, None], window.first_key
    q = jnp.arange(pooled.shape[1], dtype=jnp.int32)[None]
    last = win_start + wfirst + (q + 1) * kp - 1  # timeline slot of each pool's end
    pool_ids = (win_start + wfirst - first_key[:, None]) // kp + q  # pool id on the grid
    new = (last >= length) & (last < length + s) & (wfirst < kp + s) & fits
    new &= pool_ids < max_pools
    pool_ids = pool_ids - pool_offset  # the held range's own index
    new &= (pool_ids >= 0) & (pool_ids < cache.max_pools)
    pooled = rotate_index_rows(pooled, cache.rotate_index)
    bufs, rows = [cache.pooled_store, cache.pool_valid], [pooled, pooled_valid]
    if cache.is_fp8:  # quantised once, here
        rows[0], scale = quantize_index(pooled, cache.index_format)
        bufs.append(cache.pooled_scale)
        rows.append(scale)
    rows[0] = to_store(rows[0], cache.pooled_dtype, cache.pooled_store.dtype)
    pooled_cache, pool_valid, *scale = write_pools(bufs, rows, pool_ids, new)

    def staged(old, win):  # slots length - H .. length + S - 1, then the last H
        return jnp.where(fits, jnp.concatenate([old[:, :h - kp], win], 1)[:, s:], old)

    return cache.replace(
        pooled_store=pooled_cache,
        pool_valid=pool_valid,
        pooled_scale=scale[0] if scale else None,
        stage_keys=staged(cache.stage_keys, window.keys),
        stage_gate=staged(cache.stage_gate, window.gate),
        stage_valid=staged(cache.stage_valid, window.valid),
        first_key=jnp.where(fits, first_key, cache.first_key),
    )


#: The pool fields (token axis 1, pools) a sequence axis splits; ``gathered_pools`` joins them.
POOL_FIELDS = ("pooled_store", "pool_valid", "pooled_scale")


def gathered_pools(cache: DsaCache, seq_axis: str) -> DsaCache:
    """Inside a ``shard_map`` over ``seq_axis`` whose shards each hold a contiguous range of
    the pools (context parallelism, ``parallel.context``): ``cache`` with its pool fields
    (``POOL_FIELDS``: the pooled keys as stored, their validity, an fp8 cache's scales)
    all-gathered in shard order, i.e. every pool of the timeline as the unsharded cache
    holds them, bit for bit, with ``first_key`` (replicated) as its grid's origin. A view for
    the selection only (``pool_keys``, ``live_pools``; the layer's ``choose_pools``): the
    latent fields stay this shard's. Bytes in per device: ``(cp - 1) / cp`` of the pool
    fields (a pool: ``D`` stored values, a flag, and a scale or ``G`` of them)."""
    return cache.replace(**{
        f: jax.lax.all_gather(getattr(cache, f), seq_axis, axis=1, tiled=True)
        for f in POOL_FIELDS if getattr(cache, f) is not None})


def pool_row_bytes(cache: DsaCache) -> int:
    """Bytes of one pool in the pool fields (``POOL_FIELDS``, as stored): what a pool costs
    to send (``gathered_pools``)."""
    total = 0
    for f in POOL_FIELDS:
        a = getattr(cache, f)
        if a is not None:
            total += a.dtype.itemsize * math.prod(a.shape[2:])
    return total


def store_rows(cache, updates: dict) -> dict:
    """``updates`` (``replace`` keywords) with ``latent=`` / ``pooled=`` (float rows) as the
    stored fields ``latent_store`` / ``pooled_store`` (``cpu_policy.to_store``; an fp8
    cache quantises them and sets ``latent_scale`` / ``pooled_scale`` too). Both caches'
    ``replace`` go through it."""
    for name in ("latent", "pooled"):
        if name in updates:
            store = getattr(cache, name + "_store").dtype
            rows = updates.pop(name)
            if cache.is_fp8:
                rows, updates[name + "_scale"] = (quantize_index(rows, cache.index_format) if name == "pooled"
                                                  else quantize_latent_rows(rows, cache.latent_format))
            updates[name + "_store"] = to_store(rows, cache.pooled_dtype if name == "pooled" else cache.dtype,
                                                store)
    return updates


_replace_fields = DsaCache.replace


def _replace(self, **updates) -> DsaCache:
    """``dataclasses.replace``, where ``latent=`` / ``pooled=`` are float rows (``store_rows``)."""
    return _replace_fields(self, **store_rows(self, updates))


DsaCache.replace = _replace


def restored_cache(arrays: dict, **statics) -> DsaCache:
    """The ``DsaCache`` of its fields ``arrays`` (a checkpoint's, ``orbax_io.restore_cache``)
    and static fields ``statics``, the latent and pooled rows in this platform's stored
    dtype: another platform's stored form (a CPU keeps bfloat16 as ``uint16`` bits,
    ``cpu_policy``) is converted, the values unchanged."""
    probe = DsaCache(**arrays, **statics)
    arrays = dict(arrays)
    for k, float_dtype in (("latent_store", probe.dtype), ("pooled_store", probe.pooled_dtype)):
        if arrays.get(k) is not None and arrays[k].dtype != store_dtype(float_dtype):
            arrays[k] = to_store(from_store(arrays[k], float_dtype), float_dtype, store_dtype(float_dtype))
    return DsaCache(**arrays, **statics)


def check_fits(cache: DsaCache, s: int, length=None) -> None:
    """Raise ``ValueError`` when a chunk of ``s`` tokens does not fit ``cache`` after
    ``length`` used slots (default ``cache.length``; not checked while traced): the layer
    call and ``decode.DsaDecoder`` (its host mirror of the length) refuse it, unwritten."""
    length = cache.length if length is None else length
    if not isinstance(length, jax.core.Tracer) and int(length) + s > cache.max_length:
        raise ValueError(f"chunk of {s} tokens does not fit the cache: {int(length)} of "
                         f"{cache.max_length} slots are used; nothing was written")


def init_cache(
    cfg: DsaConfig,
    batch_size: int,
    max_length: int,
    *,
    has_indexer: bool = True,
    dtype=jnp.bfloat16,
    stage_dtype=None,
    max_rollback: int = 1,
    latent_layout: str = "group",
    rotate_index: bool = False,
    index_keys: str = "e4m3",
) -> DsaCache:
    """An empty cache for ``batch_size`` sequences of up to ``max_length`` slots.

    ``dtype`` (of the latent and pooled keys) must be one of ``CACHE_DTYPES`` or ``"fp8"``;
    anything else raises ``ValueError`` naming ``dtype``. ``stage_dtype``: the compute dtype
    an fp8 cache stages the incomplete pool's keys in (default bfloat16; the layer passes
    its own); a float cache stages in its ``dtype`` and ignores it. ``max_rollback`` (static,
    an int >= 0): slots the batch can always take back (``DsaCache.rollback``); the stage
    keeps ``max(KP, KP - 1 + max_rollback)`` slots. ``latent_layout`` (static, fp8 only):
    ``"group"`` (default) or ``"row"``, how an fp8 latent row is scaled (``latent_fp8_format``).
    ``rotate_index`` (static, default off): store Hadamard-rotated pooled keys, the layer
    rotating its indexer queries (``glm5_dsa_jax.cache.fp8``; needs a power-of-two
    ``index_head_dim``). ``index_keys`` (static, fp8 only): ``"e4m3"`` (default, one scale a
    pooled key) or ``"int8"`` (a scale per 32 columns; with ``rotate_index=True`` the
    format that keeps the indexer's recall >= 0.99 at 32K, ``glm5_dsa_jax.cache.fp8``).
    """
    dtype = check_cache_dtype(dtype)
    ifmt = index_fp8_format(cfg, dtype, index_keys)
    fmt = latent_fp8_format(cfg, dtype, latent_layout)
    stage_dtype = default_stage_dtype(dtype, stage_dtype)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if max_length > cfg.max_position_embeddings:
        raise ValueError(
            f"max_length {max_length} exceeds max_position_embeddings "
            f"{cfg.max_position_embeddings}"
        )
    b = batch_size
    st = store_dtype(dtype)
    h = stage_width(cfg.index_kpool, max_rollback)
    base = dict(
        latent_store=jnp.zeros((b, max_length, cfg.kv_cache_dim), st),
        key_valid=jnp.zeros((b, max_length), bool),
        length=jnp.zeros((), jnp.int32),
        latent_scale=None if fmt is None else jnp.ones((b, max_length, *fmt.scale_shape), jnp.float32),
        dtype=dtype,
        kpool=cfg.index_kpool,
        latent_format=fmt,
    )
    if not has_indexer:
        return DsaCache(**base)
    kp, d = cfg.index_kpool, cfg.index_head_dim
    max_pools = max(1, max_length // kp)
    return DsaCache(
        **base,
        rotate_index=check_rotate_index(d, rotate_index),
        index_format=ifmt,
        pooled_store=jnp.zeros((b, max_pools, d), st if ifmt is None else store_dtype(ifmt.dtype)),
        pooled_scale=None if ifmt is None else jnp.ones((b, max_pools, *ifmt.scale_shape), jnp.float32),
        pool_valid=jnp.zeros((b, max_pools), bool),
        stage_keys=jnp.zeros((b, h, d), stage_dtype),
        stage_gate=jnp.zeros((b, h, d), jnp.float32),
        stage_valid=jnp.zeros((b, h), bool),
        first_key=jnp.full((b,), max_length, jnp.int32),
        n_valid=jnp.zeros((b,), jnp.int32),
        stage_from=jnp.zeros((), jnp.int32),
    )


def latent_fp8_format(cfg: DsaConfig, dtype, latent_layout: str = "group") -> LatentFormat | None:
    """The ``fp8.LatentFormat`` of a cache of ``dtype`` for ``cfg`` (None for a float cache):
    ``latent_layout="group"`` scales each 128 latent columns and ``k_rot`` apart on a RoPE
    model and keeps one scale a row on a NoPE one (``fp8.latent_format``); ``"row"`` keeps
    one scale for the whole ``[c, k_rot]`` row (the layout before group scales, for
    before/after figures). Any other ``latent_layout`` raises ``ValueError`` naming it."""
    check_latent_layout(latent_layout)
    if not is_fp8(dtype):
        return None
    return latent_format(cfg.kv_lora_rank, cfg.qk_rope_head_dim, latent_layout)


def index_fp8_format(cfg: DsaConfig, dtype, index_keys: str = "e4m3") -> IndexFormat | None:
    """The ``fp8.IndexFormat`` of a cache of ``dtype`` for ``cfg`` (None for a float cache);
    ``ValueError`` naming ``index_keys`` unless it is one of ``fp8.INDEX_KEY_FORMATS``."""
    fmt = index_format(cfg.index_head_dim, index_keys)
    return fmt if is_fp8(dtype) else None


def default_stage_dtype(dtype, stage_dtype=None) -> jnp.dtype:
    """The stage's dtype: a float cache's own ``dtype``; for an fp8 cache ``stage_dtype`` (a
    float of ``_FLOATS``), bfloat16 when None (its stage stays in a compute dtype)."""
    if not is_fp8(dtype):
        return jnp.dtype(dtype)
    if stage_dtype is None:
        return jnp.dtype(jnp.bfloat16)
    dt = jnp.dtype(stage_dtype)
    if dt.name not in _FLOATS:
        raise ValueError(f"stage_dtype must be one of {_FLOATS}, got {dt.name}")
    return dt


# ---------------------------------------------------------------------------- in-place writes
def _write_where(buf, ok, rows, idx):
    """``buf`` with ``rows`` written at ``idx`` (non-negative) where ``ok`` (broadcast over
    ``rows``' trailing axes), in place: ``dynamic_update_slice(buf, where(ok, rows,
    dynamic_slice(buf, idx)), idx)``. The slice is clamped as the update is, so the rows
    not written are written back unchanged. Both take the index values as given
    (``allow_negative_indices=False``: no wrap of negative indices, which jax emits per op),
    so the slice and the update share one index computation."""
    old = jax.lax.dynamic_slice(buf, idx, rows.shape, allow_negative_indices=False)
    ok = jnp.reshape(ok, jnp.shape(ok) + (1,) * (rows.ndim - jnp.ndim(ok)))
    return jax.lax.dynamic_update_slice(buf, jnp.where(ok, rows, old), idx, allow_negative_indices=False)


def write_rows(buf: jax.Array, rows: jax.Array, start: jax.Array, fits: jax.Array) -> jax.Array:
    """``buf[:, start:start+S] = rows`` in place, or nothing at all when not ``fits``.

    One ``dynamic_update_slice`` of ``where(fits, rows, dynamic_slice(buf))`` at one clamped
    index: no control flow (a ``lax.cond`` here was a conditional, with its predicate read on
    the host, in every GPU step: issue 46), and still in place on XLA:CPU and GPU (a masked
    scatter or a ``where`` over the whole buffer made XLA:CPU rewrite or copy it, an
    O(cache) pass per step). ``buf`` of a 16-bit float cache holds bits (``uint16``):
    XLA:CPU on jax 0.10 converts a bf16 buffer to float32 and back around the update.
    """
    zero = jnp.zeros((), jnp.int32)
    idx = (zero, jnp.asarray(start, jnp.int32)) + (zero,) * (buf.ndim - 2)
    rows = rows.astype(buf.dtype)
    return _write_where(buf, fits, rows, idx)


def write_pools(bufs: tuple, rows: tuple, pool_ids, new) -> tuple:
    """``buf[b, pool_ids[b, i]] = row[b, i]`` where ``new[b, i]``, for each ``buf [B, P,
    ...]`` of ``bufs`` and its ``row [B, n, ...]`` of ``rows`` (the keys, their validity, the
    fp8 scales).

    One scatter a buffer whose indices are ``P`` (past the end: dropped) where not ``new``:
    in place on XLA:CPU and GPU (the keys' buffer holds the bits of an 8- or 16-bit float
    cache on a CPU, see the module doc: XLA:CPU has no 16-bit-float scatter and converted a
    whole bf16 ``[B, max_pools, D]`` buffer to float32 and back around one), with no control
    flow (before issue 46 a ``fori_loop`` of ``lax.cond``-guarded ``dynamic_update_slice``s:
    a loop and a conditional in every GPU step). Not ``write_rows``' form row by row: XLA:CPU
    fused the last row's update into the scoring's read of the buffer and copied the whole
    buffer twice a step from batch 2 on (``tests/test_step_control_flow.py``). One row's
    one pool (a batch-1 decode step) is that form, though: XLA:GPU rewrote its one-index
    scatter as the same update plus a reduce that checks the index, one kernel more a step
    (deviceless H200 compile, 2026-12-07), and a CPU keeps it in place at one row.
    """
    b, n = pool_ids.shape
    size = bufs[0].shape[1]
    if b == n == 1:  # one row's one pool (a batch-1 decode step): write_rows' form
        idx = jnp.clip(pool_ids[0, 0], 0, size - 1).astype(jnp.int32)
        return tuple(_write_where(buf, new[0, 0], row.astype(buf.dtype), (0, idx) + (0,) * (buf.ndim - 2))
                     for buf, row in zip(bufs, rows))
    r = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, n))
    p = jnp.where(new, pool_ids, size).astype(jnp.int32)  # past the end: dropped
    return tuple(buf.at[r, p].set(row.astype(buf.dtype), mode="drop") for buf, row in zip(bufs, rows))


def append_rows(cache: DsaCache, latent: jax.Array, mask: jax.Array, fits) -> DsaCache:
    """The chunk's latent rows ``[B, S, C]`` and validity ``[B, S]`` written at slots
    ``length .. length+S-1`` (nothing when not ``fits``); ``length`` is not moved here. An
    fp8 cache quantises the rows here, once, and writes their scales."""
    upd = {}
    if cache.is_fp8:
        latent, scale = quantize_latent_rows(latent, cache.latent_format)
        upd["latent_scale"] = write_rows(cache.latent_scale, scale, cache.length, fits)
    return cache.replace(
        latent_store=write_rows(
            cache.latent_store, to_store(latent, cache.dtype, cache.latent_store.dtype),
            cache.length, fits),
        key_valid=write_rows(cache.key_valid, mask, cache.length, fits),
        **upd,
    )


def _scatter(buf, rows, slots, fits):
    size = buf.shape[1]
    idx = jnp.where((slots >= 0) & fits, slots, size)  # past the end: dropped
    return buf.at[:, idx].set(rows.astype(buf.dtype), mode="drop")


def scatter_rows(cache: DsaCache, latent: jax.Array, mask: jax.Array, slots: jax.Array, fits) -> DsaCache:
    """``append_rows`` for one shard of a cache whose slots are split over devices (context
    parallelism, ``glm5_dsa_jax.parallel.context``): the chunk's rows ``[B, S, C]`` and
    validity ``[B, S]`` written at this shard's own slots ``slots [S]`` (``-1``: a slot
    another shard holds), nothing when not ``fits``; an fp8 cache quantises the rows here,
    once. A scatter whose indices past the end are dropped: unlike ``write_rows`` it may
    rewrite the shard's buffer on XLA:CPU (an ``O(L / cp)`` pass per step)."""
    upd = {}
    if cache.is_fp8:
        latent, scale = quantize_latent_rows(latent, cache.latent_format)
        upd["latent_scale"] = _scatter(cache.latent_scale, scale, slots, fits)
    return cache.replace(
        latent_store=_scatter(cache.latent_store, to_store(latent, cache.dtype, cache.latent_store.dtype), slots, fits),
        key_valid=_scatter(cache.key_valid, mask, slots, fits),
        **upd,
    )


# ---------------------------------------------------------------------------- live pools
def visible_pools(q_pos: jax.Array, first_key, kpool: int, limit) -> jax.Array:
    """``[B, Q]`` int32: the pools complete at each query, ``(q_pos - first_key + 1) //
    KP`` clipped to ``[0, limit]`` (``q_pos [B, Q]``, ``-1`` = padding: 0 pools). A pool
    ``p`` is a candidate only when its last slot ``first_key + (p+1)*KP - 1`` is at or
    before the query (``pallas_kernels.index_scores``), so no pool past this count needs to
    be read. The one home of that rule: ``first_key`` is the contiguous cache's
    ``first_key[:, None]`` and 0 on a paged cache (positions from 0); ``limit`` the cache's
    ``max_pools`` or a paged row's pool count."""
    return jnp.clip((q_pos - first_key + 1) // kpool, 0, limit)


def live_pool_tiles(n_live: jax.Array, tile: int) -> jax.Array:
    """``[]`` int32: tiles of ``tile`` pools up to the batch's latest complete pool
    (``n_live``: ``visible_pools``), past which every pool scores ``-inf`` and is not read."""
    return ((jnp.max(n_live) + tile - 1) // tile).astype(jnp.int32)


@struct.dataclass
class ContiguousPoolKeys:
    """The key source of index scoring on a contiguous cache (``interface.PooledKeys``):
    pools ``[B, max_pools, D]`` (stored), ``pool_valid [B, max_pools]``, ``first_key [B]``
    and the fp8 scales ``[B, max_pools]`` (or None)."""

    stored: jax.Array
    pool_valid: jax.Array
    first_key: jax.Array
    scale: jax.Array | None
    dtype: jnp.dtype = struct.field(pytree_node=False, default=jnp.dtype(jnp.bfloat16))

    @property
    def kernel(self):
        """``pk.index_scores``: the scoring wrapper for this key source (looked up at the call)."""
        return pk.index_scores

    def operands(self) -> tuple:
        """``(pooled keys, pool_valid, first_key)``: ``index_scores``' key operands."""
        return from_store(self.stored, self.dtype), self.pool_valid, self.first_key

    def tile(self, start, tile: int, kpool: int) -> tuple:
        """Pools ``start .. start + tile - 1``: only that slice of the keys (and of their
        fp8 scales) is read (and converted from bits). The slice's pool grid starts
        ``start`` pools after ``first_key``, so its candidate rule is the whole row's."""
        keys = from_store(jax.lax.dynamic_slice_in_dim(self.stored, start, tile, axis=1), self.dtype)
        valid = jax.lax.dynamic_slice_in_dim(self.pool_valid, start, tile, axis=1)
        scale = None if self.scale is None else jax.lax.dynamic_slice_in_dim(self.scale, start, tile, axis=1)
        return keys, valid, self.first_key + start * kpool, scale
