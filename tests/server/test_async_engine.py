"""AsyncLLMEngine on its own: asyncio streaming equals LLM, cancellation frees pages and slot, seeds, rejections."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from k3runtime import SamplingParams
from k3runtime.async_engine import AsyncLLMEngine, EngineDeadError
from k3runtime.engine_options import EngineOptions


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def aengine(tiny_engine, request):
    e = AsyncLLMEngine(tiny_engine, EngineOptions(async_scheduling=request.param))
    assert e.engine.options.async_scheduling is request.param
    yield e
    e.shutdown()


def _wait_free(e, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (e.stats.pages_used or e.stats.slots_used or e.stats.num_running) and time.monotonic() < deadline:
        time.sleep(0.02)
    return e.stats


def test_generate_equals_llm(aengine, llm):
    prompts = [[1, 2, 3], [9, 8, 7, 6], [42]]
    sp = SamplingParams(max_tokens=7, temperature=0)
    refs = [o.token_ids for o in llm.generate(prompts, sp)]

    async def one(p):
        return [c.token_id async for c in aengine.generate(p, sp)]

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == refs


def test_seed_passes_through(aengine, llm):
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=2024)

    async def one():
        return [c.token_id async for c in aengine.generate([5, 6, 7], sp)]

    assert asyncio.run(one()) == asyncio.run(one()) == llm.generate([5, 6, 7], sp)[0].token_ids


def test_cancel_frees_pages_and_slot(aengine):
    sp = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

    async def main():
        got = []

        async def consume():
            async for c in aengine.generate([1, 2, 3], sp):
                got.append(c.token_id)

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.01)
        assert aengine.stats.slots_used == 1 and aengine.stats.pages_used >= 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return got

    assert len(asyncio.run(main())) >= 3
    s = _wait_free(aengine)
    assert (s.pages_used, s.slots_used, s.num_running, s.num_waiting) == (0, 0, 0, 0)
    assert aengine.metrics.requests_finished.get("abort", 0) >= 1


def test_rejections_raise_value_error(aengine):
    async def first(ids, sp):
        async for c in aengine.generate(ids, sp):
            return c

    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(first([10**7], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="max_seq_len|pages"):
        asyncio.run(first([1] * 5000, SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="token id 1.5 outside"):
        asyncio.run(first([1.5], SamplingParams(max_tokens=2)))
    for params in (None, {"max_tokens": 2}):  # refused on the caller's thread; the engine thread lives on
        with pytest.raises(TypeError, match="params: expected SamplingParams"):
            asyncio.run(first([1], params))
    # a stop id past the vocabulary (banned under min_tokens by its row * vocab + id) fails its request alone
    with pytest.raises(ValueError, match="stop_token_ids: token id 1000000 outside the vocabulary"):
        asyncio.run(first([1], SamplingParams(max_tokens=2, stop_token_ids=[10**6], min_tokens=1)))
    assert aengine.is_alive
    assert asyncio.run(first([1], SamplingParams(max_tokens=1, temperature=0))).finish_reason == "length"


def test_a_stop_id_whose_text_completes_a_stop_string_ends_by_the_id(aengine, llm):
    """As LLM (vLLM's precedence): a stop id, or config.json's EOS, whose text completes a stop string ends the
    request by the id (stop_reason the id; None for EOS) with the id's own text, not cut by the stop string."""
    ids = [1, 2, 3]
    full = llm.generate(ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    k = next(i for i in range(1, 16) if len(llm.tokenizer.decode(full.token_ids[:i + 1])) >= 3
             and full.token_ids.index(full.token_ids[i]) == i)
    stop_id, upto = full.token_ids[k], llm.tokenizer.decode(full.token_ids[:k + 1])
    stop = upto[-3:]
    assert full.text.find(stop) == len(upto) - 3, (full.text, stop)
    eos = aengine.engine.eos_token_id
    spelled = llm.tokenizer.decode([eos], skip_special_tokens=False)
    cases = [  # (params, a stop string that their last token completes, the stop_reason)
        (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]), stop, stop_id),
        (SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100}, skip_special_tokens=False), spelled, None)]

    async def chunks(sp):
        return [c async for c in aengine.generate(ids, sp)]

    for plain, stop_string, why in cases:
        want = asyncio.run(chunks(plain))
        assert (want[-1].finish_reason, want[-1].stop_reason) == ("stop", why) and stop_string in "".join(
            c.text for c in want)
        got = asyncio.run(chunks(dataclasses.replace(plain, stop=(stop_string,))))
        # (the stop string holds back text, so the chunks' texts are compared joined)
        assert [c.token_id for c in got] == [c.token_id for c in want], stop_string
        assert (got[-1].finish_reason, got[-1].stop_reason) == ("stop", why), stop_string
        assert "".join(c.text for c in got) == "".join(c.text for c in want), stop_string


def test_engine_given_opened_keeps_its_tokenizer(tiny_engine):
    """An AsyncLLMEngine over an opened LLMEngine reads stop strings with the engine dir's tokenizer; without a
    tokenizer, stop strings are refused rather than ignored."""
    from k3runtime.llm_engine import LLMEngine

    engine = LLMEngine(tiny_engine, EngineOptions())
    e = AsyncLLMEngine(engine)
    try:
        assert e.tokenizer is not None and e.tokenizer.vocab_size == engine.facts.vocab_size
    finally:
        e.shutdown()
    bare = AsyncLLMEngine(LLMEngine(tiny_engine, EngineOptions()), tokenizer=None)
    try:
        with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
            bare.submit([1], SamplingParams(max_tokens=2, stop=["x"]), lambda ev: None)
    finally:
        bare.shutdown()


def test_exported_from_the_package():
    import k3runtime

    assert k3runtime.AsyncLLMEngine is AsyncLLMEngine and "AsyncLLMEngine" in k3runtime.__all__


def test_shutdown_fails_pending_and_new_requests(tiny_engine):
    e = AsyncLLMEngine(tiny_engine)
    e.shutdown()
    assert not e.is_alive
    with pytest.raises(EngineDeadError):
        e.submit([1], SamplingParams(), lambda ev: None)


def test_submit_racing_the_last_drain_is_refused(tiny_engine):
    """A submit that passed its liveness check just before the engine thread's last drain, and queues after it,
    would never be answered (a unary Triton request waited forever): once the thread is closing, submit refuses."""
    late = []

    class Racing(AsyncLLMEngine):
        def _drain_rejecting(self, err):
            super()._drain_rejecting(err)
            try:  # the thread is still alive here, as it is for a caller racing it
                self.submit([1], SamplingParams(max_tokens=1), late.append)
            except EngineDeadError as e:
                late.append(e)

    e = Racing(tiny_engine)
    e.shutdown()
    assert len(late) == 1 and isinstance(late[0], EngineDeadError)
