"""The layer on the Pallas kernels (interpret mode) equals the layer on the references:
identical top-k rows, outputs within float32 tolerance, on the HF parity geometries, for
one-shot prefill and for chunked prefill + decode through the jitted step."""

import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.decode import DsaDecoder
from helpers import f32_layer, padded_batch

# Kernels sum in another order than the references (tiles, online softmax): 2e-5 covers
# that reassociation at these widths in float32; a wrong selection or mask is O(0.1).
TOL = 2e-5


def pair(cfg, idx=1):
    return f32_layer(cfg, idx, seed=3), f32_layer(cfg, idx, seed=3, implementation="pallas_interpret")


@pytest.mark.parametrize("kpool,topk,tail,seq,pads", [
    (1, 4, True, 13, (0, 3, 7)),
    (4, 8, True, 23, (0, 2, 9)),
    (4, 12, False, 23, (0, 4)),
    (16, 32, True, 70, (0, 9, 30)),
])
def test_pallas_interpret_layer_equals_xla(kpool, topk, tail, seq, pads):
    cfg = gd.DsaConfig.tiny(index_kpool=kpool, index_topk=topk, index_kpool_always_select_tail=tail)
    x, mask = padded_batch(cfg, pads, seq, seed=11)
    xla, pal = pair(cfg)
    o1, t1 = xla(jnp.asarray(x), attention_mask=jnp.asarray(mask))
    o2, t2 = pal(jnp.asarray(x), attention_mask=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(t2), np.asarray(t1))
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), atol=TOL, rtol=TOL)
    # the shared layer on the kernels
    sx, sp = pair(cfg, 2)
    np.testing.assert_allclose(
        np.asarray(sp(jnp.asarray(x), attention_mask=jnp.asarray(mask), prev_topk=t1)[0]),
        np.asarray(sx(jnp.asarray(x), attention_mask=jnp.asarray(mask), prev_topk=t1)[0]),
        atol=TOL, rtol=TOL)


def test_pallas_interpret_decode_equals_xla():
    cfg = gd.DsaConfig.tiny()
    x, mask = padded_batch(cfg, (0, 5), 14, seed=12)
    xla, pal = pair(cfg)
    outs = []
    for layer in (xla, pal):
        dec = DsaDecoder(layer, 2, 16)
        res = [dec(x[:, :9], mask[:, :9])] + [dec(x[:, i:i + 1], mask[:, i:i + 1]) for i in range(9, 14)]
        outs.append([tuple(map(np.asarray, r)) for r in res])
    for (o1, t1), (o2, t2) in zip(*outs):
        np.testing.assert_array_equal(t2, t1)
        np.testing.assert_allclose(o2, o1, atol=TOL, rtol=TOL)
