"""K3-only features (attn_res, latent MoE, MLA output gate, SiTU, lower-bound gate, MXFP4 experts): the engine
against the separate fp32 reference written from K3_SPEC.md (tests/model/oracles/k3_fp32.py)."""

import numpy as np
import torch
from engines import build_engine
from oracles.k3_fp32 import k3_greedy, k3_logits

from k3runtime import LLM, SamplingParams

PROMPT = [1, 40, 97, 311, 5, 260, 18, 77, 402, 9, 133, 64, 250, 3, 88, 500, 12]


def test_k3_tiny_logits_match_fp32_reference(k3_tiny_ckpt, k3_tiny_engine):
    ours = LLM(k3_tiny_engine).logits(PROMPT).numpy()
    ref = k3_logits(k3_tiny_ckpt, PROMPT)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 2e-5, f"max relative logit error {rel:.2e}"


def test_k3_tiny_greedy_matches_fp32_reference(k3_tiny_ckpt, k3_tiny_engine):
    out = LLM(k3_tiny_engine).generate(PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == k3_greedy(k3_tiny_ckpt, PROMPT, 32)


def test_bf16_engine_tracks_fp32(k3_tiny_ckpt, k3_tiny_engine, tmp_path):
    bf16 = build_engine(k3_tiny_ckpt, tmp_path / "bf16", dtype="bf16", kv_dtype="bf16")
    a = LLM(k3_tiny_engine).logits(PROMPT).flatten()
    b = LLM(bf16).logits(PROMPT).flatten()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    rel_l2 = (a - b).norm() / a.norm()
    assert cos > 0.999 and rel_l2 < 3e-2, (float(cos), float(rel_l2))
