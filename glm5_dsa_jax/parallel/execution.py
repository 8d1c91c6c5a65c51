"""The one execution of a layer's call: placed or not, eager or traced.

``DsaAttention.__call__`` checks its inputs, then hands the call to ``run``. What runs is
always the plain, single-device pipeline (``DsaAttention.forward``); this module decides only *where*
and *how often it is compiled*:

* **Not placed**: the pipeline itself.
* **Placed** (``layer.placement``, set by ``shard_layer``): one ``jax.shard_map`` *manual
  over every mesh axis*. Each device gets its shard of the head-split parameters
  (``layout.partition_specs``), its rows of the inputs and of the cache when there is a
  batch axis (``placement.cache_specs``), everything else whole, and runs the plain
  pipeline on them; the only collective is the ``psum`` of the ``o_proj`` partial sums
  over the head axis (``ops.absorb_o(..., reduce_axis=)``). Tensor parallelism alone is
  the same program with the batch unsplit. Why manual over every axis: the body is plain
  per-device code, so no step needs a ``shard_map``, a ``device_put`` or an output
  sharding of its own (a ``pallas_call`` has no sharding rule: outside ``shard_map`` it
  fails on ``Explicit`` axes), and the step's collectives are exactly the one the body
  writes. It runs with ``check_vma=False`` for the same reason (no varying-axis rule).
* **Eager** (no argument traced): the whole call is one ``jax.jit`` program, cached in
  ``_PROGRAMS`` per function, ``nnx`` graphdef (the layer's structure and static
  attributes, its placement included), argument tree structure, specs and CPU float32
  policy (jit itself keys the shapes), so an eager step compiles nothing once warm,
  whatever closures the pipeline makes per call. This is the one mechanism that makes
  un-jitted calls cheap. **Under a trace** (``jax.jit``, ``make_step``) the body is
  inlined.

**Under autodiff** (``jax.grad`` / ``nnx.grad`` of a loss of the call's output) nothing here
changes: an eager call differentiated with respect to the layer (traced parameters,
concrete rows) runs its cached program under the differentiation (``jax.jit`` is
differentiable), a traced call is inlined. The placed call's ``shard_map`` transposes
with ``check_vma=False`` as JAX defines it: the cotangent of an output replicated over an
axis (``out`` over the head axis) is split evenly over that axis's devices, the body's
``psum`` transposes to a ``psum``, and the cotangent of a parameter replicated over an axis
(every parameter over the batch axis; all but the head-split ones over the head axis,
the ``o_proj`` bias added after the ``psum`` included) is ``psum``-ed over it. So the
gradients equal the unplaced layer's up to the order of the sums (TP and data x tp are
tested, ``tests/test_grad_layer.py``). On ``Explicit`` axes differentiate under
``jax.set_mesh(mesh)`` (JAX's rule for any explicitly sharded value: without it the
gradient's seed has no mesh); ``Auto`` axes need nothing.

Invariants:

* The layer's call never re-enters itself: the body calls the pipeline, not
  ``DsaAttention.__call__``, so the inputs are checked once.
* Inside the body a paged cache's page table is the shard's own: its ``n_free [1]`` is
  handed to the pipeline as the scalar of a one-shard table and put back after.
* Top-k rows are the unplaced layer's, bit for bit: each row's indexer arithmetic runs on
  one device over whole, replicated operands and does not depend on its neighbours.
* **Context parallelism** (a ``Placement.seq_axis``): a call with a cache runs
  ``parallel.context.forward`` as its body instead of the plain pipeline (the cache's
  token-axis fields are split over that axis, ``placement.cache_specs``); its collectives
  are the candidates' all-gather, the tail's and the attention partials' ``psum`` /
  ``pmax`` over the sequence axis, then the ``o_proj`` ``psum`` as above. Its top-k rows
  are the unplaced layer's bit for bit too (``context``'s module doc says why). A call
  with a paged cache runs ``parallel.context_paged.forward`` instead (its page pools are
  split by page over that axis, the page table replicated). A call
  without a cache runs the plain pipeline whole on every device of the sequence axis.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from glm5_dsa_jax.model import layout
from glm5_dsa_jax.cache import init_cache
from glm5_dsa_jax.cpu_policy import float32_products
from glm5_dsa_jax.parallel import context, context_paged
from glm5_dsa_jax.parallel.placement import cache_specs, check_batch

__all__ = ["run", "run_fn"]


def _pipeline(layer, x, mask, cache, prev_topk, position_ids, reduce_axis, modes=("sparse", None)):
    """The plain pipeline of one call on one device (``DsaAttention.forward``): ``(out,
    topk)`` without a cache (a fresh one sized to the input is used), ``(out, topk,
    cache)`` with one. ``modes``: the call's ``(attention, indexer_loss)``; with a loss
    (never with a cache) ``(out, topk, (kl_sum [B], n_loss_queries [B]))``."""
    attention, indexer_loss = modes
    kw = dict(reduce_axis=reduce_axis, attention=attention, indexer_loss=indexer_loss)
    seq_axis = None if layer.placement is None else layer.placement.seq_axis
    if cache is not None and seq_axis is not None and getattr(cache, "pages", None) is not None:
        return context_paged.forward(layer, x, mask, cache, prev_topk, position_ids, reduce_axis=reduce_axis,
                                     seq_axis=seq_axis, attention=attention)  # the paged cache's pools are split
    if cache is not None and seq_axis is not None:  # context parallelism: the cache's tokens are split
        return context.forward(layer, x, mask, cache, prev_topk, position_ids, reduce_axis=reduce_axis,
                               seq_axis=seq_axis, attention=attention)
    if cache is None:
        b, s, _ = x.shape
        fresh = init_cache(layer.cfg, b, s, has_indexer=layer.has_indexer, dtype=layer.dtype,
                           stage_dtype=layer.dtype)
        out, topk, _, *loss_rows = layer.forward(x, mask, fresh, prev_topk, position_ids, **kw)
        return (out, topk, *loss_rows)
    return layer.forward(x, mask, cache, prev_topk, position_ids, **kw)


def run(layer, x, mask, cache, prev_topk, position_ids, *, attention="sparse", indexer_loss=None):
    """The call of ``layer`` on checked inputs (``DsaAttention.__call__`` has run its
    checks): ``(out, topk)`` without a cache, ``(out, topk, cache)`` with one; with an
    ``indexer_loss`` (no cache) ``(out, topk, (kl_sum [B], n_loss_queries [B]))``: per-row
    sums, row outputs like ``out`` (split over a batch axis, no collective)."""
    outs, cache_out = run_fn(layer, _call_of(attention, indexer_loss), (x, mask, prev_topk, position_ids), cache)
    return outs if cache is None else (*outs, cache_out)


@functools.lru_cache(maxsize=None)
def _call_of(attention, indexer_loss):
    """The body of a call in these modes, one function per pair (``run_fn`` keys its
    programs by the function: a stable one keeps an eager call's program cached)."""

    def call(module, rows, cache, reduce_axis):
        x, mask, prev_topk, position_ids = rows
        res = _pipeline(module, x, mask, cache, prev_topk, position_ids, reduce_axis, (attention, indexer_loss))
        return (res if cache is None else res[:2]), (res[2] if cache is not None else None)

    return call


def run_fn(layer, fn, rows: tuple, cache=None):
    """``fn(module, rows, cache, reduce_axis) -> (row outputs, cache or None)`` run as a
    call of ``layer`` is (module doc): once, unplaced; or per device under one
    ``shard_map``, ``rows`` (``[B, ...]`` arrays or None, e.g. ``x``, ``mask``) and the row
    outputs split over the batch axis, the cache placed as ``placement.cache_specs``
    says, ``reduce_axis`` the head axis. Eagerly one cached ``jax.jit`` program: ``fn``
    must be a stable (module-level) function, it keys the program. ``run`` runs the
    layer's call through it, ``DsaAttention.selection_scores`` its indexer view."""
    placement = layer.placement
    if placement is None:
        if _traced((rows, cache)):
            return fn(layer, rows, cache, None)
        graphdef, state = nnx.split(layer)
        key = (fn, graphdef, jax.tree.structure((rows, cache)), float32_products())
        if key not in _PROGRAMS:
            _remember(key, jax.jit(_plain(fn, graphdef)))
        return _PROGRAMS[key](state, (rows, cache))
    bax = placement.batch_axis
    if bax is not None:
        check_batch(rows[0].shape[0], placement.mesh, bax)
    rows = placement.place_rows(*rows)
    cache = placement.place_call_cache(cache)
    row = placement.row_spec
    cache_spec = P() if cache is None else cache_specs(cache, bax, placement.seq_axis)
    specs = (((row,) * len(rows), cache_spec), (row, cache_spec))  # in, out
    graphdef, state = nnx.split(layer)
    spec_leaves, spec_tree = jax.tree.flatten(specs, is_leaf=_is_spec)
    key = (fn, graphdef, jax.tree.structure((rows, cache)), float32_products(), spec_tree,
           tuple(spec_leaves))
    if key not in _PROGRAMS:
        _remember(key, _sharded(fn, layer, graphdef, state, *specs))
    mapped, jitted = _PROGRAMS[key]
    return (mapped if _traced((state, rows, cache)) else jitted)(state, (rows, cache))


#: The programs of ``run_fn``, one per key (see ``run_fn``); jit keys the shapes itself.
_PROGRAMS: dict = {}
_MAX_PROGRAMS = 256


def _remember(key, program) -> None:
    """Keep ``program`` under ``key``, dropping the oldest beyond ``_MAX_PROGRAMS`` (a key
    holds a graphdef, hence the layer's static attributes and its mesh)."""
    while len(_PROGRAMS) >= _MAX_PROGRAMS:
        _PROGRAMS.pop(next(iter(_PROGRAMS)))
    _PROGRAMS[key] = program


def _traced(tree) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(tree))


def _is_spec(s) -> bool:
    return isinstance(s, P)


def _plain(fn, graphdef):
    """``fn`` on the module merged from ``graphdef`` and a state (the eager program's body)."""

    def plain(state, args):
        return fn(nnx.merge(graphdef, state), *args, None)
    return plain


def _param_specs(state, cfg, layer_idx, axis):
    """``PartitionSpec`` per leaf of an ``nnx.split`` state (the same tree): the layout's
    head-split specs."""
    plan = layout.partition_specs(cfg, axis, layer_idx=layer_idx)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    specs = [plan.get(tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)), P())
             for path, _ in leaves]
    return jax.tree.unflatten(treedef, specs)


def _local(cache):
    """A shard's view inside the body: a one-shard page table has a scalar ``n_free``."""
    pages = getattr(cache, "pages", None)
    if pages is not None and pages.n_free.ndim == 1:
        return cache.replace(pages=pages.replace(n_free=pages.n_free[0]))
    return cache


def _global(local, like):
    """``_local`` undone: the shard's ``n_free`` back as its ``[1]`` slice of the global one."""
    pages = getattr(like, "pages", None)
    if pages is not None and pages.n_free.ndim == 1:
        return local.replace(pages=local.pages.replace(n_free=local.pages.n_free.reshape(1)))
    return local


def _sharded(fn, layer, graphdef, state, in_specs, out_specs):
    """``(mapped, jitted)``: ``fn`` on the merged module under one ``shard_map`` manual over
    every mesh axis of ``layer.placement`` (module doc), and its ``jax.jit``."""
    placement = layer.placement
    state_specs = _param_specs(state, layer.cfg, layer.layer_idx, placement.axis)

    def body(state, args):
        rows, cache = args
        outs, new = fn(nnx.merge(graphdef, state), rows, _local(cache), placement.axis)
        return outs, (None if cache is None else _global(new, cache))

    mapped = jax.shard_map(body, mesh=placement.mesh, in_specs=(state_specs, in_specs),
                           out_specs=out_specs, check_vma=False)
    return mapped, jax.jit(mapped)
