"""Who owns what across ranks (in the spirit of TensorRT-LLM's `Mapping`).

Rank layout: rank = pp_rank * tp_size + tp_rank. Inside a PP stage the tp_size ranks split attention heads
(unless attention-DP, where each rank holds all heads and serves its own requests), the dense/shared MLPs, the
latent MoE's up-projection (row-parallel: its partial sums join the shared experts' all-reduce) and the
vocabulary; routed experts are split by moe_ep_size (contiguous blocks) x moe_tp_size (intermediate dim),
with moe_ep_size * moe_tp_size == tp_size. Nothing else in the project recomputes these answers.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from .config import ConfigError, K3Config


class MappingError(ValueError):
    """A parallel mapping that does not divide the model or itself; the message names the field."""


@dataclass(frozen=True)
class Shard:
    """Part `index` of `parts` equal pieces along `dim` (dim None = the whole tensor)."""

    dim: int | None = None
    parts: int = 1
    index: int = 0

    def bounds(self, size: int) -> tuple[int, int]:
        step = size // self.parts
        return self.index * step, (self.index + 1) * step


WHOLE = Shard()

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")


def moe_tp_from_flags(tp: int | None, ep: int | None) -> int:
    """The experts' TP split that plan's and convert's flags leave unsaid: tp / ep given both (an ep that does not
    divide tp is named by its flags), else 1."""
    if tp is not None and ep is not None:
        if tp % ep:
            raise MappingError(f"--ep-size {ep} does not divide --tp-size {tp}")
        return tp // ep
    return 1


@dataclass(frozen=True)
class Mapping:
    tp_size: int = 1
    pp_size: int = 1
    moe_tp_size: int = 1
    moe_ep_size: int | None = None  # default: tp_size / moe_tp_size
    attention_dp: bool = False

    def __post_init__(self):
        for name in ("tp_size", "pp_size", "moe_tp_size", "moe_ep_size"):
            v = getattr(self, name)
            if (v is not None or name != "moe_ep_size") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise MappingError(f"mapping.{name}: expected a positive int, got {v!r}")
        if not isinstance(self.attention_dp, bool):
            raise MappingError(f"mapping.attention_dp: expected true or false, got {self.attention_dp!r}")
        if self.moe_ep_size is None:
            if self.tp_size % self.moe_tp_size:
                raise MappingError(f"mapping.moe_tp_size: {self.moe_tp_size} does not divide tp_size={self.tp_size}")
            object.__setattr__(self, "moe_ep_size", self.tp_size // self.moe_tp_size)
        if self.moe_ep_size * self.moe_tp_size != self.tp_size:
            raise MappingError(f"mapping: moe_ep_size ({self.moe_ep_size}) x moe_tp_size ({self.moe_tp_size}) "
                               f"must equal tp_size ({self.tp_size})")
        if self.attention_dp and self.moe_tp_size != 1:
            raise MappingError("mapping.moe_tp_size: MoE tensor parallelism needs attention-DP off (experts are EP-only under attention-DP)")
        if self.attention_dp and self.tp_size > 1 and self.pp_size > 1:
            # the runtime schedules attention-DP ranks each on their own, which pipeline stages cannot follow:
            # refused here, before a convert and a build it could not load
            raise MappingError(f"mapping: attention-DP with pipeline parallelism (pp_size={self.pp_size}) is not "
                               "supported by k3runtime; use pp_size 1, or attention TP")

    # --- ranks ---
    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def moe_ep_rank(self, rank: int) -> int:
        return self.tp_rank(rank) // self.moe_tp_size

    def moe_tp_rank(self, rank: int) -> int:
        return self.tp_rank(rank) % self.moe_tp_size

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split attention heads (1 under attention-DP: heads are replicated)."""
        return 1 if self.attention_dp else self.tp_size

    def attn_tp_rank(self, rank: int) -> int:
        return 0 if self.attention_dp else self.tp_rank(rank)

    @property
    def dense_tp_size(self) -> int:
        """Ranks that split dense/shared MLPs and the vocabulary (replicated under attention-DP)."""
        return self.attn_tp_size

    def dense_tp_rank(self, rank: int) -> int:
        """This rank's slice of the dense/shared MLPs, the latent MoE's up-projection and the vocabulary."""
        return self.attn_tp_rank(rank)

    def tp_group(self, rank: int) -> list[int]:
        base = self.pp_rank(rank) * self.tp_size
        return list(range(base, base + self.tp_size))

    def pp_group(self, rank: int) -> list[int]:
        return [p * self.tp_size + self.tp_rank(rank) for p in range(self.pp_size)]

    # --- model pieces ---
    def stage_layers(self, pp_rank: int, num_layers: int) -> range:
        """Contiguous layers of a PP stage; the first `num_layers % pp_size` stages take one extra."""
        base, extra = divmod(num_layers, self.pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (1 if pp_rank < extra else 0))

    def rank_layers(self, rank: int, num_layers: int) -> range:
        return self.stage_layers(self.pp_rank(rank), num_layers)

    def is_first_stage(self, rank: int) -> bool:
        return self.pp_rank(rank) == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.pp_rank(rank) == self.pp_size - 1

    def local_experts(self, rank: int, num_experts: int) -> range:
        per = num_experts // self.moe_ep_size
        start = self.moe_ep_rank(rank) * per
        return range(start, start + per)

    def validate(self, cfg: K3Config) -> None:
        """Raise MappingError naming what does not divide."""
        checks = [
            ("num_attention_heads (MLA)", cfg.num_attention_heads, self.attn_tp_size, "attention TP"),
            ("linear_attn_config.num_heads (KDA)", cfg.kda_num_heads, self.attn_tp_size, "attention TP"),
            ("num_experts", cfg.num_experts, self.moe_ep_size, "moe_ep_size"),
            ("moe_intermediate_size", cfg.moe_intermediate_size, self.moe_tp_size, "moe_tp_size"),
            ("shared experts width", cfg.shared_intermediate_size, self.dense_tp_size, "TP"),
            ("intermediate_size (dense MLP)", cfg.intermediate_size, self.dense_tp_size, "TP"),
            ("vocab_size", cfg.vocab_size, self.dense_tp_size, "TP"),
        ]
        if cfg.is_latent_moe:
            checks.append(("routed_expert_hidden_size (latent MoE)", cfg.expert_hidden_size, self.dense_tp_size, "TP"))
        for what, n, d, by in checks:
            if n % d:
                raise MappingError(f"{what}={n} is not divisible by {by}={d}")
        if cfg.quantization.method == "mxfp4" and (cfg.moe_intermediate_size // self.moe_tp_size) % 32:
            raise MappingError(f"moe_intermediate_size / moe_tp_size = {cfg.moe_intermediate_size // self.moe_tp_size} "
                               "must stay a multiple of 32 (MXFP4 scale blocks)")
        if cfg.num_hidden_layers < self.pp_size:
            raise MappingError(f"pp_size={self.pp_size} exceeds num_hidden_layers={cfg.num_hidden_layers}")

    def shard(self, name: str, rank: int, cfg: K3Config) -> Shard | None:
        """Which part of canonical tensor `name` lives on `rank` (None: not on this rank).

        Canonical names are K3's (without the `language_model.` prefix); see k3build/schema.py.
        """
        if name == "model.embed_tokens.weight":
            return self._dense(0, rank) if self.is_first_stage(rank) else None
        if name == "lm_head.weight":
            return self._dense(0, rank) if self.is_last_stage(rank) else None
        if name.startswith("model.") and not name.startswith("model.layers."):
            return WHOLE if self.is_last_stage(rank) else None  # final norm, output attn_res
        m = _LAYER.match(name)
        if not m:
            raise ConfigError(f"{name}: not a K3 tensor name")
        layer, rest = int(m.group(1)), m.group(2)
        if layer not in self.rank_layers(rank, cfg.num_hidden_layers):
            return None
        e = _EXPERT.match(rest)
        if e:
            expert, which = int(e.group(1)), e.group(2)
            if expert not in self.local_experts(rank, cfg.num_experts):
                return None
            # w1/w3 split their output rows, w2 its input columns (packed bytes and scales alike).
            return Shard(0 if which != "w2" else 1, self.moe_tp_size, self.moe_tp_rank(rank))
        return self._layer_rule(rest, rank)

    def _dense(self, dim: int, rank: int) -> Shard:
        return Shard(dim, self.dense_tp_size, self.dense_tp_rank(rank))

    def _attn(self, dim: int, rank: int) -> Shard:
        return Shard(dim, self.attn_tp_size, self.attn_tp_rank(rank))

    def _layer_rule(self, rest: str, rank: int) -> Shard:
        attn_rows = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                     "v_conv1d.weight", "f_b_proj.weight", "b_proj.weight", "A_log", "dt_bias", "g_proj.weight",
                     "g_b_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")
        if rest.startswith("self_attn."):
            leaf = rest[len("self_attn."):]
            if leaf in attn_rows:
                return self._attn(0, rank)
            if leaf == "o_proj.weight":
                return self._attn(1, rank)
            return WHOLE  # f_a, g_a, o_norm, q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm
        if rest == "block_sparse_moe.routed_expert_up_proj.weight":
            # row-parallel like the shared experts' down_proj: each rank multiplies its slice of the (replicated)
            # latent by its columns, and the shared experts' all-reduce sums both (a 1/TP of its bytes a rank)
            return self._dense(1, rank)
        for prefix in ("mlp.", "block_sparse_moe.shared_experts."):
            if rest.startswith(prefix):
                leaf = rest[len(prefix):]
                return self._dense(1 if leaf == "down_proj.weight" else 0, rank)
        return WHOLE  # norms, attn_res params, router, latent down-projection

    # --- serialisation ---
    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Mapping":
        known = {"tp_size", "pp_size", "moe_tp_size", "moe_ep_size", "attention_dp"}
        unknown = set(d) - known - {"world_size"}
        if unknown:
            raise MappingError(f"mapping.{sorted(unknown)[0]}: unknown field")
        m = cls(**{k: v for k, v in d.items() if k in known})
        if "world_size" in d and d["world_size"] != m.world_size:
            raise MappingError(f"mapping.world_size: {d['world_size']} but tp_size x pp_size = {m.world_size}")
        return m
