"""`LLM`: the Python API — generate (batch), stream, and fp32 logits for scoring."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine_options import EngineOptions
from .llm_engine import LLMEngine, TokenEvent
from .logprobs import TokenLogprobs
from .request import Request
from .sampling_params import SamplingParams
from .tokenizer import ChatTextError, Detokenizer, Tokenizer, check_chat_text, resolve_tokenizer


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
    # what ended it with finish_reason "stop", as vLLM's stop_reason: the stop string (str) or the stop_token_ids id
    # (int); None when it ended on EOS or length (or runs on)
    stop_reason: int | str | None = None
    # the sum of its tokens' logprobs (the model's raw ones, as `logprobs`), when SamplingParams.logprobs asked
    cumulative_logprob: float | None = None
    index: int = 0  # which of its prompt's SamplingParams.n choices this is


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
    stop_reason: int | str | None = None  # on the last chunk: CompletionOutput.stop_reason


Prompt = str | list[int]


class LLM:
    """Args: engine_dir: a `k3build build` output; device: "cpu" or "cuda"; tokenizer: for text (None = token ids
    only; default = the engine dir's, if it has one; a Tokenizer, or a directory holding tokenizer.json); other
    keywords: EngineOptions.

    generate() and stream() may interleave (a stream paused while generate() runs, several streams): each request's
    events wait in its own mailbox until its caller takes them, while any caller's stepping runs them all. Several
    threads may share one LLM: adding, ending and stepping take a lock (a step runs for every thread's requests)."""

    def __init__(self, engine_dir: str | Path, *, device: str = "cpu", tokenizer: Tokenizer | None | str = "auto",
                 **options):
        # the tokenizer first: a damaged tokenizer file is refused before any weight is read
        self.tokenizer = resolve_tokenizer(tokenizer, engine_dir)
        self.engine = LLMEngine(engine_dir, EngineOptions(device=device, **options))
        self._mail: dict[str, deque[TokenEvent]] = {}  # this LLM's running requests' events, not yet taken
        self._lock = threading.RLock()  # around the mailboxes and the engine: callers on several threads

    def _ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: the engine has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            raise ValueError("prompt: a dict (vLLM's TextPrompt / TokensPrompt) is not taken; pass the text or the "
                             "list of token ids itself")
        elif isinstance(prompt, (list, tuple)) and all(map(_is_id, prompt)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt: expected a string or a list of token ids (ints), got {_kind(prompt)}")
        if not ids:
            raise ValueError("prompt: empty (at least one token is needed)")
        return ids

    def _detok(self, params: SamplingParams) -> Detokenizer | None:
        if self.tokenizer is None:
            return None
        return Detokenizer(self.tokenizer, params.stop, params.min_tokens, params.skip_special_tokens)

    def _add(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[Request]:
        """Add the prompts' requests, all or none: every prompt is tokenized first, and one the engine refuses
        (too long, a bad token id) takes the others of the call back out."""
        ids = [self._ids(p) for p in prompts]
        if self.tokenizer is None and any(isinstance(p, SamplingParams) and p.stop for p in params):
            raise ValueError("stop: stop strings need a tokenizer (this LLM has none); use stop_token_ids")
        with self._lock:
            return self._add_locked(ids, params)

    def _add_locked(self, ids: list[list[int]], params: list[SamplingParams]) -> list[Request]:
        added = []
        try:
            for i, p in zip(ids, params):
                req = self.engine.add_request(i, p)
                self._mail[req.request_id] = deque()
                added.append(req)
        except BaseException:
            for req in added:
                self._end(req, abort=True)
            raise
        return added

    def _end(self, req: Request, *, abort: bool = False, reason: str | None = None) -> None:
        """The caller is done with req: aborted (abort), finished by a stop string (reason), or it ended."""
        with self._lock:
            if abort and not req.is_finished:
                self.engine.abort(req.request_id)
            elif reason is not None:
                self.engine.finish(req.request_id, reason)
            self._mail.pop(req.request_id, None)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and stream() use without params (vLLM's name): SamplingParams() with the sampling fields
        of the model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), where it has them."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order, a prompt's SamplingParams.n
        choices one after another (CompletionOutput.index)."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                      and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = self.get_default_sampling_params() if params is None else params
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        bad = next((p for p in plist if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"params: expected SamplingParams, got {type(bad).__name__}")
        # each choice is a request of its own: the prompt repeated, its params seeded apart (SamplingParams.choices)
        prompts = [x for x, p in zip(prompts, plist) for _ in range(p.n)]
        index = [j for p in plist for j in range(p.n)]
        plist = [c for p in plist for c in p.choices()]
        reqs = self._add(prompts, plist)
        outputs = {r.request_id: CompletionOutput(r.request_id, r.prompt_token_ids, [], None, None,
                                                  [] if p.logprobs is not None else None,
                                                  cumulative_logprob=0.0 if p.logprobs is not None else None, index=j)
                   for r, p, j in zip(reqs, plist, index)}
        detoks = {r.request_id: self._detok(p) for r, p in zip(reqs, plist)}
        by_id = {r.request_id: r for r in reqs}
        try:
            for ev in self._events(reqs):
                out, det = outputs[ev.request_id], detoks[ev.request_id]
                out.token_ids.append(ev.token_id)
                if out.logprobs is not None:
                    out.logprobs.append(ev.logprobs)
                    out.cumulative_logprob += ev.logprobs.logprob
                if ev.prompt_logprobs is not None:
                    out.prompt_logprobs = list(ev.prompt_logprobs)
                out.finish_reason = ev.finish_reason or out.finish_reason
                if ev.finish_reason is not None:
                    out.stop_reason = by_id[ev.request_id].stop_reason
                if det is not None:
                    det.push(ev.token_id, final=ev.finish_reason is not None, stop_token=ev.finish_reason == "stop")
                    if det.stopped:  # also on the last token max_tokens allows: its stop string ends the text
                        if ev.finish_reason is None:
                            self._end(by_id[ev.request_id], reason="stop")
                        out.finish_reason, out.stop_reason = "stop", det.stop_string
                    out.text = det.text
        finally:  # interrupted (KeyboardInterrupt, a failing step): the requests of this call go
            for req in reqs:
                if req.request_id in self._mail:
                    self._end(req, abort=True)
        return list(outputs.values())

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             *, tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[CompletionOutput]:
        """vLLM's LLM.chat: a conversation (a list of {"role", "content", ...} messages) or a list of them, each
        rendered by the tokenizer's chat template (with `tools`, as transformers' apply_chat_template takes them),
        then generate(). A message's text never becomes a special token (Tokenizer.encode_chat); content may be
        text parts ({"type": "text", "text": ...}), joined by newlines as the OpenAI server joins them. The text is
        returned as written: read Kimi's tool calls in it with skip_special_tokens=False (its markers are special
        tokens)."""
        import jinja2  # (as the tokenizer's template: only where a chat is rendered)

        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("chat: " + ("the engine has no tokenizer" if self.tokenizer is None else
                                         "the engine's tokenizer has no chat template") + "; use generate()")
        single = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError(f"messages: expected a conversation (a list of message dicts) or a list of them, got "
                             f"{_kind(messages)}")
        ids = []
        for c, conv in enumerate(conversations):
            where = "messages" if single else f"messages[{c}]"
            if not isinstance(conv, (list, tuple)) or not conv:
                raise ValueError(f"{where}: expected a non-empty list of message dicts, got {_kind(conv)}")
            msgs = [_chat_message(m, f"{where}[{i}]") for i, m in enumerate(conv)]
            try:
                check_chat_text(conv)  # as written: a text part is named apart from the others
                ids.append(self.tokenizer.encode_chat(msgs, add_generation_prompt, tools))
            except jinja2.TemplateError as e:  # the template's raise_exception, or what it cannot render
                raise ValueError(f"{where}: the chat template cannot render it: {e}") from None
            except ChatTextError as e:  # text no tokenizer takes (a lone surrogate), named by its place
                raise ValueError(f"{where if e.root == 'messages' else e.root}{e.where}: {e.why}") from None
        return self.generate(ids, params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield tokens of one request as they are produced (other requests of this engine keep running)."""
        params = self.get_default_sampling_params() if params is None else params
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"n: stream() runs one choice, got n={params.n}; use generate(), or stream() once for "
                             "each of params.choices()")
        req, = self._add([prompt], [params])
        det = self._detok(params)
        try:
            for ev in self._events([req]):
                reason, why = ev.finish_reason, req.stop_reason
                text = det.push(ev.token_id, final=reason is not None, stop_token=reason == "stop") if det else ""
                if det and det.stopped:
                    if reason is None:
                        self._end(req, reason="stop")
                    reason, why = "stop", det.stop_string
                offset = det.offset if det is not None else None
                yield StreamChunk(req.request_id, ev.token_id, text, reason, ev.logprobs, offset, ev.prompt_logprobs,
                                  why if reason is not None else None)
                if reason is not None:
                    return
        finally:
            self._end(req, abort=True)  # the consumer stopped early: free pages and slot

    def _events(self, reqs: list[Request]) -> Iterator[TokenEvent]:
        """The events of `reqs` until each has its last one (or its caller ended it), stepping the engine while
        one of them waits; other requests' events go to their mailboxes. Once none of this LLM's requests runs,
        the engine is stepped until it is idle (async scheduling: a step still in flight lands)."""
        while True:
            waiting = False
            for req in reqs:
                box = self._mail.get(req.request_id)
                while box:
                    ev = box.popleft()
                    if ev.finish_reason is not None:
                        self._mail.pop(req.request_id)
                    yield ev
                    box = self._mail.get(req.request_id)
                waiting |= box is not None
            if not waiting:
                break
            with self._lock:  # another thread's step may have brought ours meanwhile: look again under the lock
                if any(self._mail.get(r.request_id) for r in reqs):
                    continue
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"requests {[r.request_id for r in reqs if r.request_id in self._mail]} "
                                       "wait for tokens but the engine runs nothing")
                self._step()
        with self._lock:
            if not self._mail:
                while self.engine.has_unfinished():
                    self._step()

    def _step(self) -> None:
        for ev in self.engine.step():
            box = self._mail.get(ev.request_id)
            if box is not None:  # (none: a request its caller ended)
                box.append(ev)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(token_ids), vocab] at every position (for scoring and tests)."""
        ids = self._ids(token_ids)
        with self._lock:
            return self.engine.score(ids).cpu()


def _chat_message(m, where: str) -> dict:
    """A message as the template gets it: text parts joined (OpenAI's content parts; other kinds refused)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"{where}: expected a dict with a string 'role', got {_kind(m)}")
    content = m.get("content")
    if isinstance(content, (list, tuple)):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are taken")
        return {**m, "content": "\n".join(p["text"] for p in content)}
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{where}.content: expected a string, text parts or None, got {_kind(content)}")
    return m


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _kind(x) -> str:
    """What a bad prompt is, for its error: its type, or a list's first element that is not an int."""
    if isinstance(x, (list, tuple)):
        if not x:
            return "an empty list"
        bad = next((t for t in x if not _is_id(t)), None)
        return f"a list holding {type(bad).__name__} {bad!r}"
    return type(x).__name__
