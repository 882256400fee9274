"""Log-probabilities of the sampled tokens and of their most likely alternatives (SamplingParams.logprobs).

They are the model's own distribution, the log-softmax of its fp32 logits before temperature, top-k and top-p (what
vLLM calls raw logprobs), so they do not depend on how a token was drawn. A step's rows that ask are done
together on the logits' device with no host sync, packed in one float64 tensor (token ids are exact in it) that
goes to the host with the step's ids. As in the sampler, the alternatives come from a top-k, not a sort of the
vocabulary, in passes of ROWS_PER_PASS rows, ties broken by lower token id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import ROWS_PER_PASS, best_first, top_k_mask
from .sampling_params import SamplingParams
from .upload import to_device


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # the sampled token's
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the most likely tokens, most likely first


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """logits [M, V] of a step's sampled rows, tokens [M] their sampled ids, params their SamplingParams. Returns,
    for the rows that ask, in order, [R, 1 + 2·top] float64: the sampled token's logprob, then the `top` most
    likely ids and their logprobs, top the most any row asks for (at most V); None when no row asks."""
    shape = rows_shape(params, logits.shape[1]) if params else None  # an idle step may have no logits
    if shape is None:
        return None
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if len(rows) < len(params):
        index = to_device(rows, logits.device)
        logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
    top = (shape[1] - 1) // 2
    packed = []
    for r0 in range(0, len(rows), ROWS_PER_PASS):
        x = logits[r0:r0 + ROWS_PER_PASS].float()
        norm = torch.logsumexp(x, dim=-1, keepdim=True)
        cols = [x.gather(1, tokens[r0:r0 + ROWS_PER_PASS].view(-1, 1)) - norm]
        if top:
            k = torch.full((x.shape[0],), top, dtype=torch.int64, device=x.device)
            values, ids = best_first(*torch.topk(x.masked_fill(~top_k_mask(x, k, top), float("-inf")), top, dim=-1))
            cols += [ids, values - norm]
        packed.append(torch.cat([c.double() for c in cols], dim=1))
    return torch.cat(packed)


def rows_shape(params: list[SamplingParams], vocab: int) -> tuple[int, int] | None:
    """The shape of step_logprobs' rows for a step's sampled items' params (None when none asks): what a rank that
    receives them allocates."""
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return (len(asked), 1 + 2 * min(max(asked), vocab)) if asked else None


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
        out.append(TokenLogprobs(row[0], tuple((int(row[1 + i]), row[1 + top + i])
                                               for i in range(min(p.logprobs, top)))))
    return out
