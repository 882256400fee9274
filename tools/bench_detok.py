"""Detokenizing one decode step's tokens, as the engine loop does between steps (JSON lines).

    python tools/bench_detok.py [--batches 32,64,128] [--outputs 256,1024,4096] [--steps 20] [--engine DIR]

N requests, each OUTPUT tokens into its answer, push their next token through a Detokenizer with a stop string
(runtime/tokenizer.py, windows of a few tokens). Medians over STEPS steps of the whole batch: detok_ms. The baseline,
whole_ms, decodes each request's whole output at every token (what Detokenizer did before the windows); the floor,
floor_ms, decodes each new token alone, once. The tokenizer is the engine's (--engine) or the tiny synthetic one;
the tokens are the README's, so every request's output is real text.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from k3runtime.tokenizer import Detokenizer, Tokenizer

from arg_types import count, counts

ROOT = Path(__file__).resolve().parents[1]


def _tokenizer(engine: str | None) -> Tokenizer:
    if engine:
        return Tokenizer(engine)
    from k3build.config import preset
    from k3build.tokenizer import write_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench_detok_") as out:  # Tokenizer reads its files at once
        write_tokenizer(out, preset("tiny"))
        return Tokenizer(out)


def _median_ms(step, steps: int) -> float:
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(tok: Tokenizer, batch: int, output: int, steps: int, text: list[int]) -> dict:
    # Request r's tokens: the README's, from offset 7r, so that requests differ.
    ids = [[text[(7 * r + i) % len(text)] for i in range(output + steps)] for r in range(batch)]
    dets = []
    for r in range(batch):
        det = Detokenizer(tok, ("\n\n\n",))
        for t in ids[r][:output]:
            det.push(t)
        dets.append(det)

    def incremental(k):
        for r in range(batch):
            dets[r].push(ids[r][output + k])

    def whole(k):
        for r in range(batch):
            tok.decode(ids[r][:output + k + 1])

    def floor(k):
        for r in range(batch):
            tok.decode([ids[r][output + k]])

    detok, base, least = (_median_ms(f, steps) for f in (incremental, whole, floor))
    # ms to 6 places: the floor of a small batch is a few µs, and x_floor must agree with the printed figures
    return {"bench": "detok", "batch": batch, "output": output, "detok_ms": round(detok, 6),
            "whole_ms": round(base, 6), "floor_ms": round(least, 6), "x_floor": round(detok / least, 2),
            "whole_x_detok": round(base / detok, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=counts, default="32,64,128")
    ap.add_argument("--outputs", type=counts, default="256,1024,4096")
    ap.add_argument("--steps", type=count, default=20)
    ap.add_argument("--engine", help="an engine directory whose tokenizer to use (default: the tiny synthetic one)")
    args = ap.parse_args()
    if args.engine and not (Path(args.engine) / "tokenizer.json").is_file():
        ap.error(f"--engine {args.engine}: no tokenizer.json there (the engine dir of a checkpoint with a tokenizer)")
    tok = _tokenizer(args.engine)
    text = tok.encode((ROOT / "README.md").read_text())
    print(json.dumps({"bench": "detok_env", "machine": platform.processor() or platform.machine(),
                      "python": platform.python_version(), "vocab": tok.vocab_size, "text_tokens": len(text)}))
    for batch in args.batches:
        for output in args.outputs:
            print(json.dumps(run(tok, batch, output, args.steps, text)), flush=True)


if __name__ == "__main__":
    main()
