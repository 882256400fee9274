"""Vocabulary-parallel embedding, the LM head and a plain linear layer (torch reference)."""

import torch


def embedding(ids, weight, *, vocab_start: int = 0):
    """ids [T] int64, weight [V_local, D] (rows vocab_start…): rows of other ranks come out as zeros,
    so a sum over the TP group gives the full embedding."""
    local = ids - vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    out = weight[local.clamp(0, weight.shape[0] - 1)]
    return out * inside.unsqueeze(-1).to(out.dtype)


def lm_head(h, weight, indices):
    """h [T, D], weight [V_local, D], indices [N] (rows of h to score) -> fp32 logits [N, V_local]."""
    return h.index_select(0, indices).float() @ weight.float().T


def linear(x, weight):
    """x [T, K], weight [N, K] -> [T, N] in x.dtype, fp32 accumulation."""
    return (x.float() @ weight.float().T).to(x.dtype)
