"""``glm5-dsa demo``: the demo's flags and what it prints.

The work is ``glm5_dsa_jax.tools.demo`` (layers, batch, the sparse-vs-dense comparison, timed
decode); this module runs it in order and prints as it goes, so a user sees the prefill
before the decode steps start. A config or checkpoint the demo cannot run (no full-indexer
layer, a missing directory, a prompt plus steps beyond ``max_position_embeddings``) is a
one-line error with exit status 2, never a traceback.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from tqdm import tqdm

import pallas_kernels as pk
from glm5_dsa_jax.cli.args import UsageError, nonnegative_int
from glm5_dsa_jax.model.config import PRESETS, DsaConfig
from glm5_dsa_jax.decode import DsaDecoder
from glm5_dsa_jax.tools import demo


def add_parser(sub) -> None:
    """``glm5-dsa demo``: a batch of three left-padded prompts through a full DSA layer (and
    the shared layer after it), prefill then decode, printing which tokens each sequence's
    last query reads (of how many visible), how far sparse attention is from dense, and the
    decode speed. The default prompt is twice the index_topk tokens a query reads (tiny: 48
    tokens, seconds; the real presets: 4,096 tokens, minutes on a CPU), so the selection is
    sparse."""
    p = sub.add_parser("demo", help="run a padded batch through a DSA layer, prefill then decode",
                       description=add_parser.__doc__)
    p.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="a model preset, random weights (glm53-flash, glm5, glm52, deepseek-v32 at "
                        "their published dims; tiny)")
    p.add_argument("--checkpoint", help="an HF checkpoint dir or an orbax dir from `glm5-dsa convert`, "
                                        "instead of --preset (default: none)")
    p.add_argument("--prompt", type=nonnegative_int, default=0,
                   help="prompt length in tokens (default, or 0: 2 x index_topk, at least "
                        f"{demo.MIN_PROMPT}: the last queries read about half of what they see)")
    p.add_argument("--steps", type=nonnegative_int, default=16, help="decode steps (0: prefill only)")
    p.add_argument("--implementation", default="xla", choices=list(pk.IMPLEMENTATIONS),
                   help="the kernels' implementation")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the weights and the prompts")
    p.set_defaults(func=main, prog=p.prog)


def _progress(steps: int):
    """The decode steps under a tqdm bar."""
    return tqdm(range(steps), desc="decode", unit="step", leave=False)


def _check_positions(cfg, prompt: int, steps: int) -> None:
    if prompt + steps > cfg.max_position_embeddings:
        raise UsageError(f"--prompt {prompt} + --steps {steps} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")


def main(args) -> int:
    t_start = time.perf_counter()
    if not args.checkpoint:  # the preset's positions, before building its layers
        pcfg = DsaConfig.preset(args.preset)
        _check_positions(pcfg, args.prompt or demo.default_prompt(pcfg), args.steps)
    try:
        cfg, full, shared = demo.build_layers(args.preset, args.checkpoint, args.implementation, args.seed)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        raise UsageError(str(e)) from None
    prompt = args.prompt or demo.default_prompt(cfg)
    _check_positions(cfg, prompt, args.steps)
    rng = np.random.default_rng(args.seed)
    lengths, x, mask = demo.left_padded_batch(cfg, prompt, rng, full.dtype)
    b = len(lengths)
    print(f"glm5-dsa demo: layer {full.layer_idx} (full indexer)"
          + (f" + layer {shared.layer_idx} (shared)" if shared else "")
          + f", implementation={full.implementation}, dtype={full.dtype.name}")
    print(f"  hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}, latent {cfg.kv_lora_rank}, "
          f"indexer {cfg.index_n_heads}x{cfg.index_head_dim}, index_topk {cfg.index_topk}, "
          f"kpool {cfg.index_kpool}, tail {cfg.index_kpool_always_select_tail}, out_width {cfg.out_width}")
    print(f"  a query reads at most {cfg.index_topk:,} tokens (index_topk: "
          f"{cfg.max_select_k:,} pools of {cfg.index_kpool})"
          f"{f' + {cfg.tail_width} of its own pool (the tail)' if cfg.tail_width else ''}, "
          "whatever the context")
    print(f"  batch of {b} prompts, lengths {lengths} (left padded to {prompt}), then {args.steps} decode steps",
          flush=True)
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
        print(f"  seq {i} (first_key {first_key[i]}, read {n:,} of {lengths[i]:,} visible tokens, "
              f"{n / lengths[i]:.0%}): {demo.describe_row(row, cfg.index_kpool, int(first_key[i]))}")

    cmp = demo.sparse_vs_dense(full, dec.cache.latent[:, :prompt], x, mask, topk)
    print(f"\nsparse vs dense attention (latent outputs, the prompt's last {cmp['queries']} queries, valid ones):")
    print(f"  sparse kernel vs dense masked attention on the same tokens: max |diff| = {cmp['max_diff']:.2e}")
    print(f"  sparse vs dense causal attention over every visible token: relative L2 = {cmp['rel_l2']:.3f} "
          f"(the queries read {cmp['read_frac']:.0%} of their visible tokens on average)")

    steps = args.steps
    t, after_first = demo.decode_steps(dec, dec2, _progress(steps), rng)
    if steps > 1:
        print(f"\ndecode: {steps} steps, {b * (steps - 1) / after_first:.1f} tokens/s after the first "
              f"(compiling) step, {1e3 * after_first / (steps - 1):.1f} ms per step, batch {b}, "
              f"compilations {dec.step.traces}")
    if steps == 0:
        print("\ndecode: 0 steps (prefill only)")
        print(f"\ndone in {time.perf_counter() - t_start:.1f} s")
        return 0
    row = np.asarray(t)[0, -1]
    print(f"last decode step, seq 0 at slot {dec.length - 1} (read {int((row >= 0).sum()):,} of "
          f"{lengths[0] + steps:,} tokens): "
          f"{demo.describe_row(row, cfg.index_kpool, int(first_key[0]))}")
    print(f"\ndone in {time.perf_counter() - t_start:.1f} s")
    return 0
