"""Drafts that can be taken back: dropping the last tokens of paged sequences
(``PagedCache.rollback`` / ``truncate``), or the last slots of a contiguous cache's timeline
(``DsaCache.rollback``), as speculative decoding drops rejected drafts.

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
  appended from the start; ``L - H`` after a rollback from ``L``; after a ``load``, the
  export's ``stage_from`` raised to ``L - min(H_src, H_dst)``: an export carries the whole
  stage, ``glm5_dsa_jax.cache.transfer``): a rollback is refused unless ``L' % KP == 0``
  or ``L' - L' % KP >= max(stage_from, L - H)``. So the last ``max_rollback`` tokens
  appended can always be taken back (a second rollback with fewer tokens appended since
  the first only as far as ``stage_from`` allows), and more whenever the new length ends
  a pool.
* **Refusals leave the row untouched**: dropping more than the row holds (or a negative
  count), or past what the stage can restore: in an eager call ``ValueError`` naming the
  row, ``n_tokens`` and the sizes, nothing changed (``check_rollback``); under jit the row
  is left as it was and ``status[b]`` is ``BAD_ROLLBACK`` (a broken page table:
  ``BAD_TABLE``, as for ``reserve``).

**The contiguous cache** (``DsaCache.rollback(n_tokens)``) holds one timeline for the
batch (slots, padding included), so it takes one count for every row; per-row counts are
refused (``ValueError``: the paged cache is the one for sequences of their own). The same
rules per row with its pool grid from ``first_key``: ``key_valid`` past the new length and
``pool_valid`` of every pool ending there cleared, ``n_valid`` recounted, ``first_key``
reset where no valid slot is left, the stage shifted, one ``stage_from`` slot for the
batch. Under jit an impossible count returns the cache unchanged (there is no status).
The clears are ``where``s over ``[B, max_length]`` and ``[B, max_pools]`` bools: ``O(B * L)``
byte writes, not ``O(R)``.

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

from glm5_dsa_jax.cache import eager
from glm5_dsa_jax.cache.pages import BAD_ROLLBACK, OK, release_mask

__all__ = ["rollback_rows", "check_rollback", "restorable", "stage_bytes", "stage_width", "counts",
           "rollback_timeline", "check_timeline_rollback", "timeline_count"]


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
    inside = np.asarray(cache.pages.ends_in_shared_page(jnp.asarray(np.clip(lengths - n, 0, None), jnp.int32)))
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
        elif inside[b]:
            new, ps = length - r, cache.page_size
            problems.append(
                f"row {b}: n_tokens[{b}] = {r} takes the sequence from {length} to {new} tokens, inside page "
                f"{new // ps} (tokens {new - new % ps} .. {new - new % ps + ps - 1}), which it shares with "
                f"another sequence (fork): a shared page is never written, so roll back to a page "
                f"boundary ({new - new % ps}) or release the row")
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


#: ``_shift`` for ``cache.fork``, which shifts a source's stage onto its fork as a rollback would.
shift_stage = _shift


def rollback_rows(cache, rows, values, *, to_lengths: bool = False):
    """``PagedCache.rollback(rows, values)`` (``to_lengths``: ``truncate(rows, values)``): the
    module doc. Eager calls are checked first (``check_rollback``), then run as one program
    placed as the cache (``glm5_dsa_jax.cache.eager``: a TP or data x tp cache stays where
    it is)."""
    what = "truncate" if to_lengths else "rollback"
    rows = release_mask(rows, cache.max_seqs, what)
    values = counts(cache, values, to_lengths)
    n = cache.pages.lengths - values if to_lengths else values
    if not eager.traced(cache, rows, n):  # checked, then one program placed as the cache
        check_rollback(cache, rows, n)
        return eager.run(_rollback_rows, cache, rows, n)
    return _rollback_rows(cache, rows, n)


def _rollback_rows(cache, rows, n):
    """The rollback of ``n [max_seqs]`` tokens where ``rows`` (jit-safe; refused rows untouched)."""
    lengths = cache.pages.lengths
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


# ---------------------------------------------------------------------------- the contiguous cache
def _timeline_restorable(cache, n):
    """``([B] bool, [B] int32)``: whether each row's stage holds its new incomplete pool after
    dropping ``n`` slots, and where that pool starts (a row's pool grid starts at its
    ``first_key``; a row with no valid slot before the new length has no pool)."""
    length, kp = cache.length, cache.kpool
    new = length - n
    fk = cache.first_key
    start = fk + jnp.maximum(new - fk, 0) // kp * kp
    held = jnp.maximum(cache.stage_from, length - cache.stage_width)
    return (fk >= new) | (start == new) | (start >= held), start


def check_timeline_rollback(cache, n: int) -> None:
    """``ValueError`` naming ``n_tokens``, the rows and the sizes unless ``DsaCache.rollback(n)``
    is possible (concrete values; nothing is changed)."""
    length = int(cache.length)
    if n < 0 or n > length:
        raise ValueError(f"cannot roll back n_tokens = {n} slots: the cache holds {length} "
                         f"(0 <= n_tokens <= {length}); nothing was changed")
    if not cache.has_indexer:
        return
    ok, start = (np.asarray(a) for a in _timeline_restorable(cache, jnp.int32(n)))
    if not ok.all():
        held = max(int(cache.stage_from), length - cache.stage_width, 0)
        rows = ", ".join(f"row {b} (its incomplete pool would start at slot {int(start[b])})"
                         for b in np.nonzero(~ok)[0])
        raise ValueError(
            f"cannot roll back n_tokens = {n} slots ({length} -> {length - n}): the stage holds the "
            f"raw keys of slots {held} .. {length - 1} only (max_rollback={cache.max_rollback}, "
            f"index_kpool={cache.kpool}: make the cache with a larger max_rollback), too few for "
            f"{rows}; nothing was changed")


def timeline_count(cache, n_tokens):
    """``n_tokens`` as one int32 count: a scalar, or a ``[B]`` array of one value (concrete;
    ``ValueError`` naming ``n_tokens`` for per-row counts, which the contiguous cache cannot
    take: one timeline for the batch)."""
    if isinstance(n_tokens, jax.core.Tracer):
        if jnp.ndim(n_tokens) != 0:
            raise ValueError("n_tokens of a contiguous cache's rollback must be one count (a scalar) "
                             "under jit: the batch shares one timeline")
        return jnp.asarray(n_tokens, jnp.int32)
    arr = np.asarray(n_tokens)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != cache.batch_size):
        raise ValueError(f"n_tokens must be an int (or a [B={cache.batch_size}] integer array of one "
                         f"value), got {arr.dtype} {tuple(arr.shape)}")
    if arr.ndim == 1 and (arr != arr[0]).any():
        raise ValueError(f"n_tokens = {arr.tolist()} differs between rows, but a contiguous cache holds one "
                         "timeline for the whole batch (slots are shared, padding included): it rolls "
                         "back one count for every row; per-sequence rollback is the paged cache's "
                         "(PagedCache.rollback)")
    return jnp.asarray(arr.reshape(-1)[0] if arr.ndim else arr, jnp.int32)


def _drop_slots(cache, n):
    """The rollback of ``n`` slots, assumed possible (``rollback_timeline``)."""
    length = cache.length
    new = length - n
    slot = jnp.arange(cache.max_length, dtype=jnp.int32)[None]
    key_valid = cache.key_valid & (slot < new)
    upd = dict(key_valid=key_valid, length=new.astype(jnp.int32))
    if cache.has_indexer:
        kp, fk = cache.kpool, cache.first_key
        p = jnp.arange(cache.max_pools, dtype=jnp.int32)[None]
        done = jnp.ones(fk.shape, bool)
        upd.update(
            pool_valid=cache.pool_valid & (fk[:, None] + (p + 1) * kp - 1 < new),
            n_valid=key_valid.sum(axis=1, dtype=jnp.int32),
            first_key=jnp.where(fk >= new, cache.max_length, fk).astype(jnp.int32),
            stage_keys=_shift(cache.stage_keys, jnp.broadcast_to(n, fk.shape), done),
            stage_gate=_shift(cache.stage_gate, jnp.broadcast_to(n, fk.shape), done),
            stage_valid=_shift(cache.stage_valid, jnp.broadcast_to(n, fk.shape), done),
            stage_from=jnp.maximum(cache.stage_from, length - cache.stage_width).astype(jnp.int32))
    return cache.replace(**upd)


def _keep(cache, n):
    return cache


def _rollback_timeline(cache, n):
    ok = (n >= 0) & (n <= cache.length)
    if cache.has_indexer:
        ok &= _timeline_restorable(cache, jnp.clip(n, 0, cache.length))[0].all()
    return jax.lax.cond(ok, _drop_slots, _keep, cache, n)


#: Compiled once per cache structure: an eager rollback is one program.
_ROLLBACK_TIMELINE = jax.jit(_rollback_timeline)


def rollback_timeline(cache, n_tokens):
    """``DsaCache.rollback(n_tokens)`` (the module doc): drop the last ``n_tokens`` slots of
    the batch's timeline. Eager calls are checked first (``check_timeline_rollback``)."""
    n = timeline_count(cache, n_tokens)
    if not eager.traced(cache, n):
        check_timeline_rollback(cache, int(n))
        return _ROLLBACK_TIMELINE(cache, n)
    return _rollback_timeline(cache, n)
