"""tools/ncu_summary.py on CSV pages written the way `ncu -i REPORT --page raw|source --csv` writes them (every field
quoted; the raw page's second row holds each column's unit), with units that need converting."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).parents[1] / "tools"
sys.path.insert(0, str(TOOL))

from ncu_summary import hotspots, kernels  # noqa: E402

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def _write(path: Path, rows: list[list[str]]) -> str:
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return str(path)


@pytest.fixture
def raw(tmp_path):
    header = ["ID", "Kernel Name", "launch__grid_size", "gpu__time_duration.sum", "dram__bytes.sum.per_second",
              "smsp__average_warp_latency_per_inst_issued.ratio", STALL.format("long_scoreboard"),
              STALL.format("barrier"), STALL.format("wait")]
    units = ["", "", "", "ms", "Gbyte/s", "cycle", "", "", ""]
    return _write(tmp_path / "raw.csv", [header, units,
                                         ["0", "small_kernel", "64", "0.0125", "950.5", "9.1", "7.5", "0.2", "0.4"],
                                         ["1", "big_kernel", "6,144", "0.2436", "3,420", "16.16", "9.30", "2.33",
                                          "0.93"]])


def test_kernels_longest_first_in_us_and_tbps(raw):
    big, small = kernels(raw, stalls=2)
    assert (big["kernel"], small["kernel"]) == ("big_kernel", "small_kernel")
    assert big["us"] == pytest.approx(243.6) and small["us"] == pytest.approx(12.5)
    assert big["dram_tbps"] == pytest.approx(3.42) and small["dram_tbps"] == pytest.approx(0.9505)
    assert big["grid"] == "6,144" and big["cycles_per_issue"] == pytest.approx(16.16)
    assert list(big["stalls"]) == ["long_scoreboard", "barrier"] and big["stalls"]["barrier"] == 2.33


def test_hotspots_by_opcode_and_instruction(tmp_path):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb", "stall_barrier",
              "stall_long_sb (Not Issued)"]
    path = _write(tmp_path / "source.csv", [
        ["Kernel Name", "k_a"], header,
        ["0x10", "      LDG.E.128 R4, desc[UR4][R2.64]", "10", "0", "0", "0"],
        ["0x20", "      FMUL R8, R4, R5", "60", "55", "0", "50"],
        ["0x30", "@!P0  FMUL R9, R6, R5", "20", "0", "3", "0"],
        ["0x40", "      BAR.SYNC.DEFER_BLOCKING 0x0", "10", "0", "10", "0"],
        ["Kernel Name", "k_b"], header,
        ["0x10", "      EXIT", "4", "0", "0", "0"]])
    h = hotspots(path, top=2)
    assert set(h) == {"k_a", "k_b"} and h["k_a"]["samples"] == 100
    assert h["k_a"]["by_opcode"] == {"FMUL": 0.8, "LDG": 0.1}           # the predicated FMUL counts as FMUL
    first, second = h["k_a"]["top"]
    assert (first["address"], first["share"], first["stalls"]) == ("0x20", 0.6, {"long_sb": 55})
    assert second["address"] == "0x30" and second["stalls"] == {}        # 3 of 20 samples: under a fifth


def test_refuses_a_file_that_is_not_the_raw_page(tmp_path):
    path = _write(tmp_path / "details.csv", [["ID", "Section Name", "Metric Name"], ["0", "SOL", "Duration"]])
    proc = subprocess.run([sys.executable, str(TOOL / "ncu_summary.py"), path], capture_output=True, text=True)
    assert proc.returncode != 0 and "not ncu's raw page" in proc.stderr
