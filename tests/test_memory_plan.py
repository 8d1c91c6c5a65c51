"""``MemoryPlan`` / ``glm5-dsa plan --dp``: per-device weights and caches on a data x tp mesh.

The cache figures are read from the caches' shapes (``jax.eval_shape``), so they are
checked here against caches actually made; the mesh arithmetic (caches split over data,
replicated over tp; weights split over tp) and the sequences-that-fit bound against
figures computed by hand.
"""

from __future__ import annotations

import json

import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.cli import main
from glm5_dsa_jax.tools.memory_plan import cache_bytes
MemoryPlan = gd.MemoryPlan  # the public name
from glm5_dsa_jax.parallel.plan import TpPlan

TINY = gd.DsaConfig.preset("tiny")
FLASH = gd.DsaConfig.preset("glm53-flash")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layer_idx", TINY.dsa_layers)
def test_cache_bytes_are_a_real_caches_bytes(layer_idx, dtype):
    has = TINY.has_indexer(layer_idx)
    contiguous = gd.init_cache(TINY, 3, 64, has_indexer=has, dtype=dtype)
    assert cache_bytes(TINY, layer_idx, "contiguous", dtype, 3, 64) == contiguous.nbytes()
    paged = gd.init_paged_cache(TINY, 3, 3 * 2, 32, pages_per_seq=2, has_indexer=has, dtype=dtype)
    assert cache_bytes(TINY, layer_idx, "paged", dtype, 3, 64, page_size=32) == paged.nbytes()


def test_data_parallel_splits_the_cache_and_tp_the_weights():
    one = MemoryPlan(FLASH, tp=8, dp=1, batch=8, context=32_768)
    two = MemoryPlan(FLASH, tp=4, dp=2, batch=8, context=32_768)
    # data=2 holds 4 sequences per device instead of 8; tp=4 holds twice the head-split weights.
    assert two.cache_bytes() == one.cache_bytes(seqs=4)
    assert one.cache_bytes() > 1.99 * two.cache_bytes()
    want = sum(TpPlan.build(FLASH, 0, 4, layer_idx=i).local_bytes for i in FLASH.dsa_layers)
    assert two.weight_bytes == want > one.weight_bytes
    # bf16 contiguous cache: the 1,089 bytes per token of cache.py's doc (+ the per-row fields).
    assert 1088 < one.bytes_per_token() < 1090


def test_sequences_that_fit_is_the_largest_count_that_fits():
    plan = MemoryPlan(FLASH, tp=4, dp=2, batch=8, context=32_768)
    memory = 20 * 2**30
    for kind in ("contiguous", "paged"):
        n = plan.sequences_that_fit(memory, kind)
        per_group = n // plan.dp
        assert n % plan.dp == 0 and per_group > 0
        used = plan.weight_bytes + plan.cache_bytes(kind, seqs=per_group)
        over = plan.weight_bytes + plan.cache_bytes(kind, seqs=per_group + 1)
        assert used <= memory < over
    assert plan.sequences_that_fit(plan.weight_bytes // 2) == 0


@pytest.mark.parametrize("kw, field", [
    (dict(dp=3, batch=8), "batch 8 is not divisible by dp=3"),
    (dict(tp=7), "7"),
    (dict(context=10**9), "context"),
    (dict(batch=0), "batch"),
])
def test_bad_plans_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        MemoryPlan(FLASH, **kw)


def test_plan_cli_prints_the_memory_table(capsys):
    assert main(["plan", "--tp", "4", "--dp", "2", "--context", "32768", "--memory-gib", "40"]) == 0
    out = capsys.readouterr().out
    assert "mesh data=2 x tp=4" in out and "16 sequences" in out
    for row in ("contiguous bfloat16", "paged      fp8"):
        assert row in out
    assert main(["plan", "--tp", "2", "--dp", "4", "--context", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["memory"]
    plan = MemoryPlan(FLASH, tp=2, dp=4, batch=32, context=4096)
    assert d["weight_bytes_per_device"] == plan.weight_bytes
    by = {(r["cache"], r["dtype"]): r for r in d["caches"]}
    assert by["paged", "fp8"]["bytes_per_token"] <= 560 < by["paged", "bfloat16"]["bytes_per_token"]
    assert by["contiguous", "fp8"]["sequences_that_fit"] > 1.9 * by["contiguous", "bfloat16"]["sequences_that_fit"]


def test_plan_cli_refuses_a_batch_the_data_axis_does_not_divide(capsys):
    assert main(["plan", "--dp", "3", "--batch", "8"]) == 2
    assert "batch 8 is not divisible by dp=3" in capsys.readouterr().err
    assert main(["plan", "--memory-gib", "-1"]) == 2  # a usage error: one line, no exit
    assert "argument --memory-gib: must be a finite number > 0" in capsys.readouterr().err
