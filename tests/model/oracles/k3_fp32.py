"""An independent, plain fp32 forward of K3 (and Kimi-Linear) written from K3_SPEC.md §2-3.

Deliberately unlike the engine: no cache, MLA in the non-absorbed form (K/V expanded from the latent per head),
KDA as the per-token delta-rule recurrence, experts dequantised by a local MXFP4 decoder, one token loop where the
spec is a loop. Reads tensors by their checkpoint names: K3 naming (optional `language_model.` prefix, sharded with
model.safetensors.index.json) or the naming transformers writes for Kimi-Linear. Only `K3Config` is shared with
the project (config parsing). Slow, fine for tiny models.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from k3build.config import K3Config

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


class CheckpointError(ValueError):
    """A tensor is missing or has the wrong shape; the message names it."""


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """K3_SPEC §3: packed u8 [N, K/2] (low nibble = even k), scale u8 [N, K/32] E8M0 -> [N, K] (exact in fp32)."""
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)  # [N, K]
    mag = _E2M1.to(dtype)[codes & 0x7]
    val = torch.where((codes & 0x8) != 0, -mag, mag)
    exp = torch.exp2(scale.to(dtype) - 127.0)  # [N, K/32]
    return val * exp.repeat_interleave(32, dim=1)


class Checkpoint:
    """All tensors of a checkpoint dir as `dtype` (MXFP4 experts dequantised), looked up by model-relative name."""

    def __init__(self, ckpt_dir: str | Path, dtype: torch.dtype = torch.float32):
        self.dir, self.dtype = Path(ckpt_dir), dtype
        self.cfg = K3Config.from_file(self.dir / "config.json")
        index = self.dir / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
            sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files")
        self.raw: dict[str, torch.Tensor] = {}
        self._fp32: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(self.dir / f), framework="pt") as h:
                for k in h.keys():
                    self.raw[k.removeprefix("language_model.")] = h.get_tensor(k)

    def replaced(self, *, cfg: K3Config | None = None, tensors: dict[str, torch.Tensor] | None = None) -> "Checkpoint":
        """A copy with some config fields or tensors swapped (for "does feature X change the logits" tests)."""
        new = copy.copy(self)
        new.cfg = cfg or self.cfg
        tensors = tensors or {}
        new.raw = {**self.raw, **tensors}
        stale = {k.removesuffix(".weight_packed").removesuffix(".weight_scale") for k in tensors} | set(tensors)
        new._fp32 = {k: v for k, v in self._fp32.items() if k not in stale}
        return new

    def has(self, name: str) -> bool:
        return name in self.raw

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._fp32:
            if name not in self.raw:
                raise CheckpointError(f"{self.dir}: tensor {name!r} not found")
            self._fp32[name] = self.raw[name].to(self.dtype)
        t = self._fp32[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.dir}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t

    def expert(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        """A routed-expert matrix: `name.weight` (plain) or `name.weight_packed` + `name.weight_scale` (MXFP4)."""
        if name + ".weight" in self.raw:
            return self.get(name + ".weight", shape)
        if name + ".weight_packed" not in self.raw:
            raise CheckpointError(f"{self.dir}: expert tensor {name}.weight or {name}.weight_packed not found")
        if name not in self._fp32:
            packed, scale = self.raw[name + ".weight_packed"], self.raw[name + ".weight_scale"]
            if tuple(packed.shape) != (shape[0], shape[1] // 2) or tuple(scale.shape) != (shape[0], shape[1] // 32):
                raise CheckpointError(f"{self.dir}: {name} packed {tuple(packed.shape)} / scale {tuple(scale.shape)} "
                                      f"do not encode a {shape} MXFP4 matrix")
            self._fp32[name] = mxfp4_dequant(packed, scale, self.dtype)
        return self._fp32[name]


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def act_mul(cfg: K3Config, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """GLU activation: SiTU (§2.5) or SiLU."""
    if cfg.hidden_act == "silu":
        return g * torch.sigmoid(g) * u
    b, bl = cfg.situ_beta, cfg.situ_linear_beta
    return b * torch.tanh(g / b) * torch.sigmoid(g) * (bl * torch.tanh(u / bl))


def attn_res(p: torch.Tensor, blocks: list[torch.Tensor], proj: torch.Tensor, norm_w: torch.Tensor, eps: float):
    """§2.1 AttnRes: per-token softmax over depth candidates [B_0..B_{K-1}, p]. p [T, H], proj [1, H]."""
    cands = torch.stack(blocks + [p])  # [K+1, T, H]
    keys = rms_norm(cands, None, eps)
    scores = (keys * (norm_w * proj[0])).sum(-1)  # [K+1, T]
    probs = torch.softmax(scores, dim=0)
    return (probs[..., None] * cands).sum(0)


def kda(ck: Checkpoint, pre: str, x: torch.Tensor) -> torch.Tensor:
    """§2.2 KDA over a whole sequence from a zero state. x [T, hidden] -> [T, hidden]."""
    cfg = ck.cfg
    T, H, K, W = x.shape[0], cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    D = H * K

    def conv_silu(name):
        y = x @ ck.get(pre + f"{name}_proj.weight", (D, cfg.hidden_size)).T  # [T, D]
        w = ck.get(pre + f"{name}_conv1d.weight", (D, 1, W))[:, 0]  # [D, W]
        padded = torch.cat([y.new_zeros(W - 1, D), y])
        out = sum(w[:, i] * padded[i:i + T] for i in range(W))
        return F.silu(out).view(T, H, K)

    q, k, v = conv_silu("q"), conv_silu("k"), conv_silu("v")
    # FLA l2norm convention: x / sqrt(sum x^2 + 1e-6)
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    raw = x @ ck.get(pre + "f_a_proj.weight").T @ ck.get(pre + "f_b_proj.weight", (D, K)).T
    a_log = ck.get(pre + "A_log").flatten()
    if a_log.numel() < H or (a_log.numel() > H and bool(a_log[H:].any())):
        raise CheckpointError(f"{ck.dir}: {pre}A_log has {a_log.numel()} values with a nonzero tail past {H} heads")
    decay = torch.exp(a_log[:H])[:, None]  # [H, 1]
    z = (raw + ck.get(pre + "dt_bias", (D,))).view(T, H, K)
    if cfg.kda_gate_lower_bound is not None:
        g = cfg.kda_gate_lower_bound * torch.sigmoid(decay * z)
    else:
        g = -decay * F.softplus(z)
    beta = torch.sigmoid(x @ ck.get(pre + "b_proj.weight", (H, cfg.hidden_size)).T)  # [T, H]
    S = x.new_zeros(H, K, K)  # [H, K, V]
    o = x.new_empty(T, H, K)
    for t in range(T):
        S = S * torch.exp(g[t])[:, :, None]
        u = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
        S = S + beta[t][:, None, None] * k[t][:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])
    if cfg.kda_use_full_rank_gate:
        gate = x @ ck.get(pre + "g_proj.weight", (D, cfg.hidden_size)).T
    else:
        gate = x @ ck.get(pre + "g_a_proj.weight").T @ ck.get(pre + "g_b_proj.weight").T
    o = rms_norm(o, ck.get(pre + "o_norm.weight", (K,)), cfg.rms_norm_eps) * torch.sigmoid(gate.view(T, H, K))
    return o.reshape(T, D) @ ck.get(pre + "o_proj.weight", (cfg.hidden_size, D)).T


def mla(ck: Checkpoint, pre: str, x: torch.Tensor) -> torch.Tensor:
    """§2.3 MLA, NoPE, non-absorbed: per-head K/V expanded from the normed latent. x [T, hidden]."""
    cfg = ck.cfg
    T, nh, dn, dr, dv = x.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    eps = cfg.mla_latent_norm_eps
    if cfg.q_lora_rank:
        qa = rms_norm(x @ ck.get(pre + "q_a_proj.weight").T, ck.get(pre + "q_a_layernorm.weight"), eps)
        q = qa @ ck.get(pre + "q_b_proj.weight", (nh * (dn + dr), cfg.q_lora_rank)).T
    else:
        q = x @ ck.get(pre + "q_proj.weight", (nh * (dn + dr), cfg.hidden_size)).T
    q = q.view(T, nh, dn + dr)
    c = x @ ck.get(pre + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + dr, cfg.hidden_size)).T
    latent = rms_norm(c[:, :cfg.kv_lora_rank], ck.get(pre + "kv_a_layernorm.weight"), eps)
    k_pe = c[:, cfg.kv_lora_rank:]  # [T, dr], shared by all heads, never rotated
    kv = (latent @ ck.get(pre + "kv_b_proj.weight", (nh * (dn + dv), cfg.kv_lora_rank)).T).view(T, nh, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe[:, None, :].expand(T, nh, dr)], dim=-1)  # [T, nh, dn+dr]
    val = kv[..., dn:]  # [T, nh, dv]
    scores = torch.einsum("thd,shd->hts", q, k) * (dn + dr) ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out = torch.einsum("hts,shd->thd", probs, val).reshape(T, nh * dv)
    if cfg.mla_use_output_gate:
        out = out * torch.sigmoid(x @ ck.get(pre + "g_proj.weight", (nh * dv, cfg.hidden_size)).T)
    return out @ ck.get(pre + "o_proj.weight", (cfg.hidden_size, nh * dv)).T


def glu_mlp(ck: Checkpoint, pre: str, x: torch.Tensor) -> torch.Tensor:
    g = x @ ck.get(pre + "gate_proj.weight").T
    u = x @ ck.get(pre + "up_proj.weight").T
    return act_mul(ck.cfg, g, u) @ ck.get(pre + "down_proj.weight").T


def route(cfg: K3Config, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """§2.4 router on fp32 logits [T, E]: (expert ids [T, k], weights [T, k])."""
    s = torch.sigmoid(logits)
    choice = s + bias
    if cfg.num_expert_group > 1:
        T, G = choice.shape[0], cfg.num_expert_group
        grouped = choice.view(T, G, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros(T, G, dtype=torch.bool).scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    idx = choice.topk(cfg.num_experts_per_token, dim=-1).indices
    w = s.gather(1, idx)
    if cfg.moe_renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


def moe(ck: Checkpoint, pre: str, x: torch.Tensor, trace: dict | None, layer: int) -> torch.Tensor:
    """§2.4 (latent) MoE with shared experts. x [T, hidden]."""
    cfg = ck.cfg
    bias = ck.get(pre + "gate.e_score_correction_bias", (cfg.num_experts,))
    idx, w = route(cfg, x @ ck.get(pre + "gate.weight", (cfg.num_experts, cfg.hidden_size)).T, bias)
    if trace is not None:
        trace.setdefault("experts", {})[layer] = idx.clone()
        trace.setdefault("experts_unbiased", {})[layer] = route(cfg, x @ ck.get(pre + "gate.weight").T, 0 * bias)[0]
    z = x @ ck.get(pre + "routed_expert_down_proj.weight").T if cfg.is_latent_moe else x
    comb = z.new_zeros(z.shape[0], cfg.num_experts).scatter_(1, idx, w)  # [T, E], zero where not routed
    y = torch.zeros_like(z)
    for e in idx.unique().tolist():
        ep, inter, lat = pre + f"experts.{e}.", cfg.moe_intermediate_size, cfg.expert_hidden_size
        w1, w3, w2 = ck.expert(ep + "w1", (inter, lat)), ck.expert(ep + "w3", (inter, lat)), ck.expert(ep + "w2", (lat, inter))
        y = y + comb[:, e, None] * (act_mul(cfg, z @ w1.T, z @ w3.T) @ w2.T)
    if cfg.is_latent_moe:
        if cfg.latent_moe_use_norm:
            y = rms_norm(y, ck.get(pre + "routed_expert_norm.weight"), cfg.rms_norm_eps)
        y = y @ ck.get(pre + "routed_expert_up_proj.weight").T
    if cfg.num_shared_experts:
        y = y + glu_mlp(ck, pre + "shared_experts.", x)
    return y


def forward(ck: Checkpoint, token_ids: list[int], trace: dict | None = None) -> torch.Tensor:
    """Whole-model logits [T, vocab] fp32 (§2.1 skeleton; plain residual stream when attn_res is off)."""
    cfg = ck.cfg
    if not token_ids or min(token_ids) < 0 or max(token_ids) >= cfg.vocab_size:
        raise ValueError(f"token_ids: expected a non-empty list of ids in 0..{cfg.vocab_size - 1}")
    eps = cfg.rms_norm_eps
    use_res = cfg.attn_res_block_size is not None
    p: torch.Tensor | None = ck.get("model.embed_tokens.weight")[torch.tensor(token_ids)]
    blocks: list[torch.Tensor] = []
    for layer, kind in enumerate(cfg.layer_types):
        pre = f"model.layers.{layer}."
        assert p is not None
        h = attn_res(p, blocks, ck.get(pre + "self_attention_res_proj.weight"), ck.get(pre + "self_attention_res_norm.weight"), eps) \
            if use_res and blocks else p
        if cfg.takes_snapshot(layer):
            blocks.append(p)
            p = None  # reset: this block's running sum starts empty
        mixer = kda if kind == "kda" else mla
        a = mixer(ck, pre + "self_attn.", rms_norm(h, ck.get(pre + "input_layernorm.weight"), eps))
        p = a if p is None else p + a
        h = attn_res(p, blocks, ck.get(pre + "mlp_res_proj.weight"), ck.get(pre + "mlp_res_norm.weight"), eps) if use_res else p
        x = rms_norm(h, ck.get(pre + "post_attention_layernorm.weight"), eps)
        if cfg.is_moe_layer(layer):
            f = moe(ck, pre + "block_sparse_moe.", x, trace, layer)
        else:
            dense = pre + "mlp." if ck.has(pre + "mlp.gate_proj.weight") else pre + "block_sparse_moe."
            f = glu_mlp(ck, dense, x)
        p = p + f
    assert p is not None
    h = attn_res(p, blocks, ck.get("model.output_attn_res_proj.weight"), ck.get("model.output_attn_res_norm.weight"), eps) \
        if use_res else p
    h = rms_norm(h, ck.get("model.norm.weight"), eps)
    head = ck.get("lm_head.weight") if ck.has("lm_head.weight") or not cfg.tie_word_embeddings else ck.get("model.embed_tokens.weight")
    return h @ head.T


_loaded: dict[tuple, Checkpoint] = {}


def load(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """A cached `Checkpoint` (reloaded when any file in the dir changed); keeps the last two loaded."""
    d = Path(ckpt_dir)
    files = tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in d.iterdir() if p.is_file()))
    key = (str(d.resolve()), files, dtype)
    if key not in _loaded:
        while len(_loaded) >= 2:
            _loaded.pop(next(iter(_loaded)))
        _loaded[key] = Checkpoint(d, dtype)
    return _loaded[key]


@torch.no_grad()
def k3_logits(ckpt_dir: str | Path, token_ids: list[int], *, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Logits [T, vocab] of the whole sequence, no cache; fp32 (float64 gives a rounding-free yardstick).

    Returns:
        np.ndarray [T, vocab] of `dtype`.
    """
    return forward(load(ckpt_dir, dtype), list(token_ids)).numpy()


@torch.no_grad()
def k3_greedy(ckpt_dir: str | Path, token_ids: list[int], n: int, *, dtype: torch.dtype = torch.float32) -> list[int]:
    """`n` greedy tokens by full recompute each step (never stops at EOS)."""
    ck, seq, out = load(ckpt_dir, dtype), list(token_ids), []
    for _ in range(n):
        nxt = int(forward(ck, seq)[-1].argmax())
        out.append(nxt)
        seq.append(nxt)
    return out
