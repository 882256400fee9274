"""`k3build inspect` on damaged or partial engines (real engines, then broken on disk): one line naming the file and
what is wrong, a non-zero exit, never a traceback; a rank whose files are missing or cut short is reported, not
listed with the sizes the build recorded."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping


@pytest.fixture(scope="module")
def engine(k3_tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("insp")
    conv = convert(k3_tiny_ckpt, root / "conv", Mapping(tp_size=2), progress=False)
    res = CliRunner().invoke(main, ["build", str(conv), str(root / "engine"), "--max-seq-len", "256",
                                    "--max-num-tokens", "256", "--no-progress"])
    assert res.exit_code == 0, res.output
    return root / "engine"


def _copy(engine, tmp_path):
    return shutil.copytree(engine, tmp_path / "engine")


def _inspect(path, *args):
    res = CliRunner().invoke(main, ["inspect", str(path), *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res


def _edit(eng, fn):
    p = eng / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage", [
    lambda c: c.update(ranks=None),
    lambda c: c["ranks"]["0"].update(layers=[]),
    lambda c: c["build_config"].update(plugins="reference"),
    lambda c: c["memory_plan"].update(budget={"ranks": 3}),
], ids=["ranks-null", "layers-empty", "plugins-string", "budget-wrong"])
def test_malformed_config_is_one_line(engine, tmp_path, damage):
    eng = _copy(engine, tmp_path)
    _edit(eng, damage)
    res = _inspect(eng)
    assert res.exit_code == 1 and "not a k3build engine config" in res.output and str(eng / "config.json") in res.output
    assert "Traceback" not in res.output


def test_unreadable_config_is_one_line(engine, tmp_path):
    eng = _copy(engine, tmp_path)
    (eng / "config.json").write_bytes(b"\xff\xfe{\x00")
    res = _inspect(eng)
    assert res.exit_code == 1 and "not a k3build engine config" in res.output and "UTF-8" in res.output
    (eng / "config.json").unlink()
    (eng / "config.json").mkdir()
    res = _inspect(eng)
    assert res.exit_code == 1 and "config.json: cannot read it" in res.output


def test_missing_rank_is_an_incomplete_engine(engine, tmp_path):
    eng = _copy(engine, tmp_path)
    shutil.rmtree(eng / "rank1")
    res = _inspect(eng)
    assert res.exit_code == 1, res.output
    assert "rank1/graph.onnx missing" in res.output and "rank1/weights.safetensors missing" in res.output
    assert "incomplete engine" in res.output
    assert "rank0/" not in res.output.split("incomplete engine")[1]  # the whole rank is not blamed


def test_truncated_weights_are_reported(engine, tmp_path):
    eng = _copy(engine, tmp_path)
    w = eng / "rank0" / "weights.safetensors"
    size = w.stat().st_size
    os.truncate(w, size // 2)
    res = _inspect(eng)
    assert res.exit_code == 1, res.output
    assert f"rank0/weights.safetensors is {size // 2} bytes, the build wrote {size}" in res.output


def test_whole_engine_still_inspects(engine):
    res = _inspect(engine)
    assert res.exit_code == 0 and "rank1: pp=0 tp=1" in res.output and "missing" not in res.output


def test_another_format_version_is_named(engine, tmp_path):
    """An engine of a format this k3build does not read (a newer k3build's): inspect says so, as the runtime refuses
    it; if the rest cannot be read either, the one line names the version."""
    eng = _copy(engine, tmp_path)
    _edit(eng, lambda c: c.update(version=99))
    res = _inspect(eng)
    assert res.exit_code == 0 and "engine format v99" in res.output and "k3runtime refuses the engine" in res.output
    _edit(eng, lambda c: c.pop("stamp"))
    res = _inspect(eng)
    assert res.exit_code == 1 and "not a k3build engine config (format v99, not v1: KeyError" in res.output
