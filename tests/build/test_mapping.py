"""`Mapping`: who owns what, stated with literal expectations (the converter tests check it against itself)."""

import pytest

from k3build.config import preset
from k3build.mapping import WHOLE, Mapping, MappingError, Shard

K3 = preset("k3")
TINY = preset("tiny")


def test_experts_are_contiguous_blocks_of_e_over_ep():
    m = Mapping(tp_size=16, moe_ep_size=16)
    assert [m.local_experts(r, 896) for r in (0, 1, 15)] == [range(0, 56), range(56, 112), range(840, 896)]
    name = "model.layers.5.block_sparse_moe.experts.{}.w1.weight_packed"
    owners = [[r for r in range(16) if m.shard(name.format(e), r, K3) is not None] for e in (0, 55, 56, 895)]
    assert owners == [[0], [0], [1], [15]]
    assert m.shard(name.format(56), 1, K3).parts == 1  # EP only: the whole expert


def test_moe_tp_splits_w1_w3_rows_and_w2_columns():
    m = Mapping(tp_size=4, moe_tp_size=2)  # EP2 x MoE-TP2: ranks 0,1 hold experts 0..7 of the tiny model
    assert m.moe_ep_size == 2 and [m.local_experts(r, 16) for r in range(4)] == [range(0, 8)] * 2 + [range(8, 16)] * 2
    x = "model.layers.1.block_sparse_moe.experts.3."
    assert m.shard(x + "w1.weight_packed", 1, TINY) == Shard(0, 2, 1)
    assert m.shard(x + "w3.weight_scale", 0, TINY) == Shard(0, 2, 0)
    assert m.shard(x + "w2.weight_packed", 1, TINY) == Shard(1, 2, 1)
    assert m.shard(x + "w2.weight_packed", 2, TINY) is None


def test_tp_splits_heads_and_vocab_attention_dp_replicates():
    tp, dp = Mapping(tp_size=2), Mapping(tp_size=2, attention_dp=True)
    q = "model.layers.1.self_attn.q_proj.weight"
    o = "model.layers.1.self_attn.o_proj.weight"
    assert [tp.shard(q, r, TINY) for r in (0, 1)] == [Shard(0, 2, 0), Shard(0, 2, 1)]
    assert tp.shard(o, 1, TINY) == Shard(1, 2, 1)
    assert tp.shard("lm_head.weight", 1, TINY) == Shard(0, 2, 1)
    assert tp.shard("model.layers.0.mlp.down_proj.weight", 0, TINY) == Shard(1, 2, 0)
    for name in (q, o, "lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"):
        assert dp.shard(name, 1, TINY).parts == 1, name  # replicated under attention-DP
    # ... while experts stay EP under attention-DP.
    e = "model.layers.1.block_sparse_moe.experts.{}.w2.weight_packed"
    assert dp.shard(e.format(0), 1, TINY) is None and dp.shard(e.format(8), 1, TINY).parts == 1
    # Router, latent projections, norms and AttnRes params are whole on every rank.
    for leaf in ("block_sparse_moe.gate.weight", "block_sparse_moe.routed_expert_down_proj.weight",
                 "self_attention_res_proj.weight", "input_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight"):
        assert tp.shard(f"model.layers.3.{leaf}", 1, TINY) == WHOLE, leaf


def test_pp_owns_contiguous_layers_embedding_first_lm_head_last():
    m = Mapping(tp_size=2, pp_size=3)
    assert [m.rank_layers(r, 9) for r in (0, 1, 2, 3, 4, 5)] == [range(0, 3)] * 2 + [range(3, 6)] * 2 + [range(6, 9)] * 2
    assert Mapping(pp_size=2).stage_layers(0, 93) == range(0, 47) and Mapping(pp_size=2).stage_layers(1, 93) == range(47, 93)
    assert m.shard("model.layers.4.input_layernorm.weight", 0, TINY) is None
    assert m.shard("model.layers.4.input_layernorm.weight", 3, TINY) == WHOLE
    assert [r for r in range(6) if m.shard("model.embed_tokens.weight", r, TINY)] == [0, 1]
    assert [r for r in range(6) if m.shard("lm_head.weight", r, TINY)] == [4, 5]
    assert [r for r in range(6) if m.shard("model.norm.weight", r, TINY)] == [4, 5]
    assert m.tp_group(3) == [2, 3] and m.pp_group(3) == [1, 3, 5]


@pytest.mark.parametrize("kw, words", [
    (dict(tp_size=0), "mapping.tp_size"),
    (dict(tp_size=4, moe_tp_size=3), "moe_tp_size: 3 does not divide tp_size=4"),
    (dict(tp_size=4, moe_ep_size=3), "must equal tp_size"),
    (dict(tp_size=2, moe_tp_size=2, attention_dp=True), "attention-DP off"),
    (dict(tp_size=2, pp_size=2, attention_dp=True), "attention-DP with pipeline parallelism"),  # refused at load
    # a hand-edited config.json: range() would fail on the float, and "false" is a true string
    (dict(moe_ep_size=1.0), r"mapping.moe_ep_size: expected a positive int, got 1.0"),
    (dict(tp_size=True), r"mapping.tp_size: expected a positive int, got True"),
    (dict(attention_dp="false"), r"mapping.attention_dp: expected true or false, got 'false'"),
])
def test_bad_mapping(kw, words):
    with pytest.raises(MappingError, match=words):
        Mapping(**kw)


def test_validate_names_what_does_not_divide():
    with pytest.raises(MappingError, match=r"num_attention_heads \(MLA\)=96 is not divisible by attention TP=5"):
        Mapping(tp_size=5).validate(K3)
    with pytest.raises(MappingError, match="num_experts=16 is not divisible by moe_ep_size=3"):
        Mapping(tp_size=3, attention_dp=True).validate(TINY)
    with pytest.raises(MappingError, match="pp_size=10 exceeds num_hidden_layers=9"):
        Mapping(pp_size=10).validate(TINY)
    Mapping(tp_size=16, moe_ep_size=16, attention_dp=True).validate(K3)  # DEP16 divides (it just does not fit)
    with pytest.raises(MappingError, match="mapping.world_size: 3"):
        Mapping.from_dict({"tp_size": 2, "world_size": 3})
    with pytest.raises(MappingError, match="mapping.ep: unknown field"):
        Mapping.from_dict({"tp_size": 2, "ep": 2})
