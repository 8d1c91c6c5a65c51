"""The per-layer decode state: the MLA latent cache and the indexer's pooled-key cache.

Invariants:

* All sequences of a batch share one timeline: slot ``i`` of every row is the ``i``-th
  token fed to the layer, padding included (as in Hugging Face's ``DynamicCache``).
  ``length`` is the number of slots written; token ids in a top-k row are slots.
* ``latent[b, i]`` is ``kv_a_layernorm(kv_a_proj(x_i))``, the only per-token
  tensor attention reads; ``key_valid[b, i]`` is False for padding.
* The indexer keeps *pooled* keys: ``pooled[b, p]`` is written once, when the last token
  of pool ``p`` arrives, and never recomputed. Only the last ``index_kpool`` tokens' keys
  and gate logits (``stage_*``, the tokens an incomplete pool may still need) are kept
  per token. Per token that is ``kv_lora_rank`` latent values, one validity byte and
  ``index_head_dim / index_kpool`` pooled values: 1,089 bytes in bf16 at GLM-5.3-Flash
  dims and kpool 4 (HF keeps the latent and every raw indexer key, 1,538 bytes).
* ``first_key[b]`` is the first valid slot, ``max_length`` until one arrives;
  ``n_valid[b]`` counts the valid slots written.
* Shared-indexer layers hold no indexer state (those fields are ``None``).

Shapes never depend on ``length``, so one compiled step serves every step of a decode.

The writes (``append_rows``, ``store_pools``) are in place: a step costs what it writes,
not the capacity (see ``write_rows`` and ``write_pools`` for how XLA:CPU is kept from
rewriting the buffers). An overflowing chunk (``fits`` False) writes nothing. Every
``lax.cond`` / ``fori_loop`` body here is a module-level function that receives every array
it reads as an operand: jax caches a traced body by the function and its operands' types,
so a closure made anew per call over that call's arrays misses the cache, and an eager
decode step (a layer call with a cache, outside jit) compiled three XLA programs on every
step. With these, an eager step compiles nothing once the first steps have run.

The cache ``dtype`` must be a 16- or 32-bit float (``bfloat16``, ``float16``, ``float32``):
the latent and pooled keys are activations written by a float projection, so an integer
or bool cache would silently round them (``int8`` gave outputs off by 4), and ``float64``
is not a compute dtype of this project (it would promote the attention to double).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from glm5_dsa_jax.config import DsaConfig
from pallas_kernels import first_valid

__all__ = [
    "DsaCache", "init_cache", "CACHE_DTYPES", "PoolWindow", "pool_window", "store_pools",
    "append_rows", "write_rows", "write_pools",
]

#: The dtypes ``init_cache`` accepts for the latent and pooled-key buffers.
CACHE_DTYPES = ("bfloat16", "float16", "float32")


def check_cache_dtype(dtype):
    """``jnp.dtype(dtype)`` if it is one of ``CACHE_DTYPES``, else ``ValueError``."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(
            f"cache dtype must be one of {list(CACHE_DTYPES)}, got {dtype!r}"
        ) from None
    if dt.name not in CACHE_DTYPES:
        raise ValueError(
            f"cache dtype must be a 16- or 32-bit float, one of {list(CACHE_DTYPES)}; got "
            f"{dt.name} (an integer or bool cache would silently round the latent rows)"
        )
    return dt


@struct.dataclass
class DsaCache:
    """Decode state of one DSA layer (a pytree). Shapes in the field comments."""

    latent: jax.Array  # [B, max_length, kv_lora_rank], cache dtype
    key_valid: jax.Array  # [B, max_length] bool
    length: jax.Array  # [] int32, slots written
    pooled: jax.Array | None = None  # [B, max_pools, index_head_dim], cache dtype
    pool_valid: jax.Array | None = None  # [B, max_pools] bool
    stage_keys: jax.Array | None = None  # [B, KP, index_head_dim]: slots length-KP .. length-1
    stage_gate: jax.Array | None = None  # [B, KP, index_head_dim] float32
    stage_valid: jax.Array | None = None  # [B, KP] bool
    first_key: jax.Array | None = None  # [B] int32
    n_valid: jax.Array | None = None  # [B] int32

    @property
    def batch_size(self) -> int:
        return self.latent.shape[0]

    @property
    def max_length(self) -> int:
        return self.latent.shape[1]

    @property
    def has_indexer(self) -> bool:
        return self.pooled is not None

    @property
    def max_pools(self) -> int:
        return self.pooled.shape[1] if self.pooled is not None else 0

    def nbytes(self) -> int:
        """Bytes held on devices by this cache."""
        return sum(x.nbytes for x in jax.tree.leaves(self))

    def check(self, cfg: DsaConfig, has_indexer: bool, batch_size: int) -> None:
        """Raise ``ValueError`` unless this cache was made for ``cfg`` and ``batch_size``."""
        want_c = cfg.kv_cache_dim
        if self.latent.ndim != 3 or self.latent.shape[0] != batch_size or self.latent.shape[2] != want_c:
            raise ValueError(
                f"cache.latent is {tuple(self.latent.shape)}; this layer and batch need "
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
            if self.pooled.shape[2] != cfg.index_head_dim or self.stage_keys.shape != want:
                raise ValueError(
                    f"cache indexer state has pooled {tuple(self.pooled.shape)} and stage "
                    f"{tuple(self.stage_keys.shape)}; this layer needs index_head_dim="
                    f"{cfg.index_head_dim} and index_kpool={cfg.index_kpool}"
                )


def init_cache(
    cfg: DsaConfig,
    batch_size: int,
    max_length: int,
    *,
    has_indexer: bool = True,
    dtype=jnp.bfloat16,
) -> DsaCache:
    """An empty cache for ``batch_size`` sequences of up to ``max_length`` slots.

    ``dtype`` (of the latent and pooled keys) must be one of ``CACHE_DTYPES``; anything
    else raises ``ValueError`` naming ``dtype``.
    """
    dtype = check_cache_dtype(dtype)
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
    base = dict(
        latent=jnp.zeros((b, max_length, cfg.kv_cache_dim), dtype),
        key_valid=jnp.zeros((b, max_length), bool),
        length=jnp.zeros((), jnp.int32),
    )
    if not has_indexer:
        return DsaCache(**base)
    kp, d = cfg.index_kpool, cfg.index_head_dim
    max_pools = max(1, max_length // kp)
    return DsaCache(
        **base,
        pooled=jnp.zeros((b, max_pools, d), dtype),
        pool_valid=jnp.zeros((b, max_pools), bool),
        stage_keys=jnp.zeros((b, kp, d), dtype),
        stage_gate=jnp.zeros((b, kp, d), jnp.float32),
        stage_valid=jnp.zeros((b, kp), bool),
        first_key=jnp.full((b,), max_length, jnp.int32),
        n_valid=jnp.zeros((b,), jnp.int32),
    )


# ---------------------------------------------------------------------------- in-place writes
def _update_slice(buf, rows, idx):
    return jax.lax.dynamic_update_slice(buf, rows, idx)


def _keep(buf, *_):
    return buf


def write_rows(buf: jax.Array, rows: jax.Array, start: jax.Array, fits: jax.Array) -> jax.Array:
    """``buf[:, start:start+S] = rows`` in place, or nothing at all when not ``fits``.

    ``lax.cond`` over a ``dynamic_update_slice`` rather than a masked scatter or a ``where``
    over the old rows: both of those made XLA:CPU rewrite (or copy) the whole buffer, an
    O(cache) pass per step. (XLA:CPU still converts a 16-bit float buffer to float32 and
    back around the update: it has no in-place bf16 ``dynamic_update_slice``; see the
    README's CPU benchmark. Storing such caches as their bits is the serving cache's fix.)
    """
    zero = jnp.zeros((), jnp.int32)
    idx = (zero, start) + (zero,) * (buf.ndim - 2)
    return jax.lax.cond(fits, _update_slice, _keep, buf, rows.astype(buf.dtype), idx)


def _write_pool(bufs, rows, valid_rows, pool_ids, r, j):
    buf, vbuf = bufs
    p, zero = pool_ids[r, j], jnp.zeros((), jnp.int32)
    buf = jax.lax.dynamic_update_slice(buf, rows[r, j][None, None], (r, p, zero))
    vbuf = jax.lax.dynamic_update_slice(vbuf, valid_rows[r, j][None, None], (r, p))
    return buf, vbuf


def _write_pool_step(i, carry):
    bufs, rows, valid_rows, pool_ids, new = carry
    n = pool_ids.shape[1]
    r, j = i // n, i % n
    bufs = jax.lax.cond(new[r, j], _write_pool, _keep, bufs, rows, valid_rows, pool_ids, r, j)
    return bufs, rows, valid_rows, pool_ids, new


def write_pools(buf, valid_buf, rows, valid_rows, pool_ids, new):
    """``buf[b, pool_ids[b, i]] = rows[b, i]`` (and the validity) where ``new[b, i]``.

    One ``cond``-guarded ``dynamic_update_slice`` per (row, window pool): in place. A masked
    scatter is the natural form, but XLA:CPU has no 16-bit-float scatter and converts the
    whole ``[B, max_pools, D]`` cache to float32 and back around it on every step.
    """
    b, n = pool_ids.shape
    carry = ((buf, valid_buf), rows.astype(buf.dtype), valid_rows, pool_ids, new)
    (buf, valid_buf), *_ = jax.lax.fori_loop(0, b * n, _write_pool_step, carry)
    return buf, valid_buf


def append_rows(cache: DsaCache, latent: jax.Array, mask: jax.Array, fits) -> DsaCache:
    """The chunk's latent rows ``[B, S, C]`` and validity ``[B, S]`` written at slots
    ``length .. length+S-1`` (nothing when not ``fits``); ``length`` is not moved here."""
    return cache.replace(
        latent=write_rows(cache.latent, latent, cache.length, fits),
        key_valid=write_rows(cache.key_valid, mask, cache.length, fits),
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
    pooled_cache, pool_valid = write_pools(cache.pooled, cache.pool_valid, pooled, pooled_valid, pool_ids, new)
    return cache.replace(
        pooled=pooled_cache,
        pool_valid=pool_valid,
        stage_keys=jnp.where(fits, window.keys[:, s:], cache.stage_keys),
        stage_gate=jnp.where(fits, window.gate[:, s:], cache.stage_gate),
        stage_valid=jnp.where(fits, window.valid[:, s:], cache.stage_valid),
        first_key=jnp.where(fits, first_key, cache.first_key),
    )
