"""Weight layout passes: a rank's canonical (converted) tensors -> the tensors its plugins read.

Passes, per layer:
- KDA: fuse every projection of x into one `in_proj` [q | k | v | f_a | b | g] (one GEMM reads x once; zero
  rows pad it to a multiple of IN_PROJ_ROW_ALIGN),
  fuse the three depthwise conv weights into `conv` [3D, W] fp32.
- MLA: absorb kv_b_proj into `w_uk` [H, nope, r] (q side) and `w_uv` [H, r, v] (o side), so decode reads
  only the 576-wide latent cache.
- Dense / shared MLPs: fuse gate and up rows into `gate_up` [2I, D]. Latent MoE: the shared expert's gate and up
  rows go under the latent down-projection's, then the router's, in `in_proj` [latent + 2I + E, D] (one GEMM of
  the MoE input, MoEInProj).
- MoE: stack the local experts into `w13` [E, 2I, K/2] (+ scales) and `w2` [E, D, I/2] (+ scales) — the
  layout k3plugins.moe reads; the MXFP4 bytes in the checkpoint's nibble order, or relaid for the tactic that
  reads them (EXPERT_LAYOUTS). The "lane" layout's experts read z in its K order: the latent down-projection's
  rows go into `in_proj` in that order (mxfp4.lane_permute).
Tensor names in the engine are ours (`l{layer}.kda.in_proj`, …); the checkpoint's names stop here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from k3plugins.kda.reference import IN_PROJ_ROW_ALIGN
from k3plugins.moe.mxfp4 import lane_permute, lane_tile_mxfp4, pair_tile_mxfp4, restride_mxfp4, tile_scales

from ..config import KDA, K3Config
from ..mapping import Mapping

# F32 in the checkpoint and read in fp32 by the kernels (K3_SPEC.md §3).
_KEEP_FP32 = ("conv", "A_log", "dt_bias", "o_norm", "bias")

Get = Callable[[str], torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# MXFP4 expert layouts by name (k3plugins.registry.Impl.expert_layout) -> the passes that write them: (bytes, scales).
LayOut = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
EXPERT_LAYOUTS: dict[str, LayOut] = {"natural": (_same, _same), "strided": (restride_mxfp4, _same),
                                     "paired": (pair_tile_mxfp4, tile_scales), "lane": (lane_tile_mxfp4, tile_scales)}


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t.contiguous()
    leaf = name.rsplit(".", 1)[-1]
    return t.to(torch.float32 if leaf in _KEEP_FP32 else dtype).contiguous()


def engine_tensors(cfg: K3Config, mapping: Mapping, rank: int, get: Get, dtype: torch.dtype,
                   expert_layout: str = "natural") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank, layer by layer (bounded memory). expert_layout: a key of
    EXPERT_LAYOUTS, the MXFP4 expert byte order the recorded MoE tactic reads (tactics.expert_layout)."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout: unknown {expert_layout!r}; expected one of {sorted(EXPERT_LAYOUTS)}")
    if mapping.is_first_stage(rank):
        yield "embed", _cast("embed", get("model.embed_tokens.weight"), dtype)
    for layer in mapping.rank_layers(rank, cfg.num_hidden_layers):
        for name, t in _layer(cfg, mapping, rank, layer, get, expert_layout):
            yield name, _cast(name, t, dtype)
    if mapping.is_last_stage(rank):
        if cfg.attn_res_block_size is not None:
            yield "out_res.proj", _cast("proj", get("model.output_attn_res_proj.weight").reshape(-1), dtype)
            yield "out_res.norm", _cast("norm", get("model.output_attn_res_norm.weight"), dtype)
        yield "norm", _cast("norm", get("model.norm.weight"), dtype)
        yield "lm_head", _cast("lm_head", get("lm_head.weight"), dtype)


def _layer(cfg: K3Config, mapping: Mapping, rank: int, layer: int, get: Get,
           expert_layout: str) -> Iterator[tuple[str, torch.Tensor]]:
    p, e = f"model.layers.{layer}.", f"l{layer}."
    yield e + "input_norm", get(p + "input_layernorm.weight")
    yield e + "post_norm", get(p + "post_attention_layernorm.weight")
    if cfg.attn_res_block_size is not None:
        for side, src in (("attn_res", "self_attention_res"), ("mlp_res", "mlp_res")):
            if side == "attn_res" and not cfg.snapshots_before(layer):
                continue  # no snapshot yet: the attn-side AttnRes is the identity (K3_SPEC §2.1), its weights unused
            yield e + side + ".proj", get(p + src + "_proj.weight").reshape(-1)
            yield e + side + ".norm", get(p + src + "_norm.weight")
    a = p + "self_attn."
    if cfg.layer_types[layer] == KDA:
        yield from _kda(cfg, a, e + "kda.", get)
    else:
        yield from _mla(cfg, mapping, a, e + "mla.", get)
    if cfg.is_moe_layer(layer):
        yield from _moe(cfg, mapping, rank, p + "block_sparse_moe.", e + "moe.", get, expert_layout)
    else:
        yield e + "mlp.gate_up", torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        yield e + "mlp.down", get(p + "mlp.down_proj.weight")


def _kda(cfg: K3Config, a: str, e: str, get: Get):
    gate = [get(a + "g_proj.weight")] if cfg.kda_use_full_rank_gate else [get(a + "g_a_proj.weight")]
    rows = [get(a + n + "_proj.weight") for n in ("q", "k", "v", "f_a", "b")] + gate
    in_proj = torch.cat([r.to(rows[0].dtype) for r in rows])
    pad = -in_proj.shape[0] % IN_PROJ_ROW_ALIGN  # zero rows: the GEMM's output rows stay 16-byte aligned
    yield e + "in_proj", F.pad(in_proj, (0, 0, 0, pad))
    yield e + "conv", torch.cat([get(a + n + "_conv1d.weight").float()[:, 0, :] for n in ("q", "k", "v")])
    yield e + "f_b", get(a + "f_b_proj.weight")
    yield e + "A_log", get(a + "A_log")
    yield e + "dt_bias", get(a + "dt_bias")
    if not cfg.kda_use_full_rank_gate:
        yield e + "g_b", get(a + "g_b_proj.weight")
    yield e + "o_norm", get(a + "o_norm.weight")
    yield e + "o_proj", get(a + "o_proj.weight")


def _mla(cfg: K3Config, mapping: Mapping, a: str, e: str, get: Get):
    heads = cfg.num_attention_heads // mapping.attn_tp_size
    nope, v, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    # Every projection of x in one GEMM, in the order the mixer splits it (k3plugins.mla.reference.in_proj_rows):
    # q_a (or the plain q_proj), the latent kv_a, the output gate
    lora = cfg.q_lora_rank is not None
    rows = [get(a + ("q_a_proj.weight" if lora else "q_proj.weight")), get(a + "kv_a_proj_with_mqa.weight")]
    if cfg.mla_use_output_gate:
        rows.append(get(a + "g_proj.weight"))
    yield e + "in_proj", torch.cat([t.to(rows[0].dtype) for t in rows])
    if lora:
        yield e + "q_a_norm", get(a + "q_a_layernorm.weight")
        yield e + "q_b", get(a + "q_b_proj.weight")
    yield e + "kv_a_norm", get(a + "kv_a_layernorm.weight")
    kv_b = get(a + "kv_b_proj.weight").reshape(heads, nope + v, r)  # head-major [k_nope | v] rows
    yield e + "w_uk", kv_b[:, :nope, :].contiguous()  # [H, nope, r]
    yield e + "w_uv", kv_b[:, nope:, :].transpose(1, 2).contiguous()  # [H, r, v]
    yield e + "o_proj", get(a + "o_proj.weight")


def _moe(cfg: K3Config, mapping: Mapping, rank: int, m: str, e: str, get: Get, expert_layout: str):
    if expert_layout == "lane" and not (cfg.is_latent_moe and cfg.quantization.method == "mxfp4"):
        raise ValueError("expert_layout 'lane' reads z in its K order, which only a latent MoE's MXFP4 experts get "
                         "(tactics.fit_moe_tactic steps other MoEs down to triton_p)")
    lay_out = EXPERT_LAYOUTS[expert_layout]
    yield e + "bias", get(m + "gate.e_score_correction_bias")
    s = m + "shared_experts."
    shared_gate_up = [get(s + "gate_proj.weight"), get(s + "up_proj.weight")]
    if cfg.is_latent_moe:
        # every projection of the MoE input in one GEMM: the latent down-projection, the shared expert's gate and
        # up, then the router's rows (MoEInProj; graph.py splits the rest of its output)
        # the lane layout's experts read z in its K order: the rows that make z are permuted to it
        down = get(m + "routed_expert_down_proj.weight")
        rows = [lane_permute(down, 0) if expert_layout == "lane" else down, *shared_gate_up, get(m + "gate.weight")]
        yield e + "in_proj", torch.cat([r.to(rows[0].dtype) for r in rows])
        if cfg.latent_moe_use_norm:
            yield e + "latent_norm", get(m + "routed_expert_norm.weight")
        # the latent up-projection's columns (this rank's) beside the shared expert's down: one GEMM (MoEOutProj)
        yield e + "out_proj", torch.cat([get(m + "routed_expert_up_proj.weight"), get(s + "down_proj.weight")], dim=1)
    else:
        yield e + "gate", get(m + "gate.weight")
    experts = mapping.local_experts(rank, cfg.num_experts)
    x = m + "experts.{}.{}."
    if cfg.quantization.method == "mxfp4":
        for leaf, suffix, f in (("", "weight_packed", lay_out[0]), ("_scale", "weight_scale", lay_out[1])):
            # one expert at a time through the layout (bounded memory), then stacked
            yield e + "w13" + leaf, torch.stack([f(torch.cat([get(x.format(i, "w1") + suffix),
                                                              get(x.format(i, "w3") + suffix)])) for i in experts])
            yield e + "w2" + leaf, torch.stack([f(get(x.format(i, "w2") + suffix)) for i in experts])
    else:
        yield e + "w13", torch.stack([torch.cat([get(x.format(i, "w1") + "weight"), get(x.format(i, "w3") + "weight")])
                                      for i in experts])
        yield e + "w2", torch.stack([get(x.format(i, "w2") + "weight") for i in experts])
    if not cfg.is_latent_moe:
        yield e + "shared.gate_up", torch.cat(shared_gate_up)
        yield e + "shared.down", get(s + "down_proj.weight")
