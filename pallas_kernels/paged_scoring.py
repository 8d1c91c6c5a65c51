"""``index_scores_paged``: ``index_scores`` over pooled keys held in pages through a block table.

Axis letters as in the package glossary (``pallas_kernels``; ``N`` pages of the pool, ``PG``
pages per sequence, ``PPP`` pools per page). The paged layout (the paged cache's):

* A page holds ``page_size`` tokens (a multiple of ``KP``), so ``PPP = page_size // KP``
  pools. Pooled keys are paged with their tokens: ``pooled_pages [N, PPP, D]``, shared by
  every sequence; pool ``p`` of sequence ``b`` lives at ``pooled_pages[block_table[b, p //
  PPP], p % PPP]``.
* ``block_table [B, PG]`` int32: entry ``j`` is the page holding sequence ``b``'s tokens
  ``[j * page_size, (j + 1) * page_size)``, or ``-1`` (none). A sequence's positions start
  at 0 with no holes, so pools start at ``first_key = 0``.
* ``pool_counts [B]``: the sequence's complete pools (its pools ``[0, pool_counts[b])``
  are written).
* fp8 keys: ``pooled_pages`` in ``float8_e4m3fn`` with ``pooled_scale [N, PPP]`` (float32,
  one per pool, paged with it), applied as ``index_scores`` applies its ``pooled_scale``.

Invariants:

* The result ``[B, Q, PG * PPP]`` is ``index_scores`` of the pools gathered in sequence
  order: the same arithmetic (float32, ``D**-0.5``, ReLU, head sum), the same candidate
  rule with ``first_key = 0`` (pool ``p`` is a candidate for query ``t`` iff ``p <
  pool_counts[b]``, its page entry is in ``[0, N)`` and ``(p + 1) * KP - 1 <= q_pos[b,
  t]``), ``-inf`` for every other pool, ``-0.0 -> +0.0``, NaN -> ``-inf``. The reference
  *is* ``index_scores_reference`` on the gathered rows (bit for bit).
* Nothing a sequence does not own is read: a ``-1`` (or out-of-range) entry and a pool at
  or past ``pool_counts[b]`` are never loaded (the reference's gather fills them with
  zeros; the kernel masks the load or skips the tile), so whatever such a page holds (NaN,
  another sequence's keys) cannot reach the scores.
* Work follows the live pools: a Pallas program whose pool tile starts at or past its
  row's live bound (``min(pool_counts[b], pools any of its queries can see)``) loads no
  key and writes ``-inf``.

The Mosaic GPU kernel (``implementation="mosaic"`` / ``"mosaic_interpret"``;
``pallas_kernels.mosaic_scoring``, ``MosaicIndexScoresBlockSizes``) copies keys by TMA a
chunk of ``min(PPP, block_p)`` pools at a time (``PPP`` a multiple of 8): a chunk whose
first pool is not live is never read, but the chunk holding a row's last written pool is
copied whole, so that page's unwritten pools after it are loaded (each is its own MMA row
and is masked to ``-inf``: its contents cannot reach another pool's score). As for
``index_scores``, operands other than one 16-bit dtype run the Triton kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    Implementation, check_positive_int, check_rank, eager_jit, kernel_family,
)
from pallas_kernels.mosaic_scoring import MosaicIndexScoresBlockSizes, mosaic_index_scores_paged
from pallas_kernels.scoring import (
    IndexScoresBlockSizes, check_key_scale, check_queries, check_triton_dtypes,
    index_scores_reference, launch_scores, run_scores, score_rows, write_dead_tile,
)

__all__ = ["index_scores_paged", "index_scores_paged_reference", "gather_pools"]


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
    _, owned = _pool_slots(pooled_pages, block_table)
    pool = jnp.arange(owned.shape[1], dtype=jnp.int32)
    pool_valid = owned & (pool[None, :] < pool_counts.astype(jnp.int32)[:, None])
    first_key = jnp.zeros(block_table.shape[:1], jnp.int32)
    scale = None if pooled_scale is None else gather_pools(pooled_scale, block_table)
    return index_scores_reference(
        q, w, gather_pools(pooled_pages, block_table), pool_valid, first_key, q_pos, scale,
        kpool=kpool,
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
    """Indexer scores over paged pooled keys; see the module doc. Shapes as
    ``index_scores_paged_reference`` (``pooled_scale [N, PPP]`` with fp8 keys);
    ``block_sizes`` (validated under every implementation) tiles the kernel as it tiles
    ``index_scores``': an ``IndexScoresBlockSizes`` for ``"pallas"``, a
    ``MosaicIndexScoresBlockSizes`` for ``"mosaic"`` (either for ``"xla"``; ``None``: the
    defaults)."""
    implementation, mosaic, blocks = kernel_family(implementation, block_sizes, IndexScoresBlockSizes, MosaicIndexScoresBlockSizes)
    b, nq, _, d = check_queries(q, w)
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
    check_key_scale("pooled_pages", pooled_pages, "pooled_scale", pooled_scale, "[N, PPP]")
    return run_scores(
        (q, w, pooled_pages, block_table, pool_counts, q_pos), pooled_scale, kpool=kpool,
        implementation=implementation, mosaic=mosaic, blocks=blocks,
        reference=index_scores_paged_reference, mosaic_kernel=_index_scores_paged_mosaic,
        pallas_kernel=_index_scores_paged_pallas,
    )


_index_scores_paged_mosaic = eager_jit("kpool", "interpret", "block_sizes")(mosaic_index_scores_paged)


# --------------------------------------------------------------------------------------
# Pallas kernel (Triton backend)
# --------------------------------------------------------------------------------------
#
# ``index_scores``' kernel (``pallas_kernels.scoring``) with the pooled-key tile gathered
# through the block table. Grid ``(query tiles, B, pool tiles)`` over the sequence's
# ``PG * PPP`` pool positions. Per program:
#
# 1. Live bound: ``live = min(pool_counts[b], max over its queries of (q_pos + 1) // KP)``
#    (pool ``p`` is visible to ``t`` iff ``(p + 1) * KP - 1 <= q_pos``, i.e. ``p < (q_pos +
#    1) // KP``). A tile starting at or past ``live`` loads no key, no page entry and no
#    query: it writes ``-inf`` over its ``[block_q, block_p]`` outputs and ends. At a
#    128K-token capacity and 4K live tokens, 31 of every 32 programs end there.
# 2. Otherwise the tile's page entries ``block_table[b, pool // PPP]`` are loaded (one
#    gather: consecutive pools share a page), and the keys of ``pooled_pages`` viewed flat
#    ``[N * PPP, D]`` at slot ``page * PPP + pool % PPP``, with the load masked to owned
#    pools below ``pool_counts[b]`` (a masked lane is not read: other = 0).
# 3. Per query, ``index_scores``' arithmetic and ``finish_scores`` in-kernel, with the
#    candidate mask ``loaded & last <= q_pos`` (``last = (pool + 1) * KP - 1``).
#
# Offsets: Pallas' Triton lowering addresses a ref with 64-bit offsets once it exceeds 4 GiB
# (32-bit below, where every element offset of a 16- or 32-bit array fits), so a pool of
# any size is addressed correctly.


def _index_scores_paged_kernel(
    q_ref, w_ref, keys_ref, bt_ref, counts_ref, qpos_ref, *refs,  # inputs [, pscale_ref], output
    kpool: int, ppp: int, n_slots: int, n_q: int, n_pools: int, heads: int, dim: int,
    block_q: int, block_p: int, block_h: int, block_d: int, dot_dtype,
):
    *pscale_ref, out_ref = refs
    q_tile, b, p_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    p0 = p_tile * block_p
    pool = p0 + jnp.arange(block_p, dtype=jnp.int32)
    pool_in = pool < n_pools
    t0 = q_tile * block_q
    n_rows = jnp.minimum(block_q, n_q - t0)

    # 1. The tile's live bound, from the sequence's pool count and its queries' positions.
    tq = t0 + jnp.arange(block_q, dtype=jnp.int32)
    qpos = plgpu.load(qpos_ref.at[b, jnp.minimum(tq, n_q - 1)], mask=tq < n_q, other=-1)
    seen = jnp.max(jnp.maximum(qpos + 1, 0)) // kpool  # pools the tile's queries can see
    live = jnp.minimum(counts_ref[b], seen)

    @pl.when(p0 >= live)
    def _dead_tile():
        write_dead_tile(out_ref, b=b, pool=pool, pool_in=pool_in, t0=t0, n_rows=n_rows)

    @pl.when(p0 < live)
    def _live_tile():
        ch = jnp.arange(block_d, dtype=jnp.int32)
        ch_ok = ch < dim
        ch_safe = jnp.minimum(ch, dim - 1)

        # 2. Page entries, then the owned keys below the live bound.
        pool_safe = jnp.minimum(pool, n_pools - 1)
        in_live = pool_in & (pool < live)
        page = plgpu.load(bt_ref.at[b, pool_safe // ppp], mask=in_live, other=-1)
        loaded = in_live & (page >= 0) & (page * ppp < n_slots)
        slot = jnp.where(loaded, page * ppp + pool_safe % ppp, 0)
        kshape = (block_p, block_d)
        keys = plgpu.load(
            keys_ref.at[
                jnp.broadcast_to(slot[:, None], kshape),
                jnp.broadcast_to(ch_safe[None, :], kshape),
            ],
            mask=jnp.broadcast_to(loaded[:, None] & ch_ok[None, :], kshape),
            other=0.0,
        ).astype(dot_dtype)
        pscale = None
        if pscale_ref:  # fp8 keys: each loaded pool's scale (0 where not loaded: no candidate)
            pscale = plgpu.load(pscale_ref[0].at[slot], mask=loaded, other=0.0)

        # 3. index_scores' arithmetic per query (the same function as index_scores').
        score_rows(q_ref, w_ref, qpos_ref, out_ref, keys, loaded, (pool + 1) * kpool - 1, pscale, b=b,
                   pool=pool, pool_in=pool_in, t0=t0, n_rows=n_rows, heads=heads, dim=dim,
                   block_h=block_h, block_d=block_d, dot_dtype=dot_dtype)


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
        *(() if pooled_scale is None else (pooled_scale.reshape(n_slots).astype(jnp.float32),)),
    )
    return launch_scores(_index_scores_paged_kernel, operands, name="index_scores_paged",
                         n_pools=n_pools, kpool=kpool, block_sizes=block_sizes,
                         interpret=interpret, ppp=ppp, n_slots=n_slots)
