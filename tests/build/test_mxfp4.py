"""MXFP4 codec vs ml_dtypes (float4_e2m1fn, float8_e8m0fnu) as an independent decoder."""

import ml_dtypes
import numpy as np
import pytest
import torch

from k3build.mxfp4 import (MXFP4Error, check_scale, dequantize_mxfp4, pack_e2m1, quantize_mxfp4,
                           unpack_e2m1)


def _ml_e2m1(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _ml_e8m0(scale: np.ndarray) -> np.ndarray:
    return scale.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def test_all_16_codes_match_ml_dtypes():
    codes = torch.arange(16, dtype=torch.uint8)
    ours = dequantize_mxfp4(pack_e2m1(codes.repeat(2)), torch.full((1,), 127, dtype=torch.uint8))  # scale 1
    ref = _ml_e2m1(codes.repeat(2).numpy())
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32))  # -0.0 too


def test_all_scale_bytes_match_ml_dtypes():
    scale = torch.arange(256, dtype=torch.uint8)  # 0..254 finite, 255 NaN
    codes = torch.arange(32, dtype=torch.uint8) % 16
    packed = pack_e2m1(codes).expand(256, 16).contiguous()
    ours = dequantize_mxfp4(packed, scale[:, None]).numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # 6 * 2^127 is inf in fp32 on both sides
        ref = _ml_e2m1(codes.numpy())[None, :] * _ml_e8m0(scale.numpy())[:, None]
    np.testing.assert_array_equal(ours[:255], ref[:255])
    assert np.isnan(ours[255]).all() and np.isnan(ref[255]).all()


def test_nibble_order_low_is_even():
    codes = torch.tensor([[1, 7]], dtype=torch.uint8)
    assert pack_e2m1(codes).item() == 0x71
    assert unpack_e2m1(torch.tensor([0x71], dtype=torch.uint8)).tolist() == [1, 7]
    c = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(c)), c)


def test_dequantize_bf16_is_exact():
    p = torch.randint(0, 256, (8, 16), dtype=torch.uint8)
    s = torch.randint(100, 150, (8, 1), dtype=torch.uint8)
    assert torch.equal(dequantize_mxfp4(p, s, torch.bfloat16).float(), dequantize_mxfp4(p, s))


@pytest.mark.parametrize("exp", [-127, -100, -3, 0, 5, 120])
def test_round_trip_exact_for_representable(exp):
    g = torch.Generator().manual_seed(exp + 200)
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=g)
    codes[:, ::32] = 7  # each block holds ±6 so the chosen scale is exactly 2^exp
    scale = torch.full((7, 2), exp + 127, dtype=torch.uint8)
    w = dequantize_mxfp4(pack_e2m1(codes), scale)
    packed, s2 = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(packed, s2), w)
    assert torch.equal(s2, scale)


def test_rounding_matches_ml_dtypes_rne():
    # Elements already divided by the block scale: ml_dtypes' float4_e2m1fn cast is RNE and saturating.
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(4000, generator=g) * 7.9 - 3.95,
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 0.0, -0.0])])
    x = x[: len(x) // 32 * 32].reshape(-1, 32)
    x[:, 0] = 6.0  # pin every block's scale to 2^0
    packed, scale = quantize_mxfp4(x)
    assert (scale == 127).all()
    ref = x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(dequantize_mxfp4(packed, scale).numpy(), ref)


def test_shared_exponent_and_zero_block():
    w = torch.zeros(2, 32)
    w[1, 3] = 6.0  # floor(log2 6) = 2 -> X = 0 -> byte 127
    w[1, 4] = -1.5
    packed, scale = quantize_mxfp4(w)
    assert scale.flatten().tolist() == [0, 127]
    assert torch.equal(dequantize_mxfp4(packed, scale), w)
    assert quantize_mxfp4(torch.full((1, 32), 5.0))[0][0, 0].item() == 0x66  # tie 5 -> 4 (even code 6)
    tiny = torch.full((1, 32), 1e-45)  # subnormal amax: exponent clamps to E8M0's minimum
    assert quantize_mxfp4(tiny)[1].item() == 0


def test_error_bound_random():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g) * 0.02
    packed, scale = quantize_mxfp4(w)
    err = (dequantize_mxfp4(packed, scale) - w).abs().unflatten(-1, (8, 32))
    # Worst case per block: half of the top grid step (2 * 2^X) = 2^X, with 2^X <= amax / 4.
    amax = w.abs().unflatten(-1, (8, 32)).amax(-1, keepdim=True)
    assert (err <= amax / 4 + 1e-12).all()
    rel = (dequantize_mxfp4(packed, scale) - w).norm() / w.norm()
    assert rel < 0.2


def test_bad_inputs():
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_mxfp4(torch.tensor([[float("inf")] + [0.0] * 31]))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(3, 48))
    s = torch.full((4, 2), 120, dtype=torch.uint8)
    check_scale(s, "x")
    s[2, 1] = 0xFF
    with pytest.raises(MXFP4Error, match=r"experts\.3\.w1\.weight_scale: scale byte 0xFF .*\[2, 1\]"):
        check_scale(s, "experts.3.w1.weight_scale")



def test_scales_of_implausible_size_are_refused():
    """Exponents stored unbiased decode finite but scale every weight by about 2^120: refused by their median; an
    all-zero tensor (scale byte 0 a block) and real weights' scales pass."""
    w = torch.randn(64, 256) * 0.02
    w[:8] = 0.0  # some all-zero blocks: byte 0, left out of the median
    _, scale = quantize_mxfp4(w)
    check_scale(scale, "x")
    check_scale(torch.zeros(4, 2, dtype=torch.uint8), "x")
    signed = ((scale.to(torch.int16) - 127) & 0xFF).to(torch.uint8)
    with pytest.raises(MXFP4Error, match=r"w2\.weight_scale: the median block scale is 2\^1\d\d; .*unbiased"):
        check_scale(signed, "w2.weight_scale")
    with pytest.raises(MXFP4Error, match=r"median block scale is 2\^-80"):
        check_scale(torch.full((4, 2), 127 - 80, dtype=torch.uint8), "x")
