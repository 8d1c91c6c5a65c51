"""Gradients of the indexer's kernels (issue 24): ``index_scores`` / ``index_scores_paged``
(``jax.custom_vjp``, ``pallas_kernels.scoring_backward``), ``kpool_compress`` (the
reference's XLA vjp), and the integer steps (``topk_pools``, ``streaming_topk``,
``expand_selection``) under ``jax.grad``.

* ``"xla"``: against ``jax.vjp`` of the plain reference (float32 reordering) and against
  float64 central finite differences of the reference (``jax.enable_x64``).
* ``"pallas_interpret"`` (the Triton kernels, interpreted) against ``"xla"`` at float32
  rounding, at block sizes that make every loop run more than once.
* Paged gradients equal the contiguous ones on the same pools held in shuffled pages.
* A ``-inf`` (not candidate) score passes no gradient, whatever its cotangent holds.
* Two runs give the same bits; nothing ``[Q, P, Hi]`` is saved or built by the ``"xla"``
  backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from glm5_dsa_jax.tools import float32_rule
from helpers import F32_REORDER, F32_VS_F64
from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version
from pallas_kernels.scoring_backward import REFERENCE_BLOCK_Q

KP = 2
# Block sizes that make both Triton kernels loop: 2 queries per program / step, 16-pool
# blocks over 40 pools.
SMALL = pk.IndexScoresBackwardBlockSizes(dq_block_q=2, dq_block_p=16, dk_block_p=16, dk_block_q=2)


def problem(b=2, n_q=5, heads=3, dim=20, n_pools=40, seed=0, dtype=jnp.float32):
    """Random scoring operands: some pools invalid, one padding query, a non-zero
    ``first_key``, queries seeing different prefixes; and a cotangent ``g`` that is NaN
    wherever the score is not a candidate (it must be ignored there)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, n_q, heads, dim)).astype(dtype)
    w = jax.random.normal(ks[1], (b, n_q, heads))
    pooled = jax.random.normal(ks[2], (b, n_pools, dim)).astype(dtype)
    pool_valid = jax.random.bernoulli(ks[3], 0.85, (b, n_pools))
    first_key = jnp.arange(b, dtype=jnp.int32)
    last = first_key[-1] + n_pools * KP
    q_pos = jnp.linspace(3, last + 4, b * n_q).astype(jnp.int32).reshape(b, n_q)
    q_pos = q_pos.at[0, 1].set(-1)  # a padding query
    operands = (q, w, pooled, pool_valid, first_key, q_pos)
    cand = np.isfinite(np.asarray(pk.index_scores_reference(*operands, kpool=KP)))
    g = jnp.where(cand, jax.random.normal(ks[4], (b, n_q, n_pools)), jnp.nan)
    return operands, g, cand


@functools.partial(jax.jit, static_argnames="implementation")
def grads(operands, g, implementation):
    """``(dq, dw, dpooled)`` of ``index_scores`` by ``jax.vjp`` (one compiled program: op by
    op, the reference's many small ops would each compile)."""
    q, w, pooled, *rest = operands
    f = lambda q, w, pooled: pk.index_scores(  # noqa: E731
        q, w, pooled, *rest, kpool=KP, implementation=implementation)
    return jax.vjp(f, q, w, pooled)[1](g)


def vjp_of(f, primals, cotangent):
    """``jax.vjp(f, *primals)`` pulled back along ``cotangent``, as one jitted program."""
    return jax.jit(lambda p, c: jax.vjp(f, *p)[1](c))(tuple(primals), cotangent)


def assert_close(got, want, tol=F32_REORDER):
    """Float32 reordering: within ``tol`` relative to the gradient's scale."""
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


def test_xla_equals_vjp_of_reference():
    operands, g, cand = problem()
    q, w, pooled, *rest = operands
    ref = lambda q, w, pooled: pk.index_scores_reference(q, w, pooled, *rest, kpool=KP)  # noqa: E731
    want = vjp_of(ref, (q, w, pooled), jnp.where(cand, g, 0.0))
    got = grads(operands, g, "xla")
    assert_close(got, want)
    assert all(a.dtype == b.dtype for a, b in zip(got, (q, w, pooled)))
    # The contract's wrapper is the same function.
    direct = jax.jit(functools.partial(pk.index_scores_backward, kpool=KP))(*operands, g)
    for a, b in zip(direct, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def scores_f64(q, w, pooled, pool_valid, first_key, q_pos):
    """The scores in float64 numpy (0 where not a candidate): the finite differences' oracle."""
    z = np.einsum("bqhd,bpd->bqhp", q, pooled) * q.shape[-1] ** -0.5
    s = np.einsum("bqh,bqhp->bqp", w, np.maximum(z, 0.0))
    last = first_key[:, None] + (np.arange(pooled.shape[1])[None, :] + 1) * KP - 1
    cand = pool_valid[:, None, :] & (last[:, None, :] <= q_pos[:, :, None])
    return np.where(cand, s, 0.0)


def test_xla_equals_float64_finite_differences():
    operands, g, cand = problem(dim=8, n_pools=12, seed=1)
    g = np.where(cand, np.asarray(g, np.float64), 0.0)
    q, w, pooled, *rest = (np.asarray(x, np.float64) if x.dtype == jnp.float32 else np.asarray(x)
                           for x in operands)
    loss = lambda q, w, pooled: float(np.sum(scores_f64(q, w, pooled, *rest) * g))  # noqa: E731
    got = [np.asarray(x, np.float64) for x in grads(operands, jnp.asarray(g, jnp.float32), "xla")]
    eps = 1e-6
    rng = np.random.default_rng(2)
    for _ in range(4):  # random directions through all three operands
        v = [rng.normal(size=x.shape) for x in (q, w, pooled)]
        plus = loss(*(x + eps * d for x, d in zip((q, w, pooled), v)))
        minus = loss(*(x - eps * d for x, d in zip((q, w, pooled), v)))
        fd = (plus - minus) / (2 * eps)
        analytic = sum(float(np.vdot(a, d)) for a, d in zip(got, v))
        # float32 gradients against float64 differences (whose own error is ~1e-9)
        assert abs(fd - analytic) <= F32_VS_F64 * max(1.0, abs(fd)), (fd, analytic)


@pytest.mark.parametrize("shape, block_sizes", [
    (dict(), SMALL),  # every loop runs more than once
    (dict(b=1, n_q=1, heads=2, dim=16, n_pools=9), None),  # a decode step, default blocks
])
def test_pallas_interpret_equals_xla(shape, block_sizes):
    operands, g, _ = problem(**shape)
    want = grads(operands, g, "xla")
    got = pk.index_scores_backward(*operands, g, kpool=KP, implementation="pallas_interpret",
                                   block_sizes=block_sizes)
    assert_close(got, want)
    if block_sizes is None:  # the custom_vjp path is the same kernels
        assert_close(grads(operands, g, "pallas_interpret"), want)


def bf16_grads(operands, g, implementation):
    """What the float32 rule (``glm5_dsa_jax.tools.float32_rule``) judges, for 16-bit
    ``operands``: ``implementation``'s gradients, bf16 ``"xla"``'s, and float32 ``"xla"``'s
    on the same (cast) operands, each ``{"dq", "dw", "dpooled"}``."""
    f32 = tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in operands)
    return tuple(dict(zip(("dq", "dw", "dpooled"), grads(ops, g, impl))) for ops, impl in
                 ((operands, implementation), (operands, "xla"), (f32, "xla")))


def test_pallas_interpret_bf16_and_fp8_keys():
    """bf16 operands (the dots' 16-bit coefficient rounds to bf16: ~2**-8 relative), judged
    by the float32 rule at ``KERNEL_FLOOR``, which fails the same gradients with one of them
    3 % off; and e4m3 keys with a per-pool scale: the scale multiplies the cotangent; the
    scale itself gets no gradient."""
    operands, g, _ = problem(dtype=jnp.bfloat16, seed=3)
    got, xla, ref32 = bf16_grads(operands, g, "pallas_interpret")
    ok, check, d = float32_rule.against_float32(got, xla, ref32, float32_rule.KERNEL_FLOOR)
    assert ok, check
    assert d["errs_xla"]["dq"] > 0 and d["errs_xla"]["dpooled"] > 0, d  # bf16 rounding was measured
    off = dict(got, dpooled=got["dpooled"] * 1.03)
    ok, check, _ = float32_rule.against_float32(off, xla, ref32, float32_rule.KERNEL_FLOOR)
    assert not ok and check.startswith("MISMATCH 1 of 3 tensors: dpooled"), check

    (q, w, pooled, *rest), g, cand = problem(seed=4)
    keys8 = pooled.astype(jnp.float8_e4m3fn)
    scale = jnp.linspace(0.5, 2.0, pooled.shape[0] * pooled.shape[1]).reshape(pooled.shape[:2])
    ops8 = (q.astype(jnp.bfloat16), w, keys8, *rest)
    ref = lambda q, w, k, s: pk.index_scores_reference(q, w, k, *rest, s, kpool=KP)  # noqa: E731
    want = vjp_of(ref, (ops8[0], w, keys8, scale), jnp.where(cand, g, 0.0))
    for impl in ("xla", "pallas_interpret"):
        f = lambda q, w, k, s: pk.index_scores(  # noqa: E731
            q, w, k, *rest, s, kpool=KP, implementation=impl)
        got = vjp_of(f, (ops8[0], w, keys8, scale), g)
        assert np.all(np.asarray(got[3]) == 0.0)  # no gradient for the scale
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2**-6,
                                   atol=2**-6 * np.abs(np.asarray(want[1])).max())
        for a, b in ((got[0], want[0]), (got[2], want[2])):  # bf16 / e4m3 rounding
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, rtol=2**-3, atol=2**-6 * np.abs(b).max())


def paged(pooled, pool_valid, seed=5, ppp=4, spare=3):
    """The pools ``pooled [B, P, D]`` in pages of ``ppp`` pools through a shuffled block
    table with ``spare`` unowned pages (``P % ppp == 0``), and the pool counts that keep
    the valid pools: ``(pooled_pages, block_table, pool_counts)``."""
    b, n_pools, dim = pooled.shape
    pg = n_pools // ppp
    order = np.random.default_rng(seed).permutation(b * pg + spare)
    table = order[: b * pg].reshape(b, pg)
    pages = np.full((b * pg + spare, ppp, dim), np.nan, np.float32)  # spare pages: NaN
    for i in range(b):
        for j in range(pg):
            pages[table[i, j]] = np.asarray(pooled[i, j * ppp:(j + 1) * ppp])
    counts = np.asarray(pool_valid).argmin(1)  # the first invalid pool ends each row
    counts = np.where(np.asarray(pool_valid).all(1), n_pools, counts)
    return jnp.asarray(pages), jnp.asarray(table, jnp.int32), jnp.asarray(counts, jnp.int32)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_paged_equals_contiguous(implementation):
    (q, w, pooled, pool_valid, _, q_pos), g, _ = problem(n_pools=16, seed=6)
    pages, table, counts = paged(pooled, pool_valid)
    valid = jnp.arange(16)[None, :] < counts[:, None]  # what the pages hold as valid
    contiguous = (q, w, pooled, valid, jnp.zeros(2, jnp.int32), q_pos)
    cand = np.isfinite(np.asarray(pk.index_scores_reference(*contiguous, kpool=KP)))
    g = jnp.where(cand, g, jnp.inf)
    want = grads(contiguous, g, implementation)
    f = lambda q, w, pages: pk.index_scores_paged(  # noqa: E731
        q, w, pages, table, counts, q_pos, kpool=KP, implementation=implementation)
    got = vjp_of(f, (q, w, pages), g)
    d_pages = np.asarray(got[2])
    expect = np.zeros_like(d_pages)  # unowned pages (NaN keys): zero
    for i in range(2):
        for j in range(table.shape[1]):
            expect[table[i, j]] = np.asarray(want[2])[i, j * 4:(j + 1) * 4]
    # Two programs: XLA:CPU may contract a multiply-add of the interpreted kernel into an
    # FMA in one and not the other (float32 rounding; the GPU kernel is one binary).
    assert_close((got[0], got[1], d_pages), (want[0], want[1], expect))
    spare = np.setdiff1d(np.arange(d_pages.shape[0]), np.asarray(table))
    assert spare.size and np.all(d_pages[spare] == 0)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_not_candidates_pass_no_gradient(implementation):
    operands, g, cand = problem(seed=7)
    got = grads(operands, g, implementation)  # g is NaN off the candidates
    clean = grads(operands, jnp.where(cand, g, 0.0), implementation)
    for a, b in zip(got, clean):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    dq, dw, dpooled = map(np.asarray, got)
    assert np.all(dq[0, 1] == 0) and np.all(dw[0, 1] == 0)  # the padding query
    unseen = ~cand.any(1)  # [B, P]: no query's candidate (invalid, or after every query)
    assert unseen.any() and np.all(dpooled[unseen] == 0)


def test_two_runs_bit_identical():
    operands, g, _ = problem(seed=8)
    q, w, pooled, *rest = operands
    for implementation in ("xla", "pallas_interpret"):
        f = jax.jit(jax.grad(lambda q, w, k: jnp.sum(jnp.where(  # noqa: E731
            jnp.isfinite(s := pk.index_scores(q, w, k, *rest, kpool=KP,
                                              implementation=implementation)), s * g, 0.0)),
            argnums=(0, 1, 2)))
        first, second = f(q, w, pooled), f(q, w, pooled)
        for a, b in zip(first, second):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    blocked = [pk.index_scores_backward(*operands, g, kpool=KP, implementation="pallas_interpret",
                                        block_sizes=SMALL) for _ in range(2)]
    for a, b in zip(*blocked):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_xla_saves_and_builds_nothing_queries_by_pools_by_heads():
    """The custom_vjp's residuals are the operands; the reference backward's largest
    intermediate is a ``REFERENCE_BLOCK_Q``-query tile."""
    n_q, heads, n_pools = 3 * REFERENCE_BLOCK_Q + 1, 3, 40
    operands, g, _ = problem(b=1, n_q=n_q, heads=heads, n_pools=n_pools, seed=9)
    q, w, pooled, *rest = operands
    f = lambda q, w, k: pk.index_scores(q, w, k, *rest, kpool=KP)  # noqa: E731
    residuals = jax.jit(lambda *p: jax.tree.leaves(jax.vjp(f, *p)[1]))(q, w, pooled)
    assert max(x.size for x in residuals) == q.size  # the operands, the largest being q
    # What the custom_vjp's backward runs for "xla":
    jaxpr = jax.make_jaxpr(lambda *a: pk.index_scores_backward(*a, kpool=KP))(*operands, g)

    def shapes(jaxpr):  # every intermediate's shape, the scan body's too
        for e in jaxpr.eqns:
            yield from (tuple(v.aval.shape) for v in e.outvars if hasattr(v.aval, "shape"))
            for p in e.params.values():
                sub = getattr(p, "jaxpr", None)
                if sub is not None:
                    yield from shapes(getattr(sub, "jaxpr", sub))

    by_pools_and_heads = [sh for sh in shapes(jaxpr.jaxpr) if n_pools in sh and heads in sh]
    assert by_pools_and_heads  # the check sees the tiles
    assert max(np.prod(sh) for sh in by_pools_and_heads) <= REFERENCE_BLOCK_Q * n_pools * heads


def test_backward_rejects_bad_input():
    operands, g, _ = problem()
    with pytest.raises(ValueError, match=r"d_scores must be \(2, 5, 40\)"):
        pk.index_scores_backward(*operands, g[:, :, :3], kpool=KP)
    with pytest.raises(ValueError, match="IndexScoresBackwardBlockSizes.dk_block_p must be a power of two >= 16"):
        pk.index_scores_backward(*operands, g, kpool=KP,
                                 block_sizes=pk.IndexScoresBackwardBlockSizes(dk_block_p=8))
    with pytest.raises(TypeError, match="block_sizes must be a IndexScoresBackwardBlockSizes"):
        pk.index_scores_backward(*operands, g, kpool=KP, block_sizes=pk.IndexScoresBlockSizes())


def test_kpool_compress_gradient_equals_reference():
    ks = jax.random.split(jax.random.key(10), 4)
    keys, gate = (jax.random.normal(k, (2, 11, 8)) for k in ks[:2])
    ape = jax.random.normal(ks[2], (3, 8))
    valid = jnp.arange(11)[None, :] >= jnp.array([[0], [2]])
    ct = jax.random.normal(ks[3], (2, 3, 8))
    out = {}
    for impl in ("xla", "pallas_interpret"):
        f = lambda k, g, a: pk.kpool_compress(k, g, valid, a, implementation=impl)[0]  # noqa: E731
        out[impl] = vjp_of(f, (keys, gate, ape), ct)
    for a, b in zip(out["pallas_interpret"], out["xla"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.abs(np.asarray(a)).max() > 0 for a in out["xla"])


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_integer_steps_under_grad(implementation):
    """topk_pools / expand_selection inside a differentiated function: no tangent reaches
    their kernels (jvp and grad), the scores still get the gradient of what they feed."""
    scores = jax.random.normal(jax.random.key(11), (1, 2, 16))

    def loss(s):
        ids = pk.topk_pools(s, 4, implementation=implementation)
        tok = pk.expand_selection(ids, jnp.zeros(1, jnp.int32), None, kpool=KP, out_width=8,
                                  implementation=implementation)
        return jnp.sum(jnp.take_along_axis(s, ids, -1) ** 2) + jnp.sum(tok) * 0.0

    d = jax.jit(jax.grad(loss))(scores)
    ids = pk.topk_pools(scores, 4)
    want = jnp.zeros_like(scores).at[0, jnp.arange(2)[:, None], ids[0]].set(
        2 * jnp.take_along_axis(scores, ids, -1)[0])
    np.testing.assert_array_equal(np.asarray(d), np.asarray(want))
    jax.jit(lambda s, t: jax.jvp(loss, (s,), (t,)))(scores, jnp.ones_like(scores))


def test_streaming_topk_under_grad():
    scores = jax.random.normal(jax.random.key(12), (1, 2, 16))
    tile = lambda start, s: jax.lax.dynamic_slice_in_dim(s, start, 4, axis=-1)  # noqa: E731

    def loss(s):
        ids = pk.streaming_topk(tile, (s,), jnp.int32(4), tile=4, n_pools=16, select_k=3,
                                rows=(1, 2))
        return jnp.sum(jnp.take_along_axis(s, ids, -1))

    d = jax.jit(jax.grad(loss))(scores)
    assert float(jnp.sum(d)) == 6.0  # one per selected pool, 3 per row


@pytest.mark.mosaic
@pytest.mark.skipif(jax_version() < MOSAIC_MIN_JAX,
                    reason=f"Mosaic GPU interpret mode needs jax >= {MOSAIC_MIN_JAX}")
def test_mosaic_interpret_differentiates():
    """The Mosaic forward and backward kernels (bf16: they run) under the same custom_vjp:
    gradients right by the float32 rule (the same sums as ``"xla"``'s in another order and
    tiling, float32 accumulation, bf16 results)."""
    operands, g, _ = problem(dim=32, dtype=jnp.bfloat16, seed=13)
    ok, check, _ = float32_rule.against_float32(*bf16_grads(operands, g, "mosaic_interpret"),
                                                float32_rule.KERNEL_FLOOR)
    assert ok, check
    d = jax.grad(lambda s: jnp.sum(jnp.take_along_axis(  # noqa: E731
        s, pk.topk_pools(s, 3, implementation="mosaic_interpret"), -1)))(g[:, :, :16])
    assert float(jnp.sum(d)) == 3 * g.shape[0] * g.shape[1]


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_empty_problems_differentiate(implementation):
    """No query, no sequence, no pool position or (Pallas) no page: zero gradients of the
    operands' shapes, no kernel launched on an empty axis."""
    ones = lambda *shape: jnp.ones(shape)  # noqa: E731
    for b, n_q, n_pools in ((0, 3, 4), (2, 0, 4)):
        rest = (jnp.ones((b, n_pools), bool), jnp.zeros(b, jnp.int32), jnp.full((b, n_q), 5))
        f = lambda q, w, k: pk.index_scores(  # noqa: E731
            q, w, k, *rest, kpool=KP, implementation=implementation)
        primals = (ones(b, n_q, 2, 8), ones(b, n_q, 2), ones(b, n_pools, 8))
        for d, x in zip(vjp_of(f, primals, ones(b, n_q, n_pools)), primals):
            assert d.shape == x.shape and not np.any(np.asarray(d))
    pages = ((2, 0), (0, 2)) if implementation == "pallas_interpret" else ((2, 0),)
    for n_pages, pg in pages:  # (the reference cannot gather from an empty page pool)
        rest = (jnp.full((1, pg), -1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.full((1, 2), 5))
        f = lambda q, w, k: pk.index_scores_paged(  # noqa: E731
            q, w, k, *rest, kpool=KP, implementation=implementation)
        primals = (ones(1, 2, 2, 8), ones(1, 2, 2), ones(n_pages, 4, 8))
        for d, x in zip(vjp_of(f, primals, ones(1, 2, pg * 4)), primals):
            assert d.shape == x.shape and not np.any(np.asarray(d))
