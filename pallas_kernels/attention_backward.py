"""``sparse_mla``'s backward: the gradients of the queries and of the latent rows, from the
forward's output and log-sum-exp, without a ``[queries, selected, CR]`` tensor.

Axis letters as in the package glossary (``pallas_kernels``; ``N = B * Q`` flattened
queries, ``R = (B or 1) * L`` flattened latent rows). Invariants:

* The math, per batch row ``b``, query ``q`` (heads ``h``, selected slots ``w``, ``s`` =
  ``scale``): ``z[h,w] = s * q[h] . kv[w]`` (fp8 rows: times the row scale), ``p =
  exp(z - lse)`` at valid slots, ``o[h] = sum_w p[h,w] kv[w,:V]``. Given ``d_out``:
  ``D[h] = d_out[h] . o[h]`` (once, in XLA), ``dp[h,w] = d_out[h] . kv[w,:V]``, ``dz = p
  (dp - D)``, ``dq[h] = s sum_w dz[h,w] kv[w]``, ``dkv[w] = sum_h p[h,w] d_out[h]``
  (zero-padded to ``CR``) ``+ s dz[h,w] q[h]``, ``dlatent[b or 0, id_w] += dkv[w]``.
* ``p`` is recomputed from the forward's ``lse [B, Q, H]`` (float32, ``-inf`` for a query
  with no valid id), masked with ``where`` (never a 0/1 product: ``exp(z - lse)`` is
  ``inf`` or NaN where an empty query's ``lse`` is ``-inf``): an invalid slot and a query
  with no valid id contribute exactly 0, never NaN. Ids ``< 0`` or ``>= L`` are never read.
* ``dq`` has ``q``'s dtype, ``dlatent`` ``latent``'s (``[B or 1, L, CR]``, a shared pool's
  gradient summed over every batch row); both accumulate in float32 inside the kernels
  (the dots take 16-bit operands, as the forward's). A row no query selects gets exactly 0.
* fp8 rows (``latent_scale``): ``dq`` is exact with each row's scale (``kv = row8 *
  scale_row``); ``dlatent`` is zeros (not computed): an fp8 cache is a serving format, no
  parameter lives in it, and ``latent_scale`` gets no gradient.
* Deterministic: two runs give the same bits. ``dq`` is query-major: one program per
  (query, head block) sums its own id blocks in order. ``dlatent`` is the hard part: many
  queries select one row, so query-major programs would have to scatter into rows with
  float atomics, whose order (and so the float rounding of the sum) changes run to run.
  Instead the selection is transposed token-major (``transpose.selection_transpose``, a
  sort in XLA): one program owns a block of ``block_rows`` latent rows and walks the
  (row block, query) entries that touch it in a fixed order (increasing query, then head
  block), accumulating the block's gradient in registers and writing it once. No atomics,
  no float sum whose order depends on scheduling.
* A query must not name one id twice (``sparse_mla``'s contract; the selection never
  does): the forward would weigh it twice, the transpose's bit mask counts it once.

``"xla"`` runs ``sparse_mla_backward_reference`` (plain jnp: it recomputes the gather of the
selected rows in the backward, so the forward saves none; its ``dlatent`` is an XLA
scatter-add, deterministic on the CPU, where it is meant to run; float64 inputs are
computed in float64, for finite-difference checks). ``"pallas"`` /
``"pallas_interpret"`` run the two Triton kernels below; ``"mosaic"`` /
``"mosaic_interpret"`` the Mosaic GPU kernels of ``mosaic_attention_backward`` (the same two
passes, the same transpose) on 16-bit operands, the Triton kernels on any other (float32, an
fp8 cache), as the forward does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    Implementation, check_block_sizes, check_power_of_two, check_triton_params,
    eager_jit, next_power_of_two, resolve_implementation,
)
from pallas_kernels._dtypes import key_dot_dtype
from pallas_kernels._mla import (
    check_group_scales, chunk_groups, column_scales, one_scale_a_row, part_columns,
    HI, accumulation_dtype, check_operands, default_block_c, dot_nn, dot_nt, gather_rows, pad_ids,
    row_end,
)
from pallas_kernels.dense_mla import check_value_width
from pallas_kernels._mosaic import mosaic_takes
from pallas_kernels.mosaic_attention_backward import (
    TRANSPOSE_ROWS as MOSAIC_TRANSPOSE_ROWS, MosaicSparseMlaBackwardBlockSizes, mosaic_sparse_mla_backward,
)
from pallas_kernels.transpose import MAX_BLOCK_ROWS, selection_transpose

__all__ = ["sparse_mla_backward", "sparse_mla_backward_reference", "SparseMlaBackwardBlockSizes"]


@dataclasses.dataclass(frozen=True)
class SparseMlaBackwardBlockSizes:
    """Tiling of the Pallas ``sparse_mla`` backward; a ``None`` field takes its
    shape-dependent default in ``resolve``.

    ``dq`` kernel (one program per query and head block):

    * ``block_h``: heads per program (power of two >= 16; fewer are padded with zeros).
    * ``block_w``: selected ids per loop step (power of two >= 16; default 32, or 16 for
      id rows narrower than 17 and for latent rows split in several column chunks).
    * ``block_c``: row columns per chunk (power of two >= 16; default as the forward's:
      the whole row up to 512 when ``CR`` is a power of two, else the chunk wasting the
      fewest padded columns). Both kernels use it.
    * ``num_warps`` (power of two), ``num_stages`` (int >= 1): Triton's.

    ``dlatent`` kernel (one program per block of latent rows):

    * ``block_rows``: latent rows per program (power of two in [16, 32]: a dot operand
      and one bit each of an int32 entry mask). Each (row block, query) entry loads the
      query's ``q`` and ``d_out``, so larger blocks mean fewer entries (half as many at
      32 as at 16 when a query selects most rows of a block, as a 4K-token context does)
      for the same loads of the rows. Default 32 for a row in one column chunk, else 16.
    * ``dlatent_block_h``: heads per step of an entry (power of two >= 16).
    * ``dlatent_num_warps`` (default 8 at 32 rows, 4 at 16), ``dlatent_num_stages``:
      Triton's.

    The defaults compile without spills for sm_80 and sm_90 (``gpu_compile``'s
    ``sparse_mla_backward`` cases): at GLM-5.3-Flash's 512-wide rows (one chunk) the
    ``dlatent`` kernel takes 127 registers a thread with 32 rows and 8 warps (240 with 4);
    at GLM-5's 576-wide rows (nine chunks of 64) 32 rows or 32 ids a step spill, 16 do
    not. Their speed is not measured.
    """

    block_h: int = 16
    block_w: int | None = None
    block_c: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    block_rows: int | None = None
    dlatent_block_h: int = 16
    dlatent_num_warps: int | None = None
    dlatent_num_stages: int = 2

    def validate(self) -> "SparseMlaBackwardBlockSizes":
        """``self``, or a ``ValueError`` naming the bad field."""
        name = "SparseMlaBackwardBlockSizes."
        for field in ("block_h", "dlatent_block_h"):
            check_power_of_two(name + field, getattr(self, field), minimum=16)
        for field in ("block_w", "block_c"):
            if getattr(self, field) is not None:
                check_power_of_two(name + field, getattr(self, field), minimum=16)
        if self.block_rows is not None:
            check_power_of_two(name + "block_rows", self.block_rows, minimum=16)
            if self.block_rows > MAX_BLOCK_ROWS:
                raise ValueError(
                    f"{name}block_rows must be a power of two in [16, {MAX_BLOCK_ROWS}] (one "
                    f"bit per row of an int32 entry mask), got {self.block_rows!r}")
        check_triton_params("SparseMlaBackwardBlockSizes", self.num_warps, self.num_stages)
        warps = 1 if self.dlatent_num_warps is None else self.dlatent_num_warps  # None: resolved
        check_triton_params("SparseMlaBackwardBlockSizes.dlatent", warps, self.dlatent_num_stages)
        return self

    def resolve(self, q_shape, width: int) -> "SparseMlaBackwardBlockSizes":
        """Every field set, for ``q`` of shape ``[B, Q, H, CR]`` and id rows ``W = width``
        wide: the sizes the kernels launch with."""
        self.validate()
        block_c = default_block_c(q_shape[3]) if self.block_c is None else self.block_c
        one_chunk = block_c >= q_shape[3]
        block_w = self.block_w
        if block_w is None:
            block_w = min(next_power_of_two(width, 16), 32 if one_chunk else 16)
        block_rows = self.block_rows or (32 if one_chunk else 16)
        warps = self.dlatent_num_warps or (8 if block_rows == 32 else 4)
        return dataclasses.replace(self, block_w=block_w, block_c=block_c, block_rows=block_rows,
                                   dlatent_num_warps=warps)


def _selected_rows(latent, latent_scale, token_ids, dtype, value_width):
    """The selected rows ``[B, Q, W, CR]`` in ``dtype`` (fp8: times their row or group
    scales), 0 at invalid slots, and the valid mask ``[B, Q, W]``."""
    length = latent.shape[1]
    valid = (token_ids >= 0) & (token_ids < length)
    safe = jnp.clip(token_ids, 0, length - 1)
    kv = gather_rows(latent, safe).astype(dtype)
    latent_scale = one_scale_a_row(latent_scale)
    if latent_scale is not None and latent_scale.ndim == 3:
        kv = kv * gather_rows(column_scales(latent_scale.astype(dtype), latent.shape[2], value_width), safe)
    elif latent_scale is not None:
        kv = kv * gather_rows(latent_scale.astype(dtype)[..., None], safe)
    return jnp.where(valid[..., None], kv, 0.0), valid


def sparse_mla_backward_reference(
    q: jax.Array, latent: jax.Array, token_ids: jax.Array, out: jax.Array, lse: jax.Array,
    d_out: jax.Array, latent_scale: jax.Array | None = None, *, scale: float,
    value_width: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp backward of ``sparse_mla`` (the math of the module doc).

    Args:
      q, latent, token_ids, latent_scale, scale, value_width: the forward's (see
        ``attention.sparse_mla_reference``).
      out: ``[B, Q, H, V]`` the forward's output.
      lse: ``[B, Q, H]`` float32 log-sum-exp of the scaled scores (``-inf``: no valid id).
      d_out: ``[B, Q, H, V]`` the output's cotangent.

    Returns:
      ``(dq [B, Q, H, CR] in q.dtype, dlatent [B or 1, L, CR] in latent.dtype)``;
      ``dlatent`` is zeros for fp8 rows (see the module doc).
    """
    v = check_value_width(value_width, latent.shape[2])
    f = accumulation_dtype(q, latent)
    kv, valid = _selected_rows(latent, latent_scale, token_ids, f, v)  # [B, Q, W, CR]
    qf, do = q.astype(f), d_out.astype(f)
    dd = jnp.sum(do * out.astype(f), axis=-1)  # [B, Q, H]
    z = jnp.einsum("bqhc,bqwc->bqhw", qf, kv, precision=HI) * scale
    p = jnp.where(valid[:, :, None, :], jnp.exp(z - lse[..., None]), 0.0)
    dp = jnp.einsum("bqhv,bqwv->bqhw", do, kv[..., :v], precision=HI)
    dz = p * (dp - dd[..., None])
    dq = scale * jnp.einsum("bqhw,bqwc->bqhc", dz, kv, precision=HI)
    if latent_scale is not None:
        return dq.astype(q.dtype), jnp.zeros_like(latent)
    dkv = scale * jnp.einsum("bqhw,bqhc->bqwc", dz, qf, precision=HI)
    dkv = dkv.at[..., :v].add(jnp.einsum("bqhw,bqhv->bqwv", p, do, precision=HI))
    length = latent.shape[1]
    ids = jnp.where(valid, token_ids, length)  # out of bounds: dropped
    dlat = jnp.zeros(latent.shape, f)
    if latent.shape[0] == 1:
        dlat = dlat.at[0, ids].add(dkv, mode="drop")
    else:
        dlat = jax.vmap(lambda d, i, g: d.at[i].add(g, mode="drop"))(dlat, ids, dkv)
    return dq.astype(q.dtype), dlat.astype(latent.dtype)


def sparse_mla_backward(
    q: jax.Array, latent: jax.Array, token_ids: jax.Array, out: jax.Array, lse: jax.Array,
    d_out: jax.Array, latent_scale: jax.Array | None = None, *, scale: float,
    value_width: int | None = None, implementation: Implementation = "xla",
    block_sizes: SparseMlaBackwardBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Backward of ``sparse_mla``: ``(dq [B, Q, H, CR] in q.dtype, dlatent [B or 1, L, CR]
    in latent.dtype)``; arguments as ``sparse_mla_backward_reference``. ``block_sizes`` (a
    ``SparseMlaBackwardBlockSizes``, validated under every implementation) tiles the
    Triton kernels. ``scale`` must be a static float for the Pallas kernels."""
    implementation = resolve_implementation(implementation, "sparse_mla")
    blocks = check_block_sizes(block_sizes, SparseMlaBackwardBlockSizes)
    check_operands(q, latent, token_ids, latent_scale)
    b, nq, h, cr = q.shape
    v = check_value_width(value_width, cr)
    latent_scale = check_group_scales(latent_scale, cr, v, implementation, kernels_read=True)
    for name, x, shape in (("out", out, (b, nq, h, v)), ("d_out", d_out, (b, nq, h, v)),
                           ("lse", lse, (b, nq, h))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {shape} ([B, Q, H{', V' if len(shape) == 4 else ''}]), "
                             f"got {tuple(x.shape)}")
    if implementation == "xla":
        return sparse_mla_backward_reference(
            q, latent, token_ids, out, lse, d_out, latent_scale, scale=scale, value_width=v)
    try:
        scale = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(
            f"scale must be a static Python float for the Pallas kernels, got {scale!r}") from e
    if implementation.startswith("mosaic") and latent_scale is None and mosaic_takes(q.dtype, latent.dtype):
        transpose = selection_transpose(token_ids, latent.shape[1], shared=latent.shape[0] == 1,
                                        block_rows=MOSAIC_TRANSPOSE_ROWS)
        return _sparse_mla_backward_mosaic(
            q, latent, token_ids, out, lse, d_out, transpose, scale=scale, value_width=v,
            interpret=implementation == "mosaic_interpret",
            block_sizes=MosaicSparseMlaBackwardBlockSizes())
    interpret = implementation in ("pallas_interpret", "mosaic_interpret")
    return _sparse_mla_backward_pallas(
        q, latent, token_ids, out, lse, d_out, latent_scale, scale=scale, value_width=v,
        interpret=interpret, block_sizes=blocks.resolve(q.shape, token_ids.shape[2]))


_sparse_mla_backward_mosaic = eager_jit("scale", "value_width", "interpret", "block_sizes")(
    mosaic_sparse_mla_backward)


# ------------------------------------------------------------- Pallas kernels (Triton backend)
# dq: grid (B*Q*head_blocks,), one program per (query, block of ``block_h`` heads), as the
# forward's. It finds ``n_end`` (the forward's scan), then per block of ``block_w`` ids:
# gathers the rows (masked load), ``s = q @ kv.T`` over the ``n_c`` column chunks, ``dp =
# d_out @ kv[:, :V].T`` over the ``n_v`` value chunks, ``p = exp(s * scale - lse)`` where
# valid, ``dz = p * (dp - D)``, ``acc_c += dz @ kv_c`` (dz cast to the rows' dot dtype);
# writes ``scale * acc`` in q's dtype.
#
# dlatent: grid (ceil(R / block_rows),), one program per block of latent rows (flattened
# ``[R, CR]``). It loads its rows once (none when no entry names the block: a query tile's
# backward touches few of a long context's blocks), then walks its transpose entries ``block_start[k] :
# block_start[k + 1]`` times the head blocks, in order; per (entry, head block): the
# query's ``q [block_h, CR]``, ``d_out [block_h, V]``, ``lse``, ``D``; everything
# transposed so no dot needs a transposed operand: ``sT = kv @ q.T [block_rows, block_h]``,
# ``dpT = kv[:, :V] @ d_out.T``, ``pT = exp(sT * scale - lse)`` where the entry's mask bit
# of the row is set, ``dzT = pT * (dpT - D)``, ``acc_c += pT @ d_out_c`` (value chunks) ``+
# (scale * dzT) @ q_c``. Writes the block's rows once, in latent's dtype. Every dot has
# every dim >= 16 (block_rows, block_h, block_c).


def _dq_kernel(ids_ref, q_ref, do_ref, lse_ref, dd_ref, lat_ref, *refs,
               scale, length, width, n_c, n_v, block_w, block_c, latent_c, fp8, groups=None, n_groups=1):
    # With group scales (``groups``: ``_mla.chunk_groups``) scale_ref is [L * G] and each
    # (chunk, group) dot takes its group's scales, as the forward's.
    scale_ref, (dq_ref,) = (refs[0], refs[1:]) if fp8 else (None, refs)
    n_end = row_end(ids_ref, width, length)
    n_blocks = (n_end + block_w - 1) // block_w
    qs = [q_ref[:, pl.ds(c * block_c, block_c)] for c in range(n_c)]
    dos = [do_ref[:, pl.ds(c * block_c, block_c)] for c in range(n_v)]
    lse, dd = lse_ref[...], dd_ref[...]
    kv_dtype = key_dot_dtype(q_ref.dtype) if fp8 else lat_ref.dtype
    col_ok = [c * block_c + jnp.arange(block_c, dtype=jnp.int32) < latent_c for c in range(n_c)]
    cols = [jnp.minimum(c * block_c + jnp.arange(block_c, dtype=jnp.int32), latent_c - 1)
            for c in range(n_c)]

    def body(j, accs):
        ids = ids_ref[pl.ds(j * block_w, block_w)]
        ok = (ids >= 0) & (ids < length)
        rows = jnp.where(ok, ids, 0)
        kvs = [plgpu.load(lat_ref.at[rows[:, None], cols[c][None, :]],
                          mask=ok[:, None] & col_ok[c][None, :], other=0.0 if fp8 else 0
                          ).astype(kv_dtype) for c in range(n_c)]
        if groups is not None:
            return _dq_groups(accs, qs, dos, kvs, rows, ok, lse, dd, scale_ref, scale=scale, n_v=n_v,
                              block_c=block_c, latent_c=latent_c, groups=groups, n_groups=n_groups,
                              kv_dtype=kv_dtype)
        s = dot_nt(qs[0], kvs[0])
        for c in range(1, n_c):
            s += dot_nt(qs[c], kvs[c])
        dp = dot_nt(dos[0], kvs[0])
        for c in range(1, n_v):
            dp += dot_nt(dos[c], kvs[c])
        if fp8:  # the row scales: on the score and on the value (kv = row8 * scale_row)
            row_scale = plgpu.load(scale_ref.at[rows], mask=ok, other=0.0)[None, :]
            s, dp = s * row_scale, dp * row_scale
        p = jnp.where(ok[None, :], jnp.exp(s * scale - lse[:, None]), 0.0)
        dz = p * (dp - dd[:, None])
        if fp8:
            dz = dz * row_scale
        dz = dz.astype(kv_dtype)
        return tuple(acc + dot_nn(dz, kv) for acc, kv in zip(accs, kvs))

    acc0 = tuple(jnp.zeros((qs[0].shape[0], block_c), jnp.float32) for _ in range(n_c))
    accs = lax.fori_loop(0, n_blocks, body, acc0)
    for c, acc in enumerate(accs):
        plgpu.store(dq_ref.at[:, pl.ds(c * block_c, block_c)], (acc * scale).astype(dq_ref.dtype))


def _dq_groups(accs, qs, dos, kvs, rows, ok, lse, dd, scale_ref, *, scale, n_v, block_c, latent_c,
               groups, n_groups, kv_dtype):
    """One id block of ``_dq_kernel`` on group scales: ``s`` and ``dp`` sum one dot per
    (chunk, group) times the group's scales; ``acc_c`` adds ``(dz * s_g) @ kv_c`` on each
    group's columns."""
    gs = {g: plgpu.load(scale_ref.at[rows * n_groups + g], mask=ok, other=0.0)[None, :]
          for g in sorted({part[0] for chunk in groups for part in chunk})}

    def grouped(x, c):  # the chunk's (group, x restricted to the group's columns) pairs
        for g, lo, hi in groups[c]:
            part = part_columns(c, block_c, latent_c, lo, hi)
            yield g, part, (x if part is None else jnp.where(part[None, :], x, jnp.zeros((), x.dtype)))

    s = sum(dot_nt(qg, kvs[c]) * gs[g] for c in range(len(kvs)) for g, _, qg in grouped(qs[c], c))
    dp = sum(dot_nt(dg, kvs[c]) * gs[g] for c in range(n_v) for g, _, dg in grouped(dos[c], c))
    p = jnp.where(ok[None, :], jnp.exp(s * scale - lse[:, None]), 0.0)
    dz = p * (dp - dd[:, None])
    dzs = {g: (dz * sc).astype(kv_dtype) for g, sc in gs.items()}
    out = []
    for c, (acc, kv) in enumerate(zip(accs, kvs)):
        for g, part, _ in grouped(kv, c):
            d = dot_nn(dzs[g], kv)
            acc = acc + (d if part is None else jnp.where(part[None, :], d, 0.0))
        out.append(acc)
    return tuple(out)


def _dlatent_kernel(start_ref, query_ref, mask_ref, q_ref, do_ref, lse_ref, dd_ref, lat_ref,
                    dlat_ref, *, scale, n_rows, n_h, n_c, n_v, block_h, block_rows, block_c,
                    latent_c):
    k = pl.program_id(0)
    lo, hi = start_ref[k], start_ref[k + 1]
    r = k * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    r_ok = (r < n_rows) & (hi > lo)  # a block no query selects reads nothing, writes zeros
    r_safe = jnp.where(r_ok, r, 0)
    col_ok = [c * block_c + jnp.arange(block_c, dtype=jnp.int32) < latent_c for c in range(n_c)]
    cols = [jnp.minimum(c * block_c + jnp.arange(block_c, dtype=jnp.int32), latent_c - 1)
            for c in range(n_c)]
    kvs = [plgpu.load(lat_ref.at[r_safe[:, None], cols[c][None, :]],
                      mask=r_ok[:, None] & col_ok[c][None, :], other=0).astype(q_ref.dtype)
           for c in range(n_c)]
    bit = jnp.arange(block_rows, dtype=jnp.int32)

    def body(t, accs):
        e, hb = t // n_h, t % n_h
        n, mask = query_ref[e], mask_ref[e]
        sel = (jnp.right_shift(mask, bit) & 1) != 0  # the rows of the block this query selects
        heads = pl.ds(pl.multiple_of(hb * block_h, block_h), block_h)
        qs = [q_ref[n, heads, pl.ds(c * block_c, block_c)] for c in range(n_c)]
        dos = [do_ref[n, heads, pl.ds(c * block_c, block_c)] for c in range(n_v)]
        lse, dd = lse_ref[n, heads], dd_ref[n, heads]
        s = dot_nt(kvs[0], qs[0])  # [block_rows, block_h]
        for c in range(1, n_c):
            s += dot_nt(kvs[c], qs[c])
        dp = dot_nt(kvs[0], dos[0])
        for c in range(1, n_v):
            dp += dot_nt(kvs[c], dos[c])
        p = jnp.where(sel[:, None], jnp.exp(s * scale - lse[None, :]), 0.0)
        # Masked by where, not by p = 0: a row the query does not select may hold anything
        # (NaN included), and 0 * NaN would leak into that row's gradient.
        dz = jnp.where(sel[:, None], p * (dp - dd[None, :]) * scale, 0.0).astype(q_ref.dtype)
        p = p.astype(do_ref.dtype)
        return tuple(
            acc + dot_nn(dz, qs[c]) + (dot_nn(p, dos[c]) if c < n_v else 0.0)
            for c, acc in enumerate(accs))

    acc0 = tuple(jnp.zeros((block_rows, block_c), jnp.float32) for _ in range(n_c))
    accs = lax.fori_loop(lo * n_h, hi * n_h, body, acc0)
    for c, acc in enumerate(accs):
        plgpu.store(dlat_ref.at[:, pl.ds(c * block_c, block_c)], acc.astype(dlat_ref.dtype))


def _pad_to(x, shape):
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


@eager_jit("scale", "value_width", "interpret", "block_sizes")
def _sparse_mla_backward_pallas(
    q, latent, token_ids, out, lse, d_out, latent_scale, *, scale, value_width, interpret,
    block_sizes: SparseMlaBackwardBlockSizes,
):
    """The two Triton kernels with the resolved ``block_sizes`` (see the comment above
    ``_dq_kernel``): ``(dq, dlatent)``."""
    bs = block_sizes
    b, nq, h, c = q.shape
    bl, length, _ = latent.shape
    v, width = value_width, token_ids.shape[2]
    fp8 = latent_scale is not None
    if b * nq * h * c == 0 or width == 0 or length == 0:  # nothing was attended to
        return jnp.zeros_like(q), jnp.zeros_like(latent)
    rows, block_c = b * nq, bs.block_c
    n_c, n_v = -(-c // block_c), -(-v // block_c)
    c_pad, v_pad = n_c * block_c, n_v * block_c
    h_pad = max(-(-h // bs.block_h) * bs.block_h, -(-h // bs.dlatent_block_h) * bs.dlatent_block_h)
    dd = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # D [B, Q, H]
    # Padded heads: zero queries and cotangents, lse and D 0: their p is 1 at valid slots
    # but their dz and their p @ d_out are 0, so they add nothing.
    qp = _pad_to(q.reshape(rows, h, c), (rows, h_pad, c_pad))
    dop = _pad_to(d_out.astype(q.dtype).reshape(rows, h, v), (rows, h_pad, v_pad))
    lsep = _pad_to(lse.astype(jnp.float32).reshape(rows, h), (rows, h_pad))
    ddp = _pad_to(dd.reshape(rows, h), (rows, h_pad))
    shared = bl == 1
    params = lambda warps, stages: plgpu.CompilerParams(num_warps=warps, num_stages=stages)

    # dq
    ids = pad_ids(token_ids, bs.block_w)
    n_h = h_pad // bs.block_h
    head_block = lambda i: (i // n_h, i % n_h)
    lat_map = (lambda i: (0, 0, 0)) if shared else (lambda i: (i // n_h // nq, 0, 0))
    in_specs = [
        pl.BlockSpec((None, ids.shape[1]), lambda i: (i // n_h, 0)),
        pl.BlockSpec((None, bs.block_h, c_pad), lambda i: (*head_block(i), 0)),
        pl.BlockSpec((None, bs.block_h, v_pad), lambda i: (*head_block(i), 0)),
        pl.BlockSpec((None, bs.block_h), head_block),
        pl.BlockSpec((None, bs.block_h), head_block),
        pl.BlockSpec((None, length, c), lat_map),
    ]
    operands = [ids, qp, dop, lsep, ddp, latent]
    grouped = fp8 and latent_scale.ndim == 3  # [B|1, L, G]: group scales, read as [L * G]
    n_groups = latent_scale.shape[2] if grouped else 1
    if fp8:
        in_specs.append(pl.BlockSpec(
            (None, length * n_groups), (lambda i: (0, 0)) if shared else (lambda i: (i // n_h // nq, 0))))
        operands.append(latent_scale.astype(jnp.float32).reshape(latent_scale.shape[0], length * n_groups))
    dq = pl.pallas_call(
        functools.partial(
            _dq_kernel, scale=scale, length=length, width=ids.shape[1], n_c=n_c, n_v=n_v,
            block_w=bs.block_w, block_c=block_c, latent_c=c, fp8=fp8, n_groups=n_groups,
            groups=chunk_groups(c, v, n_groups, block_c) if grouped else None),
        grid=(rows * n_h,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bs.block_h, c_pad), lambda i: (*head_block(i), 0)),
        out_shape=jax.ShapeDtypeStruct((rows, h_pad, c_pad), q.dtype),
        compiler_params=params(bs.num_warps, bs.num_stages),
        interpret=interpret,
        name="sparse_mla_dq",
    )(*operands)
    dq = dq[:, :h, :c].reshape(b, nq, h, c)
    if fp8:  # no latent gradient for fp8 rows (module doc)
        return dq, jnp.zeros_like(latent)

    # dlatent, token-major
    n_rows, block_rows = bl * length, bs.block_rows
    n_blocks = -(-n_rows // block_rows)
    t = selection_transpose(token_ids, length, shared=shared, block_rows=block_rows)
    whole = lambda x: pl.BlockSpec(x.shape, lambda k: (0,) * x.ndim)
    operands = [t.block_start, t.entry_query, t.entry_mask, qp, dop, lsep, ddp,
                latent.reshape(n_rows, c)]
    dlat = pl.pallas_call(
        functools.partial(
            _dlatent_kernel, scale=scale, n_rows=n_rows, n_h=h_pad // bs.dlatent_block_h,
            n_c=n_c, n_v=n_v, block_h=bs.dlatent_block_h, block_rows=block_rows,
            block_c=block_c, latent_c=c),
        grid=(n_blocks,),
        in_specs=[whole(x) for x in operands],
        out_specs=pl.BlockSpec((block_rows, c_pad), lambda k: (k, 0)),
        out_shape=jax.ShapeDtypeStruct((n_blocks * block_rows, c_pad), latent.dtype),
        compiler_params=params(bs.dlatent_num_warps, bs.dlatent_num_stages),
        interpret=interpret,
        name="sparse_mla_dlatent",
    )(*operands)
    return dq, dlat[:n_rows, :c].reshape(bl, length, c)
