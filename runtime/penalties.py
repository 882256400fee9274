"""Logit bias, the repetition, frequency and presence penalties and min_tokens (SamplingParams), applied to a step's
sampled rows before the sampler draws from them, in vLLM's order:

0. ids a row may not sample yet (EOS and stop_token_ids under min_tokens: ScheduledItem.banned) become -inf;
1. logit_bias is added;
2. repetition_penalty (CTRL's) divides the positive logits, and multiplies the negative ones, of every token in
   the prompt or the output;
3. each token's logit loses frequency_penalty times its count in the output, and presence_penalty once if it is
   there at all (OpenAI's formula).

The sampling rank keeps each penalized request's counts on the logits' device, by its KDA slot (SeenCounts): a
plan's item brings only what they lack (scheduler.SeenTokens), usually the one token sampled since its last step,
and everything when the slot's counts are another request's (a request new to the slot; also one back after
preemption or a swap in a slot another penalized request has used meanwhile). With async
scheduling a row's last output token is not among them, being still on the device: it comes from the previous
step's sampled ids (`pending`). Either way there is no host sync.

Rows that set none of the four are left as they are, bit for bit. Rows are done ROWS_PER_PASS at a time, which
bounds the [rows, V] temporaries. Host work is O(1) a step for a penalized request, O(L) once when its slot gets
its whole output (the flat ids go through numpy: about 30 ns a token). The counts take V int32 and V bools a slot
(about 0.8 MB with K3's vocabulary), for every slot of the rank, allocated at the first penalized step; the build's
memory plan reserves them on the ranks that sample (k3build.memory: penalty_counts; num_slots above the build's
max_batch_size is not covered).
"""

from __future__ import annotations

import numpy as np
import torch

from .sampler import ROWS_PER_PASS
from .sampling_params import SamplingParams
from .upload import to_device


def adjusts(p: SamplingParams) -> bool:
    """Whether a row's logits are changed before it is sampled."""
    return bool(p.logit_bias) or p.penalized


class SeenCounts:
    """On a sampling rank, per KDA slot: how often each token is in the output of the penalized request the slot
    holds (int32 [slots, V]), and which are in its prompt (bool, for repetition_penalty), as the SeenTokens of its
    items have brought them. num_slots: the rank's slots, all allocated at the first penalized step (what the
    memory plan reserves: penalty_counts); None: as many as the highest slot seen needs (tests, tools)."""

    def __init__(self, num_slots: int | None = None):
        self.num_slots = num_slots
        self.counts: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None
        self.counted: dict[int, int] = {}  # slot -> output tokens its counts hold

    def update(self, slots: list[int], seen: list, V: int, device: torch.device) -> None:
        """Apply one step's SeenTokens (one per slot, each slot once): a fresh one replaces its slot's counts and
        prompt ids, the others add their tokens. A SeenTokens that does not start where its slot's counts end
        is refused (the plan and this rank disagree: its penalties would be wrong)."""
        for slot, t in zip(slots, seen):
            if not t.fresh and self.counted.get(slot) != t.start:
                have = self.counted.get(slot)
                raise ValueError(f"slot {slot}: the step brings output tokens from index {t.start}, this rank's "
                                 f"counts hold {'none' if have is None else have}")
        if self.num_slots is not None and max(slots) >= self.num_slots:
            raise ValueError(f"slot {max(slots)}: this rank's penalty counts hold {self.num_slots} slots")
        self._grow(self.num_slots or max(slots) + 1, V, device)
        fresh = [slot for slot, t in zip(slots, seen) if t.fresh]
        if fresh:
            index = to_device(fresh, device)
            self.counts.index_fill_(0, index, 0)
            self.prompt.index_fill_(0, index, False)
            prompt = _flat([(slot, t.prompt) for slot, t in zip(slots, seen) if t.fresh], V)
            if prompt.size:
                self.prompt.view(-1).index_fill_(0, to_device(prompt, device), True)
        tokens = _flat([(slot, t.output) for slot, t in zip(slots, seen)], V)
        if tokens.size:
            self.counts.view(-1).index_add_(0, to_device(tokens, device),
                                            torch.ones(tokens.size, dtype=torch.int32, device=device))
        for slot, t in zip(slots, seen):
            self.counted[slot] = t.end

    def _grow(self, num_slots: int, V: int, device: torch.device) -> None:
        have = 0 if self.counts is None else self.counts.shape[0]
        if num_slots <= have:
            return
        counts = torch.zeros(num_slots, V, dtype=torch.int32, device=device)
        prompt = torch.zeros(num_slots, V, dtype=torch.bool, device=device)
        if have:
            counts[:have], prompt[:have] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], seen: list, pending: torch.Tensor | None = None,
                  banned: list[tuple[int, ...]] | None = None, slots: list[int] | None = None,
                  store: SeenCounts | None = None) -> torch.Tensor:
    """logits [M, V] of a step's sampled rows; per row its params and its scheduler.SeenTokens (None where it is
    not penalized); pending [M] int64 on the logits' device: each row's output token that its SeenTokens lacks,
    -1 for none (None: no row lacks one); banned: per row the ids it may not sample (None: none); slots: per row
    its KDA slot, the key of its counts in `store` (None: the row's index); store: the counts this rank keeps
    (None: a new one, for SeenTokens that are all fresh). Returns the logits with every row's changes applied,
    fp32 (the input itself when no row has any)."""
    banned = banned or [()] * len(params)
    rows = [i for i, p in enumerate(params) if adjusts(p) or banned[i]]
    if not rows:
        return logits
    slots = list(range(len(params))) if slots is None else slots
    penalized = [i for i in rows if params[i].penalized]
    if penalized:
        store = SeenCounts() if store is None else store
        store.update([slots[i] for i in penalized], [seen[i] for i in penalized], logits.shape[1], logits.device)
    out = logits.float().clone()
    for r0 in range(0, len(rows), ROWS_PER_PASS):
        part = rows[r0:r0 + ROWS_PER_PASS]
        index = to_device(part, logits.device)
        x = out.index_select(0, index)
        late = None if pending is None else pending.index_select(0, index)
        x = _ban(x, [banned[i] for i in part])
        out.index_copy_(0, index, _adjust(x, [params[i] for i in part], [slots[i] for i in part], store, late))
    return out


def _ban(x: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """x [R, V] with each row's banned ids at -inf."""
    flat = [r * x.shape[1] + t for r, ids in enumerate(banned) for t in ids if 0 <= t < x.shape[1]]
    if flat:
        x.view(-1).index_fill_(0, to_device(flat, x.device), float("-inf"))
    return x


def _adjust(x: torch.Tensor, params: list[SamplingParams], slots: list[int], store: SeenCounts | None,
            pending: torch.Tensor | None) -> torch.Tensor:
    """adjust_logits's bias and penalties on R rows: x [R, V] fp32; the penalized rows' counts in `store`."""
    R, V = x.shape
    dev = x.device
    bias = [(r * V + t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        flat, values = zip(*bias)
        # a row's ids are distinct (SamplingParams checks): each logit gets one bias, added in any order alike
        x.view(-1).index_put_((to_device(list(flat), dev),), to_device(list(values), dev, torch.float64).float(),
                              accumulate=True)
    if not any(p.penalized for p in params):
        return x
    # the rows' counts (a row that is not penalized reads slot 0's, and its factors below are all neutral)
    index = to_device([s if p.penalized else 0 for s, p in zip(slots, params)], dev)
    counts = store.counts.index_select(0, index)
    if pending is not None:  # -1: none; its add is a 0 to token 0
        counts.view(-1).index_add_(0, torch.arange(R, device=dev) * V + pending.clamp(min=0),
                                   (pending >= 0).to(torch.int32))
    in_output = counts > 0
    # one upload: (repetition, frequency, presence) a row
    k = to_device([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] if p.penalized else [1.0, 0, 0]
                   for p in params], dev, torch.float64).float()
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_any = in_output | store.prompt.index_select(0, index)
        rep = k[:, :1]
        x = torch.where(seen_any, torch.where(x > 0, x / rep, x * rep), x)
    return x - k[:, 1:2] * counts - k[:, 2:3] * in_output


def _flat(rows: list[tuple[int, tuple[int, ...]]], V: int) -> np.ndarray:
    """r * V + t for each row's (r, ids) and each t in its ids, int64, through numpy: a Python loop over the tokens
    costs about ten times more (tens of ms a step at 32 rows of 8K tokens)."""
    parts = [np.asarray(ids, dtype=np.int64) + r * V for r, ids in rows if ids]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
