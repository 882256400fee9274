"""A rank's program as an ONNX graph whose plugin nodes live in the `k3` domain.

The graph threads K3's attention-residual state explicitly (K3_SPEC.md §2.1): `p` is the running sum of the
current block and every snapshot is just another named value fed to later `AttnRes` nodes, so the runtime
carries no hidden model state. A layer's output is added to `p` by the next `AttnRes` node (`residual=1`: the
output as its second input, the new `p` as its second output) where one exists, else by a plain `Add`; the
`RMSNorm` that reads an `AttnRes` output is done by that node too (`norm=1`: its weight the input after the
node's own weights). Weights are graph inputs (bound from weights.safetensors by name); per-step metadata (sequence
offsets, slots, pages) reaches the KDA/MLA plugins through the executor's step context, addressed by each node's
`cache_index`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
import torch
from onnx import TensorProto, helper

from ..config import KDA, K3Config
from ..mapping import Mapping

DOMAIN = "k3"
OPSET = 1
_ONNX_DTYPE = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16,
               torch.float16: TensorProto.FLOAT16, torch.uint8: TensorProto.UINT8, torch.int64: TensorProto.INT64}


@dataclass
class _Builder:
    cfg: K3Config
    mapping: Mapping
    rank: int
    act_dtype: torch.dtype
    capacity: int
    weights: dict  # engine tensor name -> (shape, dtype)
    nodes: list = field(default_factory=list)
    count: int = 0

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, name: str = "", domain: str = DOMAIN, **attrs):
        self.count += 1
        base = name or f"{op_type.lower()}{self.count}"
        outs = [f"{base}:{i}" for i in range(num_outputs)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, domain=domain, **attrs))
        return outs[0] if num_outputs == 1 else outs

    def add(self, a: str, b: str, name: str = "") -> str:
        return self.op("Add", [a, b], name=name, domain="")

    def reduce(self, x: str, group: str, size: int, name: str) -> str:
        # Partial sums over a rank group; a group of one needs no node.
        return self.op("AllReduce", [x], name=name, group=group) if size > 1 else x


def build_graph(cfg: K3Config, mapping: Mapping, rank: int, weights: dict[str, tuple[tuple[int, ...], torch.dtype]],
                act_dtype: torch.dtype, capacity: int = 2048) -> onnx.ModelProto:
    """Args: weights: engine tensor name -> (shape, dtype) for this rank (from the layout pass);
    capacity: most tokens one rank feeds a step (the expert exchange buffers of attention-DP are this big)."""
    b = _Builder(cfg, mapping, rank, act_dtype, capacity, weights)
    layers = mapping.rank_layers(rank, cfg.num_hidden_layers)
    blocks = [f"blocks_in.{i}" for i in range(cfg.snapshots_before(layers.start))]
    data_inputs = []
    if mapping.is_first_stage(rank):
        data_inputs.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["T"]))
        tp = mapping.dense_tp_size
        vocab_start = mapping.dense_tp_rank(rank) * (cfg.vocab_size // tp)
        p = b.op("Embedding", ["input_ids", "embed"], name="embed", vocab_start=vocab_start)
        p = b.reduce(p, "tp", tp, "embed.allreduce")
    else:
        data_inputs.append(helper.make_tensor_value_info("hidden_in", _ONNX_DTYPE[act_dtype], ["T", cfg.hidden_size]))
        data_inputs += [helper.make_tensor_value_info(n, _ONNX_DTYPE[act_dtype], ["T", cfg.hidden_size]) for n in blocks]
        p = "hidden_in"
    kda_index = mla_index = 0
    delta = None  # each layer's output, added to the running sum by the next AttnRes (or Add)
    for layer in layers:
        p, delta, blocks = _decoder_layer(b, layer, p, delta, blocks,
                                          kda_index if cfg.layer_types[layer] == KDA else mla_index)
        if cfg.layer_types[layer] == KDA:
            kda_index += 1
        else:
            mla_index += 1
    outputs = []
    if mapping.is_last_stage(rank):
        data_inputs.append(helper.make_tensor_value_info("logits_indices", TensorProto.INT64, ["N"]))
        h, p = _attn_res(b, p, delta, blocks if cfg.attn_res_block_size is not None else [], "out_res",
                         f"l{layers.stop - 1}.mlp.residual", "norm", "final_norm")
        logits = b.op("LMHead", [h, "lm_head", "logits_indices"], name="lm_head")
        tp = mapping.dense_tp_size
        if tp > 1:
            logits = b.op("AllGather", [logits], name="lm_head.allgather", group="tp", axis=-1)
        b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", cfg.vocab_size]))
    else:
        if delta is not None:
            p = b.add(p, delta, name=f"l{layers.stop - 1}.mlp.residual")
        b.nodes.append(helper.make_node("Identity", [p], ["hidden_out"], name="hidden_out"))
        outputs.append(helper.make_tensor_value_info("hidden_out", _ONNX_DTYPE[act_dtype], ["T", cfg.hidden_size]))
        for i, blk in enumerate(blocks):
            b.nodes.append(helper.make_node("Identity", [blk], [f"blocks_out.{i}"], name=f"blocks_out.{i}"))
            outputs.append(helper.make_tensor_value_info(f"blocks_out.{i}", _ONNX_DTYPE[act_dtype], ["T", cfg.hidden_size]))
    weight_inputs = [helper.make_tensor_value_info(n, _ONNX_DTYPE[dt], list(shape)) for n, (shape, dt) in weights.items()]
    graph = helper.make_graph(b.nodes, f"k3_rank{rank}", data_inputs + weight_inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, OPSET)],
                              producer_name="k3build")
    onnx.checker.check_model(model)
    return model


def _decoder_layer(b: _Builder, layer: int, p: str, delta: str | None, blocks: list[str],
                   cache_index: int) -> tuple[str, str, list[str]]:
    """One layer on the running sum p + delta (delta: the last layer's output, not yet added: the add is fused
    into the next AttnRes where there is one). Returns the same pair after this layer, and the snapshots."""
    cfg, e = b.cfg, f"l{layer}."
    x, p = _attn_res(b, p, delta, blocks, e + "attn_res", f"l{layer - 1}.mlp.residual", e + "input_norm")
    reset = cfg.takes_snapshot(layer)
    if reset:
        blocks = blocks + [p]
    a = _kda(b, layer, x, cache_index) if cfg.layer_types[layer] == KDA else _mla(b, layer, x, cache_index)
    a = b.reduce(a, "tp", b.mapping.attn_tp_size, e + "attn.allreduce")
    p, a = (a, None) if reset else (p, a)
    x, p = _attn_res(b, p, a, blocks, e + "mlp_res", e + "attn.residual", e + "post_norm")
    f = _moe(b, layer, x) if cfg.is_moe_layer(layer) else _dense(b, e + "mlp.", x)
    return p, f, blocks


def _attn_res(b: _Builder, p: str, delta: str | None, blocks: list[str], name: str, add_name: str, norm: str,
              norm_name: str = "") -> tuple[str, str]:
    """(RMSNorm of the AttnRes output, running sum) for the running sum p + delta; norm: that RMSNorm's weight
    (norm_name: its node's name when it is a node of its own, else the weight's). Where there are snapshots to mix,
    one AttnRes node does it all: the add (residual=1, the sum its second output) and the norm (norm=1). Without
    snapshots the mix is the identity (K3_SPEC §2.1): a plain Add named add_name (or nothing to add: delta None),
    then the RMSNorm on the sum."""
    eps = b.cfg.rms_norm_eps
    if not blocks:
        if delta is not None:
            p = b.add(p, delta, name=add_name)
        return b.op("RMSNorm", [p, norm], name=norm_name or norm, eps=eps), p
    weights = [name + ".proj", name + ".norm", norm]
    attrs = dict(name=name, eps=eps, norm=1, norm_eps=eps)
    if delta is None:
        return b.op("AttnRes", [p, *weights, *blocks], **attrs), p
    return tuple(b.op("AttnRes", [p, delta, *weights, *blocks], num_outputs=2, residual=1, **attrs))


def _mlp_attrs(cfg: K3Config) -> dict:
    return {"act": cfg.hidden_act, "beta": cfg.situ_beta, "linear_beta": cfg.situ_linear_beta}


def _dense(b: _Builder, e: str, x: str) -> str:
    y = b.op("GatedMLP", [x, e + "gate_up", e + "down"], name=e + "mlp", **_mlp_attrs(b.cfg))
    return b.reduce(y, "tp", b.mapping.dense_tp_size, e + "allreduce")


def _kda(b: _Builder, layer: int, x: str, cache_index: int) -> str:
    cfg, e = b.cfg, f"l{layer}.kda."
    ins = [x] + [e + n for n in ("in_proj", "conv", "f_b", "A_log", "dt_bias")]
    ins += [e + "g_b" if not cfg.kda_use_full_rank_gate else ""] + [e + "o_norm", e + "o_proj"]
    return b.op("KDA", ins, name=f"l{layer}.kda", cache_index=cache_index,
                num_heads=cfg.kda_num_heads // b.mapping.attn_tp_size, head_dim=cfg.kda_head_dim,
                lower_bound=cfg.kda_gate_lower_bound, eps=cfg.rms_norm_eps)


def _mla(b: _Builder, layer: int, x: str, cache_index: int) -> str:
    cfg, e = b.cfg, f"l{layer}.mla."
    lora = cfg.q_lora_rank is not None
    ins = [x, e + "in_proj", e + "q_a_norm" if lora else "", e + "q_b" if lora else "", e + "kv_a_norm",
           e + "w_uk", e + "w_uv", e + "o_proj"]
    return b.op("MLA", ins, name=f"l{layer}.mla", cache_index=cache_index,
                num_heads=cfg.num_attention_heads // b.mapping.attn_tp_size, qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, scale=cfg.qk_head_dim ** -0.5,
                latent_eps=cfg.mla_latent_norm_eps, output_gate=int(cfg.mla_use_output_gate))


def _moe(b: _Builder, layer: int, x: str) -> str:
    cfg, mp, e = b.cfg, b.mapping, f"l{layer}.moe."
    routing = dict(top_k=cfg.num_experts_per_token, renormalize=int(cfg.moe_renormalize),
                   scaling_factor=cfg.routed_scaling_factor, num_expert_group=cfg.num_expert_group,
                   topk_group=cfg.topk_group)
    z, shared_h = x, None
    if cfg.is_latent_moe:
        # One GEMM for every projection of x: the latent down-projection, the shared expert's gate and up, and the
        # router's rows (layout.py stacks them in `in_proj`); the router's logits come out of it in fp32
        ids, weights, zh = b.op("MoEInProj", [x, e + "in_proj", e + "bias"], num_outputs=3, name=e + "in_proj",
                                num_experts=cfg.num_experts, **routing)
        sizes = [cfg.expert_hidden_size, b.weights[e + "in_proj"][0][0] - cfg.num_experts - cfg.expert_hidden_size]
        z, shared_h = b.op("SplitColumns", [zh], num_outputs=2, name=e + "in_proj.split", sizes=sizes)
    else:
        ids, weights = b.op("Router", [x, e + "gate", e + "bias"], num_outputs=2, name=e + "router", **routing)
    quant = cfg.quantization.method == "mxfp4"
    exchange = mp.attention_dp and mp.moe_ep_size > 1
    zs, ids_s, w_s = z, ids, weights
    if exchange:
        # Attention-DP: every rank has its own tokens. Gather all ranks' (fixed-capacity, zero-padded) tokens,
        # run the local experts on all of them, and reduce-scatter the partial sums back to their owners.
        zs, ids_s, w_s = b.op("EPGather", [z, ids, weights], num_outputs=3, name=e + "dispatch", group="moe",
                              capacity=b.capacity)
    y = b.op("MoEExperts", [zs, ids_s, w_s, e + "w13", e + "w13_scale" if quant else "", e + "w2",
                            e + "w2_scale" if quant else ""], name=e + "experts",
             expert_start=mp.local_experts(b.rank, cfg.num_experts).start, **_mlp_attrs(cfg))
    if exchange:
        y = b.op("EPScatter", [y, z], name=e + "combine", group="moe", capacity=b.capacity)
    else:
        # Expert partials are summed across the EP x MoE-TP ranks in fp32, in latent space, before the norm.
        y = b.reduce(y, "moe", mp.moe_ep_size * mp.moe_tp_size, e + "experts.allreduce")
    tp = mp.dense_tp_size
    if cfg.is_latent_moe:
        # The latent up-projection (row-parallel, Mapping.shard: this rank's columns of the latent) and the shared
        # expert's down-projection as one GEMM over their inputs side by side; its TP partial sums in one all-reduce
        width = cfg.expert_hidden_size // tp
        out = b.op("MoEOutProj", [y, e + "latent_norm" if cfg.latent_moe_use_norm else "", shared_h, e + "out_proj"],
                   name=e + "out_proj", start=mp.dense_tp_rank(b.rank) * width, size=width, eps=cfg.rms_norm_eps,
                   **_mlp_attrs(cfg))
        return b.reduce(out, "tp", tp, e + "allreduce")
    y = b.op("Cast", [y], name=e + "experts.cast", domain="", to=_ONNX_DTYPE[b.act_dtype])
    shared = _dense(b, e + "shared.", x)
    return b.add(y, shared, name=e + "add_shared")
