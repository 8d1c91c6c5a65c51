"""``kpool_compress``: pool the indexer keys of every ``index_kpool`` (``KP``) consecutive tokens.

Axis letters as in the package glossary (``pallas_kernels``). Invariants:

* Pools start at ``first_key``, the first valid token of the row (``L`` when the row has
  none). Pool ``p`` covers tokens ``first_key + p*KP + [0, KP)``.
* A pool is valid only if every slot is a valid token inside the row: a trailing partial
  pool is not a pool. Invalid pools have a pooled key of exactly 0.
* ``pooled[p, c] = sum_s softmax_s(gate[slot s, c] + ape[s, c]) * keys[slot s, c]``: the
  softmax runs over the slot axis, per channel, in float32; the probabilities are cast to
  the key dtype (as the reference does), the weighted sum accumulates in float32 and is
  stored in the key dtype.
* ``P = max(1, L // KP)`` pools are emitted, the most a row of ``L`` tokens can hold, so
  shapes are static; ``P`` is never 0 so that kernels never see an empty axis.
* Block sizes (``KpoolCompressBlockSizes``) change the tiling, never a number: any valid
  ``block_pools`` gives the same bits.
* Differentiable under every implementation w.r.t. ``keys``, ``gate`` and ``ape``: the
  Pallas path is a ``jax.custom_vjp`` whose backward is XLA's vjp of the reference (the
  kernel computes the reference's numbers), so its gradients are the reference's, bit for
  bit; ``key_valid`` / ``first_key`` get none.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    without_mosaic,
    Implementation, check_block_sizes, check_power_of_two, check_rank,
    check_triton_params, eager_jit, next_power_of_two,
)

__all__ = [
    "kpool_compress", "kpool_compress_reference", "KpoolCompressBlockSizes", "first_valid",
    "num_pools",
]

_KPOOL_TILE_ELEMENTS = 4096  # default block_pools * D_pad: 32 pools at D = 128


@dataclasses.dataclass(frozen=True)
class KpoolCompressBlockSizes:
    """Tiling of the Pallas ``kpool_compress``.

    * ``block_pools``: pools per program, a power of two. ``None`` (the default) resolves to
      ``min(next_pow2(P), max(1, 4096 // D_pad))`` (``D_pad``: D rounded up to a power of
      two): 32 at ``D = 128``, a 4K-element float32 tile per live tensor, which four warps
      hold in registers.
    * ``num_warps`` (a power of two), ``num_stages`` (an int >= 1): Triton's.
    """

    block_pools: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def validate(self) -> "KpoolCompressBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        if self.block_pools is not None:
            check_power_of_two("KpoolCompressBlockSizes.block_pools", self.block_pools)
        check_triton_params("KpoolCompressBlockSizes", self.num_warps, self.num_stages)
        return self

    def resolve(self, n_pools: int, dim: int) -> "KpoolCompressBlockSizes":
        """The sizes the kernel launches with for ``P = n_pools`` pools of width ``D = dim``."""
        self.validate()
        if self.block_pools is not None:
            return self
        block_pools = min(
            next_power_of_two(n_pools), max(1, _KPOOL_TILE_ELEMENTS // next_power_of_two(dim))
        )
        return dataclasses.replace(self, block_pools=block_pools)


def num_pools(length: int, kpool: int) -> int:
    """Static pool count for a row of ``length`` tokens: ``max(1, length // kpool)``."""
    return max(1, length // kpool)


def first_valid(key_valid: jax.Array) -> jax.Array:
    """``[B, L] bool -> [B] int32``: index of the first valid token, ``L`` if none."""
    length = key_valid.shape[-1]
    return jnp.where(
        key_valid.any(-1), jnp.argmax(key_valid, axis=-1), length
    ).astype(jnp.int32)


def kpool_compress_reference(
    keys: jax.Array,
    gate: jax.Array,
    key_valid: jax.Array,
    ape: jax.Array,
    first_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-jnp pooling.

    Args:
      keys: ``[B, L, D]`` normalised indexer keys (any float dtype).
      gate: ``[B, L, D]`` gate logits ``x @ index_kpool_compress_gate.T``.
      key_valid: ``[B, L]`` bool, False for padding.
      ape: ``[KP, D]`` the per-slot bias ``index_kpool_compress_ape``.
      first_key: optional ``[B]`` int32 start of pool 0, ``>= 0`` (default:
        ``first_valid(key_valid)``).
        The decode cache pools a window of the timeline whose pool grid is fixed by a
        ``first_key`` that may lie before the window, so it passes the aligned start.

    Returns:
      ``pooled [B, P, D]`` (keys' dtype), ``first_key [B]`` int32, ``pool_valid [B, P]`` bool.
    """
    b, length, d = keys.shape
    kpool = ape.shape[0]
    n_pools = num_pools(length, kpool)
    if first_key is None:
        first_key = first_valid(key_valid)
    slots = first_key[:, None, None] + jnp.arange(n_pools * kpool, dtype=jnp.int32).reshape(
        1, n_pools, kpool
    )
    in_row = slots < length
    safe = jnp.clip(slots, 0, length - 1)
    take = jax.vmap(lambda a, i: a[i])
    slot_valid = take(key_valid, safe) & in_row  # [B, P, KP]
    pool_valid = slot_valid.all(-1)
    logits = take(gate, safe).astype(jnp.float32) + ape.astype(jnp.float32)[None, None]
    logits = jnp.where(slot_valid[..., None], logits, -jnp.inf)
    m = jnp.max(logits, axis=2, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    probs = (e / jnp.maximum(e.sum(axis=2, keepdims=True), 1e-30)).astype(keys.dtype)
    pooled = jnp.sum(
        probs.astype(jnp.float32) * take(keys, safe).astype(jnp.float32), axis=2
    )
    pooled = jnp.where(pool_valid[..., None], pooled, 0.0).astype(keys.dtype)
    return pooled, first_key, pool_valid


def kpool_compress(
    keys: jax.Array,
    gate: jax.Array,
    key_valid: jax.Array,
    ape: jax.Array,
    first_key: jax.Array | None = None,
    *,
    implementation: Implementation = "xla",
    block_sizes: KpoolCompressBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pool the indexer keys; see the module doc. Shapes as ``kpool_compress_reference``;
    ``block_sizes`` (validated under every implementation) tiles the Pallas kernel."""
    implementation = without_mosaic(implementation)  # no Mosaic kernel for this step: Triton's (see the package doc)
    blocks = check_block_sizes(block_sizes, KpoolCompressBlockSizes)
    check_rank("keys", keys, 3, "[B, L, D]")
    if gate.shape != keys.shape:
        raise ValueError(f"gate must match keys {tuple(keys.shape)}, got {tuple(gate.shape)}")
    if key_valid.shape != keys.shape[:2]:
        raise ValueError(f"key_valid must be [B, L] = {tuple(keys.shape[:2])}, got {tuple(key_valid.shape)}")
    if ape.ndim != 2 or ape.shape[1] != keys.shape[2]:
        raise ValueError(f"ape must be [KP, D={keys.shape[2]}], got {tuple(ape.shape)}")
    if first_key is not None and first_key.shape != keys.shape[:1]:
        raise ValueError(f"first_key must be [B] = ({keys.shape[0]},), got {tuple(first_key.shape)}")
    if implementation == "xla":
        return kpool_compress_reference(keys, gate, key_valid, ape, first_key)
    kernel = functools.partial(_kpool_compress_pallas,
                               interpret=implementation == "pallas_interpret", block_sizes=blocks)
    return _differentiable(kernel, keys, gate, key_valid, ape, first_key)


def _differentiable(kernel, keys, gate, key_valid, ape, first_key):
    """``kernel(keys, gate, key_valid, ape, first_key)`` (the Pallas pooling) under a
    ``jax.custom_vjp`` whose backward is XLA's vjp of ``kpool_compress_reference`` (the
    kernel computes the reference's numbers, so this is its gradient; the issue lets the
    pooling differentiate through XLA). ``keys``, ``gate`` and ``ape`` get gradients, from
    the cotangent of ``pooled``; ``key_valid`` and ``first_key`` (and the integer / bool
    outputs) none."""

    @jax.custom_vjp
    def pool(keys, gate, key_valid, ape, first_key):
        return kernel(keys, gate, key_valid, ape, first_key)

    def pool_fwd(*args):
        return kernel(*args), args

    def pool_bwd(args, cotangents):
        keys, gate, key_valid, ape, first_key = args
        pooled_of = lambda keys, gate, ape: kpool_compress_reference(  # noqa: E731
            keys, gate, key_valid, ape, first_key)[0]
        d_keys, d_gate, d_ape = jax.vjp(pooled_of, keys, gate, ape)[1](cotangents[0])
        return d_keys, d_gate, None, d_ape, None

    pool.defvjp(pool_fwd, pool_bwd)
    return pool(keys, gate, key_valid, ape, first_key)


# --------------------------------------------------------------------------------------
# Pallas kernel (Triton backend)
# --------------------------------------------------------------------------------------
#
# One program per (batch row, tile of ``block_pools`` pools); every program holds a
# ``[block_pools, D_pad]`` tile (``D_pad`` = D rounded up to a power of two, the extra
# channels masked off). The slot axis is a loop, so any ``kpool >= 1`` works with the same
# register footprint. The loop runs three times over the slots (max, sum of exponentials,
# weighted sum): that evaluates the softmax exactly as the reference writes it (the same
# max, the same ``exp(logit - max) / sum`` cast to the key dtype), instead of an online
# softmax whose rescaling would round differently. The gate tile is re-read per pass; it
# is small (``block_pools * kpool * D`` values) and stays in L1/L2 between passes.
#
# Token rows are gathered at ``clip(first_key + p*KP + s, 0, L - 1)`` with ``slot valid =
# key_valid[clipped] & (token < L)``, exactly the reference's ``safe`` / ``in_row``, so
# every load is in bounds and the kernel agrees with the reference for any ``first_key``.


def _kpool_compress_kernel(
    fk_ref, keys_ref, gate_ref, valid_ref, ape_ref,  # inputs
    pooled_ref, pvalid_ref,  # outputs
    *, kpool: int, length: int, dim: int, n_pools: int, block_pools: int, block_d: int,
):
    f32 = jnp.float32
    b = pl.program_id(0)
    pool = pl.program_id(1) * block_pools + jnp.arange(block_pools, dtype=jnp.int32)
    ch = jnp.arange(block_d, dtype=jnp.int32)
    ch_ok = ch < dim
    ch_safe = jnp.minimum(ch, dim - 1)
    shape2 = (block_pools, block_d)
    ch2 = jnp.broadcast_to(ch_safe[None, :], shape2)
    ch_ok2 = jnp.broadcast_to(ch_ok[None, :], shape2)
    start = fk_ref[b] + pool * kpool  # first token of every pool of the tile

    def slot_rows(s):
        tok = start + s
        return tok, jnp.clip(tok, 0, length - 1)

    def logits(s):
        _, safe = slot_rows(s)
        rows = jnp.broadcast_to(safe[:, None], shape2)
        g = plgpu.load(gate_ref.at[b, rows, ch2], mask=ch_ok2, other=0.0).astype(f32)
        a = plgpu.load(ape_ref.at[s, ch_safe], mask=ch_ok, other=0.0).astype(f32)
        return g + a[None, :]

    # Pass 1: per-channel max over the slots, and pool validity.
    def max_body(s, carry):
        m, ok = carry
        tok, safe = slot_rows(s)
        slot_ok = (plgpu.load(valid_ref.at[b, safe]) != 0) & (tok < length)
        return jnp.maximum(m, logits(s)), ok & slot_ok

    m, pool_ok = jax.lax.fori_loop(
        0, kpool, max_body,
        (jnp.full(shape2, -jnp.inf, f32), jnp.ones((block_pools,), jnp.bool_)),
    )
    m = jnp.where(jnp.isfinite(m), m, 0.0)

    # Pass 2: the softmax denominator.
    denom = jax.lax.fori_loop(
        0, kpool, lambda s, acc: acc + jnp.exp(logits(s) - m), jnp.zeros(shape2, f32)
    )
    denom = jnp.maximum(denom, 1e-30)

    # Pass 3: probabilities (cast to the key dtype, as the reference) times the keys.
    def sum_body(s, acc):
        _, safe = slot_rows(s)
        rows = jnp.broadcast_to(safe[:, None], shape2)
        k = plgpu.load(keys_ref.at[b, rows, ch2], mask=ch_ok2, other=0.0).astype(f32)
        p = (jnp.exp(logits(s) - m) / denom).astype(keys_ref.dtype).astype(f32)
        return acc + p * k

    acc = jax.lax.fori_loop(0, kpool, sum_body, jnp.zeros(shape2, f32))
    pooled = jnp.where(pool_ok[:, None], acc, 0.0).astype(pooled_ref.dtype)

    # Lanes past the last pool / channel are masked; their indices are left unclamped
    # (out of bounds), so no masked lane aliases a live element: interpret mode stores the
    # old value back at every masked lane's address, which would race a live lane storing
    # to the same address (on a GPU a masked lane stores nothing).
    in_pools = pool < n_pools
    rows_out = jnp.broadcast_to(pool[:, None], shape2)
    ch_out = jnp.broadcast_to(ch[None, :], shape2)
    plgpu.store(
        pooled_ref.at[b, rows_out, ch_out], pooled, mask=in_pools[:, None] & ch_ok2
    )
    plgpu.store(pvalid_ref.at[b, pool], pool_ok.astype(jnp.int8), mask=in_pools)


@eager_jit("interpret", "block_sizes")
def _kpool_compress_pallas(
    keys, gate, key_valid, ape, first_key=None, *, interpret: bool,
    block_sizes: KpoolCompressBlockSizes,
):
    """Pallas pooling, ``block_sizes.block_pools`` pools per program."""
    b, length, d = keys.shape
    kpool = ape.shape[0]
    if length < 1 or d < 1 or kpool < 1:
        raise ValueError(
            f"the Pallas kpool_compress needs L, D, KP >= 1, got L={length}, D={d}, KP={kpool}"
        )
    for name, x in (("keys", keys), ("gate", gate), ("ape", ape)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got dtype {x.dtype}")
    if key_valid.dtype != jnp.bool_:
        raise ValueError(f"key_valid must be bool, got dtype {key_valid.dtype}")
    if first_key is not None and not jnp.issubdtype(first_key.dtype, jnp.integer):
        raise ValueError(f"first_key must be an integer array, got dtype {first_key.dtype}")
    n_pools = num_pools(length, kpool)
    block_d = next_power_of_two(d)
    blocks = block_sizes.resolve(n_pools, d)
    block_pools = blocks.block_pools

    fk_given = first_key
    fk = first_valid(key_valid) if first_key is None else first_key.astype(jnp.int32)
    if b == 0:
        pooled = jnp.zeros((0, n_pools, d), keys.dtype)
        pool_valid = jnp.zeros((0, n_pools), jnp.bool_)
        return pooled, (fk if fk_given is None else fk_given), pool_valid

    kernel = functools.partial(
        _kpool_compress_kernel, kpool=kpool, length=length, dim=d, n_pools=n_pools,
        block_pools=block_pools, block_d=block_d,
    )
    pooled, pvalid = pl.pallas_call(
        kernel,
        grid=(b, pl.cdiv(n_pools, block_pools)),
        out_shape=(
            jax.ShapeDtypeStruct((b, n_pools, d), keys.dtype),
            jax.ShapeDtypeStruct((b, n_pools), jnp.int8),
        ),
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="kpool_compress",
    )(fk, keys, gate, key_valid.astype(jnp.int8), ape)
    # The reference returns the first_key it was given unchanged.
    return pooled, (fk if fk_given is None else fk_given), pvalid != 0
