"""MoE router: fp32 sigmoid scores, bias for selection only, renormalise (K3_SPEC.md §2.4)."""
import torch


def route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int,
          renormalize: bool, scaling_factor: float, num_expert_group: int = 1,
          topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token.

    Args:
        x: [M, D] hidden states.
        gate_weight: [E, D] router weight (upcast to fp32: a bf16 GEMM flips borderline picks).
        correction_bias: [E] e_score_correction_bias, added for selection only; None means zeros.
        top_k: experts per token.
        renormalize: divide the weights by their sum (+1e-20).
        scaling_factor: routed_scaling_factor, applied last.
        num_expert_group, topk_group: DeepSeek-V3 grouped selection (a group scores the sum of
            its top-2 biased scores; only experts of the best topk_group groups compete).

    Returns:
        (topk_ids int64 [M, top_k], topk_weights fp32 [M, top_k]), ids in descending biased score.
    """
    if gate_weight.dim() != 2 or gate_weight.shape[1] != x.shape[-1]:
        raise ValueError(f"route: gate_weight must be [E, {x.shape[-1]}], got {tuple(gate_weight.shape)}")
    return select_experts(x.float() @ gate_weight.float().T, correction_bias, top_k=top_k, renormalize=renormalize,
                          scaling_factor=scaling_factor, num_expert_group=num_expert_group, topk_group=topk_group)


def select_experts(logits: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int, renormalize: bool,
                   scaling_factor: float, num_expert_group: int = 1,
                   topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """route() from the fp32 logits [M, E] on: sigmoid, bias for selection, (grouped) top-k, weights."""
    E = logits.shape[-1]
    if correction_bias is not None and correction_bias.shape != (E,):
        raise ValueError(f"route: correction_bias must be [{E}], got {tuple(correction_bias.shape)}")
    if E % num_expert_group or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"route: {E} experts cannot form {num_expert_group} groups with topk_group={topk_group}")
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k={top_k} must be in [1, {E}]")
    scores = torch.sigmoid(logits.float())                                      # [M, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group > 1:
        M = choice.shape[0]
        grouped = choice.view(M, num_expert_group, E // num_expert_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [M, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // num_expert_group, dim=1), float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices                               # [M, k]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, topk_weights * scaling_factor
