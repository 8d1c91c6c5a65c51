"""Named residuals of one DSA layer and the ``jax.checkpoint`` policies that pick among them.

A training step differentiates the layer (``jax.grad`` / ``nnx.grad`` of a loss of its
output). Under ``jax.checkpoint(f, policy=policy(...))`` (or ``nnx.remat``) the backward pass
keeps only the values the policy saves and recomputes the rest from the layer's input. The
layer marks its residuals with ``jax.ad_checkpoint.checkpoint_name`` under the names below
(``DsaAttention.forward``); a policy is a set of those names.

Invariants:

* Every named residual is ``O(tokens)``: per token it is a row of fixed width (``residual_widths``),
  whatever the context. Nothing ``[queries, pools]`` or ``[queries, keys]`` is ever named or
  saved: the indexer's scores live inside one query tile (``DsaAttention.by_query_tiles``) and are
  not differentiated (``forward`` stops the gradient of the indexer's outputs: the selection
  is discrete). So a training step's activation memory per token per layer is flat in the
  context under every policy here (``tests/test_grad_layer.py`` checks it with the compiled
  memory analysis).
* Names are unique to this layer (``"dsa_..."``): a model's own ``checkpoint_name``\\ s do not
  collide with them, and a model may add these to its own policy.
* ``TOKEN_IDS`` is in every policy: recomputing the selection (scores over every pool of the
  context, then the top-k) is the layer's one super-linear step, and the ids are integers
  (no gradient), 4 bytes per selected slot.

Why names rather than ``dots_saveable`` and friends: the layer's expensive products (the
indexer's scores) are exactly the ones a backward pass needs least, and the sparse
attention's outputs come from a kernel (no dot for a generic policy to see).

The sparse attention's own residuals (``pallas_kernels.sparse_mla``'s custom VJP keeps its
queries, the latent rows, the ids, its output and log-sum-exp) are saved as they are
without ``jax.checkpoint``; under a policy here the attention's forward runs again in the
backward pass (as FlashAttention recomputes), never the indexer.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["Q_RESID", "Q_LAT", "LATENT", "TOKEN_IDS", "O_LAT", "RESIDUALS", "residual_widths",
           "POLICIES", "TILE_POLICY", "policy", "saved_by", "name", "saved_bytes_per_token"]

#: ``[B, S, q_lora]`` the normalised query down-projection (``DsaAttention.project``).
Q_RESID = "dsa_q_resid"
#: ``[B, S, H, CR]`` the absorbed queries (``project``), the sparse attention's queries.
Q_LAT = "dsa_q_lat"
#: ``[B, S, CR]`` the chunk's latent rows (``project``), before the cache stores them.
LATENT = "dsa_latent"
#: ``[B, S, W]`` int32 the selected token slots (``expand_to_tokens``; a shared layer's reused ids).
TOKEN_IDS = "dsa_token_ids"
#: ``[B, S, H, C]`` the sparse attention's output in latent space (``sparse_attention``).
O_LAT = "dsa_o_lat"

RESIDUALS = (Q_RESID, Q_LAT, LATENT, TOKEN_IDS, O_LAT)

#: The policies, by name: the residuals each saves.
#:
#: * ``"selection"`` (the default): the ids only. Least memory; the backward recomputes the
#:   projections and the sparse attention's forward, never the indexer.
#: * ``"attention"``: also the attention's inputs and output (``Q_RESID``, ``Q_LAT``, ``LATENT``,
#:   ``O_LAT``): fewer projections recomputed (the down-projections and the per-head query
#:   still are, for their own backward; the attention's forward too, for its log-sum-exp),
#:   ``H * (CR + C) + q_lora + CR`` activations per token more (~135 KiB in bf16 at
#:   GLM-5.3-Flash dims, against 8 KiB of ids).
POLICIES: dict[str, tuple[str, ...]] = {
    "selection": (TOKEN_IDS,),
    "attention": (TOKEN_IDS, Q_RESID, Q_LAT, LATENT, O_LAT),
}


#: The policy of one query tile's sparse attention (``DsaAttention(remat_tiles=True)``):
#: nothing saved inside it. Its inputs (the tile's queries, its ids: ``4 * W`` bytes per
#: query; the latent rows, shared by every tile) are what the tile keeps; its own residuals
#: (``"xla"``: the gathered rows, ``[W, CR]`` per query; a custom VJP: its output and
#: log-sum-exp) are recomputed in the backward pass, the selection never is (it is outside).
TILE_POLICY = jax.checkpoint_policies.nothing_saveable


def policy(kind: str = "selection"):
    """The ``jax.checkpoint`` policy ``kind`` of ``POLICIES``:
    ``jax.checkpoint_policies.save_only_these_names`` of its residuals. Use as
    ``jax.checkpoint(loss, policy=policy("selection"))`` or ``nnx.remat(f, policy=...)``.
    ``ValueError`` names the known kinds for another ``kind``."""
    return jax.checkpoint_policies.save_only_these_names(*saved_by(kind))


def saved_by(kind: str) -> tuple[str, ...]:
    """The residuals policy ``kind`` saves (``POLICIES[kind]``); ``ValueError`` naming the
    known kinds for another ``kind``."""
    if kind not in POLICIES:
        raise ValueError(f"checkpoint policy kind must be one of {sorted(POLICIES)}, got {kind!r}")
    return POLICIES[kind]


def name(x: jax.Array, residual: str) -> jax.Array:
    """``x`` marked as the layer's residual ``residual`` (one of ``RESIDUALS``): the identity,
    but a ``jax.checkpoint`` policy may save it by that name."""
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
    return checkpoint_name(x, residual)


def residual_widths(cfg) -> dict[str, int]:
    """Elements per token of each named residual for ``cfg`` (``W = cfg.out_width``)."""
    return {
        Q_RESID: cfg.q_lora_rank,
        Q_LAT: cfg.num_attention_heads * cfg.kv_cache_dim,
        LATENT: cfg.kv_cache_dim,
        TOKEN_IDS: cfg.out_width,
        O_LAT: cfg.num_attention_heads * cfg.kv_lora_rank,
    }


def saved_bytes_per_token(cfg, kind: str = "selection", dtype=jax.numpy.bfloat16) -> int:
    """Bytes per token per layer that policy ``kind`` saves for the backward pass, activations
    in ``dtype`` (the ids are int32): the floor of a training step's activation memory under
    it (the compiled step adds the layer input and the transients of one query tile)."""
    widths = residual_widths(cfg)
    size = jax.numpy.dtype(dtype).itemsize
    return sum(widths[r] * (4 if r == TOKEN_IDS else size) for r in saved_by(kind))
