"""``topk_pools``: the ``select_k`` (``K``) best pools of every query row, by an explicit rule.

Axis letters as in the package glossary (``pallas_kernels``). The tie rule (the same for
every implementation and every TP size):

* Pools are ranked by score, higher first; among exactly equal scores the **lower pool
  index wins**. ``-0.0``, ``+0.0`` and denormals are one score: the rank is that of
  ``order_key``, the order-preserving int32 image of the float score, computed by integer
  ops on the float's bits (a float compare would flush denormals on some backends, e.g.
  XLA:CPU, and not on others).
* A ``-inf`` score (not a candidate, see ``index_scores``) is never selected, nor a NaN
  (``order_key`` maps it to ``-inf``): its slot is ``-1``.
* The row lists the selected pool ids in **ascending pool order**, then ``-1`` for every
  slot not filled. (An ascending row makes the expanded ``token_ids`` ascending too, which
  is what a sparse attention kernel wants to read.)

Equivalently: the selected set is ``{p : key(p) > T} ∪ {the lowest-indexed pools with
key(p) == T, as many as fit}``, where ``T`` is the ``select_k``-th largest key. That is the
form a radix select computes without sorting, and the form the reference below computes
too (``T`` by a one-bit-a-pass radix select, ``_order_key.kth_largest_key``). The property tests check it against a plain
Python sort.

The Pallas kernels (``implementation="pallas"``, Triton; ``pallas_kernels.radix_select``)
are that radix select and match the reference bit for bit. Two paths, chosen by the row
length ``P`` (``TopkPoolsBlockSizes.multi_program``): rows of ``P < 4 * split_p`` pools (decode
up to 32K tokens, prefill tiles) take one program per query row; longer rows (128K and
1M-token decode) one program per ``split_p``-pool segment of every row, so that a batch-1
decode still fills the GPU.

``n_live`` (``[B, Q]`` or ``[B]`` int32, optional) bounds each row: the pools at index
``>= n_live`` count as ``-inf`` (never selected), exactly as if the scores held ``-inf``
there (the reference masks them; the result is bit-identical), and the Pallas kernels do
not read them: their tile loops stop at the bound and the multi-program path's segments
past it do nothing. A step at 4K live tokens in a 128K-token row then costs what 4K cost.

The Mosaic GPU kernel (``implementation="mosaic"`` / ``"mosaic_interpret"``;
``pallas_kernels.mosaic_selection``, jax >= 0.11, Hopper and newer) is the same radix select
on the same two paths with the same bit-identical result, ``n_live`` included; it takes its
own block sizes,
``MosaicTopkPoolsBlockSizes`` (``block_sizes`` must then be one, or ``None``).

``visible_pool_ids`` is the selection without scores, for a row whose candidates all fit
(at most ``select_k``): every candidate is then selected whatever its finite score, and the
row above lists them ascending, so the ids follow from the candidate rule alone
(``index_scores``': valid and complete at the query). The layer's short-context path under
``"xla"`` (``DsaAttention.choose_pools``) takes it for such rows: no scoring, no top-k; the
kernels score and select every row (one selection a step, no ``where`` between two), which
gives these ids. (A NaN score, which only non-finite inputs make, drops its pool from
``topk_pools`` but not from here.)

``topk_pools_lax_baseline`` (``lax.top_k``) is a benchmark baseline only.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    Implementation, check_power_of_two, check_rank, check_triton_params, eager_jit, kernel_family,
    next_power_of_two,
)
from pallas_kernels._order_key import order_key, threshold_select
from pallas_kernels._scores import candidates
from pallas_kernels.mosaic_selection import MosaicTopkPoolsBlockSizes, mosaic_topk_pools
from pallas_kernels.radix_select import MAX_COMPARE, one_program_select, segmented_select

__all__ = [
    "topk_pools", "topk_pools_reference", "topk_pools_lax_baseline", "TopkPoolsBlockSizes",
    "order_key", "MosaicTopkPoolsBlockSizes",
]

_MAX_FLAT_INDEX = 2**31 - 1  # Triton's int32 element offsets into a whole-array ref


@dataclasses.dataclass(frozen=True)
class TopkPoolsBlockSizes:
    """Tiling of the Pallas ``topk_pools`` (both paths; see ``pallas_kernels.radix_select``).

    * ``block_p``: pools per streamed tile, a power of two. ``block_p * 2**radix_bits`` (the
      per-tile compare) must be <= 65,536. ``None`` (the default) resolves to 1,024, or
      ``65536 >> radix_bits`` when that is smaller (256 at ``radix_bits = 8``). The kernel
      caps it at the row length rounded up to a power of two, and at ``split_p`` on the
      multi-program path (``resolve``).
    * ``radix_bits``: threshold bits found per pass, one of 1, 2, 4, 8: ``32 / radix_bits``
      counting passes over the row, plus one compaction pass.
    * ``split_p``: pools per program on the multi-program path, a power of two; rows of at
      least ``MIN_SEGMENTS * split_p`` pools take that path (``multi_program``).
    * ``num_warps`` (power of two), ``num_stages`` (int >= 1): Triton's.
    """

    block_p: int | None = None
    radix_bits: int = 4
    split_p: int = 2048
    # 8 warps: a 1,024-pool tile is 4 keys a thread. At 4 warps (8 keys a thread) the
    # one-program path spilled on sm_80 for rows of 2,048 to 8,191 pools (64 registers, 4 B
    # spilled, an 8-byte stack; ``glm5-dsa gpu-compile``, tests/test_gpu_compile.py's
    # switch points); and a batch-1 decode runs one program, so more threads help it.
    num_warps: int = 8
    num_stages: int = 2

    MIN_SEGMENTS: ClassVar[int] = 4  # rows of >= this many split_p segments: multi-program
    DEFAULT_BLOCK_P: ClassVar[int] = 1024

    def validate(self) -> "TopkPoolsBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        name = "TopkPoolsBlockSizes."
        check_power_of_two(name + "radix_bits", self.radix_bits)
        if self.radix_bits > 8:
            raise ValueError(f"{name}radix_bits must be one of 1, 2, 4, 8, got {self.radix_bits!r}")
        if self.block_p is not None:
            check_power_of_two(name + "block_p", self.block_p)
            if self.block_p << self.radix_bits > MAX_COMPARE:
                raise ValueError(
                    f"{name}block_p * 2**radix_bits must be <= {MAX_COMPARE} (the per-tile "
                    f"compare), got block_p={self.block_p}, radix_bits={self.radix_bits}"
                )
        check_power_of_two(name + "split_p", self.split_p)
        check_triton_params("TopkPoolsBlockSizes", self.num_warps, self.num_stages)
        return self

    def multi_program(self, n_pools: int) -> bool:
        """Whether a row of ``P = n_pools`` pools takes the multi-program path."""
        return n_pools >= self.MIN_SEGMENTS * self.split_p

    def programs_per_row(self, n_pools: int) -> int:
        """Programs each launch runs per query row: ``cdiv(P, split_p)`` on the
        multi-program path, 1 on the one-program path."""
        return -(-n_pools // self.split_p) if self.multi_program(n_pools) else 1

    def resolve(self, n_pools: int) -> "TopkPoolsBlockSizes":
        """The sizes the kernel launches with for rows of ``P = n_pools`` pools."""
        self.validate()
        block_p = self.block_p
        if block_p is None:
            block_p = min(self.DEFAULT_BLOCK_P, MAX_COMPARE >> self.radix_bits)
        if self.multi_program(n_pools):
            block_p = min(block_p, self.split_p)
        else:
            block_p = min(block_p, next_power_of_two(n_pools))
        return dataclasses.replace(self, block_p=block_p)


def topk_pools_reference(scores: jax.Array, select_k: int) -> jax.Array:
    """``[..., P]`` float32 scores -> ``[..., select_k]`` int32 pool ids (see module doc).

    The threshold form, as the kernel computes it (``threshold_select`` of the scores'
    ``order_key``): ``T``, the ``select_k``-th largest key, by a radix select of one bit a
    pass (``kth_largest_key``: the Triton kernel's passes take 4 bits); then every key above
    ``T`` is taken, plus the lowest-indexed pools whose key equals ``T``, as many as fit (a
    ``cumsum`` rank), never a ``-inf``. A stream compaction writes them in ascending pool
    order. No sort of the row.
    """
    n_pools = scores.shape[-1]
    if not 0 <= select_k <= n_pools:
        raise ValueError(f"select_k must be in [0, P={n_pools}], got {select_k}")
    if select_k == 0:
        return jnp.zeros(scores.shape[:-1] + (0,), jnp.int32)
    return threshold_select(order_key(scores), select_k)


def mask_past_live(scores: jax.Array, n_live: jax.Array) -> jax.Array:
    """``scores [B, Q, P]`` with every pool at index ``>= n_live [B, Q]`` set to ``-inf``."""
    pool = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    return jnp.where(pool < n_live.astype(jnp.int32)[..., None], scores, -jnp.inf)


def topk_pools(
    scores: jax.Array,
    select_k: int,
    *,
    implementation: Implementation = "xla",
    block_sizes: TopkPoolsBlockSizes | MosaicTopkPoolsBlockSizes | None = None,
    n_live: jax.Array | None = None,
) -> jax.Array:
    """Top-``select_k`` pools of each row of ``scores [B, Q, P]`` -> ``[B, Q, K]`` int32
    (``K = select_k``). ``block_sizes`` (validated under every implementation) tiles the
    kernels and picks the Triton path: a ``TopkPoolsBlockSizes`` for ``"pallas"``, a
    ``MosaicTopkPoolsBlockSizes`` for ``"mosaic"`` (either for ``"xla"``; ``None``: the
    defaults). ``n_live`` (``[B, Q]`` or ``[B]`` integer, or ``None``: every pool) bounds
    each row; see the module doc.

    No gradient: the selection is discrete (integer pool ids). ``scores`` enters through
    ``jax.lax.stop_gradient``, so under ``jax.grad`` / ``jax.jvp`` no tangent reaches a
    kernel (a Pallas call has no derivative rule)."""
    implementation, mosaic, blocks = kernel_family(
        implementation, block_sizes, TopkPoolsBlockSizes, MosaicTopkPoolsBlockSizes, kernel="topk_pools")
    scores = jax.lax.stop_gradient(scores)
    check_rank("scores", scores, 3, "[B, Q, P]")
    if scores.dtype != jnp.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    if not isinstance(select_k, int) or not 0 <= select_k <= scores.shape[-1]:
        raise ValueError(f"select_k must be an int in [0, P={scores.shape[-1]}], got {select_k!r}")
    b, n_q, _ = scores.shape
    if n_live is not None:
        if n_live.shape not in ((b, n_q), (b,)) or not jnp.issubdtype(n_live.dtype, jnp.integer):
            raise ValueError(
                f"n_live must be an integer [B, Q] = {(b, n_q)} or [B] = ({b},) array, got "
                f"shape {tuple(n_live.shape)} dtype {n_live.dtype}"
            )
        n_live = n_live.astype(jnp.int32)
        n_live = jnp.broadcast_to(n_live[:, None] if n_live.ndim == 1 else n_live, (b, n_q))
    if implementation == "xla":
        if n_live is not None:
            scores = mask_past_live(scores, n_live)
        return topk_pools_reference(scores, select_k)
    if mosaic:
        return _topk_pools_mosaic(
            scores, select_k, n_live, interpret=implementation == "mosaic_interpret",
            block_sizes=blocks,
        )
    return _topk_pools_pallas(
        scores, select_k, n_live, interpret=implementation == "pallas_interpret",
        block_sizes=blocks,
    )


def visible_pool_ids(pool_valid: jax.Array, first_key: jax.Array, q_pos: jax.Array, *, select_k: int,
                     kpool: int) -> jax.Array:
    """``[B, Q, select_k]`` int32: the candidate pools among the first ``select_k`` (valid and
    complete at the query, ``index_scores``' rule), ascending, then ``-1``. Equal to
    ``topk_pools(index_scores(...), select_k)`` bit for bit wherever a query has no
    candidate at or past ``select_k`` (its visible pools, ``visible_pools``, at most
    ``select_k``) and its scores are not NaN (module doc). ``pool_valid [B, P >= select_k]``:
    only its first ``select_k`` columns are read; ``first_key [B]``; ``q_pos [B, Q]``."""
    cand = candidates(pool_valid[:, :select_k], first_key, q_pos, kpool)
    ids = jnp.arange(select_k, dtype=jnp.int32)
    first = jnp.sort(jnp.where(cand, ids, select_k), axis=-1)  # candidates first, ascending
    return jnp.where(first < select_k, first, -1)


def topk_pools_lax_baseline(scores: jax.Array, select_k: int) -> jax.Array:
    """``jax.lax.top_k(scores, select_k)[1]``: a **speed baseline for benchmarks only**.

    Not a ``topk_pools`` implementation: the order of its ids and which of several tied
    pools it keeps are unspecified, it does not map ``-0.0`` onto ``+0.0``, it can pick
    ``-inf`` (non-candidate) and NaN pools instead of writing ``-1``, and its row is ordered
    by score, not by pool id. (``lax.top_k`` cannot express the lower-index-wins tie rule
    exactly, so no exact variant is offered.)
    """
    return jax.lax.top_k(scores, select_k)[1]


_topk_pools_mosaic = eager_jit("select_k", "interpret", "block_sizes")(mosaic_topk_pools)


@eager_jit("select_k", "interpret", "block_sizes")
def _topk_pools_pallas(scores, select_k, n_live, *, interpret,
                       block_sizes: TopkPoolsBlockSizes):
    """Pallas path of ``topk_pools``: ``32 / radix_bits + 1`` launches of ``rows *
    cdiv(P, split_p)`` programs each on the multi-program path (each program folds the
    previous launch's counts itself: no XLA op between launches), else one launch of
    ``rows`` programs (cheaper when a row is only a few tiles long)."""
    batch, n_q, n_pools = scores.shape
    if select_k == 0 or batch * n_q == 0:
        return jnp.full((batch, n_q, select_k), -1, jnp.int32)
    blocks = block_sizes.resolve(n_pools)
    compiler_params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    n_rows = batch * n_q
    if blocks.multi_program(n_pools):
        def launch(rows, live):
            return segmented_select(
                rows, live, select_k, interpret=interpret, block_p=blocks.block_p,
                split_p=blocks.split_p, radix_bits=blocks.radix_bits,
                compiler_params=compiler_params,
            )
    else:
        def launch(rows, live):
            return one_program_select(
                rows, live, select_k, interpret=interpret, block_p=blocks.block_p,
                radix_bits=blocks.radix_bits, compiler_params=compiler_params,
            )

    flat = scores.reshape(n_rows, n_pools)
    if n_live is None:
        live = jnp.full((n_rows,), n_pools, jnp.int32)
    else:
        live = n_live.reshape(n_rows)
    # Triton addresses whole-array refs with int32 offsets (row * P + pool): launch at
    # most as many rows at a time as keep every offset, tile overhang included, in range.
    chunk = max(1, _MAX_FLAT_INDEX // (max(n_pools, select_k) + blocks.block_p))
    if n_rows <= chunk:
        out = launch(flat, live)
    else:
        out = jnp.concatenate(
            [launch(flat[r:r + chunk], live[r:r + chunk]) for r in range(0, n_rows, chunk)],
            axis=0,
        )
    return out.reshape(batch, n_q, select_k)
