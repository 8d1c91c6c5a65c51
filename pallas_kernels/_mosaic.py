"""What the Mosaic GPU kernels share: when they can run, and the checks they all make.

The scoring and attention kernels (``mosaic_scoring``, ``mosaic_attention``) multiply on
Hopper's tensor cores with ``wgmma``. Invariants:

* They take two operands of one 16-bit float dtype only (``takes_dtypes``): ``wgmma``'s
  float32 is TF32, not IEEE, and the kernels promise the reference's float32 products.
* They run only on a target with ``wgmma`` (``wgmma_on_target``): Blackwell (compute
  capability >= 10) has none, and its compile aborts the process rather than failing.
* ``mosaic_takes`` is the conjunction; where it is false, a wrapper asked for ``"mosaic"``
  runs its Triton kernel instead (as a step without a Mosaic kernel does), so a float32
  layer, or any layer on Blackwell, still runs. Where a Mosaic kernel is called directly
  on other dtypes, ``check_16bit_operands`` refuses them with one message for both kernels.
* Block sizes whose shared memory exceeds a Hopper CTA's (``SMEM_BYTES``) raise
  ``ValueError`` before the launch (``check_smem``): the lowering does not check it, the
  launch would fail on the GPU.

This module is private and imports no kernel module, so the Triton modules can ask
``mosaic_takes`` without importing a Mosaic one. It also holds what a Mosaic forward and its
backward (``mosaic_attention`` / ``mosaic_attention_backward``, ``mosaic_scoring`` /
``mosaic_scoring_backward``) share, one home each: the row gather, padding and tiling rules,
the scoring operand check and the causal candidate rule (``visible_pools``); no kernel
module imports a helper from another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_positive_int, target_device

__all__ = [
    "SMEM_BYTES", "check_smem", "takes_dtypes", "wgmma_on_target", "mosaic_takes",
    "check_16bit_operands", "store", "matmul", "HEAD_TILE", "VALUE_CHUNK", "IDS_COPY", "MAX_INDEX_HEADS", "gather_rows",
    "padded_ids", "padded_widths", "static_scale", "tma_box", "mma_swizzle", "check_index_operands",
    "visible_pools",
]

SMEM_BYTES = 227 * 1024  # the most shared memory one CTA may use on Hopper (sm_90)
# sparse_mla, forward and backward:
HEAD_TILE = 64  # heads per CTA: the warpgroup MMA's M
VALUE_CHUNK = 128  # value columns per MMA (its N)
IDS_COPY = 32  # ids copied per block (>= block_w): a TMA moves a multiple of 128 bytes
# index_scores, forward and backward:
MAX_INDEX_HEADS = 256  # wgmma's largest N


def check_smem(owner: str, buffers: dict[str, int], blocks) -> None:
    """A ``ValueError`` naming ``blocks`` and the buffers when their bytes exceed
    ``SMEM_BYTES`` (a launch would fail on the GPU; the lowering does not check it)."""
    total = sum(buffers.values())
    if total > SMEM_BYTES:
        parts = ", ".join(f"{k} {v}" for k, v in buffers.items())
        raise ValueError(
            f"{owner}: {blocks} needs {total} bytes of shared memory ({parts}), more than "
            f"the {SMEM_BYTES} a Hopper CTA has; use smaller blocks"
        )



def takes_dtypes(*dtypes) -> bool:
    """Whether the Mosaic kernels (scores and attention) take operands of these dtypes: one
    16-bit float dtype (wgmma's float32 is TF32)."""
    kinds = {jnp.dtype(d) for d in dtypes}
    return len(kinds) == 1 and kinds <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}


def wgmma_on_target() -> bool:
    """Whether the device the trace targets can run these kernels' ``wgmma``: anything but
    a CUDA GPU of compute capability 10 or newer. Blackwell has no ``wgmma`` (its MMAs are
    ``tcgen05``; LLVM cannot select ``wgmma`` for sm_100a and the compile aborts the
    process); interpret mode and the abstract H100 of ``cuda_lowering`` are fine."""
    platform, capability = target_device()
    return not (platform in ("cuda", "gpu") and capability is not None and capability[0] >= 10)


def mosaic_takes(*dtypes) -> bool:
    """Whether the wrappers run the Mosaic scoring / attention kernel on operands of these
    dtypes here: 16-bit operands (``takes_dtypes``) on a target with ``wgmma``
    (``wgmma_on_target``). Otherwise they run the Triton kernel (IEEE float32; any GPU), as
    a step with no Mosaic kernel does (see ``pallas_kernels.scoring``), so a float32 layer,
    or any layer on a Blackwell GPU, asked for ``"mosaic"`` (or ``"auto"``) still runs."""
    return takes_dtypes(*dtypes) and wgmma_on_target()


def check_16bit_operands(kernel: str, **operands) -> None:
    """``ValueError`` unless the two ``operands`` (name: array) of the Mosaic ``kernel`` are of
    one 16-bit float dtype (``takes_dtypes``): its MMAs are ``wgmma``'s, whose float32 is
    TF32, not IEEE (shared by the scoring and attention wrappers, one message)."""
    if not takes_dtypes(*(x.dtype for x in operands.values())):
        names = " and ".join(operands)
        got = " and ".join(f"{name} {x.dtype}" for name, x in operands.items())
        raise ValueError(
            f"the mosaic {kernel} multiplies 16-bit operands on the tensor cores (wgmma's "
            f"float32 is TF32): {names} must both be bfloat16 or both float16, got {got}"
        )


def store(plmgpu, ref, value) -> None:
    """``ref[...] = value``: a register ``value`` (in whatever layout it has: WGMMA, a
    row-copy layout, ...) stored into the SMEM ``ref`` (tiled and swizzled for an MMA or
    not), without asking for a bank-conflict-free plan. The one store every Mosaic kernel
    uses, forward and backward, on every jax the project declares: jax >= 0.12 has
    ``plgpu.store(ref, value, optimized=False)``; jax 0.11 has no ``plgpu.store`` (only
    ``plgpu.load``), and its ``ref[...] = value`` (``swap``) lowers to the same register
    store (``store_tiled`` / ``store_untiled`` of the value's layout)."""
    if hasattr(plmgpu, "store"):
        plmgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def matmul(plmgpu, shape, *products):
    """``sum(a @ b for a, b in products)`` as a float32 ``shape`` value: the warpgroup MMAs
    (``wgmma``, SMEM operands) into one scoped accumulator, read back when they are done."""
    def run(acc_ref):
        for a, b in products:
            plmgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plmgpu.ACC(shape, jnp.float32))


# ---- sparse_mla (mosaic_attention and its backward) ----


def gather_rows(plmgpu, ids_g, lat_g, zero_g, ids_s, raw_s, kv_s, ids_bar, row_bar, *, row, lat_b,
                base, length, width_c, copy_c, block_w, row_move):
    """Copy the ids ``base .. base + block_w`` of query row ``row`` into ``ids_s`` and their
    latent rows (of ``lat_g[lat_b]``; a zero row for an id that is not a token) into the
    MMA tile ``kv_s`` through the staging tile ``raw_s`` (see the module doc: Hopper has no
    TMA gather; see ``mosaic_attention``'s doc). Shared by the forward and the backward's dq
    kernel (``mosaic_attention_backward``)."""
    plmgpu.copy_gmem_to_smem(ids_g.at[row, pl.ds(base, max(block_w, IDS_COPY))], ids_s, ids_bar)
    plmgpu.barrier_wait(ids_bar)

    # The gather: one TMA row copy per slot, in a loop (unrolled, the 32 x 3 copies'
    # addresses made ptxas spill at CR = 576).
    @pl.loop(0, block_w)
    def _(r):
        tok = ids_s[r]  # a scalar read of SMEM, not of GMEM
        ok = (tok >= 0) & (tok < length)

        for k in range(0, width_c, copy_c):  # a TMA box is at most 256 elements wide
            cols = pl.ds(k, copy_c)

            @pl.when(ok)
            def _():
                plmgpu.copy_gmem_to_smem(
                    lat_g.at[lat_b, pl.ds(tok, 1), cols], raw_s.at[pl.ds(r, 1), cols], row_bar)

            @pl.when(~ok)
            def _():
                plmgpu.copy_gmem_to_smem(zero_g.at[:, cols], raw_s.at[pl.ds(r, 1), cols], row_bar)

    plmgpu.barrier_wait(row_bar)
    for k in range(0, width_c, copy_c):  # a box of columns at a time: fewer live registers
        cols = pl.ds(k, copy_c)
        store(plmgpu, kv_s.at[:, cols], plmgpu.load(raw_s.at[:, cols], layout=row_move, optimized=False))
    plmgpu.commit_smem()


def padded_widths(c: int, v: int) -> tuple[int, int]:
    """``(CR, V)`` padded as the kernels lay rows out: ``V`` to whole 128-column value chunks,
    ``CR`` to whole 64-column (128-byte) lines and at least the padded ``V``. Zero columns
    add nothing to a score (and the backward's zero ``d_out`` columns nothing to a
    gradient)."""
    v_pad = -(-v // VALUE_CHUNK) * VALUE_CHUNK
    return max(-(-c // 64) * 64, v_pad), v_pad


def padded_ids(token_ids, length: int, block_w: int):
    """``token_ids [B, Q, W]`` as the gather reads them: ``[B*Q, W_pad]`` int32, ``-1``-padded
    to whole id blocks plus room for the last block's copy of ``IDS_COPY`` ids, and each
    row's ``n_end [B*Q]``: one past its last valid id (its blocks past that are skipped)."""
    b, nq, width = token_ids.shape
    ids = token_ids.reshape(b * nq, width).astype(jnp.int32)
    w_pad = -(-width // block_w) * block_w + max(0, IDS_COPY - block_w)
    ids = jnp.pad(ids, ((0, 0), (0, w_pad - width)), constant_values=-1)
    ok = (ids >= 0) & (ids < length)
    n_end = jnp.max(jnp.where(ok, jnp.arange(1, w_pad + 1, dtype=jnp.int32), 0), axis=1)
    return ids, n_end


def tma_box(c: int) -> int:
    """The TMA box width the gather copies a padded row of ``c`` columns in: a TMA box is at
    most 256 elements wide."""
    return max(k for k in (256, 192, 128, 64) if c % k == 0)


def static_scale(scale) -> float:
    """``scale`` as a Python float (the kernels bake it in), or a ``ValueError``."""
    try:
        return float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(f"scale must be a static Python float for the Mosaic kernel, got {scale!r}") from e


# ---- index_scores (mosaic_scoring and its backward) ----


def mma_swizzle(dim: int, itemsize: int) -> int:
    """The widest TMA / MMA swizzle (bytes) that tiles a row of ``dim`` elements."""
    for s in (128, 64, 32):
        if (dim * itemsize) % s == 0:
            return s
    raise ValueError(f"no swizzle tiles a row of {dim} x {itemsize} bytes")


def check_index_operands(q, keys, keys_name, kpool):
    """``ValueError`` unless ``q`` and ``keys`` (named ``keys_name``) are one 16-bit dtype,
    the heads at most wgmma's N and ``kpool`` positive (shared with the backward)."""
    heads = q.shape[2]
    check_16bit_operands("index_scores", **{"q": q, keys_name: keys})
    if heads > MAX_INDEX_HEADS:
        raise ValueError(f"the mosaic index_scores takes at most {MAX_INDEX_HEADS} heads Hi, got {heads}")
    check_positive_int("kpool", kpool)


def visible_pools(first_key, q_pos, kpool: int):
    """``vis [B, Q]`` int32: the pools query ``t`` can see causally. Pool ``p`` (contiguous
    keys from ``first_key``) is a candidate iff valid and ``p < vis`` (``first_key + (p +
    1)*KP - 1 <= q_pos``; a padding query, ``q_pos = -1``, sees none)."""
    return jnp.floor_divide(q_pos.astype(jnp.int32) - first_key.astype(jnp.int32)[:, None] + 1, kpool)
