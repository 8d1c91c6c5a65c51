"""Rotary position embedding of the ``glm_moe_dsa`` / ``deepseek_v32`` DSA layers: the
frequencies, cos / sin at integer positions, and the rotation in both channel layouts.

What HF does (transformers 5.23.0, ``*RotaryEmbedding`` and ``modeling_rope_utils``), and
so what this module does, over ``D = qk_rope_head_dim`` channels (``D/2`` frequencies):

* ``inv_freq[i] = 1 / rope_theta ** (2i / D)`` in float32 (``"default"``); under
  ``"yarn"`` a blend of that and ``inv_freq / factor`` along a linear ramp between the
  correction dims of ``beta_fast`` / ``beta_slow`` (floored / ceiled when ``truncate``),
  the ramp computed in float32 as HF does.
* ``angle = float32(position) * inv_freq`` (float32 product, as HF's), ``cos = cos(angle) *
  attention_scaling`` (``DsaConfig.rope_attention_scaling``: YaRN's cos/sin factor, 1.0
  otherwise). HF returns ``cat(angle, angle)`` of width ``D``; ``rope_cos_sin`` returns the
  ``D/2`` per-pair half, which is all both layouts read.
* ``apply_rope(x, cos, sin, "half")`` is HF's ``rotate_half`` form: channel ``i`` pairs with
  ``i + D/2``. ``"interleaved"`` is HF's ``apply_rotary_pos_emb_interleave``: channel
  ``2i`` pairs with ``2i + 1``, and the *output* is written de-interleaved, as HF writes it:
  the rotated even channels, then the rotated odd ones. A query and a key roped alike keep
  their dot product either way; the layout matters for bit equality with HF's cached keys.
* cos and sin are cast to ``x``'s dtype before the rotation (HF casts them to the input's).

``cos`` / ``sin`` of the float32 angle are the backend's: XLA's CPU ``cos`` was measured
within 0.6 ulp of the exact value up to position 2,000,000 (torch's within 0.6 too), and
CUDA's ``cosf`` / ``sinf`` reduce the full float32 range (CUDA math docs: 2 ulp). A
hand-written Cody-Waite reduction was tried and was far worse at large angles: do not add one.

This module imports only ``config`` (and jax / numpy).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from glm5_dsa_jax.model.config import DsaConfig

__all__ = ["ROPE_STYLES", "inv_freq", "rope_cos_sin", "apply_rope"]

#: Channel layouts of ``apply_rope``.
ROPE_STYLES = ("interleaved", "half")


def _pow_f32(base: float, expo: np.ndarray) -> np.ndarray:
    """``float32(base ** expo)`` for float32 ``expo``, correctly rounded (via float64)."""
    return (np.float64(base) ** expo.astype(np.float64)).astype(np.float32)


def inv_freq(cfg: DsaConfig) -> np.ndarray:
    """The ``qk_rope_head_dim // 2`` inverse frequencies (float32) HF's rotary embedding
    computes for ``cfg`` (``"default"`` or ``"yarn"``)."""
    dim = cfg.qk_rope_head_dim
    if dim <= 0:
        raise ValueError(f"cfg.qk_rope_head_dim is {dim}: a NoPE config has no RoPE frequencies")
    expo = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = _pow_f32(cfg.rope_theta, expo)
    if cfg.rope_type == "default":
        return (np.float32(1.0) / pos_freqs).astype(np.float32)
    if cfg.rope_type != "yarn":
        raise ValueError(f"cfg.rope_type is {cfg.rope_type!r}; supported: 'default', 'yarn'")
    base, orig = cfg.rope_theta, cfg.rope_original_max_position_embeddings

    def correction_dim(n_rot):
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrap = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)
    inv_extrap = (np.float32(1.0) / pos_freqs).astype(np.float32)
    inv_interp = (np.float32(1.0) / (np.float32(cfg.rope_factor) * pos_freqs)).astype(np.float32)
    return (inv_interp * (np.float32(1) - extrap) + inv_extrap * extrap).astype(np.float32)


def rope_cos_sin(cfg: DsaConfig, positions) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(cos, sin)`` float32 ``[*positions.shape, qk_rope_head_dim // 2]`` at integer
    ``positions``, YaRN's ``attention_scaling`` applied (HF's, less the duplicated half)."""
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be an integer array, got dtype {positions.dtype}")
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(cfg))
    scale = np.float32(cfg.rope_attention_scaling)
    return jnp.cos(angle) * scale, jnp.sin(angle) * scale


def apply_rope(x, cos, sin, style: str) -> jnp.ndarray:
    """Rotate the last axis of ``x`` (width ``D``) by ``cos`` / ``sin`` (last axis ``D/2``,
    broadcast against ``x``'s leading axes) in ``style`` (``"interleaved"`` or ``"half"``,
    see the module doc for the output layout); computed in ``x``'s dtype."""
    if style not in ROPE_STYLES:
        raise ValueError(f"style must be one of {list(ROPE_STYLES)}, got {style!r}")
    x = jnp.asarray(x)
    d = x.shape[-1]
    if d % 2 or cos.shape[-1] != d // 2 or sin.shape[-1] != d // 2:
        raise ValueError(
            f"x's last axis ({d}) must be even and twice cos / sin's ({cos.shape[-1]}, {sin.shape[-1]})"
        )
    cos, sin = jnp.asarray(cos).astype(x.dtype), jnp.asarray(sin).astype(x.dtype)
    if style == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
