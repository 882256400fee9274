"""Per-rank memory model: weights, MLA KV, KDA state, activation reserve, and how many requests fit.

Arithmetic over a K3Config and a Mapping (no torch in this file), so the builder, `k3build plan` and tests
share one answer. Weight bytes come from `memory_weights`: every tensor of `k3build.schema` (imported on first
use; it imports torch), owned as `Mapping.shard` says.

Device memory convention: `gpu_memory_bytes` is the device's total as torch reports it
(`torch.cuda.get_device_properties(i).total_memory`). Measured on an H200 (torch 2.11, CUDA 13): 150,109,880,320 B
= 139.80 GiB (nvidia-smi says 143,771 MiB), of which the CUDA context takes 529 MiB. The plan keeps
`overhead_bytes` (default 1 GiB: that context, NCCL/RCCL communicators, allocator slack) and an activation
reserve (`activation_reserve`) off the top; the rest holds KDA slots and MLA pages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import ceil

from .config import K3Config
from .mapping import Mapping
from .memory_weights import CATEGORIES, check_expert_format, weight_bytes

__all__ = ["CATEGORIES", "GiB", "MiB", "PAGE_SIZE", "H200_GIB", "H200_TOTAL_BYTES", "MI300X_GIB", "MAX_GIB",
           "MemoryPlan", "RankMemory", "activation_reserve", "exchange_capacity_rows", "gib_bytes", "kda_state_bytes",
           "kv_bytes_per_token", "plan_memory", "reserve_bytes", "size_text", "weight_bytes"]

GiB = 1 << 30
MiB = 1 << 20
PAGE_SIZE = 64  # tokens per MLA page (fast MLA decode kernels need 64)
UNABSORBED_PIECE_BYTES = 256 * MiB  # k3plugins.mla.prefill.KEY_PIECE_BYTES: a context piece's keys and values
H200_TOTAL_BYTES = 150_109_880_320  # measured, see the module doc
H200_GIB = 139.8
MI300X_GIB = 191.5  # 192 GB HBM3; ROCm reports about 191.7 GiB (not measured in this project)
DEFAULT_OVERHEAD_BYTES = 1 * GiB
STATE_BYTES = {"fp32": 4, "bf16": 2}
# the engine's activation dtype (build --dtype): its bf16 checkpoint tensors, activations and KDA conv inputs
ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MAX_GIB = 1 << 20  # a sanity bound on GiB figures (1 PiB a rank)
CHUNK = 64  # KDA chunk length of the prefill kernel


def gib_bytes(gib: float, what: str, *, positive: bool = True) -> int:
    """`gib` GiB as bytes; a ValueError naming `what` unless it is finite, at most MAX_GIB, and (positive) at
    least one byte."""
    if not (0 <= gib <= MAX_GIB) or (positive and int(gib * GiB) < 1):  # also refuses nan
        low = "above 0" if positive else "0 or more"
        raise ValueError(f"{what}: expected a number of GiB {low} and at most {MAX_GIB}, got {gib!r}")
    return int(gib * GiB)


def kda_state_bytes(cfg: K3Config, mapping: Mapping, rank: int, state_dtype: str = "fp32", dtype: str = "bf16") -> int:
    """KDA slot bytes per request on `rank`: recurrent [H_tp, V, K] in state_dtype + the last W-1 conv inputs
    of q|k|v in the engine's activation dtype (K3_SPEC §4.1: bf16)."""
    if state_dtype not in STATE_BYTES:
        raise ValueError(f"state_dtype: expected one of {sorted(STATE_BYTES)}, got {state_dtype!r}")
    heads = cfg.kda_num_heads // mapping.attn_tp_size
    per_layer = (heads * cfg.kda_head_dim * cfg.kda_head_dim * STATE_BYTES[state_dtype]
                 + (cfg.kda_conv_size - 1) * 3 * heads * cfg.kda_head_dim * _act_bytes(dtype))
    return per_layer * sum(1 for i in _layers(cfg, mapping, rank) if cfg.layer_types[i] == "kda")


def kv_bytes_per_token(cfg: K3Config, mapping: Mapping, rank: int, kv_dtype_bytes: int = 2) -> int:
    """Absorbed-MLA cache bytes per token on `rank`: one 576-wide latent per MLA layer of its stage.

    The latent is one "head", so attention-TP does not split it: every TP rank of a stage holds it.
    """
    n = sum(1 for i in _layers(cfg, mapping, rank) if cfg.layer_types[i] == "mla")
    return n * cfg.mla_cache_width * kv_dtype_bytes


def exchange_capacity_rows(cfg: K3Config, mapping: Mapping, max_num_tokens: int) -> int:
    """Rows (token x expert pairs) a rank's fixed-capacity MoE buffers must hold, worst-case routing.

    Without device->host sync the buffers cannot be sized by the actual routing, so they cover the case where
    every token sent to this rank picks only local experts: tokens_in x min(top_k, local experts). Under
    attention-DP each of the EP ranks sends its own max_num_tokens; under attention-TP the tokens are already
    replicated in the TP group.
    """
    local = cfg.num_experts // mapping.moe_ep_size
    tokens_in = max_num_tokens * (mapping.moe_ep_size if mapping.attention_dp else 1)
    return tokens_in * min(cfg.num_experts_per_token, local)


def activation_reserve(cfg: K3Config, mapping: Mapping, rank: int, *, max_num_tokens: int,
                       max_batch_size: int, dtype: str = "bf16", max_seq_len: int | None = None) -> dict[str, int]:
    """Transient bytes of one forward step on `rank` (T = max_num_tokens, B = max_batch_size); "bf16" below is
    the activation dtype (`dtype`, bf16 unless the build says otherwise).

    residual: T x hidden x bf16 x (3 + AttnRes snapshots): running sum, normed input, mixer/FFN output, snapshots.
    exchange: dispatch + combine buffers, exchange_capacity_rows x latent x bf16 x 2 (persistent).
    peak: the largest per-layer working set of the stage, one of
      kda   T x (5 proj outputs bf16 + fp32 gate) x D_tp + T x H_tp x (fp32 beta + 2 fp32 64-chunk rows);
      mla   T x H_tp x (q 192 + k_nope|v 256 + out 128 + gate 128) x bf16 + T x 576 x bf16; with max_seq_len,
            + the un-absorbed prefill's (k3plugins/mla/prefill.py): one piece of a context's keys and values
            (at most UNABSORBED_PIECE_BYTES, whole pages), its latents, T x H_tp x fp32 (lse), and where a
            context takes more than one piece T x H_tp x v x fp32 (the running output the pieces merge into);
      dense T x 3 x intermediate_tp x bf16;
      moe   latent (MoEInProj): T x (latent + 2 shared_tp + E) x fp32 + T x (latent + 3 shared_tp) x bf16; else
            T x E x fp32 router + T x 3 x shared_tp x bf16; then + rows x 3 x moe_intermediate_tp x bf16;
      logits B x vocab x fp32 (gathered) + B x vocab_tp x fp32 (last stage).
    penalty_counts: B x vocab x (int32 + bool) on the ranks that sample (persistent): the last stage's first TP
      rank, every rank under attention-DP; the penalized requests' token counts, a row per KDA slot
      (runtime/penalties.py SeenCounts; the plan's slots are at most B).
    Returns {"residual", "exchange", "penalty_counts", "peak_kda", "peak_mla", "peak_dense", "peak_moe",
    "peak_logits"}; `reserve_bytes` adds them up as overhead + residual + exchange + penalty_counts + the largest
    peak (layers run one by one).
    """
    T, layers, act = max_num_tokens, list(_layers(cfg, mapping, rank)), _act_bytes(dtype)
    kinds = {cfg.layer_types[i] for i in layers}
    snaps = sum(1 for i in range(cfg.num_hidden_layers) if cfg.takes_snapshot(i))
    h_tp = cfg.kda_num_heads // mapping.attn_tp_size
    d_tp = h_tp * cfg.kda_head_dim
    mla_h = cfg.num_attention_heads // mapping.attn_tp_size
    dense_tp = mapping.dense_tp_size
    has_moe = any(cfg.is_moe_layer(i) for i in layers)
    rows = exchange_capacity_rows(cfg, mapping, T) if has_moe else 0
    shared_tp = cfg.shared_intermediate_size // dense_tp
    if cfg.is_latent_moe:  # MoEInProj's fp32 row (in_proj | router logits), the bf16 rest of it, the shared GLU
        in_cols = cfg.expert_hidden_size + 2 * shared_tp
        moe_in = T * (in_cols + cfg.num_experts) * 4 + T * (in_cols + shared_tp) * act
    else:
        moe_in = T * cfg.num_experts * 4 + T * 3 * shared_tp * act
    unabsorbed = 0
    if max_seq_len is not None:
        per_key = mla_h * (cfg.qk_nope_head_dim + cfg.v_head_dim) * act
        keys = min(max(PAGE_SIZE, UNABSORBED_PIECE_BYTES // per_key // PAGE_SIZE * PAGE_SIZE),
                   ceil(max_seq_len / PAGE_SIZE) * PAGE_SIZE)
        merged = cfg.v_head_dim if keys < max_seq_len else 0  # one piece: the kernel writes the activation itself
        unabsorbed = keys * (per_key + cfg.mla_cache_width * act) + T * mla_h * (merged + 1) * 4
    return {
        "residual": T * cfg.hidden_size * act * (3 + snaps),
        "exchange": rows * cfg.expert_hidden_size * act * 2,
        "penalty_counts": max_batch_size * cfg.vocab_size * 5
        if mapping.is_last_stage(rank) and (mapping.attention_dp or mapping.tp_rank(rank) == 0) else 0,
        "peak_kda": T * (5 * act + 4) * d_tp + T * h_tp * (4 + 2 * CHUNK * 4) if "kda" in kinds else 0,
        "peak_mla": (T * mla_h * (cfg.qk_head_dim + cfg.qk_nope_head_dim + 3 * cfg.v_head_dim) * act
                + T * cfg.mla_cache_width * act + unabsorbed) if "mla" in kinds else 0,
        "peak_dense": T * 3 * (cfg.intermediate_size // dense_tp) * act
        if any(not cfg.is_moe_layer(i) for i in layers) else 0,
        "peak_moe": moe_in + rows * 3 * (cfg.moe_intermediate_size // mapping.moe_tp_size) * act if has_moe else 0,
        "peak_logits": (max_batch_size * cfg.vocab_size * 4 + max_batch_size * (cfg.vocab_size // dense_tp) * 4)
        if mapping.is_last_stage(rank) else 0,
    }


def reserve_bytes(reserve: dict[str, int]) -> int:
    """The sum of a reserve dict's terms (overhead, spare, residual, exchange, penalty_counts) but only the
    largest of its peak_* terms (layers run one by one)."""
    peaks = [v for k, v in reserve.items() if k.startswith("peak_")]
    return sum(v for k, v in reserve.items() if not k.startswith("peak_")) + max(peaks, default=0)


@dataclass(frozen=True)
class RankMemory:
    """One rank's budget. Byte counts. Requests are of max_seq_len tokens: `memory_requests` is how many its free
    memory holds, `max_concurrent_requests` how many the planned slots and pages run at once (at most
    max_batch_size, which caps the KDA slots)."""

    rank: int
    pp_rank: int
    tp_rank: int
    layers: tuple[int, int]  # [start, stop) of its PP stage
    weights: dict[str, int]  # category -> bytes
    weight_bytes: int
    kv_bytes_per_token: int
    kda_state_bytes_per_request: int
    page_bytes: int
    request_bytes: int  # one KDA slot + ceil(max_seq_len / page_size) pages
    reserve: dict[str, int]  # overhead, the runtime's spare slot and page, activation_reserve terms
    reserve_bytes: int
    free_bytes: int  # gpu memory - weights - reserve (negative when weights do not fit)
    memory_requests: int
    max_concurrent_requests: int
    kda_slots: int
    kv_pages: int
    fits: bool
    reason: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


@dataclass(frozen=True)
class MemoryPlan:
    """Plan for all ranks. `memory_requests` and `max_concurrent_requests` (see RankMemory) are system-wide
    (per pipeline replica)."""

    mapping: dict
    gpu_memory_bytes: int
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int
    page_size: int
    kv_dtype_bytes: int
    state_dtype: str
    dtype: str
    expert_format: str
    kv_bytes_per_token_model: int  # all MLA layers, one rank's view at attention-TP 1
    kda_state_bytes_per_request_model: int  # all KDA layers, unsharded
    ranks: tuple[RankMemory, ...]
    memory_requests: int
    max_concurrent_requests: int
    fits: bool
    reason: str
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def worst_rank(self) -> RankMemory:
        """The rank that limits concurrency (ties: the fewest requests its memory holds, the least free memory)."""
        return min(self.ranks, key=lambda r: (r.max_concurrent_requests, r.memory_requests, r.free_bytes, r.rank))

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "ranks"}
        d["notes"] = list(self.notes)
        d["ranks"] = [r.to_dict() for r in self.ranks]
        return d


def plan_memory(cfg: K3Config, mapping: Mapping, *, gpu_memory_bytes: int, max_seq_len: int, max_batch_size: int,
                max_num_tokens: int, kv_dtype_bytes: int = 2, state_dtype: str = "fp32", dtype: str = "bf16",
                page_size: int = PAGE_SIZE, overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                expert_format: str | None = None) -> MemoryPlan:
    """Budget every rank of `mapping` for `cfg`; `fits` is False with a `reason` when a rank cannot hold one
    request of `max_seq_len` tokens.

    dtype: the engine's activation dtype (build --dtype): its bf16 checkpoint tensors, activations and conv state.
    KDA slots: up to max_batch_size while one full-length request's pages still fit; pages take the rest. One
    more slot and page are held back for the runtime (`open_rank`'s spare: the padding rows of captured decode
    steps, an idle attention-DP rank's dummy step).
    Raises MappingError when the mapping does not divide the model, ValueError for bad limits.
    """
    for name, v in (("gpu_memory_bytes", gpu_memory_bytes), ("max_seq_len", max_seq_len),
                    ("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens), ("page_size", page_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if max_num_tokens < max_batch_size:
        raise ValueError(f"max_num_tokens: {max_num_tokens} is less than max_batch_size {max_batch_size} (a decode "
                         "step needs one token per running request)")
    if kv_dtype_bytes not in (1, 2, 4):
        raise ValueError(f"kv_dtype_bytes: expected 1 (fp8), 2 (bf16) or 4 (fp32), got {kv_dtype_bytes!r}")
    if state_dtype not in STATE_BYTES:
        raise ValueError(f"state_dtype: expected one of {sorted(STATE_BYTES)}, got {state_dtype!r}")
    _act_bytes(dtype)
    fmt = expert_format or ("mxfp4" if cfg.quantization.method == "mxfp4" else "bf16")
    check_expert_format(fmt)
    if max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len: {max_seq_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    mapping.validate(cfg)
    ranks = tuple(_rank_plan(cfg, mapping, r, gpu_memory_bytes, max_seq_len, max_batch_size, max_num_tokens,
                             kv_dtype_bytes, state_dtype, dtype, page_size, overhead_bytes, fmt)
                  for r in range(mapping.world_size))
    bad = [r for r in ranks if not r.fits]
    short = [r for r in ranks if r.fits and r.kda_slots < max_batch_size]
    notes = [f"rank {short[0].rank}: memory holds {short[0].kda_slots} KDA slots, fewer than "
             f"max_batch_size={max_batch_size}"] if short else []
    full = Mapping()
    return MemoryPlan(
        mapping=mapping.to_dict(), gpu_memory_bytes=gpu_memory_bytes, max_seq_len=max_seq_len,
        max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, page_size=page_size,
        kv_dtype_bytes=kv_dtype_bytes, state_dtype=state_dtype, dtype=dtype, expert_format=fmt,
        kv_bytes_per_token_model=kv_bytes_per_token(cfg, full, 0, kv_dtype_bytes),
        kda_state_bytes_per_request_model=kda_state_bytes(cfg, full, 0, state_dtype, dtype), ranks=ranks,
        memory_requests=_system_concurrency(mapping, ranks, "memory_requests"),
        max_concurrent_requests=_system_concurrency(mapping, ranks, "max_concurrent_requests"), fits=not bad,
        reason=bad[0].reason if bad else "", notes=tuple(notes))


def _rank_plan(cfg, mapping, rank, gpu, seq, batch, tokens, kv_b, state_dtype, dtype, page_size, overhead, fmt):
    weights = weight_bytes(cfg, mapping, rank, expert_format=fmt, dtype_bytes=_act_bytes(dtype))
    w = sum(weights.values())
    kv_tok = kv_bytes_per_token(cfg, mapping, rank, kv_b)
    slot = kda_state_bytes(cfg, mapping, rank, state_dtype, dtype)
    page = page_size * kv_tok
    pages_per_req = ceil(seq / page_size)
    req = slot + pages_per_req * page
    reserve = {"overhead": overhead, "spare": slot + page,
               **activation_reserve(cfg, mapping, rank, max_num_tokens=tokens, max_batch_size=batch, dtype=dtype,
                                    max_seq_len=seq)}
    res = reserve_bytes(reserve)
    free = gpu - w - res
    n = (free // req if req else batch) if free > 0 else 0
    slots = min(batch, (free - pages_per_req * page) // slot if slot else batch) if n else 0
    pages = (free - slots * slot) // page if n and page else 0
    running = min(slots, pages // pages_per_req if page else slots)
    stage = mapping.rank_layers(rank, cfg.num_hidden_layers)
    where = f"rank {rank} (pp {mapping.pp_rank(rank)}, tp {mapping.tp_rank(rank)})"
    if w > gpu:
        reason = (f"{where}: weights alone need {size_text(w)}, more than the {size_text(gpu)} of device memory "
                  f"(largest: {_largest(weights)})")
    elif w + res > gpu:
        reason = (f"{where}: weights {size_text(w)} + reserve {size_text(res)} (overhead {size_text(overhead)}, "
                  f"the runtime's spare slot and page {size_text(slot + page)}, activations "
                  f"{size_text(res - overhead - slot - page)}) = {size_text(w + res)} exceed the {size_text(gpu)} "
                  "of device memory")
    elif not n:
        reason = (f"{where}: {size_text(free)} left after weights and reserve, but one request of {seq} tokens needs "
                  f"{size_text(req)} (KDA slot {size_text(slot)} + {pages_per_req} pages of {page:,} B)")
    else:
        reason = ""
    return RankMemory(rank=rank, pp_rank=mapping.pp_rank(rank), tp_rank=mapping.tp_rank(rank),
                      layers=(stage.start, stage.stop), weights=weights, weight_bytes=w, kv_bytes_per_token=kv_tok,
                      kda_state_bytes_per_request=slot, page_bytes=page, request_bytes=req, reserve=reserve,
                      reserve_bytes=res, free_bytes=free, memory_requests=n, max_concurrent_requests=running,
                      kda_slots=max(slots, 0),
                      kv_pages=max(pages, 0), fits=not reason, reason=reason)


def _system_concurrency(mapping: Mapping, ranks: tuple[RankMemory, ...], field: str) -> int:
    # A request needs room on one rank of every stage; attention-DP ranks each serve their own requests,
    # attention-TP ranks of a stage all hold the same ones.
    n = {(r.pp_rank, r.tp_rank): getattr(r, field) for r in ranks}
    stages = range(mapping.pp_size)
    if mapping.attention_dp:
        return sum(min(n[(p, t)] for p in stages) for t in range(mapping.tp_size))
    return min(n.values())


def _act_bytes(dtype: str) -> int:
    if dtype not in ACT_BYTES:
        raise ValueError(f"dtype: expected one of {', '.join(ACT_BYTES)}, got {dtype!r}")
    return ACT_BYTES[dtype]


def _layers(cfg: K3Config, mapping: Mapping, rank: int) -> range:
    return mapping.rank_layers(rank, cfg.num_hidden_layers)


def size_text(b: int) -> str:
    """Bytes as the plan's messages print them: GiB from one GiB, MiB below."""
    return f"{b / GiB:.2f} GiB" if abs(b) >= GiB else f"{b / MiB:.2f} MiB"


def _largest(weights: dict[str, int]) -> str:
    top = sorted(weights.items(), key=lambda kv: -kv[1])[:2]
    return ", ".join(f"{k} {size_text(v)}" for k, v in top)
