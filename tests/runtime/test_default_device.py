"""--device left out: the CLIs run an engine on its target's device (cuda for sm90 and gfx942 engines, cpu for cpu
ones), so a GPU engine needs no flag; the Python API keeps cpu as its default."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from k3runtime.cli import main
from k3runtime.loader import default_device
from k3runtime.triton_backend.repo import write_repo


@pytest.mark.parametrize("target,device", [("cpu", "cpu"), ("sm90", "cuda"), ("gfx942", "cuda"), (None, "cpu")])
def test_default_device_is_the_targets(target, device):
    assert default_device({"stamp": {"target": target}}) == device


@pytest.fixture
def sm90_engine(k3_tiny_engine, tmp_path) -> Path:
    engine = shutil.copytree(k3_tiny_engine, tmp_path / "engine")
    cfg = json.loads((engine / "config.json").read_text())
    cfg["stamp"]["target"] = "sm90"
    (engine / "config.json").write_text(json.dumps(cfg))
    return engine


def _param(pbtxt: str, key: str) -> str:
    at = pbtxt.index(f'key: "{key}"')
    return json.loads(pbtxt[pbtxt.index("string_value:", at) + len("string_value:"):].split("}", 1)[0])


def test_triton_repo_takes_the_targets_device(k3_tiny_engine, sm90_engine, tmp_path):
    gpu = (write_repo(sm90_engine, tmp_path / "repo", model_name="gpu") / "config.pbtxt").read_text()
    assert _param(gpu, "device") == "cuda" and "kind: KIND_MODEL" in gpu
    cpu = (write_repo(k3_tiny_engine, tmp_path / "repo", model_name="cpu") / "config.pbtxt").read_text()
    assert _param(cpu, "device") == "cpu" and "kind: KIND_CPU" in cpu
    given = (write_repo(sm90_engine, tmp_path / "repo", model_name="given", device="cuda:1") / "config.pbtxt")
    assert _param(given.read_text(), "device") == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a GPU-less host")
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "0"]], ids=["generate",
                                                                                                 "serve"])
def test_a_gpu_engine_on_a_gpu_less_host_says_so(sm90_engine, command):
    res = CliRunner().invoke(main, [command[0], str(sm90_engine), *command[1:]])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "this sm90 engine runs on --device cuda: torch" in res.output and "sees no GPU here" in res.output
