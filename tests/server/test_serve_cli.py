"""`k3runtime serve` start-up options as an operator uses them: weight store, loopback bind, DeepEP limits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from liveness import free_port, wait_healthy

from k3runtime.dist.weight_store import shm_dir_for
from k3runtime.dist.weight_store_client import WeightStoreError, store_status
from k3runtime.engine_options import EngineOptions, host_sizes

MODEL = "k3-tiny"


def start_store(engine: Path, name: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "k3runtime.dist.weight_store", str(engine), "--name", name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sock = shm_dir_for(name) / "store.sock"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if store_status(sock, timeout_s=1.0)["state"] == "ready":
                return proc
        except WeightStoreError:
            pass
        assert time.monotonic() < deadline, "store not ready"
        time.sleep(0.05)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, hexport = fields[1].rsplit(":", 1)
            if int(hexport, 16) == port and fields[3] == "0A":  # 0A = LISTEN
                found.add(addr)
    return found


def test_serve_attaches_the_weight_store_and_binds_loopback(tiny_engine, tmp_path):
    name = f"test-serve-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    store = start_store(tiny_engine, name)
    serve = None
    try:
        cfg = tmp_path / "weights.json"
        cfg.write_text(json.dumps({"nodes": {"*": {"socket": str(shm_dir_for(name) / "store.sock"), "ranks": [0]}}}))
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "K3_WEIGHT_STORE_CONFIG"}
        serve = subprocess.Popen([sys.executable, "-m", "k3runtime.cli", "serve", str(tiny_engine), "--port", str(port),
                                  "--model-name", MODEL, "--max-tokens-limit", "8", "--log-level", "warning",
                                  "--distributed-weight-config", str(cfg), "--preemption-mode", "swap",
                                  "--swap-space-gib", "0.01"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        wait_healthy(serve, port)
        # the rank's weights are the store's shared copy, mapped, not a read of rank0/weights.safetensors
        maps = Path(f"/proc/{serve.pid}/maps").read_text()
        assert str(shm_dir_for(name) / "rank0.safetensors") in maps
        assert str(tiny_engine / "rank0" / "weights.safetensors") not in maps
        # no --host: only the loopback address listens
        assert listening_addresses(port) == {"0100007F"}, listening_addresses(port)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        if serve is not None and serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(30)
        store.send_signal(signal.SIGTERM)
        store.communicate(timeout=30)
    assert store.returncode == 0 and not shm_dir_for(name).exists()
    # the modes it runs in, said at start-up: the host store as many pages and slots as --swap-space-gib holds
    said = serve.stderr.read()
    assert "async scheduling off (the default for this engine and device)" in said
    pages, slots = host_sizes(json.loads((tiny_engine / "config.json").read_text()),
                              EngineOptions(preemption_mode="swap", swap_space_gib=0.01))
    assert f"preempted requests swap to a host store of {pages} pages and {slots} KDA slots a rank" in said, said


def test_serve_with_a_dead_store_is_a_clear_startup_error(tiny_engine, tmp_path):
    cfg = tmp_path / "weights.toml"
    cfg.write_text(f'[nodes."*"]\nsocket = "{tmp_path / "gone.sock"}"\nranks = [0]\n')
    r = subprocess.run([sys.executable, "-m", "k3runtime.cli", "serve", str(tiny_engine), "--port", str(free_port()),
                        "--distributed-weight-config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "gone.sock: no such socket" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "bad.json").write_text(json.dumps({"nodes": {"n0": {"ranks": [0]}}}))
    r = subprocess.run([sys.executable, "-m", "k3runtime.cli", "serve", str(tiny_engine), "--port", str(free_port()),
                        "--distributed-weight-config", str(tmp_path / "bad.json")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "nodes.n0: needs 'socket'" in r.stderr, r.stderr


def test_serve_enable_deepep_refuses_the_limit_it_hits(tiny_engine, tmp_path):
    top_k = json.loads((tiny_engine / "config.json").read_text())["pretrained_config"]["num_experts_per_token"]
    if top_k < 2:
        pytest.skip("the tiny preset routes to one expert")
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps({"max_topk": top_k - 1, "hidden_sizes": [7168]}))
    env = {**os.environ, "K3_DEEPEP_CAPS": str(caps)}
    r = subprocess.run([sys.executable, "-m", "k3runtime.cli", "serve", str(tiny_engine), "--port", str(free_port()),
                        "--enable-deepep"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0, r.stderr
    assert f"top-k {top_k} exceeds the low-latency kernels' maximum of {top_k - 1}" in r.stderr, r.stderr
    assert "is not one of the compiled widths [7168]" in r.stderr and "Traceback" not in r.stderr


def test_serve_without_the_server_extra_names_the_install(tiny_engine, monkeypatch):
    # tools/demo.sh installs the project without its extras: serve must say what to install, not raise an ImportError
    from click.testing import CliRunner

    from k3runtime.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed: its import fails, find_spec finds none
    r = CliRunner().invoke(main, ["serve", str(tiny_engine), "--port", str(free_port())])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception  # a ClickException's exit
    assert "missing here: uvicorn" in r.output and "pip install -e '.[serve]'" in r.output, r.output
