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


# ------------------------------------------------------------------------------------------------
# Golden results (parity_tests/golden.py): the reference re-run on the CPU against its own stored outputs.
# The reference is deterministic for fixed inputs; across machines only fp32 summation order changes (BLAS
# kernels differ by ISA, vendor dispatch and thread count): ~1e-7 relative in fp32, which flips a bf16
# output by exactly 1 ULP only where the fp32 value sits within ~1e-7 of a rounding boundary (a few
# elements in 1e5), and moves whole-tensor statistics by < 1e-7 of the RMS. A formula change moves most
# elements by many ULPs; a change that moves values by less than an ULP still moves many sampled values
# by one ULP, which the `moved` count sees.
# ------------------------------------------------------------------------------------------------
GOLDEN_STATS = Bound(
    "simulated", "max |stat - golden| / rms", 1e-5,
    "mean, mean|x|, rms of the whole output: summation-order noise is < 1e-7 of the rms; 100x headroom",
)
GOLDEN_VALUES = Bound(
    "simulated", "max |x - golden| / tol", 1.0,
    "sampled values and amax; tol = 1 ULP of the output dtype at the value, or 1e-5 rms if larger (integer "
    "outputs: exact): a reordered fp32 sum can flip a bf16 rounding by one ULP, never by two",
)
GOLDEN_MOVED = Bound(
    "simulated", "fraction of samples moved >= tol / 2", 1 / 32,
    "a one-ULP flip from summation order hits ~1e-4 of the elements; 4 of 128 samples is far above that "
    "and far below the share a sub-ULP formula change (an eps, a rounding place) moves",
)

# The bad-input corpus (parity_tests/bad_inputs.py): every malformed call raises exactly the documented
# error type with the documented message fragment, or returns exactly the documented output.
BAD_INPUT_CONTRACT = Bound(
    "bitwise", "violations", 0, "a documented contract: the exact error type and message, or the defined output",
)
