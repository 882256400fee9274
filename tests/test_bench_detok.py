"""tools/bench_detok.py runs as documented: a decode step's tokens detokenized, beside the whole-output baseline."""
import json
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_detok.py"


def test_bench_detok_times_a_step_of_tokens(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(TOOL), "--batches", "4", "--outputs", "16,600", "--steps", "3"],
                         capture_output=True, text=True, timeout=120, check=True, env=env).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["bench"] == "detok_env" and lines[0]["vocab"] > 0
    assert [(d["batch"], d["output"]) for d in lines[1:]] == [(4, 16), (4, 600)]
    for d in lines[1:]:
        assert min(d["detok_ms"], d["whole_ms"], d["floor_ms"]) > 0
        assert abs(d["x_floor"] - d["detok_ms"] / d["floor_ms"]) <= 0.01 * d["x_floor"] + 0.01
    assert list(tmp_path.iterdir()) == []  # the synthetic tokenizer's directory goes with the run
