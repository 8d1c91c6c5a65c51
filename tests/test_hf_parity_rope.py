"""The RoPE model types against Hugging Face: ``glm_moe_dsa`` (GLM-5 / GLM-5.2) and
``deepseek_v32`` (DeepSeek-V3.2), with YaRN scaling on (and off), in float32.

* Prefill with left padding, a full then a shared layer (GLM-5), tie-aware selection checks
  (as ``test_hf_parity``): outputs equal HF's on every query whose selected set equals HF's,
  and HF's attention on our selection everywhere.
* Chunked prefill + decode (``DsaDecoder``) equals the one-shot call bit for bit in its
  top-k, and HF stepped with its ``DynamicCache``.
* ``position_ids`` override the positions as in HF; the paged cache (positions within each
  sequence) equals HF on each sequence alone; ``pallas_interpret`` and TP 2 give the
  ``xla`` layer's top-k.

Selections are judged by HF's own scores (``hf_oracle.hf_selection``, as in
``test_hf_parity``), with a top-k of 4 so that most query rows see more tokens than it
keeps (the rows where a wrong indexer, e.g. its RoPE in the wrong layout, changes the
selection); each test asserts that most rows do. HF's top-k of a query that sees fewer
than ``index_topk`` tokens also names masked ones (``torch.topk`` over ``-inf`` scores);
its attention mask hides them. They are dropped before comparing sets (``visible``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.decode import DsaDecoder, PagedDecoder
from glm5_dsa_jax.parallel.sharding import shard_layer
from helpers import ATOL, F32_REORDER, RTOL, YARN, check_selection, jitted_call, rope_tiny, same_sets
from helpers import padded_batch as padded
from hf_oracle import hf_attend_on, hf_attention, hf_forward, hf_selection, hf_stepped, layer_from_hf

TYPES = ["glm_moe_dsa", "deepseek_v32"]


def small(model_type: str, rope=YARN, **kw) -> gd.DsaConfig:
    """``rope_tiny`` with 4 heads and a top-k of 4: most query rows of these prompts see
    more tokens than the top-k keeps, where a wrong score changes the selection."""
    return rope_tiny(model_type, rope, **dict(num_attention_heads=4, index_topk=4) | kw)


def visible(topk, mask):
    """HF's picks a query can see (at or before it, not padding); the rest -1."""
    topk = np.asarray(topk)
    t = np.arange(topk.shape[1])[None, :, None]
    ok = (topk >= 0) & (topk <= t)
    ok &= np.take_along_axis(np.broadcast_to(mask[:, None, :], (mask.shape[0], topk.shape[1], mask.shape[1])),
                             np.clip(topk, 0, mask.shape[1] - 1), axis=2)
    return np.where(ok, topk, -1)


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("rope", [YARN, {"rope_type": "default", "rope_theta": 10_000.0}], ids=["yarn", "default"])
def test_prefill_with_left_padding_matches_hf(model_type, rope):
    cfg = small(model_type, rope)
    x, mask = padded(cfg, (0, 3, 7), 13, seed=1)
    attn = hf_attention(cfg, 0, seed=1)
    layer = layer_from_hf(cfg, 0, attn)
    hf_out, hf_topk = hf_forward(attn, x, mask)
    hf_topk = visible(hf_topk, mask)
    out, ours = map(np.asarray, layer(jnp.asarray(x), attention_mask=jnp.asarray(mask)))
    assert ours.shape == (3, 13, cfg.out_width)
    _, sparse, rows = check_selection(cfg, mask, ours, hf_selection(attn))
    assert sparse * 2 >= rows, (sparse, rows)  # most rows see more than the top-k keeps
    live = mask & (ours >= 0).any(-1)
    np.testing.assert_allclose(out[live], hf_attend_on(attn, x, mask, ours)[live], atol=ATOL, rtol=RTOL)
    same = same_sets(ours, hf_topk, live)
    assert same.sum() > live.sum() // 2
    np.testing.assert_allclose(out[same], hf_out[same], atol=ATOL, rtol=RTOL)
    if cfg.has_indexer(1):
        return
    # GLM-5: the shared layer attends on the full layer's selection.
    attn2 = hf_attention(cfg, 1, seed=2)
    shared = layer_from_hf(cfg, 1, attn2)
    out2, top2 = shared(jnp.asarray(x), attention_mask=jnp.asarray(mask), prev_topk=jnp.asarray(ours))
    np.testing.assert_array_equal(np.asarray(top2), ours)
    hf_out2, _ = hf_forward(attn2, x, mask, prev_topk=ours)
    np.testing.assert_allclose(np.asarray(out2)[live], hf_out2[live], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("model_type", TYPES)
def test_chunked_decode_equals_one_shot_and_hf_stepped(model_type):
    cfg = small(model_type)
    chunks = [5, 3, 1, 1, 1, 1, 1, 1, 1]
    x, mask = padded(cfg, (0, 4), sum(chunks), seed=2)
    attn = hf_attention(cfg, 0, seed=3)
    layer = layer_from_hf(cfg, 0, attn)
    one_out, one_topk = map(np.asarray, layer(jnp.asarray(x), attention_mask=jnp.asarray(mask)))
    dec = DsaDecoder(layer, 2, 24)
    outs, tops, pos = [], [], 0
    for n in chunks:
        o, t = dec(x[:, pos:pos + n], mask[:, pos:pos + n])
        outs.append(np.asarray(o))
        tops.append(np.asarray(t))
        pos += n
    out, top = np.concatenate(outs, 1), np.concatenate(tops, 1)
    np.testing.assert_array_equal(top, one_topk)
    np.testing.assert_allclose(out, one_out, atol=F32_REORDER, rtol=F32_REORDER)
    hf_out, hf_topk = hf_stepped(attn, cfg, x, mask, chunks)
    hf_topk = visible(hf_topk, mask)
    _, sparse, rows = check_selection(cfg, mask, top, hf_selection(attn))
    assert sparse * 2 >= rows, (sparse, rows)
    live = mask & (top >= 0).any(-1)
    same = same_sets(top, hf_topk, live)
    assert same.sum() > live.sum() // 2
    np.testing.assert_allclose(out[same], hf_out[same], atol=ATOL, rtol=RTOL)


def test_position_ids_override_like_hf():
    cfg = small("deepseek_v32")
    x, mask = padded(cfg, (0, 0), 9, seed=4)
    attn = hf_attention(cfg, 0, seed=4)
    layer = layer_from_hf(cfg, 0, attn)
    pos = np.stack([np.arange(500, 509), np.arange(3, 12)])
    out, top = map(np.asarray, layer(jnp.asarray(x), attention_mask=jnp.asarray(mask),
                                     position_ids=jnp.asarray(pos)))
    ref = hf_attend_on(attn, x, mask, top, position_ids=pos)
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)
    default, _ = layer(jnp.asarray(x), attention_mask=jnp.asarray(mask))
    assert not np.allclose(np.asarray(default)[0], out[0])  # the positions were used
    with pytest.raises(ValueError, match=r"position_ids must be \[B, S\] = \(2, 9\)"):
        layer(jnp.asarray(x), position_ids=jnp.zeros((2, 8), jnp.int32))


@pytest.mark.parametrize("model_type", TYPES)
def test_paged_sequences_match_hf_alone(model_type):
    """Two sequences through a paged cache in ragged chunks (one decoding while the other
    prefills, then a release and a third sequence in the freed row): each equals HF on it
    alone, positions from 0."""
    cfg = small(model_type)
    attn = hf_attention(cfg, 0, seed=5)
    layer = layer_from_hf(cfg, 0, attn)
    rng = np.random.default_rng(5)
    seqs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in (11, 6, 9)]
    dec = PagedDecoder(layer, 2, num_pages=6, page_size=8)
    got = [[] for _ in seqs]
    counts = np.zeros(3, int)  # check_selection's: tied, sparse, valid rows

    def step(parts, width):
        x = np.zeros((2, width, cfg.hidden_size), np.float32)
        m = np.zeros((2, width), bool)
        for row, (i, lo, hi, cols) in parts.items():
            x[row, cols] = seqs[i][lo:hi]
            m[row, cols] = True
        out, top = dec(x, m)
        for row, (i, lo, hi, cols) in parts.items():
            got[i].append((np.asarray(out)[row, cols], np.asarray(top)[row, cols]))

    step({0: (0, 0, 5, [0, 2, 3, 5, 6]), 1: (1, 0, 2, [1, 4])}, 7)
    step({0: (0, 5, 11, [0, 1, 2, 3, 4, 6]), 1: (1, 2, 3, [5])}, 7)
    for k in range(3, 6):
        step({1: (1, k, k + 1, [0])}, 1)
    dec.release(np.array([True, False]))
    step({0: (2, 0, 9, list(range(9)))}, 9)
    for i, x in enumerate(seqs):
        out = np.concatenate([o for o, _ in got[i]])
        top = np.concatenate([t for _, t in got[i]])
        m1 = np.ones((1, len(x)), bool)
        hf_out, hf_topk = hf_forward(attn, x[None], m1)
        counts += np.asarray(check_selection(cfg, m1, top[None], hf_selection(attn)))
        np.testing.assert_allclose(out, hf_attend_on(attn, x[None], m1, top[None])[0], atol=ATOL, rtol=RTOL)
    assert counts[1] * 2 >= counts[2], counts  # most rows see more than the top-k keeps


def test_pallas_interpret_and_tp2_give_the_xla_selection():
    """Each layer under ``jax.jit`` (``jitted_call``: one program a layer, where an eager
    call compiles each of its operations on its own)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    cfg = small("glm_moe_dsa")
    x, mask = padded(cfg, (0, 5), 12, seed=6)
    attn = hf_attention(cfg, 0, seed=6)
    x, mask = jnp.asarray(x), jnp.asarray(mask)

    def run(layer):
        f, state = jitted_call(layer)
        return f(state, x, attention_mask=mask)

    ref_out, ref_top = run(layer_from_hf(cfg, 0, attn))
    pallas = layer_from_hf(cfg, 0, attn)
    pallas.implementation = "pallas_interpret"
    out, top = run(pallas)
    np.testing.assert_array_equal(np.asarray(top), np.asarray(ref_top))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=ATOL, rtol=RTOL)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    out, top = run(shard_layer(layer_from_hf(cfg, 0, attn), mesh))
    np.testing.assert_array_equal(np.asarray(top), np.asarray(ref_top))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=ATOL, rtol=RTOL)
