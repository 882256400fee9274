"""The engine format (DESIGN.md "Engine dir"): config.json, per-rank graph.onnx and weights.safetensors."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner
from k3plugins import registry
from k3plugins.kda.reference import IN_PROJ_ROW_ALIGN
from safetensors import safe_open

from k3build.build.tactics import PLUGIN_OPS
from k3build.cli import main
from k3build.config import KDA, MLA, preset
from k3build.mapping import Mapping

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from engines import build_engine  # noqa: E402

CFG = preset("tiny")
ONNX_OPS = {"Add", "Cast", "Identity"}  # default-domain ops; everything else is a k3 plugin or communicator
COMM_OPS = {"AllReduce", "AllGather", "EPGather", "EPScatter"}
STRUCTURE_OPS = {"SplitColumns", "SliceColumns"}  # k3 ops the executor runs itself: views, no kernel
_ST_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8}
_ONNX_TORCH = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.BFLOAT16: torch.bfloat16,
               onnx.TensorProto.FLOAT16: torch.float16, onnx.TensorProto.UINT8: torch.uint8}
MAPPINGS = {"tp2": Mapping(tp_size=2), "pp2": Mapping(pp_size=2), "ep4": Mapping(tp_size=4, moe_ep_size=4),
            "dp2": Mapping(tp_size=2, attention_dp=True)}


def _config(engine: Path) -> dict:
    return json.loads((engine / "config.json").read_text())


def _graph(engine: Path, rank: int) -> onnx.ModelProto:
    return onnx.load(engine / f"rank{rank}" / "graph.onnx")


def _weights(engine: Path, rank: int) -> dict[str, torch.Tensor]:
    with safe_open(engine / f"rank{rank}" / "weights.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _converted(engine: Path, rank: int, name: str) -> torch.Tensor:
    # tests/model/engines.py converts into ENGINE-converted beside the engine
    with safe_open(engine.with_name(engine.name + "-converted") / f"rank{rank}.safetensors", framework="pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def multi_engines(k3_tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multi")
    return {name: build_engine(k3_tiny_ckpt, root / name, mapping=m) for name, m in MAPPINGS.items()}


def test_config_fields(k3_tiny_engine):
    cfg = _config(k3_tiny_engine)
    assert set(cfg) == {"version", "pretrained_config", "mapping", "build_config", "stamp", "ranks", "memory_plan",
                        "generation_config"}
    assert cfg["generation_config"] == {}  # the checkpoint has no generation_config.json
    assert cfg["version"] == 1
    assert cfg["pretrained_config"]["num_hidden_layers"] == CFG.num_hidden_layers
    assert cfg["pretrained_config"]["layer_types"] == list(CFG.layer_types)
    assert cfg["mapping"] == Mapping().to_dict()
    b = cfg["build_config"]
    # tests/model/engines.py's defaults
    assert (b["max_seq_len"], b["max_num_tokens"], b["max_batch_size"], b["page_size"]) == (512, 512, 8, 64)
    assert (b["dtype"], b["kv_dtype"], b["state_dtype"], b["target"]) == ("fp32", "fp32", "fp32", "cpu")
    assert set(b["plugins"]) == set(PLUGIN_OPS)
    for op, p in b["plugins"].items():
        impl = registry.find(op, p["tactic"])
        assert impl is not None and impl.version == p["version"], (op, p)
    s = cfg["stamp"]
    assert s["target"] == "cpu" and s["plugin_abi"] == registry.PLUGIN_ABI
    assert s["torch"] == torch.__version__.split("+")[0] and s["k3build_version"]
    r = cfg["ranks"]["0"]
    assert r["layers"] == [0, CFG.num_hidden_layers] and r["experts"] == [0, CFG.num_experts]
    assert r["first_stage"] and r["last_stage"]
    assert r["weight_bytes"] == (k3_tiny_engine / "rank0" / "weights.safetensors").stat().st_size
    mp = cfg["memory_plan"]
    assert mp == {"num_slots": 8, "num_pages": 8 * math.ceil(512 / 64), "page_size": 64}
    assert (k3_tiny_engine / "tokenizer.json").exists()
    assert not list(k3_tiny_engine.rglob("*.data")) and not list(k3_tiny_engine.rglob(".k3build.pid"))


def _check_graph(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import}.get("k3") == 1
    for node in model.graph.node:
        if node.op_type in ONNX_OPS:
            assert node.domain == "", node.name
        else:
            assert node.domain == "k3" and node.op_type in set(PLUGIN_OPS) | COMM_OPS | STRUCTURE_OPS, (node.name, node.op_type)


def _check_weights_declared(model: onnx.ModelProto, weights: dict[str, torch.Tensor]) -> None:
    declared = {}
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if not any(d.dim_param for d in dims):
            declared[vi.name] = (tuple(d.dim_value for d in dims), _ONNX_TORCH[vi.type.tensor_type.elem_type])
    assert declared == {k: (tuple(t.shape), t.dtype) for k, t in weights.items()}
    used = {i for n in model.graph.node for i in n.input if i}
    # K3_SPEC §2.1: layer 0's attn-side AttnRes params exist but are unused (no snapshot yet)
    assert set(weights) - used <= {"l0.attn_res.proj", "l0.attn_res.norm"}, sorted(set(weights) - used)


def test_graph_is_valid_onnx_in_k3_domain(k3_tiny_engine):
    model = _graph(k3_tiny_engine, 0)
    _check_graph(model)
    ops = {n.op_type for n in model.graph.node}
    assert {"Embedding", "KDA", "MLA", "MoEExperts", "MoEInProj", "AttnRes", "LMHead"} <= ops
    assert not ops & COMM_OPS  # one rank: nothing to reduce
    assert [o.name for o in model.graph.output] == ["logits"]


def test_every_weight_is_a_graph_input(k3_tiny_engine):
    _check_weights_declared(_graph(k3_tiny_engine, 0), _weights(k3_tiny_engine, 0))


def test_mla_absorption(k3_tiny_engine):
    w = _weights(k3_tiny_engine, 0)
    assert not [k for k in w if "kv_b" in k]
    h, nope, v, r = CFG.num_attention_heads, CFG.qk_nope_head_dim, CFG.v_head_dim, CFG.kv_lora_rank
    mla_layers = [i for i, t in enumerate(CFG.layer_types) if t == MLA]
    assert mla_layers
    for i in mla_layers:
        w_uk, w_uv = w[f"l{i}.mla.w_uk"], w[f"l{i}.mla.w_uv"]
        assert w_uk.shape == (h, nope, r) and w_uv.shape == (h, r, v)
        kv_b = _converted(k3_tiny_engine, 0, f"model.layers.{i}.self_attn.kv_b_proj.weight").float()
        kv_b = kv_b.reshape(h, nope + v, r)  # head-major [k_nope | v] rows
        torch.testing.assert_close(w_uk, kv_b[:, :nope], rtol=0, atol=0)
        torch.testing.assert_close(w_uv, kv_b[:, nope:].transpose(1, 2), rtol=0, atol=0)
        # q_a, the 576-wide latent's kv_a and the gate stacked in one GEMM, in that order, bit for bit
        a = f"model.layers.{i}.self_attn."
        parts = [_converted(k3_tiny_engine, 0, a + n + ".weight") for n in ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")]
        assert parts[1].shape == (r + CFG.qk_rope_head_dim, CFG.hidden_size)
        in_proj = w[f"l{i}.mla.in_proj"]
        torch.testing.assert_close(in_proj, torch.cat(parts).to(in_proj.dtype), rtol=0, atol=0)


def test_latent_moe_projections_share_gemms(k3_tiny_engine):
    """Latent MoE: `moe.in_proj` stacks the latent down-projection's rows over the shared expert's gate and up rows,
    then the router's; one MoEInProj node reads it (the picks from the router's fp32 columns) and the graph splits
    the rest of its output between the routed experts and the shared expert. On the way out,
    `moe.out_proj` puts the latent up-projection's columns beside the shared expert's down-projection, for the one
    MoEOutProj node that reads the experts' sum, the latent norm and the shared expert's gate | up."""
    w = _weights(k3_tiny_engine, 0)
    model = onnx.load(k3_tiny_engine / "rank0" / "graph.onnx")
    nodes = {n.name: n for n in model.graph.node}
    moe_layers = [i for i in range(CFG.num_hidden_layers) if CFG.is_moe_layer(i)]
    assert CFG.is_latent_moe and moe_layers
    for i in moe_layers:
        p, e = f"model.layers.{i}.block_sparse_moe.", f"l{i}.moe."
        src = [_converted(k3_tiny_engine, 0, p + n) for n in ("routed_expert_down_proj.weight",
                                                               "shared_experts.gate_proj.weight",
                                                               "shared_experts.up_proj.weight", "gate.weight")]
        assert src[3].shape[0] == CFG.num_experts
        torch.testing.assert_close(w[e + "in_proj"], torch.cat(src).to(w[e + "in_proj"].dtype), rtol=0, atol=0)
        assert e + "down_proj" not in w and e + "shared.gate_up" not in w and e + "gate" not in w
        proj = nodes[e + "in_proj"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in proj.attribute}
        assert proj.op_type == "MoEInProj" and list(proj.input[1:]) == [e + "in_proj", e + "bias"]
        assert attrs["num_experts"] == CFG.num_experts and attrs["top_k"] == CFG.num_experts_per_token
        ids, weights, zh = proj.output
        split = nodes[e + "in_proj.split"]
        sizes = list(onnx.helper.get_attribute_value(split.attribute[0]))
        assert split.domain == "k3" and list(split.input) == [zh]
        assert sizes == [CFG.expert_hidden_size, src[1].shape[0] + src[2].shape[0]]
        z, shared_h = split.output
        assert list(nodes[e + "experts"].input[:3]) == [z, ids, weights]
        out = nodes[e + "out_proj"]
        assert out.op_type == "MoEOutProj" and out.input[2] == shared_h
        assert list(out.input[:2]) == [nodes[e + "experts"].output[0], e + "latent_norm"]
        src = [_converted(k3_tiny_engine, 0, p + n) for n in ("routed_expert_up_proj.weight",
                                                               "shared_experts.down_proj.weight")]
        torch.testing.assert_close(w[e + "out_proj"], torch.cat(src, 1).to(w[e + "out_proj"].dtype), rtol=0, atol=0)
        assert e + "up_proj" not in w and e + "shared.down" not in w and e + "shared.mlp" not in nodes


def test_kda_fused_in_proj(k3_tiny_engine):
    w = _weights(k3_tiny_engine, 0)
    hk, dk = CFG.kda_num_heads, CFG.kda_head_dim
    d = hk * dk
    g = d if CFG.kda_use_full_rank_gate else dk
    for i in [i for i, t in enumerate(CFG.layer_types) if t == KDA]:
        in_proj = w[f"l{i}.kda.in_proj"]
        rows = 3 * d + dk + hk + g
        assert in_proj.shape == (-(-rows // IN_PROJ_ROW_ALIGN) * IN_PROJ_ROW_ALIGN, CFG.hidden_size)
        assert in_proj.shape[0] > rows  # the tiny K3's rows are not a multiple of 64, so the pad is exercised
        src = [_converted(k3_tiny_engine, 0, f"model.layers.{i}.self_attn.{n}_proj.weight").float()
               for n in ("q", "k", "v", "f_a", "b", "g")]
        torch.testing.assert_close(in_proj[:rows], torch.cat(src), rtol=0, atol=0)
        assert not in_proj[rows:].any()
        assert w[f"l{i}.kda.conv"].shape == (3 * d, CFG.kda_conv_size) and w[f"l{i}.kda.conv"].dtype == torch.float32


def test_mxfp4_experts_stacked(k3_tiny_engine):
    w = _weights(k3_tiny_engine, 0)
    e, inter, k = CFG.num_experts, CFG.moe_intermediate_size, CFG.routed_expert_hidden_size
    moe_layers = [i for i in range(CFG.num_hidden_layers) if CFG.is_moe_layer(i)]
    assert moe_layers
    for i in moe_layers:
        w13, w2 = w[f"l{i}.moe.w13"], w[f"l{i}.moe.w2"]
        assert w13.dtype == torch.uint8 and w13.shape == (e, 2 * inter, k // 2)
        assert w[f"l{i}.moe.w13_scale"].shape == (e, 2 * inter, k // 32)
        assert w2.dtype == torch.uint8 and w2.shape == (e, k, inter // 2)
        x = f"model.layers.{i}.block_sparse_moe.experts.5."
        want = torch.cat([_converted(k3_tiny_engine, 0, x + "w1.weight_packed"),
                          _converted(k3_tiny_engine, 0, x + "w3.weight_packed")])
        assert torch.equal(w13[5], want)


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_multi_rank_graphs(multi_engines, name):
    engine, mapping = multi_engines[name], MAPPINGS[name]
    cfg = _config(engine)
    assert cfg["mapping"] == mapping.to_dict() and set(cfg["ranks"]) == {str(r) for r in range(mapping.world_size)}
    for rank in range(mapping.world_size):
        model = _graph(engine, rank)
        _check_graph(model)
        _check_weights_declared(model, _weights(engine, rank))
        info = cfg["ranks"][str(rank)]
        layers = mapping.rank_layers(rank, CFG.num_hidden_layers)
        experts = mapping.local_experts(rank, CFG.num_experts)
        assert info["layers"] == [layers.start, layers.stop] and info["experts"] == [experts.start, experts.stop]
        groups = {"tp": mapping.attn_tp_size, "moe": mapping.moe_ep_size * mapping.moe_tp_size}
        reduces = [n for n in model.graph.node if n.op_type == "AllReduce"]
        for n in reduces:
            group = onnx.helper.get_attribute_value(n.attribute[0]).decode()
            assert groups[group] > 1, f"{n.name}: AllReduce over a group of one"
        attn = [n for n in reduces if n.name.endswith(".attn.allreduce")]
        experts_ar = [n for n in reduces if n.name.endswith(".moe.experts.allreduce")]
        assert len(attn) == (len(layers) if groups["tp"] > 1 else 0)
        # (attention-DP exchanges the experts' rows instead: EPGather / EPScatter)
        exchanged = [n for n in model.graph.node if n.op_type == "EPScatter"]
        moe_count = sum(CFG.is_moe_layer(i) for i in layers)
        assert len(experts_ar) == (moe_count if groups["moe"] > 1 and not mapping.attention_dp else 0)
        assert len(exchanged) == (moe_count if mapping.attention_dp else 0)
        # the latent up-projection is row-parallel over TP: its partial sums share the shared experts' all-reduce
        moe_ar = [n for n in reduces if n.name.endswith(".moe.allreduce")]
        assert len(moe_ar) == (moe_count if groups["tp"] > 1 else 0)
        assert not [n for n in reduces if n.name.endswith(".moe.shared.allreduce")]
        weights = _weights(engine, rank)
        width = CFG.expert_hidden_size // groups["tp"]  # this rank's latent columns (replicated under attention-DP)
        for i in layers:
            if CFG.is_moe_layer(i):
                out_cols = (CFG.expert_hidden_size + CFG.shared_intermediate_size) // groups["tp"]
                assert weights[f"l{i}.moe.out_proj"].shape == (CFG.hidden_size, out_cols)
        # the graph reads the latent columns and the vocabulary rows whose weights the rank holds (Mapping.shard)
        for n in model.graph.node:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            if n.op_type == "MoEOutProj":
                layer = n.name.split(".")[0][1:]
                up = mapping.shard(f"model.layers.{layer}.block_sparse_moe.routed_expert_up_proj.weight", rank, CFG)
                start, stop = up.bounds(CFG.expert_hidden_size)
                assert (attrs["start"], attrs["size"]) == (start, stop - start) and stop - start == width, n.name
            if n.op_type == "Embedding":
                embed = mapping.shard("model.embed_tokens.weight", rank, CFG)
                assert attrs["vocab_start"] == embed.bounds(CFG.vocab_size)[0]
        inputs = {i.name for i in model.graph.input}
        outputs = [o.name for o in model.graph.output]
        blocks = sum(CFG.takes_snapshot(i) for i in range(layers.start))
        if mapping.is_first_stage(rank):
            assert "input_ids" in inputs and "hidden_in" not in inputs
        else:
            assert {"hidden_in", *(f"blocks_in.{j}" for j in range(blocks))} <= inputs and "input_ids" not in inputs
        if mapping.is_last_stage(rank):
            assert outputs == ["logits"]
        else:
            after = sum(CFG.takes_snapshot(i) for i in range(layers.stop))
            assert outputs == ["hidden_out", *(f"blocks_out.{j}" for j in range(after))]


def test_pp_stages_hand_over_matching_blocks(multi_engines):
    s0, s1 = _graph(multi_engines["pp2"], 0).graph, _graph(multi_engines["pp2"], 1).graph
    out0 = {o.name.replace("_out", "_in") for o in s0.output}
    in1 = {i.name for i in s1.input if i.name.startswith(("hidden_in", "blocks_in"))}
    assert out0 == in1 and len(in1) > 1  # the tiny model snapshots before the stage boundary


def test_tp_shards_differ_and_ep_splits_experts(multi_engines):
    tp0, tp1 = _weights(multi_engines["tp2"], 0), _weights(multi_engines["tp2"], 1)
    assert tp0["embed"].shape == (CFG.vocab_size // 2, CFG.hidden_size)
    assert not torch.equal(tp0["embed"], tp1["embed"])
    ep = [_weights(multi_engines["ep4"], r)["l1.moe.w13"] for r in range(4)]
    full = _weights(multi_engines["tp2"], 0)["l1.moe.w13"]  # tp2: experts EP2, first half
    assert all(t.shape[0] == CFG.num_experts // 4 for t in ep)
    assert torch.equal(torch.cat(ep[:2]), full)


def test_inspect_text_and_json(k3_tiny_engine, multi_engines):
    runner = CliRunner()
    res = runner.invoke(main, ["inspect", str(k3_tiny_engine)])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "memory plan: 64 pages of 64 tokens, 8 KDA slots" in out
    for op in PLUGIN_OPS:
        assert f"  {op} " in out
    assert "rank0: pp=0 tp=0 layers 0..8 experts 0..15" in out and "weights" in out
    res = runner.invoke(main, ["inspect", str(k3_tiny_engine), "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == _config(k3_tiny_engine)
    res = runner.invoke(main, ["inspect", str(multi_engines["ep4"])])
    assert res.exit_code == 0
    for r in range(4):
        assert f"rank{r}: pp=0 tp={r} layers 0..8 experts {4 * r}..{4 * r + 3}" in res.output


def test_inspect_refuses_a_non_engine(tmp_path, k3_tiny_ckpt, k3_tiny_engine):
    res = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert res.exit_code != 0 and "not an engine dir" in res.output
    (tmp_path / "config.json").write_text("{}")
    res = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert res.exit_code != 0 and "not a k3build engine config" in res.output
    converted = k3_tiny_engine.with_name(k3_tiny_engine.name + "-converted")
    for path, says in ((converted, f"a converted checkpoint, not an engine; build one from it with `k3build build "
                                   f"{converted} "), (k3_tiny_ckpt, "a Hugging Face checkpoint, not an engine")):
        res = CliRunner().invoke(main, ["inspect", str(path)])
        assert res.exit_code != 0 and says in res.output, res.output


def test_gfx942_target_stamps_and_is_refused_on_cpu(k3_tiny_engine, tmp_path):
    from k3runtime.loader import EngineError, load_rank

    converted = k3_tiny_engine.with_name(k3_tiny_engine.name + "-converted")
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", str(converted), str(out), "--target", "gfx942", "--max-seq-len", "256",
                                    "--max-num-tokens", "256", "--no-progress"])
    assert res.exit_code == 0, res.output
    cfg = _config(out)
    assert cfg["stamp"]["target"] == cfg["build_config"]["target"] == "gfx942"
    assert cfg["stamp"]["target_arch"] == "gfx942" and cfg["build_config"]["page_size"] == 64
    for op, p in cfg["build_config"]["plugins"].items():
        impl = registry.find(op, p["tactic"])
        assert impl is not None and "gfx942" in impl.targets, (op, p)
    _check_graph(_graph(out, 0))
    with pytest.raises(EngineError, match=r"built for target 'gfx942'.*k3build build --target cpu"):
        load_rank(out, 0, "cpu")


def test_residual_adds_live_in_attn_res(k3_tiny_engine):
    """Each layer's attention and FFN outputs reach the running sum through the next AttnRes node (residual=1: the
    output as its second input, the new sum as its second output), never a separate Add, where a snapshot exists;
    a layer that takes a snapshot starts the sum afresh from its attention output."""
    model = onnx.load(k3_tiny_engine / "rank0" / "graph.onnx")
    nodes = {n.name: n for n in model.graph.node}
    assert not [n.name for n in model.graph.node if n.op_type == "Add"]
    residual = lambda n: any(a.name == "residual" and a.i == 1 for a in n.attribute)  # noqa: E731
    for i in range(CFG.num_hidden_layers):
        mixer = nodes[f"l{i}.kda" if CFG.layer_types[i] == KDA else f"l{i}.mla"].output[0]
        mlp_res = nodes[f"l{i}.mlp_res"]
        if CFG.takes_snapshot(i):
            assert mlp_res.input[0] == mixer and not residual(mlp_res)
            running = mixer
        else:
            assert residual(mlp_res) and mlp_res.input[1] == mixer and len(mlp_res.output) == 2
            running = mlp_res.output[1]
        ffn = nodes[f"l{i}.moe.out_proj" if CFG.is_moe_layer(i) else f"l{i}.mlp.mlp"].output[0]
        after = nodes[f"l{i + 1}.attn_res" if i + 1 < CFG.num_hidden_layers else "out_res"]
        assert residual(after) and after.input[1] == ffn
        # the sum the fused add writes is the running sum the next node reads
        assert after.input[0] == running


def test_norms_after_attn_res_live_in_it(k3_tiny_engine):
    """The RMSNorm that reads an AttnRes output is done by that node (norm=1: its weight the input after the node's
    proj and norm, its eps norm_eps), so no RMSNorm node reads an AttnRes output; the one left is layer 0's input
    norm, on the running sum itself (no snapshot yet: no AttnRes node)."""
    model = onnx.load(k3_tiny_engine / "rank0" / "graph.onnx")
    made_by = {o: n for n in model.graph.node for o in n.output}
    attrs = lambda n: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}  # noqa: E731
    fused = [n for n in model.graph.node if n.op_type == "AttnRes"]
    assert len(fused) == 2 * CFG.num_hidden_layers  # every layer's mlp_res, layers 1.. attn_res, out_res
    weight = {"attn_res": "input_norm", "mlp_res": "post_norm"}
    for n in fused:
        a = attrs(n)
        assert a["norm"] == 1 and a["norm_eps"] == pytest.approx(CFG.rms_norm_eps), n.name
        layer, _, which = n.name.partition(".")
        assert n.input[3 + a.get("residual", 0)] == (f"{layer}.{weight[which]}" if which else "norm"), n.name
    norms = [n for n in model.graph.node if n.op_type == "RMSNorm"]
    assert [n.name for n in norms] == ["l0.input_norm"]
    assert made_by[norms[0].input[0]].op_type == "Embedding"
