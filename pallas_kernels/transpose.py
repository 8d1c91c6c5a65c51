"""``selection_transpose``: the selection ``token_ids [B, Q, W]`` turned token-major, for a
deterministic gradient of the latent rows.

``sparse_mla``'s backward owes every latent row the sum of the contributions of every
(query, slot) pair that selected it, and many queries select one row. Summed query-major
(one program per query scattering into rows) that needs float atomics, whose order, and so
whose float rounding, changes run to run. Transposed, one program owns a block of rows and
walks the queries that selected any of them in a fixed order: the sums are plain
accumulations, bit-identical run to run, with no atomics. This module builds that transpose
in XLA (a sort and integer sums, both deterministic); the backward kernels
(``attention_backward``, ``mosaic_attention_backward``) walk it.

Axis letters as in the package glossary (``pallas_kernels``). Invariants:

* Rows are flattened to ``R = (1 if shared else B) * L``: row ``r = (0 if shared else b) *
  L + id`` (``shared``: one pool ``[1, L, CR]`` that every batch row reads). Queries are
  flattened to ``N = B * Q``: query ``n = b * Q + q``.
* Rows are grouped in blocks of ``block_rows`` (``1 <= block_rows <= 32``): block ``k``
  holds rows ``[k * block_rows, (k + 1) * block_rows)``; there are ``ceil(R / block_rows)``.
* An entry is one (row block, query) pair with at least one selected row in the block:
  ``entry_query[e]`` the query ``n``, ``entry_mask[e]`` bit ``i`` set when query ``n``
  selects row ``k * block_rows + i`` (bit 31 is the int32's sign bit). Entries are sorted
  by (row block, query): ``block_start[k] : block_start[k + 1]`` are block ``k``'s entries,
  in increasing query order. ``block_start`` has ``ceil(R / block_rows) + 1`` offsets.
* ``E = N * W`` entries are allocated (static: at most one per selected id); past the last
  real entry (``block_start[-1]``) ``entry_query`` is ``-1`` and ``entry_mask`` 0.
* Ids ``< 0`` or ``>= L`` select nothing. A query naming one id twice sets its bit once.
* Every array is int32 and the result depends only on the set of (query, row) pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_rank

__all__ = ["SelectionTranspose", "selection_transpose", "MAX_BLOCK_ROWS"]

MAX_BLOCK_ROWS = 32  # one int32 bit mask per entry


class SelectionTranspose(NamedTuple):
    """The token-major selection; see the module doc. All int32."""

    block_start: jax.Array  # [ceil(R / block_rows) + 1] CSR offsets into the entries
    entry_query: jax.Array  # [E] the query n = b * Q + q of each entry; -1 past the last
    entry_mask: jax.Array  # [E] bit i: the query selects row block * block_rows + i


def _check_block_rows(block_rows) -> int:
    if (not isinstance(block_rows, int) or isinstance(block_rows, bool)
            or not 1 <= block_rows <= MAX_BLOCK_ROWS):
        raise ValueError(
            f"block_rows must be an int in [1, {MAX_BLOCK_ROWS}] (one bit per row of an "
            f"int32 mask), got {block_rows!r}"
        )
    return block_rows


def selection_transpose(
    token_ids: jax.Array, length: int, *, shared: bool, block_rows: int,
) -> SelectionTranspose:
    """``token_ids [B, Q, W]`` (int, ``-1`` = none) over rows of length ``L = length`` ->
    the ``SelectionTranspose`` (see the module doc). ``shared``: the rows are one pool
    ``[1, L, CR]`` read by every batch row (the paged latent pool), else ``[B, L, CR]``.
    Runs in XLA under any trace; deterministic."""
    check_rank("token_ids", token_ids, 3, "[B, Q, W]")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be integer, got {token_ids.dtype}")
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ValueError(f"length must be an int >= 0 (the rows' L), got {length!r}")
    block_rows = _check_block_rows(block_rows)
    b, nq, w = token_ids.shape
    n_rows = (1 if shared else b) * length
    n_blocks = -(-n_rows // block_rows)
    n_entries = b * nq * w
    i32 = jnp.int32
    if n_entries == 0:
        return SelectionTranspose(
            jnp.zeros((n_blocks + 1,), i32), jnp.zeros((0,), i32), jnp.zeros((0,), i32))

    ids = token_ids.astype(i32)
    valid = (ids >= 0) & (ids < length)
    batch = jnp.arange(b, dtype=i32)[:, None, None]
    row = jnp.where(valid, (0 if shared else batch * length) + ids, 0)
    query = jnp.broadcast_to(jnp.arange(b * nq, dtype=i32).reshape(b, nq, 1), ids.shape)
    # Invalid slots take the block past the last (sorted to the end, then dropped).
    block = jnp.where(valid, row // block_rows, n_blocks).reshape(-1)
    bit = (row % block_rows).reshape(-1)
    query = query.reshape(-1)
    # Sorted by (block, query, bit): an entry's slots are adjacent, a repeated id too.
    block, query, bit = jax.lax.sort((block, query, bit), num_keys=3)

    live = block < n_blocks
    prev_same = lambda x: jnp.concatenate([jnp.zeros((1,), bool), x[1:] == x[:-1]])
    same_entry = prev_same(block) & prev_same(query)
    head = live & ~same_entry  # the first slot of each entry
    repeat = same_entry & prev_same(bit)  # the same id named again by the query
    entry = jnp.cumsum(head.astype(i32)) - 1  # each slot's entry (valid slots only)
    drop = jnp.int32(n_entries)  # out of bounds: dropped by the scatters
    entry_query = jnp.full((n_entries,), -1, i32).at[jnp.where(head, entry, drop)].set(
        query, mode="drop")
    # Distinct bits of one entry summed = their OR (integer sums: exact, order-free).
    bits = jnp.left_shift(jnp.uint32(1), bit.astype(jnp.uint32))
    mask = jnp.zeros((n_entries,), jnp.uint32).at[jnp.where(live & ~repeat, entry, drop)].add(
        bits, mode="drop")
    entry_mask = jax.lax.bitcast_convert_type(mask, i32)
    # Block k's entries start after every entry of blocks < k.
    per_block = jnp.zeros((n_blocks + 1,), i32).at[jnp.where(head, block, n_blocks)].add(
        head.astype(i32))
    block_start = jnp.concatenate([jnp.zeros((1,), i32), jnp.cumsum(per_block[:n_blocks])])
    return SelectionTranspose(block_start.astype(i32), entry_query, entry_mask)
