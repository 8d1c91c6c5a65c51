"""The HF references of ``glm_moe_dsa`` and ``deepseek_v32`` (``hf_oracle``) build and run,
and checkpoints written from their modules' state dicts are read by the importer's config
and name checks (torch: listed in ``conftest.TORCH_MODULES``)."""

import json

import numpy as np
import pytest

import glm5_dsa_jax as gd

from helpers import F32_REORDER, padded_batch
from helpers import rope_tiny as small
from hf_oracle import hf_attend_on, hf_attention, hf_forward, hf_stepped


TYPES = ["glm_moe_dsa", "deepseek_v32"]


@pytest.mark.parametrize("model_type", TYPES)
def test_oracle_builds_and_runs_2x9(model_type):
    cfg = small(model_type)
    attn = hf_attention(cfg, 0, seed=1)
    x, mask = padded_batch(cfg, (0, 3), 9, seed=0)  # left padding
    out, topk = hf_forward(attn, x, mask)
    assert out.shape == (2, 9, 32) and np.isfinite(out).all()
    assert topk.shape == (2, 9, 4)
    # causal: a query never selects a later token (rows with fewer than 4 visible keys
    # are filled with masked ones, which the attention mask then hides)
    t = np.arange(9)[None, :, None]
    visible = (topk <= t) & mask[:, None, :].repeat(9, 1)[np.arange(2)[:, None, None], t, topk]
    assert visible[0, 3:].all() and visible[1, 6:].all()
    # the attention honours a given top-k: attending on the indexer's own is the same output
    np.testing.assert_allclose(hf_attend_on(attn, x, mask, topk), out, rtol=1e-6, atol=1e-6)
    # stepping with a cache (prefill 5, then 4 decode steps) equals the whole-sequence run
    # on every row that selected the same token set (torch.topk may order ReLU ties
    # differently at another shape); attending on the stepped top-k matches on all rows
    full = np.ones((2, 9), bool)
    whole, whole_topk = hf_forward(attn, x, full)
    stepped, stepped_topk = hf_stepped(attn, cfg, x, full, [5, 1, 1, 1, 1])
    vis = lambda row, t: {int(i) for i in row if 0 <= i <= t}  # picks past t are masked anyway
    same = np.array([[vis(a, t) == vis(b, t) for t, (a, b) in enumerate(zip(ra, rb))]
                     for ra, rb in zip(whole_topk, stepped_topk)])
    assert same.mean() > 0.8
    np.testing.assert_allclose(stepped[same], whole[same], rtol=F32_REORDER, atol=F32_REORDER)
    np.testing.assert_allclose(hf_attend_on(attn, x, full, stepped_topk), stepped, rtol=F32_REORDER, atol=F32_REORDER)
    # RoPE is relative: shifting every position keeps the output, spreading them changes it
    shifted, _ = hf_forward(attn, x, full, position_ids=np.broadcast_to(np.arange(100, 109), (2, 9)))
    np.testing.assert_allclose(shifted, whole, rtol=1e-4, atol=1e-4)
    spread, _ = hf_forward(attn, x, full, position_ids=np.broadcast_to(np.arange(0, 27, 3), (2, 9)))
    assert not np.allclose(spread, whole, atol=1e-3)


def test_glm_moe_dsa_shared_layer_reuses_topk():
    cfg = small("glm_moe_dsa")
    full, shared = hf_attention(cfg, 0, seed=1), hf_attention(cfg, 1, seed=2)
    assert shared.indexer is None and full.indexer is not None
    x, mask = padded_batch(cfg, (0, 0), 9, seed=3)
    _, topk = hf_forward(full, x, mask)
    out, none = hf_forward(shared, x, mask, prev_topk=topk)
    assert none is None and out.shape == (2, 9, 32) and np.isfinite(out).all()


def test_hf_configs_round_trip_through_transformers():
    from hf_oracle import hf_config

    for name in ("glm5", "glm52", "deepseek-v32"):
        cfg = gd.DsaConfig.preset(name)
        hf = hf_config(cfg)
        back = gd.DsaConfig.from_hf_config(hf.to_dict())
        assert back == cfg, name
        assert hf.qk_head_dim == cfg.qk_head_dim and list(getattr(hf, "indexer_types", cfg.indexer_types)) == list(cfg.indexer_types)


def _write_checkpoint(path, cfg, layers: dict[int, dict[str, np.ndarray]], extra=None):
    from safetensors.numpy import save_file

    tensors = {f"model.layers.{i}.self_attn.{k}": v for i, sd in layers.items() for k, v in sd.items()}
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    hf = cfg.to_hf_dict()
    (path / "config.json").write_text(json.dumps(hf))


def _state(attn):
    return {k: v.detach().numpy().copy() for k, v in attn.state_dict().items()}


@pytest.mark.parametrize("model_type", TYPES)
def test_safetensors_of_each_type_import(tmp_path, model_type):
    from glm5_dsa_jax.model import layout
    from glm5_dsa_jax.model.weights import arrays_to_hf, hf_to_params

    cfg = small(model_type)
    sds = {i: _state(hf_attention(cfg, i, seed=10 + i)) for i in range(2)}
    assert not any("kpool" in k for sd in sds.values() for k in sd)  # no k-pool tensors in HF either
    for i, sd in sds.items():
        assert {k: tuple(v.shape) for k, v in sd.items()} == layout.hf_weight_shapes(cfg, i)
    extra = {"model.embed_tokens.weight": np.zeros((8, 32), np.float32),
             "model.layers.0.mlp.gate_proj.weight": np.zeros((4, 32), np.float32)}
    _write_checkpoint(tmp_path, cfg, sds, extra)
    got_cfg, params = gd.read_hf_params(tmp_path)
    assert got_cfg == cfg and sorted(params) == [0, 1]
    for i, sd in sds.items():
        assert {k: v.shape for k, v in params[i].items()} == layout.param_shapes(cfg, i)
        want = hf_to_params(cfg, i, sd, param_dtype=np.float32)
        for path, arr in params[i].items():
            np.testing.assert_array_equal(arr, np.asarray(want[path]))
        back = arrays_to_hf(cfg, params[i], indexer=cfg.has_indexer(i))
        assert sorted(back) == sorted(sd)
        for k in sd:
            np.testing.assert_array_equal(back[k], sd[k])
    # the imported layers compute what HF computes: the full layer on its own selection,
    # a shared one (GLM-5) on the full layer's
    import jax.numpy as jnp

    layers = gd.load_hf_checkpoint(tmp_path, dtype=jnp.float32, progress=False)
    x, mask = padded_batch(cfg, (0, 2), 9, seed=3)
    out, topk = layers[0](jnp.asarray(x), attention_mask=jnp.asarray(mask))
    live = mask & (np.asarray(topk) >= 0).any(-1)
    ref = hf_attend_on(hf_attention(cfg, 0, seed=10), x, mask, np.asarray(topk))
    np.testing.assert_allclose(np.asarray(out)[live], ref[live], rtol=F32_REORDER, atol=F32_REORDER)
    if not cfg.has_indexer(1):
        out1, _ = layers[1](jnp.asarray(x), attention_mask=jnp.asarray(mask), prev_topk=topk)
        ref1 = hf_attend_on(hf_attention(cfg, 1, seed=11), x, mask, np.asarray(topk))
        np.testing.assert_allclose(np.asarray(out1)[live], ref1[live], rtol=F32_REORDER, atol=F32_REORDER)


def test_mismatched_tensors_all_listed(tmp_path):
    cfg = small("glm_moe_dsa")
    sd0 = _state(hf_attention(cfg, 0))
    sd1 = _state(hf_attention(cfg, 1))
    del sd0["indexer.wk.weight"]
    sd0["indexer.index_kpool_compress_gate"] = np.zeros((12, 32), np.float32)  # glm5_next-only
    sd1["indexer.wq_b.weight"] = np.zeros((36, 16), np.float32)  # a shared layer has no indexer
    sd0["q_b_proj.weight"] = sd0["q_b_proj.weight"][:, :8]  # wrong shape
    _write_checkpoint(tmp_path, cfg, {0: sd0, 1: sd1})
    with pytest.raises(gd.CheckpointError) as e:
        gd.read_hf_params(tmp_path)
    msg = str(e.value)
    for needle in ("missing tensor 'model.layers.0.self_attn.indexer.wk.weight'",
                   "unexpected tensor 'model.layers.0.self_attn.indexer.index_kpool_compress_gate'",
                   "unexpected tensor 'model.layers.1.self_attn.indexer.wq_b.weight'",
                   "q_b_proj.weight"):
        assert needle in msg, msg
    assert len(e.value.problems) == 4


def test_unknown_model_type_refused(tmp_path):
    cfg = small("deepseek_v32")
    _write_checkpoint(tmp_path, cfg, {0: _state(hf_attention(cfg, 0))})
    d = json.loads((tmp_path / "config.json").read_text())
    d["model_type"] = "deepseek_v3"
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(gd.CheckpointError, match="model_type is 'deepseek_v3'; supported: .*deepseek_v32"):
        gd.read_hf_params(tmp_path)


def _fp8_block_example():
    """A hand-made DeepSeek-V3 block-scaled weight: [200, 300] e4m3 codes, a [2, 3] grid of
    ``weight_scale_inv`` (128 x 128 blocks, the last ones partial), and its value computed
    block by block: ``(128x128 block) * weight_scale_inv`` (DeepSeek-V3's README_WEIGHTS)."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    w8 = rng.uniform(-448, 448, (200, 300)).astype(ml_dtypes.float8_e4m3fn)
    s_inv = np.array([[0.5, 2.0, 0.125], [4.0, 1.0 / 3, 7.0]], np.float32)
    want = np.empty((200, 300), np.float32)
    for bi in range(2):
        for bj in range(3):
            blk = (slice(128 * bi, 128 * (bi + 1)), slice(128 * bj, 128 * (bj + 1)))
            want[blk] = w8[blk].astype(np.float32) * s_inv[bi, bj]
    return w8, s_inv, want


def test_fp8_block_dequantization_convention():
    from glm5_dsa_jax import quant

    w8, s_inv, want = _fp8_block_example()
    np.testing.assert_array_equal(quant.dequantize_fp8_block(w8, s_inv), want)
    # a slice starting inside a block reads the right scales
    np.testing.assert_array_equal(
        quant.dequantize_fp8_block(w8[100:190, 120:260], s_inv, offset=(100, 120)), want[100:190, 120:260])


def test_deepseek_v32_fp8_checkpoint_imports(tmp_path):
    """DeepSeek-V3.2's layout: fp8 e4m3 linear weights with ``weight_scale_inv`` per 128 x 128
    block, norms in float; the importer reads them dequantized."""
    from safetensors.numpy import save_file

    cfg = small("deepseek_v32", hidden_size=200, q_lora_rank=300)
    sd = _state(hf_attention(cfg, 0))
    w8, s_inv, want = _fp8_block_example()
    tensors = {f"model.layers.0.self_attn.{k}": v for k, v in sd.items() if k != "q_a_proj.weight"}
    # q_a_proj is [q_lora 300, hidden 200]: the example transposed, and its scale grid too
    tensors["model.layers.0.self_attn.q_a_proj.weight"] = w8.T.copy()
    tensors["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = s_inv.T.copy()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf = cfg.to_hf_dict() | {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                      "quant_method": "fp8", "weight_block_size": [128, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    _, params = gd.read_hf_params(tmp_path, layers=[0])
    np.testing.assert_array_equal(params[0][("q_a_proj",)], want)  # ours is [hidden, q_lora]
