"""Page bookkeeping (``glm5_dsa_jax.cache.pages``): the invariants under any schedule of
reservations and releases, against a plain Python model of the allocator."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from glm5_dsa_jax.cache.pages import NO_FREE_PAGES, OK, TOO_LONG, init_page_table


class Model:
    """The allocator in plain Python: rows in order, all or nothing, a LIFO free list."""

    def __init__(self, max_seqs, num_pages, page_size, pages_per_seq):
        self.ps, self.pps = page_size, pages_per_seq
        self.free = list(range(num_pages - 1, -1, -1))
        self.pages = [[] for _ in range(max_seqs)]
        self.lengths = [0] * max_seqs

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
            self.lengths[b] = new
            status.append(OK)
        return status

    def release(self, rows):
        for b, r in enumerate(rows):
            if r:
                self.free.extend(self.pages[b])
                self.pages[b], self.lengths[b] = [], 0


def _owned(table, b):
    row = np.asarray(table.block_table)[b]
    return row[row >= 0].tolist()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.lists(st.integers(0, 40), min_size=4, max_size=4)),
        st.tuples(st.just("release"), st.lists(st.booleans(), min_size=4, max_size=4)),
    ),
    min_size=1, max_size=12,
)


#: Built once: one compilation per table geometry, shared by the examples that draw it.
RESERVE = jax.jit(lambda t, n: t.reserve(n))
RELEASE = jax.jit(lambda t, r: t.release(r))


@settings(max_examples=40, deadline=None)
@given(ops=ops, num_pages=st.integers(1, 12), page_size=st.sampled_from([1, 4, 8]),
       pages_per_seq=st.integers(1, 6))
def test_schedule_matches_model(ops, num_pages, page_size, pages_per_seq):
    table = init_page_table(4, num_pages, page_size, pages_per_seq)
    model = Model(4, num_pages, page_size, pages_per_seq)
    for kind, arg in ops:
        if kind == "reserve":
            table, status = RESERVE(table, jnp.asarray(arg, jnp.int32))
            assert np.asarray(status).tolist() == model.reserve(arg)
        else:
            table = RELEASE(table, jnp.asarray(arg))
            model.release(arg)
        table.check()
        assert np.asarray(table.lengths).tolist() == model.lengths
        for b in range(4):
            assert _owned(table, b) == model.pages[b]
        assert int(table.n_free) == len(model.free)


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


def test_check_finds_a_page_held_twice():
    t = init_page_table(2, num_pages=4, page_size=4)
    t, _ = t.reserve(jnp.asarray([4, 4]))
    bt = t.block_table.at[1, 0].set(t.block_table[0, 0])
    with pytest.raises(ValueError, match="held twice"):
        t.replace(block_table=bt).check()
