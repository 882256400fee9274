"""Logit bias, the repetition, frequency and presence penalties and min_tokens (SamplingParams), applied to a step's
sampled rows before the sampler draws from them, in vLLM's order:

0. ids a row may not sample yet (EOS and stop_token_ids under min_tokens: ScheduledItem.banned) become -inf;
1. logit_bias is added;
2. repetition_penalty (CTRL's) divides the positive logits, and multiplies the negative ones, of every token in
   the prompt or the output;
3. each token's logit loses frequency_penalty times its count in the output, and presence_penalty once if it is
   there at all (OpenAI's formula).

The counts are made on the logits' device from the token lists the plan carries (scheduler.SeenTokens). With async
scheduling a row's last output token is not among them, being still on the device: it comes from the previous
step's sampled ids (`pending`). Either way there is no host sync.

Rows that set none of the four are left as they are, bit for bit. Rows are done ROWS_PER_PASS at a time, which
bounds the [rows, V] counts. The cost is on the host: a penalized item carries its whole output (and, for
repetition_penalty, its prompt's distinct ids) in every step's plan, so a request of L output tokens costs O(L) a
step, O(L^2) in all (the flat ids go through numpy: about 30 ns a token); counts kept on the sampling rank
would make it O(1) a step.
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


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], seen: list, pending: torch.Tensor | None = None,
                  banned: list[tuple[int, ...]] | None = None) -> torch.Tensor:
    """logits [M, V] of a step's sampled rows; per row its params and its scheduler.SeenTokens (None where it is
    not penalized); pending [M] int64 on the logits' device: each row's output token that its SeenTokens lacks,
    -1 for none (None: no row lacks one); banned: per row the ids it may not sample (None: none). Returns the
    logits with every row's changes applied, fp32 (the input itself when no row has any)."""
    banned = banned or [()] * len(params)
    rows = [i for i, p in enumerate(params) if adjusts(p) or banned[i]]
    if not rows:
        return logits
    out = logits.float().clone()
    for r0 in range(0, len(rows), ROWS_PER_PASS):
        part = rows[r0:r0 + ROWS_PER_PASS]
        index = to_device(part, logits.device)
        x = out.index_select(0, index)
        late = None if pending is None else pending.index_select(0, index)
        x = _ban(x, [banned[i] for i in part])
        out.index_copy_(0, index, _adjust(x, [params[i] for i in part], [seen[i] for i in part], late))
    return out


def _ban(x: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """x [R, V] with each row's banned ids at -inf."""
    flat = [r * x.shape[1] + t for r, ids in enumerate(banned) for t in ids]
    if flat:
        x.view(-1).index_fill_(0, to_device(flat, x.device), float("-inf"))
    return x


def _adjust(x: torch.Tensor, params: list[SamplingParams], seen: list, pending: torch.Tensor | None) -> torch.Tensor:
    """adjust_logits's bias and penalties on R rows: x [R, V] fp32."""
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
    counts = torch.zeros(R * V, dtype=torch.int32, device=dev)
    known = _flat([(r, s.output) for r, s in enumerate(seen) if s is not None], V)
    if known.size:
        counts.index_add_(0, to_device(known, dev), torch.ones(known.size, dtype=torch.int32, device=dev))
    if pending is not None:  # -1: none; its add is a 0 to token 0
        late = torch.arange(R, device=dev) * V + pending.clamp(min=0)
        counts.index_add_(0, late, (pending >= 0).to(torch.int32))
    counts = counts.view(R, V)
    in_output = counts > 0
    # one upload: (repetition, frequency, presence) a row
    k = to_device([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params], dev,
                  torch.float64).float()
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_any = in_output.clone()
        prompt = _flat([(r, s.prompt) for r, (p, s) in enumerate(zip(params, seen))
                        if s is not None and p.repetition_penalty != 1.0], V)
        if prompt.size:
            seen_any.view(-1).index_fill_(0, to_device(prompt, dev), True)
        rep = k[:, :1]
        x = torch.where(seen_any, torch.where(x > 0, x / rep, x * rep), x)
    return x - k[:, 1:2] * counts - k[:, 2:3] * in_output


def _flat(rows: list[tuple[int, tuple[int, ...]]], V: int) -> np.ndarray:
    """r * V + t for each row's (r, ids) and each t in its ids, int64, through numpy: a Python loop over the tokens
    costs about ten times more (tens of ms a step at 32 rows of 8K tokens)."""
    parts = [np.asarray(ids, dtype=np.int64) + r * V for r, ids in rows if ids]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
