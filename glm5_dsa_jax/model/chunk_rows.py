"""The gradient of a chunk's latent rows through a cache (``rows_with_chunk_gradient``).

``DsaAttention.forward`` writes the chunk's rows into the cache before any query reads them
(a query attends to its own token), then attends over the cache's rows. A cache's buffer may
hold bits, not floats (``cpu_policy.store_dtype``: a 16-bit cache on a CPU is ``uint16``), so
the write then the read would cut the chunk's rows off the backward pass. This custom VJP is
the identity forward (outputs bit for bit) and routes the rows' cotangent back to the chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["rows_with_chunk_gradient"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def rows_with_chunk_gradient(rows, latent, slots, fits, fp8: bool):
    """``rows`` (a cache's ``attention_rows`` after ``write_latent(latent, chunk)``), with
    the gradient of the chunk's rows ``latent [B, S, CR]`` routed from the rows' slots
    ``slots [B, S]`` (``row_slots(chunk.q_pos)``: ``-1`` for a padding token; nothing when
    not ``fits``). The forward is the identity: no operation, outputs bit for bit.

    Why: a cache's buffer may hold bits, not floats (``cpu_policy.store_dtype``: a 16-bit
    cache on a CPU is ``uint16``), and an integer has no gradient, so ``write_latent`` then
    ``attention_rows`` would silently cut the chunk's rows off the backward pass. The
    backward takes ``d_rows`` at the chunk's slots as ``d_latent`` (a write and a read are
    the identity on the rows; a 16-bit cache's rounding is a cast, whose derivative is
    one), and passes ``d_rows`` on to the buffer with those slots zeroed (a float buffer's
    own path would count them twice). An fp8 cache (``fp8``) is a serving format: its
    backward raises ``ValueError``."""
    del latent, slots, fits, fp8
    return rows


def _rows_fwd(rows, latent, slots, fits, fp8):
    return rows, (slots, fits, jnp.zeros((0,), latent.dtype), latent.shape)


def _rows_bwd(fp8, res, d_rows):
    slots, fits, like, shape = res
    if fp8:
        raise ValueError("no gradient through an fp8 cache's rows (a serving format): differentiate "
                         "DsaAttention with a bfloat16 or float32 cache (or none)")
    written = (slots >= 0) & fits
    src = jnp.zeros((), slots.dtype) if d_rows.shape[0] == 1 else jnp.arange(shape[0], dtype=slots.dtype)[:, None]
    src = jnp.broadcast_to(src, slots.shape)
    safe = jnp.where(written, slots, 0)
    d_latent = jnp.where(written[..., None], d_rows[src, safe], jnp.zeros((), d_rows.dtype)).astype(like.dtype)
    # Drop those slots from the buffer's cotangent (a float buffer would pass them on to
    # the chunk's rows again through its write); out-of-range indices are dropped.
    big = jnp.asarray(d_rows.shape[1], slots.dtype)
    d_rows = d_rows.at[src, jnp.where(written, slots, big)].set(0, mode="drop")
    return d_rows, d_latent, None, None


rows_with_chunk_gradient.defvjp(_rows_fwd, _rows_bwd)
