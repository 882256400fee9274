"""`k3runtime weight-store ENGINE`: hold a node's rank weight files in host shared memory, one copy per node.

The store copies each `rank{N}/weights.safetensors` to `<shm-root>/k3ws-<name>/rank{N}.safetensors`, checks the
copy's sha256 against the bytes it read, and answers `{"op": "status"}` on a Unix socket (alive, engine fingerprint,
ranks, file paths). Rank processes map those files (`attach`) instead of reading disk. SIGTERM/SIGINT remove the
files and the socket and exit 0. This module imports no torch, so `k3runtime` stays quick to start.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click
from k3plugins.progress import progress_bar

from . import weight_store_proto as proto

CHUNK_BYTES = 16 << 20
SOCKET_NAME = "store.sock"
OWN_FILE = re.compile(r"rank\d+\.safetensors(\.part)?|" + re.escape(SOCKET_NAME))


class StoreError(Exception):
    """The store cannot start or keep its copy; the message names the engine, file or limit."""


class _Stopped(Exception):
    pass


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def shm_dir_for(name: str, shm_root: str | Path = "/dev/shm") -> Path:
    return Path(shm_root) / f"k3ws-{name}"


def default_socket(name: str, shm_root: str | Path = "/dev/shm") -> Path:
    return shm_dir_for(name, shm_root) / SOCKET_NAME


@dataclass(frozen=True)
class StoreOptions:
    engine_dir: Path
    ranks: tuple[int, ...]
    name: str
    socket_path: Path
    shm_root: Path = Path("/dev/shm")
    max_bytes: int | None = None

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, '_', '.', '-' only (it names {self.shm_dir})")
        if len(str(self.socket_path).encode()) > 107:
            raise ValueError(f"socket {self.socket_path}: Unix socket paths are limited to 107 bytes")

    @property
    def shm_dir(self) -> Path:
        return shm_dir_for(self.name, self.shm_root)


def check_space(need: int, ranks: tuple[int, ...], shm_root: Path, max_bytes: int | None) -> None:
    """Refuse before copying anything when the copy cannot fit."""
    what = f"ranks {','.join(map(str, ranks))} need {gib(need)}"
    if max_bytes is not None and need > max_bytes:
        raise StoreError(f"{what} but --max-bytes allows {gib(max_bytes)}")
    st = os.statvfs(shm_root)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if need > free:
        raise StoreError(f"{what} in {shm_root} but only {gib(free)} is free there (filesystem size {gib(size)}); "
                         f"free space or enlarge it (e.g. `mount -o remount,size=<N>G {shm_root}`)")
    avail = mem_available()
    if avail is not None and need > avail:
        raise StoreError(f"{what} of host memory but MemAvailable is {gib(avail)}")


def mem_available() -> int | None:
    """The host's MemAvailable in bytes (None where /proc/meminfo does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def copy_verified(src: Path, dst: Path, stop: threading.Event, on_bytes=lambda n: None) -> str:
    """Copy src to dst (space reserved first), re-read dst and compare sha256; returns the content sha256."""
    before = src.stat()
    part = dst.with_name(dst.name + ".part")
    buf = memoryview(bytearray(CHUNK_BYTES))
    digest = hashlib.sha256()
    with open(src, "rb") as fi, open(part, "wb") as fo:
        try:
            # tmpfs hands out pages lazily: reserve now so a full /dev/shm fails here, not as SIGBUS in a rank
            os.posix_fallocate(fo.fileno(), 0, before.st_size)
        except OSError as e:
            raise StoreError(f"{dst.parent}: cannot reserve {gib(before.st_size)} for {src} ({e.strerror})") from None
        while n := fi.readinto(buf):
            if stop.is_set():
                raise _Stopped
            digest.update(buf[:n])
            fo.write(buf[:n])
            on_bytes(n)
    after = src.stat()
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise StoreError(f"{src} changed while it was being copied; restart the store once the engine is written")
    copy_sha = _sha256_file(part, buf, stop)
    if copy_sha != digest.hexdigest():
        raise StoreError(f"{part}: copy does not match {src} (sha256 {copy_sha[:12]} vs {digest.hexdigest()[:12]})")
    part.chmod(0o444)
    part.rename(dst)
    return copy_sha


def _sha256_file(path: Path, buf: memoryview, stop: threading.Event) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            if stop.is_set():  # a rank's copy is tens of GB: SIGTERM must not wait for its whole re-read
                raise _Stopped
            digest.update(buf[:n])
    return digest.hexdigest()


class WeightStore:
    """One node's store: claim the shm dir, copy and verify ranks, answer status on the socket."""

    def __init__(self, opts: StoreOptions):
        self.opts = opts
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._bound = False
        self._dir_fd: int | None = None  # the shm dir, flock'ed while this store lives: what tells a live store's dir
        self._owns_dir = False
        try:
            self.config_sha = proto.config_sha256(opts.engine_dir)
            records = proto.rank_records(opts.engine_dir)
            declared = sorted(records)
            if missing := sorted(set(opts.ranks) - set(declared)):
                raise StoreError(f"{opts.engine_dir}: no rank(s) {missing}; the engine has ranks {declared}")
            self.sources = {r: proto.weights_path(opts.engine_dir, r) for r in opts.ranks}
            for r, path in self.sources.items():
                if not path.is_file():
                    raise StoreError(f"{path}: missing; the engine dir is incomplete")
            self.prints = {r: proto.rank_print(p) for r, p in self.sources.items()}
            self.built_sha = proto.built_sha256(records)  # rank -> the build's sha256 of its file, if recorded
        except OSError as e:  # a file or directory of the engine this user may not read
            raise StoreError(f"{e.filename or opts.engine_dir}: cannot be read ({e.strerror or e})") from None
        self.total_bytes = sum(p.size for p in self.prints.values())
        self.loaded_bytes = 0
        self.content_sha: dict[int, str] = {}
        self.state = "starting"

    def status(self) -> dict:
        o = self.opts
        with self._lock:
            ranks = {str(r): {"path": str(o.shm_dir / f"rank{r}.safetensors"), "size": p.size,
                              "header_sha256": p.header_sha256, "sample_sha256": p.sample_sha256,
                              "content_sha256": self.content_sha.get(r)} for r, p in self.prints.items()}
            return {"protocol": proto.PROTOCOL_VERSION, "alive": True, "state": self.state, "name": o.name,
                    "pid": os.getpid(), "host": socket.gethostname(), "engine_dir": str(o.engine_dir.resolve()),
                    "config_sha256": self.config_sha, "fingerprint": proto.fingerprint(self.config_sha, self.prints),
                    "shm_dir": str(o.shm_dir), "ranks": ranks, "loaded_bytes": self.loaded_bytes,
                    "total_bytes": self.total_bytes}

    def claim(self) -> None:
        """Take the shm dir and socket; refuse if a live store has them, clear what a dead one left."""
        o = self.opts
        if o.socket_path.is_symlink() or o.socket_path.exists():
            if not stat.S_ISSOCK(o.socket_path.lstat().st_mode):
                raise StoreError(f"{o.socket_path}: exists and is not a socket; pick another --socket")
            try:
                other = proto.request(o.socket_path, {"op": "status"}, timeout_s=2.0)
            except ConnectionRefusedError:
                o.socket_path.unlink()  # nothing listens: a dead store's
            except OSError as e:  # a timeout above all: a live store that is busy, or something else, not a dead one
                raise StoreError(f"{o.socket_path}: something listens there but did not answer ({e.strerror or e}); "
                                 "stop it or pick another --name/--socket") from None
            except ValueError as e:
                raise StoreError(f"{o.socket_path}: something else listens there ({e}); pick another --socket") from None
            else:
                raise StoreError(f"a weight store (pid {other.get('pid')}, engine {other.get('engine_dir')}) already "
                                 f"serves {o.socket_path}; stop it or pick another --name/--socket")
        if o.shm_dir.exists():
            if (fd := _lock_dir(o.shm_dir)) is None:
                raise StoreError(f"{o.shm_dir}: a live weight store holds it (one with another --socket?); stop it or "
                                 "pick another --name")
            os.close(fd)  # nobody held it: a dead store's
            foreign = [p.name for p in o.shm_dir.iterdir() if not OWN_FILE.fullmatch(p.name)]
            if foreign:
                raise StoreError(f"{o.shm_dir} holds files a weight store did not write ({foreign[:3]}); pick another --name")
            click.echo(f"weight-store: removing leftovers of a dead store in {o.shm_dir}", err=True)
            shutil.rmtree(o.shm_dir)
        check_space(self.total_bytes, o.ranks, o.shm_root, o.max_bytes)
        try:
            o.shm_dir.mkdir(parents=True)
        except OSError as e:  # FileExistsError: another store made it since the check above
            raise StoreError(f"{o.shm_dir}: cannot create it ({e.strerror})") from None
        self._dir_fd = _lock_dir(o.shm_dir)
        if self._dir_fd is None:
            raise StoreError(f"{o.shm_dir}: another weight store took it while this one started; pick another --name")
        self._owns_dir = True
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(str(o.socket_path))
        except OSError as e:
            raise StoreError(f"{o.socket_path}: cannot listen there ({e.strerror})") from None
        self._bound = True
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        with self._lock:
            self.state = "loading"
        threading.Thread(target=self._serve, name="weight-store-control", daemon=True).start()

    def load(self) -> None:
        # a node's ranks are hundreds of GiB (K3 at TEP16: ~97 GiB a rank): minutes of copying, shown as it goes
        with progress_bar(total=self.total_bytes, desc="weight-store copy", unit="B", unit_scale=True,
                          unit_divisor=1024) as bar:
            for r, src in self.sources.items():
                self._load_rank(r, src, bar)
        with self._lock:
            self.state = "ready"

    def _load_rank(self, r: int, src: Path, bar) -> None:
        dst = self.opts.shm_dir / f"rank{r}.safetensors"
        sha = copy_verified(src, dst, self.stop, lambda n: (self._count(n), bar.update(n)))
        if (built := self.built_sha.get(r)) and sha != built:  # the store hashes every byte anyway: free here
            raise StoreError(f"{src}: damaged since its build (sha256 {sha[:12]}, {self.opts.engine_dir}/"
                             f"config.json records {built[:12]}); copy the engine whole again, or rebuild it")
        if diffs := self.prints[r].differences(proto.rank_print(dst)):
            raise StoreError(f"{src} changed after the store started: {'; '.join(diffs)}; restart the store")
        with self._lock:
            self.content_sha[r] = sha

    def _count(self, n: int) -> None:
        with self._lock:
            self.loaded_bytes += n

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return  # socket closed by close()
            with conn:
                # a stuck client cannot hold the store for more than this
                conn.settimeout(2.0)
                try:
                    line = conn.recv(4096).split(b"\n")[0]
                    op = (json.loads(line) if line.strip() else {}).get("op", "status")
                    reply = self.status() if op == "status" else {"protocol": proto.PROTOCOL_VERSION,
                                                                  "error": f"unknown op {op!r}"}
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except (OSError, ValueError, AttributeError):
                    pass

    def close(self) -> None:
        self.stop.set()
        if self._sock is not None:
            self._sock.close()
            if self._bound:  # only a socket this store made: never a path it failed to bind
                self.opts.socket_path.unlink(missing_ok=True)
        if self._owns_dir:
            shutil.rmtree(self.opts.shm_dir, ignore_errors=True)
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


def _lock_dir(path: Path) -> int | None:
    """An fd of `path` (a directory) holding flock(LOCK_EX), or None when a live store holds it. The lock lasts
    while the fd is open, and the kernel drops it when its process dies, however it dies (SIGKILL included)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def run_store(opts: StoreOptions, echo=click.echo) -> int:
    """Start, serve until SIGTERM/SIGINT, clean up; returns the exit code (0 after a signal)."""
    store = WeightStore(opts)
    stop = store.stop
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    t0 = time.monotonic()
    try:
        store.claim()
        store.load()
        host = socket.gethostname()
        echo(f"weight-store ready: ranks {','.join(map(str, opts.ranks))} ({gib(store.total_bytes)}) in {opts.shm_dir}, "
             f"socket {opts.socket_path}, fingerprint {proto.fingerprint(store.config_sha, store.prints)}, "
             f"{time.monotonic() - t0:.1f} s")
        echo(json.dumps({"nodes": {host: {"socket": str(opts.socket_path), "ranks": list(opts.ranks)}}}))
        while not stop.wait(0.5):
            pass
    except _Stopped:
        pass
    finally:
        store.close()
    echo(f"weight-store {opts.name}: stopped, {opts.shm_dir} removed")
    return 0


@click.command("weight-store")
@click.argument("engine", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--ranks", default=None, help="Ranks this node holds, e.g. 0,1 or 0-7 (default: all of the engine's).")
@click.option("--name", default=None, help="Store name: /dev/shm/k3ws-<name> (default: the engine dir's name).")
@click.option("--socket", "socket_path", default=None, type=click.Path(path_type=Path),
              help="Control socket (default: <shm dir>/store.sock).")
@click.option("--shm-root", default="/dev/shm", show_default=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path), help="A tmpfs to hold the copies in.")
@click.option("--max-bytes", type=click.IntRange(min=1), default=None, help="Refuse to hold more than this many bytes.")
def weight_store_cmd(engine, ranks, name, socket_path, shm_root, max_bytes):
    """Keep ENGINE's rank weights in host shared memory for ranks to attach (runs until SIGTERM/SIGINT)."""
    try:
        name = name or re.sub(r"[^A-Za-z0-9_.-]", "-", engine.resolve().name)
        rank_list = proto.parse_ranks(ranks, "--ranks") if ranks else tuple(proto.engine_ranks(engine))
        opts = StoreOptions(engine, rank_list, name, socket_path or default_socket(name, shm_root), shm_root, max_bytes)
        raise SystemExit(run_store(opts))
    except (StoreError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:  # reading the engine or writing the copy (EIO, a file that went away): one line, not a traceback
        raise click.ClickException(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}") from None


def attach(engine_dir, rank: int, *, config=None, device="cpu", timeout_s: float = 3.0):
    """Tensors of `rank` mapped from this node's store, or None when no store is configured for it.

    See `weight_store_client.attach` (kept there so that importing this module needs no torch).
    """
    from .weight_store_client import attach as _attach

    return _attach(engine_dir, rank, config=config, device=device, timeout_s=timeout_s)


if __name__ == "__main__":
    weight_store_cmd()
