"""Properties of the number formats (spec §2.1-§2.4, §2.6): scales, FP8 rounding, MXFP4, re-encode."""

from __future__ import annotations

import pytest
import torch

from parity_tests.cases import FP8_FORMATS, generator
from reference.formats import (
    E4M3FN,
    E4M3FNUZ,
    FP4_LUT,
    dequantize_fp4,
    dequantize_per_block,
    dequantize_per_token,
    fp8_format,
    fp32_to_ue8m0,
    is_power_of_two,
    mxfp4_to_fp8,
    pack_fp4,
    quant_dequant_fp4,
    quantize_fp4,
    quantize_per_block,
    quantize_per_token,
    round_to_fp4,
    ue8m0_scale,
    ue8m0_to_fp32,
    unpack_fp4,
)


def _wide_range(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Gaussian rows whose magnitudes span 1e-8 .. 1e4, so every binade and the subnormals are hit."""
    g = generator(seed)
    scale = torch.logspace(-8, 4, shape[0])[:, None]
    return torch.randn(shape, generator=g) * scale * torch.rand(shape, generator=g) ** 3


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_every_ue8m0_scale_is_an_exact_power_of_two(fmt: str) -> None:
    x = _wide_range((64, 512))
    x[7] = 0  # an all-zero block takes the eps floor
    _, s = quantize_per_token(x, 128, fmt)
    assert is_power_of_two(s)
    _, sw = quantize_per_block(torch.randn(256, 384, generator=generator(1)) * 1e-3, 128, fmt)
    assert is_power_of_two(sw)


def test_ue8m0_ceil_is_exact_just_above_a_power_of_two() -> None:
    # amax / 448 one ulp above 2^-3: a float log2 can round it down to -3; the bit ceil gives 2^-2.
    ratio = torch.tensor([2.0**-3], dtype=torch.float32)
    just_above = torch.nextafter(ratio, torch.tensor([1.0]))
    amax = just_above * 448
    s = ue8m0_scale(amax, 448.0)
    assert float(s) >= float(amax) / 448  # the block's amax never clips
    exact = ue8m0_scale(torch.tensor([2.0**-3 * 448]), 448.0)
    assert float(exact) == 2.0**-3


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_quant_dequant_error_is_at_most_half_an_fp8_step(fmt: str) -> None:
    f = fp8_format(fmt)
    x = _wide_range((64, 512), seed=2)
    q, s = quantize_per_token(x, 128, fmt)
    back = dequantize_per_token(q, s, 128)
    s_full = s.repeat_interleave(128, dim=-1)
    # Half of the grid spacing at each value, in the value's own units: RNE never moves it further.
    half_step = 0.5 * f.step(back / s_full) * s_full
    assert bool(((back - x).abs() <= half_step).all())
    assert float((x / s_full).abs().max()) <= f.max  # the scale maps amax inside the format


def test_fnuz_uses_its_own_max_and_has_no_negative_zero() -> None:
    # A block whose amax is exactly 240 (FNUZ max) / 448 (OCP max) gets scale 1 and keeps that value.
    x = torch.tensor([[240.0, -240.0, -1e-30] + [0.0] * 125])
    q, s = quantize_per_token(x, 128, E4M3FNUZ)
    assert float(s) == 1.0 and float(q.float().abs().max()) == E4M3FNUZ.max == 240.0
    assert not q.float().isnan().any()  # -1e-30 rounds to zero, and 0x80 would be NaN in FNUZ
    x[0, 0] = 448.0
    q, s = quantize_per_token(x, 128, E4M3FNUZ)
    assert float(s) == 2.0 and float(q.float().abs().max()) == 224.0  # 448 / 2: never clipped
    q, s = quantize_per_token(x, 128, E4M3FN)
    assert float(s) == 1.0 and float(q.float().abs().max()) == E4M3FN.max == 448.0


def test_fp8_format_lookup_rejects_unknown_formats() -> None:
    assert fp8_format(torch.float8_e4m3fnuz) is E4M3FNUZ
    with pytest.raises(ValueError, match="fmt"):
        fp8_format("e5m2")


def test_block_quantization_rejects_ragged_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of the block size"):
        quantize_per_token(torch.randn(3, 100), 128)
    with pytest.raises(ValueError, match="multiples of the block size"):
        quantize_per_block(torch.randn(100, 128), 128)
    q, s = quantize_per_block(torch.randn(128, 256), 128)
    with pytest.raises(ValueError, match="s: expected shape"):
        dequantize_per_block(q, s[:, :1], 128)


def test_ue8m0_bytes_round_trip_and_reject_non_powers_of_two() -> None:
    s = torch.tensor([2.0**-20, 1.0, 2.0**40])
    assert torch.equal(ue8m0_to_fp32(fp32_to_ue8m0(s)), s)
    with pytest.raises(ValueError, match="power of two"):
        fp32_to_ue8m0(torch.tensor([3.0]))
    # byte 0 is 2^-127 (E8M0 has no zero), byte 0xFF is NaN
    assert float(ue8m0_to_fp32(torch.tensor([0], dtype=torch.uint8))) == 2.0**-127
    with pytest.raises(ValueError, match="NaN"):
        ue8m0_to_fp32(torch.tensor([255], dtype=torch.uint8))


def test_fp4_rounding_is_round_to_nearest_even_on_ties() -> None:
    # midpoints between E2M1 magnitudes go to the neighbour with the even mantissa bit
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(FP4_LUT[round_to_fp4(ties).long()].abs(), expected)
    assert torch.equal(FP4_LUT[round_to_fp4(-ties).long()], -expected)


def test_fp4_pack_unpack_round_trip_low_nibble_first() -> None:
    codes = torch.arange(16, dtype=torch.uint8).repeat(4, 2)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (4, 16)
    assert int(packed.view(torch.uint8)[0, 0]) == 0x10  # code 0 low, code 1 high
    assert torch.equal(unpack_fp4(packed), codes)


def test_fp4_quant_dequant_error_is_at_most_half_a_step() -> None:
    x = torch.randn(16, 256, generator=generator(3))
    codes, s = quantize_fp4(x)
    back = dequantize_fp4(codes, s)
    s_full = s.repeat_interleave(32, dim=-1)
    # E2M1 spacing at magnitude m: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
    mag = (back / s_full).abs()
    spacing = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    assert bool(((back - x).abs() <= 0.5 * spacing * s_full).all())
    xb = x.bfloat16()
    assert torch.equal(quant_dequant_fp4(xb), dequantize_fp4(*quantize_fp4(xb)).bfloat16())


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_mxfp4_to_fp8_reencode_is_bitwise_lossless(fmt: str) -> None:
    g = generator(4)
    # per-32 scales spread over 2^10 inside each tile (well within the 2^14 budget)
    exponents = torch.randint(-10, 1, (256, 16), generator=g).repeat_interleave(32, 1)
    w = torch.randn(256, 512, generator=g) * 2.0**exponents
    codes, s = quantize_fp4(w)
    q, s8 = mxfp4_to_fp8(pack_fp4(codes), s, fmt)
    assert q.dtype == fp8_format(fmt).dtype and is_power_of_two(s8)
    assert torch.equal(dequantize_per_block(q, s8), dequantize_fp4(codes, s))


def test_mxfp4_to_fp8_raises_where_it_cannot_be_lossless() -> None:
    codes = torch.full((128, 128), 1, dtype=torch.uint8)  # every value 0.5 x its scale
    s = torch.ones(128, 4)
    s[0, 0] = 2.0**-20  # 0.5 * 2^-20 relative to a tile max of 1: below E4M3's subnormal step
    with pytest.raises(ValueError, match="not be lossless"):
        mxfp4_to_fp8(pack_fp4(codes), s)


def test_stacked_mxfp4_experts_reencode_one_by_one_and_refuse_an_empty_stack() -> None:
    """`Fp4Weight.to_fp8` on [E, N, K] experts fills one result expert by expert: each expert's slice is that expert's
    own re-encode; a stack of no experts is refused by name."""
    from reference.weights import Fp4Weight

    g = generator(5)
    codes, s = quantize_fp4(torch.randn(3, 128, 256, generator=g))
    stacked = Fp4Weight(pack_fp4(codes), s).to_fp8("e4m3fn")
    for e in range(3):
        q, s8 = mxfp4_to_fp8(pack_fp4(codes[e]), s[e], "e4m3fn")
        assert torch.equal(stacked.data[e], q) and torch.equal(stacked.scale[e], s8), f"expert {e}"
    with pytest.raises(ValueError, match="packed: no experts"):
        Fp4Weight(pack_fp4(codes[:0]), s[:0]).to_fp8("e4m3fn")
