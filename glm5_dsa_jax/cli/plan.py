"""``glm5-dsa plan``: print the tensor-parallel shard plan of one DSA layer and the
per-device memory of the model's DSA attention on a ``--dp`` x ``--cp`` x ``--tp`` mesh.

The plan itself (which tensors split by head, the bytes each rank holds, the indexer
all-reduce that replicating the indexer avoids, and why) is ``TpPlan``; the per-device
weights and caches (bf16 and fp8, contiguous and paged) and the sequences that fit are
``MemoryPlan``. This module builds both from a preset or a ``config.json`` and prints rank
``--rank``'s tensor table, the per-rank totals and the memory table, or one JSON object. A
TP size that does not divide the heads, a batch not divisible by ``--dp``, a context not
divisible by ``--cp`` times the pool size or a bad config is a one-line error with exit
status 2.

``--cp N`` (context parallelism, ``glm5_dsa_jax.parallel.context`` and ``context_paged``):
each device holds ``1/N`` of a sequence's token rows and pooled keys of the contiguous
cache, and the rest of it (the incomplete pool's stage, ``first_key``, ``n_valid``,
``length``) whole; of the paged cache (``--page-size`` tokens a page, ``ceil(context /
page_size)`` pages a sequence) ``1/N`` of the page pools (latent pages, pooled-key pages,
their fp8 scales: ``N_pages / N`` pages a device) and the page table, stage and status
whole. The memory table then shows both caches per device at ``--cp N`` against ``--cp 1``,
and the longest context whose caches fit a device (``MemoryPlan.context_that_fits``) at
both. Pages per data group not divisible by ``N``: a one-line error, exit status 2.
"""

from __future__ import annotations

import json
import sys

from glm5_dsa_jax.cli.args import UsageError, check_context, nonnegative_int, positive_float, positive_int
from glm5_dsa_jax.model.config import PRESETS, DsaConfig
from glm5_dsa_jax.tools.memory_plan import MemoryPlan, check_cp_pages
from glm5_dsa_jax.parallel.plan import BF16_BYTES, SCORE_BYTES, TpPlan, fmt_bytes

#: Cache dtypes the memory table compares.
PLAN_CACHE_DTYPES = ("bfloat16", "fp8")


def add_parser(subparsers) -> None:
    """``glm5-dsa plan``: print one DSA layer's tensor-parallel shard plan (rank --rank's
    tensors, the per-rank totals) and the per-device memory of the model's DSA attention
    (weights, bf16 and fp8 caches, contiguous and paged, the sequences that fit) on a
    --dp x --cp x --tp mesh. With --cp N each device holds 1/N of a sequence's contiguous
    cache (its token rows and pooled keys; the incomplete pool's stage replicated) and 1/N
    of a paged cache's page pools (the page table replicated), and the table compares the
    cache per device and the context that fits against --cp 1. A plan: no devices are
    needed."""
    p = subparsers.add_parser(
        "plan", help="print the tensor-parallel shard plan of one DSA layer",
        description=add_parser.__doc__,
    )
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size: heads split over it")
    p.add_argument("--dp", type=positive_int, default=1,
                   help="data-parallel size: the batch and the caches split by sequence")
    p.add_argument("--cp", type=positive_int, default=1, metavar="N",
                   help="context-parallel size: each sequence's contiguous cache (token rows, pooled "
                        "keys) and the paged cache's page pools split over it; the context must divide "
                        "by cp x index_kpool, the pages per data group by cp")
    p.add_argument("--page-size", type=positive_int, default=64,
                   help="tokens per page of the paged cache (a multiple of index_kpool)")
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
        check_page_size(args.page_size, cfg)
        check_cp(args.cp, context, cfg, None if batch % args.dp else batch // args.dp, args.page_size)
        mem = MemoryPlan(cfg, tp=args.tp, dp=args.dp, batch=batch, context=context,
                         elem_bytes=args.elem_bytes, cp=args.cp, page_size=args.page_size)
        memory = int(args.memory_gib * 2**30)
        rows = mem.rows(memory, PLAN_CACHE_DTYPES)
        one = MemoryPlan(cfg, tp=args.tp, dp=args.dp, batch=batch, context=context, elem_bytes=args.elem_bytes,
                         page_size=args.page_size)
        cp_rows = cp_table(mem, one, memory) if args.cp > 1 else None
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
                           weight_bytes_per_device=mem.weight_bytes, caches=rows, cp=args.cp,
                           page_size=args.page_size)
        if cp_rows is not None:
            d["memory"]["context_parallel"] = dict(
                cp=args.cp, replicated_cache_bytes_per_device=mem.replicated_cache_bytes(),
                replicated_fields=REPLICATED_OVER_CP, paged_replicated_fields=PAGED_REPLICATED_OVER_CP,
                pages=mem.pages(), pages_per_device=mem.pages() // args.cp, rows=cp_rows)
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
    if cp_rows is not None:
        print_cp(args, mem, cp_rows, batch, context)
        return 0
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


#: The contiguous cache's fields every device of the cp axis holds whole.
REPLICATED_OVER_CP = ("stage_keys", "stage_gate", "stage_valid", "first_key", "n_valid", "length", "stage_from")
#: The paged cache's parts every device of the cp axis holds whole (all but ``PAGE_AXIS_FIELDS``).
PAGED_REPLICATED_OVER_CP = ("pages", "stage_keys", "stage_gate", "stage_from", "status")


def check_page_size(page_size: int, cfg) -> None:
    """``UsageError`` unless a page holds whole pools."""
    if page_size % cfg.index_kpool:
        raise UsageError(f"--page-size {page_size} is not a multiple of index_kpool={cfg.index_kpool} "
                         f"(a page holds whole pools)")


def check_cp(cp: int, context: int, cfg, seqs: int | None = None, page_size: int = 64) -> None:
    """``UsageError`` unless ``context`` splits into ``cp`` ranges of whole pools and (given
    ``seqs``, one data group's sequences) the paged cache's pages into ``cp`` blocks."""
    unit = cp * cfg.index_kpool
    if cp > 1 and context % unit:
        raise UsageError(
            f"--cp {cp}: --context {context:,} is not divisible by cp x index_kpool = {cp} x "
            f"{cfg.index_kpool} = {unit} (each of the {cp} devices holds a contiguous range of whole "
            f"pools); e.g. --context {context // unit * unit:,}")
    if cp > 1 and seqs is not None:
        try:
            check_cp_pages(seqs, context, page_size, cp)
        except ValueError as e:
            raise UsageError(f"--cp {cp}: {e}; change --batch, --context or --page-size") from None


def cp_table(mem: MemoryPlan, one: MemoryPlan, memory: int) -> list[dict]:
    """Per cache kind and dtype: the cache per device, the part of it replicated over cp,
    the context that fits (capped at ``max_position_embeddings``;
    ``context_that_fits_memory``: what the memory alone allows) and the sequences that fit,
    at ``mem.cp`` against ``one`` (cp 1); a paged row also its pages per device."""
    out = []
    for kind in mem.kinds:
        for dtype in PLAN_CACHE_DTYPES:
            fits, fits1 = mem.context_that_fits(memory, kind, dtype), one.context_that_fits(memory, kind, dtype)
            top = mem.cfg.max_position_embeddings
            row = dict(cache=kind, dtype=dtype, cache_bytes_per_device=mem.cache_bytes(kind, dtype),
                       cache_bytes_per_device_cp1=one.cache_bytes(kind, dtype),
                       replicated_cache_bytes_per_device=mem.replicated_cache_bytes(dtype, kind=kind),
                       context_that_fits=min(fits, top), context_that_fits_cp1=min(fits1, top),
                       context_that_fits_memory=fits, context_that_fits_memory_cp1=fits1,
                       sequences_that_fit=mem.sequences_that_fit(memory, kind, dtype),
                       sequences_that_fit_cp1=one.sequences_that_fit(memory, kind, dtype))
            if kind == "paged":
                row.update(pages=mem.pages(), pages_per_device=mem.pages() // mem.cp)
            out.append(row)
    return out


def print_cp(args, mem: MemoryPlan, rows: list[dict], batch: int, context: int) -> None:
    """The memory table of a ``--cp`` plan: per device at ``--cp`` against ``--cp 1``."""
    cfg, top = mem.cfg, mem.cfg.max_position_embeddings
    print(f"memory per device, {len(mem.layers)} DSA layers, mesh data={args.dp} x cp={args.cp} x "
          f"tp={args.tp}, {batch} sequences of {context:,} tokens ({batch // args.dp} per data group, "
          f"each split over {args.cp} devices):")
    print(f"  attention weights: {fmt_bytes(mem.weight_bytes)} (split over tp, replicated over data and cp)")
    print(f"  contiguous: each device holds 1/{args.cp} of every sequence's token rows and pooled keys; "
          f"replicated over cp: {fmt_bytes(mem.replicated_cache_bytes())} of cache per device "
          f"({', '.join(REPLICATED_OVER_CP)}: the incomplete pool's stage and the bookkeeping)")
    print(f"  paged: {mem.pages():,} pages of {mem.page_size} tokens per data group, {mem.pages() // args.cp:,} "
          f"a device (latent and pooled-key pages); replicated over cp: "
          f"{fmt_bytes(mem.replicated_cache_bytes(kind='paged'))} of cache per device "
          f"({', '.join(PAGED_REPLICATED_OVER_CP)}: the page table, the stage and the status)")
    print(f"  {'cache':<11}{'dtype':<10}{'cache/device':>14}{'at cp 1':>12}  "
          f"{'context that fits':>18}{'at cp 1':>12}  sequences that fit (cp 1)")
    mark = lambda n: f"{min(n, top):,}" + ("*" if n > top else "")  # noqa: E731
    for r in rows:
        print(f"  {r['cache']:<11}{r['dtype']:<10}{fmt_bytes(r['cache_bytes_per_device']):>14}"
              f"{fmt_bytes(r['cache_bytes_per_device_cp1']):>12}  {mark(r['context_that_fits_memory']):>18}"
              f"{mark(r['context_that_fits_memory_cp1']):>12}  {r['sequences_that_fit']:,} "
              f"({r['sequences_that_fit_cp1']:,})")
    print(f"  (cache/device: what one device holds at {context:,} tokens; context that fits: tokens per "
          f"sequence for {batch // args.dp} sequences per data group in {args.memory_gib:g} GiB/device, in "
          f"units of cp x index_kpool = {args.cp * cfg.index_kpool} (contiguous) or cp x page_size = "
          f"{args.cp * mem.page_size} (paged); sequences that fit: at {context:,} tokens, on the whole mesh; "
          f"* = capped at max_position_embeddings {top:,}; attention only: no MoE, embeddings or activations)")
