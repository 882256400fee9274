"""`LLM`: the Python API — generate (batch), stream, and fp32 logits for scoring."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .llm_engine import EngineOptions, LLMEngine
from .logprobs import TokenLogprobs
from .sampling_params import SamplingParams
from .tokenizer import Detokenizer, Tokenizer


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one a token of token_ids, when SamplingParams.logprobs asked
    # one a token of prompt_token_ids (None for the first), when SamplingParams.prompt_logprobs asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class StreamChunk:
    request_id: str
    token_id: int
    text: str  # newly released text ("" when held back, e.g. inside a multi-byte character)
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None  # the token's, when SamplingParams.logprobs asked
    # where the token's text starts in the output's text (None: no tokenizer); past the end of the text for a token
    # that completed a stop string, which the text leaves out
    text_offset: int | None = None
    # on a request's first chunk, when SamplingParams.prompt_logprobs asked: one a prompt token (None for the first)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


Prompt = str | list[int]


class LLM:
    """Args: engine_dir: a `k3build build` output; device: "cpu" or "cuda"; other keywords: EngineOptions."""

    def __init__(self, engine_dir: str | Path, *, device: str = "cpu", **options):
        self.engine = LLMEngine(engine_dir, EngineOptions(device=device, **options))
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(engine_dir)
        except FileNotFoundError:
            self.tokenizer = None

    def _ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: the engine has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt: empty (at least one token is needed)")
        return ids

    def _detok(self, params: SamplingParams) -> Detokenizer | None:
        return Detokenizer(self.tokenizer, params.stop, params.min_tokens) if self.tokenizer is not None else None

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        outputs, detoks = {}, {}
        for prompt, p in zip(prompts, plist):
            req = self.engine.add_request(self._ids(prompt), p)
            outputs[req.request_id] = CompletionOutput(req.request_id, req.prompt_token_ids, [], None, None,
                                                       [] if p.logprobs is not None else None)
            detoks[req.request_id] = self._detok(p)
        for ev in self._events():
            out, det = outputs[ev.request_id], detoks[ev.request_id]
            out.token_ids.append(ev.token_id)
            if out.logprobs is not None:
                out.logprobs.append(ev.logprobs)
            if ev.prompt_logprobs is not None:
                out.prompt_logprobs = list(ev.prompt_logprobs)
            out.finish_reason = ev.finish_reason or out.finish_reason
            if det is not None:
                det.push(ev.token_id, final=ev.finish_reason is not None)
                if det.stopped and ev.finish_reason is None:
                    self.engine.finish(ev.request_id, "stop")
                    out.finish_reason = "stop"
                out.text = det.text
        return list(outputs.values())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield tokens of one request as they are produced (other requests of this engine keep running)."""
        params = params or SamplingParams()
        req = self.engine.add_request(self._ids(prompt), params)
        det = self._detok(params)
        try:
            for ev in self._events():
                if ev.request_id != req.request_id:
                    continue
                reason = ev.finish_reason
                text = det.push(ev.token_id, final=reason is not None) if det else ""
                if det and det.stopped and reason is None:
                    self.engine.finish(req.request_id, "stop")
                    reason = "stop"
                offset = det.offset if det is not None else None
                yield StreamChunk(req.request_id, ev.token_id, text, reason, ev.logprobs, offset, ev.prompt_logprobs)
                if reason is not None:
                    return
        finally:
            if not req.is_finished:
                self.engine.abort(req.request_id)  # the consumer stopped early: free pages and slot

    def _events(self):
        while self.engine.has_unfinished():
            yield from self.engine.step()

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(token_ids), vocab] at every position (for scoring and tests)."""
        return self.engine.score(self._ids(token_ids)).cpu()
