"""The Mosaic GPU backward kernels (``mosaic_attention_backward``, ``mosaic_scoring_backward``)
and the forward's log-sum-exp, in Mosaic GPU interpret mode (jax >= 0.11; skipped on the
Python 3.11 leg like every Mosaic test), against ``jax.vjp`` of the plain references.

* ``mosaic_sparse_mla(..., return_lse=True)``: the same output bits, the log-sum-exp of
  the scaled scores (``-inf`` for a row with no valid id).
* ``mosaic_sparse_mla_backward``: ``(dq, dlatent)`` equal ``jax.vjp`` of
  ``sparse_mla_reference`` (float32) by the float32 rule (within ``RATIO`` of the bf16
  ``"xla"`` path's distance from it: 16-bit operands and outputs; ``p`` and ``dz`` rounded
  before their MMAs), per-sequence and shared latents, a RoPE tail (``V < CR``), unaligned
  widths, ids ``-1`` and ``>= L``, a row with no valid id
  (zero ``dq``), rows no query names (zero ``dlatent``, even when NaN), many queries on one
  row; two runs give the same bits.
* ``mosaic_index_scores_backward``: ``(dq, dw, dpooled)`` equal ``jax.vjp`` of
  ``index_scores_reference`` by the same rule, with invalid pools (NaN keys there),
  causality, a padding query, ``D`` not a multiple of 16; two runs give the same bits.
* Bad block sizes and a transpose of the wrong block size are refused by name.

Interpret mode simulates the warpgroup's threads: tiny shapes, few calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from glm5_dsa_jax.tools import float32_rule
from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version
from pallas_kernels.mosaic_attention import MosaicSparseMlaBlockSizes, mosaic_sparse_mla
from pallas_kernels.mosaic_attention_backward import (
    TRANSPOSE_ROWS, MosaicSparseMlaBackwardBlockSizes, mosaic_sparse_mla_backward,
)
from pallas_kernels.mosaic_scoring_backward import (
    MosaicIndexScoresBackwardBlockSizes, mosaic_index_scores_backward,
)
from pallas_kernels.transpose import selection_transpose

pytestmark = pytest.mark.mosaic

NEEDS_MOSAIC = pytest.mark.skipif(
    jax_version() < MOSAIC_MIN_JAX,
    reason=f"Mosaic GPU kernels need jax >= {MOSAIC_MIN_JAX} (this is jax {jax.__version__})",
)


def _judge(got: dict, xla: dict, ref32: dict):
    """The float32 rule (``glm5_dsa_jax.tools.float32_rule``, ``KERNEL_FLOOR``): each of the
    kernel's 16-bit gradients (16-bit MMA operands ``p``, ``dz``; 16-bit outputs) within
    ``RATIO`` of the bf16 ``"xla"`` path's distance from the float32 reference, or the floor."""
    ok, check, d = float32_rule.against_float32(got, xla, ref32, float32_rule.KERNEL_FLOOR)
    assert ok, check
    # bf16 rounding measured, not zeros (a float32 gradient, dw, may be exact in both)
    assert all(e > 0 for k, e in d["errs_xla"].items() if got[k].dtype == jnp.bfloat16), d


def _mla_case(seed, *, b, nq, h, cr, v, length, width, shared, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, nq, h, cr)), dtype)
    latent = rng.standard_normal((1 if shared else b, length, cr))
    # Distinct ids per query (top-k's), some -1 or past L; row 3 named by every query.
    ids = np.stack([np.stack([rng.permutation(length + 8)[:width] for _ in range(nq)])
                    for _ in range(b)]).astype(np.int32)
    ids[:, :, 0] = np.where((ids == 3).any(-1), ids[:, :, 0], 3)
    ids[ids >= length + 4] = -1
    ids[-1, -1] = -1  # a row with no valid id
    named = np.zeros((latent.shape[0], length), bool)
    for bi in range(b):
        for i in ids[bi].ravel():
            if 0 <= i < length:
                named[0 if shared else bi, i] = True
    latent[~named] = np.nan  # never read: zero dlatent, no NaN anywhere
    d_out = jnp.asarray(rng.standard_normal((b, nq, h, v)), dtype)
    return q, jnp.asarray(latent, dtype), jnp.asarray(ids), d_out, named


def _mla_backward(q, latent, ids, d_out, v, scale, blocks=MosaicSparseMlaBackwardBlockSizes()):
    out, lse = mosaic_sparse_mla(q, latent, ids, scale=scale, value_width=v, interpret=True,
                                 block_sizes=MosaicSparseMlaBlockSizes(block_w=16), return_lse=True)
    tr = selection_transpose(ids, latent.shape[1], shared=latent.shape[0] == 1,
                             block_rows=TRANSPOSE_ROWS)
    return mosaic_sparse_mla_backward(q, latent, ids, out, lse, d_out, tr, scale=scale, value_width=v,
                                      interpret=True, block_sizes=blocks)


def _mla_vjp(q, latent, ids, d_out, v, scale, named):
    """``(float32, bf16 "xla")``: ``(dq, dlatent)`` of ``sparse_mla_reference`` in float32 on
    the same (cast) operands, and of ``"xla"`` in the operands' 16-bit dtype (the rounding
    baseline); unnamed rows zeroed (never read)."""
    clean = jnp.where(jnp.asarray(named)[..., None], latent, 0)
    f = lambda q, lat: pk.sparse_mla_reference(q, lat, ids, scale=scale, value_width=v)  # noqa: E731
    ref32 = jax.vjp(f, q.astype(jnp.float32), clean.astype(jnp.float32))[1](d_out.astype(jnp.float32))
    f = lambda q, lat: pk.sparse_mla(q, lat, ids, scale=scale, value_width=v, implementation="xla")  # noqa: E731
    return ref32, jax.vjp(f, q, clean)[1](d_out)


@NEEDS_MOSAIC
def test_forward_lse():
    q, latent, ids, _, named = _mla_case(0, b=2, nq=2, h=3, cr=40, v=40, length=50, width=12,
                                         shared=False)
    latent = jnp.where(jnp.asarray(named)[..., None], latent, 0)
    blocks = MosaicSparseMlaBlockSizes(block_w=16, num_splits=2)
    out, lse = mosaic_sparse_mla(q, latent, ids, scale=0.3, value_width=40, interpret=True,
                                 block_sizes=blocks, return_lse=True)
    plain = mosaic_sparse_mla(q, latent, ids, scale=0.3, value_width=40, interpret=True,
                              block_sizes=blocks)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
    ok = (np.asarray(ids) >= 0) & (np.asarray(ids) < 50)
    kv = np.asarray(latent, np.float64)[np.arange(2)[:, None, None], np.clip(np.asarray(ids), 0, 49)]
    s = np.einsum("bqhc,bqwc->bqhw", np.asarray(q, np.float64), kv) * 0.3
    s = np.where(ok[:, :, None, :], s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = s.max(-1, keepdims=True)
        want = (m + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(-1, keepdims=True)))[..., 0]
    got = np.asarray(lse)
    assert np.isneginf(got[-1, -1]).all() and np.isfinite(got[:, :-1]).all()
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)


@NEEDS_MOSAIC
@pytest.mark.parametrize("shared, cr, v, h, nq, block_c", [
    (False, 128, 128, 4, 2, 64), (True, 192, 128, 70, 1, 192), (False, 40, 40, 2, 2, 192)])
def test_sparse_mla_backward_matches_vjp(shared, cr, v, h, nq, block_c):
    """Per-sequence and shared latents; a RoPE tail (V < CR: its columns get only the score
    gradient); two head tiles (H = 70); CR = V = 40 (the tiny config, padded to 128); two
    column blocks (block_c = 64 of 128) and one."""
    length = 40  # B * L = 80 rows: three transpose blocks of 32, two row tiles of 64
    q, latent, ids, d_out, named = _mla_case(1 + cr, b=2, nq=nq, h=h, cr=cr, v=v, length=length,
                                             width=12, shared=shared)
    scale = cr**-0.5
    blocks = MosaicSparseMlaBackwardBlockSizes(block_c=block_c)
    dq, dlat = _mla_backward(q, latent, ids, d_out, v, scale, blocks)
    assert dq.dtype == q.dtype and dlat.dtype == latent.dtype
    ref32, xla = _mla_vjp(q, latent, ids, d_out, v, scale, named)
    name = lambda g: dict(zip(("dq", "dlatent"), g))  # noqa: E731
    _judge(name((dq, dlat)), name(xla), name(ref32))
    assert (np.asarray(dq, np.float32)[-1, -1] == 0).all()  # the row with no valid id
    assert (np.asarray(dlat, np.float32)[~named] == 0).all()  # rows no query names
    if cr != 40:
        return  # one determinism check is enough (interpret mode is slow)
    dq2, dlat2 = _mla_backward(q, latent, ids, d_out, v, scale, blocks)
    np.testing.assert_array_equal(np.asarray(dq2, np.float32), np.asarray(dq, np.float32))
    np.testing.assert_array_equal(np.asarray(dlat2, np.float32), np.asarray(dlat, np.float32))


def _scores_case(seed, dim, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    b, nq, heads, n_pools, kpool = 2, 3, 3, 70, 2
    q = jnp.asarray(rng.standard_normal((b, nq, heads, dim)), dtype)
    w = jnp.asarray(rng.standard_normal((b, nq, heads)), jnp.float32)
    valid = rng.random((b, n_pools)) < 0.8
    pooled = rng.standard_normal((b, n_pools, dim))
    pooled[~valid] = np.nan  # an invalid pool's key never reaches a gradient
    first_key = jnp.asarray([0, 4], jnp.int32)
    q_pos = jnp.asarray([[100, 130, -1], [50, 139, 20]], jnp.int32)  # -1: a padding query
    d_scores = jnp.asarray(rng.standard_normal((b, nq, n_pools)), jnp.float32)
    return (q, w, jnp.asarray(pooled, dtype), jnp.asarray(valid), first_key, q_pos, d_scores), kpool


@NEEDS_MOSAIC
@pytest.mark.parametrize("dim, block_q", [(16, 2), (24, 4)])
def test_index_scores_backward_matches_vjp(dim, block_q):
    (q, w, pooled, valid, first_key, q_pos, g), kpool = _scores_case(dim, dim)
    blocks = MosaicIndexScoresBackwardBlockSizes(block_q=block_q)
    got = mosaic_index_scores_backward(q, w, pooled, valid, first_key, q_pos, g, kpool=kpool,
                                       interpret=True, block_sizes=blocks)
    clean = jnp.where(valid[..., None], pooled, 0)
    f = lambda q, w, k: pk.index_scores_reference(q, w, k, valid, first_key, q_pos, kpool=kpool)  # noqa: E731
    scores, vjp = jax.vjp(f, q.astype(jnp.float32), w, clean.astype(jnp.float32))
    ct = jnp.where(jnp.isfinite(scores), g, 0.0)  # d_scores is ignored off candidates
    xla = jax.vjp(lambda q, w, k: pk.index_scores(q, w, k, valid, first_key, q_pos, kpool=kpool,
                                                  implementation="xla"), q, w, clean)[1](ct)
    assert [x.dtype for x in got] == [q.dtype, w.dtype, pooled.dtype]
    name = lambda g: dict(zip(("dq", "dw", "dpooled"), g))  # noqa: E731
    _judge(name(got), name(xla), name(vjp(ct)))
    assert (np.asarray(got[0], np.float32)[0, 2] == 0).all()  # the padding query
    assert (np.asarray(got[2], np.float32)[~np.asarray(valid)] == 0).all()
    again = mosaic_index_scores_backward(q, w, pooled, valid, first_key, q_pos, g, kpool=kpool,
                                         interpret=True, block_sizes=blocks)
    for a, r in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32))


@pytest.mark.parametrize("kwargs, name", [
    ({"block_w": 8}, "block_w"), ({"block_h": 128}, "block_h"), ({"block_c": 96}, "block_c"),
    ({"block_c": 512}, "block_c"),
])
def test_bad_sparse_mla_backward_block_sizes(kwargs, name):
    with pytest.raises(ValueError, match=f"MosaicSparseMlaBackwardBlockSizes.{name}"):
        MosaicSparseMlaBackwardBlockSizes(**kwargs).validate()


@pytest.mark.parametrize("kwargs, name", [({"block_q": 0}, "block_q"), ({"block_p": 32}, "block_p")])
def test_bad_index_scores_backward_block_sizes(kwargs, name):
    with pytest.raises(ValueError, match=f"MosaicIndexScoresBackwardBlockSizes.{name}"):
        MosaicIndexScoresBackwardBlockSizes(**kwargs).validate()


@NEEDS_MOSAIC
def test_transpose_of_another_block_size_is_refused():
    q = jnp.zeros((1, 1, 2, 64), jnp.bfloat16)
    latent = jnp.zeros((1, 100, 64), jnp.bfloat16)
    ids = jnp.zeros((1, 1, 4), jnp.int32)
    tr = selection_transpose(ids, 100, shared=True, block_rows=16)
    with pytest.raises(ValueError, match="transpose.block_start.*block_rows=32"):
        mosaic_sparse_mla_backward(q, latent, ids, jnp.zeros((1, 1, 2, 64), jnp.bfloat16),
                                   jnp.zeros((1, 1, 2)), jnp.zeros((1, 1, 2, 64), jnp.bfloat16), tr,
                                   scale=0.1, value_width=64, interpret=True,
                                   block_sizes=MosaicSparseMlaBackwardBlockSizes())
