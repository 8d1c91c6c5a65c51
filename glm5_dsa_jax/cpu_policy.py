"""The CPU backend policy: what makes the ``"xla"`` path fast on a CPU, in one place, so the
layer, the caches' users and the tools never see it.

Invariants:

* A policy changes where bits live and how products are computed on a CPU, never a
  number: every output, top-k and cache value is the one the plain path computes.
* Only the cache package (``glm5_dsa_jax.cache``) applies the bit storage; nothing else
  reads a cache's stored buffers (``latent_store`` / ``pooled_store``) or converts them.

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["store_dtype", "to_store", "from_store"]


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
