"""tools/bench_scheduler.py runs as documented: decode steps through the real scheduler, their host parts timed."""
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_scheduler.py"


def test_bench_scheduler_times_decode_steps():
    out = subprocess.run([sys.executable, str(TOOL), "--batches", "3,8", "--context", "300", "--steps", "4"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["bench"] == "scheduler_env"
    assert [d["batch"] for d in lines[1:]] == [3, 8]
    for d in lines[1:]:
        parts = d["schedule_ms"] + d["step_ms"] + d["update_ms"]
        assert d["fill_ms"] > 0 and abs(d["host_ms"] - parts) < 1e-3
        assert abs(d["host_x_fill"] - d["host_ms"] / d["fill_ms"]) <= 0.01
