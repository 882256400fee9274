"""A CPU engine's weights are its own once loaded: the file rewritten in place (cp over it, rsync --inplace) or
truncated while the engine runs changes nothing in it; mapped (safetensors load_file, MAP_PRIVATE), the running
engine read the new bytes, or died of SIGBUS."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3runtime import LLM

PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture
def engine(k3_tiny_engine, tmp_path) -> Path:
    return Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))


def test_weights_rewritten_in_place_do_not_reach_a_loaded_engine(engine):
    llm = LLM(engine)
    before = llm.logits(PROMPT)
    path = engine / "rank0/weights.safetensors"
    with open(path, "r+b") as f:  # every weight byte zeroed, in place: same inode, same size, header intact
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        f.write(bytes(path.stat().st_size - 8 - n))
    assert torch.equal(llm.logits(PROMPT), before)


def test_weights_truncated_under_a_loaded_engine_do_not_kill_it(engine):
    script = ("import sys; from k3runtime import LLM\n"
              "llm = LLM(sys.argv[1]); p = sys.argv[1] + '/rank0/weights.safetensors'\n"
              "open(p, 'r+b').truncate(100)\n"
              f"print(llm.logits({PROMPT}).shape)\n")
    out = subprocess.run([sys.executable, "-c", script, str(engine)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -7: SIGBUS
