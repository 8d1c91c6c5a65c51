"""The backend policy: what makes the ``"xla"`` path fast on a CPU, and the products fast
on a GPU ("Products on a GPU"), in one place, so the layer, the caches' users and the tools
never see it.

Invariants:

* A policy changes where bits live and how products are computed on a CPU, not what is
  computed: the bit storage is exact, and a float32 product rounded to the activation
  dtype is what XLA:CPU's 16-bit product computes (up to float32 accumulation order).
* Only the cache package (``glm5_dsa_jax.cache``) applies the bit storage; nothing else
  reads a cache's stored buffers (``latent_store`` / ``pooled_store``) or converts them.
* Only ``ops.matmul`` reads the float32-products setting, at trace time; only
  ``decode.make_step`` (and the eager programs of ``parallel.execution``, which carry it in
  their cache key) set it.

Bit storage of 16-bit / fp8 caches
----------------------------------

On a CPU a 16-bit float cache stores its latent rows and pooled keys as their bits
(``uint16``), an fp8 (e4m3) one as ``uint8``; the caches read them back as floats of
their ``dtype`` (``from_store``) and write float rows as bits (``to_store``). Why: XLA:CPU
on jax 0.10 converted a whole bf16 buffer to float32 and back around every one-row
``dynamic_update_slice`` (a 131,072-slot latent: ~25 ms a step per sequence) and around
every scatter, and an e4m3 buffer went through f16 likewise, whereas a ``uint16`` /
``uint8`` buffer is written in place. Writing through a ``uint16`` view of a bf16 buffer
does not help (XLA copies the buffer for the bitcasts), so the buffer itself must hold the
bits. A float32 cache, and any cache made while the default backend is not a CPU, is
stored as is: only XLA:CPU needs the bits, and a Pallas kernel handed a bitcast view of a
whole buffer could be given a copy of it. The choice is made once, when a cache is made
(``store_dtype``), and travels with its buffers' dtype.

Float32 products
----------------

XLA:CPU runs a bf16 matrix-vector product more than ten times slower than the float32
one, so on a CPU a compiled step (``decode.make_step``) that does not multiply
contraction-last copies (next section; a layer placed by ``shard_layer``) is handed
float32 copies of the layer's 16-bit parameters (``float32_params``)
and traces it inside ``float32_products_context()``: while that context is active,
``ops.matmul`` multiplies float32 operands and rounds each product to the activation
dtype, which is what XLA:CPU's bf16 product computes (bf16 -> float32 is exact; only the
float32 accumulation order can differ). Whether a layer uses it is decided from where its
parameters are (``uses_float32``): ``cpu_float32=False`` opts out, other platforms never
do. No other module sees the policy: the pipeline has no flag for it.

Contraction-last bf16 products (an unplaced layer)
--------------------------------------------------

XLA:CPU's float32 product is at the read floor for one row only: a decode of 8 rows
multiplied ``o_proj`` (``[16384, 4096]`` float32) in 32 ms where its bytes take 10.5 ms
(every YNNPACK float32 product of few rows re-packs its weight). Its bf16 product, on a
CPU with AMX, runs at the read floor of the bf16 bytes from 2 rows on, *if* the weight
is stored with its contraction axes last (``[N, K]``, HF's own ``[out, in]``): 9.4 ms at
8 rows (27 ms stored ``[K, N]``), but 74 ms for one row. (2 cores, jax 0.10.2,
2026-12-03.) So ``decode.make_step`` traces a call of ``WIDE_ROWS`` or more query rows
(``batch x chunk``) inside ``contraction_last_context()`` and hands it, instead of the
float32 copies, cached copies of the weights in their own dtype with the contraction
axes moved last (``contraction_last_params``; which axes a product contracts is the
layout table's ``Param.contract``). ``ops.matmul`` then multiplies the 16-bit operands
into a float32 accumulator and rounds the output: the same numbers as the float32
products (a product of two bf16 values is exact in float32), up to the accumulation
order. A placed layer keeps the float32 copies (its ``shard_map`` specs are the stored
layout's).

One row is the exception: its bf16 product ran at 74 ms. It is multiplied as two copies
of itself (``ops.matmul``), a product of two rows, and the first row of the result kept:
5.1 ms for ``o_proj``, against 11.8 ms for the float32 product of one row; the whole step
at batch 1 went from 24 to 14 ms (GLM-5.3-Flash, 4K tokens; 2026-12-04). So
``WIDE_ROWS`` is 1, and an unplaced 16-bit layer's step reads no float32 copy. (Padding
the row with a zero row instead ran at 9.6 ms.)

The same product of few rows runs 2.4x faster with the weight as its *left* operand:
``[N, K] x [M, K]^T -> [N, M]`` (``o_proj`` at 8 rows: 3.3 ms, faster than a ``jnp.sum``
of the same bytes, 5.7 ms; ``x @ w.T`` 7.9 ms. 2 cores, jax 0.10.2, 2026-12-04). XLA
folds a plain transpose of that result into the product's layout, which picks the slow
kernel again, so ``ops.matmul`` transposes it after an ``optimization_barrier``. Up to
``WEIGHT_MAJOR_ROWS`` rows only: from ~128 rows the result's transpose costs more than
the form saves (1,024 rows: 122 vs 104 ms).

Products on a GPU
-----------------

XLA's GPU compiler rewrites a product of one query row into a multiply and a ``reduce``
over the contraction axis. With the weight stored ``[K, N]`` (the layer's layout,
contraction first) that is a *column* reduce, and XLA does not fuse the multiply into it:
``x[1, 4096] @ w[4096, N]`` compiles to a fusion that writes the product ``x * w`` (or the
weight in float32) at the weight's size, then a reduce that reads it back (on the first
H200 run: 167 us for ``indexer.wk``, 1 MB of weights; ~330 of the step's 409 us went to
the projections). With the weight stored ``[N, K]`` (contraction last) the same product
is one row-reduce fusion that reads the weight once; from 8 rows either layout is one
Triton GEMM fusion (with its split-K partial sums reduced by a second, small fusion).
So on any backend but a CPU, ``decode.make_step`` hands an unplaced layer's step the same
cached contraction-last copies as on a CPU (``contraction_last_params``; any float
dtype) and traces it inside ``contraction_last_context(cpu_forms=False)``: ``ops.matmul``
multiplies each weight as one plain 2-D ``[M, K] x [N, K]^T`` product (or an einsum with a
batch letter: ``absorb_q``, ``w_uv``) into a float32 accumulator and rounds the output,
without the CPU's two-copies and weight-major forms. The numbers are those of the default
path (the weight cast to the activation dtype, a product at ``HIGHEST``) up to the
accumulation order. Why copies rather than the stored layout changed: checkpoints, the
HF import, TP specs and the CPU's placed float32 path all read the ``[in, out]`` layout
(``layout.TENSORS``); a cached copy keeps them as they are, at the cost of the weights'
bytes once more on the device (GLM-5.3-Flash: 250 MB per layer). A layer placed by
``shard_layer`` keeps the stored layout (its ``shard_map`` specs are the stored
layout's). Parameters with no devices (abstract ones, a step compiled ahead of time for
a GPU from a CPU host, ``tools.gpu_compile.step``) get this policy too. Checked by
``tests/test_step_compile.py`` (a deviceless compile for an H200): no fusion of the step
has a weight-sized output.

Joined products
---------------

The products that read one activation read it once on a GPU: ``layout.joined_products``
groups the weights that contract the hidden state (``q_a``, ``kv_a`` and the indexer's
``wk``, ``weights_proj``, ``kpool_gate``), and ``contraction_last_params(..., joined)``
gives every member of a group one cached *joined* copy, the members' contraction-last
copies as ``[N, K]`` stacked in group order (GLM-5.3-Flash: ``[2336, 4096]``, in place of
their five copies: no byte more). ``joined_rows`` says where each member's rows are; the
step traces inside ``contraction_last_context(cpu_forms=False, joined=rows)`` over
``shared_joined(params, rows)`` (every member holds its group's first member's value), and
``ops.matmul(..., part=path)`` returns its member's slice of the one product of ``x`` and
that copy, made once per ``(copy, x)`` in the trace whichever member asks first
(``joined_part``). Why: one kernel where there were four (a row reduce at one row, a GEMM
and its split-K reduce from 8), ``x`` read once, and a wider product for the GEMM; in two
modules (the attention's and the indexer's ``project``) the layer cannot write one
product itself without merging them. The numbers are the plain products' (each output one
float32 accumulator, rounded): bit for bit on XLA:CPU. A call traced with other values of
``x`` (a stop-gradient copy) computes its own product, right but not shared. On a CPU the
copies are not joined: XLA:CPU's forms above are per weight.

Its invariants:

* The context is read at trace time only (``ops.matmul``): it changes the program traced,
  never a value at run time, and the eager programs of ``parallel.execution`` carry it in
  their cache key.
* A copy is a cached value derived from one parameter array, never written back: the
  layer's parameters, ``param_dtype``, ``params_to_hf`` and checkpoints keep the user's
  dtype.
* The cache is keyed by the source array's identity and checked through a weak reference,
  so a parameter that is replaced (a load, a restore, ``shard_layer``, ``set_value``) gets
  a fresh copy at the next step, and a copy lives exactly as long as its source.
* A copy is placed like its source (same sharding); inside a trace nothing is cached.
* A contraction-last copy is what ``ops.matmul`` expects of every weight while that
  context is on: its spec's weight letters absent from the output moved last, in order,
  which is the table's ``Param.contract`` order (``tests/test_cpu_float32.py`` checks the
  two agree on every product of the step).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref

import jax
import jax.numpy as jnp

__all__ = ["store_dtype", "to_store", "from_store", "float32_params", "clear_float32_copies",
           "uses_float32", "float32_products", "float32_products_context", "WIDE_ROWS",
           "WEIGHT_MAJOR_ROWS",
           "contraction_last_params", "contraction_last_products", "contraction_last_context",
           "cpu_product_forms", "on_cpu", "joined_rows", "shared_joined", "joined_part"]


# ---------------------------------------------------------------------------- bit storage
def store_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype a cache of float ``dtype`` stores its rows in on ``platform`` (default:
    jax's default backend): on a CPU ``uint16`` for a 16-bit float and ``uint8`` for fp8
    (see the module doc), else ``dtype``."""
    dtype = jnp.dtype(dtype)
    platform = jax.default_backend() if platform is None else platform
    bits = {1: jnp.uint8, 2: jnp.uint16}.get(dtype.itemsize)
    return jnp.dtype(bits) if bits is not None and platform == "cpu" else dtype


def to_store(x: jax.Array, dtype, store) -> jax.Array:
    """Float rows ``x`` as a cache of float ``dtype`` whose buffer has dtype ``store``
    keeps them (a cast to ``dtype``, then its bits when ``store`` is ``uint16`` / ``uint8``)."""
    x = jnp.asarray(x).astype(dtype)
    store = jnp.dtype(store)
    return x if store == x.dtype else jax.lax.bitcast_convert_type(x, store)


def from_store(a: jax.Array, dtype) -> jax.Array:
    """Stored rows ``a`` as floats of ``dtype`` (a bitcast for a 8- or 16-bit float cache)."""
    dtype = jnp.dtype(dtype)
    return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)


# ------------------------------------------------------------------------ float32 products
#: The products a call is traced with: None (the weight cast to the activation's dtype),
#: ``"float32"``, ``"contraction_last"`` (XLA:CPU's forms) or ``"contraction_last_plain"``
#: (plain 2-D products: a GPU, "Products on a GPU").
_PRODUCTS = contextvars.ContextVar("glm5_dsa_jax_products", default=None)

#: Query rows (``batch x chunk``) from which the compiled step multiplies contraction-last
#: bf16 copies instead of float32 ones: 1, every call, since one row is multiplied as two
#: copies of it (module doc: ``o_proj`` at one row 11.8 ms float32, 5.1 ms so).
WIDE_ROWS = 1

#: Rows (``M``) up to which a contraction-last product runs weight-major, ``[N, K] x [M,
#: K]^T``, its small ``[N, M]`` result transposed after (module doc: ``o_proj`` at 8 rows
#: 7.9 -> 3.3 ms); past it the weight-major form lost (1,024 rows: 104 vs 122 ms).
WEIGHT_MAJOR_ROWS = 64


def float32_products() -> bool:
    """Whether the call being traced multiplies in float32 (``ops.matmul`` asks)."""
    return _PRODUCTS.get() == "float32"


def contraction_last_products() -> bool:
    """Whether the call being traced multiplies contraction-last weights in their own dtype
    into a float32 accumulator (``ops.matmul`` asks)."""
    return _PRODUCTS.get() in ("contraction_last", "contraction_last_plain")


def cpu_product_forms() -> bool:
    """Whether contraction-last products take XLA:CPU's forms (one row as two copies of it,
    few rows weight-major); False on a GPU's plain products (``ops.matmul`` asks)."""
    return _PRODUCTS.get() == "contraction_last"


#: While a call is traced with joined products: ``(joined_rows, {(id(w), id(x)): (w, x,
#: product)})``, the products of each joined copy made so far in this trace.
_JOINED = contextvars.ContextVar("glm5_dsa_jax_joined", default=None)


@contextlib.contextmanager
def _products_context(mode, joined=None):
    token = _PRODUCTS.set(mode)
    joined_token = _JOINED.set((dict(joined), {}) if joined else None)
    try:
        yield
    finally:
        _JOINED.reset(joined_token)
        _PRODUCTS.reset(token)


def float32_products_context(on: bool = True):
    """Trace the calls made inside with float32 products (``on``), as the CPU compiled step
    of a placed layer does; restores the previous setting on exit."""
    return _products_context("float32" if on else None)


def contraction_last_context(on: bool = True, *, cpu_forms: bool = True, joined=None):
    """Trace the calls made inside with contraction-last products (``on``), as the CPU
    compiled step does for ``WIDE_ROWS`` rows or more (``cpu_forms``: XLA:CPU's one-row and
    weight-major forms) and the GPU one always (``cpu_forms=False``: plain products);
    restores the previous setting on exit. Every weight ``ops.matmul`` is given must then
    be a ``contraction_last_params`` copy. ``joined``: the ``joined_rows`` of those copies
    (plain products only), whose groups ``ops.matmul`` multiplies as one product each."""
    if joined and cpu_forms:
        raise ValueError("joined products are plain products: pass cpu_forms=False with joined=")
    mode = "contraction_last" if cpu_forms else "contraction_last_plain"
    return _products_context(mode if on else None, joined if on else None)


def joined_part(path) -> tuple[int, tuple[int, ...], dict] | None:
    """While a call is traced with joined products (``contraction_last_context(joined=)``):
    ``(first row, kept shape, the products made so far)`` of the parameter at ``path`` in
    its group's joined copy, or None (``ops.matmul`` asks; "Joined products")."""
    state = _JOINED.get()
    if state is None or path is None or tuple(path) not in state[0]:
        return None
    _, row, shape = state[0][tuple(path)]
    return row, shape, state[1]


def uses_float32(params, opt_in: bool = True) -> bool:
    """Whether a compiled step over ``params`` (any pytree) uses float32 products and
    copies: ``opt_in`` (a layer's ``cpu_float32``) and every array lives on CPU devices
    only (decided by where the parameters are, e.g. a ``shard_layer`` mesh, not by which
    backends exist)."""
    return bool(opt_in) and on_cpu(params)


def on_cpu(params) -> bool:
    """Whether every array of ``params`` (any pytree) lives on CPU devices only; False when
    any lives elsewhere or none is placed (abstract parameters: a step compiled ahead of
    time). Which product policy a compiled step applies follows from it (module doc)."""
    leaves = jax.tree.leaves(params)
    platforms = {d.platform for a in leaves if isinstance(a, jax.Array) for d in a.devices()}
    return platforms == {"cpu"}


# (kind, id(each source array)) -> (weak references to the sources, their copy). Keyed by
# identity and checked through the weak references, so a parameter that is replaced (a
# load, a restore, ``shard_layer``, ``set_value``) gets a fresh copy, and a copy lives as
# long as its sources. Kinds: ``"float32"``, a contraction-last axis order, or
# ``"joined"`` (one copy of several sources, "Joined products").
_F32_COPIES: dict[tuple, tuple[tuple[weakref.ref, ...], jax.Array]] = {}


def _drop_copy(key: tuple, ref: weakref.ref) -> None:
    hit = _F32_COPIES.get(key)
    if hit is not None and any(r is ref for r in hit[0]):
        del _F32_COPIES[key]


def _cached_copy(a, kind, make):
    """``make(a)``, cached per ``(kind, a)`` for as long as ``a`` lives (module doc); ``a``
    may be a tuple of arrays, one copy of them all (cached while every one lives)."""
    sources = a if isinstance(a, tuple) else (a,)
    if not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in sources):
        return make(a)  # inside a trace: nothing to cache
    key = (kind,) + tuple(id(x) for x in sources)
    hit = _F32_COPIES.get(key)
    if hit is not None and all(r() is x for r, x in zip(hit[0], sources)):
        return hit[1]
    copy = make(a)
    refs = tuple(weakref.ref(x, lambda r, k=key: _drop_copy(k, r)) for x in sources)
    _F32_COPIES[key] = (refs, copy)
    return copy


def _float32_copy(a):
    def make(a):
        copy = a.astype(jnp.float32)
        if isinstance(a, jax.Array) and copy.sharding != a.sharding:
            copy = jax.device_put(copy, a.sharding)
        return copy
    return _cached_copy(a, "float32", make)


def float32_params(params):
    """``params`` (any pytree, e.g. ``nnx.split(layer)[1]``) with every floating leaf
    narrower than float32 replaced by its float32 copy, placed like it.

    The copy of an array is made once and cached for as long as that array lives; the
    tree given is not changed. Costs 4 bytes per parameter on top of the stored ones
    (GLM-5.3-Flash: 500 MB per layer beside its 250 MB of bf16).
    """
    def up(a):
        dt = getattr(a, "dtype", None)
        if dt is not None and jnp.issubdtype(dt, jnp.floating) and jnp.dtype(dt).itemsize < 4:
            return _float32_copy(a)
        return a

    return jax.tree.map(up, params)


def _param_path(path) -> tuple[str, ...]:
    """The parameter path (``layout.Param.path``) of a key path into an ``nnx.State``."""
    names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def _leaves_by_path(params) -> dict:
    """``{parameter path: leaf}`` of an ``nnx.State`` (or of what a step reads)."""
    return {_param_path(p): a for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}


def contraction_last_params(params, orders, joined=()) -> object:
    """``params`` (an ``nnx.State``) with each parameter whose path is in ``orders`` (``{path:
    axis order}``, ``layout.contraction_orders``) replaced by a cached copy of it with its
    axes in that order (contraction axes last), in its own dtype, on its own device. The
    copy of an array is made once and cached for as long as that array lives; the tree
    given is not changed. Costs the weights' bytes once more (GLM-5.3-Flash: 250 MB). An
    abstract leaf (``jax.ShapeDtypeStruct``) becomes one of the copy's shape, unplaced.

    ``joined`` (``layout.joined_products``, a GPU step's): every member of a group present
    in ``params`` gets the group's one joined copy instead, ``[N1 + N2 + ..., K]`` (each
    member's copy as ``[N, K]``, stacked in group order; ``joined_rows`` says where each
    one's rows are), the same array at each of them: "Joined products"."""
    rows = joined_rows(params, orders, joined)
    leaves = _leaves_by_path(params)
    copies = {}
    for group in joined:
        members = tuple(m for m in group if m in rows)
        if members:
            join = _joined_copy(tuple(leaves[m] for m in members), tuple(orders[m] for m in members))
            copies.update(dict.fromkeys(members, join))

    def copy(path, a):
        names = _param_path(path)
        if names in copies:
            return copies[names]
        order = orders.get(names)
        if order is None or order == tuple(range(len(order))):
            return a
        if isinstance(a, jax.ShapeDtypeStruct):  # abstract (a step compiled ahead of time)
            return jax.ShapeDtypeStruct(tuple(a.shape[i] for i in order), a.dtype)
        return _cached_copy(a, order, lambda a: jnp.transpose(a, order))

    return jax.tree_util.tree_map_with_path(copy, params)


def joined_rows(params, orders, joined) -> dict[tuple[str, ...], tuple[tuple[str, ...], int, tuple[int, ...]]]:
    """``{param path: (its group's first member, its first row in the joined copy, its kept
    shape)}`` for every member of a ``joined`` group with at least two members in
    ``params`` that share a dtype and their contracted size (each member contracts its
    last contraction-last axis only): what ``contraction_last_params(params, orders,
    joined)`` joins and ``ops.matmul`` slices ("Joined products"). Reads shapes only
    (abstract parameters too)."""
    leaves = _leaves_by_path(params)
    out = {}
    for group in joined:
        members = [m for m in group if m in leaves]
        shapes = [tuple(leaves[m].shape[i] for i in orders[m]) for m in members]
        if len(members) < 2 or len({(s[-1], leaves[m].dtype) for m, s in zip(members, shapes)}) != 1:
            continue
        row = 0
        for m, shape in zip(members, shapes):
            out[m] = (members[0], row, shape[:-1])
            row += math.prod(shape[:-1])
    return out


def _joined_copy(arrays: tuple, orders: tuple):
    """One ``[sum N, K]`` array of ``arrays``' contraction-last copies, each as ``[N, K]``,
    stacked in order (cached while every source lives); abstract for abstract sources."""
    def make(arrays):
        return jnp.concatenate([jnp.transpose(a, o).reshape(-1, a.shape[o[-1]]) for a, o in zip(arrays, orders)])

    if all(isinstance(a, jax.ShapeDtypeStruct) for a in arrays):
        return jax.eval_shape(make, arrays)
    return _cached_copy(arrays, "joined", make)


def shared_joined(params, rows):
    """``params`` (what a compiled step reads, inside its trace) with every member of a
    joined group (``rows``: ``joined_rows``) holding its group's first member's array (one
    value, not one argument per member), so ``ops.matmul`` makes one product of the
    group's activation and that array, whichever member asks first ("Joined products")."""
    if not rows:
        return params
    leaves = _leaves_by_path(params)

    def shared(path, a):
        part = rows.get(_param_path(path))
        return a if part is None else leaves[part[0]]

    return jax.tree_util.tree_map_with_path(shared, params)


def clear_float32_copies() -> None:
    """Drop every cached copy now, float32 and contraction-last (they are otherwise freed
    with their source)."""
    _F32_COPIES.clear()
