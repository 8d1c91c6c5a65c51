"""The kernels over the paged cache's layout, in interpret mode at small shapes.

* ``sparse_mla`` over a shared latent pool ``[1, L, C]`` (``token_ids`` are physical slots)
  equals the same call over a per-row broadcast copy ``[B, L, C]``, bit for bit, for the
  reference and the kernel, one split and several; a slot no row names may hold NaN.
* ``index_scores_paged``: sequences laid out in a shared page pool through random block
  tables (pages permuted, interleaved between sequences, ``-1`` past each sequence's pages)
  score exactly as ``index_scores`` scores the same pools laid out contiguously (reference
  vs reference, kernel vs kernel, bit for bit); the reference *is*
  ``index_scores_reference`` on the gathered rows. Pages no sequence owns and the pool
  slots of owned pages past ``pool_counts`` hold NaN and change nothing; a sequence with 0
  pools (and a padding query) scores ``-inf`` everywhere.
* ``topk_pools(..., n_live=)``: bit-identical to the reference with the pools past
  ``n_live`` set to ``-inf``, on the one-program and the segmented path, with ``n_live``
  ``[B, Q]`` and ``[B]``; pools past ``n_live`` hold the row's largest scores, so reading
  one would change the result.
* CUDA lowering (no GPU; ``lower_for_cuda`` works on jax 0.10 and >= 0.11) of the three at
  the GLM-5.3-Flash shapes for a 128K-token capacity in pages of 64 tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from pallas_kernels._common import lower_for_cuda, triton_calls

import pallas_kernels as pk
from pallas_kernels.attention import SparseMlaBlockSizes, sparse_mla
from pallas_kernels.selection import mask_past_live


# ---------------------------------------------------------------------------------------
# sparse_mla over a shared latent pool
# ---------------------------------------------------------------------------------------


def _slot_rows(rng, b, nq, width, slots):
    """Distinct slot ids per row (prefix of valid ids, then -1), each row from its own
    random subset of ``slots``."""
    ids = np.full((b, nq, width), -1, np.int32)
    for i in range(b):
        for j in range(nq):
            n = int(rng.integers(0, min(width, len(slots)) + 1))
            ids[i, j, :n] = rng.choice(slots, size=n, replace=False)
    return ids


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_shared_latent_equals_broadcast_copy(impl, num_splits):
    rng = np.random.default_rng(10)
    b, nq, h, c, length, width = 3, 2, 4, 40, 48, 21
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    pool = rng.standard_normal((1, length, c)).astype(np.float32)
    named = np.sort(rng.choice(length, size=30, replace=False))
    ids = _slot_rows(rng, b, nq, width, named)
    ids[0, 0] = -1  # an empty row
    ids[2, 1, 3] = length + 2  # out of range: not a slot
    blocks = SparseMlaBlockSizes(num_splits=num_splits, block_w=16)
    run = lambda lat: np.asarray(sparse_mla(
        q, jnp.asarray(lat), jnp.asarray(ids), scale=0.2, implementation=impl,
        block_sizes=blocks,
    ))
    want = run(np.broadcast_to(pool, (b, length, c)))
    np.testing.assert_array_equal(run(pool), want)
    assert np.isfinite(want).all() and (want[0, 0] == 0).all()
    if impl != "xla":
        # The kernel reads only the slots a row names (the reference reads the clamped slot
        # 0 of an empty slot, so it is held to this only where slot 0 is named).
        poisoned = pool.copy()
        unnamed = np.setdiff1d(np.arange(length), ids[ids >= 0])
        poisoned[0, unnamed] = np.nan
        np.testing.assert_array_equal(run(poisoned), want)


def test_latent_batch_must_be_one_or_b():
    q = jnp.zeros((3, 1, 4, 16), jnp.float32)
    ids = jnp.zeros((3, 1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"latent must be \[B=3, L, CR=16\] or shared \[1, L"):
        sparse_mla(q, jnp.zeros((2, 8, 16), jnp.float32), ids, scale=1.0)


# ---------------------------------------------------------------------------------------
# index_scores_paged
# ---------------------------------------------------------------------------------------

KP, PPP, PG, D, HI = 2, 4, 6, 20, 3  # page_size 8; rows of 24 pools


def _paged_case(rng, b, nq, n_pages, counts, dtype=np.float32):
    """Contiguous pooled keys ``[B, PG*PPP, D]`` and the same keys in a shared page pool
    ``[N, PPP, D]`` through a random block table (sequence ``b`` owns ``ceil(counts[b] /
    PPP)`` pages, drawn without replacement from a permutation of the pool); every slot not
    written (pages nobody owns, slots of owned pages past ``counts[b]``) holds NaN."""
    contiguous = rng.standard_normal((b, PG * PPP, D)).astype(dtype)
    pages = np.full((n_pages, PPP, D), np.nan, dtype)
    table = np.full((b, PG), -1, np.int32)
    order = iter(rng.permutation(n_pages))
    for i in range(b):
        for j in range(-(-int(counts[i]) // PPP)):
            table[i, j] = next(order)
            n = min(PPP, int(counts[i]) - j * PPP)
            pages[table[i, j], :n] = contiguous[i, j * PPP:j * PPP + n]
    q = rng.standard_normal((b, nq, HI, D)).astype(dtype)
    w = rng.standard_normal((b, nq, HI)).astype(np.float32)
    # Positions up to each sequence's length (a pool count's tokens plus a partial pool),
    # a padding query (-1) in row 0.
    q_pos = np.stack([rng.integers(-1, int(c) * KP + KP, size=nq) for c in counts])
    q_pos[0, 0] = -1
    return [jnp.asarray(x) for x in (q, w, contiguous, pages, table, np.asarray(counts, np.int32),
                                     q_pos.astype(np.int32))]


def _contiguous_scores(q, w, contiguous, counts, q_pos, **kw):
    """``index_scores`` over the contiguous layout (``first_key`` 0, pools below the count
    valid); the NaN-free rows past a count are never candidates."""
    pool_valid = jnp.arange(contiguous.shape[1])[None, :] < counts[:, None]
    first_key = jnp.zeros(counts.shape, jnp.int32)
    return pk.index_scores(q, w, contiguous, pool_valid, first_key, q_pos, kpool=KP, **kw)


# Several query tiles and pool tiles (block_q 2, block_p 16 over 24 pools), so dead tiles
# (past a row's count or its queries' reach) and live ones meet in one launch.
_BLOCKS = pk.IndexScoresBlockSizes(block_q=2, block_p=16)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_paged_scores_equal_contiguous_scores(impl, dtype):
    rng = np.random.default_rng(20)
    counts = [13, 24, 0, 5]  # a partial last page, a full row, an empty sequence, one page
    q, w, contiguous, pages, table, counts, q_pos = _paged_case(rng, 4, 3, 16, counts, dtype)
    got = pk.index_scores_paged(q, w, pages, table, counts, q_pos, kpool=KP,
                                implementation=impl, block_sizes=_BLOCKS)
    want = _contiguous_scores(q, w, contiguous, counts, q_pos, implementation=impl,
                              block_sizes=_BLOCKS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    got = np.asarray(got)
    assert (got[2] == -np.inf).all() and (got[0, 0] == -np.inf).all()
    assert np.isfinite(got).any() and not np.isnan(got).any()
    if impl == "xla":
        np.testing.assert_array_equal(got, np.asarray(pk.index_scores_paged_reference(
            q, w, pages, table, counts, q_pos, kpool=KP)))


def test_paged_reference_is_index_scores_reference_on_gathered_rows():
    rng = np.random.default_rng(21)
    q, w, _, pages, table, counts, q_pos = _paged_case(rng, 3, 4, 12, [9, 17, 2])
    pages = jnp.where(jnp.isnan(pages), 7.0, pages)  # the gathered rows, read whole here
    gathered = pk.gather_pools(pages, table)
    np_gathered = np.zeros((3, PG * PPP, D), np.float32)
    for i, j in np.ndindex(3, PG):
        if table[i, j] >= 0:
            np_gathered[i, j * PPP:(j + 1) * PPP] = np.asarray(pages)[int(table[i, j])]
    np.testing.assert_array_equal(np.asarray(gathered), np_gathered)
    owned = jnp.repeat(table >= 0, PPP, axis=1)
    pool_valid = owned & (jnp.arange(PG * PPP)[None, :] < counts[:, None])
    want = pk.index_scores_reference(q, w, gathered, pool_valid, jnp.zeros(3, jnp.int32), q_pos,
                                     kpool=KP)
    got = pk.index_scores_paged(q, w, pages, table, counts, q_pos, kpool=KP)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unowned_pages_and_out_of_range_entries_are_not_read():
    # Every page but the ones the table names holds NaN, and row 1's table names a page
    # past the pool (1000) and holes (-1) below its count: those pools are no candidates,
    # and nothing NaN reaches a score.
    rng = np.random.default_rng(22)
    q, w, contiguous, pages, table, counts, q_pos = _paged_case(rng, 2, 2, 10, [10, 12])
    table = np.asarray(table).copy()
    table[1, 1], table[1, 2] = -1, 1000
    q_pos = jnp.full_like(q_pos, 40)
    for impl in ("xla", "pallas_interpret"):
        got = np.asarray(pk.index_scores_paged(q, w, pages, jnp.asarray(table), counts, q_pos,
                                               kpool=KP, implementation=impl,
                                               block_sizes=_BLOCKS))
        assert not np.isnan(got).any()
        assert (got[1, :, PPP:3 * PPP] == -np.inf).all()
        assert np.isfinite(got[1, :, :PPP]).all() and np.isfinite(got[0, :, :10]).all()
        assert (got[:, :, 12:] == -np.inf).all()


def test_paged_scores_reject_bad_input():
    q, w = jnp.zeros((2, 1, 3, 8)), jnp.zeros((2, 1, 3))
    pages, table = jnp.zeros((4, 2, 8)), jnp.zeros((2, 3), jnp.int32)
    counts, q_pos = jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1), jnp.int32)
    call = lambda **kw: pk.index_scores_paged(**{**dict(
        q=q, w=w, pooled_pages=pages, block_table=table, pool_counts=counts, q_pos=q_pos),
        **kw}, kpool=2)
    with pytest.raises(ValueError, match=r"pooled_pages must be \[N, PPP, D=8\]"):
        call(pooled_pages=jnp.zeros((4, 2, 9)))
    with pytest.raises(ValueError, match=r"block_table must be \[B=2, PG\]"):
        call(block_table=jnp.zeros((3, 3), jnp.int32))
    with pytest.raises(ValueError, match="block_table must be an integer array"):
        call(block_table=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"pool_counts must be \[B\]"):
        call(pool_counts=jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match="IndexScoresBlockSizes.block_p"):
        pk.index_scores_paged(q, w, pages, table, counts, q_pos, kpool=2,
                              block_sizes=pk.IndexScoresBlockSizes(block_p=8))


# ---------------------------------------------------------------------------------------
# topk_pools with a live bound
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("per", ["query", "sequence"])
@pytest.mark.parametrize("blocks", [
    pk.TopkPoolsBlockSizes(block_p=16),  # one program per row, several tiles
    pk.TopkPoolsBlockSizes(block_p=8, split_p=16),  # segmented: 5 segments of 16
], ids=["one-program", "segmented"])
def test_topk_n_live_equals_reference_with_minus_inf_past_it(blocks, per):
    rng = np.random.default_rng(30)
    b, nq, p = 3, 2, 70
    scores = rng.integers(-3, 3, (b, nq, p)).astype(np.float32)  # many ties
    scores[0, 0, 5] = np.nan
    n_live = rng.integers(0, p + 4, (b, nq) if per == "query" else (b,)).astype(np.int32)
    n_live[0] = 0  # a row with nothing live
    n_live[-1] = p  # a whole row
    live_bq = np.broadcast_to(n_live[:, None] if per == "sequence" else n_live, (b, nq))
    # Past the bound, the row's largest scores: any read of them changes the selection.
    scores[np.arange(p)[None, None, :] >= live_bq[..., None]] = 1e30
    s, nl = jnp.asarray(scores), jnp.asarray(n_live)
    assert blocks.multi_program(p) == (blocks.split_p == 16)
    for k in (1, 9, p):
        want = np.asarray(pk.topk_pools(mask_past_live(s, jnp.asarray(live_bq)), k))
        got_x = np.asarray(pk.topk_pools(s, k, n_live=nl))
        got_p = np.asarray(pk.topk_pools(s, k, n_live=nl, implementation="pallas_interpret",
                                         block_sizes=blocks))
        np.testing.assert_array_equal(got_x, want)
        np.testing.assert_array_equal(got_p, want)
        assert (want[0] == -1).all() and (want[-1] >= 0).any()


def test_topk_n_live_rejects_bad_shapes():
    s = jnp.zeros((2, 3, 8))
    with pytest.raises(ValueError, match=r"n_live must be an integer \[B, Q\] = \(2, 3\)"):
        pk.topk_pools(s, 2, n_live=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="n_live must be an integer"):
        pk.topk_pools(s, 2, n_live=jnp.zeros((2, 3)))


# ---------------------------------------------------------------------------------------
# CUDA lowering at the GLM-5.3-Flash shapes, 128K-token capacity, pages of 64 tokens
# ---------------------------------------------------------------------------------------

CFG = gd.DsaConfig.glm53_flash()
PAGE = 64
CAPACITY = 131072
REAL_PPP = PAGE // CFG.index_kpool  # 16 pools a page
REAL_PG = CAPACITY // PAGE  # 2048 pages a sequence
REAL_POOLS = REAL_PG * REAL_PPP  # 32768 pools a row
SDS = jax.ShapeDtypeStruct


@pytest.mark.lowering
@pytest.mark.parametrize("b, nq", [(1, 1), (8, 1), (1, 64)], ids=["decode-b1", "decode-b8",
                                                                  "prefill-q64"])
def test_index_scores_paged_lowers_for_cuda(b, nq):
    hi, d, kp = CFG.index_n_heads, CFG.index_head_dim, CFG.index_kpool
    lowered = lower_for_cuda(
        lambda q, w, pages, bt, counts, qp: pk.index_scores_paged(
            q, w, pages, bt, counts, qp, kpool=kp, implementation="pallas"),
        SDS((b, nq, hi, d), jnp.bfloat16), SDS((b, nq, hi), jnp.float32),
        SDS((b * REAL_PG, REAL_PPP, d), jnp.bfloat16),  # a pool with room for every row
        SDS((b, REAL_PG), jnp.int32), SDS((b,), jnp.int32), SDS((b, nq), jnp.int32),
    )
    (call,) = triton_calls(lowered)
    # Tiles of up to 16 queries x 64 pools over the whole capacity; the dead ones end at once.
    assert (call["name"], call["grid"]) == ("index_scores_paged",
                                           (-(-nq // 16), b, REAL_POOLS // 64))


@pytest.mark.lowering
@pytest.mark.parametrize("b, nq", [(1, 1), (8, 1), (1, 64)], ids=["decode-b1", "decode-b8",
                                                                  "prefill-q64"])
def test_topk_pools_n_live_lowers_for_cuda(b, nq):
    k = CFG.select_k(REAL_POOLS)
    lowered = lower_for_cuda(
        lambda s, n: pk.topk_pools(s, k, n_live=n, implementation="pallas"),
        SDS((b, nq, REAL_POOLS), jnp.float32), SDS((b, nq), jnp.int32),
    )
    # 32768 pools: the multi-program path, 8 counting launches and one compaction of
    # rows x 16 segments each.
    calls = [(c["name"], c["grid"]) for c in triton_calls(lowered)]
    rows = b * nq
    assert calls == [("topk_pools_count", (rows, 16, 1))] * 8 + [
        ("topk_pools_compact", (rows, 16, 1))]
    # A short row takes the one-program path, bounded the same way.
    lowered = lower_for_cuda(
        lambda s, n: pk.topk_pools(s, k, n_live=n, implementation="pallas"),
        SDS((b, nq, 4096), jnp.float32), SDS((b,), jnp.int32),
    )
    assert [(c["name"], c["grid"]) for c in triton_calls(lowered)] == [("topk_pools", (rows, 1, 1))]


@pytest.mark.lowering
@pytest.mark.parametrize("b, nq", [(1, 1), (8, 1), (1, 64)], ids=["decode-b1", "decode-b8",
                                                                  "prefill-q64"])
def test_sparse_mla_shared_latent_lowers_for_cuda(b, nq):
    h, c = CFG.num_attention_heads, CFG.kv_lora_rank
    lowered = lower_for_cuda(
        lambda q, lat, ids: pk.sparse_mla(q, lat, ids, scale=CFG.softmax_scale,
                                          implementation="pallas"),
        SDS((b, nq, h, c), jnp.bfloat16),
        SDS((1, b * CAPACITY, c), jnp.bfloat16),  # the flat page pool, shared
        SDS((b, nq, CFG.out_width), jnp.int32),
    )
    blocks = pk.SparseMlaBlockSizes().resolve((b, nq, h, c), CFG.out_width)
    call, *combine = triton_calls(lowered)
    assert (call["name"], call["grid"]) == ("sparse_mla",
                                           (b * nq * h // blocks.block_h, blocks.num_splits, 1))
    # A split row's partials are merged by a second launch: (rows x head blocks, c / 128).
    assert [(x["name"], x["grid"]) for x in combine] == (
        [("sparse_mla_combine", (b * nq * h // blocks.block_h, c // 128, 1))]
        if blocks.num_splits > 1 else [])
