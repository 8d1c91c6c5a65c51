"""The CPU backend policy: what makes the ``"xla"`` path fast on a CPU, applied in one place.

Float32 products (this section). XLA:CPU runs a bf16 matrix-vector product more than ten
times slower than the float32 one, so on a CPU the compiled step (``decode.make_step``)
hands the traced call float32 copies of the layer's 16-bit parameters (``float32_params``)
and traces it inside ``float32_products_context()``: while that context is active,
``ops.matmul`` multiplies float32 operands and rounds each product to the activation
dtype, which is what XLA:CPU's bf16 product computes (bf16 -> float32 is exact; only the
float32 accumulation order can differ). Whether a layer uses it is decided from where its
parameters are (``uses_float32``): ``cpu_float32=False`` opts out, other platforms never
do. No other module sees the policy: the pipeline has no flag for it.

Invariants:

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

__all__ = ["float32_params", "clear_float32_copies", "uses_float32", "float32_products",
           "float32_products_context"]

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
