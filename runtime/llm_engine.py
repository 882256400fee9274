"""One engine step loop: schedule -> apply swaps / reset slots -> run the graph -> sample -> update.

This is the only room that knows both the scheduler (token bookkeeping, no tensors) and the executor
(tensors, no bookkeeping); it turns a StepPlan into a StepBatch and sampled logits back into tokens.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .executor import Executor, StepBatch
from .kv_cache import CacheTensors, HostStore, PagePool, SlotPool
from .kv_cache.cache_tensors import CacheConfig
from .loader import KDA, MLA, load_rank
from .request import Request
from .sampler import sample
from .scheduler import Scheduler, StepPlan
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


class LLMEngine:
    def __init__(self, engine_dir, options: EngineOptions = EngineOptions()):
        self.rank = rank = load_rank(engine_dir, 0, options.device)
        if rank.world_size != 1:
            raise NotImplementedError(f"{engine_dir}: a {rank.world_size}-rank engine needs the multi-rank launcher")
        build, plan, facts = rank.build, rank.config["memory_plan"], rank.facts
        self.device = torch.device(options.device)
        self.page_size = build["page_size"]
        num_slots = options.num_slots or plan["num_slots"]
        kda_layers, mla_layers = rank.local_layers(KDA), rank.local_layers(MLA)
        tp = rank.config["mapping"]["tp_size"] if not rank.config["mapping"]["attention_dp"] else 1
        heads = facts.kda_num_heads // tp
        cache_cfg = CacheConfig(
            num_pages=options.num_pages or plan["num_pages"], num_slots=num_slots, num_mla_layers=len(mla_layers),
            mla_width=facts.mla_cache_width, num_kda_layers=len(kda_layers), kda_num_heads=heads,
            kda_head_k_dim=facts.kda_head_dim, kda_head_v_dim=facts.kda_head_dim,
            kda_conv_dim=3 * heads * facts.kda_head_dim, page_size=self.page_size, kda_conv_size=facts.kda_conv_size,
            kv_dtype=build["kv_dtype"], state_dtype=build["state_dtype"], conv_dtype=build["dtype"])
        self.cache = CacheTensors(cache_cfg, self.device)
        self.host_store = HostStore(self.cache, options.num_host_pages, options.num_host_slots) \
            if options.preemption_mode == "swap" else None
        self.executor = Executor(rank, self.cache)
        sched_cfg = SchedulerConfig(
            max_num_seqs=min(options.max_num_seqs or build["max_batch_size"], num_slots),
            max_num_batched_tokens=options.max_num_batched_tokens or build["max_num_tokens"],
            max_prefill_chunk=options.max_prefill_chunk or build["max_num_tokens"], page_size=self.page_size,
            preemption_mode=options.preemption_mode, num_host_pages=options.num_host_pages,
            num_host_slots=options.num_host_slots, max_model_len=build["max_seq_len"])
        self.scheduler = Scheduler(sched_cfg, PagePool(cache_cfg.num_pages, self.page_size), SlotPool(num_slots))
        self._ids = itertools.count()
        self.stats = {"steps": 0, "preemptions": 0, "swaps_out": 0, "tokens": 0}

    @property
    def eos_token_id(self) -> int | None:
        return self.rank.facts.eos_token_id

    def add_request(self, prompt_token_ids: list[int], params, request_id: str | None = None) -> Request:
        vocab = self.rank.facts.vocab_size
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

    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        self.stats["steps"] += 1
        self.stats["preemptions"] += len(plan.preempted_ids)
        self.stats["swaps_out"] += len(plan.swap_out)
        if plan.is_empty:
            self.scheduler.update(plan, {})
            return []
        if self.host_store is not None and (plan.swap_out or plan.swap_in):
            self.host_store.apply(plan.swap_out, plan.swap_in)
        self.cache.zero_slots(list(plan.reset_slot_ids))
        batch = self._batch(plan)
        logits = self.executor.run(batch)["logits"]
        sampled_items = [it for it in plan.items if it.sample]
        tokens = sample(logits, [it.params for it in sampled_items], [it.seed for it in sampled_items],
                        [it.sample_index for it in sampled_items])
        sampled = {it.request_id: t for it, t in zip(sampled_items, tokens)}
        finished = {r.request_id: r.finish_reason for r in self.scheduler.update(plan, sampled)}
        self.stats["tokens"] += plan.num_batched_tokens
        return [TokenEvent(rid, tok, finished.get(rid)) for rid, tok in sampled.items()]

    def _batch(self, plan: StepPlan) -> StepBatch:
        items = plan.items
        ids = list(itertools.chain.from_iterable(it.token_ids for it in items))
        lens = [it.num_tokens for it in items]
        cu = [0, *itertools.accumulate(lens)]
        max_pages = max(len(it.page_ids) for it in items)
        table = [list(it.page_ids) + [-1] * (max_pages - len(it.page_ids)) for it in items]
        sampled_rows = [cu[i + 1] - 1 for i, it in enumerate(items) if it.sample]
        d = self.device
        return StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=d),
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=d),
            slot_ids=torch.tensor([it.slot_id for it in items], dtype=torch.int64, device=d),
            context_lens=torch.tensor([it.start_pos + it.num_tokens for it in items], dtype=torch.int64, device=d),
            page_table=torch.tensor(table, dtype=torch.int64, device=d),
            logits_indices=torch.tensor(sampled_rows, dtype=torch.int64, device=d))

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
            self.cache.zero_slots([slot])
            chunk = min(self.scheduler.config.max_prefill_chunk, self.scheduler.config.max_num_batched_tokens)
            out = []
            for start in range(0, len(token_ids), chunk):
                part = token_ids[start:start + chunk]
                d, n = self.device, len(part)
                batch = StepBatch(
                    input_ids=torch.tensor(part, dtype=torch.int64, device=d),
                    cu_seqlens=torch.tensor([0, n], dtype=torch.int64, device=d),
                    slot_ids=torch.tensor([slot], dtype=torch.int64, device=d),
                    context_lens=torch.tensor([start + n], dtype=torch.int64, device=d),
                    page_table=torch.tensor([pages], dtype=torch.int64, device=d),
                    logits_indices=torch.arange(n, dtype=torch.int64, device=d))
                out.append(self.executor.run(batch)["logits"])
            return torch.cat(out)
        finally:
            pool.free(pages)
            slots.free(slot)
