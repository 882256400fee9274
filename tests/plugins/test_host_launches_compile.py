"""The Triton launches the plugins' host code makes, compiled for sm_90 and gfx942 exactly as launched (no GPU).

A host function runs on CPU tensors with every kernel launch recorded instead of run (JITFunction.run patched),
then each recorded launch is compiled with the types and constexprs it was given. A None argument becomes a
constexpr, as at a real launch: a kernel that touches such a pointer under a runtime branch runs in the
interpreter (plain Python) and compiles from a hand-written spec that passes a pointer, yet fails at its real
launch (the pair sort's per-token counts, nineteenth session). test_rocm_compile.py covers every kernel from
specs; this covers the launch configurations of the engine's own tactics and batch sizes.
"""
import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
        torch.int64: "*i64", torch.uint8: "*u8"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "maxnreg")


def _launches(monkeypatch, run, gpu_pdl: bool) -> list:
    """(kernel, bound arguments, options) of every launch `run()` makes; gpu_pdl: the host sees an sm_90 GPU."""
    from k3plugins import pdl
    from k3plugins.moe import triton as moe
    calls = []

    def record(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append((self, dict(bound.arguments), options))

    monkeypatch.setattr(JITFunction, "run", record)
    monkeypatch.setattr(moe, "_interpreting", lambda: True)  # supports(): CPU tensors stand in for the GPU's
    monkeypatch.setattr(moe, "pdl_capable", lambda t: gpu_pdl)
    monkeypatch.setattr(pdl, "_supported", lambda index: gpu_pdl)
    from k3plugins.kda import fla
    monkeypatch.setattr(fla, "sm_count", lambda device: 132 if gpu_pdl else 0)  # the fused decode's register cap
    monkeypatch.setattr(moe, "sm_count", lambda device: 132)  # the MoE prefetch's first programs
    run()
    return calls


def _source(kernel, args: dict) -> ASTSource:
    sig, consts = {}, {}
    for p in kernel.params:
        value = args[p.name]
        if p.is_constexpr or value is None:
            sig[p.name], consts[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[p.name] = _PTR[value.dtype]
        elif isinstance(value, bool):
            sig[p.name] = "i1"
        elif isinstance(value, int):
            sig[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            sig[p.name] = "fp32"
    return ASTSource(kernel, sig, consts, {})


def _moe_decode(tactic: str, **changes):
    from dataclasses import replace

    from k3plugins.moe import triton as moe

    def run():
        g = torch.Generator().manual_seed(0)
        E, dl, inter, M, k = 4, 512, 512, 5, 4
        t = replace(moe.TACTICS[tactic], **changes)
        w13 = moe.lay_out(t, torch.randint(0, 256, (E, 2 * inter, dl // 2), dtype=torch.uint8, generator=g))
        s13 = moe.lay_out_scale(t, torch.randint(118, 126, (E, 2 * inter, dl // 32), dtype=torch.uint8, generator=g))
        w2 = moe.lay_out(t, torch.randint(0, 256, (E, dl, inter // 2), dtype=torch.uint8, generator=g))
        s2 = moe.lay_out_scale(t, torch.randint(118, 126, (E, dl, inter // 32), dtype=torch.uint8, generator=g))
        ids = torch.randint(0, 2 * E, (M, k), generator=g)
        moe.moe_experts(torch.randn(M, dl).to(torch.bfloat16), ids, torch.rand(M, k), w13, s13, w2, s2,
                        expert_start=0, act="situ", tactic=t)
    return run


def _attn_res(split: int, delta: bool, norm: bool):
    from k3plugins.attn_res import triton as ar

    def run():
        M, D, K = 3, 1024, 4
        x = lambda: torch.randn(M, D).to(torch.bfloat16)  # noqa: E731
        ar.attn_res(x(), [x() for _ in range(K)], torch.randn(D), torch.ones(D), eps=1e-6, split=split,
                    delta=x() if delta else None, out_norm=torch.ones(D, dtype=torch.bfloat16) if norm else None)
    return run


def _route(M: int):
    from k3plugins.router import triton as router

    def run():
        E, D = 896, 1024
        router.route(torch.randn(M, D).to(torch.bfloat16), torch.randn(E, D).to(torch.bfloat16), torch.randn(E),
                     top_k=16, renormalize=True, scaling_factor=2.5)
    return run


def _moe_in(M: int):
    from k3plugins.moe_in import triton as moe_in

    def run():  # on CPU tensors the fp32 GEMM runs in torch; the top-k launch with its cast is what is recorded
        N, E, D = 4352, 896, 256
        moe_in.moe_in_proj(torch.randn(M, D).to(torch.bfloat16), torch.randn(N + E, D).to(torch.bfloat16),
                           torch.randn(E), num_experts=E, top_k=16, renormalize=True, scaling_factor=2.5)
    return run


def _mla_decode(B: int, H: int):
    from k3plugins.mla import triton as mla

    def run():
        pages = torch.arange(4 * B, dtype=torch.int32).view(B, 4)
        mla.mla_decode_attention(torch.randn(B, H, 512).to(torch.bfloat16), torch.randn(B, H, 64).to(torch.bfloat16),
                                 torch.randn(4 * B, 64, 576).to(torch.bfloat16), pages,
                                 torch.full((B,), 200, dtype=torch.int32), scale=192 ** -0.5)
    return run


def _mla_glue(T: int, H: int):
    from k3plugins.mla import triton as mla

    def run():  # the cache write (latent norm, concat, paged store) and the gated output of a rank's MLA layer
        mla.write_cache(torch.randn(T, 576).to(torch.bfloat16), torch.ones(512, dtype=torch.bfloat16),
                        torch.zeros(T + 2, 64, 576).to(torch.bfloat16), torch.arange(T), torch.arange(T) % 64, eps=1e-6)
        mla.gate_heads(torch.randn(H, T, 128).to(torch.bfloat16), torch.randn(T, H * 128).to(torch.bfloat16))
    return run


def _norms():
    from k3plugins.mlp import triton as mlp
    from k3plugins.norm import triton as norm

    def run():
        norm.rms_norm(torch.randn(5, 7168).to(torch.bfloat16), torch.ones(7168, dtype=torch.bfloat16), eps=1e-5)
        mlp.glu(torch.randn(5, 2 * 768).to(torch.bfloat16), act="situ", beta=4.0, linear_beta=25.0)
    return run


def _kda_decode(N: int, tactic: str, state_dtype=torch.float32, f_b: bool = False):
    from k3plugins.kda import fla

    def run():
        H, K = 6, 128
        D, S = H * K, N + 1
        x = lambda *shape: torch.randn(*shape).to(torch.bfloat16)  # noqa: E731
        fla.kda_decode(x(N, 3 * D), x(N, K if f_b else D), x(N, H), x(N, D), torch.randn(3 * D, 4), torch.randn(H),
                       torch.randn(D), torch.ones(K), torch.zeros(S, H, K, K, dtype=state_dtype),
                       torch.zeros(S, 3 * D, 3).to(torch.bfloat16), torch.arange(N), num_heads=H, head_dim=K,
                       lower_bound=-5.0, eps=1e-5, tactic=tactic, f_b_weight=x(D, K) if f_b else None)
    return run


def _moe_out(norm: bool):
    from k3plugins.moe_out import triton as moe_out

    def run():
        T, Dl, inter, size = 5, 3584, 48, 224
        moe_out.moe_out_proj(torch.randn(T, Dl), torch.ones(Dl, dtype=torch.bfloat16) if norm else None,
                             torch.randn(T, 2 * inter).to(torch.bfloat16),
                             torch.randn(7168, size + inter).to(torch.bfloat16), start=size, size=size, eps=1e-5,
                             act="situ")
    return run


CASES = {
    "moe_out_proj": _moe_out(True),
    "moe_out_proj without the latent norm": _moe_out(False),
    **{f"kda decode {t} {N} seqs": _kda_decode(N, t) for t in ("fused", "split") for N in (3, 60)},
    "kda decode fused bf16 state": _kda_decode(8, "fused", torch.bfloat16),
    "kda decode fused, f_b inside": _kda_decode(8, "fused", f_b=True),
    **{f"router {M} tokens": _route(M) for M in (8, 32, 64, 128, 512)},
    **{f"moe_in_proj {M} tokens": _moe_in(M) for M in (1, 128)},
    **{f"mla decode {B}x{H}": _mla_decode(B, H) for B, H in ((4, 6), (64, 16), (2, 96))},
    **{f"mla glue {T} tokens": _mla_glue(T, 6) for T in (1, 32)},
    "rms_norm and glu": _norms(),
    "moe decode_p": _moe_decode("decode_p"),
    "moe decode_p plain": _moe_decode("decode_p", overlap=False, rows_first=False),
    "moe prefill_p": _moe_decode("prefill_p"),
    # the lane layout: the host passes the PTX multiply (ASM) for an sm_90 GPU only, so gfx942 compiles the product
    "moe decode_l": _moe_decode("decode_l"),
    "moe decode_l_pf": _moe_decode("decode_l_pf"),  # the L2 prefetch (taken where the host can launch with PDL)
    "moe decode_l_yh": _moe_decode("decode_l_yh"),  # the down kernel storing bf16 rows
    "moe decode_l_gc": _moe_decode("decode_l_gc"),  # the combine gathering a token's rows
    "moe prefill_l": _moe_decode("prefill_l"),
    **{f"attn_res split{s} delta{int(d)} norm{int(n)}": _attn_res(s, d, n)
       for s in (0, 512) for d in (False, True) for n in (False, True)},
}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_host_launches_compile(monkeypatch, case, target):
    from triton.backends import backends
    tgt = TARGETS[target]
    if {"hip": "amd", "cuda": "nvidia"}[tgt.backend] not in backends:
        pytest.skip(f"this Triton has no {tgt.backend} backend")
    launches = _launches(monkeypatch, CASES[case], gpu_pdl=target == "sm90")
    assert launches, f"{case}: no Triton launch recorded"
    for kernel, args, options in launches:
        opts = {"num_warps": options.get("num_warps", 4), "num_stages": options.get("num_stages", 3)}
        if target == "sm90" and options.get("launch_pdl"):
            opts["launch_pdl"] = True
        if target == "sm90" and options.get("maxnreg"):
            opts["maxnreg"] = options["maxnreg"]
        try:
            triton.compile(_source(kernel, args), target=tgt, options=opts)
        except Exception as exc:
            pytest.fail(f"{case}: {kernel.fn.__name__} as launched does not compile for {target}: "
                        f"{type(exc).__name__}: {str(exc)[:1500]}")
