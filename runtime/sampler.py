"""Turn logits into tokens: greedy, temperature, top-k, top-p, each draw seeded by (request seed, position).

Seeding every draw by the request's seed and the index of the token being sampled makes sampling a pure
function of the request, so batch composition and preemption-by-recompute cannot change the output.
"""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby (seed, position) pairs apart


def _draw_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """Args: logits [M, V] fp32; per row its params, request seed and output-token index. Returns M token ids."""
    out = []
    greedy = logits.argmax(dim=-1).tolist()
    for row, (p, seed, pos) in enumerate(zip(params, seeds, positions)):
        if p.temperature == 0:
            out.append(greedy[row])
            continue
        x = logits[row].float() / p.temperature
        if p.top_k:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
            probs = probs.scatter(0, order[drop], 0.0)
            probs = probs / probs.sum()
        gen = torch.Generator(device=logits.device).manual_seed(_draw_seed(seed, pos))
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
