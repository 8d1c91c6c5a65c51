"""The layer's array arithmetic: norms, products in their dtype, weight absorption, query tiles.

Invariants:

* Norms compute their statistics in float32 and return the input's dtype, as the
  reference does.
* A product (``matmul``, ``dense``) returns the activation's dtype. By default the weight
  is cast to it (the GPU path); ``wide=True`` multiplies float32 operands and rounds the
  output to the activation dtype: what XLA:CPU's bf16 product computes, at float32 speed
  (the CPU compiled step's float32 copies, ``glm5_dsa_jax.float32_copies``). bf16 ->
  float32 is exact, so only the float32 accumulation order can differ.
* ``absorb_o`` contracts the head axis, which a placed layer shards: its output sharding
  is the row-parallel one (``parallel.row_parallel_out_sharding``), all-reduced once.
* ``by_query_tiles`` runs a step over ``block_q`` queries at a time, so a prefill never
  builds an ``[S, P]`` score or ``[S, S]`` tensor. Under a trace the tiles are a
  ``lax.map``; outside one (an eager layer call) a Python loop of calls on tiles of one
  shape, because the step is a closure made anew per call (over that call's cache), and
  an eager ``lax.map`` of a new function compiles its body on every call.
* The kernels a placed layer runs through ``glm5_dsa_jax.parallel`` are stable functions
  (its cached programs are keyed by the function): ``topk_live`` (``topk_pools`` bounded by
  each query's live pools, ``n_live`` as an operand) and ``mla_kernel`` (``sparse_mla``
  with its statics bound, one function per statics).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels as pk

from glm5_dsa_jax.parallel import row_parallel_out_sharding

__all__ = ["rms_norm", "layer_norm", "matmul", "dense", "absorb_q", "absorb_o", "by_query_tiles",
           "topk_live", "mla_kernel"]

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


def matmul(spec: str, x: jax.Array, w: jax.Array, wide: bool = False, **kwargs) -> jax.Array:
    """``einsum(spec, x, w)`` in ``x``'s dtype. ``wide``: both operands in float32 and the
    output rounded to ``x.dtype`` (what XLA:CPU's bf16 product computes, at float32 speed);
    otherwise ``w`` is cast to ``x.dtype`` (the GPU path)."""
    if wide:
        f32 = jnp.float32
        return jnp.einsum(spec, x.astype(f32), w.astype(f32), precision=_HI, **kwargs).astype(x.dtype)
    return jnp.einsum(spec, x, w.astype(x.dtype), precision=_HI, **kwargs)


def absorb_q(q_nope: jax.Array, w_uk: jax.Array, *, wide: bool = False) -> jax.Array:
    """``[B, S, H, qk_nope] x [H, qk_nope, C] -> [B, S, H, C]``: the query in latent space."""
    return matmul("bshd,hdc->bshc", q_nope, w_uk, wide)


def absorb_o(
    o_lat: jax.Array, w_uv: jax.Array, o_proj: jax.Array, bias: jax.Array | None = None,
    *, wide: bool = False, reduce_axis: str | None = None,
) -> jax.Array:
    """``[B, S, H, C]`` latent attention output -> ``[B, S, hidden]``: ``W_UV`` then ``o_proj``.

    ``reduce_axis``: inside a ``shard_map`` manual over it (a data-parallel call, whose
    device holds only its heads), the partial sums are ``psum``-ed over it before the bias
    is added (once)."""
    o = matmul("bshc,hvc->bshv", o_lat, w_uv, wide)
    # Row-parallel under TP: the head axis contracted here may be sharded; the partial sums
    # are all-reduced once. Explicit mesh axes need the output sharding spelled out.
    out = matmul("bshv,hvo->bso", o, o_proj, wide, out_sharding=row_parallel_out_sharding(o))
    if reduce_axis is not None:
        out = jax.lax.psum(out, reduce_axis)
    return out if bias is None else out + bias.astype(out.dtype)


def dense(x: jax.Array, w: jax.Array, wide: bool = False) -> jax.Array:
    """``x [..., in] @ w [in, out]`` in ``x``'s dtype (``wide`` as ``matmul``)."""
    return matmul("...i,io->...o", x, w, wide)


def by_query_tiles(fn, block_q: int, *arrays):
    """``fn`` over tiles of ``block_q`` queries: each ``(array [B, S, ...], fill)`` is
    cut along S (the last tile padded with ``fill``), and ``fn``'s outputs (each
    ``[B, block_q, ...]``) are joined back to ``[B, S, ...]``. So no ``[S, P]`` score
    tensor is built. One tile (a decode step) is a plain call; several are a ``lax.map``
    under a trace and, eagerly, one call per tile (see the module doc: nothing compiles
    per call)."""
    b, s = arrays[0][0].shape[:2]
    bq = min(block_q, s)
    n_tiles = -(-s // bq)
    pad = n_tiles * bq - s

    def tiles(a, fill):
        if pad:
            a = jnp.concatenate([a, jnp.full((b, pad) + a.shape[2:], fill, a.dtype)], axis=1)
        return jnp.moveaxis(a.reshape((b, n_tiles, bq) + a.shape[2:]), 1, 0)

    args = tuple(tiles(a, fill) for a, fill in arrays)
    if n_tiles == 1:
        outs = jax.tree.map(lambda a: a[None], fn(*(a[0] for a in args)))
    elif any(isinstance(a, jax.core.Tracer) for a in args):
        outs = jax.lax.map(lambda t: fn(*t), args)
    else:
        per_tile = [fn(*(a[i] for a in args)) for i in range(n_tiles)]
        outs = jax.tree.map(lambda *t: jnp.stack(t), *per_tile)
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape((b, n_tiles * bq) + a.shape[3:])[:, :s], outs)


def topk_live(scores, n_live, select_k: int, *, implementation):
    """``pk.topk_pools`` over each row's first ``n_live`` scores ``[B, Q]`` (the rest count
    as ``-inf`` and a Pallas kernel does not read them). ``n_live`` is positional, so
    ``parallel.replicated_call`` passes it as an operand (its keyword arguments are static)."""
    return pk.topk_pools(scores, select_k, n_live=n_live, implementation=implementation)


@functools.lru_cache(maxsize=None)
def mla_kernel(scale: float, value_width: int, implementation: str):
    """``pk.sparse_mla`` with its statics bound, one function per statics: the stable
    kernel ``parallel.sharded_sparse_mla`` keys its cached eager program by. Its ``latent``
    is the rows, or ``(rows, latent_scale)`` of an fp8 cache: one operand, so a placement
    of the latent places its scales alike."""

    def kernel(q_lat, latent, token_ids):
        rows, row_scale = latent if isinstance(latent, tuple) else (latent, None)
        return pk.sparse_mla(q_lat, rows, token_ids, row_scale, scale=scale, value_width=value_width,
                             implementation=implementation)

    return kernel
