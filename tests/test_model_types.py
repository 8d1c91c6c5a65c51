"""The three model types in ``DsaConfig`` (``glm5_next``, ``glm_moe_dsa``, ``deepseek_v32``):
presets, reading each type's config.json, per-type rules, RoPE fields and the YaRN softmax
scale, bad input; the layout's per-type tensors; the CLI's presets. No torch: the HF
comparisons are in ``test_rope`` and ``test_hf_models``."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.model import layout, rope
from glm5_dsa_jax.cli import main
from glm5_dsa_jax.model.config import MODEL_TYPES, PRESETS

# DeepSeek-V3.2-Exp's config.json, trimmed to the fields read here (flat, legacy rope_scaling).
DEEPSEEK_V32_JSON = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 7168,
    "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def test_presets_published_dims():
    assert set(PRESETS) >= {"glm53-flash", "glm5", "glm52", "deepseek-v32", "tiny"}
    g5, g52, ds = (gd.DsaConfig.preset(n) for n in ("glm5", "glm52", "deepseek-v32"))
    assert (g5.model_type, g5.hidden_size, g5.q_lora_rank, g5.qk_head_dim, g5.v_head_dim) == (
        "glm_moe_dsa", 6144, 2048, 256, 256)
    assert g5.kv_cache_dim == 576 and g5.index_kpool == 1 and g5.out_width == 2048
    assert len(g5.dsa_layers) == 78 and "shared" not in g5.indexer_types
    full = [i for i, t in enumerate(g52.indexer_types) if t == "full"]
    assert full == [0, 1, 2, *range(6, 78, 4)] and len(full) == 21
    assert g52.rope_theta == 8e6 and g52.max_position_embeddings == 1_048_576
    assert (ds.num_attention_heads, ds.index_n_heads, ds.qk_head_dim, ds.rms_norm_eps) == (128, 64, 192, 1e-6)
    assert ds.rope_type == "yarn" and ds.rope_factor == 40 and ds.rope_original_max_position_embeddings == 4096
    assert ds.from_hf_config(DEEPSEEK_V32_JSON) == ds
    for name in PRESETS:
        cfg = gd.DsaConfig.preset(name)
        assert gd.DsaConfig.from_hf_config(cfg.to_hf_dict()) == cfg, name


def test_softmax_scale_with_yarn_mscale():
    ds = gd.DsaConfig.preset("deepseek-v32")
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert ds.softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-15)
    assert ds.rope_attention_scaling == 1.0  # mscale == mscale_all_dim: cos/sin unscaled
    assert gd.DsaConfig.preset("glm5").softmax_scale == 256**-0.5
    no_all_dim = ds.replace(rope_mscale_all_dim=None)
    assert no_all_dim.softmax_scale == 192**-0.5
    assert no_all_dim.rope_attention_scaling == pytest.approx(0.1 * math.log(40) + 1.0)
    assert ds.replace(rope_attention_factor=0.5).rope_attention_scaling == 0.5


def test_read_each_type_flat_nested_and_from_file(tmp_path):
    for name in ("glm5", "glm52", "deepseek-v32"):
        cfg = gd.DsaConfig.preset(name)
        d = cfg.to_hf_dict()
        nested = {"model_type": d["model_type"], "text_config": d}
        (tmp_path / "config.json").write_text(json.dumps(nested))
        assert gd.DsaConfig.from_hf_config(nested) == gd.DsaConfig.from_hf_config(tmp_path) == cfg


def test_hf_spellings_of_rope():
    base = dict(DEEPSEEK_V32_JSON)
    legacy = gd.DsaConfig.from_hf_config(base)
    new = dict(base, rope_parameters={"rope_type": "yarn", "rope_theta": 10000, "factor": 40,
                                      "original_max_position_embeddings": 4096, "beta_fast": 32,
                                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    del new["rope_scaling"], new["rope_theta"]
    assert gd.DsaConfig.from_hf_config(new) == legacy
    # a null factor is max_position_embeddings / original (DeepSeek's convention)
    implicit = dict(base, rope_scaling=dict(base["rope_scaling"], factor=None))
    assert gd.DsaConfig.from_hf_config(implicit).rope_factor == 40
    # beta 0 falls back to HF's 32 / 1 (its `or`)
    zero = dict(base, rope_scaling=dict(base["rope_scaling"], beta_fast=0, beta_slow=0))
    c = gd.DsaConfig.from_hf_config(zero)
    assert (c.rope_beta_fast, c.rope_beta_slow) == (32, 1)
    # no rope at all: HF's default theta 10000, default type
    plain = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_theta")}
    c = gd.DsaConfig.from_hf_config(plain)
    assert (c.rope_type, c.rope_theta, c.softmax_scale) == ("default", 10000.0, 192**-0.5)


def test_model_rules():
    g5 = gd.DsaConfig.preset("glm5")
    ds = gd.DsaConfig.preset("deepseek-v32")
    with pytest.raises(ValueError, match="index_kpool is 4.*no k-pool compression"):
        g5.replace(index_kpool=4, index_topk=2048)
    with pytest.raises(ValueError, match="no k-pool compression"):
        ds.replace(index_kpool_always_select_tail=True)
    with pytest.raises(ValueError, match=r"indexer_types\[3\] is 'shared'.*'deepseek_v32' has no cross-layer"):
        ds.replace(indexer_types=("full",) * 3 + ("shared",) + ("full",) * 57)
    g5.replace(indexer_types=("full", "shared") * 39)  # sharing is glm_moe_dsa's
    with pytest.raises(ValueError, match="NoPE"):
        gd.DsaConfig.glm53_flash(qk_rope_head_dim=64)
    with pytest.raises(ValueError, match="even integer"):
        g5.replace(qk_rope_head_dim=63)
    with pytest.raises(ValueError, match="exceeds index_head_dim"):
        g5.replace(qk_rope_head_dim=256)
    with pytest.raises(ValueError, match="linear_attention.*every layer of model_type"):
        g5.replace(layer_types=("linear_attention",) + ("indexed_attention",) * 77)
    for qk_rope in (0, 32):  # any even qk_rope_head_dim >= 0
        assert g5.replace(qk_rope_head_dim=qk_rope).kv_cache_dim == 512 + qk_rope
    assert g5.latent_norm_eps == ds.latent_norm_eps == 1e-6
    assert gd.DsaConfig.glm53_flash().latent_norm_eps == 1e-5
    assert MODEL_TYPES["glm_moe_dsa"].indexer_rope_style == "interleaved"
    assert MODEL_TYPES["deepseek_v32"].indexer_rope_style == "half"


def test_bad_model_type_and_rope_type_named():
    with pytest.raises(ValueError, match=r"model_type is 'deepseek_v3'; supported: \['deepseek_v32'"):
        gd.DsaConfig.from_hf_config(dict(DEEPSEEK_V32_JSON, model_type="deepseek_v3"))
    with pytest.raises(ValueError, match=r"rope_type is 'llama3'; supported: \['default', 'yarn'\]"):
        gd.DsaConfig.from_hf_config(dict(DEEPSEEK_V32_JSON, rope_scaling={"type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match=r"rope_parameters is nested per layer type"):
        gd.DsaConfig.from_hf_config(dict(DEEPSEEK_V32_JSON, rope_scaling=None,
                                         rope_parameters={"indexed_attention": {"rope_type": "default"}}))
    with pytest.raises(ValueError, match=r"rope_parameters: factor must be a number"):
        gd.DsaConfig.from_hf_config(dict(DEEPSEEK_V32_JSON, rope_scaling=dict(
            DEEPSEEK_V32_JSON["rope_scaling"], factor="40")))
    with pytest.raises(ValueError, match=r"rope_theta must be a number"):
        gd.DsaConfig.from_hf_config(dict(DEEPSEEK_V32_JSON, rope_theta="1e4", rope_scaling=None))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        gd.DsaConfig.from_hf_config(dict(DEEPSEEK_V32_JSON, partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match=r"DsaConfig.model_type is 'llama'; supported"):
        gd.DsaConfig.tiny().replace(model_type="llama")
    with pytest.raises(ValueError, match=r"DsaConfig.rope_type is 'ntk'"):
        gd.DsaConfig.preset("glm5").replace(rope_type="ntk")
    with pytest.raises(ValueError, match="unknown preset 'glm-5'"):
        gd.DsaConfig.preset("glm-5")


def test_layout_per_model_type():
    kp = {"indexer.index_kpool_compress_gate", "indexer.index_kpool_compress_ape"}
    g53, g5, ds = gd.DsaConfig.glm53_flash(), gd.DsaConfig.preset("glm5"), gd.DsaConfig.preset("deepseek-v32")
    assert kp <= set(layout.hf_weight_shapes(g53, g53.dsa_layers[0]))
    for cfg in (g5, ds):
        shapes = layout.hf_weight_shapes(cfg, 0)
        assert not kp & set(shapes) and not kp & set(layout.hf_tensor_shapes(cfg))
        assert shapes["kv_a_proj_with_mqa.weight"] == (576, cfg.hidden_size)
        assert shapes["q_b_proj.weight"] == (cfg.num_attention_heads * cfg.qk_head_dim, cfg.q_lora_rank)
        assert shapes["kv_b_proj.weight"] == (cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512)
        assert ("indexer", "kpool_gate") not in layout.param_shapes(cfg, 0)
        assert layout.param_shapes(cfg, 0)[("q_b_proj",)] == (cfg.q_lora_rank, cfg.num_attention_heads, cfg.qk_head_dim)
    g52 = gd.DsaConfig.preset("glm52")
    assert not any(k.startswith("indexer.") for k in layout.hf_weight_shapes(g52, 3))


@pytest.mark.parametrize("name", ["glm5", "glm52", "deepseek-v32"])
def test_cli_presets(name, capsys):
    assert main(["plan", "--preset", name, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["per_rank_local_bytes"]) == 8
    # the demo's parser takes each preset (running the real dims is the demo's own test)
    from glm5_dsa_jax.cli import build_parser
    assert build_parser().parse_args(["demo", "--preset", name]).preset == name


def rope_cfg():
    return gd.DsaConfig.preset("glm5").replace(qk_rope_head_dim=8)


def test_styles_differ_and_preserve_dot_products():
    cfg = rope_cfg()
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 8)).astype(np.float32)
    c, s = rope.rope_cos_sin(cfg, np.array([7, 7]))
    qi, ki = (np.asarray(rope.apply_rope(v, c[0], s[0], "interleaved")) for v in (q, k))
    qh, kh = (np.asarray(rope.apply_rope(v, c[0], s[0], "half")) for v in (q, k))
    assert not np.allclose(qi, qh)
    # a query and a key at the same position: each layout keeps their dot product
    assert float(qi @ ki) == pytest.approx(float(q @ k), rel=1e-5)
    assert float(qh @ kh) == pytest.approx(float(q @ k), rel=1e-5)
    c0, s0 = rope.rope_cos_sin(cfg, np.array([0]))
    np.testing.assert_allclose(np.asarray(rope.apply_rope(q, c0[0], s0[0], "half")), q, rtol=0, atol=0)


def test_bad_input():
    cfg = rope_cfg()
    c, s = rope.rope_cos_sin(cfg, np.arange(3))
    with pytest.raises(ValueError, match="style"):
        rope.apply_rope(jnp.zeros((3, 8)), c, s, "neox")
    with pytest.raises(ValueError, match="twice"):
        rope.apply_rope(jnp.zeros((3, 6)), c, s, "half")
    with pytest.raises(ValueError, match="positions must be an integer"):
        rope.rope_cos_sin(cfg, np.arange(3.0))
    with pytest.raises(ValueError, match="NoPE"):
        rope.inv_freq(gd.DsaConfig.tiny())
