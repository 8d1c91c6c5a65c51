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

import pallas_kernels as pk
from glm5_dsa_jax.cache.fp8 import quantize_rows

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
        return jax.grad(lambda q, lat: (fn(q, lat, q_slots, key_valid) * w).sum(), argnums=(0, 1))

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
    grads = jax.grad(lambda q, lat: fn(q, lat, q_slots, key_valid).sum(), argnums=(0, 1))(q, poisoned)
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
