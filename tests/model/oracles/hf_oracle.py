"""transformers' `KimiLinearForCausalLM` as a CPU oracle, run in a subprocess.

Why a subprocess: when `fla` and `triton` both import, transformers binds KDA and the short conv to fla's Triton
kernels, which fail without a GPU (PITFALLS.md). The worker (this file run as a script) makes `triton`, `fla` and
`causal_conv1d` unimportable *before* torch/transformers load, then asserts that every kernel-capable function in
the Kimi-Linear module resolved to transformers' own torch implementation.

Results are cached in memory and on disk (`$K3_ORACLE_CACHE_DIR`, default `<tmp>/k3_hf_oracle_cache`), keyed by the
checkpoint files' contents, the request and the transformers version, so a changed checkpoint is never served
stale numbers while an identical re-created one is.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCKED = ("triton", "fla", "causal_conv1d", "kernels")
_memo: dict[str, tuple[np.ndarray, list[int] | None]] = {}


class OracleError(RuntimeError):
    """The transformers oracle failed or disagreed with itself; the message says how."""


@dataclass(frozen=True)
class HFJob:
    """One request: prompt logits of `token_ids`, plus `n_greedy` greedy tokens when > 0."""

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
    return hf_batch([HFJob(str(model_dir), tuple(token_ids), n)])[0][1]


def hf_batch(jobs: list[HFJob]) -> list[tuple[np.ndarray, list[int] | None]]:
    """Run many jobs in ONE worker process (importing transformers costs seconds); returns (logits, greedy) each.

    A job with n_greedy > 0 also fills the cache for its logits-only twin, so `hf_greedy` then `hf_logits` on the
    same prompt costs one run.
    """
    keys = [_key(j) for j in jobs]
    todo = [(k, j) for k, j in zip(keys, jobs) if _lookup(k) is None]
    todo = list({k: j for k, j in todo}.items())
    if todo:
        results = _run_worker([j for _, j in todo])
        for (k, j), (logits, greedy) in zip(todo, results):
            _store(k, logits, greedy)
            if j.n_greedy:
                _store(_key(HFJob(j.model_dir, j.token_ids)), logits, None)
    out = []
    for k in keys:
        hit = _lookup(k)
        assert hit is not None
        out.append((hit[0].copy(), None if hit[1] is None else list(hit[1])))
    return out


def _cache_dir() -> Path:
    return Path(os.environ.get("K3_ORACLE_CACHE_DIR") or Path(tempfile.gettempdir()) / "k3_hf_oracle_cache")


_digests: dict[tuple, str] = {}


def _key(job: HFJob) -> str:
    # Content-addressed (not path/mtime): a re-created identical tiny model hits the disk cache across runs.
    d = Path(job.model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: no config.json; expected a transformers save_pretrained directory")
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))
    stat = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if stat not in _digests:
        h = hashlib.sha1()
        for p in files:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        _digests[stat] = h.hexdigest()
    blob = json.dumps([_digests[stat], list(job.token_ids), job.n_greedy, _transformers_version(), 3])
    return hashlib.sha1(blob.encode()).hexdigest()


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "missing"


def _lookup(key: str):
    if key in _memo:
        return _memo[key]
    path = _cache_dir() / f"{key}.npz"
    if path.is_file():
        try:
            z = np.load(path)
            greedy = z["greedy"].tolist() if "greedy" in z.files else None
            _memo[key] = (z["logits"], greedy)
            return _memo[key]
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)  # a torn write from a killed run: recompute
    return None


def _store(key: str, logits: np.ndarray, greedy: list[int] | None) -> None:
    _memo[key] = (logits, greedy)
    d = _cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"{key}.{os.getpid()}.tmp.npz"
    arrays = {"logits": logits} if greedy is None else {"logits": logits, "greedy": np.asarray(greedy, np.int64)}
    np.savez(tmp, **arrays)
    os.replace(tmp, d / f"{key}.npz")


def _run_worker(jobs: list[HFJob]) -> list[tuple[np.ndarray, list[int] | None]]:
    with tempfile.TemporaryDirectory(prefix="hf_oracle_") as tmp:
        spec = Path(tmp) / "jobs.json"
        spec.write_text(json.dumps([{"model_dir": j.model_dir, "token_ids": list(j.token_ids),
                                     "n_greedy": j.n_greedy} for j in jobs]))
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(spec), tmp],
                              capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise OracleError(f"transformers oracle worker failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        out = []
        for i, j in enumerate(jobs):
            z = np.load(Path(tmp) / f"out{i}.npz")
            out.append((z["logits"].astype(np.float32), z["greedy"].tolist() if j.n_greedy else None))
        return out


# ---------------------------------------------------------------- worker side (runs in the subprocess) ----------

def _block_kernel_packages() -> None:
    # None in sys.modules: `import x` raises ImportError and importlib.util.find_spec(x) returns None.
    for name in BLOCKED:
        if name in sys.modules and sys.modules[name] is not None:
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


def _worker(spec_path: str, out_dir: str) -> None:
    _block_kernel_packages()
    import torch

    torch.set_num_threads(1)
    from transformers import KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    _check_torch_path(modeling)
    jobs = json.loads(Path(spec_path).read_text())
    models: dict[str, torch.nn.Module] = {}
    for i, job in enumerate(jobs):
        if job["model_dir"] not in models:
            models[job["model_dir"]] = KimiLinearForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
        model = models[job["model_dir"]]
        ids = torch.tensor([job["token_ids"]], dtype=torch.long)
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0].float().numpy()
            arrays = {"logits": logits}
            n = job["n_greedy"]
            if n:
                gen = model.generate(ids, max_new_tokens=n, min_new_tokens=0, do_sample=False, use_cache=True,
                                     eos_token_id=None, pad_token_id=model.config.pad_token_id,
                                     attention_mask=torch.ones_like(ids))
                greedy = gen[0, ids.shape[1]:].tolist()
                if len(greedy) != n:
                    raise OracleError(f"{job['model_dir']}: generate returned {len(greedy)} tokens, asked for {n}")
                seq = ids
                for step in range(n):
                    nxt = int(model(seq, use_cache=False).logits[0, -1].argmax())
                    if nxt != greedy[step]:
                        raise OracleError(f"{job['model_dir']}: cached generate and no-cache recompute disagree at "
                                          f"step {step}: {greedy[step]} vs {nxt}")
                    seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
                arrays["greedy"] = np.asarray(greedy, np.int64)
        np.savez(Path(out_dir) / f"out{i}.npz", **arrays)
    real = [m for m in BLOCKED if sys.modules.get(m) is not None]
    if real:
        raise OracleError(f"blocked kernel packages got imported anyway: {real}")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
