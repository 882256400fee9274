"""Index tensors derived from a step's batch, computed once per step instead of once per layer.

Every MLA layer of a decode step turns the same (cu_seqlens, context_lens, page_table) into the same token
positions and page rows, and every KDA layer the same slot ids into int32: about ten small launches a layer,
hundreds a step. The executor runs each step inside `step_scope()`; inside it, `per_step` hands the first
layer's result to the later ones when they pass the very same source tensors (the batch's own objects, which
nothing changes during a step). Outside a scope (a plugin called on its own: tests, benchmarks) nothing is kept.
Under CUDA-graph capture the step runs once, so the graph records each derived tensor once too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_scope: dict[str, tuple[tuple[torch.Tensor, ...], object]] | None = None


@contextmanager
def step_scope() -> Iterator[None]:
    global _scope
    outer, _scope = _scope, {}
    try:
        yield
    finally:
        _scope = outer


def per_step(name: str, sources: tuple[torch.Tensor, ...], make: Callable[..., object]) -> object:
    """make(*sources), computed once per step for the same source objects (every call outside a step scope)."""
    if _scope is None:
        return make(*sources)
    hit = _scope.get(name)
    if hit is not None and len(hit[0]) == len(sources) and all(a is b for a, b in zip(hit[0], sources)):
        return hit[1]
    value = make(*sources)
    _scope[name] = (sources, value)
    return value
