"""Probe run inline between the two forms of batch102 (twenty-eighth session): is the GPU engine's pick at
request 2, step 4 of the preemption case (test_gpu_engine) bf16 noise or the preemption? The prompt [9, 8, 7]
greedy on the sm90 bf16 engine: alone sync, alone async, in the case's batch sync and async, recompute; with the
fp32 CPU engine's top-3 at each step."""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "tests/model")
from engines import build_engine, run_staggered  # noqa: E402
from k3build.config import preset  # noqa: E402
from k3build.synth import synth  # noqa: E402
from k3runtime import LLM, SamplingParams  # noqa: E402

root = Path(tempfile.mkdtemp())
synth(root / "ckpt", preset("tiny"), seed=0)
gpu = build_engine(root / "ckpt", root / "sm90", target="sm90", dtype="bf16", kv_dtype="bf16")
fp32 = build_engine(root / "ckpt", root / "fp32")
P = [5, 17, 99, 3, 250, 7, 7, 41]
prompts = [list(range(1, 86)), P, [9, 8, 7], list(range(100, 160)), list(range(200, 270)), [3] * 11, [1, 499],
           [1, 33] * 20]
greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def batch(llm):
    return run_staggered(llm.engine, prompts, greedy, first=3)[0][2], llm.engine.stats


small = dict(num_pages=6, max_prefill_chunk=32, preemption_mode="recompute")
for name, kw in (("alone sync", dict(async_scheduling=False)), ("alone async", dict(async_scheduling=True))):
    print(name, LLM(gpu, device="cuda", **kw).generate([prompts[2]], greedy)[0].token_ids)
for name, kw in (("batch sync", dict(async_scheduling=False, **small)),
                 ("batch async", dict(async_scheduling=True, **small)),
                 ("batch sync, pages enough", dict(async_scheduling=False, max_prefill_chunk=32))):
    print(name, *batch(LLM(gpu, device="cuda", **kw)))
toks = LLM(gpu, device="cuda").generate([prompts[2]], greedy)[0].token_ids
logits = LLM(fp32).logits(prompts[2] + list(toks))[2:-1]
for s, (row, t) in enumerate(zip(logits, toks)):
    top = row.topk(3)
    print(s, t, [(int(i), round(float(v), 4)) for v, i in zip(top.values, top.indices)], round(float(row.std()), 4))
print("fp32 cpu alone", LLM(fp32).generate([prompts[2]], greedy)[0].token_ids)
