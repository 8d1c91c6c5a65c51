"""Context parallelism in the CLI (issue 27, deliverables 4 and 5): ``glm5-dsa plan --cp N``
(``MemoryPlan(cp=N)``), ``glm5-dsa roofline --cp N`` (``roofline.cp_rows``) and ``glm5-dsa
bench decode --cp N`` (``bench_cp.run``) on the 8 virtual CPU devices of conftest.py.

The plan's per-device cache bytes are checked against a cache actually placed with its
tokens split over ``cp`` (device 0's shards), the context that fits against the bytes at it
and one pool unit more; the roofline's cp rows against its cp 1 rows (what is split, what
is not) and against the collectives' operand sizes; the benchmark's rows against the same
plan arithmetic and the cp 1 step's selection (bit for bit). Bad ``--cp`` values: one line,
exit status 2, no work.
"""

from __future__ import annotations

import json

import jax
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.cli import main
from glm5_dsa_jax.parallel import sharding as sh
from glm5_dsa_jax.tools import bench, bench_cp, roofline
from glm5_dsa_jax.tools.memory_plan import MemoryPlan, cache_bytes

TINY = gd.DsaConfig.preset("tiny")
FLASH = gd.DsaConfig.preset("glm53-flash")


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("layer_idx", TINY.dsa_layers)
def test_plan_cp_bytes_are_a_placed_caches_bytes_per_device(layer_idx, dtype):
    """``cache_bytes(..., cp=4)`` is what device 0 holds of a cache placed with its tokens
    split over a cp axis of 4: 1/4 of the token rows and pools, the stage whole."""
    mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])
    cache = gd.init_cache(TINY, 2, 64, has_indexer=TINY.has_indexer(layer_idx), dtype=dtype)
    placed = sh.place_cache(cache, mesh, None, "cp")
    assert cache_bytes(TINY, layer_idx, "contiguous", dtype, 2, 64, cp=4) == bench_cp.device_bytes(placed)
    assert cache_bytes(TINY, layer_idx, "contiguous", dtype, 2, 64, cp=1) == cache.nbytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("layer_idx", TINY.dsa_layers)
def test_plan_cp_paged_bytes_are_a_placed_caches_bytes_per_device(layer_idx, dtype):
    """``cache_bytes(..., "paged", cp=4)`` is what device 0 holds of a paged cache whose page
    pools are split over a cp axis of 4: 1/4 of the pages, the page table and stage whole."""
    mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])
    # 2 sequences of 64 tokens in 8-token pages: 16 pages, 4 a device.
    cache = gd.init_paged_cache(TINY, 2, 16, 8, pages_per_seq=8, has_indexer=TINY.has_indexer(layer_idx),
                                dtype=dtype, seq_shards=4)
    placed = sh.place_cache(cache, mesh, None, "cp")
    got = cache_bytes(TINY, layer_idx, "paged", dtype, 2, 64, 8, cp=4)
    assert got == bench_cp.device_bytes(placed)
    assert cache_bytes(TINY, layer_idx, "paged", dtype, 2, 64, 8, cp=1) == cache.nbytes() > got
    with pytest.raises(ValueError, match=r"3 sequences x 8 pages .* = 24 pages is not divisible by cp=16"):
        cache_bytes(TINY, layer_idx, "paged", dtype, 3, 64, 8, cp=16)


def test_plan_cp_paged_context_and_sequences_that_fit():
    """The paged context that fits under cp is the longest (in units of cp x page_size) whose
    caches fit next to the weights; the sequences that fit keep the pages divisible by cp."""
    memory = 8 * 2**30
    plan, one = (MemoryPlan(FLASH, tp=8, batch=8, context=4096, cp=cp) for cp in (4, 1))
    n, n1 = plan.context_that_fits(memory, "paged"), one.context_that_fits(memory, "paged")
    unit = 4 * plan.page_size
    assert n % unit == 0 and n1 % plan.page_size == 0
    assert plan.weight_bytes + plan.cache_bytes("paged", context=n) <= memory < plan.weight_bytes + plan.cache_bytes(
        "paged", context=n + unit)
    assert 3.9 * n1 < n <= 4 * n1 + unit  # the page table is the only part not split
    # Replicated over cp: the page table, the stage and the status, the same bytes on every cp size.
    rep = plan.replicated_cache_bytes(kind="paged")
    assert rep == one.replicated_cache_bytes(kind="paged") > plan.replicated_cache_bytes()
    assert plan.cache_bytes("paged") - rep == (one.cache_bytes("paged") - rep) // 4
    assert plan.pages() == 8 * 4096 // 64
    # 4,160 tokens: 65 pages a sequence, so sequences come in fours (65 x 4 pages divide by 4).
    odd = MemoryPlan(FLASH, tp=8, batch=8, context=4160, cp=4)
    s = odd.sequences_that_fit(memory, "paged")
    assert s % 4 == 0 and s > 0
    assert odd.weight_bytes + odd.cache_bytes("paged", seqs=s) <= memory
    assert odd.weight_bytes + odd.cache_bytes("paged", seqs=s + 4) > memory


def test_plan_cp_context_that_fits_is_the_longest_that_fits():
    memory = 8 * 2**30
    plan, one = (MemoryPlan(FLASH, tp=8, batch=8, context=4096, cp=cp) for cp in (4, 1))
    n, n1 = plan.context_that_fits(memory), one.context_that_fits(memory)
    unit = 4 * FLASH.index_kpool
    assert n % unit == 0 and n1 % FLASH.index_kpool == 0
    assert plan.weight_bytes + plan.cache_bytes(context=n) <= memory < plan.weight_bytes + plan.cache_bytes(
        context=n + unit)
    assert 3.99 * n1 < n <= 4 * n1 + unit  # the stage is the only part not split
    # Replicated over cp: the stage and bookkeeping, the same bytes on every cp size.
    assert plan.replicated_cache_bytes() == one.replicated_cache_bytes() > 0
    assert plan.cache_bytes() - plan.replicated_cache_bytes() == (one.cache_bytes() - one.replicated_cache_bytes()) // 4
    with pytest.raises(ValueError, match=r"context 4,100 is not divisible by cp \* index_kpool = 4 \* 4 = 16"):
        MemoryPlan(FLASH, tp=8, context=4100, cp=4)


def test_plan_cli_cp_prints_per_device_against_cp_1(capsys):
    argv = ["plan", "--tp", "8", "--cp", "4", "--context", "262144", "--memory-gib", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh data=1 x cp=4 x tp=8" in out and "replicated over cp:" in out and "stage_keys" in out
    assert "paged: 32,768 pages of 64 tokens per data group, 8,192 a device" in out
    table = out.split("memory per device")[1].split("(cache/device:")[0]
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("  contiguous ")
            or line.startswith("  paged ")] == [["contiguous", "bfloat16"], ["contiguous", "fp8"],
                                                 ["paged", "bfloat16"], ["paged", "fp8"]]
    assert "not sized yet" not in out
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)["memory"]
    plan, one = (MemoryPlan(FLASH, tp=8, batch=8, context=262144, cp=cp) for cp in (4, 1))
    assert d["cp"] == 4 and [r["cache"] for r in d["caches"]] == ["contiguous", "contiguous", "paged", "paged"]
    cp = d["context_parallel"]
    assert cp["replicated_cache_bytes_per_device"] == plan.replicated_cache_bytes()
    assert (cp["pages"], cp["pages_per_device"]) == (32768, 8192)
    row = cp["rows"][0]
    assert row["dtype"] == "bfloat16" and row["cache_bytes_per_device"] == plan.cache_bytes()
    assert row["cache_bytes_per_device_cp1"] == one.cache_bytes()
    assert row["context_that_fits_memory"] == plan.context_that_fits(8 * 2**30)
    assert row["context_that_fits_memory_cp1"] == one.context_that_fits(8 * 2**30)
    paged = cp["rows"][2]
    assert (paged["cache"], paged["dtype"], paged["pages_per_device"]) == ("paged", "bfloat16", 8192)
    assert paged["cache_bytes_per_device"] == plan.cache_bytes("paged")
    assert paged["cache_bytes_per_device_cp1"] == one.cache_bytes("paged")
    assert paged["replicated_cache_bytes_per_device"] == plan.replicated_cache_bytes(kind="paged")
    assert paged["context_that_fits_memory"] == plan.context_that_fits(8 * 2**30, "paged")
    assert paged["sequences_that_fit"] == plan.sequences_that_fit(8 * 2**30, "paged")


def test_roofline_cp_rows_split_the_indexer_and_count_what_crosses():
    ctx, cp = 1 << 20, 8
    one = {r.kernel: r for r in roofline.rows(FLASH, "h200", ctx, 1, phases=("decode",))}
    rows = roofline.cp_rows(FLASH, "h200", ctx, 1, cp)
    got = {r.kernel: r for r in rows}
    assert {r.phase for r in rows} == {"decode_cp8"}
    for k in one:  # what every device does whole: the same rows
        if k.startswith("xla:") or k in ("kpool_compress", "expand_selection", "cache_write"):
            assert (got[k].bytes, got[k].flops) == (one[k].bytes, one[k].flops), k
    for k in ("index_scores", "topk_pools"):  # over P/cp pools
        assert got[k].flops * cp == pytest.approx(one[k].flops, rel=0.01), k
        assert got[k].bytes * cp == pytest.approx(one[k].bytes, rel=0.01), k
    # sparse_mla: the worst case, every selected row here, plus the log-sum-exp written.
    assert got["sparse_mla"].bytes == one["sparse_mla"].bytes + FLASH.num_attention_heads * 4
    k, nh, v = FLASH.max_select_k, FLASH.num_attention_heads, FLASH.kv_lora_rank
    ring = lambda n: 2 * (cp - 1) * n // cp  # noqa: E731
    assert got["interconnect:candidates"].bytes == (cp - 1) * k * 8
    assert got["interconnect:partials"].bytes == ring(nh * (v + 1) * 4) + ring(nh * 4)
    assert got["interconnect:candidates"].bound_s == (cp - 1) * k * 8 / roofline.GPUS["h200"].interconnect
    assert roofline.cp_crossing_bytes(FLASH, 1 << 17, 1, cp) == roofline.cp_crossing_bytes(FLASH, ctx, 1, cp)
    assert got["total"].bound_s == pytest.approx(sum(r.bound_s for r in rows[:-1]))
    assert got["total"].bound_s < one["total"].bound_s
    with pytest.raises(ValueError, match="not divisible by cp"):
        roofline.cp_rows(FLASH, "h200", ctx + 4, 1, cp)


def test_roofline_cli_cp_summary(capsys):
    argv = ["roofline", "--gpu", "h200", "--context", "1048576", "--cp", "8"]
    assert main(argv + ["--json", "--interconnect-gb-s", "100"]) == 0
    d = json.loads(capsys.readouterr().out)
    c = d["context_parallel"]
    assert c["cp"] == 8 and c["interconnect_bytes_per_s"] == 100e9
    assert c["crossing_bytes"] == roofline.cp_crossing_bytes(FLASH, 1 << 20, 1, 8)["total"]
    assert c["crossing_s"] == pytest.approx(c["crossing_bytes"] / 100e9)
    assert c["device_bytes"] < c["cp1_bytes"] and "worst case" in c["assumption"]
    assert main(argv) == 0
    assert "decode per device at cp 8" in capsys.readouterr().out


def test_bench_decode_cp_against_cp_1(capsys):
    argv = ["bench", "decode", "--cp", "2", "--preset", "tiny", "--contexts", "64", "--batch", "1", "--iters", "1"]
    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["cp"]: r for r in res["rows"]}
    assert sorted(rows) == [1, 2] and res["cache"] == "contiguous" and res["implementation"] == "xla"
    idx = next(i for i in TINY.dsa_layers if TINY.has_indexer(i))
    for n, r in rows.items():
        assert r["same_topk"] is True and r["compiles"] == 1 and r["devices"] == n
        assert r["capacity"] == res["capacity"] == bench_cp.cp_capacity([64], 1, 2, TINY.index_kpool)
        assert r["cache_bytes_per_device"] == cache_bytes(TINY, idx, "contiguous", r["cache_dtype"], 1,
                                                          r["capacity"], cp=n)
    # cp 1 (unplaced) reads the bf16 contraction-last weights, cp 2 (placed) float32 copies
    # (cpu_policy): what splitting the sequence shrinks is the rest, the cache's share.
    weights = {n: roofline.step_read_bytes(TINY, 64, 1, weight_elem_bytes=eb, cache_elem_bytes=2)["weights"]
               for n, eb in ((1, 2), (2, 4))}
    assert rows[2]["read_bytes_per_device"] - weights[2] < rows[1]["read_bytes_per_device"] - weights[1]
    assert rows[2]["crossing_bytes_per_device"] == roofline.cp_crossing_bytes(TINY, 64, 1, 2)["total"] > 0
    assert rows[1]["crossing_bytes_per_device"] == 0


def test_bench_decode_cp_paged_against_cp_1(capsys):
    """``--cp 2 --cache paged``: the paged step with its page pools split over 2 devices, its
    top-k bit for bit the cp 1 step's, device 0's bytes the plan's, the collectives as sized."""
    argv = ["bench", "decode", "--cp", "2", "--cache", "paged", "--preset", "tiny", "--contexts", "64",
            "--batch", "1", "--iters", "1", "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["cp"]: r for r in res["rows"]}
    assert sorted(rows) == [1, 2] and res["cache"] == "paged" and res["implementation"] == "xla"
    idx = next(i for i in TINY.dsa_layers if TINY.has_indexer(i))
    cap = res["capacity"]
    assert cap == bench_cp.cp_capacity([64], 1, 2, TINY.index_kpool, "paged") and cap % (2 * bench.PAGE_SIZE) == 0
    for n, r in rows.items():
        assert r["same_topk"] is True and r["compiles"] == 1 and r["devices"] == n and r["cache"] == "paged"
        assert r["cache_bytes_per_device"] == cache_bytes(TINY, idx, "paged", r["cache_dtype"], 1, cap,
                                                          bench.PAGE_SIZE, cp=n)
    assert rows[2]["cache_bytes_per_device"] < rows[1]["cache_bytes_per_device"]
    assert rows[2]["crossing_bytes_per_device"] == bench_cp.paged_crossing_bytes(TINY, 1, 2, cap) > 0
    assert rows[1]["crossing_bytes_per_device"] == 0


def test_paged_crossing_bytes_are_the_steps_all_gathers():
    """``paged_crossing_bytes``' candidates are the compiled paged cp step's all-gather
    operands: per device ``K'`` int32 keys and ids of ``[B, 1, K']``."""
    import re

    from glm5_dsa_jax.decode import make_step
    b, cp, cap = 2, 2, 2 * bench.PAGE_SIZE
    cfg = TINY
    layer = gd.DsaAttention(cfg, next(i for i in cfg.dsa_layers if cfg.has_indexer(i)), rngs=nnx.Rngs(0),
                            implementation="xla")
    mesh = jax.make_mesh((cp, 1), ("cp", "tp"), devices=jax.devices()[:cp])
    sh.shard_layer(layer, mesh, axis="tp", seq_axis="cp")
    step, params = make_step(layer)
    kv = sh.place_cache(bench.filled_paged_cache(layer, b, 64, cap), mesh, None, "cp")
    x = jax.numpy.zeros((b, 1, cfg.hidden_size), layer.dtype)
    mask = jax.numpy.ones((b, 1), bool)
    hlo = step.lower(params, x, mask, kv).compile().as_text()
    shapes = re.findall(r"= s32\[(\d+),1,(\d+)\]\{[^}]*\} all-gather", hlo)
    assert shapes, "no int32 all-gather of the candidates"
    k_loc = int(shapes[0][1]) // cp
    part = roofline.cp_crossing_bytes(cfg, cap, b, cp)["partials"]
    assert bench_cp.paged_crossing_bytes(cfg, b, cp, cap) == b * (cp - 1) * k_loc * 8 + part
    assert {s for s in shapes} == {(str(b), str(cp * k_loc))}


PROBES = {
    "plan --cp 4 --context 262160 --batch 3": "--cp 4: a paged cache of 3 sequences x 4,097 pages",
    "plan --page-size 6": "--page-size 6 is not a multiple of index_kpool=4",
    "plan --cp 3 --context 131072": "--cp 3: --context 131,072 is not divisible by cp x index_kpool = 3 x 4 = 12",
    "plan --cp 0": "argument --cp: must be a positive integer",
    "roofline --gpu h200 --context 4100 --cp 8": "--context 4,100 is not divisible by cp x index_kpool = 8 x 4",
    "roofline --gpu h200 --context 4096 --cp 2 --train": "--cp 2 does not go with --train",
    "roofline --gpu h200 --context 4096 --interconnect-gb-s 100": "--interconnect-gb-s needs --cp",
    "bench decode --preset tiny --contexts 64 --cp 2 --implementation pallas": "--cp 2 needs --implementation xla",
    "bench decode --preset tiny --contexts 64 --cp 2 --capacity 4096": "--capacity does not go with --cp 2",
    "bench decode --preset tiny --contexts 64 --cp 16": "--cp 16 needs 16 devices",
    "bench decode --cp -1": "argument --cp: must be a positive integer",
}


@pytest.mark.parametrize("argv", list(PROBES))
def test_bad_cp_flags_are_one_line_and_exit_2_before_any_work(argv, capsys, monkeypatch):
    for mod, name in ((bench, "run"), (bench, "filled_cache"), (bench_cp, "run")):
        monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail("bench ran"))
    assert main(argv.split()) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and PROBES[argv] in lines[0], err
    assert out == ""


def test_benchmarks_page_cp_table_is_the_model():
    """docs/benchmarks.md's ``--cp`` roofline table, recomputed: every cell (H200, batch 1)."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[1] / "docs" / "benchmarks.md").read_text()
    section = text[text.index("### Context parallelism: `--cp N`"):]
    section = section[:section.index("\n## ")]
    rows = re.findall(r"^\| ([\d,]+) \| (\d+) \| ([\d.]+) / ([\d.]+) \| ([\d.]+) \| (.*) \|$", section, re.M)
    assert len(rows) == 6
    for ctx, cp, mb, us, idx, cross in rows:
        ctx, cp = int(ctx.replace(",", "")), int(cp)
        if cp == 1:
            got = roofline.rows(FLASH, "h200", ctx, 1, phases=("decode",))
            local, link = got[:-1], []
        else:
            got = roofline.cp_rows(FLASH, "h200", ctx, 1, cp)
            local = [r for r in got[:-1] if r.limit != "interconnect"]
            link = [r for r in got if r.limit == "interconnect"]
        k = {r.kernel: r for r in got}
        assert (float(mb), float(us)) == (round(sum(r.bytes for r in local) / 1e6, 2), round(got[-1].bound_s * 1e6, 2))
        assert float(idx) == round((k["index_scores"].bytes + k["topk_pools"].bytes) / 1e6, 2)
        want = "0" if cp == 1 else (f"{sum(r.bytes for r in link) / 1e3:.1f} / "
                                    f"{sum(r.bound_s for r in link) * 1e6:.2f}")
        assert cross == want, (ctx, cp)
