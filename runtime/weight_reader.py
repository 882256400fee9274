"""Read a rank's weights.safetensors into device memory at disk / PCIe speed.

safetensors' `load_file(device="cuda")` takes each tensor from the mmap on the host and copies it with a pageable
H2D copy: the disk read and the PCIe copy take turns, and a pageable copy runs at a fraction of a pinned one.
Here the file is read front to back in large chunks into two pinned host buffers, and while the GPU copies one
chunk out of one buffer (asynchronously), the disk fills the other. Each chunk is read by several threads at once
(positioned reads of its parts): one thread copying from the page cache tops out well below what the memory and
an NVMe queue give. The device tensors are allocated once, before any byte is read. The CPU path reads straight
into the tensors (nothing staged).
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
from k3plugins.progress import progress_bar

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


class WeightFileError(ValueError):
    """A weights file that is not a complete safetensors file; the message names the file and tensor."""


def read_header(path: Path) -> tuple[dict[str, tuple[torch.dtype, list[int], int, int]], int, dict]:
    """{name: (dtype, shape, start, end)} with offsets into the data section, where that section starts, and the
    header's __metadata__ ({} when it has none)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightFileError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise WeightFileError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightFileError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightFileError(f"{path}: header is not a JSON object")
    data_bytes, entries = size - 8 - n, {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = _DTYPES[e["dtype"]], list(e["shape"]), e["data_offsets"]
            # ints >= 0 only: a string offset would fail below as a TypeError, a negative dim in torch.empty
            good = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in [*shape, start, end])
        except (KeyError, TypeError, ValueError):
            good = False
        if not good:
            raise WeightFileError(f"{path}: tensor {name!r}: bad header entry {e!r} (dtype one of "
                                  f"{sorted(_DTYPES)}, shape and data_offsets [start, end] of ints >= 0)")
        numel = 1
        for d in shape:
            numel *= d
        if end - start != numel * dtype.itemsize or not 0 <= start <= end <= data_bytes:
            raise WeightFileError(f"{path}: tensor {name!r}: data_offsets [{start}, {end}] do not hold "
                                  f"{shape} {e['dtype']} inside the {data_bytes} data bytes (truncated file?)")
        entries[name] = (dtype, shape, start, end)
    spans = sorted((s, t, name) for name, (_, _, s, t) in entries.items())
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise WeightFileError(f"{path}: tensors {a!r} and {b!r} overlap in the data section")
    if (last := max((t for _, t, _ in spans), default=0)) != data_bytes:  # safetensors' "not fully covered"
        raise WeightFileError(f"{path}: {data_bytes - last} bytes past its last tensor's data (bytes appended?)")
    metadata = header.get("__metadata__")
    return entries, 8 + n, metadata if isinstance(metadata, dict) else {}


def read_weights(path: str | os.PathLike, device: str | torch.device = "cpu", *, chunk_bytes: int = 64 << 20,
                 staged: bool | None = None, readers: int = 4, min_part: int = 4 << 20,
                 progress: bool = False, digest=None) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on `device`, read sequentially once.

    Args:
        staged: go through two host buffers (pinned on a GPU, so the copies overlap the reads); default: on
            GPUs only (on the CPU, reads land in the tensors directly).
        chunk_bytes: size of each staging buffer.
        readers, min_part: a staged chunk is read by up to `readers` threads, in parts of at least `min_part`
            bytes.
        digest: a hashlib object to update with every byte of the file, in order, as it is read (the header too),
            on a thread of its own beside the reads: the caller compares it with the build's record.
    Raises:
        WeightFileError naming the file (and tensor) when the file is short, or its header wrong.
    """
    path, device = Path(path), torch.device(device)
    entries, data_start, _ = read_header(path)
    tensors = {name: torch.empty(shape, dtype=dtype, device=device) for name, (dtype, shape, _, _) in entries.items()}
    spans = sorted((s, t, name) for name, (_, _, s, t) in entries.items() if t > s)
    staged = device.type != "cpu" if staged is None else staged
    total = spans[-1][1] if spans else 0
    bar = progress_bar(total=total, unit="B", unit_scale=True, desc=f"load {path.parent.name}", enabled=progress)
    with open(path, "rb", buffering=0) as f, bar, _Hasher(digest) as hasher:
        if digest is not None:
            hasher.update(_read_range(f.fileno(), 0, data_start, path, "the header"))
        if staged:
            readers = max(1, readers)
            with ThreadPoolExecutor(readers, thread_name_prefix="weight-reader") as pool:
                read = partial(_pread_parts, pool, readers, min_part, f.fileno(), data_start, path)
                _read_staged(read, spans, tensors, total, chunk_bytes, device, bar,
                             hasher if digest is not None else None)
        else:
            at = 0  # data bytes hashed so far
            for start, end, name in spans:
                view = memoryview(_bytes(tensors[name]).numpy()).cast("B")
                _pread(f.fileno(), view, data_start + start, path, name)
                if digest is not None:  # bytes between tensors (an alignment pad) belong to the file's hash too
                    hasher.update(_read_range(f.fileno(), data_start + at, start - at, path, name))
                    hasher.update(view)
                    at = end
                bar.update(end - start)
    return tensors


class _Hasher:
    """digest.update on a thread of its own, in the order given, so that hashing a part overlaps reading the next
    (hashlib lets go of the GIL on large buffers); leaving the `with` waits until every part is hashed."""

    def __init__(self, digest):
        self.digest = digest
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="weight-hash") if digest is not None else None
        self.last = None

    def update(self, data) -> Future:
        """Hash data after the parts given before; the caller keeps data unchanged until the future is done."""
        self.last = self.pool.submit(self.digest.update, data)
        return self.last

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            if exc[0] is None and self.last is not None:
                self.last.result()  # a hashing error, raised here


def _read_range(fd: int, offset: int, n: int, path: Path, name: str) -> bytearray:
    out = bytearray(n)
    _pread(fd, memoryview(out), offset, path, name)
    return out


def _read_staged(read, spans, tensors, total: int, chunk: int, device: torch.device, bar, hasher=None) -> None:
    cuda = device.type == "cuda"
    bufs = [torch.empty(min(chunk, total), dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    done = [None, None]  # the event after each buffer's last copies: the buffer is free again once it is reached
    hashed = [None, None]  # with a hasher: each buffer's hash, which must end before the buffer is filled again
    j = 0  # first span that may still overlap the chunk
    for i, c0 in enumerate(range(0, total, chunk)):
        c1 = min(c0 + chunk, total)
        buf = bufs[i % 2]
        if done[i % 2] is not None:
            done[i % 2].synchronize()
        if hashed[i % 2] is not None:
            hashed[i % 2].result()
        while spans[j][1] <= c0:
            j += 1
        read(buf[:c1 - c0].numpy(), c0, spans[j][2])
        k = j
        while k < len(spans) and spans[k][0] < c1:
            start, end, name = spans[k]
            a, b = max(start, c0), min(end, c1)
            _bytes(tensors[name])[a - start:b - start].copy_(buf[a - c0:b - c0], non_blocking=cuda)
            k += 1
        if hasher is not None:  # the whole chunk (pads between tensors too), while the GPU copies it out
            hashed[i % 2] = hasher.update(memoryview(buf[:c1 - c0].numpy()))
        if cuda:
            done[i % 2] = torch.cuda.Event()
            done[i % 2].record(torch.cuda.current_stream(device))
        bar.update(c1 - c0)
    if cuda:
        torch.cuda.current_stream(device).synchronize()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _pread_parts(pool: ThreadPoolExecutor, readers: int, min_part: int, fd: int, data_start: int, path: Path, out,
                 at: int, name: str) -> None:
    """Fill `out` from data offset `at`, in up to `readers` parts read by the pool's threads (os.preadv releases
    the GIL); `name` is the tensor the errors name."""
    view = memoryview(out).cast("B")
    n, offset = len(view), data_start + at
    parts = max(1, min(readers, n // max(1, min_part)))
    bounds = [n * i // parts for i in range(parts + 1)]
    jobs = [pool.submit(_pread, fd, view[a:b], offset + a, path, name) for a, b in zip(bounds, bounds[1:])]
    for job in jobs:
        job.result()


def _pread(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    """Fill `view` from file offset `offset` (a positioned read: no shared file position between threads)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise WeightFileError(f"{path}: ends inside tensor {name!r} (truncated file?)")
        got += n
