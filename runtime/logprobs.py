"""Log-probabilities of the sampled tokens and of their most likely alternatives (SamplingParams.logprobs).

They are the model's own distribution, the log-softmax of its fp32 logits before temperature, top-k and top-p (what
vLLM calls raw logprobs), so they do not depend on how a token was drawn. A step's rows that ask are done
together on the logits' device with no host sync, packed in one float64 tensor (token ids are exact in it) that
goes to the host with the step's ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams
from .upload import to_device


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # the sampled token's
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the most likely tokens, most likely first


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """logits [M, V] of a step's sampled rows, tokens [M] their sampled ids, params their SamplingParams. Returns,
    for the rows that ask, in order, [R, 1 + 2·top] float64: the sampled token's logprob, then the `top` most
    likely ids and their logprobs (ties by lower id), top the most any row asks for; None when no row asks."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    if len(rows) < len(params):
        index = to_device(rows, logits.device)
        logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
    lp = torch.log_softmax(logits.float(), dim=-1)
    cols = [lp.gather(1, tokens.view(-1, 1))]
    top = max(params[i].logprobs for i in rows)
    if top:
        values, ids = torch.sort(lp, dim=-1, descending=True, stable=True)  # stable: equal values by lower id
        cols += [ids[:, :top], values[:, :top]]
    return torch.cat([c.double() for c in cols], dim=1)


def unpack(rows: list[list[float]], params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """step_logprobs' rows on the host: each asking row's, cut to what it asked for; None for the others."""
    rows = iter(rows)
    out = []
    for p in params:
        if p.logprobs is None:
            out.append(None)
            continue
        row = next(rows)
        top = (len(row) - 1) // 2
        out.append(TokenLogprobs(row[0], tuple((int(row[1 + i]), row[1 + top + i]) for i in range(p.logprobs))))
    return out
