"""A decode step's sampling as the driver does it, with penalties or logprobs beside plain sampling (JSON lines).

    python tools/bench_sampling.py [--device cuda] [--rows 32,128] [--outputs 1024,8192] [--vocab 163840]
                                   [--steps 20]

ROWS requests each sample one token from fp32 logits [ROWS, VOCAB] (K3's vocabulary by default) through
llm_engine.sample_step, at temperature 0.8 and top-p 0.95:
- plain_ms: that alone;
- before_ms: the same with the draw as torch ops and top-p by the sort (sampler.TRITON_DRAW and TRITON_TOP_P off:
  the sampler before the thirty-fifth session), the baseline of plain_ms (on a CPU both are the torch ops); the
  same draws (same_tokens_as_before checks it);
- triton_top_p_ms / sorted_top_p_ms: plain with top-p's kept set from Triton's histograms (sampler.TRITON_TOP_P on,
  on a GPU) / from the sort (off); same_tokens_triton_top_p checks the histograms' draws against the sort's
  (triton_kernels: whether the flags chose Triton kernels, as they do on a GPU only);
- penalized_ms: every row also with frequency, presence and repetition penalties, in a decode step after the first:
  it brings the one token sampled since (the plan's SeenTokens), the counts kept on the sampling rank, its own
  last token still on the device (async scheduling's case);
- penalized_first_ms: the first such step of each row on its slot, which brings OUTPUT - 1 earlier tokens and a
  prompt of 1024 distinct ids (a request admitted, or back after preemption);
- logprobs_ms: plain, every row also asking for 5 alternatives (runtime/logprobs.py).
The floor, floor_ms, reads the logits once (a max over the vocabulary). Each figure is the median over STEPS calls,
the device synchronized after each (the driver reads the ids next); x_floor and x_plain are its ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from k3runtime import sampler
from k3runtime.llm_engine import sample_step, sample_with_logprobs
from k3runtime.penalties import SeenCounts
from k3runtime.rank_runner import Step
from k3runtime.request import PLACEHOLDER
from k3runtime.sampling_params import SamplingParams
from k3runtime.scheduler import ScheduledItem, SeenTokens

from arg_types import count, counts

PROMPT_IDS = 1024  # distinct prompt ids a repetition penalty counts


def _median_ms(call, steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps + 1):  # the first call warms up
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _step(params: SamplingParams, rows: int, seen: list[SeenTokens] | None = None, index: int = 0) -> Step:
    """One decode item a row (in slot i), fed its last token (async scheduling); with `seen`, its SeenTokens, and
    it samples output token `index`."""
    return Step(tuple(ScheduledItem(str(i), (PLACEHOLDER,), 100, 1, True, i, (0,), params, i, index,
                                    seen=None if seen is None else seen[i]) for i in range(rows)),
                feed=tuple((i, i) for i in range(rows)))


class _Decode:
    """Penalized decode steps as the sampling rank sees them: the first brings each row's OUTPUT - 1 known tokens
    (fresh: what a request's first step on a slot costs); each later one the token the step before sampled, the
    counts kept in between (SeenCounts), the step's own last token fed."""

    def __init__(self, params, rows, outputs, prompt, logits, fed):
        self.params, self.rows, self.outputs, self.prompt, self.logits, self.fed = params, rows, outputs, prompt, \
            logits, fed
        self.store, self.known = None, 0

    def first(self):
        self.store, self.known = SeenCounts(), len(self.outputs[0]) - 1
        seen = [SeenTokens(self.prompt, tuple(o[:self.known])) for o in self.outputs]
        return sample_step(_step(self.params, self.rows, seen, self.known + 1), self.logits, self.fed, self.store)

    def next(self):
        seen = [SeenTokens((), (o[self.known % len(o)],), self.known, fresh=False) for o in self.outputs]
        self.known += 1
        return sample_step(_step(self.params, self.rows, seen, self.known + 1), self.logits, self.fed, self.store)


def _with(call, **flags):
    """call() with the sampler's flags (TRITON_DRAW, TRITON_TOP_P) set as given."""
    old = {name: getattr(sampler, name) for name in flags}
    for name, value in flags.items():
        setattr(sampler, name, value)
    try:
        return call()
    finally:
        for name, value in old.items():
            setattr(sampler, name, value)


def run(device: torch.device, rows: int, output: int, vocab: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(rows + output)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    outputs = torch.randint(0, vocab, (rows, output), generator=g).tolist()
    fed = torch.tensor([o[-1] for o in outputs], device=device)
    prompt = tuple(sorted(torch.randperm(vocab, generator=g)[:PROMPT_IDS].tolist()))
    plain = SamplingParams(temperature=0.8, top_p=0.95)
    penal = SamplingParams(temperature=0.8, top_p=0.95, frequency_penalty=0.5, presence_penalty=0.5,
                           repetition_penalty=1.1)
    asks = SamplingParams(temperature=0.8, top_p=0.95, logprobs=5)
    decode = _Decode(penal, rows, outputs, prompt, logits, fed)
    decode.first()

    def plain_step(**flags):  # plain sampling, with the sampler's flags set as given
        return _with(lambda: sample_step(_step(plain, rows), logits, fed), **flags)

    figures = {
        "plain_ms": _median_ms(plain_step, steps, device),
        "before_ms": _median_ms(lambda: plain_step(TRITON_DRAW=False, TRITON_TOP_P=False), steps, device),
        "triton_top_p_ms": _median_ms(lambda: plain_step(TRITON_TOP_P=True), steps, device),
        "sorted_top_p_ms": _median_ms(lambda: plain_step(TRITON_TOP_P=False), steps, device),
        "penalized_ms": _median_ms(decode.next, steps, device),
        "penalized_first_ms": _median_ms(decode.first, steps, device),
        "logprobs_ms": _median_ms(lambda: sample_with_logprobs(_step(asks, rows), logits, fed), steps, device),
        "floor_ms": _median_ms(lambda: logits.max(dim=-1), steps, device),
    }
    out = {"bench": "sampling", "rows": rows, "output": output, "vocab": vocab,
           **{k: round(v, 6) for k, v in figures.items()}}
    for case in ("plain", "penalized", "penalized_first", "logprobs"):
        out[f"{case}_x_floor"] = round(figures[f"{case}_ms"] / figures["floor_ms"], 2)
    # both ways draw the same tokens (seeded draws: the same call twice gives the same ids); the flags select
    # Triton kernels only on a GPU: elsewhere both sides are the torch ops
    out["triton_kernels"] = logits.is_cuda
    out["same_tokens_as_before"] = torch.equal(plain_step(), plain_step(TRITON_DRAW=False, TRITON_TOP_P=False))
    out["same_tokens_triton_top_p"] = torch.equal(plain_step(TRITON_TOP_P=True), plain_step(TRITON_TOP_P=False))
    out["triton_top_p_x_before"] = round(figures["triton_top_p_ms"] / figures["before_ms"], 3)
    out["triton_top_p_x_sorted"] = round(figures["triton_top_p_ms"] / figures["sorted_top_p_ms"], 3)
    out["plain_x_before"] = round(figures["plain_ms"] / figures["before_ms"], 3)
    for case in ("penalized", "penalized_first", "logprobs"):
        out[f"{case}_x_plain"] = round(figures[f"{case}_ms"] / figures["plain_ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=counts, default="32,128")
    ap.add_argument("--outputs", type=counts, default="1024,8192")
    ap.add_argument("--vocab", type=count, default=163840)
    ap.add_argument("--steps", type=count, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(json.dumps({"bench": "sampling_env", "device": name, "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d")}), flush=True)
    for rows in args.rows:
        for output in args.outputs:
            print(json.dumps(run(device, rows, output, args.vocab, args.steps)), flush=True)


if __name__ == "__main__":
    main()
