"""Orbax restore onto a mesh with a ``cp`` axis (issue 27): a layer restored with
``restore_checkpoint(..., seq_axis="cp")`` and a contiguous cache restored with
``restore_cache(..., seq_axis="cp")`` decode equal to the unsharded layer; each device
reads only its ``1/cp`` of the cache's slots and pools. On the 8 virtual CPU devices of
conftest.py, float32, the tiny preset with 8 heads (kpool 4, select_k 4).

Compared: top-k rows bit for bit, outputs to ``F32_REORDER`` (the cp merge and the tp
all-reduce add in other orders), the restored cache's fields bit for bit. Bad input: a
capacity or batch that does not split, an axis missing, a paged cache: ``ValueError`` /
``TypeError`` naming the sizes, the checkpoint directory unchanged; a digest that does not
match: ``CheckpointError``. A bfloat16 cache saved as floats (a GPU's stored form) restores
on a CPU as its bits.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import glm5_dsa_jax as gd
from glm5_dsa_jax.checkpoint import META_FILE
from glm5_dsa_jax.parallel import sharding as sh
from helpers import F32_REORDER, f32_layer, padded_batch
from helpers import tiny8 as cfg

S, STEPS, MAX_LEN = 40, 3, 64  # a 40-token chunk (10 pools) then 3 decode steps; 64 slots split by cp 2 and 4
PADS = (0, 5)


def inputs():
    return padded_batch(cfg(), PADS, S + STEPS, seed=0)


def steps(layer, cache, spans):
    """``([(out, topk)] as numpy, cache)`` of ``layer`` over the token ``spans``."""
    x, mask = inputs()
    res = []
    for a, b in spans:
        out, topk, cache = layer(x[:, a:b], attention_mask=mask[:, a:b], cache=cache)
        res.append((np.asarray(out), np.asarray(topk)))
    return res, cache


CHUNK = [(0, S)]
DECODE = [(t, t + 1) for t in range(S, S + STEPS)]


def assert_same(got, want):
    for i, ((o, t), (o0, t0)) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(t, t0, err_msg=f"call {i}: top-k")
        np.testing.assert_allclose(o, o0, atol=F32_REORDER, rtol=F32_REORDER, err_msg=f"call {i}: out")


def assert_split(cache, cp):
    """Every token-axis field split on axis 1 over ``cp``: each device holds ``1/cp``."""
    for name in gd.DsaCache.TOKEN_AXIS_FIELDS:
        a = getattr(cache, name)
        if a is None:
            continue
        assert a.sharding.spec[1] == "cp", (name, a.sharding.spec)
        assert {s.data.shape[1] for s in a.addressable_shards} == {a.shape[1] // cp}, name


def assert_fields_equal(got, want):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert (got.dtype, got.kpool, got.latent_format, got.index_format) == (
        want.dtype, want.kpool, want.latent_format, want.index_format)


@pytest.fixture(scope="module")
def unsharded():
    """The unsharded layer's chunk then decode steps, and its cache after the chunk."""
    layer = f32_layer(cfg(), 1, block_q=8)
    chunk, cache = steps(layer, layer.init_cache(2, MAX_LEN), CHUNK)
    decode, _ = steps(layer, cache, DECODE)
    return layer, chunk + decode, cache


@pytest.mark.slow
def test_layer_restored_onto_cp_tp_mesh(unsharded, tmp_path):
    layer, want, _ = unsharded
    gd.save_checkpoint({1: layer}, tmp_path / "layer")
    mesh = jax.make_mesh((4, 2), ("cp", "tp"))
    back = gd.restore_checkpoint(tmp_path / "layer", mesh, axis="tp", seq_axis="cp", dtype="float32")[1]
    assert back.placement == sh.Placement(mesh, "tp", None, "cp")
    assert back.w_uv[...].sharding.spec[0] == "tp"
    got, cache = steps(back, back.init_cache(2, MAX_LEN), CHUNK + DECODE)
    assert_same(got, want)
    assert_split(cache, 4)


def test_cache_restored_split_over_cp_decodes_on(unsharded, tmp_path, shape=(4, 2)):
    """A prefilled cache saved unsharded, restored onto a (cp, tp) mesh split over cp; the
    cp layer's decode steps from it equal the unsharded layer's. Saved again from there
    (split) and restored unsharded: the same fields bit for bit."""
    layer, want, cache = unsharded
    gd.save_cache(cache, tmp_path / "c")
    mesh = jax.make_mesh(shape, ("cp", "tp"))
    split = gd.restore_cache(tmp_path / "c", mesh, seq_axis="cp")
    assert_split(split, shape[0])
    assert split.length.sharding.spec == P() and split.first_key.sharding.spec == P()
    assert_fields_equal(split, cache)
    cp_layer = sh.shard_layer(f32_layer(cfg(), 1, block_q=8), mesh, axis="tp", seq_axis="cp")
    got, after = steps(cp_layer, split, DECODE)
    assert_same(got, want[1:])
    assert_split(after, shape[0])
    gd.save_cache(after, tmp_path / "split")  # written shard by shard, read back whole
    whole = gd.restore_cache(tmp_path / "split")
    assert len(whole.latent_store.sharding.device_set) == 1
    assert_fields_equal(whole, after)


def test_fp8_cache_onto_data_cp_tp_mesh(tmp_path):
    """An fp8 cache (e4m3 rows, int8 pooled keys, their scales) restored onto (data, cp, tp)
    = (2, 2, 2): rows split by sequence over data, by slot over cp; fields bit for bit."""
    layer = f32_layer(cfg(), 1, block_q=8)
    _, cache = steps(layer, layer.init_cache(2, MAX_LEN, "fp8", index_keys="int8"), CHUNK)
    gd.save_cache(cache, tmp_path / "fp8")
    mesh = jax.make_mesh((2, 2, 2), ("data", "cp", "tp"))
    back = gd.restore_cache(tmp_path / "fp8", mesh, batch_axis="data", seq_axis="cp")
    assert back.is_fp8 and back.index_format.keys == "int8"
    assert_split(back, 2)
    assert back.latent_scale.sharding.spec == P("data", "cp") and back.first_key.sharding.spec == P("data")
    assert_fields_equal(back, cache)


def _listing(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.read_bytes() if p.is_file() else b"")
                  for p in path.rglob("*"))


def test_refused_before_reading_nothing_changed(unsharded, tmp_path):
    layer, _, _ = unsharded
    small = layer.init_cache(2, 40)  # 40 slots: divisible by cp 2 * kpool 4, not by cp 4 * 4
    gd.save_cache(small, tmp_path / "c40")
    before = _listing(tmp_path / "c40")
    mesh = jax.make_mesh((4, 2), ("cp", "tp"))
    with pytest.raises(ValueError, match=r"max_length=40 is not divisible by cp \* kpool = 4 \* 4 = 16"):
        gd.restore_cache(tmp_path / "c40", mesh, seq_axis="cp")
    with pytest.raises(ValueError, match=r"\{'cp': 4, 'tp': 2\}\) but no axis 'seq'"):
        gd.restore_cache(tmp_path / "c40", mesh, seq_axis="seq")
    with pytest.raises(ValueError, match=r"batch of 2 rows is not divisible by the 4 data shards"):
        gd.restore_cache(tmp_path / "c40", jax.make_mesh((4, 2), ("data", "cp")), batch_axis="data")
    with pytest.raises(ValueError, match="need a mesh"):
        gd.restore_cache(tmp_path / "c40", seq_axis="cp")
    assert _listing(tmp_path / "c40") == before
    halves = gd.restore_cache(tmp_path / "c40", jax.make_mesh((2, 4), ("cp", "tp")), seq_axis="cp")
    assert_split(halves, 2)
    assert_fields_equal(halves, small)
    with pytest.raises(TypeError, match="save_cache saves a DsaCache, got PagedCache"):
        gd.save_cache(layer.init_paged_cache(2, 8, 8), tmp_path / "paged")
    assert not (tmp_path / "paged").exists()
    with pytest.raises(FileExistsError):
        gd.save_cache(small, tmp_path / "c40")
    assert _listing(tmp_path / "c40") == before
    with pytest.raises(gd.CheckpointError, match="restore_checkpoint"):
        gd.restore_cache(_saved_layer(layer, tmp_path))  # a layer checkpoint is not a cache
    with pytest.raises(gd.CheckpointError, match="format is 'glm5_dsa_jax.orbax_cache'"):
        gd.restore_checkpoint(tmp_path / "c40")


def _saved_layer(layer, tmp_path):
    return gd.save_checkpoint({1: layer}, tmp_path / "layer")


def test_layer_restore_axes_refused(unsharded, tmp_path):
    layer, _, _ = unsharded
    path = _saved_layer(layer, tmp_path)
    mesh = jax.make_mesh((2, 2, 2), ("data", "cp", "tp"))
    with pytest.raises(ValueError, match=r"seq_axis and axis \(the heads\) are both 'tp'"):
        gd.restore_checkpoint(path, mesh, seq_axis="tp")
    with pytest.raises(ValueError, match=r"but no axis 'seq'"):
        gd.restore_checkpoint(path, mesh, seq_axis="seq")
    both = gd.restore_checkpoint(path, mesh, batch_axis="data", seq_axis="cp")[1]
    assert both.placement == sh.Placement(mesh, "tp", "data", "cp")
    kernels = gd.restore_checkpoint(path, mesh, seq_axis="cp", implementation="pallas_interpret")[1]
    assert kernels.implementation == "pallas_interpret" and kernels.placement.seq_axis == "cp"


def test_digests_checked_and_another_platforms_stored_rows(unsharded, tmp_path):
    """A digest that does not match: ``CheckpointError`` naming the field. A bfloat16 cache
    saved as floats (how a GPU stores it) restores on a CPU as the CPU stores it (bits)."""
    layer, _, _ = unsharded
    cache = layer.init_cache(2, 32, "bfloat16")
    _, cache = steps(layer, cache, [(0, 12)])
    path = gd.save_cache(cache, tmp_path / "bf16")
    meta = json.loads((path / META_FILE).read_text())
    meta["checksums"]["key_valid"] = "0" * 16
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(gd.CheckpointError, match=r"key_valid: digest [0-9a-f]{16} does not match 0{16}"):
        gd.restore_cache(path)
    as_floats = dataclasses.replace(cache, latent_store=cache.latent, pooled_store=cache.pooled)
    assert as_floats.latent_store.dtype == jnp.bfloat16 != cache.latent_store.dtype  # uint16 bits on a CPU
    back = gd.restore_cache(gd.save_cache(as_floats, tmp_path / "floats"), jax.make_mesh((2, 4), ("cp", "tp")),
                            seq_axis="cp")
    assert_split(back, 2)
    assert_fields_equal(back, cache)
