"""Engine outputs do not depend on chunk size, batch composition or preemption (DESIGN.md ladder step 4).

Beyond the greedy tokens, every run records the fp32 logits row each token was sampled from, and those must
match the request run alone too (a token-only check would miss a small error that does not flip an argmax).
"""

import pytest
import torch

import k3runtime.llm_engine as llm_engine
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

        def record(step, logits):
            for row, it in enumerate(i for i in step.items if i.sample):
                self.rows[(it.request_id, it.sample_index)] = logits[row].clone()
            return orig(step, logits)

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


def _run_staggered(llm, params):
    """Requests arrive over time, so steps mix prefill chunks with decodes. Returns (tokens, request ids)."""
    eng, reqs, out = llm.engine, {}, {}
    for i, p in enumerate(PROMPTS[:4]):
        reqs[eng.add_request(p, params).request_id] = i
    for step in range(200):
        if step == 3:
            for i, p in enumerate(PROMPTS[4:], start=4):
                reqs[eng.add_request(p, params).request_id] = i
        for ev in eng.step():
            out.setdefault(reqs[ev.request_id], []).append(ev.token_id)
        if step > 3 and not eng.has_unfinished():
            break
    return out, reqs


def test_batch_of_8_mixed_prefill_decode_matches_alone(k3_tiny_engine, alone, monkeypatch):
    rec = _LogitsRecorder(monkeypatch)
    out, ids = _run_staggered(LLM(k3_tiny_engine, max_prefill_chunk=16), GREEDY)
    assert out == _tokens(alone)
    _assert_logits_match(rec, ids, alone)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_identical_outputs(k3_tiny_engine, alone, mode, monkeypatch):
    # 8 pages of 64 tokens cannot hold 8 requests of up to 105 tokens: the scheduler must preempt.
    rec = _LogitsRecorder(monkeypatch)
    llm = LLM(k3_tiny_engine, num_pages=8, max_prefill_chunk=32, preemption_mode=mode,
              num_host_pages=16 if mode == "swap" else 0, num_host_slots=8 if mode == "swap" else 0)
    out, ids = _run_staggered(llm, GREEDY)
    assert out == _tokens(alone)
    _assert_logits_match(rec, ids, alone)
    sched = llm.engine.scheduler
    assert sched.page_pool.num_used == 0 and sched.slot_pool.num_free == sched.slot_pool.num_slots
    assert llm.engine.stats["preemptions"] > 0
    if mode == "swap":
        assert llm.engine.stats["swaps_out"] > 0


def test_few_slots_queue_requests(k3_tiny_engine, alone, monkeypatch):
    rec = _LogitsRecorder(monkeypatch)
    out, ids = _run_staggered(LLM(k3_tiny_engine, num_slots=2), GREEDY)
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
