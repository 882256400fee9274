"""Scheduler limits: a frozen config validated at construction (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap")


def check_ints(obj, names: tuple[str, ...], minimum: int, *, optional: bool = False) -> None:
    """ValueError naming the first field of `names` that is not an int >= minimum (or None, when optional)."""
    for name in names:
        v = getattr(obj, name)
        if optional and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            none = "None (the engine's) or " if optional else ""
            raise ValueError(f"{name}: expected {none}an int >= {minimum}, got {v!r}")


def check_preemption(mode: str) -> None:
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode: expected one of {PREEMPTION_MODES}, got {mode!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What one engine step may hold.

    Args:
        max_num_seqs: running requests at most (each holds one KDA slot).
        max_num_batched_tokens: tokens fed to the model in one step, over all requests.
        max_prefill_chunk: tokens per request per step (chunked prefill); decode uses 1.
        page_size: tokens per MLA cache page; must equal the PagePool's.
        preemption_mode: "recompute" (drop pages + slot, re-prefill later) or "swap" (move them to host).
        num_host_pages / num_host_slots: host-store capacity for "swap"; a victim that does not fit
            on the host is preempted by recompute instead.
        max_model_len: prompt + output tokens per request at most; None = bounded by the page pool only.
        async_scheduling: the next step may be scheduled while one is in flight (scheduler.py).
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 512
    page_size: int = 64
    preemption_mode: str = "recompute"
    num_host_pages: int = 0
    num_host_slots: int = 0
    max_model_len: int | None = None
    async_scheduling: bool = False

    def __post_init__(self):
        check_ints(self, ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "page_size"), 1)
        check_ints(self, ("num_host_pages", "num_host_slots"), 0)
        check_preemption(self.preemption_mode)
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len: expected None or an int >= 2, got {self.max_model_len!r}")
