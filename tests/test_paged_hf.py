"""The paged cache against Hugging Face ``glm5_next``: every sequence of a schedule (joins,
ragged chunks beside other sequences' decode steps, releases) equals HF run on that
sequence alone, with the tie-aware selection check of the parity tests; a shared layer
on the same schedule equals HF's shared layer on the full layer's selection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.decode import make_step
from helpers import ATOL, RTOL, check_selection, same_sets
from hf_oracle import hf_attend_on, hf_attention, hf_forward, hf_selection, layer_from_hf
from test_paged import eager_release, make_schedule, per_sequence


@pytest.mark.parametrize("kpool,topk,tail", [(4, 8, True), (2, 8, False)])
def test_each_sequence_of_a_schedule_equals_hf_alone(kpool, topk, tail):
    cfg = gd.DsaConfig.tiny(index_kpool=kpool, index_topk=topk, index_kpool_always_select_tail=tail)
    attn_full, attn_shared = hf_attention(cfg, 1, seed=1), hf_attention(cfg, 2, seed=2)
    full, shared = layer_from_hf(cfg, 1, attn_full), layer_from_hf(cfg, 2, attn_shared)
    steps, seqs, where = make_schedule(cfg, (33, 7, 52, 18), max_seqs=2, seed=11, chunk_sizes=(8, 1, 1))
    step, params = make_step(full)
    step2, params2 = make_step(shared)
    release = jax.jit(eager_release)
    cache, cache2 = full.init_paged_cache(2, 10, 16), shared.init_paged_cache(2, 10, 16)
    results, results2 = [], []
    for x, mask, rel in steps:
        x, mask = jnp.asarray(x), jnp.asarray(mask)
        out, ids, cache = step(params, x, mask, cache)
        out2, _, cache2 = step2(params2, x, mask, cache2, ids)
        results.append((np.asarray(out), np.asarray(ids)))
        results2.append((np.asarray(out2), np.asarray(ids)))
        if rel.any():
            cache, cache2 = release(cache, jnp.asarray(rel)), release(cache2, jnp.asarray(rel))
    n_same = n_rows = 0
    counts = np.zeros(3, int)  # check_selection's: tied, sparse, valid rows
    for i, x in enumerate(seqs):
        out, ours = per_sequence(results, where, i)
        out2, _ = per_sequence(results2, where, i)
        x1, m1 = x[None], np.ones((1, len(x)), bool)
        hf_out, hf_topk = hf_forward(attn_full, x1, m1)
        counts += np.asarray(check_selection(cfg, m1, ours[None], hf_selection(attn_full)))
        live = (ours >= 0).any(-1)
        np.testing.assert_allclose(out[live], hf_attend_on(attn_full, x1, m1, ours[None])[0][live],
                                   atol=ATOL, rtol=RTOL)
        same = same_sets(ours, hf_topk[0], live)
        np.testing.assert_allclose(out[same], hf_out[0][same], atol=ATOL, rtol=RTOL)
        hf_out2, _ = hf_forward(attn_shared, x1, m1, prev_topk=ours[None])
        np.testing.assert_allclose(out2[live], hf_out2[0][live], atol=ATOL, rtol=RTOL)
        n_same, n_rows = n_same + same.sum(), n_rows + live.sum()
    assert n_same > n_rows // 2
    assert counts[1] * 2 >= counts[2], counts  # most rows see more than the top-k keeps
