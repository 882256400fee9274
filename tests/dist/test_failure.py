"""A rank killed (or hung) mid-generation takes the job down within a bounded time, naming that rank."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from engines import build_engine

from k3build.mapping import Mapping

JOB = Path(__file__).with_name("dist_job.py")


def _stop_a_rank_mid_generation(engine_root: Path, ckpt: Path, sig: int, timeout_s: int,
                                mapping: Mapping = Mapping(tp_size=2), options: dict | None = None,
                                kill_on: str | None = None) -> tuple[int, float, str]:
    """Start a 2-rank streaming job, send `sig` to rank 1 once tokens flow; returns (rc, seconds to exit, log).
    kill_on: once a line of the log matches it, SIGKILL rank 1 here instead of waiting for torchrun to (it gives
    a stopped rank 30 s to exit first)."""
    engine = build_engine(ckpt, engine_root / "engine", mapping=mapping, max_seq_len=4096, max_num_tokens=512)
    out = engine_root / "progress"
    job = json.dumps({"prompts": [[1, 2, 3]], "max_tokens": 4000, "options": options or {}, "mode": "stream"})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": str(timeout_s)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(JOB), str(engine), str(out), job], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    victim = None
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and int(out.read_text() or 0) >= 3):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "generation never started"
            time.sleep(0.2)
        victim = int(Path(f"{out}.rank1.pid").read_text())
        os.kill(victim, sig)
        stopped_at = time.monotonic()
        if kill_on is None:
            log, _ = proc.communicate(timeout=120)
        else:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if victim is not None and re.search(kill_on, line):
                    os.kill(victim, signal.SIGKILL)
                    victim = None
            proc.wait(timeout=120)
            log = "".join(lines)
        return proc.returncode, time.monotonic() - stopped_at, log
    finally:
        if proc.poll() is None:
            proc.kill()
        if victim is not None and sig == signal.SIGSTOP:
            try:
                os.kill(victim, signal.SIGKILL)  # torchrun normally did; never leave a stopped process behind
            except ProcessLookupError:
                pass


def test_killed_rank_ends_the_job_naming_it(k3_tiny_ckpt, tmp_path):
    rc, elapsed, log = _stop_a_rank_mid_generation(tmp_path, k3_tiny_ckpt, signal.SIGKILL, 30)
    assert rc != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop"
    # torchrun stops the survivors and names the rank that died first.
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\).*?SIGKILL", log, re.S), log[-3000:]


@pytest.mark.parametrize("mapping, options",
                         [(Mapping(tp_size=2), {}), (Mapping(pp_size=2), {"async_scheduling": True})],
                         ids=["tp2", "pp2-async"])
def test_hung_rank_trips_the_collective_timeout(mapping, options, k3_tiny_ckpt, tmp_path):
    # SIGSTOP: the rank's sockets stay open, so only the timeout can end the job. Every process group
    # (TP/MoE groups, control plane) must carry K3_DIST_TIMEOUT_S, not torch's 30-minute default. With pipeline
    # stages and async scheduling the driver waits for the last stage's ids in their broadcast.
    # tp2 waits for torchrun to end the whole job; pp2-async shows the driver's error, then ends the stopped rank
    # itself (what torchrun would do 30 s later, as in tp2)
    kill_on = r"rank 1 stopped responding" if mapping.pp_size > 1 else None
    rc, elapsed, log = _stop_a_rank_mid_generation(tmp_path, k3_tiny_ckpt, signal.SIGSTOP, 10, mapping, options,
                                                   kill_on)
    assert rc != 0
    # timeout in the step (10 s) + 5 s watching the heartbeats (heartbeat.explain_timeout) + timeout releasing the
    # workers (10 s) + torchrun's grace before SIGKILL (30 s)
    assert elapsed < (70 if kill_on is None else 45), f"the job took {elapsed:.0f} s to stop"
    assert "Timed out waiting 10000ms" in log, log[-3000:]
    # the driver's error names the silent rank from its stale heartbeat, not only its own timeout
    assert re.search(r"rank 1 stopped responding \(no heartbeat in \d+ s\)", log), log[-3000:]


def test_ranks_of_different_builds_are_refused(k3_tiny_ckpt, tmp_path):
    """Rank 1 opens another build of the same model and mapping (a stale copy on its node): its files look alike,
    so it would run and generate nonsense; every rank refuses at start-up instead, naming the odd rank."""
    engines = [build_engine(k3_tiny_ckpt, tmp_path / name, mapping=Mapping(tp_size=2)) for name in ("a", "b")]
    job = json.dumps({"prompts": [[1, 2, 3]], "max_tokens": 2, "options": {},
                      "engine_by_rank": {"1": str(engines[1])}})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(JOB), str(engines[0]), str(tmp_path / "out"), job],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert "the ranks opened engines of different builds" in proc.stderr and "rank(s) 1 another" in proc.stderr, \
        proc.stderr[-3000:]


def _children(pid: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes torchrun (pid) started."""
    ranks = {}
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                env = dict(kv.split("=", 1) for kv in (p / "environ").read_text().split("\0") if "=" in kv)
                ranks[int(env["RANK"])] = int(p.name)
        except (OSError, KeyError, ValueError):
            continue
    return ranks


def test_hung_rank_ends_a_multirank_server(k3_tiny_ckpt, tmp_path):
    """`serve` under torchrun with a rank stopped: the request fails, and the server does not stay up; the job
    ends with rank 0's error naming the silent rank (before, the server answered 503 forever)."""
    import socket
    import urllib.error
    import urllib.request

    engine = build_engine(k3_tiny_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "5"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "k3runtime.dist.launch", str(engine), "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, victim, workers = f"http://127.0.0.1:{port}", None, {}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        workers = _children(proc.pid)
        victim = workers[1]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        body = json.dumps({"model": "engine", "prompt": [1, 2, 3], "max_tokens": 4}).encode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=60)
        assert e.value.code >= 500
        # a server that stays up fails the test, not hangs it (the workers hold the log's pipe too)
        threading.Timer(90, lambda: [_kill(p) for p in (proc.pid, *workers.values())]).start()
        lines = []
        for line in proc.stdout:  # torchrun gives a stopped rank 30 s before SIGKILL: this test does it at once
            lines.append(line)
            if victim is not None and "rank 1 stopped responding" in line:
                os.kill(victim, signal.SIGKILL)
                victim = None
        proc.wait(timeout=60)
        log = "".join(lines)
        assert proc.returncode != 0 and time.monotonic() - stopped_at < 60, log[-3000:]
        assert re.search(r"Error \(rank 0\): .*rank 1 stopped responding \(no heartbeat in \d+ s\)", log), log[-3000:]
    finally:
        for pid in (proc.pid, *workers.values()):
            _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
