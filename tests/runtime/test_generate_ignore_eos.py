"""`k3runtime generate --ignore-eos` runs a prompt to --max-tokens past the EOS that ends it without the flag (for
timing runs, as vLLM's benchmarks take it; the multi-rank Ctrl-C test needs a generation that lasts)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from click.testing import CliRunner
from engines import build_engine

from k3runtime.cli import main

LAYER_TYPES = ("kda", "mla", "kda", "kda", "mla", "mla")  # tests/dist's short model: greedy "The" meets EOS early


@pytest.fixture(scope="module")
def short_engine(tmp_path_factory):
    from k3build.config import preset
    from k3build.synth import synth

    config = dataclasses.replace(preset("tiny"), num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
                                 attn_res_block_size=2)
    root = tmp_path_factory.mktemp("short")
    synth(root / "ckpt", config, seed=0, progress=False)
    return build_engine(root / "ckpt", root / "engine")


def _run(engine, *flags) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, ["generate", str(engine), "--prompt", "The", "--max-tokens", "48", *flags])
    assert res.exit_code == 0, res.output
    count, reason = re.search(r"-> (\d+) tokens \((\w+)\)", res.stdout).groups()
    return int(count), reason, res.stdout.split("\n", 1)[1]


def test_ignore_eos_generates_to_max_tokens(short_engine):
    count, reason, text = _run(short_engine)
    assert reason == "stop" and count < 48
    count, reason, longer = _run(short_engine, "--ignore-eos")
    assert (count, reason) == (48, "length") and longer.startswith(text.rstrip("\n"))
