"""Bounded load test of the OpenAI server on loopback (stops by itself).

    python tools/load_test.py --engine ENGINE_DIR [--clients 16] [--requests 1000] [--max-tokens 4]
    python tools/load_test.py --url http://127.0.0.1:8000 --model NAME ...

1. A reference: every distinct (prompt, max_tokens) once, sequentially, greedy, non-streaming.
2. The load: N concurrent streaming clients share M requests; each request is a random prompt of the
   pool; a fraction disconnects mid-stream after a random number of tokens.
3. Checks: each request that was not cut got exactly its reference tokens and finish reason, once (no
   token lost or duplicated); a cut one got a prefix of them; afterwards /metrics shows no request
   running or queued and zero KV pages and KDA slots in use (no leak).
   Exact tokens need an engine whose greedy tokens do not depend on what else is in the batch: an fp32 engine
   (`k3build build --dtype fp32 --kv-dtype fp32`). A bf16 engine rounds differently in a batch of another size,
   so its greedy tokens drift apart after a while; there (--no-exact, the default for a bf16 --engine) a
   completed request must end in "length" with max_tokens tokens or in "stop" with fewer.
Prints p50/p99 time to first token and between tokens, and throughput; --json writes the report.
A server that fails mid-run ends the run with its errors in the report (exit 1), not a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
from arg_types import count, engine_dir

from k3runtime.server.metrics import parse_metrics


def _loopback(url: str) -> None:
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: not resolved, refused
        loopback = False
    if not loopback:
        raise SystemExit(f"--url {url}: the load test only targets loopback addresses (127.0.0.0/8, ::1, localhost)")


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _ms(seconds: float | None) -> float | None:
    """None (JSON null) where nothing was measured (no second token, every request failed)."""
    return None if seconds is None else round(1000 * seconds, 2)


async def _reference(c: httpx.AsyncClient, model: str, pool: list[tuple[list[int], int]]) -> list[dict]:
    refs = []
    for ids, n in pool:
        r = await c.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": n, "temperature": 0,
                                                  "return_token_ids": True})
        r.raise_for_status()
        ch = r.json()["choices"][0]
        refs.append({"ids": ch["token_ids"], "reason": ch["finish_reason"]})
    return refs


async def _one(c: httpx.AsyncClient, model: str, ids: list[int], n: int, cut_after: int | None) -> dict:
    """One streaming request; cut_after = disconnect after that many token events (None = read to the end)."""
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
            "return_token_ids": True}
    t0 = last = time.perf_counter()
    out = {"ids": [], "reason": None, "ttft": None, "gaps": [], "done": False, "cut": False, "status": None}
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                out["error"] = r.text
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    out["error"] = ev["error"]
                    break
                ch = ev["choices"][0]
                now = time.perf_counter()
                if out["ttft"] is None:
                    out["ttft"] = now - t0
                elif ch["token_ids"]:
                    out["gaps"].append(now - last)
                last = now
                out["ids"] += ch["token_ids"]
                out["reason"] = ch["finish_reason"] or out["reason"]
                if cut_after is not None and len(out["ids"]) >= cut_after:
                    out["cut"] = True
                    break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:  # the server went away or stalled: an error of this request
        out["error"] = f"{type(e).__name__}: {e}"
    out["latency"] = time.perf_counter() - t0
    return out


def _client(url: str, api_key: str | None, **kw) -> httpx.AsyncClient:
    """Loopback only, and never through a proxy of the environment (the API key stays on this host)."""
    _loopback(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, trust_env=False, **kw)


async def run_load(url: str, model: str, *, clients: int = 8, requests: int = 100, max_tokens: int = 4,
                   num_prompts: int = 32, disconnect_rate: float = 0.1, seed: int = 0, vocab: int = 256,
                   api_key: str | None = None, idle_timeout: float = 30.0, exact: bool = True) -> dict:
    """exact: each completed request's tokens must equal the reference's (an fp32 engine, see above)."""
    rng = random.Random(seed)
    pool = [([rng.randrange(1, vocab) for _ in range(rng.randint(2, 24))], rng.randint(1, max_tokens))
            for _ in range(num_prompts)]
    limits = httpx.Limits(max_connections=clients + 2)
    async with _client(url, api_key, timeout=120, limits=limits) as c:
        try:
            refs = await _reference(c, model, pool)
        except httpx.HTTPError as e:  # no reference, no run: the report says why
            return {"requests": requests, "ok": False, "reference_error": f"{type(e).__name__}: {e}"}
        plan = []
        for j in range(requests):
            k = rng.randrange(num_prompts)
            n_ref = len(refs[k]["ids"])
            cut = rng.randint(1, n_ref - 1) if n_ref > 1 and rng.random() < disconnect_rate else None
            plan.append((j, k, cut))
        results: dict[int, dict] = {}
        todo = list(plan)

        async def worker():
            while todo:
                j, k, cut = todo.pop()
                results[j] = {"k": k, **await _one(c, model, pool[k][0], pool[k][1], cut)}

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
        # Aborts reach the engine thread asynchronously: wait (bounded) for the pools to drain.
        deadline = time.monotonic() + idle_timeout
        while True:
            try:
                m = parse_metrics((await c.get("/metrics")).text)
            except httpx.HTTPError as e:
                busy = {"metrics": f"unreadable ({type(e).__name__}: {e})"}
                break
            busy = {k: m[k] for k in ("k3_requests_running", "k3_queue_length", "k3_kv_pages_used",
                                      "k3_kda_slots_used") if m.get(k)}
            if not busy or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)

    errors, mismatched, cut_bad = [], [], []
    for j, res in sorted(results.items()):
        ref = refs[res["k"]]
        if res["status"] != 200 or res.get("error"):
            errors.append((j, res["status"], res.get("error")))
        elif res["cut"]:
            if exact and res["ids"] != ref["ids"][:len(res["ids"])]:
                cut_bad.append(j)
        elif not res["done"] or (res["ids"] != ref["ids"] or res["reason"] != ref["reason"] if exact else
                                 not _ends_right(res, pool[res["k"]][1])):
            mismatched.append({"request": j, "got": res["ids"], "want": ref["ids"], "reason": res["reason"]})
    full = [r for r in results.values() if not r["cut"] and r["status"] == 200]
    ttfts = [r["ttft"] for r in results.values() if r["ttft"] is not None]
    gaps = [g for r in results.values() for g in r["gaps"]]
    tokens = sum(len(r["ids"]) for r in results.values())
    return {
        "requests": requests, "completed": len(full), "disconnected": sum(r["cut"] for r in results.values()),
        "missing": requests - len(results), "errors": errors[:10], "num_errors": len(errors),
        "mismatched": mismatched[:5], "num_mismatched": len(mismatched), "bad_prefixes": len(cut_bad),
        "leak": busy, "clients": clients, "max_tokens": max_tokens, "wall_s": round(wall, 3),
        "ttft_p50_ms": _ms(_pct(ttfts, 0.5)), "ttft_p99_ms": _ms(_pct(ttfts, 0.99)),
        "itl_p50_ms": _ms(_pct(gaps, 0.5)), "itl_p99_ms": _ms(_pct(gaps, 0.99)),
        "exact": exact,
        "requests_per_s": round(len(results) / wall, 2), "tokens_per_s": round(tokens / wall, 2),
        "ok": not (errors or mismatched or cut_bad or busy) and len(results) == requests,
    }


def _ends_right(res: dict, max_tokens: int) -> bool:
    """Without exact tokens: max_tokens of them and "length", or fewer and "stop"."""
    n = len(res["ids"])
    return (res["reason"], n) == ("length", max_tokens) or (res["reason"] == "stop" and 0 < n <= max_tokens)


def _engine_is_fp32(engine: str) -> bool:
    build = json.loads((Path(engine) / "config.json").read_text())["build_config"]
    return build["dtype"] == "fp32" and build["kv_dtype"] == "fp32"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(engine: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k3runtime.cli", "serve", str(engine), "--host", "127.0.0.1", "--port", str(port),
           "--model-name", "load-test", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("server did not become healthy in 120 s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--engine", type=engine_dir,
                   help="start `k3runtime serve ENGINE` on a free loopback port for the run")
    g.add_argument("--url", help="an already running server (loopback only)")
    ap.add_argument("--model", default="load-test")
    ap.add_argument("--clients", type=count, default=16)
    ap.add_argument("--requests", type=count, default=1000)
    ap.add_argument("--max-tokens", type=count, default=4)
    ap.add_argument("--prompts", type=count, default=32)
    ap.add_argument("--disconnect-rate", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=os.environ.get("K3_API_KEY"))
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `k3runtime serve` argument")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                    help="require each request's reference tokens [default: yes, but no for a --engine not fp32]")
    a = ap.parse_args(argv)
    if not 0 <= a.disconnect_rate <= 1:
        ap.error(f"--disconnect-rate: expected a fraction in [0, 1], got {a.disconnect_rate}")
    proc = None
    url, model = a.url, a.model
    exact = a.exact
    if a.engine:
        if exact is None and not _engine_is_fp32(a.engine):
            exact = False
            print(f"{a.engine}: not an fp32 engine, so its greedy tokens depend on the batch: checking each "
                  "request's length and finish reason, not its tokens (--exact to insist)", file=sys.stderr)
        port = _free_port()
        proc, url, model = _start_server(a.engine, port, a.serve_arg), f"http://127.0.0.1:{port}", "load-test"
    try:
        async def models():
            async with _client(url, a.api_key, timeout=30) as c:
                r = await c.get("/v1/models")
                r.raise_for_status()
                return r.json()["data"][0].get("vocab_size", 256)

        try:
            vocab = asyncio.run(models())
        except httpx.HTTPError as e:
            raise SystemExit(f"{url}/v1/models: {type(e).__name__}: {e}") from None
        report = asyncio.run(run_load(url, model, clients=a.clients, requests=a.requests, max_tokens=a.max_tokens,
                                      num_prompts=a.prompts, disconnect_rate=a.disconnect_rate, seed=a.seed,
                                      vocab=vocab, api_key=a.api_key, exact=exact is not False))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(report, indent=2))
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
