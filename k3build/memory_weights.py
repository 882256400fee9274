"""Weight bytes per rank and category: every tensor of the converted checkpoint (`k3build.schema`, canonical
flavour), each counted for the ranks `Mapping.shard` gives it to. Nothing here re-decides ownership.
"""

from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from math import prod

from k3plugins.kda.reference import IN_PROJ_ROW_ALIGN

from .config import KDA, K3Config, QuantConfig
from .mapping import Mapping, MappingError

CATEGORIES = ("embedding", "lm_head", "attention_kda", "attention_mla", "dense_mlp", "shared_experts",
              "router_latent_norms", "routed_experts")
_ITEMSIZE = {"F32": 4, "U8": 1}  # kept as they are; 16-bit tensors take the engine's dtype
_GLOBAL = {"model.embed_tokens.weight": "embedding", "lm_head.weight": "lm_head"}
_PART = {"mlp.": "dense_mlp", "block_sparse_moe.shared_experts.": "shared_experts"}
# The KDA projections of x that build's layout fuses into one `in_proj`, padded with zero rows (layout._kda).
_KDA_IN_PROJ = frozenset(n + "_proj" for n in ("q", "k", "v", "f_a", "b", "g", "g_a"))
_NAME = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.|mlp\.|block_sparse_moe\.shared_experts\.|"
                   r"block_sparse_moe\.experts\.(\d+)\.)?")


def weight_bytes(cfg: K3Config, mapping: Mapping, rank: int, *, expert_format: str | None = None,
                 dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes of this rank's slices per category (see CATEGORIES), exactly as `Mapping.shard` assigns them, plus
    the zero rows that pad each KDA layer's fused `in_proj` and less the AttnRes the build leaves out (layout.py):
    the tensor bytes of the rank's engine.

    expert_format: "mxfp4" (packed E2M1 + E8M0 scales) or "bf16"; default: what the config's checkpoint holds.
    dtype_bytes: the engine's size of the checkpoint's 16-bit tensors (build --dtype; the build keeps F32 and
    packed U8 tensors as they are).
    """
    dense, experts = _tensor_groups(_with_expert_format(cfg, expert_format), dtype_bytes)
    out = dict.fromkeys(CATEGORIES, 0)
    stage = mapping.rank_layers(rank, cfg.num_hidden_layers)
    in_proj_rows = dict.fromkeys((i for i in stage if cfg.layer_types[i] == KDA), 0)
    for name, layer, shape, itemsize, cat in dense:
        if layer is not None and ".self_attention_res_" in name and not cfg.snapshots_before(layer):
            continue  # no snapshot yet: the build leaves this AttnRes (the identity) out (layout._layer)
        if layer is None or layer in stage:
            owned = _owned(mapping, name, shape, itemsize, rank, cfg)
            out[cat] += owned
            if layer in in_proj_rows and name.split(".")[-2] in _KDA_IN_PROJ:
                in_proj_rows[layer] += owned // (shape[-1] * itemsize)
    pad_rows = sum(-rows % IN_PROJ_ROW_ALIGN for rows in in_proj_rows.values())
    out["attention_kda"] += pad_rows * cfg.hidden_size * dtype_bytes
    for layer in stage:
        local = mapping.local_experts(rank, cfg.num_experts)
        if layer not in experts or not len(local):
            continue
        # Every local expert has the same slices: ask the Mapping about the first, count the rest.
        head = f"model.layers.{layer}.block_sparse_moe.experts.{local[0]}."
        one = sum(_owned(mapping, head + leaf, shape, itemsize, rank, cfg) for leaf, shape, itemsize in experts[layer])
        out["routed_experts"] += one * len(local)
    return out


def check_expert_format(expert_format: str) -> None:
    if expert_format not in ("mxfp4", "bf16"):
        raise ValueError(f"expert_format: expected 'mxfp4' or 'bf16', got {expert_format!r}")


def _with_expert_format(cfg: K3Config, expert_format: str | None) -> K3Config:
    if expert_format is None:
        return cfg
    check_expert_format(expert_format)
    method = "mxfp4" if expert_format == "mxfp4" else "none"
    return cfg if cfg.quantization.method == method else dataclasses.replace(cfg, quantization=QuantConfig(method))


@lru_cache(maxsize=16)
def _tensor_groups(cfg: K3Config, dtype_bytes: int):
    """The converted (canonical) checkpoint's tensors from `k3build.schema`, grouped for fast per-rank sums.

    Returns (dense, experts): dense = [(name, layer | None, shape, itemsize, category)] for every non-expert
    tensor; experts = {layer: [(leaf, shape, itemsize)]} for one expert (all experts of a layer are alike).
    """
    from .schema import checkpoint_tensors

    dense, experts = [], {}
    for name, (shape, dtype) in checkpoint_tensors(cfg, "canonical").items():
        itemsize = _ITEMSIZE.get(dtype, dtype_bytes)
        m = _NAME.match(name)
        if m is None:
            cat = _GLOBAL.get(name, "router_latent_norms")  # final norm, output AttnRes
            dense.append((name, None, shape, itemsize, cat))
            continue
        layer, part = int(m.group(1)), m.group(2)
        if m.group(3) is not None:
            if m.group(3) == "0":
                experts.setdefault(layer, []).append((name[m.end():], shape, itemsize))
            continue
        # part None: layer norms, AttnRes params, router, latent projections
        cat = "attention_" + cfg.layer_types[layer] if part == "self_attn." else _PART.get(part, "router_latent_norms")
        dense.append((name, layer, shape, itemsize, cat))
    return tuple(dense), experts


def _owned(mapping: Mapping, name: str, shape: tuple[int, ...], itemsize: int, rank: int, cfg: K3Config) -> int:
    s = mapping.shard(name, rank, cfg)
    if s is None:
        return 0
    if s.dim is not None and shape[s.dim] % s.parts:
        raise MappingError(f"{name}: dim {s.dim} of shape {list(shape)} does not split into {s.parts} parts")
    return prod(shape) * itemsize // (s.parts if s.dim is not None else 1)
