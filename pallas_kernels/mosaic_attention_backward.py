"""The backward of ``sparse_mla`` as Mosaic GPU kernels: ``(dq, dlatent)`` from the forward's
``out`` and log-sum-exp (``mosaic_sparse_mla(..., return_lse=True)``).

The math (``pallas_kernels.attention_backward``'s; per query row ``n``, heads ``h``, selected
slots ``w``, ``s = scale``): ``p = exp(s q.kv - lse)`` recomputed, ``D[h] = do[h] . o[h]``,
``dp = do . kv[:, :V]``, ``dz = p (dp - D)``, ``dq = s dz @ kv``, ``dkv[w] = p^T do (zero
past V) + s dz^T q``, summed into ``dlatent[b or 0, id_w]`` over every (query, slot) that
names the row. Invariants:

* **No float atomics; bit-identical runs.** ``dlatent`` is computed latent-row-major: the
  selection is transposed token-major first (``pallas_kernels.transpose.selection_transpose``,
  ``block_rows = TRANSPOSE_ROWS = 32``: per block of 32 rows, its entries, each a query and a
  32-bit mask of the rows it selects, sorted by query). A CTA owns ``ROW_TILE = 64`` rows
  (two transpose blocks, whose entries are contiguous) and walks their entries in that
  fixed order, accumulating in registers: each row's sum is one CTA's, in one order.
  A query names a row at most once (top-k ids are distinct; the mask cannot count a
  repeated id twice, so a repeated id's second slot gets no latent gradient here).
* **Nothing ``[queries, selected, CR]``.** The dq kernel re-gathers each query's rows (the
  forward's gather, ``mosaic_attention.gather_rows``); the dlatent kernel copies each
  entry's query ``q[n]``, ``d_out[n]``, ``lse[n]``, ``D[n]`` (contiguous TMA copies) and
  recomputes its scores against the CTA's resident row tile.
* **Masks by ``where``.** A slot that is not a token, a row the entry does not select, a
  padding head (``lse = +inf``) get probability exactly 0, never ``inf * 0``; an empty
  query row (``lse = -inf``) has no valid slot and no entry. A NaN latent row that no query
  names (the paged pool) stays out of every gradient.
* **Float32 accumulation, 16-bit MMA operands.** ``q``, ``latent`` one 16-bit dtype (as the
  forward; ``_mosaic.check_16bit_operands``); ``d_out`` is cast to it; ``p`` and ``dz`` are
  rounded to it before their MMAs (as the forward rounds ``p``), so the gradients agree
  with the float32 reference's within 16-bit rounding, not bit for bit. Outputs in
  ``q.dtype`` / ``latent.dtype``, each element's sum finished in one CTA before the cast.

Kernel shapes (``plmgpu.kernel``, Lane semantics, one warpgroup per CTA):

* dq: grid ``(B*Q rows, head tiles of 64, column blocks of block_c)``; the query and
  ``d_out`` tiles ``[64, CR]`` resident (``d_out`` zero-padded from ``V`` to ``CR``, so
  ``dp`` is one MMA over the whole row and the RoPE tail gets no value gradient); per id
  block of ``block_w`` slots: gather, ``s = q kv^T``, ``dp = do kv^T`` (wgmma, M = heads),
  ``dz`` to SMEM, ``acc += dz kv[:, cols]``. Column blocks keep the f32 accumulator at
  ``64 x block_c`` (``CR = 576`` whole would be 288 registers a thread); each re-scores.
* dlatent: grid ``(row tiles of 64, column blocks)``; the latent row tile ``[64, CR]``
  resident; per entry and head tile of ``block_h``: ``s^T = lat q^T``, ``dp^T = lat do^T``
  (M = the 64 rows, N = heads), ``p^T``, ``s dz^T`` to SMEM, ``acc += p^T do[:, cols] + s
  dz^T q[:, cols]``. An entry of the tile's first transpose block masks the second
  block's 32 rows out and vice versa (MMA rows wasted where a query selects rows of one
  block only).

Shared memory (Hopper's 227 KiB, checked by ``_mosaic.check_smem`` before the launch) sets
the defaults: at ``CR = 576`` the dq kernel holds two ``[64, 576]`` tiles (query,
``d_out``) beside its gather tiles, so ``block_w = 16``; the dlatent kernel holds the row
tile and one head tile's ``q`` and ``d_out``, so ``block_h = 32``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import require_mosaic_gpu
from pallas_kernels._mosaic import (
    HEAD_TILE, IDS_COPY, check_16bit_operands, check_smem, gather_rows, matmul, padded_ids,
    padded_widths, static_scale, store, tma_box,
)

__all__ = [
    "MosaicSparseMlaBackwardBlockSizes", "mosaic_sparse_mla_backward", "TRANSPOSE_ROWS", "ROW_TILE",
    "column_block", "launch_grids",
]

TRANSPOSE_ROWS = 32  # block_rows of the selection_transpose the dlatent kernel reads
ROW_TILE = 64  # latent rows per dlatent CTA: the MMA's M, two transpose blocks


def column_block(c: int, want: int) -> int:
    """The largest multiple of 64 at most ``want`` that divides ``c`` (a multiple of 64)."""
    for k in range(want - want % 64, 0, -64):
        if c % k == 0:
            return k
    return 64


@dataclasses.dataclass(frozen=True)
class MosaicSparseMlaBackwardBlockSizes:
    """Tiling of the Mosaic GPU ``sparse_mla`` backward (see the module doc).

    * ``block_w``: selected ids gathered per step of the dq kernel: 16, 32 or 64 (16 fits
      Hopper's shared memory at ``CR = 576``);
    * ``block_h``: heads per step of the dlatent kernel (the N of its score MMAs, the K of
      its gradient MMAs): 16, 32 or 64;
    * ``block_c``: gradient columns per CTA of both kernels (the f32 accumulator's width):
      a multiple of 64 up to 256, lowered to the largest multiple of 64 dividing the padded
      ``CR`` (576 -> 192, 512 -> 128 at the default 192).
    """

    block_w: int = 16
    block_h: int = 32
    block_c: int = 192

    def validate(self) -> "MosaicSparseMlaBackwardBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        name = "MosaicSparseMlaBackwardBlockSizes."
        for field in ("block_w", "block_h"):
            val = getattr(self, field)
            if isinstance(val, bool) or val not in (16, 32, 64):
                raise ValueError(f"{name}{field} must be 16, 32 or 64, got {val!r}")
        bc = self.block_c
        if not isinstance(bc, int) or isinstance(bc, bool) or bc < 64 or bc > 256 or bc % 64:
            raise ValueError(f"{name}block_c must be a multiple of 64 in [64, 256], got {bc!r}")
        return self


def _dq_kernel(ids_g, nend_g, q_g, do_g, lse_g, dd_g, lat_g, zero_g, dq_g,
               q_s, do_s, raw_s, kv_s, dz_s, ids_s, lse_s, dd_s, o_s, bars, row_bar,
               *, scale, length, shared, nq, width_c, copy_c, swizzle, block_w, block_c, dtype):
    plmgpu = require_mosaic_gpu("sparse_mla backward")
    wgmma_layout = plmgpu.Layout.WGMMA
    per_head = wgmma_layout.reduce(1)
    per_slot = wgmma_layout.reduce(0)
    row_move = plmgpu.Layout.SMEM_GMEM_COPY((block_w, copy_c), dtype, swizzle)
    row, hb, cb = (lax.axis_index(a) for a in ("row", "hb", "cb"))
    lat_b = 0 if shared else row // nq
    h0 = hb * HEAD_TILE
    c0 = cb * block_c
    heads = pl.ds(h0, HEAD_TILE)

    plmgpu.copy_gmem_to_smem(q_g.at[row, heads], q_s, bars.at[0])
    plmgpu.copy_gmem_to_smem(do_g.at[row, heads], do_s, bars.at[2])
    plmgpu.copy_gmem_to_smem(lse_g.at[row, heads], lse_s, bars.at[3])
    plmgpu.copy_gmem_to_smem(dd_g.at[row, heads], dd_s, bars.at[4])
    for k in (0, 2, 3, 4):
        plmgpu.barrier_wait(bars.at[k])
    shape = (HEAD_TILE, block_w)
    lse = lax.broadcast_in_dim(plmgpu.load(lse_s, layout=per_head), shape, [0])
    dd = lax.broadcast_in_dim(plmgpu.load(dd_s, layout=per_head), shape, [0])
    n_blocks = (nend_g[row] + block_w - 1) // block_w

    def step(j, acc):
        gather_rows(plmgpu, ids_g, lat_g, zero_g, ids_s, raw_s, kv_s, bars.at[1], row_bar, row=row,
                    lat_b=lat_b, base=j * block_w, length=length, width_c=width_c, copy_c=copy_c,
                    block_w=block_w, row_move=row_move)

        s = matmul(plmgpu, shape, (q_s, kv_s.T))
        dp = matmul(plmgpu, shape, (do_s, kv_s.T))
        ids = plmgpu.load(ids_s.at[pl.ds(0, block_w)], layout=per_slot)
        ok = lax.broadcast_in_dim((ids >= 0) & (ids < length), shape, [1])
        p = jnp.where(ok, jnp.exp(s * scale - lse), 0.0)
        store(plmgpu, dz_s, jnp.where(ok, p * (dp - dd), 0.0).astype(dtype))
        plmgpu.commit_smem()

        return acc + matmul(plmgpu, (HEAD_TILE, block_c), (dz_s, kv_s.at[:, pl.ds(c0, block_c)]))

    acc0 = plmgpu.layout_cast(jnp.zeros((HEAD_TILE, block_c), jnp.float32), wgmma_layout)
    acc = lax.fori_loop(0, n_blocks, step, acc0)
    o_s[...] = (acc * scale).astype(dtype)
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(o_s, dq_g.at[row, heads, pl.ds(c0, block_c)])
    plmgpu.wait_smem_to_gmem(0)


def _dlatent_kernel(start_g, query_g, mask_g, q_g, do_g, lse_g, dd_g, lat_g, dlat_g,
                    lat_s, q_s, do_s, pt_s, dzt_s, lse_s, dd_s, o_s, bars,
                    *, scale, head_tiles, block_h, block_c, dtype):
    plmgpu = require_mosaic_gpu("sparse_mla backward")
    wgmma_layout = plmgpu.Layout.WGMMA
    per_row = wgmma_layout.reduce(1)
    per_head = wgmma_layout.reduce(0)
    rt, cb = lax.axis_index("rt"), lax.axis_index("cb")
    r0 = rt * ROW_TILE
    c0 = cb * block_c
    cols = pl.ds(c0, block_c)
    shape = (ROW_TILE, block_h)

    plmgpu.copy_gmem_to_smem(lat_g.at[pl.ds(r0, ROW_TILE)], lat_s, bars.at[0])
    plmgpu.barrier_wait(bars.at[0])
    blocks_per_tile = ROW_TILE // TRANSPOSE_ROWS
    e_lo = start_g[rt * blocks_per_tile]
    e_mid = start_g[rt * blocks_per_tile + 1]
    e_hi = start_g[rt * blocks_per_tile + blocks_per_tile]
    local = plmgpu.broadcasted_iota(jnp.int32, (ROW_TILE,), 0, layout=per_row)

    def entry(e, acc):
        n = query_g[e]
        half = jnp.where(e < e_mid, 0, 1)
        picked = (((mask_g[e] >> (local & (TRANSPOSE_ROWS - 1))) & 1) != 0) & (
            (local // TRANSPOSE_ROWS) == half)
        picked = lax.broadcast_in_dim(picked, shape, [0])

        def head_tile(t, acc):
            heads = pl.ds(t * block_h, block_h)
            plmgpu.copy_gmem_to_smem(q_g.at[n, heads], q_s, bars.at[1])
            plmgpu.copy_gmem_to_smem(do_g.at[n, heads], do_s, bars.at[2])
            plmgpu.copy_gmem_to_smem(lse_g.at[n, heads], lse_s, bars.at[3])
            plmgpu.copy_gmem_to_smem(dd_g.at[n, heads], dd_s, bars.at[4])
            for k in (1, 2, 3, 4):
                plmgpu.barrier_wait(bars.at[k])

            st = matmul(plmgpu, shape, (lat_s, q_s.T))
            dpt = matmul(plmgpu, shape, (lat_s, do_s.T))
            lse = lax.broadcast_in_dim(plmgpu.load(lse_s, layout=per_head), shape, [1])
            dd = lax.broadcast_in_dim(plmgpu.load(dd_s, layout=per_head), shape, [1])
            pt = jnp.where(picked, jnp.exp(st * scale - lse), 0.0)
            store(plmgpu, pt_s, pt.astype(dtype))
            # where, not pt * ...: an unselected row's dp^T may be NaN (a NaN row of the pool)
            dzt = jnp.where(picked, pt * (dpt - dd) * scale, 0.0)
            store(plmgpu, dzt_s, dzt.astype(dtype))
            plmgpu.commit_smem()

            return acc + matmul(plmgpu, (ROW_TILE, block_c), (pt_s, do_s.at[:, cols]),
                                (dzt_s, q_s.at[:, cols]))

        return lax.fori_loop(0, head_tiles, head_tile, acc)

    acc0 = plmgpu.layout_cast(jnp.zeros((ROW_TILE, block_c), jnp.float32), wgmma_layout)
    acc = lax.fori_loop(e_lo, e_hi, entry, acc0)
    o_s[...] = acc.astype(dtype)
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(o_s, dlat_g.at[pl.ds(r0, ROW_TILE), cols])
    plmgpu.wait_smem_to_gmem(0)


def launch_grids(rows: int, heads: int, latent_rows: int, cr: int, v: int,
                 blocks: MosaicSparseMlaBackwardBlockSizes) -> dict[str, tuple[int, ...]]:
    """The Pallas grids of the two launches (kernel name -> grid) for ``rows = B*Q`` query
    rows of ``heads`` heads, ``latent_rows = R`` flattened latent rows of ``CR = cr``
    columns, ``V = v``: dq ``(rows, head tiles, column blocks)``, dlatent ``(row tiles,
    column blocks)``."""
    c, _ = padded_widths(cr, v)
    n_c = c // column_block(c, blocks.validate().block_c)
    tiles = -(-(-(-latent_rows // TRANSPOSE_ROWS) * TRANSPOSE_ROWS) // ROW_TILE)
    return {"mosaic_sparse_mla_dq": (rows, -(-heads // HEAD_TILE), n_c),
            "mosaic_sparse_mla_dlatent": (tiles, n_c)}


def _check_transpose(transpose, n_rows: int, n_entries: int):
    """``transpose``'s arrays as the dlatent kernel reads them, or a ``ValueError`` naming the
    field: ``block_start`` the CSR offsets of ``ceil(R / 32) + 1`` row blocks (``block_rows
    = TRANSPOSE_ROWS``), ``entry_query`` / ``entry_mask`` ``[E = B*Q*W]``."""
    want = -(-n_rows // TRANSPOSE_ROWS) + 1
    start = transpose.block_start
    if start.shape != (want,):
        raise ValueError(
            f"transpose.block_start must have shape ({want},): a selection_transpose with "
            f"block_rows={TRANSPOSE_ROWS} over R={n_rows} latent rows, got {start.shape}")
    for name in ("entry_query", "entry_mask"):
        arr = getattr(transpose, name)
        if arr.shape != (n_entries,):
            raise ValueError(f"transpose.{name} must have shape ({n_entries},) (B*Q*W entries), "
                             f"got {arr.shape}")
    return start.astype(jnp.int32), transpose.entry_query.astype(jnp.int32), transpose.entry_mask.astype(jnp.int32)


def mosaic_sparse_mla_backward(q, latent, token_ids, out, lse, d_out, transpose, *, scale, value_width,
                               interpret, block_sizes: MosaicSparseMlaBackwardBlockSizes):
    """``(dq [B, Q, H, CR] in q.dtype, dlatent [B or 1, L, CR] in latent.dtype)``: the
    gradients of ``sparse_mla`` (shapes and meaning as ``sparse_mla_reference``; the caller
    checked them) given the forward's ``out [B, Q, H, V]``, ``lse [B, Q, H]`` float32
    (``mosaic_sparse_mla(..., return_lse=True)``), the output cotangent ``d_out [B, Q, H,
    V]`` and ``transpose``, ``selection_transpose(token_ids, L, shared=latent.shape[0] == 1,
    block_rows=TRANSPOSE_ROWS)``. ``interpret``: run in Mosaic GPU interpret mode."""
    plmgpu = require_mosaic_gpu("sparse_mla backward")
    check_16bit_operands("sparse_mla backward", q=q, latent=latent)
    blocks = block_sizes.validate()
    b, nq, h, c_true = q.shape
    n_lat, length = latent.shape[:2]
    width = token_ids.shape[2]
    dtype = q.dtype
    if b * nq * h == 0 or width == 0 or length == 0:
        return jnp.zeros_like(q), jnp.zeros_like(latent)
    scale = static_scale(scale)
    n_rows = n_lat * length
    start, entry_query, entry_mask = _check_transpose(transpose, n_rows, b * nq * width)

    f32 = jnp.float32
    dd = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)  # D = do . o
    c, _ = padded_widths(c_true, value_width)
    rows = b * nq
    grids = launch_grids(rows, h, n_rows, c_true, value_width, blocks)
    n_h = grids["mosaic_sparse_mla_dq"][1]
    tiles = grids["mosaic_sparse_mla_dlatent"][0]
    h_pad = n_h * HEAD_TILE
    block_c = c // grids["mosaic_sparse_mla_dq"][2]
    block_w, block_h = blocks.block_w, blocks.block_h
    # Padding heads: zero query and d_out, lse = +inf (probability 0), D = 0. At least two
    # query rows (a padding row is never read): with one, ptxas spilled the dlatent kernel
    # (255 registers and a stack frame, against 164 at two or more; its entry loop's
    # copies of q[n] became loop-invariant).
    extra = max(0, 2 - rows)
    qp = jnp.pad(q.reshape(rows, h, c_true), ((0, extra), (0, h_pad - h), (0, c - c_true)))
    dop = jnp.pad(d_out.astype(dtype).reshape(rows, h, value_width),
                  ((0, extra), (0, h_pad - h), (0, c - value_width)))
    lsep = jnp.pad(lse.astype(f32).reshape(rows, h), ((0, extra), (0, h_pad - h)),
                   constant_values=jnp.inf)
    ddp = jnp.pad(dd.reshape(rows, h), ((0, extra), (0, h_pad - h)))
    lat = latent if c == c_true else jnp.pad(latent, ((0, 0), (0, 0), (0, c - c_true)))
    item = dtype.itemsize
    params = plmgpu.CompilerParams(lowering_semantics=plmgpu.LoweringSemantics.Lane)
    interp = plmgpu.InterpretGPUParams() if interpret else None

    def tiles_of(swizzle):
        return (plmgpu.TilingTransform((8, swizzle // item)), plmgpu.SwizzleTransform(swizzle))

    # dq
    check_smem("the mosaic sparse_mla backward (dq)", {
        "query and d_out tiles": 2 * HEAD_TILE * c * item, "gathered rows": 2 * block_w * c * item,
        "dz": HEAD_TILE * block_w * item, "output": HEAD_TILE * block_c * item,
        "ids, lse, D": max(block_w, IDS_COPY) * 4 + 2 * HEAD_TILE * 4,
    }, blocks)
    ids, n_end = padded_ids(token_ids, length, block_w)
    copy_c = tma_box(c)
    swizzle = block_w * item
    mma = tiles_of(swizzle)
    dq = plmgpu.kernel(
        functools.partial(_dq_kernel, scale=scale, length=length, shared=n_lat == 1, nq=nq,
                          width_c=c, copy_c=copy_c, swizzle=swizzle, block_w=block_w,
                          block_c=block_c, dtype=dtype),
        out_type=jax.ShapeDtypeStruct((rows, h_pad, c), dtype),
        scratch_types=[
            plmgpu.SMEM((HEAD_TILE, c), dtype, transforms=mma),  # query tile
            plmgpu.SMEM((HEAD_TILE, c), dtype, transforms=mma),  # d_out tile (zero past V)
            plmgpu.SMEM((block_w, c), dtype),  # gathered rows, as copied
            plmgpu.SMEM((block_w, c), dtype, transforms=mma),  # ... as the MMA reads them
            plmgpu.SMEM((HEAD_TILE, block_w), dtype, transforms=mma),  # dz
            plmgpu.SMEM((max(block_w, IDS_COPY),), jnp.int32),
            plmgpu.SMEM((HEAD_TILE,), f32),  # lse
            plmgpu.SMEM((HEAD_TILE,), f32),  # D
            plmgpu.SMEM((HEAD_TILE, block_c), dtype, transforms=tiles_of(128)),
            plmgpu.Barrier(num_barriers=5),
            plmgpu.Barrier(num_arrivals=block_w * (c // copy_c)),
        ],
        grid=grids["mosaic_sparse_mla_dq"],
        grid_names=("row", "hb", "cb"),
        compiler_params=params, interpret=interp, kernel_name="mosaic_sparse_mla_dq",
    )(ids, n_end, qp, dop, lsep, ddp, lat, jnp.zeros((1, c), dtype))
    dq = dq[:, :h, :c_true].reshape(b, nq, h, c_true)

    # dlatent
    check_smem("the mosaic sparse_mla backward (dlatent)", {
        "row tile": ROW_TILE * c * item, "query and d_out head tiles": 2 * block_h * c * item,
        "p and dz": 2 * ROW_TILE * block_h * item, "output": ROW_TILE * block_c * item,
        "lse, D": 2 * block_h * 4,
    }, blocks)
    r_pad = tiles * ROW_TILE
    lat_rows = jnp.pad(lat.reshape(n_rows, c), ((0, r_pad - n_rows), (0, 0)))
    # A tile past the last transpose block starts and ends at the last offset.
    start = jnp.pad(start, (0, tiles * (ROW_TILE // TRANSPOSE_ROWS) + 1 - start.shape[0]), mode="edge")
    mma = tiles_of(block_h * item)
    dlat = plmgpu.kernel(
        functools.partial(_dlatent_kernel, scale=scale, head_tiles=h_pad // block_h,
                          block_h=block_h, block_c=block_c, dtype=dtype),
        out_type=jax.ShapeDtypeStruct((r_pad, c), latent.dtype),
        scratch_types=[
            plmgpu.SMEM((ROW_TILE, c), dtype, transforms=mma),  # latent row tile
            plmgpu.SMEM((block_h, c), dtype, transforms=mma),  # an entry's query head tile
            plmgpu.SMEM((block_h, c), dtype, transforms=mma),  # ... its d_out
            plmgpu.SMEM((ROW_TILE, block_h), dtype, transforms=mma),  # p^T
            plmgpu.SMEM((ROW_TILE, block_h), dtype, transforms=mma),  # scale * dz^T
            plmgpu.SMEM((block_h,), f32),  # lse
            plmgpu.SMEM((block_h,), f32),  # D
            plmgpu.SMEM((ROW_TILE, block_c), dtype, transforms=tiles_of(128)),
            plmgpu.Barrier(num_barriers=5),
        ],
        grid=grids["mosaic_sparse_mla_dlatent"],
        grid_names=("rt", "cb"),
        compiler_params=params, interpret=interp, kernel_name="mosaic_sparse_mla_dlatent",
    )(start, entry_query, entry_mask, qp, dop, lsep, ddp, lat_rows)
    dlat = dlat[:n_rows, :c_true].reshape(n_lat, length, c_true)
    return dq, dlat
