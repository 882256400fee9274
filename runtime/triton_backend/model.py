"""Triton Python-backend model serving a k3build engine (copied as `<repo>/<model>/1/model.py`).

Inputs and outputs follow the TensorRT-LLM backend's spirit: `text_input` (or `input_ids`), `max_tokens`,
`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stream`, `stop`, `return_log_probs`, `presence_penalty`,
`frequency_penalty`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens` in
(no logit bias: TensorRT-LLM's backend takes bias words instead); `text_output`, `output_ids`, `finish_reason`,
`output_log_probs` (each output token's log-probability, flat; empty unless asked) out. In decoupled mode each
request is handed to the engine thread, which queues its tokens for a sender thread that answers (one response per
token when stream=true, or the tokens made since the last when sends fall behind), so concurrent requests batch continuously. The unary model (not decoupled) takes the
requests Triton's dynamic batcher hands it together (each with a batch dimension of 1) and answers them when all are
done. A cancelled request (client gone) is aborted on the engine, which frees its pages and KDA slot. Errors: the
client's mistakes are INVALID_ARG (HTTP 400), a stopped engine UNAVAILABLE (503; the gauge k3_engine_alive of
Triton's metrics goes to 0, since Triton before 2.64 cannot mark a Python model not ready: reload the model or
restart the server). Triton's metrics also count finished requests by reason (k3_requests_finished_total), prompt
and generated tokens, and show the engine's cache and host-store use and preemptions (async_engine.STAT_GAUGES,
STAT_COUNTERS; updated every STATS_PERIOD_S), each labelled with the model.
Needs numpy<2 in the stub's environment (Triton 2.51's stub), plus k3runtime and its dependencies.
"""

import json
import queue
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# how often the engine's snapshot (cache and host-store use, preemptions) is sent to Triton's metrics: from a thread
# of its own, as each update is IPC to Triton (on the engine thread it would cost every step)
STATS_PERIOD_S = 1.0


# TensorRT-LLM backend inputs this model does not take, with what it takes instead. Sent as inputs, Triton refuses
# them ("unexpected inference input"); a /generate body's fields that are no input reach the model as request
# parameters instead, which it would ignore: a client written for TensorRT-LLM would think its end_id applied.
# Only these names are refused: other parameters may be HTTP headers an operator forwards (--http-header-forward-*).
_TENSORRT_LLM_ONLY = {
    "end_id": "stop_token_ids (the engine's EOS ends a request unless ignore_eos)", "pad_id": "nothing (no padding)",
    "random_seed": "seed", "runtime_top_k": "top_k", "runtime_top_p": "top_p", "beam_width": "nothing (no beams)",
    "bad_words": "nothing", "embedding_bias": "nothing", "len_penalty": "nothing", "num_return_sequences": "nothing",
}


def _refuse_tensorrt_llm_parameters(request) -> None:
    try:
        given = json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError):  # a stub without parameters(), or none
        return
    names = sorted(set(given) & set(_TENSORRT_LLM_ONLY)) if isinstance(given, dict) else []
    if names:
        raise ValueError(f"{names[0]}: not taken by this model (a TensorRT-LLM input); it takes "
                         f"{_TENSORRT_LLM_ONLY[names[0]]}")


def _scalar(request, name, default, kind):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise ValueError(f"{name}: expected one value, got {a.size}")
    v = a[0]
    return kind(_text(name, v) if isinstance(v, bytes) else v)


def _text(name: str, raw: bytes) -> str:
    """A BYTES input's value as text; ValueError naming the input when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not valid UTF-8 ({e})") from None


class _Output:
    """A response's tokens so far: one event's (streamed), or a request's, collected (unary and not streamed);
    error: the error response instead, once the engine refused or failed the request."""

    def __init__(self):
        self.text, self.ids, self.logprobs, self.reason, self.error = [], [], [], None, None

    def add(self, ev) -> "_Output":
        self.text.append(ev.text)
        self.ids.append(ev.token_id)
        if ev.logprobs is not None:  # its request asked (return_log_probs)
            self.logprobs.append(ev.logprobs.logprob)
        self.reason = ev.finish_reason
        return self

    def response(self, batched: bool = False):
        """batched: the model takes Triton's batch dimension (the unary model), so each output gets one of 1."""
        if self.error is not None:
            return self.error
        outputs = [("text_output", np.array(["".join(self.text).encode("utf-8")], dtype=np.object_)),
                   ("output_ids", np.array(self.ids, dtype=np.int32)),
                   ("finish_reason", np.array([(self.reason or "").encode()], dtype=np.object_)),
                   ("output_log_probs", np.array(self.logprobs, dtype=np.float32))]
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, a.reshape(1, -1) if batched else a) for name, a in outputs])


def _error(message: str, code=None):
    """An error response; code: a pb_utils.TritonError code (default INTERNAL: the server's fault)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL
                                                                 if code is None else code))


def _invalid(e: Exception):
    return _error(str(e), pb_utils.TritonError.INVALID_ARG)


class _Stream:
    """One decoupled request's response side; once opened, only the sender thread sends on it (the engine thread
    adds to `waiting` under the responder's lock)."""

    def __init__(self, request, rid: str):
        self.request, self.sender, self.rid = request, request.get_response_sender(), rid
        self.closed = False  # its final response went (or its stream failed): what comes later is dropped
        self.waiting: _Output | None = None  # its streamed tokens queued and not yet taken by the sender


_OPEN, _CLOSE = object(), object()


def _cancelled(request) -> bool:
    try:
        return request.is_cancelled()
    except Exception:  # noqa: BLE001 - a request Triton cannot tell about is as good as gone
        return True


class _Responder:
    """Sends the decoupled model's responses from a thread of its own, each request's in the order they were put.

    Triton's IPC takes about 0.2 ms a response and 23 us a cancellation check on a CPU core: on the engine thread,
    256 streamed requests spent about 60 ms of every decode step there. The engine thread only queues what to send;
    this thread builds the responses (build(payload)), sends them, and checks the open requests' cancellation every
    POLL_S: a cancelled one is aborted on the engine (abort(rid)) and closed with an empty final response."""

    POLL_S = 0.05
    # A streamed token joins its request's response still in the queue: when sends fall behind the engine (one
    # thread sends about 5K responses a second), a response carries the tokens made since the last, so the sends
    # a second stay what one thread can do and no stream falls further behind than one response.

    def __init__(self, build, abort):
        self._build, self._abort = build, abort
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._open: dict[str, _Stream] = {}
        # Taken by put and by the thread's last drain: what is put after that drain is sent on the putting thread
        # (an engine thread that outlived finalize's shutdown wait still answers its requests).
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="k3-triton-send", daemon=True)
        self._thread.start()

    def open(self, request, rid: str) -> _Stream:
        """Before the request goes to the engine, so that its cancellation is watched from the start."""
        st = _Stream(request, rid)
        self.put(st, _OPEN)
        return st

    def put(self, st: _Stream, payload, final: bool = False) -> None:
        """payload: what build() turns into a response (final: the request's last)."""
        with self._lock:
            st.waiting = None  # what follows this goes after it
            if not self._closed:
                self._queue.put((st, payload, final))
                return
            self._send(st, payload, final)

    def put_token(self, st: _Stream, ev) -> None:
        """A streamed token (an engine event): added to the request's response in the queue, or queued as one."""
        with self._lock:
            if st.waiting is not None:
                st.waiting.add(ev)
                return
            out = _Output().add(ev)
            if not self._closed:
                st.waiting = out
                self._queue.put((st, out, False))
                return
            self._send(st, out, ev.finish_reason is not None)

    def _take(self, item):
        """A queued item, detached (under the lock) from the tokens still to come."""
        st, payload, final = item
        if st.waiting is payload:
            st.waiting = None
        return st, payload, final or (isinstance(payload, _Output) and payload.reason is not None)

    def close(self) -> None:
        """Send what was put, then end the thread."""
        self._queue.put(_CLOSE)
        self._thread.join()

    def _run(self) -> None:
        next_poll = time.monotonic() + self.POLL_S
        while True:
            try:
                item = self._queue.get(timeout=self.POLL_S if self._open else None)
            except queue.Empty:
                item = None
            if item is _CLOSE:
                with self._lock:
                    self._closed = True
                    while not self._queue.empty():
                        self._send(*self._take(self._queue.get()))
                return
            if item is not None:
                with self._lock:
                    item = self._take(item)
                self._send(*item)
            if time.monotonic() >= next_poll:
                for st in list(self._open.values()):
                    if _cancelled(st.request):
                        self._abort(st.rid)
                        self._send(st, None, final=True)
                next_poll = time.monotonic() + self.POLL_S

    def _send(self, st: _Stream, payload, final: bool) -> None:
        if payload is _OPEN:
            self._open[st.rid] = st
            return
        if st.closed:  # cancelled: what the engine made meanwhile has nowhere to go
            return
        try:
            if payload is None:  # a cancelled request's end
                st.sender.send(flags=FINAL)
            else:
                st.sender.send(self._build(payload), flags=FINAL if final else 0)
        except Exception:  # noqa: BLE001 - its stream is gone (or its response failed): only its request ends
            if not final:
                self._abort(st.rid)
            final = True
            try:
                st.sender.send(flags=FINAL)
            except Exception:  # noqa: BLE001 - a failed stream cannot be told
                pass
        if final:
            st.closed = True
            self._open.pop(st.rid, None)


def _counters(model_name: str):
    """The engine's Metrics hooks (engine thread) as Triton metrics of this model: finished requests by reason,
    prompt and generated tokens (the names of `k3runtime serve`'s /metrics)."""
    from k3runtime.async_engine import Metrics

    def family(name, description):
        return pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.COUNTER)

    class Counters(Metrics):
        def __init__(self):
            super().__init__()
            self.families = {n: family(f"k3_{n}_total", d) for n, d in (
                ("requests_finished", "Finished requests."), ("prompt_tokens", "Prompt tokens of finished requests."),
                ("generation_tokens", "Generated tokens."))}
            self.by_reason = {}
            self.prompt = self.families["prompt_tokens"].Metric(labels={"model": model_name})
            self.generation = self.families["generation_tokens"].Metric(labels={"model": model_name})

        def on_finish(self, reason, prompt_tokens, output_tokens, tpot_s):
            super().on_finish(reason, prompt_tokens, output_tokens, tpot_s)
            if reason not in self.by_reason:
                self.by_reason[reason] = self.families["requests_finished"].Metric(
                    labels={"model": model_name, "finish_reason": reason})
            self.by_reason[reason].increment(1)
            self.prompt.increment(prompt_tokens)
            self.generation.increment(output_tokens)

    return Counters()


class _StatMetrics:
    """The engine's snapshot (async_engine.STAT_GAUGES and STAT_COUNTERS) as this model's Triton metrics, the names
    of `k3runtime serve`'s /metrics with a model label."""

    def __init__(self, model_name: str):
        from k3runtime.async_engine import STAT_COUNTERS, STAT_GAUGES

        labels = {"model": model_name}
        self.families, self.gauges, self.counters = [], [], []  # a family must outlive its metrics
        for name, doc, field in STAT_GAUGES:
            family = pb_utils.MetricFamily(name=name, description=doc, kind=pb_utils.MetricFamily.GAUGE)
            self.families.append(family)
            self.gauges.append((family.Metric(labels=labels), field))
        for name, doc, field in STAT_COUNTERS:
            family = pb_utils.MetricFamily(name=f"{name}_total", description=doc, kind=pb_utils.MetricFamily.COUNTER)
            self.families.append(family)
            self.counters.append([family.Metric(labels=labels), field, 0])  # [metric, field, value sent]

    def publish(self, stats) -> None:
        for metric, field in self.gauges:
            metric.set(getattr(stats, field))
        for counter in self.counters:
            metric, field, sent = counter
            value = getattr(stats, field)
            if value > sent:
                metric.increment(value - sent)
                counter[2] = value

    def drop(self) -> None:
        self.gauges.clear()
        self.counters.clear()
        self.families.clear()


class TritonPythonModel:
    def initialize(self, args):
        from k3runtime.async_engine import AsyncLLMEngine, EngineDeadError
        from k3runtime.sampling_params import SamplingParams
        from k3runtime.triton_backend.params import engine_options

        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        if "engine_dir" not in params:
            raise pb_utils.TritonModelException("config.pbtxt: parameters must set 'engine_dir'")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        try:
            options = engine_options(params)
        except ValueError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        self.model_name = args["model_name"]
        self.counters = _counters(self.model_name)
        self.engine = AsyncLLMEngine(params["engine_dir"], options, metrics=self.counters)
        self.SamplingParams, self.EngineDeadError = SamplingParams, EngineDeadError
        self.max_tokens_limit = int(params.get("max_tokens_limit") or 4096)
        self.batched = cfg.get("max_batch_size", 0) > 0
        # a family must outlive its metrics (the stub refuses a metric whose family was collected)
        self.alive_family = pb_utils.MetricFamily(
            name="k3_engine_alive", description="1 while the model's k3 engine runs, 0 once it stopped",
            kind=pb_utils.MetricFamily.GAUGE)
        self.alive = self.alive_family.Metric(labels={"model": self.model_name})
        self.alive.set(1)
        self.finalizing = False
        self.responder = _Responder(self._response, self.engine.abort) if self.decoupled else None
        threading.Thread(target=self._watch, name="k3-engine-watch", daemon=True).start()
        self.stat_metrics, self._stats_done = _StatMetrics(self.model_name), threading.Event()
        self._stats_thread = threading.Thread(target=self._publish_stats, name="k3-stats", daemon=True)
        self._stats_thread.start()

    def _publish_stats(self):
        while True:
            self.stat_metrics.publish(self.engine.stats)
            if self._stats_done.wait(STATS_PERIOD_S):
                return

    def _watch(self):
        self.engine.wait_stopped()
        if not self.finalizing:
            self.alive.set(0)

    def _engine_error(self, ev: BaseException):
        """The error response for an exception the engine gave a request."""
        if isinstance(ev, (ValueError, TypeError)):  # the engine refused this request's input
            return _invalid(ev)
        if isinstance(ev, self.EngineDeadError):  # it failed, or the model is being unloaded
            return self._unavailable()
        return _error(str(ev))

    def _response(self, payload):
        """The response for what the engine thread gave the responder: an _Output, or an exception."""
        return self._engine_error(payload) if isinstance(payload, BaseException) else payload.response()

    def _unavailable(self):
        why = "being unloaded" if self.finalizing else f"stopped ({self.engine.error!r})"
        # A POST .../load of a model whose files did not change is a no-op in Triton (the dead engine stays), and
        # the default --model-control-mode=none refuses load/unload altogether: only unload + load brings it back.
        return _error(f"the k3 engine is {why}; restart the server, or (--model-control-mode=explicit) unload then "
                      f"load the model (POST /v2/repository/models/{self.model_name}/unload, then .../load)",
                      pb_utils.TritonError.UNAVAILABLE)

    def _parse(self, request):
        """(prompt ids, SamplingParams, stream) of one request; ValueError names the bad input."""
        if self.batched:  # one prompt a request: a batch of 2 would be joined into one prompt
            for t in request.inputs():
                if t.shape()[0] != 1:
                    raise ValueError(f"{t.name()}: a batch of {t.shape()[0]}; send one request a prompt, each "
                                     "input shaped [1, ...] (requests sent together are batched by the server)")
        _refuse_tensorrt_llm_parameters(request)
        text = _scalar(request, "text_input", None, str)
        ids_t = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if (text is None) == (ids_t is None):
            raise ValueError("text_input / input_ids: send exactly one of them")
        if text is not None:
            if self.engine.tokenizer is None:
                raise ValueError("text_input: the engine has no tokenizer; send input_ids")
            try:
                ids = self.engine.tokenizer.encode(text)
            except ValueError as e:
                raise ValueError(f"text_input: {e}") from None
        else:
            ids = [int(x) for x in ids_t.as_numpy().reshape(-1)]
        if not ids:
            raise ValueError("text_input / input_ids: empty prompt (at least one token is needed)")
        max_tokens = _scalar(request, "max_tokens", 16, int)
        if max_tokens > self.max_tokens_limit:
            raise ValueError(f"max_tokens: {max_tokens} is over this model's limit of {self.max_tokens_limit}")
        stop_t = pb_utils.get_input_tensor_by_name(request, "stop")
        stop = tuple(_text("stop", s) for s in stop_t.as_numpy().reshape(-1)) if stop_t is not None else ()
        if stop and self.engine.tokenizer is None:
            raise ValueError("stop: stop strings need the engine's tokenizer, and it has none; send stop_token_ids")
        seed = _scalar(request, "seed", None, int)
        stop_ids_t = pb_utils.get_input_tensor_by_name(request, "stop_token_ids")
        stop_ids = tuple(int(x) for x in stop_ids_t.as_numpy().reshape(-1)) if stop_ids_t is not None else ()
        model = self.engine.sampling_defaults  # the model's generation_config.json, for inputs a request leaves out
        sp = self.SamplingParams(max_tokens=max_tokens,
                                 temperature=_scalar(request, "temperature", model.get("temperature", 1.0), float),
                                 top_p=_scalar(request, "top_p", model.get("top_p", 1.0), float),
                                 top_k=_scalar(request, "top_k", model.get("top_k", 0), int),
                                 min_p=_scalar(request, "min_p", model.get("min_p", 0.0), float),
                                 seed=seed, stop=stop,
                                 logprobs=0 if _scalar(request, "return_log_probs", False, bool) else None,
                                 presence_penalty=_scalar(request, "presence_penalty", 0.0, float),
                                 frequency_penalty=_scalar(request, "frequency_penalty", 0.0, float),
                                 repetition_penalty=_scalar(request, "repetition_penalty",
                                                            model.get("repetition_penalty", 1.0), float),
                                 min_tokens=_scalar(request, "min_tokens", 0, int), stop_token_ids=stop_ids,
                                 ignore_eos=_scalar(request, "ignore_eos", False, bool),
                                 skip_special_tokens=_scalar(request, "skip_special_tokens", True, bool))
        return ids, sp, _scalar(request, "stream", False, bool)

    def execute(self, requests):
        if not self.engine.is_alive:
            if not self.decoupled:
                return [self._unavailable() for _ in requests]
            for request in requests:
                request.get_response_sender().send(self._unavailable(), flags=FINAL)
            return None
        if self.decoupled:
            for request in requests:
                self._start_decoupled(request)
            return None
        return self._execute_unary(requests)

    def _start_decoupled(self, request):
        try:
            ids, sp, stream = self._parse(request)
        except ValueError as e:
            request.get_response_sender().send(_invalid(e), flags=FINAL)
            return
        acc, rid = _Output(), uuid.uuid4().hex
        st, put = self.responder.open(request, rid), self.responder.put

        def on_event(ev):  # engine thread: no IPC here, the responder's thread sends
            if isinstance(ev, str):  # accepted
                return
            if isinstance(ev, BaseException):
                put(st, ev, final=True)
            elif stream:
                self.responder.put_token(st, ev)
            elif acc.add(ev).reason:
                put(st, acc, final=True)

        try:
            self.engine.submit(ids, sp, on_event, request_id=rid)
        except (self.EngineDeadError, ValueError, TypeError) as e:  # it stopped since execute looked, or refused
            put(st, e, final=True)  # the input (the other requests of the batch still start)

    def _execute_unary(self, requests):
        responses = [None] * len(requests)
        pending = []
        for i, request in enumerate(requests):
            try:
                ids, sp, stream = self._parse(request)
                if stream:
                    raise ValueError("stream: true needs the decoupled model (config.pbtxt "
                                     "model_transaction_policy { decoupled: true })")
            except ValueError as e:
                responses[i] = _invalid(e)
                continue
            done, acc, rid = threading.Event(), _Output(), uuid.uuid4().hex

            def on_event(ev, done=done, acc=acc):  # engine thread
                if isinstance(ev, str):
                    return
                if isinstance(ev, BaseException):
                    acc.error = self._engine_error(ev)
                    done.set()
                elif acc.add(ev).reason:
                    done.set()

            try:
                self.engine.submit(ids, sp, on_event, request_id=rid)
            except self.EngineDeadError:  # it stopped since execute looked
                responses[i] = self._unavailable()
                continue
            except (ValueError, TypeError) as e:  # refused: this request alone; the batch's others still run
                responses[i] = _invalid(e)
                continue
            pending.append((i, request, rid, done, acc))
        while pending:  # until each is done, or cancelled by its client (then aborted: its pages and slot freed)
            pending[0][3].wait(0.05)
            waiting = []
            for i, request, rid, done, acc in pending:
                if done.is_set():
                    responses[i] = acc.response(self.batched)
                elif request.is_cancelled():
                    self.engine.abort(rid)
                    responses[i] = _error("cancelled by the client", pb_utils.TritonError.CANCELLED)
                else:
                    waiting.append((i, request, rid, done, acc))
            pending = waiting
        return responses

    def finalize(self):
        self.finalizing = True
        self.engine.shutdown()  # its requests' last responses (503) go to the responder, which sends them before ending
        if self.responder is not None:
            self.responder.close()
        self._stats_done.set()
        self._stats_thread.join(timeout=10)  # (a publish stuck in IPC with a Triton that is going does not hold this)
        # Drop this model's metrics (a family's or metric's deletion is sent to Triton when its object goes): the stub
        # is killed after finalize without collecting them, and Triton would go on showing k3_engine_alive 1 and the
        # counters of a model that is no longer loaded.
        import gc
        self.counters.by_reason.clear()
        del self.counters.prompt, self.counters.generation
        self.counters.families.clear()
        del self.alive, self.alive_family
        self.stat_metrics.drop()
        gc.collect()
