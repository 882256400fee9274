"""`k3build build` on bad input: a clear message, a non-zero exit, and nothing left behind.

Every refusal goes through the real CLI; after it the output's parent dir holds no ENGINE and no staging dir.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from k3plugins import registry

from k3build.output_dir import PID_FILE, _host, _start_time
from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping

ROOT = Path(__file__).parents[2]
FAST = ["--dtype", "fp32", "--kv-dtype", "fp32", "--max-seq-len", "256", "--max-num-tokens", "256", "--no-progress"]


@pytest.fixture(scope="module")
def converted(k3_tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conv")
    return {name: convert(k3_tiny_ckpt, root / name, m, progress=False)
            for name, m in {"tp1": Mapping(), "tp2": Mapping(tp_size=2)}.items()}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _build(converted_dir, out: Path, *args: str):
    res = CliRunner().invoke(main, ["build", str(converted_dir), str(out), *FAST, *args])
    return res


def _refused(res, out: Path, *words: str) -> None:
    assert res.exit_code != 0, res.output
    msg = res.output + (res.stderr if res.stderr_bytes else "")
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert "Traceback" not in msg
    assert not out.exists()
    if out.parent.exists():  # a refusal before the first write does not even create the parent
        assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


def test_missing_converted_dir(tmp_path):
    out = tmp_path / "out" / "engine"
    _refused(_build(tmp_path / "nope", out), out, "nope", "does not exist")


def test_hf_checkpoint_is_not_converted(k3_tiny_ckpt, tmp_path):
    out = tmp_path / "engine"
    _refused(_build(k3_tiny_ckpt, out), out, "HF checkpoint", "k3build convert")


def test_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "engine"
    _refused(_build(tmp_path / "empty", out), out, "not a converted checkpoint", "config.json")


def test_missing_rank_file(converted, tmp_path):
    conv = _copy(converted["tp2"], tmp_path / "conv")
    (conv / "rank1.safetensors").unlink()
    out = tmp_path / "engine"
    _refused(_build(conv, out), out, "rank1.safetensors: missing", "world_size 2")


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_rank_file(converted, tmp_path, damage):
    conv = _copy(converted["tp1"], tmp_path / "conv")
    f = conv / "rank0.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:8] + b"{not json" + data[17:])
    out = tmp_path / "engine"
    _refused(_build(conv, out), out, "rank0.safetensors", "corrupt" if damage == "header" else "rank0")


def test_rank_file_of_another_conversion(converted, k3_tiny_ckpt, tmp_path):
    """Same config and mapping, but rank1 comes from a conversion of another copy of the checkpoint (a stale file
    on one node, say): refused by the conversion id; a rerun on the same files gives the same bytes."""
    other_ckpt = _copy(k3_tiny_ckpt, tmp_path / "other_ckpt")
    other = convert(other_ckpt, tmp_path / "other", Mapping(tp_size=2), progress=False)
    again = convert(k3_tiny_ckpt, tmp_path / "again", Mapping(tp_size=2), progress=False)
    assert (again / "rank1.safetensors").read_bytes() == (converted["tp2"] / "rank1.safetensors").read_bytes()
    conv = _copy(converted["tp2"], tmp_path / "conv")
    shutil.copy(other / "rank1.safetensors", conv / "rank1.safetensors")
    out = tmp_path / "engine"
    _refused(_build(conv, out), out, "rank1.safetensors: written by another run of convert",
             "files of two conversions mixed")


def test_rank_files_of_another_mapping(converted, tmp_path):
    # config.json says TP2 but the files are TP1's rank0 twice
    conv = _copy(converted["tp1"], tmp_path / "conv")
    raw = json.loads((conv / "config.json").read_text())
    raw["mapping"] = Mapping(tp_size=2).to_dict()
    (conv / "config.json").write_text(json.dumps(raw))
    shutil.copy(conv / "rank0.safetensors", conv / "rank1.safetensors")
    out = tmp_path / "engine"
    _refused(_build(conv, out), out, "rank0.safetensors", "world size 1", "expected rank 0 of 2")


def test_slices_of_another_mapping(converted, tmp_path):
    # Same world size, different split: TP2 with experts EP2 on disk, config.json claims MoE-TP2.
    conv = _copy(converted["tp2"], tmp_path / "conv")
    raw = json.loads((conv / "config.json").read_text())
    raw["mapping"] = Mapping(tp_size=2, moe_tp_size=2).to_dict()
    (conv / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "engine"
    _refused(_build(conv, out), out, "rank0.safetensors", "block_sparse_moe.experts", "convert again")


def _retensor(conv: Path, fn) -> None:
    """Rewrite rank0.safetensors with fn applied to its tensors, its metadata (k3_rank, k3_slices) kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = conv / "rank0.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    fn(tensors)
    save_file(tensors, str(path), metadata=meta)


EXPERT = "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"


@pytest.mark.parametrize("damage, words", [
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].reshape(-1, 256)}),
     ["tensor 'lm_head.weight' is [256, 256], expected [512, 128]"]),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].reshape(64, 2)}),
     ["tensor 'model.norm.weight' is [64, 2], expected [128]"]),
    (lambda t: t.update({EXPERT: t[EXPERT].view(torch.int8)}), [f"tensor '{EXPERT}' is I8", "has U8"]),
    # bf16 bits relabelled fp16: a K3 conversion writes each float tensor in its canonical dtype
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].view(torch.float16)}),
     ["tensor 'lm_head.weight' is F16", "has BF16"]),
    (lambda t: t.pop("model.norm.weight"), ["tensors of rank 0 missing, the first 'model.norm.weight'"]),
    (lambda t: t.update({"model.extra.weight": torch.zeros(2)}), ["tensor 'model.extra.weight' is not one of"]),
    # bytes changed after convert, which refuses both: NaN logits otherwise, and a runtime asking for a rebuild
    (lambda t: t["model.norm.weight"].__setitem__(3, float("nan")), ["'model.norm.weight' holds NaN or Inf",
                                                                    "which convert refuses"]),
    (lambda t: t[EXPERT.replace("packed", "scale")].view(-1).__setitem__(5, 0xFF),
     ["scale byte 0xFF (NaN in E8M0)", "expected bytes 0..252 (1 bad bytes), which convert refuses"]),
], ids=["reshaped", "reshaped-norm", "dtype", "float-dtype", "missing", "unknown", "nan", "scale"])
def test_rank_tensors_unlike_the_model(converted, tmp_path, damage, words):
    """Headers that read well but do not hold the model config.json describes: refused by tensor at build time,
    not as a shape error at the first generate."""
    conv = _copy(converted["tp1"], tmp_path / "conv")
    _retensor(conv, damage)
    out = tmp_path / "engine"
    _refused(_build(conv, out), out, "rank0.safetensors", *words)


def test_config_sizes_unlike_the_rank_files(converted, tmp_path):
    conv = _copy(converted["tp1"], tmp_path / "conv")
    raw = json.loads((conv / "config.json").read_text())
    raw["vocab_size"] = 1024
    (conv / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "engine"
    _refused(_build(conv, out), out, "rank0.safetensors", "is a slice of [512, 128]", "has [1024, 128]")


def test_extra_rank_file(converted, tmp_path):
    conv = _copy(converted["tp1"], tmp_path / "conv")
    shutil.copy(conv / "rank0.safetensors", conv / "rank1.safetensors")
    out = tmp_path / "engine"
    _refused(_build(conv, out), out, "rank1.safetensors beyond the mapping's world_size 1")


@pytest.mark.parametrize("args, words", [
    (["--target", "tpu"], ["--target", "tpu"]),
    (["--max-batch-size", "16", "--max-num-tokens", "8"], ["--max-num-tokens (8)", "--max-batch-size (16)"]),
    (["--target", "sm90", "--page-size", "32"], ["--page-size: 32", "64"]),
    (["--max-seq-len", "-1"], ["--max-seq-len", "-1"]),
    (["--max-batch-size", "0"], ["--max-batch-size", "0"]),
    (["--max-seq-len", "1"], ["--max-seq-len: expected at least 2 tokens, got 1"]),
    (["--gpu-memory-gib", "-2"], ["--gpu-memory-gib", "-2"]),
    (["--gpu-memory-gib", "1", "--overhead-gib", "-1"], ["--overhead-gib", "-1"]),
    (["--gpu-memory-gib", "inf"], ["--gpu-memory-gib: expected a number of GiB above 0 and at most 1048576, got inf"]),
    (["--gpu-memory-gib", "nan"], ["--gpu-memory-gib: expected a number of GiB above 0", "got nan"]),
    (["--gpu-memory-gib", "1e300"], ["--gpu-memory-gib: expected a number of GiB above 0", "got 1e+300"]),
    (["--overhead-gib", "inf"], ["--overhead-gib: expected a number of GiB 0 or more and at most 1048576, got inf"]),
    (["--max-seq-len", "100000"], ["--max-seq-len: 100000", "max_position_embeddings (4096"]),
    (["--expert-backend", "deepep"], ["--expert-backend deepep: DeepEP runs on GPUs"]),
    (["--max-batch-size", str(10**11), "--max-num-tokens", str(10**11)],
     ["100000000000 KDA slots", "lower the limits, or give --gpu-memory-gib"]),
], ids=["target", "tokens<batch", "page-size-sm90", "neg-seq", "zero-batch", "seq-1", "neg-mem", "neg-overhead", "inf-mem",
     "nan-mem", "huge-mem", "inf-overhead", "seq>positions", "deepep-on-cpu", "huge-caches"])
def test_bad_options(converted, tmp_path, args, words):
    out = tmp_path / "engine"
    # the last occurrence of an option wins, so these override FAST's
    _refused(_build(converted["tp1"], out, *args), out, *words)


def test_local_exchange_needs_one_ep_rank(converted, tmp_path):
    out = tmp_path / "engine"
    _refused(_build(converted["tp2"], out, "--expert-backend", "local"), out, "--expert-backend local",
             "moe_ep_size=2", "use nccl or deepep")


def test_existing_engine_needs_overwrite(converted, tmp_path):
    """An existing ENGINE needs --overwrite, which replaces only an engine or an empty directory: a directory of
    the user's, or the build's own input, is left as it was."""
    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep").write_text("mine")
    res = _build(converted["tp1"], out)
    assert res.exit_code != 0 and "already exists" in res.output and "--overwrite" in res.output
    res = _build(converted["tp1"], out, "--overwrite")
    assert res.exit_code != 0 and "not an engine, so --overwrite leaves it alone" in res.output
    assert [p.name for p in out.iterdir()] == ["keep"] and (out / "keep").read_text() == "mine"
    (out / "keep").unlink()
    for what in ("an empty directory", "an engine"):
        res = _build(converted["tp1"], out, "--overwrite")
        assert res.exit_code == 0, (what, res.output)
        assert (out / "config.json").exists()
    inputs = sorted(p.name for p in converted["tp1"].iterdir())
    res = _build(converted["tp1"], converted["tp1"], "--overwrite")
    assert res.exit_code != 0 and "is or holds the input" in res.output
    assert sorted(p.name for p in converted["tp1"].iterdir()) == inputs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_memory_budget_refusal_has_numbers(converted, tmp_path):
    out = tmp_path / "engine"
    res = _build(converted["tp1"], out, "--gpu-memory-gib", "0.0001")
    _refused(res, out, "does not fit", "--gpu-memory-gib 0.0001", "rank 0", "MiB")
    # with no overhead held back, 0.05 GiB holds the tiny model's weights and one request
    res = _build(converted["tp1"], out, "--gpu-memory-gib", "0.05", "--overhead-gib", "0")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["memory_plan"]["budget"]["ranks"][0]["reserve"]["overhead"] == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_memory_budget_counts_the_engine_dtype(converted, tmp_path, dtype):
    """The budget's weights are the rank's tensors as written, in the engine's dtype, KDA in_proj's zero rows
    included."""
    out = tmp_path / "engine"
    res = _build(converted["tp1"], out, "--gpu-memory-gib", "1.0625", "--dtype", dtype)
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    planned = cfg["memory_plan"]["budget"]["ranks"][0]["weight_bytes"]
    with safe_open(out / "rank0" / "weights.safetensors", "pt") as f:
        written = sum(f.get_tensor(name).nbytes for name in f.keys())
    assert planned == written


def test_caches_without_a_budget_are_noted(converted, tmp_path):
    out = tmp_path / "engine"
    res = _build(converted["tp1"], out)
    assert res.exit_code == 0, res.output
    assert "no --gpu-memory-gib: 8 KDA slots and 32 MLA pages" in res.output


def test_memory_budget_that_fits_sizes_the_caches(converted, tmp_path):
    out = tmp_path / "engine"
    res = _build(converted["tp1"], out, "--gpu-memory-gib", "1.0625", "--max-seq-len", "1024")
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "config.json").read_text())["memory_plan"]
    assert plan["budget"]["fits"] and plan["budget"]["gpu_memory_bytes"] == int(1.0625 * 2**30)
    rank = plan["budget"]["ranks"][0]
    assert plan["num_slots"] == min(8, rank["kda_slots"])
    assert plan["num_pages"] == min(8 * 1024 // 64, rank["kv_pages"])
    text = CliRunner().invoke(main, ["inspect", str(out)]).output
    budget = plan["budget"]
    assert (f"{budget['max_concurrent_requests']} requests of 1024 tokens run at once (memory holds "
            f"{budget['memory_requests']}: max_batch_size 8 caps the KDA slots)") in text
    assert budget["max_concurrent_requests"] == 8
    assert f"room for {rank['kda_slots']} slots and {rank['kv_pages']} pages" in text


def test_recipe_supplies_the_options(converted, tmp_path):
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", str(converted["tp1"]), str(out), "--recipe",
                                    str(ROOT / "engines" / "tiny.toml"), "--max-batch-size", "4", "--no-progress"])
    assert res.exit_code == 0, res.output
    b = json.loads((out / "config.json").read_text())
    bc = b["build_config"]
    # from engines/tiny.toml; the flag wins over the recipe
    assert (bc["max_num_tokens"], bc["max_seq_len"], bc["kv_dtype"], bc["gpu_memory_gib"]) == (256, 1024, "bf16", 1.0625)
    assert bc["max_batch_size"] == 4 and bc["overhead_gib"] == 1.0 and bc["expert_backend"] == "local"
    assert b["memory_plan"]["budget"]["max_batch_size"] == 4


def test_recipe_of_another_mapping_is_refused(converted, tmp_path):
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", str(converted["tp1"]), str(out), "--recipe",
                                    str(ROOT / "engines" / "tiny_tp2.toml"), "--no-progress"])
    _refused(res, out, "tiny_tp2.toml", "[mapping]", "tp_size=2", "tp_size=1")


def _cli(*args: str, block_triton: bool = False, slow: float = 0.0, **kw) -> subprocess.Popen:
    """The real `k3build` CLI in a child process; `slow` sleeps per written tensor so a signal lands mid-build."""
    code = ("import sys, time\n"
            + ("sys.modules['triton'] = None\n" if block_triton else "")  # `import triton` then raises ImportError
            + "import k3build.build.engine as eng\n"
            + "orig = eng.engine_tensors\n"
            + f"def slow(*a, **kw):\n    for x in orig(*a, **kw):\n        time.sleep({slow})\n        yield x\n"
            + ("eng.engine_tensors = slow\n" if slow else "")
            + "from k3build.cli import main\nmain(sys.argv[1:])\n")
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, **kw)


def test_sm90_without_triton_uses_what_runs(converted, tmp_path):
    out = tmp_path / "engine"
    p = _cli("build", str(converted["tp1"]), str(out), "--target", "sm90", *FAST, block_triton=True)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    plugins = json.loads((out / "config.json").read_text())["build_config"]["plugins"]
    for op, t in plugins.items():
        impl = registry.find(op, t["tactic"])
        assert impl.needs != "triton" and "sm90" in impl.targets, (op, t)
        # a preferred triton tactic that was passed over is reported, naming the package
        skipped = [i for i in registry.IMPLS if i.op == op and i.needs == "triton" and "sm90" in i.targets]
        if skipped:
            assert f"{op}: using the {t['tactic']!r} tactic on sm90" in stderr and "'triton'" in stderr


def _wait_for(path_glob: Path, pattern: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if any(f.stat().st_size for f in path_glob.glob(pattern)):  # the first tensor is being written
                return
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"build ended before the signal: {proc.communicate()}")
        time.sleep(0.02)
    pytest.fail(f"no {pattern} under {path_glob} after {timeout}s")


def test_sigkill_mid_build_leaves_no_engine_and_next_build_cleans(converted, tmp_path):
    out = tmp_path / "engine"
    p = _cli("build", str(converted["tp1"]), str(out), *FAST, slow=0.05)
    _wait_for(tmp_path, ".engine.tmp-*/rank0/weights.safetensors.data", p)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=30)
    assert not out.exists()
    stale = [d for d in tmp_path.iterdir() if d.name.startswith(".engine.tmp-")]
    assert len(stale) == 1 and (stale[0] / PID_FILE).exists()
    # a live build's staging dir (this process's) survives the clean-up, and the build refuses to write its OUT
    # meanwhile: the last to finish would replace the other's engine
    live = tmp_path / ".engine.tmp-live"
    live.mkdir()
    (live / PID_FILE).write_text(f"{os.getpid()} {_host()} {_start_time(os.getpid())}\n")
    res = _build(converted["tp1"], out)
    assert res.exit_code == 1 and f"engine: another k3build run is writing it (pid {os.getpid()})" in res.output
    assert sorted(d.name for d in tmp_path.iterdir()) == [".engine.tmp-live"]  # the dead run's dir went
    shutil.rmtree(live)  # that run ended
    res = _build(converted["tp1"], out)
    assert res.exit_code == 0, res.output
    assert sorted(d.name for d in tmp_path.iterdir()) == ["engine"]


def test_a_second_build_into_a_busy_out_is_refused(converted, tmp_path):
    """Two real builds into one OUT: the one started while the other writes is refused, naming the other's pid, and
    leaves nothing; the first ends with its engine in place."""
    out = tmp_path / "engine"
    first = _cli("build", str(converted["tp1"]), str(out), *FAST, slow=0.05)
    _wait_for(tmp_path, ".engine.tmp-*/rank0/weights.safetensors.data", first)
    res = _build(converted["tp2"], out, "--overwrite")
    assert res.exit_code == 1 and f"engine: another k3build run is writing it (pid {first.pid})" in res.output
    assert len(list(tmp_path.glob(".engine.tmp-*"))) == 1 and not out.exists()  # the first's staging dir alone
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert json.loads((out / "config.json").read_text())["mapping"]["tp_size"] == 1


def test_other_runs_names_who_writes(tmp_path):
    """other_runs: a live pid here, a run on another host (not checkable: named with the dir to remove), a run just
    starting (no pid file yet); not a dead run's dir nor the caller's own."""
    from k3build.output_dir import other_runs

    me = os.getpid()
    for name, line in {"live": f"{me} {_host()} {_start_time(me)}", "far": "7 elsewhere 1", "young": None,
                       "dead": f"{me} {_host()} 1", "own": f"{me} {_host()} {_start_time(me)}"}.items():
        d = tmp_path / f".engine.tmp-{name}"
        d.mkdir()
        if line is not None:
            (d / PID_FILE).write_text(line)
    found = other_runs(tmp_path / "engine", own=tmp_path / ".engine.tmp-own")
    assert found == [f"pid 7 on elsewhere, which this machine cannot check: if no run is there, remove "
                     f"{tmp_path / '.engine.tmp-far'}", f"pid {me}", "a run just starting (no pid file yet)"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_mid_build_removes_everything(converted, tmp_path, sig):
    out = tmp_path / "engine"
    p = _cli("build", str(converted["tp1"]), str(out), *FAST[:-1], slow=0.05)  # with the progress bar
    _wait_for(tmp_path, ".engine.tmp-*/rank0/weights.safetensors.data", p)
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, stderr  # 130 for Ctrl-C, 143 for SIGTERM, as convert and synth
    assert "build interrupted" in stderr and "Traceback" not in stderr
    assert "build rank0" in stderr  # the tqdm bar was running
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_per_layer(converted, tmp_path):
    res = CliRunner().invoke(main, ["build", str(converted["tp2"]), str(tmp_path / "engine"), *FAST[:-1]])
    assert res.exit_code == 0, res.output
    err = res.stderr
    assert "build rank0" in err and "build rank1" in err and "9/9" in err and "layer" in err


def test_bad_recipe_value_names_the_recipe(converted, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text((ROOT / "engines" / "tiny.toml").read_text().replace('kv_dtype = "bf16"', 'kv_dtype = "fp8"'))
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", str(converted["tp1"]), str(out), "--recipe", str(recipe), "--no-progress"])
    _refused(res, out, "r.toml: build.kv_dtype: expected one of fp32, bf16, fp16, got 'fp8'")
    # a recipe value that is wrong only beside a flag's (tiny.toml: max_num_tokens 256)
    good = ROOT / "engines" / "tiny.toml"
    res = CliRunner().invoke(main, ["build", str(converted["tp1"]), str(out), "--recipe", str(good),
                                    "--max-batch-size", "512", "--no-progress"])
    _refused(res, out, "tiny.toml [build]: --max-num-tokens (256) must be >= --max-batch-size (512)")


def test_clean_stale_tells_dead_from_live(tmp_path):
    from k3build.output_dir import NO_PID_GRACE_S, clean_stale

    host, me = _host(), os.getpid()
    dirs = {"live": f"{me} {host} {_start_time(me)}", "reused-pid": f"{me} {host} 1",
            "other-host": f"1 not-{host} 1", "garbage": "x", "young-no-pid": None, "old-no-pid": None}
    for name, pid in dirs.items():
        d = tmp_path / f".engine.tmp-{name}"
        d.mkdir()
        if pid is not None:
            (d / PID_FILE).write_text(pid)
    old = time.time() - NO_PID_GRACE_S - 5
    os.utime(tmp_path / ".engine.tmp-old-no-pid", (old, old))
    (tmp_path / ".other.tmp-x").mkdir()  # another engine's staging dir is not ours to judge
    (tmp_path / ".engine.old-x").mkdir()  # an old output moved aside while its replacement moves in
    removed = {p.name for p in clean_stale(tmp_path / "engine")}
    assert removed == {".engine.tmp-reused-pid", ".engine.tmp-garbage", ".engine.tmp-old-no-pid"}
    assert {p.name for p in tmp_path.iterdir()} == {".engine.tmp-live", ".engine.tmp-other-host",
                                                    ".engine.tmp-young-no-pid", ".other.tmp-x", ".engine.old-x"}


def test_an_output_under_a_file_is_refused_by_name(converted, k3_tiny_ckpt, tmp_path):
    """synth, convert and build with a file where OUT's directory should be: one line naming it, no traceback,
    nothing written."""
    (tmp_path / "afile").write_text("not a directory")
    for args in (["synth", str(tmp_path / "afile" / "ck")],
                 ["convert", str(k3_tiny_ckpt), str(tmp_path / "afile" / "c")],
                 ["build", str(converted["tp1"]), str(tmp_path / "afile" / "e"), *FAST]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (args[0], res.output, res.exception)
        assert f"cannot make its directory {tmp_path / 'afile'} (a file is in the way" in res.output, res.output
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_binary_config_files_are_named(converted, k3_tiny_ckpt, tmp_path):
    """A config.json that is not text (a binary copied in its place), and plan given a shard for the checkpoint's
    config: each refused naming the file, not with a bare codec error."""
    conv = _copy(converted["tp1"], tmp_path / "conv")
    (conv / "config.json").write_bytes(bytes(range(128, 256)))
    res = _build(conv, tmp_path / "engine")
    assert res.exit_code != 0 and f"{conv / 'config.json'}: not valid JSON (not UTF-8 text" in res.output, res.output
    shard = next(k3_tiny_ckpt.glob("*.safetensors"))
    res = CliRunner().invoke(main, ["plan", str(shard), "--gpu-memory-gib", "80", "--max-seq-len", "1024"])
    assert res.exit_code != 0 and f"{shard}: not valid JSON (not UTF-8 text" in res.output, res.output
