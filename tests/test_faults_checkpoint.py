"""Fault injection for checkpoints: HF safetensors directories and orbax checkpoints of the tiny
preset are corrupted (truncated at every section boundary, bit-flipped, with overlapping,
gapped, out-of-file or duplicate ranges, absurd header lengths, a shard missing, an index path
leaving the directory...) and saves/converts are interrupted at each stage, in process
(monkeypatched failures) and for real (SIGINT to a ``glm5-dsa convert`` subprocess).

Every case asserts the exact error type, that the message names the file and tensor/array,
that nothing was returned or assigned (a layer's parameters are unchanged), and that a
previous checkpoint still restores bit for bit. For the safetensors header checks, every
file we refuse is also refused by the ``safetensors`` library itself (and vice versa for the
files it accepts), so the reader checks at least what the library does.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import glm5_dsa_jax as gd
from glm5_dsa_jax import checkpoint as ck
from glm5_dsa_jax.checkpoint import orbax_io
from glm5_dsa_jax.model.weights import WeightError, params_to_hf
from helpers import assert_trees_equal, f32_layer, fresh_dir, params_np
from helpers import assert_same_layers as _assert_same

PFX = "model.language_model.layers."
CFG = gd.DsaConfig.tiny()
DSA = list(CFG.dsa_layers)  # [1, 2]: a full indexer layer, then a shared one
ROOT = Path(__file__).resolve().parents[1]


def _layers(seed: int) -> dict[int, gd.DsaAttention]:
    return {i: f32_layer(CFG, i, seed=seed + i) for i in DSA}


def _tensors(layers) -> dict[str, np.ndarray]:
    return {f"{PFX}{i}.self_attn.{k}": v for i, l in layers.items() for k, v in params_to_hf(l).items()}


def _hf_dir(d: Path, tensors: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": CFG.to_hf_dict()}))
    save_file(tensors, d / "model.safetensors")
    return d


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    class B:
        pass

    b = B()
    b.root = tmp_path_factory.mktemp("faults")
    b.layers = _layers(0)
    b.tensors = _tensors(b.layers)
    b.good = _hf_dir(b.root / "good", b.tensors)
    return b


def _load(d, **kw):
    return ck.load_hf_checkpoint(d, dtype=jnp.float32, progress=False, **kw)


# ============================================================================ safetensors bytes
def _split(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header_text: str | bytes, data: bytes, n: int | None = None) -> bytes:
    h = header_text.encode() if isinstance(header_text, str) else header_text
    return struct.pack("<Q", len(h) if n is None else n) + h + data


def _copy(base, name: str) -> Path:
    return fresh_dir(base.root / name, copy_of=base.good)


def _lib_refuses(file: Path) -> bool:
    try:
        with safe_open(str(file), "numpy") as f:
            for k in f.keys():
                f.get_tensor(k)
        return False
    except Exception:
        return True


def _refused(d: Path, *needles: str, lib: bool = True) -> ck.CheckpointError:
    """Loading ``d`` raises exactly CheckpointError naming ``needles``; the library agrees."""
    with pytest.raises(ck.CheckpointError) as ei:
        _load(d)
    assert type(ei.value) is ck.CheckpointError
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)
    if lib:
        assert _lib_refuses(d / "model.safetensors"), "our reader refuses a file the library accepts"
    return ei.value


def _names_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def test_valid_file_in_any_header_order_loads(base):
    header, data = _split(base.good / "model.safetensors")
    d = _copy(base, "reordered")
    names = _names_by_offset(header)[::-1]  # JSON order opposite to the data order
    (d / "model.safetensors").write_bytes(_join(json.dumps({k: header[k] for k in names}), data))
    assert not _lib_refuses(d / "model.safetensors")
    _assert_same(_load(d), base.layers)


def test_overlapping_and_duplicate_offsets(base):
    header, data = _split(base.good / "model.safetensors")
    names = _names_by_offset(header)
    a, b = names[3], names[4]  # same dtype (float32): sizes may differ
    # b aliases a's bytes where they fit: overlap + a gap where b used to be
    h = json.loads(json.dumps(header))
    sb = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    start = h[a]["data_offsets"][0]
    h[b]["data_offsets"] = [start, start + sb]
    d = _copy(base, "overlap")
    (d / "model.safetensors").write_bytes(_join(json.dumps(h), data))
    e = _refused(d, "model.safetensors", "overlap", repr(b))
    # a shifted range (same size): overlaps its neighbour by 4 bytes
    h = json.loads(json.dumps(header))
    o = h[b]["data_offsets"]
    h[b]["data_offsets"] = [o[0] - 4, o[1] - 4]
    (d / "model.safetensors").write_bytes(_join(json.dumps(h), data))
    _refused(d, "model.safetensors", "overlap", repr(b), repr(a))
    assert e.problems


def test_gap_and_trailing_bytes(base):
    header, data = _split(base.good / "model.safetensors")
    names = _names_by_offset(header)
    cut = header[names[5]]["data_offsets"][0]
    h = json.loads(json.dumps(header))
    for k in names[5:]:
        h[k]["data_offsets"] = [o + 16 for o in h[k]["data_offsets"]]
    d = _copy(base, "gap")
    (d / "model.safetensors").write_bytes(_join(json.dumps(h), data[:cut] + b"\0" * 16 + data[cut:]))
    _refused(d, "model.safetensors", "16 bytes before tensor", repr(names[5]))
    (d / "model.safetensors").write_bytes(_join(json.dumps(header), data + b"\0" * 8))
    _refused(d, "model.safetensors", "8 bytes after the last tensor")


def test_out_of_file_offsets(base):
    header, data = _split(base.good / "model.safetensors")
    last = _names_by_offset(header)[-1]
    h = json.loads(json.dumps(header))
    o = h[last]["data_offsets"]
    h[last]["data_offsets"] = [o[0] + 4096, o[1] + 4096]
    d = _copy(base, "oof")
    (d / "model.safetensors").write_bytes(_join(json.dumps(h), data))
    _refused(d, "model.safetensors", repr(last), "truncated")
    h[last]["data_offsets"] = [o[0], 2**62]  # absurd end: size no longer matches
    (d / "model.safetensors").write_bytes(_join(json.dumps(h), data))
    _refused(d, "model.safetensors", repr(last), "corrupt")


@pytest.mark.parametrize("n", [2**63, 2**64 - 1, 2**40, "size", 0])
def test_absurd_header_length(base, n):
    good = (base.good / "model.safetensors").read_bytes()
    d = _copy(base, "hlen")
    n = len(good) - 7 if n == "size" else n
    (d / "model.safetensors").write_bytes(struct.pack("<Q", n) + good[8:])
    _refused(d, "model.safetensors", "not a valid safetensors file")


def test_bad_json_duplicate_names_metadata(base):
    header, data = _split(base.good / "model.safetensors")
    text = json.dumps(header)
    d = _copy(base, "json")
    f = d / "model.safetensors"
    f.write_bytes(_join(text[:-1] + ",}", data))  # not JSON
    _refused(d, "model.safetensors", "corrupt header")
    f.write_bytes(_join(b"\xff" + text.encode()[1:], data))  # not UTF-8
    _refused(d, "model.safetensors", "corrupt header")
    f.write_bytes(_join("[1, 2]", data))
    _refused(d, "model.safetensors", "not a JSON object")
    first = _names_by_offset(header)[0]
    dup = text[:-1] + ", " + json.dumps(first) + ": " + json.dumps(header[first]) + "}"
    f.write_bytes(_join(dup, data))
    # (stricter than the library, which keeps the last of two identical entries)
    _refused(d, "model.safetensors", repr(first), "more than once", lib=False)
    f.write_bytes(_join(json.dumps(dict(header, __metadata__={"format": 3})), data))
    _refused(d, "model.safetensors", "__metadata__")


def test_dtype_and_shape_against_byte_count(base):
    header, data = _split(base.good / "model.safetensors")
    name = f"{PFX}1.self_attn.q_b_proj.weight"
    d = _copy(base, "dtype")
    for change in ({"dtype": "F16"}, {"shape": [80, 25]}, {"shape": [80, -24]}, {"dtype": "Q4"},
                   {"data_offsets": [5, 2]}):
        h = json.loads(json.dumps(header))
        h[name] |= change
        (d / "model.safetensors").write_bytes(_join(json.dumps(h), data))
        _refused(d, "model.safetensors", repr(name))


def test_truncated_at_every_section_boundary(base):
    good = (base.good / "model.safetensors").read_bytes()
    header, data = _split(base.good / "model.safetensors")
    n = struct.unpack("<Q", good[:8])[0]
    start = 8 + n
    cuts = {0, 4, 8, 8 + n // 2, start}
    ends = {}
    for k in _names_by_offset(header):
        b, e = header[k]["data_offsets"]
        cuts |= {start + b, start + (b + e) // 2}
        ends[k] = start + e
    cuts.add(len(good) - 1)
    d = _copy(base, "trunc")
    f = d / "model.safetensors"
    for cut in sorted(cuts):
        f.write_bytes(good[:cut])
        lost = [k for k, e in ends.items() if e > cut]
        e = _refused(d, "model.safetensors")
        if cut >= start:  # the header is whole: exactly the lost tensors, by name
            assert len(e.problems) == len(lost), (cut, e.problems)
            for k in lost:
                assert repr(k) in str(e) and "truncated" in str(e)


def test_bit_flips_in_header_never_load_wrong_weights(base):
    good = (base.good / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    d = _copy(base, "flip_h")
    f = d / "model.safetensors"
    rng = np.random.default_rng(0)
    positions = sorted(set(range(0, 8)) | set(int(p) for p in rng.integers(8, 8 + n, 40)))
    refused = 0
    for pos in positions:
        for bit in (0, 5):
            raw = bytearray(good)
            raw[pos] ^= 1 << bit
            f.write_bytes(bytes(raw))
            try:
                got = _load(d)
            except ck.CheckpointError as e:
                assert "model.safetensors" in str(e) or "tensor '" in str(e)
                refused += 1
                continue
            _assert_same(got, base.layers)  # a harmless flip (whitespace-like): same weights
    assert refused >= len(positions)  # nearly every flip is caught


def test_bit_flips_in_data_nan_and_float16_overflow(base):
    header, data = _split(base.good / "model.safetensors")
    name = f"{PFX}2.self_attn.o_proj.weight"
    b = header[name]["data_offsets"][0]
    raw = bytearray(data)
    raw[b + 4 * 7 + 3] |= 0x7F  # exponent bits all set -> inf/NaN
    raw[b + 4 * 7 + 2] |= 0x80
    d = _copy(base, "flip_d")
    (d / "model.safetensors").write_bytes(_join(json.dumps(header), bytes(raw)))
    _refused(d, repr(name), "non-finite", lib=False)  # the library does not look at values
    # a finite float32 1e6: fine in float32, refused in float16 (checked after the cast)
    t = dict(base.tensors)
    w = t[name].copy()
    w[3, 5] = 1e6
    t[name] = w
    d = _hf_dir(base.root / "f16", t)
    assert sorted(ck.load_hf_checkpoint(d, dtype=jnp.float32, progress=False)) == DSA
    with pytest.raises(ck.CheckpointError) as ei:
        ck.load_hf_checkpoint(d, dtype=jnp.float16, progress=False)
    msg = str(ei.value)
    assert repr(name) in msg and "outside the range of float16" in msg


def test_load_hf_weights_float16_same_rule(base):
    layer = gd.DsaAttention(CFG, 2, rngs=nnx.Rngs(3), dtype=jnp.float16, param_dtype=jnp.float16)
    before = params_np(layer)
    w = params_to_hf(base.layers[2])
    w["o_proj.weight"] = w["o_proj.weight"].copy()
    w["o_proj.weight"][3, 5] = 1e6
    with pytest.raises(WeightError) as ei:
        layer.load_hf_weights(w)
    assert "'o_proj.weight' holds 1 non-finite values (as float16)" in str(ei.value)
    assert "outside the range of float16" in str(ei.value)
    assert_trees_equal(params_np(layer), before)  # unchanged
    w["o_proj.weight"][3, 5] = 6e4  # in range: accepted
    layer.load_hf_weights(w)


# ============================================================================ sharded index
def _sharded(base, name: str) -> Path:
    d = fresh_dir(base.root / name)
    shutil.copy(base.good / "config.json", d)
    t = base.tensors
    names = sorted(t)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    wm = {}
    for fname, ns in parts.items():
        save_file({k: t[k] for k in ns}, d / fname)
        wm |= {k: fname for k in ns}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


def _index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def test_sharded_good_then_shard_missing_from_index_or_disk(base):
    d = _sharded(base, "sh")
    _assert_same(_load(d), base.layers)
    idx = _index(d)
    gone = f"{PFX}1.self_attn.kv_b_proj.weight"
    del idx["weight_map"][gone]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    e = _refused(d, f"missing tensor {gone!r}", lib=False)
    assert len(e.problems) == 1
    d = _sharded(base, "sh2")
    (d / "model-00002-of-00002.safetensors").unlink()
    _refused(d, "model-00002-of-00002.safetensors", "cannot be read", lib=False)


@pytest.mark.parametrize("where", ["../other/model.safetensors", "/abs", "sub/../../x.safetensors", "C:/x"])
def test_index_path_escaping_the_directory(base, where):
    d = _sharded(base, "esc")
    other = base.root / "other"
    other.mkdir(exist_ok=True)
    shutil.copy(d / "model-00001-of-00002.safetensors", other / "model.safetensors")  # valid, outside
    idx = _index(d)
    target = str(other / "model.safetensors") if where == "/abs" else where
    victim = next(k for k, v in idx["weight_map"].items() if v == "model-00001-of-00002.safetensors")
    for k, v in idx["weight_map"].items():
        if v == "model-00001-of-00002.safetensors":
            idx["weight_map"][k] = target
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    e = _refused(d, "model.safetensors.index.json", repr(victim), repr(target), "outside the checkpoint", lib=False)
    assert len(e.problems) == 1


def test_structural_problems_and_nan_in_one_error(base):
    t = dict(base.tensors)
    del t[f"{PFX}1.self_attn.q_a_proj.weight"]
    t[f"{PFX}2.self_attn.kv_b_proj.weight"] = t[f"{PFX}2.self_attn.kv_b_proj.weight"][:-1]
    w = t[f"{PFX}1.self_attn.o_proj.weight"].copy()
    w[0, 0] = np.nan
    t[f"{PFX}1.self_attn.o_proj.weight"] = w
    d = _hf_dir(base.root / "all_in_one", t)
    e = _refused(d, lib=False)
    msg = "\n".join(e.problems)
    assert len(e.problems) == 3, msg
    assert f"missing tensor '{PFX}1.self_attn.q_a_proj.weight'" in msg
    assert f"'{PFX}2.self_attn.kv_b_proj.weight' has shape (127, 40)" in msg
    assert f"tensor '{PFX}1.self_attn.o_proj.weight' holds 1 non-finite values" in msg


# ============================================================================ orbax
@pytest.fixture(scope="module")
def saved(base, tmp_path_factory):
    """An orbax checkpoint of ``base.layers`` (restored once to warm the path)."""
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    ck.save_checkpoint(base.layers, out)
    return out


def _clone(saved, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(saved, d)
    return d


def _restore_refused(d: Path, *needles: str) -> ck.CheckpointError:
    with pytest.raises(ck.CheckpointError) as ei:
        ck.restore_checkpoint(d)
    assert type(ei.value) is ck.CheckpointError
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))
    return ei.value


def _data_files(d: Path) -> list[Path]:
    files = [p for p in (d / "params").rglob("*") if p.is_file() and p.stat().st_size > 256
             and "/d/" in str(p)]
    assert files, sorted(str(p) for p in (d / "params").rglob("*"))
    return files


def test_orbax_round_trip_and_meta_digests(base, saved):
    _assert_same(ck.restore_checkpoint(saved), base.layers)
    meta = json.loads((saved / ck.META_FILE).read_text())
    assert meta["version"] == 2
    assert set(meta["checksums"]) == {f"layer_{i}.{k}" for i in DSA for k in orbax_io._flat(params_np(base.layers[i]))}
    assert not [p for p in saved.parent.iterdir() if p.name.startswith(".")]  # no partial sibling left


def test_orbax_corrupted_truncated_missing_data(base, saved, tmp_path):
    d = _clone(saved, tmp_path)
    f = max(_data_files(d), key=lambda p: p.stat().st_size)
    raw = bytearray(f.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = bytes((x ^ 0x5A) for x in raw[mid:mid + 64])
    f.write_bytes(bytes(raw))
    e = _restore_refused(d, str(d), "layer_")
    assert any("digest" in p or "cannot be read" in p for p in e.problems), e.problems
    f.write_bytes(bytes(raw[: len(raw) // 3]))  # truncated
    _restore_refused(d, "layer_")
    f.unlink()  # missing
    _restore_refused(d, "layer_")


def test_orbax_value_changed_in_place_is_caught_by_digest(base, saved, tmp_path):
    """A corruption that orbax itself cannot see (valid data, other values): the digest does."""
    d = _clone(saved, tmp_path)
    other = _layers(7)
    ck.save_checkpoint(other, tmp_path / "other")
    shutil.rmtree(d / "params")
    shutil.copytree(tmp_path / "other" / "params", d / "params")  # same shapes, other values
    e = _restore_refused(d, "digest", "layer_1.q_a_proj", "layer_2.o_proj")
    differ = sorted(f"layer_{i}.{k}" for i in DSA for k, v in orbax_io._flat(params_np(other[i])).items()
                    if not np.array_equal(v, orbax_io._flat(params_np(base.layers[i]))[k]))  # norms init equal
    assert len(differ) > 10
    assert sorted(p.split(":")[0] for p in e.problems) == differ


def test_orbax_restore_names_every_problem_of_a_checkpoint_with_many(base, saved, tmp_path):
    """A checkpoint with a missing, a misshaped and an extra array and several others
    corrupted in place: one ``CheckpointError`` names each of them, and nothing else (a
    problem found never stops the checks of the arrays after it)."""
    d = _clone(saved, tmp_path)
    tree = {f"layer_{i}": params_np(base.layers[i]) for i in DSA}
    names = sorted(orbax_io._flat(tree))
    missing, misshaped, *corrupted = names[:2] + names[3:-1:2]
    assert len(corrupted) >= 8

    def at(name):
        *parents, leaf = name.split(".")
        node = tree
        for k in parents:
            node = node[k]
        return node, leaf

    node, leaf = at(missing)
    node.pop(leaf)
    node, leaf = at(misshaped)
    node[leaf] = np.zeros(node[leaf].shape + (2,), node[leaf].dtype)
    for name in corrupted:
        node, leaf = at(name)
        node[leaf] = node[leaf] + np.asarray(1, node[leaf].dtype)
    tree["layer_1"]["extra_w"] = np.ones((3,), np.float32)
    shutil.rmtree(d / "params")
    ckptr = orbax_io._orbax().StandardCheckpointer()
    ckptr.save(d / "params", tree)
    ckptr.wait_until_finished()
    e = _restore_refused(d, "digest", "not in the checkpoint", "stored shape", "not a parameter of layer 1")
    assert sorted(p.split(":")[0] for p in e.problems) == sorted([missing, misshaped, "layer_1.extra_w", *corrupted])


def test_orbax_meta_problems(base, saved, tmp_path):
    d = _clone(saved, tmp_path)
    meta = json.loads((d / ck.META_FILE).read_text())
    for change, needle in [
        ({"layers": [0, 1, 2]}, "lists layer 0"),  # a linear-attention layer
        ({"layers": [1, 3]}, "lists layer 3"),
        ({"layers": "1"}, "'layers'"),
        ({"version": 1}, "version"),
        ({"checksums": None}, "'checksums'"),
        ({"param_dtype": {"1": "int8", "2": "float32"}}, "param_dtype[1]"),
        ({"param_dtype": {"1": "float32"}}, "param_dtype[2] is None"),
        ({"format": "x"}, "format"),
    ]:
        (d / ck.META_FILE).write_text(json.dumps(meta | change))
        _restore_refused(d, ck.META_FILE, needle)
    (d / ck.META_FILE).write_text("{not json")
    _restore_refused(d, ck.META_FILE)
    (d / ck.META_FILE).write_text(json.dumps(meta | {"checksums": {}}))
    _restore_refused(d, "layer_1.q_a_proj: no digest")
    (d / ck.META_FILE).unlink()  # params without the completion marker: an interrupted save
    _restore_refused(d, "incomplete")
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        ck.load_for_demo(d)


def test_save_refuses_nan_and_writes_nothing(base, tmp_path):
    bad = _layers(1)
    v = bad[2].w_uv
    v.set_value(v[...].at[0, 0, 0].set(jnp.nan))
    with pytest.raises(ck.CheckpointError, match=r"layer_2\.w_uv holds 1 non-finite"):
        ck.save_checkpoint(bad, tmp_path / "nan")
    assert not list(tmp_path.iterdir())


def test_overwrite_only_replaces_checkpoints(base, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ck.save_checkpoint(base.layers, tmp_path / "notes")
    with pytest.raises(FileExistsError, match="not a glm5_dsa_jax checkpoint"):
        ck.save_checkpoint(base.layers, tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep me"


def _boom(*a, **k):
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("stage", ["orbax_save", "wait", "meta", "swap", "exchange", "interrupt"])
def test_interrupted_overwrite_keeps_previous_checkpoint(base, saved, tmp_path, monkeypatch, stage):
    import orbax.checkpoint as ocp

    d = _clone(saved, tmp_path)
    new = _layers(11)
    exc = RuntimeError
    if stage == "orbax_save":
        monkeypatch.setattr(ocp.StandardCheckpointer, "save", _boom)
    elif stage == "wait":
        monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", _boom)
    elif stage == "meta":
        monkeypatch.setattr(orbax_io, "_write_meta", _boom)
    elif stage == "swap":
        monkeypatch.setattr(orbax_io, "_swap_into", _boom)
    elif stage == "exchange":
        monkeypatch.setattr(orbax_io, "_exchange", _boom)
    else:
        def interrupt(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(orbax_io, "_write_meta", interrupt)
        exc = KeyboardInterrupt
    with pytest.raises(exc):
        ck.save_checkpoint(new, d, overwrite=True)
    _assert_same(ck.restore_checkpoint(d), base.layers)  # the previous one, whole
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the partial sibling is gone
    monkeypatch.undo()
    ck.save_checkpoint(new, d, overwrite=True)  # and a clean retry replaces it
    _assert_same(ck.restore_checkpoint(d), new)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_interrupted_first_save_leaves_nothing_loadable(base, tmp_path, monkeypatch):
    monkeypatch.setattr(orbax_io, "_write_meta", _boom)
    with pytest.raises(RuntimeError):
        ck.save_checkpoint(base.layers, tmp_path / "fresh")
    assert not list(tmp_path.iterdir())


def _convert_cmd(src: Path, out: Path, *, sigint_at: str) -> list[str]:
    """The ``glm5-dsa convert --overwrite`` command line, in a child that sends itself a real
    SIGINT at a fixed point of its work: ``"loading"`` as it starts materialising the layers
    (after every import and the read of the headers), ``"writing"`` as it writes the
    metadata file into the partial sibling directory (the orbax tree is written, the swap
    is not done). A hook, not a clock: a signal sent from outside after a sleep, or on
    seeing the partial directory, could land during an import (where a library's bare
    ``except:`` may swallow the KeyboardInterrupt, seen once on the jax 0.12 leg) or after
    a fast machine had already finished (seen on the jax 0.12 leg too)."""
    args = ["convert", str(src), str(out), "--overwrite", "--no-progress", "--dtype", "float32"]
    # Ctrl-C raises KeyboardInterrupt in the child whatever the parent does with SIGINT: a
    # process started with SIGINT ignored (as a test worker may be, after some library set
    # SIG_IGN) keeps it ignored, and Python then installs no KeyboardInterrupt handler.
    hook = "import os, signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    module, name = {"loading": ("hf_import", "_materialize"), "writing": ("orbax_io", "_write_meta")}[sigint_at]
    hook += (f"from glm5_dsa_jax.checkpoint import {module} as target\n"
             f"_inner = target.{name}\n"
             "def _interrupted(*a, **k):\n"
             "    os.kill(os.getpid(), signal.SIGINT)\n"
             "    return _inner(*a, **k)\n"
             f"target.{name} = _interrupted\n")
    hook += "from glm5_dsa_jax.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return [sys.executable, "-c", hook, *args]


def test_sigint_during_convert_keeps_previous_checkpoint(base, saved, tmp_path):
    """A real Ctrl-C of ``glm5-dsa convert --overwrite``: once while it loads and once while it
    writes the new checkpoint's partial directory (``_convert_cmd``). The old checkpoint
    survives both, and no partial directory is left."""
    d = _clone(saved, tmp_path)
    src = _hf_dir(tmp_path / "hf_new", _tensors(_layers(21)))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               XLA_FLAGS="", JAX_PLATFORMS="cpu")
    for when in ("loading", "writing"):
        p = subprocess.run(_convert_cmd(src, d, sigint_at=when), env=env, capture_output=True, timeout=240)
        assert p.returncode != 0, f"convert finished through a SIGINT while {when}: {p.stderr[-2000:]!r}"
        assert b"KeyboardInterrupt" in p.stderr, p.stderr[-2000:]
        _assert_same(ck.restore_checkpoint(d), base.layers)
        assert not [q for q in tmp_path.iterdir() if q.name.startswith(".ckpt.")], sorted(tmp_path.iterdir())
    # (that the same command without a signal replaces it: test_convert_overwrite_replaces)


def test_convert_overwrite_replaces(base, saved, tmp_path):
    from glm5_dsa_jax.cli import main

    d = _clone(saved, tmp_path)
    src = _hf_dir(tmp_path / "hf_new", _tensors(_layers(21)))
    assert main(["convert", str(src), str(d), "--overwrite", "--no-progress", "--dtype", "float32"]) == 0
    _assert_same(ck.restore_checkpoint(d), _layers(21))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf_new"]


def test_convert_into_non_empty_dir_names_the_flag(base, saved, tmp_path, capsys):
    from glm5_dsa_jax.cli import main

    d = _clone(saved, tmp_path)
    assert main(["convert", str(base.good), str(d), "--no-progress"]) == 2  # before loading
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    _assert_same(ck.restore_checkpoint(d), base.layers)
