"""runtime/weight_reader.py against safetensors' own reader, on real files: every dtype, tensors split across
staging chunks, empty tensors, and the damaged files a loader must refuse by name."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3runtime.weight_reader import WeightFileError, read_header, read_weights


@pytest.fixture
def st_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(37, 11, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(1000, generator=g),
        "c.u8": torch.randint(0, 256, (7, 5, 3), dtype=torch.uint8, generator=g),  # odd byte count
        "d.i64": torch.arange(9),
        "e.empty": torch.empty(0, 4),
        "f.f16": torch.randn(3, 333, generator=g).to(torch.float16),
        "g.bool": torch.rand(13, generator=g) > 0.5,
    }
    path = tmp_path / "weights.safetensors"
    save_file(tensors, path, metadata={"format": "k3engine"})
    return path


@pytest.mark.parametrize("chunk,staged,min_part", [(64 << 20, False, 4 << 20), (64 << 20, True, 4 << 20),
                                                   (1000, True, 4 << 20), (1000, True, 300), (7, True, 1)])
def test_reads_what_safetensors_reads(st_file, chunk, staged, min_part):
    """Staged with 7-byte chunks: every tensor is split over many chunks and many chunks hold several tensors;
    with small parts, each chunk is read by several threads (3 parts of 333 bytes, 7 parts of 1 byte)."""
    want = load_file(st_file)
    got = read_weights(st_file, "cpu", chunk_bytes=chunk, staged=staged, readers=8, min_part=min_part)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_reads_a_built_engine_rank(k3_tiny_engine, capsys):
    path = k3_tiny_engine / "rank0" / "weights.safetensors"
    want, got = load_file(path), read_weights(path, "cpu", chunk_bytes=1 << 16, staged=True, progress=True)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert "load rank0" in capsys.readouterr().err  # the progress bar names the rank it reads


def test_truncated_file_is_refused_naming_the_tensor(st_file):
    size = st_file.stat().st_size
    st_file.write_bytes(st_file.read_bytes()[:size - 100])
    with pytest.raises(WeightFileError,
                       match=r"weights\.safetensors: tensor '.*': data_offsets .*\(truncated file\?\)"):
        read_weights(st_file)


def test_bad_header_is_refused(st_file, tmp_path):
    raw = bytearray(st_file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8:8 + n] = b"{" * n
    st_file.write_bytes(bytes(raw))
    with pytest.raises(WeightFileError, match="header is not JSON"):
        read_weights(st_file)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x05\x00")
    with pytest.raises(WeightFileError, match="too short"):
        read_weights(short)


def _rewrite_header(path, change):
    """The same data under a header edited by `change` (the file is rewritten, header length and all)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def test_unknown_dtype_and_overlap_are_refused(st_file):
    original = st_file.read_bytes()
    _rewrite_header(st_file, lambda h: h["d.i64"].update(dtype="F8_E9M9"))
    with pytest.raises(WeightFileError, match=r"tensor 'd.i64': bad header entry"):
        read_weights(st_file)
    st_file.write_bytes(original)

    def overlap(h):  # d.i64 (72 bytes) moved onto the start of b.f32
        start = h["b.f32"]["data_offsets"][0]
        h["d.i64"]["data_offsets"] = [start, start + 72]
    _rewrite_header(st_file, overlap)
    with pytest.raises(WeightFileError, match="overlap"):
        read_weights(st_file)


@pytest.mark.parametrize("field, value", [("data_offsets", ["0", "72"]), ("shape", [-3, -3]), ("shape", [9.0]),
                                          ("data_offsets", [True, 72])], ids=["str-offsets", "neg-dims", "float-dim",
                                                                              "bool-offset"])
def test_header_numbers_that_are_not_sizes_are_refused(st_file, field, value):
    """Offsets and dims that are not ints >= 0: a WeightFileError naming the tensor, not a TypeError from the
    offsets' arithmetic or a RuntimeError from torch.empty."""
    _rewrite_header(st_file, lambda h: h["d.i64"].update({field: value}))
    with pytest.raises(WeightFileError, match=r"weights\.safetensors: tensor 'd.i64': bad header entry .*ints >= 0"):
        read_weights(st_file)


def test_header_metadata_is_returned(st_file):
    entries, data_start, metadata = read_header(st_file)
    assert metadata == {"format": "k3engine"} and sorted(entries) == sorted(load_file(st_file))
    assert data_start == 8 + struct.unpack("<Q", st_file.read_bytes()[:8])[0]


def test_engine_loader_turns_a_bad_file_into_an_engine_error(k3_tiny_engine, tmp_path):
    """load_rank on a truncated rank file names the file and says to rebuild (the GPU path reads with
    read_weights; the CPU path with safetensors: both refuse)."""
    import shutil

    from k3runtime.loader import EngineError, load_rank

    engine = tmp_path / "engine"
    shutil.copytree(k3_tiny_engine, engine)
    w = engine / "rank0" / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:-4096])
    with pytest.raises(EngineError, match=r"rank0/weights.safetensors: corrupt .*rebuild"):
        load_rank(engine, 0, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [64 << 20, 4096, 7])
def test_gpu_reads_what_safetensors_reads(st_file, chunk):
    """The pinned double-buffered path: async copies out of a buffer the disk refills two chunks later."""
    want = load_file(st_file)
    got = read_weights(st_file, "cuda", chunk_bytes=chunk)
    assert all(got[n].is_cuda and torch.equal(got[n].cpu(), want[n]) for n in want)


def _with_gap(tmp_path):
    """A safetensors file whose two tensors have 5 pad bytes between them (another writer's alignment)."""
    a, b = torch.arange(6, dtype=torch.int32), torch.arange(3, dtype=torch.float32)
    header = {"a": {"dtype": "I32", "shape": [6], "data_offsets": [0, 24]},
              "b": {"dtype": "F32", "shape": [3], "data_offsets": [29, 41]}}
    head = json.dumps(header).encode()
    path = tmp_path / "gap.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + a.numpy().tobytes() + b"\x07" * 5 + b.numpy().tobytes())
    return path, {"a": a, "b": b}


@pytest.mark.parametrize("chunk,staged", [(64 << 20, False), (64 << 20, True), (7, True)])
def test_digest_is_the_whole_files_sha256(st_file, tmp_path, chunk, staged):
    """read_weights(digest=...) hashes every byte of the file in order, as it reads: the header and the pad bytes
    between tensors too, on both paths and across chunk boundaries."""
    import hashlib

    gap, tensors = _with_gap(tmp_path)
    for path in (st_file, gap):
        digest = hashlib.sha256()
        got = read_weights(path, "cpu", chunk_bytes=chunk, staged=staged, digest=digest)
        assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest(), path.name
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    data = bytearray(gap.read_bytes())
    data[-13] ^= 1  # a pad byte: no tensor changes, the hash does
    gap.write_bytes(bytes(data))
    digest = hashlib.sha256()
    read_weights(gap, "cpu", chunk_bytes=chunk, staged=staged, digest=digest)
    assert digest.hexdigest() == hashlib.sha256(bytes(data)).hexdigest()
