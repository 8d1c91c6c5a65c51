"""Pallas GPU kernels of the DSA pipeline, one module per step.

Axis letters, used by every kernel doc, shape comment and error message of this package
(``T`` in ``selection`` / ``radix_select`` is not an axis: the threshold key):

* ``B``: batch (sequences).
* ``S``: chunk tokens, the new tokens of one layer step (1 for a decode step).
* ``Q``: queries a kernel call sees (the chunk, or a tile of ``block_q`` of it).
* ``L``: token slots of a row (the cache length, or the pooled window).
* ``P``: pools of a row, ``max(1, L // KP)``.
* ``KP``: kpool width, the tokens of one pool (``index_kpool``).
* ``K``: pools selected per query (``select_k``); ``TW``: tail slots (``KP - 1``, or 0).
* ``H``: attention heads; ``Hi``: indexer heads.
* ``C``: latent width (``kv_lora_rank``); ``D``: indexer head dim.
* ``R``: RoPE width (``qk_rope_head_dim``, 0 for GLM-5.3); ``CR``: width of a latent cache
  row, ``C + R`` (the latent, then the shared roped key ``k_rot``); ``V``: the leading
  columns of a row that are values (``C``).
* ``W``: width of a selected-id row (``out_width = K*KP + TW``).
* A ``_pad`` suffix (``D_pad``, ``Hi_pad``, ...): that axis rounded up to a power of two
  (at least 16 for a ``dot`` operand) inside a kernel block; the extra entries are masked.
* Paged cache: ``N``: pages of the shared page pool; ``PG``: pages per sequence (the
  block table's width); ``PPP``: pools per page (``page_size // KP``).

The paged layout (a page holds ``page_size`` tokens, a multiple of ``KP``, 64 by default):
``block_table [B, PG]`` int32 names the page holding tokens ``[j*page_size, (j+1)*page_size)``
of sequence ``b`` (``-1``: none; positions start at 0 with no holes, so ``first_key`` is 0);
``pooled_pages [N, PPP, D]`` holds pool ``p`` of sequence ``b`` at ``[block_table[b, p //
PPP], p % PPP]``; the latent pool ``[N * page_size, CR]`` (passed as ``[1, L, CR]``) holds token
``t`` at slot ``block_table[b, t // page_size] * page_size + t % page_size``.

A row of selected token ids is called ``token_ids`` everywhere (``[B, Q, W]`` int32, ``-1``
= no token); the layer returns it as ``topk`` and a shared layer takes it back as
``prev_topk`` (public names). A model whose indexer selects tokens directly (``glm_moe_dsa``, ``deepseek_v32``)
runs the same kernels at ``KP = 1`` without a tail: a pool is a token, ``P = L``, ``K =
min(index_topk, L)``, and ``expand_selection`` maps pool ``p`` to token ``first_key + p``.

Each step module holds the Pallas kernel (Triton backend), its public wrapper and the
plain-jnp reference that ``implementation="xla"`` runs (``scoring`` holds both scoring
wrappers, ``index_scores`` and ``index_scores_paged``: one reference, one dispatch, one
kernel body per backend, the key source, contiguous or a block table, their only
difference). Every wrapper of a step kernel takes ``implementation`` (an
``Implementation``: ``"xla"``, ``"pallas"``, ``"pallas_interpret"``, ``"mosaic"``,
``"mosaic_interpret"``, ``"auto"``; see ``_common``) and ``block_sizes``, an instance of
the kernel's frozen block-size dataclass (``None``: its defaults), validated under every
implementation. A step's Mosaic GPU kernel (Hopper and newer, jax >= 0.11)
lives in ``mosaic_<step>.py`` beside the Triton one, dispatched from the same wrapper with
its own block-size dataclass (``topk_pools``: ``mosaic_selection``); a step with no Mosaic
kernel maps ``"mosaic"`` to ``"pallas"`` and ``"mosaic_interpret"`` to ``"pallas_interpret"``
(``without_mosaic``: Triton runs wherever Mosaic GPU does, so a layer asked for
``"mosaic"`` runs every step, the Mosaic kernels where they exist). ``"auto"`` resolves
when a wrapper is traced: Mosaic on a CUDA GPU where that step's Mosaic kernels have run
right on its class of GPU (``_hardware_runs``), Triton on other CUDA GPUs, ``"xla"``
elsewhere::

    k, gate, valid, ape -> kpool_compress   (pooling)   -> pooled keys [B, P, D], first_key, pool valid
                        -> index_scores     (scoring)   -> [B, Q, P] float32 scores (-inf = no candidate)
                        -> topk_pools       (selection) -> [B, Q, K] pool ids (ascending, -1 after)
                        -> expand_selection (expansion) -> token_ids [B, Q, W] (-1 = none)
                        -> sparse_mla       (attention) -> absorbed MLA over those tokens [B, Q, H, V]

    paged cache:  pooled_pages [N, PPP, D], block_table [B, PG], pool_counts [B]
                        -> index_scores_paged (scoring)  -> [B, Q, PG*PPP] scores, own live pools only
                        -> topk_pools(..., n_live=visible pools) -> [B, Q, K] (nothing past n_live read)
                        -> expand_selection -> positions; the caller maps them to slots of the latent pool
                        -> sparse_mla over latent [1, N*page_size, CR] (shared by every row)

``streaming_selection`` holds ``streaming_topk``: ``topk_pools`` over a row scored tile by
tile up to a device-side tile count (what ``implementation="xla"`` runs, so its work follows
the live pools); it is an xla-only op, with neither ``implementation`` nor ``block_sizes``
(its ``tile`` is the caller's pool tile; Triton has no sort for its running merge);
``attention_backward`` holds ``sparse_mla``'s backward (``sparse_mla_backward``: a
reference and Triton kernels, the Mosaic ones in ``mosaic_attention_backward``;
``sparse_mla`` is a ``jax.custom_vjp`` under every implementation), ``transpose`` the
token-major ``selection_transpose`` its deterministic latent gradient walks;
``scoring_backward`` the backward of ``index_scores`` / ``index_scores_paged`` (their
``jax.custom_vjp``: no ``[Q, P, Hi]`` tensor, deterministic; Mosaic kernels in
``mosaic_scoring_backward``); ``radix_select`` holds the Pallas kernels behind
``topk_pools``; ``causal_attention`` ``causal_mla``, the dense attention of every visible key
(``attention="dense"``; ``sparse_mla`` over the visible slots under the Pallas
implementations, a tiled online softmax under ``"xla"``); ``dense_mla`` the dense
oracle of ``sparse_mla`` (``topk_to_mask``, ``mla_masked_attention``) and the softmax
pieces both attention kernels share (``masked_softmax``, ``combine_splits``).

What several kernels share lives in private modules that import no kernel module, so no
Triton module imports a Mosaic one and no kernel module imports another kernel's module
for a helper (a wrapper imports only its own step's kernels, to dispatch to them;
``tests/test_structure.py`` checks it): ``_common`` the implementation names, checks and
CUDA-lowering helpers the wrappers and tests share; ``_mosaic`` when the Mosaic kernels run
(``mosaic_takes``: 16-bit operands on a target with ``wgmma``) and their checks;
``_dtypes`` the fp8 operands (``key_dot_dtype``, ``check_key_scale``); ``_mla`` what the
Triton sparse-MLA forward and backward share (``gather_rows``, the id row's scan, the dots);
``_scores`` what the indexer's scoring and its backward share (the candidate rule, the
dots' dtypes); ``_order_key`` the
order key of ``topk_pools``' tie rule (``order_key``, ``NEG_INF_KEY``); ``_hardware_runs``
the record of which kernels have run right on which GPUs, which ``"auto"`` picks from
(``HARDWARE_RUNS``, ``hardware_table``; docs/kernels.md). The names other
packages use (``check_implementation``, ``MOSAIC_MIN_JAX`` / ``jax_version``,
``lower_for_cuda`` / ``cuda_lowering`` / ``cuda_mesh`` / ``triton_calls`` / ``mosaic_modules`` /
``unsigned_compares``, ``order_key``) are exported here, so no module
outside ``pallas_kernels`` imports a private one.
"""

from pallas_kernels._common import (
    IMPLEMENTATIONS, MOSAIC_MIN_JAX, Implementation, check_implementation, cuda_lowering, cuda_mesh,
    jax_version, lower_for_cuda, mosaic_modules, resolve_implementation, triton_calls,
    unsigned_compares,
)
from pallas_kernels._hardware_runs import (
    AUTO_NEEDS, HARDWARE_RUNS, KERNEL_SOURCES, HardwareRun, auto_picks_mosaic, device_class, fingerprints,
    hardware_table, proven, source_fingerprint,
)
from pallas_kernels.attention import (
    MosaicSparseMlaBlockSizes, SparseMlaBlockSizes, sparse_mla, sparse_mla_partial, sparse_mla_reference,
)
from pallas_kernels.attention_backward import (
    SparseMlaBackwardBlockSizes, sparse_mla_backward, sparse_mla_backward_reference,
)
from pallas_kernels.causal_attention import causal_mla, causal_mla_reference, causal_visible
from pallas_kernels.dense_mla import mla_masked_attention, topk_to_mask
from pallas_kernels.expansion import (
    ExpandSelectionBlockSizes, compact_row, expand_selection, expand_selection_reference, tail_slots,
    visible_tail,
)
from pallas_kernels.pooling import (
    KpoolCompressBlockSizes, first_valid, kpool_compress, kpool_compress_reference, num_pools,
)
from pallas_kernels._order_key import order_key
from pallas_kernels.scoring import (
    IndexScoresBlockSizes, MosaicIndexScoresBlockSizes, gather_pools, index_scores,
    index_scores_paged, index_scores_paged_reference, index_scores_reference, pool_last_token,
)
from pallas_kernels.scoring_backward import (
    IndexScoresBackwardBlockSizes, index_scores_backward, index_scores_backward_reference,
)
from pallas_kernels.selection import (
    MosaicTopkPoolsBlockSizes, TopkPoolsBlockSizes, topk_pools, topk_pools_reference, visible_pool_ids,
)
from pallas_kernels.streaming_selection import streaming_topk
from pallas_kernels.transpose import SelectionTranspose, selection_transpose

__all__ = [
    "IMPLEMENTATIONS", "Implementation", "resolve_implementation", "check_implementation",
    "MOSAIC_MIN_JAX", "jax_version", "lower_for_cuda", "cuda_lowering", "cuda_mesh", "triton_calls",
    "mosaic_modules", "unsigned_compares", "HARDWARE_RUNS", "HardwareRun", "hardware_table",
    "AUTO_NEEDS", "KERNEL_SOURCES", "auto_picks_mosaic", "device_class", "fingerprints", "proven",
    "source_fingerprint",
    "ExpandSelectionBlockSizes", "compact_row", "expand_selection", "expand_selection_reference",
    "tail_slots",
    "visible_tail",
    "IndexScoresBlockSizes", "MosaicIndexScoresBlockSizes", "index_scores",
    "index_scores_reference", "pool_last_token",
    "gather_pools", "index_scores_paged", "index_scores_paged_reference",
    "IndexScoresBackwardBlockSizes", "index_scores_backward", "index_scores_backward_reference",
    "KpoolCompressBlockSizes", "first_valid", "kpool_compress", "kpool_compress_reference",
    "num_pools",
    "MosaicSparseMlaBlockSizes", "SparseMlaBlockSizes", "mla_masked_attention", "sparse_mla",
    "sparse_mla_partial", "sparse_mla_reference", "SparseMlaBackwardBlockSizes", "sparse_mla_backward",
    "sparse_mla_backward_reference", "SelectionTranspose", "selection_transpose",
    "topk_to_mask", "causal_mla", "causal_mla_reference", "causal_visible",
    "MosaicTopkPoolsBlockSizes", "TopkPoolsBlockSizes", "order_key", "topk_pools", "topk_pools_reference",
    "visible_pool_ids", "streaming_topk",
]
