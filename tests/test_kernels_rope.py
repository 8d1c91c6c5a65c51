"""The kernels for the RoPE models (``glm_moe_dsa``: GLM-5 / GLM-5.2; ``deepseek_v32``):

* ``sparse_mla`` over latent rows ``[c, k_rot]`` (``CR = C + R`` wide) with the split score
  ``q_lat . c + q_rot . k_rot`` and values ``c`` (``value_width = C``): the Pallas kernel
  (interpret mode) against the reference, the reference against the dense oracle and
  against a float64 numpy computation of the split written out term by term, block sizes
  whose chunk straddles the value boundary, bad ``value_width``.
* The indexer kernels at ``kpool = 1`` without a tail (these models select tokens, not
  pools): ``kpool_compress`` is the identity on valid keys, ``index_scores`` /
  ``index_scores_paged`` score tokens, ``topk_pools`` takes ``select_k`` of a few hundred
  tokens on both of its paths, ``expand_selection`` is the identity on ids, and the whole
  chain selects numpy's top-k of HF's token scores.
* CUDA lowering (no GPU) of every kernel at GLM-5's and DeepSeek-V3.2's real shapes (their
  transformers 5.23.0 config defaults, checked here), a decode step and a prefill tile at a
  128K-token context, contiguous and paged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels._common import lower_for_cuda, triton_calls
from helpers import F32_VS_F64, SCORE_TIE

# ------------------------------------------------------------------------------------
# sparse_mla with a RoPE part
# ------------------------------------------------------------------------------------

C, R = 40, 8  # latent and RoPE widths at test scale: CR = 48, not a power of two
CR = C + R


def _rope_case(seed, b=2, nq=3, h=5, length=37, width=24, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, nq, h, CR)).astype(np.float32)
    lat = rng.standard_normal((b, length, CR)).astype(np.float32)
    lat[..., C:] *= 3.0  # a k_rot that moves the scores a lot
    ids = np.full((b, nq, width), -1, np.int32)
    for i in range(b):
        for j in range(nq):
            n = int(rng.integers(0, min(width, length) + 1))
            ids[i, j, :n] = np.sort(rng.choice(length, size=n, replace=False))
    ids[0, 0] = -1  # an empty row
    ids[-1, -1, -1] = length + 2  # an out-of-range id: not a token
    return jnp.asarray(q, dtype), jnp.asarray(lat, dtype), jnp.asarray(ids), (q, lat, ids)


def _np_split_attention(q, lat, ids, scale):
    """float64, written as the RoPE models do: ``q_lat . c + q_rot . k_rot``, values ``c``."""
    b, nq, h, _ = q.shape
    out = np.zeros((b, nq, h, C))
    for bi in range(b):
        for qi in range(nq):
            sel = [i for i in ids[bi, qi] if 0 <= i < lat.shape[1]]
            if not sel:
                continue
            c, k_rot = lat[bi, sel, :C].astype(np.float64), lat[bi, sel, C:].astype(np.float64)
            q_lat, q_rot = q[bi, qi, :, :C].astype(np.float64), q[bi, qi, :, C:].astype(np.float64)
            s = (q_lat @ c.T + q_rot @ k_rot.T) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[bi, qi] = (p / p.sum(-1, keepdims=True)) @ c
    return out


# Outputs are convex combinations of O(1) rows in float32 on both sides: a few ulps of
# difference in summation order (as in test_kernels_mla).
F32_TOL = dict(rtol=2e-5, atol=2e-6)


def test_reference_is_the_split_score_and_equals_the_dense_oracle():
    q, lat, ids, (q_np, lat_np, ids_np) = _rope_case(0)
    scale = 0.11
    ref = np.asarray(pk.sparse_mla_reference(q, lat, ids, scale=scale, value_width=C))
    assert ref.shape == (2, 3, 5, C)
    np.testing.assert_allclose(ref, _np_split_attention(q_np, lat_np, ids_np, scale), **F32_TOL)
    dense = pk.mla_masked_attention(q, lat, pk.topk_to_mask(ids, lat.shape[1]), scale=scale,
                                    value_width=C)
    np.testing.assert_allclose(ref, np.asarray(dense), **F32_TOL)
    # The RoPE columns really enter the score: without them the result moves by O(1).
    no_rope = pk.sparse_mla_reference(q[..., :C], lat[..., :C], ids, scale=scale)
    assert np.abs(np.asarray(no_rope) - ref).max() > 0.1


# block_c 16 (the default at CR = 48): the third chunk [32, 48) holds 8 value and 8 k_rot
# columns; 32: the second chunk [32, 64) holds 8 value, 8 k_rot and 16 padded columns; 64:
# one chunk holds all.
@pytest.mark.parametrize("block_c, num_splits", [(None, 1), (32, 3), (64, 2)])
def test_pallas_matches_reference_with_the_value_boundary_inside_a_chunk(block_c, num_splits):
    q, lat, ids, (q_np, lat_np, ids_np) = _rope_case(1)
    blocks = pk.SparseMlaBlockSizes(block_c=block_c, num_splits=num_splits, block_w=16)
    got = pk.sparse_mla(q, lat, ids, scale=0.11, value_width=C, implementation="pallas_interpret",
                        block_sizes=blocks)
    assert got.shape == (2, 3, 5, C) and got.dtype == jnp.float32
    got = np.asarray(got)
    np.testing.assert_array_equal(got[0, 0], 0.0)  # the empty row: zeros, not NaN
    want = np.asarray(pk.sparse_mla(q, lat, ids, scale=0.11, value_width=C, block_sizes=blocks))
    np.testing.assert_allclose(got, want, **F32_TOL)
    np.testing.assert_allclose(got, _np_split_attention(q_np, lat_np, ids_np, 0.11), **F32_TOL)


@pytest.mark.parametrize("value_width, num_splits", [(1, 2), (16, 1), (CR - 1, 2)])
def test_any_value_width(value_width, num_splits):
    q, lat, ids, _ = _rope_case(2, b=1, nq=2, h=3)
    got = pk.sparse_mla(q, lat, ids, scale=0.2, value_width=value_width,
                        implementation="pallas_interpret",
                        block_sizes=pk.SparseMlaBlockSizes(num_splits=num_splits, block_c=16))
    full = pk.sparse_mla_reference(q, lat, ids, scale=0.2)  # every column a value
    assert got.shape == (1, 2, 3, value_width)
    # Same scores and weights, so the value columns are the full output's first ones.
    np.testing.assert_allclose(np.asarray(got), np.asarray(full)[..., :value_width], **F32_TOL)


def test_value_width_cr_is_the_default():
    q, lat, ids, _ = _rope_case(3)
    for impl in ("xla", "pallas_interpret"):
        np.testing.assert_array_equal(
            np.asarray(pk.sparse_mla(q, lat, ids, scale=0.3, implementation=impl)),
            np.asarray(pk.sparse_mla(q, lat, ids, scale=0.3, value_width=CR, implementation=impl)))


def test_shared_pool_and_poisoned_rows():
    # The paged layout: one [1, L, CR] pool for every batch row. Unselected rows (k_rot
    # included) hold NaN: the kernel never reads them.
    q, lat, ids, (q_np, lat_np, ids_np) = _rope_case(4, b=2, length=40)
    pool = lat_np.reshape(1, -1, CR)  # sequence 1's rows follow sequence 0's
    slots = np.where(ids_np >= 0, ids_np + np.arange(2)[:, None, None] * 40, -1)
    slots[ids_np >= 40] = -1
    poisoned = np.full_like(pool, np.nan)
    used = np.unique(slots[slots >= 0])
    poisoned[0, used] = pool[0, used]
    got = np.asarray(pk.sparse_mla(q, jnp.asarray(poisoned), jnp.asarray(slots), scale=0.11,
                                   value_width=C, implementation="pallas_interpret",
                                   block_sizes=pk.SparseMlaBlockSizes(num_splits=2, block_c=16)))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _np_split_attention(q_np, lat_np, ids_np, 0.11), **F32_TOL)


def test_bf16_rope_rows():
    q, lat, ids, _ = _rope_case(5, h=16, dtype=jnp.bfloat16)
    got = pk.sparse_mla(q, lat, ids, scale=CR**-0.5, value_width=C, implementation="pallas_interpret")
    want = pk.sparse_mla_reference(q, lat, ids, scale=CR**-0.5, value_width=C)
    assert got.dtype == jnp.bfloat16 and got.shape[-1] == C
    # The kernel rounds the softmax weights to bf16 before p @ kv; both round the output:
    # a few bf16 ulps (2**-8 relative) on O(1) outputs, as in test_kernels_mla.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("bad", [0, -1, CR + 1, True, 2.5, "40"])
def test_bad_value_width_raises(impl, bad):
    q, lat, ids, _ = _rope_case(6, b=1, nq=1, h=1)
    with pytest.raises(ValueError, match=rf"value_width must be an int in \[1, CR={CR}\]"):
        pk.sparse_mla(q, lat, ids, scale=1.0, value_width=bad, implementation=impl)
    with pytest.raises(ValueError, match="value_width"):
        pk.mla_masked_attention(q, lat, pk.topk_to_mask(ids, lat.shape[1]), scale=1.0,
                                value_width=bad)


def test_query_and_row_widths_must_match():
    q, lat, ids, _ = _rope_case(7, b=1, nq=1, h=1)
    with pytest.raises(ValueError, match=r"latent must be \[B=1, L, CR=40\]"):
        pk.sparse_mla(q[..., :C], lat, ids, scale=1.0, value_width=C)


# ------------------------------------------------------------------------------------
# The indexer kernels at kpool 1, no tail
# ------------------------------------------------------------------------------------

IMPLS = ["xla", "pallas_interpret"]
D, HI = 24, 3  # indexer head dim and heads at test scale


def _tokens(seed, b=2, length=96, pad=(0, 7)):
    """Indexer keys of ``b`` sequences, the second left-padded (first_key 7)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((b, length, D)).astype(np.float32)
    valid = np.ones((b, length), bool)
    for i, p in enumerate(pad):
        valid[i, :p] = False
    return keys, valid, rng


@pytest.mark.parametrize("impl", IMPLS)
def test_kpool_compress_at_kpool_1_is_the_identity_on_valid_keys(impl):
    keys, valid, rng = _tokens(10)
    gate = rng.standard_normal(keys.shape).astype(np.float32) * 5  # any gate: one slot
    ape = rng.standard_normal((1, D)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        pooled, fk, pv = pk.kpool_compress(
            jnp.asarray(keys, dtype), jnp.asarray(gate), jnp.asarray(valid), jnp.asarray(ape, dtype),
            implementation=impl)
        np.testing.assert_array_equal(np.asarray(fk), [0, 7])
        assert pooled.shape == (2, 96, D) and pooled.dtype == dtype
        # Pool p of a row is token first_key + p: valid while inside the row, bit for bit
        # the key (softmax over one slot is exactly 1), zeros past the row's end.
        want = np.zeros_like(keys)
        want[0] = keys[0]
        want[1, :89] = keys[1, 7:]
        np.testing.assert_array_equal(np.asarray(pooled, np.float32),
                                      np.asarray(jnp.asarray(want, dtype), np.float32))
        np.testing.assert_array_equal(np.asarray(pv), [[True] * 96, [True] * 89 + [False] * 7])


def _token_scores_np(qi, w, keys, valid, q_pos):
    """HF's indexer score over tokens (``deepseek_v32`` / ``glm_moe_dsa``), float64:
    ``sum_h w * relu(q . k * D**-0.5)``, ``-inf`` where the token is padding or after the
    query."""
    s = np.einsum("bqhd,bld->bqhl", qi.astype(np.float64), keys.astype(np.float64)) * D**-0.5
    score = np.einsum("bqh,bqhl->bql", w.astype(np.float64), np.maximum(s, 0.0))
    tok = np.arange(keys.shape[1])
    ok = valid[:, None, :] & (tok[None, None, :] <= q_pos[:, :, None])
    return np.where(ok, score, -np.inf)


def _indexer_case(seed, nq=6):
    keys, valid, rng = _tokens(seed)
    qi = rng.standard_normal((2, nq, HI, D)).astype(np.float32)
    w = rng.standard_normal((2, nq, HI)).astype(np.float32)
    # Queries early in the row (fewer visible tokens than select_k), late ones and a
    # padding query (-1).
    q_pos = np.array([[0, 5, 30, 60, 95, -1], [3, 7, 20, 50, 95, 94]], np.int32)[:, :nq]
    return keys, valid, qi, w, q_pos


@pytest.mark.parametrize("impl", IMPLS)
def test_index_scores_at_kpool_1_are_token_scores(impl):
    keys, valid, qi, w, q_pos = _indexer_case(11)
    pooled, fk, pv = pk.kpool_compress_reference(
        jnp.asarray(keys), jnp.zeros(keys.shape), jnp.asarray(valid), jnp.zeros((1, D)))
    got = np.asarray(pk.index_scores(
        jnp.asarray(qi), jnp.asarray(w), pooled, pv, fk, jnp.asarray(q_pos), kpool=1,
        implementation=impl, block_sizes=pk.IndexScoresBlockSizes(block_q=2, block_p=16)))
    # Pool p of row b is token fk[b] + p: shift the token scores onto the pool grid.
    want = _token_scores_np(qi, w, keys, valid, q_pos)
    want[1] = np.concatenate([want[1][:, 7:], np.full((6, 7), -np.inf)], axis=1)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got, want, rtol=F32_VS_F64, atol=F32_VS_F64)


@pytest.mark.parametrize("impl", IMPLS)
def test_index_scores_paged_at_kpool_1_equal_contiguous(impl):
    # Pages of 8 tokens = 8 pools (PPP 8), sequence 1's pages shuffled in the pool.
    keys, valid, qi, w, q_pos = _indexer_case(12)
    valid[:] = True  # paged sequences start at 0
    q_pos[1, 1] = -1
    page = 8
    counts = np.array([96, 61], np.int32)  # sequence 1 has written 61 tokens
    pg = 96 // page
    order = np.random.default_rng(0).permutation(2 * pg)
    table = order.reshape(2, pg).astype(np.int32)
    pages = np.zeros((2 * pg, page, D), np.float32)
    for b in range(2):
        for j in range(pg):
            pages[table[b, j]] = keys[b, j * page:(j + 1) * page]
    table[1, 10:] = -1  # pages past the written tokens are not mapped
    blocks = pk.IndexScoresBlockSizes(block_q=2, block_p=16)
    got = np.asarray(pk.index_scores_paged(
        jnp.asarray(qi), jnp.asarray(w), jnp.asarray(pages), jnp.asarray(table),
        jnp.asarray(counts), jnp.asarray(q_pos), kpool=1, implementation=impl, block_sizes=blocks))
    tok = np.arange(96)
    pool_valid = tok[None, :] < counts[:, None]
    want = np.asarray(pk.index_scores(
        jnp.asarray(qi), jnp.asarray(w), jnp.asarray(keys), jnp.asarray(pool_valid),
        jnp.zeros((2,), jnp.int32), jnp.asarray(q_pos), kpool=1, implementation=impl,
        block_sizes=blocks))
    np.testing.assert_array_equal(got, want)


def _np_topk(scores, k):
    """numpy's top-k by (score desc, index asc), ascending ids, ``-1`` for ``-inf``."""
    out = np.full(scores.shape[:-1] + (k,), -1, np.int32)
    for idx in np.ndindex(scores.shape[:-1]):
        row = scores[idx]
        order = sorted(range(row.size), key=lambda p: (-row[p], p))[:k]
        taken = sorted(p for p in order if row[p] > -np.inf)
        out[idx][:len(taken)] = taken
    return out


# select_k relative to the row as 2048 is to a few thousand tokens: most of a short row,
# a small part of a long one; split_p 16 puts the 96-token row on the multi-program path.
@pytest.mark.parametrize("select_k, blocks", [
    (64, pk.TopkPoolsBlockSizes()), (32, pk.TopkPoolsBlockSizes(block_p=16)),
    (8, pk.TopkPoolsBlockSizes(block_p=16, split_p=16)),
], ids=["one-program", "one-program-tiles", "multi-program"])
def test_topk_over_tokens(select_k, blocks):
    keys, valid, qi, w, q_pos = _indexer_case(13)
    scores = _token_scores_np(qi, w, keys, valid, q_pos).astype(np.float32)
    scores[0, 3, 10:30] = 0.0  # a plateau of ReLU zeros at the cutoff
    want = _np_topk(scores, select_k)
    for impl in IMPLS:
        got = np.asarray(pk.topk_pools(jnp.asarray(scores), select_k, implementation=impl,
                                       block_sizes=blocks))
        np.testing.assert_array_equal(got, want)
    # The paged path's live bound: tokens at or past n_live are never taken.
    n_live = np.array([40, 96], np.int32)
    got = np.asarray(pk.topk_pools(jnp.asarray(scores), select_k, n_live=jnp.asarray(n_live),
                                   implementation="pallas_interpret", block_sizes=blocks))
    cut = np.where(np.arange(96)[None, None, :] < n_live[:, None, None], scores, -np.inf)
    np.testing.assert_array_equal(got, _np_topk(cut.astype(np.float32), select_k))


@pytest.mark.parametrize("impl", IMPLS)
def test_expand_selection_at_kpool_1_without_tail_is_the_identity(impl):
    rng = np.random.default_rng(14)
    b, nq, k = 2, 5, 40
    ids = np.full((b, nq, k), -1, np.int32)
    for i in range(b):
        for j in range(nq):
            n = int(rng.integers(0, k + 1))
            ids[i, j, :n] = np.sort(rng.choice(300, size=n, replace=False))
    for out_width in (k, k + 9):
        blocks = pk.ExpandSelectionBlockSizes(block_q=2, block_w=16)
        # Row 0 starts at token 0: its ids are the pool ids themselves; row 1 is
        # left-padded (first_key 7): pool p is token 7 + p.
        fk = np.array([0, 7], np.int32)
        got = np.asarray(pk.expand_selection(
            jnp.asarray(ids), jnp.asarray(fk), None, kpool=1, out_width=out_width,
            implementation=impl, block_sizes=blocks))
        want = np.full((b, nq, out_width), -1, np.int32)
        want[..., :k] = np.where(ids >= 0, ids + fk[:, None, None], -1)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got[0, :, :k], ids[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_kpool_1_chain_selects_the_top_tokens(impl):
    """kpool_compress -> index_scores -> topk_pools -> expand_selection at kpool 1 without a
    tail select, per query, the top-k tokens of HF's token scores (token ids, ascending)."""
    keys, valid, qi, w, q_pos = _indexer_case(15)
    select_k = 32
    pooled, fk, pv = pk.kpool_compress(
        jnp.asarray(keys), jnp.zeros(keys.shape), jnp.asarray(valid), jnp.zeros((1, D)),
        implementation=impl)
    scores = pk.index_scores(jnp.asarray(qi), jnp.asarray(w), pooled, pv, fk, jnp.asarray(q_pos),
                             kpool=1, implementation=impl)
    pools = pk.topk_pools(scores, select_k, implementation=impl)
    got = np.asarray(pk.expand_selection(pools, fk, None, kpool=1, out_width=select_k,
                                         implementation=impl))
    # Exactly the top-k of the chain's own scores put back on the token axis ...
    on_tokens = np.full((2, 6, 96), -np.inf, np.float32)
    for b, f in enumerate(np.asarray(fk)):
        on_tokens[b, :, f:] = np.asarray(scores)[b, :, :96 - f]
    np.testing.assert_array_equal(got, _np_topk(on_tokens, select_k))
    # ... which are a valid top-k of HF's float64 token scores (tie-aware: every selected
    # token scores at least every visible unselected one, to float32 rounding).
    hf = _token_scores_np(qi, w, keys, valid, q_pos)
    for b in range(2):
        for t in range(6):
            sel = got[b, t][got[b, t] >= 0]
            visible = np.flatnonzero(hf[b, t] > -np.inf)
            assert len(sel) == min(select_k, len(visible))
            rest = np.setdiff1d(visible, sel)
            if len(sel) and len(rest):
                assert hf[b, t, sel].min() >= hf[b, t, rest].max() - SCORE_TIE
    assert (got[0, 5] == -1).all()  # the padding query selects nothing
    assert (got[0, 0] >= 0).sum() == 1 and (got[1, 0] == -1).all()  # one visible / none


# ------------------------------------------------------------------------------------
# CUDA lowering at the real shapes of GLM-5 and DeepSeek-V3.2
# ------------------------------------------------------------------------------------

# transformers 5.23.0 GlmMoeDsaConfig / DeepseekV32Config defaults (the published models'
# dims; test_model_dims_are_hf_defaults checks them). Both select tokens: kpool 1, no tail.
MODELS = {
    "glm5": dict(hf="GlmMoeDsaConfig", hidden_size=6144, num_attention_heads=64,
                 q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
                 v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048),
    "dsv32": dict(hf="DeepseekV32Config", hidden_size=7168, num_attention_heads=128,
                  q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                  v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048),
}
CONTEXT = 131072
PAGE = 64
STEPS = {"decode-b1": (1, 1), "decode-b8": (8, 1), "prefill-q64": (1, 64)}
SDS = jax.ShapeDtypeStruct
BF16, I32 = jnp.bfloat16, jnp.int32


@pytest.mark.parametrize("model", sorted(MODELS))
def test_model_dims_are_hf_defaults(model):
    transformers = pytest.importorskip("transformers")
    dims = dict(MODELS[model])
    hf = getattr(transformers, dims.pop("hf"))()
    assert {k: getattr(hf, k) for k in dims} == dims


def _calls(fn, *avals):
    return [(c["name"], c["grid"]) for c in triton_calls(lower_for_cuda(fn, *avals))]


_CASES = [pytest.param(m, s, id=f"{m}-{s}") for m in sorted(MODELS) for s in STEPS]


@pytest.mark.lowering
@pytest.mark.parametrize("model, step", _CASES)
def test_indexer_kernels_lower_for_cuda(model, step):
    m = MODELS[model]
    b, nq = STEPS[step]
    hi, d, k = m["index_n_heads"], m["index_head_dim"], m["index_topk"]
    # kpool_compress over a chunk's window (kpool 1: the keys themselves), 32 pools of 128
    # channels a program.
    window = nq + 1
    per = pk.KpoolCompressBlockSizes().resolve(window, d).block_pools
    assert _calls(lambda x, g, v, a: pk.kpool_compress(x, g, v, a, implementation="pallas"),
                  SDS((b, window, d), BF16), SDS((b, window, d), jnp.float32),
                  SDS((b, window), jnp.bool_), SDS((1, d), BF16)) == [
        ("kpool_compress", (b, -(-window // per), 1))]
    # index_scores: every token of the context is a pool; tiles of <= 16 queries x 64.
    assert _calls(lambda q, w, p, pv, fk, qp: pk.index_scores(
        q, w, p, pv, fk, qp, kpool=1, implementation="pallas"),
        SDS((b, nq, hi, d), BF16), SDS((b, nq, hi), jnp.float32), SDS((b, CONTEXT, d), BF16),
        SDS((b, CONTEXT), jnp.bool_), SDS((b,), I32), SDS((b, nq), I32)) == [
        ("index_scores", (-(-nq // 16), b, CONTEXT // 64))]
    # ... paged: pages of 64 tokens are 64 pools.
    pg = CONTEXT // PAGE
    assert _calls(lambda q, w, pages, bt, n, qp: pk.index_scores_paged(
        q, w, pages, bt, n, qp, kpool=1, implementation="pallas"),
        SDS((b, nq, hi, d), BF16), SDS((b, nq, hi), jnp.float32), SDS((b * pg, PAGE, d), BF16),
        SDS((b, pg), I32), SDS((b,), I32), SDS((b, nq), I32)) == [
        ("index_scores_paged", (-(-nq // 16), b, CONTEXT // 64))]
    # topk_pools: 2048 of 131072 tokens, the multi-program path (64 segments of 2048),
    # 8 counting launches and one compaction, bounded by n_live or not.
    rows = b * nq
    want = [("topk_pools_count", (rows, 64, 1))] * 8 + [("topk_pools_compact", (rows, 64, 1))]
    assert _calls(lambda s: pk.topk_pools(s, k, implementation="pallas"),
                  SDS((b, nq, CONTEXT), jnp.float32)) == want
    assert _calls(lambda s, n: pk.topk_pools(s, k, n_live=n, implementation="pallas"),
                  SDS((b, nq, CONTEXT), jnp.float32), SDS((b, nq), I32)) == want
    # expand_selection: kpool 1, no tail, out_width = index_topk.
    assert _calls(lambda p, fk: pk.expand_selection(p, fk, None, kpool=1, out_width=k,
                                                    implementation="pallas"),
                  SDS((b, nq, k), I32), SDS((b,), I32)) == [
        ("expand_selection", (b, -(-nq // 4), 1))]


@pytest.mark.lowering
@pytest.mark.parametrize("model, step", _CASES)
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_sparse_mla_lowers_for_cuda(model, step, cache):
    m = MODELS[model]
    b, nq = STEPS[step]
    h, c = m["num_attention_heads"], m["kv_lora_rank"]
    cr = c + m["qk_rope_head_dim"]  # 576: [c, k_rot]
    k = m["index_topk"]
    scale = (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]) ** -0.5
    if model == "dsv32":  # the published checkpoint's YaRN: factor 40, mscale_all_dim 1
        scale *= (0.1 * math.log(40) + 1.0) ** 2
    latent = (1, b * CONTEXT, cr) if cache == "paged" else (b, CONTEXT, cr)
    lowered = lower_for_cuda(
        lambda q, lat, ids: pk.sparse_mla(q, lat, ids, scale=scale, value_width=c,
                                          implementation="pallas"),
        SDS((b, nq, h, cr), BF16), SDS(latent, BF16), SDS((b, nq, k), I32))
    assert lowered.out_info.shape == (b, nq, h, c)
    blocks = pk.SparseMlaBlockSizes().resolve((b, nq, h, cr), k)
    assert blocks.block_c == 64  # 9 chunks of the 576-wide row, 8 of them values
    call, *combine = triton_calls(lowered)
    assert (call["name"], call["grid"]) == ("sparse_mla",
                                           (b * nq * h // blocks.block_h, blocks.num_splits, 1))
    # A split row's partials are merged by a second launch: (rows x head blocks, c / 128).
    assert [(x["name"], x["grid"]) for x in combine] == (
        [("sparse_mla_combine", (b * nq * h // blocks.block_h, c // 128, 1))]
        if blocks.num_splits > 1 else [])
