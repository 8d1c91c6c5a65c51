"""DsaConfig: HF config reading, presets, and every validation rule."""

import json

import pytest

import glm5_dsa_jax as gd


def test_glm53_flash_preset_geometry():
    cfg = gd.DsaConfig.glm53_flash()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank) == (4096, 64, 512)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.index_kpool) == (32, 128, 2048, 4)
    assert cfg.out_width == 2048 + 3
    assert cfg.select_k(65_536) == 512 and cfg.select_k(100) == 100
    assert len(cfg.dsa_layers) == 11 and cfg.dsa_layers[0] == 3


def test_from_hf_config_nested_flat_and_path(tmp_path):
    tiny = gd.DsaConfig.tiny().to_hf_dict()
    flat = gd.DsaConfig.from_hf_config(tiny)
    nested = gd.DsaConfig.from_hf_config({"model_type": "glm5_next", "text_config": tiny})
    (tmp_path / "config.json").write_text(json.dumps({"text_config": tiny}))
    from_dir = gd.DsaConfig.from_hf_config(tmp_path)
    from_file = gd.DsaConfig.from_hf_config(tmp_path / "config.json")
    assert flat == nested == from_dir == from_file == gd.DsaConfig.tiny()


def test_hf_derived_indexer_types_match_transformers():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    kw = dict(num_hidden_layers=12, index_topk_freq=2, index_skip_topk_offset=2)
    assert "shared" in Glm5NextTextConfig(**kw).indexer_types
    ours = gd.DsaConfig.from_hf_config(kw)
    hf = Glm5NextTextConfig(**kw)
    assert list(ours.indexer_types) == hf.indexer_types
    assert list(ours.layer_types) == hf.layer_types


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        gd.DsaConfig.from_hf_config(tmp_path)


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(index_topk=10, index_kpool=4), "index_topk"),
        (dict(index_topk=0), "index_topk"),
        (dict(index_kpool=0), "index_kpool"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(index_n_heads=-1), "index_n_heads"),
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(indexer_types=("full", "full")), "indexer_types"),
        (dict(layer_types=("linear_attention", "indexed_attention", "mlp", "linear_attention")), "layer_types"),
        (dict(indexer_types=("full", "shared", "shared", "full")), "indexer_types"),
    ],
)
def test_validation_names_field_and_value(change, field):
    with pytest.raises(ValueError, match=field):
        gd.DsaConfig.tiny().replace(**change)


def test_kernel_limits_of_the_seed_are_not_rules():
    # The CUDA seed refused kpool > 8 and kv_lora_rank != 512; the model does not.
    cfg = gd.DsaConfig.tiny(index_kpool=16, index_topk=32, kv_lora_rank=40)
    assert cfg.index_kpool == 16 and cfg.kv_lora_rank == 40


def test_mismatched_kv_heads_refused():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        gd.DsaConfig.tiny(num_key_value_heads=2)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        gd.DsaConfig.preset("big")


# --------------------------------------------------------------------- typed fields
@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(index_kpool_always_select_tail="false"), "index_kpool_always_select_tail must be a JSON boolean"),
        (dict(attention_bias="false"), "attention_bias must be a JSON boolean"),
        (dict(attention_bias=1), "attention_bias must be a JSON boolean"),
        (dict(num_hidden_layers="abc"), "num_hidden_layers must be an integer"),
        (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
        (dict(hidden_size="48"), "hidden_size must be an integer"),
        (dict(hidden_size=48.0), "hidden_size must be an integer"),
        (dict(index_topk=True), "index_topk must be an integer"),
        (dict(q_lora_rank="24"), "q_lora_rank must be an integer"),
        (dict(num_attention_heads=0), "num_attention_heads must be a positive integer"),
        (dict(num_attention_heads=0, num_key_value_heads=4), "num_attention_heads must be a positive"),
        (dict(max_position_embeddings=0), "max_position_embeddings must be a positive integer"),
        (dict(max_position_embeddings=-5), "max_position_embeddings must be a positive integer"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a number"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a finite number > 0"),
        (dict(num_key_value_heads="4"), "num_key_value_heads must be an integer"),
        (dict(layer_types="linear_attention"), "layer_types must be a list of strings"),
        (dict(indexer_types=[1, 2, 3, 4]), "indexer_types must be a list of strings"),
        (dict(indexer_types=None, index_topk_pattern="FSXF"), r"unknown letters \['X'\]; allowed letters are \['F', 'S'\]"),
        (dict(indexer_types=None, index_topk_pattern="FS"), "index_topk_pattern has 2 entries"),
        (dict(indexer_types=None, index_topk_pattern=7), "index_topk_pattern must be a string"),
        (dict(indexer_types=None, index_topk_freq="2"), "index_topk_freq must be an integer"),
    ],
)
def test_typed_fields_are_refused_with_their_name(change, needle):
    d = gd.DsaConfig.tiny().to_hf_dict() | change
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(ValueError, match=needle):
        gd.DsaConfig.from_hf_config(d)


def test_real_booleans_and_pattern_are_read():
    d = gd.DsaConfig.tiny().to_hf_dict()
    del d["indexer_types"]
    cfg = gd.DsaConfig.from_hf_config(d | dict(attention_bias=True, index_kpool_always_select_tail=False,
                                                index_topk_pattern="FFSF"))
    assert cfg.attention_bias is True and cfg.index_kpool_always_select_tail is False
    assert cfg.indexer_types == ("full", "full", "shared", "full")


@pytest.mark.parametrize("text,needle", [
    ("[1, 2]", "must hold a JSON object.*got list"),
    ("null", "must hold a JSON object.*got null"),
    ('{"hidden_size": 48,', "is not valid JSON"),
    ("", "is not valid JSON"),
])
def test_bad_config_files_name_the_file(tmp_path, text, needle):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=needle) as e:
        gd.DsaConfig.from_hf_config(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


@pytest.mark.parametrize("change,field", [
    (dict(attention_bias="false"), "attention_bias"),
    (dict(index_kpool_always_select_tail=1), "index_kpool_always_select_tail"),
    (dict(max_position_embeddings=0), "max_position_embeddings"),
    (dict(index_norm_eps=float("inf")), "index_norm_eps"),
    (dict(q_lora_rank=True), "q_lora_rank"),
])
def test_direct_construction_is_validated_too(change, field):
    with pytest.raises(ValueError, match=field):
        gd.DsaConfig.tiny().replace(**change)
