"""The host's share of a decode step, on the host that runs it: what async scheduling has to hide (JSON lines).

    python tools/bench_scheduler.py [--batches 32,64,128] [--context 8192] [--steps 50]

N requests of CONTEXT prompt tokens are prefilled through the real scheduler (no model: each step's sampled ids
are made up), then decode steps are timed, medians over STEPS: schedule_ms (Scheduler.schedule), step_ms
(Step.from_plan), update_ms (Scheduler.update with the step's ids), and, as the baseline, fill_ms
(cuda_graph.fill_rows for the same rows into host buffers of the graphs' shape: the CUDA-graph staging). host_ms is
the scheduler's three parts; host_x_fill is host_ms / fill_ms. The synchronous engine does all of it between two
GPU steps; with async scheduling it runs while the GPU does the next one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3runtime.cuda_graph import fill_rows
from k3runtime.kv_cache import PagePool, SlotPool
from k3runtime.rank_runner import Step
from k3runtime.request import Request
from k3runtime.sampling_params import SamplingParams
from k3runtime.scheduler import Scheduler
from k3runtime.scheduler_config import SchedulerConfig

from arg_types import count, counts

PAGE = 64


def _max_pages(context: int) -> int:
    return -(-2 * context // PAGE)


def _prefilled(n: int, context: int, steps: int) -> Scheduler:
    # the requests prefilled first decode while the others prefill: room for twice the context each, so that no
    # request is preempted
    cfg = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=16384, max_prefill_chunk=8192, page_size=PAGE)
    sched = Scheduler(cfg, PagePool(n * _max_pages(context), PAGE), SlotPool(n))
    params = SamplingParams(max_tokens=context, temperature=0, ignore_eos=True)
    for i in range(n):
        sched.add(Request(f"r{i}", [1 + i % 500] * context, params))
    while any(r.num_computed_tokens < context for r in sched.requests.values()):
        plan = sched.schedule()
        sched.update(plan, {it.request_id: 7 for it in plan.items if it.sample})
    return sched


def bench(n: int, context: int, steps: int) -> dict:
    sched = _prefilled(n, context, steps)
    parts = {"schedule_ms": [], "step_ms": [], "update_ms": [], "fill_ms": []}
    cols, pages = torch.zeros(3, n, dtype=torch.int64), torch.zeros(n, _max_pages(context), dtype=torch.int64)
    written = [None] * n
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        step = Step.from_plan(plan)
        t2 = time.perf_counter()
        rows = [(it.token_ids[0], it.slot_id, it.start_pos + 1, it.page_ids) for it in step.items]
        t3 = time.perf_counter()
        fill_rows(cols, pages, rows, spare_slot=n, spare_page=0, written=written)
        t4 = time.perf_counter()
        sched.update(plan, {it.request_id: 7 for it in plan.items if it.sample})
        t5 = time.perf_counter()
        if len(plan.items) != n or any(it.num_tokens != 1 for it in plan.items):
            raise RuntimeError(f"step of {len(plan.items)} items is not a decode step of {n}")
        for key, (a, b) in zip(parts, ((t0, t1), (t1, t2), (t4, t5), (t3, t4))):
            parts[key].append((b - a) * 1e3)
    rec = {key: round(statistics.median(v), 4) for key, v in parts.items()}
    host = rec["schedule_ms"] + rec["step_ms"] + rec["update_ms"]
    return dict(bench="scheduler_host", batch=n, context=context, steps=steps, **rec, host_ms=round(host, 4),
                host_x_fill=round(host / rec["fill_ms"], 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=counts, default="32,64,128")
    ap.add_argument("--context", type=count, default=8192)
    ap.add_argument("--steps", type=count, default=50)
    args = ap.parse_args()
    print(json.dumps({"bench": "scheduler_env", "torch": torch.__version__, "threads": torch.get_num_threads()}))
    for n in args.batches:
        print(json.dumps(bench(n, args.context, args.steps)), flush=True)


if __name__ == "__main__":
    main()
