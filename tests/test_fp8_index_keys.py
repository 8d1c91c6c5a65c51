"""int8 pooled indexer keys of an fp8 cache (issue 26, deliverable 4: recall >= 0.99 at 32K):
``glm5_dsa_jax.cache.fp8``'s ``IndexFormat`` / ``quantize_index`` and the scoring kernels'
group scales (``pallas_kernels._dtypes.INT8``).

* The quantiser: every element within half a step (``amax / 254``) of its 32-column group;
  an all-zero group exact (scale 1); a non-finite group's scale NaN (never a candidate).
* The kernels score int8 keys as the float32 scores of the dequantised keys: ``"xla"`` bit
  for bit, ``"pallas_interpret"`` to float32 rounding with the same top-k, contiguous and
  paged; the backward gives the queries the gradient of the dequantised keys' scores.
* Caches, layer, decoders, export / load: the format travels everywhere the e4m3 one does,
  and is refused where it differs.
* Bytes: GLM-5.3-Flash 552 a token (<= 560); the recall itself is ``glm5-dsa accuracy``'s
  (docs/fp8.md), with its 4K figure kept in tests/test_fp8_accuracy.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.cache.fp8 import IndexFormat, dequantize_index, index_format, quantize_index
from helpers import paged_scores_both

FEW = settings(max_examples=8, deadline=None)


@FEW
@given(seed=st.integers(0, 2**31 - 1), zero_group=st.integers(0, 4))
def test_int8_keys_within_half_a_step_of_their_group(seed, zero_group):
    fmt = index_format(128, "int8")
    assert (fmt.group, fmt.n_groups, fmt.scale_shape, fmt.bytes_per_pool) == (32, 4, (4,), 144)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 128)) * 10.0 ** np.repeat(rng.uniform(-6, 6, (5, 4)), 32, axis=-1)
    x[:, 32 * zero_group: 32 * zero_group + 32] = 0.0  # zero_group 4: none zeroed
    x = x.astype(np.float32)
    q, s = quantize_index(jnp.asarray(x), fmt)
    assert q.dtype == jnp.int8 and s.shape == (5, 4) and s.dtype == jnp.float32
    assert np.abs(np.asarray(q, np.int32)).max() <= 127
    deq = np.asarray(dequantize_index(q, s), np.float64)
    amax = np.abs(x).reshape(5, 4, 32).max(-1)
    step = np.where(amax > 0, amax / 127, 1.0)
    err = np.abs(deq - x).reshape(5, 4, 32)
    assert (err <= 0.5 * step[..., None] * (1 + 2.0**-16)).all()
    if zero_group < 4:
        assert (deq[:, 32 * zero_group: 32 * zero_group + 32] == 0).all()
        assert (np.asarray(s)[:, zero_group] == 1).all()


def test_non_finite_group_gets_a_nan_scale_and_no_candidate():
    x = np.ones((1, 3, 64), np.float32)
    x[0, 1, 40] = np.nan
    x[0, 2, 3] = np.inf
    q, s = quantize_index(jnp.asarray(x), index_format(64, "int8"))
    s = np.asarray(s)
    assert np.isnan(s[0, 1, 1]) and np.isfinite(s[0, 1, 0]) and np.isnan(s[0, 2, 0]) and (s[0, 0] == 1 / 127).all()
    qi = jnp.ones((1, 1, 2, 64), jnp.float32)
    w = jnp.ones((1, 1, 2), jnp.float32)
    args = (jnp.ones((1, 3), bool), jnp.zeros(1, jnp.int32), jnp.array([[20]], jnp.int32))
    for impl in ("xla", "pallas_interpret"):
        got = np.asarray(pk.index_scores(qi, w, q, *args, jnp.asarray(s), kpool=2, implementation=impl))
        assert np.isfinite(got[0, 0, 0]) and np.isneginf(got[0, 0, 1:]).all(), (impl, got)


def test_e4m3_keys_and_refusals():
    assert index_format(128) == IndexFormat(128, "e4m3", 32) and index_format(128).scale_shape == ()
    assert index_format(16, "int8").n_groups == 1  # 32 does not divide 16: one group (the tiny preset)
    with pytest.raises(ValueError, match="index_keys must be one of"):
        index_format(128, "int4")
    with pytest.raises(ValueError, match="index_keys must be one of"):
        gd.init_cache(gd.DsaConfig.preset("tiny"), 1, 16, dtype="fp8", index_keys="fp4")


def _keys(rng, shape):
    return rng.standard_normal(shape) * rng.uniform(0.1, 10, shape[:-1] + (1,))


def _reorder_bound(q, w, keys):
    """``[B, Q, P]``: what float32 summation order can move a score of ``keys [B, P, D]``,
    ``2 D eps32 sum_h |w_h| sum_d |q_hd k_pd| / sqrt(D)`` (two sums, each within ``D eps``
    of its terms' magnitudes), float64."""
    d = q.shape[-1]
    mag = np.einsum("bqh,bqhd,bpd->bqp", np.abs(w), np.abs(q), np.abs(keys))
    return 2 * d * np.finfo(np.float32).eps * mag / np.sqrt(d) + 1e-30


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_int8_scores_are_the_dequantised_keys_scores(seed, dtype):
    """``"xla"`` is the float32 reference on the dequantised keys, and the Triton kernel
    (interpreted) matches it, within float32 reordering (``_reorder_bound``), with the same
    top-k, contiguous and paged (shuffled pages)."""
    rng = np.random.default_rng(seed)
    b, nq, h, d, p, kp = 2, 3, 3, 64, 24, 2
    keys = _keys(rng, (b, p, d))
    keys[:, p - 3:] = keys[:, :3]  # duplicates: exact ties
    k8, scale = quantize_index(jnp.asarray(keys, jnp.float32), index_format(d, "int8"))
    assert scale.shape == (b, p, 2)
    q = jnp.asarray(rng.standard_normal((b, nq, h, d)), dtype)
    w = jnp.asarray(rng.standard_normal((b, nq, h)), jnp.float32)
    valid = jnp.asarray(rng.random((b, p)) < 0.9)
    first_key = jnp.asarray(rng.integers(0, 3, b), jnp.int32)
    q_pos = jnp.asarray(rng.integers(-1, p * kp + 3, (b, nq)), jnp.int32)
    args = (valid, first_key, q_pos)
    deq = np.asarray(dequantize_index(k8, scale), np.float64)
    bound = _reorder_bound(np.asarray(q, np.float64), np.asarray(w, np.float64), deq)  # [B, Q, P]
    x = np.asarray(pk.index_scores(q, w, k8, *args, scale, kpool=kp))
    ref = np.asarray(pk.index_scores_reference(q.astype(jnp.float32), w, jnp.asarray(deq, jnp.float32), *args,
                                               kpool=kp))
    c = np.asarray(pk.index_scores(q, w, k8, *args, scale, kpool=kp, implementation="pallas_interpret"))
    for got in (ref, c):
        np.testing.assert_array_equal(np.isinf(x), np.isinf(got))
        live = np.isfinite(x)
        assert (np.abs(x[live] - got[live]) <= bound[live]).all()
    np.testing.assert_array_equal(pk.topk_pools(jnp.asarray(x), 5), pk.topk_pools(jnp.asarray(c), 5))
    # paged: the same keys in pages of 4 pools, in a shuffled page order
    pa, pc = paged_scores_both(rng, q, w, keys, q_pos, lambda x: quantize_index(x, index_format(d, "int8")), kp)
    np.testing.assert_array_equal(np.isinf(pa), np.isinf(pc))
    np.testing.assert_allclose(pa[np.isfinite(pa)], pc[np.isfinite(pc)], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(pk.topk_pools(jnp.asarray(pa), 5), pk.topk_pools(jnp.asarray(pc), 5))


def test_int8_scale_shapes_refused():
    rng = np.random.default_rng(1)
    k8, scale = quantize_index(jnp.asarray(_keys(rng, (1, 8, 64)), jnp.float32), index_format(64, "int8"))
    q = jnp.asarray(rng.standard_normal((1, 2, 3, 64)), jnp.float32)
    w = jnp.ones((1, 2, 3), jnp.float32)
    args = (jnp.ones((1, 8), bool), jnp.zeros(1, jnp.int32), jnp.array([[31, 31]], jnp.int32))
    with pytest.raises(ValueError, match=r"pooled_scale of int8 pooled must be \[B, P, G\] with G dividing "
                                         r"the key width D = 64; got None"):
        pk.index_scores(q, w, k8, *args, kpool=4)
    with pytest.raises(ValueError, match=r"G dividing the key width D = 64; got \(1, 8, 3\)"):
        pk.index_scores(q, w, k8, *args, jnp.ones((1, 8, 3)), kpool=4)
    with pytest.raises(ValueError, match=r"pooled_scale must be \[B, P, G\] = \(1, 8\), got \(1, 7\)"):
        pk.index_scores(q, w, k8, *args, scale[:, :7], kpool=4)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_int8_keys_get_no_gradient_and_the_queries_the_dequantised_one(impl):
    rng = np.random.default_rng(2)
    k8, scale = quantize_index(jnp.asarray(_keys(rng, (1, 8, 64)), jnp.float32), index_format(64, "int8"))
    q = jnp.asarray(rng.standard_normal((1, 2, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((1, 2, 3)), jnp.float32)
    args = (jnp.ones((1, 8), bool), jnp.zeros(1, jnp.int32), jnp.array([[31, 20]], jnp.int32))
    g = jnp.asarray(rng.standard_normal((1, 2, 8)), jnp.float32)

    def loss(q, w, keys, scale=None):
        s = pk.index_scores(q, w, keys, *args, scale, kpool=4, implementation=impl)
        return jnp.sum(jnp.where(jnp.isfinite(s), s, 0.0) * g)

    dq, dw = jax.grad(loss, argnums=(0, 1))(q, w, k8, scale)
    want_dq, want_dw = jax.grad(loss, argnums=(0, 1))(q, w, dequantize_index(k8, scale))
    np.testing.assert_allclose(dq, want_dq, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(dq).sum()) > 0


def _layer(impl):
    cfg = dataclasses.replace(gd.DsaConfig.preset("tiny"), index_head_dim=64)  # two 32-column groups
    assert cfg.hidden_size == 48
    return gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0), implementation=impl, dtype=jnp.float32,
                           param_dtype=jnp.float32)


def _run(layer, cache, x):
    out, topk, cache = layer(x[:, :37], cache=cache)
    out2, topk2, cache = layer(x[:, 37:38], cache=cache)
    return np.asarray(out), np.asarray(topk), np.asarray(out2), np.asarray(topk2), cache


@pytest.mark.slow
def test_layer_reads_int8_keys_contiguous_and_paged():
    """A rotated int8-key fp8 cache: ``"xla"`` and ``"pallas_interpret"`` give the same top-k
    (a chunk, then a decode step) and outputs to float32 rounding, on both caches; the
    cache holds int8 keys and ``[.., G]`` scales."""
    x = jax.random.normal(jax.random.key(1), (2, 40, 48), jnp.float32)
    kw = dict(dtype="fp8", rotate_index=True, index_keys="int8")
    for paged in (False, True):
        runs = []
        for impl in ("xla", "pallas_interpret"):
            layer = _layer(impl)
            cache = layer.init_paged_cache(2, 16, 8, **kw) if paged else layer.init_cache(2, 64, **kw)
            runs.append(_run(layer, cache, x))
        (o, t, o2, t2, cache), (po, pt, po2, pt2, _) = runs
        assert cache.pooled_dtype == jnp.int8 and cache.pooled_scale.shape[-1] == 2
        np.testing.assert_array_equal(t, pt)
        np.testing.assert_array_equal(t2, pt2)
        np.testing.assert_allclose(o, po, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(o2, po2, rtol=1e-5, atol=1e-5)


def test_int8_keys_select_as_the_float_cache_nearly():
    """The int8 keys' selection against a float32 cache of the same layer (tiny preset, 2 x
    38 queries over up to 9 pools of the 64-wide keys): at least as close as e4m3 keys'."""
    x = jax.random.normal(jax.random.key(3), (2, 40, 48), jnp.float32)
    layer = _layer("xla")
    _, t32, *_ = _run(layer, layer.init_cache(2, 64, dtype=jnp.float32), x)
    agree = {}
    for keys in ("e4m3", "int8"):
        _, t, *_ = _run(layer, layer.init_cache(2, 64, dtype="fp8", rotate_index=True, index_keys=keys), x)
        agree[keys] = np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, (a >= 0).sum())
                               for a, b in zip(t32.reshape(-1, t32.shape[-1]), t.reshape(-1, t.shape[-1]))])
    assert agree["int8"] >= agree["e4m3"] and agree["int8"] > 0.95, agree


def test_decoders_export_and_load_carry_the_key_format():
    layer = _layer("xla")
    x = jax.random.normal(jax.random.key(1), (2, 40, 48), jnp.float32)
    dec = gd.PagedDecoder(layer, 2, 16, 8, cache_dtype="fp8", rotate_index=True, index_keys="int8")
    assert dec.cache.pooled_dtype == jnp.int8
    assert gd.DsaDecoder(layer, 2, 64, cache_dtype="fp8", index_keys="int8").cache.pooled_scale.shape == (2, 16, 2)
    c = layer.init_paged_cache(2, 16, 8, dtype="fp8", rotate_index=True, index_keys="int8")
    _, _, c = layer(x[:, :37], cache=c)
    e = c.export(1)
    assert e.pooled.dtype == np.int8 and e.pooled_scale.shape == (9, 2)
    target = layer.init_paged_cache(2, 20, 16, dtype="fp8", rotate_index=True, index_keys="int8").load(0, e)
    o1, t1, _ = layer(x[:, 37:38], cache=c)
    o2, t2, _ = layer(jnp.concatenate([x[1:2, 37:38], x[0:1, 37:38]]), cache=target)
    np.testing.assert_array_equal(np.asarray(t1)[1], np.asarray(t2)[0])
    np.testing.assert_allclose(np.asarray(o1)[1], np.asarray(o2)[0], rtol=1e-6, atol=1e-6)
    e4m3 = layer.init_paged_cache(2, 20, 16, dtype="fp8", rotate_index=True)
    before = jax.tree.map(np.asarray, e4m3)
    with pytest.raises(ValueError, match=r"index_keys int8 \(the cache's: e4m3\); index_scale_groups 2 "
                                         r"\(the cache's: 1\); nothing was written"):
        e4m3.load(0, e)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, e4m3))
    bad = dataclasses.replace(e, pooled_scale=e.pooled_scale[:, 0])
    with pytest.raises(ValueError, match=r"ExportedSequence.pooled_scale must be float32 \(9, 'G'\)"):
        target.load(1, bad)


def test_bytes_per_token_with_int8_keys():
    """GLM-5.3-Flash with int8 keys: 512 + 4 + (128 + 16) / 4 = 552 bytes a token (+1
    validity byte contiguous), <= 560; DeepSeek-V3.2 / GLM-5: 596 + 144 = 740 a token."""
    from test_fp8_cache import _nbytes
    cfg = gd.DsaConfig.glm53_flash()
    tokens = 8 * 131_072
    paged = jax.eval_shape(lambda: gd.init_paged_cache(cfg, 8, tokens // 64, 64, dtype="fp8", index_keys="int8"))
    assert 552 <= _nbytes(paged) / tokens <= 560, _nbytes(paged) / tokens
    cache = jax.eval_shape(lambda: gd.init_cache(cfg, 1, 131_072, dtype="fp8", index_keys="int8"))
    assert 553 <= _nbytes(cache) / 131_072 <= 560
    assert index_format(128, "int8").bytes_per_pool == 144 and index_format(128).bytes_per_pool == 132


@pytest.mark.lowering
def test_int8_scoring_lowers_for_cuda():
    """The Triton scoring kernels on int8 keys with group scales lower for CUDA at
    GLM-5.3-Flash widths (no GPU needed; int8 converts on any capability)."""
    from pallas_kernels._common import lower_for_cuda, triton_calls

    sds, bf, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    q, w, qp = sds((2, 1, 32, 128), f32), sds((2, 1, 32), f32), sds((2, 1), i32)
    calls = triton_calls(lower_for_cuda(
        lambda *a: pk.index_scores(*a, kpool=4, implementation="pallas"),
        q, w, sds((2, 4096, 128), jnp.int8), sds((2, 4096), jnp.bool_), sds((2,), i32), qp, sds((2, 4096, 4), f32)))
    calls += triton_calls(lower_for_cuda(
        lambda *a: pk.index_scores_paged(*a, kpool=4, implementation="pallas"),
        sds((2, 1, 32, 128), bf), w, sds((64, 16, 128), jnp.int8), sds((2, 32), i32), sds((2,), i32), qp,
        sds((64, 16, 4), f32)))
    assert [c["name"] for c in calls] == ["index_scores", "index_scores_paged"]


@pytest.mark.slow
def test_fork_shares_int8_key_pages():
    """A fork of an int8-key sequence (mid-page, mid-pool: 37 tokens) decodes as its source."""
    layer = _layer("xla")
    x = jax.random.normal(jax.random.key(4), (3, 40, 48), jnp.float32)
    c = layer.init_paged_cache(3, 24, 8, dtype="fp8", rotate_index=True, index_keys="int8")
    mask = jnp.asarray(np.arange(3)[:, None] < 2) & jnp.ones((3, 37), bool)
    _, _, c = layer(x[:, :37], mask, cache=c)
    c = c.fork(np.array([1]), np.array([2]), np.array([37]))
    step = jnp.concatenate([x[:2, 37:38], x[1:2, 37:38]])
    out, topk, _ = layer(step, cache=c)
    np.testing.assert_array_equal(np.asarray(topk)[1], np.asarray(topk)[2])
    np.testing.assert_allclose(np.asarray(out)[1], np.asarray(out)[2], rtol=1e-6, atol=1e-6)
