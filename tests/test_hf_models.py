"""The HF references of ``glm_moe_dsa`` and ``deepseek_v32`` (``hf_oracle``) build and run,
and checkpoints written from their modules' state dicts are read by the importer's config
and name checks (torch: listed in ``conftest.TORCH_MODULES``)."""

import json

import numpy as np
import pytest
import torch

import glm5_dsa_jax as gd

from hf_oracle import hf_attend_on, hf_attention, hf_forward, hf_stepped


def small(model_type: str, **kw) -> gd.DsaConfig:
    d = dict(model_type=model_type, hidden_size=32, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=24,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6, index_n_heads=3, index_head_dim=12,
             index_topk=4, num_hidden_layers=2, max_position_embeddings=4096,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                              "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0})
    if model_type == "glm_moe_dsa":
        d["indexer_types"] = ["full", "shared"]
    return gd.DsaConfig.from_hf_config(d | kw)


TYPES = ["glm_moe_dsa", "deepseek_v32"]


@pytest.mark.parametrize("model_type", TYPES)
def test_oracle_builds_and_runs_2x9(model_type):
    cfg = small(model_type)
    attn = hf_attention(cfg, 0, seed=1)
    x = np.random.default_rng(0).standard_normal((2, 9, 32)).astype(np.float32)
    mask = np.ones((2, 9), bool)
    mask[1, :3] = False  # left padding
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
    np.testing.assert_allclose(stepped[same], whole[same], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hf_attend_on(attn, x, full, stepped_topk), stepped, rtol=1e-5, atol=1e-5)
    # RoPE is relative: shifting every position keeps the output, spreading them changes it
    shifted, _ = hf_forward(attn, x, full, position_ids=np.broadcast_to(np.arange(100, 109), (2, 9)))
    np.testing.assert_allclose(shifted, whole, rtol=1e-4, atol=1e-4)
    spread, _ = hf_forward(attn, x, full, position_ids=np.broadcast_to(np.arange(0, 27, 3), (2, 9)))
    assert not np.allclose(spread, whole, atol=1e-3)


def test_glm_moe_dsa_shared_layer_reuses_topk():
    cfg = small("glm_moe_dsa")
    full, shared = hf_attention(cfg, 0, seed=1), hf_attention(cfg, 1, seed=2)
    assert shared.indexer is None and full.indexer is not None
    x = np.random.default_rng(3).standard_normal((2, 9, 32)).astype(np.float32)
    mask = np.ones((2, 9), bool)
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
