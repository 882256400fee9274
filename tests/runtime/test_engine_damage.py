"""Damaged copies of a built engine on disk (files swapped between ranks, an edited graph or config.json, files that
cannot be read, a corrupt tokenizer): refused at load by one line naming the file and the field, before any weight
is read where the check needs none, never a traceback at the first step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner

from k3runtime.api import LLM
from k3runtime.async_engine import AsyncLLMEngine
from k3runtime.cli import main as runtime_main
from k3runtime.loader import EngineError, load_rank

GRAPH, WEIGHTS = "rank0/graph.onnx", "rank0/weights.safetensors"


@pytest.fixture
def engine(k3_tiny_engine, tmp_path) -> Path:
    return Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))


@pytest.fixture(scope="module")
def tp2_engine(k3_tiny_ckpt, tmp_path_factory) -> Path:
    from engines import build_engine
    from k3build.mapping import Mapping

    return build_engine(k3_tiny_ckpt, tmp_path_factory.mktemp("damage_tp2") / "engine", mapping=Mapping(tp_size=2))


def _generate(engine: Path, *args: str) -> str:
    """`k3runtime generate` on the engine, which must fail with one error line and no traceback; its output."""
    res = CliRunner().invoke(runtime_main, ["generate", str(engine), "--prompt", "hi", "--max-tokens", "1", *args])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.output, res.exception)
    said = [line for line in res.output.splitlines() if not line.startswith("load rank")]  # less the load's progress
    assert len(said) == 1 and said[0].startswith("Error: "), res.output
    return said[0]


def _refused(engine: Path, *words: str) -> str:
    with pytest.raises(EngineError) as e:
        load_rank(engine, 0, "cpu")
    for w in words:
        assert w in str(e.value), f"{w!r} not in {str(e.value)!r}"
    return str(e.value)


def _edit_config(engine: Path, fn) -> None:
    cfg = json.loads((engine / "config.json").read_text())
    fn(cfg)
    (engine / "config.json").write_text(json.dumps(cfg))


def _swap(engine: Path, name: str) -> None:
    a, b, t = engine / "rank0" / name, engine / "rank1" / name, engine / name
    a.rename(t)
    b.rename(a)
    t.rename(b)


def test_rank_files_swapped_between_ranks(tp2_engine, tmp_path):
    """A TP2 engine's ranks hold tensors of the same shapes: only the rank each file records tells them apart."""
    engine = Path(shutil.copytree(tp2_engine, tmp_path / "engine"))
    load_rank(engine, 0, "cpu")
    _swap(engine, "weights.safetensors")
    _refused(engine, WEIGHTS, "holds rank 1's weights, not rank 0's")
    _swap(engine, "weights.safetensors")
    _swap(engine, "graph.onnx")
    _refused(engine, GRAPH, "'k3_rank1', not rank 0's")


def test_rank_files_of_another_build(k3_tiny_engine, k3_tiny_ckpt, tmp_path):
    """The same model built twice: the files look alike, but each build's id (config stamp, weights header) differs."""
    from engines import build_engine

    engine = Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))
    other = build_engine(k3_tiny_ckpt, tmp_path / "other")
    shutil.copy(other / WEIGHTS, engine / WEIGHTS)
    ids = [json.loads((e / "config.json").read_text())["stamp"]["build_id"] for e in (engine, other)]
    assert ids[0] != ids[1]
    _refused(engine, WEIGHTS, f"written by another build ({ids[1]}) than the engine's config.json ({ids[0]})")


def test_graph_of_another_build(k3_tiny_engine, k3_tiny_ckpt, tmp_path):
    """A graph.onnx of another build, config.json's sha256 record matched to it (engines from before that record
    have none): refused by the build id the graph holds, not run with the other build's attributes."""
    import hashlib

    from engines import build_engine

    engine = Path(shutil.copytree(k3_tiny_engine, tmp_path / "engine"))
    other = build_engine(k3_tiny_ckpt, tmp_path / "other")
    shutil.copy(other / GRAPH, engine / GRAPH)
    _edit_config(engine, lambda c: c["ranks"]["0"].update(
        graph_sha256=hashlib.sha256((engine / GRAPH).read_bytes()).hexdigest()))
    ids = [json.loads((e / "config.json").read_text())["stamp"]["build_id"] for e in (engine, other)]
    _refused(engine, GRAPH, f"written by another build ({ids[1]}) than the engine's config.json ({ids[0]})")


def _graph_edit(fn):
    def edit(engine: Path) -> None:
        model = onnx.load(engine / GRAPH)
        fn(model.graph)
        onnx.save(model, engine / GRAPH)
    return edit


def _node(graph, op_type):
    return next(n for n in graph.node if n.op_type == op_type)


def _set_cache_index(node, value):
    next(a for a in node.attribute if a.name == "cache_index").i = value


def _drop_attr(node, name):
    keep = [a for a in node.attribute if a.name != name]
    node.ClearField("attribute")
    node.attribute.extend(keep)


def _weight_input(graph):
    return next(vi for vi in graph.input if vi.name == "lm_head").type.tensor_type


@pytest.mark.parametrize("damage, words", [
    (lambda e: (e / GRAPH).write_bytes(b""), ["onnx.checker", "ir_version"]),
    (_graph_edit(lambda g: g.ClearField("output")), ["the runtime reads 'logits'"]),
    (_graph_edit(lambda g: g.node[1].input.__setitem__(0, "no_such_tensor")), ["onnx.checker", "'no_such_tensor'"]),
    (_graph_edit(lambda g: (setattr(g.node[0], "domain", ""), setattr(g.node[0], "op_type", "Mul"))),
     ["onnx.checker", "Mul", "embed"]),
    (_graph_edit(lambda g: (setattr(g.node[1], "domain", ""), setattr(g.node[1], "op_type", "Relu"),
                            _drop_attr(g.node[1], "eps"), g.node[1].input.pop())),
     ["graph node 'l0.input_norm': op Relu is not an ONNX op the runtime runs"]),
    (_graph_edit(lambda g: _drop_attr(_node(g, "KDA"), "cache_index")), ["graph node 'l0.kda': cache_index None"]),
    (_graph_edit(lambda g: _set_cache_index(_node(g, "MLA"), 7)),
     ["graph node 'l3.mla': cache_index 7: this rank holds 3 MLA layer cache(s)"]),
    (_graph_edit(lambda g: setattr(_weight_input(g), "elem_type", onnx.TensorProto.DOUBLE)),
     ["graph input 'lm_head': element type DOUBLE is not one the runtime reads"]),
], ids=["empty-file", "no-outputs", "dangling-input", "mul", "relu", "kda-no-cache-index", "mla-cache-index",
        "double-weight"])
def test_damaged_graph_is_refused_at_load(engine, damage, words):
    """Each of these loaded before and died at the first step (KeyError, IndexError)."""
    damage(engine)
    _refused(engine, GRAPH, *words, "rebuild")


@pytest.mark.parametrize("edit, words", [
    (lambda c: c["build_config"]["plugins"]["KDA"].pop("tactic"), "build_config.plugins.KDA: expected"),
    (lambda c: c["build_config"]["plugins"].update(KDA="reference"), "build_config.plugins.KDA: expected"),
    (lambda c: c.update(stamp=[1]), "stamp: expected a JSON object, got [1]"),
    (lambda c: c["ranks"]["0"].pop("first_stage"), "ranks.0.first_stage: expected true or false, got None"),
    (lambda c: c["pretrained_config"]["layer_types"].__setitem__(0, "foo"),
     "pretrained_config.layer_types[0]: expected one of kda, mla, got 'foo'"),
    (lambda c: c["pretrained_config"].update(eos_token_id="2"), "pretrained_config.eos_token_id: expected a token id"),
    (lambda c: c["pretrained_config"].update(eos_token_id=99999), "in 0..511 (vocab_size) or null, got 99999"),
    (lambda c: c["pretrained_config"].update(vocab_size=100000),
     "'embed': 512 vocabulary rows on each of 1 rank(s), but pretrained_config.vocab_size is 100000"),
    # a GPU tactic of the registry in a CPU engine's table: Triton's "0 active drivers" traceback at bind before
    (lambda c: c["build_config"]["plugins"]["MLA"].update(tactic="triton"),
     "plugin MLA/triton cannot run here (MLA/triton does not run on cpu)"),
    # the cache is sized from these: a layer that does not fit it failed the engine at its first step, not its load
    (lambda c: c["pretrained_config"].update(kda_num_heads=2),
     "graph node 'l0.kda': 4 heads of 32 with a conv of width 4, but the KDA cache config.json sizes holds 2 heads"),
    (lambda c: c["pretrained_config"].update(kda_conv_size=2), "and a conv of width 2 (kda_conv_size)"),
    (lambda c: c["pretrained_config"].update(kv_lora_rank=8),
     "graph node 'l3.mla': caches 40 values a token (its kv_a_norm's rank + qk_rope_head_dim), but the MLA cache "
     "config.json sizes holds 16"),
], ids=["plugin-no-tactic", "plugin-str", "stamp-list", "no-first-stage", "layer-type", "eos-str", "eos-oob",
        "vocab-size", "gpu-tactic", "kda-heads", "kda-conv", "mla-width"])
def test_edited_config_is_refused_by_its_field(engine, edit, words):
    _edit_config(engine, edit)
    _refused(engine, words)


def test_weights_of_the_wrong_size_say_where_and_what_the_build_wrote(engine):
    """The CPU path checks the header as the GPU path does: the tensor that does not fit, and the size the build
    recorded (safetensors alone says "incomplete metadata, file not fully covered")."""
    path = engine / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    _refused(engine, WEIGHTS, "tensor '", "(truncated file?)", f"it is {len(data) // 2} bytes, its build wrote "
             f"{len(data)}")
    path.write_bytes(data + bytes(4096))
    _refused(engine, WEIGHTS, f"it is {len(data) + 4096} bytes, its build wrote {len(data)}")


@pytest.mark.parametrize("name", ["config.json", WEIGHTS, GRAPH, "tokenizer.json", "tokenizer_config.json"])
def test_a_directory_in_place_of_a_file(engine, name):
    (engine / name).unlink()
    (engine / name).mkdir()
    out = _generate(engine)
    assert f"{engine / name}: cannot be read (Is a directory)" in out, out


_READ_ALL = """
import sys
from click.testing import CliRunner
from k3runtime.cli import main
for engine in sys.argv[1:]:
    res = CliRunner().invoke(main, ["generate", engine, "--prompt", "hi", "--max-tokens", "1"])
    print(res.exit_code, type(res.exception).__name__, res.output.strip().replace(chr(10), " | "), flush=True)
"""


def test_files_that_cannot_be_read(engine, tmp_path):
    """chmod 000 on each file (and on the rank directory): one line naming the path. As root, file modes apply only
    without CAP_DAC_OVERRIDE: the command runs under setpriv then, as the reviewer ran it."""
    cmd = [sys.executable, "-c", _READ_ALL]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE: file modes do not apply")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    names = ["config.json", WEIGHTS, GRAPH, "rank0", "tokenizer.json", "tokenizer_config.json"]
    engines = []
    for i, name in enumerate(names):
        copy = Path(shutil.copytree(engine, tmp_path / f"e{i}"))
        (copy / name).chmod(0)
        engines.append(copy)
    try:
        out = subprocess.run([*cmd, *map(str, engines)], capture_output=True, text=True, timeout=300)
    finally:
        for copy, name in zip(engines, names):
            (copy / name).chmod(0o755)
    lines = out.stdout.splitlines()
    assert len(lines) == len(names), out.stdout + out.stderr
    for line, copy, name in zip(lines, engines, names):
        path = copy / (GRAPH if name == "rank0" else name)  # the first file read inside the directory
        assert line == f"1 SystemExit Error: {path}: cannot be read (Permission denied)", line


@pytest.mark.parametrize("name, content, words", [
    ("tokenizer.json", "{ broken", "tokenizer.json: not a tokenizer the `tokenizers` library reads"),
    ("tokenizer_config.json", "{ broken", "tokenizer_config.json: not valid JSON"),
    ("tokenizer_config.json", "[1]", "tokenizer_config.json: expected a JSON object, got list"),
    ("config.json", b"\xff\xfe\x00garbage", "config.json: not valid JSON (not UTF-8 text"),
], ids=["tokenizer", "tokenizer-config", "tokenizer-config-list", "config-binary"])
def test_corrupt_json_files_are_named(engine, name, content, words):
    path = engine / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = _generate(engine)
    assert f"{path.parent}/{words}" in out, out


def test_tokenizer_and_prompts_are_checked_before_the_weights(engine):
    """With the weights truncated, what the command would refuse anyway is what it says, not the weights."""
    path = engine / WEIGHTS
    path.write_bytes(path.read_bytes()[:1000])
    assert "empty (at least one token is needed)" in _generate(engine, "--prompt", "")
    max_len = json.loads((engine / "config.json").read_text())["build_config"]["max_seq_len"]
    assert f"under the engine's max_seq_len ({max_len})" in _generate(engine, "--prompt", "a " * max_len)
    # the last --max-tokens counts: 200 tokens need 4 pages of 64
    assert "needs 4 pages of 64 tokens; the cache holds 1 (--num-pages)" in _generate(
        engine, "--num-pages", "1", "--max-tokens", "200")
    (engine / "tokenizer_config.json").write_text("{")
    for opens in (LLM, AsyncLLMEngine):  # the Python API; the server's and Triton's engine
        with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):  # TokenizerError
            opens(engine)
    (engine / "tokenizer.json").unlink()
    assert "the engine has no tokenizer.json" in _generate(engine)


def test_gpu_engine_takes_its_targets_device(engine):
    """An sm90 engine runs on cuda unless --device says otherwise: on this GPU-less host that is refused naming the
    target and how to run on the CPU; --device cpu names the mismatch."""
    _edit_config(engine, lambda c: c["stamp"].update(target="sm90"))
    if not torch.cuda.is_available():
        out = _generate(engine)
        assert "this sm90 engine runs on --device cuda: torch" in out and "sees no GPU here" in out, out
        assert "`k3build build --target cpu`" in out, out
    out = _generate(engine, "--device", "cpu")
    assert "engine built for target 'sm90' but this device is 'cpu'" in out and "--device cuda" in out, out


@pytest.mark.parametrize("flags", [["--num-pages", str(10**12)], ["--num-slots", str(10**12), "--max-num-seqs", "1"]],
                         ids=["pages", "slots"])
def test_caches_past_memory_name_the_flags(engine, flags):
    out = _generate(engine, *flags)
    assert "--num-pages and --num-slots" in out and "bytes" in out and "of cpu memory" in out, out
    assert f"{10**12} MLA pages" in out or f"{10**12} KDA slots" in out, out  # the number given, spare or not


def test_caches_past_memory_count_as_given_beside_the_spare(k3_tiny_ckpt, tmp_path):
    """An attention-DP rank holds a spare page and slot of its own (dummy steps): the error counts what was asked."""
    from engines import build_engine
    from k3build.mapping import Mapping
    from k3runtime.engine_options import EngineOptions
    from k3runtime.llm_engine import open_rank

    dp = build_engine(k3_tiny_ckpt, tmp_path / "dp", mapping=Mapping(attention_dp=True))
    with pytest.raises(EngineError, match=rf"the caches of {10**12} MLA pages and \d+ KDA slots .*and a spare one"):
        open_rank(dp, EngineOptions(num_pages=10**12), 0)


def test_executor_binds_only_the_ops_it_runs(k3_tiny_engine):
    """A RankEngine edited after load_rank's graph check (or made without it, as bench_rank's) is refused by the
    executor naming the node, not by a KeyError."""
    from k3runtime.executor import Executor

    engine = load_rank(k3_tiny_engine, 0, "cpu", progress=False)
    kda = next(n for n in engine.graph.node if n.domain == "k3" and n.op_type == "KDA")
    kda.op_type = "KDA2"
    with pytest.raises(EngineError, match=rf"graph node '{kda.name}': op k3::KDA2 is neither a structure op nor in "
                                          "the engine's plugin table; rebuild the engine with this k3build"):
        Executor(engine, caches=None)
    kda.op_type = "KDA"
    plain = next(n for n in engine.graph.node if n.domain == "")
    plain.op_type = "Softmax2"
    with pytest.raises(EngineError, match=rf"graph node '{plain.name}': op Softmax2 is not an ONNX op the runtime "):
        Executor(engine, caches=None)
