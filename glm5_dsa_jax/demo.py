"""``glm5-dsa demo``: a padded batch through a full DSA layer and the shared layer after it,
prefill then decode, with what a user wants to see: which tokens each query attends to,
how far sparse attention is from dense attention, and decode speed.

With no arguments it runs the tiny preset with random weights on the CPU in seconds;
``--preset glm53-flash`` uses the real layer shape, ``--checkpoint DIR`` real weights.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from glm5_dsa_jax.config import DsaConfig
from glm5_dsa_jax.decode import DsaDecoder
from glm5_dsa_jax.layer import DsaAttention

__all__ = ["add_parser", "main", "describe_row"]


def describe_row(ids: np.ndarray, kpool: int, first_key: int) -> str:
    """A top-k row as runs of token slots, e.g. ``0-3 8-15 | tail 40-41``."""
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


def build_layers(args):
    """(cfg, full layer, shared layer or None) from a preset or a checkpoint."""
    if args.checkpoint:
        from glm5_dsa_jax.checkpoint import load_for_demo

        cfg, layers = load_for_demo(args.checkpoint, implementation=args.implementation)
    else:
        cfg = DsaConfig.preset(args.preset)
        dtype = jnp.float32 if args.preset == "tiny" else jnp.bfloat16
        layers = {
            i: DsaAttention(cfg, i, rngs=nnx.Rngs(args.seed + i), implementation=args.implementation,
                            dtype=dtype, param_dtype=dtype)
            for i in cfg.dsa_layers[:2]
        }
    fulls = [i for i in sorted(layers) if cfg.has_indexer(i)]
    if not fulls:
        where = f"checkpoint {args.checkpoint!r}" if args.checkpoint else "this config"
        raise ValueError(
            f"{where} holds no full-indexer DSA layer (only shared layers {sorted(layers)}): the "
            "demo needs a 'full' layer, whose top-k a shared layer reuses"
        )
    full_idx = fulls[0]
    nxt = [i for i in cfg.dsa_layers if i > full_idx]
    shared = layers.get(nxt[0]) if nxt and not cfg.has_indexer(nxt[0]) else None
    return cfg, layers[full_idx], shared


def main(args) -> int:
    t_start = time.perf_counter()
    try:
        cfg, full, shared = build_layers(args)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        print(f"glm5-dsa demo: error: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt or (48 if cfg.hidden_size < 1024 else 256)
    if prompt + args.steps > cfg.max_position_embeddings:
        print(f"glm5-dsa demo: error: --prompt {prompt} + --steps {args.steps} exceeds the "
              f"model's max_position_embeddings {cfg.max_position_embeddings}", file=sys.stderr)
        return 2
    lengths = [prompt, max(1, prompt - 7), max(1, prompt - 19)]
    b = len(lengths)
    rng = np.random.default_rng(args.seed)
    x = jnp.asarray(rng.standard_normal((b, prompt, cfg.hidden_size)), full.dtype)
    mask = np.zeros((b, prompt), bool)
    for i, n in enumerate(lengths):
        mask[i, prompt - n:] = True  # left padding
    mask = jnp.asarray(mask)
    print(f"glm5-dsa demo: layer {full.layer_idx} (full indexer)"
          + (f" + layer {shared.layer_idx} (shared)" if shared else "")
          + f", implementation={full.implementation}, dtype={full.dtype.name}")
    print(f"  hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}, latent {cfg.kv_lora_rank}, "
          f"indexer {cfg.index_n_heads}x{cfg.index_head_dim}, index_topk {cfg.index_topk}, "
          f"kpool {cfg.index_kpool}, tail {cfg.index_kpool_always_select_tail}, out_width {cfg.out_width}")
    print(f"  batch of {b} prompts, lengths {lengths} (left padded to {prompt}), then {args.steps} decode steps")

    max_len = prompt + args.steps
    dec = DsaDecoder(full, b, max_len)
    dec2 = DsaDecoder(shared, b, max_len) if shared else None
    t0 = time.perf_counter()
    out, topk = dec(x, mask)
    if dec2:
        dec2(out, mask, prev_topk=topk)
    jax.block_until_ready(out)
    print(f"\nprefill: {time.perf_counter() - t0:.2f} s (compile included)")

    first_key = np.asarray(dec.cache.first_key)
    topk_np = np.asarray(topk)
    print("selected token slots of each sequence's last prompt query:")
    for i in range(b):
        row = topk_np[i, -1]
        n = int((row >= 0).sum())
        print(f"  seq {i} (first_key {first_key[i]}, {lengths[i]} tokens visible, {n} selected): "
              f"{describe_row(row, cfg.index_kpool, int(first_key[i]))}")

    # Sparse against dense, on the prompt's queries.
    _, q_lat, _ = full.project(x)
    latent = dec.cache.latent[:, :prompt]
    sel = jnp.asarray(topk)
    sparse = pk.sparse_mla(q_lat, latent, sel, scale=cfg.softmax_scale, implementation=full.implementation)
    same = pk.mla_masked_attention(q_lat, latent, pk.topk_to_mask(sel, prompt), scale=cfg.softmax_scale)
    causal = mask[:, None, :] & (jnp.arange(prompt)[None, :, None] >= jnp.arange(prompt)[None, None, :])
    dense = pk.mla_masked_attention(q_lat, latent, causal, scale=cfg.softmax_scale)
    live = np.asarray(mask & (sel >= 0).any(-1))
    sp, sm, de = (np.asarray(a, np.float32)[live] for a in (sparse, same, dense))
    rel = np.linalg.norm(sp - de) / max(np.linalg.norm(de), 1e-30)
    frac = float((np.asarray(sel) >= 0).sum(-1)[live].mean()) / max(
        float(np.asarray(causal).sum(-1)[live].mean()), 1)
    print("\nsparse vs dense attention (latent outputs, valid queries):")
    print(f"  sparse kernel vs dense masked attention on the same tokens: max |diff| = {np.abs(sp - sm).max():.2e}")
    print(f"  sparse vs dense causal attention over every visible token: relative L2 = {rel:.3f} "
          f"(the queries read {frac:.0%} of their visible tokens on average)")

    # Decode: random next hidden states stand in for the rest of the model.
    steps = args.steps
    it = range(steps)
    try:
        from tqdm import tqdm

        it = tqdm(it, desc="decode", unit="step", leave=False)
    except ImportError:
        pass
    step_mask = jnp.ones((b, 1), bool)
    t0, t_first = time.perf_counter(), None
    for _ in it:
        h = jnp.asarray(rng.standard_normal((b, 1, cfg.hidden_size)), full.dtype)
        o, t = dec(h, step_mask)
        if dec2:
            o, _ = dec2(o, step_mask, prev_topk=t)
        jax.block_until_ready(o)
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    if steps > 1:
        rate = b * (steps - 1) / (t_end - t_first)
        print(f"\ndecode: {steps} steps, {rate:.1f} tokens/s after the first (compiling) step, "
              f"{1e3 * (t_end - t_first) / (steps - 1):.1f} ms per step, batch {b}, "
              f"compilations {dec.step.traces}")
    if steps == 0:
        print("\ndecode: 0 steps (prefill only)")
        print(f"\ndone in {time.perf_counter() - t_start:.1f} s")
        return 0
    row = np.asarray(t)[0, -1]
    print(f"last decode step, seq 0 at slot {dec.length - 1}: {describe_row(row, cfg.index_kpool, int(first_key[0]))}")
    print(f"\ndone in {time.perf_counter() - t_start:.1f} s")
    return 0


def add_parser(sub) -> None:
    from glm5_dsa_jax.cli.args import nonnegative_int

    p = sub.add_parser("demo", help="run a padded batch through a DSA layer, prefill then decode")
    p.add_argument("--preset", default="tiny", choices=["tiny", "glm53-flash"])
    p.add_argument("--checkpoint", help="an HF checkpoint dir or an orbax dir from `glm5-dsa convert`")
    p.add_argument("--prompt", type=nonnegative_int, default=0,
                   help="prompt length (default, or 0: 48 tiny, 256 real)")
    p.add_argument("--steps", type=nonnegative_int, default=16, help="decode steps (0: prefill only)")
    p.add_argument("--implementation", default="xla", choices=list(pk.IMPLEMENTATIONS))
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.set_defaults(func=main)
