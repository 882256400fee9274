"""Expert exchange backends for attention-DP + EP (the graph's EPGather / EPScatter nodes), chosen at start-up.

    local   one EP rank: nothing to exchange.
    nccl    (default) torch.distributed collectives on fixed-capacity buffers: each rank contributes `capacity`
            rows (its tokens, zero-padded, routing weight 0 on the padding), all ranks gather them, run their
            local experts on the rows routed to them, and reduce-scatter the partial sums back to the owners.
            Shapes never depend on the routing, so there is no device->host sync and the step can be captured
            as a CUDA graph. A fixed-size all-to-all would move the same bytes (NCCL sends the padding too);
            the per-local-expert grouping DeepEP's buffers give is done by the MoE plugin's on-device sort.
    deepep  DeepEP's low-latency kernels (`deep_ep.Buffer.low_latency_dispatch/combine`): a token travels
            only to the ranks owning its experts and arrives in per-local-expert buffers
            [local experts, ranks x capacity, width] with a count per expert. The MoE plugin sees those rows
            with top-1 routing to their expert (weight 1, id -1 past the count, so padding is skipped), and
            DeepEP's combine applies the routing weights on the way back.

The engine records its backend (`k3build build --expert-backend`, or the recipe's [runtime] expert_backend);
`--enable-deepep` asks for DeepEP whatever the engine says, and fails at start-up when it cannot be had.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from ..loader import EngineError
from .comm import gather_cat

BACKENDS = ("local", "nccl", "deepep")


def choose_backend(config: dict, enable_deepep: bool = False) -> str:
    """The exchange backend for this engine and flag; raises EngineError when it cannot be used."""
    recorded = config["build_config"].get("expert_backend", "nccl")
    if recorded not in BACKENDS:
        raise EngineError(f"engine build_config.expert_backend is {recorded!r}; expected one of {', '.join(BACKENDS)}")
    backend = "deepep" if enable_deepep else recorded
    mapping = config["mapping"]
    if backend == "local" and mapping["moe_ep_size"] > 1:
        raise EngineError(f"expert_backend 'local' cannot serve an engine with moe_ep_size={mapping['moe_ep_size']}; "
                          "rebuild with --expert-backend nccl")
    if backend == "deepep":
        from .deepep import check_deepep

        check_deepep(config["pretrained_config"])  # missing package or a limit K3 exceeds: fail before loading
        if config["build_config"]["dtype"] != "bf16":
            raise EngineError(f"--enable-deepep: DeepEP's low-latency dispatch carries bf16 tokens; this engine's "
                              f"activations are {config['build_config']['dtype']} (rebuild with --dtype bf16, or "
                              "use the nccl exchange)")
    return backend


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


def make_exchange(backend: str, config: dict, rank: int, group, *, upcast: bool):
    """The exchange object for `backend` on this rank (None for 'local' or without an EP group)."""
    if backend == "local" or group is None:
        return None
    if backend == "nccl":
        return NcclExchange(group, upcast)
    cfg, info = config["pretrained_config"], config["ranks"][str(rank)]
    width = cfg.get("routed_expert_hidden_size") or cfg["hidden_size"]
    return DeepEPExchange(group, num_experts=cfg["num_experts"], expert_start=info["experts"][0], hidden=width,
                          capacity=config["build_config"]["max_num_tokens"])
