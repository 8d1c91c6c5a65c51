"""``glm5-dsa roofline``: the roofline rows of one layer on a GPU, as a table or JSON.

The model (bytes, FLOPs, programs and the bound of each kernel, and why they are what they
are) is ``glm5_dsa_jax.tools.roofline``; this module parses the flags, calls ``roofline.rows`` and
formats its rows. Checked before any work, each a one-line error with exit status 2: a
context beyond the preset's ``max_position_embeddings``, an explicit ``--chunk`` longer
than the context (the default chunk, 2048, is cut to a shorter context), a non-positive
size.
"""

from __future__ import annotations

import json
import sys

from glm5_dsa_jax.tools import roofline
from glm5_dsa_jax.cli.args import UsageError, check_context, positive_int
from glm5_dsa_jax.model.config import PRESETS, DsaConfig
from glm5_dsa_jax.tools.roofline import GPUS, RooflineRow


def _fmt_bytes(n: int) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= f:
            return f"{n / f:8.2f} {unit}"
    return f"{n:8d} B "


def format_table(rs: list[RooflineRow], measured: dict | None = None) -> str:
    """A text table of ``rows``; ``measured`` ``{(phase, kernel): seconds}`` adds a column."""
    head = f"{'phase':<8} {'kernel':<26} {'bytes':>11} {'GFLOP':>10} {'programs':>9} {'bound us':>10} {'limit':<7}"
    if measured is not None:
        head += f" {'measured us':>12} {'x bound':>8}"
    lines = [head, "-" * len(head)]
    for r in rs:
        line = (f"{r.phase:<8} {r.kernel:<26} {_fmt_bytes(r.bytes):>11} {r.flops / 1e9:10.3f} "
                f"{r.programs if r.programs else '':>9} {r.bound_s * 1e6:10.2f} {r.limit:<7}")
        if measured is not None:
            m = measured.get((r.phase, r.kernel))
            line += f" {m * 1e6:12.2f} {m / r.bound_s:8.2f}" if m else f" {'':>12} {'':>8}"
        lines.append(line)
    return "\n".join(lines)


#: The prefill chunk when ``--chunk`` is not given (cut to a shorter context).
DEFAULT_CHUNK = 2048


def add_parser(sub) -> None:
    """``glm5-dsa roofline``: per kernel of one DSA layer, the bytes it moves, its FLOPs, its
    programs and the time a GPU's bandwidth and peak FLOPs bound it to, for one decode
    step and one prefill chunk (the model: glm5_dsa_jax.tools.roofline)."""
    p = sub.add_parser("roofline", help="bytes, FLOPs and bound time per kernel on a GPU (a model, no GPU needed)",
                       description=add_parser.__doc__)
    p.add_argument("--gpu", required=True, choices=sorted(GPUS), help="the GPU whose bandwidth and FLOPs bound the kernels")
    p.add_argument("--context", type=positive_int, required=True,
                   help="tokens in the cache, at most the preset's max_position_embeddings")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences")
    p.add_argument("--chunk", type=positive_int, default=None,
                   help=f"queries per sequence of the prefill chunk, at most --context (default: "
                        f"{DEFAULT_CHUNK}, or the context when it is shorter)")
    p.add_argument("--preset", default="glm53-flash", choices=[*PRESETS, "glm53_flash"],
                   help="the model's shapes (glm53_flash: an alias of glm53-flash)")
    p.add_argument("--cache-dtype", default="bfloat16", choices=["bfloat16", "fp8"],
                   help="latent rows and pooled keys: bf16, or e4m3 with a float32 scale per row")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main, prog=p.prog)


def main(args) -> int:
    cfg = DsaConfig.preset(args.preset.replace("_", "-"))
    check_context(args.context, cfg)
    if args.chunk is not None and args.chunk > args.context:
        raise UsageError(f"--chunk {args.chunk} is longer than --context {args.context}: a prefill "
                         "chunk's queries are tokens of the context")
    chunk = min(DEFAULT_CHUNK, args.context) if args.chunk is None else args.chunk
    try:
        rs = roofline.rows(cfg, args.gpu, args.context, args.batch, chunk=chunk,
                           cache_dtype=args.cache_dtype)
    except ValueError as e:
        print(f"glm5-dsa roofline: {e}", file=sys.stderr)
        return 2
    spec = GPUS[args.gpu]
    if args.json:
        print(json.dumps({"gpu": args.gpu, "gpu_name": spec.name, "bandwidth": spec.bandwidth,
                          "peak_flops": spec.peak_flops, "source": spec.source,
                          "context": args.context, "batch": args.batch, "chunk": chunk,
                          "preset": args.preset, "cache_dtype": args.cache_dtype,
                          "rows": [r.as_dict() for r in rs]}))
        return 0
    print(f"{spec.name}: {spec.bandwidth / 1e12:.3g} TB/s, {spec.peak_flops / 1e12:.0f} TFLOPS bf16 "
          f"({spec.source})")
    print(f"one layer of {args.preset.replace('_', '-')} ({cfg.model_type}), batch {args.batch}, "
          f"context {args.context:,}, prefill chunk {chunk:,} queries per sequence, "
          f"{args.cache_dtype} cache\n")
    print(format_table(rs))
    return 0
