"""Heartbeats name a hung rank after a collective timeout, also one that stopped just before it, and not a live one
(real gloo ranks under torchrun)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

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
        store.set("pid1", str(os.getpid()))
        wait("checked_alive")
        store.set("stopping", "1")
        os.kill(os.getpid(), signal.SIGSTOP)  # hangs here with its sockets open; rank 0 ends it
    time.sleep(2.5)  # both beat
    alive = heartbeat.silent_ranks(5.0, watch_s=3.0)  # rank 1 beats: nobody
    store.set("checked_alive", "1")
    wait("stopping")
    time.sleep(0.2)
    stopped = heartbeat.silent_ranks(5.0, watch_s=3.0)  # no beat older than 5 s: watching tells
    why = heartbeat.explain_timeout(RuntimeError("Timed out waiting 10000ms"), 10)
    other = heartbeat.explain_timeout(RuntimeError("Connection closed by peer"), 10)
    with open(sys.argv[1], "w") as f:
        json.dump({"alive": alive, "stopped": stopped, "why": why, "other": other}, f)
    os.kill(int(store.get("pid1")), signal.SIGKILL)
    os._exit(0)
''')


def test_a_rank_stopped_just_before_the_timeout_is_named(tmp_path):
    job, out = tmp_path / "job.py", tmp_path / "out.json"
    job.write_text(JOB)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(job), str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # never leave a stopped rank behind
    assert out.exists(), log[-3000:]
    got = json.loads(out.read_text())
    assert got["alive"] == []
    # rank 1 stopped about 0.2 s before: no beat is 5 s old, and its beat did not move in 3 s
    assert [r for r, _ in got["stopped"]] == [1] and 2 < got["stopped"][0][1] < 5
    assert "rank 1 (no heartbeat for" in got["why"] and got["other"] is None
