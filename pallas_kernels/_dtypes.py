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

__all__ = ["FP8", "INT8", "key_dot_dtype", "check_key_scale", "check_key_groups", "dequantize_key_groups"]

FP8 = jnp.dtype(jnp.float8_e4m3fn)
#: int8 pooled indexer keys (an fp8 cache's ``index_keys="int8"``): one scale per group of
#: columns, ``[..., G]``, dequantised to float32 before the dot (a group's scale does not
#: commute with the sum over the key's columns, so it cannot wait for the head sum).
INT8 = jnp.dtype(jnp.int8)


def key_dot_dtype(q_dtype):
    """The dtype fp8 keys are converted to for the dot with queries of ``q_dtype``: a
    16-bit float itself (e4m3 -> bf16 / f16 is exact, and so are their products in
    float32), else float32."""
    return jnp.dtype(q_dtype) if jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


def check_key_scale(name, keys, scale_name, scale, shape_doc):
    """``scale`` (float, ``keys.shape[:2]``) must come with e4m3 ``keys`` and only with
    them; else ``ValueError`` naming both and the sizes (shared by the scoring wrappers and
    ``sparse_mla``)."""
    if (scale is None) != (keys.dtype not in (FP8, INT8)):
        raise ValueError(
            f"{scale_name} must be given exactly when {name} is {FP8.name} (fp8) or int8; got {name} "
            f"{keys.dtype} and {scale_name} {None if scale is None else tuple(scale.shape)}")
    if scale is not None:
        if tuple(scale.shape) != tuple(keys.shape[:2]):
            raise ValueError(f"{scale_name} must be {shape_doc} = {tuple(keys.shape[:2])}, got "
                             f"{tuple(scale.shape)}")
        if not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(f"{scale_name} must be float, got dtype {scale.dtype}")


def check_key_groups(name, keys, scale_name, scale, shape_doc):
    """``check_key_scale`` for keys that may be int8, whose scale is ``shape_doc`` plus a
    trailing ``G`` (a divisor of the key width ``D``): ``ValueError`` naming both and the
    sizes otherwise."""
    if keys.dtype == INT8:
        d = keys.shape[-1]
        if scale is None or scale.ndim != keys.ndim or scale.shape[-1] < 1 or d % scale.shape[-1]:
            raise ValueError(
                f"{scale_name} of int8 {name} must be {shape_doc[:-1]}, G] with G dividing the key width "
                f"D = {d}; got {None if scale is None else tuple(scale.shape)}")
        scale, shape_doc = scale[..., 0], shape_doc[:-1] + ", G]"
    check_key_scale(name, keys, scale_name, scale, shape_doc)


def dequantize_key_groups(keys, scale):
    """int8 ``keys [..., D]`` times their group scales ``scale [..., G]`` (each scale for
    ``D / G`` consecutive columns), in float32: what the references and the kernels' loads
    dot with the queries."""
    g, d = scale.shape[-1], keys.shape[-1]
    grouped = keys.astype(jnp.float32).reshape(*keys.shape[:-1], g, d // g)
    return (grouped * scale.astype(jnp.float32)[..., None]).reshape(keys.shape)
