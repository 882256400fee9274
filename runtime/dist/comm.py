"""Collectives and stage hand-off over torch.distributed (NCCL on GPUs, gloo on CPU).

Groups come from the engine's rank table (written by the builder from its Mapping), so the runtime never
recomputes who owns what. Every rank creates every group in the same order, as torch.distributed requires.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from k3plugins.ep import gather_cat

from ..executor import Communicator
from . import heartbeat

TIMEOUT_ENV = "K3_DIST_TIMEOUT_S"
LOAD_TIMEOUT_ENV = "K3_DIST_LOAD_TIMEOUT_S"


def collective_timeout() -> timedelta:
    """How long any collective or hand-off may wait for a peer ($K3_DIST_TIMEOUT_S, default 60 s).

    Every group gets it explicitly: `dist.new_group` does not inherit the default group's timeout (it falls
    back to torch's 30 min), so a hung rank would otherwise stall the others for half an hour.
    """
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, 60)))


def load_timeout() -> timedelta:
    """How long the ranks wait for each other to finish reading their weights ($K3_DIST_LOAD_TIMEOUT_S, default
    30 min): a K3 rank reads for minutes, and the ranks of a job finish minutes apart, past any step's timeout."""
    return timedelta(seconds=float(os.environ.get(LOAD_TIMEOUT_ENV, 1800)))


def sampling_rank(mapping: dict) -> int:
    """The last stage's first rank: it reports a step's results to the driver (rank 0 without pipeline stages)."""
    return mapping["world_size"] - mapping["tp_size"]


def build_groups(ranks_table: dict[str, dict], rank: int) -> tuple[dict[str, object], dict[str, str]]:
    """Process groups this rank belongs to, by graph group name ("tp", "moe"), and their keys in the heartbeats."""
    mine, keys = {}, {}
    for key in ("tp_group", "moe_group"):
        seen = []
        for info in (ranks_table[str(r)] for r in sorted(map(int, ranks_table))):
            members = tuple(info[key])
            if members in seen:
                continue
            seen.append(members)
            group = dist.new_group(list(members), timeout=collective_timeout()) if len(members) > 1 else None
            if rank in members:
                name = key.removesuffix("_group")
                mine[name], keys[name] = group, heartbeat.group_key(name, members)
    return mine, keys


_RESULT_DTYPES = (torch.int64, torch.float32, torch.float64)  # what send_result carries, by header code


class ControlPlane:
    """Driver -> workers messages (options, steps) and last stage -> driver results, over gloo on the CPU.

    Kept apart from the data-plane groups so NCCL ranks never need host objects on their streams.
    """

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=collective_timeout())
        self.key = heartbeat.group_key("control", range(dist.get_world_size()))

    def broadcast(self, obj=None):
        box = [obj]
        with heartbeat.collective(self.key):
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send_result(self, t: torch.Tensor, dst: int = 0) -> None:
        """Last stage -> driver: sampled token ids [M] int64 (then their logprobs' rows [R, W] float64, when an
        item asked), or logits [N, V] fp32 in score mode. A fixed-size header (dtype, ndim, shape) goes first, so
        the driver needs no guess of what each rank's step returns (under attention-DP one rank may score while the
        others run idle steps and send empty token ids)."""
        t = t.detach().cpu().contiguous()
        if t.dtype not in _RESULT_DTYPES or t.dim() > 2:
            raise TypeError(f"send_result: a result is int64 token ids, fp64 logprob rows or fp32 logits of at most "
                            f"2 dims, got "
                            f"{t.dtype} {tuple(t.shape)}")
        shape = list(t.shape) + [0] * (2 - t.dim())
        header = torch.tensor([_RESULT_DTYPES.index(t.dtype), t.dim(), *shape], dtype=torch.int64)
        dist.send(header, dst, group=self.group)
        dist.send(t, dst, group=self.group)

    def recv_result(self, src: int) -> torch.Tensor:
        header = torch.zeros(4, dtype=torch.int64)
        dist.recv(header, src, group=self.group)
        code, ndim, *shape = header.tolist()
        t = torch.empty(shape[:ndim], dtype=_RESULT_DTYPES[code])
        dist.recv(t, src, group=self.group)
        return t


class DistCommunicator(Communicator):
    def __init__(self, ranks_table: dict[str, dict], rank: int, tp_size: int, device: torch.device):
        self.rank, self.tp_size, self.device = rank, tp_size, device
        self.groups, self.group_keys = build_groups(ranks_table, rank)
        self.world_key = heartbeat.group_key("world", range(dist.get_world_size()))
        self.control = ControlPlane()
        self._loaded = dist.new_group(backend="gloo", timeout=load_timeout())
        # gloo has no bf16/fp16 reductions on every build: reduce those in fp32 (also more accurate).
        self.upcast = dist.get_backend() == "gloo"
        self.exchange = None
        self.last_step = time.monotonic()
        self.keep_alive = None  # the driver's KeepAlive (dist/keep_alive.py), stopped before its workers' release
        # the driver has opened its rank: its workers, past the load barrier, wait for steps (launch.release_workers)
        self.opened = False
        # a step failed on the driver while the workers may be inside it (its collectives): they are not sent a
        # stop, which would wait there for them, and they for it, until the step timeout (launch.release_workers)
        self.broken = False

    def lost(self, exc: BaseException) -> heartbeat.RankLost | None:
        """A failed step's error naming the rank it lost (silent, stuck, left or dead: heartbeat.explain, which may
        watch the beats for a few seconds), for the driver's callers (a server's 503); None when exc is no failed
        collective."""
        why = heartbeat.explain(exc, collective_timeout().total_seconds())
        if not why:
            return None
        said = str(exc).strip().splitlines()
        return heartbeat.RankLost(f"{why} ({type(exc).__name__}: {said[0][:300] if said else ''})")

    def all_reduce(self, x: torch.Tensor, group: str) -> torch.Tensor:
        y = x.float() if self.upcast and x.dtype != torch.float32 else x.contiguous()
        with heartbeat.collective(self.group_keys[group]):
            dist.all_reduce(y, group=self.groups[group])
        return y.to(x.dtype)

    def all_gather(self, x: torch.Tensor, group: str, axis: int) -> torch.Tensor:
        with heartbeat.collective(self.group_keys[group]):
            return gather_cat(x, self.groups[group], axis)

    def wait_loaded(self) -> None:
        """Every rank has read its weights (a barrier under load_timeout): the collectives after it, from the first
        CUDA-graph capture on, meet ranks that are ready, within the step timeout."""
        dist.barrier(group=self._loaded)

    def use_exchange(self, exchange) -> None:
        """The expert exchange backend (k3plugins.ep, chosen by runtime/dist/exchange.py), set once the runtime options
        are known."""
        self.exchange = exchange

    def ep_gather(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, group: str, capacity: int):
        """Attention-DP dispatch: the rows this rank's experts must see, from every rank of the group."""
        if z.shape[0] > capacity:
            raise RuntimeError(f"expert exchange: {z.shape[0]} tokens exceed the engine's capacity of {capacity} per rank")
        with heartbeat.collective(self.group_keys[group]):  # counted, so a rank that never gets here can be named
            return self.exchange.dispatch(z, ids, weights, capacity)

    def ep_scatter(self, y: torch.Tensor, z: torch.Tensor, *, group: str, capacity: int) -> torch.Tensor:
        """Attention-DP combine: this rank's tokens' sums of every rank's expert outputs."""
        with heartbeat.collective(self.group_keys[group]):
            return self.exchange.combine(y, z.shape[0], capacity)

    def share_tokens(self, tokens: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Async scheduling: the sampled ids [M] int64 of rank `src` (the driver; with pipeline stages the last
        stage's first rank) broadcast into `tokens` on every rank, on the device (NCCL: queued on the stream, no
        host sync), for the next step to feed; or their logprobs' rows [R, W] float64, for the driver."""
        with heartbeat.collective(self.world_key):
            dist.broadcast(tokens, src=src)
        return tokens

    def send_stage(self, hidden: torch.Tensor, blocks: list[torch.Tensor]) -> None:
        dst = self.rank + self.tp_size  # same TP index, next stage
        for t in [hidden, *blocks]:
            dist.send(t.contiguous(), dst)

    def recv_stage(self, num_tokens: int, hidden_size: int, num_blocks: int, dtype: torch.dtype) -> dict:
        src = self.rank - self.tp_size
        out = {}
        for name in ["hidden_in"] + [f"blocks_in.{i}" for i in range(num_blocks)]:
            t = torch.empty(num_tokens, hidden_size, dtype=dtype, device=self.device)
            dist.recv(t, src)
            out[name] = t
        return out

    def broadcast_step(self, step) -> None:
        self.control.broadcast(step)
        self.last_step = time.monotonic()  # KeepAlive sends nothing while steps go out

    def recv_result(self, src: int) -> torch.Tensor:
        return self.control.recv_result(src)
