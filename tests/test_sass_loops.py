"""tools/sass_loops.py: the MoE decode's instruction budget in its sm_90 SASS, compiled and read on the CPU.

The paired layout exists to cut the decode's instructions (the kernel was bound by instruction issue at 1-8 tokens
per expert until about 3 a weight); this guards what it bought against a change that would quietly put them back."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
TOOL = Path(__file__).parents[1] / "tools" / "sass_loops.py"


def _innermost_loop(kernel: str, *flags: str) -> tuple[dict, dict]:
    proc = subprocess.run([sys.executable, str(TOOL), kernel, *flags], capture_output=True, text=True, timeout=300)
    if proc.returncode and "backend" in proc.stderr:
        pytest.skip("Triton's NVIDIA backend is not installed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, *loops = [json.loads(line) for line in proc.stdout.splitlines()]
    assert loops, "no loop found in the SASS"
    return head, min(loops, key=lambda loop: loop["instructions"])


@pytest.mark.parametrize("kernel,weights_per_thread,budget", [
    ("moe_gate_up_paired", 2 * 64 * 256 // 128, 3.2),   # gate and up rows, BN 64, BK 256, 4 warps: 3.04 when written
    ("moe_down_paired", 64 * 256 // 128, 3.7),          # 3.56 when written
])
def test_paired_decode_loop_stays_within_its_instruction_budget(kernel, weights_per_thread, budget):
    head, loop = _innermost_loop(kernel)
    per_weight = loop["instructions"] / weights_per_thread
    assert head["spill_instructions"] == 0
    assert per_weight < budget, (per_weight, loop["ops"])
    assert loop["ops"].get("HGMMA", 0) > 0  # the tensor cores, fed from registers
