"""Fixed (hand-built, not random) cases of every kernel against its reference.

The hypothesis tests draw scores of small whole numbers, so most of their keys end in the
same low bits: a radix select that skips its last counting pass, or a split merge that
weighs its partial sums wrongly, passed every fixed test before this file and was caught
only by a lucky random draw. The cases here are built so that each such bug fails
deterministically:

* ``topk_pools``: rows whose ``select_k``-th and ``(select_k+1)``-th keys differ in exactly
  one bit, for *every* bit of the 31 value bits (so every digit of every radix pass
  decides the threshold somewhere), on both signs, plus ``-0.0``/denormals (one key with
  ``+0``), NaN (never selected) and ties broken by pool index. The expected rows come from
  a plain numpy sort of the keys, independent of both kernel and reference.
* ``sparse_mla``: rows split over several shares (``num_splits``) whose maxima differ by
  tens of units of the logit, so any merge that does not rescale each share by
  ``exp(m_share - m_max)`` is far off; checked against a dense numpy softmax too.
* ``kpool_compress``, ``index_scores``, ``expand_selection``: one fixed case each with
  negative values, gaps in the mask and edge positions.

Mutants tried, each of which fails this file: the radix select with its last counting pass
dropped (``32 // radix_bits - 1`` passes); the compaction taking one tie too many
(``eq_rank <= n_take_eq``); ``_combine_splits_kernel`` weighing every share by 1, or by
``exp(m_max - m)``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from helpers import F32_VS_F64


# ------------------------------------------------------------------------- topk_pools
def _np_key(x: np.ndarray) -> np.ndarray:
    """The documented order key in numpy: -0/denormals -> +0, NaN -> -inf, sign-folded."""
    bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    mag = bits & 0x7FFFFFFF
    bits = np.where(mag < 0x00800000, 0, bits)
    bits = np.where(mag > 0x7F800000, np.int64(np.float32(-np.inf).view(np.int32)), bits)
    return np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _np_from_key(key: np.ndarray) -> np.ndarray:
    """Inverse of ``_np_key`` on normal floats."""
    key = np.asarray(key, np.int64)
    bits = np.where(key < 0, key ^ 0x7FFFFFFF, key).astype(np.int32)
    return bits.view(np.float32)


def _np_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Oracle: sort by (key desc, index asc), drop -inf/NaN, ascending ids, -1 pad."""
    neg_inf = _np_key(np.float32(-np.inf))
    out = np.full(scores.shape[:-1] + (k,), -1, np.int32)
    for idx in np.ndindex(scores.shape[:-1]):
        key = _np_key(scores[idx])
        order = sorted(range(key.size), key=lambda p: (-key[p], p))[:k]
        ids = sorted(p for p in order if key[p] > neg_inf)
        out[idx][: len(ids)] = ids
    return out


def _one_bit_rows() -> tuple[np.ndarray, int]:
    """One row per (value bit, sign): the k-th and (k+1)-th largest keys differ in that bit
    only, with the rest of the row above and below them (and decoys sharing the prefix)."""
    k, rows = 5, []
    for sign in (1, -1):
        for bit in range(31):
            # key = high part | the bit | low part, every key a normal float's
            low = 0x3F5A5A5A & ((1 << bit) - 1)
            if bit >= 24 and low < 0x00800000:  # keep it a normal float
                low |= 0x00800000
            high = 0x3F000000 & ~((1 << (bit + 1)) - 1) if bit < 24 else 0
            lo_key, hi_key = high | low, high | (1 << bit) | low
            if sign < 0:  # the same gap among negative scores (key -x-1 = ~x)
                lo_key, hi_key = ~hi_key, ~lo_key
            keys = [hi_key + 0, lo_key, lo_key]  # the threshold and two ties just below
            keys += [hi_key + 1 + j for j in range(4)]  # above
            keys += [lo_key - 1 - j for j in range(3)]  # below
            row = _np_from_key(np.array(keys, np.int64))
            # interleave so the threshold is not simply at one end of the row
            perm = np.array([3, 0, 8, 1, 5, 9, 2, 4, 7, 6])
            rows.append(row[perm])
    return np.stack(rows)[None], k


def _special_rows() -> tuple[np.ndarray, int]:
    """-0.0 vs +0.0 vs denormals (one key), NaN of both signs, -inf, ties by index, and
    scores equal in their top bits (adjacent floats)."""
    den = np.float32(1e-45)
    one = np.float32(1.0)
    adj = np.nextafter(one, np.float32(2.0))
    rows = [
        [-0.0, 0.0, den, -den, 0.0, -1.0, np.nan, -np.nan, -np.inf, -0.0, 1e-40, -3.0],
        [one, adj, one, np.nextafter(adj, np.float32(2.0)), adj, one, -np.inf, np.nan,
         -1.0, np.nextafter(np.float32(-1.0), np.float32(0.0)), -1.0, 0.5],
        [-1.5, -1.5, np.nextafter(np.float32(-1.5), np.float32(0.0)), -2.0, -np.inf,
         -1.5, -3.0, -np.inf, np.nan, -1.4, -1.5, -1.6],
        [np.nan] * 4 + [-np.inf] * 4 + [-0.0, 2.0, -0.0, np.nan],  # fewer candidates than k
        # more ties at the threshold than fit, before the larger keys in pool order
        [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 0.0, -np.inf, np.nan, 1.0, -0.0],
    ]
    return np.array(rows, np.float32)[None], 5


_TOPK_BLOCKS = [{}] + [
    {"radix_bits": r, "block_p": 4} for r in (1, 2, 8)
]


@pytest.mark.parametrize("blocks", _TOPK_BLOCKS, ids=lambda b: ",".join(f"{k}={v}" for k, v in b.items()) or "default")
@pytest.mark.parametrize("case", [_one_bit_rows, _special_rows])
def test_topk_fixed_rows(case, blocks):
    scores, k = case()
    want = _np_topk(scores, k)
    x = jnp.asarray(scores)
    np.testing.assert_array_equal(np.asarray(pk.topk_pools_reference(x, k)), want)
    got = np.asarray(pk.topk_pools(x, k, implementation="pallas_interpret",
                                   block_sizes=pk.TopkPoolsBlockSizes(**blocks)))
    np.testing.assert_array_equal(got, want)


def test_one_bit_rows_are_what_they_claim():
    # The case generator itself: in every row the 5th and 6th keys differ in exactly one
    # bit, and that bit runs over all 31 value bits on both signs.
    scores, k = _one_bit_rows()
    seen = set()
    for row, sign_bit in zip(scores[0], [0] * 31 + [1] * 31):
        key = np.sort(_np_key(row))[::-1]
        diff = int(key[k - 1]) ^ int(key[k])
        assert diff and diff & (diff - 1) == 0, (key[k - 1], key[k])
        seen.add((sign_bit, diff.bit_length() - 1))
    assert seen == {(s, b) for s in (0, 1) for b in range(31)}


# ------------------------------------------------------------------------- sparse_mla
# Tolerance against the float64 oracle (``helpers.F32_VS_F64``: logits reach ~30 here,
# measured up to 1.5e-6), while a wrongly weighted merge is off by O(0.1-1).
MLA_TOL = dict(rtol=F32_VS_F64, atol=F32_VS_F64)


def _np_attention(q, lat, ids, scale):
    b, nq, h, _ = q.shape
    out = np.zeros(q.shape, np.float64)
    for bi in range(b):
        for qi in range(nq):
            sel = [i for i in ids[bi, qi] if 0 <= i < lat.shape[1]]
            if not sel:
                continue
            kv = lat[bi, sel].astype(np.float64)
            s = q[bi, qi].astype(np.float64) @ kv.T * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[bi, qi] = (p / p.sum(-1, keepdims=True)) @ kv
    return out


@pytest.mark.parametrize("num_splits", [2, 3, 4])
def test_sparse_mla_split_merge_with_very_different_maxima(num_splits):
    # 64 ids in 4 blocks of 16: every split gets at least one block. The latent rows of
    # each block are scaled so its largest logit differs from the next block's by ~tens:
    # a merge that does not rescale each share by exp(m_share - m_max) is off by O(1).
    b, nq, h, c, width = 1, 2, 3, 16, 64
    rng = np.random.default_rng(0)
    q = np.ones((b, nq, h, c), np.float32)
    q[:, :, 1] *= -1.0  # one head with inverted logits: its maximum sits in another block
    q[:, 1, 2] = np.linspace(-1, 1, c)
    lat = (rng.standard_normal((b, width, c)) * 0.1).astype(np.float32)
    block_scale = np.repeat(np.array([0.2, 3.0, 1.0, 6.0], np.float32), 16)
    lat = lat + block_scale[None, :, None] * 0.3
    ids = np.tile(np.arange(width, dtype=np.int32), (b, nq, 1))
    ids[0, 1, ::7] = -1  # a few holes in the second query's row
    scale = 1.0
    want = _np_attention(q, lat, ids, scale)
    # The logit maxima of the four blocks really differ widely (per head 0).
    logits = (q[0, 0, 0] @ lat[0].T).reshape(4, 16).max(-1)
    assert np.ptp(logits) > 20
    ref = np.asarray(pk.sparse_mla_reference(jnp.asarray(q), jnp.asarray(lat), jnp.asarray(ids), scale=scale))
    np.testing.assert_allclose(ref, want, **MLA_TOL)
    got = np.asarray(pk.sparse_mla(jnp.asarray(q), jnp.asarray(lat), jnp.asarray(ids), scale=scale,
                                   implementation="pallas_interpret",
                                   block_sizes=pk.SparseMlaBlockSizes(num_splits=num_splits, block_w=16)))
    np.testing.assert_allclose(got, want, **MLA_TOL)


def test_sparse_mla_one_split_empty_others_not():
    # Split 0 sees only -1 ids (m = -inf, l = 0); the merge must give it weight 0, not NaN.
    b, nq, h, c, width = 1, 1, 2, 16, 64
    rng = np.random.default_rng(1)
    q = rng.standard_normal((b, nq, h, c)).astype(np.float32) * 3
    lat = rng.standard_normal((b, 40, c)).astype(np.float32)
    ids = np.full((b, nq, width), -1, np.int32)
    ids[0, 0, 40:] = np.arange(24) + 10
    ids[0, 0, 20] = 5  # one valid id in the first half too: n_end is past block 3
    want = _np_attention(q, lat, ids, 1.0)
    got = np.asarray(pk.sparse_mla(jnp.asarray(q), jnp.asarray(lat), jnp.asarray(ids), scale=1.0,
                                   implementation="pallas_interpret",
                                   block_sizes=pk.SparseMlaBlockSizes(num_splits=4, block_w=16)))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, **MLA_TOL)


# ------------------------------------------------------------- the other three kernels
def test_kpool_compress_fixed_negative_gates_and_gaps():
    d = 3  # kpool is ape's 4 rows
    keys = np.arange(2 * 14 * d, dtype=np.float32).reshape(2, 14, d) * np.float32(-0.25) + 3
    gate = np.zeros((2, 14, d), np.float32)
    gate[..., 0] = -50.0  # a very negative gate: its softmax weight is ~0 unless alone
    gate[0, 5] = 30.0
    valid = np.ones((2, 14), bool)
    valid[0, :2] = False  # left padding: the pool grid starts at slot 2
    valid[1, 6] = False  # a gap inside a pool
    ape = np.array([[1, -1, 0.5], [0, 0, 0], [-2, 2, 0], [0.25, 0.25, 0.25]], np.float32)
    args = [jnp.asarray(a) for a in (keys, gate, valid, ape)]
    want = pk.kpool_compress(*args)
    got = pk.kpool_compress(*args, implementation="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    assert int(want[1][0]) == 2 and int(want[1][1]) == 0


def test_index_scores_fixed_signs_and_visibility():
    kp, d, n_pools = 2, 3, 5  # Hi = 2 heads
    q = np.array([[[[1, -2, 0.5], [-1, 0, 3]], [[0, 0, 0], [2, 2, -2]], [[-1, 1, -1], [0.5, 0.5, 0.5]]]],
                 np.float32)  # [B=1, Q=3, Hi, D]
    w = np.array([[[1.0, -1.0], [0.5, 0.5], [-2.0, 1.0]]], np.float32)
    pooled = np.linspace(-2, 2, n_pools * d, dtype=np.float32).reshape(1, n_pools, d)
    pool_valid = np.array([[True, True, False, True, True]])
    first_key = np.array([1], np.int32)
    q_pos = np.array([[4, 10, -1]], np.int32)  # sees 1-2 pools, all 5, and a padding query
    args = [jnp.asarray(a) for a in (q, w, pooled, pool_valid, first_key, q_pos)]
    want = np.asarray(pk.index_scores(*args, kpool=kp))
    got = np.asarray(pk.index_scores(*args, kpool=kp, implementation="pallas_interpret"))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isneginf(want[0, 2]).all() and np.isneginf(want[0, :, 2]).all()
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)


def test_expand_selection_fixed():
    kp, width = 3, 3 * 3 + 2
    pools = np.array([[[0, 2, -1], [-1, -1, -1], [1, 3, 4]]], np.int32)
    first_key = np.array([2], np.int32)
    tail = np.array([[[20, -1], [-1, -1], [17, 18]]], np.int32)
    args = [jnp.asarray(a) for a in (pools, first_key, tail)]
    want = np.asarray(pk.expand_selection_reference(*args, kpool=kp, out_width=width))
    got = np.asarray(pk.expand_selection(*args, kpool=kp, out_width=width, implementation="pallas_interpret"))
    np.testing.assert_array_equal(got, want)
    assert want[0, 0, :6].tolist() == [2, 3, 4, 8, 9, 10]
    assert (want[0, 1] == -1).all()
