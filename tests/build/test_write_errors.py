"""A write that fails (the disk full, a file size limit) ends synth and build with one line naming the output, as
convert's does, not a traceback; and no output or staging dir is left."""
from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from k3build.convert import convert
from k3build.mapping import Mapping

LIMIT = 1 << 20  # bytes a process may write to one file: below the tiny checkpoint's shards and rank weights


def _limited():
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))  # Python ignores SIGXFSZ: the write fails with EFBIG


@pytest.fixture(scope="module")
def converted(k3_tiny_ckpt, tmp_path_factory):
    return convert(k3_tiny_ckpt, tmp_path_factory.mktemp("conv") / "tp1", Mapping(), progress=False)


@pytest.mark.parametrize("command", ["synth", "build"])
def test_a_failed_write_is_one_line(command, converted, tmp_path):
    out = tmp_path / "out"
    args = ["--preset", "tiny"] if command == "synth" else [str(converted), "--no-progress", "--max-seq-len", "256"]
    args = [args[0], str(out), *args[1:]] if command == "build" else [str(out), *args]
    res = subprocess.run([sys.executable, "-m", "k3build.cli", command, *args], capture_output=True, text=True,
                         timeout=300, preexec_fn=_limited)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"Error: {out}: cannot be written (File too large" in res.stderr
    assert list(tmp_path.iterdir()) == []
