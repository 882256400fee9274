"""tools/bench_rank.py on the CPU with the tiny preset: the builder's graph and layout over synthetic weights run
through the executor (the same path the H200 benchmark takes), and every record has its fields. No timing is
asserted: figures belong in BENCHMARKS.md."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).parents[1] / "tools" / "bench_rank.py"


def test_bench_rank_runs_a_tiny_tp2_rank():
    proc = subprocess.run([sys.executable, str(TOOL), "--preset", "tiny", "--tp", "2", "--device", "cpu",
                           "--target", "cpu", "--batches", "1,3", "--context", "100", "--reps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["bench"] for r in recs] == ["rank_env", "rank_weights", "rank_decode", "rank_decode"]
    assert recs[0]["mapping"]["tp_size"] == 2 and recs[0]["routing"] == "uniform"
    one, three = recs[2], recs[3]
    assert (one["batch"], three["batch"]) == (1, 3) and one["step_ms"] > 0
    # KV and state floors scale with the batch; 3 tokens touch more experts than 1
    assert three["kv_bytes"] == 3 * one["kv_bytes"] and three["state_bytes"] == 3 * one["state_bytes"]
    assert three["experts_touched_share"] > one["experts_touched_share"]
