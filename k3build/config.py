"""The K3 text-model config: one typed, frozen object parsed from either checkpoint flavour.

Accepted inputs (K3_SPEC.md §1):
- the K3 wrapper (`model_type: kimi_k3`) whose `text_config` holds the language model;
- a plain Kimi-Linear config (`model_type: kimi_linear`), as transformers saves it;
- our own converted/engine `config.json`, which is the text config plus `mapping` and `quantization`.
Every mistake raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KDA, MLA = "kda", "mla"


class ConfigError(ValueError):
    """A config value is missing, unknown or inconsistent; the message names the field."""


@dataclass(frozen=True)
class QuantConfig:
    """Which weights are MXFP4 in the checkpoint (only routed experts for K3)."""

    method: str = "mxfp4"  # "mxfp4" | "none"
    group_size: int = 32
    scale_dtype: str = "e8m0"

    def __post_init__(self):
        if self.method not in ("mxfp4", "none"):
            raise ConfigError(f"quantization.method: expected 'mxfp4' or 'none', got {self.method!r}")
        if self.method == "mxfp4" and self.group_size != 32:
            raise ConfigError(f"quantization.group_size: MXFP4 uses blocks of 32, got {self.group_size}")


@dataclass(frozen=True)
class K3Config:
    """Every field of the K3 text config that the engine uses (K3_SPEC.md §1.2)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # dense MLP of the first_k_dense_replace layers
    layer_types: tuple[str, ...]  # "kda" | "mla" per layer, 0-based
    # MLA
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    # MoE
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    # options with K3's values as defaults
    hidden_act: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    mla_latent_norm_eps: float = 1e-6  # q_a/kv_a layernorms use the RMSNorm class default (PITFALLS.md)
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    kda_conv_size: int = 4
    kda_use_full_rank_gate: bool = True
    kda_gate_lower_bound: float | None = -5.0
    routed_expert_hidden_size: int | None = None  # latent MoE width; None = experts read the full hidden
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    router_activation: str = "sigmoid"
    topk_method: str = "noaux_tc"
    num_expert_group: int = 1
    topk_group: int = 1
    attn_res_block_size: int | None = None  # None = plain residual stream (Kimi-Linear)
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    tie_word_embeddings: bool = False
    quantization: QuantConfig = field(default_factory=lambda: QuantConfig("none"))

    def __post_init__(self):
        _check_types(self)
        _check_positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim",
                        "v_head_dim", "kda_num_heads", "kda_head_dim", "num_experts", "num_experts_per_token",
                        "moe_intermediate_size", "kda_conv_size")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types: {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in (KDA, MLA)]
        if bad:
            raise ConfigError(f"layer_types: unknown layer kind {bad[0]!r} (expected 'kda' or 'mla')")
        if self.hidden_act not in ("situ", "silu"):
            raise ConfigError(f"hidden_act: expected 'situ' or 'silu', got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads: {self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError("num_key_value_heads: MLA expands one latent to every head; expected num_key_value_heads == num_attention_heads")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank: expected a positive int or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim < 0:
            raise ConfigError(f"qk_rope_head_dim: expected >= 0, got {self.qk_rope_head_dim}")
        if not self.mla_use_nope:
            raise ConfigError("mla_use_nope: K3 and Kimi-Linear MLA have no RoPE; mla_use_nope=false is not supported")
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(f"num_experts_per_token: {self.num_experts_per_token} not in 1..num_experts={self.num_experts}")
        if self.num_expert_group != 1 or self.topk_group != 1:
            if self.num_experts % self.num_expert_group or self.topk_group > self.num_expert_group:
                raise ConfigError(f"num_expert_group/topk_group: {self.num_expert_group}/{self.topk_group} do not fit {self.num_experts} experts")
        if self.router_activation != "sigmoid":
            raise ConfigError(f"moe_router_activation_func: only 'sigmoid' is supported, got {self.router_activation!r}")
        if self.topk_method != "noaux_tc":
            raise ConfigError(f"topk_method: only 'noaux_tc' is supported, got {self.topk_method!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace: {self.first_k_dense_replace} not in 0..{self.num_hidden_layers}")
        if self.routed_scaling_factor <= 0:  # (_check_types refused NaN and Inf) it multiplies every expert's output
            raise ConfigError(f"routed_scaling_factor: expected a finite number > 0, "
                              f"got {self.routed_scaling_factor!r}")
        if self.moe_layer_freq < 1:
            raise ConfigError(f"moe_layer_freq: expected >= 1, got {self.moe_layer_freq}")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            raise ConfigError(f"attn_res_block_size: expected a positive int or null, got {self.attn_res_block_size}")
        if self.kda_gate_lower_bound is not None and self.kda_gate_lower_bound >= 0:
            raise ConfigError(f"linear_attn_config.gate_lower_bound: expected < 0, got {self.kda_gate_lower_bound}")
        if self.quantization.method == "mxfp4":
            for name, k in (("expert_hidden_size", self.expert_hidden_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                if k % 32:
                    raise ConfigError(f"{name}: MXFP4 experts need the input dim divisible by 32, got {k}")
        if self.hidden_act == "situ" and (self.situ_beta <= 0 or self.situ_linear_beta <= 0):
            raise ConfigError("activation_situ_beta / activation_situ_linear_beta: expected > 0")
        for name in ("rms_norm_eps", "mla_latent_norm_eps"):
            if not 0 < getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected a number in (0, 1), got {getattr(self, name)!r}")
        if self.max_position_embeddings < 2:
            raise ConfigError(f"max_position_embeddings: expected >= 2, got {self.max_position_embeddings}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}: {value} is outside the vocabulary 0..{self.vocab_size - 1}")

    # --- derived facts, one place ---
    @property
    def expert_hidden_size(self) -> int:
        """Input width of routed experts: the latent width for latent MoE, else the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: normed latent + shared k_pe (576 for K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def takes_snapshot(self, layer: int) -> bool:
        """AttnRes: layer ℓ pushes the running sum as a block snapshot before its mixer (K3_SPEC §2.1)."""
        return self.attn_res_block_size is not None and layer % self.attn_res_block_size == 0

    def snapshots_before(self, layer: int) -> int:
        """Block snapshots taken by layers < `layer` (the AttnRes candidates a layer starts with)."""
        return sum(self.takes_snapshot(i) for i in range(layer))

    # --- serialisation ---
    def to_dict(self) -> dict[str, Any]:
        """Our canonical JSON form (round-trips through `from_dict`)."""
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["quantization"] = dataclasses.asdict(self.quantization)
        return {"model_type": "k3", **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        """Parse any accepted flavour (see module doc)."""
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(d).__name__}")
        for where, section in (("", d), ("text_config.", d.get("text_config") or {})):
            for key in ("text_config", "linear_attn_config", "quantization_config"):
                if section.get(key) is not None and not isinstance(section[key], dict):
                    raise ConfigError(f"{where}{key}: expected an object, got {section[key]!r}")
        try:
            return cls._parse(d)
        except (TypeError, AttributeError) as e:  # a value of another kind inside a section, met while parsing it
            raise ConfigError(f"config: a field holds the wrong kind of value ({e})") from None

    @classmethod
    def _parse(cls, d: dict[str, Any]) -> "K3Config":
        model_type = d.get("model_type")
        if model_type == "kimi_k3":
            if "text_config" not in d:
                raise ConfigError("text_config: a kimi_k3 wrapper config must hold text_config")
            text = dict(d["text_config"])
            if "quantization_config" not in text and "quantization_config" in d:
                text["quantization_config"] = d["quantization_config"]
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # what transformers generates with
                if text.get(key) is None and d.get(key) is not None:
                    text[key] = d[key]
            return _from_hf(text)
        if model_type == "kimi_linear":
            return _from_hf(d)
        if model_type == "k3":
            return _from_canonical(d)
        raise ConfigError(f"model_type: expected 'kimi_k3', 'kimi_linear' or 'k3', got {model_type!r}")

    @classmethod
    def from_file(cls, path: str | Path) -> "K3Config":
        return cls.from_json(path, read_json(path))

    @classmethod
    def from_json(cls, path: str | Path, d: Any) -> "K3Config":
        """from_dict on config.json's parsed contents (read_json's), its errors naming the file."""
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


# what each annotation of K3Config admits (a bool is no int here, and an int is a float); others are checked apart
_ADMITS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _check_types(cfg) -> None:
    """ConfigError naming the first field whose value is not of its declared type (a string where a number goes,
    a null where one is required), before any check compares it."""
    for f in dataclasses.fields(cfg):
        kinds = [k.strip() for k in str(f.type).split("|")]
        value = getattr(cfg, f.name)
        if value is None and "None" in kinds:
            continue
        allowed = tuple(t for k in kinds for t in _ADMITS.get(k, ()))
        if not allowed and kinds != ["None"]:
            continue  # layer_types, quantization: checked where they are parsed
        if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)) or \
                (isinstance(value, float) and not math.isfinite(value)):
            want = " or ".join({"int": "an int", "float": "a finite number", "bool": "true or false", "str": "a string",
                                "None": "null"}[k] for k in kinds if k in _ADMITS or k == "None")
            raise ConfigError(f"{f.name}: expected {want}, got {value!r}")


def _check_positive(cfg, *names):
    """After _check_types: these int fields must be above 0."""
    for n in names:
        v = getattr(cfg, n)
        if v <= 0:
            raise ConfigError(f"{n}: expected a positive int, got {v!r}")


_CANONICAL_FIELDS = {f.name for f in dataclasses.fields(K3Config)}


def _from_canonical(d: dict[str, Any]) -> K3Config:
    kw = {k: v for k, v in d.items() if k in _CANONICAL_FIELDS}
    missing = [f.name for f in dataclasses.fields(K3Config)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kw]
    if missing:
        raise ConfigError(f"{missing[0]}: required field missing")
    kw["layer_types"] = tuple(kw["layer_types"])
    q = kw.get("quantization") or {}
    kw["quantization"] = QuantConfig(**q) if isinstance(q, dict) else q
    return K3Config(**kw)


def _require(d: dict, key: str, where: str = ""):
    if key not in d or d[key] is None and key != "q_lora_rank":
        raise ConfigError(f"{where}{key}: required field missing")
    return d[key]


def _layer_types_from_hf(d: dict, n_layers: int) -> tuple[str, ...]:
    lac = d.get("linear_attn_config") or {}
    full, kda = lac.get("full_attn_layers"), lac.get("kda_layers")
    if full is None and kda is None:
        if d.get("layer_types"):
            names = {"full_attention": MLA, "linear_attention": KDA}
            try:
                return tuple(names[t] for t in d["layer_types"])
            except KeyError as e:
                raise ConfigError(f"layer_types: unknown entry {e.args[0]!r}") from None
        raise ConfigError("linear_attn_config.full_attn_layers: required to know which layers are MLA")
    full = list(full or [])
    kda = list(kda) if kda is not None else [i for i in range(1, n_layers + 1) if i not in full]
    types: list[str | None] = [None] * n_layers
    for key, members, kind in (("full_attn_layers", full, MLA), ("kda_layers", kda, KDA)):
        for i in members:
            if not isinstance(i, int) or not 1 <= i <= n_layers:
                raise ConfigError(f"linear_attn_config.{key}: layer {i!r} outside 1..{n_layers} (lists are 1-based)")
            if types[i - 1] is not None:
                raise ConfigError(f"linear_attn_config.{key}: layer {i} is listed twice")
            types[i - 1] = kind
    unset = [i + 1 for i, t in enumerate(types) if t is None]
    if unset:
        raise ConfigError(f"linear_attn_config: layer {unset[0]} is in neither full_attn_layers nor kda_layers")
    return tuple(types)  # type: ignore[arg-type]


def _quant_from_hf(q: dict | None) -> QuantConfig:
    if not q:
        return QuantConfig("none")
    fmt = q.get("format") or q.get("quant_method")
    if fmt not in ("mxfp4-pack-quantized", "mxfp4"):
        raise ConfigError(f"quantization_config.format: only 'mxfp4-pack-quantized' is supported, got {fmt!r}")
    groups = q.get("config_groups") or {}
    gs = 32
    for g in groups.values():
        w = g.get("weights") or {}
        if w.get("num_bits", 4) != 4 or w.get("type", "float") != "float":
            raise ConfigError("quantization_config.config_groups.weights: expected 4-bit float (E2M1)")
        gs = w.get("group_size", 32)
    return QuantConfig("mxfp4", group_size=gs)


def _dense_layers_from_hf(d: dict, n_layers: int) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq); transformers may write only `mlp_layer_types` for them."""
    first, freq = d.get("first_k_dense_replace"), d.get("moe_layer_freq", 1)
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        return (1 if first is None else first), freq
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in ("dense", "sparse") for k in kinds):
        raise ConfigError(f"mlp_layer_types: expected {n_layers} entries of 'dense' or 'sparse', got {kinds!r}")
    k = kinds.index("sparse") if "sparse" in kinds else n_layers
    want = ["dense"] * k + ["sparse"] * (n_layers - k)
    if kinds != want or freq != 1:
        raise ConfigError(f"mlp_layer_types: only dense-first layouts (dense layers 0..k-1, then MoE) are supported, "
                          f"got {kinds}")
    if first is not None and first != k:
        raise ConfigError(f"first_k_dense_replace: {first} disagrees with mlp_layer_types ({k} dense layers first)")
    return k, freq


# Far above any real model; a bigger value is a typo, refused before lists of that length are built.
MAX_LAYERS, MAX_EXPERTS = 4096, 1 << 16


def _from_hf(d: dict[str, Any]) -> K3Config:
    n_layers = _require(d, "num_hidden_layers")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or not 0 < n_layers <= MAX_LAYERS:
        raise ConfigError(f"num_hidden_layers: expected an int in 1..{MAX_LAYERS}, got {n_layers!r}")
    n_exp = d.get("num_experts", d.get("num_local_experts"))
    if isinstance(n_exp, int) and n_exp > MAX_EXPERTS:
        raise ConfigError(f"num_experts: {n_exp} is above {MAX_EXPERTS}; expected the model's expert count")
    lac = d.get("linear_attn_config") or {}
    hidden_act = d.get("hidden_act", "silu")
    kda_heads = lac.get("num_heads", d.get("linear_num_heads"))
    kda_dim = lac.get("head_dim", d.get("linear_head_dim"))
    if kda_heads is None or kda_dim is None:
        raise ConfigError("linear_attn_config.num_heads/head_dim: required")
    for k in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_attention_heads", "hidden_size", "vocab_size",
              "intermediate_size", "moe_intermediate_size"):
        _require(d, k)
    if "q_lora_rank" not in d:
        raise ConfigError("q_lora_rank: required field missing (null means a plain q_proj)")
    num_experts = d.get("num_experts", d.get("num_local_experts"))
    top_k = d.get("num_experts_per_token", d.get("num_experts_per_tok"))
    if num_experts is None or top_k is None:
        raise ConfigError("num_experts / num_experts_per_token: required")
    lower = lac.get("gate_lower_bound")
    is_k3 = "attn_res_block_size" in d or "routed_expert_hidden_size" in d
    first_dense, moe_freq = _dense_layers_from_hf(d, n_layers)
    return K3Config(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_hidden_layers=n_layers,
        intermediate_size=d["intermediate_size"],
        layer_types=_layer_types_from_hf(d, n_layers),
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        q_lora_rank=d["q_lora_rank"],
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d.get("qk_rope_head_dim", 0),
        v_head_dim=d["v_head_dim"],
        kda_num_heads=kda_heads,
        kda_head_dim=kda_dim,
        num_experts=num_experts,
        num_experts_per_token=top_k,
        moe_intermediate_size=d["moe_intermediate_size"],
        num_shared_experts=d.get("num_shared_experts", d.get("n_shared_experts", 1)),
        hidden_act=hidden_act,
        situ_beta=d.get("activation_situ_beta", 4.0),
        situ_linear_beta=d.get("activation_situ_linear_beta", 25.0),
        rms_norm_eps=d.get("rms_norm_eps", 1e-5),
        mla_use_nope=d.get("mla_use_nope", True),
        mla_use_output_gate=d.get("mla_use_output_gate", False),
        kda_conv_size=lac.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4)),
        kda_use_full_rank_gate=lac.get("use_full_rank_gate", False),
        kda_gate_lower_bound=lower,
        routed_expert_hidden_size=d.get("routed_expert_hidden_size"),
        latent_moe_use_norm=d.get("latent_moe_use_norm", is_k3),
        first_k_dense_replace=first_dense,
        moe_layer_freq=moe_freq,
        moe_renormalize=d.get("moe_renormalize", d.get("norm_topk_prob", True)),
        routed_scaling_factor=d.get("routed_scaling_factor", 1.0),
        router_activation=d.get("moe_router_activation_func", "sigmoid"),
        topk_method=d.get("topk_method", "noaux_tc"),
        num_expert_group=d.get("num_expert_group", d.get("n_group", 1)) or 1,
        topk_group=d.get("topk_group", 1) or 1,
        attn_res_block_size=d.get("attn_res_block_size"),
        max_position_embeddings=d.get("max_position_embeddings", d.get("model_max_length", 1048576)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        quantization=_quant_from_hf(d.get("quantization_config")),
    )


def _k3_layer_types(n_layers: int, every: int = 4) -> tuple[str, ...]:
    """K3's pattern: every `every`-th layer (1-based) plus the last is MLA."""
    full = {i for i in range(every, n_layers + 1, every)} | {n_layers}
    return tuple(MLA if i + 1 in full else KDA for i in range(n_layers))


def preset(name: str) -> K3Config:
    """Named configs: `k3` (the published model) and small ones for tests."""
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]()


def _k3() -> K3Config:
    return K3Config(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, intermediate_size=33792,
        layer_types=_k3_layer_types(93), num_attention_heads=96, num_key_value_heads=96, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kda_num_heads=96,
        kda_head_dim=128, num_experts=896, num_experts_per_token=16, moe_intermediate_size=3072,
        num_shared_experts=2, routed_expert_hidden_size=3584, attn_res_block_size=12,
        quantization=QuantConfig("mxfp4"))


def _tiny() -> K3Config:
    # Every K3 feature at test size: dense layer 0, KDA+MLA with the last two MLA (0-based 3, 7, 8),
    # latent MoE, attn_res snapshots at 0,3,6, MXFP4 experts (K dims multiples of 32), heads divisible by 4 for TP4.
    return dataclasses.replace(
        _k3(), vocab_size=512, hidden_size=128, num_hidden_layers=9, intermediate_size=256,
        layer_types=_k3_layer_types(9), num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kda_num_heads=4,
        kda_head_dim=32, num_experts=16, num_experts_per_token=4, moe_intermediate_size=64,
        num_shared_experts=2, routed_expert_hidden_size=64, attn_res_block_size=3,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _small() -> K3Config:
    # A few GiB when synthesised: for convert/load benchmarks (real K3 widths, fewer layers/experts).
    return dataclasses.replace(
        _k3(), vocab_size=32768, num_hidden_layers=4, layer_types=_k3_layer_types(4), num_experts=64,
        intermediate_size=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)


PRESETS = {"k3": _k3, "tiny": _tiny, "small": _small}


def to_hf_text_config(cfg: K3Config) -> dict[str, Any]:
    """The K3 `text_config` (model_type kimi_linear) as the published checkpoint writes it."""
    full = [i + 1 for i, t in enumerate(cfg.layer_types) if t == MLA]
    d: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "bfloat16",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size, "hidden_act": cfg.hidden_act,
        "activation_situ_beta": cfg.situ_beta, "activation_situ_linear_beta": cfg.situ_linear_beta,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "mla_use_nope": cfg.mla_use_nope,
        "mla_use_output_gate": cfg.mla_use_output_gate, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_shared_experts": cfg.num_shared_experts, "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
        "latent_moe_use_norm": cfg.latent_moe_use_norm, "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq, "moe_router_activation_func": cfg.router_activation,
        "topk_method": cfg.topk_method, "use_grouped_topk": True, "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group, "moe_renormalize": cfg.moe_renormalize,
        "routed_scaling_factor": cfg.routed_scaling_factor, "attn_res_block_size": cfg.attn_res_block_size,
        "num_nextn_predict_layers": 0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "linear_attn_config": {
            "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim, "short_conv_kernel_size": cfg.kda_conv_size,
            "use_full_rank_gate": cfg.kda_use_full_rank_gate, "gate_lower_bound": cfg.kda_gate_lower_bound,
            "full_attn_layers": full, "kda_layers": [i for i in range(1, cfg.num_hidden_layers + 1) if i not in full],
        },
    }
    if cfg.quantization.method == "mxfp4":
        d["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                              "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                                          "symmetric": True, "dynamic": False, "observer": "minmax",
                                          "scale_dtype": "torch.uint8"},
                              "input_activations": None, "output_activations": None}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        }
    return d


def to_hf_wrapper_config(cfg: K3Config) -> dict[str, Any]:
    """The top-level K3 config.json (`kimi_k3` wrapper around the text config)."""
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": False, "text_config": to_hf_text_config(cfg),
    }


def read_json(path: str | Path) -> Any:
    """A config.json's parsed contents; ConfigError naming the file when it is missing or not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json there") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, expected a config.json") from None
    except UnicodeDecodeError as e:  # a binary file (a safetensors shard given for the checkpoint's config)
        raise ConfigError(f"{path}: not valid JSON (not UTF-8 text: {e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # no permission, an I/O error
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
