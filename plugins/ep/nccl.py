"""The NCCL-style expert exchange: an all-gather of every rank's padded rows, a reduce-scatter of the sums."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_cat(x: torch.Tensor, group, axis: int = 0) -> torch.Tensor:
    """Every rank's x of the group, concatenated along `axis` in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=axis)


class NcclExchange:
    """Fixed-capacity all-gather dispatch / reduce-scatter combine over the torch.distributed group."""

    def __init__(self, group, upcast: bool):
        self.group, self.upcast = group, upcast

    def dispatch(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, capacity: int):
        t = z.shape[0]
        out = []
        for x in (z, ids, weights):
            padded = x.new_zeros((capacity, *x.shape[1:]))
            padded[:t] = x
            out.append(gather_cat(padded, self.group))
        return tuple(out)

    def combine(self, y: torch.Tensor, num_tokens: int, capacity: int) -> torch.Tensor:
        # gloo has no bf16/fp16 reductions on every build; the MoE output is fp32 anyway
        y = y.float() if self.upcast and y.dtype != torch.float32 else y.contiguous()
        mine = y.new_empty((capacity, *y.shape[1:]))
        dist.reduce_scatter_tensor(mine, y, group=self.group)
        return mine[:num_tokens]
