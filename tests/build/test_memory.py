"""Memory model: exact figures of K3_SPEC §3/§4, ownership identical to Mapping.shard, and the fit arithmetic."""

import dataclasses
from math import ceil, prod

import pytest

from k3build.config import QuantConfig, preset
from k3build.mapping import Mapping, MappingError
from k3build.memory import (CATEGORIES, GiB, H200_TOTAL_BYTES, MiB, kda_state_bytes, kv_bytes_per_token,
                            plan_memory, weight_bytes)
from k3build.schema import checkpoint_tensors
from k3plugins.kda.reference import in_proj_rows

K3 = preset("k3")
TINY = preset("tiny")
H200 = H200_TOTAL_BYTES
ITEM = {"BF16": 2, "F32": 4, "U8": 1}
TEP16 = Mapping(tp_size=16, moe_ep_size=16)
DEP16 = Mapping(tp_size=16, moe_ep_size=16, attention_dp=True)


def _k3_plan(mapping, seq, **kw):
    kw = {"max_batch_size": 64, "max_num_tokens": 8192, **kw}
    return plan_memory(K3, mapping, gpu_memory_bytes=H200, max_seq_len=seq, **kw)


def test_kda_state_per_request_matches_spec():
    full = Mapping()
    assert kda_state_bytes(K3, full, 0, "fp32") == 449_372_160  # 428.6 MiB/slot
    assert round(kda_state_bytes(K3, full, 0, "fp32") / MiB, 1) == 428.6
    assert round(kda_state_bytes(K3, full, 0, "bf16") / MiB, 1) == 221.6
    assert round(kda_state_bytes(K3, Mapping(tp_size=8), 0, "fp32") / MiB, 1) == 53.6
    # attention-DP does not shard it; EP does not either.
    assert kda_state_bytes(K3, Mapping(tp_size=8, attention_dp=True), 3, "fp32") == 449_372_160
    with pytest.raises(ValueError, match="state_dtype"):
        kda_state_bytes(K3, full, 0, "fp16")


def test_mla_kv_per_token_matches_spec_and_is_not_split_by_tp():
    assert kv_bytes_per_token(K3, Mapping(), 0, 2) == 27_648
    assert kv_bytes_per_token(K3, Mapping(), 0, 1) == 13_824
    assert all(kv_bytes_per_token(K3, TEP16, r, 2) == 27_648 for r in (0, 7, 15))
    pp = Mapping(tp_size=8, pp_size=2)
    stages = [kv_bytes_per_token(K3, pp, r, 2) for r in (0, 8)]
    assert sum(stages) == 27_648 and stages == [11 * 576 * 2, 13 * 576 * 2]


def test_full_k3_weights_match_published_sizes():
    w = weight_bytes(K3, Mapping(), 0)
    per_expert = 2 * (3072 * 1792 + 3072 * 112) + 3584 * 1536 + 3584 * 96
    assert per_expert == 17_547_264  # "≈ 17.55 MB incl. scales"
    assert w["routed_experts"] == 92 * 896 * per_expert
    assert w["embedding"] == w["lm_head"] == 163840 * 7168 * 2
    assert w["dense_mlp"] == 3 * 33792 * 7168 * 2
    assert w["shared_experts"] == 92 * 3 * 6144 * 7168 * 2
    # The published 1,560,936,091,448 B also hold the (out of scope) vision tower: text is ~0.06% less.
    total = sum(w.values())
    assert 0 < 1_560_936_091_448 - total < 0.001 * total


@pytest.mark.parametrize("mapping", [
    Mapping(), Mapping(tp_size=2), Mapping(tp_size=4), Mapping(tp_size=4, moe_tp_size=2), Mapping(pp_size=2),
    Mapping(tp_size=2, pp_size=3), Mapping(tp_size=2, attention_dp=True), Mapping(tp_size=4, moe_tp_size=2, pp_size=2),
], ids=lambda m: f"tp{m.tp_size}-pp{m.pp_size}-ep{m.moe_ep_size}-mtp{m.moe_tp_size}{'-dp' if m.attention_dp else ''}")
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize("kind", ["k3", "kimi_linear"])
def test_weight_bytes_equal_brute_force_over_schema(mapping, fmt, kind):
    # kimi_linear: no latent MoE, no AttnRes, low-rank KDA gate, plain q_proj, no MLA output gate.
    base = TINY if kind == "k3" else dataclasses.replace(
        TINY, routed_expert_hidden_size=None, attn_res_block_size=None, kda_use_full_rank_gate=False,
        mla_use_output_gate=False, q_lora_rank=None)
    cfg = dataclasses.replace(base, quantization=QuantConfig("mxfp4" if fmt == "mxfp4" else "none"))
    tensors = checkpoint_tensors(cfg, "canonical")
    for rank in range(mapping.world_size):
        want = 0
        for name, (shape, dtype) in tensors.items():
            s = mapping.shard(name, rank, cfg)
            unused = ".self_attention_res_" in name and not cfg.snapshots_before(int(name.split(".")[2]))
            if s is not None and not unused:  # the build leaves out an AttnRes with no snapshot yet
                want += prod(shape) * ITEM[dtype] // (s.parts if s.dim is not None else 1)
        # build's layout pads each KDA layer's fused in_proj with zero rows (the rank's share of the heads)
        rows, padded = in_proj_rows(cfg.kda_num_heads // mapping.attn_tp_size, cfg.kda_head_dim,
                                    not cfg.kda_use_full_rank_gate)
        kda_layers = [i for i in mapping.rank_layers(rank, cfg.num_hidden_layers) if cfg.layer_types[i] == "kda"]
        want += len(kda_layers) * (padded - rows) * cfg.hidden_size * 2
        got = weight_bytes(base, mapping, rank, expert_format=fmt)
        assert sum(got.values()) == want, rank
        assert set(got) == set(CATEGORIES)


def test_pp_stages_hold_embedding_first_and_lm_head_last():
    pp = Mapping(tp_size=8, pp_size=2)
    first, last = weight_bytes(K3, pp, 0), weight_bytes(K3, pp, 15)
    assert first["embedding"] > 0 and first["lm_head"] == 0
    assert last["embedding"] == 0 and last["lm_head"] > 0
    assert first["dense_mlp"] > 0 and last["dense_mlp"] == 0  # layer 0 is dense


def test_attention_dp_replicates_and_tp_splits():
    full, dep, tep = weight_bytes(K3, Mapping(), 0), weight_bytes(K3, DEP16, 5), weight_bytes(K3, TEP16, 5)
    for cat in ("embedding", "lm_head", "attention_kda", "attention_mla", "dense_mlp", "shared_experts"):
        assert dep[cat] == full[cat], cat
        assert tep[cat] < full[cat] / 8, cat
    for cat in ("embedding", "lm_head", "dense_mlp", "shared_experts"):
        assert tep[cat] * 16 == full[cat], cat
    assert dep["routed_experts"] * 16 == tep["routed_experts"] * 16 == full["routed_experts"]
    assert dep["router_latent_norms"] == full["router_latent_norms"]
    # under TP the latent up-projection (bf16) is row-parallel: a 1/16 slice a rank; the rest is replicated
    up = sum(K3.is_moe_layer(i) for i in range(K3.num_hidden_layers)) * K3.hidden_size * K3.expert_hidden_size * 2
    assert tep["router_latent_norms"] == full["router_latent_norms"] - up + up // 16


def test_dep16_does_not_fit_h200_and_tep16_does():
    dep = _k3_plan(DEP16, 8192, max_num_tokens=1024)
    w = dep.ranks[0].weight_bytes
    assert abs(w / GiB - 193) / 193 < 0.03, w / GiB  # spec §4.4: "DEP16 ≈193 GiB weights/rank"
    assert not dep.fits and dep.max_concurrent_requests == 0
    assert "weights alone" in dep.reason and "rank 0" in dep.reason
    # DEP8 estimate in the spec: ≈273 GiB/rank.
    dep8 = weight_bytes(K3, Mapping(tp_size=8, attention_dp=True), 0)
    assert abs(sum(dep8.values()) / GiB - 273) / 273 < 0.03
    tep = _k3_plan(TEP16, 131072)
    assert tep.fits and tep.reason == ""
    assert all(r.weight_bytes < 105 * GiB for r in tep.ranks)


@pytest.mark.parametrize("seq", [8192, 131072])
def test_tep16_concurrency_is_the_arithmetic(seq):
    plan = _k3_plan(TEP16, seq)
    r = plan.ranks[0]
    free = H200 - r.weight_bytes - r.reserve_bytes
    slot = 449_372_160 // 16  # 6 of 96 heads
    pages = ceil(seq / 64)
    held = free // (slot + pages * 64 * 27_648)
    assert r.kda_state_bytes_per_request == slot
    assert r.memory_requests == held == plan.memory_requests  # TP ranks share requests
    assert r.reserve["spare"] == slot + 64 * 27_648  # the runtime's spare slot and page
    assert {"overhead", "residual", "exchange"} <= set(r.reserve)
    assert (r.kda_slots, r.kv_pages) == (min(64, (free - pages * 64 * 27_648) // slot),
                                         (free - r.kda_slots * slot) // (64 * 27_648))
    # what the engine runs at once: a slot and a full request's pages each
    assert r.max_concurrent_requests == min(r.kda_slots, r.kv_pages // pages) == plan.max_concurrent_requests
    # Published Hopper context: SGLang's 2x8 H200 runs ~98 requests; 128K requests are ~3.6 GB each.
    assert (100 < held < 200) if seq == 8192 else (5 < held < 15)
    assert plan.max_concurrent_requests == (64 if seq == 8192 else held)  # max_batch_size 64 caps the slots


def test_engine_dtype_scales_weights_activations_and_conv_state():
    """build --dtype fp32 doubles the 16-bit tensors, the activations and the conv state; packed experts and
    F32 tensors stay as they are (k3build/build/layout.py _cast)."""
    kw = dict(gpu_memory_bytes=GiB, max_seq_len=1024, max_batch_size=8, max_num_tokens=256)
    bf, fp = plan_memory(TINY, Mapping(), **kw), plan_memory(TINY, Mapping(), **kw, dtype="fp32")
    sixteen = sum(prod(shape) for name, (shape, dt) in checkpoint_tensors(TINY, "canonical").items()
                  if dt == "BF16" and not name.startswith("model.layers.0.self_attention_res_"))  # 0: unused
    rows, padded = in_proj_rows(TINY.kda_num_heads, TINY.kda_head_dim, not TINY.kda_use_full_rank_gate)
    sixteen += len(TINY.kda_layers) * (padded - rows) * TINY.hidden_size  # in_proj's zero rows
    assert fp.ranks[0].weight_bytes - bf.ranks[0].weight_bytes == sixteen * 2
    assert fp.ranks[0].weights["routed_experts"] == bf.ranks[0].weights["routed_experts"]  # MXFP4 bytes
    conv = len(TINY.kda_layers) * 3 * TINY.kda_num_heads * TINY.kda_head_dim * (TINY.kda_conv_size - 1) * 2
    assert fp.kda_state_bytes_per_request_model - bf.kda_state_bytes_per_request_model == conv
    assert fp.ranks[0].reserve["residual"] == 2 * bf.ranks[0].reserve["residual"]
    assert fp.dtype == "fp32" and fp.ranks[0].free_bytes < bf.ranks[0].free_bytes
    with pytest.raises(ValueError, match="dtype: expected one of fp32, bf16, fp16, got 'fp8'"):
        plan_memory(TINY, Mapping(), **kw, dtype="fp8")


def test_bf16_state_and_fp8_kv_raise_concurrency():
    # the state is a request's larger share at short contexts (28 MB against 226 MB of KV at 8K), the KV at long ones
    short, long = _k3_plan(TEP16, 8192).memory_requests, _k3_plan(TEP16, 32768).memory_requests
    assert _k3_plan(TEP16, 8192, state_dtype="bf16").memory_requests > short
    assert _k3_plan(TEP16, 32768, kv_dtype_bytes=1).memory_requests > long


def test_attention_dp_concurrency_adds_up_over_ranks():
    tp = plan_memory(TINY, Mapping(tp_size=2), gpu_memory_bytes=64 * MiB, max_seq_len=1024, max_batch_size=8,
                     max_num_tokens=256, overhead_bytes=0)
    dp = plan_memory(TINY, Mapping(tp_size=2, attention_dp=True), gpu_memory_bytes=64 * MiB, max_seq_len=1024,
                     max_batch_size=8, max_num_tokens=256, overhead_bytes=0)
    for field in ("max_concurrent_requests", "memory_requests"):
        assert getattr(tp, field) == min(getattr(r, field) for r in tp.ranks)
        assert getattr(dp, field) == sum(getattr(r, field) for r in dp.ranks)


def test_pool_split_keeps_one_full_request_and_stays_in_budget():
    plan = plan_memory(TINY, Mapping(pp_size=2), gpu_memory_bytes=8 * MiB, max_seq_len=4096, max_batch_size=64,
                       max_num_tokens=256, overhead_bytes=0)
    for r in plan.ranks:
        assert 1 <= r.kda_slots <= 64
        assert r.kv_pages >= 4096 // 64
        # the free bytes are past the reserve, which holds the runtime's spare slot and page
        assert r.kda_slots * r.kda_state_bytes_per_request + r.kv_pages * r.page_bytes <= r.free_bytes
        assert r.reserve["spare"] == r.kda_state_bytes_per_request + r.page_bytes
    d = plan.to_dict()
    assert d["ranks"][1]["layers"] == [5, 9] and d["fits"] is True


def test_refusal_when_one_request_does_not_fit():
    plan = plan_memory(TINY, Mapping(), gpu_memory_bytes=6 * MiB, max_seq_len=4096, max_batch_size=8,
                       max_num_tokens=256, overhead_bytes=0)
    r = plan.ranks[0]
    assert r.free_bytes > 0 and not plan.fits and plan.max_concurrent_requests == 0
    assert "one request of 4096 tokens needs" in plan.reason
    plan = plan_memory(TINY, Mapping(), gpu_memory_bytes=4 * MiB, max_seq_len=64, max_batch_size=8,
                       max_num_tokens=256, overhead_bytes=0)
    assert "reserve" in plan.reason and not plan.fits
    r = plan.ranks[0]  # the reserve's parts as they add up (overhead 0 here)
    acts = r.reserve_bytes - r.reserve["spare"]
    assert f"the runtime's spare slot and page {r.reserve['spare'] / MiB:.2f} MiB, activations {acts / MiB:.2f} MiB" \
        in plan.reason, plan.reason


def test_bad_inputs_name_the_field():
    kw = dict(gpu_memory_bytes=GiB, max_seq_len=1024, max_batch_size=8, max_num_tokens=256)
    with pytest.raises(MappingError, match="num_attention_heads"):
        plan_memory(TINY, Mapping(tp_size=8), **kw)
    with pytest.raises(MappingError, match="multiple of 32"):  # 64 / 4 splits MXFP4 scale blocks
        plan_memory(TINY, Mapping(tp_size=4, moe_tp_size=4), **kw)
    with pytest.raises(ValueError, match="max_seq_len"):
        plan_memory(TINY, Mapping(), **{**kw, "max_seq_len": 8192})
    with pytest.raises(ValueError, match="max_batch_size"):
        plan_memory(TINY, Mapping(), **{**kw, "max_batch_size": 0})
    with pytest.raises(ValueError, match="max_num_tokens: 8 is less than max_batch_size 64"):
        plan_memory(TINY, Mapping(), **{**kw, "max_num_tokens": 8, "max_batch_size": 64})
    with pytest.raises(ValueError, match="state_dtype"):
        plan_memory(TINY, Mapping(), **kw, state_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype_bytes"):
        plan_memory(TINY, Mapping(), **kw, kv_dtype_bytes=3)
    with pytest.raises(ValueError, match="expert_format"):
        plan_memory(TINY, Mapping(), **kw, expert_format="nvfp4")


def test_penalty_counts_are_reserved_where_sampling_happens():
    """A row of int32 counts and a bool prompt mask over the vocabulary per slot (max_batch_size of them), on the
    ranks that sample: the last stage's first TP rank, or every rank under attention-DP; nowhere else."""
    row = K3.vocab_size * 5
    by_rank = lambda plan: [r.reserve["penalty_counts"] for r in plan.ranks]  # noqa: E731
    assert by_rank(_k3_plan(TEP16, 8192, max_batch_size=64)) == [64 * row] + [0] * 15
    assert by_rank(_k3_plan(DEP16, 8192, max_batch_size=64)) == [64 * row] * 16
    pp = Mapping(tp_size=8, pp_size=2)
    plan = _k3_plan(pp, 8192, max_batch_size=8)
    assert by_rank(plan) == [8 * row if pp.is_last_stage(r) and pp.tp_rank(r) == 0 else 0 for r in range(16)]
    assert sum(map(bool, by_rank(plan))) == 1 and by_rank(plan)[8] == 8 * row
    r = plan.ranks[8]
    assert r.reserve_bytes == sum(v for k, v in r.reserve.items() if not k.startswith("peak_")) + max(
        v for k, v in r.reserve.items() if k.startswith("peak_"))


def test_unabsorbed_prefill_piece_is_reserved():
    """The un-absorbed MLA prefill's working set is in the MLA peak: one context piece of keys and values (the
    plugin's KEY_PIECE_BYTES in whole pages, no more than the longest request), its latents, the fp32 log-sum-exp
    of the step's tokens, and their fp32 running output where a context takes several pieces."""
    from k3build.memory import UNABSORBED_PIECE_BYTES, activation_reserve
    kw = dict(max_num_tokens=8192, max_batch_size=64)
    for mapping, heads in ((Mapping(), 96), (TEP16, 6)):
        base = activation_reserve(K3, mapping, 0, **kw)["peak_mla"]
        per_key = heads * (128 + 128) * 2
        keys = UNABSORBED_PIECE_BYTES // per_key // 64 * 64
        extra = keys * (per_key + 576 * 2) + 8192 * heads * 129 * 4
        assert activation_reserve(K3, mapping, 0, max_seq_len=1 << 20, **kw)["peak_mla"] == base + extra
        # a short longest request caps the piece at its pages, and its one piece needs no running output
        short = activation_reserve(K3, mapping, 0, max_seq_len=100, **kw)["peak_mla"]
        assert short == base + 128 * (per_key + 576 * 2) + 8192 * heads * 4
    pytest.importorskip("triton")
    from k3plugins.mla import prefill
    assert UNABSORBED_PIECE_BYTES == prefill.KEY_PIECE_BYTES
