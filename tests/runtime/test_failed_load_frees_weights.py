"""A load refused after the weights are read (a NaN tensor, a shape the graph does not expect, a sha256 other than
the build's) leaves none of them
alive while its EngineError is held: the error's traceback (a notebook's sys.last_value, a caller keeping it to
report) held the loader's frames and every tensor in them, on a GPU a whole rank's device memory, so a retry after
fixing the file ran out of it."""

from __future__ import annotations

import gc
import json
import shutil
import struct
from pathlib import Path

import onnx
import pytest
import torch

from k3runtime.loader import EngineError, load_rank


@pytest.fixture
def engine(k3_tiny_engine, tmp_path) -> Path:
    return Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))


def _nan(engine: Path) -> None:
    path = engine / "rank0/weights.safetensors"
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))["lm_head"]
        f.seek(8 + n + entry["data_offsets"][0])
        f.write(b"\x00\x00\xc0\x7f" if entry["dtype"] == "F32" else b"\xc0\x7f")


def _shape(engine: Path) -> None:
    model = onnx.load(engine / "rank0/graph.onnx")
    vi = next(v for v in model.graph.input if v.name == "l0.mlp.down")
    vi.type.tensor_type.shape.dim[0].dim_value += 1
    onnx.save(model, engine / "rank0/graph.onnx")
    cfg = json.loads((engine / "config.json").read_text())
    cfg["ranks"]["0"].pop("graph_sha256", None)  # a graph edited on purpose (the graph's recorded sha256 would refuse it first)
    (engine / "config.json").write_text(json.dumps(cfg))


def _one_bit(engine: Path) -> None:
    """A bit of one weight flipped: only verify_weights' hash refuses it (loaded with verify below)."""
    path = engine / "rank0/weights.safetensors"
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + json.loads(f.read(n))["embed"]["data_offsets"][0])
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def _tensors() -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


@pytest.mark.parametrize("damage, words", [(_nan, "hold NaN or Inf"), (_shape, "graph expects"),
                                           (_one_bit, "damaged since its build")], ids=["nan", "shape", "sha256"])
def test_a_refused_load_keeps_no_tensor_alive(engine, damage, words):
    damage(engine)
    before = _tensors()
    with pytest.raises(EngineError, match=words) as held:
        load_rank(engine, 0, verify=damage is _one_bit)
    assert held.value is not None  # the error is still held here ...
    assert _tensors() - before < 5  # ... and not the rank's 186 tensors
