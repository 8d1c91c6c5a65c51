"""Autodiff through a context-parallel layer call (issue 27): ``jax.grad`` of a loss of a
``shard_layer(..., seq_axis="cp")`` layer's prefill chunk on a contiguous cache
(``"xla"``) equals the unsharded layer's gradient, with respect to the parameters and to
the input ``x``. On the 8 virtual CPU devices of conftest.py, float32.

What differentiates: the projections, the per-device partial attention and its
log-sum-exp merge (``pmax`` / ``psum``, whose transposes sum the per-device cotangents),
the ``o_proj`` all-reduce. The selection is discrete (int32 keys and ids all-gathered and
merged, ``order_key``): no gradient flows through it, as in the unsharded layer, whose
indexer gradients are exactly zero too. Compared with ``test_grad_layer``'s rule: each
tensor within ``F32_REORDER`` of its largest entry (the per-device partials and the
all-reduces sum in other orders), the top-k bit for bit, the indexer's gradients exactly
zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm5_dsa_jax.parallel import sharding as sh
from helpers import F32_REORDER, f32_layer, padded_batch, rope_tiny, tiny8

S, PREFIX, MAX_LEN = 40, 8, 64  # a 32-token chunk (8 pools, select_k 4) after an 8-token prefix
PADS = (0, 5)


def grads_of(layer, config, prefix):
    """``(topk, {param path: grad}, dx)`` of ``sum(out * ct)`` of ``layer``'s chunk
    ``[prefix, S)`` on a cache holding the tokens before it, jitted."""
    x, mask = padded_batch(config, PADS, S, seed=3)
    ct = np.random.default_rng(4).standard_normal((len(PADS), S - prefix, config.hidden_size)).astype(np.float32)
    cache = layer.init_cache(len(PADS), MAX_LEN)
    if prefix:
        _, _, cache = layer(x[:, :prefix], attention_mask=mask[:, :prefix], cache=cache)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x, mask, cache):
        out, topk, _ = nnx.merge(graphdef, params, rest)(x, attention_mask=mask, cache=cache)
        return jnp.sum(out * ct), topk

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    (dparams, dx), topk = grad(params, x[:, prefix:], mask[:, prefix:], cache)
    flat = {tuple(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(dparams)}
    return np.asarray(topk), flat, np.asarray(dx)


def assert_close_scaled(got, want, what):
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(w).max()
    assert np.isfinite(g).all() and scale > 0, what
    err = np.abs(g - w).max()
    assert err <= F32_REORDER * scale, f"{what}: max error {err:.3g} > {F32_REORDER} x scale {scale:.3g}"


@pytest.mark.parametrize("config, layer_idx, prefix", [
    pytest.param(tiny8(), 1, PREFIX, marks=pytest.mark.slow), (tiny8(), 1, 0),
    # kpool 1: select_k 8 of up to 40 pools
    pytest.param(rope_tiny(index_topk=8, num_attention_heads=2), 0, PREFIX, marks=pytest.mark.slow),
], ids=["nope-after-prefix", "nope-first-chunk", "rope-after-prefix"])
def test_grad_equals_unsharded(config, layer_idx, prefix):
    want_topk, want, want_dx = grads_of(f32_layer(config, layer_idx, block_q=8), config, prefix)
    layer = sh.shard_layer(f32_layer(config, layer_idx, block_q=8), jax.make_mesh((4, 2), ("cp", "tp")),
                           axis="tp", seq_axis="cp")
    topk, got, dx = grads_of(layer, config, prefix)
    np.testing.assert_array_equal(topk, want_topk)
    assert ((topk >= 0).sum(-1) < np.arange(prefix, S)[None]).any()  # a sparse selection somewhere
    assert_close_scaled(dx, want_dx, "dx")
    assert got.keys() == want.keys()
    for path in want:
        if path[0] == "indexer":  # the selection is discrete: no gradient, as unsharded
            assert not got[path].any() and not want[path].any(), path
        else:
            assert_close_scaled(got[path], want[path], "/".join(path))
