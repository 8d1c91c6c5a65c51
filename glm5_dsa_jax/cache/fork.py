"""Shared prefixes: paged sequences that start as the first tokens of another
(``PagedCache.fork``), as prefix caching (vLLM, SGLang's radix cache) and parallel sampling
share one prompt's pages between requests.

Invariants:

* **A fork is a prefix, held by reference.** Destination row ``d`` starts as the first
  ``ell`` tokens of its source row ``s``: its block table names ``s``'s complete pages of that
  prefix (``ell // page_size`` of them, now shared: ``PageTable.refs`` counts the holders,
  ``owner`` is ``SHARED``) and, when ``ell`` ends inside a page, one fresh page holding a copy
  of ``s``'s page there (the whole page: its rows at or past ``ell`` are never read, and the
  next append overwrites them). A page holds its tokens' latent rows and their pooled keys,
  so the pools come with the pages; pools at or past ``ell // KP`` are invisible
  (``pool_counts``), as after a rollback.
* **A shared page is never written** (``pages``' module doc): it is complete for every
  holder, appends write only at or past a row's length, and a ``truncate`` / ``rollback``
  that would end inside it is refused (``BAD_ROLLBACK``; a ``ValueError`` naming the row
  eagerly). It returns to the free stack when its last holder is released or truncated.
* **The stage.** ``d``'s stage is ``s``'s shifted right by ``r = len_s - ell`` entries (entry
  ``i`` is position ``ell - H + i``), as a rollback of ``r`` would leave it, and
  ``stage_from[d] = min(ell, max(stage_from[s], len_s - H))``. So ``d`` can go on only if the
  raw keys of its incomplete pool are still in ``s``'s stage, the rollback rule
  (``rollback.restorable``): ``ell % KP == 0``, or ``ell - ell % KP >= max(stage_from[s],
  len_s - H)``. Page-aligned prefixes (a page holds whole pools) and whole-length forks
  (``ell = len_s``, parallel sampling) always work; another prefix works within
  ``max_rollback`` tokens of the source's end, and is refused otherwise (``BAD_FORK``).
* **Refusals change nothing.** A fork from a row out of range, empty or released, into a
  row in use (or out of range, or named twice), of ``ell`` outside ``[1, len_s]``, across
  data shards, a row both source and destination, a prefix whose incomplete pool the
  stage no longer holds, or without a free page for the partial one: in an eager call (and
  ``PagedDecoder.fork``) ``ValueError`` naming the row and the sizes, before anything is
  written (``check_fork``); under jit the destination row is left untouched and
  ``status[d]`` says why (``BAD_FORK``, ``NO_FREE_PAGES``, ``BAD_TABLE``).
* **Jit-safe, one program.** ``src_rows`` / ``dst_rows`` / ``lengths`` are ``[M]`` (M static)
  and become a ``[max_seqs]`` map; no shape depends on their values, so one compiled
  program serves every fork of ``M`` pairs.

Memory (``docs/serving.md``, "Shared prefixes"): 16 sequences sharing a 4,096-token prompt
at GLM-5.3-Flash dims hold its 64 pages of 64 tokens once: 64 x 64 x 1,088 B = 4,456,448 B
(4.25 MiB) a layer in bf16 instead of 16 x that (68 MiB); fp8 64 x 64 x 549 B = 2,248,704 B
(2.14 MiB) instead of 34.3 MiB. A fork at a page boundary copies no page; its own state is
the stage (``rollback.stage_bytes``, 3,076 B at ``max_rollback`` 1) and 4 bytes of ``refs``
a page (0.06 B a token of capacity at 64-token pages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_dsa_jax.cache import eager
from glm5_dsa_jax.cache.eager import explicit_sharding
from glm5_dsa_jax.cache.pages import OK
from glm5_dsa_jax.cache.rollback import shift_stage

__all__ = ["fork_rows", "check_fork", "fork_args", "shared_prefix_bytes"]


def fork_args(cache, src_rows, dst_rows, lengths):
    """``(src_rows, dst_rows, lengths)`` as ``[M]`` int32 arrays, or ``ValueError`` naming the
    argument: one-dimensional integer arrays of one length ``M >= 1`` (dtype and shape only:
    runs under jit)."""
    out = []
    for name, v in (("src_rows", src_rows), ("dst_rows", dst_rows), ("lengths", lengths)):
        arr = v if isinstance(v, jax.Array) else np.asarray(v)
        if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1 or arr.shape[0] < 1:
            raise ValueError(f"fork {name} must be a one-dimensional integer array of M >= 1 entries "
                             f"(one per fork), got {arr.dtype} {tuple(np.shape(arr))}")
        out.append(arr)
    if not out[0].shape == out[1].shape == out[2].shape:
        raise ValueError(f"fork src_rows, dst_rows and lengths must have one length M, got "
                         f"{out[0].shape[0]}, {out[1].shape[0]} and {out[2].shape[0]}")
    return tuple(jnp.asarray(a, jnp.int32) for a in out)


def _held_from(cache, src_len, src_from):
    """The first position whose raw key a source's stage still holds."""
    return jnp.maximum(src_from, src_len - cache.stage_width)


def _stage_ok(cache, src_len, src_from, ell):
    """Whether the source's stage holds the raw keys of the incomplete pool of ``ell`` tokens."""
    kp = cache.kpool
    return (ell % kp == 0) | (ell - ell % kp >= _held_from(cache, src_len, src_from))


def check_fork(cache, src_rows, dst_rows, lengths) -> None:
    """``ValueError`` naming every fork ``i`` that would be refused (the module doc), with the
    rows and the sizes, and a broken page table (``PageTable.check``). Concrete values only
    (an eager call, ``PagedDecoder``); nothing is changed."""
    cache.pages.check()
    src, dst, ell = (np.asarray(a).astype(np.int64) for a in (src_rows, dst_rows, lengths))
    m, ps = cache.max_seqs, cache.page_size
    per = m // cache.pages.shards
    length = np.asarray(cache.lengths)
    stage_from = None if not cache.has_indexer else np.asarray(cache.stage_from)
    problems, fresh = [], {}
    for i in range(src.size):
        s, d, n = int(src[i]), int(dst[i]), int(ell[i])
        head = f"fork {i} (row {s} -> row {d}, {n} tokens)"
        if not 0 <= s < m or not 0 <= d < m:
            problems.append(f"{head}: src_rows[{i}] = {s} and dst_rows[{i}] = {d} must be rows 0 .. {m - 1}")
        elif (dst == d).sum() > 1:
            problems.append(f"{head}: row {d} is the destination of forks {np.nonzero(dst == d)[0].tolist()}")
        elif s == d or d in src or s in dst:
            problems.append(f"{head}: a row is both a source and a destination (sources "
                            f"{src.tolist()}, destinations {dst.tolist()})")
        elif length[s] == 0:
            problems.append(f"{head}: row {s} holds no sequence (length 0: empty or released)")
        elif length[d] != 0:
            problems.append(f"{head}: row {d} is in use (holds {int(length[d])} tokens); release it first "
                            "or pick a free row")
        elif not 0 < n <= length[s]:
            problems.append(f"{head}: lengths[{i}] = {n} but row {s} holds {int(length[s])} tokens "
                            f"(1 <= lengths <= {int(length[s])})")
        elif s // per != d // per:
            problems.append(f"{head}: row {s} is in data shard {s // per} and row {d} in data shard "
                            f"{d // per} (rows of {per}): a fork shares pages, which stay in their shard")
        elif cache.has_indexer and not bool(_stage_ok(cache, int(length[s]), int(stage_from[s]), n)):
            held = max(int(_held_from(cache, int(length[s]), int(stage_from[s]))), 0)
            problems.append(
                f"{head}: the prefix's incomplete pool starts at position {n - n % cache.kpool}, but row "
                f"{s}'s stage holds the raw keys of positions {held} .. {int(length[s]) - 1} only (fork at a "
                f"multiple of index_kpool={cache.kpool}, at the source's length {int(length[s])}, or within "
                f"max_rollback={cache.max_rollback} tokens of it)")
        elif n % ps:
            fresh.setdefault(d // per, []).append((d, i, n))
    n_free = np.asarray(cache.pages.n_free).reshape(-1)
    for shard, forks in fresh.items():  # rows take fresh pages in row order
        for k, (d, i, n) in enumerate(sorted(forks)):
            if k >= n_free[shard]:
                where = "" if n_free.size == 1 else f" in data shard {shard}"
                problems.append(f"fork {i} (into row {d}, {n} tokens) needs 1 fresh page for its partly "
                                f"filled last page ({n % ps} of {ps} tokens) but only {int(n_free[shard])} "
                                f"are free{where}, taken by the forks into rows before it")
    if problems:
        raise ValueError("cannot fork; nothing was changed: " + "; ".join(problems))


def _copy_pages(store, src, dst):
    """``store [N, ...]`` with page ``dst[b]`` a copy of page ``src[b]`` (``-1``: none). Never a
    one-row scatter (``paged._scatter_rows``' doc): one dropped row more. On ``Explicit``
    mesh axes (pools split over a data or sequence axis) the copied pages are gathered onto
    every device and each device writes the ones it holds (the output placed as ``store``)."""
    if store is None:
        return None
    n = store.shape[0]
    sharding = explicit_sharding(store)
    whole = None if sharding is None else NamedSharding(sharding.mesh, P())
    content = store.at[jnp.clip(src, 0, n - 1)].get(out_sharding=whole)
    at = jnp.where((src >= 0) & (dst >= 0), dst, n)
    at = jnp.concatenate([at, jnp.full((1,), n, at.dtype)])
    content = jnp.concatenate([content, jnp.zeros((1,) + store.shape[1:], store.dtype)])
    return store.at[at].set(content, mode="drop", out_sharding=sharding)


def fork_rows(cache, src_rows, dst_rows, lengths):
    """``PagedCache.fork(src_rows, dst_rows, lengths)``: the module doc. Eager calls are
    checked first (``check_fork``)."""
    src_rows, dst_rows, lengths = fork_args(cache, src_rows, dst_rows, lengths)
    if not eager.traced(cache, src_rows, dst_rows, lengths):  # checked, then one program placed as the cache
        check_fork(cache, src_rows, dst_rows, lengths)
        return eager.run(_fork_rows, cache, src_rows, dst_rows, lengths)
    return _fork_rows(cache, src_rows, dst_rows, lengths)


def _fork_rows(cache, src_rows, dst_rows, lengths):
    """The fork itself (``fork_rows`` after its checks; traced)."""
    m = cache.max_seqs
    at = jnp.where((dst_rows >= 0) & (dst_rows < m), dst_rows, m)
    # A negative source is no row: refused as out of range, not read as "no fork".
    src = jnp.full((m,), -1, jnp.int32).at[at].set(jnp.where(src_rows >= 0, src_rows, m), mode="drop")
    ell = jnp.zeros((m,), jnp.int32).at[at].set(lengths, mode="drop")
    refuse = jnp.zeros((m,), jnp.int32).at[at].add(1, mode="drop") > 1  # a row named twice
    s = jnp.clip(src, 0, m - 1)
    src_len = jnp.take(cache.lengths, s)
    if cache.has_indexer:
        refuse |= (src >= 0) & ~_stage_ok(cache, src_len, jnp.take(cache.stage_from, s), ell)
    pages, status, copy_from, copy_to = cache.pages.fork(src, ell, refuse)
    active = src >= 0
    ok = active & (status == OK)
    base = jnp.arange(m, dtype=jnp.int32) // (m // cache.pages.shards) * cache.pages.pages_per_shard
    from_page = jnp.where(copy_from >= 0, copy_from + base, -1)
    to_page = jnp.where(copy_to >= 0, copy_to + base, -1)
    upd = dict(pages=pages, status=jnp.where(active, status, cache.status).astype(jnp.int32))
    for name in ("latent_store", "latent_scale", "pooled_store", "pooled_scale"):
        upd[name] = _copy_pages(getattr(cache, name), from_page, to_page)
    if cache.has_indexer:
        r = src_len - ell
        for name in ("stage_keys", "stage_gate"):
            stage = getattr(cache, name)
            moved = shift_stage(jnp.take(stage, s, axis=0), r, ok)
            upd[name] = jnp.where(ok[:, None, None], moved, stage).astype(stage.dtype)
        held = _held_from(cache, src_len, jnp.take(cache.stage_from, s))
        upd["stage_from"] = jnp.where(ok, jnp.minimum(ell, held), cache.stage_from).astype(jnp.int32)
    return cache.replace(**upd)


def shared_prefix_bytes(cache, holders: int, prompt_tokens: int) -> tuple[int, int]:
    """``(shared, unshared)`` bytes of the pages a ``prompt_tokens``-token prompt takes in
    ``cache``'s pools (latent rows, pooled keys, fp8 scales) when ``holders`` sequences hold
    it: once, shared by reference, or once per sequence. Shapes only (a ``jax.eval_shape``
    cache will do)."""
    per_page = sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize
                   for a in (cache.latent_store, cache.latent_scale, cache.pooled_store, cache.pooled_scale)
                   if a is not None)
    pages = -(-prompt_tokens // cache.page_size)
    return pages * per_page, holders * pages * per_page
