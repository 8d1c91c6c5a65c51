"""``sparse_mla`` as a Mosaic GPU kernel (``implementation="mosaic"`` / ``"mosaic_interpret"``).

The contract is ``pallas_kernels.attention``'s (the reference and the Triton kernel live
there): ``q [B, Q, H, CR]`` absorbed queries attend over the latent rows ``latent[b or 0,
id]`` named by ``token_ids [B, Q, W]``, the score over all ``CR`` columns, the values the
first ``V = value_width``; ``latent`` is per sequence ``[B, L, CR]`` or one shared pool
``[1, L, CR]`` (the paged cache); an id outside ``[0, L)`` is never read and gets no weight;
a row with no valid id returns zeros; softmax in float32; output in ``q``'s dtype.

Kernel shape (``plmgpu.kernel``, Lane lowering semantics, one warpgroup per CTA, grid
``(B*Q rows, head blocks of 64, value blocks, splits)``):

* The CTA's 64 heads are the warpgroup MMA's M (heads padded with zero queries); its query
  tile ``[64, CR]`` is copied into SMEM once by TMA.
* Hopper has no TMA gather: per id block of ``block_w`` slots (the ids first copied to
  SMEM, then read there as scalars), every slot issues TMA copies of its row into an SMEM
  staging tile (``CR / 256`` or more boxes per row: a TMA box is at
  most 256 elements wide), all arriving on one barrier of as many arrivals. A slot whose
  id is not a token copies a zero row from a ``[1, CR]`` constant instead, so the latent is
  never read there and the tile holds no stale (possibly NaN) data that a zero weight
  could turn into NaN. The slots are a loop, not unrolled (unrolled, the copies' addresses
  made ptxas spill). The staging tile is then moved, a TMA box of columns at a time,
  through registers into the tiled,
  swizzled layout the MMA reads (TMA cannot write one row of a tile: a slice of a tiled
  SMEM dimension must be a whole 8-row tile). That move is not bank-conflict free (Mosaic's
  ``optimized=False`` transfer, in its ``SMEM_GMEM_COPY`` layout); a warp-level gather
  straight into the swizzled tile would remove it.
* ``scores = q_tile @ rows^T`` (``wgmma``, ``[64, block_w]`` f32), scaled, ``-inf`` at
  invalid slots, online softmax in f32 (running max and sum per head); the probabilities,
  rounded to the input dtype (as the Triton kernel's ``p``), are stored to SMEM and
  ``acc = alpha * acc + p @ rows[:, value columns]`` runs in chunks of 128 columns (wgmma's
  N). Every MMA operand has the swizzle of one ``p`` row (``block_w`` 16-bit elements: 32,
  64 or 128 bytes): wgmma wants its two operands' swizzles equal. (The probabilities go
  through SMEM, not registers: the interpret mode runs the ref form of wgmma, an ``ACC``
  of ``pl.run_scoped``, but not ``pl.run_state`` over ``ACC.init`` with a register operand,
  whose ``wgmma`` primitive has no CPU translation in jax 0.12.0.1.)
* A CTA accumulates ``block_v`` value columns (default 128): a 64 x 512 float32
  accumulator would need 256 registers per thread of one warpgroup, so ``V = 512`` runs as
  ``V / block_v`` value blocks, each re-scoring the rows (the later CTAs' row reads hit
  L2). 128 rather than 256: with 256 ptxas spills (see ``MosaicSparseMlaBlockSizes``).
* Decode splits each row's id blocks over ``num_splits`` CTAs (flash decoding); a CTA
  processes only the blocks up to the row's last valid id (``n_end``, computed by the
  wrapper). Every CTA writes its unnormalised accumulator, running max and sum; the
  wrapper merges them (``dense_mla.combine_splits``, a small XLA fusion), which also
  divides by the sum (0 for a row with no valid id: the output is exactly 0).
* ``return_lse=True`` also returns each head's log-sum-exp of the scaled scores, merged
  from the same split partials (``dense_mla.combine_splits``; ``-inf`` for a row with no
  valid id): the
  residual the backward (``mosaic_attention_backward``) recomputes probabilities from. The
  kernel is the same launch, so ``out`` is the same bits either way.

Operands: ``q`` and ``latent`` of one 16-bit dtype (``_mosaic.takes_dtypes``; the tensor
cores' float32 is TF32): ``sparse_mla`` runs any other dtypes on the Triton kernel, as
``index_scores`` does, and so it does on a Blackwell GPU, which has no ``wgmma``
(``_mosaic.wgmma_on_target``). Rows are padded with zero columns to a multiple of
64 (a 128-byte line) and to at least ``V`` rounded up to 128 (the value chunks); that is a copy of the
latent per call when ``CR`` is not already aligned (no real model: ``CR`` is 512 or 576,
``V`` 512). Outputs agree with the reference
within float32 rounding (different summation order, and ``p`` rounded to 16 bits before
the value MMA as in the Triton kernel).
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
    HEAD_TILE, IDS_COPY, VALUE_CHUNK, check_16bit_operands, check_smem, gather_rows, padded_ids,
    padded_widths, static_scale, store, tma_box,
)
from pallas_kernels.dense_mla import combine_splits

__all__ = ["MosaicSparseMlaBlockSizes", "mosaic_sparse_mla", "HEAD_TILE"]

_TARGET_CTAS = 256  # auto num_splits aims at about this many CTAs (2 per H100/H200 SM)
_MIN_BLOCKS_PER_SPLIT = 4


@dataclasses.dataclass(frozen=True)
class MosaicSparseMlaBlockSizes:
    """Tiling of the Mosaic GPU ``sparse_mla`` (see the module doc).

    * ``block_w``: selected ids gathered per step, the score MMA's N: 16, 32 or 64
      (SMEM holds the query tile and two ``[block_w, CR]`` tiles: 32 fits Hopper's 227 KiB
      at ``CR = 576``, 64 does not);
    * ``block_v``: value columns per CTA, a multiple of 128; lowered to the largest
      multiple of 128 that divides ``V`` (rounded up to 128).

    The defaults (32, 128) compile for sm_90a without spilling at ``CR = 512`` and ``576``,
    ``V = 512`` (``python -m glm5_dsa_jax.gpu_compile``; 255 registers): with
    ``block_v=256`` the two 64 x 128 float32 accumulators alone take 128 registers a thread
    and ptxas spills about 300 bytes a thread, so ``V = 512`` runs as four value blocks,
    each re-scoring its rows (unmeasured: no GPU here);
    * ``num_splits``: CTAs each row's id blocks are split over (int >= 1; ``None``: enough
      for about 256 CTAs, each share at least 4 id blocks).
    """

    block_w: int = 32
    block_v: int = 128
    num_splits: int | None = None

    def validate(self) -> "MosaicSparseMlaBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        name = "MosaicSparseMlaBlockSizes."
        if self.block_w not in (16, 32, 64) or isinstance(self.block_w, bool):
            raise ValueError(f"{name}block_w must be 16, 32 or 64, got {self.block_w!r}")
        bv = self.block_v
        if not isinstance(bv, int) or isinstance(bv, bool) or bv < VALUE_CHUNK or bv % VALUE_CHUNK:
            raise ValueError(f"{name}block_v must be a multiple of {VALUE_CHUNK}, got {bv!r}")
        if self.num_splits is not None:
            check_positive_int(name + "num_splits", self.num_splits)
        return self

    def resolve(self, rows: int, head_blocks: int, width: int, v: int) -> "MosaicSparseMlaBlockSizes":
        """Every field set for ``rows = B*Q`` query rows, ``head_blocks`` CTAs of heads, id
        rows of width ``W = width`` and ``V = v`` value columns."""
        self.validate()
        block_v = min(self.block_v, v)
        while v % block_v:  # value blocks tile V (both multiples of 128)
            block_v -= VALUE_CHUNK
        splits = self.num_splits
        if splits is None:
            ctas = rows * head_blocks * (v // block_v)
            want = max(1, -(-_TARGET_CTAS // max(ctas, 1)))
            splits = max(1, min(want, -(-max(width, 1) // self.block_w) // _MIN_BLOCKS_PER_SPLIT))
        return dataclasses.replace(self, block_v=block_v, num_splits=splits)


def _kernel(ids_g, nend_g, q_g, lat_g, zero_g, acc_g, m_g, l_g,
            q_s, raw_s, kv_s, p_s, ids_s, o_s, vec_s, bars, row_bar,
            *, scale, length, shared, nq, width_c, copy_c, swizzle, block_w, block_v, num_splits, dtype):
    plmgpu = require_mosaic_gpu("sparse_mla")
    wgmma_layout = plmgpu.Layout.WGMMA
    per_head = wgmma_layout.reduce(1)
    per_slot = wgmma_layout.reduce(0)
    # The staging -> MMA tile move: a layout made for copying 128-byte swizzled tiles.
    row_move = plmgpu.Layout.SMEM_GMEM_COPY((block_w, copy_c), dtype, swizzle)
    row, hb, vb, split = (lax.axis_index(a) for a in ("row", "hb", "vb", "split"))
    lat_b = 0 if shared else row // nq
    h0 = hb * HEAD_TILE
    v0 = vb * block_v
    n_chunks = block_v // VALUE_CHUNK

    plmgpu.copy_gmem_to_smem(q_g.at[row, pl.ds(h0, HEAD_TILE)], q_s, bars.at[0])
    plmgpu.barrier_wait(bars.at[0])

    n_blocks = (nend_g[row] + block_w - 1) // block_w
    lo = split * n_blocks // num_splits
    hi = (split + 1) * n_blocks // num_splits

    def step(j, carry):
        m_prev, l_prev, accs = carry
        base = j * block_w
        gather_rows(plmgpu, ids_g, lat_g, zero_g, ids_s, raw_s, kv_s, bars.at[1], row_bar, row=row,
                    lat_b=lat_b, base=base, length=length, width_c=width_c, copy_c=copy_c,
                    block_w=block_w, row_move=row_move)

        def score_mma(acc_ref):
            plmgpu.wgmma(acc_ref, q_s, kv_s.T)
            return acc_ref[...]

        s = pl.run_scoped(score_mma, plmgpu.ACC((HEAD_TILE, block_w), jnp.float32))
        ids = plmgpu.load(ids_s.at[pl.ds(0, block_w)], layout=per_slot)
        ok = lax.broadcast_in_dim((ids >= 0) & (ids < length), (HEAD_TILE, block_w), [1])
        s = jnp.where(ok, s * scale, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        alpha = jnp.exp(m_prev - m_safe)  # 0 while m_prev is -inf
        p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))  # 0 at masked slots
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        store(plmgpu, p_s, p.astype(dtype))
        plmgpu.commit_smem()
        new = []
        for c, acc in enumerate(accs):
            def value_mma(acc_ref, c=c):
                plmgpu.wgmma(acc_ref, p_s, kv_s.at[:, pl.ds(v0 + c * VALUE_CHUNK, VALUE_CHUNK)])
                return acc_ref[...]

            pv = pl.run_scoped(value_mma, plmgpu.ACC((HEAD_TILE, VALUE_CHUNK), jnp.float32))
            new.append(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv)
        return m_next, l_next, tuple(new)

    m0 = plmgpu.layout_cast(jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32), per_head)
    l0 = plmgpu.layout_cast(jnp.zeros((HEAD_TILE,), jnp.float32), per_head)
    acc0 = tuple(plmgpu.layout_cast(jnp.zeros((HEAD_TILE, VALUE_CHUNK), jnp.float32), wgmma_layout)
                 for _ in range(n_chunks))
    m_i, l_i, accs = lax.fori_loop(lo, hi, step, (m0, l0, acc0))

    for c, acc in enumerate(accs):
        o_s[...] = acc
        plmgpu.commit_smem()
        plmgpu.copy_smem_to_gmem(
            o_s, acc_g.at[row, split, pl.ds(h0, HEAD_TILE), pl.ds(v0 + c * VALUE_CHUNK, VALUE_CHUNK)])
        plmgpu.wait_smem_to_gmem(0)
    # The running max and sum, once per (row, head block, split): value block 0 writes them.
    vec_s[0] = m_i
    vec_s[1] = l_i
    plmgpu.commit_smem()

    @pl.when(vb == 0)
    def _():
        plmgpu.copy_smem_to_gmem(vec_s.at[0], m_g.at[row, split, pl.ds(h0, HEAD_TILE)])
        plmgpu.copy_smem_to_gmem(vec_s.at[1], l_g.at[row, split, pl.ds(h0, HEAD_TILE)])
        plmgpu.wait_smem_to_gmem(0)


def mosaic_sparse_mla(q, latent, token_ids, *, scale, value_width, interpret,
                      block_sizes: MosaicSparseMlaBlockSizes, return_lse: bool = False):
    """``[B, Q, H, V]`` attention (shapes and meaning as ``sparse_mla_reference``; the caller
    checked shapes and ``V = value_width``) with the Mosaic GPU kernel. With
    ``return_lse``: ``(out, lse)``, ``lse [B, Q, H]`` float32 the log-sum-exp of the scaled
    scores over the row's valid ids (``-inf`` for a row with none), what the backward
    (``mosaic_attention_backward``) recomputes the probabilities from; ``out`` is the same
    bits either way."""
    plmgpu = require_mosaic_gpu("sparse_mla")
    b, nq, h, c = q.shape
    v = value_width
    length = latent.shape[1]
    width = token_ids.shape[2]
    check_16bit_operands("sparse_mla", q=q, latent=latent)
    if b * nq * h == 0 or width == 0 or length == 0:
        out = jnp.zeros((b, nq, h, v), q.dtype)
        return (out, jnp.full((b, nq, h), -jnp.inf, jnp.float32)) if return_lse else out
    scale = static_scale(scale)

    # Rows padded to whole 64-column lines and to whole 128-column value chunks: zero
    # columns add nothing to a score, and value columns past V are cut off below.
    c_pad, v_pad = padded_widths(c, v)
    if c_pad != c:  # a copy of the latent (no real model: CR = 512 or 576, V = 512)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, c_pad - c)))
        latent = jnp.pad(latent, ((0, 0), (0, 0), (0, c_pad - c)))
    v_true, v, c = v, v_pad, c_pad
    rows = b * nq
    n_h = -(-h // HEAD_TILE)
    blocks = block_sizes.resolve(rows, n_h, width, v)
    block_w, block_v, splits = blocks.block_w, blocks.block_v, blocks.num_splits
    h_pad = n_h * HEAD_TILE
    item = q.dtype.itemsize
    check_smem("the mosaic sparse_mla", {
        "query tile": HEAD_TILE * c * item, "gathered rows": 2 * block_w * c * item,
        "probabilities": HEAD_TILE * block_w * item,
        "output": HEAD_TILE * VALUE_CHUNK * 4 + 2 * HEAD_TILE * 4 + block_w * 4,
    }, blocks)
    qp = jnp.pad(q.reshape(rows, h, c), ((0, 0), (0, h_pad - h), (0, 0)))
    ids, n_end = padded_ids(token_ids, length, block_w)

    copy_c = tma_box(c)
    # One swizzle for every MMA operand (wgmma wants its two operands' swizzles equal): one
    # row of probabilities, block_w 16-bit elements, is 32, 64 or 128 bytes.
    swizzle = block_w * item
    mma_tiles = (plmgpu.TilingTransform((8, swizzle // item)), plmgpu.SwizzleTransform(swizzle))
    f32_tiles = (plmgpu.TilingTransform((8, 32)), plmgpu.SwizzleTransform(128))
    kernel = functools.partial(
        _kernel, scale=scale, length=length, shared=latent.shape[0] == 1, nq=nq, width_c=c,
        copy_c=copy_c, swizzle=swizzle,
        block_w=block_w, block_v=block_v, num_splits=splits, dtype=q.dtype,
    )
    f32 = jnp.float32
    acc, m, l = plmgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((rows, splits, h_pad, v), f32),
                  jax.ShapeDtypeStruct((rows, splits, h_pad), f32),
                  jax.ShapeDtypeStruct((rows, splits, h_pad), f32)),
        scratch_types=[
            plmgpu.SMEM((HEAD_TILE, c), q.dtype, transforms=mma_tiles),  # query tile
            plmgpu.SMEM((block_w, c), q.dtype),  # gathered rows, as copied
            plmgpu.SMEM((block_w, c), q.dtype, transforms=mma_tiles),  # ... as the MMA reads them
            plmgpu.SMEM((HEAD_TILE, block_w), q.dtype, transforms=mma_tiles),  # probabilities
            plmgpu.SMEM((max(block_w, IDS_COPY),), jnp.int32),
            plmgpu.SMEM((HEAD_TILE, VALUE_CHUNK), f32, transforms=f32_tiles),
            plmgpu.SMEM((2, HEAD_TILE), f32),
            plmgpu.Barrier(num_barriers=2),
            plmgpu.Barrier(num_arrivals=block_w * (c // copy_c)),
        ],
        grid=(rows, n_h, v // block_v, splits),
        grid_names=("row", "hb", "vb", "split"),
        compiler_params=plmgpu.CompilerParams(lowering_semantics=plmgpu.LoweringSemantics.Lane),
        interpret=plmgpu.InterpretGPUParams() if interpret else None,
        kernel_name="mosaic_sparse_mla",
    )(ids, n_end, qp, latent, jnp.zeros((1, c), latent.dtype))
    if not return_lse:
        out = combine_splits(acc, m, l)
    else:
        out, lse = combine_splits(acc, m, l, return_lse=True)
    out = out.astype(q.dtype)[:, :h, :v_true].reshape(b, nq, h, v_true)
    return (out, lse[:, :h].reshape(b, nq, h)) if return_lse else out
