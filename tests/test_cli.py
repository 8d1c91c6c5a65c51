"""The command line: the demo (default and from a checkpoint) and the decode benchmark."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.cli import main
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
    base = {"impl", "batch", "context", "median_ms", "compiles", "peak_bytes", "cache", "capacity"}
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
