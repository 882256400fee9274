"""One rank's share of a step: its caches, its graph, and the hand-off to the next pipeline stage.

Every rank runs the same `Step` (the scheduler's decisions, broadcast by the driver); ranks of a stage see the
same tokens and meet in the graph's AllReduce/AllGather nodes, consecutive stages exchange the hidden state and
the attention-residual snapshots. A step's sequences may be cut into micro-batches (Step.micro_batches, chosen by
the driver: micro_batch.py) so that stage s can work on micro-batch i while stage s+1 works on i-1.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
from k3plugins import registry

from .cuda_graph import DecodeGraphs, bucket_for
from .executor import FED, Communicator, Executor, StepBatch, feed_tokens
from .kv_cache import CacheTensors, HostStore
from .kv_cache.cache_tensors import CacheConfig
from .loader import EngineError, RankEngine
from .micro_batch import split
from .request import PLACEHOLDER
from .scheduler import ScheduledItem, StepPlan, SwapEntry
from .upload import to_device


@dataclass(frozen=True)
class Step:
    """What every rank executes this step (picklable: it is broadcast to the other ranks)."""

    items: tuple[ScheduledItem, ...]
    reset_slot_ids: tuple[int, ...] = ()
    swap_out: tuple[SwapEntry, ...] = ()
    swap_in: tuple[SwapEntry, ...] = ()
    all_logits: bool = False  # score mode: logits of every token, not only sampled ones
    stop: bool = False  # the driver is shutting down: workers leave their loop
    keep_alive: bool = False  # the driver has had no step to send for a while: workers wait again (dist/keep_alive)
    extra: dict = field(default_factory=dict)
    idle: bool = False  # an attention-DP rank with no work of its own: it only meets the others' collectives
    # attention-DP: the captured bucket every DP rank replays this step in, chosen by the driver from all their
    # steps (shared_bucket); None: every rank runs it eagerly
    graph_bucket: int | None = None
    # async scheduling: (item index, index among the previous step's sampled tokens) for each item whose input is
    # the PLACEHOLDER of a token sampled by the previous step; RankRunner.run feeds it on the device
    feed: tuple[tuple[int, int], ...] = ()
    # pipeline stages: the groups of whole sequences the step's items are cut into (micro_batch.split), at most
    # pp_size; every rank of the step cuts it alike
    micro_batches: int = 1

    @classmethod
    def from_plan(cls, plan: StepPlan) -> "Step":
        return cls(plan.items, plan.reset_slot_ids, plan.swap_out, plan.swap_in)


class RankRunner:
    def __init__(self, engine: RankEngine, cache_cfg: CacheConfig, comm: Communicator | None = None, *,
                 num_host_pages: int = 0, num_host_slots: int = 0, spare: tuple[int, int] | None = None,
                 cuda_graphs: bool = False):
        """spare: (page, slot) no request uses (padding rows of captured decode steps write there).
        cuda_graphs: replay pure decode steps from CUDA graphs (on a GPU, with a spare, unless graph_blocker says
        why not; `graphs_off` then holds that reason)."""
        self.engine, self.comm = engine, comm or Communicator()
        self.device = next(iter(engine.weights.values())).device
        c, extra = cache_cfg, 1 if spare else 0  # named as the user sized them: the spare is the runtime's
        self.cache = _allocate(lambda: CacheTensors(c, self.device), c.nbytes, self.device,
                               f"the caches of {c.num_pages - extra} MLA pages and {c.num_slots - extra} KDA slots "
                               "(num_pages and num_slots, or the engine's memory plan"
                               + (", and a spare one of each" if extra else "") + ")")
        self.host_store = None
        if num_host_pages or num_host_slots:
            host_bytes = num_host_pages * c.bytes_per_page + num_host_slots * c.bytes_per_slot
            self.host_store = _allocate(lambda: HostStore(self.cache, num_host_pages, num_host_slots), host_bytes,
                                        torch.device("cpu"), f"the host store of {num_host_pages} pages and "
                                        f"{num_host_slots} slots (num_host_pages, num_host_slots)")
        self.executor = Executor(engine, self.cache, self.comm)
        info = engine.rank_info
        self.first, self.last = info["first_stage"], info["last_stage"]
        self.pp_size = engine.config["mapping"]["pp_size"]
        self.num_blocks_in = sum(1 for i in engine.graph.input if i.name.startswith("blocks_in."))
        self.act_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[engine.build["dtype"]]
        self.graphs = None
        mapping = engine.config["mapping"]
        self.attention_dp = mapping["attention_dp"] and mapping["tp_size"] > 1  # DP ranks: the stage's TP ranks
        wanted = cuda_graphs and self.device.type == "cuda"
        self.graphs_off = graph_blocker(engine) if wanted else None
        if wanted and spare is not None and self.graphs_off is None:
            build = engine.build
            self.graphs = DecodeGraphs(self.executor, max_batch=build["max_batch_size"],
                                       max_pages=-(-build["max_seq_len"] // build["page_size"]),
                                       spare_page=spare[0], spare_slot=spare[1], stage_in=self._stage_inputs(),
                                       host_sets=self.pp_size)
            self.graphs.capture()

    def run(self, step: Step, fed: torch.Tensor | None = None, wait: bool = True) -> torch.Tensor | None:
        """Apply the step's cache edits and run its tokens. Returns fp32 logits on the last stage: [M, V] for the
        M sampled items, then the rows of their prompt logprobs (PromptRows), if any.
        fed: the previous step's sampled token ids on this device, which the step's `feed` inputs take.
        wait: rank 0 of several waits for a replayed step (_await_replay); async scheduling waits for the
        step's tokens instead."""
        if not 1 <= step.micro_batches <= self.pp_size:
            raise ValueError(f"a step in {step.micro_batches} micro-batches: expected 1 to pp_size ({self.pp_size})")
        if step.feed and fed is None:
            raise ValueError("a step that feeds sampled tokens needs them (fed) on every rank (async scheduling)")
        if step.feed and max(src for _, src in step.feed) >= fed.numel():  # shapes only: no sync
            raise ValueError(f"the step feeds sampled token {max(src for _, src in step.feed)} of a previous step "
                             f"that sampled {fed.numel()}")
        if step.swap_out or step.swap_in:
            if self.host_store is None:
                raise RuntimeError("the step swaps requests but this rank has no host store (num_host_pages = 0)")
            self.host_store.apply(step.swap_out, step.swap_in)
        self.cache.zero_slots(list(step.reset_slot_ids))
        if self.graphs is None:
            bucket = None
        elif self.attention_dp:  # the driver chose for every DP rank at once: they replay, or not, together
            bucket = step.graph_bucket
        else:
            bucket = self.graphs.bucket(len(step.items)) if _pure_decode(step) else None
        if bucket is not None:
            logits = self._replay(step, bucket if self.attention_dp else None, fed)
            if wait and self.engine.world_size > 1 and self.engine.rank == 0:
                _await_replay(self.device)
            return logits
        logits, start = [], 0
        for items in split(step.items, step.micro_batches):
            # the feed indexes the step's items; this micro-batch's start at `start`
            feed = tuple((i - start, src) for i, src in step.feed if start <= i < start + len(items))
            start += len(items)
            batch = self.batch(items, step.all_logits, feed)
            if feed:
                feed_tokens(batch.input_ids, fed)
            extra = {}
            if not self.first:
                extra = self._receive(int(batch.input_ids.numel()))
            out = self.executor.run(batch, extra)
            if self.last:
                logits.append((out["logits"], sum(it.sample for it in items)))
            else:
                self._send_on(out)
        return _sampled_first(logits) if self.last else None

    def _receive(self, num_tokens: int) -> dict[str, torch.Tensor]:
        return self.comm.recv_stage(num_tokens, self.engine.facts.hidden_size, self.num_blocks_in, self.act_dtype)

    def _send_on(self, out: dict[str, torch.Tensor]) -> None:
        self.comm.send_stage(out["hidden_out"], [out[f"blocks_out.{i}"] for i in range(len(out) - 1)])

    def _stage_inputs(self) -> dict[str, tuple[int, torch.dtype]]:
        """What this stage receives from the previous one: the hidden state and the snapshots (none on stage 0)."""
        names = [] if self.first else ["hidden_in"] + [f"blocks_in.{i}" for i in range(self.num_blocks_in)]
        return {name: (self.engine.facts.hidden_size, self.act_dtype) for name in names}

    def _replay(self, step: Step, bucket: int | None = None, fed: torch.Tensor | None = None) -> torch.Tensor | None:
        """A pure decode step from the captured graphs, a replay a micro-batch (in `bucket` when given; an idle
        step replays it with padding rows only); the hand-offs between stages stay outside the graphs (the next
        replay overwrites the outputs, so each goes out, or is copied, first)."""
        logits = []
        ids = _fed_ids(step.items, step.feed)
        groups = split(() if step.idle else step.items, step.micro_batches)
        for k, items in enumerate(groups):
            rows = [(ids[it.request_id], it.slot_id, it.start_pos + 1, it.page_ids) for it in items]
            out = self.graphs.run(rows, None if self.first else self._receive(len(rows)), host_set=k, bucket=bucket,
                                  fed=fed if step.feed else None)
            if self.last:
                # the caller reads the last replay's logits before the next replay; the earlier ones are copied
                logits.append(out["logits"] if len(groups) == 1 else out["logits"].clone())
            else:
                self._send_on(out)
        return (logits[0] if len(logits) == 1 else torch.cat(logits)) if self.last else None

    def batch(self, items: tuple[ScheduledItem, ...], all_logits: bool = False,
              feed: tuple[tuple[int, int], ...] = ()) -> StepBatch:
        """The items' eager step (input ids < 0 are fed: feed_tokens)."""
        ids = list(itertools.chain.from_iterable(it.token_ids for it in items))
        cu = [0, *itertools.accumulate(it.num_tokens for it in items)]
        for i, src in feed:  # i indexes `items`
            ids[cu[i] + items[i].token_ids.index(PLACEHOLDER)] = FED - src
        if PLACEHOLDER in ids:
            raise ValueError("a step input is a PLACEHOLDER that its feed does not resolve")
        max_pages = max(len(it.page_ids) for it in items)
        table = [list(it.page_ids) + [-1] * (max_pages - len(it.page_ids)) for it in items]
        rows = list(range(cu[-1])) if all_logits else [cu[i + 1] - 1 for i, it in enumerate(items) if it.sample]
        if not all_logits:  # then the prompt logprobs' rows (PromptRows), item by item
            rows += [cu[i] + it.prompt_rows.start - it.start_pos + j for i, it in enumerate(items) if it.prompt_rows
                     for j in range(len(it.prompt_rows.targets))]

        def tensor(values):
            return to_device(values, self.device)

        return StepBatch(input_ids=tensor(ids), cu_seqlens=tensor(cu), slot_ids=tensor([it.slot_id for it in items]),
                         context_lens=tensor([it.start_pos + it.num_tokens for it in items]),
                         page_table=tensor(table), logits_indices=tensor(rows),
                         host_seqs=tuple((it.num_tokens, it.start_pos + it.num_tokens) for it in items))


def _allocate(make, nbytes: int, device: torch.device, what: str):
    """make(), whose tensors take nbytes on device; EngineError naming what they hold (the options that size them)
    where the allocator refuses, in place of its traceback."""
    try:
        return make()
    except RuntimeError as e:  # torch.OutOfMemoryError on a GPU (a RuntimeError), the CPU allocator's own
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EngineError(f"{what} need {nbytes} bytes ({nbytes / 2**30:.1f} GiB) of {device.type} memory, more "
                          f"than could be allocated ({first}); lower them") from None


def _sampled_first(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The logits of a step's micro-batches (each with its number of sampled rows, which come first in it): all the
    sampled rows in item order, then all the prompt logprobs' rows."""
    if len(parts) == 1:
        return parts[0][0]
    return torch.cat([x[:n] for x, n in parts] + [x[n:] for x, n in parts])


def _fed_ids(items: tuple[ScheduledItem, ...], feed: tuple[tuple[int, int], ...]) -> dict[str, int]:
    """Each one-token item's input id by request id, FED - i where the feed gives it sampled token i."""
    fed = dict(feed)
    ids = {it.request_id: FED - fed[i] if i in fed else it.token_ids[0] for i, it in enumerate(items)}
    if PLACEHOLDER in ids.values():
        raise ValueError("a step input is a PLACEHOLDER that its feed does not resolve")
    return ids


def graph_blocker(engine: RankEngine) -> str | None:
    """Why this rank's decode steps cannot replay CUDA graphs, or None when they can.

    A captured step holds its collectives (NCCL records them into the graph like any kernel), so the ranks that
    meet in them must all replay, or all run eagerly, the same step. That holds when every rank runs every step:
    TP attention with experts over EP (K3's TEP16), and pipeline stages: every rank of every stage runs every
    micro-batch of a step, and the point-to-point hand-offs between stages stay outside the graphs
    (RankRunner._replay). Attention-DP ranks run steps of their own, so the driver, which schedules them all,
    picks one bucket for all of them or none (shared_bucket, Step.graph_bucket): the expert exchange moves a fixed
    capacity of rows whatever each rank's batch, and an idle rank replays the bucket with padding rows only. All
    ranks capture the same buckets in the same order at start-up, where the driver and the workers open their
    ranks in step. A plugin that reads device values on the host (a torch reference of KDA or MLA, where the build
    found no kernel for the target: KDA on gfx942, or fla-core missing) cannot be captured at all."""
    syncing = sorted(op for op, p in engine.build["plugins"].items()
                     if (impl := registry.find(op, p["tactic"])) is not None and impl.host_sync)
    if syncing:
        return f"{', '.join(syncing)}: the torch reference reads device values on the host, which a graph cannot hold"
    if engine.world_size == 1:
        return None
    if torch.version.hip is not None:
        return "RCCL collectives inside HIP graphs have not been run by k3runtime"
    return None


def _await_replay(device: torch.device) -> None:
    """Rank 0 waits for a multi-rank replay with the collective timeout. The collectives inside a graph are not
    watched by torch's NCCL watchdog, so a rank that hangs mid-replay would otherwise leave the driver blocked in
    its next device sync for ever; this way it fails like a timed-out collective (launch.run then names the
    rank whose heartbeat went stale). The driver reads the logits next anyway: this sync costs nothing extra."""
    from .dist.comm import collective_timeout

    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    wait_for(done.query, collective_timeout().total_seconds(), "a replayed decode step")


def wait_for(done, limit_s: float, what: str) -> None:
    """Poll done() until it is true; TimeoutError (worded as a collective timeout) after limit_s seconds."""
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} timed out after {limit_s:.0f} s (K3_DIST_TIMEOUT_S): a rank did not reach "
                               "one of its collectives")
        time.sleep(1e-4)


def shared_bucket(steps: tuple[Step, ...], buckets: list[int]) -> int | None:
    """Attention-DP: the bucket all DP ranks replay their steps in (the smallest that holds the largest), or None
    when any of them is not a pure decode step or fits no bucket (they all run eagerly then). Idle ranks' steps fit
    any bucket."""
    busy = [s for s in steps if not s.idle]
    if not busy or not all(_pure_decode(s) for s in busy):
        return None
    return bucket_for(buckets, max(len(s.items) for s in busy))


def _pure_decode(step: Step) -> bool:
    return not step.all_logits and all(it.num_tokens == 1 and it.sample for it in step.items)
