"""`k3build convert`: every mapping's ranks reassemble every source tensor bit-exactly."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from convert_helpers import make_tiny, reassemble, source_tensors
from k3build.cli import main
from k3build.config import K3Config
from k3build.convert import convert
from k3build.mapping import Mapping
from k3build.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3build.output_dir import PID_FILE
from k3build.schema import checkpoint_tensors, from_canonical_name

MAPPINGS = {
    "tp1": Mapping(),
    "tp2": Mapping(tp_size=2),
    "ep4": Mapping(tp_size=4, moe_ep_size=4),
    "tp2xpp2": Mapping(tp_size=2, pp_size=2),
    "pp3": Mapping(pp_size=3),
    "attention_dp2": Mapping(tp_size=2, attention_dp=True),
    "moe_tp2xep2": Mapping(tp_size=4, moe_tp_size=2, moe_ep_size=2),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "ckpt")


def _check_ranks(out, mapping: Mapping, cfg: K3Config) -> None:
    """Each rank file holds exactly the tensors Mapping.shard assigns to it, with the planned slice shapes."""
    canon = checkpoint_tensors(cfg, "canonical")
    for r in range(mapping.world_size):
        with safe_open(str(out / f"rank{r}.safetensors"), "pt") as f:
            want = {n for n in canon if mapping.shard(n, r, cfg) is not None}
            assert set(f.keys()) == want
            for n in want:
                sh = mapping.shard(n, r, cfg)
                shape = list(canon[n][0])
                if sh.dim is not None:
                    a, b = sh.bounds(shape[sh.dim])
                    shape[sh.dim] = b - a
                assert list(f.get_slice(n).get_shape()) == shape, n


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_k3_reassembles_bit_exact(tiny, tmp_path, name):
    mapping = MAPPINGS[name]
    out = convert(tiny, tmp_path / "out", mapping, progress=False)
    conf = json.loads((out / "config.json").read_text())
    cfg = K3Config.from_dict(conf)
    assert Mapping.from_dict(conf["mapping"]) == mapping
    assert cfg.quantization.method == "mxfp4" and conf["source"]["flavour"] == "k3"
    _check_ranks(out, mapping, cfg)
    got, src = reassemble(out), source_tensors(tiny)
    assert set(got) == set(src)
    h = cfg.kda_num_heads
    for n, t in src.items():
        if n.endswith("A_log"):
            assert torch.equal(t[h:], torch.zeros_like(t[h:]))
            t = t[:h]  # canonical A_log drops K3's zero padding
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob(".out.tmp-*")) and not (out / PID_FILE).exists()


def test_workers_give_identical_files(tiny, tmp_path):
    m = Mapping(tp_size=2, pp_size=2)
    a = convert(tiny, tmp_path / "a", m, progress=False)
    b = convert(tiny, tmp_path / "b", m, workers=2, progress=False)
    for r in range(m.world_size):
        assert (a / f"rank{r}.safetensors").read_bytes() == (b / f"rank{r}.safetensors").read_bytes()


def test_dequantize_k3_experts(tiny, tmp_path):
    out = convert(tiny, tmp_path / "out", Mapping(tp_size=2), quantize="none", progress=False)
    cfg = K3Config.from_file(out / "config.json")
    assert cfg.quantization.method == "none"
    got, src = reassemble(out), source_tensors(tiny)
    e = "model.layers.1.block_sparse_moe.experts.3.w2."
    want = dequantize_mxfp4(src[e + "weight_packed"], src[e + "weight_scale"], torch.bfloat16)
    assert torch.equal(got[e + "weight"], want)


def test_cli_and_overwrite(tiny, tmp_path):
    out = tmp_path / "out"
    runner = CliRunner()
    r = runner.invoke(main, ["convert", str(tiny), str(out), "--ep-size", "2"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["mapping"]["moe_ep_size"] == 2
    r = runner.invoke(main, ["convert", str(tiny), str(out), "--tp-size", "1"])
    assert r.exit_code != 0 and "already exists" in r.output
    assert (out / "rank1.safetensors").exists()  # the refused run left the old result alone
    r = runner.invoke(main, ["convert", str(tiny), str(out), "--tp-size", "1", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.glob("rank*")) == ["rank0.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # --overwrite replaces a converted checkpoint only: not the input itself, nor a directory of the user's
    source = sorted(p.name for p in tiny.iterdir())
    for target, message in ((tiny, "is or holds the input"), (tiny.parent, "is or holds the input"),
                            (tmp_path / "mine", "not a converted checkpoint, so --overwrite leaves it alone")):
        if target.name == "mine":
            target.mkdir()
            (target / "keep").write_text("mine")
        r = runner.invoke(main, ["convert", str(tiny), str(target), "--tp-size", "1", "--overwrite"])
        assert r.exit_code != 0 and message in r.output, r.output
    assert sorted(p.name for p in tiny.iterdir()) == source
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["keep"]


# --- a Kimi-Linear checkpoint as transformers saves it ---

@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    hf = KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2, num_local_experts=8,
        linear_head_dim=16, linear_num_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(hf)
    with torch.no_grad():
        for _, b in model.named_buffers():
            if b.is_floating_point():
                b.normal_()  # e_score_correction_bias is a buffer: zero unless set
        for _, p in model.named_parameters():
            p.normal_(std=0.05)
    path = tmp_path_factory.mktemp("kl") / "ckpt"
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", ["tp1", "tp2", "ep4", "tp2xpp2", "attention_dp2"])
def test_kimi_linear_reassembles_bit_exact(kimi_linear, tmp_path, name):
    mapping = MAPPINGS[name]
    out = convert(kimi_linear, tmp_path / "out", mapping, quantize="none", progress=False)
    conf = json.loads((out / "config.json").read_text())
    cfg = K3Config.from_dict(conf)
    assert conf["source"]["flavour"] == "kimi_linear" and cfg.quantization.method == "none"
    _check_ranks(out, mapping, cfg)
    got, src = reassemble(out), source_tensors(kimi_linear)
    assert len(got) == len(src)
    assert "model.layers.0.mlp.gate_proj.weight" in got and "model.layers.0.self_attn.g_a_proj.weight" in got
    for n, t in got.items():
        s = src[from_canonical_name(n, "kimi_linear")]
        if n.endswith("A_log"):
            assert s.shape == (1, 1, cfg.kda_num_heads, 1)
            s = s.reshape(-1)
        assert t.dtype == s.dtype and torch.equal(t, s), n


def test_kimi_linear_quantize_mxfp4(kimi_linear, tmp_path):
    out = convert(kimi_linear, tmp_path / "out", Mapping(tp_size=2), quantize="mxfp4", progress=False)
    cfg = K3Config.from_file(out / "config.json")
    assert cfg.quantization.method == "mxfp4"
    got, src = reassemble(out), source_tensors(kimi_linear)
    e = "model.layers.3.block_sparse_moe.experts.5.w1."
    packed, scale = quantize_mxfp4(src[e + "weight"])
    assert torch.equal(got[e + "weight_packed"], packed) and torch.equal(got[e + "weight_scale"], scale)
    assert e + "weight" not in got


def test_tokenizer_files_travel_and_a_missing_tokenizer_json_is_told(tiny, tmp_path):
    """convert and build carry every tokenizer file (a tiktoken.model too); without tokenizer.json, which k3runtime
    reads, convert and build both warn that the engine will take token ids only (build said nothing)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in tiny.iterdir():
        if f.name != "tokenizer.json":
            (ckpt / f.name).symlink_to(f)
    (ckpt / "tiktoken.model").write_text("IQ== 0\n")
    res = CliRunner().invoke(main, ["convert", str(ckpt), str(tmp_path / "conv")])
    assert res.exit_code == 0, res.output
    assert f"{ckpt}: no tokenizer.json (only tiktoken.model)" in res.stderr and "token ids only" in res.stderr
    res = CliRunner().invoke(main, ["build", str(tmp_path / "conv"), str(tmp_path / "engine"), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "no tokenizer.json (only tiktoken.model)" in res.stderr and "token ids only" in res.stderr
    assert (tmp_path / "engine" / "tiktoken.model").read_text() == "IQ== 0\n"
    res = CliRunner().invoke(main, ["convert", str(tiny), str(tmp_path / "conv2")])
    assert res.exit_code == 0 and "warning" not in res.stderr, res.output
    (ckpt / "tiktoken.model").unlink()  # tokenizer_config.json alone is no tokenizer
    res = CliRunner().invoke(main, ["convert", str(ckpt), str(tmp_path / "conv3")])
    assert res.exit_code == 0 and f"{ckpt}: no tokenizer.json, nor another tokenizer file" in res.stderr, res.output
    res = CliRunner().invoke(main, ["build", str(tmp_path / "conv2"), str(tmp_path / "engine2"), "--no-progress"])
    assert res.exit_code == 0 and "token ids only" not in res.stderr, res.output


def test_cli_fills_in_moe_tp_as_plan_does(tiny, tmp_path):
    """--tp-size with --ep-size and no --moe-tp-size: the experts' remaining split is tp / ep, as `k3build plan`
    reads the same flags, so a mapping planned converts as it was planned; an ep that does not divide tp is named."""
    runner = CliRunner()
    r = runner.invoke(main, ["convert", str(tiny), str(tmp_path / "a"), "--tp-size", "2", "--ep-size", "1"])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "a" / "config.json").read_text())["mapping"]
    assert (m["tp_size"], m["moe_ep_size"], m["moe_tp_size"]) == (2, 1, 2)
    r = runner.invoke(main, ["plan", str(tiny), "--tp-size", "2", "--ep-size", "1", "--json", "--gpu-memory-gib", "80",
                             "--max-seq-len", "1024"])
    assert r.exit_code == 0 and json.loads(r.output)["mapping"] == m, r.output
    r = runner.invoke(main, ["convert", str(tiny), str(tmp_path / "b"), "--tp-size", "3", "--ep-size", "2"])
    assert r.exit_code != 0 and "--ep-size 2 does not divide --tp-size 3" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
