"""``glm5-dsa plan``: print the tensor-parallel shard plan of one DSA layer and the
per-device memory of the model's DSA attention on a ``--dp`` x ``--tp`` mesh.

The plan itself (which tensors split by head, the bytes each rank holds, the indexer
all-reduce that replicating the indexer avoids, and why) is ``TpPlan``; the per-device
weights and caches (bf16 and fp8, contiguous and paged) and the sequences that fit are
``MemoryPlan``. This module builds both from a preset or a ``config.json`` and prints rank
``--rank``'s tensor table, the per-rank totals and the memory table, or one JSON object. A
TP size that does not divide the heads, a batch not divisible by ``--dp`` or a bad config
is a one-line error with exit status 2.
"""

from __future__ import annotations

import json
import sys

from glm5_dsa_jax.cli.args import check_context, nonnegative_int, positive_float, positive_int
from glm5_dsa_jax.model.config import PRESETS, DsaConfig
from glm5_dsa_jax.tools.memory_plan import MemoryPlan
from glm5_dsa_jax.parallel.plan import BF16_BYTES, SCORE_BYTES, TpPlan, fmt_bytes

#: Cache dtypes the memory table compares.
PLAN_CACHE_DTYPES = ("bfloat16", "fp8")


def add_parser(subparsers) -> None:
    """``glm5-dsa plan``: print one DSA layer's tensor-parallel shard plan (rank --rank's
    tensors, the per-rank totals) and the per-device memory of the model's DSA attention
    (weights, bf16 and fp8 caches, contiguous and paged, the sequences that fit) on a
    --dp x --tp mesh. A plan: no devices are needed."""
    p = subparsers.add_parser(
        "plan", help="print the tensor-parallel shard plan of one DSA layer",
        description=add_parser.__doc__,
    )
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size: heads split over it")
    p.add_argument("--dp", type=positive_int, default=1,
                   help="data-parallel size: the batch and the caches split by sequence")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="sequences on the whole mesh for the cache figures (default: 8 x --dp)")
    p.add_argument("--memory-gib", type=positive_float, default=80.0,
                   help="device memory given to attention weights and caches, GiB")
    p.add_argument("--rank", type=nonnegative_int, default=0, help="rank whose tensor table is shown")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, default="glm53-flash", help="the model's shapes")
    src.add_argument("--config", help="a glm5_next, glm_moe_dsa or deepseek_v32 config.json (or its directory) instead of --preset (default: none)")
    p.add_argument("--elem-bytes", type=positive_int, default=BF16_BYTES, help="bytes per element (bf16: 2)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="context for the cache figures and the indexer all-reduce figure, at most "
                        "the model's max_position_embeddings (default: max_position_embeddings)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=main, prog=p.prog)


def main(args) -> int:
    try:
        cfg = DsaConfig.from_hf_config(args.config) if args.config else DsaConfig.preset(args.preset)
        plans = TpPlan.all_ranks(cfg, args.tp, elem_bytes=args.elem_bytes)
        plan = TpPlan.build(cfg, args.rank, args.tp, elem_bytes=args.elem_bytes)
        context = args.context or cfg.max_position_embeddings
        check_context(context, cfg)
        batch = args.batch or 8 * args.dp
        mem = MemoryPlan(cfg, tp=args.tp, dp=args.dp, batch=batch, context=context,
                         elem_bytes=args.elem_bytes)
        memory = int(args.memory_gib * 2**30)
        rows = mem.rows(memory, PLAN_CACHE_DTYPES)
    except (ValueError, FileNotFoundError) as e:
        print(f"glm5-dsa plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        d = plan.to_dict()
        d["per_rank_local_bytes"] = [p.local_bytes for p in plans]
        d["indexer_allreduce_bytes_per_token"] = plan.indexer_allreduce_bytes(context)
        d["context"] = context
        d["memory"] = dict(dp=args.dp, tp=args.tp, batch=batch, context=context,
                           dsa_layers=len(mem.layers), device_memory_bytes=memory,
                           weight_bytes_per_device=mem.weight_bytes, caches=rows)
        print(json.dumps(d, indent=2))
        return 0
    print(plan.table())
    print()
    print("per-rank totals:")
    for p in plans:
        print(f"  rank {p.tp_rank}: {fmt_bytes(p.local_bytes):>10}  ({p.local_bytes:,} B, "
              f"{p.local_heads} heads)")
    print(f"  all ranks: {fmt_bytes(sum(p.local_bytes for p in plans))} "
          f"(full layer {fmt_bytes(plan.full_bytes)}; its {fmt_bytes(plan.replicated_bytes)} "
          f"replicated part is held by each of the {args.tp} ranks)")
    print(
        f"indexer all-reduce avoided: {fmt_bytes(plan.indexer_allreduce_bytes(context))} per "
        f"decode token per layer at {context:,} tokens "
        f"({context // cfg.index_kpool:,} pools x {SCORE_BYTES} B)"
    )
    print()
    print(f"memory per device, {len(mem.layers)} DSA layers, mesh data={args.dp} x tp={args.tp}, "
          f"{batch} sequences of {context:,} tokens ({batch // args.dp} per data group):")
    print(f"  attention weights: {fmt_bytes(mem.weight_bytes)} (split over tp, replicated over data)")
    print(f"  {'cache':<11}{'dtype':<10}{'B/token':>9}{'cache/device':>14}  "
          f"sequences that fit in {args.memory_gib:g} GiB/device")
    for r in rows:
        print(f"  {r['cache']:<11}{r['dtype']:<10}{r['bytes_per_token']:>9.1f}"
              f"{fmt_bytes(r['cache_bytes_per_device']):>14}  {r['sequences_that_fit']:,}")
    print("  (caches split over data by sequence, replicated over tp; attention only: no MoE, "
          "embeddings or activations)")
    return 0
