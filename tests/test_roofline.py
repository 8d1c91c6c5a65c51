"""The roofline model: its numbers are consistent with each other, with the layer and with
the kernels' tiling, and ``glm5-dsa roofline`` prints and parses."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.tools import roofline as rl
from glm5_dsa_jax.cli import main
import pallas_kernels as pk
from pallas_kernels import IndexScoresBlockSizes, SparseMlaBlockSizes

CFG = gd.DsaConfig.glm53_flash()


def _by(rows, phase):
    return {r.kernel: r for r in rows if r.phase == phase}


def test_totals_are_the_sums():
    rows = rl.rows(CFG, "h200", 131072, 2, chunk=256)
    for phase in ("decode", "prefill"):
        by = _by(rows, phase)
        parts = [r for k, r in by.items() if k != "total"]
        assert by["total"].bytes == sum(r.bytes for r in parts)
        assert by["total"].flops == sum(r.flops for r in parts)
        assert by["total"].bound_s == pytest.approx(sum(r.bound_s for r in parts))
        assert {"kpool_compress", "index_scores", "topk_pools", "expand_selection",
                "sparse_mla", "xla:o_proj"} <= set(by)
        for r in parts:  # the bound is the larger of the two times
            spec = rl.GPUS["h200"]
            assert r.bound_s == pytest.approx(max(r.bytes / spec.bandwidth, r.flops / spec.peak_flops))


def test_index_scores_linear_and_sparse_mla_constant_in_context():
    ctx = [16384, 32768, 65536, 131072]
    scores = [_by(rl.rows(CFG, "h100", n, 1, phases=("decode",)), "decode")["index_scores"].bytes
              for n in ctx]
    steps = [b - a for a, b in zip(scores, scores[1:])]
    assert steps[1] == 2 * steps[0] and steps[2] == 2 * steps[1]  # affine in the context
    mla = {_by(rl.rows(CFG, "h100", n, 1, phases=("decode",)), "decode")["sparse_mla"].bytes
           for n in ctx + [1 << 20]}
    assert len(mla) == 1  # index_topk tokens whatever the context
    # a prefill chunk re-reads every pool's key once per query tile of the kernel
    one = _by(rl.rows(CFG, "h100", 65536, 1, chunk=16), "prefill")["index_scores"].bytes
    four = _by(rl.rows(CFG, "h100", 65536, 1, chunk=64), "prefill")["index_scores"].bytes
    pools, d = 65536 // 4, CFG.index_head_dim
    keys = pools * (d * 2 + 1)
    assert four - one == 3 * keys + 48 * (CFG.index_n_heads * (d * 2 + 4) + pools * 4)


def test_weight_bytes_are_the_layers_and_the_projections_read_them():
    cfg = gd.DsaConfig.tiny()
    layer = gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    stored = sum(a.nbytes for a in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    assert rl.weight_bytes(cfg, 2) == stored
    dec = _by(rl.rows(CFG, "a100", 4096, 1, phases=("decode",)), "decode")
    w = sum(r.bytes for k, r in dec.items() if k.startswith("xla:"))
    mm = sum(e for e, _, _ in rl.matmul_weights(CFG).values()) * 2
    assert mm <= w < mm * 1.01  # the weights, plus one token's activations
    assert rl.weight_bytes(CFG, 2) - mm < 20_000  # the rest: norms and the pool APE
    floor = rl.step_read_bytes(CFG, 16384, 1)
    assert floor["weights"] == rl.weight_bytes(CFG, 2)
    assert floor["cache"] == 4096 * 128 * 2 + 2048 * 512 * 2


@pytest.mark.lowering
@pytest.mark.parametrize("context", [4096, 1 << 20])
def test_programs_follow_the_kernels_grids(context):
    """The programs column equals the grid the kernel really launches (lowered for CUDA)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels._common import lower_for_cuda, triton_calls
    from pallas_kernels import topk_pools

    dec = _by(rl.rows(CFG, "h200", context, 1, phases=("decode",)), "decode")
    pools = context // CFG.index_kpool
    calls = triton_calls(lower_for_cuda(
        lambda s: topk_pools(s, CFG.select_k(pools), implementation="pallas"),
        jax.ShapeDtypeStruct((1, 1, pools), jnp.float32),
    ))
    grid = lambda c: c["grid"][0] * c["grid"][1] * c["grid"][2]
    assert dec["topk_pools"].programs == max(grid(c) for c in calls)
    assert dec["topk_pools"].programs == (1 if context == 4096 else 128)
    assert dec["index_scores"].programs == pools // 64  # block_p = 64 pools per program
    assert dec["sparse_mla"].programs >= 4  # at least the 64 / 16 head blocks


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="context"):
        rl.rows(CFG, "h100", 0, 1)
    with pytest.raises(ValueError, match="chunk"):
        rl.rows(CFG, "h100", 100, 1, chunk=200)


def test_cli_table_and_json(capsys):
    assert main(["roofline", "--gpu", "h200", "--context", "4096", "--batch", "1",
                 "--preset", "glm53_flash"]) == 0
    out = capsys.readouterr().out
    assert "4.8 TB/s" in out and "sparse_mla" in out and "total" in out
    assert main(["roofline", "--gpu", "b200", "--context", "2048", "--preset", "tiny", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["bandwidth"] == 8e12 and res["peak_flops"] == 2250e12
    kernels = [r["kernel"] for r in res["rows"] if r["phase"] == "prefill"]
    assert kernels[-1] == "total" and "index_scores" in kernels
    assert main(["roofline", "--gpu", "h100", "--context", "0"]) == 2


def test_cli_gpu_defaults_to_this_hosts(monkeypatch, capsys):
    """Without ``--gpu`` the roofline bounds the host's own GPU when the table names it (on an
    H200: its 4.8 TB/s), and is refused, naming the flag, where there is none."""
    from glm5_dsa_jax.cli import roofline as cli_roofline

    monkeypatch.setattr(cli_roofline, "this_gpu", lambda: "h200")
    assert main(["roofline", "--context", "4096", "--preset", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bandwidth"] == 4.8e12
    monkeypatch.setattr(cli_roofline, "this_gpu", lambda: None)
    assert main(["roofline", "--context", "4096", "--preset", "tiny"]) == 2
    assert "--gpu is required" in capsys.readouterr().err


# ---------------------------------------------------------------------------- model widths
ROPE_PRESETS = ("glm5", "glm52", "deepseek-v32")

# glm5-dsa roofline --gpu h200 --context N at GLM-5.3-Flash, as docs/benchmarks.md prints them
# (rounded there); exact here, so a refactor of the model cannot move them.
GLM53_DECODE_131072 = {
    "xla:q_a_proj": (12594176, 12582912), "xla:q_b_proj": (50367488, 50331648),
    "xla:w_uk (absorb_q)": (16875520, 16777216), "xla:kv_a_proj_with_mqa": (4203520, 4194304),
    "xla:w_uv (absorb_o)": (16875520, 16777216), "xla:o_proj": (134258688, 134217728),
    "xla:indexer.wq_b": (12594176, 12582912), "xla:indexer.wk": (1057024, 1048576),
    "xla:indexer.weights_proj": (270400, 262144), "xla:indexer.kpool_gate": (1057024, 1048576),
    "kpool_compress": (5125, 4096), "index_scores": (8560768, 271581184),
    "topk_pools": (1181696, 8388608), "expand_selection": (10264, 8204),
    "sparse_mla": (12763184, 269090816), "cache_write": (7177, 0), "total": (272681750, 798896140),
}
GLM53_TOTALS = {  # context -> (decode bytes, flops), (prefill bytes, flops)
    4096: ((263253782, 527675404), (18618022156, 1081076576256)),
    131072: ((272681750, 798896140), (22262741260, 1636536643584)),
    1048576: ((340806422, 2758684684), (48598776076, 5650183581696)),
}


def test_glm53_figures_unchanged():
    rows = rl.rows(CFG, "h200", 131072)
    dec = _by(rows, "decode")
    assert list(dec) == list(GLM53_DECODE_131072)  # docs/benchmarks.md's row order too
    assert {k: (r.bytes, r.flops) for k, r in dec.items()} == GLM53_DECODE_131072
    for context, (decode, prefill) in GLM53_TOTALS.items():
        rows = rl.rows(CFG, "h200", context)
        assert (_by(rows, "decode")["total"].bytes, _by(rows, "decode")["total"].flops) == decode
        assert (_by(rows, "prefill")["total"].bytes, _by(rows, "prefill")["total"].flops) == prefill
    # cache_dtype="bfloat16" is the default bf16 cache, number for number
    assert rl.rows(CFG, "h200", 131072, cache_dtype="bfloat16") == rl.rows(CFG, "h200", 131072)


def _readme_tables():
    """The roofline tables of docs/benchmarks.md: ``{(phase or "presets", first cell): [(MB, us,
    compute?) per column]}``."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[1] / "docs" / "benchmarks.md").read_text()
    section = text[text.index("## Roofline"):]
    section = section[:section.index("\n## ", 5)]
    out, table = {}, None
    for line in section.splitlines():
        for start, name in (("Decode step", "decode"), ("Prefill chunk", "prefill"), ("The other presets", "presets")):
            table = name if line.startswith(start) else table
        m = re.match(r"\| (`[^|]+|\*\*total\*\*) \|(.*)\|$", line)
        if m and table:
            cells = [re.match(r"\s*([\d,.]+) / ([\d,.]+)( c)?\s*$", c) for c in m.group(2).split("|")]
            out[(table, m.group(1).replace("`", "").replace("**", ""))] = [
                (float(c[1].replace(",", "")), float(c[2].replace(",", "")), bool(c[3])) for c in cells]
    return out


def _cell(r):
    return round(r.bytes / 1e6, 2), round(r.bound_s * 1e6, 2), r.limit == "compute"


def test_readme_tables_are_the_model():
    tables = _readme_tables()
    assert len(tables) == 2 * 17 + 5
    by_context = [rl.rows(CFG, "h200", n) for n in (4096, 131072, 1048576)]
    for (table, kernel), cells in tables.items():
        if table == "presets":
            preset, cache_dtype = kernel.split(", ")
            cfg = gd.DsaConfig.preset(preset)
            mid = rl.rows(cfg, "h200", 131072, cache_dtype=cache_dtype)
            long = _by(rl.rows(cfg, "h200", 1 << 20, cache_dtype=cache_dtype, phases=("decode",)), "decode")
            want = [_by(mid, "decode")["sparse_mla"], _by(mid, "decode")["total"], long["total"],
                    _by(mid, "prefill")["sparse_mla"], _by(mid, "prefill")["total"]]
        else:
            want = [_by(rows, table)[kernel] for rows in by_context]
        assert [_cell(r) for r in want] == cells, (table, kernel)


def _layer_shapes(cfg):
    """A real layer of ``cfg`` built abstractly (``nnx.eval_shape``): ``{param path:
    shape}`` and the shapes of one decode token's ``q_resid``, ``q_lat``, cache row and
    ``sparse_attention`` output."""
    layer = nnx.eval_shape(lambda: gd.DsaAttention(cfg, cfg.dsa_layers[0], rngs=nnx.Rngs(0)))
    params = {tuple(str(k) for k in path): tuple(v.shape)
              for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    graphdef, state = nnx.split(layer)

    def step(state, x):
        lay = nnx.merge(graphdef, state)
        q_resid, q_lat, latent = lay.project(x, lay.rope(jnp.zeros((1, 1), jnp.int32)))
        o_lat = lay.sparse_attention(q_lat, latent, jnp.zeros((1, 1, cfg.out_width), jnp.int32))
        return q_resid, q_lat, latent, o_lat

    x = jax.ShapeDtypeStruct((1, 1, cfg.hidden_size), jnp.bfloat16)
    return params, *(a.shape for a in jax.eval_shape(step, state, x))


@pytest.mark.parametrize("preset", ["glm53-flash", *ROPE_PRESETS])
def test_matmuls_are_the_layers_products(preset):
    """The products are the parameters of a real layer at the preset's dims, each read
    whole, and their widths are the activations the layer computes."""
    cfg = gd.DsaConfig.preset(preset)
    shapes, q_resid, q_lat, latent, o_lat = _layer_shapes(cfg)
    mms = rl.matmuls(cfg)
    for m in mms:
        assert m.weights == math.prod(shapes[m.path]), m.name
        per_head = cfg.num_attention_heads if m.path in (("w_uk",), ("w_uv",)) else 1
        assert m.fin * m.fout == m.weights * per_head, m.name
    # every matrix of the layer is a product, but the k-pool APE (added to the gate logits,
    # only in a model type with k-pool compression)
    ape = {("indexer", "kpool_ape")} & set(shapes)
    assert bool(ape) == cfg.rules.kpool_compression
    assert {m.path for m in mms} == {p for p, s in shapes.items() if len(s) >= 2} - ape
    assert len(mms) == len({m.path for m in mms}) == (10 if ape else 9)
    assert rl.matmul_weights(cfg) == {m.name: (m.weights, m.fin, m.fout) for m in mms}
    # widths: the absorbed query, the cache row and the attention output of the layer
    by = {m.name: m for m in mms}
    assert by["q_a_proj"].fout == q_resid[-1]
    assert by["kv_a_proj_with_mqa"].fout == latent[-1] == cfg.kv_cache_dim
    assert by["w_uk (absorb_q)"].fout + cfg.num_attention_heads * cfg.qk_rope_head_dim == math.prod(q_lat[2:])
    assert by["w_uv (absorb_o)"].fin == math.prod(o_lat[2:])
    assert by["o_proj"].fout == cfg.hidden_size


@pytest.mark.parametrize("preset", ROPE_PRESETS)
def test_rope_models_count_their_widths_and_kpool_1(preset):
    cfg = gd.DsaConfig.preset(preset)
    assert cfg.kv_cache_dim == 576 and cfg.kv_lora_rank == 512 and cfg.index_kpool == 1
    assert not cfg.rules.kpool_compression
    context = 65536
    dec = _by(rl.rows(cfg, "h200", context, 1, phases=("decode",)), "decode")
    assert "xla:indexer.kpool_gate" not in dec  # no gate tensor in the model type
    # the widths sparse_mla reads and writes, from the layer's own shapes
    _, _, q_lat, latent, o_lat = _layer_shapes(cfg)
    h, cr, v = q_lat[2], latent[-1], o_lat[-1]
    assert (q_lat[-1], cr, v) == (576, 576, 512)
    blk = SparseMlaBlockSizes().resolve((1, 1, h, cr), cfg.out_width)
    n_hb, ids = -(-h // blk.block_h), cfg.index_topk  # every id valid at this context
    partials = 2 * blk.num_splits * h * (v + 2) * 4 if blk.num_splits > 1 else 0
    want = n_hb * ids * cr * 2 + n_hb * cfg.out_width * 4 + h * (cr + v) * 2 + partials
    assert dec["sparse_mla"].bytes == want
    assert dec["sparse_mla"].flops == h * ids * (2 * cr + 2 * v + 5)
    # kpool 1: a pool is a token, the indexer scans every token of the cache
    assert dec["index_scores"].programs == context // IndexScoresBlockSizes().resolve(1, context).block_p
    assert dec["cache_write"].bytes == cr * 2 + 1 + cfg.index_head_dim * (2 + 4) * 2 + 2
    floor = rl.step_read_bytes(cfg, context, 1)
    assert floor["cache"] == context * cfg.index_head_dim * 2 + ids * cr * 2


@pytest.mark.parametrize("preset", ["glm53-flash", "glm5"])
def test_fp8_cache_counts_e4m3_rows_and_scales(preset):
    cfg = gd.DsaConfig.preset(preset)
    bf = _by(rl.rows(cfg, "h200", 65536, 2, chunk=64), "prefill")
    f8 = _by(rl.rows(cfg, "h200", 65536, 2, chunk=64, cache_dtype="fp8"), "prefill")
    cr, d = cfg.kv_cache_dim, cfg.index_head_dim
    h = cfg.num_attention_heads
    n_hb = -(-h // SparseMlaBlockSizes().resolve((2, 64, h, cr), cfg.out_width).block_h)
    ids = sum(rl.selected_ids(cfg, 65536 - 64 + 1 + t) for t in range(64))
    assert bf["sparse_mla"].bytes - f8["sparse_mla"].bytes == 2 * n_hb * ids * (cr * 2 - (cr + 4))
    pools = 65536 // cfg.index_kpool
    q_tiles = -(-64 // IndexScoresBlockSizes().resolve(64, pools).block_q)
    assert bf["index_scores"].bytes - f8["index_scores"].bytes == 2 * q_tiles * pools * (d * 2 - (d + 4))
    assert bf["cache_write"].bytes - f8["cache_write"].bytes == 2 * 64 * (cr * 2 - (cr + 4))
    for k in bf:  # the projections, the pooling, the top-k and FLOPs do not move
        if k not in ("sparse_mla", "index_scores", "cache_write", "total"):
            assert bf[k] == f8[k], k
    assert rl.cache_row_bytes(576, 2, "fp8") == 580 and rl.cache_row_bytes(576, 2, None) == 1152
    with pytest.raises(ValueError, match="cache dtype"):
        rl.rows(cfg, "h200", 4096, cache_dtype="int8")


def test_cli_rope_preset_and_fp8(capsys):
    assert main(["roofline", "--gpu", "h200", "--context", "8192", "--preset", "deepseek-v32",
                 "--cache-dtype", "fp8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["cache_dtype"] == "fp8" and res["preset"] == "deepseek-v32"
    cfg = gd.DsaConfig.preset("deepseek-v32")
    want = rl.rows(cfg, "h200", 8192, chunk=2048, cache_dtype="fp8")
    assert res["rows"] == [r.as_dict() for r in want]
    assert main(["roofline", "--gpu", "h200", "--context", "8192", "--preset", "glm52"]) == 0
    out = capsys.readouterr().out
    assert "glm_moe_dsa" in out and "kpool_gate" not in out and "bfloat16 cache" in out


# ---------------------------------------------------------------------------- training
def test_train_phases_totals_and_indexer_rows():
    for indexer_loss in (False, True):
        rows = rl.train_rows(CFG, "h200", 4096, 2, indexer_loss=indexer_loss)
        assert [r.phase for r in rows if r.kernel == "total"] == list(rl.TRAIN_PHASES)
        for phase in rl.TRAIN_PHASES:
            by = _by(rows, phase)
            parts = [r for k, r in by.items() if k != "total"]
            assert by["total"].bytes == sum(r.bytes for r in parts)
            assert by["total"].flops == sum(r.flops for r in parts)
            assert by["total"].bound_s == pytest.approx(sum(r.bound_s for r in parts))
        bwd = _by(rows, "train_bwd")
        indexer = {k for k in bwd if "index" in k or "kpool" in k}
        assert bool(indexer) == indexer_loss, indexer
        assert {"sparse_mla_bwd:dq", "sparse_mla_bwd:dlatent", "selection_transpose",
                "xla:lse_delta", "xla:o_proj bwd"} <= set(bwd)
    # The indexer's backward (with an indexer loss): one dq/dw program per query over the
    # pools it sees (causal: about half of S x P), every query re-read per dpooled tile.
    s, pools, hi, d = 4096, 4096 // CFG.index_kpool, CFG.index_n_heads, CFG.index_head_dim
    seen = sum((q + 1) // CFG.index_kpool for q in range(s))
    sblk = pk.IndexScoresBackwardBlockSizes().resolve(s, pools)
    assert sblk.dq_block_q == 1 and bwd["index_scores_bwd:dq_dw"].programs == 2 * s
    assert bwd["index_scores_bwd:dq_dw"].flops == 2 * seen * hi * (4 * d + 2)
    assert bwd["index_scores_bwd:dpooled"].flops == 2 * s * pools * hi * 4 * d
    assert bwd["index_scores_bwd:dpooled"].programs == 2 * pools // sblk.dk_block_p
    # The forward is the prefill of the whole sequence, plus the lse sparse_mla saves.
    fwd = _by(rows, "train_fwd")
    pre = _by(rl.rows(CFG, "h200", 4096, 2, chunk=4096, phases=("prefill",)), "prefill")
    assert fwd["sparse_mla"].bytes == pre["sparse_mla"].bytes + 2 * 4096 * CFG.num_attention_heads * 4
    assert fwd["index_scores"] == dataclasses.replace(pre["index_scores"], phase="train_fwd")
    assert "cache_write" not in fwd
    # A projection's backward is dX and dW: twice its forward FLOPs.
    for m in rl.matmuls(CFG):
        assert bwd[f"xla:{m.name} bwd"].flops == 2 * fwd[f"xla:{m.name}"].flops


def test_train_dense_mask_is_quadratic_and_sparse_attention_linear():
    a, b = (rl.train_rows(CFG, "h100", s) for s in (16384, 32768))
    for kernel in ("xla:masked_mla_fwd", "xla:masked_mla_bwd"):
        ra, rb = _by(a, "dense_mask")[kernel], _by(b, "dense_mask")[kernel]
        assert rb.flops / ra.flops == pytest.approx(4, rel=1e-3)
        assert 3.9 < rb.bytes / ra.bytes <= 4
    h, s, cr, v = CFG.num_attention_heads, 16384, CFG.kv_cache_dim, CFG.kv_lora_rank
    assert _by(a, "dense_mask")["xla:masked_mla_fwd"].flops == 2 * h * s * s * (cr + v) + 5 * h * s * s
    # dq: every query past index_topk tokens reads its 2,051 rows: linear in the context
    # (the first index_topk queries read fewer: a little over 2x).
    dq_a, dq_b = _by(a, "train_bwd")["sparse_mla_bwd:dq"], _by(b, "train_bwd")["sparse_mla_bwd:dq"]
    assert 2 < dq_b.flops / dq_a.flops < 2.1


def test_train_dlatent_entries_reread_q_and_d_out():
    """The token-major pass re-reads a query's q and d_out once per row block it touches:
    while a query selects every pool (context <= index_topk), that is every visible block."""
    cfg = gd.DsaConfig.tiny()
    s, h, cr, v = 16, cfg.num_attention_heads, cfg.kv_cache_dim, cfg.kv_lora_rank
    br = pk.SparseMlaBackwardBlockSizes().resolve((1, s, h, cr), cfg.out_width).block_rows
    assert s <= cfg.index_topk and br >= s
    # A query at position q sees q + 1 tokens, q // KP... complete pools: one row block
    # holds them all once it has one complete pool (q >= 3).
    entries = sum(1 if (q + 1) // cfg.index_kpool else 0 for q in range(s))
    row = _by(rl.train_rows(cfg, "h200", s, elem_bytes=4), "train_bwd")["sparse_mla_bwd:dlatent"]
    assert row.bytes == (2 * br * cr * 4 + 8) + entries * (h * (cr + v) * 4 + h * 8 + 8)
    assert row.flops == entries * br * h * (4 * cr + 4 * v) and row.programs == 1
    # Past index_topk the selection is spread: fewer blocks than visible, more than selected / (pools a block).
    br = pk.SparseMlaBackwardBlockSizes().resolve((1, 65536, CFG.num_attention_heads, CFG.kv_cache_dim),
                                                  CFG.out_width).block_rows
    exp = rl._expected_blocks(CFG, 65536, br)
    assert CFG.max_select_k / (br // CFG.index_kpool) < exp < 65536 / br


def test_cli_train(capsys):
    assert main(["roofline", "--gpu", "h200", "--context", "4096", "--train"]) == 0
    out = capsys.readouterr().out
    assert "train_bwd" in out and "sparse_mla_bwd:dlatent" in out and "dense_mask" in out
    assert "attention forward + backward: sparse" in out and "no indexer loss" in out
    assert main(["roofline", "--gpu", "h100", "--context", "2048", "--preset", "tiny", "--train",
                 "--indexer-loss", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["train"] and res["indexer_loss"]
    assert {r["phase"] for r in res["rows"]} == set(rl.TRAIN_PHASES)
    assert any(r["kernel"] == "index_scores_bwd:dpooled" for r in res["rows"])
    sparse = sum(r["bound_s"] for r in res["rows"] if r["kernel"] in
                 ("sparse_mla", "xla:lse_delta", "sparse_mla_bwd:dq", "selection_transpose",
                  "sparse_mla_bwd:dlatent"))
    assert res["sparse_attention_s"] == pytest.approx(sparse)
    for argv, says in ((["--train", "--chunk", "64"], "--chunk is a prefill flag"),
                       (["--train", "--cache-dtype", "fp8"], "a training step keeps no cache"),
                       (["--indexer-loss"], "--indexer-loss needs --train")):
        assert main(["roofline", "--gpu", "h200", "--context", "4096", *argv]) == 2
        assert says in capsys.readouterr().err


def test_training_table_is_the_model():
    """docs/benchmarks.md's training roofline table, recomputed: every cell (H200, batch 1)."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[1] / "docs" / "benchmarks.md").read_text()
    section = text[text.index("## Training roofline"):]
    section = section[:section.index("\n## ", 5)]
    head = re.search(r"\| phase/row \|(.*)\|$", section, re.M).group(1)
    contexts = [int(c.split(":")[0].replace(",", "")) for c in head.split("|")]
    by = [{(r.phase, r.kernel): r for r in rl.train_rows(CFG, "h200", n)} for n in contexts]
    rows = re.findall(r"^\| `([^/`]+)/([^`]+)` \|(.*)\|$", section, re.M)
    assert len(rows) == 12 and contexts == [4096, 16384, 65536]
    for phase, kernel, cells in rows:
        got = [re.match(r"\s*([\d,.]+) / ([\d,.]+)( c)?\s*$", c) for c in cells.split("|")]
        got = [(float(c[1].replace(",", "")), float(c[2].replace(",", "")), bool(c[3])) for c in got]
        assert got == [_cell(b[phase, kernel]) for b in by], (phase, kernel)


@pytest.mark.parametrize("preset", ["glm53-flash", "glm5"])
def test_step_flops_is_the_decode_rows_work_without_their_elementwise_terms(preset):
    """``step_flops`` (the compute half of the bench's floor) against the decode rows: the
    projections are theirs; the attention is ``sparse_mla``'s products (its ``+ 5`` per
    token and head is the softmax's element-wise work); the index scores are
    ``index_scores``' products and head weights (its ``+ 3``: ReLU and the mask) where the
    selection matters, and nothing where every visible pool is selected."""
    cfg = gd.DsaConfig.preset(preset)
    kp, hi, d = cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim
    h, cr, v = cfg.num_attention_heads, cfg.kv_cache_dim, cfg.kv_lora_rank
    short = cfg.max_select_k * kp  # the longest context whose pools are all selected
    for context, batch in ((short, 1), (short + kp, 3), (131072, 2)):
        dec = _by(rl.rows(cfg, "h200", context, batch, phases=("decode",)), "decode")
        f = rl.step_flops(cfg, context, batch)
        assert f["projections"] == sum(r.flops for k, r in dec.items() if k.startswith("xla:"))
        ids = rl.selected_ids(cfg, context)
        assert f["attention"] * (2 * cr + 2 * v + 5) == dec["sparse_mla"].flops * (2 * cr + 2 * v)
        assert f["index"] * (2 * d + 3) == (0 if context <= short else dec["index_scores"].flops * (2 * d + 2))
        assert f["total"] == f["projections"] + f["index"] + f["attention"]
        dense = rl.step_flops(cfg, context, batch, dense=True)
        assert dense["index"] == 0 and dense["attention"] == batch * h * context * (2 * cr + 2 * v)
        assert dense["projections"] == 2 * batch * sum(m.weights for m in rl.matmuls(cfg, has_indexer=False))
        assert ids <= context and f["attention"] == batch * h * ids * (2 * cr + 2 * v)


def test_rows_carry_their_memory_and_compute_parts():
    rs = rl.rows(CFG, "h200", 131072, 8)
    spec = rl.GPUS["h200"]
    for r in rs:
        assert (r.memory_s, r.compute_s) == (pytest.approx(r.bytes / spec.bandwidth), pytest.approx(r.flops / spec.peak_flops))
        assert r.limit == ("memory" if r.memory_s >= r.compute_s else "compute")
        if r.kernel != "total":
            assert r.bound_s == max(r.memory_s, r.compute_s)
    for phase in ("decode", "prefill"):
        kernels = [r for r in rs if r.phase == phase]
        assert kernels[-1].bound_s == pytest.approx(sum(r.bound_s for r in kernels[:-1]))
