"""Safetensors at the byte level: validated header reads, planned layouts, positional reads and writes.

The converter never loads a whole file: it reads headers, plans every output header, then moves tensor
bytes with pread/pwrite. Errors name the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "F16": torch.float16,
                "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32, "I64": torch.int64,
                "F64": torch.float64}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# MXFP4 block scales some checkpoints store as F8_E8M0 (torch.float8_e8m0fnu) rather than U8: the same exponent
# bytes, read as uint8 because the MXFP4 code works on the bytes (and float8_e8m0fnu has few torch ops)
E8M0 = "F8_E8M0"
BYTE_DTYPES = {E8M0: torch.uint8}
MAX_HEADER = 1 << 30  # safetensors caps headers far below this; a bigger length field means corruption


class SafetensorsError(ValueError):
    """A shard that is truncated, corrupt or not safetensors; names the file (and tensor)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes live: `path` at absolute offset `start`, `nbytes` long."""

    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors header against the file's size. Returns (tensors by name, metadata)."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: corrupt safetensors header: file is {size} bytes, shorter than "
                                       "the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{path}: corrupt safetensors header: header length {n} does not fit "
                                       f"in a {size}-byte file")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header: expected a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, e in header.items():
        out[name] = _entry(path, name, e, data_start, data_len)
    spans = sorted((t.start, t.start + t.nbytes, t.name) for t in out.values() if t.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise SafetensorsError(f"{path}: corrupt safetensors header: tensors {a} and {b} overlap")
    return out, meta


def _entry(path: str, name: str, e, data_start: int, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {name}"
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
        raise SafetensorsError(f"{where}: corrupt header entry (expected dtype, shape, data_offsets), got {e!r}")
    dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise SafetensorsError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise SafetensorsError(f"{where}: corrupt shape {shape!r}")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)
            or not 0 <= offs[0] <= offs[1]):
        raise SafetensorsError(f"{where}: corrupt data_offsets {offs!r}")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offs[1] - offs[0] != nbytes:
        raise SafetensorsError(f"{where}: data_offsets {offs} span {offs[1] - offs[0]} bytes, but {dtype} "
                               f"{shape} needs {nbytes}")
    if offs[1] > data_len:
        raise SafetensorsError(f"{where}: file is truncated: the tensor's bytes end at data offset {offs[1]} "
                               f"but the file holds only {data_len} data bytes")
    return TensorInfo(path, name, dtype, tuple(shape), data_start + offs[0], nbytes)


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Load one tensor's bytes (one read, no mmap) as a torch tensor of its dtype and shape."""
    buf = np.empty(info.nbytes, dtype=np.uint8)
    view, got = memoryview(buf), 0
    with open(info.path, "rb", buffering=0) as f:
        while got < info.nbytes:
            k = os.preadv(f.fileno(), [view[got:]], info.start + got)
            if k == 0:
                raise SafetensorsError(f"{info.path}: tensor {info.name}: file is truncated (read {got} of "
                                       f"{info.nbytes} bytes)")
            got += k
    t = torch.from_numpy(buf)
    dtype = TORCH_DTYPES.get(info.dtype, BYTE_DTYPES.get(info.dtype))
    if dtype is None:
        raise SafetensorsError(f"{info.path}: tensor {info.name}: dtype {info.dtype} is not supported here")
    return t.view(dtype).reshape(info.shape)


@dataclass(frozen=True)
class FileLayout:
    """A planned safetensors file: its header bytes and where each tensor's data goes (absolute offsets)."""

    header: bytes
    offsets: dict[str, int]
    size: int


def plan_file(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> FileLayout:
    """Lay out tensors (name, dtype, shape) back to back in the given order."""
    header: dict = {"__metadata__": metadata}
    rel, pos = {}, 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as safetensors writers do
    start = 8 + len(raw)
    return FileLayout(struct.pack("<Q", len(raw)) + raw, {k: start + v for k, v in rel.items()}, start + pos)


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        k = os.pwrite(fd, view, offset)
        view, offset = view[k:], offset + k


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's raw bytes without a copy (bf16 included, which numpy cannot hold)."""
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")
