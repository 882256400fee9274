"""Where an eager prefill step of the tiny model syncs: each sync warning's stack (our frames and fla's), printed.
Run from the repo root on the device after `source tools/device/env.sh` (it makes the tiny checkpoint and engine
under /tmp)."""
import sys
import traceback
import warnings

import torch

sys.path.insert(0, "tests/model")
from engines import build_engine  # noqa: E402
from k3build.config import preset  # noqa: E402
from k3build.synth import synth  # noqa: E402
from k3plugins.mla import prefill  # noqa: E402
from k3runtime import LLM  # noqa: E402
from k3runtime.executor import StepBatch  # noqa: E402

ckpt = "/tmp/probe_ckpt"
synth(ckpt, preset("tiny"), seed=0, progress=False)
from pathlib import Path  # noqa: E402
eng = build_engine(Path(ckpt), Path("/tmp/probe_engine"), target="sm90", dtype="bf16", kv_dtype="bf16")
prefill.MIN_NEW_TOKENS = 4
runner = LLM(eng, device="cuda").engine.runner
dev = torch.device("cuda")
batch = StepBatch(input_ids=torch.tensor([5, 17, 99, 3, 250, 7, 8], device=dev),
                  cu_seqlens=torch.tensor([0, 6, 7], device=dev), slot_ids=torch.arange(2, device=dev),
                  context_lens=torch.tensor([6, 9], device=dev),
                  page_table=torch.tensor([[0, -1], [1, -1]], device=dev),
                  logits_indices=torch.tensor([5, 6], device=dev), host_seqs=((6, 6), (1, 9)))
seen = []
warnings.showwarning = lambda m, *a, **k: seen.append((str(m), traceback.format_stack(limit=12)))
warnings.simplefilter("always")
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
for step in range(2):  # the first step and a second of the same batch (fla-core's caches hit)
    n = len(seen)
    runner.executor.run(batch)
    print(f"step {step}: syncs", sum("called a synchronizing" in m for m, _ in seen[n:]))
torch.cuda.set_sync_debug_mode("default")
syncs = [s for s in seen if "called a synchronizing" in s[0]]
for m, st in syncs[:3]:
    print("".join(f for f in st if "/warnings" not in f)[-2500:])
    print("-----")
