"""Sums whose result does not depend on their order: fp64 accumulation, one rounding to fp32.

Why this file exists. An fp32 matmul's result for one row depends on how many rows share the call:
MKL (and cuBLAS) pick different kernels and K blockings by M, so `x[:1] @ W.T` and `(x @ W.T)[:1]`
differ in the last bits (measured on this project's CPU torch for every M < 12 that is not a multiple
of 4). A reference built on such sums cannot make decode (one token per sequence) bitwise equal to
prefill (all tokens at once), nor make an attention row independent of how wide the padded index
list is. Here every reduction the attention reference performs accumulates in fp64 and rounds once
to fp32, where the official code holds its accumulator. Products of bf16 or fp32 operands are exact
in fp64 and the fp64 sum carries 29 more bits than the fp32 result, so the rounded result is the
fp32 rounding of the exact sum whatever the order (except for sums that land within 2^-53 of an fp32
rounding boundary, which random data does not hit). Against the kernels this is the same function:
they differ from it only by their own fp32 summation order (spec §2.5, §7.1 pitfall 8).

`fp8_linear` and `rms_norm` are `reference.linear.fp8_linear` and `reference.linear.rms_norm` (spec
§2.5, §2.7) with this accumulation (torch's fp32 row mean is ordered by the row count on CUDA); the
attention reference uses them so that a token's projections are the same in every batch.
"""

from __future__ import annotations

import torch

from reference.linear import act_quant_dequant
from reference.numerics import Numerics
from reference.weights import Fp8Weight


def einsum_fp32(expr: str, *operands: torch.Tensor) -> torch.Tensor:
    """`torch.einsum(expr, *operands)` accumulated in fp64 and rounded once to fp32."""
    return torch.einsum(expr, *(t.double() for t in operands)).float()


def sum_fp32(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """`x.sum(dim)` accumulated in fp64 and rounded once to fp32."""
    return x.double().sum(dim=dim, keepdim=keepdim).float()


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x W^T` with fp32 output (operands of any float dtype, upcast exactly).

    Args:
        x: [..., K].
        weight: [N, K].

    Returns:
        [..., N] fp32.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x: last dim {x.shape[-1]} does not match the weight's K {weight.shape[-1]}")
    return einsum_fp32("...k,nk->...n", x, weight)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, numerics: Numerics) -> torch.Tensor:
    """Block-FP8 linear (official `fp8_gemm`, spec §2.5): x quantized per token per `act_block`
    channels, times the dequantized FP8 weight, fp32 accumulation, bf16 output.

    Args:
        x: [..., K] bf16.
        weight: `Fp8Weight` [N, K].

    Returns:
        [..., N] bf16.
    """
    return linear_fp32(act_quant_dequant(x, numerics), weight.dequantize()).to(torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w * x * rsqrt(mean(x^2) + eps)` in fp32 (mean accumulated in fp64), cast back to x's dtype
    (spec §2.7). `weight=None` = no weight.

    Args:
        x: [..., n] bf16 or fp32.
        weight: [n] or None.

    Returns:
        [..., n] in x's dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(sum_fp32(xf.square(), dim=-1, keepdim=True) / x.shape[-1] + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
