"""What the Triton sparse-MLA kernels share, forward (``attention``) and backward
(``attention_backward``): the operand checks, the row gather of the references, the id
row's padding and its scan for the last valid slot, the default column chunk and the
float32-accumulating dots.

Private (imports no public module of the package) so that neither kernel module imports
the other for a helper. Axis letters as in the package glossary (``pallas_kernels``).
Invariants:

* ``gather_rows`` moves 8- and 16-bit floats as their bits (see its doc); it reads only
  in-range ids (the caller clamps).
* The id row a kernel sees is ``padded_width`` wide, padded with ``-1`` (never a token), so
  every load of it is whole and in bounds (jax >= 0.12 bounds-checks static Ref slices
  even when masked); ``row_end`` then scans it in unmasked tiles.
* fp8 group scales (``latent_scale [B or 1, L, G]``, ``glm5_dsa_jax.cache.fp8``'s
  ``"group"`` layout): the first ``V = value_width`` columns form ``G - (CR > V)`` equal
  groups and the columns past ``V`` (``k_rot``) the last one (``group_columns``); ``G = 1``
  is the row scale ``[B or 1, L]`` (``one_scale_a_row``), read by every implementation.
  ``G > 1`` is read by the ``"xla"`` references and by the Triton ``sparse_mla`` (forward
  and ``dq``; ``causal_mla``'s Pallas path is that kernel), whose callers say so
  (``check_group_scales(..., kernels_read=True)``); every other caller refuses it naming
  the implementation. A Triton kernel splits each column
  chunk into the groups it holds (``chunk_groups``, static): one dot per (chunk, group),
  the group's scale on the score and on the softmax weight, as a row scale is; a chunk in
  one group (every chunk at DS-V3.2 dims: ``block_c`` 64, groups of 128 and ``k_rot`` 64)
  costs what a row scale costs.
* ``dot_nt`` / ``dot_nn`` accumulate in float32 at ``HIGHEST`` precision (bf16 tensor
  cores for bf16 operands, IEEE float32 for float32 ones).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_rank, next_power_of_two
from pallas_kernels._dtypes import check_key_scale

__all__ = ["accumulation_dtype", "check_operands", "one_scale_a_row", "group_columns", "check_group_scales",
           "column_scales", "chunk_groups", "part_columns", "gather_rows", "padded_width", "pad_ids", "row_end",
           "default_block_c", "dot_nt", "dot_nn"]

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


def check_operands(q, latent, token_ids, latent_scale) -> None:
    """``sparse_mla``'s operand checks (its forward and backward): ``q [B, Q, H, CR]``,
    ``latent [B or 1, L, CR]`` as wide, integer ``token_ids [B, Q, W]``, ``latent_scale``
    with fp8 rows only; a ``ValueError`` naming the tensor otherwise."""
    check_rank("q", q, 4, "[B, Q, H, CR]")
    check_rank("latent", latent, 3, "[B, L, CR]")
    check_rank("token_ids", token_ids, 3, "[B, Q, W]")
    b, nq, _, cr = q.shape
    if latent.shape[0] not in (1, b) or latent.shape[2] != cr:
        raise ValueError(
            f"latent must be [B={b}, L, CR={cr}] or shared [1, L, CR={cr}] (rows as wide as "
            f"the query q), got {tuple(latent.shape)}"
        )
    if token_ids.shape[:2] != (b, nq):
        raise ValueError(f"token_ids must be [B={b}, Q={nq}, W], got {tuple(token_ids.shape)}")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be integer, got {token_ids.dtype}")
    if latent_scale is not None and latent_scale.ndim == 3:  # group scales [B or 1, L, G]
        check_key_scale("latent", latent, "latent_scale", latent_scale[..., 0], "[B or 1, L, G]")
        if latent_scale.shape[2] < 1:
            raise ValueError(f"latent_scale [B or 1, L, G] needs G >= 1, got {tuple(latent_scale.shape)}")
    else:
        check_key_scale("latent", latent, "latent_scale", latent_scale, "[B or 1, L]")


def one_scale_a_row(latent_scale):
    """``latent_scale [.., L, 1]`` -> ``[.., L]`` (one group is a row scale); any other scale
    (or None) unchanged."""
    if latent_scale is not None and latent_scale.ndim == 3 and latent_scale.shape[2] == 1:
        return latent_scale[..., 0]
    return latent_scale


def group_columns(width: int, value_width: int, n_groups: int) -> np.ndarray:
    """``[width]`` int32: the scale group of each column of a latent row (module doc); a
    ``ValueError`` naming ``latent_scale`` when ``n_groups`` does not split the row so. One
    group is the whole row."""
    if n_groups == 1:
        return np.zeros(width, np.int32)
    rot = int(width > value_width)
    latent_groups = n_groups - rot
    if latent_groups < 1 or value_width % latent_groups:
        raise ValueError(
            f"latent_scale has {n_groups} groups a row: the {value_width} value columns must split in "
            f"{latent_groups} equal groups{' (plus one for the ' + str(width - value_width) + ' k_rot columns)' if rot else ''}")
    g = value_width // latent_groups
    return np.minimum(np.arange(width) // g, n_groups - 1).astype(np.int32)


def check_group_scales(latent_scale, width: int, value_width: int, implementation: str, *,
                       kernels_read: bool = False):
    """``latent_scale`` after ``one_scale_a_row``; group scales (``G > 1``) checked against the
    row (``group_columns``) and refused, naming the implementation, outside ``"xla"`` unless
    the caller's kernels read them (``kernels_read``)."""
    latent_scale = one_scale_a_row(latent_scale)
    if latent_scale is not None and latent_scale.ndim == 3:
        group_columns(width, value_width, latent_scale.shape[2])
        if implementation != "xla" and not kernels_read:
            raise ValueError(
                f"latent_scale with {latent_scale.shape[2]} groups a row is read by implementation='xla' "
                f"only so far, got implementation={implementation!r} (a row scale [B or 1, L] runs everywhere)")
    return latent_scale


def column_scales(latent_scale, width: int, value_width: int):
    """Group scales ``[B or 1, L, G]`` -> one scale a column ``[B or 1, L, width]``."""
    return jnp.take(latent_scale, jnp.asarray(group_columns(width, value_width, latent_scale.shape[2])), axis=2)


def chunk_groups(width: int, value_width: int, n_groups: int, block_c: int) -> tuple:
    """Static, for a Triton kernel reading group scales: for each column chunk ``c`` of
    ``block_c`` columns, the ``(group, lo, hi)`` column ranges ``[lo, hi)`` of the groups it
    holds (``group_columns``), in column order."""
    cols = group_columns(width, value_width, n_groups)
    out = []
    for c in range(-(-width // block_c)):
        parts, col, end = [], c * block_c, min((c + 1) * block_c, width)
        while col < end:
            nxt = col
            while nxt < end and cols[nxt] == cols[col]:
                nxt += 1
            parts.append((int(cols[col]), col, nxt))
            col = nxt
        out.append(tuple(parts))
    return tuple(out)


def part_columns(c: int, block_c: int, width: int, lo: int, hi: int):
    """Inside a kernel: ``[block_c]`` bool, the columns ``[lo, hi)`` of chunk ``c``; None when
    they are all of the chunk's columns below ``width`` (the rest load as zeros)."""
    if lo <= c * block_c and hi >= min((c + 1) * block_c, width):
        return None
    col = c * block_c + jnp.arange(block_c, dtype=jnp.int32)
    return (col >= lo) & (col < hi)


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
