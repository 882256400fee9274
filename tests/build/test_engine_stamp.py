"""The runtime refuses an engine it cannot run, saying what to rebuild (edited copies of a built engine)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from k3plugins import registry
from safetensors.torch import load_file, save_file

from k3build.config import preset
from k3runtime.cli import main as runtime_main
from k3runtime.loader import EngineError, load_rank


@pytest.fixture
def engine(k3_tiny_engine, tmp_path) -> Path:
    return Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))


def _edit(engine: Path, fn) -> None:
    path = engine / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def _refused(engine: Path, *words: str, device: str = "cpu") -> str:
    with pytest.raises(EngineError) as e:
        load_rank(engine, 0, device)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def test_the_copy_loads(engine):
    rank = load_rank(engine, 0, "cpu")
    assert rank.world_size == 1 and "l0.kda.in_proj" in rank.weights


def test_other_format_version(engine):
    _edit(engine, lambda c: c.update(version=2))
    _refused(engine, "config.json", "engine format v2", "reads v1", "rebuild it with `k3build build`")


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.pop("memory_plan"), "memory_plan: expected a JSON object, got None"),
    (lambda c: c["memory_plan"].update(num_pages="128"), "memory_plan.num_pages: expected an int >= 1, got '128'"),
    (lambda c: c["memory_plan"].update(num_slots=0), "memory_plan.num_slots: expected an int >= 1, got 0"),
    (lambda c: c.pop("pretrained_config"), "pretrained_config: expected a JSON object"),
    (lambda c: c["build_config"].update(dtype="fp64"), "build_config.dtype: expected one of fp32, bf16, fp16"),
    (lambda c: c["build_config"].update(max_num_tokens="x"), "build_config.max_num_tokens: expected an int >= 1"),
    (lambda c: c["mapping"].update(attention_dp=1), "mapping.attention_dp: expected true or false, got 1"),
    (lambda c: c["ranks"]["0"].update(layers=[0, 500]), "ranks.0.layers: expected [start, stop] within the model's"),
], ids=["no-plan", "pages-string", "no-slots", "no-model", "dtype", "tokens", "dp", "layers"])
def test_edited_engine_config_names_the_field(engine, edit, words):
    """A config.json edited or damaged since its build: refused at load by the field (not a KeyError or an
    IndexError mid-step, nor an error naming a command-line flag the user never gave)."""
    _edit(engine, edit)
    _refused(engine, words, "was edited or damaged; rebuild it with `k3build build`")


def test_other_plugin_abi(engine):
    _edit(engine, lambda c: c["stamp"].update(plugin_abi=registry.PLUGIN_ABI + 1))
    _refused(engine, f"plugin ABI {registry.PLUGIN_ABI + 1}", f"has ABI {registry.PLUGIN_ABI}", "rebuild")


def test_unknown_plugin_tactic(engine):
    _edit(engine, lambda c: c["build_config"]["plugins"]["KDA"].update(tactic="warp9"))
    v = registry.find("KDA", "reference").version
    _refused(engine, f"plugin KDA/warp9 v{v} is not available here (none)", "rebuild")


def test_unknown_plugin_version(engine):
    _edit(engine, lambda c: c["build_config"]["plugins"]["MLA"].update(version=7))
    have = registry.find("MLA", "reference").version
    _refused(engine, "plugin MLA/reference v7 is not available here", f"(v{have})", "rebuild")


def test_target_of_another_device(engine):
    _edit(engine, lambda c: c["stamp"].update(target="sm90"))
    _refused(engine, "built for target 'sm90'", "this device is 'cpu'", "k3build build --target cpu")


def test_missing_rank(engine):
    with pytest.raises(EngineError, match="no rank 3 .world size 1."):
        load_rank(engine, 3, "cpu")


def test_not_an_engine(tmp_path):
    with pytest.raises(EngineError, match="not an engine dir .no config.json.; build one with `k3build build`"):
        load_rank(tmp_path, 0, "cpu")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(EngineError, match="not valid JSON"):
        load_rank(tmp_path, 0, "cpu")
    with pytest.raises(EngineError, match="config.json: a file; give the engine's directory"):
        load_rank(tmp_path / "config.json", 0, "cpu")


def test_a_checkpoint_is_not_an_engine(k3_tiny_ckpt, k3_tiny_engine):
    """A converted or an HF checkpoint handed to the runtime: told which it is and the command that makes an
    engine of it, from the loader and from the weight store's command alike."""
    from k3runtime.dist.weight_store import weight_store_cmd

    converted = k3_tiny_engine.with_name(k3_tiny_engine.name + "-converted")  # tests/model/engines.py's place
    for path, words in ((converted, ("a converted checkpoint, not an engine", f"`k3build build {converted} ")),
                        (k3_tiny_ckpt, ("a Hugging Face checkpoint, not an engine", "`k3build convert`"))):
        _refused(path, *words)
        res = CliRunner().invoke(weight_store_cmd, [str(path), "--ranks", "0"])
        assert res.exit_code != 0 and words[0] in res.output and "Traceback" not in res.output, res.output


def test_generate_cli_without_a_tokenizer(engine):
    (engine / "tokenizer.json").unlink()
    res = CliRunner().invoke(runtime_main, ["generate", str(engine), "--prompt", "hi", "--max-tokens", "1"])
    assert res.exit_code != 0 and "the engine has no tokenizer.json" in res.output and "Python API" in res.output
    assert "Traceback" not in res.output


def test_runtime_version_is_the_stamps(k3_tiny_engine):
    """`k3runtime --version` names the installed distribution's version, the one a build stamps."""
    res = CliRunner().invoke(runtime_main, ["--version"])
    stamp = json.loads((k3_tiny_engine / "config.json").read_text())["stamp"]["k3build_version"]
    assert res.exit_code == 0 and res.output.strip().endswith(f"version {stamp}"), res.output


def test_generate_cli_checks_its_options(k3_tiny_engine):
    """Options named as the user typed them; a device torch cannot use, a batch past the engine's state slots and
    --stream over several prompts refused before anything runs."""
    def run(*args):
        res = CliRunner().invoke(runtime_main, ["generate", str(k3_tiny_engine), "--prompt", "hi", *args])
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        return res.output

    assert "--max-tokens: expected an int in 1.." in run("--max-tokens", "0")
    assert "--device: expected cpu, cuda or cuda:N, got 'bogus'" in run("--device", "bogus")
    # a cpu engine on a GPU: refused on any host, before looking for the GPU
    assert "engine built for target 'cpu' but --device cuda:1 is a GPU; run it with --device cpu" in run(
        "--device", "cuda:1")
    slots = json.loads((k3_tiny_engine / "config.json").read_text())["memory_plan"]["num_slots"]
    assert f"--max-num-seqs {slots + 1} is past the engine's {slots} KDA state slots" in run(
        "--max-num-seqs", str(slots + 1))
    assert "--stream prints one completion" in run("--prompt", "again", "--stream")
    assert "the cache holds 1 (--num-pages)" in run("--num-pages", "1", "--max-tokens", "200")
    max_len = json.loads((k3_tiny_engine / "config.json").read_text())["build_config"]["max_seq_len"]
    too_long = run("--prompt", "a " * max_len)  # named by the command's option, not the API's field
    assert "Error: --prompt (as tokens): " in too_long and "prompt_token_ids" not in too_long
    assert f"tokens leave no room to generate under the engine's max_seq_len ({max_len})" in too_long


def _rewrite_weights(engine: Path, fn) -> None:
    path = engine / "rank0" / "weights.safetensors"
    w = load_file(path)
    fn(w)
    save_file(w, path)


def test_weights_damaged_in_place_are_refused(engine):
    # bytes overwritten without changing the file's size: NaN weights, which would give NaN logits and empty text
    def damage(w):
        w["l0.kda.in_proj"] = w["l0.kda.in_proj"].clone()
        w["l0.kda.in_proj"].view(-1)[3] = float("nan")
    _rewrite_weights(engine, damage)
    _refused(engine, "weights.safetensors: 1 tensor(s) hold NaN or Inf, the first 'l0.kda.in_proj'", "rebuild")


def test_weight_shape_differs_from_graph(engine):
    _rewrite_weights(engine, lambda w: w.update({"l3.mla.w_uk": torch.zeros(4, 16, 31)}))
    _refused(engine, "weights.safetensors", "'l3.mla.w_uk'", "(4, 16, 31)", "graph expects (4, 16, 32)")


def test_weight_dtype_differs_from_graph(engine):
    _rewrite_weights(engine, lambda w: w.update({"l1.moe.w13": w["l1.moe.w13"].float()}))
    _refused(engine, "'l1.moe.w13'", "torch.float32", "torch.uint8")


def test_weight_missing(engine):
    _rewrite_weights(engine, lambda w: w.pop("lm_head"))
    _refused(engine, "'lm_head'", "declared by graph.onnx is missing")


def test_missing_graph_file(engine):
    (engine / "rank0" / "graph.onnx").unlink()
    _refused(engine, "graph.onnx", "rebuild")


def test_truncated_weights(engine):
    path = engine / "rank0" / "weights.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _refused(engine, "weights.safetensors", "rebuild")


def test_generate_cli_refuses_with_the_message(engine):
    _edit(engine, lambda c: c["stamp"].update(plugin_abi=registry.PLUGIN_ABI + 1))
    res = CliRunner().invoke(runtime_main, ["generate", str(engine), "--prompt", "hi", "--max-tokens", "1"])
    assert res.exit_code != 0 and "plugin ABI" in res.output and "Traceback" not in res.output


def test_graph_op_unknown_to_this_runtime(engine):
    """A graph node whose op the runtime has no binding for (a newer builder's op): a clear refusal, no traceback."""
    import onnx
    path = engine / "rank0" / "graph.onnx"
    model = onnx.load(path)
    node = next(n for n in model.graph.node if n.op_type == "SplitColumns")
    node.op_type = "SplitRows"
    onnx.save(model, path)
    res = CliRunner().invoke(runtime_main, ["generate", str(engine), "--prompt", "hi", "--max-tokens", "1"])
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    assert f"graph node {node.name!r}: op k3::SplitRows" in res.output and "rebuild" in res.output


def test_an_engine_from_before_moe_in_proj_still_runs(k3_tiny_engine, engine):
    """Engines built before MoEInProj ran a latent MoE's router as its own node on a separate `gate` weight, and the
    in_proj without the router's rows. Rewritten to that form (graph and weights on disk), the engine loads and
    scores a prompt as the new form does, up to fp32 rounding."""
    import onnx
    from onnx import helper

    from k3runtime import LLM

    rank = engine / "rank0"
    model = onnx.load(rank / "graph.onnx")
    weights = load_file(rank / "weights.safetensors")
    inputs = {vi.name: vi for vi in model.graph.input}
    nodes, rewritten = [], 0
    for node in model.graph.node:
        if node.op_type != "MoEInProj":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        x, in_proj, bias = node.input
        ids, wts, zh = node.output
        gate = in_proj.replace("in_proj", "gate")
        stacked = weights.pop(in_proj)
        n = stacked.shape[0] - attrs.pop("num_experts")
        weights[in_proj], weights[gate] = stacked[:n].clone(), stacked[n:].clone()
        for name in (in_proj, gate):
            vi = helper.make_tensor_value_info(name, inputs[in_proj].type.tensor_type.elem_type, weights[name].shape)
            model.graph.input.append(vi)
        model.graph.input.remove(inputs[in_proj])
        nodes.append(helper.make_node("Router", [x, gate, bias], [ids, wts], name=node.name + ".router",
                                      domain=node.domain, **attrs))
        nodes.append(helper.make_node("Linear", [x, in_proj], [zh], name=node.name, domain=node.domain))
        rewritten += 1
    cfg = preset("tiny")
    assert rewritten == sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) > 0
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, rank / "graph.onnx")
    save_file(weights, rank / "weights.safetensors")
    _edit(engine, lambda c: [c["ranks"]["0"].pop(k) for k in ("graph_sha256", "weights_sha256")])  # none back then
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    old, new = LLM(engine).logits(prompt), LLM(k3_tiny_engine).logits(prompt)
    torch.testing.assert_close(old, new, rtol=1e-4, atol=1e-4)
