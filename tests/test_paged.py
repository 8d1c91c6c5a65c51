"""The paged cache: sequences of their own lengths, joining and leaving, held against the
same tokens run alone.

* Schedules: several sequences of different lengths join at different steps, arrive in
  ragged chunks (valid tokens anywhere in a chunk, other rows decoding or idle in the same
  step) and leave; each finished sequence's outputs and top-k are compared with the same
  tokens run alone through a contiguous cache of batch 1: top-k bit-identical, outputs
  within float32 rounding. For ``xla`` and ``pallas_interpret``, eager, under ``make_step``
  / ``PagedDecoder`` (one compilation for every decode step, across joins and releases),
  and on TP meshes of 2 and 8 devices. (Against Hugging Face: ``test_paged_hf.py``.)
* Bad input: a chunk needing more pages than are free or a sequence past its maximum is
  refused before anything is written (eager, ``PagedDecoder``); inside a raw jitted step the
  row writes nothing, ``status`` says why and no other sequence is touched; foreign caches,
  block-table entries out of range and bad page sizes are refused, naming the difference.
* Memory: bytes per token of capacity at GLM-5.3-Flash dims (bf16) <= 1,100, everything
  included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.cache import pages as pg
from glm5_dsa_jax.decode import PagedDecoder, make_step
from glm5_dsa_jax.parallel.sharding import shard_layer
from helpers import ATOL, RTOL, f32_layer


@pytest.fixture(scope="module")
def cfg():
    return gd.DsaConfig.tiny()


def make_schedule(cfg, lengths, max_seqs, seed, chunk_sizes=(7, 1, 3, 16, 1, 1)):
    """A schedule: a list of steps ``(x [max_seqs, S, hidden], mask, release [max_seqs])``
    and, per sequence, its tokens and (row, step, chunk index) of each token. Sequence ``i``
    joins a free row at a random step, sends a random number of its tokens per step at
    random places in the chunk, and its row is released after its last token."""
    rng = np.random.default_rng(seed)
    seqs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in lengths]
    waiting = list(range(len(seqs)))
    row_of, done, where = {}, [0] * len(seqs), [[] for _ in seqs]
    steps, t = [], 0
    while waiting or row_of:
        s = chunk_sizes[t % len(chunk_sizes)]
        busy = set(row_of.values())
        for r in range(max_seqs):  # join: a waiting sequence takes a free row (sometimes later)
            if waiting and r not in busy and rng.random() < 0.7:
                row_of[waiting.pop(0)] = r
                busy.add(r)
        x = np.zeros((max_seqs, s, cfg.hidden_size), np.float32)
        mask = np.zeros((max_seqs, s), bool)
        release = np.zeros(max_seqs, bool)
        for i, r in list(row_of.items()):
            k = int(min(rng.integers(0, s + 1), len(seqs[i]) - done[i]))
            cols = np.sort(rng.choice(s, k, replace=False))
            x[r, cols] = seqs[i][done[i]:done[i] + k]
            mask[r, cols] = True
            where[i] += [(r, len(steps), c) for c in cols]
            done[i] += k
            if done[i] == len(seqs[i]):
                release[r] = True
                del row_of[i]
        # a padding entry holds garbage: it must go nowhere
        x[~mask] = rng.standard_normal(((~mask).sum(), cfg.hidden_size)) * 1e3
        steps.append((x, mask, release))
        t += 1
    return steps, seqs, where


def run_schedule(call, release, steps, cache):
    """Run ``steps`` with ``call(x, mask, cache) -> (out, topk, cache)`` and
    ``release(cache, rows) -> cache``; returns per step ``(out, topk)`` numpy."""
    results = []
    for x, mask, rel in steps:
        out, topk, cache = call(jnp.asarray(x), jnp.asarray(mask), cache)
        results.append((np.asarray(out), np.asarray(topk)))
        if rel.any():
            cache = release(cache, jnp.asarray(rel))
    return results, cache


def per_sequence(results, where, i):
    out = np.stack([results[st][0][r, c] for r, st, c in where[i]])
    topk = np.stack([results[st][1][r, c] for r, st, c in where[i]])
    return out, topk


_ALONE = {}


def alone(layer, x, width=80, capacity=128):
    """The same tokens run alone: batch 1 through a contiguous cache, in one jitted call of
    ``width`` slots (right padding: later slots do not change earlier queries)."""
    if id(layer) not in _ALONE:
        _ALONE[id(layer)] = (layer, jax.jit(lambda x, m, c: layer(x, attention_mask=m, cache=c)))
    f = _ALONE[id(layer)][1]
    n = len(x)
    xs = np.zeros((1, width, x.shape[1]), np.float32)
    xs[0, :n] = x
    mask = np.arange(width)[None] < n
    out, topk, _ = f(jnp.asarray(xs), jnp.asarray(mask), layer.init_cache(1, capacity))
    return np.asarray(out[0, :n]), np.asarray(topk[0, :n])


def check_against_alone(layer, results, seqs, where):
    for i, x in enumerate(seqs):
        out, topk = per_sequence(results, where, i)
        ref_out, ref_topk = alone(layer, x)
        np.testing.assert_array_equal(topk, ref_topk, err_msg=f"sequence {i}")
        np.testing.assert_allclose(out, ref_out, atol=ATOL, rtol=RTOL, err_msg=f"sequence {i}")


def eager_call(layer):
    def call(x, mask, cache):
        return layer(x, attention_mask=mask, cache=cache)
    return call


def assert_warm_decode_compiles_nothing(layer, cache, x, warm_up, measured):
    """Eager decode steps of ``x`` on ``cache``: the ``warm_up`` pattern, then the
    ``measured`` one, which must compile nothing. A pattern ``(n, release, m)`` is ``n``
    steps, ``cache.release(release)`` (one bool a row), ``m`` steps: a warm paged step must
    take joins and releases without a new program."""
    from test_layer_steps import backend_compiles

    def run_pattern(cache, n, release, m):
        for _ in range(n):
            _, _, cache = layer(x, cache=cache)
        cache = cache.release(jnp.array(release))
        for _ in range(m):
            _, _, cache = layer(x, cache=cache)
        return cache

    cache = run_pattern(cache, *warm_up)
    with backend_compiles() as seen:
        run_pattern(cache, *measured)
    n = measured[0] + measured[2]
    assert not seen, f"{len(seen)} compilations in {n} eager decode steps after warm-up"


def eager_release(cache, rows):
    return cache.release(rows)


LENGTHS = (37, 5, 80, 23, 1, 64)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
@pytest.mark.slow
def test_schedule_equals_each_sequence_alone(cfg, implementation):
    """Six sequences through three rows under ``make_step`` (chunks of 8 and decode steps)."""
    layer = f32_layer(cfg, 1, seed=1, implementation=implementation, block_q=8)
    steps, seqs, where = make_schedule(cfg, LENGTHS, max_seqs=3, seed=0, chunk_sizes=(8, 1, 8, 1, 1))
    # 14 pages of 16 tokens: fewer than max_seqs x longest sequence needs at once (3 x 5).
    step, params = make_step(layer)
    release = jax.jit(eager_release, donate_argnums=0)
    results, cache = run_schedule(lambda x, m, c: step(params, x, m, c), release, steps,
                                  layer.init_paged_cache(3, num_pages=14, page_size=16))
    assert step.traces == 2  # one program per chunk length, across every join and release
    check_against_alone(layer, results, seqs, where)
    assert int(cache.pages.n_free) == 14 and (np.asarray(cache.lengths) == 0).all()
    cache.pages.check()


@pytest.mark.slow
def test_eager_schedule_and_no_compilation_after_warm_up(cfg):
    """The eager call (outside jit) gives the same, and its decode steps compile nothing
    once the first have run."""
    layer = f32_layer(cfg, 1, seed=1, block_q=8)
    steps, seqs, where = make_schedule(cfg, (21, 6, 30), max_seqs=2, seed=1, chunk_sizes=(5, 1, 1))
    results, cache = run_schedule(eager_call(layer), eager_release, steps, layer.init_paged_cache(2, 6, 16))
    check_against_alone(layer, results, seqs, where)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 1, cfg.hidden_size)), jnp.float32)
    assert_warm_decode_compiles_nothing(layer, cache, x, (3, [False, True], 1), (4, [True, False], 2))


@pytest.mark.slow
def test_decoder_one_compilation_and_shared_layer(cfg):
    """``PagedDecoder``: one compiled program for every decode step across joins and
    releases; a shared layer on the same schedule reuses the full layer's top-k."""
    full, shared = f32_layer(cfg, 1, seed=1), f32_layer(cfg, 2, seed=2)
    steps, seqs, where = make_schedule(cfg, (30, 9, 41, 17), max_seqs=2, seed=3, chunk_sizes=(1,))
    dec, dec2 = PagedDecoder(full, 2, num_pages=8, page_size=16), PagedDecoder(shared, 2, 8, 16)
    results, results2 = [], []
    for x, mask, rel in steps:
        out, topk = dec(x, mask)
        out2, topk2 = dec2(x, mask, prev_topk=topk)
        np.testing.assert_array_equal(np.asarray(topk2), np.asarray(topk))
        results.append((np.asarray(out), np.asarray(topk)))
        results2.append((np.asarray(out2), np.asarray(topk2)))
        if rel.any():
            dec.release(rel)
            dec2.release(rel)
    assert dec.step.traces == 1 and dec2.step.traces == 1
    check_against_alone(full, results, seqs, where)
    for i, x in enumerate(seqs):
        out2, topk = per_sequence(results2, where, i)
        _, ref_topk = alone(full, x)
        c = shared.init_cache(1, 128)
        ref_out2, _, _ = shared(jnp.asarray(x[None]), cache=c, prev_topk=jnp.asarray(ref_topk[None]))
        np.testing.assert_allclose(out2, np.asarray(ref_out2[0]), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.slow
def test_sharded_schedule_equals_unsharded(cfg, tp):
    """On a TP mesh the paged step gives the unsharded layer's top-k bit for bit and its
    outputs within float32 rounding (the pools replicated, the heads split)."""
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    cfg = gd.DsaConfig.tiny(num_attention_heads=8)
    steps, seqs, where = make_schedule(cfg, (29, 50, 11), max_seqs=2, seed=5, chunk_sizes=(8, 1))
    ref = f32_layer(cfg, 1, seed=4, block_q=8)
    ref_step, ref_params = make_step(ref)
    ref_results, _ = run_schedule(lambda x, m, c: ref_step(ref_params, x, m, c), jax.jit(eager_release),
                                  steps, ref.init_paged_cache(2, 10, 16))
    layer = shard_layer(f32_layer(cfg, 1, seed=4, block_q=8), mesh)
    step, params = make_step(layer)
    release = jax.jit(eager_release, donate_argnums=0)
    results, cache = run_schedule(lambda x, m, c: step(params, x, m, c), release, steps,
                                  layer.init_paged_cache(2, 10, 16))
    assert cache.latent_store.sharding.is_fully_replicated
    for (o, t), (ro, rt) in zip(results, ref_results):
        np.testing.assert_array_equal(t, rt)
        np.testing.assert_allclose(o, ro, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------- bad input
def snapshot(cache):
    return [np.asarray(a).copy() for a in jax.tree.leaves(cache)]


def assert_same(before, cache):
    for a, b in zip(before, snapshot(cache)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_no_room_is_refused_before_anything_is_written(cfg):
    layer = f32_layer(cfg, 1)
    x = np.random.default_rng(0).standard_normal((2, 20, cfg.hidden_size)).astype(np.float32)
    cache = layer.init_paged_cache(2, num_pages=3, page_size=8, pages_per_seq=3)
    _, _, cache = layer(jnp.asarray(x[:, :10]), attention_mask=jnp.asarray([[True] * 10, [False] * 10]),
                        cache=cache)  # sequence 0: 10 tokens on 2 pages; 1 page left
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"sequence 1 needs 2 more page\(s\) of 8 tokens but only 1"):
        layer(jnp.asarray(x[:, :10]), attention_mask=jnp.asarray([[False] * 10, [True] * 10]), cache=cache)
    assert_same(before, cache)
    with pytest.raises(ValueError, match=r"sequence 0 would hold 30 tokens, more than .* = 24"):
        layer(jnp.asarray(x), attention_mask=jnp.asarray([[True] * 20, [False] * 20]), cache=cache)
    assert_same(before, cache)
    # The decoder refuses before it donates anything.
    dec = PagedDecoder(layer, 2, num_pages=3, page_size=8, pages_per_seq=3)
    dec(x[:, :10], np.array([[True] * 10, [False] * 10]))
    before = snapshot(dec.cache)
    with pytest.raises(ValueError, match="sequence 1 needs 2 more page"):
        dec(x[:, :10], np.array([[False] * 10, [True] * 10]))
    assert_same(before, dec.cache)
    # Inside a raw jitted step: row 1 writes nothing and says why; row 0 goes on.
    step, params = make_step(layer, donate=False)
    mask = np.array([[True] + [False] * 9, [True] * 10])
    out, topk, after = step(params, jnp.asarray(x[:, :10]), jnp.asarray(mask), cache)
    assert np.asarray(after.status).tolist() == [pg.OK, pg.NO_FREE_PAGES]
    assert np.asarray(after.lengths).tolist() == [11, 0]
    assert (np.asarray(topk)[1] == -1).all() and (np.asarray(out)[1] == 0).all()
    np.testing.assert_array_equal(np.asarray(after.latent_store)[np.asarray(cache.pages.free)[:1]],
                                  np.asarray(cache.latent_store)[np.asarray(cache.pages.free)[:1]])
    after.pages.check()


def test_release_of_an_empty_row_is_a_no_op_and_rows_restart_at_zero(cfg):
    layer = f32_layer(cfg, 1)
    cache = layer.init_paged_cache(3, num_pages=6, page_size=8)
    before = snapshot(cache)
    assert_same(before, cache.release(jnp.array([True, True, True])))
    x = np.random.default_rng(1).standard_normal((3, 9, cfg.hidden_size)).astype(np.float32)
    _, topk_a, cache = layer(jnp.asarray(x), cache=cache)
    cache = cache.release(jnp.array([False, True, False]))
    assert np.asarray(cache.lengths).tolist() == [9, 0, 9] and int(cache.pages.n_free) == 2
    _, topk_b, cache = layer(jnp.asarray(x), attention_mask=jnp.asarray([[False] * 9, [True] * 9, [False] * 9]),
                             cache=cache)
    np.testing.assert_array_equal(np.asarray(topk_b)[1], np.asarray(topk_a)[1])  # from position 0
    with pytest.raises(ValueError, match=r"\[max_seqs=3\] bool mask"):
        cache.release(jnp.array([True, False]))


def test_foreign_caches_and_bad_tables_are_refused(cfg):
    layer = f32_layer(cfg, 1)
    x = jnp.ones((2, 3, cfg.hidden_size))
    with pytest.raises(ValueError, match="B=2 rows: row b of the input is sequence b"):
        layer(x, cache=layer.init_paged_cache(3, 4, 8))
    other = f32_layer(gd.DsaConfig.tiny(kv_lora_rank=24), 1)
    with pytest.raises(ValueError, match="kv_lora_rank=40"):
        layer(x, cache=other.init_paged_cache(2, 4, 8))
    with pytest.raises(ValueError, match="lacks indexer state"):
        layer(x, cache=f32_layer(cfg, 2).init_paged_cache(2, 4, 8))
    with pytest.raises(ValueError, match=r"index_kpool=4, index_head_dim=16\) and stage \(2, 4, 16\)"):
        layer(x, cache=f32_layer(gd.DsaConfig.tiny(index_kpool=8), 1).init_paged_cache(2, 4, 8))
    cache = layer.init_paged_cache(2, 4, 8)
    bad = cache.replace(pages=cache.pages.replace(block_table=cache.block_table.at[1, 0].set(4)))
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 4 is out of range: page ids are 0 .. 3"):
        layer(x, cache=bad)
    with pytest.raises(ValueError, match="page_size must be a positive multiple of index_kpool=4"):
        layer.init_paged_cache(2, 4, page_size=6)
    with pytest.raises(ValueError, match="cache dtype must be"):
        layer.init_paged_cache(2, 4, 8, dtype=jnp.int8)
    with pytest.raises(ValueError, match="dtype is float32, expected bfloat16"):
        cache.check(cfg, True, 2, dtype=jnp.bfloat16)


def test_bytes_per_token_of_capacity():
    """At GLM-5.3-Flash dims in bf16: <= 1,100 bytes per token of capacity, pages, block
    tables, free stack, stage and status included (shapes only: nothing is allocated)."""
    cfg = gd.DsaConfig.glm53_flash()
    for max_seqs, tokens in ((1, 4096), (8, 8 * 131_072), (64, 64 * 32_768)):
        shapes = jax.eval_shape(lambda: gd.init_paged_cache(cfg, max_seqs, tokens // 64, 64))
        total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
        per_token = total / tokens
        assert per_token <= 1100, (max_seqs, tokens, per_token)
        assert per_token >= 1088  # 1,024 latent + 64 pooled: nothing is missing


def test_sharded_eager_decode_compiles_nothing_after_warm_up(cfg):
    """The eager paged step on a TP 2 mesh (one cached program per call, see
    ``glm5_dsa_jax.parallel.execution``) compiles nothing once warm, joins and releases
    included."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    cfg = gd.DsaConfig.tiny(num_attention_heads=8)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    layer = shard_layer(f32_layer(cfg, 1, seed=1, block_q=8), mesh)
    cache = layer.init_paged_cache(2, 6, 16)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 1, cfg.hidden_size)), jnp.float32)
    assert_warm_decode_compiles_nothing(layer, cache, x, (3, [True, False], 1), (3, [True, False], 1))


# ---------------------------------------------------------------------------- broken tables
def _probe_setup(cfg):
    """Three 16-token sequences on 16-token pages (pages 0, 1, 2; pages 3 .. 6 free), a
    decode step for each, and that step's clean result under jit."""
    layer = f32_layer(cfg, 1, seed=3, block_q=8)
    rng = np.random.default_rng(4)
    cache = layer.init_paged_cache(3, num_pages=7, page_size=16)
    _, _, cache = layer(jnp.asarray(rng.standard_normal((3, 16, cfg.hidden_size)), jnp.float32), cache=cache)
    x = jnp.asarray(rng.standard_normal((3, 1, cfg.hidden_size)), jnp.float32)
    step, params = make_step(layer, donate=False)
    mask = jnp.ones((3, 1), bool)
    clean = step(params, x, mask, cache)
    return layer, cache, x, (step, params, mask), clean


#: The page-table probes: ``(field, index, value)`` set on the table, the rows refused.
PROBES = [
    ("lengths", 1, -5, [1], r"row 1: lengths\[1\] = -5 outside \[0, max_length=112\]"),
    ("lengths", 1, 30, [1], r"row 1: block_table row 1 holds 1 pages for length 30"),
    ("n_free", (), 50, [0, 1, 2], r"n_free = 50 outside \[0, 7\]"),
    ("block_table", (1, 0), 0, [1], r"row 1: block_table\[1, 0\] = page 0, which is row 0's, not row 1's"),
]


@pytest.mark.parametrize("field,index,value,refused,match", PROBES)
def test_a_broken_page_table_is_refused_eagerly_and_writes_nothing_under_jit(cfg, field, index, value,
                                                                            refused, match):
    """Eager: ``ValueError`` naming the row before anything is written. Under jit: the
    broken row (every row for a broken free stack) is ``BAD_TABLE``, writes nothing and
    outputs zeros; every other row's output, top-k and pages are the clean step's."""
    layer, cache, x, (step, params, mask), (ref_out, ref_topk, ref_cache) = _probe_setup(cfg)
    pages = cache.pages
    bad = cache.replace(pages=pages.replace(**{field: getattr(pages, field).at[index].set(value)}))
    before = snapshot(bad)
    with pytest.raises(ValueError, match=match):
        layer(x, cache=bad)
    assert_same(before, bad)
    dec = PagedDecoder(layer, 3, num_pages=7, page_size=16)
    dec.cache = bad
    with pytest.raises(ValueError, match=match):
        dec(x)
    assert_same(before, bad)
    out, topk, after = step(params, x, mask, bad)
    assert np.asarray(after.status).tolist() == [pg.BAD_TABLE if b in refused else pg.OK for b in range(3)]
    out, topk, ref_out, ref_topk = (np.asarray(a) for a in (out, topk, ref_out, ref_topk))
    for b in range(3):
        if b in refused:
            assert (out[b] == 0).all() and (topk[b] == -1).all()
        else:  # another sequence: as if the table were clean
            np.testing.assert_array_equal(topk[b], ref_topk[b])
            np.testing.assert_array_equal(out[b], ref_out[b])
    # Nothing written for a refused row: its table row, length, stage and every page no
    # other row took are as before.
    good = [b for b in range(3) if b not in refused]
    took = np.asarray(after.block_table)[good]
    untouched = np.setdiff1d(np.arange(7), took[took >= 0])
    for name in ("latent_store", "pooled_store"):
        np.testing.assert_array_equal(np.asarray(getattr(after, name))[untouched],
                                      np.asarray(getattr(bad, name))[untouched])
    for b in refused:
        for name in ("stage_keys", "stage_gate"):
            np.testing.assert_array_equal(np.asarray(getattr(after, name))[b], np.asarray(getattr(bad, name))[b])
        assert np.asarray(after.lengths)[b] == np.asarray(bad.lengths)[b]
        np.testing.assert_array_equal(np.asarray(after.block_table)[b], np.asarray(bad.block_table)[b])
    if len(refused) == 3:
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, after.pages),
                     jax.tree.map(np.asarray, bad.pages))


def test_release_takes_only_a_bool_mask(cfg):
    """Row ids where a 0/1 mask belongs (``[2, 0, 1]``), or even a 0/1 integer mask, are
    refused naming ``rows``, by the cache and by ``PagedDecoder``; nothing is released."""
    layer = f32_layer(cfg, 1)
    dec = PagedDecoder(layer, 3, num_pages=6, page_size=8)
    dec(np.random.default_rng(1).standard_normal((3, 9, cfg.hidden_size)).astype(np.float32))
    before = snapshot(dec.cache)
    for rows in ([2, 0, 1], np.array([1, 0, 1]), jnp.array([1, 0, 1])):
        with pytest.raises(ValueError, match=r"release rows must be a \[max_seqs=3\] bool mask .* got dtype int"):
            dec.cache.release(rows)
        with pytest.raises(ValueError, match=r"release rows must be a \[max_seqs=3\] bool mask"):
            dec.release(rows)
        assert_same(before, dec.cache)
    with pytest.raises(ValueError, match=r"got shape \(2,\)"):
        dec.release([True, False])
    dec.release([True, False, True])  # a list of bools is a mask
    assert dec.lengths.tolist() == [0, 9, 0]
