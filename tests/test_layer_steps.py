"""The layer's pipeline steps: visible in the compiled step, and no compilation per eager step.

* Each step runs under ``jax.named_scope`` with its method's name (``glm5_dsa_jax.model.layer``),
  so the compiled decode step's HLO (op metadata) names every one of them, on a contiguous
  and on a paged cache: a profile or an HLO dump shows where the time goes.
* An eager decode step (a layer call with a cache, outside jit) compiles nothing once the
  first steps have run: an eager call runs as one ``jax.jit`` program of the whole call,
  cached per layer structure, placement and argument structure
  (``glm5_dsa_jax.parallel.execution``), so the closures the pipeline makes per call
  compile nothing. Counted with jax's backend-compile events. The same holds for a full
  layer followed by its shared layer (``prev_topk``), ``"xla"`` and ``"pallas_interpret"``,
  unplaced and placed on TP meshes of 2 and 8 devices, and for prefill chunks of several
  query tiles (``DsaAttention.by_query_tiles``), and on context-parallel meshes (``seq_axis="cp"``:
  (cp, tp) = (2, 4) and (8, 1)). Before eager calls were cached, a full + shared
  pair of eager steps compiled 6 (unplaced, ``"pallas_interpret"``: one per kernel) to 90
  (TP 2 or 8, ``"xla"``: the ``shard_map`` bodies op by op) programs.
* ``DsaAttention.check_inputs`` is the public check ``decode.DsaDecoder`` uses.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.decode import make_step
from glm5_dsa_jax.model.layer import COMPRESS_POOLS, FULL_STEPS, SCORE_POOLS, SHARED_STEPS
from glm5_dsa_jax.parallel.sharding import shard_layer

#: The event jax records for each XLA backend compilation (jax 0.10 and 0.12).
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"



@pytest.fixture(scope="module")
def cfg():
    return gd.DsaConfig.tiny()


def make(cfg, idx, **kw):
    kw.setdefault("dtype", jnp.float32)
    kw.setdefault("param_dtype", jnp.float32)
    return gd.DsaAttention(cfg, idx, rngs=nnx.Rngs(idx), **kw)


@contextlib.contextmanager
def backend_compiles():
    """A list that grows by one per XLA backend compilation inside the block."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_backend_compile_event_is_counted():
    with backend_compiles() as seen:
        jax.jit(lambda a: a * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    assert len(seen) >= 1, f"no {BACKEND_COMPILE!r} event: the event name changed in this jax"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_eager_decode_compiles_nothing_after_warmup(cfg, dtype):
    full = make(cfg, 1, dtype=dtype, param_dtype=dtype)
    shared = make(cfg, 2, dtype=dtype, param_dtype=dtype)
    b, hidden = 2, cfg.hidden_size
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, 20, hidden)).astype(np.float32)
    mask = np.ones((b, 20), bool)
    mask[0, :3] = False  # left padding: the pool grid starts later in row 0
    cache, cache2 = full.init_cache(b, 32), shared.init_cache(b, 32)

    def step(i, n, cache, cache2):
        out, topk, cache = full(x[:, i:i + n], attention_mask=mask[:, i:i + n], cache=cache)
        out2, _, cache2 = shared(out, attention_mask=mask[:, i:i + n], cache=cache2, prev_topk=topk)
        jax.block_until_ready(out2)
        return cache, cache2

    cache, cache2 = step(0, 8, cache, cache2)  # prefill
    for i in range(8, 11):  # warm-up decode steps
        cache, cache2 = step(i, 1, cache, cache2)
    with backend_compiles() as seen:
        for i in range(11, 20):
            cache, cache2 = step(i, 1, cache, cache2)
    assert len(seen) == 0, f"{len(seen)} XLA compilations over 9 eager decode steps after warm-up"
    assert int(cache.length) == 20


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("tp, chunk", [(None, 1), (None, 6), (2, 1), (8, 1)])
@pytest.mark.slow
def test_eager_steps_compile_nothing_after_warmup(impl, tp, chunk):
    """Eager steps of a full layer and its shared layer (``prev_topk``): decode steps
    (``chunk`` 1) or prefill chunks of two query tiles (``chunk`` 6, ``block_q`` 4),
    unplaced or on a TP mesh. After a prefill and two warm-up steps, two more steps of
    the same shapes compile nothing."""
    cfg = gd.DsaConfig.tiny(num_attention_heads=8)  # 8 heads: TP 2 and 8 divide them
    full = make(cfg, 1, implementation=impl, block_q=4)
    shared = make(cfg, 2, implementation=impl, block_q=4)
    if tp is not None:
        mesh = jax.make_mesh((tp,), ("tp",))
        shard_layer(full, mesh)
        shard_layer(shared, mesh)
    b, n = 2, 5 + 4 * chunk
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, n, cfg.hidden_size)).astype(np.float32)
    mask = np.ones((b, n), bool)
    mask[0, :3] = False  # left padding
    mask[1, 6] = False  # a hole
    caches = full.init_cache(b, n), shared.init_cache(b, n)

    def step(i, s, caches):
        out, topk, c1 = full(x[:, i:i + s], attention_mask=mask[:, i:i + s], cache=caches[0])
        out2, _, c2 = shared(out, attention_mask=mask[:, i:i + s], cache=caches[1], prev_topk=topk)
        jax.block_until_ready(out2)
        assert (np.asarray(topk)[mask[:, i:i + s]] >= 0).any(axis=-1).all()  # tokens selected
        return c1, c2

    caches = step(0, 5, caches)  # prefill
    for i in range(5, 5 + 2 * chunk, chunk):  # warm-up steps
        caches = step(i, chunk, caches)
    with backend_compiles() as seen:
        for i in range(5 + 2 * chunk, n, chunk):
            caches = step(i, chunk, caches)
    assert len(seen) == 0, f"{len(seen)} XLA compilations over 2 eager steps of {chunk} after warm-up"
    assert int(caches[0].length) == int(caches[1].length) == n


@pytest.mark.parametrize("cp, tp", [(2, 4), (8, 1)])
def test_eager_cp_steps_compile_nothing_after_warmup(cp, tp):
    """The same on a context-parallel mesh (``seq_axis="cp"``, ``parallel.context``): a full
    and a shared layer over a contiguous cache split into ``cp`` token ranges; after a
    prefill chunk and two warm-up decode steps, three more eager steps compile nothing."""
    cfg = gd.DsaConfig.tiny(num_attention_heads=8)
    full, shared = make(cfg, 1, block_q=4), make(cfg, 2, block_q=4)
    mesh = jax.make_mesh((cp, tp), ("cp", "tp"))
    for layer in (full, shared):
        shard_layer(layer, mesh, axis="tp", seq_axis="cp")
    b, n, cap = 2, 21, 64  # cp * kpool divides the capacity
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, n, cfg.hidden_size)).astype(np.float32)
    mask = np.ones((b, n), bool)
    mask[0, :3] = False  # left padding
    caches = full.init_cache(b, cap), shared.init_cache(b, cap)
    assert caches[0].latent_store.sharding.spec[1] == "cp"

    def step(i, s, caches):
        out, topk, c1 = full(x[:, i:i + s], attention_mask=mask[:, i:i + s], cache=caches[0])
        out2, _, c2 = shared(out, attention_mask=mask[:, i:i + s], cache=caches[1], prev_topk=topk)
        jax.block_until_ready(out2)
        return c1, c2

    caches = step(0, 16, caches)  # prefill
    for i in (16, 17):  # warm-up steps
        caches = step(i, 1, caches)
    with backend_compiles() as seen:
        for i in range(18, n):
            caches = step(i, 1, caches)
    assert len(seen) == 0, f"{len(seen)} XLA compilations over 3 eager cp decode steps after warm-up"
    assert int(caches[0].length) == int(caches[1].length) == n


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("idx, names", [(1, FULL_STEPS), (2, SHARED_STEPS)])
def test_compiled_step_names_each_pipeline_step(cfg, idx, names, kind):
    layer = make(cfg, idx)
    step, params = make_step(layer)
    b, s = 2, 1
    x = jnp.ones((b, s, cfg.hidden_size), jnp.float32)
    mask = jnp.ones((b, s), bool)
    prev = None if layer.has_indexer else jnp.zeros((b, s, cfg.out_width), jnp.int32)
    cache = layer.init_cache(b, 16) if kind == "contiguous" else layer.init_paged_cache(b, 8, 4)
    hlo = step.lower(params, x, mask, cache, prev).compile().as_text()
    missing = [n for n in names if f"/{n}/" not in hlo]
    assert not missing, f"steps not named in the compiled HLO: {missing}"
    if not layer.has_indexer:
        assert f"/{SCORE_POOLS}/" not in hlo and f"/{COMPRESS_POOLS}/" not in hlo


def test_check_inputs_is_public(cfg):
    full, shared = make(cfg, 1), make(cfg, 2)
    x = np.ones((2, 3, cfg.hidden_size), np.float64)
    xc, mask, prev = full.check_inputs(x, np.array([[0, 1, 1], [1, 1, 1]]))
    assert xc.dtype == jnp.float32 and mask.dtype == jnp.bool_ and prev is None
    assert np.asarray(mask).tolist() == [[False, True, True], [True, True, True]]
    _, _, prev = shared.check_inputs(x, None, np.zeros((2, 3, cfg.out_width), np.int64))
    assert isinstance(prev, jax.Array) and prev.dtype == jnp.int32
    with pytest.raises(ValueError, match="only for 'shared' layers"):
        full.check_inputs(x, None, prev)
    future = np.full((2, 3, cfg.out_width), -1)
    future[0, 0, 0] = 5  # query 0 at slot 4 names slot 5
    with pytest.raises(ValueError, match="future"):
        shared.check_inputs(x, None, future, start=4)


def _prefill_then_decode(layer, x, mask, s, capacity):
    """``(topk, out)`` of a prefill of ``x[:, :s]`` then one decode step per later token,
    joined along the token axis (outputs in float32)."""
    cache = layer.init_cache(x.shape[0], capacity)
    out, topk, cache = layer(x[:, :s], attention_mask=mask[:, :s], cache=cache)
    outs, topks = [out], [topk]
    for i in range(s, x.shape[1]):
        out, topk, cache = layer(x[:, i:i + 1], attention_mask=mask[:, i:i + 1], cache=cache)
        outs.append(out)
        topks.append(topk)
    return np.concatenate(topks, 1), np.concatenate([np.asarray(o, np.float32) for o in outs], 1)


@pytest.mark.parametrize("tile", [1, 3, 5])
def test_xla_live_tiles_equal_one_whole_row(cfg, tile):
    """``score_and_select`` (the ``"xla"`` decode step's 2-3, over live pool tiles only)
    gives the same top-k and outputs in any tiling as one tile of the whole capacity (which
    is ``topk_pools_reference`` of the full score row): decode steps after a prefill with
    left padding and a hole."""
    b, s = 2, 23
    rng = np.random.default_rng(1)
    x = rng.standard_normal((b, s + 4, cfg.hidden_size)).astype(np.float32)
    mask = np.ones((b, s + 4), bool)
    mask[0, :5] = False
    mask[1, 9] = False
    results = []
    for pool_tile in (tile, 10**6):
        layer = make(cfg, 1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        layer.POOL_TILE = pool_tile
        results.append(_prefill_then_decode(layer, x, mask, s, 40))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    assert (results[0][0] >= 0).any()


def test_xla_small_then_large_tiles_equal_one_whole_row(cfg):
    """``score_and_select`` switches from tiles of ``2 * select_k`` to ``pool_tile``'s once
    the live pools outgrow one large tile (a ``lax.cond`` in one program): decode steps that
    cross that point (38 -> 56 tokens: 9 -> 14 complete pools in row 0) give the top-k and
    outputs of one whole-capacity tile."""
    b, s, steps = 2, 38, 18
    rng = np.random.default_rng(2)
    x = rng.standard_normal((b, s + steps, cfg.hidden_size)).astype(np.float32)
    mask = np.ones((b, s + steps), bool)
    mask[1, :3] = False
    results = []
    for big in (12, 10**6):
        layer = make(cfg, 1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        layer.POOL_TILE, layer.MIN_POOL_TILE = big, 2
        if big == 12:  # tiles of 8 pools (2 * select_k) up to 12 live pools, then 12
            qi = (b, 1, cfg.index_n_heads, cfg.index_head_dim)
            assert (layer.pool_tile(qi, 20), 2 * cfg.select_k(20)) == (12, 8)
        results.append(_prefill_then_decode(layer, x, mask, s, 80))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_cpu_cache_stores_16_bit_floats_as_bits(cfg):
    """On a CPU a bf16 cache's buffers hold the bits (written in place by XLA:CPU), and
    ``latent`` / ``pooled`` are the bf16 views; ``replace(latent=...)`` stores floats."""
    layer = make(cfg, 1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    cache = layer.init_cache(1, 16)
    assert cache.latent_store.dtype == jnp.uint16 and cache.pooled_store.dtype == jnp.uint16
    assert cache.latent.dtype == jnp.bfloat16 and cache.pooled.dtype == jnp.bfloat16
    rows = jnp.full(cache.latent.shape, -1.5, jnp.bfloat16)
    assert (np.asarray(cache.replace(latent=rows).latent, np.float32) == -1.5).all()
    assert layer.init_cache(1, 16, dtype=jnp.float32).latent_store.dtype == jnp.float32


@pytest.mark.parametrize("rows, bias", [((1, 1), False), ((1, 1), True), ((2, 3), False)])
def test_output_projection_masks_padding_rows(rows, bias):
    """``ops.absorb_o(..., mask=)``: zeros at the padding rows, the other rows exactly the
    unmasked products, a NaN of a padding row's attention output included. One row without
    a bias is masked on its input ``o_lat``, before the first product (where the ``where``
    fuses into it on a GPU); otherwise on the output."""
    from glm5_dsa_jax.model.ops import absorb_o

    k = jax.random.split(jax.random.key(0), 4)
    o_lat = jax.random.normal(k[0], rows + (4, 8), jnp.float32).astype(jnp.bfloat16)
    w_uv = jax.random.normal(k[1], (4, 6, 8), jnp.float32).astype(jnp.bfloat16)
    o_proj = jax.random.normal(k[2], (4, 6, 10), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(k[3], (10,), jnp.float32).astype(jnp.bfloat16) if bias else None
    for mask in (jnp.zeros(rows, bool), jnp.ones(rows, bool), jnp.arange(np.prod(rows)).reshape(rows) % 2 == 0):
        x = jnp.where(mask[..., None, None], o_lat, jnp.nan)  # padding rows: NaN
        out = absorb_o(x, w_uv, o_proj, b, mask=mask)
        want = jnp.where(mask[..., None], absorb_o(o_lat, w_uv, o_proj, b), 0)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    text = str(jax.make_jaxpr(lambda x, m: absorb_o(x, w_uv, o_proj, b, mask=m))(o_lat, mask))
    assert ("select_n" in text[:text.index("dot_general")]) == (rows == (1, 1) and not bias), text
