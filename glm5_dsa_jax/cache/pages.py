"""Page bookkeeping of a paged decode cache: block tables, lengths and the free pages.

A paged cache stores every sequence's tokens in fixed-size pages drawn from one pool
shared by all sequences (vLLM's and SGLang's layout). This module holds only the
bookkeeping, as a pytree of small int32 arrays, so it can run inside a jitted step; the
page pools themselves (latent rows, pooled indexer keys) live with the cache.

Invariants (each function keeps them; ``check`` verifies them on concrete values):

* ``block_table[b, j]`` is the page holding tokens ``[j * page_size, (j + 1) * page_size)``
  of sequence ``b``, or ``-1``; the first ``pages_needed(lengths[b])`` entries of a row
  are pages and the rest are ``-1``.
* Every page is either owned by exactly one (row, slot) of the block table or on the free
  stack ``free[:n_free]``, never both, never twice. ``free[n_free:]`` is unspecified.
* ``owner[p]`` is the row that owns page ``p`` (``-1``: free): the record of who took it,
  written only by ``reserve``, ``release`` and ``truncate``. A row's pages are exactly the pages whose
  owner it is, and the free stack exactly the pages no row owns.
* ``lengths[b]`` is the number of tokens sequence ``b`` holds (its next position).

**A table handed in is validated, not trusted** (``faults``; a caller may have written
any field). Every ``reserve`` checks the table first and a row whose bookkeeping is
broken (``ROW_FAULTS``: its length, a block-table entry out of range or not owned by it,
a page twice in the row, an owner record that names more or fewer pages than its length
needs) gets status ``BAD_TABLE`` and takes, writes and reads nothing; a broken free stack
(``STACK_FAULTS``: ``n_free`` out of range, an entry out of range, twice, owned by a row,
or a page neither owned nor free) affects every row of its shard, so every row of that
shard gets ``BAD_TABLE`` and nothing is taken at all. ``check`` raises the same faults
eagerly as one ``ValueError`` naming every broken row (field, slot, page) and shard.
Why an owner record: when two rows name one page, the table alone cannot say whose it
is; the record can, so the row that names a page it does not own is refused and the
owner goes on, untouched. Whatever a caller writes, a page is read or written in a call
only by a row that names it *and* owns it, so no two rows share a page. (A table whose
block tables, lengths and owner record are all rewritten alike, e.g. two rows swapped
wholesale, is a valid table: no check can tell, only not writing the table can.)

**Shards** (data parallelism, ``glm5_dsa_jax.parallel.placement``): a table may be ``shards``
independent tables side by side, one per data shard of a mesh. Rows ``k * m .. (k+1) * m -
1`` (``m = max_seqs / shards``) and pages ``k * n .. (k+1) * n - 1`` of the pools (``n =
num_pages / shards``) are shard ``k``'s; ``free[k * n: (k+1) * n]`` is its stack,
``owner[k * n: (k+1) * n]`` its owner record (rows local to the shard, ``0 .. m - 1``) and
``n_free[k]`` its top (``n_free`` is ``[shards]``; a scalar ``n_free`` is one shard). Page
ids in the block table and on a stack are *local* to the shard (``0 .. n - 1``), so a
shard's rows never name another shard's page and a step run per shard reads only its own
pools. ``reserve`` / ``release`` / ``truncate`` / ``check`` run per shard (rows take pages in row order
within their shard); the invariants above hold per shard.

Why a stack: taking ``n`` pages is a slice of its top and returning them a write of the
top, both without a data-dependent shape, so one compiled step serves every step whatever
sequences join or leave. Why rows take pages in row order, each all or nothing: a row
that cannot get all the pages its chunk needs gets none and writes nothing (``status``
says why), so a failure never takes pages from, or writes into, another sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from glm5_dsa_jax.parallel.placement import put

__all__ = ["PageTable", "init_page_table", "OK", "NO_FREE_PAGES", "TOO_LONG", "BAD_TABLE",
           "BAD_ROLLBACK", "STATUS_NAMES", "release_mask", "ROW_FAULTS", "STACK_FAULTS"]

#: ``status`` values of ``PageTable.reserve``, one per row. ``BAD_TABLE``: the row's own
#: bookkeeping or its shard's free stack is broken (``PageTable.faults``); the row took,
#: wrote and read nothing. ``BAD_ROLLBACK`` (of ``truncate`` and ``PagedCache.rollback``): the
#: row was asked to drop more tokens than it holds, or more than its stage can restore; it
#: was left untouched.
OK, NO_FREE_PAGES, TOO_LONG, BAD_TABLE, BAD_ROLLBACK = 0, 1, 2, 3, 4
STATUS_NAMES = {OK: "ok", NO_FREE_PAGES: "not enough free pages", TOO_LONG: "past pages_per_seq * page_size",
                BAD_TABLE: "inconsistent page table (PageTable.check names the fault)",
                BAD_ROLLBACK: "rollback past the sequence's length or past what its stage can restore"}

#: Per-row faults of ``PageTable.faults`` (code -> rule), the first broken one reported.
ROW_LENGTH, ROW_PAGE_ID, ROW_NOT_OWNED, ROW_TWICE, ROW_OWNED_COUNT = 1, 2, 3, 4, 5
ROW_FAULTS = {
    ROW_LENGTH: "lengths[b] outside [0, max_length]",
    ROW_PAGE_ID: "a block-table entry out of range, or not exactly the first pages_needed(lengths[b]) set",
    ROW_NOT_OWNED: "a block-table entry names a page the row does not own (owner[page] != b)",
    ROW_TWICE: "a page named twice in the row",
    ROW_OWNED_COUNT: "owner names more or fewer pages of the row than its length needs",
}
#: Per-shard faults of the free stack (code -> rule): they refuse every row of the shard.
STACK_N_FREE, STACK_OWNER, STACK_ID, STACK_OWNED, STACK_TWICE, STACK_LOST = 1, 2, 3, 4, 5, 6
STACK_FAULTS = {
    STACK_N_FREE: "n_free outside [0, pages of the shard]",
    STACK_OWNER: "an owner entry names no row",
    STACK_ID: "a free-stack entry out of range",
    STACK_OWNED: "a page both on the free stack and owned by a row",
    STACK_TWICE: "a page twice on the free stack",
    STACK_LOST: "n_free differs from the number of pages no row owns",
}


def _first(flags, axis=-1):
    """``(any, index of the first True)`` along ``axis``."""
    return flags.any(axis=axis), jnp.argmax(flags, axis=axis).astype(jnp.int32)


def _fault_code(*flags):
    """The code (1-based position) of the first of ``flags`` that holds, 0 for none."""
    code = jnp.zeros(jnp.shape(flags[0]), jnp.int32)
    for i, f in reversed(list(enumerate(flags, 1))):
        code = jnp.where(f, i, code)
    return code


def _take_pages(left, row):
    """One row's turn of ``reserve``: it takes its pages if they are all free. Module
    level, so jax's trace cache hits and an eager step compiles no new ``scan``."""
    need_b, bad_b = row
    ok_b = ~bad_b & (need_b <= left)
    return left - jnp.where(ok_b, need_b, 0), ok_b


def _placed_like(a, ref):
    """``a`` (``[max_seqs]`` rows) placed as ``ref`` (the table's ``lengths``): ``vmap`` over
    the shard axis wants every mapped input split alike under ``Explicit`` mesh axes."""
    if isinstance(ref, jax.core.Tracer):
        sh = getattr(jax.typeof(ref), "sharding", None)
        if sh is None or sh.mesh.empty or jax.sharding.AxisType.Explicit not in sh.mesh.axis_types:
            return a
        return jax.sharding.reshard(a, sh)
    if isinstance(getattr(ref, "sharding", None), jax.sharding.NamedSharding):
        return put(a, ref.sharding)
    return a


@struct.dataclass
class PageTable:
    """Block tables, lengths and free pages of ``max_seqs`` sequences (a pytree)."""

    block_table: jax.Array  # [max_seqs, pages_per_seq] int32, -1 = no page
    lengths: jax.Array  # [max_seqs] int32, tokens held
    free: jax.Array  # [num_pages] int32, free page ids in free[:n_free]
    n_free: jax.Array  # [] int32
    owner: jax.Array  # [num_pages] int32, row owning each page, -1 = free (module doc)
    page_size: int = struct.field(pytree_node=False, default=64)

    @property
    def max_seqs(self) -> int:
        return self.block_table.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.block_table.shape[1]

    @property
    def num_pages(self) -> int:
        return self.free.shape[0]

    @property
    def max_length(self) -> int:
        """Most tokens one sequence can hold."""
        return self.pages_per_seq * self.page_size

    @property
    def shards(self) -> int:
        """Independent sub-tables (see the module doc): ``n_free``'s length, 1 for a scalar."""
        return 1 if self.n_free.ndim == 0 else self.n_free.shape[0]

    @property
    def pages_per_shard(self) -> int:
        """Pages of one shard's pools (page ids in the table are below this)."""
        return self.num_pages // self.shards

    def _per_shard(self, fn, *rows):
        """``fn(table, *rows)`` of every shard's one-shard table (``vmap``), whose first
        output, a table, is put back side by side; the other outputs get their rows back
        in row order. ``rows`` are ``[max_seqs]`` arrays."""
        k = self.shards
        m = self.max_seqs // k
        local = self.replace(block_table=self.block_table.reshape(k, m, -1),
                             lengths=self.lengths.reshape(k, m), free=self.free.reshape(k, -1),
                             owner=self.owner.reshape(k, -1))
        rows = (_placed_like(jnp.asarray(r), self.lengths).reshape(k, m) for r in rows)
        table, *rest = jax.vmap(fn)(local, *rows)
        table = table.replace(block_table=table.block_table.reshape(self.max_seqs, -1),
                              lengths=table.lengths.reshape(-1), free=table.free.reshape(-1),
                              owner=table.owner.reshape(-1))
        return (table, *(r.reshape(-1) for r in rest))

    def shard(self, k: int) -> "PageTable":
        """Shard ``k``'s own one-shard table, as host (numpy) arrays: for checks, tests and
        reports (page ids are local to the shard)."""
        m, n = self.max_seqs // self.shards, self.pages_per_shard
        return self.replace(block_table=np.asarray(self.block_table)[k * m:(k + 1) * m],
                            lengths=np.asarray(self.lengths)[k * m:(k + 1) * m],
                            free=np.asarray(self.free)[k * n:(k + 1) * n],
                            n_free=np.asarray(self.n_free).reshape(-1)[k],
                            owner=np.asarray(self.owner)[k * n:(k + 1) * n])

    def pages_needed(self, lengths: jax.Array) -> jax.Array:
        """Pages that hold ``lengths`` tokens."""
        return (lengths + self.page_size - 1) // self.page_size

    def reserve(self, n_new: jax.Array) -> tuple["PageTable", jax.Array]:
        """Make room for ``n_new[b]`` more tokens in each row: ``(table, status)``.

        The table is validated first (``faults``): a row whose bookkeeping is broken, and
        every row of a shard whose free stack is broken, gets ``BAD_TABLE`` and takes
        nothing. Then rows take pages from the top of the free stack in row order. A row
        whose new length passes ``max_length`` (``TOO_LONG``) or whose pages are not all
        free after the rows before it took theirs (``NO_FREE_PAGES``) takes nothing and
        keeps its length; every other row's length grows by ``n_new[b]``. ``status`` is
        ``[max_seqs]`` int32. Positions of the new tokens are ``old lengths[b] + 0 ..
        n_new[b] - 1``.
        """
        n_new = jnp.asarray(n_new, jnp.int32)
        if self.shards > 1:
            return self._per_shard(PageTable.reserve, n_new)
        row_fault, _, stack_fault, _ = self._faults()
        bad = (row_fault != 0) | (stack_fault != 0)
        have = self.pages_needed(self.lengths)
        new_len = self.lengths + n_new
        too_long = new_len > self.max_length
        skip = bad | too_long
        need = jnp.where(skip, 0, self.pages_needed(new_len) - have)

        left, ok = jax.lax.scan(_take_pages, self.n_free, (need, skip))
        status = jnp.where(bad, BAD_TABLE, jnp.where(too_long, TOO_LONG, jnp.where(ok, OK, NO_FREE_PAGES)))
        got = jnp.where(ok, need, 0)
        # Pages are popped one by one from the top: the k-th new page of row b is stack
        # entry n_free - 1 - (pages taken by the rows before b) - k.
        start = jnp.cumsum(got) - got
        j = jnp.arange(self.pages_per_seq, dtype=jnp.int32)[None]
        k = j - have[:, None]  # k-th new page of the row
        fresh = (k >= 0) & (k < got[:, None])
        src = self.n_free - 1 - start[:, None] - k
        page = jnp.take(self.free, jnp.clip(src, 0, self.num_pages - 1))
        table = jnp.where(fresh, page, self.block_table)
        lengths = jnp.where(ok, new_len, self.lengths)
        # Every operand derived from the table's own arrays: placed alike on a mesh.
        row = jnp.where(fresh, jnp.arange(self.max_seqs, dtype=jnp.int32)[:, None], -1)
        owner = self.owner.at[jnp.where(fresh, page, self.num_pages)].set(row, mode="drop")
        return (self.replace(block_table=table, lengths=lengths, n_free=left, owner=owner),
                status.astype(jnp.int32))

    def release(self, rows: jax.Array) -> "PageTable":
        """Return the pages of every row where ``rows`` (``[max_seqs]`` bool) to the free
        stack; those rows then hold nothing (length 0, no pages). A row that holds
        nothing is a no-op. Usable inside jit.

        Only pages a released row *owns* (``owner``) go back, each once: first those its
        block table names, in table order, then any it owns but does not name. So
        releasing a row whose bookkeeping was broken (``BAD_TABLE``) repairs it without
        freeing another row's page."""
        rows = jnp.asarray(rows, bool)
        if self.shards > 1:
            return self._per_shard(lambda t, r: (PageTable.release(t, r),), rows)[0]
        n, m = self.num_pages, self.max_seqs
        table = self.block_table
        page = jnp.clip(table, 0, n - 1)
        row = jnp.arange(m, dtype=jnp.int32)[:, None]
        named = rows[:, None] & (table >= 0) & (table < n) & (jnp.take(self.owner, page) == row)
        # A page its row names twice goes back once: keep the first naming of each page.
        flat_idx = jnp.arange(table.size, dtype=jnp.int32).reshape(table.shape)
        first = jnp.full_like(self.owner, table.size).at[jnp.where(named, table, n)].min(
            jnp.where(named, flat_idx, table.size), mode="drop")
        named = named & (jnp.take(first, page) == flat_idx)
        back = jnp.zeros_like(self.owner, bool).at[jnp.where(named, table, n)].set(named, mode="drop")
        in_rows = (self.owner >= 0) & (self.owner < m)
        rest = in_rows & jnp.take(rows, jnp.clip(self.owner, 0, m - 1)) & ~back  # owned, not named
        flat = named.reshape(-1)
        n_named = flat.sum(dtype=jnp.int32)
        pos = jnp.where(flat, self.n_free + jnp.cumsum(flat) - 1, n)  # stack slot of each page
        pos_rest = jnp.where(rest, self.n_free + n_named + jnp.cumsum(rest) - 1, n)
        free = self.free.at[pos].set(table.reshape(-1), mode="drop")
        free = free.at[pos_rest].set(jnp.where(rest, jnp.arange(n, dtype=jnp.int32), -1), mode="drop")
        return self.replace(
            block_table=jnp.where(rows[:, None], -1, table),
            lengths=jnp.where(rows, 0, self.lengths),
            free=free,
            n_free=self.n_free + n_named + rest.sum(dtype=jnp.int32),
            owner=jnp.where(back | rest, -1, self.owner),
        )

    def truncate(self, rows: jax.Array, lengths: jax.Array) -> tuple["PageTable", jax.Array]:
        """Shorten every row where ``rows`` (``[max_seqs]`` bool) to ``lengths[b]`` tokens:
        ``(table, status)``. The row's pages past ``pages_needed(lengths[b])`` go back to the
        free stack *in reverse order of taking* (the rows' last pages deepest, the first
        freed page of the first row on top), so the next ``reserve`` of the same tokens
        takes the same page ids: the table is as if the dropped tokens had never been
        appended. Usable inside jit.

        Validated as ``reserve`` is: a row whose bookkeeping is broken, and every row of a
        shard whose free stack is broken, gets ``BAD_TABLE``; a row asked for a length
        outside ``[0, lengths[b]]`` gets ``BAD_ROLLBACK``; both are left untouched. Other
        rows get ``OK`` (``status`` is ``OK`` for rows not in ``rows``)."""
        rows = jnp.asarray(rows, bool)
        lengths = jnp.asarray(lengths, jnp.int32)
        if self.shards > 1:
            return self._per_shard(PageTable.truncate, rows, lengths)
        row_fault, _, stack_fault, _ = self._faults()
        bad = rows & ((row_fault != 0) | (stack_fault != 0))
        out_of_range = rows & ~bad & ((lengths < 0) | (lengths > self.lengths))
        ok = rows & ~bad & ~out_of_range
        new_len = jnp.where(ok, lengths, self.lengths)
        j = jnp.arange(self.pages_per_seq, dtype=jnp.int32)[None]
        freed = ok[:, None] & (j >= self.pages_needed(new_len)[:, None]) & \
            (j < self.pages_needed(self.lengths)[:, None])
        flat = freed.reshape(-1)
        total = flat.sum(dtype=jnp.int32)
        # Reverse order of taking: the last (row, slot) deepest, the first on top.
        pos = jnp.where(flat, self.n_free + total - jnp.cumsum(flat, dtype=jnp.int32), self.num_pages)
        table = self.block_table
        free = self.free.at[pos].set(table.reshape(-1), mode="drop")
        owner = self.owner.at[jnp.where(flat, table.reshape(-1), self.num_pages)].set(-1, mode="drop")
        status = jnp.where(bad, BAD_TABLE, jnp.where(out_of_range, BAD_ROLLBACK, OK)).astype(jnp.int32)
        return (self.replace(block_table=jnp.where(freed, -1, table), lengths=new_len, free=free,
                             n_free=self.n_free + total, owner=owner), status)

    def token_slots(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(page, offset)`` of each position of ``positions [max_seqs, ...]`` (``-1`` ->
        page ``-1``)."""
        j = jnp.clip(positions // self.page_size, 0, self.pages_per_seq - 1)
        page = jnp.take_along_axis(self.block_table, j.reshape(j.shape[0], -1), axis=1).reshape(j.shape)
        page = jnp.where(positions >= 0, page, -1)
        return page, positions % self.page_size

    def _faults(self):
        """``faults`` of a one-shard table."""
        n, m = self.num_pages, self.max_seqs
        table, lengths, owner, free = self.block_table, self.lengths, self.owner, self.free
        row = jnp.arange(m, dtype=jnp.int32)[:, None]
        j = jnp.arange(self.pages_per_seq, dtype=jnp.int32)[None]
        bad_length = (lengths < 0) | (lengths > self.max_length)
        need = self.pages_needed(jnp.clip(lengths, 0, self.max_length))
        want = j < need[:, None]
        in_range = (table >= 0) & (table < n)
        page = jnp.where(in_range, table, 0)
        mine = want & in_range & (jnp.take(owner, page) == row)
        named = jnp.zeros_like(owner).at[jnp.where(mine, table, n)].add(mine.astype(jnp.int32), mode="drop")
        rules = (jnp.broadcast_to(bad_length[:, None], table.shape),
                 jnp.where(want, ~in_range, table != -1),
                 want & in_range & ~mine,
                 mine & (jnp.take(named, page) > 1))
        is_row = (owner >= 0) & (owner < m)
        owned = jnp.zeros_like(lengths).at[jnp.where(is_row, owner, m)].add(is_row.astype(jnp.int32), mode="drop")
        hits = [_first(r) for r in rules]
        row_fault = _fault_code(*(h[0] for h in hits), owned != need)
        row_at = jnp.zeros((m,), jnp.int32)
        for code, (_, at) in enumerate(hits, 1):
            row_at = jnp.where(row_fault == code, at, row_at)

        n_free = self.n_free
        i = jnp.arange(n, dtype=jnp.int32)
        live = i < jnp.clip(n_free, 0, n)
        id_bad = live & ((free < 0) | (free >= n))
        fpage = jnp.where(live & ~id_bad, free, n)
        on_stack = jnp.zeros_like(owner).at[fpage].add((fpage < n).astype(jnp.int32), mode="drop")
        fpage = jnp.clip(fpage, 0, n - 1)
        ok_id = live & ~id_bad
        stack_rules = (jnp.broadcast_to((n_free < 0) | (n_free > n), (n,)),
                       (owner < -1) | (owner >= m),
                       id_bad,
                       ok_id & (jnp.take(owner, fpage) != -1),
                       ok_id & (jnp.take(on_stack, fpage) > 1),
                       jnp.broadcast_to(n_free != (owner == -1).sum(dtype=jnp.int32), (n,)))
        hits = [_first(r) for r in stack_rules]
        stack_fault = _fault_code(*(h[0] for h in hits))
        stack_at = jnp.zeros((), jnp.int32)
        for code, (_, at) in enumerate(hits, 1):
            stack_at = jnp.where(stack_fault == code, at, stack_at)
        return row_fault, row_at, stack_fault, stack_at

    def faults(self):
        """``(row_fault [max_seqs], row_at [max_seqs], stack_fault [shards], stack_at
        [shards])`` int32: the first broken rule of each row (``ROW_FAULTS``; 0 = none) and
        the block-table slot where it is broken, and of each shard's free stack
        (``STACK_FAULTS``) and the stack entry or page where. One home of every rule:
        ``reserve`` turns them into ``BAD_TABLE`` under jit, ``check`` into a
        ``ValueError``. Usable inside jit; ``O(max_seqs * pages_per_seq + num_pages)``."""
        if self.shards == 1:
            rf, ra, sf, sa = self._faults()
            return rf, ra, sf.reshape(1), sa.reshape(1)
        k = self.shards
        m = self.max_seqs // k
        local = self.replace(block_table=self.block_table.reshape(k, m, -1),
                             lengths=self.lengths.reshape(k, m), free=self.free.reshape(k, -1),
                             owner=self.owner.reshape(k, -1))
        rf, ra, sf, sa = jax.vmap(PageTable._faults)(local)
        return rf.reshape(-1), ra.reshape(-1), sf, sa

    def check(self) -> None:
        """Raise ``ValueError`` unless the invariants of the module doc hold (concrete
        values; an eager paged call runs it on the table it is given, through
        ``PagedCache.check``): one message naming every broken row (its field, slot and
        page) and every broken free stack, with the shard for a sharded table."""
        host = jax.tree.map(np.asarray, self)  # small; and one program whatever the placement
        rf, ra, sf, sa = (np.asarray(a) for a in _FAULTS(host))
        if not rf.any() and not sf.any():
            return
        k, m, n = self.shards, self.max_seqs // self.shards, self.pages_per_shard
        problems = []
        for s in range(k):
            local = self.shard(s)
            where = "" if k == 1 else f"shard {s} (rows {s * m} .. {(s + 1) * m - 1}, local page ids): "
            if sf[s]:
                problems.append(where + _stack_problem(local, int(sf[s]), int(sa[s])) +
                                " (every row of the shard is refused)")
            for b in np.nonzero(rf[s * m:(s + 1) * m])[0]:
                problems.append(where + _row_problem(local, int(b), s * m, int(rf[s * m + b]),
                                                     int(ra[s * m + b])))
        raise ValueError(f"page table is inconsistent (page ids are 0 .. {n - 1}, or -1 for none); "
                         "nothing was written: " + "; ".join(problems))


#: ``PageTable.faults`` compiled once per table geometry (the eager check).
_FAULTS = jax.jit(PageTable.faults)


def _row_problem(t: PageTable, b: int, first_row: int, code: int, j: int) -> str:
    """The message of row ``b`` (local; global ``first_row + b``) of the one-shard host table ``t``."""
    g = first_row + b
    length, entry = int(t.lengths[b]), int(t.block_table[b, j])
    need = -(-max(0, min(length, t.max_length)) // t.page_size)
    if code == ROW_LENGTH:
        return f"row {g}: lengths[{g}] = {length} outside [0, max_length={t.max_length}]"
    if code == ROW_PAGE_ID and not -1 <= entry < t.num_pages:
        return (f"row {g}: block_table[{g}, {j}] = {entry} is out of range: page ids are "
                f"0 .. {t.num_pages - 1}, or -1 for none")
    if code == ROW_PAGE_ID:
        return (f"row {g}: block_table row {g} holds {int((t.block_table[b] >= 0).sum())} pages for "
                f"length {length}: it needs exactly its first {need} entries set")
    if code == ROW_NOT_OWNED:
        o = int(t.owner[entry])
        whose = "free (owner -1)" if o == -1 else f"row {first_row + o}'s" if 0 <= o < t.max_seqs else f"owner {o}'s"
        return (f"row {g}: block_table[{g}, {j}] = page {entry}, which is {whose}, not row {g}'s: "
                "a row reads and writes only the pages it owns")
    if code == ROW_TWICE:
        return f"row {g}: block_table[{g}, {j}] = page {entry} is named twice in the row"
    owned = np.nonzero(np.asarray(t.owner) == b)[0]
    return (f"row {g}: owner names {owned.size} page(s) of row {g} ({owned[:5].tolist()}) but "
            f"lengths[{g}] = {length} needs {need}, named by its block table")


def _stack_problem(t: PageTable, code: int, i: int) -> str:
    """The message of the free stack of the one-shard host table ``t``."""
    n_free, n = int(t.n_free), t.num_pages
    if code == STACK_N_FREE:
        return f"n_free = {n_free} outside [0, {n}]"
    if code == STACK_OWNER:
        return f"owner[{i}] = {int(t.owner[i])} names no row (rows 0 .. {t.max_seqs - 1}, or -1 for free)"
    page = int(t.free[i]) if code in (STACK_ID, STACK_OWNED, STACK_TWICE) else -1
    if code == STACK_ID:
        return f"free[{i}] = {page} is out of range: page ids are 0 .. {n - 1}"
    if code == STACK_OWNED:
        return f"free[{i}] = page {page} is on the free stack but owned by row {int(t.owner[page])}"
    if code == STACK_TWICE:
        return f"page {page} is on the free stack twice (free[:n_free={n_free}])"
    unowned = int((np.asarray(t.owner) == -1).sum())
    return (f"n_free = {n_free} but {unowned} pages are owned by no row: the free stack must "
            "hold exactly the pages no row owns")


def release_mask(rows, max_seqs: int, what: str = "release") -> jax.Array:
    """``rows`` as a ``[max_seqs]`` bool jax array, or ``ValueError`` naming ``rows``: a
    bool array (or list of bools) of that shape only; integer row ids or a 0/1 integer
    mask are refused (see ``PagedCache.release``). Checks dtype and shape only, so it
    runs under jit too. ``what``: the operation the message names (``release``,
    ``rollback``)."""
    arr = rows if isinstance(rows, jax.Array) else np.asarray(rows)
    if arr.dtype != np.bool_:
        raise ValueError(
            f"{what} rows must be a [max_seqs={max_seqs}] bool mask (True = {what} that "
            f"sequence), got dtype {arr.dtype} {np.shape(arr)}: row ids such as [2, 0, 1] or a "
            "0/1 integer mask are refused, as the two cannot be told apart (pass rows == 1, or "
            "a bool mask built from the ids)")
    if arr.shape != (max_seqs,):
        raise ValueError(f"{what} rows must be a [max_seqs={max_seqs}] bool mask, "
                         f"got shape {tuple(arr.shape)}")
    return jnp.asarray(arr)


def init_page_table(max_seqs: int, num_pages: int, page_size: int = 64,
                    pages_per_seq: int | None = None, *, shards: int = 1) -> PageTable:
    """An empty table: every page free, every sequence empty.

    ``pages_per_seq`` (default: all of a shard's pages) bounds one sequence's length at
    ``pages_per_seq * page_size`` tokens. ``shards > 1``: that many independent tables
    (module doc); ``max_seqs`` and ``num_pages`` must divide by it.
    """
    for name, v in (("max_seqs", max_seqs), ("num_pages", num_pages), ("page_size", page_size),
                    ("shards", shards)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if max_seqs % shards or num_pages % shards:
        raise ValueError(
            f"max_seqs={max_seqs} and num_pages={num_pages} must both divide by the {shards} "
            f"data shards (each shard owns max_seqs/{shards} sequences and num_pages/{shards} pages)")
    n = num_pages // shards
    pages_per_seq = n if pages_per_seq is None else pages_per_seq
    if not isinstance(pages_per_seq, int) or isinstance(pages_per_seq, bool) or pages_per_seq <= 0:
        raise ValueError(f"pages_per_seq must be a positive int, got {pages_per_seq!r}")
    return PageTable(
        block_table=jnp.full((max_seqs, pages_per_seq), -1, jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
        # Popped from the top: pages are handed out 0, 1, 2, ... on a fresh table.
        free=jnp.tile(jnp.arange(n - 1, -1, -1, dtype=jnp.int32), shards),
        n_free=jnp.asarray(num_pages, jnp.int32) if shards == 1 else jnp.full((shards,), n, jnp.int32),
        owner=jnp.full((num_pages,), -1, jnp.int32),
        page_size=page_size,
    )
