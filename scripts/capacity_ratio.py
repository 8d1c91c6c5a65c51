#!/usr/bin/env python
"""Decode-step time at 4,096 live tokens per sequence: capacity 131,072 against 4,224.

Issue 10's check that a step's work follows its live tokens, not the cache's capacity:
the project's own ``make_step`` over ``bench.filled_cache`` (``implementation="xla"``),
one run, median of ``ITERS`` steps, on one DSA layer with the GLM-5.3-Flash cache geometry
(kv_lora 512, indexer 32 x 128, kpool 4, topk 2048)::

    python scripts/capacity_ratio.py small   # hidden 256, 8 heads: the cache dominates
    python scripts/capacity_ratio.py real    # the real GLM-5.3-Flash dims
    python scripts/capacity_ratio.py real 1,8 4224,131072 5   # batches, capacities, iters

Prints each row's median step time and, per batch, the ratio last capacity / first.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax import bench
from glm5_dsa_jax.decode import make_step

CONTEXT = 4096


def main(argv):
    which = argv[0] if argv else "small"
    batches = [int(b) for b in (argv[1] if len(argv) > 1 else "1,8").split(",")]
    caps = [int(c) for c in (argv[2] if len(argv) > 2 else "4224,131072").split(",")]
    iters = int(argv[3]) if len(argv) > 3 else 5
    cfg = gd.DsaConfig.glm53_flash()
    if which == "small":
        cfg = dataclasses.replace(cfg, hidden_size=256, num_attention_heads=8)
    layer_idx = next(i for i in cfg.dsa_layers if cfg.has_indexer(i))
    layer = gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0))
    step, params = make_step(layer)
    for b in batches:
        x = jax.random.normal(jax.random.key(1), (b, 1, cfg.hidden_size), jnp.float32).astype(layer.dtype)
        mask = jnp.ones((b, 1), bool)
        times = []
        for cap in caps:
            cache = bench.filled_cache(layer, b, CONTEXT, cap)
            times.append(bench._time_steps(lambda p, x, m, c: step(p, x, m, c), (params, x, mask), cache, iters))
            print(f"{which} B={b} capacity={cap}: {times[-1]:.2f} ms", flush=True)
        print(f"{which} B={b} ratio {caps[-1]}/{caps[0]}: {times[-1] / times[0]:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
