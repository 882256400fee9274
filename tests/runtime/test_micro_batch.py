"""How a pipeline-parallel engine cuts a step into micro-batches (runtime/micro_batch.py): the groups, the stage-time
estimate read from a real rank, and the counts it chooses for K3's stages as the builder's memory model sizes them.
The multi-rank tests (tests/dist/test_multirank.py) run cut and whole steps through real stages."""

import pytest
import torch

from engines import build_engine

from k3build.config import preset
from k3build.mapping import Mapping
from k3build.memory import kda_state_bytes, kv_bytes_per_token, weight_bytes
from k3runtime.kv_cache import CacheTensors
from k3runtime.loader import load_rank
from k3runtime.micro_batch import RIDGE_FLOP_PER_BYTE, StageCost, micro_batch_count, split
from k3runtime.scheduler import ScheduledItem


def _items(n: int, context: int, tokens: int = 1) -> tuple[ScheduledItem, ...]:
    """n sequences each running `tokens` tokens (1: decode) up to `context`."""
    return tuple(ScheduledItem(request_id=str(i), token_ids=(7,) * tokens, start_pos=context - tokens,
                               num_tokens=tokens, sample=True, slot_id=i, page_ids=(), params=None, seed=0,
                               sample_index=0) for i in range(n))


def test_split_keeps_whole_sequences_in_order():
    items = _items(5, 10)
    assert split(items, 1) == [items]
    assert split(items, 2) == [items[:3], items[3:]]
    assert split(items, 4) == [items[:2], items[2:4], items[4:]]  # 5 over 4: groups of 2
    assert split(items, 9) == [(it,) for it in items]
    assert split((), 2) == [()]


def _k3_stage(pp_size: int) -> StageCost:
    """Rank 0 of K3 over pp_size stages of TP8 / EP8 (the MI300X recipe's at two: 47 layers, 112 experts each),
    sized by the builder's memory model (the runtime reads them from the rank's weights)."""
    cfg, mapping = preset("k3"), Mapping(tp_size=8, pp_size=pp_size, moe_tp_size=1, moe_ep_size=8)
    w = weight_bytes(cfg, mapping, 0)
    experts = w.pop("routed_experts")
    dense = sum(w.values())
    expert_weights = experts * 2 * 32 / 34  # MXFP4: 2 weights a byte, a scale byte a 32
    share = cfg.num_experts_per_token / cfg.num_experts
    return StageCost(dense_bytes=dense, expert_bytes=experts, num_experts=cfg.num_experts,
                     experts_per_token=cfg.num_experts_per_token,
                     kv_bytes_per_token=kv_bytes_per_token(cfg, mapping, 0),
                     state_bytes_per_seq=2 * kda_state_bytes(cfg, mapping, 0),
                     flop_bytes_per_token=2 * (dense / 2 + share * expert_weights) / RIDGE_FLOP_PER_BYTE)


@pytest.fixture(scope="module")
def k3_stage() -> StageCost:
    return _k3_stage(2)


def test_k3_decode_stays_whole_and_long_prefill_is_cut(k3_stage):
    """Decode at 128 requests of 8K picks most of a stage's experts in either half: cut, each half reads them again,
    so the step stays whole. A prefill step of 8K tokens is bound by its arithmetic, which the two stages then
    overlap."""
    assert micro_batch_count(_items(128, 8192), 2, k3_stage) == 1
    assert micro_batch_count(_items(4, 2048, tokens=2048), 2, k3_stage) == 2
    # a cut by the estimate alone would take it at 64 requests (0.99 of the whole step): the margin keeps it whole
    decode = _items(64, 8192)
    cut = 3 * max(k3_stage.bytes(g) for g in split(decode, 2))
    assert 0.9 < cut / (2 * k3_stage.bytes(decode)) < 1
    assert micro_batch_count(decode, 2, k3_stage) == 1


def test_four_stages_cut_up_to_their_count_and_the_sequences():
    """Over four stages a prefill step is cut in four, or in as many sequences as it has; one sequence is never
    cut. A decode batch of 32 is cut too: a quarter of it picks 13 % of the experts, the whole 44 %."""
    stage = _k3_stage(4)
    prefill = _items(8, 1024, tokens=1024)
    assert micro_batch_count(prefill, 4, stage) == 4
    assert micro_batch_count(prefill[:3], 4, stage) == 3
    assert micro_batch_count(_items(1, 8192, tokens=8192), 4, stage) == 1
    assert micro_batch_count(_items(32, 8192), 4, stage) == 4


def test_stage_cost_reads_the_rank(k3_tiny_ckpt, tmp_path):
    """From a real rank 0 of a two-stage tiny engine: the experts' bytes are the moe.w13 / moe.w2 tensors and their
    scales, the rest dense; the cache terms are its local layers' (one MLA, four KDA)."""
    engine_dir = build_engine(k3_tiny_ckpt, tmp_path / "engine", mapping=Mapping(pp_size=2))
    engine = load_rank(engine_dir, 0, "cpu")
    cache = engine.cache_config(num_pages=4, num_slots=2)
    cost = StageCost.from_engine(engine.weights, engine.config["pretrained_config"], cache)
    nbytes = {n: t.numel() * t.element_size() for n, t in engine.weights.items()}
    experts = sum(b for n, b in nbytes.items() if n.split(".")[-1] in ("w13", "w2", "w13_scale", "w2_scale"))
    assert experts > 0 and cost.expert_bytes == experts
    assert cost.dense_bytes == sum(nbytes.values()) - experts
    assert engine.local_layers("mla") == [3] and len(engine.local_layers("kda")) == 4
    tensors = CacheTensors(cache, torch.device("cpu"))  # the bytes the rank's caches hold, a token and a slot
    kv, state, conv = tensors.mla_kv_all, tensors.kda_state_all, tensors.kda_conv_all
    assert cost.kv_bytes_per_token == kv.numel() * kv.element_size() // (cache.num_pages * cache.page_size)
    per_slot = (state.numel() * state.element_size() + conv.numel() * conv.element_size()) // cache.num_slots
    assert cost.state_bytes_per_seq == 2 * per_slot  # read and written
    assert (cost.num_experts, cost.experts_per_token) == (16, 4)
    # the arithmetic: every dense weight, and of the experts' (four MoE layers of 16 experts of 3 x 64 x 64, two
    # MXFP4 weights a byte) the share 4 of 16 picks
    dense = sum(t.numel() for n, t in engine.weights.items() if n.split(".")[-1] not in ("w13", "w2", "w13_scale",
                                                                                          "w2_scale"))
    assert cost.flop_bytes_per_token == pytest.approx(2 * (dense + 4 / 16 * 4 * 16 * 3 * 64 * 64) / RIDGE_FLOP_PER_BYTE)
    # the tiny model's weights outweigh a decode step's work: whole; 4K tokens of prefill: cut
    assert micro_batch_count(_items(8, 100), 2, cost) == 1
    assert micro_batch_count(_items(2, 2048, tokens=2048), 2, cost) == 2
