"""Request handling behind the OpenAI routes: validation into SamplingParams, admission, runs, SSE."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from ..sampling_params import GENERATION_DEFAULTS, SamplingParams
from ..tokenizer import ChatTextError, check_chat_text
from .config import ServerConfig
from .logprobs import ChoiceOffsets, TokenText, chat_logprobs, completion_logprobs, echoed_prompt, joined
from .metrics import PrometheusMetrics
from .protocol import MAX_CHOICES
from .tool_calls import CALL_END, MARKERS, CallRules, SpecialsOut, ToolDeltas, parse_tool_calls


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _param(e: ValueError) -> str:
    return re.split(r"[:\[]", str(e))[0]  # runtime errors start with the field name (logit_bias[7]: one entry's)


class _SSE(StreamingResponse):
    """Streaming response whose cleanup runs however the stream ends (done, disconnect, send error)."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Handlers:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, metrics: PrometheusMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.tok = engine.tokenizer
        self.token_text = TokenText(self.tok)
        self.max_model_len = engine.engine.scheduler.config.max_model_len
        # the most tokens (prompt + output) one request's KV can ever hold: the smallest attention-DP rank's cache
        # (scheduler.room_error: the last sampled token needs no cache row)
        self.cache_tokens = min(s.page_pool.num_pages * s.config.page_size for s in engine.engine.schedulers) + 1
        # ToolCallStream reads the markers from text that keeps them: the other special tokens, and the lengths of
        # their spellings, that a request with skip_special_tokens leaves out
        specials = self.tok.special_tokens() if self.tok is not None else {}
        self.unmarked = {i: len(s) for i, s in specials.items() if s not in MARKERS}
        self.call_end = next((i for i, s in specials.items() if s == CALL_END), None)  # (a named call's stop)
        self.forces_calls = set(MARKERS) <= set(specials.values())  # a forced call's opening is made of them
        self.admission_waiting = 0
        self._running = 0

    # --- admission: at most max_concurrent HTTP requests generating, max_queue more waiting ---
    async def _admit(self) -> None:
        c = self.config
        if self._running >= c.max_concurrent and self.admission_waiting >= c.max_queue:
            raise APIError(429, f"server busy: {self._running} requests running and {self.admission_waiting} "
                                f"queued (max_concurrent={c.max_concurrent}, max_queue={c.max_queue}); retry later",
                           code="queue_full", type_="rate_limit_error")
        if not hasattr(self, "_sem"):
            self._sem = asyncio.Semaphore(c.max_concurrent)
        self.admission_waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.admission_waiting -= 1
        self._running += 1

    def _release(self) -> None:
        self._running -= 1
        self._sem.release()

    # --- validation ---
    def _check(self, body) -> None:
        if body.model != self.config.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.config.model_name!r}",
                           "model", "model_not_found")
        bad = body.unsupported() or body.out_of_range()
        if bad:
            raise APIError(400, bad[1], bad[0])

    def _encode(self, prompt: str | list[int], field: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tok is None:
                raise APIError(400, f"{field}: this engine has no tokenizer; send token ids", field)
            try:
                ids = self.tok.encode(prompt)
            except ValueError as e:
                raise APIError(400, f"{field}: {e}", field) from None
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, f"{field}: empty (at least one token is needed)", field)
        if len(ids) > self.config.max_prompt_tokens:
            raise APIError(400, f"{field}: {len(ids)} tokens is over this server's limit of "
                                f"{self.config.max_prompt_tokens} prompt tokens", field, "context_length_exceeded")
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{field}: token ids must be in 0..{vocab - 1}", field)
        return ids

    def _params(self, body, max_tokens: int | None, prompt_len: int, field: str = "max_tokens") -> SamplingParams:
        """field: the request's name for max_tokens (chat's max_completion_tokens), which its errors name."""
        limit = self.config.max_tokens_limit
        if max_tokens is None:  # chat default: as much as the context, the KV cache and the server allow
            most = min(self.max_model_len or self.cache_tokens, self.cache_tokens)
            if prompt_len >= most:
                raise APIError(400, f"messages: {prompt_len} prompt tokens leave no room to generate: the engine "
                                    f"holds {most} tokens a request (its max_seq_len and KV cache)", "messages",
                               "context_length_exceeded")
            max_tokens = min(limit, most - prompt_len)
        # past the model's context first: its code tells a client to shorten (also a max_tokens over both limits)
        if self.max_model_len and prompt_len + max_tokens > self.max_model_len:  # OpenAI: a 400, not a cut output
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the request "
                                f"asks for {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} in "
                                f"the output): reduce {field} or the prompt", field,
                           "context_length_exceeded")
        if max_tokens > limit:
            raise APIError(400, f"{field}: {max_tokens} is over this server's limit of {limit}", field)
        # a field the request leaves out (or null): the model's generation_config.json value, else SamplingParams'
        # default (OpenAI's: temperature 1, top_p 1, no top_k, min_p or repetition penalty)
        given = {k: getattr(body, k) for k in GENERATION_DEFAULTS if getattr(body, k) is not None}
        sampling = {**self.engine.sampling_defaults, **given}
        try:
            params = SamplingParams(
                max_tokens=max_tokens, seed=body.seed, stop=() if body.stop is None else body.stop,
                ignore_eos=body.ignore_eos,
                logprobs=body.wanted_logprobs(), stop_token_ids=body.stop_token_ids or (), min_tokens=body.min_tokens,
                skip_special_tokens=body.skip_special_tokens, **{**body.penalties(), **sampling})
        except ValueError as e:
            msg = re.sub(r"^max_tokens\b", field, str(e))
            raise APIError(400, msg, _param(ValueError(msg))) from None
        vocab = self.engine.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise APIError(400, f"logit_bias: token ids must be in 0..{vocab - 1}", "logit_bias")
        return params

    # --- endpoints ---
    async def completions(self, body, request: Request):
        self._check(body)
        p = body.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) or not p else list(p)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"prompt: {len(prompts)} prompts × n={body.n} choices is over this server's limit "
                                f"of {MAX_CHOICES} choices per request", "prompt" if body.n == 1 else "n")
        # tokenized off the event loop: a megabyte prompt takes seconds, which would stall every other client
        ids = await asyncio.to_thread(lambda: [self._encode(x, "prompt") for x in prompts])
        texts = [x if isinstance(x, str) else None for x in prompts]
        echo = _Echo(ids, texts, body.n, body.max_tokens == 0, body.skip_special_tokens) if body.echo else None
        # max_tokens 0 with echo: the prompt alone (its logprobs): one token is generated and left out
        params = [self._params(body, 1 if echo and echo.only else body.max_tokens, len(x)) for x in ids]
        if echo and body.logprobs is not None:
            params = [replace(p, prompt_logprobs=body.logprobs) for p in params]
        return await self._serve(request, body, ids, params, chat=False, echo=echo)

    async def chat(self, body, request: Request):
        self._check(body)
        if self.tok is None or not self.tok.chat_template:
            raise APIError(400, "messages: this engine's tokenizer has no chat template; use /v1/completions",
                           "messages")
        msgs = [m.for_template() for m in body.messages]
        rules = self._call_rules(body)
        try:  # a message's text never becomes a special token (Tokenizer.encode_chat)
            check_chat_text([m.model_dump(exclude_unset=True) for m in body.messages])  # (text parts apart)
            ids = await asyncio.to_thread(self.tok.encode_chat, msgs, True, body.tools or None, rules.opening)
        except ChatTextError as e:  # text no tokenizer takes (a lone surrogate), named by its place
            raise APIError(400, str(e), e.root) from None
        except Exception as e:  # a template that cannot render these messages is the client's input problem
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        ids = self._encode(ids, "messages")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "max_tokens / max_completion_tokens: set at most one", "max_tokens")
        new = body.max_completion_tokens is not None
        mt, field = (body.max_completion_tokens, "max_completion_tokens") if new else (body.max_tokens, "max_tokens")
        params = self._params(body, mt, len(ids), field)
        if body.parse_tool_calls:  # the markers are special tokens: kept in the text (as vLLM's kimi_k2 parser does)
            params = replace(params, skip_special_tokens=False)
        if rules.named:  # its call's end marker ends the output
            params = replace(params, stop_token_ids=(*params.stop_token_ids, self.call_end))
        return await self._serve(request, body, [ids], [params], chat=True, rules=rules)

    def _call_rules(self, body) -> CallRules:
        if not body.parse_tool_calls:
            return CallRules()
        if body.tool_choice not in (None, "auto") and not self.forces_calls:
            raise APIError(400, "tool_choice: this engine's tokenizer has no tool-call markers to force a call with",
                           "tool_choice")
        return CallRules.of(body.tool_choice, body.parallel_tool_calls, body.past_calls())

    async def _start(self, ids, params, n: int) -> list[RequestStream]:
        """Each prompt's requests, n of them (its choices, in order; choice j seeded seed + j when a seed is set,
        else each its own random seed)."""
        streams = []
        try:
            for x, sp in zip(ids, params):
                for choice in sp.choices(n):
                    streams.append(await self.engine.add(x, choice))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, ValueError):  # the scheduler's checks: prompt + max_tokens vs cache and context
                raise APIError(400, str(e), _param(e)) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), type_="server_error") from None
            raise
        return streams

    async def _serve(self, request: Request, body, ids, params, chat: bool, echo: _Echo | None = None,
                     rules: CallRules = CallRules()):
        await _until_disconnect(request, self._admit())  # a client that leaves while queued gives its place up
        try:
            streams = await self._start(ids, params, body.n)
        except BaseException:
            self._release()
            raise
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.config.model_name}
        closed = []

        def close():
            if not closed:
                closed.append(1)
                for s in streams:
                    s.close()
                self._release()

        tools = chat and body.parse_tool_calls
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            deltas = [ToolDeltas(self._tool_text(body), rules) for _ in streams] if tools else None
            return _SSE(self._sse(streams, ids, meta, chat, usage, body.return_token_ids, close, echo, deltas), close)
        try:
            collect = (_collect(s, ChoiceOffsets(self.token_text), self._tool_text(body) if tools else None)
                       for s in streams)
            outs = await _until_disconnect(request, asyncio.gather(*collect))
        finally:
            close()
        if echo and echo.only:  # the generated token is left out
            outs = [("", [], "length", None if o[3] is None else [], [], o[5], None) for o in outs]
        n_out = sum(len(o[1]) for o in outs)
        choices = []
        for i, (text, tids, reason, lps, starts, prompt_lps, why) in enumerate(outs):
            c = {"index": i, "finish_reason": reason, "stop_reason": why,
                 "logprobs": self._logprobs(chat, tids, lps, starts)}
            if echo:
                said, columns, shift = echo(self.token_text, i, prompt_lps)
                text = said + text
                c["logprobs"] = None if columns is None else joined(columns, c["logprobs"], shift)
            if tools:
                content, calls = parse_tool_calls(text, rules)
                c["message"] = {"role": "assistant", "content": content}
                if calls:
                    c["message"]["tool_calls"] = [call.to_openai() for call in calls]
                    c["finish_reason"] = rules.reason if reason != "length" else reason
                c["stop_reason"] = self._stop_reason(why, rules)
            elif chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            if body.return_token_ids:
                c["token_ids"] = tids
                if not chat:  # vLLM's places: a completion choice's prompt, a chat response's one prompt
                    c["prompt_token_ids"] = ids[i // body.n]
            choices.append(c)
        out = {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
               "usage": _usage(sum(map(len, ids)), n_out)}
        if chat and body.return_token_ids:
            out["prompt_token_ids"] = ids[0]
        return out

    async def _sse(self, streams, ids, meta, chat, include_usage, return_ids, close, echo: _Echo | None = None,
                   tools: list[ToolDeltas] | None = None):
        obj = "chat.completion.chunk" if chat else "text_completion"
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for ch in s:
                    q.put_nowait((i, ch))
            except Exception as e:  # noqa: BLE001 - becomes an error event for the client
                q.put_nowait((i, e))
            q.put_nowait((i, None))

        prompted: set[int] = set()  # the completion choices whose prompt_token_ids went out (in their first chunk)
        n = len(streams) // len(ids)  # choices a prompt

        def event(choice: dict, usage=None, top: dict | None = None) -> str:
            if return_ids and not chat and choice and choice["index"] not in prompted:
                prompted.add(choice["index"])
                choice["prompt_token_ids"] = ids[choice["index"] // n]
            data = {**meta, "object": obj, "choices": [choice] if choice else [], **(top or {})}
            if usage is not None:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        n_out, live = 0, len(streams)
        offsets = [ChoiceOffsets(self.token_text) for _ in streams]  # each choice's text_offset so far
        shifts = [0] * len(streams)  # where each choice's output starts in its text (echo)
        echoed = set()
        try:
            if chat:
                for i in range(len(streams)):
                    yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                 "stop_reason": None, "logprobs": None},
                                top={"prompt_token_ids": ids[0]} if return_ids else None)  # (each, as vLLM)
            while live:
                i, ch = await q.get()
                if ch is None:
                    live -= 1
                    continue
                if isinstance(ch, Exception):
                    err = {"message": f"generation failed: {ch}", "type": "server_error", "param": None, "code": None}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    return
                if echo and i not in echoed:  # the prompt first, as a chunk of its own
                    echoed.add(i)
                    said, columns, shifts[i] = echo(self.token_text, i, ch.prompt_logprobs)
                    yield event({"index": i, "text": said, "logprobs": columns, "finish_reason": None,
                                 "stop_reason": None})
                if echo and echo.only:
                    yield event({"index": i, "text": "", "logprobs": None, "finish_reason": "length",
                                 "stop_reason": None})
                    continue
                n_out += 1
                lps = None if ch.logprobs is None else [ch.logprobs]
                start = offsets[i].push(ch.token_id, ch.text_offset) + shifts[i]
                c = {"index": i, "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
                     "logprobs": self._logprobs(chat, [ch.token_id], lps, [start])}
                if tools:
                    c["delta"], c["finish_reason"] = tools[i].push(ch.token_id, ch.text_offset, ch.text,
                                                                   ch.finish_reason)
                    c["stop_reason"] = self._stop_reason(ch.stop_reason, tools[i].rules)
                elif chat:
                    c["delta"] = {"content": ch.text} if ch.text or ch.finish_reason is None else {}
                else:
                    c["text"] = ch.text
                if return_ids:
                    c["token_ids"] = [ch.token_id]
                yield event(c)
            if include_usage:
                yield event({}, _usage(sum(map(len, ids)), n_out))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            close()

    def _stop_reason(self, why, rules: CallRules):
        """vLLM's stop_reason, less the call's end marker a named function's call stops at (a stop id the server
        adds: null, as vLLM's forced call, also where the client gave that id too)."""
        return None if rules.named and why == self.call_end else why

    def _tool_text(self, body) -> SpecialsOut:
        """A choice's text to read tool calls in (its request runs with skip_special_tokens false): less the
        special tokens but the markers when the client asked to skip them."""
        return SpecialsOut(self.unmarked if body.skip_special_tokens else {})

    def _logprobs(self, chat: bool, ids: list[int], lps: list | None, starts: list[int]) -> dict | None:
        """A choice's (or a streamed choice's chunk's) `logprobs`, None when its request did not ask; `starts`:
        where its tokens start in the choice's text (ChoiceOffsets)."""
        if lps is None:
            return None
        return chat_logprobs(self.token_text, ids, lps) if chat else completion_logprobs(self.token_text, ids, lps,
                                                                                          starts)


@dataclass(frozen=True)
class _Echo:
    """A completion that echoes its prompts (`echo`): choice i's is prompts[i // n], written as the client's text
    where it sent one (texts[i // n]; None: token ids, decoded with or without special tokens, as the output is);
    only: max_tokens 0, the prompt alone."""

    prompts: list[list[int]]
    texts: list[str | None]
    n: int
    only: bool
    skip_special_tokens: bool

    def __call__(self, text_of: TokenText, choice: int, lps) -> tuple[str, dict | None, int]:
        """echoed_prompt's (text, logprobs columns, shift) for a choice."""
        said, columns, shift = echoed_prompt(text_of, self.prompts[choice // self.n], lps, self.skip_special_tokens)
        text = self.texts[choice // self.n]
        return (said, columns, shift) if text is None else (text, columns, shift + len(text) - len(said))


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _collect(stream: RequestStream, offsets: ChoiceOffsets, tool_text: SpecialsOut | None = None
                   ) -> tuple[str, list[int], str | None, list | None, list[int], tuple | None, int | str | None]:
    """A request's text, token ids, finish reason, tokens' logprobs (None when it did not ask), where its tokens
    start in its text, its prompt's logprobs (None when it did not ask), and its stop reason (vLLM's: the stop
    string or stop token id that ended it). tool_text: the text to read tool calls in is taken through it."""
    text, tids, reason, lps, starts, prompt, why = [], [], None, [], [], None, None
    try:
        async for ch in stream:
            prompt = ch.prompt_logprobs if prompt is None else prompt
            text.append(ch.text if tool_text is None else tool_text.push(ch.token_id, ch.text_offset, ch.text))
            tids.append(ch.token_id)
            reason, why = ch.finish_reason, ch.stop_reason
            lps.append(ch.logprobs)
            starts.append(offsets.push(ch.token_id, ch.text_offset))
    except EngineDeadError as e:
        raise APIError(503, str(e), type_="server_error") from None
    return "".join(text), tids, reason, lps if lps and lps[0] is not None else None, starts, prompt, why


async def _until_disconnect(request: Request, aw):
    """Await aw; cancel it (its finally blocks abort the requests) if the client disconnects first."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(_outcome_read)
            raise APIError(499, "client disconnected")
    return task.result()


def _outcome_read(task: asyncio.Future) -> None:
    """Read a cancelled task's outcome, which nobody awaits: asyncio would log it with a traceback otherwise."""
    if not task.cancelled():
        task.exception()


async def _wait_disconnect(request: Request):
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return
