"""The dev tools' bad arguments are usage errors: exit status 2 and a line naming the flag, no traceback (before,
a missing engine or file ended in a FileNotFoundError traceback, --steps 0 in statistics' own error, a bad
--sizes in int()'s, and bench_layout --reps 0 ran and reported nothing; bench_convert --workers 0 synthesised
its checkpoints first). load_test and bench_weight_store have theirs beside their tests."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.mark.parametrize("tool, args, want", [
    ("bench_load.py", ["--engine", "/nonexistent"], "--engine /nonexistent: no rank0/weights.safetensors there"),
    ("bench_load.py", ["--repeat", "0"], "argument --repeat: expected a count >= 1, got '0'"),
    ("bench_scheduler.py", ["--steps", "0"], "argument --steps: expected a count >= 1, got '0'"),
    ("bench_scheduler.py", ["--batches", "32,x"], "argument --batches: expected counts >= 1, comma separated"),
    ("bench_sampling.py", ["--rows", "0"], "argument --rows: expected counts >= 1, comma separated"),
    ("bench_detok.py", ["--engine", "/nonexistent"], "--engine /nonexistent: no tokenizer.json there"),
    ("bench_layout.py", ["--reps", "0"], "argument --reps: expected a count >= 1, got '0'"),
    ("bench_convert.py", ["--sizes", "4xabc"], "--sizes '4xabc': expected LAYERSxEXPERTS sizes of counts >= 1"),
    ("bench_convert.py", ["--workers", "0"], "argument --workers: expected a count >= 1, got '0'"),
    ("ncu_summary.py", ["/nonexistent"], "/nonexistent: no such file"),
    ("mla_fp8_drift.py", ["--heads", "0"], "argument --heads: expected a count >= 1, got '0'"),
    ("ncu_summary.py", [__file__, "--top", "0"], "argument --top: expected a count >= 1, got '0'"),
])
def test_bad_arguments_are_usage_errors(tool, args, want):
    run = subprocess.run([sys.executable, str(TOOLS / tool), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and want in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stdout == ""  # nothing measured, nothing half-reported
