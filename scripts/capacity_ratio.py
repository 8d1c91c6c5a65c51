#!/usr/bin/env python
"""Decode-step time at 4,096 live tokens per sequence: capacity 131,072 against 4,224.

Issue 10's check that a step's work follows its live tokens, not the cache's capacity:
the project's own ``make_step`` over a cache already holding ``CONTEXT`` tokens per
sequence (``bench.filled_cache`` for the contiguous cache, ``bench.filled_paged_cache``
for the paged one: ``max_seqs = batch`` sequences, ``bench.PAGE_SIZE``-token pages,
``batch * capacity / PAGE_SIZE`` pages, each sequence's pages scattered over the pool),
``implementation="xla"``, one run, median of ``iters`` steps, on one DSA layer with the
GLM-5.3-Flash cache geometry (kv_lora 512, indexer 32 x 128, kpool 4, topk 2048)::

    python scripts/capacity_ratio.py small   # hidden 256, 8 heads: the cache dominates
    python scripts/capacity_ratio.py real    # the real GLM-5.3-Flash dims
    python scripts/capacity_ratio.py real 1,8 4224,131072 5 --cache both   # batches, capacities, iters

Capacities are tokens per sequence, the same for both cache kinds (a paged capacity must
be a whole number of pages; 4,224 is 66 pages: the smallest that holds 4,096 tokens plus
the timed steps). Prints each row's median step time and, per cache kind and batch, the
ratio last capacity / first.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax import bench
from glm5_dsa_jax.decode import make_step

CONTEXT = 4096


def _ints(text):
    return [int(v) for v in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", nargs="?", default="small", choices=["small", "real"])
    ap.add_argument("batches", nargs="?", type=_ints, default=[1, 8])
    ap.add_argument("capacities", nargs="?", type=_ints, default=[4224, 131072])
    ap.add_argument("iters", nargs="?", type=int, default=5)
    ap.add_argument("--cache", default="contiguous", choices=[*bench.CACHE_KINDS, "both"])
    args = ap.parse_args(argv)
    kinds = bench.CACHE_KINDS if args.cache == "both" else (args.cache,)
    for kind in kinds:
        for cap in args.capacities:
            bench.check_capacity(cap, [CONTEXT], args.iters, kind)
    cfg = gd.DsaConfig.glm53_flash()
    if args.which == "small":
        cfg = dataclasses.replace(cfg, hidden_size=256, num_attention_heads=8)
    layer_idx = next(i for i in cfg.dsa_layers if cfg.has_indexer(i))
    layer = gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0))
    step, params = make_step(layer)
    for kind in kinds:
        fill = bench.filled_paged_cache if kind == "paged" else bench.filled_cache
        for b in args.batches:
            x = jax.random.normal(jax.random.key(1), (b, 1, cfg.hidden_size), jnp.float32).astype(layer.dtype)
            mask = jnp.ones((b, 1), bool)
            times = []
            for cap in args.capacities:
                cache = fill(layer, b, CONTEXT, cap)
                times.append(bench._time_steps(lambda p, x, m, c: step(p, x, m, c), (params, x, mask),
                                               cache, args.iters))
                del cache
                print(f"{args.which} {kind} B={b} capacity={cap}: {times[-1]:.2f} ms", flush=True)
            print(f"{args.which} {kind} B={b} ratio {args.capacities[-1]}/{args.capacities[0]}: "
                  f"{times[-1] / times[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
