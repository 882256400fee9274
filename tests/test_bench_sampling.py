"""tools/bench_sampling.py runs as documented: a decode step's sampling with penalties and with logprobs, beside
plain sampling and the floor of reading the logits."""
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_sampling.py"


def test_bench_sampling_times_the_cases_side_by_side():
    out = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--rows", "3", "--outputs", "8,40",
                          "--vocab", "2048", "--steps", "2"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["bench"] == "sampling_env" and lines[0]["torch"]
    assert [(d["rows"], d["output"], d["vocab"]) for d in lines[1:]] == [(3, 8, 2048), (3, 40, 2048)]
    for d in lines[1:]:
        # on the CPU the flags choose no Triton kernel (the interpreter tests and the GPU's check those tokens):
        # here both sides of each check are the torch ops, which shows only that seeded draws repeat
        assert d["triton_kernels"] is False
        assert d["same_tokens_as_before"] is True and d["same_tokens_triton_top_p"] is True
        for base in ("before", "sorted_top_p"):
            ratio = d["triton_top_p_ms"] / d[f"{base}_ms"]
            assert abs(d[f"triton_top_p_x_{base.split('_')[0]}"] - ratio) <= 0.01 * ratio + 0.001
        assert abs(d["plain_x_before"] - d["plain_ms"] / d["before_ms"]) <= 0.01 * d["plain_x_before"] + 0.001
        assert min(d["plain_ms"], d["before_ms"], d["penalized_ms"], d["penalized_first_ms"], d["logprobs_ms"],
                   d["floor_ms"]) > 0
        assert abs(d["penalized_x_plain"] - d["penalized_ms"] / d["plain_ms"]) <= 0.01 * d["penalized_x_plain"] + 0.01
        assert abs(d["plain_x_floor"] - d["plain_ms"] / d["floor_ms"]) <= 0.01 * d["plain_x_floor"] + 0.01
