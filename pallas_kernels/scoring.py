"""``index_scores``: the lightning indexer's score of every (query, pool) pair.

Axis letters as in the package glossary (``pallas_kernels``; ``Hi``: indexer heads).
Invariants:

* ``score[b, t, p] = sum_h w[b, t, h] * relu((q[b, t, h] . pooled[b, p]) * D**-0.5)``
  (``h`` over the ``Hi`` indexer heads), computed in float32 whatever the input dtype.
* Pool ``p`` is a *candidate* for query ``t`` when it is valid and its last token,
  ``first_key + (p + 1)*KP - 1``, is at or before the query's position ``q_pos[b, t]``
  (causal; a padding query has ``q_pos = -1`` and so no candidate). Non-candidates score
  ``-inf``; so does a NaN score, so that a NaN never wins a top-k slot.
* ``-0.0`` is returned as ``+0.0``: ReLU makes exact zeros common, and the top-k tie rule
  must see ``w * 0 < 0`` and ``0`` as the same score.
* Block sizes (``IndexScoresBlockSizes``) change the tiling only; within a pool tile, the
  head sum's order is the kernel's own (see the float tolerance of the tests).
* fp8 keys: with ``pooled_scale [B, P]`` (float32, one per pool) ``pooled`` is
  ``float8_e4m3fn`` and the key of pool ``p`` is ``pooled[b, p] * pooled_scale[b, p]``
  (``glm5_dsa_jax.fp8``). The scale multiplies the head-summed score, after the ReLU:
  ``score = pooled_scale[b, p] * sum_h w * relu((q . k8) * D**-0.5)``, equal to the score
  of the dequantised key because a scale is positive. The e4m3 key is converted to the
  query's dtype (exact for bf16 / f16, whose products stay exact in float32) inside the
  kernel; the reference does the same conversion, the same dot and the same order.
* Work follows the queries' positions: a Pallas program whose pool tile lies wholly past
  what its queries can see (``first_key + (p + 1)*KP - 1 > q_pos`` for every pool and
  query of the tile) loads no key and writes ``-inf``, so a cache sized for a long
  capacity costs what its filled part costs. ``index_scores_paged``
  (``pallas_kernels.paged_scoring``) is this kernel through a block table.

The Mosaic GPU kernel (``implementation="mosaic"`` / ``"mosaic_interpret"``;
``pallas_kernels.mosaic_scoring``, jax >= 0.11, Hopper and newer) keeps this contract for
16-bit ``q`` and ``pooled`` of one dtype, with its own block sizes,
``MosaicIndexScoresBlockSizes`` (``block_sizes`` must then be one, or ``None``); its
summation order is the tensor cores' (see that module's doc on equality). Other dtypes
(float32: wgmma's is TF32) run this module's Triton kernel at its default block sizes, as a
step with no Mosaic kernel does, so a float32 layer asked for ``"mosaic"`` still runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    Implementation, check_positive_int, check_power_of_two, check_rank, check_triton_params,
    eager_jit, kernel_family, next_power_of_two, without_mosaic,
)
from pallas_kernels.mosaic_scoring import (
    MosaicIndexScoresBlockSizes, mosaic_index_scores, mosaic_takes,
)

__all__ = [
    "index_scores", "index_scores_reference", "IndexScoresBlockSizes", "pool_last_token",
    "MosaicIndexScoresBlockSizes", "key_dot_dtype",
]


@dataclasses.dataclass(frozen=True)
class IndexScoresBlockSizes:
    """Tiling of the Pallas ``index_scores``.

    * ``block_q``: queries per program (a power of two), which share one pooled-key tile;
    * ``block_p``: pools per program, the dot's N (a power of two >= 16);
    * ``num_warps`` (a power of two), ``num_stages`` (an int >= 1): Triton's.

    Both tiles are capped at the padded problem size (``resolve``), so a decode step
    (``Q = 1``) runs one query per program.
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

    def resolve(self, n_queries: int, n_pools: int) -> "IndexScoresBlockSizes":
        """The sizes the kernel launches with for ``Q = n_queries``, ``P = n_pools``."""
        self.validate()
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, next_power_of_two(n_queries)),
            block_p=min(self.block_p, next_power_of_two(n_pools, 16)),
        )


def pool_last_token(first_key: jax.Array, n_pools: int, kpool: int) -> jax.Array:
    """``[B] -> [B, P]`` int32: the last token id of every pool."""
    p = jnp.arange(n_pools, dtype=jnp.int32)
    return first_key.astype(jnp.int32)[:, None] + (p[None, :] + 1) * kpool - 1


def finish_scores(score, pool_valid, first_key, q_pos, kpool):
    """Apply the candidate mask and the sign / NaN canonicalisation (shared with kernels)."""
    last = pool_last_token(first_key, score.shape[-1], kpool)
    cand = pool_valid[:, None, :] & (last[:, None, :] <= q_pos[:, :, None])
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
    # Products of 16-bit floats are exact in float32, so a dot in the inputs' dtype with a
    # float32 accumulator is the float32 computation (up to summation order) without
    # converting the whole pooled cache to float32 on every step.
    dt = key_dot_dtype(q.dtype) if pooled_scale is not None else jnp.promote_types(q.dtype, pooled.dtype)
    s = jnp.einsum(
        "bqhd,bpd->bqhp", q.astype(dt), pooled.astype(dt),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    s = jax.nn.relu(s * (d**-0.5))
    score = jnp.einsum(
        "bqh,bqhp->bqp", w.astype(jnp.float32), s, precision=jax.lax.Precision.HIGHEST
    )
    if pooled_scale is not None:  # fp8 keys: the pool's scale, after the head sum
        score = score * pooled_scale.astype(jnp.float32)[:, None, :]
    return finish_scores(score, pool_valid, first_key, q_pos, kpool)


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
    implementation, mosaic, blocks = kernel_family(implementation, block_sizes, IndexScoresBlockSizes, MosaicIndexScoresBlockSizes)
    b, nq, _, d = check_queries(q, w)
    check_rank("pooled", pooled, 3, "[B, P, D]")
    if pooled.shape[0] != b or pooled.shape[2] != d:
        raise ValueError(f"pooled must be [B={b}, P, D={d}], got {tuple(pooled.shape)}")
    if pool_valid.shape != pooled.shape[:2]:
        raise ValueError(f"pool_valid must be [B, P] = {tuple(pooled.shape[:2])}, got {tuple(pool_valid.shape)}")
    if first_key.shape != (b,):
        raise ValueError(f"first_key must be [B] = ({b},), got {tuple(first_key.shape)}")
    if q_pos.shape != (b, nq):
        raise ValueError(f"q_pos must be [B, Q] = {(b, nq)}, got {tuple(q_pos.shape)}")
    check_key_scale("pooled", pooled, "pooled_scale", pooled_scale, "[B, P]")
    return run_scores(
        (q, w, pooled, pool_valid, first_key, q_pos), pooled_scale, kpool=kpool,
        implementation=implementation, mosaic=mosaic, blocks=blocks,
        reference=index_scores_reference, mosaic_kernel=_index_scores_mosaic,
        pallas_kernel=_index_scores_pallas,
    )


def check_queries(q, w) -> tuple[int, int, int, int]:
    """``(B, Q, Hi, D)`` of queries ``q [B, Q, Hi, D]`` with head weights ``w [B, Q, Hi]``,
    or a ``ValueError`` naming the shapes (shared with ``index_scores_paged``)."""
    check_rank("q", q, 4, "[B, Q, Hi, D]")
    b, nq, h, d = q.shape
    if w.shape != (b, nq, h):
        raise ValueError(f"w must be [B, Q, Hi] = {(b, nq, h)}, got {tuple(w.shape)}")
    return b, nq, h, d


def run_scores(args, pooled_scale, *, kpool, implementation, mosaic, blocks, reference,
               mosaic_kernel, pallas_kernel):
    """Score checked inputs ``args = (q, w, keys, ...)`` (``keys`` the pooled keys, whole or
    paged) with the implementation ``kernel_family`` chose: ``reference`` for ``"xla"``;
    ``mosaic_kernel`` when Mosaic was asked for and takes the operands (``mosaic_takes``),
    else ``pallas_kernel``, at ``IndexScoresBlockSizes()`` when it stands in for Mosaic
    (float32 or fp8 keys: see the module doc). Shared by ``index_scores`` and
    ``index_scores_paged``, so both fall back alike."""
    q, keys = args[0], args[2]
    if implementation == "xla":
        return reference(*args, pooled_scale, kpool=kpool)
    if mosaic and not mosaic_takes(q.dtype, keys.dtype):
        implementation, mosaic, blocks = without_mosaic(implementation), False, IndexScoresBlockSizes()
    if mosaic:
        return mosaic_kernel(*args, kpool=kpool, interpret=implementation == "mosaic_interpret",
                             block_sizes=blocks)
    return pallas_kernel(*args, pooled_scale, kpool=kpool,
                         interpret=implementation == "pallas_interpret", block_sizes=blocks)


# --------------------------------------------------------------------------------------
# Pallas kernel (Triton backend)
# --------------------------------------------------------------------------------------
#
# Grid ``(query tiles, B, pool tiles)``: a program loads one ``[block_p, D_pad]`` tile of
# pooled keys once and loops over its ``block_q`` queries; per query one ``dot``
# ``[Hi_pad, D_pad] x [D_pad, block_p]`` gives every head's logits at once (the heads are
# the dot's M axis, so a decode step with one query still fills an MMA tile), then ReLU,
# the head weights and a sum over the head axis give the ``[block_p]`` score row. The
# working set is one pooled tile plus one query's ``[Hi_pad, D_pad]`` whatever the context
# length. The query-tile axis comes first in the grid (the fastest launch axis), so the
# programs that share a pooled tile run together and the tile is read from L2. A tile of
# pools none of its queries can see yet (causally: past the newest query's last complete
# pool) loads nothing and writes ``-inf``: a decode step in a cache sized for a long
# capacity reads only the pools up to its position.
#
# Precision: bf16 / f16 operands of one dtype go to the tensor cores with a float32
# accumulator (their products are exact in f32, as in the reference's f32 einsum); any
# other combination is cast to float32 and multiplied with ``allow_tf32=False`` (IEEE
# f32, not TF32), like the reference's ``Precision.HIGHEST``. fp8 (e4m3) keys are
# converted to the query's 16-bit dtype (exact) or float32 after the load, and the tile's
# pool scales (one load of ``block_p`` floats) multiply the head-summed score row; Triton
# converts e4m3 from compute capability 8.9 (``glm5_dsa_jax.fp8.check_readable``).


def _index_scores_kernel(
    q_ref, w_ref, pooled_ref, pvalid_ref, fk_ref, qpos_ref, *refs,  # inputs [, pscale_ref], output
    kpool: int, n_q: int, n_pools: int, heads: int, dim: int, block_q: int,
    block_p: int, block_h: int, block_d: int, dot_dtype,
):
    *pscale_ref, out_ref = refs
    q_tile, b, p_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pool = p_tile * block_p + jnp.arange(block_p, dtype=jnp.int32)
    pool_in = pool < n_pools
    t0 = q_tile * block_q
    n_rows = jnp.minimum(block_q, n_q - t0)

    # Pools the tile's queries can see: ``first_key + (p + 1)*KP - 1 <= q_pos`` iff ``p <
    # (q_pos - first_key + 1) // KP``. A tile starting at or past that loads no key.
    tq = t0 + jnp.arange(block_q, dtype=jnp.int32)
    qpos = plgpu.load(qpos_ref.at[b, jnp.minimum(tq, n_q - 1)], mask=tq < n_q, other=-1)
    seen = jnp.max(jnp.maximum(qpos - fk_ref[b] + 1, 0)) // kpool

    @pl.when(p_tile * block_p >= seen)
    def _dead_tile():
        write_dead_tile(out_ref, b=b, pool=pool, pool_in=pool_in, t0=t0, n_rows=n_rows)

    @pl.when(p_tile * block_p < seen)
    def _live_tile():
        _score_tile(q_ref, w_ref, pooled_ref, pvalid_ref, fk_ref, qpos_ref, pscale_ref, out_ref, b=b,
                    pool=pool, t0=t0, n_rows=n_rows, kpool=kpool, n_pools=n_pools,
                    heads=heads, dim=dim, block_p=block_p, block_h=block_h, block_d=block_d,
                    dot_dtype=dot_dtype)


def _score_tile(q_ref, w_ref, pooled_ref, pvalid_ref, fk_ref, qpos_ref, pscale_ref, out_ref, *, b, pool,
                t0, n_rows, kpool, n_pools, heads, dim, block_p, block_h, block_d, dot_dtype):
    """One live tile: load its pooled keys once, then score its queries one by one."""
    pool_in = pool < n_pools
    pool_safe = jnp.minimum(pool, n_pools - 1)
    ch = jnp.arange(block_d, dtype=jnp.int32)
    ch_ok = ch < dim
    ch_safe = jnp.minimum(ch, dim - 1)
    kshape = (block_p, block_d)
    keys = plgpu.load(
        pooled_ref.at[
            b,
            jnp.broadcast_to(pool_safe[:, None], kshape),
            jnp.broadcast_to(ch_safe[None, :], kshape),
        ],
        mask=jnp.broadcast_to(ch_ok[None, :], kshape),
        other=0.0,
    ).astype(dot_dtype)
    pool_valid = plgpu.load(pvalid_ref.at[b, pool_safe]) != 0
    last = fk_ref[b] + (pool + 1) * kpool - 1  # last token of every pool
    pscale = plgpu.load(pscale_ref[0].at[b, pool_safe]) if pscale_ref else None

    score_rows(q_ref, w_ref, qpos_ref, out_ref, keys, pool_valid, last, pscale, b=b, pool=pool,
               pool_in=pool_in, t0=t0, n_rows=n_rows, heads=heads, dim=dim, block_h=block_h,
               block_d=block_d, dot_dtype=dot_dtype)


def write_dead_tile(out_ref, *, b, pool, pool_in, t0, n_rows):
    """A tile no query of it can see: ``-inf`` over its ``[n_rows, block_p]`` outputs, no
    load (shared with ``paged_scoring``)."""
    @pl.loop(0, n_rows)
    def _(i):
        plgpu.store(out_ref.at[b, t0 + i, pool], jnp.full(pool.shape, -jnp.inf, jnp.float32),
                    mask=pool_in)


def score_rows(q_ref, w_ref, qpos_ref, out_ref, keys, loaded, last, pscale, *, b, pool, pool_in,
               t0, n_rows, heads, dim, block_h, block_d, dot_dtype):
    """Score a loaded ``[block_p, block_d]`` key tile for queries ``t0 .. t0 + n_rows - 1``
    of row ``b``: per query one ``[Hi, D] x [D, block_p]`` dot, ReLU, the head weights, the
    head sum, times the pools' fp8 scales ``pscale [block_p]`` (None: no scale), then
    ``finish_scores`` in-kernel (``-0.0 -> +0.0``; NaN, a pool not
    ``loaded`` or whose ``last`` token is after the query -> ``-inf``). Shared with
    ``paged_scoring``, so both kernels do the same arithmetic."""
    f32 = jnp.float32
    scale = dim**-0.5
    ch = jnp.arange(block_d, dtype=jnp.int32)
    ch_ok = ch < dim
    ch_safe = jnp.minimum(ch, dim - 1)
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


_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def score_dot_dtype(q_dtype, key_dtype):
    """The dtype the Triton kernels' dot multiplies in: ``key_dot_dtype`` for fp8 keys; the
    operands' own for bf16 / f16 of one dtype (tensor cores, exact products in the float32
    accumulator); else float32 (IEEE, ``allow_tf32=False``). Shared with ``paged_scoring``."""
    if jnp.dtype(key_dtype) == FP8:
        return key_dot_dtype(q_dtype)
    if q_dtype == key_dtype and q_dtype != jnp.float32:
        return q_dtype
    return jnp.float32


def check_triton_dtypes(q, w, keys_name, keys):
    """``ValueError`` unless ``q``, the keys and ``w`` are float32, bfloat16 or float16 (the
    keys may also be e4m3), as the Triton kernels take them (shared with ``paged_scoring``)."""
    for name, x in (("q", q), (keys_name, keys), ("w", w)):
        if x.dtype not in _FLOAT_DTYPES and not (name == keys_name and x.dtype == FP8):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got dtype {x.dtype}")


def launch_scores(kernel, operands, *, name, n_pools, kpool, block_sizes, interpret, **static):
    """The Triton scoring ``kernel``'s ``pallas_call`` on ``operands = (q, w, keys, ...)``:
    grid ``(query tiles, B, pool tiles)`` over ``[B, Q, n_pools]`` float32 scores, tiled by
    ``block_sizes`` resolved to the problem, the dot in ``score_dot_dtype``; ``static``: the
    kernel's other static arguments. Shared with ``paged_scoring``."""
    q, keys = operands[0], operands[2]
    b, n_q, heads, dim = q.shape
    blocks = block_sizes.resolve(n_q, n_pools)
    kernel = functools.partial(
        kernel, kpool=kpool, n_q=n_q, n_pools=n_pools, heads=heads, dim=dim,
        block_q=blocks.block_q, block_p=blocks.block_p, block_h=next_power_of_two(heads, 16),
        block_d=next_power_of_two(dim, 16), dot_dtype=score_dot_dtype(q.dtype, keys.dtype),
        **static,
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


def key_dot_dtype(q_dtype):
    """The dtype fp8 keys are converted to for the dot with queries of ``q_dtype``: a
    16-bit float itself (e4m3 -> bf16 / f16 is exact, and so are their products in
    float32), else float32."""
    return jnp.dtype(q_dtype) if jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


def check_key_scale(name, keys, scale_name, scale, shape_doc):
    """``scale`` (float, ``keys.shape[:2]``) must come with e4m3 ``keys`` and only with
    them; else ``ValueError`` naming both and the sizes (shared with the paged scores and
    ``sparse_mla``)."""
    if (scale is None) != (keys.dtype != FP8):
        raise ValueError(
            f"{scale_name} must be given exactly when {name} is {FP8.name} (fp8); got {name} "
            f"{keys.dtype} and {scale_name} {None if scale is None else tuple(scale.shape)}")
    if scale is not None:
        if tuple(scale.shape) != tuple(keys.shape[:2]):
            raise ValueError(f"{scale_name} must be {shape_doc} = {tuple(keys.shape[:2])}, got "
                             f"{tuple(scale.shape)}")
        if not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(f"{scale_name} must be float, got dtype {scale.dtype}")

_index_scores_mosaic = eager_jit("kpool", "interpret", "block_sizes")(mosaic_index_scores)


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
    return launch_scores(_index_scores_kernel, operands, name="index_scores", n_pools=n_pools,
                         kpool=kpool, block_sizes=block_sizes, interpret=interpret)
