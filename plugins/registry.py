"""Plugin implementations by (op, tactic): what the builder chooses from and the runtime binds.

The builder resolves one tactic per op for its target and records (version, tactic) in the engine; the
runtime looks the same pair up here and refuses an engine whose pair it does not have. Nothing dispatches
per call.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

PLUGIN_ABI = 1  # bump when a plugin's signature or weight layout changes incompatibly
ALL_TARGETS = ("cpu", "sm90", "gfx942")


@dataclass(frozen=True)
class Impl:
    op: str  # the ONNX op_type in the k3 domain
    tactic: str
    version: int
    entry: str  # "module:function"
    targets: tuple[str, ...] = ALL_TARGETS
    needs: str | None = None  # module that must import (e.g. "triton")
    mxfp4_only: bool = False  # reads MXFP4 expert weights (an engine converted with float experts cannot use it)
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")  # engine activation dtypes it takes
    expert_layout: str = "natural"  # MXFP4 expert bytes as the build lays them out for it ("strided": restride_mxfp4,
    # "paired": pair_tile_mxfp4 and tile_scales, "lane": lane_tile_mxfp4 and tile_scales)
    host_sync: bool = False  # reads device values on the host each call (.tolist()): no CUDA graph can hold it

    def supports(self, target: str, quantization: str = "mxfp4", dtype: str = "bf16") -> tuple[bool, str]:
        if self.mxfp4_only and quantization != "mxfp4":
            return False, f"{self.op}/{self.tactic} reads MXFP4 experts; this checkpoint's experts are {quantization!r}"
        if dtype not in self.dtypes:
            return False, f"{self.op}/{self.tactic} takes {'/'.join(self.dtypes)} activations, not {dtype}"
        return self.runs_on(target)

    def runs_on(self, target: str) -> tuple[bool, str]:
        """Whether this machine can run it on that target: the target is its, and its package imports."""
        if target not in self.targets:
            return False, f"{self.op}/{self.tactic} does not run on {target}"
        if self.needs:
            try:
                importlib.import_module(self.needs)
            except ImportError:
                return False, f"{self.op}/{self.tactic} needs the '{self.needs}' package"
        return True, ""

    def load(self):
        module, fn = self.entry.split(":")
        return getattr(importlib.import_module(module), fn)


_REF = "reference"
_GPU = ("sm90", "gfx942")
IMPLS: list[Impl] = [
    Impl("Embedding", _REF, 1, "k3plugins.embed.reference:embedding"),
    Impl("LMHead", _REF, 1, "k3plugins.embed.reference:lm_head"),
    Impl("Linear", _REF, 1, "k3plugins.embed.reference:linear"),
    Impl("RMSNorm", _REF, 1, "k3plugins.norm.reference:rms_norm"),
    Impl("AttnRes", _REF, 3, "k3plugins.attn_res.reference:attn_res"),  # v3: norm=1 (the next RMSNorm fused)
    Impl("GatedMLP", _REF, 2, "k3plugins.mlp.reference:gated_mlp"),  # v2: gate_up may be absent (x projected)
    Impl("Router", _REF, 1, "k3plugins.router.reference:route"),
    Impl("MoEInProj", _REF, 1, "k3plugins.moe_in.reference:moe_in_proj"),
    Impl("MoEExperts", _REF, 1, "k3plugins.moe.reference:moe_experts"),
    Impl("MoEOutProj", _REF, 1, "k3plugins.moe_out.reference:moe_out_proj"),
    # their loops over sequences read lengths and slots on the host
    Impl("KDA", _REF, 2, "k3plugins.kda.reference:kda_mixer", host_sync=True),  # v2: in_proj rows padded
    Impl("MLA", _REF, 2, "k3plugins.mla.reference:mla_mixer", host_sync=True),  # v2: q_a, kv_a and g in one in_proj
    # device kernels (GPU-tested one by one: tests/plugins/test_*_gpu.py)
    Impl("Router", "triton", 1, "k3plugins.router.triton:route", _GPU, "triton", dtypes=("bf16", "fp16")),
    # one BLAS GEMM with fp32 output (torch.mm's out_dtype), then the top-k launch; on ROCm (not run there) its two
    # row blocks go to the blas GEMM and the Triton router instead (moe_in/triton.py)
    Impl("MoEInProj", "triton", 1, "k3plugins.moe_in.triton:moe_in_proj", _GPU, "triton", dtypes=("bf16", "fp16")),
    # pair_mxfp4's bits on K permuted so that each lane loads its own scales (mxfp4.lane_mxfp4); z in that K order:
    # the build permutes the latent down-projection's rows (latent MoE only: tactics.fit_moe_tactic)
    Impl("MoEExperts", "triton_l", 1, "k3plugins.moe.triton:moe_experts_lane", _GPU, "triton", mxfp4_only=True,
         expert_layout="lane"),
    # v3: the paired bytes and the scales in row tiles (mxfp4.pair_tile_mxfp4 / tile_scales); v4: each pair's bits
    # placed for plain shifts (mxfp4.PAIR_MAG_SHIFT), not rotations
    Impl("MoEExperts", "triton_p", 4, "k3plugins.moe.triton:moe_experts_paired", _GPU, "triton", mxfp4_only=True,
         expert_layout="paired"),
    Impl("MoEExperts", "triton_s", 1, "k3plugins.moe.triton:moe_experts_strided", _GPU, "triton", mxfp4_only=True,
         expert_layout="strided"),
    Impl("MoEExperts", "triton", 1, "k3plugins.moe.triton:moe_experts_w4", _GPU, "triton", mxfp4_only=True),
    # FP8 activations for prefill: within the parity bar only on some checkpoints, and slower than W4A16 on the
    # H200 as written (BENCHMARKS.md), so in no PREFERENCE: forced (`k3build build --tactic`) or taken by --tune
    Impl("MoEExperts", "triton_f8", 1, "k3plugins.moe.triton:moe_experts_fp8", _GPU, "triton", mxfp4_only=True,
         dtypes=("bf16", "fp16"), expert_layout="strided"),
    Impl("MoEExperts", "triton_ds", 1, "k3plugins.moe.triton:moe_experts_ds", _GPU, "triton", mxfp4_only=True,
         dtypes=("bf16", "fp16")),
    Impl("KDA", "fla", 2, "k3plugins.kda.fla:kda_mixer", ("sm90",), "fla.ops.kda"),
    # the Triton mixer with its decode attention in Gluon (TMA, wgmma: Hopper only) at 64 heads a rank or more
    Impl("MLA", "gluon", 2, "k3plugins.mla.triton:mla_mixer_gluon", ("sm90",), "triton.experimental.gluon",
         dtypes=("bf16", "fp16")),
    Impl("MLA", "triton", 2, "k3plugins.mla.triton:mla_mixer", _GPU, "triton"),
    # one launch each instead of the references' chains of elementwise kernels
    Impl("RMSNorm", "triton", 1, "k3plugins.norm.triton:rms_norm", _GPU, "triton"),
    Impl("AttnRes", "triton", 3, "k3plugins.attn_res.triton:attn_res", _GPU, "triton"),  # v3: norm=1
    # GEMMs in the activation dtype (the references upcast weights to fp32 on every call)
    Impl("Linear", "blas", 1, "k3plugins.embed.blas:linear", _GPU, dtypes=("bf16", "fp16")),
    Impl("LMHead", "blas", 1, "k3plugins.embed.blas:lm_head", _GPU, dtypes=("bf16", "fp16")),
    Impl("GatedMLP", "blas", 2, "k3plugins.mlp.blas:gated_mlp", _GPU, dtypes=("bf16", "fp16")),
    Impl("MoEOutProj", "triton", 1, "k3plugins.moe_out.triton:moe_out_proj", _GPU, "triton",
         dtypes=("bf16", "fp16")),
]

# Preferred tactic per target, best first; the first that `supports` the target wins. triton_l (lane expert bytes)
# measured fastest on the H200 at decode, ahead of triton_p, triton_s and triton (BENCHMARKS.md); the builder steps
# down from it where the MoE has no latent projection, or the expert dims or scales do not allow it (tactics.py).
PREFERENCE: dict[str, tuple[str, ...]] = {"cpu": (_REF,), "sm90": ("triton_l", "triton_p", "gluon", "triton", "fla",
                                                                   "blas", _REF),
                                          "gfx942": ("triton", "blas", _REF)}


def find(op: str, tactic: str) -> Impl | None:
    return next((i for i in IMPLS if i.op == op and i.tactic == tactic), None)


def resolve(op: str, target: str, prefer: str | None = None, quantization: str = "mxfp4",
            dtype: str = "bf16") -> Impl:
    """The implementation the builder records for `op` on `target` (a forced `prefer` must be supported)."""
    candidates = [i for i in IMPLS if i.op == op]
    if not candidates:
        raise KeyError(f"no plugin implements op {op!r}")
    order = (prefer,) if prefer else PREFERENCE[target]
    reasons = []
    for tactic in order:
        for impl in candidates:
            if impl.tactic == tactic:
                ok, why = impl.supports(target, quantization, dtype)
                if ok:
                    return impl
                reasons.append(why)
    raise ValueError(f"no implementation of {op} for target {target}: " + ("; ".join(reasons) or f"tactic {prefer!r} unknown"))
