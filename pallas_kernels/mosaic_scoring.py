"""``index_scores`` and ``index_scores_paged`` as one Mosaic GPU kernel
(``implementation="mosaic"`` / ``"mosaic_interpret"``).

The contract is ``pallas_kernels.scoring``'s (the wrappers, the reference and the Triton
kernel of both key sources live there): ``score[b, t, p] = sum_h w[b, t, h] * relu((q[b, t, h] . pooled[b, p]) * D**-0.5)``
in float32, ``-inf`` where pool ``p`` is not a candidate for query ``t`` (not valid, or its
last token after ``q_pos``) and where the score is NaN, ``-0.0`` returned as ``+0.0``, and a
pool tile that no query of the program can see yet loads no key and writes ``-inf``.

Kernel shape (``plmgpu.kernel``, Lane lowering semantics, one warpgroup per CTA, grid
``(query tiles, B, pool tiles)``; every operand stays in GMEM and is copied by TMA):

* A CTA owns ``block_q`` queries of row ``b`` and a tile of ``block_p`` pools. It reads
  ``seen`` (the pools its queries can see, computed by the wrapper per query tile); a tile
  at or past it is *dead*: ``-inf`` is written and nothing is loaded. A live tile copies its
  ``[block_p, D]`` pooled keys into SMEM with one TMA (tiled and swizzled for the MMA), the
  tile's queries ``[block_q, Hn, D]`` (``Hn``: the indexer heads padded, see below), head
  weights and pool validity beside them.
* Per query one warpgroup MMA (``plmgpu.wgmma``) ``keys [block_p, D] x q_t^T [D, Hn]``:
  the **pools are the MMA's M** and the heads its N. Why not heads as M (as the Triton
  kernel does): ``wgmma``'s M is 64 per warpgroup, so GLM-5.3's 32 indexer heads would
  waste half of every MMA, while N only needs a multiple of 8; and the head sum then runs
  along the accumulator's rows, the reduction Mosaic's WGMMA layout provides
  (``Layout.WGMMA.reduce(1)``; the head weights broadcast along M from
  ``Layout.WGMMA.reduce(0)``). The pool tile is 64 pools at least, so a decode step (one
  query) still fills the MMA.
* ReLU (keeping NaN, like ``jax.nn.relu``), the head weights, the head sum, ``-0.0 ->
  +0.0`` and the candidate rule in registers; the ``[block_q, block_p]`` tile goes back
  through SMEM with one TMA store.

Precision and equality with the reference: ``wgmma`` multiplies 16-bit operands exactly
and accumulates in float32, as the reference's ``einsum(..., preferred_element_type=f32)``
does; float32 operands would be TF32 on the tensor cores, so this kernel takes bf16 / f16
``q`` and ``pooled`` of one dtype only (``_mosaic.takes_dtypes``): the wrappers run any other
dtypes on the Triton kernel (IEEE float32), as a step with no Mosaic kernel does, so a
float32 layer asked for ``"mosaic"`` still runs (an exact bf16 x 3 split, six MMAs, would
bring float32 here). Blackwell (compute capability >= 10) has no ``wgmma``: there too the
wrappers run the Triton kernel (``_mosaic.mosaic_takes``, ``wgmma_on_target``). The order
of the sums (over ``D`` inside the MMA, over the heads in the warpgroup reduction) is the hardware's, not XLA's, so scores of arbitrary
inputs agree with the reference within float32 rounding, not bit for bit. Where every
partial sum is exact (dyadic inputs of few mantissa bits, a ``D`` whose ``D**-0.5`` is a
power of two) the scores, and so the top-k selection, ties included, are bit-identical;
``tests/test_kernels_mosaic_mla.py`` checks both.

Layout limits the wrapper meets by padding (cheap unless noted): ``D`` to a multiple of 16
(the MMA's K step; a copy of the keys when it is not one, as in no real model), heads to
``Hn``, a multiple of 32 (zero queries and weights add exact zeros; a TMA moves whole
128-byte lines), queries to a multiple of ``block_q``, pools to a multiple of ``block_p``
(a copy of ``pooled`` when ``P`` is not one already: size a contiguous cache so that
``max_length // KP`` is a multiple of 64). Block sizes whose SMEM exceeds a Hopper CTA's
227 KiB raise ``ValueError`` (``_mosaic.check_smem``). Every CTA handles one tile; latency is
hidden across CTAs, not by a multi-stage pipeline inside one.

``index_scores_paged`` (``mosaic_index_scores_paged``) is the same kernel body with the key
tile copied through the block table (``page_chunk``), one TMA per chunk of ``min(PPP,
block_p)`` pools (``PPP`` a multiple of 8: a TMA into a tiled SMEM buffer starts and ends on
whole 8-row tiles); a chunk whose first pool is not live (no page, or at or past the row's
pool count) copies a zero chunk instead of reading a page.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_positive_int, require_mosaic_gpu
from pallas_kernels._mosaic import check_index_operands, check_smem, mma_swizzle, visible_pools

__all__ = ["MosaicIndexScoresBlockSizes", "mosaic_index_scores", "mosaic_index_scores_paged"]

_HEAD_STEP = 32  # heads are padded to a multiple: one f32 weight row is a whole 128-byte line
@dataclasses.dataclass(frozen=True)
class MosaicIndexScoresBlockSizes:
    """Tiling of the Mosaic GPU ``index_scores`` (see the module doc).

    * ``block_q``: queries per CTA, which share one SMEM tile of pooled keys (an int >= 1;
      capped at ``Q``);
    * ``block_p``: pools per CTA, the MMA's M: a multiple of 64 (one warpgroup MMA row
      block) up to 256.
    """

    block_q: int = 8
    block_p: int = 64

    def validate(self) -> "MosaicIndexScoresBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        check_positive_int("MosaicIndexScoresBlockSizes.block_q", self.block_q)
        bp = self.block_p
        if not isinstance(bp, int) or isinstance(bp, bool) or bp < 64 or bp > 256 or bp % 64:
            raise ValueError(
                "MosaicIndexScoresBlockSizes.block_p must be a multiple of 64 in [64, 256] "
                f"(the warpgroup MMA's M), got {bp!r}"
            )
        return self

    def resolve(self, n_queries: int) -> "MosaicIndexScoresBlockSizes":
        """The sizes the kernel launches with for ``Q = n_queries``."""
        self.validate()
        return dataclasses.replace(self, block_q=max(1, min(self.block_q, n_queries)))


def _kernel(q_g, w_g, vis_g, seen_g, pv_g, pooled_g, table_g, zero_g, out_g,
            q_s, w_s, pv_s, keys_s, out_s, bars, key_bar, *, block_q, block_p, heads, scale,
            n_q, q_pad, page_chunk):
    """One (query tile, row, pool tile) CTA; ``page_chunk`` is ``None`` for contiguous
    ``pooled [B, P, D]``, else pooled keys are ``pooled_pages [N, PPP, D]`` read through
    ``table_g`` in chunks of ``page_chunk`` pools (``zero_g`` replaces an unowned page)."""
    plmgpu = require_mosaic_gpu("index_scores")
    row_layout = plmgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row (a pool)
    qt, b, pt = lax.axis_index("qt"), lax.axis_index("b"), lax.axis_index("pt")
    p0 = pt * block_p
    t0 = qt * block_q
    n_rows = jnp.minimum(block_q, n_q - t0)

    @pl.when(p0 >= seen_g[b, qt])
    def _dead():
        @pl.loop(0, n_rows)
        def _(i):
            out_s[i] = plmgpu.layout_cast(jnp.full((block_p,), -jnp.inf, jnp.float32), row_layout)

    @pl.when(p0 < seen_g[b, qt])
    def _live():
        _copy_keys(plmgpu, pooled_g, pv_g, table_g, zero_g, keys_s, key_bar, b=b, p0=p0,
                   block_p=block_p, page_chunk=page_chunk)
        # q and w come as [B * Q_pad, ...] (see _launch: a TMA has at most 5 dimensions)
        plmgpu.copy_gmem_to_smem(q_g.at[pl.ds(b * q_pad + t0, block_q)], q_s, bars.at[1])
        plmgpu.copy_gmem_to_smem(w_g.at[pl.ds(b * q_pad + t0, block_q)], w_s, bars.at[2])
        plmgpu.copy_gmem_to_smem(pv_g.at[b, pl.ds(p0, block_p)], pv_s, bars.at[3])
        plmgpu.barrier_wait(key_bar)
        for j in range(1, 4):
            plmgpu.barrier_wait(bars.at[j])
        pool = p0 + plmgpu.broadcasted_iota(jnp.int32, (block_p,), 0, layout=row_layout)
        valid = plmgpu.load(pv_s, layout=row_layout) != 0

        @pl.loop(0, n_rows)
        def _(i):
            def mma(acc_ref):
                plmgpu.wgmma(acc_ref, keys_s, q_s.at[i].T)
                return acc_ref[...]

            s = pl.run_scoped(mma, plmgpu.ACC((block_p, heads), jnp.float32)) * scale
            s = jnp.where(s < 0.0, 0.0, s)  # ReLU that keeps NaN, like jax.nn.relu
            w = plmgpu.load(w_s.at[i], layout=plmgpu.Layout.WGMMA.reduce(0))
            score = jnp.sum(s * lax.broadcast_in_dim(w, (block_p, heads), [1]), axis=1)
            score = jnp.where(score == 0.0, 0.0, score)
            cand = valid & (pool < vis_g[b, t0 + i]) & (score == score)
            out_s[i] = jnp.where(cand, score, -jnp.inf)

    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(out_s, out_g.at[b, pl.ds(t0, block_q), pl.ds(p0, block_p)])
    plmgpu.wait_smem_to_gmem(0)


def _copy_keys(plmgpu, pooled_g, pv_g, table_g, zero_g, keys_s, key_bar, *, b, p0, block_p,
               page_chunk):
    """TMA the tile's ``[block_p, D]`` pooled keys into ``keys_s`` (arriving on ``key_bar``):
    one copy of a contiguous row, or one per ``page_chunk`` pools through the block table;
    a chunk whose first pool is not live (``pv_g``: its page entry is not a page, or it is
    at or past the row's pool count) copies a zero chunk instead, its page is not read."""
    if page_chunk is None:
        plmgpu.copy_gmem_to_smem(pooled_g.at[b, pl.ds(p0, block_p)], keys_s, key_bar)
        return
    ppp = pooled_g.shape[1]
    for k in range(block_p // page_chunk):
        p = p0 + k * page_chunk
        page = table_g[b, p // ppp]
        dst = keys_s.at[pl.ds(k * page_chunk, page_chunk)]
        owned = pv_g[b, p] != 0

        @pl.when(owned)
        def _():
            plmgpu.copy_gmem_to_smem(pooled_g.at[page, pl.ds(p % ppp, page_chunk)], dst, key_bar)

        @pl.when(~owned)
        def _():
            plmgpu.copy_gmem_to_smem(zero_g, dst, key_bar)


def _pad_dim(x, dim: int):
    """``x`` with its last axis (``D``) zero-padded to ``dim`` (the MMA's K step of 16):
    zero channels add exact zeros to every dot."""
    if x.shape[-1] == dim:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dim - x.shape[-1])])


def _launch(plmgpu, q, w, vis, seen, pv, pooled, table, *, n_pools, blocks, interpret, page_chunk):
    """Pad the queries, heads and ``D``, launch the kernel over ``n_pools`` pool positions (a
    multiple of ``block_p``), return the ``[B, Q_pad, n_pools]`` scores."""
    scale = q.shape[-1] ** -0.5  # of the true D
    dim = -(-q.shape[-1] // 16) * 16
    q, pooled = _pad_dim(q, dim), _pad_dim(pooled, dim)  # a copy of the keys if D % 16
    b, n_q, heads, _ = q.shape
    block_q, block_p = blocks.block_q, blocks.block_p
    hn = -(-heads // _HEAD_STEP) * _HEAD_STEP
    q_pad = vis.shape[1]
    # Batch and queries as one axis: a query tile's copy of [block_q, Hi, D] into the
    # MMA-tiled SMEM is then a TMA of 5 dimensions (tiles of rows and columns), the most a
    # TMA takes; with B and Q apart it needs 6 whenever B > 1 and block_q > 1, and the
    # lowering refuses it (a prefill of a batch, first seen on an H200, 2026-12-04).
    qp = jnp.pad(q, ((0, 0), (0, q_pad - n_q), (0, hn - heads), (0, 0))).reshape(b * q_pad, hn, dim)
    wp = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, q_pad - n_q), (0, hn - heads))).reshape(b * q_pad, hn)
    swizzle = mma_swizzle(dim, q.dtype.itemsize)
    mma_tiles = (plmgpu.TilingTransform((8, swizzle // q.dtype.itemsize)),
                 plmgpu.SwizzleTransform(swizzle))
    kernel = functools.partial(_kernel, block_q=block_q, block_p=block_p, heads=hn,
                               scale=scale, n_q=n_q, q_pad=q_pad, page_chunk=page_chunk)
    n_key_copies = 1 if page_chunk is None else block_p // page_chunk
    check_smem("the mosaic index_scores", {
        "queries": block_q * hn * dim * q.dtype.itemsize, "weights": block_q * hn * 4,
        "keys": block_p * dim * q.dtype.itemsize, "scores": block_q * block_p * 4 + block_p * 4,
    }, blocks)
    zero = jnp.zeros((page_chunk or 8, dim), q.dtype)
    return plmgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((b, q_pad, n_pools), jnp.float32),
        scratch_types=[
            plmgpu.SMEM((block_q, hn, dim), q.dtype, transforms=mma_tiles),
            plmgpu.SMEM((block_q, hn), jnp.float32),
            plmgpu.SMEM((block_p,), jnp.int32),
            plmgpu.SMEM((block_p, dim), q.dtype, transforms=mma_tiles),
            plmgpu.SMEM((block_q, block_p), jnp.float32),
            plmgpu.Barrier(num_barriers=4),
            plmgpu.Barrier(num_arrivals=n_key_copies),
        ],
        grid=(q_pad // block_q, b, n_pools // block_p),
        grid_names=("qt", "b", "pt"),
        compiler_params=plmgpu.CompilerParams(lowering_semantics=plmgpu.LoweringSemantics.Lane),
        interpret=plmgpu.InterpretGPUParams() if interpret else None,
        kernel_name="mosaic_index_scores" if page_chunk is None else "mosaic_index_scores_paged",
    )(qp, wp, vis, seen, pv, pooled, table, zero)


def _query_tiles(vis, block_q, bound=None):
    """``vis [B, Q]`` padded to whole query tiles (padding queries see nothing) and each
    tile's ``seen [B, Q_pad / block_q]``: the pools any of its queries can see, capped at
    ``bound [B]`` when given."""
    b, n_q = vis.shape
    q_pad = -(-n_q // block_q) * block_q
    vis = jnp.pad(vis, ((0, 0), (0, q_pad - n_q)))
    seen = jnp.max(jnp.maximum(vis, 0).reshape(b, q_pad // block_q, block_q), axis=2)
    if bound is not None:
        seen = jnp.minimum(seen, bound[:, None])
    return vis, seen


def mosaic_index_scores_paged(q, w, pooled_pages, block_table, pool_counts, q_pos, *, kpool,
                              interpret, block_sizes: MosaicIndexScoresBlockSizes):
    """``index_scores_paged`` (``pallas_kernels.scoring``'s contract; the caller checked
    the shapes) with this kernel: ``[B, Q, PG * PPP]`` float32."""
    plmgpu = require_mosaic_gpu("index_scores_paged")
    check_index_operands(q, pooled_pages, "pooled_pages", kpool)
    b, n_q = q.shape[:2]
    n_pages, ppp = pooled_pages.shape[:2]
    n_pools = block_table.shape[1] * ppp
    if b == 0 or n_q == 0 or n_pools == 0:
        return jnp.full((b, n_q, n_pools), -jnp.inf, jnp.float32)
    blocks = block_sizes.resolve(n_q)
    page_chunk = min(ppp, blocks.block_p)
    if page_chunk % 8 or (ppp > blocks.block_p and ppp % blocks.block_p) or (
            ppp < blocks.block_p and blocks.block_p % ppp):
        raise ValueError(
            f"the mosaic index_scores_paged copies whole 8-row tiles: pools per page PPP "
            f"(pooled_pages.shape[1]) must be a multiple of 8 that divides or is a multiple "
            f"of MosaicIndexScoresBlockSizes.block_p={blocks.block_p}, got {ppp}"
        )
    p_pad = -(-n_pools // blocks.block_p) * blocks.block_p
    table = block_table.astype(jnp.int32)
    pg_pad = p_pad // ppp if ppp <= blocks.block_p else -(-p_pad // ppp)
    table = jnp.pad(table, ((0, 0), (0, pg_pad - table.shape[1])), constant_values=-1)
    counts = pool_counts.astype(jnp.int32)
    pool = jnp.arange(p_pad, dtype=jnp.int32)
    page = jnp.repeat(table, ppp, axis=1)[:, :p_pad]
    pv = ((page >= 0) & (page < n_pages) & (pool[None, :] < counts[:, None])).astype(jnp.int32)
    vis, seen = _query_tiles(jnp.floor_divide(q_pos.astype(jnp.int32) + 1, kpool),
                             blocks.block_q, bound=counts)
    out = _launch(plmgpu, q, w, vis, seen, pv, pooled_pages, table, n_pools=p_pad, blocks=blocks,
                  interpret=interpret, page_chunk=page_chunk)
    return out[:, :n_q, :n_pools]


def mosaic_index_scores(q, w, pooled, pool_valid, first_key, q_pos, *, kpool, interpret,
                        block_sizes: MosaicIndexScoresBlockSizes):
    """Scores ``[B, Q, P]`` float32 (shapes and meaning as ``index_scores_reference``; the
    caller checked the shapes) with the Mosaic GPU kernel, tiled by ``block_sizes``."""
    plmgpu = require_mosaic_gpu("index_scores")
    check_index_operands(q, pooled, "pooled", kpool)
    b, n_q = q.shape[:2]
    n_pools = pooled.shape[1]
    if b == 0 or n_q == 0 or n_pools == 0:
        return jnp.full((b, n_q, n_pools), -jnp.inf, jnp.float32)
    blocks = block_sizes.resolve(n_q)
    p_pad = -(-n_pools // blocks.block_p) * blocks.block_p
    pv = pool_valid.astype(jnp.int32)
    if p_pad != n_pools:  # a copy of the pooled keys: see the module doc
        pooled = jnp.pad(pooled, ((0, 0), (0, p_pad - n_pools), (0, 0)))
        pv = jnp.pad(pv, ((0, 0), (0, p_pad - n_pools)))
    vis, seen = _query_tiles(visible_pools(first_key, q_pos, kpool), blocks.block_q)
    out = _launch(plmgpu, q, w, vis, seen, pv, pooled, jnp.zeros((1, 1), jnp.int32),
                  n_pools=p_pad, blocks=blocks, interpret=interpret, page_chunk=None)
    return out[:, :n_q, :n_pools]
