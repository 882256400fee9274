"""DeepEP's low-latency dispatch / combine as the expert exchange (`deep_ep` imported only when one is made)."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist


class DeepEPExchange:
    """DeepEP low-latency dispatch/combine; one Buffer per process, sized for `capacity` tokens per rank.

    Not run here: DeepEP needs NVSHMEM-capable GPUs. tests/dist/deep_ep_standin holds a torch.distributed
    stand-in with DeepEP's documented API and layouts, which checks this adapter's bookkeeping on gloo.
    """

    def __init__(self, group, *, num_experts: int, expert_start: int, hidden: int, capacity: int):
        deep_ep = importlib.import_module("deep_ep")
        n = dist.get_world_size(group)
        self.num_experts, self.expert_start, self.capacity = num_experts, expert_start, capacity
        self.num_local = num_experts // n
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(capacity, hidden, n, num_experts)
        self.buffer = deep_ep.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True,
                                     num_qps_per_rank=self.num_local)
        self._pending = []  # (topk_ids, topk_weights, handle) of dispatches awaiting their combine, in order

    def dispatch(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, capacity: int):
        if z.shape[0] > self.capacity:
            raise RuntimeError(f"expert exchange: {z.shape[0]} tokens exceed DeepEP's buffer of {self.capacity}")
        recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
            z.contiguous(), ids.to(torch.int64).contiguous(), self.capacity, self.num_experts,
            use_fp8=False, async_finish=False, return_recv_hook=False)
        self._pending.append((ids, weights, handle))
        e, rows, width = recv_x.shape
        # Rows past an expert's count are padding: id -1 makes the MoE plugin skip them (no routing weight needed).
        valid = torch.arange(rows, device=recv_x.device)[None, :] < recv_count.to(recv_x.device)[:, None]
        local = torch.arange(e, device=recv_x.device, dtype=torch.int64)[:, None] + self.expert_start
        row_ids = torch.where(valid, local, -1).reshape(-1, 1)
        row_w = valid.reshape(-1, 1).to(torch.float32)
        return recv_x.reshape(e * rows, width), row_ids, row_w

    def combine(self, y: torch.Tensor, num_tokens: int, capacity: int) -> torch.Tensor:
        ids, weights, handle = self._pending.pop(0)
        expert_out = y.to(torch.bfloat16).view(self.num_local, -1, y.shape[-1])
        out, _, _ = self.buffer.low_latency_combine(expert_out, ids.to(torch.int64).contiguous(),
                                                    weights.to(torch.float32).contiguous(), handle,
                                                    async_finish=False, return_recv_hook=False)
        return out.float()[:num_tokens]
