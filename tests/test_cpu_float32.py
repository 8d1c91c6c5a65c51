"""The compiled step on a CPU multiplies by cached float32 copies of 16-bit parameters.

What must hold: the same numbers as the bf16 path (to float32 rounding: each product still
rounds its output to bf16), the user's parameters and checkpoints untouched, one copy per
parameter array (a replaced parameter gets a new one), the opt-out, and sharded layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax import cpu_policy
from glm5_dsa_jax.decode import DsaDecoder, make_step


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


def test_float32_step_matches_the_bf16_step():
    """Same selection; outputs as accurate as the bf16 step's, or more.

    The float32 products compute exactly what a bf16 product accumulating in float32 does
    (bf16 -> float32 is exact; each product rounds its output to bf16). jax 0.10's XLA:CPU
    bf16 dot accumulates in float32, and there the two steps are equal; jax 0.12's does
    not, and there the float32 step is the closer of the two to the float32 computation on
    the same bf16 weights. So: against that float32 oracle, the float32 step's error is no
    larger than the bf16 step's, and within the bf16 budget of a few roundings.
    """
    wide, narrow = _bf16_layer(True), _bf16_layer(False)
    graphdef, params = nnx.split(_bf16_layer(False))
    oracle = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float32), params))
    oracle.dtype = jnp.dtype(jnp.float32)
    x = jax.random.normal(jax.random.key(3), (2, 20, wide.cfg.hidden_size), jnp.float32)
    mask = jnp.ones((2, 20), bool).at[1, :3].set(False)
    chunks = [13, 1, 1, 5]  # a prefill chunk, then decode steps
    out_w, topk_w, dec_w = _run(wide, x, mask, chunks)
    out_n, topk_n, dec_n = _run(narrow, x, mask, chunks)
    out_f, topk_f, _ = _run(oracle, x, mask, chunks)
    assert dec_w.step.float32 and not dec_n.step.float32
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
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(step.compute_params(params)))
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
    assert make_step(layer)[0].float32


def test_sharded_layer_copies_keep_the_placement():
    layer = _bf16_layer()
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    gd.shard_layer(layer, mesh, axis="tp")
    assert layer.float32_compute()
    params = nnx.state(layer, nnx.Param)
    copies = gd.float32_params(params)
    for a, c in zip(jax.tree.leaves(params), jax.tree.leaves(copies)):
        assert c.dtype == jnp.float32 and c.sharding == a.sharding
    x = jax.random.normal(jax.random.key(1), (1, 6, layer.cfg.hidden_size), jnp.float32)
    dec = DsaDecoder(layer, batch_size=1, max_length=16)
    out, _ = dec(x)
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
