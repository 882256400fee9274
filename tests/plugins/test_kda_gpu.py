"""fla-core/Triton KDA mixer vs the torch reference on the GPU (pytest -m gpu)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("fla.ops.kda")

from k3plugins.kda import fla as kda_dev  # noqa: E402
from k3plugins.kda.reference import in_proj_rows  # noqa: E402
from k3plugins.kda.reference import kda_mixer as kda_ref  # noqa: E402


def _layer(hidden, H, K, S, seed, low_rank=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    D = H * K
    r = lambda *s, sc=1.0: torch.randn(*s, device="cuda", generator=g) * sc
    rows, padded = in_proj_rows(H, K, low_rank)
    in_proj = torch.cat([r(rows, hidden, sc=hidden ** -0.5), torch.zeros(padded - rows, hidden, device="cuda")])
    w = dict(in_proj_weight=in_proj, conv_weight=r(3 * D, 4, sc=0.5),  # zero rows padded, as the build lays it
             f_b_weight=r(D, K, sc=K ** -0.5), A_log=r(H, sc=0.5), dt_bias=r(D, sc=0.5),
             g_b_weight=r(D, K, sc=K ** -0.5) if low_rank else None, o_norm_weight=1 + 0.1 * r(K),
             o_weight=r(hidden, D, sc=D ** -0.5))
    pools = (r(S, H, K, K, sc=0.1), r(S, 3 * D, 3).to(torch.bfloat16))
    return w, pools, g


def _run(fn, x, w, pools, cu, slots, H, K, lb, **extra):
    rec, conv = pools[0].clone(), pools[1].clone()
    out = fn(x, w["in_proj_weight"], w["conv_weight"], w["f_b_weight"], w["A_log"], w["dt_bias"], w["g_b_weight"],
             w["o_norm_weight"], w["o_weight"], rec, conv, cu_seqlens=cu, slot_ids=slots, num_heads=H, head_dim=K,
             lower_bound=lb, eps=1e-5, **extra)
    return out.float(), rec.float(), conv.float()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("tactic", kda_dev.DECODE_TACTICS)
@pytest.mark.parametrize("lb", [-5.0, None], ids=["safe_gate", "softplus"])
@pytest.mark.parametrize("N,H,K", [(1, 2, 128), (7, 4, 64), (33, 3, 128)])
def test_kda_decode(tactic, lb, N, H, K):
    w, pools, g = _layer(96, H, K, S=N + 5, seed=N * 10 + H)
    x = torch.randn(N, 96, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(N + 5, device="cuda", generator=g)[:N]
    cu = torch.arange(N + 1, device="cuda")
    wb = {k: (v.to(torch.bfloat16) if k in ("in_proj_weight", "f_b_weight", "o_weight", "g_b_weight") and v is not None
              else v) for k, v in w.items()}
    out, rec, conv = _run(kda_dev.kda_mixer, x, wb, pools, cu, slots, H, K, lb, decode_tactic=tactic)
    ref, rec_r, conv_r = _run(kda_ref, x, wb, pools, cu, slots, H, K, lb)
    assert _rel(out, ref) < 2e-2 and _rel(rec, rec_r) < 1e-2
    assert _rel(conv, conv_r) < 1e-2  # raw inputs, copied (bf16 GEMM rounding may differ by an ulp)


@pytest.mark.parametrize("lens", [[300], [1, 64, 130], [5, 0, 77]], ids=str)
def test_kda_prefill(lens):
    H, K = 4, 128
    N = len(lens)
    w, pools, g = _layer(96, H, K, S=N + 2, seed=sum(lens))
    x = torch.randn(sum(lens), 96, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(N + 2, device="cuda", generator=g)[:N]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    wb = {k: (v.to(torch.bfloat16) if k in ("in_proj_weight", "f_b_weight", "o_weight") and v is not None else v)
          for k, v in w.items()}
    out, rec, conv = _run(kda_dev.kda_mixer, x, wb, pools, cu, slots, H, K, -5.0)
    ref, rec_r, conv_r = _run(kda_ref, x, wb, pools, cu, slots, H, K, -5.0)
    assert _rel(out, ref) < 3e-2 and _rel(rec, rec_r) < 2e-2
    assert _rel(conv, conv_r) < 1e-2


@pytest.mark.parametrize("lens", [[300], [1, 64, 130], [5, 0, 77, 1]], ids=str)
def test_prefill_chunk_layout_on_device(lens, monkeypatch):
    """chunk_kda with its chunk layout built on the device (CHUNK_LAYOUT_ON_DEVICE, padded with chunks that do
    nothing) gives what it gives with the layout read on the host, bit for bit, and makes no device->host sync for
    a new cu_seqlens (set_sync_debug_mode("error"); the first call, whose kernels autotune, runs before)."""
    H, K = 4, 128
    N = len(lens)
    w, pools, g = _layer(96, H, K, S=N + 2, seed=sum(lens) + 1)
    x = torch.randn(sum(lens), 96, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(N + 2, device="cuda", generator=g)[:N]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    wb = {k: (v.to(torch.bfloat16) if k in ("in_proj_weight", "f_b_weight", "o_weight") and v is not None else v)
          for k, v in w.items()}
    res = {}
    for on_device in (False, True):
        monkeypatch.setattr(kda_dev, "CHUNK_LAYOUT_ON_DEVICE", on_device)
        _run(kda_dev.kda_mixer, x, wb, pools, cu.clone(), slots, H, K, -5.0)
        fresh = cu.clone()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if on_device else "default")
        try:
            res[on_device] = _run(kda_dev.kda_mixer, x, wb, pools, fresh, slots, H, K, -5.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(res[True], res[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("N,H", [(5, 3), (40, 96)])
def test_decode_slices_agree(N, H):
    """Every state slice of the split tactic gives the same output and state (decode_block_v picks one by grid),
    and the fused tactic agrees with it with and without its register cap."""
    K = 128
    g = torch.Generator(device="cuda").manual_seed(N)
    D = H * K
    r = lambda *s, sc=1.0: torch.randn(*s, device="cuda", generator=g) * sc
    args = [r(N, 3 * D).bfloat16(), r(N, D).bfloat16(), r(N, H).bfloat16(), r(N, D).bfloat16(), r(3 * D, 4, sc=0.5),
            r(H, sc=0.5), r(D, sc=0.5), 1 + 0.1 * r(K)]
    pools = (r(N + 3, H, K, K, sc=0.05), r(N + 3, 3 * D, 3).bfloat16())
    slots = torch.randperm(N + 3, device="cuda", generator=g)[:N].int()
    res = []
    configs = [dict(tactic="split", block_v=bv) for bv in (32, 64, 128, None)]
    configs += [dict(tactic="fused", maxnreg=reg) for reg in (None, 0, kda_dev.FUSED_MAXNREG)]
    for config in configs:
        rec, conv = pools[0].clone(), pools[1].clone()
        out = kda_dev.kda_decode(*args, rec, conv, slots, num_heads=H, head_dim=K, lower_bound=-5.0, eps=1e-5,
                                 **config)
        res.append((out.float(), rec))
    for config, (out, rec) in zip(configs[1:], res[1:]):
        # fused's sums over K run in another order (bench_plugins measured rel-L2 1.4e-5 against split)
        tol = 1e-5 if config["tactic"] == "split" else 5e-5
        assert _rel(out, res[0][0]) < tol and _rel(rec, res[0][1]) < 1e-6, config


@pytest.mark.parametrize("N,H", [(5, 3), (32, 6), (40, 96)])
def test_fused_decode_applies_f_b_itself(N, H):
    """The fused tactic given f_a and f_b's weight equals it given the f_b GEMM's output (the gate rounded to bf16
    either way; the sums run in another order, so an element may differ by one bf16 ulp)."""
    from k3plugins.embed.dense import dense
    K = 128
    g = torch.Generator(device="cuda").manual_seed(N + H)
    D = H * K
    r = lambda *s, sc=1.0: torch.randn(*s, device="cuda", generator=g) * sc
    f_a, f_b = r(N, K).bfloat16(), r(D, K, sc=K ** -0.5).bfloat16()
    qkv, b, g_out = r(N, 3 * D).bfloat16(), r(N, H).bfloat16(), r(N, D).bfloat16()
    rest = [r(3 * D, 4, sc=0.5), r(H, sc=0.5), r(D, sc=0.5), 1 + 0.1 * r(K)]
    pools = (r(N + 3, H, K, K, sc=0.05), r(N + 3, 3 * D, 3).bfloat16())
    slots = torch.randperm(N + 3, device="cuda", generator=g)[:N].int()
    res = []
    for g_in, extra in ((dense(f_a, f_b), {}), (f_a, dict(f_b_weight=f_b))):
        rec, conv = pools[0].clone(), pools[1].clone()
        out = kda_dev.kda_decode(qkv, g_in, b, g_out, *rest, rec, conv, slots, num_heads=H, head_dim=K,
                                 lower_bound=-5.0, eps=1e-5, tactic="fused", **extra)
        res.append((out.float(), rec, conv))
    assert _rel(res[1][0], res[0][0]) < 5e-3 and _rel(res[1][1], res[0][1]) < 5e-3
    assert torch.equal(res[1][2], res[0][2])
    with pytest.raises(ValueError, match=r"g_raw must be f_a"):
        kda_dev.kda_decode(qkv, g_out, b, g_out, *rest, *pools, slots, num_heads=H, head_dim=K, lower_bound=-5.0,
                           eps=1e-5, f_b_weight=f_b)
