"""The oracle of runtime/penalties.py, one row at a time: transformers' own logits processors for the logit bias and
CTRL's repetition penalty, then OpenAI's formula for the frequency and presence penalties."""

import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor


def penalized_logits(x: torch.Tensor, p, prompt: list[int], output: list[int]) -> torch.Tensor:
    """x [V]: the bias, then the repetition penalty over prompt + output, then
    mu[j] - c[j] * frequency - (c[j] > 0) * presence with c the counts in output (float64)."""
    x = x.double()[None]
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias])(torch.tensor([[0]]), x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + output]), x)
    x = x[0].clone()
    for t in set(output):
        x[t] -= output.count(t) * p.frequency_penalty + p.presence_penalty
    return x
