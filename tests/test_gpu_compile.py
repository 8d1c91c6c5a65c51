"""Deviceless GPU compile (``glm5_dsa_jax.tools.gpu_compile``): every Pallas kernel at the
GLM-5.3-Flash shapes compiled to cubin for sm_80 and sm_90 on this CPU host.

The compile tests need the ``gpu-compile`` extra (``jax[cuda12-local]`` + ptxas) and are
skipped, naming it, only when it is not installed; a plugin whose version differs from
jaxlib's fails. Their table (registers, spills, stack, shared memory, blocks per SM) is
printed in pytest's terminal summary and written as JSON to
``.pytest_cache/d/gpu-compile/report.json`` (a pytest temporary folder without the cache
plugin; ``$GLM5_GPU_COMPILE_REPORT`` if set).
The occupancy rules, the parsers and the case table are checked without the extra.
"""

import dataclasses
import json
import os
import re

import jax.numpy as jnp
import pytest

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.tools import gpu_compile as gc
from glm5_dsa_jax.tools.gpu_compile import ptxas


# ------------------------------------------------------------------------------------
# Without the toolchain
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, threads, regs, smem, expect",
    [
        # CUDA occupancy calculator values for 4-warp blocks.
        ("sm_80", 128, 250, 57472, (2, "regs")),  # 8192 regs a warp: 2 warps a partition
        ("sm_80", 128, 160, 8192, (3, "regs")),  # 5120 a warp: 3 a partition, 12 warps
        ("sm_80", 128, 96, 8192, (5, "regs")),  # 3072: 5 a partition (not 65536 // 3072 = 21)
        ("sm_80", 128, 72, 24576, (6, "smem")),  # 167936 // (24576 + 1 KiB reserved)
        ("sm_90", 128, 72, 24576, (7, "regs")),  # 228 KiB of shared memory: 9 would fit
        ("sm_90", 128, 24, 0, (16, "threads")),
        ("sm_90", 32, 16, 0, (32, "blocks")),
        ("sm_90", 1024, 255, 0, (0, "regs")),  # 32 warps x 8192 > 65536 registers a block
        ("sm_80", 128, 32, 166913, (0, "smem")),  # one byte over the opt-in limit
    ],
)
def test_blocks_per_sm(target, threads, regs, smem, expect):
    assert gc.TARGETS[target].blocks_per_sm(threads, regs, smem) == expect


def test_target_config_names_the_gpu_and_its_limits():
    for t in gc.TARGETS.values():
        text = t.target_config()
        major, minor = t.compute_capability
        assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in text
        assert f"shared_memory_per_block_optin: {t.smem_per_block_optin}" in text
        assert f'device_description_str: "{t.device}"' in text
        assert t.name == f"sm_{major}{minor}"


def test_parse_ptxas_and_thunks():
    ptxas = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'topk_pools' for 'sm_80'
ptxas info    : Function properties for topk_pools
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 70 registers, used 1 barriers, 368 bytes cmem[0]
ptxas info    : Compiling entry function 'sparse_mla' for 'sm_90a'
ptxas info    : Function properties for sparse_mla
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem
"""
    assert gc.parse_ptxas(ptxas) == {
        "topk_pools": dict(regs=70, stack=0, spill_stores=0, spill_loads=0, smem_static=0),
        "sparse_mla": dict(regs=255, stack=16, spill_stores=12, spill_loads=8, smem_static=4096),
    }
    thunks = (
        "001: kKernel [source] loop_pad_fusion grid: [2, 1, 1] threads: [128, 1, 1]  "
        "shared_memory: 0 bytes\n"
        "002: kCustomKernel [source | sink] sparse_mla grid: [4, 16, 1] threads: [128, 1, 1]  "
        "shared_memory: 57472 bytes"
    )
    assert gc.parse_thunks(thunks) == [
        dict(kind="kKernel", name="loop_pad_fusion", grid=(2, 1, 1), threads=128, smem=0),
        dict(kind="kCustomKernel", name="sparse_mla", grid=(4, 16, 1), threads=128, smem=57472),
    ]


def test_every_pallas_module_has_a_case():
    """A kernel module that launches a ``pallas_call`` without a ``KERNELS`` entry would
    never be compiled here."""
    import pallas_kernels

    root = os.path.dirname(pallas_kernels.__file__)
    launching = {
        f[:-3] for f in os.listdir(root)
        if f.endswith(".py") and re.search(r"\bpallas_call\(", open(os.path.join(root, f)).read())
    }
    covered = {m for m, k in gc.KERNEL_MODULES.items() if k in gc.KERNELS}
    assert launching and launching <= covered, (
        f"{sorted(launching - covered)} launch pallas_call but have no "
        "gpu_compile.KERNEL_MODULES entry naming a gpu_compile.KERNELS one")
    assert set(gc.KERNEL_MODULES.values()) == set(gc.KERNELS)


def test_default_cases_cover_decode_prefill_1m_and_batches():
    cases = gc.default_cases()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    for kernel in gc.KERNELS:
        backward = kernel in gc.cases.BACKWARD_KERNELS  # training steps only
        for kind in ("decode", "prefill"):
            for b in (1, 8):
                for ctx in ("4K", "128K", "1M"):
                    assert (f"{kernel} {kind} b{b} {ctx}" in ids) == (not backward or kind != "decode")
    for kernel in gc.cases.PAGED_KERNELS:  # the paged cache's kernels, paged too
        for kind in ("decode", "prefill"):
            assert f"{kernel} {kind} b8 128K paged" in ids
    assert not any(i.startswith(("kpool_compress", "expand_selection")) and "paged" in i
                   for i in ids)
    # int8 pooled keys (an fp8 cache's index_keys="int8"): the scoring kernel only, every
    # forward step, contiguous and paged; float32 queries, [.., G] group scales last
    int8 = [c for c in cases if c.step.index_keys == "int8"]
    assert {c.kernel for c in int8} == {"index_scores"}
    assert {(c.step.kind, c.step.cache) for c in int8} == {(k, c) for k in ("decode", "prefill", "prompt")
                                                            for c in ("contiguous", "paged")}
    assert "index_scores decode b1 4K int8-keys" in ids and "index_scores decode b8 1M paged int8-keys" in ids
    cfg = gd.DsaConfig.glm53_flash()
    for cache in ("contiguous", "paged"):
        _, avals = gc.cases.KERNELS["index_scores"](cfg, gc.Step("decode", 1, 4096, cache=cache, index_keys="int8"), {})
        assert avals[0][1] == jnp.float32 and avals[2][1] == jnp.int8
        assert avals[-1] == (avals[2][0][:-1] + (cfg.index_head_dim // 32,), jnp.float32)
    step = gc.Step("decode", 1, 1 << 20)
    assert (step.chunk, step.queries) == (1, 1)
    assert (gc.Step("prefill", 8, 4096).queries, gc.Step("prompt", 1, 1 << 20).chunk) == (64, 1 << 20)


def test_switch_point_cases_sit_on_every_path_switch():
    """``SWITCH_CONTEXTS`` straddle the switches they name (GLM-5.3-Flash: 4-token pools, a
    512-pool budget): so a change of a block size or a path threshold that moves a switch
    fails here, not silently outside the compile check."""
    cfg = gd.DsaConfig.glm53_flash()
    pools = [n // cfg.index_kpool for n in gc.cases.SWITCH_CONTEXTS]
    assert pools == [16, cfg.max_select_k, 2048, 8191, 8192]
    tk = pk.TopkPoolsBlockSizes()
    assert not tk.multi_program(8191) and tk.multi_program(8192)
    assert tk.resolve(2048).block_p < 2048  # the one-program row over more than one tile
    assert pk.IndexScoresBlockSizes().resolve(1, 16).block_p == 16  # the smallest pool tile
    # a float32 dot of one query (int8 keys at decode) on a narrower tile, more warps (it spilled)
    f32 = pk.IndexScoresBlockSizes().resolve(1, 8192, float32_dot=True)
    assert (f32.block_p, f32.num_warps) == (pk.scoring.FLOAT32_DECODE_BLOCK_P, pk.scoring.FLOAT32_DECODE_WARPS)
    assert pk.IndexScoresBlockSizes().resolve(16, 8192, float32_dot=True).block_p == 64  # a prefill tile: as before
    assert {c.step.context for c in gc.switch_point_cases()} == set(gc.cases.SWITCH_CONTEXTS)
    assert {c.kernel for c in gc.switch_point_cases()} == {
        "kpool_compress", "index_scores", "topk_pools", "expand_selection", "sparse_mla"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kernels=["nope"]), "unknown kernel"),
        (dict(contexts=[0]), "contexts must be positive"),
        (dict(batches=[]), "batches must be positive"),
        (dict(steps=["train"]), "steps must be among"),
        (dict(dtypes=["float16"]), "dtypes must be among"),
        (dict(caches=["ring"]), "caches must be among"),
        (dict(index_keys=["fp4"]), "index_keys must be among"),
    ],
)
def test_default_cases_reject_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gc.default_cases(**kwargs)


def test_step_rejects_bad_fields():
    with pytest.raises(ValueError, match="Step.kind must be one of"):
        gc.Step("train", 1, 4096)
    with pytest.raises(ValueError, match="Step.context must be a positive int"):
        gc.Step("decode", 1, 0)
    with pytest.raises(ValueError, match="Step.cache must be one of"):
        gc.Step("decode", 1, 4096, cache="ring")
    with pytest.raises(ValueError, match=r"multiple of PAGE_SIZE \(64\) for a paged step"):
        gc.Step("decode", 1, 4100, cache="paged")
    with pytest.raises(ValueError, match="Step.index_keys must be one of"):
        gc.Step("decode", 1, 4096, index_keys="e5m2")


@pytest.mark.lowering
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_paged_cases_lower_for_cuda(kind):
    """The paged cases trace and lower for CUDA (no toolchain needed): the paged scorer
    over the pool pages, the live-bounded top-k and attention over the shared latent pool."""
    import jax

    import glm5_dsa_jax as gd
    from pallas_kernels._common import lower_for_cuda, triton_calls

    cfg = gd.DsaConfig.glm53_flash()
    names = {}
    for case in gc.default_cases(gc.cases.PAGED_KERNELS, contexts=[131072], batches=[8],
                                 steps=[kind], caches=["paged"]):
        fn, avals, _ = gc.cases.build(cfg, case)
        lowered = lower_for_cuda(fn, *(jax.ShapeDtypeStruct(sh, dt) for sh, dt in avals))
        names[case.kernel] = {c["name"] for c in triton_calls(lowered)}
    assert names == {"index_scores": {"index_scores_paged"},
                     "topk_pools": {"topk_pools_count", "topk_pools_compact"},
                     "sparse_mla": ({"sparse_mla", "sparse_mla_combine"} if kind == "decode"
                                    else {"sparse_mla"})}


@pytest.mark.lowering
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_rope_model_cases_lower_for_cuda(cache):
    """GLM-5's geometry (a 576-wide ``[c, k_rot]`` cache row, kpool 1 without a tail): every
    case builds and lowers, ``sparse_mla`` scoring whole rows and returning the 512 latent
    columns. (An unvalidated config: ``DsaConfig.validate`` refuses RoPE until the layer
    takes it.)"""
    import dataclasses

    import jax

    import glm5_dsa_jax as gd
    from pallas_kernels._common import lower_for_cuda, triton_calls

    cfg = dataclasses.replace(
        gd.DsaConfig.glm53_flash(), hidden_size=6144, q_lora_rank=2048, qk_nope_head_dim=192,
        qk_rope_head_dim=64, index_kpool=1, index_kpool_always_select_tail=False)
    names = {}
    for case in gc.default_cases(contexts=[131072], batches=[1], steps=["decode"],
                                 caches=[cache]):
        fn, avals, _ = gc.cases.build(cfg, case)
        lowered = lower_for_cuda(fn, *(jax.ShapeDtypeStruct(sh, dt) for sh, dt in avals))
        names[case.kernel] = {c["name"] for c in triton_calls(lowered)}
        if case.kernel == "sparse_mla":
            assert avals[0][0] == (1, 1, 64, 576) and avals[1][0][-1] == 576
            assert lowered.out_info.shape == (1, 1, 64, 512)
    assert names["sparse_mla"] == {"sparse_mla", "sparse_mla_combine"}  # a decode row is split
    assert names["topk_pools"] == {"topk_pools_count", "topk_pools_compact"}  # 131072 tokens
    assert len(names) == (6 if cache == "contiguous" else 3)


def test_toolchain_says_which_extra_is_missing(monkeypatch):
    monkeypatch.setattr(ptxas, "_version", lambda dist: None)
    with pytest.raises(gc.ToolchainMissing, match=r"jax-cuda12-plugin.*'gpu-compile' extra"):
        gc.toolchain()


def test_toolchain_refuses_a_plugin_of_another_jaxlib(monkeypatch):
    versions = {"jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda12-plugin": "0.12.0",
                "jax-cuda12-pjrt": "0.12.0"}
    monkeypatch.setattr(ptxas, "_version", versions.get)
    monkeypatch.setattr(ptxas, "find_ptxas", lambda: "/bin/true")
    with pytest.raises(RuntimeError, match="does not match jaxlib 0.10.2"):
        gc.toolchain()


def test_worker_compiles_at_the_default_optimisation_level(monkeypatch):
    # The suite's own XLA_FLAGS (conftest) turn LLVM's passes off; passed on to the worker,
    # they gave every Triton index_scores kernel a stack frame and spills (CI, 2026-12-06).
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=0 --xla_dump_to=/tmp/x")
    case = gc.default_cases(["kpool_compress"])[0]
    seen = {}

    def run(argv, *, input, env, **kwargs):
        seen["flags"] = env["XLA_FLAGS"]
        out = [{"event": "ready"}, {"event": "case", "id": case.id, "ok": True}]
        return type("Proc", (), {"stdout": "\n".join(map(json.dumps, out)), "stderr": "",
                                 "returncode": 0})()

    monkeypatch.setattr(gc.subprocess, "run", run)
    records = gc._run_worker(gc.TARGETS["sm_90"], [case], "/tmp", 10.0, {})
    assert records[case.id]["ok"]
    assert seen["flags"] == "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x"
    assert gc.worker_xla_flags("--xla_backend_optimization_level=3") == ""


# ------------------------------------------------------------------------------------
# With the toolchain: compile for sm_80 and sm_90
# ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toolchain():
    try:
        return gc.toolchain()
    except gc.ToolchainMissing as e:
        pytest.skip(f"deviceless GPU compile: {e}")


class _Summary:
    """Prints the compile table in pytest's terminal summary (shown without ``-s``)."""

    def __init__(self, title, text):
        self.title, self.text = title, text

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_sep("=", self.title)
        for line in self.text.splitlines():
            terminalreporter.write_line(line)


def _publish(request, tmp_path_factory, toolchain, reports, seconds):
    path = os.environ.get("GLM5_GPU_COMPILE_REPORT")
    if not path:
        cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
        folder = cache.mkdir("gpu-compile") if cache is not None else tmp_path_factory.mktemp("gpu-compile")
        path = str(folder / "report.json")
    with open(path, "w") as f:
        json.dump(dict(toolchain=toolchain, seconds=round(seconds),
                       reports=[dict(dataclasses.asdict(r), ok=r.ok) for r in reports]), f, indent=1)
    text = (f"jax {toolchain['jax']}, jax-cuda12-plugin {toolchain['jax-cuda12-plugin']}, "
            f"ptxas {toolchain['ptxas_version']}; {len(reports)} launches in {seconds:.0f} s; "
            f"every row: {path}\n" + gc.format_table(reports, compact=True))
    bad = gc.failures(reports)
    title, text = "deviceless GPU compile (sm_80, sm_90)", text + ("\n\n" + bad if bad else "")
    # Under pytest-xdist this runs in a worker, whose summary is not shown: conftest's
    # summary hook prints this file on the controller.
    with open(os.path.splitext(path)[0] + ".txt", "w") as f:
        f.write(title + "\n" + text)
    if not hasattr(request.config, "workerinput"):
        request.config.pluginmanager.register(_Summary(title, text))


@pytest.fixture(scope="module")
def matrix(toolchain):
    """``(cases, reports, seconds)``: ``default_cases()`` and ``switch_point_cases()`` (every
    row-length class of every forward kernel) compiled for sm_80 and sm_90, once for the
    tests that read it (a worker process per target and ~2 minutes of CPU each)."""
    import time

    cases = gc.default_cases()
    cases += [c for c in gc.switch_point_cases() if c.id not in {d.id for d in cases}]
    t0 = time.time()
    reports = gc.compile_cases(cases, ("sm_80", "sm_90"))
    return cases, reports, time.time() - t0


@pytest.mark.compile_matrix
def test_every_kernel_compiles_for_sm80_and_sm90(toolchain, matrix, request, tmp_path_factory):
    cases, reports, seconds = matrix
    _publish(request, tmp_path_factory, toolchain, reports, seconds)
    bad = [r for r in reports if not r.ok]
    assert not bad, "\n" + gc.failures(reports)
    # Every case of every kernel on both targets reported at least one Triton launch.
    seen = {(r.target, r.case) for r in reports}
    assert seen == {(t, c.id) for t in ("sm_80", "sm_90") for c in cases}
    assert all(r.regs and r.blocks_per_sm >= 1 and r.smem is not None for r in reports)


@pytest.mark.compile_matrix
def test_index_scores_backward_compiles_for_sm80_and_sm90(matrix):
    """The scoring backward's two kernels (issue 24) at GLM-5.3-Flash's training shapes, a
    prefill chunk's query tile over a 128K-token cache and a decode step: both launch, no
    spill on either target. Read from the matrix's reports (``matrix``: the same cases,
    compiled once for both tests)."""
    cases = [gc.Case("index_scores_backward", gc.Step(kind, b, 131072))
             for kind, b in (("prefill", 8), ("decode", 1))]
    ids = {c.id for c in cases}
    assert ids <= {c.id for c in matrix[0]}
    reports = [r for r in matrix[1] if r.case in ids]
    assert all(r.ok for r in reports), "\n" + gc.failures(reports)
    assert {(r.target, r.case, r.kernel) for r in reports} == {
        (t, c.id, k) for t in ("sm_80", "sm_90") for c in cases
        for k in ("index_scores_backward_dq", "index_scores_backward_dk")}
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in reports)


@pytest.mark.lowering
def test_spills_and_shared_memory_over_the_limit_fail(toolchain):
    """The check can fail: sparse_mla with blocks of 64 ids spills (255 registers are not
    enough), with blocks of 256 it asks for more shared memory than an SM has, and XLA
    refuses to compile it."""
    spill, smem = (gc.Case("sparse_mla", gc.Step("decode", 1, 131072), (("block_w", w),))
                   for w in (64, 256))
    reports = {r.case: r for r in gc.compile_cases([spill, smem], ("sm_90",))
               if r.kernel != "sparse_mla_combine"}  # the split merge's launch compiles
    assert "SPILL" in reports[spill.id].problems and reports[spill.id].spill_stores > 0
    assert reports[smem.id].problems == ("COMPILE",)
    assert "Shared memory size limit exceeded" in reports[smem.id].error


# ------------------------------------------------------------------------------------
# Mosaic GPU kernels (jax >= 0.11): sm_90a at every supported model's shapes
# ------------------------------------------------------------------------------------

#: Presets whose Mosaic scoring / attention shapes differ (glm52's equal glm5's: checked).
_MOSAIC_PRESETS = ("glm53-flash", "glm5", "deepseek-v32")

#: The kernels that spill on jax 0.11's Mosaic GPU pipeline (0.11.2, ptxas 12.9; each at 255
#: registers): the same kernels compile without a spill on jax 0.12. Measured with the CUDA
#: 12 plugin, sm_90a, 128K tokens: sparse_mla 28-148 bytes a thread, its backward's dq
#: 244-644 and dlatent 448-776 (glm53-flash .. deepseek-v32 / glm5 shapes). Not an API
#: difference (the kernels trace and lower alike on both); a slower kernel, not a wrong one.
_SPILL_ON_JAX_011 = frozenset({"mosaic_sparse_mla_mosaic_gpu_kernel", "mosaic_sparse_mla_dq_mosaic_gpu_kernel",
                               "mosaic_sparse_mla_dlatent_mosaic_gpu_kernel"})


def _check_mosaic_reports(reports):
    """Every report ok; on jax 0.11 a strict xfail when the only faults are the spills of
    ``_SPILL_ON_JAX_011`` (any other fault, or those kernels clean, still fails)."""
    from pallas_kernels._common import jax_version

    bad = [r for r in reports if not r.ok]
    if jax_version() < (0, 12) and bad and all(
            r.kernel in _SPILL_ON_JAX_011 and set(r.problems) <= {"SPILL", "STACK"} for r in bad):
        pytest.xfail("jax 0.11's Mosaic GPU pipeline spills the sparse_mla kernels (not 0.12's):\n"
                     + gc.failures(bad))
    if jax_version() < (0, 12):
        assert not {r.kernel for r in reports} & _SPILL_ON_JAX_011 or bad, (
            "the sparse_mla kernels no longer spill on jax 0.11: drop _SPILL_ON_JAX_011")
    assert not bad, gc.failures(bad)


@pytest.mark.mosaic
def test_mosaic_kernels_exist_per_target():
    """Mosaic kernels from sm_90 on; the wgmma ones (scoring, attention) not on sm_100
    (Blackwell has tcgen05 MMAs, no wgmma: LLVM cannot select them for sm_100a)."""
    on = gc.cases.mosaic_on_target
    assert all(on(k, (8, 0)) for k in gc.KERNELS)
    assert not any(on(k, (8, 0)) for k in gc.MOSAIC_KERNELS)
    assert all(on(k, (9, 0)) for k in gc.MOSAIC_KERNELS)
    assert {k for k in gc.MOSAIC_KERNELS if on(k, (10, 0))} == {"topk_pools_mosaic"}
    # CUDA launch grids: Pallas' (q tiles, B, pool tiles) reversed; (rows, heads, vb, splits)
    # with the leading two flattened, reversed.
    import glm5_dsa_jax as gd

    cfg = gd.DsaConfig.glm53_flash()
    step = gc.Step("prefill", 8, 131072)
    assert gc.cases.MOSAIC_LAUNCHES["index_scores_mosaic"](cfg, step, {}) == {
        "mosaic_index_scores": (131072 // 4 // 64, 8, 64 // 8)}
    assert gc.cases.MOSAIC_LAUNCHES["sparse_mla_mosaic"](cfg, step, {}) == {
        "mosaic_sparse_mla": (1, 512 // 128, 8 * 64)}
    # The backward: dq (rows, heads, column blocks of 128 of CR 512) and dlatent (row tiles
    # of 64 of the 8 x 128K rows, column blocks); dq / dw (queries, B, heads), dpooled.
    assert gc.cases.MOSAIC_LAUNCHES["sparse_mla_backward_mosaic"](cfg, step, {}) == {
        "mosaic_sparse_mla_dq": (512 // 128, 1, 8 * 64),
        "mosaic_sparse_mla_dlatent": (512 // 128, 8 * 131072 // 64, 1)}
    assert gc.cases.MOSAIC_LAUNCHES["index_scores_backward_mosaic"](cfg, step, {}) == {
        "mosaic_index_scores_dq": (1, 8, 64), "mosaic_index_scores_dpooled": (8, 131072 // 4 // 64, 1)}


@pytest.mark.mosaic
def test_mosaic_shapes_of_glm52_are_glm5s():
    import glm5_dsa_jax as gd

    fields = ("index_n_heads", "index_head_dim", "index_kpool", "num_attention_heads",
              "kv_cache_dim", "kv_lora_rank", "out_width", "tail_width")
    a, b = gd.DsaConfig.preset("glm5"), gd.DsaConfig.preset("glm52")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]


@pytest.mark.lowering
@pytest.mark.mosaic
@pytest.mark.parametrize("preset", _MOSAIC_PRESETS)
def test_mosaic_kernels_compile_for_sm90a(toolchain, preset):
    """The Mosaic ``index_scores`` (contiguous and paged) and ``sparse_mla`` of ``preset``
    compiled to sm_90a cubin without a GPU: decode at batch 1 and 8 at 128K tokens and a
    prefill chunk, contiguous and paged caches; no spill, no stack, one CTA fits an SM.
    No sm_100 row (see ``test_mosaic_kernels_exist_per_target``)."""
    from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version

    if jax_version() < MOSAIC_MIN_JAX:
        pytest.skip(f"Mosaic GPU kernels need jax >= {MOSAIC_MIN_JAX}")
    kernels = ["index_scores_mosaic", "sparse_mla_mosaic"]
    cases = [c for c in gc.mosaic_cases(contexts=[131072], batches=[1, 8],
                                        steps=["decode", "prefill"])
             if c.kernel in kernels and not (c.step.kind == "prefill" and c.step.batch == 8)]
    assert len(cases) == 2 * 3 * 2
    reports = gc.compile_cases(cases, ("sm_90", "sm_100"), config={"preset": preset})
    assert {(r.target, r.case) for r in reports} == {("sm_90", c.id) for c in cases}
    names = {r.kernel for r in reports}
    assert names == {f"mosaic_{k}_mosaic_gpu_kernel"
                     for k in ("index_scores", "index_scores_paged", "sparse_mla")}
    _check_mosaic_reports(reports)
    for r in reports:
        assert r.warps == 4 and 0 < r.regs <= 255 and r.blocks_per_sm >= 1 and r.smem_dynamic > 0


@pytest.mark.lowering
@pytest.mark.mosaic
@pytest.mark.parametrize("preset", ["glm53-flash", "glm5"])
def test_mosaic_backward_kernels_compile_for_sm90a(toolchain, preset):
    """The Mosaic backward kernels (``sparse_mla``'s dq and dlatent, ``index_scores``' dq /
    dw and dpooled) of ``preset`` (CR 512 and 576: the latter fills the most shared memory)
    compiled to sm_90a cubin at a training step (a prefill chunk's query tile), contiguous
    and paged, and at one query row (the shape that once made ptxas spill the dlatent
    kernel); no spill, no stack, one CTA fits an SM. (deepseek-v32's shapes, 128 heads,
    compile alike: 229 registers; not run here.)"""
    from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version

    if jax_version() < MOSAIC_MIN_JAX:
        pytest.skip(f"Mosaic GPU kernels need jax >= {MOSAIC_MIN_JAX}")
    kernels = ["sparse_mla_backward_mosaic", "index_scores_backward_mosaic"]
    cases = [c for c in gc.mosaic_cases(contexts=[131072], batches=[1], steps=["prefill"])
             if c.kernel in kernels]
    assert len(cases) == 2 * 2
    cases.append(gc.Case("sparse_mla_backward_mosaic", gc.Step("decode", 1, 131072)))
    reports = gc.compile_cases(cases, ("sm_90",), config={"preset": preset})
    assert {r.kernel for r in reports} == {
        f"mosaic_{k}_mosaic_gpu_kernel"
        for k in ("sparse_mla_dq", "sparse_mla_dlatent", "index_scores_dq", "index_scores_dpooled")}
    _check_mosaic_reports(reports)
    for r in reports:
        assert r.warps == 4 and 0 < r.regs <= 255 and r.blocks_per_sm >= 1 and r.smem_dynamic > 0
