"""`k3build synth`: a random checkpoint in K3's real layout, readable by standard tools."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from k3build.cli import main
from k3build.config import K3Config, preset
from k3build.mxfp4 import dequantize_mxfp4
from k3build.output_dir import PID_FILE, _host
from k3build.schema import checkpoint_tensors
from k3build.synth import synth
from k3build.tokenizer import BOS, EOS, PAD, build_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "ckpt"
    r = CliRunner().invoke(main, ["synth", str(out), "--preset", "tiny", "--shards", "3", "--seed", "7"])
    assert r.exit_code == 0, r.output
    return out


def _all(ckpt):
    out = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_layout_matches_schema(ckpt):
    cfg = preset("tiny")
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    tensors = _all(ckpt)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    want = checkpoint_tensors(cfg, "k3")
    assert {k[len("language_model."):] for k in tensors} == set(want)
    names = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}
    for k, t in tensors.items():
        shape, dtype = want[k[len("language_model."):]]
        assert tuple(t.shape) == shape and t.dtype == names[dtype], k
    # Every K3 feature of the tiny preset is present: dense layer 0, KDA, last-two MLA, latent MoE, attn_res.
    for n in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_conv1d.weight",
              "model.layers.7.self_attn.kv_b_proj.weight", "model.layers.8.self_attn.g_proj.weight",
              "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
              "model.layers.5.block_sparse_moe.experts.15.w2.weight_packed", "model.output_attn_res_proj.weight",
              "model.layers.3.self_attention_res_proj.weight"):
        assert "language_model." + n in tensors, n


def test_config_parses_and_values_are_sensible(ckpt):
    cfg = K3Config.from_file(ckpt / "config.json")
    assert cfg == preset("tiny")
    t = _all(ckpt)
    p = "language_model.model.layers."
    a_log = t[p + "0.self_attn.A_log"]
    h = cfg.kda_num_heads
    assert a_log.shape == (32,) and (a_log[h:] == 0).all()
    assert ((a_log[:h] >= 0) & (a_log[:h] <= torch.log(torch.tensor(16.0)))).all()
    assert 0.01 < t[p + "1.self_attn.q_proj.weight"].float().std() < 0.04
    assert (t[p + "1.input_layernorm.weight"].float() - 1).abs().max() < 0.5
    bias = t[p + "1.block_sparse_moe.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    w = dequantize_mxfp4(t[p + "2.block_sparse_moe.experts.0.w1.weight_packed"],
                         t[p + "2.block_sparse_moe.experts.0.w1.weight_scale"])
    assert w.shape == (cfg.moe_intermediate_size, cfg.expert_hidden_size) and 0.01 < w.std() < 0.04
    assert torch.isfinite(w).all()


def test_seed_determinism(tmp_path, ckpt):
    a = synth(tmp_path / "a", preset("tiny"), seed=7, num_shards=1, progress=False)
    one = _all(a)
    three = _all(ckpt)
    assert set(one) == set(three)
    assert all(torch.equal(one[k], three[k]) for k in one)  # shard count does not change values
    b = _all(synth(tmp_path / "b", preset("tiny"), seed=8, num_shards=1, progress=False))
    assert not torch.equal(b["language_model.lm_head.weight"], one["language_model.lm_head.weight"])


def test_existing_out_needs_overwrite(tmp_path):
    """An existing OUT is replaced whole, and only with --overwrite and only when it is a checkpoint: no shard of
    the old one is left beside the new, nothing of the user's is touched, no staging directory stays."""
    out, mine = tmp_path / "ckpt", tmp_path / "mine"
    runner = CliRunner()
    assert runner.invoke(main, ["synth", str(out), "--shards", "3"]).exit_code == 0
    r = runner.invoke(main, ["synth", str(out), "--shards", "2"])
    assert r.exit_code != 0 and "already exists; pass --overwrite" in r.output
    assert len(list(out.glob("model-*-of-00003.safetensors"))) == 3
    r = runner.invoke(main, ["synth", str(out), "--shards", "2", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == [f"model-0000{i}-of-00002.safetensors"
                                                                        for i in (1, 2)]
    assert not (out / PID_FILE).exists()  # a finished output is no run's staging dir
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    # a directory of the user's, even one with a config.json (a real checkpoint, an engine), is not synth's
    for config in (None, {"my": "settings"}, {"model_type": "kimi_k3"}, {"version": 1, "build_config": {}}):
        if config is not None:
            (mine / "config.json").write_text(json.dumps(config))
        r = runner.invoke(main, ["synth", str(mine), "--overwrite"])
        assert r.exit_code != 0 and "not a checkpoint synth wrote, so --overwrite leaves it alone" in r.output
        assert (mine / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "mine"]


def test_sigterm_leaves_no_staging_and_a_killed_runs_is_removed(tmp_path):
    """SIGTERM mid-write exits through the clean-up (as Ctrl-C does); a staging dir left by a killed run (its pid
    gone) is removed by the next synth of the same OUT."""
    out = tmp_path / "ckpt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = tmp_path / ".ckpt.tmp-x"
    killed.mkdir()
    (killed / PID_FILE).write_text(f"{dead.pid} {_host()} 1\n")  # (a start time no live process has)
    proc = subprocess.Popen([sys.executable, "-m", "k3build.cli", "synth", str(tmp_path / "big"), "--preset", "small",
                             "--num-layers", "2", "--num-experts", "16"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".big.tmp-*/*.safetensors")):  # writing
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert not (tmp_path / "big").exists() and not list(tmp_path.glob(".big.tmp-*"))
    assert CliRunner().invoke(main, ["synth", str(out)]).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_tokenizer(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    cfg = preset("tiny")
    assert len(tok) == cfg.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("Hello café 東京 😀").input_ids
    assert tok.decode(ids) == "Hello café 東京 😀" and max(ids) < cfg.vocab_size
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == f"{BOS}<|im_user|>user<|im_middle|>hi{EOS}<|im_assistant|>assistant<|im_middle|>"


def test_tokenizer_ids_follow_config():
    k3 = preset("k3")
    tok = build_tokenizer(k3)
    assert tok.get_vocab_size() == k3.vocab_size
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [163584, 163586, 163839]


def test_a_checkpoint_larger_than_the_disk_is_refused_up_front(tmp_path):
    """K3 itself (about 1.4 TiB) on this machine's disk: refused before anything is written, naming both sizes."""
    import shutil

    out = tmp_path / "k3"
    if shutil.disk_usage(tmp_path).free > 2 * 2**40:
        pytest.skip("this disk has room for K3")
    r = CliRunner().invoke(main, ["synth", str(out), "--preset", "k3"])
    assert r.exit_code != 0 and f"{out}: needs 1,487,699.1 MiB, but" in r.output and "MiB free" in r.output, r.output
    assert list(tmp_path.iterdir()) == []
