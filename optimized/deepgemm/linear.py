"""DeepGEMM adapter for the block-scaled FP8 linear: Triton per-token quant + `deep_gemm.fp8_gemm_nt`.

`fp8_gemm_nt((x_fp8, sfa), (w_fp8, sfw), d)` (DeepGEMM 2.8.2, SM90 "1D2D" kernel): A [M, K] and W
[N, K] e4m3fn K-major, fp32 scales `sfa [M, K/128]` (wanted MN-major and TMA-aligned, strides
`(1, align(M, 4))`, which `quant.quantize_per_token(..., scale_layout="deepgemm")` writes directly) and
`sfw [N/128, K/128]`, bf16 D [M, N].
"""

from __future__ import annotations

import torch

from optimized.deepgemm.einsum import deep_gemm_module
from optimized.linear import check_fp8_linear_args
from optimized.triton.quant import quantize_per_token_checked
from reference.numerics import Numerics
from reference.weights import Fp8Weight


def check_supported(weight: Fp8Weight, numerics: Numerics) -> None:
    """What `fp8_gemm_nt` on SM90 needs beyond `check_fp8_linear_args` (raises ValueError naming the argument)."""
    if numerics.fp8_format != "e4m3fn":
        raise ValueError(f"numerics: DeepGEMM supports fp8_format 'e4m3fn' only, got {numerics.fp8_format!r}")
    if numerics.act_block != 128:
        raise ValueError(f"numerics: DeepGEMM's SM90 FP8 GEMM needs act_block 128 (gran_k), got {numerics.act_block}")
    if not (weight.data.is_contiguous() and weight.scale.is_contiguous()):
        raise ValueError("weight: DeepGEMM needs contiguous K-major data [N, K] and scales [N/128, K/128]")


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, numerics: Numerics) -> torch.Tensor:
    """`y = x W^T` on DeepGEMM; same contract as `reference.linear.fp8_linear`.

    Args:
        x: [..., K] bf16.
        weight: `Fp8Weight` [N, K] e4m3fn.
        numerics: act_quant on, act_block 128, fp8_format e4m3fn.

    Returns:
        [..., N] bf16.
    """
    check_fp8_linear_args(x, weight, numerics)
    return fp8_linear_checked(x, weight, numerics)


def fp8_linear_checked(x: torch.Tensor, weight: Fp8Weight, numerics: Numerics) -> torch.Tensor:
    """`fp8_linear` for arguments that already passed `check_fp8_linear_args` (the public op's validation)."""
    check_supported(weight, numerics)
    dg = deep_gemm_module()
    n, k = weight.data.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    q, s = quantize_per_token_checked(x2, 128, numerics.fp8_format, scale_layout="deepgemm")
    out = torch.empty((x2.shape[0], n), dtype=torch.bfloat16, device=x.device)
    if x2.shape[0] > 0:
        dg.fp8_gemm_nt((q, s), (weight.data, weight.scale), out)
    return out.view(*x.shape[:-1], n)
