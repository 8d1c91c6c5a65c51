"""Drafts that can be taken back: dropping the last tokens of paged sequences
(``PagedCache.rollback`` / ``truncate``), as speculative decoding drops rejected drafts.

Invariants:

* **After a rollback a sequence is as if the dropped tokens had never been appended**: its
  length, its pages, its stage and its visible pools. Appending ``k`` drafts, rolling back
  ``r`` and continuing gives the outputs and top-k of appending the ``k - r`` accepted ones
  (``tests/test_rollback.py``: every ``r``, every position of the pool boundary).
* **Pages**: ``PageTable.truncate`` frees the pages past the new length in reverse order of
  taking, so the next ``reserve`` takes the same page ids (the page table equals the one
  the accepted tokens alone would have built). A kept partial page keeps its dropped rows
  as garbage: nothing reads a position at or past the length, and the next append
  overwrites it.
* **Pooled keys**: nothing is written. A pool a dropped token completed is at or past the
  new pool count ``length // KP`` and so invisible (``live_pools``, ``pool_counts``); it is
  pooled again, as new, when its last token arrives again.
* **The stage**: the incomplete pool of the new length ``L'`` needs the raw keys (and gate
  logits) of positions ``L' - L' % KP .. L' - 1``, which lie at or after ``L - R - (KP -
  1)`` for a rollback of ``R`` tokens from length ``L``. So the stage keeps the last ``H =
  max(KP, KP - 1 + max_rollback)`` positions (``stage_width``; the pipeline reads its last
  ``KP``), and a rollback shifts it right by ``r`` (entry ``i`` is position ``L' - H + i``).
  Only its last ``L' % KP`` entries are specified; the ones before are don't-care.
  ``stage_from[b]`` is the first position the row's stage may hold (0 for a sequence
  appended from the start; ``L - H`` after a rollback from ``L``; ``L - KP`` after a
  ``load``, whose export carries ``KP`` entries): a rollback is refused unless ``L' % KP
  == 0`` or ``L' - L' % KP >= max(stage_from, L - H)``. So ``max_rollback`` tokens can
  always be taken back, and more whenever the new length ends a pool.
* **Refusals leave the row untouched**: dropping more than the row holds (or a negative
  count), or past what the stage can restore: in an eager call ``ValueError`` naming the
  row, ``n_tokens`` and the sizes, nothing changed (``check_rollback``); under jit the row
  is left as it was and ``status[b]`` is ``BAD_ROLLBACK`` (a broken page table:
  ``BAD_TABLE``, as for ``reserve``).

Bytes of the per-sequence state a rollback needs, per layer with an indexer: ``H * D *
(s + 4) + 4`` (``s`` bytes a stage key, 4 a float32 gate logit, 4 for ``stage_from``). At
GLM-5.3-Flash dims (``D = 128``, ``KP = 4``, bf16 stage): ``max_rollback`` 1 (``H = 4``,
today's stage) 3,076 B; 8 (``H = 11``) 8,452 B; 16 (``H = 19``) 14,596 B a sequence, under
0.1 B per token of capacity at 8 sequences x 131,072 tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glm5_dsa_jax.cache.pages import BAD_ROLLBACK, OK, release_mask

__all__ = ["rollback_rows", "check_rollback", "restorable", "stage_bytes", "stage_width", "counts"]


def stage_width(kpool: int, max_rollback: int) -> int:
    """``H = max(KP, KP - 1 + max_rollback)``: raw positions a stage keeps so that
    ``max_rollback`` tokens can always be taken back (the module doc). ``ValueError`` naming
    ``max_rollback`` unless it is an int >= 0."""
    if not isinstance(max_rollback, (int, np.integer)) or isinstance(max_rollback, bool) or max_rollback < 0:
        raise ValueError(f"max_rollback must be an int >= 0 (tokens a sequence can take back), "
                         f"got {max_rollback!r}")
    return max(kpool, kpool - 1 + int(max_rollback))


def stage_bytes(stage_width: int, head_dim: int, key_bytes: int) -> int:
    """Bytes of one sequence's rollback state per layer (the module doc): ``H * D *
    (key_bytes + 4) + 4``."""
    return stage_width * head_dim * (key_bytes + 4) + 4


def restorable(cache, lengths, new_lengths):
    """``[max_seqs]`` bool: whether each row's stage holds the raw keys of the incomplete pool
    of ``new_lengths`` (the module doc's rule; always True without an indexer). Only
    meaningful for ``0 <= new_lengths <= lengths``."""
    if not cache.has_indexer:
        return jnp.ones(jnp.shape(lengths), bool)
    kp = cache.kpool
    start = new_lengths - new_lengths % kp
    return (new_lengths % kp == 0) | (start >= jnp.maximum(cache.stage_from, lengths - cache.stage_width))


def _concrete(*trees) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(trees))


def counts(cache, values, to_lengths: bool):
    """``values`` (``n_tokens``, or target ``lengths`` with ``to_lengths``) as ``[max_seqs]``
    int32, ``ValueError`` naming the argument unless it is an integer array of that shape
    (dtype and shape only: runs under jit)."""
    name = "lengths" if to_lengths else "n_tokens"
    arr = values if isinstance(values, jax.Array) else np.asarray(values)
    if not np.issubdtype(arr.dtype, np.integer) or arr.shape != (cache.max_seqs,):
        raise ValueError(f"{name} must be a [max_seqs={cache.max_seqs}] integer array, "
                         f"got {arr.dtype} {tuple(np.shape(arr))}")
    return jnp.asarray(arr, jnp.int32)


def check_rollback(cache, rows, n_tokens) -> None:
    """``ValueError`` naming every row where ``rows`` whose rollback by ``n_tokens[b]`` would
    be refused (the module doc: past its length, negative, or past what its stage can
    restore), with the sizes; and a broken page table (``PageTable.check``). Concrete
    values only (an eager call, ``PagedDecoder``); nothing is changed."""
    cache.pages.check()
    rows, n = np.asarray(rows, bool), np.asarray(n_tokens, np.int64)
    lengths = np.asarray(cache.lengths).astype(np.int64)
    ok = np.asarray(restorable(cache, lengths, lengths - n)) if cache.has_indexer else np.ones_like(rows)
    problems = []
    for b in np.nonzero(rows)[0]:
        length, r = int(lengths[b]), int(n[b])
        if r < 0 or r > length:
            problems.append(f"row {b}: n_tokens[{b}] = {r} but the sequence holds {length} tokens "
                            f"(0 <= n_tokens <= {length})")
        elif not ok[b]:
            new = length - r
            held = max(int(np.asarray(cache.stage_from)[b]), length - cache.stage_width)
            problems.append(
                f"row {b}: n_tokens[{b}] = {r} takes the sequence from {length} to {new} tokens, whose "
                f"incomplete pool starts at position {new - new % cache.kpool}, but the stage holds the "
                f"raw keys of positions {max(held, 0)} .. {length - 1} only (max_rollback="
                f"{cache.max_rollback}, index_kpool={cache.kpool}: make the cache with a larger "
                "max_rollback)")
    if problems:
        raise ValueError("cannot roll back; nothing was changed: " + "; ".join(problems))


def _shift(stage: jax.Array, n: jax.Array, done: jax.Array) -> jax.Array:
    """Each row's stage ``[B, H, ...]`` moved right by ``n[b]`` entries (zeros enter) where
    ``done``: entry ``i`` becomes old entry ``i - n``."""
    h = stage.shape[1]
    src = jnp.arange(h, dtype=jnp.int32)[None] - n[:, None]
    idx = jnp.clip(src, 0, h - 1).reshape(src.shape + (1,) * (stage.ndim - 2))
    moved = jnp.take_along_axis(stage, idx, axis=1)
    keep = (src >= 0).reshape(src.shape + (1,) * (stage.ndim - 2))
    moved = jnp.where(keep, moved, jnp.zeros((), stage.dtype))
    return jnp.where(done.reshape((-1,) + (1,) * (stage.ndim - 1)), moved, stage).astype(stage.dtype)


def rollback_rows(cache, rows, values, *, to_lengths: bool = False):
    """``PagedCache.rollback(rows, values)`` (``to_lengths``: ``truncate(rows, values)``): the
    module doc. Eager calls are checked first (``check_rollback``)."""
    what = "truncate" if to_lengths else "rollback"
    rows = release_mask(rows, cache.max_seqs, what)
    values = counts(cache, values, to_lengths)
    lengths = cache.pages.lengths
    n = lengths - values if to_lengths else values
    if _concrete(cache, rows, n):
        check_rollback(cache, rows, n)
    new = lengths - n
    # A row the stage cannot restore truncates to its own length (a no-op), then is refused.
    fine = restorable(cache, lengths, new) | (n < 0) | (n > lengths)
    pages, status = cache.pages.truncate(rows, jnp.where(fine, new, lengths))
    status = jnp.where(rows & (status == OK) & ~fine, BAD_ROLLBACK, status)
    done = rows & (status == OK)
    upd = dict(pages=pages, status=jnp.where(rows, status, cache.status).astype(jnp.int32))
    if cache.has_indexer:
        upd.update(stage_keys=_shift(cache.stage_keys, n, done), stage_gate=_shift(cache.stage_gate, n, done),
                   stage_from=jnp.where(done, jnp.maximum(cache.stage_from, lengths - cache.stage_width),
                                        cache.stage_from))
    return cache.replace(**upd)
