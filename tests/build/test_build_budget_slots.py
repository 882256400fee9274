"""A --gpu-memory-gib budget that holds fewer KDA slots than --max-batch-size: the engine runs fewer requests at once
than the user asked for, and the build must say so (it recorded the smaller number silently)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping
from k3build.memory import GiB, plan_memory
from k3build.build.source import read_converted

LIMITS = dict(max_seq_len=1024, max_batch_size=8, max_num_tokens=256)


@pytest.fixture(scope="module")
def converted(k3_tiny_ckpt, tmp_path_factory):
    return convert(k3_tiny_ckpt, tmp_path_factory.mktemp("conv") / "tp1", Mapping(), progress=False)


def _budget_for_slots(converted, slots: int) -> float:
    """GiB (no overhead) that leave room for `slots` KDA slots and one full-length request's pages, not more."""
    _, cfg, mapping = read_converted(converted)
    big = plan_memory(cfg, mapping, gpu_memory_bytes=GiB, overhead_bytes=0, **LIMITS).ranks[0]
    pages = -(-LIMITS["max_seq_len"] // 64) * big.page_bytes
    need = GiB - big.free_bytes + slots * big.kda_state_bytes_per_request + pages
    return (need + big.kda_state_bytes_per_request // 2) / GiB


def test_budget_short_of_the_batch_size_is_said(converted, tmp_path):
    gib = _budget_for_slots(converted, 3)
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", str(converted), str(out), "--gpu-memory-gib", repr(gib),
                                    "--overhead-gib", "0", "--max-seq-len", "1024", "--max-batch-size", "8",
                                    "--max-num-tokens", "256", "--no-progress"])
    assert res.exit_code == 0, res.output
    slots = json.loads((out / "config.json").read_text())["memory_plan"]["num_slots"]
    assert 1 <= slots < 8
    assert "--max-batch-size 8" in res.output and f"holds {slots} KDA slots" in res.output, res.output
    assert f"at most {slots} requests run at once, 1 of them of --max-seq-len 1024" in res.output


def test_budget_that_holds_the_batch_size_says_nothing_of_it(converted, tmp_path):
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", str(converted), str(out), "--gpu-memory-gib", "1.0625",
                                    "--max-seq-len", "1024", "--max-batch-size", "8", "--max-num-tokens", "256",
                                    "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["memory_plan"]["num_slots"] == 8
    assert "KDA slots" not in res.output


def test_inspect_says_why_fewer_run_than_memory_holds(converted, tmp_path):
    """inspect gave "1 requests ... run at once (memory holds 252)" with no reason; it now says it as plan does."""
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", str(converted), str(out), "--gpu-memory-gib", "1.1", "--max-seq-len",
                                    "1024", "--max-batch-size", "1", "--max-num-tokens", "256", "--no-progress"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["inspect", str(out)])
    line = next(x for x in res.output.splitlines() if "run at once" in x)
    assert "1 requests of 1024 tokens run at once (memory holds" in line, line
    assert line.endswith(": max_batch_size 1 caps the KDA slots)"), line
