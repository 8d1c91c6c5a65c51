"""The layer's array arithmetic: norms, products in their dtype, weight absorption.

Invariants:

* Norms compute their statistics in float32 and return the input's dtype, as the
  reference does.
* A product (``matmul``, ``dense``) returns the activation's dtype. By default the weight
  is cast to it (the GPU path); while the CPU policy's float32 products are on
  (``cpu_policy.float32_products``, read at trace time) it multiplies float32 operands and
  rounds the output to the activation dtype: what XLA:CPU's bf16 product computes, at
  float32 speed. bf16 -> float32 is exact, so only the float32 accumulation order can
  differ. While its contraction-last products are on (``cpu_policy.contraction_last_products``:
  a compiled CPU step of many rows) every weight comes stored with the axes the product
  contracts moved last (``contraction_last_spec``), and 16-bit operands are multiplied as
  they are into a float32 accumulator: the same numbers again, up to the accumulation order.
  A compiled step on a GPU (or traced for one ahead of time) multiplies contraction-last
  copies too, as plain 2-D products (``cpu_policy``, "Products on a GPU").
* ``absorb_o`` contracts the head axis, which a placed layer splits: inside the placed
  call's ``shard_map`` (``glm5_dsa_jax.parallel.execution``) each device holds its heads
  only and the partial sums are ``psum``-ed over ``reduce_axis``, the step's one
  collective.
* ``query_tiles`` cuts a call's queries into tiles of ``block_q`` (``DsaAttention.by_query_tiles``
  runs a function over them), so no pipeline builds a ``[S, P]`` or ``[S, S]`` tensor.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from glm5_dsa_jax.cpu_policy import (
    WEIGHT_MAJOR_ROWS, contraction_last_products, cpu_product_forms, float32_products, joined_part,
)

__all__ = ["rms_norm", "layer_norm", "matmul", "contraction_last_spec", "dense", "absorb_q", "absorb_o",
           "query_tiles"]

_HI = jax.lax.Precision.HIGHEST

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as the reference: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight * xf.astype(x.dtype)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with a bias (``indexer.k_norm``), statistics in float32."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def matmul(spec: str, x: jax.Array, w: jax.Array, *, reduce_axis: str | None = None,
           part: tuple[str, ...] | None = None) -> jax.Array:
    """``einsum(spec, x, w)`` in ``x``'s dtype: ``w`` cast to ``x.dtype`` (the GPU path), or,
    while the CPU policy's float32 products are on, both operands in float32 and the output
    rounded to ``x.dtype`` (what XLA:CPU's bf16 product computes, at float32 speed), or,
    while its contraction-last products are on, ``w`` stored as ``contraction_last_spec``
    says and, when both operands share a dtype, multiplied as is into a float32
    accumulator. ``reduce_axis``: the partial products are ``psum``-ed over that
    ``shard_map`` axis in the product's own dtype, before the rounding (float32 partial sums
    under the policy). ``part``: the parameter path of ``w`` (``layout.Param.path``), for a
    GPU step that multiplies ``w``'s group as one product (``_joined_product``)."""
    f32, dtype = jnp.float32, x.dtype
    joined = joined_part(part)
    if joined is not None and reduce_axis is None:
        return _joined_product(spec, x, w, *joined)
    if contraction_last_products():
        if x.dtype != w.dtype:
            x, w = x.astype(f32), w.astype(f32)
        out = _contraction_last_product(contraction_last_spec(spec), x, w, cpu_product_forms())
    elif float32_products():
        out = jnp.einsum(spec, x.astype(f32), w.astype(f32), precision=_HI)
    else:
        out = jnp.einsum(spec, x, w.astype(x.dtype), precision=_HI)
    if reduce_axis is not None:
        out = jax.lax.psum(out, reduce_axis)
    return out.astype(dtype)


def _contraction_last_product(spec: str, x: jax.Array, w: jax.Array, cpu_forms: bool = True) -> jax.Array:
    """``einsum(spec, x, w)`` into float32 for a contraction-last ``w``. Without a batch
    letter it is one 2-D ``[M, K] x [N, K]`` product of free reshapes. Why: XLA:CPU's dot
    canonicalisation transposes a weight with several kept or contracted axes back to
    ``[K, N]`` (a copy of the whole weight every step, then the slow layout); a 2-D
    ``[N, K]`` operand it takes as is. Up to ``cpu_policy.WEIGHT_MAJOR_ROWS`` rows the
    weight is the left operand (``[N, K] x [M, K]^T``, 2.4x faster at 8 rows). One row
    (``M = 1``, with or without a batch letter) is multiplied as two copies of it and the
    first kept: XLA:CPU's bf16 product of one row is ~15x slower than of two, and converted
    ``w_uk`` / ``w_uv`` to float32 every step (``cpu_policy``'s module doc). Those two forms
    are XLA:CPU's only (``cpu_forms``): on a GPU the plain 2-D product ``[M, K] x [N, K]^T``
    is one row-reduce fusion at one row and one GEMM fusion from 8 (``cpu_policy``, "Products
    on a GPU")."""
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    if any(c in xs and c in out for c in ws):  # a batch letter (absorb_q, absorb_o's w_uv)
        one = "..." not in xs and xs[0] == out[0] and all(
            x.shape[i] == 1 for i, c in enumerate(xs) if c not in ws)
        if one and cpu_forms:  # one row: two copies of it along x's first axis, the first result kept
            return jnp.einsum(spec, jnp.concatenate([x, x]), w, precision=_HI,
                              preferred_element_type=jnp.float32)[:1]
        return jnp.einsum(spec, x, w, precision=_HI, preferred_element_type=jnp.float32)
    kept = "".join(c for c in ws if c in out)
    con = ws[len(kept):]
    free = xs.replace("...", "").translate({ord(c): None for c in con})
    lead = "..." if "..." in xs else ""
    x = jnp.einsum(f"{xs}->{lead}{free}{con}", x)  # contracted letters last (a no-op here)
    n_con = len(con)
    x2 = x.reshape(-1, math.prod(x.shape[x.ndim - n_con:]))
    w2 = w.reshape(math.prod(w.shape[:len(kept)]), -1)
    if cpu_forms and x2.shape[0] <= WEIGHT_MAJOR_ROWS:  # weight-major: [N, K] x [M, K]^T, then its transpose
        m = x2.shape[0]
        x2 = jnp.concatenate([x2, x2]) if m == 1 else x2  # one row: two copies of it
        y = jax.lax.dot_general(w2, x2, (((1,), (1,)), ((), ())), precision=_HI,
                                preferred_element_type=jnp.float32)
        y = jax.lax.optimization_barrier(y).T[:m]  # so XLA does not fold it into the product
    else:
        if not cpu_forms and x2.shape[0] > 1:
            # XLA:GPU's dot merger joins products of one x into one GEMM over the weights
            # concatenated every step (a weight-sized copy); a barrier over each (x, w) pair
            # keeps each product its own GEMM reading its weight once.
            x2, w2 = jax.lax.optimization_barrier((x2, w2))
        y = jax.lax.dot_general(x2, w2, (((1,), (1,)), ((), ())), precision=_HI,
                                preferred_element_type=jnp.float32)
    y = y.reshape(x.shape[:x.ndim - n_con] + w.shape[:len(kept)])
    return jnp.einsum(f"{lead}{free}{kept}->{out}", y)


def _joined_product(spec: str, x: jax.Array, w: jax.Array, row: int, kept: tuple[int, ...], made: dict):
    """``matmul(spec, x, w)`` where ``w`` is a joined copy ``[N1 + N2 + ..., K]`` of its group
    (``cpu_policy``, "Joined products") and ``spec``'s member starts at ``row`` with its kept
    axes ``kept``: its slice of the one product ``x [..., K] @ w^T`` (float32 accumulator,
    rounded to ``x``'s dtype), made once per ``(w, x)`` in the trace (``made``) and shared by
    every member that multiplies the same ``x``. The member contracts ``x``'s last axis only;
    its numbers are the plain product's, up to the accumulation order."""
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    if [c for c in ws if c not in out] != [xs[-1]]:
        raise ValueError(f"a joined product contracts x's last axis only, got {spec!r}")
    hit = made.get((id(w), id(x)))
    if hit is None or hit[0] is not w or hit[1] is not x:  # the references held keep ids unique
        xa, wa = (x, w) if x.dtype == w.dtype else (x.astype(jnp.float32), w.astype(jnp.float32))
        y = jax.lax.dot_general(xa.reshape(-1, x.shape[-1]), wa, (((1,), (1,)), ((), ())),
                                precision=_HI, preferred_element_type=jnp.float32).astype(x.dtype)
        hit = made[(id(w), id(x))] = (w, x, y)
    y = hit[2][:, row:row + math.prod(kept)].reshape(x.shape[:-1] + kept)
    kept_letters = "".join(c for c in ws if c in out)
    lead = xs[:-1]
    return jnp.einsum(f"{lead}{kept_letters}->{out}", y)


def contraction_last_spec(spec: str) -> str:
    """``spec`` (``"x,w->out"``) with ``w``'s letters absent from ``out`` (the contracted
    ones) moved last, in order: the spec of a product whose weight is a contraction-last
    copy (``layout.Param.contraction_last``): ``"bshv,hvo->bso"`` -> ``"bshv,ohv->bso"``."""
    ins, out = spec.split("->")
    x, w = ins.split(",")
    kept = "".join(c for c in w if c in out)
    return f"{x},{kept}{''.join(c for c in w if c not in out)}->{out}"


def absorb_q(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """``[B, S, H, qk_nope] x [H, qk_nope, C] -> [B, S, H, C]``: the query in latent space."""
    return matmul("bshd,hdc->bshc", q_nope, w_uk)


def absorb_o(
    o_lat: jax.Array, w_uv: jax.Array, o_proj: jax.Array, bias: jax.Array | None = None,
    *, reduce_axis: str | None = None, mask: jax.Array | None = None,
) -> jax.Array:
    """``[B, S, H, C]`` latent attention output -> ``[B, S, hidden]``: ``W_UV`` then ``o_proj``.

    ``reduce_axis``: inside a ``shard_map`` manual over it (a placed call, whose device
    holds only its heads), the partial sums are ``psum``-ed over it before the bias is
    added (once): row-parallel ``o_proj``. ``mask [B, S]``: zeros at its False rows. Of
    one row without a bias, the input ``o_lat`` is masked (a zero row's products are
    zeros), where the ``where`` fuses into ``w_uv``'s row reduce on a GPU (on the output
    it was a kernel of its own; on ``o_proj``'s input too); of more rows the output, where
    it fuses into the GEMM's split-K reduce (on the input it was one more kernel at 8 and
    64 rows). Deviceless H200 compile, 2026-12-07."""
    one_row = mask is not None and bias is None and mask.size == 1
    if one_row:
        o_lat = jnp.where(mask[..., None, None], o_lat, jnp.zeros((), o_lat.dtype))
    o = matmul("bshc,hvc->bshv", o_lat, w_uv)
    zero = jnp.zeros((), o.dtype)
    out = matmul("bshv,hvo->bso", o, o_proj, reduce_axis=reduce_axis)
    out = out if bias is None else out + bias.astype(out.dtype)
    return out if mask is None or one_row else jnp.where(mask[..., None], out, zero)


def dense(x: jax.Array, w: jax.Array, *, part: tuple[str, ...] | None = None) -> jax.Array:
    """``x [..., in] @ w [in, out]`` in ``x``'s dtype (as ``matmul``; ``part`` too)."""
    return matmul("...i,io->...o", x, w, part=part)


def query_tiles(block_q: int, *arrays):
    """``(tiles, untile)``: each ``(array [B, S, ...], fill)`` cut along S into tiles of
    ``block_q`` queries, ``[T, B, block_q, ...]`` (the last tile padded with ``fill``), and
    ``untile``, which joins per-tile outputs ``[T, B, block_q, ...]`` back to ``[B, S, ...]``.
    So no ``[S, P]`` score tensor is built. ``DsaAttention.by_query_tiles`` maps a tile
    function over them (from the layer's own module: its call stack stays flat).

    Under autodiff a tile's residuals are stacked per tile (``lax.map``), but loop-invariant
    ones (the latent rows every tile reads) are inputs of the map's body, hoisted by
    ``lax.scan``, never stacked; ``forward`` keeps the rest to the ids
    (``DsaAttention(remat_tiles=True)``)."""
    b, s = arrays[0][0].shape[:2]
    bq = min(block_q, s)
    n_tiles = -(-s // bq)
    pad = n_tiles * bq - s

    def tiles(a, fill):
        if pad:
            a = jnp.concatenate([a, jnp.full((b, pad) + a.shape[2:], fill, a.dtype)], axis=1)
        return jnp.moveaxis(a.reshape((b, n_tiles, bq) + a.shape[2:]), 1, 0)

    def untile(outs):
        return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape((b, n_tiles * bq) + a.shape[3:])[:, :s], outs)

    return tuple(tiles(a, fill) for a, fill in arrays), untile
