"""How much an fp8 cache changes a layer's selection and output, against a bf16 cache.

``measure_formats`` compares fp8 cache formats (``FORMATS``: the latent layout, ``"row"``
or ``"group"``, with ``+hadamard`` the indexer's rotated keys; ``glm5_dsa_jax.cache.fp8``)
on one prompt whose hidden states are multiplied by ``x_scale`` (x1e4, x1e6: where one
scale for a RoPE row's ``[c, k_rot]`` loses ``c``), against the bf16 cache of the same
prompt; ``measure`` is one format.

What ``glm5-dsa accuracy`` (and ``tests/test_fp8_accuracy.py``) measure: one layer, the
same weights and the same prompt, decoded from a bf16 cache and from an fp8 cache. The
prompt's first ``context - queries`` tokens are written into both caches (``fill``: the
layer's own write path, steps 0-1, without attending: the outputs of those tokens are not
measured and attending them would cost ``context`` times a decode step); the last
``queries`` tokens are then one call of the layer on each cache. Reported per context:

* ``recall``: the mean over queries of ``|ids_fp8 & ids_bf16| / |ids_bf16|``, the share of
  the bf16 cache's selected tokens that the fp8 cache selects too;
* ``rel_l2``: ``||out_fp8 - out_bf16|| / ||out_bf16||`` over the queries' layer outputs;
* ``rel_l2_same_selection``: the same, the fp8 output recomputed over the bf16 cache's
  selection (``sparse_attention`` and ``output_projection`` of the layer on the fp8 rows at
  the bf16 top-k): the error of the quantised latent rows alone; the rest of ``rel_l2``
  comes from the tokens the fp8 selection swapped.
* ``changed``: pools (of ``select_k`` per query, the cache's pools) in one selection and
  not the other, summed over queries (a swap counts twice), and how many of them
  sit at a **tie** (the pool's bf16 score equals the bf16 cutoff, the ``select_k``-th
  score, exactly) or a **near-tie** (``gap <= NEAR_TIE``): a change there swaps pools the
  bf16 indexer itself barely tells apart. A pool's ``gap`` is ``|s - cutoff|`` in units of
  the standard deviation of its query's live bf16 scores (not relative to the cutoff,
  which can be near 0: the indexer weights can be negative); ``gap_median`` / ``gap_max``
  over the changed pools.

Weights and prompts resemble a trained model's (``trained_like_weights``,
``prompt_states``) because an fp8 cache's error depends on the rows' dynamic range: a
row's scale is its amax, so one large channel costs every other channel precision, and
random N(0, 1) rows (no outlier channels, no repeated tokens) flatter it.

* Projections are variance-preserving, ``N(0, 1 / fan_in)`` per HF ``[out, in]`` weight:
  a trained projection's output RMS is about its input's (the product of RMS-normed
  inputs and weights of RMS ``1/sqrt(fan_in)``), which random N(0, 0.02) inits are not.
* Norm gains are lognormal around 1 (sigma 0.3) with ``OUTLIER_SHARE`` of the channels
  ``OUTLIER_GAIN`` times larger: trained LLMs' RMSNorm gains spread like this and a few
  channels carry "massive activations", which is the hard case for a per-row scale.
* The prompt's hidden states (the input layernorm's output: unit RMS) are token
  embeddings drawn from a Zipf law over a vocabulary of ``VOCAB`` random directions, plus
  a slow positional drift: real text repeats tokens, so pools repeat and near-ties exist.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm5_dsa_jax.cache import DsaCache
from glm5_dsa_jax.cache.fp8 import LATENT_LAYOUTS, index_queries
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.model.layout import hf_weight_shapes

__all__ = ["trained_like_weights", "prompt_states", "fill", "measure", "measure_formats", "Fp8Accuracy",
           "FORMATS", "DEFAULT_FORMAT", "ACCURATE_FORMAT", "format_options", "NEAR_TIE", "OUTLIER_SHARE", "OUTLIER_GAIN", "VOCAB"]

NEAR_TIE = 0.01  # gap to the cutoff (in score standard deviations) of a near-tie
OUTLIER_SHARE = 0.01
OUTLIER_GAIN = 10.0
VOCAB = 4096
#: The fp8 cache formats measured: a latent layout, ``+int8`` for int8 pooled keys with a
#: scale per 32 columns (else e4m3, a scale a key), ``+hadamard`` for rotated indexer keys.
FORMATS = tuple(f"{layout}{keys}{rot}" for keys in ("", "+int8") for rot in ("", "+hadamard")
                for layout in LATENT_LAYOUTS)
#: The fp8 caches' default (``init_cache``): group scales, e4m3 keys not rotated.
DEFAULT_FORMAT = "group"
#: The format that keeps the indexer's recall >= 0.99 at 32K (``glm5_dsa_jax.cache.fp8``).
ACCURATE_FORMAT = "group+int8+hadamard"


def format_options(fmt: str) -> dict:
    """``init_cache`` keywords of a format of ``FORMATS`` (``ValueError`` naming it otherwise)."""
    if fmt not in FORMATS:
        raise ValueError(f"fp8 cache format must be one of {FORMATS}, got {fmt!r}")
    layout, *parts = fmt.split("+")
    return dict(latent_layout=layout, rotate_index="hadamard" in parts,
                index_keys="int8" if "int8" in parts else "e4m3")


def trained_like_weights(cfg, layer_idx: int, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights of layer ``layer_idx`` drawn as the module doc says."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_weight_shapes(cfg, layer_idx).items():
        if name.endswith("bias"):
            w = np.zeros(shape)
        elif len(shape) == 1:  # a norm gain
            w = rng.lognormal(0.0, 0.3, shape)
            w[rng.random(shape) < OUTLIER_SHARE] *= OUTLIER_GAIN
        elif "ape" in name:
            w = rng.normal(0.0, 0.02, shape)
        else:
            w = rng.normal(0.0, shape[-1] ** -0.5, shape)
        out[name] = w.astype(np.float32)
    return out


def prompt_states(cfg, length: int, seed: int = 0) -> np.ndarray:
    """``[1, length, hidden]`` float32 hidden states of unit RMS (see the module doc)."""
    rng = np.random.default_rng(seed + 1)
    d = cfg.hidden_size
    vocab = rng.standard_normal((VOCAB, d)).astype(np.float32)
    ranks = np.arange(1, VOCAB + 1)
    p = 1.0 / ranks
    tokens = rng.choice(VOCAB, size=length, p=p / p.sum())
    drift = np.cumsum(rng.standard_normal((length, d)).astype(np.float32) * 0.02, axis=0)
    x = vocab[tokens] + drift
    x /= np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
    return x[None]


def _fill_chunk(graphdef, state, cache: DsaCache, x):
    layer = nnx.merge(graphdef, state)
    b, s, _ = x.shape
    mask = jnp.ones((b, s), bool)
    cache, chunk = cache.begin_chunk(mask)
    rope = layer.rope(chunk.positions)
    q_resid, _, latent = layer.project(x, rope)  # the queries are dead code: XLA drops them
    cache = cache.write_latent(latent, chunk)
    if layer.indexer is not None:
        _, _, ki, gate = layer.indexer.project(x, q_resid, rope)
        cache = layer.compress_pools(cache, ki, gate, chunk)
        cache = cache.replace(n_valid=cache.n_valid + s)
    return cache.replace(length=cache.length + s)


_fill_chunk_jit = jax.jit(_fill_chunk, static_argnums=0, donate_argnums=2)


def fill(layer: DsaAttention, cache: DsaCache, x, chunk: int = 2048) -> DsaCache:
    """``cache`` with the rows of every token of ``x [B, S, hidden]`` written (steps 0-1 of
    the layer, chunk by chunk, no padding), as a call would write them, without attending."""
    graphdef, state = nnx.split(layer)
    for start in range(0, x.shape[1], chunk):
        cache = _fill_chunk_jit(graphdef, state, cache, jnp.asarray(x[:, start:start + chunk], layer.dtype))
    return cache


@dataclasses.dataclass(frozen=True)
class Fp8Accuracy:
    """One context's figures (see the module doc)."""

    context: int
    queries: int
    format: str
    x_scale: float
    recall: float
    rel_l2: float
    rel_l2_same_selection: float
    select_k: int
    changed: int
    ties: int
    near_ties: int
    gap_median: float
    gap_max: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _scores(layer, cache, x, queries):
    """The bf16-cache indexer scores ``[Q, P]`` of the last ``queries`` tokens of ``x``."""
    s = queries
    length = cache.length
    pos = length + jnp.arange(s, dtype=jnp.int32)[None]
    rope = layer.rope(pos)
    q_resid, _, _ = layer.project(x, rope)
    qi, w, _, _ = layer.indexer.project(x, q_resid, rope)
    qi = index_queries(qi, cache.rotate_index, cache.index_format)  # the layer's own step
    # The queries' own pools complete within the chunk: score the cache's pools only
    # (those written by ``fill``), as a decode step at ``length`` sees them.
    return layer.score_pools(qi, w, cache, pos)[0]


def measure(cfg, context: int, *, queries: int = 16, seed: int = 0, layer_idx: int | None = None,
            implementation: str = "xla", dtype: str = "fp8", fmt: str = DEFAULT_FORMAT,
            x_scale: float = 1.0) -> Fp8Accuracy:
    """The figures of the module doc at ``context`` tokens (``context - queries`` filled):
    a ``dtype`` cache (fp8 by default, of format ``fmt``) against a bf16 one."""
    return measure_formats(cfg, context, (fmt,), queries=queries, seed=seed, layer_idx=layer_idx,
                           implementation=implementation, dtype=dtype, x_scale=x_scale)[0]


def measure_formats(cfg, context: int, formats=FORMATS, *, queries: int = 16, seed: int = 0,
                    layer_idx: int | None = None, implementation: str = "xla", dtype: str = "fp8",
                    x_scale: float = 1.0) -> list[Fp8Accuracy]:
    """``measure`` of each format of ``formats`` (``FORMATS``) on the same layer, prompt (its
    hidden states times ``x_scale``) and bf16 reference, which run once."""
    opts = [format_options(f) for f in formats]
    layer_idx = next(i for i in cfg.dsa_layers if cfg.has_indexer(i)) if layer_idx is None else layer_idx
    layer = DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(seed), implementation=implementation,
                         dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    layer.load_hf_weights(trained_like_weights(cfg, layer_idx, seed))
    x = prompt_states(cfg, context, seed) * np.float32(x_scale)
    prefix, tail = x[:, : context - queries], jnp.asarray(x[:, context - queries:], jnp.bfloat16)

    def run(dt, **kw):
        cache = fill(layer, layer.init_cache(1, context, dtype=dt, **kw), prefix)
        out, topk, after = layer(tail, cache=cache)
        return np.asarray(out, np.float32)[0], topk, cache, after

    ref = run("bfloat16")
    return [_figures(layer, cfg, tail, queries, ref, run(dtype, **kw), fmt, x_scale)
            for fmt, kw in zip(formats, opts)]


def _figures(layer, cfg, tail, queries, ref, test, fmt, x_scale) -> Fp8Accuracy:
    """``Fp8Accuracy`` of one ``test`` run against the bf16 ``ref`` (``(out, topk, cache
    before, cache after)`` each)."""
    (o16, t16, c16, _), (o8, t8, c8, a8) = ref, test
    context = int(c16.max_length)
    pos = c8.length + jnp.arange(queries, dtype=jnp.int32)[None]
    _, q_lat, _ = layer.project(tail, layer.rope(pos))
    o_same = layer.output_projection(layer.sparse_attention(q_lat, a8.latent, t16, a8.latent_scale))
    o_same = np.asarray(o_same, np.float32)[0]
    t16, t8 = np.asarray(t16)[0], np.asarray(t8)[0]
    recall = np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, len(a[a >= 0])) for a, b in zip(t16, t8)])
    rel_l2 = float(np.linalg.norm(o8 - o16) / np.linalg.norm(o16))
    rel_same = float(np.linalg.norm(o_same - o16) / np.linalg.norm(o16))
    s16, s8 = np.asarray(_scores(layer, c16, tail, queries)), np.asarray(_scores(layer, c8, tail, queries))
    k = cfg.select_k(c16.max_pools)
    changed = ties = near = 0
    gaps = []
    for a, b in zip(s16, s8):
        live = np.isfinite(a)
        kk = min(k, int(live.sum()))
        if kk == 0:
            continue
        top16 = set(np.argsort(-a, kind="stable")[:kk])
        top8 = set(np.argsort(-b, kind="stable")[:kk])
        cut = np.sort(a[live])[::-1][kk - 1]
        spread = max(float(np.std(a[live])), 1e-30)
        for p in top16 ^ top8:
            gap = abs(a[p] - cut) / spread
            gaps.append(gap)
            changed += 1
            ties += a[p] == cut
            near += gap <= NEAR_TIE
    gaps = np.asarray(gaps) if gaps else np.zeros(1)
    return Fp8Accuracy(context, queries, fmt, float(x_scale), float(recall), rel_l2, rel_same, k, changed,
                       int(ties), int(near), float(np.median(gaps)), float(gaps.max()))
