"""Page bookkeeping (``glm5_dsa_jax.cache.pages``): the invariants under any schedule of
reservations, releases, truncations and forks, against a plain Python model of the allocator
(reference counts, the free stack's exact order, ``check()`` after every step); a table broken
by its caller (each rule of ``ROW_FAULTS`` / ``STACK_FAULTS``) is refused by ``check``
naming the row, and under jit ``reserve`` gives that row (or, for a broken free stack,
every row of the shard) ``BAD_TABLE`` and takes nothing; ``release`` repairs a broken row.
(The layer-level probes: ``tests/test_paged.py``.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from glm5_dsa_jax.cache.pages import (
    BAD_FORK, BAD_ROLLBACK, BAD_TABLE, NO_FREE_PAGES, OK, SHARED, TOO_LONG, init_page_table,
)


class Model:
    """The allocator in plain Python: rows in order, all or nothing, a LIFO free list, a
    reference count per page (a page goes back when its last holder lets go)."""

    def __init__(self, max_seqs, num_pages, page_size, pages_per_seq):
        self.ps, self.pps = page_size, pages_per_seq
        self.free = list(range(num_pages - 1, -1, -1))
        self.pages = [[] for _ in range(max_seqs)]
        self.lengths = [0] * max_seqs
        self.refs = [0] * num_pages

    def _let_go(self, page):
        self.refs[page] -= 1
        assert self.refs[page] >= 0
        if self.refs[page] == 0:
            self.free.append(page)

    def reserve(self, n_new):
        status = []
        for b, n in enumerate(n_new):
            new = self.lengths[b] + n
            if new > self.pps * self.ps:
                status.append(TOO_LONG)
                continue
            need = -(-new // self.ps) - len(self.pages[b])
            if need > len(self.free):
                status.append(NO_FREE_PAGES)
                continue
            for _ in range(need):
                self.pages[b].append(self.free.pop())
                self.refs[self.pages[b][-1]] = 1
            self.lengths[b] = new
            status.append(OK)
        return status

    def release(self, rows):
        for b, r in enumerate(rows):
            if r:
                for p in self.pages[b]:
                    self._let_go(p)
                self.pages[b], self.lengths[b] = [], 0

    def truncate(self, rows, lengths):
        """Pages let go in reverse order of taking: the last row's last page first."""
        status = []
        for b, (r, n) in enumerate(zip(rows, lengths)):
            inside = n % self.ps and n // self.ps < len(self.pages[b]) and self.refs[self.pages[b][n // self.ps]] > 1
            status.append(BAD_ROLLBACK if r and (n > self.lengths[b] or inside) else OK)
        for b in reversed(range(len(rows))):
            if rows[b] and status[b] == OK:
                keep = -(-lengths[b] // self.ps)
                for p in reversed(self.pages[b][keep:]):
                    self._let_go(p)
                self.pages[b], self.lengths[b] = self.pages[b][:keep], lengths[b]
        return status

    def fork(self, src, lengths):
        """Row b starts as the first lengths[b] tokens of row src[b] (-1: none): complete
        pages shared, a partial last one fresh (rows in order, all or nothing)."""
        status = [OK] * len(src)
        for b, (s, n) in enumerate(zip(src, lengths)):
            if s < 0:
                continue
            if (self.lengths[s] == 0 or self.lengths[b] or b in src or src[s] >= 0
                    or not 0 < n <= self.lengths[s]):
                status[b] = BAD_FORK
            elif n % self.ps and not self.free:
                status[b] = NO_FREE_PAGES
            else:
                self.pages[b] = self.pages[s][:n // self.ps]
                for p in self.pages[b]:
                    self.refs[p] += 1
                if n % self.ps:
                    self.pages[b].append(self.free.pop())
                    self.refs[self.pages[b][-1]] = 1
                self.lengths[b] = n
        return status


def _owned(table, b):
    row = np.asarray(table.block_table)[b]
    return row[row >= 0].tolist()


four = dict(min_size=4, max_size=4)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.lists(st.integers(0, 40), **four)),
        st.tuples(st.just("release"), st.lists(st.booleans(), **four)),
        st.tuples(st.just("truncate"), st.tuples(st.lists(st.booleans(), **four),
                                                 st.lists(st.integers(0, 40), **four))),
        st.tuples(st.just("fork"), st.tuples(st.lists(st.integers(-1, 3), **four),
                                             st.lists(st.integers(0, 40), **four))),
    ),
    min_size=1, max_size=14,
)


#: Built once: one compilation per table geometry, shared by the examples that draw it.
RESERVE = jax.jit(lambda t, n: t.reserve(n))
RELEASE = jax.jit(lambda t, r: t.release(r))
TRUNCATE = jax.jit(lambda t, r, n: t.truncate(r, n))
FORK = jax.jit(lambda t, s, n: t.fork(s, n)[:2])


def assert_matches(table, model):
    """Lengths, every row's pages, the reference counts, owners and the free stack (its exact
    order) equal the model's; ``check()`` finds nothing."""
    table.check()
    assert np.asarray(table.lengths).tolist() == model.lengths
    for b in range(len(model.pages)):
        assert _owned(table, b) == model.pages[b]
    refs, owner = np.asarray(table.refs), np.asarray(table.owner)
    assert refs.tolist() == model.refs and (refs >= 0).all()
    for p, r in enumerate(model.refs):
        holders = [b for b, pages in enumerate(model.pages) if p in pages]
        assert owner[p] == (-1 if r == 0 else holders[0] if r == 1 else SHARED)
    assert int(table.n_free) == len(model.free)
    assert np.asarray(table.free)[:len(model.free)].tolist() == model.free


#: ``(num_pages, page_size, pages_per_seq)``: one page, pages of one token, more pages than a
#: row may take and fewer, ... A few geometries, so the examples share compiled programs.
GEOMETRIES = [(1, 1, 1), (3, 4, 2), (5, 1, 6), (8, 4, 3), (12, 8, 6), (7, 8, 1)]


@settings(max_examples=40, deadline=None)
@given(ops=ops, geometry=st.sampled_from(GEOMETRIES))
@pytest.mark.slow
def test_schedule_matches_model(ops, geometry):
    num_pages, page_size, pages_per_seq = geometry
    table = init_page_table(4, num_pages, page_size, pages_per_seq)
    model = Model(4, num_pages, page_size, pages_per_seq)
    for kind, arg in ops:
        if kind == "reserve":
            table, status = RESERVE(table, jnp.asarray(arg, jnp.int32))
            assert np.asarray(status).tolist() == model.reserve(arg)
        elif kind == "release":
            table = RELEASE(table, jnp.asarray(arg))
            model.release(arg)
        elif kind == "truncate":
            table, status = TRUNCATE(table, jnp.asarray(arg[0]), jnp.asarray(arg[1], jnp.int32))
            assert np.asarray(status).tolist() == model.truncate(*arg)
        else:
            table, status = FORK(table, jnp.asarray(arg[0], jnp.int32), jnp.asarray(arg[1], jnp.int32))
            assert np.asarray(status).tolist() == model.fork(*arg)
        assert_matches(table, model)


def test_failed_row_takes_nothing_and_later_rows_still_fit():
    t = init_page_table(3, num_pages=4, page_size=4, pages_per_seq=32)
    t, status = t.reserve(jnp.asarray([8, 100, 4]))  # row 1 needs 25 pages
    assert status.tolist() == [OK, NO_FREE_PAGES, OK]
    assert t.lengths.tolist() == [8, 0, 4] and int(t.n_free) == 1
    t.check()


def test_too_long_and_release_of_empty_row():
    t = init_page_table(2, num_pages=8, page_size=4, pages_per_seq=2)
    t, status = t.reserve(jnp.asarray([9, 8]))
    assert status.tolist() == [TOO_LONG, OK]
    before = jax.tree.map(np.asarray, t)
    t = t.release(jnp.asarray([True, False]))  # row 0 holds nothing
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, t), before)


def test_token_slots():
    t = init_page_table(2, num_pages=8, page_size=4)
    t, _ = t.reserve(jnp.asarray([3, 6]))
    page, off = t.token_slots(jnp.asarray([[0, 2, -1], [3, 4, 5]]))
    assert page.tolist() == [[0, 0, -1], [1, 2, 2]] and off[1].tolist() == [3, 0, 1]


@pytest.mark.parametrize("field,value,match", [
    ("block_table", [[0, 9], [-1, -1]], r"block_table\[0, 1\] = 9 is out of range"),
    ("lengths", [5, 0], r"block_table row 0 holds 1 pages for length 5"),
])
def test_check_names_the_broken_entry(field, value, match):
    t = init_page_table(2, num_pages=4, page_size=4, pages_per_seq=2)
    t, _ = t.reserve(jnp.asarray([4, 0]))
    with pytest.raises(ValueError, match=match):
        t.replace(**{field: jnp.asarray(value, jnp.int32)}).check()


def _three_rows(shards=1):
    """Three rows per shard of 4 tokens (one page each) on 4-token pages, 7 pages a shard."""
    t = init_page_table(3 * shards, num_pages=7 * shards, page_size=4, pages_per_seq=3, shards=shards)
    t, status = RESERVE(t, jnp.full((3 * shards,), 4, jnp.int32))
    assert (np.asarray(status) == OK).all()
    return t


def _set(t, field, index, value):
    return t.replace(**{field: getattr(t, field).at[index].set(value)})


#: Corruptions of ``_three_rows()`` (rows 0, 1, 2 own pages 0, 1, 2; pages 3 .. 6 free):
#: ``(field, index, value, rows refused under jit, check's message)``.
BROKEN = [
    ("lengths", 1, -5, [1], r"row 1: lengths\[1\] = -5 outside \[0, max_length=12\]"),
    ("lengths", 1, 30, [1], r"row 1: lengths\[1\] = 30 outside"),
    ("lengths", 1, 8, [1], r"row 1: block_table row 1 holds 1 pages for length 8: it needs exactly its first 2"),
    ("block_table", (1, 0), 9, [1], r"row 1: block_table\[1, 0\] = 9 is out of range: page ids are 0 .. 6"),
    ("block_table", (1, 0), 0, [1], r"row 1: block_table\[1, 0\] = page 0, which is row 0's, not row 1's"),
    ("block_table", (1, 0), 5, [1], r"row 1: block_table\[1, 0\] = page 5, which is free"),
    ("owner", 1, 0, [0, 1], r"row 0: owner names 2 page\(s\) of row 0 \(\[0, 1\]\) but lengths\[0\] = 4 needs 1"),
    ("n_free", (), 50, [0, 1, 2], r"n_free = 50 outside \[0, 7\] \(every row of the shard is refused\)"),
    ("free", 3, 4, [0, 1, 2], r"page 4 is on the free stack twice"),
    ("free", 0, 2, [0, 1, 2], r"free\[0\] = page 2 is on the free stack but owned by row 2"),
    ("free", 0, -3, [0, 1, 2], r"free\[0\] = -3 is out of range"),
    ("n_free", (), 3, [0, 1, 2], r"n_free = 3 but 4 pages are owned by no row"),
    ("owner", 6, 7, [0, 1, 2], r"owner\[6\] = 7 names no row"),
]


@pytest.mark.parametrize("field,index,value,refused,match", BROKEN)
def test_a_broken_table_is_refused_naming_the_row_and_under_jit_takes_nothing(field, index, value, refused,
                                                                              match):
    t = _set(_three_rows(), field, index, value)
    with pytest.raises(ValueError, match=match):
        t.check()
    before = jax.tree.map(np.asarray, t)
    after, status = RESERVE(t, jnp.full((3,), 4, jnp.int32))
    want = [BAD_TABLE if b in refused else OK for b in range(3)]
    assert np.asarray(status).tolist() == want
    a = jax.tree.map(np.asarray, after)
    for b in refused:  # a refused row keeps its length and its block-table row
        assert a.lengths[b] == before.lengths[b]
        np.testing.assert_array_equal(a.block_table[b], before.block_table[b])
    if len(refused) == 3:  # a broken stack: nothing is taken at all
        jax.tree.map(np.testing.assert_array_equal, a, before)
    for b in set(range(3)) - set(refused):  # the others grow from a page no other row holds
        assert a.lengths[b] == 8 and a.owner[a.block_table[b, 1]] == b


def test_two_rows_naming_one_page_the_owner_goes_on_and_release_repairs_the_other():
    t = _set(_three_rows(), "block_table", (1, 0), 0)  # row 1 names row 0's page; its page 1 is lost
    after, status = RESERVE(t, jnp.asarray([4, 4, 0], jnp.int32))
    assert np.asarray(status).tolist() == [OK, BAD_TABLE, OK]
    assert np.asarray(after.block_table)[0].tolist() == [0, 3, -1]  # row 0 took the top free page
    fixed = RELEASE(after, jnp.asarray([False, True, False]))
    fixed.check()  # row 1's own page (1) went back, row 0's page stayed row 0's
    assert int(fixed.n_free) == 4 and np.asarray(fixed.owner)[[0, 1]].tolist() == [0, -1]
    assert sorted(np.asarray(fixed.free)[:4].tolist()) == [1, 4, 5, 6]


def test_a_sharded_table_is_validated_per_shard():
    t = _three_rows(shards=2)
    t.check()
    bad = t.replace(n_free=t.n_free.at[1].set(50))  # shard 1's stack: its rows 3, 4, 5 only
    with pytest.raises(ValueError, match=r"shard 1 \(rows 3 .. 5, local page ids\): n_free = 50"):
        bad.check()
    _, status = bad.reserve(jnp.full((6,), 4, jnp.int32))
    assert np.asarray(status).tolist() == [OK] * 3 + [BAD_TABLE] * 3
    bad = _set(t, "block_table", (4, 0), 0)  # shard 1's row 4 names its shard's page 0 (row 3's)
    with pytest.raises(ValueError, match=r"shard 1 .*row 4: block_table\[4, 0\] = page 0, which is row 3's"):
        bad.check()
    _, status = bad.reserve(jnp.full((6,), 4, jnp.int32))
    assert np.asarray(status).tolist() == [OK] * 4 + [BAD_TABLE, OK]


def _forked():
    """Row 0 holds 8 tokens (pages 0, 1 of 4 tokens); row 1 was forked from its first 4: page
    0 shared (refs 2, owner SHARED); pages 2 .. 5 free."""
    t = init_page_table(3, num_pages=6, page_size=4, pages_per_seq=3)
    t, _ = RESERVE(t, jnp.asarray([8, 0, 0], jnp.int32))
    t, status = FORK(t, jnp.asarray([-1, 0, -1], jnp.int32), jnp.asarray([0, 4, 0], jnp.int32))
    assert np.asarray(status).tolist() == [OK] * 3
    t.check()
    assert np.asarray(t.refs)[:2].tolist() == [2, 1] and int(np.asarray(t.owner)[0]) == SHARED
    return t


#: Corruptions of ``_forked()``'s reference counts: ``(field, index, value, rows refused, message)``.
BROKEN_REFS = [
    ("refs", 0, 3, [0, 1], r"row 0: block_table\[0, 0\] = shared page 0 has refs\[0\] = 3 but 2 block-table"),
    ("lengths", 1, 3, [1], r"row 1: block_table\[1, 0\] = shared page 0 \(refs 2\) holds tokens 0 \.\. 3 but "
                           r"lengths\[1\] = 3: a shared page must be complete"),
    ("owner", 0, 0, [0, 1, 2], r"page 0: refs\[0\] = 2, owner\[0\] = 0, named by 2 block-table entries"),
    ("refs", 1, -1, [0, 1, 2], r"page 1: refs\[1\] = -1"),
]


@pytest.mark.parametrize("field,index,value,refused,match", BROKEN_REFS)
def test_broken_reference_counts_are_refused(field, index, value, refused, match):
    t = _set(_forked(), field, index, value)
    with pytest.raises(ValueError, match=match):
        t.check()
    _, status = RESERVE(t, jnp.asarray([1, 1, 1], jnp.int32))
    assert [b for b, s in enumerate(np.asarray(status).tolist()) if s == BAD_TABLE] == refused


def test_a_page_named_twice_in_a_row_is_refused_owned_or_shared():
    """The twice rule without a sort of the block table (issue 48): a page the row owns is
    named twice when it has two holders; a shared page (other rows hold it too) is found by
    the sort that only a table with a shared page runs. Here the twice rule is the only one
    broken by the shared page (its refs and the row's page count agree)."""
    t = _set(_set(_three_rows(), "block_table", (0, 1), 0), "lengths", 0, 8)  # row 0: page 0 twice
    with pytest.raises(ValueError, match=r"row 0: block_table\[0, 0\] = page 0 is named twice in the row"):
        t.check()
    _, status = RESERVE(t, jnp.asarray([1, 1, 1], jnp.int32))
    assert np.asarray(status).tolist() == [BAD_TABLE, OK, OK]
    t = _forked()  # row 1 names shared page 0 at slots 0 and 1, refs 3 = the entries naming it
    t = _set(_set(_set(t, "block_table", (1, 1), 0), "lengths", 1, 8), "refs", 0, 3)
    with pytest.raises(ValueError, match=r"row 1: block_table\[1, 0\] = page 0 is named twice in the row"):
        t.check()
    _, status = RESERVE(t, jnp.asarray([1, 1, 1], jnp.int32))
    assert np.asarray(status).tolist() == [OK, BAD_TABLE, OK]
