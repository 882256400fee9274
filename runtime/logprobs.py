"""Log-probabilities of the sampled tokens and of their most likely alternatives (SamplingParams.logprobs), and of
the prompt's tokens (SamplingParams.prompt_logprobs).

They are the model's own distribution, the log-softmax of its fp32 logits before temperature, top-k and top-p (what
vLLM calls raw logprobs), so they do not depend on how a token was drawn. A step's rows that ask are done
together on the logits' device with no host sync, packed in one float64 tensor (token ids are exact in it) that
goes to the host with the step's ids. As in the sampler, the alternatives come from a top-k, not a sort of the
vocabulary, in passes of ROWS_PER_PASS rows, ties broken by lower token id. A prompt's rows are the logits of its
prefill chunks' positions, packed after the sampled rows', so they go to the driver the same way; a request gets
them with its first output token. The scheduler holds a step to max_num_seqs prompt rows (Scheduler._chunk), so
that its logits stay within twice the sampled rows' most.
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


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, items) -> torch.Tensor | None:
    """logits [M + P, V]: a step's M sampled rows, then its P prompt rows (the items' PromptRows, in order); tokens
    [M] the sampled ids; items the step's ScheduledItems. Returns [R, 1 + 2·top] float64: for each sampled row that
    asks (SamplingParams.logprobs), then for each prompt row, the logprob of its token (the sampled one; the next
    prompt token), then the `top` most likely ids and their logprobs, top the most any row asks for (at most V);
    None when no row asks."""
    if rows_shape(items, 1) is None:  # an idle step may have no logits
        return None
    shape = rows_shape(items, logits.shape[1])
    params = sampled_params(items)
    m, rows = len(params), [i for i, p in enumerate(params) if p.logprobs is not None]
    targets = [t for it in items if it.prompt_rows for t in it.prompt_rows.targets]
    blocks = []  # (logits, their tokens): the asking sampled rows (a copy when some do not ask), the prompt rows
    if rows:
        index = to_device(rows, logits.device)
        blocks.append((logits[:m], tokens) if len(rows) == m else
                      (logits.index_select(0, index), tokens.index_select(0, index)))
    if targets:  # a view: a step may hold max_num_seqs prompt rows
        blocks.append((logits[m:m + len(targets)], to_device(targets, logits.device)))
    top = (shape[1] - 1) // 2
    packed = []
    for block, ids_of in blocks:
        for r0 in range(0, block.shape[0], ROWS_PER_PASS):
            x = block[r0:r0 + ROWS_PER_PASS].float()
            norm = torch.logsumexp(x, dim=-1, keepdim=True)
            cols = [x.gather(1, ids_of[r0:r0 + ROWS_PER_PASS].view(-1, 1)) - norm]
            if top:
                k = torch.full((x.shape[0],), top, dtype=torch.int64, device=x.device)
                values, ids = best_first(*torch.topk(x.masked_fill(~top_k_mask(x, k, top), float("-inf")), top,
                                                     dim=-1))
                cols += [ids, values - norm]
            packed.append(torch.cat([c.double() for c in cols], dim=1))
    return torch.cat(packed)


def sampled_params(items) -> list[SamplingParams]:
    """The SamplingParams of a step's (or plan's) items that sample, in order."""
    return [it.params for it in items if it.sample]


def rows_shape(items, vocab: int) -> tuple[int, int] | None:
    """The shape of step_logprobs' rows for a step's (or plan's) items (None when none asks): what a rank that
    receives them allocates."""
    asked = [p.logprobs for p in sampled_params(items) if p.logprobs is not None]
    prompt = [(len(it.prompt_rows.targets), it.params.prompt_logprobs) for it in items if it.prompt_rows]
    if not asked and not prompt:
        return None
    top = max(asked + [k for _, k in prompt])
    return len(asked) + sum(n for n, _ in prompt), 1 + 2 * min(top, vocab)


def unpack(rows: list[list[float]], items) -> tuple[list[TokenLogprobs | None], list[tuple[str, list[TokenLogprobs]]]]:
    """step_logprobs' rows on the host: each sampled item's, cut to what it asked for (None for those that did
    not ask); and (request id, its prompt rows' logprobs) for each item with PromptRows."""
    rows = iter(rows)
    sampled = [None if p.logprobs is None else _entry(next(rows), p.logprobs) for p in sampled_params(items)]
    prompt = [(it.request_id, [_entry(next(rows), it.params.prompt_logprobs) for _ in it.prompt_rows.targets])
              for it in items if it.prompt_rows]
    return sampled, prompt


def _entry(row: list[float], wanted: int) -> TokenLogprobs:
    top = (len(row) - 1) // 2
    return TokenLogprobs(row[0], tuple((int(row[1 + i]), row[1 + top + i]) for i in range(min(wanted, top))))
