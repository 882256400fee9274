"""What a user may ask of an engine (EngineOptions) and what it refuses before any weight is read: options past
the engine's build limits, prompts it could never run. Every way in (the Python API, generate, serve, the Triton
backend, dist.launch) checks with these."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .kv_cache.cache_tensors import CacheConfig
from .loader import EngineError
from .scheduler import room_error
from .scheduler_config import check_ints, check_preemption


def check_device(device: str) -> None:
    """ValueError for a device string that is not cpu, cuda or cuda:N (whether that GPU is here is the loader's
    check: a Triton model repository may be written for another machine's GPU)."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu, cuda or cuda:N, got {device!r}")


@dataclass(frozen=True)
class EngineOptions:
    """Runtime sizes; None = the engine's memory plan / build limits."""

    device: str = "cpu"
    num_pages: int | None = None
    num_slots: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int | None = None
    preemption_mode: str = "recompute"
    num_host_pages: int = 0
    num_host_slots: int = 0
    # the host store in GiB a rank instead of the two counts (host_sizes turns it into them)
    swap_space_gib: float | None = None
    enable_deepep: bool = False  # require DeepEP for the expert exchange (fails at start-up without it)
    cuda_graphs: bool = True  # decode steps from CUDA graphs on GPUs (rank_runner.graph_blocker: where not)
    load_progress: bool = False  # progress while a rank reads its weights (generate and serve show it)
    # hash every byte of the weights files as they are read, against the sha256 the build recorded (a weight store
    # has checked its copy already): damage that leaves the values finite and the scales in range is refused too
    verify_weights: bool = False
    # schedule a step while the previous one runs (module doc); None: on where it can run and pays, see
    # `resolve_async_scheduling`
    async_scheduling: bool | None = None
    # pipeline stages: cut every step of several sequences into this many micro-batches (at most pp_size; 1:
    # never cut); None: the count micro_batch.micro_batch_count estimates fastest
    pp_micro_batches: int | None = None

    def __post_init__(self):
        check_device(self.device)
        for name in ("enable_deepep", "cuda_graphs", "load_progress", "verify_weights", "async_scheduling"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name == "async_scheduling"):
                raise ValueError(f"{name}: expected True or False, got {value!r}")
        check_ints(self, ("num_pages", "num_slots", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                          "pp_micro_batches"), 1, optional=True)
        check_ints(self, ("num_host_pages", "num_host_slots"), 0)
        check_preemption(self.preemption_mode)
        gib = self.swap_space_gib
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib)
                                or gib <= 0):
            raise ValueError(f"swap_space_gib: expected None or a number of GiB > 0, got {gib!r}")
        host = self.num_host_pages, self.num_host_slots
        if gib is not None and any(host):
            raise ValueError(f"swap_space_gib ({gib}) sizes the host store itself: give it or num_host_pages and "
                             f"num_host_slots ({host[0]} / {host[1]}), not both")
        if self.preemption_mode == "swap" and gib is None and not all(host):
            raise ValueError(f"preemption_mode 'swap' needs a host store: swap_space_gib, or num_host_pages and "
                             f"num_host_slots >= 1 (got {host[0]} and {host[1]})")
        if self.preemption_mode != "swap" and gib is not None:
            raise ValueError(f"swap_space_gib ({gib}) holds swapped requests: it needs preemption_mode 'swap'")
        if self.preemption_mode != "swap" and any(host):
            raise ValueError(f"num_host_pages / num_host_slots ({host[0]} / {host[1]}) hold swapped requests: they "
                             "need preemption_mode 'swap'")


# resolve_async_scheduling's rule, for the command lines' help
ASYNC_SCHEDULING_DEFAULT = "on for a CUDA engine without pipeline stages or attention-DP; off on the CPU and ROCm"


def resolve_async_scheduling(options: EngineOptions, mapping: dict) -> EngineOptions:
    """The options with async scheduling decided. Left to the engine (None), it is on for a single-stage engine
    on a CUDA GPU, where the GPU otherwise waits for the host between decode steps (BENCHMARKS.md, bench_rank:
    0.4-0.7 ms a step at 32 requests), and off on the CPU, whose steps run as they are launched: there it would
    only cost a token-stopped request one step more. Off on ROCm, with attention-DP and with pipeline stages,
    where it has not run on GPUs (under attention-DP and with pipeline stages it has run as gloo ranks on the CPU
    only); asked for (True), it runs there too. Over several GPUs the TP/EP form has run only as gloo ranks on
    the CPU and as a one-process NCCL group (no multi-GPU machine was lent)."""
    if options.async_scheduling is None:
        cuda = torch.device(options.device).type == "cuda" and torch.version.hip is None
        single = mapping["pp_size"] == 1 and not mapping["attention_dp"]
        return replace(options, async_scheduling=cuda and single)
    return options


def check_build_limits(options: EngineOptions, config: dict, engine_dir) -> None:
    """EngineError for steps larger than the engine was built for: its graph and expert exchange buffers hold
    max_num_tokens tokens, so a larger step would fail mid-serve (a longer prefill chunk is cut by the step's
    tokens; more running requests than max_batch_size decode eagerly past the largest captured graph); and for
    more micro-batches than pipeline stages (the captured graphs hold a micro-batch's inputs a stage); and for more
    running requests than KDA state slots. Every command that takes the engine flags checks them here, before any
    weight is read."""
    value, limit = options.max_num_batched_tokens, config["build_config"]["max_num_tokens"]
    if value is not None and value > limit:
        raise EngineError(f"{engine_dir}: max_num_batched_tokens {value} is past the engine's max_num_tokens {limit}; "
                          "ask for at most that, or rebuild it (k3build build --max-num-tokens ...)")
    value, limit = options.pp_micro_batches, config["mapping"]["pp_size"]
    if value is not None and value > limit:
        raise EngineError(f"{engine_dir}: pp_micro_batches {value} is past the engine's {limit} pipeline stage(s) "
                          "(pp_size); a step is cut into at most that many micro-batches")
    value, limit = options.max_num_seqs, cache_sizes(config, options)[1]
    if value is not None and value > limit:
        raise EngineError(f"{engine_dir}: max_num_seqs {value} is past the engine's {limit} KDA state slots "
                          "(num_slots), one a running request: lower it or give num_slots")
    try:
        host_sizes(config, options)
    except ValueError as e:
        raise EngineError(f"{engine_dir}: {e}") from None


def check_ids(token_ids: list[int], vocab: int, field: str) -> None:
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{field}: token id {bad[0]!r} outside the vocabulary 0..{vocab - 1}")


def check_prompt(config: dict, token_ids: list[int], field: str = "prompt_token_ids", *,
                 max_tokens: int = 1, num_pages: int | None = None) -> None:
    """ValueError for a prompt the engine whose config.json is `config` never runs: empty, an id outside its
    vocabulary, too long to leave a token under max_seq_len, or with max_tokens more than `num_pages` hold (the
    output stops at max_seq_len; Scheduler.add's rule, room_error).
    It reads no weights: a command checks its prompts with it before the engine loads."""
    if not token_ids:
        raise ValueError(f"{field}: empty (at least one token is needed)")
    check_ids(token_ids, config["pretrained_config"]["vocab_size"], field)
    build = config["build_config"]
    why = room_error(len(token_ids), max_tokens, max_len=build["max_seq_len"], page_size=build["page_size"],
                     num_pages=num_pages or config["memory_plan"]["num_pages"])
    if why:
        raise ValueError(why.replace("prompt_token_ids:", f"{field}:", 1))


def cache_sizes(config: dict, options: EngineOptions) -> tuple[int, int]:
    """(pages, slots) the scheduler hands out, per attention-DP rank."""
    plan = config["memory_plan"]
    return options.num_pages or plan["num_pages"], options.num_slots or plan["num_slots"]


def host_sizes(config: dict, options: EngineOptions) -> tuple[int, int]:
    """(pages, slots) of each rank's host store for swap preemption: num_host_pages and num_host_slots, or what
    swap_space_gib holds. Every rank's store has the same counts (the scheduler's host ids are one set for all), so
    the budget is held by the rank whose cache costs the most bytes (pipeline stages hold different layers), and it
    is split as the device cache is (pages to slots), the mix its requests are swapped out in.
    ValueError for a budget that holds no page or no slot."""
    if options.swap_space_gib is None:
        return options.num_host_pages, options.num_host_slots
    pages, slots = cache_sizes(config, options)
    budget = int(options.swap_space_gib * 2**30)
    ranks = [CacheConfig.for_rank(config, r, num_pages=pages, num_slots=slots)
             for r in range(config["mapping"]["world_size"])]
    rank = max(range(len(ranks)), key=lambda r: ranks[r].nbytes)
    worst = ranks[rank]
    host_pages, host_slots = budget * pages // worst.nbytes, budget * slots // worst.nbytes
    if not (host_pages and host_slots):
        least = math.ceil(max(worst.nbytes / pages, worst.nbytes / slots) / 2**30 * 1e4) / 1e4  # one of each
        raise ValueError(f"swap_space_gib {options.swap_space_gib} holds {host_pages} host pages and {host_slots} KDA "
                         f"slots (rank {rank}: {worst.bytes_per_page:,} B a page, {worst.bytes_per_slot:,} B a slot, "
                         f"split {pages}:{slots} as its device cache); a swapped request needs a slot and its pages: "
                         f"give at least {least:.4f} GiB")
    return host_pages, host_slots
