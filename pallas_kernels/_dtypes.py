"""The fp8 (e4m3) operands the kernels take, and how they enter a dot.

An fp8 cache stores ``float8_e4m3fn`` rows with one float32 scale per row
(``glm5_dsa_jax.cache.fp8``): the pooled indexer keys for ``index_scores`` /
``index_scores_paged`` (``pooled_scale``), the latent rows for ``sparse_mla``
(``latent_scale``). Invariants shared by every kernel and reference that reads them:

* A scale comes with e4m3 keys and only with them, shaped as the keys' leading axes
  (``check_key_scale``: one message for every wrapper).
* e4m3 keys are converted, before the dot, to the query's dtype when that is bf16 / f16
  (exact: every e4m3 value is one, and their products stay exact in float32), else to
  float32 (``key_dot_dtype``); the scale multiplies after the dot, so the result is the
  dot of the dequantised key.

Private, and importing no kernel module, so the scoring and attention modules share it
without importing each other.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["FP8", "key_dot_dtype", "check_key_scale"]

FP8 = jnp.dtype(jnp.float8_e4m3fn)


def key_dot_dtype(q_dtype):
    """The dtype fp8 keys are converted to for the dot with queries of ``q_dtype``: a
    16-bit float itself (e4m3 -> bf16 / f16 is exact, and so are their products in
    float32), else float32."""
    return jnp.dtype(q_dtype) if jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


def check_key_scale(name, keys, scale_name, scale, shape_doc):
    """``scale`` (float, ``keys.shape[:2]``) must come with e4m3 ``keys`` and only with
    them; else ``ValueError`` naming both and the sizes (shared by the scoring wrappers and
    ``sparse_mla``)."""
    if (scale is None) != (keys.dtype != FP8):
        raise ValueError(
            f"{scale_name} must be given exactly when {name} is {FP8.name} (fp8); got {name} "
            f"{keys.dtype} and {scale_name} {None if scale is None else tuple(scale.shape)}")
    if scale is not None:
        if tuple(scale.shape) != tuple(keys.shape[:2]):
            raise ValueError(f"{scale_name} must be {shape_doc} = {tuple(keys.shape[:2])}, got "
                             f"{tuple(scale.shape)}")
        if not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(f"{scale_name} must be float, got dtype {scale.dtype}")
