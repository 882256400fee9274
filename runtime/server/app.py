"""OpenAI-compatible HTTP app over an AsyncLLMEngine: completions, chat, models, health, metrics.

Every failure a client can cause is an OpenAI-style error body with a 4xx; limits give 400
(too long / too many tokens) or 429 (server busy). Leaving a request early (client disconnect)
aborts it on the engine, which frees its pages and KDA slot.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_engine import AsyncLLMEngine
from .config import ServerConfig
from .handlers import APIError, Handlers
from .metrics import PrometheusMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, loc_path


def _error(status, message, param=None, code=None, type_="invalid_request_error"):
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class _AuthMiddleware:
    """Plain ASGI (BaseHTTPMiddleware would get in the way of streaming and disconnect detection)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(("/v1", "/metrics")):
            scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # the scheme's name is case-insensitive (RFC 9110); the key is compared in constant time
            if not (hmac.compare_digest(key, self.expected) and scheme.lower() == b"bearer"):
                resp = _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key", type_="authentication_error")
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app; `engine.metrics` should be a PrometheusMetrics (else /metrics has no histograms)."""
    app = FastAPI(title="k3runtime OpenAI-compatible server", version="1",
                  responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                             429: {"model": ErrorResponse}})
    metrics = engine.metrics if isinstance(engine.metrics, PrometheusMetrics) else PrometheusMetrics()
    h = Handlers(engine, config, metrics)
    metrics.bind(lambda: engine.stats, lambda: h.admission_waiting, lambda: engine.is_alive)
    if config.api_key is not None:
        app.add_middleware(_AuthMiddleware, api_key=config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        if e.status == 429:
            metrics.rejected.labels(e.code or "busy").inc()
        return _error(e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        errs = e.errors()
        err = errs[0]
        if err.get("type") == "json_invalid":
            return _error(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = loc[0] if loc else "body"
        same = [x for x in errs if [str(y) for y in x.get("loc", ()) if y != "body"][:1] == loc[:1]]
        if len(same) > 1:  # a union field (prompt, stop, content): pydantic reports one error per alternative
            tried = "; ".join(f"as {'.'.join(str(y) for y in x['loc'][2:]) or 'value'}: {x['msg']}" for x in same[:4])
            return _error(400, f"{field}: no accepted form matches ({tried})", param=field)
        where = loc_path([x for x in err.get("loc", ()) if x != "body"]) or "body"
        return _error(400, f"{where}: {err['msg']}", param=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        msg = e.detail if e.status_code != 400 else f"request body could not be parsed ({e.detail}); send UTF-8 JSON"
        return _error(e.status_code, str(msg))

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return _error(503, f"engine stopped: {engine.error!r}", type_="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "k3runtime",
                "max_model_len": h.max_model_len, "vocab_size": engine.vocab_size}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")  # the OpenAI clients' models.retrieve(id); an id may hold a slash
    async def model(model: str):
        if model != config.model_name:
            return _error(404, f"model {model!r} does not exist; this server serves {config.model_name!r}",
                          "model", "model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await h.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await h.chat(body, request)

    return app


