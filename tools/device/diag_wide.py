"""Device diagnosis for the wide-experts engine: logits parity vs fp32 of the sm90 engine with triton_s
(strided bytes) and of a copy switched to triton (natural bytes), plus the CPU bf16 engine's own error."""
import dataclasses, json, shutil, sys
from pathlib import Path
sys.path.insert(0, "tests/model")
import torch
from engines import build_engine
from k3build.config import preset
from k3build.synth import synth
from safetensors.torch import load_file, save_file
from k3runtime import LLM

root = Path("/tmp/wide")
synth(root / "ckpt", dataclasses.replace(preset("tiny"), routed_expert_hidden_size=256, moe_intermediate_size=256), seed=0)
o = dict(dtype="bf16", kv_dtype="bf16")
cpu, gpu, exact = (build_engine(root / "ckpt", root / "cpu", **o), build_engine(root / "ckpt", root / "sm90", target="sm90", **o),
                   build_engine(root / "ckpt", root / "fp32"))
nat = root / "sm90_nat"
shutil.copytree(gpu, nat)
w_cpu, w_nat = load_file(cpu / "rank0/weights.safetensors"), load_file(gpu / "rank0/weights.safetensors")
for n in w_nat:
    if n.endswith((".w13", ".w2")):
        w_nat[n] = w_cpu[n]
save_file(w_nat, nat / "rank0/weights.safetensors", metadata={"format": "k3engine", "rank": "0"})
c = json.loads((nat / "config.json").read_text()); c["build_config"]["plugins"]["MoEExperts"]["tactic"] = "triton"
(nat / "config.json").write_text(json.dumps(c))
def par(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return round((a @ b / (a.norm() * b.norm())).item(), 6), round(((a - b).norm() / b.norm()).item(), 5)
E, C = LLM(exact), LLM(cpu)
S, N = LLM(gpu, device="cuda", cuda_graphs=False), LLM(nat, device="cuda", cuda_graphs=False)
for ids in [[5, 17, 99, 3, 250, 7, 7, 41], list(range(2, 70))]:
    want, s, n = E.logits(ids), S.logits(ids).cpu(), N.logits(ids).cpu()
    print(json.dumps({"len": len(ids), "cpu_bf16_vs_fp32": par(C.logits(ids), want), "strided_vs_fp32": par(s, want),
                      "natural_vs_fp32": par(n, want), "strided_vs_natural": par(s, n)}), flush=True)
