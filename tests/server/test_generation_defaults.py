"""The server takes a field a request leaves out from the model's generation_config.json (vLLM's
generation_config="auto"), and stops on each EOS id it lists."""

from __future__ import annotations

import json

import httpx
import pytest

from k3runtime import LLM, SamplingParams

FOX = "The quick brown fox jumps"
# the tiny model's greedy output for FOX changes with repetition_penalty 1.3 (tests/model/test_generation_config.py)
SAMPLING = {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def gen_engine(tmp_path_factory):
    from k3build.build import BuildOptions, build
    from k3build.config import preset
    from k3build.convert import convert
    from k3build.mapping import Mapping
    from k3build.synth import synth

    root = tmp_path_factory.mktemp("gencfg")
    ckpt = synth(root / "ckpt", preset("tiny"), seed=0, progress=False)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 371], **SAMPLING}))
    convert(ckpt, root / "conv", Mapping(), progress=False)
    return build(root / "conv", root / "engine", BuildOptions(dtype="fp32", kv_dtype="fp32"), progress=False)


def test_left_out_fields_take_the_models_defaults(gen_engine, make_server):
    llm = LLM(gen_engine)
    want = llm.generate(FOX, SamplingParams(max_tokens=16, **SAMPLING))[0]
    greedy = llm.generate(FOX, SamplingParams(max_tokens=16, temperature=0))[0]
    assert want.token_ids != greedy.token_ids
    server = make_server(gen_engine)
    try:
        def complete(**fields):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": "k3-tiny", "prompt": FOX, "max_tokens": 16, "return_token_ids": True,
                                 **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        assert complete()["token_ids"] == want.token_ids
        assert complete(temperature=None, repetition_penalty=None)["token_ids"] == want.token_ids  # null: left out
        assert complete(temperature=0, repetition_penalty=1)["token_ids"] == greedy.token_ids
        hello = complete(prompt="Hello world", temperature=0, repetition_penalty=1)
        assert hello["token_ids"] == [227, 21, 371] and hello["finish_reason"] == "stop"  # the second EOS id
    finally:
        server.close()


def test_a_left_out_min_p_takes_the_models(tmp_path, make_server):
    """generation_config.json's min_p (vLLM reads it too): 1.0 keeps the best token alone, at any temperature."""
    from k3build.build import BuildOptions, build
    from k3build.config import preset
    from k3build.convert import convert
    from k3build.mapping import Mapping
    from k3build.synth import synth

    ckpt = synth(tmp_path / "ckpt", preset("tiny"), seed=0, progress=False)
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 1.5, "min_p": 1.0}))
    convert(ckpt, tmp_path / "conv", Mapping(), progress=False)
    engine = build(tmp_path / "conv", tmp_path / "engine", BuildOptions(dtype="fp32", kv_dtype="fp32"),
                   progress=False)
    greedy = LLM(engine).generate(FOX, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    server = make_server(engine)
    try:
        def complete(**fields):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": "k3-tiny", "prompt": FOX, "max_tokens": 12, "return_token_ids": True,
                                 "seed": 1, "ignore_eos": True, **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert complete() == greedy and complete(min_p=None) == greedy
        assert complete(min_p=0) != greedy  # given: taken as it is
    finally:
        server.close()
