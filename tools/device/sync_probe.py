"""Where an eager prefill step of the tiny model syncs: each sync warning's stack (our frames and fla's), printed.
Run from the repo root on the device after `source tools/device/env.sh` (it makes the tiny checkpoint and engine
in a fresh temporary folder)."""
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, "tests/model")
from engines import build_engine, prefill_step_batch  # noqa: E402
from k3build.config import preset  # noqa: E402
from k3build.synth import synth  # noqa: E402
from k3plugins.mla import prefill  # noqa: E402
from k3runtime import LLM  # noqa: E402

root = Path(tempfile.mkdtemp(prefix="sync_probe_"))
synth(root / "ckpt", preset("tiny"), seed=0, progress=False)
eng = build_engine(root / "ckpt", root / "engine", target="sm90", dtype="bf16", kv_dtype="bf16")
prefill.MIN_NEW_TOKENS = 4
runner = LLM(eng, device="cuda").engine.runner
batch = prefill_step_batch(torch.device("cuda"))
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
