"""`--expert-backend deepep` where it can never run: k3runtime refuses a DeepEP engine whose activations are not bf16
at every start, and demands the deep_ep package at start-up even for a mapping whose graph has no expert exchange
(attention TP, or one EP rank). The build wrote both engines; it must refuse them by the option's name."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping
from k3build.recipe import RecipeError, load_recipe

FAST = ["--max-seq-len", "256", "--max-num-tokens", "256", "--no-progress"]


@pytest.fixture(scope="module")
def converted(k3_tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    return {name: convert(k3_tiny_ckpt, root / name, m, progress=False)
            for name, m in {"tep2": Mapping(tp_size=2), "dep2": Mapping(tp_size=2, attention_dp=True)}.items()}


def _build(conv, out, *args):
    return CliRunner().invoke(main, ["build", str(conv), str(out), "--target", "sm90", *FAST, *args])


def _refused(res, out, *words):
    assert res.exit_code == 1, res.output
    for w in words:
        assert w in res.output, (w, res.output)
    assert "Traceback" not in res.output and not out.exists()


def test_deepep_without_an_exchange_is_refused(converted, tmp_path):
    out = tmp_path / "engine"
    _refused(_build(converted["tep2"], out, "--expert-backend", "deepep"), out, "--expert-backend deepep",
             "attention_dp=False", "use nccl")


def test_deepep_needs_bf16_activations(converted, tmp_path):
    out = tmp_path / "engine"
    _refused(_build(converted["dep2"], out, "--expert-backend", "deepep", "--dtype", "fp32"), out,
             "--expert-backend deepep", "--dtype", "fp32")


def test_deepep_under_attention_dp_and_ep_builds(converted, tmp_path):
    res = _build(converted["dep2"], tmp_path / "engine", "--expert-backend", "deepep")
    assert res.exit_code == 0, res.output


RECIPE = """\
[model]
preset = "tiny"
[mapping]
tp_size = 2
{adp}
[build]
target = "sm90"
max_batch_size = 4
max_num_tokens = 64
max_seq_len = 256
gpu_memory_gib = 1.0625
{dtype}
[runtime]
expert_backend = "deepep"
"""


@pytest.mark.parametrize("adp, dtype, words", [
    ("", "", ["runtime.expert_backend", "attention_dp=false", "use 'nccl'"]),
    ("attention_dp = true", 'dtype = "fp32"', ["runtime.expert_backend", "build.dtype = 'fp32'"]),
])
def test_recipe_deepep_checked_as_build_checks_it(tmp_path, adp, dtype, words):
    path = tmp_path / "r.toml"
    path.write_text(RECIPE.format(adp=adp, dtype=dtype))
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    path.write_text(RECIPE.format(adp="attention_dp = true", dtype=""))
    assert load_recipe(path).runtime.expert_backend == "deepep"
