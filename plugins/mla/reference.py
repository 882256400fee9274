"""Absorbed NoPE MLA over a paged latent cache, with the K3 output gate (K3_SPEC.md §2.3)."""
import torch

from k3plugins.norm.reference import rms_norm


def _check(name: str, tensor: torch.Tensor | None, shape: tuple) -> None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"mla_mixer: {name} must be {list(shape)}, got {list(tensor.shape)}")


def in_proj_rows(num_heads: int, nope: int, rope: int, v_head_dim: int, kv_lora_rank: int,
                 q_a_norm_weight: torch.Tensor | None, output_gate: int) -> list[int]:
    """Rows of each part of the stacked in_proj: [q (q_a or plain q_proj), kv_a (latent + rope), gate (0 if none)]."""
    q_rows = num_heads * (nope + rope) if q_a_norm_weight is None else q_a_norm_weight.shape[0]
    return [q_rows, kv_lora_rank + rope, num_heads * v_head_dim if output_gate else 0]


def split_in_proj(proj: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q input, kv_a output, gate logits or None) as column views of in_proj's output."""
    q, ckv, gate = proj.split(rows, dim=-1)
    return q, ckv, gate if rows[2] else None


def _cache_slots(page_table_row: torch.Tensor, positions: torch.Tensor, page_size: int,
                seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids, offsets) of token positions of sequence `seq`; raises if a needed page is unassigned.

    Args:
        page_table_row: [max_pages] page ids, -1 unused. positions: [L] int64.
    """
    idx = positions // page_size
    if len(idx) and int(idx.max()) >= page_table_row.numel():
        raise ValueError(f"mla_mixer: sequence {seq} reaches position {int(positions.max())}, beyond its "
                         f"{page_table_row.numel()} page-table entries of {page_size} tokens")
    pages = page_table_row.long()[idx]
    if (pages < 0).any():
        raise ValueError(f"mla_mixer: sequence {seq} has no page assigned for positions "
                         f"{positions[pages < 0][:4].tolist()}... (page_table entry -1)")
    return pages, positions % page_size


def mla_mixer(x: torch.Tensor, in_proj_weight: torch.Tensor, q_a_norm_weight: torch.Tensor | None,
              q_b_weight: torch.Tensor | None, kv_a_norm_weight: torch.Tensor, w_uk: torch.Tensor,
              w_uv: torch.Tensor, o_weight: torch.Tensor, kv_cache: torch.Tensor, *, cu_seqlens: torch.Tensor,
              context_lens: torch.Tensor, page_table: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
              qk_rope_head_dim: int, v_head_dim: int, scale: float, latent_eps: float,
              output_gate: int, host_seqs: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """One MLA layer over N packed sequences: append their latents to the paged cache, attend causally.

    Args:
        x: [T, hidden] new tokens of N sequences, packed.
        in_proj_weight: [q_rows + r + rope (+ H*v), hidden], every projection of x in one GEMM (split_in_proj):
            q_a_proj [q_lora rows] (or the plain q_proj [H*(nope+rope) rows] when q_a_norm_weight is None),
            kv_a_proj_with_mqa [r + rope rows], then g_proj [H*v rows] if output_gate.
        q_a_norm_weight: [q_lora] or None (no q_lora: no q_b either).
        q_b_weight: [H*(nope+rope), q_lora] or None.
        kv_a_norm_weight: [r].
        w_uk: [H, nope, r] absorbed into q; w_uv: [H, r, v] applied to the attended latent.
        o_weight: [hidden, H*v].
        kv_cache: [num_pages, page_size, r + rope] this layer's cache, written in place.
        cu_seqlens: [N+1] offsets into x. context_lens: [N] tokens of each sequence after this step
            (its new tokens sit at positions context_lens[n]-T_n ... context_lens[n]-1).
        page_table: [N, max_pages] int32/int64 page ids, -1 unused.
        scale: softmax scale (K3: (nope+rope)^-0.5). latent_eps: eps of the q_a / kv_a norms.
        output_gate: 1 if in_proj ends with the sigmoid output gate's rows (K3: g_proj).
        host_seqs: (new tokens, context length) of each sequence as the host knows them, or None: the device
            tactics pick each sequence's prefill form by them; here they are checked against cu_seqlens and
            context_lens.

    Returns:
        [T, hidden] in x.dtype (this rank's partial of o_proj).
    """
    T, hidden = x.shape
    H, nope, rope, vd = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    r = kv_a_norm_weight.shape[0]
    if (q_b_weight is None) != (q_a_norm_weight is None):
        raise ValueError("mla_mixer: q_a_norm_weight and q_b_weight must both be given (q_lora) or both be None")
    rows = in_proj_rows(H, nope, rope, vd, r, q_a_norm_weight, output_gate)
    _check("in_proj_weight", in_proj_weight, (sum(rows), hidden))
    if q_b_weight is not None:
        _check("q_b_weight", q_b_weight, (H * (nope + rope), rows[0]))
    _check("w_uk", w_uk, (H, nope, r))
    _check("w_uv", w_uv, (H, r, vd))
    _check("o_weight", o_weight, (hidden, H * vd))
    _check("kv_cache", kv_cache, (kv_cache.shape[0], kv_cache.shape[1], r + rope))
    cu = [int(c) for c in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"mla_mixer: cu_seqlens must rise from 0 to {T} (the packed token count), got {cu}")
    N = len(cu) - 1
    lens = [int(c) for c in context_lens.tolist()]
    if len(lens) != N or page_table.dim() != 2 or page_table.shape[0] != N:
        raise ValueError(f"mla_mixer: context_lens ({len(lens)}) and page_table rows ({tuple(page_table.shape)}) "
                         f"must match the {N} sequences of cu_seqlens")
    if any(lens[n] < cu[n + 1] - cu[n] for n in range(N)):
        raise ValueError(f"mla_mixer: context_lens {lens} must be >= each sequence's new tokens {cu}")
    seqs = [(cu[n + 1] - cu[n], lens[n]) for n in range(N)]
    if host_seqs is not None and [tuple(s) for s in host_seqs] != seqs:
        raise ValueError(f"mla_mixer: host_seqs {list(host_seqs)} differ from the step's (new tokens, context) {seqs}")

    q_src, ckv, gate = split_in_proj(x.float() @ in_proj_weight.float().T, rows)
    if q_b_weight is not None:
        q_src = rms_norm(q_src, q_a_norm_weight.float(), eps=latent_eps) @ q_b_weight.float().T
    q = q_src.view(T, H, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    latent = rms_norm(ckv[:, :r], kv_a_norm_weight.float(), eps=latent_eps)
    entries = torch.cat([latent, ckv[:, r:]], dim=-1).to(kv_cache.dtype)        # [T, r + rope]
    # Absorption: score = (q_nope W_uk) · c, so decode reads only the (r + rope)-wide latent.
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk.float())                  # [T, H, r]

    page_size = kv_cache.shape[1]
    for n in range(N):
        s, e = cu[n], cu[n + 1]
        pos = torch.arange(lens[n] - (e - s), lens[n], device=x.device)
        pages, offs = _cache_slots(page_table[n], pos, page_size, n)
        kv_cache[pages, offs] = entries[s:e]
        # a page this step began keeps zeros past the sequence's last row: the device kernels multiply a zero
        # probability by each row of a sequence's last page, and must not meet a NaN an earlier owner left there
        if e > s and int(pos[0]) <= int(pos[-1]) - int(offs[-1]):
            kv_cache[pages[-1], int(offs[-1]) + 1:] = 0

    # NaN, not empty: a token that no sequence covers would show in the output.
    o = torch.full((T, H, vd), float("nan"), dtype=torch.float32, device=x.device)
    for n in range(N):
        s, e = cu[n], cu[n + 1]
        if s == e:
            continue
        # Every token, new ones included, is read back from the cache: one precision for all positions.
        pos = torch.arange(lens[n], device=x.device)
        pages, offs = _cache_slots(page_table[n], pos, page_size, n)
        c = kv_cache[pages, offs].float()                                       # [L, r + rope]
        scores = (torch.einsum("thr,lr->thl", q_lat[s:e], c[:, :r])
                  + torch.einsum("thp,lp->thl", q_pe[s:e], c[:, r:])) * scale  # [Tn, H, L]
        q_pos = torch.arange(lens[n] - (e - s), lens[n], device=x.device)
        future = pos[None, :] > q_pos[:, None]                                  # [Tn, L]
        probs = torch.softmax(scores.masked_fill(future[:, None, :], float("-inf")), dim=-1)
        o_lat = torch.einsum("thl,lr->thr", probs, c[:, :r])
        o[s:e] = torch.einsum("thr,hrv->thv", o_lat, w_uv.float())

    o = o.reshape(T, H * vd)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return (o @ o_weight.float().T).to(x.dtype)
