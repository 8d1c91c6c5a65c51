"""The selection-side Pallas kernels: ``kpool_compress``, ``index_scores``, ``expand_selection``.

* Interpret mode (``implementation="pallas_interpret"``) against the plain-jnp references
  on hypothesis-drawn small shapes: integers and booleans must match exactly; float32
  values within ``rtol=1e-5, atol=1e-6``.
* CUDA lowering (Pallas -> Triton IR, no GPU needed) at the GLM-5.3-Flash shapes.
* Bad block sizes are rejected, under every implementation, with a ``ValueError`` that
  names the field of the kernel's block-size dataclass.

Why a float tolerance at all: the kernels sum in a different order than the references
(a sequential loop over pool slots vs. XLA's reduction; a tree sum over heads vs. the
einsum's dot), which moves the last bit or two of a float32 result (relative ~1e-7).
Exact zeros, the ``-inf`` pattern, ids and validity flags are compared exactly.

The references (``implementation="xla"``) run under ``jax.jit``, built once here, as the
layer runs them: eagerly, each of their operations compiled anew for every drawn shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels._common import lower_for_cuda, triton_calls

SETTINGS = settings(
    max_examples=12, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
KPOOLS = (1, 2, 3, 4, 8, 16)
DIMS = (3, 5, 8, 16, 24)  # not always a power of two
RTOL, ATOL = 1e-5, 1e-6

# The plain-jnp references, one compiled program per shape (see the module doc).
kpool_compress_xla = jax.jit(pk.kpool_compress)
index_scores_xla = jax.jit(pk.index_scores, static_argnames="kpool")
expand_selection_xla = jax.jit(pk.expand_selection, static_argnames=("kpool", "out_width"))


def _padding_mask(rng, b, length, mode):
    mask = np.ones((b, length), bool)
    for row in range(b):
        m = mode if mode != "mixed" else rng.choice(["none", "left", "right", "all", "random"])
        n = int(rng.integers(0, length + 1))
        if m == "left":
            mask[row, :n] = False
        elif m == "right":
            mask[row, length - n:] = False
        elif m == "all":
            mask[row] = False
        elif m == "random":
            mask[row] = rng.random(length) < 0.7
    return mask


# ------------------------------------------------------------------------------------
# kpool_compress
# ------------------------------------------------------------------------------------


@SETTINGS
@given(
    b=st.integers(1, 2),
    length=st.integers(1, 40),
    kpool=st.sampled_from(KPOOLS),
    d=st.sampled_from(DIMS),
    pad=st.sampled_from(["none", "left", "right", "all", "random", "mixed"]),
    explicit_first_key=st.booleans(),
    block_pools=st.sampled_from([None, 1, 2, 4]),
    seed=st.integers(0, 2**31 - 1),
)
# Edge cases drawn explicitly: a row shorter than one pool with all padding; kpool 16.
@example(b=2, length=3, kpool=16, d=5, pad="all", explicit_first_key=False, block_pools=None, seed=1)
@example(b=1, length=40, kpool=16, d=24, pad="left", explicit_first_key=False, block_pools=1, seed=2)
def test_kpool_compress_matches_reference(
    b, length, kpool, d, pad, explicit_first_key, block_pools, seed
):
    rng = np.random.default_rng(seed)
    keys = jnp.asarray(rng.standard_normal((b, length, d)), jnp.float32)
    gate = jnp.asarray(rng.standard_normal((b, length, d)) * 3, jnp.float32)
    ape = jnp.asarray(rng.standard_normal((kpool, d)), jnp.float32)
    valid = jnp.asarray(_padding_mask(rng, b, length, pad))
    # The decode cache passes its own pool grid start, possibly past the end of the window.
    first_key = (
        jnp.asarray(rng.integers(0, length + kpool + 1, b), jnp.int32) if explicit_first_key else None
    )
    got = pk.kpool_compress(
        keys, gate, valid, ape, first_key, implementation="pallas_interpret",
        block_sizes=pk.KpoolCompressBlockSizes(block_pools=block_pools),
    )
    want = kpool_compress_xla(keys, gate, valid, ape, first_key)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    pooled = np.asarray(got[0])
    assert (pooled[~np.asarray(want[2])] == 0).all(), "invalid pools must be exactly 0"
    np.testing.assert_allclose(pooled, want[0], rtol=RTOL, atol=ATOL)


def test_kpool_compress_bf16_keys():
    """The layer's dtypes: bf16 keys and ape, float32 gate logits. The kernel evaluates the
    softmax with the reference's operations, so allow at most one bf16 rounding step."""
    rng = np.random.default_rng(7)
    b, length, d, kpool = 2, 37, 24, 4
    keys = jnp.asarray(rng.standard_normal((b, length, d)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((b, length, d)) * 3, jnp.float32)
    ape = jnp.asarray(rng.standard_normal((kpool, d)), jnp.bfloat16)
    valid = jnp.asarray(rng.random((b, length)) < 0.9)
    got = pk.kpool_compress(keys, gate, valid, ape, implementation="pallas_interpret")
    want = pk.kpool_compress(keys, gate, valid, ape)
    assert got[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(
        np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=2**-7, atol=1e-6
    )


# ------------------------------------------------------------------------------------
# index_scores
# ------------------------------------------------------------------------------------


def _assert_scores_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert not np.isnan(got).any()
    # Exact zeros (ReLU ties) stay exact, and are +0.0.
    np.testing.assert_array_equal(got == 0, want == 0)
    assert not np.signbit(got[got == 0]).any()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=RTOL, atol=ATOL)


@SETTINGS
@given(
    b=st.integers(1, 2),
    n_q=st.integers(1, 6),
    heads=st.sampled_from([1, 3, 4, 17]),
    d=st.sampled_from(DIMS),
    n_pools=st.integers(1, 40),
    kpool=st.sampled_from(KPOOLS),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    block_q=st.sampled_from([1, 2, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_index_scores_matches_reference(b, n_q, heads, d, n_pools, kpool, dtype, block_q, seed):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((b, n_q, heads, d)), dt)
    w = jnp.asarray(rng.standard_normal((b, n_q, heads)), jnp.float32)
    pooled = rng.standard_normal((b, n_pools, d)).astype(np.float32)
    # Exact score ties: zero pooled keys (score exactly 0 for every query) and duplicated rows.
    pooled[:, ::3] = 0.0
    if n_pools > 2:
        pooled[:, -1] = pooled[:, 1]
    pooled = jnp.asarray(pooled, dt)
    pool_valid = jnp.asarray(rng.random((b, n_pools)) < 0.8)
    first_key = jnp.asarray(rng.integers(0, 4, b), jnp.int32)
    q_pos = rng.integers(0, n_pools * kpool + 4, (b, n_q))
    q_pos[rng.random((b, n_q)) < 0.2] = -1  # padding queries: no candidate
    q_pos = jnp.asarray(q_pos, jnp.int32)
    args = (q, w, pooled, pool_valid, first_key, q_pos)
    got = pk.index_scores(
        *args, kpool=kpool, implementation="pallas_interpret",
        block_sizes=pk.IndexScoresBlockSizes(block_q=block_q, block_p=16),
    )
    want = index_scores_xla(*args, kpool=kpool)
    _assert_scores_equal(got, want)


def test_index_scores_all_ties_and_nan():
    """Every score of a row tied at 0 (all pooled keys 0, or all negative logits), and a
    NaN score, which must become -inf, never a winner."""
    b, n_q, heads, d, n_pools, kpool = 1, 3, 4, 8, 20, 2
    rng = np.random.default_rng(3)
    q = np.abs(rng.standard_normal((b, n_q, heads, d))).astype(np.float32)
    q[0, 2] = -q[0, 2]  # row 2: every logit < 0 -> ReLU 0 -> all scores +0.0
    pooled = np.abs(rng.standard_normal((b, n_pools, d))).astype(np.float32)
    pooled[0, :5] = 0.0
    pooled[0, 7, 0] = np.nan
    w = -np.abs(rng.standard_normal((b, n_q, heads))).astype(np.float32)  # w * 0 = -0.0
    args = (
        jnp.asarray(q), jnp.asarray(w), jnp.asarray(pooled),
        jnp.ones((b, n_pools), bool), jnp.zeros((b,), jnp.int32),
        jnp.full((b, n_q), n_pools * kpool, jnp.int32),
    )
    got = pk.index_scores(*args, kpool=kpool, implementation="pallas_interpret",
                          block_sizes=pk.IndexScoresBlockSizes(block_p=16))
    want = pk.index_scores(*args, kpool=kpool)
    _assert_scores_equal(got, want)
    assert np.isneginf(np.asarray(got)[0, :, 7]).all()
    assert (np.asarray(got)[0, 2][np.arange(n_pools) != 7] == 0).all()


# ------------------------------------------------------------------------------------
# expand_selection
# ------------------------------------------------------------------------------------


@SETTINGS
@given(
    b=st.integers(1, 2),
    n_q=st.integers(1, 5),
    select_k=st.integers(0, 8),
    kpool=st.sampled_from(KPOOLS),
    tail_width=st.one_of(st.none(), st.integers(0, 6)),
    extra=st.integers(0, 5),
    prefix=st.booleans(),
    block_q=st.sampled_from([1, 2, 4]),
    block_w=st.sampled_from([1, 4, 16, 512]),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, n_q=3, select_k=0, kpool=4, tail_width=3, extra=0, prefix=True, block_q=2,
         block_w=1, seed=3)  # no pool slot at all: the tail alone
def test_expand_selection_matches_reference(
    b, n_q, select_k, kpool, tail_width, extra, prefix, block_q, block_w, seed
):
    rng = np.random.default_rng(seed)
    pool_ids = np.full((b, n_q, select_k), -1, np.int32)
    for row in np.ndindex(b, n_q):
        n = int(rng.integers(0, select_k + 1))
        ids = np.sort(rng.choice(64, n, replace=False)).astype(np.int32)
        if prefix:  # what topk_pools emits: ascending, -1 after
            pool_ids[row][:n] = ids
        else:  # the kernel compacts any row, as the reference does
            slots = np.sort(rng.choice(select_k, n, replace=False))
            pool_ids[row][slots] = ids
    first_key = jnp.asarray(rng.integers(0, 9, b), jnp.int32)
    tail = None
    if tail_width is not None:
        t = rng.integers(0, 400, (b, n_q, tail_width))
        tail = jnp.asarray(np.where(rng.random(t.shape) < 0.5, t, -1), jnp.int32)
    out_width = select_k * kpool + (tail_width or 0) + extra
    if out_width == 0:
        out_width = 1
    args = (jnp.asarray(pool_ids), first_key, tail)
    got = pk.expand_selection(
        *args, kpool=kpool, out_width=out_width, implementation="pallas_interpret",
        block_sizes=pk.ExpandSelectionBlockSizes(block_q=block_q, block_w=block_w),
    )
    want = expand_selection_xla(*args, kpool=kpool, out_width=out_width)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)


def test_expand_selection_visible_tail():
    """The tail as the layer builds it (``visible_tail``), with a padding query."""
    b, n_q, kpool, select_k = 2, 4, 4, 3
    rng = np.random.default_rng(5)
    key_valid = jnp.asarray(_padding_mask(rng, b, 30, "mixed"))
    first_key = pk.first_valid(key_valid)
    q_pos = jnp.asarray([[5, 17, 29, -1], [0, 3, 12, 28]], jnp.int32)
    n_vis = jnp.cumsum(key_valid, axis=1, dtype=jnp.int32)[jnp.arange(b)[:, None], jnp.maximum(q_pos, 0)]
    n_vis = jnp.where(q_pos >= 0, n_vis, 0)
    tail = pk.visible_tail(first_key, n_vis, q_pos, key_valid, kpool)
    pool_ids = jnp.asarray([[[0, 2, -1]] * n_q, [[1, -1, -1]] * n_q], jnp.int32)
    out_width = select_k * kpool + kpool - 1
    got = pk.expand_selection(
        pool_ids, first_key, tail, kpool=kpool, out_width=out_width,
        implementation="pallas_interpret",
    )
    want = pk.expand_selection(pool_ids, first_key, tail, kpool=kpool, out_width=out_width)
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------
# CUDA lowering at GLM-5.3-Flash shapes (Pallas -> Triton IR; nothing runs)
# ------------------------------------------------------------------------------------

INDEX_HEADS, INDEX_DIM, KPOOL = 32, 128, 4
INDEX_TOPK = 2048
SELECT_K = INDEX_TOPK // KPOOL  # 512
OUT_WIDTH = INDEX_TOPK + KPOOL - 1  # 2051
S = jax.ShapeDtypeStruct


def _lower_cuda(fn, *avals, name, grid):
    """Lower for CUDA without a GPU; exactly one Triton launch named ``name`` over ``grid``."""
    (call,) = triton_calls(lower_for_cuda(fn, *avals))
    assert (call["name"], call["grid"]) == (name, grid), call
    return call


@pytest.mark.lowering
@pytest.mark.parametrize("length", [8192, 1 << 20])
def test_kpool_compress_lowers_for_cuda(length):
    b = 1
    _lower_cuda(
        lambda k, g, v, a: pk.kpool_compress(k, g, v, a, implementation="pallas"),
        S((b, length, INDEX_DIM), jnp.bfloat16),  # LayerNorm'd keys, model dtype
        S((b, length, INDEX_DIM), jnp.float32),  # gate logits (float32 in the layer)
        S((b, length), jnp.bool_),
        S((KPOOL, INDEX_DIM), jnp.bfloat16),  # index_kpool_compress_ape
        # 32 pools of 128 channels per program (one 4096-element tile).
        name="kpool_compress", grid=(b, length // KPOOL // 32, 1),
    )


@pytest.mark.lowering
@pytest.mark.parametrize(
    "context, n_q, dtype",
    [
        (8192, 1, jnp.bfloat16), (8192, 64, jnp.bfloat16),  # a decode step, a prefill tile
        (1 << 20, 1, jnp.bfloat16), (1 << 20, 64, jnp.bfloat16),  # 1M tokens: 262,144 pools
        (8192, 64, jnp.float32),  # the float32 (IEEE dot) path
    ],
)
def test_index_scores_lowers_for_cuda(context, n_q, dtype):
    b, n_pools = 2, context // KPOOL
    _lower_cuda(
        lambda q, w, p, pv, fk, qp: pk.index_scores(
            q, w, p, pv, fk, qp, kpool=KPOOL, implementation="pallas"
        ),
        S((b, n_q, INDEX_HEADS, INDEX_DIM), dtype),
        S((b, n_q, INDEX_HEADS), jnp.float32),
        S((b, n_pools, INDEX_DIM), dtype),
        S((b, n_pools), jnp.bool_),
        S((b,), jnp.int32),
        S((b, n_q), jnp.int32),
        # Tiles of up to 16 queries x 64 pools; every pool of the context is scored.
        name="index_scores", grid=(-(-n_q // 16), b, n_pools // 64),
    )


@pytest.mark.lowering
@pytest.mark.parametrize("with_tail", [True, False])
@pytest.mark.parametrize("n_q", [1, 64])
def test_expand_selection_lowers_for_cuda(with_tail, n_q):
    b = 2
    avals = [S((b, n_q, SELECT_K), jnp.int32), S((b,), jnp.int32)]
    if with_tail:
        avals.append(S((b, n_q, KPOOL - 1), jnp.int32))
        fn = lambda p, fk, t: pk.expand_selection(
            p, fk, t, kpool=KPOOL, out_width=OUT_WIDTH, implementation="pallas"
        )
    else:
        fn = lambda p, fk: pk.expand_selection(
            p, fk, None, kpool=KPOOL, out_width=INDEX_TOPK, implementation="pallas"
        )
    _lower_cuda(fn, *avals, name="expand_selection", grid=(b, -(-n_q // 4), 1))  # 4 rows a program


# ------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------


def _small_kpool_args():
    return (
        jnp.zeros((1, 8, 4), jnp.float32), jnp.zeros((1, 8, 4), jnp.float32),
        jnp.ones((1, 8), bool), jnp.zeros((2, 4), jnp.float32),
    )


def _small_scores_args():
    return (
        jnp.zeros((1, 2, 2, 4)), jnp.zeros((1, 2, 2)), jnp.zeros((1, 4, 4)),
        jnp.ones((1, 4), bool), jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2), jnp.int32),
    )


@pytest.mark.parametrize("impl", ["xla", "pallas", "pallas_interpret"])
def test_bad_block_sizes_raise(impl):
    def kpool(**bad):
        pk.kpool_compress(*_small_kpool_args(), implementation=impl,
                          block_sizes=pk.KpoolCompressBlockSizes(**bad))

    def scores(**bad):
        pk.index_scores(*_small_scores_args(), kpool=2, implementation=impl,
                        block_sizes=pk.IndexScoresBlockSizes(**bad))

    def expand(**bad):
        pk.expand_selection(jnp.zeros((1, 2, 3), jnp.int32), jnp.zeros((1,), jnp.int32), None,
                            kpool=2, out_width=8, implementation=impl,
                            block_sizes=pk.ExpandSelectionBlockSizes(**bad))

    for call, field, value in [
        (kpool, "block_pools", 3), (kpool, "num_warps", 3), (kpool, "num_stages", 0),
        (scores, "block_q", 6), (scores, "block_p", 8), (scores, "block_p", 48),
        (scores, "num_warps", 0), (expand, "block_w", 12), (expand, "block_q", 0),
        (expand, "num_stages", 1.5),
    ]:
        with pytest.raises(ValueError, match=f"BlockSizes.{field}"):
            call(**{field: value})
    with pytest.raises(TypeError, match="KpoolCompressBlockSizes"):
        pk.kpool_compress(*_small_kpool_args(), implementation=impl,
                          block_sizes=pk.IndexScoresBlockSizes())


def test_bad_dtypes_raise():
    keys, gate, valid, ape = _small_kpool_args()
    with pytest.raises(ValueError, match="key_valid"):
        pk.kpool_compress(keys, gate, valid.astype(jnp.int32), ape, implementation="pallas_interpret")
    q, w, pooled, pv, fk, qp = _small_scores_args()
    with pytest.raises(ValueError, match="q_pos"):
        pk.index_scores(q, w, pooled, pv, fk, qp.astype(jnp.float32), kpool=2,
                         implementation="pallas_interpret")
    with pytest.raises(ValueError, match="pool_ids"):
        pk.expand_selection(jnp.zeros((1, 2, 3)), jnp.zeros((1,), jnp.int32), None, kpool=2,
                            out_width=8, implementation="pallas_interpret")
