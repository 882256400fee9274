"""One generation request and its bookkeeping (no torch; nano-vllm's `Sequence` in spirit).

The scheduler owns every field below `params`; the API layer creates the request and reads
`output_token_ids`, `status`, `finish_reason` and `stop_reason`.
"""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field

from .sampling_params import SEED_LIMIT, SamplingParams


# the token id of a position whose token is still being sampled on the device (async scheduling): the runner
# takes it from the previous step's sampled ids
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds a slot and pages on the device
    SWAPPED = "swapped"  # preempted; its pages and slot live in the host store
    PREEMPTED = "preempted"  # preempted by recompute; holds nothing, re-prefills prompt + output
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
                 "abort": RequestStatus.FINISHED_ABORTED}


@dataclass(eq=False)
class Request:
    """A prompt, its sampling params and everything the scheduler tracks about it.

    Args:
        request_id: unique among live requests.
        prompt_token_ids: the prompt, at least one token id >= 0.
        params: sampling and stopping options.
        eos_token_ids: the model's EOS ids (config.json's and generation_config.json's; none = no EOS stop); set
            by the engine, () under ignore_eos.
        eos_token_id: config.json's EOS (vLLM's primary one, None under ignore_eos): the one id whose stop reports
            no stop_reason; generation_config.json's others report theirs, as vLLM adds them to the stop ids.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose MLA KV and KDA state are in the cache (advanced when a chunk is scheduled).
    num_computed_tokens: int = 0
    # Tokens sampled by steps scheduled but not yet updated (async scheduling feeds them to the next step on the
    # device, as PLACEHOLDER ids): 1 from schedule() to update() of a sampling step, 2 while the next is planned.
    num_pending: int = 0
    # Prompt positions whose logprobs of the next prompt token are scheduled (SamplingParams.prompt_logprobs): a
    # re-prefill after preemption by recompute does not report them again.
    num_prompt_rows: int = 0
    page_ids: list[int] = field(default_factory=list)
    slot_id: int | None = None
    host_page_ids: list[int] = field(default_factory=list)
    host_slot_id: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # the stop_token_ids id (or generation_config.json EOS id past the first) that ended it (vLLM's stop_reason); None:
    # config.json's EOS, length, abort or a stop string (API layer)
    stop_reason: int | None = None
    arrival: int = -1  # arrival order, set by Scheduler.add; smaller = older = higher priority
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    # Fixed at creation so a request without an explicit seed still samples identically after recompute.
    sampling_seed: int = -1
    _distinct_prompt: tuple[int, ...] | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id: expected a non-empty string, got {self.request_id!r}")
        ids = self.prompt_token_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError(f"prompt_token_ids: expected a non-empty list of token ids (request {self.request_id!r})")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"prompt_token_ids: expected ints >= 0 (request {self.request_id!r})")
        self.prompt_token_ids = list(ids)
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(self.params).__name__}")
        if self.sampling_seed < 0:
            self.sampling_seed = self.params.seed if self.params.seed is not None else random.randrange(SEED_LIMIT)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def distinct_prompt_ids(self) -> tuple[int, ...]:
        """The prompt's token ids, each once, ascending (what a repetition penalty needs; made once)."""
        if self._distinct_prompt is None:
            self._distinct_prompt = tuple(sorted(set(self.prompt_token_ids)))
        return self._distinct_prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far; also the index of the next token to sample (the sampler's RNG position)."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """Token ids at positions [start, stop) of prompt + output; PLACEHOLDER past the known ones (tokens still
        pending on the device)."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return tuple(self.prompt_token_ids[start:stop])
        known = self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n):stop - n]
        return tuple(known) + (PLACEHOLDER,) * (stop - start - len(known))
