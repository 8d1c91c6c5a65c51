"""``glm5-dsa accuracy``: how an fp8 cache changes the selection and output of a layer.

What each figure is, and how the weights and prompt were chosen, is
``glm5_dsa_jax.tools.cache_accuracy``; this module parses the flags, runs ``measure_formats`` per
context and hidden-state scale (``--scales``) over the fp8 cache formats (``--formats``) and
prints a table, one row each, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from glm5_dsa_jax.cli.args import (
    UsageError, check_context, nonnegative_int, positive_float, positive_int, positive_int_list,
)
from glm5_dsa_jax.model.config import PRESETS, DsaConfig
from glm5_dsa_jax.tools.cache_accuracy import ACCURATE_FORMAT, DEFAULT_FORMAT, FORMATS, NEAR_TIE, measure_formats


def _formats(s: str) -> list[str]:
    """argparse type: comma-separated fp8 cache formats of ``FORMATS``, at least one."""
    vals = [v.strip() for v in s.split(",") if v.strip()]
    bad = [v for v in vals if v not in FORMATS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"expected comma-separated formats of {', '.join(FORMATS)}, got {s!r}")
    return vals


def _scales(s: str) -> list[float]:
    """argparse type: comma-separated finite numbers > 0, at least one."""
    vals = [positive_float(v.strip()) for v in s.split(",") if v.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {s!r}")
    return vals


def add_parser(sub) -> None:
    """``glm5-dsa accuracy``: decode the same queries of one layer (trained-like weights, a
    Zipf-law prompt) from a bf16 cache and from an fp8 cache and print how the fp8 cache
    changes the selection (recall, changed pools, ties) and the output (relative L2), one row
    per context, hidden-state scale and fp8 cache format. About 20-60 s per context and
    format on a CPU at the real preset; a progress bar on stderr."""
    p = sub.add_parser("accuracy", help="fp8 cache against bf16 cache: selection recall, output error",
                       description=add_parser.__doc__)
    p.add_argument("--contexts", type=positive_int_list, default="4096,32768",
                   help="comma-separated prompt lengths in tokens, each above --queries and at most "
                        "the preset's max_position_embeddings")
    p.add_argument("--queries", type=positive_int, default=16, help="query tokens measured per context")
    p.add_argument("--preset", default="glm53-flash", choices=PRESETS, help="the layer's shapes")
    p.add_argument("--formats", type=_formats, default=f"row,{DEFAULT_FORMAT},{ACCURATE_FORMAT}",
                   help=f"comma-separated fp8 cache formats, of {', '.join(FORMATS)}: the latent layout "
                        "(one scale a row, or per 128 columns with k_rot apart), '+int8' for int8 pooled "
                        "keys with a scale per 32 columns (else e4m3, a scale a key), '+hadamard' for "
                        f"rotated indexer keys (default: before, the caches' default {DEFAULT_FORMAT}, "
                        f"and {ACCURATE_FORMAT})")
    p.add_argument("--scales", type=_scales, default="1",
                   help="comma-separated factors on the prompt's hidden states (e.g. 1,1e4,1e6)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the weights and the prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main, prog=p.prog)


def main(args) -> int:
    cfg = DsaConfig.preset(args.preset)
    for c in args.contexts:
        if c <= args.queries:
            raise UsageError(f"--contexts {c} must exceed --queries {args.queries} (the queries are "
                             "the prompt's last tokens)")
        check_context(c, cfg, flag="--contexts")
    runs = [(c, x) for c in args.contexts for x in args.scales]
    bar = tqdm(runs, desc=f"accuracy ({args.preset})", unit="run", file=sys.stderr, disable=args.no_progress)
    rows = []
    for c, x in bar:
        bar.set_postfix(context=c, x=x)
        rows += [r.to_dict() for r in measure_formats(cfg, c, args.formats, queries=args.queries, seed=args.seed,
                                                      x_scale=x)]
    bar.close()
    if args.json:
        print(json.dumps(dict(preset=args.preset, near_tie=NEAR_TIE, rows=rows)))
        return 0
    print(f"{args.preset}: fp8 cache against bf16 cache, {args.queries} queries after the context")
    print(f"{'context':>8} {'format':>20} {'x':>6} {'recall':>8} {'rel L2':>9} {'same sel':>9} {'changed':>8} "
          f"{'ties':>5} {'near':>5} {'gap med':>9} {'gap max':>9}")
    for r in rows:
        print(f"{r['context']:>8} {r['format']:>20} {r['x_scale']:6.0e} {r['recall']:8.4f} {r['rel_l2']:9.2e} "
              f"{r['rel_l2_same_selection']:9.2e} {r['changed']:>8} {r['ties']:>5} {r['near_ties']:>5} "
              f"{r['gap_median']:9.1e} {r['gap_max']:9.1e}")
    print("same sel: the output error over the bf16 selection (the fp8 rows' own error)")
    print(f"changed: pools in one selection and not the other (of select_k per query); ties: at the "
          f"bf16 cutoff score exactly; near: within {NEAR_TIE:g} score standard deviations of it")
    return 0
