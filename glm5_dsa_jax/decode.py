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
  never a weight-sized intermediate), the hidden state's five products as one against
  their joined copy (``cpu_policy``, "Joined products"; ``step.module(params)`` merges
  the layer so that its members share it); a placed one reads the stored layout.
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
* ``steps(hiddens [B, n, hidden], mask [B, n], prev_topk)`` (both decoders) runs ``n``
  single-token decode steps in one compiled program and equals ``n`` calls exactly (each
  step is the module call of one step, traced once; the cache donated and updated in
  place): for a caller with several tokens between host visits (teacher forcing, a draft
  to verify). On a GPU up to ``UNROLL_STEPS`` steps are unrolled (a rolled loop cost
  15-60 us a step there), on a CPU the loop is rolled (unrolled, XLA:CPU copied the cache
  at every step). It is checked and refused as one chunk of ``n`` tokens would be, which
  for either cache is exactly when one of the ``n`` calls would be refused.

What a decoder call does on the host, and why that is all (once compiled; a call's
inputs are jax arrays, the hidden states in the compute dtype and a bool mask or None):

* shape / dtype compares of the inputs (``_fast_inputs``; other inputs go through
  ``layer.check_inputs``, which converts them and reads a 0/1 mask's or a shared layer's
  ``prev_topk``'s values: the refusal before donation needs them), the cache's shapes
  (``cache.check``) and, for ``DsaDecoder``, the room from its host ``length``;
* for ``PagedDecoder``, the room: the mask read to the host (a ``[B, S]`` bool) and the
  pages each row takes counted in numpy on the host's copy of the lengths and free pages
  that the decoder keeps in step with the cache it left (``_room_after``). The whole table
  is validated and reserved on a host copy (``cache.check_chunk``, milliseconds of eager
  ops) only for a cache the decoder did not leave itself, a shared layer's ``prev_topk``,
  or a chunk that does not fit (its error names the rows);
* the parameters the compiled step reads (``step.compute_params``: float32 or
  contraction-last copies on a CPU) fetched from a cache kept while the layer's parameter
  arrays are the same objects (one flatten of ``params`` and an identity compare per
  leaf), and a cached all-True mask for ``mask=None``;
* one dispatch of the compiled program, the cache donated (no buffer is re-created: the
  program's outputs are the next call's inputs).

No eager op, compilation or host-to-device transfer happens in a call, and a contiguous
call reads nothing back from the device (``tests/test_decode_steps.py`` counts them).
Tiny preset, bf16, batch 2, one core of the project's loaded 2-core CPU, jax 0.10.2, best
of 5 blocks of 50 calls: a ``DsaDecoder`` decode call took 343-472 us where the compiled
step called directly on the same arrays takes 130 us; now 158-176 us (1.2-1.35x).
``PagedDecoder``: 7,700 us (the eager reservation on a host copy), now 272 us against 171
us direct. ``steps(8)``: 71 us a token contiguous, 102 paged (rolled scan).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm5_dsa_jax.cache import DsaCache, check_fits
from glm5_dsa_jax.cpu_policy import (
    WIDE_ROWS, contraction_last_context, contraction_last_params, float32_params, float32_products_context,
    joined_rows, on_cpu, shared_joined,
)
from glm5_dsa_jax.model.layout import contraction_orders, joined_products
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
    # A GPU's plain products multiply each group of weights that reads one activation as
    # one product against the group's joined copy (cpu_policy, "Joined products").
    joined = joined_products() if orders is not None and not cpu_forms else ()
    rows_of_joined = joined_rows(params, orders, joined) if joined else {}

    def contraction_last_rows(rows: int) -> bool:
        """Whether a call of ``rows`` query rows multiplies contraction-last copies."""
        return orders is not None and (rows >= WIDE_ROWS or not cpu_forms)

    def compute(p, rows: int = 1):
        """The parameters the compiled step reads for a call of ``rows`` query rows."""
        if contraction_last_rows(rows):
            return contraction_last_params(p, orders, joined)
        return float32_params(p) if wide else p

    def products_for(rows: int):
        """The product context a call of ``rows`` query rows is traced in (``cpu_policy``):
        contraction-last products, float32 ones, or neither."""
        if contraction_last_rows(rows):
            return contraction_last_context(cpu_forms=cpu_forms, joined=rows_of_joined)
        return float32_products_context(wide)

    def module_of(params):
        """The layer over what a compiled step reads (inside its trace): each joined
        group's members share one value, so their group is one product."""
        return nnx.merge(graphdef, shared_joined(params, rows_of_joined))

    def step_fn(params, hidden, mask, cache: DsaCache, prev_topk=None):
        traces["n"] += 1
        module = module_of(params)
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
        #: ``module(params)``: the layer over ``compute_params``' output, inside a trace
        module = staticmethod(module_of)

        @property
        def traces(self) -> int:
            return traces["n"]

    return _Step(), params


def _rows(hidden) -> int:
    """Query rows of a call's ``hidden [B, S, ...]`` (``B x S``; 1 for anything else)."""
    shape = getattr(hidden, "shape", ())
    return int(shape[0]) * int(shape[1]) if len(shape) >= 2 else 1

#: ``steps`` on a GPU (any platform but the CPU) unrolls up to this many decode steps
#: (``lax.scan(..., unroll=True)``): the program is each step's own kernels one after
#: another, no loop. A rolled loop cost 15-60 us per iteration on a GPU, unrolled ones
#: nothing extra; past this count a rolled scan keeps the compile time flat. On a CPU the
#: scan is rolled whatever ``n``: XLA:CPU copied the cache ~4 times per unrolled step (30
#: cache-sized copies in 8 steps, none rolled; tiny preset: 404 us a token unrolled, 77
#: rolled, 127 one step per call).
UNROLL_STEPS = 16


class _Programs:
    """What both decoders run per call, on the host: O(1) Python and the compiled program.

    * ``compute(rows)``: the parameters the compiled step reads (``step.compute_params``),
      made once and reused while the layer's parameter arrays are the same objects (one
      identity compare per leaf; a replaced parameter is seen at the next call).
    * ``run_steps``: ``n`` single-token steps in one compiled program (``steps``).
    """

    def _init_programs(self, layer: DsaAttention) -> None:
        self._computed = {}  # contraction_last(rows) -> (the leaves it was made from, params)
        self._ones = {}  # (B, S) -> an all-True mask on the device (mask=None)
        self._steps_jits = {}

    def _compute(self, rows: int):
        leaves = jax.tree.leaves(self.params)
        key = self.step.contraction_last(rows)
        hit = self._computed.get(key)
        if hit is not None and len(hit[0]) == len(leaves) and all(a is b for a, b in zip(hit[0], leaves)):
            return hit[1]
        made = self.step.compute_params(self.params, rows)
        self._computed[key] = (leaves, made)
        return made

    def _fast_inputs(self, hidden, mask, prev_topk):
        """``(x, mask)`` when the call's inputs need no conversion and no value check (a
        jax array ``[B, S, hidden]`` in the compute dtype, a bool jax mask ``[B, S]`` or
        None, no ``prev_topk``): shape and dtype compares only, nothing dispatched. Else
        None, and the caller runs ``layer.check_inputs``."""
        layer = self.layer
        if (prev_topk is not None or not layer.has_indexer or not isinstance(hidden, jax.Array)
                or hidden.ndim != 3 or hidden.dtype != layer.dtype
                or hidden.shape[2] != layer.cfg.hidden_size or 0 in hidden.shape):
            return None
        bs = hidden.shape[:2]
        if mask is None:
            if bs not in self._ones:
                self._ones[bs] = jnp.ones(bs, bool)
            mask = self._ones[bs]
        elif not (isinstance(mask, jax.Array) and mask.dtype == jnp.bool_ and mask.shape == bs):
            return None
        return hidden, mask

    def _steps_jit(self, cache):
        """The compiled ``n``-step program for a cache of this structure (``make_step``'s
        shardings on a placed layer)."""
        layer, step = self.layer, self.step

        def run(params, hiddens, masks, cache, prev_topk, unroll):
            module = step.module(params)

            def one(cache, xs):
                x, m, p = xs
                out, topk, cache = module(x[:, None], attention_mask=m[:, None], cache=cache,
                                          prev_topk=None if p is None else p[:, None])
                return cache, (out[:, 0], topk[:, 0])

            xs = (jnp.swapaxes(hiddens, 0, 1), masks.T, None if prev_topk is None else jnp.swapaxes(prev_topk, 0, 1))
            with step.products(hiddens.shape[0]):  # each step's rows: B, as one step's
                cache, (outs, topks) = jax.lax.scan(one, cache, xs, unroll=unroll)
            return jnp.swapaxes(outs, 0, 1), jnp.swapaxes(topks, 0, 1), cache

        mesh = layer.mesh
        key = None if mesh is None else jax.tree.structure(cache)
        if key not in self._steps_jits and mesh is None:
            self._steps_jits[key] = jax.jit(run, static_argnames="unroll", donate_argnames="cache")
        elif key not in self._steps_jits:
            rows = batch_sharding(layer)
            cache_sh = cache_shardings(cache, mesh, layer.batch_axis, layer.placement.seq_axis)
            params_sh = jax.tree.map(lambda a: a.sharding, self._compute(1))
            self._steps_jits[key] = jax.jit(
                run, static_argnames="unroll", donate_argnames="cache",
                in_shardings=(params_sh, rows, rows, cache_sh, rows), out_shardings=(rows, rows, cache_sh))
        return self._steps_jits[key]

    def _run_steps(self, x, mask, prev_topk, unroll):
        n = x.shape[1]
        cache = self.cache
        if unroll is None:
            on_cpu = all(d.platform == "cpu" for d in jax.tree.leaves(cache)[0].devices())
            unroll = 1 if on_cpu or n > UNROLL_STEPS else True
        out, topk, self.cache = self._steps_jit(cache)(self._compute(x.shape[0]), x, mask, cache, prev_topk,
                                                       unroll=unroll)
        return out, topk


class DsaDecoder(_Programs):
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
        self._init_programs(layer)

    @property
    def max_length(self) -> int:
        return self.cache.max_length

    def _checked(self, hidden, mask, prev_topk):
        """The call's inputs, checked on the host before anything is donated: shapes and
        dtypes only for jax arrays already in the compute dtype (``_fast_inputs``), else
        ``layer.check_inputs`` (conversions, 0/1 masks, a shared layer's causal ``prev_topk``:
        those read values); room from the host's ``length``; the cache's shapes."""
        fast = self._fast_inputs(hidden, mask, prev_topk)
        if fast is None:
            x, mask, prev_topk = self.layer.check_inputs(hidden, mask, prev_topk, start=self.length)
        else:
            (x, mask), prev_topk = fast, None
        b, s, _ = x.shape
        check_fits(self.cache, s, self.length)
        self.cache.check(self.layer.cfg, self.layer.has_indexer, b)
        return x, mask, prev_topk

    def __call__(self, hidden, mask=None, prev_topk=None):
        x, mask, prev_topk = self._checked(hidden, mask, prev_topk)
        cache = self.cache
        out, topk, self.cache = self.step.jitted(cache)(self._compute(x.shape[0] * x.shape[1]), x, mask,
                                                        cache, prev_topk)
        self.length += x.shape[1]
        return out, topk

    def steps(self, hiddens, mask=None, prev_topk=None, *, unroll=None):
        """``n`` decode steps in one compiled program: ``hiddens [B, n, hidden]`` are the
        inputs of ``n`` successive positions (teacher-forced tokens, a draft to verify),
        ``mask [B, n]`` and ``prev_topk [B, n, out_width]`` (a shared layer) as ``n``
        calls' columns. Returns ``(out [B, n, hidden], topk [B, n, out_width])``, and leaves
        the cache, exactly as ``n`` calls ``self(hiddens[:, i:i+1], mask[:, i:i+1], ...)``
        would (each step is the single-token step, one after another; the cache donated
        and updated in place). Refused before anything runs when ``n`` tokens do not fit.
        On a GPU up to ``UNROLL_STEPS`` steps are unrolled (``unroll=True``: each step's
        kernels one after another); past that, and on a CPU, a rolled ``lax.scan`` whose
        body is the step (``unroll``: scan's, to choose). One compilation per ``n``."""
        x, mask, prev_topk = self._checked(hiddens, mask, prev_topk)
        out, topk = self._run_steps(x, mask, prev_topk, unroll)
        self.length += x.shape[1]
        return out, topk

    def rollback(self, n_tokens) -> None:
        """Drop the last ``n_tokens`` slots of the batch (rejected drafts; ``DsaCache.rollback``:
        one count for every row). Refused before the donated write (``ValueError`` naming
        ``n_tokens`` and the sizes, nothing changed); compiled once, whatever the count."""
        n = timeline_count(self.cache, n_tokens)
        check_timeline_rollback(self.cache, int(n))
        self.cache = self._rollback(self.cache, n)
        self.length -= int(n)


def _room_after(lengths, n_free, n_new, page_size: int, max_length: int):
    """``(lengths, n_free)`` (host numpy) after every row ``b`` takes the pages for
    ``n_new[b]`` more tokens in row order (``PageTable.reserve``: each data shard, ``n_free``
    ``[shards]``, from its own free pages), or None when a row would not get them (too long,
    or too few free pages): O(rows) numpy, nothing dispatched."""
    new = lengths + n_new
    if (new > max_length).any():
        return None
    need = (new + page_size - 1) // page_size - (lengths + page_size - 1) // page_size
    per = need.reshape(n_free.size, -1)  # rows of each shard, in order
    if (per.sum(axis=1) > n_free).any():  # rows take pages in order: all fit iff the total does
        return None
    return new, n_free - per.sum(axis=1)


def _release(cache: PagedCache, rows):
    return cache.release(rows)


def _rollback(cache: PagedCache, rows, n_tokens):
    return cache.rollback(rows, n_tokens)


def _fork(cache: PagedCache, src_rows, dst_rows, lengths):
    return cache.fork(src_rows, dst_rows, lengths)


class PagedDecoder(_Programs):
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
        self._init_programs(layer)
        self._room = None  # (the cache it mirrors, lengths [max_seqs], n_free [shards]): host numpy

    @property
    def lengths(self):
        """``[max_seqs]`` tokens each sequence holds (host numpy)."""
        return jax.device_get(self.cache.lengths)

    def _checked(self, hidden, mask, prev_topk):
        """The call's inputs, checked on the host before anything is donated, and the
        host's copy of the lengths and free pages after the chunk (``_room``). The room is
        counted on that copy, which ``__call__`` / ``steps`` keep in step with the cache
        they leave: the mask is read (one small device-to-host copy when it is a device
        array) and nothing is dispatched. On a cache this decoder did not leave itself
        (the first call, after ``release`` / ``rollback`` / ``fork`` / ``load``, a cache
        assigned from outside), for a shared layer's ``prev_topk`` and for a chunk that
        does not fit (its error names the rows), ``cache.check_chunk`` runs whole: the
        table validated and reserved on a host copy (``check_room``)."""
        fast = self._fast_inputs(hidden, mask, prev_topk)
        if fast is None:
            x, mask, prev_topk = self.layer.check_inputs(hidden, mask, prev_topk)
        else:
            (x, mask), prev_topk = fast, None
        cache = self.cache
        n_new = np.asarray(mask, bool).sum(axis=1, dtype=np.int64)
        room = self._room if self._room is not None and self._room[0] is cache else None
        after = None if room is None or prev_topk is not None or x.shape[0] != cache.max_seqs else \
            _room_after(room[1], room[2], n_new, cache.page_size, cache.max_length)
        if after is None:
            cache.check_chunk(self.layer.cfg, self.layer.has_indexer, x.shape[0], mask, prev_topk)
            lengths, n_free = (np.asarray(a).astype(np.int64) for a in (cache.pages.lengths, cache.pages.n_free))
            after = _room_after(lengths, n_free.reshape(-1), n_new, cache.page_size, cache.max_length)
            assert after is not None, "check_chunk passed a chunk the host's count refuses"
        return x, mask, prev_topk, after

    def _leave(self, after) -> None:
        self._room = (self.cache, *after)

    def __call__(self, hidden, mask=None, prev_topk=None):
        x, mask, prev_topk, after = self._checked(hidden, mask, prev_topk)
        cache = self.cache
        out, topk, self.cache = self.step.jitted(cache)(self._compute(x.shape[0] * x.shape[1]), x, mask,
                                                        cache, prev_topk)
        self._leave(after)
        return out, topk

    def steps(self, hiddens, mask=None, prev_topk=None, *, unroll=None):
        """``n`` decode steps in one compiled program: ``hiddens [max_seqs, n, hidden]``,
        ``mask [max_seqs, n]`` and ``prev_topk`` (a shared layer) as ``n`` calls' columns;
        row ``b``'s valid tokens extend sequence ``b`` one per step. Returns ``(out, topk)``
        ``[max_seqs, n, ...]`` and leaves the cache (pages, lengths, ``status``: the last
        step's) exactly as ``n`` calls ``self(hiddens[:, i:i+1], mask[:, i:i+1], ...)``
        would. Refused before anything runs (``ValueError`` naming the sequence) when the
        pages of all ``n`` tokens are not free: exactly when one of the ``n`` calls would
        be, since rows take pages in row order and a need only grows. ``unroll`` as
        ``DsaDecoder.steps``."""
        x, mask, prev_topk, after = self._checked(hiddens, mask, prev_topk)
        out, topk = self._run_steps(x, mask, prev_topk, unroll)
        self._leave(after)
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
