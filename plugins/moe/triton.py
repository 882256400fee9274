"""MXFP4 grouped MoE, W4A16, in Triton: same signature and semantics as `reference.moe_experts`.

Three launches after a sync-free counting sort of the (token, expert) pairs by local expert (one launch):
gate/up GEMM with SiTU fused (h [P, I], activation dtype), down GEMM with the routing weight applied
(y [P, Dl] fp32, or the activation dtype with `y_half`), and a deterministic per-token sum of its local pairs
(no atomics). Weights are read in the build's MXFP4 layout, unchanged (the W4 decode reads the same bytes as
int32 words). Tactics are block configs and the operand path: "decode" (BM=16, swap-AB so the weights fill the
MMA rows) and "prefill" (BM=128) with our W4 bit-level decode, "*_s" with the same decode on the strided-nibble
layout, "*_ds" with tl.dot_scaled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from k3plugins.mlp.triton import ACT_IDS
from k3plugins.moe.mxfp4 import (STRIDE_BLOCK_K, TILE_ROWS, W4_MAX_SCALE_BYTE, lane_mxfp4,  # noqa: F401
                                  lane_permute, pair_mxfp4, restride_mxfp4, tile_mxfp4, tile_scales)
from k3plugins.moe.triton_kernels import (moe_combine_kernel, moe_down_kernel, moe_gate_up_kernel,
                                            mxfp4_dequant_kernel, sort_pairs_kernel)
from k3plugins.pdl import pdl, pdl_capable
from k3plugins.sm_count import sm_count


@dataclass(frozen=True)
class MoETactic:
    block_m: int   # tokens per MMA tile (the MMA's N side)
    block_n: int   # weight rows per program
    block_k: int   # K elements per step (a power of two >= 32)
    num_warps: int
    num_stages: int
    w4: bool = True  # our bit-level MXFP4 decode + tl.dot (True) or Triton's tl.dot_scaled (False)
    strided: bool = False  # W4 on weights in `restride_mxfp4`'s layout (block_k 256); activations in natural order
    paired: bool = False  # with strided: on `pair_mxfp4`'s layout instead
    # with paired: on `lane_mxfp4`'s layout (pair_mxfp4's bits on K in LANE_ORDER), z in that order too
    lane: bool = False
    # with lane, on CUDA: the scale multiply as one PTX bf16x2 multiply a register (_paired_dot's ASM)
    packed_mul: bool = True
    fp8: bool = False  # with strided: gate/up from e4m3 activations on FP8 tensor cores (the down GEMM stays W4A16)
    tiled: bool = False  # with strided: weights and scales in tile_rows' order (block_n a multiple of TILE_ROWS)
    rows_first: bool = False  # grid (row blocks, experts): programs that run together share an expert's tokens
    # with paired: the down kernel starts on an expert as soon as the gate/up kernel has all its rows of h (a count
    # per expert), launched with PDL on sm_90 so that it takes SMs while the gate/up kernel's last programs run
    overlap: bool = False
    # the down kernel's own rows per program, warps and stages (None: as the gate/up kernel's)
    down_block_n: int | None = None
    down_num_warps: int | None = None
    down_num_stages: int | None = None
    # the per-pair rows y in the activation dtype, not fp32: the down kernel writes, and the combine reads, half
    # the bytes (6.4 -> 3.2 MB at 8 tokens an expert, 56 experts); each pair's product is rounded once before the
    # fp32 sum of a token's pairs
    y_half: bool = False
    # the combine gathers a token's local rows of y at once (moe_combine_kernel's GATHER), not one position and
    # row after another
    gather_combine: bool = False
    # W4: each gate/up program asks L2 for its first `prefetch` K steps of weights while the pair sort runs (the
    # kernel launched with PDL behind the sort, which lets it in at once; CUDA sm_90, else no prefetch). On an H100,
    # 2-4 steps were 0.5-0.8 % faster with all 56 experts touched (1-8 tokens each), and 4 steps 15-30 % slower with
    # 8-32 of them touched (a rank's decode), as every program prefetches, an empty expert's too (BENCHMARKS.md,
    # forty-eighth session); hence prefetch_per_sm (decode_l_pf)
    prefetch: int = 0
    # with prefetch: only the grid's first programs prefetch, this many an SM (about the wave that runs beside the
    # sort; the later ones start once it has ended, their loads no later for it); 0: every program. Its branch adds
    # 10 sm_90 instructions to the gate/up loop's 682 (tools/sass_loops.py, a compiler choice)
    prefetch_per_sm: int = 0

    def down(self) -> "MoETactic":
        """The blocks the down kernel takes."""
        return replace(self, block_n=self.down_block_n or self.block_n, num_warps=self.down_num_warps or self.num_warps,
                       num_stages=self.down_num_stages or self.num_stages)


TACTICS = {  # fastest of the sweep on the H200 (BENCHMARKS.md, bench_plugins)
    "decode": MoETactic(16, 64, 256, 4, 3),
    "decode_ds": MoETactic(16, 128, 128, 8, 3, w4=False),
    "prefill": MoETactic(128, 128, 128, 8, 3),
    "prefill_ds": MoETactic(128, 128, 64, 8, 3, w4=False),
    # on weights in restride_mxfp4's layout (the "triton_s" engine tactic): 0.50 of the weight floor at 1-2
    # tokens/expert against 0.37 for "decode", 297 TFLOP/s at 128 tokens/expert against 254 (BENCHMARKS.md)
    "decode_s": MoETactic(16, 64, 256, 4, 3, strided=True),
    "prefill_s": MoETactic(128, 128, 256, 8, 2, strided=True),
    # on pair_mxfp4's weights in row tiles (tile_mxfp4; the "triton_p" engine tactic, the sm90 default for a MoE
    # without latent projection): no byte permutes to build the MMA operands; each K step of a program reads one
    # contiguous 8 KB block instead of 64 runs of 128 bytes 1.8 KB apart. Untiled, 0.60-0.63 of the weight floor at
    # 1-8 tokens/expert (0.52-0.56 for "*_s"); tiled, 6 % faster: 0.64-0.69 (BENCHMARKS.md). Its loops take 2.99 /
    # 3.52 / 3.05 sm_90 instructions a weight (gate/up, down, prefill gate/up); the 17 % cut that got them there gave
    # 1.5 % less time
    # rows first with the down kernel awaiting each expert's h (overlap): at one token on each of 16-32 of the 56
    # experts (a rank's decode at 32-64 requests) 6-8 % faster than the plain launches, 3 % at all 56, bit-identical
    # (bench_plugins moe_touched, nineteenth session); the grid rows first alone: 1 %
    "decode_p": MoETactic(16, 64, 256, 4, 3, strided=True, paired=True, tiled=True, rows_first=True, overlap=True),
    # prefill_p's grid runs row blocks first (rows_first): 313 against 302 TFLOP/s at 128 tokens/expert, side by side;
    # level at decode sizes (BENCHMARKS.md, sixteenth session)
    "prefill_p": MoETactic(128, 128, 256, 8, 2, strided=True, paired=True, tiled=True, rows_first=True),
    # decode_p on lane_mxfp4's layout (the "triton_l" engine tactic): each thread loads its own scales, no shuffles;
    # sm_90 loops of 682 / 395 instructions a K step (gate/up / down) against 766 / 441. On the H200, 0.78-0.83 of
    # the weight floor at 1-8 tokens/expert against 0.70-0.73 (BENCHMARKS.md, twenty-third session)
    "decode_l": MoETactic(16, 64, 256, 4, 3, strided=True, paired=True, lane=True, tiled=True, rows_first=True,
                          overlap=True),
    # decode_l with the L2 prefetch of the first 2 K steps in the grid's first 2 programs an SM while the pair sort
    # runs (prefetch, prefetch_per_sm; the "triton_l" engine tactic's decode): on an H100, side by side with
    # decode_l, 0.3-1.5 % faster at every count of touched experts from 8 to 56 (one token each, a rank's decode:
    # 0.624 -> 0.634 of the floor at 8, 0.947 -> 0.954 at 56) and 0.908 -> 0.925 (with y_half) at 8 tokens on each of
    # 56 (BENCHMARKS.md, forty-ninth session); not yet run on an H200
    "decode_l_pf": MoETactic(16, 64, 256, 4, 3, strided=True, paired=True, lane=True, tiled=True, rows_first=True,
                             overlap=True, prefetch=2, prefetch_per_sm=2),
    # decode_l with each pair's row y in bf16 (y_half): y's write and the combine's read of it are 12.8 of the
    # 9.6-28 MB decode_l moves besides the weights at 8 tokens an expert in fp32. On the H200 0.3-0.4 % faster than
    # decode_l at 1-8 tokens an expert, its sums rounded once more (BENCHMARKS.md, fortieth session)
    "decode_l_yh": MoETactic(16, 64, 256, 4, 3, strided=True, paired=True, lane=True, tiled=True, rows_first=True,
                             overlap=True, y_half=True),
    # decode_l with the gathering combine (a token's 16 positions loaded at once, not one round after another;
    # the combine took 5.0 µs at 8 tokens an expert): level with decode_l on the H200, within 0.4 %
    # (BENCHMARKS.md, fortieth session)
    "decode_l_gc": MoETactic(16, 64, 256, 4, 3, strided=True, paired=True, lane=True, tiled=True, rows_first=True,
                             overlap=True, gather_combine=True),
    # prefill on the lane layout: in prefill_p's blocks (BM 128, 2 stages) 297 TFLOP/s with the packed multiply,
    # 306 without (registers: 10 spill instructions); BM 64 with 3 stages and the packed multiply 315 against
    # prefill_p's 307, side by side (BENCHMARKS.md, twenty-third session)
    "prefill_l": MoETactic(64, 128, 256, 8, 3, strided=True, paired=True, lane=True, tiled=True, rows_first=True),
    # FP8 activations for the gate/up GEMM (strided weights); BN 64, as BN 128 spills registers in the sm_90 SASS.
    # On the H200, the best of its sweep: 231 TFLOP/s at 128 tokens/expert (1.25x slower than "prefill_p"; 8 warps
    # took 3.84 ms), rel-L2 0.041 against W4A16 on random activations
    "prefill_f8": MoETactic(128, 64, 256, 4, 3, strided=True, fp8=True),
}
# Steps of at least this many tokens take the prefill blocks: between the H200 sweep's decode points (M <= 448)
# and its prefill point (M = 7168); the crossover itself has not been measured.
PREFILL_MIN_TOKENS = 1024


def _tactic(tactic: str | MoETactic, dl: int, inter: int) -> MoETactic:
    """A named tactic's blocks, halved where the expert dims (multiples of 32) are too small for them; an
    explicit MoETactic is taken as given."""
    if isinstance(tactic, MoETactic):
        return tactic
    if tactic not in TACTICS:
        raise ValueError(f"unknown MoE tactic {tactic!r}; have {sorted(TACTICS)}")
    t = TACTICS[tactic]
    bk, bn = t.block_k, t.block_n
    while bk > 32 and (dl % bk or inter % bk) and not t.strided:  # the strided layout fixes block_k
        bk //= 2
    while bn > 16 and (dl % bn or inter % bn):
        bn //= 2
    dbn = t.down_block_n
    while dbn and dbn > 16 and dl % dbn:
        dbn //= 2
    return replace(t, block_k=bk, block_n=bn, down_block_n=dbn)


def supports(z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
             tactic: str | MoETactic = "decode") -> tuple[bool, str]:
    """Whether the Triton MoE runs these shapes/dtypes with `tactic`."""
    if not z.is_cuda and not _interpreting():
        return False, "Triton MoE needs a GPU tensor (or TRITON_INTERPRET=1)"
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        return False, "Triton MoE reads MXFP4 (uint8) weights only"
    dl, inter = w13.shape[2] * 2, w2.shape[2] * 2
    try:
        t = _tactic(tactic, dl, inter)
    except ValueError as exc:
        return False, str(exc)
    for name, k in (("Dl", dl), ("I", inter)):
        if k % t.block_k:
            return False, f"{name}={k} must be a multiple of block_k={t.block_k}"
    if inter % t.block_n or dl % t.block_n or dl % t.down().block_n:
        return False, (f"I={inter} and Dl={dl} must be multiples of block_n={t.block_n} (and Dl of the down kernel's "
                       f"{t.down().block_n})")
    if t.strided and t.block_k != STRIDE_BLOCK_K:
        return False, f"strided tactics read K tiles of {STRIDE_BLOCK_K}, got block_k={t.block_k}"
    untileable = any(bn % TILE_ROWS and TILE_ROWS % bn for bn in (t.block_n, t.down().block_n))
    if t.tiled and (not t.strided or t.fp8 or untileable or inter % TILE_ROWS
                    or dl % TILE_ROWS):
        return False, (f"tiled tactics read the strided or paired layout in row tiles of {TILE_ROWS}: block_n="
                       f"{t.block_n} must divide it or be a multiple of it, I={inter} and Dl={dl} multiples of it "
                       "(and no FP8)")
    if not t.w4 and z.dtype not in (torch.bfloat16, torch.float16):
        return False, "tl.dot_scaled takes bf16/fp16 activations; use a W4 tactic for fp32"
    if t.lane and not t.paired:
        return False, "lane tactics read pair_mxfp4's bits (paired)"
    if t.prefetch < 0 or t.prefetch_per_sm < 0 or (t.prefetch and not t.w4):
        return False, (f"prefetch counts K steps of W4 weights, prefetch_per_sm programs (both >= 0), got "
                       f"{t.prefetch} / {t.prefetch_per_sm} with w4={t.w4}")
    if t.overlap and (not t.paired or t.fp8):
        return False, "overlap (the down kernel awaiting each expert's h) is implemented for the paired layout only"
    if t.fp8 and (not z.is_cuda or not t.strided or z.dtype not in (torch.bfloat16, torch.float16)):
        return False, "the FP8 tactic needs bf16/fp16 activations on a GPU (the interpreter's fp8 is not exact)"
    return True, ""


def swap01(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with bits 0 and 1 of the last index swapped: the K order a W4 tile comes out in."""
    return x.unflatten(-1, (-1, 2, 2)).transpose(-1, -2).flatten(-3)


def _interpreting() -> bool:
    # decided when the kernels were decorated (TRITON_INTERPRET=1 at import), not by the variable now
    return type(moe_gate_up_kernel).__name__ == "InterpretedFunction"


# the e4m3 a backend's FP8 MMA takes -> (Triton dtype, largest finite value)
_F8 = {torch.float8_e4m3fn: (tl.float8e4nv, 448.0), torch.float8_e4m3fnuz: (tl.float8e4b8, 240.0)}


def quantize_e4m3(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z [M, D] -> (e4m3 [M, D], fp32 per-token scales [M]) with z ≈ q · scale: e4m3fn on CUDA, e4m3fnuz on ROCm."""
    f8 = torch.float8_e4m3fnuz if torch.version.hip else torch.float8_e4m3fn
    scale = z.float().abs().amax(1).clamp_min(1e-30) / _F8[f8][1]
    return (z.float() / scale[:, None]).to(f8).contiguous(), scale.contiguous()


# the sort's tile width (sort_pairs_kernel's COLS): at 4 the kernel's sm_90 code is about a third shorter than at 1,
# a flat scan (static instructions, compiled on a CPU, at blocks of 512 and 8192 pairs), for the same output; not
# yet timed against it (tools/device/moe_sort_probe.py)
SORT_COLS = 4


def sort_pairs(topk_ids: torch.Tensor, expert_start: int, num_local: int, max_block: int = 8192,
               done: torch.Tensor | None = None, cols: int | None = None, early: bool = False):
    """Pairs (token·k + j) sorted by local expert, with no device->host sync, in one launch; `done` (int32
    [num_local]), if given, is zeroed by the same launch (the MoE kernels' per-expert count, MoETactic.overlap).
    cols: the kernel's tile width (None: SORT_COLS; a power of two), at most the block. early (sm_90): the next
    kernel, launched with PDL, may take SMs as soon as the sort starts (MoETactic.prefetch).

    Returns:
        order int32 [P] (pair ids, local experts' pairs first, grouped by expert, in pair order within one; past
        offsets[E] unset),
        offsets int32 [E+1] (expert e owns order[offsets[e]:offsets[e+1]]), inv int32 [P] (sorted position of
        each pair, -1 if the expert is not local).
    """
    flat = topk_ids.reshape(-1).contiguous()
    P = flat.numel()
    order = torch.empty(P, dtype=torch.int32, device=flat.device)
    inv = torch.empty(P, dtype=torch.int32, device=flat.device)
    offsets = torch.empty(num_local + 1, dtype=torch.int32, device=flat.device)
    block = min(max(triton.next_power_of_2(P), 16), max_block)  # pairs a program reads per step
    cols = min(SORT_COLS if cols is None else cols, block)
    sort_pairs_kernel[(num_local + 1,)](flat, order, offsets, inv, P, expert_start, num_local, BLOCK=block,
                                        COLS=cols, done_ptr=done, ZERO_DONE=done is not None, EARLY=early,
                                        num_warps=4 if block <= 2048 else 8, **pdl(flat))
    return order, offsets, inv


def moe_experts(z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, *, expert_start: int,
                act: str, beta: float = 4.0, linear_beta: float = 25.0,
                tactic: str | MoETactic = "decode") -> torch.Tensor:
    """Σ over each token's selected local experts of w · W2(act(W1 z, W3 z)); see reference.moe_experts.

    Args:
        z: [M, Dl] bf16/fp16 (fp32 with a *_dq tactic).
        topk_ids: [M, k] int64 global expert ids; topk_weights: [M, k] fp32.
        w13: [E, 2I, Dl/2] u8; w13_scale: [E, 2I, Dl/32] u8; w2: [E, Dl, I/2] u8; w2_scale: [E, Dl, I/32] u8.
        expert_start: global id of local expert 0. act: "situ" | "silu".
        tactic: a key of TACTICS (the builder records it). The "*_s" tactics read w13/w2 in
            `restride_mxfp4`'s layout, the "*_p" ones in `pair_mxfp4`'s, the "*_l" ones in `lane_mxfp4`'s (see
            `lay_out`), with z's columns in its order too (`lay_out_input`; the output is in natural order).

    Returns:
        [M, Dl] fp32.
    """
    if act not in ACT_IDS:
        raise ValueError(f"moe_experts: unknown act {act!r}; expected one of {sorted(ACT_IDS)}")
    if w13_scale is None or w2_scale is None:
        raise ValueError("moe_experts (triton): MXFP4 scales are required")
    ok, why = supports(z, w13, w2, tactic=tactic)
    if not ok:
        raise ValueError(f"moe_experts (triton): {why}")
    M, Dl = z.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if w2.shape != (E, Dl, inter // 2) or w13.shape[2] * 2 != Dl:
        raise ValueError(f"moe_experts (triton): w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match "
                         f"z [M, {Dl}]")
    t = _tactic(tactic, Dl, inter)
    if t.w4:  # same bytes as int32 words; activations in the tile's K order (h comes out in it too)
        w13, w2 = w13.view(torch.int32), w2.view(torch.int32)
        z = z if t.strided else swap01(z)
    if z.stride(-1) != 1:  # rows may be strided (z is a column slice of the MoE input's fused GEMM): the kernels
        z = z.contiguous()  # take z.stride(0)
    done = torch.empty(E, dtype=torch.int32, device=z.device) if t.overlap else None
    prefetch = t.prefetch if pdl_capable(z) else 0  # PDL lets the gate/up programs in while the sort runs
    order, offsets, inv = sort_pairs(topk_ids, expert_start, E, done=done, early=prefetch > 0)
    early = t.overlap and pdl_capable(z)  # the down kernel launched before the gate/up kernel ends
    P = order.numel()
    h = torch.empty(P, inter, dtype=z.dtype, device=z.device)
    y = torch.empty(P, Dl, dtype=z.dtype if t.y_half else torch.float32, device=z.device)
    out = torch.empty(M, Dl, dtype=torch.float32, device=z.device)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    layout = 4 if t.lane else 2 if t.paired else int(t.strided)  # the kernels' STRIDED (3: FP8 below)
    # _paired_dot's packed multiply: mul.rn.bf16x2 needs CUDA sm_90+, the devices PDL needs too
    asm = t.lane and t.packed_mul and pdl_capable(z)
    zs, f8 = z, None  # token scales and F8 dtype: the FP8 path's only (unused pointer otherwise)
    if t.fp8:
        z, zs = quantize_e4m3(z)
        f8 = _F8[z.dtype][0]
    d = t.down()
    grid = lambda rows, bn: (rows // bn, E) if t.rows_first else (E, rows // bn)
    moe_gate_up_kernel[grid(inter, t.block_n)](
        z, zs, w13, w13_scale, h, order, offsets, Dl, inter, z.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), h.stride(0), float(beta), float(linear_beta),
        TOP_K=top_k, ACT=ACT_IDS[act], BM=t.block_m, BN=t.block_n, BK=t.block_k, W4=t.w4,
        STRIDED=3 if t.fp8 else layout, F8=f8, TILED=t.tiled, ROWS_FIRST=t.rows_first, done_ptr=done,
        SIGNAL=t.overlap, EARLY=early, ASM=asm, PREFETCH=prefetch,
        PREFETCH_PROGRAMS=sm_count(z.device) * t.prefetch_per_sm if prefetch else 0, num_warps=t.num_warps,
        num_stages=t.num_stages,
        **(dict(PDL=True, launch_pdl=True) if prefetch else pdl(z)))
    moe_down_kernel[grid(Dl, d.block_n)](
        h, w2, w2_scale, y, order, offsets, tw, inter, h.stride(0), w2.stride(0), w2.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), y.stride(0), BM=t.block_m, BN=d.block_n, BK=t.block_k,
        W4=t.w4, STRIDED=layout, TILED=t.tiled, ROWS_FIRST=t.rows_first, done_ptr=done,
        AWAIT=inter // t.block_n if t.overlap else 0, ASM=asm, num_warps=d.num_warps, num_stages=d.num_stages,
        **(dict(PDL=False, launch_pdl=True) if early else pdl(h)))
    bd = 512
    moe_combine_kernel[(M, triton.cdiv(Dl, bd))](y, inv, out, Dl, y.stride(0), out.stride(0), TOP_K=top_k, BD=bd,
                                                 GATHER=t.gather_combine, **pdl(y))
    return out


def _by_step(decode: str, prefill: str, name: str, doc: str):
    """An engine tactic with reference.moe_experts' signature: the `prefill` blocks for steps of at least
    PREFILL_MIN_TOKENS tokens, else `decode` (fixed per captured batch bucket: no per-call choice inside a graph)."""
    def run(z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
            w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, *, expert_start: int, act: str,
            beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
        return moe_experts(z, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_start=expert_start,
                           act=act, beta=beta, linear_beta=linear_beta,
                           tactic=prefill if z.shape[0] >= PREFILL_MIN_TOKENS else decode)
    run.__name__, run.__qualname__, run.__doc__ = name, name, doc
    return run


moe_experts_w4 = _by_step("decode", "prefill", "moe_experts_w4", "The engine's \"triton\" tactic.")
moe_experts_strided = _by_step("decode_s", "prefill_s", "moe_experts_strided",
                               "The engine's \"triton_s\" tactic: on expert bytes the build wrote in restride_mxfp4's "
                               "layout (expert dims multiples of STRIDE_BLOCK_K).")
moe_experts_paired = _by_step("decode_p", "prefill_p", "moe_experts_paired",
                              "The engine's \"triton_p\" tactic (the sm90 default without latent projection): on "
                              "expert bytes the build wrote in pair_mxfp4's layout (expert dims multiples of "
                              "STRIDE_BLOCK_K).")
moe_experts_lane = _by_step("decode_l_pf", "prefill_l", "moe_experts_lane",
                            "The engine's \"triton_l\" tactic (the sm90 default for latent MoE): on expert bytes the "
                            "build wrote in lane_mxfp4's layout, z in its K order (the build permutes the latent "
                            "down-projection's rows to match).")
moe_experts_fp8 = _by_step("decode_s", "prefill_f8", "moe_experts_fp8",
                           "The \"triton_f8\" tactic (forced, or taken by --tune): triton_s for decode steps, FP8 "
                           "activations in the gate/up GEMM for prefill steps.")
moe_experts_ds = _by_step("decode_ds", "prefill_ds", "moe_experts_ds",
                          "The engine's \"triton_ds\" tactic (tl.dot_scaled: any scale byte; bf16/fp16 activations).")


def lay_out(tactic: str | MoETactic, packed: torch.Tensor) -> torch.Tensor:
    """Expert bytes in the checkpoint's order -> the layout `tactic` reads."""
    t = TACTICS[tactic] if isinstance(tactic, str) else tactic
    out = (lane_mxfp4(packed) if t.lane else pair_mxfp4(packed) if t.paired else restride_mxfp4(packed) if t.strided
           else packed)
    return tile_mxfp4(out) if t.tiled else out


def lay_out_input(tactic: str | MoETactic, z: torch.Tensor) -> torch.Tensor:
    """The MoE input z [M, Dl] with its columns in the checkpoint's order -> the order `tactic` reads (the lane
    tactics': mxfp4.lane_permute). An engine gets z in that order from its latent rows (k3build's layout pass)."""
    t = TACTICS[tactic] if isinstance(tactic, str) else tactic
    return lane_permute(z) if t.lane else z


def lay_out_scale(tactic: str | MoETactic, scale: torch.Tensor) -> torch.Tensor:
    """Expert scales in the checkpoint's order -> the order `tactic` reads (changed by tiled tactics only)."""
    t = TACTICS[tactic] if isinstance(tactic, str) else tactic
    return tile_scales(scale) if t.tiled else scale


def lay_out_experts(tactic: str | MoETactic, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The experts' four tensors in the checkpoint's order -> the layout `tactic` reads (lay_out, lay_out_scale)."""
    return lay_out(tactic, w13), lay_out_scale(tactic, w13_scale), lay_out(tactic, w2), lay_out_scale(tactic, w2_scale)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 [..., R, K/2] u8 + [..., R, K/32] u8 -> [..., R, K] `dtype` on the device (dequant-once tactic);
    exact for scale bytes up to W4_MAX_SCALE_BYTE."""
    K = packed.shape[-1] * 2
    rows = packed.numel() // packed.shape[-1]
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * 32 != K or K % 128 or rows % 32:
        raise ValueError(f"dequantize: packed {tuple(packed.shape)} / scale {tuple(scale.shape)} need K % 128 == 0, "
                         "rows % 32 == 0 and one scale per 32 elements")
    out = torch.empty(*packed.shape[:-1], K, dtype=dtype, device=packed.device)
    mxfp4_dequant_kernel[(rows // 32, K // 128)](packed.contiguous().view(torch.int32), scale.contiguous(), out, K=K,
                                                 BR=32, BK=128)
    return out
