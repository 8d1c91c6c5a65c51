"""Torch-free helpers the tests share: batches, tolerances and the tie-aware selection check.

``check_selection`` compares our top-k with HF's as *sets* of token ids per valid query row;
where they differ, the only allowed cause is HF's arbitrary choice among pools whose scores
tie at the cutoff (see ``test_hf_parity``'s module doc).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# Float32 parity tolerance against HF; the error budget is in test_hf_parity's module doc.
ATOL = RTOL = 3e-5


def padded_batch(cfg, pads, seq, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(pads), seq, cfg.hidden_size)).astype(np.float32)
    mask = np.ones((len(pads), seq), bool)
    for b, p in enumerate(pads):
        mask[b, :p] = False
    return x, mask


def check_selection(cfg, layer, x, mask, ours, theirs):
    """Sets equal per valid row, or ours a valid top-k of the same scores (ties)."""
    scores, first_key = layer.selection_scores(jnp.asarray(x), jnp.asarray(mask))
    scores, first_key = np.asarray(scores), np.asarray(first_key)
    kp = cfg.index_kpool
    n_tied = 0
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not mask[b, t]:
                assert (ours[b, t] == -1).all(), "padding query must select nothing"
                assert (theirs[b, t] == -1).all()
                continue
            a, h = set(ours[b, t][ours[b, t] >= 0]), set(theirs[b, t][theirs[b, t] >= 0])
            assert len(ours[b, t][ours[b, t] >= 0]) == len(a), "a row repeats a token"
            if a == h:
                continue
            n_tied += 1
            assert len(a) == len(h), (b, t, sorted(a), sorted(h))
            pool_of = lambda ids: {(i - first_key[b]) // kp for i in ids}
            row = scores[b, t]
            full_a = {p for p in pool_of(a) if 0 <= p < len(row) and np.isfinite(row[p])
                      and all(first_key[b] + p * kp + j in a for j in range(kp))}
            full_h = {p for p in pool_of(h) if 0 <= p < len(row) and np.isfinite(row[p])
                      and all(first_key[b] + p * kp + j in h for j in range(kp))}
            tail_a = a - {first_key[b] + p * kp + j for p in full_a for j in range(kp)}
            tail_h = h - {first_key[b] + p * kp + j for p in full_h for j in range(kp)}
            assert tail_a == tail_h, (b, t, sorted(tail_a), sorted(tail_h))
            assert len(full_a) == len(full_h)
            left_out = [row[p] for p in range(len(row)) if np.isfinite(row[p]) and p not in full_a]
            if left_out:
                assert min(row[p] for p in full_a) >= max(left_out) - 1e-5, (b, t)
    return n_tied
