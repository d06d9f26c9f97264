"""Parity tiers and their bounds. Every bound says why it is what it is; tests import them from here.

Tiers (design §parity_tests):
  * bitwise        — identical by construction (same arithmetic in the same order, or pure data
                     movement / integer work): `torch.equal` on the bytes.
  * simulated      — candidate vs the reference run with the *same* quantization simulated: only fp32
                     summation order, the hardware FP8 accumulator and the final bf16 rounding differ.
  * end_to_end     — candidate vs the reference in EXACT numerics (no quantization simulated): the
                     error of the quantization itself is included.
  * torch_relative — FlashAttention's rule: the candidate's error against an fp32 reference is at
                     most 2x the error of a same-precision (bf16) PyTorch run against that reference.
"""

from __future__ import annotations

from dataclasses import dataclass

TIERS = ("bitwise", "simulated", "end_to_end", "torch_relative")


@dataclass(frozen=True)
class Bound:
    """A named bound on one metric, with its reason."""

    tier: str
    metric: str
    value: float
    reason: str

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier: expected one of {TIERS}, got {self.tier!r}")

    def passes(self, measured: float) -> bool:
        """`measured <= value` (NaN never passes)."""
        return measured == measured and measured <= self.value


BITWISE = Bound("bitwise", "mismatches", 0, "same arithmetic in the same order: any difference is a bug")

# A bf16 output rounding alone gives calc_diff ~ 2^-9^2 / 3 ~ 1.3e-6 (relative error uniform in
# +-2^-9, squared, averaged); DeepGEMM measured 1.4e-6 on the H200 for every FP8 kernel against an
# fp32 dequantize-then-matmul of the same inputs (gpu.md). Different fp32 summation orders add far
# less (K <= 7168 terms, each ~2^-24 relative). 1e-5 leaves 7x headroom over the bf16 rounding
# and is still two orders below the FP8 quantization error (~7e-4), so a kernel that mis-scales one
# 128-block or drops a K tile fails it.
FP8_GEMM_SIMULATED = Bound(
    "simulated", "calc_diff", 1e-5,
    "bf16 output rounding ~1.4e-6 (DeepGEMM, H200) x 7 headroom; a wrong block scale costs >1e-4",
)

# DeepGEMM's own FP8 GEMM / einsum test bound against the unquantized bf16 math: per-128 FP8 with
# 3 mantissa bits on both operands gives calc_diff ~7e-4 on Gaussian data (gpu.md measured 7e-4).
FP8_END_TO_END = Bound(
    "end_to_end", "calc_diff", 1e-3,
    "DeepGEMM's bound for FP8 x FP8 vs unquantized bf16 (measured ~7e-4 on the H200)",
)

# One operand in FP4 (E2M1, 1 mantissa bit): DeepGEMM uses 1e-2 for FP8 x FP4.
FP4_END_TO_END = Bound(
    "end_to_end", "calc_diff", 1e-2,
    "DeepGEMM's bound for FP8 x FP4 (E2M1 has 1 mantissa bit, ~16x the FP8 squared error)",
)

TORCH_RELATIVE_FACTOR = 2.0  # FlashAttention: candidate error <= 2x the same-precision torch error


def fp8_quant_dequant_bound(step: float) -> float:
    """Per element, quantize -> dequantize moves a value by at most half an FP8 step (RNE), where the
    step is the spacing of the E4M3 grid at that value times the block's power-of-two scale."""
    return 0.5 * step
