"""Start the tritonserver bundled in nvidia-pytriton on a model repository (tests, local runs).

The Python environment (a venv with numpy<2, nvidia-pytriton and access to k3runtime; see
tools/triton_env.sh) provides the server binary, the Python backend and the stub. Three fixes from
shared/notes/TRITON_ON_CPU.md: a symlinked backend dir (the stub's RPATH resolves through the link),
the interpreter's libpython dir on LD_LIBRARY_PATH, and the venv first on PATH (the stub picks its
environment from `python3` on PATH).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_VENV = Path(os.environ.get("K3_TRITON_VENV", Path.home() / ".cache/k3runtime/triton-venv"))


@dataclass(frozen=True)
class TritonEnv:
    venv: Path
    python: Path
    site_packages: Path
    libdir: str
    py_version: str

    @property
    def tritonserver(self) -> Path:
        return self.site_packages / "pytriton/tritonserver/bin/tritonserver"


def find_env(venv: str | Path = DEFAULT_VENV) -> TritonEnv:
    """Describe the Triton venv; FileNotFoundError says how to make it."""
    venv = Path(venv)
    py = venv / "bin/python"
    if not py.exists():
        raise FileNotFoundError(f"{venv}: no Triton environment; create it with `bash tools/triton_env.sh {venv}`")
    code = ("import sysconfig,sys,site;print(sysconfig.get_paths()['purelib']);"
            "print(sysconfig.get_config_var('LIBDIR'));print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
    sp, libdir, ver = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True).stdout.split()
    env = TritonEnv(venv, py, Path(sp), libdir, ver)
    if not env.tritonserver.exists():
        raise FileNotFoundError(f"{env.tritonserver}: missing; install nvidia-pytriton==0.7.0 into {venv}")
    return env


def backend_dir(env: TritonEnv, dest: str | Path) -> Path:
    """dest/python/{libtriton_python.so, triton_python_backend_utils.py, triton_python_backend_stub} as symlinks."""
    ts = env.site_packages / "pytriton/tritonserver"
    py = Path(dest) / "python"
    py.mkdir(parents=True, exist_ok=True)
    for link, target in [("libtriton_python.so", ts / "backends/python/libtriton_python.so"),
                         ("triton_python_backend_utils.py", ts / "backends/python/triton_python_backend_utils.py"),
                         ("triton_python_backend_stub", ts / f"python_backend_stubs/{env.py_version}/"
                                                              "triton_python_backend_stub")]:
        if not target.exists():
            raise FileNotFoundError(f"{target}: missing from nvidia-pytriton (Python {env.py_version} stub?)")
        p = py / link
        if p.is_symlink() or p.exists():
            p.unlink()
        p.symlink_to(target)
    return Path(dest)


class TritonServer:
    """`with TritonServer(repo, workdir, ports=(http, grpc, metrics)) as ts:` starts, waits for ready, and on
    exit sends SIGTERM and waits (tritonserver stops its stubs itself), killing only on timeout. extra_args: more
    tritonserver flags (e.g. "--model-control-mode=explicit", "--load-model=*")."""

    def __init__(self, repo: str | Path, workdir: str | Path, ports: tuple[int, int, int],
                 env: TritonEnv | None = None, ready_timeout: float = 180.0, extra_args: tuple[str, ...] = ()):
        self.repo, self.workdir, self.ports = Path(repo), Path(workdir), ports
        self.extra_args = tuple(extra_args)
        self.env = env or find_env()
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "tritonserver.log"

    def start(self) -> TritonServer:
        http, grpc, metrics = self.ports
        backends = backend_dir(self.env, self.workdir / "backends")
        env = dict(os.environ, LD_LIBRARY_PATH=self.env.libdir,
                   PATH=f"{self.env.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        env.pop("PYTHONHOME", None)
        cmd = [str(self.env.tritonserver), f"--model-repository={self.repo}", f"--backend-directory={backends}",
               "--http-address=127.0.0.1", f"--http-port={http}", "--grpc-address=127.0.0.1",
               f"--grpc-port={grpc}", "--metrics-address=127.0.0.1", f"--metrics-port={metrics}",
               "--allow-gpu-metrics=false", "--exit-timeout-secs=15", "--log-verbose=0", *self.extra_args]
        self._log = open(self.log_path, "wb")
        # SIGINT is not ignored in the child even if our parent ignores it (non-interactive shells).
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_default_signals)
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        url = f"http://127.0.0.1:{self.ports[0]}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}; its errors:\n{self.log_errors()}"
                                   f"\nlog:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {self.ready_timeout:.0f} s; log:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace") if self.log_path.exists() else ""

    def log_errors(self, n: int = 10) -> str:
        """The log's last n error lines (`E<date>`: why a model failed to load; the tail is mostly the model table)."""
        if not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join([line for line in lines if re.match(r"E\d{4} ", line)][-n:])

    def children(self) -> list[int]:
        """Pids of processes whose parent is tritonserver (the stubs)."""
        if self.proc is None:
            return []
        return _children(self.proc.pid)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        kids = self.children()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        # A killed server leaves its stubs behind (re-parented to init); end exactly those.
        for pid in kids:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        return rc

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _default_signals():
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


if __name__ == "__main__":  # python -m k3runtime.triton_backend.launch REPO WORKDIR HTTP GRPC METRICS
    repo, work, *ports = sys.argv[1:]
    with TritonServer(repo, work, tuple(int(p) for p in ports)) as ts:
        print(f"tritonserver ready (pid {ts.proc.pid}); Ctrl-C to stop", flush=True)
        try:
            ts.proc.wait()
        except KeyboardInterrupt:
            pass
