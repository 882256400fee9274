"""Host weight store with real processes: a store subprocess on a tiny 2-rank engine, ranks attaching to it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from engines import build_engine
from safetensors.torch import load_file

from k3runtime.dist.weight_store import shm_dir_for
from k3runtime.dist.weight_store_client import WeightStoreConfig, WeightStoreError, attach, store_status
from k3runtime.loader import EngineError

STORE_MODULE = [sys.executable, "-m", "k3runtime.dist.weight_store"]


@pytest.fixture(scope="module")
def engine(k3_tiny_ckpt, tmp_path_factory) -> Path:
    from k3build.mapping import Mapping

    return build_engine(k3_tiny_ckpt, tmp_path_factory.mktemp("ws") / "engine", mapping=Mapping(tp_size=2))


class Store:
    """A `weight-store` subprocess with a unique name; teardown kills it and removes anything it left."""

    def __init__(self, engine: Path, *args: str, name: str | None = None, cmd=STORE_MODULE):
        self.name = name or f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir = shm_dir_for(self.name)
        self.socket = self.dir / "store.sock"
        self.proc = subprocess.Popen([*cmd, str(engine), "--name", self.name, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def config(self, ranks="0-1") -> dict:
        return {"nodes": {"*": {"socket": str(self.socket), "ranks": ranks}}}

    def wait_ready(self, timeout_s=60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"store exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                status = store_status(self.socket, timeout_s=1.0)
                if status["state"] == "ready":
                    return status
            except WeightStoreError:
                pass
            time.sleep(0.05)
        raise AssertionError("store not ready in time")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def stores():
    started: list[Store] = []

    def start(engine, *args, **kw) -> Store:
        started.append(Store(engine, *args, **kw))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(_bytes(v) + f"{v.dtype}{tuple(v.shape)}".encode()).hexdigest() for k, v in weights.items()}


def test_attach_is_bit_exact_here_and_in_a_second_process(engine, stores, tmp_path):
    store = stores(engine)
    status = store.wait_ready()
    assert status["ranks"].keys() == {"0", "1"} and status["engine_dir"] == str(engine.resolve())
    for rank in (0, 1):
        disk = load_file(engine / f"rank{rank}" / "weights.safetensors")
        mapped = attach(engine, rank, config=store.config())
        assert mapped.keys() == disk.keys() and len(disk) > 10
        for name, t in disk.items():
            assert mapped[name].dtype == t.dtype and mapped[name].shape == t.shape, name
            assert _bytes(mapped[name]) == _bytes(t), name
    # zero-copy: a tensor's storage is the whole mapped file; a write stays private to this process
    name = next(k for k, v in mapped.items() if v.dtype == torch.float32)
    assert mapped[name].untyped_storage().nbytes() == (store.dir / "rank1.safetensors").stat().st_size
    mapped[name].fill_(123.0)
    assert _bytes(attach(engine, 1, config=store.config())[name]) == _bytes(disk[name])

    cfg_file = tmp_path / "wsc.json"
    cfg_file.write_text(json.dumps(store.config()))
    # the rank side of a restart: a fresh process attaching through $K3_WEIGHT_STORE_CONFIG
    script = ("import hashlib, json, sys, time, torch\n"
              "from k3runtime.dist.weight_store import attach\n"
              "t0 = time.perf_counter(); w = attach(sys.argv[1], 1); dt = time.perf_counter() - t0\n"
              "b = lambda t: t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b''\n"
              "d = {k: hashlib.sha256(b(v) + f'{v.dtype}{tuple(v.shape)}'.encode()).hexdigest() for k, v in w.items()}\n"
              "print(json.dumps({'attach_s': dt, 'digests': d}))\n")
    env = {**os.environ, "K3_WEIGHT_STORE_CONFIG": str(cfg_file)}
    out = subprocess.run([sys.executable, "-c", script, str(engine)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["digests"] == _digests(disk)
    assert child["attach_s"] < 1.0, child["attach_s"]


def test_no_store_configured_means_none(engine, monkeypatch):
    monkeypatch.delenv("K3_WEIGHT_STORE_CONFIG", raising=False)
    assert attach(engine, 0) is None
    other_host = {"nodes": {"not-this-host-xyz": {"socket": "/nonexistent.sock", "ranks": [0, 1]}}}
    assert attach(engine, 0, config=other_host) is None
    assert attach(engine, 1, config={"nodes": {"*": {"socket": "/nonexistent.sock", "ranks": [0]}}}) is None


def _assert_quick_error(engine, config, match, limit_s=3.5, rank=0, **kw):
    t0 = time.monotonic()
    with pytest.raises(WeightStoreError, match=match) as err:
        attach(engine, rank, config=config, **kw)
    assert time.monotonic() - t0 < limit_s
    assert isinstance(err.value, EngineError)
    return str(err.value)


def test_dead_store_is_a_quick_clear_error(engine, stores, tmp_path):
    _assert_quick_error(engine, {"nodes": {"*": {"socket": str(tmp_path / "none.sock"), "ranks": "0-1"}}},
                        "no such socket")
    store = stores(engine)
    store.wait_ready()
    store.proc.send_signal(signal.SIGKILL)
    store.proc.wait(10)
    msg = _assert_quick_error(engine, store.config(), "connection refused")
    assert str(store.socket) in msg

    # a process that accepts connections but never answers: bounded by timeout_s, not a hang
    mute_path = tmp_path / "mute.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(str(mute_path))
        mute.listen(1)
        _assert_quick_error(engine, {"nodes": {"*": {"socket": str(mute_path), "ranks": [0]}}}, "no answer within 0.5 s",
                            limit_s=2.0, timeout_s=0.5)


def test_missing_shm_copy_is_a_clear_error(engine, stores):
    store = stores(engine)
    store.wait_ready()
    (store.dir / "rank1.safetensors").unlink()
    _assert_quick_error(engine, store.config(), r"rank1\.safetensors is unreadable", rank=1)


@pytest.mark.parametrize("change", ["config", "values"])
def test_store_of_another_engine_is_a_mismatch(engine, stores, tmp_path, change):
    other = tmp_path / "other"
    shutil.copytree(engine, other)
    if change == "config":
        cfg = json.loads((other / "config.json").read_text())
        cfg["build_config"]["max_seq_len"] += 1
        (other / "config.json").write_text(json.dumps(cfg))
    else:
        # same names, shapes and dtypes, other values: only the sampled content can tell
        path = other / "rank0" / "weights.safetensors"
        data = bytearray(path.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        data[start:] = bytes(b ^ 0x5A for b in data[start:])
        path.write_bytes(bytes(data))
    store = stores(engine)
    store.wait_ready()
    expect = "config.json sha256" if change == "config" else "sampled weight bytes"
    msg = _assert_quick_error(other, store.config(), "holds another engine")
    assert expect in msg and str(engine.resolve()) in msg
    # the store's own engine still attaches
    assert attach(engine, 0, config=store.config()) is not None


def test_rank_the_store_does_not_hold(engine, stores):
    store = stores(engine, "--ranks", "0")
    status = store.wait_ready()
    assert list(status["ranks"]) == ["0"] and not (store.dir / "rank1.safetensors").exists()
    _assert_quick_error(engine, store.config("0-1"), r"holds ranks \[0\], not 1", rank=1)


CLI = [sys.executable, "-m", "k3runtime.cli", "weight-store"]


# SIGTERM through the `k3runtime` command group, as an operator starts it; SIGINT (Ctrl-C) on the bare module
@pytest.mark.parametrize("sig, cmd", [(signal.SIGTERM, CLI), (signal.SIGINT, STORE_MODULE)], ids=["SIGTERM", "SIGINT"])
def test_signal_removes_shm_files_and_exits_0(engine, stores, sig, cmd):
    store = stores(engine, cmd=cmd)
    store.wait_ready()
    assert (store.dir / "rank0.safetensors").exists()
    store.proc.send_signal(sig)
    out, err = store.proc.communicate(timeout=10)
    assert store.proc.returncode == 0, err
    assert not store.dir.exists() and "removed" in out
    # the copy's progress on stderr (lines, not a terminal's bar): its last line all of the ranks' bytes
    done = [line for line in err.splitlines() if line.startswith("weight-store copy: 100%")]
    assert len(done) == 1 and "\r" not in err, err


def test_refuses_when_the_copy_does_not_fit(engine, stores):
    store = stores(engine, "--max-bytes", "1000000")
    _, err = store.proc.communicate(timeout=60)
    assert store.proc.returncode == 1
    need = sum((engine / f"rank{r}" / "weights.safetensors").stat().st_size for r in (0, 1))
    assert f"need 0.01 GiB ({need} bytes) but --max-bytes allows" in err and "1000000 bytes" in err
    assert not store.dir.exists()


def test_second_store_refused_and_dead_store_leftovers_cleared(engine, stores):
    first = stores(engine)
    first.wait_ready()
    second = stores(engine, name=first.name)
    _, err = second.proc.communicate(timeout=60)
    assert second.proc.returncode == 1 and f"pid {first.proc.pid}" in err and "already" in err
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert first.dir.exists()  # a killed store cannot clean up ...
    third = stores(engine, name=first.name)
    third.wait_ready()  # ... the next one with that name clears it and starts
    assert attach(engine, 0, config=third.config()) is not None
    third.proc.send_signal(signal.SIGTERM)
    _, err = third.proc.communicate(timeout=10)
    assert "leftovers of a dead store" in err and not third.dir.exists()


def test_config_files_json_and_toml(tmp_path):
    host = socket.gethostname()
    (tmp_path / "c.toml").write_text(f'[nodes."{host}"]\nsocket = "a.sock"\nranks = "0-3"\n'
                                     '[nodes.other]\nsocket = "/x/b.sock"\nranks = [4, 5]\n')
    (tmp_path / "c.json").write_text(json.dumps({"nodes": {host: {"socket": "a.sock", "ranks": "0-3"},
                                                           "other": {"socket": "/x/b.sock", "ranks": [4, 5]}}}))
    for name in ("c.toml", "c.json"):
        cfg = WeightStoreConfig.load(tmp_path / name)
        assert cfg.entry_for(2).socket == tmp_path / "a.sock"  # relative to the config file
        assert cfg.entry_for(4) is None  # rank 4 lives on another node
        assert cfg.entry_for(5, host="other.cluster.local").socket == Path("/x/b.sock")
    with pytest.raises(WeightStoreError, match=r"nodes\.n0\.ranks: rank list item 'x'"):
        WeightStoreConfig.from_dict({"nodes": {"n0": {"socket": "/s", "ranks": "0,x"}}}, "f.json")
    with pytest.raises(WeightStoreError, match="needs 'socket'"):
        WeightStoreConfig.from_dict({"nodes": {"n0": {"ranks": [0]}}}, "f.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(WeightStoreError, match="bad.json: cannot read"):
        WeightStoreConfig.load(tmp_path / "bad.json")


def test_load_rank_attaches_when_a_store_is_configured(engine, stores, tmp_path, monkeypatch):
    from k3runtime import loader

    store = stores(engine)
    store.wait_ready()
    cfg_file = tmp_path / "wsc.toml"
    cfg_file.write_text(f'[nodes."*"]\nsocket = "{store.socket}"\nranks = [0, 1]\n')
    monkeypatch.setenv("K3_WEIGHT_STORE_CONFIG", str(cfg_file))
    rank = loader.load_rank(engine, 1)
    shm_size = (store.dir / "rank1.safetensors").stat().st_size
    assert all(t.untyped_storage().nbytes() == shm_size for t in rank.weights.values())  # mapped, not read from disk
