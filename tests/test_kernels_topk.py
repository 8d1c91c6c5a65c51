"""``topk_pools``: the Pallas kernel (interpret mode) against the reference, bit for bit.

Scores are drawn with many exact ties (small integers, ``0.0`` and ``-0.0``), ``-inf``
(never selected), NaN (treated as ``-inf``), denormals and extremes, so the tie rule
(lower pool index wins), the ``-1`` padding and the ascending output order are all checked.
CUDA lowering is checked at the real decode and prefill shapes without a GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels.selection as selection
from pallas_kernels._common import lower_for_cuda, triton_calls
from pallas_kernels._order_key import NEG_INF_KEY, kth_largest_key, order_key
from pallas_kernels.selection import (
    TopkPoolsBlockSizes, topk_pools, topk_pools_lax_baseline, topk_pools_reference,
)

# Values a score row is drawn from: exact ties, both zeros, non-candidates, NaN (both
# signs), the smallest denormals (distinct from 0 in the reference), extremes.
_SPECIAL = np.array(
    [0.0, -0.0, 0.0, -0.0, 1.0, 1.0, 2.0, -1.0, -1.0, -2.0, -np.inf, -np.inf, np.inf,
     np.nan, -np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38, 0.5],
    dtype=np.float32,
)

#: The reference under ``jax.jit``, one program per shape and ``select_k`` (eagerly, each of
#: its operations compiles anew for every drawn shape): the same operations, so the same ids.
_reference = jax.jit(topk_pools_reference, static_argnums=1)


def _check(scores: np.ndarray, select_k: int, **block_sizes) -> np.ndarray:
    x = jnp.asarray(scores, jnp.float32)
    got = np.asarray(topk_pools(x, select_k, implementation="pallas_interpret",
                                block_sizes=TopkPoolsBlockSizes(**block_sizes)))
    want = np.asarray(_reference(x, select_k))
    assert got.shape == want.shape == scores.shape[:-1] + (select_k,)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    return got


def _draw_scores(mode: str, rng: np.random.Generator, shape: tuple) -> np.ndarray:
    if mode == "ties":
        s = rng.integers(-2, 3, size=shape).astype(np.float32)
        s[rng.random(s.shape) < 0.3] = -0.0
        s[rng.random(s.shape) < 0.2] = -np.inf
    elif mode == "special":
        s = rng.choice(_SPECIAL, size=shape)
    else:
        s = rng.standard_normal(shape).astype(np.float32)
        s = np.where(rng.random(s.shape) < 0.5, np.round(s), s).astype(np.float32)
        s[rng.random(s.shape) < 0.15] = -np.inf
        s[rng.random(s.shape) < 0.05] = np.nan
    return s


@st.composite
def _case(draw):
    b = draw(st.integers(1, 2))
    q = draw(st.integers(1, 3))
    p = draw(st.integers(1, 70))
    k = draw(st.integers(0, p))
    seed = draw(st.integers(0, 2**32 - 1))
    mode = draw(st.sampled_from(["ties", "special", "mixed"]))
    s = _draw_scores(mode, np.random.default_rng(seed), (b, q, p))
    blocks = draw(st.sampled_from([
        {},
        {"block_p": 16, "radix_bits": 8},
        {"block_p": 8, "radix_bits": 2},
        {"block_p": 4, "radix_bits": 1},
    ]))
    return s, k, blocks


@settings(max_examples=15, deadline=None)
@given(_case())
def test_matches_reference(case):
    scores, select_k, blocks = case
    _check(scores, select_k, **blocks)


def test_all_neg_inf_row_is_all_minus_one():
    s = np.full((1, 2, 37), -np.inf, np.float32)
    s[0, 1, :] = np.nan
    got = _check(s, 5)
    assert (got == -1).all()


def test_all_equal_row_takes_lowest_indices():
    s = np.zeros((2, 1, 50), np.float32)
    s[1, 0, ::2] = -0.0  # -0.0 ties with +0.0
    got = _check(s, 7)
    np.testing.assert_array_equal(got, np.broadcast_to(np.arange(7), (2, 1, 7)))


def test_select_all_pools():
    rng = np.random.default_rng(1)
    s = rng.integers(-1, 2, size=(1, 2, 45)).astype(np.float32)
    s[0, 0, 3] = -np.inf
    got = _check(s, 45)
    assert got[0, 1].tolist() == list(range(45))
    assert got[0, 0].tolist() == [p for p in range(45) if p != 3] + [-1]


def test_single_pool():
    _check(np.array([[[3.0]], [[-np.inf]]], np.float32), 1)
    _check(np.array([[[3.0]]], np.float32), 0)


def test_select_zero_is_empty():
    got = topk_pools(jnp.zeros((2, 3, 10)), 0, implementation="pallas_interpret")
    assert got.shape == (2, 3, 0) and got.dtype == jnp.int32


def _sorted_rule(scores: np.ndarray, select_k: int) -> np.ndarray:
    """``topk_pools``' rule by a sort: higher key first, the lower pool id among equal keys
    (``-0.0``, denormals and ``+0.0`` one key; NaN and ``-inf`` never), ids ascending, -1 pads."""
    key = np.asarray(order_key(jnp.asarray(scores)))
    out = np.full(scores.shape[:-1] + (select_k,), -1, np.int32)
    for idx in np.ndindex(scores.shape[:-1]):
        ids = np.lexsort((np.arange(key.shape[-1]), -key[idx].astype(np.int64)))[:select_k]
        ids = np.sort(ids[key[idx][ids] > NEG_INF_KEY])
        out[idx][: ids.size] = ids
    return out


@pytest.mark.parametrize("n_pools", [(1 << 16) - 1, 1 << 16])
def test_reference_equals_a_sort_on_both_sides_of_the_packed_prefix_sum(n_pools):
    """The reference ranks a row shorter than ``2**16`` with one prefix sum of two packed
    counts and a longer one with two (``_order_key._two_counts``): both against a sort,
    on rows whose threshold has far more ties than room (and one with fewer live keys than
    ``select_k``), so a carry between the halves or a wrong tie rank would show."""
    rng = np.random.default_rng(5)
    s = np.zeros((3, 1, n_pools), np.float32)  # the threshold, 0, tied almost everywhere
    for row in (0, 1):  # 2,900 keys above it, then 100 ties of ~65K taken in id order
        s[row, 0, rng.choice(n_pools, 2900, replace=False)] = rng.integers(1, 6, 2900)
    s[1, 0, rng.random(n_pools) < 0.5] *= -1.0  # half the ties -0.0, one key with +0.0
    s[1, 0, s[1, 0] < 0] = 1.0  # the keys above stay above
    s[2, 0, rng.random(n_pools) < 0.9995] = -np.inf  # ~33 live keys, fewer than select_k
    s[2, 0, 7] = np.nan
    got = np.asarray(_reference(jnp.asarray(s), 3000))
    np.testing.assert_array_equal(got, _sorted_rule(s, 3000))
    assert (got[2] == -1).any() and (got[:2] >= 0).all()


@pytest.mark.parametrize("n_pools, count_dtype", [((1 << 24) - 1, jnp.float32), (1 << 24, jnp.int32)])
def test_counting_passes_count_in_float32_only_where_every_count_is_exact(n_pools, count_dtype):
    """``kth_largest_key`` sums its counting passes in float32 (faster on XLA:CPU) only for
    rows shorter than ``2**24``, where every partial count is an exact float32 integer; a
    longer row counts in int32. Traced only (no 16M-key row is built)."""
    row = jax.ShapeDtypeStruct((1, n_pools), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda key: kth_largest_key(key, 3))(row)
    loop = next(e for e in jaxpr.eqns if e.primitive.name in ("scan", "while"))  # the 32 passes
    body = loop.params.get("jaxpr") or loop.params["body_jaxpr"]
    sums = [e for e in body.jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert [e.outvars[0].aval.dtype for e in sums] == [count_dtype]


def test_long_row_multi_tile():
    """5,000 pools in 1,024-wide tiles: the last tile is partial; ties straddle tiles."""
    rng = np.random.default_rng(2)
    s = rng.integers(0, 40, size=(1, 1, 5000)).astype(np.float32)
    s[rng.random(s.shape) < 0.3] = -np.inf
    _check(s, 300, block_p=1024)


def test_rows_split_into_int32_addressable_launches(monkeypatch):
    """Past 2**31 elements, rows go in several launches (shrunk here to 3 rows each)."""
    monkeypatch.setattr(selection, "_MAX_FLAT_INDEX", 3 * (20 + 32))
    rng = np.random.default_rng(4)
    s = rng.integers(-2, 3, size=(2, 4, 20)).astype(np.float32)
    _check(s, 6)


def test_lax_baseline_shape():
    s = jnp.arange(12, dtype=jnp.float32).reshape(1, 1, 12)
    out = topk_pools_lax_baseline(s, 3)
    assert out.shape == (1, 1, 3)
    assert sorted(np.asarray(out).ravel().tolist()) == [9, 10, 11]


# -- the multi-program path (rows of >= 4 * split_p pools), forced onto small rows by a
# small split_p; jitted so each shape compiles once.

def _check_split(scores: np.ndarray, select_k: int, **block_sizes) -> np.ndarray:
    x = jnp.asarray(scores, jnp.float32)
    assert scores.shape[-1] >= 4 * block_sizes["split_p"]  # else it is the one-program path
    blocks = TopkPoolsBlockSizes(**block_sizes)
    fn = jax.jit(lambda s: topk_pools(s, select_k, implementation="pallas_interpret",
                                      block_sizes=blocks))
    got = np.asarray(fn(x))
    want = np.asarray(_reference(x, select_k))
    assert got.shape == want.shape == scores.shape[:-1] + (select_k,)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    return got


@st.composite
def _split_case(draw):
    blocks = draw(st.sampled_from([
        {"split_p": 4, "block_p": 4, "radix_bits": 8},
        {"split_p": 8, "block_p": 4, "radix_bits": 4},
        {"split_p": 8, "block_p": 8, "radix_bits": 8},
        {"split_p": 16, "block_p": 4, "radix_bits": 8},
        {"split_p": 4, "block_p": 2, "radix_bits": 2},
    ]))
    b = draw(st.integers(1, 2))
    q = draw(st.integers(1, 2))
    p = draw(st.integers(4 * blocks["split_p"], 4 * blocks["split_p"] + 40))
    k = draw(st.sampled_from([1, p // 3, p // 2, p - 1, p, draw(st.integers(1, p))]))
    seed = draw(st.integers(0, 2**32 - 1))
    mode = draw(st.sampled_from(["ties", "special", "mixed"]))
    return _draw_scores(mode, np.random.default_rng(seed), (b, q, p)), k, blocks


@settings(max_examples=8, deadline=None, derandomize=True)
@given(_split_case())
def test_multi_program_matches_reference(case):
    scores, select_k, blocks = case
    _check_split(scores, select_k, **blocks)


def test_multi_program_ties_at_threshold_across_segments():
    """The threshold value (1.0, with -0.0/+0.0 noise below) sits in several segments of 8;
    the lowest-indexed ones fill the row, so some segments take all of theirs, one part,
    the rest none."""
    s = np.full((1, 2, 64), -0.0, np.float32)
    s[..., ::2] = 0.0
    s[0, :, [5, 30, 63]] = 2.0
    s[0, :, [3, 10, 17, 25, 26, 40, 50]] = 1.0
    s[0, 1, 26] = np.nan  # row 1: one threshold pool fewer, so the ties reach further
    got = _check_split(s, 7, split_p=8, block_p=4, radix_bits=8)
    assert got[0, 0].tolist() == [3, 5, 10, 17, 25, 30, 63]
    assert got[0, 1].tolist() == [3, 5, 10, 17, 25, 30, 63]
    got = _check_split(s, 9, split_p=8, block_p=4)
    assert got[0, 0].tolist() == [3, 5, 10, 17, 25, 26, 30, 40, 63]
    assert got[0, 1].tolist() == [3, 5, 10, 17, 25, 30, 40, 50, 63]
    # all pools tie: the row is the first select_k pools, whatever the segments
    got = _check_split(np.zeros((2, 1, 37), np.float32), 20, split_p=8, block_p=8, radix_bits=8)
    assert (got == np.arange(20)).all()


def test_multi_program_all_neg_inf_and_partly_neg_inf_rows():
    s = np.full((1, 3, 40), -np.inf, np.float32)
    s[0, 1, :] = np.nan
    s[0, 2, [7, 33]] = [1.0, -3.0]  # two candidates only
    got = _check_split(s, 5, split_p=8, block_p=4, radix_bits=8)
    assert (got[0, :2] == -1).all()
    assert got[0, 2].tolist() == [7, 33, -1, -1, -1]


def test_multi_program_select_zero_and_all():
    rng = np.random.default_rng(5)
    s = rng.integers(-1, 2, size=(2, 1, 33)).astype(np.float32)
    s[1, 0, [0, 32]] = -np.inf
    got = _check_split(s, 33, split_p=8, block_p=8, radix_bits=8)
    assert got[0, 0].tolist() == list(range(33))
    assert got[1, 0].tolist() == list(range(1, 32)) + [-1, -1]
    assert _check_split(s, 0, split_p=8, block_p=8).shape == (2, 1, 0)


def test_multi_program_rows_split_into_int32_addressable_launches(monkeypatch):
    monkeypatch.setattr(selection, "_MAX_FLAT_INDEX", 2 * (36 + 4))
    rng = np.random.default_rng(6)
    s = rng.integers(-2, 3, size=(1, 3, 36)).astype(np.float32)
    _check_split(s, 10, split_p=8, block_p=4, radix_bits=8)


def _launches(shape, select_k=512, **block_sizes):
    lowered = lower_for_cuda(
        lambda s: topk_pools(s, select_k, implementation="pallas",
                             block_sizes=TopkPoolsBlockSizes(**block_sizes)),
        jax.ShapeDtypeStruct(shape, jnp.float32),
    )
    return [(c["name"], c["grid"], c["num_warps"], c["num_stages"]) for c in triton_calls(lowered)]


def _split_launches(rows, n_seg, radix_bits=4, warps=8, stages=2):
    count = ("topk_pools_count", (rows, n_seg, 1), warps, stages)
    return [count] * (32 // radix_bits) + [("topk_pools_compact", (rows, n_seg, 1), warps, stages)]


# Decode (Q=1) at 8K, 32K, 128K and 1M-token contexts (index_kpool 4), batch 1 and 8, and
# prefill tiles; rows of >= 4 * split_p (default 2,048) pools take the multi-program path:
# 8 counting launches (radix_bits 4) and one compaction, each of rows x P / 2,048 programs.
@pytest.mark.lowering
@pytest.mark.parametrize("shape, want", [
    ((1, 1, 2048), [("topk_pools", (1, 1, 1), 8, 2)]),
    ((1, 64, 2048), [("topk_pools", (64, 1, 1), 8, 2)]),
    ((1, 1, 8191), [("topk_pools", (1, 1, 1), 8, 2)]),
    ((1, 1, 8192), _split_launches(1, 4)),
    ((1, 1, 32768), _split_launches(1, 16)),
    ((1, 1, 262144), _split_launches(1, 128)),
    ((8, 1, 262144), _split_launches(8, 128)),
    ((1, 64, 32768), _split_launches(64, 16)),
])
def test_lowers_for_cuda(shape, want):
    assert _launches(shape) == want


def test_one_long_row_spreads_over_at_least_32_programs():
    """Batch-1 decode at 1M tokens (262,144 pools): every launch has >= 32 programs."""
    launches = _launches((1, 1, 262144))
    programs = [math.prod(grid) for _, grid, _, _ in launches]
    assert len(launches) == 9 and min(programs) >= 32, launches


@pytest.mark.lowering
def test_lowers_for_cuda_odd_width_and_all_radixes():
    for radix_bits, block_p in [(1, 2048), (2, 2048), (8, 256)]:
        assert _launches((2, 3, 1000), 300, radix_bits=radix_bits, block_p=block_p) == [
            ("topk_pools", (6, 1, 1), 8, 2)], (radix_bits, block_p)
        # the same rows on the multi-program path: 1000 pools in 8 segments of 128
        assert _launches(
            (2, 3, 1000), 300, radix_bits=radix_bits, block_p=block_p, split_p=128,
            num_warps=4, num_stages=1,
        ) == _split_launches(6, 8, radix_bits, 4, 1), (radix_bits, block_p)


def test_default_block_sizes_are_powers_of_two():
    blocks = TopkPoolsBlockSizes().resolve(1 << 20)
    for name in ("block_p", "radix_bits", "num_warps", "split_p"):
        value = getattr(blocks, name)
        assert value > 0 and value & (value - 1) == 0, name
    assert TopkPoolsBlockSizes().resolve(100_000).block_p == 1024
    assert TopkPoolsBlockSizes(radix_bits=8).resolve(100_000).block_p == 256


def test_radix_bits_8_shrinks_default_block():
    rng = np.random.default_rng(3)
    _check(rng.integers(-3, 3, size=(1, 1, 40)).astype(np.float32), 9, radix_bits=8)


@pytest.mark.parametrize("kwargs, name", [
    ({"block_p": 1000}, "block_p"),
    ({"block_p": 0}, "block_p"),
    ({"radix_bits": 3}, "radix_bits"),
    ({"radix_bits": 16}, "radix_bits"),
    ({"num_warps": 6}, "num_warps"),
    ({"num_stages": 0}, "num_stages"),
    ({"block_p": 1024, "radix_bits": 8}, "block_p"),
    ({"split_p": 1000}, "split_p"),
    ({"split_p": 0}, "split_p"),
    ({"split_p": 2.0}, "split_p"),
])
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_bad_block_sizes(kwargs, name, impl):
    with pytest.raises(ValueError, match=f"TopkPoolsBlockSizes.{name}"):
        topk_pools(jnp.zeros((1, 1, 8)), 2, implementation=impl,
                   block_sizes=TopkPoolsBlockSizes(**kwargs))


def test_bad_inputs():
    with pytest.raises(ValueError, match="float32"):
        topk_pools(jnp.zeros((1, 1, 8), jnp.bfloat16), 2, implementation="pallas_interpret")
    with pytest.raises(ValueError, match="select_k"):
        topk_pools(jnp.zeros((1, 1, 8)), 9, implementation="pallas_interpret")
    with pytest.raises(ValueError, match="rank"):
        topk_pools(jnp.zeros((1, 8)), 2, implementation="pallas_interpret")
