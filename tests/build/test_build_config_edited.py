"""A converted checkpoint whose config.json was edited after convert (same shapes, another model: top-k, norm eps,
max positions): the rank files were cut for the config convert wrote, and build must refuse the edited one by
naming the field, as it refuses a changed rank file (it built an engine of another model silently)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from k3build.cli import main
from k3build.convert import convert
from k3build.mapping import Mapping


@pytest.fixture(scope="module")
def converted(k3_tiny_ckpt, tmp_path_factory):
    return convert(k3_tiny_ckpt, tmp_path_factory.mktemp("conv") / "tp2", Mapping(tp_size=2), progress=False)


def _build(conv, out):
    return CliRunner().invoke(main, ["build", str(conv), str(out), "--max-seq-len", "256", "--max-num-tokens", "256",
                                     "--no-progress"])


@pytest.mark.parametrize("field, value", [("num_experts_per_token", 2), ("rms_norm_eps", 0.5),
                                          ("max_position_embeddings", 1 << 20), ("routed_scaling_factor", 2.5)])
def test_config_edited_after_convert_is_refused(converted, tmp_path, field, value):
    conv = shutil.copytree(converted, tmp_path / "conv")
    cfg = json.loads((conv / "config.json").read_text())
    assert field in cfg and cfg[field] != value
    was = cfg[field]
    cfg[field] = value
    (conv / "config.json").write_text(json.dumps(cfg, indent=2))
    out = tmp_path / "engine"
    res = _build(conv, out)
    assert res.exit_code == 1, res.output
    assert f"config.json: {field} is {value!r}" in res.output and f"converted with {was!r}" in res.output
    assert "Traceback" not in res.output and not out.exists()


def test_untouched_and_reformatted_config_builds(converted, tmp_path):
    conv = shutil.copytree(converted, tmp_path / "conv")
    cfg = json.loads((conv / "config.json").read_text())
    (conv / "config.json").write_text(json.dumps(cfg, indent=4, sort_keys=True))  # same values, other layout
    res = _build(conv, tmp_path / "engine")
    assert res.exit_code == 0, res.output


def test_a_field_added_to_k3build_since_the_convert_is_no_edit(converted, tmp_path):
    """A converted checkpoint from a k3build whose config had fewer fields (a field added since, at its default):
    nothing was edited, so it builds (the check compared every field, and a new one was "converted with None")."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    conv = shutil.copytree(converted, tmp_path / "conv")
    for rank in (0, 1):
        path = conv / f"rank{rank}.safetensors"
        with safe_open(path, "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        was = json.loads(meta["k3_config"])
        del was["routed_scaling_factor"], was["quantization"][next(iter(was["quantization"]))]  # not there back then
        meta["k3_config"] = json.dumps(was)
        save_file(tensors, path, metadata=meta)
    res = _build(conv, tmp_path / "engine")
    assert res.exit_code == 0, res.output
