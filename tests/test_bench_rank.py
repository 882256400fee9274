"""tools/bench_rank.py on the CPU with the tiny preset: the builder's graph and layout over synthetic weights run
through the executor (the same path the H200 benchmark takes), and every record has its fields. No timing is
asserted: figures belong in BENCHMARKS.md."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).parents[1] / "tools" / "bench_rank.py"


def test_bench_rank_runs_a_tiny_tp2_rank():
    proc = subprocess.run([sys.executable, str(TOOL), "--preset", "tiny", "--tp", "2", "--device", "cpu",
                           "--target", "cpu", "--batches", "1,3", "--context", "100", "--reps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["bench"] for r in recs] == ["rank_env", "rank_weights", "rank_decode", "rank_decode"]
    assert recs[0]["mapping"]["tp_size"] == 2 and recs[0]["routing"] == "uniform"
    one, three = recs[2], recs[3]
    assert (one["batch"], three["batch"]) == (1, 3) and one["step_ms"] > 0
    # KV and state floors scale with the batch; 3 tokens touch more experts than 1
    assert three["kv_bytes"] == 3 * one["kv_bytes"] and three["state_bytes"] == 3 * one["state_bytes"]
    assert three["experts_touched_share"] > one["experts_touched_share"]


def test_ab_switches_flip_and_undo():
    """Each --ab switch changes what the next capture runs and its undo restores it; the unfused residual (the adds
    as separate launches) and the unfused norm (the RMSNorms after AttnRes as separate launches) give the fused
    graph's logits exactly, from the same caches; the separate router (MoEInProj as a Linear and a Router) within
    fp32 rounding."""
    import torch

    sys.path.insert(0, str(TOOL.parent))
    sys.path.insert(0, str(TOOL.parent / "bench"))
    import bench_rank as br
    from k3build.config import preset
    from k3build.mapping import Mapping
    from k3plugins.attn_res import triton as ar
    from k3plugins.kda import fla as kda
    from k3plugins.mla import triton as mla
    from k3plugins.moe import triton as moe
    from k3plugins.router import triton as router
    from k3runtime.executor import Executor, StepBatch
    from k3runtime.kv_cache import CacheTensors

    engine = br.make_rank(preset("tiny"), Mapping(tp_size=1), 0, target="cpu", device=torch.device("cpu"),
                          max_batch=2, max_seq_len=128)
    ids = torch.tensor([3, 5])
    batch = StepBatch(input_ids=ids, cu_seqlens=torch.arange(3), slot_ids=torch.tensor([0, 1]),
                      context_lens=torch.tensor([1, 1]), page_table=torch.tensor([[0], [1]]),
                      logits_indices=torch.arange(2))

    def fresh():
        cache = CacheTensors(engine.cache_config(num_pages=8, num_slots=3), torch.device("cpu"))
        for t in [*cache.kda_state, *cache.kda_conv]:
            t.zero_()
        return Executor(engine, cache)

    fused = fresh().run(batch)["logits"]
    for name in ("unfused-residual", "unfused-norm"):
        ex = fresh()
        fns = [b.fn for b in ex.nodes]
        undo = br.AB_SWITCHES[name][1](ex)
        assert [b.fn for b in ex.nodes] != fns, name  # the fused nodes now run a wrapper
        assert torch.equal(ex.run(batch)["logits"], fused), name
        undo()
        assert [b.fn for b in ex.nodes] == fns, name
    ex = fresh()
    for flip in (br.AB_SWITCHES["unfused-residual"][1], br.AB_SWITCHES["unfused-norm"][1]):
        flip(ex)  # both at once: the wrappers compose
    assert torch.equal(ex.run(batch)["logits"], fused)
    ex = fresh()
    fns = [b.fn for b in ex.nodes]
    undo = br.AB_SWITCHES["separate-router"][1](ex)
    moe_layers = sum(preset("tiny").is_moe_layer(i) for i in range(preset("tiny").num_hidden_layers))
    assert sum(b.fn is not f for b, f in zip(ex.nodes, fns)) == moe_layers
    # the engine's Linear and Router on the stacked weight's two row blocks: the same sums, in another GEMM
    torch.testing.assert_close(ex.run(batch)["logits"], fused, rtol=1e-4, atol=1e-4)
    undo()
    state = lambda: (dict(moe.TACTICS), router.blocks_for, ar.use_split, ar.NORM_MIX_WARPS,  # noqa: E731
                     router.SELECT_WARPS, router.CAST_COLUMNS, router.CAST_SPLIT_MAX_TOKENS,
                     kda.F_B_FUSED_MAX_PROGRAMS, moe.SORT_COLS, mla.SPLIT_WAVES, [b.fn for b in ex.nodes])
    before = state()
    for name, (_, flip) in br.AB_SWITCHES.items():
        if not name.startswith("unfused-"):
            undo = flip(ex)
            assert name == "pdl" or state() != before, name  # the switch changes something (pdl: the environment)
            undo()
    assert state() == before


def test_replay_timeline_counts_overlapping_kernels_once(monkeypatch):
    """--timeline's busy time is the union of the launches' intervals (the MoE down kernel starts inside its gate/up
    kernel), the idle time the rest of the span, and the longest gaps name the launches on either side."""
    from types import SimpleNamespace

    sys.path.insert(0, str(TOOL.parent))
    sys.path.insert(0, str(TOOL.parent / "bench"))
    import bench_rank as br
    import common

    def launch(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))
    events = [launch("norm", 0.0, 10.0), launch("gate_up", 11.0, 20.0), launch("inner", 12.0, 14.0),
              launch("down", 15.0, 30.0), launch("combine", 30.0, 31.0), launch("gemm", 40.0, 41.0)]
    monkeypatch.setattr(common, "cuda_events", lambda fn: events)
    t = br.replay_timeline(None, layer_window=(1, 4), longest=2)
    assert (t["span_us"], t["busy_us"], t["idle_us"], t["kernels_us"]) == (41.0, 31.0, 10.0, 38.0)
    assert t["longest_gaps"] == [[9.0, "combine", "gemm", 31.0], [1.0, "norm", "gate_up", 10.0]]
    assert t["window"] == [["gate_up", 0.0, 9.0], ["inner", 1.0, 2.0], ["down", 4.0, 15.0]]


def test_bench_rank_refuses_a_rank_larger_than_memory():
    """K3's TEP16 rank (96.8 GiB of weights) on this machine's CPU: refused at once, naming the sizes, before any
    weight is made (the same check stops it on an 80 GB H100)."""
    import pytest
    import torch

    sys.path.insert(0, str(TOOL.parent))
    import bench_rank as br
    free = br.free_bytes(torch.device("cpu"))
    if free is None or free > 96 * 2**30:
        pytest.skip("this host has room for the rank's weights")
    proc = subprocess.run([sys.executable, str(TOOL), "--preset", "k3", "--tp", "16", "--device", "cpu",
                           "--target", "cpu", "--batches", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "holds 96.77 GiB of weights; cpu has" in proc.stderr and "GiB free" in proc.stderr, proc.stderr[-2000:]
