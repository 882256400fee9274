"""Bytes of a rank's files changed after the build (a disk, a copy) are refused at load by the sha256 the build
records in config.json: graph.onnx always (a one-bit change to an attribute's name was a KeyError traceback at the
first step; to its value, another model's output without a word), weights.safetensors where the weight store
copies it (it hashes every byte anyway) and where the load is asked to verify it (verify_weights)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from test_weight_store import Store

from k3runtime.loader import EngineError, load_rank


@pytest.fixture
def engine(k3_tiny_engine, tmp_path) -> Path:
    return Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))


def _flip(path: Path, find: bytes, offset: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[data.index(find) + offset] ^= mask
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("find, offset, mask", [(b"renormalize", 1, 0x04), (b"\x03eps\x15", 8, 0x08)],
                         ids=["attribute-name", "attribute-value"])
def test_a_graph_changed_after_the_build_is_refused(engine, find, offset, mask):
    _flip(engine / "rank0/graph.onnx", find, offset, mask)
    with pytest.raises(EngineError, match=r"rank0/graph.onnx: damaged since its build \(sha256 "):
        load_rank(engine, 0)


def test_the_build_records_what_it_wrote(engine):
    import hashlib

    info = json.loads((engine / "config.json").read_text())["ranks"]["0"]
    for name, key in (("graph.onnx", "graph_sha256"), ("weights.safetensors", "weights_sha256")):
        assert info[key] == hashlib.sha256((engine / "rank0" / name).read_bytes()).hexdigest()
    load_rank(engine, 0, verify=True)  # the intact engine loads, verified


def _flip_one_weight_bit(engine: Path) -> None:
    path = engine / "rank0/weights.safetensors"
    with open(path, "r+b") as f:  # one bit of one bf16 weight: no NaN, same size, header intact
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + json.loads(f.read(n))["embed"]["data_offsets"][0])
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def test_verify_weights_refuses_weights_changed_after_the_build(engine):
    """EngineOptions.verify_weights (--verify-weights): the load hashes the file as it reads it. Without it, one bit
    of one weight loads (finite, scales in range: the loader's own checks pass)."""
    from k3runtime import LLM

    _flip_one_weight_bit(engine)
    load_rank(engine, 0)
    with pytest.raises(EngineError, match=r"rank0/weights.safetensors: damaged since its build \(sha256 \w{12}, "
                                          r"config.json records \w{12}\)"):
        LLM(engine, verify_weights=True)


def test_verify_weights_needs_the_builds_record(engine):
    cfg = json.loads((engine / "config.json").read_text())
    del cfg["ranks"]["0"]["weights_sha256"]
    (engine / "config.json").write_text(json.dumps(cfg))
    load_rank(engine, 0, verify=False)
    with pytest.raises(EngineError, match=r"weights.safetensors: its build recorded no sha256 of it"):
        load_rank(engine, 0, verify=True)


def test_the_weight_store_refuses_weights_changed_after_the_build(engine):
    _flip_one_weight_bit(engine)
    store = Store(engine)
    try:
        _, err = store.proc.communicate(timeout=60)
    finally:
        store.close()
    assert store.proc.returncode == 1 and "weights.safetensors: damaged since its build" in err, err


def test_generate_verify_weights_flag(engine):
    """`k3runtime generate --verify-weights`: the damaged file is named and the command fails before generating;
    the intact engine generates with the flag."""
    from click.testing import CliRunner

    from k3runtime.cli import main

    ok = CliRunner().invoke(main, ["generate", str(engine), "--max-tokens", "2", "--prompt", "hi", "--verify-weights"])
    assert ok.exit_code == 0 and "2 tokens" in ok.output, ok.output
    _flip_one_weight_bit(engine)
    res = CliRunner().invoke(main, ["generate", str(engine), "--max-tokens", "2", "--prompt", "hi", "--verify-weights"])
    assert res.exit_code != 0 and "weights.safetensors: damaged since its build" in res.output, res.output
