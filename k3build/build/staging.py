"""The hidden staging dir an engine is written into, and the clean-up of those left by dead builds.

A build writes `.{name}.tmp-XXXX/` beside ENGINE and renames it into place at the end, so ENGINE is either
absent or complete. A build killed with SIGKILL cannot remove its staging dir; it leaves a pid file in it
(pid, host, process start time) so the next build of the same ENGINE can tell a dead build's dir from a
running one's and remove it.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

PID_FILE = ".k3build.pid"
# A staging dir without a pid file is only a dead build's when it is older than this (a live build writes
# its pid file right after creating the dir).
NO_PID_GRACE_S = 60.0


def _start_time(pid: int) -> str | None:
    """The process start time in clock ticks since boot (Linux /proc), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited: treat as dead


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    here = _start_time(pid)
    if Path("/proc").is_dir() and here is None and Path(f"/proc/{pid}").exists():
        return False  # zombie
    return start is None or here is None or here == start  # a different start time: the pid was reused


def make_staging_dir(engine_dir: Path) -> Path:
    """Create the hidden staging dir for `engine_dir` (same parent, so the final rename is atomic)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{engine_dir.name}.tmp-", dir=engine_dir.parent))
    pid = os.getpid()
    (tmp / PID_FILE).write_text(f"{pid} {socket.gethostname()} {_start_time(pid) or '-'}\n")
    return tmp


def finish_staging_dir(tmp: Path) -> None:
    (tmp / PID_FILE).unlink(missing_ok=True)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; an engine is meant to be shared


def clean_stale(engine_dir: Path) -> list[Path]:
    """Remove staging dirs of `engine_dir` whose build is no longer running; returns what was removed."""
    removed = []
    host = socket.gethostname()
    for tmp in engine_dir.parent.glob(f".{engine_dir.name}.tmp-*"):
        if not tmp.is_dir():
            continue
        try:
            pid_s, pid_host, start = (tmp / PID_FILE).read_text().split()
        except FileNotFoundError:
            try:
                stale = time.time() - tmp.stat().st_mtime > NO_PID_GRACE_S
            except FileNotFoundError:
                continue  # removed meanwhile
        except (OSError, ValueError):
            stale = True  # an unreadable pid file is no live build's
        else:
            # Only this host's processes can be checked; another host's build is left alone.
            stale = pid_host == host and not _alive(int(pid_s), None if start == "-" else start)
        if stale:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed
