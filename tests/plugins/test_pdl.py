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

PDL_KERNELS = sorted(n for n, (fn, _, _) in specs.SPECS.items() if "PDL" in fn.arg_names)
MEMORY_OP = re.compile(r"^\s*(?:@%p\d+\s+)?(?:ld\.global|st\.global|cp\.async|atom\.|red\.)", re.M)


def test_the_decode_step_kernels_take_pdl():
    assert {"rms_norm", "attn_res_partials", "attn_res_mix", "router_logits", "router_topk", "mlp_glu",
            "moe_sort_pairs", "moe_gate_up_tiled", "moe_down_tiled", "moe_combine", "kda_conv_update",
            "kda_recurrent_vsplit", "kda_gated_norm", "mla_decode", "mla_merge"} <= set(PDL_KERNELS)


@pytest.mark.parametrize("name", PDL_KERNELS)
def test_pdl_kernel_waits_before_touching_memory(name):
    fn, ptrs, consts = specs.SPECS[name]
    specs.SPECS[name] = (fn, ptrs, {**consts, "PDL": True})
    try:
        ptx = triton.compile(specs._source(name, "sm90"), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "num_stages": 2, "launch_pdl": True}).asm["ptx"]
    finally:
        specs.SPECS[name] = (fn, ptrs, consts)
    wait = ptx.find("griddepcontrol.wait")
    first_memory_op = MEMORY_OP.search(ptx)
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx, name
    assert first_memory_op is None or wait < first_memory_op.start(), (name, first_memory_op.group(0))
    assert ptx.find("griddepcontrol.launch_dependents") > wait, name  # dependents only once this grid may run


def test_pdl_is_off_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("K3_PDL", "1")
    assert pdl(torch.zeros(1)) == {"PDL": False}
