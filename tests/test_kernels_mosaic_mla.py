"""``index_scores``, ``index_scores_paged`` and ``sparse_mla`` with ``implementation="mosaic"``:
the Mosaic GPU kernels (``pallas_kernels.mosaic_scoring`` / ``mosaic_attention``) against
their references.

* ``index_scores`` in GPU interpret mode (``"mosaic_interpret"``, jax >= 0.11) on shapes
  drawn by hypothesis, with dyadic inputs of few mantissa bits and ``D`` in {16, 64} (so
  ``D**-0.5`` is a power of two): every partial sum is exact in float32, so the scores
  must equal the reference's **bit for bit** whatever order the MMA and the head sum add
  in, and so must their top-k selection, ties included (integer-valued scores tie often,
  ReLU makes many exact zeros). Invalid pools, causality, padding queries, dead tiles, NaN
  keys and ``-0.0`` are drawn too. Random normal inputs at ``D = 128`` (where the order
  matters) agree within float32 rounding. ``index_scores_paged`` likewise, bit for bit,
  through drawn block tables (``-1`` entries, pool counts mid-page, NaN pages no row owns).
* ``sparse_mla`` in interpret mode on drawn shapes: per-sequence and shared (paged)
  latents, ``value_width < CR`` (a RoPE tail), more than 64 heads (two head tiles), ids that
  are ``-1`` or past ``L``, a row with no valid id (exactly 0), several splits; within the
  16-bit output's rounding of the reference. A latent whose unnamed rows are NaN shows that
  an invalid id is never read.
* ``lower_for_cuda`` of the kernels at every supported model's shapes (decode at batch 8
  over a 128K-token context, a 64-query prefill chunk at 4K): one Mosaic GPU custom call,
  no Triton (which kernel ``"auto"`` picks: ``tests/test_hardware_runs.py``).
* Float32 operands run the Triton kernel (wgmma's float32 is TF32); widths the layouts
  cannot tile are zero-padded. Bad input: bad block sizes (the field is named), block sizes
  of the other backend, blocks past Hopper's shared memory.

Interpret mode simulates the warpgroup's threads, so shapes are small and examples few. On
jax < 0.11 (the Python 3.11 leg) the Mosaic tests skip with that reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from glm5_dsa_jax.model.config import DsaConfig
from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version, lower_for_cuda
from pallas_kernels.attention import MosaicSparseMlaBlockSizes, SparseMlaBlockSizes
from pallas_kernels.scoring import IndexScoresBlockSizes, MosaicIndexScoresBlockSizes
from helpers import F32_REORDER

pytestmark = pytest.mark.mosaic

NEEDS_MOSAIC = pytest.mark.skipif(
    jax_version() < MOSAIC_MIN_JAX,
    reason=f"Mosaic GPU kernels need jax >= {MOSAIC_MIN_JAX} (this is jax {jax.__version__})",
)
_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ---------------------------------------------------------------------------------------
# index_scores
# ---------------------------------------------------------------------------------------


@st.composite
def _scores_case(draw):
    b, nq = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    heads, dim = draw(st.integers(1, 40)), draw(st.sampled_from([16, 64]))
    n_pools, kpool = draw(st.integers(1, 150)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.integers(-3, 4, (b, nq, heads, dim)) / 4
    pooled = rng.integers(-3, 4, (b, n_pools, dim)) / 4
    if draw(st.booleans()):
        pooled[rng.random((b, n_pools)) < 0.05] = np.nan  # a NaN key scores -inf
    w = rng.integers(-3, 4, (b, nq, heads)) / 8
    pool_valid = rng.random((b, n_pools)) < 0.9
    first_key = rng.integers(0, 4, b)
    span = n_pools * kpool + 8
    q_pos = rng.integers(-1, span, (b, nq))  # -1: a padding query
    blocks = MosaicIndexScoresBlockSizes(block_q=draw(st.sampled_from([1, 2, 8])),
                                         block_p=draw(st.sampled_from([64, 128])))
    dtype = _DTYPES[draw(st.sampled_from(sorted(_DTYPES)))]
    args = (jnp.asarray(q, dtype), jnp.asarray(w, jnp.float32), jnp.asarray(pooled, dtype),
            jnp.asarray(pool_valid), jnp.asarray(first_key, jnp.int32), jnp.asarray(q_pos, jnp.int32))
    return args, kpool, blocks


@NEEDS_MOSAIC
@settings(max_examples=4, deadline=None)
@given(_scores_case())
def test_index_scores_bit_identical_on_exact_inputs(case):
    args, kpool, blocks = case
    got = pk.index_scores(*args, kpool=kpool, implementation="mosaic_interpret", block_sizes=blocks)
    want = pk.index_scores_reference(*args, kpool=kpool)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    n_pools = want.shape[-1]
    for k in {1, max(1, n_pools // 3), n_pools}:  # the selection, ties included
        np.testing.assert_array_equal(np.asarray(pk.topk_pools(got, k)),
                                      np.asarray(pk.topk_pools_reference(want, k)))


@NEEDS_MOSAIC
def test_index_scores_dead_tiles_and_rounding_at_d128():
    """Random normal inputs at the real ``D = 128``, ``Hi = 32``: the summation order
    differs from XLA's, so within float32 rounding; ``-inf`` exactly where the reference
    has it. Query 0 sees only the first pool tile (the second is dead for its CTA)."""
    rng = np.random.default_rng(3)
    b, nq, heads, dim, n_pools, kpool = 1, 2, 32, 128, 192, 2
    q = jnp.asarray(rng.standard_normal((b, nq, heads, dim)), jnp.bfloat16)
    pooled = jnp.asarray(rng.standard_normal((b, n_pools, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((b, nq, heads)) / heads**0.5, jnp.float32)
    args = (q, w, pooled, jnp.ones((b, n_pools), bool), jnp.zeros(b, jnp.int32),
            jnp.asarray([[40, 2 * n_pools - 1]], jnp.int32))
    got = np.asarray(pk.index_scores(*args, kpool=kpool, implementation="mosaic_interpret",
                                     block_sizes=MosaicIndexScoresBlockSizes(block_q=1)))
    want = np.asarray(pk.index_scores_reference(*args, kpool=kpool))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isneginf(want[0, 0, 20:]).all() and np.isfinite(want[0, 1]).all()
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=F32_REORDER, atol=F32_REORDER)


@st.composite
def _paged_case(draw):
    ppp, kpool, block_p = draw(st.sampled_from([(16, 4, 64), (8, 1, 128), (128, 1, 64)]))
    b, nq, heads, dim = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 9)), 16
    n_pages, pg = 10, draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pages = rng.integers(-3, 4, (n_pages, ppp, dim)) / 4
    table = rng.permutation(n_pages)[: b * pg].reshape(b, pg).astype(np.int32)
    table[rng.random(table.shape) < 0.2] = -1  # no page
    table[rng.random(table.shape) < 0.1] = n_pages + 3  # not a page either
    pages[np.setdiff1d(np.arange(n_pages), table)] = np.nan  # pages no row owns: never read
    counts = rng.integers(0, pg * ppp + 1, b)
    q_pos = rng.integers(-1, pg * ppp * kpool + 4, (b, nq))
    args = (jnp.asarray(rng.integers(-3, 4, (b, nq, heads, dim)) / 4, jnp.bfloat16),
            jnp.asarray(rng.integers(-3, 4, (b, nq, heads)) / 8, jnp.float32),
            jnp.asarray(pages, jnp.bfloat16), jnp.asarray(table), jnp.asarray(counts, jnp.int32),
            jnp.asarray(q_pos, jnp.int32))
    return args, kpool, MosaicIndexScoresBlockSizes(block_q=2, block_p=block_p)


@NEEDS_MOSAIC
@settings(max_examples=4, deadline=None)
@given(_paged_case())
def test_index_scores_paged_bit_identical_on_exact_inputs(case):
    """The block-table kernel: pages of 8, 16 and 128 pools (a page per chunk, several
    chunks a tile, a page over several tiles), ``-1`` and out-of-range entries, pool counts
    mid-page; pages no row owns are NaN and must never reach a score."""
    args, kpool, blocks = case
    got = pk.index_scores_paged(*args, kpool=kpool, implementation="mosaic_interpret",
                                block_sizes=blocks)
    want = pk.index_scores_paged_reference(*args, kpool=kpool)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


# ---------------------------------------------------------------------------------------
# sparse_mla
# ---------------------------------------------------------------------------------------


@st.composite
def _mla_case(draw):
    b, nq = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    heads = draw(st.sampled_from([1, 5, 70]))
    cr, v = draw(st.sampled_from([(128, 128), (192, 128), (256, 256)]))
    length, width = draw(st.integers(1, 60)), draw(st.integers(1, 70))
    shared = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((b, nq, heads, cr))
    latent = rng.standard_normal((1 if shared else b, length, cr))
    ids = rng.integers(-1, length + 4, (b, nq, width))  # ids >= L are not tokens either
    if draw(st.booleans()):
        ids[ids >= length] = -1
    ids[0, 0, : width // 2] = -1  # invalid ids before valid ones
    if draw(st.booleans()):
        ids[-1, -1] = -1  # a row with no valid id
    blocks = MosaicSparseMlaBlockSizes(block_w=draw(st.sampled_from([16, 32])),
                                       block_v=128,
                                       num_splits=draw(st.sampled_from([None, 1, 3])))
    dtype = _DTYPES[draw(st.sampled_from(sorted(_DTYPES)))]
    return (jnp.asarray(q, dtype), jnp.asarray(latent, dtype), jnp.asarray(ids, jnp.int32),
            cr**-0.5, v, blocks)


@NEEDS_MOSAIC
@settings(max_examples=4, deadline=None)
@given(_mla_case())
def test_sparse_mla_matches_reference(case):
    q, latent, ids, scale, v, blocks = case
    got = pk.sparse_mla(q, latent, ids, scale=scale, value_width=v,
                        implementation="mosaic_interpret", block_sizes=blocks)
    want = pk.sparse_mla_reference(q, latent, ids, scale=scale, value_width=v)
    assert got.shape == want.shape == q.shape[:3] + (v,) and got.dtype == q.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    # 16-bit outputs, and p rounded to the input dtype before the value MMA (as the Triton
    # kernel does): a few units in the last place of an O(1) output.
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    none = ~((np.asarray(ids) >= 0) & (np.asarray(ids) < latent.shape[1])).any(-1)
    assert (got[none] == 0).all()


@NEEDS_MOSAIC
def test_sparse_mla_never_reads_invalid_ids():
    """Every latent row the ids do not name validly is NaN, the shared latent of the paged
    layout: the output is finite and equals attention over the named rows alone."""
    rng = np.random.default_rng(5)
    length, cr, heads = 40, 128, 66  # two head tiles of 64
    latent = rng.standard_normal((1, length, cr))
    ids = np.full((2, 1, 20), -1, np.int32)
    ids[0, 0, [3, 7, 8]] = [5, 11, 30]
    ids[1, 0, [0, 19]] = [2, 39]
    named = np.zeros(length, bool)
    named[[5, 11, 30, 2, 39]] = True
    latent[0, ~named] = np.nan
    q = jnp.asarray(rng.standard_normal((2, 1, heads, cr)), jnp.bfloat16)
    lat = jnp.asarray(latent, jnp.bfloat16)
    got = pk.sparse_mla(q, lat, jnp.asarray(ids), scale=0.1, implementation="mosaic_interpret",
                        block_sizes=MosaicSparseMlaBlockSizes(block_w=16, block_v=128, num_splits=2))
    assert np.isfinite(np.asarray(got, np.float32)).all()
    clean = jnp.asarray(np.where(named[None, :, None], latent, 0.0), jnp.bfloat16)
    want = pk.sparse_mla_reference(q, clean, jnp.asarray(ids), scale=0.1)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


@NEEDS_MOSAIC
def test_sparse_mla_partial_returns_the_kernels_lse():
    """``sparse_mla_partial(implementation="mosaic_interpret")``: the Mosaic launch with
    ``return_lse`` (``sparse_mla``'s output bit for bit, two splits merged) and its
    log-sum-exp against the reference's; a row holding no id: zeros and ``-inf``. Float32
    operands run the Triton kernel, as ``sparse_mla`` does."""
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((2, 1, 3, 128)), jnp.bfloat16)
    lat = jnp.asarray(rng.standard_normal((2, 40, 128)), jnp.bfloat16)
    ids = np.full((2, 1, 20), -1, np.int32)
    ids[0, 0, [0, 3, 7, 19]] = [5, 11, 30, 39]
    ids = jnp.asarray(ids)  # row 1 holds no id
    blocks = MosaicSparseMlaBlockSizes(block_w=16, block_v=128, num_splits=2)
    out, lse = pk.sparse_mla_partial(q, lat, ids, scale=0.1, implementation="mosaic_interpret",
                                     block_sizes=blocks)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(pk.sparse_mla(
        q, lat, ids, scale=0.1, implementation="mosaic_interpret", block_sizes=blocks), np.float32))
    want_out, want_lse = pk.sparse_mla_partial(q, lat, ids, scale=0.1)
    lse = np.asarray(lse)
    assert (lse[1] == -np.inf).all() and (np.asarray(out, np.float32)[1] == 0).all()
    # bf16 products are exact in float32: the scores differ from the reference's only in
    # the order of their float32 sums.
    np.testing.assert_allclose(lse[0], np.asarray(want_lse)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), rtol=2e-2, atol=2e-2)
    q32, lat32 = q.astype(jnp.float32), lat.astype(jnp.float32)
    for a, b in zip(pk.sparse_mla_partial(q32, lat32, ids, scale=0.1, implementation="mosaic_interpret"),
                    pk.sparse_mla_partial(q32, lat32, ids, scale=0.1, implementation="pallas_interpret")):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------
# Lowering at the real shapes
# ---------------------------------------------------------------------------------------

_PRESETS = ("glm53-flash", "glm5", "glm52", "deepseek-v32")
# (batch, queries, context): decode, a prefill chunk, a batch's prefill chunk (B > 1 with a
# tile of queries: a 6-dimension TMA until the queries' copy folded B into Q; the H200
# refused it in a layer's prefill, 2026-12-04)
_STEPS = [(8, 1, 131072), (1, 64, 4096), (2, 64, 4096)]


def _mosaic_calls(text: str) -> int:
    assert "triton" not in text
    return sum("stablehlo.custom_call @mosaic_gpu" in line for line in text.splitlines())


@NEEDS_MOSAIC
@pytest.mark.parametrize("preset", _PRESETS)
def test_lowers_for_cuda_at_model_shapes(preset):
    cfg = DsaConfig.preset(preset)
    sds = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    hi, d, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    heads, cr = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    for b, nq, context in _STEPS:
        p = context // kp
        scores = lambda q, w, pooled, pv, fk, qp: pk.index_scores(
            q, w, pooled, pv, fk, qp, kpool=kp, implementation="mosaic")
        text = lower_for_cuda(scores, sds((b, nq, hi, d), bf16), sds((b, nq, hi), jnp.float32),
                              sds((b, p, d), bf16), sds((b, p), jnp.bool_), sds((b,), jnp.int32),
                              sds((b, nq), jnp.int32)).as_text()
        assert _mosaic_calls(text) == 1, (preset, b, nq, context)
        ppp = 64 // kp  # pages of 64 tokens
        paged = lambda q, w, pages, table, counts, qp: pk.index_scores_paged(
            q, w, pages, table, counts, qp, kpool=kp, implementation="mosaic")
        text = lower_for_cuda(paged, sds((b, nq, hi, d), bf16), sds((b, nq, hi), jnp.float32),
                              sds((b * context // 64, ppp, d), bf16),
                              sds((b, context // 64), jnp.int32), sds((b,), jnp.int32),
                              sds((b, nq), jnp.int32)).as_text()
        assert _mosaic_calls(text) == 1, (preset, b, nq, context, "paged")
        for latent_rows in (b, 1) if nq == 1 else (b,):  # per-sequence cache; shared (paged) pool
            mla = lambda q, lat, ids: pk.sparse_mla(
                q, lat, ids, scale=cfg.qk_head_dim**-0.5, value_width=cfg.kv_lora_rank,
                implementation="mosaic")
            text = lower_for_cuda(mla, sds((b, nq, heads, cr), bf16),
                                  sds((latent_rows, context * (1 if latent_rows == b else b), cr), bf16),
                                  sds((b, nq, cfg.out_width), jnp.int32)).as_text()
            assert _mosaic_calls(text) == 1, (preset, b, nq, context, latent_rows)


@NEEDS_MOSAIC
@pytest.mark.parametrize("block_w, cr, v", [(16, 512, 512), (32, 192, 128), (64, 256, 256)])
def test_sparse_mla_block_sizes_lower(block_w, cr, v):
    """Every ``block_w`` lowers (an id block of 16 is still copied as 32 ids: a TMA moves
    whole 128-byte lines), with and without a RoPE tail."""
    sds = jax.ShapeDtypeStruct
    text = lower_for_cuda(lambda q, lat, ids: pk.sparse_mla(
        q, lat, ids, scale=0.1, value_width=v, implementation="mosaic",
        block_sizes=MosaicSparseMlaBlockSizes(block_w=block_w, block_v=128)),
        sds((2, 1, 16, cr), jnp.float16), sds((1, 4096, cr), jnp.float16),
        sds((2, 1, 300), jnp.int32)).as_text()
    assert _mosaic_calls(text) == 1


@NEEDS_MOSAIC
@pytest.mark.parametrize("block_q, block_p, dim", [(1, 64, 16), (3, 128, 64), (8, 256, 128)])
def test_index_scores_block_sizes_lower(block_q, block_p, dim):
    sds = jax.ShapeDtypeStruct
    text = lower_for_cuda(lambda q, w, p, pv, fk, qp: pk.index_scores(
        q, w, p, pv, fk, qp, kpool=2, implementation="mosaic",
        block_sizes=MosaicIndexScoresBlockSizes(block_q=block_q, block_p=block_p)),
        sds((1, 5, 3, dim), jnp.float16), sds((1, 5, 3), jnp.float32), sds((1, 300, dim), jnp.float16),
        sds((1, 300), jnp.bool_), sds((1,), jnp.int32), sds((1, 5), jnp.int32)).as_text()
    assert _mosaic_calls(text) == 1


@NEEDS_MOSAIC
def test_lowered_kernels_compare_signed():
    """The sparse MLA and scoring kernels, forward and backward, lowered for CUDA hold no
    unsigned integer comparison: every integer they compare (ids, lengths, positions) is a
    signed int32, and an unsigned compare would mean Mosaic lost a value's sign, which
    interpret mode cannot show (the Mosaic top-k on an H200: ``tests/test_kernels_mosaic_topk.py``)."""
    sds = jax.ShapeDtypeStruct
    mla = lambda q, lat, ids: pk.sparse_mla(q, lat, ids, scale=0.1, value_width=512,  # noqa: E731
                                            implementation="mosaic")
    av = (sds((1, 2, 64, 576), jnp.bfloat16), sds((1, 4096, 576), jnp.bfloat16), sds((1, 2, 2051), jnp.int32))
    mla_bwd = lambda q, lat, ids, do: jax.vjp(lambda a, c: mla(a, c, ids), q, lat)[1](do)  # noqa: E731
    scores = lambda q, w, p, pv, fk, qp: pk.index_scores(q, w, p, pv, fk, qp, kpool=4,  # noqa: E731
                                                         implementation="mosaic")
    avi = (sds((1, 64, 32, 128), jnp.bfloat16), sds((1, 64, 32), jnp.float32),
           sds((1, 256, 128), jnp.bfloat16), sds((1, 256), jnp.bool_), sds((1,), jnp.int32),
           sds((1, 64), jnp.int32))
    scores_bwd = lambda *a: jax.vjp(lambda q, w, p: scores(q, w, p, *a[3:6]), *a[:3])[1](a[6])  # noqa: E731
    modules = (pk.mosaic_modules(lower_for_cuda(mla, *av))
               + pk.mosaic_modules(lower_for_cuda(mla_bwd, *av, sds((1, 2, 64, 512), jnp.bfloat16)))
               + pk.mosaic_modules(lower_for_cuda(scores_bwd, *avi, sds((1, 64, 256), jnp.float32))))
    assert len(modules) >= 5  # the forwards and the backwards' kernels
    for text in modules:
        assert 'arith.cmpi"' in text and pk.unsigned_compares(text) == [], pk.unsigned_compares(text)


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------


def _scores_args(dtype=jnp.bfloat16, dim=16):
    return (jnp.zeros((1, 1, 2, dim), dtype), jnp.zeros((1, 1, 2)), jnp.zeros((1, 8, dim), dtype),
            jnp.ones((1, 8), bool), jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.int32))


@NEEDS_MOSAIC
def test_float32_runs_the_triton_kernel():
    """wgmma's float32 is TF32: float32 operands under ``"mosaic_interpret"`` run the Triton
    kernel (``"pallas_interpret"``) at its default block sizes, bit for bit."""
    rng = np.random.default_rng(7)
    args = (jnp.asarray(rng.standard_normal((1, 2, 3, 16)), jnp.float32),
            jnp.asarray(rng.standard_normal((1, 2, 3)), jnp.float32),
            jnp.asarray(rng.standard_normal((1, 20, 16)), jnp.float32), jnp.ones((1, 20), bool),
            jnp.zeros(1, jnp.int32), jnp.asarray([[9, 30]], jnp.int32))
    np.testing.assert_array_equal(
        np.asarray(pk.index_scores(*args, kpool=2, implementation="mosaic_interpret",
                                   block_sizes=MosaicIndexScoresBlockSizes(block_q=1))),
        np.asarray(pk.index_scores(*args, kpool=2, implementation="pallas_interpret")))
    q = jnp.asarray(rng.standard_normal((1, 1, 2, 40)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((1, 9, 40)), jnp.float32)
    ids = jnp.asarray([[[3, -1, 8, 0]]], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(pk.sparse_mla(q, lat, ids, scale=0.2, implementation="mosaic_interpret")),
        np.asarray(pk.sparse_mla(q, lat, ids, scale=0.2, implementation="pallas_interpret")))


@NEEDS_MOSAIC
def test_unaligned_widths_are_padded():
    """``D = 24`` (not a multiple of the MMA's 16), ``CR = V = 40`` (the tiny config) and
    ``CR = 96``, ``V = 64``: zero-padded in the wrapper, equal to the references."""
    rng = np.random.default_rng(8)
    args = (jnp.asarray(rng.integers(-3, 4, (1, 2, 3, 24)) / 4, jnp.bfloat16),
            jnp.asarray(rng.integers(-3, 4, (1, 2, 3)) / 8, jnp.float32),
            jnp.asarray(rng.integers(-3, 4, (1, 20, 24)) / 4, jnp.bfloat16), jnp.ones((1, 20), bool),
            jnp.zeros(1, jnp.int32), jnp.asarray([[9, 30]], jnp.int32))
    got = pk.index_scores(*args, kpool=2, implementation="mosaic_interpret")
    want = pk.index_scores_reference(*args, kpool=2)  # 24**-0.5 is inexact: rounding only
    np.testing.assert_array_equal(np.isneginf(np.asarray(got)), np.isneginf(np.asarray(want)))
    fin = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(np.asarray(got)[fin], np.asarray(want)[fin], rtol=1e-6, atol=1e-6)
    for cr, v in ((40, None), (96, 64)):
        q = jnp.asarray(rng.standard_normal((1, 1, 2, cr)), jnp.bfloat16)
        lat = jnp.asarray(rng.standard_normal((1, 9, cr)), jnp.bfloat16)
        ids = jnp.asarray([[[3, -1, 8, 0]]], jnp.int32)
        got = pk.sparse_mla(q, lat, ids, scale=0.2, value_width=v, implementation="mosaic_interpret")
        want = pk.sparse_mla_reference(q, lat, ids, scale=0.2, value_width=v)
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kwargs, name", [
    ({"block_q": 0}, "block_q"), ({"block_p": 32}, "block_p"), ({"block_p": 96}, "block_p"),
    ({"block_p": 512}, "block_p"),
])
def test_bad_index_scores_block_sizes(kwargs, name):
    with pytest.raises(ValueError, match=f"MosaicIndexScoresBlockSizes.{name}"):
        pk.index_scores(*_scores_args(), kpool=1, block_sizes=MosaicIndexScoresBlockSizes(**kwargs))


@pytest.mark.parametrize("kwargs, name", [
    ({"block_w": 8}, "block_w"), ({"block_w": 128}, "block_w"), ({"block_v": 64}, "block_v"),
    ({"block_v": 200}, "block_v"), ({"num_splits": 0}, "num_splits"),
])
def test_bad_sparse_mla_block_sizes(kwargs, name):
    with pytest.raises(ValueError, match=f"MosaicSparseMlaBlockSizes.{name}"):
        pk.sparse_mla(jnp.zeros((1, 1, 2, 128)), jnp.zeros((1, 4, 128)), jnp.zeros((1, 1, 2), jnp.int32),
                      scale=0.1, block_sizes=MosaicSparseMlaBlockSizes(**kwargs))


@NEEDS_MOSAIC
def test_blocks_past_hopper_shared_memory_are_refused():
    """``block_w=64`` at ``CR = 576`` (two 64-row tiles of 576 bf16 columns beside the query
    tile) and 16 queries of 64 heads x 128 exceed a Hopper CTA's 227 KiB."""
    sds = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="MosaicSparseMlaBlockSizes.*shared memory"):
        lower_for_cuda(lambda q, lat, ids: pk.sparse_mla(
            q, lat, ids, scale=0.1, value_width=512, implementation="mosaic",
            block_sizes=MosaicSparseMlaBlockSizes(block_w=64)),
            sds((1, 1, 64, 576), jnp.bfloat16), sds((1, 4096, 576), jnp.bfloat16),
            sds((1, 1, 2048), jnp.int32))
    with pytest.raises(ValueError, match="MosaicIndexScoresBlockSizes.*shared memory"):
        lower_for_cuda(lambda q, w, p, pv, fk, qp: pk.index_scores(
            q, w, p, pv, fk, qp, kpool=1, implementation="mosaic",
            block_sizes=MosaicIndexScoresBlockSizes(block_q=16)),
            sds((1, 16, 64, 128), jnp.bfloat16), sds((1, 16, 64), jnp.float32),
            sds((1, 256, 128), jnp.bfloat16), sds((1, 256), jnp.bool_), sds((1,), jnp.int32),
            sds((1, 16), jnp.int32))


def test_block_sizes_must_match_the_implementation():
    with pytest.raises(TypeError, match="MosaicIndexScoresBlockSizes"):
        pk.index_scores(*_scores_args(), kpool=1, implementation="mosaic_interpret",
                        block_sizes=IndexScoresBlockSizes())
    with pytest.raises(TypeError, match="MosaicSparseMlaBlockSizes"):
        pk.sparse_mla(jnp.zeros((1, 1, 2, 128)), jnp.zeros((1, 4, 128)), jnp.zeros((1, 1, 2), jnp.int32),
                      scale=0.1, implementation="mosaic", block_sizes=SparseMlaBlockSizes())


def test_resolve_sparse_mla_splits():
    """Decode at batch 1 splits a 2051-id row over several CTAs (shares of >= 4 blocks of
    32); a prefill chunk of many rows does not split."""
    blocks = MosaicSparseMlaBlockSizes().resolve(rows=1, head_blocks=1, width=2051, v=512)
    assert blocks.block_v == 128 and 1 < blocks.num_splits <= 2051 // 32 // 4 + 1
    assert MosaicSparseMlaBlockSizes().resolve(rows=512, head_blocks=1, width=2051, v=512).num_splits == 1
    assert MosaicSparseMlaBlockSizes(block_v=512).resolve(1, 1, 64, 128).block_v == 128
    assert MosaicSparseMlaBlockSizes(block_v=256).resolve(1, 1, 64, 384).block_v == 128


@pytest.mark.skipif(jax_version() >= MOSAIC_MIN_JAX, reason="the jax < 0.11 error path")
def test_old_jax_names_the_version():
    with pytest.raises(NotImplementedError, match=r"jax >= 0\.11"):
        pk.index_scores(*_scores_args(), kpool=1, implementation="mosaic_interpret")
    with pytest.raises(NotImplementedError, match=r"jax >= 0\.11"):
        pk.sparse_mla(jnp.zeros((1, 1, 2, 128), jnp.bfloat16), jnp.zeros((1, 4, 128), jnp.bfloat16),
                      jnp.zeros((1, 1, 2), jnp.int32), scale=0.1, implementation="mosaic_interpret")
