"""The compiled step on a CPU multiplies by cached copies of 16-bit parameters:
contraction-last copies in their own dtype from ``WIDE_ROWS`` (1: every call) on an
unplaced layer, float32 copies on a placed one.

What must hold: the same numbers as the bf16 path (to float32 rounding: each product still
rounds its output to bf16), the user's parameters and checkpoints untouched, one copy per
parameter array (a replaced parameter gets a new one), the opt-out, and sharded layers.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax import cpu_policy
from glm5_dsa_jax.decode import DsaDecoder, make_step
from glm5_dsa_jax.model.layout import contraction_orders


def _bf16_layer(cpu_float32=True, layer_idx=1):
    cfg = gd.DsaConfig.tiny()
    return gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                           param_dtype=jnp.bfloat16, cpu_float32=cpu_float32)


def _run(layer, x, mask, chunks):
    dec = DsaDecoder(layer, batch_size=x.shape[0], max_length=32)
    outs, topks, pos = [], [], 0
    for n in chunks:
        o, t = dec(x[:, pos:pos + n], mask[:, pos:pos + n])
        outs.append(o)
        topks.append(t)
        pos += n
    return jnp.concatenate(outs, 1), jnp.concatenate(topks, 1), dec


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.slow
def test_float32_step_matches_the_bf16_step(batch):
    """Same selection; outputs as accurate as the bf16 step's, or more.

    The float32 products compute exactly what a bf16 product accumulating in float32 does
    (bf16 -> float32 is exact; each product rounds its output to bf16). jax 0.10's XLA:CPU
    bf16 dot accumulates in float32, and there the two steps are equal; jax 0.12's does
    not, and there the float32 step is the closer of the two to the float32 computation on
    the same bf16 weights. So: against that float32 oracle, the float32 step's error is no
    larger than the bf16 step's, and within the bf16 budget of a few roundings. Every call
    takes contraction-last copies; at batch 1 a decode step multiplies two copies of its
    one row.
    """
    wide, narrow = _bf16_layer(True), _bf16_layer(False)
    graphdef, params = nnx.split(_bf16_layer(False))
    oracle = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float32), params))
    oracle.dtype = jnp.dtype(jnp.float32)
    x = jax.random.normal(jax.random.key(3), (2, 20, wide.cfg.hidden_size), jnp.float32)[:batch]
    mask = jnp.ones((2, 20), bool).at[1, :3].set(False)[:batch]
    chunks = [13, 1, 1, 5]  # a prefill chunk, then decode steps
    out_w, topk_w, dec_w = _run(wide, x, mask, chunks)
    out_n, topk_n, dec_n = _run(narrow, x, mask, chunks)
    out_f, topk_f, _ = _run(oracle, x, mask, chunks)
    assert dec_w.step.float32 and not dec_n.step.float32
    assert dec_w.step.contraction_last(batch * 13) and dec_w.step.contraction_last(batch)
    assert out_w.dtype == out_n.dtype == jnp.bfloat16 and out_f.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(topk_w), np.asarray(topk_n))
    np.testing.assert_array_equal(np.asarray(topk_w), np.asarray(topk_f))
    ref = np.asarray(out_f, np.float64)
    err = lambda o: np.linalg.norm(np.asarray(o, np.float64) - ref) / np.linalg.norm(ref)
    assert err(out_w) <= err(out_n) * (1 + 1e-6), (err(out_w), err(out_n))
    assert err(out_w) < 8 * 2.0**-9, err(out_w)  # ~8 bf16 roundings in a row

def test_parameters_and_checkpoints_keep_their_dtype(tmp_path):
    layer = _bf16_layer()
    step, params = make_step(layer)
    assert step.float32
    leaves = jax.tree.leaves(params)
    assert all(a.dtype == jnp.bfloat16 for a in leaves)  # make_step hands back the layer's own
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(step.compute_params(params)))  # from one row
    dec = DsaDecoder(layer, batch_size=1, max_length=8)
    dec(jnp.ones((1, 2, layer.cfg.hidden_size)))
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    assert layer.param_dtype == jnp.bfloat16 and layer.dtype == jnp.bfloat16
    for v in gd.params_to_hf(layer).values():  # float32 numpy of the stored bf16 values
        np.testing.assert_array_equal(v, np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32))
    gd.save_checkpoint({1: layer}, tmp_path / "ckpt")
    restored = gd.restore_checkpoint(tmp_path / "ckpt")[1]
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(nnx.state(restored, nnx.Param)))


def test_copies_are_cached_per_source_array():
    layer = _bf16_layer()
    params = nnx.state(layer, nnx.Param)
    c1 = jax.tree.leaves(gd.float32_params(params))
    c2 = jax.tree.leaves(gd.float32_params(params))
    assert all(a is b for a, b in zip(c1, c2))
    old = layer.q_a_proj[...]
    layer.q_a_proj.set_value(old * 2)  # a new source array: a new copy, never the stale one
    new = gd.float32_params(nnx.state(layer, nnx.Param))["q_a_proj"][...]
    np.testing.assert_array_equal(np.asarray(new), np.asarray((old * 2).astype(jnp.float32)))
    n = len(cpu_policy._F32_COPIES)
    del old, c1, c2, params
    gd.float32_params({"x": jnp.ones((2,), jnp.bfloat16)})  # a copy whose source dies at once
    assert len(cpu_policy._F32_COPIES) <= n
    gd.clear_float32_copies()
    assert not cpu_policy._F32_COPIES


def test_opt_out_and_float32_layers():
    layer = _bf16_layer(cpu_float32=False)
    step, params = make_step(layer)
    assert not layer.float32_compute() and not step.float32
    assert step.compute_params(params) is params
    layer.cpu_float32 = True  # a plain attribute, read by make_step
    assert make_step(layer)[0].float32 and make_step(layer)[0].contraction_last(8)
    # A float32 layer multiplies its own parameters, however many rows.
    f32 = gd.DsaAttention(layer.cfg, 1, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    step, params = make_step(f32)
    assert not step.contraction_last(8)
    assert all(a is b for a, b in zip(jax.tree.leaves(step.compute_params(params, 8)), jax.tree.leaves(params)))


def test_sharded_layer_copies_keep_the_placement():
    layer = _bf16_layer()
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    gd.shard_layer(layer, mesh, axis="tp")
    assert layer.float32_compute()
    assert not make_step(layer)[0].contraction_last(8)  # the shard_map specs are the stored layout's
    params = nnx.state(layer, nnx.Param)
    copies = gd.float32_params(params)
    for a, c in zip(jax.tree.leaves(params), jax.tree.leaves(copies)):
        assert c.dtype == jnp.float32 and c.sharding == a.sharding
    x = jax.random.normal(jax.random.key(1), (1, 6, layer.cfg.hidden_size), jnp.float32)
    dec = DsaDecoder(layer, batch_size=1, max_length=16)
    out, _ = dec(x)
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))


def _ulps_apart(a, b):
    """Per element, how many bf16 ulps (of the larger magnitude) two bf16 arrays differ by."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    big = np.maximum(np.abs(a), np.abs(b)).astype(jnp.bfloat16)
    ulp = np.spacing(big).astype(np.float32)
    return np.abs(a - b) / np.where(ulp > 0, ulp, 1)


@pytest.mark.parametrize("batch, tokens", [(2, 7), (1, 1)])
def test_contraction_last_products_match_float32_products(batch, tokens):
    """The same call (2 rows x 7 tokens, and one row: a batch-1 decode step, which multiplies
    two copies of its row) traced both ways, on the same cache: the same ids,
    and outputs at most one bf16 ulp apart (both multiply the same bf16 values exactly into
    float32: only the accumulation order differs), nearly all equal. The layout table's
    contraction axes (``Param.contract``) are those of every product the step runs, or the
    shapes would not meet."""
    layer = _bf16_layer()
    step, params = make_step(layer, donate=False)
    assert step.contraction_last(batch * tokens)
    graphdef, _ = nnx.split(layer)

    def float32_call(p, x, mask, cache):
        with cpu_policy.float32_products_context():
            return nnx.merge(graphdef, p)(x, attention_mask=mask, cache=cache)

    x = jax.random.normal(jax.random.key(5), (batch, tokens, layer.cfg.hidden_size), jnp.float32)
    x = x.astype(jnp.bfloat16)
    mask = jnp.ones((batch, tokens), bool).at[0, :2].set(tokens == 1)
    cache = layer.init_cache(batch, 16)
    out_c, topk_c, _ = step(params, x, mask, cache)
    out_f, topk_f, _ = jax.jit(float32_call)(gd.float32_params(params), x, mask, cache)
    np.testing.assert_array_equal(np.asarray(topk_c), np.asarray(topk_f))
    apart = _ulps_apart(out_c, out_f)
    assert apart.max() <= 1 and (apart > 0).mean() < 0.02, (apart.max(), (apart > 0).mean())
    copies = step.compute_params(params, batch * tokens)
    assert all(a is b for a, b in zip(jax.tree.leaves(copies), jax.tree.leaves(step.compute_params(params, 3))))
    for path, order in contraction_orders().items():
        src, copy = params, copies
        for k in path:
            src, copy = src[k], copy[k]
        want = jnp.transpose(src[...], order)
        assert copy[...].dtype == jnp.bfloat16 and copy[...].shape == want.shape, path
        np.testing.assert_array_equal(np.asarray(copy[...], np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("batch", [4, 1])
def test_contraction_last_weights_are_not_transposed_back(batch):
    """In the compiled step no weight is copied, converted or transposed (XLA:CPU's dot
    canonicalisation does that to a weight with several kept or contracted axes, unless the
    product is written 2-D: ``ops._contraction_last_product``; at one row it converted
    ``w_uk`` and ``w_uv`` to float32, unless the row is doubled), and every product of a
    weight reads its bf16 values."""
    layer = _bf16_layer()
    step, params = make_step(layer)
    x = jnp.ones((batch, 1, layer.cfg.hidden_size), jnp.bfloat16)
    hlo = step.lower(params, x, jnp.ones((batch, 1), bool), layer.init_cache(batch, 16)).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    names = re.findall(r"%(\S+) = bf16\[[0-9,]+\]\{[0-9,]*\} parameter\(", entry)
    weights = [n for n in names if any(w in n for w in ("o_proj", "q_b_proj", "wq_b", "w_uk", "w_uv", "q_a_proj"))]
    assert len(weights) >= 5, names
    for n in weights:
        for line in hlo.splitlines():
            if re.search(rf"[(,] ?%{re.escape(n)}[,)]", line):
                assert not re.search(r"kind=kLoop|= \S+ (copy|transpose)\(", line), line[:300]


@pytest.mark.parametrize("rows", [8, cpu_policy.WEIGHT_MAJOR_ROWS + 16])
def test_few_rows_multiply_weight_major(rows):
    """A contraction-last product of at most ``WEIGHT_MAJOR_ROWS`` rows runs weight-major
    (``[N, K] x [M, K]^T``, its result transposed after an ``optimization_barrier``, so XLA
    cannot fold the transpose back into the product); more rows run ``[M, K] x [N, K]^T``.
    Both are the float32 product of the same bf16 values, rounded to bf16: at most one ulp
    apart (the accumulation order)."""
    from glm5_dsa_jax.model import ops

    spec = "bshv,hvo->bso"  # o_proj's
    x = jax.random.normal(jax.random.key(0), (2, rows // 2, 4, 32), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (4, 32, 48), jnp.float32).astype(jnp.bfloat16)
    w_last = jnp.transpose(w, (2, 0, 1))  # its contraction-last copy, [o, h, v]

    def product(x, w_last):
        with cpu_policy.contraction_last_context():
            return ops.matmul(spec, x, w_last)

    out = jax.jit(product)(x, w_last)
    want = jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    assert out.dtype == jnp.bfloat16
    assert _ulps_apart(out, want.astype(jnp.bfloat16)).max() <= 1
    eqns = jax.make_jaxpr(product)(x, w_last).jaxpr.eqns
    (dot,) = [e for e in eqns if e.primitive.name == "dot_general"]
    weight_major = rows <= cpu_policy.WEIGHT_MAJOR_ROWS
    assert dot.invars[0].aval.shape == ((48, 128) if weight_major else (rows, 128))
    assert any(e.primitive.name == "optimization_barrier" for e in eqns) == weight_major


@pytest.mark.parametrize("model, layer_idx", [("glm5_next", 1), ("glm5_next", 2), ("deepseek_v32", 0)],
                         ids=["glm5-next-full", "glm5-next-shared", "deepseek-v32-rope"])
def test_joined_products_are_the_plain_products(model, layer_idx):
    """A GPU step's joined products (``cpu_policy``, "Joined products"): the products of the
    hidden state (``q_a``, ``kv_a`` and, on a layer with an indexer, its ``wk``,
    ``weights_proj`` and a pooling model's ``kpool_gate``) are one ``dot_general`` against
    one joined copy, made once while its sources live, and each member's slice is the plain
    product of its own copy: the same float32 products of the same bf16 values, rounded
    to bf16, so at most one ulp apart (the accumulation order). Here, on XLA:CPU, the
    projections come out bit for bit."""
    from helpers import rope_tiny

    from glm5_dsa_jax.model import ops
    from glm5_dsa_jax.model.layout import joined_products

    cfg = gd.DsaConfig.tiny() if model == "glm5_next" else rope_tiny(model)
    layer = gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    graphdef, params = nnx.split(layer)
    orders, groups = contraction_orders(), joined_products()
    rows = cpu_policy.joined_rows(params, orders, groups)
    want = [("q_a_proj",), ("kv_a_proj",)] + ([("indexer", "wk"), ("indexer", "weights_proj")]
                                              + [("indexer", "kpool_gate")] * cfg.rules.kpool_compression
                                              if layer.has_indexer else [])
    assert sorted(rows) == sorted(want)
    joined = cpu_policy.contraction_last_params(params, orders, groups)
    plain = cpu_policy.contraction_last_params(params, orders)
    assert cpu_policy.contraction_last_params(params, orders, groups)["q_a_proj"].value is joined["q_a_proj"].value
    x = jax.random.normal(jax.random.key(3), (2, 3, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)

    def project(p, r):
        m = nnx.merge(graphdef, cpu_policy.shared_joined(p, r))
        with cpu_policy.contraction_last_context(cpu_forms=False, joined=r):
            q_resid, q_lat, latent = m.project(x)
            return (q_resid, q_lat, latent) + (m.indexer.project(x, q_resid) if m.indexer is not None else ())

    def dots(p, r):
        return sum(e.primitive.name == "dot_general" for e in jax.make_jaxpr(lambda p: project(p, r))(p).jaxpr.eqns)

    assert dots(plain, {}) - dots(joined, rows) == len(want) - 1
    for a, b in zip(jax.jit(lambda p: project(p, rows))(joined), jax.jit(lambda p: project(p, {}))(plain)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    for path in want:  # each member's slice, against its own plain product
        member = plain[path[0]] if len(path) == 1 else plain[path[0]][path[1]]
        with cpu_policy.contraction_last_context(cpu_forms=False, joined=rows):
            ours = ops.dense(x, joined["q_a_proj"].value, part=path)
        with cpu_policy.contraction_last_context(cpu_forms=False):
            theirs = ops.dense(x, member.value)
        assert ours.shape == theirs.shape and _ulps_apart(ours, theirs).max() <= 1
    # a replaced member gets a new joined copy
    layer.kv_a_proj.value = layer.kv_a_proj.value + 1
    again = cpu_policy.contraction_last_params(nnx.state(layer), orders, groups)
    assert again["q_a_proj"].value is not joined["q_a_proj"].value


def test_a_gpu_step_with_joined_products(monkeypatch):
    """``make_step`` under the GPU product policy (``decode.on_cpu`` made to answer False,
    so a CPU runs what a GPU step traces: plain contraction-last products and the hidden
    state's joined copy), through ``DsaDecoder``'s calls and ``steps(n)``: the same outputs,
    ids and cache, bit for bit, as the same policy without the join; the joined copy made
    once while its sources live."""
    import glm5_dsa_jax.decode as decode
    from glm5_dsa_jax.model import layout

    monkeypatch.setattr(decode, "on_cpu", lambda params: False)
    layer = _bf16_layer(cpu_float32=False)  # no float32 copies: what a GPU step reads
    x = jax.random.normal(jax.random.key(5), (2, 9, layer.cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    mask = jnp.ones((2, 9), bool).at[1, :2].set(False)

    def run():
        dec = DsaDecoder(layer, batch_size=2, max_length=16)
        outs = [dec(x[:, :5], mask[:, :5]), dec(x[:, 5:6], mask[:, 5:6]), dec.steps(x[:, 6:9], mask[:, 6:9])]
        return outs, dec

    joined, dec = run()
    copies = [a for a in jax.tree.leaves(dec._compute(2)) if a.shape[0] == sum(
        p.shape(layer.cfg)[-1] for p in (layout.find_param(q)[1] for q in layout.joined_products()[0]))]
    assert len(copies) == len(layout.joined_products()[0]) and all(c is copies[0] for c in copies)
    assert dec.step.compute_params(dec.params, 2)["q_a_proj"].value is copies[0]  # cached
    monkeypatch.setattr(decode, "joined_products", lambda: ())
    plain, dec_plain = run()
    assert not [a for a in jax.tree.leaves(dec_plain._compute(2)) if a is copies[0]]
    for (o, t), (o2, t2) in zip(joined, plain):
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o2, np.float32))
        np.testing.assert_array_equal(np.asarray(t), np.asarray(t2))
    for a, b in zip(jax.tree.leaves(dec.cache), jax.tree.leaves(dec_plain.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
