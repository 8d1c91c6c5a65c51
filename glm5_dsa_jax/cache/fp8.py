"""fp8 caches: latent rows and pooled indexer keys in e4m3 (``float8_e4m3fn``), one float32
scale per row, quantised once where a row is written and dequantised inside the kernels
that read it.

Invariants:

* **What is quantised.** A latent row (``kv_lora_rank`` values, plus ``k_rot`` with RoPE: the
  whole ``kv_cache_dim``-wide row shares one scale) and a pooled key (``index_head_dim``
  values) are each one *row*: ``scale = amax(|row|) / 448`` (448 is e4m3's largest finite
  value), ``q = row / scale`` clipped to ``[-448, 448]`` and cast to e4m3 (round to
  nearest; e4m3fn has no infinity and turns an overflow into NaN, hence the clip). A row
  of zeros (a padding token, an empty slot) has ``amax = 0`` and gets ``scale = 1``, so it
  dequantises to exact zeros, never ``0 / 0``; a non-finite ``amax`` also gets 1.
* **Error.** ``dequantize_rows(*quantize_rows(x)) = q * scale`` differs from ``x`` by at most
  half an e4m3 ulp of ``x / scale`` times ``scale`` (plus float32 rounding): ``<= 2**-4 * |x|``
  for the normal range (3 mantissa bits), and ``<= 2**-10 * scale = 2**-10 * amax / 448``
  where ``x / scale`` is subnormal (``< 2**-6``). So every element is within ``2**-4`` of the
  row's ``amax``. ``tests/test_fp8_cache.py`` checks the exact half-ulp bound.
* **Why one scale per row, not per 128-wide group.** A row of 512 latent values with one
  scale costs 516 bytes; four 128-groups would cost 528, and with the 33 bytes a token of
  pooled keys costs (32 + 4 / 4 scale) and the validity byte the per-token total (562)
  would break the 560-byte per-token budget of an fp8 cache (``tests/test_fp8_cache.py``
  checks it; ``glm5_dsa_jax.cache.contiguous`` cites this argument). The latent is ``kv_a_layernorm``'s output,
  whose channels share one scale by construction, so a row scale loses little.
* **Quantise once.** Only the caches' writes (``write_latent`` and ``store_pools`` of
  either cache, and ``replace(latent=, pooled=)``) call ``quantize_rows``;
  the stage of the incomplete pool stays in the compute dtype (it is pooled later).
* **Dequantise in the kernels.** ``index_scores`` / ``index_scores_paged`` take
  ``pooled_scale`` and multiply each pool's head-summed score by it (``score = scale_p *
  sum_h w_h relu(q_h . k8_p / sqrt(D))``: ``scale_p > 0`` commutes with the ReLU, so this
  is the score of the dequantised key, with one multiply per (query, pool)); ``sparse_mla``
  takes ``latent_scale`` (see its module doc). The ``"xla"`` references do the same
  arithmetic in the same order, so the top-k of ``"xla"`` and Pallas agree bit for bit.
* **Which kernels can read e4m3.** Triton converts e4m3 only on compute capability 8.9 and
  newer (Ada, Hopper): ``check_readable`` refuses an fp8 cache for ``implementation=
  "pallas"`` on an older GPU (an A100 is 8.0), naming the capability and the dtype. The
  ``"xla"`` and ``"pallas_interpret"`` paths read e4m3 anywhere. The Mosaic GPU kernels
  read 16-bit rows only: under ``"mosaic"`` the scoring and attention steps of an fp8
  cache run the Triton kernels (sm_90+ converts e4m3), as float32 operands do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["FP8", "E4M3_MAX", "is_fp8", "quantize_rows", "dequantize_rows", "check_readable",
           "check_cache_readable"]

#: The fp8 cache dtype.
FP8 = jnp.dtype(jnp.float8_e4m3fn)
#: e4m3fn's largest finite value: a row's ``amax`` maps to it.
E4M3_MAX = 448.0
#: Compute capability from which Triton converts e4m3 (sm_89: Ada; Hopper is 9.0).
MIN_CAPABILITY = (8, 9)


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is the fp8 cache dtype (``float8_e4m3fn``)."""
    return dtype is not None and jnp.dtype(dtype) == FP8


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., width]`` -> ``(q [..., width] float8_e4m3fn, scale [...] float32)`` with one scale
    per row (the last axis); see the module doc."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax / E4M3_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(xf / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(FP8)
    return q, scale


def dequantize_rows(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q [..., width]`` (e4m3) times its row's ``scale [...]``, in float32."""
    return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def _capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def check_readable(dtype, implementation: str, devices) -> None:
    """Raise ``ValueError`` when a cache of ``dtype`` is fp8, ``implementation`` is
    ``"pallas"`` or ``"mosaic"`` (whose wrappers run the Triton kernels on fp8 rows) and one
    of ``devices`` is a GPU of compute capability below 8.9 (Triton cannot convert e4m3
    there)."""
    if not is_fp8(dtype) or implementation not in ("pallas", "mosaic"):
        return
    for d in devices:
        cc = _capability(d)
        if getattr(d, "platform", None) in ("gpu", "cuda") and cc is not None and cc < MIN_CAPABILITY:
            raise ValueError(
                f"an fp8 cache (dtype {FP8.name}) cannot be read by implementation={implementation!r} on "
                f"{d}: its compute capability is {cc[0]}.{cc[1]}, and Triton converts e4m3 only "
                f"from {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper); use a bfloat16 "
                "cache or implementation='xla'")


def check_cache_readable(cache, implementation: str) -> None:
    """``check_readable`` for ``cache`` (a ``DsaCache`` or ``PagedCache``) on the devices that
    hold it (inside a trace: the default backend's devices)."""
    check_readable(cache.dtype, implementation, _devices_of(cache.latent_store))


def _devices_of(leaf):
    return jax.devices() if isinstance(leaf, jax.core.Tracer) else leaf.devices()
