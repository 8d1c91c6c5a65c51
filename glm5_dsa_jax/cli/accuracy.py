"""``glm5-dsa accuracy``: how an fp8 cache changes the selection and output of a layer.

What each figure is, and how the weights and prompt were chosen, is
``glm5_dsa_jax.tools.cache_accuracy``; this module parses the flags, runs ``measure`` per context
and prints a table, or one JSON object with ``--json``.
"""

from __future__ import annotations

import json
import sys

from glm5_dsa_jax.tools.cache_accuracy import NEAR_TIE, measure
from glm5_dsa_jax.cli.args import nonnegative_int, positive_int, positive_int_list
from glm5_dsa_jax.config import PRESETS, DsaConfig


def add_parser(sub) -> None:
    """``glm5-dsa accuracy``: fp8 cache against bf16 cache (recall, output error, ties)."""
    p = sub.add_parser("accuracy", help="fp8 cache against bf16 cache: selection recall, output error",
                       description=add_parser.__doc__)
    p.add_argument("--contexts", type=positive_int_list, default=[4096, 32768])
    p.add_argument("--queries", type=positive_int, default=16, help="query tokens measured per context")
    p.add_argument("--preset", default="glm53-flash", choices=PRESETS)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main, prog=p.prog)


def main(args) -> int:
    cfg = DsaConfig.preset(args.preset)
    for c in args.contexts:
        if c <= args.queries or c > cfg.max_position_embeddings:
            print(f"glm5-dsa accuracy: error: --contexts: {c} must exceed --queries={args.queries} "
                  f"and be at most max_position_embeddings={cfg.max_position_embeddings}", file=sys.stderr)
            return 2
    rows = [measure(cfg, c, queries=args.queries, seed=args.seed).to_dict() for c in args.contexts]
    if args.json:
        print(json.dumps(dict(preset=args.preset, near_tie=NEAR_TIE, rows=rows)))
        return 0
    print(f"{args.preset}: fp8 cache against bf16 cache, {args.queries} queries after the context")
    print(f"{'context':>8} {'recall':>8} {'rel L2':>9} {'same sel':>9} {'changed':>8} {'ties':>5} "
          f"{'near':>5} {'gap med':>9} {'gap max':>9}")
    for r in rows:
        print(f"{r['context']:>8} {r['recall']:8.4f} {r['rel_l2']:9.2e} {r['rel_l2_same_selection']:9.2e} "
              f"{r['changed']:>8} {r['ties']:>5} {r['near_ties']:>5} {r['gap_median']:9.1e} {r['gap_max']:9.1e}")
    print("same sel: the output error over the bf16 selection (the fp8 rows' own error)")
    print(f"changed: pools in one selection and not the other (of select_k per query); ties: at the "
          f"bf16 cutoff score exactly; near: within {NEAR_TIE:g} score standard deviations of it")
    return 0
