"""Timing helpers shared by the plugin benchmarks: CUDA-graph replays, L2 flushed, CUDA-event medians."""

from __future__ import annotations

import json
import statistics
import sys

import torch

_FLUSH: torch.Tensor | None = None


def emit(**rec) -> None:
    """One JSON line on stdout (and flushed, so a killed run keeps what it printed)."""
    print(json.dumps(rec, sort_keys=False), flush=True)
    sys.stdout.flush()


def _flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > 4x the H200's 60 MB L2
    _FLUSH.zero_()


def time_ms(fn, *, rep: int = 20, graph: bool = True, flush: bool = True) -> float:
    """Median ms of `fn` on the GPU; replayed from a CUDA graph when `graph` (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
        run()
        torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        if flush:
            _flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def interleaved_replays_us(replays: dict, *, rounds: int = 5, reps: int = 10) -> dict:
    """Median µs of each replay (a callable, e.g. a CUDA graph's replay) over `rounds` rounds that time every replay
    in turn (one untimed call, then `reps` timed one by one), so that a drift of the clocks falls on all alike."""
    times = {name: [] for name in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            one = []
            for _ in range(reps):
                start.record()
                replay()
                end.record()
                torch.cuda.synchronize()
                one.append(start.elapsed_time(end) * 1000)
            times[name].append(statistics.median(one))
    return {name: statistics.median(t) for name, t in times.items()}


def hbm_read_tbps() -> float:
    """HBM read bandwidth (TB/s): the sum of an 8 GiB bf16 tensor, as in ANCHORS.md."""
    x = torch.empty(4 * 2**30, dtype=torch.bfloat16, device="cuda").normal_()
    ms = time_ms(lambda: x.sum(), rep=10, graph=False, flush=False)
    del x
    torch.cuda.empty_cache()
    return 8 * 2**30 / (ms * 1e-3) / 1e12


def mma_tflops() -> float:
    """Dense bf16 tensor-core rate (TFLOP/s) cuBLAS reaches on this card now: an 8192³ matmul. The math floor of a
    kernel whose FLOPs come close to its bytes' (MLA decode at 96 heads) is its FLOPs at this rate."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, rep=10, flush=False)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-30)).item()


def _profiled(fn):
    """A torch profile (GPU activity) of one call of fn, after an unprofiled one (compiles, caches)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def cuda_events(fn) -> list:
    """The GPU events (kernels, copies) of one call of fn, after an unprofiled one, in order of start (user
    annotations, which span others, left out)."""
    return sorted((e for e in _profiled(fn).events()
                   if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)),
                  key=lambda e: e.time_range.start)


def top_kernels(fn, top: int = 80) -> list:
    """[kernel name, ms per step, launches per step] of the kernels taking most GPU time in one call of fn."""
    prof = _profiled(fn)
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return [["TOTAL", round(total, 3), sum(r[2] for r in rows)]] + [[k[:90], round(ms, 3), c] for k, ms, c in rows[:top]]
