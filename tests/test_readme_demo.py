"""The README's main job (`bash tools/demo.sh`): synth -> convert -> build -> inspect -> generate, as real CLI
processes in a fresh directory (the pip install line is skipped: this environment is the installed one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_demo_script_generates(tmp_path):
    env = {**os.environ, "K3_DEMO_SKIP_INSTALL": "1", "K3_DEMO_DIR": str(tmp_path / "work"),
           # the console scripts of the interpreter running the tests
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run(["bash", str(ROOT / "tools" / "demo.sh")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert f"engine written to {tmp_path / 'work' / 'engine'}" in out
    assert "memory plan:" in out and "plugins:" in out and "rank0:" in out  # k3build inspect
    gens = {p: (int(n), why) for p, n, why in re.findall(r"^--- '(.*)' -> (\d+) tokens \((\w+)\)", out, re.M)}
    assert set(gens) == {"The quick brown fox", "Kimi-K3 is"}, out
    for n, why in gens.values():
        # the random tiny model may sample EOS early; otherwise it runs to --max-tokens 24
        assert (why == "length" and n == 24) or (why == "stop" and 1 <= n <= 24), out
    for name in ("ckpt", "converted", "engine"):
        assert (tmp_path / "work" / name / "config.json").exists()
