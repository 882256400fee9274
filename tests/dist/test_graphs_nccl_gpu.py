"""A multi-rank engine's decode steps captured as CUDA graphs with their NCCL collectives inside, pytest -m gpu.

One GPU holds one NCCL rank (NCCL refuses two ranks on a device), so this runs rank 0 of a TP2 engine on a
one-process NCCL group: every AllReduce / AllGather node of its graph is a real NCCL call, recorded into the graphs
at capture, and each replay must give the logits of the same step run eagerly. (Over one rank the collectives
return their input, so the logits are rank 0's partial sums, not the model's: the comparison is replay against
eager of the same program.) Whether all ranks of a real job replay in step is graph_blocker's rule
(tests/runtime/test_graph_blocker.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or not dist.is_nccl_available():
    pytest.skip("needs a CUDA GPU and NCCL", allow_module_level=True)

from engines import build_engine  # noqa: E402
from k3build.mapping import Mapping  # noqa: E402
from k3runtime.dist.comm import DistCommunicator  # noqa: E402
from k3runtime.loader import load_rank  # noqa: E402
from k3runtime.rank_runner import RankRunner, Step  # noqa: E402
from k3runtime.sampling_params import SamplingParams  # noqa: E402
from k3runtime.scheduler import ScheduledItem  # noqa: E402

PAGES, SLOTS = 8, 4
ROWS = [(5, 0, 1, [0]), (6, 1, 9, [1]), (7, 2, 70, [2, 3]), (8, 3, 3, [4])]  # (token, slot, context, pages)


@pytest.fixture
def nccl_group(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield
    dist.destroy_process_group()


def test_tp2_rank_replays_its_nccl_collectives(k3_short_ckpt, tmp_path, nccl_group):
    engine_dir = build_engine(k3_short_ckpt, tmp_path / "tp2", mapping=Mapping(tp_size=2), target="sm90",
                              dtype="bf16", kv_dtype="bf16")
    engine = load_rank(engine_dir, 0, "cuda")
    assert engine.world_size == 2 and any(n.op_type == "AllReduce" for n in engine.graph.node)
    ranks = {"0": {**engine.config["ranks"]["0"], "tp_group": [0], "moe_group": [0]}}  # the one-process group
    comm = DistCommunicator(ranks, 0, 1, torch.device("cuda"))
    calls = []
    for name in ("all_reduce", "all_gather"):
        real = getattr(comm, name)
        setattr(comm, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))

    runner = RankRunner(engine, engine.cache_config(num_pages=PAGES + 1, num_slots=SLOTS + 1), comm,
                        spare=(PAGES, SLOTS), cuda_graphs=True)
    assert runner.graphs_off is None and runner.graphs is not None
    assert runner.graphs.bucket(len(ROWS)) == len(ROWS)  # no padding row: replay and eager run the same shapes
    assert "all_reduce" in calls  # NCCL ran at capture (warm-up and recording)

    cache = runner.cache
    state = (cache.kda_state_all, cache.kda_conv_all, cache.mla_kv_all)
    for t in state:
        t.normal_(0, 0.1)
    saved = [t.clone() for t in state]
    calls.clear()
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda rows, *a, **kw: replays.append(len(rows)) or run(rows, *a, **kw)
    # a pure decode step through the runner: replayed, and rank 0 waits for it with the collective timeout
    step = Step(tuple(ScheduledItem(request_id=str(i), token_ids=(tok,), start_pos=ctx - 1, num_tokens=1, sample=True,
                                    slot_id=slot, page_ids=tuple(pages), params=None, seed=0, sample_index=0)
                      for i, (tok, slot, ctx, pages) in enumerate(ROWS)))
    replayed = runner.run(step).clone()
    assert replays == [len(ROWS)]
    assert calls == []  # a replay runs no Python collective: NCCL's calls are inside the graph
    for t, s in zip(state, saved):
        t.copy_(s)
    eager = runner.executor.run(runner.batch(step.items))["logits"]  # the same step, not replayed
    assert calls  # the eager step made them itself
    assert torch.isfinite(replayed).all()
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)

    # async scheduling's step on rank 0: the ids fed from the last step's samples, the replay not awaited, the
    # samples broadcast over NCCL to the other ranks: all queued without a host sync
    from k3runtime.llm_engine import sample_step

    for t, s in zip(state, saved):
        t.copy_(s)
    greedy = SamplingParams(temperature=0)
    fed = torch.tensor([8, 7, 6, 5], device="cuda")  # the last step's samples
    step = Step(tuple(ScheduledItem(request_id=str(i), token_ids=(-1,), start_pos=ctx - 1, num_tokens=1, sample=True,
                                    slot_id=slot, page_ids=tuple(pages), params=greedy, seed=0, sample_index=0)
                      for i, (tok, slot, ctx, pages) in enumerate(ROWS)), feed=tuple((i, 3 - i) for i in range(4)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = comm.share_tokens(sample_step(step, runner.run(step, fed, wait=False)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert replays[-1] == len(ROWS) and runner.graphs.cols[0, :4].tolist() == [5, 6, 7, 8]  # ROWS' own tokens
    assert tokens.tolist() == replayed.argmax(-1).tolist()  # the same inputs and state as the replay above


def test_attention_dp_rank_replays_the_bucket_the_driver_picks(k3_short_ckpt, tmp_path, nccl_group):
    """Rank 0 of an attention-DP engine (TP2 attention as two DP ranks, experts over EP2) on the one-process NCCL
    group, its expert exchange (fixed-capacity all-gather / reduce-scatter) real NCCL calls inside the graphs. It
    replays only when the step carries the driver's bucket (Step.graph_bucket): in a larger bucket than its own
    batch needs, with the eager step's logits, and as an idle rank with padding rows only."""
    from dataclasses import replace

    from k3plugins.ep import NcclExchange
    from k3runtime.engine_options import EngineOptions
    from k3runtime.llm_engine import dummy_step

    engine_dir = build_engine(k3_short_ckpt, tmp_path / "dp2", mapping=Mapping(tp_size=2, moe_ep_size=2,
                                                                             attention_dp=True),
                              target="sm90", dtype="bf16", kv_dtype="bf16")
    engine = load_rank(engine_dir, 0, "cuda")
    assert any(n.op_type == "EPGather" for n in engine.graph.node)
    ranks = {"0": {**engine.config["ranks"]["0"], "tp_group": [0], "moe_group": [0]}}
    comm = DistCommunicator(ranks, 0, 1, torch.device("cuda"))
    comm.use_exchange(NcclExchange(dist.group.WORLD, upcast=False))  # the 'moe' group of one rank
    runner = RankRunner(engine, engine.cache_config(num_pages=PAGES + 1, num_slots=SLOTS + 1), comm,
                        spare=(PAGES, SLOTS), cuda_graphs=True)
    assert runner.graphs_off is None and runner.graphs is not None and runner.attention_dp
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda rows, *a, **kw: replays.append((len(rows), kw.get("bucket"))) or run(rows, *a, **kw)

    state = (runner.cache.kda_state_all, runner.cache.kda_conv_all, runner.cache.mla_kv_all)
    for t in state:
        t.normal_(0, 0.1)
    saved = [t.clone() for t in state]
    step = Step(tuple(ScheduledItem(request_id=str(i), token_ids=(tok,), start_pos=ctx - 1, num_tokens=1, sample=True,
                                    slot_id=slot, page_ids=tuple(pages), params=None, seed=0, sample_index=0)
                      for i, (tok, slot, ctx, pages) in enumerate(ROWS[:3])))
    eager = runner.run(step).clone()  # no bucket from the driver: eager, though a pure decode step
    eager_state = [t.clone() for t in state]
    assert replays == []
    for bucket in (4, 8):
        for t, s in zip(state, saved):
            t.copy_(s)
        replayed = runner.run(replace(step, graph_bucket=bucket)).clone()
        assert replays[-1] == (3, bucket)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        for t, want, n in zip(state, eager_state, (SLOTS, SLOTS, PAGES)):  # padding rows write the spare slot / page
            torch.testing.assert_close(t[:, :n], want[:, :n], rtol=1e-5, atol=1e-5)
    idle = replace(dummy_step(engine.config, EngineOptions(num_pages=PAGES, num_slots=SLOTS)), graph_bucket=4)
    assert runner.run(idle).shape == (0, engine.facts.vocab_size) and replays[-1] == (0, 4)
