"""Bad input to `k3build convert` (via the real CLI): a message naming file + tensor + expectation, exit != 0,
no output directory (nor temp dir) left behind; and a kill -9 mid-run followed by a correct re-run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from convert_helpers import copy_ckpt, make_tiny, reassemble, rewrite_shard, source_tensors
from k3build.cli import main

L2 = "language_model.model.layers.2."
WQ = L2 + "self_attn.q_proj.weight"
SCALE = L2 + "block_sparse_moe.experts.1.w3.weight_scale"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "ckpt")


def _shard_of(ckpt, name):
    return json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]


def _run(ckpt, out, *args):
    r = CliRunner().invoke(main, ["convert", str(ckpt), str(out), *args])
    assert r.exit_code != 0, r.output
    assert isinstance(r.exception, SystemExit), r.exception  # a ClickException, not a traceback
    assert not out.exists(), "no output directory may be left behind"
    assert not list(out.parent.glob(f".{out.name}.tmp-*")), "no temp directory may be left behind"
    return r.output


def _edit(fn):
    def edit(d):
        fn(d)
        return d
    return edit


def _set(name, value):
    return _edit(lambda d: d.__setitem__(name, value))


def _poke(name, index, value):
    def fn(d):
        t = d[name].clone()
        t.view(-1)[index] = value
        d[name] = t
    return _edit(fn)


CASES = {
    "missing": (_edit(lambda d: d.pop(WQ)), ["missing tensor", WQ[len("language_model."):], "BF16 [128, 128]"]),
    "unexpected": (_set(L2 + "self_attn.extra.weight", torch.zeros(3)), ["unexpected tensor", L2 + "self_attn.extra.weight"]),
    "shape": (_set(WQ, torch.zeros(128, 64, dtype=torch.bfloat16)), [WQ, "wrong shape [128, 64]", "expected [128, 128]"]),
    "dtype": (_edit(lambda d: d.__setitem__(WQ, d[WQ].float())), [WQ, "wrong dtype F32", "expected BF16"]),
    "nan": (_poke(WQ, 77, float("nan")), [WQ, "nan", "expected finite"]),
    "inf": (_poke(WQ, 5, float("-inf")), [WQ, "-inf", "expected finite"]),
    "scale_ff": (_poke(SCALE, 9, 0xFF), [SCALE, "0xFF (NaN in E8M0)", "expected bytes 0..252"]),
    # 2^127 times a code of 2 is Inf in bf16: the engine's logits would be NaN
    "scale_inf": (_poke(SCALE, 3, 0xFE), [SCALE, "0xFE (2^127: its weights decode to Inf in BF16)", "0..252"]),
    "a_log_tail": (_poke(L2 + "self_attn.A_log", 7, 0.5), [L2 + "self_attn.A_log", "padding must be zero", "index 7"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_tensor(tiny, tmp_path, case):
    edit, expect = CASES[case]
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    target = {"scale_ff": SCALE, "scale_inf": SCALE, "a_log_tail": L2 + "self_attn.A_log"}.get(case, WQ)
    shard = rewrite_shard(ckpt, edit, target)
    msg = _run(ckpt, tmp_path / "out", "--tp-size", "2", "--workers", "2" if case == "nan" else "1")
    assert shard in msg or case == "missing", msg
    for e in expect:
        assert e in msg, (e, msg)


def test_truncated_shard(tiny, tmp_path):
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    f = ckpt / _shard_of(ckpt, WQ)
    os.truncate(f, f.stat().st_size - 100)
    msg = _run(ckpt, tmp_path / "out")
    assert str(f) in msg and "truncated" in msg and "tensor language_model." in msg, msg


def test_index_naming_a_missing_shard(tiny, tmp_path):
    """An index that maps a tensor to a shard file that is not there names that file and tensor (it blamed the
    shard that does hold the tensor, as unlisted there); without an index, a dangling shard link is no index's."""
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"][WQ] = "model-00009-of-00009.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _run(ckpt, tmp_path / "out")
    assert f"lists shard model-00009-of-00009.safetensors (for tensor {WQ}), which does not exist" in msg, msg
    (ckpt / "model.safetensors.index.json").unlink()
    shard = ckpt / _shard_of(tiny, WQ)
    shard.unlink()
    shard.symlink_to(tmp_path / "nowhere")
    msg = _run(ckpt, tmp_path / "out")
    assert f"{shard}: not a shard file" in msg and "index.json" not in msg, msg


@pytest.mark.parametrize("how", ["garbage_json", "huge_length"])
def test_corrupt_header(tiny, tmp_path, how):
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    f = ckpt / _shard_of(ckpt, WQ)
    with open(f, "r+b") as fh:
        if how == "garbage_json":
            fh.seek(8)
            fh.write(b"\x00not json\xff")
        else:
            fh.write((1 << 40).to_bytes(8, "little"))
    msg = _run(ckpt, tmp_path / "out")
    assert str(f) in msg and "corrupt safetensors header" in msg, msg


@pytest.mark.parametrize("args, expect", [
    (["--tp-size", "3"], "not divisible by attention TP=3"),
    (["--tp-size", "2", "--ep-size", "3"], "--ep-size 3 does not divide --tp-size 2"),
    (["--tp-size", "4", "--moe-tp-size", "4"], "multiple of 32"),
    (["--tp-size", "2", "--moe-tp-size", "2", "--attention-dp"], "attention-DP off"),
])
def test_mapping_does_not_divide(tiny, tmp_path, args, expect):
    msg = _run(tiny, tmp_path / "out", *args)
    assert expect in msg, msg


@pytest.mark.parametrize("name, text, expect", [
    ("tokenizer.json", "{not json", "tokenizer.json: not a tokenizer the runtime can load"),
    ("tokenizer.json", '{"model": {"type": "nothing"}}', "tokenizer.json: not a tokenizer the runtime can load"),
    ("tokenizer_config.json", "{", "tokenizer_config.json: not valid JSON"),
    ("generation_config.json", "\xff", "generation_config.json: not valid JSON"),
])
def test_tokenizer_files_the_runtime_could_not_load(tiny, tmp_path, name, text, expect):
    # convert copies them into the engine, where they would fail only at the first prompt
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    (ckpt / name).write_text(text)
    msg = _run(ckpt, tmp_path / "out")
    assert expect in msg, msg


@pytest.mark.parametrize("fields, expect", [
    ({"eos_token_id": "2"}, "eos_token_id: expected a token id in 0..511 (vocab_size) or a non-empty list of them, "
                            "got '2'"),
    ({"eos_token_id": [2, 512]}, "eos_token_id: expected a token id in 0..511 (vocab_size)"),
    ({"eos_token_id": []}, "eos_token_id: expected a token id in 0..511 (vocab_size) or a non-empty list"),
    ({"eos_token_id": [2, True]}, "eos_token_id: expected a token id"),
    ({"temperature": -0.5}, "temperature: expected a finite number >= 0, got -0.5"),
    ({"temperature": "0.7"}, "temperature: expected a finite number >= 0, got '0.7'"),
    ({"top_p": 0}, "top_p: expected a number in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p: expected a number in (0, 1], got 1.5"),
    ({"top_k": 2.5}, "top_k: expected an int >= 0 (0 or -1 = off), got 2.5"),
    ({"repetition_penalty": 0}, "repetition_penalty: expected a finite number > 0 (1 = off), got 0"),
    ([{"eos_token_id": 2}], "generation_config.json: expected a JSON object, got list"),
])
def test_a_generation_config_the_engine_cannot_use(tiny, tmp_path, fields, expect):
    """Its EOS ids and sampling defaults go into the engine: a value it cannot use is named with the file."""
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    (ckpt / "generation_config.json").write_text(json.dumps(fields))
    msg = _run(ckpt, tmp_path / "out")
    where = "" if isinstance(fields, list) else "generation_config.json: "
    assert f"{ckpt / 'generation_config.json'}: " in msg and where + expect in " ".join(msg.split()), msg


@pytest.mark.parametrize("value", [0, -1.5, float("nan"), float("inf")])
def test_a_routed_scaling_factor_not_above_zero(tiny, tmp_path, value):
    """It multiplies every routed expert's output: 0 silences them, a negative one flips them."""
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["routed_scaling_factor"] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    msg = " ".join(_run(ckpt, tmp_path / "out").split())
    want = "expected a finite number > 0" if math.isfinite(value) else "expected a finite number"
    assert f"config.json: routed_scaling_factor: {want}, got {value!r}" in msg, msg


def test_a_converted_checkpoint_is_named_as_such(tiny, tmp_path):
    from k3build.convert import convert
    from k3build.mapping import Mapping

    conv = convert(tiny, tmp_path / "conv", Mapping(), progress=False)
    msg = _run(conv, tmp_path / "out")
    assert "already a converted checkpoint" in msg and f"k3build build {conv} ENGINE_DIR" in msg, msg


def test_sigkill_then_rerun(tiny, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "k3build.cli", "convert", str(tiny), str(out), "--tp-size", "2"]
    env = dict(os.environ, K3BUILD_CONVERT_TEST_SLEEP="0.02")  # ~1000 tensors: about 20 s if left alone
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.tmp-*/rank1.safetensors")) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the data phase
    assert proc.poll() is None, "convert finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stale = list(tmp_path.glob(".out.tmp-*"))
    assert not out.exists() and len(stale) == 1
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not stale[0].exists() and [p.name for p in tmp_path.iterdir()] == ["out"]
    got, src = reassemble(out), source_tensors(tiny)
    assert torch.equal(got["model.layers.4.self_attn.o_proj.weight"], src["model.layers.4.self_attn.o_proj.weight"])
    assert all(torch.equal(got[n], src[n]) for n in src if not n.endswith("A_log"))


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_interrupt_cleans_up(tiny, tmp_path, sig, code):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "k3build.cli", "convert", str(tiny), str(out)]
    proc = subprocess.Popen(cmd, env=dict(os.environ, K3BUILD_CONVERT_TEST_SLEEP="0.02"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.tmp-*/rank0.safetensors")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == code
    assert f"convert interrupted; {out} was not written" in proc.stderr.read()
    assert list(tmp_path.iterdir()) == []


def _children(pid):
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _writing(pid):
    """Whether process pid holds a rank file of a staging dir open (a worker in the middle of its jobs)."""
    try:
        return any(".tmp-" in os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def test_a_worker_killed_midway_ends_the_run(tiny, tmp_path):
    """The OOM killer takes a --workers process mid-job: convert stops with one line and leaves nothing (it waited
    for the lost job forever, and a SIGTERM then hung in the pool's clean-up)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "k3build.cli", "convert", str(tiny), str(out), "--tp-size", "2", "--workers", "2"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, K3BUILD_CONVERT_TEST_SLEEP="0.05"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, workers = time.time() + 60, []
        while not (len(workers) == 2 and all(map(_writing, workers))) and time.time() < deadline:
            time.sleep(0.05)
            workers = [w for c in _children(proc.pid) for w in _children(c)]  # the forkserver's children
        assert proc.poll() is None and all(map(_writing, workers)), "no two workers seen writing"
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "Traceback" not in err and "a --workers process died" in err, err
    assert list(tmp_path.iterdir()) == []


def test_unreadable_inputs_are_named(tiny, tmp_path):
    """config.json a directory, an index whose weight_map is not a map of file names: one line each."""
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    index = ckpt / "model.safetensors.index.json"
    saved = index.read_text()
    index.write_text(json.dumps({"weight_map": ["a", "b"]}))
    assert "weight_map must map tensor names to shard file names" in _run(ckpt, tmp_path / "out")
    index.write_text(saved)
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    assert f"{ckpt / 'config.json'}: cannot read" in _run(ckpt, tmp_path / "out")


def test_output_through_a_symlink(tiny, tmp_path, monkeypatch):
    """OUT a symlink (to a larger disk, say): the output goes where it points and the link stays, also with
    --overwrite; a link into a directory that does not exist is refused before any work."""
    (tmp_path / "disk").mkdir()
    assert CliRunner().invoke(main, ["convert", str(tiny), str(tmp_path / "disk" / "conv")]).exit_code == 0
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "disk" / "conv")
    import shutil

    asked, usage = [], shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: asked.append(Path(p)) or usage(p))
    r = CliRunner().invoke(main, ["convert", str(tiny), str(link), "--tp-size", "2", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert asked and asked[0] == tmp_path / "disk"  # the free space where the output goes
    assert link.is_symlink() and json.loads((link / "config.json").read_text())["mapping"]["tp_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "out"]  # no old output left beside the link
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["conv"]
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "conv")
    r = CliRunner().invoke(main, ["convert", str(tiny), str(dangling)])
    assert r.exit_code != 0 and "a symlink to" in r.output and "whose directory does not exist" in r.output


def test_too_little_disk_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    """The rank files' total size against the free space of OUT's disk (shutil.disk_usage, here told 1 MiB)."""
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=2**20))
    msg = _run(tiny, tmp_path / "out")
    assert "MiB, but" in msg and "has only 1.0 MiB free" in msg


def test_a_failed_run_leaves_no_directories_it_made(tiny, tmp_path):
    ckpt = copy_ckpt(tiny, tmp_path / "ckpt")
    rewrite_shard(ckpt, _poke(WQ, 1, float("nan")), WQ)
    (tmp_path / "kept").mkdir()
    _run(ckpt, tmp_path / "kept" / "new" / "deeper" / "out")
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == []
