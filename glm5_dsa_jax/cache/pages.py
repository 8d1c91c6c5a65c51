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
* ``lengths[b]`` is the number of tokens sequence ``b`` holds (its next position).

**Shards** (data parallelism, ``glm5_dsa_jax.parallel.placement``): a table may be ``shards``
independent tables side by side, one per data shard of a mesh. Rows ``k * m .. (k+1) * m -
1`` (``m = max_seqs / shards``) and pages ``k * n .. (k+1) * n - 1`` of the pools (``n =
num_pages / shards``) are shard ``k``'s; ``free[k * n: (k+1) * n]`` is its stack and
``n_free[k]`` its top (``n_free`` is ``[shards]``; a scalar ``n_free`` is one shard). Page
ids in the block table and on a stack are *local* to the shard (``0 .. n - 1``), so a
shard's rows never name another shard's page and a step run per shard reads only its own
pools. ``reserve`` / ``release`` / ``check`` run per shard (rows take pages in row order
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

__all__ = ["PageTable", "init_page_table", "OK", "NO_FREE_PAGES", "TOO_LONG", "STATUS_NAMES"]

#: ``status`` values of ``PageTable.reserve``, one per row.
OK, NO_FREE_PAGES, TOO_LONG = 0, 1, 2
STATUS_NAMES = {OK: "ok", NO_FREE_PAGES: "not enough free pages", TOO_LONG: "past pages_per_seq * page_size"}


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
                             lengths=self.lengths.reshape(k, m), free=self.free.reshape(k, -1))
        rows = (_placed_like(jnp.asarray(r), self.lengths).reshape(k, m) for r in rows)
        table, *rest = jax.vmap(fn)(local, *rows)
        table = table.replace(block_table=table.block_table.reshape(self.max_seqs, -1),
                              lengths=table.lengths.reshape(-1), free=table.free.reshape(-1))
        return (table, *(r.reshape(-1) for r in rest))

    def shard(self, k: int) -> "PageTable":
        """Shard ``k``'s own one-shard table, as host (numpy) arrays: for checks, tests and
        reports (page ids are local to the shard)."""
        m, n = self.max_seqs // self.shards, self.pages_per_shard
        return self.replace(block_table=np.asarray(self.block_table)[k * m:(k + 1) * m],
                            lengths=np.asarray(self.lengths)[k * m:(k + 1) * m],
                            free=np.asarray(self.free)[k * n:(k + 1) * n],
                            n_free=np.asarray(self.n_free).reshape(-1)[k])

    def pages_needed(self, lengths: jax.Array) -> jax.Array:
        """Pages that hold ``lengths`` tokens."""
        return (lengths + self.page_size - 1) // self.page_size

    def reserve(self, n_new: jax.Array) -> tuple["PageTable", jax.Array]:
        """Make room for ``n_new[b]`` more tokens in each row: ``(table, status)``.

        Rows take pages from the top of the free stack in row order. A row whose new
        length passes ``max_length`` (``TOO_LONG``) or whose pages are not all free after
        the rows before it took theirs (``NO_FREE_PAGES``) takes nothing and keeps its
        length; every other row's length grows by ``n_new[b]``. ``status`` is ``[max_seqs]``
        int32. Positions of the new tokens are ``old lengths[b] + 0 .. n_new[b] - 1``.
        """
        n_new = jnp.asarray(n_new, jnp.int32)
        if self.shards > 1:
            return self._per_shard(PageTable.reserve, n_new)
        have = self.pages_needed(self.lengths)
        new_len = self.lengths + n_new
        too_long = new_len > self.max_length
        need = jnp.where(too_long, 0, self.pages_needed(new_len) - have)

        left, ok = jax.lax.scan(_take_pages, self.n_free, (need, too_long))
        status = jnp.where(too_long, TOO_LONG, jnp.where(ok, OK, NO_FREE_PAGES)).astype(jnp.int32)
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
        return self.replace(block_table=table, lengths=lengths, n_free=left), status

    def release(self, rows: jax.Array) -> "PageTable":
        """Return the pages of every row where ``rows`` (``[max_seqs]`` bool) to the free
        stack; those rows then hold nothing (length 0, no pages). A row that holds
        nothing is a no-op. Usable inside jit."""
        rows = jnp.asarray(rows, bool)
        if self.shards > 1:
            return self._per_shard(lambda t, r: (PageTable.release(t, r),), rows)[0]
        owned = rows[:, None] & (self.block_table >= 0)
        flat = owned.reshape(-1)
        pos = self.n_free + jnp.cumsum(flat) - 1  # stack slot of each returned page
        pos = jnp.where(flat, pos, self.num_pages)  # others: dropped
        free = self.free.at[pos].set(self.block_table.reshape(-1), mode="drop")
        return self.replace(
            block_table=jnp.where(rows[:, None], -1, self.block_table),
            lengths=jnp.where(rows, 0, self.lengths),
            free=free,
            n_free=self.n_free + flat.sum(dtype=jnp.int32),
        )

    def token_slots(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(page, offset)`` of each position of ``positions [max_seqs, ...]`` (``-1`` ->
        page ``-1``)."""
        j = jnp.clip(positions // self.page_size, 0, self.pages_per_seq - 1)
        page = jnp.take_along_axis(self.block_table, j.reshape(j.shape[0], -1), axis=1).reshape(j.shape)
        page = jnp.where(positions >= 0, page, -1)
        return page, positions % self.page_size

    def check(self) -> None:
        """Raise ``ValueError`` unless the invariants of the module doc hold (concrete
        values only; for tests, debugging and tables handed in by a user); per shard, with
        the shard named, for a sharded table."""
        if self.shards > 1:
            for k in range(self.shards):
                try:
                    self.shard(k).check()
                except ValueError as e:
                    m = self.max_seqs // self.shards
                    raise ValueError(f"shard {k} (rows {k * m} .. {(k + 1) * m - 1}, local page "
                                     f"ids): {e}") from None
            return
        table, lengths = np.asarray(self.block_table), np.asarray(self.lengths)
        free, n_free = np.asarray(self.free), int(self.n_free)
        if not 0 <= n_free <= self.num_pages:
            raise ValueError(f"n_free = {n_free} outside [0, num_pages={self.num_pages}]")
        if ((table < -1) | (table >= self.num_pages)).any():
            b, j = (int(v[0]) for v in np.nonzero((table < -1) | (table >= self.num_pages)))
            raise ValueError(
                f"block_table[{b}, {j}] = {int(table[b, j])} is out of range: page ids are "
                f"0 .. {self.num_pages - 1}, or -1 for none"
            )
        if ((lengths < 0) | (lengths > self.max_length)).any():
            b = int(np.nonzero((lengths < 0) | (lengths > self.max_length))[0][0])
            raise ValueError(f"lengths[{b}] = {int(lengths[b])} outside [0, {self.max_length}]")
        need = -(-lengths // self.page_size)
        for b in range(self.max_seqs):
            row = table[b]
            if (row[: need[b]] < 0).any() or (row[need[b]:] >= 0).any():
                raise ValueError(
                    f"block_table row {b} holds {int((row >= 0).sum())} pages for length "
                    f"{int(lengths[b])}: it needs exactly its first {int(need[b])} entries set"
                )
        used = np.concatenate([table[table >= 0], free[:n_free]])
        if used.size != self.num_pages or np.unique(used).size != self.num_pages:
            counts = np.bincount(used, minlength=self.num_pages)
            lost, twice = np.nonzero(counts == 0)[0], np.nonzero(counts > 1)[0]
            raise ValueError(
                f"pages lost {lost[:5].tolist()} or held twice {twice[:5].tolist()}: every page "
                "must be in exactly one block-table entry or on the free stack"
            )


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
        page_size=page_size,
    )
