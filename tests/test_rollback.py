"""Drafts that can be taken back (``glm5_dsa_jax.cache.rollback``): appending ``k`` drafts,
rolling back ``r`` and continuing equals appending the ``k - r`` accepted ones.

* Paged: every ``r`` in ``0 .. k`` at every position of the pool boundary (``KP = 4``:
  prefixes of 4 .. 7 tokens), each (prefix, r) twice in one cache: a row that takes its
  drafts back (per-row counts in one call) and a row that is given only the accepted ones;
  the two rows' continuations have bit-identical top-k and outputs within float32
  rounding, ``xla`` and (a subset) ``pallas_interpret``, eager and under ``PagedDecoder``
  (its rollback compiled once), and on an fp8 cache (placed caches, TP 2 and data x tp:
  ``tests/test_serving_schedules.py``, against each sequence alone). Page accounting: the page
  table after a rollback is clean (``check``), each row holds the pages its accepted
  tokens alone hold and the free pages are the rest; rolling every row back to where it
  was restores the table exactly, free stack included, so the next reservation takes the
  same page ids.
* Bad input: more tokens than a sequence holds, a negative count, more than the stage can
  restore, integer row ids, a count of the wrong shape: ``ValueError`` naming the row (or
  the argument) and every leaf unchanged; under jit the row is untouched and ``status``
  is ``BAD_ROLLBACK`` while the other rows roll back.
* A rolled-back sequence moves (``export`` / ``load``) with its rollback state: loaded into
  a cache of the same ``max_rollback`` it can take back what it could where it was; into
  a narrower stage, what that stage can restore.

Time: every call is a chunk of ``K`` or one token, and the tests share their cache
geometries (``PAGED``), so each (layer, geometry) compiles two step programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.cache import pages as pg
from glm5_dsa_jax.cache.rollback import stage_bytes
from glm5_dsa_jax.decode import PagedDecoder
from helpers import ATOL, RTOL, f32_layer

K = 4  # drafts per step, and the width of every chunk (a prefix arrives in chunks of K)
CONT = 3  # tokens appended after the rollback (in one chunk of K)
ALL_CASES = [(p, r) for p in (4, 5, 6, 7) for r in range(K + 1)]  # every pool offset, every r

#: The cache geometries the tests share (one compilation each per layer and chunk width):
#: ``WIDE`` takes back ``K`` tokens (a row per case and half), ``NARROW`` (another page
#: size) the default one.
WIDE = dict(max_seqs=2 * len(ALL_CASES), num_pages=4 * len(ALL_CASES), page_size=8, max_rollback=K)
NARROW = dict(max_seqs=3, num_pages=12, page_size=4)


@pytest.fixture(scope="module")
def cfg():
    return gd.DsaConfig.tiny(index_topk=4)  # 1 pool of up to 3 selected: a top-k that can be wrong


_LAYERS = {}


def layer_of(cfg, implementation="xla", layer_idx=1):
    """One layer per (implementation, layer) for the whole module: eager calls of equal
    layers share their compiled programs."""
    key = (implementation, layer_idx)
    if key not in _LAYERS:
        _LAYERS[key] = f32_layer(cfg, layer_idx, seed=layer_idx, implementation=implementation, block_q=8)
    return _LAYERS[key]


def _chunks(x, mask, width=K):
    """``x [B, S, h]`` / ``mask [B, S]`` as calls of ``width`` (the last padded)."""
    s = x.shape[1]
    pad = -s % width
    x = np.pad(x, ((0, 0), (0, pad), (0, 0)))
    mask = np.pad(mask, ((0, 0), (0, pad)))
    return [(x[:, i:i + width], mask[:, i:i + width]) for i in range(0, s + pad, width)]


def _inputs(cfg, cases, seed=0):
    """Rows ``i`` (drafts taken back) and ``n + i`` (only the accepted drafts) of case ``i``
    (prefix p, rollback r) get the same tokens: the prefix (right-padded), ``K`` drafts and
    the continuation, ``[2n, S, hidden]``; ``accepted`` masks the drafts each row keeps."""
    rng = np.random.default_rng(seed)
    n, h = len(cases), cfg.hidden_size
    width = max(p for p, _ in cases)
    prefix = rng.standard_normal((n, width, h)).astype(np.float32)
    drafts = rng.standard_normal((n, K, h)).astype(np.float32)
    cont = rng.standard_normal((n, K, h)).astype(np.float32)
    both = lambda a: np.concatenate([a, a])
    pmask = both(np.arange(width)[None] < np.array([p for p, _ in cases])[:, None])
    keep = np.arange(K)[None] < np.array([K - r for _, r in cases])[:, None]
    accepted = np.concatenate([np.ones_like(keep), keep])
    return both(prefix), pmask, both(drafts), accepted, both(cont)


def _run_halves(call, rollback, cache, cfg, cases, decode=True):
    """Prefix, drafts (all of them on the first half, the accepted ones on the second), a
    rollback of ``r`` on the first half, then the continuation chunk and (``decode``) one
    decode step: ``(outs, topks, cache)`` of the last two."""
    prefix, pmask, drafts, accepted, cont = _inputs(cfg, cases)
    n = len(cases)
    for x, m in _chunks(prefix, pmask):
        _, _, cache = call(x, m, cache)
    _, _, cache = call(drafts, accepted, cache)
    rows = np.arange(2 * n) < n
    cache = rollback(cache, rows, np.array([r for _, r in cases] * 2, np.int32) * rows)
    cmask = np.arange(K)[None] < np.full((2 * n, 1), CONT)
    out1, top1, cache = call(cont, cmask, cache)
    outs, tops = [np.asarray(out1)[:, :CONT]], [np.asarray(top1)[:, :CONT]]
    if decode:
        out2, top2, cache = call(cont[:, :1] * 0.5, np.ones((2 * n, 1), bool), cache)
        outs.append(np.asarray(out2))
        tops.append(np.asarray(top2))
    return outs, tops, cache


def _eager(layer):
    def call(x, mask, cache):
        return layer(jnp.asarray(x), attention_mask=jnp.asarray(mask), cache=cache)
    return call


def _rollback(cache, rows, n):
    return cache.rollback(rows, n)


def _assert_halves_same(outs, tops, cases):
    """Row ``i`` (drafts taken back) against row ``n + i`` (accepted only)."""
    n = len(cases)
    for o, t in zip(outs, tops):
        for i, case in enumerate(cases):
            np.testing.assert_array_equal(t[i], t[n + i], err_msg=f"(prefix, rollback) = {case}")
            np.testing.assert_allclose(o[i], o[n + i], atol=ATOL, rtol=RTOL, err_msg=f"(prefix, rollback) = {case}")


def _assert_pages_halves(cache, cases):
    """Clean table; both rows of a case hold the same length and pages; every page not held
    is free (per data shard)."""
    cache.pages.check()
    n = len(cases)
    lengths = np.asarray(cache.lengths)
    held = (np.asarray(cache.block_table) >= 0).sum(1)
    np.testing.assert_array_equal(lengths[:n], lengths[n:])
    np.testing.assert_array_equal(held[:n], held[n:])
    np.testing.assert_array_equal(held, -(-lengths // cache.page_size))
    shards = cache.pages.shards
    per = held.reshape(shards, -1).sum(1)
    np.testing.assert_array_equal(np.asarray(cache.pages.n_free).reshape(-1), cache.num_pages // shards - per)


def _paged(layer, cases, dtype=None, **fmt):
    """A ``WIDE`` cache, or for fewer cases one of a row per case and half (``fmt``: an fp8
    cache's format keywords)."""
    if len(cases) == len(ALL_CASES):
        return layer.init_paged_cache(dtype=dtype, **WIDE, **fmt)
    rows = 2 * len(cases)
    return layer.init_paged_cache(dtype=dtype, **(WIDE | dict(max_seqs=rows, num_pages=2 * rows)), **fmt)


@pytest.mark.parametrize("implementation,cases", [
    ("xla", ALL_CASES),
    ("pallas_interpret", [(p, r) for p in (5, 7) for r in (0, 2, 4)]),
])
@pytest.mark.slow
def test_drafts_rolled_back_equal_the_accepted_ones(cfg, implementation, cases):
    """Every (prefix, r) its own pair of rows: per-row counts in one rollback call (the
    decode step after the continuation on ``xla`` only: one program less to interpret)."""
    layer = layer_of(cfg, implementation)
    outs, tops, cache = _run_halves(_eager(layer), _rollback, _paged(layer, cases), cfg, cases,
                                    decode=implementation == "xla")
    _assert_halves_same(outs, tops, cases)
    _assert_pages_halves(cache, cases)


@pytest.mark.parametrize("index_keys", ["e4m3", "int8"])
def test_rollback_on_an_fp8_cache(cfg, index_keys):
    """The same equivalence on an fp8 cache (e4m3 or int8 pooled keys): each row is quantised
    once, alike on both rows of a case, so the continuations agree within float32 rounding.
    (Placed caches, TP 2 and data x tp: ``tests/test_serving_schedules.py``, against each
    sequence run alone.)"""
    layer = layer_of(cfg)
    cache = _paged(layer, ALL_CASES, dtype="fp8", index_keys=index_keys)
    assert cache.pooled_dtype == (jnp.int8 if index_keys == "int8" else jnp.float8_e4m3fn)
    outs, tops, cache = _run_halves(_eager(layer), _rollback, cache, cfg,
                                    ALL_CASES, decode=False)
    _assert_halves_same(outs, tops, ALL_CASES)
    _assert_pages_halves(cache, ALL_CASES)


@pytest.mark.slow
def test_decoder_rollback_compiles_once_and_shared_layer(cfg):
    """``PagedDecoder.rollback`` / ``truncate``: jitted once across counts and rows; a shared
    layer rolled back alike reuses its full layer's top-k."""
    cases = [(p, r) for p in (5, 7) for r in (1, 4)]
    rows = 2 * len(cases)
    full, shared = layer_of(cfg), layer_of(cfg, layer_idx=2)
    decs = [PagedDecoder(lay, rows, 2 * rows, max_rollback=K, page_size=8) for lay in (full, shared)]

    def call(x, mask, _):
        out, top = decs[0](x, mask)
        out2, top2 = decs[1](x, mask, prev_topk=top)
        return (np.concatenate([np.asarray(out), np.asarray(out2)], 2),
                np.concatenate([np.asarray(top), np.asarray(top2)], 2), None)

    def rollback(_, rows, n):
        decs[0].rollback(rows, n)
        decs[1].truncate(rows, decs[1].lengths - n)

    outs, tops, _ = _run_halves(call, rollback, None, cfg, cases, decode=False)  # chunks of K only
    _assert_halves_same(outs, tops, cases)
    compiled = [d._rollback._cache_size() for d in decs]
    for d in decs:  # more rollbacks, other rows and counts: no new program
        d.rollback(np.arange(rows) % 2 == 0, np.zeros(rows, np.int32))
        d.rollback(np.arange(rows) % 3 == 0, np.ones(rows, np.int32))
    # At most one program per decoder and input placement (a step's output, then its own)
    assert max(compiled) <= 2 and [d._rollback._cache_size() for d in decs] == compiled
    for d in decs:
        d.cache.pages.check()


_TABLE_OPS = {"reserve": jax.jit(lambda t, n: t.reserve(n)),
              "truncate": jax.jit(lambda t, r, n: t.truncate(r, n))}


def test_rollback_restores_the_page_table_exactly(cfg):
    """Drafts on every row, then every row rolled back to its length before: the page table
    (block tables, owners, the free stack) equals the one before, so the next reservation
    takes the same page ids. Also on a data-sharded table."""
    reserve, truncate = _TABLE_OPS["reserve"], _TABLE_OPS["truncate"]
    for shards in (1, 2):
        table = pg.init_page_table(4, 16, 4, 8, shards=shards)
        table, _ = reserve(table, jnp.array([5, 0, 9, 3], jnp.int32))
        before = jax.tree.map(np.asarray, table)
        grown, status = reserve(table, jnp.array([7, 4, 1, 8], jnp.int32))
        assert (np.asarray(status) == pg.OK).all()
        back, status = truncate(grown, jnp.ones(4, bool), table.lengths)
        assert (np.asarray(status) == pg.OK).all()
        back.check()
        after = jax.tree.map(np.asarray, back)
        for name in ("block_table", "lengths", "n_free", "owner"):
            np.testing.assert_array_equal(getattr(after, name), getattr(before, name), err_msg=name)
        n = np.asarray(before.n_free).reshape(-1)
        per = 16 // shards
        for s in range(shards):  # the free stack below its top
            np.testing.assert_array_equal(after.free[s * per:s * per + n[s]], before.free[s * per:s * per + n[s]])
        again, _ = reserve(back, jnp.array([7, 4, 1, 8], jnp.int32))
        np.testing.assert_array_equal(np.asarray(again.block_table), np.asarray(grown.block_table))


def _leaves(cache):
    return [np.asarray(a) for a in jax.tree.leaves(cache)]


def _assert_unchanged(a, b):
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _prefill(layer, cache, lengths, seed=0):
    """Row ``b`` gets ``lengths[b]`` tokens, in chunks of ``K``: ``(cache, tokens)``."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    x = rng.standard_normal((len(lengths), width, layer.cfg.hidden_size)).astype(np.float32)
    mask = np.arange(width)[None] < np.asarray(lengths)[:, None]
    for xc, mc in _chunks(x, mask):
        _, _, cache = _eager(layer)(xc, mc, cache)
    return cache, x


def test_bad_rollbacks_are_refused_and_change_nothing(cfg):
    layer = layer_of(cfg)
    cache = layer.init_paged_cache(**WIDE)  # max_rollback 4: a stage of 7 entries
    b = cache.max_seqs
    assert cache.stage_width == 7 and cache.max_rollback == K
    cache, _ = _prefill(layer, cache, (10, 6, 3) + (0,) * (b - 3))
    rows = np.arange(b) < 3
    n = lambda *k: np.array(k + (0,) * (b - 3), np.int32)  # noqa: E731
    bad = [
        (n(0, 7, 0), "row 1: n_tokens[1] = 7 but the sequence holds 6 tokens"),
        (n(0, 0, -1), "row 2: n_tokens[2] = -1"),
        # 10 -> 2: the pool of positions 0 .. 2 needs position 0; the stage holds 3 .. 9
        (n(8, 0, 0), "row 0: n_tokens[0] = 8 takes the sequence from 10 to 2 tokens"),
    ]
    for counts, msg in bad:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            cache.rollback(rows, counts)
    with pytest.raises(ValueError, match=f"rollback rows must be a \\[max_seqs={b}\\] bool mask"):
        cache.rollback(rows.astype(np.int32), n(0, 0, 0))
    with pytest.raises(ValueError, match=f"n_tokens must be a \\[max_seqs={b}\\] integer array"):
        cache.rollback(rows, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=f"lengths must be a \\[max_seqs={b}\\] integer array"):
        cache.truncate(rows, np.zeros(b, np.float32))
    # Allowed: up to max_rollback tokens, or down to a pool boundary (10 -> 8 -> 4, 3 -> 0).
    ok = cache.rollback(rows, n(2, 2, 3))
    np.testing.assert_array_equal(np.asarray(ok.lengths)[:3], [8, 4, 0])
    ok.pages.check()
    assert int(ok.pages.n_free) == cache.num_pages - 1 - 1  # pages of 8: 8 and 4 tokens hold one each

    # Under jit: the refused rows are untouched, status says why, the others roll back.
    before = jax.tree.map(np.asarray, cache)
    got = jax.jit(_rollback)(cache, jnp.asarray(rows), jnp.asarray(n(8, 7, 1)))
    assert np.asarray(got.status)[:3].tolist() == [pg.BAD_ROLLBACK, pg.BAD_ROLLBACK, pg.OK]
    np.testing.assert_array_equal(np.asarray(got.lengths)[:3], [10, 6, 2])
    for name in ("stage_keys", "stage_gate", "stage_from"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[:2], getattr(before, name)[:2])
    np.testing.assert_array_equal(np.asarray(got.block_table)[:2], before.block_table[:2])
    got.pages.check()
    _assert_unchanged(cache, before)  # the eager refusals above changed nothing


def test_second_rollback_is_limited_by_stage_from(cfg):
    """A rollback shifts the stage: what it could restore before the shift is gone, so a
    second rollback that would need it is refused (``stage_from``), eagerly and under jit,
    although ``length - H`` alone would allow it."""
    layer = layer_of(cfg)
    cache = layer.init_paged_cache(**WIDE)  # H = 7: positions L - 7 .. L - 1
    b = cache.max_seqs
    cache, _ = _prefill(layer, cache, (11,) + (0,) * (b - 1))
    rows = np.arange(b) == 0
    n = lambda k: np.array([k] + [0] * (b - 1), np.int32)  # noqa: E731
    cache = cache.rollback(rows, n(4))  # 11 -> 7: stage_from 4
    assert int(cache.stage_from[0]) == 4 and int(cache.lengths[0]) == 7
    with pytest.raises(ValueError, match="raw keys of positions 4 .. 6 only"):
        cache.rollback(rows, n(4))  # 7 -> 3 needs position 0 (7 - H = 0)
    with pytest.raises(ValueError, match="from 7 to 1 tokens"):
        cache.rollback(rows, n(6))
    assert int(cache.rollback(rows, n(7)).lengths[0]) == 0  # a boundary
    assert int(cache.rollback(rows, n(3)).lengths[0]) == 4  # a boundary
    got = jax.jit(_rollback)(cache, jnp.asarray(rows), jnp.asarray(n(4)))
    assert int(got.status[0]) == pg.BAD_ROLLBACK and int(got.lengths[0]) == 7


def test_stage_bytes_in_the_docs():
    """The per-sequence state the module doc states, at GLM-5.3-Flash dims (bf16 stage)."""
    flash = gd.DsaConfig.glm53_flash()
    d, kp = flash.index_head_dim, flash.index_kpool
    assert (d, kp) == (128, 4)
    assert [stage_bytes(max(kp, kp - 1 + r), d, 2) for r in (1, 8, 16)] == [3076, 8452, 14596]
    cache = gd.init_paged_cache(gd.DsaConfig.tiny(), 2, 4, 8, max_rollback=8)
    assert cache.stage_keys.shape[1] == cache.stage_width == 11 and cache.max_rollback == 8
    with pytest.raises(ValueError, match="max_rollback must be an int >= 0"):
        gd.init_paged_cache(gd.DsaConfig.tiny(), 2, 4, 8, max_rollback=-1)


# ---------------------------------------------------------------------------- the contiguous cache
CONTIGUOUS = (4, 24)  # (batch, max_length): every contiguous test's geometry


def _timeline_inputs(cfg, batch=4, seed=5):
    """Row ``b`` left-padded by ``b`` slots (its pool grid starts at slot ``b``: every offset of
    the pool boundary across the rows), ``K`` drafts with one hole, the continuation."""
    rng = np.random.default_rng(seed)
    h = cfg.hidden_size
    prefix = rng.standard_normal((batch, 8, h)).astype(np.float32)
    pmask = np.arange(8)[None] >= np.arange(batch)[:, None]
    drafts = rng.standard_normal((batch, K, h)).astype(np.float32)
    dmask = np.ones((batch, K), bool)
    dmask[1, 1] = False  # padding inside the drafts
    cont = rng.standard_normal((batch, K, h)).astype(np.float32)
    return prefix, pmask, drafts, dmask, cont


@pytest.mark.parametrize("implementation,rollbacks", [("xla", range(K + 1)), ("pallas_interpret", (K,))])
def test_contiguous_drafts_rolled_back_equal_the_accepted_ones(cfg, implementation, rollbacks):
    """One count for the batch; every row's pool boundary at another offset. The accepted
    drafts arrive one slot a call (a chunk of them equals its slots one by one);
    ``pallas_interpret`` drops every draft (a pool they completed included) and runs chunks
    of ``K`` only (one program to interpret)."""
    decode = implementation == "xla"
    layer = layer_of(cfg, implementation)
    call = _eager(layer)
    prefix, pmask, drafts, dmask, cont = _timeline_inputs(cfg)
    b = prefix.shape[0]
    for r in rollbacks:
        runs = []
        for take_back in (True, False):
            cache = layer.init_cache(*CONTIGUOUS, max_rollback=K)
            for x, m in _chunks(prefix, pmask):
                _, _, cache = call(x, m, cache)
            if take_back:
                _, _, cache = call(drafts, dmask, cache)
                cache = cache.rollback(r)
                assert int(cache.length) == 8 + K - r
            else:
                for j in range(K - r):
                    _, _, cache = call(drafts[:, j:j + 1], dmask[:, j:j + 1], cache)
            out1, top1, cache = call(cont, np.ones((b, K), bool), cache)
            out2, top2, cache = call(cont[:, :1] * 0.5, np.ones((b, 1), bool), cache) if decode else (out1, top1, cache)
            runs.append(((np.asarray(out1), np.asarray(out2)), (np.asarray(top1), np.asarray(top2)), cache))
        for (oa, ta), (ob, tb) in zip(zip(*runs[0][:2]), zip(*runs[1][:2])):
            np.testing.assert_array_equal(ta, tb, err_msg=f"r = {r}")
            np.testing.assert_allclose(oa, ob, atol=ATOL, rtol=RTOL, err_msg=f"r = {r}")
        for name in ("key_valid", "pool_valid", "first_key", "n_valid", "length"):
            np.testing.assert_array_equal(np.asarray(getattr(runs[0][2], name)),
                                          np.asarray(getattr(runs[1][2], name)), err_msg=f"{name}, r = {r}")


def test_contiguous_bad_rollbacks_and_decoder(cfg):
    layer = layer_of(cfg)
    cache = layer.init_cache(*CONTIGUOUS, max_rollback=K)  # H = 7
    x = np.random.default_rng(0).standard_normal((4, 12, cfg.hidden_size)).astype(np.float32)
    for xc, mc in _chunks(x, np.ones((4, 12), bool)):
        _, _, cache = _eager(layer)(xc, mc, cache)  # 12 slots, no padding
    before = jax.tree.map(np.asarray, cache)
    with pytest.raises(ValueError, match=r"n_tokens = \[1, 2, 1, 1\] differs between rows"):
        cache.rollback(np.array([1, 2, 1, 1]))
    with pytest.raises(ValueError, match="n_tokens = 13 slots: the cache holds 12"):
        cache.rollback(13)
    with pytest.raises(ValueError, match=r"raw keys of slots 5 \.\. 11 only .*row 0 \(its incomplete pool would start at slot 0\)"):
        cache.rollback(9)
    got = jax.jit(lambda c, n: c.rollback(n))(cache, jnp.int32(9))  # under jit: unchanged
    _assert_unchanged(got, before)
    _assert_unchanged(cache, before)
    assert int(cache.rollback(np.array([4, 4, 4, 4])).length) == 8  # a boundary: allowed

    from glm5_dsa_jax.decode import DsaDecoder
    dec = DsaDecoder(layer, *CONTIGUOUS, max_rollback=3)  # H = 6
    dec(x[:, :4])
    dec(x[:, 4:8])
    dec.rollback(3)  # 8 -> 5: the stage now holds slots 2 .. 4
    with pytest.raises(ValueError, match=r"\(5 -> 3\): the stage holds the raw keys of slots 2 \.\. 4"):
        dec.rollback(2)
    dec.rollback(np.array([5, 5, 5, 5]))  # a boundary
    assert dec.length == 0 and int(dec.cache.length) == 0 and dec._rollback._cache_size() == 1
    with pytest.raises(ValueError, match="the cache holds 0"):
        dec.rollback(1)


# ---------------------------------------------------------------------------- a sequence that moves
def test_a_rolled_back_sequence_moves_and_goes_on(cfg):
    """An export carries the rollback state (the whole stage, ``stage_from``): loaded into a
    cache of the same ``max_rollback`` a sequence takes back what it could where it was, and
    the continuation equals the one there; loaded into one of a narrower stage (and another
    page size) it keeps the last entries that stage holds and a ``stage_from`` raised to
    match, so it takes back what that stage can restore."""
    layer = layer_of(cfg)
    call = _eager(layer)
    src = layer.init_paged_cache(**WIDE)
    b = src.max_seqs
    one, two = np.arange(b) == 0, np.arange(b) == 1
    src, _ = _prefill(layer, src, (14,) + (0,) * (b - 1), seed=7)
    src = src.rollback(one, one.astype(np.int32))  # 14 -> 13: stage_from 14 - 7
    e = src.export(0)
    assert e.stage_keys.shape[0] == src.stage_width == 7 and int(e.stage_from) == 7 and e.length == 13
    # The same max_rollback: K tokens back (13 -> 9 needs position 8; the last KP alone: 9 ..).
    same = layer.init_paged_cache(**WIDE).load(1, e)
    assert np.asarray(same.stage_from)[:2].tolist() == [0, 7]
    src = src.rollback(one, one * np.int32(K))
    same = same.rollback(two, two * np.int32(K))
    assert np.asarray(same.lengths)[:2].tolist() == [0, 9]
    nxt = np.random.default_rng(8).standard_normal((b, K, cfg.hidden_size)).astype(np.float32)
    out_a, top_a, _ = call(nxt, np.ones((b, K), bool) & one[:, None], src)
    out_b, top_b, _ = call(nxt[[1, 0] + list(range(2, b))], np.ones((b, K), bool) & two[:, None], same)
    np.testing.assert_array_equal(np.asarray(top_b)[1], np.asarray(top_a)[0])
    np.testing.assert_allclose(np.asarray(out_b)[1], np.asarray(out_a)[0], atol=ATOL, rtol=RTOL)
    # A narrower stage (H = 4) and pages of 4: the last 4 entries, stage_from max(7, 13 - 4).
    narrow = layer.init_paged_cache(**NARROW).load(2, e)
    assert narrow.stage_width == 4 and narrow.max_rollback == 1
    assert np.asarray(narrow.stage_from).tolist() == [0, 0, 9]
    rows = np.array([False, False, True])
    with pytest.raises(ValueError, match="raw keys of positions 9 .. 12 only"):  # 13 -> 9 needs 8
        narrow.rollback(rows, np.array([0, 0, K], np.int32))
    assert int(narrow.rollback(rows, np.array([0, 0, 1], np.int32)).lengths[2]) == 12
    assert int(narrow.rollback(rows, np.array([0, 0, 5], np.int32)).lengths[2]) == 8  # a boundary
    again = narrow.export(2)
    assert again.stage_keys.shape[0] == 4 and int(again.stage_from) == 9
    np.testing.assert_array_equal(again.stage_keys, e.stage_keys[-4:])
