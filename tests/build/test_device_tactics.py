"""Which plugin implementations a build records for the GPU targets, and the checks behind the choice.

The kernels themselves are compared with their references in tests/plugins (interpreter here, -m gpu on an
H200); these tests pin the builder's decisions, which must hold on a machine without a GPU.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from k3plugins import registry
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3build.build.tactics import resolve_plugins
from k3build.cli import main

pytest.importorskip("triton")
pytest.importorskip("fla.ops.kda")

DEVICE_TACTICS = {"Router": "triton", "MoEExperts": "triton", "KDA": "fla", "MLA": "triton", "Linear": "blas",
                  "LMHead": "blas", "GatedMLP": "blas", "RMSNorm": "triton", "AttnRes": "triton", "MoEOutProj": "triton",
                  "MoEInProj": "triton"}


def _moe_notes(build: dict) -> list[str]:
    """The build's notes on the MoE tactic (the tiny models' MLA is stepped down from gluon too)."""
    return [n for n in build["plugin_notes"] if n.startswith("MoEExperts")]


def _build(converted, out, target="sm90", dtype="bf16"):
    res = CliRunner().invoke(main, ["build", str(converted), str(out), "--target", target, "--max-seq-len", "256",
                                    "--max-num-tokens", "256", "--dtype", dtype, "--no-progress"])
    assert res.exit_code == 0, res.output
    return json.loads((out / "config.json").read_text())["build_config"], res.output


def test_sm90_build_records_the_device_kernels(k3_tiny_engine, tmp_path):
    from k3runtime.loader import EngineError, load_rank

    converted = k3_tiny_engine.with_name(k3_tiny_engine.name + "-converted")
    build, _ = _build(converted, tmp_path / "engine")
    plugins = build["plugins"]
    for op, p in plugins.items():
        assert p["tactic"] == DEVICE_TACTICS.get(op, "reference"), (op, p)
        assert "sm90" in registry.find(op, p["tactic"]).targets
    # the tiny experts (64 wide) are too narrow for the paired layout's K tile, and its 4 heads and latent 32 for
    # the Gluon MLA kernel: the build says so
    assert build["plugin_notes"] == ["MoEExperts: using the 'triton' tactic, not 'triton_l' (expert dims (64, 64) "
                                     "are not multiples of its K tile 256)",
                                     "MLA: using the 'triton' tactic, not 'gluon' (its kernel takes 64 heads a rank or "
                                     "more, latent 256 or 512 and rope 64; this rank has 4 heads, latent 32, rope 8)"]
    with pytest.raises(EngineError, match=r"built for target 'sm90'"):
        load_rank(tmp_path / "engine", 0, "cpu")


def test_large_expert_scale_moves_moe_to_dot_scaled(k3_tiny_engine, tmp_path):
    """A scale byte above 128 (|w| > 12) is outside the W4 decode's exact range: the build says so and
    records the tl.dot_scaled tactic instead."""
    converted = k3_tiny_engine.with_name(k3_tiny_engine.name + "-converted")
    edited = tmp_path / "converted"
    shutil.copytree(converted, edited)
    with safe_open(edited / "rank0.safetensors", framework="pt") as f:
        meta = f.metadata()  # the rank/mapping stamp the builder checks
    tensors = load_file(edited / "rank0.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("weight_scale"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = 131
    save_file(tensors, edited / "rank0.safetensors", metadata=meta)
    build, output = _build(edited, tmp_path / "engine")
    assert build["plugins"]["MoEExperts"]["tactic"] == "triton_ds"
    assert any("131" in n and "triton_ds" in n for n in build["plugin_notes"]), build["plugin_notes"]
    assert "triton_ds" in output  # the user sees the note


@pytest.mark.parametrize("forced,relay,scales", [(None, "lane_tile_mxfp4", "tile_scales"),
                                                  ("triton_p", "pair_tile_mxfp4", "tile_scales"),
                                                  ("triton_s", "restride_mxfp4", None)])
def test_wide_experts_get_the_tactics_layout(k3_wide_experts_ckpt, tmp_path, forced, relay, scales):
    """Expert dims that are multiples of 256: the sm90 build records triton_l (or the forced triton_p / triton_s)
    and writes each expert's MXFP4 bytes in the layout it reads (the CPU build of the same checkpoint keeps the
    checkpoint's order); triton_l's and triton_p's scales are in their row tiles too, triton_s's unchanged.
    triton_l also gets the latent down-projection's rows of the MoE in_proj in its K order (lane_permute); the
    rest of the in_proj as the CPU build has it."""
    from engines import build_engine
    from k3plugins.moe import mxfp4

    opts = dict(dtype="bf16", kv_dtype="bf16")
    cpu = build_engine(k3_wide_experts_ckpt, tmp_path / "cpu", **opts)
    tactics = (("MoEExperts", forced),) if forced else ()
    gpu = build_engine(k3_wide_experts_ckpt, tmp_path / "sm90", target="sm90", tactics=tactics, **opts)
    build = json.loads((gpu / "config.json").read_text())["build_config"]
    assert build["plugins"]["MoEExperts"]["tactic"] == (forced or "triton_l") and not _moe_notes(build)
    natural = load_file(cpu / "rank0" / "weights.safetensors")
    relaid = load_file(gpu / "rank0" / "weights.safetensors")
    experts = [n for n in natural if n.endswith((".moe.w13", ".moe.w2"))]
    assert experts
    for name in experts:
        assert not torch.equal(relaid[name], natural[name]), name
        assert torch.equal(relaid[name], getattr(mxfp4, relay)(natural[name])), name
        scale = natural[name + "_scale"]
        assert torch.equal(relaid[name + "_scale"], getattr(mxfp4, scales)(scale) if scales else scale), name
    in_projs = [n for n in natural if n.endswith(".moe.in_proj")]
    assert in_projs
    for name in in_projs:
        a, b, latent = relaid[name], natural[name], 256
        assert torch.equal(a[:latent], mxfp4.lane_permute(b[:latent], 0) if forced is None else b[:latent]), name
        assert torch.equal(a[latent:], b[latent:]), name


@pytest.mark.parametrize("dims,scale,latent,want", [((256, 512), 128, True, "triton_l"),
                                                    ((256, 96), 128, True, "triton"),
                                                    ((256, 512), 129, True, "triton_ds"),
                                                    ((64, 64), 200, True, "triton_ds"),
                                                    ((256, 512), None, True, "triton_l"),
                                                    ((256, 512), 128, False, "triton_p"),
                                                    ((256, 96), 128, False, "triton")])
def test_moe_tactic_steps_down_for_dims_and_scales(dims, scale, latent, want):
    """triton_l needs a latent MoE (its activations' K order comes from the latent rows), the relaid layouts expert
    dims in K tiles of 256, the W4 decodes scale bytes up to 128: a note for each step down."""
    from k3build.build.tactics import expert_layout, fit_moe_tactic

    table, _ = resolve_plugins("sm90")
    notes = fit_moe_tactic(table, dims, scale, latent=latent)
    assert table["MoEExperts"]["tactic"] == want
    assert table["MoEExperts"]["version"] == registry.find("MoEExperts", want).version  # what the loader checks
    steps = (not latent) + (dims[1] % 256 != 0) + (scale is not None and scale > 128)
    assert len(notes) == steps, notes
    assert expert_layout(table) == {"triton_l": "lane", "triton_p": "paired"}.get(want, "natural")


@pytest.mark.parametrize("change", [dict(routed_expert_hidden_size=None), dict(quantization="none")])
def test_lane_layout_refused_where_z_cannot_follow(change):
    """The layout pass refuses the lane expert layout for a MoE without latent projection (the experts would read
    the hidden state, whose order nothing permutes) or with float experts, before reading any tensor."""
    import dataclasses

    from k3build.build.layout import _moe
    from k3build.config import QuantConfig, preset
    from k3build.mapping import Mapping

    if "quantization" in change:
        change = dict(quantization=QuantConfig(method="none"))
    tiny = preset("tiny")
    assert tiny.is_latent_moe and tiny.quantization.method == "mxfp4"  # the lane layout's case, but for `change`
    cfg = dataclasses.replace(tiny, **change)
    with pytest.raises(ValueError, match="lane"):
        next(_moe(cfg, Mapping(tp_size=1), 0, "m.", "e.", lambda name: pytest.fail(name), "lane"))
    next(_moe(tiny, Mapping(tp_size=1), 0, "m.", "e.", lambda name: torch.zeros(1), "lane"))  # takes the tiny one


def test_float_experts_keep_the_reference_moe():
    table, notes = resolve_plugins("sm90", quantization="none")
    assert table["MoEExperts"]["tactic"] == "reference"
    assert table["Router"]["tactic"] == "triton" and table["KDA"]["tactic"] == "fla"
    assert any("MoEExperts" in n and "MXFP4" in n for n in notes), notes


def test_fp32_engine_keeps_the_reference_router():
    table, notes = resolve_plugins("sm90", dtype="fp32")
    assert table["Router"]["tactic"] == "reference" and table["MoEExperts"]["tactic"] == "triton_l"
    assert table["GatedMLP"]["tactic"] == "reference"  # fp32 activations: the reference GEMMs are the fp32 ones
    assert table["MoEOutProj"]["tactic"] == table["MoEInProj"]["tactic"] == "reference"
    assert any("Router" in n and "fp32" in n for n in notes), notes


def test_gfx942_uses_portable_kernels_only():
    table, notes = resolve_plugins("gfx942")
    assert table["MoEExperts"]["tactic"] == "triton" and table["Router"]["tactic"] == "triton"
    assert table["MLA"]["tactic"] == "triton" and table["Linear"]["tactic"] == "blas"
    assert table["RMSNorm"]["tactic"] == "triton" and table["AttnRes"]["tactic"] == "triton"
    assert table["KDA"]["tactic"] == "reference"  # fla-core's chunk kernels are only registered for sm90
    # ... which the build says (it is the slow path): the only note
    assert notes == ["KDA: the torch reference on gfx942, a slow fallback: its kernels (fla) are not registered for "
                     "gfx942"], notes
    assert resolve_plugins("cpu")[1] == []


def test_registry_entries_load_and_share_the_reference_signature():
    """The executor calls every implementation of an op the same way: the reference's parameters, in order;
    anything more must be keyword-only with a default (a kernel's own knobs, never passed by the engine)."""
    import inspect

    for impl in registry.IMPLS:
        if impl.tactic == "reference":
            continue
        ref = list(inspect.signature(registry.find(impl.op, "reference").load()).parameters.values())
        dev = list(inspect.signature(impl.load()).parameters.values())
        assert [(p.name, p.kind) for p in dev[:len(ref)]] == [(p.name, p.kind) for p in ref], (impl.op, impl.tactic)
        for extra in dev[len(ref):]:
            assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty, \
                (impl.op, impl.tactic, extra.name)


def test_forced_tactics_are_recorded_or_refused(k3_tiny_engine, tmp_path):
    """--tactic OP=TACTIC overrides the target's preference; a forced MoE tactic that cannot read the experts is
    an error naming it (not a silent step down), and so are an unknown op and a malformed flag."""
    converted = k3_tiny_engine.with_name(k3_tiny_engine.name + "-converted")
    runner = CliRunner()
    common = ["--target", "sm90", "--max-seq-len", "256", "--max-num-tokens", "256", "--no-progress"]
    res = runner.invoke(main, ["build", str(converted), str(tmp_path / "ds"), *common,
                               "--tactic", "MoEExperts=triton_ds"])
    assert res.exit_code == 0, res.output
    build = json.loads((tmp_path / "ds" / "config.json").read_text())["build_config"]
    assert build["plugins"]["MoEExperts"]["tactic"] == "triton_ds" and not _moe_notes(build)
    for flag, words in (("MoEExperts=triton_p", ["--tactic MoEExperts=triton_p", "(64, 64)", "256"]),
                        ("Bogus=triton", ["--tactic Bogus=triton", "not a plugin op"]),
                        ("MoEExperts=nope", ["--tactic MoEExperts=nope", "nope"]),
                        ("MoEExperts", ["--tactic", "OP=TACTIC"])):
        out = tmp_path / flag.replace("=", "_")
        res = runner.invoke(main, ["build", str(converted), str(out), *common, "--tactic", flag])
        assert res.exit_code != 0 and all(w in res.output for w in words), (flag, res.output)
        assert not out.exists()


def test_tune_needs_the_gpu_it_measures_on(k3_tiny_engine, tmp_path):
    """--tune measures the FP8 tactic's drift and speed on the build machine's GPU: without one (this machine) or for a CPU
    target it is refused up front, and nothing is written. (tests/model/test_gpu_engine.py runs it on a GPU.)"""
    from k3build.build.tune import fp8_wins, fp8_within_bar

    converted = k3_tiny_engine.with_name(k3_tiny_engine.name + "-converted")
    for target, words in (("sm90", ["--tune", "GPU", "torch sees none"]), ("cpu", ["--tune", "GPU --target"])):
        out = tmp_path / target
        res = CliRunner().invoke(main, ["build", str(converted), str(out), "--target", target, "--tune",
                                        "--no-progress"])
        if target == "sm90" and torch.cuda.is_available():
            continue
        assert res.exit_code != 0 and all(w in res.output for w in words), res.output
        assert not out.exists()
    assert fp8_within_bar(0.02, 0.9995) and not fp8_within_bar(0.04, 0.9995) and not fp8_within_bar(0.02, 0.998)
    trial = dict(moe_fp8_rel=0.02, moe_fp8_cos=0.9995, moe_fp8_prefill_ms=1.0, moe_w4a16_prefill_ms=1.5)
    assert fp8_wins(trial) and not fp8_wins({**trial, "moe_fp8_prefill_ms": 2.0})  # within the bar but slower


@pytest.mark.parametrize("heads,latent,rope,tactic", [(96, 512, 64, "gluon"), (64, 256, 64, "gluon"),
                                                      (6, 512, 64, "triton"), (96, 128, 64, "triton"),
                                                      (96, 512, 32, "triton")])
def test_mla_tactic_fits_the_ranks_heads_and_cache(heads, latent, rope, tactic):
    """An sm90 bf16 engine records gluon where its kernel runs (K3 under attention-DP: 96 heads, 512 + 64) and
    triton where it never would (a TP slice of 6 heads, other cache widths), with a note."""
    from k3build.build.tactics import fit_mla_tactic
    table, _ = resolve_plugins("sm90")
    assert table["MLA"]["tactic"] == "gluon"
    notes = fit_mla_tactic(table, heads, latent, rope)
    assert table["MLA"] == {"tactic": tactic, "version": registry.find("MLA", tactic).version}
    assert bool(notes) == (tactic == "triton") and all(f"{heads} heads" in n for n in notes)


def test_forced_gluon_mla_that_cannot_run_is_refused(k3_tiny_engine, tmp_path):
    converted = k3_tiny_engine.with_name(k3_tiny_engine.name + "-converted")
    res = CliRunner().invoke(main, ["build", str(converted), str(tmp_path / "engine"), "--target", "sm90",
                                    "--tactic", "MLA=gluon"])
    assert res.exit_code != 0 and "--tactic MLA=gluon" in res.output and "4 heads" in res.output, res.output
    assert not (tmp_path / "engine").exists()
