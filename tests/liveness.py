"""Loopback helpers shared by the tests that start servers or process groups: a free port, and waiting for a
server process to answer /health."""

from __future__ import annotations

import random
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, picked at random below the kernel's ephemeral
    range: a port the kernel hands out (a bind to port 0) it may hand out again, to another process's outgoing
    connection or port-0 bind (gloo's, torchrun's, the other test worker's), before the server binds it."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.Random()
    for _ in range(100):
        port = pick.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 120, what: str = "serve") -> None:
    """Return once http://127.0.0.1:port/health answers 200; fail if `proc` exits or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} did not come up"
        time.sleep(0.2)
