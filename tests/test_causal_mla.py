"""``causal_mla`` (``pallas_kernels.causal_attention``): the dense attention of every visible
key equals ``mla_masked_attention`` under the causal mask, ``sparse_mla`` over the visible
slots and ``causal_mla_reference`` under ``"xla"`` (key tiles smaller than and not dividing
``L``) and ``"pallas_interpret"``; its gradients equal the reference's; a padding query gets
zeros; a NaN in a row no query sees goes nowhere; fp8 rows; bad input names the tensor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from glm5_dsa_jax.cache.fp8 import quantize_rows
from helpers import tp_mesh

SCALE = 0.29
B, Q, H, CR, V, L = 2, 4, 3, 24, 16, 11


def _case(seed=0):
    """q, latent, q_slots, key_valid: row 0 left-padded by 2 with a hole at slot 6 and a
    padding query; row 1 unpadded. No query sees slot 10 of row 0 or slot 9-10 of row 1."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, Q, H, CR)).astype(np.float32))
    latent = jnp.asarray(rng.normal(size=(B, L, CR)).astype(np.float32))
    key_valid = np.ones((B, L), bool)
    key_valid[0, :2] = False
    key_valid[0, 6] = False
    q_slots = jnp.asarray(np.array([[5, -1, 8, 9], [2, 3, 7, 8]], np.int32))
    return q, latent, q_slots, jnp.asarray(key_valid)


def _call(impl, key_tile=4):
    if impl == "reference":
        return lambda *a: pk.causal_mla_reference(*a, scale=SCALE, value_width=V)
    return lambda *a: pk.causal_mla(*a, scale=SCALE, value_width=V, implementation=impl, key_tile=key_tile)


@pytest.mark.parametrize("impl,key_tile", [("xla", 4), ("xla", 512), ("xla", 1), ("pallas_interpret", 512)])
def test_equals_masked_and_sparse_attention(impl, key_tile):
    q, latent, q_slots, key_valid = _case(1)
    got = _call(impl, key_tile)(q, latent, q_slots, key_valid)
    assert got.shape == (B, Q, H, V) and got.dtype == q.dtype
    mask = pk.causal_visible(q_slots, key_valid)
    masked = pk.mla_masked_attention(q, latent, mask, scale=SCALE, value_width=V)
    ids = jnp.where(mask, jnp.arange(L, dtype=jnp.int32), -1)
    sparse = pk.sparse_mla_reference(q, latent, ids, scale=SCALE, value_width=V)
    reference = pk.causal_mla_reference(q, latent, q_slots, key_valid, scale=SCALE, value_width=V)
    for want in (masked, sparse, reference):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    assert not np.asarray(got)[0, 1].any()  # the padding query: exactly zeros


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_gradients_equal_the_reference(impl):
    q, latent, q_slots, key_valid = _case(2)
    w = jnp.asarray(np.random.default_rng(3).normal(size=(B, Q, H, V)).astype(np.float32))

    def loss(fn):
        return jax.jit(jax.grad(lambda q, lat: (fn(q, lat, q_slots, key_valid) * w).sum(), argnums=(0, 1)))

    got, want = loss(_call(impl))(q, latent), loss(_call("reference"))(q, latent)
    for g, r in zip(got, want):
        assert np.abs(np.asarray(r)).max() > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=2e-6)
    # Rows no query sees get no gradient; the padding query's q neither.
    assert not np.asarray(got[1])[0, [0, 1, 6, 10]].any() and not np.asarray(got[1])[1, 9:].any()
    assert not np.asarray(got[0])[0, 1].any()


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret", "reference"])
def test_nan_in_an_invisible_row_goes_nowhere(impl):
    q, latent, q_slots, key_valid = _case(4)
    poisoned = latent.at[0, 6].set(jnp.nan).at[0, 10].set(jnp.inf).at[1, 9].set(jnp.nan)
    fn = _call(impl, key_tile=3)
    np.testing.assert_array_equal(np.asarray(fn(q, poisoned, q_slots, key_valid)),
                                  np.asarray(fn(q, latent, q_slots, key_valid)))
    grads = jax.jit(jax.grad(lambda q, lat: fn(q, lat, q_slots, key_valid).sum(), argnums=(0, 1)))(q, poisoned)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_fp8_rows(impl):
    q, latent, q_slots, key_valid = _case(5)
    lat8, scales = quantize_rows(latent)
    got = pk.causal_mla(q, lat8, q_slots, key_valid, scales, scale=SCALE, value_width=V,
                        implementation=impl, key_tile=4)
    ids = jnp.where(pk.causal_visible(q_slots, key_valid), jnp.arange(L, dtype=jnp.int32), -1)
    want = pk.sparse_mla_reference(q, lat8, ids, scales, scale=SCALE, value_width=V)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    ref = pk.causal_mla_reference(q, lat8, q_slots, key_valid, scales, scale=SCALE, value_width=V)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), rtol=2e-5, atol=2e-6)
    dq = jax.jit(jax.grad(lambda q: pk.causal_mla(q, lat8, q_slots, key_valid, scales, scale=SCALE, value_width=V,
                                          implementation=impl, key_tile=4).sum()))(q)
    dq_ref = jax.jit(jax.grad(lambda q: pk.causal_mla_reference(q, lat8, q_slots, key_valid, scales, scale=SCALE,
                                                        value_width=V).sum()))(q)
    assert np.abs(np.asarray(dq_ref)).max() > 0
    np.testing.assert_allclose(np.asarray(dq), np.asarray(dq_ref), rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("change,match", [
    (lambda a: (a[0][..., :5], *a[1:]), "latent"),
    (lambda a: (a[0], a[1], a[2][:, :2], a[3]), "q_slots"),
    (lambda a: (a[0], a[1], a[2], a[3].astype(jnp.int32)), "key_valid"),
    (lambda a: (*a, jnp.ones((B, L))), "latent_scale"),
])
def test_bad_input_names_the_tensor(change, match):
    with pytest.raises(ValueError, match=match):
        pk.causal_mla(*change(_case()), scale=SCALE, value_width=V)


def test_bad_options_name_the_argument():
    args = _case()
    with pytest.raises(ValueError, match="key_tile"):
        pk.causal_mla(*args, scale=SCALE, key_tile=0)
    with pytest.raises(ValueError, match="value_width"):
        pk.causal_mla(*args, scale=SCALE, value_width=CR + 1)
    with pytest.raises(ValueError, match="implementation"):
        pk.causal_mla(*args, scale=SCALE, implementation="cuda")


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value a jaxpr (and every jaxpr inside it) makes."""
    most = 0
    for eqn in jaxpr.eqns:
        most = max([most] + [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    most = max(most, _largest_intermediate(inner))
    return most


def test_xla_memory_is_a_key_tile_per_head():
    # Forward and backward of "xla" make nothing as large as [B, Q, H, L] (the reference
    # does); Q * H > CR, so the latent and its gradient [B, L, CR] are smaller than that.
    rng = np.random.default_rng(8)
    length, tile, nq, heads = 96, 8, 8, 6
    q = jnp.asarray(rng.normal(size=(B, nq, heads, CR)).astype(np.float32))
    latent = jnp.asarray(rng.normal(size=(B, length, CR)).astype(np.float32))
    q_slots = jnp.asarray(np.full((B, nq), length - 1, np.int32))
    key_valid = jnp.ones((B, length), bool)

    def largest(impl):
        fn = (lambda q, lat: pk.causal_mla_reference(q, lat, q_slots, key_valid, scale=SCALE)) if impl is None else (
            lambda q, lat: pk.causal_mla(q, lat, q_slots, key_valid, scale=SCALE, key_tile=tile))
        return _largest_intermediate(jax.make_jaxpr(jax.grad(lambda q, lat: fn(q, lat).sum(), argnums=(0, 1)))(
            q, latent).jaxpr)

    full = B * nq * heads * length
    assert largest(None) >= full  # the check sees the reference's [B, Q, H, L]
    assert largest("xla") < full


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_tp2_heads_equal_unsharded(impl):
    # Heads split over a shard_map as the placed layer's (check_vma off: Pallas kernels): the
    # output and both gradients equal the unsharded call (the latent's summed over devices).
    q, latent, q_slots, key_valid = _case(9)
    q = jnp.concatenate([q, q[:, :, :1] * 0.5], axis=2)  # 4 heads
    fn = _call(impl, key_tile=4)
    mesh = tp_mesh(2, "auto")

    def sharded(q, lat):
        return jax.shard_map(lambda q, lat: fn(q, lat, q_slots, key_valid), mesh=mesh,
                             in_specs=(P(None, None, "tp", None), P()), out_specs=P(None, None, "tp", None), check_vma=False)(q, lat)

    def grads(f):
        return jax.jit(jax.value_and_grad(lambda q, lat: (f(q, lat) ** 2).sum(), argnums=(0, 1)))(q, latent)

    (got, got_g), (want, want_g) = grads(sharded), grads(lambda q, lat: fn(q, lat, q_slots, key_valid))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


@pytest.mark.mosaic
@pytest.mark.skipif(pk.jax_version() < pk.MOSAIC_MIN_JAX,
                    reason=f"Mosaic GPU kernels need jax >= {pk.MOSAIC_MIN_JAX} (this is jax {jax.__version__})")
def test_mosaic_interpret_bf16():
    # 16-bit operands: the Mosaic forward and backward kernels over the visible ids with
    # holes (slot 6 of row 0) equal the "xla" path to bf16 rounding.
    q, latent, q_slots, key_valid = (a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _case(3))

    def run(impl):
        return jax.jit(jax.value_and_grad(lambda q, lat: pk.causal_mla(
            q, lat, q_slots, key_valid, scale=SCALE, value_width=V, implementation=impl
        ).astype(jnp.float32).sum(), argnums=(0, 1)))(q, latent)

    for got, want in zip(jax.tree.leaves(run("mosaic_interpret")), jax.tree.leaves(run("xla"))):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(want).max()))
