"""The roofline model: its numbers are consistent with each other, with the layer and with
the kernels' tiling, and ``glm5-dsa roofline`` prints and parses."""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax import roofline as rl
from glm5_dsa_jax.cli import main

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
