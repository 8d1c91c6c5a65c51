"""Tensor parallelism: the plan as data, PartitionSpecs, placement and sharded execution.

Runs on the 8 virtual CPU devices of conftest.py. Float32 throughout.

Tolerance: a sharded layer computes the same ops on the same values as the unsharded one,
except that the row-parallel ``o_proj`` contraction over ``heads * v_head`` is split into
per-rank partial sums that are then all-reduced, a different summation order (and XLA may
block the smaller per-shard dots differently). At these widths that moves float32 results
by ~1e-6, so outputs are compared at ``atol = rtol = 1e-5``, still far below what a wrong
head, token or mask would cause (O(0.1)). Top-k rows are compared bit for bit: the indexer
is replicated and computes the same scores in the same order on every device and TP size.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import glm5_dsa_jax as gd
from glm5_dsa_jax.parallel import sharding as sh
from glm5_dsa_jax.decode import DsaDecoder
from helpers import F32_REORDER, f32_layer, jitted_call, padded_batch
from helpers import tiny8 as tiny_cfg  # 8 heads: every TP size up to 8 divides them
from helpers import tp_mesh as make_mesh

ATOL = RTOL = F32_REORDER
TP_SIZES = (1, 2, 4, 8)
MODES = ("explicit", "auto")
B, S, MAX_LEN, DECODE_STEPS = 3, 13, 24, 3


def make_layer(cfg, layer_idx=1, implementation="xla", param_dtype=jnp.float32):
    # block_q=8: two prefill tiles of 8
    return f32_layer(cfg, layer_idx, implementation=implementation, param_dtype=param_dtype, block_q=8)


def inputs(cfg, seed=0):
    # left padding of different depths
    return padded_batch(cfg, (0, 3, 7), S + DECODE_STEPS, seed)


def prefill_fn(layer):
    """The no-cache call, jitted (split once, merge inside the trace)."""
    f, state = jitted_call(layer)
    return lambda x, mask: f(state, x, attention_mask=mask), f, state


def run(layer):
    """Prefill without a cache, then the decode engine: one chunk of S, DECODE_STEPS steps."""
    cfg = layer.cfg
    x, mask = inputs(cfg)
    prefill, _, _ = prefill_fn(layer)
    out, topk = prefill(x[:, :S], mask[:, :S])
    dec = DsaDecoder(layer, B, MAX_LEN)
    steps = [dec(x[:, :S], mask[:, :S])]
    for t in range(S, S + DECODE_STEPS):
        steps.append(dec(x[:, t:t + 1], mask[:, t:t + 1]))
    return (out, topk), steps, dec


def to_np(a):
    return np.asarray(a)


@pytest.fixture(scope="module")
def reference():
    (out, topk), steps, _ = run(make_layer(tiny_cfg()))
    return to_np(out), to_np(topk), [(to_np(o), to_np(t)) for o, t in steps]


def assert_replicated_identical(a, want):
    """Every device holds the whole array, bit-identical to ``want``."""
    assert a.sharding.is_fully_replicated
    assert len(a.addressable_shards) == len(a.sharding.device_set)
    for shard in a.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want)


# ------------------------------------------------------------------------------- plan
def test_plan_figures_glm53_flash():
    cfg = gd.DsaConfig.glm53_flash()
    assert cfg.index_kpool == 4
    plan = sh.TpPlan.build(cfg, 0, 8)
    d, hi, h, r = cfg.index_head_dim, cfg.index_n_heads, cfg.hidden_size, cfg.q_lora_rank
    indexer = (hi * d * r + d * h + d + d + hi * h + d * h + cfg.index_kpool * d) * 2
    assert plan.indexer_bytes == indexer == 14_943_744  # "about 15 MB per layer"
    assert 14.5e6 < plan.indexer_bytes < 15.5e6
    assert plan.indexer_allreduce_bytes(context=262_144) == 65_536 * 4 == 256 * 1024
    assert plan.indexer_allreduce_bytes(context=262_144, q_rows=3) == 3 * 256 * 1024
    assert plan.full_heads == 64 and plan.local_heads == 8
    assert plan.needs_output_all_reduce
    assert not sh.TpPlan.build(cfg, 0, 1).needs_output_all_reduce
    assert plan.output_allreduce_bytes(tokens=1) == h * 2
    # Every indexer tensor, kv_a_proj and the down-projections are replicated.
    kinds = {t.name: t.kind for t in plan.tensors}
    assert all(k is sh.ShardKind.REPLICATED for n, k in kinds.items() if n.startswith("indexer."))
    for n in ("q_a_proj", "q_a_layernorm", "kv_a_proj", "kv_a_layernorm"):  # our parameter names
        assert plan[n].kind is sh.ShardKind.REPLICATED
    assert kinds["q_b_proj"] is kinds["kv_b_proj"] is sh.ShardKind.HEAD_ROWS
    assert kinds["o_proj"] is sh.ShardKind.HEAD_COLS


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 64])
def test_plan_arithmetic(tp):
    cfg = gd.DsaConfig.glm53_flash()
    plans = sh.TpPlan.all_ranks(cfg, tp)
    full = plans[0].full_bytes
    nh, qk, nope, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    for rank, plan in enumerate(plans):
        assert plan.tp_rank == rank and plan.local_heads == nh // tp
        assert plan.replicated_bytes == plans[0].replicated_bytes
        assert plan.local_bytes == plan.replicated_bytes + (full - plan.replicated_bytes) // tp
        # Offsets: q_b_proj and kv_b_proj slice rows at their own per-head strides.
        assert plan["q_b_proj"].src_offset == (rank * (nh // tp) * qk, 0)
        assert plan["kv_b_proj"].src_offset == (rank * (nh // tp) * (nope + v), 0)
        assert plan["o_proj"].src_offset == (0, rank * (nh // tp) * v)
        assert plan["o_proj"].local_shape == (cfg.hidden_size, nh // tp * v)
        assert plan["indexer.wq_b"].local_shape == plan["indexer.wq_b"].full_shape
    # The shards of each tensor tile it exactly.
    for name in ("q_b_proj", "kv_b_proj", "o_proj"):
        assert sum(p[name].local_bytes for p in plans) == plans[0][name].full_bytes


def test_plan_names_match_hf_and_our_layout():
    cfg = tiny_cfg()
    plan = sh.TpPlan.build(cfg, 0, 2, elem_bytes=4)
    assert {t.hf_name for t in plan.tensors} == set(gd.hf_weight_shapes(cfg, 1))
    for t in plan.tensors:
        assert gd.hf_weight_shapes(cfg, 1)[t.hf_name] == t.full_shape
    assert plan.get("kv_b_proj").params == ("w_uk", "w_uv")
    assert plan.get("w_uv") is plan.get("kv_b_proj.weight") is plan["kv_b_proj"]
    assert plan.get("indexer/kpool_gate").hf_name == "indexer.index_kpool_compress_gate"
    with pytest.raises(KeyError, match="nope"):
        plan.get("nope")
    # A 'shared' indexer layer has no indexer tensors.
    shared = sh.TpPlan.build(cfg, 0, 2, layer_idx=2)
    assert not any(t.indexer for t in shared.tensors) and shared.indexer_bytes == 0
    # Biases (attention_bias) are replicated; o_proj's is added after the all-reduce.
    biased = sh.TpPlan.build(cfg.replace(attention_bias=True), 0, 2)
    assert biased["o_proj.bias"].kind is sh.ShardKind.REPLICATED
    assert {t.hf_name for t in biased.tensors} == set(gd.hf_weight_shapes(cfg.replace(attention_bias=True), 1))


def test_plan_display():
    plan = sh.TpPlan.build(gd.DsaConfig.glm53_flash(), 3, 8)
    text = plan.table()
    for needle in ("q_b_proj", "HeadRows", "HeadCols", "indexer.wq_b", "rank 3 of 8", "w_uk[tp, -, -]"):
        assert needle in text
    assert str(plan) == text
    html = plan._repr_html_()
    assert "<table>" in html and "indexer.index_kpool_compress_ape" in html
    rows = plan.to_rows()
    assert len(rows) == len(plan.tensors) and rows[2]["name"] == "q_b_proj"
    assert rows[2]["local_shape"] == [2048, 1536] and rows[2]["src_offset"] == [3 * 2048, 0]
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["local_bytes"] == plan.local_bytes and d["needs_output_all_reduce"] is True


def test_plan_bad_input():
    cfg = gd.DsaConfig.glm53_flash()
    with pytest.raises(ValueError, match=r"tp_rank 8 .*tp_size=8"):
        sh.TpPlan.build(cfg, 8, 8)
    with pytest.raises(ValueError, match=r"tp_rank -1"):
        sh.TpPlan.build(cfg, -1, 8)
    with pytest.raises(ValueError, match=r"tp_size 3 does not divide num_attention_heads=64"):
        sh.TpPlan.build(cfg, 0, 3)
    with pytest.raises(ValueError, match=r"tp_size must be >= 1"):
        sh.TpPlan.build(cfg, 0, 0)
    with pytest.raises(ValueError, match=r"tp_size must be an int"):
        sh.TpPlan.build(cfg, 0, 2.0)


def test_cli_plan(capsys):
    from glm5_dsa_jax.cli import main

    assert main(["plan", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "q_b_proj" in out and "per-rank totals" in out and "rank 7:" in out
    # The default context is max_position_embeddings (1,048,576 here): 262,144 pools.
    assert "1.00 MiB per decode token per layer at 1,048,576 tokens" in out
    assert main(["plan", "--tp", "4", "--context", "262144"]) == 0
    assert "256.00 KiB per decode token" in capsys.readouterr().out
    assert main(["plan", "--tp", "2", "--preset", "tiny", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tp_size"] == 2 and len(d["per_rank_local_bytes"]) == 2
    assert main(["plan", "--tp", "3"]) == 2
    assert "does not divide num_attention_heads=64" in capsys.readouterr().err


def test_cli_plan_config_file(tmp_path, capsys):
    from glm5_dsa_jax.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": tiny_cfg().to_hf_dict()}))
    assert main(["plan", "--tp", "8", "--config", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["full_heads"] == 8 and d["local_heads"] == 1


# ------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("preset", ["tiny", "glm53-flash"])
def test_partition_specs_match_layer_metadata(preset):
    cfg = gd.DsaConfig.preset(preset)
    for layer_idx in cfg.dsa_layers[:2]:
        layer = nnx.eval_shape(lambda: gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0)))
        meta = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
        flat = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(meta)}
        specs = sh.partition_specs(cfg, layer_idx=layer_idx)
        assert flat == specs
        heads = {p for p, s in specs.items() if "tp" in tuple(s)}
        assert heads == {("q_b_proj",), ("w_uk",), ("w_uv",), ("o_proj",)}
    assert sh.partition_specs(cfg, "model")[("o_proj",)] == P("model", None, None)


# ------------------------------------------------------------------------------- placement
@pytest.mark.parametrize("tp", TP_SIZES)
def test_placement_matches_plan(tp):
    """Default bf16 params: every sharding is the plan's; each device holds its plan bytes."""
    cfg = tiny_cfg()
    layer = make_layer(cfg, param_dtype=jnp.bfloat16)
    mesh = make_mesh(tp)
    assert sh.shard_layer(layer, mesh) is layer
    assert layer.mesh is mesh and layer.tp_axis == "tp"
    plans = sh.TpPlan.all_ranks(cfg, tp)  # bf16: 2 bytes per element
    variables = dict(sh._param_vars(layer))
    held = {d: 0 for d in mesh.devices.flat}
    for plan_t in plans[0].tensors:
        for path_str, spec in zip(plan_t.params, plan_t.param_specs):
            var = variables[tuple(path_str.split("/"))]
            a = var[...]
            assert a.sharding == NamedSharding(mesh, spec), path_str
            assert var.get_metadata()["out_sharding"] == tuple(spec)
    for rank, dev in enumerate(mesh.devices.flat):
        for t in plans[rank].tensors:
            got, offsets = 0, []
            for path_str in t.params:
                a = variables[tuple(path_str.split("/"))][...]
                (shard,) = [s for s in a.addressable_shards if s.device == dev]
                got += shard.data.nbytes
                offsets.append(shard.index)
            assert got == t.local_bytes, (t.name, rank)
            held[dev] += got
            if t.kind is not sh.ShardKind.REPLICATED:
                # This device's head range starts where the plan's source offset says.
                head_dim = {"q_b_proj": 1, "kv_b_proj": 0, "o_proj": 0}[t.name]
                start = offsets[0][head_dim].start or 0
                stride = {"q_b_proj": cfg.qk_head_dim,
                          "kv_b_proj": cfg.qk_nope_head_dim + cfg.v_head_dim,
                          "o_proj": cfg.v_head_dim}[t.name]
                axis = 0 if t.kind is sh.ShardKind.HEAD_ROWS else 1
                assert start * stride == t.src_offset[axis], t.name
        assert held[dev] == plans[rank].local_bytes
    total = sum(s.data.nbytes for _, v in variables.items() for s in v[...].addressable_shards)
    assert total == sum(p.local_bytes for p in plans)


def test_placement_survives_split_merge_and_caches_are_replicated():
    cfg = tiny_cfg()
    layer = make_layer(cfg)
    mesh = make_mesh(4, "auto")
    sh.shard_layer(layer, mesh)
    graphdef, state = nnx.split(layer)
    specs = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.get_partition_spec(state))}
    assert specs == sh.partition_specs(cfg)
    merged = nnx.merge(graphdef, state)
    assert merged.mesh == mesh
    assert merged.o_proj[...].sharding == NamedSharding(mesh, P("tp", None, None))
    assert sh.param_shardings(merged)[("q_b_proj",)] == NamedSharding(mesh, P(None, "tp", None))
    # What an orbax restore target is built from: the shardings in the Param metadata.
    named = nnx.get_named_sharding(nnx.state(merged, nnx.Param), mesh)
    for path, v in nnx.to_flat_state(named):
        assert v.get_value() == NamedSharding(mesh, specs[tuple(path)])
    cache = merged.init_cache(2, 16)
    for leaf in jax.tree.leaves(cache):
        assert leaf.sharding == NamedSharding(mesh, P())
    assert jax.tree.leaves(sh.cache_shardings(cache, mesh))[0] == NamedSharding(mesh, P())
    # Placing again on the same mesh is a no-op.
    before = layer.q_b_proj[...]
    sh.shard_layer(layer, mesh)
    assert layer.q_b_proj[...] is before
    # A layer whose parameters were put on the mesh already (a checkpoint restored onto it)
    # is adopted without a copy.
    restored = make_layer(cfg)
    for path, var in sh._param_vars(restored):
        var.set_value(jax.device_put(var[...], NamedSharding(mesh, specs[path])))
    arrays = {path: var[...] for path, var in sh._param_vars(restored)}
    sh.shard_layer(restored, mesh)
    assert all(var[...] is arrays[path] for path, var in sh._param_vars(restored))
    assert restored.mesh == mesh
    assert repr(sh.TpPlan.build(cfg, 1, 4)).startswith("TpPlan(rank 1 of 4, 2/8 heads")


def test_shard_layer_bad_input():
    cfg = tiny_cfg()
    layer = make_layer(cfg)
    with pytest.raises(ValueError, match=r"no axis 'tp'.*\('data',\)|\('data',\).*no axis 'tp'"):
        sh.shard_layer(layer, make_mesh(8, name="data"))
    with pytest.raises(ValueError, match=r"axis 'tp' of size 3 does not divide num_attention_heads=8.*q_b_proj"):
        sh.shard_layer(layer, make_mesh(3))
    with pytest.raises(ValueError, match="concrete jax.sharding.Mesh"):
        sh.shard_layer(layer, make_mesh(2).abstract_mesh)
    assert layer.mesh is None  # nothing placed by a refused call
    mesh = make_mesh(2)
    sh.shard_layer(layer, mesh)
    other = jax.make_mesh((2,), ("tp",), devices=jax.devices()[2:4])
    with pytest.raises(ValueError, match=r"already placed on mesh .*'tp': 2.*devices \[0, 1\].*\[2, 3\]"):
        sh.shard_layer(layer, other)
    with pytest.raises(ValueError, match=r"already placed.*axis 'tp'.*axis 'model'"):
        sh.shard_layer(layer, make_mesh(2, name="model"), axis="model")
    # A parameter a user put on another mesh by hand is named.
    fresh = make_layer(cfg)
    fresh.w_uk.set_value(jax.device_put(fresh.w_uk[...], NamedSharding(other, P("tp"))))
    with pytest.raises(ValueError, match=r"parameter 'w_uk' .*already on another mesh"):
        sh.shard_layer(fresh, mesh)
    with pytest.raises(ValueError, match="not placed"):
        sh.param_shardings(make_layer(cfg))


# ------------------------------------------------------------------------------- execution
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_sharded_prefill_and_decode_equal_unsharded(tp, mode, reference):
    ref_out, ref_topk, ref_steps = reference
    layer = make_layer(tiny_cfg())
    mesh = make_mesh(tp, mode)
    sh.shard_layer(layer, mesh)
    (out, topk), steps, dec = run(layer)
    assert out.sharding.mesh == mesh and topk.sharding.mesh == mesh
    np.testing.assert_allclose(to_np(out), ref_out, atol=ATOL, rtol=RTOL)
    assert_replicated_identical(topk, ref_topk)  # bit-identical to TP=1 on every device
    assert (ref_topk[2, :7] == -1).all()  # the padded rows really are padding
    for (o, t), (ro, rt) in zip(steps, ref_steps):
        np.testing.assert_allclose(to_np(o), ro, atol=ATOL, rtol=RTOL)
        assert_replicated_identical(t, rt)
    # The decode cache never left its replicated placement.
    for leaf in jax.tree.leaves(dec.cache):
        assert leaf.sharding.is_fully_replicated and leaf.sharding.mesh == mesh


@pytest.mark.parametrize("mode", MODES)
def test_one_all_reduce_no_gather(mode):
    """Compiled prefill and decode step: the o_proj output is all-reduced once, no cache
    (nor anything else) is all-gathered, and the attention kernel runs under shard_map."""
    cfg = tiny_cfg()
    layer = make_layer(cfg)
    sh.shard_layer(layer, make_mesh(4, mode))
    x, mask = inputs(cfg)
    _, f, state = prefill_fn(layer)
    jaxpr = str(jax.make_jaxpr(f)(state, x[:, :S], attention_mask=mask[:, :S]))
    assert "shard_map" in jaxpr
    hlo = f.lower(state, x[:, :S], attention_mask=mask[:, :S]).compile().as_text()
    assert hlo.count("all-reduce(") + hlo.count("all-reduce-start(") == 1
    assert "all-gather" not in hlo
    dec = DsaDecoder(layer, B, MAX_LEN)
    hlo = dec.step.lower(dec.params, x[:, :1], mask[:, :1], dec.cache).compile().as_text()
    assert hlo.count("all-reduce(") + hlo.count("all-reduce-start(") == 1
    assert "all-gather" not in hlo


def test_eager_call_on_explicit_mesh(reference):
    """The un-jitted public call on a placed layer (Explicit axes) and selection_scores."""
    ref_out, ref_topk, _ = reference
    cfg = tiny_cfg()
    layer = make_layer(cfg)
    sh.shard_layer(layer, make_mesh(2))
    x, mask = inputs(cfg)
    out, topk = layer(x[:, :S], attention_mask=mask[:, :S])
    np.testing.assert_allclose(to_np(out), ref_out, atol=ATOL, rtol=RTOL)
    assert_replicated_identical(topk, ref_topk)
    scores, _ = layer.selection_scores(x[:, :S], mask[:, :S])
    ref_scores, _ = make_layer(cfg).selection_scores(x[:, :S], mask[:, :S])
    assert_replicated_identical(scores, to_np(ref_scores))


def test_shared_indexer_layer_sharded(reference):
    """A 'shared' layer (no indexer) attends over the top-k of the full layer, sharded."""
    _, ref_topk, _ = reference
    cfg = tiny_cfg()
    x, mask = inputs(cfg)
    want, _ = make_layer(cfg, layer_idx=2)(x[:, :S], attention_mask=mask[:, :S], prev_topk=ref_topk)
    layer = make_layer(cfg, layer_idx=2)
    sh.shard_layer(layer, make_mesh(8))
    f, state = jitted_call(layer)
    out, topk = f(state, x[:, :S], attention_mask=mask[:, :S], prev_topk=ref_topk)
    np.testing.assert_allclose(to_np(out), to_np(want), atol=ATOL, rtol=RTOL)
    np.testing.assert_array_equal(to_np(topk), ref_topk)


@pytest.mark.parametrize("mode,tp", [("explicit", 4), ("auto", 2)])
def test_pallas_interpret_under_shard_map(mode, tp, reference):
    """The Pallas kernels (interpret mode): sparse MLA per head shard, the indexer kernels
    per device on replicated inputs, all under shard_map; equal to the unsharded XLA run."""
    ref_out, ref_topk, ref_steps = reference
    layer = make_layer(tiny_cfg(), implementation="pallas_interpret")
    sh.shard_layer(layer, make_mesh(tp, mode))
    (out, topk), steps, _ = run(layer)
    np.testing.assert_allclose(to_np(out), ref_out, atol=ATOL, rtol=RTOL)
    assert_replicated_identical(topk, ref_topk)
    for (o, t), (ro, rt) in zip(steps, ref_steps):
        np.testing.assert_allclose(to_np(o), ro, atol=ATOL, rtol=RTOL)
        assert_replicated_identical(t, rt)


@pytest.mark.e2e
# ------------------------------------------------------------------------------- notebook
def test_notebook_runs(tmp_path, monkeypatch):
    """notebooks/sharding.ipynb runs top to bottom in a fresh kernel of this interpreter."""
    import importlib.util
    import os
    import sys

    import nbclient
    import nbformat

    # the kernel the notebook runs in: the test extra installs all three, never skipped
    assert importlib.util.find_spec("ipykernel") is not None, "ipykernel is not installed"

    # A kernel spec for *this* interpreter, so the notebook runs in the test's environment
    # whatever kernel specs the machine has (a fresh CI venv may have none usable).
    spec_dir = tmp_path / "kernels" / "glm5-dsa-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "glm5-dsa-jax test", "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "notebooks", "sharding.ipynb")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="glm5-dsa-test",
        resources={"metadata": {"path": os.path.join(root, "notebooks")}},
    )
    client.execute()  # raises CellExecutionError on any failing cell
    text = "\n".join(
        o.get("text", "") + json.dumps(o.get("data", {}))
        for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "14.9 MB" in text and "256 KiB per decode token" in text
    assert "8 devices hold identical top-k: True; equal to unsharded: True" in text
    assert "image/png" in text  # the bytes-per-rank plot
    assert text.count("TpPlan") >= 4  # the four plan tables
    assert "all-reduce: 1 | all-gather: 0" in text
    # 5. data parallelism, 6. the selection picture (bf16 and fp8 caches); public API only.
    assert "top-k equal to unsharded: True" in text and "data=2 x tp=4" in text
    assert text.count("image/png") >= 2 and "cells selected by bf16" in text
    # 7. training the indexer: the loss and captured-mass plot, and the mass rising.
    m = re.search(r"captured mass on held-out prompts: before ([0-9.]+), after ([0-9.]+)", text)
    assert m and float(m.group(2)) > float(m.group(1)) + 0.15, m
    assert text.count("image/png") >= 3
    # 8. context parallelism: equal to unsharded, each cp device a quarter of the slots and pools.
    assert "context parallelism, cp=4 x tp=2: top-k equal to unsharded: True" in text
    assert re.search(r"\n +6 +3 +0 +48 - +63 12 - 15 +0 +[\d,]+ B", text), "device 6: slots 48-63, pools 12-15"
    m = re.search(r"per device: ([\d,]+) B of cache at cp 4 against ([\d,]+) B at cp 1", text)
    assert m and 3 < int(m.group(2).replace(",", "")) / int(m.group(1).replace(",", "")) < 4, m
    # 9. the paged cache under cp: equal to unsharded; the pages round-robin over the cp devices.
    assert "paged cache, cp=4 x tp=2: top-k equal to unsharded: True" in text
    assert re.search(r"\n +0 +1 +8-15 +4 +1\n", text), "sequence 0's logical page 1: physical page 4 on cp device 1"
    assert re.search(r"\n +1 +4 +32-34 +6 +1\n", text), "sequence 1's last page: physical page 6 on cp device 1"
    assert "pages taken per cp device: [3, 3, 2, 2] of 4 each" in text
    m = re.search(r"per device: ([\d,]+) B of paged cache at cp 4 against ([\d,]+) B at cp 1", text)
    assert m and 2 < int(m.group(2).replace(",", "")) / int(m.group(1).replace(",", "")) < 4, m
    code = "".join(c.source for c in nb.cells if c.cell_type == "code")
    assert not re.search(r"\._[a-z]", code), "the notebook reaches a private name"
