"""``sparse_mla``: weight-absorbed MLA attention over the selected latent rows only.

Axis letters as in the package glossary (``pallas_kernels``; ``CR``: the width of a latent
row, ``V``: its leading value columns). Invariants:

* Queries are already absorbed and keys and values are the same latent rows ``latent[b,
  id]``, so one gather of the ``W`` rows named by ``token_ids`` serves every head. A query
  ``q [B, Q, H, CR]`` is as wide as a row: the score of a row is ``q . row`` over all ``CR``
  columns, the value is the row's first ``V = value_width`` columns, and the output is the
  latent attention output ``[B, Q, H, V]`` (``absorb_o`` applies ``W_UV`` and ``o_proj``).
* Without RoPE (``glm5_next``) a row is the latent ``c`` (``CR = V = C = kv_lora_rank``)
  and ``q = q_nope @ W_UK``. With RoPE (``glm_moe_dsa``, ``deepseek_v32``) a row is ``[c,
  k_rot]`` (``CR = C + R``, ``R = qk_rope_head_dim``: 576 at 512 + 64), the query is
  ``[q_nope @ W_UK, q_rot]`` and ``V = C``: the score is ``q_lat . c + q_rot . k_rot``
  (HF's ``q_nope . k_nope + q_rot . k_rot`` with ``W_UK`` absorbed) and the values are
  ``c`` alone, as HF's value heads are ``c @ W_UV``. ``value_width=None`` means ``V = CR``.
* ``latent`` is ``[B, L, CR]`` (one cache row per sequence) or ``[1, L, CR]``, one pool of
  rows that every batch row reads (``latent[0, id]``): the paged cache's flat latent pool
  ``[N * page_size, CR]``, where ``token_ids`` are then physical slots (``block_table[b, t //
  page_size] * page_size + t % page_size`` for token ``t`` of sequence ``b``). Which slots a
  row may read is the caller's business: a row reads exactly the slots it names, so a row
  naming only its own sequence's slots reads no other sequence's page. A shared pool is
  never copied per row (the Pallas latent block of every program is batch 0's).
* ``id < 0`` (and ``id >= L``) is not a token: it is never read and gets no weight.
* A row with no valid id returns zeros: never NaN, never an out-of-bounds read.
* Softmax in float32 (float64 for float64 inputs: the references only, for finite
  differences) with the caller's ``scale`` (``qk_head_dim**-0.5``, times YaRN's
  ``mscale**2`` when the RoPE parameters ask for it); the output has ``q``'s dtype.
* The ``"xla"`` reference on bf16 ``q`` and rows keeps them bf16: the scores are bf16
  products in a float32 accumulator (exact products, as the float32 ones), and the value
  sum splits each float32 softmax weight into two bf16 parts (``weighted_values``), within
  ``2**-16`` of the float32 sum, so the output is the float32 reference's but for rare
  one-ulp ties (about 0.2 % of outputs at GLM-5.3-Flash shapes); its gradients are the
  float32 products'. Why: on XLA:CPU the float32 copy of the gathered rows cost more than
  the products (a GLM-5.3-Flash batch-8 decode step ran 1.16x faster at 4K and 1.23x at
  131K, ``docs/benchmarks.md``). The kernels round the weights to bf16 once (tensor cores).
* fp8 rows: with ``latent_scale [B or 1, L]`` (float32, one per row) ``latent`` is
  ``float8_e4m3fn`` and row ``id`` is ``latent[b, id] * latent_scale[b, id]``
  (``glm5_dsa_jax.cache.fp8``). The scale is folded into the sums rather than into the row:
  a row's score is ``(q . row8) * s_id * scale`` and its softmax weight is multiplied by
  ``s_id`` before the value sum (``sum_id p_id * s_id * row8``), so the kernel's dots keep
  e4m3 rows converted exactly to the query's 16-bit dtype. The reference does the same
  products in the same order (in float32). Group scales ``latent_scale [B or 1, L, G]``
  (``"group"`` layout; columns to groups: ``pallas_kernels._mla``'s module doc): the
  ``"xla"`` reference and its backward dequantise the gathered rows column by column; the
  Triton kernel (and its ``dq``) applies each group's scale to its columns' score and
  weight (``pallas_kernels._mla``'s module doc); the Mosaic kernels read no fp8 rows.
* Differentiable w.r.t. ``q`` and ``latent`` under every implementation (a
  ``jax.custom_vjp``; see the comment above ``_attend``): the forward saves the output and
  its log-sum-exp, never the gathered ``[Q, W, CR]`` rows; the backward
  (``pallas_kernels.attention_backward``) is deterministic. ``token_ids`` and
  ``latent_scale`` get no gradient, nor does an fp8 ``latent`` (a serving format).
* A row must not repeat an id (the selection never does): the dense oracle
  ``topk_to_mask`` counts a repeated id once, the sparse path would weigh it twice.

The dense oracle (``topk_to_mask`` + ``mla_masked_attention``, in ``pallas_kernels.dense_mla``:
the same attention computed over every key with a boolean mask, as Hugging Face's
references compute it) takes the same ``value_width``.

The Pallas kernel (Triton backend; see the comment above ``_sparse_mla_kernel``): one
program per (batch, query) row, block of ``block_h`` heads and share of the row's id
blocks; an online softmax over gathered blocks of ``block_w`` latent rows, each gathered
once for both the scores and the values, with a masked load (an invalid id is really never
read, whereas the reference reads the clamped row and gives it weight 0). The loop stops
after the last valid id of the row, so short rows cost little. Any H, CR and V work: heads
are padded to ``block_h``, the row is processed in ``block_c`` chunks (scores over every
chunk, an accumulator only for the chunks holding value columns). Block sizes
(``SparseMlaBlockSizes``) change the tiling and the order of the sums, not the result
beyond float rounding.

The Mosaic GPU kernel (``"mosaic"``, ``pallas_kernels.mosaic_attention``, its block sizes
``MosaicSparseMlaBlockSizes``) keeps this contract for 16-bit ``q`` and ``latent`` of one
dtype; other dtypes (float32: wgmma's is TF32; an fp8 cache) run the Triton kernel here.

``sparse_mla_partial`` is the same launch under every implementation returning the output
and its log-sum-exp ``[B, Q, H]`` (``-inf`` for a row with no valid id; the Triton kernel's
``lse`` output, the Mosaic kernel's ``return_lse``, the reference's): one device's part of
an attention whose rows are split over devices, merged by the log-sum-exp (context
parallelism). The forward only: no custom gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    Implementation, check_positive_int, check_power_of_two, check_triton_params,
    eager_jit, kernel_family, next_power_of_two, without_mosaic,
)
from pallas_kernels._dtypes import key_dot_dtype
from pallas_kernels._mla import (
    check_group_scales, chunk_groups, column_scales, one_scale_a_row, part_columns,
    accumulation_dtype, check_operands, default_block_c, dot_nn, dot_nt, gather_rows, pad_ids, row_end,
)
from pallas_kernels._mosaic import mosaic_takes
from pallas_kernels.attention_backward import sparse_mla_backward
from pallas_kernels.dense_mla import check_value_width, masked_softmax
from pallas_kernels.mosaic_attention import MosaicSparseMlaBlockSizes, mosaic_sparse_mla

__all__ = ["sparse_mla", "sparse_mla_reference", "sparse_mla_partial", "SparseMlaBlockSizes",
           "MosaicSparseMlaBlockSizes"]

_HI = jax.lax.Precision.HIGHEST


def sparse_mla_reference(
    q: jax.Array, latent: jax.Array, token_ids: jax.Array, latent_scale: jax.Array | None = None,
    *, scale: float, value_width: int | None = None,
) -> jax.Array:
    """Plain-jnp sparse attention.

    Args:
      q: ``[B, Q, H, CR]`` absorbed queries (``[q_lat, q_rot]`` with RoPE), as wide as a row.
      latent: ``[B, L, CR]`` latent cache rows (keys and values at once), or ``[1, L, CR]``
        shared by every batch row (the paged cache's flat pool).
      token_ids: ``[B, Q, W]`` int32 selected token ids (slots of ``latent``'s ``L``
        axis), ``-1`` = none.
      latent_scale: ``[B or 1, L]`` float32 row scales of an fp8 ``latent``, else None.
      scale: softmax scale (``qk_head_dim**-0.5``, with YaRN's ``mscale**2`` if any).
      value_width: ``V``, the leading columns of a row that are values (``None``: all
        ``CR``; ``kv_lora_rank`` with RoPE).

    Returns:
      ``[B, Q, H, V]`` in ``q.dtype``.
    """
    return _reference_with_lse(q, latent, token_ids, latent_scale, scale=scale,
                               value_width=value_width)[0]


def sparse_mla_partial(
    q: jax.Array, latent: jax.Array, token_ids: jax.Array, latent_scale: jax.Array | None = None,
    *, scale: float, value_width: int | None = None, implementation: Implementation = "xla",
    block_sizes: SparseMlaBlockSizes | MosaicSparseMlaBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(out [B, Q, H, V] in q.dtype, lse [B, Q, H] float32)``: ``sparse_mla`` over the
    ids a caller holds and its log-sum-exp (``-inf``, output zeros, where a row holds
    none): one part of an attention whose rows are split over devices (context
    parallelism, ``glm5_dsa_jax.parallel.context``), whose parts merge exactly by their
    log-sum-exp: ``sum_i exp(lse_i - LSE) out_i`` with ``LSE = log sum_i exp(lse_i)``.

    Operands, checks and ``implementation`` / ``block_sizes`` as ``sparse_mla``'s, and the
    same kernel launch: ``"xla"`` the reference (``sparse_mla_reference``'s output and its
    log-sum-exp), ``"pallas"`` / ``"pallas_interpret"`` the Triton kernel (its ``lse``
    output, merged over its splits by ``sparse_mla_combine``), ``"mosaic"`` /
    ``"mosaic_interpret"`` the Mosaic kernel with ``return_lse=True`` where it takes the
    operands (16-bit ``q`` and ``latent`` of one dtype, a target with ``wgmma``), else the
    Triton one, as ``sparse_mla`` falls back. So ``out`` is ``sparse_mla``'s bit for bit
    under each implementation. The forward only: no custom gradient (the kernels' outputs
    are not differentiable here; ``"xla"`` differentiates as plain jnp)."""
    implementation, mosaic, blocks = kernel_family(implementation, block_sizes, SparseMlaBlockSizes,
                                                   MosaicSparseMlaBlockSizes, kernel="sparse_mla")
    check_operands(q, latent, token_ids, latent_scale)
    v = check_value_width(value_width, q.shape[3])
    latent_scale = check_group_scales(latent_scale, q.shape[3], v, implementation, kernels_read=True)
    if mosaic and not mosaic_takes(q.dtype, latent.dtype):  # float32 or fp8 rows: as sparse_mla
        implementation, mosaic, blocks = without_mosaic(implementation), False, SparseMlaBlockSizes()
    if implementation == "xla":
        return _reference_with_lse(q, latent, token_ids, latent_scale, scale=scale, value_width=v)
    if mosaic:
        return _sparse_mla_mosaic(q, latent, token_ids, scale=scale, value_width=v,
                                  interpret=implementation == "mosaic_interpret", block_sizes=blocks,
                                  return_lse=True)
    return _sparse_mla_pallas(q, latent, token_ids, latent_scale, scale=scale, value_width=v,
                              interpret=implementation == "pallas_interpret",
                              block_sizes=blocks.resolve(q.shape, token_ids.shape[2]))


def _reference_with_lse(q, latent, token_ids, latent_scale=None, *, scale, value_width=None):
    """``sparse_mla_reference``'s output and the log-sum-exp ``[B, Q, H]`` of its scaled
    scores over the valid ids (``-inf`` where none; float32, float64 for float64 inputs),
    the backward's residual."""
    length = latent.shape[1]
    v = check_value_width(value_width, latent.shape[2])
    f = accumulation_dtype(q, latent)
    valid = (token_ids >= 0) & (token_ids < length)
    safe = jnp.clip(token_ids, 0, length - 1)
    latent_scale = one_scale_a_row(latent_scale)
    # bf16 rows and queries stay bf16: their products are exact in the float32 accumulator
    # (no float32 copy of the gathered rows); see ``weighted_values`` for the value sum.
    bf16 = q.dtype == latent.dtype == jnp.bfloat16 and latent_scale is None
    kv = gather_rows(latent, safe)  # [B,Q,W,CR]
    kv = kv if bf16 else kv.astype(f)
    if latent_scale is not None and latent_scale.ndim == 3:  # group scales: dequantise the rows
        kv = kv * gather_rows(column_scales(latent_scale.astype(f), latent.shape[2], v), safe)
        latent_scale = None
    # An invalid slot reads the clamped row 0 here; zero it so a NaN there costs nothing.
    kv = jnp.where(valid[..., None], kv, jnp.zeros((), kv.dtype))
    if bf16:
        s = _flat_batch_product("nhc,nwc->nhw", q, kv, f)
    else:
        s = jnp.einsum("bqhc,bqwc->bqhw", q.astype(f), kv, precision=_HI)
    if latent_scale is not None:  # fp8 rows: each row's scale on its score and its weight
        row_scale = gather_rows(latent_scale.astype(f)[..., None], safe)[..., 0]
        row_scale = jnp.where(valid, row_scale, 0.0)[:, :, None, :]  # [B, Q, 1, W]
        s = s * row_scale
    p = masked_softmax(s * scale, valid[:, :, None, :])
    if latent_scale is not None:
        p = p * row_scale
    o = weighted_values(p, kv[..., :v]) if bf16 else jnp.einsum("bqhw,bqwc->bqhc", p, kv[..., :v], precision=_HI)
    z = jnp.where(valid[:, :, None, :], s * scale, -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(z - m), axis=-1)  # exp(-inf) = 0 at invalid slots
    lse = jnp.where(total > 0, m[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return o.astype(q.dtype), lse


@jax.custom_jvp
def weighted_values(p: jax.Array, values: jax.Array) -> jax.Array:
    """``einsum("bqhw,bqwc->bqhc", p, values)`` for float32 softmax weights ``p [B, Q, H, W]``
    and bf16 ``values [B, Q, W, V]``, as bf16 products with a float32 accumulator.

    Why: XLA:CPU multiplies bf16 operands into a float32 accumulator about twice as fast
    as it converts the gathered rows to float32 and multiplies those (the reference alone
    at GLM-5.3-Flash shapes, batch 8, 2,051 rows: 19.6 -> 9.7 ms in one run). How, without
    rounding the weights to bf16 as the kernels do: ``p = hi + lo + r`` with ``hi`` its bf16
    rounding and ``lo`` the bf16 rounding of ``p - hi``, so ``|r| <= 2**-16 |p|``; ``hi``
    and ``lo`` are stacked as ``2H`` rows of one product and their sums added. The value
    sum is then within ``2**-16`` (relative, per weight) of the float32 one, 128 times
    below the bf16 rounding of the output: at most one bf16 ulp apart, in about 0.2 % of
    outputs at GLM-5.3-Flash shapes. Under autodiff the tangents (and so the gradients)
    are the float32 products' (``_weighted_values_jvp``)."""
    h = p.shape[2]
    hi = p.astype(values.dtype)
    lo = (p - hi.astype(p.dtype)).astype(values.dtype)
    both = jnp.concatenate([hi, lo], axis=2)
    o = _flat_batch_product("nhw,nwc->nhc", both, values, p.dtype)
    return o[:, :, :h] + o[:, :, h:]


def _flat_batch_product(spec: str, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """``einsum(spec)`` of 16-bit ``a [B, Q, ...]`` and ``b [B, Q, ...]`` into ``out_dtype``,
    with ``(B, Q)`` as one batch axis ``n``. Why: XLA:CPU (jax 0.10) multiplies 16-bit
    operands into a float32 accumulator only for some products; with two batch axes it
    converted both operands to float32 whenever ``a`` came out of an earlier product (the
    layer's ``absorb_q``), with one it keeps them 16-bit."""
    lead = a.shape[:2]
    out = jnp.einsum(spec, a.reshape((-1,) + a.shape[2:]), b.reshape((-1,) + b.shape[2:]),
                     precision=_HI, preferred_element_type=out_dtype)
    return out.reshape(lead + out.shape[1:])


@weighted_values.defjvp
def _weighted_values_jvp(primals, tangents):
    p, values = primals
    dp, dvalues = tangents
    f = p.dtype
    t = (jnp.einsum("bqhw,bqwc->bqhc", dp, values.astype(f), precision=_HI)
         + jnp.einsum("bqhw,bqwc->bqhc", p, dvalues.astype(f), precision=_HI))
    return weighted_values(p, values), t


def sparse_mla(
    q: jax.Array, latent: jax.Array, token_ids: jax.Array, latent_scale: jax.Array | None = None,
    *, scale: float, value_width: int | None = None, implementation: Implementation = "xla",
    block_sizes: SparseMlaBlockSizes | MosaicSparseMlaBlockSizes | None = None,
) -> jax.Array:
    """Sparse absorbed MLA; see the module doc. Shapes as ``sparse_mla_reference``:
    ``q [B, Q, H, CR]``, ``latent [B or 1, L, CR]``, ``token_ids [B, Q, W]`` ->
    ``[B, Q, H, V]`` (``V = value_width``, default ``CR``); ``latent_scale [B or 1, L]``
    with an fp8 ``latent``. ``block_sizes`` (validated under every implementation) tiles
    the kernel: a ``SparseMlaBlockSizes`` for ``"pallas"``, a ``MosaicSparseMlaBlockSizes``
    for ``"mosaic"`` (either for ``"xla"``; ``None``: the defaults)."""
    implementation, mosaic, blocks = kernel_family(implementation, block_sizes, SparseMlaBlockSizes, MosaicSparseMlaBlockSizes,
                                                   kernel="sparse_mla")
    check_operands(q, latent, token_ids, latent_scale)
    v = check_value_width(value_width, q.shape[3])
    latent_scale = check_group_scales(latent_scale, q.shape[3], v, implementation, kernels_read=True)
    if mosaic and not mosaic_takes(q.dtype, latent.dtype):  # float32 or fp8 rows: see the module doc
        implementation, mosaic, blocks = without_mosaic(implementation), False, SparseMlaBlockSizes()
    if implementation == "xla":
        if isinstance(scale, jax.core.Tracer):  # a traced scale: autodiff of the reference
            return sparse_mla_reference(q, latent, token_ids, latent_scale, scale=scale, value_width=v)
        blocks = None  # the reference has no tiling: one custom_vjp whatever was validated
    elif not mosaic:
        blocks = blocks.resolve(q.shape, token_ids.shape[2])
    return _attend(q, latent, token_ids, latent_scale, scale, v, implementation, blocks)


# ------------------------------------------------------------------------------ gradients
# ``sparse_mla`` is a ``jax.custom_vjp`` (``_attend``) under every implementation: the
# forward saves ``q``, ``latent`` (the caller's array), ``token_ids``, ``latent_scale``,
# the output and its log-sum-exp ``lse [B, Q, H]``, nothing ``[Q, W, CR]``; the backward is
# ``attention_backward.sparse_mla_backward`` with the same implementation (``"xla"``: a
# plain-jnp backward that recomputes the gather; the Pallas ones: Triton kernels,
# deterministic). ``token_ids`` is integer (no gradient); ``latent_scale`` gets none either
# (an fp8 cache is a serving format), nor does an fp8 ``latent`` (zeros).


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attend(q, latent, token_ids, latent_scale, scale, value_width, implementation, blocks):
    """``sparse_mla`` after its checks: ``implementation`` resolved, ``blocks`` validated
    (resolved for Triton; None for ``"xla"``)."""
    if implementation == "xla":
        return sparse_mla_reference(q, latent, token_ids, latent_scale, scale=scale,
                                    value_width=value_width)
    if implementation in ("mosaic", "mosaic_interpret"):
        return _sparse_mla_mosaic(q, latent, token_ids, scale=scale, value_width=value_width,
                                  interpret=implementation == "mosaic_interpret", block_sizes=blocks)
    return _sparse_mla_pallas(q, latent, token_ids, latent_scale, scale=scale,
                              value_width=value_width,
                              interpret=implementation == "pallas_interpret", block_sizes=blocks)[0]


def _attend_fwd(q, latent, token_ids, latent_scale, scale, value_width, implementation, blocks):
    if implementation == "xla":
        out, lse = _reference_with_lse(q, latent, token_ids, latent_scale, scale=scale,
                                       value_width=value_width)
    elif implementation in ("mosaic", "mosaic_interpret"):
        out, lse = _sparse_mla_mosaic(q, latent, token_ids, scale=scale, value_width=value_width,
                                      interpret=implementation == "mosaic_interpret",
                                      block_sizes=blocks, return_lse=True)
    else:
        out, lse = _sparse_mla_pallas(q, latent, token_ids, latent_scale, scale=scale,
                                      value_width=value_width,
                                      interpret=implementation == "pallas_interpret",
                                      block_sizes=blocks)
    return out, (q, latent, token_ids, latent_scale, out, lse)


def _attend_bwd(scale, value_width, implementation, blocks, residuals, d_out):
    q, latent, token_ids, latent_scale, out, lse = residuals
    dq, dlatent = sparse_mla_backward(q, latent, token_ids, out, lse, d_out, latent_scale,
                                      scale=scale, value_width=value_width,
                                      implementation=implementation)
    return dq, dlatent, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


# ------------------------------------------------------------- Pallas kernel (Triton backend)
# Grid: (B*Q*head_blocks, num_splits). One program owns one (batch, query) row and a block
# of ``block_h`` heads (head blocks of the same row are adjacent program ids, so they run
# together and share the gathered latent rows through L2), and one of ``num_splits``
# contiguous shares of that row's id blocks (flash-decoding split; a decode step has too
# few rows to fill the GPU otherwise). Per program:
#
# 1. ``n_end`` = 1 + the last slot holding a valid id (0 if none), from loads of the id row
#    in tiles of up to ``_mla.SCAN_BLOCK`` (the wrapper pads the row with -1 to a whole
#    number of tiles and of ``block_w``, so no load of the id row is masked or out of
#    bounds). Valid ids form a prefix of the row, so ``n_end`` is their count; but
#    ``n_end`` is exact for any layout, and every slot below it is still masked on its own.
# 2. The ``ceil(n_end / block_w)`` id blocks are divided evenly among the splits, so a
#    short row (decode at a short context, the first tokens of a prefill) costs little and
#    its work is still spread over every split.
# 3. Per id block: load ``block_w`` ids, gather the ``block_w`` latent rows once (a masked
#    load: an invalid id is never read), ``scores = q @ kv.T * scale`` (f32), online
#    softmax (running max and sum in f32), ``acc += p @ kv``. The row is processed as
#    ``n_c = ceil(CR / block_c)`` static chunks of ``block_c`` columns: the scores sum over
#    every chunk, accumulators exist only for the first ``n_v = ceil(V / block_c)`` chunks
#    (those holding value columns; with RoPE the ``k_rot`` chunks are scored, never
#    accumulated). Columns past CR are masked to 0. A chunk straddling the value boundary
#    (``V`` not a multiple of ``block_c``) is accumulated whole: its columns ``[V, n_v *
#    block_c)`` (``k_rot`` or padding) land in output columns that the wrapper cuts off.
#    fp8 rows: e4m3 chunks converted to q's 16-bit dtype (exact) or f32; the block's row
#    scales (one masked load) multiply the scores before ``scale`` and ``p`` before ``p @ kv``.
# 4. One split: write ``acc / sum`` in q's dtype and the log-sum-exp ``max + log(sum)``
#    in f32 (the backward's residual). Several: write ``acc``, the max and the sum in f32,
#    and a second launch, ``sparse_mla_combine``, merges them and their log-sum-exp (below;
#    ``dense_mla.combine_splits`` is its reference). As XLA ops the merge was three
#    fusions a decode step (the weights' exponential, the sums, the cast to q's dtype).
#
# All-invalid rows and splits: the running max stays -inf, every p is 0 and the sum 0, so
# the output is exactly 0 (the divisions are guarded), never NaN, and the log-sum-exp -inf.

_TARGET_PROGRAMS = 256  # auto num_splits aims at about this many programs (2 per H100/H200 SM)
_MIN_BLOCKS_PER_SPLIT = 4  # ... but never splits a row into shares of fewer id blocks


def _auto_num_splits(rows: int, n_wblocks: int) -> int:
    want = max(1, -(-_TARGET_PROGRAMS // max(rows, 1)))
    return max(1, min(want, n_wblocks // _MIN_BLOCKS_PER_SPLIT))


def _sparse_mla_kernel(
    ids_ref, q_ref, lat_ref, *refs,
    scale, length, width, n_c, n_v, block_h, block_w, block_c, num_splits, latent_c, fp8,
    groups=None, n_groups=1,
):
    # ids_ref [W] int32, q_ref [block_h, n_c*block_c], lat_ref [L, CR] (this row's batch, or
    # the shared pool), with fp8 rows then scale_ref [L] (or, with group scales, [L * G]:
    # ``groups`` is ``_mla.chunk_groups``); outputs n_v*block_c columns wide.
    scale_ref, out_refs = (refs[0], refs[1:]) if fp8 else (None, refs)
    split = pl.program_id(1)
    f32 = jnp.float32

    # 1. n_end: one past the last valid slot of the row. The id row is a ``padded_width``
    # (the wrapper pads it with -1), so every load is in bounds.
    n_end = row_end(ids_ref, width, length)

    # 2. This split's share of the id blocks that hold valid ids.
    n_blocks = (n_end + block_w - 1) // block_w
    lo = split * n_blocks // num_splits
    hi = (split + 1) * n_blocks // num_splits

    qs = [q_ref[:, pl.ds(c * block_c, block_c)] for c in range(n_c)]
    # fp8 rows are converted (exactly) to the query's 16-bit dtype, or float32, for the dots.
    kv_dtype = key_dot_dtype(q_ref.dtype) if fp8 else lat_ref.dtype
    col_ok = [c * block_c + jnp.arange(block_c, dtype=jnp.int32) < latent_c for c in range(n_c)]
    cols = [jnp.minimum(c * block_c + jnp.arange(block_c, dtype=jnp.int32), latent_c - 1)
            for c in range(n_c)]

    # 3. Online softmax over the id blocks.
    def body(j, carry):
        m_prev, l_prev, accs = carry
        ids = ids_ref[pl.ds(j * block_w, block_w)]
        ok = (ids >= 0) & (ids < length)
        rows = jnp.where(ok, ids, 0)  # a safe index even where the load is masked
        kvs = []
        s = jnp.zeros((block_h, block_w), f32)
        if groups is not None:  # each group's scales of the block's rows (0 where masked)
            gs = {g: plgpu.load(scale_ref.at[rows * n_groups + g], mask=ok, other=0.0)
                  for g in sorted({part[0] for chunk in groups for part in chunk})}
        for c in range(n_c):
            kv = plgpu.load(
                lat_ref.at[rows[:, None], cols[c][None, :]],
                mask=ok[:, None] & col_ok[c][None, :], other=0.0 if fp8 else 0,  # Triton: no i32 -> e4m3
            ).astype(kv_dtype)
            kvs.append(kv)
            if groups is None:
                s += dot_nt(qs[c], kv)
                continue
            for g, lo, hi in groups[c]:  # a group's columns: its scale on their score
                part = part_columns(c, block_c, latent_c, lo, hi)
                qg = qs[c] if part is None else jnp.where(part[None, :], qs[c], jnp.zeros((), qs[c].dtype))
                s += dot_nt(qg, kv) * gs[g][None, :]
        if fp8 and groups is None:  # each row's scale on its score (0 where masked: never read)
            row_scale = plgpu.load(scale_ref.at[rows], mask=ok, other=0.0)
            s = s * row_scale[None, :]
        s = jnp.where(ok[None, :], s * scale, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        alpha = jnp.exp(m_prev - m_safe)  # 0 while m_prev is -inf
        p = jnp.exp(s - m_safe[:, None])  # 0 at masked slots
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        if groups is not None:  # per group: p times the group's scale, on the group's columns
            pvs = {g: (p * sc[None, :]).astype(kv_dtype) for g, sc in gs.items()}
            accs = tuple(alpha[:, None] * acc + _group_values(pvs, kvs[c], groups[c], c, block_c, latent_c)
                         for c, acc in enumerate(accs))
            return m_next, l_next, accs
        pv = (p * row_scale[None, :] if fp8 else p).astype(kv_dtype)
        accs = tuple(  # the value chunks only: zip stops at the n_v accumulators
            alpha[:, None] * acc + dot_nn(pv, kv) for acc, kv in zip(accs, kvs)
        )
        return m_next, l_next, accs

    m0 = jnp.full((block_h,), -jnp.inf, f32)
    l0 = jnp.zeros((block_h,), f32)
    acc0 = tuple(jnp.zeros((block_h, block_c), f32) for _ in range(n_v))
    m_i, l_i, accs = lax.fori_loop(lo, hi, body, (m0, l0, acc0))

    # 4. Write.
    if num_splits == 1:
        o_ref, lse_ref = out_refs
        l_safe = jnp.where(l_i > 0, l_i, 1.0)
        inv = 1.0 / l_safe
        for c, acc in enumerate(accs):
            out = (acc * inv[:, None]).astype(o_ref.dtype)
            plgpu.store(o_ref.at[:, pl.ds(c * block_c, block_c)], out)
        plgpu.store(lse_ref.at[:], jnp.where(l_i > 0, m_i + jnp.log(l_safe), -jnp.inf))
    else:
        acc_ref, m_ref, l_ref = out_refs
        for c, acc in enumerate(accs):
            plgpu.store(acc_ref.at[:, pl.ds(c * block_c, block_c)], acc)
        plgpu.store(m_ref.at[:], m_i)
        plgpu.store(l_ref.at[:], l_i)


# The split merge, one program per (row, block of ``block_h`` heads, ``_COMBINE_C`` output
# columns): the splits' common max ``M`` (0 where every split is empty), then per split
# ``w = exp(m - M)`` (0 for an empty split), ``num += w * acc`` and ``den += w * l``; the
# output ``num / den`` in q's dtype (0 where ``den`` is 0) and the log-sum-exp ``M +
# log(den)`` (-inf there). ``dense_mla.combine_splits`` computes the same (its sums over
# the splits in XLA's order).
# The splits are read one at a time (a loop, so any ``num_splits`` works: a Triton block
# shape must be a power of two, a split count need not be).
_COMBINE_C = 128  # output columns a program at most


def _combine_splits_kernel(acc_ref, m_ref, l_ref, o_ref, lse_ref, *, num_splits):
    # acc_ref [S, block_h, tile_c], m_ref / l_ref [S, block_h] (f32); o_ref [block_h,
    # tile_c] (q's dtype), lse_ref [block_h] (f32).
    f32 = jnp.float32
    m_all = lax.fori_loop(1, num_splits, lambda s, m: jnp.maximum(m, m_ref[s, :]), m_ref[0, :])
    m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)

    def body(s, carry):
        num, den = carry
        w = jnp.exp(m_ref[s, :] - m_all)
        return num + w[:, None] * acc_ref[s, :, :], den + w * l_ref[s, :]

    num, den = lax.fori_loop(
        0, num_splits, body,
        (jnp.zeros(o_ref.shape, f32), jnp.zeros(lse_ref.shape, f32)),
    )
    safe = jnp.where(den > 0, den, 1.0)
    plgpu.store(o_ref.at[:, :], (num / safe[:, None]).astype(o_ref.dtype))
    plgpu.store(lse_ref.at[:], jnp.where(den > 0, m_all + jnp.log(safe), -jnp.inf))


def _combine_splits_pallas(acc, m, l, out_dtype, *, block_h, num_warps, interpret):
    """``dense_mla.combine_splits(acc, m, l, return_lse=True)`` (``acc [R, S, Hp, Vp]``,
    ``m, l [R, S, Hp]``, ``Hp`` a multiple of ``block_h``) as one Triton launch, the output
    in ``out_dtype``."""
    rows, num_splits, h_pad, v_pad = acc.shape
    tile_c = min(v_pad & -v_pad, _COMBINE_C)  # a power of two (>= 16: v_pad is whole block_c's)
    n_h, n_t = h_pad // block_h, -(-v_pad // tile_c)
    return pl.pallas_call(
        functools.partial(_combine_splits_kernel, num_splits=num_splits),
        grid=(rows * n_h, n_t),
        in_specs=[
            pl.BlockSpec((None, num_splits, block_h, tile_c), lambda i, t: (i // n_h, 0, i % n_h, t)),
            pl.BlockSpec((None, num_splits, block_h), lambda i, t: (i // n_h, 0, i % n_h)),
            pl.BlockSpec((None, num_splits, block_h), lambda i, t: (i // n_h, 0, i % n_h)),
        ],
        out_specs=(
            pl.BlockSpec((None, block_h, tile_c), lambda i, t: (i // n_h, i % n_h, t)),
            # Every column tile of a head block writes the same log-sum-exp.
            pl.BlockSpec((None, block_h), lambda i, t: (i // n_h, i % n_h)),
        ),
        out_shape=(jax.ShapeDtypeStruct((rows, h_pad, v_pad), out_dtype),
                   jax.ShapeDtypeStruct((rows, h_pad), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="sparse_mla_combine",
    )(acc, m, l)


def _group_values(pvs, kv, parts, c, block_c, width):
    """``sum_g (p * s_g) @ kv`` of chunk ``c`` on each group ``g``'s columns (``parts``: its
    ``_mla.chunk_groups`` entry; ``pvs``: ``p`` times each group's scales, cast for the dot)."""
    out = None
    for g, lo, hi in parts:
        part = part_columns(c, block_c, width, lo, hi)
        d = dot_nn(pvs[g], kv)
        d = d if part is None else jnp.where(part[None, :], d, 0.0)
        out = d if out is None else out + d
    return out


@dataclasses.dataclass(frozen=True)
class SparseMlaBlockSizes:
    """Tiling of the Pallas ``sparse_mla``; a ``None`` field takes its shape-dependent
    default in ``resolve``.

    * ``block_h``: heads per program (power of two >= 16; fewer heads are padded with zero
      queries).
    * ``block_w``: selected ids per loop step (power of two >= 16; default 32, or 16 for
      rows narrower than 17).
    * ``block_c``: row columns per chunk (power of two >= 16; default the whole row width
      ``CR`` up to 512 when it is a power of two, else the chunk wasting the fewest padded
      columns: 64 at ``CR = 576``, so the 512 value columns are 8 whole chunks); the kernel
      scores ``ceil(CR / block_c)`` chunks and accumulates ``ceil(V / block_c)``.
    * ``num_splits``: shares each row's id blocks are split into (int >= 1; default: enough
      for about 256 programs, each share at least 4 id blocks); partial results are merged
      by a second launch, ``sparse_mla_combine``.
    * ``num_warps`` (power of two), ``num_stages`` (int >= 1): Triton's.
    """

    block_h: int = 16
    block_w: int | None = None
    block_c: int | None = None
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def validate(self) -> "SparseMlaBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        name = "SparseMlaBlockSizes."
        check_power_of_two(name + "block_h", self.block_h, minimum=16)
        for field in ("block_w", "block_c"):
            if getattr(self, field) is not None:
                check_power_of_two(name + field, getattr(self, field), minimum=16)
        if self.num_splits is not None:
            check_positive_int(name + "num_splits", self.num_splits)
        check_triton_params("SparseMlaBlockSizes", self.num_warps, self.num_stages)
        return self

    def resolve(self, q_shape, width: int) -> "SparseMlaBlockSizes":
        """Every field set, for ``q`` of shape ``q_shape`` ``[B, Q, H, CR]`` and id rows
        of width ``W = width``: the sizes the kernel launches with."""
        self.validate()
        b, nq, h, c = q_shape
        block_w = self.block_w
        if block_w is None:
            block_w = min(next_power_of_two(width, 16), 32)
        block_c = default_block_c(c) if self.block_c is None else self.block_c
        num_splits = self.num_splits
        if num_splits is None:
            num_splits = _auto_num_splits(
                b * nq * -(-h // self.block_h), -(-max(width, 1) // block_w)
            )
        return dataclasses.replace(
            self, block_w=block_w, block_c=block_c, num_splits=num_splits
        )


_sparse_mla_mosaic = eager_jit("scale", "value_width", "interpret", "block_sizes", "return_lse")(mosaic_sparse_mla)


@eager_jit("scale", "value_width", "interpret", "block_sizes")
def _sparse_mla_pallas(
    q, latent, token_ids, latent_scale, *, scale, value_width, interpret,
    block_sizes: SparseMlaBlockSizes,
):
    """Pallas attention with the resolved ``block_sizes`` (every field set) and ``V =
    value_width`` (checked): ``(out [B, Q, H, V] in q's dtype, lse [B, Q, H] float32)``."""
    block_h, block_w, block_c = block_sizes.block_h, block_sizes.block_w, block_sizes.block_c
    num_splits = block_sizes.num_splits
    b, nq, h, c = q.shape
    v = value_width
    length = latent.shape[1]
    width = token_ids.shape[2]
    if b * nq * h * c == 0 or width == 0 or length == 0:  # nothing to attend to
        return jnp.zeros((b, nq, h, v), q.dtype), jnp.full((b, nq, h), -jnp.inf, jnp.float32)

    n_h = -(-h // block_h)
    n_c = -(-c // block_c)
    n_v = -(-v // block_c)  # chunks holding value columns; the output's width in chunks
    h_pad, c_pad, v_pad = n_h * block_h, n_c * block_c, n_v * block_c
    rows = b * nq
    q_dtype = q.dtype

    q = q.reshape(rows, h, c)
    if (h_pad, c_pad) != (h, c):
        q = jnp.pad(q, ((0, 0), (0, h_pad - h), (0, c_pad - c)))
    ids = pad_ids(token_ids, block_w)
    width = ids.shape[1]

    try:
        scale = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(
            f"scale must be a static Python float for the Pallas kernel, got {scale!r}"
        ) from e
    grouped = latent_scale is not None and latent_scale.ndim == 3  # [B|1, L, G]: group scales
    n_groups = latent_scale.shape[2] if grouped else 1
    kernel = functools.partial(
        _sparse_mla_kernel, scale=scale, length=length, width=width, n_c=n_c, n_v=n_v,
        block_h=block_h, block_w=block_w, block_c=block_c, num_splits=num_splits, latent_c=c,
        fp8=latent_scale is not None, n_groups=n_groups,
        groups=chunk_groups(c, v, n_groups, block_c) if grouped else None,
    )
    shared = latent.shape[0] == 1  # one pool for every batch row: always block 0
    in_specs = [
        pl.BlockSpec((None, width), lambda i, s: (i // n_h, 0)),
        pl.BlockSpec((None, block_h, c_pad), lambda i, s: (i // n_h, i % n_h, 0)),
        pl.BlockSpec(
            (None, length, c),
            (lambda i, s: (0, 0, 0)) if shared else (lambda i, s: (i // n_h // nq, 0, 0)),
        ),
    ]
    operands = [ids, q, latent]
    if latent_scale is not None:  # the rows' scales, blocked as the rows (groups: [L * G])
        in_specs.append(pl.BlockSpec(
            (None, length * n_groups), (lambda i, s: (0, 0)) if shared else (lambda i, s: (i // n_h // nq, 0))))
        operands.append(latent_scale.astype(jnp.float32).reshape(latent_scale.shape[0], length * n_groups))
    if num_splits == 1:
        out_shape = (jax.ShapeDtypeStruct((rows, h_pad, v_pad), q_dtype),
                     jax.ShapeDtypeStruct((rows, h_pad), jnp.float32))
        out_specs = (pl.BlockSpec((None, block_h, v_pad), lambda i, s: (i // n_h, i % n_h, 0)),
                     pl.BlockSpec((None, block_h), lambda i, s: (i // n_h, i % n_h)))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((rows, num_splits, h_pad, v_pad), jnp.float32),
            jax.ShapeDtypeStruct((rows, num_splits, h_pad), jnp.float32),
            jax.ShapeDtypeStruct((rows, num_splits, h_pad), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, None, block_h, v_pad), lambda i, s: (i // n_h, s, i % n_h, 0)),
            pl.BlockSpec((None, None, block_h), lambda i, s: (i // n_h, s, i % n_h)),
            pl.BlockSpec((None, None, block_h), lambda i, s: (i // n_h, s, i % n_h)),
        )
    out = pl.pallas_call(
        kernel,
        grid=(rows * n_h, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="sparse_mla",
    )(*operands)
    if num_splits > 1:
        out, lse = _combine_splits_pallas(
            *out, q_dtype, block_h=block_h, num_warps=block_sizes.num_warps, interpret=interpret
        )
    else:
        out, lse = out
    return out[:, :h, :v].reshape(b, nq, h, v), lse[:, :h].reshape(b, nq, h)
