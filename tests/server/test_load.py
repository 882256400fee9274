"""A small run of tools/load_test.py against the session server: exact tokens, disconnects, no leak."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("load_test", Path(__file__).parents[2] / "tools/load_test.py")
load_test = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load_test)


def test_small_load_run(server):
    before = server.metrics()
    report = asyncio.run(load_test.run_load(server.url, "k3-tiny", clients=6, requests=60, max_tokens=6,
                                            num_prompts=12, disconnect_rate=0.25, seed=7,
                                            vocab=server.engine.vocab_size))
    assert report["missing"] == 0 and report["num_errors"] == 0, report
    assert report["num_mismatched"] == 0 and report["bad_prefixes"] == 0, report
    assert report["disconnected"] > 0 and report["completed"] + report["disconnected"] == 60, report
    assert report["leak"] == {} and report["ok"], report
    m = server.wait_idle()
    # Every request of the run finished exactly once on the engine (12 reference + 60 load requests).
    done = sum(v for k, v in m.items() if k.startswith("k3_requests_finished_total"))
    done_before = sum(v for k, v in before.items() if k.startswith("k3_requests_finished_total"))
    assert done - done_before == 72
    aborts = m.get('k3_requests_finished_total{finish_reason="abort"}', 0) - \
        before.get('k3_requests_finished_total{finish_reason="abort"}', 0)
    # A cut stream may still finish normally if its last token was already produced when the client left.
    assert 0 < aborts <= report["disconnected"]


def test_load_test_refuses_non_loopback():
    with pytest.raises(SystemExit, match="loopback"):
        asyncio.run(load_test.run_load("http://192.0.2.1:8000", "m", requests=1))
    with pytest.raises(SystemExit, match="loopback"):
        asyncio.run(load_test.run_load("http://example.com:8000", "m", requests=1))
