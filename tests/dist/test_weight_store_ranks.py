"""Every rank of a torchrun job attaches its weights from the node's store (`--distributed-weight-config`)."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from engines import build_engine
from liveness import free_port, wait_healthy

from k3build.mapping import Mapping
from k3runtime.dist.weight_store import shm_dir_for
from k3runtime.dist.weight_store_client import WeightStoreError, store_status


def _mapping_pids(path: Path) -> set[int]:
    """Processes that have `path` mapped."""
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if str(path) in (d / "maps").read_text():
                    pids.add(int(d.name))
            except OSError:
                pass
    return pids


def _check_ranks_map_the_store(shm: Path, engine: Path) -> tuple[set[int], set[int]]:
    """Each rank maps its own store copy and no rank maps the engine's files; returns (rank0 pids, rank1 pids)."""
    rank0, rank1 = _mapping_pids(shm / "rank0.safetensors"), _mapping_pids(shm / "rank1.safetensors")
    assert rank0 and rank1 and not rank0 & rank1, (rank0, rank1)
    for pid in rank0 | rank1:
        assert str(engine / "rank0") not in (maps := Path(f"/proc/{pid}/maps").read_text()), pid
        assert str(engine / "rank1") not in maps, pid
    return rank0, rank1


def test_torchrun_serve_ranks_attach_from_the_store_and_restart(k3_short_ckpt, tmp_path):
    engine = build_engine(k3_short_ckpt, tmp_path / "engine", mapping=Mapping(tp_size=2))
    name = f"test-ranks-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    shm = shm_dir_for(name)
    store = subprocess.Popen([sys.executable, "-m", "k3runtime.dist.weight_store", str(engine), "--name", name],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job = None
    try:
        deadline = time.monotonic() + 60
        while True:
            assert store.poll() is None, store.communicate()
            try:
                if store_status(shm / "store.sock", timeout_s=1.0)["state"] == "ready":
                    break
            except WeightStoreError:
                pass
            assert time.monotonic() < deadline, "store not ready"
            time.sleep(0.05)
        cfg = tmp_path / "weights.json"
        cfg.write_text(json.dumps({"nodes": {"*": {"socket": str(shm / "store.sock"), "ranks": "0-1"}}}))
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "K3_WEIGHT_STORE_CONFIG"}
        env["OMP_NUM_THREADS"] = "1"
        # Only rank 0 runs `serve`; the launcher must hand the config to rank 1 too.
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                "--max-restarts=1", "-m", "k3runtime.dist.launch", str(engine), "serve", "--port", str(port),
                                "--model-name", "k3", "--log-level", "warning",
                                "--distributed-weight-config", str(cfg)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_healthy(job, port, timeout=180, what="serve under torchrun")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": "k3", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        first = _check_ranks_map_the_store(shm, engine)
        # kill rank 1: torchrun restarts the group, and the new ranks attach to the store again
        os.kill(next(iter(first[1])), signal.SIGKILL)
        killed_at = time.monotonic()
        while any(Path(f"/proc/{pid}").exists() for pid in first[0]):  # the old server must be gone first
            assert time.monotonic() - killed_at < 60, "torchrun did not stop rank 0 after rank 1 died"
            time.sleep(0.2)
        wait_healthy(job, port, timeout=180, what="serve after the restart")
        print(f"serving again {time.monotonic() - killed_at:.1f} s after rank 1 was killed")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": "k3", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        second = _check_ranks_map_the_store(shm, engine)
        assert not (first[0] | first[1]) & (second[0] | second[1]), "the restart reused a process"
    finally:
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.communicate()
        store.send_signal(signal.SIGTERM)
        store.communicate(timeout=30)
    assert not shm.exists()
