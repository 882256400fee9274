"""Heartbeats name a hung rank after a collective timeout, also one that stopped just before it, and not a live one;
a live rank stuck in its own work by the collectives it has not entered (real gloo ranks under torchrun)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

JOB = textwrap.dedent('''
    import json, os, signal, sys, time
    import torch.distributed as dist
    from k3runtime.dist import heartbeat

    dist.init_process_group("gloo")
    heartbeat.start()
    store = dist.distributed_c10d._get_default_store()

    def wait(key):  # polled: TCPStore.wait holds the GIL, and the heartbeat thread would stop with it
        while not store.check([key]):
            time.sleep(0.05)

    if dist.get_rank() == 1:
        with open(sys.argv[1] + ".pid1", "w") as f:
            f.write(str(os.getpid()))
        wait("checked_alive")
        store.set("stopping", "1")
        os.kill(os.getpid(), signal.SIGSTOP)  # hangs here with its sockets open; rank 0 ends it
    time.sleep(2.5)  # both beat
    alive = heartbeat.silent_ranks(3.0)  # rank 1 beats: nobody
    store.set("checked_alive", "1")
    wait("stopping")
    time.sleep(0.2)
    stopped = heartbeat.silent_ranks(3.0)  # stopped 0.2 s ago: its beat does not move in the 3 s watched
    why = heartbeat.explain_timeout(RuntimeError("Timed out waiting 10000ms"), 10)
    other = heartbeat.explain_timeout(RuntimeError("Connection closed by peer"), 10)
    # gloo's other wording of a timeout, when the peer's side of the pair gives up first
    pair = heartbeat.explain_timeout(RuntimeError("Application timeout caused pair closure"), 10)
    heartbeat.stop()  # before the process group goes: this rank's beat stands still, marked as left
    mine = store.get("k3/heartbeat/0")
    time.sleep(2.5)
    still = store.get("k3/heartbeat/0") == mine == heartbeat.LEFT.encode()
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump({"alive": alive, "stopped": stopped, "why": why, "other": other, "pair": pair, "still": still}, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    os._exit(0)
''')


def _torchrun(tmp_path, code: str, nproc: int):
    """(the job's process, the path its rank 0 writes its findings to): `code` as a script under torchrun."""
    job, out = tmp_path / "job.py", tmp_path / "out.json"
    job.write_text(code)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}", str(job), str(out)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, out


def _log(proc, timeout: float) -> str:
    """The job's output once it ends; killed (and the timeout raised) if it runs past `timeout` s."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_a_rank_stopped_just_before_the_timeout_is_named(tmp_path):
    proc, out = _torchrun(tmp_path, JOB, 2)
    t0 = time.monotonic()
    try:
        while not out.exists() and proc.poll() is None:  # rank 0 writes it, then rank 1 is killed here
            time.sleep(0.2)
            assert time.monotonic() - t0 < 120, "the job did not finish"
    finally:
        pid1 = Path(f"{out}.pid1")
        if pid1.exists():
            try:
                os.kill(int(pid1.read_text()), signal.SIGKILL)  # never leave a stopped rank behind
            except ProcessLookupError:
                pass
        log = _log(proc, 60)
    assert out.exists(), log[-3000:]
    got = json.loads(out.read_text())
    assert got["alive"] == [] and got["stopped"] == [1]
    assert "rank 1 stopped responding (no heartbeat in 5 s)" in got["why"] and got["other"] is None
    assert "rank 1 stopped responding" in got["pair"]
    assert got["still"]


STUCK_JOB = textwrap.dedent('''
    import json, os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from k3runtime.dist import heartbeat

    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    heartbeat.start()
    rank, t = dist.get_rank(), torch.zeros(1)
    a = dist.new_group([0, 2], timeout=timedelta(seconds=3))
    b = dist.new_group([1, 2], timeout=timedelta(seconds=60))
    ka, kb = heartbeat.group_key("a", [0, 2]), heartbeat.group_key("b", [2, 1])
    if rank in (0, 2):  # a round on each group: every member entered one
        with heartbeat.collective(ka):
            dist.all_reduce(t, group=a)
    if rank in (1, 2):
        with heartbeat.collective(kb):
            dist.all_reduce(t, group=b)
    if rank == 1:
        time.sleep(14)  # alive, beating, in no collective: the rank the others wait for (rank 0 is done by 10 s)
        os._exit(0)
    if rank == 2:  # waits for rank 1 inside b; behind on a, where rank 0 waits for it
        try:
            with heartbeat.collective(kb):
                dist.all_reduce(t, group=b)
        finally:
            os._exit(0)
    time.sleep(1.5)
    try:
        with heartbeat.collective(ka):
            dist.all_reduce(t, group=a)
        err = None
    except RuntimeError as e:
        err = e
    got = {"err": str(err), "why": heartbeat.explain_timeout(err, 3) if err else None, "stuck": heartbeat.stuck_ranks()}
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump(got, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    os._exit(0)
''')


def test_a_live_rank_stuck_outside_the_collectives_is_named(tmp_path):
    """Rank 1 lives (its beat moves) but waits in no collective; rank 2 waits for it inside group b, so it never
    joins rank 0's collective on group a, which times out. Rank 2 is behind on a too, but waiting: only rank 1, the
    rank the waits start from, is named, by the group it is behind on."""
    proc, out = _torchrun(tmp_path, STUCK_JOB, 3)
    log = _log(proc, 120)
    assert out.exists(), log[-3000:]
    got = json.loads(out.read_text())
    assert "timed out" in got["err"].lower(), got
    assert got["stuck"] == [[1, ["b:1,2", 1, 2]]], got  # and "why" names it as stuck, not as silent:
    assert ("rank 1 (group b [1,2]: it entered 1 of its collectives, another member 2) is alive but waits in no "
            "collective: stuck in its own work") in got["why"], got["why"]


def test_an_orphaned_rank_names_the_store_it_lost(monkeypatch, capsys):
    """The store is the rendezvous host's agent's (MASTER_ADDR): on another node, the rank's own agent is alive, so
    the message names the store's address rather than blaming "its launcher"."""
    import threading

    from k3runtime.dist import heartbeat

    monkeypatch.setenv("MASTER_ADDR", "node0.example")
    monkeypatch.setenv("MASTER_PORT", "29500")
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    done = threading.Event()
    done.set()  # stop() came: no hard exit
    heartbeat._orphaned(1, RuntimeError("Broken pipe"), done)
    err = capsys.readouterr().err
    assert sent == [signal.SIGTERM]
    assert "rank 1 lost the job's store at node0.example:29500 (Broken pipe)" in err and "its launcher" not in err, err


def test_a_beat_that_finds_the_store_closed_stops_at_once(monkeypatch, tmp_path):
    """A beat failing on the store's closed socket (its agent killed: "Broken pipe") orphans the rank at once, not
    after ORPHAN_BEATS failures, each of which writes a dozen lines of TCPStore's C++ warning to the log."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from k3runtime.dist import heartbeat
    from liveness import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                               f"s = d.TCPStore('127.0.0.1', {port}, 2, True); time.sleep(1.5)"])
    try:
        client = None
        for _ in range(100):  # until the server listens
            try:
                client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=5))
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        assert client is not None
        client.set("k3/probe", "1")
        server.wait(timeout=30)
    finally:
        server.kill()

    class Counting:  # the real store, its failed sets counted
        failed = 0

        def set(self, key, value):
            try:
                client.set(key, value)
            except Exception:
                Counting.failed += 1
                raise

    orphaned = []
    monkeypatch.setattr(heartbeat, "PERIOD_S", 0.05)
    monkeypatch.setattr(heartbeat, "_orphaned", lambda rank, e, done: orphaned.append(str(e)))
    done = threading.Event()
    thread = threading.Thread(target=heartbeat._beat, args=(Counting(), 1, done), daemon=True)
    thread.start()
    thread.join(timeout=30)
    done.set()
    assert orphaned and any(w in orphaned[0].lower() for w in ("broken pipe", "connection reset")), orphaned
    assert Counting.failed == 1  # ORPHAN_BEATS (3) before
