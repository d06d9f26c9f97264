"""Block-scaled FP8 linear in Triton (official `fp8_gemm`, spec §2.5): per-token act quant + FP8 GEMM.

`y = x W^T` is the einsum `'bhr,hdr->bhd'` with one group (h = 1, b = tokens, r = K, d = N), so this is
`quant.quantize_per_token` followed by the einsum kernel of `optimized.triton.einsum` (its promotion
loop steps one activation scale block at a time: 128, or 32 for MegaMoE-style numerics, while the
weight keeps its 128x128 scales).
"""

from __future__ import annotations

import torch

from optimized.linear import check_fp8_linear_args
from optimized.triton.einsum import block_scaled_matmul
from optimized.triton.quant import check_fp8_support, quantize_per_token_checked
from reference.formats import fp8_format
from reference.numerics import Numerics
from reference.weights import FP8_WEIGHT_BLOCK, Fp8Weight


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, numerics: Numerics) -> torch.Tensor:
    """Triton `fp8_linear`; same contract as `reference.linear.fp8_linear`.

    Args:
        x: [..., K] bf16 (K a multiple of 128).
        weight: `Fp8Weight` [N, K] in `numerics.fp8_format`.
        numerics: `act_quant` must be on; `act_block` 128 (official) or 32.

    Returns:
        [..., N] bf16.
    """
    check_fp8_linear_args(x, weight, numerics)
    return fp8_linear_checked(x, weight, numerics)


def fp8_linear_checked(x: torch.Tensor, weight: Fp8Weight, numerics: Numerics) -> torch.Tensor:
    """`fp8_linear` for arguments that already passed `check_fp8_linear_args` (the public op's validation)."""
    check_fp8_support(fp8_format(numerics.fp8_format), x.device, "numerics")
    n, k = weight.data.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    q, s = quantize_per_token_checked(x2, numerics.act_block, numerics.fp8_format)
    out = torch.empty((x2.shape[0], 1, n), dtype=torch.bfloat16, device=x.device)
    data = weight.data if weight.data.stride(1) == 1 else weight.data.contiguous()
    block_scaled_matmul(q.unsqueeze(1), s.unsqueeze(1), data.unsqueeze(0), weight.scale.unsqueeze(0), out,
                        a_block_k=numerics.act_block, b_gran_n=FP8_WEIGHT_BLOCK)
    return out.view(*x.shape[:-1], n)
