"""The names of the layer's pipeline steps: the ``jax.named_scope`` each one runs under.

Rule: a step's name is the name of the ``DsaAttention`` method that runs it (the indexer's
projection, ``DsaIndexer.project``, is ``"index_project"``, to tell it from the layer's
``project``). The kernel a step calls (``kpool_compress``, ``index_scores``, ...) is not
the step: a step also reads or writes the cache around its kernel, and the contiguous and
paged caches run the same step over different kernels (``index_scores`` /
``index_scores_paged``). Why one home: the layer (``glm5_dsa_jax.layer``), the caches'
tile scorer (wrapped by the layer), the indexer and the
test that finds every step in a compiled step's HLO (``tests/test_layer_steps.py``) must
spell each name the same way, or a profile silently loses a step.

Invariants: every name is a distinct identifier-like string (an HLO op's metadata shows
``.../<name>/...``); ``FULL_STEPS`` lists, in pipeline order, the steps a layer with an
indexer runs, ``SHARED_STEPS`` those of a ``"shared"`` layer (it reuses its full layer's
token ids).
"""

from __future__ import annotations

__all__ = [
    "PROJECT", "INDEX_PROJECT", "COMPRESS_POOLS", "SCORE_POOLS", "SELECT_POOLS",
    "EXPAND_TO_TOKENS", "SPARSE_ATTENTION", "OUTPUT_PROJECTION", "FULL_STEPS", "SHARED_STEPS",
]

PROJECT = "project"
INDEX_PROJECT = "index_project"
COMPRESS_POOLS = "compress_pools"
SCORE_POOLS = "score_pools"
SELECT_POOLS = "select_pools"
EXPAND_TO_TOKENS = "expand_to_tokens"
SPARSE_ATTENTION = "sparse_attention"
OUTPUT_PROJECTION = "output_projection"

FULL_STEPS = (PROJECT, INDEX_PROJECT, COMPRESS_POOLS, SCORE_POOLS, SELECT_POOLS, EXPAND_TO_TOKENS,
              SPARSE_ATTENTION, OUTPUT_PROJECTION)
SHARED_STEPS = (PROJECT, SPARSE_ATTENTION, OUTPUT_PROJECTION)
