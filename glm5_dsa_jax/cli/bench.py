"""``glm5-dsa bench decode`` and ``glm5-dsa bench train``: the benchmarks' flags, tables and JSON.

What each row measures is documented with the measuring code: ``glm5_dsa_jax.tools.bench``
(decode, and its floor of bytes and FLOPs), ``glm5_dsa_jax.tools.bench_train`` (train: forward +
backward time and peak memory). This module only parses the flags, runs ``bench.run`` /
``bench_train.run`` (``bench_cp.run`` with ``--cp N``) and prints. With ``--json`` the progress lines go to stderr so stdout
is one JSON object.
"""

from __future__ import annotations

import json
import sys

import pallas_kernels as pk
from glm5_dsa_jax.cli.args import (UsageError, nonnegative_int, positive_float, positive_int,
                                   positive_int_list)
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.cli.host import need_devices
from glm5_dsa_jax.tools import bench, bench_cp, bench_train


def _num(v, width: int, digits: int) -> str:
    """``v`` in a column of ``width``, or a dash where there is no reading (None)."""
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def add_parser(sub) -> None:
    """``glm5-dsa bench``: benchmarks of one DSA layer on this host's devices: ``decode`` (a
    decode step against dense MLA) and ``train`` (forward + backward against the dense-mask
    formulation); ``glm5-dsa bench decode --help`` / ``glm5-dsa bench train --help`` for
    their flags."""
    p = sub.add_parser("bench", help="benchmarks (decode, train): glm5-dsa bench decode --help",
                       description=add_parser.__doc__)
    benchmarks = p.add_subparsers(dest="what", required=True, title="benchmarks", metavar="BENCHMARK")
    d = benchmarks.add_parser(
        "decode", help="decode-step time of sparse DSA against dense MLA, per batch and context",
        description="Time one full DSA layer's jitted decode step (sparse) against the same step "
        "with dense attention over every cached token, on a cache already holding each context, "
        "per batch size; print the median step time against its floor, the larger of the bytes it "
        "must read over the measured read bandwidth and the FLOPs it must do over the measured "
        "matmul rate (what each row measures: glm5_dsa_jax.tools.bench). Progress lines go to stdout, or to stderr with "
        "--json. With --cp N: instead, the sparse step with its cache (--cache contiguous: token rows and "
        "pools; --cache paged: page pools) split over N devices (shard_layer(..., seq_axis='cp'); virtual "
        "CPU devices on a CPU host) against the same step on one device, with per-device cache, read and "
        "crossing bytes (glm5_dsa_jax.tools.bench_cp).")
    d.add_argument("--contexts", type=positive_int_list, default="4096,16384,65536,131072",
                   help="comma-separated cache lengths in tokens; the largest plus the timed steps "
                        "must fit the preset's max_position_embeddings")
    d.add_argument("--batch", type=positive_int_list, default="1,8",
                   help="comma-separated batch sizes (sequences per step)")
    d.add_argument("--preset", default="glm53-flash", choices=["glm53-flash", "tiny"],
                   help="the layer's shapes (random weights)")
    d.add_argument("--iters", type=positive_int, default=5, help="timed steps per row (median)")
    d.add_argument("--loop-steps", type=nonnegative_int, default=None,
                   help="the whole-step rows' in-loop column: one step inside a program of this many "
                        "steps and twice as many (default 8 on a GPU, 0 (none) on a CPU)")
    d.add_argument("--implementation", default="xla", choices=list(pk.IMPLEMENTATIONS),
                   help="the kernels' implementation")
    d.add_argument("--hf-max-context", type=nonnegative_int, default=16384,
                   help="HF eager rows at batch 1 for contexts up to this (0: none; needs torch and "
                        "transformers)")
    d.add_argument("--capacity", type=positive_int_list, default=None,
                   help="cache tokens per sequence of the sparse and dense rows (default: the "
                        "largest context plus the timed steps, in whole pages for --cache paged); "
                        "comma-separated: every sparse row at each capacity, timed in rounds (what "
                        "the capacity costs at the same live tokens), the other rows at the first")
    d.add_argument("--cache", default="contiguous", choices=list(bench.CACHE_KINDS),
                   help="the sparse rows' cache: contiguous (init_cache) or paged (init_paged_cache, "
                        f"{bench.PAGE_SIZE}-token pages, batch * capacity / {bench.PAGE_SIZE} of them)")
    d.add_argument("--cache-dtype", default=None, choices=["bfloat16", "fp8"],
                   help="the sparse rows' cache dtype (default: the layer's, bfloat16); the dense "
                        "rows keep bfloat16")
    d.add_argument("--cp", type=positive_int, default=1, metavar="N",
                   help="context parallelism: time the sparse step with the cache (contiguous or paged: "
                        "--cache) split over N devices against cp 1 instead (--implementation xla only; "
                        "N virtual CPU devices on a CPU host)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=main, prog=d.prog)
    _add_train_parser(benchmarks)


def _add_train_parser(benchmarks) -> None:
    t = benchmarks.add_parser(
        "train", help="forward + backward time and peak memory of one layer, sparse against a dense mask",
        description="Compile jax.value_and_grad of a loss of one full DSA layer's output w.r.t. its "
        "parameters (sparse: the layer's own call) and of the dense-mask formulation MaxText trains "
        "with (same parameters and selection, attention over every key with the top-k as a dense "
        "mask), per batch size and token count; print each compiled step's scratch memory (total "
        "and per token) and, where the step fits --max-gib, its median time; and the indexer loss's "
        "step of glm5-dsa train-indexer's two stages, dense and sparse, w.r.t. the indexer's parameters "
        "(what each row "
        "measures: glm5_dsa_jax.tools.bench_train). Progress lines go to stdout, or to stderr "
        "with --json.")
    t.add_argument("--tokens", type=positive_int_list, default="4096,16384",
                   help="comma-separated sequence lengths (tokens per sequence), at most the "
                        "preset's max_position_embeddings")
    t.add_argument("--batch", type=positive_int_list, default="1", help="comma-separated batch sizes")
    t.add_argument("--preset", default="glm53-flash", choices=["glm53-flash", "tiny"],
                   help="the layer's shapes (random weights)")
    t.add_argument("--iters", type=positive_int, default=2, help="timed steps per row (median)")
    t.add_argument("--implementation", default="xla", choices=list(pk.IMPLEMENTATIONS),
                   help="the kernels' implementation")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="parameters and activations")
    t.add_argument("--max-gib", type=positive_float, default=None,
                   help="time a row only when its compiled step needs at most this many GiB "
                        "(default: the device's memory limit, on a CPU half the available memory)")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(func=main_train, prog=t.prog)


def check(args) -> None:
    """``UsageError`` for flags the preset or the cache cannot run: the largest context plus
    the warm-up and timed steps beyond ``max_position_embeddings``, a capacity too small."""
    cfg = DsaConfig.preset(args.preset)
    top, need = max(args.contexts), max(args.contexts) + args.iters + 1
    if need > cfg.max_position_embeddings:
        raise UsageError(
            f"--contexts {top:,} plus {args.iters + 1} decode steps (--iters {args.iters} and a "
            f"warm-up) needs {need:,} positions; preset {args.preset} holds "
            f"max_position_embeddings={cfg.max_position_embeddings:,}")
    for cap in args.capacity or ():
        try:
            bench.check_capacity(cap, args.contexts, args.iters, args.cache)
        except ValueError as e:
            raise UsageError(f"--capacity: {e}") from None


def check_cp(args) -> None:
    """``UsageError`` for what ``--cp`` cannot run: a Pallas implementation, ``--capacity``."""
    if args.cp == 1:
        return
    if args.implementation != "xla":
        raise UsageError(f"--cp {args.cp} needs --implementation xla: the cp bench times the "
                         f"xla layer only, not {args.implementation} (the layer runs it per shard)")
    if args.capacity is not None:
        raise UsageError(f"--capacity does not go with --cp {args.cp}: the cp run sizes both caches itself "
                         "(the default capacity rounded up to a multiple of cp x index_kpool, or of cp x "
                         f"{bench.PAGE_SIZE}-token pages for --cache paged)")


def main_cp(args, log) -> int:
    """``--cp N``: ``bench_cp.run`` and its table (cp N against cp 1 per batch and context)."""
    need_devices(args.cp, "--cp")
    log(f"glm5-dsa bench decode --cp {args.cp}: preset {args.preset}, {args.cache} cache, contexts "
        f"{args.contexts}, batch {args.batch}, {args.iters} timed steps per row")
    res = bench_cp.run(args.preset, args.contexts, args.batch, args.iters, args.cp, log=log,
                       cache_dtype=args.cache_dtype, cache=args.cache)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"\n{res['cache']} {res['cache_dtype']} cache, {res['implementation']}:")
    print(f"{'cp':>3} {'batch':>5} {'context':>8} {'capacity':>9} {'median ms':>10} {'x cp1':>6} "
          f"{'cache MB/dev':>13} {'read MB/dev':>12} {'cross KB/dev':>13} {'same top-k':>10}")
    base = {(r["batch"], r["context"]): r["median_ms"] for r in res["rows"] if r["cp"] == 1}
    for r in res["rows"]:
        print(f"{r['cp']:>3} {r['batch']:>5} {r['context']:>8} {r['capacity']:>9} {r['median_ms']:10.2f} "
              f"{r['median_ms'] / base[r['batch'], r['context']]:6.2f} {r['cache_bytes_per_device'] / 1e6:13.3f} "
              f"{r['read_bytes_per_device'] / 1e6:12.3f} {r['crossing_bytes_per_device'] / 1e3:13.2f} "
              f"{str(r['same_topk']):>10}")
    print(f"\n({res['devices']} {res['device']} devices; on a CPU they are virtual and share the host's "
          "cores: the times show the split's overhead, not N accelerators' gain; read MB/dev assumes every "
          "selected row on one device)")
    return 0


def main(args) -> int:
    check(args)
    check_cp(args)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (
        lambda *a: print(*a, flush=True))
    if args.cp > 1:
        return main_cp(args, log)
    log(f"glm5-dsa bench decode: preset {args.preset}, contexts {args.contexts}, batch {args.batch}, "
        f"{args.iters} timed steps per row")
    res = bench.run(args.preset, args.contexts, args.batch, args.iters, args.implementation, log=log,
                    hf_max_context=args.hf_max_context, capacity=args.capacity, cache=args.cache,
                    cache_dtype=args.cache_dtype, loop_steps=args.loop_steps)
    if args.json:
        print(json.dumps(res))
        return 0
    rates = ", ".join(f"{r:.1f} GFLOP/s ({d})" for d, r in res["matmul_gflop_s"].items())
    weights = ", ".join(f"batch {b}: {w / 1e6:.1f} MB" for b, w in res["weight_bytes_step"].items())
    print(f"\nread bandwidth {res['read_gb_s']:.2f} GB/s; matmul {rates} ({res['rates_source']}); weights read per step "
          f"{weights} (stored {res['weight_bytes_stored'] / 1e6:.1f} MB)")
    print(f"{'impl':<12} {'cache':<10} {'dtype':<13} {'batch':>5} {'context':>8} {'capacity':>9} "
          f"{'median ms':>10} {'read ms':>8} {'flop ms':>8} {'floor ms':>9} {'x floor':>8}"
          f"{'':>1}{'loop ms':>9} {'x floor':>8}")
    for r in res["rows"]:
        fl = (f"{r['floor_read_ms']:8.2f} {r['floor_compute_ms']:8.2f} {r['floor_ms']:9.2f} {r['x_floor']:8.2f}"
              if "floor_ms" in r else f"{'':>8} {'':>8} {'':>9} {'':>8}")
        loop = (f" {_num(r['loop_ms'], 9, 3)} {_num(r.get('x_floor_loop'), 8, 2)}" if "loop_ms" in r else "")
        print(f"{r['impl']:<12} {r['cache']:<10} {r.get('cache_dtype', 'bfloat16'):<13} {r['batch']:>5} "
              f"{r['context']:>8} {r['capacity']:>9} {r['median_ms']:10.2f} {fl}{loop}")
    print(f"\n{res['cache']} {res['cache_dtype']} cache bytes per token: {res['cache_bytes_per_token']:.1f}")
    caps = res["capacities"]
    by = {(r["impl"], r["batch"], r["context"]): r["median_ms"] for r in res["rows"]
          if r["impl"] != "sparse" or r["capacity"] == caps[0]}
    for r in res["rows"]:  # each further capacity's sparse row against the first's
        if r["impl"] == "sparse" and r["capacity"] != caps[0]:
            print(f"B={r['batch']} context {r['context']}: sparse step at capacity {r['capacity']} / at "
                  f"{caps[0]} = {r['median_ms'] / by[('sparse', r['batch'], r['context'])]:.3f}")
    for b in args.batch:
        c0, c1 = args.contexts[0], args.contexts[-1]
        # A paged run has no attention-part rows (see glm5_dsa_jax.tools.bench).
        attn = (f"attention dense/sparse at {c1} = {by[('dense_attn', b, c1)] / by[('sparse_attn', b, c1)]:.1f}x; "
                if ("sparse_attn", b, c1) in by else "")
        index = (f"indexer at {c1} = {by[('index', b, c1)]:.2f} ms; " if ("index", b, c1) in by else "")
        print(f"B={b}: sparse step({c1}) / step({c0}) = {by[('sparse', b, c1)] / by[('sparse', b, c0)]:.3f}; {index}"
              f"{attn}whole step dense/sparse = {by[('dense', b, c1)] / by[('sparse', b, c1)]:.1f}x "
              f"(dense on a cache sized to the context: {by[('dense_fit', b, c1)] / by[('sparse', b, c1)]:.1f}x)")
    for (impl, b, c), t in by.items():
        if impl == "hf":
            print(f"B=1: HF eager / sparse step at {c} = {t / by[('sparse', 1, c)]:.1f}x")
    return 0


def main_train(args) -> int:
    """``glm5-dsa bench train``: ``bench_train.run`` with the flags, then its table."""
    try:
        bench_train.check_tokens(DsaConfig.preset(args.preset), args.tokens)
    except ValueError as e:
        raise UsageError(f"--tokens: {e}") from None
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (
        lambda *a: print(*a, flush=True))
    log(f"glm5-dsa bench train: preset {args.preset}, tokens {args.tokens}, batch {args.batch}, "
        f"{args.iters} timed steps per row, {args.implementation}, {args.dtype}")
    max_bytes = None if args.max_gib is None else int(args.max_gib * 2**30)
    res = bench_train.run(args.preset, args.tokens, args.batch, args.iters, args.implementation,
                          log=log, max_bytes=max_bytes, dtype=args.dtype)
    if args.json:
        print(json.dumps(res))
        return 0
    print()
    for impl, what in res["measures"].items():
        print(f"{impl}: {what}")
    print(f"(timed where the step needs at most {res['max_bytes'] / 2**30:.2f} GiB; "
          f"{res['dtype']} on {res['device']})\n")
    print(f"{'impl':<19} {'batch':>5} {'tokens':>7} {'temp MiB':>10} {'KiB/token':>10} "
          f"{'compile s':>9} {'median ms':>10}  note")
    for r in res["rows"]:
        ms = f"{r['median_ms']:10.1f}" if r["median_ms"] is not None else f"{'-':>10}"
        print(f"{r['impl']:<19} {r['batch']:>5} {r['tokens']:>7} {r['temp_bytes'] / 2**20:10.1f} "
              f"{r['temp_bytes_per_token'] / 1024:10.2f} {r['compile_s']:9.1f} {ms}  {r['note']}")
    by = {(r["impl"], r["batch"], r["tokens"]): r for r in res["rows"]}
    s0, s1 = args.tokens[0], args.tokens[-1]
    for b in args.batch:
        sp0, sp1, dn1 = by[("sparse", b, s0)], by[("sparse", b, s1)], by[("dense_mask", b, s1)]
        print(f"B={b}: sparse temp per token {s1} / {s0} = "
              f"{sp1['temp_bytes_per_token'] / sp0['temp_bytes_per_token']:.2f}x; "
              f"dense_mask / sparse temp at {s1} = {dn1['temp_bytes'] / sp1['temp_bytes']:.1f}x")
        il0, il1 = by[("indexer_loss_dense", b, s0)], by[("indexer_loss_dense", b, s1)]
        print(f"B={b}: dense indexer loss temp per token {s1} / {s0} = "
              f"{il1['temp_bytes_per_token'] / il0['temp_bytes_per_token']:.2f}x")
    return 0
