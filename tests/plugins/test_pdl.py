"""Programmatic dependent launch: every decode-step kernel that takes PDL waits for the previous grid before it
touches memory (compiled for sm_90 on the CPU, PTX read back), and PDL is off where it cannot run."""
import re

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import test_rocm_compile as specs  # noqa: E402
from k3plugins.pdl import pdl  # noqa: E402

# the MoE down kernel with AWAIT waits for its own expert's count instead of the whole previous grid (below)
PDL_KERNELS = sorted(n for n, (fn, _, c) in specs.SPECS.items() if "PDL" in fn.arg_names and not c.get("AWAIT"))
MEMORY_OP = re.compile(r"^\s*(?:@%p\d+\s+)?(?:ld\.global|st\.global|cp\.async|atom\.|red\.)", re.M)


def _ptx(name: str, **consts) -> str:
    fn, ptrs, base = specs.SPECS[name]
    specs.SPECS[name] = (fn, ptrs, {**base, **consts})
    try:
        return triton.compile(specs._source(name, "sm90"), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 2, "launch_pdl": True}).asm["ptx"]
    finally:
        specs.SPECS[name] = (fn, ptrs, base)


def test_the_decode_step_kernels_take_pdl():
    assert {"rms_norm", "attn_res_partials", "attn_res_mix", "router_logits", "router_topk", "mlp_glu",
            "moe_sort_pairs", "moe_gate_up_tiled", "moe_down_tiled", "moe_combine", "kda_conv_update",
            "kda_recurrent_vsplit", "kda_gated_norm", "mla_decode", "mla_merge"} <= set(PDL_KERNELS)


@pytest.mark.parametrize("name", PDL_KERNELS)
def test_pdl_kernel_waits_before_touching_memory(name):
    ptx = _ptx(name, PDL=True)
    wait = ptx.find("griddepcontrol.wait")
    first_memory_op = MEMORY_OP.search(ptx)
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx, name
    assert first_memory_op is None or wait < first_memory_op.start(), (name, first_memory_op.group(0))
    assert ptx.find("griddepcontrol.launch_dependents") > wait, name  # dependents only once this grid may run


def test_pdl_is_off_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("K3_PDL", "1")
    assert pdl(torch.zeros(1)) == {"PDL": False}


def test_overlapped_moe_down_awaits_its_expert_before_reading_h():
    """Launched with PDL while the gate/up kernel runs (MoETactic.overlap), the down kernel must not wait for that
    whole grid (the point), and must acquire its expert's count before its pipelined loads (h among them) start;
    the gate/up kernel lets it launch early and releases its count after its stores."""
    ptx = _ptx("moe_down_await")
    acquire = ptx.find("ld.global.gpu.acquire")
    assert "griddepcontrol.wait" not in ptx and acquire >= 0
    assert acquire < ptx.find("cp.async"), "a pipelined load starts before the expert's count is acquired"
    gate_up = _ptx("moe_gate_up_signal", EARLY=True)
    assert gate_up.find("griddepcontrol.launch_dependents") >= 0
    release = re.search(r"atom\.(?:\w+\.)*release\.(?:\w+\.)*add|atom\.(?:\w+\.)*add.*release", gate_up)
    assert release, "no release of the expert's count"
    stored = gate_up.rfind("st.global", 0, release.start())
    assert 0 < stored < gate_up.rfind("bar.sync", 0, release.start()), "h stores not fenced off by a barrier"


def test_prefetching_gate_up_asks_l2_before_waiting_for_the_sort():
    """MoETactic.prefetch: the gate/up kernel, launched with PDL behind the sort, prefetches its first K steps of
    weights and scales (2 steps x gate, up x words, scales) before griddepcontrol.wait and touches nothing else
    before it; the sort lets it in at its start (launch_dependents before its first memory op), without waiting."""
    for first_programs in (0, 264):  # every program, or the grid's first 264 only (MoETactic.prefetch_per_sm)
        ptx = _ptx("moe_gate_up_prefetch", PDL=True, PREFETCH_PROGRAMS=first_programs)
        wait = ptx.find("griddepcontrol.wait")
        prefetches = [m.start() for m in re.finditer(r"prefetch\.global\.L2", ptx)]
        first_memory_op = MEMORY_OP.search(ptx)
        assert wait > 0 and len(prefetches) >= 8 and max(prefetches) < wait
        assert first_memory_op is None or wait < first_memory_op.start(), first_memory_op.group(0)
    plain = _ptx("moe_gate_up_prefetch", PDL=True, PREFETCH=0)
    assert "prefetch.global" not in plain
    sort = _ptx("moe_sort_pairs_early")
    trigger = sort.find("griddepcontrol.launch_dependents")
    assert "griddepcontrol.wait" not in sort and 0 < trigger < MEMORY_OP.search(sort).start()
