"""Pallas GPU kernels of the DSA pipeline, one file per step.

Each file holds the Pallas kernel (Triton backend), its public wrapper, which takes
``implementation`` (``"xla"``, ``"pallas"``, ``"pallas_interpret"``) and block sizes, and the
plain-jnp reference that ``implementation="xla"`` runs::

    k, gate, valid, ape -> kpool_compress   -> pooled keys [B, P, D], first_key, pool valid
                        -> index_scores     -> [B, Q, P] float32 scores (-inf = no candidate)
                        -> topk_pools       -> [B, Q, select_k] pool ids (ascending, -1 after)
                        -> expand_selection -> [B, Q, out_width] token ids (-1 = none)
                        -> sparse_mla       -> absorbed MLA over those tokens
"""

from pallas_kernels._common import IMPLEMENTATIONS
from pallas_kernels.expand_selection import (
    compact_row, expand_selection, expand_selection_reference, visible_tail,
)
from pallas_kernels.index_scores import index_scores, index_scores_reference, pool_last_token
from pallas_kernels.kpool_compress import (
    first_valid, kpool_compress, kpool_compress_reference, num_pools,
)
from pallas_kernels.sparse_mla import (
    mla_masked_attention, sparse_mla, sparse_mla_reference, topk_to_mask,
)
from pallas_kernels.topk_pools import order_key, topk_pools, topk_pools_reference

__all__ = [
    "IMPLEMENTATIONS",
    "compact_row", "expand_selection", "expand_selection_reference", "visible_tail",
    "index_scores", "index_scores_reference", "pool_last_token",
    "first_valid", "kpool_compress", "kpool_compress_reference", "num_pools",
    "mla_masked_attention", "sparse_mla", "sparse_mla_reference", "topk_to_mask",
    "order_key", "topk_pools", "topk_pools_reference",
]
