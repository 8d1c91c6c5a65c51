"""``scripts/gpu_check_layer.py``: the whole layer under each implementation against ``"xla"``.

* Its rules, fast: the float32 rule of prefill / decode (``judge_f32``: the output error
  and the share of float32's selected tokens missed, each within ``F32_RATIO`` of bf16
  ``"xla"``'s, or under a floor); the top-k rule (``compare_topk``) passes a swap at a tie
  and an other order, and fails a swap that no tie explains.
* The smoke run end to end, in process (``main(["--smoke", ...])``: the tiny preset in
  interpret mode, ``pallas_interpret`` and ``auto``): every part's rows present and ``ok``,
  the top-k check not vacuous (rows that choose), both gradients compared. ``e2e``: it
  compiles ~20 programs (~1-2 minutes on a 2-core CPU).
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import gpu_check_layer as gcl  # noqa: E402
from glm5_dsa_jax.tools import float32_rule  # noqa: E402


# ---------------------------------------------------------------------------- top-k
def test_topk_rule_passes_ties_and_fails_other_swaps():
    """One row, first_key 2, pools of 4 from slot 2: scores of pools 0..3, 2 kept + tail."""
    scores = np.array([[[1.0, 0.5, 0.5 + 1e-4, -np.inf]]])  # pools 1 and 2 tie; 3 incomplete
    pool = lambda j: [2 + 4 * j + r for r in range(4)]  # noqa: E731
    tail = [14, 15]
    want = np.array([[pool(0) + pool(2) + tail]])
    live = np.ones((1, 1), bool)
    check = lambda got: gcl.compare_topk(np.array([[got]]), want, live, lambda: scores, [2], 4)  # noqa: E731
    assert check(pool(0) + pool(2) + tail)["topk_rows_differ"] == 0
    res = check(pool(2) + pool(0) + tail)  # the same set in another order
    assert (res["topk_rows_differ"], res["topk_rows_order"], res["topk_rows_untied"]) == (0, 1, 0)
    res = check(pool(0) + pool(1) + tail)  # pool 1 for pool 2: a tie
    assert (res["topk_rows_differ"], res["topk_rows_untied"]) == (1, 0)
    for got in (pool(1) + pool(2) + tail,  # pool 1 for pool 0: no tie
                pool(0) + pool(2) + [14, -1],  # another tail
                pool(0) + pool(2) + pool(1)[:2],  # part of a pool as the tail
                pool(0) + pool(2)[:3] + [2] + tail):  # a token twice
        res = check(got)
        assert (res["topk_rows_differ"], res["topk_rows_untied"]) == (1, 1), got


# ---------------------------------------------------------------------------- end to end
def test_float32_rule_of_prefill_and_decode():
    """``judge_f32``: an implementation as far from float32 as bf16 ``"xla"`` (or within
    ``F32_RATIO`` of it, or under the floors) passes; one that misses more of float32's
    tokens, or whose output is farther, fails; a non-finite output fails."""
    base = dict(out_err_f32=1.0e-2, miss_f32=9e-4)
    assert gcl.judge_f32(dict(out_err_f32=9.4e-3, miss_f32=9e-4), base).startswith("ok")
    assert gcl.judge_f32(dict(out_err_f32=1.4e-2, miss_f32=1.3e-3), base).startswith("ok")
    assert gcl.judge_f32(dict(out_err_f32=1.6e-2, miss_f32=9e-4), base).startswith("MISMATCH")
    assert gcl.judge_f32(dict(out_err_f32=1.0e-2, miss_f32=2e-3), base).startswith("MISMATCH")
    assert gcl.judge_f32(dict(out_err_f32=math.inf, miss_f32=0.0), base).startswith("MISMATCH")
    # a bf16 "xla" that happens to match float32 exactly: the floors still allow rounding
    exact = dict(out_err_f32=0.0, miss_f32=0.0)
    assert gcl.judge_f32(dict(out_err_f32=5e-3, miss_f32=5e-4), exact).startswith("ok")


@pytest.mark.e2e
def test_smoke_run_on_cpu(capsys):
    assert gcl.main(["--smoke", "--json", "--impls", "pallas_interpret,auto"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["preset"] == "tiny" and report["layer"] == 1
    rows = {(r["part"], r["impl"]): r for r in report["rows"]}
    cache_parts = ("prefill", "decode", "paged prefill", "paged decode")
    grad_parts = ("grad out", "grad indexer_loss")
    for part in cache_parts:
        assert rows[part, "xla"]["check"].startswith("reference")
        row = rows[part, "pallas_interpret"]
        assert row["check"].startswith("ok vs float32"), row  # judged against float32
        d = row["details"]
        assert d["miss_f32"] <= gcl.MISS_FLOOR and d["out_err_f32"] <= gcl.OUT_FLOOR
        assert d["out_rel_err"] <= gcl.OUT_TOL and d["topk_rows_untied"] == 0
        assert d["topk_scored_rows"] > 0 and row["time_ms"] > 0  # the top-k is a real choice
    for part in grad_parts:
        assert rows[part, "xla f32"]["check"] == "reference (float32)"
        assert rows[part, "xla"]["check"].startswith("ok (bf16 baseline")
        row = rows[part, "pallas_interpret"]
        assert row["check"].startswith("ok"), row
        errs = row["details"]["errs"]
        assert errs and all(e <= float32_rule.GRAD_FLOOR or e <= float32_rule.RATIO * rows[part, "xla"]["details"]["errs"][k]
                            for k, e in errs.items())
        assert any(e > 0 for e in errs.values())  # a gradient was compared, not only zeros
    # auto: resolved to "xla" on a CPU, no kernels; its rows of the other parts skipped.
    assert rows["auto", "auto"]["check"].startswith("ok (resolved to 'xla'"), rows["auto", "auto"]
    assert rows["prefill", "auto"]["details"]["resolved"] == "xla"
    for part in cache_parts[2:] + grad_parts:
        assert rows[part, "auto"]["check"].startswith("skipped (auto resolved to 'xla'")
