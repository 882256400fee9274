"""Prometheus metrics: engine hooks (histograms, counters) plus gauges read from the engine's snapshot."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..async_engine import STAT_COUNTERS, STAT_GAUGES, EngineStats, Metrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
THROUGHPUT_WINDOW_S = 10.0


class PrometheusMetrics(Metrics):
    """One registry per server (tests start several in one process)."""

    def __init__(self):
        super().__init__()
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("k3_time_to_first_token_seconds", "Submission to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("k3_time_per_output_token_seconds", "Mean gap between output tokens of a request.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("k3_requests_finished", "Finished requests.", ["finish_reason"], registry=r)
        self.rejected = Counter("k3_requests_rejected", "Requests refused before running.", ["reason"], registry=r)
        self.prompt = Counter("k3_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation = Counter("k3_generation_tokens", "Generated tokens.", registry=r)
        self._window: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._stats: Callable[[], EngineStats] = EngineStats
        self._server_waiting: Callable[[], int] = lambda: 0
        self._alive: Callable[[], bool] = lambda: True
        r.register(_Gauges(self))

    def bind(self, stats: Callable[[], EngineStats], server_waiting: Callable[[], int],
             alive: Callable[[], bool] = lambda: True) -> None:
        self._stats, self._server_waiting, self._alive = stats, server_waiting, alive

    # engine-thread hooks
    def on_first_token(self, ttft_s):
        self.ttft.observe(ttft_s)

    def on_finish(self, reason, prompt_tokens, output_tokens, tpot_s):
        super().on_finish(reason, prompt_tokens, output_tokens, tpot_s)
        self.finished.labels(reason).inc()
        self.prompt.inc(prompt_tokens)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def on_step(self, num_tokens, seconds):
        self.generation.inc(num_tokens)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, num_tokens))
            while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
                self._window.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            n = sum(k for t, k in self._window if t >= now - THROUGHPUT_WINDOW_S)
        return n / THROUGHPUT_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges:
    """Collector evaluated at scrape time, so the gauges never lag the engine."""

    def __init__(self, m: PrometheusMetrics):
        self.m = m

    def collect(self):
        s = self.m._stats()
        for name, doc, value in [
            ("k3_queue_length", "Requests waiting (server admission queue + scheduler queue).",
             s.num_waiting + self.m._server_waiting()),
            *((name, doc, getattr(s, field)) for name, doc, field in STAT_GAUGES),
            ("k3_generation_tokens_per_second", f"Generated tokens/s over the last {THROUGHPUT_WINDOW_S:g} s.",
             self.m.tokens_per_second()),
            ("k3_engine_alive", "1 while the engine runs, 0 once it stopped (/health then answers 503).",
             int(self.m._alive())),
        ]:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        for name, doc, field in STAT_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(s, field))


def parse_metrics(text: str) -> dict[str, float]:
    """{sample name with labels: value} of a Prometheus text page (for tests and the load test)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
