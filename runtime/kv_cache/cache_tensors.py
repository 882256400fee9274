"""Device tensors of one rank's cache: paged MLA latents and the KDA state slot pool.

Each kind is one tensor with a leading layer axis, so zeroing a slot or swapping a request touches
every layer in one indexed copy; `mla_kv[i]`, `kda_state[i]`, `kda_conv[i]` are per-layer views.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..model_facts import KDA, MLA, ModelFacts, dense_tp
from ..upload import to_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class CacheConfig:
    """Cache geometry of one rank (local layers and heads after sharding).

    Args:
        num_pages / page_size: MLA pages and tokens per page.
        num_slots: KDA state slots (one per live request).
        num_mla_layers / mla_width: local MLA layers and cached values per token (kv_lora_rank + rope dim; 576 for K3).
        num_kda_layers / kda_num_heads / kda_head_k_dim / kda_head_v_dim: local KDA layers and per-rank heads.
        kda_conv_dim / kda_conv_size: conv channels (q|k|v sections, 3 * local H * D) and kernel width W.
        kv_dtype / state_dtype / conv_dtype: "fp32" | "bf16" | "fp16"; state_dtype is fp32 or bf16.
    """

    num_pages: int
    num_slots: int
    num_mla_layers: int
    mla_width: int
    num_kda_layers: int
    kda_num_heads: int
    kda_head_k_dim: int
    kda_head_v_dim: int
    kda_conv_dim: int
    page_size: int = 64
    kda_conv_size: int = 4
    kv_dtype: str = "bf16"
    state_dtype: str = "fp32"
    conv_dtype: str = "bf16"

    def __post_init__(self):
        for name in ("num_pages", "num_slots", "num_mla_layers", "num_kda_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {getattr(self, name)!r}")
        for name in ("page_size", "mla_width", "kda_num_heads", "kda_head_k_dim", "kda_head_v_dim", "kda_conv_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected an int > 0, got {getattr(self, name)!r}")
        if not isinstance(self.kda_conv_size, int) or self.kda_conv_size < 2:
            raise ValueError(f"kda_conv_size: expected an int >= 2, got {self.kda_conv_size!r}")
        for name in ("kv_dtype", "conv_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}: expected one of {tuple(DTYPES)}, got {getattr(self, name)!r}")
        if self.state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"state_dtype: expected 'fp32' or 'bf16', got {self.state_dtype!r}")

    @classmethod
    def for_rank(cls, config: dict, rank: int, *, num_pages: int, num_slots: int) -> "CacheConfig":
        """The cache of `rank` of the engine whose config.json is `config`: its own layers' (pipeline stages hold
        different ones) and its share of the KDA heads. Reads no weights."""
        facts = ModelFacts.from_pretrained_config(config["pretrained_config"])
        build, mapping = config["build_config"], config["mapping"]
        start, stop = config["ranks"][str(rank)]["layers"]
        kinds = facts.layer_types[start:stop]
        heads = facts.kda_num_heads // dense_tp(mapping)
        return cls(num_pages=num_pages, num_slots=num_slots, num_mla_layers=kinds.count(MLA),
                   mla_width=facts.mla_cache_width, num_kda_layers=kinds.count(KDA), kda_num_heads=heads,
                   kda_head_k_dim=facts.kda_head_dim, kda_head_v_dim=facts.kda_head_dim,
                   kda_conv_dim=3 * heads * facts.kda_head_dim, page_size=build["page_size"],
                   kda_conv_size=facts.kda_conv_size, kv_dtype=build["kv_dtype"], state_dtype=build["state_dtype"],
                   conv_dtype=build["dtype"])

    @property
    def bytes_per_page(self) -> int:
        """MLA bytes one page takes over all local MLA layers."""
        return self.num_mla_layers * self.page_size * self.mla_width * DTYPES[self.kv_dtype].itemsize

    @property
    def bytes_per_slot(self) -> int:
        """KDA recurrent + conv bytes one slot takes over all local KDA layers."""
        h, k, v = self.kda_num_heads, self.kda_head_k_dim, self.kda_head_v_dim
        state = h * v * k * DTYPES[self.state_dtype].itemsize
        conv = self.kda_conv_dim * (self.kda_conv_size - 1) * DTYPES[self.conv_dtype].itemsize
        return self.num_kda_layers * (state + conv)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.num_slots * self.bytes_per_slot

    def fit_pages(self, budget_bytes: int) -> "CacheConfig":
        """A copy with as many pages as fit in `budget_bytes` after num_slots slots (found at start-up)."""
        left = budget_bytes - self.num_slots * self.bytes_per_slot
        num_pages = left // self.bytes_per_page if self.bytes_per_page else 0
        if num_pages < 1:
            raise ValueError(f"cache budget: {budget_bytes} B holds {self.num_slots} slots of {self.bytes_per_slot} B "
                             f"but not one page of {self.bytes_per_page} B; lower num_slots or raise the budget")
        return replace(self, num_pages=int(num_pages))


class CacheTensors:
    """Allocates and owns the cache of one rank.

    Attributes:
        mla_kv_all: [L_mla, num_pages, page_size, mla_width] kv_dtype
        kda_state_all: [L_kda, num_slots, H, V, K] state_dtype (V-first, FLA `state_v_first`)
        kda_conv_all: [L_kda, num_slots, C, W-1] conv_dtype (the last W-1 conv inputs, oldest first)
        mla_kv / kda_state / kda_conv: per-layer views (index = local layer order).
    """

    def __init__(self, config: CacheConfig, device: torch.device | str = "cpu", num_pages: int | None = None,
                 num_slots: int | None = None):
        c = config
        self.config = c
        self.device = torch.device(device)
        # Host stores reuse this class with their own capacities.
        self.num_pages = c.num_pages if num_pages is None else num_pages
        self.num_slots = c.num_slots if num_slots is None else num_slots
        alloc = dict(device=self.device)
        self.mla_kv_all = torch.zeros(c.num_mla_layers, self.num_pages, c.page_size, c.mla_width,
                                      dtype=DTYPES[c.kv_dtype], **alloc)
        self.kda_state_all = torch.zeros(c.num_kda_layers, self.num_slots, c.kda_num_heads, c.kda_head_v_dim,
                                         c.kda_head_k_dim, dtype=DTYPES[c.state_dtype], **alloc)
        self.kda_conv_all = torch.zeros(c.num_kda_layers, self.num_slots, c.kda_conv_dim, c.kda_conv_size - 1,
                                        dtype=DTYPES[c.conv_dtype], **alloc)
        self.mla_kv = list(self.mla_kv_all.unbind(0))
        self.kda_state = list(self.kda_state_all.unbind(0))
        self.kda_conv = list(self.kda_conv_all.unbind(0))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.mla_kv_all, self.kda_state_all, self.kda_conv_all

    def zero_slots(self, slot_ids) -> None:
        """Zero the KDA recurrent and conv state of `slot_ids` (fresh requests start from zero state).

        Args:
            slot_ids: a sequence of slot ids or an int64 tensor [S] on this device.
        """
        if not torch.is_tensor(slot_ids):
            if not slot_ids:
                return
            self._check(slot_ids, self.num_slots, "slot")
            slot_ids = to_device(list(slot_ids), self.device)
        self.kda_state_all.index_fill_(1, slot_ids, 0)
        self.kda_conv_all.index_fill_(1, slot_ids, 0)

    @staticmethod
    def _check(ids, limit: int, what: str) -> None:
        bad = [i for i in ids if not 0 <= i < limit]
        if bad:
            raise IndexError(f"{what} id {bad[0]} out of range: the cache holds {limit} {what}s")
