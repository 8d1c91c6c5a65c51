"""NVFP4 and fp8 dequantization against a plain numpy decoding written here, independently
of ``glm5_dsa_jax.quant`` (a literal table of the 16 E2M1 values, FP8 E4M3 decoded from its
bits), and quantized checkpoints end to end (whole and sharded loads)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import glm5_dsa_jax as gd
from glm5_dsa_jax import checkpoint as ck
from glm5_dsa_jax import quant
from glm5_dsa_jax.model.weights import params_to_hf
from helpers import tiny8

# The FP4 E2M1 code -> value table (OCP MX spec; codes 8..15 are the negatives).
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e4m3_to_float(byte: int) -> float:
    """FP8 E4M3 (fn: no infinities, S.1111.111 is NaN), bias 7, from its bits."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def ref_nvfp4(packed: np.ndarray, scale_bytes: np.ndarray, global_scale: float, n: int) -> np.ndarray:
    out = np.zeros((packed.shape[0], n), np.float64)
    for r in range(packed.shape[0]):
        for c in range(n):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            out[r, c] = E2M1[code] * e4m3_to_float(int(scale_bytes[r, c // 16])) * global_scale
    return out


def ref_fp8_block(w_bytes: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    out = np.zeros(w_bytes.shape, np.float64)
    for r in range(w_bytes.shape[0]):
        for c in range(w_bytes.shape[1]):
            out[r, c] = e4m3_to_float(int(w_bytes[r, c])) * scale_inv[r // block[0], c // block[1]]
    return out


def random_nvfp4(rng, out: int, n: int, padded: bool = True):
    """Random codes and positive finite block scales; packed width padded to 16 or not."""
    nb = -(-n // 16)
    width = nb * 8 if padded else -(-n // 2)
    codes = rng.integers(0, 16, (out, width * 2)).astype(np.uint8)
    codes[:, n:] = 0
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale_bytes = rng.integers(0x08, 0x7E, (out, nb)).astype(np.uint8)  # normal, finite, > 0
    return packed, scale_bytes, np.float32(rng.uniform(1e-3, 2e-2))


def random_fp8(rng, shape):
    b = rng.integers(0, 256, shape).astype(np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C  # no NaNs
    return b


# ---------------------------------------------------------------------------- decoders
def test_e2m1_table():
    np.testing.assert_array_equal(quant.E2M1_VALUES, np.array(E2M1, np.float32))
    assert all(np.signbit(quant.E2M1_VALUES[8:]))


def test_e4m3_decoder_agrees_with_ml_dtypes():
    bytes_ = np.arange(256, dtype=np.uint8)
    ours = np.array([e4m3_to_float(int(b)) for b in bytes_])
    np.testing.assert_array_equal(ours, bytes_.view(ml_dtypes.float8_e4m3fn).astype(np.float64))


@pytest.mark.parametrize("out,n,padded", [(5, 64, True), (3, 40, True), (4, 40, False), (2, 7, False)])
def test_nvfp4_matches_numpy(out, n, padded):
    rng = np.random.default_rng(n + out)
    packed, sb, g = random_nvfp4(rng, out, n, padded)
    got = quant.dequantize_nvfp4(packed, sb.view(ml_dtypes.float8_e4m3fn), g, cols=n)
    np.testing.assert_allclose(got, ref_nvfp4(packed, sb, float(g), n), rtol=1e-6, atol=0)
    assert got.dtype == np.float32 and got.shape == (out, n)


def test_nvfp4_low_nibble_is_first():
    packed = np.array([[0x71]], np.uint8)  # low 1 (0.5), high 7 (6.0)
    scale = np.array([[1.0]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(quant.dequantize_nvfp4(packed, scale, 2.0), [[1.0, 12.0]])


@pytest.mark.parametrize("padded", [True, False])
def test_nvfp4_slices(padded):
    """Any row/column window decodes to the same values as the whole tensor (unaligned
    column windows read whole blocks and crop)."""
    rng = np.random.default_rng(3)
    out, n = 9, 72
    packed, sb, g = random_nvfp4(rng, out, n, padded)
    stored = {"w": packed, "s": sb.view(ml_dtypes.float8_e4m3fn), "g": np.array(g)}

    def read(name, rows, cols):
        a = stored[name]
        if rows is None and cols is None:
            return a
        return a[rows[0]:rows[1], cols[0]:cols[1]]

    full = ref_nvfp4(packed, sb, float(g), n)
    spec = quant.QuantSpec()
    for rows, cols in [((0, 9), (0, 72)), ((2, 5), (12, 30)), ((0, 9), (65, 72)), ((8, 9), (17, 18)), ((1, 4), (0, 1))]:
        got = quant.read_dequantized("nvfp4", {"weight": "w", "scale": "s", "scale_2": "g"}, (out, n), read,
                                     rows, cols, spec)
        np.testing.assert_allclose(got, full[rows[0]:rows[1], cols[0]:cols[1]], rtol=1e-6, atol=0)


def test_fp8_block_matches_numpy_and_slices():
    rng = np.random.default_rng(5)
    shape, block = (300, 200), (128, 128)
    wb = random_fp8(rng, shape)
    s = rng.uniform(1e-3, 1.0, (3, 2)).astype(np.float32)
    full = ref_fp8_block(wb, s, block)
    got = quant.dequantize_fp8_block(wb.view(ml_dtypes.float8_e4m3fn), s, block=block)
    np.testing.assert_allclose(got, full, rtol=1e-6, atol=0)
    stored = {"w": wb.view(ml_dtypes.float8_e4m3fn), "s": s}
    read = lambda name, rows, cols: stored[name][rows[0]:rows[1], cols[0]:cols[1]]
    spec = quant.QuantSpec(block_size=block)
    for rows, cols in [((0, 300), (0, 200)), ((100, 260), (120, 140)), ((299, 300), (199, 200)), ((5, 6), (0, 128))]:
        got = quant.read_dequantized("fp8_block", {"weight": "w", "scale": "s"}, shape, read, rows, cols, spec)
        np.testing.assert_allclose(got, full[rows[0]:rows[1], cols[0]:cols[1]], rtol=1e-6, atol=0)


def test_fp8_per_tensor_and_per_row():
    rng = np.random.default_rng(6)
    wb = random_fp8(rng, (4, 6))
    vals = np.array([[e4m3_to_float(int(b)) for b in row] for row in wb])
    w = wb.view(ml_dtypes.float8_e4m3fn)
    np.testing.assert_allclose(quant.dequantize_fp8(w, np.float32(0.5)), vals * 0.5, rtol=1e-6)
    rs = np.array([1, 2, 3, 4], np.float32)
    np.testing.assert_allclose(quant.dequantize_fp8(w, rs.reshape(4, 1)), vals * rs[:, None], rtol=1e-6)


def test_quant_spec_from_config():
    assert not quant.quant_spec_from_config({}).declared
    s = quant.quant_spec_from_config({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                              "group_size": 16}})
    assert s.method == "modelopt" and s.algo == "NVFP4" and not s.problems
    s = quant.quant_spec_from_config({}, {"quantization": {"quant_algo": "NVFP4", "group_size": 16}})
    assert s.method == "modelopt" and s.group_size == 16
    s = quant.quant_spec_from_config({"text_config": {"quantization_config": {"quant_method": "fp8",
                                                                              "weight_block_size": [64, 32]}}})
    assert s.block_size == (64, 32) and not s.problems
    s = quant.quant_spec_from_config({"quantization_config": {"quant_method": "gptq"}})
    assert s.problems and "gptq" in s.problems[0]


# ---------------------------------------------------------------------------- checkpoints
CFG = tiny8()
PFX = "model.layers."


def _hf_weights(rng, cfg, i):
    shapes = gd.hf_weight_shapes(cfg, i)
    return {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in shapes.items()}


def _t(a):
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


def _write(tmp_path, tensors, quantization_config):
    d = tmp_path
    raw = CFG.to_hf_dict() | {"model_type": "glm5_next", "quantization_config": quantization_config}
    (d / "config.json").write_text(json.dumps(raw))
    save_file({k: _t(v) for k, v in tensors.items()}, str(d / "model.safetensors"))
    return d


QUANTIZED = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
             "o_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight")


def _dsa_tensors(rng, quantize, keep=lambda v: v):
    """Random HF tensors of every DSA layer as a checkpoint stores them: each ``QUANTIZED``
    weight through ``quantize(name, v) -> (stored tensors, dequantized values expected)``,
    the rest as ``keep(v)``. Returns ``(tensors, expect)``; ``expect[(layer, key)]`` is
    float64."""
    tensors, expect = {}, {}
    for i in CFG.dsa_layers:
        for k, v in _hf_weights(rng, CFG, i).items():
            name = f"{PFX}{i}.self_attn.{k}"
            if k in QUANTIZED:
                stored, expect[(i, k)] = quantize(name, v)
                tensors |= stored
            else:
                tensors[name] = keep(v)
                expect[(i, k)] = tensors[name].astype(np.float64)
    return tensors, expect


def _nvfp4_checkpoint(tmp_path):
    """Every large linear NVFP4 (norms, weights_proj, pool gate/APE kept as stored, in bf16);
    returns the directory and the expected dequantized HF tensors."""
    rng = np.random.default_rng(11)

    def nvfp4(name, v):
        out, n = v.shape
        packed, sb, g = random_nvfp4(rng, out, n, padded=not name.endswith("q_b_proj.weight"))
        base = name[: -len("weight")]
        return {name: packed, base + "weight_scale": sb.view(ml_dtypes.float8_e4m3fn),
                base + "weight_scale_2": np.array(g, np.float32),
                base + "input_scale": np.array(0.25, np.float32)}, ref_nvfp4(packed, sb, float(g), n)

    tensors, expect = _dsa_tensors(rng, nvfp4, keep=lambda v: v.astype(ml_dtypes.bfloat16))
    for i in CFG.dsa_layers:
        tensors[f"{PFX}{i}.self_attn.k_scale"] = np.array(1.0, np.float32)  # KV-cache scale: ignored
    tensors["model.layers.0.mlp.gate_proj.weight"] = np.zeros((4, 4), np.uint8)  # not a DSA layer
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8"}
    return _write(tmp_path, tensors, qc), tensors, expect


def _check_loaded(layers, expect):
    for (i, k), want in expect.items():
        got = params_to_hf(layers[i])[k]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"layer {i} {k}")


def test_nvfp4_checkpoint_loads_whole_and_sharded(tmp_path):
    d, _, expect = _nvfp4_checkpoint(tmp_path)
    layers = ck.load_hf_checkpoint(d, dtype=jnp.float32, progress=False)
    _check_loaded(layers, expect)
    # 8 devices: each o_proj shard is 12 HF columns, not a multiple of the 16-wide blocks
    mesh = jax.make_mesh((8,), ("tp",))
    sharded = ck.load_hf_checkpoint(d, mesh=mesh, dtype=jnp.float32, progress=False)
    _check_loaded(sharded, expect)
    assert sharded[1].o_proj[...].sharding.spec == jax.sharding.PartitionSpec("tp", None, None)
    # weights_proj stays as stored (bf16 values)
    wp = params_to_hf(layers[1])["indexer.weights_proj.weight"]
    np.testing.assert_array_equal(wp, wp.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_fp8_block_checkpoint(tmp_path):
    rng = np.random.default_rng(12)
    block = (16, 32)

    def fp8(name, v):
        out, n = v.shape
        wb = random_fp8(rng, (out, n))
        s = rng.uniform(1e-3, 0.1, (-(-out // block[0]), -(-n // block[1]))).astype(np.float32)
        return {name: wb.view(ml_dtypes.float8_e4m3fn), name + "_scale_inv": s}, ref_fp8_block(wb, s, block)

    tensors, expect = _dsa_tensors(rng, fp8)
    d = _write(tmp_path, tensors, {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                   "activation_scheme": "dynamic"})
    _check_loaded(ck.load_hf_checkpoint(d, dtype=jnp.float32, progress=False), expect)
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    _check_loaded(ck.load_hf_checkpoint(d, mesh=mesh, dtype=jnp.float32, progress=False), expect)


def test_bad_quantized_tensors_in_one_error(tmp_path):
    d, tensors, _ = _nvfp4_checkpoint(tmp_path)
    t = dict(tensors)
    del t[f"{PFX}1.self_attn.q_b_proj.weight_scale"]
    t[f"{PFX}2.self_attn.o_proj.weight_scale"] = t[f"{PFX}2.self_attn.o_proj.weight_scale"][:, :-1]
    t[f"{PFX}2.self_attn.kv_b_proj.weight_scale_2"] = np.array(1.0, np.float16)
    t[f"{PFX}1.self_attn.kv_a_layernorm.weight_scale"] = np.ones(3, np.float32)
    bad = np.array(t[f"{PFX}1.self_attn.o_proj.weight_scale"])
    bad.view(np.uint8)[0, 0] = 0x7F  # an fp8 NaN block scale
    t[f"{PFX}1.self_attn.o_proj.weight_scale"] = bad
    (tmp_path / "model.safetensors").unlink()
    save_file({k: _t(v) for k, v in t.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ck.CheckpointError) as ei:
        ck.load_hf_checkpoint(d, progress=False)
    msg = "\n".join(ei.value.problems)
    assert len(ei.value.problems) == 5, msg  # the NaN scale too, in the same error
    assert f"'{PFX}1.self_attn.o_proj.weight' holds 16 non-finite values (dequantized nvfp4" in msg
    assert f"'{PFX}1.self_attn.q_b_proj.weight_scale' is missing" in msg
    assert f"'{PFX}2.self_attn.o_proj.weight_scale' has shape (48, 5), expected (48, 6)" in msg
    assert f"'{PFX}2.self_attn.kv_b_proj.weight_scale_2' has dtype F16" in msg
    assert f"'{PFX}1.self_attn.kv_a_layernorm.weight_scale'" in msg
    # the header problems are fixed: now the NaN scale is found while reading
    t = dict(tensors)
    t[f"{PFX}1.self_attn.o_proj.weight_scale"] = bad
    (tmp_path / "model.safetensors").unlink()
    save_file({k: _t(v) for k, v in t.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ck.CheckpointError, match=r"o_proj.weight' holds 16 non-finite values \(dequantized nvfp4"):
        ck.load_hf_checkpoint(d, progress=False)


def test_unsupported_quantization_config(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"{PFX}{i}.self_attn.{k}": v for i in CFG.dsa_layers for k, v in _hf_weights(rng, CFG, i).items()}
    d = _write(tmp_path, tensors, {"quant_method": "awq", "bits": 4})
    with pytest.raises(ck.CheckpointError, match="quant_method is 'awq': not supported"):
        ck.load_hf_checkpoint(d, progress=False)
