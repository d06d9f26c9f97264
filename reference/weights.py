"""Weight containers and random initialisation with realistic statistics.

Quantized weights travel as `(data, scale)` pairs, the layout DSv4 checkpoints and DeepGEMM use:
`Fp8Weight` (E4M3 values, fp32 power-of-two scale per 128x128 tile) and `Fp4Weight` (two E2M1
values per int8, fp32 power-of-two scale per 1x32). Module-specific weight sets (attention, MoE)
live beside their modules; loading from checkpoint names lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.formats import (
    E4M3FN,
    FP4_BLOCK,
    FP8Format,
    dequantize_fp4,
    dequantize_per_block,
    fp8_format,
    mxfp4_to_fp8,
    pack_fp4,
    quantize_fp4,
    quantize_per_block,
    unpack_fp4,
)

FP8_WEIGHT_BLOCK = 128


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight `[N, K]` as FP8 with one fp32 power-of-two scale per 128x128 tile.

    Attributes:
        data: [..., N, K] float8_e4m3fn or float8_e4m3fnuz.
        scale: [..., N / 128, K / 128] fp32.
    """

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        fp8_format(self.data.dtype)  # raises on a non-FP8 dtype
        n, k = self.data.shape[-2:]
        expect = (*self.data.shape[:-2], -(-n // FP8_WEIGHT_BLOCK), -(-k // FP8_WEIGHT_BLOCK))
        if tuple(self.scale.shape) != expect:
            raise ValueError(f"scale: expected shape {expect} for data {tuple(self.data.shape)}, "
                             f"got {tuple(self.scale.shape)}")
        if self.scale.dtype != torch.float32:
            raise TypeError(f"scale: expected float32 power-of-two values, got {self.scale.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        """[..., N, K] fp32."""
        return dequantize_per_block(self.data, self.scale, FP8_WEIGHT_BLOCK)

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device))


@dataclass(frozen=True)
class Fp4Weight:
    """A linear weight `[N, K]` as MXFP4: int8 with two E2M1 values (low nibble = even k) and one fp32
    power-of-two scale per 1x32.

    Attributes:
        packed: [..., N, K / 2] int8.
        scale: [..., N, K / 32] fp32.
    """

    packed: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.int8:
            raise TypeError(f"packed: expected int8 packed E2M1, got {self.packed.dtype}")
        expect = (*self.packed.shape[:-1], self.packed.shape[-1] * 2 // FP4_BLOCK)
        if tuple(self.scale.shape) != expect:
            raise ValueError(f"scale: expected shape {expect} for packed {tuple(self.packed.shape)}, "
                             f"got {tuple(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., N, K]."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self) -> torch.Tensor:
        """[..., N, K] fp32."""
        return dequantize_fp4(unpack_fp4(self.packed), self.scale)

    def to_fp8(self, fmt: str | FP8Format = E4M3FN) -> Fp8Weight:
        """Lossless re-encode to 128x128 block FP8 (raises where it would not be lossless)."""
        if self.packed.dim() != 2:
            q, s = zip(*(mxfp4_to_fp8(p, sc, fmt) for p, sc in zip(self.packed, self.scale)))
            return Fp8Weight(torch.stack(q), torch.stack(s))
        return Fp8Weight(*mxfp4_to_fp8(self.packed, self.scale, fmt))

    def to(self, device: torch.device | str) -> Fp4Weight:
        return Fp4Weight(self.packed.to(device), self.scale.to(device))


def random_linear(
    n: int, k: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu",
    batch: tuple[int, ...] = (), std: float | None = None,
) -> torch.Tensor:
    """[*batch, N, K] fp32 Gaussian weight with std `1/sqrt(K)` (unit-variance outputs for unit inputs)."""
    std = k**-0.5 if std is None else std
    w = torch.randn((*batch, n, k), generator=generator, dtype=torch.float32)
    return (w * std).to(device)


def random_fp8_weight(
    n: int, k: int, *, fmt: str | FP8Format = E4M3FN, generator: torch.Generator | None = None,
    device: torch.device | str = "cpu", batch: tuple[int, ...] = (),
) -> Fp8Weight:
    """A random `[*batch, N, K]` weight quantized to 128x128 block FP8, as checkpoints store it."""
    q, s = quantize_per_block(random_linear(n, k, generator=generator, batch=batch), FP8_WEIGHT_BLOCK, fmt)
    return Fp8Weight(q.to(device), s.to(device))


def random_fp4_weight(
    n: int, k: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu",
    batch: tuple[int, ...] = (),
) -> Fp4Weight:
    """A random `[*batch, N, K]` weight quantized to MXFP4 (per-32 UE8M0 scales), as the experts ship."""
    codes, s = quantize_fp4(random_linear(n, k, generator=generator, batch=batch))
    return Fp4Weight(pack_fp4(codes).to(device), s.to(device))
