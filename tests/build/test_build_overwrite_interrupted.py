"""Ctrl-C while `build --overwrite` removes the engine it replaced: the new engine was already in place, yet the
build said "was not written" (exit 130), and what was left of the old engine (`.ENGINE.old-*`, up to a whole K3
engine) stayed beside OUT for good: no later run removes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from k3build.convert import convert
from k3build.mapping import Mapping
from k3build.output_dir import PID_FILE, _host, _start_time, clean_stale

FAST = ["--max-seq-len", "256", "--max-num-tokens", "256", "--no-progress"]


@pytest.fixture(scope="module")
def converted(k3_tiny_ckpt, tmp_path_factory):
    return convert(k3_tiny_ckpt, tmp_path_factory.mktemp("conv") / "tp1", Mapping(), progress=False)


def _build(converted, out, *args, **kw):
    return subprocess.Popen([sys.executable, "-m", "k3build.cli", "build", str(converted), str(out), *FAST, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_interrupt_while_the_old_engine_goes(converted, tmp_path):
    out = tmp_path / "engine"
    p = _build(converted, out)
    assert p.wait(timeout=300) == 0, p.communicate()
    # so that removing the old engine takes a while, as a real one's does (rank dirs: what --overwrite replaces)
    pad = [out / f"rank{i}" for i in range(1, 40001)]
    for d in pad:
        d.mkdir()
    p = _build(converted, out, "--overwrite")
    end = time.time() + 300
    while not any(d.name.startswith(".engine.old-") for d in tmp_path.iterdir()):
        assert p.poll() is None and time.time() < end, p.communicate()
        time.sleep(0.002)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=300)
    assert (out / "config.json").is_file() and not pad[0].exists()  # the new engine is in place
    assert p.returncode == 0 and "engine written to" in stdout, (p.returncode, stdout, stderr)
    assert "was not written" not in stderr
    # whatever the interrupted removal left goes with the next run
    p = _build(converted, out, "--overwrite")
    assert p.wait(timeout=300) == 0, p.communicate()
    assert sorted(d.name for d in tmp_path.iterdir()) == ["engine"]


def test_clean_stale_removes_a_dead_runs_old_output_only(tmp_path):
    out = tmp_path / "engine"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    start = _start_time(dead.pid)
    dead.wait()
    mine = f"{os.getpid()} {_host()} {_start_time(os.getpid())}\n"
    for name, pid in ((".engine.old-dead", f"{dead.pid} {_host()} {start or '-'}\n"), (".engine.old-live", mine),
                      (".engine.old-none", None)):
        (tmp_path / name / "rank0").mkdir(parents=True)
        if pid:
            (tmp_path / name / PID_FILE).write_text(pid)
    clean_stale(out)
    assert sorted(d.name for d in tmp_path.iterdir()) == [".engine.old-live", ".engine.old-none"]
