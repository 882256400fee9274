"""The sampler's Gumbel-max draw in one Triton launch (and a small argmax over its chunks): argmax over each row of
x + g, where g is the sampler's counter-based noise of (the row's draw seed, the token id) made in registers
(k3runtime.sampler.gumbel_noise does it in about twenty torch launches through [rows, V] int64 temporaries). The
same integer hash, the same fp32 arithmetic and the lowest id on a tie: the same token as the torch ops wherever
their logarithms agree (Triton's log on NVIDIA is libdevice's logf, as CUDA's is, which torch calls).

Each row is cut into chunks, a program a chunk, so that a few rows still fill the GPU; the chunks' maxima are
reduced by two small torch launches (argmax takes the first maximum: the lowest chunk, so the lowest id)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gumbel_argmax_kernel(x_ptr, seed_ptr, val_ptr, idx_ptr, V, stride_x, CHUNK, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int64)
    start = part * CHUNK
    for c0 in range(0, CHUNK, BLOCK):
        ids = start + c0 + tl.arange(0, BLOCK)
        mask = (ids < V) & (c0 + tl.arange(0, BLOCK) < CHUNK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + ids, mask=mask, other=float("-inf"))
        # sampler.gumbel_noise: SplitMix64 of seed ^ (id * C), 23 bits as a uniform strictly inside (0, 1)
        h = seed ^ (ids.to(tl.uint64) * 0xD1B54A32D192ED03)
        h = h + 0x9E3779B97F4A7C15
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB
        h = h ^ (h >> 31)
        u = ((h >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
        s = tl.where(mask, x + -tl.log(-tl.log(u)), float("-inf"))
        m = tl.max(s, 0)
        i = tl.argmax(s, 0, tie_break_left=True)
        better = m > best                                    # strictly: an earlier (lower) id keeps a tie
        best_id = tl.where(better, (start + c0 + i).to(tl.int64), best_id)
        best = tl.where(better, m, best)
    tl.store(val_ptr + row * tl.num_programs(1) + part, best)
    tl.store(idx_ptr + row * tl.num_programs(1) + part, best_id)


BLOCK = 1024
PROGRAMS = 1024  # about this many programs a launch (a few waves on an H200's 132 SMs)


def row_chunks(M: int, V: int, block: int, programs: int) -> tuple[int, int]:
    """(chunks a row, tokens a chunk) for a grid (M rows, chunks) of about `programs` programs: each chunk whole
    blocks of `block`, the last one ragged."""
    parts = max(1, min(triton.cdiv(V, block), programs // max(M, 1)))
    chunk = triton.cdiv(triton.cdiv(V, parts), block) * block
    return triton.cdiv(V, chunk), chunk


def gumbel_argmax(x: torch.Tensor, draw_seeds: torch.Tensor) -> torch.Tensor:
    """argmax(x + gumbel_noise(draw_seeds, ids)) a row, the lowest id on a tie: x [M, V] fp32 (its last dim
    contiguous), draw_seeds [M] int64 (any stride: the sampler's is a column of its parameters) -> [M] int64 on x's
    device, with no sync. A row all -inf gives 0."""
    M, V = x.shape
    draw_seeds = draw_seeds.contiguous()
    parts, chunk = row_chunks(M, V, BLOCK, PROGRAMS)
    vals = torch.empty(M, parts, dtype=torch.float32, device=x.device)
    idx = torch.empty(M, parts, dtype=torch.int64, device=x.device)
    gumbel_argmax_kernel[(M, parts)](x, draw_seeds, vals, idx, V, x.stride(0), chunk, BLOCK=BLOCK, num_warps=4)
    return idx.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0]
