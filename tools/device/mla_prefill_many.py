"""The MLA prefill of several sequences a step (bench_mla_prefill_many): one launch a sequence against
prefill.attend_sequences' shared launches, and the absorbed kernel, at PREFILL_MANY_CASES (`--together`:
PREFILL_TOGETHER_CASES, the rows behind prefill.TOGETHER_*; `--beside-decode`: such prompts beside a step's decode
rows, PREFILL_BESIDE_DECODE_CASES). JSON lines on stdout."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from mla import (PREFILL_BESIDE_DECODE_CASES, PREFILL_MANY_CASES, PREFILL_TOGETHER_CASES,  # noqa: E402
                 bench_mla_prefill_beside_decode, bench_mla_prefill_many)

gen = torch.Generator(device="cuda").manual_seed(0)
if "--beside-decode" in sys.argv:
    for case in PREFILL_BESIDE_DECODE_CASES:
        bench_mla_prefill_beside_decode(gen, *case)
else:
    for n, cached, chunk, H in PREFILL_TOGETHER_CASES if "--together" in sys.argv else PREFILL_MANY_CASES:
        bench_mla_prefill_many(gen, n, cached, chunk, H)
