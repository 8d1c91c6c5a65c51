"""The pieces of ``glm5-dsa demo``: a padded batch through a full DSA layer and the shared
layer after it, prefill then decode, with what a user wants to see: which tokens each query
attends to, how far sparse attention is from dense attention, and decode speed.

``glm5_dsa_jax.cli.demo`` parses the flags, calls these in order and prints; with no flags
it runs the tiny preset with random weights on the CPU in seconds (``--preset glm53-flash``:
the real layer shape, ``--checkpoint DIR``: real weights). One ``numpy`` generator, seeded
by ``--seed``, draws the prompts and then every decode step's input, so a run is
reproducible; the layers' random weights use ``nnx.Rngs(seed + layer_idx)``. The default
prompt (``default_prompt``) is longer than what a query can select, so every preset's demo
shows sparsity: the last queries read ``index_topk`` tokens of about twice as many.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from glm5_dsa_jax.checkpoint import load_for_demo
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.decode import DsaDecoder
from glm5_dsa_jax.model.layer import DsaAttention

__all__ = ["describe_row", "build_layers", "left_padded_batch", "default_prompt", "sparse_vs_dense",
           "decode_steps", "MIN_PROMPT", "COMPARED_QUERIES"]

#: The shortest default prompt (``default_prompt``): room for the batch's 7 and 19 tokens
#: of left padding beside a tiny preset's ``2 * index_topk`` = 32.
MIN_PROMPT = 48
#: The prompt's last queries ``sparse_vs_dense`` compares.
COMPARED_QUERIES = 64


def describe_row(ids: np.ndarray, kpool: int, first_key: int) -> str:
    """A top-k row as runs of token slots, e.g. ``0-3 8-15 40-41``."""
    ids = ids[ids >= 0]
    if ids.size == 0:
        return "(nothing)"
    runs, start, prev = [], ids[0], ids[0]
    for i in ids[1:]:
        if i != prev + 1:
            runs.append((start, prev))
            start = i
        prev = i
    runs.append((start, prev))
    return " ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def build_layers(preset: str = "tiny", checkpoint: str | None = None, implementation: str = "xla",
                 seed: int = 0):
    """(cfg, full layer, shared layer or None) from a preset (random weights, seeded) or a
    checkpoint; ``ValueError`` when there is no full-indexer layer to run."""
    if checkpoint:
        cfg, layers = load_for_demo(checkpoint, implementation=implementation)
    else:
        cfg = DsaConfig.preset(preset)
        dtype = jnp.float32 if preset == "tiny" else jnp.bfloat16
        layers = {
            i: DsaAttention(cfg, i, rngs=nnx.Rngs(seed + i), implementation=implementation,
                            dtype=dtype, param_dtype=dtype)
            for i in cfg.dsa_layers[:2]
        }
    fulls = [i for i in sorted(layers) if cfg.has_indexer(i)]
    if not fulls:
        where = f"checkpoint {checkpoint!r}" if checkpoint else "this config"
        raise ValueError(
            f"{where} holds no full-indexer DSA layer (only shared layers {sorted(layers)}): the "
            "demo needs a 'full' layer, whose top-k a shared layer reuses"
        )
    full_idx = fulls[0]
    nxt = [i for i in cfg.dsa_layers if i > full_idx]
    shared = layers.get(nxt[0]) if nxt and not cfg.has_indexer(nxt[0]) else None
    return cfg, layers[full_idx], shared


def left_padded_batch(cfg: DsaConfig, prompt: int, rng: np.random.Generator, dtype):
    """Three prompts of lengths ``prompt``, ``prompt - 7`` and ``prompt - 19`` (at least 1),
    left padded to ``prompt``: ``(lengths, x [3, prompt, hidden], mask [3, prompt])``."""
    lengths = [prompt, max(1, prompt - 7), max(1, prompt - 19)]
    x = jnp.asarray(rng.standard_normal((len(lengths), prompt, cfg.hidden_size)), dtype)
    mask = np.zeros((len(lengths), prompt), bool)
    for i, n in enumerate(lengths):
        mask[i, prompt - n:] = True  # left padding
    return lengths, x, jnp.asarray(mask)


def default_prompt(cfg: DsaConfig) -> int:
    """The demo's prompt length when ``--prompt`` is not given: twice the ``index_topk``
    tokens a query reads (at least ``MIN_PROMPT``), so the last queries read about half of
    the tokens they see and the selection is sparse (a prompt of at most ``index_topk``
    tokens selects every one: dense attention by another name)."""
    return max(2 * cfg.index_topk, MIN_PROMPT)


def sparse_vs_dense(layer: DsaAttention, latent: jax.Array, x: jax.Array, mask: jax.Array,
                    topk: jax.Array, queries: int = COMPARED_QUERIES) -> dict[str, float]:
    """The prompt's last ``queries`` queries attended three ways, compared on the valid ones
    (those that select a token): ``max_diff``, the sparse kernel against dense masked
    attention over the same tokens (the kernel's own error); ``rel_l2``, sparse against
    dense causal attention over every visible token (what the selection leaves out);
    ``read_frac``, the share of its visible tokens a query reads on average. ``latent``: the
    cache's rows of the prompt. Only the last queries, because dense attention's scores
    grow with the prompt squared (a real preset's sparse prompt is thousands of tokens)."""
    cfg = layer.cfg
    prompt = x.shape[1]
    n = min(queries, prompt)
    slots = jnp.broadcast_to(jnp.arange(prompt - n, prompt, dtype=jnp.int32)[None], (x.shape[0], n))
    _, q_lat, _ = layer.project(x[:, -n:], layer.rope(slots))  # RoPE at the cache's slots, as the call
    token_ids = jnp.asarray(topk)[:, -n:]
    kw = dict(scale=cfg.softmax_scale, value_width=cfg.kv_lora_rank)
    sparse = pk.sparse_mla(q_lat, latent, token_ids, implementation=layer.implementation, **kw)
    same = pk.mla_masked_attention(q_lat, latent, pk.topk_to_mask(token_ids, prompt), **kw)
    causal = mask[:, None, :] & (slots[:, :, None] >= jnp.arange(prompt)[None, None, :])
    dense = pk.mla_masked_attention(q_lat, latent, causal, **kw)
    live = np.asarray(mask[:, -n:] & (token_ids >= 0).any(-1))
    sp, sm, de = (np.asarray(a, np.float32)[live] for a in (sparse, same, dense))
    rel = np.linalg.norm(sp - de) / max(np.linalg.norm(de), 1e-30)
    frac = float((np.asarray(token_ids) >= 0).sum(-1)[live].mean()) / max(
        float(np.asarray(causal).sum(-1)[live].mean()), 1)
    return {"max_diff": float(np.abs(sp - sm).max()), "rel_l2": float(rel), "read_frac": frac,
            "queries": n}


def decode_steps(dec: DsaDecoder, shared: DsaDecoder | None, steps, rng: np.random.Generator):
    """Decode one token per sequence per item of ``steps`` (an iterable: a range, or a
    progress bar over one), random next hidden states standing in for the rest of the
    model; the shared layer, if any, reuses the full layer's top-k. Returns the last
    step's top-k and the seconds after the first (compiling) step, or ``(None, None)``
    for no step."""
    b = dec.cache.batch_size
    step_mask = jnp.ones((b, 1), bool)
    t, t_first = None, None
    for _ in steps:
        h = jnp.asarray(rng.standard_normal((b, 1, dec.layer.cfg.hidden_size)), dec.layer.dtype)
        o, t = dec(h, step_mask)
        if shared:
            o, _ = shared(o, step_mask, prev_topk=t)
        jax.block_until_ready(o)
        if t_first is None:
            t_first = time.perf_counter()
    return t, None if t_first is None else time.perf_counter() - t_first
