"""The backward of ``index_scores`` (contiguous pooled keys) as Mosaic GPU kernels:
``(dq, dw, dpooled)`` from the score cotangent.

The math (``pallas_kernels.scoring_backward``'s; ``zeta[t, h, p] = D**-0.5 q[t, h] .
k[p]``, ``g = d_scores``, 0 where pool ``p`` is not a candidate for query ``t``):
``dw[t, h] = sum_p g relu(zeta)``; ``dz = D**-0.5 g w[t, h] 1[zeta > 0]``; ``dq[t, h] =
sum_p dz k[p]``; ``dpooled[p] = sum_{t, h} dz q[t, h]``. Invariants:

* **No ``[Q, P, H]`` tensor in HBM**: ``zeta`` is recomputed in each kernel from ``q`` and
  the keys, in registers, one ``[heads, pools]`` tile at a time. Only ``g [B, Q, P]`` (the
  cotangent itself, zeroed where not a candidate by the wrapper) is read.
* **Masks by ``where``**: a non-candidate pair (``g = 0`` there) adds exact zeros; an
  invalid pool's key (garbage, possibly NaN) is zeroed by the wrapper in the copy that pads
  the keys (an MMA multiplies every key of a tile, and ``0 * NaN`` is NaN); padding
  queries, heads, pools and channels are zeros.
* **Deterministic, no atomics**: ``dq`` and ``dw`` of a query are one CTA's sums (query
  major), ``dpooled`` of a pool tile one CTA's (pool major), each in a fixed order.
* **Float32 sums; 16-bit MMA operands** (``q`` and ``pooled`` one 16-bit dtype, as the
  forward): ``zeta`` is exact products accumulated in float32 (as the forward), ``dw`` is
  float32 throughout; ``dz`` is rounded to the input dtype before the ``dq`` / ``dpooled``
  MMAs, so those agree with the float32 reference within 16-bit rounding.

Kernel shapes (``plmgpu.kernel``, Lane semantics, one warpgroup per CTA; ``D`` padded to a
multiple of 16, heads to a multiple of 64, one swizzle for every MMA operand, from ``D``):

* dq / dw: grid ``(Q, B, head tiles of 64)``: the heads are the MMA's M (GLM-5.3's 32
  indexer heads fill half of it; a second query in the other half would need a per-row
  ``g``), ``zeta^T = q k^T`` per pool tile of ``block_p`` (only the tiles the query can
  see), ``dw`` reduced along the pools in registers, ``dz`` to SMEM, ``dq += dz k``.
* dpooled: grid ``(pool tiles of block_p, B)``: the pools are the MMA's M (as the forward),
  ``zeta = k q_t^T`` per query of a ``block_q`` tile, ``dz`` to SMEM, ``dk += dz q_t``.
  Every query tile is walked (a query that cannot see the tile has ``g = 0`` there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_positive_int, require_mosaic_gpu
from pallas_kernels._mosaic import (
    check_index_operands, check_smem, matmul, mma_swizzle, store, visible_pools,
)

__all__ = ["MosaicIndexScoresBackwardBlockSizes", "mosaic_index_scores_backward", "launch_grids"]

_HEAD_TILE = 64  # heads per dq / dw CTA: the warpgroup MMA's M


@dataclasses.dataclass(frozen=True)
class MosaicIndexScoresBackwardBlockSizes:
    """Tiling of the Mosaic GPU ``index_scores`` backward (see the module doc).

    * ``block_p``: pools per step of the dq / dw kernel and per CTA of the dpooled kernel
      (an MMA's N, then M): a multiple of 64 up to 256;
    * ``block_q``: queries whose ``q`` tile the dpooled kernel copies at once (an int >= 1;
      capped at ``Q``).
    """

    block_p: int = 64
    block_q: int = 4

    def validate(self) -> "MosaicIndexScoresBackwardBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        check_positive_int("MosaicIndexScoresBackwardBlockSizes.block_q", self.block_q)
        bp = self.block_p
        if not isinstance(bp, int) or isinstance(bp, bool) or bp < 64 or bp > 256 or bp % 64:
            raise ValueError("MosaicIndexScoresBackwardBlockSizes.block_p must be a multiple of 64 "
                             f"in [64, 256], got {bp!r}")
        return self


def launch_grids(batch: int, n_queries: int, heads: int, n_pools: int,
                 blocks: MosaicIndexScoresBackwardBlockSizes) -> dict[str, tuple[int, ...]]:
    """The Pallas grids of the two launches (kernel name -> grid): dq / dw ``(Q padded to
    whole query tiles, B, head tiles)``, dpooled ``(pool tiles, B)``."""
    blocks.validate()
    block_q = min(blocks.block_q, n_queries)
    q_pad = -(-n_queries // block_q) * block_q
    return {"mosaic_index_scores_dq": (q_pad, batch, -(-heads // _HEAD_TILE)),
            "mosaic_index_scores_dpooled": (-(-n_pools // blocks.block_p), batch)}


def _dq_kernel(ntiles_g, q_g, w_g, pooled_g, g_g, dq_g, dw_g,
               q_s, w_s, keys_s, g_s, dz_s, o_s, dw_s, bars, *, scale, block_p, dim, dtype, q_pad):
    plmgpu = require_mosaic_gpu("index_scores backward")
    wgmma_layout = plmgpu.Layout.WGMMA
    per_head, per_pool = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    t, b, hb = lax.axis_index("t"), lax.axis_index("b"), lax.axis_index("hb")
    heads = pl.ds(hb * _HEAD_TILE, _HEAD_TILE)
    shape = (_HEAD_TILE, block_p)
    plmgpu.copy_gmem_to_smem(q_g.at[b * q_pad + t, heads], q_s, bars.at[0])  # [B * Q_pad, ...]
    plmgpu.copy_gmem_to_smem(w_g.at[b * q_pad + t, heads], w_s, bars.at[1])
    plmgpu.barrier_wait(bars.at[0])
    plmgpu.barrier_wait(bars.at[1])
    wv = lax.broadcast_in_dim(plmgpu.load(w_s, layout=per_head), shape, [0])

    def step(j, carry):
        dq, dw = carry
        pools = pl.ds(j * block_p, block_p)
        plmgpu.copy_gmem_to_smem(pooled_g.at[b, pools], keys_s, bars.at[2])
        plmgpu.copy_gmem_to_smem(g_g.at[b, t, pools], g_s, bars.at[3])
        plmgpu.barrier_wait(bars.at[2])
        plmgpu.barrier_wait(bars.at[3])

        zeta = matmul(plmgpu, shape, (q_s, keys_s.T)) * scale
        g = lax.broadcast_in_dim(plmgpu.load(g_s, layout=per_pool), shape, [1])
        live = g != 0.0
        dw = dw + jnp.sum(jnp.where(live & (zeta > 0.0), g * zeta, 0.0), axis=1)
        store(plmgpu, dz_s, jnp.where(live & (zeta > 0.0), g * wv * scale, 0.0).astype(dtype))
        plmgpu.commit_smem()

        return dq + matmul(plmgpu, (_HEAD_TILE, dim), (dz_s, keys_s)), dw

    dq0 = plmgpu.layout_cast(jnp.zeros((_HEAD_TILE, dim), jnp.float32), wgmma_layout)
    dw0 = plmgpu.layout_cast(jnp.zeros((_HEAD_TILE,), jnp.float32), per_head)
    dq, dw = lax.fori_loop(0, ntiles_g[b, t], step, (dq0, dw0))
    o_s[...] = dq.astype(dtype)
    dw_s[...] = dw
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(o_s, dq_g.at[b, t, heads])
    plmgpu.copy_smem_to_gmem(dw_s, dw_g.at[b, t, heads])
    plmgpu.wait_smem_to_gmem(0)


def _dpooled_kernel(q_g, w_g, pooled_g, g_g, dk_g,
                    keys_s, q_s, w_s, g_s, dz_s, o_s, bars, *, scale, block_p, block_q, heads, dim,
                    n_qtiles, dtype):
    plmgpu = require_mosaic_gpu("index_scores backward")
    wgmma_layout = plmgpu.Layout.WGMMA
    per_pool, per_head = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    pt, b = lax.axis_index("pt"), lax.axis_index("b")
    pools = pl.ds(pt * block_p, block_p)
    shape = (block_p, heads)
    plmgpu.copy_gmem_to_smem(pooled_g.at[b, pools], keys_s, bars.at[0])
    plmgpu.barrier_wait(bars.at[0])

    def query_tile(qt, acc):
        queries = pl.ds(qt * block_q, block_q)
        rows = pl.ds(b * n_qtiles * block_q + qt * block_q, block_q)  # q, w: [B * Q_pad, ...]
        plmgpu.copy_gmem_to_smem(q_g.at[rows], q_s, bars.at[1])
        plmgpu.copy_gmem_to_smem(w_g.at[rows], w_s, bars.at[2])
        plmgpu.copy_gmem_to_smem(g_g.at[b, queries, pools], g_s, bars.at[3])
        for k in (1, 2, 3):
            plmgpu.barrier_wait(bars.at[k])

        def query(i, acc):
            zeta = matmul(plmgpu, shape, (keys_s, q_s.at[i].T)) * scale
            g = lax.broadcast_in_dim(plmgpu.load(g_s.at[i], layout=per_pool), shape, [0])
            wv = lax.broadcast_in_dim(plmgpu.load(w_s.at[i], layout=per_head), shape, [1])
            dz = jnp.where((g != 0.0) & (zeta > 0.0), g * wv * scale, 0.0)
            store(plmgpu, dz_s, dz.astype(dtype))
            plmgpu.commit_smem()

            return acc + matmul(plmgpu, (block_p, dim), (dz_s, q_s.at[i]))

        return lax.fori_loop(0, block_q, query, acc)

    acc0 = plmgpu.layout_cast(jnp.zeros((block_p, dim), jnp.float32), wgmma_layout)
    acc = lax.fori_loop(0, n_qtiles, query_tile, acc0)
    o_s[...] = acc.astype(dtype)
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(o_s, dk_g.at[b, pools])
    plmgpu.wait_smem_to_gmem(0)


def mosaic_index_scores_backward(q, w, pooled, pool_valid, first_key, q_pos, d_scores, *, kpool,
                                 interpret, block_sizes: MosaicIndexScoresBackwardBlockSizes):
    """``(dq [B, Q, Hi, D] in q.dtype, dw [B, Q, Hi] in w.dtype, dpooled [B, P, D] in
    pooled.dtype)``: the gradients of ``index_scores`` (contiguous keys; shapes and meaning
    as ``index_scores_reference``, the caller checked them) given ``d_scores [B, Q, P]``
    (ignored where the pool is not a candidate). ``interpret``: Mosaic GPU interpret mode."""
    plmgpu = require_mosaic_gpu("index_scores backward")
    check_index_operands(q, pooled, "pooled", kpool)
    blocks = block_sizes.validate()
    b, n_q, heads, d_true = q.shape
    n_pools = pooled.shape[1]
    if b * n_q * heads == 0 or n_pools == 0:
        return jnp.zeros_like(q), jnp.zeros_like(w), jnp.zeros_like(pooled)
    dtype = q.dtype
    f32 = jnp.float32
    scale = d_true**-0.5
    block_p = blocks.block_p
    block_q = min(blocks.block_q, n_q)
    dim = -(-d_true // 16) * 16
    hn = -(-heads // _HEAD_TILE) * _HEAD_TILE
    p_pad = -(-n_pools // block_p) * block_p
    grids = launch_grids(b, n_q, heads, n_pools, blocks)
    q_pad = grids["mosaic_index_scores_dq"][0]
    vis = visible_pools(first_key, q_pos, kpool)
    cand = pool_valid[:, None, :] & (jnp.arange(n_pools, dtype=jnp.int32) < vis[..., None])
    g = jnp.pad(jnp.where(cand, d_scores.astype(f32), 0.0), ((0, 0), (0, q_pad - n_q), (0, p_pad - n_pools)))
    n_tiles = jnp.pad(-(-jnp.clip(vis, 0, n_pools) // block_p), ((0, 0), (0, q_pad - n_q)))
    # Batch and queries as one axis, as the forward's (a TMA of a query tile into MMA-tiled
    # SMEM has at most 5 dimensions: see mosaic_scoring._launch).
    qp = jnp.pad(q, ((0, 0), (0, q_pad - n_q), (0, hn - heads), (0, dim - d_true))).reshape(b * q_pad, hn, dim)
    wp = jnp.pad(w.astype(f32), ((0, 0), (0, q_pad - n_q), (0, hn - heads))).reshape(b * q_pad, hn)
    # Invalid pools' keys zeroed (in the copy that pads them): ``dq += dz k`` multiplies
    # every key of a tile, and 0 * NaN is NaN.
    keys = jnp.pad(jnp.where(pool_valid[..., None], pooled, jnp.zeros((), pooled.dtype)),
                   ((0, 0), (0, p_pad - n_pools), (0, dim - d_true)))
    item = dtype.itemsize
    swizzle = mma_swizzle(dim, item)
    mma = (plmgpu.TilingTransform((8, swizzle // item)), plmgpu.SwizzleTransform(swizzle))
    params = plmgpu.CompilerParams(lowering_semantics=plmgpu.LoweringSemantics.Lane)
    interp = plmgpu.InterpretGPUParams() if interpret else None

    check_smem("the mosaic index_scores backward (dq, dw)", {
        "query": _HEAD_TILE * dim * item, "keys": block_p * dim * item,
        "dz": _HEAD_TILE * block_p * item, "output": _HEAD_TILE * dim * item,
        "weights, g, dw": 2 * _HEAD_TILE * 4 + block_p * 4,
    }, blocks)
    dq, dw = plmgpu.kernel(
        functools.partial(_dq_kernel, scale=scale, block_p=block_p, dim=dim, dtype=dtype, q_pad=q_pad),
        out_type=(jax.ShapeDtypeStruct((b, q_pad, hn, dim), dtype),
                  jax.ShapeDtypeStruct((b, q_pad, hn), f32)),
        scratch_types=[
            plmgpu.SMEM((_HEAD_TILE, dim), dtype, transforms=mma),
            plmgpu.SMEM((_HEAD_TILE,), f32),
            plmgpu.SMEM((block_p, dim), dtype, transforms=mma),
            plmgpu.SMEM((block_p,), f32),
            plmgpu.SMEM((_HEAD_TILE, block_p), dtype, transforms=mma),
            plmgpu.SMEM((_HEAD_TILE, dim), dtype, transforms=mma),
            plmgpu.SMEM((_HEAD_TILE,), f32),
            plmgpu.Barrier(num_barriers=4),
        ],
        grid=grids["mosaic_index_scores_dq"],
        grid_names=("t", "b", "hb"),
        compiler_params=params, interpret=interp, kernel_name="mosaic_index_scores_dq",
    )(n_tiles, qp, wp, keys, g)

    check_smem("the mosaic index_scores backward (dpooled)", {
        "keys": block_p * dim * item, "queries": block_q * hn * dim * item,
        "weights, g": block_q * (hn + block_p) * 4, "dz": block_p * hn * item,
        "output": block_p * dim * item,
    }, blocks)
    dk = plmgpu.kernel(
        functools.partial(_dpooled_kernel, scale=scale, block_p=block_p, block_q=block_q, heads=hn,
                          dim=dim, n_qtiles=q_pad // block_q, dtype=dtype),
        out_type=jax.ShapeDtypeStruct((b, p_pad, dim), pooled.dtype),
        scratch_types=[
            plmgpu.SMEM((block_p, dim), dtype, transforms=mma),
            plmgpu.SMEM((block_q, hn, dim), dtype, transforms=mma),
            plmgpu.SMEM((block_q, hn), f32),
            plmgpu.SMEM((block_q, block_p), f32),
            plmgpu.SMEM((block_p, hn), dtype, transforms=mma),
            plmgpu.SMEM((block_p, dim), dtype, transforms=mma),
            plmgpu.Barrier(num_barriers=4),
        ],
        grid=grids["mosaic_index_scores_dpooled"],
        grid_names=("pt", "b"),
        compiler_params=params, interpret=interp, kernel_name="mosaic_index_scores_dpooled",
    )(qp, wp, keys, g)
    return (dq[:, :n_q, :heads, :d_true], dw[:, :n_q, :heads].astype(w.dtype),
            dk[:, :n_pools, :d_true])
