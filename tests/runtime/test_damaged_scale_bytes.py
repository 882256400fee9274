"""A damaged MXFP4 expert scale byte (one flipped bit of 0x7F is 0xFF, E8M0's NaN) is refused at load, naming the
tensor, as a NaN in a float tensor is; it was loaded, and every token routed to that expert got NaN logits."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3runtime.cli import main as runtime_main
from k3runtime.loader import EngineError, load_rank


def _set_byte(engine: Path, tensor: str, index: int, value: int) -> None:
    path = engine / "rank0/weights.safetensors"
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start = json.loads(f.read(n))[tensor]["data_offsets"][0]
        f.seek(8 + n + start + index)
        f.write(bytes([value]))


@pytest.fixture
def engine(k3_tiny_engine, tmp_path) -> Path:
    return Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))


@pytest.mark.parametrize("tensor,value", [("l1.moe.w13_scale", 0xFF), ("l2.moe.w2_scale", 0xFF),
                                          ("l1.moe.w2_scale", 253)])
def test_scale_byte_past_the_build_bound_is_refused_naming_the_tensor(engine, tensor, value):
    _set_byte(engine, tensor, 5, value)
    with pytest.raises(EngineError, match=rf"'{tensor}' holds E8M0 scale byte 0x{value:02X}.*damaged after its build"):
        load_rank(engine, 0)


def test_generate_says_it_in_one_line(engine):
    _set_byte(engine, "l1.moe.w13_scale", 0, 0xFF)
    res = CliRunner().invoke(runtime_main, ["generate", str(engine), "--prompt", "hi", "--max-tokens", "1"])
    said = [line for line in res.stderr.splitlines() if not line.startswith("load rank0")]  # less the load's progress
    assert res.exit_code == 1 and len(said) == 1 and said[0].startswith("Error: "), res.output
    assert "l1.moe.w13_scale" in said[0]


def test_scale_bytes_the_build_writes_still_load(engine):
    _set_byte(engine, "l1.moe.w13_scale", 5, 252)  # the largest finite one: a valid (if odd) scale
    assert load_rank(engine, 0).weights["l1.moe.w13_scale"].max() == 252
