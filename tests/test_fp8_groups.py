"""fp8 latent group scales and the indexer's Hadamard rotation (issue 26, deliverable 4):
``glm5_dsa_jax.cache.fp8``'s ``LatentFormat``, ``quantize_latent`` and ``hadamard``.

* One group (a NoPE model's ``"group"`` format, and the ``"row"`` layout) is
  ``quantize_rows`` bit for bit: the layout before this change stays selectable.
* Every group keeps the row quantiser's bound with its own amax; a RoPE row whose ``k_rot`` is
  1e6 times its ``c`` keeps ``c`` (the row layout rounds most of ``c`` to zero).
* Bytes a latent row: DeepSeek-V3.2 / GLM-5 580 -> 596 (<= 660; vLLM's 656), GLM-5.3-Flash
  516 (549 with its pooled keys, <= 560).
* ``hadamard``: orthogonal, scores kept to float32 rounding (measured ``max|s_rot - s| /
  max|s|`` below 1e-6). Whether it raises the fp8 indexer's recall is measured by
  ``glm5-dsa accuracy``, not asserted here.
"""

import numpy as np
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

from glm5_dsa_jax.cache.fp8 import (LatentFormat, dequantize_latent, dequantize_rows, hadamard, latent_format,
                                    quantize_latent, quantize_rows)

FEW = settings(max_examples=8, deadline=None)


def test_one_group_is_the_row_quantiser_bit_for_bit():
    rng = np.random.default_rng(0)
    for fmt, width in ((latent_format(32), 32), (latent_format(24, 8, "row"), 32)):
        assert fmt.n_groups == 1
        x = jnp.asarray(rng.standard_normal((3, 5, width)) * 10.0 ** rng.uniform(-3, 3, (3, 5, 1)), jnp.float32)
        q, s = quantize_latent(x, fmt)
        q0, s0 = quantize_rows(x)
        assert s.shape == (3, 5, 1)
        np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q0, np.float32))
        np.testing.assert_array_equal(np.asarray(s[..., 0]), np.asarray(s0))
        np.testing.assert_array_equal(np.asarray(dequantize_latent(q, s, fmt)), np.asarray(dequantize_rows(q0, s0)))


@FEW
@given(seed=st.integers(0, 2**31 - 1), zero_group=st.integers(0, 4))
def test_each_group_within_its_own_amax(seed, zero_group):
    fmt = LatentFormat(24, 8, "group", 8)  # groups of 8, 8, 8 and k_rot 8
    assert fmt.n_groups == 4 and fmt.group_widths == (8, 8, 8, 8)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 32)) * 10.0 ** np.repeat(rng.uniform(-6, 6, (6, 4)), 8, axis=-1)
    x[:, 8 * zero_group: 8 * zero_group + 8] = 0.0  # zero_group 4: none zeroed
    x = x.astype(np.float32)
    q, s = quantize_latent(jnp.asarray(x), fmt)
    deq = np.asarray(dequantize_latent(q, s, fmt), np.float64)
    amax = np.abs(x).reshape(6, 4, 8).max(-1)
    assert np.isfinite(deq).all() and (np.asarray(s) > 0).all()
    err = np.abs(deq - x).reshape(6, 4, 8)
    assert (err <= 2.0**-4 * amax[..., None] * (1 + 2.0**-20)).all()
    if zero_group < 4:
        assert (deq[:, 8 * zero_group: 8 * zero_group + 8] == 0).all()
        assert (np.asarray(s)[:, zero_group] == 1).all()


def test_k_rot_no_longer_sets_the_latent_scale():
    """The issue's x1e6 collapse in one row: ``k_rot`` 1e6 times ``c``."""
    rng = np.random.default_rng(1)
    c = rng.standard_normal((16, 512)).astype(np.float32)
    x = jnp.asarray(np.concatenate([c, 1e6 * rng.standard_normal((16, 64)).astype(np.float32)], -1))
    rel = {}
    for layout in ("row", "group"):
        fmt = latent_format(512, 64, layout)
        deq = np.asarray(dequantize_latent(*quantize_latent(x, fmt), fmt))[:, :512]
        rel[layout] = np.linalg.norm(deq - c) / np.linalg.norm(c)
    assert rel["row"] > 0.9  # most of c rounds to zero
    assert rel["group"] < 0.04, rel  # e4m3's relative rounding (<= 2**-4 an element)


def test_bytes_per_token():
    ds = {layout: latent_format(512, 64, layout).bytes_per_token for layout in ("row", "group")}
    assert ds == {"row": 580, "group": 596}
    assert ds["group"] <= 660  # the budget; vLLM's fp8_ds_mla row: 656
    flash = latent_format(512, 0)
    assert flash.n_groups == 1 and flash.bytes_per_token == 516
    assert flash.bytes_per_token + (128 + 4) / 4 <= 560  # + pooled keys at kpool 4: 549


def test_bad_formats_and_rows_refused():
    with pytest.raises(ValueError, match="layout"):
        LatentFormat(512, 64, "block")
    with pytest.raises(ValueError, match="group must divide value_width 40"):
        LatentFormat(40, 8, "group", 128)
    fmt = latent_format(24, 8)  # 128 does not divide 24: one latent group and k_rot's
    assert fmt.group_widths == (24, 8)
    with pytest.raises(ValueError, match="32 wide"):
        quantize_latent(jnp.zeros((2, 30)), fmt)
    q, s = quantize_latent(jnp.ones((2, 32)), LatentFormat(24, 8, "group", 8))
    with pytest.raises(ValueError, match="n_groups = 2"):
        dequantize_latent(q, s, fmt)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(jnp.zeros((2, 24)))


def test_hadamard_rotation_keeps_scores():
    rng = np.random.default_rng(2)
    d = 128
    rot = np.asarray(hadamard(jnp.eye(d, dtype=jnp.float32)), np.float64)
    np.testing.assert_allclose(rot @ rot.T, np.eye(d), atol=1e-6)
    q = rng.standard_normal((64, d)).astype(np.float32)
    k = rng.standard_normal((256, d)).astype(np.float32)
    s = q @ k.T
    s_rot = np.asarray(hadamard(jnp.asarray(q))) @ np.asarray(hadamard(jnp.asarray(k))).T
    assert np.abs(s_rot - s).max() / np.abs(s).max() < 1e-6


# ----------------------------------------------------------------------------- sparse_mla
def _mla_operands(fmt, seed=0, b=2, nq=3, h=4, length=10, w=6, rot_scale=10.0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, nq, h, fmt.width)), jnp.float32)
    rows = rng.standard_normal((b, length, fmt.width)).astype(np.float32)
    rows[..., fmt.value_width:] *= rot_scale  # k_rot larger than c: the groups differ
    latent, scale = quantize_latent(jnp.asarray(rows), fmt)
    ids = jnp.asarray(rng.integers(-1, length, (b, nq, w)), jnp.int32)
    return q, latent, scale, ids


@pytest.mark.parametrize("layout", ["row", "group"])
def test_sparse_mla_reads_group_scales_as_the_dequantised_rows(layout):
    """``"xla"``: the output and ``dq`` equal those of the float rows ``dequantize_latent``
    gives (float32 rounding); ``group_columns`` is ``LatentFormat.column_groups``."""
    import jax
    import pallas_kernels as pk
    from pallas_kernels._mla import group_columns
    fmt = LatentFormat(24, 8, layout, 8)
    np.testing.assert_array_equal(group_columns(32, 24, fmt.n_groups), fmt.column_groups())
    q, latent, scale, ids = _mla_operands(fmt)
    deq = dequantize_latent(latent, scale, fmt)
    kw = dict(scale=0.2, value_width=24)
    got = pk.sparse_mla(q, latent, ids, scale, **kw)
    want = pk.sparse_mla(q, deq, ids, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    dq = jax.grad(lambda x: pk.sparse_mla(x, latent, ids, scale, **kw).sum())(q)
    dq_want = jax.grad(lambda x: pk.sparse_mla(x, deq, ids, **kw).sum())(q)
    np.testing.assert_allclose(np.asarray(dq), np.asarray(dq_want), rtol=2e-5,
                               atol=2e-5 * float(jnp.abs(dq_want).max()))


def test_one_group_runs_the_row_kernels_bit_for_bit():
    import pallas_kernels as pk
    fmt = latent_format(24, 8, "row")
    q, latent, scale, ids = _mla_operands(fmt)
    assert scale.shape[-1] == 1
    for impl in ("xla", "pallas_interpret"):
        a = pk.sparse_mla(q, latent, ids, scale, scale=0.2, value_width=24, implementation=impl)
        b = pk.sparse_mla(q, latent, ids, scale[..., 0], scale=0.2, value_width=24, implementation=impl)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fmt, block_c", [
    (LatentFormat(32, 16, "group", 16), 16),  # every chunk in one group (DS-V3.2's case)
    (LatentFormat(32, 16, "group", 16), None),  # default block_c 64: one chunk, 3 groups
    (LatentFormat(24, 8, "group", 24), None),  # rope_tiny's format, one chunk of 32
])
def test_triton_sparse_mla_reads_group_scales(fmt, block_c):
    """``"pallas_interpret"`` (the Triton kernels) on group scales: the output and ``dq``
    equal ``"xla"``'s to float32 rounding, whether a column chunk holds one group or
    several (``_mla.chunk_groups``); with ``num_splits`` 2 too."""
    import jax
    import pallas_kernels as pk
    q, latent, scale, ids = _mla_operands(fmt, length=40, w=24, h=3)
    kw = dict(scale=0.2, value_width=fmt.value_width)
    want = pk.sparse_mla(q, latent, ids, scale, **kw)
    dq_want = jax.grad(lambda x: pk.sparse_mla(x, latent, ids, scale, **kw).sum())(q)
    tol = lambda x: dict(rtol=2e-5, atol=2e-5 * float(jnp.abs(x).max()))
    for splits in (1, 2):
        blocks = pk.SparseMlaBlockSizes(block_c=block_c, block_w=16, num_splits=splits)
        got = pk.sparse_mla(q, latent, ids, scale, implementation="pallas_interpret", block_sizes=blocks, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol(want))
    bwd = pk.SparseMlaBackwardBlockSizes(block_c=block_c)
    dq, dlat = pk.sparse_mla_backward(q, latent, ids, *_out_lse(q, latent, ids, scale, fmt, kw),
                                      jnp.ones_like(want), scale, implementation="pallas_interpret",
                                      block_sizes=bwd, **kw)
    np.testing.assert_allclose(np.asarray(dq), np.asarray(dq_want), **tol(dq_want))
    assert not np.asarray(dlat.astype(jnp.float32)).any()  # no gradient into fp8 rows


def _out_lse(q, latent, ids, scale, fmt, kw):
    """The forward's residuals for a direct backward call: ``(out, lse)`` over the
    dequantised rows (``lse``: the log-sum-exp of each query's valid scores)."""
    import jax
    import pallas_kernels as pk
    deq = dequantize_latent(latent, scale, fmt)
    kv = jax.vmap(lambda rows, i: rows[jnp.clip(i, 0, rows.shape[0] - 1)])(deq, ids)  # [B, Q, W, CR]
    s = jnp.einsum("bqhc,bqwc->bqhw", q, kv) * kw["scale"]
    s = jnp.where((ids >= 0)[:, :, None, :], s, -jnp.inf)
    return pk.sparse_mla(q, latent, ids, scale, **kw), jax.nn.logsumexp(s, axis=-1)


def test_bad_group_scales_refused_and_where_not_read():
    """Scales that do not split the row, or of the wrong shape, name ``latent_scale``; the
    attention mass (the indexer loss's target: training, never on an fp8 cache) reads one
    scale a row and refuses group scales naming ``latent_scale``."""
    import pallas_kernels as pk
    from glm5_dsa_jax.model.attention_mass import sparse_pool_mass
    fmt = LatentFormat(24, 8, "group", 8)
    q, latent, scale, ids = _mla_operands(fmt)
    with pytest.raises(ValueError, match=r"latent_scale must be \[B, L\]"):
        sparse_pool_mass(q, latent, ids, scale, kpool=1, select_k=6, scale=0.2)
    with pytest.raises(ValueError, match="must split in 5 equal groups"):  # 6 groups: 5 + k_rot
        pk.sparse_mla(q, latent, ids, jnp.ones(scale.shape[:2] + (6,)), scale=0.2, value_width=24)
    with pytest.raises(ValueError, match=r"latent_scale must be \[B or 1, L, G\]"):
        pk.sparse_mla(q, latent, ids, scale[:, :4], scale=0.2, value_width=24)


@pytest.mark.parametrize("layout", ["row", "group"])
def test_causal_mla_reads_group_scales_as_the_dequantised_rows(layout):
    """The dense prefill reader: ``"xla"`` (tiled, and its reference) on group scales equals
    the float rows, output and ``dq``; so does the Pallas path (``"pallas_interpret"``)."""
    import jax
    import pallas_kernels as pk
    fmt = LatentFormat(24, 8, layout, 8)
    q, latent, scale, _ = _mla_operands(fmt)
    deq = dequantize_latent(latent, scale, fmt)
    q_slots = jnp.asarray([[2, 5, 9], [0, 3, -1]], jnp.int32)
    key_valid = jnp.arange(10)[None, :] < jnp.asarray([[10], [7]])
    kw = dict(scale=0.2, value_width=24)
    want = pk.causal_mla(q, deq, q_slots, key_valid, **kw)
    tol = dict(rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    for got in (pk.causal_mla(q, latent, q_slots, key_valid, scale, key_tile=4, **kw),
                pk.causal_mla_reference(q, latent, q_slots, key_valid, scale, **kw)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)
    dq = jax.grad(lambda x: pk.causal_mla(x, latent, q_slots, key_valid, scale, key_tile=4, **kw).sum())(q)
    dq_want = jax.grad(lambda x: pk.causal_mla(x, deq, q_slots, key_valid, key_tile=4, **kw).sum())(q)
    np.testing.assert_allclose(np.asarray(dq), np.asarray(dq_want), rtol=2e-5,
                               atol=2e-5 * float(jnp.abs(dq_want).max()))
    if layout == "group":  # the Pallas path: sparse_mla's Triton kernels over the visible slots
        got = pk.causal_mla(q, latent, q_slots, key_valid, scale, implementation="pallas_interpret", **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)


# ----------------------------------------------------------------------------- the caches
def test_caches_store_group_scales_and_the_row_layout_stays():
    """A RoPE model's fp8 caches scale ``c`` and ``k_rot`` apart by default (``[.., L, G]``);
    ``latent_layout="row"`` keeps one scale a row (``[.., L]``), as does a NoPE model."""
    import glm5_dsa_jax as gd
    from helpers import rope_tiny
    cfg = rope_tiny()  # c 24 (one group: 128 does not divide it) + k_rot 8: G = 2
    cache, paged = gd.init_cache(cfg, 2, 16, dtype="fp8"), gd.init_paged_cache(cfg, 2, 4, 8, dtype="fp8")
    assert cache.latent_format.n_groups == 2 and cache.latent_scale.shape == (2, 16, 2)
    assert paged.latent_scale.shape == (4, 8, 2) and paged.latent_pool_scale.shape == (32, 2)
    assert gd.init_cache(cfg, 2, 16, dtype="fp8", latent_layout="row").latent_scale.shape == (2, 16)
    assert gd.init_paged_cache(cfg, 2, 4, 8, dtype="fp8", latent_layout="row").latent_scale.shape == (4, 8)
    nope = gd.DsaConfig.tiny()
    assert gd.init_cache(nope, 2, 16, dtype="fp8").latent_scale.shape == (2, 16)
    assert gd.init_cache(cfg, 2, 16).latent_format is None
    for init in (lambda: gd.init_cache(cfg, 2, 16, dtype="fp8", latent_layout="block"),
                 lambda: gd.init_paged_cache(cfg, 2, 4, 8, latent_layout="block")):
        with pytest.raises(ValueError, match="latent_layout must be one of"):
            init()


@pytest.mark.slow
def test_layer_on_group_scales_contiguous_and_paged():
    """A RoPE layer (``"xla"``) on fp8 caches, 4 tokens (every one selected: the error is the
    rows', not a changed selection): the paged group cache equals the contiguous one (top-k
    bit for bit, outputs to float32 rounding); against a float32 cache the group layout
    stays close at hidden states x1 and x1e6, where one scale a row loses ``c`` (``k_rot``
    grows with the hidden state, ``c`` is normalised). Measured rel L2 against float32
    (x1, x1e6): row 0.027, 0.99; group 0.027, 0.026."""
    from helpers import f32_layer, hidden_states, rope_tiny
    cfg = rope_tiny()
    layer = f32_layer(cfg, 0, seed=4, block_q=8)
    rel = {}
    for x_scale in (1.0, 1e6):
        x = jnp.asarray(hidden_states(cfg, 2, 4, seed=3) * x_scale)
        want, t_want, _ = layer(x, cache=layer.init_cache(2, 8, dtype=jnp.float32))
        for layout in ("row", "group"):
            out, topk, cache = layer(x, cache=layer.init_cache(2, 8, dtype="fp8", latent_layout=layout))
            np.testing.assert_array_equal(topk, t_want)
            assert cache.latent_scale.ndim == (3 if layout == "group" else 2)
            rel[layout, x_scale] = float(np.linalg.norm(out - want) / np.linalg.norm(want))
        o_paged, t_paged, _ = layer(x, cache=layer.init_paged_cache(2, 2, 8, dtype="fp8"))
        np.testing.assert_array_equal(t_paged, topk)
        np.testing.assert_allclose(o_paged, out, rtol=1e-5, atol=1e-5 * float(jnp.abs(out).max()))
    assert rel["group", 1.0] < 0.05 and rel["group", 1e6] < 0.05, rel
    assert rel["row", 1e6] > 0.5, rel  # c rounded away: the collapse


def test_decoders_take_the_cache_format():
    """``DsaDecoder`` / ``PagedDecoder`` pass ``latent_layout`` and ``rotate_index`` to the
    cache they make, and decode as the layer does on a cache of that format."""
    from helpers import f32_layer, hidden_states, rope_tiny
    import glm5_dsa_jax as gd
    cfg = rope_tiny(index_head_dim=16)  # a power of two: rotate_index allowed
    layer = f32_layer(cfg, 0, seed=4, block_q=8)
    x = jnp.asarray(hidden_states(cfg, 2, 5, seed=3))  # 5 tokens, index_topk 4: a selection
    kw = dict(latent_layout="row", rotate_index=True)
    want, t_want, _ = layer(x, cache=layer.init_cache(2, 8, dtype="fp8", **kw))
    dec = gd.DsaDecoder(layer, 2, 8, cache_dtype="fp8", **kw)
    paged = gd.PagedDecoder(layer, 2, 2, 8, cache_dtype="fp8", **kw)
    for d in (dec, paged):
        assert d.cache.latent_scale.ndim == 2 and d.cache.rotate_index
        out, topk = d(x)
        np.testing.assert_array_equal(topk, t_want)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    assert gd.DsaDecoder(layer, 2, 8, cache_dtype="fp8").cache.latent_scale.ndim == 3  # "group"


def test_export_load_carries_group_scales():
    """``export`` keeps ``[length, G]``; a cache of the other layout refuses the load naming
    ``latent_scale_groups``, nothing written; one of the same layout (another page count)
    holds the sequence as it was: exported from there, the same arrays, bit for bit."""
    from helpers import f32_layer, hidden_states, rope_tiny
    cfg = rope_tiny()
    layer = f32_layer(cfg, 0, seed=4, block_q=8)
    x = jnp.asarray(hidden_states(cfg, 2, 9, seed=5))
    _, _, src = layer(x, cache=layer.init_paged_cache(2, 4, 8, dtype="fp8"))
    exported = src.export(1)
    assert exported.latent_scale.shape == (9, 2) and exported.latent_scale.dtype == np.float32
    row = layer.init_paged_cache(2, 6, 8, dtype="fp8", latent_layout="row")
    with pytest.raises(ValueError, match=r"latent_scale_groups 2 \(the cache's: 1\)"):
        row.load(0, exported)
    assert int(row.lengths.sum()) == 0
    back = layer.init_paged_cache(2, 6, 8, dtype="fp8").load(0, exported).export(0)
    for name in ("latent", "latent_scale", "pooled", "pooled_scale", "stage_keys", "stage_gate"):
        a, b = getattr(back, name), getattr(exported, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)


# ----------------------------------------------------------------------------- the rotation
def test_rotate_index_off_by_default_and_refusals():
    """Off unless asked (it did not raise the fp8 indexer's recall: ``docs/fp8.md``); asked,
    it needs a power-of-two ``index_head_dim`` and a bool."""
    import glm5_dsa_jax as gd
    from helpers import rope_tiny
    tiny = gd.DsaConfig.tiny()  # index_head_dim 16
    assert not gd.init_cache(tiny, 2, 16, dtype="fp8").rotate_index
    assert not gd.init_paged_cache(tiny, 2, 4, 8, dtype="fp8").rotate_index
    assert gd.init_cache(tiny, 2, 16, dtype="fp8", rotate_index=True).rotate_index
    assert gd.init_paged_cache(tiny, 2, 4, 8, rotate_index=True).rotate_index  # a float cache too
    with pytest.raises(ValueError, match="rotate_index=True needs a power-of-two index_head_dim"):
        gd.init_paged_cache(rope_tiny(), 2, 4, 8, dtype="fp8", rotate_index=True)  # index_head_dim 12
    with pytest.raises(ValueError, match="rotate_index must be a bool"):
        gd.init_cache(tiny, 2, 16, rotate_index=None)


@pytest.mark.slow
def test_rotated_index_keeps_scores_and_selection():
    """A float32 cache storing rotated pooled keys, the layer rotating its queries: the
    scores of every pool equal the unrotated ones to float32 rounding (measured ``max|s_rot
    - s| / max|s|`` 4.1e-8, the float32 difference of a rotation), the same top-k and
    outputs; the stored keys are the rotated ones. A moved sequence keeps its rotation: a
    cache of the other kind refuses it, naming ``rotate_index``."""
    import glm5_dsa_jax as gd
    from helpers import f32_layer, hidden_states
    cfg = gd.DsaConfig.tiny()
    layer = f32_layer(cfg, 1, seed=4, block_q=8)
    x = jnp.asarray(hidden_states(cfg, 2, 24, seed=1))
    runs = {rot: layer(x, cache=layer.init_cache(2, 32, dtype=jnp.float32, rotate_index=rot)) for rot in (False, True)}
    (o0, t0, c0), (o1, t1, c1) = runs[False], runs[True]
    np.testing.assert_array_equal(np.asarray(t0), np.asarray(t1))
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o0), rtol=1e-5, atol=1e-5 * float(jnp.abs(o0).max()))
    np.testing.assert_allclose(np.asarray(c1.pooled), np.asarray(hadamard(c0.pooled)), rtol=1e-6, atol=1e-6)
    q_resid, _, _ = layer.project(x)
    qi, w, _, _ = layer.indexer.project(x, q_resid)
    q_pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32)[None], (2, 24))
    s0 = np.asarray(layer.score_pools(qi, w, c0, q_pos))
    s1 = np.asarray(layer.score_pools(hadamard(qi), w, c1, q_pos))
    live = np.isfinite(s0)
    np.testing.assert_array_equal(live, np.isfinite(s1))
    assert live.sum() > 100
    rel = np.abs(s1[live] - s0[live]).max() / np.abs(s0[live]).max()
    assert 0 < rel < 1e-6, rel
    paged = layer.init_paged_cache(2, 8, 8, dtype="fp8", rotate_index=True)
    _, _, paged = layer(x, cache=paged)
    exported = paged.export(0)
    assert exported.rotate_index
    with pytest.raises(ValueError, match=r"rotate_index True \(the cache's: False\)"):
        layer.init_paged_cache(2, 8, 8, dtype="fp8").load(1, exported)
