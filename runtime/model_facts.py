"""What the runtime knows of the model beside its graph: the facts it sizes caches and buffers by, read from an
engine's pretrained_config, and how a mapping splits the attention heads."""

from __future__ import annotations

from dataclasses import dataclass

KDA, MLA = "kda", "mla"  # the layer kinds that hold a cache (pretrained_config's layer_types)


@dataclass(frozen=True)
class ModelFacts:
    """What the runtime needs to know of the model (read from the engine's pretrained_config)."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_size: int
    mla_cache_width: int
    eos_token_id: int | None
    bos_token_id: int | None
    max_position_embeddings: int

    @classmethod
    def from_pretrained_config(cls, d: dict) -> "ModelFacts":
        return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], layer_types=tuple(d["layer_types"]),
                   kda_num_heads=d["kda_num_heads"], kda_head_dim=d["kda_head_dim"], kda_conv_size=d["kda_conv_size"],
                   mla_cache_width=d["kv_lora_rank"] + d["qk_rope_head_dim"], eos_token_id=d.get("eos_token_id"),
                   bos_token_id=d.get("bos_token_id"), max_position_embeddings=d["max_position_embeddings"])


def dense_tp(mapping: dict) -> int:
    """Ranks a layer's attention heads (and the vocabulary rows) are split over: tp_size, or 1 under attention-DP,
    whose ranks each hold them whole."""
    return 1 if mapping["attention_dp"] else mapping["tp_size"]
