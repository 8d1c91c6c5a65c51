"""Data-parallel attention (issue 11): ``shard_layer(layer, mesh, axis="tp", batch_axis="data")``
on the 8 virtual CPU devices of conftest.py, against the unsharded layer. Float32 throughout.

What is compared: the no-cache prefill, and a prefill chunk then decode steps on both cache
kinds (``DsaDecoder`` / ``PagedDecoder``: one compilation, donated cache), on ("data", "tp")
= (2, 4) and (4, 2), ``Explicit`` and ``Auto`` axes, ``"xla"`` and ``"pallas_interpret"``.

Tolerance: the same as ``test_sharding`` (``atol = rtol = 1e-5``) for the same reason: each
device computes its sequences' rows with the unsharded layer's ops on the same values,
except that the ``o_proj`` contraction over ``heads * v_head`` is split into per-tp-rank
partial sums that are then all-reduced (another summation order, ~1e-6 in float32 at these
widths; a wrong head, token, row or mask moves outputs by O(0.1)). Top-k rows are compared
bit for bit: the indexer is replicated within a tp group and a row's scores do not depend
on the other rows of the batch.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import glm5_dsa_jax as gd
from glm5_dsa_jax.parallel import sharding as sh
from glm5_dsa_jax.cache.pages import init_page_table
from helpers import F32_REORDER, f32_layer, jitted_call, padded_batch
from helpers import dp_mesh as mesh_of
from helpers import tiny8 as cfg  # 8 heads: tp 2 and 4 divide them
from test_layer_steps import backend_compiles

ATOL = RTOL = F32_REORDER
B, S, STEPS, MAX_LEN = 4, 24, 3, 32
PAGE, NUM_PAGES, PAGES_PER_SEQ = 8, 16, 4  # 32 tokens a sequence: the contiguous cache's select_k


def inputs():
    # Left padding of different depths: every data shard sees padding.
    return padded_batch(cfg(), (0, 3, 7, 1), S + STEPS, seed=0)


def layer_of(implementation="xla", layer_idx=1):
    return f32_layer(cfg(), layer_idx, implementation=implementation, block_q=8)


def run(layer, kinds=("prefill", "contiguous", "paged"), steps=STEPS, cache_dtype=None, **fmt):
    """No-cache prefill (jitted), then the decoders: a chunk of S, then ``steps`` steps
    (caches of ``cache_dtype``, default the layer's; ``fmt``: an fp8 cache's format keywords)."""
    x, mask = inputs()
    res = {}
    if "prefill" in kinds:
        f, state = jitted_call(layer)
        res["prefill"] = [f(state, x[:, :S], attention_mask=mask[:, :S])]
    decoders = {"contiguous": lambda: gd.DsaDecoder(layer, B, MAX_LEN, cache_dtype=cache_dtype, **fmt),
                "paged": lambda: gd.PagedDecoder(layer, B, NUM_PAGES, PAGE, pages_per_seq=PAGES_PER_SEQ,
                                                 cache_dtype=cache_dtype, **fmt)}
    made = {}
    for name in ("contiguous", "paged"):
        if name in kinds:
            d = made[name] = decoders[name]()
            res[name] = [d(x[:, :S], mask[:, :S])]
            res[name] += [d(x[:, t:t + 1], mask[:, t:t + 1]) for t in range(S, S + steps)]
    return jax.tree.map(np.asarray, res), made


@pytest.fixture(scope="module")
def reference():
    return run(layer_of())[0]


def assert_equal_results(got, want):
    assert got.keys() == want.keys()
    for kind in want:
        for i, ((o, t), (o0, t0)) in enumerate(zip(got[kind], want[kind], strict=True)):
            np.testing.assert_array_equal(t, t0, err_msg=f"{kind} call {i}: top-k")
            np.testing.assert_allclose(o, o0, atol=ATOL, rtol=RTOL, err_msg=f"{kind} call {i}")


def check_placement(mesh, made):
    """Caches stay split by sequence; each data shard's page table is a valid table of its
    own pages and the counts add up."""
    dp = mesh.shape["data"]
    for c in (d.cache for d in made.values()):
        for a, want in zip(jax.tree.leaves(c), jax.tree.leaves(sh.cache_shardings(c, mesh, "data"))):
            assert a.sharding.is_equivalent_to(want, a.ndim)
    if "contiguous" in made:
        assert made["contiguous"].cache.length.sharding.is_fully_replicated
    if "paged" in made:
        pages = made["paged"].cache.pages
        pages.check()
        n_free, table = np.asarray(pages.n_free), np.asarray(pages.block_table)
        used = [(table[k * B // dp:(k + 1) * B // dp] >= 0).sum() for k in range(dp)]
        assert n_free.shape == (dp,) and (n_free + used == NUM_PAGES // dp).all()


@pytest.mark.parametrize("shape,mode,kinds", [
    ((2, 4), "explicit", ("prefill", "contiguous", "paged")), ((4, 2), "auto", ("contiguous", "paged"))])
@pytest.mark.slow
def test_dp_equals_unsharded(shape, mode, kinds, reference):
    mesh = mesh_of(shape, mode)
    layer = sh.shard_layer(layer_of(), mesh, "tp", batch_axis="data")
    got, made = run(layer, kinds)
    assert_equal_results(got, {k: reference[k] for k in kinds})
    assert all(d.step.traces == 2 for d in made.values())  # the chunk, then every decode step
    check_placement(mesh, made)


@pytest.mark.parametrize("index_keys", ["e4m3", "int8"])
@pytest.mark.slow
def test_dp_fp8_caches_equal_unsharded(index_keys):
    """fp8 caches split by sequence: the row scales (``latent_scale``, ``pooled_scale``: e4m3
    keys' one a pool, int8 keys' ``[.., G]``) go with their rows to each data shard; top-k and
    outputs as the unsharded fp8 layer's."""
    kinds = ("contiguous", "paged")
    want, _ = run(layer_of(), kinds, steps=1, cache_dtype="fp8", index_keys=index_keys)
    mesh = mesh_of((2, 4), "explicit")
    layer = sh.shard_layer(layer_of(), mesh, "tp", batch_axis="data")
    got, made = run(layer, kinds, steps=1, cache_dtype="fp8", index_keys=index_keys)
    assert_equal_results(got, want)
    assert all(d.cache.is_fp8 and d.cache.latent_scale is not None for d in made.values())
    assert all(d.cache.index_format.keys == index_keys for d in made.values())
    check_placement(mesh, made)


@pytest.mark.slow
def test_dp_pallas_interpret_equals_unsharded():
    """The Pallas kernels (interpret mode) run per device inside the data-parallel call,
    reading the paged pools through local page ids."""
    kinds = ("paged",)
    want, _ = run(layer_of("pallas_interpret"), kinds, steps=1)
    mesh = mesh_of((4, 2), "explicit")
    got, made = run(sh.shard_layer(layer_of("pallas_interpret"), mesh, "tp", batch_axis="data"), kinds, steps=1)
    assert_equal_results(got, want)
    check_placement(mesh, made)


def test_eager_calls_and_shared_layer(reference):
    """Eager (no jit) calls of a placed full layer on its own cache, and of its shared layer
    (``prev_topk`` split like the rows): the same numbers, one compiled program per shape."""
    mesh = mesh_of((2, 4), "auto")
    x, mask = inputs()
    full = sh.shard_layer(layer_of(), mesh, "tp", batch_axis="data")
    cache = full.init_cache(B, MAX_LEN)
    assert cache.latent_store.sharding.spec[0] == "data" and cache.length.sharding.is_fully_replicated
    for i, sl in enumerate((slice(0, S), slice(S, S + 1), slice(S + 1, S + 2))):
        with backend_compiles() as seen:
            out, topk, cache = full(x[:, sl], attention_mask=mask[:, sl], cache=cache)
        o0, t0 = reference["contiguous"][i]
        np.testing.assert_array_equal(np.asarray(topk), t0)
        np.testing.assert_allclose(np.asarray(out), o0, atol=ATOL, rtol=RTOL)
    assert len(seen) == 0, f"the second eager decode step compiled {len(seen)} XLA programs"
    assert out.sharding.spec[0] == "data"
    prev = reference["prefill"][0][1]
    shared = sh.shard_layer(layer_of(layer_idx=2), mesh, "tp", batch_axis="data")
    o, t = shared(x[:, :S], attention_mask=mask[:, :S], prev_topk=prev)
    f, state = jitted_call(layer_of(layer_idx=2))
    o0, t0 = f(state, x[:, :S], attention_mask=mask[:, :S], prev_topk=prev)
    np.testing.assert_array_equal(np.asarray(t), np.asarray(t0))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o0), atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------- collectives
def replica_groups(line: str, mesh) -> list[list[int]]:
    """The replica groups of one HLO collective, as device ids: the list form
    ``{{0,1},{2,3}}`` (jax 0.10), or the mesh form ``mesh['data'=2,'tp'=4] {'tp'}`` (0.12)."""
    m = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
    if m:
        return sorted(sorted(int(i) for i in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", m.group(1)))
    m = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
    assert m, f"unknown replica_groups form: {line}"
    axes = [a.strip().strip("'") for a in m.group(1).split(",")]
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    keep = [i for i, n in enumerate(mesh.axis_names) if n not in axes]
    groups = np.moveaxis(ids, keep, list(range(len(keep))))
    groups = groups.reshape(int(np.prod([ids.shape[i] for i in keep])), -1)
    return sorted(sorted(int(i) for i in g) for g in groups)


def collectives(hlo: str) -> dict[str, list[str]]:
    ops = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")
    lines = hlo.splitlines()
    return {op: [ln for ln in lines if re.search(rf"= \S+ {op}(-start)?\(", ln)] for op in ops}


@pytest.mark.parametrize("mode", ("explicit", "auto"))
def test_decode_step_has_one_all_reduce_within_tp(mode):
    """The compiled decode step of each cache kind: one all-reduce (the o_proj output), its
    groups the tp groups; no all-gather, permute or all-to-all (no cache moves)."""
    mesh = mesh_of((2, 4), mode)
    layer = sh.shard_layer(layer_of(), mesh, "tp", batch_axis="data")
    x, mask = inputs()
    tp_groups = sorted(sorted(d.id for d in row) for row in mesh.devices)
    for dec in (gd.DsaDecoder(layer, B, MAX_LEN), gd.PagedDecoder(layer, B, NUM_PAGES, PAGE)):
        hlo = dec.step.lower(dec.params, x[:, :1], mask[:, :1], dec.cache).compile().as_text()
        found = collectives(hlo)
        assert {op: len(v) for op, v in found.items()} == {
            "all-reduce": 1, "all-gather": 0, "collective-permute": 0, "all-to-all": 0,
            "reduce-scatter": 0}, found
        assert replica_groups(found["all-reduce"][0], mesh) == tp_groups


def test_replica_group_parser():
    mesh = mesh_of((2, 4), "explicit")
    a = "x = f32[2] all-reduce(y), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=f"
    b = "x = f32[2] all-reduce(y), replica_groups=mesh['data'=2,'tp'=4] {'tp'}, use_global"
    c = "x = f32[2] all-reduce(y), replica_groups=mesh['data'=2,'tp'=4] {'data'}, use_global"
    assert replica_groups(a, mesh) == replica_groups(b, mesh) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups(c, mesh) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert len(collectives(a)["all-reduce"]) == 1 and not collectives(a)["all-gather"]


# ------------------------------------------------------------------------------- paged bookkeeping
def test_paged_release_and_room_per_shard():
    mesh = mesh_of((2, 4), "explicit")
    layer = sh.shard_layer(layer_of(), mesh, "tp", batch_axis="data")
    dec = gd.PagedDecoder(layer, B, NUM_PAGES, PAGE)  # a shard's 8 pages: 64 tokens a sequence
    assert dec.cache.pages_per_seq == NUM_PAGES // 2
    x, _ = inputs()
    first = np.arange(3 * PAGE) < 2 * PAGE
    dec(x[:, :3 * PAGE], np.broadcast_to(first, (B, 3 * PAGE)))  # 2 pages each: 4 left per shard
    assert np.asarray(dec.cache.pages.n_free).tolist() == [4, 4]
    dec.release(np.array([False, True, False, False]))  # a global row mask: row 1, in shard 0
    assert np.asarray(dec.cache.pages.n_free).tolist() == [6, 4]
    assert np.asarray(dec.cache.lengths).tolist() == [16, 0, 16, 16]
    dec.cache.pages.check()
    table = np.asarray(dec.cache.block_table)
    assert (table < NUM_PAGES // 2).all() and sorted(table[2:][table[2:] >= 0]) == [0, 1, 2, 3]
    # Rows 2 and 3 (shard 1) want 3 more pages each: shard 1 has 4, and shard 0's 6 free
    # pages are not theirs. Refused before anything runs, naming the shard.
    grow = np.zeros((B, 3 * PAGE), bool)
    grow[2:] = True
    with pytest.raises(ValueError, match=r"sequence 3 needs 3 more page\(s\) of 8 tokens but only 1 "
                                         r"are free in data shard 1"):
        dec(x[:, :3 * PAGE], grow)
    grow[3] = False
    dec(x[:, :3 * PAGE], grow)  # row 2 alone fits
    assert np.asarray(dec.cache.pages.n_free).tolist() == [6, 1]
    assert np.asarray(dec.cache.lengths).tolist() == [16, 0, 40, 16]


RESERVE = jax.jit(lambda t, n: t.reserve(n))  # one compilation per table shape
RELEASE = jax.jit(lambda t, rows: t.release(rows))


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 20), min_size=4, max_size=4)),
                    min_size=1, max_size=6))
def test_sharded_page_table_is_independent_tables(ops):
    """A 2-shard table behaves as two one-shard tables of half the rows and pages, side by
    side (reserve statuses, lengths, local block tables, free stacks)."""
    big = init_page_table(4, 12, 4, 4, shards=2)
    halves = [init_page_table(2, 6, 4, 4) for _ in range(2)]
    for release, n in ops:
        n = np.asarray(n, np.int32)
        if release:
            rows = n % 2 == 1
            big = RELEASE(big, rows)
            halves = [RELEASE(h, rows[2 * k:2 * k + 2]) for k, h in enumerate(halves)]
        else:
            big, status = RESERVE(big, n)
            parts = [RESERVE(h, n[2 * k:2 * k + 2]) for k, h in enumerate(halves)]
            halves = [p[0] for p in parts]
            np.testing.assert_array_equal(status, np.concatenate([p[1] for p in parts]))
        big.check()
        for k, h in enumerate(halves):
            local = big.shard(k)
            np.testing.assert_array_equal(local.block_table, h.block_table)
            np.testing.assert_array_equal(local.lengths, h.lengths)
            assert int(local.n_free) == int(h.n_free)
            np.testing.assert_array_equal(local.free[:int(h.n_free)], np.asarray(h.free)[:int(h.n_free)])


# ------------------------------------------------------------------------------- bad input
def test_bad_input():
    mesh = mesh_of((2, 4), "explicit")
    with pytest.raises(ValueError, match=r"no axis 'data'.*split the batch"):
        sh.shard_layer(layer_of(), jax.make_mesh((8,), ("tp",)), "tp", batch_axis="data")
    with pytest.raises(ValueError, match=r"batch_axis and axis are both 'tp'"):
        sh.shard_layer(layer_of(), mesh, "tp", batch_axis="tp")
    layer = sh.shard_layer(layer_of(), mesh, "tp", batch_axis="data")
    with pytest.raises(ValueError, match=r"already placed.*batch_axis 'data'.*batch_axis None"):
        sh.shard_layer(layer, mesh, "tp")
    x, mask = inputs()
    with pytest.raises(ValueError, match=r"batch of 3 rows is not divisible by the 2 data shards of "
                                         r"mesh axis 'data'"):
        layer(x[:3, :4], attention_mask=mask[:3, :4])
    with pytest.raises(ValueError, match=r"the cache's batch of 3 sequences is not divisible by the 2 "
                                         r"data shards of mesh axis 'data'"):
        layer.init_cache(3, MAX_LEN)
    with pytest.raises(ValueError, match=r"max_seqs=4 and num_pages=15 must both divide by the 2 data shards"):
        layer.init_paged_cache(4, 15, PAGE)
    with pytest.raises(ValueError, match=r"max_seqs=3 and num_pages=16 must both divide by the 2 data shards"):
        layer.init_paged_cache(3, 16, PAGE)
    # A cache made for the unsharded layer, or placed for TP only, or on another mesh.
    plain = layer_of().init_cache(B, MAX_LEN)
    with pytest.raises(ValueError, match=r"cache field .*latent_store is on no mesh|not on the layer's mesh"):
        layer(x[:, :4], attention_mask=mask[:, :4], cache=plain)
    tp_only = sh.shard_layer(layer_of(), mesh, "tp").init_cache(B, MAX_LEN)
    with pytest.raises(ValueError, match=r"placed as \S*\(\) but a data-parallel layer needs \S*\('data',\)"):
        layer(x[:, :4], attention_mask=mask[:, :4], cache=tp_only)
    other = jax.make_mesh((2, 4), ("data", "tp"), devices=jax.devices()[::-1])
    moved = sh.place_cache(layer_of().init_cache(B, MAX_LEN), other, batch_axis="data")
    with pytest.raises(ValueError, match=r"not on the layer's mesh"):
        layer(x[:, :4], attention_mask=mask[:, :4], cache=moved)
    unsharded_pages = layer_of().init_paged_cache(B, NUM_PAGES, PAGE)
    with pytest.raises(ValueError, match=r"paged cache has 1 page shard\(s\) but mesh axis 'data' has 2"):
        layer(x[:, :4], attention_mask=mask[:, :4], cache=sh.place_cache(unsharded_pages, mesh))
    with pytest.raises(ValueError, match=r"1 page shard\(s\) but mesh axis 'data' has 2"):
        sh.place_cache(unsharded_pages, mesh, batch_axis="data")
    # Under jit with Explicit axes a traced cache's placement is checked too.
    f, state = jitted_call(layer)
    with pytest.raises(ValueError, match=r"placed as \S*\(\) but a data-parallel layer needs"):
        f(state, x[:, :4], attention_mask=mask[:, :4], cache=tp_only)


def test_selection_scores_on_dp_layer():
    """The notebook view of a prompt (``selection_scores``: the whole batch, replicated) on a
    data-parallel layer with ``Explicit`` axes: the unsharded layer's scores."""
    x, mask = inputs()
    want = layer_of().selection_scores(x[:, :8], mask[:, :8])
    layer = sh.shard_layer(layer_of(), mesh_of((2, 4), "explicit"), "tp", batch_axis="data")
    got = layer.selection_scores(x[:, :8], mask[:, :8])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
