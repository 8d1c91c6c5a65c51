"""Index scoring: the lightning indexer's score of every (query, pool) pair, with the pooled
keys read from one of two sources.

Axis letters as in the package glossary (``pallas_kernels``; ``Hi``: indexer heads; ``N``
pages of the pool, ``PG`` pages per sequence, ``PPP`` pools per page). The two key sources
are the only difference between the two public wrappers:

* ``index_scores``: contiguous keys, ``pooled [B, P, D]`` (from ``kpool_compress``) with
  ``pool_valid [B, P]`` and ``first_key [B]`` (the first token of pool 0).
* ``index_scores_paged``: keys held in pages through a block table (the paged cache's
  layout). A page holds ``page_size`` tokens (a multiple of ``KP``), so ``PPP = page_size
  // KP`` pools; ``pooled_pages [N, PPP, D]`` is shared by every sequence and pool ``p`` of
  sequence ``b`` lives at ``pooled_pages[block_table[b, p // PPP], p % PPP]``.
  ``block_table [B, PG]`` int32: entry ``j`` is the page holding tokens ``[j * page_size,
  (j + 1) * page_size)``, or ``-1`` (none); positions start at 0 with no holes, so
  ``first_key = 0``. ``pool_counts [B]``: the sequence's complete pools (its pools ``[0,
  pool_counts[b])`` are written). The result is ``[B, Q, PG * PPP]``.

Invariants (both sources):

* ``score[b, t, p] = sum_h w[b, t, h] * relu((q[b, t, h] . key[b, p]) * D**-0.5)``
  (``h`` over the ``Hi`` indexer heads), computed in float32 whatever the input dtype.
* Pool ``p`` is a *candidate* for query ``t`` when it is valid and its last token,
  ``first_key + (p + 1)*KP - 1``, is at or before the query's position ``q_pos[b, t]``
  (causal; a padding query has ``q_pos = -1`` and so no candidate). A paged pool is valid
  iff ``p < pool_counts[b]`` and its page entry is in ``[0, N)``. Non-candidates score
  ``-inf``; so does a NaN score, so that a NaN never wins a top-k slot.
* ``-0.0`` is returned as ``+0.0``: ReLU makes exact zeros common, and the top-k tie rule
  must see ``w * 0 < 0`` and ``0`` as the same score.
* Block sizes (``IndexScoresBlockSizes``) change the tiling only; within a pool tile, the
  head sum's order is the kernel's own (see the float tolerance of the tests).
* fp8 keys: with ``pooled_scale`` (float32, one per pool: ``[B, P]``, or ``[N, PPP]``
  paged with the keys) the keys are ``float8_e4m3fn`` and the key of a pool is its e4m3
  row times its scale (``glm5_dsa_jax.cache.fp8``). The scale multiplies the head-summed score,
  after the ReLU: ``score = scale * sum_h w * relu((q . k8) * D**-0.5)``, equal to the
  score of the dequantised key because a scale is positive. The e4m3 key is converted to
  the query's dtype (exact for bf16 / f16, whose products stay exact in float32) inside
  the kernel; the reference does the same conversion, the same dot and the same order
  (``pallas_kernels._dtypes``).
* int8 keys: with ``pooled_scale`` ``[B, P, G]`` (``[N, PPP, G]`` paged; ``G`` divides
  ``D``) the keys are ``int8`` and the key of a pool is each ``D / G``-column group times
  its scale. A group's scale does not commute with the sum over the columns, so the key is
  dequantised to float32 before the dot: in the reference (``_dtypes.dequantize_key_groups``)
  and in the Triton kernel at the tile's load (one gather of the ``[block_p, block_d]``
  scales per tile); the dot is float32 (IEEE, ``allow_tf32=False``), the score the float32
  score of the dequantised key. Under ``"mosaic"`` the Triton kernel runs (int8 is not a
  wgmma operand here). The keys get no gradient (a serving format; ``float0``).
* Nothing a sequence does not own is read: a ``-1`` (or out-of-range) page entry and a
  pool at or past ``pool_counts[b]`` are never loaded (the reference's gather fills them
  with zeros; the kernels mask the load or skip the tile), so whatever such a page holds
  (NaN, another sequence's keys) cannot reach the scores.
* Work follows the live pools: a Pallas program whose pool tile starts at or past what
  its queries can see (``first_key + (p + 1)*KP - 1 > q_pos`` for every pool and query of
  the tile; paged: also at or past ``pool_counts[b]``) loads no key and writes ``-inf``,
  so a cache sized for a long capacity costs what its filled part costs.

Differentiable (issue 24) w.r.t. ``q``, ``w`` and the pooled keys (``pooled`` /
``pooled_pages``) under every implementation, ``"xla"`` included: one ``jax.custom_vjp``
(``_differentiable``) whose residuals are the operands themselves (nothing ``[Q, P, Hi]``
is saved) and whose backward is ``pallas_kernels.scoring_backward`` (the reference in
query tiles for ``"xla"``, Triton kernels otherwise; deterministic). The integer / bool
operands and the fp8 scale get no gradient; a non-candidate (``-inf``) score passes none.
The paged backward gathers each sequence's pools (as the paged reference does), runs the
contiguous backward and puts each pool's gradient back into the one page slot that holds
it (``_into_pages``: an integer scatter of the owner, then a gather; no float sum).

One family, so that the key source is the only difference:

* One reference: ``index_scores_reference``. ``index_scores_paged_reference`` gathers
  each sequence's pages into contiguous rows (``gather_pools``) and calls it, so the paged
  result *is* the contiguous one on the gathered rows, bit for bit.
* One validation of the queries and scales, one dispatch (``_run_scores``: the reference,
  the Mosaic kernel where it takes the operands, else Triton) and one pair of block-size
  dataclasses for both wrappers.
* One Triton kernel body (``_scores_kernel``) for both; a key source
  (``_ContiguousKeys`` / ``_PagedKeys``) supplies the tile's live bound and its key load
  (a direct index vs. one through the block table); the arithmetic is one function.
* One Mosaic kernel body for both (``pallas_kernels.mosaic_scoring``: ``page_chunk`` picks
  a direct TMA or one per page chunk).
* Not shared, because the operands differ: each wrapper checks its own key source's
  operands (with the messages and in the order it always has), and each backend has one
  thin entry per source that turns them into the kernel's operands (``pool_valid`` as
  int8, or the pages viewed flat ``[N * PPP, D]``; Mosaic: per-pool validity and
  visibility precomputed from the block table).

The Mosaic GPU kernel (``implementation="mosaic"`` / ``"mosaic_interpret"``, jax >= 0.11,
Hopper and newer) keeps this contract for 16-bit ``q`` and keys of one dtype, with its own
block sizes, ``MosaicIndexScoresBlockSizes`` (``block_sizes`` must then be one, or
``None``); its summation order is the tensor cores' (see that module's doc on equality).
Paged, it copies keys by TMA a chunk of ``min(PPP, block_p)`` pools at a time (``PPP`` a
multiple of 8): a chunk whose first pool is not live is never read, but the chunk holding a
row's last written pool is copied whole, so that page's unwritten pools after it are loaded
(each is its own MMA row and is masked to ``-inf``: its contents cannot reach another
pool's score). Other dtypes (float32: wgmma's is TF32; fp8 keys) run this module's Triton
kernel at its default block sizes, as a step with no Mosaic kernel does, so a float32 layer
asked for ``"mosaic"`` still runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    Implementation, check_positive_int, check_power_of_two, check_rank, check_triton_params,
    eager_jit, kernel_family, next_power_of_two, without_mosaic,
)
from pallas_kernels._dtypes import INT8, check_key_groups, dequantize_key_groups
from pallas_kernels._mosaic import mosaic_takes
from pallas_kernels._scores import (
    candidates, channels, check_triton_dtypes, pool_last_token, reference_dot_dtype,
    score_dot_dtype, visible_pools,
)
from pallas_kernels.scoring_backward import index_scores_backward
from pallas_kernels.mosaic_scoring import (
    MosaicIndexScoresBlockSizes, mosaic_index_scores, mosaic_index_scores_paged,
)

__all__ = [
    "index_scores", "index_scores_reference", "IndexScoresBlockSizes", "pool_last_token",
    "MosaicIndexScoresBlockSizes", "index_scores_paged", "index_scores_paged_reference",
    "gather_pools",
]


FLOAT32_DECODE_BLOCK_P, FLOAT32_DECODE_WARPS = 32, 8  # see IndexScoresBlockSizes


@dataclasses.dataclass(frozen=True)
class IndexScoresBlockSizes:
    """Tiling of the Pallas ``index_scores`` and ``index_scores_paged`` (one kernel body).

    * ``block_q``: queries per program (a power of two), which share one pooled-key tile;
    * ``block_p``: pools per program, the dot's N (a power of two >= 16);
    * ``num_warps`` (a power of two), ``num_stages`` (an int >= 1): Triton's.

    Both tiles are capped at the padded problem size (``resolve``), so a decode step
    (``Q = 1``) runs one query per program. A float32 dot (int8 keys) of one query gets
    ``FLOAT32_DECODE_BLOCK_P`` pools on ``FLOAT32_DECODE_WARPS`` warps or more: on 64 pools and
    4 warps it spilled ~6 KB a thread on sm_80 and sm_90 (``glm5-dsa gpu-compile``).
    """

    block_q: int = 16
    block_p: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def validate(self) -> "IndexScoresBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        check_power_of_two("IndexScoresBlockSizes.block_q", self.block_q)
        check_power_of_two("IndexScoresBlockSizes.block_p", self.block_p, minimum=16)
        check_triton_params("IndexScoresBlockSizes", self.num_warps, self.num_stages)
        return self

    def resolve(self, n_queries: int, n_pools: int, float32_dot: bool = False) -> "IndexScoresBlockSizes":
        """The launch sizes for ``Q = n_queries``, ``P = n_pools``, a float32 dot or not."""
        self.validate()
        out = dataclasses.replace(self, block_q=min(self.block_q, next_power_of_two(n_queries)),
                                  block_p=min(self.block_p, next_power_of_two(n_pools, 16)))
        if float32_dot and out.block_q == 1:
            out = dataclasses.replace(out, block_p=min(out.block_p, FLOAT32_DECODE_BLOCK_P),
                                      num_warps=max(out.num_warps, FLOAT32_DECODE_WARPS))
        return out


def _finish_scores(score, pool_valid, first_key, q_pos, kpool):
    """Apply the candidate mask and the sign / NaN canonicalisation (as the kernels do)."""
    cand = candidates(pool_valid, first_key, q_pos, kpool)
    score = jnp.where(score == 0.0, 0.0, score)
    return jnp.where(cand & ~jnp.isnan(score), score, -jnp.inf)


def index_scores_reference(
    q: jax.Array,
    w: jax.Array,
    pooled: jax.Array,
    pool_valid: jax.Array,
    first_key: jax.Array,
    q_pos: jax.Array,
    pooled_scale: jax.Array | None = None,
    *,
    kpool: int,
) -> jax.Array:
    """Plain-jnp scores.

    Args:
      q: ``[B, Q, Hi, D]`` indexer queries ``wq_b(q_resid)``.
      w: ``[B, Q, Hi]`` float32 head weights ``weights_proj(x) * Hi**-0.5``.
      pooled: ``[B, P, D]`` pooled keys from ``kpool_compress``.
      pool_valid: ``[B, P]`` bool.
      first_key: ``[B]`` int32.
      q_pos: ``[B, Q]`` int32 token position of each query, ``-1`` for a padding query.
      pooled_scale: ``[B, P]`` float32 scale of each pool when ``pooled`` is fp8 (e4m3),
        else None.
      kpool: tokens per pool.

    Returns:
      ``[B, Q, P]`` float32 scores, ``-inf`` where the pool is not a candidate.
    """
    d = q.shape[-1]
    if pooled.dtype == INT8:  # int8 keys: their group scales before the dot (float32)
        pooled, pooled_scale = dequantize_key_groups(pooled, pooled_scale), None
    # Products of 16-bit floats are exact in float32, so a dot in the inputs' dtype with a
    # float32 accumulator is the float32 computation (up to summation order) without
    # converting the whole pooled cache to float32 on every step.
    # The query and head axes merge into one ``[B, Q*Hi, D]`` operand: the same products and
    # sums, but XLA:CPU's dot of one free axis ran about 1.8x faster than with two at batch
    # 1 (0.30 vs 0.55 ms for a 8192-pool tile at GLM-5.3-Flash shapes; no change at batch 8).
    dt = reference_dot_dtype(q.dtype, pooled.dtype)
    b, nq, hi = q.shape[:3]
    s = jnp.einsum(
        "bxd,bpd->bxp", q.astype(dt).reshape(b, nq * hi, d), pooled.astype(dt),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    ).reshape(b, nq, hi, pooled.shape[1])
    s = jax.nn.relu(s * (d**-0.5))
    score = jnp.einsum(
        "bqh,bqhp->bqp", w.astype(jnp.float32), s, precision=jax.lax.Precision.HIGHEST
    )
    if pooled_scale is not None:  # e4m3 keys: the pool's scale, after the head sum
        score = score * pooled_scale.astype(jnp.float32)[:, None, :]
    return _finish_scores(score, pool_valid, first_key, q_pos, kpool)


def _pool_slots(pooled_pages, block_table):
    """``[B, PG * PPP]`` int32: the flat ``[N * PPP]`` slot of every pool of every sequence,
    and whether it is owned (page entry in ``[0, N)``)."""
    n_pages, ppp = pooled_pages.shape[:2]
    pages = jnp.repeat(block_table.astype(jnp.int32), ppp, axis=1)  # [B, PG*PPP]
    within = jnp.tile(jnp.arange(ppp, dtype=jnp.int32), block_table.shape[1])
    owned = (pages >= 0) & (pages < n_pages)
    return jnp.where(owned, pages * ppp + within[None, :], n_pages * ppp), owned


def gather_pools(pooled_pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """``pooled_pages [N, PPP, D]``, ``block_table [B, PG]`` -> ``[B, PG * PPP, D]``: each
    sequence's pools in order; a pool whose page entry is ``-1`` (or out of range) is zeros
    and is never read (``jnp.take(..., mode="fill")`` on a slot past the pool).

    8- and 16-bit floats are gathered through their bits (as ``attention.gather_rows``):
    XLA:CPU would otherwise convert the whole pool to a wider float first. ``pooled_pages``
    may also be ``[N, PPP]`` (the fp8 scales), giving ``[B, PG * PPP]``.
    """
    n_pages, ppp = pooled_pages.shape[:2]
    flat = pooled_pages.reshape((n_pages * ppp,) + pooled_pages.shape[2:])
    slots, _ = _pool_slots(pooled_pages, block_table)
    take = lambda x: jnp.take(x, slots, axis=0, mode="fill", fill_value=0)
    if jnp.issubdtype(flat.dtype, jnp.floating) and flat.dtype.itemsize in (1, 2):
        bits = jax.lax.bitcast_convert_type
        uint = jnp.uint8 if flat.dtype.itemsize == 1 else jnp.uint16
        return bits(take(bits(flat, uint)), flat.dtype)
    return take(flat)


def index_scores_paged_reference(
    q: jax.Array,
    w: jax.Array,
    pooled_pages: jax.Array,
    block_table: jax.Array,
    pool_counts: jax.Array,
    q_pos: jax.Array,
    pooled_scale: jax.Array | None = None,
    *,
    kpool: int,
) -> jax.Array:
    """Plain-jnp paged scores: ``gather_pools`` (of the keys and of their fp8 scales) then
    ``index_scores_reference`` with ``first_key = 0`` and ``pool_valid = owned & (p <
    pool_counts[b])``.

    Args:
      q: ``[B, Q, Hi, D]`` indexer queries.
      w: ``[B, Q, Hi]`` float32 head weights.
      pooled_pages: ``[N, PPP, D]`` the shared pool of pooled-key pages.
      block_table: ``[B, PG]`` int32 page of each ``page_size`` tokens, ``-1`` = none.
      pool_counts: ``[B]`` int32 complete pools of each sequence.
      q_pos: ``[B, Q]`` int32 position of each query in its sequence, ``-1`` = padding.
      pooled_scale: ``[N, PPP]`` float32 scale of each pool when ``pooled_pages`` is fp8.
      kpool: tokens per pool.

    Returns:
      ``[B, Q, PG * PPP]`` float32 scores, ``-inf`` where the pool is not a candidate.
    """
    pooled, pool_valid, first_key, scale = _as_contiguous(
        pooled_pages, block_table, pool_counts, pooled_scale)
    return index_scores_reference(q, w, pooled, pool_valid, first_key, q_pos, scale, kpool=kpool)


def _as_contiguous(pooled_pages, block_table, pool_counts, pooled_scale):
    """The paged key source as the contiguous one: ``(pooled [B, PG * PPP, D], pool_valid,
    first_key = 0, scales)`` (``gather_pools``; ``pool_valid = owned & (p <
    pool_counts[b])``)."""
    _, owned = _pool_slots(pooled_pages, block_table)
    pool = jnp.arange(owned.shape[1], dtype=jnp.int32)
    pool_valid = owned & (pool[None, :] < pool_counts.astype(jnp.int32)[:, None])
    first_key = jnp.zeros(block_table.shape[:1], jnp.int32)
    scale = None if pooled_scale is None else gather_pools(pooled_scale, block_table)
    return gather_pools(pooled_pages, block_table), pool_valid, first_key, scale


def _into_pages(d_pooled, pooled_pages, block_table):
    """``d_pooled [B, PG * PPP, D]`` (each sequence's pools, as ``gather_pools`` gives them)
    -> ``[N, PPP, D]``: each page slot gets the gradient of the (sequence, pool) that names
    it; a slot no sequence names gets zeros.

    Deterministic, with no float sum: the owner of every slot is found by an *integer*
    scatter-max of ``b * PG * PPP + p`` (exact, so its order cannot matter), then each slot
    gathers its owner's row. A slot has at most one owner in a valid block table (a page
    is owned by exactly one (row, slot): ``glm5_dsa_jax.cache.pages``), so this is the
    gradient; of a table naming one page twice it keeps the last naming (by ``(b, p)``)
    instead of summing the two, so that no two sequences ever sum into one slot."""
    n_pages, ppp = pooled_pages.shape[:2]
    slots, _ = _pool_slots(pooled_pages, block_table)  # unowned: n_pages * ppp, dropped
    n_rows = slots.size
    if n_rows == 0:  # no sequence names a page
        return jnp.zeros_like(pooled_pages, d_pooled.dtype)
    source = jnp.arange(n_rows, dtype=jnp.int32)
    owner = jnp.full((n_pages * ppp,), -1, jnp.int32).at[slots.reshape(-1)].max(
        source, mode="drop")
    owner = jnp.where(owner < 0, n_rows, owner)  # no owner: past the rows, gathers zeros
    flat = d_pooled.reshape((n_rows,) + d_pooled.shape[2:])
    return jnp.take(flat, owner, axis=0, mode="fill", fill_value=0).reshape(pooled_pages.shape)


def index_scores(
    q: jax.Array,
    w: jax.Array,
    pooled: jax.Array,
    pool_valid: jax.Array,
    first_key: jax.Array,
    q_pos: jax.Array,
    pooled_scale: jax.Array | None = None,
    *,
    kpool: int,
    implementation: Implementation = "xla",
    block_sizes: IndexScoresBlockSizes | MosaicIndexScoresBlockSizes | None = None,
) -> jax.Array:
    """Indexer scores; see the module doc. Shapes as ``index_scores_reference``
    (``pooled_scale [B, P]`` with fp8 ``pooled``); ``block_sizes`` (validated under every
    implementation) tiles the kernel: an ``IndexScoresBlockSizes`` for ``"pallas"``, a
    ``MosaicIndexScoresBlockSizes`` for ``"mosaic"`` (either for ``"xla"``; ``None``: the
    defaults)."""
    implementation, mosaic, blocks = kernel_family(implementation, block_sizes, IndexScoresBlockSizes, MosaicIndexScoresBlockSizes, kernel="index_scores")
    b, nq, _, d = _check_queries(q, w)
    check_rank("pooled", pooled, 3, "[B, P, D]")
    if pooled.shape[0] != b or pooled.shape[2] != d:
        raise ValueError(f"pooled must be [B={b}, P, D={d}], got {tuple(pooled.shape)}")
    if pool_valid.shape != pooled.shape[:2]:
        raise ValueError(f"pool_valid must be [B, P] = {tuple(pooled.shape[:2])}, got {tuple(pool_valid.shape)}")
    if first_key.shape != (b,):
        raise ValueError(f"first_key must be [B] = ({b},), got {tuple(first_key.shape)}")
    if q_pos.shape != (b, nq):
        raise ValueError(f"q_pos must be [B, Q] = {(b, nq)}, got {tuple(q_pos.shape)}")
    check_key_groups("pooled", pooled, "pooled_scale", pooled_scale, "[B, P]")
    return _run_scores(
        (q, w, pooled, pool_valid, first_key, q_pos), pooled_scale, kpool=kpool,
        implementation=implementation, mosaic=mosaic, blocks=blocks,
        reference=index_scores_reference, mosaic_kernel=_index_scores_mosaic,
        pallas_kernel=_index_scores_pallas, backward=_contiguous_backward,
    )


def index_scores_paged(
    q: jax.Array,
    w: jax.Array,
    pooled_pages: jax.Array,
    block_table: jax.Array,
    pool_counts: jax.Array,
    q_pos: jax.Array,
    pooled_scale: jax.Array | None = None,
    *,
    kpool: int,
    implementation: Implementation = "xla",
    block_sizes: IndexScoresBlockSizes | MosaicIndexScoresBlockSizes | None = None,
) -> jax.Array:
    """Indexer scores over paged pooled keys (the block table as the key source); see the
    module doc. Shapes as ``index_scores_paged_reference`` (``pooled_scale [N, PPP]`` with
    fp8 keys); ``block_sizes`` (validated under every implementation) tiles the kernel as it
    tiles ``index_scores``': an ``IndexScoresBlockSizes`` for ``"pallas"``, a
    ``MosaicIndexScoresBlockSizes`` for ``"mosaic"`` (either for ``"xla"``; ``None``: the
    defaults)."""
    implementation, mosaic, blocks = kernel_family(implementation, block_sizes, IndexScoresBlockSizes, MosaicIndexScoresBlockSizes, kernel="index_scores_paged")
    b, nq, _, d = _check_queries(q, w)
    check_rank("pooled_pages", pooled_pages, 3, "[N, PPP, D]")
    if pooled_pages.shape[2] != d:
        raise ValueError(f"pooled_pages must be [N, PPP, D={d}], got {tuple(pooled_pages.shape)}")
    check_rank("block_table", block_table, 2, "[B, PG]")
    if block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B={b}, PG], got {tuple(block_table.shape)}")
    if pool_counts.shape != (b,):
        raise ValueError(f"pool_counts must be [B] = ({b},), got {tuple(pool_counts.shape)}")
    if q_pos.shape != (b, nq):
        raise ValueError(f"q_pos must be [B, Q] = {(b, nq)}, got {tuple(q_pos.shape)}")
    for name, x in (("block_table", block_table), ("pool_counts", pool_counts), ("q_pos", q_pos)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    check_positive_int("kpool", kpool)
    check_key_groups("pooled_pages", pooled_pages, "pooled_scale", pooled_scale, "[N, PPP]")
    return _run_scores(
        (q, w, pooled_pages, block_table, pool_counts, q_pos), pooled_scale, kpool=kpool,
        implementation=implementation, mosaic=mosaic, blocks=blocks,
        reference=index_scores_paged_reference, mosaic_kernel=_index_scores_paged_mosaic,
        pallas_kernel=_index_scores_paged_pallas, backward=_paged_backward,
    )


def _check_queries(q, w) -> tuple[int, int, int, int]:
    """``(B, Q, Hi, D)`` of queries ``q [B, Q, Hi, D]`` with head weights ``w [B, Q, Hi]``,
    or a ``ValueError`` naming the shapes (both wrappers)."""
    check_rank("q", q, 4, "[B, Q, Hi, D]")
    b, nq, h, d = q.shape
    if w.shape != (b, nq, h):
        raise ValueError(f"w must be [B, Q, Hi] = {(b, nq, h)}, got {tuple(w.shape)}")
    return b, nq, h, d


def _run_scores(args, pooled_scale, *, kpool, implementation, mosaic, blocks, reference,
                mosaic_kernel, pallas_kernel, backward):
    """Score checked inputs ``args = (q, w, keys, ...)`` (``keys`` the pooled keys, whole or
    paged) with the implementation ``kernel_family`` chose: ``reference`` for ``"xla"``;
    ``mosaic_kernel`` when Mosaic was asked for and takes the operands (``mosaic_takes``),
    else ``pallas_kernel``, at ``IndexScoresBlockSizes()`` when it stands in for Mosaic
    (float32 or fp8 keys: see the module doc). Shared by ``index_scores`` and
    ``index_scores_paged``, so both fall back alike, and both differentiate alike
    (``_differentiable``: ``backward`` is the key source's, called with the implementation)."""

    def forward(q, w, keys, rest, scale):
        args = (q, w, keys, *rest)
        impl, use_mosaic, sizes = implementation, mosaic, blocks
        if impl == "xla":
            return reference(*args, scale, kpool=kpool)
        if use_mosaic and not mosaic_takes(q.dtype, keys.dtype):
            impl, use_mosaic, sizes = without_mosaic(impl), False, IndexScoresBlockSizes()
        if use_mosaic:
            return mosaic_kernel(*args, kpool=kpool, interpret=impl == "mosaic_interpret",
                                 block_sizes=sizes)
        return pallas_kernel(*args, scale, kpool=kpool, interpret=impl == "pallas_interpret",
                             block_sizes=sizes)

    grad = functools.partial(backward, kpool=kpool, implementation=implementation)
    return _differentiable(forward, grad, args, pooled_scale)


def _differentiable(forward, backward, args, pooled_scale):
    """``forward(q, w, keys, rest, scale)`` under a ``jax.custom_vjp`` (every
    implementation, ``"xla"`` included) whose backward is ``backward(q, w, keys, rest,
    scale, g) -> (dq, dw, dkeys)``. The residuals are the operands themselves (the caller's
    arrays): nothing ``[Q, P, Hi]`` is saved, the backward recomputes the logits tile by
    tile. The integer / bool operands (``rest``) and the fp8 scale get no gradient (an fp8
    pooled cache is a serving format; its scale is not trained)."""
    q, w, keys, *rest = args

    @jax.custom_vjp
    def scores(q, w, keys, rest, scale):
        return forward(q, w, keys, rest, scale)

    def scores_fwd(q, w, keys, rest, scale):
        return forward(q, w, keys, rest, scale), (q, w, keys, rest, scale)

    def scores_bwd(res, g):
        q, w, keys, rest, scale = res
        if keys.dtype == INT8:  # int8 keys (a serving format) get no gradient; read dequantised
            dq, dw, _ = backward(q, w, dequantize_key_groups(keys, scale), rest, None, g)
            dkeys = np.zeros(keys.shape, jax.dtypes.float0)
        else:
            dq, dw, dkeys = backward(*res, g)
        return dq, dw, dkeys, tuple(None for _ in rest), None if scale is None else jnp.zeros_like(scale)

    scores.defvjp(scores_fwd, scores_bwd)
    return scores(q, w, keys, tuple(rest), pooled_scale)


def _contiguous_backward(q, w, pooled, rest, scale, g, *, kpool, implementation):
    """``index_scores``' backward: ``index_scores_backward`` on its operands."""
    return index_scores_backward(q, w, pooled, *rest, g, scale, kpool=kpool,
                                 implementation=implementation)


def _paged_backward(q, w, pooled_pages, rest, scale, g, *, kpool, implementation):
    """``index_scores_paged``' backward: each sequence's pools gathered (``_as_contiguous``,
    as the reference scores them), ``index_scores_backward`` on them, and their gradient
    put back into the pages (``_into_pages``: deterministic, see there)."""
    block_table, pool_counts, q_pos = rest
    if pooled_pages.shape[0] * pooled_pages.shape[1] == 0:  # no page: nothing is a candidate
        return jnp.zeros_like(q), jnp.zeros_like(w), jnp.zeros_like(pooled_pages)
    pooled, pool_valid, first_key, gathered_scale = _as_contiguous(
        pooled_pages, block_table, pool_counts, scale)
    dq, dw, d_pooled = index_scores_backward(
        q, w, pooled, pool_valid, first_key, q_pos, g, gathered_scale, kpool=kpool,
        implementation=implementation)
    return dq, dw, _into_pages(d_pooled, pooled_pages, block_table)


_index_scores_mosaic = eager_jit("kpool", "interpret", "block_sizes")(mosaic_index_scores)
_index_scores_paged_mosaic = eager_jit("kpool", "interpret", "block_sizes")(mosaic_index_scores_paged)


# --------------------------------------------------------------------------------------
# Pallas kernel (Triton backend): one body, two key sources
# --------------------------------------------------------------------------------------
#
# Grid ``(query tiles, B, pool tiles)`` over the row's pool positions (``P``, or ``PG *
# PPP`` paged). Per program:
#
# 1. Live bound: the pools the tile's queries can see, ``max over its queries of (q_pos -
#    first_key + 1) // KP`` (pool ``p`` is visible to ``t`` iff ``first_key + (p + 1)*KP -
#    1 <= q_pos``), paged also capped at ``pool_counts[b]`` (the key source's
#    ``live_bound``). A tile starting at or past it loads no key, no page entry and no
#    query: it writes ``-inf`` over its ``[block_q, block_p]`` outputs and ends. A decode
#    step in a cache sized for a long capacity reads only the pools up to its position (at
#    a 128K-token capacity and 4K live tokens, 31 of every 32 programs end there).
# 2. Otherwise the key source loads the tile's ``[block_p, D_pad]`` keys once, with which
#    pools are loaded and their last tokens (``load_tile``): contiguous, row ``b`` of
#    ``pooled`` directly and ``pool_valid``; paged, the tile's page entries
#    ``block_table[b, pool // PPP]`` (one gather: consecutive pools share a page), then the
#    keys of ``pooled_pages`` viewed flat ``[N * PPP, D]`` at slot ``page * PPP + pool %
#    PPP``, the load masked to owned pools below the live bound (a masked lane is not read).
# 3. Per query (``_score_rows``, one function for both sources) one ``dot`` ``[Hi_pad,
#    D_pad] x [D_pad, block_p]`` gives every head's logits at once (the heads are the dot's
#    M axis, so a decode step with one query still fills an MMA tile), then ReLU, the head
#    weights, the head sum, the fp8 scales and ``_finish_scores`` in-kernel (candidate mask
#    ``loaded & last <= q_pos``). The working set is one key tile plus one query's
#    ``[Hi_pad, D_pad]`` whatever the context length. The query-tile axis comes first in
#    the grid (the fastest launch axis), so the programs that share a key tile run together
#    and the tile is read from L2.
#
# Why one body: the two kernels differed only in steps 1 and 2; the key source is a static
# Python object, resolved at trace time, so no branch on it reaches the GPU: the paged
# kernel traces to exactly the program its own body did, the contiguous one to its own
# less two recomputed tile offsets (which Triton's CSE merged anyway).
#
# Precision: bf16 / f16 operands of one dtype go to the tensor cores with a float32
# accumulator (their products are exact in f32, as in the reference's f32 einsum); any
# other combination is cast to float32 and multiplied with ``allow_tf32=False`` (IEEE
# f32, not TF32), like the reference's ``Precision.HIGHEST``. fp8 (e4m3) keys are
# converted to the query's 16-bit dtype (exact) or float32 after the load, and the tile's
# pool scales (one load of ``block_p`` floats) multiply the head-summed score row; Triton
# converts e4m3 from compute capability 8.9 (``glm5_dsa_jax.cache.fp8.check_readable``).
#
# Offsets: Pallas' Triton lowering addresses a ref with 64-bit offsets once it exceeds 4 GiB
# (32-bit below, where every element offset of a 16- or 32-bit array fits), so a page pool
# of any size is addressed correctly.


def _scores_kernel(
    q_ref, w_ref, keys_ref, table_ref, row_ref, qpos_ref, *refs,  # inputs [, pscale_ref], output
    source, kpool: int, n_q: int, n_pools: int, heads: int, dim: int, block_q: int,
    block_p: int, block_h: int, block_d: int, dot_dtype,
):
    """One (query tile, row, pool tile) program. ``table_ref`` / ``row_ref`` are the key
    source's per-pool and per-row operands (``pool_valid`` / ``first_key``, or
    ``block_table`` / ``pool_counts``), read only by ``source``."""
    *pscale_ref, out_ref = refs
    q_tile, b, p_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    p0 = p_tile * block_p
    pool = p0 + jnp.arange(block_p, dtype=jnp.int32)
    pool_in = pool < n_pools
    t0 = q_tile * block_q
    n_rows = jnp.minimum(block_q, n_q - t0)

    # 1. The tile's live bound, from its queries' positions (and the row's pool count).
    tq = t0 + jnp.arange(block_q, dtype=jnp.int32)
    qpos = plgpu.load(qpos_ref.at[b, jnp.minimum(tq, n_q - 1)], mask=tq < n_q, other=-1)
    live = source.live_bound(table_ref, row_ref, b=b, qpos=qpos, kpool=kpool)

    @pl.when(p0 >= live)
    def _dead_tile():
        _write_dead_tile(out_ref, b=b, pool=pool, pool_in=pool_in, t0=t0, n_rows=n_rows)

    @pl.when(p0 < live)
    def _live_tile():
        # 2. The tile's keys, then 3. the arithmetic per query.
        keys, loaded, last, pscale = source.load_tile(
            keys_ref, table_ref, row_ref, pscale_ref, b=b, pool=pool, pool_in=pool_in,
            live=live, kpool=kpool, n_pools=n_pools, dim=dim, block_d=block_d,
            dot_dtype=dot_dtype)
        _score_rows(q_ref, w_ref, qpos_ref, out_ref, keys, loaded, last, pscale, b=b, pool=pool,
                    pool_in=pool_in, t0=t0, n_rows=n_rows, heads=heads, dim=dim,
                    block_h=block_h, block_d=block_d, dot_dtype=dot_dtype)


def _load_keys(ref, index, rows, rows_ok, ch_ok, ch_safe, dot_dtype):
    """The tile's ``[block_p, block_d]`` keys ``ref[*index, rows[i], ch]`` in ``dot_dtype``:
    zero in a padding channel and in a row not ``rows_ok`` (``None``: every row), whose
    lanes are masked, so not read."""
    kshape = (rows.shape[0], ch_ok.shape[0])
    tile = ref.at[(*index, jnp.broadcast_to(rows[:, None], kshape),
                   jnp.broadcast_to(ch_safe[None, :], kshape))]
    mask = ch_ok[None, :] if rows_ok is None else rows_ok[:, None] & ch_ok[None, :]
    return plgpu.load(tile, mask=jnp.broadcast_to(mask, kshape), other=0.0).astype(dot_dtype)


def _group_scales(scale_ref, index, rows, rows_ok, ch_safe, groups: int, dim: int):
    """int8 keys' scales spread over the tile's ``[block_p, block_d]`` lanes: lane ``(i, c)``
    gets ``scale_ref[*index, rows[i], c // (dim / groups)]`` (a padding channel its last
    group's; its key is 0), 0 in a row not ``rows_ok`` (None: every row). One indexer, as
    ``_load_keys``' (Triton lowers one gather per load)."""
    kshape = (rows.shape[0], ch_safe.shape[0])
    col = ch_safe // (dim // groups)
    tile = scale_ref.at[(*index, jnp.broadcast_to(rows[:, None], kshape), jnp.broadcast_to(col[None, :], kshape))]
    if rows_ok is None:
        return plgpu.load(tile)
    return plgpu.load(tile, mask=jnp.broadcast_to(rows_ok[:, None], kshape), other=0.0)


@dataclasses.dataclass(frozen=True)
class _ContiguousKeys:
    """``index_scores``' key source: ``keys_ref = pooled [B, P, D]``, ``table_ref =
    pool_valid [B, P]`` (int8), ``row_ref = first_key [B]``, scales ``[B, P]`` (e4m3) or
    ``[B, P, G]`` (int8 keys, ``groups = G``: dequantised here, before the dot)."""

    groups: int = 0

    def live_bound(self, valid_ref, fk_ref, *, b, qpos, kpool):
        # ``first_key + (p + 1)*KP - 1 <= q_pos`` iff ``p < (q_pos - first_key + 1) // KP``.
        return jnp.max(visible_pools(qpos, fk_ref[b], kpool))

    def load_tile(self, pooled_ref, valid_ref, fk_ref, pscale_ref, *, b, pool, pool_in, live,
                  kpool, n_pools, dim, block_d, dot_dtype):
        pool_safe = jnp.minimum(pool, n_pools - 1)
        ch_ok, ch_safe = channels(dim, block_d)
        keys = _load_keys(pooled_ref, (b,), pool_safe, None, ch_ok, ch_safe, dot_dtype)
        loaded = plgpu.load(valid_ref.at[b, pool_safe]) != 0
        last = fk_ref[b] + (pool + 1) * kpool - 1  # last token of every pool
        pscale = None
        if self.groups:  # int8 keys: dequantised before the dot
            keys = keys * _group_scales(pscale_ref[0], (b,), pool_safe, None, ch_safe, self.groups, dim)
        elif pscale_ref:
            pscale = plgpu.load(pscale_ref[0].at[b, pool_safe])
        return keys, loaded, last, pscale


@dataclasses.dataclass(frozen=True)
class _PagedKeys:
    """``index_scores_paged``' key source: ``keys_ref = pooled_pages`` viewed flat ``[N *
    PPP, D]`` (``n_slots`` rows), ``table_ref = block_table [B, PG]``, ``row_ref =
    pool_counts [B]``, scales ``[N * PPP]`` (e4m3) or ``[N * PPP, G]`` (int8, ``groups =
    G``); ``first_key = 0``."""

    ppp: int
    n_slots: int
    groups: int = 0

    def live_bound(self, bt_ref, counts_ref, *, b, qpos, kpool):
        seen = jnp.max(visible_pools(qpos, 0, kpool))  # pools the tile's queries can see
        return jnp.minimum(counts_ref[b], seen)

    def load_tile(self, keys_ref, bt_ref, counts_ref, pscale_ref, *, b, pool, pool_in, live,
                  kpool, n_pools, dim, block_d, dot_dtype):
        ppp = self.ppp
        ch_ok, ch_safe = channels(dim, block_d)
        # Page entries, then the owned keys below the live bound.
        pool_safe = jnp.minimum(pool, n_pools - 1)
        in_live = pool_in & (pool < live)
        page = plgpu.load(bt_ref.at[b, pool_safe // ppp], mask=in_live, other=-1)
        loaded = in_live & (page >= 0) & (page * ppp < self.n_slots)
        slot = jnp.where(loaded, page * ppp + pool_safe % ppp, 0)
        keys = _load_keys(keys_ref, (), slot, loaded, ch_ok, ch_safe, dot_dtype)
        pscale = None
        if self.groups:  # int8 keys: dequantised before the dot
            keys = keys * _group_scales(pscale_ref[0], (), slot, loaded, ch_safe, self.groups, dim)
        elif pscale_ref:  # e4m3 keys: each loaded pool's scale (0 where not loaded: no candidate)
            pscale = plgpu.load(pscale_ref[0].at[slot], mask=loaded, other=0.0)
        return keys, loaded, (pool + 1) * kpool - 1, pscale


def _write_dead_tile(out_ref, *, b, pool, pool_in, t0, n_rows):
    """A tile no query of it can see: ``-inf`` over its ``[n_rows, block_p]`` outputs, no
    load."""
    @pl.loop(0, n_rows)
    def _(i):
        plgpu.store(out_ref.at[b, t0 + i, pool], jnp.full(pool.shape, -jnp.inf, jnp.float32),
                    mask=pool_in)


def _score_rows(q_ref, w_ref, qpos_ref, out_ref, keys, loaded, last, pscale, *, b, pool,
                pool_in, t0, n_rows, heads, dim, block_h, block_d, dot_dtype):
    """Score a loaded ``[block_p, block_d]`` key tile for queries ``t0 .. t0 + n_rows - 1``
    of row ``b``: per query one ``[Hi, D] x [D, block_p]`` dot, ReLU, the head weights, the
    head sum, times the pools' fp8 scales ``pscale [block_p]`` (None: no scale), then
    ``_finish_scores`` in-kernel (``-0.0 -> +0.0``; NaN, a pool not ``loaded`` or whose
    ``last`` token is after the query -> ``-inf``). One function for both key sources, so
    both do the same arithmetic."""
    f32 = jnp.float32
    scale = dim**-0.5
    ch_ok, ch_safe = channels(dim, block_d)
    hd = jnp.arange(block_h, dtype=jnp.int32)
    h_ok = hd < heads
    h_safe = jnp.minimum(hd, heads - 1)
    qshape = (block_h, block_d)
    q_rows = jnp.broadcast_to(h_safe[:, None], qshape)
    q_cols = jnp.broadcast_to(ch_safe[None, :], qshape)
    q_mask = jnp.broadcast_to(h_ok[:, None] & ch_ok[None, :], qshape)

    @pl.loop(0, n_rows)
    def _(i):
        t = t0 + i
        qt = plgpu.load(q_ref.at[b, t, q_rows, q_cols], mask=q_mask, other=0.0)
        wt = plgpu.load(w_ref.at[b, t, h_safe], mask=h_ok, other=0.0).astype(f32)
        s = plgpu.dot(qt.astype(dot_dtype), keys, trans_b=True, allow_tf32=False)  # [Hi, P]
        s = s * scale
        s = jnp.where(s < 0.0, 0.0, s)  # ReLU that keeps NaN, like jax.nn.relu
        score = jnp.sum(wt[:, None] * s, axis=0)  # padded heads have w = 0
        if pscale is not None:
            score = score * pscale
        score = jnp.where(score == 0.0, 0.0, score)
        cand = loaded & (last <= qpos_ref[b, t]) & (score == score)
        plgpu.store(out_ref.at[b, t, pool], jnp.where(cand, score, -jnp.inf), mask=pool_in)


def _launch_scores(operands, *, source, name, n_pools, kpool, block_sizes, interpret):
    """The Triton scoring kernel's ``pallas_call`` on ``operands = (q, w, keys, table, row,
    q_pos[, scales])`` read through the key ``source``: grid ``(query tiles, B, pool
    tiles)`` over ``[B, Q, n_pools]`` float32 scores, tiled by ``block_sizes`` resolved to
    the problem, the dot in ``score_dot_dtype``."""
    q, keys = operands[0], operands[2]
    b, n_q, heads, dim = q.shape
    dot_dtype = score_dot_dtype(q.dtype, keys.dtype)
    blocks = block_sizes.resolve(n_q, n_pools, float32_dot=dot_dtype == jnp.float32)
    kernel = functools.partial(
        _scores_kernel, source=source, kpool=kpool, n_q=n_q, n_pools=n_pools, heads=heads,
        dim=dim, block_q=blocks.block_q, block_p=blocks.block_p,
        block_h=next_power_of_two(heads, 16), block_d=next_power_of_two(dim, 16),
        dot_dtype=dot_dtype,
    )
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n_q, blocks.block_q), b, pl.cdiv(n_pools, blocks.block_p)),
        out_shape=jax.ShapeDtypeStruct((b, n_q, n_pools), jnp.float32),
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name=name,
    )(*operands)


@eager_jit("kpool", "interpret", "block_sizes")
def _index_scores_pallas(
    q, w, pooled, pool_valid, first_key, q_pos, pooled_scale, *, kpool, interpret,
    block_sizes: IndexScoresBlockSizes,
):
    """Pallas scores, tiled by ``block_sizes`` (see ``IndexScoresBlockSizes``)."""
    b, n_q, heads, dim = q.shape
    n_pools = pooled.shape[1]
    check_positive_int("kpool", kpool)
    if heads < 1 or dim < 1 or n_pools < 1:
        raise ValueError(
            f"the Pallas index_scores needs Hi, D, P >= 1, got Hi={heads}, D={dim}, P={n_pools}"
        )
    check_triton_dtypes(q, w, "pooled", pooled)
    if pool_valid.dtype != jnp.bool_:
        raise ValueError(f"pool_valid must be bool, got dtype {pool_valid.dtype}")
    for name, x in (("first_key", first_key), ("q_pos", q_pos)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    if b == 0 or n_q == 0:
        return jnp.zeros((b, n_q, n_pools), jnp.float32)
    operands = (
        q, w.astype(jnp.float32), pooled, pool_valid.astype(jnp.int8),
        first_key.astype(jnp.int32), q_pos.astype(jnp.int32),
        *(() if pooled_scale is None else (pooled_scale.astype(jnp.float32),)),
    )
    groups = pooled_scale.shape[-1] if pooled.dtype == INT8 else 0
    return _launch_scores(operands, source=_ContiguousKeys(groups), name="index_scores",
                         n_pools=n_pools, kpool=kpool, block_sizes=block_sizes,
                         interpret=interpret)


@eager_jit("kpool", "interpret", "block_sizes")
def _index_scores_paged_pallas(
    q, w, pooled_pages, block_table, pool_counts, q_pos, pooled_scale, *, kpool, interpret,
    block_sizes: IndexScoresBlockSizes,
):
    """Pallas paged scores, tiled by ``block_sizes``."""
    b, n_q, heads, dim = q.shape
    n_pages, ppp, _ = pooled_pages.shape
    n_pools = block_table.shape[1] * ppp
    n_slots = n_pages * ppp
    if heads < 1 or dim < 1:
        raise ValueError(f"the Pallas index_scores_paged needs Hi, D >= 1, got Hi={heads}, D={dim}")
    check_triton_dtypes(q, w, "pooled_pages", pooled_pages)
    if b == 0 or n_q == 0 or n_pools == 0:
        return jnp.zeros((b, n_q, n_pools), jnp.float32)
    if n_slots == 0:  # no page at all: nothing is a candidate
        return jnp.full((b, n_q, n_pools), -jnp.inf, jnp.float32)
    operands = (
        q, w.astype(jnp.float32), pooled_pages.reshape(n_slots, dim),
        block_table.astype(jnp.int32), pool_counts.astype(jnp.int32), q_pos.astype(jnp.int32),
        *(() if pooled_scale is None else
          (pooled_scale.reshape((n_slots,) + pooled_scale.shape[2:]).astype(jnp.float32),)),
    )
    groups = pooled_scale.shape[-1] if pooled_pages.dtype == INT8 else 0
    return _launch_scores(operands, source=_PagedKeys(ppp, n_slots, groups), name="index_scores_paged",
                         n_pools=n_pools, kpool=kpool, block_sizes=block_sizes,
                         interpret=interpret)
