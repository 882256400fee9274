"""Progress off a terminal (k3plugins.progress): a log gets whole lines, one every LOG_EVERY_S seconds and the last,
not tqdm's carriage returns; convert, which showed nothing off a terminal, now shows its progress there."""

from __future__ import annotations

import io

from click.testing import CliRunner

from k3build.cli import main
from k3plugins import progress
from k3runtime.cli import main as runtime_main


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(file, n: int = 50, **kwargs) -> str:
    with progress.progress_bar(total=n, desc="work", unit="step", file=file, **kwargs) as bar:
        for _ in range(n):
            bar.update(1)
    return file.getvalue()


def test_a_log_gets_the_last_line_within_the_interval():
    text = _run(io.StringIO())
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 1, lines  # 50 updates inside LOG_EVERY_S: the end only (no 0 % as it opens)
    assert lines[0].startswith("work: 100%") and "50/50" in lines[0]


def test_a_log_gets_nothing_from_work_that_fails_at_once():
    log = io.StringIO()
    try:
        with progress.progress_bar(total=3, desc="work", file=log):
            raise ValueError("bad input")
    except ValueError:
        pass
    assert log.getvalue() == ""


def test_a_log_gets_a_line_each_interval(monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    lines = _run(io.StringIO()).splitlines()
    assert len(lines) > 10 and all(line.startswith("work:") for line in lines)


def test_a_terminal_keeps_tqdms_bar_and_off_writes_nothing():
    assert "\r" in _run(_Terminal())
    assert _run(io.StringIO(), enabled=False) == ""


def test_a_process_without_stderr_runs_without_a_bar(monkeypatch):
    monkeypatch.setattr("sys.stderr", None)
    with progress.progress_bar(total=3, desc="work") as bar:
        bar.update(3)
    assert bar.disable


def test_convert_and_build_show_progress_lines_in_a_log(k3_tiny_ckpt, tmp_path):
    """CliRunner's stderr is no terminal, as a log file or a pipe is not."""
    runner = CliRunner()
    conv = tmp_path / "conv"
    res = runner.invoke(main, ["convert", str(k3_tiny_ckpt), str(conv)])
    assert res.exit_code == 0, res.output
    assert "\r" not in res.stderr
    assert any(line.startswith("convert: 100%") for line in res.stderr.splitlines()), res.stderr
    res = runner.invoke(main, ["build", str(conv), str(tmp_path / "engine"), "--max-seq-len", "256",
                               "--max-num-tokens", "256"])
    assert res.exit_code == 0, res.output
    assert "\r" not in res.stderr
    assert any(line.startswith("build rank0: 100%") for line in res.stderr.splitlines()), res.stderr
    bad = runner.invoke(main, ["convert", str(tmp_path / "nope"), str(tmp_path / "c1")])
    assert bad.exit_code == 1 and bad.stderr == f"Error: {tmp_path / 'nope'}: not a checkpoint directory\n"
    quiet = runner.invoke(main, ["convert", str(k3_tiny_ckpt), str(tmp_path / "quiet"), "--no-progress"])
    assert quiet.exit_code == 0 and "convert:" not in quiet.stderr and "plan (" not in quiet.stderr, quiet.stderr


def test_generate_shows_the_weight_load(k3_tiny_engine):
    res = CliRunner().invoke(runtime_main, ["generate", str(k3_tiny_engine), "--prompt", "hi", "--max-tokens", "2"])
    assert res.exit_code == 0, res.output
    assert any(line.startswith("load rank0: 100%") for line in res.stderr.splitlines()), res.stderr
    assert "load rank0" not in res.stdout  # the completions alone on stdout
