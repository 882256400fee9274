"""`--enable-deepep`: require DeepEP and check K3's shapes against its low-latency kernels at start-up.

DeepEP's low-latency dispatch/combine kernels are compiled for a fixed set of exchange widths and cap
top-k (kNumMaxTopK = 11 upstream); K3 routes 16 experts per token over a 3584-wide latent, which the
released kernels do not cover. Checking here turns a failure deep inside a kernel into a message that
names the limit before any weight is loaded.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass

from ..loader import EngineError


@dataclass(frozen=True)
class DeepEPCaps:
    """What the installed DeepEP low-latency kernels support."""

    max_topk: int = 11
    hidden_sizes: tuple[int, ...] = (1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
    source: str = "DeepEP main (low-latency kernels)"

    @classmethod
    def from_file(cls, path: str) -> "DeepEPCaps":
        d = json.loads(open(path).read())
        return cls(max_topk=int(d["max_topk"]), hidden_sizes=tuple(int(h) for h in d["hidden_sizes"]),
                   source=f"capabilities file {path}")


def _installed_caps() -> DeepEPCaps:
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as e:  # ImportError, or a CUDA extension failing at import (OSError/RuntimeError)
        raise EngineError(f"--enable-deepep: the 'deep_ep' package does not import ({type(e).__name__}: {e}); "
                          "install DeepEP (CUDA + NVSHMEM) on every rank, or start without --enable-deepep "
                          "to use the NCCL expert exchange") from e
    # Newer builds may publish their limits; otherwise assume upstream's.
    caps = DeepEPCaps()
    return DeepEPCaps(max_topk=getattr(deep_ep, "LOW_LATENCY_MAX_TOPK", caps.max_topk),
                      hidden_sizes=tuple(getattr(deep_ep, "LOW_LATENCY_HIDDEN_SIZES", caps.hidden_sizes)),
                      source=f"deep_ep {getattr(deep_ep, '__version__', '?')}")


def check_deepep(pretrained_config: dict, caps: DeepEPCaps | None = None) -> DeepEPCaps:
    """Raise EngineError unless DeepEP imports and supports this model's expert exchange.

    Args:
        pretrained_config: the engine's model config (top-k and the exchange width are read from it).
        caps: limits to check against; default: the installed deep_ep's, or $K3_DEEPEP_CAPS (a JSON file).
    """
    if caps is None:
        path = os.environ.get("K3_DEEPEP_CAPS")
        caps = DeepEPCaps.from_file(path) if path else _installed_caps()
    top_k = pretrained_config["num_experts_per_token"]
    width = pretrained_config.get("routed_expert_hidden_size") or pretrained_config["hidden_size"]
    problems = []
    if top_k > caps.max_topk:
        problems.append(f"top-k {top_k} exceeds the low-latency kernels' maximum of {caps.max_topk}")
    if width not in caps.hidden_sizes:
        problems.append(f"exchange width {width} is not one of the compiled widths {list(caps.hidden_sizes)}")
    if problems:
        raise EngineError(f"--enable-deepep: {caps.source} cannot carry this model's experts: " + "; ".join(problems)
                          + ". Start without --enable-deepep to use the NCCL exchange, or install a DeepEP build "
                            "with these limits raised")
    return caps
