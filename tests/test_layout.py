"""The layout table (``glm5_dsa_jax.model.layout``) against the layer, the plan and checkpoints.

* Its HF shapes are what ``params_to_hf`` writes and its parameter shapes what
  ``DsaAttention`` creates, for full and shared layers, with and without biases.
* The transform round-trips: HF -> params -> HF is the identity, through the table and
  through ``hf_to_params`` / ``load_hf_weights`` / ``params_to_hf``.
* A TP shard of any parameter, read with the shard's bounds, equals that slice of the
  whole parameter, for every tensor and every TP size in 1, 2, 4, 8 that divides the heads,
  and reads only the HF rows (or columns) of its heads.
* An orbax checkpoint written before ``kv_a_proj`` was renamed (the tree holds the
  parameter under the HF name) still restores.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax import checkpoint as ck
from glm5_dsa_jax.model import layout
from glm5_dsa_jax.parallel import plan
from glm5_dsa_jax.tools import roofline
from helpers import tiny8

CONFIGS = {
    "tiny": gd.DsaConfig.tiny(),
    "tiny8-bias": tiny8(attention_bias=True),
}


def _random_hf(cfg, layer_idx, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in gd.hf_weight_shapes(cfg, layer_idx).items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("layer_idx", [1, 2])  # a full and a shared indexer layer
def test_shapes_are_the_layers(name, layer_idx):
    cfg = CONFIGS[name]
    layer = nnx.eval_shape(lambda: gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0)))
    made = {tuple(p): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert made == layout.param_shapes(cfg, layer_idx)
    specs = {tuple(p): tuple(v.get_metadata()["out_sharding"]) for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert specs == {p: tuple(s) for p, s in gd.partition_specs(cfg, layer_idx=layer_idx).items()}
    tensors = layout.layer_tensors(cfg, layer_idx)
    assert any(t.indexer for t in tensors) == cfg.has_indexer(layer_idx)
    assert any(t.bias for t in tensors) == cfg.attention_bias
    assert set(layout.hf_weight_shapes(cfg, layer_idx)) <= set(layout.hf_tensor_shapes(cfg))
    # The table's element counts agree on both sides and with the plan and the roofline.
    for t in tensors:
        assert math.prod(t.hf_shape(cfg)) == sum(math.prod(p.shape(cfg)) for p in t.params), t.hf_name
    full = plan.TpPlan.build(cfg, layer_idx=layer_idx, elem_bytes=2).full_bytes
    assert full == sum(2 * math.prod(s) for s in made.values())
    assert full == roofline.weight_bytes(cfg, 2, has_indexer=cfg.has_indexer(layer_idx))


def test_the_table():
    # Which tensors split over TP, and how, is read off the heads axis.
    kinds = {t.hf_name: plan.ShardKind.of(t) for t in layout.TENSORS}
    split = {n: k for n, k in kinds.items() if k is not plan.ShardKind.REPLICATED}
    assert split == {"q_b_proj.weight": plan.ShardKind.HEAD_ROWS, "kv_b_proj.weight": plan.ShardKind.HEAD_ROWS,
                     "o_proj.weight": plan.ShardKind.HEAD_COLS}
    assert {t.transform for t in layout.TENSORS} == {"as-is", "transpose", "heads", "parts"}
    t, p = layout.find_param(("w_uv",))
    assert t.hf_name == "kv_b_proj.weight" and t.transform == "parts" and p.init_std(CONFIGS["tiny"]) == 40**-0.5
    assert layout.find_param(("kv_a_proj_with_mqa",)) == layout.find_param(("kv_a_proj",))  # the alias
    with pytest.raises(KeyError):
        layout.find_param(("nope",))
    assert len({p.path for t in layout.TENSORS for p in t.params}) == sum(len(t.params) for t in layout.TENSORS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("layer_idx", [1, 2])
def test_hf_params_hf_is_the_identity(name, layer_idx):
    cfg = CONFIGS[name]
    hf = _random_hf(cfg, layer_idx, seed=layer_idx)
    for t in layout.layer_tensors(cfg, layer_idx):
        arrays = {p.path: layout.read_param(cfg, t, p, layout.array_reader(hf[t.hf_name])) for p in t.params}
        np.testing.assert_array_equal(layout.assemble_hf(cfg, t, arrays), hf[t.hf_name])
    params = gd.hf_to_params(cfg, layer_idx, hf, param_dtype=np.float32)
    assert {k: v.shape for k, v in params.items()} == layout.param_shapes(cfg, layer_idx)
    layer = gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0), param_dtype=np.float32)
    layer.load_hf_weights(hf)
    back = gd.params_to_hf(layer)
    assert back.keys() == hf.keys()
    for n in hf:
        np.testing.assert_array_equal(back[n], hf[n], err_msg=n)
    # Known entries of the transform, spelled out once here.
    nh, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
    kvb = hf["kv_b_proj.weight"].reshape(nh, nope + cfg.v_head_dim, -1)
    np.testing.assert_array_equal(params[("w_uk",)], kvb[:, :nope])
    np.testing.assert_array_equal(params[("w_uv",)], kvb[:, nope:])
    np.testing.assert_array_equal(params[("kv_a_proj",)], hf["kv_a_proj_with_mqa.weight"].T)
    np.testing.assert_array_equal(
        params[("o_proj",)], hf["o_proj.weight"].T.reshape(nh, cfg.v_head_dim, cfg.hidden_size))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_tp_slice_is_the_slice_of_the_whole(name):
    cfg = CONFIGS[name]
    hf = _random_hf(cfg, 1, seed=7)
    nh = cfg.num_attention_heads
    checked = 0
    for tp in (t for t in (1, 2, 4, 8) if nh % t == 0):
        for t in layout.layer_tensors(cfg, 1):
            a = hf[t.hf_name]
            for p in t.params:
                whole = layout.read_param(cfg, t, p, layout.array_reader(a))
                for rank in range(tp):
                    bounds = [(0, n) for n in p.shape(cfg)]
                    if p.heads_axis is not None:
                        per = nh // tp
                        bounds[p.heads_axis] = (rank * per, (rank + 1) * per)
                    asked = []

                    def read(rows, cols, a=a, asked=asked):
                        asked.append((rows, cols))
                        return layout.array_reader(a)(rows, cols)

                    got = layout.read_param(cfg, t, p, read, bounds)
                    np.testing.assert_array_equal(got, whole[tuple(slice(*b) for b in bounds)])
                    # Only this rank's rows/columns of the HF tensor are read.
                    (rows, cols), = asked
                    read_elems = (rows[1] - rows[0]) * (1 if cols is None else cols[1] - cols[0])
                    if t.transform != "parts":
                        assert read_elems == got.size, (t.hf_name, tp)
                    else:  # each head's whole row group: w_uk and w_uv share the rows
                        assert read_elems == math.prod(t.hf_shape(cfg)) // tp
                    checked += 1
    assert checked


def test_any_block_is_the_slice_of_the_whole():
    cfg = CONFIGS["tiny8-bias"]
    hf = _random_hf(cfg, 1, seed=3)
    rng = np.random.default_rng(0)
    for t in layout.layer_tensors(cfg, 1):
        for p in t.params:
            whole = layout.read_param(cfg, t, p, layout.array_reader(hf[t.hf_name]))
            for _ in range(5):
                bounds = []
                for n in p.shape(cfg):
                    a, b = sorted(rng.integers(0, n + 1, 2))
                    bounds.append((int(a), int(b)))
                got = layout.read_param(cfg, t, p, layout.array_reader(hf[t.hf_name]), bounds)
                np.testing.assert_array_equal(got, whole[tuple(slice(*b) for b in bounds)])
    with pytest.raises(ValueError, match="do not fit"):
        t, p = layout.find_param(("w_uk",))
        layout.read_param(cfg, t, p, layout.array_reader(hf[t.hf_name]), [(0, 99), (0, 1), (0, 1)])


def test_checkpoint_saved_under_the_old_name_restores(tmp_path):
    import orbax.checkpoint as ocp

    cfg = CONFIGS["tiny8-bias"]
    layers = {i: gd.DsaAttention(cfg, i, rngs=nnx.Rngs(i), param_dtype=np.float32) for i in (1, 2)}
    new = ck.save_checkpoint(layers, tmp_path / "new")
    # What the previous version wrote: the same arrays and digests, kv_a_proj under its HF name.
    old = tmp_path / "old"
    tree = {f"layer_{i}": nnx.to_pure_dict(nnx.state(l, nnx.Param)) for i, l in layers.items()}
    for t in tree.values():
        t["kv_a_proj_with_mqa"] = t.pop("kv_a_proj")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(old / "params", tree)
    ckptr.wait_until_finished()
    meta = json.loads((new / ck.META_FILE).read_text())
    meta["checksums"] = {k.replace(".kv_a_proj", ".kv_a_proj_with_mqa", 1) if k.endswith(".kv_a_proj") else k: v
                         for k, v in meta["checksums"].items()}
    assert sum(k.endswith(".kv_a_proj_with_mqa") for k in meta["checksums"]) == 2
    (old / ck.META_FILE).write_text(json.dumps(meta))

    mesh = jax.make_mesh((4,), ("tp",))
    for restored in (ck.restore_checkpoint(old), ck.restore_checkpoint(old, mesh)):
        for i, layer in layers.items():
            assert isinstance(restored[i].kv_a_proj, nnx.Param)
            want, got = gd.params_to_hf(layer), gd.params_to_hf(restored[i])
            assert want.keys() == got.keys()
            for n in want:
                np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    # The old name's digest is still checked.
    meta["checksums"]["layer_1.kv_a_proj_with_mqa"] = "0" * 16
    (old / ck.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ck.CheckpointError, match="layer_1.kv_a_proj_with_mqa: digest"):
        ck.restore_checkpoint(old)
