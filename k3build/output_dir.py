"""Where k3build's commands write: convert and build never over their own input, --overwrite replaces only
k3build's own output of that kind or an empty directory (anything else at OUT is the user's to remove), and a
finished output moves into place whole.

A command writes `.{name}.tmp-XXXX/` beside OUT and renames it into place at the end (move_into_place),
so OUT is either absent or complete. A run killed with SIGKILL cannot remove its staging dir; it leaves a pid file
in it (pid, host, process start time) so the next run for the same OUT can tell a dead run's dir from a live one's
(also one on another host sharing the filesystem, or a later process given the same pid) and remove it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

from .tokenizer import TOKENIZER_FILES


def config_of(path: Path) -> dict:
    """path/config.json parsed, or {} when it is missing or not a JSON object."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def check_output_dir(out: Path, src: Path, *, overwrite: bool, ours: Callable[[dict], bool], what: str,
                     error: type[Exception]) -> None:
    """`error` when writing `out` (built from `src`) would replace the input or something that is not `what`.

    ours: whether an existing out's config.json (config_of) is k3build's `what`."""
    if out.is_symlink() and not out.resolve().parent.is_dir():
        raise error(f"{out}: a symlink to {out.resolve()}, whose directory does not exist")
    out_r, src_r = out.resolve(), src.resolve()
    if out_r == src_r or out_r in src_r.parents:
        raise error(f"{out}: is or holds the input {src}; write the output elsewhere")
    if src_r in out_r.parents:  # replacing the input later (synth or convert --overwrite) would delete it
        raise error(f"{out}: inside the input {src}; write the output elsewhere")
    if not out.exists():
        return
    if not overwrite:
        raise error(f"{out}: already exists; pass --overwrite to replace it")
    if out.is_dir() and not any(out.iterdir()):
        return
    if not out.is_dir() or not ours(config_of(out)):
        raise error(f"{out}: not {what}, so --overwrite leaves it alone (it replaces only k3build's own output or an "
                    "empty directory); remove it yourself or pick another path")
    check_only_ours(out, error)


# What synth, convert and build write at OUT (and a killed run's pid file): anything else there is the user's
_OWN_NAMES = {"config.json", "model.safetensors.index.json", "model.safetensors", *TOKENIZER_FILES}
_OWN_PATTERNS = ("model-*-of-*.safetensors", "rank[0-9]*.safetensors")
_RANK_DIR = re.compile(r"rank\d+")
_RANK_FILES = {"graph.onnx", "weights.safetensors"}


def _k3build_wrote(entry: Path, name: str) -> bool:
    if name in _OWN_NAMES or name == PID_FILE or any(fnmatch(name, p) for p in _OWN_PATTERNS):
        return entry.is_file()
    return bool(_RANK_DIR.fullmatch(name)) and entry.is_dir() and all(
        f.name in _RANK_FILES and f.is_file() for f in entry.iterdir())


def check_only_ours(out: Path, error: type[Exception]) -> None:
    """`error` naming what --overwrite would delete at out that k3build did not write there (a user's notes, results
    or another output kept inside), before any work is done: the new output replaces out whole."""
    foreign = sorted(e.name + ("/" if e.is_dir() else "") for e in out.iterdir() if not _k3build_wrote(e, e.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise error(f"{out}: holds {shown}, which k3build did not write; --overwrite would delete it with the old "
                    "output: move it out first or pick another path")


def check_free_space(out: Path, need: int, error: type[Exception]) -> None:
    """`error` when the filesystem out will be written on has less than `need` bytes free (checked before any work:
    a K3 checkpoint or conversion is over a TB)."""
    target = write_target(out)
    probe = next((p for p in (target.parent, *target.parent.parents) if p.exists()), None)
    free = shutil.disk_usage(probe).free if probe is not None else need
    if free < need:
        raise error(f"{out}: needs {need / 2**20:,.1f} MiB, but {probe} has only {free / 2**20:,.1f} MiB free")


def write_target(out: Path) -> Path:
    """Where staged_output writes OUT: out, or the path a symlink at out points to."""
    return out.resolve() if out.is_symlink() else out


def os_error_message(out: Path, doing: str, e: OSError) -> str:
    """`out: cannot <doing> (<why>: <path>)` for an OSError met writing out."""
    why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or str(e)
    return f"{out}: cannot {doing} ({why}{f': {e.filename}' if e.filename else ''})"


def make_parent(out: Path, error: type[Exception]) -> list[Path]:
    """out's parent directories, made where missing (returned, the deepest first); `error` where they cannot be (a
    file in the way, no permission), before any work is done."""
    missing = []
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(os_error_message(out, f"make its directory {out.parent}", e)) from None
    return missing


PID_FILE = ".k3build.pid"
# A staging dir without a pid file is only a dead run's when it is older than this (a live run writes its pid
# file right after creating the dir).
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


def _host() -> str:
    """Where this process's pid means something: the host name and the pid namespace (containers that share a host
    name each number their own processes)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}{'/' + ns if ns else ''}".replace(" ", "_")


def make_staging_dir(out: Path, error: type[Exception]) -> Path:
    """The hidden staging dir for `out` (same parent, so the final rename is atomic), with the permissions of any new
    directory (mkdtemp makes it private) and this process's pid file; `error` where out's directory takes no new
    entry."""
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        (tmp / PID_FILE).write_text(_pid_line())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error(os_error_message(out, f"write beside it in {out.parent}", e)) from None
    return tmp


def _pid_line() -> str:
    pid = os.getpid()
    return f"{pid} {_host()} {_start_time(pid) or '-'}\n"


def _owner(tmp: Path, host: str) -> tuple[bool, str] | None:
    """(whether the run that made staging dir tmp is gone, who it is, for a message); None where tmp is gone."""
    try:
        pid_s, pid_host, start = (tmp / PID_FILE).read_text().split()
    except FileNotFoundError:
        try:
            young = time.time() - tmp.stat().st_mtime <= NO_PID_GRACE_S
        except FileNotFoundError:
            return None  # removed meanwhile
        return not young, "a run just starting (no pid file yet)"
    except (OSError, ValueError):
        return True, ""  # an unreadable pid file is no live build's
    if pid_host != host:  # only this host's (and pid namespace's) processes can be checked: another's is left alone
        return False, f"pid {pid_s} on {pid_host}, which this machine cannot check: if no run is there, remove {tmp}"
    return not _alive(int(pid_s), None if start == "-" else start), f"pid {pid_s}"


def clean_stale(out: Path) -> list[Path]:
    """Remove staging dirs of `out` whose run is no longer running, and what such a run left of the output it was
    replacing (move_into_place); returns what was removed."""
    removed = []
    host = _host()
    asides = [d for d in out.parent.glob(f".{out.name}.old-*") if (d / PID_FILE).is_file()]  # only ours say whose
    for tmp in [*out.parent.glob(f".{out.name}.tmp-*"), *asides]:
        if tmp.is_dir() and (owner := _owner(tmp, host)) is not None and owner[0]:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def other_runs(out: Path, own: Path | None = None) -> list[str]:
    """Who else is writing `out` now (clean_stale first): the live runs of its staging dirs other than `own`."""
    host, found = _host(), []
    for tmp in sorted(out.parent.glob(f".{out.name}.tmp-*")):
        if tmp != own and tmp.is_dir() and (owner := _owner(tmp, host)) is not None and not owner[0]:
            found.append(owner[1])
    return found


def move_into_place(staging: Path, out: Path, error: type[Exception]) -> None:
    """Rename the finished `staging` (a sibling of out, so the rename is atomic) to `out`; an existing out is moved
    aside first and then removed, so that out is never a mix of the old and the new. `error` where a rename is
    refused (the old out is back in place then; the caller removes staging)."""
    (staging / PID_FILE).unlink(missing_ok=True)  # a finished output is no run's staging dir
    if not out.exists():
        try:
            os.replace(staging, out)
        except OSError as e:
            raise error(os_error_message(out, "put the finished output in place", e)) from None
        return
    old = out.with_name(f".{out.name}.old-{staging.name.rsplit('-', 1)[-1]}")
    # SIGINT/SIGTERM held while OUT is swapped: between the two renames OUT would be missing, the old one aside
    held = _hold_signals()
    try:
        # this run's pid in the copy going aside: a run starting meanwhile leaves it alone, one starting after this
        # run died removes what is left of it (clean_stale); an old output the pid cannot go in is never removed
        try:
            (out / PID_FILE).write_text(_pid_line())
        except OSError:
            pass
        try:
            os.replace(out, old)
            try:
                os.replace(staging, out)
            except OSError:
                os.replace(old, out)
                raise
        except OSError as e:
            (out / PID_FILE).unlink(missing_ok=True)
            raise error(os_error_message(out, "put the finished output in place", e)) from None
    except BaseException:
        held()
        raise
    try:
        held()  # a signal held during the swap lands here
        for child in old.iterdir():  # the pid file last: what an interrupt leaves still says whose it is
            if child.name == PID_FILE:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        shutil.rmtree(old, ignore_errors=True)
    except (KeyboardInterrupt, SystemExit):
        pass  # OUT is complete and in place: what is left of the old output goes with the next run's clean_stale


def _hold_signals() -> Callable[[], None]:
    """Hold SIGINT and SIGTERM until the returned function is called, which delivers what came meanwhile.

    Their Python handlers are swapped for one that notes the signal: blocking them (pthread_sigmask) would hold them
    in the calling thread only, and the kernel gives a process-directed signal to any thread that does not block it
    (tqdm's monitor, torch's OpenMP workers), after which CPython runs the handler in the main thread at its next
    bytecode. Off the main thread (no handler can be set there) nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    came: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}

    def release() -> None:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
        for s in dict.fromkeys(came):
            signal.raise_signal(s)  # its own handler now: KeyboardInterrupt, SystemExit, or the default action

    return release


@contextmanager
def staged_output(out: Path, error: type[Exception]) -> Iterator[Path]:
    """`with staged_output(OUT, error) as tmp:` write OUT's content into tmp; when the block ends it moves into place
    whole, and when it raises (Ctrl-C and SIGTERM through writing_command included) tmp goes with what it held.
    OUT's parent is made first and dead runs' staging dirs for OUT removed; `error` for what cannot be written, and
    while another live run writes OUT (its staging dir's pid file says so).
    OUT a symlink: the output goes where it points (on that filesystem), and the link stays."""
    out = write_target(out)
    made = make_parent(out, error)
    clean_stale(out)
    tmp = make_staging_dir(out, error)
    try:
        # looked at with our own dir made: of two runs that start together, neither goes on unseen
        if busy := other_runs(out, own=tmp):
            raise error(f"{out}: another k3build run is writing it ({'; '.join(busy)}); wait for it to end, or write "
                        "elsewhere (the last to finish would replace the other's output)")
        yield tmp
        move_into_place(tmp, out, error)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:  # the directories this run made for OUT, where nothing else went meanwhile
            try:
                d.rmdir()
            except OSError:
                break
        raise
