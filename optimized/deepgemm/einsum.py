"""DeepGEMM adapter for the grouped FP8 einsum, and the activation quantization that feeds it.

`deep_gemm.fp8_einsum(expr, a, b, d, c=None, recipe=(1, 128, 128))` (DeepGEMM 2.8.2,
`csrc/apis/einsum.hpp`): on SM90 only `'bhr,hdr->bhd'`, recipe (1, 128, 128), e4m3fn operands, fp32
scales, bf16 `d`. It permutes A, its scales and D to `[h, b, .]` and runs a batched NT GEMM, so it
needs `A.permute(1, 0, 2).stride(-1) == 1` and `D.stride(-1) == 1`; the weight scales must be
contiguous `[h, d/128, r/128]`. Activation scales in any layout work, but unless they already are
MN-major and TMA-aligned (`get_mn_major_tma_aligned_tensor`: per group `[r/128, align(b, 4)]`) DeepGEMM
re-lays them out on every call (~5 us at b = 128, gpu.md). `quantize_attn_output` here therefore writes
them in that layout directly (Triton kernel: DeepGEMM has no quantization kernel).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from optimized.deepgemm import deep_gemm
from optimized.triton import quant
from reference.einsum import check_attn_output_args, check_fp8_einsum_args
from reference.formats import FP8Format, fp8_format

SUPPORTED_EXPR = "bhr,hdr->bhd"
SUPPORTED_RECIPE = (1, 128, 128)


@functools.cache
def deep_gemm_module() -> ModuleType:
    """`optimized.deepgemm.deep_gemm()` once per process (it checks the backend's availability on every call;
    a failure is not cached and raises again)."""
    return deep_gemm()


def check_supported(expr: str, recipe: tuple[int, int, int], a: tuple[torch.Tensor, torch.Tensor],
                    b: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None) -> None:
    """What DeepGEMM's SM90 einsum needs beyond `check_fp8_einsum_args` (raises ValueError / TypeError)."""
    if expr != SUPPORTED_EXPR:
        raise ValueError(f"expr: the deepgemm backend implements only {SUPPORTED_EXPR!r} (DeepGEMM's SM90 form), "
                         f"got {expr!r}; the reference implements all three")
    if recipe != SUPPORTED_RECIPE:
        raise ValueError(f"recipe: DeepGEMM's SM90 einsum takes only {SUPPORTED_RECIPE} (gran_k 128, 128x128 "
                         f"weight scales), got {recipe!r}; the triton backend also implements (1, 1, 128)")
    if a[0].dtype != torch.float8_e4m3fn:
        raise TypeError(f"a[0]: DeepGEMM supports float8_e4m3fn only, got {a[0].dtype}")
    for name, t in (("a[0]", a[0]), ("b[0]", b[0])):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")
    if not b[1].is_contiguous():
        raise ValueError("b[1]: DeepGEMM's SM90 einsum needs contiguous [h, d/128, r/128] weight scales")
    if out is not None:
        if out.dtype != torch.bfloat16:
            raise TypeError(f"out: DeepGEMM's SM90 einsum writes bfloat16 only, got {out.dtype}")
        if out.stride(-1) != 1:
            raise ValueError(f"out: the last dim must be contiguous (stride 1), got strides {tuple(out.stride())}")


def fp8_einsum(
    expr: str,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    recipe: tuple[int, int, int] = (1, 128, 128),
) -> torch.Tensor:
    """`deep_gemm.fp8_einsum` with the reference's contract (scale layouts in `reference.einsum`)."""
    check_fp8_einsum_args(expr, a, b, out, recipe)
    return fp8_einsum_checked(expr, a, b, out, recipe=recipe)


def fp8_einsum_checked(
    expr: str,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    recipe: tuple[int, int, int] = (1, 128, 128),
) -> torch.Tensor:
    """`fp8_einsum` for arguments that already passed `check_fp8_einsum_args` (the public op's validation)."""
    check_supported(expr, recipe, a, b, out)
    dg = deep_gemm_module()
    n = a[0].shape[0]
    if out is None:
        out = torch.empty((n, a[0].shape[1], b[0].shape[1]), dtype=torch.bfloat16, device=a[0].device)
    if n > 0:
        dg.fp8_einsum(expr, (a[0], a[1]), (b[0], b[1]), out, recipe=recipe)
    return out


def quantize_attn_output(
    o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *, n_groups: int,
    fmt: str | FP8Format = "e4m3fn",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton fused inverse-RoPE quantization with scales in DeepGEMM's SM90 layout.

    Returns `o_fp8` [T, G, K] (a view of [G, T, K] storage) and `o_scale` [T, G, K/128] (a view of
    [G, K/128, align(T, 4)] storage, padding rows 0) — both consumed by `deep_gemm.fp8_einsum` without a copy.
    """
    check_attn_output_args(o, positions, freqs, n_groups, fmt)
    return quantize_attn_output_checked(o, positions, freqs, n_groups=n_groups, fmt=fmt)


def quantize_attn_output_checked(
    o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *, n_groups: int,
    fmt: str | FP8Format = "e4m3fn",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_attn_output` for arguments that already passed `check_attn_output_args`."""
    if fp8_format(fmt).name != "e4m3fn":
        raise ValueError(f"fmt: DeepGEMM consumes float8_e4m3fn only, got {fmt!r}")
    return quant.quantize_attn_output_checked(o, positions, freqs, n_groups=n_groups, fmt=fmt,
                                              scale_layout="deepgemm")
