"""k3runtime: load a k3build engine and serve it (Python API, HTTP, Triton)."""

from .sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLMEngine", "SamplingParams"]


def __getattr__(name):
    # LLM pulls in torch and the plugins; keep `import k3runtime` light for tools that only read configs.
    if name == "LLM":
        from .api import LLM

        return LLM
    if name == "AsyncLLMEngine":  # asyncio generate / streaming / cancellation, for embedding in other servers
        from .async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(f"module 'k3runtime' has no attribute {name!r}")
