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

`reference.linear` (the FP8 / FP4 linears and RMSNorm, spec §2.5-§2.7) accumulates through these
helpers too (torch's fp32 row mean is ordered by the row count on CUDA), so a token's projections are
the same in every batch in every block of the reference.
"""

from __future__ import annotations

import torch


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
