"""The lightning indexer's training loss (DeepSeek-V3.2's KL over pools) and the parameter
filters that split a layer into the indexer and the rest.

The loss of a call ``layer(x, attention_mask=mask, indexer_loss="dense" | "sparse")`` is
the mean over the batch's *loss queries* of ``KL(p[t] || q[t])``, where, for a valid query
``t`` that sees at least one complete pool (``J_t`` below is not empty):

* ``a[t, s]``: the main attention's probabilities averaged over heads. ``"dense"``: the
  softmax over every token ``t`` sees; ``"sparse"``: the sparse attention's own, over its
  selected tokens (``attention_mass.dense_pool_mass`` / ``sparse_pool_mass``).
* ``J_t``: ``"dense"``: every complete pool ``t`` sees (the indexer's candidates, the
  pools ``index_scores`` scores finite); ``"sparse"``: the selected pools. The always-kept
  tail of an incomplete pool is in neither.
* ``p[t, j]``: ``a[t, ·]`` summed over pool ``j``'s tokens, renormalised over ``J_t``; a
  constant (the mass functions stop its gradient).
* ``q[t, j]``: the softmax over ``J_t`` of the indexer's pool scores (``selection_scores``).

Invariants:

* Per-row outputs: the layer's body returns ``(kl_sum [B], n_loss_queries [B])`` float32
  (``query_kl`` then a sum over the row's queries), so a data-parallel call needs no
  collective; ``mean_loss`` reduces them (``0.0`` when no query is a loss query).
* The KL reads the scores only through ``log_softmax`` over ``J_t``: its gradient with
  respect to a score is ``q - p`` on ``J_t`` and exactly zero elsewhere; nothing outside
  ``J_t`` (``-inf`` scores, padding queries, unselected pools) makes a NaN.
* Why the math lives here and not in ``layer``: the layer decides *where* the loss is taken
  (its query tiles, its gradient routing); this module is the definition, one home for it.

Filters: ``INDEXER_PARAMS`` is an ``nnx`` filter of the indexer's ``nnx.Param``s (the
``indexer`` sub-module of a ``DsaAttention``), ``ATTENTION_PARAMS`` of every other
``nnx.Param``. Train the indexer alone with ``nnx.Optimizer(layer, tx, wrt=INDEXER_PARAMS)``
and ``nnx.grad(loss_fn, argnums=nnx.DiffState(0, INDEXER_PARAMS))``; the main model with
``ATTENTION_PARAMS`` (then no backward of the indexer runs at all). For an optax mask over
an ``nnx.state(layer, nnx.Param)`` tree, ``indexer_param_mask(state)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_dsa_jax.model.attention_mass import dense_pool_mass, sparse_pool_mass

__all__ = ["INDEXER_LOSS_MODES", "ATTENTION_MODES", "check_modes", "INDEXER_PARAMS", "ATTENTION_PARAMS", "indexer_param_mask",
           "query_kl", "dense_tile_kl", "sparse_tile_kl", "mean_loss"]

#: The values of ``indexer_loss=`` (``None``: no loss).
INDEXER_LOSS_MODES = ("dense", "sparse")

#: The indexer's parameters: every ``nnx.Param`` under a layer's ``indexer`` attribute.
INDEXER_PARAMS = nnx.All(nnx.Param, nnx.PathContains("indexer"))
#: Every other parameter of the layer (the main attention's).
ATTENTION_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))


def indexer_param_mask(state) -> object:
    """An optax mask (same tree, ``True`` at the indexer's leaves) of a parameter state
    (``nnx.state(layer, nnx.Param)``): ``optax.masked(tx, indexer_param_mask(state))``."""
    return jax.tree_util.tree_map_with_path(lambda path, _: any(getattr(k, "key", None) == "indexer" for k in path),
                                            state)


def query_kl(scores: jax.Array, mass: jax.Array, in_loss: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(kl [B, Q], is_loss_query [B, Q])`` float32 for the pool scores ``scores [B, Q, J]``
    (the indexer's logits), the attention mass ``mass [B, Q, J]`` (a constant) and the
    members of ``J_t`` ``in_loss [B, Q, J]`` bool: ``KL(p || softmax_{J_t}(scores))`` with
    ``p = mass / sum_{J_t} mass``; a query with an empty ``J_t`` gives 0 and is no loss
    query. Entries outside ``J_t`` are never read (their scores may be ``-inf``)."""
    scores = scores.astype(jnp.float32)
    is_loss = in_loss.any(-1)
    p = jnp.where(in_loss, jax.lax.stop_gradient(mass).astype(jnp.float32), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    s = jnp.where(in_loss, scores, 0.0)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(in_loss, s, -jnp.inf), -1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.log(jnp.maximum(jnp.sum(jnp.where(in_loss, jnp.exp(s - m), 0.0), -1, keepdims=True),
                              jnp.finfo(jnp.float32).tiny)) + m
    log_q = s - lse
    pos = p > 0
    log_p = jnp.log(jnp.where(pos, p, 1.0))
    kl = jnp.sum(jnp.where(pos, p * (log_p - log_q), 0.0), -1)
    return jnp.where(is_loss, kl, 0.0), is_loss.astype(jnp.float32)


def dense_tile_kl(scores, q_lat, rows, q_slots, key_valid, first_key, row_scale=None, *, kpool: int,
                  scale: float, reduce_axis: str | None = None):
    """``query_kl`` of a query tile's ``"dense"`` loss: ``scores [B, Q, P]`` (``index_scores``
    of the prompt's pools, ``-inf`` = not a candidate: ``J_t`` is the finite ones) against
    the head-mean dense attention mass of ``q_lat [B, Q, H, CR]`` over ``rows [B, L, CR]``
    (``dense_pool_mass``: every visible slot, in key tiles, never ``[B, Q, L]`` per head)."""
    mass = dense_pool_mass(q_lat, rows, q_slots, key_valid, first_key, row_scale, kpool=kpool,
                           n_pools=scores.shape[-1], scale=scale, reduce_axis=reduce_axis)
    return query_kl(scores, mass, jnp.isfinite(scores))


def sparse_tile_kl(scores, pools, q_lat, rows, token_ids, row_scale=None, *, kpool: int, scale: float,
                   reduce_axis: str | None = None):
    """``query_kl`` of a query tile's ``"sparse"`` loss: ``J_t`` is the selected pools
    ``pools [B, Q, K]`` (``-1`` = none), scored by ``scores [B, Q, P]`` (gathered), against
    the sparse attention's own head-mean mass on each selected pool (``sparse_pool_mass``
    over ``token_ids [B, Q, W]`` as the attention reads them: pool ``k`` is ids ``k*KP ...``)."""
    chosen = pools >= 0
    picked = jnp.take_along_axis(scores, jnp.maximum(pools, 0), axis=-1)
    mass = sparse_pool_mass(q_lat, rows, token_ids, row_scale, kpool=kpool, select_k=pools.shape[-1],
                            scale=scale, reduce_axis=reduce_axis)
    return query_kl(picked, mass, chosen & jnp.isfinite(picked))


def mean_loss(kl_sum: jax.Array, n_loss: jax.Array) -> jax.Array:
    """The loss, a float32 scalar: ``sum(kl_sum) / sum(n_loss)`` over the rows' outputs
    (``0.0`` when there is no loss query)."""
    total = jnp.sum(n_loss.astype(jnp.float32))
    return jnp.sum(kl_sum.astype(jnp.float32)) / jnp.maximum(total, 1.0)


#: The values of a call's ``attention=``: the selected tokens (the default) or every visible one.
ATTENTION_MODES = ("sparse", "dense")


def check_modes(attention, indexer_loss, has_indexer: bool, layer_idx: int, cache) -> None:
    """A call's training modes, before anything runs: ``ValueError`` naming ``attention`` /
    ``indexer_loss`` unless ``attention`` is one of ``ATTENTION_MODES`` (``"dense"``: no
    paged cache, which keeps no per-slot mask of the visible tokens) and ``indexer_loss`` is
    ``None`` or one of ``INDEXER_LOSS_MODES`` on a full layer (``has_indexer``) without a
    cache (the loss is a prefill's, over the prompt's own pools)."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "dense" and cache is not None and getattr(cache, "key_valid", None) is None:
        raise ValueError("attention='dense' needs a contiguous cache (DsaCache) or none: a paged cache "
                         "keeps no per-slot mask of the visible tokens")
    if indexer_loss is None:
        return
    if indexer_loss not in INDEXER_LOSS_MODES:
        raise ValueError(f"indexer_loss must be None or one of {INDEXER_LOSS_MODES}, got {indexer_loss!r}")
    if not has_indexer:
        raise ValueError(f"indexer_loss={indexer_loss!r}: layer {layer_idx} is a 'shared' layer (it reuses "
                         "its full layer's ids and has no indexer to train)")
    if cache is not None:
        raise ValueError(f"indexer_loss={indexer_loss!r} is a prefill's loss: call without a cache "
                         "(the loss scores the prompt's own pools)")
