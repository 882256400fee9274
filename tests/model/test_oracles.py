"""The oracles the engine is tested against, tested against each other and against transformers.

(a) k3_fp32 (written from K3_SPEC.md) == transformers' KimiLinearForCausalLM on random tiny Kimi-Linear models,
    also after rewriting them in K3 naming; (b) on K3-feature checkpoints every K3-only feature moves the logits,
    and decoding is deterministic; (c) the transformers worker really runs transformers' torch path even when
    kernel packages that would bind are importable.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors import safe_open

from oracles import hf_oracle, k3_fp32, tiny_models  # tests/model is on sys.path (conftest.py)

PROMPT = [1, 17, 200, 5, 99, 42, 42, 7, 150, 3, 250, 11, 64, 128, 31, 8, 77, 190, 2, 45]
N_GREEDY = 32
VARIANTS = sorted(tiny_models.VARIANTS)
ALL_VARIANTS = VARIANTS + sorted(tiny_models.EXTRA_VARIANTS)
SPECS = {**tiny_models.VARIANTS, **tiny_models.EXTRA_VARIANTS}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny ops on a shared 2-core box: intra-op threads only add spin-wait overhead
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def kimi_models(tmp_path_factory):
    """variant -> (checkpoint dir, transformers prompt logits, transformers greedy tokens); one worker for all."""
    dirs = {v: tiny_models.make_kimi_linear(tmp_path_factory.mktemp(f"kl_{v}"), seed=11 + i, variant=v)
            for i, v in enumerate(ALL_VARIANTS)}
    results = hf_oracle.hf_batch([hf_oracle.HFJob(str(d), tuple(PROMPT), N_GREEDY) for d in dirs.values()])
    return {v: (dirs[v], *r) for v, r in zip(dirs, results)}


def test_transformers_saves_original_kimi_naming(kimi_models):
    d, _, _ = kimi_models["base"]
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    p = "model.layers.0.self_attn."
    assert t[p + "A_log"].shape == (1, 1, 2, 1)
    assert t[p + "q_conv1d.weight"].shape == (32, 1, 4) and p + "g_a_proj.weight" in t and p + "g_b_proj.weight" in t
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in t
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in t
    bias = t["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0, "router bias left at zero: routing would never exercise it"
    assert not torch.equal(t["model.layers.0.input_layernorm.weight"], torch.ones(64))
    assert not torch.equal(t[p + "o_norm.weight"], torch.ones(16))


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_k3_fp32_matches_transformers(kimi_models, variant):
    d, ref_logits, ref_greedy = kimi_models[variant]
    logits = k3_fp32.k3_logits(d, PROMPT)
    assert logits.shape == ref_logits.shape == (len(PROMPT), SPECS[variant].vocab_size)
    assert rel_err(logits, ref_logits) < 1e-5
    assert len(set(ref_greedy)) > 4, "degenerate greedy continuation proves little"
    # teacher-forced argmax == greedy decoding, in one forward instead of N_GREEDY
    forced = k3_fp32.k3_logits(d, PROMPT + ref_greedy[:-1])[len(PROMPT) - 1:]
    assert forced.argmax(-1).tolist() == ref_greedy
    assert k3_fp32.k3_greedy(d, PROMPT, 3) == ref_greedy[:3]


def test_float64_mode_bounds_fp32_rounding(kimi_models):
    # both fp32 implementations sit within fp32 rounding of the float64 forward: neither has a real bug
    d, ref_logits, _ = kimi_models["qlora_mixed"]
    exact = k3_fp32.k3_logits(d, PROMPT, dtype=torch.float64)
    assert exact.dtype == np.float64
    assert rel_err(ref_logits, exact) < 1e-5 and rel_err(k3_fp32.k3_logits(d, PROMPT), exact) < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_k3_naming_reader_matches_transformers(kimi_models, tmp_path, variant):
    # same function in K3 naming: language_model. prefix, shards + index, mlp., full-rank g_proj, padded A_log
    d, ref_logits, _ = kimi_models[variant]
    k3_dir = tiny_models.kimi_linear_to_k3_naming(d, tmp_path / "k3naming")
    assert not (k3_dir / "model.safetensors").exists()
    assert rel_err(k3_fp32.k3_logits(k3_dir, PROMPT), ref_logits) < 1e-5


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_routing_exercises_bias_and_experts(kimi_models, variant):
    d, _, _ = kimi_models[variant]
    trace: dict = {}
    with torch.no_grad():
        k3_fp32.forward(k3_fp32.load(d), PROMPT, trace)
    v = SPECS[variant]
    for layer, picks in trace["experts"].items():
        unbiased = trace["experts_unbiased"][layer]
        changed = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(picks, unbiased))
        assert 0 < changed < len(PROMPT), f"layer {layer}: bias changed {changed} of {len(PROMPT)} selections"
        assert len(picks.unique()) >= v.num_experts // 2, f"layer {layer}: only experts {picks.unique().tolist()}"


def test_hf_oracle_single_calls_agree_with_batch(kimi_models):
    d, ref_logits, ref_greedy = kimi_models["base"]
    runs = hf_oracle._worker().count
    # served from the cache the batch filled: no new worker round trip
    np.testing.assert_array_equal(hf_oracle.hf_logits(d, PROMPT), ref_logits)
    assert hf_oracle.hf_greedy(d, PROMPT, 5) == ref_greedy[:5]
    assert hf_oracle.hf_greedy(d, PROMPT, N_GREEDY) == ref_greedy
    assert hf_oracle._worker().count == runs
    assert ref_greedy[0] == int(ref_logits[-1].argmax())


def test_hf_oracle_cache_follows_checkpoint_contents(kimi_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src, ref_logits, _ = kimi_models["base"]
    d = shutil.copytree(src, tmp_path / "copy")
    np.testing.assert_array_equal(hf_oracle.hf_logits(d, PROMPT), ref_logits)  # same bytes elsewhere: a hit
    t = load_file(str(d / "model.safetensors"))
    t["lm_head.weight"][3] += 1.0
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    changed = hf_oracle.hf_logits(d, PROMPT)  # new bytes: recomputed by the (already running) worker
    assert not np.allclose(changed[:, 3], ref_logits[:, 3]) and np.allclose(changed[:, 4], ref_logits[:, 4])


FAKE_KERNELS = {
    "triton/__init__.py": "",
    "causal_conv1d/__init__.py": "def causal_conv1d_fn(*a, **k): raise RuntimeError('fake')\n"
                                 "def causal_conv1d_update(*a, **k): raise RuntimeError('fake')\n",
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "",
    "fla/ops/kda/__init__.py": "def chunk_kda(*a, **k): raise RuntimeError('fake')\n"
                               "def fused_recurrent_kda(*a, **k): raise RuntimeError('fake')\n",
}


def test_hf_worker_blocks_importable_kernel_packages(kimi_models, tmp_path):
    # PITFALLS.md: with fla + triton importable, transformers would bind KDA to them. Fake packages that WOULD bind
    # (they import fine and export the names) and that leave a marker when imported; the worker must not touch them.
    import os
    import subprocess
    import sys

    fake = tmp_path / "fake"
    marker = tmp_path / "imported"
    for rel, body in FAKE_KERNELS.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(f"open({str(marker)!r}, 'a').write({rel!r} + '\\n')\n" + body)
    path = os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])
    probe = subprocess.run([sys.executable, "-c", "import fla.ops.kda as m; print(m.chunk_kda.__module__)"],
                           env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True)
    assert probe.stdout.strip() == "fla.ops.kda" and marker.exists()  # the fakes are what an import would find
    marker.unlink()
    d, ref_logits, ref_greedy = kimi_models["base"]
    client = hf_oracle._Client(env_overrides={"PYTHONPATH": path})
    try:
        (logits, greedy), = client.run([hf_oracle.HFJob(str(d), tuple(PROMPT), 2)])
    finally:
        client.close()
    assert not marker.exists(), f"worker imported {marker.read_text()}"
    np.testing.assert_array_equal(logits, ref_logits)
    assert greedy == ref_greedy[:2]


def test_mxfp4_decoder_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, size=(3, 32), dtype=np.uint8)  # logical [3, 64]
    scale = rng.integers(110, 140, size=(3, 2), dtype=np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(3, 64)
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scales = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    want = vals * np.repeat(scales, 32, axis=1)
    got = k3_fp32.mxfp4_dequant(torch.from_numpy(packed), torch.from_numpy(scale)).numpy()
    np.testing.assert_array_equal(got, want)


def test_attn_res_math():
    torch.manual_seed(0)
    p, b0, b1 = torch.randn(3, 5, 8).unbind(0)
    proj, w = torch.randn(1, 8), torch.rand(8) + 0.5
    torch.testing.assert_close(k3_fp32.attn_res(p, [], proj, w, 1e-5), p)  # one candidate: identity
    out = k3_fp32.attn_res(p, [b0, b1], proj, w, 1e-5)
    for t in range(5):
        cands = [b0[t], b1[t], p[t]]
        s = torch.stack([(c / torch.sqrt((c * c).mean() + 1e-5) * w * proj[0]).sum() for c in cands])
        torch.testing.assert_close(out[t], sum(pi * c for pi, c in zip(torch.softmax(s, 0), cands)))


def _k3_sources():
    try:
        from k3build.synth import synth  # noqa: F401
        return ["synth", "local"]
    except ImportError:
        return ["local"]


@pytest.fixture(scope="module", params=_k3_sources())
def k3_ckpt(request, tmp_path_factory):
    from k3build.config import preset

    out = tmp_path_factory.mktemp(f"k3_{request.param}")
    if request.param == "synth":
        from k3build.synth import synth

        return synth(out, preset("tiny"), seed=5, progress=False)
    return tiny_models.make_k3_tiny(out, seed=5)


def _scaled(ck, suffix: str, factor: float, layers=None):
    hit = {k: v * factor for k, v in ck.raw.items()
           if k.endswith(suffix) and (layers is None or any(k.startswith(f"model.layers.{i}.") for i in layers))}
    assert hit, f"no tensor ends with {suffix!r}"
    return ck.replaced(tensors=hit)


FEATURES = {
    "attn_res_proj": lambda ck: _scaled(ck, "res_proj.weight", 0.0),
    "output_attn_res": lambda ck: _scaled(ck, "output_attn_res_norm.weight", 3.0),
    "mla_output_gate": lambda ck: _scaled(ck, "self_attn.g_proj.weight", 0.0, ck.cfg.mla_layers),
    "kda_output_gate": lambda ck: _scaled(ck, "self_attn.g_proj.weight", 0.0, ck.cfg.kda_layers),
    "lower_bound_gate": lambda ck: ck.replaced(cfg=dataclasses.replace(ck.cfg, kda_gate_lower_bound=None)),
    "situ": lambda ck: ck.replaced(cfg=dataclasses.replace(ck.cfg, hidden_act="silu")),
    "latent_moe_norm": lambda ck: ck.replaced(cfg=dataclasses.replace(ck.cfg, latent_moe_use_norm=False)),
    "router_bias": lambda ck: _scaled(ck, "e_score_correction_bias", 0.0),
    "shared_experts": lambda ck: _scaled(ck, "shared_experts.down_proj.weight", 0.0),
    "mxfp4_scales": lambda ck: ck.replaced(tensors={k: v + 1 for k, v in ck.raw.items() if k.endswith("weight_scale")}),
}


@pytest.fixture(scope="module")
def k3_base(k3_ckpt):
    with torch.no_grad():
        ck = k3_fp32.load(k3_ckpt)
        return ck, k3_fp32.forward(ck, PROMPT)


def test_k3_logits_finite(k3_ckpt, k3_base):
    ck, logits = k3_base
    assert ck.cfg.attn_res_block_size and ck.cfg.is_latent_moe and ck.cfg.kda_gate_lower_bound is not None
    assert logits.shape == (len(PROMPT), ck.cfg.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0
    k3_fp32._loaded.clear()  # the public entry point on a fresh load, not the fixture's cached checkpoint
    np.testing.assert_array_equal(k3_fp32.k3_logits(k3_ckpt, PROMPT), logits.numpy())


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_k3_logits_depend_on_feature(k3_base, feature):
    ck, logits = k3_base
    with torch.no_grad():
        other = k3_fp32.forward(FEATURES[feature](ck), PROMPT)
    assert torch.isfinite(other).all()
    assert rel_err(other.numpy(), logits.numpy()) > 1e-4, f"{feature} does not change the logits"


def test_k3_greedy_deterministic(k3_ckpt):
    first = k3_fp32.k3_greedy(k3_ckpt, PROMPT, 4)
    k3_fp32._loaded.clear()  # a fresh load must decode the same
    assert k3_fp32.k3_greedy(k3_ckpt, PROMPT, 4) == first
    assert all(0 <= t < k3_fp32.load(k3_ckpt).cfg.vocab_size for t in first)
