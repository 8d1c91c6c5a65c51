"""Drafts that can be taken back (``glm5_dsa_jax.cache.rollback``): appending ``k`` drafts,
rolling back ``r`` and continuing equals appending the ``k - r`` accepted ones.

* Paged: every ``r`` in ``0 .. k`` at every position of the pool boundary (``KP = 4``:
  prefixes of 4 .. 7 tokens), each (prefix, r) its own sequence in one cache, with
  per-row counts in one call; the continuation's top-k bit-identical and outputs within
  float32 rounding, ``xla`` and (a subset) ``pallas_interpret``, eager and under
  ``PagedDecoder`` (its rollback compiled once). Page accounting: the page table after a
  rollback is clean (``check``) and holds what the accepted tokens alone hold; rolling
  every row back to where it was restores the table exactly, free stack included, so the
  next reservation takes the same page ids.
* Bad input: more tokens than a sequence holds, a negative count, more than the stage can
  restore, integer row ids, a count of the wrong shape: ``ValueError`` naming the row (or
  the argument) and every leaf unchanged; under jit the row is untouched and ``status``
  is ``BAD_ROLLBACK`` while the other rows roll back.
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

K = 4  # drafts per step
CONT = 3  # tokens appended after the rollback


@pytest.fixture(scope="module")
def cfg():
    return gd.DsaConfig.tiny()


def _cases(prefixes, rollbacks):
    return [(p, r) for p in prefixes for r in rollbacks]


def _inputs(cfg, cases, seed=0):
    """Per case (prefix p, rollback r): the prefix chunk (right-padded), the K drafts and
    the continuation, as ``[rows, S, hidden]`` arrays and masks."""
    rng = np.random.default_rng(seed)
    rows, width = len(cases), max(p for p, _ in cases)
    h = cfg.hidden_size
    prefix = rng.standard_normal((rows, width, h)).astype(np.float32)
    pmask = np.arange(width)[None] < np.array([p for p, _ in cases])[:, None]
    drafts = rng.standard_normal((rows, K, h)).astype(np.float32)
    accepted = np.arange(K)[None] < np.array([K - r for _, r in cases])[:, None]
    cont = rng.standard_normal((rows, CONT, h)).astype(np.float32)
    return prefix, pmask, drafts, accepted, cont


def _run(call, rollback, cache, cfg, cases, take_back: bool):
    """Prefix, drafts, then (take_back) a rollback of r or (else) only the accepted drafts,
    then the continuation chunk and one decode step: ``(outs, topks, cache)`` of the last two."""
    prefix, pmask, drafts, accepted, cont = _inputs(cfg, cases)
    rows = len(cases)
    _, _, cache = call(prefix, pmask, cache)
    if take_back:
        _, _, cache = call(drafts, np.ones((rows, K), bool), cache)
        cache = rollback(cache, np.ones(rows, bool), np.array([r for _, r in cases], np.int32))
    else:
        _, _, cache = call(drafts, accepted, cache)
    out1, top1, cache = call(cont, np.ones((rows, CONT), bool), cache)
    out2, top2, cache = call(cont[:, :1] * 0.5, np.ones((rows, 1), bool), cache)
    return (np.asarray(out1), np.asarray(out2)), (np.asarray(top1), np.asarray(top2)), cache


def _eager(layer):
    def call(x, mask, cache):
        return layer(jnp.asarray(x), attention_mask=jnp.asarray(mask), cache=cache)
    return call


def _rollback(cache, rows, n):
    return cache.rollback(rows, n)


def _assert_same(a, b, cases):
    (outs_a, tops_a), (outs_b, tops_b) = a, b
    for oa, ob, ta, tb in zip(outs_a, outs_b, tops_a, tops_b):
        for i, case in enumerate(cases):
            np.testing.assert_array_equal(ta[i], tb[i], err_msg=f"(prefix, rollback) = {case}")
            np.testing.assert_allclose(oa[i], ob[i], atol=ATOL, rtol=RTOL, err_msg=f"(prefix, rollback) = {case}")


def _assert_pages_match(taken_back, accepted):
    """Same lengths, pages per row and free-page count; both tables clean."""
    taken_back.pages.check()
    accepted.pages.check()
    np.testing.assert_array_equal(np.asarray(taken_back.lengths), np.asarray(accepted.lengths))
    np.testing.assert_array_equal((np.asarray(taken_back.block_table) >= 0).sum(1),
                                  (np.asarray(accepted.block_table) >= 0).sum(1))
    assert int(taken_back.pages.n_free) == int(accepted.pages.n_free)


@pytest.mark.parametrize("implementation,prefixes,rollbacks", [
    ("xla", (4, 5, 6, 7), range(K + 1)),
    ("pallas_interpret", (5, 7), (0, 2, 4)),
])
def test_drafts_rolled_back_equal_the_accepted_ones(cfg, implementation, prefixes, rollbacks):
    """Every (prefix, r) its own sequence: per-row counts in one rollback call."""
    cases = _cases(prefixes, rollbacks)
    layer = f32_layer(cfg, 1, seed=1, implementation=implementation, block_q=8)
    rows = len(cases)
    make = lambda: layer.init_paged_cache(rows, num_pages=3 * rows, page_size=8, max_rollback=K)
    *got, back = _run(_eager(layer), _rollback, make(), cfg, cases, True)
    *want, acc = _run(_eager(layer), _rollback, make(), cfg, cases, False)
    _assert_same(got, want, cases)
    _assert_pages_match(back, acc)


def test_decoder_rollback_compiles_once_and_shared_layer(cfg):
    """``PagedDecoder.rollback`` / ``truncate``: jitted once across counts and rows; a shared
    layer rolled back alike reuses its full layer's top-k."""
    cases = _cases((5, 7), (1, 4))
    rows = len(cases)
    full, shared = f32_layer(cfg, 1, seed=1), f32_layer(cfg, 2, seed=2)
    prefix, pmask, drafts, accepted, cont = _inputs(cfg, cases, seed=3)
    n = np.array([r for _, r in cases], np.int32)
    results = []
    for take_back in (True, False):
        decs = [PagedDecoder(lay, rows, 3 * rows, 8, max_rollback=K) for lay in (full, shared)]

        def both(x, mask):
            out, top = decs[0](x, mask)
            out2, top2 = decs[1](x, mask, prev_topk=top)
            return np.asarray(out), np.asarray(top), np.asarray(out2), np.asarray(top2)

        both(prefix, pmask)
        if take_back:
            both(drafts, np.ones((rows, K), bool))
            decs[0].rollback(np.ones(rows, bool), n)
            decs[1].truncate(np.ones(rows, bool), decs[1].lengths - n)
        else:
            both(drafts, accepted)
        results.append(both(cont, np.ones((rows, CONT), bool)))
        if take_back:  # more rollbacks, other rows and counts: no new program
            compiled = decs[0]._rollback._cache_size()  # one per cache structure (full, shared)
            for d in decs:
                d.rollback(np.arange(rows) % 2 == 0, np.zeros(rows, np.int32))
                d.rollback(np.arange(rows) % 3 == 0, np.ones(rows, np.int32))
            assert compiled == 2 and decs[0]._rollback._cache_size() == compiled
    for a, b in zip(results[0], results[1]):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL)
        if a.dtype == np.int32:
            np.testing.assert_array_equal(a, b)


def test_rollback_restores_the_page_table_exactly(cfg):
    """Drafts on every row, then every row rolled back to its length before: the page table
    (block tables, owners, the free stack) equals the one before, so the next reservation
    takes the same page ids. Also on a data-sharded table."""
    for shards in (1, 2):
        table = pg.init_page_table(4, 16, 4, 8, shards=shards)
        table, _ = table.reserve(jnp.array([5, 0, 9, 3], jnp.int32))
        before = jax.tree.map(np.asarray, table)
        grown, status = table.reserve(jnp.array([7, 4, 1, 8], jnp.int32))
        assert (np.asarray(status) == pg.OK).all()
        back, status = grown.truncate(jnp.ones(4, bool), table.lengths)
        assert (np.asarray(status) == pg.OK).all()
        back.check()
        after = jax.tree.map(np.asarray, back)
        for name in ("block_table", "lengths", "n_free", "owner"):
            np.testing.assert_array_equal(getattr(after, name), getattr(before, name), err_msg=name)
        n = np.asarray(before.n_free).reshape(-1)
        per = 16 // shards
        for s in range(shards):  # the free stack below its top
            np.testing.assert_array_equal(after.free[s * per:s * per + n[s]], before.free[s * per:s * per + n[s]])
        again, _ = back.reserve(jnp.array([7, 4, 1, 8], jnp.int32))
        np.testing.assert_array_equal(np.asarray(again.block_table), np.asarray(grown.block_table))


def _leaves(cache):
    return [np.asarray(a) for a in jax.tree.leaves(cache)]


def _assert_unchanged(a, b):
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_bad_rollbacks_are_refused_and_change_nothing(cfg):
    layer = f32_layer(cfg, 1, seed=1)
    cache = layer.init_paged_cache(3, 12, 8)  # max_rollback 1: a stage of KP = 4 entries
    assert cache.stage_width == 4 and cache.max_rollback == 1
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 10, cfg.hidden_size)), jnp.float32)
    mask = jnp.asarray(np.arange(10)[None] < np.array([[10], [6], [3]]))
    _, _, cache = layer(x, attention_mask=mask, cache=cache)  # lengths 10, 6, 3
    rows = np.ones(3, bool)
    bad = [
        (np.array([0, 7, 0]), "row 1: n_tokens[1] = 7 but the sequence holds 6 tokens"),
        (np.array([0, 0, -1]), "row 2: n_tokens[2] = -1"),
        # 10 -> 7: the pool of positions 4 .. 7 needs position 4; the stage holds 6 .. 9
        (np.array([3, 0, 0]), "row 0: n_tokens[0] = 3 takes the sequence from 10 to 7 tokens"),
    ]
    for n, msg in bad:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            cache.rollback(rows, n.astype(np.int32))
    with pytest.raises(ValueError, match="rollback rows must be a \\[max_seqs=3\\] bool mask"):
        cache.rollback(np.array([1, 1, 1]), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="n_tokens must be a \\[max_seqs=3\\] integer array"):
        cache.rollback(rows, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="lengths must be a \\[max_seqs=3\\] integer array"):
        cache.truncate(rows, np.zeros(3, np.float32))
    # Allowed with max_rollback 1: one token, or down to a pool boundary (10 -> 8, 6 -> 4, 3 -> 0).
    ok = cache.rollback(rows, np.array([2, 2, 3], np.int32))
    np.testing.assert_array_equal(np.asarray(ok.lengths), [8, 4, 0])
    ok.pages.check()
    assert int(ok.pages.n_free) == 12 - 1 - 1  # pages of 8 tokens: 8 and 4 tokens hold one each

    # Under jit: the refused rows are untouched, status says why, the others roll back.
    before = jax.tree.map(np.asarray, cache)
    got = jax.jit(_rollback)(cache, jnp.asarray(rows), jnp.array([3, 7, 1], jnp.int32))
    assert np.asarray(got.status).tolist() == [pg.BAD_ROLLBACK, pg.BAD_ROLLBACK, pg.OK]
    np.testing.assert_array_equal(np.asarray(got.lengths), [10, 6, 2])
    for name in ("stage_keys", "stage_gate", "stage_from"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[:2], getattr(before, name)[:2])
    np.testing.assert_array_equal(np.asarray(got.block_table)[:2], before.block_table[:2])
    got.pages.check()
    _assert_unchanged(cache, before)  # the eager refusals above changed nothing


def test_second_rollback_is_limited_by_stage_from(cfg):
    """A rollback shifts the stage: what it could restore before the shift is gone, so a
    second rollback that would need it is refused (``stage_from``), eagerly and under jit."""
    layer = f32_layer(cfg, 1, seed=1)
    cache = layer.init_paged_cache(1, 6, 8, max_rollback=3)  # H = 6: positions L - 6 .. L - 1
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 11, cfg.hidden_size)), jnp.float32)
    _, _, cache = layer(x, cache=cache)
    cache = cache.rollback(np.ones(1, bool), np.array([3], np.int32))  # 11 -> 8: stage_from 5
    assert int(cache.stage_from[0]) == 5 and int(cache.lengths[0]) == 8
    with pytest.raises(ValueError, match="raw keys of positions 5 .. 7 only"):
        cache.rollback(np.ones(1, bool), np.array([2], np.int32))  # 8 -> 6 needs position 4
    with pytest.raises(ValueError, match="from 8 to 5 tokens"):
        cache.rollback(np.ones(1, bool), np.array([3], np.int32))  # 8 -> 5 needs position 4 too
    assert int(cache.rollback(np.ones(1, bool), np.array([4], np.int32)).lengths[0]) == 4  # a boundary
    got = jax.jit(_rollback)(cache, jnp.ones(1, bool), jnp.array([2], jnp.int32))
    assert int(got.status[0]) == pg.BAD_ROLLBACK and int(got.lengths[0]) == 8


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
    cont = rng.standard_normal((batch, CONT, h)).astype(np.float32)
    return prefix, pmask, drafts, dmask, cont


@pytest.mark.parametrize("implementation,rollbacks", [("xla", range(K + 1)), ("pallas_interpret", (2,))])
def test_contiguous_drafts_rolled_back_equal_the_accepted_ones(cfg, implementation, rollbacks):
    """One count for the batch; every row's pool boundary at another offset."""
    layer = f32_layer(cfg, 1, seed=1, implementation=implementation, block_q=8)
    call = _eager(layer)
    prefix, pmask, drafts, dmask, cont = _timeline_inputs(cfg)
    b = prefix.shape[0]
    for r in rollbacks:
        runs = []
        for take_back in (True, False):
            cache = layer.init_cache(b, 24, max_rollback=K)
            _, _, cache = call(prefix, pmask, cache)
            if take_back:
                _, _, cache = call(drafts, dmask, cache)
                cache = cache.rollback(r)
                assert int(cache.length) == 8 + K - r
            elif r < K:
                _, _, cache = call(drafts[:, :K - r], dmask[:, :K - r], cache)
            out1, top1, cache = call(cont, np.ones((b, CONT), bool), cache)
            out2, top2, cache = call(cont[:, :1] * 0.5, np.ones((b, 1), bool), cache)
            runs.append(((np.asarray(out1), np.asarray(out2)), (np.asarray(top1), np.asarray(top2)), cache))
        _assert_same(runs[0][:2], runs[1][:2], [(f"row {i}", r) for i in range(b)])
        for name in ("key_valid", "pool_valid", "first_key", "n_valid", "length"):
            np.testing.assert_array_equal(np.asarray(getattr(runs[0][2], name)),
                                          np.asarray(getattr(runs[1][2], name)), err_msg=f"{name}, r = {r}")


def test_contiguous_bad_rollbacks_and_decoder(cfg):
    layer = f32_layer(cfg, 1, seed=1)
    cache = layer.init_cache(2, 16)  # max_rollback 1
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 10, cfg.hidden_size)), jnp.float32)
    _, _, cache = layer(x, cache=cache)
    before = jax.tree.map(np.asarray, cache)
    with pytest.raises(ValueError, match=r"n_tokens = \[1, 2\] differs between rows"):
        cache.rollback(np.array([1, 2]))
    with pytest.raises(ValueError, match="n_tokens = 11 slots: the cache holds 10"):
        cache.rollback(11)
    with pytest.raises(ValueError, match=r"raw keys of slots 6 \.\. 9 only .*row 0 \(its incomplete pool would start at slot 4\)"):
        cache.rollback(3)
    got = jax.jit(lambda c, n: c.rollback(n))(cache, jnp.int32(3))  # under jit: unchanged
    _assert_unchanged(got, before)
    _assert_unchanged(cache, before)
    assert int(cache.rollback(np.array([2, 2])).length) == 8  # a boundary: allowed

    from glm5_dsa_jax.decode import DsaDecoder
    dec = DsaDecoder(layer, 2, 16, max_rollback=3)
    dec(x[:, :7])
    dec.rollback(3)  # 7 -> 4: the stage now holds slots 1 .. 3
    with pytest.raises(ValueError, match=r"\(4 -> 3\): the stage holds the raw keys of slots 1 \.\. 3"):
        dec.rollback(1)
    dec.rollback(np.array([4, 4]))
    assert dec.length == 0 and int(dec.cache.length) == 0 and dec._rollback._cache_size() == 1
    with pytest.raises(ValueError, match="the cache holds 0"):
        dec.rollback(1)


def test_a_rolled_back_sequence_moves_and_goes_on(cfg):
    """Export after a rollback from a wide-stage cache, load into a cache of another
    ``max_rollback`` and page size: the continuation equals the one where it was; the loaded
    row's ``stage_from`` is ``length - KP`` (an export carries the last ``KP`` stage entries)."""
    layer = f32_layer(cfg, 1, seed=1)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((1, 13, cfg.hidden_size)), jnp.float32)
    src = layer.init_paged_cache(1, 4, 8, max_rollback=4)
    _, _, src = layer(x, cache=src)
    src = src.rollback(np.ones(1, bool), np.array([3], np.int32))  # 13 -> 10
    dst = layer.init_paged_cache(2, 6, 4).load(1, src.export(0))
    assert np.asarray(dst.lengths).tolist() == [0, 10] and np.asarray(dst.stage_from).tolist() == [0, 6]
    nxt = jnp.asarray(rng.standard_normal((1, 3, cfg.hidden_size)), jnp.float32)
    out_a, top_a, _ = layer(nxt, cache=src)
    out_b, top_b, dst = layer(jnp.concatenate([nxt * 0, nxt]), attention_mask=jnp.asarray([[False] * 3, [True] * 3]),
                              cache=dst)
    np.testing.assert_array_equal(np.asarray(top_b)[1], np.asarray(top_a)[0])
    np.testing.assert_allclose(np.asarray(out_b)[1], np.asarray(out_a)[0], atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="raw keys of positions 9 .. 12 only"):  # 13 -> 9 needs 8
        dst.rollback(np.array([False, True]), np.array([0, 4], np.int32))
    assert int(dst.rollback(np.array([False, True]), np.array([0, 1], np.int32)).lengths[1]) == 12
