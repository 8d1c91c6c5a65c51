"""Checkpoint import (HF safetensors written by transformers' own ``save_pretrained``), bad
input, orbax save/restore across device counts, and ``glm5-dsa convert``.

Parity with HF follows tests/test_hf_parity.py: float32, ``atol = rtol = 3e-5``; selections
are compared as sets (``check_selection``, which allows HF's arbitrary pick among exactly
tied pools), and outputs against HF's attention restricted to *our* selection, on rows that
select something.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import AxisType
from safetensors import safe_open
from safetensors.numpy import save_file

import glm5_dsa_jax as gd
from glm5_dsa_jax import checkpoint as ck
from glm5_dsa_jax.checkpoint import safetensors_file
from glm5_dsa_jax.cli import main
from glm5_dsa_jax.model.weights import params_to_hf
from hf_oracle import hf_attend_on, hf_forward, hf_selection, randomize_
from helpers import (ATOL, RTOL, assert_trees_equal, check_selection, f32_layer, fresh_dir, padded_batch,
                     params_np)
from helpers import assert_same_layers as assert_same_params

PFX = "model.language_model.layers."
LAYER_TYPES = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"]
INDEXER_TYPES = ["full", "full", "shared", "full", "full"]
DSA = [1, 2, 4]


def _text_config():
    return dict(
        vocab_size=64, hidden_size=48, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=40, q_lora_rank=24,
        qk_rope_head_dim=0, v_head_dim=12, qk_nope_head_dim=20, index_topk=16, index_head_dim=16,
        index_n_heads=3, index_kpool=4, index_kpool_always_select_tail=True,
        layer_types=LAYER_TYPES, indexer_types=INDEXER_TYPES, linear_head_dim=8, linear_num_heads=2,
        hc_mult=2, pad_token_id=0, mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
    )


class Tiny:
    """A tiny Glm5NextForConditionalGeneration saved three ways."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=48,
                  projection_intermediate_size=16, patch_size=2, image_size=8)
    hf_cfg = Glm5NextConfig(text_config=_text_config(), vision_config=vision)
    hf_cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    for i in DSA:  # random everything (HF init zeroes the APE)
        randomize_(model.model.language_model.layers[i].self_attn, g)
    root = tmp_path_factory.mktemp("tiny_glm5")
    t = Tiny()
    t.single, t.sharded, t.flat = root / "single", root / "sharded", root / "flat"
    model.save_pretrained(t.single)
    model.save_pretrained(t.sharded, max_shard_size="20KB")
    # The text-only layout: flat config, "model.layers.{i}" names.
    t.flat.mkdir()
    raw = json.loads((t.single / "config.json").read_text())
    flat_cfg = dict(raw["text_config"], model_type="glm5_next")
    (t.flat / "config.json").write_text(json.dumps(flat_cfg))
    t.tensors = _read_all(t.single / "model.safetensors")
    save_file({k.replace("model.language_model.", "model."): v for k, v in t.tensors.items()
               if k.startswith("model.language_model.")}, t.flat / "model.safetensors")
    t.attn = {i: model.model.language_model.layers[i].self_attn for i in DSA}
    t.cfg = gd.DsaConfig.from_hf_config(t.single)
    t.root = root
    t.x, t.mask = padded_batch(t.cfg, (0, 5), 23, seed=0)
    t.layers = ck.load_hf_checkpoint(t.single, dtype=jnp.float32, progress=False)
    return t


def _read_all(file) -> dict[str, np.ndarray]:
    with safe_open(str(file), "numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _copy_with(tiny, name, tensors=None, config=None) -> Path:
    d = fresh_dir(tiny.root / name)
    cfg = json.loads((tiny.single / "config.json").read_text()) if config is None else config
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tiny.tensors if tensors is None else tensors, d / "model.safetensors")
    return d


def assert_match_hf(tiny, layers) -> None:
    cfg, x, mask = tiny.cfg, tiny.x, tiny.mask
    prev = None
    for i in DSA:
        layer, attn = layers[i], tiny.attn[i]
        if layer.has_indexer:
            out, ours = layer(jnp.asarray(x), attention_mask=jnp.asarray(mask))
            out, ours = np.asarray(out), np.asarray(ours)
            _, hf_topk = hf_forward(attn, x, mask)
            check_selection(cfg, mask, ours, hf_selection(attn))
            ref = hf_attend_on(attn, x, mask, ours)
            prev = ours
        else:
            out, topk = layer(jnp.asarray(x), attention_mask=jnp.asarray(mask), prev_topk=jnp.asarray(prev))
            out, ours = np.asarray(out), np.asarray(topk)
            ref = hf_forward(attn, x, mask, prev_topk=prev)[0]
        live = mask & (ours >= 0).any(-1)
        assert live.sum() > 20
        np.testing.assert_allclose(out[live], ref[live], atol=ATOL, rtol=RTOL, err_msg=f"layer {i}")


# ============================================================================ good input
def test_save_pretrained_writes_the_names_we_read(tiny):
    names = set(tiny.tensors)
    assert f"{PFX}1.self_attn.indexer.wq_b.weight" in names
    assert not any(n.startswith(f"{PFX}2.self_attn.indexer.") for n in names)  # shared layer
    assert f"{PFX}0.self_attn.q_conv1d.weight" in names  # linear attention, ignored
    assert (tiny.sharded / "model.safetensors.index.json").is_file()
    assert len(list(tiny.sharded.glob("model-*.safetensors"))) > 5


def test_single_file_matches_hf(tiny):
    layers = tiny.layers
    assert sorted(layers) == DSA
    assert layers[1].has_indexer and not layers[2].has_indexer and layers[4].has_indexer
    for i in DSA:  # exact: the stored float32 tensors round-trip through our layout
        ours = params_to_hf(layers[i])
        for k, v in ours.items():
            np.testing.assert_array_equal(v, tiny.tensors[f"{PFX}{i}.self_attn.{k}"])
        assert layers[i].q_b_proj[...].dtype == jnp.float32 and layers[i].dtype == jnp.float32
    assert_match_hf(tiny, layers)


def test_same_as_layer_load_hf_weights(tiny):
    """The sliced reader agrees bit for bit with ``DsaAttention.load_hf_weights``."""
    for i in (1, 2):
        ref = f32_layer(tiny.cfg, i)
        ref.load_hf_weights({k: v for k, v in params_to_hf(tiny.layers[i]).items()})
        assert_trees_equal(params_np(ref), params_np(tiny.layers[i]))


def test_sharded_index_and_flat_layout(tiny):
    sharded = ck.load_hf_checkpoint(tiny.sharded, dtype=jnp.float32, progress=False)
    assert_same_params(sharded, tiny.layers)
    flat = ck.load_hf_checkpoint(tiny.flat, dtype=jnp.float32, progress=False)
    assert_same_params(flat, tiny.layers)


@pytest.mark.parametrize("tp", [2, 4])
def test_mesh_of_8_devices(tiny, tp):
    """8 devices, ``8 // tp`` heads on each (4 or 2): with one head per device a head/dim
    mix-up in the sliced reads (rows ``h*d + j`` read as ``j*H + h``) would go unseen, since
    a one-head slice is the same either way. Compared bit for bit with the unsliced load."""
    mesh = jax.make_mesh((8 // tp, tp), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    layers = ck.load_hf_checkpoint(tiny.sharded, mesh=mesh, dtype=jnp.float32, progress=False)
    assert_same_params(layers, tiny.layers)
    for i in DSA:
        layer = layers[i]
        assert layer.mesh == mesh  # placed for sharded execution, not only its arrays
        specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer, nnx.Param)))
        for name in ("q_b_proj", "w_uk", "w_uv", "o_proj"):
            arr = getattr(layer, name)[...]
            assert arr.sharding == jax.sharding.NamedSharding(mesh, specs[name])
            assert "tp" in tuple(specs[name])
            head_axis = tuple(specs[name]).index("tp")
            assert {s.data.shape[head_axis] for s in arr.addressable_shards} == {8 // tp}
            assert len(arr.addressable_shards) == 8
        assert layer.q_a_proj[...].sharding.is_fully_replicated
        if layer.has_indexer:
            assert layer.indexer.wq_b[...].sharding.is_fully_replicated
    if tp == 4:
        assert_match_hf(tiny, layers)


def test_explicit_mesh_subset_and_bf16(tiny):
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))  # explicit axes, heads over 4 of 8 devices
    layers = ck.load_hf_checkpoint(tiny.single, mesh=mesh, layers=[2], progress=False)
    assert sorted(layers) == [2]
    layer = layers[2]
    assert layer.dtype == jnp.bfloat16 and layer.o_proj[...].dtype == jnp.bfloat16
    assert layer.o_proj[...].sharding.spec == jax.sharding.PartitionSpec("tp", None, None)
    assert layer.mesh == mesh
    want = params_to_hf(tiny.layers[2])
    got = params_to_hf(layer)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k].astype(jnp.bfloat16).astype(np.float32))
    with pytest.raises(ValueError, match="implementation"):
        ck.load_hf_checkpoint(tiny.single, implementation="cuda", progress=False)
    with pytest.raises(ValueError, match="not a DSA"):
        ck.load_hf_checkpoint(tiny.single, layers=[0], progress=False)
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        ck.load_hf_checkpoint(tiny.single, mesh=jax.make_mesh((3,), ("tp",), devices=jax.devices()[:3]),
                              progress=False)
    with pytest.raises(ValueError, match="no axis 'tp'"):
        ck.load_hf_checkpoint(tiny.single, mesh=jax.make_mesh((8,), ("model",)), progress=False)


def test_headers_match_safe_open(tiny):
    for file in sorted(tiny.sharded.glob("*.safetensors"))[:6] + [tiny.single / "model.safetensors"]:
        ours = ck.SafetensorsFile(file)
        assert ours.error is None
        with safe_open(str(file), "numpy") as f:
            assert sorted(f.keys()) == sorted(ours.tensors)
            for k in f.keys():
                info = ours.tensors[k]
                assert info.problem is None
                assert list(info.shape) == f.get_slice(k).get_shape()
                assert info.dtype == f.get_slice(k).get_dtype()
                np.testing.assert_array_equal(ours.read(info), f.get_tensor(k))
                if len(info.shape) == 2 and info.shape[0] > 3 and info.shape[1] > 5:
                    np.testing.assert_array_equal(ours.read(info, (1, 3), (2, 5)), f.get_tensor(k)[1:3, 2:5])
        ours.close()


def test_progress_bar(tiny, capsys):
    ck.load_hf_checkpoint(tiny.single, layers=[1], progress=True)
    err = capsys.readouterr().err
    assert "loading DSA layers" in err and "tensor" in err


# ============================================================================ bad input
def _problems(excinfo) -> str:
    e = excinfo.value
    assert isinstance(e, ck.CheckpointError) and isinstance(e, ValueError)
    return "\n".join(e.problems)


def test_every_weight_problem_in_one_error(tiny):
    t = dict(tiny.tensors)
    del t[f"{PFX}1.self_attn.q_a_proj.weight"]
    del t[f"{PFX}4.self_attn.indexer.wk.weight"]
    t[f"{PFX}1.self_attn.extra_proj.weight"] = np.zeros((3, 3), np.float32)
    t[f"{PFX}2.self_attn.indexer.wq_b.weight"] = t[f"{PFX}1.self_attn.indexer.wq_b.weight"]
    t[f"{PFX}4.self_attn.kv_b_proj.weight"] = t[f"{PFX}4.self_attn.kv_b_proj.weight"][:-1]
    t[f"{PFX}1.self_attn.o_proj.weight"] = t[f"{PFX}1.self_attn.o_proj.weight"].astype(np.int32)
    # outside the DSA layers' self_attn namespaces: ignored
    t[f"{PFX}0.self_attn.whatever.weight"] = np.zeros(2, np.float32)
    t[f"{PFX}3.mlp.unknown"] = np.zeros(2, np.float32)
    t["model.something_else"] = np.zeros(2, np.int64)
    d = _copy_with(tiny, "bad_many", t)
    with pytest.raises(ck.CheckpointError) as ei:
        ck.load_hf_checkpoint(d, progress=False)
    e, msg = ei.value, _problems(ei)
    assert len(e.problems) == 6, msg
    for needle in (
        f"missing tensor '{PFX}1.self_attn.q_a_proj.weight'",
        f"missing tensor '{PFX}4.self_attn.indexer.wk.weight'",
        f"unexpected tensor '{PFX}1.self_attn.extra_proj.weight'",
        f"unexpected tensor '{PFX}2.self_attn.indexer.wq_b.weight' (config.json makes layer 2 a 'shared'",
        f"'{PFX}4.self_attn.kv_b_proj.weight' has shape (255, 40), expected (256, 40)",
        f"'{PFX}1.self_attn.o_proj.weight' has dtype I32",
    ):
        assert needle in msg, (needle, msg)
    assert "layers.0." not in msg and "layers.3." not in msg and "something_else" not in msg


def test_non_finite_values_listed_before_anything_returns(tiny):
    t = dict(tiny.tensors)
    w = t[f"{PFX}4.self_attn.q_b_proj.weight"].copy()
    w[7, 3] = np.nan
    w[70, 1] = np.inf
    t[f"{PFX}4.self_attn.q_b_proj.weight"] = w
    n = t[f"{PFX}1.self_attn.kv_a_layernorm.weight"].copy()
    n[0] = -np.inf
    t[f"{PFX}1.self_attn.kv_a_layernorm.weight"] = n
    d = _copy_with(tiny, "bad_nan", t)
    for mesh in (None, jax.make_mesh((8,), ("tp",))):
        with pytest.raises(ck.CheckpointError) as ei:
            ck.load_hf_checkpoint(d, mesh=mesh, progress=False)
        msg = _problems(ei)
        assert len(ei.value.problems) == 2, msg
        assert f"'{PFX}4.self_attn.q_b_proj.weight' holds 2 non-finite values" in msg
        assert f"'{PFX}1.self_attn.kv_a_layernorm.weight' holds 1 non-finite values" in msg


def test_truncated_and_corrupt_files(tiny):
    d = _copy_with(tiny, "bad_trunc")
    f = d / "model.safetensors"
    header = ck.SafetensorsFile(f)
    size = f.stat().st_size
    cut = int(size * 0.6)
    with open(f, "r+b") as fh:
        fh.truncate(cut)
    ends = {n: i.offset + int(np.prod(i.shape)) * np.dtype(safetensors_file._ST_DTYPES[i.dtype]).itemsize
            for n, i in header.tensors.items()}
    header.close()
    lost = sorted(n for n, end in ends.items() if end > cut and any(n.startswith(f"{PFX}{i}.self_attn.") for i in DSA))
    assert lost
    with pytest.raises(ck.CheckpointError) as ei:
        ck.load_hf_checkpoint(d, progress=False)
    msg = _problems(ei)
    assert len(ei.value.problems) == len(lost), msg
    for n in lost:
        assert repr(n) in msg and "truncated" in msg

    with open(f, "r+b") as fh:  # a header that is not JSON
        fh.seek(9)
        fh.write(b"\x00garbage\xff")
    with pytest.raises(ck.CheckpointError, match="model.safetensors is not a valid safetensors file"):
        ck.load_hf_checkpoint(d, progress=False)
    f.write_bytes(b"abc")
    with pytest.raises(ck.CheckpointError, match="shorter than a safetensors header"):
        ck.load_hf_checkpoint(d, progress=False)


def test_sharded_missing_and_truncated_shards(tiny):
    d = fresh_dir(tiny.root / "bad_shards", copy_of=tiny.sharded)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    gone = wm[f"{PFX}1.self_attn.q_b_proj.weight"]
    (d / gone).unlink()
    short = wm[f"{PFX}4.self_attn.o_proj.weight"]
    assert short != gone
    with open(d / short, "r+b") as fh:
        fh.truncate((d / short).stat().st_size - 4)
    with pytest.raises(ck.CheckpointError) as ei:
        ck.load_hf_checkpoint(d, progress=False)
    msg = _problems(ei)
    assert f"file {gone} cannot be read" in msg and f"'{PFX}1.self_attn.q_b_proj.weight'" in msg
    assert "truncated" in msg and short in msg


def test_config_not_matching_weights(tiny):
    raw = json.loads((tiny.single / "config.json").read_text())
    raw["text_config"]["q_lora_rank"] = 32
    d = _copy_with(tiny, "bad_cfg", config=raw)
    with pytest.raises(ck.CheckpointError) as ei:
        ck.load_hf_checkpoint(d, progress=False)
    msg = _problems(ei)
    for i in DSA:
        assert f"'{PFX}{i}.self_attn.q_a_proj.weight' has shape (24, 48), expected (32, 48)" in msg
        assert f"'{PFX}{i}.self_attn.q_b_proj.weight' has shape (160, 24), expected (160, 32)" in msg
    # a linear-attention layer declared DSA: its DSA tensors are missing, its own unexpected
    raw = json.loads((tiny.single / "config.json").read_text())
    raw["text_config"]["layer_types"][3] = "indexed_attention"
    d = _copy_with(tiny, "bad_cfg2", config=raw)
    with pytest.raises(ck.CheckpointError) as ei:
        ck.load_hf_checkpoint(d, progress=False)
    msg = _problems(ei)
    assert f"missing tensor '{PFX}3.self_attn.kv_b_proj.weight'" in msg
    assert f"unexpected tensor '{PFX}3.self_attn.q_conv1d.weight'" in msg
    assert "layers.1." not in msg


def test_missing_config_or_weights(tiny, tmp_path):
    (tmp_path / "a").mkdir()
    shutil.copy(tiny.single / "model.safetensors", tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ck.load_hf_checkpoint(tmp_path / "a")
    (tmp_path / "b").mkdir()
    shutil.copy(tiny.single / "config.json", tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json.*model.safetensors"):
        ck.load_hf_checkpoint(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="neither an orbax checkpoint"):
        ck.load_for_demo(tmp_path / "a")


# ============================================================================ orbax
def _same_arrays(a: dict, b: dict) -> None:
    for i in a:
        sa = nnx.to_pure_dict(nnx.state(a[i], nnx.Param))
        sb = nnx.to_pure_dict(nnx.state(b[i], nnx.Param))
        jax.tree.map(lambda x, y: (np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                                   (x.dtype == y.dtype) or pytest.fail("dtype")), sa, sb)


def test_orbax_round_trip_across_device_counts(tiny, tmp_path):
    mesh8 = jax.make_mesh((8,), ("tp",))
    layers = ck.load_hf_checkpoint(tiny.single, mesh=mesh8, dtype=jnp.bfloat16, progress=False)
    out = ck.save_checkpoint(layers, tmp_path / "orbax")
    meta = json.loads((out / ck.META_FILE).read_text())
    assert meta["layers"] == DSA and meta["config"]["num_attention_heads"] == 8
    with pytest.raises(FileExistsError):
        ck.save_checkpoint(layers, tmp_path / "orbax")

    for n in (8, 4, 1):
        mesh = None if n == 1 else jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n])
        back = ck.restore_checkpoint(out, mesh=mesh)
        assert sorted(back) == DSA and back[1].cfg == tiny.cfg
        _same_arrays(layers, back)  # bit-exact, same dtypes
        arr = back[4].w_uv[...]
        if mesh is None:
            assert len(arr.sharding.device_set) == 1
        else:
            assert arr.sharding == jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp", None, None))
            assert {s.data.shape[0] for s in arr.addressable_shards} == {8 // n}
        assert back[1].q_a_proj[...].sharding.is_fully_replicated

    sub = ck.restore_checkpoint(out, layers=[2], dtype=jnp.float32)
    assert sorted(sub) == [2] and sub[2].dtype == jnp.float32
    _same_arrays({2: layers[2]}, sub)
    wide = ck.restore_checkpoint(out, layers=[4], param_dtype=jnp.float32)  # cast on restore
    assert wide[4].o_proj[...].dtype == jnp.float32 and wide[4].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(wide[4].o_proj[...]), np.asarray(layers[4].o_proj[...], np.float32))
    with pytest.raises(ValueError, match="not in the checkpoint"):
        ck.restore_checkpoint(out, layers=[3])


def test_orbax_restored_layers_run_like_the_loaded_ones(tiny, tmp_path):
    out = ck.save_checkpoint({1: tiny.layers[1]}, tmp_path / "o1")
    cfg, back = ck.load_for_demo(out)
    assert cfg == tiny.cfg and sorted(back) == [1] and back[1].dtype == jnp.float32
    x = jnp.asarray(tiny.x)
    a = tiny.layers[1](x, attention_mask=jnp.asarray(tiny.mask))
    b = back[1](x, attention_mask=jnp.asarray(tiny.mask))
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


# ============================================================================ CLI / demo
def test_convert_cli(tiny, tmp_path, capsys):
    def run(*argv):
        return main(list(argv))

    out = tmp_path / "conv"
    assert run("convert", str(tiny.sharded), str(out), "--tp", "8", "--dtype", "float32") == 0
    captured = capsys.readouterr()
    assert "converted 3 DSA layer(s) [1, 2, 4]" in captured.out and "tp=8" in captured.out
    assert "loading DSA layers" in captured.err  # the progress bar
    cfg, layers = ck.load_for_demo(out)
    assert_same_params(layers, tiny.layers)
    cfg2, layers2 = ck.load_for_demo(tiny.single, dtype=jnp.float32, progress=False)
    assert cfg2 == cfg and sorted(layers2) == DSA
    # the demo runs on both kinds of directory, through the real command line
    for ckpt in (out, tiny.single):
        assert main(["demo", "--checkpoint", str(ckpt), "--steps", "2", "--prompt", "10"]) == 0
        assert "layer 1 (full indexer) + layer 2 (shared)" in capsys.readouterr().out

    assert run("convert", str(tiny.single), str(out), "--no-progress") == 2  # exists: before loading
    assert "exists and is not empty" in capsys.readouterr().err
    assert run("convert", str(tiny.single), str(out), "--overwrite", "--layers", "1,2", "--no-progress") == 0
    assert ck.read_checkpoint_meta(out)[0]["layers"] == [1, 2]
    assert run("convert", str(tiny.single), str(tmp_path / "x"), "--tp", "64") == 2
    assert run("convert", str(tmp_path), str(tmp_path / "y")) == 1
    assert "no config.json" in capsys.readouterr().err
