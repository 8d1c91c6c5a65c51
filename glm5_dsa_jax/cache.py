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

The cache ``dtype`` must be a 16- or 32-bit float (``bfloat16``, ``float16``, ``float32``):
the latent and pooled keys are activations written by a float projection, so an integer
or bool cache would silently round them (``int8`` gave outputs off by 4), and ``float64``
is not a compute dtype of this project (it would promote the attention to double).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from glm5_dsa_jax.config import DsaConfig

__all__ = ["DsaCache", "init_cache", "CACHE_DTYPES"]

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
