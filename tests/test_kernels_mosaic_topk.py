"""``topk_pools(..., implementation="mosaic")``: the Mosaic GPU kernel against the reference.

* Interpret mode (``"mosaic_interpret"``, jax >= 0.11) equals ``topk_pools_reference`` bit
  for bit on rows drawn by hypothesis with many exact ties (small integers, ``0.0`` and
  ``-0.0``), ``-inf`` / NaN (never selected), denormals and extremes, and ``n_live`` bounds
  (pools past them count as ``-inf``). Interpret mode simulates the warpgroup's threads,
  so shapes are small and examples few.
* ``lower_for_cuda`` of the kernel at the real shapes of every supported model (decode at
  batch 1 and 8 and a prefill tile, 4K / 128K / 1M-token contexts): the Mosaic GPU custom
  call is emitted, one CTA per row.
* On jax < 0.11 (no Mosaic GPU interpret mode; the Python 3.11 leg) the Mosaic tests skip
  with that reason, and the wrapper's error names the version.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from glm5_dsa_jax.model.config import DsaConfig
from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version, lower_for_cuda
from pallas_kernels.selection import (
    MosaicTopkPoolsBlockSizes, TopkPoolsBlockSizes, mask_past_live, topk_pools,
    topk_pools_reference,
)

pytestmark = pytest.mark.mosaic

NEEDS_MOSAIC = pytest.mark.skipif(
    jax_version() < MOSAIC_MIN_JAX,
    reason=f"Mosaic GPU kernels need jax >= {MOSAIC_MIN_JAX} (this is jax {jax.__version__})",
)

_SPECIAL = np.array(
    [0.0, -0.0, 0.0, -0.0, 1.0, 1.0, 2.0, -1.0, -2.0, -np.inf, -np.inf, np.inf,
     np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38],
    dtype=np.float32,
)


def _check(scores, select_k, n_live=None, **blocks):
    x = jnp.asarray(scores, jnp.float32)
    live = None if n_live is None else jnp.asarray(n_live, jnp.int32)
    got = np.asarray(topk_pools(x, select_k, implementation="mosaic_interpret", n_live=live,
                                block_sizes=MosaicTopkPoolsBlockSizes(**blocks)))
    if live is not None:
        live = jnp.broadcast_to(live[:, None] if live.ndim == 1 else live, x.shape[:2])
        x = mask_past_live(x, live)
    want = np.asarray(topk_pools_reference(x, select_k))
    assert got.shape == want.shape == scores.shape[:-1] + (select_k,) and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    return got


@st.composite
def _case(draw):
    q = draw(st.integers(1, 2))
    p = draw(st.integers(1, 260))
    k = draw(st.integers(0, p))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        s = rng.integers(-2, 3, size=(1, q, p)).astype(np.float32)  # plateaus of ties
        s[rng.random(s.shape) < 0.3] = -0.0
        s[rng.random(s.shape) < 0.2] = -np.inf
    else:
        s = rng.choice(_SPECIAL, size=(1, q, p))
    n_live = draw(st.one_of(st.none(), st.lists(st.integers(0, p + 3), min_size=q, max_size=q)))
    n_live = None if n_live is None else np.asarray([n_live], np.int32)
    blocks = draw(st.sampled_from([{"block_p": 128}, {"block_p": 128, "radix_bits": 1},
                                   {"block_p": 256, "radix_bits": 2}]))
    return s, k, n_live, blocks


@NEEDS_MOSAIC
@settings(max_examples=4, deadline=None)
@given(_case())
def test_matches_reference(case):
    scores, k, n_live, blocks = case
    _check(scores, k, n_live, **blocks)


@NEEDS_MOSAIC
def test_ties_all_neg_inf_and_past_live_rows():
    """One launch of four rows: a row of one tied value (lowest indices win, across tiles),
    an all ``-inf`` row (all ``-1``), a row where ``-inf`` leaves fewer candidates than
    ``select_k`` (``-1`` after them), and a row whose live bound cuts it to a few pools."""
    p = 300
    rows = np.zeros((1, 4, p), np.float32)
    rows[0, 1] = -np.inf
    rows[0, 2] = -np.inf
    rows[0, 2, [5, 140, 299]] = [-0.0, 1e-45, 3.0]
    rows[0, 3] = np.arange(p, dtype=np.float32)
    got = _check(rows, 40, np.array([[p, p, p, 9]], np.int32), block_p=128)
    np.testing.assert_array_equal(got[0, 0], np.arange(40))
    assert (got[0, 1] == -1).all()
    np.testing.assert_array_equal(got[0, 2, :3], [5, 140, 299])
    np.testing.assert_array_equal(got[0, 3, :9], np.arange(9))


@NEEDS_MOSAIC
def test_multi_program_path_matches_reference():
    """Rows cut into 128-pool segments (5 CTAs a row): ties across segment borders, all
    ``-inf`` rows, live bounds inside a segment and past the first, select-all."""
    rng = np.random.default_rng(7)
    s = rng.choice(np.array([0, 0, 1, 2, -np.inf, 3, -0.0], np.float32), size=(1, 4, 600))
    s[0, 2] = -np.inf
    s[0, 3] = 1.0  # one plateau of ties over every segment
    live = np.array([[600, 300, 600, 77]], np.int32)
    for k in (150, 600):
        _check(s, k, live, block_p=128, split_p=128)
    assert MosaicTopkPoolsBlockSizes(block_p=128, split_p=128).multi_program(600)


@NEEDS_MOSAIC
def test_select_zero_and_all():
    s = np.random.default_rng(1).integers(-1, 2, size=(1, 2, 130)).astype(np.float32)
    _check(s, 0, block_p=128)
    _check(s, 130, block_p=128)


@NEEDS_MOSAIC
def test_batch_vector_n_live():
    s = np.random.default_rng(2).standard_normal((2, 2, 200)).astype(np.float32)
    _check(s, 20, np.array([200, 13], np.int32), block_p=128)


# Real shapes: each supported model at decode (batch 1 and 8) and a prefill tile of 64
# queries, 4K / 128K / 1M-token contexts (P = context // index_kpool pools).
_PRESETS = ("glm53-flash", "glm5", "glm52", "deepseek-v32")
_SHAPES = [(1, 1), (8, 1), (1, 64)]
_CONTEXTS = (4096, 131072, 1 << 20)


@NEEDS_MOSAIC
@pytest.mark.parametrize("preset", _PRESETS)
def test_lowers_for_cuda_at_model_shapes(preset):
    cfg = DsaConfig.preset(preset)
    for context in _CONTEXTS:
        p = max(1, context // cfg.index_kpool)
        k = cfg.select_k(p)
        for b, q in _SHAPES:
            def fn(scores, n_live):
                return topk_pools(scores, k, implementation="mosaic", n_live=n_live)

            text = lower_for_cuda(fn, jax.ShapeDtypeStruct((b, q, p), jnp.float32),
                                  jax.ShapeDtypeStruct((b, q), jnp.int32)).as_text()
            calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
            # one launch, or 8 counting launches and a compaction on the multi-program path
            want = 9 if MosaicTopkPoolsBlockSizes().multi_program(p) else 1
            assert len(calls) == want, (preset, context, b, q, len(calls))
            assert "triton" not in text, (preset, context, b, q)


@pytest.mark.parametrize("kwargs, name", [
    ({"block_p": 64}, "block_p"),
    ({"block_p": 1000}, "block_p"),
    ({"block_p": 16384}, "block_p"),
    ({"radix_bits": 3}, "radix_bits"),
    ({"radix_bits": 8}, "radix_bits"),
    ({"split_p": 64}, "split_p"),
    ({"split_p": 1000}, "split_p"),
])
@pytest.mark.parametrize("impl", ["xla", "mosaic_interpret"])
def test_bad_block_sizes(kwargs, name, impl):
    with pytest.raises(ValueError, match=f"MosaicTopkPoolsBlockSizes.{name}"):
        topk_pools(jnp.zeros((1, 1, 8)), 2, implementation=impl,
                   block_sizes=MosaicTopkPoolsBlockSizes(**kwargs))


def test_block_sizes_must_match_the_implementation():
    with pytest.raises(TypeError, match="MosaicTopkPoolsBlockSizes"):
        topk_pools(jnp.zeros((1, 1, 8)), 2, implementation="mosaic_interpret",
                   block_sizes=TopkPoolsBlockSizes())
    with pytest.raises(TypeError, match="TopkPoolsBlockSizes"):
        topk_pools(jnp.zeros((1, 1, 8)), 2, implementation="pallas_interpret",
                   block_sizes=MosaicTopkPoolsBlockSizes())


def test_resolve_block_p_caps_at_the_row():
    assert MosaicTopkPoolsBlockSizes().resolve(5).block_p == 128
    assert MosaicTopkPoolsBlockSizes().resolve(300).block_p == 512
    assert MosaicTopkPoolsBlockSizes().resolve(1 << 20).block_p == 1024
    assert MosaicTopkPoolsBlockSizes(block_p=4096, split_p=2048).resolve(1 << 20).block_p == 2048
    assert not MosaicTopkPoolsBlockSizes().multi_program(8191)
    assert MosaicTopkPoolsBlockSizes().multi_program(8192)


@pytest.mark.skipif(jax_version() >= MOSAIC_MIN_JAX, reason="the jax < 0.11 error path")
def test_old_jax_names_the_version():
    with pytest.raises(NotImplementedError, match=r"jax >= 0\.11"):
        topk_pools(jnp.zeros((1, 1, 8)), 2, implementation="mosaic_interpret")


def test_resolve_implementation():
    from pallas_kernels._common import cuda_lowering, without_mosaic

    assert pk.resolve_implementation("auto") == "xla"  # the CPU test host
    with cuda_lowering("a100"):  # on an H100 "auto" follows the hardware record:
        assert pk.resolve_implementation("auto") == "pallas"  # tests/test_hardware_runs.py
    assert [without_mosaic(i) for i in ("mosaic", "mosaic_interpret", "pallas", "xla", "auto")] == [
        "pallas", "pallas_interpret", "pallas", "xla", "xla"]
    with pytest.raises(ValueError, match="implementation must be one of"):
        pk.resolve_implementation("triton")


@NEEDS_MOSAIC
def test_layer_on_mosaic_interpret_equals_xla():
    """A layer asked for ``"mosaic_interpret"``: Mosaic ``topk_pools``, Triton interpret for
    the steps without a Mosaic kernel; the same top-k rows and outputs as ``"xla"``."""
    import glm5_dsa_jax as gd
    from helpers import f32_layer, padded_batch

    cfg = gd.DsaConfig.tiny(index_kpool=4, index_topk=8)
    x, mask = padded_batch(cfg, (3,), 13, seed=11)
    layer = f32_layer(cfg, 1, seed=3, implementation="mosaic_interpret")
    assert layer.implementation == "mosaic_interpret"
    o1, t1 = f32_layer(cfg, 1, seed=3)(jnp.asarray(x), attention_mask=jnp.asarray(mask))
    o2, t2 = layer(jnp.asarray(x), attention_mask=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(t2), np.asarray(t1))
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), atol=2e-5, rtol=2e-5)


def test_every_mosaic_module_has_a_gpu_compile_case():
    """A ``pallas_kernels/mosaic_*.py`` module without a ``MOSAIC_KERNEL_MODULES`` entry
    would never be compiled by ``gpu_compile``."""
    import os

    from glm5_dsa_jax.tools.gpu_compile import cases

    root = os.path.dirname(pk.__file__)
    modules = {f[:-3] for f in os.listdir(root) if f.startswith("mosaic_") and f.endswith(".py")}
    assert "mosaic_selection" in modules
    assert modules <= set(cases.MOSAIC_KERNEL_MODULES), sorted(modules - set(cases.MOSAIC_KERNEL_MODULES))
    assert set(cases.MOSAIC_KERNEL_MODULES.values()) == set(cases.MOSAIC_KERNELS)
    assert set(cases.MOSAIC_LAUNCHES) == set(cases.MOSAIC_THREADS) == set(cases.MOSAIC_KERNELS)


@NEEDS_MOSAIC
def test_compiles_to_cubin_for_sm90a_and_sm100a_without_a_gpu():
    """``gpu_compile`` on the Mosaic kernel (needs the ``gpu-compile`` extra): cubin for
    sm_90a and sm_100a from the compile-only devices, no spill, no stack, its SMEM read
    from the plugin's dump; no sm_80 row (Mosaic GPU needs Hopper)."""
    from glm5_dsa_jax.tools import gpu_compile as gc

    try:
        gc.toolchain()
    except gc.ToolchainMissing as e:
        pytest.skip(f"deviceless GPU compile: {e}")
    cases = gc.default_cases(["topk_pools_mosaic"], contexts=[4096, 1 << 20], batches=[1, 8],
                             steps=["decode", "prefill"], caches=["contiguous", "paged"])
    reports = gc.compile_cases(cases, ("sm_80", "sm_90", "sm_100"))
    assert {(r.target, r.case) for r in reports} == {
        (t, c.id) for t in ("sm_90", "sm_100") for c in cases}
    assert all(r.ok for r in reports), gc.failures(reports)
    for r in reports:
        assert r.warps == 4 and r.regs > 0 and r.blocks_per_sm >= 1 and r.smem_dynamic > 0
        if "_count" not in r.kernel:  # a compacting kernel holds its SMEM tile
            assert r.smem_dynamic >= MosaicTopkPoolsBlockSizes().block_p * 4
    # 4K tokens: one program a row; 1M: counting and compaction over 2,048-pool segments
    kernels = {r.kernel for r in reports}
    assert kernels == {f"topk_pools_mosaic{k}_mosaic_gpu_kernel" for k in ("", "_count", "_compact")}


def test_layer_resolves_auto_when_built():
    import glm5_dsa_jax as gd
    from helpers import f32_layer

    cfg = gd.DsaConfig.tiny()
    assert f32_layer(cfg, 1, seed=0, implementation="auto").implementation == "xla"  # CPU host
    with pytest.raises(ValueError, match="implementation must be one of"):
        f32_layer(cfg, 1, seed=0, implementation="triton")


@NEEDS_MOSAIC
@pytest.mark.parametrize("n_pools", [256, 8192 * 4])  # the one-program path; the multi-program one
def test_lowered_kernel_compares_keys_signed(n_pools):
    """Every integer the kernel compares (order keys, lanes, counts, ids) is a signed int32,
    so its lowered Mosaic GPU code holds no unsigned comparison. Interpret mode cannot see
    this (it runs jnp's signed semantics): on an H200 the kernel compared keys unsigned (a
    select with a constant true branch took the predicate's signedness, see
    ``pallas_kernels._order_key``), so negative scores ranked above positive ones and every
    case selected wrong tokens (2026-12-04). This test fails on that kernel."""
    fn = lambda s, n: topk_pools(s, 64, implementation="mosaic", n_live=n)  # noqa: E731
    lowered = lower_for_cuda(fn, jax.ShapeDtypeStruct((2, 1, n_pools), jnp.float32),
                             jax.ShapeDtypeStruct((2, 1), jnp.int32))
    modules = pk.mosaic_modules(lowered)
    assert len(modules) == (9 if MosaicTopkPoolsBlockSizes().multi_program(n_pools) else 1)
    for text in modules:
        assert text.count('arith.cmpi"') > 16  # the parse found the kernel's comparisons
        assert pk.unsigned_compares(text) == [], pk.unsigned_compares(text)
