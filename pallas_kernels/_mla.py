"""What the Triton sparse-MLA kernels share, forward (``attention``) and backward
(``attention_backward``): the row gather of the references, the id row's padding and its
scan for the last valid slot, the default column chunk and the float32-accumulating dots.

Private (imports no public module of the package) so that neither kernel module imports
the other for a helper. Axis letters as in the package glossary (``pallas_kernels``).
Invariants:

* ``gather_rows`` moves 8- and 16-bit floats as their bits (see its doc); it reads only
  in-range ids (the caller clamps).
* The id row a kernel sees is ``padded_width`` wide, padded with ``-1`` (never a token), so
  every load of it is whole and in bounds (jax >= 0.12 bounds-checks static Ref slices
  even when masked); ``row_end`` then scans it in unmasked tiles.
* ``dot_nt`` / ``dot_nn`` accumulate in float32 at ``HIGHEST`` precision (bf16 tensor
  cores for bf16 operands, IEEE float32 for float32 ones).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import next_power_of_two

__all__ = ["accumulation_dtype", "gather_rows", "padded_width", "row_end", "default_block_c", "dot_nt", "dot_nn"]

HI = jax.lax.Precision.HIGHEST
SCAN_BLOCK = 4096  # widest single load of the id row when computing n_end


def gather_rows(latent: jax.Array, token_ids: jax.Array) -> jax.Array:
    """``latent [B, L, CR]`` or shared ``[1, L, CR]``, in-range ``token_ids [B, Q, W]`` ->
    ``[B, Q, W, CR]``.

    8- and 16-bit floats are gathered through their bits: XLA:CPU otherwise converts the
    whole ``[B, L, CR]`` cache to a wider float before gathering ``W`` rows of it, an
    O(context) pass. A shared ``[1, L, CR]`` pool is gathered from directly (never
    broadcast to ``B`` rows).
    """
    if latent.shape[0] == 1:
        take = lambda lat, i: lat[0][i]
    else:
        take = jax.vmap(lambda lat, i: lat[i])
    if jnp.issubdtype(latent.dtype, jnp.floating) and latent.dtype.itemsize in (1, 2):
        bits = jax.lax.bitcast_convert_type
        uint = jnp.uint8 if latent.dtype.itemsize == 1 else jnp.uint16
        return bits(take(bits(latent, uint), token_ids), latent.dtype)
    return take(latent, token_ids)


def accumulation_dtype(*arrays) -> jnp.dtype:
    """What the references compute in: float32, or float64 when an input is float64 (under
    ``jax_enable_x64``, for finite-difference checks)."""
    return jnp.dtype(jnp.float64 if any(a.dtype == jnp.float64 for a in arrays) else jnp.float32)


def scan_block(width: int) -> int:
    return min(next_power_of_two(width), SCAN_BLOCK)


def padded_width(width: int, block_w: int) -> int:
    """The id row's width in the kernel: a multiple of the scan tile and of ``block_w``.

    Every load of the id row then lies inside it. jax >= 0.12 bounds-checks a static slice
    of a Ref even when the load is masked, so a row of 2051 ids read in a tile of 4096 is
    refused at trace time; padding with -1 (never a token) keeps the loads whole and unmasked.
    """
    step = max(scan_block(width), block_w)  # both powers of two
    return -(-width // step) * step


def pad_ids(token_ids: jax.Array, block_w: int) -> jax.Array:
    """``token_ids [B, Q, W]`` -> ``[B * Q, padded_width(W, block_w)]`` int32, padded with -1."""
    b, nq, width = token_ids.shape
    ids = token_ids.reshape(b * nq, width).astype(jnp.int32)
    padded = padded_width(width, block_w)
    if padded != width:
        ids = jnp.pad(ids, ((0, 0), (0, padded - width)), constant_values=-1)
    return ids


def row_end(ids_ref, width: int, length: int):
    """Inside a kernel: 1 + the last slot of the id row ``ids_ref [width]`` holding an id in
    ``[0, length)`` (0 if none). ``width`` is a ``padded_width``: every load is whole."""
    scan = scan_block(width)

    def scan_tile(t, n_end):
        pos = t * scan + jnp.arange(scan, dtype=jnp.int32)
        ids = ids_ref[pl.ds(t * scan, scan)]
        ok = (ids >= 0) & (ids < length)
        return jnp.maximum(n_end, jnp.max(jnp.where(ok, pos + 1, 0)))

    return lax.fori_loop(0, width // scan, scan_tile, jnp.int32(0))


def default_block_c(c: int) -> int:
    """Power-of-two chunk of the row width: whole CR up to 512 when CR is a power of two;
    otherwise the chunk that wastes the fewest padded columns (a small cost per chunk)."""
    best = None
    for bc in (16, 32, 64, 128, 256, 512):
        n = -(-c // bc)
        cost = n * bc + 16 * n
        if best is None or cost < best[0]:
            best = (cost, bc)
    return best[1]


def dot_nt(a, b):
    """``a @ b.T`` with float32 accumulation (bf16 tensor cores for bf16; IEEE f32 for f32)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HI,
                           preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """``a @ b`` with float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HI,
                           preferred_element_type=jnp.float32)
