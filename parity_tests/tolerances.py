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


# ------------------------------------------------------------------------------------------------
# MoE (spec §5; parity_tests/ops/moe.py). Derivations below; the numbers quoted as "measured" come from
# the reference itself on the CPU (random weights of `reference.moe.random_moe_weights`).
# ------------------------------------------------------------------------------------------------

# Router logits l = x . g over D <= 7168 bf16 x bf16 products, each exact in fp32, so two implementations
# differ only in fp32 summation order. A sequential sum's error is a random walk of D roundings of the
# running sum: RMS 2^-24 * sigma_l * sqrt(D / 6) = 4e-6 at D = 7168 for logit std sigma_l = 2; 5 sigma
# over the 1.6 M logits of PRO at T = 4096, with both sides ordered worst: |dl| <= 3e-5 (measured vs fp64:
# 1.2e-5 sequential, 2.4e-6 blocked BLAS). Tiled GPU sums are far below that.
ROUTER_LOGIT_ERROR = 3e-5

# Two experts can swap places in the top-k only if the reference's keys (s + b) of the two differ by at most
# what both keys can move: |ds| <= |dl| / 2 (ds/dl = sigmoid(l) / (2 sqrt(softplus(l))) <= 0.32) on each,
# plus half an fp32 ulp of the key (~8..16: 2^-21) on each side: 3e-5 + 2e-6. Swaps between experts whose
# keys are closer than this are near ties (spec §7.1 pitfall 5); any other difference of the sets fails.
ROUTE_NEAR_TIE_GAP = 4e-5

ROUTE_SETS = Bound(
    "bitwise", "tokens whose expert set differs beyond a near tie", 0,
    "selection is exact up to near ties (gap <= ROUTE_NEAR_TIE_GAP); exact ties go to the lower expert id; "
    "hash routing is a table lookup",
)

# w_i = route_scale * s_i / sum_j s_j: d ln s <= |dl| / 2 per score, the renormalization adds at most as much
# again, so |dw_i| <= w_i * |dl| <= route_scale (2.5) * 3e-5 = 7.5e-5, plus a few fp32 ulps of 2.5 (1e-6).
# A missing renormalization or route_scale, or a bias leaking into the weights, moves weights by > 1e-2.
ROUTE_WEIGHTS = Bound(
    "simulated", "max_abs_error", 1e-4,
    "route_scale x logit error (2.5 x 3e-5) + fp32 rounding; real bugs move weights by > 1e-2",
)

# Logits of +-30 built exactly (one-hot x): only exp, log1p, sqrt, the sum and the division differ between
# implementations, each within ~2 fp32 ulps: < 16 ulps = 1e-6 relative. 10x headroom. A score that
# underflows to 0 at l = -30 (log(1 + exp(l)) in fp32) is a relative error of 1.
ROUTE_EXTREME_WEIGHTS = Bound(
    "simulated", "max_rel_error", 1e-5,
    "exact logits: elementwise math only (< 16 fp32 ulps); an underflowed score is 1.0",
)

# Experts and the whole layer against the reference with the same numerics. Differences: fp32 summation
# order (including the H200's FP8 accumulator, ~14 bits per 128-K block before fp32 promotion, spec §7.1
# pitfall 8), which can flip the bf16 rounding of a gate/up value (one bf16 ulp) and then, on about 1 in 32
# such elements, the FP8 rounding of the SwiGLU output (one FP8 step, 1/16..1/8 of the value) — rare
# elements, so calc_diff and not bitwise. Modelled by perturbing every linear output by relative noise of
# 2^-14 (the accumulator), at D 1024, I 512, T 256: calc_diff 6.0e-6..6.5e-6; pure fp32 reordering
# (fp64 accumulation) gives 1e-10. The bound keeps 3x over the accumulator model and stays under what real
# mistakes cost (measured): gate/up not rounded to bf16 9.3e-5, no SwiGLU clamp 1.3e-4, routing weight
# applied after the down projection 7.2e-4. (Per-32 vs per-128 activation scales differ by 3e-9 on
# Gaussian data: E4M3 is floating point, the block scale rarely matters, so no calc_diff can see it.)
MOE_SIMULATED = Bound(
    "simulated", "calc_diff", 2e-5,
    "accumulator-noise model 6.5e-6 x 3; missing bf16 gate/up rounding 9e-5, missing clamp 1.3e-4",
)

# MOE_SIMULATED at few tokens. That calc_diff is an average over rare events: about 1 in 2048 of the SwiGLU
# output's T x k x I elements flips an FP8 rounding (the accumulator error, 2^-14 relative, flips 1 in 64 bf16
# roundings of gate/up, and 1 in 32 of those cross an FP8 rounding boundary). At T = 1 on FLASH that is
# 6 x 2048 / 2048 ~ 6 flips, and a Poisson count of mean n exceeds it by 4 standard deviations, a relative
# 4 / sqrt(n), about once in 10^4 cases. The bound is MOE_SIMULATED x (1 + 4 / sqrt(n)): 5.3e-5 at FLASH T = 1,
# 3.2e-5 at T = 8, within 20 % of MOE_SIMULATED from T = 64 (H200, deepgemm, hash layers: 3.0e-5 at T = 1, 2.0e-5
# at T = 8). It stays under the lightest mistake measured (gate/up not rounded to bf16, 9.3e-5).
SWIGLU_FLIP_RATE = 1 / 2048


def moe_simulated(swiglu_elements: int) -> Bound:
    """MOE_SIMULATED widened for the count of SwiGLU output elements (T x k x I) the comparison averages over."""
    n = max(swiglu_elements * SWIGLU_FLIP_RATE, 1.0)
    factor = 1 + 4 / n**0.5
    return Bound("simulated", "calc_diff", MOE_SIMULATED.value * factor,
                 f"MOE_SIMULATED x (1 + 4/sqrt({n:.0f})): ~{n:.0f} FP8 flips expected, Poisson spread")


# Experts and the whole layer against the EXACT reference (fp32 activations, the same FP8/FP4 weights).
# Three E4M3 roundings sit in series: x before w1 and w3, and the SwiGLU output before w2. One rounding of
# Gaussian-like data costs calc_diff 3.5e-4 (relative error variance 2^-8 / 3 * E[1/m^2] = 7.0e-4 for
# mantissas m log-uniform in [1, 2), halved by calc_diff; measured 3.53e-4), and the x rounding reaches the
# output through both g and u of silu(g) * u: expected ~3 x 3.5e-4 = 1.05e-3; measured mean 1.10e-3 (TINY
# T = 33 and D 1024 T = 128, FP8 and FP4 experts, official and MegaMoE numerics: 1.03e-3..1.18e-3).
# DeepGEMM's 1e-3 for one FP8 GEMM covers two roundings in parallel, not three in series. calc_diff over few
# elements fluctuates around that mean: a single TINY token (256 values) ranged 0.53e-3..1.97e-3 over 800
# draws (99th percentile 1.74e-3); FLASH/PRO tokens have 16-28x the values, so 1/4..1/5 the spread. 2.5e-3
# covers the single-token tail; a wrong expert, scale or clamp costs > 1e-2.
MOE_END_TO_END = Bound(
    "end_to_end", "calc_diff", 2.5e-3,
    "three E4M3 roundings in series (3 x 3.5e-4; mean 1.1e-3) plus the spread of a single 256-value token",
)

# `reference.moe.sqrt_softplus` below l = -20 is e^(l/2): torch's fp32 exp is faithful (< 1 ulp), l/2 is exact,
# and softplus(l) = e^l there up to 2^-29 relative, far under half an ulp: at most 1 ulp from the fp64 truth.
SQRT_SOFTPLUS_ULPS = Bound(
    "simulated", "ulp_distance vs fp64", 1, "faithful fp32 exp of an exact argument; the e^l tail error is < 2^-29",
)


# ------------------------------------------------------------------------------------------------
# Attention reference self-checks (parity_tests/test_attention_reference.py)
# ------------------------------------------------------------------------------------------------

# `sparse_attention` rounds the probabilities to bf16 before P V (official kernel) and its output to bf16; a
# plain fp32 softmax with the sink as one more logit does neither. The output rounding alone is calc_diff
# ~1.4e-6 (see FP8_GEMM_SIMULATED); rounding P adds a relative error <= 2^-9 per weight that averages down over
# the keys: measured 2.1e-6..2.3e-6 in total (40 keys, 4 heads, sink share 12-28 %, five seeds). 4x headroom.
# A missing sink, or one scaled by 512^-0.5, costs 8e-3..5e-2 on the same inputs.
ATTENTION_UNROUNDED_P = Bound(
    "simulated", "calc_diff", 1e-5,
    "bf16 P and bf16 output vs an fp32 softmax: measured 2.2e-6; a missing or scaled sink costs > 8e-3",
)


# ------------------------------------------------------------------------------------------------
# Sharded parity (reference/sharding.py, parity_tests/distributed.py, parity_tests/test_sharding.py)
# ------------------------------------------------------------------------------------------------

# Attention under tensor parallelism: each rank's `wo_b` output is rounded to bf16 before the fp32 all-reduce
# (official `RowParallelLinear`), so the sharded output carries W partial roundings plus the final one, the
# unsharded output one rounding. A bf16 rounding of Gaussian-like data has mean-square relative error
# rho = 2^-14 / 12 * E[1/m^2] = 2.5e-6 (mantissa m log-uniform in [1, 2)), and calc_diff ~ |d|^2 / (2 |y|^2).
# The partials of a row-parallel product over disjoint input columns with independent weights are
# uncorrelated, so sum_r |p_r|^2 ~ |y|^2 whatever W is, and E|d|^2 ~ rho (|y|^2 [the W partials] + |y|^2 [the
# sharded final rounding] + |y|^2 [the unsharded one]): calc_diff ~ 3 rho / 2 = 3.8e-6, independent of W and
# D. Measured (TINY, SWA/CSA/HCA layers, official and vLLM numerics, W = 2 and 4, prefill steps and decode
# steps of 2 tokens, 24 seeds): 3.3e-6..4.9e-6. The same model covers an MoE whose per-rank outputs are bf16
# (the optimized `experts`, like MegaMoE and DeepEP, returns bf16): measured 0.6e-6..2.6e-6. 2x headroom over
# the largest measurement. A missing or duplicated rank costs ~1 / (2W) (> 6e-2 at W = 8); heads paired with
# another rank's groups cost ~1.
SHARDED_BF16_PARTIALS = Bound(
    "simulated", "calc_diff", 1e-5,
    "W bf16-rounded partials + 1 final rounding vs 1 rounding: 3 rho / 2 = 3.8e-6 (measured <= 4.9e-6)",
)

# MoE under expert parallelism, official numerics: each rank's partial is the fp32 sum of its experts' bf16
# outputs, the shared expert is added after the all-reduce, one bf16 rounding at the end; against the
# unsharded layer only the fp32 association of the <= k + 1 terms of a token differs. Sums of a few bf16
# values (8 significant bits) are exact in fp32 (24 bits) unless their magnitudes span more than ~2^15, so
# the results are usually bitwise equal (measured: 0 differing elements of 16384 per case, TINY, hash and
# top-k layers, FP8 and MXFP4 experts, W = 2..16). Where a sum is inexact it moves by <= k 2^-24 of the terms'
# magnitude and flips the final bf16 rounding (one bf16 ulp, relative <= 2^-7) with probability
# <= k 2^-24 / 2^-8 = 1e-4: calc_diff <= 1e-4 x 2^-14 / 2 = 3e-9. 30x headroom; bf16-rounded partials
# (the numerics of SHARDED_BF16_PARTIALS, measured >= 6e-7) fail it, and so does any missing expert (~1e-2).
SHARDED_FP32_PARTIALS = Bound(
    "simulated", "calc_diff", 1e-7,
    "fp32 reassociation of <= k+1 bf16 terms: rare one-ulp flips, <= 3e-9; bf16 partials cost >= 6e-7",
)


def sharded_bound(op_bound: Bound, reduction: Bound) -> Bound:
    """The bound of a sharded backend's reduced output against the unsharded reference: the backend's own
    bound for its op (its kernels against the reference, per shard) plus the reduction's. Both are calc_diff
    ~ |d|^2 / (2 |y|^2), and the kernel's error and the reduction's roundings are independent, so their
    squared norms (hence their calc_diffs) add."""
    for b in (op_bound, reduction):
        if b.metric != "calc_diff":
            raise ValueError(f"sharded_bound: both bounds must be on calc_diff, got {b.metric!r}")
    return Bound(op_bound.tier, "calc_diff", op_bound.value + reduction.value,
                 f"{op_bound.reason} + sharded reduction ({reduction.reason})")


# ------------------------------------------------------------------------------------------------
# Output projection (spec §3.6, §4; parity_tests/ops/einsum.py). fp8_einsum and fp8_linear use
# FP8_GEMM_SIMULATED and FP8_END_TO_END above: one FP8 GEMM each, on the same quantized inputs resp. with
# two E4M3 roundings in parallel (DeepGEMM's own bounds).
# ------------------------------------------------------------------------------------------------

# o -> quantize -> FP8 einsum -> bf16 z -> quantize -> wo_b against the reference with the same numerics.
# Summation-order noise in z (the H200's FP8 accumulator: ~2^-14 relative per 128-K block, spec §7.1
# pitfall 8) flips some bf16 roundings of z, and about 1 in 16 of those flips the E4M3 rounding of z in
# front of wo_b — one FP8 step, 1/16..1/8 of the value — so the output differs on rare elements by far more
# than a bf16 ulp: calc_diff, not bitwise. Modelled by 2^-14 relative Gaussian noise on z (TINY T 33 / 256,
# FLASH T 64, both formats): 2.2e-6..6.0e-6, plus the wo_b output rounding (1.4e-6, FP8_GEMM_SIMULATED):
# <= 7.5e-6; 2.7x headroom. Real mistakes cost (measured, same shapes): inverse RoPE rounded to bf16
# before the quantization (the official path) 1.4e-4..1.7e-4, z kept fp32 into the wo_b quantization
# 1.3e-4..1.6e-4, forward instead of inverse RoPE 0.12.
OUTPUT_PROJECTION_SIMULATED = Bound(
    "simulated", "calc_diff", 2e-5,
    "FP8 requantization of z after accumulator noise: model <= 7.5e-6; bf16-rounded inverse RoPE costs 1.4e-4",
)


# ------------------------------------------------------------------------------------------------
# Attention kernels (optimized/attention.py, optimized/triton/*; parity_tests/ops/attention.py)
# ------------------------------------------------------------------------------------------------

# Sparse attention against the reference on the same q, KV rows, indices and sinks. Both round P to bf16
# before P V and the output to bf16; the kernel's online softmax rounds each P relative to the running maximum
# of its tile sequence instead of the row's global maximum, so the two bf16 roundings of a probability are
# independent errors of <= 2^-9 relative, as are the two output roundings. Each side's rounding costs ~2.2e-6
# against unrounded math (ATTENTION_UNROUNDED_P); measured kernel vs reference at 64 heads x 640 candidates
# with the H200 tiling (16 rows per step): 2.0e-6..2.1e-6 (one 128-row tile: 1.7e-6..1.9e-6). 5x headroom;
# a missing or scaled sink costs > 8e-3, a dropped or repeated row ~1/K of a token's output.
SPARSE_ATTENTION_SIMULATED = Bound(
    "simulated", "calc_diff", 1e-5,
    "independent bf16 roundings of P and of the output: measured 2.1e-6; a missing sink costs > 8e-3",
)

# FlashAttention's rule: the kernel's max error against the formula with unrounded probabilities (fp64) is at
# most TORCH_RELATIVE_FACTOR x the reference's (which rounds P to bf16 as the official kernel does).
# Measured ratio 0.90..1.19.
SPARSE_ATTENTION_TORCH_RELATIVE = Bound(
    "torch_relative", "max error / reference's max error", TORCH_RELATIVE_FACTOR,
    "FlashAttention: at most 2x the error of the same-precision PyTorch run (measured <= 1.19)",
)

# Indexer scores in fp32 (vLLM numerics): each score is sum_h w_h relu(q_h . k) with 128-term dots of exact
# bf16 products; implementations differ only in fp32 summation order, ~sqrt(128) 2^-24 = 7e-7 relative per dot
# and less over the head sum: calc_diff ~1e-13 (measured 1e-16 at TINY). A kernel that rounds to bf16 costs
# ~1e-6, an FP8 quantization of q or k ~1e-4.
INDEXER_SCORES_FP32 = Bound(
    "simulated", "calc_diff", 1e-10,
    "fp32 summation order only (~1e-13); bf16 rounding costs 1e-6, FP8 inputs 1e-4",
)

# Official bf16 scores: the dot, each weighted term and the head sum round to bf16. A term's product
# relu(bf16 s) x bf16 w is exact in fp32, and a sum of bf16 terms in fp32 is exact unless they span more than 16
# binades, so only a dot whose fp32 value moves by its summation order (~2^-24 relative) across a bf16 rounding
# boundary (probability ~2^-16 per dot) changes a term by one bf16 ulp, which moves the final rounding with
# probability ~2^-6: ~1e-6 of the scores by one bf16 ulp (2^-8): calc_diff ~1e-11 (measured 0 at TINY). 1e-7
# stays below what skipping the intermediate bf16 roundings costs (~1e-6).
INDEXER_SCORES_BF16 = Bound(
    "simulated", "calc_diff", 1e-7,
    "rare one-ulp flips of a bf16 dot (~1e-11); skipping the official bf16 roundings costs ~1e-6",
)

# Top-k sets of each side's own scores. A token's sets may differ only by entries whose reference scores lie
# within the row's measured score error (max |s_candidate - s_reference| over its visible entries, counted for
# both entries of a swap) of the reference's k-th largest score: a swap the score differences explain (spec
# §7.1 pitfall 5). Exact ties go to the lower entry index on every backend. On identical scores: BITWISE sets.
SELECTION_NEAR_TIES = Bound(
    "simulated", "tokens whose sets differ beyond near ties", 0,
    "only swaps the measured score error explains; ties -> lower index everywhere",
)

# The compressor on the same tokens: the projection GEMM's fp32 summation order (~1e-7 relative) moves the
# pooled entry, whose bf16 rounding (official), norm and RoPE then flip a bf16 rounding with probability
# ~1e-7 / 2^-9 = 5e-5 per element, and 1 in 16 of those flips an FP8 step (2^-4) — or 1 in 64 an FP4 step
# (2^-2 relative) in the indexer's keys: calc_diff ~5e-5 x 2^-6 x 2^-4 / 2 < 1e-8 (measured 0 at TINY). 1e-5 is
# the ceiling of such rare flips; a wrong ape row, slot or overlap half costs > 1e-2.
COMPRESS_SIMULATED = Bound(
    "simulated", "calc_diff", 1e-5,
    "rare FP8/FP4 rounding flips after fp32 GEMM reordering (< 1e-8); wrong slots or ape cost > 1e-2",
)

# The indexer's compressor adds a Hadamard rotation before its FP4 simulation. On a GPU the rotation is a 128-term
# bf16 dot with fp32 accumulation in the MMA's order (the reference sums in fp64) and `tl.exp` in the pooling is
# the approximate ex2 (a few fp32 ulps). Each rotated value is rounded to bf16, so an fp32 difference of ~128 x
# 2^-24 relative flips that rounding with probability ~2^-8 per element; a one-ulp (2^-8) move then crosses an
# E2M1 rounding midpoint (spacing ~2^-1.5 relative) with probability ~2^-6.5, i.e. ~4e-5 of the elements move by
# a full FP4 step (~0.35 relative): calc_diff ~ 4e-5 x 0.35^2 / 2 ~ 2.5e-6, and the occasional flip of a block's
# amax moves its whole 32-block scale (x4 in the worst case). Measured on the H200 at FLASH T=8192: 1.1e-5
# (the CPU interpreter rounds like the reference: 0). 5e-5 = 20x the typical term, 4.5x the measurement; a
# wrong ape row, slot, overlap half or a missing Hadamard costs > 1e-2.
COMPRESS_INDEXER_SIMULATED = Bound(
    "simulated", "calc_diff", 5e-5,
    "GPU Hadamard dot order flips ~2^-8 of bf16 roundings, ~4e-5 of FP4 steps (H200: 1.1e-5); mistakes > 1e-2",
)

# Projections (q, c_q, kv, index queries, head weights) against the reference with the same numerics. The FP8
# linears differ by summation order (FP8_GEMM_SIMULATED: some outputs one bf16 ulp apart, up to ~30 % of them
# under the H200's FP8 accumulator); where a quantization simulation follows, 1 in 16 of those flip an FP8
# rounding of the KV NoPE dims (one step, 2^-4 relative): 0.3 x 1/16 x 2^-8 / 2 = 3.7e-5, and 1 in 64 flip an
# FP4 rounding of the index queries (2^-2 relative): 0.3 x 1/64 x 2^-4 / 2 x 1/3 = 5e-5. 2e-4 covers both with
# 4x headroom (measured 0 on the CPU, where both sides' GEMMs round the same way). The fused kernel alone is
# compared bitwise on identical inputs (test_attention.py), which is what catches a missing quantization step.
PROJECTION_SIMULATED = Bound(
    "simulated", "calc_diff", 2e-4,
    "GEMM-order ulp flips amplified by the FP8 (3.7e-5) / FP4 (5e-5) simulations after them",
)

# The whole layer against the reference with the same numerics, computed on the layer's own top-k selection
# (CSA: the selections are compared separately, SELECTION_NEAR_TIES). The error is a cascade of FP8
# requantizations. (1) The attention output o differs from the reference's by bf16 roundings (~30 % of its
# elements one ulp apart, SPARSE_ATTENTION_SIMULATED); quantizing o to FP8 (relative step r ~ 2^-3.5 on average)
# flips a rounding where a one-ulp (2^-8) difference crosses a rounding boundary, p ~ 2^-8 / r ~ 2^-4.5, each flip
# a relative error ~r: calc_diff e1 ~ 0.3 x p x r^2 / 2 ~ 5e-5 (the q / kv projections add < 1e-5). (2) After
# wo_a every z element carries the mixed error, relative eps = sqrt(2 e1) ~ 1e-2, far above a bf16 ulp, so z's
# FP8 requantization flips with p ~ eps / r on every element: e2 ~ eps x r / 2 ~ 4.4e-4. Total ~5e-4, as
# measured at FLASH on the H100 (prefill SWA / HCA / CSA 4.9e-4..5.2e-4; TINY on the CPU, where both sides
# round alike, 1.4e-5..1.0e-4). The bound allows e1 up to 2x its estimate (1e-4: e2 = 6.2e-4, total 7.2e-4)
# and rounds up to 1e-3. It stays below the lightest real mistake measured: the KV NoPE dims without the FP8
# simulation (1.6e-3 at TINY); a missing sink costs 3.4e-2, a wrong selection ~1e-2.
ATTENTION_LAYER_SIMULATED = Bound(
    "simulated", "calc_diff", 1e-3,
    "cascade of two FP8 requantizations (o, then z) of bf16-level differences: ~5e-4 derived and measured",
)
