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
the timed steps). Prints each row's median and best step time and, per cache kind and
batch, the ratio of the medians last capacity / first.

The capacities' steps are timed in turn (one step on each cache, then the next round),
not one capacity after the other: on a shared machine the load moves within a minute, and
timing them in turn lets a change of load hit every capacity alike instead of one row.
"""

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.tools import bench
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
            caches = [fill(layer, b, CONTEXT, cap) for cap in args.capacities]
            times = [[] for _ in caches]
            for i in range(args.iters + 1):  # the first round is the warm-up (compilation)
                for j in range(len(caches)):
                    t0 = time.perf_counter()
                    res = step(params, x, mask, caches[j])
                    jax.block_until_ready(res)
                    caches[j] = res[-1]
                    if i:
                        times[j].append((time.perf_counter() - t0) * 1e3)
            del caches, res
            med = [statistics.median(t) for t in times]
            for cap, m, t in zip(args.capacities, med, times):
                print(f"{args.which} {kind} B={b} capacity={cap}: median {m:.2f} ms, best {min(t):.2f} ms",
                      flush=True)
            print(f"{args.which} {kind} B={b} ratio {args.capacities[-1]}/{args.capacities[0]}: "
                  f"{med[-1] / med[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
