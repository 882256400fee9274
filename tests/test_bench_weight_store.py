"""tools/bench_weight_store.py runs as documented: its synthetic engine's cold disk loads against attaching to a
weight store, ending in a summary line."""
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_weight_store.py"


def test_bench_weight_store_runs_on_its_synthetic_engine(tmp_path):
    work = tmp_path / "work"
    run = subprocess.run([sys.executable, str(TOOL), "--gib", "0.07", "--ranks", "1", "--work", str(work)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    steps = [d["step"] for d in lines]
    assert steps == ["synthesize", "engine", "cold_disk_load", "warm_disk_load", "store_start_cold", "attach",
                     "store_stop", "summary"]
    by_step = {d["step"]: d for d in lines}
    assert by_step["engine"]["ranks"] == [0]
    assert by_step["attach"]["bytes"] == by_step["cold_disk_load"]["bytes"] > 0
    assert by_step["store_stop"] == {"step": "store_stop", "returncode": 0, "shm_dir_left": False}
    assert by_step["summary"]["attach_s"] > 0
    assert not work.exists()  # the synthetic engine goes unless --keep


def test_bad_arguments_are_usage_errors(tmp_path):
    """Before, a negative --gib wrote a small engine anyway and a missing --engine ended in a traceback."""
    for args, want in ((["--gib", "-2"], "argument --gib: expected a size > 0, got '-2'"),
                       (["--repeat", "0"], "argument --repeat: expected a count >= 1, got '0'"),
                       (["--engine", str(tmp_path / "none")], "not an engine dir (no config.json")):
        run = subprocess.run([sys.executable, str(TOOL), *args, "--work", str(tmp_path / "work")],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and want in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert not (tmp_path / "work").exists()
