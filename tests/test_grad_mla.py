"""Gradients of ``sparse_mla``: the token-major ``selection_transpose``, the ``"xla"``
backward against ``jax.vjp`` of the plain reference and float64 finite differences, the
Pallas backward (interpret mode) against ``"xla"``, determinism, and the block-size checks.

Id rows hold ``-1`` and ids ``>= L`` anywhere, rows with no valid id, and one row selected
by every query, so the masking, the zero gradient of an empty row and the transpose's
many-queries-per-row sums are all exercised. Shapes are tiny: interpret mode runs every
program on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from glm5_dsa_jax.tools import float32_rule
from pallas_kernels._common import lower_for_cuda, triton_calls
import pallas_kernels.attention as attention
from pallas_kernels.attention import sparse_mla_reference
from pallas_kernels.attention_backward import SparseMlaBackwardBlockSizes, sparse_mla_backward
from pallas_kernels.transpose import selection_transpose


def _transpose_oracle(token_ids: np.ndarray, length: int, shared: bool, block_rows: int):
    """The transpose by Python loops: {(block, query): mask}."""
    b, nq, _ = token_ids.shape
    out: dict[tuple[int, int], int] = {}
    for bi in range(b):
        for qi in range(nq):
            for i in token_ids[bi, qi]:
                if 0 <= i < length:
                    r = (0 if shared else bi) * length + int(i)
                    key = (r // block_rows, bi * nq + qi)
                    out[key] = out.get(key, 0) | (1 << (r % block_rows))
    return out


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("block_rows", [1, 16, 32])
def test_selection_transpose_matches_loops(shared, block_rows):
    rng = np.random.default_rng(block_rows + shared)
    b, nq, w, length = 2, 5, 7, 70
    ids = rng.integers(-2, length + 3, size=(b, nq, w)).astype(np.int32)
    ids[0, 1] = -1  # a query selecting nothing
    ids[1, 2, :3] = 33  # a repeated id: its bit once
    ids[:, :, 0] = 31  # one row selected by every query (bit 31 when block_rows = 32)
    t = selection_transpose(jnp.asarray(ids), length, shared=shared, block_rows=block_rows)
    start, query, mask = (np.asarray(a) for a in t)
    assert all(a.dtype == np.int32 for a in (start, query, mask))
    n_blocks = -(-(1 if shared else b) * length // block_rows)
    assert start.shape == (n_blocks + 1,) and query.shape == mask.shape == (b * nq * w,)
    got = {}
    for k in range(n_blocks):
        qs = query[start[k]:start[k + 1]]
        assert list(qs) == sorted(set(qs)), "a block's entries: increasing queries, once each"
        for e in range(start[k], start[k + 1]):
            got[(k, int(query[e]))] = int(mask[e]) & 0xFFFFFFFF
    assert got == _transpose_oracle(ids, length, shared, block_rows)
    n = start[-1]
    assert (query[n:] == -1).all() and (mask[n:] == 0).all() and (query[:n] >= 0).all()


def test_selection_transpose_jits_and_checks():
    ids = jnp.asarray([[[0, 5, -1], [5, 4, 9]]], jnp.int32)
    f = jax.jit(lambda i: selection_transpose(i, 6, shared=False, block_rows=4))
    start, query, mask = f(ids)
    # block 0 (rows 0-3): query 0 (id 0); block 1 (rows 4-7): query 0 (5), query 1 (5, 4)
    assert start.tolist() == [0, 1, 3] and query.tolist() == [0, 0, 1, -1, -1, -1]
    assert mask.tolist() == [1, 2, 3, 0, 0, 0]  # id 9 >= L selects nothing
    with pytest.raises(ValueError, match="block_rows"):
        selection_transpose(ids, 6, shared=False, block_rows=33)
    with pytest.raises(ValueError, match="token_ids"):
        selection_transpose(ids[0], 6, shared=False, block_rows=4)


# ------------------------------------------------------------------- sparse_mla gradients

SCALE = 0.3


def _id_rows(rng, b: int, nq: int, width: int, length: int, hot: int | None = None) -> np.ndarray:
    """Distinct ids per query (``sparse_mla``'s contract) drawn from ``[0, L + 3)`` (so some
    are ``>= L``), ``-1`` runs anywhere, query ``(0, 1)`` with no valid id, and ``hot`` (a
    row) in every other query's row."""
    rows = np.full((b, nq, width), -1, np.int32)
    for bi in range(b):
        for qi in range(nq):
            row = rng.permutation(length + 3)[:width].astype(np.int32)
            row[rng.random(width) < 0.25] = -1
            if hot is not None and hot not in row:
                row[rng.integers(width)] = hot
            rows[bi, qi] = row
    if nq > 1:
        rows[0, 1] = np.where(rng.random(width) < 0.5, -1, length + 1)  # nothing valid
    return rows


def _problem(seed, *, b=2, nq=3, h=3, c=40, length=45, width=12, shared=False, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), dtype)
    lat = jnp.asarray(rng.standard_normal((1 if shared else b, length, c)), dtype)
    ids = jnp.asarray(_id_rows(rng, b, nq, width, length, hot=length // 2))
    return rng, q, lat, ids


def _cotangent(out):
    return jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)).astype(out.dtype)


def _vjp(implementation, q, lat, ids, v, blocks=None):
    """``(out, dq, dlatent)`` of ``sparse_mla`` under ``implementation`` for a fixed
    cotangent pattern."""
    fn = lambda q_, l_: pk.sparse_mla(q_, l_, ids, scale=SCALE, value_width=v,  # noqa: E731
                                      implementation=implementation, block_sizes=blocks)
    out, vjp = jax.vjp(fn, q, lat)
    return (out, *vjp(_cotangent(out)))


#: One compiled program per shape (eagerly, every operation of the backward compiles anew).
_grads = jax.jit(_vjp, static_argnums=(0, 4, 5))


@pytest.mark.parametrize("shared", [False, True])
def test_xla_gradients_equal_vjp_of_reference(shared):
    # The "xla" custom_vjp (lse residual, recomputing backward) against autodiff of the
    # plain reference; RoPE split (V < CR).
    _, q, lat, ids = _problem(0, shared=shared)
    v = 24
    out, dq, dlat = _grads("xla", q, lat, ids, v)
    ref = lambda q_, l_: sparse_mla_reference(q_, l_, ids, scale=SCALE, value_width=v)  # noqa: E731
    ref_out, vjp = jax.vjp(ref, q, lat)
    want_dq, want_dlat = vjp(_cotangent(out))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_allclose(np.asarray(dq), np.asarray(want_dq), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dlat), np.asarray(want_dlat), rtol=1e-5, atol=1e-6)
    assert dlat.shape == lat.shape and np.abs(np.asarray(dlat)).max() > 0.1


def test_xla_gradients_match_float64_finite_differences():
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        b, nq, h, c, length, v = 1, 2, 2, 6, 7, 4
        q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float64)
        lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.float64)
        ids = jnp.asarray([[[0, 3, -1, 6], [2, 9, 3, 5]]], jnp.int32)
        w_out = jnp.asarray(rng.standard_normal((b, nq, h, v)), jnp.float64)
        loss = jax.jit(lambda q_, l_: jnp.sum(w_out * pk.sparse_mla(
            q_, l_, ids, scale=SCALE, value_width=v, implementation="xla")))
        dq, dlat = jax.grad(loss, argnums=(0, 1))(q, lat)
        assert dq.dtype == dlat.dtype == jnp.float64
        eps = 1e-6
        for _ in range(3):
            tq = jnp.asarray(rng.standard_normal(q.shape))
            tl = jnp.asarray(rng.standard_normal(lat.shape))
            fd = (loss(q + eps * tq, lat + eps * tl) - loss(q - eps * tq, lat - eps * tl)) / (2 * eps)
            exact = jnp.sum(dq * tq) + jnp.sum(dlat * tl)
            np.testing.assert_allclose(float(fd), float(exact), rtol=1e-7, atol=1e-9)
        # rows 1, 4 are selected by no query: exactly no gradient
        assert not np.asarray(dlat[0, [1, 4]]).any()


def _assert_close_f32(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("shared, num_splits", [(False, None), (True, 2)])
def test_pallas_gradients_equal_xla_f32(shared, num_splits):
    # Per-row latent (one batch row's ids are rows of its own cache) and the shared paged
    # pool [1, L, CR]; RoPE split V < CR; -1 / >= L ids, an empty query, one row selected
    # by every query; the forward split into two shares (lse through combine_splits).
    _, q, lat, ids = _problem(2, shared=shared)
    v = 24
    blocks = pk.SparseMlaBlockSizes(num_splits=num_splits)
    out, dq, dlat = _grads("pallas_interpret", q, lat, ids, v, blocks)
    want_out, want_dq, want_dlat = _grads("xla", q, lat, ids, v)
    _assert_close_f32(out, want_out)
    _assert_close_f32(dq, want_dq)
    _assert_close_f32(dlat, want_dlat)
    assert dq.dtype == q.dtype and dlat.dtype == lat.dtype and dlat.shape == lat.shape
    assert not np.asarray(dq[0, 1]).any()  # the query with no valid id
    assert np.isfinite(np.asarray(dlat)).all()
    selected = np.zeros(lat.shape[:2], bool)
    for bi, row in enumerate(np.asarray(ids)):
        valid = row[(row >= 0) & (row < lat.shape[1])]
        selected[0 if shared else bi, valid] = True
    assert not np.asarray(dlat)[~selected].any()  # rows no query selects: exactly 0


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_nan_in_an_unselected_row_stays_there(implementation):
    # A row no query selects may hold anything (a cache slot never written, a padding
    # token's row): its NaN reaches no output and no gradient, not even its own (exactly
    # 0), although it shares a row block with selected rows (the Triton dlatent kernel
    # walks whole blocks of rows).
    _, q, lat, ids = _problem(4)
    v = 24
    selected = np.zeros(lat.shape[:2], bool)
    for bi, row in enumerate(np.asarray(ids)):
        selected[bi, row[(row >= 0) & (row < lat.shape[1])]] = True
    unselected = np.argwhere(~selected)
    assert len(unselected), "the problem must leave some row unselected"
    poisoned = np.asarray(lat).copy()
    poisoned[~selected] = np.nan
    out, dq, dlat = _grads(implementation, q, jnp.asarray(poisoned), ids, v)
    want_out, want_dq, want_dlat = _grads(implementation, q, lat, ids, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(dq), np.asarray(want_dq))
    np.testing.assert_array_equal(np.asarray(dlat), np.asarray(want_dlat))
    assert not np.asarray(dlat)[~selected].any()


def test_pallas_gradients_bf16():
    """bf16 operands, f32 accumulation, judged by the float32 rule
    (``glm5_dsa_jax.tools.float32_rule``): the kernels round p and dz to bf16 before the
    tensor-core dots, ``"xla"`` keeps them in f32, both round the result to bf16; each
    one's distance from the float32 gradient on the same bf16-valued operands is its own
    error, and the kernels' must be within ``RATIO`` of ``"xla"``'s or ``KERNEL_FLOOR``. A
    gradient 3 % off (a lost term, not rounding) fails the same rule."""
    _, q, lat, ids = _problem(3, h=16, c=64, length=40, width=20, dtype=jnp.bfloat16)
    v = 64
    _, dq, dlat = _grads("pallas_interpret", q, lat, ids, v)
    out, *want = _grads("xla", q, lat, ids, v)
    assert dq.dtype == dlat.dtype == jnp.bfloat16
    fn32 = lambda q_, l_: pk.sparse_mla(q_, l_, ids, scale=SCALE, value_width=v, implementation="xla")  # noqa: E731
    ref32 = jax.vjp(fn32, q.astype(jnp.float32), lat.astype(jnp.float32))[1](_cotangent(out).astype(jnp.float32))
    ref32 = dict(dq=ref32[0], dlatent=ref32[1])
    xla = dict(dq=want[0], dlatent=want[1])
    ok, check, d = float32_rule.against_float32(dict(dq=dq, dlatent=dlat), xla, ref32, float32_rule.KERNEL_FLOOR)
    assert ok, check
    assert all(0 < e < 2.0**-8 for e in d["errs_xla"].values()), d  # bf16 rounding, not zero
    ok, check, _ = float32_rule.against_float32(dict(dq=dq * 1.03, dlatent=dlat), xla, ref32, float32_rule.KERNEL_FLOOR)
    assert not ok and check.startswith("MISMATCH 1 of 2 tensors: dq"), check


def test_pallas_backward_is_deterministic_and_jits():
    # Two runs of the jitted gradient give the same bits; the jitted gradient equals the
    # eager one; the transpose walks a hot row's many entries in a fixed order.
    _, q, lat, ids = _problem(4, nq=4, length=30)
    v = 40
    first = _grads("pallas_interpret", q, lat, ids, v)[1:]
    second = _grads("pallas_interpret", q, lat, ids, v)[1:]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(first, _grads("xla", q, lat, ids, v)[1:]):
        _assert_close_f32(a, b)


def test_backward_of_fp8_rows():
    # fp8 rows: dq with each row's scale; no gradient for the cache rows nor their scales.
    rng, q, lat, ids = _problem(5, h=4, c=32, length=24, width=10)
    lat8 = lat.astype(jnp.float8_e4m3fn)
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (lat.shape[0], lat.shape[1])), jnp.float32)
    v = 32
    loss = lambda impl: jax.jit(jax.grad(lambda q_, l_, s_: jnp.sum(jnp.sin(pk.sparse_mla(  # noqa: E731
        q_, l_, ids, s_, scale=SCALE, value_width=v, implementation=impl))), argnums=(0, 1, 2)))
    got, want = loss("pallas_interpret")(q, lat8, scales), loss("xla")(q, lat8, scales)
    _assert_close_f32(got[0], want[0])
    for dlat, dscale in (got[1:], want[1:]):
        assert dlat.dtype == lat8.dtype and not np.asarray(dlat.astype(jnp.float32)).any()
        assert not np.asarray(dscale).any()


def test_pallas_forward_lse():
    # The Triton forward's log-sum-exp (one split and two) is the reference's; -inf for a
    # query with no valid id.
    _, q, lat, ids = _problem(6)
    want_out, want_lse = attention._reference_with_lse(q, lat, ids, scale=SCALE, value_width=24)
    assert np.isneginf(np.asarray(want_lse[0, 1])).all()
    for splits in (1, 2):
        blocks = pk.SparseMlaBlockSizes(num_splits=splits).resolve(q.shape, ids.shape[2])
        out, lse = attention._sparse_mla_pallas(q, lat, ids, None, scale=SCALE, value_width=24,
                                                interpret=True, block_sizes=blocks)
        _assert_close_f32(out, want_out)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("field, value, match", [
    ("block_rows", 64, "block_rows"), ("block_rows", 8, "block_rows"), ("block_h", 8, "block_h"),
    ("block_w", 24, "block_w"), ("block_c", 0, "block_c"), ("dlatent_block_h", 12, "dlatent_block_h"),
    ("num_warps", 3, "num_warps"), ("dlatent_num_stages", 0, "dlatent.num_stages"),
    ("dlatent_num_warps", 0, "dlatent.num_warps"),
])
def test_backward_block_sizes_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SparseMlaBackwardBlockSizes(**{field: value}).validate()


def test_backward_block_sizes_resolve_by_row_width():
    # One column chunk (GLM-5.3-Flash's 512-wide rows): 32 rows and 32 ids a step, 8 warps;
    # several (GLM-5's 576 = 9 x 64): 16 and 16, 4 warps (what compiles without spills).
    flash = SparseMlaBackwardBlockSizes().resolve((1, 64, 64, 512), 2051)
    assert (flash.block_c, flash.block_w, flash.block_rows, flash.dlatent_num_warps) == (512, 32, 32, 8)
    rope = SparseMlaBackwardBlockSizes().resolve((1, 64, 64, 576), 2048)
    assert (rope.block_c, rope.block_w, rope.block_rows, rope.dlatent_num_warps) == (64, 16, 16, 4)
    mine = SparseMlaBackwardBlockSizes(block_rows=16, dlatent_num_warps=2).resolve((1, 1, 16, 512), 8)
    assert (mine.block_w, mine.block_rows, mine.dlatent_num_warps) == (16, 16, 2)


def test_backward_checks_its_arguments():
    _, q, lat, ids = _problem(7, b=1, nq=1)
    out = jnp.zeros((1, 1, 3, 24))
    lse = jnp.zeros((1, 1, 3))
    args = dict(scale=SCALE, value_width=24, implementation="xla")
    with pytest.raises(TypeError, match="SparseMlaBackwardBlockSizes"):
        sparse_mla_backward(q, lat, ids, out, lse, out, **args, block_sizes=pk.SparseMlaBlockSizes())
    with pytest.raises(ValueError, match="block_rows"):  # validated under "xla" too
        sparse_mla_backward(q, lat, ids, out, lse, out, **args,
                            block_sizes=SparseMlaBackwardBlockSizes(block_rows=48))
    with pytest.raises(ValueError, match="d_out"):
        sparse_mla_backward(q, lat, ids, out, lse, out[..., :8], **args)
    with pytest.raises(ValueError, match="lse"):
        sparse_mla_backward(q, lat, ids, out, lse[..., 0], out, **args)


def test_pallas_backward_tilings_agree():
    # Other tilings: column chunks of 16 (CR = 40: three chunks, the value boundary V = 24
    # inside the second), rows in blocks of 16 (blocks spanning two batch rows' caches),
    # 32 heads per dlatent step, ids in blocks of 16: the same gradients as the reference.
    _, q, lat, ids = _problem(8, length=40, width=20)
    v = 24
    out, lse = attention._reference_with_lse(q, lat, ids, scale=SCALE, value_width=v)
    d_out = _cotangent(out)
    want = sparse_mla_backward(q, lat, ids, out, lse, d_out, scale=SCALE, value_width=v)
    blocks = SparseMlaBackwardBlockSizes(block_c=16, block_w=16, block_rows=16, dlatent_block_h=32)
    got = sparse_mla_backward(q, lat, ids, out, lse, d_out, scale=SCALE, value_width=v,
                              implementation="pallas_interpret", block_sizes=blocks)
    for a, b in zip(got, want):
        _assert_close_f32(a, b)


@pytest.mark.lowering
def test_pallas_gradient_lowers_for_cuda():
    # The gradient of a query tile of 64 at GLM-5.3-Flash's shapes (64 heads, 512-wide rows,
    # 2051 ids, a 4K cache) lowers for CUDA with no GPU: the forward, then the dq kernel
    # (one program per query and 16 heads) and the dlatent kernel (one per 32 rows).
    b, nq, h, c, length, width = 1, 64, 64, 512, 4096, 2051
    sd = jax.ShapeDtypeStruct

    def grad(q, lat, ids, d_out):
        fn = lambda q_, l_: pk.sparse_mla(q_, l_, ids, scale=0.0625, implementation="pallas")  # noqa: E731
        return jax.vjp(fn, q, lat)[1](d_out)

    lowered = lower_for_cuda(grad, sd((b, nq, h, c), jnp.bfloat16), sd((b, length, c), jnp.bfloat16),
                             sd((b, nq, width), jnp.int32), sd((b, nq, h, c), jnp.bfloat16))
    calls = [(k["name"], k["grid"], k["num_warps"]) for k in triton_calls(lowered)]
    assert calls == [("sparse_mla", (nq * 4, 1, 1), 4), ("sparse_mla_dq", (nq * 4, 1, 1), 4),
                     ("sparse_mla_dlatent", (length // 32, 1, 1), 8)]
