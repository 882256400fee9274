"""Shared fixtures: one tiny engine per session, in-process OpenAI servers on loopback ports."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from liveness import free_port

BIN = Path(sys.executable).parent


def _k3build(*args):
    r = subprocess.run([str(BIN / "k3build"), *args], capture_output=True, text=True)
    assert r.returncode == 0, f"k3build {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory) -> Path:
    if os.environ.get("K3_SERVER_TEST_ENGINE"):  # a prebuilt tiny engine (local iteration)
        return Path(os.environ["K3_SERVER_TEST_ENGINE"])
    root = tmp_path_factory.mktemp("tiny")
    _k3build("synth", str(root / "ckpt"), "--preset", "tiny")
    _k3build("convert", str(root / "ckpt"), str(root / "conv"), "--tp-size", "1")
    _k3build("build", str(root / "conv"), str(root / "engine"), "--dtype", "fp32", "--kv-dtype", "fp32")
    return root / "engine"


@pytest.fixture(scope="session")
def llm(tiny_engine):
    from k3runtime import LLM

    return LLM(tiny_engine)


@pytest.fixture(scope="session")
def special_output(llm, tiny_engine):
    """(the engine's tokenizer in transformers, the oracle of its decoding; a greedy output of 24 tokens past EOS
    that holds special tokens among others: the tiny model's tokens are random, so a prompt is looked for)"""
    from transformers import AutoTokenizer

    from k3runtime import SamplingParams

    hf = AutoTokenizer.from_pretrained(tiny_engine)
    special = set(hf.all_special_ids)
    outs = (llm.generate([a, 14, 15], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
            for a in range(7, 200))
    return hf, next(o for o in outs if special & set(o.token_ids[1:-1]) and not set(o.token_ids) <= special)


class LiveServer:
    """uvicorn in a thread of this process, serving create_app(engine, config) on 127.0.0.1."""

    def __init__(self, engine_dir, engine_options=None, **config):
        import uvicorn

        from k3runtime.async_engine import AsyncLLMEngine
        from k3runtime.engine_options import EngineOptions
        from k3runtime.server.app import create_app
        from k3runtime.server.config import ServerConfig
        from k3runtime.server.metrics import PrometheusMetrics

        self.engine = AsyncLLMEngine(engine_dir, engine_options or EngineOptions(), metrics=PrometheusMetrics())
        self.config = ServerConfig(**{"model_name": "k3-tiny", **config})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.engine, self.config), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        import httpx

        from k3runtime.server.metrics import parse_metrics

        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        return parse_metrics(httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Metrics once no request runs or waits (raises if it never gets there)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["k3_requests_running"] == 0 and m["k3_queue_length"] == 0 and m["k3_kv_pages_used"] == 0 \
                    and m["k3_kda_slots_used"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.engine.shutdown()


@pytest.fixture(scope="session")
def server(tiny_engine):
    s = LiveServer(tiny_engine, max_prompt_tokens=256, max_tokens_limit=64)
    yield s
    s.close()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def make_server():
    """LiveServer factory for tests that need their own limits (call .close() when done)."""
    return LiveServer
