"""``glm5-dsa roofline``: the roofline rows of one layer on a GPU, as a table or JSON.

The model (bytes, FLOPs, programs and the bound of each kernel, and why they are what they
are) is ``glm5_dsa_jax.tools.roofline``; this module parses the flags, calls ``roofline.rows`` and
formats its rows. Checked before any work, each a one-line error with exit status 2: a
context beyond the preset's ``max_position_embeddings``, an explicit ``--chunk`` longer
than the context (the default chunk, 2048, is cut to a shorter context), a non-positive
size; with ``--train``, a ``--chunk``, an fp8 ``--cache-dtype`` (a training step keeps no
cache) or ``--indexer-loss`` without ``--train``.

``--cp N`` adds the decode step on one device of a sequence axis of ``N`` devices
(``roofline.cp_rows``: phase ``decode_cpN``, the interconnect rows over the GPU's NVLink
figure or ``--interconnect-gb-s``) and a summary against cp 1: bytes and bound per device,
bytes crossing devices. Refused (exit 2): ``--cp`` with ``--train``, a context not
divisible by ``N`` times the pool size.

``--train`` prints ``roofline.train_rows`` instead: the forward and backward of one training
step over ``--context`` tokens per sequence, and the dense-mask formulation's attention, then
the sparse attention's forward + backward (``sparse_mla``, its backward kernels and the
selection's transpose) against the dense mask's.
"""

from __future__ import annotations

import json
import sys

import jax

from glm5_dsa_jax.cli import host
from glm5_dsa_jax.tools import roofline
from glm5_dsa_jax.cli.args import UsageError, check_context, positive_float, positive_int
from glm5_dsa_jax.model.config import PRESETS, DsaConfig
from glm5_dsa_jax.tools.roofline import GPUS, RooflineRow


def _fmt_bytes(n: int) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= f:
            return f"{n / f:8.2f} {unit}"
    return f"{n:8d} B "


def format_table(rs: list[RooflineRow], measured: dict | None = None) -> str:
    """A text table of ``rows``; ``measured`` ``{(phase, kernel): seconds}`` adds a column."""
    pw = max([8] + [len(r.phase) for r in rs])  # decode_cp8 is wider than the other phases
    head = (f"{'phase':<{pw}} {'kernel':<26} {'bytes':>11} {'GFLOP':>10} {'programs':>9} {'memory us':>10} "
            f"{'compute us':>10} {'bound us':>10} {'limit':<7}")
    if measured is not None:
        head += f" {'measured us':>12} {'x bound':>8}"
    lines = [head, "-" * len(head)]
    for r in rs:
        line = (f"{r.phase:<{pw}} {r.kernel:<26} {_fmt_bytes(r.bytes):>11} {r.flops / 1e9:10.3f} "
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
    step and one prefill chunk (the model: glm5_dsa_jax.tools.roofline). With --cp N also the
    decode step on one of N devices that each hold 1/N of the sequence (context parallelism),
    what crosses devices over NVLink, and a line against cp 1."""
    p = sub.add_parser("roofline", help="bytes, FLOPs and bound time per kernel on a GPU (a model, no GPU needed)",
                       description=add_parser.__doc__)
    p.add_argument("--gpu", default=None, choices=sorted(GPUS),
                   help="the GPU whose bandwidth and FLOPs bound the kernels (default: this host's GPU, "
                        "when the table names it; required elsewhere)")
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
    p.add_argument("--cp", type=positive_int, default=1, metavar="N",
                   help="context parallelism: also the decode step on one of N devices each holding 1/N "
                        "of the sequence (worst case: every selected row on that device), what crosses "
                        "devices, against cp 1; --context must divide by N x index_kpool")
    p.add_argument("--interconnect-gb-s", type=positive_float, default=None,
                   help="with --cp: GB/s one device sends to the others (default: half the GPU's "
                        "datasheet NVLink total, i.e. one direction)")
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


def check_cp(args, cfg) -> None:
    """``UsageError`` for a ``--cp`` the context does not split into, or that does not go with
    the other flags."""
    if args.cp == 1:
        if args.interconnect_gb_s is not None:
            raise UsageError("--interconnect-gb-s needs --cp N (N > 1): it times what crosses devices")
        return
    if args.train:
        raise UsageError(f"--cp {args.cp} does not go with --train: the context-parallel rows are the decode step's")
    unit = args.cp * cfg.index_kpool
    if args.context % unit:
        raise UsageError(f"--cp {args.cp}: --context {args.context:,} is not divisible by cp x index_kpool = "
                         f"{args.cp} x {cfg.index_kpool} = {unit} (each device holds whole pools); e.g. "
                         f"--context {max(unit, args.context // unit * unit):,}")


def cp_summary(cfg, args, rs: list[RooflineRow], cp_rs: list[RooflineRow]) -> dict:
    """The decode step per device at ``--cp`` against cp 1: bytes, FLOPs and bound, and
    what crosses devices (bytes and bound)."""
    one = next(r for r in rs if (r.phase, r.kernel) == ("decode", "total"))
    tot = cp_rs[-1]
    link = [r for r in cp_rs if r.limit == "interconnect"]
    local = [r for r in cp_rs[:-1] if r.limit != "interconnect"]
    spec = GPUS[args.gpu]
    return dict(cp=args.cp, interconnect_bytes_per_s=(spec.interconnect if args.interconnect_gb_s is None
                                                      else args.interconnect_gb_s * 1e9),
                cp1_bytes=one.bytes, cp1_flops=one.flops, cp1_bound_s=one.bound_s,
                device_bytes=sum(r.bytes for r in local), device_flops=sum(r.flops for r in local),
                crossing_bytes=sum(r.bytes for r in link), crossing_s=sum(r.bound_s for r in link),
                bound_s=tot.bound_s, assumption="worst case: every selected latent row on one device")


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


def this_gpu() -> str | None:
    """The table's name of this host's GPU (``roofline.gpu_for_device_kind`` of jax's first
    device); None without a GPU or for one the table does not name."""
    if not host.has_gpu():
        return None
    dev = jax.devices()[0]
    return roofline.gpu_for_device_kind(getattr(dev, "device_kind", "")) if dev.platform == "gpu" else None


def main(args) -> int:
    if args.gpu is None:
        args.gpu = this_gpu()
        if args.gpu is None:
            raise UsageError(f"--gpu is required: this host has no GPU the table names (one of "
                             f"{', '.join(sorted(GPUS))})")
    cfg = DsaConfig.preset(args.preset.replace("_", "-"))
    check_context(args.context, cfg)
    check_cp(args, cfg)
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
        link = None if args.interconnect_gb_s is None else args.interconnect_gb_s * 1e9
        cp_rs = (roofline.cp_rows(cfg, args.gpu, args.context, args.batch, args.cp, cache_dtype=args.cache_dtype,
                                  interconnect=link) if args.cp > 1 else [])
    except ValueError as e:
        print(f"glm5-dsa roofline: {e}", file=sys.stderr)
        return 2
    spec = GPUS[args.gpu]
    if args.json:
        print(json.dumps({"gpu": args.gpu, "gpu_name": spec.name, "bandwidth": spec.bandwidth,
                          "peak_flops": spec.peak_flops, "source": spec.source,
                          "context": args.context, "batch": args.batch, "chunk": chunk,
                          "preset": args.preset, "cache_dtype": args.cache_dtype, "cp": args.cp,
                          "rows": [r.as_dict() for r in rs + cp_rs],
                          **({"context_parallel": cp_summary(cfg, args, rs, cp_rs)} if cp_rs else {})}))
        return 0
    print(f"{spec.name}: {spec.bandwidth / 1e12:.3g} TB/s, {spec.peak_flops / 1e12:.0f} TFLOPS bf16 "
          f"({spec.source})")
    print(f"one layer of {args.preset.replace('_', '-')} ({cfg.model_type}), batch {args.batch}, "
          f"context {args.context:,}, prefill chunk {chunk:,} queries per sequence, "
          f"{args.cache_dtype} cache\n")
    print(format_table(rs + cp_rs))
    if cp_rs:
        c = cp_summary(cfg, args, rs, cp_rs)
        print(f"\ndecode per device at cp {args.cp} (decode_cp{args.cp}; worst case: every selected latent row "
              f"on one device) against cp 1: {c['device_bytes'] / 1e6:.2f} MB read/written vs "
              f"{c['cp1_bytes'] / 1e6:.2f} MB, {c['device_flops'] / 1e9:.3f} vs {c['cp1_flops'] / 1e9:.3f} GFLOP, "
              f"bound {c['bound_s'] * 1e6:.2f} us vs {c['cp1_bound_s'] * 1e6:.2f} us "
              f"({c['cp1_bound_s'] / c['bound_s']:.2f}x); crossing devices {c['crossing_bytes'] / 1e3:.1f} KB "
              f"per device, {c['crossing_s'] * 1e6:.2f} us at {c['interconnect_bytes_per_s'] / 1e9:g} GB/s "
              f"(launch latency not counted)")
    return 0
