"""Paths of the wrong kind: a rank directory given where the engine's is expected (generate, serve's Python side,
weight-store) is named as such, with the engine's path (it was "not an engine dir (no config.json); build one with
`k3build build`", which sends the user to rebuild an engine they have); a FIFO in an engine file's place is refused
(open() waited for a writer: the load hung)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from k3runtime.cli import main as runtime_main
from k3runtime.loader import EngineError, load_rank


def test_load_rank_names_the_engine(k3_tiny_engine):
    with pytest.raises(EngineError, match=rf"rank0: one rank's directory, not an engine; give the engine's directory "
                                          rf"\({k3_tiny_engine.resolve()}\)"):
        load_rank(k3_tiny_engine / "rank0", 0)


def test_generate_names_the_engine(k3_tiny_engine):
    res = CliRunner().invoke(runtime_main, ["generate", str(k3_tiny_engine / "rank0"), "--prompt", "hi"])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "one rank's directory" in res.output, res.output


def test_weight_store_names_the_engine(k3_tiny_engine, tmp_path):
    out = subprocess.run([sys.executable, "-m", "k3runtime.dist.weight_store", str(k3_tiny_engine / "rank0"),
                          "--shm-root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "one rank's directory, not an engine" in out.stderr, out.stderr


@pytest.mark.parametrize("name", ["config.json", "rank0/graph.onnx", "rank0/weights.safetensors"])
def test_a_fifo_in_a_files_place_is_refused_not_waited_on(k3_tiny_engine, tmp_path, name):
    engine = shutil.copytree(k3_tiny_engine, tmp_path / "engine")
    (engine / name).unlink()
    os.mkfifo(engine / name)
    out = subprocess.run([sys.executable, "-m", "k3runtime.cli", "generate", str(engine), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=120)  # before: TimeoutExpired (a hang)
    assert out.returncode == 1 and out.stderr == f"Error: {engine / name}: not a regular file (a pipe, socket or " \
        "device in its place); copy the engine's file there, or rebuild the engine\n", out.stderr
