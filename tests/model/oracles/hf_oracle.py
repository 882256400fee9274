"""transformers' `KimiLinearForCausalLM` as a CPU oracle, run in a subprocess.

Why a subprocess: when `fla` and `triton` both import, transformers binds KDA and the short conv to fla's Triton
kernels, which fail without a GPU (PITFALLS.md). The worker (this file run as a script) makes `triton`, `fla`,
`causal_conv1d` and `kernels` unimportable *before* torch/transformers load, then asserts that every
kernel-capable function of the Kimi-Linear module resolved to transformers' own torch implementation.

One worker serves the whole test session (importing transformers costs seconds). Every request computes the prompt
logits and `PREFETCH_GREEDY` greedy tokens, so `hf_logits` then `hf_greedy` on one prompt is one run. Results are
cached in memory and on disk (`$K3_ORACLE_CACHE_DIR`, default `<tmp>/k3_hf_oracle_cache`), keyed by the checkpoint
files' contents, the prompt and the transformers version: a changed checkpoint is never served stale numbers,
an identical re-created one is a hit.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCKED = ("triton", "fla", "causal_conv1d", "kernels")
PREFETCH_GREEDY = 32
_memo: dict[str, tuple[np.ndarray, list[int]]] = {}
_digests: dict[tuple, str] = {}


class OracleError(RuntimeError):
    """The transformers oracle failed or disagreed with itself; the message says how."""


@dataclass(frozen=True)
class HFJob:
    """One request: prompt logits of `token_ids`, plus at least `n_greedy` greedy tokens."""

    model_dir: str
    token_ids: tuple[int, ...]
    n_greedy: int = 0


def hf_logits(model_dir: str | Path, token_ids: list[int]) -> np.ndarray:
    """Prompt logits from transformers, no cache, fp32.

    Returns:
        np.ndarray [T, vocab] float32.
    """
    return hf_batch([HFJob(str(model_dir), tuple(token_ids))])[0][0]


def hf_greedy(model_dir: str | Path, token_ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens from `generate(do_sample=False, use_cache=True)`, never stopping at EOS.

    The worker also decodes by full recompute without a cache and raises `OracleError` if the two disagree.
    """
    if n <= 0:
        raise ValueError(f"n: expected a positive number of tokens, got {n}")
    return hf_batch([HFJob(str(model_dir), tuple(token_ids), n)])[0][1][:n]


def hf_batch(jobs: list[HFJob]) -> list[tuple[np.ndarray, list[int]]]:
    """Run many jobs in one worker round trip; returns (logits [T, vocab], greedy tokens >= n_greedy) per job."""
    keys = [_key(j) for j in jobs]
    todo: dict[str, HFJob] = {}
    for k, j in zip(keys, jobs):
        if _lookup(k, j.n_greedy) is None:
            prev = todo.get(k)
            todo[k] = j if prev is None or j.n_greedy > prev.n_greedy else prev
    if todo:
        order = list(todo)
        runs = [HFJob(todo[k].model_dir, todo[k].token_ids, max(todo[k].n_greedy, PREFETCH_GREEDY)) for k in order]
        for k, (logits, greedy) in zip(order, _worker().run(runs)):
            _store(k, logits, greedy)
    out = []
    for k, j in zip(keys, jobs):
        hit = _lookup(k, j.n_greedy)
        assert hit is not None
        out.append((hit[0].copy(), list(hit[1])))
    return out


def _cache_dir() -> Path:
    return Path(os.environ.get("K3_ORACLE_CACHE_DIR") or Path(tempfile.gettempdir()) / "k3_hf_oracle_cache")


def _digest(model_dir: str) -> str:
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: no config.json; expected a transformers save_pretrained directory")
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))
    stat = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if stat not in _digests:
        h = hashlib.sha1()
        for p in files:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        _digests[stat] = h.hexdigest()
    return _digests[stat]


def _key(job: HFJob) -> str:
    # Content-addressed (not path/mtime), so a re-created identical tiny model hits the disk cache across runs.
    blob = json.dumps([_digest(job.model_dir), list(job.token_ids), _transformers_version(), 4])
    return hashlib.sha1(blob.encode()).hexdigest()


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "missing"


def _lookup(key: str, n_greedy: int):
    if key not in _memo:
        path = _cache_dir() / f"{key}.npz"
        if not path.is_file():
            return None
        try:
            z = np.load(path)
            _memo[key] = (z["logits"], z["greedy"].tolist())
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)  # a torn write from a killed run: recompute
            return None
    hit = _memo[key]
    return hit if len(hit[1]) >= n_greedy else None


def _store(key: str, logits: np.ndarray, greedy: list[int]) -> None:
    _memo[key] = (logits, greedy)
    d = _cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"{key}.{os.getpid()}.tmp.npz"
    np.savez(tmp, logits=logits, greedy=np.asarray(greedy, np.int64))
    os.replace(tmp, d / f"{key}.npz")


def build_kimi_linear(out_dir: Path, seed: int, variant: dict) -> None:
    """Run `tiny_models.build_kimi_linear_here` in the worker (the variant as `dataclasses.asdict`)."""
    _worker().request({"op": "build", "out_dir": str(out_dir), "seed": seed, "variant": variant})


class _Client:
    """The parent's handle on the long-lived worker: one JSON line per request, arrays through .npz files."""

    def __init__(self, env_overrides: dict[str, str] | None = None):
        self.tmp = tempfile.TemporaryDirectory(prefix="hf_oracle_")
        self.log = open(Path(self.tmp.name) / "worker.log", "w+")
        # USE_HUB_KERNELS=0: transformers 5.25 asks for the (blocked) `kernels` package by default in from_pretrained
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   USE_HUB_KERNELS="0", **(env_overrides or {}))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.count = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, jobs: list[HFJob]) -> list[tuple[np.ndarray, list[int]]]:
        self.count += 1
        out_dir = Path(self.tmp.name) / f"req{self.count}"
        out_dir.mkdir()
        self.request({"op": "run", "out_dir": str(out_dir), "jobs": [
            {"model_dir": j.model_dir, "token_ids": list(j.token_ids), "n_greedy": j.n_greedy} for j in jobs]})
        results = []
        for i in range(len(jobs)):
            z = np.load(out_dir / f"out{i}.npz")
            results.append((z["logits"].astype(np.float32), z["greedy"].tolist()))
        return results

    def request(self, req: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        except BrokenPipeError:
            reply = ""
        if not reply:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.log.seek(0)
            raise OracleError(f"transformers oracle worker died (rc={self.proc.poll()}):\n{self.log.read()[-4000:]}")
        status = json.loads(reply)
        if not status["ok"]:
            raise OracleError(f"transformers oracle worker failed:\n{status['error']}")

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        self.tmp.cleanup()


_client: _Client | None = None


def _worker() -> _Client:
    global _client
    if _client is None or not _client.alive():
        _client = _Client()
        atexit.register(_client.close)
    return _client


# ---------------------------------------------------------------- worker side (runs in the subprocess) ----------

def _block_kernel_packages() -> None:
    # None in sys.modules: `import x` raises ImportError and importlib.util.find_spec(x) returns None.
    for name in BLOCKED:
        if sys.modules.get(name) is not None:
            raise OracleError(f"{name} was imported before the oracle could block it")
        sys.modules[name] = None  # type: ignore[assignment]


def _check_torch_path(modeling) -> None:
    import inspect

    names = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")
    for name in names:
        fn = getattr(modeling, name)
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
        if impl is not getattr(fn, "__wrapped__", None):
            raise OracleError(f"transformers bound {name} to {impl!r}, not its torch path; the oracle would not be "
                              "the reference implementation")


def _run_job(torch, model, job: dict) -> dict[str, np.ndarray]:
    ids = torch.tensor([job["token_ids"]], dtype=torch.long)
    logits = model(ids, use_cache=False).logits[0].float().numpy()
    n = job["n_greedy"]
    gen = model.generate(ids, max_new_tokens=n, do_sample=False, use_cache=True, eos_token_id=None,
                         pad_token_id=model.config.pad_token_id, attention_mask=torch.ones_like(ids))
    greedy = gen[0, ids.shape[1]:].tolist()
    if len(greedy) != n:
        raise OracleError(f"{job['model_dir']}: generate returned {len(greedy)} tokens, asked for {n}")
    seq = ids
    for step in range(n):
        nxt = int(model(seq, use_cache=False).logits[0, -1].argmax())
        if nxt != greedy[step]:
            raise OracleError(f"{job['model_dir']}: cached generate and no-cache recompute disagree at step {step}: "
                              f"{greedy[step]} vs {nxt}")
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return {"logits": logits, "greedy": np.asarray(greedy, np.int64)}


def _serve() -> None:
    # protocol on a private copy of stdout; anything printed by libraries goes to stderr (the log)
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _block_kernel_packages()
    import torch

    torch.set_num_threads(1)
    from transformers import KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    _check_torch_path(modeling)
    models: dict[str, torch.nn.Module] = {}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if req["op"] == "build":
                import tiny_models  # beside this file, which is sys.path[0] in the worker

                v = dict(req["variant"], layers=tuple(req["variant"]["layers"]))
                tiny_models.build_kimi_linear_here(req["out_dir"], req["seed"], tiny_models.KimiLinearVariant(**v))
            for i, job in enumerate(req.get("jobs", [])):
                key = _digest(job["model_dir"])
                if key not in models:
                    while len(models) >= 8:
                        models.pop(next(iter(models)))
                    models[key] = KimiLinearForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
                with torch.no_grad():
                    arrays = _run_job(torch, models[key], job)
                np.savez(Path(req["out_dir"]) / f"out{i}.npz", **arrays)
            real = [m for m in BLOCKED if sys.modules.get(m) is not None]
            if real:
                raise OracleError(f"blocked kernel packages got imported anyway: {real}")
            reply = {"ok": True}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        raise SystemExit("usage: hf_oracle.py --serve (started by hf_oracle._worker)")
    _serve()
