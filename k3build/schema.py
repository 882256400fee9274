"""The one list of tensors a checkpoint holds for a `K3Config`, and the map from source names to ours.

Flavours:
- "k3": the published K3 checkpoint (K3_SPEC.md §3) without its `language_model.` prefix. Dtypes fixed: BF16,
  except conv1d weights, A_log, dt_bias, o_norm and e_score_correction_bias (F32) and MXFP4 experts (U8; convert
  also takes F8_E8M0 block scales, the same bytes, and writes them as U8).
  A_log is [P] F32 with P = max(kda_head_dim, kda_num_heads); only the first kda_num_heads are valid.
- "kimi_linear": what `transformers.KimiLinearForCausalLM.save_pretrained` writes: dense layers under
  `block_sparse_moe.{gate,up,down}_proj`, A_log [1, 1, H, 1], no attn_res or latent tensors; any float dtype.
- "canonical": the names every module after the converter uses. K3's names, A_log [H] F32, dense layers under
  `mlp.`, and where the config says so: `self_attn.g_a_proj/g_b_proj` (low-rank KDA output gate),
  `self_attn.q_proj` (MLA without q_lora), no MLA `g_proj` (mla_use_output_gate false), experts as
  `experts.E.wN.weight` (unquantized) or `.weight_packed/.weight_scale` (MXFP4).
Float dtypes of a converted checkpoint follow its source; `canonical` lists K3's.
"""

from __future__ import annotations

import re

import torch

from .config import KDA, MLA, K3Config

BF16, F32, U8 = "BF16", "F32", "U8"
FLOAT = "float"  # any float dtype (Kimi-Linear flavour)
FLOAT_DTYPES = ("F32", "BF16", "F16")
FLAVOURS = ("k3", "kimi_linear", "canonical")
PREFIX = "language_model."
# Tensors a real checkpoint may carry that the text model does not use.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^(vision_tower|mm_projector|multi_modal_projector)\.")

Spec = tuple[tuple[int, ...], str]


class SchemaError(ValueError):
    """A config this schema cannot describe, or a tensor value the schema forbids; names the field/tensor."""


def dtype_matches(expected: str, actual: str) -> bool:
    return expected == actual or (expected == FLOAT and actual in FLOAT_DTYPES)


def checkpoint_tensors(cfg: K3Config, flavour: str = "k3") -> dict[str, Spec]:
    """name -> (shape, dtype) of every tensor a checkpoint of `flavour` holds for `cfg` (names unprefixed)."""
    if flavour not in FLAVOURS:
        raise SchemaError(f"flavour: expected one of {FLAVOURS}, got {flavour!r}")
    if cfg.tie_word_embeddings:
        raise SchemaError("tie_word_embeddings: tied embeddings are not supported (K3 and Kimi-Linear are untied)")
    if flavour == "kimi_linear":
        for field, on in (("attn_res_block_size", cfg.attn_res_block_size is not None),
                          ("routed_expert_hidden_size", cfg.is_latent_moe)):
            if on:
                raise SchemaError(f"{field}: set in the config, but Kimi-Linear checkpoints have no such tensors")
    out: dict[str, Spec] = {}
    fl = BF16 if flavour != "kimi_linear" else FLOAT
    f32 = F32 if flavour != "kimi_linear" else FLOAT
    d, v = cfg.hidden_size, cfg.vocab_size

    def add(name: str, shape, dtype: str = fl):
        out[name] = (tuple(int(s) for s in shape), dtype)

    add("model.embed_tokens.weight", (v, d))
    add("model.norm.weight", (d,))
    if cfg.attn_res_block_size is not None:
        add("model.output_attn_res_norm.weight", (d,))
        add("model.output_attn_res_proj.weight", (1, d))
    add("lm_head.weight", (v, d))
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", (d,))
        add(p + "post_attention_layernorm.weight", (d,))
        if cfg.attn_res_block_size is not None:
            for which in ("self_attention_res", "mlp_res"):
                add(p + f"{which}_norm.weight", (d,))
                add(p + f"{which}_proj.weight", (1, d))
        a = p + "self_attn."
        if kind == KDA:
            _kda(cfg, a, add, flavour, fl, f32)
        else:
            assert kind == MLA
            _mla(cfg, a, add)
        if cfg.is_moe_layer(i):
            _moe(cfg, p + "block_sparse_moe.", add, fl, f32)
        else:
            m = p + ("block_sparse_moe." if flavour == "kimi_linear" else "mlp.")
            add(m + "gate_proj.weight", (cfg.intermediate_size, d))
            add(m + "up_proj.weight", (cfg.intermediate_size, d))
            add(m + "down_proj.weight", (d, cfg.intermediate_size))
    return out


def _kda(cfg: K3Config, a: str, add, flavour: str, fl: str, f32: str) -> None:
    d, h, k = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    c = h * k
    for x in "qkv":
        add(a + f"{x}_proj.weight", (c, d))
    for x in "qkv":
        add(a + f"{x}_conv1d.weight", (c, 1, cfg.kda_conv_size), f32)
    add(a + "f_a_proj.weight", (k, d))
    add(a + "f_b_proj.weight", (c, k))
    add(a + "b_proj.weight", (h, d))
    a_log = {"k3": (a_log_padded_size(cfg),), "kimi_linear": (1, 1, h, 1), "canonical": (h,)}[flavour]
    add(a + "A_log", a_log, f32)
    add(a + "dt_bias", (c,), f32)
    if cfg.kda_use_full_rank_gate:
        add(a + "g_proj.weight", (c, d))
    else:
        add(a + "g_a_proj.weight", (k, d))
        add(a + "g_b_proj.weight", (c, k))
    add(a + "o_norm.weight", (k,), f32)
    add(a + "o_proj.weight", (d, c))


def _mla(cfg: K3Config, a: str, add) -> None:
    d, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is not None:
        add(a + "q_a_proj.weight", (cfg.q_lora_rank, d))
        add(a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
        add(a + "q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank))
    else:
        add(a + "q_proj.weight", (nh * cfg.qk_head_dim, d))
    add(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d))
    add(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,))
    add(a + "kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
    if cfg.mla_use_output_gate:
        add(a + "g_proj.weight", (nh * cfg.v_head_dim, d))
    add(a + "o_proj.weight", (d, nh * cfg.v_head_dim))


def _moe(cfg: K3Config, m: str, add, fl: str, f32: str) -> None:
    d, e, inter, dl = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_hidden_size
    add(m + "gate.weight", (e, d))
    add(m + "gate.e_score_correction_bias", (e,), f32)
    if cfg.is_latent_moe:
        add(m + "routed_expert_down_proj.weight", (dl, d))
        if cfg.latent_moe_use_norm:
            add(m + "routed_expert_norm.weight", (dl,))
        add(m + "routed_expert_up_proj.weight", (d, dl))
    if cfg.num_shared_experts:
        s = cfg.shared_intermediate_size
        add(m + "shared_experts.gate_proj.weight", (s, d))
        add(m + "shared_experts.up_proj.weight", (s, d))
        add(m + "shared_experts.down_proj.weight", (d, s))
    quantized = cfg.quantization.method == "mxfp4"
    for j in range(e):
        for w, (rows, cols) in (("w1", (inter, dl)), ("w2", (dl, inter)), ("w3", (inter, dl))):
            x = m + f"experts.{j}.{w}."
            if quantized:
                add(x + "weight_packed", (rows, cols // 2), U8)
                add(x + "weight_scale", (rows, cols // 32), U8)
            else:
                add(x + "weight", (rows, cols))


def a_log_padded_size(cfg: K3Config) -> int:
    return max(cfg.kda_head_dim, cfg.kda_num_heads)


_KL_DENSE = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
_DENSE = re.compile(r"^(model\.layers\.\d+\.)mlp\.((?:gate|up|down)_proj\.weight)$")


def strip_prefix(name: str) -> str:
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def to_canonical_name(name: str, flavour: str) -> str:
    """Source tensor name (prefix already stripped) -> canonical name."""
    if flavour == "kimi_linear":
        return _KL_DENSE.sub(r"\1mlp.\2", name)
    return name


def from_canonical_name(name: str, flavour: str) -> str:
    if flavour == "kimi_linear":
        return _DENSE.sub(r"\1block_sparse_moe.\2", name)
    return name


def to_canonical_tensor(canonical_name: str, t: torch.Tensor, cfg: K3Config, flavour: str,
                        where: str = "") -> torch.Tensor:
    """Reshape/de-pad a source tensor into its canonical form; only A_log changes (to [H]).

    Raises SchemaError when K3's padded A_log tail is non-zero; `where` (e.g. "file: tensor name") leads the
    message, else the canonical name does.
    """
    if not canonical_name.endswith(".self_attn.A_log"):
        return t
    h = cfg.kda_num_heads
    if flavour == "kimi_linear":
        return t.reshape(h)
    tail = t[h:]
    if bool((tail != 0).any()):
        j = int((tail != 0).nonzero()[0, 0]) + h
        raise SchemaError(f"{where or canonical_name}: A_log padding must be zero after the first {h} heads "
                          f"(shape [{t.shape[0]}]), got {float(t[j])!r} at index {j}")
    return t[:h].clone()


def detect_flavour(names: set[str], cfg: K3Config) -> str:
    """The flavour whose tensor list shares the most names with `names` (K3 wins ties)."""
    best, best_hits = "k3", -1
    for flavour in ("k3", "kimi_linear"):
        try:
            expected = checkpoint_tensors(cfg, flavour)
        except SchemaError:
            continue
        hits = len(names & expected.keys())
        if hits > best_hits:
            best, best_hits = flavour, hits
    return best
