"""What the indexer's scoring forward (``pallas_kernels.scoring``) and its backward
(``pallas_kernels.scoring_backward``) share: the candidate rule, the dtype the Triton
dots multiply in, the operand dtypes the Triton kernels take, and the padded-channel lanes.

Invariants (one home, so that the forward and the backward cannot disagree):

* Pool ``p`` of a row ends at token ``first_key + (p + 1)*KP - 1`` (``pool_last_token``)
  and is a *candidate* for a query at position ``q_pos`` when it is valid and ends at or
  before it (``candidates``; a padding query, ``q_pos = -1``, has none). The forward
  scores a non-candidate ``-inf``; the backward passes it no gradient.
* The pools a query can see are a prefix: ``p < (q_pos - first_key + 1) // KP`` (``visible_pools``);
  a Triton program stops its pool loop (backward) or skips its tile (forward) there.
* Triton dots multiply in ``score_dot_dtype``: bf16 / f16 operands of one dtype on the
  tensor cores with a float32 accumulator, e4m3 keys converted to the query's 16-bit dtype
  (``_dtypes.key_dot_dtype``), anything else in IEEE float32 (``allow_tf32=False``).

Private, and importing no kernel module (the package's seam rule), so that both kernel
modules read it without importing each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._dtypes import FP8, INT8, key_dot_dtype

__all__ = [
    "pool_last_token", "candidates", "visible_pools", "reference_dot_dtype", "score_dot_dtype", "FLOAT_DTYPES",
    "check_triton_dtypes", "channels",
]


def pool_last_token(first_key: jax.Array, n_pools: int, kpool: int) -> jax.Array:
    """``[B] -> [B, P]`` int32: the last token id of every pool."""
    p = jnp.arange(n_pools, dtype=jnp.int32)
    return first_key.astype(jnp.int32)[:, None] + (p[None, :] + 1) * kpool - 1


def candidates(pool_valid: jax.Array, first_key: jax.Array, q_pos: jax.Array,
               kpool: int) -> jax.Array:
    """``[B, Q, P]`` bool: pool ``p`` is valid and ends at or before query ``t``'s position."""
    last = pool_last_token(first_key, pool_valid.shape[-1], kpool)
    return pool_valid[:, None, :] & (last[:, None, :] <= q_pos[:, :, None])


def visible_pools(q_pos, first_key, kpool: int):
    """The pools a query at ``q_pos`` can see, ``max(q_pos - first_key + 1, 0) // KP`` (any
    broadcastable integer arrays; in a kernel too): pool ``p`` ends at or before ``q_pos``
    iff ``p`` is below it."""
    return jnp.maximum(q_pos - first_key + 1, 0) // kpool


def reference_dot_dtype(q_dtype, key_dtype):
    """The dtype the references' einsums multiply in (with ``Precision.HIGHEST`` and a float32
    result): ``key_dot_dtype`` for fp8 keys, else the promotion of the two (products of
    16-bit floats are exact in float32, so the pooled cache is not converted whole)."""
    if jnp.dtype(key_dtype) == FP8:
        return key_dot_dtype(q_dtype)
    return jnp.promote_types(q_dtype, key_dtype)


def score_dot_dtype(q_dtype, key_dtype):
    """The dtype the Triton kernels' dot multiplies in: ``key_dot_dtype`` for fp8 keys; the
    operands' own for bf16 / f16 of one dtype (tensor cores, exact products in the float32
    accumulator); else float32 (IEEE, ``allow_tf32=False``)."""
    if jnp.dtype(key_dtype) == FP8:
        return key_dot_dtype(q_dtype)
    if jnp.dtype(key_dtype) == INT8:  # dequantised to float32 at the load (``_dtypes.INT8``)
        return jnp.dtype(jnp.float32)
    if q_dtype == key_dtype and q_dtype != jnp.float32:
        return q_dtype
    return jnp.float32


FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_triton_dtypes(q, w, keys_name, keys):
    """``ValueError`` unless ``q``, the keys and ``w`` are float32, bfloat16 or float16 (the
    keys may also be e4m3 or int8), as the Triton kernels take them."""
    for name, x in (("q", q), (keys_name, keys), ("w", w)):
        if x.dtype not in FLOAT_DTYPES and not (name == keys_name and x.dtype in (FP8, INT8)):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got dtype {x.dtype}")


def channels(dim, block_d):
    """Whether each of the ``[block_d]`` channel lanes is one of the ``dim`` real ones, and an
    in-bounds channel index for each."""
    ch = jnp.arange(block_d, dtype=jnp.int32)
    return ch < dim, jnp.minimum(ch, dim - 1)
