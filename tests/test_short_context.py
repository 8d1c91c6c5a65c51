"""The short-context path (``DsaAttention.choose_pools``): a query whose complete pools all fit
the selection (``live_pools <= select_k``) takes every candidate pool without a score or a
top-k (``pk.visible_pool_ids``), with exactly the ids the scored path selects.

* ``visible_pool_ids`` equals ``topk_pools(index_scores(...))`` on every short query: holes
  in ``pool_valid``, any ``first_key``, padding queries.
* The layer: a schedule whose rows cross the threshold at different steps (batches all short,
  mixed, all long) gives, in one compiled decode program, under ``xla`` the outputs and
  top-k of its scored path (the method as it was, patched in), and under
  ``pallas_interpret`` (which scores every row) those of ``xla``'s short path; a
  left-padded contiguous prefill too.
* Routing (``"xla"``): a tile of short queries takes the unscored ids (the unscored side of
  the ``lax.cond``) whatever the scored side returns; a mixed tile keeps the short rows' ids
  (a ``where``) and scores the others. The kernels score and select every row, short or
  not (one selection a step, no control flow and no ``where`` between two: issue 46); the
  first test is why their short rows' ids are these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.decode import PagedDecoder
from helpers import ATOL, RTOL, f32_layer, padded_batch
from test_paged import make_schedule


def scored_only(self, qi, w, cache, q_pos, select_k):
    """``choose_pools`` before the short path: every query scored and selected."""
    n_live = cache.live_pools(q_pos)
    if self.implementation == "xla" and (cache.STREAM_PREFILL or q_pos.shape[1] == 1):
        return self.score_and_select(qi, w, cache, q_pos, select_k)
    return self.select_pools(self.score_pools(qi, w, cache, q_pos), select_k, n_live)


def test_visible_pool_ids_are_the_top_k_of_every_short_query():
    rng = np.random.default_rng(0)
    b, q, p, k, kp, d, hi = 4, 9, 14, 6, 4, 8, 3
    checked = 0
    for _ in range(6):
        valid = rng.random((b, p)) < 0.8
        first_key = rng.integers(0, 5, b).astype(np.int32)
        q_pos = rng.integers(-1, p * kp + 5, (b, q)).astype(np.int32)
        qi = jnp.asarray(rng.standard_normal((b, q, hi, d)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((b, q, hi)), jnp.float32)
        keys = jnp.asarray(rng.standard_normal((b, p, d)), jnp.float32)
        scores = pk.index_scores_reference(qi, w, keys, jnp.asarray(valid), jnp.asarray(first_key),
                                           jnp.asarray(q_pos), kpool=kp)
        want = np.asarray(pk.topk_pools_reference(scores, k))
        got = np.asarray(pk.visible_pool_ids(jnp.asarray(valid), jnp.asarray(first_key), jnp.asarray(q_pos),
                                             select_k=k, kpool=kp))
        short = np.clip((q_pos - first_key[:, None] + 1) // kp, 0, p) <= k
        np.testing.assert_array_equal(got[short], want[short])
        checked += short.sum()
        assert (~short).any()  # the draw holds long queries too (their ids differ in general)
    assert checked > 50 and got.dtype == np.int32


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
@pytest.mark.slow
def test_rows_crossing_the_threshold_equal_the_scored_path(implementation, monkeypatch):
    """Tiny: 4 pools of 4 tokens are selected, so a row is short up to 19 tokens. Rows of 22,
    24 and 9 tokens join and leave two rows one token a step: steps where both rows are
    short, one is, none is."""
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1, seed=1, implementation=implementation)
    steps, _, where = make_schedule(cfg, (22, 24, 9), max_seqs=2, seed=3, chunk_sizes=(1,))
    # The schedule holds steps of every kind: (rows short, rows long) in {(2, 0), (1, 1), (0, 2)}.
    kinds = {}
    for seq in where:
        for n, (row, step, _) in enumerate(seq, 1):
            kinds.setdefault(step, []).append(n // cfg.index_kpool <= cfg.max_select_k)
    assert {(sum(k), len(k) - sum(k)) for k in kinds.values() if len(k) == 2} >= {(2, 0), (1, 1), (0, 2)}

    def run(layer):
        dec = PagedDecoder(layer, 2, num_pages=8, page_size=16)
        res = []
        for x, mask, rel in steps:
            out, topk = dec(x, mask)
            res.append((np.asarray(out), np.asarray(topk)))
            if rel.any():
                dec.release(rel)
        return res, dec.step.traces

    got, traces = run(layer)
    if implementation == "xla":  # against its own scored path, patched in
        monkeypatch.setattr(gd.DsaAttention, "choose_pools", scored_only)
        want, traces_want = run(layer)
    else:  # the kernels score every row: against "xla", whose short rows take all_pools
        want, traces_want = run(f32_layer(cfg, 1, seed=1, implementation="xla"))
    assert traces == 1 and traces_want == 1  # one program each (the second traced after any patch)
    for (o, t), (wo, wt) in zip(got, want):
        np.testing.assert_array_equal(t, wt)
        np.testing.assert_allclose(o, wo, atol=ATOL, rtol=RTOL)


def test_left_padded_prefill_equals_the_scored_path(monkeypatch):
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1, seed=2)
    x, mask = padded_batch(cfg, (0, 3, 9), 26, seed=4)
    mask[1, 12] = False  # a hole inside a row: an invalid pool among the visible ones
    call = jax.jit(lambda x, m: layer(x, attention_mask=m, cache=layer.init_cache(3, 32)))
    out, topk, _ = call(jnp.asarray(x), jnp.asarray(mask))
    monkeypatch.setattr(gd.DsaAttention, "choose_pools", scored_only)
    call = jax.jit(lambda x, m: layer(x, attention_mask=m, cache=layer.init_cache(3, 32)))
    want_out, want_topk, _ = call(jnp.asarray(x), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(topk), np.asarray(want_topk))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=ATOL, rtol=RTOL)


def test_short_tiles_skip_the_scored_side(monkeypatch):
    """With the scored side returning nonsense (every id 0), a tile of short queries still
    selects right (it never takes that side); in a mixed tile only the long rows change."""
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1, seed=5)
    x, mask = padded_batch(cfg, (0, 0), 40, seed=6)
    mask[1, 12:] = False  # row 1: 12 tokens, short at every query; row 0 long from its 20th token
    want_out, want_topk, _ = layer(jnp.asarray(x), attention_mask=jnp.asarray(mask), cache=layer.init_cache(2, 48))
    monkeypatch.setattr(gd.DsaAttention, "score_and_select", lambda self, qi, w, cache, q_pos, k: jnp.zeros(
        q_pos.shape + (k,), jnp.int32))
    monkeypatch.setattr(gd.DsaAttention, "select_pools", lambda self, scores, k, n_live=None: jnp.zeros(
        scores.shape[:2] + (k,), jnp.int32))
    # Fresh traces (an eager call would replay the program compiled before the patch).
    call = jax.jit(lambda x, m, c: layer(x, attention_mask=m, cache=c))
    _, topk, _ = call(jnp.asarray(x[1:, :12]), jnp.ones((1, 12), bool), layer.init_cache(1, 48))
    np.testing.assert_array_equal(np.asarray(topk[0]), np.asarray(want_topk[1, :12]))
    _, topk, _ = call(jnp.asarray(x), jnp.asarray(mask), layer.init_cache(2, 48))
    topk, want_topk = np.asarray(topk), np.asarray(want_topk)
    np.testing.assert_array_equal(topk[1], want_topk[1])
    np.testing.assert_array_equal(topk[0, :19], want_topk[0, :19])  # short queries of the long row
    assert (topk[0, 19:] != want_topk[0, 19:]).any(axis=-1).all()
