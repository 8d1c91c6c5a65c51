"""``expand_selection``: selected pools -> ``token_ids``, the row of token ids attention reads.

Axis letters as in the package glossary (``pallas_kernels``; ``K = select_k`` selected pools,
``TW`` tail slots, ``W = out_width``). Invariants:

* Pool ``p`` expands to tokens ``first_key + p*KP + [0, KP)``; a ``-1`` pool expands to
  nothing.
* The tail (``index_kpool_always_select_tail``): with ``n_vis`` the number of tokens
  visible to the query, the last ``n_vis % KP`` visible tokens (the incomplete pool) are
  appended after the pools. ``visible_tail`` computes them as the reference does:
  ``first_key + n_vis - n_vis % KP + [0, KP - 1)``, each kept only if it is a valid token
  at or before the query.
* Output row (``token_ids``), ``W = out_width`` wide: the expanded pools (ascending, since
  ``topk_pools`` emits ascending pool ids), then the tail, then ``-1`` in every remaining
  slot: every slot is written. A row with no pool and no tail is all ``-1``.
* Block sizes (``ExpandSelectionBlockSizes``) change the tiling, never the row.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    Implementation, check_block_sizes, check_positive_int, check_power_of_two, check_rank,
    check_triton_params, eager_jit, next_power_of_two, without_mosaic,
)
from pallas_kernels._order_key import row_cumsum

__all__ = [
    "expand_selection", "expand_selection_reference", "ExpandSelectionBlockSizes",
    "visible_tail", "tail_slots", "compact_row",
]


@dataclasses.dataclass(frozen=True)
class ExpandSelectionBlockSizes:
    """Tiling of the Pallas ``expand_selection``.

    * ``block_q``: query rows per program (a power of two);
    * ``block_w``: ids per chunk of the walk over a row (a power of two);
    * ``num_warps`` (a power of two), ``num_stages`` (an int >= 1): Triton's.

    Both tiles are capped at the padded problem size (``resolve``).
    """

    block_q: int = 4
    block_w: int = 512
    num_warps: int = 4
    num_stages: int = 2

    def validate(self) -> "ExpandSelectionBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        check_power_of_two("ExpandSelectionBlockSizes.block_q", self.block_q)
        check_power_of_two("ExpandSelectionBlockSizes.block_w", self.block_w)
        check_triton_params("ExpandSelectionBlockSizes", self.num_warps, self.num_stages)
        return self

    def resolve(self, n_queries: int, n_src: int, out_width: int) -> "ExpandSelectionBlockSizes":
        """The sizes the kernel launches with for ``Q = n_queries`` rows of ``n_src`` source
        ids (``K*KP + T``) expanded into ``W = out_width`` slots."""
        self.validate()
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, next_power_of_two(n_queries)),
            block_w=min(self.block_w, next_power_of_two(max(n_src, out_width - n_src))),
        )


def visible_tail(
    first_key: jax.Array,
    n_vis: jax.Array,
    q_pos: jax.Array,
    key_valid: jax.Array,
    kpool: int,
) -> jax.Array:
    """Token ids of the incomplete visible pool.

    Args:
      first_key: ``[B]`` int32.
      n_vis: ``[B, Q]`` int32, valid tokens at or before each query.
      q_pos: ``[B, Q]`` int32 query positions (``-1`` for a padding query: no tail).
      key_valid: ``[B, L]`` bool.
      kpool: tokens per pool.

    Returns:
      ``[B, Q, KP - 1]`` int32 token ids, ``-1`` where empty.
    """
    length = key_valid.shape[-1]
    ids, ok = tail_slots(first_key, n_vis, q_pos, kpool, length)
    safe = jnp.clip(ids, 0, length - 1)
    ok &= jax.vmap(lambda v, i: v[i])(key_valid, safe)
    return jnp.where(ok, ids, -1).astype(jnp.int32)


def tail_slots(first_key: jax.Array, n_vis: jax.Array, q_pos: jax.Array, kpool: int, length: int):
    """``visible_tail`` before the validity read: ``(ids, ok)``, each ``[B, Q, KP - 1]``, the
    slots after each query's last complete pool and whether each is one of its ``n_vis %
    KP`` visible ones within ``length`` slots (a context-parallel shard reads the validity
    of the slots it holds: ``glm5_dsa_jax.parallel.context``)."""
    count = n_vis % kpool
    start = first_key[:, None] + n_vis - count
    off = jnp.arange(kpool - 1, dtype=jnp.int32)
    ids = start[..., None] + off
    return ids, (off < count[..., None]) & (ids < length) & (ids <= q_pos[..., None])


def compact_row(ids: jax.Array, out_width: int) -> jax.Array:
    """Move the ids ``>= 0`` of each row to its front (order kept), ``-1`` after; pad or
    cut to ``out_width``. A stream compaction: each valid id is scattered to its rank among
    the row's valid ids (a prefix sum, ``row_cumsum``) in a row of ``-1``; ranks past
    ``out_width`` are dropped. Not a sort: XLA:CPU sorted a ``[8, 1, 2051]`` row in 1.4 ms,
    this compacts it in 0.16 ms (the same ids; 2 cores, jax 0.10.2, 2026-12-04)."""
    n = ids.shape[-1]
    ids = ids.astype(jnp.int32)
    valid = ids >= 0
    slot = jnp.where(valid, row_cumsum(valid.astype(jnp.int32)) - 1, out_width)
    rows = math.prod(ids.shape[:-1])
    out = jnp.full((rows, out_width), -1, jnp.int32)
    out = out.at[jnp.arange(rows)[:, None], slot.reshape(rows, n)].set(ids.reshape(rows, n), mode="drop")
    return out.reshape(ids.shape[:-1] + (out_width,))


def expand_selection_reference(
    pool_ids: jax.Array,
    first_key: jax.Array,
    tail: jax.Array | None,
    *,
    kpool: int,
    out_width: int,
) -> jax.Array:
    """``pool_ids [B, Q, K]`` (ascending, ``-1`` after) and ``tail [B, Q, TW]`` (or None)
    -> ``token_ids [B, Q, W]`` int32 (``W = out_width``)."""
    b, nq, k = pool_ids.shape
    tok = first_key[:, None, None, None] + pool_ids[..., None] * kpool + jnp.arange(kpool, dtype=jnp.int32)
    tok = jnp.where(pool_ids[..., None] >= 0, tok, -1).reshape(b, nq, k * kpool)
    if tail is not None:
        tok = jnp.concatenate([tok, tail.astype(jnp.int32)], axis=-1)
    return compact_row(tok, out_width)


def expand_selection(
    pool_ids: jax.Array,
    first_key: jax.Array,
    tail: jax.Array | None,
    *,
    kpool: int,
    out_width: int,
    implementation: Implementation = "xla",
    block_sizes: ExpandSelectionBlockSizes | None = None,
) -> jax.Array:
    """Expand pools to ``token_ids [B, Q, W]`` and append the tail; see the module doc.
    ``block_sizes`` (validated under every implementation) tiles the Pallas kernel.

    No gradient: the selection is discrete; every input and the output are integers (no
    float input to stop), so no tangent reaches the kernel under ``jax.grad`` /
    ``jax.jvp``."""
    implementation = without_mosaic(implementation)  # no Mosaic kernel for this step: Triton's (see the package doc)
    blocks = check_block_sizes(block_sizes, ExpandSelectionBlockSizes)
    check_rank("pool_ids", pool_ids, 3, "[B, Q, K]")
    b, nq, k = pool_ids.shape
    if first_key.shape != (b,):
        raise ValueError(f"first_key must be [B] = ({b},), got {tuple(first_key.shape)}")
    width = k * kpool + (0 if tail is None else tail.shape[-1])
    if width > out_width:
        raise ValueError(
            f"out_width {out_width} is narrower than K*kpool + tail = {k}*{kpool} + "
            f"{width - k * kpool} = {width}"
        )
    if tail is not None and tail.shape[:2] != (b, nq):
        raise ValueError(f"tail must be [B, Q, TW] with B, Q = {(b, nq)}, got {tuple(tail.shape)}")
    if implementation == "xla":
        return expand_selection_reference(pool_ids, first_key, tail, kpool=kpool, out_width=out_width)
    return _expand_selection_pallas(
        pool_ids, first_key, tail, kpool=kpool, out_width=out_width,
        interpret=implementation == "pallas_interpret", block_sizes=blocks,
    )


# --------------------------------------------------------------------------------------
# Pallas kernel (Triton backend)
# --------------------------------------------------------------------------------------
#
# The kernel computes ``compact_row`` of the concatenated source row ``src = [expanded
# pools (K*KP ids) | tail (TW ids)]`` without sorting, as a permutation scatter. One
# program per (batch row, tile of ``block_q`` query rows) walks ``src`` in chunks of
# ``block_w`` ids, carrying per-row counts of valid and invalid ids seen so far:
#
# * a valid id (``>= 0``) goes to ``valid_rank`` (its rank among the valid ids, a cumsum):
#   the valid ids land at the front in their order;
# * an invalid one writes ``-1`` at ``n_src - 1 - invalid_rank``: the invalid ids
#   fill ``[n_valid, n_src)`` from the back, so the positions form a permutation of
#   ``[0, n_src)`` (``n_src = K*KP + TW``, the source row's length);
# * a second loop writes ``-1`` over ``[n_src, out_width)``.
#
# Every output element is written exactly once (no two stores of a program overlap, so
# there is no ordering question between GPU threads), and no assumption is made about
# where the ``-1`` pools are: the result is ``compact_row`` for any input. Masked lanes get
# indices that no live lane uses (rows past Q and positions past the row end are left out
# of bounds, never clamped), which keeps interpret mode's write-back of masked lanes
# harmless.


def _expand_selection_kernel(
    fk_ref, pool_ref, *rest,
    kpool: int, n_q: int, n_sel: int, n_tail: int, out_width: int, block_q: int,
    block_w: int,
):
    if n_tail:
        tail_ref, out_ref = rest
    else:
        (out_ref,) = rest
    i32 = jnp.int32
    b = pl.program_id(0)
    shape = (block_q, block_w)
    row = pl.program_id(1) * block_q + jnp.arange(block_q, dtype=i32)
    row_ok = jnp.broadcast_to((row < n_q)[:, None], shape)
    rows = jnp.broadcast_to(row[:, None], shape)
    rows_safe = jnp.minimum(rows, n_q - 1)
    lane = jnp.broadcast_to(jnp.arange(block_w, dtype=i32)[None, :], shape)
    fk = fk_ref[b]
    n_pool_ids = n_sel * kpool
    n_src = n_pool_ids + n_tail

    def chunk(c, carry):
        seen_valid, seen_invalid = carry  # [block_q, 1] each
        e = c * block_w + lane  # position in src
        in_src = e < n_src
        is_pool = e < n_pool_ids
        ids = jnp.full(shape, -1, i32)
        if n_sel:
            pid = plgpu.load(
                pool_ref.at[b, rows_safe, jnp.minimum(e // kpool, n_sel - 1)],
                mask=row_ok & is_pool, other=-1,
            )
            tok = fk + pid * kpool + e % kpool
            ids = jnp.where(is_pool & (pid >= 0), tok, ids)
        if n_tail:
            is_tail = in_src & ~is_pool
            tail = plgpu.load(
                tail_ref.at[b, rows_safe, jnp.clip(e - n_pool_ids, 0, n_tail - 1)],
                mask=row_ok & is_tail, other=-1,
            )
            ids = jnp.where(is_tail, tail, ids)
        valid = in_src & (ids >= 0)
        invalid = in_src & (ids < 0)
        v = valid.astype(i32)
        u = invalid.astype(i32)
        valid_rank = seen_valid + jnp.cumsum(v, axis=1) - v
        invalid_rank = seen_invalid + jnp.cumsum(u, axis=1) - u
        pos = jnp.where(valid, valid_rank, jnp.where(invalid, n_src - 1 - invalid_rank, e))
        plgpu.store(
            out_ref.at[b, rows, pos], jnp.where(valid, ids, -1), mask=row_ok & in_src
        )
        return (
            seen_valid + jnp.sum(v, axis=1, keepdims=True),
            seen_invalid + jnp.sum(u, axis=1, keepdims=True),
        )

    if n_src:
        zero = jnp.zeros((block_q, 1), i32)
        jax.lax.fori_loop(0, pl.cdiv(n_src, block_w), chunk, (zero, zero))

    n_fill = out_width - n_src
    if n_fill:
        minus_one = jnp.full(shape, -1, i32)

        @pl.loop(0, pl.cdiv(n_fill, block_w))
        def _(c):
            pos = n_src + c * block_w + lane
            plgpu.store(out_ref.at[b, rows, pos], minus_one, mask=row_ok & (pos < out_width))


@eager_jit("kpool", "out_width", "interpret", "block_sizes")
def _expand_selection_pallas(
    pool_ids, first_key, tail, *, kpool, out_width, interpret,
    block_sizes: ExpandSelectionBlockSizes,
):
    """Pallas expansion, tiled by ``block_sizes`` (see ``ExpandSelectionBlockSizes``)."""
    b, n_q, n_sel = pool_ids.shape
    check_positive_int("kpool", kpool)
    if not isinstance(out_width, int) or out_width < 0:
        raise ValueError(f"out_width must be an int >= 0, got {out_width!r}")
    for name, x in (("pool_ids", pool_ids), ("first_key", first_key), ("tail", tail)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    if tail is not None and tail.ndim != 3:
        raise ValueError(f"tail must be [B, Q, TW] (rank 3), got shape {tuple(tail.shape)}")
    n_tail = 0 if tail is None else tail.shape[-1]
    if b == 0 or n_q == 0 or out_width == 0:
        return jnp.full((b, n_q, out_width), -1, jnp.int32)

    n_src = n_sel * kpool + n_tail
    blocks = block_sizes.resolve(n_q, n_src, out_width)
    block_q, block_w = blocks.block_q, blocks.block_w
    kernel = functools.partial(
        _expand_selection_kernel, kpool=kpool, n_q=n_q, n_sel=n_sel, n_tail=n_tail,
        out_width=out_width, block_q=block_q, block_w=block_w,
    )
    # A zero-width pool_ids (K = 0) is replaced by a dummy the kernel never reads.
    pools = pool_ids.astype(jnp.int32) if n_sel else jnp.full((b, n_q, 1), -1, jnp.int32)
    args = [first_key.astype(jnp.int32), pools]
    if n_tail:
        args.append(tail.astype(jnp.int32))
    return pl.pallas_call(
        kernel,
        grid=(b, pl.cdiv(n_q, block_q)),
        out_shape=jax.ShapeDtypeStruct((b, n_q, out_width), jnp.int32),
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="expand_selection",
    )(*args)
