"""tools/sass_loops.py: instruction budgets in sm_90 SASS, compiled and read on the CPU.

The paired layout exists to cut the MoE decode's instructions (the kernel was bound by instruction issue at 1-8
tokens per expert until about 3 a weight), and the KDA conv prefill's row walk is bound by issue too; these guard
what each bought against a change that would quietly put the instructions back."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
TOOL = Path(__file__).parents[1] / "tools" / "sass_loops.py"


def _loops(kernel: str, *flags: str) -> tuple[dict, list[dict]]:
    from triton.backends import backends

    if "nvidia" not in backends:  # asked here, not guessed from the tool's error (a ptxas failure names the backend)
        pytest.skip("Triton's NVIDIA backend is not installed")
    proc = subprocess.run([sys.executable, str(TOOL), kernel, *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, *loops = [json.loads(line) for line in proc.stdout.splitlines()]
    assert loops, "no loop found in the SASS"
    return head, loops


@pytest.mark.parametrize("kernel,weights_per_thread,budget", [
    ("moe_gate_up_paired", 2 * 64 * 256 // 128, 3.2),   # gate and up rows, BN 64, BK 256, 4 warps: 3.04 when written
    ("moe_down_paired", 64 * 256 // 128, 3.7),          # 3.56 when written
])
def test_paired_decode_loop_stays_within_its_instruction_budget(kernel, weights_per_thread, budget):
    head, loops = _loops(kernel)
    loop = min(loops, key=lambda loop: loop["instructions"])  # the innermost: the K loop
    per_weight = loop["instructions"] / weights_per_thread
    assert head["spill_instructions"] == 0
    assert per_weight < budget, (per_weight, loop["ops"])
    assert loop["ops"].get("HGMMA", 0) > 0  # the tensor cores, fed from registers


def test_conv_prefill_row_walk_stays_within_its_instruction_budget():
    """The one-sequence walk, unrolled by 4 rows of 128 channels at 1 warp (kda.fla's tile): 121 instructions a row
    when written (152 before the unroll and the fast SiLU), one vector load and one vector store a row."""
    head, loops = _loops("kda_conv_prefill", "--set", "BT=32", "--set", "BC=128", "--warps", "1", "--div16", "C,D,T")
    walk = max(loops, key=lambda loop: loop["instructions"])  # the boundary tiles' loop takes one row
    # rows an iteration, by the special-function ops: a row of 4 channels a thread takes 4 exp and 4 reciprocals,
    # and its head norm a sqrt and a reciprocal
    rows = walk["ops"]["MUFU"] / 10
    assert head["spill_instructions"] == 0
    assert walk["instructions"] / rows < 130, (rows, walk["ops"])
    assert walk["ops"].get("LDG", 0) <= rows and walk["ops"].get("STG", 0) <= rows, walk["ops"]
    assert "STS" not in walk["ops"], walk["ops"]  # no layout round trip through shared memory
