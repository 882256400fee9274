"""How many micro-batches a step of a pipeline-parallel engine is cut into.

Stage s works on micro-batch i while stage s+1 works on i-1, but a step's micro-batches drain before the next
step starts (its inputs are this step's sampled tokens), so n micro-batches over pp stages take pp + n - 1 times
the largest micro-batch's stage time. Cutting pays when a micro-batch's time falls with its size: so for a long
prefill step of several sequences (a sequence is never cut), bound by its tokens' arithmetic, and less so for a
decode step, bound by the bytes it reads. Each micro-batch reads the stage's dense weights again, and the experts
its tokens pick (at K3's 16 of 896, 32 tokens pick about 44 % of them, 64 tokens 68 %, so the experts' bytes grow
with the tokens until most are picked), while its KV and KDA state are its own. On the H200 one TEP16 rank's decode
step at 32 requests takes 0.73 of its step at 64 (bench_rank, BENCHMARKS.md): two stages cutting such a step in
two would take about 1.1 times it whole.

`StageCost` estimates a micro-batch's stage time as the bytes it reads plus its arithmetic counted at the GPU's
ridge (added, as if they did not overlap), from rank 0's weights and caches; `micro_batch_count` cuts a step when
the estimate says so by a margin. For that rank the estimate gives 0.66 where 0.73 was measured: it favours
cutting, hence the margin. Attention's arithmetic is left out (its KV bytes are counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache.cache_tensors import DTYPES, CacheConfig

# FLOP a byte of HBM read buys at the bf16 matrix rate: about 185 measured on the H200 (790 TFLOP/s over
# 4.3 TB/s, BENCHMARKS.md), about 250 on paper for the MI300X; only the choice of a count depends on it
RIDGE_FLOP_PER_BYTE = 200.0
# a cut step must be estimated this much faster than the whole one: the estimate favours cutting (module doc)
CUT_MARGIN = 0.9


def _size(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def _is_expert(name: str) -> bool:
    """A routed expert's packed weights or scales (lN.moe.w13, lN.moe.w2_scale)."""
    return ".moe.w13" in name or ".moe.w2" in name


@dataclass(frozen=True)
class StageCost:
    """One rank's stage time for a micro-batch, in bytes read. Rank 0 stands in for every stage (the build gives
    the stages equal layers); its embedding table, which a token reads a row of, is counted as read whole in place
    of the last stage's LM head, of the same shape."""

    dense_bytes: float  # weights every micro-batch reads whole
    expert_bytes: float  # the rank's routed experts: a micro-batch reads those its tokens pick
    num_experts: int  # routed experts of the model (0: no MoE)
    experts_per_token: int
    kv_bytes_per_token: float  # the rank's MLA layers' cache bytes a context token
    state_bytes_per_seq: float  # the rank's KDA state and conv windows, read and written a step
    flop_bytes_per_token: float  # a token's arithmetic on the rank, as bytes at the ridge

    @classmethod
    def from_engine(cls, weights: dict, pretrained: dict, cache: CacheConfig) -> "StageCost":
        """weights: the rank's tensors by name; pretrained: the engine's pretrained_config; cache: its geometry."""
        dense = sum(t.numel() * t.element_size() for n, t in weights.items() if not _is_expert(n))
        expert = sum(t.numel() * t.element_size() for n, t in weights.items() if _is_expert(n))
        # MXFP4: two weights a packed byte (the scales' bytes do no arithmetic); float experts: one an element
        expert_weights = sum((2 if t.dtype == torch.uint8 else 1) * t.numel() for n, t in weights.items()
                             if _is_expert(n) and "_scale" not in n)
        num_experts, top_k = pretrained.get("num_experts") or 0, pretrained.get("num_experts_per_token") or 0
        share = top_k / num_experts if num_experts else 0.0  # of the rank's experts, a token's expected picks
        dense_weights = sum(t.numel() for n, t in weights.items() if not _is_expert(n))
        state = cache.num_kda_layers * (cache.kda_num_heads * cache.kda_head_k_dim * cache.kda_head_v_dim
                                        * _size(cache.state_dtype)
                                        + cache.kda_conv_dim * (cache.kda_conv_size - 1) * _size(cache.conv_dtype))
        return cls(dense_bytes=dense, expert_bytes=expert, num_experts=num_experts, experts_per_token=top_k,
                   kv_bytes_per_token=cache.num_mla_layers * cache.mla_width * _size(cache.kv_dtype),
                   state_bytes_per_seq=2 * state,
                   flop_bytes_per_token=2 * (dense_weights + share * expert_weights) / RIDGE_FLOP_PER_BYTE)

    def bytes(self, items) -> float:
        """The estimated stage time of one micro-batch of scheduled items, in bytes."""
        tokens = sum(it.num_tokens for it in items)
        picked = 1 - (1 - self.experts_per_token / self.num_experts) ** tokens if self.num_experts else 0.0
        context = sum(it.start_pos + it.num_tokens for it in items)
        return (self.dense_bytes + picked * self.expert_bytes + context * self.kv_bytes_per_token
                + len(items) * self.state_bytes_per_seq + tokens * self.flop_bytes_per_token)


def split(items: tuple, count: int) -> list[tuple]:
    """Up to `count` groups of whole sequences, in order, of equal size but the last (one group: all of them)."""
    if count <= 1 or len(items) <= 1:
        return [items]
    size = -(-len(items) // min(count, len(items)))
    return [items[i:i + size] for i in range(0, len(items), size)]


def micro_batch_count(items: tuple, pp_size: int, cost: StageCost) -> int:
    """The count, from 1 to pp_size, with the least estimated step time; above 1 only if it beats the whole step's
    by CUT_MARGIN."""
    best, best_time = 1, pp_size * cost.bytes(items) * CUT_MARGIN
    for count in range(2, min(pp_size, len(items)) + 1):
        groups = split(items, count)
        if len(groups) < count:  # the groups of a count the items do not fill come from a smaller count too
            continue
        time = (pp_size + count - 1) * max(cost.bytes(g) for g in groups)
        if time < best_time:
            best, best_time = count, time
    return best
