"""Benchmark: reading a rank's weights into device memory (runtime/weight_reader.py) against its floor and against
safetensors' load_file, side by side in one run (JSON lines).

    python tools/bench_load.py [--engine DIR | --gib 2] [--device cpu|cuda] [--repeat 3] [--warm]

Floor: the file read front to back into one host buffer (the disk, or the page cache with --warm; fresh memory on
the CPU, where the tensors are fresh memory too); on a GPU, the larger of that (into a pinned buffer) and a pinned
host->device copy of the same bytes (PCIe), measured in this run.
"ours_verified" is our read hashing every byte as it goes (EngineOptions.verify_weights), to show what the check
costs. Baseline: `safetensors.torch.load_file(path, device)` plus, on the CPU, a copy of every tensor (its load is a lazy
mmap; the copy is what reads the file). Cold rounds evict the file from the page cache first (posix_fadvise), as
bench_weight_store.py does. Without --engine a synthetic rank file of random bf16 tensors is written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from arg_types import count, gib  # noqa: E402
from bench_weight_store import drop_from_page_cache, write_synthetic_engine  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from k3runtime.weight_reader import read_weights  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw_read(path: Path, buf: torch.Tensor, chunk: int = 64 << 20) -> None:
    view = memoryview(buf.numpy())
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < len(view):
            n = f.readinto(view[got:got + chunk])
            if not n:
                break
            got += n


def _baseline(path: Path, device: torch.device) -> None:
    w = load_file(path, device=str(device))
    if device.type == "cpu":
        for v in w.values():
            v.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, help="an engine dir: reads its rank0/weights.safetensors")
    ap.add_argument("--gib", type=gib, default=2.0, help="synthetic rank file size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=count, default=3)
    ap.add_argument("--warm", action="store_true", help="read from the page cache (no eviction between rounds)")
    args = ap.parse_args()
    if args.engine and not (args.engine / "rank0" / "weights.safetensors").is_file():
        ap.error(f"--engine {args.engine}: no rank0/weights.safetensors there (a `k3build build` output has one)")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="k3-bench-load-") as tmp:
        if args.engine:
            path = args.engine / "rank0" / "weights.safetensors"
        else:
            write_synthetic_engine(Path(tmp) / "engine", args.gib, 1)
            path = Path(tmp) / "engine" / "rank0" / "weights.safetensors"
        size = path.stat().st_size
        host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        # on the CPU the floor reads into fresh memory, as the tensors ours and load_file fill are (page faults
        # included); on a GPU into the pinned buffer the PCIe floor copies from
        fresh = device.type == "cpu"
        modes = {"floor_read": lambda: _raw_read(path, torch.empty(size, dtype=torch.uint8) if fresh else host),
                 "ours": lambda: read_weights(path, device),
                 "ours_verified": lambda: read_weights(path, device, digest=hashlib.sha256()),
                 "load_file": lambda: _baseline(path, device)}
        if device.type == "cuda":
            dev = torch.empty(size, dtype=torch.uint8, device=device)
            modes["floor_pcie"] = lambda: dev.copy_(host, non_blocking=True)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeat):
            for mode, fn in modes.items():
                if not args.warm and mode != "floor_pcie":
                    drop_from_page_cache(path)
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times[mode].append(time.perf_counter() - t0)
        med = {m: statistics.median(t) for m, t in times.items()}
        floor = max(med["floor_read"], med.get("floor_pcie", 0.0))
        row = {"bench": "load", "device": str(device), "cache": "warm" if args.warm else "cold", "bytes": size,
               "repeat": args.repeat, **{f"{m}_s": round(t, 4) for m, t in med.items()},
               "floor_s": round(floor, 4), "ours_gbps": round(size / med["ours"] / 1e9, 2),
               "ours_x_floor": round(med["ours"] / floor, 3), "load_file_x_ours": round(med["load_file"] / med["ours"], 3),
               "verified_x_ours": round(med["ours_verified"] / med["ours"], 3)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
