"""Jit-compiled decode: one pure step function, compiled once per chunk length.

Invariants:

* The module is split once (``nnx.split``); the step is a pure function of
  ``(params, hidden, mask, cache, prev_topk)`` that merges the graph inside the trace, so
  no Python object is traversed per step.
* The cache argument is donated: a step updates the caches in place on the device.
* On a placed layer the step's inputs, outputs and cache have explicit shardings
  (``sharding.batch_sharding`` for the rows: split over a ``batch_axis`` or replicated;
  ``sharding.cache_shardings`` for the cache), so nothing moves between steps; the jitted
  function is made once per cache structure (contiguous or paged, with or without indexer
  state), since the cache's shardings are a pytree of its fields.
* No shape depends on the current length (``cache.length`` is a traced scalar), so a
  decode of any number of steps compiles once; each distinct prefill chunk length
  compiles once more.
* On a CPU (``layer.float32_compute()``) the step applies the CPU policy
  (``glm5_dsa_jax.cpu_policy``): a call of ``WIDE_ROWS`` query rows or more (``batch x
  chunk``; 1: every call) on an unplaced layer of 16-bit weights is traced with
  contraction-last products and multiplies by cached copies of the weights with their
  contracted axes last (``contraction_last_params``); otherwise (a layer placed by
  ``shard_layer``, a float32 layer) it is traced with float32 products on and multiplies
  by cached float32 copies of the parameters it is given (``float32_params``).
  On any other backend (a GPU; or parameters not yet placed, a step compiled ahead of
  time) an unplaced layer's step multiplies the same contraction-last copies as plain
  products (``cpu_policy``, "Products on a GPU": one row-reduce or GEMM fusion a product,
  never a weight-sized intermediate); a placed one reads the stored layout.
  The caller's ``params`` are the layer's own, in their own dtype; only the arrays handed
  to the compiled function differ. The choice is made from the input's static shape, so
  it never adds a compilation.
* ``DsaDecoder`` keeps the length on the host too, so a chunk that would overflow the
  cache is refused before anything is launched or donated: the cache is left exactly as
  it was. (Inside the step itself an overflowing chunk is also harmless: its writes are
  dropped and ``length`` does not move.)
* ``PagedDecoder`` does the same for a paged cache: before the step, the pages every row's
  chunk needs are reserved on a copy (``PagedCache.check_chunk``) and a shortfall raises
  ``ValueError`` naming the sequence; inside a step a row that does not fit writes nothing
  and ``cache.status`` says why. Sequences join (a row's next valid tokens start a new
  sequence after ``release``) and leave without recompiling: ``release`` is jitted once.
  A sequence moves between decoders (``export`` / ``load``, ``glm5_dsa_jax.cache.transfer``):
  the load is refused before its donated write when it cannot fit. Rejected drafts are
  taken back (``rollback`` / ``truncate``, ``glm5_dsa_jax.cache.rollback``), refused before
  the donated write when the stage cannot restore them; jitted once. A sequence forks into
  free rows that share its prefix's pages (``fork``, ``glm5_dsa_jax.cache.fork``), refused
  before the donated write; jitted once per number of forks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm5_dsa_jax.cache import DsaCache, check_fits
from glm5_dsa_jax.cpu_policy import (
    WIDE_ROWS, contraction_last_context, contraction_last_params, float32_params, float32_products_context,
    on_cpu,
)
from glm5_dsa_jax.model.layout import contraction_orders
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.cache import PagedCache
from glm5_dsa_jax.cache.paged import release_mask
from glm5_dsa_jax.cache.fork import check_fork, fork_args
from glm5_dsa_jax.cache.rollback import (
    check_rollback, check_timeline_rollback, counts, rollback_timeline, timeline_count,
)
from glm5_dsa_jax.cache.transfer import ExportedSequence, load_sequence
from glm5_dsa_jax.parallel.sharding import batch_sharding, cache_shardings

__all__ = ["make_step", "DsaDecoder", "PagedDecoder"]


def make_step(layer: DsaAttention, *, donate: bool = True):
    """Split ``layer`` once and return ``(step, params)``.

    ``step(params, hidden [B, S, hidden], mask [B, S] bool, cache, prev_topk=None)`` returns
    ``(out [B, S, hidden], topk [B, S, out_width] int32, cache)``; it is ``jax.jit``-compiled
    with ``cache`` donated. ``step.traces`` counts how many times it was traced (compiled).
    Whether it computes in float32 on a CPU is decided here, from where the layer's
    parameters are (``layer.float32_compute()``); ``step.float32`` says which.
    """
    graphdef, params = nnx.split(layer)
    traces = {"n": 0}
    wide = layer.float32_compute()
    # Contraction-last copies of an unplaced layer (cpu_policy's module doc): on a CPU for
    # 16-bit weights (a float32 layer's float32 products are already its own), in XLA:CPU's
    # forms; on any other backend (or abstract parameters, compiled ahead of time) for every
    # dtype, as plain products ("Products on a GPU").
    narrow = jnp.dtype(layer.param_dtype).itemsize == 2
    cpu = on_cpu(params)
    cpu_forms = wide and narrow
    orders = contraction_orders() if layer.mesh is None and (cpu_forms or not cpu) else None

    def contraction_last_rows(rows: int) -> bool:
        """Whether a call of ``rows`` query rows multiplies contraction-last copies."""
        return orders is not None and (rows >= WIDE_ROWS or not cpu_forms)

    def compute(p, rows: int = 1):
        """The parameters the compiled step reads for a call of ``rows`` query rows."""
        if contraction_last_rows(rows):
            return contraction_last_params(p, orders)
        return float32_params(p) if wide else p

    def products_for(rows: int):
        """The product context a call of ``rows`` query rows is traced in (``cpu_policy``):
        contraction-last products, float32 ones, or neither."""
        if contraction_last_rows(rows):
            return contraction_last_context(cpu_forms=cpu_forms)
        return float32_products_context(wide)

    def step_fn(params, hidden, mask, cache: DsaCache, prev_topk=None):
        traces["n"] += 1
        module = nnx.merge(graphdef, params)
        with products_for(hidden.shape[0] * hidden.shape[1]):
            return module(hidden, attention_mask=mask, cache=cache, prev_topk=prev_topk)

    mesh = layer.mesh
    donated = ("cache",) if donate else ()
    jits = {}

    def jitted_for(cache):
        """The compiled step for a cache of this structure. A placed layer gets explicit
        shardings, so the parameters stay where shard_layer put them and the inputs,
        outputs and cache (replicated, or split over a batch axis and a sequence axis)
        never move."""
        key = None if mesh is None else jax.tree.structure(cache)
        if key not in jits and mesh is None:
            jits[key] = jax.jit(step_fn, donate_argnames=donated)
        elif key not in jits:
            rows = batch_sharding(layer)
            cache_sh = cache_shardings(cache, mesh, layer.batch_axis, layer.placement.seq_axis)
            jits[key] = jax.jit(
                step_fn, donate_argnames=donated,
                in_shardings=(jax.tree.map(lambda a: a.sharding, params), rows, rows, cache_sh, rows),
                out_shardings=(rows, rows, cache_sh))
        return jits[key]

    class _Step:
        """The compiled step; ``traces`` is the number of compilations so far."""

        jitted = staticmethod(jitted_for)  # jitted(cache): the jax.jit function for that cache

        def __call__(self, params, hidden, mask, cache, prev_topk=None):
            return jitted_for(cache)(compute(params, _rows(hidden)), hidden, mask, cache, prev_topk)

        def lower(self, params, hidden, mask, cache, prev_topk=None):
            return jitted_for(cache).lower(compute(params, _rows(hidden)), hidden, mask, cache, prev_topk)

        float32 = wide
        #: ``compute_params(params, rows=1)``: what the compiled step reads for ``rows`` query rows
        compute_params = staticmethod(compute)
        #: ``contraction_last(rows)``: whether such a call multiplies contraction-last copies
        contraction_last = staticmethod(contraction_last_rows)
        #: ``products(rows)``: the context to trace such a call's products in (a program
        #: beside the step, e.g. the bench's dense step, multiplies as the step does)
        products = staticmethod(products_for)

        @property
        def traces(self) -> int:
            return traces["n"]

    return _Step(), params


def _rows(hidden) -> int:
    """Query rows of a call's ``hidden [B, S, ...]`` (``B x S``; 1 for anything else)."""
    shape = getattr(hidden, "shape", ())
    return int(shape[0]) * int(shape[1]) if len(shape) >= 2 else 1


class DsaDecoder:
    """A layer, its cache and its compiled step: prefill in chunks, then decode.

    >>> dec = DsaDecoder(layer, batch_size=2, max_length=4096)
    >>> out, topk = dec(prompt, mask)            # prefill (any chunk length)
    >>> out, topk = dec(next_hidden, next_mask)  # one decode step, [B, 1, hidden]

    For a ``"shared"`` layer pass ``prev_topk``, the top-k its full layer returned for
    the same chunk. ``cache_dtype``, ``max_rollback``, ``latent_layout``, ``rotate_index`` and
    ``index_keys`` are ``DsaAttention.init_cache``'s (an fp8 cache's format: ``glm5_dsa_jax.cache.fp8``).
    """

    def __init__(self, layer: DsaAttention, batch_size: int, max_length: int, *, cache_dtype=None,
                 max_rollback: int = 1, latent_layout: str = "group", rotate_index: bool = False,
                 index_keys: str = "e4m3"):
        self.layer = layer
        self.step, self.params = make_step(layer)
        self.cache = layer.init_cache(batch_size, max_length, dtype=cache_dtype, max_rollback=max_rollback,
                                      latent_layout=latent_layout, rotate_index=rotate_index,
                                      index_keys=index_keys)
        self.length = 0  # host mirror of cache.length
        self._rollback = jax.jit(rollback_timeline, donate_argnums=0)

    @property
    def max_length(self) -> int:
        return self.cache.max_length

    def __call__(self, hidden, mask=None, prev_topk=None):
        # Checks that need concrete values (0/1 masks, shapes) run eagerly, before donation.
        x, mask, prev_topk = self.layer.check_inputs(hidden, mask, prev_topk, start=self.length)
        b, s, _ = x.shape
        check_fits(self.cache, s, self.length)
        self.cache.check(self.layer.cfg, self.layer.has_indexer, b)
        out, topk, self.cache = self.step(self.params, x, mask, self.cache, prev_topk)
        self.length += s
        return out, topk

    def rollback(self, n_tokens) -> None:
        """Drop the last ``n_tokens`` slots of the batch (rejected drafts; ``DsaCache.rollback``:
        one count for every row). Refused before the donated write (``ValueError`` naming
        ``n_tokens`` and the sizes, nothing changed); compiled once, whatever the count."""
        n = timeline_count(self.cache, n_tokens)
        check_timeline_rollback(self.cache, int(n))
        self.cache = self._rollback(self.cache, n)
        self.length -= int(n)


def _release(cache: PagedCache, rows):
    return cache.release(rows)


def _rollback(cache: PagedCache, rows, n_tokens):
    return cache.rollback(rows, n_tokens)


def _fork(cache: PagedCache, src_rows, dst_rows, lengths):
    return cache.fork(src_rows, dst_rows, lengths)


class PagedDecoder:
    """A layer, its paged cache and its compiled step: many sequences of their own lengths,
    joining and leaving.

    >>> dec = PagedDecoder(layer, max_seqs=8, num_pages=4096)   # 64-token pages
    >>> out, topk = dec(x, mask)     # x [8, S, hidden]: row b's valid tokens extend sequence b
    >>> dec.release(done)            # done [8] bool: those sequences give their pages back

    Every decode step (``S = 1``) runs one compiled program whatever the lengths and
    whichever sequences are live; each distinct chunk length compiles once more. ``topk``
    holds positions within each row's own sequence. The cache keywords are
    ``DsaAttention.init_paged_cache``'s.
    """

    def __init__(self, layer: DsaAttention, max_seqs: int, num_pages: int, page_size: int = 64, *,
                 cache_dtype=None, pages_per_seq: int | None = None, max_rollback: int = 1,
                 latent_layout: str = "group", rotate_index: bool = False, index_keys: str = "e4m3"):
        self.layer = layer
        self.step, self.params = make_step(layer)
        self.cache = layer.init_paged_cache(max_seqs, num_pages, page_size, cache_dtype,
                                            pages_per_seq=pages_per_seq, max_rollback=max_rollback,
                                            latent_layout=latent_layout, rotate_index=rotate_index,
                                            index_keys=index_keys)
        self._release = jax.jit(_release, donate_argnums=0)
        self._rollback = jax.jit(_rollback, donate_argnums=0)
        self._fork = jax.jit(_fork, donate_argnums=0)

    @property
    def lengths(self):
        """``[max_seqs]`` tokens each sequence holds (host numpy)."""
        return jax.device_get(self.cache.lengths)

    def __call__(self, hidden, mask=None, prev_topk=None):
        # Checks that need concrete values run eagerly, before donation.
        x, mask, prev_topk = self.layer.check_inputs(hidden, mask, prev_topk)
        self.cache.check_chunk(self.layer.cfg, self.layer.has_indexer, x.shape[0], mask, prev_topk)
        out, topk, self.cache = self.step(self.params, x, mask, self.cache, prev_topk)
        return out, topk

    def export(self, row: int) -> ExportedSequence:
        """Sequence ``row`` as host arrays (``PagedCache.export``): to load into another
        decoder's cache (another page count, page size or mesh) or to park it."""
        return self.cache.export(row)

    def load(self, row: int, exported: ExportedSequence) -> None:
        """Place ``exported`` into the free row ``row`` (``PagedCache.load``: the same
        refusals, before anything is written or donated); the write is compiled once per
        power of two of pages and donates the cache. The row's next valid tokens then
        extend the loaded sequence; its ``topk`` holds positions within that sequence."""
        self.cache = load_sequence(self.cache, row, exported, donate=True)

    def release(self, rows) -> None:
        """End the sequences where ``rows`` (``[max_seqs]`` bool; ``PagedCache.release``:
        integer ids or masks are refused): their pages return to the pool and those rows
        start new sequences at position 0."""
        self.cache = self._release(self.cache, release_mask(rows, self.cache.max_seqs))

    def rollback(self, rows, n_tokens) -> None:
        """Drop the last ``n_tokens[b]`` tokens of each sequence where ``rows`` (``[max_seqs]``
        bool, ``n_tokens`` ``[max_seqs]`` int): rejected drafts (``PagedCache.rollback``).
        Refused before the donated write (``check_rollback``: ``ValueError`` naming the row,
        nothing changed); compiled once, whatever the rows and counts."""
        rows = release_mask(rows, self.cache.max_seqs, "rollback")
        n = np.asarray(n_tokens)
        check_rollback(self.cache, rows, counts(self.cache, n, False))
        self.cache = self._rollback(self.cache, rows, jnp.asarray(n, jnp.int32))

    def fork(self, src_rows, dst_rows, lengths) -> None:
        """Start each free row ``dst_rows[i]`` as the first ``lengths[i]`` tokens of sequence
        ``src_rows[i]`` (``[M]`` ints; ``PagedCache.fork``: shared pages, no copy but a partly
        filled last page). Refused before the donated write (``check_fork``: ``ValueError``
        naming the row and the sizes, nothing changed); compiled once per ``M``."""
        args = fork_args(self.cache, *(np.asarray(a) for a in (src_rows, dst_rows, lengths)))
        check_fork(self.cache, *args)
        self.cache = self._fork(self.cache, *args)

    def truncate(self, rows, lengths) -> None:
        """Shorten each sequence where ``rows`` to ``lengths[b]`` tokens: ``rollback`` of
        ``lengths - self.lengths`` tokens (the same refusals)."""
        lengths = counts(self.cache, np.asarray(lengths), True)
        self.rollback(rows, np.asarray(self.lengths) - np.asarray(lengths))
