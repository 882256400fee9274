"""The HTTP server's settings: the model id clients send, the API key, and the limits on requests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """Args: model_name: the id clients must send; api_key: None = open; max_concurrent: requests in the
    engine at once; max_queue: requests waiting beyond those (more get 429); max_prompt_tokens and
    max_tokens_limit: per-request caps (over them: 400)."""

    model_name: str
    api_key: str | None = None
    max_concurrent: int = 64
    max_queue: int = 256
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 4096

    def __post_init__(self):
        for f in ("max_concurrent", "max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}: expected >= 1, got {getattr(self, f)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: expected >= 0, got {self.max_queue}")
