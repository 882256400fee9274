"""The driver's step loop: schedule -> broadcast the step -> run this rank's share -> sample -> update.

The driver (rank 0) is the only process with a scheduler; every other rank runs `worker_loop` (runtime/dist/
worker.py) and executes the same `Step`s. With one rank there is no broadcast and no hand-off.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .kv_cache import PagePool, SlotPool
from .loader import load_rank
from .rank_runner import RankRunner, Step, cache_config
from .request import Request
from .sampler import sample
from .scheduler import Scheduler, ScheduledItem
from .scheduler_config import SchedulerConfig


@dataclass(frozen=True)
class EngineOptions:
    """Runtime sizes; None = the engine's memory plan / build limits."""

    device: str = "cpu"
    num_pages: int | None = None
    num_slots: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int | None = None
    preemption_mode: str = "recompute"
    num_host_pages: int = 0
    num_host_slots: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """A token appended to a request this step (finish_reason set on its last one)."""

    request_id: str
    token_id: int
    finish_reason: str | None


def open_rank(engine_dir, options: EngineOptions, rank: int = 0, comm=None) -> RankRunner:
    """Load `rank` of the engine with caches sized by `options` (or the engine's memory plan)."""
    engine = load_rank(engine_dir, rank, options.device)
    plan = engine.config["memory_plan"]
    cfg = cache_config(engine, num_pages=options.num_pages or plan["num_pages"],
                       num_slots=options.num_slots or plan["num_slots"])
    return RankRunner(engine, cfg, comm, num_host_pages=options.num_host_pages if options.preemption_mode == "swap" else 0,
                      num_host_slots=options.num_host_slots if options.preemption_mode == "swap" else 0)


def sample_step(step: Step, logits: torch.Tensor) -> torch.Tensor:
    """Token ids [M] for the step's sampled items (the same on every rank that holds the logits)."""
    items = [it for it in step.items if it.sample]
    return torch.tensor(sample(logits, [it.params for it in items], [it.seed for it in items],
                               [it.sample_index for it in items]), dtype=torch.int64)


class LLMEngine:
    def __init__(self, engine_dir, options: EngineOptions = EngineOptions()):
        from .loader import read_engine_config

        config = read_engine_config(engine_dir)
        self.world_size = config["mapping"]["world_size"]
        comm = None
        if self.world_size > 1:
            from .dist.launch import driver_comm

            comm = driver_comm(config, options.device, options)
        self.runner = runner = open_rank(engine_dir, options, 0, comm)
        self.comm = comm
        build, cache = runner.engine.build, runner.cache.config
        self.device, self.page_size = runner.device, build["page_size"]
        sched_cfg = SchedulerConfig(
            max_num_seqs=min(options.max_num_seqs or build["max_batch_size"], cache.num_slots),
            max_num_batched_tokens=options.max_num_batched_tokens or build["max_num_tokens"],
            max_prefill_chunk=options.max_prefill_chunk or build["max_num_tokens"], page_size=self.page_size,
            preemption_mode=options.preemption_mode, num_host_pages=options.num_host_pages,
            num_host_slots=options.num_host_slots, max_model_len=build["max_seq_len"])
        self.scheduler = Scheduler(sched_cfg, PagePool(cache.num_pages, self.page_size), SlotPool(cache.num_slots))
        self._ids = itertools.count()
        self.stats = {"steps": 0, "preemptions": 0, "swaps_out": 0, "tokens": 0}
        self._last_stage_rank = self.world_size - config["mapping"]["tp_size"]

    @property
    def facts(self):
        return self.runner.engine.facts

    @property
    def eos_token_id(self) -> int | None:
        return self.facts.eos_token_id

    def add_request(self, prompt_token_ids: list[int], params, request_id: str | None = None) -> Request:
        vocab = self.facts.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]!r} outside the vocabulary 0..{vocab - 1}")
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids), params,
                      eos_token_id=None if params.ignore_eos else self.eos_token_id)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _execute(self, step: Step) -> torch.Tensor:
        """Run a step on every rank; returns sampled ids [M] (or all logits [N, V] in score mode)."""
        if self.comm is not None:
            self.comm.broadcast_step(step)
        logits = self.runner.run(step)
        if logits is not None:
            return logits if step.all_logits else sample_step(step, logits)
        ndim, dtype = (2, torch.float32) if step.all_logits else (1, torch.int64)
        return self.comm.recv_result(self._last_stage_rank, ndim, dtype)

    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        self.stats["steps"] += 1
        self.stats["preemptions"] += len(plan.preempted_ids)
        self.stats["swaps_out"] += len(plan.swap_out)
        if plan.is_empty:
            self.scheduler.update(plan, {})
            return []
        tokens = self._execute(Step.from_plan(plan)).tolist()
        sampled = {it.request_id: t for it, t in zip((it for it in plan.items if it.sample), tokens)}
        finished = {r.request_id: r.finish_reason for r in self.scheduler.update(plan, sampled)}
        self.stats["tokens"] += plan.num_batched_tokens
        return [TokenEvent(rid, tok, finished.get(rid)) for rid, tok in sampled.items()]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] of every position of one sequence, run outside the scheduler."""
        pool, slots = self.scheduler.page_pool, self.scheduler.slot_pool
        pages = pool.allocate(math.ceil(len(token_ids) / self.page_size))
        slot = slots.allocate()
        if pages is None or slot is None:
            if pages:
                pool.free(pages)
            if slot is not None:
                slots.free(slot)
            raise RuntimeError("score: no free pages or KDA slot (the engine is busy; retry when idle)")
        try:
            chunk = min(self.scheduler.config.max_prefill_chunk, self.scheduler.config.max_num_batched_tokens)
            out = []
            for start in range(0, len(token_ids), chunk):
                part = tuple(token_ids[start:start + chunk])
                item = ScheduledItem(request_id="score", token_ids=part, start_pos=start, num_tokens=len(part),
                                     sample=False, slot_id=slot, page_ids=tuple(pages), params=None, seed=0,
                                     sample_index=0)
                out.append(self._execute(Step((item,), reset_slot_ids=(slot,) if start == 0 else (), all_logits=True)))
            return torch.cat(out)
        finally:
            pool.free(pages)
            slots.free(slot)

    def shutdown(self) -> None:
        """Release the worker ranks (they leave their loop); a no-op with one rank."""
        if self.comm is not None:
            from .dist.launch import release_workers

            release_workers(self.comm)
            self.comm = None
