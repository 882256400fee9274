"""tools/bench_layout.py runs as documented and reports every relaid expert layout against the copy floor."""
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_layout.py"


def test_bench_layout_reports_each_relaid_layout():
    out = subprocess.run([sys.executable, str(TOOL), "--experts", "1", "--rows", "64", "--k", "512", "--reps", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["bench"] == "layout_env" and lines[0]["bytes"] == 64 * 256
    rows = {d["layout"]: d for d in lines[1:]}
    assert set(rows) == {"strided", "paired", "lane"}
    assert rows["paired"]["x_paired"] == 1.0
    assert all(d["s"] > 0 and d["x_copy"] > 0 and d["copy_gb_per_s"] > 0 for d in rows.values())
