import pytest
import torch

from k3plugins.moe.mxfp4 import dequantize_mxfp4
from k3plugins.moe.reference import moe_experts

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(shape, gen):
    """Random MXFP4 tensor: (packed u8 [..., K/2], scale u8 [..., K/32], its fp32 value [..., K])."""
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
    scale = torch.randint(118, 124, (*shape[:-1], shape[-1] // 32), generator=gen, dtype=torch.uint8)
    # Low nibble = even element, high nibble = odd element (K3_SPEC.md §3).
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    value = E2M1[codes.long()] * torch.exp2(scale.float() - 127).repeat_interleave(32, -1)
    return packed, scale, value


def _situ(g, u, beta=4.0, lb=25.0):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lb * torch.tanh(u / lb)


def _naive(z, ids, wts, w13, w2, start, act):
    """fp64 per token, per selected expert; w13 [E, 2I, Dl], w2 [E, Dl, I] float values."""
    inter = w2.shape[-1]
    out = torch.zeros(z.shape, dtype=torch.float64)
    for m in range(z.shape[0]):
        for e, w in zip(ids[m].tolist(), wts[m].tolist()):
            if not start <= e < start + w13.shape[0]:
                continue
            h = w13[e - start].double() @ z[m].double()
            g, u = h[:inter], h[inter:]
            a = _situ(g, u) if act == "situ" else g * torch.sigmoid(g) * u
            out[m] += w * (w2[e - start].double() @ a)
    return out


def _routing(M, E, k, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)])
    wts = torch.rand(M, k, generator=gen)
    return ids, wts / wts.sum(-1, keepdim=True)


@pytest.mark.parametrize("M,E,k,Dl,I", [(63, 8, 2, 48, 40), (100, 16, 4, 32, 24), (1, 4, 4, 16, 8)],
                         ids=["M63-E8-k2", "M100-E16-k4", "M1-E4-k4"])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts_float(M, E, k, Dl, I, act):
    g = torch.Generator().manual_seed(M + E)
    z = torch.randn(M, Dl, generator=g)
    w13 = torch.randn(E, 2 * I, Dl, generator=g) / Dl**0.5 * 2
    w2 = torch.randn(E, Dl, I, generator=g) / I**0.5
    ids, wts = _routing(M, E, k, g)
    out = moe_experts(z, ids, wts, w13, None, w2, None, expert_start=0, act=act)
    assert out.dtype == torch.float32 and out.shape == (M, Dl)
    torch.testing.assert_close(out.double(), _naive(z, ids, wts, w13, w2, 0, act), rtol=1e-5, atol=1e-5)


def test_expert_parallel_partials_sum_to_full():
    g = torch.Generator().manual_seed(7)
    M, E, k, Dl, I = 63, 12, 3, 32, 16
    z = torch.randn(M, Dl, generator=g)
    w13, w2 = torch.randn(E, 2 * I, Dl, generator=g) / 6, torch.randn(E, Dl, I, generator=g) / 4
    ids, wts = _routing(M, E, k, g)
    full = moe_experts(z, ids, wts, w13, None, w2, None, expert_start=0, act="situ")
    parts = [moe_experts(z, ids, wts, w13[s:s + 4], None, w2[s:s + 4], None, expert_start=s, act="situ")
             for s in (0, 4, 8)]
    torch.testing.assert_close(sum(parts), full, rtol=1e-5, atol=1e-6)
    # A token none of whose experts is local gets an exact zero row.
    ids_far = torch.full((M, k), 11)
    assert moe_experts(z, ids_far, wts, w13[:4], None, w2[:4], None, expert_start=0, act="situ").abs().max() == 0


@pytest.mark.parametrize("M,E,k,Dl,I", [(63, 6, 2, 64, 96), (100, 4, 3, 96, 32)], ids=["M63-E6", "M100-E4"])
def test_moe_experts_mxfp4(M, E, k, Dl, I):
    g = torch.Generator().manual_seed(M * E)
    z = torch.randn(M, Dl, generator=g)
    w13, s13, w13_val = _mxfp4((E, 2 * I, Dl), g)
    w2, s2, w2_val = _mxfp4((E, Dl, I), g)
    # The codec agrees with this file's independent reading of the layout.
    assert torch.equal(dequantize_mxfp4(w2, s2), w2_val)
    ids, wts = _routing(M, E + 2, k, g)          # experts E, E+1 live on another rank
    out = moe_experts(z, ids, wts, w13, s13, w2, s2, expert_start=2, act="situ")
    # The same experts as float weights: MXFP4 dequant is exact in fp32.
    out_f = moe_experts(z, ids, wts, w13_val, None, w2_val, None, expert_start=2, act="situ")
    torch.testing.assert_close(out, out_f, rtol=0, atol=0)
    torch.testing.assert_close(out.double(), _naive(z, ids, wts, w13_val, w2_val, 2, "situ"), rtol=1e-5, atol=1e-5)


def test_moe_experts_bf16_smoke():
    g = torch.Generator().manual_seed(11)
    M, E, k, Dl, I = 100, 8, 2, 32, 24
    z = torch.randn(M, Dl, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, Dl, generator=g) / 5).bfloat16()
    w2 = (torch.randn(E, Dl, I, generator=g) / 4).bfloat16()
    ids, wts = _routing(M, E, k, g)
    out = moe_experts(z, ids, wts, w13, None, w2, None, expert_start=0, act="situ")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _naive(z.float(), ids, wts, w13.float(), w2.float(), 0, "situ"),
                               rtol=1e-5, atol=1e-5)


def test_moe_experts_rejects_bad_layout():
    z, ids, wts = torch.ones(3, 64), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    w13 = torch.zeros(1, 16, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="both be given"):
        moe_experts(z, ids, wts, w13, torch.zeros(1, 16, 2, dtype=torch.uint8), torch.zeros(1, 64, 4), None,
                    expert_start=0, act="situ")
    with pytest.raises(ValueError, match="MXFP4 w13 must be packed"):
        moe_experts(z, ids, wts, w13, torch.zeros(1, 16, 3, dtype=torch.uint8),
                    torch.zeros(1, 64, 4, dtype=torch.uint8), torch.zeros(1, 64, 1, dtype=torch.uint8),
                    expert_start=0, act="situ")



@pytest.mark.parametrize("block_k", [256, 512])
def test_restride_mxfp4_puts_code_q_sub_plus_j_in_nibble_q_of_word_j(block_k):
    from k3plugins.moe.mxfp4 import restride_mxfp4

    g = torch.Generator().manual_seed(0)
    K, sub = 1024, block_k // 8
    packed = torch.randint(0, 256, (3, 5, K // 2), dtype=torch.uint8, generator=g)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()        # [3, 5, K] natural order
    words = restride_mxfp4(packed, block_k).view(torch.int32).long() & 0xFFFFFFFF  # little-endian words
    got = torch.stack([(words >> (4 * q)) & 0xF for q in range(8)], -1)            # [3, 5, K/8, q]
    j = torch.arange(K // 8)
    want = torch.stack([codes[..., (j // sub) * block_k + q * sub + j % sub] for q in range(8)], -1)
    assert torch.equal(got, want)
    # a view at an odd byte offset (not 64-bit aligned) and a non-contiguous one give the same bytes
    shifted = torch.cat([torch.zeros(3, 5, 1, dtype=torch.uint8), packed], -1)[..., 1:]
    assert torch.equal(restride_mxfp4(shifted, block_k), restride_mxfp4(packed, block_k))
    assert torch.equal(restride_mxfp4(packed.transpose(0, 1).contiguous().transpose(0, 1), block_k),
                       restride_mxfp4(packed, block_k))
    with pytest.raises(ValueError, match=f"multiple of block_k={block_k}"):
        restride_mxfp4(packed[..., :64], block_k)


def test_pair_mxfp4_puts_neighbours_along_k_where_the_decode_reads_them():
    """Word j's pair i (read as the kernel does: shift, mask the magnitude at bits 6-8 / 22-24 and the sign at bit
    15 / 31) holds codes 64i + 2j (low half) and 64i + 2j + 1 (high half) of its K tile."""
    from k3plugins.moe.mxfp4 import PAIR_MAG_SHIFT, PAIR_SIGN_SHIFT, pair_mxfp4

    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (2, 3, 512 // 2), dtype=torch.uint8, generator=g)  # K = 512: two tiles
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()
    words = pair_mxfp4(packed).view(torch.int32).long() & 0xFFFFFFFF
    shl = lambda w, d: ((w << d) if d >= 0 else (w >> -d)) & 0xFFFFFFFF  # noqa: E731
    j = torch.arange(64)
    for i in range(4):
        mag, sign = shl(words, PAIR_MAG_SHIFT[i]), shl(words, PAIR_SIGN_SHIFT[i])
        for h in range(2):
            got = ((mag >> (6 + 16 * h)) & 7) | (((sign >> (15 + 16 * h)) & 1) << 3)  # [2, 3, 64 words]
            assert torch.equal(got, codes[..., (j // 32) * 256 + 64 * i + 2 * (j % 32) + h]), (i, h)
    shifted = torch.cat([torch.zeros(2, 3, 1, dtype=torch.uint8), packed], -1)[..., 1:]  # unaligned, non-contiguous
    assert torch.equal(pair_mxfp4(shifted), pair_mxfp4(packed))
    with pytest.raises(ValueError, match="multiple of block_k=256"):
        pair_mxfp4(packed[..., :64])


def test_lane_order_gives_each_quad_lane_two_scale_groups():
    """LANE_ORDER is a permutation of each K tile's 256 indices whose inverse is the kernel's _lane_pos bit formula;
    position m = 64i + k is read by lane q = (k // 2) % 4 of each quad of the MMA's operand layout, and holds a K
    index of scale group 2q + i // 2 (so a lane needs its own two scale bytes a row). lane_mxfp4 is pair_mxfp4 of
    the codes in that order, lane_permute the same order on activations."""
    from k3plugins.moe.mxfp4 import LANE_ORDER, lane_mxfp4, lane_permute, pair_mxfp4, unpack_e2m1

    m = torch.arange(256)
    assert torch.equal(LANE_ORDER.sort().values, m)
    pos = (LANE_ORDER & 1) | (((LANE_ORDER >> 1) & 31) << 3) | (((LANE_ORDER >> 6) & 3) << 1)  # _lane_pos
    assert torch.equal(pos, m)
    assert torch.equal(LANE_ORDER // 32, 2 * ((m // 2) % 4) + m // 128)
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (2, 3, 512 // 2), dtype=torch.uint8, generator=g)  # K = 512: two tiles
    codes = unpack_e2m1(packed)
    moved = codes.reshape(2, 3, 2, 256)[..., LANE_ORDER].reshape(2, 3, 512)
    assert torch.equal(lane_permute(codes), moved)
    assert torch.equal(lane_mxfp4(packed), pair_mxfp4((moved[..., 0::2] | (moved[..., 1::2] << 4)).contiguous()))
    x = torch.randn(5, 512, generator=g)
    assert torch.equal(lane_permute(x.T.contiguous(), 0).T, lane_permute(x))
    with pytest.raises(ValueError, match="multiple of 256"):
        lane_permute(x[:, :100])


def test_tile_rows_stores_each_row_tile_contiguously():
    """Row tiles of 64 × one K tile: element (r, c) of an expert sits at ((r // 64) · (C / tc) + c // tc) · 64 · tc
    + (r % 64) · tc + c % tc, so a program's K step over 64 rows reads one contiguous block."""
    from k3plugins.moe.mxfp4 import tile_mxfp4, tile_rows, tile_scales

    E, R, C, tc = 2, 128, 256, 128
    t = torch.arange(E * R * C, dtype=torch.int64).reshape(E, R, C)
    flat = tile_rows(t, tc).reshape(E, -1)
    r, c = torch.meshgrid(torch.arange(R), torch.arange(C), indexing="ij")
    at = ((r // 64) * (C // tc) + c // tc) * 64 * tc + (r % 64) * tc + c % tc
    assert torch.equal(flat[:, at.flatten()], t.reshape(E, -1))
    assert tile_mxfp4(t.to(torch.uint8)).shape == (E, R, C)            # shape kept: the engine's declared shapes hold
    assert torch.equal(tile_scales(t[..., :16]), tile_rows(t[..., :16], 8))
    with pytest.raises(ValueError, match=r"rows a multiple of 64 and columns a multiple of 128"):
        tile_rows(t[:, :96], tc)
