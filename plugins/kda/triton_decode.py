"""KDA decode glue in Triton (one token per sequence, slots updated in place).

`kda_decode_fused_kernel` does a whole decode step of one (sequence, head) in one program: short-conv
update of the q/k/v channels, SiLU, q/k L2 norm, the K3 gate, sigmoid beta, the delta rule on the
[V, K] state (read once, written once), and the gated output RMSNorm. `conv_update_kernel` and
`gated_norm_kernel` are the same glue split around a recurrent kernel: fla-core's fused_recurrent (the
"fla" tactic) or `kda_recurrent_vsplit_kernel` (the "split" tactic), which gives each program a [BV, K]
slice of one head's state, so many small programs stream the pool instead of one 64 KiB tile each.
"""

import triton
import triton.language as tl

from k3plugins.pdl import pdl_prologue


@triton.jit
def _conv_inputs(x_ptr, w_ptr, pool_ptr, ch, mask, W: tl.constexpr):
    """The new input, the slot's 3 kept inputs and the 4 weights of channels `ch` (fp32)."""
    tl.static_assert(W == 4, "written for K3's short conv of width 4 (3 inputs kept)")
    x = tl.load(x_ptr + ch, mask=mask, other=0.0).to(tl.float32)
    s0 = tl.load(pool_ptr + ch * 3, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(pool_ptr + ch * 3 + 1, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(pool_ptr + ch * 3 + 2, mask=mask, other=0.0).to(tl.float32)
    w0 = tl.load(w_ptr + ch * 4, mask=mask, other=0.0)
    w1 = tl.load(w_ptr + ch * 4 + 1, mask=mask, other=0.0)
    w2 = tl.load(w_ptr + ch * 4 + 2, mask=mask, other=0.0)
    w3 = tl.load(w_ptr + ch * 4 + 3, mask=mask, other=0.0)
    return x, s0, s1, s2, w0, w1, w2, w3


@triton.jit
def _conv_shift(x, s0, s1, s2, w0, w1, w2, w3, pool_ptr, ch, mask):
    """SiLU(Σ_i w_i·window_i); shifts the raw input into the slot's state. Call after a barrier that follows
    every thread's _conv_inputs: a channel may be held by several threads, all must read before any writes."""
    acc = s0 * w0 + s1 * w1 + s2 * w2 + x * w3
    dt = pool_ptr.dtype.element_ty
    tl.store(pool_ptr + ch * 3, s1.to(dt), mask=mask)
    tl.store(pool_ptr + ch * 3 + 1, s2.to(dt), mask=mask)
    tl.store(pool_ptr + ch * 3 + 2, x.to(dt), mask=mask)
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_step(x_ptr, w_ptr, pool_ptr, ch, mask, W: tl.constexpr):
    """SiLU(Σ_i w[c, i]·window_i) for channels `ch` of one slot; shifts the raw input into the slot's state."""
    x, s0, s1, s2, w0, w1, w2, w3 = _conv_inputs(x_ptr, w_ptr, pool_ptr, ch, mask, W)
    tl.debug_barrier()
    return _conv_shift(x, s0, s1, s2, w0, w1, w2, w3, pool_ptr, ch, mask)


@triton.jit
def _gate(raw, a_log, bias, lower_bound, HAS_LOWER_BOUND: tl.constexpr):
    a = raw + bias
    if HAS_LOWER_BOUND:
        return lower_bound * tl.sigmoid(tl.exp(a_log) * a)
    # -exp(A_log)·softplus(a), softplus written stably
    return -tl.exp(a_log) * (tl.maximum(a, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(a))))


@triton.jit
def _low_rank_gate(fa_row, fb_ptr, ch, K: tl.constexpr, RC: tl.constexpr):
    """g_raw[ch] = Σ_r f_a[r] · f_b[ch, r] over the gate's K-wide low rank (f_b [D, K] row-major), RC values of r at a
    time (a [K, RC] tile of f_b in registers beside the state), rounded to f_a's dtype as the f_b GEMM's output is."""
    acc = tl.zeros([K], dtype=tl.float32)
    rr = tl.arange(0, RC)
    for r0 in tl.static_range(0, K, RC):
        fa = tl.load(fa_row + r0 + rr).to(tl.float32)
        w = tl.load(fb_ptr + ch[:, None] * K + (r0 + rr)[None, :]).to(tl.float32)
        acc += tl.sum(w * fa[None, :], 1)
    return acc.to(fa_row.dtype.element_ty).to(tl.float32)


@triton.jit
def kda_decode_fused_kernel(qkv_ptr, conv_w_ptr, conv_pool_ptr, graw_ptr, a_log_ptr, dt_bias_ptr, b_ptr, gout_ptr,
                            norm_w_ptr, state_ptr, slot_ptr, out_ptr, stride_qkv, stride_cp, stride_graw, stride_b,
                            stride_gout, stride_st, stride_out, scale, lower_bound, eps, H: tl.constexpr,
                            K: tl.constexpr, W: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, fb_ptr=None,
                            FB: tl.constexpr = False, FB_RC: tl.constexpr = 16, PDL: tl.constexpr = False):
    """FB: graw_ptr holds f_a [N, K] (the gate's low-rank input) and the program applies f_b (fb_ptr, [H·K, K]) to
    its head's channels itself: the f_b GEMM's launch saved (_low_rank_gate)."""
    pdl_prologue(PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    D = H * K
    slot = tl.load(slot_ptr + n).to(tl.int64)
    rk = tl.arange(0, K)
    ch = h * K + rk
    x_row = qkv_ptr + n * stride_qkv
    pool = conv_pool_ptr + slot * stride_cp
    full = rk < K
    p_s = state_ptr + slot * stride_st + h * K * K + rk[:, None] * K + rk[None, :]   # [V, K], V-first
    # The state's 64 KiB, then every small input (ptxas issues these first), then one barrier and the math. Each
    # conv stage loading after the last one's stores, the gate after the conv and the out gate after the state's
    # math made five memory latencies the program waited out alone (ncu: about 40 % of the stall samples, most of
    # the gap to the floor; BENCHMARKS.md, sixteenth session).
    S = tl.load(p_s)
    cq = _conv_inputs(x_row, conv_w_ptr, pool, ch, full, W)
    ck = _conv_inputs(x_row, conv_w_ptr, pool, D + ch, full, W)
    cv = _conv_inputs(x_row, conv_w_ptr, pool, 2 * D + ch, full, W)
    if FB:
        g_raw = _low_rank_gate(graw_ptr + n * stride_graw, fb_ptr, ch, K, FB_RC)
    else:
        g_raw = tl.load(graw_ptr + n * stride_graw + ch).to(tl.float32)
    g_bias = tl.load(dt_bias_ptr + ch).to(tl.float32)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    beta = tl.sigmoid(tl.load(b_ptr + n * stride_b + h).to(tl.float32))
    gate_out = tl.load(gout_ptr + n * stride_gout + ch).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + rk).to(tl.float32)
    tl.debug_barrier()  # every thread has read its conv windows (see _conv_shift)
    q = _conv_shift(*cq, pool, ch, full)
    k = _conv_shift(*ck, pool, D + ch, full)
    v = _conv_shift(*cv, pool, 2 * D + ch, full)
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    g = _gate(g_raw, a_log, g_bias, lower_bound, HAS_LOWER_BOUND)
    S = S.to(tl.float32) * tl.exp(g)[None, :]
    u = (v - tl.sum(S * k[None, :], 1)) * beta                                       # [V]
    S += u[:, None] * k[None, :]
    o = tl.sum(S * q[None, :], 1)                                                    # [V]
    tl.store(p_s, S.to(state_ptr.dtype.element_ty))
    o = o * tl.rsqrt(tl.sum(o * o, 0) / K + eps) * norm_w
    o = o * tl.sigmoid(gate_out)
    tl.store(out_ptr + n * stride_out + ch, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _state_slice(state_ptr, slot_ptr, stride_st, n, h, vb, K: tl.constexpr, BV: tl.constexpr):
    """Pointers [BV, K] to value rows [BV·vb, +BV) of head h's [V, K] state in sequence n's slot (V-first)."""
    slot = tl.load(slot_ptr + n).to(tl.int64)
    rv = vb * BV + tl.arange(0, BV)
    return state_ptr + slot * stride_st + h * K * K + rv[:, None] * K + tl.arange(0, K)[None, :]


@triton.jit
def _update_slice(S, p_s, n, h, vb, y_ptr, graw_ptr, a_log_ptr, dt_bias_ptr, b_ptr, o_ptr, stride_y, stride_graw,
                  stride_b, stride_o, scale, lower_bound, H: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                  HAS_LOWER_BOUND: tl.constexpr):
    """One decode token of sequence n, head h on its state slice S (as loaded from p_s, value rows [BV·vb, +BV)):
    o = Sᵀq after S ← diag(exp g)S; S += β k (v − Sᵀk)ᵀ; S is stored back to p_s (y = conv output)."""
    D = H * K
    rk = tl.arange(0, K)
    rv = vb * BV + tl.arange(0, BV)
    row = y_ptr + n * stride_y + h * K
    q = tl.load(row + rk)
    k = tl.load(row + D + rk)
    v = tl.load(row + 2 * D + rv)
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    g = _gate(tl.load(graw_ptr + n * stride_graw + h * K + rk).to(tl.float32), tl.load(a_log_ptr + h).to(tl.float32),
              tl.load(dt_bias_ptr + h * K + rk).to(tl.float32), lower_bound, HAS_LOWER_BOUND)
    beta = tl.sigmoid(tl.load(b_ptr + n * stride_b + h).to(tl.float32))
    S = S.to(tl.float32) * tl.exp(g)[None, :]
    u = (v - tl.sum(S * k[None, :], 1)) * beta
    S += u[:, None] * k[None, :]
    tl.store(p_s, S.to(p_s.dtype.element_ty))
    tl.store(o_ptr + n * stride_o + h * K + rv, tl.sum(S * q[None, :], 1))


@triton.jit
def kda_recurrent_vsplit_kernel(y_ptr, graw_ptr, a_log_ptr, dt_bias_ptr, b_ptr, state_ptr, slot_ptr, o_ptr,
                                stride_y, stride_graw, stride_b, stride_st, stride_o, scale, lower_bound,
                                H: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                                PDL: tl.constexpr = False):
    """_update_slice of sequence program_id(0), head program_id(1), value slice program_id(2), in place."""
    pdl_prologue(PDL)
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p_s = _state_slice(state_ptr, slot_ptr, stride_st, n, h, vb, K, BV)
    _update_slice(tl.load(p_s), p_s, n, h, vb, y_ptr, graw_ptr, a_log_ptr, dt_bias_ptr, b_ptr, o_ptr, stride_y,
                  stride_graw, stride_b, stride_o, scale, lower_bound, H, K, BV, HAS_LOWER_BOUND)


@triton.jit
def conv_update_kernel(qkv_ptr, conv_w_ptr, conv_pool_ptr, slot_ptr, y_ptr, stride_qkv, stride_cp, stride_y,
                       C, W: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
    """y[n, c] = SiLU(conv) for one token per sequence; the slot's conv state shifts in place."""
    pdl_prologue(PDL)
    n = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = ch < C
    slot = tl.load(slot_ptr + n).to(tl.int64)
    y = _conv_step(qkv_ptr + n * stride_qkv, conv_w_ptr, conv_pool_ptr + slot * stride_cp, ch, mask, W)
    tl.store(y_ptr + n * stride_y + ch, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_norm_kernel(o_ptr, gout_ptr, norm_w_ptr, out_ptr, T, stride_o, stride_gout, stride_out, eps,
                      K: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, h] = RMSNorm(o[t, h]; w) · sigmoid(g_out[t, h]) per head of K values, fp32 math; BT tokens of
    head program_id(1) per program (one [K] row a program leaves most of its threads idle)."""
    pdl_prologue(PDL)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    ch = tl.program_id(1) * K + tl.arange(0, K)
    m = (rt < T)[:, None]
    o = tl.load(o_ptr + rt[:, None] * stride_o + ch[None, :], mask=m, other=0.0).to(tl.float32)
    o = o * tl.rsqrt(tl.sum(o * o, 1) / K + eps)[:, None] * tl.load(norm_w_ptr + tl.arange(0, K)).to(tl.float32)[None, :]
    o = o * tl.sigmoid(tl.load(gout_ptr + rt[:, None] * stride_gout + ch[None, :], mask=m, other=0.0).to(tl.float32))
    tl.store(out_ptr + rt[:, None] * stride_out + ch[None, :], o.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def conv_prefill_rows_kernel(qkv_ptr, conv_w_ptr, conv_pool_ptr, slot_ptr, cu_ptr, tok_seq_ptr, y_ptr, T, stride_qkv,
                             stride_cp, C, D, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                             NORM_K: tl.constexpr = 0):
    """y[c // D, t, c % D] = SiLU(Σ_i w[c, i]·x[t-W+1+i, c]) over packed sequences, the slot state standing in
    before each sequence's start. A program walks BT tokens of BC channels row by row: the last W-1 inputs stay in
    registers, so each input row is read once. y is [3, T, D] so that q, k and v each come out contiguous; BC
    divides D, so a tile lies in one plane and its stores are contiguous. NORM_K > 0 (it must divide BC): the q
    and k planes are also L2-normed over each head's NORM_K channels (eps 1e-6 inside the sqrt, as fla-core's
    in-kernel l2norm), in fp32 before the one rounding, so chunk_kda need not make its own two passes over q and k.

    Most tiles lie inside one sequence, W-1 rows or more past its start: those walk their rows with no per-row
    sequence lookups and load each row two rows ahead of its use. The others (at sequence starts and ends) look
    each row's sequence up and read the window from the slot state where it lies before the start."""
    tl.static_assert(W == 4, "conv_prefill_rows_kernel is written for K3's short conv of width 4")
    # channels as [heads, head channels] so that the norm is a row reduction (one head a row without NORM_K)
    NK: tl.constexpr = NORM_K if NORM_K > 0 else BC
    t0 = tl.program_id(0) * BT
    c0 = tl.program_id(1) * BC
    ch = c0 + tl.arange(0, BC // NK)[:, None] * NK + tl.arange(0, NK)[None, :]   # all < C (BC divides D): no masks
    plane = c0 // D
    out = y_ptr + plane.to(tl.int64) * T * D + (ch - plane * D)
    w0 = tl.load(conv_w_ptr + ch * W)
    w1 = tl.load(conv_w_ptr + ch * W + 1)
    w2 = tl.load(conv_w_ptr + ch * W + 2)
    w3 = tl.load(conv_w_ptr + ch * W + 3)
    t_end = tl.minimum(t0 + BT, T)
    sid = tl.load(tok_seq_ptr + t0)
    if (tl.load(tok_seq_ptr + t_end - 1) == sid) & (t0 - tl.load(cu_ptr + sid) >= W - 1):
        row = qkv_ptr + t0.to(tl.int64) * stride_qkv + ch
        x3 = tl.load(row - 3 * stride_qkv).to(tl.float32)
        x2 = tl.load(row - 2 * stride_qkv).to(tl.float32)
        x1 = tl.load(row - stride_qkv).to(tl.float32)
        xa = tl.load(row).to(tl.float32)
        xb = tl.load(row + stride_qkv, mask=t0 + 1 < t_end, other=0.0).to(tl.float32)
        # unrolled by 4 so that the window's shift below is register renaming, not moves
        for r in tl.range(0, BT, loop_unroll_factor=4):
            t = t0 + r
            xc = tl.load(row + (r + 2) * stride_qkv, mask=t + 2 < t_end, other=0.0).to(tl.float32)
            y = _conv_out(w0, w1, w2, w3, xa, x1, x2, x3, plane, NORM_K)
            tl.store(out + t.to(tl.int64) * D, y.to(y_ptr.dtype.element_ty), mask=t < t_end)
            x3 = x2
            x2 = x1
            x1 = xa
            xa = xb
            xb = xc
    else:
        x1 = tl.zeros((BC // NK, NK), dtype=tl.float32)  # inputs at t-1, t-2, t-3
        x2 = tl.zeros((BC // NK, NK), dtype=tl.float32)
        x3 = tl.zeros((BC // NK, NK), dtype=tl.float32)
        for r in range(0, BT):
            t = t0 + r
            if t < T:
                sid = tl.load(tok_seq_ptr + t)
                start = tl.load(cu_ptr + sid)
                x0 = tl.load(qkv_ptr + t.to(tl.int64) * stride_qkv + ch).to(tl.float32)
                if (r == 0) | (t - start < W - 1):
                    pool = conv_pool_ptr + tl.load(slot_ptr + sid).to(tl.int64) * stride_cp
                    x1 = _raw_input(qkv_ptr, pool, ch, None, t - 1, start, stride_qkv, W)
                    x2 = _raw_input(qkv_ptr, pool, ch, None, t - 2, start, stride_qkv, W)
                    x3 = _raw_input(qkv_ptr, pool, ch, None, t - 3, start, stride_qkv, W)
                y = _conv_out(w0, w1, w2, w3, x0, x1, x2, x3, plane, NORM_K)
                tl.store(out + t.to(tl.int64) * D, y.to(y_ptr.dtype.element_ty))
                x3 = x2
                x2 = x1
                x1 = x0


@triton.jit
def _conv_out(w0, w1, w2, w3, x0, x1, x2, x3, plane, NORM_K: tl.constexpr):
    """One conv output row [heads, NORM_K] from inputs at t, t-1, t-2, t-3: SiLU, then (q and k planes, NORM_K > 0)
    each head's L2 norm."""
    acc = w0 * x3 + w1 * x2 + w2 * x1 + w3 * x0
    # SiLU as acc / (1 + e^-acc) in one fast division (≤ 2 ulp), fewer instructions than the precise sigmoid and a
    # product: the row walk is bound by instruction issue (sm_90 SASS: 121 a row of 128 channels, from 152)
    y = tl.fdiv(acc, 1 + tl.exp(-acc))
    if NORM_K > 0:
        if plane < 2:
            y = y * (1 / tl.sqrt(tl.sum(y * y, 1) + 1e-6))[:, None]  # one division a head, as fla-core's l2norm
    return y


@triton.jit
def _raw_input(qkv_ptr, pool, ch, mask, pos, start, stride_qkv, W: tl.constexpr):
    """Raw conv input of packed position pos: the chunk's token, or the slot's old state before start (channels
    where mask holds; mask None: all of ch)."""
    if pos >= start:
        x = tl.load(qkv_ptr + pos * stride_qkv + ch, mask=mask)
    else:
        x = tl.load(pool + ch * (W - 1) + (pos - start + W - 1), mask=mask)
    return x.to(tl.float32)


@triton.jit
def conv_state_kernel(qkv_ptr, conv_pool_ptr, slot_ptr, cu_ptr, stride_qkv, stride_cp, C, W: tl.constexpr,
                      BC: tl.constexpr):
    """After a prefill chunk: each slot keeps the last W-1 raw inputs (old state where the chunk is shorter)."""
    tl.static_assert(W == 4, "conv_state_kernel is written for K3's short conv of width 4")
    n = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    mask = ch < C
    pool = conv_pool_ptr + tl.load(slot_ptr + n).to(tl.int64) * stride_cp
    # read every source before writing: sources in the old state sit at an index >= the one written
    x0 = _raw_input(qkv_ptr, pool, ch, mask, end - 3, start, stride_qkv, W)
    x1 = _raw_input(qkv_ptr, pool, ch, mask, end - 2, start, stride_qkv, W)
    x2 = _raw_input(qkv_ptr, pool, ch, mask, end - 1, start, stride_qkv, W)
    tl.debug_barrier()
    dt = conv_pool_ptr.dtype.element_ty
    tl.store(pool + ch * 3, x0.to(dt), mask=mask)
    tl.store(pool + ch * 3 + 1, x1.to(dt), mask=mask)
    tl.store(pool + ch * 3 + 2, x2.to(dt), mask=mask)
