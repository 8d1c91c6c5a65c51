"""Shared prefixes (``PagedCache.fork``, ``glm5_dsa_jax.cache.fork``): a row started as the
first tokens of another holds that prefix's complete pages by reference.

* Equivalence: one source prompt forked at a page-aligned, a mid-page (pool-aligned), a
  mid-pool and the whole length, every fork then continued with its own tokens (a chunk and
  a decode step, beside the source's own): each forked sequence's outputs and top-k equal
  its whole prompt run alone (``test_paged.alone``: top-k bit for bit, outputs within float32
  rounding); ``xla`` and ``pallas_interpret``, under ``PagedDecoder`` (its fork jitted once,
  donating), the eager fork giving the same cache.
* Page accounting: ``refs`` exact and ``check()`` clean after the fork, the appends, a
  rollback and releases; a shared page goes back with its last holder only; truncating into
  a shared page is refused (eagerly and under jit). A forked row exports (its content).
* Bad input: every refusal of the module doc raises ``ValueError`` naming the row and the
  sizes with every leaf unchanged; under jit the refused row is untouched and ``status`` is
  ``BAD_FORK`` while the other forks go through.
* Memory: the bytes ``docs/serving.md`` states for 16 sequences sharing a 4,096-token
  prompt at GLM-5.3-Flash dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.cache import pages as pg
from glm5_dsa_jax.cache.fork import shared_prefix_bytes
from glm5_dsa_jax.decode import PagedDecoder
from helpers import ATOL, RTOL, f32_layer
from test_paged import alone

PROMPT = 21  # the source's tokens: pages of 8 hold 0 .. 7, 8 .. 15, 16 .. 20
#: Fork lengths: page-aligned, mid-page on a pool boundary (KP 4), mid-pool, the whole prompt.
FORKS = (16, 20, 19, 21)
SUFFIX = 5  # each row's own tokens after the fork (the source's too)
ROWS = 1 + len(FORKS)
PAGE = 8


@pytest.fixture(scope="module")
def cfg():
    return gd.DsaConfig.tiny()


def _tokens(cfg, seed=0):
    rng = np.random.default_rng(seed)
    h = cfg.hidden_size
    return (rng.standard_normal((PROMPT, h)).astype(np.float32),
            rng.standard_normal((ROWS, SUFFIX + 1, h)).astype(np.float32))


def _first_chunk(cfg, prompt):
    x = np.zeros((ROWS, PROMPT, cfg.hidden_size), np.float32)
    x[0] = prompt
    mask = np.zeros((ROWS, PROMPT), bool)
    mask[0] = True
    return x, mask


def _assert_refs(cache, want):
    """``refs`` of the pages named in ``want`` ({page: holders}); every other page free."""
    cache.pages.check()
    refs = np.asarray(cache.pages.refs)
    np.testing.assert_array_equal(refs[list(want)], list(want.values()))
    assert (np.delete(refs, list(want)) == 0).all()
    assert int(cache.pages.n_free) == cache.num_pages - len(want)


def _assert_alone(layer, prompt, suffix, outs, tops):
    """Row ``b``'s suffix outputs equal its whole prompt (``prompt[:ell]`` then its suffix)
    run alone."""
    for b, ell in enumerate((PROMPT,) + FORKS):
        out, top = alone(layer, np.concatenate([prompt[:ell], suffix[b]]))
        np.testing.assert_array_equal(tops[b], top[ell:], err_msg=f"row {b} (fork of {ell} tokens)")
        np.testing.assert_allclose(outs[b], out[ell:], atol=ATOL, rtol=RTOL, err_msg=f"row {b}")


def _suffix_steps(call, suffix):
    """The rows' own tokens: a chunk of ``SUFFIX``, then one decode step."""
    out1, top1 = call(suffix[:, :SUFFIX], np.ones((ROWS, SUFFIX), bool))
    out2, top2 = call(suffix[:, SUFFIX:], np.ones((ROWS, 1), bool))
    return np.concatenate([out1, out2], 1), np.concatenate([top1, top2], 1)


SRC = np.zeros(len(FORKS), np.int32)
DST = np.arange(1, ROWS, dtype=np.int32)
LENGTHS = np.asarray(FORKS, np.int32)
#: After the fork: pages 0, 1 (the source's complete pages) held by all five rows, page 2
#: the source's last one, pages 3, 4, 5 the copies of the three forks that end mid-page.
AFTER_FORK = {0: 5, 1: 5, 2: 1, 3: 1, 4: 1, 5: 1}


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
@pytest.mark.slow
def test_forks_equal_their_prompts_alone(cfg, implementation):
    """Under ``PagedDecoder`` (its fork jitted and donating); the eager fork gives the same
    cache. Then (``xla``) page accounting through truncate and release, and a second fork
    of other rows and lengths that compiles nothing."""
    layer = f32_layer(cfg, 1, seed=1, implementation=implementation, block_q=8)
    prompt, suffix = _tokens(cfg)
    dec = PagedDecoder(layer, ROWS, 16, PAGE, max_rollback=4)
    dec(*(jnp.asarray(a) for a in _first_chunk(cfg, prompt)))
    eager = _leaves(dec.cache.fork(SRC, DST, LENGTHS))  # host copies: the decoder's fork donates
    dec.fork(SRC, DST, LENGTHS)
    for a, b in zip(eager, _leaves(dec.cache), strict=True):
        np.testing.assert_array_equal(a, b)
    cache = dec.cache
    np.testing.assert_array_equal(np.asarray(cache.lengths), (PROMPT,) + FORKS)
    assert np.asarray(cache.status).tolist() == [pg.OK] * ROWS
    _assert_refs(cache, AFTER_FORK)
    assert (np.asarray(cache.pages.owner)[:2] == pg.SHARED).all()
    outs, tops = _suffix_steps(lambda x, m: tuple(np.asarray(a) for a in dec(jnp.asarray(x), jnp.asarray(m))),
                               suffix)
    _assert_alone(layer, prompt, suffix, outs, tops)
    if implementation == "xla":
        _page_accounting(dec.cache)
        dec.release(np.arange(ROWS) > 0)  # other rows and lengths: the same program
        dec.fork(np.array([0, 0, 0, 0]), np.array([4, 3, 2, 1]), np.array([8, 27, 26, 24]))
        dec.cache.pages.check()
        assert dec._fork._cache_size() == 1
        np.testing.assert_array_equal(dec.lengths, [27, 24, 26, 27, 8])


#: Compiled once (the eager paths are ``test_rollback``'s and ``test_paged``'s).
TRUNCATE = jax.jit(lambda c, r, n: c.truncate(r, n))
RELEASE = jax.jit(lambda c, r: c.release(r))


def _page_accounting(cache):
    """After the rows' own tokens (lengths 27, 22, 26, 25, 27: every row took a page past
    the shared two): refs through truncate and release; a forked row exports its content."""
    cache.pages.check()
    refs = np.asarray(cache.pages.refs)
    assert refs[:2].tolist() == [5, 5] and (refs[2:] <= 1).all()
    whole = cache.export(0)
    for b, ell in enumerate(FORKS, 1):  # the source's first ell tokens and their pools
        part = cache.export(b)
        np.testing.assert_array_equal(part.latent[:ell], whole.latent[:ell])
        np.testing.assert_array_equal(part.pooled[:ell // 4], whole.pooled[:ell // 4])
    # Truncating into a shared page is refused (it would be written), eagerly and under jit.
    rows = np.arange(ROWS) == 1
    with pytest.raises(ValueError, match=r"row 1: n_tokens\[1\] = 10 takes the sequence from 22 to 12 "
                                         r"tokens, inside page 1 \(tokens 8 \.\. 15\), which it shares"):
        cache.rollback(rows, np.array([0, 10, 0, 0, 0], np.int32))
    got = TRUNCATE(cache, jnp.asarray(rows), jnp.array([0, 12, 0, 0, 0]))
    assert int(got.status[1]) == pg.BAD_ROLLBACK and int(got.lengths[1]) == 22
    got.pages.check()
    # To the page boundary: allowed; the row lets go of its own page only.
    back = TRUNCATE(cache, jnp.asarray(rows), jnp.array([0, 16, 0, 0, 0]))
    back.pages.check()
    assert int(back.lengths[1]) == 16 and np.asarray(back.pages.refs)[:2].tolist() == [5, 5]
    # Releasing the source: the shared pages lose one holder each; its own pages go back.
    rel = RELEASE(back, jnp.arange(ROWS) == 0)
    rel.pages.check()
    assert np.asarray(rel.pages.refs)[:2].tolist() == [4, 4]
    # Every fork but one released: the last holder owns the pages again.
    last = RELEASE(rel, jnp.arange(ROWS) < ROWS - 1)
    last.pages.check()
    assert np.asarray(last.pages.owner)[:2].tolist() == [ROWS - 1] * 2
    empty = RELEASE(last, jnp.ones(ROWS, bool))
    empty.pages.check()
    assert int(empty.pages.n_free) == 16 and not np.asarray(empty.pages.refs).any()


def _leaves(cache):
    return [np.asarray(a) for a in jax.tree.leaves(cache)]


def test_bad_forks_are_refused_and_change_nothing(cfg):
    cache = gd.init_paged_cache(cfg, 4, 6, PAGE)  # max_rollback 1: a stage of KP = 4 entries
    pages, _ = jax.jit(lambda t, n: t.reserve(n))(cache.pages, jnp.array([18, 0, 9, 0]))  # a prefill's bookkeeping
    cache = cache.replace(pages=pages)  # lengths 18, 0, 9, 0: 1 page free
    before = _leaves(cache)
    bad = [
        ((1,), (3,), (4,), r"fork 0 \(row 1 -> row 3, 4 tokens\): row 1 holds no sequence \(length 0"),
        ((0,), (2,), (4,), r"row 2 is in use \(holds 9 tokens\)"),
        ((0,), (1,), (19,), r"lengths\[0\] = 19 but row 0 holds 18 tokens \(1 <= lengths <= 18\)"),
        ((0,), (1,), (0,), r"lengths\[0\] = 0 but row 0 holds 18"),
        ((0,), (0,), (4,), "a row is both a source and a destination"),
        ((0, 1), (1, 3), (4, 4), "a row is both a source and a destination"),
        ((0, 0), (1, 1), (4, 8), r"row 1 is the destination of forks \[0, 1\]"),
        ((0,), (7,), (4,), r"dst_rows\[0\] = 7 must be rows 0 \.\. 3"),
        # 18 tokens, stage 14 .. 17: a prefix of 13 needs position 12
        ((0,), (1,), (13,), r"incomplete pool starts at position 12, but row 0's stage holds the raw keys "
                            r"of positions 14 \.\. 17 only"),
        ((0, 0, 0), (1, 3, 2), (3, 2, 1), "row 2 is in use"),
    ]
    for src, dst, n, msg in bad:
        with pytest.raises(ValueError, match=msg):
            cache.fork(np.array(src), np.array(dst), np.array(n))
        for a, b in zip(_leaves(cache), before, strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="fork lengths must be a one-dimensional integer array"):
        cache.fork(np.array([0]), np.array([1]), np.array([4.0]))
    # Two partly filled last pages to copy, one page free: the second fork (by row order) is refused.
    with pytest.raises(ValueError, match=r"fork 0 \(into row 3, 17 tokens\) needs 1 fresh page .* only 1 "
                                         "are free, taken by the forks into rows before it"):
        cache.fork(np.array([0, 0]), np.array([3, 1]), np.array([17, 17]))

    # Under jit: the refused rows are untouched, status says why, the others fork.
    got = jax.jit(lambda c, s, d, n: c.fork(s, d, n))(
        cache, jnp.array([0, 0]), jnp.array([1, 3]), jnp.array([13, 16]))
    assert np.asarray(got.status).tolist() == [pg.OK, pg.BAD_FORK, pg.OK, pg.OK]
    assert np.asarray(got.lengths).tolist() == [18, 0, 9, 16]
    got.pages.check()
    np.testing.assert_array_equal(np.asarray(got.block_table)[1], -1)
    # Across data shards: refused eagerly and under jit.
    sharded = gd.init_paged_cache(cfg, 4, 8, PAGE, shards=2, dtype=cache.dtype).load(0, cache.export(0))  # 4 pages a shard
    with pytest.raises(ValueError, match="row 0 is in data shard 0 and row 2 in data shard 1"):
        sharded.fork(np.array([0]), np.array([2]), np.array([8]))
    got = jax.jit(lambda c, s, d, n: c.fork(s, d, n))(
        sharded, jnp.array([0, 0]), jnp.array([2, 1]), jnp.array([8, 18]))
    assert np.asarray(got.status).tolist() == [pg.OK, pg.OK, pg.BAD_FORK, pg.OK]
    got.pages.check()
    assert np.asarray(got.lengths).tolist() == [18, 18, 0, 0]


def test_shared_prompt_bytes_in_the_docs():
    """16 sequences sharing a 4,096-token prompt at GLM-5.3-Flash dims hold its 64 pages
    once: the bytes ``docs/serving.md`` states (shapes only: nothing is allocated)."""
    flash = gd.DsaConfig.glm53_flash()
    for dtype, want in ((jnp.bfloat16, 4_456_448), ("fp8", 2_248_704)):
        cache = jax.eval_shape(lambda: gd.init_paged_cache(flash, 16, 16 * 64, 64, dtype=dtype))
        shared, unshared = shared_prefix_bytes(cache, 16, 4096)
        assert (shared, unshared) == (want, 16 * want)
