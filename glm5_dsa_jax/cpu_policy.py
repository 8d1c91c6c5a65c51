"""The CPU backend policy: what makes the ``"xla"`` path fast on a CPU, in one place, so the
layer, the caches' users and the tools never see it.

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

XLA:CPU runs a bf16 matrix-vector product more than ten times slower than the float32 one, so on a CPU the compiled step (``decode.make_step``)
hands the traced call float32 copies of the layer's 16-bit parameters (``float32_params``)
and traces it inside ``float32_products_context()``: while that context is active,
``ops.matmul`` multiplies float32 operands and rounds each product to the activation
dtype, which is what XLA:CPU's bf16 product computes (bf16 -> float32 is exact; only the
float32 accumulation order can differ). Whether a layer uses it is decided from where its
parameters are (``uses_float32``): ``cpu_float32=False`` opts out, other platforms never
do. No other module sees the policy: the pipeline has no flag for it.

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
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref

import jax
import jax.numpy as jnp

__all__ = ["store_dtype", "to_store", "from_store", "float32_params", "clear_float32_copies",
           "uses_float32", "float32_products", "float32_products_context"]


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
_FLOAT32_PRODUCTS = contextvars.ContextVar("glm5_dsa_jax_float32_products", default=False)


def float32_products() -> bool:
    """Whether the call being traced multiplies in float32 (``ops.matmul`` asks)."""
    return _FLOAT32_PRODUCTS.get()


@contextlib.contextmanager
def float32_products_context(on: bool = True):
    """Trace the calls made inside with float32 products (``on``), as the CPU compiled step
    does; restores the previous setting on exit."""
    token = _FLOAT32_PRODUCTS.set(bool(on))
    try:
        yield
    finally:
        _FLOAT32_PRODUCTS.reset(token)


def uses_float32(params, opt_in: bool = True) -> bool:
    """Whether a compiled step over ``params`` (any pytree) uses float32 products and
    copies: ``opt_in`` (a layer's ``cpu_float32``) and every array lives on CPU devices
    only (decided by where the parameters are, e.g. a ``shard_layer`` mesh, not by which
    backends exist)."""
    if not opt_in:
        return False
    leaves = jax.tree.leaves(params)
    platforms = {d.platform for a in leaves if isinstance(a, jax.Array) for d in a.devices()}
    return platforms == {"cpu"}


# id(source array) -> (weak reference to the source, its float32 copy). Keyed by identity and
# checked through the weak reference, so a parameter that is replaced (a load, a restore,
# ``shard_layer``, ``set_value``) gets a fresh copy, and a copy lives as long as its source.
_F32_COPIES: dict[int, tuple[weakref.ref, jax.Array]] = {}


def _drop_copy(key: int, ref: weakref.ref) -> None:
    hit = _F32_COPIES.get(key)
    if hit is not None and hit[0] is ref:
        del _F32_COPIES[key]


def _float32_copy(a):
    if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer):
        return a.astype(jnp.float32)  # inside a trace: nothing to cache
    key = id(a)
    hit = _F32_COPIES.get(key)
    if hit is not None and hit[0]() is a:
        return hit[1]
    copy = a.astype(jnp.float32)
    if copy.sharding != a.sharding:
        copy = jax.device_put(copy, a.sharding)
    ref = weakref.ref(a, lambda r, k=key: _drop_copy(k, r))
    _F32_COPIES[key] = (ref, copy)
    return copy


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


def clear_float32_copies() -> None:
    """Drop every cached float32 copy now (they are otherwise freed with their source)."""
    _F32_COPIES.clear()
