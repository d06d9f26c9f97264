"""Block-scaled FP8 linear and FP8 x FP4 linear, as the official kernels compute them (spec §2.5, §2.6).

`y[m, n] = bf16( sum_kb sa[m, kb] * sw[n, kb] * sum_{k in kb} qa[m, k] * qw[n, k] )` with fp32 partial
sums. Because every scale is a power of two, dequantizing both operands and doing one matmul is the
same function; the matmul accumulates in fp64 and rounds once to fp32 (`reference.invariant`), so a
row's result does not depend on how many rows share the call (decode equals prefill bitwise). It
differs from the kernels only in their fp32 summation order (and the hardware's FP8 accumulator,
spec §7.1 pitfall 8).
"""

from __future__ import annotations

import torch

from reference.formats import dequantize_per_token, quantize_per_token
from reference.invariant import linear_fp32, sum_fp32
from reference.numerics import Numerics
from reference.weights import Fp4Weight, Fp8Weight


def act_quant_dequant(x: torch.Tensor, numerics: Numerics) -> torch.Tensor:
    """The activation a quantized linear sees: `QD_fp8(x; act_block)` in fp32, or x in fp32 when
    `numerics.act_quant` is off.

    Args:
        x: [..., K] bf16.

    Returns:
        [..., K] fp32.
    """
    if not numerics.act_quant:
        return x.float()
    q, s = quantize_per_token(x, numerics.act_block, numerics.fp8_format)
    return dequantize_per_token(q, s, numerics.act_block)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, numerics: Numerics) -> torch.Tensor:
    """`y = x W^T` with W block-FP8 and x quantized per token per `act_block` channels (official `fp8_gemm`).

    Args:
        x: [..., K] bf16.
        weight: `Fp8Weight` [N, K].

    Returns:
        [..., N] bf16.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x: last dim {x.shape[-1]} does not match the weight's K {weight.shape[-1]}")
    return linear_fp32(act_quant_dequant(x, numerics), weight.dequantize()).to(torch.bfloat16)


def fp4_linear(x: torch.Tensor, weight: Fp4Weight, numerics: Numerics) -> torch.Tensor:
    """`y = x W^T` with W MXFP4 (per-32 scales) and x quantized per token (official `fp4_gemm`).

    Args:
        x: [..., K] bf16.
        weight: `Fp4Weight` logical [N, K].

    Returns:
        [..., N] bf16.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x: last dim {x.shape[-1]} does not match the weight's K {weight.shape[-1]}")
    return linear_fp32(act_quant_dequant(x, numerics), weight.dequantize()).to(torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w * x * rsqrt(mean(x^2) + eps)` in fp32 (the mean accumulated in fp64), cast back to x's dtype
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
