"""Dequantization of quantized Hugging Face checkpoints, at import time, in numpy.

Formats (each a ``<module>.weight`` of a linear layer plus scale tensors beside it):

* ``"nvfp4"`` -- NVIDIA ModelOpt NVFP4 (``quant_algo: NVFP4``), as its unified HF export
  writes it (``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``):

  - ``weight``: ``uint8 [out, in_p / 2]``, two FP4 E2M1 codes per byte, the element with
    the even column index in the **low** nibble (``packed = q[1::2] << 4 | q[0::2]``);
    ``in_p`` is ``in`` rounded up to the block size (ModelOpt pads the last block).
  - ``weight_scale``: ``float8_e4m3fn [out, ceil(in / 16)]``, one scale per 16-element block
    along the input dimension.
  - ``weight_scale_2``: ``float32`` scalar (or ``[1]``), the global scale.
  - ``input_scale``: the activation scale for FP4 activations; not needed to dequantize
    weights, accepted and ignored.

  ``value = E2M1[code] * float(weight_scale[r, c // 16]) * weight_scale_2``.

* ``"fp8_block"`` -- DeepSeek-V3-style block-scaled FP8 (``quant_method: fp8``,
  ``weight_block_size: [128, 128]``): ``weight`` ``float8_e4m3fn [out, in]`` and
  ``weight_scale_inv`` ``float32 [ceil(out / 128), ceil(in / 128)]``;
  ``value = weight[r, c] * weight_scale_inv[r // 128, c // 128]`` (despite its name the
  stored number multiplies: it is the inverse of the quantization scale).

* ``"fp8"`` -- per-tensor (or per-output-row) FP8, ModelOpt ``quant_algo: FP8``:
  ``weight`` ``float8_e4m3fn [out, in]`` and ``weight_scale`` ``float32`` with one element
  (or ``[out]`` / ``[out, 1]``); ``value = weight * weight_scale``.

Tensors stored unquantized (norms, biases, the indexer's ``weights_proj``, anything listed
in ModelOpt's ``exclude_modules``) are loaded as stored. Every function here decodes a
*slice* as well as a whole tensor, so a sharded load reads only the bytes of its shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

__all__ = [
    "E2M1_VALUES", "QuantSpec", "quant_spec_from_config", "unpack_e2m1", "dequantize_nvfp4",
    "dequantize_fp8_block", "dequantize_fp8", "AUX_SUFFIXES", "classify", "read_dequantized",
]


def _e2m1_table() -> np.ndarray:
    """The 16 FP4 E2M1 values, from the bit layout: sign(1) exponent(2, bias 1) mantissa(1)."""
    out = np.empty(16, np.float32)
    for code in range(16):
        sign = -1.0 if code & 0b1000 else 1.0
        exp, man = (code >> 1) & 0b11, code & 1
        mag = man * 0.5 if exp == 0 else (1.0 + man * 0.5) * 2.0 ** (exp - 1)
        out[code] = sign * mag
    return out


#: ``E2M1_VALUES[code]`` for the 16 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives).
E2M1_VALUES = _e2m1_table()

#: Names that may sit beside a quantized ``<module>.weight`` (``<module>.<suffix>``).
AUX_SUFFIXES = ("weight_scale", "weight_scale_2", "weight_scale_inv", "input_scale")

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


# ---------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """What ``config.json`` (``quantization_config``) / ``hf_quant_config.json`` declare.

    ``method`` is ``None`` for an unquantized checkpoint. Formats are detected per tensor
    from names and dtypes; the spec supplies block sizes and refuses unsupported schemes.
    """

    method: str | None = None
    algo: str | None = None
    group_size: int = 16
    block_size: tuple[int, int] = (128, 128)
    problems: tuple[str, ...] = ()

    @property
    def declared(self) -> bool:
        return self.method is not None


_SUPPORTED = "ModelOpt NVFP4 / FP8 ('quant_method: modelopt') and block-scaled fp8 ('quant_method: fp8')"


def quant_spec_from_config(
    config: Mapping[str, Any] | None, hf_quant_config: Mapping[str, Any] | None = None
) -> QuantSpec:
    """Read ``quantization_config`` (top level or under ``text_config``) and ModelOpt's
    ``hf_quant_config.json``; an unsupported scheme is recorded in ``problems``."""
    config = config or {}
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), Mapping):
        qc = config["text_config"].get("quantization_config")
    hq = (hf_quant_config or {}).get("quantization") if hf_quant_config else None
    if qc is None and hq is None:
        return QuantSpec()
    qc = dict(qc or {})
    hq = dict(hq or {})
    problems: list[str] = []
    method = str(qc.get("quant_method") or ("modelopt" if hq else "")).lower() or None
    algo = qc.get("quant_algo") or hq.get("quant_algo")
    group = qc.get("group_size") or hq.get("group_size") or 16
    block = qc.get("weight_block_size") or (128, 128)
    if method not in ("modelopt", "fp8", "nvfp4"):
        problems.append(
            f"config.json quantization_config.quant_method is {qc.get('quant_method')!r}: "
            f"not supported (supported: {_SUPPORTED})"
        )
    algo_s = str(algo).upper() if algo is not None else None
    if method == "modelopt" and algo_s not in (None, "NVFP4", "FP8", "FP8_PB_WO", "MIXED_PRECISION"):
        problems.append(f"quantization quant_algo {algo!r} is not supported (supported: {_SUPPORTED})")
    try:
        group = int(group)
        block = tuple(int(b) for b in block)
        if group <= 0 or len(block) != 2 or min(block) <= 0:
            raise ValueError
    except (TypeError, ValueError):
        problems.append(f"quantization group_size {group!r} / weight_block_size {block!r} are not positive ints")
        group, block = 16, (128, 128)
    return QuantSpec(method, algo_s, group, block, tuple(problems))


# ---------------------------------------------------------------------------- decoders
def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """``uint8 [..., k]`` -> codes ``uint8 [..., 2k]``; the low nibble is the first element."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed NVFP4 data must be uint8, got {packed.dtype}")
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes


def _as_f32(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.uint8:  # raw fp8 bytes
        a = a.view(ml_dtypes.float8_e4m3fn)
    return a.astype(np.float32)


def dequantize_nvfp4(
    packed: np.ndarray, block_scale: np.ndarray, global_scale, *, group_size: int = 16,
    cols: int | None = None,
) -> np.ndarray:
    """NVFP4 -> float32 ``[..., cols]``.

    ``packed`` ``uint8 [..., n / 2]`` starts on a block boundary; ``block_scale``
    ``float8_e4m3fn [..., ceil(n / group_size)]`` holds the scales of exactly the blocks
    that ``packed`` covers (a trailing partial block allowed); ``global_scale`` is the
    ``weight_scale_2`` scalar. ``cols`` crops the result (default: every unpacked element).
    """
    codes = unpack_e2m1(packed)
    n = codes.shape[-1]
    scale = _as_f32(block_scale) * np.float32(np.asarray(global_scale, np.float32).reshape(()))
    n_blocks = -(-n // group_size)
    if scale.shape[-1] < n_blocks or scale.shape[:-1] != codes.shape[:-1]:
        raise ValueError(
            f"NVFP4 block scales {scale.shape} do not cover {codes.shape} codes in blocks of {group_size}"
        )
    per_elem = np.repeat(scale[..., :n_blocks], group_size, axis=-1)[..., :n]
    out = E2M1_VALUES[codes] * per_elem
    return out if cols is None else out[..., :cols]


def dequantize_fp8_block(
    weight: np.ndarray, scale_inv: np.ndarray, *, block: tuple[int, int] = (128, 128),
    offset: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """Block-scaled FP8 -> float32.

    ``weight`` is ``[rows, cols]`` (``float8_e4m3fn`` or its raw ``uint8`` bytes), the slice of the
    full tensor that starts at row/column ``offset``; ``scale_inv`` is the slice of the
    ``[ceil(out / b0), ceil(in / b1)]`` scale grid that starts at block
    ``(offset[0] // b0, offset[1] // b1)`` and covers the weight slice.
    """
    w = _as_f32(weight)
    s = np.asarray(scale_inv, np.float32)
    b0, b1 = block
    r0, c0 = offset
    ri = (np.arange(r0, r0 + w.shape[0]) // b0) - r0 // b0
    ci = (np.arange(c0, c0 + w.shape[1]) // b1) - c0 // b1
    if s.ndim != 2 or (len(ri) and ri[-1] >= s.shape[0]) or (len(ci) and ci[-1] >= s.shape[1]):
        raise ValueError(f"fp8 block scales {s.shape} do not cover a {w.shape} slice at {offset}")
    return w * s[ri[:, None], ci[None, :]]


def dequantize_fp8(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-tensor (one element) or per-row (``[rows]`` / ``[rows, 1]``) scaled FP8 -> float32."""
    w = _as_f32(weight)
    s = np.asarray(scale, np.float32)
    if s.size == 1:
        return w * s.reshape(())
    return w * s.reshape(w.shape[0], 1)


# ---------------------------------------------------------------------------- layouts
def classify(
    name: str, shape: tuple[int, ...], infos: Mapping[str, tuple[str, tuple[int, ...]]],
    spec: QuantSpec,
) -> tuple[str | None, dict[str, str], list[str]]:
    """How the logical tensor ``name`` (expected PyTorch ``shape``) is stored.

    ``infos`` maps the names present (same namespace) to ``(safetensors dtype, shape)``.
    Returns ``(format, {role: tensor name}, problems)`` with format ``None`` (stored as a
    float tensor), ``"nvfp4"``, ``"fp8_block"`` or ``"fp8"``; roles are ``weight``,
    ``scale``, ``scale_2`` (and ``stray_*`` for scales that sit beside a float weight, which
    are reported as problems). Problems name the tensors.
    """
    dtype, stored = infos[name]
    base = name[: -len("weight")] if name.endswith(".weight") else None
    aux = {s: base + s for s in AUX_SUFFIXES if base is not None and base + s in infos}
    problems: list[str] = []
    roles = {"weight": name}

    def want(role, suffix, dtypes, shapes, what):
        n = aux.get(suffix)
        if n is None:
            problems.append(f"tensor {base + suffix!r} is missing ({what})")
            return
        dt, sh = infos[n]
        if dt not in dtypes:
            problems.append(f"tensor {n!r} has dtype {dt}, expected {' or '.join(dtypes)}")
        elif tuple(sh) not in shapes:
            problems.append(
                f"tensor {n!r} has shape {tuple(sh)}, expected "
                + " or ".join(str(s) for s in shapes)
            )
        roles[role] = n

    if dtype in _FLOAT_DTYPES:
        if tuple(stored) != shape:
            problems.append(f"tensor {name!r} has shape {tuple(stored)}, expected {shape}")
        for s in ("weight_scale", "weight_scale_2", "weight_scale_inv"):
            if s in aux:  # reported here, so listed as a role (not also as "unexpected")
                problems.append(
                    f"tensor {aux[s]!r} is a quantization scale but {name!r} is stored as {dtype}"
                )
                roles["stray_" + s] = aux[s]
        return None, roles, problems
    if base is None or len(shape) != 2:
        return None, roles, [f"tensor {name!r} has dtype {dtype}, expected a float dtype (F32, BF16, F16)"]
    out, inn = shape
    if dtype == "U8":
        g = spec.group_size
        nb = -(-inn // g)
        widths = sorted({nb * g // 2} | ({inn // 2} if inn % 2 == 0 else set()))
        if tuple(stored) not in [(out, w) for w in widths]:
            problems.append(
                f"tensor {name!r} (NVFP4, packed uint8) has shape {tuple(stored)}, expected "
                + " or ".join(str((out, w)) for w in widths) + f" for a logical {shape}"
            )
        want("scale", "weight_scale", ("F8_E4M3",), [(out, nb)], f"NVFP4 block scales of {name!r}")
        want("scale_2", "weight_scale_2", ("F32",), [(), (1,)], f"NVFP4 global scale of {name!r}")
        return "nvfp4", roles, problems
    if dtype == "F8_E4M3":
        if tuple(stored) != shape:
            problems.append(f"tensor {name!r} (fp8) has shape {tuple(stored)}, expected {shape}")
        if "weight_scale_inv" in aux:
            b0, b1 = spec.block_size
            want("scale", "weight_scale_inv", ("F32", "BF16"), [(-(-out // b0), -(-inn // b1))],
                 f"fp8 block scales of {name!r}")
            return "fp8_block", roles, problems
        if "weight_scale" in aux:
            want("scale", "weight_scale", ("F32", "BF16"), [(), (1,), (out,), (out, 1)],
                 f"fp8 scale of {name!r}")
            return "fp8", roles, problems
        problems.append(
            f"tensor {name!r} is float8_e4m3fn but has no {base + 'weight_scale_inv'!r} "
            f"(block-scaled) or {base + 'weight_scale'!r} (per-tensor) beside it"
        )
        return "fp8", roles, problems
    return None, roles, [
        f"tensor {name!r} has dtype {dtype}, expected a float dtype (F32, BF16, F16), "
        "NVFP4 (U8 + weight_scale + weight_scale_2) or fp8 (F8_E4M3 + scales)"
    ]


Reader = Callable[[str, tuple[int, int] | None, tuple[int, int] | None], np.ndarray]


def read_dequantized(
    fmt: str, roles: Mapping[str, str], shape: tuple[int, int], read: Reader,
    rows: tuple[int, int], cols: tuple[int, int], spec: QuantSpec,
) -> np.ndarray:
    """float32 ``[rows, cols]`` of a quantized ``[out, in]`` weight, reading only what the
    slice needs. ``read(name, rows, cols)`` returns a raw slice of a stored tensor
    (``None`` = whole axis)."""
    r0, r1 = rows
    c0, c1 = cols
    if fmt == "nvfp4":
        g = spec.group_size
        b0, b1 = c0 // g, -(-c1 // g)
        # Blocks b0..b1 cover columns b0*g .. b1*g; ``read`` clamps to the stored width
        # (ModelOpt pads the packed width to whole blocks, other writers may not).
        lo, hi = b0 * g, b1 * g
        packed_w = read(roles["weight"], (r0, r1), (lo // 2, -(-hi // 2)))
        scale = read(roles["scale"], (r0, r1), (b0, b1))
        glob = read(roles["scale_2"], None, None)
        vals = dequantize_nvfp4(packed_w, scale, glob, group_size=g)
        return vals[:, c0 - lo: c1 - lo]
    if fmt == "fp8_block":
        bs0, bs1 = spec.block_size
        w = read(roles["weight"], (r0, r1), (c0, c1))
        s = read(roles["scale"], (r0 // bs0, -(-r1 // bs0)), (c0 // bs1, -(-c1 // bs1)))
        return dequantize_fp8_block(w, s, block=spec.block_size, offset=(r0, c0))
    if fmt == "fp8":
        w = read(roles["weight"], (r0, r1), (c0, c1))
        s = np.asarray(read(roles["scale"], None, None), np.float32)
        if s.size > 1:
            s = s.reshape(-1)[r0:r1]
        return dequantize_fp8(w, s)
    raise ValueError(f"unknown quantized format {fmt!r}")
