"""`k3runtime serve ENGINE`: the OpenAI-compatible server on uvicorn (127.0.0.1 unless told otherwise)."""

from __future__ import annotations

import errno
import socket
import threading
from pathlib import Path

import click

from ..engine_flags import (as_options, device_option, engine_flags, given, sequence_limits, use_weight_config,
                            weight_config_option)


def _check_serve_extra() -> None:
    """ClickException naming the install command when the server's optional packages are missing (the main
    install, tools/demo.sh's, leaves them out)."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(f"serve needs the server's packages, missing here: {', '.join(missing)}; install "
                                   "them with pip install -e '.[serve]' in the k3build checkout")


def _check_bindable(host: str, port: int) -> None:
    """ClickException when host:port cannot be bound now (uvicorn would find out only after the engine loaded)."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:  # a name that does not resolve, or no address of this family
        raise click.ClickException(f"--host {host}: cannot resolve it ({e.strerror or e}); give an IP address or "
                                   "host name of this machine to listen on, e.g. 127.0.0.1") from None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not block
            s.bind((host, port))
    except OSError as e:
        hint = "is another server on it?" if e.errno == errno.EADDRINUSE else "is the address this machine's?"
        raise click.ClickException(f"--host {host} --port {port}: cannot bind ({e.strerror or e}); {hint}") from None


@click.command("serve")
@click.argument("engine", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (0.0.0.0 exposes it).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="K3_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1 and /metrics (/health stays open).")
@click.option("--model-name", default=None, help="Model id clients send [engine dir name].")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=64, show_default=True,
              help="HTTP requests generating at once.")
@click.option("--max-queue", type=click.IntRange(min=0), default=256, show_default=True,
              help="Requests waiting beyond --max-concurrent; more get 429.")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Longest prompt accepted, at most the engine's max_seq_len - 1 [that].")
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=None,
              help="Cap on a request's max_tokens, at most the engine's max_seq_len [that].")
@device_option
@engine_flags
@click.option("--enable-deepep", is_flag=True,
              help="Exchange experts with DeepEP: refuse to start unless deep_ep imports and its low-latency "
                   "limits (top-k, hidden size; $K3_DEEPEP_CAPS = a JSON file of them) cover the model.")
@weight_config_option
@click.option("--enforce-eager", is_flag=True, help="Run decode steps eagerly instead of replaying CUDA graphs.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]),
              default="info", show_default=True, help="uvicorn's log level.")
def serve_cmd(engine, host, port, api_key, model_name, max_concurrent, max_queue, max_prompt_tokens,
              max_tokens_limit, device, enable_deepep, distributed_weight_config, enforce_eager, log_level, **flags):
    """Serve ENGINE over the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics)."""
    _check_serve_extra()
    use_weight_config(distributed_weight_config)
    _check_bindable(host, port)  # before the engine loads: a real K3 rank takes minutes to read
    import uvicorn

    from ..async_engine import AsyncLLMEngine
    from ..engine_options import EngineOptions
    from ..loader import EngineError, default_device, read_engine_config
    from .app import create_app
    from .config import ServerConfig
    from .metrics import PrometheusMetrics

    try:
        # the limits against the engine's config, before its weights load
        engine_config = read_engine_config(engine)
        device = device or default_device(engine_config)
        max_prompt_tokens, max_tokens_limit = sequence_limits(engine_config, max_prompt_tokens, max_tokens_limit)
        cfg = ServerConfig(model_name=model_name or Path(engine).resolve().name, api_key=api_key,
                           max_concurrent=max_concurrent, max_queue=max_queue,
                           max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit)
    except (EngineError, ValueError) as e:
        raise click.ClickException(as_options(str(e))) from None
    try:
        ae = AsyncLLMEngine(engine, EngineOptions(device=device, enable_deepep=enable_deepep,
                                                   cuda_graphs=not enforce_eager, load_progress=True, **given(flags)),
                            metrics=PrometheusMetrics())
    except (EngineError, ValueError, NotImplementedError) as e:
        raise click.ClickException(as_options(str(e))) from None
    if enable_deepep and ae.engine.world_size == 1:
        click.echo(f"k3runtime serve: {engine} is a single-rank engine; --enable-deepep was checked and has no "
                   "effect on it (no expert exchange)", err=True)
    click.echo(f"k3runtime serve: async scheduling {'on' if ae.engine.options.async_scheduling else 'off'}"
               f"{'' if flags['async_scheduling'] is not None else ' (the default for this engine and device)'}",
               err=True)
    if ae.engine.options.preemption_mode == "swap":
        sched = ae.engine.scheduler
        click.echo(f"k3runtime serve: preempted requests swap to a host store of {sched.host_page_pool.num_pages} "
                   f"pages and {sched.host_slot_pool.num_slots} KDA slots a rank", err=True)
    if ae.engine.runner.graphs_off:
        click.echo(f"k3runtime serve: decode steps run eagerly, not from CUDA graphs: {ae.engine.runner.graphs_off}",
                   err=True)
    app = create_app(ae, cfg)
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so stop the engine inside it.
    app.router.on_shutdown.append(ae.shutdown)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=10))
    if ae.engine.world_size > 1:
        # A multi-rank engine that stops (a rank hung or gone) ends the server, and its error ends the job: the
        # launcher names the silent rank and torchrun stops the others. (One rank's server stays up, answering
        # 503 and /health's failure, for its supervisor to restart.)
        threading.Thread(target=lambda: ae.wait_stopped() and setattr(server, "should_exit", True),
                         name="k3-engine-watch", daemon=True).start()
    try:
        server.run()
    finally:
        ae.shutdown()
    if ae.engine.world_size > 1 and ae.error is not None:
        raise ae.error
