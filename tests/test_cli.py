"""The command line: the demo (default and from a checkpoint) and the decode benchmark."""

import importlib.util
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
from glm5_dsa_jax.tools import bench
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
    assert "sparse kernel vs dense masked attention on the same tokens: max |diff|" in out
    assert "tokens/s" in out


def test_demo_from_an_orbax_checkpoint(tmp_path, capsys):
    cfg = gd.DsaConfig.tiny()
    layers = {i: f32_layer(cfg, i, seed=i) for i in cfg.dsa_layers}
    gd.save_checkpoint(layers, tmp_path / "ckpt")
    assert main(["demo", "--checkpoint", str(tmp_path / "ckpt"), "--steps", "2", "--prompt", "12"]) == 0
    out = capsys.readouterr().out
    assert "layer 1 (full indexer) + layer 2 (shared)" in out


def test_bench_decode_json(capsys):
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64,256", "--batch", "1",
                 "--iters", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = res["rows"]
    assert {r["impl"] for r in rows} >= {"sparse", "dense", "dense_fit"}
    base = {"impl", "batch", "context", "median_ms", "compiles", "peak_bytes", "cache", "capacity",
            "cache_dtype"}
    floor = {"floor_bytes", "floor_ms", "x_floor"}
    for r in rows:
        assert set(r) == (base if r["impl"] == "hf" else base | floor)
        if "floor_ms" in r:
            assert r["x_floor"] == r["median_ms"] / r["floor_ms"]
            assert r["floor_ms"] == pytest.approx(r["floor_bytes"] / (res["read_gb_s"] * 1e9) * 1e3)
    assert res["read_gb_s"] > 0 and res["float32_compute"]  # a CPU: the float32 copies
    assert res["weight_bytes_step"] == 2 * res["weight_bytes_stored"]
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


def test_bench_decode_capacity(capsys):
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64", "--batch", "1",
                 "--iters", "1", "--capacity", "512", "--hf-max-context", "0", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["capacity"] == 512
    caps = {r["impl"]: r["capacity"] for r in res["rows"]}
    assert caps == {"sparse": 512, "dense": 512, "dense_fit": 67, "sparse_attn": 512, "dense_attn": 512}
    # Too small for the context and the timed steps: a usage error before any work.
    assert main(["bench", "decode", "--preset", "tiny", "--contexts", "64", "--iters", "1",
                 "--capacity", "65"]) == 2
    assert "need at least 66 tokens" in capsys.readouterr().err


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
        want = "float8_e4m3fn" if r["impl"] in ("sparse", "sparse_attn") else "bfloat16"
        assert r["cache_dtype"] == want and r["median_ms"] > 0, r
    # e4m3 rows + a float32 scale per row: a little over half the bf16 cache's bytes.
    assert 0.5 < fp8["cache_bytes_per_token"] / bf16["cache_bytes_per_token"] < 0.7


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
