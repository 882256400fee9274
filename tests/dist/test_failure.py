"""A rank killed mid-generation takes the job down, with a message naming it, within a bounded time."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from engines import build_engine

from k3build.mapping import Mapping

JOB = Path(__file__).with_name("dist_job.py")


def test_killed_rank_ends_the_job_naming_it(k3_tiny_ckpt, tmp_path):
    engine = build_engine(k3_tiny_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2), max_seq_len=4096,
                          max_num_tokens=512)
    out = tmp_path / "progress"
    job = json.dumps({"prompts": [[1, 2, 3]], "max_tokens": 4000, "options": {}, "mode": "stream"})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "30"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(JOB), str(engine), str(out), job], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and int(out.read_text() or 0) >= 3):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "generation never started"
            time.sleep(0.2)
        victim = int(Path(f"{out}.rank1.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        log, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop"
    # torchrun stops the survivors and names the rank that died first.
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\).*?SIGKILL", log, re.S), log[-3000:]
