"""Probe (twentieth session): can a side-stream kernel that pulls a GEMM's weights into L2, while the main stream
runs a chain of small latency-bound kernels, make the GEMM that follows faster? JSON lines on stdout.

Graph per variant: flush L2 (copy 256 MB) -> [fork: prefetch first X MB of W] -> chain of small kernels -> GEMM.
The GEMM's cost is T(variant) - T(flush + chain) in the same process, replays interleaved.
"""
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from common import interleaved_replays_us  # noqa: E402


@triton.jit
def bulk_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, ASM: tl.constexpr):
    lane = tl.arange(0, LANES).to(tl.int64)
    span = LANES * CHUNK
    for base in range(tl.program_id(0).to(tl.int64) * span, nbytes, tl.num_programs(0).to(tl.int64) * span):
        offs = tl.minimum(base + lane * CHUNK, nbytes - CHUNK)
        addr = (ptr + offs).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise(ASM, "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def touch_kernel(ptr, sink, nwords, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for base in range(tl.program_id(0) * BLOCK, nwords, tl.num_programs(0) * BLOCK):
        offs = base + lane
        acc ^= tl.load(ptr + offs, mask=offs < nwords, other=0, cache_modifier=".cg")
    tl.store(sink + lane, acc, mask=acc == 0x1234567)


CHUNK = 4096


def prefetch(kind, w, nbytes, grid, sink):
    u8 = w.view(torch.uint8).reshape(-1)
    nbytes = min(nbytes, u8.numel()) // CHUNK * CHUNK
    if nbytes == 0:
        return
    if kind == "bulk":
        bulk_prefetch_kernel[(grid,)](u8, nbytes, CHUNK=CHUNK, LANES=32,
                                      ASM=f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK};\n mov.u32 $0, 0;",
                                      num_warps=1)
    else:
        touch_kernel[(grid,)](u8.view(torch.int32), sink, nbytes // 4, BLOCK=1024, num_warps=4)


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    M = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    flush_src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flush_dst = torch.empty_like(flush_src)
    sink = torch.zeros(1024, dtype=torch.int32, device=dev)
    x = torch.randn(M, 7168, device=dev, dtype=torch.bfloat16)
    shapes = {"moe_in_proj": (4352, 7168), "attn_in_proj": (3264, 7168), "o_proj": (7168, 768)}
    ws = {k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02 for k, (n, kk) in shapes.items()}
    ins = {"moe_in_proj": x, "attn_in_proj": x, "o_proj": torch.randn(M, 768, device=dev, dtype=torch.bfloat16)}
    side = torch.cuda.Stream()
    chain_len = int(sys.argv[2]) if len(sys.argv) > 2 else 8

    def body(name, pf):
        flush_dst.copy_(flush_src)
        main_s = torch.cuda.current_stream()
        if pf:
            side.wait_stream(main_s)
            with torch.cuda.stream(side):
                prefetch(pf[0], ws[name], pf[1] << 20, pf[2], sink)
        y = x
        for _ in range(chain_len):
            y = y * 1.0001
        if name:
            torch.nn.functional.linear(ins[name], ws[name])
        if pf:
            main_s.wait_stream(side)

    variants = [("", None)]
    for name in shapes:
        variants.append((name, None))
        for mb in (8, 16, 24, 32, 48, 64):
            if (mb << 20) > ws[name].numel() * 2 + (8 << 20):
                continue
            for kind, grid in (("bulk", 8), ("bulk", 32), ("touch", 16), ("touch", 66)):
                variants.append((name, (kind, mb, grid)))
    graphs = []
    for name, pf in variants:
        for _ in range(2):
            body(name, pf)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body(name, pf)
        graphs.append(g)
    med = list(interleaved_replays_us({i: g.replay for i, g in enumerate(graphs)}).values())
    base = med[0]
    for (name, pf), t in zip(variants, med):
        w = ws.get(name)
        print(json.dumps({"probe": "l2_prefetch", "M": M, "chain": chain_len, "gemm": name or "none",
                          "prefetch": pf and {"kind": pf[0], "mb": pf[1], "grid": pf[2]},
                          "total_us": round(t, 2), "gemm_us": round(t - base, 2),
                          "weight_mb": w is not None and round(w.numel() * 2 / 2**20, 1)}))


main()
