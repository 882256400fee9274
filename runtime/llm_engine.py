"""The driver's step loop: schedule -> broadcast the step -> run this rank's share -> sample -> update.

The driver (rank 0) is the only process with a scheduler; every other rank runs `worker_loop` (runtime/dist/
launch.py) and executes the same `Step`s. With one rank there is no broadcast and no hand-off.

Async scheduling (`EngineOptions.async_scheduling`; on by default on CUDA GPUs, with pipeline stages or
attention-DP when asked for: engine_options.resolve_async_scheduling): a step is scheduled and launched before the
previous step's tokens reach the host: its decoding requests take those tokens on the device (`Step.feed`; the rank
that samples them, the driver or with pipeline stages the last stage's first rank, broadcasts them to the other
ranks on the device, `share_tokens`; under attention-DP each DP rank feeds its own and sends them to the driver
once it has launched the next step), and the host reads them, and updates the scheduler, while the new step runs.
The GPU then does not wait for the host's share of a step (scheduling, staging, sampling's launches, the update);
`step()` returns the previous step's tokens, and a request that stops on a token (EOS, stop ids or strings) runs
one step more, its extra token dropped. Swaps to the host store still wait for the step in flight (the pages they
copy may be its).
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, replace

import torch

from .dist.comm import collective_timeout, sampling_rank
from .engine_options import (EngineOptions, cache_sizes, check_build_limits, check_ids, host_sizes,
                             resolve_async_scheduling)
from .kv_cache import PagePool, SlotPool
from .loader import EngineError, load_rank
from .logprobs import TokenLogprobs, rows_shape, sampled_params, step_logprobs, unpack
from .micro_batch import StageCost, micro_batch_count
from .penalties import SeenCounts, adjust_logits
from .rank_runner import RankRunner, Step, shared_bucket, wait_for
from .request import PLACEHOLDER, Request
from .sampler import sample_tokens
from .sampling_params import SamplingParams
from .scheduler import Scheduler, ScheduledItem, StepPlan
from .scheduler_config import SchedulerConfig
from .upload import to_device


@dataclass(frozen=True)
class TokenEvent:
    """A token appended to a request this step (finish_reason set on its last one)."""

    request_id: str
    token_id: int
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None  # when its request asked (SamplingParams.logprobs)
    # on a request's first token, when it asked (SamplingParams.prompt_logprobs): None for the prompt's first token,
    # then each next one's
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


def dummy_step(config: dict, options: EngineOptions) -> Step:
    """One throw-away token on the spare page/slot: an attention-DP rank with no work of its own still has to
    meet the others in every expert exchange."""
    pages, slots = cache_sizes(config, options)
    item = ScheduledItem(request_id="", token_ids=(0,), start_pos=0, num_tokens=1, sample=False, slot_id=slots,
                         page_ids=(pages,), params=None, seed=0, sample_index=0)
    return Step((item,), reset_slot_ids=(slots,), idle=True)


def open_rank(engine_dir, options: EngineOptions, rank: int = 0, comm=None) -> RankRunner:
    """Load `rank` of the engine with caches sized by `options` (or the engine's memory plan)."""
    engine = load_rank(engine_dir, rank, options.device, progress=options.load_progress, verify=options.verify_weights)
    if comm is not None:
        comm.wait_loaded()  # the ranks finish reading minutes apart; what follows runs under the step timeout
    pages, slots = cache_sizes(engine.config, options)
    graphs = options.cuda_graphs and next(iter(engine.weights.values())).device.type == "cuda"
    # dummy_step's page and slot (attention-DP), where captured decode steps' padding rows write (graphs)
    spare = 1 if engine.config["mapping"]["attention_dp"] or graphs else 0
    cfg = engine.cache_config(num_pages=pages + spare, num_slots=slots + spare)
    host_pages, host_slots = host_sizes(engine.config, options)
    return RankRunner(engine, cfg, comm, num_host_pages=host_pages, num_host_slots=host_slots,
                      spare=(pages, slots) if spare else None, cuda_graphs=graphs)


def sample_step(step: Step, logits: torch.Tensor, fed: torch.Tensor | None = None,
                seen: SeenCounts | None = None) -> torch.Tensor:
    """Token ids [M] int64 on the logits' device, for the step's sampled items (the same on every rank that holds
    the logits); no host sync. fed: the previous step's sampled ids (async scheduling), where the penalties of
    a row find its last output token; seen: the penalized requests' counts this rank keeps (the rank that samples
    every step of theirs must pass the same one; None: a new one, for items whose SeenTokens are all fresh)."""
    items = [it for it in step.items if it.sample]
    params = [it.params for it in items]
    logits = logits[:len(items)]  # the prompt logprobs' rows follow the sampled ones
    logits = adjust_logits(logits, params, [it.seen for it in items], _pending(step, fed), [it.banned for it in items],
                           [it.slot_id for it in items], seen)
    return sample_tokens(logits, params, [it.seed for it in items], [it.sample_index for it in items])


def _pending(step: Step, fed: torch.Tensor | None) -> torch.Tensor | None:
    """[M] on fed's device: the output token each penalized sampled item's SeenTokens lacks (its fed input), -1
    where none; None when no item lacks one."""
    src, rows = dict(step.feed), []
    for i, it in enumerate(step.items):
        if not it.sample:
            continue
        known = it.seen.end if it.seen is not None else it.sample_index
        late = it.sample_index - known
        if late not in (0, 1) or (late and (i not in src or fed is None)):
            raise ValueError(f"request {it.request_id!r}: its penalties see {known} output tokens "
                             f"before token {it.sample_index}, and the step feeds it {'one' if i in src else 'none'}")
        rows.append(src[i] if late else -1)
    if max(rows, default=-1) < 0:
        return None
    rows = to_device(rows, fed.device)
    return torch.where(rows >= 0, fed.index_select(0, rows.clamp(min=0)), -1)


def wants_rows(step_or_plan) -> bool:
    """Whether an item of the step asks for logprobs (of its sampled token, or of its prompt): then their rows
    follow the step's ids wherever they go."""
    return not getattr(step_or_plan, "all_logits", False) and rows_shape(step_or_plan.items, 1) is not None


def sample_with_logprobs(step: Step, logits: torch.Tensor, fed: torch.Tensor | None = None,
                         seen: SeenCounts | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rank that samples a step: its ids [M] on the device, and their logprobs' rows when an item asked (the
    model's raw ones: from the logits before any penalty). fed, seen: as sample_step's."""
    tokens = sample_step(step, logits, fed, seen)
    return tokens, step_logprobs(logits, tokens, step.items)


def _reporters(sched: Scheduler, plan: StepPlan) -> dict[str, Request]:
    """The plan's requests that asked for prompt logprobs, by id, as the scheduler holds them now."""
    return {it.request_id: sched.get(it.request_id) for it in plan.items
            if it.params is not None and it.params.prompt_logprobs is not None}


def empty_sampled(step: Step, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A rank that receives a step's samples: buffers for its ids, and for their logprobs' rows when an item
    asked (rows_shape: the sampler's step_logprobs gives that shape)."""
    shape = rows_shape(step.items, vocab)
    return (torch.empty(len(sampled_params(step.items)), dtype=torch.int64, device=device),
            None if shape is None else torch.empty(shape, dtype=torch.float64, device=device))


class HostCopy:
    """A tensor's values on their way to the host: a non-blocking copy into pinned memory, queued right after the
    work that makes them. Reading them waits for that copy alone, where t.tolist() would queue its copy behind
    everything launched since (with async scheduling: the whole next step)."""

    def __init__(self, t: torch.Tensor):
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = t, None

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        """The values on the host; timeout_s: poll for them, TimeoutError past it (a multi-rank step whose
        collectives hang)."""
        if self.ready is not None:
            if timeout_s is None:
                self.ready.synchronize()
            else:
                wait_for(self.ready.query, timeout_s, "a decode step")
        return self.host

    def tolist(self, timeout_s: float | None = None) -> list:
        return self.wait(timeout_s).tolist()


@dataclass(frozen=True)
class _InFlight:
    """An async step launched and not yet updated: its plan, its sampled ids on the device (the next step's
    inputs) and on their way to the host; both None for another attention-DP rank's step, whose rank keeps its
    ids and sends them once it has launched its next step."""

    plan: StepPlan
    tokens: torch.Tensor | None
    host: HostCopy | None
    requests: tuple[Request, ...]  # of the sampled items, in order
    logprobs: HostCopy | None = None  # step_logprobs' rows, when an item asked for them
    reporters: dict[str, Request] | None = None  # _reporters: its requests that asked for prompt logprobs


class LLMEngine:
    def __init__(self, engine_dir, options: EngineOptions = EngineOptions()):
        from .loader import read_engine_config

        from .dist.exchange import choose_backend

        config = read_engine_config(engine_dir)
        # before any weight is read: a backend that cannot run (DeepEP missing or too small) fails here
        self.expert_backend = choose_backend(config, options.enable_deepep)
        mapping = config["mapping"]
        options = resolve_async_scheduling(options, mapping)
        check_build_limits(options, config, engine_dir)
        num_pages, num_slots = cache_sizes(config, options)
        self.config, self.options = config, options
        self.world_size = mapping["world_size"]
        # Attention-DP: each rank of the stage serves its own requests, so each gets its own scheduler.
        self.dp_size = mapping["tp_size"] if mapping["attention_dp"] else 1
        if self.dp_size > 1 and mapping["pp_size"] > 1:
            raise EngineError(f"{engine_dir}: attention-DP with pipeline parallelism is not supported (k3build refuses "
                              "this mapping now); convert and build again with --pp-size 1, or without --attention-dp")
        comm = None
        if self.world_size > 1:
            from .dist.launch import driver_comm

            comm = driver_comm(config, options.device, options)
        self.runner = runner = open_rank(engine_dir, options, 0, comm)
        self.comm = comm
        if comm is not None:
            comm.opened = True
        # generation_config.json's, recorded by k3build build (engine_dir checked them): a request stops on every
        # EOS id, and takes the sampling fields where it gives none (GENERATION_DEFAULTS)
        generation = config.get("generation_config") or {}
        eos = {runner.engine.facts.eos_token_id, *generation.get("eos_token_ids", ())} - {None}
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self.sampling_defaults: dict = dict(generation.get("sampling", {}))
        # held around every exchange with the workers (step, score, shutdown), and by the keep-alive between them
        self._comm_lock = threading.Lock()
        # before the keep-alive starts: its thread reads _broken (can_send) and sets both (on_error) from its first tick
        self._broken = False  # an async step failed (_guarded), or a step of several ranks
        # the error of a keep-alive that failed between steps (a worker gone or hung): the engine is broken
        self.failure: BaseException | None = None
        if comm is not None:
            from .dist.keep_alive import KeepAlive

            comm.keep_alive = KeepAlive(comm, self._comm_lock, lambda: not self._broken, self._workers_lost)
        build = runner.engine.build
        self.device, self.page_size = runner.device, build["page_size"]
        host_pages, host_slots = host_sizes(config, options)
        sched_cfg = SchedulerConfig(
            max_num_seqs=min(options.max_num_seqs or build["max_batch_size"], num_slots),
            max_num_batched_tokens=options.max_num_batched_tokens or build["max_num_tokens"],
            max_prefill_chunk=options.max_prefill_chunk or build["max_num_tokens"], page_size=self.page_size,
            preemption_mode=options.preemption_mode, num_host_pages=host_pages, num_host_slots=host_slots,
            max_model_len=build["max_seq_len"],
            async_scheduling=options.async_scheduling)
        self.schedulers = [Scheduler(sched_cfg, PagePool(num_pages, self.page_size), SlotPool(num_slots))
                           for _ in range(self.dp_size)]
        self.scheduler = self.schedulers[0]
        self._owner: dict[str, Scheduler] = {}
        self._ids = itertools.count()
        self.stats = {"steps": 0, "preemptions": 0, "swaps_out": 0, "tokens": 0}
        self._last_stage_rank = sampling_rank(mapping)
        # async scheduling: each DP rank's launched step; whether the other DP ranks owe their last step's ids
        self._in_flight: list[_InFlight | None] = [None] * self.dp_size
        self._owed = False
        self._held_events: list[TokenEvent] = []  # an in-flight step's, read early (score())
        self._prompt_logprobs: dict[Request, list[TokenLogprobs]] = {}  # prompt rows kept until the first token
        self._seen = SeenCounts(num_slots)  # the penalties' counts of the requests this rank samples (DP rank 0's)
        self.pp_size = mapping["pp_size"]
        # pipeline stages: what a micro-batch costs a stage, to choose how many a step is cut into
        self._stage_cost = StageCost.from_engine(runner.engine.weights, config["pretrained_config"],
                                                 runner.cache.config) if self.pp_size > 1 else None

    def _workers_lost(self, error: BaseException) -> None:
        """KeepAlive's on_error (the comm lock held): nothing more is exchanged with the workers."""
        self.failure = error
        self._break()

    def _break(self, error: BaseException | None = None) -> None:
        """A step failed (with `error`): nothing more is exchanged with the other ranks, not even a release
        (comm.broken) while they may be inside the step's collectives; this process's exit ends their wait. An error
        of a collective that lost another rank is raised again naming that rank (gloo's or NCCL's text names none)."""
        self._broken = True
        if self.comm is not None:
            self.comm.broken = True
            if error is not None and (lost := self.comm.lost(error)) is not None:
                raise lost from error

    def _check_usable(self) -> None:
        if self.failure is not None:  # its text kept: launch.run names the rank from it
            raise RuntimeError(f"the workers stopped answering between steps: {self.failure}") from self.failure
        if self._broken:
            raise RuntimeError("the engine failed in an earlier step; shut it down")

    @property
    def facts(self):
        return self.runner.engine.facts

    @property
    def eos_token_id(self) -> int | None:
        """config.json's EOS id (vLLM's primary one); eos_token_ids has generation_config.json's too."""
        return self.facts.eos_token_id

    def _check_ids(self, token_ids: list[int], field: str) -> None:
        check_ids(token_ids, self.facts.vocab_size, field)

    def add_request(self, prompt_token_ids: list[int], params, request_id: str | None = None) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if params.n != 1:  # one request is one choice; LLM.generate and the servers add each of n
            raise ValueError(f"n: a request is one choice, got n={params.n}; add params.choices() one by one "
                             "(LLM.generate does)")
        self._check_ids(prompt_token_ids, "prompt_token_ids")
        vocab = self.facts.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} outside the vocabulary 0..{vocab - 1}")
        # banned under min_tokens by flat index row * V + id (penalties._ban): an id past the vocabulary would land
        # in another request's row, or past the logits and fail the step of every request
        self._check_ids(list(params.stop_token_ids), "stop_token_ids")
        if request_id is not None and request_id in self._owner:  # live on any attention-DP rank
            raise ValueError(f"request_id: {request_id!r} is already live")
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids), params,
                      eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
                      eos_token_id=None if params.ignore_eos else self.eos_token_id)
        # Least-loaded attention-DP rank (the only one without attention-DP).
        sched = min(self.schedulers, key=lambda s: len(s.requests))
        sched.add(req)
        self._owner[req.request_id] = sched
        return req

    def abort(self, request_id: str) -> None:
        sched = self._drop_held(request_id)
        if sched is not None:
            sched.abort(request_id)

    def finish(self, request_id: str, reason: str) -> None:
        sched = self._drop_held(request_id)
        if sched is not None:
            sched.finish(request_id, reason)

    def _drop_held(self, request_id: str) -> Scheduler | None:
        """A request ended by the caller gets no more tokens, also none landed early (score()), and its prompt
        logprobs are not kept; returns the scheduler that owned it (None: none does)."""
        self._held_events = [ev for ev in self._held_events if ev.request_id != request_id]
        sched = self._owner.pop(request_id, None)
        if sched is not None:
            self._prompt_logprobs.pop(sched.get(request_id), None)
        return sched

    def has_unfinished(self) -> bool:
        """Requests left, or (async scheduling) a launched step or its tokens not yet returned by step()."""
        return any(s.has_unfinished() for s in self.schedulers) or any(self._in_flight) \
            or bool(self._held_events)

    def _execute(self, steps: tuple[Step, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Run one step per attention-DP rank on every rank; returns, per DP rank, its sampled ids [M]
        (or all logits [N, V] in score mode), and their logprobs' rows (step_logprobs; None when none asked)."""
        owes = self.options.async_scheduling and len(steps) > 1  # attention-DP ranks send what they owe (below)
        if owes and any(self._in_flight[1:]):
            raise RuntimeError("attention-DP steps in flight: collect them (_collect) before a step of all ranks")
        if self.comm is not None:
            self.comm.broadcast_step(steps)
        step = steps[0]
        logits = self.runner.run(step)
        logprobs = [None] * len(steps)
        if logits is None:  # pipeline stages: the last stage's
            results = [self.comm.recv_result(self._last_stage_rank)]
            if wants_rows(step):
                logprobs[0] = self.comm.recv_result(self._last_stage_rank)
        elif step.all_logits:
            results = [logits]
        else:
            tokens, logprobs[0] = sample_with_logprobs(step, logits, seen=self._seen)
            results = [tokens]
        # Under attention-DP (pp = 1) DP rank d is global rank d and reports its own tokens (or its logits).
        if owes:
            # ...with async scheduling once it has launched its next step: what comes now is what it owed
            # (score() collected every step in flight first, so those are idle steps' ids: none)
            if self._owed:
                for d in range(1, len(steps)):
                    if self.comm.recv_result(d).numel():
                        raise RuntimeError(f"attention-DP rank {d} sent ids where it owed an idle step's (none)")
            self._owed = True
            return results, logprobs
        for d in range(1, len(steps)):
            results.append(self.comm.recv_result(d))
            if wants_rows(steps[d]):
                logprobs[d] = self.comm.recv_result(d)
        return results, logprobs

    def step(self) -> list[TokenEvent]:
        """One engine step; the tokens it appended (async scheduling: the previous step's)."""
        with self._comm_lock:
            return self._step()

    def _step(self) -> list[TokenEvent]:
        if self.options.async_scheduling:
            return self._guarded(self._step_async)
        self._check_usable()
        plans = self._schedule()
        if all(p.is_empty for p in plans):
            for s, p in zip(self.schedulers, plans):
                s.update(p, {})
            return []
        events = []
        try:
            results, logprobs = self._execute(self._steps(plans))
            # on a GPU the host waits here: a CUDA error or a Ctrl-C of the step surfaces in these reads
            tokens = [t.tolist() for t in results]
            rows = [lp.tolist() if lp is not None else None for lp in logprobs]
        except BaseException as e:  # a failing model or sampler, a KeyboardInterrupt
            if self.comm is None:  # its requests re-prefill; without this every later schedule() refuses
                for sched, plan in zip(self.schedulers, plans):
                    sched.discard(plan)
            else:  # other ranks may be inside the step
                self._break(e)
            raise
        for d, (sched, plan) in enumerate(zip(self.schedulers, plans)):
            lps, prompts = self._logprobs(plan, rows[d], _reporters(sched, plan))
            sampled, finished = self._update(sched, plan, tokens[d])
            self.stats["tokens"] += plan.num_batched_tokens
            events += [TokenEvent(rid, tok, finished.get(rid), lp, pl)
                       for (rid, tok), lp, pl in zip(sampled.items(), lps, prompts)]
        return events

    def _logprobs(self, plan: StepPlan, rows: list[list[float]] | None, reporters: dict[str, Request]
                  ) -> tuple[list[TokenLogprobs | None], list[tuple | None]]:
        """Each sampled item's logprobs (None where its request did not ask, or no row came), and its prompt's
        (SamplingParams.prompt_logprobs; None first, for the prompt's first token): only on a request's first
        token, the rows of its earlier steps kept until then. reporters: _reporters(plan) when it was scheduled,
        so that rows of a request ended meanwhile go nowhere, also not to a new one under its id."""
        items = [it for it in plan.items if it.sample]
        lps = [None] * len(items)
        if rows is not None:
            lps, prompt = unpack(rows, plan.items)
            for rid, entries in prompt:
                if not reporters[rid].is_finished:
                    self._prompt_logprobs.setdefault(reporters[rid], []).extend(entries)
        firsts = [(None, *self._prompt_logprobs.pop(reporters[it.request_id], ()))
                  if it.sample_index == 0 and it.params.prompt_logprobs is not None else None for it in items]
        return lps, firsts

    def _update(self, sched: Scheduler, plan: StepPlan, tokens: list[int]) -> tuple[dict[str, int], dict[str, str]]:
        """A step's sampled tokens (in the order of its sampled items) into its scheduler: (token by request id,
        finish reason by request id of those that ended), the ended ones no longer owned."""
        sampled = {it.request_id: t for it, t in zip((it for it in plan.items if it.sample), tokens)}
        finished = {r.request_id: r.finish_reason for r in sched.update(plan, sampled)}
        for r in finished:
            self._owner.pop(r, None)
        return sampled, finished

    def _step_async(self) -> list[TokenEvent]:
        """Schedule and launch a step, then read the previous step's tokens (waiting for that step only) and
        update the schedulers with them, while the new one runs. Attention-DP: every DP rank feeds its own
        previous samples, and sends them to the driver once it has launched the new step."""
        plans = self._schedule()
        launched, remote = [None] * self.dp_size, None
        # a step, or (attention-DP) idle steps only to collect the other DP ranks' ids
        if not all(p.is_empty for p in plans) or any(self._in_flight[1:]):
            tokens, logprobs, remote = self._launch(self._steps(plans))
            for d, (sched, plan) in enumerate(zip(self.schedulers, plans)):
                if not plan.is_empty:
                    # the sampled requests as objects: one ended meanwhile and a new one under its id are told apart
                    sampled = tuple(sched.get(it.request_id) for it in plan.items if it.sample)
                    launched[d] = _InFlight(plan, *((tokens, HostCopy(tokens)) if d == 0 else (None, None)), sampled,
                                            HostCopy(logprobs) if d == 0 and logprobs is not None else None,
                                            _reporters(sched, plan))
                    self.stats["tokens"] += plan.num_batched_tokens
        events, self._held_events = self._held_events + self._land(remote), []
        for sched, plan, flight in zip(self.schedulers, plans, launched):
            if flight is None:
                sched.update(plan, {})
        self._in_flight = launched
        return events

    def _schedule(self) -> list[StepPlan]:
        """One plan per attention-DP scheduler, counted in the stats."""
        plans = [s.schedule() for s in self.schedulers]
        self.stats["steps"] += 1
        for plan in plans:
            self.stats["preemptions"] += len(plan.preempted_ids)
            self.stats["swaps_out"] += len(plan.swap_out)
        return plans

    def _steps(self, plans: list[StepPlan]) -> tuple[Step, ...]:
        """Each DP rank's step (an idle one for an empty plan; async scheduling: with its feed), all in one graph
        bucket under attention-DP (they replay it together, or none does)."""
        feed = self.options.async_scheduling
        steps = tuple(dummy_step(self.config, self.options) if p.is_empty
                      else replace(Step.from_plan(p), feed=self._feed(d, p)) if feed else Step.from_plan(p)
                      for d, p in enumerate(plans))
        if self.pp_size > 1:  # no attention-DP here: one step
            steps = tuple(replace(s, micro_batches=self._micro_batches(s.items)) for s in steps)
        if self.dp_size > 1 and self.runner.graphs is not None:
            bucket = shared_bucket(steps, self.runner.graphs.buckets)
            steps = tuple(replace(s, graph_bucket=bucket) for s in steps)
        return steps

    def _micro_batches(self, items: tuple[ScheduledItem, ...]) -> int:
        """How many micro-batches a step of these items is cut into over the pipeline stages."""
        if self.options.pp_micro_batches is not None:
            return min(self.options.pp_micro_batches, max(len(items), 1))
        return micro_batch_count(items, self.pp_size, self._stage_cost)

    def _guarded(self, fn):
        """fn(), marking the engine broken if it fails: a step may be in flight on other ranks, or their ids in
        transit, so nothing more is exchanged with them but their release (shutdown). (One synchronous rank stays
        usable: nothing is in flight.)"""
        self._check_usable()
        try:
            return fn()
        except BaseException as e:
            if self.options.async_scheduling or self.comm is not None:
                self._break(e)
            raise

    def _launch(self, steps: tuple[Step, ...]) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple] | None]:
        """Broadcast the steps, launch this rank's (steps[0]) and sample it (with pipeline stages: receive the ids
        that the last stage samples); then (attention-DP) receive what the other DP ranks owe: their previous step's
        ids, sent once they have launched these. Returns this rank's ids and their logprobs' rows (None when no item
        asked) on the device, and the others' (ids, rows) on the host (None when none were owed)."""
        if self.comm is not None:
            self.comm.broadcast_step(steps)
        step, flight = steps[0], self._in_flight[0]
        logits = self.runner.run(step, flight.tokens if step.feed else None, wait=False)
        if logits is not None:
            tokens, logprobs = sample_with_logprobs(step, logits, flight.tokens if step.feed else None, self._seen)
        else:  # pipeline stages: the last stage samples, and shares them (and their rows) below
            tokens, logprobs = empty_sampled(step, self.facts.vocab_size, self.device)
        if self.comm is not None and self.dp_size == 1:
            if tokens.numel():  # every rank's next step feeds them (the first stage's embeds them)
                self.comm.share_tokens(tokens, src=self._last_stage_rank)
            if logits is None and logprobs is not None:  # (a step of prompt chunks alone may have rows)
                self.comm.share_tokens(logprobs, src=self._last_stage_rank)
        remote = None
        if self.dp_size > 1:
            if self._owed:  # each DP rank's previous step's ids, then their rows if it asked
                remote = []
                for d in range(1, self.dp_size):
                    ids, owed = self.comm.recv_result(d), self._in_flight[d]
                    rows = self.comm.recv_result(d) if owed is not None and wants_rows(owed.plan) else None
                    remote.append((ids, rows))
            self._owed = True
        return tokens, logprobs, remote

    def _collect(self) -> list[tuple] | None:
        """Attention-DP: idle steps on every DP rank, so that those with a step in flight send its ids; their
        (ids, logprobs' rows) (None when no DP rank but this one has a step in flight)."""
        if not any(self._in_flight[1:]) or self.comm is None:
            return None
        return self._launch((dummy_step(self.config, self.options),) * self.dp_size)[2]

    def _feed(self, d: int, plan: StepPlan) -> tuple[tuple[int, int], ...]:
        """(item, index among DP rank d's in-flight step's sampled tokens) for each item that feeds one
        (PLACEHOLDER)."""
        wanted = [i for i, it in enumerate(plan.items) if PLACEHOLDER in it.token_ids]
        if not wanted:
            return ()
        flight = self._in_flight[d]
        src = {} if flight is None else {r.request_id: j for j, r in enumerate(flight.requests)}
        missing = [plan.items[i].request_id for i in wanted if plan.items[i].request_id not in src]
        if missing:
            raise RuntimeError(f"scheduler: requests {missing} feed a token that no step in flight samples")
        return tuple((i, src[plan.items[i].request_id]) for i in wanted)

    def _land(self, remote: list[tuple] | None = None) -> list[TokenEvent]:
        """The in-flight steps' tokens to the host (this rank's: its one sync; the other DP ranks': `remote`,
        received by _launch or _collect) and into the schedulers; their events."""
        events = []
        for d, (sched, flight) in enumerate(zip(self.schedulers, self._in_flight)):
            if flight is None:
                continue
            if d == 0:
                timeout = collective_timeout().total_seconds() if self.world_size > 1 else None
                tokens = flight.host.tolist(timeout)
                rows = flight.logprobs.tolist() if flight.logprobs is not None else None
            elif remote is None:
                raise RuntimeError(f"attention-DP rank {d}'s step is in flight but its ids were not received")
            else:
                tokens, rows = remote[d - 1][0].tolist(), remote[d - 1][1]
                rows = rows.tolist() if rows is not None else None
                if len(tokens) != len(flight.requests):
                    raise RuntimeError(f"attention-DP rank {d} sent {len(tokens)} ids for a step that samples "
                                       f"{len(flight.requests)}")
            self._in_flight[d] = None
            lps, prompts = self._logprobs(flight.plan, rows, flight.reporters)
            live = [(r, t, lp, pl) for r, t, lp, pl in zip(flight.requests, tokens, lps, prompts)
                    if not r.is_finished]  # not ended meanwhile
            _, finished = self._update(sched, flight.plan, tokens)
            events += [TokenEvent(r.request_id, t, finished.get(r.request_id), lp, pl) for r, t, lp, pl in live]
        return events

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] of every position of one sequence, run outside the scheduler."""
        with self._comm_lock:
            return self._score(token_ids)

    def _score(self, token_ids: list[int]) -> torch.Tensor:
        self._check_ids(token_ids, "token_ids")
        max_len = self.scheduler.config.max_model_len
        if not token_ids or (max_len is not None and len(token_ids) > max_len):
            raise ValueError(f"token_ids: {len(token_ids)} tokens; a sequence holds 1 to the engine's max_seq_len "
                             f"({max_len})")
        # async scheduling: no step in flight meanwhile; step() returns their tokens
        self._held_events += self._guarded(lambda: self._land(self._collect()))
        pool, slots = self.scheduler.page_pool, self.scheduler.slot_pool
        need = math.ceil(len(token_ids) / self.page_size)
        if need > pool.num_pages:  # never fits: retrying cannot help (Scheduler.add's rule for requests)
            raise ValueError(f"token_ids: {len(token_ids)} tokens need {need} pages of {self.page_size} tokens; "
                             f"the cache holds {pool.num_pages} (num_pages)")
        pages = pool.allocate(need)
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
                step = Step((item,), reset_slot_ids=(slot,) if start == 0 else (), all_logits=True)
                idle = (dummy_step(self.config, self.options),) * (self.dp_size - 1)
                out.append(self._guarded(lambda: self._execute((step, *idle)))[0][0])
            return torch.cat(out)
        finally:
            pool.free(pages)
            slots.free(slot)

    def shutdown(self) -> None:
        """Land a step in flight (async scheduling), then release the worker ranks (they leave their loop; a
        no-op with one rank)."""
        if self.comm is not None and self.comm.keep_alive is not None:
            self.comm.keep_alive.stop()  # before the lock: it may be waiting for it
        with self._comm_lock:
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            if not self._broken:
                self._guarded(lambda: self._land(self._collect()))
        finally:  # a failed step must not keep the workers waiting
            if self.comm is not None:
                from .dist.launch import release_workers

                release_workers(self.comm)
                self.comm = None
