"""The decode engine: chunked prefill + decode == one-shot prefill == HF stepped with its
``DynamicCache``; one compilation for a whole decode; bounded prefill memory; bad input.

Float32 throughout. Chunked and one-shot runs read the same cache rows through the same
kernels, so their top-k rows are compared bit for bit and their outputs at 1e-5 (only the
order of the per-chunk projections differs). The HF comparison uses the tolerance and the
tie handling of test_hf_parity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.decode import DsaDecoder, make_step
from hf_oracle import hf_attention, hf_selection, hf_stepped, layer_from_hf
from helpers import ATOL, F32_REORDER, RTOL, check_selection, f32_layer, hidden_states, padded_batch, same_sets

CHUNKS = [6, 3, 1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # 29 tokens: prefill chunks, then decode


def batch(cfg, seq=29, seed=0, kind="left"):
    if kind == "left":  # left padding of different depths: sequences of different lengths
        return padded_batch(cfg, (0, 5, 13), seq, seed)
    # "gaps": holes inside prefill chunks and decode steps, right padding, left + holes
    x, mask = padded_batch(cfg, (0, 0, 5), seq, seed)
    mask[0, [2, 7, 8, 17, 22]] = False
    mask[1, 20:] = False
    mask[2, [11, 19]] = False
    return x, mask


def run_chunks(dec, x, mask, chunks, prev=None):
    outs, tops, pos = [], [], 0
    for n in chunks:
        p = None if prev is None else jnp.asarray(prev[:, pos:pos + n])
        o, t = dec(x[:, pos:pos + n], mask[:, pos:pos + n], prev_topk=p)
        outs.append(np.asarray(o))
        tops.append(np.asarray(t))
        pos += n
    return np.concatenate(outs, 1), np.concatenate(tops, 1)


@pytest.mark.parametrize("kpool,topk,tail,kind", [
    (1, 5, False, "left"), (1, 5, True, "left"), (4, 8, True, "left"), (4, 8, False, "left"),
    (4, 8, True, "gaps"),  # holes and right padding: HF reads them like the one-shot call
])
def test_chunked_decode_equals_one_shot_and_hf(kpool, topk, tail, kind):
    cfg = gd.DsaConfig.tiny(index_kpool=kpool, index_topk=topk, index_kpool_always_select_tail=tail)
    x, mask = batch(cfg, seed=kpool, kind=kind)
    attn, attn2 = hf_attention(cfg, 1, seed=5), hf_attention(cfg, 2, seed=6)
    layer, shared = layer_from_hf(cfg, 1, attn), layer_from_hf(cfg, 2, attn2)

    one_out, one_topk = map(np.asarray, layer(jnp.asarray(x), attention_mask=jnp.asarray(mask)))
    dec = DsaDecoder(layer, 3, 40)
    out, top = run_chunks(dec, x, mask, CHUNKS)
    np.testing.assert_array_equal(top, one_topk)
    np.testing.assert_allclose(out, one_out, atol=F32_REORDER, rtol=F32_REORDER)

    # The shared layer decodes on the full layer's selection, chunk by chunk.
    dec2 = DsaDecoder(shared, 3, 40)
    out2, top2 = run_chunks(dec2, x, mask, CHUNKS, prev=top)
    ref2, _ = map(np.asarray, shared(jnp.asarray(x), attention_mask=jnp.asarray(mask), prev_topk=jnp.asarray(top)))
    np.testing.assert_allclose(out2, ref2, atol=F32_REORDER, rtol=F32_REORDER)

    hf_out, hf_topk = hf_stepped(attn, cfg, x, mask, CHUNKS)
    _, sparse, rows = check_selection(cfg, mask, top, hf_selection(attn))
    # Enough rows see more pools than the top-k keeps (where a wrong score shows); holes
    # leave few complete pools, so the "gaps" batch tests the mask, not the scores.
    assert kind == "gaps" or sparse * 3 >= rows, (sparse, rows)
    live = mask & (top >= 0).any(-1)
    same = same_sets(top, hf_topk, live)
    assert same.sum() > live.sum() // 2
    np.testing.assert_allclose(out[same], hf_out[same], atol=ATOL, rtol=RTOL)
    assert (out[~live] == 0).all()


def test_one_compilation_for_64_decode_steps():
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1)
    dec = DsaDecoder(layer, 2, 96)
    rng = np.random.default_rng(0)
    dec(rng.standard_normal((2, 16, cfg.hidden_size)).astype(np.float32))
    after_prefill = dec.step.traces
    for _ in range(64):
        dec(rng.standard_normal((2, 1, cfg.hidden_size)).astype(np.float32))
    assert dec.step.traces - after_prefill == 1
    assert int(dec.cache.length) == 80 == dec.length


def test_long_prefill_stays_within_its_memory_budget():
    """Prefill scratch memory grows linearly with the prompt (tiles of ``block_q`` rows),
    and at 4,096 tokens stays below a single [S, pools] float32 score matrix (16 MiB on
    the tiny config; an [S, S] one would be 64 MiB)."""
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1, block_q=64)
    step, params = make_step(layer)

    def temp_bytes(s):
        cache = jax.eval_shape(lambda: layer.init_cache(1, s))
        x = jax.ShapeDtypeStruct((1, s, cfg.hidden_size), jnp.float32)
        m = jax.ShapeDtypeStruct((1, s), jnp.bool_)
        return step.lower(params, x, m, cache).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(2048), temp_bytes(4096)
    assert large < 16 * 2**20, large
    assert large < 2.6 * small, (small, large)  # a quadratic term would make it ~4x


def snapshot(cache):
    return [np.asarray(a).copy() for a in jax.tree.leaves(cache)]


def test_overflowing_chunk_is_refused_and_cache_kept():
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1)
    x = hidden_states(cfg, 2, 10, seed=0)
    dec = DsaDecoder(layer, 2, 12)
    dec(x[:, :8])
    before = snapshot(dec.cache)
    with pytest.raises(ValueError, match="does not fit the cache: 8 of 12"):
        dec(x[:, :5])
    for a, b in zip(before, snapshot(dec.cache)):
        np.testing.assert_array_equal(a, b)
    # the eager layer call checks the same
    cache = layer.init_cache(2, 12)
    _, _, cache = layer(jnp.asarray(x[:, :8]), cache=cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="does not fit the cache"):
        layer(jnp.asarray(x[:, :5]), cache=cache)
    for a, b in zip(before, snapshot(cache)):
        np.testing.assert_array_equal(a, b)
    # and inside a user's own jit, an overflowing chunk writes nothing
    step, params = make_step(layer, donate=False)
    _, _, after = step(params, jnp.asarray(x[:, :5]), jnp.ones((2, 5), bool), cache)
    for a, b in zip(before, snapshot(after)):
        np.testing.assert_array_equal(a, b)


def test_bad_shapes_and_foreign_caches_raise():
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1)
    x = jnp.ones((2, 3, cfg.hidden_size))
    cache = layer.init_cache(2, 8)
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, S, hidden=48\]"):
        layer(jnp.ones((2, 3, 47)), cache=cache)
    with pytest.raises(ValueError, match="attention_mask must be"):
        layer(x, attention_mask=jnp.ones((2, 4), bool), cache=cache)
    with pytest.raises(ValueError, match="batch size"):
        layer(x, cache=layer.init_cache(3, 8))
    other = gd.DsaConfig.tiny(kv_lora_rank=24)
    other_layer = f32_layer(other, 1)
    with pytest.raises(ValueError, match="another config"):
        layer(x, cache=other_layer.init_cache(2, 8))
    shared = f32_layer(cfg, 2)
    with pytest.raises(ValueError, match="indexer state"):
        layer(x, cache=shared.init_cache(2, 8))
    with pytest.raises(ValueError, match="max_length"):
        layer.init_cache(2, 0)


def test_nan_in_one_sequence_stays_there():
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1)
    x, mask = padded_batch(cfg, (0, 0, 4), 12, seed=1)
    clean = DsaDecoder(layer, 3, 16)
    ref, ref_topk = run_chunks(clean, x, mask, [8, 1, 1, 1, 1])
    bad = x.copy()
    bad[0, 5] = np.nan  # a real token of sequence 0
    bad[2, 1] = np.nan  # a padding token of sequence 2: never read
    dec = DsaDecoder(layer, 3, 16)
    out, topk = run_chunks(dec, bad, mask, [8, 1, 1, 1, 1])
    np.testing.assert_array_equal(out[1:], ref[1:])
    np.testing.assert_array_equal(topk[1:], ref_topk[1:])
    for name, a, b in zip(("latent", "pooled"), (dec.cache.latent, dec.cache.pooled), (clean.cache.latent, clean.cache.pooled)):
        np.testing.assert_array_equal(np.asarray(a)[1:], np.asarray(b)[1:], err_msg=name)
    assert np.isnan(out[0, 5:]).any()
