"""Number formats of DSv4: FP8 E4M3 (OCP and FNUZ), UE8M0 power-of-two scales, MXFP4 (E2M1).

Spec §2.1-§2.4 and §2.6. Every scale here is an fp32 tensor whose values are exact powers of two
(the UE8M0 values); `ue8m0_to_fp32` / `fp32_to_ue8m0` convert to and from the checkpoint's
`float8_e8m0fnu` bytes. Because the scales are powers of two, `x / s` and `q * s` are exact in fp32,
so quantize -> dequantize loses only the FP8 (or FP4) rounding itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

# ------------------------------------------------------------------------------------------------
# FP8 formats
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FP8Format:
    """One FP8 E4M3 flavour.

    Attributes:
        name: `"e4m3fn"` or `"e4m3fnuz"`.
        dtype: the torch dtype.
        max: largest finite value; quantization scales map a block's amax onto it and clamp to it.
        min_normal_exp: exponent of the smallest normal number (values below are subnormal).
    """

    name: str
    dtype: torch.dtype
    max: float
    min_normal_exp: int

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """The spacing of representable values around |x| (fp32), i.e. one FP8 ULP at x."""
        exp = torch.floor(torch.log2(x.float().abs().clamp(min=2.0 ** self.min_normal_exp)))
        return torch.exp2(exp - 3)  # 3 mantissa bits


# OCP E4M3: max 448, smallest normal 2^-6; NVIDIA SM89+, gfx950.
E4M3FN = FP8Format("e4m3fn", torch.float8_e4m3fn, 448.0, -6)
# FNUZ E4M3 (exponent bias 8, no negative zero, 0x80 is NaN): max 240, smallest normal 2^-7; gfx942.
# We clamp at the format's own max, 240. vLLM clamps at 224 on gfx942 for weights converted from OCP
# bytes (their values are halved); here every tensor is quantized directly into FNUZ with a scale
# that maps the block amax onto 240, so the full range is usable and nothing overflows.
E4M3FNUZ = FP8Format("e4m3fnuz", torch.float8_e4m3fnuz, 240.0, -7)

FP8_FORMATS: dict[str, FP8Format] = {f.name: f for f in (E4M3FN, E4M3FNUZ)}


def fp8_format(fmt: str | torch.dtype | FP8Format) -> FP8Format:
    """Look up an FP8 format by name (`"e4m3fn"`, `"e4m3fnuz"`), torch dtype, or pass one through."""
    if isinstance(fmt, FP8Format):
        return fmt
    for f in FP8_FORMATS.values():
        if fmt in (f.name, f.dtype):
            return f
    raise ValueError(f"fmt: expected one of {sorted(FP8_FORMATS)} or their torch dtypes, got {fmt!r}")


# ------------------------------------------------------------------------------------------------
# UE8M0 scales (spec §2.1)
# ------------------------------------------------------------------------------------------------

# amax floors: official act_quant and DeepGEMM's casts use 1e-4; official fp4_act_quant 6 * 2^-126.
ACT_EPS = 1e-4
FP4_EPS = 6 * 2.0**-126


def ue8m0_scale(amax: torch.Tensor, qmax: float, eps: float = ACT_EPS) -> torch.Tensor:
    """The power-of-two scale `2^ceil(log2(max(amax, eps) / qmax))`, computed on the float's bits.

    A float `log2` can round a value just above a power of two down to the integer and give a scale
    one binade too small (values then clip at qmax); on the bits the ceil is exact: take the exponent
    of `amax / qmax` and add one if any mantissa bit is set (official `fast_log2_ceil`, DeepGEMM
    `ceil_to_ue8m0`). The exponent byte is clamped to [1, 254] as DeepGEMM does.

    Args:
        amax: [...] absolute maximum of each block (any float dtype).
        qmax: largest value of the target format (448 / 240 FP8, 6 FP4).
        eps: amax floor, so an all-zero block still gets a finite scale.

    Returns:
        [...] fp32 exact powers of two.
    """
    ratio = amax.float().clamp(min=eps) / qmax
    bits = ratio.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    exponent = exponent.clamp(1, 254)
    return (exponent << 23).view(torch.float32)


def ue8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """Checkpoint scales (`float8_e8m0fnu` bytes, or already fp32) -> fp32 powers of two.

    The bytes are read as uint8 first: a numeric copy of e8m0 into an integer dtype destroys them
    (spec §7.1 pitfall 14). Byte 255 is NaN in E8M0 and raises.
    """
    if scale.dtype == torch.float32:
        return scale
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scale: expected float8_e8m0fnu, uint8 or float32, got {scale.dtype}")
    exponent = scale.view(torch.uint8).to(torch.int32)
    if bool((exponent == 255).any()):
        raise ValueError("scale: E8M0 byte 0xFF is NaN")
    # 2^(e - 127); e = 0 is 2^-127, a float32 subnormal.
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 127)


def fp32_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales -> `float8_e8m0fnu` bytes. Raises if a value is not a power of two."""
    s = scale.float()
    mantissa, exponent = torch.frexp(s)
    if bool(((mantissa != 0.5) | (s <= 0)).any()):
        raise ValueError("scale: every value must be a positive power of two to be stored as UE8M0")
    biased = exponent - 1 + 127
    if bool(((biased < 0) | (biased > 254)).any()):
        raise ValueError("scale: exponent outside the UE8M0 range 2^-127 .. 2^127")
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def is_power_of_two(scale: torch.Tensor) -> bool:
    """True when every element is a positive power of two (what UE8M0 can hold)."""
    mantissa, _ = torch.frexp(scale.float())
    return bool(((mantissa == 0.5) & (scale > 0)).all())


# ------------------------------------------------------------------------------------------------
# FP8 block quantization (spec §2.2, §2.3)
# ------------------------------------------------------------------------------------------------


def _check_block(x: torch.Tensor, block: int, dim_name: str) -> None:
    if x.shape[-1] % block:
        raise ValueError(f"{dim_name}: last dim {x.shape[-1]} is not a multiple of the block size {block}")


def quantize_per_token(
    x: torch.Tensor, block: int = 128, fmt: str | FP8Format = E4M3FN, eps: float = ACT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1 x `block` FP8 quantization of activations (official `act_quant`).

    Args:
        x: [..., N] any float dtype, N a multiple of `block`.
        block: channels per scale (128 before linears, 64 for the KV NoPE simulation, 32 for MegaMoE).
        fmt: FP8 format.
        eps: amax floor of the scale.

    Returns:
        q: [..., N] FP8 values `fp8_rne(clamp(x / s, -max, max))`.
        s: [..., N / block] fp32 power-of-two scales.
    """
    f = fp8_format(fmt)
    _check_block(x, block, "x")
    blocks = rearrange(x.float(), "... (nb b) -> ... nb b", b=block)
    s = ue8m0_scale(blocks.abs().amax(dim=-1), f.max, eps)
    q = (blocks / s.unsqueeze(-1)).clamp(-f.max, f.max).to(f.dtype)  # clamp first: overflow would be NaN
    return rearrange(q, "... nb b -> ... (nb b)"), s


def dequantize_per_token(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of `quantize_per_token`: [..., N] FP8 and [..., N / block] scales -> [..., N] fp32."""
    if s.shape[-1] * block != q.shape[-1]:
        raise ValueError(f"s: expected last dim {q.shape[-1] // block} for block {block}, got {s.shape[-1]}")
    blocks = rearrange(q.float(), "... (nb b) -> ... nb b", b=block)
    return rearrange(blocks * s.float().unsqueeze(-1), "... nb b -> ... (nb b)")


def quant_dequant_fp8(
    x: torch.Tensor, block: int, fmt: str | FP8Format = E4M3FN, eps: float = ACT_EPS
) -> torch.Tensor:
    """`QD_fp8(x; block)`: what an FP8 cache stores, read back, in x's dtype (official in-place act_quant)."""
    q, s = quantize_per_token(x, block, fmt, eps)
    return dequantize_per_token(q, s, block).to(x.dtype)


def quantize_per_block(
    w: torch.Tensor, block: int = 128, fmt: str | FP8Format = E4M3FN, eps: float = ACT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block` x `block` FP8 quantization of weights (checkpoint format; DeepGEMM `per_block_cast_to_fp8`).

    Args:
        w: [..., N, K] any float dtype, N and K multiples of `block`.

    Returns:
        q: [..., N, K] FP8.
        s: [..., N / block, K / block] fp32 power-of-two scales.
    """
    f = fp8_format(fmt)
    if w.shape[-1] % block or w.shape[-2] % block:
        raise ValueError(f"w: last two dims {tuple(w.shape[-2:])} must be multiples of the block size {block}")
    tiles = rearrange(w.float(), "... (nb bn) (kb bk) -> ... nb kb bn bk", bn=block, bk=block)
    s = ue8m0_scale(tiles.abs().amax(dim=(-1, -2)), f.max, eps)
    q = (tiles / s[..., None, None]).clamp(-f.max, f.max).to(f.dtype)
    return rearrange(q, "... nb kb bn bk -> ... (nb bn) (kb bk)"), s


def dequantize_per_block(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of `quantize_per_block`: [..., N, K] FP8 and [..., N/B, K/B] scales -> [..., N, K] fp32."""
    expect = (*q.shape[:-2], q.shape[-2] // block, q.shape[-1] // block)
    if tuple(s.shape) != expect:
        raise ValueError(f"s: expected shape {expect} for block {block}, got {tuple(s.shape)}")
    tiles = rearrange(q.float(), "... (nb bn) (kb bk) -> ... nb kb bn bk", bn=block, bk=block)
    return rearrange(tiles * s.float()[..., None, None], "... nb kb bn bk -> ... (nb bn) (kb bk)")


# ------------------------------------------------------------------------------------------------
# MXFP4 (E2M1 values, UE8M0 scale per 32) (spec §1.1, §2.4)
# ------------------------------------------------------------------------------------------------

FP4_MAX = 6.0
FP4_BLOCK = 32
# Nibble -> value: bit 3 is the sign, bits 0-2 index the E2M1 magnitudes.
FP4_LUT = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)


def round_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (|x| <= 6) to the nearest E2M1 value, ties to the even mantissa (RNE).

    Official TileLang cast and vLLM's `cvt.rn.satfinite.e2m1x2` are RNE; DeepGEMM's test utility
    sends ties to the smaller magnitude instead (spec §2.4), so quantizers disagree on exact ties.
    Returns nibble codes [...] uint8 (sign in bit 3).
    """
    mag = x.float().abs().clamp(max=FP4_MAX)
    # Midpoints between neighbouring magnitudes. A value exactly on a midpoint goes to the neighbour
    # with the even code (even mantissa bit): down (strict >) when the lower code is even, up (>=)
    # when the upper one is.
    code = torch.zeros_like(mag, dtype=torch.int64)
    for lower_code, midpoint in enumerate((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)):
        passed = mag > midpoint if lower_code % 2 == 0 else mag >= midpoint
        code += passed.to(torch.int64)
    sign = ((x < 0) & (code > 0)).to(torch.int64) << 3
    return (code | sign).to(torch.uint8)


def quantize_fp4(x: torch.Tensor, block: int = FP4_BLOCK, eps: float = FP4_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-`block` MXFP4 quantization along the last dim (official `fp4_act_quant`).

    Args:
        x: [..., N] any float dtype, N a multiple of `block`.

    Returns:
        codes: [..., N] uint8 nibble codes (unpacked; see `pack_fp4`).
        s: [..., N / block] fp32 power-of-two scales.
    """
    _check_block(x, block, "x")
    blocks = rearrange(x.float(), "... (nb b) -> ... nb b", b=block)
    s = ue8m0_scale(blocks.abs().amax(dim=-1), FP4_MAX, eps)
    codes = round_to_fp4((blocks / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return rearrange(codes, "... nb b -> ... (nb b)"), s


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """Nibble codes [...] uint8 -> E2M1 values [...] fp32."""
    return FP4_LUT.to(codes.device)[codes.long()]


def dequantize_fp4(codes: torch.Tensor, s: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Inverse of `quantize_fp4`: [..., N] codes, [..., N / block] scales -> [..., N] fp32."""
    return dequantize_per_token(fp4_values(codes), s, block)


def quant_dequant_fp4(x: torch.Tensor, block: int = FP4_BLOCK, eps: float = FP4_EPS) -> torch.Tensor:
    """`QD_fp4(x; block)` in x's dtype (official in-place `fp4_act_quant`)."""
    codes, s = quantize_fp4(x, block, eps)
    return dequantize_fp4(codes, s, block).to(x.dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., N] nibble codes -> [..., N / 2] int8, two per byte along the last dim, low nibble = even index."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dim {codes.shape[-1]} must be even to pack two nibbles per byte")
    pairs = rearrange(codes.to(torch.uint8), "... (n two) -> ... n two", two=2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., N / 2] int8 (or uint8) -> [..., N] uint8 nibble codes (low nibble first)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"packed: expected int8 or uint8 packed E2M1, got {packed.dtype}")
    b = packed.view(torch.uint8)
    return rearrange(torch.stack((b & 0xF, b >> 4), dim=-1), "... n two -> ... (n two)")


# ------------------------------------------------------------------------------------------------
# Lossless MXFP4 -> 128x128 FP8 re-encode (spec §2.6, official convert.py cast_e2m1fn_to_e4m3fn)
# ------------------------------------------------------------------------------------------------


def mxfp4_to_fp8(
    packed: torch.Tensor, scale: torch.Tensor, fmt: str | FP8Format = E4M3FN, block: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-encode an MXFP4 weight as block-FP8 without changing a single value.

    Per `block` x `block` tile the new scale is `S = max_j s_j / 2^6` (2^6 = 64 so that the largest
    E2M1 magnitude, 6, times 64 = 384 fits under 448; under FNUZ's 240 the headroom is 2^5, giving
    6 x 32 = 192), and each value becomes `e2m1 * (s_j / S)`. The result is exact only where every
    value lands on the FP8 grid; where a small per-32 scale would push a value below the format's
    subnormal step (or between grid points) this raises instead of rounding.

    Args:
        packed: [N, K / 2] int8 packed E2M1 (low nibble = even k).
        scale: [N, K / 32] per-32 scales (fp32 powers of two or `float8_e8m0fnu`).
        fmt: target FP8 format.

    Returns:
        q: [N, K] FP8, s: [N / block, K / block] fp32 powers of two, with
        `dequantize_per_block(q, s) == dequantize_fp4(unpack_fp4(packed), scale)` bitwise.
    """
    f = fp8_format(fmt)
    codes = unpack_fp4(packed)
    s32 = ue8m0_to_fp32(scale)
    n, k = codes.shape
    if s32.shape != (n, k // FP4_BLOCK):
        raise ValueError(f"scale: expected shape {(n, k // FP4_BLOCK)} for packed {tuple(packed.shape)}, "
                         f"got {tuple(s32.shape)}")
    if n % block or k % block:
        raise ValueError(f"packed: logical shape {(n, k)} must be a multiple of the FP8 block {block}")
    exact = dequantize_fp4(codes, s32)
    headroom = 2.0 ** (6 if f.max >= 384 else 5)  # largest power of two with 6 * 2^k <= fmt.max
    tile_max = rearrange(s32, "(nb bn) (kb bk) -> nb kb (bn bk)", bn=block, bk=block // FP4_BLOCK).amax(-1)
    s = tile_max / headroom
    s_full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (exact / s_full).to(f.dtype)
    back = q.float() * s_full
    if not torch.equal(back, exact):
        bad = (back != exact).nonzero()[0].tolist()
        raise ValueError(
            f"packed: MXFP4 -> {f.name} re-encode would not be lossless (first differing element {bad}: "
            f"{exact[tuple(bad)].item()} -> {back[tuple(bad)].item()}); a per-32 scale is too small "
            f"relative to its {block}x{block} tile's largest scale"
        )
    return q, s
