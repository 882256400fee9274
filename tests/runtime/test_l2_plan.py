"""Where the executor asks L2 for weights (runtime/l2_plan.py), planned over the real tiny engine's graph. The
tiny weights are kilobytes, so the thresholds are scaled down with them; the GPU run is in
tests/model/test_gpu_engine.py."""

from k3runtime.executor import Executor
from k3runtime.kv_cache import CacheTensors
from k3runtime.l2_plan import prefetch_plan
from k3runtime.loader import load_rank
from k3runtime.rank_runner import cache_config

HEAVY = 4096  # bytes: the tiny router's gate (16 x 128 bf16) is just heavy, AttnRes's vectors are light


def _executor(engine_dir):
    engine = load_rank(engine_dir)
    return Executor(engine, CacheTensors(cache_config(engine, num_pages=4, num_slots=2), "cpu"))


def test_windows_between_heavy_nodes_ask_for_the_next_weights(k3_tiny_engine):
    ex = _executor(k3_tiny_engine)
    assert ex.l2_plan == {}  # nothing on the CPU
    nodes, w = ex.nodes, ex.weights
    budget = 40_000
    plan = prefetch_plan(nodes, w, heavy_bytes=HEAVY, budget=budget)
    assert plan
    ops = [n.op for n in nodes]
    for start, asks in plan.items():
        # the window opens right after a heavy node and runs a kernel before the heavy node it prefetches for
        before = nodes[start - 1]
        assert before.kind in ("kda", "mla") or sum(w[i].nbytes for i in before.inputs if w.get(i) is not None) \
            >= HEAVY, before.name
        end = next(j for j in range(start, len(nodes)) if any(name in nodes[j].inputs for name, _ in asks))
        assert any(op in ("AttnRes", "RMSNorm") for op in ops[start:end]), ops[start:end]
        assert sum(n for _, n in asks) <= budget
        assert all(w[name].is_floating_point() and 0 < n <= w[name].nbytes for name, n in asks)
    # every KDA and MLA node after the first is reached: its in_proj, the first weight it reads
    attention = [i for i, n in enumerate(nodes) if n.kind in ("kda", "mla")]
    asked = {name for asks in plan.values() for name, _ in asks}
    for i in attention:
        in_proj = nodes[i].name + ".in_proj"
        assert in_proj in asked, in_proj
    # the MoE block: the router's gate first, then the in_proj GEMM with what is left of the budget
    router = next(i for i, n in enumerate(nodes) if n.op == "Router")
    gate, in_proj = nodes[router].inputs[1], nodes[router + 1].inputs[1]
    window = max(s for s in plan if s < router)
    assert [name for name, _ in plan[window]] == [gate, in_proj]
    assert plan[window][0][1] == w[gate].nbytes and sum(n for _, n in plan[window]) == budget
    # the MoE's output projection follows the experts with no kernel between them: no window, no prefetch
    for i, n in enumerate(nodes):
        if n.op == "MoEOutProj":
            assert not any(start <= i and any(name in n.inputs for name, _ in plan[start]) for start in plan)


def test_no_budget_no_plan(k3_tiny_engine, monkeypatch):
    ex = _executor(k3_tiny_engine)
    assert prefetch_plan(ex.nodes, ex.weights, heavy_bytes=HEAVY, budget=0) == {}
    monkeypatch.setenv("K3_L2_PREFETCH_MB", "0")
    assert prefetch_plan(ex.nodes, ex.weights, heavy_bytes=HEAVY) == {}
