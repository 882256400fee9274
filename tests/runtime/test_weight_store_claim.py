"""`k3runtime weight-store` takes a path for a dead store's only when nothing lives there: a busy live store (its
control thread held by mute clients), a live store with another --socket, or a --socket naming a file that is no
socket keep what they have, and the new store says why in one line."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from test_weight_store import Store, stores  # noqa: F401 - stores: the fixture, shared

from k3runtime.dist.weight_store_client import store_status


@pytest.fixture(scope="module")
def engine(k3_tiny_engine) -> "os.PathLike":
    return k3_tiny_engine


def _refused(store: Store) -> str:
    _, err = store.proc.communicate(timeout=60)
    assert store.proc.returncode == 1 and err.startswith("Error: ") and "Traceback" not in err, err
    return err


def test_socket_path_that_is_not_a_socket_is_refused_and_kept(engine, stores, tmp_path):
    keep = tmp_path / "notes.txt"
    keep.write_text("keep me")
    err = _refused(stores(engine, "--socket", str(keep)))
    assert f"{keep}: exists and is not a socket" in err
    assert keep.read_text() == "keep me"


def test_a_busy_live_store_is_not_taken_for_a_dead_one(engine, stores):
    first = stores(engine)
    first.wait_ready()
    copy = first.dir / "rank0.safetensors"
    inode = copy.stat().st_ino
    mute = []  # clients that connect and say nothing hold the store's control thread 2 s each
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(first.socket))
        mute.append(s)
    try:
        err = _refused(stores(engine, name=first.name))
    finally:
        for s in mute:
            s.close()
    assert "did not answer" in err
    assert copy.stat().st_ino == inode and first.proc.poll() is None
    assert store_status(first.socket, timeout_s=10)["state"] == "ready"


def test_a_live_store_with_another_socket_keeps_its_copies(engine, stores, tmp_path):
    first = stores(engine, "--socket", str(tmp_path / "a.sock"))
    first.socket = tmp_path / "a.sock"
    first.wait_ready()
    inode = (first.dir / "rank0.safetensors").stat().st_ino
    err = _refused(stores(engine, name=first.name))  # the default socket: none there
    assert "a live weight store holds it" in err
    assert (first.dir / "rank0.safetensors").stat().st_ino == inode


def test_a_killed_store_is_still_cleared(engine, stores):
    first = stores(engine)
    first.wait_ready()
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    second = stores(engine, name=first.name)
    second.wait_ready()  # the kernel dropped the dead store's lock with its process


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="root without setpriv: modes do not apply")
def test_an_unreadable_rank_file_is_one_line(engine, tmp_path):
    copy = shutil.copytree(engine, tmp_path / "engine")
    weights = copy / "rank0/weights.safetensors"
    weights.chmod(0)
    cmd = [sys.executable, "-m", "k3runtime.dist.weight_store", str(copy), "--name", f"t{os.getpid()}",
           "--shm-root", str(tmp_path)]
    if os.geteuid() == 0:
        cmd = [shutil.which("setpriv"), "--bounding-set=-dac_override,-dac_read_search", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr == f"Error: {weights}: cannot be read (Permission denied)\n", out.stderr
