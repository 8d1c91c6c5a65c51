"""``index_scores``: the lightning indexer's score of every (query, pool) pair.

Invariants:

* ``score[b, t, p] = sum_h w[b, t, h] * relu((q[b, t, h] . pooled[b, p]) * D**-0.5)``,
  computed in float32 whatever the input dtype.
* Pool ``p`` is a *candidate* for query ``t`` when it is valid and its last token,
  ``first_key + (p + 1)*KP - 1``, is at or before the query's position ``q_pos[b, t]``
  (causal; a padding query has ``q_pos = -1`` and so no candidate). Non-candidates score
  ``-inf``; so does a NaN score, so that a NaN never wins a top-k slot.
* ``-0.0`` is returned as ``+0.0``: ReLU makes exact zeros common, and the top-k tie rule
  must see ``w * 0 < 0`` and ``0`` as the same score.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_implementation, check_rank

__all__ = ["index_scores", "index_scores_reference", "pool_last_token"]


def pool_last_token(first_key: jax.Array, n_pools: int, kpool: int) -> jax.Array:
    """``[B] -> [B, P]`` int32: the last token id of every pool."""
    p = jnp.arange(n_pools, dtype=jnp.int32)
    return first_key.astype(jnp.int32)[:, None] + (p[None, :] + 1) * kpool - 1


def finish_scores(score, pool_valid, first_key, q_pos, kpool):
    """Apply the candidate mask and the sign / NaN canonicalisation (shared with kernels)."""
    last = pool_last_token(first_key, score.shape[-1], kpool)
    cand = pool_valid[:, None, :] & (last[:, None, :] <= q_pos[:, :, None])
    score = jnp.where(score == 0.0, 0.0, score)
    return jnp.where(cand & ~jnp.isnan(score), score, -jnp.inf)


def index_scores_reference(
    q: jax.Array,
    w: jax.Array,
    pooled: jax.Array,
    pool_valid: jax.Array,
    first_key: jax.Array,
    q_pos: jax.Array,
    *,
    kpool: int,
) -> jax.Array:
    """Plain-jnp scores.

    Args:
      q: ``[B, Q, H, D]`` indexer queries ``wq_b(q_resid)``.
      w: ``[B, Q, H]`` float32 head weights ``weights_proj(x) * H**-0.5``.
      pooled: ``[B, P, D]`` pooled keys from ``kpool_compress``.
      pool_valid: ``[B, P]`` bool.
      first_key: ``[B]`` int32.
      q_pos: ``[B, Q]`` int32 token position of each query, ``-1`` for a padding query.
      kpool: tokens per pool.

    Returns:
      ``[B, Q, P]`` float32 scores, ``-inf`` where the pool is not a candidate.
    """
    d = q.shape[-1]
    s = jnp.einsum(
        "bqhd,bpd->bqhp", q.astype(jnp.float32), pooled.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    s = jax.nn.relu(s * (d**-0.5))
    score = jnp.einsum(
        "bqh,bqhp->bqp", w.astype(jnp.float32), s, precision=jax.lax.Precision.HIGHEST
    )
    return finish_scores(score, pool_valid, first_key, q_pos, kpool)


def index_scores(
    q: jax.Array,
    w: jax.Array,
    pooled: jax.Array,
    pool_valid: jax.Array,
    first_key: jax.Array,
    q_pos: jax.Array,
    *,
    kpool: int,
    implementation: str = "xla",
    **block_sizes,
) -> jax.Array:
    """Indexer scores; see the module doc. Shapes as ``index_scores_reference``."""
    check_implementation(implementation)
    check_rank("q", q, 4, "[B, Q, H, D]")
    b, nq, h, d = q.shape
    if w.shape != (b, nq, h):
        raise ValueError(f"w must be [B, Q, H] = {(b, nq, h)}, got {tuple(w.shape)}")
    check_rank("pooled", pooled, 3, "[B, P, D]")
    if pooled.shape[0] != b or pooled.shape[2] != d:
        raise ValueError(f"pooled must be [B={b}, P, D={d}], got {tuple(pooled.shape)}")
    if pool_valid.shape != pooled.shape[:2]:
        raise ValueError(f"pool_valid must be [B, P] = {tuple(pooled.shape[:2])}, got {tuple(pool_valid.shape)}")
    if first_key.shape != (b,):
        raise ValueError(f"first_key must be [B] = ({b},), got {tuple(first_key.shape)}")
    if q_pos.shape != (b, nq):
        raise ValueError(f"q_pos must be [B, Q] = {(b, nq)}, got {tuple(q_pos.shape)}")
    if implementation == "xla":
        return index_scores_reference(q, w, pooled, pool_valid, first_key, q_pos, kpool=kpool)
    return _index_scores_pallas(
        q, w, pooled, pool_valid, first_key, q_pos, kpool=kpool,
        interpret=implementation == "pallas_interpret", **block_sizes,
    )


def _index_scores_pallas(q, w, pooled, pool_valid, first_key, q_pos, *, kpool, interpret, **block_sizes):
    raise NotImplementedError("the index_scores Pallas kernel is not written yet")
