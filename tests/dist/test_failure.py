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
from liveness import free_port

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
            log, victim = _log_killing(proc, victim, kill_on), None
        return proc.returncode, time.monotonic() - stopped_at, log
    finally:
        if proc.poll() is None:
            proc.kill()
        if victim is not None and sig == signal.SIGSTOP:
            try:
                os.kill(victim, signal.SIGKILL)  # torchrun normally did; never leave a stopped process behind
            except ProcessLookupError:
                pass


def _log_killing(proc: subprocess.Popen, victim: int, pattern: str) -> str:
    """proc's whole output, SIGKILLing `victim` once a line matches `pattern`: what torchrun does to a stopped rank
    after its 30 s grace, done at once."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if victim is not None and re.search(pattern, line):
            os.kill(victim, signal.SIGKILL)
            victim = None
    proc.wait(timeout=120)
    return "".join(lines)


def test_ctrl_c_on_the_driver_mid_generation_ends_the_job_at_once(k3_short_ckpt, tmp_path):
    """SIGINT to rank 0 of `k3runtime.dist.launch ENGINE generate` while it generates: it says so and leaves
    without sending its workers a stop (they may be inside the step's collectives, where a stop would wait for them,
    and they for it, until K3_DIST_TIMEOUT_S: 61 s before, in silence), and the workers end as its exit closes
    their collectives, naming it."""
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2), max_seq_len=4096,
                          max_num_tokens=512)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "40"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "k3runtime.dist.launch", str(engine), "generate", "--prompt", "Hello",
                             "--max-tokens", "4000", "--ignore-eos", "--stream"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while "load rank0: 100%" not in "".join(log):  # the weights read: generation starts
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)[-3000:]
            time.sleep(0.2)
        time.sleep(2)
        os.kill(_children(proc.pid)[0], signal.SIGINT)
        stopped_at = time.monotonic()
        proc.wait(timeout=120)
        elapsed = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    text = "".join(log)
    assert proc.returncode != 0 and elapsed < 15, (elapsed, text[-3000:])
    assert "rank 0: interrupted" in text and "exitcode  : 130" in text, text[-3000:]
    # rank 1 ends by its own error naming rank 0 or, when torchrun is quicker, by its SIGTERM (not a timeout)
    assert re.search(r"Error \(rank 1\): rank 0 left the job|exitcode\s*: -15 \(pid", text), text[-3000:]
    assert "KeyboardInterrupt" not in text, text[-3000:]  # no rank's bare traceback


def test_killed_rank_ends_the_job_naming_it(k3_short_ckpt, tmp_path):
    rc, elapsed, log = _stop_a_rank_mid_generation(tmp_path, k3_short_ckpt, signal.SIGKILL, 30)
    assert rc != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop"
    # torchrun stops the survivors and names the rank that died first.
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\).*?SIGKILL", log, re.S), log[-3000:]


@pytest.mark.parametrize("mapping, options",
                         [(Mapping(tp_size=2), {}), (Mapping(pp_size=2), {"async_scheduling": True})],
                         ids=["tp2", "pp2-async"])
def test_hung_rank_trips_the_collective_timeout(mapping, options, k3_short_ckpt, tmp_path):
    # SIGSTOP: the rank's sockets stay open, so only the timeout can end the job. Every process group
    # (TP/MoE groups, control plane) must carry K3_DIST_TIMEOUT_S, not torch's 30-minute default. With pipeline
    # stages and async scheduling the driver waits for the last stage's ids in their broadcast.
    # Once the driver's error names it, the test ends the stopped rank itself: what torchrun does 30 s later (its
    # grace for a rank that does not exit), which would only add those 30 s to the suite
    rc, elapsed, log = _stop_a_rank_mid_generation(tmp_path, k3_short_ckpt, signal.SIGSTOP, 5, mapping, options,
                                                   kill_on=r"rank 1 stopped responding")
    assert rc != 0
    # timeout in the step (5 s) + 5 s watching the heartbeats (heartbeat.explain_timeout) + timeout releasing the
    # workers (5 s)
    assert elapsed < 35, f"the job took {elapsed:.0f} s to stop"
    assert "Timed out waiting 5000ms" in log, log[-3000:]
    # the driver's error names the silent rank from its stale heartbeat, not only its own timeout
    assert re.search(r"rank 1 stopped responding \(no heartbeat in \d+ s\)", log), log[-3000:]


def test_ranks_of_different_builds_are_refused(k3_short_ckpt, tmp_path):
    """Rank 1 opens another build of the same model and mapping (a stale copy on its node): its files look alike,
    so it would run and generate nonsense; every rank refuses at start-up instead, naming the odd rank."""
    engines = [build_engine(k3_short_ckpt, tmp_path / name, mapping=Mapping(tp_size=2)) for name in ("a", "b")]
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


def test_hung_rank_ends_a_multirank_server(k3_short_ckpt, tmp_path):
    """`serve` under torchrun with a rank stopped: the request fails, and the server does not stay up; the job
    ends with rank 0's error naming the silent rank (before, the server answered 503 forever)."""
    import urllib.error
    import urllib.request

    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    proc, url = _serve(engine, 5)
    workers = {}
    try:
        workers = _children(proc.pid)
        victim = workers[1]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        body = json.dumps({"model": "engine", "prompt": [1, 2, 3], "max_tokens": 4}).encode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=60)
        # the request's error names the silent rank (it was gloo's text: "Timed out waiting 5000ms for recv")
        assert e.value.code >= 500 and "rank 1 stopped responding" in e.value.read().decode()
        # a server that stays up fails the test, not hangs it (the workers hold the log's pipe too)
        threading.Timer(90, lambda: [_kill(p) for p in (proc.pid, *workers.values())]).start()
        log = _log_killing(proc, victim, "rank 1 stopped responding")
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


def _two_nodes(per_node: list[list[str]], env: dict) -> list[subprocess.Popen]:
    """Two torchrun agents of one process each on this machine, as two nodes; per_node: each one's command after
    torchrun's options (a script or `-m module`, then its arguments)."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                              f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={port}", *command],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for n, command in enumerate(per_node)]


def _errors(nodes: list[subprocess.Popen]) -> list[str]:
    """Each node's stderr once it ends (killed if it outlives two minutes)."""
    try:
        return [p.communicate(timeout=120)[1] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()


def _serve(engine: Path, timeout_s: int) -> tuple[subprocess.Popen, str]:
    """`serve` under torchrun on 2 ranks (K3_DIST_TIMEOUT_S = timeout_s), up and answering /health; (proc, url)."""
    import urllib.request

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": str(timeout_s)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "k3runtime.dist.launch", str(engine), "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.5)


def test_hung_rank_ends_an_idle_multirank_server(k3_short_ckpt, tmp_path):
    """A worker that hangs while the server has no request: the keep-alive that finds it stops the engine, and the
    job ends naming the rank (before, the keep-alive gave up silently: /health answered 200 until the next request,
    a dead worker on another node was never noticed)."""
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    proc, url = _serve(engine, 5)
    workers = _children(proc.pid)
    victim = workers[1]
    # a server that stays up fails the test, not hangs it (the workers hold the log's pipe too)
    timer = threading.Timer(90, lambda: [_kill(p) for p in (proc.pid, *workers.values())])
    try:
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        timer.start()
        log = _log_killing(proc, victim, "rank 1 stopped responding")  # no request is sent: it stops by itself
        assert proc.returncode != 0 and time.monotonic() - stopped_at < 60, log[-3000:]
        assert re.search(r"Error \(rank 0\): .*rank 1 stopped responding", log), log[-3000:]
    finally:
        timer.cancel()
        for pid in (proc.pid, *workers.values()):
            _kill(pid)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_stop_when_their_launcher_is_killed(k3_short_ckpt, tmp_path):
    """torchrun's agent SIGKILLed (the OOM killer, `kill -9`, a crashed supervisor) cannot stop its ranks: they find
    the job's store gone from their heartbeats and stop themselves (before, both ranks served on as orphans,
    holding the port and, on a GPU node, the accelerators)."""
    import urllib.request

    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    proc, url = _serve(engine, 10)
    workers = _children(proc.pid)
    try:
        assert sorted(workers) == [0, 1]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 45
        while any(_alive(p) for p in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {r: p for r, p in workers.items() if _alive(p)}
        assert not left, f"ranks {sorted(left)} outlived their launcher by 45 s"
        with pytest.raises(OSError):  # nothing answers on the port any more
            urllib.request.urlopen(f"{url}/health", timeout=5)
    finally:
        for pid in (proc.pid, *workers.values()):
            _kill(pid)


def test_driver_that_fails_to_load_ends_the_job_at_once(k3_short_ckpt, tmp_path):
    """Rank 0's own weights damaged: its error and the workers' naming it come at once, not after the collective
    timeout (before, the driver's release of its workers waited K3_DIST_TIMEOUT_S for them in the load barrier)."""
    import shutil

    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    cut = Path(shutil.copytree(engine, tmp_path / "cut"))
    weights = cut / "rank0" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "k3runtime.dist.launch", str(cut), "generate", "--prompt", "Hello"],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "60"}, capture_output=True,
                          text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0 and "weights.safetensors: corrupt" in proc.stderr, proc.stderr[-3000:]
    assert "Error (rank 1): rank 0 left the job" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 40, f"the job took {elapsed:.0f} s to end (K3_DIST_TIMEOUT_S is 60)"


def test_ranks_of_other_mappings_are_refused_at_once(k3_short_ckpt, tmp_path):
    """Rank 1 opens an engine of the same model and rank count but another mapping (pp2 beside tp2): refused at
    start-up like any other build, naming the odd rank (before, the ranks made different process groups from their
    configs and waited in them for each other until the timeout: a store 'wait timeout' and a C++ trace)."""
    engines = [build_engine(k3_short_ckpt, tmp_path / name, mapping=m)
               for name, m in (("tp2", Mapping(tp_size=2)), ("pp2", Mapping(pp_size=2)))]
    job = json.dumps({"prompts": [[1, 2, 3]], "max_tokens": 2, "options": {}, "engine_by_rank": {"1": str(engines[1])}})
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(JOB), str(engines[0]), str(tmp_path / "out"), job],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "60"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and time.monotonic() - started < 40, proc.stderr[-3000:]
    assert "the ranks opened engines of different builds" in proc.stderr and "rank(s) 1 another" in proc.stderr, \
        proc.stderr[-3000:]


def test_a_node_without_the_engine_is_named_at_once(k3_short_ckpt, tmp_path):
    """Two nodes (two torchrun agents here), the second without the engine dir: node 0's rank names rank 1 and its
    error at start-up (before, it waited K3_DIST_TIMEOUT_S in its groups' creation and failed with the store's
    'wait timeout' and a C++ trace, naming no one)."""
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "60"}
    started = time.monotonic()
    nodes = _two_nodes([["-m", "k3runtime.dist.launch", str(where), "generate", "--prompt", "Hello"]
                        for where in (engine, tmp_path / "missing")], env)
    errs = _errors(nodes)
    assert all(p.returncode != 0 for p in nodes) and time.monotonic() - started < 40, errs[0][-3000:]
    assert "Error (rank 1): " in errs[1] and "not an engine dir" in errs[1], errs[1][-3000:]
    assert re.search(r"Error \(rank 0\): rank\(s\) 1 cannot open their engine: .*not an engine dir", errs[0]), \
        errs[0][-3000:]


def test_a_rank_killed_on_another_node_is_named(k3_short_ckpt, tmp_path):
    """Two nodes (two torchrun agents here), node 1's rank SIGKILLed mid-generation: node 0's torchrun cannot name
    it (its own rank is the one that fails), so rank 0's error does, as dead rather than as a rank that left with an
    error of its own (before: 'another rank left the job (its own error says why)', naming no one). Most runs see
    gloo's closed connection ("died without an error of its own"); on a loaded machine rank 0's collective has
    also timed out first (K3_DIST_TIMEOUT_S) with the connection not yet seen closed, and the beats then name rank
    1 as silent ("stopped responding"): either names it, neither as a rank that left."""
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2), max_seq_len=4096,
                          max_num_tokens=512)
    out = tmp_path / "progress"
    job = json.dumps({"prompts": [[1, 2, 3]], "max_tokens": 4000, "options": {}, "mode": "stream"})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "30"}
    nodes = _two_nodes([[str(JOB), str(engine), str(out), job]] * 2, env)
    victim = None
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and int(out.read_text() or 0) >= 3):
            assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, "generation never started"
            time.sleep(0.2)
        victim = int(Path(f"{out}.rank1.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        log = nodes[0].communicate(timeout=120)[1]
        assert nodes[0].returncode != 0, log[-3000:]
        assert re.search(r"rank 1 (died without an error of its own|stopped responding)", log), log[-3000:]
        assert not re.search(r"(another rank|rank 1) left the job", log), log[-3000:]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        if victim is not None:
            _kill(victim)


def test_a_failed_score_over_ranks_marks_the_engine_failed(k3_short_ckpt, tmp_path):
    """Rank 0's share of a score fails while the workers are inside its step (synchronous scheduling): the engine is
    marked failed, and the next call says so at once (before, it stayed usable, and the next step's broadcast met
    the workers' pending collectives and hung for K3_DIST_TIMEOUT_S)."""
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    out = tmp_path / "out.json"
    job = json.dumps({"prompts": [[1, 2, 3]], "max_tokens": 2, "options": {}, "mode": "score_fails"})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(JOB), str(engine), str(out), job],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "8"}, capture_output=True,
                          text=True, timeout=300)
    got = json.loads(out.read_text())
    assert "the engine failed in an earlier step" in got["after"], (got, proc.stderr[-3000:])
    assert got["seconds"] < 5


def test_a_command_that_opens_no_engine_lets_the_workers_go(k3_short_ckpt, tmp_path):
    """Rank 0's command ends before it opens the engine: `--help` ends the job at once with status 0, and a refused
    flag on a two-node job reaches the other node's rank with rank 0's message (before, the workers waited for the
    groups' creation for K3_DIST_TIMEOUT_S and failed with the store's 'wait timeout', naming no one)."""
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "60"}
    started = time.monotonic()
    helped = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "k3runtime.dist.launch", str(engine), "generate", "--help"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "--max-tokens" in helped.stdout, helped.stderr[-3000:]
    assert time.monotonic() - started < 40
    started = time.monotonic()
    nodes = _two_nodes([["-m", "k3runtime.dist.launch", str(engine), "generate", "--prompt", "Hi", "--max-tokens",
                         "0"]] * 2, env)
    errs = _errors(nodes)
    assert all(p.returncode != 0 for p in nodes) and time.monotonic() - started < 40, errs[1][-3000:]
    assert "Error (rank 1): rank 0 ended before it opened the engine: --max-tokens: expected an int" in errs[1], \
        errs[1][-3000:]


def test_a_gpu_index_is_refused_under_torchrun(k3_short_ckpt, tmp_path):
    """`--device cuda:1` under torchrun: rank 0's options reach every rank, which would all read their weights onto
    GPU 1 while their NCCL collectives run on their LOCAL_RANK's GPU; every rank refuses it at once, saying what to
    give (checked before any GPU is touched, so this runs on the CPU)."""
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "k3runtime.dist.launch", str(engine), "generate", "--prompt", "Hi", "--device",
                           "cuda:1"], env={**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "60"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--device cuda:1: under torchrun every rank takes the GPU of its LOCAL_RANK" in proc.stderr, \
        proc.stderr[-3000:]
