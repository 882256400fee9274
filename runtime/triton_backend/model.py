"""Triton Python-backend model serving a k3build engine (copied as `<repo>/<model>/1/model.py`).

Inputs and outputs follow the TensorRT-LLM backend's spirit: `text_input` (or `input_ids`), `max_tokens`,
`temperature`, `top_p`, `top_k`, `seed`, `stream`, `stop`, `return_log_probs`, `presence_penalty`,
`frequency_penalty`, `repetition_penalty` in (no logit bias: TensorRT-LLM's backend takes bias words instead);
`text_output`, `output_ids`, `finish_reason`, `output_log_probs` (each output token's log-probability, flat; empty
unless asked) out. In decoupled mode each request is handed to the engine thread and answered from there (one
response per token when stream=true), so concurrent requests batch continuously; a cancelled request (client gone)
is aborted on the engine, which frees its pages and KDA slot.
Needs numpy<2 in the stub's environment (Triton 2.51's stub), plus k3runtime and its dependencies.
"""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


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
    """A response's tokens so far: one event's (streamed), or a request's, collected (unary and not streamed)."""

    def __init__(self):
        self.text, self.ids, self.logprobs, self.reason, self.error = [], [], [], None, None

    def add(self, ev) -> "_Output":
        self.text.append(ev.text)
        self.ids.append(ev.token_id)
        if ev.logprobs is not None:  # its request asked (return_log_probs)
            self.logprobs.append(ev.logprobs.logprob)
        self.reason = ev.finish_reason
        return self

    def response(self):
        if self.error is not None:
            return _error(self.error)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array(["".join(self.text).encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.array(self.ids, dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array([(self.reason or "").encode()], dtype=np.object_)),
            pb_utils.Tensor("output_log_probs", np.array(self.logprobs, dtype=np.float32)),
        ])


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        from k3runtime.async_engine import AsyncLLMEngine
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
        self.engine = AsyncLLMEngine(params["engine_dir"], options)
        self.SamplingParams = SamplingParams
        self.max_tokens_limit = int(params.get("max_tokens_limit") or 4096)

    def _parse(self, request):
        """(prompt ids, SamplingParams, stream) of one request; ValueError names the bad input."""
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
        seed = _scalar(request, "seed", None, int)
        sp = self.SamplingParams(max_tokens=max_tokens, temperature=_scalar(request, "temperature", 1.0, float),
                                 top_p=_scalar(request, "top_p", 1.0, float), top_k=_scalar(request, "top_k", 0, int),
                                 seed=seed, stop=stop,
                                 logprobs=0 if _scalar(request, "return_log_probs", False, bool) else None,
                                 presence_penalty=_scalar(request, "presence_penalty", 0.0, float),
                                 frequency_penalty=_scalar(request, "frequency_penalty", 0.0, float),
                                 repetition_penalty=_scalar(request, "repetition_penalty", 1.0, float))
        return ids, sp, _scalar(request, "stream", False, bool)

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self._start_decoupled(request)
            return None
        return self._execute_unary(requests)

    def _start_decoupled(self, request):
        sender = request.get_response_sender()
        try:
            ids, sp, stream = self._parse(request)
        except (ValueError, UnicodeDecodeError) as e:
            sender.send(_error(str(e)), flags=FINAL)
            return
        acc, rid = _Output(), []

        def on_event(ev):  # engine thread
            if isinstance(ev, str):  # accepted
                return
            if isinstance(ev, BaseException):
                sender.send(_error(str(ev)), flags=FINAL)
                return
            if ev.finish_reason is None and request.is_cancelled():
                self.engine.abort(rid[0])
                sender.send(flags=FINAL)
                return
            if stream:
                sender.send(_Output().add(ev).response(), flags=FINAL if ev.finish_reason else 0)
            elif acc.add(ev).reason:
                sender.send(acc.response(), flags=FINAL)

        rid.append(self.engine.submit(ids, sp, on_event))

    def _execute_unary(self, requests):
        responses = [None] * len(requests)
        pending = []
        for i, request in enumerate(requests):
            try:
                ids, sp, stream = self._parse(request)
                if stream:
                    raise ValueError("stream: true needs the decoupled model (config.pbtxt "
                                     "model_transaction_policy { decoupled: true })")
            except (ValueError, UnicodeDecodeError) as e:
                responses[i] = _error(str(e))
                continue
            done, acc = threading.Event(), _Output()

            def on_event(ev, done=done, acc=acc):  # engine thread
                if isinstance(ev, str):
                    return
                if isinstance(ev, BaseException):
                    acc.error = str(ev)
                    done.set()
                elif acc.add(ev).reason:
                    done.set()

            self.engine.submit(ids, sp, on_event)
            pending.append((i, done, acc))
        for i, done, acc in pending:
            done.wait()
            responses[i] = acc.response()
        return responses

    def finalize(self):
        self.engine.shutdown()
