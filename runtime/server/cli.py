"""`k3runtime serve ENGINE`: the OpenAI-compatible server on uvicorn (127.0.0.1 unless told otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import click

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _read_weight_config(path: str) -> dict:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"{p}: expected a JSON (or .toml) object: {e}",
                                 param_hint="--distributed-weight-config") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{p}: expected a JSON object at the top level, got {type(data).__name__}",
                                 param_hint="--distributed-weight-config")
    return data


@click.command("serve")
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (0.0.0.0 exposes it).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="K3_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1.")
@click.option("--model-name", default=None, help="Model id clients send [engine dir name].")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=64, show_default=True,
              help="HTTP requests generating at once.")
@click.option("--max-queue", type=click.IntRange(min=0), default=256, show_default=True,
              help="Requests waiting beyond --max-concurrent; more get 429.")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None, help="[engine max_seq_len - 1]")
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=None, help="Cap on max_tokens [max_seq_len].")
@click.option("--device", default="cpu", show_default=True)
@click.option("--num-pages", type=click.IntRange(min=1), default=None, help="KV pages [engine memory plan].")
@click.option("--enable-deepep", is_flag=True, help="Use DeepEP for expert parallelism (needs deep_ep).")
@click.option("--distributed-weight-config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON/TOML file describing where each rank's weights live (multi-rank launcher).")
@click.option("--log-level", default="info", show_default=True)
def serve_cmd(engine, host, port, api_key, model_name, max_concurrent, max_queue, max_prompt_tokens,
              max_tokens_limit, device, num_pages, enable_deepep, distributed_weight_config, log_level):
    """Serve ENGINE over the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /metrics)."""
    if enable_deepep:
        from .deepep import DeepEPUnavailable, require_deepep

        try:
            require_deepep()
        except DeepEPUnavailable as e:
            raise click.ClickException(str(e)) from None
    if distributed_weight_config:
        _read_weight_config(distributed_weight_config)
    import uvicorn

    from ..async_engine import AsyncLLMEngine
    from ..llm_engine import EngineOptions
    from ..loader import EngineError
    from .app import ServerConfig, create_app
    from .metrics import PrometheusMetrics

    try:
        ae = AsyncLLMEngine(engine, EngineOptions(device=device, num_pages=num_pages), metrics=PrometheusMetrics())
    except (EngineError, ValueError, NotImplementedError) as e:
        raise click.ClickException(str(e)) from None
    max_len = ae.engine.scheduler.config.max_model_len or 4096
    try:
        cfg = ServerConfig(model_name=model_name or Path(engine).resolve().name, api_key=api_key,
                           max_concurrent=max_concurrent, max_queue=max_queue,
                           max_prompt_tokens=max_prompt_tokens or max_len - 1, max_tokens_limit=max_tokens_limit or max_len)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if distributed_weight_config or enable_deepep:
        click.echo(f"k3runtime serve: {engine} is a single-rank engine; --enable-deepep / --distributed-weight-config "
                   "were checked and have no effect on it", err=True)
    app = create_app(ae, cfg)
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so stop the engine inside it.
    app.router.on_shutdown.append(ae.shutdown)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
    finally:
        ae.shutdown()
