"""Benchmark `k3build convert` against `cp -r` of the same checkpoint, and its peak RSS, at two sizes.

For each size: synth a checkpoint (preset `small` with --num-layers/--num-experts overrides), then, in one run:
evict the source's pages (posix_fadvise DONTNEED after a sync: "cold-ish", the device cache may still hold
them), time `cp -r` + fsync of the copies, evict again, time `k3build convert` (which fsyncs its output),
and sample the convert's process tree (parent, forkserver, workers) for peak RSS. Prints JSON lines; deletes everything it wrote
(in a directory of its own under --workdir; what else is there stays).

    python tools/bench_convert.py --workdir /tmp/bench --sizes 4x16,4x64 --tp-size 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from arg_types import count


def _evict(path: Path) -> None:
    """Drop clean page-cache pages of every file under path (no root needed, unlike drop_caches)."""
    os.sync()
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _status_kib(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _run(cmd: list[str]) -> tuple[float, int, int]:
    """(seconds, peak summed RSS of the process tree, sum of per-process VmHWM: exact per process, an upper bound for the tree).

    Workers live under a forkserver, outside wait4's accounting, so the tree is sampled at 10 Hz.
    """
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tree_peak, hwm = 0, {}
    while proc.poll() is None:
        pids = _tree(proc.pid)
        tree_peak = max(tree_peak, sum(_status_kib(p, "VmRSS:") for p in pids))
        for p in pids:
            hwm[p] = max(hwm.get(p, 0), _status_kib(p, "VmHWM:"))
        time.sleep(0.1)
    dt = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-2000:]}")
    return dt, tree_peak * 1024, sum(hwm.values()) * 1024


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as h:
                os.fsync(h.fileno())


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_size(work: Path, layers: int, experts: int, convert_args: list[str]) -> dict:
    from k3build.config import _k3_layer_types, preset
    from k3build.schema import checkpoint_tensors
    import dataclasses

    cfg = dataclasses.replace(preset("small"), num_hidden_layers=layers, layer_types=_k3_layer_types(layers),
                              num_experts=experts, num_experts_per_token=min(16, experts))
    sizes = {"BF16": 2, "F32": 4, "U8": 1}
    largest = max(math.prod(s) * sizes[d] for s, d in checkpoint_tensors(cfg).values())
    src, copy, out = work / "ckpt", work / "copy", work / "out"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "k3build.cli", "synth", str(src), "--preset", "small", "--shards", "4",
                    "--num-layers", str(layers), "--num-experts", str(experts)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    synth_s = time.perf_counter() - t0
    try:
        _evict(src)
        t = time.perf_counter()
        cp_s, _, _ = _run(["cp", "-r", str(src), str(copy)])
        _fsync_tree(copy)
        cp_sync_s = time.perf_counter() - t
        shutil.rmtree(copy)
        _evict(src)
        conv_s, rss, hwm = _run([sys.executable, "-m", "k3build.cli", "convert", str(src), str(out), *convert_args])
        row = {"bench": "bench_convert", "layers": layers, "experts": experts, "ckpt_bytes": _bytes(src),
               "ckpt_gib": round(_bytes(src) / 2**30, 2), "largest_tensor_mib": round(largest / 2**20, 1),
               "out_bytes": _bytes(out), "convert_args": " ".join(convert_args), "synth_s": round(synth_s, 1),
               "cp_s": round(cp_s, 2), "cp_fsync_s": round(cp_sync_s, 2), "convert_s": round(conv_s, 2),
               "ratio_convert_over_cp_fsync": round(conv_s / cp_sync_s, 3),
               "ratio_convert_over_cp": round(conv_s / cp_s, 3), "convert_tree_peak_rss_gib": round(rss / 2**30, 3),
               "convert_sum_process_hwm_gib": round(hwm / 2**30, 3),
               "rss_goal_gib": round(1.5 + 2 * largest / 2**30, 3)}
    finally:
        for p in (src, copy, out):
            shutil.rmtree(p, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/k3_bench_convert")
    ap.add_argument("--sizes", default="4x16,4x64", help="LAYERSxEXPERTS per size, comma separated")
    ap.add_argument("--tp-size", type=count, default=2)
    ap.add_argument("--workers", type=count, default=1)
    args = ap.parse_args()
    try:
        sizes = [tuple(int(x) for x in spec.split("x")) for spec in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        ap.error(f"--sizes {args.sizes!r}: expected LAYERSxEXPERTS sizes of counts >= 1, comma separated (4x16,4x64)")
    # the run's files go in a fresh directory of its own under --workdir, which may hold anything else
    base = Path(args.workdir)
    made = [] if base.is_dir() else [base, *(p for p in base.parents if not p.exists())]
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="k3_bench_convert-", dir=base))
    print(json.dumps({"bench": "bench_convert", "host": platform.node(), "cpus": os.cpu_count(),
                      "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "free_disk_gib": round(shutil.disk_usage(work).free / 2**30, 1)}), flush=True)
    try:
        for layers, experts in sizes:
            row = bench_size(work, layers, experts, ["--tp-size", str(args.tp_size), "--workers", str(args.workers)])
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for d in made:  # the directories this run made for --workdir, where nothing else went meanwhile
            try:
                d.rmdir()
            except OSError:
                break


if __name__ == "__main__":
    main()
