"""``glm5_dsa_jax.tools.indexer_training``: a resumed run is the uninterrupted run, training raises
the captured mass from the random indexer's, the metric against a float64 numpy computation of
its definition, the indexer's re-initialisation, and bad settings refused before any work."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.tools import indexer_training as ti
from glm5_dsa_jax.checkpoint import load_for_demo
from helpers import assert_trees_equal, f32_layer, params_np

CFG = gd.DsaConfig.tiny()


class Interrupted(Exception):
    pass


def settings(**kw):
    return ti.TrainSettings(**{**dict(warmup_steps=2, sparse_steps=2, batch=2, tokens=32, lr=1e-2), **kw})


@pytest.mark.slow
def test_resumed_run_equals_the_uninterrupted_run(tmp_path):
    st = settings()
    trained = f32_layer(CFG)
    whole = ti.train_indexer(trained, st, progress=False)
    assert [r["stage"] for r in whole["records"]] == ["dense", "dense", "sparse", "sparse"]

    def stop_after_two(rec):
        if rec["step"] == 2:
            raise Interrupted  # as a Ctrl-C after the second step's state was saved

    with pytest.raises(Interrupted):
        ti.train_indexer(f32_layer(CFG), st, out=tmp_path / "b", save_every=2, callback=stop_after_two,
                         progress=False)
    rest = ti.train_indexer(f32_layer(CFG), st, out=tmp_path / "b", resume=True, progress=False)
    assert rest["start_step"] == 2 and [r["step"] for r in rest["records"]] == [3, 4]
    # The next losses (the two sparse steps) are the uninterrupted run's, bit for bit.
    assert [r["loss"] for r in rest["records"]] == [r["loss"] for r in whole["records"][2:]]
    assert rest["after"] == whole["after"]
    # The trained layer is saved, and restores to the trained parameters.
    _, layers = load_for_demo(tmp_path / "b" / ti.LAYER_DIR)
    assert_trees_equal(params_np(layers[1]), params_np(trained))

    # A resume with other settings, or a new run into a used directory: refused, nothing touched.
    with pytest.raises(ti.SettingsMismatch, match=r"tokens 32 -> 40"):
        ti.train_indexer(f32_layer(CFG), settings(tokens=40), out=tmp_path / "b", resume=True, progress=False)
    with pytest.raises(ValueError, match=r"holds a run \(pass resume=True to continue it\)"):
        ti.train_indexer(f32_layer(CFG), st, out=tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="holds no run"):
        ti.train_indexer(f32_layer(CFG), st, out=tmp_path / "c", resume=True, progress=False)
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_training_raises_the_captured_mass():
    layer = f32_layer(CFG)
    seen = []
    res = ti.train_indexer(layer, settings(warmup_steps=12, sparse_steps=4, batch=2, tokens=128),
                           eval_every=8, callback=seen.append, progress=False)
    before, after = res["before"]["captured"], res["after"]["captured"]
    assert before < 0.75 and after > before + 0.15, (before, after)
    assert after <= 1 + 1e-6 and res["after"]["best"] == pytest.approx(res["before"]["best"])
    assert seen == res["records"] and [r["step"] for r in seen if "captured" in r] == [8, 16]
    assert seen[-1]["captured"] == pytest.approx(after)
    dense = [r["loss"] for r in seen if r["stage"] == "dense"]
    assert dense[-1] < 0.5 * dense[0]


def _captured_numpy(layer, x, mask):
    """The metric's definition in float64 numpy, from the layer's queries, rows and top-k."""
    cfg, kp, k = layer.cfg, layer.cfg.index_kpool, layer.cfg.max_select_k
    b, s, _ = x.shape
    xz = np.where(mask[..., None], x, 0).astype(np.float32)
    _, q, rows = layer.project(jnp.asarray(xz))
    q, rows = np.asarray(q, np.float64), np.asarray(rows, np.float64)
    _, topk = layer(jnp.asarray(x), attention_mask=jnp.asarray(mask))
    topk = np.asarray(topk)
    ratios = []
    for i in range(b):
        fk = int(np.argmax(mask[i]))
        for t in range(s):
            if not mask[i, t]:
                continue
            vis = mask[i, : t + 1]
            sc = np.einsum("hc,kc->hk", q[i, t], rows[i, : t + 1]) * cfg.softmax_scale
            sc = np.where(vis[None], sc, -np.inf)
            a = np.exp(sc - sc.max(-1, keepdims=True))
            a = (a / a.sum(-1, keepdims=True)).mean(0)
            n_complete = (t - fk + 1) // kp
            if n_complete <= k:
                continue
            pools = np.array([a[fk + j * kp: fk + (j + 1) * kp].sum() for j in range(n_complete)])
            chosen = {(int(v) - fk) // kp for v in topk[i, t, : k * kp] if v >= 0}
            ratios.append(sum(pools[j] for j in chosen) / np.sort(pools)[::-1][:k].sum())
    return float(np.mean(ratios)), len(ratios)


def test_captured_mass_is_its_definition():
    layer = f32_layer(CFG, seed=3)
    x = ti.SyntheticPrompts(CFG, seed=1).held_out(2, 37)  # a partial last pool
    mask = np.ones((2, 37), bool)
    mask[1, :6] = False  # left padding: the pool grid starts at slot 6
    got = ti.captured_mass(layer, x, mask)
    want, n = _captured_numpy(layer, x, mask)
    assert got["queries"] == n and got["captured"] == pytest.approx(want, rel=1e-5)
    assert 0 < got["captured"] <= 1 + 1e-6


def test_prompts_are_words_and_reproducible():
    p = ti.SyntheticPrompts(CFG, seed=0, vocab=5, noise=0.0)
    x = p.train(3, 2, 18)
    assert x.shape == (2, 18, CFG.hidden_size) and x.dtype == np.float32
    # Runs of kpool (4 at tiny) copies of a word, aligned with the pool grid.
    assert (x[:, 0:4] == x[:, 0:1]).all() and (x[:, 4:8] == x[:, 4:5]).all()
    assert len({w.tobytes() for w in x.reshape(-1, CFG.hidden_size)}) <= 5
    assert np.array_equal(p.train(3, 2, 18), x) and not np.array_equal(p.train(4, 2, 18), x)
    assert not np.array_equal(p.held_out(2, 18), x)


def test_reinit_indexer_touches_only_the_indexer_and_is_seeded():
    a, b = f32_layer(CFG), f32_layer(CFG)
    before = params_np(a)
    ti.reinit_indexer(a, seed=5)
    ti.reinit_indexer(b, seed=5)
    after = params_np(a)
    assert_trees_equal({k: v for k, v in after.items() if k != "indexer"},
                       {k: v for k, v in before.items() if k != "indexer"})
    for name, v in after["indexer"].items():
        if name in ("wq_b", "wk", "weights_proj", "kpool_gate"):  # the random ones
            assert not np.array_equal(v, before["indexer"][name]), name
    assert_trees_equal(params_np(b), after)


@pytest.mark.parametrize("kw, says", [
    (dict(tokens=16), "tokens 16 leave no query a choice: at least 20"),
    (dict(tokens=5000), "tokens 5,000 exceed max_position_embeddings=4,096"),
    (dict(warmup_steps=0, sparse_steps=0), "nothing to train"),
    (dict(batch=0), "batch must be >= 1"),
    (dict(lr=0.0), "lr must be > 0"),
])
def test_bad_settings_are_refused_before_any_work(kw, says, tmp_path):
    layer = f32_layer(CFG)
    before = params_np(layer)
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        ti.train_indexer(layer, settings(**kw), out=tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
    assert np.array_equal(params_np(layer)["indexer"]["wq_b"], before["indexer"]["wq_b"])


def test_build_layer_refuses_a_shared_layer():
    with pytest.raises(ValueError, match=r"layer 2 is no full-indexer DSA layer of preset tiny: expected one of \[1\]"):
        ti.build_layer("tiny", layer_idx=2)
    assert ti.build_layer("tiny").layer_idx == 1
    with pytest.raises(ValueError, match="'shared' layer: it has no indexer"):
        ti.reinit_indexer(gd.DsaAttention(CFG, 2, rngs=nnx.Rngs(0)), 0)


def test_build_layer_reads_the_checkpoint(tmp_path):
    # The layer of a checkpoint is the saved one (not the preset's seed): every parameter,
    # its indexer included (train_indexer re-initialises the indexer after, seeded).
    saved = f32_layer(CFG, 1, seed=7)
    gd.save_checkpoint({1: saved}, tmp_path / "ckpt")
    layer = ti.build_layer("tiny", str(tmp_path / "ckpt"))
    assert layer.layer_idx == 1
    assert_trees_equal(params_np(layer), params_np(saved), "checkpoint layer")
    assert not np.array_equal(params_np(layer)["w_uk"], params_np(ti.build_layer("tiny"))["w_uk"])
    with pytest.raises(ValueError, match=r"layer 3 is no full-indexer DSA layer of checkpoint"):
        ti.build_layer("tiny", str(tmp_path / "ckpt"), 3)
