"""Logit bias and penalties through the engine: every greedy token is the argmax of the oracle's penalized logits
(oracles/penalties.py over the engine's own scoring logits of the same sequence), with synchronous and async
scheduling (where a row's last output token is still on the device), beside other requests, and after preemption."""

import pytest
import torch
from oracles.penalties import penalized_logits

from k3runtime import LLM, SamplingParams

PROMPTS = [[1, 40, 97, 311, 5, 260, 18, 77], [1, 7, 9], [1, 300, 301, 302, 303] * 12]
PENALIZED = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw) for kw in (
    {"frequency_penalty": 2.0, "presence_penalty": 1.0},
    {"repetition_penalty": 3.0, "logit_bias": {40: 2.0, 97: -100.0}},
    {"repetition_penalty": 0.5, "frequency_penalty": -1.0, "presence_penalty": 2.0},
)]


@pytest.fixture(scope="module")
def llm(k3_tiny_engine):
    return LLM(k3_tiny_engine)


def _assert_oracle_greedy(llm, prompt, params, out):
    """Each output token is the argmax of the oracle's penalized logits (within the rounding of batched logits)."""
    rows = llm.logits(prompt + out[:-1])[len(prompt) - 1:]
    for i, tok in enumerate(out):
        x = penalized_logits(rows[i], params, prompt, out[:i])
        assert x[tok] >= x.max() - 1e-4, f"token {i}: {tok} is not the penalized argmax {int(x.argmax())}"


def test_greedy_tokens_are_the_penalized_argmax(llm):
    outs = llm.generate(PROMPTS, PENALIZED)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, params, out, base in zip(PROMPTS, PENALIZED, outs, plain):
        _assert_oracle_greedy(llm, prompt, params, out.token_ids)
        assert out.token_ids != base.token_ids  # the penalties change something here
    # the tiny model's logits span less than 1: a repeat that costs 3 never wins
    assert len(set(plain[0].token_ids)) < 24 == len(set(outs[0].token_ids))
    assert outs[1].token_ids[0] == 40 and 0 < outs[1].token_ids.count(40) < 24  # the bias, then the penalty


def test_async_scheduling_and_preemption_give_the_same_tokens(llm, k3_tiny_engine):
    """Async scheduling counts each row's last token from the device; recompute after preemption re-counts
    everything from the request; neither changes a token. Sampled (seeded) rows too."""
    more = [SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True, frequency_penalty=1.5,
                           repetition_penalty=1.2, logit_bias={7: 3.0}),
            # the bias wins the first token, the penalty every later one: the previous token counts at once
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={123: 1.5}, frequency_penalty=2)]
    prompts, params = PROMPTS + PROMPTS[:2], PENALIZED + more
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert want[-1][0] == 123 and want[-1].count(123) == 1
    fast = LLM(k3_tiny_engine, async_scheduling=True)
    assert [o.token_ids for o in fast.generate(prompts, params)] == want
    tight = LLM(k3_tiny_engine, async_scheduling=True, num_pages=3, max_prefill_chunk=8)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert tight.engine.stats["preemptions"] > 0


def test_a_logit_bias_of_100_forces_its_token(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.7, seed=1, logit_bias={123: 100}))
    assert out[0].token_ids == [123] * 6


def test_a_bias_outside_the_vocabulary_is_refused(llm):
    vocab = llm.engine.facts.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias: token id {vocab} outside the vocabulary 0..{vocab - 1}"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={vocab: 1.0}))


def test_generate_cli_takes_the_penalties(llm, k3_tiny_engine):
    from click.testing import CliRunner

    from k3runtime.cli import main

    prompt = "The quick brown fox"
    args = ["generate", str(k3_tiny_engine), "--prompt", prompt, "--max-tokens", "24"]
    want = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0,
                                               repetition_penalty=1.5))[0].text
    assert want != llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0].text
    res = CliRunner().invoke(main, [*args, "--frequency-penalty", "2", "--repetition-penalty", "1.5"])
    assert res.exit_code == 0 and res.stdout.splitlines()[1:] == want.splitlines(), res.output
    bad = CliRunner().invoke(main, [*args, "--presence-penalty", "3"])
    assert bad.exit_code != 0 and "--presence-penalty: expected a number in [-2, 2]" in bad.output


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(llm, k3_tiny_engine):
    """A bias makes EOS (then a stop id) the greedy choice at every step: with min_tokens k the output runs k tokens
    and ends on the k+1-th, with sync and async scheduling; a stop string inside the first k tokens' text does not
    end it either."""
    eos = llm.engine.eos_token_id
    for options in ({}, {"async_scheduling": True}):
        engine = LLM(k3_tiny_engine, **options)
        for kw in ({"logit_bias": {eos: 100}}, {"logit_bias": {77: 100}, "stop_token_ids": (77,), "ignore_eos": True}):
            out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, min_tokens=5, **kw))[0]
            stop = kw.get("stop_token_ids", (eos,))[0]
            assert len(out.token_ids) == 6 and out.finish_reason == "stop", (options, kw, out.token_ids)
            assert stop not in out.token_ids[:5] and out.token_ids[5] == stop
            without = engine.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, **kw))[0]
            assert without.token_ids == [stop]
    text = llm.generate("Hello there", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].text
    stop = text[1:3]  # inside the first token or two
    early = llm.generate("Hello there", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop,)))[0]
    late = llm.generate("Hello there", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop,),
                                                      min_tokens=8))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    assert len(late.token_ids) >= 9 and late.text.startswith(text[:3])
    with pytest.raises(ValueError, match=r"min_tokens: expected an int in 0..max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
