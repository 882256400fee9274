"""A small run of tools/load_test.py against the session server: exact tokens, disconnects, no leak."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
import load_test  # noqa: E402


def test_small_load_run(server):
    before = server.metrics()
    report = asyncio.run(load_test.run_load(server.url, "k3-tiny", clients=6, requests=60, max_tokens=6,
                                            num_prompts=12, disconnect_rate=0.25, seed=7,
                                            vocab=server.engine.vocab_size))
    assert report["missing"] == 0 and report["num_errors"] == 0, report
    assert report["num_mismatched"] == 0 and report["bad_prefixes"] == 0, report
    assert report["disconnected"] > 0 and report["completed"] + report["disconnected"] == 60, report
    assert report["leak"] == {} and report["ok"], report
    assert report["exact"] and 0 < report["itl_p50_ms"] <= report["itl_p99_ms"], report
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


def test_key_goes_to_loopback_only(server, monkeypatch):
    """The API key never leaves the host: a non-loopback --url is refused before any request (the model list was
    fetched from it first), and a proxy of the environment is not used for a loopback server."""
    import socket
    import threading

    with pytest.raises(SystemExit, match="loopback"):
        load_test.main(["--url", "http://192.0.2.2:9", "--api-key", "SECRET", "--requests", "1"])
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen()
    proxy.settimeout(0.2)
    seen = []

    def accept():
        while True:
            try:
                seen.append(proxy.accept())
            except TimeoutError:
                continue
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    try:
        report = asyncio.run(load_test.run_load(server.url, "k3-tiny", clients=2, requests=4, max_tokens=2,
                                                num_prompts=2, disconnect_rate=0, vocab=server.engine.vocab_size))
    finally:
        proxy.close()
    assert report["ok"] and not seen, report


def test_server_gone_mid_run_is_a_report(tiny_engine):
    """A server killed under load ends the run by itself with the requests' errors in its report (not a
    traceback, not a hang)."""
    import signal
    import threading
    import time

    import httpx

    port = load_test._free_port()
    proc = load_test._start_server(str(tiny_engine), port, [])
    url = f"http://127.0.0.1:{port}"

    def kill_once_loaded():  # after the reference run (4 requests) and the first load requests
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                m = load_test.parse_metrics(httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text)
                if sum(v for k, v in m.items() if k.startswith("k3_requests_finished_total")) >= 6:
                    break
                time.sleep(0.05)
        finally:  # the server goes whatever happened here
            proc.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_once_loaded)
    killer.start()
    try:
        report = asyncio.run(load_test.run_load(url, "load-test", clients=4, requests=400, max_tokens=6,
                                                num_prompts=4, disconnect_rate=0, idle_timeout=2))
    finally:
        killer.join()
        proc.wait(30)
    assert not report["ok"] and report["num_errors"] > 0 and report["missing"] == 0, report
    assert "metrics" in report["leak"], report


def test_inexact_check_takes_length_or_stop():
    """Without exact tokens (a bf16 engine) a completed request must end as max_tokens says."""
    ends = load_test._ends_right
    assert ends({"ids": [1, 2, 3], "reason": "length"}, 3) and ends({"ids": [1], "reason": "stop"}, 3)
    assert not ends({"ids": [1, 2], "reason": "length"}, 3)  # a token lost
    assert not ends({"ids": [1, 2, 3, 4], "reason": "length"}, 3)  # one too many
    assert not ends({"ids": [], "reason": "stop"}, 3) and not ends({"ids": [1, 2, 3], "reason": None}, 3)


def test_no_server_is_a_report():
    """Nothing listening: the reference run fails, and the report says so (no traceback); a latency nothing
    measured is null in the JSON report (not NaN, which strict JSON readers refuse)."""
    import json

    url = f"http://127.0.0.1:{load_test._free_port()}"
    report = asyncio.run(load_test.run_load(url, "m", requests=3))
    assert not report["ok"] and "ConnectError" in report["reference_error"], report
    assert json.dumps({"itl": load_test._ms(load_test._pct([], 0.5))}) == '{"itl": null}'


@pytest.mark.parametrize("args, want", [
    (["--engine", "/nonexistent"], "argument --engine: /nonexistent: not an engine dir (no config.json"),
    (["--url", "http://127.0.0.1:1", "--clients", "0"], "argument --clients: expected a count >= 1, got '0'"),
    (["--url", "http://127.0.0.1:1", "--disconnect-rate", "1.5"], "--disconnect-rate: expected a fraction in [0, 1]"),
])
def test_bad_arguments_are_usage_errors(args, want, capsys):
    """Before, a missing engine dir ended in a FileNotFoundError traceback and counts below 1 were taken."""
    with pytest.raises(SystemExit) as e:
        load_test.main(args)
    assert e.value.code == 2 and want in capsys.readouterr().err
