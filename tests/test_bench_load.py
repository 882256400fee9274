"""tools/bench_load.py on the CPU: one small synthetic rank file, cold, its JSON line and ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).parents[1] / "tools" / "bench_load.py"


def test_bench_load_prints_its_ratios():
    out = subprocess.run([sys.executable, str(TOOL), "--gib", "0.07", "--repeat", "1"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["bench"] == "load" and row["cache"] == "cold" and row["bytes"] > 0.06 * 2**30
    assert row["ours_s"] > 0 and row["floor_s"] > 0 and row["ours_x_floor"] > 0 and row["load_file_x_ours"] > 0
    assert row["ours_verified_s"] > 0 and row["verified_x_ours"] > 0
