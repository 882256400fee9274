"""`AsyncLLMEngine`: one background thread owns an LLMEngine and runs its step loop.

Callers on any thread submit requests through a thread-safe command queue; the engine thread is the
only one that touches the scheduler, pools and cache. Tokens come back either through a callback
(run on the engine thread: Triton's response senders) or as an asyncio iterator (`generate`).
Stop strings are applied on the engine thread right after the step that produced the token, exactly
as `LLM.generate` does, so a streamed request yields the same tokens as the Python API.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from .api import StreamChunk
from .engine_options import EngineOptions
from .llm_engine import LLMEngine
from .request import Request
from .sampling_params import SamplingParams
from .tokenizer import Detokenizer, Tokenizer, resolve_tokenizer

# Called on the engine thread: ACCEPTED once the request is queued, then each chunk; or once with the
# exception that rejected it (or EngineDeadError if the engine stops under it).
ACCEPTED = "accepted"
Callback = Callable[[StreamChunk | BaseException | str], None]


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no request can run."""


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot written by the engine thread after every step."""

    num_waiting: int = 0
    num_running: int = 0
    pages_used: int = 0
    pages_total: int = 0
    slots_used: int = 0
    slots_total: int = 0
    num_steps: int = 0
    # since the engine started: requests preempted (for lack of pages), of them swapped out to the host store
    preemptions: int = 0
    swaps_out: int = 0
    host_pages_used: int = 0  # the host store's (0 of 0 without one)
    host_pages_total: int = 0
    host_slots_used: int = 0
    host_slots_total: int = 0


# The snapshot's figures as both front-ends export them (`serve`'s /metrics, the Triton model's): (metric, help,
# EngineStats field). Gauges; then counters, exported with the _total suffix
STAT_GAUGES = (
    ("k3_requests_running", "Requests holding a KDA slot and pages.", "num_running"),
    ("k3_kv_pages_used", "MLA KV cache pages in use.", "pages_used"),
    ("k3_kv_pages_total", "MLA KV cache pages.", "pages_total"),
    ("k3_kda_slots_used", "KDA state slots in use.", "slots_used"),
    ("k3_kda_slots_total", "KDA state slots.", "slots_total"),
    ("k3_host_pages_used", "Host-store pages holding swapped-out requests' MLA KV.", "host_pages_used"),
    ("k3_host_pages_total", "Host-store pages (--num-host-pages, or as --swap-space-gib holds).",
     "host_pages_total"),
    ("k3_host_slots_used", "Host-store KDA slots holding swapped-out requests' state.", "host_slots_used"),
    ("k3_host_slots_total", "Host-store KDA slots (--num-host-slots, or as --swap-space-gib holds).",
     "host_slots_total"),
)
STAT_COUNTERS = (
    ("k3_preemptions", "Requests preempted for lack of cache pages (recomputed or swapped out later).",
     "preemptions"),
    ("k3_requests_swapped_out", "Preempted requests copied to the host store.", "swaps_out"),
)


class Metrics:
    """Hooks the engine thread calls; the server subclasses this with Prometheus metrics."""

    def __init__(self):
        self.requests_finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def on_first_token(self, ttft_s: float) -> None:
        pass

    def on_finish(self, reason: str, prompt_tokens: int, output_tokens: int, tpot_s: float | None) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += output_tokens

    def on_step(self, num_tokens: int, seconds: float) -> None:
        pass


def _call(callback: Callback, ev) -> bool:
    try:
        callback(ev)
        return True
    except Exception:
        return False


@dataclass
class _Live:
    callback: Callback
    detok: Detokenizer | None
    request: Request
    submitted: float
    first: float | None = None
    num_out: int = 0


class RequestStream:
    """Async iterator over one accepted request's chunks; `close()` (or leaving early) aborts it."""

    def __init__(self, engine: AsyncLLMEngine, loop: asyncio.AbstractEventLoop):
        self.engine, self._loop = engine, loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.request_id = ""
        self.done = False

    def _push(self, ev) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamChunk:
        if self.done:
            raise StopAsyncIteration
        ev = await self._queue.get()
        if isinstance(ev, BaseException):
            self.done = True
            raise ev
        self.done = ev.finish_reason is not None
        return ev

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)


class AsyncLLMEngine:
    """Args: engine: an LLMEngine, or an engine dir (then `options` builds one); tokenizer: for text and stop
    strings (None = token ids only; default = the engine dir's tokenizer if any); metrics: hook object."""

    def __init__(self, engine: LLMEngine | str, options: EngineOptions = EngineOptions(), *,
                 tokenizer: Tokenizer | None | str = "auto", metrics: Metrics | None = None):
        if not isinstance(engine, LLMEngine):
            # before the weights: a damaged tokenizer file costs no weight reading
            tokenizer = resolve_tokenizer(tokenizer, engine)
            engine = LLMEngine(engine, options)
        else:  # "auto": the dir the engine was loaded from
            tokenizer = resolve_tokenizer(tokenizer, engine.runner.engine.engine_dir)
        self.engine, self.tokenizer = engine, tokenizer
        self.metrics = metrics or Metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._stop = False
        # Set by the engine thread, under _submit_lock, before its last drain: no command put after that
        # drain would ever be answered, so submit refuses from then on.
        self._closed = False
        self._submit_lock = threading.Lock()
        self.error: BaseException | None = None
        self.stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    # --- any thread ---
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def vocab_size(self) -> int:
        return self.engine.facts.vocab_size

    @property
    def sampling_defaults(self) -> dict:
        """LLMEngine.sampling_defaults: the model's generation_config.json values a request without its own takes."""
        return self.engine.sampling_defaults

    def submit(self, prompt_ids: list[int], params: SamplingParams, callback: Callback,
               request_id: str | None = None) -> str:
        """Queue a request; returns its id at once. Rejections (bad ids, too long) reach `callback` as an exception."""
        if not isinstance(params, SamplingParams):  # here, on the caller's thread: the engine thread takes no guess
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (this engine has none); use stop_token_ids")
        rid = request_id or f"req-{next(self._ids)}"
        with self._submit_lock:
            if self._closed or not self.is_alive:
                raise EngineDeadError(f"the engine thread is not running ({self.error!r})")
            self._commands.put(("add", rid, list(prompt_ids), params, callback))
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op if it already finished); its pages and slot are freed by the engine thread."""
        self._commands.put(("abort", request_id))

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the engine thread has ended (shut down or failed: see `error`); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._commands.put(("wake",))
        self._thread.join(timeout)

    async def add(self, prompt_ids: list[int], params: SamplingParams,
                  request_id: str | None = None) -> RequestStream:
        """Submit and wait until the engine accepted the request; raises ValueError if it rejected it."""
        stream = RequestStream(self, asyncio.get_running_loop())
        stream.request_id = self.submit(prompt_ids, params, stream._push, request_id)
        try:
            first = await stream._queue.get()
        except BaseException:
            self.abort(stream.request_id)
            raise
        if isinstance(first, BaseException):
            stream.done = True
            raise first
        return stream

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StreamChunk]:
        """Yield the request's chunks, one a token, each with its own text (a delta: vLLM's default yields the
        output so far); the last has finish_reason set. Leaving early (break, task cancellation, client
        disconnect) aborts the request. Raises ValueError if the engine rejects it."""
        stream = await self.add(prompt_ids, params, request_id)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.close()

    # --- engine thread ---
    def _snapshot(self, num_steps: int = 0) -> EngineStats:
        ss, stats = self.engine.schedulers, self.engine.stats  # one scheduler per attention-DP rank
        return EngineStats(sum(s.num_waiting for s in ss), sum(s.num_running for s in ss),
                           sum(s.page_pool.num_used for s in ss), sum(s.page_pool.num_pages for s in ss),
                           sum(s.slot_pool.num_used for s in ss), sum(s.slot_pool.num_slots for s in ss), num_steps,
                           stats["preemptions"], stats["swaps_out"], sum(s.host_page_pool.num_used for s in ss),
                           sum(s.host_page_pool.num_pages for s in ss), sum(s.host_slot_pool.num_used for s in ss),
                           sum(s.host_slot_pool.num_slots for s in ss))

    def _loop(self) -> None:
        try:
            while not self._stop:
                # Block only when idle; while requests run, pick up new commands between steps.
                busy = self.engine.has_unfinished()
                self._drain(block=not busy)
                if self._stop:
                    break
                if self.engine.failure is not None:  # a multi-rank engine's workers went while it idled
                    raise self.engine.failure
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # a failing step must not leave callers waiting forever
            self.error = e
        finally:
            try:
                self.engine.shutdown()  # releases worker ranks of a multi-rank engine
            except Exception as e:  # noqa: BLE001 - keep failing the callers below
                self.error = self.error or e
            err = self.error or EngineDeadError("the engine was shut down")
            for rid in list(self._live):
                _call(self._live.pop(rid).callback, EngineDeadError(f"request {rid}: {err!r}"))
            # nothing runs or waits any more: the last step's snapshot would show its requests forever
            st = self.stats
            self.stats = EngineStats(pages_total=st.pages_total, slots_total=st.slots_total, num_steps=st.num_steps,
                                     preemptions=st.preemptions, swaps_out=st.swaps_out,
                                     host_pages_total=st.host_pages_total, host_slots_total=st.host_slots_total)
            with self._submit_lock:
                self._closed = True
            self._drain_rejecting(err)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = self._snapshot(self.stats.num_steps)

    def _drain_rejecting(self, err: BaseException) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _call(cmd[4], EngineDeadError(f"request {cmd[1]}: {err!r}"))

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, callback = cmd
            try:
                if rid in self._live:
                    raise ValueError(f"request_id: {rid!r} is already live")
                req = self.engine.add_request(ids, params, rid)
            except (ValueError, TypeError) as e:  # the caller's input: its request alone is refused
                _call(callback, e)
                return
            detok = None if self.tokenizer is None else Detokenizer(self.tokenizer, params.stop, params.min_tokens,
                                                                    params.skip_special_tokens)
            self._live[rid] = _Live(callback, detok, req, time.monotonic())
            if not _call(callback, ACCEPTED):
                self._apply(("abort", rid))
        elif cmd[0] == "abort":
            if cmd[1] in self._live:
                self.engine.abort(cmd[1])
                live = self._live.pop(cmd[1])
                self.metrics.on_finish("abort", live.request.num_prompt_tokens, live.num_out, None)

    def _step(self) -> None:
        t0 = time.monotonic()
        events = self.engine.step()
        now = time.monotonic()
        self.metrics.on_step(len(events), now - t0)
        for ev in events:
            live = self._live.get(ev.request_id)
            if live is None:  # aborted while the step ran
                continue
            reason, why = ev.finish_reason, live.request.stop_reason
            text = ""
            if live.detok is not None:
                text = live.detok.push(ev.token_id, final=reason is not None, stop_token=reason == "stop")
                if live.detok.stopped:  # also on the last token max_tokens allows: its stop string ends the text
                    if reason is None:
                        self.engine.finish(ev.request_id, "stop")
                    reason, why = "stop", live.detok.stop_string
            live.num_out += 1
            if live.first is None:
                live.first = now
                self.metrics.on_first_token(now - live.submitted)
            if reason is not None:
                del self._live[ev.request_id]
                tpot = (now - live.first) / (live.num_out - 1) if live.num_out > 1 else None
                self.metrics.on_finish(reason, live.request.num_prompt_tokens, live.num_out, tpot)
            # A broken consumer (closed event loop, Triton stream gone) cancels only its own request.
            chunk = StreamChunk(ev.request_id, ev.token_id, text, reason, ev.logprobs,
                                live.detok.offset if live.detok is not None else None, ev.prompt_logprobs,
                                why if reason is not None else None)
            if not _call(live.callback, chunk) and reason is None:
                self._apply(("abort", ev.request_id))
        self.stats = self._snapshot(self.stats.num_steps + 1)
