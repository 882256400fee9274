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

    def supports(self, target: str) -> tuple[bool, str]:
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
IMPLS: list[Impl] = [
    Impl("Embedding", _REF, 1, "k3plugins.embed.reference:embedding"),
    Impl("LMHead", _REF, 1, "k3plugins.embed.reference:lm_head"),
    Impl("Linear", _REF, 1, "k3plugins.embed.reference:linear"),
    Impl("RMSNorm", _REF, 1, "k3plugins.norm.reference:rms_norm"),
    Impl("AttnRes", _REF, 1, "k3plugins.attn_res.reference:attn_res"),
    Impl("GatedMLP", _REF, 1, "k3plugins.mlp.reference:gated_mlp"),
    Impl("Router", _REF, 1, "k3plugins.router.reference:route"),
    Impl("MoEExperts", _REF, 1, "k3plugins.moe.reference:moe_experts"),
    Impl("KDA", _REF, 1, "k3plugins.kda.reference:kda_mixer"),
    Impl("MLA", _REF, 1, "k3plugins.mla.reference:mla_mixer"),
]

# Preferred tactic per target, best first; the first that `supports` the target wins.
PREFERENCE: dict[str, tuple[str, ...]] = {"cpu": (_REF,), "sm90": ("triton", "fla", _REF), "gfx942": ("triton", _REF)}


def find(op: str, tactic: str) -> Impl | None:
    return next((i for i in IMPLS if i.op == op and i.tactic == tactic), None)


def resolve(op: str, target: str, prefer: str | None = None) -> Impl:
    """The implementation the builder records for `op` on `target` (a forced `prefer` must be supported)."""
    candidates = [i for i in IMPLS if i.op == op]
    if not candidates:
        raise KeyError(f"no plugin implements op {op!r}")
    order = (prefer,) if prefer else PREFERENCE[target]
    reasons = []
    for tactic in order:
        for impl in candidates:
            if impl.tactic == tactic:
                ok, why = impl.supports(target)
                if ok:
                    return impl
                reasons.append(why)
    raise ValueError(f"no implementation of {op} for target {target}: " + ("; ".join(reasons) or f"tactic {prefer!r} unknown"))
