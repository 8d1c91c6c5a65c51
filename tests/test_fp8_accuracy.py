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

import glm5_dsa_jax as gd
from glm5_dsa_jax.tools.cache_accuracy import measure


def test_fp8_cache_accuracy_at_4k_tokens():
    r = measure(gd.DsaConfig.preset("glm53-flash"), 4096, queries=8)
    assert r.select_k == 512
    assert r.recall >= 0.975, r
    assert r.rel_l2 <= 0.035, r
    assert r.rel_l2_same_selection <= 0.018, r
    assert r.changed > 0  # fp8 does change some picks: the harness sees a difference at all
    assert r.gap_max <= 0.3, r  # only pools that nearly tie with the cutoff change
