"""One real-size K3 rank decoding: step time against the sum of its floors (JSON lines).

    python tools/bench_rank.py [--batches 32,64,128] [--context 8192]          # on an H200: TEP16 rank 0
    python tools/bench_rank.py --moe-tactic triton                                # another MoE tactic than the build's
    python tools/bench_rank.py --kda-decode split                                 # another KDA decode tactic
    python tools/bench_rank.py --ab unfused-residual                              # A/B a switch in one process
    python tools/bench_rank.py --preset tiny --tp 1 --device cpu --target cpu --batches 2 --context 128
    python tools/bench_rank.py --gemms                                            # its dense GEMMs alone (GPU)
    python tools/bench_rank.py --batches 32 --timeline                            # one graph replay profiled

The rank is what `k3build build` would write for the recipe's mapping (all 93 layers, 1/16 of attention and
shared experts, 56 local experts in MXFP4), with synthetic weights made on the device instead of read from a
checkpoint (the graph and layout passes are the builder's own). The expert exchange is looped back: the
graph's all-reduces return their input, so the figure is the rank's compute and memory alone.

Each batch size decodes N requests of CONTEXT cached tokens (N pages tables of garbage KV: the timing does
not depend on the values). The step is the runtime's CUDA-graph replay (runtime/cuda_graph.py) as the runtime
calls it, the host staging of the rows included, timed after WARMUP_S seconds of replays; the eager step is timed
too. Its parts: graph_ms (the graph's replay on staged inputs) and, in steps timed one by one (steady decode: the
same rows as the last step), the host's wait, fill, upload and launch calls and the GPU step (_step_parts). The
runtime's loop with sampling, synchronous and with async scheduling: loop_sync_ms and loop_async_ms (_loop_ms).
Floors use the HBM bandwidth measured first in the same run:
    weights  every non-expert weight the step reads (the embedding: N rows) plus the local experts a uniform
             top-k routing touches in expectation (all of them: floor_all_experts_ms)
    kv       N x CONTEXT x the MLA layers' latent bytes
    state    the KDA recurrent states of N requests, read and written (conv states too)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))

import torch  # noqa: E402


SYNTHETIC_MAX_SCALE = 123  # the largest expert scale byte synthetic_get makes


def synthetic_get(cfg, mapping, rank: int, device: torch.device, seed: int = 0):
    """get(name) for k3build's layout pass: this rank's slice of each canonical tensor, random, on `device`."""
    from k3build.schema import checkpoint_tensors

    specs = checkpoint_tensors(cfg, "canonical")
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8}
    gen = torch.Generator(device=device).manual_seed(seed)

    def get(name: str) -> torch.Tensor:
        shape, dtype = specs[name]
        shard = mapping.shard(name, rank, cfg)
        shape = list(shape)
        if shard.dim is not None:
            shape[shard.dim] //= shard.parts
        dt = dtypes[dtype]
        if dt == torch.uint8:
            if name.endswith("weight_scale"):  # E8M0 scales 2^-7..2^-4: values stay moderate
                return torch.randint(120, SYNTHETIC_MAX_SCALE + 1, shape, dtype=torch.uint8, device=device,
                                     generator=gen)
            return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
        if name.endswith(("norm.weight", "layernorm.weight")):
            return torch.ones(shape, dtype=dt, device=device)
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape, dtype=dt, device=device)
        fan_in = shape[-1] if len(shape) > 1 else 1
        return (torch.randn(shape, device=device, generator=gen) / fan_in ** 0.5).to(dt)

    return get


def make_rank(cfg, mapping, rank: int, *, target: str, device: torch.device, max_batch: int, max_seq_len: int,
              moe_tactic: str | None = None):
    """A RankEngine with the builder's tactics, graph and layout over synthetic weights (nothing written to disk)."""
    from k3build.build import graph as graph_mod
    from k3build.build.layout import engine_tensors
    from k3build.build.tactics import expert_layout, fit_moe_tactic, resolve_plugins
    from k3runtime.loader import ModelFacts, RankEngine

    plugins, _ = resolve_plugins(target, overrides={"MoEExperts": moe_tactic} if moe_tactic else None,
                                 quantization=cfg.quantization.method, dtype="bf16")
    fit_moe_tactic(plugins, (cfg.expert_hidden_size, cfg.moe_intermediate_size // mapping.moe_tp_size),
                   SYNTHETIC_MAX_SCALE, latent=cfg.is_latent_moe)
    weights, shapes = {}, {}
    for name, t in engine_tensors(cfg, mapping, rank, synthetic_get(cfg, mapping, rank, device), torch.bfloat16,
                                  expert_layout=expert_layout(plugins)):
        weights[name], shapes[name] = t, (tuple(t.shape), t.dtype)
    graph = graph_mod.build_graph(cfg, mapping, rank, shapes, torch.bfloat16, capacity=max_batch).graph
    layers = mapping.rank_layers(rank, cfg.num_hidden_layers)
    config = {
        "pretrained_config": cfg.to_dict(), "mapping": mapping.to_dict(),
        "build_config": {"plugins": plugins, "page_size": 64, "dtype": "bf16", "kv_dtype": "bf16",
                         "state_dtype": "fp32", "max_batch_size": max_batch, "max_seq_len": max_seq_len,
                         "max_num_tokens": max_batch},
        "ranks": {str(rank): {"layers": [layers.start, layers.stop], "tp_rank": mapping.tp_rank(rank),
                              "first_stage": mapping.is_first_stage(rank), "last_stage": mapping.is_last_stage(rank)}},
    }
    return RankEngine(None, rank, config, ModelFacts.from_pretrained_config(config["pretrained_config"]), graph,
                      weights)


# weights a decode step multiplies as x @ wᵀ with one row of x per request, timed here as bf16-out GEMMs (a latent
# MoE's in_proj, router rows included, runs with fp32 output in MoEInProj: the probe in BENCHMARKS.md found it as fast)
GEMM_WEIGHTS = ("in_proj", "f_b", "o_proj", "gate_up", "down", "out_proj", "q_b", "lm_head")


def bench_gemms(weights: dict, batches: list[int], bw: float, emit) -> None:
    """Every dense GEMM of one decode step, by weight shape: torch (cuBLAS) against the weight-bytes floor; then
    the step's totals."""
    from common import time_ms

    shapes: dict[tuple[int, int], list] = {}
    for name, w in weights.items():
        if w.dim() == 2 and w.dtype == torch.bfloat16 and name.rsplit(".", 1)[-1] in GEMM_WEIGHTS:
            shapes.setdefault(tuple(w.shape), [w, 0])[1] += 1
    for n in batches:
        total = dict(torch_ms=0.0, floor_ms=0.0)
        for (N, K), (w, count) in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[1][1]):
            x = torch.randn(n, K, device=w.device).to(w.dtype)
            t_torch = time_ms(lambda: x @ w.T)
            floor = w.nbytes / bw * 1e3
            emit(bench="rank_gemm", batch=n, N=N, K=K, count=count, floor_ms=round(floor, 4),
                 torch_ms=round(t_torch, 4), torch_frac_of_floor=round(floor / t_torch, 3))
            total["torch_ms"] += count * t_torch
            total["floor_ms"] += count * floor
        emit(bench="rank_gemms", batch=n, **{k: round(v, 3) for k, v in total.items()},
             torch_x_floor=round(total["torch_ms"] / total["floor_ms"], 3))


def _median_ms(fn, reps: int, cuda: bool) -> float:
    """Median ms of fn: CUDA-event timed on a GPU (common.time_ms, no extra graph: fn may replay one), else wall."""
    if cuda:
        from common import time_ms
        return time_ms(fn, rep=reps, graph=False, flush=False)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _step_parts(graphs, n: int, rows, reps: int) -> dict:
    """The step in its parts as the runtime runs a step (DecodeGraphs.run), medians in ms: host_wait_ms (the wait
    for the host set's last copy), host_fill_ms (the rows into the pinned buffer), host_upload_ms (its copy's
    call), host_launch_ms (the graph's launch call), all on the host clock, and gpu_step_ms (CUDA events around
    them all)."""
    parts = {"host_wait_ms": [], "host_fill_ms": [], "host_upload_ms": [], "host_launch_ms": [], "gpu_step_ms": []}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs._stage(rows)
    torch.cuda.synchronize()
    for _ in range(reps):
        start.record()
        t0 = time.perf_counter()
        graphs.copied[0].synchronize()
        t1 = time.perf_counter()
        graphs._fill(rows, 0)
        t2 = time.perf_counter()
        graphs._upload(0, n)
        t3 = time.perf_counter()
        graphs.graphs[n].replay()
        t4 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        for key, v in zip(parts, [(b - a) * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4))]
                          + [start.elapsed_time(end)]):
            parts[key].append(v)
    return {key: round(statistics.median(v), 4) for key, v in parts.items()}


def _loop(graphs, rows, mode: str):
    """The runtime's decode loop on the graphs of len(rows), as a function that runs k steps back to back and
    returns the host seconds of each step's run call. Each step stages the rows and replays (DecodeGraphs.run),
    samples (sampler.sample_tokens, greedy) and reads tokens on the host. mode "sync": as the synchronous engine,
    each step's tokens read before the next is staged (they are its input ids); "async": as async scheduling, each
    step staged with its ids fed on the device from the previous step's tokens, and those read once it is
    launched. Neither schedules requests: the scheduler's host time, which async scheduling also hides, is not in
    these figures."""
    from k3runtime.executor import FED
    from k3runtime.llm_engine import HostCopy
    from k3runtime.sampler import sample_tokens
    from k3runtime.sampling_params import SamplingParams

    n = len(rows)
    greedy, zeros = [SamplingParams(temperature=0)] * n, [0] * n
    fed_rows = [(FED - i, *r[1:]) for i, r in enumerate(rows)]
    first = torch.tensor([r[0] for r in rows], device="cuda")
    state = {"prev": first, "prev_host": HostCopy(first), "prev_ids": [r[0] for r in rows]}

    def steps(count: int) -> list[float]:
        host = []
        for _ in range(count):
            t0 = time.perf_counter()
            if mode == "async":
                logits = graphs.run(fed_rows, fed=state["prev"])["logits"]
            else:
                logits = graphs.run([(t, *r[1:]) for t, r in zip(state["prev_ids"], rows)])["logits"]
            host.append(time.perf_counter() - t0)
            nxt = sample_tokens(logits, greedy, zeros, zeros)
            nxt_host = HostCopy(nxt)
            # the host reads a step's tokens (the one sync): async, the previous step's, behind its own copy
            ids = (state["prev_host"] if mode == "async" else nxt_host).tolist()
            state.update(prev=nxt, prev_host=nxt_host, prev_ids=ids)
        torch.cuda.synchronize()
        return host
    return steps


def _loop_ms(graphs, rows, reps: int, mode: str) -> dict:
    """_loop's steps timed: loop_{mode}_ms (GPU ms a step over `reps` steps) and loop_{mode}_run_host_ms (the
    median host time of a step's run call)."""
    steps = _loop(graphs, rows, mode)
    steps(4)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = steps(reps)
    end.record()
    torch.cuda.synchronize()
    return {f"loop_{mode}_ms": round(start.elapsed_time(end) / reps, 4),
            f"loop_{mode}_run_host_ms": round(statistics.median(host) * 1e3, 4)}


def _graphs(executor, n: int, pages_per_seq: int, spare: tuple[int, int]):
    """The decode CUDA graphs of bucket n, captured as the executor and plugins stand now."""
    from k3runtime.cuda_graph import DecodeGraphs
    graphs = DecodeGraphs(executor, max_batch=n, max_pages=pages_per_seq, spare_page=spare[0], spare_slot=spare[1],
                          buckets=[n])
    graphs.capture()
    return graphs


def _interleaved_ms(variants: dict, rows, args, rounds: int) -> dict:
    """Median ms of each variant's graph replay: args.warmup_s of replays of them all, then `rounds` rounds that time
    each variant in turn (args.reps replays each), so that a drift of the clocks over the run falls on all alike."""
    settled = time.perf_counter() + args.warmup_s
    while time.perf_counter() < settled:
        for graphs in variants.values():
            graphs.replay(rows)
        torch.cuda.synchronize()
    from common import interleaved_replays_us
    replays = {name: (lambda g=graphs: g.replay(rows)) for name, graphs in variants.items()}
    return {name: us / 1e3 for name, us in interleaved_replays_us(replays, rounds=rounds, reps=args.reps).items()}


def _moe_decode(**changes):
    """A switch that replaces fields of the MoE decode tactics decode_l_pf, decode_l and decode_p (the triton_l and
    triton_p engines', decode_l as before decode_l_pf; no effect on other MoE tactics)."""
    def flip(executor):
        from dataclasses import replace

        from k3plugins.moe import triton as moe
        old = {key: moe.TACTICS[key] for key in ("decode_l_pf", "decode_l", "decode_p")}
        moe.TACTICS.update({key: replace(t, **changes) for key, t in old.items()})
        return lambda: moe.TACTICS.update(old)
    return flip


def _wrap_nodes(executor, select, wrap):
    """Replace the fn of the executor's nodes that `select` picks by wrap(fn); returns the undo."""
    saved = [(b, b.fn) for b in executor.nodes if select(b)]
    for b, fn in saved:
        b.fn = wrap(fn)

    def undo():
        for b, fn in saved:
            b.fn = fn
    return undo


def _unfused_residual(executor):
    """The AttnRes nodes that add the residual (residual=1) run it as a separate add first, as before the fusion."""
    def unfused(fn):
        def run(partial, blocks, proj, norm, *, delta, **kw):
            total = partial + delta
            return fn(total, blocks, proj, norm, **kw), total
        return run
    return _wrap_nodes(executor, lambda b: b.kind == "attn_res" and b.inputs[3], unfused)  # delta (_attn_res_inputs)


def _unfused_norm(executor):
    """The AttnRes nodes that apply the next RMSNorm (norm=1) mix without it, then run the engine's RMSNorm as a
    separate launch, as before the fusion."""
    from k3plugins import registry
    rms_norm = registry.find("RMSNorm", executor.engine.build["plugins"]["RMSNorm"]["tactic"]).load()

    def unfused(fn):
        def run(*args, delta=None, out_norm, out_eps, **kw):
            if delta is None:
                return rms_norm(fn(*args, **kw), out_norm, eps=out_eps)
            out, total = fn(*args, delta=delta, **kw)
            return rms_norm(out, out_norm, eps=out_eps), total
        return run
    return _wrap_nodes(executor, lambda b: b.kind == "attn_res" and b.inputs[4], unfused)  # out_norm (_attn_res_inputs)


def _module_flag(module: str, name: str, value):
    """A switch that sets a module global of k3plugins while its graphs are captured (the plugins read it at each
    call)."""
    def flip(executor):
        import importlib
        mod = importlib.import_module(f"k3plugins.{module}")
        old = getattr(mod, name)
        setattr(mod, name, value)
        return lambda: setattr(mod, name, old)
    return flip


def _attn_res_chunk(values: int):
    """A switch: AttnRes's split form in chunks of `values` wherever use_split takes it (0: one program a token at
    every size)."""
    def flip(executor):
        from k3plugins.attn_res import triton as ar
        choice = ar.use_split
        ar.use_split = lambda M, K: values if choice(M, K) else 0
        return lambda: setattr(ar, "use_split", choice)
    return flip


def _seventeenth_router_blocks(executor):
    from k3plugins.router import triton as router
    new = router.blocks_for

    def old(M):  # the router's blocks before the eighteenth session's sweep
        return router.LogitBlocks(16, 32, 128, 8) if M <= 16 else router.LogitBlocks(32, 32, 64, 8) if M <= 64 \
            else router.LogitBlocks(64, 32, 64, 4 if M <= 256 else 1)
    router.blocks_for = old
    return lambda: setattr(router, "blocks_for", new)


def _unfused_mla_glue(executor):
    """The MLA layers' glue as before its two launches: the latent RMSNorm, concat and indexed store of the cache
    write; copies of the strided queries; the output's reshape copy, sigmoid and product."""
    from k3plugins.mla import triton as mla
    saved = mla.write_cache, mla.gate_heads, mla.mla_decode_attention

    def write_cache(ckv, w, kv, page, row, *, eps):
        r = w.shape[0]
        kv[page, row] = torch.cat([mla.rms_norm(ckv[:, :r], w, eps=eps), ckv[:, r:]], -1).to(kv.dtype)

    def gate_heads(o, gate):
        o = o.transpose(0, 1).reshape(o.shape[1], -1)
        return o if gate is None else o * torch.sigmoid(gate)

    def attention(q_lat, q_pe, *args, **kw):
        return saved[2](q_lat.contiguous(), q_pe.contiguous(), *args, **kw)
    mla.write_cache, mla.gate_heads, mla.mla_decode_attention = write_cache, gate_heads, attention

    def undo():
        mla.write_cache, mla.gate_heads, mla.mla_decode_attention = saved
    return undo


def _pdl_everywhere(executor):
    """K3_PDL=1 while the graphs are captured: every Triton kernel launched with PDL (k3plugins/pdl.py)."""
    old = os.environ.get("K3_PDL")
    os.environ["K3_PDL"] = "1"
    return lambda: os.environ.pop("K3_PDL") if old is None else os.environ.__setitem__("K3_PDL", old)


def _separate_router(executor):
    """Each MoEInProj node as the graph had it before the op: the engine's Linear tactic on the in_proj rows and its
    Router tactic on the router's rows (views of the stacked weight), the router on a side stream beside the GEMM
    from FORK_MIN_TOKENS tokens on (the executor's former fork), and the picks replaced as _balance_routing does."""
    from k3plugins import registry
    table = executor.engine.build["plugins"]
    linear = registry.find("Linear", table["Linear"]["tactic"]).load()
    route = registry.find("Router", table["Router"]["tactic"]).load()
    streams = {}

    def separate(fn):
        def run(x, weight, bias, *, num_experts, **kw):
            n = weight.shape[0] - num_experts
            if x.is_cuda and x.shape[0] >= FORK_MIN_TOKENS:
                if x.device not in streams:
                    streams[x.device] = torch.cuda.Stream(x.device)
                side = streams[x.device]
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    ids, wts = route(x, weight[n:], bias, **kw)
                zh = linear(x, weight[:n])
                main.wait_stream(side)
            else:
                ids, wts = route(x, weight[n:], bias, **kw)
                zh = linear(x, weight[:n])
            balanced = getattr(executor, "balanced_ids", None)
            return (ids if balanced is None else balanced[:x.shape[0]]), wts, zh
        return run
    return _wrap_nodes(executor, lambda b: b.name.endswith(".moe.in_proj"), separate)  # graph.py's name for it


FORK_MIN_TOKENS = 64  # the executor forked the Router from this many tokens on (twentieth session)


AB_SWITCHES = {  # name: (what flipping it does, flip(executor) -> undo())
    "separate-router": ("each MoEInProj as before it: the engine's Linear and Router tactics on its two row blocks, "
                        "the router on a side stream from 64 tokens on", _separate_router),
    "moe-bn128": ("the MoE decode (decode_l / decode_p) in blocks of 128 rows, 8 warps",
                  _moe_decode(block_n=128, num_warps=8)),
    "moe-stages4": ("the MoE decode (decode_l / decode_p) with 4 pipeline stages", _moe_decode(num_stages=4)),
    "moe-no-prefetch": ("the MoE decode without the L2 prefetch while the pair sort runs (decode_l_pf as decode_l)",
                        _moe_decode(prefetch=0, prefetch_per_sm=0)),
    "moe-down-bn128": ("the MoE decode's down kernel in blocks of 128 rows, 8 warps",
                       _moe_decode(down_block_n=128, down_num_warps=8)),
    "moe-down-bn128-w4": ("the MoE decode's down kernel in blocks of 128 rows, 4 warps",
                          _moe_decode(down_block_n=128, down_num_warps=4)),
    "moe-down-stages4": ("the MoE decode's down kernel with 4 pipeline stages", _moe_decode(down_num_stages=4)),
    "moe-plain": ("the MoE decode's two GEMMs as plain launches, experts first (no MoETactic.overlap)",
                  _moe_decode(rows_first=False, overlap=False)),
    "moe-no-overlap": ("the MoE decode rows first without MoETactic.overlap", _moe_decode(overlap=False)),
    "moe-y-half": ("the MoE decode's per-pair rows y in bf16, not fp32 (MoETactic.y_half)", _moe_decode(y_half=True)),
    "moe-gather-combine": ("the MoE decode's combine gathering a token's rows at once (MoETactic.gather_combine)",
                           _moe_decode(gather_combine=True)),
    "mla-two-waves": ("the MLA decode split for about two waves of programs, not one (as before the thirty-fifth "
                      "session)", _module_flag("mla.triton", "SPLIT_WAVES", 2)),
    "moe-sort-flat": ("the MoE's pair sort as one flat scan (SORT_COLS 1), not in rows of SORT_COLS pairs",
                      _module_flag("moe.triton", "SORT_COLS", 1)),
    "unfused-residual": ("the residual adds as separate launches, not inside AttnRes", _unfused_residual),
    "unfused-norm": ("the RMSNorms after AttnRes as separate launches (the engine's RMSNorm tactic)", _unfused_norm),
    "attn-res-single": ("AttnRes as one program a token at every size (attn_res_kernel)", _attn_res_chunk(0)),
    "attn-res-chunk256": ("AttnRes's split form in chunks of 256 values, not 512", _attn_res_chunk(256)),
    "attn-res-mix-warps4": ("the AttnRes mix with the norm fused in 4 warps, not 8",
                            _module_flag("attn_res.triton", "NORM_MIX_WARPS", 4)),
    "attn-res-mix-warps16": ("the AttnRes mix with the norm fused in 16 warps, not 8",
                             _module_flag("attn_res.triton", "NORM_MIX_WARPS", 16)),
    "topk-warps4": ("MoEInProj's top-k launch in 4 warps, not 8", _module_flag("router.triton", "SELECT_WARPS", 4)),
    "topk-cast512": ("MoEInProj's top-k launch casting 512 columns a program, not 1024 (up to "
                     "router.CAST_SPLIT_MAX_TOKENS tokens)",
                     _module_flag("router.triton", "CAST_COLUMNS", 512)),
    "topk-cast-rows": ("MoEInProj's top-k launch casting a whole row a program at every size",
                       _module_flag("router.triton", "CAST_SPLIT_MAX_TOKENS", 0)),
    "topk-cast-chunks": ("MoEInProj's top-k launch casting 1024 columns a program at every size",
                         _module_flag("router.triton", "CAST_SPLIT_MAX_TOKENS", 1 << 30)),
    "unfused-mla-glue": ("the MLA layers' cache write, query copies and output gate as the torch launches before "
                         "mla_cache_write_kernel and mla_gate_kernel", _unfused_mla_glue),
    "pdl": ("every Triton kernel launched with PDL (K3_PDL=1)", _pdl_everywhere),
    "kda-f-b-gemm": ("the KDA decode's gate from the f_b GEMM's output, not f_b applied inside the fused kernel",
                     _module_flag("kda.fla", "F_B_FUSED_MAX_PROGRAMS", 0)),
    "old-router-blocks": ("the router logits kernel's blocks of the seventeenth session", _seventeenth_router_blocks),
}


def _balance_routing(executor, num_experts: int, top_k: int, max_tokens: int, device) -> None:
    """Wrap every node that routes (Router, MoEInProj): same kernels run, then fixed random distinct experts per
    token row (uniform over all experts, so each rank's share of the pairs is balanced) replace its picks."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(max_tokens)]).to(device)
    executor.balanced_ids = ids  # for the switches that replace these nodes (separate-router)
    routers = [n for n in executor.nodes if n.fn.__name__ in ("route", "moe_in_proj")]
    if not routers:
        raise SystemExit("bench_rank: --routing uniform found no Router or MoEInProj node to wrap")
    for node in routers:
        def balanced(*args, _route=node.fn, **kw):
            _, weights, *rest = _route(*args, **kw)
            return ids[:weights.shape[0]], weights, *rest
        node.fn = balanced


def replay_timeline(replay, layer_window: tuple[int, int] = (700, 760), longest: int = 12) -> dict:
    """One profiled graph replay (after an unprofiled one): its span; the time some kernel runs (the union of their
    intervals: the MoE's down kernel overlaps its gate/up kernel, so the kernels' summed times count that twice) and
    what is left, idle; the `longest` gaps between launches as [µs, the launch before, the launch after, µs from
    the replay's start]; kernels grouped by name; and the launches in `layer_window` (a few layers mid-step) as
    [name, µs from the window's first start, µs long]."""
    from common import cuda_events
    ev = cuda_events(replay)
    t0 = ev[0].time_range.start
    busy, gaps, reach, last = 0.0, [], t0, ev[0].name
    for e in ev:
        start, end = e.time_range.start, e.time_range.end
        if start > reach:
            gaps.append([round(start - reach, 1), last[:40], e.name[:40], round(reach - t0, 1)])
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, last = end, e.name
    groups: dict[str, list] = {}
    for e in ev:
        g = groups.setdefault(e.name[:70], [0, 0.0])
        g[0] += 1
        g[1] += e.time_range.end - e.time_range.start
    window = ev[layer_window[0]:layer_window[1]]
    w0 = window[0].time_range.start if window else 0
    span = reach - t0
    return {"launches": len(ev), "span_us": round(span, 1), "busy_us": round(busy, 1), "idle_us": round(span - busy, 1),
            "kernels_us": round(sum(g[1] for g in groups.values()), 1),
            "longest_gaps": sorted(gaps, key=lambda g: -g[0])[:longest],
            "groups": sorted(([k, c, round(us, 1)] for k, (c, us) in groups.items()), key=lambda g: -g[2]),
            "window": [[e.name[:40], round(e.time_range.start - w0, 1),
                        round(e.time_range.end - e.time_range.start, 1)] for e in window]}


def floors(engine, cache, n: int, context: int, bw_bytes_per_ms: float) -> dict:
    cfg = engine.config["pretrained_config"]
    w = engine.weights
    expert = sum(t.nbytes for k, t in w.items() if k.endswith((".w13", ".w2", ".w13_scale", ".w2_scale")))
    embed = w["embed"].nbytes if "embed" in w else 0
    other = sum(t.nbytes for t in w.values()) - expert - embed
    embed_rows = n * w["embed"].shape[1] * w["embed"].element_size() if embed else 0
    k, e = cfg["num_experts_per_token"], cfg["num_experts"]
    touched = 1 - (1 - k / e) ** n  # share of local experts a uniform top-k routing of n tokens reaches
    mla = cache.config.num_mla_layers * context * n * cache.config.mla_width * cache.mla_kv[0].element_size() \
        if cache.config.num_mla_layers else 0
    state = 2 * n * sum(s[0].nbytes + c[0].nbytes for s, c in zip(cache.kda_state, cache.kda_conv))
    weights_touched = other + embed_rows + touched * expert
    return {"weights_bytes": int(weights_touched), "kv_bytes": int(mla), "state_bytes": int(state),
            "floor_ms": (weights_touched + mla + state) / bw_bytes_per_ms,
            "floor_all_experts_ms": (other + embed_rows + expert + mla + state) / bw_bytes_per_ms,
            "experts_touched_share": round(touched, 3)}


def free_bytes(device: torch.device) -> int | None:
    """Memory the rank's weights could take on `device`: the GPU's free bytes, or the host's MemAvailable (None
    where /proc/meminfo does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from k3runtime.dist.weight_store import mem_available
    return mem_available()


def refuse_if_weights_do_not_fit(cfg, mapping, preset_name: str, device: torch.device) -> None:
    """Stop before making a rank whose weights alone exceed the device's free memory (K3's TEP16 rank holds 96.8
    GiB: an H200 holds it, an 80 GB H100 does not), instead of an out-of-memory error minutes into the layout."""
    from k3build.memory_weights import weight_bytes
    need = sum(weight_bytes(cfg, mapping, 0).values())
    free = free_bytes(device)
    if free is not None and need > free:
        raise SystemExit(f"bench_rank: rank 0 of --preset {preset_name} at tp {mapping.tp_size} / ep "
                         f"{mapping.moe_ep_size} holds {need / 2**30:.2f} GiB of weights; {device} has "
                         f"{free / 2**30:.2f} GiB free (K3 at TEP16 needs an H200's 141 GB; or pass a smaller "
                         f"--preset or more ranks with --tp)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3")
    ap.add_argument("--recipe", default=os.path.join(os.path.dirname(__file__), "..", "engines", "k3_h200_tep16.toml"),
                    help="mapping to take rank 0 of (ignored with --tp)")
    ap.add_argument("--tp", type=int, default=None, help="TEP mapping of this many ranks instead of the recipe's")
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup-s", type=float, default=2.0,
                    help="seconds of graph replays before each batch size is timed (GPU clocks and caches settle; "
                         "without it two processes run back to back differed by up to 1 ms, the second faster)")
    ap.add_argument("--profile", action="store_true", help="also print the top kernels of one eager step")
    ap.add_argument("--loop-timeline", action="store_true",
                    help="profile three steps of the runtime's loop, sync and async (as --timeline does a replay)")
    ap.add_argument("--timeline", action="store_true",
                    help="also profile one graph replay of each batch: its span against the time some kernel runs "
                         "(the rest idle), its longest gaps, kernels grouped by name (launches, µs), and the launches "
                         "of a few layers")
    ap.add_argument("--ncu-step", action="store_true",
                    help="run one more eager step of each batch between cudaProfilerStart and Stop, for Nsight Compute "
                         "started with --profile-from-start off (tools/device/batch29.sh)")
    ap.add_argument("--gemms", action="store_true",
                    help="instead of decoding: time the rank's dense GEMMs at each batch size, torch (cuBLAS) "
                         "against the weight floor")
    ap.add_argument("--kda-decode", default=None,
                    help="KDA decode tactic instead of the default (k3plugins.kda.fla.DECODE_TACTICS)")
    ap.add_argument("--moe-tactic", default=None,
                    help="MoE tactic instead of the one the build records (e.g. triton: the W4 decode on the "
                         "checkpoint's nibble order; triton_s: on the strided layout); the layout follows it")
    ap.add_argument("--ab", action="append", default=[], choices=sorted(AB_SWITCHES),
                    help="also time each step with this switch flipped (step_ms_<switch>), in the same process, "
                         "its graphs replayed in turn with the default's over five rounds: "
                         + "; ".join(f"{k}: {v[0]}" for k, v in AB_SWITCHES.items()))
    ap.add_argument("--routing", choices=("uniform", "model"), default="uniform",
                    help="uniform: the router runs but its picks are replaced by balanced random ones (what a "
                         "trained K3 router with its bias approaches); model: the synthetic router's own picks "
                         "(random weights route most tokens to the same experts)")
    args = ap.parse_args()

    from common import emit, top_kernels
    from k3build.config import preset
    from k3build.mapping import Mapping
    from k3runtime.executor import Executor
    from k3runtime.kv_cache import CacheTensors

    cuda = args.device.startswith("cuda")
    if args.kda_decode:  # what the engine's KDA layers run when not told
        from k3plugins.kda import fla
        if args.kda_decode not in fla.DECODE_TACTICS:
            raise SystemExit(f"bench_rank: --kda-decode {args.kda_decode!r}: choose from {fla.DECODE_TACTICS}")
        fla.DECODE_DEFAULT = args.kda_decode
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_rank: --device cuda needs a CUDA GPU (or pass --device cpu --target cpu)")
    device = torch.device(args.device)
    cfg = preset(args.preset)
    if args.tp:
        mapping = Mapping(tp_size=args.tp)
    else:
        from k3build.recipe import load_recipe
        mapping = load_recipe(args.recipe).mapping
    batches = sorted(int(b) for b in args.batches.split(","))
    refuse_if_weights_do_not_fit(cfg, mapping, args.preset, device)
    if cuda:
        from common import hbm_read_tbps
        bw = hbm_read_tbps() * 1e12
        torch.cuda.empty_cache()
    else:
        bw = float("nan")
    emit(bench="rank_env", device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
         preset=args.preset, mapping=mapping.to_dict(), rank=0, routing=args.routing, kda_decode=args.kda_decode,
         hbm_read_tbps=round(bw / 1e12, 3))
    t0 = time.perf_counter()
    engine = make_rank(cfg, mapping, 0, target=args.target, device=device, max_batch=batches[-1],
                       max_seq_len=args.context + 64, moe_tactic=args.moe_tactic)
    if cuda:
        torch.cuda.empty_cache()  # the layout pass's per-expert temporaries
    emit(bench="rank_weights", gib=round(sum(t.nbytes for t in engine.weights.values()) / 2**30, 2),
         made_s=round(time.perf_counter() - t0, 1), moe_tactic=engine.build["plugins"]["MoEExperts"]["tactic"])
    if args.gemms:
        if not cuda:
            raise SystemExit("bench_rank: --gemms needs a CUDA GPU")
        bench_gemms(engine.weights, batches, bw, emit)
        return
    pages_per_seq = -(-(args.context + 1) // 64)
    while batches:
        n_max = batches[-1]
        try:
            cache = CacheTensors(engine.cache_config(num_pages=n_max * pages_per_seq + 1, num_slots=n_max + 1),
                                 device)
            break
        except torch.OutOfMemoryError as e:
            emit(bench="rank_oom", batch=n_max, error=str(e).splitlines()[0])
            batches.pop()
            torch.cuda.empty_cache()
    executor = Executor(engine, cache)
    if args.routing == "uniform":
        _balance_routing(executor, cfg.num_experts, cfg.num_experts_per_token, batches[-1], device)
    for n in batches:
        rows = [(int(t), i, args.context, list(range(i * pages_per_seq, (i + 1) * pages_per_seq)))
                for i, t in enumerate(torch.randint(0, cfg.vocab_size, (n,)))]
        spare = (n_max * pages_per_seq, n_max)
        rec = dict(bench="rank_decode", batch=n, context=args.context)
        if cuda:
            variants = {}
            for name in args.ab:
                undo = AB_SWITCHES[name][1](executor)
                variants[name] = _graphs(executor, n, pages_per_seq, spare)
                undo()
            graphs = variants["default"] = _graphs(executor, n, pages_per_seq, spare)
            times = _interleaved_ms(variants, rows, args, rounds=5 if len(variants) > 1 else 1)
            rec["step_ms"] = times.pop("default")
            rec.update({"step_ms_" + name.replace("-", "_"): round(t, 4) for name, t in times.items()})
            del variants
            rec["graph_ms"] = round(_median_ms(graphs.graphs[n].replay, args.reps, cuda), 4)  # on staged inputs
            rec.update(_step_parts(graphs, n, rows, args.reps))
            for mode in ("sync", "async"):  # the runtime's loop, with sampling
                rec.update(_loop_ms(graphs, rows, 3 * args.reps, mode))
            batch = graphs._batch(n)
            rec["eager_ms"] = _median_ms(lambda: executor.run(batch), max(3, args.reps // 3), cuda)
            if args.timeline:
                emit(bench="rank_timeline", batch=n, **replay_timeline(lambda: graphs.replay(rows)))
            if args.loop_timeline:
                for mode in ("sync", "async"):
                    steps = _loop(graphs, rows, mode)
                    emit(bench="rank_loop_timeline", batch=n, mode=mode, **replay_timeline(lambda: steps(3)))
            if args.profile:
                emit(bench="rank_profile", batch=n, top=top_kernels(lambda: executor.run(batch)))
            if args.ncu_step:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                executor.run(batch)
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            del graphs
        else:
            from k3runtime.executor import StepBatch
            tensor = lambda v: torch.tensor(v, dtype=torch.int64)
            batch = StepBatch(input_ids=tensor([r[0] for r in rows]), cu_seqlens=torch.arange(n + 1),
                              slot_ids=tensor([r[1] for r in rows]), context_lens=tensor([r[2] for r in rows]),
                              page_table=tensor([r[3] for r in rows]), logits_indices=torch.arange(n))
            rec["step_ms"] = rec["eager_ms"] = _median_ms(lambda: executor.run(batch), args.reps, cuda)
        f = floors(engine, cache, n, args.context, bw / 1e3)
        rec.update({k: round(v, 4) if isinstance(v, float) else v for k, v in f.items()})
        rec["step_x_floor"] = round(rec["step_ms"] / f["floor_ms"], 3)
        for mode in ("sync", "async"):
            if f"loop_{mode}_ms" in rec:
                rec[f"loop_{mode}_x_floor"] = round(rec[f"loop_{mode}_ms"] / f["floor_ms"], 3)
        rec["tokens_per_s"] = round(n / rec["step_ms"] * 1e3, 1)
        rec["step_ms"], rec["eager_ms"] = round(rec["step_ms"], 4), round(rec["eager_ms"], 4)
        emit(**rec)
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
