"""Engine outputs do not depend on chunk size, batch composition or preemption (DESIGN.md ladder step 4).

Beyond the greedy tokens, every run records the fp32 logits row each token was sampled from, and those must
match the request run alone too (a token-only check would miss a small error that does not flip an argmax).
"""

import pytest
import torch

import k3runtime.llm_engine as llm_engine
from engines import run_staggered
from k3runtime import LLM, SamplingParams

PROMPTS = [[1, 40, 97, 311, 5, 260, 18, 77, 402, 9, 133, 64, 250, 3, 88, 500, 12] * 5,  # 85 tokens: > a page
           [1, 7, 9], [1, 300, 301, 302, 303, 304, 305], [1] + list(range(100, 160)),
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 499], [1, 64, 128, 256, 511, 0, 1, 2, 3], [1, 33] * 20]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


class _LogitsRecorder:
    """Wraps the engine's sampler: keeps the logits row of every sampled (request id, output index)."""

    def __init__(self, monkeypatch):
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        orig = llm_engine.sample_step

        def record(step, logits, fed=None, seen=None):
            for row, it in enumerate(i for i in step.items if i.sample):
                self.rows[(it.request_id, it.sample_index)] = logits[row].clone()
            return orig(step, logits, fed, seen)

        monkeypatch.setattr(llm_engine, "sample_step", record)

    def of(self, request_id: str, n: int) -> torch.Tensor:
        return torch.stack([self.rows[(request_id, k)] for k in range(n)])


@pytest.fixture(scope="module")
def alone(k3_tiny_engine):
    """Per prompt index: (greedy tokens, logits [20, vocab]) of the request run alone."""
    mp = pytest.MonkeyPatch()
    try:
        rec, llm = _LogitsRecorder(mp), LLM(k3_tiny_engine)
        out = {}
        for i, p in enumerate(PROMPTS):
            o = llm.generate(p, GREEDY)[0]
            out[i] = (o.token_ids, rec.of(o.request_id, GREEDY.max_tokens))
        return out
    finally:
        mp.undo()


def _tokens(alone):
    return {i: t for i, (t, _) in alone.items()}


def _assert_logits_match(rec, ids, alone):
    for rid, i in ids.items():
        torch.testing.assert_close(rec.of(rid, GREEDY.max_tokens), alone[i][1], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"prompt {i}: {m}")


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000], ids=["chunk1", "chunk7", "chunk64", "whole"])
def test_logits_same_for_every_prefill_chunk(k3_tiny_engine, chunk):
    whole = LLM(k3_tiny_engine).logits(PROMPTS[0])
    chunked = LLM(k3_tiny_engine, max_prefill_chunk=chunk).logits(PROMPTS[0])
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_chunked_generation_matches(k3_tiny_engine, alone, monkeypatch):
    rec, llm = _LogitsRecorder(monkeypatch), LLM(k3_tiny_engine, max_prefill_chunk=7)
    o = llm.generate(PROMPTS[0], GREEDY)[0]
    assert o.token_ids == alone[0][0]
    _assert_logits_match(rec, {o.request_id: 0}, alone)


def test_batch_of_8_mixed_prefill_decode_matches_alone(k3_tiny_engine, alone, monkeypatch):
    rec = _LogitsRecorder(monkeypatch)
    out, ids = run_staggered(LLM(k3_tiny_engine, max_prefill_chunk=16).engine, PROMPTS, GREEDY)
    assert out == _tokens(alone)
    _assert_logits_match(rec, ids, alone)


@pytest.mark.parametrize("mode", ["recompute", "swap", "swap_space"])
def test_preemption_gives_identical_outputs(k3_tiny_engine, alone, mode, monkeypatch):
    # 8 pages of 64 tokens cannot hold 8 requests of up to 105 tokens: the scheduler must preempt.
    rec = _LogitsRecorder(monkeypatch)
    # swap_space: a host store sized in bytes (1 MiB), in the device cache's mix of pages and slots
    host = {"recompute": {}, "swap": dict(num_host_pages=16, num_host_slots=8),
            "swap_space": dict(swap_space_gib=2**-10)}[mode]
    llm = LLM(k3_tiny_engine, num_pages=8, max_prefill_chunk=32,
              preemption_mode="recompute" if mode == "recompute" else "swap", **host)
    out, ids = run_staggered(llm.engine, PROMPTS, GREEDY)
    assert out == _tokens(alone)
    _assert_logits_match(rec, ids, alone)
    sched = llm.engine.scheduler
    assert sched.page_pool.num_used == 0 and sched.slot_pool.num_free == sched.slot_pool.num_slots
    assert llm.engine.stats["preemptions"] > 0
    if mode != "recompute":
        assert llm.engine.stats["swaps_out"] > 0


def test_few_slots_queue_requests(k3_tiny_engine, alone, monkeypatch):
    rec = _LogitsRecorder(monkeypatch)
    out, ids = run_staggered(LLM(k3_tiny_engine, num_slots=2).engine, PROMPTS, GREEDY)
    assert out == _tokens(alone)
    _assert_logits_match(rec, ids, alone)


def test_seeded_sampling_independent_of_batch(k3_tiny_engine):
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=100 + i) for i in range(4)]
    llm = LLM(k3_tiny_engine)
    batched = [o.token_ids for o in llm.generate(PROMPTS[:4], params)]
    single = [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS[:4], params)]
    assert batched == single
    other = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.8, seed=7))[0].token_ids
    assert other != batched[0]


@pytest.mark.parametrize("mode", [None, "recompute", "swap"])
def test_async_scheduling_gives_identical_outputs(k3_tiny_engine, alone, mode, monkeypatch):
    """Steps launched before the previous step's tokens reach the host, their decode inputs fed on the device:
    the same tokens and logits as each request alone, with preemption too."""
    rec = _LogitsRecorder(monkeypatch)
    fed = []
    feed = llm_engine.LLMEngine._feed
    monkeypatch.setattr(llm_engine.LLMEngine, "_feed", lambda self, d, plan: fed.append(feed(self, d, plan)) or fed[-1])
    sizes = {} if mode is None else dict(num_pages=8, max_prefill_chunk=32, preemption_mode=mode,
                                         num_host_pages=16 if mode == "swap" else 0,
                                         num_host_slots=8 if mode == "swap" else 0)
    llm = LLM(k3_tiny_engine, async_scheduling=True, **{"max_prefill_chunk": 16, **sizes})
    out, ids = run_staggered(llm.engine, PROMPTS, GREEDY)
    assert out == _tokens(alone)
    _assert_logits_match(rec, ids, alone)
    assert sum(map(len, fed)) > 100  # most decode inputs came from the device
    sched = llm.engine.scheduler
    assert sched.page_pool.num_used == 0 and sched.slot_pool.num_free == sched.slot_pool.num_slots
    if mode is not None:
        assert llm.engine.stats["preemptions"] > 0


def test_async_request_short_of_a_page_that_a_last_token_frees(k3_tiny_engine, monkeypatch):
    """A's second token is its last, so the plan after it skips A; B, halfway through its prefill, needs the page A
    frees once that token lands. B must not be swapped out in that plan without items (the engine runs no step for
    it, so the copy never ran and B came back from an unwritten host page): its logits are those of B alone."""
    rec = _LogitsRecorder(monkeypatch)
    a, b = [1] + list(range(100, 163)), [1, 40, 97, 311, 5, 260, 18, 77] * 16  # one page, two pages
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    alone = LLM(k3_tiny_engine).generate(b, params)[0]
    alone_logits = rec.of(alone.request_id, 2)  # before the next engine's ids, which start again, overwrite them
    llm = LLM(k3_tiny_engine, num_pages=3, max_prefill_chunk=64, preemption_mode="swap", num_host_pages=2,
              num_host_slots=1, async_scheduling=True)
    out, ids = run_staggered(llm.engine, [a, b], params, first=1, later_at=1)
    rid = next(r for r, i in ids.items() if i == 1)
    assert out[1] == alone.token_ids
    torch.testing.assert_close(rec.of(rid, 2), alone_logits, rtol=1e-5, atol=1e-5)
    sched = llm.engine.scheduler
    assert sched.page_pool.num_used == 0 and sched.host_page_pool.num_used == 0


def test_async_scheduling_stops_and_samples_as_sync(k3_tiny_engine):
    """Seeded sampling with EOS, stop ids and max_tokens: async scheduling finds a stop one step late and drops
    the extra token, so outputs and finish reasons equal the synchronous engine's."""
    def params(stops):
        return [SamplingParams(max_tokens=6 + 3 * i, temperature=1.5, top_k=8, seed=11 + i, stop_token_ids=stop)
                for i, stop in enumerate(stops)]

    free = LLM(k3_tiny_engine).generate(PROMPTS, params([()] * 8))
    # half the requests stop on a token they draw early
    params = params([(o.token_ids[1 + i % 3],) if i % 2 else () for i, o in enumerate(free)])
    sync = LLM(k3_tiny_engine).generate(PROMPTS, params)
    llm = LLM(k3_tiny_engine, async_scheduling=True)
    got = llm.generate(PROMPTS, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in sync]
    assert {o.finish_reason for o in sync} == {"stop", "length"}
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.page_pool.num_used == 0
    # a stream stopped early (aborted with a step in flight), then scoring, which lands that step first
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    stream = llm.stream(PROMPTS[0], greedy)
    first = [next(stream).token_id for _ in range(3)]
    stream.close()
    assert llm.engine.has_unfinished()  # the step launched before the abort
    assert first == LLM(k3_tiny_engine).generate(PROMPTS[0], greedy)[0].token_ids[:3]
    torch.testing.assert_close(llm.logits(PROMPTS[1]), LLM(k3_tiny_engine).logits(PROMPTS[1]))
    events = []
    while llm.engine.has_unfinished():
        events += llm.engine.step()
    assert events == []  # the aborted request's in-flight token is not reported
    assert llm.engine.scheduler.page_pool.num_used == 0


def test_generate_cli_with_async_scheduling(k3_tiny_engine, monkeypatch):
    from click.testing import CliRunner

    from k3runtime import api
    from k3runtime.cli import main

    args = ["generate", str(k3_tiny_engine), "--prompt", "Hello there", "--prompt", "Hi", "--max-tokens", "9"]
    sync = CliRunner().invoke(main, [*args, "--no-async-scheduling"])
    fast = CliRunner().invoke(main, [*args, "--async-scheduling"])
    default = CliRunner().invoke(main, args)
    assert sync.exit_code == fast.exit_code == default.exit_code == 0, fast.output
    assert fast.stdout == sync.stdout == default.stdout and "-> 9 tokens" in fast.stdout
    assert LLM(k3_tiny_engine).engine.options.async_scheduling is False  # resolved: off on the CPU
    # the engine's sizes and policies as flags (engine_flags): one request at a time in chunks of 4, the same text
    made = []
    monkeypatch.setattr(api, "LLMEngine",
                        lambda path, options: made.append(options) or llm_engine.LLMEngine(path, options))
    sizes = ["--max-num-seqs", "1", "--max-prefill-chunk", "4", "--preemption-mode", "swap", "--num-host-pages", "2",
             "--num-host-slots", "1", "--num-pages", "3"]
    small = CliRunner().invoke(main, [*args, *sizes])
    assert small.exit_code == 0 and small.stdout == default.stdout, small.output
    opts = made[-1]
    assert (opts.max_num_seqs, opts.max_prefill_chunk, opts.num_pages, opts.num_slots) == (1, 4, 3, None)
    assert (opts.preemption_mode, opts.num_host_pages, opts.num_host_slots) == ("swap", 2, 1)
    bad = CliRunner().invoke(main, [*args, "--preemption-mode", "swap"])
    assert bad.exit_code != 0 and "--preemption-mode 'swap' needs a host store" in bad.output


@pytest.mark.parametrize("device, pp, dp, wanted, on", [
    ("cuda", 1, False, None, True), ("cuda:1", 1, False, None, True), ("cpu", 1, False, None, False),
    ("cuda", 2, False, None, False), ("cuda", 2, False, True, True), ("cuda", 1, True, None, False),
    ("cuda", 1, True, True, True), ("cuda", 1, False, False, False), ("cpu", 1, False, True, True)])
def test_async_scheduling_default(device, pp, dp, wanted, on, monkeypatch):
    """Left to the engine, async scheduling is on for a single-stage CUDA engine, off on the CPU, on ROCm, with
    attention-DP and with pipeline stages (neither run on GPUs); asked for, it runs everywhere."""
    from k3runtime.engine_options import EngineOptions, resolve_async_scheduling

    mapping = {"pp_size": pp, "attention_dp": dp}
    options = EngineOptions(device=device, async_scheduling=wanted)
    monkeypatch.setattr(torch.version, "hip", None)
    assert resolve_async_scheduling(options, mapping).async_scheduling is on
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert resolve_async_scheduling(options, mapping).async_scheduling is (on and wanted is True)


def test_async_scheduling_gives_no_token_of_an_ended_request(k3_tiny_engine):
    """A request aborted after its token was landed early (score()), or aborted with its step in flight and its
    id then reused: no token of it reaches the caller, and the new request under its id gets its own tokens."""
    from k3runtime.request import PLACEHOLDER
    from k3runtime.scheduler import ScheduledItem

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng = LLM(k3_tiny_engine, async_scheduling=True).engine
    eng.add_request(PROMPTS[1], greedy, "a")
    assert eng.step() == []  # launched; nothing landed yet
    assert [ev.request_id for ev in eng.step()] == ["a"]
    eng.score(PROMPTS[2])  # lands a's second token, held for the next step()
    eng.abort("a")
    eng.add_request(PROMPTS[3], greedy, "x")
    assert eng.step() == []
    eng.abort("x")  # its first token is in flight
    eng.add_request(PROMPTS[4], greedy, "x")
    events = []
    while eng.has_unfinished():
        events += eng.step()
    want = LLM(k3_tiny_engine).generate(PROMPTS[4], greedy)[0].token_ids
    assert [ev.request_id for ev in events] == ["x"] * len(want) and [ev.token_id for ev in events] == want
    with pytest.raises(ValueError, match="PLACEHOLDER"):
        eng.runner.batch((ScheduledItem("p", (PLACEHOLDER,), 0, 1, True, 0, (0,), greedy, 0, 0),))


def test_failed_async_step_breaks_the_engine(k3_tiny_engine, monkeypatch):
    """A step that fails with async scheduling leaves steps in flight on other ranks, or their ids in transit:
    the engine refuses further steps and scores by name, and shutdown() only releases the workers. A feed past
    the previous step's samples fails by name before anything runs."""
    from k3runtime.rank_runner import Step
    from k3runtime.scheduler import ScheduledItem

    llm = LLM(k3_tiny_engine, async_scheduling=True)
    eng = llm.engine
    eng.add_request([1, 2, 3], GREEDY)
    eng.step()
    run = eng.runner.run
    monkeypatch.setattr(eng.runner, "run", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    monkeypatch.setattr(eng.runner, "run", run)
    with pytest.raises(RuntimeError, match="failed in an earlier step; shut it down"):
        eng.step()
    with pytest.raises(RuntimeError, match="failed in an earlier step"):
        llm.logits([1, 2, 3])
    eng.shutdown()

    item = ScheduledItem("r", (-1,), 3, 1, True, 0, (0,), GREEDY, 0, 1)
    with pytest.raises(ValueError, match="feeds sampled token 2 of a previous step that sampled 2"):
        run(Step((item,), feed=((0, 2),)), torch.tensor([5, 6]))
