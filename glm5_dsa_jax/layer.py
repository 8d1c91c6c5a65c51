"""Flax NNX modules of one DSA layer: the lightning indexer and weight-absorbed sparse MLA.

Invariants:

* Parameters are the rows of the layout table (``glm5_dsa_jax.layout``: names, shapes,
  initialisers, creation order), stored in JAX layout (``[in, out]``, heads as their own
  axis), and carry their tensor-parallel placement as ``out_sharding`` metadata: the head
  axis of ``q_b_proj``, ``w_uk``, ``w_uv`` and ``o_proj`` is named ``tp_axis``; everything
  else, the whole indexer included, is replicated (see ``glm5_dsa_jax.plan`` for why).
* ``kv_b_proj`` is split once, at load, into ``w_uk [heads, qk_nope, kv_lora]`` and
  ``w_uv [heads, v_head, kv_lora]``; attention then runs in the ``kv_lora_rank``-wide
  latent space (``absorb_q`` before, ``absorb_o`` after), reading one latent row per
  selected token for all heads.
* Every call goes through the same path, with or without a cache: a call without a cache
  runs on a fresh cache sized to the input. Prefill rows are processed in tiles of
  ``block_q`` queries, so no ``[S, S]`` or ``[S, pools]`` tensor is ever built.
* A padding query gets a top-k row of ``-1`` and an output of zeros; a padding token's
  hidden state is zeroed before any projection, so a NaN there goes nowhere.
* On a CPU the compiled step (``decode.make_step``) multiplies by float32 copies of 16-bit
  parameters: XLA:CPU runs a bf16 matrix-vector product more than ten times slower than
  the float32 one. Each copy is a cached value derived from one parameter array
  (``float32_params``), never written back: the layer's parameters, ``param_dtype``,
  ``params_to_hf`` and checkpoints keep the user's dtype. Each product still rounds its
  output to the activation dtype, so only the float32 accumulation order can differ
  (bf16 -> float32 is exact). ``cpu_float32=False`` opts out; other platforms never
  use the copies.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from pallas_kernels._common import check_implementation
from glm5_dsa_jax import layout
from glm5_dsa_jax.cache import DsaCache, init_cache
from glm5_dsa_jax.config import DsaConfig
from glm5_dsa_jax.layout import hf_weight_shapes
from glm5_dsa_jax.weights import hf_to_params

__all__ = ["DsaIndexer", "DsaAttention", "rms_norm", "layer_norm", "absorb_q", "absorb_o",
           "float32_params", "clear_float32_copies"]

_HI = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------- helpers
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


def _mm(spec: str, x: jax.Array, w: jax.Array, wide: bool = False, **kwargs) -> jax.Array:
    """``einsum(spec, x, w)`` in ``x``'s dtype. ``wide``: both operands in float32 and the
    output rounded to ``x.dtype`` (what XLA:CPU's bf16 product computes, at float32 speed);
    otherwise ``w`` is cast to ``x.dtype`` (the GPU path)."""
    if wide:
        f32 = jnp.float32
        return jnp.einsum(spec, x.astype(f32), w.astype(f32), precision=_HI, **kwargs).astype(x.dtype)
    return jnp.einsum(spec, x, w.astype(x.dtype), precision=_HI, **kwargs)


def absorb_q(q_nope: jax.Array, w_uk: jax.Array, *, wide: bool = False) -> jax.Array:
    """``[B, S, H, qk_nope] x [H, qk_nope, C] -> [B, S, H, C]``: the query in latent space."""
    return _mm("bshd,hdc->bshc", q_nope, w_uk, wide)


def absorb_o(
    o_lat: jax.Array, w_uv: jax.Array, o_proj: jax.Array, bias: jax.Array | None = None,
    *, wide: bool = False,
) -> jax.Array:
    """``[B, S, H, C]`` latent attention output -> ``[B, S, hidden]``: ``W_UV`` then ``o_proj``."""
    from glm5_dsa_jax.sharding import row_parallel_out_sharding

    o = _mm("bshc,hvc->bshv", o_lat, w_uv, wide)
    # Row-parallel under TP: the head axis contracted here may be sharded; the partial sums
    # are all-reduced once. Explicit mesh axes need the output sharding spelled out.
    out = _mm("bshv,hvo->bso", o, o_proj, wide, out_sharding=row_parallel_out_sharding(o))
    return out if bias is None else out + bias.astype(out.dtype)


def _write_rows(buf: jax.Array, rows: jax.Array, start: jax.Array, fits: jax.Array) -> jax.Array:
    """``buf[:, start:start+S] = rows`` in place, or nothing at all when not ``fits``.

    ``lax.cond`` rather than a masked scatter or a ``where`` over the old rows: both of
    those made XLA:CPU rewrite (or copy) the whole buffer, an O(cache) pass per step.
    16-bit floats are written through their bits, or XLA:CPU turns
    ``DUS(buf, convert(rows))`` into ``convert(DUS(convert(buf), rows))``.
    """
    idx = (jnp.zeros((), jnp.int32), start) + (jnp.zeros((), jnp.int32),) * (buf.ndim - 2)
    rows = rows.astype(buf.dtype)
    return jax.lax.cond(fits, lambda b: jax.lax.dynamic_update_slice(b, rows, idx), lambda b: b, buf)


def _write_pools(buf, valid_buf, rows, valid_rows, pool_ids, new):
    """``buf[b, pool_ids[b, i]] = rows[b, i]`` (and the validity) where ``new[b, i]``.

    One ``cond``-guarded ``dynamic_update_slice`` per (row, window pool): in place. A masked
    scatter is the natural form, but XLA:CPU has no 16-bit-float scatter and converts the
    whole ``[B, max_pools, D]`` cache to float32 and back around it on every step.
    """
    b, n = pool_ids.shape
    rows = rows.astype(buf.dtype)
    zero = jnp.zeros((), jnp.int32)

    def body(i, carry):
        r, j = i // n, i % n

        def write(c):
            buf, vbuf = c
            p = pool_ids[r, j]
            buf = jax.lax.dynamic_update_slice(buf, rows[r, j][None, None], (r, p, zero))
            vbuf = jax.lax.dynamic_update_slice(vbuf, valid_rows[r, j][None, None], (r, p))
            return buf, vbuf

        return jax.lax.cond(new[r, j], write, lambda c: c, carry)

    return jax.lax.fori_loop(0, b * n, body, (buf, valid_buf))


def _dense(x, w, wide=False):
    return _mm("...i,io->...o", x, w, wide)


# ---------------------------------------------------------------------------- CPU float32 copies
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


def _mesh_has(axis: str | None) -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return axis is not None and not mesh.empty and axis in mesh.axis_names


class _ParamFactory:
    """Makes the ``nnx.Param`` of a ``layout.Param`` row, with ``out_sharding`` metadata.

    The shape, initialiser and head axis come from the layout table. The metadata is kept
    even with no mesh in context (eager sharding is then switched off for the creation),
    so ``shard_layer`` or a user's ``nnx.get_partition_spec`` can place the parameters later.
    """

    def __init__(self, cfg: DsaConfig, rngs: nnx.Rngs, param_dtype, tp_axis: str | None):
        self.cfg, self.rngs, self.param_dtype, self.tp_axis = cfg, rngs, param_dtype, tp_axis

    def __call__(self, p: layout.Param) -> nnx.Param:
        shape = p.shape(self.cfg)
        if p.init == "ones":
            value = jnp.ones(shape, self.param_dtype)
        elif p.init == "zeros":
            value = jnp.zeros(shape, self.param_dtype)
        else:
            std = p.init_std(self.cfg)
            value = (jax.random.normal(self.rngs.params(), shape, jnp.float32) * std).astype(self.param_dtype)
        spec = p.spec(self.tp_axis)
        if _mesh_has(self.tp_axis):
            return nnx.Param(value, out_sharding=spec)
        with nnx.use_eager_sharding(False):
            return nnx.Param(value, out_sharding=spec)

    def create(self, module: nnx.Module, tensors) -> None:
        """Set ``module.<name>`` for every parameter of ``tensors`` (table order: the order
        the random inits are drawn in)."""
        for _, p in layout.iter_params(tensors):
            setattr(module, p.path[-1], self(p))


# ---------------------------------------------------------------------------- indexer
class DsaIndexer(nnx.Module):
    """The lightning indexer of one full DSA layer (replicated under TP).

    Parameters (the layout table's indexer rows, JAX layout): ``wq_b [q_lora, index_heads,
    D]``, ``wk [hidden, D]``, ``k_norm_scale/k_norm_bias [D]``, ``weights_proj [hidden,
    index_heads]``, ``kpool_gate [hidden, D]`` (HF ``index_kpool_compress_gate``
    transposed), ``kpool_ape [KP, D]``.
    """

    def __init__(self, cfg: DsaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.bfloat16, tp_axis="tp"):
        _ParamFactory(cfg, rngs, param_dtype, tp_axis).create(
            self, [t for t in layout.TENSORS if t.indexer])
        self.eps = cfg.index_norm_eps
        self.index_heads = cfg.index_n_heads

    def project(self, x: jax.Array, q_resid: jax.Array, *, wide: bool = False):
        """``x [B, S, hidden]``, ``q_resid [B, S, q_lora]`` -> queries ``[B, S, Hi, D]``,
        weights ``[B, S, Hi]`` float32, keys ``[B, S, D]``, gate logits ``[B, S, D]`` float32.
        ``wide``: float32 products (see ``_mm``)."""
        q = _mm("bsr,rhd->bshd", q_resid, self.wq_b[...], wide)
        k = layer_norm(_dense(x, self.wk[...], wide), self.k_norm_scale[...], self.k_norm_bias[...], self.eps)
        gate = _dense(x, self.kpool_gate[...], wide).astype(jnp.float32)
        w = _dense(x, self.weights_proj[...], wide).astype(jnp.float32) * (self.index_heads**-0.5)
        return q, w, k, gate


# ---------------------------------------------------------------------------- attention
class DsaAttention(nnx.Module):
    """One GLM-5.3-Flash DSA layer: indexer (unless shared) + weight-absorbed sparse MLA.

    Args:
      cfg: the model's ``DsaConfig``.
      layer_idx: index of an ``indexed_attention`` layer of ``cfg``.
      rngs: initialisation randomness (weights are usually loaded after).
      implementation: ``"xla"``, ``"pallas"`` or ``"pallas_interpret"``, for every
        pipeline step.
      dtype: compute dtype of activations and of the default cache (bf16).
      param_dtype: storage dtype of the parameters (bf16).
      tp_axis: mesh axis name the head axis is sharded over (metadata only until the
        layer is placed on a mesh).
      block_q: queries per prefill tile (bounds the ``[block_q, pools]`` score tile).
      cpu_float32: let the compiled step (``decode.make_step``) multiply by cached float32
        copies of 16-bit parameters when every parameter lives on a CPU device (see the
        module doc; ``float32_compute()``). Also a plain attribute, read by ``make_step``.

    Call: ``out, topk = layer(x, attention_mask=mask, prev_topk=None)`` without a cache;
    ``out, topk, cache = layer(x, attention_mask=mask, cache=cache)`` with one. ``x`` is
    ``[B, S, hidden]``, ``mask`` ``[B, S]`` bool (or 0/1 ints; None = all valid), ``out``
    ``[B, S, hidden]`` in ``dtype`` and ``topk`` ``[B, S, out_width]`` int32 token slots.
    """

    def __init__(
        self,
        cfg: DsaConfig,
        layer_idx: int,
        *,
        rngs: nnx.Rngs,
        implementation: str = "xla",
        dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16,
        tp_axis: str | None = "tp",
        block_q: int = 64,
        cpu_float32: bool = True,
    ):
        cfg.validate()
        cfg.check_layer(layer_idx)
        check_implementation(implementation)
        if not isinstance(block_q, int) or block_q <= 0:
            raise ValueError(f"block_q must be a positive int, got {block_q!r}")
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.implementation = implementation
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.tp_axis = tp_axis
        self.block_q = block_q
        self.cpu_float32 = bool(cpu_float32)
        # True only on the copy a compiled step merges (make_step): float32 products.
        self._wide = False
        # The attention's own tensors (the indexer's are DsaIndexer's); without
        # attention_bias the bias attributes are None.
        _ParamFactory(cfg, rngs, param_dtype, tp_axis).create(self, layout.layer_tensors(cfg, indexer=False))
        for t in layout.TENSORS:
            if t.bias and not cfg.attention_bias:
                setattr(self, t.params[0].path[-1], None)
        self.indexer = (
            DsaIndexer(cfg, rngs=rngs, param_dtype=param_dtype, tp_axis=tp_axis)
            if cfg.has_indexer(layer_idx)
            else None
        )

    # ------------------------------------------------------------------ weights
    @property
    def has_indexer(self) -> bool:
        return self.indexer is not None

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor names (relative to ``self_attn.``) and their PyTorch shapes."""
        return hf_weight_shapes(self.cfg, self.layer_idx)

    def load_hf_weights(self, weights: Mapping[str, Any]) -> None:
        """Load HF tensors (names relative to ``self_attn.``, PyTorch ``[out, in]`` layout).

        Every problem (missing, unexpected, misshaped, non-finite) is collected and raised
        as one ``ValueError`` before any parameter changes, so a failed load leaves the
        layer as it was.
        """
        params = hf_to_params(self.cfg, self.layer_idx, weights, self.param_dtype)
        for path, value in params.items():
            obj = self
            for part in path[:-1]:
                obj = getattr(obj, part)
            var = getattr(obj, path[-1])
            old = var[...]
            if getattr(old, "sharding", None) is not None and not isinstance(
                old.sharding, jax.sharding.SingleDeviceSharding
            ):
                value = jax.device_put(value, old.sharding)
            var.set_value(value)

    def float32_compute(self) -> bool:
        """Whether ``make_step`` runs this layer's products in float32 (on cached float32
        copies of 16-bit parameters): ``cpu_float32`` is set and every parameter lives on
        CPU devices only (decided by where the parameters are, e.g. a ``shard_layer``
        mesh, not by which backends exist)."""
        if not self.cpu_float32:
            return False
        leaves = jax.tree.leaves(nnx.state(self, nnx.Param))
        platforms = {d.platform for a in leaves if isinstance(a, jax.Array) for d in a.devices()}
        return platforms == {"cpu"}

    # ------------------------------------------------------------------ cache
    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> DsaCache:
        """An empty decode cache for this layer (``dtype`` defaults to the compute dtype)."""
        cache = init_cache(
            self.cfg, batch_size, max_length, has_indexer=self.has_indexer,
            dtype=self.dtype if dtype is None else dtype,
        )
        if getattr(self, "mesh", None) is not None:  # placed by shard_layer: replicated
            from glm5_dsa_jax.sharding import place_cache

            cache = place_cache(cache, self.mesh)
        return cache

    def _place_inputs(self, *arrays):
        """Inputs of a layer placed by ``shard_layer`` that are not on its mesh yet,
        replicated on it (``Explicit`` meshes need every operand there; see
        ``sharding.place_inputs``). Before ``shard_layer`` this is a no-op."""
        if getattr(self, "mesh", None) is None:
            return arrays
        from glm5_dsa_jax.sharding import place_inputs

        return place_inputs(self.mesh, *arrays)

    def _kernel(self, fn, *args, **kwargs):
        """Run an indexer pipeline kernel. On a layer placed by ``shard_layer`` a Pallas
        kernel runs on every device over its replicated inputs under ``shard_map``
        (``sharding.replicated_call``); otherwise, and for ``"xla"``, a plain call."""
        if getattr(self, "mesh", None) is None or self.implementation == "xla":
            return fn(*args, **kwargs)
        from glm5_dsa_jax.sharding import replicated_call

        return replicated_call(self.mesh, fn, *args, **kwargs)

    # ------------------------------------------------------------------ forward
    def __call__(
        self,
        hidden_states: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        cache: DsaCache | None = None,
        prev_topk: jax.Array | None = None,
    ):
        prev_topk = as_index_array(prev_topk)
        start = 0 if cache is None else cache.length
        x, mask = self._check_inputs(hidden_states, attention_mask, prev_topk, start=start)
        x, mask, prev_topk = self._place_inputs(x, mask, prev_topk)
        b, s, _ = x.shape
        if cache is None:
            out, topk, _ = self._step(x, mask, self.init_cache(b, s), prev_topk)
            return out, topk
        cache.check(self.cfg, self.has_indexer, b)
        if not isinstance(cache.length, jax.core.Tracer):
            length = int(cache.length)
            if length + s > cache.max_length:
                raise ValueError(
                    f"chunk of {s} tokens does not fit the cache: {length} of "
                    f"{cache.max_length} slots are used; nothing was written"
                )
        return self._step(x, mask, cache, prev_topk)

    def selection_scores(self, hidden_states: jax.Array, attention_mask: jax.Array | None = None):
        """The indexer's view of a prompt, for inspection: ``scores [B, S, P]`` float32
        (``-inf`` = not a candidate) over the prompt's pools, and ``first_key [B]``.

        Builds the full ``[S, P]`` score matrix: meant for short prompts in a notebook or
        a test, not for serving.
        """
        if self.indexer is None:
            raise ValueError(f"layer {self.layer_idx} is a 'shared' layer: it has no indexer")
        x, mask = self._check_inputs(hidden_states, attention_mask, None)
        x, mask = self._place_inputs(x, mask)
        x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
        q_resid, _, _ = self.project(x)
        qi, w, ki, gate = self.indexer.project(x, q_resid)
        pooled, first_key, pool_valid = self._kernel(
            pk.kpool_compress, ki, gate, mask, self.indexer.kpool_ape[...], implementation=self.implementation
        )
        q_pos = jnp.where(mask, jnp.arange(x.shape[1], dtype=jnp.int32)[None], -1)
        scores = self._kernel(
            pk.index_scores, qi, w, pooled, pool_valid, first_key, q_pos, kpool=self.cfg.index_kpool,
            implementation=self.implementation,
        )
        return scores, first_key

    def _check_inputs(self, hidden_states, attention_mask, prev_topk, start=None):
        """``(x, mask)`` after checking every input. ``start`` is the slot of the first
        query (the cache's length): with it, a concrete ``prev_topk`` is checked causal."""
        cfg = self.cfg
        x = jnp.asarray(hidden_states)
        if x.ndim != 3 or x.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"hidden_states must be [B, S, hidden={cfg.hidden_size}], got shape {tuple(x.shape)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"hidden_states must be floating point, got {x.dtype}")
        b, s, _ = x.shape
        if s == 0 or b == 0:
            raise ValueError(f"hidden_states has an empty batch or sequence: {tuple(x.shape)}")
        if attention_mask is None:
            mask = jnp.ones((b, s), bool)
        else:
            mask = jnp.asarray(attention_mask)
            if mask.shape != (b, s):
                raise ValueError(
                    f"attention_mask must be [B, S] = {(b, s)} like hidden_states, got {tuple(mask.shape)}"
                )
            if mask.dtype != jnp.bool_:
                if not jnp.issubdtype(mask.dtype, jnp.integer):
                    raise ValueError(
                        f"attention_mask must be bool or 0/1 integers, got dtype {mask.dtype}"
                    )
                if not isinstance(mask, jax.core.Tracer):
                    bad = np.setdiff1d(np.unique(np.asarray(mask)), [0, 1])
                    if bad.size:
                        raise ValueError(
                            f"attention_mask must hold only 0 and 1, found {bad[:5].tolist()}"
                        )
                mask = mask != 0
        if self.has_indexer:
            if prev_topk is not None:
                raise ValueError(
                    f"layer {self.layer_idx} runs its own indexer; prev_topk is only for "
                    "'shared' layers"
                )
        else:
            if prev_topk is None:
                raise ValueError(
                    f"layer {self.layer_idx} is a 'shared' indexer layer: pass prev_topk, the "
                    "top-k of the previous 'full' layer"
                )
            prev_topk = as_index_array(prev_topk)
            if prev_topk.shape != (b, s, cfg.out_width) or not jnp.issubdtype(prev_topk.dtype, jnp.integer):
                raise ValueError(
                    f"prev_topk must be integer [B, S, out_width] = {(b, s, cfg.out_width)}, "
                    f"got {prev_topk.dtype} {tuple(prev_topk.shape)}"
                )
            concrete = not any(isinstance(a, jax.core.Tracer) for a in (prev_topk, mask, start))
            if start is not None and concrete:
                _check_causal_topk(np.asarray(prev_topk), np.asarray(mask), int(start))
        return x.astype(self.dtype), mask

    def _step(self, x, mask, cache: DsaCache, prev_topk):
        cfg = self.cfg
        b, s, _ = x.shape
        # Padding tokens are zeroed first: whatever they hold (NaN included) is never read.
        x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
        length = cache.length
        fits = length + s <= cache.max_length

        q_resid, q_lat, latent = self.project(x)

        cache = cache.replace(
            latent=_write_rows(cache.latent, latent, length, fits),
            key_valid=_write_rows(cache.key_valid, mask, length, fits),
        )
        q_pos = jnp.where(mask, length + jnp.arange(s, dtype=jnp.int32)[None], -1)

        if self.indexer is not None:
            qi, w, ki, gate = self.indexer.project(x, q_resid, wide=self._wide)
            cache = self._update_pools(cache, ki, gate, mask, fits)
            n_vis = cache.n_valid[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32)
            topk, o_lat = self._select_and_attend(q_lat, cache, q_pos, qi=qi, w=w, n_vis=n_vis)
            cache = cache.replace(n_valid=jnp.where(fits, n_vis[:, -1], cache.n_valid))
        else:
            # Only slots at or before the query's own (q_pos is -1 for padding): a shared
            # layer never attends to the future, even when a traced prev_topk (which
            # _check_inputs cannot see) points there.
            prev = prev_topk.astype(jnp.int32)
            topk = jnp.where((prev >= 0) & (prev <= q_pos[..., None]), prev, -1)
            _, o_lat = self._select_and_attend(q_lat, cache, q_pos, topk=topk)

        out = absorb_o(o_lat, self.w_uv[...], self.o_proj[...],
                       None if self.o_proj_bias is None else self.o_proj_bias[...], wide=self._wide)
        out = jnp.where(mask[..., None], out, jnp.zeros((), out.dtype)).astype(self.dtype)
        cache = cache.replace(length=jnp.where(fits, length + s, length).astype(jnp.int32))
        return out, topk, cache

    def project(self, x: jax.Array):
        """``x [B, S, hidden]`` -> ``q_resid [B, S, q_lora]``, the absorbed query
        ``q_lat [B, S, H, kv_lora]`` and the latent rows ``[B, S, kv_lora]`` (what the cache
        stores), all in ``x``'s dtype."""
        cfg = self.cfg
        q_resid = rms_norm(self._dense(x, self.q_a_proj, self.q_a_proj_bias), self.q_a_layernorm[...], cfg.rms_norm_eps)
        q = _mm("bsr,rhd->bshd", q_resid, self.q_b_proj[...], self._wide)
        q_lat = absorb_q(q[..., : cfg.qk_nope_head_dim], self.w_uk[...], wide=self._wide)
        kv = self._dense(x, self.kv_a_proj, self.kv_a_proj_bias)
        latent = rms_norm(kv[..., : cfg.kv_lora_rank], self.kv_a_layernorm[...], cfg.rms_norm_eps)
        return q_resid, q_lat, latent

    def _dense(self, x, w, bias):
        y = _dense(x, w[...], self._wide)
        return y if bias is None else y + bias[...].astype(y.dtype)

    def _update_pools(self, cache: DsaCache, ki, gate, mask, fits) -> DsaCache:
        """Pool the keys of every pool that completes in this chunk, once, into the cache.

        The window is the last ``KP`` slots before the chunk (``stage_*``) plus the chunk:
        it holds every slot of any pool whose last slot is in the chunk.
        """
        cfg = self.cfg
        kp = cfg.index_kpool
        b, s, _ = ki.shape
        length, big = cache.length, cache.max_length
        win_start = length - kp
        win_k = jnp.concatenate([cache.stage_keys, ki.astype(cache.stage_keys.dtype)], axis=1)
        win_g = jnp.concatenate([cache.stage_gate, gate], axis=1)
        win_v = jnp.concatenate([cache.stage_valid, mask], axis=1)
        chunk_first = pk.first_valid(mask)
        first_key = jnp.where(
            cache.first_key < big, cache.first_key,
            jnp.where(chunk_first < s, length + chunk_first, big),
        ).astype(jnp.int32)
        rel = first_key - win_start
        # Start of the first whole pool inside the window, on first_key's pool grid.
        wfirst = jnp.where(first_key >= big, kp + s, jnp.where(rel >= 0, rel, jnp.mod(rel, kp)))
        pooled, _, pvalid = self._kernel(
            pk.kpool_compress,
            win_k, win_g, win_v, self.indexer.kpool_ape[...], wfirst.astype(jnp.int32),
            implementation=self.implementation,
        )
        n_win = pooled.shape[1]
        q = jnp.arange(n_win, dtype=jnp.int32)[None]
        last = win_start + wfirst[:, None] + (q + 1) * kp - 1  # timeline slot of each pool's end
        gp = (win_start + wfirst[:, None] - first_key[:, None]) // kp + q  # pool id on the grid
        new = (last >= length) & (last < length + s) & (wfirst[:, None] < kp + s) & fits
        new &= gp < cache.max_pools
        pooled_cache, pool_valid = _write_pools(cache.pooled, cache.pool_valid, pooled, pvalid, gp, new)
        return cache.replace(
            pooled=pooled_cache,
            pool_valid=pool_valid,
            stage_keys=jnp.where(fits, win_k[:, s:], cache.stage_keys),
            stage_gate=jnp.where(fits, win_g[:, s:], cache.stage_gate),
            stage_valid=jnp.where(fits, win_v[:, s:], cache.stage_valid),
            first_key=jnp.where(fits, first_key, cache.first_key),
        )

    def _attend(self, q_lat, latent, token_ids):
        """Sparse MLA for ``q_lat [B, Q, H, C]`` over ``latent [B, L, C]`` at ``token_ids``.

        Hook for tensor parallelism: on a mesh the heads of ``q_lat`` are sharded and the
        kernel must run per shard (``shard_map``), reading the replicated latent.
        ``shard_layer`` records the mesh (``self.mesh``); until then this is the plain call.
        """
        scale, impl = self.cfg.softmax_scale, self.implementation

        def kernel(q, lat, ids):
            return pk.sparse_mla(q, lat, ids, scale=scale, implementation=impl)

        if getattr(self, "mesh", None) is None:
            return kernel(q_lat, latent, token_ids)
        from glm5_dsa_jax.sharding import layer_attend

        return layer_attend(self, q_lat, latent, token_ids, kernel)

    def _select_and_attend(self, q_lat, cache: DsaCache, q_pos, *, qi=None, w=None, n_vis=None, topk=None):
        """Top-k selection (full layers) and sparse attention, ``block_q`` queries at a time."""
        cfg, impl = self.cfg, self.implementation
        b, s = q_pos.shape
        bq = min(self.block_q, s)
        n_tiles = -(-s // bq)
        pad = n_tiles * bq - s

        def tiles(a, fill):
            if a is None:
                return None
            if pad:
                a = jnp.concatenate([a, jnp.full((b, pad) + a.shape[2:], fill, a.dtype)], axis=1)
            return jnp.moveaxis(a.reshape((b, n_tiles, bq) + a.shape[2:]), 1, 0)

        select_k = cfg.select_k(cache.max_pools) if cache.has_indexer else 0

        def one_tile(args):
            t_qlat, t_pos, t_qi, t_w, t_nvis, t_topk = args
            if t_topk is None:
                scores = self._kernel(
                    pk.index_scores, t_qi, t_w, cache.pooled, cache.pool_valid, cache.first_key, t_pos,
                    kpool=cfg.index_kpool, implementation=impl,
                )
                pools = self._kernel(pk.topk_pools, scores, select_k, implementation=impl)
                tail = None
                if cfg.tail_width:
                    tail = pk.visible_tail(cache.first_key, t_nvis, t_pos, cache.key_valid, cfg.index_kpool)
                    # With holes in the mask the tail (HF's rule: from first_key + visible
                    # - visible % kpool) can fall inside a complete pool that is selected
                    # too; drop those ids so no token is attended twice (HF builds a mask
                    # from the ids, so it counts such a token once).
                    t_pool = jnp.where(tail >= 0, (tail - cache.first_key[:, None, None]) // cfg.index_kpool, -2)
                    tail = jnp.where((t_pool[..., None] == pools[..., None, :]).any(-1), -1, tail)
                t_topk = self._kernel(
                    pk.expand_selection, pools, cache.first_key, tail, kpool=cfg.index_kpool,
                    out_width=cfg.out_width, implementation=impl,
                )
                t_topk = jnp.where(t_pos[..., None] >= 0, t_topk, -1)
            return t_topk, self._attend(t_qlat, cache.latent, t_topk)

        args = (tiles(q_lat, 0), tiles(q_pos, -1), tiles(qi, 0), tiles(w, 0),
                tiles(n_vis, 0), tiles(topk, -1))
        if n_tiles == 1:
            t_topk, o = one_tile(jax.tree.map(lambda a: a[0], args))
            t_topk, o = t_topk[None], o[None]
        else:
            t_topk, o = jax.lax.map(one_tile, args)

        def untile(a):
            a = jnp.moveaxis(a, 0, 1).reshape((b, n_tiles * bq) + a.shape[3:])
            return a[:, :s]

        return untile(t_topk), untile(o)


# ---------------------------------------------------------------------------- input checks
def as_index_array(prev_topk):
    """``prev_topk`` (a list, numpy or jax array, or None) as a jax array, or ``ValueError``."""
    if prev_topk is None or isinstance(prev_topk, jax.Array):
        return prev_topk
    try:
        arr = np.asarray(prev_topk)
    except (ValueError, TypeError) as e:
        raise ValueError(f"prev_topk must be an integer array [B, S, out_width]: {e}") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"prev_topk must be an integer array [B, S, out_width], got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("prev_topk holds values outside int32")
    return jnp.asarray(arr, jnp.int32)


def _check_causal_topk(ids: np.ndarray, mask: np.ndarray, start: int) -> None:
    """Refuse a ``prev_topk`` whose valid queries name a slot after their own (the future)
    or a negative id other than ``-1`` (no token). Padding queries' rows are ignored."""
    pos = start + np.arange(ids.shape[1])
    bad = mask[..., None] & ((ids > pos[None, :, None]) | (ids < -1))
    if bad.any():
        b, q, j = (int(v[0]) for v in np.nonzero(bad))
        raise ValueError(
            f"prev_topk[{b}, {q}, {j}] = {int(ids[b, q, j])} but query {q} sits at slot "
            f"{start + q}: ids must be -1 (no token) or a slot <= the query's own (a shared "
            f"layer never attends to the future); {int(bad.sum())} such entries"
        )
