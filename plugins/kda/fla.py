"""KDA mixer on the GPU: fla-core's chunk_kda (prefill) / fused_recurrent (decode) with Triton glue.

Same signature and semantics as `reference.kda_mixer`. Projections are torch GEMMs in the activation
dtype. Decode tactics ("a step with as many tokens as sequences", every sequence one token), the default first:
  "fused" — one Triton program per (sequence, head) does conv update, norms, gates, the delta rule on the
            in-place slot state and the gated output norm (the state is read once and written once);
  "fla"   — conv kernel, fla-core's fused_recurrent_kda_fwd (slots by index, in place), norm kernel;
  "split" — conv kernel, our recurrent kernel over [BLOCK_V, K] state slices (in place), norm kernel.
Prefill: row-walking varlen conv kernel (q, k, v out contiguous, q and k L2-normed), fla-core chunk_kda from the
gathered slot states, state scatter, norm kernel.
"""

from __future__ import annotations

import torch
import triton

from k3plugins.embed.dense import dense
from k3plugins.kda.triton_decode import (conv_prefill_rows_kernel, conv_state_kernel, conv_update_kernel,
                                         gated_norm_kernel, kda_decode_fused_kernel, kda_recurrent_vsplit_kernel)
from k3plugins.pdl import pdl
from k3plugins.sm_count import sm_count
from k3plugins.step_scope import per_step

DECODE_TACTICS = ("fused", "split", "fla")
# what kda_mixer runs when not told: fused is the fastest measured on the H200, or level, at every grid tried
# (8 to 256 sequences x 96 heads, 32 to 128 x a rank's 6; BENCHMARKS.md)
DECODE_DEFAULT = DECODE_TACTICS[0]
# value rows of the state a split program updates, by grid size (the H200 sweeps in BENCHMARKS.md): 128 where
# sequences x heads fill the GPU many times over (64 x 96: 6144 programs), 32 where they do not (up to 128 x 6 and
# 8 x 96: 768 programs of 128 rows are under six per SM; four times as many narrower ones go 7-11 % faster).
BLOCK_V = 128
NARROW_BLOCK_V, NARROW_BELOW = 32, 2048
# The fused kernel's register cap, 168 a thread, fits three 4-warp programs an SM instead of two (213 registers
# uncapped; 27 spill instructions capped, in the sm_90 SASS). Since its loads go out together (sixteenth session),
# the cap pays only where it saves a wave: where the grid fits three programs an SM but not two. On the H200,
# capped against uncapped, ms: 0.0209 / 0.0230 at 64 x a rank's 6 heads (384 programs, 132 SMs), but 0.2377 /
# 0.2247 at 64 x 96 and 0.928 / 0.876 at 256 x 96; level at 768 programs (BENCHMARKS.md)
FUSED_MAXNREG = 168
# The fused decode computes its head's gate from f_a (the f_b product, K x K multiply-adds a program, f_b's [K, K]
# slice read from L2, F_B_CHUNK columns at a time beside the state in registers) instead of reading the f_b GEMM's
# output: one launch less a KDA layer. On the H200 (BENCHMARKS.md, twenty-sixth session) that saved 0.18 / 0.28 /
# 0.14 ms a rank step at 32 / 64 / 128 requests (192-768 programs; one process) and 5 % at 8 x 96 heads (768), but
# cost 3 % at 64 x 96 and 256 x 96 (6144 and 24576 programs, each re-reading its head's slice): so up to 1024
# programs only
F_B_CHUNK = 32
F_B_FUSED_MAX_PROGRAMS = 1024
# chunk_kda lays out its chunks from cu_seqlens. Left to itself it does that once per cu_seqlens tensor with two
# repeat_interleave whose output size the host must read: a device->host sync in each prefill step's first KDA
# layer, which stops the host launching ahead. fla's use_graph builds the layout on the device instead, padded to
# the most chunks the step can have (programs past the real ones return at once), but again in every layer, about
# ten small torch ops: on an H100 (BENCHMARKS.md, fifty-first session) 8 layers of a mixed step (32 decode rows
# beside a 480-token chunk) took 22.8 ms that way against 19.3 with the sync, and level at one 8K prompt. So off
CHUNK_LAYOUT_ON_DEVICE = False


def fused_maxnreg(num_programs: int, num_sms: int) -> int:
    """The fused decode's register cap for a grid (0: none): FUSED_MAXNREG where num_programs fits three programs
    on each of num_sms SMs but not two."""
    return FUSED_MAXNREG if 2 * num_sms < num_programs <= 3 * num_sms else 0


def decode_block_v(num_seqs: int, num_heads: int) -> int:
    """The split tactic's state slice for a batch: BLOCK_V unless num_seqs x num_heads is under NARROW_BELOW."""
    return NARROW_BLOCK_V if num_seqs * num_heads < NARROW_BELOW else BLOCK_V


def supports(x: torch.Tensor, recurrent_pool: torch.Tensor, conv_pool: torch.Tensor, *, head_dim: int,
             tactic: str = DECODE_TACTICS[0]) -> tuple[bool, str]:
    if tactic not in DECODE_TACTICS:
        return False, f"unknown KDA tactic {tactic!r}; have {DECODE_TACTICS}"
    if not x.is_cuda:
        return False, "the fla/Triton KDA path needs CUDA tensors"
    if conv_pool.shape[-1] != 3:
        return False, f"conv_pool must keep 3 inputs (short conv of width 4), got {conv_pool.shape[-1]}"
    if head_dim & (head_dim - 1):
        return False, f"head_dim={head_dim} must be a power of two"
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError as exc:
        return False, f"fla-core does not import: {exc}"
    return True, ""


def _gated_norm(o, g_out, o_norm_weight, out, H, K, eps):
    """out [T, H·K] = RMSNorm(o per head) · sigmoid(g_out); returns out."""
    T = o.shape[0]
    bt = min(16, triton.next_power_of_2(T))
    gated_norm_kernel[(triton.cdiv(T, bt), H)](o, g_out, o_norm_weight, out, T, o.stride(0), g_out.stride(0),
                                               out.stride(0), float(eps), K=K, BT=bt, **pdl(o))
    return out


# Conv prefill: the row-walking kernel (each input row read once, q and k normed) on [32 tokens, 128 channels] with
# 1 warp, the fastest of the H200 sweep at T = 8192, H = 96 (BENCHMARKS.md, KDA): 0.432 ms, against 0.447 ms for
# the earlier [64, 256] with 2 warps.
CONV_PREFILL_BT, CONV_PREFILL_BC, CONV_PREFILL_WARPS = 32, 128, 1


def conv_channel_block(D: int, most: int = CONV_PREFILL_BC) -> int:
    """Channels per conv-prefill tile: the largest power of two <= most dividing D (tiles stay in one plane)."""
    bc = most
    while D % bc:
        bc //= 2
    return bc


def kda_decode(qkv: torch.Tensor, g_raw: torch.Tensor, b: torch.Tensor, g_out: torch.Tensor, conv_weight: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_weight: torch.Tensor, recurrent_pool: torch.Tensor,
               conv_pool: torch.Tensor, slot_ids: torch.Tensor, *, num_heads: int, head_dim: int,
               lower_bound: float | None, eps: float, tactic: str | None = None, block_v: int | None = None,
               num_warps: int = 4, maxnreg: int | None = None, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per sequence, after the projections; slots are updated in place.

    Args:
        qkv: [N, 3D] raw (pre-conv) q|k|v; g_raw: [N, D] f_b output (with f_b_weight: its input f_a [N, K]);
        b: [N, H] beta logits;
        g_out: [N, D] output-gate logits; conv_weight: [3D, 4] fp32; A_log: [H]; dt_bias: [D];
        o_norm_weight: [K]; recurrent_pool: [S, H, V, K]; conv_pool: [S, 3D, 3]; slot_ids: [N].
        block_v: the split tactic's state slice ([block_v, K] a program; None: decode_block_v);
        num_warps: the launch width of the split and fused kernels; maxnreg: their register cap (None: the
        tactic's default, fused_maxnreg's for fused, none for split; 0: none).
        f_b_weight: [D, K]; given, the fused kernel applies it to f_a itself (other tactics run the GEMM first).

    Returns:
        [N, D] gated, normed output in qkv.dtype (the o_proj input).
    """
    N = qkv.shape[0]
    H, K = num_heads, head_dim
    D = H * K
    slot_ids = per_step("kda_slots", (slot_ids,), lambda s: s.to(torch.int32))
    out = torch.empty(N, D, dtype=qkv.dtype, device=qkv.device)
    lb = 0.0 if lower_bound is None else float(lower_bound)
    tactic = tactic or DECODE_DEFAULT
    if maxnreg is None and tactic == "fused":
        maxnreg = fused_maxnreg(N * H, sm_count(qkv.device))
    cap = {"maxnreg": maxnreg} if maxnreg else {}
    if f_b_weight is not None:
        if tuple(f_b_weight.shape) != (D, K) or tuple(g_raw.shape) != (N, K):
            raise ValueError(f"kda_decode: with f_b_weight [{D}, {K}], g_raw must be f_a [{N}, {K}]; got "
                             f"{tuple(f_b_weight.shape)} and {tuple(g_raw.shape)}")
        if tactic != "fused":
            g_raw = dense(g_raw, f_b_weight)
    if tactic == "fused":
        fb = f_b_weight is not None
        kda_decode_fused_kernel[(N, H)](
            qkv, conv_weight, conv_pool, g_raw, A_log, dt_bias, b, g_out, o_norm_weight, recurrent_pool, slot_ids,
            out, qkv.stride(0), conv_pool.stride(0), g_raw.stride(0), b.stride(0), g_out.stride(0),
            recurrent_pool.stride(0), out.stride(0), K ** -0.5, lb, float(eps), H=H, K=K, W=4,
            HAS_LOWER_BOUND=lower_bound is not None, fb_ptr=f_b_weight.contiguous() if fb else None, FB=fb,
            FB_RC=min(F_B_CHUNK, K), num_warps=num_warps, **cap, **pdl(qkv))
        return out
    y = torch.empty(N, 3 * D, dtype=torch.float32, device=qkv.device)
    conv_update_kernel[(N, triton.cdiv(3 * D, 1024))](qkv, conv_weight, conv_pool, slot_ids, y, qkv.stride(0),
                                                       conv_pool.stride(0), y.stride(0), 3 * D, W=4, BC=1024,
                                                       **pdl(qkv))
    if tactic == "split":
        o = torch.empty(N, D, dtype=torch.float32, device=qkv.device)
        bv = min(block_v or decode_block_v(N, H), K)
        kda_recurrent_vsplit_kernel[(N, H, K // bv)](
            y, g_raw, A_log, dt_bias, b, recurrent_pool, slot_ids, o, y.stride(0), g_raw.stride(0), b.stride(0),
            recurrent_pool.stride(0), o.stride(0), K ** -0.5, lb, H=H, K=K, BV=bv,
            HAS_LOWER_BOUND=lower_bound is not None, num_warps=num_warps, **cap, **pdl(y))
        return _gated_norm(o, g_out, o_norm_weight, out, H, K, eps)
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    # fused_recurrent_kda_fwd takes no strides: each of q, k, v must be contiguous
    q, k, v = (t.contiguous().view(1, N, H, K) for t in y.split(D, dim=1))
    cu = torch.arange(N + 1, dtype=torch.int64, device=qkv.device)
    o, _ = fused_recurrent_kda_fwd(q, k, v, g_raw.float().view(1, N, H, K), b.float().contiguous().view(1, N, H),
                                   A_log=A_log.float(), dt_bias=dt_bias.float(), initial_state=recurrent_pool,
                                   scale=K ** -0.5, inplace_final_state=True, state_v_first=True, cu_seqlens=cu,
                                   ssm_state_indices=slot_ids, use_qk_l2norm_in_kernel=True,
                                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)
    o = o.view(N, D)
    return _gated_norm(o, g_out, o_norm_weight, out, H, K, eps)


def _prefill_index(slot_ids: torch.Tensor, cu_seqlens: torch.Tensor, T: int):
    """int32 slots, int64 offsets and each token's sequence (int32): the same for every KDA layer of a step."""
    cu = cu_seqlens.to(torch.int64)
    tok_seq = torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True).to(torch.int32)
    return slot_ids.to(torch.int32), cu, tok_seq


def kda_prefill(qkv, g_raw, b, g_out, conv_weight, A_log, dt_bias, o_norm_weight, recurrent_pool, conv_pool,
                cu_seqlens, slot_ids, *, num_heads, head_dim, lower_bound, eps):
    """Packed prefill chunks (any lengths) via chunk_kda, continuing from and updating each slot."""
    from fla.ops.kda import chunk_kda
    T = qkv.shape[0]
    N = slot_ids.shape[0]
    H, K = num_heads, head_dim
    D = H * K
    slot_ids, cu, tok_seq = per_step("kda_prefill_index", (slot_ids, cu_seqlens),
                                     lambda *src: _prefill_index(*src, T))
    y = torch.empty(3, T, D, dtype=qkv.dtype, device=qkv.device)                # q, k, v each contiguous
    # the conv also L2-norms q and k per head, so chunk_kda runs without its own two l2norm passes over them (a
    # tile holds whole heads: K is a power of two dividing D, so bc is a multiple of K)
    bc = conv_channel_block(D, max(CONV_PREFILL_BC, K))
    conv_prefill_rows_kernel[(triton.cdiv(T, CONV_PREFILL_BT), 3 * D // bc)](
        qkv, conv_weight, conv_pool, slot_ids, cu, tok_seq, y, T, qkv.stride(0), conv_pool.stride(0), 3 * D, D, W=4,
        BT=CONV_PREFILL_BT, BC=bc, NORM_K=K, num_warps=CONV_PREFILL_WARPS)
    conv_state_kernel[(N, triton.cdiv(3 * D, 1024))](qkv, conv_pool, slot_ids, cu, qkv.stride(0), conv_pool.stride(0),
                                                     3 * D, W=4, BC=1024)
    q, k, v = (t.view(1, T, H, K) for t in y)
    h0 = recurrent_pool[slot_ids.long()].float()                                 # [N, H, V, K]
    o, ht = chunk_kda(q, k, v, g_raw.reshape(1, T, H, K).to(q.dtype), b.float().reshape(1, T, H), scale=K ** -0.5,
                      initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
                      use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=lower_bound is not None,
                      lower_bound=lower_bound, state_v_first=True, cu_seqlens=cu, A_log=A_log.float(),
                      dt_bias=dt_bias.float(), use_graph=CHUNK_LAYOUT_ON_DEVICE)
    recurrent_pool[slot_ids.long()] = ht.to(recurrent_pool.dtype)
    o = o.reshape(T, D)
    out = torch.empty(T, D, dtype=qkv.dtype, device=qkv.device)
    return _gated_norm(o, g_out, o_norm_weight, out, H, K, eps)


def kda_mixer(x: torch.Tensor, in_proj_weight: torch.Tensor, conv_weight: torch.Tensor, f_b_weight: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, g_b_weight: torch.Tensor | None,
              o_norm_weight: torch.Tensor, o_weight: torch.Tensor, recurrent_pool: torch.Tensor,
              conv_pool: torch.Tensor, *, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, num_heads: int,
              head_dim: int, lower_bound: float | None, eps: float,
              decode_tactic: str | None = None) -> torch.Tensor:
    """See reference.kda_mixer (the engine calls it without decode_tactic: DECODE_DEFAULT). A step with T == N
    tokens is taken as decode (the scheduler puts no empty sequence in a step), which needs no device->host
    sync; any other step is a prefill."""
    T = x.shape[0]
    H, K = num_heads, head_dim
    D = H * K
    G = D if g_b_weight is None else K
    proj = dense(x, in_proj_weight)                   # [T, 3D + K + H + G], or padded (reference.IN_PROJ_ROW_ALIGN)
    qkv = proj[:, :3 * D]
    f_a, b, g_in = proj[:, 3 * D:3 * D + K + H + G].split([K, H, G], dim=-1)
    decode = T == slot_ids.shape[0]
    # the fused decode applies f_b itself on grids up to F_B_FUSED_MAX_PROGRAMS (sequences x heads)
    fuse_f_b = decode and (decode_tactic or DECODE_DEFAULT) == "fused" and T * H <= F_B_FUSED_MAX_PROGRAMS
    g_raw = f_a if fuse_f_b else dense(f_a, f_b_weight)                         # [T, K] or [T, D]
    g_out = g_in if g_b_weight is None else dense(g_in, g_b_weight)
    # g_out stays a strided view of proj: every kernel that reads it takes its row stride (a copy was a launch a
    # layer)
    args = (qkv, g_raw, b, g_out, conv_weight, A_log, dt_bias, o_norm_weight, recurrent_pool, conv_pool)
    if decode:
        o = kda_decode(*args, slot_ids, num_heads=H, head_dim=K, lower_bound=lower_bound, eps=eps,
                       tactic=decode_tactic, f_b_weight=f_b_weight if fuse_f_b else None)
    else:
        o = kda_prefill(*args, cu_seqlens, slot_ids, num_heads=H, head_dim=K, lower_bound=lower_bound, eps=eps)
    return dense(o, o_weight)
