import dataclasses

import pytest
import torch

from k3runtime.kv_cache import CacheConfig, CacheTensors, HostStore


def tiny(dtype: str, **kw) -> CacheConfig:
    base = dict(num_pages=7, num_slots=3, num_mla_layers=2, mla_width=9, num_kda_layers=3, kda_num_heads=2,
                kda_head_k_dim=5, kda_head_v_dim=4, kda_conv_dim=6, page_size=4, kda_conv_size=4,
                kv_dtype=dtype, state_dtype=dtype, conv_dtype=dtype)
    return CacheConfig(**{**base, **kw})


def randomize(cache: CacheTensors, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in cache.tensors():
        # Large random values use every mantissa bit, so any rounding on the way shows.
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * 1e3)


def test_shapes_dtypes_and_views():
    c = CacheTensors(tiny("bf16", state_dtype="fp32"))
    assert c.mla_kv_all.shape == (2, 7, 4, 9) and c.mla_kv_all.dtype == torch.bfloat16
    assert c.kda_state_all.shape == (3, 3, 2, 4, 5) and c.kda_state_all.dtype == torch.float32
    assert c.kda_conv_all.shape == (3, 3, 6, 3) and c.kda_conv_all.dtype == torch.bfloat16
    assert len(c.mla_kv) == 2 and len(c.kda_state) == len(c.kda_conv) == 3
    c.kda_state[1][2].fill_(5)  # the per-layer views alias the pooled tensor
    assert c.kda_state_all[1, 2].eq(5).all()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_swap_round_trip_is_exact_and_touches_nothing_else(dtype):
    cache = CacheTensors(tiny(dtype))
    randomize(cache, 0)
    before = [t.clone() for t in cache.tensors()]
    store = HostStore(cache, num_host_pages=5, num_host_slots=2)
    store.swap_out([3, 1, 6], 2, [4, 0, 2], 1)
    assert torch.equal(store.mla_kv[[4, 0, 2]], before[0][:, [3, 1, 6]].transpose(0, 1))
    assert torch.equal(store.kda_state[1], before[1][:, 2]) and torch.equal(store.kda_conv[1], before[2][:, 2])
    # The executor reuses the device pages/slot; the request comes back elsewhere.
    for t in cache.tensors():
        t.fill_(-1)
    store.swap_in([4, 0, 2], 1, [0, 5, 2], 0)
    mla, state, conv = cache.tensors()
    assert torch.equal(mla[:, [0, 5, 2]], before[0][:, [3, 1, 6]])
    assert torch.equal(state[:, 0], before[1][:, 2]) and torch.equal(conv[:, 0], before[2][:, 2])
    assert mla[:, [1, 3, 4, 6]].eq(-1).all() and state[:, 1:].eq(-1).all() and conv[:, 1:].eq(-1).all()


def test_apply_runs_swap_outs_before_swap_ins():
    from types import SimpleNamespace as E

    cache = CacheTensors(tiny("fp32"))
    randomize(cache, 1)
    old0, old2 = cache.mla_kv_all[:, 0].clone(), cache.mla_kv_all[:, 2].clone()
    store = HostStore(cache, 2, 2)
    store.swap_out([0], 0, [1], 1)
    # Page 2 leaves for host page 0 while host page 1 comes back into page 2 in the same step.
    store.apply(swap_out=[E(page_ids=(2,), slot_id=1, host_page_ids=(0,), host_slot_id=0)],
                swap_in=[E(page_ids=(2,), slot_id=1, host_page_ids=(1,), host_slot_id=1)])
    assert torch.equal(store.mla_kv[0], old2) and torch.equal(cache.mla_kv_all[:, 2], old0)


@pytest.mark.parametrize("host_pages", [[0, 1, 2, 3], [5, 6, 0, 1], [3, 1, 6, 4], [6, 5, 4, 3]], ids=str)
def test_pages_land_in_their_host_pages_in_any_runs(host_pages):
    """Host pages go in runs of consecutive ids (one copy a run): whole runs, broken runs, none, reversed."""
    cache = CacheTensors(tiny("bf16"))
    randomize(cache, 4)
    before = cache.mla_kv_all.clone()
    store = HostStore(cache, num_host_pages=7, num_host_slots=1)
    store.swap_out([2, 0, 6, 5], 0, host_pages, 0)
    for page, host in zip([2, 0, 6, 5], host_pages):
        assert torch.equal(store.mla_kv[host], before[:, page])
    untouched = sorted(set(range(7)) - set(host_pages))
    assert store.mla_kv[untouched].eq(0).all()
    cache.mla_kv_all.zero_()
    store.swap_in(host_pages, 0, [1, 3, 4, 0], 0)
    assert torch.equal(cache.mla_kv_all[:, [1, 3, 4, 0]], before[:, [2, 0, 6, 5]])
    assert cache.mla_kv_all[:, [2, 5, 6]].eq(0).all()


def test_capacity_and_id_errors_are_clear():
    cache = CacheTensors(tiny("fp32"))
    store = HostStore(cache, num_host_pages=2, num_host_slots=1)
    with pytest.raises(IndexError, match="host page id 2 out of range.*num_host_pages.*holds 2"):
        store.swap_out([0, 1, 2], 0, [0, 1, 2], 0)
    with pytest.raises(IndexError, match="host slot id 1 out of range.*num_host_slots"):
        store.swap_out([0], 0, [0], 1)
    with pytest.raises(IndexError, match="page id 9 out of range: the device cache holds 7"):
        store.swap_in([0], 0, [9], 0)
    with pytest.raises(ValueError, match="2 host pages for 1 device pages"):
        store.swap_out([0], 0, [0, 1], 0)


def test_zero_slots_zeroes_only_those_slots():
    cache = CacheTensors(tiny("bf16"))
    randomize(cache, 2)
    mla = cache.mla_kv_all.clone()
    cache.zero_slots([0, 2])
    assert cache.kda_state_all[:, [0, 2]].eq(0).all() and cache.kda_conv_all[:, [0, 2]].eq(0).all()
    assert cache.kda_state_all[:, 1].ne(0).any() and torch.equal(cache.mla_kv_all, mla)
    cache.zero_slots([])
    with pytest.raises(IndexError, match="slot id 3 out of range"):
        cache.zero_slots([3])


def test_k3_sizes_match_the_spec():
    # K3_SPEC.md §4: 449,372,160 B per fp32 slot (69 KDA layers), 27,648 B per token of MLA KV in bf16.
    k3 = CacheConfig(num_pages=1, num_slots=1, num_mla_layers=24, mla_width=576, num_kda_layers=69, kda_num_heads=96,
                     kda_head_k_dim=128, kda_head_v_dim=128, kda_conv_dim=3 * 96 * 128)
    assert k3.bytes_per_slot == 449_372_160 and k3.bytes_per_page == 27_648 * 64
    assert k3.nbytes == k3.bytes_per_slot + k3.bytes_per_page
    k10 = dataclasses.replace(k3, num_slots=10)
    fitted = k10.fit_pages(10 * k3.bytes_per_slot + 5 * k3.bytes_per_page + 1)
    assert fitted.num_pages == 5 and fitted.num_slots == 10 and k10.num_pages == 1
    with pytest.raises(ValueError, match="not one page"):
        k3.fit_pages(k3.bytes_per_slot)


@pytest.mark.parametrize("kw,field", [({"state_dtype": "fp16"}, "state_dtype"), ({"kv_dtype": "int8"}, "kv_dtype"),
                                      ({"mla_width": 0}, "mla_width"), ({"kda_conv_size": 1}, "kda_conv_size"),
                                      ({"num_pages": -1}, "num_pages")])
def test_config_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        tiny("fp32", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_round_trip_through_pinned_host(dtype):
    cache = CacheTensors(tiny(dtype), device="cuda")
    randomize(cache, 3)
    before = [t.clone() for t in cache.tensors()]
    store = HostStore(cache, num_host_pages=4, num_host_slots=2)
    assert store.pinned and store.mla_kv.is_pinned() and store.kda_state.is_pinned()
    slot, pages = torch.tensor([1], device="cuda"), torch.tensor([6, 0, 5], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the swaps are queued on the stream, the host never waits
    try:
        store.swap_out([6, 0, 5], 1, [2, 3, 0], 0)
        cache.zero_slots(slot)
        cache.mla_kv_all.index_fill_(1, pages, 0)  # the device pages reused at once: after the copies, in order
        store.swap_in([2, 3, 0], 0, [2, 4, 1], 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(cache.mla_kv_all[:, [2, 4, 1]], before[0][:, [6, 0, 5]])
    assert cache.mla_kv_all[:, [6, 0, 5]].eq(0).all() and cache.kda_state_all[:, 1].eq(0).all()
    assert torch.equal(cache.kda_state_all[:, 2], before[1][:, 1]) and torch.equal(cache.kda_conv_all[:, 2], before[2][:, 1])
    torch.cuda.synchronize()  # the host reads the store itself
    assert torch.equal(store.mla_kv[[2, 3, 0]].cuda(), before[0][:, [6, 0, 5]].transpose(0, 1))
