"""``dense_pool_mass`` and ``sparse_pool_mass`` against a float64 numpy computation of their
definitions (``glm5_dsa_jax.model.attention_mass``): left padding, holes in the mask, a
padding query, kpool 1 and 4, key tiles smaller than and not dividing ``L``, fp8 rows, the
``expand_selection`` layout the sparse mass relies on, and TP 2 (``reduce_axis`` in a
``shard_map``) equal to the unsharded call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from glm5_dsa_jax.cache.fp8 import quantize_rows
from glm5_dsa_jax.model import attention_mass as am
from glm5_dsa_jax.model.attention_mass import dense_pool_mass, sparse_pool_mass
from helpers import tp_mesh
from test_causal_mla import _largest_intermediate

SCALE = 0.37
B, Q, H, CR, L = 2, 5, 4, 12, 13


def _case(seed=0, *, fp8=False):
    """q, latent, latent_scale (fp8) or None, q_slots, key_valid, first_key: row 0 left-padded
    by 3 with a hole at slot 7, row 1 unpadded with a padding query (slot -1)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, Q, H, CR)).astype(np.float32)
    latent = rng.normal(size=(B, L, CR)).astype(np.float32) * 1.5
    key_valid = np.ones((B, L), bool)
    key_valid[0, :3] = False
    key_valid[0, 7] = False
    first_key = np.array([3, 0], np.int32)
    q_slots = np.stack([np.arange(L - Q, L), np.array([2, 5, -1, 9, 12])]).astype(np.int32)
    scale = None
    if fp8:
        latent, scale = quantize_rows(jnp.asarray(latent))
    return jnp.asarray(q), jnp.asarray(latent), scale, jnp.asarray(q_slots), jnp.asarray(key_valid), jnp.asarray(first_key)


def _rows64(latent, scale):
    """Float64 rows and per-row scales (1 for a float cache)."""
    rows = np.asarray(jnp.asarray(latent).astype(jnp.float32), np.float64)
    s = np.ones(rows.shape[:2]) if scale is None else np.asarray(scale, np.float64)
    return rows, s


def _probs64(q, rows, rscale, visible):
    """``[Q, H, L]`` softmax (float64) of one row's scores over ``visible [Q, L]``."""
    s = np.einsum("qhc,lc->qhl", np.asarray(q, np.float64), rows) * rscale[None, None, :] * SCALE
    s = np.where(visible[:, None, :], s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    e = np.where(visible[:, None, :], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    d = e.sum(-1, keepdims=True)
    return e / np.where(d > 0, d, 1.0)


def dense_mass64(q, latent, scale, q_slots, key_valid, first_key, kpool, n_pools):
    rows, rs = _rows64(latent, scale)
    out = np.zeros((B, Q, n_pools))
    for b in range(B):
        slots = np.arange(L)
        visible = np.asarray(key_valid)[b][None, :] & (slots[None, :] <= np.asarray(q_slots)[b][:, None])
        a = _probs64(np.asarray(q)[b], rows[b], rs[b], visible).mean(1)  # [Q, L]
        for j in range(n_pools):
            lo = int(first_key[b]) + j * kpool
            out[b, :, j] = a[:, lo:min(lo + kpool, L)].sum(-1)
    return out


def sparse_mass64(q, latent, scale, token_ids, kpool, select_k):
    rows, rs = _rows64(latent, scale)
    ids = np.asarray(token_ids)
    out = np.zeros((B, Q, select_k))
    for b in range(B):
        for t in range(Q):
            row_ids = ids[b, t]
            ok = (row_ids >= 0) & (row_ids < L)
            safe = np.where(ok, row_ids, 0)
            a = _probs64(np.asarray(q)[b, t][None], rows[b][safe], rs[b][safe], ok[None])[0].mean(0)  # [W]
            for k in range(select_k):
                block = row_ids[k * kpool:(k + 1) * kpool]
                if (block >= 0).all():  # a selected pool (the tail holds fewer than KP ids)
                    out[b, t, k] = a[k * kpool:(k + 1) * kpool].sum()
    return out


@pytest.mark.parametrize("kpool,key_tile", [(1, 5), (4, 4), (4, 6), (4, 512)])
@pytest.mark.parametrize("fp8", [False, True])
def test_dense_mass_equals_float64(kpool, key_tile, fp8):
    q, latent, scale, q_slots, key_valid, first_key = _case(kpool, fp8=fp8)
    n_pools = L // kpool  # row 0's last pool runs past L (its grid starts at 3)
    got = dense_pool_mass(q, latent, q_slots, key_valid, first_key, scale, kpool=kpool,
                          n_pools=n_pools, scale=SCALE, key_tile=key_tile)
    assert got.shape == (B, Q, n_pools) and got.dtype == jnp.float32
    want = dense_mass64(q, latent, scale, q_slots, key_valid, first_key, kpool, n_pools)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)
    assert np.all(np.asarray(got)[1, 2] == 0)  # the padding query
    # Every visible key is in some pool of row 1 at kpool 1 (grid from 0, L pools): mass 1.
    if kpool == 1:
        np.testing.assert_allclose(np.asarray(got)[1, [0, 1, 3, 4]].sum(-1), 1.0, rtol=1e-5)


def test_dense_mass_nan_in_invisible_row_goes_nowhere():
    q, latent, _, q_slots, key_valid, first_key = _case(1)
    poisoned = latent.at[0, 7].set(jnp.nan).at[0, 1].set(jnp.inf).at[1, 12].set(jnp.nan)
    qs = q_slots.at[1, 4].set(11)  # row 1: no query sees slot 12
    kw = dict(kpool=4, n_pools=3, scale=SCALE, key_tile=4)
    got = dense_pool_mass(q, poisoned, qs, key_valid, first_key, **kw)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dense_pool_mass(q, latent, qs, key_valid, first_key, **kw)))


def test_dense_mass_no_gradient():
    q, latent, _, q_slots, key_valid, first_key = _case(2)
    g = jax.grad(lambda q, lat: dense_pool_mass(q, lat, q_slots, key_valid, first_key, kpool=4,
                                                n_pools=3, scale=SCALE).sum(), argnums=(0, 1))(q, latent)
    assert all(not np.asarray(x).any() for x in g)


def _selection(q_slots, key_valid, first_key, kpool, select_k, seed):
    """token_ids of expand_selection for random scores over each query's complete pools,
    with the tail: rows with fewer candidates than select_k put the tail in block n_sel."""
    n_pools = L // kpool
    rng = np.random.default_rng(seed)
    scores = jnp.asarray(rng.normal(size=(B, Q, n_pools)).astype(np.float32))
    n_vis = (q_slots - first_key[:, None] + 1) // kpool
    cand = jnp.arange(n_pools)[None, None, :] < n_vis[..., None]
    pools = pk.topk_pools(jnp.where(cand, scores, -jnp.inf), select_k)
    n_valid = jnp.cumsum(key_valid, axis=1)
    n_tok = jnp.where(q_slots >= 0, jnp.take_along_axis(n_valid, jnp.clip(q_slots, 0, L - 1), 1), 0)
    tail = pk.visible_tail(first_key, n_tok.astype(jnp.int32), q_slots, key_valid, kpool) if kpool > 1 else None
    width = select_k * kpool + (kpool - 1) + 2
    return pk.expand_selection(pools, first_key, tail, kpool=kpool, out_width=width), pools


@pytest.mark.parametrize("kpool,select_k", [(1, 3), (4, 2), (4, 3)])
@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mass_equals_float64(kpool, select_k, fp8):
    q, latent, scale, q_slots, key_valid, first_key = _case(10 + kpool, fp8=fp8)
    token_ids, pools = _selection(q_slots, key_valid, first_key, kpool, select_k, seed=select_k)
    got = sparse_pool_mass(q, latent, token_ids, scale, kpool=kpool, select_k=select_k, scale=SCALE)
    assert got.shape == (B, Q, select_k) and got.dtype == jnp.float32
    want = sparse_mass64(q, latent, scale, token_ids, kpool, select_k)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)
    # What the layout rule gives: mass exactly where a pool is selected, and it is sparse_mla's
    # distribution (kpool 1: every id a pool, the masses sum to 1 on a row with any id).
    sel = np.asarray(pools) >= 0
    assert ((np.asarray(got) > 0) == sel).all()
    if kpool == 4 and select_k == 3:  # some rows select fewer pools than K (the tail's block)
        assert sel.any() and (~sel).any()
    if kpool == 1:
        rows = np.asarray(token_ids >= 0).any(-1)
        np.testing.assert_allclose(np.asarray(got).sum(-1)[rows], 1.0, rtol=1e-5)


def test_sparse_mass_tail_is_in_no_pool():
    # One query, pools 0 and 1 selected of select_k 3, a tail of 3 tokens: block 2 holds the
    # tail and gets nothing; the two pools hold 1 minus the tail's mass.
    q, latent, _, _, _, _ = _case(5)
    ids = np.full((B, Q, 3 * 4 + 3), -1, np.int32)
    ids[:, :, :11] = np.arange(11)
    got = np.asarray(sparse_pool_mass(q, latent, jnp.asarray(ids), kpool=4, select_k=3, scale=SCALE))
    assert (got[..., 2] == 0).all() and (got[..., :2] > 0).all()
    tail = sparse_mass64(q, latent, None, jnp.asarray(np.where(ids >= 0, ids, -1)), 1, 11)[..., 8:].sum(-1)
    np.testing.assert_allclose(got.sum(-1), 1.0 - tail, rtol=1e-5)


def test_sparse_mass_shared_pool_and_wide_rows(monkeypatch):
    # A [1, L, CR] pool read by every row (the paged layout) and rows wider than ID_TILE.
    monkeypatch.setattr(am, "ID_TILE", 5)
    q, latent, _, _, _, _ = _case(6)
    rng = np.random.default_rng(6)
    ids = jnp.asarray(np.where(rng.random((B, Q, 12)) < 0.8, rng.integers(0, L, (B, Q, 12)), -1))
    ids = pk.compact_row(jnp.asarray(np.sort(np.asarray(ids), -1)[..., ::-1].copy()), 12)
    shared = latent[:1]
    got = sparse_pool_mass(q, shared, ids, kpool=1, select_k=12, scale=SCALE)
    want = sparse_mass64(q, jnp.broadcast_to(shared, latent.shape), None, ids, 1, 12)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)


def test_tp2_equals_unsharded():
    q, latent, _, q_slots, key_valid, first_key = _case(7)
    token_ids, _ = _selection(q_slots, key_valid, first_key, 4, 2, seed=7)
    mesh = tp_mesh(2, "auto")
    heads = P(None, None, "tp", None)

    def dense(q, axis):
        return dense_pool_mass(q, latent, q_slots, key_valid, first_key, kpool=4, n_pools=3,
                               scale=SCALE, key_tile=8, reduce_axis=axis)

    def sparse(q, axis):
        return sparse_pool_mass(q, latent, token_ids, kpool=4, select_k=2, scale=SCALE, reduce_axis=axis)

    for fn in (dense, sparse):
        tp = jax.jit(jax.shard_map(lambda q: fn(q, "tp"), mesh=mesh, in_specs=heads, out_specs=P()))(q)
        np.testing.assert_allclose(np.asarray(tp), np.asarray(fn(q, None)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("call,match", [
    (lambda c: dense_pool_mass(*c[:2], c[3][:, :2], *c[4:], kpool=4, n_pools=3, scale=SCALE), "q_slots"),
    (lambda c: dense_pool_mass(*c[:2], c[3], c[4][:, :5], c[5], kpool=4, n_pools=3, scale=SCALE), "key_valid"),
    (lambda c: dense_pool_mass(c[0], c[1], *c[3:], kpool=0, n_pools=3, scale=SCALE), "kpool"),
    (lambda c: dense_pool_mass(c[0], c[1], *c[3:], kpool=4, n_pools=3, scale=SCALE, key_tile=0), "key_tile"),
    (lambda c: dense_pool_mass(c[0], c[1][:1], *c[3:], kpool=4, n_pools=3, scale=SCALE), "latent"),
    (lambda c: sparse_pool_mass(c[0], c[1], jnp.zeros((B, Q, 7), jnp.int32), kpool=4, select_k=2,
                                scale=SCALE), "select_k \\* kpool"),
    (lambda c: sparse_pool_mass(c[0], c[1], jnp.zeros((B, Q, 8), jnp.int32), jnp.ones((B, 3)), kpool=4,
                                select_k=2, scale=SCALE), "latent_scale"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(_case(0))


def test_dense_mass_memory_is_a_key_tile_per_head():
    # Nothing as large as [B, Q, H, L] in the program (Q * H > CR, so the latent is smaller).
    rng = np.random.default_rng(9)
    length, nq, heads = 96, 6, 4
    q = jnp.asarray(rng.normal(size=(B, nq, heads, CR)).astype(np.float32))
    latent = jnp.asarray(rng.normal(size=(B, length, CR)).astype(np.float32))
    q_slots = jnp.asarray(np.full((B, nq), length - 1, np.int32))
    jaxpr = jax.make_jaxpr(lambda q, lat: dense_pool_mass(
        q, lat, q_slots, jnp.ones((B, length), bool), jnp.zeros((B,), jnp.int32), kpool=4,
        n_pools=length // 4, scale=SCALE, key_tile=8))(q, latent).jaxpr
    assert 0 < _largest_intermediate(jaxpr) < B * nq * heads * length
