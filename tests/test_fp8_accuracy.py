"""The fp8 cache's accuracy figures (``glm5_dsa_jax.tools.cache_accuracy``, README "fp8 caches")
kept from regressing, at GLM-5.3-Flash geometry with trained-like weights, 4,096 tokens.

Measured (``glm5-dsa accuracy --contexts 4096``, seed 0, 16 queries): recall 0.989, output
relative L2 0.021 (0.010 over the bf16 selection: the e4m3 rows' own error), every changed
pool within 0.12 score standard deviations of the bf16 cutoff. The
bounds below leave a margin for float rounding across jax versions and catch what breaks
an fp8 cache: a lost or misapplied scale (recall ~0.5, error ~1), a quantisation without
its per-row scale (error several times larger), or a selection that changes away from the
cutoff. The same harness with a float32 cache against the bf16 one gives recall 0.999 and
error 0.007: most of fp8's error is its 3 mantissa bits, as expected.
"""

from __future__ import annotations

import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.tools.cache_accuracy import ACCURATE_FORMAT, DEFAULT_FORMAT, measure_formats


@pytest.mark.slow
def test_fp8_cache_accuracy_at_4k_tokens():
    """The default format (e4m3 keys) and int8 + rotated keys (``ACCURATE_FORMAT``; measured
    at 16 queries: recall 0.9973, every changed pool within 0.026 standard deviations of the
    cutoff) on one prompt and bf16 reference."""
    r, acc = measure_formats(gd.DsaConfig.preset("glm53-flash"), 4096, (DEFAULT_FORMAT, ACCURATE_FORMAT), queries=8)
    assert acc.recall >= 0.99 and acc.recall > r.recall, (r, acc)
    assert acc.gap_max <= 0.1 and acc.rel_l2_same_selection == r.rel_l2_same_selection, acc
    assert r.select_k == 512
    assert r.recall >= 0.975, r
    assert r.rel_l2 <= 0.035, r
    assert r.rel_l2_same_selection <= 0.018, r
    assert r.changed > 0  # fp8 does change some picks: the harness sees a difference at all
    assert r.gap_max <= 0.3, r  # only pools that nearly tie with the cutoff change


@pytest.mark.slow
def test_formats_at_hidden_state_scales_on_a_rope_model():
    """The x1e6 collapse of one scale a RoPE row, and the group layout keeping the output:
    ``measure_formats`` on a small RoPE model (64 tokens; trained-like weights, whose 10x
    outlier channels cost a 24-wide group precision). Measured rel L2 at x1e6 (the same
    selection as bf16 in both: the indexer's keys are not the latent rows): row 0.98 (``c``
    rounded away), group 0.19."""
    from helpers import rope_tiny
    from glm5_dsa_jax.tools.cache_accuracy import measure_formats
    row, group = measure_formats(rope_tiny(), 64, ("row", "group"), queries=8, x_scale=1e6)
    assert (row.format, group.format, row.x_scale) == ("row", "group", 1e6)
    assert row.rel_l2_same_selection > 0.9 and group.rel_l2_same_selection < 0.25, (row, group)


@pytest.mark.slow
def test_accuracy_cli_rows_per_context_scale_and_format(capsys):
    """``glm5-dsa accuracy --formats --scales --json`` at the tiny preset: one row per
    (context, scale, format), in that order; a bad format or scale is a usage error."""
    import json
    from glm5_dsa_jax.cli import main
    assert main(["accuracy", "--preset", "tiny", "--contexts", "48", "--queries", "8", "--scales", "1,1e4",
                 "--formats", "row,group+int8+hadamard", "--json", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["context"], r["x_scale"], r["format"]) for r in rows] == [
        (48, 1.0, "row"), (48, 1.0, "group+int8+hadamard"), (48, 1e4, "row"), (48, 1e4, "group+int8+hadamard")]
    assert all(0 <= r["recall"] <= 1 and r["rel_l2"] >= 0 for r in rows)
    for bad, says in ((["--formats", "row,block"], "--formats: expected comma-separated formats of row, group"),
                      (["--scales", "1,0"], "--scales: must be a finite number > 0, got 0")):
        assert main(["accuracy", "--preset", "tiny", "--contexts", "48", *bad]) == 2
        assert says in capsys.readouterr().err
