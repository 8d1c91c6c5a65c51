"""``glm5-dsa plan``: print the tensor-parallel shard plan of one DSA layer.

The plan itself (which tensors split by head, the bytes each rank holds, the indexer
all-reduce that replicating the indexer avoids, and why) is ``TpPlan``; this module builds
it for every rank from a preset or a ``config.json`` and prints rank ``--rank``'s tensor
table and the per-rank totals, or one JSON object. A TP size that does not divide the heads
or a bad config is a one-line error with exit status 2.
"""

from __future__ import annotations

import json
import sys

from glm5_dsa_jax.cli.args import nonnegative_int, positive_int
from glm5_dsa_jax.config import PRESETS, DsaConfig
from glm5_dsa_jax.plan import BF16_BYTES, SCORE_BYTES, TpPlan, fmt_bytes


def add_parser(subparsers) -> None:
    """``glm5-dsa plan``: print the TP plan table and per-rank totals."""
    p = subparsers.add_parser(
        "plan", help="print the tensor-parallel shard plan of one DSA layer",
        description=add_parser.__doc__,
    )
    p.add_argument("--tp", type=positive_int, default=8, help="TP size (default 8)")
    p.add_argument("--rank", type=nonnegative_int, default=0, help="rank whose tensor table is shown (default 0)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, default="glm53-flash")
    src.add_argument("--config", help="a glm5_next, glm_moe_dsa or deepseek_v32 config.json (or its directory)")
    p.add_argument("--elem-bytes", type=positive_int, default=BF16_BYTES, help="bytes per element (bf16: 2)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="context for the indexer all-reduce figure (default max_position_embeddings)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=main)


def main(args) -> int:
    try:
        cfg = DsaConfig.from_hf_config(args.config) if args.config else DsaConfig.preset(args.preset)
        plans = TpPlan.all_ranks(cfg, args.tp, elem_bytes=args.elem_bytes)
        plan = TpPlan.build(cfg, args.rank, args.tp, elem_bytes=args.elem_bytes)
    except (ValueError, FileNotFoundError) as e:
        print(f"glm5-dsa plan: error: {e}", file=sys.stderr)
        return 2
    context = args.context or cfg.max_position_embeddings
    if args.json:
        d = plan.to_dict()
        d["per_rank_local_bytes"] = [p.local_bytes for p in plans]
        d["indexer_allreduce_bytes_per_token"] = plan.indexer_allreduce_bytes(context)
        d["context"] = context
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
    return 0
