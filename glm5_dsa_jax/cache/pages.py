"""Page bookkeeping of a paged decode cache: block tables, lengths and the free pages.

A paged cache stores every sequence's tokens in fixed-size pages drawn from one pool
shared by all sequences (vLLM's and SGLang's layout). This module holds only the
bookkeeping, as a pytree of small int32 arrays, so it can run inside a jitted step; the
page pools themselves (latent rows, pooled indexer keys) live with the cache.

Invariants (each function keeps them; ``check`` verifies them on concrete values):

* ``block_table[b, j]`` is the page holding tokens ``[j * page_size, (j + 1) * page_size)``
  of sequence ``b``, or ``-1``; the first ``pages_needed(lengths[b])`` entries of a row
  are pages and the rest are ``-1``.
* Every page is either held by (row, slot) entries of the block table, ``refs[p] >= 1`` of
  them, at most one per row, or on the free stack ``free[:n_free]`` (``refs[p] == 0``), never
  both, never twice. ``free[n_free:]`` is unspecified.
* ``owner[p]`` is the row that holds page ``p`` alone (``refs[p] == 1``), ``SHARED`` (``-2``)
  for a page two or more rows hold (``refs[p] >= 2``, ``fork``) and ``-1`` for a free one: the
  record of who took it, written only by ``reserve``, ``release``, ``truncate`` and ``fork``. A
  row's pages are exactly the pages whose owner it is plus the shared pages it names, and
  the free stack exactly the pages no row holds.
* **A shared page is never written.** It is complete for every holder (it lies below
  ``lengths[b] // page_size`` pages of each: ``fork`` shares only a prefix's complete pages),
  and appends write only at or past a row's length, so no write reaches it. A page goes
  back to the free stack when its last holder lets go (``release``, ``truncate``), once;
  ``refs`` never goes below zero. A ``truncate`` that would leave a shared page partly
  filled (the next append would write into it) is refused (``BAD_ROLLBACK``); rollbacks past
  a fork point are not what drafts do.
* ``lengths[b]`` is the number of tokens sequence ``b`` holds (its next position).

**A table handed in is validated, not trusted** (``faults``; a caller may have written
any field). Every ``reserve`` checks the table first and a row whose bookkeeping is
broken (``ROW_FAULTS``: its length, a block-table entry out of range or not owned by it,
a page twice in the row, an owner record that names more or fewer pages than its length
needs, a shared page whose reference count is not its holders' or that is not complete for
the row) gets status ``BAD_TABLE`` and takes, writes and reads nothing; a broken free stack
(``STACK_FAULTS``: ``n_free`` out of range, an entry out of range, twice, owned by a row,
a page neither owned nor free, reference counts that disagree with the owner record) affects
every row of its shard, so every row of that
shard gets ``BAD_TABLE`` and nothing is taken at all. ``check`` raises the same faults
eagerly as one ``ValueError`` naming every broken row (field, slot, page) and shard.
**What the check costs** (issue 48): it runs in every jitted step, so it must not cost
what the pool's size would let it. A check that refuses a broken entry wherever it lies
reads every entry, so it is a few elementwise int32 passes and scatter-adds over the block
tables and the free stack, nothing more: no scan over pages, no copy, and no sort unless a
row shares a page (a page a row owns alone is named twice exactly when it has two holders;
only a shared page, which other rows name too, needs the row's pages sorted, under a
``lax.cond``). At 8 sequences over a pool for 131,072 tokens each that is ~0.3 ms on a
2-core CPU, where the sort of every block-table row cost ~2 ms alone and more inside a step
of ~17-40 ms (``tests/test_paged_pool_cost.py`` bounds the step's FLOPs per page of pool;
``docs/benchmarks.md``, the paged step at two pool capacities). That ``lax.cond`` is the one
control-flow op left between a paged GPU step's kernels (issue 46,
``tests/test_step_control_flow.py``; a conditional, its predicate read on the host): no
exact check of a shared page named twice in a row was found without a sort, and no
trace-time signal of the target platform that would keep the skip on a CPU only
(``lax.platform_dependent`` still lowers a ``case`` on jax 0.10). Rows take pages in row
order unrolled, not in a ``scan``: no loop in the step.
Why an owner record: when two rows name one page, the table alone cannot say whose it
is; the record can, so the row that names a page it does not own is refused and the
owner goes on, untouched. Whatever a caller writes, a page is read or written in a call
only by a row that names it *and* owns it (or holds it shared, and then only read), so no
row writes another row's page. (A table whose
block tables, lengths and owner record are all rewritten alike, e.g. two rows swapped
wholesale, is a valid table: no check can tell, only not writing the table can.)

**Shards** (data parallelism, ``glm5_dsa_jax.parallel.placement``): a table may be ``shards``
independent tables side by side, one per data shard of a mesh. Rows ``k * m .. (k+1) * m -
1`` (``m = max_seqs / shards``) and pages ``k * n .. (k+1) * n - 1`` of the pools (``n =
num_pages / shards``) are shard ``k``'s; ``free[k * n: (k+1) * n]`` is its stack,
``owner[k * n: (k+1) * n]`` its owner record (rows local to the shard, ``0 .. m - 1``) and
``n_free[k]`` its top (``n_free`` is ``[shards]``; a scalar ``n_free`` is one shard), ``refs[k * n:
(k+1) * n]`` its reference counts. Page
ids in the block table and on a stack are *local* to the shard (``0 .. n - 1``), so a
shard's rows never name another shard's page and a step run per shard reads only its own
pools. ``reserve`` / ``release`` / ``truncate`` / ``fork`` / ``check`` run per shard (rows take pages in
row order within their shard; a fork never crosses shards); the invariants above hold per shard.

**Sequence shards** (context parallelism, ``glm5_dsa_jax.parallel.context_paged``): a
table made with ``seq_shards = cp`` is an ordinary table whose fresh free stack hands a
shard's pages out round-robin over ``cp`` contiguous blocks of them (the devices that hold
them); nothing else differs, and no rule depends on the order.

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
           "BAD_ROLLBACK", "BAD_FORK", "SHARED", "STATUS_NAMES", "release_mask", "ROW_FAULTS",
           "STACK_FAULTS"]

#: ``status`` values of ``PageTable.reserve``, one per row. ``BAD_TABLE``: the row's own
#: bookkeeping or its shard's free stack is broken (``PageTable.faults``); the row took,
#: wrote and read nothing. ``BAD_ROLLBACK`` (of ``truncate`` and ``PagedCache.rollback``): the
#: row was asked to drop more tokens than it holds, or more than its stage can restore; it
#: was left untouched; also a truncate that would leave a shared page partly filled.
#: ``BAD_FORK`` (of ``fork``, on the destination row): a fork from an empty or released row,
#: to a row in use, of no tokens or more than the source holds, from another data shard, a
#: row both source and destination (or named twice), or (``PagedCache.fork``) of a prefix
#: whose incomplete pool the source's stage no longer holds; the row was left untouched.
OK, NO_FREE_PAGES, TOO_LONG, BAD_TABLE, BAD_ROLLBACK, BAD_FORK = 0, 1, 2, 3, 4, 5
STATUS_NAMES = {OK: "ok", NO_FREE_PAGES: "not enough free pages", TOO_LONG: "past pages_per_seq * page_size",
                BAD_TABLE: "inconsistent page table (PageTable.check names the fault)",
                BAD_ROLLBACK: "rollback past the sequence's length, past what its stage can restore, "
                              "or into a shared page",
                BAD_FORK: "fork from an empty row, to a row in use, past the source's length, across data "
                          "shards, or of a prefix whose incomplete pool the source's stage no longer holds"}
#: ``owner`` of a page two or more rows hold (``fork``; ``refs >= 2``).
SHARED = -2

#: Per-row faults of ``PageTable.faults`` (code -> rule), the first broken one reported.
ROW_LENGTH, ROW_PAGE_ID, ROW_NOT_OWNED, ROW_TWICE, ROW_OWNED_COUNT, ROW_REFS, ROW_SHARED_PARTIAL = range(1, 8)
ROW_FAULTS = {
    ROW_LENGTH: "lengths[b] outside [0, max_length]",
    ROW_PAGE_ID: "a block-table entry out of range, or not exactly the first pages_needed(lengths[b]) set",
    ROW_NOT_OWNED: "a block-table entry names a page the row does not own (owner[page] not b or SHARED)",
    ROW_TWICE: "a page named twice in the row",
    ROW_OWNED_COUNT: "owner names more or fewer pages of the row than its length needs",
    ROW_REFS: "a shared page whose refs differs from the number of rows that name it",
    ROW_SHARED_PARTIAL: "a shared page not complete for the row (at or past lengths[b] // page_size)",
}
#: Per-shard faults of the free stack (code -> rule): they refuse every row of the shard.
STACK_N_FREE, STACK_OWNER, STACK_ID, STACK_OWNED, STACK_TWICE, STACK_LOST, STACK_REFS = range(1, 8)
STACK_FAULTS = {
    STACK_N_FREE: "n_free outside [0, pages of the shard]",
    STACK_OWNER: "an owner entry names no row (nor -1 free, -2 shared)",
    STACK_ID: "a free-stack entry out of range",
    STACK_OWNED: "a page both on the free stack and held by a row",
    STACK_TWICE: "a page twice on the free stack",
    STACK_LOST: "n_free differs from the number of pages no row owns",
    STACK_REFS: "refs < 0, or refs and owner disagree (0: free, 1: a row, >= 2: SHARED, named by a row)",
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


def _take_in_row_order(left, need, bad):
    """``(left, ok)``: rows take ``need [R]`` pages from ``left`` free ones in row order,
    each all or nothing (``ok[b]``: not ``bad[b]`` and its pages all free after the rows
    before it took theirs). Unrolled over the rows, a few scalar ops each: no loop between
    a GPU step's kernels (a ``lax.scan`` before issue 46, a ``while`` in every step, one
    iteration even at one row)."""
    ok = []
    for b in range(need.shape[0]):
        ok_b = ~bad[b] & (need[b] <= left)
        left = left - jnp.where(ok_b, need[b], 0)
        ok.append(ok_b)
    return left, jnp.stack(ok)


def _twice_in_row(key, mine):
    """``[R, PG]`` bool: the ``mine`` entries whose ``key`` (a page id; distinct negatives
    where the row names no page of its own) another entry of the same row repeats: equal
    neighbours once each row is sorted, put back in slot order."""
    order = jnp.argsort(key, axis=1, stable=True)
    ranked = jnp.take_along_axis(key, order, axis=1)
    eq = ranked[:, 1:] == ranked[:, :-1]
    no = ranked[:, :1] != ranked[:, :1]  # False, placed as the table
    dup = jnp.concatenate([eq, no], axis=1) | jnp.concatenate([no, eq], axis=1)
    return mine & jnp.take_along_axis(dup, jnp.argsort(order, axis=1), axis=1)  # back in slot order


def _none_twice(key, mine):
    """``_twice_in_row``'s other branch (no shared page: nothing to sort). Module level, so
    jax's trace cache hits and an eager check compiles no new ``cond``."""
    return mine & False


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
    owner: jax.Array  # [num_pages] int32, row owning each page, -1 = free, SHARED (module doc)
    refs: jax.Array  # [num_pages] int32, rows holding each page, 0 = free (module doc)
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
        rows = (_placed_like(jnp.asarray(r), self.lengths).reshape(k, m) for r in rows)
        table, *rest = jax.vmap(fn)(self._split(), *rows)
        table = table.replace(block_table=table.block_table.reshape(self.max_seqs, -1),
                              lengths=table.lengths.reshape(-1), free=table.free.reshape(-1),
                              owner=table.owner.reshape(-1), refs=table.refs.reshape(-1))
        return (table, *(r.reshape(-1) for r in rest))

    def _split(self) -> "PageTable":
        """The shards' one-shard tables stacked on a leading axis (for ``vmap``)."""
        k = self.shards
        m = self.max_seqs // k
        return self.replace(block_table=self.block_table.reshape(k, m, -1),
                            lengths=self.lengths.reshape(k, m), free=self.free.reshape(k, -1),
                            owner=self.owner.reshape(k, -1), refs=self.refs.reshape(k, -1))

    def shard(self, k: int) -> "PageTable":
        """Shard ``k``'s own one-shard table, as host (numpy) arrays: for checks, tests and
        reports (page ids are local to the shard)."""
        m, n = self.max_seqs // self.shards, self.pages_per_shard
        return self.replace(block_table=np.asarray(self.block_table)[k * m:(k + 1) * m],
                            lengths=np.asarray(self.lengths)[k * m:(k + 1) * m],
                            free=np.asarray(self.free)[k * n:(k + 1) * n],
                            n_free=np.asarray(self.n_free).reshape(-1)[k],
                            owner=np.asarray(self.owner)[k * n:(k + 1) * n],
                            refs=np.asarray(self.refs)[k * n:(k + 1) * n])

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

        left, ok = _take_in_row_order(self.n_free, need, skip)
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
        at = jnp.where(fresh, page, self.num_pages)
        owner = self.owner.at[at].set(row, mode="drop")
        refs = self.refs.at[at].set(1, mode="drop")
        return (self.replace(block_table=table, lengths=lengths, n_free=left, owner=owner, refs=refs),
                status.astype(jnp.int32))

    def release(self, rows: jax.Array) -> "PageTable":
        """Return the pages of every row where ``rows`` (``[max_seqs]`` bool) to the free
        stack; those rows then hold nothing (length 0, no pages). A row that holds
        nothing is a no-op. Usable inside jit.

        Only pages a released row *holds* go back, each once, and a shared page only when
        its last holder lets go (its ``refs`` falls by the released rows naming it; one
        holder left: that row owns it again): first those the block tables name, in table
        order, then any a released row owns but does not name. So releasing a row whose
        bookkeeping was broken (``BAD_TABLE``) repairs it without freeing another row's page."""
        rows = jnp.asarray(rows, bool)
        if self.shards > 1:
            return self._per_shard(lambda t, r: (PageTable.release(t, r),), rows)[0]
        m = self.max_seqs
        holding = self._holding()
        in_rows = (self.owner >= 0) & (self.owner < m)
        rest = in_rows & jnp.take(rows, jnp.clip(self.owner, 0, m - 1))  # owned, maybe not named
        free, n_free, owner, refs = self._let_go(rows[:, None] & holding, holding, newest_on_top=False,
                                                 owned=rest)
        return self.replace(block_table=jnp.where(rows[:, None], -1, self.block_table),
                            lengths=jnp.where(rows, 0, self.lengths), free=free, n_free=n_free,
                            owner=owner, refs=refs)

    def truncate(self, rows: jax.Array, lengths: jax.Array) -> tuple["PageTable", jax.Array]:
        """Shorten every row where ``rows`` (``[max_seqs]`` bool) to ``lengths[b]`` tokens:
        ``(table, status)``. The row's pages past ``pages_needed(lengths[b])`` go back to the
        free stack *in reverse order of taking* (the rows' last pages deepest, the first
        freed page of the first row on top), so the next ``reserve`` of the same tokens
        takes the same page ids: the table is as if the dropped tokens had never been
        appended. A shared page the row lets go loses a holder (``refs``) and goes back
        only with its last one. Usable inside jit.

        Validated as ``reserve`` is: a row whose bookkeeping is broken, and every row of a
        shard whose free stack is broken, gets ``BAD_TABLE``; a row asked for a length
        outside ``[0, lengths[b]]``, or for one that ends inside a shared page (whose next
        append would write into it: a shared page is never written), gets
        ``BAD_ROLLBACK``; both are left untouched. Other rows get ``OK`` (``status`` is
        ``OK`` for rows not in ``rows``)."""
        rows = jnp.asarray(rows, bool)
        lengths = jnp.asarray(lengths, jnp.int32)
        if self.shards > 1:
            return self._per_shard(PageTable.truncate, rows, lengths)
        row_fault, _, stack_fault, _ = self._faults()
        bad = rows & ((row_fault != 0) | (stack_fault != 0))
        out_of_range = rows & ~bad & ((lengths < 0) | (lengths > self.lengths))
        out_of_range |= rows & ~bad & self.ends_in_shared_page(lengths)
        ok = rows & ~bad & ~out_of_range
        new_len = jnp.where(ok, lengths, self.lengths)
        j = jnp.arange(self.pages_per_seq, dtype=jnp.int32)[None]
        holding = self._holding()
        freed = ok[:, None] & holding & (j >= self.pages_needed(new_len)[:, None]) & \
            (j < self.pages_needed(self.lengths)[:, None])
        free, n_free, owner, refs = self._let_go(freed, holding, newest_on_top=True)
        status = jnp.where(bad, BAD_TABLE, jnp.where(out_of_range, BAD_ROLLBACK, OK)).astype(jnp.int32)
        return (self.replace(block_table=jnp.where(freed, -1, self.block_table), lengths=new_len, free=free,
                             n_free=n_free, owner=owner, refs=refs), status)

    def ends_in_shared_page(self, lengths: jax.Array) -> jax.Array:
        """``[max_seqs]`` bool: whether ``lengths[b]`` tokens of row ``b`` would end inside (not
        on the boundary of) a page the row shares: a truncate there is refused, since the next
        append would write into a shared page. Usable inside jit."""
        lengths = jnp.asarray(lengths, jnp.int32)
        if self.shards > 1:
            return self._per_shard(lambda t, n: (t, PageTable.ends_in_shared_page(t, n)), lengths)[1]
        j = jnp.clip(lengths // self.page_size, 0, self.pages_per_seq - 1)
        page = jnp.take_along_axis(self.block_table, j[:, None], axis=1)[:, 0]
        in_range = (page >= 0) & (page < self.num_pages)
        shared = jnp.take(self.owner, jnp.clip(page, 0, self.num_pages - 1)) == SHARED
        return (lengths % self.page_size != 0) & in_range & shared

    def _holding(self) -> jax.Array:
        """``[max_seqs, pages_per_seq]`` bool: the block-table entries naming a page their
        row holds (owns, or shares)."""
        n, table = self.num_pages, self.block_table
        own = jnp.take(self.owner, jnp.clip(table, 0, n - 1))
        row = jnp.arange(self.max_seqs, dtype=jnp.int32)[:, None]
        return (table >= 0) & (table < n) & ((own == row) | (own == SHARED))

    def _let_go(self, dropped, holding, *, newest_on_top: bool, owned=None):
        """``(free, n_free, owner, refs)`` after the (row, slot) entries ``dropped`` (a subset
        of ``holding``) let go of their pages: each page's ``refs`` falls by its dropped
        entries (never below 0); a page whose last holder let go is pushed once, at the entry
        processed last (table order: ``newest_on_top=False``, the first dropped entry deepest;
        ``True``: the reverse, the first on top); then the pages ``owned`` (``[num_pages]``
        bool, release's repair) not pushed yet, in page order. A page left with one holder is
        that row's again."""
        n, table = self.num_pages, self.block_table
        size = table.size
        at = jnp.where(dropped, table, n)
        count = jnp.zeros_like(self.refs).at[at].add(dropped.astype(jnp.int32), mode="drop")
        left = jnp.maximum(self.refs - count, 0)
        gone = (count > 0) & (left == 0)
        idx = jnp.arange(size, dtype=jnp.int32).reshape(table.shape)
        if newest_on_top:
            last = jnp.full_like(self.refs, size).at[at].min(jnp.where(dropped, idx, size), mode="drop")
        else:
            last = jnp.full_like(self.refs, -1).at[at].max(jnp.where(dropped, idx, -1), mode="drop")
        page = jnp.clip(table, 0, n - 1)
        flat = (dropped & jnp.take(gone, page) & (jnp.take(last, page) == idx)).reshape(-1)
        total = flat.sum(dtype=jnp.int32)
        rank = jnp.cumsum(flat, dtype=jnp.int32)
        pos = jnp.where(flat, self.n_free + (total - rank if newest_on_top else rank - 1), n)
        free = self.free.at[pos].set(table.reshape(-1), mode="drop")
        n_free = self.n_free + total
        if owned is not None:
            rest = owned & ~gone
            pos_rest = jnp.where(rest, n_free + jnp.cumsum(rest, dtype=jnp.int32) - 1, n)
            free = free.at[pos_rest].set(jnp.where(rest, jnp.arange(n, dtype=jnp.int32), -1), mode="drop")
            n_free = n_free + rest.sum(dtype=jnp.int32)
            gone = gone | rest
        kept = holding & ~dropped
        row = jnp.broadcast_to(jnp.arange(self.max_seqs, dtype=jnp.int32)[:, None], table.shape)
        holder = jnp.full_like(self.owner, -1).at[jnp.where(kept, table, n)].max(row, mode="drop")
        owner = jnp.where(gone, -1, jnp.where((self.owner == SHARED) & (left == 1), holder, self.owner))
        return free, n_free, owner, jnp.where(gone, 0, left)

    def fork(self, src: jax.Array, lengths: jax.Array, refuse: jax.Array | None = None):
        """Start each row ``b`` with ``src[b] >= 0`` (``[max_seqs]`` int32; ``-1``: no fork) as the
        first ``lengths[b]`` tokens of row ``src[b]``: ``(table, status, copy_from, copy_to)``.

        The destination names the source's complete pages of that prefix (``lengths[b] //
        page_size`` of them: shared, ``refs`` + 1, ``owner`` ``SHARED``) and, when the prefix
        ends inside a page, one fresh page from the free stack (rows in row order, all or
        nothing, as ``reserve``): the caller copies page ``copy_from[b]`` (the source's) into
        ``copy_to[b]`` (local page ids, ``-1``: none). Usable inside jit.

        Refused, the row left untouched: ``BAD_TABLE`` for a broken table (the row's, its
        source's or the shard's free stack), ``BAD_FORK`` for a source out of range, empty or
        itself a destination, a destination in use or also a source, ``lengths[b]`` outside
        ``[1, lengths[src[b]]]``, a source in another data shard, or ``refuse[b]`` (the
        caller's own reasons); ``NO_FREE_PAGES`` when no page is left for the partial one.
        ``status`` is ``OK`` for rows without a fork."""
        src = jnp.asarray(src, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        refuse = jnp.zeros(src.shape, bool) if refuse is None else jnp.asarray(refuse, bool)
        if self.shards > 1:
            m = self.max_seqs // self.shards
            b = jnp.arange(self.max_seqs, dtype=jnp.int32)
            refuse = refuse | ((src >= 0) & ((src >= self.max_seqs) | (src // m != b // m)))
            return self._per_shard(PageTable.fork, jnp.where(src >= 0, src % m, -1), lengths, refuse)
        m, n, ps = self.max_seqs, self.num_pages, self.page_size
        row_fault, _, stack_fault, _ = self._faults()
        active = src >= 0
        s = jnp.clip(src, 0, m - 1)
        src_len = jnp.take(self.lengths, s)
        broken = active & ((row_fault != 0) | (jnp.take(row_fault, s) != 0) | (stack_fault != 0))
        is_src = jnp.zeros_like(self.lengths, bool).at[jnp.where(active, src, m)].set(active, mode="drop")
        bad = active & ~broken & (refuse | (src >= m) | (src_len == 0) | (self.lengths != 0) | is_src |
                                  jnp.take(active, s) | (lengths <= 0) | (lengths > src_len))
        partial = lengths % ps != 0
        need = jnp.where(partial, 1, 0).astype(jnp.int32)
        left, taken = _take_in_row_order(self.n_free, need, ~active | broken | bad)
        ok = active & ~broken & ~bad & taken
        status = jnp.where(~active, OK, jnp.where(broken, BAD_TABLE, jnp.where(
            bad, BAD_FORK, jnp.where(ok, OK, NO_FREE_PAGES)))).astype(jnp.int32)
        got = jnp.where(ok, need, 0)
        fresh = jnp.take(self.free, jnp.clip(self.n_free - jnp.cumsum(got), 0, n - 1))  # popped in row order
        full = lengths // ps
        j = jnp.arange(self.pages_per_seq, dtype=jnp.int32)[None]
        src_table = jnp.take(self.block_table, s, axis=0)
        shared = ok[:, None] & (j < full[:, None])
        copied = ok & partial
        table = jnp.where(shared, src_table, self.block_table)
        table = jnp.where(copied[:, None] & (j == full[:, None]), fresh[:, None], table)
        gains = jnp.zeros_like(self.refs).at[jnp.where(shared, src_table, n)].add(1, mode="drop")
        at = jnp.where(copied, fresh, n)
        owner = jnp.where(gains > 0, SHARED, self.owner).at[at].set(
            jnp.where(copied, jnp.arange(m, dtype=jnp.int32), -1), mode="drop")
        refs = (self.refs + gains).at[at].set(1, mode="drop")
        from_page = jnp.take_along_axis(src_table, jnp.clip(full, 0, self.pages_per_seq - 1)[:, None], axis=1)[:, 0]
        table_out = self.replace(block_table=table, lengths=jnp.where(ok, lengths, self.lengths), n_free=left,
                                 owner=owner, refs=refs)
        return table_out, status, jnp.where(copied, from_page, -1), jnp.where(copied, fresh, -1)

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
        table, lengths, owner, free, refs = self.block_table, self.lengths, self.owner, self.free, self.refs
        row = jnp.arange(m, dtype=jnp.int32)[:, None]
        j = jnp.arange(self.pages_per_seq, dtype=jnp.int32)[None]
        bad_length = (lengths < 0) | (lengths > self.max_length)
        need = self.pages_needed(jnp.clip(lengths, 0, self.max_length))
        want = j < need[:, None]
        in_range = (table >= 0) & (table < n)
        page = jnp.where(in_range, table, 0)
        own = jnp.take(owner, page)
        shared = want & in_range & (own == SHARED)
        mine = (want & in_range & (own == row)) | shared
        holders = jnp.zeros_like(owner).at[jnp.where(mine, table, n)].add(mine.astype(jnp.int32), mode="drop")
        # A page twice in one row. A page the row owns alone is held by no other row's
        # entries (``mine`` needs owner == row or SHARED), so it is twice exactly when it has
        # two holders: a count, no sort. Only a shared page, which other rows hold too, needs
        # the row's pages sorted, and only a table with a shared page pays for that sort
        # (``lax.cond``): a step's check stays a few passes over the table (issue 48).
        twice = mine & (jnp.take(holders, page) >= 2)
        twice = jnp.where(shared, jax.lax.cond(shared.any(), _twice_in_row, _none_twice,
                                               jnp.where(mine, table, -1 - j), mine), twice)
        rules = (jnp.broadcast_to(bad_length[:, None], table.shape),
                 jnp.where(want, ~in_range, table != -1),
                 want & in_range & ~mine,
                 mine & twice)
        is_row = (owner >= 0) & (owner < m)
        owned = jnp.zeros_like(lengths).at[jnp.where(is_row, owner, m)].add(is_row.astype(jnp.int32), mode="drop")
        hits = [_first(r) for r in rules]
        hits += [(owned + shared.sum(axis=1, dtype=jnp.int32) != need, jnp.zeros((m,), jnp.int32)),
                 _first(shared & (jnp.take(refs, page) != jnp.take(holders, page))),
                 _first(shared & ((j + 1) * self.page_size > lengths[:, None]))]
        row_fault = _fault_code(*(h[0] for h in hits))
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
                       (owner < SHARED) | (owner >= m),
                       id_bad,
                       ok_id & ((jnp.take(owner, fpage) != -1) | (jnp.take(refs, fpage) != 0)),
                       ok_id & (jnp.take(on_stack, fpage) > 1),
                       jnp.broadcast_to(n_free != (owner == -1).sum(dtype=jnp.int32), (n,)),
                       (refs < 0) | ((refs == 0) != (owner == -1)) | ((refs == 1) & ~is_row) |
                       ((refs >= 2) != (owner == SHARED)) | ((owner == SHARED) & (holders == 0)))
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
        rf, ra, sf, sa = jax.vmap(PageTable._faults)(self._split())
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
    if code == ROW_REFS:
        holders = int((np.asarray(t.block_table) == entry).sum())
        return (f"row {g}: block_table[{g}, {j}] = shared page {entry} has refs[{entry}] = "
                f"{int(t.refs[entry])} but {holders} block-table entries name it")
    if code == ROW_SHARED_PARTIAL:
        return (f"row {g}: block_table[{g}, {j}] = shared page {entry} (refs {int(t.refs[entry])}) holds "
                f"tokens {j * t.page_size} .. {(j + 1) * t.page_size - 1} but lengths[{g}] = {length}: a "
                "shared page must be complete for every holder (it is never written)")
    owned = np.nonzero(np.asarray(t.owner) == b)[0]
    row = np.asarray(t.block_table)[b, :need]
    n_shared = int((np.asarray(t.owner)[np.clip(row, 0, t.num_pages - 1)] == SHARED).sum())
    shares = f" and it shares {n_shared}," if n_shared else ""
    return (f"row {g}: owner names {owned.size} page(s) of row {g} ({owned[:5].tolist()}){shares} but "
            f"lengths[{g}] = {length} needs {need}, named by its block table")


def _stack_problem(t: PageTable, code: int, i: int) -> str:
    """The message of the free stack of the one-shard host table ``t``."""
    n_free, n = int(t.n_free), t.num_pages
    if code == STACK_N_FREE:
        return f"n_free = {n_free} outside [0, {n}]"
    if code == STACK_OWNER:
        return (f"owner[{i}] = {int(t.owner[i])} names no row (rows 0 .. {t.max_seqs - 1}, -1 for free, "
                f"{SHARED} for shared)")
    page = int(t.free[i]) if code in (STACK_ID, STACK_OWNED, STACK_TWICE) else -1
    if code == STACK_ID:
        return f"free[{i}] = {page} is out of range: page ids are 0 .. {n - 1}"
    if code == STACK_OWNED:
        return (f"free[{i}] = page {page} is on the free stack but owned by row {int(t.owner[page])}"
                if t.owner[page] >= 0 else f"free[{i}] = page {page} is on the free stack but held "
                f"(owner {int(t.owner[page])}, refs {int(t.refs[page])})")
    if code == STACK_REFS:
        return _refs_problem(t, i)
    if code == STACK_TWICE:
        return f"page {page} is on the free stack twice (free[:n_free={n_free}])"
    unowned = int((np.asarray(t.owner) == -1).sum())
    return (f"n_free = {n_free} but {unowned} pages are owned by no row: the free stack must "
            "hold exactly the pages no row owns")


def _refs_problem(t: PageTable, i: int) -> str:
    """The message of a page whose ``refs`` and ``owner`` disagree (``STACK_REFS``)."""
    refs, owner = int(t.refs[i]), int(t.owner[i])
    holders = int((np.asarray(t.block_table) == i).sum())
    return (f"page {i}: refs[{i}] = {refs}, owner[{i}] = {owner}, named by {holders} block-table "
            f"entries: refs must be 0 for a free page (owner -1), 1 for a row's own page (owner "
            f"that row), >= 2 for a shared one (owner {SHARED}) and never below 0")


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
                    pages_per_seq: int | None = None, *, shards: int = 1, seq_shards: int = 1) -> PageTable:
    """An empty table: every page free, every sequence empty.

    ``pages_per_seq`` (default: all of a shard's pages) bounds one sequence's length at
    ``pages_per_seq * page_size`` tokens. ``shards > 1``: that many independent tables
    (module doc); ``max_seqs`` and ``num_pages`` must divide by it. ``seq_shards > 1``
    (context parallelism: a shard's ``n`` pages split into that many contiguous blocks of
    ``n / seq_shards``, one per device of a sequence axis): the free stack hands pages out
    round-robin over the blocks (``0, n/c, 2n/c, .., 1, n/c + 1, ..``), so on a fresh table
    consecutive pages of a sequence lie on consecutive devices; ``n`` must divide by it.
    Pages go back to the stack in reverse order of taking, which keeps the rotation for a
    sequence released whole; after other churn the spread is uneven (never wrong).
    """
    for name, v in (("max_seqs", max_seqs), ("num_pages", num_pages), ("page_size", page_size),
                    ("shards", shards), ("seq_shards", seq_shards)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if max_seqs % shards or num_pages % shards:
        raise ValueError(
            f"max_seqs={max_seqs} and num_pages={num_pages} must both divide by the {shards} "
            f"data shards (each shard owns max_seqs/{shards} sequences and num_pages/{shards} pages)")
    n = num_pages // shards
    if n % seq_shards:
        raise ValueError(
            f"num_pages={num_pages} gives {n} pages per data shard, not divisible by the {seq_shards} "
            f"devices of the sequence axis (each holds a block of pages / {seq_shards}): make it a "
            f"multiple of {shards * seq_shards}")
    pages_per_seq = n if pages_per_seq is None else pages_per_seq
    if not isinstance(pages_per_seq, int) or isinstance(pages_per_seq, bool) or pages_per_seq <= 0:
        raise ValueError(f"pages_per_seq must be a positive int, got {pages_per_seq!r}")
    return PageTable(
        block_table=jnp.full((max_seqs, pages_per_seq), -1, jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
        # Popped from the top: pages are handed out 0, 1, 2, ... on a fresh table (round-robin
        # over the seq_shards blocks: 0, n/c, .., 1, n/c + 1, ..).
        free=jnp.tile(jnp.asarray(np.arange(n, dtype=np.int32).reshape(seq_shards, -1).T.reshape(-1)[::-1]),
                      shards),
        n_free=jnp.asarray(num_pages, jnp.int32) if shards == 1 else jnp.full((shards,), n, jnp.int32),
        owner=jnp.full((num_pages,), -1, jnp.int32),
        refs=jnp.zeros((num_pages,), jnp.int32),
        page_size=page_size,
    )
