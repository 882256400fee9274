"""Heartbeats name a hung rank after a collective timeout, also one that stopped just before it, and not a live one
(real gloo ranks under torchrun)."""

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


def test_a_rank_stopped_just_before_the_timeout_is_named(tmp_path):
    job, out = tmp_path / "job.py", tmp_path / "out.json"
    job.write_text(JOB)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(job), str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        try:
            log = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert out.exists(), log[-3000:]
    got = json.loads(out.read_text())
    assert got["alive"] == [] and got["stopped"] == [1]
    assert "rank 1 stopped responding (no heartbeat in 5 s)" in got["why"] and got["other"] is None
    assert "rank 1 stopped responding" in got["pair"]
    assert got["still"]


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
