"""Context parallelism's prefill selection (issue 27, deliverable 3): the query split.

A prefill chunk whose pools cost fewer bytes to gather than the candidates
(``context.splits_queries``) selects by the query split: the pool fields are all-gathered
(``contiguous.gathered_pools``) and each device runs the unsharded layer's ``choose_pools``
for its zig-zag rows of the chunk (``context.zigzag_split``); a decode step and a short
chunk keep the key split (candidates merged). Checked on the 8 virtual CPU devices:

* ``zigzag_split``: device ``i`` holds blocks ``i`` and ``2 cp - 1 - i`` of the padded
  chunk (padding rows filled as asked), and ``gathered`` puts every row back in order;
* the rule: a decode step never splits, a GLM-5.3-Flash prefill chunk at a 1M-token context
  on cp 8 does, a 4-token verify chunk there does not;
* chunks of both kinds (a long one, a 2-token one, another long one) then decode steps on
  (cp, tp) = (2, 4) and (4, 2) equal the unsharded layer (top-k bit for bit, outputs to
  float32 rounding);
* the compiled steps' collectives: a long chunk gathers the pool fields ``[B, P, D]`` and
  the chosen ids, and no candidates; a 2-token chunk the candidates and no pools;
* the paged cache the same way (``PagedCache.gathered_pools``: every pooled-key page
  gathered for a long chunk), against the unsharded paged layer;
* ``tools.cp_memory``'s rows (``scripts/cp_prefill_memory.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import glm5_dsa_jax as gd
from glm5_dsa_jax.parallel import context
from glm5_dsa_jax.parallel import sharding as sh
from helpers import F32_REORDER, f32_layer, padded_batch
from helpers import tiny8 as cfg

MAX_LEN = 64  # 16 pools; cp * kpool divides it for cp 2, 4
CHUNKS = (24, 2, 14)  # the 2-token chunk takes the key split
STEPS = 2
PAGES, PAGE = 16, 8  # the paged cache's: 16 pages of 8 tokens (2 pools each), 6 pages a row


def mesh_of(shape, names=("cp", "tp")):
    return jax.make_mesh(tuple(shape), names, axis_types=(AxisType.Explicit,) * len(shape))


@pytest.mark.parametrize("s, cp", [(40, 4), (16, 4), (5, 2), (3, 4)])
def test_zigzag_split_rows(s, cp):
    mesh = jax.make_mesh((cp,), ("cp",), axis_types=(AxisType.Explicit,))
    a = jnp.arange(2 * s, dtype=jnp.int32).reshape(2, s) + 1  # row r of sequence b: b * s + r + 1

    def body(a):
        rows_of, gathered = context.zigzag_split(s, cp, jax.lax.axis_index("cp"), "cp")
        mine = rows_of(a, -1)
        return mine[None], gathered(mine)

    mine, back = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P("cp"), P()), check_vma=False)(a)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(a))
    m = -(-s // (2 * cp))
    padded = np.pad(np.asarray(a), [(0, 0), (0, 2 * cp * m - s)], constant_values=-1)
    for i in range(cp):
        want = np.concatenate([padded[:, i * m:(i + 1) * m], padded[:, (2 * cp - 1 - i) * m:(2 * cp - i) * m]], 1)
        np.testing.assert_array_equal(np.asarray(mine)[i], want, err_msg=f"device {i}")


def test_splits_queries_rule():
    flash = gd.DsaConfig.preset("glm53-flash")
    cp, pools = 8, (1 << 20) // flash.index_kpool
    p_loc, k = pools // cp, flash.select_k(pools)
    pool_bytes = 2 * flash.index_head_dim + 1  # bf16 keys and a flag
    assert not context.splits_queries(1, cp, k, p_loc, pool_bytes)  # decode: candidates
    assert context.splits_queries(4096, cp, k, p_loc, pool_bytes)  # a prefill chunk: pools
    assert not context.splits_queries(4, cp, k, p_loc, pool_bytes)  # a short verify chunk: candidates
    assert not context.splits_queries(4096, 1, k, pools, pool_bytes)  # no sequence axis


def run(layer, batch=2, paged=False):
    """``CHUNKS`` then ``STEPS`` decode steps on a fresh cache (``paged``: ``PAGES`` pages of
    ``PAGE``): ``[(out, topk)]`` as numpy."""
    x, mask = padded_batch(cfg(), (0, 5, 2, 9)[:batch], sum(CHUNKS) + STEPS, seed=0)
    cache = layer.init_paged_cache(batch, PAGES, PAGE) if paged else layer.init_cache(batch, MAX_LEN)
    edges = np.cumsum((0,) + CHUNKS + (1,) * STEPS)
    res = []
    for a, b in zip(edges[:-1], edges[1:]):
        out, topk, cache = layer(x[:, a:b], attention_mask=mask[:, a:b], cache=cache)
        res.append((np.asarray(out), np.asarray(topk)))
    return res


@pytest.fixture(scope="module")
def reference():
    return run(f32_layer(cfg(), 1, block_q=8))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.slow
def test_both_selections_equal_unsharded(reference, shape):
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of(shape), axis="tp", seq_axis="cp")
    for i, ((o, t), (o0, t0)) in enumerate(zip(run(layer), reference, strict=True)):
        np.testing.assert_array_equal(t, t0, err_msg=f"call {i}: top-k")
        np.testing.assert_allclose(o, o0, atol=F32_REORDER, rtol=F32_REORDER, err_msg=f"call {i}: out")


def gathers(layer, chunk, paged=False):
    """The result types of the all-gathers in the compiled step of ``chunk`` tokens (of a
    ``PagedDecoder`` of ``PAGES`` pages when ``paged``)."""
    dec = gd.PagedDecoder(layer, 2, PAGES, PAGE) if paged else gd.DsaDecoder(layer, 2, MAX_LEN)
    x, mask = padded_batch(cfg(), (0, 5), chunk, seed=0)
    hlo = dec.step.lower(dec.params, x, mask, dec.cache).compile().as_text()
    found = [re.search(r"= (.*?) all-gather(?:-start)?\(", ln) for ln in hlo.splitlines()]
    return [re.sub(r"\{[\d,]+\}", "", m.group(1)) for m in found if m]


def test_long_chunk_gathers_pools_short_chunk_candidates():
    c, cp = cfg(), 4
    layer = sh.shard_layer(f32_layer(c, 1, block_q=8), mesh_of((cp, 2)), axis="tp", seq_axis="cp")
    pools, d, k = MAX_LEN // c.index_kpool, c.index_head_dim, c.max_select_k
    long, short = gathers(layer, 24), gathers(layer, 2)
    pooled, candidates = f"f32[2,{pools},{d}]", f"s32[2,2,{cp * k}]"
    assert any(pooled in t for t in long), long  # the pooled keys, every pool
    assert any(f"pred[2,{pools}]" in t for t in long), long  # their validity
    assert not any(t.startswith("s32[2,") and t.endswith(f",{cp * k}]") for t in long), long
    assert any(candidates in t for t in short), short
    assert not any(pooled in t for t in short), short


def test_cp_memory_tool_reports_the_split(capsys):
    """``tools.cp_memory`` (``scripts/cp_prefill_memory.py``'s rows): per device, the cache's
    bytes shrink with cp (arguments, the donated cache), and the rows say which selection
    ran; the script prints them as JSON."""
    import json
    import runpy

    script = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "cp_prefill_memory.py"))
    assert script["main"](["--preset", "tiny", "--context", "256", "--chunk", "32", "--cp", "1,4", "--json"]) == 0
    one, four = json.loads(capsys.readouterr().out)
    assert (one["cp"], one["selection"], four["cp"]) == (1, "unsharded", 4)
    assert four["selection"] == "query split"  # 32 rows, 16 pools a shard: the pools cost less
    assert four["argument_bytes"] < one["argument_bytes"], (one, four)
    assert four["alias_bytes"] < one["alias_bytes"], (one, four)  # the donated cache: its rows split


# ---------------------------------------------------------------------------- the paged cache
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.slow
def test_paged_both_selections_equal_unsharded(shape):
    """The paged cache's chunks (the query split: the pooled-key pages gathered; the 2-token
    chunk and the steps: the key split) equal the unsharded paged layer."""
    want = run(f32_layer(cfg(), 1, block_q=8), paged=True)
    layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh_of(shape), axis="tp", seq_axis="cp")
    for i, ((o, t), (o0, t0)) in enumerate(zip(run(layer, paged=True), want, strict=True)):
        np.testing.assert_array_equal(t, t0, err_msg=f"call {i}: top-k")
        np.testing.assert_allclose(o, o0, atol=F32_REORDER, rtol=F32_REORDER, err_msg=f"call {i}: out")


def test_paged_long_chunk_gathers_pages_short_chunk_candidates():
    c, cp = cfg(), 4
    layer = sh.shard_layer(f32_layer(c, 1, block_q=8), mesh_of((cp, 2)), axis="tp", seq_axis="cp")
    pages = f"f32[{PAGES},{PAGE // c.index_kpool},{c.index_head_dim}]"  # every pooled-key page
    long, short = gathers(layer, 24, paged=True), gathers(layer, 2, paged=True)
    assert any(pages in t for t in long), long
    assert not any(t.startswith("s32[2,") and t.endswith(f",{cp * c.max_select_k}]") for t in long), long
    assert any(f"s32[2,2,{cp * c.max_select_k}]" in t for t in short), short
    assert not any(pages in t for t in short), short
