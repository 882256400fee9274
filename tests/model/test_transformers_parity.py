"""Engine == transformers.KimiLinearForCausalLM (an independent implementation) on random tiny models."""

import numpy as np
import pytest
from engines import build_engine
from oracles.hf_oracle import hf_greedy, hf_logits
from oracles.tiny_models import VARIANTS, make_kimi_linear

from k3runtime import LLM, SamplingParams

PROMPT = [5, 17, 33, 100, 7, 9, 200, 3, 44, 61, 12, 90, 150, 8, 77, 31, 2, 199, 64]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"kl_{request.param}")
    ckpt = make_kimi_linear(root / "hf", seed=3, variant=request.param)
    return ckpt, build_engine(ckpt, root / "engine", quantize="none")


def test_prompt_logits_match_transformers(variant_engine):
    ckpt, engine = variant_engine
    ours = LLM(engine).logits(PROMPT).numpy()
    ref = hf_logits(ckpt, PROMPT)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 2e-5, f"max relative logit error {rel:.2e}"


def test_greedy_tokens_match_transformers(variant_engine):
    ckpt, engine = variant_engine
    out = LLM(engine).generate([PROMPT], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(ckpt, PROMPT, 32)
    assert out.finish_reason == "length"
