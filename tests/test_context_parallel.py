"""Context parallelism (issue 27, first slice): ``shard_layer(layer, mesh, axis="tp",
seq_axis="cp")`` on the 8 virtual CPU devices of conftest.py, against the unsharded layer.
Float32 throughout.

What is compared: a chunked prefill (a chunk of ``S`` tokens, more pools than ``select_k``,
left padding of different depths) then decode steps on the contiguous cache, on (cp, tp) =
(2, 4), (4, 2), (8, 1) and (data, cp, tp) = (2, 2, 2), eager and jitted, ``Explicit`` and
``Auto`` axes, full and shared layers, NoPE and RoPE: top-k rows bit for bit, outputs to
``F32_REORDER`` (the attention is merged from per-device partials by their log-sum-exp and
``o_proj`` all-reduced over tp: other summation orders, ~1e-7 here; a wrong token or pool
moves outputs by O(0.1)), the cache's contents gathered bit for bit, and each device holding
``1/cp`` of the token rows and pools. ``merge_candidates`` against ``topk_pools`` on scores
full of ties. Bad input: ``ValueError`` naming the sizes, the layer and cache unchanged.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.parallel import context
from glm5_dsa_jax.parallel import sharding as sh
from helpers import F32_REORDER, f32_layer, jitted_call, padded_batch, rope_tiny
from helpers import tiny8 as cfg  # 8 heads: tp 1, 2 and 4 divide them; kpool 4, select_k 4

ATOL = RTOL = F32_REORDER
S, STEPS, MAX_LEN = 40, 3, 64  # 10 pools in the chunk (select_k 4); 64 slots: cp * kpool = 32 divides
PADS = (0, 5, 2, 9)


def mesh_of(shape, names=("cp", "tp"), mode="explicit"):
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[mode]
    return jax.make_mesh(tuple(shape), names, axis_types=(kind,) * len(shape))


def inputs(config, batch):
    return padded_batch(config, PADS[:batch], S + STEPS, seed=0)


def run(layer, config, batch=2, jit=False, prev=None, dtype=None, **fmt):
    """A chunk of ``S`` then ``STEPS`` decode steps: ``([(out, topk)], cache)`` as numpy.
    ``prev``: a full layer's top-k rows per call (a shared layer's ``prev_topk``)."""
    x, mask = inputs(config, batch)
    cache = layer.init_cache(batch, MAX_LEN, dtype, **fmt)
    if jit:
        f, state = jitted_call(layer)
        call = lambda *a, **kw: f(state, *a, **kw)  # noqa: E731
    else:
        call = layer
    spans = [(0, S)] + [(t, t + 1) for t in range(S, S + STEPS)]
    res = []
    for i, (a, b) in enumerate(spans):
        kw = {} if prev is None else dict(prev_topk=prev[i][1])
        out, topk, cache = call(x[:, a:b], attention_mask=mask[:, a:b], cache=cache, **kw)
        res.append((np.asarray(out), np.asarray(topk)))
    return res, cache


def assert_same(got, want):
    for i, ((o, t), (o0, t0)) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(t, t0, err_msg=f"call {i}: top-k")
        np.testing.assert_allclose(o, o0, atol=ATOL, rtol=RTOL, err_msg=f"call {i}: out")


def assert_split(cache, cp):
    """Each device holds ``1/cp`` of the slots and pools; nothing else is split over cp."""
    for name in ("latent_store", "key_valid", "pooled_store", "pool_valid"):
        a = getattr(cache, name)
        assert a.sharding.spec[1] == "cp", (name, a.sharding.spec)
        for shard in a.addressable_shards:
            assert shard.data.shape[1] == a.shape[1] // cp, (name, shard.data.shape, a.shape)
    assert cache.latent_store.shape[1] == MAX_LEN
    for name in ("stage_keys", "stage_valid", "first_key", "n_valid", "length"):
        a = getattr(cache, name)
        assert "cp" not in tuple(a.sharding.spec), (name, a.sharding.spec)
        assert all(s.data.shape[1:] == a.shape[1:] for s in a.addressable_shards), name


def assert_same_cache(got, want):
    """The gathered cache equals the unsharded one: integer and bool fields bit for bit, float
    rows to ``F32_REORDER`` (a data-split batch projects fewer rows: another rounding)."""
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.fixture(scope="module")
def reference():
    layer = f32_layer(cfg(), 1, block_q=8)
    return {batch: run(layer, cfg(), batch) for batch in (2, 4)}


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1)])
def test_chunk_then_decode_equals_unsharded(reference, shape):
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of(shape), axis="tp", seq_axis="cp")
    got, cache = run(layer, cfg())
    want, want_cache = reference[2]
    assert_same(got, want)
    assert_split(cache, shape[0])
    assert_same_cache(cache, want_cache)


def test_data_cp_tp_mesh(reference):
    mesh = mesh_of((2, 2, 2), ("data", "cp", "tp"))
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh, axis="tp", batch_axis="data", seq_axis="cp")
    got, cache = run(layer, cfg(), batch=4)
    want, want_cache = reference[4]
    assert_same(got, want)
    assert_split(cache, 2)
    assert cache.latent_store.sharding.spec[0] == "data"
    assert_same_cache(cache, want_cache)


def test_jitted_auto_axes(reference):
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2), mode="auto"), axis="tp", seq_axis="cp")
    got, _ = run(layer, cfg(), jit=True)
    assert_same(got, reference[2][0])


def test_shared_layer():
    """A shared layer attends over its full layer's ids, the rows split over cp."""
    full = f32_layer(cfg(), 1, block_q=8)
    want_full, _ = run(full, cfg())
    want, _ = run(f32_layer(cfg(), 2, block_q=8), cfg(), prev=want_full)
    layer = sh.shard_layer(f32_layer(cfg(), 2, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, cache = run(layer, cfg(), prev=want_full)
    assert cache.pooled_store is None
    assert_same(got, want)


@pytest.mark.parametrize("index_keys", ["e4m3", "int8"])
def test_fp8_cache(index_keys):
    """An fp8 cache (e4m3 or int8 pooled keys): each shard quantises and writes its own rows
    and pools, the scales with them (split like the rows)."""
    want, want_cache = run(f32_layer(cfg(), 1, block_q=8), cfg(), dtype="fp8", index_keys=index_keys)
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, cache = run(layer, cfg(), dtype="fp8", index_keys=index_keys)
    assert cache.index_format.keys == index_keys
    assert cache.is_fp8 and cache.latent_scale.sharding.spec[1] == "cp"
    assert cache.pooled_scale.sharding.spec[1] == "cp"
    assert_same(got, want)
    assert_same_cache(cache, want_cache)


def test_rope_model():
    config = rope_tiny(index_topk=8, num_attention_heads=2)  # kpool 1: select_k 8 of 40 pools
    want, _ = run(f32_layer(config, 0, block_q=8), config)
    layer = sh.shard_layer(f32_layer(config, 0, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, cache = run(layer, config)
    assert_same(got, want)
    assert_split(cache, 4)


_order_key = jax.jit(pk.order_key)


def _range_best(scores, offset, k):
    """A device's ``k`` best pools of its range under ``topk_pools``' order (a plain sort:
    higher ``order_key`` first, the lower id on ties; ``-inf`` never): ``(keys, global ids)``,
    ``-1`` ids after."""
    keys = np.asarray(_order_key(scores))
    never = int(_order_key(np.float32(-np.inf)))
    b, q, n = scores.shape
    out_k = np.full((b, q, k), np.iinfo(np.int32).min, np.int32)
    out_i = np.full((b, q, k), -1, np.int32)
    for r in np.ndindex(b, q):
        order = sorted((p for p in range(n) if keys[r][p] > never),
                       key=lambda p: (-int(keys[r][p]), p))[:k]
        out_k[r][:len(order)] = keys[r][order]
        out_i[r][:len(order)] = np.asarray(order, np.int32) + offset
    return out_k, out_i


def test_merge_candidates_is_topk_pools():
    """Per-range best K' then the merge = ``topk_pools`` over the whole row, ties included
    (scores from 5 values: most pools tie, ``-0.0`` ties ``+0.0``; ``-inf`` never selected)."""
    rng = np.random.default_rng(0)
    for cp, n_pools, select_k in ((2, 16, 4), (4, 16, 6), (8, 32, 5), (4, 8, 8)):
        scores = rng.choice(np.float32([-np.inf, -1.0, 0.0, -0.0, 2.5]), size=(2, 3, n_pools))
        want = jax.jit(pk.topk_pools_reference, static_argnums=1)(scores, select_k)
        p_loc = n_pools // cp
        parts = [_range_best(scores[..., i * p_loc:(i + 1) * p_loc], i * p_loc, min(select_k, p_loc))
                 for i in range(cp)]
        keys, ids = (np.concatenate([p[j] for p in parts], -1) for j in (0, 1))
        got = jax.jit(context.merge_candidates, static_argnums=2)(keys, ids, select_k)
        np.testing.assert_array_equal(got, want, err_msg=f"cp {cp}, P {n_pools}, K {select_k}")


# ------------------------------------------------------------------------------ bad input
def test_bad_seq_axis_refused_layer_unchanged():
    mesh = mesh_of((2, 2, 2), ("data", "cp", "tp"))
    layer = f32_layer(cfg(), 1, block_q=8)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    cases = [
        (dict(seq_axis="seq"), r"\{'data': 2, 'cp': 2, 'tp': 2\}\) but no axis 'seq'"),
        (dict(seq_axis="tp"), r"seq_axis and axis \(the heads\) are both 'tp'"),
        (dict(batch_axis="data", seq_axis="data"), r"seq_axis and batch_axis \(the sequences\) are both 'data'"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            sh.shard_layer(layer, mesh, axis="tp", **kw)
        assert layer.placement is None
    pallas = f32_layer(cfg(), 1, block_q=8, implementation="pallas_interpret")
    with pytest.raises(ValueError, match="implementation in \\('xla',\\) only, got 'pallas_interpret'"):
        sh.shard_layer(pallas, mesh, axis="tp", seq_axis="cp")
    assert pallas.placement is None
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_capacity_not_divisible_refused():
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    # 40 divides by cp 4 but not by cp * kpool = 16: a pool would straddle two devices.
    with pytest.raises(ValueError, match=r"max_length=40 is not divisible by cp \* kpool = 4 \* 4 = 16"):
        layer.init_cache(2, 40)
    with pytest.raises(ValueError, match=r"max_length=36 is not divisible by cp \* kpool = 4 \* 4 = 16"):
        sh.place_cache(f32_layer(cfg(), 1).init_cache(2, 36), layer.mesh, seq_axis="cp")


def test_cache_placed_otherwise_refused_unchanged():
    """A replicated cache handed to a cp layer: refused, not silently split or gathered."""
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    cache = sh.place_cache(f32_layer(cfg(), 1).init_cache(2, MAX_LEN), layer.mesh)
    x, mask = inputs(cfg(), 2)
    with pytest.raises(ValueError, match=r"placed as P\(\) but a context-parallel layer needs P\(None, 'cp'\)"):
        layer(x[:, :S], attention_mask=mask[:, :S], cache=cache)
    assert int(cache.length) == 0
    split = layer.init_cache(2, MAX_LEN)
    with pytest.raises(ValueError, match=r"seq_axis='cp'\) supports attention='sparse' only, got attention='dense'"):
        layer(x[:, :S], attention_mask=mask[:, :S], cache=split, attention="dense")
    assert int(split.length) == 0 and not np.asarray(split.key_valid).any()


def decode_with_rollback(layer):
    """``DsaDecoder``: the chunk, 2 steps, ``rollback(2)``, 2 steps again: ``(results, decoder)``."""
    dec = gd.DsaDecoder(layer, 2, MAX_LEN, max_rollback=4)
    x, mask = inputs(cfg(), 2)
    got = [dec(x[:, :S], mask[:, :S])] + [dec(x[:, t:t + 1], mask[:, t:t + 1]) for t in (S, S + 1)]
    dec.rollback(2)
    got += [dec(x[:, t:t + 1], mask[:, t:t + 1]) for t in (S + 2, S + 1)]  # other tokens this time
    return jax.tree.map(np.asarray, got), dec


def test_decoder_with_rollback():
    """``DsaDecoder`` (``make_step``): the cache keeps its split between steps (in and out
    shardings), one compilation for the chunk and one for every decode step; ``rollback``
    (a jitted global-view update of the split validity) gives the unsharded decoder's
    results after it."""
    want, _ = decode_with_rollback(f32_layer(cfg(), 1, block_q=8))
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, dec = decode_with_rollback(layer)
    assert_same(got, want)
    assert_split(dec.cache, 4)
    assert dec.step.traces == 2


def step_collectives(layer, max_length):
    """``[(result type, op)]`` of every collective in the compiled decode step of a
    ``DsaDecoder`` of ``max_length`` slots (tuple all-reduces, which XLA combines, included)."""
    dec = gd.DsaDecoder(layer, 2, max_length)
    x, mask = inputs(cfg(), 2)
    hlo = dec.step.lower(dec.params, x[:, :1], mask[:, :1], dec.cache).compile().as_text()
    ops = r"all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter"
    found = [re.search(rf"= (.*?) ({ops})(?:-start)?\(", ln) for ln in hlo.splitlines()]
    return sorted((re.sub(r"\{[\d,]+\}", "", m.group(1)), m.group(2)) for m in found if m)


def test_bytes_crossing_devices_do_not_grow_with_the_context():
    """The decode step's collectives at 64 and 1024 slots are the same ops on the same
    shapes: the candidates' two all-gathers ``s32[B, 1, cp * K]``, the tail's validity, the
    partials' ``pmax`` and ``psum`` ``[B, 1, H_local(, V)]``, the ``o_proj`` ``psum``."""
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    small, large = step_collectives(layer, 64), step_collectives(layer, 1024)
    assert small == large
    c = cfg()
    k, v, h_loc = c.max_select_k, c.kv_lora_rank, c.num_attention_heads // 2
    assert small == sorted([
        (f"s32[2,1,{4 * k}]", "all-gather"), (f"s32[2,1,{4 * k}]", "all-gather"),  # keys, ids
        (f"s32[2,1,{c.index_kpool - 1}]", "all-reduce"),  # the tail's validity
        (f"f32[2,1,{h_loc}]", "all-reduce"),  # pmax of the log-sum-exp
        (f"(f32[2,1,{h_loc},{v}], f32[2,1,{h_loc}])", "all-reduce"),  # weighted partials, weights
        (f"f32[2,1,{c.hidden_size}]", "all-reduce"),  # o_proj over tp
    ]), small

