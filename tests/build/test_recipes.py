"""engines/*.toml: every recipe loads, `k3build plan` agrees with its memory, and bad recipes name file + field."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3build.cli import main
from k3build.config import preset, to_hf_wrapper_config
from k3build.mapping import Mapping
from k3build.memory import GiB, plan_memory
from k3build.recipe import RecipeError, load_recipe, load_recipes

ENGINES = Path(__file__).resolve().parents[2] / "engines"
RECIPES = sorted(ENGINES.glob("*.toml"))
REQUIRED = {
    "tiny": Mapping(), "tiny_tp2": Mapping(tp_size=2), "tiny_ep4": Mapping(tp_size=4, moe_ep_size=4),
    "tiny_pp2": Mapping(pp_size=2), "k3_h200_tep16": Mapping(tp_size=16, moe_ep_size=16),
    "k3_h200_dep16": Mapping(tp_size=16, moe_ep_size=16, attention_dp=True),
    "k3_mi300x_pp2_tp8": Mapping(tp_size=8, pp_size=2, moe_ep_size=8),
}


def test_every_deployment_has_a_recipe():
    got = {r.name: r for r in load_recipes(ENGINES)}
    for name, mapping in REQUIRED.items():
        assert got[name].mapping == mapping, name
    assert got["k3_mi300x_pp2_tp8"].build.target == "gfx942" and got["k3_h200_tep16"].build.target == "sm90"
    assert got["tiny"].build.target == "cpu" and got["tiny"].runtime.expert_backend == "local"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_plan_agrees_with_recipe(path):
    rec = load_recipe(path)
    b = rec.build
    # The test's own computation from the recipe's raw values.
    want = plan_memory(rec.model_config(), rec.mapping, gpu_memory_bytes=int(b.gpu_memory_gib * GiB),
                       max_seq_len=b.max_seq_len, max_batch_size=b.max_batch_size, max_num_tokens=b.max_num_tokens,
                       kv_dtype_bytes={"bf16": 2, "fp8": 1}[b.kv_dtype], state_dtype=b.state_dtype,
                       page_size=b.page_size, overhead_bytes=int(b.overhead_gib * GiB))
    assert want.fits == rec.expect_fits, want.reason
    if not rec.expect_fits:
        assert rec.why and "weights" in want.reason
    res = CliRunner().invoke(main, ["plan", "--recipe", str(path), "--json"])
    assert res.exit_code == (0 if want.fits else 1), res.output
    printed = json.loads(res.stdout)
    assert printed["fits"] == want.fits and printed["max_concurrent_requests"] == want.max_concurrent_requests
    for got, r in zip(printed["ranks"], want.ranks, strict=True):
        for key in ("weight_bytes", "kv_bytes_per_token", "kda_state_bytes_per_request", "reserve_bytes",
                    "max_concurrent_requests", "kda_slots", "kv_pages"):
            assert got[key] == getattr(r, key), (r.rank, key)
    text = CliRunner().invoke(main, ["plan", "--recipe", str(path)])
    assert ("FITS" if want.fits else "DOES NOT FIT") in text.stdout


def test_k3_recipes_show_spec_figures():
    tep = load_recipe(ENGINES / "k3_h200_tep16.toml").plan()
    assert tep.kv_bytes_per_token_model == 27_648 and tep.kda_state_bytes_per_request_model == 449_372_160
    assert tep.max_concurrent_requests >= 1 and all(r.kda_slots == 64 for r in tep.ranks)
    dep = load_recipe(ENGINES / "k3_h200_dep16.toml").plan()
    assert abs(dep.ranks[0].weight_bytes / GiB - 193) < 0.03 * 193
    mi = load_recipe(ENGINES / "k3_mi300x_pp2_tp8.toml").plan()
    assert mi.fits and {r.layers for r in mi.ranks} == {(0, 47), (47, 93)}


TINY = """\
description = "t"
[model]
preset = "tiny"
[mapping]
tp_size = 2
[build]
target = "cpu"
max_batch_size = 4
max_num_tokens = 64
max_seq_len = 256
gpu_memory_gib = 0.0625
overhead_gib = 0
[runtime]
expert_backend = "nccl"
"""


@pytest.mark.parametrize("edit, field", [
    (("[runtime]", "[extra]\n[runtime]"), "extra: unknown section"),
    (("tp_size = 2", "tp_size = 2\ntp = 2"), "mapping.tp: unknown field"),
    (("tp_size = 2", 'tp_size = "2"'), "mapping.tp_size: expected int"),
    (("tp_size = 2", "tp_size = true"), "mapping.tp_size: expected int"),
    (("tp_size = 2", "tp_size = 3"), "attention TP=3"),
    (('target = "cpu"', 'target = "sm80"'), "build.target"),
    (("max_seq_len = 256\n", ""), "build.max_seq_len: required"),
    (("max_batch_size = 4", "max_batch_size = 0"), "build.max_batch_size"),
    (("max_num_tokens = 64", "max_num_tokens = 2"), "build.max_num_tokens"),
    (('gpu_memory_gib = 0.0625', 'gpu_memory_gib = 0.0625\nstate_dtype = "fp16"'), "build.state_dtype"),
    (('gpu_memory_gib = 0.0625', 'gpu_memory_gib = 0.0625\nkv_dtype = "int4"'), "build.kv_dtype"),
    (('preset = "tiny"', 'preset = "huge"'), "model.preset"),
    (('preset = "tiny"', 'preset = "tiny"\ncheckpoint = "x"'), "model: give exactly one"),
    (('expert_backend = "nccl"', 'expert_backend = "mpi"'), "runtime.expert_backend"),
    (('expert_backend = "nccl"', 'expert_backend = "local"'), "runtime.expert_backend: 'local'"),
    (('expert_backend = "nccl"', 'expert_backend = "deepep"'), "needs a GPU target"),
    (('expert_backend = "nccl"', 'expert_backend = "nccl"\n[plan]\nexpect_fits = false'), "plan.why"),
    (("[build]", "[build\n"), "not valid TOML"),
    # what `k3build build` refuses, `plan --recipe` must too
    (('target = "cpu"', 'target = "sm90"\npage_size = 32'), "build.page_size: 32 on target sm90"),
    (("max_seq_len = 256", "max_seq_len = 1"), "build.max_seq_len: expected at least 2"),
    (('gpu_memory_gib = 0.0625', 'gpu_memory_gib = 0.0625\nkv_dtype = "fp8"'), "build.kv_dtype: expected one of"),
    (('gpu_memory_gib = 0.0625', 'gpu_memory_gib = nan'), "build.gpu_memory_gib: expected a number of GiB"),
    (('gpu_memory_gib = 0.0625', 'gpu_memory_gib = 1e300'), "build.gpu_memory_gib: expected a number of GiB"),
])
def test_bad_recipe_names_file_and_field(tmp_path, edit, field):
    path = tmp_path / "bad.toml"
    old, new = edit
    assert old in TINY
    path.write_text(TINY.replace(old, new, 1))
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(path) in str(e.value) and field in str(e.value)


def test_binary_recipe_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b"\xff\xfe\x00[build]")
    with pytest.raises(RecipeError, match=f"{path}: not valid TOML"):
        load_recipe(path)


def test_good_recipe_and_checkpoint_relative_to_recipe(tmp_path):
    (tmp_path / "good.toml").write_text(TINY)
    rec = load_recipe(tmp_path / "good.toml")
    assert rec.mapping.moe_ep_size == 2 and rec.build.page_size == 64 and rec.build.state_dtype == "fp32"
    assert rec.plan().gpu_memory_bytes == 64 << 20
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(to_hf_wrapper_config(preset("tiny"))))
    (tmp_path / "ck.toml").write_text(TINY.replace('preset = "tiny"', 'checkpoint = "ckpt"'))
    rec = load_recipe(tmp_path / "ck.toml")
    assert rec.model.checkpoint == ckpt and rec.model_config() == preset("tiny")
    assert rec.plan().fits
    (tmp_path / "big.toml").write_text(TINY.replace("overhead_gib = 0", "overhead_gib = 1"))
    plan = load_recipe(tmp_path / "big.toml").plan()
    assert not plan.fits and "overhead 1.00 GiB" in plan.reason
    (tmp_path / "missing.toml").write_text(TINY.replace('preset = "tiny"', 'checkpoint = "nope"'))
    with pytest.raises(RecipeError, match="model.checkpoint"):
        load_recipe(tmp_path / "missing.toml").model_config()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_feeds_the_builder_options(path):
    from k3build.build.options import BuildOptions

    rec = load_recipe(path)
    opts = BuildOptions(**rec.build_options())
    assert (opts.target, opts.max_seq_len, opts.gpu_memory_gib) == (rec.build.target, rec.build.max_seq_len,
                                                                    rec.build.gpu_memory_gib)
