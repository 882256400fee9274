"""`k3build build --recipe`: a refusal caused by a recipe value the user did not type names the recipe (it named a
command-line flag the user never gave), and a flag that overrides a recipe value says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping

ROOT = Path(__file__).parents[2]
TINY = (ROOT / "engines" / "tiny.toml").read_text()


@pytest.fixture(scope="module")
def converted(k3_tiny_ckpt, tmp_path_factory):
    return convert(k3_tiny_ckpt, tmp_path_factory.mktemp("conv") / "tp1", Mapping(), progress=False)


def _build(converted, out, recipe, *args):
    return CliRunner().invoke(main, ["build", str(converted), str(out), "--recipe", str(recipe), "--no-progress",
                                     *args])


@pytest.mark.parametrize("edit, words", [
    (("max_seq_len = 1024", "max_seq_len = 100000"), ["--max-seq-len: 100000 exceeds"]),
    (("gpu_memory_gib = 1.0625", "gpu_memory_gib = 0.001"), ["does not fit in --gpu-memory-gib 0.001"]),
], ids=["seq>positions", "budget"])
def test_recipe_value_refused_by_build_names_the_recipe(converted, tmp_path, edit, words):
    recipe = tmp_path / "r.toml"
    assert edit[0] in TINY
    recipe.write_text(TINY.replace(*edit))
    out = tmp_path / "engine"
    res = _build(converted, out, recipe)
    assert res.exit_code == 1 and not out.exists(), res.output
    assert f"{recipe} [build]: " in res.output, res.output
    for w in words:
        assert w in res.output


def test_same_value_given_as_flag_is_the_users(converted, tmp_path):
    """A value the user typed too is the flag's: no recipe blamed."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(TINY)
    res = _build(converted, tmp_path / "engine", recipe, "--max-seq-len", "100000")
    assert res.exit_code == 1 and "--max-seq-len: 100000 exceeds" in res.output and "[build]" not in res.output


def test_flag_over_recipe_is_noted(converted, tmp_path):
    out = tmp_path / "engine"
    res = _build(converted, out, ROOT / "engines" / "tiny.toml", "--max-batch-size", "4", "--max-seq-len", "1024")
    assert res.exit_code == 0, res.output
    assert "--max-batch-size 4 overrides" in res.output and "build.max_batch_size = 8" in res.output
    assert "--max-seq-len 1024 overrides" not in res.output  # the same value as the recipe's: nothing to say
