"""``glm5-dsa roofline``: the roofline rows of one layer on a GPU, as a table or JSON.

The model (bytes, FLOPs, programs and the bound of each kernel, and why they are what they
are) is ``glm5_dsa_jax.tools.roofline``; this module parses the flags, calls ``roofline.rows`` and
formats its rows. Checked before any work, each a one-line error with exit status 2: a
context beyond the preset's ``max_position_embeddings``, an explicit ``--chunk`` longer
than the context (the default chunk, 2048, is cut to a shorter context), a non-positive
size; with ``--train``, a ``--chunk``, an fp8 ``--cache-dtype`` (a training step keeps no
cache) or ``--indexer-loss`` without ``--train``.

``--train`` prints ``roofline.train_rows`` instead: the forward and backward of one training
step over ``--context`` tokens per sequence, and the dense-mask formulation's attention, then
the sparse attention's forward + backward (``sparse_mla``, its backward kernels and the
selection's transpose) against the dense mask's.
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
    head = (f"{'phase':<8} {'kernel':<26} {'bytes':>11} {'GFLOP':>10} {'programs':>9} {'memory us':>10} "
            f"{'compute us':>10} {'bound us':>10} {'limit':<7}")
    if measured is not None:
        head += f" {'measured us':>12} {'x bound':>8}"
    lines = [head, "-" * len(head)]
    for r in rs:
        line = (f"{r.phase:<8} {r.kernel:<26} {_fmt_bytes(r.bytes):>11} {r.flops / 1e9:10.3f} "
                f"{r.programs if r.programs else '':>9} {r.memory_s * 1e6:10.2f} {r.compute_s * 1e6:10.2f} "
                f"{r.bound_s * 1e6:10.2f} {r.limit:<7}")
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
    p.add_argument("--train", action="store_true",
                   help="one training step instead: forward + backward of every kernel over --context "
                        "tokens per sequence, against the dense-mask formulation (MaxText's)")
    p.add_argument("--indexer-loss", action="store_true",
                   help="with --train: the indexer's backward too (index_scores, kpool_compress, the "
                        "indexer's projections), as an indexer loss runs it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main, prog=p.prog)


#: The rows of the sparse attention's forward + backward (``--train``'s summary line).
SPARSE_ATTENTION_ROWS = ("sparse_mla", "xla:lse_delta", "sparse_mla_bwd:dq", "selection_transpose",
                         "sparse_mla_bwd:dlatent")


def check_train(args) -> None:
    """``UsageError`` for flags that do not go with ``--train`` (or need it)."""
    if not args.train:
        if args.indexer_loss:
            raise UsageError("--indexer-loss needs --train: it adds the indexer's backward rows")
        return
    if args.chunk is not None:
        raise UsageError("--chunk is a prefill flag: with --train every token of --context is a query")
    if args.cache_dtype != "bfloat16":
        raise UsageError(f"--cache-dtype {args.cache_dtype} does not apply to --train: a training "
                         "step keeps no cache")


def main_train(args, cfg) -> int:
    """``--train``: ``roofline.train_rows`` as a table (or JSON) and the attention's summary."""
    rs = roofline.train_rows(cfg, args.gpu, args.context, args.batch, indexer_loss=args.indexer_loss)
    spec = GPUS[args.gpu]
    sparse = sum(r.bound_s for r in rs if r.kernel in SPARSE_ATTENTION_ROWS)
    dense = next(r.bound_s for r in rs if (r.phase, r.kernel) == ("dense_mask", "total"))
    if args.json:
        print(json.dumps({"gpu": args.gpu, "gpu_name": spec.name, "bandwidth": spec.bandwidth,
                          "peak_flops": spec.peak_flops, "source": spec.source, "train": True,
                          "context": args.context, "batch": args.batch, "preset": args.preset,
                          "indexer_loss": args.indexer_loss, "sparse_attention_s": sparse,
                          "dense_mask_attention_s": dense, "rows": [r.as_dict() for r in rs]}))
        return 0
    print(f"{spec.name}: {spec.bandwidth / 1e12:.3g} TB/s, {spec.peak_flops / 1e12:.0f} TFLOPS bf16 "
          f"({spec.source})")
    print(f"one training step of one layer of {args.preset.replace('_', '-')} ({cfg.model_type}), batch "
          f"{args.batch}, {args.context:,} tokens per sequence, "
          f"{'with' if args.indexer_loss else 'no'} indexer loss\n")
    print(format_table(rs))
    print(f"\nattention forward + backward: sparse {sparse * 1e3:.2f} ms "
          f"({' + '.join(SPARSE_ATTENTION_ROWS)}), dense mask {dense * 1e3:.2f} ms "
          f"({dense / sparse:.2f}x the sparse bound)")
    return 0


def main(args) -> int:
    cfg = DsaConfig.preset(args.preset.replace("_", "-"))
    check_context(args.context, cfg)
    check_train(args)
    if args.train:
        return main_train(args, cfg)
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
