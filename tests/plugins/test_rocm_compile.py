"""Compile every Triton kernel of k3plugins for AMD gfx942 (MI300X) with Triton's own HIP backend, and for
sm90 with its NVIDIA backend: compile only, no GPU needed (Triton ships the LLVM, ld.lld and ptxas it uses).

A kernel that does not compile fails its case with the compiler's message, naming the kernel and target.
"""
import inspect

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from k3plugins.attn_res import triton as attn_res  # noqa: E402
from k3plugins.kda import triton_decode as kd  # noqa: E402
from k3plugins.mla import prefill as mla_prefill  # noqa: E402
from k3plugins.mla import triton as mla  # noqa: E402
from k3plugins.mlp import triton as mlp  # noqa: E402
from k3plugins.moe import triton_kernels as moe  # noqa: E402
from k3plugins.moe_out import triton as moe_out  # noqa: E402
from k3plugins.norm import triton as norm  # noqa: E402
from k3plugins.router import triton as router  # noqa: E402
from k3plugins.sample import top_p  # noqa: E402
from k3plugins.sample import triton as sample  # noqa: E402

# (kernel, pointer element types by arg name, constexprs); other args: *_ptr -> *fp32, ints i32, listed floats fp32
_MOE = dict(TOP_K=16, ACT=0, BM=16, BN=64, BK=128, STRIDED=False, F8=None)
SPECS = {
    "moe_gate_up_dot_scaled": (moe.moe_gate_up_kernel, dict(z_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", h_ptr="*bf16",
                                                            sorted_ptr="*i32", offs_ptr="*i32"),
                               dict(_MOE, W4=False)),
    "moe_gate_up_w4": (moe.moe_gate_up_kernel, dict(z_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", h_ptr="*bf16",
                                                    sorted_ptr="*i32", offs_ptr="*i32"),
                       dict(_MOE, W4=True)),
    "moe_down_dot_scaled": (moe.moe_down_kernel, dict(h_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", sorted_ptr="*i32",
                                                      offs_ptr="*i32"),
                            dict(BM=16, BN=64, BK=128, W4=False, STRIDED=False)),
    "moe_down_w4": (moe.moe_down_kernel, dict(h_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", sorted_ptr="*i32",
                                              offs_ptr="*i32"),
                    dict(BM=16, BN=64, BK=128, W4=True, STRIDED=False)),
    "moe_gate_up_strided": (moe.moe_gate_up_kernel, dict(z_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", h_ptr="*bf16",
                                                         sorted_ptr="*i32", offs_ptr="*i32"),
                            dict(_MOE, BK=256, W4=True, STRIDED=True)),
    "moe_down_strided": (moe.moe_down_kernel, dict(h_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", sorted_ptr="*i32",
                                                   offs_ptr="*i32"), dict(BM=16, BN=64, BK=256, W4=True, STRIDED=True)),
    "moe_gate_up_paired": (moe.moe_gate_up_kernel, dict(z_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", h_ptr="*bf16",
                                                        sorted_ptr="*i32", offs_ptr="*i32"),
                           dict(_MOE, BK=256, W4=True, STRIDED=2)),
    "moe_down_paired": (moe.moe_down_kernel, dict(h_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", sorted_ptr="*i32",
                                                  offs_ptr="*i32"), dict(BM=16, BN=64, BK=256, W4=True, STRIDED=2)),
    "moe_gate_up_tiled": (moe.moe_gate_up_kernel, dict(z_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", h_ptr="*bf16",
                                                       sorted_ptr="*i32", offs_ptr="*i32"),
                          dict(_MOE, BK=256, W4=True, STRIDED=2, TILED=True)),
    "moe_down_tiled": (moe.moe_down_kernel, dict(h_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", sorted_ptr="*i32",
                                                 offs_ptr="*i32"), dict(BM=16, BN=64, BK=256, W4=True, STRIDED=2,
                                                                        TILED=True)),
    # ASM: _paired_dot's packed PTX multiply (lane layout) on sm90, the plain product on gfx942 (what the host passes there)
    "moe_gate_up_lane": (moe.moe_gate_up_kernel, dict(z_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", h_ptr="*bf16",
                                                      sorted_ptr="*i32", offs_ptr="*i32", done_ptr="*i32"),
                         dict(_MOE, BK=256, W4=True, STRIDED=4, TILED=True, ROWS_FIRST=True, SIGNAL=True, ASM="ASM")),
    # PREFETCH: the L2 prefetch PTX on sm90 only (the host passes 0 where PDL cannot run)
    "moe_gate_up_prefetch": (moe.moe_gate_up_kernel, dict(z_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", h_ptr="*bf16",
                                                          sorted_ptr="*i32", offs_ptr="*i32", done_ptr="*i32"),
                             dict(_MOE, BK=256, W4=True, STRIDED=4, TILED=True, ROWS_FIRST=True, SIGNAL=True,
                                  ASM="ASM", PREFETCH={"sm90": 2, "gfx942": 0})),
    "moe_down_lane": (moe.moe_down_kernel, dict(h_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", sorted_ptr="*i32",
                                                offs_ptr="*i32", done_ptr="*i32"),
                      dict(BM=16, BN=64, BK=256, W4=True, STRIDED=4, TILED=True, ROWS_FIRST=True, AWAIT=48,
                           ASM="ASM")),
    "moe_gate_up_signal": (moe.moe_gate_up_kernel, dict(z_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", h_ptr="*bf16",
                                                        sorted_ptr="*i32", offs_ptr="*i32", done_ptr="*i32"),
                           dict(_MOE, BK=256, W4=True, STRIDED=2, TILED=True, ROWS_FIRST=True, SIGNAL=True)),
    "moe_down_await": (moe.moe_down_kernel, dict(h_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", sorted_ptr="*i32",
                                                 offs_ptr="*i32", done_ptr="*i32"),
                       dict(BM=16, BN=64, BK=256, W4=True, STRIDED=2, TILED=True, ROWS_FIRST=True, AWAIT=48)),
    "moe_gate_up_fp8": (moe.moe_gate_up_kernel, dict(z_ptr="*F8", w_ptr="*i32", s_ptr="*u8", h_ptr="*bf16",
                                                     sorted_ptr="*i32", offs_ptr="*i32"),
                        dict(_MOE, BM=128, BN=64, BK=256, W4=True, STRIDED=3, F8="F8")),
    "moe_combine": (moe.moe_combine_kernel, dict(inv_ptr="*i32"), dict(TOP_K=16, BD=512)),
    "moe_combine_gather": (moe.moe_combine_kernel, dict(y_ptr="*bf16", inv_ptr="*i32"),
                           dict(TOP_K=16, BD=512, GATHER=True)),
    "mxfp4_dequant": (moe.mxfp4_dequant_kernel, dict(w_ptr="*i32", s_ptr="*u8", out_ptr="*bf16"),
                      dict(K=3584, BR=32, BK=128)),
    "mla_decode": (mla.mla_decode_kernel, dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", kv_ptr="*bf16", pt_ptr="*i32",
                                               qseq_ptr="*i32",
                                               lens_ptr="*i32"), dict(BH=32, PAGE_SIZE=64, DL=512, DR=64)),
    "mla_decode_xchg": (mla.mla_decode_kernel, dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", kv_ptr="*bf16", pt_ptr="*i32",
                                                    qseq_ptr="*i32", lens_ptr="*i32", xp_ptr="*bf16", xa_ptr="*fp32"),
                        dict(BH=64, PAGE_SIZE=64, DL=512, DR=64, XCHG=True)),
    "mla_decode_small_rope": (mla.mla_decode_kernel, dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", kv_ptr="*bf16",
                                                          pt_ptr="*i32", qseq_ptr="*i32", lens_ptr="*i32"),
                              dict(BH=16, PAGE_SIZE=64, DL=32, DR=8)),
    "mla_merge": (mla.mla_merge_kernel, dict(out_ptr="*bf16"), dict(NUM_SPLITS=4, DL=512)),
    "mla_cache_write": (mla.mla_cache_write_kernel, dict(ckv_ptr="*bf16", w_ptr="*bf16", kv_ptr="*bf16",
                                                         page_ptr="*i64", row_ptr="*i64"),
                        dict(BR=512, BDR=64, NORM_DTYPE=tl.bfloat16)),
    # the un-absorbed prefill at K3's dims (the last of several pieces: the merge on, bf16 out), and a small model's
    # rope under 16
    "mla_mha_prefill": (mla_prefill.mha_prefill_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", kpe_ptr="*bf16",
                                                             v_ptr="*bf16", o_ptr="*bf16"),
                        dict(DN=128, DR=64, DV=128, BDN=128, BDR=64, BDV=128, BM=128, BN=64, HAS_PREV=True)),
    "mla_mha_prefill_split": (mla_prefill.mha_prefill_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", kpe_ptr="*bf16",
                                                                   v_ptr="*bf16"),
                              dict(DN=128, DR=64, DV=128, BDN=128, BDR=64, BDV=128, BM=128, BN=64, HAS_PREV=False,
                                   SPLIT=True)),
    # several sequences in one launch (their block table, int32)
    "mla_mha_prefill_varlen": (mla_prefill.mha_prefill_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", kpe_ptr="*bf16",
                                                                    v_ptr="*bf16", o_ptr="*bf16", blocks_ptr="*i32"),
                               dict(DN=128, DR=64, DV=128, BDN=128, BDR=64, BDV=128, BM=64, BN=64, HAS_PREV=False,
                                    SPLIT=True, VARLEN=True)),
    "mla_mha_prefill_small_rope": (mla_prefill.mha_prefill_kernel, dict(q_ptr="*bf16", k_ptr="*bf16",
                                                                        kpe_ptr="*bf16", v_ptr="*bf16"),
                                   dict(DN=16, DR=8, DV=24, BDN=16, BDR=8, BDV=32, BM=64, BN=64, HAS_PREV=False)),
    "mla_cache_write_clear": (mla.mla_cache_write_kernel, dict(ckv_ptr="*bf16", w_ptr="*bf16", kv_ptr="*bf16",
                                                               page_ptr="*i64", row_ptr="*i64", clear_ptr="*i64"),
                              dict(BR=512, BDR=64, NORM_DTYPE=tl.bfloat16, PAGE_SIZE=64)),
    "mla_gate": (mla.mla_gate_kernel, dict(o_ptr="*bf16", g_ptr="*bf16", out_ptr="*bf16"), dict(BV=128, HAS_GATE=True)),
    "kda_decode_fused": (kd.kda_decode_fused_kernel, dict(qkv_ptr="*bf16", conv_pool_ptr="*bf16", slot_ptr="*i32",
                                                          out_ptr="*bf16"),
                         dict(H=96, K=128, W=4, HAS_LOWER_BOUND=True)),
    "kda_decode_fused_f_b": (kd.kda_decode_fused_kernel, dict(qkv_ptr="*bf16", conv_pool_ptr="*bf16", slot_ptr="*i32",
                                                              out_ptr="*bf16", graw_ptr="*bf16", fb_ptr="*bf16"),
                             dict(H=96, K=128, W=4, HAS_LOWER_BOUND=True, FB=True, FB_RC=32)),
    "kda_conv_update": (kd.conv_update_kernel, dict(qkv_ptr="*bf16", conv_pool_ptr="*bf16", slot_ptr="*i32"),
                        dict(W=4, BC=1024)),
    "kda_gated_norm": (kd.gated_norm_kernel, dict(out_ptr="*bf16"), dict(K=128, BT=16)),
    "kda_recurrent_vsplit": (kd.kda_recurrent_vsplit_kernel, dict(slot_ptr="*i32"),
                             dict(H=96, K=128, BV=32, HAS_LOWER_BOUND=True)),
    "kda_conv_prefill": (kd.conv_prefill_rows_kernel, dict(qkv_ptr="*bf16", conv_pool_ptr="*bf16", slot_ptr="*i32",
                                                           cu_ptr="*i64", tok_seq_ptr="*i32", y_ptr="*bf16"),
                         dict(W=4, BT=64, BC=256, NORM_K=128)),
    "kda_conv_state": (kd.conv_state_kernel, dict(qkv_ptr="*bf16", conv_pool_ptr="*bf16", slot_ptr="*i32",
                                                  cu_ptr="*i64"), dict(W=4, BC=1024)),
    "mlp_glu": (mlp.glu_kernel, dict(h_ptr="*bf16", out_ptr="*bf16"), dict(ACT=0, BI=1024)),
    "moe_out_input": (moe_out.moe_out_input_kernel, dict(y_ptr="*fp32", nw_ptr="*bf16", h_ptr="*bf16",
                                                         out_ptr="*bf16"),
                      dict(HAS_NORM=True, ACT=0, BD=4096, BS=256, BI=512)),
    "rms_norm": (norm.rms_norm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16"), dict(BD=8192)),
    "attn_res": (attn_res.attn_res_kernel, dict(partial_ptr="*bf16", proj_ptr="*bf16", norm_w_ptr="*bf16",
                                                out_ptr="*bf16", **{f"b{i}_ptr": "*bf16" for i in range(8)}),
                 dict(K=8, STACKED=False, BD=8192, BK=8)),
    "attn_res_stacked": (attn_res.attn_res_kernel, dict(partial_ptr="*bf16", proj_ptr="*bf16", norm_w_ptr="*bf16",
                                                        out_ptr="*bf16", **{f"b{i}_ptr": "*bf16" for i in range(8)}),
                         dict(K=12, STACKED=True, BD=8192, BK=16)),
    "attn_res_partials": (attn_res.attn_res_partials_kernel, dict(partial_ptr="*bf16", proj_ptr="*bf16",
                                                                  norm_w_ptr="*bf16",
                                                                  **{f"b{i}_ptr": "*bf16" for i in range(8)}),
                          dict(K=8, STACKED=False, CH=512, BK=16)),
    "attn_res_partials_delta": (attn_res.attn_res_partials_kernel, dict(partial_ptr="*bf16", delta_ptr="*bf16",
                                                                         sum_ptr="*bf16",
                                                                         **{f"b{i}_ptr": "*bf16" for i in range(8)}),
                                dict(K=8, STACKED=False, CH=512, BK=16, DELTA=True)),
    "attn_res_mix": (attn_res.attn_res_mix_kernel, dict(partial_ptr="*bf16", out_ptr="*bf16",
                                                        **{f"b{i}_ptr": "*bf16" for i in range(8)}),
                     dict(K=8, STACKED=False, CH=512, BK=16, CHUNKS=14, BC=16)),
    # the next RMSNorm fused (NORM): one program a token, and the split form's mix over whole rows
    "attn_res_norm_delta": (attn_res.attn_res_kernel, dict(partial_ptr="*bf16", delta_ptr="*bf16", sum_ptr="*bf16",
                                                           out_norm_ptr="*bf16", out_ptr="*bf16",
                                                           **{f"b{i}_ptr": "*bf16" for i in range(8)}),
                            dict(K=8, STACKED=False, BD=8192, BK=8, DELTA=True, NORM=True)),
    "attn_res_mix_norm": (attn_res.attn_res_mix_kernel, dict(partial_ptr="*bf16", out_norm_ptr="*bf16", out_ptr="*bf16",
                                                             **{f"b{i}_ptr": "*bf16" for i in range(8)}),
                          dict(K=8, STACKED=False, CH=8192, BK=16, CHUNKS=14, BC=16, NORM=True)),
    "moe_sort_pairs": (moe.sort_pairs_kernel, dict(ids_ptr="*i64", order_ptr="*i32", offs_ptr="*i32",
                                                   inv_ptr="*i32"), dict(BLOCK=4096, COLS=4)),
    "moe_sort_pairs_8192": (moe.sort_pairs_kernel, dict(ids_ptr="*i64", order_ptr="*i32", offs_ptr="*i32",
                                                        inv_ptr="*i32"), dict(BLOCK=8192, COLS=4)),
    "moe_sort_pairs_done": (moe.sort_pairs_kernel, dict(ids_ptr="*i64", order_ptr="*i32", offs_ptr="*i32",
                                                        inv_ptr="*i32", done_ptr="*i32"),
                            dict(BLOCK=4096, COLS=4, ZERO_DONE=True)),
    "moe_sort_pairs_early": (moe.sort_pairs_kernel, dict(ids_ptr="*i64", order_ptr="*i32", offs_ptr="*i32",
                                                         inv_ptr="*i32", done_ptr="*i32"),
                             dict(BLOCK=8192, COLS=4, ZERO_DONE=True, EARLY={"sm90": True, "gfx942": False})),
    "moe_sort_pairs_flat": (moe.sort_pairs_kernel, dict(ids_ptr="*i64", order_ptr="*i32", offs_ptr="*i32",
                                                        inv_ptr="*i32"), dict(BLOCK=4096, COLS=1)),
    "router_logits": (router.router_logits_kernel, dict(x_ptr="*bf16", w_ptr="*bf16"), dict(BM=16, BE=32, BK=64)),
    "router_logits_swap": (router.router_logits_kernel, dict(x_ptr="*bf16", w_ptr="*bf16"),
                           dict(BM=32, BE=64, BK=128, SWAP=True)),
    "router_topk": (router.router_topk_kernel, dict(ids_ptr="*i64"),
                    dict(NUM_SPLITS=4, TOP_K=16, BE=1024, HAS_BIAS=True, RENORM=True)),
    # MoEInProj: the logits are a column view of the fp32 GEMM row, the rest of the row cast to bf16
    "router_topk_cast": (router.router_topk_kernel, dict(ids_ptr="*i64", h_ptr="*fp32", out_ptr="*bf16"),
                         dict(NUM_SPLITS=1, TOP_K=16, BE=1024, HAS_BIAS=True, RENORM=True, CAST=True, BC=1024)),
    # past CAST_SPLIT_MAX_TOKENS tokens: a whole row of the latent MoE's 4352 columns a cast program
    "router_topk_cast_row": (router.router_topk_kernel, dict(ids_ptr="*i64", h_ptr="*fp32", out_ptr="*bf16"),
                             dict(NUM_SPLITS=1, TOP_K=16, BE=1024, HAS_BIAS=True, RENORM=True, CAST=True, BC=8192)),
    "gumbel_argmax": (sample.gumbel_argmax_kernel, dict(seed_ptr="*i64", idx_ptr="*i64"), dict(BLOCK=1024)),
    # top-p without a sort: the first round's histogram in copies, its crossing and list, a later round's histogram
    # on the rows and on the list (the prefix check on), the ties, the mask
    "top_p_hist_first": (top_p.top_p_hist_kernel, dict(state_ptr="*i64", hist_ptr="*i64"),
                         dict(SHIFT=20, NB=4096, ABOVE=32, FIRST=True, BLOCK=1024, COPIES=8)),
    "top_p_hist": (top_p.top_p_hist_kernel, dict(state_ptr="*i64", hist_ptr="*i64"),
                   dict(SHIFT=8, NB=4096, ABOVE=20, FIRST=False, BLOCK=1024)),
    "top_p_hist_listed": (top_p.top_p_hist_kernel, dict(state_ptr="*i64", hist_ptr="*i64"),
                          dict(SHIFT=8, NB=4096, ABOVE=20, FIRST=False, BLOCK=1024, LISTED=True)),
    "top_p_cross": (top_p.top_p_cross_kernel, dict(hist_ptr="*i64", state_ptr="*i64", top_p_ptr="*fp64",
                                                   t_ptr="*fp64"), dict(NB=4096, FIRST=True, COPIES=8)),
    "top_p_list": (top_p.top_p_list_kernel, dict(state_ptr="*i64"), dict(SHIFT=20, BLOCK=1024)),
    "top_p_ties": (top_p.top_p_ties_kernel, dict(state_ptr="*i64", top_p_ptr="*fp64", ties_ptr="*i32"),
                   dict(BLOCK=1024)),
    "top_p_mask": (top_p.top_p_mask_kernel, dict(state_ptr="*i64", top_p_ptr="*fp64", t_ptr="*fp64", ties_ptr="*i32"),
                   dict(PARTS=32, BLOCK=1024)),
}
_FLOATS = {"beta", "linear_beta", "sm_scale", "scale", "lower_bound", "eps", "out_eps", "scaling"}
TARGETS = {"gfx942": GPUTarget("hip", "gfx942", 64), "sm90": GPUTarget("cuda", 90, 32)}


# each target's own e4m3 ("F8" in a spec): e4m3fn on sm_90, e4m3fnuz on gfx942 (what MI300's FP8 MMA takes)
NATIVE_F8 = {"sm90": ("fp8e4nv", tl.float8e4nv), "gfx942": ("fp8e4b8", tl.float8e4b8)}


def _source(name, target="sm90"):
    fn, ptrs, consts = SPECS[name]
    f8_name, f8 = NATIVE_F8[target]
    ptrs = {k: v.replace("F8", f8_name) for k, v in ptrs.items()}
    consts = {k: f8 if v == "F8" else (target == "sm90") if v == "ASM" else v[target] if isinstance(v, dict) else v
              for k, v in consts.items()}
    # constexprs the spec leaves out take their defaults (TILED, PDL: off), as at a launch that omits them
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts
                 and p.default is not inspect.Parameter.empty}, **consts}
    sig = {}
    for arg in fn.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            sig[arg] = ptrs.get(arg, "*fp32")
        else:
            sig[arg] = "fp32" if arg in _FLOATS else "i32"
    # what the launcher sees at run time: 16-byte aligned pointers, strides and extents divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a] != "constexpr" and (sig[a].startswith("*") or a.startswith("stride"))}
    return ASTSource(fn, sig, consts, attrs)


def sm90_sass(cubin: bytes) -> tuple[str, str]:
    """(SASS, resource usage) of an sm_90 cubin, by the cuobjdump Triton ships (tools/sass_loops.py, and the
    compile tests that read a kernel's SASS)."""
    import os
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return tuple(subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                     for flag in ("-sass", "-res-usage"))


def _has_backend(kind):
    from triton.backends import backends
    return {"hip": "amd", "cuda": "nvidia"}[kind] in backends


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_kernel_compiles(name, target):
    tgt = TARGETS[target]
    if not _has_backend(tgt.backend):
        pytest.skip(f"this Triton ({triton.__version__}) has no {tgt.backend} backend")
    try:
        compiled = triton.compile(_source(name, target), target=tgt, options={"num_warps": 4, "num_stages": 2})
    except Exception as exc:  # report which kernel, for which target, and the compiler's own words
        pytest.fail(f"{name} does not compile for {target}: {type(exc).__name__}: {str(exc)[:2000]}")
    binary = "hsaco" if tgt.backend == "hip" else "cubin"
    assert compiled.asm.get(binary), f"{name}: no {binary} produced for {target}"
