"""The Python API (issue 3, requirement 5): text in and out through the engine's tokenizer, stop strings,
streaming, `.logits`, what SamplingParams' top_k / top_p / temperature / seed do, and a bf16-state engine."""

import re

import pytest
import torch
from engines import build_engine

from k3runtime import LLM, SamplingParams
from k3runtime.sampler import sample

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(k3_tiny_engine):
    return LLM(k3_tiny_engine)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_text_prompt_uses_the_engine_tokenizer(llm):
    out = llm.generate(PROMPT, greedy(12))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    assert out.text == llm.tokenizer.decode(out.token_ids) and len(out.token_ids) == 12
    assert out.finish_reason == "length"
    # token ids in, the same tokens out; several prompts come back in order
    ids = llm.generate([out.prompt_token_ids], greedy(12))[0]
    assert ids.token_ids == out.token_ids
    many = llm.generate([PROMPT, [5, 6, 7]], greedy(4))
    assert [o.prompt_token_ids for o in many] == [out.prompt_token_ids, [5, 6, 7]]
    assert many[0].token_ids == out.token_ids[:4]


def test_logits_are_fp32_per_position_and_agree_with_greedy(llm):
    ids = llm.tokenizer.encode(PROMPT)
    logits = llm.logits(ids)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), llm.engine.facts.vocab_size)
    first = llm.generate(ids, greedy(1))[0].token_ids[0]
    assert int(logits[-1].argmax()) == first


def test_stream_equals_generate(llm):
    ref = llm.generate(PROMPT, greedy(16))[0]
    chunks = list(llm.stream(PROMPT, greedy(16)))
    assert [c.token_id for c in chunks] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    assert [c.finish_reason for c in chunks] == [None] * 15 + ["length"]
    assert llm.engine.scheduler.page_pool.num_used == 0
    # each chunk says where its token's text starts: a whole token's own text stands there
    starts = [c.text_offset for c in chunks]
    assert starts == sorted(starts) and starts[0] == 0 and starts[-1] <= len(ref.text)
    pieces = [llm.tokenizer.token_bytes(t).decode("utf-8", "replace") for t in ref.token_ids]
    # (a special token's text, its spelling, is left out of the output's: the tiny model's output holds three)
    whole = [i for i, p in enumerate(pieces) if "\ufffd" not in p and llm.tokenizer.decode([ref.token_ids[i]]) == p]
    assert whole and all(ref.text.startswith(pieces[i], starts[i]) for i in whole)


def test_stream_stopped_early_frees_the_request(llm):
    it = llm.stream(PROMPT, greedy(50))
    next(it), next(it)
    it.close()
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.page_pool.num_used == 0


def test_interleaved_streams_and_generate_get_every_token(llm):
    """Two streams consumed in turns, and a generate() while both are paused: each request gets all its tokens,
    the same as alone (the engine's steps run them all; each caller takes only its own)."""
    prompts = [PROMPT, [5, 6, 7, 8]]
    alone = [llm.generate(p, greedy(6))[0].token_ids for p in prompts]
    a, b = llm.stream(prompts[0], greedy(6)), llm.stream(prompts[1], greedy(6))
    got = [[next(a).token_id], [next(b).token_id]]
    assert llm.generate("Kimi", greedy(3))[0].token_ids == llm.generate("Kimi", greedy(3))[0].token_ids
    got[1] += [c.token_id for c in b]
    got[0] += [c.token_id for c in a]
    assert got == alone
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.page_pool.num_used == 0


def test_a_refused_prompt_takes_its_batch_back_out(llm):
    """One prompt the engine refuses (too long, out of the vocabulary) refuses the call; the prompts before it are
    not left running, and the next call works."""
    max_len = llm.engine.scheduler.config.max_model_len
    for bad, words in (([5] * max_len, "max_seq_len"), ([10**7], "outside the vocabulary"), ("", "empty"),
                       ([1.5], "a list holding float 1.5"), (None, "got NoneType")):
        with pytest.raises(ValueError, match=words):
            llm.generate(["fine", bad], greedy(4))
        assert not llm.engine.has_unfinished() and llm.engine.scheduler.page_pool.num_used == 0
    assert len(llm.generate("fine", greedy(4))[0].token_ids) == 4
    with pytest.raises(TypeError, match="params: expected SamplingParams, got dict"):
        llm.generate("fine", {"max_tokens": 3})
    with pytest.raises(ValueError, match="params: 0 SamplingParams for 2 prompts"):
        llm.generate(["fine", "also"], [])
    # vLLM's TextPrompt / TokensPrompt: refused, not generated from the dict's keys as text
    with pytest.raises(ValueError, match="a dict \\(vLLM's TextPrompt / TokensPrompt\\) is not taken"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(4))
    # a stop id past the vocabulary would be banned (min_tokens) in another request's logits row
    vocab = llm.engine.facts.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids: token id {vocab} outside the vocabulary"):
        llm.generate(["fine", "also"], [greedy(4), greedy(4, stop_token_ids=[vocab], min_tokens=2)])
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.page_pool.num_used == 0


def test_stop_strings_need_a_tokenizer(k3_tiny_engine):
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        LLM(k3_tiny_engine, tokenizer=None).generate([5, 6], SamplingParams(max_tokens=2, stop=["x"]))


def test_tokenizer_argument_is_a_directory_or_refused_by_name(k3_tiny_engine, llm, tmp_path):
    """tokenizer= takes a directory holding tokenizer.json (vLLM's tokenizer=path), read as the engine dir's is; a
    path without one, or another library's tokenizer object, is a ValueError naming the argument before any weight
    is read (a path was kept as the tokenizer: "unknown encoding" at the first text prompt, and an object without
    token_bytes failed inside a generation). AsyncLLMEngine takes the argument alike."""
    from k3runtime.async_engine import AsyncLLMEngine
    from k3runtime.tokenizer import Tokenizer

    want = llm.generate(PROMPT, greedy(4))[0]
    for path in (str(k3_tiny_engine), k3_tiny_engine):
        got = LLM(k3_tiny_engine, tokenizer=path).generate(PROMPT, greedy(4))[0]
        assert (got.token_ids, got.text) == (want.token_ids, want.text)
    for cls in (LLM, AsyncLLMEngine):
        with pytest.raises(ValueError, match="tokenizer: '.*' is not a directory holding tokenizer.json"):
            cls(k3_tiny_engine, tokenizer=str(tmp_path))
        with pytest.raises(ValueError, match="tokenizer: expected 'auto', None, a k3runtime Tokenizer .*got dict"):
            cls(k3_tiny_engine, tokenizer={"name": "moonshotai/Kimi-K2"})
    ae = AsyncLLMEngine(k3_tiny_engine, tokenizer=str(k3_tiny_engine))
    try:
        assert isinstance(ae.tokenizer, Tokenizer)
    finally:
        ae.shutdown()


def test_a_failed_step_leaves_the_llm_usable(k3_tiny_engine):
    """A step that raises (a failing kernel, Ctrl-C in a notebook) fails its call; the requests it held re-prefill,
    so another caller's paused stream goes on with the tokens it would have had, and the next call works."""
    llm = LLM(k3_tiny_engine, num_pages=8)
    seeded = SamplingParams(max_tokens=12, seed=7, repetition_penalty=1.3, ignore_eos=True, logprobs=2)
    want = llm.generate(PROMPT, seeded)[0]
    stream = llm.stream(PROMPT, seeded)
    got = [next(stream) for _ in range(3)]
    execute = llm.engine._execute

    def interrupted(steps):
        llm.engine._execute = execute  # once
        raise KeyboardInterrupt

    llm.engine._execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate("another caller", greedy(6))
    got.append(next(stream))

    class Waiting:  # a GPU step's tokens: the host waits for them in tolist(), where Ctrl-C lands
        def tolist(self):
            raise KeyboardInterrupt

    def interrupted_reading(steps):
        llm.engine._execute = execute
        execute(steps)
        return [Waiting()], [None]

    llm.engine._execute = interrupted_reading
    with pytest.raises(KeyboardInterrupt):
        llm.generate("another caller", greedy(6))
    got += list(stream)
    assert [c.token_id for c in got] == want.token_ids
    # the tokens after the failed step come from a re-prefill: their logprobs agree to fp32 rounding
    assert [[t for t, _ in c.logprobs.top] for c in got] == [[t for t, _ in lp.top] for lp in want.logprobs]
    assert [c.logprobs.logprob for c in got] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    again = llm.generate("another caller", greedy(6))[0].token_ids
    assert again == LLM(k3_tiny_engine).generate("another caller", greedy(6))[0].token_ids
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.page_pool.num_used == 0
    assert llm.engine.scheduler.slot_pool.num_free == llm.engine.scheduler.slot_pool.num_slots


def test_threads_may_share_an_llm(llm):
    """Callers on several threads step one engine for each other: every output is the one it has alone."""
    import threading

    prompts = ["a b c", "The quick", [5, 6, 7, 8], "1 2 3"]
    want = [o.token_ids for o in llm.generate(prompts, greedy(8))]
    got, errors = {}, []

    def caller(i):
        try:
            for _ in range(3):
                if i % 2:
                    got.setdefault(i, []).append([c.token_id for c in llm.stream(prompts[i], greedy(8))])
                else:
                    got.setdefault(i, []).append(llm.generate(prompts[i], greedy(8))[0].token_ids)
        except Exception as e:  # noqa: BLE001 (reported below, in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all(got[i] == [want[i]] * 3 for i in range(len(prompts))), got
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.page_pool.num_used == 0


def test_logits_refuse_what_generate_refuses(llm):
    max_len = llm.engine.scheduler.config.max_model_len
    vocab = llm.engine.facts.vocab_size
    for bad, words in (([1, vocab], f"token id {vocab} outside the vocabulary"), ([-1], "token id -1 outside"),
                       ([5] * (max_len + 1), f"max_seq_len \\({max_len}\\)"), ([], "empty"),
                       ([1.5], "list holding float")):
        with pytest.raises(ValueError, match=words):
            llm.logits(bad)
    assert llm.logits([5] * max_len).shape == (max_len, vocab)  # the longest sequence the engine holds


def test_logits_past_the_cache_say_so(k3_tiny_engine):
    """A sequence more pages long than the cache holds: never scoreable, so not 'busy, retry'."""
    small = LLM(k3_tiny_engine, num_pages=2)
    with pytest.raises(ValueError, match=r"token_ids: 200 tokens need 4 pages of 64 tokens; the cache holds 2 "
                                         r"\(num_pages\)"):
        small.logits([5] * 200)
    assert small.logits([5] * 128).shape[0] == 128


def test_engine_switches_must_be_booleans(k3_tiny_engine):
    for name in ("cuda_graphs", "async_scheduling", "enable_deepep"):
        with pytest.raises(ValueError, match=f"{name}: expected True or False, got 'no'"):
            LLM(k3_tiny_engine, **{name: "no"})


def test_stop_string_cuts_the_text(llm):
    full = llm.generate(PROMPT, greedy(16))[0]
    stop = full.text[4:6]
    assert stop and full.text.find(stop) == 4, full.text
    out = llm.generate(PROMPT, greedy(16, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:4]
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < 16
    streamed = list(llm.stream(PROMPT, greedy(16, stop=(stop,))))
    assert "".join(c.text for c in streamed) == out.text and streamed[-1].finish_reason == "stop"


def test_stop_string_with_async_scheduling(llm, k3_tiny_engine):
    """A stop string found on the host one step after its token was sampled: the same text, tokens and reason,
    streamed or not, and the request's extra step leaves nothing behind."""
    full = llm.generate(PROMPT, greedy(16))[0]
    stop = full.text[4:6]
    want = llm.generate(PROMPT, greedy(16, stop=(stop,)))[0]
    fast = LLM(k3_tiny_engine, async_scheduling=True)
    out = fast.generate(PROMPT, greedy(16, stop=(stop,)))[0]
    assert (out.text, out.token_ids, out.finish_reason) == (want.text, want.token_ids, "stop")
    streamed = list(fast.stream(PROMPT, greedy(16, stop=(stop,))))
    assert "".join(c.text for c in streamed) == want.text and streamed[-1].finish_reason == "stop"
    while fast.engine.has_unfinished():
        assert fast.engine.step() == []
    assert fast.engine.scheduler.page_pool.num_used == 0


def test_skip_special_tokens(llm, k3_tiny_engine):
    """Special tokens are left out of the text by default (vLLM's), kept with skip_special_tokens=False: as the
    tokenizer's own decoding (transformers) spells them, generated or streamed; a stop string that spells one then
    matches it. The tokens are the same either way."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(k3_tiny_engine)
    special = set(hf.all_special_ids)
    # the tiny model's tokens are random: a prompt whose output holds special tokens among others
    outs = (llm.generate([a, 14, 15], greedy(24))[0] for a in range(7, 200))
    ref = next(o for o in outs if special & set(o.token_ids[1:-1]) and not set(o.token_ids) <= special)
    prompt, ids = ref.prompt_token_ids, ref.token_ids
    assert ref.text == hf.decode(ids, skip_special_tokens=True)
    for skip in (True, False):
        out = llm.generate(prompt, greedy(24, skip_special_tokens=skip))[0]
        assert out.token_ids == ids and out.text == hf.decode(ids, skip_special_tokens=skip), skip
        chunks = list(llm.stream(prompt, greedy(24, skip_special_tokens=skip)))
        assert [c.token_id for c in chunks] == ids and "".join(c.text for c in chunks) == out.text
    first = next(i for i, t in enumerate(ids) if t in special)
    spelled = hf.convert_ids_to_tokens(ids[first])
    assert spelled in hf.decode(ids, skip_special_tokens=False) and spelled not in ref.text
    stopped = llm.generate(prompt, greedy(24, stop=(spelled,), skip_special_tokens=False))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == ids[:first + 1]
    assert stopped.text == hf.decode(ids[:first], skip_special_tokens=False)
    streamed = list(llm.stream(prompt, greedy(24, stop=(spelled,), skip_special_tokens=False)))
    assert "".join(c.text for c in streamed) == stopped.text and streamed[-1].finish_reason == "stop"
    assert llm.generate(prompt, greedy(24, stop=(spelled,)))[0].text == ref.text  # left out: never matches
    with pytest.raises(ValueError, match="skip_special_tokens: expected a bool, got 'no'"):
        SamplingParams(skip_special_tokens="no")


def test_sampling_options_do_what_they_say(llm):
    ids = llm.tokenizer.encode(PROMPT)
    g = llm.generate(ids, greedy(8))[0].token_ids
    # top_k=1, a tiny top_p and min_p=1 leave only the argmax, whatever the temperature and seed.
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        for seed in (0, 1, 2):
            p = SamplingParams(max_tokens=8, temperature=1.5, seed=seed, ignore_eos=True, **kw)
            assert llm.generate(ids, p)[0].token_ids == g, kw
    hot = [llm.generate(ids, SamplingParams(max_tokens=8, temperature=5.0, seed=s, ignore_eos=True))[0].token_ids
           for s in range(3)]
    assert len({tuple(h) for h in hot}) > 1  # a high temperature with different seeds differs
    again = llm.generate(ids, SamplingParams(max_tokens=8, temperature=5.0, seed=1, ignore_eos=True))[0].token_ids
    assert again == hot[1]  # the same seed reproduces


def test_generate_cli_takes_min_p(llm, k3_tiny_engine):
    """`k3runtime generate --min-p`: 1 gives the greedy text at a high temperature, 0.75 the Python API's (the tiny
    model's distribution is nearly flat), and one outside [0, 1] is refused by its option's name."""
    from click.testing import CliRunner

    from k3runtime.cli import main

    args = ["generate", str(k3_tiny_engine), "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "1.5",
            "--seed", "1"]
    hot = SamplingParams(max_tokens=12, temperature=1.5, seed=1)
    plain, greedy_text = llm.generate(PROMPT, hot)[0].text, llm.generate(PROMPT, greedy(12))[0].text
    want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, seed=1, min_p=0.75))[0].text
    assert plain != want and plain != greedy_text
    for min_p, text in (("1", greedy_text), ("0.75", want)):
        res = CliRunner().invoke(main, [*args, "--min-p", min_p])
        assert res.exit_code == 0 and res.stdout.splitlines()[1:] == text.splitlines(), (min_p, res.output)
    bad = CliRunner().invoke(main, [*args, "--min-p", "1.5"])
    assert bad.exit_code != 0 and "--min-p: expected a number in [0, 1] (0 = off), got 1.5" in bad.output


def test_stop_reason_names_the_stop_string_or_id(llm, k3_tiny_engine):
    """vLLM's stop_reason: the stop string that cut the text (the earliest, whatever its place in the list), the stop
    id that ended the output (int), None on length and on EOS (also when EOS is one of the stop ids); the last
    StreamChunk carries it, with async scheduling too."""
    full = llm.generate(PROMPT, greedy(16))[0]
    assert (full.finish_reason, full.stop_reason) == ("length", None)
    early, late = full.text[4:6], full.text[9:11]
    assert full.text.find(early) == 4 and full.text.find(late) > 6 and early != late, full.text
    out = llm.generate(PROMPT, greedy(16, stop=(late, early)))[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", early, full.text[:4])
    assert list(llm.stream(PROMPT, greedy(16, stop=(late, early))))[-1].stop_reason == early
    stop_id = full.token_ids[3]
    want = full.token_ids[:full.token_ids.index(stop_id) + 1]
    fast = LLM(k3_tiny_engine, async_scheduling=True)
    for engine in (llm, fast):
        for ignore_eos in (True, False):
            p = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_id], ignore_eos=ignore_eos)
            out = engine.generate(PROMPT, p)[0]
            assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", stop_id, want)
            assert isinstance(out.stop_reason, int)
            chunks = list(engine.stream(PROMPT, p))
            assert [c.stop_reason for c in chunks] == [None] * (len(want) - 1) + [stop_id]
    eos = llm.engine.eos_token_id
    for stop_ids in ((), (eos,)):
        p = SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100}, stop_token_ids=stop_ids)
        out = llm.generate(PROMPT, p)[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
        assert list(llm.stream(PROMPT, p))[-1].stop_reason is None


def test_a_stop_id_whose_text_completes_a_stop_string_ends_by_the_id(llm, k3_tiny_engine):
    """vLLM's precedence: a token that ends the output itself (a stop id, EOS) reports its id (None for EOS) as the
    stop_reason even where its text completes a stop string, and the text is the stop id's own (not cut by the stop
    string); with the stop string alone, the same token is cut by it. Generated and streamed, async scheduling too."""
    full = llm.generate(PROMPT, greedy(16))[0]
    k = 2
    stop_id, upto = full.token_ids[k], llm.tokenizer.decode(full.token_ids[:k + 1])
    stop = upto[-3:]  # begins in an earlier token's text and ends with the stop id's
    assert full.token_ids.index(stop_id) == k and full.text.find(stop) == len(upto) - 3
    assert llm.tokenizer.decode([stop_id]) and not llm.tokenizer.decode([stop_id]).startswith(stop), stop
    by_string = llm.generate(PROMPT, greedy(16, stop=(stop,)))[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    assert by_string.token_ids == full.token_ids[:k + 1]
    by_id = llm.generate(PROMPT, greedy(16, stop_token_ids=[stop_id]))[0]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id) and by_id.text != by_string.text
    fast = LLM(k3_tiny_engine, async_scheduling=True)
    for engine in (llm, fast):
        p = greedy(16, stop=(stop,), stop_token_ids=[stop_id])
        out = engine.generate(PROMPT, p)[0]
        assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == \
            ("stop", stop_id, by_id.token_ids, by_id.text)
        chunks = list(engine.stream(PROMPT, p))
        assert [(c.finish_reason, c.stop_reason) for c in chunks[-1:]] == [("stop", stop_id)]
        assert "".join(c.text for c in chunks) == by_id.text
    # config.json's EOS spelled by the text (special tokens kept): it ends the output with no stop_reason
    eos = llm.engine.eos_token_id
    plain = SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100}, skip_special_tokens=False)
    ended = llm.generate(PROMPT, plain)[0]
    assert ended.token_ids == [eos] and ended.text
    p = SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100}, skip_special_tokens=False,
                       stop=(ended.text,))
    out = llm.generate(PROMPT, p)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([eos], "stop", None, ended.text)
    last = list(llm.stream(PROMPT, p))[-1]
    assert (last.finish_reason, last.stop_reason, last.text) == ("stop", None, ended.text)


def test_cumulative_logprob_sums_the_tokens_logprobs(llm):
    """cumulative_logprob: the sum of the output tokens' logprobs (the model's log-softmax, checked against
    .logits), None when logprobs were not asked."""
    out = llm.generate(PROMPT, greedy(8, logprobs=0))[0]
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs), abs=1e-9)
    ids = out.prompt_token_ids + out.token_ids
    rows = torch.log_softmax(llm.logits(ids[:-1]).double(), -1)[len(out.prompt_token_ids) - 1:]
    assert out.cumulative_logprob == pytest.approx(rows.gather(1, torch.tensor(out.token_ids)[:, None]).sum().item(),
                                                   abs=1e-4)
    assert out.cumulative_logprob < 0
    assert llm.generate(PROMPT, greedy(8))[0].cumulative_logprob is None


def test_sampler_top_k_top_p_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    draws = lambda p: {sample(logits, [p], [s], [0])[0] for s in range(300)}  # noqa: E731
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.65)) == {0, 1}  # 0.4 < 0.65 <= 0.4 + 0.3
    assert draws(SamplingParams(temperature=1.0, top_p=0.75)) == {0, 1, 2}
    assert draws(SamplingParams(temperature=0.0)) == {0}


def test_bf16_state_engine(k3_tiny_ckpt, k3_tiny_engine, tmp_path):
    eng = build_engine(k3_tiny_ckpt, tmp_path / "bf16state", state_dtype="bf16")
    llm = LLM(eng)
    assert llm.engine.config["build_config"]["state_dtype"] == "bf16"
    assert llm.engine.runner.cache.kda_state_all.dtype == torch.bfloat16
    ids = list(range(1, 80))
    # Chunks of 16: the state is written to the slot and read back between chunks (one chunk would never read it).
    a = LLM(k3_tiny_engine, max_prefill_chunk=16).logits(ids).flatten()
    b = LLM(eng, max_prefill_chunk=16).logits(ids).flatten()
    assert not torch.equal(a, b)  # the state really is stored in bf16 ...
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    assert cos > 0.999 and (a - b).norm() / a.norm() < 3e-2  # ... within the spec's parity bar


def test_n_choices_are_seeded_requests_in_prompt_order(llm):
    """SamplingParams.n: each prompt's n choices come one after another (index 0..n-1), choice j the output of a
    request seeded seed + j, the same as the OpenAI server's n."""
    sampled = SamplingParams(max_tokens=8, temperature=1.5, seed=21, ignore_eos=True)
    outs = llm.generate([PROMPT, [5, 6, 7]], SamplingParams(**{**sampled.__dict__, "n": 3}))
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(PROMPT)] * 3 + [[5, 6, 7]] * 3
    assert len({o.request_id for o in outs}) == 6
    for k, prompt in enumerate([PROMPT, [5, 6, 7]]):
        for j in range(3):
            alone = llm.generate(prompt, SamplingParams(**{**sampled.__dict__, "seed": 21 + j}))[0]
            assert outs[3 * k + j].token_ids == alone.token_ids and outs[3 * k + j].text == alone.text
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # seeds 21, 22, 23 at temperature 1.5: 8 tokens apart
    # a list of params: each prompt its own n
    two = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=2)
    mixed = llm.generate([PROMPT, PROMPT], [two, greedy(4)])
    assert [o.index for o in mixed] == [0, 1, 0] and len({tuple(o.token_ids) for o in mixed}) == 1


@pytest.mark.parametrize("bad", [0, 65, True, 2.0])
def test_bad_n_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"^n: expected an int in 1\.\.64"):
        SamplingParams(n=bad)


def test_n_above_one_is_refused_where_one_request_runs(llm):
    with pytest.raises(ValueError, match=r"^n: stream\(\) runs one choice"):
        next(llm.stream(PROMPT, SamplingParams(max_tokens=4, n=2)))
    with pytest.raises(ValueError, match=r"^n: a request is one choice"):
        llm.engine.add_request([5, 6], SamplingParams(max_tokens=4, n=2))
    assert not llm.engine.has_unfinished()


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The quick brown fox?"}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "f"}}]


def test_chat_renders_as_transformers_then_generates(llm, k3_tiny_engine):
    """LLM.chat (vLLM's): each conversation's prompt is transformers' apply_chat_template (tools included) on the
    engine's tokenizer, and its output is generate()'s on those ids; conversations come back in order."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(k3_tiny_engine)
    want = [hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False),
            hf.apply_chat_template(CHAT[1:], tools=CHAT_TOOLS, add_generation_prompt=True, return_dict=False)]
    assert len(want[1]) > len(hf.apply_chat_template(CHAT[1:], add_generation_prompt=True, return_dict=False))
    one = llm.chat(CHAT, greedy(6))
    assert [o.prompt_token_ids for o in one] == want[:1]
    assert one[0].token_ids == llm.generate([want[0]], greedy(6))[0].token_ids
    both = llm.chat([CHAT, CHAT[1:]], greedy(6), tools=CHAT_TOOLS)
    assert [o.prompt_token_ids for o in both] == [hf.apply_chat_template(c, tools=CHAT_TOOLS, add_generation_prompt=True,
                                                                         return_dict=False) for c in (CHAT, CHAT[1:])]
    assert both[1].prompt_token_ids == want[1]
    # text parts join with newlines, as the OpenAI server joins them
    parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": "The quick"},
                                                   {"type": "text", "text": "brown fox?"}]}]
    joined = [CHAT[0], {"role": "user", "content": "The quick\nbrown fox?"}]
    assert llm.chat(parts, greedy(1))[0].prompt_token_ids == hf.apply_chat_template(
        joined, add_generation_prompt=True, return_dict=False)


def test_chat_tool_call_arguments_as_a_dict_render_as_json(llm, k3_tiny_engine):
    """transformers' docs give an assistant's tool call arguments as a dict: the template renders them as JSON
    (Kimi's does, `| tojson`), the prompt a string of that JSON gives, not Python's repr ({'city': ...})."""
    from transformers import PreTrainedTokenizerFast

    def history(arguments):
        return [CHAT[1], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "functions.f:0", "content": "sunny"}]

    as_dict = llm.chat(history({"city": "東京"}), greedy(1), tools=CHAT_TOOLS)[0].prompt_token_ids
    assert as_dict == llm.chat(history('{"city": "東京"}'), greedy(1), tools=CHAT_TOOLS)[0].prompt_token_ids
    hf = PreTrainedTokenizerFast.from_pretrained(k3_tiny_engine)
    assert as_dict == hf.apply_chat_template(history({"city": "東京"}), tools=CHAT_TOOLS, add_generation_prompt=True,
                                             return_dict=False)


@pytest.mark.parametrize("messages, named", [([], "messages: expected a conversation (a list of message dicts) or a "
                                                 "list of them, got an empty list"),
                                             ([CHAT, [{"role": "user", "content": "a\ud800"}]],
                                              "messages[1][0].content: not valid Unicode text: a lone surrogate "
                                              "'\\ud800' at character 1"),
                                             ([{"role": "user", "content": [{"type": "text", "text": "ab"},
                                                                            {"type": "text", "text": "c\ud800"}]}],
                                              "messages[0].content[1].text: not valid Unicode text: a lone "
                                              "surrogate '\\ud800' at character 1"),
                                             ([CHAT, "hi"], "messages[1]: expected a non-empty list"),
                                             ([{"content": "hi"}], "messages[0]: expected a dict with a string 'role'"),
                                             ([{"role": "user", "content": [{"type": "image_url"}]}],
                                              "messages[0].content: only text parts"),
                                             ([{"role": "user", "content": 3}], "messages[0].content: expected")])
def test_chat_refuses_what_no_template_takes_naming_it(llm, messages, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        llm.chat(messages, greedy(1))


def test_chat_needs_a_tokenizer(k3_tiny_engine):
    with pytest.raises(ValueError, match=r"chat: the engine has no tokenizer; use generate\(\)"):
        LLM(k3_tiny_engine, tokenizer=None).chat(CHAT)
