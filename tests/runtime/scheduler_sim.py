"""A tensor-free fake executor for scheduler tests: a deterministic "model" over a simulated cache.

The fake keeps what a real executor keeps: per page and row the token written there, per slot a
running hash of the tokens folded in (the KDA state). The next token is a function of the tokens
read back through the page table, the slot state and the sampler's (seed, output index), so a wrong
page table, a missed slot reset, a lost swap or a wrong RNG position changes the output.
Freed pages and slots are poisoned after every step, so reading one is caught at once.

With async scheduling, `run` keeps a plan in flight as the engine does: it executes each plan when it is made (a
GPU would run it next on its stream) and updates the scheduler with the previous plan's tokens only after
scheduling the next; PLACEHOLDER inputs are fed from the previous plan's sampled tokens, as the runner feeds them
on the device.
"""

from __future__ import annotations

from k3runtime.request import PLACEHOLDER, Request
from k3runtime.scheduler import Scheduler, StepPlan

VOCAB = 32
EOS = 1
MOD = (1 << 61) - 1


def fold(state: int, token: int) -> int:
    return (state * 1000003 + token + 1) % MOD


def next_token(kv_tokens, state: int, seed: int, index: int) -> int:
    acc = 0
    for p, t in enumerate(kv_tokens):
        acc = (acc + (p + 1) * (t + 7)) % MOD
    x = (acc * 0x9E3779B1 + state * 31 + seed * 0x85EBCA6B + index * 0xC2B2AE35) % MOD
    x ^= x >> 29
    return (x * 0xBF58476D1CE4E5B9 >> 17) % VOCAB


def reference(request: Request, max_model_len: int | None = None) -> tuple[list[int], str]:
    """Output tokens and finish reason of `request` run alone, straight from its tokens."""
    p = request.params
    tokens, out = list(request.prompt_token_ids), []
    while True:
        state = 0
        for t in tokens:
            state = fold(state, t)
        t = next_token(tokens, state, request.sampling_seed, len(out))
        out.append(t)
        tokens.append(t)
        if t in p.stop_token_ids or (not p.ignore_eos and t in request.eos_token_ids):
            return out, "stop"
        if len(out) >= p.max_tokens or (max_model_len is not None and len(tokens) >= max_model_len):
            return out, "length"


class FakeExecutor:
    def __init__(self, scheduler: Scheduler):
        self.sched = scheduler
        self.P = scheduler.config.page_size
        self.pages = [None] * scheduler.page_pool.num_pages  # page -> list of (pos, token) rows
        self.slots = [None] * scheduler.slot_pool.num_slots  # slot -> (num tokens folded, state)
        self.host_pages = [None] * scheduler.config.num_host_pages
        self.host_slots = [None] * scheduler.config.num_host_slots
        self.num_swaps = 0
        self.counted: dict[int, list[int]] = {}  # slot -> the output tokens the sampling rank counts there
        self.num_fresh = self.num_deltas = 0

    def step(self, plan: StepPlan, fed: dict[str, int] | None = None) -> dict[str, int]:
        """The plan's sampled tokens; fed: the previous plan's sampled tokens (PLACEHOLDER inputs take them)."""
        if plan.is_empty:  # LLMEngine runs no step for a plan without items
            return {}
        for e in plan.swap_out:
            for d, h in zip(e.page_ids, e.host_page_ids):
                self.host_pages[h], self.pages[d] = self.pages[d], None
            self.host_slots[e.host_slot_id], self.slots[e.slot_id] = self.slots[e.slot_id], None
            self.num_swaps += 1
        for e in plan.swap_in:
            for d, h in zip(e.page_ids, e.host_page_ids):
                self.pages[d], self.host_pages[h] = list(self.host_pages[h]), None
            self.slots[e.slot_id], self.host_slots[e.host_slot_id] = self.host_slots[e.host_slot_id], None
        for s in plan.reset_slot_ids:
            self.slots[s] = (0, 0)
        sampled = {}
        for it in plan.items:
            slot = self.slots[it.slot_id]
            assert slot is not None, f"{it.request_id}: slot {it.slot_id} used without reset or swap-in"
            count, state = slot
            assert count == it.start_pos, f"{it.request_id}: slot holds {count} tokens, item starts at {it.start_pos}"
            for k, tok in enumerate(it.token_ids):
                pos = it.start_pos + k
                if tok == PLACEHOLDER:
                    assert fed is not None and it.request_id in fed, f"{it.request_id}: a placeholder, nothing fed"
                    tok = fed[it.request_id]
                page = it.page_ids[pos // self.P]
                if self.pages[page] is None:
                    self.pages[page] = [None] * self.P
                self.pages[page][pos % self.P] = (pos, tok)
                state = fold(state, tok)
            end = it.start_pos + it.num_tokens
            self.slots[it.slot_id] = (end, state)
            if it.sample:
                kv = []
                for pos in range(end):
                    rows = self.pages[it.page_ids[pos // self.P]]
                    assert rows is not None and rows[pos % self.P] is not None, f"{it.request_id}: row {pos} unwritten"
                    stored_pos, tok = rows[pos % self.P]
                    assert stored_pos == pos, f"{it.request_id}: page table maps position {pos} to a row of {stored_pos}"
                    kv.append(tok)
                # The plan alone carries what sampling needs; the Request is only cross-checked.
                r = self.sched.get(it.request_id)
                # its own token is pending, and the in-flight plan's if it sampled this request
                index = r.num_output_tokens + r.num_pending - 1
                assert (it.seed, it.sample_index, it.params) == (r.sampling_seed, index, r.params)
                if it.seen is not None:
                    self._check_seen(it, r, fed)
                sampled[it.request_id] = next_token(kv, state, it.seed, it.sample_index)
        return sampled

    def _check_seen(self, it, r: Request, fed: dict[str, int] | None) -> None:
        """Keep the penalties' counts as a sampling rank does (penalties.SeenCounts: by slot, never poisoned) and
        check that they hold the request's output before the token sampled, but for one token fed on the device
        (async scheduling)."""
        seen = it.seen
        if seen.fresh:
            want_prompt = r.distinct_prompt_ids() if r.params.repetition_penalty != 1.0 else ()
            assert seen.start == 0 and seen.prompt == want_prompt, f"{it.request_id}: fresh SeenTokens' prompt"
            have = []
            self.num_fresh += 1
        else:
            have = self.counted.get(it.slot_id)
            assert have is not None and len(have) == seen.start, \
                f"{it.request_id}: slot {it.slot_id} counts {have and len(have)}, the item adds from {seen.start}"
            self.num_deltas += 1
        have = have + list(seen.output)
        self.counted[it.slot_id] = have
        late = it.sample_index - len(have)
        assert late in ((0, 1) if self.sched.config.async_scheduling else (0,)), f"{it.request_id}: {late} late"
        assert not late or it.request_id in fed, f"{it.request_id}: its last token is neither counted nor fed"
        assert have == r.output_token_ids[:len(have)], f"{it.request_id}: counts {have}, output {r.output_token_ids}"

    def poison_free(self) -> None:
        for i, used in enumerate(self.sched.page_pool._used):
            if not used:
                self.pages[i] = None
        for i, used in enumerate(self.sched.slot_pool._used):
            if not used:
                self.slots[i] = None


def check_plan(plan: StepPlan, sched: Scheduler) -> None:
    cfg = sched.config
    # the engine runs no step for a plan without items: it may carry no cache edits
    assert plan.items or not (plan.swap_out or plan.swap_in or plan.reset_slot_ids), "cache edits in an empty plan"
    assert plan.num_batched_tokens == sum(it.num_tokens for it in plan.items) <= cfg.max_num_batched_tokens
    assert len(plan.items) <= cfg.max_num_seqs
    assert len({it.request_id for it in plan.items}) == len(plan.items)
    assert len({it.slot_id for it in plan.items}) == len(plan.items)
    pages = [p for it in plan.items for p in it.page_ids]
    assert len(set(pages)) == len(pages), "two requests share a page"
    arrivals = [sched.get(it.request_id).arrival for it in plan.items]
    assert arrivals == sorted(arrivals)
    for it in plan.items:
        assert 1 <= it.num_tokens <= cfg.max_prefill_chunk and len(it.token_ids) == it.num_tokens
        assert len(it.page_ids) == -(-(it.start_pos + it.num_tokens) // cfg.page_size)
        r = sched.get(it.request_id)
        known = r.all_token_ids[it.start_pos:it.start_pos + it.num_tokens]
        # past the known tokens: one placeholder at most (a token sampled by the plan in flight)
        assert list(it.token_ids) == known + [PLACEHOLDER] * (it.num_tokens - len(known))
        assert it.num_tokens - len(known) <= (1 if sched.config.async_scheduling else 0)
        end = it.start_pos + it.num_tokens
        assert it.sample == (end == r.num_tokens + r.num_pending - it.sample)


def run(sched: Scheduler, arrivals: dict[int, list[Request]] | None = None, on_step=None, max_steps=100_000):
    """Drive schedule -> fake step -> update until every request (also later arrivals) has finished.

    on_step(step, plan) may abort requests between schedule and update (with async scheduling, also after the
    previous plan's update, this one in flight). With async scheduling a plan is updated after the next one is
    scheduled (and run). Returns (executor, plans).
    """
    ex, plans, step = FakeExecutor(sched), [], 0
    arrivals = dict(arrivals or {})
    in_flight = None  # (plan, its sampled tokens): async scheduling's plan not yet updated
    while sched.has_unfinished() or arrivals or in_flight:
        for r in arrivals.pop(step, []):
            sched.add(r)
        plan = sched.schedule()
        check_plan(plan, sched)
        sampled = ex.step(plan, in_flight[1] if in_flight else None)
        if on_step is not None:
            on_step(step, plan)
        if sched.config.async_scheduling:
            if in_flight:
                sched.update(*in_flight)
            in_flight = (plan, sampled) if not plan.is_empty else None
            if plan.is_empty:
                sched.update(plan, sampled)
            elif on_step is not None:
                on_step(step, plan)  # also where the engine aborts: between steps, this plan in flight
        else:
            sched.update(plan, sampled)
        ex.poison_free()
        plans.append(plan)
        step += 1
        assert step < max_steps, "scheduler made no progress"
    return ex, plans
