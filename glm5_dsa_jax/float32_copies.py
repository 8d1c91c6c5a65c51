"""Float32 compute copies of 16-bit parameters, for the compiled step on a CPU.

XLA:CPU runs a bf16 matrix-vector product more than ten times slower than the float32 one,
so on a CPU ``decode.make_step`` hands the compiled step float32 copies of the layer's
16-bit parameters (``DsaAttention.float32_compute``; the layer's module doc says what is
computed with them).

Invariants:

* A copy is a cached value derived from one parameter array, never written back: the
  layer's parameters, ``param_dtype``, ``params_to_hf`` and checkpoints keep the user's
  dtype.
* The cache is keyed by the source array's identity and checked through a weak reference,
  so a parameter that is replaced (a load, a restore, ``shard_layer``, ``set_value``) gets
  a fresh copy at the next step, and a copy lives exactly as long as its source.
* A copy is placed like its source (same sharding); inside a trace nothing is cached.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp

__all__ = ["float32_params", "clear_float32_copies"]

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
