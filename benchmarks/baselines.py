"""Baselines timed beside the backends: what a user would call without this package.

  * torch bf16: the same product with the dequantized weight in bf16 (cuBLAS), the official code's numerics
    for `wo_a` and what an FP8-less GPU would run.
  * torch `_scaled_mm` with block-wise scales (1x128 activations, 128x128 weights): cuBLAS's block-scaled
    FP8 GEMM, the same numerics as our FP8 linears (torch >= 2.9 on SM90 with CUDA >= 12.9). Its scale
    layout rules have moved between torch releases, so `scaled_mm_blockwise` tries the known layouts and keeps
    the first that runs *and* gives the right answer; where none does, the baseline is n/a with the reason.
  * DeepGEMM's raw kernels on pre-quantized inputs with scales already in its MN-major TMA-aligned layout:
    the floor our DeepGEMM adapters add their glue to.

Every baseline is checked once against an fp32 oracle before it is timed (`check_close`): a baseline that
computes something else is reported n/a, not timed.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from parity_tests.metrics import calc_diff

# A baseline must agree with the fp32 oracle of the same (quantized) inputs to this calc_diff: the bf16
# output rounding alone gives ~1.4e-6 (tolerances.FP8_GEMM_SIMULATED) and the FP8 quantization of unquantized
# inputs ~7e-4 (tolerances.FP8_END_TO_END); a wrong scale layout or transposed operand gives ~1.
BASELINE_CALC_DIFF = 1e-3


def check_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise when a baseline's output is not the oracle's (calc_diff above `BASELINE_CALC_DIFF`)."""
    diff = calc_diff(got.float(), want.float())
    if not diff <= BASELINE_CALC_DIFF:
        raise RuntimeError(f"{name} gives a different result (calc_diff {diff:.2e} > {BASELINE_CALC_DIFF:g})")


def deep_gemm() -> ModuleType:
    """The `deep_gemm` module, or RuntimeError with the reason it is unavailable here."""
    from optimized.deepgemm import deep_gemm as load

    return load()


def deepgemm_scales(sf: torch.Tensor) -> torch.Tensor:
    """fp32 `[..., MN, K/128]` scales in DeepGEMM's MN-major TMA-aligned layout (same logical shape)."""
    return deep_gemm().get_mn_major_tma_aligned_tensor(sf)


def scaled_mm_blockwise(x: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                        want: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A call of `torch._scaled_mm` computing `x W^T` with block scales, checked against `want`.

    Args:
        x: [M, K] FP8 row-major; sx: [M, K/128] fp32 (1x128 blocks).
        w: [N, K] FP8 row-major; sw: [N/128, K/128] fp32 (128x128 blocks).
        want: [M, N] the fp32 oracle of the same quantized operands.

    Raises:
        RuntimeError: no known scale layout runs on this torch, or none gives the right result.
    """
    wt = w.t()  # [K, N] column-major: the second operand layout cuBLAS wants
    layouts = {
        "1x128 outer-dim-major / 128x128 transposed": (sx.t().contiguous().t(), sw.t()),
        "1x128 row-major / 128x128 transposed": (sx.contiguous(), sw.t()),
        "1x128 outer-dim-major / 128x128 transposed-contiguous": (sx.t().contiguous().t(), sw.t().contiguous()),
    }
    errors = []
    for label, (scale_a, scale_b) in layouts.items():
        def call(scale_a: torch.Tensor = scale_a, scale_b: torch.Tensor = scale_b) -> torch.Tensor:
            return torch._scaled_mm(x, wt, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        try:
            check_close(f"_scaled_mm ({label})", call(), want)
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0][:100] if str(exc).strip() else ""
            errors.append(f"{label}: {type(exc).__name__}: {first_line}")
            continue
        return call
    raise RuntimeError("torch._scaled_mm block-wise scaling unsupported here (" + "; ".join(errors) + ")")
