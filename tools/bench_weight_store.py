"""Benchmark: a rank's cold load of its weights from disk vs attaching to the host weight store.

    python tools/bench_weight_store.py [--engine DIR | --gib 2.5 --ranks 2] [--device cpu] [--work DIR] [--keep]

Without --engine it writes a synthetic engine dir (config.json + rank{N}/weights.safetensors of random bf16
[4096, 4096] tensors; no graph, the store and attach need none) - much faster than synth+convert+build.
Each measurement runs in a fresh process, as a restarted rank would (torch imported before the clock starts).
Page cache: each weights file is fsync'ed and dropped with posix_fadvise(DONTNEED) before a cold read; residency
is checked with `fincore` when present. Prints JSON lines; the last one is the summary with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from arg_types import count, engine_dir, gib

TENSOR_SHAPE = (4096, 4096)  # bf16: 32 MiB a tensor

CHILD = r"""
import json, os, sys, time, torch
from safetensors.torch import load_file
from k3runtime.dist.weight_store import attach
import k3runtime.dist.weight_store_client  # a restarted rank has its runtime imported before it loads weights
mode, engine, rank, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()
# the destination exists before the clock starts, as a rank's weight buffers would: the timed copy then reads
# the source (disk or shared memory), rather than measuring fresh-page faults of the destination
size = os.path.getsize(f"{engine}/rank{rank}/weights.safetensors")
dst = torch.zeros(size, dtype=torch.uint8, device=device); sync()
t0 = time.perf_counter()
w = load_file(f"{engine}/rank{rank}/weights.safetensors") if mode == "disk" else attach(engine, rank)
t1 = time.perf_counter()
# both are lazy on CPU (safetensors >= 0.6 maps the file too): copying every byte is what reads the source
off = 0
for v in w.values():
    n = v.numel() * v.element_size()
    dst[off:off + n].copy_(v.reshape(-1).view(torch.uint8))
    off += n
sync()
print(json.dumps({"open_s": t1 - t0, "read_all_s": time.perf_counter() - t0, "bytes": off}))
"""


def write_synthetic_engine(engine: Path, gib: float, num_ranks: int) -> None:
    per_rank = int(gib * 2**30) // num_ranks
    nbytes = TENSOR_SHAPE[0] * TENSOR_SHAPE[1] * 2
    count = max(per_rank // nbytes, 1)
    engine.mkdir(parents=True, exist_ok=True)
    ranks = {str(r): {"synthetic": True} for r in range(num_ranks)}
    (engine / "config.json").write_text(json.dumps({"version": 1, "build_config": {}, "synthetic_benchmark_engine": True,
                                                           "ranks": ranks}))
    for r in range(num_ranks):
        header = {"__metadata__": {"format": "k3engine", "rank": str(r)}}
        header |= {f"w{i}": {"dtype": "BF16", "shape": list(TENSOR_SHAPE), "data_offsets": [i * nbytes, (i + 1) * nbytes]}
                   for i in range(count)}
        raw = json.dumps(header).encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        (engine / f"rank{r}").mkdir(exist_ok=True)
        with open(engine / f"rank{r}" / "weights.safetensors", "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for _ in range(count):
                f.write(os.urandom(nbytes))


def drop_from_page_cache(path: Path) -> int | None:
    """Evict a file's clean pages; returns the bytes still resident per `fincore` (None if unavailable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def child(mode: str, engine: Path, rank: int, device: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(engine), str(rank), device],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{mode} rank {rank} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def wait_ready(proc, socket_path: Path, timeout_s: float = 600) -> None:
    from k3runtime.dist.weight_store_client import WeightStoreError, store_status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"store exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if store_status(socket_path, timeout_s=2.0)["state"] == "ready":
                return
        except WeightStoreError:
            pass
        time.sleep(0.1)
    raise SystemExit("store not ready in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=engine_dir, help="an existing engine dir (default: write a synthetic one)")
    ap.add_argument("--gib", type=gib, default=2.5, help="synthetic engine size, all ranks together")
    ap.add_argument("--ranks", type=count, default=2, help="synthetic engine rank count")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=Path("/tmp/k3ws-bench"))
    ap.add_argument("--repeat", type=count, default=1, help="rounds of cold/warm/attach loads (median reported)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic engine")
    args = ap.parse_args()

    from k3runtime.dist.weight_store import shm_dir_for
    from k3runtime.dist.weight_store_proto import engine_ranks, weights_path

    engine = args.engine
    if engine is None:
        engine = args.work / "engine"
        t0 = time.perf_counter()
        write_synthetic_engine(engine, args.gib, args.ranks)
        emit(step="synthesize", engine=str(engine), seconds=round(time.perf_counter() - t0, 2))
    ranks = engine_ranks(engine)
    files = {r: weights_path(engine, r) for r in ranks}
    total = sum(p.stat().st_size for p in files.values())
    emit(step="engine", engine=str(engine), ranks=ranks, total_gib=round(total / 2**30, 3), device=args.device)

    disk, warm = [], []
    for _ in range(args.repeat):
        disk.append({}), warm.append({})
        for r in ranks:
            resident = drop_from_page_cache(files[r])
            disk[-1][r] = child("disk", engine, r, args.device)
            emit(step="cold_disk_load", rank=r, resident_bytes_before=resident, **disk[-1][r])
            warm[-1][r] = child("disk", engine, r, args.device)
            emit(step="warm_disk_load", rank=r, **warm[-1][r])

    name = f"bench-{os.getpid()}"
    socket_path = shm_dir_for(name) / "store.sock"
    resident = {r: drop_from_page_cache(p) for r, p in files.items()}
    t0 = time.perf_counter()
    store = subprocess.Popen([sys.executable, "-m", "k3runtime.dist.weight_store", str(engine), "--name", name],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cfg = args.work / "wsc.json"
    try:
        wait_ready(store, socket_path)
        emit(step="store_start_cold", seconds=round(time.perf_counter() - t0, 3), resident_bytes_before=resident,
             note="copy from disk + sha256 of source and copy")
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(json.dumps({"nodes": {"*": {"socket": str(socket_path), "ranks": ranks}}}))
        os.environ["K3_WEIGHT_STORE_CONFIG"] = str(cfg)
        att = []
        for _ in range(args.repeat):
            att.append({})
            for r in ranks:
                att[-1][r] = child("attach", engine, r, args.device)
                emit(step="attach", rank=r, **att[-1][r])
    finally:
        store.send_signal(signal.SIGTERM)
        rc = store.wait(60)
        left = shm_dir_for(name).exists()
        emit(step="store_stop", returncode=rc, shm_dir_left=left)
        cfg.unlink(missing_ok=True)
        if args.engine is None and not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)

    def worst(rounds, key):  # median over rounds of the slowest rank
        return statistics.median(max(rnd[r][key] for r in ranks) for rnd in rounds)

    cold, warm_s, att_s = worst(disk, "read_all_s"), worst(warm, "read_all_s"), worst(att, "read_all_s")
    emit(step="summary", device=args.device, total_gib=round(total / 2**30, 3),
         per_rank_gib=round(total / len(ranks) / 2**30, 3), cold_disk_s=round(cold, 3), warm_disk_s=round(warm_s, 3),
         attach_s=round(att_s, 3), attach_open_s=round(worst(att, "open_s"), 4),
         cold_disk_over_attach=round(cold / att_s, 2), warm_disk_over_attach=round(warm_s / att_s, 2),
         note="median over rounds of the slowest rank; *_s = open (load_file or attach) + copy of every byte into a "
              "ready buffer on --device")

if __name__ == "__main__":
    main()
