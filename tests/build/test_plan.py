"""`k3build plan` on the command line: K3 on 16 x H200 (TEP16 fits, DEP16 does not), checkpoints, bad input."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3build.cli import main
from k3build.config import preset, to_hf_wrapper_config, to_hf_text_config
from k3build.mapping import Mapping
from k3build.memory import GiB, plan_memory

ENGINES = Path(__file__).resolve().parents[2] / "engines"
K3_16 = ["plan", "--preset", "k3", "--tp-size", "16", "--ep-size", "16", "--gpu-memory-gib", "139.8"]


def _run(*args):
    return CliRunner().invoke(main, list(args))


def test_tep16_fits_with_spec_numbers():
    res = _run(*K3_16, "--max-seq-len", "131072", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["fits"] and d["reason"] == ""
    assert d["kv_bytes_per_token_model"] == 27_648 and d["kda_state_bytes_per_request_model"] == 449_372_160
    assert d["mapping"]["moe_ep_size"] == 16 and not d["mapping"]["attention_dp"]
    assert len(d["ranks"]) == 16 and all(r["kv_bytes_per_token"] == 27_648 for r in d["ranks"])
    by_len = {int(k): v for k, v in d["concurrency_by_length"].items()}
    held = {int(k): v for k, v in d["memory_requests_by_length"].items()}
    assert sorted(by_len) == sorted(held) == [8192, 32768, 131072]
    assert held[8192] > held[32768] > held[131072] == d["memory_requests"] >= 1
    # max_batch_size 64 caps the running requests where memory holds more
    # (slots taken up to the cap can leave pages for one full-length request fewer than memory holds)
    assert all(min(64, held[n]) - 1 <= by_len[n] <= min(64, held[n]) for n in held) and by_len[8192] == 64
    assert by_len[131072] == d["max_concurrent_requests"]
    want = plan_memory(preset("k3"), Mapping(tp_size=16), gpu_memory_bytes=int(139.8 * GiB), max_seq_len=8192,
                       max_batch_size=64, max_num_tokens=8192)
    assert held[8192] == want.memory_requests


def test_dep16_refused_with_reason():
    res = _run(*K3_16, "--attention-dp", "--max-seq-len", "8192", "--max-num-tokens", "1024")
    assert res.exit_code == 1
    assert "DOES NOT FIT" in res.stdout and "weights alone need 189.9" in res.stdout
    assert "does not fit" not in res.stderr  # said once, in the table's last line
    as_json = _run(*K3_16, "--attention-dp", "--max-seq-len", "8192", "--max-num-tokens", "1024", "--json")
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["fits"] is False
    assert as_json.stderr.strip() == f"Error: does not fit: {json.loads(as_json.stdout)['reason']}"
    # The table shows the replicated attention (57 GiB of KDA) next to the experts.
    row = next(line for line in res.stdout.splitlines() if line.startswith("0-15 ") and "189.94" in line)
    assert "57.08" in row and "84.19" in row


def test_fewer_running_than_memory_holds_says_why():
    """At 8K the KDA slots (max_batch_size 64) cap the running requests; at 48K the 64 slots, given first, leave
    pages for one full-length request fewer than the memory holds: raising max_batch_size would not help there."""
    res = _run("plan", "--recipe", str(ENGINES / "k3_h200_tep16.toml"), "--max-seq-len", "49152")
    assert res.exit_code == 0, res.output
    line = next(x for x in res.stdout.splitlines() if x.startswith("memory holds more: "))
    assert "at 8K (max_batch_size 64 caps the KDA slots)" in line
    assert "28 at 48K (its 64 KDA slots leave pages for 27 of that length)" in line, line


def test_text_report_shows_per_model_facts():
    res = _run(*K3_16, "--max-seq-len", "131072", "--state-dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert "27,648 B/token" in res.stdout and "221.6 MiB/request" in res.stdout
    assert "max concurrent requests (all ranks):" in res.stdout and "at 128K" in res.stdout
    assert res.stdout.rstrip().endswith("FITS")


def test_pp_ranks_get_separate_rows():
    res = _run("plan", "--preset", "k3", "--tp-size", "8", "--pp-size", "2", "--gpu-memory-gib", "191",
               "--max-seq-len", "32768", "--json")
    assert res.exit_code == 0, res.output
    ranks = json.loads(res.stdout)["ranks"]
    assert ranks[0]["weights"]["embedding"] > 0 and ranks[0]["weights"]["lm_head"] == 0
    assert ranks[15]["weights"]["lm_head"] > 0 and ranks[15]["layers"] == [47, 93]
    text = _run("plan", "--preset", "k3", "--tp-size", "8", "--pp-size", "2", "--gpu-memory-gib", "191",
                "--max-seq-len", "32768").stdout
    assert any(line.startswith("0-7 ") for line in text.splitlines())
    # the last stage's first TP rank samples: it alone reserves the penalties' counts (penalty_counts)
    assert any(line.startswith("8 ") for line in text.splitlines())
    assert any(line.startswith("9-15 ") for line in text.splitlines())
    assert "reserve of rank 8:" in text and "penalty_counts 0.05" in text


@pytest.mark.parametrize("flavour", ["wrapper", "text", "converted"])
def test_checkpoint_dir_config(tmp_path, flavour):
    cfg = preset("tiny")
    d = {"wrapper": to_hf_wrapper_config(cfg), "text": to_hf_text_config(cfg),
         "converted": {**cfg.to_dict(), "mapping": Mapping(tp_size=2).to_dict()}}[flavour]
    (tmp_path / "config.json").write_text(json.dumps(d))
    res = _run("plan", str(tmp_path), "--gpu-memory-gib", "0.0625", "--overhead-gib", "0", "--max-seq-len", "1024",
               "--max-batch-size", "8", "--max-num-tokens", "256", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    # A converted checkpoint brings its own mapping; the others default to one rank.
    assert out["mapping"]["tp_size"] == (2 if flavour == "converted" else 1)
    assert out["kv_bytes_per_token_model"] == 3 * (32 + 8) * 2
    # Options override the checkpoint's mapping.
    res = _run("plan", str(tmp_path / "config.json"), "--tp-size", "4", "--gpu-memory-gib", "1",
               "--overhead-gib", "0", "--max-seq-len", "1024", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mapping"]["moe_ep_size"] == 4


@pytest.mark.parametrize("gpu, overhead, flag", [
    ("inf", "0", "--gpu-memory-gib"), ("nan", "0", "--gpu-memory-gib"), ("1e300", "0", "--gpu-memory-gib"),
    ("1e-12", "0", "--gpu-memory-gib"), ("1", "inf", "--overhead-gib"), ("1", "nan", "--overhead-gib"),
    ("1", "1e300", "--overhead-gib"), ("1", "-1", "--overhead-gib")])
def test_memory_sizes_must_be_finite(gpu, overhead, flag):
    res = _run("plan", "--preset", "tiny", "--gpu-memory-gib", gpu, "--overhead-gib", overhead, "--max-seq-len", "64")
    assert res.exit_code != 0 and res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert f"{flag}: expected a number of GiB" in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("value", ["nan", "inf", "1e300"])
def test_recipe_memory_sizes_name_the_field(tmp_path, value):
    text = (ENGINES / "tiny.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("gpu_memory_gib = ", f"gpu_memory_gib = {value}  # ", 1))
    res = _run("plan", "--recipe", str(bad))
    assert res.exit_code == 1 and f"{bad}: build.gpu_memory_gib: expected a number of GiB" in res.stderr, res.output


def test_engine_dtype_option_and_kv_dtypes_are_builds():
    args = ["plan", "--preset", "tiny", "--gpu-memory-gib", "1", "--overhead-gib", "0", "--max-seq-len", "64", "--json"]
    bf, fp = (json.loads(_run(*args, *extra).stdout) for extra in ([], ["--dtype", "fp32", "--kv-dtype", "fp32"]))
    assert fp["dtype"] == "fp32" and fp["kv_dtype_bytes"] == 4 and fp["ranks"][0]["weight_bytes"] > bf["ranks"][0]["weight_bytes"]
    res = _run(*args, "--kv-dtype", "fp8")  # no fp8 cache kernel: build refuses it, so plan does too
    assert res.exit_code == 2 and "'fp8' is not one of 'fp32', 'bf16', 'fp16'" in res.output


def test_expert_format_option():
    args = ["plan", "--preset", "tiny", "--gpu-memory-gib", "1", "--overhead-gib", "0", "--max-seq-len", "64", "--json"]
    mx = json.loads(_run(*args).stdout)["ranks"][0]["weights"]["routed_experts"]
    bf = json.loads(_run(*args, "--expert-format", "bf16").stdout)["ranks"][0]["weights"]["routed_experts"]
    # bf16: 2 B/element; MXFP4: 0.5 B + one scale byte per 32 elements.
    assert bf * (0.5 + 1 / 32) == pytest.approx(mx * 2)


def test_recipe_options_override():
    res = _run("plan", "--recipe", str(ENGINES / "k3_h200_tep16.toml"), "--max-seq-len", "8192", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["max_seq_len"] == 8192 and d["max_batch_size"] == 64 and d["gpu_memory_bytes"] == int(139.8 * GiB)


@pytest.mark.parametrize("args, message", [
    (["--preset", "k3", "--tp-size", "16", "--ep-size", "3"], "--ep-size 3 does not divide --tp-size 16"),
    (["--preset", "k3", "--tp-size", "5"], "not divisible"),
    (["--preset", "tiny", "--max-seq-len", "100000"], "max_position_embeddings"),
    (["--preset", "nope"], "preset: unknown"),
    # checked as `build` checks them: plan passes only what build takes
    (["--preset", "tiny", "--max-num-tokens", "1", "--max-batch-size", "64"],
     "--max-num-tokens (1) must be >= --max-batch-size (64)"),
    (["--preset", "tiny", "--max-seq-len", "1"], "--max-seq-len: expected at least 2 tokens"),
    (["--recipe", str(ENGINES / "k3_h200_tep16.toml"), "--page-size", "32"], "--page-size: 32 on target sm90"),
])
def test_bad_input_is_a_clear_error(args, message):
    full = ["plan", *args]
    if "--max-seq-len" not in args:
        full += ["--max-seq-len", "1024"]
    res = _run(*full, "--gpu-memory-gib", "1")
    assert res.exit_code == 1 and message in res.stderr, res.output


def test_missing_model_or_limits_is_a_usage_error(tmp_path):
    assert _run("plan", "--gpu-memory-gib", "1", "--max-seq-len", "1").exit_code == 2
    assert "required" in _run("plan", "--preset", "tiny").stderr
    (tmp_path / "config.json").write_text("{not json")
    res = _run("plan", str(tmp_path), "--gpu-memory-gib", "1", "--max-seq-len", "64")
    assert res.exit_code == 1 and "config.json" in res.stderr and "not valid JSON" in res.stderr


def test_tiny_report_uses_mib():
    res = _run("plan", "--recipe", str(ENGINES / "tiny_ep4.toml"))
    assert res.exit_code == 0 and "weights per rank (MiB)" in res.stdout
    # rank 0 samples (it alone reserves penalty_counts), ranks 1-3 share one row
    assert any(line.startswith("0 ") for line in res.stdout.splitlines())
    assert any(line.startswith("1-3 ") for line in res.stdout.splitlines())


def test_an_engine_is_named_as_one(k3_tiny_engine):
    """plan given an engine (its config.json nests the model's): said so, pointing at inspect, not a model_type
    error about a field the engine keeps elsewhere."""
    res = _run("plan", str(k3_tiny_engine), "--gpu-memory-gib", "80", "--max-seq-len", "256")
    assert res.exit_code != 0 and "an engine's config, not a checkpoint's" in res.output, res.output
    assert "k3build inspect ENGINE" in res.output and "model_type" not in res.output
