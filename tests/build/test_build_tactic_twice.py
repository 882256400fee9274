"""Two --tactic values for one op contradict each other: the build kept the last one silently."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping


@pytest.fixture(scope="module")
def converted(k3_tiny_ckpt, tmp_path_factory):
    return convert(k3_tiny_ckpt, tmp_path_factory.mktemp("conv") / "tp1", Mapping(), progress=False)


def _build(converted, out, *args):
    return CliRunner().invoke(main, ["build", str(converted), str(out), "--target", "sm90", "--max-seq-len", "256",
                                     "--max-num-tokens", "256", "--no-progress", *args])


def test_two_tactics_for_one_op_are_refused(converted, tmp_path):
    out = tmp_path / "engine"
    res = _build(converted, out, "--tactic", "MoEExperts=triton", "--tactic", "MoEExperts=triton_ds")
    assert res.exit_code != 0 and not out.exists(), res.output
    assert "--tactic" in res.output and "MoEExperts" in res.output and "triton, triton_ds" in res.output
    assert "Traceback" not in res.output


def test_the_same_tactic_twice_is_one(converted, tmp_path):
    res = _build(converted, tmp_path / "engine", "--tactic", "MoEExperts=triton_ds", "--tactic", "MoEExperts=triton_ds")
    assert res.exit_code == 0, res.output
