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
  of pool ``p`` arrives, and never recomputed. Only the last ``index_kpool`` tokens' keys
  and gate logits (``stage_*``, the tokens an incomplete pool may still need) are kept
  per token. Per token that is ``kv_cache_dim`` row values, one validity byte and
  ``index_head_dim / index_kpool`` pooled values: 1,089 bytes in bf16 at GLM-5.3-Flash
  dims and kpool 4 (HF keeps the latent and every raw indexer key, 1,538 bytes).
* ``first_key[b]`` is the first valid slot, ``max_length`` until one arrives;
  ``n_valid[b]`` counts the valid slots written.
* Shared-indexer layers hold no indexer state (those fields are ``None``).

Shapes never depend on ``length``, so one compiled step serves every step of a decode.

On a CPU a 16-bit float cache stores the latent rows and pooled keys as their bits
(``uint16``; ``latent_store`` / ``pooled_store``), and ``cache.latent`` / ``cache.pooled``
are the float views (``dtype``, a static field, says which float). Why: XLA:CPU on jax 0.10
converted a whole bf16 buffer to float32 and back around every one-row
``dynamic_update_slice`` (a 131,072-slot latent: ~25 ms a step per sequence), whereas a
``uint16`` buffer is written in place. Writing through a ``uint16`` view of a bf16 buffer does not help (XLA
copies the buffer for the bitcasts), so the buffer itself must hold the bits. A float32
cache, and any cache made while the default backend is not a CPU, is stored as is: only
XLA:CPU needs the bits, and a Pallas kernel handed a bitcast view of a whole buffer could
be given a copy of it. ``cache.replace(latent=..., pooled=...)`` takes float rows and
stores their bits.

The writes (``append_rows``, ``store_pools``) are in place: a step costs what it writes,
not the capacity (see ``write_rows`` and ``write_pools`` for how XLA:CPU is kept from
rewriting the buffers). An overflowing chunk (``fits`` False) writes nothing. Every
``lax.cond`` / ``fori_loop`` body here is a module-level function that receives every array
it reads as an operand: jax caches a traced body by the function and its operands' types,
so a closure made anew per call over that call's arrays misses the cache, and an eager
decode step (a layer call with a cache, outside jit) compiled three XLA programs on every
step. The rest of an eager step follows the same rule (``glm5_dsa_jax.parallel``,
``ops.by_query_tiles``), so it compiles nothing once a step of its shapes has run
(``tests/test_layer_steps.py`` counts the compilations).

The cache ``dtype`` must be a 16- or 32-bit float or fp8 (``CACHE_DTYPES``): an integer
or bool cache would silently round the activations it holds (``int8`` gave outputs off by
4), and ``float64`` would promote the attention to double.

**fp8 caches** (``glm5_dsa_jax.fp8``): ``latent`` rows and ``pooled`` keys are e4m3 with one
float32 scale per row, ``latent_scale [B, L]`` and ``pooled_scale [B, P]`` (``None`` for a
float cache: nothing else changes for those). Rows are quantised once, in ``append_rows``
and ``store_pools``; the stage of the incomplete pool stays in the compute dtype
(``stage_dtype``), and the kernels dequantise (``index_scores``' and ``sparse_mla``'s scale
arguments). Per slot of capacity at GLM-5.3-Flash dims, kpool 4: 512 latent + 4 scale + 1
validity + (128 + 4) / 4 pooled = 550 bytes (+ the per-batch stage; ``<= 560`` is tested).
Why a scale per row and not per 128-wide group: ``glm5_dsa_jax.fp8``'s module doc. On a
CPU the e4m3 buffers hold their bits as ``uint8``, for the reason 16-bit ones hold
``uint16`` (an e4m3 buffer went through f16 around each one-row write, jax 0.10).
"""

from __future__ import annotations

import functools

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from glm5_dsa_jax.config import DsaConfig
from glm5_dsa_jax.fp8 import FP8, is_fp8, quantize_rows
from glm5_dsa_jax.steps import SCORE_POOLS
import pallas_kernels as pk
from pallas_kernels import first_valid

__all__ = [
    "DsaCache", "init_cache", "CACHE_DTYPES", "PoolWindow", "pool_window", "store_pools",
    "append_rows", "write_rows", "write_pools", "store_dtype", "to_store", "from_store",
    "visible_pools", "live_pool_tiles", "check_fits", "default_stage_dtype",
    "pool_tile_scores", "pool_tile_scorer",
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


def store_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype a cache of float ``dtype`` stores its rows in on ``platform`` (default:
    jax's default backend): on a CPU ``uint16`` for a 16-bit float and ``uint8`` for fp8
    (see the module doc), else ``dtype``."""
    dtype = jnp.dtype(dtype)
    platform = jax.default_backend() if platform is None else platform
    bits = {1: jnp.uint8, 2: jnp.uint16}.get(dtype.itemsize)
    return jnp.dtype(bits) if bits is not None and platform == "cpu" else dtype


def to_store(x: jax.Array, dtype, store) -> jax.Array:
    """Float rows ``x`` as a cache of float ``dtype`` whose buffer has dtype ``store``
    keeps them (a cast to ``dtype``, then its bits when ``store`` is ``uint16``)."""
    x = jnp.asarray(x).astype(dtype)
    store = jnp.dtype(store)
    return x if store == x.dtype else jax.lax.bitcast_convert_type(x, store)


def from_store(a: jax.Array, dtype) -> jax.Array:
    """Stored rows ``a`` as floats of ``dtype`` (a bitcast for a 8- or 16-bit float cache)."""
    dtype = jnp.dtype(dtype)
    return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)


@struct.dataclass
class DsaCache:
    """Decode state of one DSA layer (a pytree). Shapes in the field comments; "stored"
    = ``store_dtype(dtype)`` (the bits of a 16-bit float cache on a CPU)."""

    latent_store: jax.Array  # [B, max_length, kv_lora_rank], stored
    key_valid: jax.Array  # [B, max_length] bool
    length: jax.Array  # [] int32, slots written
    pooled_store: jax.Array | None = None  # [B, max_pools, index_head_dim], stored
    pool_valid: jax.Array | None = None  # [B, max_pools] bool
    stage_keys: jax.Array | None = None  # [B, KP, index_head_dim]: slots length-KP .. length-1
    stage_gate: jax.Array | None = None  # [B, KP, index_head_dim] float32
    stage_valid: jax.Array | None = None  # [B, KP] bool
    first_key: jax.Array | None = None  # [B] int32
    n_valid: jax.Array | None = None  # [B] int32
    latent_scale: jax.Array | None = None  # [B, max_length] float32, fp8 caches only
    pooled_scale: jax.Array | None = None  # [B, max_pools] float32, fp8 caches only
    dtype: jnp.dtype = struct.field(pytree_node=False, default=jnp.dtype(jnp.bfloat16))

    @property
    def latent(self) -> jax.Array:
        """``[B, max_length, kv_lora_rank]`` latent rows in the cache ``dtype`` (e4m3 for
        an fp8 cache: times ``latent_scale`` to dequantise)."""
        return from_store(self.latent_store, self.dtype)

    @property
    def pooled(self) -> jax.Array | None:
        """``[B, max_pools, index_head_dim]`` pooled keys in the cache ``dtype`` (None on a
        shared-indexer layer; e4m3 for an fp8 cache: times ``pooled_scale``)."""
        return None if self.pooled_store is None else from_store(self.pooled_store, self.dtype)

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
            want = (batch_size, cfg.index_kpool, cfg.index_head_dim)
            if self.pooled_store.shape[2] != cfg.index_head_dim or self.stage_keys.shape != want:
                raise ValueError(
                    f"cache indexer state has pooled {tuple(self.pooled_store.shape)} and stage "
                    f"{tuple(self.stage_keys.shape)}; this layer needs index_head_dim="
                    f"{cfg.index_head_dim} and index_kpool={cfg.index_kpool}"
                )


_replace_fields = DsaCache.replace


def _replace(self, **updates) -> DsaCache:
    """``dataclasses.replace``, where ``latent=`` / ``pooled=`` (float rows) are stored as
    ``latent_store`` / ``pooled_store`` (``to_store``; an fp8 cache quantises them and sets
    ``latent_scale`` / ``pooled_scale`` too)."""
    for name in ("latent", "pooled"):
        if name in updates:
            store = getattr(self, name + "_store").dtype
            rows = updates.pop(name)
            if self.is_fp8:
                rows, updates[name + "_scale"] = quantize_rows(rows)
            updates[name + "_store"] = to_store(rows, self.dtype, store)
    return _replace_fields(self, **updates)


DsaCache.replace = _replace


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
) -> DsaCache:
    """An empty cache for ``batch_size`` sequences of up to ``max_length`` slots.

    ``dtype`` (of the latent and pooled keys) must be one of ``CACHE_DTYPES`` or ``"fp8"``;
    anything else raises ``ValueError`` naming ``dtype``. ``stage_dtype``: the compute dtype
    an fp8 cache stages the incomplete pool's keys in (default bfloat16; the layer passes
    its own); a float cache stages in its ``dtype`` and ignores it.
    """
    dtype = check_cache_dtype(dtype)
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
    base = dict(
        latent_store=jnp.zeros((b, max_length, cfg.kv_cache_dim), st),
        key_valid=jnp.zeros((b, max_length), bool),
        length=jnp.zeros((), jnp.int32),
        latent_scale=jnp.ones((b, max_length), jnp.float32) if is_fp8(dtype) else None,
        dtype=dtype,
    )
    if not has_indexer:
        return DsaCache(**base)
    kp, d = cfg.index_kpool, cfg.index_head_dim
    max_pools = max(1, max_length // kp)
    return DsaCache(
        **base,
        pooled_store=jnp.zeros((b, max_pools, d), st),
        pooled_scale=jnp.ones((b, max_pools), jnp.float32) if is_fp8(dtype) else None,
        pool_valid=jnp.zeros((b, max_pools), bool),
        stage_keys=jnp.zeros((b, kp, d), stage_dtype),
        stage_gate=jnp.zeros((b, kp, d), jnp.float32),
        stage_valid=jnp.zeros((b, kp), bool),
        first_key=jnp.full((b,), max_length, jnp.int32),
        n_valid=jnp.zeros((b,), jnp.int32),
    )


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
def _update_slice(buf, rows, idx):
    return jax.lax.dynamic_update_slice(buf, rows, idx)


def _keep(buf, *_):
    return buf


def write_rows(buf: jax.Array, rows: jax.Array, start: jax.Array, fits: jax.Array) -> jax.Array:
    """``buf[:, start:start+S] = rows`` in place, or nothing at all when not ``fits``.

    ``lax.cond`` over a ``dynamic_update_slice`` rather than a masked scatter or a ``where``
    over the old rows: both of those made XLA:CPU rewrite (or copy) the whole buffer, an
    O(cache) pass per step. ``buf`` of a 16-bit float cache holds bits (``uint16``): XLA:CPU
    on jax 0.10 converts a bf16 buffer to float32 and back around the update.
    """
    zero = jnp.zeros((), jnp.int32)
    idx = (zero, start) + (zero,) * (buf.ndim - 2)
    return jax.lax.cond(fits, _update_slice, _keep, buf, rows.astype(buf.dtype), idx)


def _write_pool(bufs, rows, pool_ids, r, j):
    p, zero = pool_ids[r, j], jnp.zeros((), jnp.int32)
    return tuple(
        jax.lax.dynamic_update_slice(buf, row[r, j][None, None], (r, p) + (zero,) * (buf.ndim - 2))
        for buf, row in zip(bufs, rows))


def _write_pool_step(i, carry):
    bufs, rows, pool_ids, new = carry
    n = pool_ids.shape[1]
    r, j = i // n, i % n
    bufs = jax.lax.cond(new[r, j], _write_pool, _keep, bufs, rows, pool_ids, r, j)
    return bufs, rows, pool_ids, new


def write_pools(bufs: tuple, rows: tuple, pool_ids, new) -> tuple:
    """``buf[b, pool_ids[b, i]] = row[b, i]`` where ``new[b, i]``, for each ``buf [B, P,
    ...]`` of ``bufs`` and its ``row [B, n, ...]`` of ``rows`` (the keys, their validity, the
    fp8 scales).

    One ``cond``-guarded ``dynamic_update_slice`` per (row, window pool): in place (the
    keys' buffer holds the bits of an 8- or 16-bit float cache, see the module doc). A
    masked scatter is the natural form, but XLA:CPU has no 16-bit-float scatter and
    converts the whole ``[B, max_pools, D]`` cache to float32 and back around it on every
    step.
    """
    b, n = pool_ids.shape
    rows = tuple(row.astype(buf.dtype) for buf, row in zip(bufs, rows))
    bufs, *_ = jax.lax.fori_loop(0, b * n, _write_pool_step, (tuple(bufs), rows, pool_ids, new))
    return bufs


def append_rows(cache: DsaCache, latent: jax.Array, mask: jax.Array, fits) -> DsaCache:
    """The chunk's latent rows ``[B, S, C]`` and validity ``[B, S]`` written at slots
    ``length .. length+S-1`` (nothing when not ``fits``); ``length`` is not moved here. An
    fp8 cache quantises the rows here, once, and writes their scales."""
    upd = {}
    if cache.is_fp8:
        latent, scale = quantize_rows(latent)
        upd["latent_scale"] = write_rows(cache.latent_scale, scale, cache.length, fits)
    return cache.replace(
        latent_store=write_rows(
            cache.latent_store, to_store(latent, cache.dtype, cache.latent_store.dtype),
            cache.length, fits),
        key_valid=write_rows(cache.key_valid, mask, cache.length, fits),
        **upd,
    )


class PoolWindow(NamedTuple):
    """The slots of the timeline that hold every slot of any pool completing in a chunk
    of ``S`` tokens: the last ``KP`` slots before the chunk (the cache's ``stage_*``) then
    the chunk, i.e. slots ``length - KP .. length + S - 1``.

    ``keys [B, KP+S, D]`` (cache dtype), ``gate [B, KP+S, D]`` float32, ``valid [B, KP+S]``;
    ``first_key [B]`` the row's first valid slot after this chunk (``max_length`` while
    none); ``first_pool [B]`` int32, the window offset where the first whole pool on
    ``first_key``'s pool grid starts (``KP + S`` when the row has no valid slot yet): what
    ``kpool_compress`` takes as its ``first_key``.
    """

    keys: jax.Array
    gate: jax.Array
    valid: jax.Array
    first_key: jax.Array
    first_pool: jax.Array


def pool_window(cache: DsaCache, keys: jax.Array, gate: jax.Array, mask: jax.Array) -> PoolWindow:
    """The ``PoolWindow`` of a chunk's indexer keys ``[B, S, D]``, gate logits ``[B, S, D]``
    and mask ``[B, S]``."""
    kp = cache.stage_keys.shape[1]
    s = keys.shape[1]
    length, big = cache.length, cache.max_length
    win_start = length - kp
    chunk_first = first_valid(mask)
    first_key = jnp.where(
        cache.first_key < big, cache.first_key,
        jnp.where(chunk_first < s, length + chunk_first, big),
    ).astype(jnp.int32)
    rel = first_key - win_start
    first_pool = jnp.where(first_key >= big, kp + s, jnp.where(rel >= 0, rel, jnp.mod(rel, kp)))
    return PoolWindow(
        keys=jnp.concatenate([cache.stage_keys, keys.astype(cache.stage_keys.dtype)], axis=1),
        gate=jnp.concatenate([cache.stage_gate, gate], axis=1),
        valid=jnp.concatenate([cache.stage_valid, mask], axis=1),
        first_key=first_key,
        first_pool=first_pool.astype(jnp.int32),
    )


def store_pools(cache: DsaCache, window: PoolWindow, pooled: jax.Array, pooled_valid: jax.Array,
                fits) -> DsaCache:
    """Write the pools of ``window`` that complete in this chunk into the cache, once, and
    keep the window's last ``KP`` slots as the new stage (nothing when not ``fits``).

    ``pooled [B, n, D]`` / ``pooled_valid [B, n]`` are ``kpool_compress`` of the window
    from ``window.first_pool``; a pool is new when its last slot lies in the chunk.
    """
    kp = cache.stage_keys.shape[1]
    s = window.keys.shape[1] - kp
    length = cache.length
    win_start = length - kp
    wfirst, first_key = window.first_pool[:, None], window.first_key
    q = jnp.arange(pooled.shape[1], dtype=jnp.int32)[None]
    last = win_start + wfirst + (q + 1) * kp - 1  # timeline slot of each pool's end
    pool_ids = (win_start + wfirst - first_key[:, None]) // kp + q  # pool id on the grid
    new = (last >= length) & (last < length + s) & (wfirst < kp + s) & fits
    new &= pool_ids < cache.max_pools
    bufs, rows = [cache.pooled_store, cache.pool_valid], [pooled, pooled_valid]
    if cache.is_fp8:  # quantised once, here
        rows[0], scale = quantize_rows(pooled)
        bufs.append(cache.pooled_scale)
        rows.append(scale)
    rows[0] = to_store(rows[0], cache.dtype, cache.pooled_store.dtype)
    pooled_cache, pool_valid, *scale = write_pools(bufs, rows, pool_ids, new)
    return cache.replace(
        pooled_store=pooled_cache,
        pool_valid=pool_valid,
        pooled_scale=scale[0] if scale else None,
        stage_keys=jnp.where(fits, window.keys[:, s:], cache.stage_keys),
        stage_gate=jnp.where(fits, window.gate[:, s:], cache.stage_gate),
        stage_valid=jnp.where(fits, window.valid[:, s:], cache.stage_valid),
        first_key=jnp.where(fits, first_key, cache.first_key),
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


def pool_tile_scores(start, qi, w, pooled_store, pool_valid, first_key, q_pos, pooled_scale=None, *,
                     tile: int, kpool: int, dtype, score_fn) -> jax.Array:
    """``[B, Q, tile]`` float32 scores (``score_fn``, ``index_scores``'s signature) of pools
    ``start .. start + tile - 1`` of the cache: only that slice of the pooled keys (and of
    their fp8 scales) is read (and converted from bits). The pool grid of the slice starts
    ``start`` pools after ``first_key``, so its candidate rule is the whole row's."""
    keys = from_store(jax.lax.dynamic_slice_in_dim(pooled_store, start, tile, axis=1), dtype)
    valid = jax.lax.dynamic_slice_in_dim(pool_valid, start, tile, axis=1)
    scale = None if pooled_scale is None else jax.lax.dynamic_slice_in_dim(pooled_scale, start, tile, axis=1)
    return score_fn(qi, w, keys, valid, first_key + start * kpool, q_pos, scale, kpool=kpool)


@functools.lru_cache(maxsize=None)
def pool_tile_scorer(tile: int, kpool: int, dtype):
    """The ``index_scores`` of one pool tile (``pool_tile_scores``), one function per
    statics so the eager ``while_loop`` trace is cached (see ``pk.streaming_topk``)."""

    def scores(start, *operands):
        with jax.named_scope(SCORE_POOLS):
            return pool_tile_scores(start, *operands, tile=tile, kpool=kpool, dtype=dtype,
                                    score_fn=pk.index_scores_reference)

    return scores
