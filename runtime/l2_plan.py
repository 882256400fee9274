"""Where a step asks L2 for which weights (k3plugins.l2_prefetch), decided once from the graph's node order.

A node is heavy when it streams memory: its weight inputs add up to at least `heavy_bytes`, or it reads a cache
(KDA, MLA). Between two heavy nodes lies a window of light ones; when the window launches kernels of its own
(AttnRes, RMSNorm; not a view, or a single rank's identity all-reduce) HBM idles through them. At the window's
first node the executor forks its prefetch stream, which asks L2 for the weights of the heavy nodes right after
the window, in the order they read them, `budget_bytes` in all: floating-point weights only, not the MoE's MXFP4
experts, of which a step reads only those its tokens are routed to. The fork waits for the main stream, so the
prefetch never competes with the heavy node before the window.
"""

from __future__ import annotations

import os

import torch

HEAVY_BYTES = 1 << 20
# A window of two small kernels at 32 tokens is about 5 µs: ~12 MB at the rate 8 bulk-prefetch programs reach
# (BENCHMARKS.md). K3_L2_PREFETCH_MB overrides it; 0 turns prefetching off.
BUDGET_MB = 12
_KERNEL_FREE_OPS = ("SplitColumns", "SliceColumns", "Identity", "AllReduce", "AllGather")


def l2_supported(device: torch.device) -> bool:
    """Whether the step prefetches on this device (k3plugins.l2_prefetch.supported); imported only for CUDA, where
    Triton is installed with torch."""
    if device.type != "cuda":
        return False
    from k3plugins.l2_prefetch import supported
    return supported(torch.empty(0, device=device))


def budget_bytes() -> int:
    return int(float(os.environ.get("K3_L2_PREFETCH_MB", BUDGET_MB)) * 2**20)


def _weights(node, weights: dict) -> list[str]:
    return [i for i in node.inputs if weights.get(i) is not None]


def _heavy(node, weights: dict, heavy_bytes: int) -> bool:
    return node.kind in ("kda", "mla") or sum(weights[i].nbytes for i in _weights(node, weights)) >= heavy_bytes


def prefetch_plan(nodes, weights: dict, *, heavy_bytes: int | None = None,
                  budget: int | None = None) -> dict[int, list[tuple[str, int]]]:
    """{index of a window's first node: [(weight name, bytes to prefetch), ...]} for the executor's bound nodes
    (each has .op, .kind and .inputs)."""
    budget = budget_bytes() if budget is None else budget
    heavy_bytes = HEAVY_BYTES if heavy_bytes is None else heavy_bytes
    plan: dict[int, list[tuple[str, int]]] = {}
    if budget <= 0:
        return plan
    heavy = [_heavy(n, weights, heavy_bytes) for n in nodes]
    i = 0
    while i < len(nodes):
        if heavy[i] or i == 0 or not heavy[i - 1]:
            i += 1
            continue
        start = i  # a window opens after a heavy node
        while i < len(nodes) and not heavy[i]:
            i += 1
        if not any(n.op not in _KERNEL_FREE_OPS for n in nodes[start:i]):
            continue  # nothing runs in it: a prefetch would only compete with the next heavy node
        asks, left = [], budget
        for j in range(i, len(nodes)):
            if not heavy[j] or left <= 0:
                break
            for name in _weights(nodes[j], weights):
                w = weights[name]
                if w.is_floating_point() and w.nbytes >= heavy_bytes and left > 0:
                    asks.append((name, min(w.nbytes, left)))
                    left -= asks[-1][1]
        if asks:
            plan[start] = asks
    return plan


def step_prefetch(plan_asks: list[tuple[str, int]], env: dict, stream, main) -> None:
    """Fork `stream` from `main` and issue the asks on it (the caller joins it at the step's end)."""
    from k3plugins.l2_prefetch import l2_prefetch

    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        for name, n in plan_asks:
            l2_prefetch(env[name], n)
