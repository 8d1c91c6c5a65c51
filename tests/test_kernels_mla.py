"""``sparse_mla``: the Pallas kernel (interpret mode) against the plain-jnp reference, the
reference against the dense oracle, CUDA lowering at the real GLM-5.3-Flash shapes, and a
smoke run of ``scripts/gpu_check.py``.

Id rows are drawn with ``-1`` runs anywhere (not only as the suffix that the selection
produces), ids ``>= L``, all-``-1`` rows and prefix rows, so the per-slot masking, the
early stop (``n_end``) and the zero output of an empty row are all exercised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels._mla as mla_helpers
from pallas_kernels import attention
from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version, lower_for_cuda, triton_calls
from pallas_kernels.attention import SparseMlaBlockSizes, sparse_mla, sparse_mla_partial, sparse_mla_reference
from pallas_kernels.dense_mla import mla_masked_attention, topk_to_mask
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ids_row(rng, width: int, length: int, mode: str) -> np.ndarray:
    if mode == "none":
        return np.full(width, -1, np.int32)
    if mode == "prefix":  # what expand_selection emits: distinct valid ids, then -1s
        n = int(rng.integers(0, min(width, length) + 1))
        row = np.full(width, -1, np.int32)
        row[:n] = np.sort(rng.choice(length, size=n, replace=False))
        return row
    # "runs": ids anywhere in [-1, L + 3) with runs of -1 in the middle
    row = rng.integers(-1, length + 3, size=width).astype(np.int32)
    for _ in range(int(rng.integers(0, 3))):
        a = int(rng.integers(0, width))
        row[a : a + int(rng.integers(1, 8))] = -1
    return row


def _ids(rng, b, nq, width, length, modes=("none", "prefix", "runs")) -> np.ndarray:
    return np.stack([
        np.stack([_ids_row(rng, width, length, str(rng.choice(modes))) for _ in range(nq)])
        for _ in range(b)
    ])


@st.composite
def _case(draw):
    return dict(
        b=draw(st.integers(1, 2)),
        nq=draw(st.integers(1, 3)),
        h=draw(st.sampled_from([1, 3, 4, 16])),
        c=draw(st.sampled_from([8, 40, 64])),
        length=draw(st.integers(1, 50)),
        width=draw(st.integers(1, 40)),
        seed=draw(st.integers(0, 2**32 - 1)),
        # None = the wrapper's defaults; explicit splits exercise the combine step,
        # including splits that get no id block at all.
        num_splits=draw(st.sampled_from([None, 1, 2, 3])),
        block_w=draw(st.sampled_from([None, 16])),
    )


#: The reference under ``jax.jit``: one program per drawn shape (eagerly, each of its
#: operations compiles anew for every shape).
_reference = jax.jit(sparse_mla_reference, static_argnames="scale")


@settings(max_examples=10, deadline=None)
@given(_case())
def test_pallas_matches_reference_f32(case):
    rng = np.random.default_rng(case["seed"])
    b, nq, h, c, length, width = (case[k] for k in ("b", "nq", "h", "c", "length", "width"))
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.float32)
    ids_np = _ids(rng, b, nq, width, length)
    ids_np[0, 0] = -1  # at least one empty row per example
    ids = jnp.asarray(ids_np)
    scale = c**-0.5
    blocks = {k: case[k] for k in ("num_splits", "block_w") if case[k] is not None}
    got = sparse_mla(q, lat, ids, scale=scale, implementation="pallas_interpret",
                     block_sizes=SparseMlaBlockSizes(**blocks))
    want = _reference(q, lat, ids, scale=scale)
    assert got.shape == want.shape and got.dtype == jnp.float32
    got = np.asarray(got)
    assert not np.isnan(got).any()
    # Both sides compute in float32 (the reference with HIGHEST-precision einsums); they
    # differ only in summation order and in the online softmax's rescaling, a few ulps per
    # term over <= 40 slots and <= 64 channels. Outputs are convex combinations of N(0, 1)
    # rows, so O(1): rtol 2e-5 covers that with margin; atol 2e-6 covers outputs that
    # cancel to near 0.
    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(got[0, 0], 0.0)


def test_all_invalid_rows_are_exact_zeros():
    rng = np.random.default_rng(1)
    b, nq, h, c, length, width = 2, 2, 4, 40, 20, 37
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.float32)
    ids = np.full((b, nq, width), -1, np.int32)
    ids[1, 1, 3] = length + 5  # out of range: not a token either
    ids[0, 1, :5] = [3, 1, 4, 15, 9]  # one real row, so empty and full rows coexist
    for num_splits in (1, 4):
        out = np.asarray(sparse_mla(q, lat, jnp.asarray(ids), scale=0.1,
                                    implementation="pallas_interpret",
                                    block_sizes=SparseMlaBlockSizes(num_splits=num_splits)))
        assert not np.isnan(out).any()
        assert (out[0, 0] == 0).all() and (out[1] == 0).all()
        np.testing.assert_allclose(
            out[0, 1], np.asarray(sparse_mla_reference(q, lat, jnp.asarray(ids), scale=0.1))[0, 1],
            rtol=2e-5, atol=2e-6,
        )


def test_invalid_ids_are_never_read():
    # Latent row 0 (where the reference clamps -1) and every unselected row hold NaN: the
    # kernel masks the gather itself, so they never reach the output. (The reference reads
    # the clamped row and gives it weight 0, and 0 * NaN = NaN: it would fail this test.)
    rng = np.random.default_rng(2)
    b, nq, h, c, length, width = 1, 2, 3, 64, 30, 20
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    lat = rng.standard_normal((b, length, c)).astype(np.float32)
    ids = np.full((b, nq, width), -1, np.int32)
    ids[0, 0, :6] = [2, 5, 7, 11, 12, 29]
    ids[0, 1, [1, 4, 9]] = [5, 7, 11]
    poisoned = lat.copy()
    chosen = np.unique(ids[ids >= 0])
    mask = np.ones(length, bool)
    mask[chosen] = False
    poisoned[:, mask] = np.nan
    got = np.asarray(sparse_mla(q, jnp.asarray(poisoned), jnp.asarray(ids), scale=0.125,
                                implementation="pallas_interpret",
                                block_sizes=SparseMlaBlockSizes(num_splits=2)))
    want = np.asarray(sparse_mla_reference(q, jnp.asarray(lat), jnp.asarray(ids), scale=0.125))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_wide_row_scanned_in_tiles(monkeypatch):
    # Rows wider than the single-load scan limit find n_end with a loop of tiles; shrink
    # the limit so a 40-wide row takes three tiles, with its last valid id in the last one.
    monkeypatch.setattr(mla_helpers, "SCAN_BLOCK", 16)
    rng = np.random.default_rng(3)
    b, nq, h, c, length, width = 1, 2, 16, 16, 50, 40
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.float32)
    ids = np.full((b, nq, width), -1, np.int32)
    ids[0, 0, [0, 20, 39]] = [4, 8, 49]
    ids[0, 1, 33] = 7
    got = sparse_mla(q, lat, jnp.asarray(ids), scale=0.25, implementation="pallas_interpret")
    want = sparse_mla_reference(q, lat, jnp.asarray(ids), scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_bf16_within_bf16_tolerance():
    rng = np.random.default_rng(4)
    b, nq, h, c, length, width = 2, 2, 16, 64, 48, 35
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.bfloat16)
    lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.bfloat16)
    ids = jnp.asarray(_ids(rng, b, nq, width, length, modes=("prefix", "runs")))
    got = sparse_mla(q, lat, ids, scale=c**-0.5, implementation="pallas_interpret")
    want = sparse_mla_reference(q, lat, ids, scale=c**-0.5)
    assert got.dtype == jnp.bfloat16
    # The kernel rounds the softmax weights to bf16 before ``p @ kv`` (the tensor-core
    # path) and both sides round the output to bf16: a few bf16 ulps (2**-8 relative) on
    # O(1) outputs.
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )



def test_bf16_reference_sums_values_within_2_pow_16():
    """The reference on bf16 rows (``attention.weighted_values``): bf16 products with the
    softmax weights split into two bf16 parts, whose value sum is within ``2**-16`` of the
    float32 one per weight; its outputs are the float32 reference's rounded to bf16 but for
    a few ulp-1 ties; its gradients are the float32 products' exactly."""
    rng = np.random.default_rng(7)
    b, nq, h, c, length, width = 2, 3, 8, 64, 96, 40
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.bfloat16)
    lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.bfloat16)
    ids = jnp.asarray(_ids(rng, b, nq, width, length, modes=("prefix", "runs")))
    p = jax.nn.softmax(jnp.asarray(rng.standard_normal((b, nq, h, width)) * 3, jnp.float32), -1)
    vals = jnp.asarray(rng.standard_normal((b, nq, width, c)), jnp.bfloat16)
    exact = jnp.einsum("bqhw,bqwc->bqhc", p, vals.astype(jnp.float32), precision="highest")
    bound = 2.0**-16 * jnp.einsum("bqhw,bqwc->bqhc", p, jnp.abs(vals).astype(jnp.float32)) + 1e-6
    err = jnp.abs(attention.weighted_values(p, vals) - exact)
    assert bool(jnp.all(err <= bound)), float(jnp.max(err / bound))
    # The whole reference against its float32 run (the same bf16 inputs, widened), rounded
    # to bf16: one bf16 ulp of the output plus the split's 2**-16 of sum_w p |v| (the weights
    # sum to 1, so at most 2**-16 max |v|; an output near zero cancels, its ulp is small).
    got = np.asarray(sparse_mla_reference(q, lat, ids, scale=c**-0.5), np.float32)
    wide = sparse_mla_reference(q.astype(jnp.float32), lat.astype(jnp.float32), ids, scale=c**-0.5)
    want = np.asarray(wide.astype(jnp.bfloat16), np.float32)
    bound = np.abs(want) * 2.0**-7 + 2.0**-15 * float(jnp.max(jnp.abs(lat).astype(jnp.float32)))
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    assert np.mean(got != want) < 0.02
    # Gradients: the float32 products' (custom JVP), w.r.t. the weights and the values.
    f = lambda p, v: jnp.sum(jnp.sin(attention.weighted_values(p, v)))
    g = lambda p, v: jnp.sum(jnp.sin(jnp.einsum("bqhw,bqwc->bqhc", p, v.astype(jnp.float32), precision="highest")))
    for got_g, want_g in zip(jax.grad(f, (0, 1))(p, vals), jax.grad(g, (0, 1))(p, vals)):
        assert got_g.dtype == want_g.dtype
        np.testing.assert_allclose(np.asarray(got_g, np.float32), np.asarray(want_g, np.float32), rtol=1e-2, atol=1e-5)



def test_bf16_reference_products_stay_bf16_on_cpu():
    """The reference's two products multiply bf16 operands on XLA:CPU even when the query
    comes out of an earlier float32 product (the layer's ``absorb_q`` under the CPU
    policy): no float32 copy of the gathered rows (``attention._flat_batch_product``)."""
    import re

    b, h, d, c, length, width = 2, 4, 16, 32, 64, 24

    def step(q_nope, w_uk, lat, ids):
        q = jnp.einsum("bshd,hdc->bshc", q_nope, w_uk, precision="highest").astype(jnp.bfloat16)
        return sparse_mla_reference(q, lat, ids, scale=0.1)

    shapes = (jax.ShapeDtypeStruct((b, 1, h, d), jnp.float32), jax.ShapeDtypeStruct((h, d, c), jnp.float32),
              jax.ShapeDtypeStruct((b, length, c), jnp.bfloat16), jax.ShapeDtypeStruct((b, 1, width), jnp.int32))
    hlo = jax.jit(step).lower(*shapes).compile().as_text()
    # Each product is a dot in a computation of its own (a library fusion), whose header
    # names the operand types: the scores [b, h, width] and the value sum [b, 2h, c].
    products, header = [], ""
    for line in hlo.splitlines():
        if re.match(r"^(ENTRY )?%\S+ \(", line):
            header = line
        elif " dot(" in line and re.search(rf"= f32\[{b},({h},{width}|{2 * h},{c})\]", line):
            products.append(header)
    assert len(products) == 2, hlo
    for hd in products:
        assert "f32" not in hd.split("->")[0], hd


_partial_reference = jax.jit(sparse_mla_partial, static_argnames=("scale", "value_width"))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_partial_returns_the_kernels_lse(num_splits):
    """``sparse_mla_partial(implementation="pallas_interpret")``: the Triton launch's output
    (``sparse_mla``'s bits, same blocks) and log-sum-exp (one split, or merged over 3 by the
    ``sparse_mla_combine`` launch) against the reference's (``"xla"``); a row holding no id: output
    zeros, lse ``-inf``. Two parts over disjoint ids merged by their lse (as
    ``parallel.context.merge_partials`` does) give the attention over all of them."""
    rng = np.random.default_rng(7)
    b, nq, h, c, v, length, width = 2, 3, 5, 40, 32, 30, 24  # V < CR: RoPE's k_rot columns are scored only
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.float32)
    ids_np = _ids(rng, b, nq, width, length, modes=("prefix", "runs"))
    ids_np[0, 0] = -1
    ids_np[1, 2, :] = length + 1  # out of range: no token either
    ids = jnp.asarray(ids_np)
    kw = dict(scale=c**-0.5, value_width=v)
    blocks = SparseMlaBlockSizes(num_splits=num_splits, block_w=16)
    out, lse = sparse_mla_partial(q, lat, ids, **kw, implementation="pallas_interpret", block_sizes=blocks)
    want_out, want_lse = _partial_reference(q, lat, ids, **kw)
    assert out.shape == (b, nq, h, v) and lse.shape == (b, nq, h) and lse.dtype == jnp.float32
    np.testing.assert_array_equal(
        out, sparse_mla(q, lat, ids, **kw, implementation="pallas_interpret", block_sizes=blocks))
    out, lse = np.asarray(out), np.asarray(lse)
    none = ~((ids_np >= 0) & (ids_np < length)).any(-1)
    assert none[0, 0] and none[1, 2]
    assert (lse[none] == -np.inf).all() and (out[none] == 0).all()
    assert np.isfinite(lse[~none]).all()
    np.testing.assert_array_equal(np.asarray(want_lse)[none], -np.inf)
    np.testing.assert_allclose(out, np.asarray(want_out), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(lse[~none], np.asarray(want_lse)[~none], rtol=2e-6, atol=2e-6)

    odd = ids_np % 2 == 1  # two "devices": the odd ids, the even ones
    parts = [sparse_mla_partial(q, lat, jnp.asarray(np.where(sel, ids_np, -1)), **kw,
                                implementation="pallas_interpret", block_sizes=blocks) for sel in (odd, ~odd)]
    m = np.maximum(*(np.asarray(p[1]) for p in parts))
    m = np.where(np.isfinite(m), m, 0.0)
    w = [np.exp(np.asarray(p[1]) - m) for p in parts]
    den = w[0] + w[1]
    merged = sum(np.asarray(p[0]) * wi[..., None] for p, wi in zip(parts, w))
    merged = np.where(den[..., None] > 0, merged / np.where(den > 0, den, 1.0)[..., None], 0.0)
    np.testing.assert_allclose(merged, np.asarray(want_out), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("groups", [None, 3])
def test_partial_reads_fp8_rows(groups):
    """fp8 rows (an fp8 cache's shard): e4m3 ``latent`` with one scale a row (``[B, L]``) or
    3 groups a row (``[B, L, 3]``: two of the 32 value columns, one of ``k_rot``), the
    Triton partial equal to the reference's, out and lse."""
    rng = np.random.default_rng(8)
    b, nq, h, c, v, length, width = 1, 2, 3, 40, 32, 24, 16
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.float8_e4m3fn)
    shape = (b, length) if groups is None else (b, length, groups)
    row_scale = jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)
    ids_np = _ids(rng, b, nq, width, length, modes=("prefix",))
    ids_np[0, 1] = -1
    ids = jnp.asarray(ids_np)
    kw = dict(scale=0.2, value_width=v)
    out, lse = sparse_mla_partial(q, lat, ids, row_scale, **kw, implementation="pallas_interpret")
    want_out, want_lse = jax.jit(lambda *a: sparse_mla_partial(*a, **kw))(q, lat, ids, row_scale)
    np.testing.assert_array_equal(out, sparse_mla(q, lat, ids, row_scale, **kw, implementation="pallas_interpret"))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=2e-5, atol=2e-5)
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    assert lse[0, 1].tolist() == want_lse[0, 1].tolist() == [-np.inf] * h
    np.testing.assert_allclose(lse[0, 0], want_lse[0, 0], rtol=2e-6, atol=2e-6)


def test_partial_checks_like_sparse_mla():
    """Bad block sizes and operands: the ``ValueError`` of ``sparse_mla``, under every
    implementation."""
    q = jnp.zeros((1, 1, 4, 16), jnp.float32)
    lat = jnp.zeros((1, 8, 16), jnp.float32)
    ids = jnp.zeros((1, 1, 4), jnp.int32)
    for impl in ("xla", "pallas_interpret"):
        with pytest.raises(ValueError, match="SparseMlaBlockSizes.block_w"):
            sparse_mla_partial(q, lat, ids, scale=1.0, implementation=impl,
                               block_sizes=SparseMlaBlockSizes(block_w=24))
        with pytest.raises(ValueError, match="value_width"):
            sparse_mla_partial(q, lat, ids, scale=1.0, value_width=17, implementation=impl)
    with pytest.raises(ValueError, match="implementation must be one of"):
        sparse_mla_partial(q, lat, ids, scale=1.0, implementation="triton")


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 5), st.integers(1, 30),
       st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_reference_equals_dense_oracle(b, nq, h, length, width, seed):
    rng = np.random.default_rng(seed)
    c = 24
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((b, length, c)), jnp.float32)
    # Distinct ids per row (the selection never repeats one), -1 and out-of-range ids mixed in.
    ids = np.full((b, nq, width), -1, np.int32)
    for i in range(b):
        for j in range(nq):
            n = int(rng.integers(0, min(width, length + 3) + 1))
            ids[i, j, rng.choice(width, size=n, replace=False)] = rng.choice(
                length + 3, size=n, replace=False
            )
    ids = jnp.asarray(ids)
    want = jax.jit(lambda q, lat, ids: mla_masked_attention(
        q, lat, topk_to_mask(ids, length), scale=0.3))(q, lat, ids)
    got = jax.jit(lambda q, lat, ids: sparse_mla_reference(q, lat, ids, scale=0.3))(q, lat, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_bad_block_sizes_raise(impl):
    q = jnp.zeros((1, 1, 4, 16), jnp.float32)
    lat = jnp.zeros((1, 8, 16), jnp.float32)
    ids = jnp.zeros((1, 1, 4), jnp.int32)
    for name, value in [("block_w", 24), ("block_h", 8), ("block_c", 48), ("num_warps", 3),
                        ("num_splits", 0), ("num_stages", 0)]:
        with pytest.raises(ValueError, match=f"SparseMlaBlockSizes.{name}"):
            sparse_mla(q, lat, ids, scale=1.0, implementation=impl,
                       block_sizes=SparseMlaBlockSizes(**{name: value}))
    with pytest.raises(TypeError, match="block_k"):
        SparseMlaBlockSizes(block_k=16)
    with pytest.raises(TypeError, match="SparseMlaBlockSizes"):
        sparse_mla(q, lat, ids, scale=1.0, implementation=impl, block_sizes={"block_w": 16})


# Real GLM-5.3-Flash shapes: 64 heads, kv_lora_rank 512, out_width 2048 + kpool - 1.
_REAL = [
    pytest.param(1, 1, 131072, id="decode-b1-128k"),
    pytest.param(8, 1, 131072, id="decode-b8-128k"),
    pytest.param(1, 1, 1048576, id="decode-b1-1m"),
    pytest.param(1, 64, 131072, id="prefill-q64-128k"),
]


@pytest.mark.lowering
@pytest.mark.parametrize("b,nq,length", _REAL)
def test_lowers_for_cuda_at_real_shapes(b, nq, length):
    sds = jax.ShapeDtypeStruct
    fn = lambda q, lat, ids: sparse_mla(q, lat, ids, scale=256**-0.5, implementation="pallas")
    lowered = lower_for_cuda(
        fn,
        sds((b, nq, 64, 512), jnp.bfloat16),
        sds((b, length, 512), jnp.bfloat16),
        sds((b, nq, 2051), jnp.int32),
    )
    # A program per (row, block of 16 heads) and per split of the id blocks; a split row's
    # partials merged by a second launch, a program per (row, head block, 128 columns).
    blocks = SparseMlaBlockSizes().resolve((b, nq, 64, 512), 2051)
    call, *combine = triton_calls(lowered)
    assert call["name"] == "sparse_mla"
    assert call["grid"] == (b * nq * 64 // blocks.block_h, blocks.num_splits, 1)
    assert (call["num_warps"], call["num_stages"]) == (blocks.num_warps, blocks.num_stages)
    # A decode row is split (flash-decoding) so that it fills the GPU; a prefill tile is not.
    assert (blocks.num_splits > 1) == (b * nq * 4 < 256)
    assert [(c["name"], c["grid"]) for c in combine] == (
        [("sparse_mla_combine", (b * nq * 64 // blocks.block_h, 512 // 128, 1))]
        if blocks.num_splits > 1 else [])


@pytest.mark.e2e
def test_gpu_check_smoke_runs_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        # No time budget: the smoke run checks every row, however loaded this machine is
        # (the budget bounds a GPU session's time, not correctness).
        [sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--smoke", "--json",
         "--budget", "100000"],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    report = json.loads(proc.stdout)
    rows = report["rows"]
    kernels = {r["kernel"] for r in rows}
    assert {"kpool_compress", "index_scores", "index_scores_paged", "topk_pools",
            "expand_selection", "sparse_mla"} <= kernels
    mla = [r for r in rows if r["kernel"] == "sparse_mla" and r["impl"] != "xla"]
    assert mla and all(r["check"].startswith("ok") for r in mla), mla
    assert "pallas rope" in {r["impl"] for r in mla}  # the [c, k_rot] rows, value_width C
    # topk_pools on both paths (the smoke rows are short: the multi-program one is forced)
    topk = {r["impl"]: r["check"] for r in rows if r["kernel"] == "topk_pools"}
    assert topk["pallas"].startswith("ok") and topk["pallas split_p=2"].startswith("ok"), topk
    # the paged cache's kernels on the same data, through a block table / a shared pool
    paged = [r for r in rows if (r["kernel"] == "index_scores_paged" and r["impl"] == "pallas")
             or r["impl"] in ("pallas n_live", "pallas shared latent")]
    assert len(paged) == 3 * 2 and all(r["check"].startswith("ok") for r in paged), paged
    # jax >= 0.11: a mosaic row (interpret mode) for every step with a Mosaic kernel, checked
    mosaic = {(r["kernel"], r["impl"].split(" (")[0]): r["check"] for r in rows
              if r["impl"].startswith("mosaic")}
    if jax_version() >= MOSAIC_MIN_JAX:
        want = {(k, "mosaic") for k in ("index_scores", "index_scores_paged", "topk_pools",
                                        "sparse_mla")}
        want |= {("topk_pools", "mosaic n_live"), ("sparse_mla", "mosaic shared latent")}
        assert set(mosaic) == want and all(c.startswith("ok") for c in mosaic.values()), mosaic
    else:
        assert not mosaic, mosaic
    # the roofline column: a bound for every modelled kernel of the main table
    assert report["roofline_gpu"] == "h100"
    assert all(r["bound_us"] > 0 for r in rows
               if r["kernel"] in ("index_scores", "topk_pools", "expand_selection")), rows
