"""One request swapped out to the host store and back, at a K3 rank's size (JSON lines).

    python tools/bench_swap.py [--device cuda] [--pages 128] [--heads 6] [--reps 5]

A TEP16 rank's cache (runtime.kv_cache): 24 MLA layers of 576-wide bf16 pages of 64 tokens, 69 KDA layers of
HEADS x 128 x 128 fp32 state and their bf16 conv state. The request holds PAGES device pages (128: an 8K context),
scattered over twice as many, and one slot; it goes to PAGES host pages in one run of ids (`runs_1`, as a fresh
host pool hands them out) or in runs of one page (`runs_pages`), then comes back to other device pages and slot.
- store_ms: `HostStore.swap_out` then `swap_in`, the device synchronized after (the copies done), and
  host_return_ms the host's time until both calls returned (on a GPU the copies are queued on the stream);
- pageable_ms: the same bytes the way the store moved them before the fifty-first session (the baseline): gathered
  on the device, copied into pageable memory with `.cpu()`, then into the store by the host (`index_copy_`), and
  back likewise; it returns once the copies are done;
- floor_ms: the bytes each way over the page-locked copy rate measured in the run (one copy of 256 MiB each way).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from arg_types import count
from k3runtime.kv_cache import CacheConfig, CacheTensors, HostStore


def _ms(fn, reps: int, sync) -> tuple[float, float]:
    """Median ms of fn until the device is done, and until fn returned (after one call untimed)."""
    fn()
    done, returned = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        returned.append(time.perf_counter() - t0)
        sync()
        done.append(time.perf_counter() - t0)
    return statistics.median(done) * 1e3, statistics.median(returned) * 1e3


def _pageable_round_trip(cache: CacheTensors, host: list[torch.Tensor], pages, slot, host_pages, back_pages,
                         back_slot) -> None:
    """The baseline: the store's copies before (layer-major host buffers, each copy through pageable memory)."""
    dev = cache.device
    p, hp = torch.tensor(pages, device=dev), torch.tensor(host_pages)
    s, hs = torch.tensor([slot], device=dev), torch.tensor([0])
    host[0].index_copy_(1, hp, cache.mla_kv_all.index_select(1, p).cpu())
    for h, t in zip(host[1:], cache.tensors()[1:]):
        h.index_copy_(1, hs, t.index_select(1, s).cpu())
    p, s = torch.tensor(back_pages, device=dev), torch.tensor([back_slot], device=dev)
    cache.mla_kv_all.index_copy_(1, p, host[0].index_select(1, hp).to(dev))
    for h, t in zip(host[1:], cache.tensors()[1:]):
        t.index_copy_(1, s, h.index_select(1, hs).to(dev))


def _copy_rate_gbps(device: torch.device, sync) -> float | None:
    """Page-locked copy rate, GB/s: the slower of 256 MiB device->host and host->device (None on the CPU)."""
    if device.type != "cuda":
        return None
    d = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    h = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    out = _ms(lambda: h.copy_(d, non_blocking=True), 5, sync)[0]
    back = _ms(lambda: d.copy_(h, non_blocking=True), 5, sync)[0]
    return d.numel() / max(out, back) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pages", type=count, default=128, help="the request's pages (128: 8K tokens)")
    ap.add_argument("--heads", type=count, default=6, help="KDA heads a rank holds (K3's 96 / TP16)")
    ap.add_argument("--reps", type=count, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = args.pages
    cfg = CacheConfig(num_pages=2 * n, num_slots=2, num_mla_layers=24, mla_width=576, num_kda_layers=69,
                      kda_num_heads=args.heads, kda_head_k_dim=128, kda_head_v_dim=128,
                      kda_conv_dim=3 * args.heads * 128, kv_dtype="bf16", state_dtype="fp32", conv_dtype="bf16")
    cache = CacheTensors(cfg, device)
    for t in cache.tensors():
        t.copy_(torch.randn(t.shape, device=device))
    store = HostStore(cache, n, 1)
    pageable = [torch.zeros((t.shape[0], k, *t.shape[2:]), dtype=t.dtype) for t, k in zip(cache.tensors(), (n, 1, 1))]
    order = torch.randperm(2 * n, generator=torch.Generator().manual_seed(0)).tolist()
    pages, back = order[:n], order[n:]
    nbytes = store.nbytes
    rate = _copy_rate_gbps(device, sync)
    env = dict(bench="env", device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
               or platform.machine(), torch=torch.__version__, copy_rate_gbps=rate and round(rate, 2))
    print(json.dumps(env), flush=True)
    for name, host_pages in (("runs_1", list(range(n))), ("runs_pages", list(range(n))[::-1])):
        def round_trip():
            store.swap_out(pages, 0, host_pages, 0)
            store.swap_in(host_pages, 0, back, 1)
        want = [t.clone() for t in (cache.mla_kv_all[:, pages], cache.kda_state_all[:, 0], cache.kda_conv_all[:, 0])]
        store_ms, returned_ms = _ms(round_trip, args.reps, sync)
        exact = all(torch.equal(a, b) for a, b in zip(
            want, (cache.mla_kv_all[:, back], cache.kda_state_all[:, 1], cache.kda_conv_all[:, 1])))
        pageable_ms = _ms(lambda: _pageable_round_trip(cache, pageable, pages, 0, host_pages, back, 1), args.reps,
                          sync)[0]
        floor_ms = 2 * nbytes / (rate * 1e6) if rate else None
        print(json.dumps(dict(bench="swap", host_runs=name, pages=n, heads=args.heads, bytes_each_way=nbytes,
                              store_ms=round(store_ms, 3), host_return_ms=round(returned_ms, 3),
                              pageable_ms=round(pageable_ms, 3), floor_ms=floor_ms and round(floor_ms, 3),
                              store_x_floor=floor_ms and round(store_ms / floor_ms, 3), pageable_x_store=round(
                                  pageable_ms / store_ms, 3), exact=exact)), flush=True)


if __name__ == "__main__":
    main()
