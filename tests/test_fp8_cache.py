"""fp8 (e4m3) caches (issue 11, deliverable 1): made and refused, their bytes, the quantiser's
error bound, the kernels reading them, and the layer on them.

* ``init_cache`` / ``init_paged_cache`` take ``"fp8"`` / ``jnp.float8_e4m3fn`` and refuse
  every dtype that is neither a 16/32-bit float nor e4m3, naming ``dtype``.
* <= 560 bytes per token of capacity at GLM-5.3-Flash dims, everything included.
* Round trip: each element within half an e4m3 ulp (times the row's scale) of the input,
  hence within ``2**-4`` of the row's amax (``glm5_dsa_jax.cache.fp8``'s module doc).
* ``"xla"`` and ``"pallas_interpret"`` on an fp8 cache: the same top-k, bit for bit (ties
  included), outputs within float32 rounding (contiguous prefill + decode, paged steps, a
  RoPE model).
* fp8 against bf16 on the tiny preset: measured (seeds 0-2, 2 x 48 tokens) relative L2
  0.088-0.130 over every output and 0.030-0.031 over the rows whose selected set is the
  same (94.8-96.9 % of them; a changed selection is a different average, so those rows
  dominate). Bounds with a margin: 0.25 / 0.06 / 0.9. A missing scale (scales of 1) gives
  470-510, so the bounds catch it.
* A zero row and an all-padding chunk give no NaN; the writes stay in place (no copy or
  conversion of a whole buffer in the compiled decode step).
"""

import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.cache import fp8
from glm5_dsa_jax.decode import make_step
from glm5_dsa_jax.cache.fp8 import quantize_rows, dequantize_rows
from helpers import F32_REORDER, f32_layer, hidden_states, jitted_call, padded_batch, paged_scores_both
from helpers import rope_tiny as rope_cfg  # glm_moe_dsa: the cache row is [c, k_rot], 24 + 8 wide

CFG = gd.DsaConfig.tiny()
E4M3 = jnp.float8_e4m3fn
FEW = settings(max_examples=8, deadline=None)


# ----------------------------------------------------------------------------- make / refuse
@pytest.mark.parametrize("dtype", ["fp8", "FP8", E4M3, "float8_e4m3fn"])
def test_init_fp8_caches(dtype):
    cache = gd.init_cache(CFG, 2, 12, dtype=dtype)
    assert cache.dtype == E4M3 and cache.latent.dtype == E4M3 and cache.pooled.dtype == E4M3
    assert cache.latent_store.dtype == jnp.uint8  # bits on a CPU: written in place
    assert cache.latent_scale.shape == (2, 12) and cache.pooled_scale.shape == (2, 3)
    assert cache.latent_scale.dtype == cache.pooled_scale.dtype == jnp.float32
    assert cache.stage_keys.dtype == jnp.bfloat16  # the stage stays in a compute dtype
    paged = gd.init_paged_cache(CFG, 2, 5, 8, dtype=dtype)
    assert paged.latent_scale.shape == (5, 8) and paged.pooled_scale.shape == (5, 2)
    assert paged.latent_store.dtype == jnp.uint8 and paged.stage_keys.dtype == jnp.bfloat16
    # a layer stages in its compute dtype; a shared layer has no pooled scales
    layer = f32_layer(CFG, 1)
    assert layer.init_cache(1, 8, dtype=dtype).stage_keys.dtype == jnp.float32
    assert layer.init_paged_cache(1, 2, 8, dtype=dtype).stage_keys.dtype == jnp.float32
    shared = f32_layer(CFG, 2).init_cache(1, 8, dtype=dtype)
    assert shared.pooled_scale is None and shared.latent_scale.shape == (1, 8)


def test_float_caches_have_no_scales():
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        c, p = gd.init_cache(CFG, 1, 8, dtype=dt), gd.init_paged_cache(CFG, 1, 2, 8, dtype=dt)
        assert c.latent_scale is c.pooled_scale is p.latent_scale is p.pooled_scale is None


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.float64, "fp4", "float8_e5m2",
                                   jnp.float8_e4m3fnuz, "int4"])
def test_other_dtypes_refused(dtype):
    with pytest.raises(ValueError, match=r"cache dtype must be .* fp8 .*; got dtype="):
        gd.init_cache(CFG, 1, 8, dtype=dtype)
    with pytest.raises(ValueError, match="got dtype="):
        gd.init_paged_cache(CFG, 1, 2, 8, dtype=dtype)
    with pytest.raises(ValueError, match="got dtype="):
        f32_layer(CFG, 1).init_cache(1, 8, dtype=dtype)


# ----------------------------------------------------------------------------- bytes
def _nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def test_bytes_per_token_of_capacity():
    """At GLM-5.3-Flash dims (C 512, D 128, kpool 4): 512 + 4 + (128 + 4) / 4 = 549 bytes
    a token (+1 validity byte for the contiguous cache), everything included, <= 560."""
    cfg = gd.DsaConfig.glm53_flash()
    tokens = 8 * 131_072  # the paged bf16 bytes test's setup (tests/test_paged.py)
    paged = jax.eval_shape(lambda: gd.init_paged_cache(cfg, 8, tokens // 64, 64, dtype="fp8"))
    per_token = _nbytes(paged) / tokens
    assert 549 <= per_token <= 560, per_token
    for batch, length in ((1, 131_072), (8, 32_768), (1, 4096)):
        cache = jax.eval_shape(lambda: gd.init_cache(cfg, batch, length, dtype="fp8"))
        per_slot = _nbytes(cache) / (batch * length)
        assert 550 <= per_slot <= 560, (batch, length, per_slot)


# ----------------------------------------------------------------------------- quantiser
def _half_ulp(y):
    """Half an e4m3 ulp at ``|y|`` (3 mantissa bits; subnormal spacing 2**-9 below 2**-6)."""
    e = np.floor(np.log2(np.maximum(np.abs(y), 2.0**-6)))
    return 2.0 ** (e - 4)


@FEW
@given(seed=st.integers(0, 2**31 - 1), log_mag=st.floats(-30, 30), zero_rows=st.integers(0, 2))
def test_round_trip_error_bound(seed, log_mag, zero_rows):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 64)) * np.exp(rng.uniform(-6, 6, (5, 64))) * math.exp(log_mag)
    x[:zero_rows] = 0.0
    x = x.astype(np.float32)
    q, scale = quantize_rows(jnp.asarray(x))
    deq = np.asarray(dequantize_rows(q, scale), np.float64)
    q, scale = np.asarray(q, np.float64), np.asarray(scale, np.float64)
    assert np.isfinite(deq).all() and (scale > 0).all()
    amax = np.abs(x).max(-1)
    assert (deq[:zero_rows] == 0).all() and (scale[:zero_rows] == 1).all()
    np.testing.assert_array_equal(np.abs(q).max(-1)[amax > 0], 448.0)  # the row's amax -> 448
    err = np.abs(x - deq)
    # half an ulp of x / scale, times scale, plus float32 rounding of the divide and multiply
    bound = _half_ulp(x / scale[:, None]) * scale[:, None] + 2.0**-22 * np.abs(x)
    assert (err <= bound).all(), float((err / bound).max())
    assert (err <= 2.0**-4 * amax[:, None] * (1 + 2.0**-20)).all()


# ----------------------------------------------------------------------------- kernels
def _scores_both(q, w, keys, valid, first_key, q_pos, scale, kpool):
    return [np.asarray(pk.index_scores(q, w, keys, valid, first_key, q_pos, scale, kpool=kpool,
                                       implementation=i)) for i in ("xla", "pallas_interpret")]


@FEW
@given(seed=st.integers(0, 2**31 - 1), n_dup=st.integers(0, 6), dtype=st.sampled_from([jnp.bfloat16, jnp.float32]))
@pytest.mark.slow
def test_index_scores_fp8_same_topk_ties_included(seed, n_dup, dtype):
    """Duplicated pools tie exactly, and ReLU makes exact-zero plateaus: the top-k of both
    implementations is the same, bit for bit, contiguous and paged."""
    rng = np.random.default_rng(seed)
    b, nq, h, d, p, kp = 2, 3, 3, 16, 24, 2
    keys = rng.standard_normal((b, p, d)) * rng.uniform(0.1, 10, (b, p, 1))
    keys[:, p - n_dup:] = keys[:, :n_dup]  # exact duplicates: ties
    k8, scale = quantize_rows(jnp.asarray(keys, jnp.float32))
    q = jnp.asarray(rng.standard_normal((b, nq, h, d)), dtype)
    w = jnp.asarray(rng.standard_normal((b, nq, h)), jnp.float32)
    valid = jnp.asarray(rng.random((b, p)) < 0.9)
    first_key = jnp.asarray(rng.integers(0, 3, b), jnp.int32)
    q_pos = jnp.asarray(rng.integers(-1, p * kp + 3, (b, nq)), jnp.int32)
    a, c = _scores_both(q, w, k8, valid, first_key, q_pos, scale, kp)
    np.testing.assert_array_equal(np.isinf(a), np.isinf(c))
    np.testing.assert_allclose(a[np.isfinite(a)], c[np.isfinite(c)], rtol=1e-6, atol=1e-6)
    assert (a == 0).sum() > 0 or n_dup == 0 or not np.isfinite(a).any()  # zero plateaus occur
    for k in (4, 9):
        np.testing.assert_array_equal(pk.topk_pools(jnp.asarray(a), k), pk.topk_pools(jnp.asarray(c), k))
    # paged: the same keys in pages of 4 pools, in a shuffled page order
    pa, pc = paged_scores_both(rng, q, w, keys, q_pos, quantize_rows, kp)
    np.testing.assert_array_equal(np.isinf(pa), np.isinf(pc))
    np.testing.assert_allclose(pa[np.isfinite(pa)], pc[np.isfinite(pc)], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(pk.topk_pools(jnp.asarray(pa), 5), pk.topk_pools(jnp.asarray(pc), 5))


def test_index_scores_fp8_is_the_score_of_the_dequantised_keys():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 2, 3, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((1, 2, 3)), jnp.float32)
    k8, scale = quantize_rows(jnp.asarray(rng.standard_normal((1, 8, 16)) * 5, jnp.float32))
    args = (jnp.ones((1, 8), bool), jnp.zeros(1, jnp.int32), jnp.array([[31, 31]], jnp.int32))
    got = pk.index_scores(q, w, k8, *args, scale, kpool=4)
    want = pk.index_scores(q, w, dequantize_rows(k8, scale), *args, kpool=4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pooled_scale must be given exactly when pooled is float8_e4m3fn"):
        pk.index_scores(q, w, k8, *args, kpool=4)
    with pytest.raises(ValueError, match=r"pooled_scale must be \[B, P\] = \(1, 8\), got \(1, 7\)"):
        pk.index_scores(q, w, k8, *args, scale[:, :7], kpool=4)


@pytest.mark.parametrize("shared", [False, True])
def test_sparse_mla_fp8_both_implementations_and_dequantised_rows(shared):
    rng = np.random.default_rng(2)
    b, nq, h, cr, length = 2, 3, 4, 40, 30
    lat = rng.standard_normal((1 if shared else b, length, cr)) * rng.uniform(0.1, 10, (1, length, 1))
    lat[:, 5] = 0.0  # a zero row: scale 1, never NaN
    l8, scale = quantize_rows(jnp.asarray(lat, jnp.float32))
    q = jnp.asarray(rng.standard_normal((b, nq, h, cr)), jnp.float32)
    ids = jnp.asarray(rng.integers(-1, length, (b, nq, 8)), jnp.int32).at[0, 0].set(-1)
    kw = dict(scale=0.2, value_width=32)
    outs = [np.asarray(pk.sparse_mla(q, l8, ids, scale, implementation=i, **kw)) for i in ("xla", "pallas_interpret")]
    want = np.asarray(pk.sparse_mla(q, dequantize_rows(l8, scale), ids, **kw))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_allclose(outs[0], want, rtol=F32_REORDER, atol=F32_REORDER)
    np.testing.assert_allclose(outs[1], outs[0], rtol=F32_REORDER, atol=F32_REORDER)


# ----------------------------------------------------------------------------- the layer
def _run(layer, cfg, dtype, x, mask, prefill, paged=True):
    """Contiguous prefill of ``prefill`` slots then decode steps; and (``paged``) the same
    tokens, unmasked, through a paged cache the same way. Returns ``((topk, out)
    contiguous, (topk, out) paged or None)``. The layer runs under ``jax.jit``
    (``jitted_call``): one program per chunk shape and cache kind, the decode steps after
    the first reusing it (eagerly, each operation of the layer compiles on its own)."""
    f, state = jitted_call(layer)
    b, s = mask.shape
    cache = layer.init_cache(b, s + 4, dtype=dtype)
    out, topk, cache = f(state, x[:, :prefill], attention_mask=mask[:, :prefill], cache=cache)
    outs, tops = [out], [topk]
    for i in range(prefill, s):
        o, t, cache = f(state, x[:, i:i + 1], attention_mask=mask[:, i:i + 1], cache=cache)
        outs.append(o)
        tops.append(t)
    cont = (np.concatenate(tops, 1), np.concatenate([np.asarray(o, np.float32) for o in outs], 1))
    if not paged:
        return cont, None
    cache = layer.init_paged_cache(b, 2 * -(-s // 8) + 1, 8, dtype=dtype)
    outs, tops = [], []
    for lo, hi in [(0, prefill)] + [(i, i + 1) for i in range(prefill, s)]:
        o, t, cache = f(state, x[:, lo:hi], cache=cache)
        outs.append(o)
        tops.append(t)
    return cont, (np.concatenate(tops, 1), np.concatenate([np.asarray(o, np.float32) for o in outs], 1))


@pytest.mark.slow
def test_layer_xla_and_pallas_agree_on_fp8_caches():
    s, prefill = 10, 8
    x, mask = map(jnp.asarray, padded_batch(CFG, (0, 3), s, seed=3))  # left padding
    runs = [_run(f32_layer(CFG, 1, seed=4, implementation=impl, block_q=8), CFG, "fp8", x, mask, prefill)
            for impl in ("xla", "pallas_interpret")]
    for (ta, oa), (tb, ob) in zip(*runs):
        np.testing.assert_array_equal(ta, tb)
        assert (ta >= 0).any() and np.isfinite(oa).all()
        np.testing.assert_allclose(oa, ob, rtol=F32_REORDER, atol=F32_REORDER * np.abs(oa).max())


def test_rope_model_on_fp8_caches():
    """A RoPE row ``[c, k_rot]`` is quantised whole (one scale): close to a float32 cache.
    (The Pallas reading of such rows, scores over ``CR`` and values over ``V``, is
    ``test_sparse_mla_fp8_both_implementations_and_dequantised_rows``.) Measured: relative
    L2 0.023, every selected set the same."""
    cfg = rope_cfg()
    x = jnp.asarray(hidden_states(cfg, 2, 10, seed=3))
    mask = jnp.asarray(np.arange(10)[None] >= np.array([[0], [3]]))  # row 1 left-padded
    layer = f32_layer(cfg, 0, seed=4, block_q=8)
    (t8, o8), _ = _run(layer, cfg, "fp8", x, mask, 10, paged=False)
    (tf, of), _ = _run(layer, cfg, jnp.float32, x, mask, 10, paged=False)
    assert np.linalg.norm(o8 - of) / np.linalg.norm(of) < 0.05
    assert np.mean([set(u) == set(v) for u, v in zip(t8.reshape(-1, t8.shape[-1]), tf.reshape(-1, tf.shape[-1]))]) > 0.9


def _chunks(layer, f, state, dtype, x):
    """``((topk, out), cache)`` of ``x [2, 48]`` in two chunks of 24 (one program: ``f,
    state = jitted_call(layer)``) on a cache of ``dtype``; the cache is the one after the
    first chunk."""
    cache = layer.init_cache(2, 48, dtype=dtype)
    o1, t1, cache = f(state, x[:, :24], cache=cache)
    o2, t2, _ = f(state, x[:, 24:], cache=cache)
    return (np.concatenate([t1, t2], 1), np.concatenate([np.asarray(o, np.float32) for o in (o1, o2)], 1)), cache


def test_fp8_close_to_bf16_on_tiny_and_a_missing_scale_is_caught():
    layer = gd.DsaAttention(CFG, 1, rngs=nnx.Rngs(0))
    x = jnp.asarray(hidden_states(CFG, 2, 48, seed=0), jnp.bfloat16)
    f, state = jitted_call(layer)
    ((t8, o8), cache), ((tb, ob), _) = (_chunks(layer, f, state, dt, x) for dt in ("fp8", jnp.bfloat16))
    same = np.array([set(u) == set(v) for u, v in zip(t8.reshape(-1, t8.shape[-1]), tb.reshape(-1, tb.shape[-1]))])
    same = same.reshape(t8.shape[:2])
    rel = np.linalg.norm(o8 - ob) / np.linalg.norm(ob)
    rel_same = np.linalg.norm(o8[same] - ob[same]) / np.linalg.norm(ob[same])
    assert same.mean() >= 0.9 and rel <= 0.25 and rel_same <= 0.06, (same.mean(), rel, rel_same)
    # The second chunk on the first's rows with every scale 1 (a missing scale): far out.
    bad = cache.replace(latent_scale=jnp.ones_like(cache.latent_scale),
                        pooled_scale=jnp.ones_like(cache.pooled_scale), length=jnp.int32(24))
    o_bad = np.asarray(f(state, x[:, 24:], cache=bad)[0], np.float32)
    assert np.linalg.norm(o_bad - ob[:, 24:]) / np.linalg.norm(ob[:, 24:]) > 10 * 0.25


def test_zero_rows_and_all_padding_chunk_give_no_nan():
    layer = f32_layer(CFG, 1, seed=5)
    cache = layer.init_cache(2, 16, dtype="fp8")
    x = jnp.asarray(hidden_states(CFG, 2, 6, seed=6))
    out, topk, cache = layer(x[:, :3], attention_mask=jnp.zeros((2, 3), bool), cache=cache)
    assert (np.asarray(out) == 0).all() and (np.asarray(topk) == -1).all()
    np.testing.assert_array_equal(cache.latent_scale[:, :3], 1.0)  # zero rows: scale 1
    np.testing.assert_array_equal(np.asarray(cache.latent[:, :3], np.float32), 0.0)
    out, topk, cache = layer(x[:, 3:], cache=cache)
    assert np.isfinite(np.asarray(out)).all() and (np.asarray(topk)[:, -1] >= 0).any()
    # a zero hidden state (a zero latent row after the norm's input) is finite too
    z = jnp.zeros((2, 3, CFG.hidden_size), jnp.float32)
    out, _, _ = layer(z, cache=cache)
    assert np.isfinite(np.asarray(out)).all()


# ----------------------------------------------------------------------------- in place
_WHOLE = re.compile(r"= (\w+)\[([0-9,]*)\](?:\{[^}]*\})? (copy|convert)\(")


def _whole_buffer_ops(hlo: str, buffers) -> list[str]:
    """``copy`` / ``convert`` instructions whose result has as many elements as a cache
    buffer (any element type, any shape): a pass over the whole capacity."""
    sizes = {a.size for a in buffers}
    return [line.strip()[:160] for line in hlo.splitlines()
            if (m := _WHOLE.search(line)) and math.prod(int(d) for d in m.group(2).split(",") if d) in sizes]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_decode_step_writes_fp8_buffers_in_place(kind):
    layer = gd.DsaAttention(CFG, 1, rngs=nnx.Rngs(0))
    layer.POOL_TILE = 512  # a score tile smaller than the buffer: the loop converts each tile it reads
    step, params = make_step(layer)
    # capacities whose element counts no other tensor of the step has
    # (and more than POOL_TILE pools)
    cache = layer.init_cache(1, 4096, dtype="fp8") if kind == "contiguous" else layer.init_paged_cache(1, 100, 28, dtype="fp8")
    x = jnp.zeros((1, 1, CFG.hidden_size), layer.dtype)
    hlo = step.lower(params, x, jnp.ones((1, 1), bool), cache).compile().as_text()
    bufs = (cache.latent_store, cache.pooled_store)
    assert all(a.dtype == jnp.uint8 for a in bufs)
    assert _whole_buffer_ops(hlo, bufs) == []
    # the checker sees what XLA:CPU does to an e4m3 buffer (a convert to f16 and back)
    buf = jnp.zeros(cache.latent_store.shape, E4M3)
    f = jax.jit(lambda a, r: jax.lax.dynamic_update_slice(a, r, (0, 0, 0)), donate_argnums=0)
    seen = f.lower(buf, jnp.ones((1, 1, buf.shape[2]), E4M3)).compile().as_text()
    assert _whole_buffer_ops(seen, bufs)


# ----------------------------------------------------------------------------- capability
def _gpu(cc):
    return types.SimpleNamespace(platform="gpu", compute_capability=cc)


def test_fp8_refused_where_triton_cannot_convert_e4m3(monkeypatch):
    with pytest.raises(ValueError, match=r"compute capability is 8\.0.*float8_e4m3fn|float8_e4m3fn.*8\.0"):
        fp8.check_readable(E4M3, "pallas", [_gpu("8.0")])
    for ok in (("8.9", "pallas"), ("9.0", "pallas"), ("8.0", "xla"), ("8.0", "pallas_interpret")):
        fp8.check_readable(E4M3, ok[1], [_gpu(ok[0])])
    fp8.check_readable(jnp.bfloat16, "pallas", [_gpu("8.0")])  # a bf16 cache: fine
    fp8.check_readable(E4M3, "pallas", jax.devices())  # CPU devices: not a Triton target
    # the layer refuses such a cache when made and when given
    layer = f32_layer(CFG, 1, implementation="pallas")
    cache = gd.init_cache(CFG, 1, 8, dtype="fp8")
    monkeypatch.setattr(fp8, "_devices_of", lambda leaf: [_gpu("8.0")])
    with pytest.raises(ValueError, match="compute capability is 8.0"):
        layer.init_cache(1, 8, dtype="fp8")
    with pytest.raises(ValueError, match="compute capability is 8.0"):
        layer.init_paged_cache(1, 2, 8, dtype="fp8")
    with pytest.raises(ValueError, match="compute capability is 8.0"):
        layer(jnp.zeros((1, 1, CFG.hidden_size)), cache=cache)


@pytest.mark.lowering
def test_fp8_kernels_lower_for_cuda():
    """The Pallas-to-Triton lowering of the three fp8 readers at GLM-5.3-Flash widths (no
    GPU needed; compiling the Triton IR to cubin needs the ``gpu-compile`` extra and, for
    e4m3, sm_89+)."""
    from pallas_kernels._common import lower_for_cuda, triton_calls

    sds, bf, f8, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, E4M3, jnp.float32, jnp.int32
    q, w, qp = sds((2, 1, 32, 128), bf), sds((2, 1, 32), f32), sds((2, 1), i32)
    calls = triton_calls(lower_for_cuda(
        lambda *a: pk.index_scores(*a, kpool=4, implementation="pallas"),
        q, w, sds((2, 4096, 128), f8), sds((2, 4096), jnp.bool_), sds((2,), i32), qp, sds((2, 4096), f32)))
    calls += triton_calls(lower_for_cuda(
        lambda *a: pk.index_scores_paged(*a, kpool=4, implementation="pallas"),
        q, w, sds((64, 16, 128), f8), sds((2, 32), i32), sds((2,), i32), qp, sds((64, 16), f32)))
    calls += triton_calls(lower_for_cuda(
        lambda *a: pk.sparse_mla(*a, scale=0.06, value_width=512, implementation="pallas"),
        sds((2, 1, 64, 576), bf), sds((1, 8192, 576), f8), sds((2, 1, 2051), i32), sds((1, 8192), f32)))
    assert [c["name"] for c in calls] == ["index_scores", "index_scores_paged", "sparse_mla",
                                          "sparse_mla_combine"]
