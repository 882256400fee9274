"""SamplingParams.logprobs through the Python API: each output token's log-probability and its most likely
alternatives, against the log-softmax of the engine's own scoring logits (llm.logits) of the same sequence."""

import pytest
import torch

from k3runtime import LLM, SamplingParams

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(k3_tiny_engine):
    return LLM(k3_tiny_engine)


def _expected(llm, prompt_ids, out_ids) -> torch.Tensor:
    """log-softmax of the logits that predict each output token (fp32 [len(out_ids), vocab])."""
    logits = llm.logits(prompt_ids + out_ids[:-1])
    return torch.log_softmax(logits[len(prompt_ids) - 1:].double(), -1)


def test_greedy_logprobs_are_the_models(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3))[0]
    want = _expected(llm, out.prompt_token_ids, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 8
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.logprob == pytest.approx(want[i, tok].item(), abs=1e-4)
        ids = [t for t, _ in lp.top]
        assert len(ids) == 3 and ids[0] == tok  # greedy: the sampled token is the most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert ids == torch.topk(want[i], 3).indices.tolist()
        assert all(v == pytest.approx(want[i, t].item(), abs=1e-4) for t, v in lp.top)


def test_sampled_tokens_get_the_untempered_distribution(llm):
    """Temperature and top-k pick the token; its logprob is still the model's raw distribution's."""
    params = SamplingParams(max_tokens=6, temperature=1.7, top_k=5, seed=11, ignore_eos=True, logprobs=0)
    out = llm.generate(PROMPT, params)[0]
    want = _expected(llm, out.prompt_token_ids, out.token_ids)
    assert [lp.top for lp in out.logprobs] == [()] * 6
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([want[i, t].item() for i, t in
                                                                 enumerate(out.token_ids)], abs=1e-4)


def test_only_the_requests_that_ask_get_them_and_streams_agree(llm, k3_tiny_engine):
    asks = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    # another prompt first in the batch: the asking row is the step's second
    plain, with_lp = llm.generate(["Kimi-K3 is", PROMPT],
                                  [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), asks])
    assert plain.logprobs is None and len(with_lp.logprobs) == 5
    chunks = list(llm.stream(PROMPT, asks))  # alone in its batch: the same values up to the batch's rounding
    _assert_close([c.logprobs for c in chunks], with_lp.logprobs)
    assert all(c.logprobs is None for c in llm.stream(PROMPT, SamplingParams(max_tokens=2)))
    # async scheduling lands a step's logprobs with its tokens, a step later
    fast = LLM(k3_tiny_engine, async_scheduling=True).generate(PROMPT, asks)[0]
    assert fast.token_ids == with_lp.token_ids
    _assert_close(fast.logprobs, with_lp.logprobs)


def _assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [g.logprob, *(v for _, v in g.top)] == pytest.approx([w.logprob, *(v for _, v in w.top)], abs=1e-5)


def test_rows_asking_for_different_counts_in_one_step(llm):
    """Two requests in one batch asking for 1 and 4 alternatives: each gets its own count, the values the ones it
    gets alone."""
    one, four = (SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=n) for n in (1, 4))
    a, b = llm.generate(["Kimi-K3 is", PROMPT], [one, four])
    assert {len(x.top) for x in a.logprobs} == {1} and {len(x.top) for x in b.logprobs} == {4}
    _assert_close(a.logprobs, llm.generate("Kimi-K3 is", one)[0].logprobs)
    _assert_close(b.logprobs, llm.generate(PROMPT, four)[0].logprobs)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs: expected None or an int in 0..20"):
        SamplingParams(logprobs=bad)


def test_an_abort_in_flight_leaves_the_others_logprobs_in_place(k3_tiny_engine):
    """Async scheduling: the request beside an asking one is aborted while a step of both is in flight; the asking
    request's tokens and logprobs stay paired, as it gets them alone."""
    llm = LLM(k3_tiny_engine, async_scheduling=True)
    eng, asks = llm.engine, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    other = eng.add_request(llm.tokenizer.encode("Kimi-K3 is"), SamplingParams(max_tokens=8, ignore_eos=True))
    mine = eng.add_request(llm.tokenizer.encode(PROMPT), asks)
    tokens, lps = [], []
    for step in range(40):
        if step == 3:
            assert other in eng._in_flight[0].requests  # a step of both launched, its tokens not yet landed
            eng.abort(other.request_id)
        for ev in eng.step():
            assert ev.request_id != other.request_id or step < 3  # none once aborted
            if ev.request_id == mine.request_id:
                tokens.append(ev.token_id)
                lps.append(ev.logprobs)
        if not eng.has_unfinished():
            break
    alone = llm.generate(PROMPT, asks)[0]
    assert tokens == alone.token_ids
    _assert_close(lps, alone.logprobs)


LONG = [1, 40, 97, 311, 5, 260, 18, 77, 402, 9, 133, 64, 250, 3, 88, 500, 12] * 4  # 68 tokens: two pages


def _assert_prompt_logprobs(llm, prompt, got, k):
    """got: a request's prompt_logprobs: None, then each prompt token's logprob and its k most likely alternatives,
    as the log-softmax of the engine's scoring logits of the prompt gives them."""
    want = torch.log_softmax(llm.logits(prompt).double(), -1)
    assert len(got) == len(prompt) and got[0] is None
    for i, lp in enumerate(got[1:], start=1):
        assert lp.logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=1e-4), i
        assert [t for t, _ in lp.top] == torch.topk(want[i - 1], k).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(torch.topk(want[i - 1], k).values.tolist(), abs=1e-4)


def test_prompt_logprobs_are_the_models(llm, k3_tiny_engine):
    """Each prompt token's logprob and alternatives, beside requests that do not ask, through prefill chunks; with
    async scheduling and after preemption by recompute, the same; a one-token prompt has only its None."""
    asks = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    out = llm.generate([[1, 7, 9], LONG, [5]], [plain, asks, asks])
    assert out[0].prompt_logprobs is None and out[2].prompt_logprobs == [None]
    _assert_prompt_logprobs(llm, LONG, out[1].prompt_logprobs, 3)
    for options in ({"max_prefill_chunk": 8}, {"async_scheduling": True, "max_prefill_chunk": 8, "num_pages": 2}):
        # the asking request comes second: with two pages it is the one preempted, mid-prefill, and re-prefilled
        other = LLM(k3_tiny_engine, **options)
        again = other.generate([[1, 300, 301, 302, 303] * 12, LONG], [plain, asks])
        assert again[1].token_ids == out[1].token_ids
        _assert_close(again[1].prompt_logprobs[1:], out[1].prompt_logprobs[1:])
    assert other.engine.stats["preemptions"] > 0 and not other.engine._prompt_logprobs  # nothing left behind
    # with the output tokens' own logprobs, in one step's rows (different widths: 3 and 1)
    both = llm.generate(LONG, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, logprobs=1))[0]
    _assert_close(both.prompt_logprobs[1:], out[1].prompt_logprobs[1:])
    assert [len(x.top) for x in both.logprobs] == [1, 1]


def test_prompt_logprobs_come_with_the_first_chunk(llm):
    chunks = list(llm.stream(LONG, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=0)))
    assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
    assert [lp.top for lp in chunks[0].prompt_logprobs[1:]] == [()] * (len(LONG) - 1)
    with pytest.raises(ValueError, match="prompt_logprobs: expected None or an int in 0..20"):
        SamplingParams(prompt_logprobs=21)


def test_a_step_holds_at_most_max_num_seqs_prompt_rows(k3_tiny_engine, llm):
    """The prompt's rows are logits over the vocabulary: a step holds max_num_seqs of them, so the prompt is
    prefilled in chunks that small; the values are the same."""
    small = LLM(k3_tiny_engine, max_num_seqs=2)
    counts, schedule = [], small.engine.scheduler.schedule

    def counted():
        plan = schedule()
        counts.append(sum(len(it.prompt_rows.targets) for it in plan.items if it.prompt_rows))
        return plan

    small.engine.scheduler.schedule = counted
    asks = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    got = small.generate([LONG, [1, 7, 9]], [asks, asks])
    assert max(counts) == 2 and sum(counts) == len(LONG) - 1 + 2
    want = llm.generate([LONG, [1, 7, 9]], [asks, asks])
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        _assert_close(g.prompt_logprobs[1:], w.prompt_logprobs[1:])


def test_an_id_reused_while_rows_are_in_flight_gets_its_own(k3_tiny_engine, llm):
    """Async scheduling: a request asking for prompt logprobs is aborted while a step with its prompt rows is in
    flight, and a new request takes its id; the new one's prompt logprobs are its own, as it gets them alone."""
    fast = LLM(k3_tiny_engine, async_scheduling=True, max_prefill_chunk=16)
    eng, asks = fast.engine, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    eng.add_request(LONG, asks, request_id="x")
    eng.step()  # its first chunk's step launched, its rows not landed
    eng.abort("x")
    eng.add_request([1, 300, 301, 302, 303] * 4, asks, request_id="x")
    firsts = [ev.prompt_logprobs for _ in range(40) if eng.has_unfinished() for ev in eng.step()
              if ev.prompt_logprobs is not None]
    assert len(firsts) == 1 and not eng._prompt_logprobs
    alone = llm.generate([1, 300, 301, 302, 303] * 4, asks)[0].prompt_logprobs
    assert len(firsts[0]) == len(alone) and firsts[0][0] is None
    _assert_close(firsts[0][1:], alone[1:])
