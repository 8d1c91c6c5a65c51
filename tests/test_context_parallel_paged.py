"""Context parallelism with a paged cache (issue 27): ``shard_layer(layer, mesh, axis="tp",
seq_axis="cp")`` then ``init_paged_cache`` / ``PagedDecoder`` on the 8 virtual CPU devices of
conftest.py, against the unsharded paged layer. Float32 throughout.

What is compared: a prefill in two chunks (more pools than ``select_k``, the rows' valid
tokens at different offsets: left padding of different depths) then decode steps, on (cp,
tp) = (2, 4), (4, 2), (8, 1) and (data, cp, tp) = (2, 2, 2): top-k rows bit for bit, outputs
to ``F32_REORDER`` (the attention merged from per-device partials by their log-sum-exp,
``o_proj`` all-reduced over tp), each sequence's content (``export``: latent rows and pools
in timeline order) to ``F32_REORDER``, each device holding ``1/cp`` of the page pools and
of the pages taken (the free stack's round-robin); ``rollback``, ``fork`` and ``export`` /
``load`` on split pools, each followed by a step. The kernels per shard:
``"pallas_interpret"`` on (cp, tp) = (2, 4) and ``"mosaic_interpret"`` in bfloat16 on cp 2
(jax >= 0.11) against the unsharded paged layer of the same implementation, and the decode
step of GLM-5.3-Flash with a 1M-token paged cache at cp 8 lowered for CUDA (as
``test_context_parallel.py`` does for the contiguous cache). Bad input: ``ValueError``
naming the sizes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, use_abstract_mesh

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.parallel import context_paged
from glm5_dsa_jax.parallel import sharding as sh
from glm5_dsa_jax.parallel.placement import Placement
from helpers import F32_REORDER, check_cp8_decode_kernels, f32_layer, jitted_call, padded_batch, rope_tiny
from helpers import tiny8 as cfg  # 8 heads: tp 1, 2 and 4 divide them; kpool 4, select_k 4

ATOL = RTOL = F32_REORDER
SPANS = [(0, 20), (20, 40), (40, 41), (41, 42), (42, 43)]  # two prefill chunks (one length), three steps
PAGES, PAGE = 16, 8  # 16 pages of 8 tokens (2 pools each): cp 2, 4 and 8 divide; 43 tokens = 6 pages a row
PADS = (0, 5, 2, 9)


def mesh_of(shape, names=("cp", "tp"), mode="explicit"):
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[mode]
    return jax.make_mesh(tuple(shape), names, axis_types=(kind,) * len(shape))


def run(layer, config, batch=2, jit=False, prev=None, dtype=None, num_pages=PAGES):
    """The chunks and steps of ``SPANS``: ``([(out, topk)], cache)`` as numpy. ``prev``: a
    full layer's results per call (a shared layer's ``prev_topk``)."""
    x, mask = padded_batch(config, PADS[:batch], SPANS[-1][1], seed=0)
    cache = layer.init_paged_cache(batch, num_pages, PAGE, dtype)
    call = layer
    if jit:
        f, state = jitted_call(layer)
        call = lambda *a, **kw: f(state, *a, **kw)  # noqa: E731
    res = []
    for i, (a, b) in enumerate(SPANS):
        kw = {} if prev is None else dict(prev_topk=prev[i][1])
        out, topk, cache = call(x[:, a:b], attention_mask=mask[:, a:b], cache=cache, **kw)
        res.append((np.asarray(out), np.asarray(topk)))
    return res, cache


def assert_same(got, want):
    for i, ((o, t), (o0, t0)) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(t, t0, err_msg=f"call {i}: top-k")
        np.testing.assert_allclose(o, o0, atol=ATOL, rtol=RTOL, err_msg=f"call {i}: out")


def assert_same_content(cache, want):
    """Every sequence's exported content (timeline order, no page ids) equals the unsharded
    cache's: lengths and pools bit for bit, float rows to ``F32_REORDER``."""
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(want.lengths))
    for row in range(cache.max_seqs):
        got, ref = cache.export(row), want.export(row)
        for name in ("latent", "pooled", "stage_keys"):
            a, b = getattr(got, name), getattr(ref, name)
            if a is not None:
                np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL, err_msg=f"row {row}: {name}")


def assert_split(cache, cp, data=None):
    """Each device holds ``1/cp`` (of its data shard's) pages of every pool; the page table,
    the stage and the status are not split over cp; the pages taken spread evenly (to one)."""
    want = P((data, "cp")) if data else P("cp")
    for name in gd.PagedCache.PAGE_AXIS_FIELDS:
        a = getattr(cache, name)
        if a is None:
            continue
        assert trim(a.sharding.spec) == want, (name, a.sharding.spec)
        dp = 1 if data is None else 2
        assert all(s.data.shape[0] == a.shape[0] // (dp * cp) for s in a.addressable_shards), name
    for name in ("block_table", "lengths", "free", "owner", "refs"):
        assert "cp" not in str(getattr(cache.pages, name).sharding.spec), name
    for name in ("stage_keys", "stage_gate", "status"):
        assert "cp" not in str(getattr(cache, name).sharding.spec), name
    dp = 1 if data is None else 2
    per_device = cache.num_pages // dp // cp
    tables = np.asarray(cache.block_table).reshape(dp, -1, cache.pages_per_seq)
    for k, table in enumerate(tables):  # a data shard's rows: its pages, local ids
        held = np.bincount(table[table >= 0] // per_device, minlength=cp)
        assert held.max() - held.min() <= 1, (k, table, held)


P = jax.sharding.PartitionSpec


def trim(spec):
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


@pytest.fixture(scope="module")
def reference():
    return {2: run(f32_layer(cfg(), 1, block_q=8), cfg(), 2)}


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1)])
@pytest.mark.slow
def test_chunks_then_decode_equal_unsharded(reference, shape):
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of(shape), axis="tp", seq_axis="cp")
    got, cache = run(layer, cfg())
    want, want_cache = reference[2]
    assert_same(got, want)
    assert_split(cache, shape[0])
    assert_same_content(cache, want_cache)


@pytest.mark.slow
def test_data_cp_tp_mesh():
    """A batch axis too: one page table per data shard, its pages split over cp."""
    mesh = mesh_of((2, 2, 2), ("data", "cp", "tp"))
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh, axis="tp", batch_axis="data", seq_axis="cp")
    got, cache = run(layer, cfg(), batch=4, num_pages=2 * PAGES)
    want, want_cache = run(f32_layer(cfg(), 1, block_q=8), cfg(), batch=4, num_pages=2 * PAGES)
    assert_same(got, want)
    assert_split(cache, 2, data="data")
    assert_same_content(cache, want_cache)


@pytest.mark.slow
def test_jitted_auto_axes_fp8():
    """Under ``jax.jit`` on ``Auto`` axes, with an fp8 cache (each owner quantises its rows
    and writes their scales beside them)."""
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2), mode="auto"), axis="tp", seq_axis="cp")
    want, want_cache = run(f32_layer(cfg(), 1, block_q=8), cfg(), dtype="fp8")
    got, cache = run(layer, cfg(), jit=True, dtype="fp8")
    assert cache.is_fp8 and trim(cache.latent_scale.sharding.spec) == P("cp")
    assert_same(got, want)
    assert_same_content(cache, want_cache)


@pytest.mark.slow
def test_shared_layer_and_rope(reference):
    """A shared layer attends over its full layer's ids; a RoPE model (kpool 1)."""
    want, _ = run(f32_layer(cfg(), 2, block_q=8), cfg(), prev=reference[2][0])
    layer = sh.shard_layer(f32_layer(cfg(), 2, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, cache = run(layer, cfg(), prev=reference[2][0])
    assert cache.pooled_store is None
    assert_same(got, want)
    config = rope_tiny(index_topk=8, num_attention_heads=2)  # kpool 1: select_k 8 of up to 43 pools
    want, _ = run(f32_layer(config, 0, block_q=8), config)
    layer = sh.shard_layer(f32_layer(config, 0, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, cache = run(layer, config)
    assert_same(got, want)
    assert_split(cache, 4)


def decode(layer):
    """``PagedDecoder``: two chunks, three steps, a release of row 0 and a new sequence
    there: ``(results, decoder)``."""
    dec = gd.PagedDecoder(layer, 2, PAGES, PAGE)
    x, mask = padded_batch(cfg(), PADS[:2], SPANS[-1][1], seed=0)
    got = [dec(x[:, a:b], mask[:, a:b]) for a, b in SPANS[:2]]
    got += [dec(x[:, a:b], mask[:, a:b]) for a, b in SPANS[2:]]
    dec.release(np.array([True, False]))
    got += [dec(x[:, a:b], mask[:, a:b]) for a, b in SPANS[2:]]  # row 0 starts again
    return jax.tree.map(np.asarray, got), dec


@pytest.mark.slow
def test_paged_decoder_one_compilation():
    """``PagedDecoder`` on a cp layer: the pools keep their split between steps (in and out
    shardings), one compilation for the chunks (one length) and one for every decode step,
    through a release and a new sequence."""
    want, _ = decode(f32_layer(cfg(), 1, block_q=8))
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, dec = decode(layer)
    assert_same(got, want)
    assert trim(dec.cache.latent_store.sharding.spec) == P("cp")
    assert dec.step.traces == 2


# ------------------------------------------------------------------------------ rollback, fork, load
def churn(layer, config):
    """Two chunks, a step, then the page table's other operations each followed by a step
    of both rows: ``rollback`` (row 0 takes back its last token), ``release`` + ``fork`` (row 1
    restarts as row 0's first 28 tokens: shared pages and a copied partial page),
    ``export`` of row 0 and ``load`` into a released row 1 (re-paged; an export of
    ``config``'s other placement, ``loaded``, when given). ``([(out, topk)], cache)``."""
    x, mask = padded_batch(config, PADS[:2], SPANS[-1][1], seed=0)
    cache = layer.init_paged_cache(2, PAGES, PAGE)
    res = []

    def step(a, b):
        nonlocal cache
        out, topk, cache = layer(x[:, a:b], attention_mask=mask[:, a:b], cache=cache)
        res.append((np.asarray(out), np.asarray(topk)))

    step(0, 20), step(20, 40), step(40, 41)
    cache = cache.rollback(np.array([True, False]), np.array([1, 0], np.int32))
    step(41, 42)
    cache = cache.release(np.array([False, True]))
    cache = cache.fork(np.array([0], np.int32), np.array([1], np.int32), np.array([28], np.int32))
    step(42, 43)
    exported = cache.export(0)
    cache = cache.release(np.array([False, True]))
    cache = cache.load(1, exported)
    step(41, 42)
    return res, cache, exported


@pytest.mark.slow
def test_rollback_fork_load_equal_unsharded():
    """On (cp, tp) = (4, 2), ``"xla"``: ``rollback``, ``release`` + ``fork`` and ``export`` /
    ``load`` of a cache whose pools are split over cp (their global-view programs on the
    split pools, the placement kept) give the unsharded paged cache's steps after each
    (top-k bit for bit, outputs to ``F32_REORDER``) and its content; an export from either
    loads into the other (whatever its mesh)."""
    want, want_cache, want_export = churn(f32_layer(cfg(), 1, block_q=8), cfg())
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    got, cache, exported = churn(layer, cfg())
    assert_same(got, want)
    assert_same_content(cache, want_cache)
    for name in gd.PagedCache.PAGE_AXIS_FIELDS:
        a = getattr(cache, name)
        assert a is None or trim(a.sharding.spec) == P("cp"), (name, a.sharding.spec)
    crossed = cache.release(np.array([False, True])).load(1, want_export)
    back = want_cache.release(np.array([False, True])).load(1, exported)
    assert trim(crossed.latent_store.sharding.spec) == P("cp")
    assert_same_content(crossed, back)


# ------------------------------------------------------------------------------ kernels per shard
NEEDS_MOSAIC = pytest.mark.skipif(
    pk.jax_version() < pk.MOSAIC_MIN_JAX,
    reason=f"Mosaic GPU kernels need jax >= {pk.MOSAIC_MIN_JAX} (this is jax {jax.__version__})")


def test_pallas_kernels_per_shard(monkeypatch):
    """``implementation="pallas_interpret"`` on (cp, tp) = (2, 4): every step of a shard runs
    the Triton kernel (``kpool_compress``, ``index_scores`` over its held pools,
    ``topk_pools`` bounded to its visible held pools, ``expand_selection``,
    ``sparse_mla_partial``; the launches are counted); two chunks then decode steps equal
    the unsharded paged layer of the same implementation: top-k bit for bit, outputs to
    ``F32_REORDER``, the sequences' content too."""
    from jax.experimental import pallas

    want, want_cache = run(f32_layer(cfg(), 1, block_q=8, implementation="pallas_interpret"), cfg())
    launched = []
    pallas_call = pallas.pallas_call
    monkeypatch.setattr(pallas, "pallas_call", lambda *a, **k: launched.append(k.get("name")) or pallas_call(*a, **k))
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8, implementation="pallas_interpret"), mesh_of((2, 4)),
                           axis="tp", seq_axis="cp")
    got, cache = run(layer, cfg())
    assert {"kpool_compress", "index_scores", "topk_pools", "expand_selection", "sparse_mla"} <= set(
        launched), launched
    assert_same(got, want)
    assert_split(cache, 2)
    assert_same_content(cache, want_cache)


@pytest.mark.mosaic
@NEEDS_MOSAIC
def test_mosaic_kernels_per_shard(monkeypatch):
    """``implementation="mosaic_interpret"`` in bfloat16 on cp 2 (the Mosaic scoring,
    selection and attention per shard, the attention's log-sum-exp from the same launch)
    with a paged cache: two chunks then a decode step select as the unsharded paged layer
    of the same implementation (and ``"xla"``), top-k bit for bit, and their outputs are
    the same mesh's ``"xla"`` cp layer's within two bf16 ulps (as
    ``test_context_parallel.py::test_mosaic_kernels_per_shard``, which says why not the
    unsharded layer's: the chunk's projections run on ``S/cp`` rows)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    import pallas_kernels.attention as attention

    monkeypatch.setattr(gpu_callbacks, "_assert_no_barriers_allocated", lambda token: token)
    calls = []
    mosaic = attention._sparse_mla_mosaic
    monkeypatch.setattr(attention, "_sparse_mla_mosaic", lambda *a, **k: calls.append(k) or mosaic(*a, **k))
    # kpool 1, pages of 8: 8 pools a page (the Mosaic paged scoring copies 8-row tiles); 4 of up to 16
    config = cfg(index_kpool=1, index_topk=4)
    x, mask = padded_batch(config, (0, 2), 17, seed=14)
    x = jnp.asarray(x, jnp.bfloat16)
    spans = [(0, 8), (8, 16), (16, 17)]  # two chunks of one query tile each, then a step
    runs = []
    for impl, mesh in (("xla", None), ("mosaic_interpret", None), ("xla", mesh_of((2, 1))),
                       ("mosaic_interpret", mesh_of((2, 1)))):
        layer = f32_layer(config, 1, seed=4, dtype=jnp.bfloat16, implementation=impl, block_q=8)
        if mesh is not None:
            layer = sh.shard_layer(layer, mesh, axis="tp", seq_axis="cp")
        cache = layer.init_paged_cache(2, 8, 8)  # 3 pages a row
        res = []
        for a, b in spans:
            o, t, cache = layer(x[:, a:b], attention_mask=mask[:, a:b], cache=cache)
            res.append((np.asarray(o, np.float32), np.asarray(t)))
        runs.append(res)
    assert any(k.get("return_lse") for k in calls), calls
    tol = 2 * 2.0**-8
    for step, ((_, t0), (_, t1), (o2, t2), (o3, t3)) in enumerate(zip(*runs)):
        for t in (t1, t2, t3):
            np.testing.assert_array_equal(t, t0, err_msg=f"call {step}")
        np.testing.assert_allclose(o3, o2, atol=tol, rtol=tol, err_msg=f"call {step}")


def _lowered_cp8_paged_decode(implementation, tp, context=1 << 20, page=64):
    """The decode step (``make_step``'s ``jax.jit``: one sequence, one token) of
    GLM-5.3-Flash's first DSA layer in bf16 on a ``(cp, tp) = (8, tp)`` mesh with a paged
    bf16 cache of ``context / page`` pages of ``page`` tokens (one sequence may take them
    all), lowered for CUDA without a GPU, as
    ``test_context_parallel._lowered_cp8_decode`` does for the contiguous cache: the layer
    built under ``nnx.eval_shape`` and placed on ``pk.cuda_mesh``, the cache's page pools
    split over cp by ``cache_shardings``."""
    config = gd.DsaConfig.glm53_flash()
    idx = config.dsa_layers[0]
    mesh = pk.cuda_mesh("h100", (8, tp), ("cp", "tp"))
    layer = nnx.eval_shape(lambda: gd.DsaAttention(config, idx, rngs=nnx.Rngs(0), implementation=implementation))
    layer.placement = Placement(mesh, "tp", None, "cp")
    cache = jax.eval_shape(lambda: gd.init_paged_cache(config, 1, context // page, page, has_indexer=True,
                                                       dtype=jnp.bfloat16, seq_shards=8))
    rows = NamedSharding(mesh, P())
    step, params = gd.make_step(layer)
    params, cache = sh.abstract_step_operands(layer, params, cache)  # shardings the step compiles with
    x = jax.ShapeDtypeStruct((1, 1, config.hidden_size), jnp.bfloat16, sharding=rows)
    m = jax.ShapeDtypeStruct((1, 1), jnp.bool_, sharding=rows)
    with use_abstract_mesh(mesh):
        lowered = step.jitted(cache).trace(params, x, m, cache, None).lower(lowering_platforms=("cuda",))
    return config, lowered.as_text()


@pytest.mark.lowering
@pytest.mark.parametrize("implementation, tp", [("pallas", 1), ("pallas", 8),
                                                pytest.param("mosaic", 1, marks=NEEDS_MOSAIC)])
def test_paged_decode_step_lowers_for_cuda_at_cp8(implementation, tp):
    """GLM-5.3-Flash decode with a 1M-token paged cache (16,384 pages of 64) on cp 8 (tp 1
    or 8) lowers for CUDA: one program of ``8 * tp`` partitions whose kernels run at
    per-shard shapes (the scoring over the ``PGL * PPP = 2,048 * 16`` pools a shard can
    hold: ``P / 8``; the attention over ``H / tp`` heads; ``"pallas"`` every step a Triton
    launch, ``"mosaic"`` the Mosaic scoring, selection and attention, Triton for the two
    steps without a Mosaic kernel), and whose collectives are the candidates' all-gathers
    ``[1, 1, 8 * select_k]`` and the partials' small all-reduces: no pool, page table or
    tail validity crosses devices."""
    config, text = _lowered_cp8_paged_decode(implementation, tp)
    assert f"mhlo.num_partitions = {8 * tp}" in text
    k, h, v = config.max_select_k, config.num_attention_heads // tp, config.kv_lora_rank
    check_cp8_decode_kernels(config, text, implementation, tp)
    found = [(m.group(1), m.group(2)) for m in re.finditer(
        r'"stablehlo\.(all_gather|all_reduce)"\(.*?\) -> (tensor<[^>]*>)', text, re.S)]
    assert sorted(found) == sorted([
        ("all_gather", f"tensor<1x1x{8 * k}xi32>"), ("all_gather", f"tensor<1x1x{8 * k}xi32>"),  # keys, ids
        ("all_reduce", f"tensor<1x1x{h}xf32>"),  # pmax of the log-sum-exp
        ("all_reduce", f"tensor<1x1x{h}x{v}xf32>"), ("all_reduce", f"tensor<1x1x{h}xf32>"),  # partials, weights
        ("all_reduce", f"tensor<1x1x{config.hidden_size}xbf16>"),  # o_proj over tp, in the layer's dtype
    ]), found


# ------------------------------------------------------------------------------ bad input
def test_page_count_not_divisible_refused():
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    with pytest.raises(ValueError, match=r"num_pages=18 is not divisible by data shards \* cp = 1 \* 4 = 4"):
        layer.init_paged_cache(2, 18, PAGE)
    with pytest.raises(ValueError, match=r"num_pages=18 is not divisible by data shards \* cp = 1 \* 4 = 4"):
        sh.place_cache(f32_layer(cfg(), 1).init_paged_cache(2, 18, PAGE), layer.mesh, seq_axis="cp")
    with pytest.raises(ValueError, match=r"num_pages=18 gives 18 pages per data shard, not divisible by the 4"):
        gd.init_paged_cache(cfg(), 2, 18, PAGE, seq_shards=4)
    with pytest.raises(ValueError, match=r"a paged cache under context parallelism \(seq_axis='cp'\) supports "
                                         r"implementation in \('xla', 'pallas', 'pallas_interpret', 'mosaic', "
                                         r"'mosaic_interpret'\), got 'auto'"):
        context_paged.check_supported("auto", "cp")


def test_cache_placed_otherwise_refused_unchanged():
    """A replicated paged cache handed to a cp layer: refused, not silently split; dense
    attention refused (as without cp: a paged cache keeps no per-slot mask); nothing written."""
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    cache = sh.place_cache(f32_layer(cfg(), 1).init_paged_cache(2, PAGES, PAGE), layer.mesh)
    x, mask = padded_batch(cfg(), PADS[:2], 24, seed=0)
    with pytest.raises(ValueError, match=r"placed as P\(\) but a context-parallel layer needs P\('cp',\)"):
        layer(x, attention_mask=mask, cache=cache)
    split = layer.init_paged_cache(2, PAGES, PAGE)
    with pytest.raises(ValueError, match=r"attention='dense' needs a contiguous cache \(DsaCache\) or none"):
        layer(x, attention_mask=mask, cache=split, attention="dense")
    assert not np.asarray(split.lengths).any() and not np.asarray(split.latent_store).any()


def step_collectives(layer, num_pages):
    """``[(result type, op)]`` of every collective in the compiled decode step of a
    ``PagedDecoder`` of ``num_pages`` pages (as ``test_context_parallel.step_collectives``)."""
    dec = gd.PagedDecoder(layer, 2, num_pages, PAGE)
    x, mask = padded_batch(cfg(), PADS[:2], 1, seed=0)
    hlo = dec.step.lower(dec.params, x, mask, dec.cache).compile().as_text()
    ops = r"all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter"
    found = [re.search(rf"= (.*?) ({ops})(?:-start)?\(", ln) for ln in hlo.splitlines()]
    return sorted((re.sub(r"\{[\d,]+\}", "", m.group(1)), m.group(2)) for m in found if m)


@pytest.mark.slow
def test_bytes_crossing_devices_do_not_grow_with_the_pool():
    """The decode step's collectives at 16 and 128 pages are the same ops on the same
    shapes: the candidates' two all-gathers ``s32[B, 1, cp * K]``, the partials' ``pmax`` and
    ``psum`` ``[B, 1, H_local(, V)]``, the ``o_proj`` ``psum``; no page table, pool or key
    crosses devices."""
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of((4, 2)), axis="tp", seq_axis="cp")
    small, large = step_collectives(layer, PAGES), step_collectives(layer, 8 * PAGES)
    assert small == large
    c = cfg()
    k, v, h_loc = c.max_select_k, c.kv_lora_rank, c.num_attention_heads // 2
    assert small == sorted([
        (f"s32[2,1,{4 * k}]", "all-gather"), (f"s32[2,1,{4 * k}]", "all-gather"),  # keys, ids
        (f"f32[2,1,{h_loc}]", "all-reduce"),  # pmax of the log-sum-exp
        (f"(f32[2,1,{h_loc},{v}], f32[2,1,{h_loc}])", "all-reduce"),  # weighted partials, weights
        (f"f32[2,1,{c.hidden_size}]", "all-reduce"),  # o_proj over tp
    ]), small
