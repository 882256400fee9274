"""Kimi Delta Attention mixer over a slot pool (K3_SPEC.md §2.2): short conv, gates, delta rule, gated norm."""
import torch
import torch.nn.functional as F

# k3build's layout pass pads the fused input projection with zero rows to a multiple of this, so that the rows of
# its GEMM's output start 16-byte aligned: K3 at TP16 has 3206 rows, and for that cuBLAS takes a slower
# `align2` kernel (BENCHMARKS.md, eleventh session). The mixers read the first in_proj_rows() columns.
IN_PROJ_ROW_ALIGN = 64


def in_proj_rows(num_heads: int, head_dim: int, low_rank_gate: bool) -> tuple[int, int]:
    """(rows of q | k | v | f_a | b | g, those rows padded to IN_PROJ_ROW_ALIGN): the in_proj shapes accepted."""
    D = num_heads * head_dim
    rows = 3 * D + head_dim + num_heads + (head_dim if low_rank_gate else D)
    return rows, -(-rows // IN_PROJ_ROW_ALIGN) * IN_PROJ_ROW_ALIGN


def kda_gate(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
             lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g ≤ 0.

    Args:
        raw: [T, H, K] f_b(f_a(x)).
        A_log: [H] per-head log rate.
        dt_bias: [H*K] per-channel bias.
        lower_bound: L for the K3 "safe gate" L·sigmoid(exp(A_log)·(raw+dt_bias)) ∈ (L, 0);
            None for Kimi-Linear's -exp(A_log)·softplus(raw+dt_bias).

    Returns:
        [T, H, K] fp32.
    """
    H, K = raw.shape[-2:]
    a = raw.float() + dt_bias.float().view(H, K)
    rate = A_log.float().view(H, 1).exp()
    if lower_bound is None:
        return -rate * F.softplus(a)
    return lower_bound * torch.sigmoid(rate * a)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule for one sequence, token by token in fp32.

    Per head, with S viewed as [K, V]: S ← diag(exp(g_t)) S; u = v_t − Sᵀk_t; S ← S + β_t k_t uᵀ;
    o_t = Sᵀ (scale·q_t). q and k are used as given (normalise them before calling).

    Args:
        q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] log-decay; beta: [T, H].
        initial_state: [H, V, K] (V-first, as the slot pool stores it) or None for zeros.
        scale: multiplies q.

    Returns:
        (o [T, H, V] in v.dtype, final_state [H, V, K] fp32).
    """
    T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        S = torch.zeros(H, K, V, dtype=torch.float32, device=q.device)
    else:
        if tuple(initial_state.shape) != (H, V, K):
            raise ValueError(f"kda_recurrent: initial_state must be [{H}, {V}, {K}], got {tuple(initial_state.shape)}")
        S = initial_state.float().transpose(1, 2).clone()                      # [H, K, V]
    qf, kf, vf, bf = (q.float() * scale), k.float(), v.float(), beta.float()
    decay = g.float().exp()                                                     # [T, H, K]
    o = torch.empty(T, H, V, dtype=torch.float32, device=q.device)
    for t in range(T):
        S = S * decay[t][:, :, None]
        u = vf[t] - torch.einsum("hkv,hk->hv", S, kf[t])
        S = S + bf[t][:, None, None] * kf[t][:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", S, qf[t])
    return o.to(v.dtype), S.transpose(1, 2).contiguous()


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU continuing from `state`.

    Args:
        x: [T, C] new raw inputs; weight: [C, W], column W-1 multiplies the current token;
        state: [C, W-1] the previous W-1 raw inputs, oldest first.

    Returns:
        (y [T, C] fp32, new_state [C, W-1] fp32 = the last W-1 raw inputs).
    """
    W = weight.shape[1]
    window = torch.cat([state.float(), x.float().T], dim=1)                     # [C, W-1+T]
    y = (window.unfold(1, W, 1) * weight.float()[:, None, :]).sum(-1)          # [C, T]
    return F.silu(y).T, window[:, window.shape[1] - (W - 1):]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # FLA's in-kernel l2norm adds eps inside the sqrt (not F.normalize's max).
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _check_packing(cu_seqlens: torch.Tensor, T: int, num_ids: int, what: str, name: str) -> list[int]:
    cu = [int(c) for c in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name}: cu_seqlens must rise from 0 to {T} (the packed token count), got {cu}")
    if num_ids != len(cu) - 1:
        raise ValueError(f"{name}: {what} has {num_ids} entries for {len(cu) - 1} sequences")
    return cu


def kda_mixer(x: torch.Tensor, in_proj_weight: torch.Tensor, conv_weight: torch.Tensor, f_b_weight: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, g_b_weight: torch.Tensor | None,
              o_norm_weight: torch.Tensor, o_weight: torch.Tensor, recurrent_pool: torch.Tensor,
              conv_pool: torch.Tensor, *, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, num_heads: int,
              head_dim: int, lower_bound: float | None, eps: float) -> torch.Tensor:
    """One KDA layer over N packed sequences, continuing and updating each sequence's slot in place.

    Args:
        x: [T, hidden] tokens of N sequences, packed.
        in_proj_weight: [3D + head_dim + num_heads + G, hidden], rows q | k | v | f_a | b | g
            (G = D full-rank gate, or head_dim when g_b_weight gives the low-rank gate), or those rows and zero
            rows up to a multiple of IN_PROJ_ROW_ALIGN (the build's layout).
        conv_weight: [3D, W] fp32, channels q | k | v.
        f_b_weight: [D, head_dim]; A_log: [num_heads]; dt_bias: [D].
        g_b_weight: [D, head_dim] or None (full-rank gate).
        o_norm_weight: [head_dim]; o_weight: [hidden, D].
        recurrent_pool: [S, num_heads, V, K] fp32/bf16, mutated in place.
        conv_pool: [S, 3D, W-1] last W-1 raw conv inputs, oldest first, mutated in place.
        cu_seqlens: [N+1] int64 offsets into x; slot_ids: [N] slot of each sequence.
        num_heads, head_dim: local heads and K = V.
        lower_bound: gate lower bound (K3: -5.0) or None (Kimi-Linear softplus gate).
        eps: o_norm epsilon.

    Returns:
        [T, hidden] in x.dtype (this rank's partial of o_proj).
    """
    T, hidden = x.shape
    H, K = num_heads, head_dim
    D = H * K
    G = D if g_b_weight is None else K
    W = conv_weight.shape[-1]
    rows, padded = in_proj_rows(H, K, g_b_weight is not None)
    if in_proj_weight.dim() != 2 or in_proj_weight.shape[0] not in (rows, padded) or in_proj_weight.shape[1] != hidden:
        raise ValueError(f"kda_mixer: in_proj_weight must be [{rows}, {hidden}] or [{padded}, {hidden}] (q|k|v|f_a|b|g "
                         f"for {H} heads of {K}, {'full' if g_b_weight is None else 'low'}-rank gate; zero rows after "
                         f"them), got {tuple(in_proj_weight.shape)}")
    expect = {"conv_weight": (conv_weight, (3 * D, W)), "f_b_weight": (f_b_weight, (D, K)), "A_log": (A_log, (H,)),
              "dt_bias": (dt_bias, (D,)), "o_norm_weight": (o_norm_weight, (K,)), "o_weight": (o_weight, (hidden, D)),
              "recurrent_pool": (recurrent_pool, (recurrent_pool.shape[0], H, K, K)),
              "conv_pool": (conv_pool, (recurrent_pool.shape[0], 3 * D, W - 1))}
    if g_b_weight is not None:
        expect["g_b_weight"] = (g_b_weight, (D, K))
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"kda_mixer: {name} must be {list(shape)}, got {list(tensor.shape)}")
    cu = _check_packing(cu_seqlens, T, len(slot_ids), "slot_ids", "kda_mixer")
    slots = [int(s) for s in slot_ids.tolist()]
    if len(set(slots)) != len(slots) or any(not 0 <= s < recurrent_pool.shape[0] for s in slots):
        raise ValueError(f"kda_mixer: slot_ids must be distinct and in [0, {recurrent_pool.shape[0]}), got {slots}")

    proj = x.float() @ in_proj_weight.float().T                                 # [T, rows or padded]
    # The conv reads projections in activation precision, the same values the conv pool stores.
    qkv = proj[:, :3 * D].to(x.dtype)
    f_a, b, g_in = proj[:, 3 * D:rows].split([K, H, G], dim=-1)
    raw = (f_a @ f_b_weight.float().T).view(T, H, K)
    gate = kda_gate(raw, A_log, dt_bias, lower_bound=lower_bound)               # [T, H, K]
    beta = torch.sigmoid(b)                                                     # [T, H]
    g_out = g_in if g_b_weight is None else g_in @ g_b_weight.float().T         # [T, D]

    # NaN, not empty: a token that no sequence covers would show in the output.
    o = torch.full((T, H, K), float("nan"), dtype=torch.float32, device=x.device)
    for n, slot in enumerate(slots):
        s, e = cu[n], cu[n + 1]
        if s == e:
            continue
        y, conv_state = short_conv(qkv[s:e], conv_weight, conv_pool[slot])
        conv_pool[slot] = conv_state.to(conv_pool.dtype)
        q, k, v = (c.reshape(e - s, H, K) for c in y.split(D, dim=-1))
        o[s:e], state = kda_recurrent(_l2norm(q), _l2norm(k), v, gate[s:e], beta[s:e], recurrent_pool[slot],
                                      scale=K ** -0.5)
        recurrent_pool[slot] = state.to(recurrent_pool.dtype)

    # FusedRMSNormGated: per-head RMSNorm with weight, times sigmoid(gate), all fp32.
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * o_norm_weight.float()
    o = o * torch.sigmoid(g_out.view(T, H, K))
    return (o.reshape(T, D) @ o_weight.float().T).to(x.dtype)
