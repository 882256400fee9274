"""Absorbed NoPE MLA over a paged latent cache, with the K3 output gate (K3_SPEC.md §2.3)."""
import torch

from k3plugins.norm.reference import rms_norm


def _check(name: str, tensor: torch.Tensor | None, shape: tuple) -> None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"mla_mixer: {name} must be {list(shape)}, got {list(tensor.shape)}")


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


def mla_mixer(x: torch.Tensor, q_a_weight: torch.Tensor | None, q_a_norm_weight: torch.Tensor | None,
              q_b_weight: torch.Tensor, kv_a_weight: torch.Tensor, kv_a_norm_weight: torch.Tensor,
              w_uk: torch.Tensor, w_uv: torch.Tensor, g_weight: torch.Tensor | None, o_weight: torch.Tensor,
              kv_cache: torch.Tensor, *, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
              page_table: torch.Tensor, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
              v_head_dim: int, scale: float, latent_eps: float) -> torch.Tensor:
    """One MLA layer over N packed sequences: append their latents to the paged cache, attend causally.

    Args:
        x: [T, hidden] new tokens of N sequences, packed.
        q_a_weight: [q_lora, hidden] or None (then q_b_weight is the plain q_proj).
        q_a_norm_weight: [q_lora] or None.
        q_b_weight: [H*(nope+rope), q_lora or hidden].
        kv_a_weight: [r + rope, hidden]; kv_a_norm_weight: [r].
        w_uk: [H, nope, r] absorbed into q; w_uv: [H, r, v] applied to the attended latent.
        g_weight: [H*v, hidden] sigmoid output gate, or None.
        o_weight: [hidden, H*v].
        kv_cache: [num_pages, page_size, r + rope] this layer's cache, written in place.
        cu_seqlens: [N+1] offsets into x. context_lens: [N] tokens of each sequence after this step
            (its new tokens sit at positions context_lens[n]-T_n ... context_lens[n]-1).
        page_table: [N, max_pages] int32/int64 page ids, -1 unused.
        scale: softmax scale (K3: (nope+rope)^-0.5). latent_eps: eps of the q_a / kv_a norms.

    Returns:
        [T, hidden] in x.dtype (this rank's partial of o_proj).
    """
    T, hidden = x.shape
    H, nope, rope, vd = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    r = kv_a_norm_weight.shape[0]
    if (q_a_weight is None) != (q_a_norm_weight is None):
        raise ValueError("mla_mixer: q_a_weight and q_a_norm_weight must both be given (q_lora) or both be None")
    q_in = hidden if q_a_weight is None else q_a_weight.shape[0]
    _check("q_a_weight", q_a_weight, (q_in, hidden))
    _check("q_a_norm_weight", q_a_norm_weight, (q_in,))
    _check("q_b_weight", q_b_weight, (H * (nope + rope), q_in))
    _check("kv_a_weight", kv_a_weight, (r + rope, hidden))
    _check("w_uk", w_uk, (H, nope, r))
    _check("w_uv", w_uv, (H, r, vd))
    _check("g_weight", g_weight, (H * vd, hidden))
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

    xf = x.float()
    q_src = xf if q_a_weight is None else rms_norm(xf @ q_a_weight.float().T, q_a_norm_weight.float(), eps=latent_eps)
    q = (q_src @ q_b_weight.float().T).view(T, H, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    ckv = xf @ kv_a_weight.float().T                                            # [T, r + rope]
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
    if g_weight is not None:
        o = o * torch.sigmoid(xf @ g_weight.float().T)
    return (o @ o_weight.float().T).to(x.dtype)
