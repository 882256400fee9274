"""A stand-in for DeepEP's low-latency API, for testing k3runtime's DeepEP adapter on CPU ranks over gloo.

Not DeepEP: DeepEP needs NVSHMEM-capable GPUs, which CI does not have. This module has the same entry points
and tensor layouts as `deep_ep.Buffer.low_latency_dispatch / low_latency_combine` (bf16 tokens in; per local
expert [experts, ranks x max tokens, hidden] rows and a count per expert out; combine applies the routing
weights), and moves every token with all_gather instead of RDMA writes. It publishes the limits k3runtime's
start-up check reads.
"""

import torch
import torch.distributed as dist

__version__ = "standin"
LOW_LATENCY_MAX_TOPK = 16
LOW_LATENCY_HIDDEN_SIZES = tuple(range(32, 8193, 32))


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


class Buffer:
    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 1, **_):
        if not low_latency_mode:
            raise ValueError("stand-in: only low_latency_mode=True is provided")
        self.group, self.rank, self.n = group, dist.get_rank(group), dist.get_world_size(group)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return 2 * num_max_dispatch_tokens_per_rank * hidden * 2 * num_experts

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                             async_finish=False, return_recv_hook=False, **_):
        C, L = num_max_dispatch_tokens_per_rank, num_experts // self.n
        if x.dtype != torch.bfloat16 or topk_idx.dtype != torch.int64 or x.shape[0] > C or use_fp8:
            raise ValueError("stand-in: bf16 x, int64 topk_idx, at most C tokens, use_fp8=False")
        xs = torch.zeros(C, x.shape[1], dtype=torch.float32)
        xs[:x.shape[0]] = x.float()  # gloo transport in fp32
        ids = torch.full((C, topk_idx.shape[1]), -1, dtype=torch.int64)
        ids[:x.shape[0]] = topk_idx
        xs, ids = _all_gather(xs, self.group), _all_gather(ids, self.group)  # [n, C, H], [n, C, k]
        recv_x = torch.zeros(L, self.n * C, x.shape[1], dtype=torch.bfloat16)
        count = torch.zeros(L, dtype=torch.int32)
        src = torch.full((L, self.n * C), -1, dtype=torch.int64)  # source rank * C + token of each row
        for e in range(L):
            r, t = (ids == self.rank * L + e).any(-1).nonzero(as_tuple=True)
            recv_x[e, :r.numel()] = xs[r, t].to(torch.bfloat16)
            count[e], src[e, :r.numel()] = r.numel(), r * C + t
        return recv_x, count, (src, C), None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, async_finish=False, return_recv_hook=False, **_):
        src, C = handle
        L = x.shape[0]
        outs, srcs = _all_gather(x.float(), self.group), _all_gather(src, self.group)  # every rank's expert rows
        out = torch.zeros(topk_idx.shape[0], x.shape[2], dtype=torch.float32)
        for i, row in enumerate(topk_idx.tolist()):
            for j, g in enumerate(row):
                if g < 0:
                    continue
                owner, e = divmod(g, L)
                pos = (srcs[owner, e] == self.rank * C + i).nonzero()[0, 0]
                out[i] += topk_weights[i, j].float() * outs[owner, e, pos]
        return out.to(torch.bfloat16), None, None
