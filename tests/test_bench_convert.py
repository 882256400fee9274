"""tools/bench_convert.py deletes what it wrote and nothing else: --workdir may be a directory holding other files."""
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_convert.py"


def test_bench_convert_leaves_the_rest_of_its_workdir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("not the benchmark's")
    # a size it cannot parse ends the run at once, through the same clean-up as a finished one
    run = subprocess.run([sys.executable, str(TOOL), "--workdir", str(work), "--sizes", "bad"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    assert (work / "notes.txt").read_text() == "not the benchmark's"
    # a --workdir it made goes with the run, as its parent it made does
    fresh = tmp_path / "made" / "here"
    subprocess.run([sys.executable, str(TOOL), "--workdir", str(fresh), "--sizes", "bad"],
                   capture_output=True, text=True, timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
