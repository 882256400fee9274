"""Random tiny checkpoints for parity tests.

`make_kimi_linear` builds a `transformers.KimiLinearForCausalLM` (fp32) and saves it with `save_pretrained`, so the
files are exactly what transformers writes (original Kimi naming, PITFALLS.md). `make_k3_tiny` writes a K3-naming
checkpoint (wrapper config, `language_model.` prefix, two shards + index, bf16 dense weights, MXFP4 experts) for the
K3-only features transformers does not implement.

Weights are re-drawn with O(1) activations (transformers' 0.02-std init makes near-uniform logits and ties), and
every parameter a bug could hide behind (norm weights, A_log, dt_bias, conv taps, e_score_correction_bias) is random.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch


@dataclass(frozen=True)
class KimiLinearVariant:
    """One tiny Kimi-Linear shape; `layers` is the 0-based kda/mla pattern."""

    layers: tuple[str, ...]
    hidden_size: int = 64
    vocab_size: int = 256
    intermediate_size: int = 96
    q_lora_rank: int | None = None
    num_attention_heads: int = 2
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    kda_num_heads: int = 2
    kda_head_dim: int = 16
    num_experts: int = 8
    num_experts_per_token: int = 2
    moe_intermediate_size: int = 32
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.446
    first_k_dense_replace: int = 1
    num_expert_group: int = 1
    topk_group: int = 1


KDA, MLA = "kda", "mla"

# Readable ids for parametrize: every variant differs from `base` in the axes its name says.
VARIANTS: dict[str, KimiLinearVariant] = {
    "base": KimiLinearVariant(layers=(KDA, KDA, KDA, MLA)),
    "qlora_mixed": KimiLinearVariant(
        layers=(KDA, MLA, KDA, MLA, MLA), hidden_size=96, vocab_size=384, q_lora_rank=32, num_attention_heads=4,
        kda_num_heads=4, num_experts=16, num_experts_per_token=4, num_shared_experts=2, routed_scaling_factor=1.0),
    "wide_mla_first": KimiLinearVariant(
        layers=(MLA, KDA, KDA, MLA, KDA), hidden_size=128, vocab_size=512, intermediate_size=160, q_lora_rank=48,
        num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=24,
        kda_num_heads=4, kda_head_dim=32, num_experts=12, num_experts_per_token=3, moe_intermediate_size=48,
        first_k_dense_replace=2),
}

# Shapes transformers runs but K3 never uses (grouped routing): for oracle-vs-transformers tests only.
EXTRA_VARIANTS: dict[str, KimiLinearVariant] = {
    "grouped_router": KimiLinearVariant(layers=(KDA, MLA, KDA), num_experts=16, num_experts_per_token=4,
                                        num_expert_group=4, topk_group=2),
}

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def make_kimi_linear(out_dir: str | Path, *, seed: int, variant: str | KimiLinearVariant = "base") -> Path:
    """Build a random tiny `KimiLinearForCausalLM` (fp32) and `save_pretrained` it into `out_dir`.

    Built inside the transformers oracle's worker process (see hf_oracle.py): the caller never imports
    transformers (seconds saved, and no fla/triton binding in the test process).

    Args:
        out_dir: directory to write (created); gets config.json, model.safetensors, generation_config.json.
        seed: all weights and buffers are a function of it.
        variant: a key of `VARIANTS` / `EXTRA_VARIANTS`, or a `KimiLinearVariant`.
    Returns:
        `out_dir` as a Path.
    """
    from . import hf_oracle

    known = {**VARIANTS, **EXTRA_VARIANTS}
    if isinstance(variant, str) and variant not in known:
        raise KeyError(f"variant {variant!r}: known {sorted(known)}")
    v = known[variant] if isinstance(variant, str) else variant
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_oracle.build_kimi_linear(out, seed, dataclasses.asdict(v))
    return out


def build_kimi_linear_here(out_dir: str | Path, seed: int, v: KimiLinearVariant) -> None:
    """`make_kimi_linear`'s body, run in the process that already has transformers imported."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    n = len(v.layers)
    full = [i + 1 for i, t in enumerate(v.layers) if t == MLA]
    cfg = KimiLinearConfig(
        vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
        moe_intermediate_size=v.moe_intermediate_size, num_hidden_layers=n, num_attention_heads=v.num_attention_heads,
        num_key_value_heads=v.num_attention_heads, q_lora_rank=v.q_lora_rank, kv_lora_rank=v.kv_lora_rank,
        qk_rope_head_dim=v.qk_rope_head_dim, qk_nope_head_dim=v.qk_nope_head_dim, v_head_dim=v.v_head_dim,
        num_experts=v.num_experts, num_experts_per_token=v.num_experts_per_token,
        num_shared_experts=v.num_shared_experts, routed_scaling_factor=v.routed_scaling_factor,
        first_k_dense_replace=v.first_k_dense_replace, n_group=v.num_expert_group, topk_group=v.topk_group,
        linear_attn_config=dict(num_heads=v.kda_num_heads, head_dim=v.kda_head_dim, short_conv_kernel_size=4,
                                full_attn_layers=full, kda_layers=[i for i in range(1, n + 1) if i not in full]),
        max_position_embeddings=4096, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype="float32")
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).float().eval()
    randomize_(model, seed)
    model.save_pretrained(out_dir)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter and the router bias buffers of a Kimi-Linear model in place."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(uniform(p.shape, 1.0, 8.0).log())
        elif leaf == "dt_bias":
            p.copy_(uniform(p.shape, -3.0, 1.0))
        elif "norm" in name:
            p.copy_(uniform(p.shape, 0.5, 1.5))
        elif "conv1d" in name:
            p.copy_(normal(p.shape, 0.5))
        elif "embed_tokens" in name:
            p.copy_(normal(p.shape, 1.0))
        elif name.endswith("gate.weight") or "lm_head" in name:
            # wider router/lm_head logits: distinct expert picks, clear argmax margins for greedy parity
            p.copy_(normal(p.shape, 2.0 / math.sqrt(p.shape[-1])))
        else:
            p.copy_(normal(p.shape, 1.0 / math.sqrt(p.shape[-1])))
    _shrink_mla_latents_(model.named_parameters(), model.config.kv_lora_rank)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(normal(b.shape, 0.15))


LATENT_SCALE = 0.01


@torch.no_grad()
def _shrink_mla_latents_(named: Iterable[tuple[str, torch.Tensor]], kv_lora_rank: int) -> None:
    # Latents with mean square ~1e-4 make the latent norms' eps (1e-6, not rms_norm_eps; PITFALLS.md) visible in the
    # logits; the RMSNorm right after restores their scale, so nothing else gets smaller. k_pe rows stay O(1).
    for name, p in named:
        if name.endswith("q_a_proj.weight"):
            p.mul_(LATENT_SCALE)
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            p[:kv_lora_rank].mul_(LATENT_SCALE)


# --- K3 naming (only for the K3-feature oracle test; the project's synth is the real writer) -------------------

_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _mxfp4_random(rng: np.random.Generator, n: int, k: int, std: float) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 tensor for a logical [n, k] weight of roughly `std`: (packed u8 [n, k/2], scale u8 [n, k/32])."""
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    rms = math.sqrt(float((_E2M1 ** 2).mean()))
    base = 127 + round(math.log2(std / rms))
    scale = rng.integers(base - 1, base + 2, size=(n, k // 32), dtype=np.int64).astype(np.uint8)
    return packed, scale


def k3_tensor_shapes(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name (without `language_model.`) -> (shape, kind) for a K3 checkpoint; kind is bf16|f32|mxfp4|norm."""
    h, d = cfg.hidden_size, cfg.kda_dim
    s: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), "embed"), "model.norm.weight": ((h,), "norm"),
        "model.output_attn_res_norm.weight": ((h,), "norm"), "model.output_attn_res_proj.weight": ((1, h), "bf16"),
        "lm_head.weight": ((cfg.vocab_size, h), "bf16")}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            s[p + n + ".weight"] = ((h,), "norm")
        s[p + "self_attention_res_proj.weight"] = ((1, h), "bf16")
        s[p + "mlp_res_proj.weight"] = ((1, h), "bf16")
        a = p + "self_attn."
        if kind == KDA:
            for n in ("q", "k", "v"):
                s[a + f"{n}_proj.weight"] = ((d, h), "bf16")
                s[a + f"{n}_conv1d.weight"] = ((d, 1, cfg.kda_conv_size), "conv")
            s[a + "f_a_proj.weight"] = ((cfg.kda_head_dim, h), "bf16")
            s[a + "f_b_proj.weight"] = ((d, cfg.kda_head_dim), "bf16")
            s[a + "b_proj.weight"] = ((cfg.kda_num_heads, h), "bf16")
            s[a + "A_log"] = ((max(cfg.kda_num_heads, cfg.kda_head_dim),), "A_log")
            s[a + "dt_bias"] = ((d,), "dt_bias")
            s[a + "g_proj.weight"] = ((d, h), "bf16")
            s[a + "o_norm.weight"] = ((cfg.kda_head_dim,), "norm32")
            s[a + "o_proj.weight"] = ((h, d), "bf16")
        else:
            nh, qk = cfg.num_attention_heads, cfg.qk_head_dim
            if cfg.q_lora_rank:
                s[a + "q_a_proj.weight"] = ((cfg.q_lora_rank, h), "bf16")
                s[a + "q_a_layernorm.weight"] = ((cfg.q_lora_rank,), "norm")
                s[a + "q_b_proj.weight"] = ((nh * qk, cfg.q_lora_rank), "bf16")
            else:
                s[a + "q_proj.weight"] = ((nh * qk, h), "bf16")
            s[a + "kv_a_proj_with_mqa.weight"] = ((cfg.mla_cache_width, h), "bf16")
            s[a + "kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), "norm")
            s[a + "kv_b_proj.weight"] = ((nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "bf16")
            s[a + "g_proj.weight"] = ((nh * cfg.v_head_dim, h), "bf16")
            s[a + "o_proj.weight"] = ((h, nh * cfg.v_head_dim), "bf16")
        if not cfg.is_moe_layer(i):
            s[p + "mlp.gate_proj.weight"] = ((cfg.intermediate_size, h), "bf16")
            s[p + "mlp.up_proj.weight"] = ((cfg.intermediate_size, h), "bf16")
            s[p + "mlp.down_proj.weight"] = ((h, cfg.intermediate_size), "bf16")
            continue
        m, lat, inter, sh = p + "block_sparse_moe.", cfg.expert_hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
        s[m + "gate.weight"] = ((cfg.num_experts, h), "router")
        s[m + "gate.e_score_correction_bias"] = ((cfg.num_experts,), "bias")
        s[m + "routed_expert_down_proj.weight"] = ((lat, h), "bf16")
        s[m + "routed_expert_norm.weight"] = ((lat,), "norm")
        s[m + "routed_expert_up_proj.weight"] = ((h, lat), "bf16")
        s[m + "shared_experts.gate_proj.weight"] = ((sh, h), "bf16")
        s[m + "shared_experts.up_proj.weight"] = ((sh, h), "bf16")
        s[m + "shared_experts.down_proj.weight"] = ((h, sh), "bf16")
        for e in range(cfg.num_experts):
            for w, shape in (("w1", (inter, lat)), ("w3", (inter, lat)), ("w2", (lat, inter))):
                s[m + f"experts.{e}.{w}"] = (shape, "mxfp4")
    return s


def make_k3_tiny(out_dir: str | Path, *, seed: int, cfg=None) -> Path:
    """Write a random K3-naming checkpoint (default config: `k3build.config.preset("tiny")`).

    Layout as the published one (K3_SPEC.md §3): wrapper config.json, tensors under `language_model.`, two shards
    plus model.safetensors.index.json, BF16 dense weights, F32 conv/A_log/dt_bias/o_norm/router bias, MXFP4 experts.
    """
    from safetensors.torch import save_file

    from k3build.config import preset, to_hf_wrapper_config

    cfg = cfg or preset("tiny")
    rng = np.random.default_rng(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in k3_tensor_shapes(cfg).items():
        full = "language_model." + name
        if kind == "mxfp4":
            packed, scale = _mxfp4_random(rng, shape[0], shape[1], 1.0 / math.sqrt(shape[1]))
            tensors[full + ".weight_packed"] = torch.from_numpy(packed)
            tensors[full + ".weight_scale"] = torch.from_numpy(scale)
            continue
        if kind == "A_log":
            a = np.zeros(shape, np.float32)
            a[: cfg.kda_num_heads] = np.log(rng.uniform(1.0, 8.0, cfg.kda_num_heads))
            tensors[full] = torch.from_numpy(a)
            continue
        std = {"embed": 1.0, "conv": 0.5, "bias": 0.15, "router": 2.0 / math.sqrt(shape[-1])}.get(kind, 1.0 / math.sqrt(shape[-1]))
        if kind in ("norm", "norm32"):
            arr = rng.uniform(0.5, 1.5, shape)
        elif kind == "dt_bias":
            arr = rng.uniform(-3.0, 1.0, shape)
        else:
            arr = rng.standard_normal(shape) * std
        t = torch.from_numpy(arr.astype(np.float32))
        _shrink_mla_latents_([(name, t)], cfg.kv_lora_rank)
        tensors[full] = t if kind in ("conv", "dt_bias", "norm32", "bias") else t.to(torch.bfloat16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(to_hf_wrapper_config(cfg), indent=2))
    return out


def kimi_linear_to_k3_naming(src: str | Path, dst: str | Path, *, num_shards: int = 2) -> Path:
    """Rewrite a transformers Kimi-Linear checkpoint in K3 naming with every K3-only feature off.

    Dense MLP moves to `mlp.`, the low-rank output gate is folded into a full-rank `g_proj` (g_b @ g_a), A_log
    becomes a zero-padded vector, names get `language_model.`, tensors are split into shards with an index. The
    model is the same function, so an oracle reading K3 naming must reproduce transformers' logits on it.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from k3build.config import K3Config, to_hf_wrapper_config

    src, dst = Path(src), Path(dst)
    cfg = dataclasses.replace(K3Config.from_file(src / "config.json"), kda_use_full_rank_gate=True)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    out: dict[str, torch.Tensor] = {}
    for k, t in raw.items():
        parts = k.split(".")
        if k.startswith("model.layers.") and parts[3] == "block_sparse_moe" and not cfg.is_moe_layer(int(parts[2])) \
                and parts[4] in ("gate_proj", "up_proj", "down_proj"):
            k = k.replace("block_sparse_moe.", "mlp.")
        if k.endswith("g_a_proj.weight"):
            continue
        if k.endswith("g_b_proj.weight"):
            out[k.replace("g_b_proj", "g_proj")] = t @ raw[k.replace("g_b_proj", "g_a_proj")]
            continue
        if k.endswith("A_log"):
            a = torch.zeros(max(cfg.kda_num_heads, cfg.kda_head_dim))
            a[: cfg.kda_num_heads] = t.flatten()
            t = a
        out[k] = t
    dst.mkdir(parents=True, exist_ok=True)
    names = sorted(out)
    weight_map = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        keys = names[i * len(names) // num_shards:(i + 1) * len(names) // num_shards]
        save_file({"language_model." + k: out[k].contiguous() for k in keys}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({"language_model." + k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (dst / "config.json").write_text(json.dumps(to_hf_wrapper_config(cfg), indent=2))
    return dst
