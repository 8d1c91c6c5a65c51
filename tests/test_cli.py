"""The command line: the demo (default and from a checkpoint), the decode and train benchmarks, and
the probes of a CLI that explains itself (help, one-line usage errors, no CUDA traceback)."""

import argparse
import importlib.util
import re
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.tools import bench, bench_train, float32_rule
from glm5_dsa_jax.cli import main
from glm5_dsa_jax.decode import make_step
from helpers import f32_layer


def test_demo_default_runs_in_a_fresh_process():
    env = dict(os.environ, XLA_FLAGS="")
    r = subprocess.run([sys.executable, "-m", "glm5_dsa_jax.cli", "demo", "--steps", "4"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "selected token slots" in out
    # The default prompt (48 tokens at tiny) is sparse, and each query says what it read.
    assert re.search(r"seq 0 \(first_key 0, read (1[6-9]) of 48 visible tokens", out), out
    assert "sparse kernel vs dense masked attention on the same tokens: max |diff|" in out
    assert "tokens/s" in out


@pytest.mark.e2e
def test_demo_from_an_orbax_checkpoint(tmp_path, capsys):
    cfg = gd.DsaConfig.tiny()
    layers = {i: f32_layer(cfg, i, seed=i) for i in cfg.dsa_layers}
    gd.save_checkpoint(layers, tmp_path / "ckpt")
    assert main(["demo", "--checkpoint", str(tmp_path / "ckpt"), "--steps", "2", "--prompt", "12"]) == 0
    out = capsys.readouterr().out
    assert "layer 1 (full indexer) + layer 2 (shared)" in out


@pytest.mark.e2e
def test_bench_decode_json(capsys):
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64,256", "--batch", "1",
                 "--iters", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = res["rows"]
    assert {r["impl"] for r in rows} >= {"sparse", "dense", "dense_fit", "sparse_attn", "dense_attn", "index"}
    base = {"impl", "batch", "context", "median_ms", "compiles", "peak_bytes", "cache", "capacity",
            "cache_dtype"}
    floor = {"floor_bytes", "floor_flops", "floor_matmul_dtype", "floor_read_ms", "floor_compute_ms", "floor_ms",
             "floor_limit", "x_floor"}
    for r in rows:
        assert set(r) == (base if r["impl"] == "hf" else base | floor)
        if "floor_ms" in r:
            assert r["x_floor"] == r["median_ms"] / r["floor_ms"]
            read = r["floor_bytes"] / (res["read_gb_s"] * 1e9) * 1e3
            compute = r["floor_flops"] / (res["matmul_gflop_s"][r["floor_matmul_dtype"]] * 1e9) * 1e3
            # The attention part multiplies bf16 rows; a step, from one row, bf16 weights
            # (the CPU policy's contraction-last copies).
            assert r["floor_matmul_dtype"] == "bfloat16", r
            assert (r["floor_read_ms"], r["floor_compute_ms"]) == (pytest.approx(read), pytest.approx(compute))
            assert r["floor_ms"] == max(r["floor_read_ms"], r["floor_compute_ms"]) and r["floor_flops"] > 0
            assert r["floor_limit"] == ("memory" if r["floor_read_ms"] >= r["floor_compute_ms"] else "compute")
    assert set(res["matmul_gflop_s"]) == {"float32", "bfloat16"} and min(res["matmul_gflop_s"].values()) > 0
    assert res["read_gb_s"] > 0 and not res["float32_compute"]  # a CPU: bf16 copies, no float32 ones
    assert res["weight_bytes_step"] == {"1": res["weight_bytes_stored"]}
    # HF eager rows need torch (absent on the Python 3.12 leg, where the bench says so).
    want_hf = [64, 256] if importlib.util.find_spec("torch") else []
    assert [r["context"] for r in rows if r["impl"] == "hf"] == want_hf
    sparse = [r for r in rows if r["impl"] == "sparse"]
    assert [r["context"] for r in sparse] == [64, 256]
    assert all(r["compiles"] == 1 for r in sparse)  # one compilation across contexts
    assert 0 < res["cache_bytes_per_token"] < 200
    # Capacity: by default the largest context plus the timed steps, for the sparse row and
    # the dense row it is compared with; dense_fit is sized to its context.
    assert res["capacity"] == 256 + 2 + 2
    for r in rows:
        want = {"hf": ("dynamic", r["context"]), "dense_fit": ("contiguous", r["context"] + 4)}.get(
            r["impl"], ("contiguous", 260))
        assert (r["cache"], r["capacity"]) == want, r
    dense = [r for r in rows if r["impl"] == "dense"]
    assert all(r["compiles"] == 1 for r in dense)


@pytest.mark.e2e
def test_bench_train_json(capsys):
    assert main(["bench", "train", "--preset", "tiny", "--tokens", "64,256", "--iters", "1",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    impls = ("sparse", "dense_mask", "indexer_loss_dense", "indexer_loss_sparse")
    assert set(res["measures"]) == set(impls) == set(bench_train.ROWS)
    rows = {(r["impl"], r["tokens"]): r for r in res["rows"]}
    assert set(rows) == {(i, s) for i in impls for s in (64, 256)}
    for r in rows.values():
        assert r["batch"] == 1 and r["note"] == "" and r["median_ms"] > 0, r
        assert r["temp_bytes"] > 0 and r["temp_bytes_per_token"] == r["temp_bytes"] / r["tokens"]
    # The dense mask's scores [S, H, S] grow with the square of the context, per token too.
    per_token = {k: r["temp_bytes_per_token"] for k, r in rows.items()}
    assert per_token["dense_mask", 256] > 2 * per_token["dense_mask", 64]
    assert rows["dense_mask", 256]["temp_bytes"] > rows["sparse", 256]["temp_bytes"]
    # The dense indexer loss is taken in query tiles: no [S, S] tensor, flat per token.
    assert per_token["indexer_loss_dense", 256] < 1.2 * per_token["indexer_loss_dense", 64]


@pytest.mark.e2e
def test_bench_train_rows_over_the_memory_limit_are_compiled_not_run(capsys):
    assert main(["bench", "train", "--preset", "tiny", "--tokens", "32", "--iters", "1",
                 "--max-gib", "0.0001"]) == 0
    out = capsys.readouterr().out
    assert "sparse: jitted jax.value_and_grad" in out and "dense_mask: the same parameters" in out
    assert "indexer_loss_dense: jitted jax.value_and_grad of the layer's dense indexer loss" in out
    assert out.count("not run: needs") == 8  # four rows, each logged and in the table


@pytest.mark.slow
def test_bench_train_dense_mask_is_the_same_function():
    """The baseline computes the sparse layer's loss and gradients (same parameters, same
    selection), float32 at tiny shapes: only the formulation differs."""
    layer = bench_train.train_layer("tiny", dtype=jnp.float32)
    cfg = layer.cfg
    x = jax.random.normal(jax.random.key(0), (2, 40, cfg.hidden_size), jnp.float32)
    g = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    sparse, params = bench_train.sparse_step(layer)
    dense, _ = bench_train.dense_mask_step(layer)
    _, topk = layer(x)
    (ls, gs), (ld, gdn) = sparse(params, x, g), dense(params, x, g, topk)
    np.testing.assert_allclose(ld, ls, rtol=1e-5)
    for name in ("q_a_proj", "q_b_proj", "w_uk", "w_uv", "o_proj", "kv_a_proj"):
        a, b = np.asarray(gs[name][...]), np.asarray(gdn[name][...])
        assert np.abs(a).max() > 0, name
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-5 * np.abs(a).max(), err_msg=name)


@pytest.mark.e2e
def test_train_indexer_json_resume_and_refusals(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train-indexer", "--warmup-steps", "2", "--sparse-steps", "0", "--tokens", "32", "--batch", "1",
            "--out", str(out)]
    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["stage"] for r in res["records"]] == ["dense", "dense"] and res["start_step"] == 0
    assert 0 < res["before"]["captured"] <= 1 and res["after"]["queries"] == res["before"]["queries"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["layer", "run.json", "state"]
    # A new run into it, or a resume with other settings: one line, exit 2, nothing changed.
    listing = sorted(str(p) for p in out.rglob("*"))
    assert main(argv) == 2
    _one_line_error(capsys.readouterr().err, "holds a run (pass --resume to continue it)")
    assert main(argv[:6] + ["40"] + argv[7:] + ["--resume"]) == 2
    _one_line_error(capsys.readouterr().err, "--resume: the run in")
    assert sorted(str(p) for p in out.rglob("*")) == listing
    # Resuming the finished run: no step left, the same report (the table).
    assert main(argv + ["--resume"]) == 0
    text = capsys.readouterr().out
    assert "resumed at step 2" in text and f"after {res['after']['captured']:.3f}" in text
    # The trained layer is a checkpoint: a new run from it re-initialises the indexer (the
    # same seed, so the same random indexer) over the checkpoint's attention, which is the
    # seed-0 tiny layer's: the same 'before' figure, from the checkpoint's parameters.
    again = tmp_path / "again"
    assert main(argv[:-2] + ["--checkpoint", str(out / "layer"), "--out", str(again), "--json"]) == 0
    res2 = json.loads(capsys.readouterr().out)
    assert res2["settings"]["source"].startswith(f"checkpoint {out / 'layer'}")
    assert res2["before"] == res["before"] and [r["loss"] for r in res2["records"]] == [r["loss"] for r in res["records"]]


@pytest.mark.e2e
def test_gpu_check_train_runs_on_cpu():
    """The training rows of scripts/gpu_check.py (scripts/gpu_check_train.py) on tiny shapes
    in interpret mode, in bf16 as on a GPU: selection, the kernels' vjp rows judged by the
    float32 rule (each operand's gradient; the bf16 ``"xla"`` baseline's own check) with the
    comparison with bf16 xla beside it, the layer's bench rows and its gradients against
    xla's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu_check.py")
    r = subprocess.run([sys.executable, script, "--train", "--smoke", "--tokens", "32", "--dtype", "bfloat16",
                        "--json"], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["ok"] and res["preset"] == "tiny" and res["tokens"] == [32] and res["impl"] == ["pallas_interpret"]
    checks = {(row["kernel"], row["impl"]): row["check"] for row in res["rows"]}
    errs = {(row["kernel"], row["impl"]): row.get("errs_f32") for row in res["rows"]}
    for kernel, operands in (("sparse_mla", {"q", "latent"}), ("index_scores", {"q", "w", "pooled"})):
        assert checks[kernel, "xla"].startswith("reference, vs float32: ok (bf16 baseline"), checks
        assert checks[kernel, "pallas_interpret"].startswith("ok (worst "), checks
        assert "vs float32; vs bf16 xla: ok (max err" in checks[kernel, "pallas_interpret"], checks
        assert set(errs[kernel, "pallas_interpret"]) == operands and all(
            0 < e <= max(float32_rule.RATIO * errs[kernel, "xla"][k], float32_rule.KERNEL_FLOOR)
            for k, e in errs[kernel, "pallas_interpret"].items()), errs
    assert checks["layer grads", "pallas_interpret"].startswith("ok (max err"), checks
    assert {("layer", "sparse"), ("layer", "dense_mask")} <= set(checks)
    for row in res["rows"]:
        if row["kernel"] in ("sparse_mla", "index_scores"):
            assert row["fwd_us"] > 0 and row["fwd_bwd_us"] > 0 and row["bound_us"] > 0, row
    r = subprocess.run([sys.executable, script, "--train", "--tokens", "5000", "--smoke"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "exceed max_position_embeddings=4,096" in r.stderr


def test_bench_decode_capacity(capsys):
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64", "--batch", "1",
                 "--iters", "1", "--capacity", "512", "--hf-max-context", "0", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["capacity"] == 512
    caps = {r["impl"]: r["capacity"] for r in res["rows"]}
    assert caps == {"sparse": 512, "dense": 512, "dense_fit": 67, "sparse_attn": 512, "dense_attn": 512,
                    "index": 512}
    # Too small for the context and the timed steps: a usage error before any work.
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64", "--iters", "1",
                 "--capacity", "65"]) == 2
    assert "need at least 66 tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_decode_loop_column(capsys):
    """``--loop-steps``: the whole-step rows carry the step's time inside one program beside
    the per-call median, with its ratio to the floor (the default on a GPU). A tiny step's
    2 steps lie within this CPU's noise: a row may have no
    reading (None, a dash in the table), never a zero; ``timing.step_loop_ms`` reads a step
    that costs more (tests/test_gpu_check_timing.py)."""
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64", "--batch", "1", "--iters", "1",
                 "--loop-steps", "2", "--hf-max-context", "0", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    looped = {r["impl"]: r for r in res["rows"] if "loop_ms" in r}
    assert set(looped) == {"sparse", "dense", "dense_fit"}
    for r in looped.values():
        if r["loop_ms"] is None:
            assert r["x_floor_loop"] is None
        else:
            assert r["loop_ms"] > 0 and r["x_floor_loop"] == r["loop_ms"] / r["floor_ms"]
    assert res["rates_source"] == "measured"  # a CPU: no table


def test_bench_times_compared_rows_in_rounds():
    # time_steps_rounds: one step of each cache per round, in turn, each cache threaded
    # through its own steps (warm-up + timed); one median per cache.
    calls = []

    def step(inc, cache):
        calls.append(int(cache[0]))
        return cache[1:2], cache + inc

    caches = [jnp.array([0, 0]), jnp.array([100, 0]), jnp.array([200, 0])]
    ms = bench.time_steps_rounds(step, (1,), caches, iters=3, warmup=2)
    assert len(ms) == 3 and all(t > 0 for t in ms)
    assert calls == [0, 100, 200, 1, 101, 201, 2, 102, 202, 3, 103, 203, 4, 104, 204]
    assert bench.time_steps(step, (10,), jnp.array([7, 0]), iters=2) > 0 and calls[-3:] == [7, 17, 27]


def test_bench_dense_attention_is_the_sparse_arithmetic_over_every_row():
    # The dense rows' attention (bench.dense_mla_decode): the sparse step's "xla" arithmetic
    # (bf16 products into float32) over every allowed row, without the gather; bit for bit
    # sparse_mla's outputs given every allowed row as its ids, and within bf16 rounding of
    # the float32 oracle. Masked rows hold random rows: they add nothing.
    kq, kl, km = jax.random.split(jax.random.key(3), 3)
    b, n, h, c = 3, 70, 4, 40
    q = jax.random.normal(kq, (b, 1, h, c)).astype(jnp.bfloat16)
    lat = jax.random.normal(kl, (b, n, c)).astype(jnp.bfloat16)
    mask = jax.random.bernoulli(km, 0.6, (b, 1, n)).at[:, :, 0].set(True)
    out = bench.dense_mla_decode(q, lat, mask, scale=0.3)
    assert out.dtype == jnp.bfloat16 and out.shape == (b, 1, h, c)
    ids = jnp.where(mask, jnp.arange(n), -1)
    sparse = pk.sparse_mla(q, lat, ids, scale=0.3, implementation="xla")
    o32, s32 = np.asarray(out, np.float32), np.asarray(sparse, np.float32)
    np.testing.assert_array_equal(o32, s32)
    oracle = np.asarray(pk.mla_masked_attention(q, lat, mask, scale=0.3), np.float32)
    np.testing.assert_allclose(o32, oracle, rtol=2 ** -7, atol=2 ** -8)
    # float32 operands: the oracle itself
    q32, l32 = q.astype(jnp.float32), lat.astype(jnp.float32)
    np.testing.assert_array_equal(bench.dense_mla_decode(q32, l32, mask, scale=0.3),
                                  pk.mla_masked_attention(q32, l32, mask, scale=0.3))


def test_bench_times_dense_attention_alone(monkeypatch):
    # A context's dense_attn call is timed in a group of its own, before the sparse_attn and
    # index calls' rounds: XLA frees a call's scratch while the next call runs, and the
    # dense call's (gigabytes at 131K, batch 8) made the call after it 4-5x slower.
    traced_dense = []
    real_dense = bench.dense_mla_decode
    monkeypatch.setattr(bench, "dense_mla_decode",
                        lambda *a, **k: traced_dense.append(1) or real_dense(*a, **k))
    groups = []

    def fake_rounds(calls, iters, warmup=1):
        group = []
        for call in calls:  # each once: a jitted call traces its function the first time
            n = len(traced_dense)
            call()
            group.append("dense" if len(traced_dense) > n else "other")
        groups.append(group)
        return [1.0] * len(calls)

    monkeypatch.setattr(bench, "_time_rounds", fake_rounds)
    cfg = gd.DsaConfig.tiny()
    layer = gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0))
    cache = bench.filled_cache(layer, 1, 40, 64)
    rows = bench._attention_rows(layer, cache, cache, 1, 40, 1, lambda s: None, 64)
    assert groups == [["dense"], ["other", "other"]]
    assert [r["impl"] for r in rows] == ["sparse_attn", "dense_attn", "index"]


@pytest.mark.e2e
def test_bench_decode_paged_at_two_capacities(capsys):
    # --capacity A,B: each context's sparse row at both pool sizes, timed in one set of
    # rounds (issue 48's check: the same live tokens, a larger pool); the others at A.
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64", "--batch", "1",
                 "--iters", "1", "--cache", "paged", "--capacity", "128,1024", "--hf-max-context", "0",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["capacity"] == 128 and res["capacities"] == [128, 1024]
    rows = {(r["impl"], r["capacity"]) for r in res["rows"]}
    assert rows == {("sparse", 128), ("sparse", 1024), ("dense", 128), ("dense_fit", 67)}
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64", "--batch", "1", "--iters", "1",
                 "--cache", "paged", "--capacity", "128,1000"]) == 2  # not whole pages: refused first
    assert "--capacity: capacity 1000 is not a whole number of 64-token pages" in capsys.readouterr().err


@pytest.mark.e2e
def test_bench_decode_paged_json(capsys):
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64,130", "--batch", "2",
                 "--iters", "1", "--cache", "paged", "--hf-max-context", "0", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    # Default capacity: 130 + 1 + 2 tokens, rounded up to whole 64-token pages.
    assert (res["cache"], res["capacity"]) == ("paged", 192)
    rows = res["rows"]
    # No attention-part rows on a paged cache (see glm5_dsa_jax.tools.bench).
    assert sorted(r["impl"] for r in rows) == ["dense"] * 2 + ["dense_fit"] * 2 + ["sparse"] * 2
    for r in rows:
        assert r["batch"] == 2 and r["median_ms"] > 0 and "x_floor" in r
        want = {"sparse": ("paged", 192), "dense": ("contiguous", 192),
                "dense_fit": ("contiguous", r["context"] + 3)}[r["impl"]]
        assert (r["cache"], r["capacity"]) == want, r
    sparse = [r for r in rows if r["impl"] == "sparse"]
    assert [r["context"] for r in sparse] == [64, 130]
    assert all(r["compiles"] == 1 for r in sparse)  # one compilation across contexts
    # Latent rows and pooled keys of the tiny config, plus block tables, free stack, stage.
    assert 0 < res["cache_bytes_per_token"] < 200
    # The table form names the cache of each row.
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64", "--batch", "1",
                 "--iters", "1", "--cache", "paged", "--capacity", "128", "--hf-max-context", "0"]) == 0
    out = capsys.readouterr().out
    assert "sparse       paged" in out and "paged bfloat16 cache bytes per token" in out


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_bench_decode_fp8_cache_rows(capsys, kind):
    argv = ["bench", "decode", "--preset", "tiny", "--contexts", "64", "--batch", "2", "--iters", "1",
            "--cache", kind, "--hf-max-context", "0", "--json"]
    assert main(argv) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main(argv + ["--cache-dtype", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert (bf16["cache_dtype"], fp8["cache_dtype"]) == ("bfloat16", "float8_e4m3fn")
    for r in fp8["rows"]:  # the sparse rows read fp8; the dense baseline stays bf16
        want = "float8_e4m3fn" if r["impl"] in ("sparse", "sparse_attn", "index") else "bfloat16"
        assert r["cache_dtype"] == want and r["median_ms"] > 0, r
    # e4m3 rows + a float32 scale per row: a little over half the bf16 cache's bytes.
    assert 0.5 < fp8["cache_bytes_per_token"] / bf16["cache_bytes_per_token"] < 0.7


@pytest.mark.e2e
@pytest.mark.parametrize("context", [0, 2, 64, 130])
def test_filled_paged_cache_is_consistent_and_steps(context):
    cfg = gd.DsaConfig.tiny()
    layer = gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0))
    b, cap, ps = 3, 192, bench.PAGE_SIZE
    cache = bench.filled_paged_cache(layer, b, context, cap)
    cache.pages.check()  # block tables, lengths and free stack agree
    table = np.asarray(cache.pages.block_table)
    used = -(-context // ps)
    assert cache.num_pages == b * cap // ps and cache.pages_per_seq == cap // ps
    assert (np.asarray(cache.pages.lengths) == context).all()
    assert int(cache.pages.n_free) == cache.num_pages - b * used
    owned = table[:, :used].reshape(-1)
    if used > 1:  # the pages are a random draw from the pool, not in order
        assert (np.diff(owned) != 1).any()
    # The stage holds positions context - KP .. context - 1: none below 0.
    kp = cfg.index_kpool
    held = context - kp + np.arange(kp) >= 0
    stage = np.asarray(cache.stage_keys, np.float32)
    assert (np.abs(stage).sum(-1) > 0).tolist() == [held.tolist()] * b
    # One decode step appends a token to every sequence through its own pages.
    step, params = make_step(layer)
    x = jax.random.normal(jax.random.key(1), (b, 1, cfg.hidden_size)).astype(layer.dtype)
    out, topk, cache = step(params, x, jnp.ones((b, 1), bool), cache)
    assert (np.asarray(cache.status) == 0).all()
    assert (np.asarray(cache.pages.lengths) == context + 1).all()
    cache.pages.check()
    ids = np.asarray(topk)
    assert ((ids >= -1) & (ids <= context)).all() and (ids >= 0).any(axis=-1).all()
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_filled_paged_cache_refuses_a_partial_page():
    layer = gd.DsaAttention(gd.DsaConfig.tiny(), 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="multiple of page_size=64"):
        bench.filled_paged_cache(layer, 1, 10, 100)
    with pytest.raises(ValueError, match=r"context must be in \[0, capacity=128\]"):
        bench.filled_paged_cache(layer, 1, 200, 128)


def test_gpu_compile_subcommand_and_its_python_m_alias(capsys):
    # A setup error (an unknown kernel) exits 2 before any compile, with or without the
    # gpu-compile extra; `python -m glm5_dsa_jax.tools.gpu_compile` is the same command.
    assert main(["gpu-compile", "--kernels", "nope"]) == 2
    assert "unknown kernel(s) ['nope']" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "glm5_dsa_jax.tools.gpu_compile", "--kernels", "nope"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""))
    assert r.returncode == 2 and "unknown kernel(s) ['nope']" in r.stderr, r.stderr[-2000:]


# ------------------------------------------------------------------ a CLI that explains itself
# Each probe: exit status 2, one line on stderr naming the flag, no traceback, nothing
# written, and no work before it (each returns in well under a second in process).
from glm5_dsa_jax import cli  # noqa: E402
from glm5_dsa_jax.cli import gpu_compile as cli_gpu_compile  # noqa: E402
from glm5_dsa_jax.cli import host  # noqa: E402
from glm5_dsa_jax.model.config import MODEL_TYPES, PRESETS  # noqa: E402
from glm5_dsa_jax.tools import demo as demo_tool  # noqa: E402
from glm5_dsa_jax.tools import indexer_training as train_tool  # noqa: E402
from glm5_dsa_jax.tools.gpu_compile import ToolchainMissing  # noqa: E402

PROBES = {  # argv -> what the one line must say
    "bench decode --preset tiny --contexts 9000": "max_position_embeddings=4,096",
    "roofline --gpu h200 --context 2097152": "max_position_embeddings is 1,048,576",
    "roofline --gpu h200 --preset tiny --context 8192": "max_position_embeddings is 4,096",
    "roofline --gpu h200 --chunk 8192 --context 4096": "--chunk 8192 is longer than --context 4096",
    "gpu-compile --targets sm_75": "unknown target(s) ['sm_75']",
    "gpu-compile --preset tiny --contexts 8192": "--contexts 8,192",
    "gpu-compile --contexts 4096,x": "--contexts: expected comma-separated integers",
    "accuracy --preset tiny --contexts 8192": "--contexts 8,192",
    "accuracy --contexts 16 --queries 16": "--contexts 16 must exceed --queries 16",
    "plan --context 2097152": "--context 2,097,152",
    "demo --preset tiny --prompt 4090 --steps 16": "exceeds the model's max_position_embeddings 4096",
    # negative and zero counts
    "bench decode --iters 0": "argument --iters: must be a positive integer",
    "bench decode --batch 1,0": "argument --batch: must be a positive integer",
    "bench decode --hf-max-context -1": "argument --hf-max-context: must be a non-negative integer",
    "bench train --preset tiny --tokens 64,8192": "--tokens: tokens 8,192 exceed max_position_embeddings=4,096",
    "bench train --iters 0": "argument --iters: must be a positive integer",
    "bench train --max-gib 0": "argument --max-gib: must be a finite number > 0",
    "roofline --gpu h200 --context 4096 --batch -2": "argument --batch: must be a positive integer",
    "roofline --gpu h200 --context 4096 --chunk 0": "argument --chunk: must be a positive integer",
    "demo --steps -1": "argument --steps: must be a non-negative integer",
    "accuracy --queries 0": "argument --queries: must be a positive integer",
    "convert a b --tp 0": "argument --tp: must be a positive integer",
    "convert a b --layers 1,-3": "argument --layers: expected comma-separated layer indices >= 0",
    "plan --tp -8": "argument --tp: must be a positive integer",
    "train-indexer --tokens 16": "--tokens 16 leave no query a choice: at least 20",
    "train-indexer --tokens 8192": "--tokens 8,192 exceed max_position_embeddings=4,096",
    "train-indexer --resume": "--resume needs --out",
    "train-indexer --warmup-steps 0 --sparse-steps 0": "nothing to train",
    "train-indexer --layer 2": "--layer 2 is no full-indexer DSA layer of preset tiny: expected one of [1]",
    "train-indexer --lr 0": "argument --lr: must be a finite number > 0",
    "train-indexer --batch 0": "argument --batch: must be a positive integer",
    "train-indexer --sparse-steps -1": "argument --sparse-steps: must be a non-negative integer",
}


def _one_line_error(err: str, says: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and says in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", list(PROBES))
def test_bad_flags_are_one_line_and_exit_2_before_any_work(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("run", "filled_cache"):  # no benchmark work starts
        monkeypatch.setattr(bench, name, lambda *a, **k: pytest.fail("bench ran"))
    monkeypatch.setattr(bench_train, "run", lambda *a, **k: pytest.fail("bench train ran"))
    monkeypatch.setattr(train_tool, "train_indexer", lambda *a, **k: pytest.fail("train-indexer ran"))
    monkeypatch.setattr(demo_tool, "build_layers", lambda *a, **k: pytest.fail("demo built layers"))
    monkeypatch.setattr(cli_gpu_compile, "toolchain", lambda: pytest.fail("toolchain read first"))
    assert main(argv.split()) == 2
    out, err = capsys.readouterr()
    _one_line_error(err, PROBES[argv])
    assert out == "" and list(tmp_path.iterdir()) == []  # nothing printed or written


def test_probes_in_a_fresh_process_have_no_traceback():
    # The same as a user runs them (the installed command's module), two at a time.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    for argv in ("bench decode --preset tiny --contexts 9000", "gpu-compile --targets sm_75"):
        r = subprocess.run([sys.executable, "-m", "glm5_dsa_jax.cli", *argv.split()],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2 and r.stdout == "", (argv, r.stdout, r.stderr)
        err = "\n".join(l for l in r.stderr.splitlines()
                        if "cudart_stub" not in l and "absl::InitializeLog" not in l)
        _one_line_error(err, PROBES[argv])


def test_gpu_compile_setup_errors_are_one_line(capsys, monkeypatch):
    # The extra missing: one line naming it, exit 2 (after the flags are judged).
    def missing():
        raise ToolchainMissing("not installed: jax-cuda12-plugin; install the 'gpu-compile' extra")

    monkeypatch.setattr(cli_gpu_compile, "toolchain", missing)
    assert main(["gpu-compile", "--kernels", "sparse_mla"]) == 2
    _one_line_error(capsys.readouterr().err, "install the 'gpu-compile' extra")
    # An unknown target is told first, before the extra.
    assert main(["gpu-compile", "--targets", "sm_75"]) == 2
    _one_line_error(capsys.readouterr().err, "unknown target(s) ['sm_75']")
    # --mosaic: one setup error on a jax without Mosaic GPU (not a failure per kernel); on
    # a newer jax, the Mosaic GPU kernels' cases and no others.
    args = cli.build_parser().parse_args(["gpu-compile", "--mosaic", "--contexts", "4096"])
    if pk.jax_version() < pk.MOSAIC_MIN_JAX:
        assert main(["gpu-compile", "--mosaic"]) == 2
        _one_line_error(capsys.readouterr().err, "need jax >= 0.11; this is jax")
    else:
        cases, targets = cli_gpu_compile.cases_of(args)
        assert {c.kernel for c in cases} == set(cli_gpu_compile.MOSAIC_KERNELS)


def test_convert_refuses_a_non_empty_output_before_loading(tmp_path, capsys, monkeypatch):
    from glm5_dsa_jax.cli import convert

    monkeypatch.setattr(convert, "load_hf_checkpoint", lambda *a, **k: pytest.fail("loaded"))
    hf, out = tmp_path / "hf", tmp_path / "out"
    hf.mkdir()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", str(hf), str(out)]) == 2
    _one_line_error(capsys.readouterr().err, "exists and is not empty (pass --overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 2
    _one_line_error(capsys.readouterr().err, "is not a directory")
    # More devices than the host has (the test process's jax already started: 8 CPU devices).
    assert main(["convert", str(hf), str(tmp_path / "o3"), "--tp", "64"]) == 2
    _one_line_error(capsys.readouterr().err, "--xla_force_host_platform_device_count=64")
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_every_flag_has_help_and_its_default(capsys):
    parser = cli.build_parser()

    def parsers(p, name):
        yield name, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for n, sp in a.choices.items():
                    yield from parsers(sp, f"{name} {n}")

    seen = set()
    for name, p in parsers(parser, "glm5-dsa"):
        seen.add(name)
        text = p.format_help()
        for a in p._actions:
            if a.help == argparse.SUPPRESS or not a.option_strings or a.dest == "help":
                continue
            assert a.help, f"{name} {a.option_strings[0]} has no help"
            shown = p._get_formatter()._get_help_string(a)
            assert ("(default" in shown or (a.nargs == 0 and a.default is False)
                    or a.required), f"{name} {a.option_strings[0]}: no default shown: {shown!r}"
        assert "add_parser" not in text and "``" not in text, name
    assert {"glm5-dsa bench", "glm5-dsa bench decode", "glm5-dsa gpu-compile"} <= seen
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    bench_help = commands["bench"].format_help()
    assert "decode" in bench_help and "--contexts" not in bench_help
    # convert names every model type it converts.
    convert_help = commands["convert"].format_help()
    assert all(t in convert_help for t in MODEL_TYPES), convert_help
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "COMMAND" in top and "JAX_PLATFORMS=cpu" in top and "add_parser" not in top


def test_demo_default_prompt_is_sparse_at_every_preset():
    # A prompt of at most index_topk tokens selects every token: no sparsity to show.
    for name in PRESETS:
        cfg = gd.DsaConfig.preset(name)
        assert demo_tool.default_prompt(cfg) >= 2 * cfg.index_topk > cfg.index_topk + cfg.tail_width


def test_no_cuda_plugin_traceback_without_a_gpu():
    # With the CUDA plugin installed (the gpu-compile extra) and no GPU, jax's first backend
    # prints "Jax plugin configuration error ... Unable to load CUDA" unless the platform is
    # pinned: the command pins it (JAX_PLATFORMS unset here, as a user's shell has it).
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = ("import sys, jax; from glm5_dsa_jax.cli import main; "
            "rc = main(['roofline', '--gpu', 'h200', '--context', '4096', '--json']); "
            "print(jax.devices()[0].platform, len(jax.devices()), file=sys.stderr); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "plugin configuration error" not in r.stderr, r.stderr
    if not host.has_gpu():
        assert r.stderr.strip().splitlines()[-1] == "cpu 1"
    # A CPU-only host makes the devices a command needs (convert --tp N), before jax starts.
    code = ("import sys; from glm5_dsa_jax.cli import host; host.pin_cpu_without_gpu(); "
            "print(len(host.need_devices(3, '--tp')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    if not host.has_gpu():
        assert r.returncode == 0 and r.stdout.split() == ["3"], r.stderr[-2000:]


def test_pin_leaves_a_users_platform_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert host.pin_cpu_without_gpu() is False
    monkeypatch.delenv("JAX_PLATFORMS")
    assert host.pin_cpu_without_gpu() is False  # this process's backend has started
