"""Scheduler limits: a frozen config validated at construction (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap")


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
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: expected an int > 0, got {v!r}")
        for name in ("num_host_pages", "num_host_slots"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: expected one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len: expected None or an int >= 2, got {self.max_model_len!r}")
