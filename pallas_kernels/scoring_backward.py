"""The backward of ``index_scores``: the gradients of the indexer scores with respect to the
queries, the head weights and the pooled keys.

Axis letters as in the package glossary (``pallas_kernels``; ``Hi``: indexer heads). With
``zeta[t, h, p] = D**-0.5 * q[t, h] . k[p]`` and the forward ``score[t, p] = s_p * sum_h
w[t, h] * relu(zeta[t, h, p])`` (``s_p``: the fp8 key scale, 1 without), given ``g [B, Q,
P]`` (the cotangent of the scores):

* ``gs[t, p] = g[t, p] * s_p`` where ``p`` is a candidate for ``t`` (``_scores.candidates``),
  else ``0``: a ``-inf`` score passes no gradient, whatever ``g`` holds there (NaN too: it
  is selected away with ``where``, never multiplied by a 0/1 mask);
* ``dw[t, h] = sum_p gs[t, p] relu(zeta[t, h, p])``;
* ``dq[t, h] = D**-0.5 w[t, h] sum_p gs[t, p] 1[zeta > 0] k[p]``;
* ``dk[p] = D**-0.5 sum_{t, h} gs[t, p] w[t, h] 1[zeta > 0] q[t, h]``.

``1[zeta > 0]`` is ``jax.nn.relu``'s derivative (0 at 0). The forward's ``-0.0 -> +0.0``
canonicalisation is taken as the identity (it changes no value). Invariants:

* No ``[Q, P, Hi]`` tensor, anywhere: the reference (``index_scores_backward_reference``,
  plain jnp, the ``"xla"`` path) runs a ``lax.scan`` over tiles of ``REFERENCE_BLOCK_Q``
  queries (a ``[B, REFERENCE_BLOCK_Q, Hi, P]`` tile at a time), accumulating ``dk`` in
  float32 tile after tile; the Triton kernels hold ``[block_q * Hi_pad, block_p]`` logits.
* Float32 accumulation everywhere; ``dq`` / ``dw`` / ``dpooled`` are returned in the
  dtypes of ``q`` / ``w`` / ``pooled`` (an e4m3 ``pooled`` gets an e4m3 gradient: a
  cotangent has its primal's dtype). The fp8 scale, ``pool_valid``, ``first_key`` and
  ``q_pos`` get no gradient (``index_scores``' custom_vjp returns none for them).
* Deterministic: two runs give the same bits. Every output element is written by exactly
  one Triton program, which sums its terms in a fixed order (pool blocks in order for
  ``dq`` / ``dw``; query blocks in order for ``dpooled``); no atomics.
* Dots as the forward's (``_scores.score_dot_dtype``): 16-bit operands of one dtype go to
  the tensor cores with a float32 accumulator, the float32 coefficient ``gs * 1[zeta > 0]``
  (times ``w`` for ``dk``) cast to that 16-bit dtype for its dot (as flash attention's
  backward casts ``dS``); other dtypes multiply in IEEE float32. Every dot dimension is at
  least 16 (``Hi``, ``D`` padded to powers of two >= 16, ``block_p`` >= 16).

Two Triton kernels, so that no output needs a cross-program sum:

* query-major (``_dq_dw_kernel``), grid ``(query tiles, B)``: a program holds ``dq_block_q``
  queries' ``[dq_block_q * Hi_pad, D_pad]`` queries and ``dq`` accumulator and loops over
  pool blocks of ``dq_block_p`` up to the last pool its queries can see (``visible_pools``):
  per block one dot for ``zeta`` and one for ``dq``; ``dw`` is a row sum.
* pool-major (``_dk_kernel``), grid ``(pool tiles, B)``: a program holds a ``[dk_block_p,
  D_pad]`` key tile and its ``dk`` accumulator and loops over query blocks of
  ``dk_block_q`` (the query x head rows as the dots' second axis): ``zeta`` as ``keys x
  q^T`` then ``dk += coef x q``. A tile no query can see (past ``visible_pools`` of every
  query) writes zeros and loads nothing.

The Mosaic implementations run the Mosaic GPU kernels of ``mosaic_scoring_backward`` (the same
two passes) on 16-bit operands without an fp8 scale, these Triton kernels on any other, as the
forward does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    Implementation, check_block_sizes, check_positive_int, check_power_of_two, check_rank,
    check_triton_params, eager_jit, next_power_of_two, resolve_implementation,
)
from pallas_kernels._mosaic import mosaic_takes
from pallas_kernels.mosaic_scoring_backward import (
    MosaicIndexScoresBackwardBlockSizes, mosaic_index_scores_backward,
)
from pallas_kernels._scores import (
    candidates, channels, check_triton_dtypes, reference_dot_dtype, score_dot_dtype,
    visible_pools,
)

__all__ = [
    "index_scores_backward", "index_scores_backward_reference", "IndexScoresBackwardBlockSizes",
    "REFERENCE_BLOCK_Q",
]

#: Queries per tile of the reference backward's scan: its working set is a ``[B, 16, Hi, P]``
#: float32 tile, never ``[B, Q, Hi, P]``.
REFERENCE_BLOCK_Q = 16


@dataclasses.dataclass(frozen=True)
class IndexScoresBackwardBlockSizes:
    """Tiling of the Triton ``index_scores`` backward (two kernels, see the module doc).

    * ``dq_block_q``: queries per program of the query-major kernel (``dq``, ``dw``), a power
      of two; its dots' M is ``dq_block_q * Hi_pad``.
    * ``dq_block_p``: pools per loop step there, a power of two >= 16.
    * ``dk_block_p``: pools per program of the pool-major kernel (``dpooled``), a power of
      two >= 16.
    * ``dk_block_q``: queries per loop step there, a power of two.
    * ``num_warps`` (a power of two), ``num_stages`` (an int >= 1): Triton's, both kernels.

    The pool blocks are capped at the padded pool count and the query blocks at the padded
    query count (``resolve``).
    """

    dq_block_q: int = 1
    dq_block_p: int = 64
    dk_block_p: int = 64
    dk_block_q: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def validate(self) -> "IndexScoresBackwardBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        owner = "IndexScoresBackwardBlockSizes"
        check_power_of_two(f"{owner}.dq_block_q", self.dq_block_q)
        check_power_of_two(f"{owner}.dq_block_p", self.dq_block_p, minimum=16)
        check_power_of_two(f"{owner}.dk_block_p", self.dk_block_p, minimum=16)
        check_power_of_two(f"{owner}.dk_block_q", self.dk_block_q)
        check_triton_params(owner, self.num_warps, self.num_stages)
        return self

    def resolve(self, n_queries: int, n_pools: int) -> "IndexScoresBackwardBlockSizes":
        """The sizes the kernels launch with for ``Q = n_queries``, ``P = n_pools``."""
        self.validate()
        q_cap, p_cap = next_power_of_two(n_queries), next_power_of_two(n_pools, 16)
        return dataclasses.replace(
            self, dq_block_q=min(self.dq_block_q, q_cap), dq_block_p=min(self.dq_block_p, p_cap),
            dk_block_p=min(self.dk_block_p, p_cap), dk_block_q=min(self.dk_block_q, q_cap),
        )


def index_scores_backward_reference(
    q: jax.Array,
    w: jax.Array,
    pooled: jax.Array,
    pool_valid: jax.Array,
    first_key: jax.Array,
    q_pos: jax.Array,
    d_scores: jax.Array,
    pooled_scale: jax.Array | None = None,
    *,
    kpool: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-jnp backward of ``index_scores_reference`` (the math of the module doc), in
    tiles of ``REFERENCE_BLOCK_Q`` queries.

    Args: as ``index_scores_reference``, plus ``d_scores [B, Q, P]`` float, the cotangent of
    the scores (ignored where the pool is not a candidate).

    Returns:
      ``(dq [B, Q, Hi, D] in q.dtype, dw [B, Q, Hi] in w.dtype, dpooled [B, P, D] in
      pooled.dtype)``.
    """
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    b, n_q, heads, dim = q.shape
    n_pools = pooled.shape[1]
    scale = dim**-0.5
    g = jnp.where(candidates(pool_valid, first_key, q_pos, kpool), d_scores.astype(f32), 0.0)
    if pooled_scale is not None:  # fp8 keys: the score is scaled after the head sum
        g = g * pooled_scale.astype(f32)[:, None, :]
    dt = reference_dot_dtype(q.dtype, pooled.dtype)
    keys, keys32 = pooled.astype(dt), pooled.astype(f32)
    tile = min(REFERENCE_BLOCK_Q, max(n_q, 1))
    n_tiles = -(-n_q // tile)
    pad = n_tiles * tile - n_q

    def tiles(x):  # [B, Q, ...] -> [n_tiles, B, tile, ...]; padded queries have g = 0
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((b, n_tiles, tile) + x.shape[2:]), 1, 0)

    def step(dk, xs):
        qt, wt, gt = xs
        z = jnp.einsum("bthd,bpd->bthp", qt.astype(dt), keys, precision=hi,
                       preferred_element_type=f32) * scale
        dwt = jnp.einsum("btp,bthp->bth", gt, jax.nn.relu(z), precision=hi)
        coef = jnp.where(z > 0.0, gt[:, :, None, :] * wt.astype(f32)[..., None], 0.0) * scale
        dqt = jnp.einsum("bthp,bpd->bthd", coef, keys32, precision=hi)
        dk = dk + jnp.einsum("bthp,bthd->bpd", coef, qt.astype(f32), precision=hi)
        return dk, (dqt, dwt)

    dk, (dq, dw) = jax.lax.scan(step, jnp.zeros((b, n_pools, dim), f32),
                                (tiles(q), tiles(w), tiles(g)))
    untile = lambda x: jnp.moveaxis(x, 0, 1).reshape((b, n_tiles * tile) + x.shape[3:])[:, :n_q]
    return (untile(dq).astype(q.dtype), untile(dw).astype(w.dtype),
            dk.astype(pooled.dtype))


def index_scores_backward(
    q: jax.Array,
    w: jax.Array,
    pooled: jax.Array,
    pool_valid: jax.Array,
    first_key: jax.Array,
    q_pos: jax.Array,
    d_scores: jax.Array,
    pooled_scale: jax.Array | None = None,
    *,
    kpool: int,
    implementation: Implementation = "xla",
    block_sizes: IndexScoresBackwardBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dw, dpooled)`` of ``index_scores`` (contiguous keys) given the scores'
    cotangent ``d_scores [B, Q, P]``; see the module doc. Shapes as
    ``index_scores_backward_reference``; ``block_sizes`` (validated under every
    implementation) tiles the Triton kernels. ``"xla"``: the reference; the Pallas
    implementations: the Triton kernels; the Mosaic ones: the Mosaic kernels on 16-bit
    operands, else the Triton ones (interpret mode for the ``*_interpret`` forms). The paged scores' backward (``index_scores_paged``) gathers each sequence's
    pools, calls this, and puts the gradient back into the pages."""
    implementation = resolve_implementation(implementation, "index_scores")
    blocks = check_block_sizes(block_sizes, IndexScoresBackwardBlockSizes)
    check_rank("q", q, 4, "[B, Q, Hi, D]")
    b, n_q, heads, dim = q.shape
    check_rank("pooled", pooled, 3, "[B, P, D]")
    expect = {"w": (w, (b, n_q, heads)), "pooled": (pooled, (b, pooled.shape[1], dim)),
              "pool_valid": (pool_valid, pooled.shape[:2]), "first_key": (first_key, (b,)),
              "q_pos": (q_pos, (b, n_q)), "d_scores": (d_scores, (b, n_q, pooled.shape[1]))}
    for name, (x, shape) in expect.items():
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must be {tuple(shape)}, got {tuple(x.shape)}")
    check_positive_int("kpool", kpool)
    if implementation == "xla":
        return index_scores_backward_reference(
            q, w, pooled, pool_valid, first_key, q_pos, d_scores, pooled_scale, kpool=kpool)
    if implementation.startswith("mosaic") and pooled_scale is None and mosaic_takes(q.dtype, pooled.dtype):
        return _index_scores_backward_mosaic(
            q, w, pooled, pool_valid, first_key, q_pos, d_scores, kpool=kpool,
            interpret=implementation == "mosaic_interpret",
            block_sizes=MosaicIndexScoresBackwardBlockSizes())
    interpret = implementation in ("pallas_interpret", "mosaic_interpret")
    return _index_scores_backward_pallas(
        q, w, pooled, pool_valid, first_key, q_pos, d_scores, pooled_scale, kpool=kpool,
        interpret=interpret, block_sizes=blocks)


_index_scores_backward_mosaic = eager_jit("kpool", "interpret", "block_sizes")(
    mosaic_index_scores_backward)


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------
#
# Rows of a query block: row ``r`` of a block of ``block_q`` queries is query ``t0 + r //
# Hi_pad``, head ``r % Hi_pad`` (``_query_rows``), so the heads of several queries stack
# into one dot operand. Loads use in-bounds (clamped) indices with masks; stores use the
# unclamped ones under their mask, so that no masked lane aliases a live one (interpret
# mode writes the old value back at a masked lane's address: see ``pooling``).


def _query_rows(t0, block_q, block_h, n_q, heads):
    """Per row of a ``[block_q * block_h]`` query block: query, head, whether both are real,
    whether the query is, and clamped query / head indices."""
    r = jnp.arange(block_q * block_h, dtype=jnp.int32)
    t, h = t0 + r // block_h, r % block_h
    t_ok = t < n_q
    return t, h, t_ok & (h < heads), t_ok, jnp.minimum(t, n_q - 1), jnp.minimum(h, heads - 1)


def _load_query_block(q_ref, w_ref, qpos_ref, *, b, t0, block_q, block_h, n_q, heads, dim,
                      block_d, dot_dtype):
    """A query block's rows: queries ``[M, D_pad]`` (``dot_dtype``), head weights ``[M]`` and
    positions ``[M]`` (0 / -1 on padding rows, which are no candidate), with the row
    indices of ``_query_rows``."""
    t, h, row_ok, t_ok, t_safe, h_safe = _query_rows(t0, block_q, block_h, n_q, heads)
    ch_ok, ch_safe = channels(dim, block_d)
    shape = (t.shape[0], block_d)
    bc = lambda x: jnp.broadcast_to(x, shape)
    qb = plgpu.load(q_ref.at[b, bc(t_safe[:, None]), bc(h_safe[:, None]), bc(ch_safe[None, :])],
                    mask=bc(row_ok[:, None] & ch_ok[None, :]), other=0.0).astype(dot_dtype)
    wb = plgpu.load(w_ref.at[b, t_safe, h_safe], mask=row_ok, other=0.0).astype(jnp.float32)
    qpos = plgpu.load(qpos_ref.at[b, t_safe], mask=row_ok, other=-1)
    return qb, wb, qpos, (t, h, row_ok, t_safe)


def _load_pool_block(pooled_ref, valid_ref, fk_ref, pscale_ref, *, b, pool, load_ok, n_pools,
                     dim, block_d, kpool, dot_dtype):
    """A pool block's keys ``[bp, D_pad]`` (``dot_dtype``; zero where not ``load_ok``, not
    read), whether each pool is loaded and valid, its last token and its fp8 scale (None
    without)."""
    pool_safe = jnp.minimum(pool, n_pools - 1)
    ch_ok, ch_safe = channels(dim, block_d)
    shape = (pool.shape[0], block_d)
    keys = plgpu.load(
        pooled_ref.at[b, jnp.broadcast_to(pool_safe[:, None], shape),
                      jnp.broadcast_to(ch_safe[None, :], shape)],
        mask=jnp.broadcast_to(load_ok[:, None] & ch_ok[None, :], shape), other=0.0,
    ).astype(dot_dtype)
    valid = load_ok & (plgpu.load(valid_ref.at[b, pool_safe], mask=load_ok, other=0) != 0)
    last = fk_ref[b] + (pool + 1) * kpool - 1
    pscale = None
    if pscale_ref:
        pscale = plgpu.load(pscale_ref[0].at[b, pool_safe], mask=load_ok, other=0.0)
    return keys, valid, last, pscale


def _pool_gradient(g_ref, *, b, t_safe, row_ok, qpos, pool_safe, valid, last, pscale,
                   pools_axis):
    """``gs``: the scores' cotangent at (row's query, pool), times the pool's fp8 scale, ``0``
    where the pool is no candidate for the row's query (selected with ``where``). Shaped
    ``[M, bp]`` (``pools_axis=1``) or ``[bp, M]`` (``pools_axis=0``)."""
    if pools_axis == 1:
        rows, cols = t_safe[:, None], pool_safe[None, :]
        cand = row_ok[:, None] & valid[None, :] & (last[None, :] <= qpos[:, None])
    else:
        rows, cols = t_safe[None, :], pool_safe[:, None]
        cand = row_ok[None, :] & valid[:, None] & (last[:, None] <= qpos[None, :])
    shape = cand.shape
    g = plgpu.load(g_ref.at[b, jnp.broadcast_to(rows, shape), jnp.broadcast_to(cols, shape)],
                   mask=cand, other=0.0)
    g = jnp.where(cand, g.astype(jnp.float32), 0.0)
    if pscale is not None:
        g = g * (pscale[None, :] if pools_axis == 1 else pscale[:, None])
    return g


def _dq_dw_kernel(q_ref, w_ref, pooled_ref, valid_ref, fk_ref, qpos_ref, g_ref, *refs,
                  kpool, n_q, n_pools, heads, dim, block_q, block_p, block_h, block_d,
                  dot_dtype):
    """One (query tile, row) program: ``dq`` and ``dw`` of ``block_q`` queries."""
    *pscale_ref, dq_ref, dw_ref = refs
    f32, scale = jnp.float32, dim**-0.5
    q_tile, b = pl.program_id(0), pl.program_id(1)
    qb, wb, qpos, (t, h, row_ok, t_safe) = _load_query_block(
        q_ref, w_ref, qpos_ref, b=b, t0=q_tile * block_q, block_q=block_q, block_h=block_h,
        n_q=n_q, heads=heads, dim=dim, block_d=block_d, dot_dtype=dot_dtype)
    live = jnp.minimum(jnp.max(visible_pools(qpos, fk_ref[b], kpool)), n_pools)
    m = block_q * block_h

    def body(j, carry):
        dq, dw = carry
        pool = j * block_p + jnp.arange(block_p, dtype=jnp.int32)
        keys, valid, last, pscale = _load_pool_block(
            pooled_ref, valid_ref, fk_ref, pscale_ref, b=b, pool=pool, load_ok=pool < live,
            n_pools=n_pools, dim=dim, block_d=block_d, kpool=kpool, dot_dtype=dot_dtype)
        gs = _pool_gradient(g_ref, b=b, t_safe=t_safe, row_ok=row_ok, qpos=qpos,
                            pool_safe=jnp.minimum(pool, n_pools - 1), valid=valid, last=last,
                            pscale=pscale, pools_axis=1)  # [M, bp]
        z = plgpu.dot(qb, keys, trans_b=True, allow_tf32=False) * scale  # [M, bp]
        pos = z > 0.0
        dw = dw + jnp.sum(jnp.where(pos, z * gs, 0.0), axis=1)
        coef = jnp.where(pos, gs, 0.0).astype(dot_dtype)
        dq = dq + plgpu.dot(coef, keys, allow_tf32=False)  # [M, D_pad]
        return dq, dw

    dq, dw = jax.lax.fori_loop(
        0, pl.cdiv(live, block_p), body,
        (jnp.zeros((m, block_d), f32), jnp.zeros((m,), f32)))
    dq = dq * (wb * scale)[:, None]
    ch = jnp.arange(block_d, dtype=jnp.int32)
    shape = (m, block_d)
    bc = lambda x: jnp.broadcast_to(x, shape)
    plgpu.store(dq_ref.at[b, bc(t[:, None]), bc(h[:, None]), bc(ch[None, :])],
                dq.astype(dq_ref.dtype), mask=bc(row_ok[:, None] & (ch < dim)[None, :]))
    plgpu.store(dw_ref.at[b, t, h], dw, mask=row_ok)


def _dk_kernel(q_ref, w_ref, pooled_ref, valid_ref, fk_ref, qpos_ref, g_ref, live_ref, *refs,
               kpool, n_q, n_pools, heads, dim, block_q, block_p, block_h, block_d, dot_dtype):
    """One (pool tile, row) program: ``dpooled`` of ``block_p`` pools, summed over the row's
    query blocks in order. ``live_ref [B]``: the pools any query of the row can see."""
    *pscale_ref, dk_ref = refs
    f32, scale = jnp.float32, dim**-0.5
    p_tile, b = pl.program_id(0), pl.program_id(1)
    p0 = p_tile * block_p
    pool = p0 + jnp.arange(block_p, dtype=jnp.int32)
    ch = jnp.arange(block_d, dtype=jnp.int32)
    shape = (block_p, block_d)
    bc = lambda x: jnp.broadcast_to(x, shape)
    out = dk_ref.at[b, bc(pool[:, None]), bc(ch[None, :])]
    out_mask = bc((pool < n_pools)[:, None] & (ch < dim)[None, :])
    live = live_ref[b]

    @pl.when(p0 >= live)
    def _dead_tile():  # no query of the row sees a pool of the tile
        plgpu.store(out, jnp.zeros(shape, dk_ref.dtype), mask=out_mask)

    @pl.when(p0 < live)
    def _live_tile():
        keys, valid, last, pscale = _load_pool_block(
            pooled_ref, valid_ref, fk_ref, pscale_ref, b=b, pool=pool, load_ok=pool < live,
            n_pools=n_pools, dim=dim, block_d=block_d, kpool=kpool, dot_dtype=dot_dtype)

        def body(j, dk):
            qb, wb, qpos, (_, _, row_ok, t_safe) = _load_query_block(
                q_ref, w_ref, qpos_ref, b=b, t0=j * block_q, block_q=block_q, block_h=block_h,
                n_q=n_q, heads=heads, dim=dim, block_d=block_d, dot_dtype=dot_dtype)
            gs = _pool_gradient(g_ref, b=b, t_safe=t_safe, row_ok=row_ok, qpos=qpos,
                                pool_safe=jnp.minimum(pool, n_pools - 1), valid=valid,
                                last=last, pscale=pscale, pools_axis=0)  # [bp, M]
            z = plgpu.dot(keys, qb, trans_b=True, allow_tf32=False)  # [bp, M]
            coef = jnp.where(z > 0.0, gs * wb[None, :], 0.0).astype(dot_dtype)
            return dk + plgpu.dot(coef, qb, allow_tf32=False)  # [bp, D_pad]

        dk = jax.lax.fori_loop(0, pl.cdiv(n_q, block_q), body, jnp.zeros(shape, f32))
        plgpu.store(out, (dk * scale).astype(dk_ref.dtype), mask=out_mask)


@eager_jit("kpool", "interpret", "block_sizes")
def _index_scores_backward_pallas(q, w, pooled, pool_valid, first_key, q_pos, d_scores,
                                  pooled_scale, *, kpool, interpret,
                                  block_sizes: IndexScoresBackwardBlockSizes):
    """The two Triton kernels on checked operands; see the module doc."""
    b, n_q, heads, dim = q.shape
    n_pools = pooled.shape[1]
    if heads < 1 or dim < 1:
        raise ValueError(f"the Pallas index_scores backward needs Hi, D >= 1, got Hi={heads}, "
                         f"D={dim}")
    check_triton_dtypes(q, w, "pooled", pooled)
    if pool_valid.dtype != jnp.bool_:
        raise ValueError(f"pool_valid must be bool, got dtype {pool_valid.dtype}")
    for name, x in (("first_key", first_key), ("q_pos", q_pos)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    if b == 0 or n_q == 0 or n_pools == 0:  # no score: no gradient
        return jnp.zeros_like(q), jnp.zeros_like(w), jnp.zeros_like(pooled)
    blocks = block_sizes.resolve(n_q, n_pools)
    first_key, q_pos = first_key.astype(jnp.int32), q_pos.astype(jnp.int32)
    operands = (q, w.astype(jnp.float32), pooled, pool_valid.astype(jnp.int8), first_key,
                q_pos, d_scores.astype(jnp.float32))
    scales = () if pooled_scale is None else (pooled_scale.astype(jnp.float32),)
    statics = dict(kpool=kpool, n_q=n_q, n_pools=n_pools, heads=heads, dim=dim,
                   block_h=next_power_of_two(heads, 16), block_d=next_power_of_two(dim, 16),
                   dot_dtype=score_dot_dtype(q.dtype, pooled.dtype))
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    dq, dw = pl.pallas_call(
        functools.partial(_dq_dw_kernel, block_q=blocks.dq_block_q, block_p=blocks.dq_block_p,
                          **statics),
        grid=(pl.cdiv(n_q, blocks.dq_block_q), b),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(w.shape, jnp.float32)),
        compiler_params=params, interpret=interpret, name="index_scores_backward_dq",
    )(*operands, *scales)
    # The pools any query of a row sees: the pool-major kernel's live bound per row.
    live = jnp.minimum(jnp.max(visible_pools(q_pos, first_key[:, None], kpool), axis=1), n_pools)
    # e4m3 keys: dpooled leaves the kernel in float32 (Ampere's Triton has no e4m3 store).
    dk_dtype = jnp.float32 if pooled_scale is not None else pooled.dtype
    dk = pl.pallas_call(
        functools.partial(_dk_kernel, block_q=blocks.dk_block_q, block_p=blocks.dk_block_p,
                          **statics),
        grid=(pl.cdiv(n_pools, blocks.dk_block_p), b),
        out_shape=jax.ShapeDtypeStruct(pooled.shape, dk_dtype),
        compiler_params=params, interpret=interpret, name="index_scores_backward_dk",
    )(*operands, live, *scales)
    return dq, dw.astype(w.dtype), dk.astype(pooled.dtype)
