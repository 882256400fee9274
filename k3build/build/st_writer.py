"""Write a safetensors file one tensor at a time (memory bounded by the largest tensor).

Data goes to a side file as tensors arrive; `close()` writes the header and appends the data, so the
final file is never half-valid: it appears only once complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable

import torch

_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
             torch.int64: "I64", torch.int32: "I32", torch.int8: "I8"}


class SafetensorsWriter:
    def __init__(self, path: str | os.PathLike, metadata: dict[str, str] | None = None):
        self.path = os.fspath(path)
        self._data_path = self.path + ".data"
        self._data = open(self._data_path, "wb")
        self._entries: dict[str, dict] = {}
        self._offset = 0
        self._metadata = metadata or {}
        self.sha256: str | None = None  # of the whole file, once closed (config.json records it for the runtime)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"{self.path}: tensor {name!r} written twice")
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self._data.write(memoryview(raw) if t.numel() else raw)
        size = t.numel() * t.element_size()
        self._entries[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape),
                               "data_offsets": [self._offset, self._offset + size]}
        self._offset += size

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data added so far (what close() copies behind the header)."""
        return self._offset

    def close(self, progress: Callable[[int], None] | None = None) -> None:
        """Write the file: header, then the data copied from the side file; `progress(n)` after each n bytes."""
        self._data.close()
        header = dict(self._entries)
        if self._metadata:
            header["__metadata__"] = self._metadata
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned for mmap readers
        digest = hashlib.sha256()
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            for head in (struct.pack("<Q", len(blob)), blob):
                out.write(head)
                digest.update(head)
            buf = memoryview(bytearray(16 << 20))
            while n := data.readinto(buf):  # hashed as it is copied: no second pass over the file
                out.write(buf[:n])
                digest.update(buf[:n])
                if progress is not None:
                    progress(n)
            out.flush()
            os.fsync(out.fileno())
        self.sha256 = digest.hexdigest()
        os.remove(self._data_path)

    def abort(self) -> None:
        self._data.close()
        for p in (self._data_path, self.path):
            if os.path.exists(p):
                os.remove(p)
