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

The kernels per shard: a layer of ``implementation="pallas_interpret"`` (the Triton kernels
in interpret mode) on (cp, tp) = (2, 4), and of ``"mosaic_interpret"`` in bfloat16 on cp 2
(jax >= 0.11), against the unsharded layer; and the decode step at GLM-5.3-Flash shapes
with cp 8 lowered for CUDA (no GPU: a layer built under ``nnx.eval_shape`` and placed on an
abstract mesh of 8 abstract H100s, ``pk.cuda_mesh``), its kernels launched at per-shard
shapes and its collectives the context-independent ones.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, use_abstract_mesh

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.parallel import context
from glm5_dsa_jax.parallel import sharding as sh
from glm5_dsa_jax.parallel.placement import Placement
from helpers import F32_REORDER, check_cp8_decode_kernels, f32_layer, jitted_call, padded_batch, rope_tiny
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
@pytest.mark.slow
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
@pytest.mark.slow
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


@pytest.mark.slow
def test_rope_model():
    config = rope_tiny(index_topk=8, num_attention_heads=2)  # kpool 1: select_k 8 of 40 pools
    want, _ = run(f32_layer(config, 0, block_q=8), config)
    layer = sh.shard_layer(f32_layer(config, 0, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, cache = run(layer, config)
    assert_same(got, want)
    assert_split(cache, 4)


# ------------------------------------------------------------------------------ kernels per shard
NEEDS_MOSAIC = pytest.mark.skipif(
    pk.jax_version() < pk.MOSAIC_MIN_JAX,
    reason=f"Mosaic GPU kernels need jax >= {pk.MOSAIC_MIN_JAX} (this is jax {jax.__version__})")


def test_pallas_kernels_per_shard(reference, monkeypatch):
    """``implementation="pallas_interpret"``: every step of a shard runs the Triton kernel
    (``kpool_compress``, ``index_scores``, ``topk_pools``, ``expand_selection``,
    ``sparse_mla_partial``'s out and log-sum-exp; the launches are counted); prefill then
    decode equal the unsharded layer (``"xla"``: the kernels' selections are its bit for
    bit, ``test_layer_pallas.py``)."""
    from jax.experimental import pallas

    launched = []
    pallas_call = pallas.pallas_call
    monkeypatch.setattr(pallas, "pallas_call", lambda *a, **k: launched.append(k.get("name")) or pallas_call(*a, **k))
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8, implementation="pallas_interpret"), mesh_of((2, 4)),
                           axis="tp", seq_axis="cp")
    got, cache = run(layer, cfg())
    assert {"kpool_compress", "index_scores", "topk_pools", "expand_selection", "sparse_mla"} <= set(
        launched), launched
    want, want_cache = reference[2]
    assert_same(got, want)
    assert_split(cache, 2)
    assert_same_cache(cache, want_cache)


@pytest.mark.mosaic
@NEEDS_MOSAIC
def test_mosaic_kernels_per_shard(monkeypatch):
    """``implementation="mosaic_interpret"`` in bfloat16 on cp 2 (the Mosaic scoring,
    selection and attention kernels per shard, the attention's log-sum-exp from the same
    launch): a chunk then a decode step select as the unsharded layer on the references,
    top-k bit for bit, and their outputs are the ``"xla"`` cp layer's within two bf16 ulps
    (the kernels round the attention output to bf16 in another order). Against the
    same mesh's ``"xla"`` layer, because the chunk's projections run on ``S/cp`` rows
    there (``context._row_split``), and XLA:CPU's bf16 dots (jax 0.12) round some rows
    otherwise at another row count; float32 layers compare with the unsharded one in
    the other tests. Both devices interpret their kernels at once:
    jax's end-of-kernel barrier check sees the other device's barriers, a no-op here as in
    ``test_layer_mosaic.py::test_tp_sharded_layer_equals_xla`` (which says why)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    import pallas_kernels.attention as attention

    monkeypatch.setattr(gpu_callbacks, "_assert_no_barriers_allocated", lambda token: token)
    calls = []
    mosaic = attention._sparse_mla_mosaic
    monkeypatch.setattr(attention, "_sparse_mla_mosaic", lambda *a, **k: calls.append(k) or mosaic(*a, **k))
    config = cfg(index_kpool=4, index_topk=4)  # one pool selected of up to 4
    x, mask = padded_batch(config, (0, 2), 10, seed=14)
    x = jnp.asarray(x, jnp.bfloat16)
    runs = []
    for impl, mesh in (("xla", None), ("xla", mesh_of((2, 1))), ("mosaic_interpret", mesh_of((2, 1)))):
        layer = f32_layer(config, 1, seed=4, dtype=jnp.bfloat16, implementation=impl, block_q=8)
        if mesh is not None:
            layer = sh.shard_layer(layer, mesh, axis="tp", seq_axis="cp")
        cache = layer.init_cache(2, 16)
        o, t, cache = layer(x[:, :9], attention_mask=mask[:, :9], cache=cache)
        o2, t2, _ = layer(x[:, 9:], attention_mask=mask[:, 9:], cache=cache)
        runs.append([(np.asarray(o, np.float32), np.asarray(t)), (np.asarray(o2, np.float32), np.asarray(t2))])
    assert calls and all(k["return_lse"] for k in calls), calls
    tol = 2 * 2.0**-8
    for step, ((_, t0), (o1, t1), (o2, t2)) in enumerate(zip(*runs)):
        np.testing.assert_array_equal(t1, t0, err_msg=f"step {step}")
        np.testing.assert_array_equal(t2, t0, err_msg=f"step {step}")
        np.testing.assert_allclose(o2, o1, atol=tol, rtol=tol, err_msg=f"step {step}")


def _lowered_cp8_decode(implementation, tp, context=1 << 20, chunk=1):
    """The ``DsaDecoder`` decode step (``make_step``'s ``jax.jit``: batch 1, one token; or a
    prefill chunk of ``chunk`` tokens) of
    GLM-5.3-Flash's first DSA layer in bf16 on a ``(cp, tp) = (8, tp)`` mesh with a
    ``context``-slot bf16 cache, lowered for CUDA without a GPU: the layer built under
    ``nnx.eval_shape`` (shapes only) and placed on ``pk.cuda_mesh`` (8 * tp abstract H100s;
    ``shard_layer`` needs a concrete mesh: it puts the parameters), the step traced on
    abstract parameters, rows and cache carrying the shardings it is compiled with."""
    config = gd.DsaConfig.glm53_flash()
    idx = config.dsa_layers[0]
    mesh = pk.cuda_mesh("h100", (8, tp), ("cp", "tp"))
    layer = nnx.eval_shape(lambda: gd.DsaAttention(config, idx, rngs=nnx.Rngs(0), implementation=implementation))
    layer.placement = Placement(mesh, "tp", None, "cp")
    cache = jax.eval_shape(lambda: gd.init_cache(config, 1, context, has_indexer=True, dtype=jnp.bfloat16))
    rows = NamedSharding(mesh, P())
    step, params = gd.make_step(layer)
    params, cache = sh.abstract_step_operands(layer, params, cache)  # shardings the step compiles with
    x = jax.ShapeDtypeStruct((1, chunk, config.hidden_size), jnp.bfloat16, sharding=rows)
    m = jax.ShapeDtypeStruct((1, chunk), jnp.bool_, sharding=rows)
    with use_abstract_mesh(mesh):
        lowered = step.jitted(cache).trace(params, x, m, cache, None).lower(lowering_platforms=("cuda",))
    return config, lowered.as_text()


def _collectives(text):
    """``[(op, result type)]`` of the module's all-gathers and all-reduces, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(
        r'"stablehlo\.(all_gather|all_reduce)"\(.*?\) -> (tensor<[^>]*>)', text, re.S)]


@pytest.mark.lowering
@pytest.mark.parametrize("implementation, tp", [("pallas", 1), ("pallas", 8),
                                                pytest.param("mosaic", 1, marks=NEEDS_MOSAIC)])
def test_decode_step_lowers_for_cuda_at_cp8(implementation, tp):
    """GLM-5.3-Flash decode at a 1M-token context on cp 8 (and tp 1 or 8) lowers for CUDA
    (``_lowered_cp8_decode``): one program of ``8 * tp`` partitions whose kernels run at
    per-shard shapes (the scoring grid covers ``P / 8`` pools, the attention ``H / tp``
    heads; ``"pallas"``: every step a Triton launch; ``"mosaic"``: the Mosaic scoring,
    selection and attention, Triton for the two steps without a Mosaic kernel), and whose
    collectives are the candidates' all-gathers ``[1, 1, 8 * select_k]`` and the small
    all-reduces, nothing context-sized."""
    config, text = _lowered_cp8_decode(implementation, tp)
    assert f"mhlo.num_partitions = {8 * tp}" in text
    k, h, v = config.max_select_k, config.num_attention_heads // tp, config.kv_lora_rank
    check_cp8_decode_kernels(config, text, implementation, tp)
    assert sorted(_collectives(text)) == sorted([
        ("all_gather", f"tensor<1x1x{8 * k}xi32>"), ("all_gather", f"tensor<1x1x{8 * k}xi32>"),  # keys, ids
        ("all_reduce", f"tensor<1x1x{config.index_kpool - 1}xi32>"),  # the tail's validity
        ("all_reduce", f"tensor<1x1x{h}xf32>"),  # pmax of the log-sum-exp
        ("all_reduce", f"tensor<1x1x{h}x{v}xf32>"), ("all_reduce", f"tensor<1x1x{h}xf32>"),  # partials, weights
        ("all_reduce", f"tensor<1x1x{config.hidden_size}xbf16>"),  # o_proj over tp, in the layer's dtype
    ]), _collectives(text)


@pytest.mark.lowering
def test_prefill_chunk_lowers_for_cuda_at_cp8():
    """A 4,096-token prefill chunk of GLM-5.3-Flash at a 1M-token context on (cp, tp) = (8,
    8), ``"pallas"``, lowers for CUDA: each device projects 512 of the chunk's rows, whose
    projections are all-gathered (``q_lat`` of the 8 local heads, the latent rows, the
    indexer's queries, weights, keys and gates), scores its ``P / 8`` pools in the Triton
    kernel, and runs ``o_proj`` (its tp all-reduce) on its 512 rows, the outputs
    all-gathered; no collective is context-sized."""
    chunk, tp = 4096, 8
    config, text = _lowered_cp8_decode("pallas", tp, chunk=chunk)
    assert f"mhlo.num_partitions = {8 * tp}" in text
    mine, h = chunk // 8, config.num_attention_heads // tp
    cr, hid, hi, d = config.kv_cache_dim, config.hidden_size, config.index_n_heads, config.index_head_dim
    found = _collectives(text)
    for want in (f"1x{chunk}x{h}x{cr}xbf16", f"1x{chunk}x{cr}xbf16", f"1x{chunk}x{hi}x{d}xbf16",
                 f"1x{chunk}x{hid}xbf16"):  # q_lat, rows, indexer queries, the outputs
        assert ("all_gather", f"tensor<{want}>") in found, (want, found)
    assert ("all_reduce", f"tensor<1x{mine}x{hid}xbf16>") in found, found  # o_proj over tp on 512 rows
    assert ("all_reduce", f"tensor<1x{chunk}x{hid}xbf16>") not in found, found
    assert not [t for _, t in found if str(config.max_position_embeddings // 8) in t], found
    assert "index_scores" in [c["name"] for c in pk.triton_calls(text)]


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
    # Every implementation a layer holds runs per shard; an unresolved name is refused.
    with pytest.raises(ValueError, match=r"seq_axis='cp'\) supports implementation in \('xla', 'pallas', "
                                         r"'pallas_interpret', 'mosaic', 'mosaic_interpret'\), got 'auto'"):
        context.check_supported("auto", "cp")
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


def step_collectives(layer, max_length, chunk=1):
    """``[(result type, op)]`` of every collective in the compiled step of ``chunk`` tokens
    (1: a decode step) of a ``DsaDecoder`` of ``max_length`` slots (tuple all-reduces, which
    XLA combines, included)."""
    dec = gd.DsaDecoder(layer, 2, max_length)
    x, mask = inputs(cfg(), 2)
    hlo = dec.step.lower(dec.params, x[:, :chunk], mask[:, :chunk], dec.cache).compile().as_text()
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



def test_prefill_projects_a_cp_th_of_the_chunk():
    """A prefill chunk's projections are split over cp (``context._row_split``): each
    device projects ``S/cp`` rows and the projected rows are all-gathered; ``o_proj`` (and
    its tp ``psum``) runs on ``S/cp`` rows, its output all-gathered. Read in the compiled
    prefill step at (cp, tp) = (4, 2); a decode step is not split (one row)."""
    c = cfg()
    layer = sh.shard_layer(f32_layer(c, 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    found = step_collectives(layer, MAX_LEN, chunk=S)
    h_loc, cr, hid = c.num_attention_heads // 2, c.kv_cache_dim, c.hidden_size
    assert (f"f32[2,{S // 4},{hid}]", "all-reduce") in found, found  # o_proj over tp, a quarter of the rows
    assert (f"f32[2,{S},{hid}]", "all-reduce") not in found, found
    gathered = {t for t, op in found if op == "all-gather"}
    for want in (f"f32[2,{S},{h_loc},{cr}]", f"f32[2,{S},{cr}]", f"f32[2,{S},{hid}]"):  # q_lat, rows, out
        assert any(want in t for t in gathered), (want, gathered)
