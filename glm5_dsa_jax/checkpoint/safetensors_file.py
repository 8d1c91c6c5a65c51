"""A safetensors reader: headers parsed and validated eagerly, data read by slices with ``pread``.

The format is an 8-byte little-endian header length, a JSON header (``{name: {dtype, shape,
data_offsets}}`` plus an optional ``__metadata__`` map of strings) and the raw little-endian
data section. ``SafetensorsFile`` parses the header when it is opened (``error`` set if the
file cannot be used) and reads a tensor, or rows ``[r0, r1)`` and columns ``[c0, c1)`` of it,
on demand.

Why not ``safetensors.safe_open(..., "numpy").get_slice``: in safetensors 0.8 the numpy
backend cannot return ``F8_E4M3`` tensors (NVFP4 block scales, fp8 weights), and it reads
through an mmap. The tests check the headers parsed here against ``safe_open``.

Invariants:

* **At least the library's validation.** Because this reader replaces the library, it
  refuses what the library refuses: a header length past the file or over ``_MAX_HEADER``
  (256 MiB), a header that is not a UTF-8 JSON object, a duplicate tensor name, a
  ``__metadata__`` that is not a map of strings, an unsupported dtype, dtype x shape that is
  not the byte count of its range, and ``data_offsets`` that do not tile the data section
  exactly (overlaps, gaps, trailing bytes). A file the library refuses is refused here,
  never read with aliased or shifted tensors. A range past the end of the file is reported
  per tensor (``TensorInfo.problem``, "truncated"), so a cut file names exactly the tensors
  it lost.
* **Only the bytes asked for are read**, through ``pread`` into a buffer of the slice's size:
  no mmap (whose touched pages would count as resident memory), never a whole tensor when a
  slice is asked for. A column slice is read in row blocks of at most ``CHUNK_BYTES``
  (8 MiB) at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["SafetensorsFile", "TensorInfo"]

CHUNK_BYTES = 8 << 20  # row block for column-sliced reads
_MAX_HEADER = 256 << 20


_ST_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header. ``problem`` is set when its entry is unusable."""

    name: str
    file: "SafetensorsFile"
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    problem: str | None = None


class SafetensorsFile:
    """A safetensors file: header parsed eagerly (``error`` set if it cannot be), data read
    lazily by slices with ``pread``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.error: str | None = None
        self._fd: int | None = None
        try:
            self.size = self.path.stat().st_size
            self._parse()
        except OSError as e:
            self.size = 0
            self.error = f"cannot be read ({e.strerror or e})"

    def _parse(self) -> None:
        # What ``safetensors`` (0.8) itself refuses is refused here too: a header length past
        # the file (or absurd, e.g. 2**63), a header that is not a UTF-8 JSON object, a
        # duplicate tensor name, a dtype/shape that does not match its byte range, and
        # ``data_offsets`` that do not tile the data section exactly (overlapping, gapped or
        # duplicate ranges, trailing bytes). A range past the end of the file is reported per
        # tensor ("truncated"), so a cut file names exactly the tensors it lost.
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                self.error = f"is {self.size} bytes, shorter than a safetensors header"
                return
            (n,) = struct.unpack("<Q", head)
            if n > min(self.size - 8, _MAX_HEADER):
                self.error = (
                    f"is not a valid safetensors file: its header length field says {n} bytes but "
                    f"the file has {self.size}"
                    + (f" and a header may be at most {_MAX_HEADER}" if n > _MAX_HEADER else "")
                    + " (truncated or corrupt)"
                )
                return
            raw = f.read(n)
        dups: list[str] = []

        def pairs(items):
            d = {}
            for k, v in items:
                if k in d:
                    dups.append(k)
                d[k] = v
            return d

        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs)
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            self.error = f"is not a valid safetensors file: corrupt header ({e})"
            return
        if dups:
            self.error = ("is not a valid safetensors file: its header lists "
                          + ", ".join(repr(d) for d in sorted(set(dups))) + " more than once")
            return
        meta = header.get("__metadata__")
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            self.error = "is not a valid safetensors file: __metadata__ is not a map of strings"
            return
        start = 8 + n
        ranges: list[tuple[int, int, str]] = []
        for name, e in header.items():
            if name == "__metadata__":
                continue
            info, rng = self._entry(name, e, start)
            self.tensors[name] = info
            if rng is not None:
                ranges.append(rng + (name,))
        malformed = [i.problem for i in self.tensors.values() if i.dtype == "?"]
        if malformed:  # an entry without a usable range: the layout cannot be trusted either
            self.error = "is not a valid safetensors file: " + "; ".join(malformed[:6]) + (
                f"; and {len(malformed) - 6} more" if len(malformed) > 6 else "")
            return
        self.error = self._layout_error(ranges, self.size - start)

    def _layout_error(self, ranges: list[tuple[int, int, str]], data_len: int) -> str | None:
        """The tensors' byte ranges must tile ``[0, data_len)`` exactly, in any header order."""
        bad: list[str] = []
        end, prev = 0, None
        for b, e, name in sorted(ranges):
            if b < end:
                bad.append(f"tensor {name!r} data_offsets [{b}, {e}] overlap tensor {prev[2]!r} [{prev[0]}, {prev[1]}]")
            elif b > end:
                bad.append(f"{b - end} bytes before tensor {name!r} (data_offsets [{b}, {e}]) belong to no tensor")
            if e >= end:
                end, prev = e, (b, e, name)
        if bad:  # say which ranges also run past the end (a truncated file on top of it)
            bad += [f"tensor {name!r} (data_offsets [{b}, {e}]) ends past the {data_len}-byte data "
                    "section (file truncated?)" for b, e, name in sorted(ranges) if e > data_len]
        if end < data_len and not bad:
            bad.append(f"{data_len - end} bytes after the last tensor's data belong to no tensor")
        if not bad:
            return None
        shown = "; ".join(bad[:6]) + (f"; and {len(bad) - 6} more" if len(bad) > 6 else "")
        return f"is not a valid safetensors file: its data_offsets do not tile the data section ({shown})"

    def _entry(self, name: str, e: Any, start: int) -> tuple[TensorInfo, tuple[int, int] | None]:
        bad = lambda msg: (TensorInfo(name, self, "?", (), 0, f"tensor {name!r} in {self.path.name}: {msg}"), None)
        if not isinstance(e, dict):
            return bad(f"corrupt header entry {str(e)[:80]}")
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in _ST_DTYPES:
            return bad(f"unsupported dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            return bad(f"corrupt shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            return bad(f"corrupt data_offsets {offs!r}")
        shape = tuple(shape)
        want = math.prod(shape) * np.dtype(_ST_DTYPES[dtype]).itemsize
        info = TensorInfo(name, self, dtype, shape, start + offs[0])
        if offs[1] - offs[0] != want:
            return dataclasses.replace(info, problem=(
                f"tensor {name!r} in {self.path.name}: header gives {offs[1] - offs[0]} bytes for "
                f"{dtype} {list(shape)}, which needs {want} (corrupt)")), (offs[0], offs[1])
        if start + offs[1] > self.size:
            return dataclasses.replace(info, problem=(
                f"tensor {name!r}: its data ends at byte {start + offs[1]} but {self.path.name} "
                f"has {self.size} bytes (file truncated)")), (offs[0], offs[1])
        return info, (offs[0], offs[1])

    # ------------------------------------------------------------------ reading
    def _pread_into(self, arr: np.ndarray, offset: int) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        view = memoryview(arr.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            if hasattr(os, "preadv"):
                got = os.preadv(self._fd, [view[done:]], offset + done)
            else:  # pragma: no cover - platforms without preadv
                chunk = os.pread(self._fd, len(view) - done, offset + done)
                got = len(chunk)
                view[done:done + got] = chunk
            if got <= 0:
                raise OSError(f"{self.path.name} ended early (truncated while loading?)")
            done += got

    def read(self, info: TensorInfo, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor, or rows ``[r0, r1)`` (axis 0) and columns ``[c0, c1)`` (axis 1) of it,
        clamped to its shape. Only those bytes (plus, for a column slice, row blocks of at
        most 8 MiB at a time) are read."""
        if info.problem:
            raise OSError(info.problem)
        dt = np.dtype(_ST_DTYPES[info.dtype])
        shape = info.shape
        if not shape or (rows is None and cols is None):
            out = np.empty(shape, dt)
            self._pread_into(out, info.offset)
            return out
        n0 = shape[0]
        r0, r1 = rows if rows is not None else (0, n0)
        r0, r1 = max(0, min(r0, n0)), max(0, min(r1, n0))
        r1 = max(r1, r0)
        inner = shape[1:]
        row_bytes = math.prod(inner) * dt.itemsize
        if len(shape) == 1 or cols is None or (cols[0] <= 0 and cols[1] >= shape[1]):
            out = np.empty((r1 - r0,) + inner, dt)
            self._pread_into(out, info.offset + r0 * row_bytes)
            return out
        n1 = shape[1]
        c0, c1 = max(0, min(cols[0], n1)), max(0, min(cols[1], n1))
        c1 = max(c0, c1)
        out = np.empty((r1 - r0, c1 - c0) + inner[1:], dt)
        step = max(1, CHUNK_BYTES // max(row_bytes, 1))
        buf = np.empty((min(step, r1 - r0),) + inner, dt)
        for s in range(r0, r1, step):
            k = min(step, r1 - s)
            self._pread_into(buf[:k], info.offset + s * row_bytes)
            out[s - r0:s - r0 + k] = buf[:k, c0:c1]
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
