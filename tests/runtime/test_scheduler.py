"""Scheduler driven by a fake, deterministic executor (scheduler_sim.py); no model, no tensors."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from k3runtime.kv_cache import PagePool, SlotPool
from k3runtime.request import PLACEHOLDER, Request, RequestStatus
from k3runtime.sampling_params import SamplingParams
from k3runtime.scheduler import Scheduler
from k3runtime.scheduler_config import SchedulerConfig
from scheduler_sim import EOS, VOCAB, FakeExecutor, check_plan, reference, run


def make(num_pages=64, num_slots=8, **cfg):
    config = SchedulerConfig(**{"page_size": 4, **cfg})
    return Scheduler(config, PagePool(num_pages, config.page_size), SlotPool(num_slots))


def req(rid, n_prompt, max_tokens=8, seed=None, **kw):
    rng = random.Random(rid)
    prompt = [rng.randrange(2, VOCAB) for _ in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, seed=seed, **kw), eos_token_ids=(EOS,))


def assert_matches_reference(requests, max_model_len=None):
    for r in requests:
        out, reason = reference(r, max_model_len)
        assert (r.output_token_ids, r.finish_reason) == (out, reason), r.request_id


def assert_all_free(sched):
    assert sched.page_pool.num_free == sched.page_pool.num_pages
    assert sched.slot_pool.num_free == sched.slot_pool.num_slots
    assert sched.host_page_pool.num_free == sched.host_page_pool.num_pages
    assert sched.host_slot_pool.num_free == sched.host_slot_pool.num_slots
    assert not sched.running and not sched.waiting and not sched.requests


def step(sched, ex):
    plan = sched.schedule()
    check_plan(plan, sched)
    finished = sched.update(plan, ex.step(plan))
    ex.poison_free()
    return plan, finished


def test_continuous_batching_admits_and_mixes_prefill_with_decode():
    sched = make(max_prefill_chunk=16)
    ex = FakeExecutor(sched)
    a = req("a", 5, max_tokens=10, ignore_eos=True)
    sched.add(a)
    plan, _ = step(sched, ex)
    assert [(it.request_id, it.start_pos, it.num_tokens, it.sample) for it in plan.items] == [("a", 0, 5, True)]
    assert plan.reset_slot_ids == (a.slot_id,)
    step(sched, ex)  # a decodes
    b = req("b", 20, max_tokens=3, ignore_eos=True)
    sched.add(b)
    plan, _ = step(sched, ex)
    # One step: a's decode token at position 6 and b's first prefill chunk, no flag telling them apart.
    assert [(it.request_id, it.start_pos, it.num_tokens, it.sample) for it in plan.items] == \
        [("a", 6, 1, True), ("b", 0, 16, False)]
    assert plan.items[0].token_ids == (a.output_token_ids[1],)
    assert plan.reset_slot_ids == (b.slot_id,) and plan.num_batched_tokens == 17
    plan, _ = step(sched, ex)
    assert [(it.request_id, it.start_pos, it.num_tokens, it.sample) for it in plan.items] == \
        [("a", 7, 1, True), ("b", 16, 4, True)]
    while sched.has_unfinished():
        step(sched, ex)
    assert_matches_reference([a, b])
    assert_all_free(sched)


def test_chunked_prefill_respects_chunk_and_step_budget():
    sched = make(max_prefill_chunk=64, max_num_batched_tokens=100, page_size=16)
    ex = FakeExecutor(sched)
    a, b = req("a", 150, max_tokens=2, ignore_eos=True), req("b", 30, max_tokens=2, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    shapes = []
    while a.num_output_tokens == 0:
        plan, _ = step(sched, ex)
        shapes.append([(it.request_id, it.start_pos, it.num_tokens, it.sample) for it in plan.items])
    # b gets what a leaves of the 100-token budget, and never more than one chunk.
    assert shapes == [[("a", 0, 64, False), ("b", 0, 30, True)],
                      [("a", 64, 64, False), ("b", 30, 1, True)],
                      [("a", 128, 22, True)]]
    assert len(plan.items[0].page_ids) == 10  # ceil(150 / 16)


def test_step_budget_smaller_than_chunk():
    sched = make(max_prefill_chunk=64, max_num_batched_tokens=40)
    ex = FakeExecutor(sched)
    a = req("a", 100, max_tokens=1, ignore_eos=True)  # an unseeded request's one token is EOS 1 time in 32
    sched.add(a)
    sizes = [step(sched, ex)[0].items[0].num_tokens for _ in range(3)]
    assert sizes == [40, 40, 20] and a.finish_reason == "length"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_on_tiny_page_budget_gives_unpreempted_outputs(mode):
    # 12 pages of 4 tokens: three requests growing to ~30 tokens each cannot all stay resident.
    sched = make(num_pages=12, num_slots=4, max_prefill_chunk=8, preemption_mode=mode,
                 num_host_pages=12, num_host_slots=4)
    reqs = [req(f"r{i}", 10 + i, max_tokens=20, ignore_eos=True) for i in range(3)]
    ex, plans = run(sched, {0: reqs})
    assert any(p.preempted_ids for p in plans)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert bool(ex.num_swaps) == (mode == "swap")
    assert any(p.swap_in for p in plans) == (mode == "swap")
    assert_matches_reference(reqs)
    assert_all_free(sched)
    # The oldest request is never the victim while a newer one runs (here newer ones run all its life), and the
    # newest is the first to go
    assert reqs[0].num_preemptions == 0
    assert next(p.preempted_ids for p in plans if p.preempted_ids)[0] == reqs[-1].request_id


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_slot_budget_queues_and_completes(mode):
    sched = make(num_pages=8, num_slots=2, max_prefill_chunk=6, preemption_mode=mode,
                 num_host_pages=4, num_host_slots=1)
    reqs = [req(f"r{i}", 3 + 2 * i, max_tokens=12, seed=i, ignore_eos=i % 3 > 0) for i in range(6)]
    ex, plans = run(sched, {0: reqs[:3], 4: reqs[3:]})
    assert max(len(p.items) for p in plans) == 2
    assert sum(r.num_preemptions for r in reqs) > 0
    assert_matches_reference(reqs)
    assert_all_free(sched)


def test_swap_falls_back_to_recompute_when_host_store_is_full():
    sched = make(num_pages=8, num_slots=3, max_prefill_chunk=8, preemption_mode="swap",
                 num_host_pages=2, num_host_slots=1)
    reqs = [req(f"r{i}", 9, max_tokens=14, ignore_eos=True) for i in range(3)]
    seen = set()
    run(sched, {0: reqs}, on_step=lambda s, p: seen.update(sched.get(i).status for i in p.preempted_ids))
    assert RequestStatus.PREEMPTED in seen
    assert_matches_reference(reqs)
    assert_all_free(sched)


def test_stop_conditions_and_api_finish():
    sched = make(max_model_len=12)
    ex = FakeExecutor(sched)
    a = req("a", 4, max_tokens=50, ignore_eos=True)  # ends by max_model_len
    b = req("b", 4, max_tokens=3, ignore_eos=True)  # ends by max_tokens
    first = reference(req("c", 4, max_tokens=1, seed=5))[0][0]
    c = req("c", 4, max_tokens=50, seed=5, ignore_eos=True, stop_token_ids=(first,))
    d = req("d", 4, max_tokens=50, ignore_eos=True)  # the API layer stops it on a stop string
    for r in (a, b, c, d):
        sched.add(r)
    _, finished = step(sched, ex)
    assert finished == [c] and c.finish_reason == "stop" and c.output_token_ids == [first]
    assert sched.finish("d", "stop") is d and d.status is RequestStatus.FINISHED_STOPPED
    plan = sched.schedule()
    assert plan.finished_ids == ("c", "d") and {it.request_id for it in plan.items} == {"a", "b"}
    sched.update(plan, ex.step(plan))
    while sched.has_unfinished():
        step(sched, ex)
    assert (a.num_tokens, a.finish_reason) == (12, "length")
    assert (b.num_output_tokens, b.finish_reason) == (3, "length")
    assert_all_free(sched)
    with pytest.raises(ValueError, match="reason"):
        sched.finish("a", "done")


def test_eos_unless_ignored():
    def unstopped(seed):
        return reference(req("a", 3, max_tokens=6, seed=seed, ignore_eos=True))[0]

    seed = next(s for s in range(1000) if EOS in unstopped(s)[:5])
    a = req("a", 3, max_tokens=6, seed=seed)
    b = Request("b", a.prompt_token_ids, SamplingParams(max_tokens=6, seed=seed, ignore_eos=True), eos_token_ids=(EOS,))
    run(make(), {0: [a, b]})
    cut = unstopped(seed).index(EOS) + 1
    assert (a.output_token_ids, a.finish_reason) == (unstopped(seed)[:cut], "stop")
    assert (b.output_token_ids, b.finish_reason) == (unstopped(seed), "length")


def test_abort_frees_resources_in_every_state():
    sched = make(num_pages=10, num_slots=2, max_prefill_chunk=4, preemption_mode="swap",
                 num_host_pages=10, num_host_slots=2)
    ex = FakeExecutor(sched)
    reqs = [req(f"r{i}", 6, max_tokens=30, ignore_eos=True) for i in range(4)]
    for r in reqs:
        sched.add(r)
    states = set()
    for _ in range(25):
        step(sched, ex)
        states |= {r.status for r in reqs}
    assert {RequestStatus.RUNNING, RequestStatus.SWAPPED, RequestStatus.WAITING} <= states
    for r in sorted(reqs, key=lambda r: r.status.value):
        assert sched.abort(r.request_id) is r and r.finish_reason == "abort"
    assert sched.abort("r0") is None and sched.abort("nope") is None
    assert_all_free(sched)


def test_abort_while_step_in_flight_drops_its_token():
    sched = make()
    ex = FakeExecutor(sched)
    a, b = req("a", 5, ignore_eos=True), req("b", 5, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sampled = ex.step(plan)
    sched.abort("a")
    assert sched.update(plan, sampled) == [] and a.output_token_ids == [] and len(b.output_token_ids) == 1
    assert sched.schedule().finished_ids == ("a",)


def test_contract_errors():
    sched = make(num_pages=4, max_model_len=10)
    sched.add(req("a", 3))
    with pytest.raises(ValueError, match="already live"):
        sched.add(req("a", 3))
    with pytest.raises(ValueError, match=r"under the engine.s max_seq_len \(10\)"):
        sched.add(req("long", 10))
    with pytest.raises(ValueError, match="max_tokens.*needs 5 pages.*holds 4"):
        make(num_pages=4).add(req("big", 10, max_tokens=10))
    with pytest.raises(ValueError, match="page_size"):
        Scheduler(SchedulerConfig(page_size=64), PagePool(4, 16), SlotPool(1))
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="update"):
        sched.schedule()
    with pytest.raises(ValueError, match="missing \\['a'\\]"):
        sched.update(plan, {})
    with pytest.raises(ValueError, match="extra \\['zz'\\]"):
        sched.update(plan, {"a": 3, "zz": 1})
    sched.update(plan, {"a": 3})
    with pytest.raises(ValueError, match="last schedule"):
        sched.update(plan, {"a": 3})


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_num_batched_tokens", -1), ("max_prefill_chunk", 0),
                                         ("page_size", 0), ("preemption_mode", "drop"), ("num_host_pages", -1),
                                         ("max_model_len", 1)])
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


@pytest.mark.parametrize("field,value", [("num_pages", 0), ("num_slots", 1.5), ("max_num_seqs", True),
                                         ("max_prefill_chunk", -4), ("num_host_pages", -1),
                                         ("preemption_mode", "drop")])
def test_engine_options_validation_names_field(field, value):
    """The runtime options are refused by name when they are made, before an engine is opened."""
    from k3runtime.engine_options import EngineOptions

    with pytest.raises(ValueError, match=f"^{field}: expected"):
        EngineOptions(**{field: value})


# some requests penalized: their items carry SeenTokens, which FakeExecutor checks against its counts by slot
PENALTIES = ({}, {"frequency_penalty": 0.5}, {}, {"repetition_penalty": 1.2, "presence_penalty": -1.0})


def _random_run(sched, rng, *, count, per_step, prompt, max_tokens, abort_rate, max_model_len):
    """`count` random requests, `per_step` arriving a step, some aborted at random between schedule and update;
    checks that everything is freed and every output against the reference (an aborted request's: a prefix).
    Returns (plans, aborted ids)."""
    arrivals, reqs = {}, []
    for i in range(count):
        r = req(f"r{i}", rng.randint(1, prompt), max_tokens=rng.randint(1, max_tokens), seed=rng.choice([None, i]),
                ignore_eos=rng.random() < 0.3, **PENALTIES[i % len(PENALTIES)])
        arrivals.setdefault(i // per_step, []).append(r)
        reqs.append(r)
    aborted = set()

    def chaos(step, plan):
        live = sorted(sched.requests)
        if live and rng.random() < abort_rate:
            aborted.add(sched.abort(rng.choice(live)).request_id)

    ex, plans = run(sched, arrivals, on_step=chaos)
    assert ex.num_deltas > ex.num_fresh > 0  # the penalized requests' SeenTokens, checked by the executor
    assert_all_free(sched)
    assert all(r.is_finished for r in reqs)
    assert_matches_reference([r for r in reqs if r.request_id not in aborted], max_model_len=max_model_len)
    for r in reqs:
        if r.request_id in aborted:
            assert r.output_token_ids == reference(r, max_model_len)[0][:r.num_output_tokens]
    return plans, aborted


def test_no_leak_over_1000_random_requests_with_aborts():
    sched = make(num_pages=40, num_slots=6, max_num_seqs=5, max_prefill_chunk=12, max_num_batched_tokens=32,
                 preemption_mode="swap", num_host_pages=16, num_host_slots=2, max_model_len=64)
    plans, aborted = _random_run(sched, random.Random(1234), count=1000, per_step=4, prompt=40, max_tokens=20,
                                 abort_rate=0.08, max_model_len=64)
    assert len(aborted) > 20 and sum(bool(p.preempted_ids) for p in plans) > 10


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(page_size=st.sampled_from([1, 3, 8]), num_pages=st.integers(8, 30), num_slots=st.integers(1, 4),
       chunk=st.integers(1, 9), budget=st.integers(1, 20), mode=st.sampled_from(["recompute", "swap"]),
       host=st.integers(0, 10), lens=st.lists(st.integers(1, 12), min_size=1, max_size=6),
       async_scheduling=st.booleans())
def test_outputs_invariant_to_limits(page_size, num_pages, num_slots, chunk, budget, mode, host, lens,
                                     async_scheduling):
    sched = make(num_pages=num_pages * 8 // page_size, num_slots=num_slots, page_size=page_size,
                 max_prefill_chunk=chunk, max_num_batched_tokens=budget, preemption_mode=mode,
                 num_host_pages=host * 8 // page_size, num_host_slots=host // 3, async_scheduling=async_scheduling)
    reqs = [req(f"r{i}", n, max_tokens=1 + (i * 7) % 10, seed=i, **PENALTIES[i % 4]) for i, n in enumerate(lens)]
    run(sched, {0: reqs[::2], 3: reqs[1::2]})
    assert_matches_reference(reqs)
    assert_all_free(sched)


# --- async scheduling: the next plan made while one is in flight ---

def test_async_next_plan_feeds_the_pending_token():
    sched = make(async_scheduling=True)
    ex = FakeExecutor(sched)
    a = req("a", 5, max_tokens=4, ignore_eos=True)
    sched.add(a)
    first = sched.schedule()
    first_tokens = ex.step(first)
    second = sched.schedule()  # before update(first): a's first output is still on the device
    (it,) = second.items
    assert (it.token_ids, it.start_pos, it.sample, it.sample_index) == ((PLACEHOLDER,), 5, True, 1)
    assert a.num_pending == 2 and a.output_token_ids == []
    second_tokens = ex.step(second, first_tokens)
    with pytest.raises(RuntimeError, match="in flight"):
        sched.schedule()
    with pytest.raises(ValueError, match="oldest"):
        sched.update(second, second_tokens)
    sched.update(first, first_tokens)
    sched.update(second, second_tokens)
    assert a.output_token_ids == reference(a)[0][:2] and a.num_pending == 0


def test_async_request_ending_by_length_is_not_scheduled_again():
    sched = make(async_scheduling=True, max_model_len=8)
    ex = FakeExecutor(sched)
    a = req("a", 5, max_tokens=1, ignore_eos=True)  # its first token is its last
    b = req("b", 6, max_tokens=9, ignore_eos=True)  # reaches max_model_len at its second token
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    t1 = ex.step(first)
    second = sched.schedule()
    assert [it.request_id for it in second.items] == ["b"]
    t2 = ex.step(second, t1)
    assert sched.update(first, t1) == [a]
    assert sched.schedule().is_empty  # b's pending token is its last
    assert sched.update(second, t2) == [b] and b.finish_reason == "length" and b.num_tokens == 8


def test_async_stop_found_one_step_late_drops_the_extra_token():
    seed = next(s for s in range(1000) if reference(req("a", 3, max_tokens=9, seed=s))[0][0] == EOS)
    sched = make(async_scheduling=True)
    ex = FakeExecutor(sched)
    a = req("a", 3, max_tokens=9, seed=seed)  # its first token is EOS
    sched.add(a)
    first = sched.schedule()
    t1 = ex.step(first)
    second = sched.schedule()  # a is in it: its stop is not known yet
    t2 = ex.step(second, t1)
    assert sched.update(first, t1) == [a] and a.finish_reason == "stop"
    assert sched.update(second, t2) == [] and a.output_token_ids == [EOS]
    assert_all_free(sched)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_outputs_match_reference_under_preemption_and_aborts(mode):
    sched = make(num_pages=16, num_slots=5, max_num_seqs=4, max_prefill_chunk=6, max_num_batched_tokens=16,
                 preemption_mode=mode, num_host_pages=12, num_host_slots=2, max_model_len=48, async_scheduling=True)
    plans, aborted = _random_run(sched, random.Random(7), count=300, per_step=3, prompt=30, max_tokens=30,
                                 abort_rate=0.05, max_model_len=48)
    assert sum(bool(p.preempted_ids) for p in plans) > 5 and len(aborted) > 5
    assert sum(PLACEHOLDER in it.token_ids for p in plans for it in p.items) > 500


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_no_preemption_in_a_plan_without_items(mode):
    """a's pending token is its last, so the next plan skips it; b, prefilling, is short of a page that a frees when
    that token lands. The engine runs no step for a plan without items, so preempting b there would lose its swap-out
    (and, by recompute, its prefill for nothing): b waits for a's page instead."""
    sched = make(num_pages=3, max_prefill_chunk=4, preemption_mode=mode, num_host_pages=4 if mode == "swap" else 0,
                 num_host_slots=2 if mode == "swap" else 0, async_scheduling=True)
    a, b = req("a", 4, max_tokens=2, ignore_eos=True), req("b", 8, max_tokens=3, ignore_eos=True)
    _, plans = run(sched, {0: [a], 1: [b]})
    assert_matches_reference([a, b])
    assert not [p for p in plans if p.is_empty and (p.swap_out or p.preempted_ids)]
    assert_all_free(sched)
