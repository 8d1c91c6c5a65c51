"""RoPE (``glm5_dsa_jax.model.rope``) against transformers' own rotary classes and functions of
``glm_moe_dsa`` and ``deepseek_v32``: default and YaRN frequencies, cos / sin up to position
200k, both channel layouts (torch: listed in ``conftest.TORCH_MODULES``)."""

import numpy as np
import pytest
import torch

import glm5_dsa_jax as gd
from glm5_dsa_jax.model import rope

from hf_oracle import hf_rotary

YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_ODD = {"rope_type": "yarn", "rope_theta": 50_000.0, "factor": 8.0, "original_max_position_embeddings": 2048,
            "beta_fast": 16, "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 0.3, "truncate": False}
DEFAULT = {"rope_type": "default", "rope_theta": 1_000_000.0}
CASES = [("glm_moe_dsa", DEFAULT), ("glm_moe_dsa", YARN_ODD), ("deepseek_v32", YARN), ("deepseek_v32", DEFAULT)]


def small_cfg(model_type: str, rope_parameters: dict, qk_rope: int = 64) -> gd.DsaConfig:
    return gd.DsaConfig.from_hf_config(dict(
        model_type=model_type, hidden_size=32, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=qk_rope, v_head_dim=8, index_n_heads=2, index_head_dim=qk_rope + 8,
        index_topk=4, num_hidden_layers=1, max_position_embeddings=163_840, rope_parameters=dict(rope_parameters)))


def ulps(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.max(np.abs(a.astype(np.float64) - b) / np.spacing(np.maximum(np.abs(b), np.float32(1e-30))))


@pytest.mark.parametrize("name", ["glm5", "glm52", "deepseek-v32"])
def test_presets_frequencies_bit_equal_hf(name):
    cfg = gd.DsaConfig.preset(name)
    hf = hf_rotary(cfg)
    np.testing.assert_array_equal(rope.inv_freq(cfg), hf.inv_freq.numpy())
    assert cfg.rope_attention_scaling == hf.attention_scaling
    pos = np.array([[0, 1, 4095, 4096, 65_535, 163_839, 199_999]])
    with torch.no_grad():
        c_hf, s_hf = hf(torch.zeros(1), torch.from_numpy(pos))
    c, s = rope.rope_cos_sin(cfg, pos)
    np.testing.assert_allclose(np.asarray(c), c_hf.numpy()[..., :32], rtol=0, atol=2.5e-7)
    np.testing.assert_allclose(np.asarray(s), s_hf.numpy()[..., :32], rtol=0, atol=2.5e-7)


@pytest.mark.parametrize("model_type,rp", CASES)
def test_inv_freq_and_scaling_match_hf(model_type, rp):
    cfg = small_cfg(model_type, rp)
    hf = hf_rotary(cfg)
    assert ulps(rope.inv_freq(cfg), hf.inv_freq.numpy()) <= 1
    assert cfg.rope_attention_scaling == pytest.approx(hf.attention_scaling, rel=1e-15)
    if rp["rope_type"] == "yarn":  # YaRN really changes the frequencies and the scale here
        assert not np.allclose(rope.inv_freq(cfg), rope.inv_freq(cfg.replace(rope_type="default")))


@pytest.mark.parametrize("model_type,rp", CASES)
def test_cos_sin_match_hf_up_to_200k(model_type, rp):
    cfg = small_cfg(model_type, rp)
    hf = hf_rotary(cfg)
    pos = np.concatenate([np.arange(64), np.arange(1000, 200_001, 997), [131_071, 163_839, 199_999]])[None]
    with torch.no_grad():
        c_hf, s_hf = hf(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos))
    c, s = rope.rope_cos_sin(cfg, pos)
    half = cfg.qk_rope_head_dim // 2
    np.testing.assert_array_equal(c_hf.numpy()[..., :half], c_hf.numpy()[..., half:])
    # float32 rounding: the same float32 angle, two libms: within 2 ulp of the scale (1.0
    # times YaRN's attention_scaling), the size of cos / sin
    # float32 rounding: the same float32 angle, two libms: within 2 ulp of the scale (1.0
    # times YaRN's attention_scaling, the size of cos / sin) -- plus, where torch's float32
    # pow (SLEEF, 1 ulp) rounded an inverse frequency the other way than ours (correctly
    # rounded), the angle that ulp makes at the position and the float32 rounding of that
    # angle, times the scale. Only such columns get the wider bound.
    scale = cfg.rope_attention_scaling
    ours_inv = rope.inv_freq(cfg)
    d_inv = np.abs(ours_inv.astype(np.float64) - hf.inv_freq.numpy())
    assert (d_inv > 0).sum() <= 1  # the odd theta here: one frequency of 32
    angle = (pos[..., None].astype(np.float32) * ours_inv).astype(np.float32)
    wide = (pos[..., None] * d_inv + np.spacing(np.abs(angle)).astype(np.float64)) * (d_inv > 0)
    tol = 2 * float(np.spacing(np.float32(scale))) + wide * scale * 1.01
    for ours, theirs in ((c, c_hf), (s, s_hf)):
        err = np.abs(np.asarray(ours, np.float64) - theirs.numpy()[..., :half])
        assert (err <= tol).all(), float((err - tol).max())


@pytest.mark.parametrize("style", rope.ROPE_STYLES)
def test_apply_rope_matches_hf_functions(style):
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        apply_rotary_pos_emb, apply_rotary_pos_emb_interleave,
    )
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave as glm_inter

    cfg = small_cfg("deepseek_v32", YARN, qk_rope=16)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 9, 16)).astype(np.float32)  # [B, H, S, D]
    k = rng.standard_normal((2, 1, 9, 16)).astype(np.float32)
    pos = np.stack([np.arange(9), np.arange(190_000, 190_009)])
    hf = hf_rotary(cfg)
    with torch.no_grad():
        cos, sin = hf(torch.zeros(1), torch.from_numpy(pos))
        args = (torch.from_numpy(q), torch.from_numpy(k), cos, sin)
        if style == "half":
            outs = [apply_rotary_pos_emb(*args)]
        else:
            outs = [apply_rotary_pos_emb_interleave(*args), glm_inter(*args)]
    c, s = (np.asarray(a)[:, None] for a in rope.rope_cos_sin(cfg, pos))
    c_hf = cos.numpy()[:, None, :, :8]
    s_hf = sin.numpy()[:, None, :, :8]
    for q_hf, k_hf in outs:
        # with HF's own cos / sin the rotation is bit-for-bit
        np.testing.assert_array_equal(np.asarray(rope.apply_rope(q, c_hf, s_hf, style)), q_hf.numpy())
        np.testing.assert_array_equal(np.asarray(rope.apply_rope(k, c_hf, s_hf, style)), k_hf.numpy())
        # with ours, float32 rounding
        np.testing.assert_allclose(np.asarray(rope.apply_rope(q, c, s, style)), q_hf.numpy(), rtol=0, atol=5e-6)
