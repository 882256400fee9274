"""Continuous-batching scheduler (no torch; vLLM v1's scheduler in spirit).

Every step is a list of "N tokens of request r starting at position p, sample the last one or not":
a decoding request gets 1 token, a prefilling one a chunk, both in the same step; there is no
prefill/decode flag. Priority is arrival order (FCFS). When a running request needs pages that are
not free, the most recently arrived running request is preempted ("recompute" or "swap").

The executor runs a `StepPlan` in this order: swap_out copies, swap_in copies, zero reset_slot_ids,
then the forward over `items`; it answers `update(plan, {request_id: token})` for every item with
`sample=True`. `schedule()` advances `num_computed_tokens`, so `update()` must follow each plan.

Async scheduling (`SchedulerConfig.async_scheduling`, vLLM v1's in spirit): the next plan may be made while one is
in flight, before its tokens are known. A request sampled by the in-flight plan then gets its next position
with a PLACEHOLDER token id (the executor feeds the sampled id on the device), and its sample_index counts the
pending token. A request whose pending token is its last by length (max_tokens, max_model_len) is not scheduled
again; one that stops on its pending token (EOS, stop ids) is found out one step late: the next plan already
holds it, and update() drops that plan's token for it as it drops an aborted request's. The plans are updated in
order; their device work runs in order on one stream, so pages and slots freed while a plan is in flight are
reused only by later work.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from .kv_cache.page_pool import PagePool, pages_needed
from .kv_cache.slot_pool import SlotPool
from .request import FINISH_STATUS, PLACEHOLDER, Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler_config import SchedulerConfig


@dataclass(frozen=True)
class SeenTokens:
    """The tokens the penalties of a sampled item count (SamplingParams.penalized), as the host knew them when it
    was scheduled. The sampling rank keeps each slot's counts (penalties.SeenCounts), so an item carries only what
    they lack: when `fresh`, the prompt's distinct ids (only for a repetition_penalty) and the whole output, which
    replace the slot's; otherwise the output tokens from index `start` on, which its counts already hold up to.
    With async scheduling the output may lack its last token, still on the device: the item's own PLACEHOLDER
    input, which the sampler takes from the previous step's sampled ids."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    start: int = 0
    fresh: bool = True

    @property
    def end(self) -> int:
        """How many output tokens the slot's counts hold once this is applied."""
        return self.start + len(self.output)


@dataclass(frozen=True)
class PromptRows:
    """Positions start .. start + len(targets) - 1 of an item whose logits give the logprob of the prompt token
    after each, targets[i] (SamplingParams.prompt_logprobs)."""

    start: int
    targets: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledItem:
    """Feed `token_ids` (positions start_pos .. start_pos+num_tokens-1) of one request this step.

    `page_ids` is the request's full page table after this step (position p is in page_ids[p // page_size]);
    `slot_id` holds its KDA state, which carries over from earlier chunks (fresh when start_pos == 0).
    The sampling fields make a plan self-contained (ranks that hold no Request objects can sample):
    the sampler draws from (seed, sample_index), which recompute after preemption reproduces exactly.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    num_tokens: int
    sample: bool  # the logits of the last token are sampled into the request's next output token
    slot_id: int
    page_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # Request.sampling_seed: params.seed, or a random seed fixed when the request was created
    sample_index: int  # index among the request's output tokens of the token this item samples
    seen: SeenTokens | None = None  # what its penalties count, when its request has any (sample items only)
    # ids it may not sample (EOS and stop_token_ids while under SamplingParams.min_tokens)
    banned: tuple[int, ...] = ()
    prompt_rows: PromptRows | None = None  # prompt logprobs this item reports, when its request asked


@dataclass(frozen=True)
class SwapEntry:
    """Copy a request's pages and slot between device ids and host-store ids (page_ids[i] <-> host_page_ids[i])."""

    request_id: str
    page_ids: tuple[int, ...]
    slot_id: int
    host_page_ids: tuple[int, ...]
    host_slot_id: int


@dataclass(frozen=True)
class StepPlan:
    """One engine step; see the module doc for the order in which the executor applies it.

    finished_ids: requests that finished (abort, stop, length) since the previous plan, so the
    executor can drop anything it keeps per request; their pages and slots are already free.
    """

    items: tuple[ScheduledItem, ...]
    reset_slot_ids: tuple[int, ...]
    swap_out: tuple[SwapEntry, ...]
    swap_in: tuple[SwapEntry, ...]
    preempted_ids: tuple[str, ...]
    finished_ids: tuple[str, ...]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.items


def room_error(num_prompt_tokens: int, max_tokens: int, *, max_len: int | None, page_size: int,
               num_pages: int) -> str | None:
    """Why a request of this prompt and max_tokens could never run on caches of `num_pages` (None: it can).
    Every request must fit alone, or preemption could never make room for it."""
    if max_len is not None and num_prompt_tokens >= max_len:
        return (f"prompt_token_ids: {num_prompt_tokens} tokens leave no room to generate under the engine's "
                f"max_seq_len ({max_len})")
    tokens = num_prompt_tokens + max_tokens if max_len is None else min(num_prompt_tokens + max_tokens, max_len)
    need = pages_needed(tokens - 1, page_size)  # the last sampled token is never fed back: it needs no cache row
    if need > num_pages:
        return (f"max_tokens: prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) needs {need} pages of "
                f"{page_size} tokens; the cache holds {num_pages} (num_pages)")
    return None


class Scheduler:
    """Owns the request queues and hands out pages/slots from the pools it is given.

    Args:
        config: limits and preemption mode.
        page_pool: device MLA pages (its page_size must equal config.page_size).
        slot_pool: device KDA state slots.
    """

    def __init__(self, config: SchedulerConfig, page_pool: PagePool, slot_pool: SlotPool):
        if page_pool.page_size != config.page_size:
            raise ValueError(f"page_size: scheduler config says {config.page_size}, page pool has {page_pool.page_size}")
        if page_pool.num_pages < 1 or slot_pool.num_slots < 1:
            raise ValueError(f"page/slot pool: need at least one page and one slot, got "
                             f"{page_pool.num_pages} pages and {slot_pool.num_slots} slots")
        self.config = config
        self.page_pool = page_pool
        self.slot_pool = slot_pool
        self.host_page_pool = PagePool(config.num_host_pages, config.page_size)
        self.host_slot_pool = SlotPool(config.num_host_slots)
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.waiting: list[Request] = []  # WAITING / PREEMPTED / SWAPPED, sorted by arrival
        self.running: list[Request] = []  # RUNNING, sorted by arrival
        self._arrivals = itertools.count()
        self._finished_ids: list[str] = []
        # plans scheduled and not yet updated (oldest first), each with its requests by id
        self._in_flight: list[tuple[StepPlan, dict[str, Request]]] = []
        self._max_in_flight = 2 if config.async_scheduling else 1
        # slot -> (the penalized request whose counts the sampling rank holds there, its output tokens counted)
        self._counted: dict[int, tuple[Request, int]] = {}

    # --- queue state, for the engine and metrics ---
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # --- requests in and out ---
    def add(self, request: Request) -> None:
        """Queue a fresh request; raises ValueError if it could never run on this engine."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already live")
        if request.status is not RequestStatus.WAITING or request.output_token_ids or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r}: expected a fresh request, got status {request.status.value}")
        why = room_error(request.num_prompt_tokens, request.params.max_tokens, max_len=self.config.max_model_len,
                         page_size=self.config.page_size, num_pages=self.page_pool.num_pages)
        if why:
            raise ValueError(why)
        request.arrival = next(self._arrivals)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, reason: str) -> Request | None:
        """End a live request now ("stop" | "length" | "abort") and free its pages and slot.

        Returns:
            the request, or None if no live request has that id (already finished or unknown).
        """
        if reason not in FINISH_STATUS:
            raise ValueError(f"reason: expected one of {tuple(FINISH_STATUS)}, got {reason!r}")
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason)
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, "abort")

    # --- one step ---
    def schedule(self) -> StepPlan:
        """Plan the next step (pages and slots are booked here)."""
        if len(self._in_flight) >= self._max_in_flight:
            why = "the previous StepPlan has not been passed to update() yet" if self._max_in_flight == 1 else \
                f"{len(self._in_flight)} StepPlans are in flight (async scheduling holds at most one while " \
                "planning); update() the oldest first"
            raise RuntimeError(f"schedule: {why}")
        budget = self.config.max_num_batched_tokens
        rows = self.config.max_num_seqs  # prompt logprobs' rows the step may still hold (_chunk)
        items: list[tuple[int, ScheduledItem]] = []
        reset: list[int] = []
        swap_out: list[SwapEntry] = []
        swap_in: list[SwapEntry] = []
        preempted: list[str] = []

        i = 0
        held = False  # a request waits for the pages of requests whose last token is in flight (_waits)
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending and self._ends_by_length(request):
                i += 1  # its pending token is its last
                continue
            n = self._chunk(request, budget, rows)
            if n == 0:  # its next position reports a prompt logprob: next step
                i += 1
                continue
            if not items and self._waits(request, n, i):
                held = True
                break
            if not self._reserve_pages(request, n, swap_out, preempted):
                break  # the request preempted itself; every later one already was
            items.append((request.arrival, self._item(request, n)))
            budget, rows = budget - n, rows - _num_rows(items[-1][1])
            i += 1

        # No admissions in a step that had to preempt: the freed room went to older requests.
        while not preempted and not held and self.waiting and budget > 0 \
                and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = self._chunk(request, budget, rows)
            if n == 0 or not self._admit(request, n, reset, swap_in):
                break  # FCFS: nothing overtakes the head of the queue
            self.waiting.pop(0)
            self._insert(self.running, request)
            items.append((request.arrival, self._item(request, n)))
            budget, rows = budget - n, rows - _num_rows(items[-1][1])

        items.sort(key=lambda x: x[0])
        plan = StepPlan(items=tuple(it for _, it in items), reset_slot_ids=tuple(reset), swap_out=tuple(swap_out),
                        swap_in=tuple(swap_in), preempted_ids=tuple(preempted),
                        finished_ids=tuple(self._finished_ids),
                        num_batched_tokens=self.config.max_num_batched_tokens - budget)
        self._finished_ids = []
        self._in_flight.append((plan, {it.request_id: self.requests[it.request_id] for it in plan.items}))
        return plan

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Apply the tokens sampled by the executor for `plan`.

        Args:
            plan: the oldest plan not yet updated (the one returned by the last `schedule()`, without async
                scheduling).
            sampled: request_id -> token id, exactly for the items with sample=True.
        Returns:
            requests that finished in this update (stop token, EOS, max_tokens, max_model_len).
        """
        if not self._in_flight or plan is not self._in_flight[0][0]:
            which = "returned by the last schedule()" if self._max_in_flight == 1 else "oldest in flight"
            raise ValueError(f"update: plan is not the StepPlan {which}")
        expected = {it.request_id for it in plan.items if it.sample}
        if set(sampled) != expected:
            missing, extra = sorted(expected - set(sampled)), sorted(set(sampled) - expected)
            raise ValueError(f"sampled: expected tokens for exactly the sampled items; missing {missing}, extra {extra}")
        requests = self._in_flight.pop(0)[1]
        finished = []
        for it in plan.items:
            request = requests[it.request_id]
            if it.sample:
                request.num_pending -= 1
            # Finished while the step ran (aborted, or stopped by an earlier plan's token): its token is dropped.
            if not it.sample or request.is_finished:
                continue
            token = sampled[it.request_id]
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"sampled[{it.request_id!r}]: expected a token id >= 0, got {token!r}")
            request.output_token_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason == "stop" and token != request.eos_token_id:
                # a stop id or generation_config.json's other EOS ids (config.json's EOS, also one of the stop ids,
                # reports None), as vLLM, which adds those to the stop ids
                request.stop_reason = token
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    def discard(self, plan: StepPlan) -> None:
        """Forget a plan whose step failed before update() (an exception in the model or the sampler, a
        KeyboardInterrupt), on one rank without async scheduling (the only plan in flight): the step may have
        written part of its requests' KV pages and KDA state, and its swaps may not have run, so each of its live
        requests is preempted by recompute and re-prefills from scratch. A plan no longer in flight (already
        updated) is left alone."""
        at = next((i for i, (p, _) in enumerate(self._in_flight) if p is plan), None)
        if at is None:
            return
        requests = self._in_flight.pop(at)[1]
        for it in plan.items:
            request = requests[it.request_id]
            if it.sample:
                request.num_pending -= 1
            if it.prompt_rows:  # not reported: report them again
                request.num_prompt_rows = min(request.num_prompt_rows, it.prompt_rows.start)
        for request in {*requests.values(), *(self.requests[r] for r in plan.preempted_ids if r in self.requests)}:
            if request.is_finished or request.status is RequestStatus.PREEMPTED:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:  # SWAPPED by this plan: its swap-out never ran
                self.waiting.remove(request)
            self._counted.pop(request.slot_id, None)
            self._free_device(request)
            self._free_host(request)
            request.status, request.num_computed_tokens = RequestStatus.PREEMPTED, 0
            self._insert(self.waiting, request)
        self._finished_ids = list(plan.finished_ids) + self._finished_ids  # the executor never saw them

    # --- helpers ---
    def _chunk(self, request: Request, budget: int, rows: int) -> int:
        """Tokens of the request this step: within the step's token budget and its prefill chunk, and holding at
        most `rows` prompt positions whose logprobs it reports (their logits rows: SamplingParams.prompt_logprobs);
        0 when its next position reports one and the step holds no more."""
        start = request.num_computed_tokens
        remaining = request.num_tokens + request.num_pending - start
        assert remaining > 0, f"request {request.request_id} has nothing to compute"
        n = min(remaining, self.config.max_prefill_chunk, budget)
        first = max(start, request.num_prompt_rows)  # the first position still to report, if any
        if request.params.prompt_logprobs is not None and first < request.num_prompt_tokens - 1:
            n = min(n, first - start + rows)
        return n

    def _item(self, request: Request, n: int) -> ScheduledItem:
        start, pending = request.num_computed_tokens, request.num_pending
        request.num_computed_tokens += n
        sample = start + n == request.num_tokens + pending
        request.num_pending += sample
        return ScheduledItem(request.request_id, request.token_slice(start, start + n), start, n, sample,
                             request.slot_id, tuple(request.page_ids), request.params, request.sampling_seed,
                             request.num_output_tokens + pending, seen=self._seen(request) if sample else None,
                             banned=_banned(request, request.num_output_tokens + pending) if sample else (),
                             prompt_rows=_prompt_rows(request, start, n))

    def _seen(self, request: Request) -> SeenTokens | None:
        """What a sampled item's penalties count and its slot's counts lack (None when its request has none): the
        output tokens since its last sampled item, or everything when its slot holds another request's counts (a
        request new to the slot; also one back after preemption or a swap in a slot that another penalized request
        has used meanwhile)."""
        p = request.params
        if not p.penalized:
            return None
        out, slot = request.output_token_ids, request.slot_id
        owner, counted = self._counted.get(slot, (None, 0))
        self._counted[slot] = (request, len(out))
        if owner is request:
            return SeenTokens((), tuple(out[counted:]), counted, fresh=False)
        return SeenTokens(request.distinct_prompt_ids() if p.repetition_penalty != 1.0 else (), tuple(out))

    def _ends_by_length(self, request: Request) -> bool:
        """Whether the request's pending tokens take it to max_tokens or max_model_len (it finishes on them)."""
        out, total = request.num_output_tokens + request.num_pending, request.num_tokens + request.num_pending
        max_len = self.config.max_model_len
        return out >= request.params.max_tokens or (max_len is not None and total >= max_len)

    def _waits(self, request: Request, n: int, i: int) -> bool:
        """Whether running[i], first of the plan, would have to preempt itself for its pages: those are then held by
        the requests before it, each skipped as its pending token is its last (async scheduling), which free them
        once that token lands. The engine runs no step for a plan without items, so a swap-out there would never
        be copied (and a recompute would drop the request's cache for nothing): it waits for the next plan."""
        need = self._more_pages(request, n)
        return i > 0 and need > self.page_pool.num_free + sum(len(r.page_ids) for r in self.running[i + 1:])

    def _more_pages(self, request: Request, n: int) -> int:
        """Pages a running request needs beyond its own for n more tokens."""
        return self.page_pool.pages_needed(request.num_computed_tokens + n) - len(request.page_ids)

    def _reserve_pages(self, request: Request, n: int, swap_out: list, preempted: list) -> bool:
        """Give a running request the pages for n more tokens, preempting the newest running requests if short."""
        need = self._more_pages(request, n)
        while need > self.page_pool.num_free:
            victim = self.running.pop()
            self._preempt(victim, swap_out, preempted)
            if victim is request:
                return False
        request.page_ids += self.page_pool.allocate(need)
        return True

    def _admit(self, request: Request, n: int, reset: list, swap_in: list) -> bool:
        """Move the head of the waiting queue onto the device if a slot and its pages are free."""
        need = self.page_pool.pages_needed(request.num_computed_tokens + n)
        if self.slot_pool.num_free < 1 or need > self.page_pool.num_free:
            return False
        request.slot_id = self.slot_pool.allocate()
        request.page_ids = self.page_pool.allocate(need)
        if request.status is RequestStatus.SWAPPED:
            k = len(request.host_page_ids)
            swap_in.append(SwapEntry(request.request_id, tuple(request.page_ids[:k]), request.slot_id,
                                     tuple(request.host_page_ids), request.host_slot_id))
            self._free_host(request)
        else:
            reset.append(request.slot_id)
        request.status = RequestStatus.RUNNING
        return True

    def _preempt(self, request: Request, swap_out: list, preempted: list) -> None:
        num_pages = len(request.page_ids)
        fits_host = self.host_page_pool.num_free >= num_pages and self.host_slot_pool.num_free >= 1
        if self.config.preemption_mode == "swap" and fits_host:
            request.host_page_ids = self.host_page_pool.allocate(num_pages)
            request.host_slot_id = self.host_slot_pool.allocate()
            swap_out.append(SwapEntry(request.request_id, tuple(request.page_ids), request.slot_id,
                                      tuple(request.host_page_ids), request.host_slot_id))
            request.status = RequestStatus.SWAPPED
        else:
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
        self._free_device(request)
        request.num_preemptions += 1
        self._insert(self.waiting, request)
        preempted.append(request.request_id)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        p = request.params
        stops = request.num_output_tokens > p.min_tokens  # (the token is counted): min_tokens were before it
        if stops and (token in p.stop_token_ids or (not p.ignore_eos and token in request.eos_token_ids)):
            return "stop"
        if request.num_output_tokens >= p.max_tokens:
            return "length"
        if self.config.max_model_len is not None and request.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free_device(request)
        self._free_host(request)
        request.status = FINISH_STATUS[reason]
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _free_device(self, request: Request) -> None:
        self.page_pool.free(request.page_ids)
        request.page_ids = []
        if request.slot_id is not None:
            self.slot_pool.free(request.slot_id)
            request.slot_id = None

    def _free_host(self, request: Request) -> None:
        self.host_page_pool.free(request.host_page_ids)
        request.host_page_ids = []
        if request.host_slot_id is not None:
            self.host_slot_pool.free(request.host_slot_id)
            request.host_slot_id = None

    @staticmethod
    def _insert(queue: list[Request], request: Request) -> None:
        bisect.insort(queue, request, key=lambda r: r.arrival)


def _banned(request: Request, index: int) -> tuple[int, ...]:
    """The ids output token `index` may not be: EOS and the stop ids while under min_tokens."""
    p = request.params
    if index >= p.min_tokens:
        return ()
    eos = () if p.ignore_eos else request.eos_token_ids
    return tuple(sorted({*eos, *p.stop_token_ids}))


def _num_rows(item: ScheduledItem) -> int:
    return len(item.prompt_rows.targets) if item.prompt_rows else 0


def _prompt_rows(request: Request, start: int, n: int) -> PromptRows | None:
    """The prompt positions among start .. start + n - 1 whose logprobs are still to report (their next token is a
    prompt token), marked as reported; None when there are none or the request did not ask."""
    if request.params.prompt_logprobs is None:
        return None
    lo, hi = max(start, request.num_prompt_rows), min(start + n, request.num_prompt_tokens - 1)
    if lo >= hi:
        return None
    request.num_prompt_rows = hi
    return PromptRows(lo, tuple(request.prompt_token_ids[lo + 1:hi + 1]))
