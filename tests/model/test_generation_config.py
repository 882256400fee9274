"""A checkpoint's generation_config.json reaches the engine: every EOS id it lists ends an output (as vLLM adds them
to the stop ids), and its sampling fields are the defaults of the API, `k3runtime generate` and the server where a
request gives none (vLLM's generation_config="auto")."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
from click.testing import CliRunner

from engines import build_engine
from k3runtime import LLM, SamplingParams

# the tiny model's greedy tokens (ignore_eos) for these prompts start 227, 21, 371 and 252, 314, 4, 121, 464, 297, 452;
# with repetition_penalty 1.3 the second's seventh token is another (a penalty the defaults must bring)
HELLO, FOX = "Hello world", "The quick brown fox jumps"
SECOND_EOS = 371
GENERATION = {"eos_token_id": [2, SECOND_EOS], "do_sample": True, "temperature": 0.0, "top_p": 0.9, "top_k": 5,
              "repetition_penalty": 1.3, "max_new_tokens": 3}
PENALIZED = {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def gen_engine(k3_tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("gencfg")
    ckpt = shutil.copytree(k3_tiny_ckpt, root / "ckpt")
    (ckpt / "generation_config.json").write_text(json.dumps(GENERATION))
    return build_engine(ckpt, root / "engine")


@pytest.fixture(scope="module")
def gen_llm(gen_engine):
    return LLM(gen_engine)


@pytest.fixture(scope="module")
def plain_llm(k3_tiny_engine):
    return LLM(k3_tiny_engine)


def test_build_records_the_file(gen_engine):
    config = json.loads((gen_engine / "config.json").read_text())
    assert config["generation_config"] == {"eos_token_ids": [2, SECOND_EOS], "sampling": PENALIZED}
    assert json.loads((gen_engine / "generation_config.json").read_text()) == GENERATION  # copied too


def test_every_eos_id_ends_the_output(gen_llm, plain_llm):
    greedy = SamplingParams(max_tokens=16, temperature=0)
    plain = plain_llm.generate(HELLO, greedy)[0]
    assert plain.token_ids[:3] == [227, 21, SECOND_EOS] and plain.finish_reason == "length"
    out = gen_llm.generate(HELLO, greedy)[0]
    assert out.token_ids == [227, 21, SECOND_EOS] and out.finish_reason == "stop"
    assert gen_llm.engine.eos_token_ids == (2, SECOND_EOS)
    streamed = list(gen_llm.stream(HELLO, greedy))
    assert [c.token_id for c in streamed] == out.token_ids and streamed[-1].finish_reason == "stop"
    # as the config's EOS: ignore_eos runs past it, min_tokens holds it back
    past = gen_llm.generate(HELLO, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert past.token_ids == plain.token_ids and past.finish_reason == "length"
    held = gen_llm.generate(HELLO, SamplingParams(max_tokens=16, temperature=0, min_tokens=4))[0]
    assert SECOND_EOS not in held.token_ids[:4] and held.token_ids[:2] == [227, 21]


def test_sampling_fields_are_the_defaults(gen_llm, plain_llm):
    assert gen_llm.get_default_sampling_params() == SamplingParams(**PENALIZED)
    assert plain_llm.get_default_sampling_params() == SamplingParams()
    want = gen_llm.generate(FOX, SamplingParams(**PENALIZED))[0]
    greedy = gen_llm.generate(FOX, SamplingParams(temperature=0))[0]
    assert want.token_ids != greedy.token_ids  # the penalty shows
    assert gen_llm.generate(FOX)[0].token_ids == want.token_ids
    assert [c.token_id for c in gen_llm.stream(FOX)] == want.token_ids
    # given params are taken as they are
    assert gen_llm.generate(FOX, SamplingParams(temperature=0))[0].token_ids == greedy.token_ids


def test_generate_cli_takes_the_defaults_and_the_flags_over_them(gen_llm, gen_engine):
    from k3runtime.cli import main

    args = ["generate", str(gen_engine), "--prompt", FOX, "--max-tokens", "16"]
    want = gen_llm.generate(FOX, SamplingParams(max_tokens=16, **PENALIZED))[0].text
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0 and res.stdout.splitlines()[1:] == want.splitlines(), res.output
    greedy = gen_llm.generate(FOX, SamplingParams(max_tokens=16, temperature=0))[0].text
    assert greedy != want
    res = CliRunner().invoke(main, [*args, "--repetition-penalty", "1"])
    assert res.exit_code == 0 and res.stdout.splitlines()[1:] == greedy.splitlines(), res.output


@pytest.mark.parametrize("section, expect", [
    ({"eos_token_ids": [512]}, "generation_config.eos_token_ids: expected a list of token ids in 0..511"),
    ({"sampling": {"top_p": 0}}, "generation_config.sampling.top_p: expected a number in (0, 1]"),
    ({"sampling": {"seed": 1}}, "generation_config.sampling: expected an object of temperature, top_p"),
])
def test_an_edited_section_is_refused_by_name(gen_engine, tmp_path, section, expect):
    from k3runtime.loader import EngineError, read_engine_config

    engine = shutil.copytree(gen_engine, tmp_path / "engine")
    config = json.loads((engine / "config.json").read_text())
    config["generation_config"] = section
    (engine / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=re.escape(f"config.json: {expect}")):
        read_engine_config(engine)


def test_min_p_is_a_default_too(k3_tiny_ckpt, tmp_path):
    """vLLM's generation_config="auto" reads min_p beside temperature, top_p, top_k and repetition_penalty: a model
    whose file says min_p 1.0 samples its best token alone where a request gives no min_p."""
    from k3runtime.cli import main

    ckpt = shutil.copytree(k3_tiny_ckpt, tmp_path / "ckpt")
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 1.5, "min_p": 1.0}))
    engine = build_engine(ckpt, tmp_path / "engine")
    assert json.loads((engine / "config.json").read_text())["generation_config"] == {
        "sampling": {"temperature": 1.5, "min_p": 1.0}}
    llm = LLM(engine)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=1.5, min_p=1.0)
    greedy = llm.generate(FOX, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    hot = SamplingParams(max_tokens=12, temperature=1.5, seed=1, ignore_eos=True)
    assert llm.generate(FOX, hot)[0].token_ids != greedy  # min_p 0: the draws show
    defaults = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=12, seed=1, ignore_eos=True)
    assert llm.generate(FOX, defaults)[0].token_ids == greedy
    res = CliRunner().invoke(main, ["generate", str(engine), "--prompt", FOX, "--max-tokens", "12", "--seed", "1"])
    want = llm.generate(FOX, SamplingParams(max_tokens=12, temperature=0))[0].text
    assert res.exit_code == 0 and res.stdout.splitlines()[1:] == want.splitlines(), res.output
    with pytest.raises(ValueError, match="generation_config.json: min_p: expected a number in"):
        (ckpt / "generation_config.json").write_text(json.dumps({"min_p": 1.5}))
        build_engine(ckpt, tmp_path / "engine2")


def test_stop_reason_of_an_added_eos_id_is_the_id(gen_llm):
    """vLLM adds generation_config.json's EOS ids other than the config's to the stop ids, so an output they end
    reports the id as its stop_reason (Llama 3's 128009); the config's EOS reports none, as before."""
    greedy = SamplingParams(max_tokens=16, temperature=0)
    out = gen_llm.generate(HELLO, greedy)[0]
    assert (out.token_ids[-1], out.finish_reason, out.stop_reason) == (SECOND_EOS, "stop", SECOND_EOS)
    assert list(gen_llm.stream(HELLO, greedy))[-1].stop_reason == SECOND_EOS
    eos = gen_llm.engine.eos_token_id
    assert eos == 2 and eos != SECOND_EOS
    ban = SamplingParams(max_tokens=16, temperature=0, logit_bias={SECOND_EOS: -100, eos: 100})
    out = gen_llm.generate(HELLO, ban)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    out = gen_llm.generate(HELLO, dataclasses.replace(ban, stop_token_ids=(eos,)))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)



def test_sampling_fields_are_what_vllm_reads_through_transformers(tmp_path):
    """vLLM takes the file's fields through transformers' `GenerationConfig.to_diff_dict()`; since transformers 5 the
    sampling fields default to None there, so a value equal to the old defaults (the `top_k: 50` save_pretrained used
    to write) is kept, as here. The same fields for files of such values, against the installed transformers."""
    from transformers import GenerationConfig

    from k3build.generation_config import SAMPLING, read_generation_config

    for fields in ({"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0},
                   {"temperature": 0.6, "top_k": 50, "min_p": 0.0}, {"do_sample": True}):
        (tmp_path / "generation_config.json").write_text(json.dumps(fields))
        diff = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
        want = {k: v for k, v in diff.items() if k in SAMPLING and v is not None}
        assert read_generation_config(tmp_path, 100, ValueError).get("sampling", {}) == want, fields
