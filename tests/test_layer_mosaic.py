"""The bfloat16 layer on the Mosaic GPU kernels (``implementation="mosaic_interpret"``)
equals the layer on the references (``"xla"``): one-shot prefill, chunked prefill and
decode steps over the contiguous cache, the paged cache, and a layer placed on a 2-way TP
mesh.

* bfloat16, because the Mosaic scoring and attention kernels take 16-bit operands only
  (wgmma's float32 is TF32; a float32 layer asked for ``"mosaic"`` runs them on Triton).
  Every test counts the calls of the three Mosaic kernels (``index_scores``,
  ``index_scores_paged``, ``sparse_mla``; ``topk_pools`` is Mosaic too) so a silent fallback
  to Triton fails it.
* The tiny preset's dims are not Mosaic-aligned (indexer D 16 and 3 heads, latent 40):
  the wrappers zero-pad them (exact zeros in every dot). The paged cache uses pages of 32
  tokens: 8 pools a page, the whole 8-row tiles the paged scorer's TMA copies.
* Top-k: identical. The kernel's scores sum in another order than XLA's (the MMA, then the
  warpgroup's head sum), so two pools whose scores tie within float32 rounding could swap;
  the inputs here have no such near tie (a swap would fail ``assert_array_equal``, and the
  check would then have to be ``helpers.check_selection``'s tie-aware one).
* Outputs: within bf16 rounding (``TOL``): both paths round the attention output and the
  projections to bf16, in another order.
* Python 3.12 leg (jax >= 0.11: Mosaic GPU's interpret mode); on jax < 0.11 skipped with
  the version in the reason. Interpret mode simulates the warpgroup: tiny shapes.
"""

from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from helpers import f32_layer, padded_batch, tiny8
from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version

pytestmark = [pytest.mark.mosaic, pytest.mark.skipif(
    jax_version() < MOSAIC_MIN_JAX,
    reason=f"Mosaic GPU kernels need jax >= {'.'.join(map(str, MOSAIC_MIN_JAX))} "
           f"(this is jax {jax.__version__})",
)]

TOL = 2 * 2.0**-8  # two bf16 ulps at 1.0 (relative) and absolute
KPOOL, TOPK, PAGE = 4, 4, 32  # one pool of 4 selected: a real choice from 8 tokens on


def bf16_layer(cfg, implementation, seed=3, idx=1):
    return f32_layer(cfg, idx, seed=seed, dtype=jnp.bfloat16, implementation=implementation,
                     block_q=8)


@contextlib.contextmanager
def mosaic_calls(monkeypatch):
    """Counts the calls of each Mosaic kernel entry the public wrappers dispatch to (a
    jitted step calls them once per trace: a count >= 1 says the program holds the kernel)."""
    import pallas_kernels.attention as attention
    import pallas_kernels.scoring as scoring

    seen = collections.Counter()

    def counted(module, name):
        fn = getattr(module, name)

        def call(*a, **k):
            seen[name] += 1
            return fn(*a, **k)

        monkeypatch.setattr(module, name, call)

    counted(scoring, "_index_scores_mosaic")
    counted(scoring, "_index_scores_paged_mosaic")
    counted(attention, "_sparse_mla_mosaic")
    yield seen


def _close(a, b, msg=""):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=TOL, rtol=TOL, err_msg=msg)


@pytest.fixture(scope="module")
def cfg():
    return gd.DsaConfig.tiny(index_kpool=KPOOL, index_topk=TOPK)


def test_prefill_equals_xla(cfg, monkeypatch):
    x, mask = padded_batch(cfg, (0, 3), 10, seed=11)
    x = jnp.asarray(x, jnp.bfloat16)
    o1, t1 = bf16_layer(cfg, "xla")(x, attention_mask=jnp.asarray(mask))
    with mosaic_calls(monkeypatch) as seen:
        o2, t2 = bf16_layer(cfg, "mosaic_interpret")(x, attention_mask=jnp.asarray(mask))
    assert seen["_index_scores_mosaic"] >= 1 and seen["_sparse_mla_mosaic"] >= 1, seen
    assert o2.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(t2), np.asarray(t1))
    _close(o2, o1)


def test_chunked_decode_equals_xla(cfg, monkeypatch):
    from glm5_dsa_jax.decode import DsaDecoder

    x, mask = padded_batch(cfg, (0, 2), 10, seed=12)
    outs = []
    for impl in ("xla", "mosaic_interpret"):
        dec = DsaDecoder(bf16_layer(cfg, impl), 2, 16)
        with mosaic_calls(monkeypatch) as seen:
            res = [dec(x[:, :8], mask[:, :8])] + [
                dec(x[:, i:i + 1], mask[:, i:i + 1]) for i in range(8, 10)]
        outs.append([tuple(map(np.asarray, r)) for r in res])
        if impl != "xla":  # the chunk and the decode steps ran the Mosaic kernels
            assert seen["_index_scores_mosaic"] >= 1 and seen["_sparse_mla_mosaic"] >= 1, seen
        else:
            assert not seen, seen
    for step, ((o1, t1), (o2, t2)) in enumerate(zip(*outs)):
        np.testing.assert_array_equal(t2, t1, err_msg=f"step {step}")
        _close(o2, o1, f"step {step}")


def _paged_run(layer, x, mask):
    """A chunk of 8 tokens then 2 decode steps through ``init_paged_cache`` (pages of
    ``PAGE`` tokens, more pages than the two sequences need)."""
    cache = layer.init_paged_cache(2, num_pages=4, page_size=PAGE)
    out, topk, cache = layer(jnp.asarray(x[:, :8]), attention_mask=jnp.asarray(mask[:, :8]),
                             cache=cache)
    res = [(np.asarray(out), np.asarray(topk))]
    for i in range(8, 10):
        out, topk, cache = layer(jnp.asarray(x[:, i:i + 1]),
                                 attention_mask=jnp.asarray(mask[:, i:i + 1]), cache=cache)
        res.append((np.asarray(out), np.asarray(topk)))
    return res


def test_paged_cache_equals_xla(cfg, monkeypatch):
    x, mask = padded_batch(cfg, (0, 2), 10, seed=13)
    x = x.astype(jnp.bfloat16)
    ref = _paged_run(bf16_layer(cfg, "xla"), x, mask)
    with mosaic_calls(monkeypatch) as seen:
        got = _paged_run(bf16_layer(cfg, "mosaic_interpret"), x, mask)
    assert seen["_index_scores_paged_mosaic"] >= 1 and seen["_sparse_mla_mosaic"] >= 1, seen
    for step, ((o1, t1), (o2, t2)) in enumerate(zip(ref, got)):
        np.testing.assert_array_equal(t2, t1, err_msg=f"step {step}")
        _close(o2, o1, f"step {step}")


def test_tp_sharded_layer_equals_xla(monkeypatch):
    """``shard_layer`` on a 2-way TP mesh (heads split): prefill and a decode step on the
    Mosaic kernels equal the unsharded layer on the references.

    Both devices interpret their kernels at once (``shard_map``). jax 0.12's interpret mode
    ends each kernel with a check that no barrier is left allocated, over the simulated
    shared memory of *every* device, before the devices meet at its clean-up barrier: the
    device that finishes first sees the other's barriers and fails. That check is a no-op
    here (it still runs in every single-device test above)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    from glm5_dsa_jax.parallel.sharding import shard_layer

    monkeypatch.setattr(gpu_callbacks, "_assert_no_barriers_allocated", lambda token: token)

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest sets 8 virtual CPU devices)")
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    cfg = tiny8(index_kpool=KPOOL, index_topk=TOPK)
    x, mask = padded_batch(cfg, (0, 2), 10, seed=14)
    x = x.astype(jnp.bfloat16)
    runs = []
    for impl, place in (("xla", False), ("mosaic_interpret", True)):
        layer = bf16_layer(cfg, impl, seed=4)
        if place:
            layer = shard_layer(layer, mesh)
        cache = layer.init_cache(2, 16)
        with mosaic_calls(monkeypatch) as seen:
            o, t, cache = layer(jnp.asarray(x[:, :9]), attention_mask=jnp.asarray(mask[:, :9]),
                                cache=cache)
            o2, t2, _ = layer(jnp.asarray(x[:, 9:]), attention_mask=jnp.asarray(mask[:, 9:]),
                              cache=cache)
        runs.append([(np.asarray(o), np.asarray(t)), (np.asarray(o2), np.asarray(t2))])
        if place:
            assert seen["_index_scores_mosaic"] >= 2 and seen["_sparse_mla_mosaic"] >= 2, seen
    for step, ((o1, t1), (o2, t2)) in enumerate(zip(*runs)):
        np.testing.assert_array_equal(t2, t1, err_msg=f"step {step}")
        _close(o2, o1, f"step {step}")


@pytest.mark.parametrize("capability, mosaic", [((9, 0), True), ((10, 0), False)])
def test_blackwell_runs_scoring_and_attention_on_triton(monkeypatch, capability, mosaic):
    """The Mosaic scoring and attention kernels are wgmma, which Blackwell lacks (its
    compile aborts the process): on a CUDA target of capability >= 10 the wrappers asked for
    ``"mosaic"`` lower the Triton kernels instead; on Hopper the Mosaic ones."""
    import pallas_kernels as pk
    import pallas_kernels._mosaic as ms
    from pallas_kernels._common import lower_for_cuda, triton_calls

    monkeypatch.setattr(ms, "target_device", lambda: ("cuda", capability))
    bf = jnp.bfloat16
    s = jax.ShapeDtypeStruct
    scores = lower_for_cuda(
        lambda q, w, p, v, f, t: pk.index_scores(q, w, p, v, f, t, kpool=4, implementation="mosaic"),
        s((1, 1, 32, 128), bf), s((1, 1, 32), jnp.float32), s((1, 256, 128), bf),
        s((1, 256), jnp.bool_), s((1,), jnp.int32), s((1, 1), jnp.int32))
    mla = lower_for_cuda(
        lambda q, lat, ids: pk.sparse_mla(q, lat, ids, scale=0.1, implementation="mosaic"),
        s((1, 1, 64, 512), bf), s((1, 1024, 512), bf), s((1, 1, 64), jnp.int32))
    for lowered, name in ((scores, "index_scores"), (mla, "sparse_mla")):
        assert ("mosaic_gpu" in lowered.as_text()) == mosaic, name
        assert bool(triton_calls(lowered)) == (not mosaic), name
