"""Triton grouped block-FP8 GEMMs of the MoE experts, with the SwiGLU + routing weight + FP8 quantization
epilogue fused into the gate/up GEMM (spec §2.5, §5.2).

`grouped_gemm` runs on the expert-sorted rows of `moe_permute.permute` (or, ungrouped, on the tokens
themselves: the shared expert). One program = one BLOCK_M x BLOCK_N output tile of one expert; a row block's
column tiles are launched one after another (`GemmConfig.n_fastest`), so that its A rows are read from DRAM once
and the expert's weight tiles are read by its row blocks at about the same time:

    for each K block:  partial = dot(A tile, W tile^T)   (FP8 x FP8 -> fp32)
                       acc += partial * sa[row, kb] * sw[n // 128, k // 128]     (spec §2.5 promotion)

with the K block = the activation quantization block (128 official, 32 MegaMoE numerics: each
32-wide sub-block has its own activation scale, so it gets its own dot; spec-exact, not an
approximation). With `numerics.act_quant` off (EXACT) the A operand is bf16 and the weight's FP8 values
are converted to bf16 (exactly) for a bf16 dot: every product is exact in fp32, and the weight scale
multiplies the fp32 partial sum, which is the reference's fp32 matmul with the dequantized weight up to
the summation order.

Gate/up GEMM (`swiglu=True`): each program computes the gate tile (w13 rows n) and the up tile (rows
I + n) from the same A tile, then in registers (official order, `reference.moe.expert_forward`):
gate/up -> bf16 (`gate_up_bf16`), g = min(gate, L), u = clamp(up, -L, L), a = silu(g) * u (fp32),
a *= routing weight, a -> bf16, per-`act_block` UE8M0 FP8 quantization -> the down GEMM's A operand and
its scales, written directly. Down GEMM (`swiglu=False`): bf16 output rows.

Split-K (`GemmConfig.split_k`, chosen by `split_k_for`: the decode shared expert, whose 16 gate/up tiles would
leave most SMs idle): program (m, n, s) runs the s-th of the equal K slices and stores its fp32 partial sums; the
tile's last program to arrive (an acquire-release counter, `_arrive`) adds the slices in slice order and runs the
epilogue above. No program waits for another, and the order of the sum is fixed: run to run bitwise. Against the
whole K loop only the fp32 sum is regrouped (slice sums, then their sum).

`swiglu_quant` is the same epilogue as a kernel of its own, for DeepGEMM's grouped GEMMs (which write
gate/up as bf16): it reads gate/up rows, writes FP8 rows and scales in DeepGEMM's MN-major layout.

Rounding: FP8 values go through `round_to_fp8_grid` before the cast (the CPU interpreter would truncate);
bf16 casts round to nearest even on GPUs and, through `prepare_interpreter`, in the interpreter.
NaN: Triton's min/max drop NaN on GPUs, so the clamps propagate it explicitly, and a quantization block
holding a NaN gets a NaN scale (its values are then NaN after dequantization, as in the reference,
where the NaN stays in the FP8 value): a NaN token stays NaN through both GEMMs and no other row sees it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from optimized.triton._fp8 import (
    fp8_constants,
    pow2_reciprocal,
    prepare_interpreter,
    round_to_fp8_grid,
    ue8m0_scale,
)
from optimized.triton._pdl import pdl_launch, pdl_wait
from optimized.triton.aot import ALL_TARGETS, PLATFORM_TARGETS, AotSpec
from optimized.triton.einsum import tma_loads
from optimized.triton.moe_permute import MoeLayout
from reference.formats import ACT_EPS, FP8Format, fp8_format
from reference.weights import FP8_WEIGHT_BLOCK

WEIGHT_BLOCK = tl.constexpr(FP8_WEIGHT_BLOCK)  # weight scales: one per 128 x 128 tile
EPS = tl.constexpr(ACT_EPS)  # amax floor of the activation quantization (official act_quant)
# swiglu_quant tiles: slots x 128 channels (one quantization block).
SWIGLU_BLOCK_S = 16
# The decode tile height (`choose_config`: rows per expert <= 16; the smallest `tl.dot` M), the only tiles
# `split_k_for` splits.
DECODE_BLOCK_M = 16


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one grouped GEMM launch (BLOCK_M is also the permute alignment)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    swap_ab: bool = False  # the weight tile on the MMA's M side (`_block_dot`)
    # launch order: a row block's column tiles one after another (its A rows then come from L2 for all but the first;
    # design note 30), else each column tile's row blocks
    n_fastest: bool = True
    # tiled weights through a TMA descriptor (NVIDIA sm_90+; a tile inside one 128-row block, not a stacked swap-AB
    # tile; `grouped_gemm` falls back to pointer loads elsewhere)
    tma: bool = False


def choose_config(rows_per_expert: float, n_out: int, swiglu: bool, interpret: bool = False,
                  platform: str = "nvidia", tiled: bool = False) -> GemmConfig:
    """Tiles by the mean number of rows an active expert gets (BLOCK_M is the same for both GEMMs of a call).

    | rows / expert | GEMM    | BLOCK_M | BLOCK_N | warps     | stages    | why                                   |
    |---------------|---------|---------|---------|-----------|-----------|---------------------------------------|
    | <= 16         | gate/up | 16      | 128     | 8 (4)     | 4 (2)     | decode: smallest dot tile; the weight |
    |               | down    | 16      | 64      | 4         | 3         | stream is the cost; NVIDIA: swap-AB   |
    | > 16          | gate/up | 64      | 128     | 8, 4* (8) | 4, 2* (2) | compute-bound; 64 rows pad less per   |
    |               | down    | 64      | 128     | 4 (8)     | 3, 4* (2) | expert than 128 (E x 32 rows on avg.) |

    (bracketed: AMD; *: tiled weights on NVIDIA.)

    `tiled`: the weights are tiled (`optimized.moe.tile_experts`); NVIDIA's prefill tiles then read them through TMA
    descriptors (`GemmConfig.tma`: one box per 128 x 128 block and K step instead of every thread's pointer loads),
    the down GEMM takes 4 stages and the gate/up GEMM 4 warps in 2 stages (*). Every figure here is an H100 same-run
    A/B of the FLASH routed MoE, bitwise equal. TMA with the down GEMM in 4 stages (design note 30,
    `docs/h200/ab-moe-prefill-tma-h100.json`, two rounds): T = 4096 3209 / 3377 -> 3161 / 3165 us, T = 8192 5487 /
    5579 -> 5400 / 5469 us; in 3 stages it was not faster in both rounds. Gate/up in 4 warps and 2 stages (design
    note 31, `ab-moe-gate-up-warps-h100.json`, `ab-moe-gate-up-down-stages-h100.json`, six rounds): 82 KB of shared
    memory and 238 registers a thread, so two programs share an SM and one's promotion overlaps the other's wgmma;
    T = 4096 2.3-4.0 % faster in every round, T = 8192 faster in 4 of 6.

    The gate/up GEMM keeps BLOCK_N = 128: its epilogue quantizes whole 128-wide blocks, and it holds two
    accumulators (gate and up), which is why its tiles stop at 64 x 128 per 8 warps; narrower tiles finish their
    blocks through arrival counters (`PARTS`), which NVIDIA's routed grids under one wave take
    (`narrow_gate_up_for`). Decode gate/up on NVIDIA: 8 warps and 4 stages keep more of the weight stream in flight
    (H200 sweep, `python -m benchmarks.sweep_moe`, docs/h200/sweep-moe.json: FLASH T = 1 34 us against 57 with 4
    warps and 2 stages); those 4 stages take
    104 KB of shared memory, over gfx942's 64 KB LDS, so AMD keeps the bracketed 4 warps and 2 stages. Prefill on
    NVIDIA: 4 stages for gate/up and 4 warps with 3 stages for down took the Triton experts at FLASH T = 4096 from
    4670 to 3222 us and at T = 8192 from 7732 to 5305 us (H200, same-run A/B of six tile pairs, outputs bitwise
    equal: `docs/h200/ab-moe-prefill-tiles.json`); AMD keeps the bracketed tiles there (not measured: no ROCm GPU
    here). Decode down on NVIDIA swaps A and B (`swap_ab`, `_block_dot`: the 64 weight rows on wgmma's M side, native
    FP8 wgmma instead of Triton's mma.sync path with its f16 conversions); H200, same-run A/B, routed MoE, two rounds
    each (`docs/h200/ab-moe-swap-ab.json`, `ab-moe-swap-down-tiles.json`): T = 1 62.4 -> 60.2 us and 61.5 -> 60.3 us,
    T = 8 268.5 -> 267.2 us, T = 64 975.2 -> 972.9 us; outputs within calc_diff 1e-6 of the mma.sync ones (wgmma sums
    a block's products in another order). Swapping the gate/up GEMM as well was slower from T = 8 on (T = 8 268.5 ->
    284.5 us: its two 128-row weight tiles take 139 KB of shared memory in 4 stages); for the swapped down GEMM, 4
    stages gave T = 1 59.8 against 60.3 us but T = 8 269.2 against 267.6, and 2 stages or 128-column tiles were
    slower. Every
    config compiles without spills within its targets' LDS and registers (the AOT check). On the CPU
    interpreter, where each program costs the same few hundred numpy calls whatever its size, the tiles
    are as large as the shape allows: the arithmetic is the same, with fewer programs.
    """
    if interpret:
        return GemmConfig(64 if rows_per_expert <= 64 else 128, min(n_out, 256), 4, 1)
    if rows_per_expert <= DECODE_BLOCK_M:
        if not swiglu:
            return GemmConfig(DECODE_BLOCK_M, 64, 4, 3, swap_ab=platform == "nvidia")
        return GemmConfig(DECODE_BLOCK_M, 128, 8, 4) if platform == "nvidia" else GemmConfig(DECODE_BLOCK_M, 128, 4, 2)
    if platform != "nvidia":
        return GemmConfig(64, 128, 8, 2)
    if tiled:
        return GemmConfig(64, 128, 4, 2, tma=True) if swiglu else GemmConfig(64, 128, 4, 4, tma=True)
    return GemmConfig(64, 128, 8, 4) if swiglu else GemmConfig(64, 128, 4, 3)


def block_parts(config: GemmConfig, act_block: int) -> int:
    """Gate/up tiles that share each `act_block`-wide quantization block of the FP8 output (`PARTS`): 1 when a tile
    holds whole blocks, else act_block / BLOCK_N (the last of them to arrive quantizes the block)."""
    return act_block // config.block_n if config.block_n < act_block else 1


# Narrow decode gate/up tiles (`narrow_gate_up_for`): 32 columns, 4 warps, 4 stages; a quarter of a quantization block.
NARROW_GATE_UP_BLOCK_N = 32


def narrow_gate_up_for(config: GemmConfig, n_rows: int, n_out: int, act_block: int, sms: int,
                       platform: str = "nvidia") -> GemmConfig:
    """`config` (a gate/up tile) with 32 columns instead of 128 where the 128-column decode grid leaves SMs idle.

    At FLASH T = 1 the routed gate/up GEMM has 96 tiles of 128 columns (6 experts x 16) on 132 SMs, each streaming
    1 MB of weights at what one program can keep in flight (design note 23). 32-column tiles (4 warps, 4 stages) run
    384 programs over the same bytes; the SwiGLU output's 128-wide quantization blocks are then finished by the last
    of each block's 4 tiles to arrive (`PARTS`: the same values and scales, so the same bits as 128-column tiles).
    Only for NVIDIA decode tiles (BLOCK_M = 16) whose 128-column grid has fewer tiles than the GPU has SMs, with
    128-wide activation blocks (official numerics; MegaMoE's 32-wide and EXACT's bf16 outputs were not measured).
    Same-run A/B on an H100 (the machine this session got; design note 28), routed MoE (`route` + `experts`), FLASH,
    tiled experts stored K-block-major, four rounds (`docs/h200/ab-moe-narrow-gate-up-sweep-h100.json`): T = 1 73.54
    -> 72.67 us (64-column tiles 73.36, 32 columns in 3 stages or 2 warps slower); at T = 8 and 64, which this rule
    leaves at 128 columns (768 tiles and more), 32-column tiles were 0.7 % faster and 1.1 % slower (N-block-major).
    """
    if (config.block_m != DECODE_BLOCK_M or platform != "nvidia" or act_block != FP8_WEIGHT_BLOCK
            or config.block_n != FP8_WEIGHT_BLOCK or config.split_k != 1):
        return config
    if -(-n_rows // config.block_m) * (n_out // config.block_n) >= sms:
        return config
    return dataclasses.replace(config, block_n=NARROW_GATE_UP_BLOCK_N, num_warps=4, num_stages=4)


# Split-K (`split_k_for`): programs per SM a split grid may fill, by GEMM (H200 occupancy: the decode gate/up tile,
# 8 warps and 104 KB of shared memory, runs one per SM; the 4-warp down tile, 20 KB, several).
SPLIT_PROGRAMS_PER_SM = {"gate_up": 1, "down": 2}
# A slice keeps at least this many 128-wide K blocks (the pipeline's stages need a few iterations to fill).
MIN_K_BLOCKS_PER_SPLIT = 4


def split_k_for(config: GemmConfig, n_rows: int, n_out: int, k: int, sms: int, swiglu: bool,
                platform: str = "nvidia") -> GemmConfig:
    """`config` with the K split that fills the GPU: for the decode tiles (BLOCK_M = 16), the largest power of two
    whose programs (output tiles x split) stay within `SPLIT_PROGRAMS_PER_SM` per SM, with at least
    `MIN_K_BLOCKS_PER_SPLIT` K blocks per slice.

    What splits is the decode shared expert (FLASH, T <= 16: one row block, 16 gate/up tiles of 128 columns and 64
    down tiles, each streaming a whole K): 8 and 4 slices. H200, same run, against whole-K launches, CUDA-graph
    replays (`docs/h200/ab-moe-split-k-rule.json`): the shared expert 40.4 -> 22.9 us at T = 1 and 8, 40.0 -> 23.2
    us at T = 16; the whole MoE 107.3 -> 90.9 us (T = 1), 351.9 -> 329.8 us (T = 8), 543.7 -> 527.5 us (T = 16).
    The routed decode grids stay whole (96 gate/up tiles at T = 1 are most of the SMs already; a split measured
    slower there: 71.0 -> 74.4 us, `ab-moe-split-k-2.json`), and so do the 64-row tiles (shared expert at T = 64:
    8 and 4 slices 43.5 -> 44.7 us). AMD keeps full-K (not measured: no ROCm GPU here).
    """
    if config.block_m != DECODE_BLOCK_M or platform != "nvidia":
        return config
    if swiglu and config.block_n < FP8_WEIGHT_BLOCK:
        return config  # a narrow gate/up tile (`narrow_gate_up_for`) finishes its quantization blocks through counters
    n_tiles = -(-n_rows // config.block_m) * (n_out // config.block_n)
    budget = sms * SPLIT_PROGRAMS_PER_SM["gate_up" if swiglu else "down"]
    k_blocks = k // FP8_WEIGHT_BLOCK
    split = 1
    while (n_tiles * split * 2 <= budget and k_blocks % (split * 2) == 0
           and k_blocks // (split * 2) >= MIN_K_BLOCKS_PER_SPLIT):
        split *= 2
    return dataclasses.replace(config, split_k=split)


@triton.jit
def _bf16(x):
    """fp32 -> bf16 -> fp32: the official bf16 rounding points (ties to even)."""
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _swiglu(gate, up, limit, weight, GATE_UP_BF16: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """`silu(min(gate, L)) * clamp(up, -L, L)` (* weight) in fp32 (spec §5.2; `reference.moe.swiglu`).

    gate, up: [M, N] fp32; weight: [M] fp32 (HAS_WEIGHT); limit: L (+inf = no clamp).
    """
    if GATE_UP_BF16:
        gate = _bf16(gate)
        up = _bf16(up)
    g = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    a = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    if HAS_WEIGHT:
        a = a * weight[:, None]
    return a


@triton.jit
def _quantize_rows(
    a, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT_BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr,
):
    """Per-row, per-ACT_BLOCK UE8M0 FP8 quantization of a [BLOCK_M, BLOCK_N] fp32 tile (spec §2.3).

    Returns the FP8 values (on the grid, fp32) and the [BLOCK_M, BLOCK_N / ACT_BLOCK] scales (NaN for a
    block that holds a NaN).
    """
    blocks = tl.reshape(a, [BLOCK_M, BLOCK_N // ACT_BLOCK, ACT_BLOCK])
    amax = tl.max(tl.abs(blocks), axis=2)
    has_nan = tl.max((blocks != blocks).to(tl.int32), axis=2) > 0
    scale = ue8m0_scale(amax, FP8_MAX, EPS)
    q = round_to_fp8_grid(blocks * pow2_reciprocal(scale)[:, :, None], FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO)
    return tl.reshape(q, [BLOCK_M, BLOCK_N]), tl.where(has_nan, float("nan"), scale)


@triton.jit
def _arrive(counter_ptr):
    """Count this program in at its tile's counter, once all its threads have stored their partial sums; returns
    the count before it (the last of S programs gets S - 1).

    The pattern of CUTLASS's split-K semaphore: a CTA barrier, then one thread's atomic with release semantics at
    GPU scope (Triton runs a scalar atomic in one thread and broadcasts the result), so every store of the program
    is visible to the program that acquires the count; acquire makes the other programs' stores visible to this one.
    """
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _sum_slices(ptrs, valid, slice_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """The sum of a tile's SPLIT_K fp32 partial sums, in slice order (the same order whichever program adds them,
    so the result does not depend on which slice finished last). Loads bypass L1 (`.cg`): L1 is not coherent
    with the other SMs' stores."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ptrs + s * slice_stride, mask=valid[:, None], other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _block_dot(a, w, sa, sw, A_FP8: tl.constexpr, SWAP_AB: tl.constexpr, SCALAR_SW: tl.constexpr):
    """One K block's partial sum, promoted (spec §2.5): `dot(a, w) * sa[row] * sw[col]` in fp32.

    a: [M, BLOCK_K] FP8 (scales sa [M]) or bf16 (EXACT: no activation scale; w's FP8 values are exact in bf16);
    w: [BLOCK_K, N] FP8, sw [N], or one scalar where the tile's columns lie in one 128-row weight block
    (`SCALAR_SW`): the two scales are then multiplied per row first and the promotion is one fused multiply-add
    per element, the same bits (both scales are powers of two, so `(dot * sa) * sw == dot * (sa * sw)`).
    SWAP_AB returns the same products transposed, [N, M], from `dot(w^T, a^T)`: the weight rows on the MMA's M
    side, so that a 16-row decode tile runs Hopper's native FP8 wgmma (M >= 64) instead of Triton's mma.sync path,
    which converts every FP8 operand to f16 on sm_90 (`choose_config`, design note 25).
    """
    if not A_FP8:
        w = w.to(tl.bfloat16)
    if SWAP_AB:
        part = tl.dot(tl.trans(w), tl.trans(a))
    else:
        part = tl.dot(a, w)
    if SCALAR_SW and not A_FP8:
        part = part * sw
    elif SCALAR_SW and SWAP_AB:
        part = part * (sa * sw)[None, :]
    elif SCALAR_SW:
        part = part * (sa * sw)[:, None]
    elif SWAP_AB:
        if A_FP8:
            part = part * sa[None, :]
        part = part * sw[:, None]
    else:
        if A_FP8:
            part = part * sa[:, None]
        part = part * sw[None, :]
    return part


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr,
    sorted_slot_ptr, row_expert_ptr, topk_w_ptr, partial_ptr, arrivals_ptr,
    n_rows, limit, stride_ps,
    stride_am, stride_asm, stride_ask,
    stride_we, stride_wn, stride_wkb, stride_wse, stride_wsn, stride_wsk,
    stride_om, stride_osm, stride_osk,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr,
    GROUPED: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    A_FP8: tl.constexpr, OUT_FP8: tl.constexpr, GATE_UP_BF16: tl.constexpr, ACT_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr, SPLIT_K: tl.constexpr = 1,
    W_TILED: tl.constexpr = False, SWAP_AB: tl.constexpr = False, PARTS: tl.constexpr = 1,
    N_FASTEST: tl.constexpr = False, W_TMA: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """out[rows, n-tile] of one expert: load tiles, block-scaled accumulate, epilogue, store.

    BLOCK_K = ACT_BLOCK for FP8 A (one activation scale per K step), 128 for bf16 A (one weight scale).
    With SPLIT_K > 1, program (m, n, s) accumulates the s-th of SPLIT_K equal K slices; the tile's last
    program to finish adds the slices' partial sums (`_sum_slices`) and runs the epilogue.
    """
    pdl_wait(PDL)
    if N_FASTEST:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    weight = tl.zeros([BLOCK_M], dtype=tl.float32)
    # which expert, which rows are real, where their A rows are
    if GROUPED:
        expert = tl.load(row_expert_ptr + pid_m * BLOCK_M)
        if expert < 0:  # a block past the last expert's segment
            return
        slot = tl.load(sorted_slot_ptr + rows)
        valid = slot >= 0
        if GATHER:
            a_rows = slot // TOPK
        else:
            a_rows = rows
        if HAS_WEIGHT:
            weight = tl.load(topk_w_ptr + slot, mask=valid, other=0.0)
    else:
        expert = tl.full([], 0, tl.int32)
        valid = rows < n_rows
        a_rows = rows
    a_rows = a_rows.to(tl.int64)

    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    # swap-AB gate/up: one stacked weight tile, one dot per K block
    STACKED: tl.constexpr = SWIGLU and SWAP_AB
    if STACKED:
        # the tile's gate rows n over its up rows I + n
        offs_w = tl.arange(0, 2 * BLOCK_N)
        w_n = pid_n * BLOCK_N + offs_w % BLOCK_N + (offs_w // BLOCK_N) * N
    else:
        w_n = offs_n
    if W_TMA:
        # w_ptr: a TMA descriptor over the tiled weight [E, rows / 128, K / 128, 128, 128], block [1, 1, 1, BLOCK_N,
        # BLOCK_K]: the tile's rows of its gate (or down) block and of its up block
        nb_g = (pid_n * BLOCK_N) // WEIGHT_BLOCK
        nb_u = (N + pid_n * BLOCK_N) // WEIGHT_BLOCK
        n_in = (pid_n * BLOCK_N) % WEIGHT_BLOCK
    else:
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        if W_TILED:
            # w: [E, rows / 128, K / 128, 128, 128] (`optimized.moe.tile_experts`), each 128 x 128 block contiguous;
            # the 128-row blocks 128 * stride_wn apart, the K blocks stride_wkb apart
            w_rows = (w_n // WEIGHT_BLOCK) * (WEIGHT_BLOCK * stride_wn) + (w_n % WEIGHT_BLOCK) * WEIGHT_BLOCK
        else:
            w_rows = w_n * stride_wn
        wg_ptrs = w_base + w_rows.to(tl.int64)[None, :] + offs_k[:, None]  # [BLOCK_K, BLOCK_N] (stacked: 2 BLOCK_N)
        wu_ptrs = wg_ptrs + N * stride_wn  # up rows I + n (unstacked gate/up GEMM only)
    ws_base = w_scale_ptr + expert * stride_wse
    # a tile inside one 128-row weight block has one weight scale per K block (`_block_dot`'s SCALAR_SW)
    SCALAR_SW: tl.constexpr = BLOCK_N <= WEIGHT_BLOCK and not STACKED
    if SCALAR_SW:
        sg_ptrs = ws_base + ((pid_n * BLOCK_N) // WEIGHT_BLOCK) * stride_wsn
        su_ptrs = ws_base + ((N + pid_n * BLOCK_N) // WEIGHT_BLOCK) * stride_wsn
    else:
        sg_ptrs = ws_base + (w_n // WEIGHT_BLOCK) * stride_wsn
        su_ptrs = ws_base + ((N + offs_n) // WEIGHT_BLOCK) * stride_wsn

    if STACKED:  # gate over up, transposed until the loop ends
        acc_g = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = acc_g
    elif SWAP_AB:  # the accumulator is held transposed until the loop ends
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = acc_g
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_slice: tl.constexpr = K // SPLIT_K
    for k0 in range(pid_k * k_slice, (pid_k + 1) * k_slice, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
        if W_TMA:
            kb = k0 // WEIGHT_BLOCK
            k_in = k0 - kb * WEIGHT_BLOCK
            wg = tl.trans(w_ptr.load([expert, nb_g, kb, n_in, k_in]).reshape(BLOCK_N, BLOCK_K))
        else:
            if W_TILED:
                # block k0 // 128 starts stride_wkb bytes after the previous one; k0 % 128 within its rows
                kw = k0 + (k0 // WEIGHT_BLOCK) * (stride_wkb - WEIGHT_BLOCK)
            else:
                kw = k0
            wg = tl.load(wg_ptrs + kw)
        sg = tl.load(sg_ptrs + (k0 // WEIGHT_BLOCK) * stride_wsk)
        if A_FP8:
            sa = tl.load(a_scale_ptr + a_rows * stride_asm + (k0 // ACT_BLOCK) * stride_ask, mask=valid, other=0.0)
        else:
            sa = sg  # not read: EXACT's bf16 A has no scale
        acc_g += _block_dot(a, wg, sa, sg, A_FP8, SWAP_AB, SCALAR_SW)
        if SWIGLU and not STACKED:
            if W_TMA:
                wu = tl.trans(w_ptr.load([expert, nb_u, kb, n_in, k_in]).reshape(BLOCK_N, BLOCK_K))
            else:
                wu = tl.load(wu_ptrs + kw)
            su = tl.load(su_ptrs + (k0 // WEIGHT_BLOCK) * stride_wsk)
            acc_u += _block_dot(a, wu, sa, su, A_FP8, SWAP_AB, SCALAR_SW)
    if STACKED:
        # [2 BLOCK_N, BLOCK_M] -> [BLOCK_M, BLOCK_N, 2] -> gate [BLOCK_M, BLOCK_N], up [BLOCK_M, BLOCK_N]
        stacked = tl.reshape(tl.trans(acc_g), [BLOCK_M, 2, BLOCK_N])
        acc_g, acc_u = tl.split(tl.permute(stacked, (0, 2, 1)))
    elif SWAP_AB:
        acc_g = tl.trans(acc_g)

    out_rows = rows.to(tl.int64)
    if SPLIT_K > 1:
        # gate partials in columns [0, N) of a [SPLIT_K, n_rows, 2N] fp32 workspace (slice stride stride_ps), up
        # partials in [N, 2N); the down GEMM's in a [SPLIT_K, n_rows, N] one
        width: tl.constexpr = 2 * N if SWIGLU else N
        slices = partial_ptr + out_rows[:, None] * width + offs_n[None, :]
        tl.store(slices + pid_k * stride_ps, acc_g, mask=valid[:, None])
        if SWIGLU:
            tl.store(slices + pid_k * stride_ps + N, acc_u, mask=valid[:, None])
        if _arrive(arrivals_ptr + pid_m * (N // BLOCK_N) + pid_n) < SPLIT_K - 1:
            return  # another slice of this tile is still running: its program finishes the tile
        acc_g = _sum_slices(slices, valid, stride_ps, BLOCK_M, BLOCK_N, SPLIT_K)
        if SWIGLU:
            acc_u = _sum_slices(slices + N, valid, stride_ps, BLOCK_M, BLOCK_N, SPLIT_K)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :]
    if SWIGLU:
        act = _bf16(_swiglu(acc_g, acc_u, limit, weight, GATE_UP_BF16, HAS_WEIGHT))  # a -> bf16
        if OUT_FP8:
            # the columns quantized here: the tile's own, or (PARTS > 1) its whole quantization block
            Q_WIDTH: tl.constexpr = BLOCK_N * PARTS
            offs_q = (pid_n // PARTS) * Q_WIDTH + tl.arange(0, Q_WIDTH)
            if PARTS > 1:
                # the tile holds 1 / PARTS of each row's quantization block: it stores its bf16 values in the fp32
                # [n_rows, N] workspace, and the block's last program to arrive reads the whole block back
                block = partial_ptr + out_rows[:, None] * N
                tl.store(block + offs_n[None, :], act, mask=valid[:, None])
                counter = arrivals_ptr + pid_m * (N // ACT_BLOCK) + pid_n // PARTS
                if _arrive(counter) < PARTS - 1:
                    return  # another part of this block is still running: its program quantizes the block
                tl.store(counter, 0)  # every part has arrived: the counter is ready for the next launch
                act = tl.load(block + offs_q[None, :], mask=valid[:, None], other=0.0, cache_modifier=".cg")
            q, scale = _quantize_rows(act, BLOCK_M, Q_WIDTH, ACT_BLOCK, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO)
            tl.store(out_ptr + out_rows[:, None] * stride_om + offs_q[None, :], q.to(out_ptr.dtype.element_ty),
                     mask=valid[:, None])
            kb = (pid_n // PARTS) * (Q_WIDTH // ACT_BLOCK) + tl.arange(0, Q_WIDTH // ACT_BLOCK)
            tl.store(out_scale_ptr + out_rows[:, None] * stride_osm + kb[None, :] * stride_osk, scale,
                     mask=valid[:, None])
        else:
            tl.store(out_ptrs, act.to(tl.bfloat16), mask=valid[:, None])
    else:
        tl.store(out_ptrs, acc_g.to(tl.bfloat16), mask=valid[:, None])


def weight_tma(config: GemmConfig, tiled: bool, swiglu: bool) -> bool:
    """Whether a launch of `config` reads its weights through a TMA descriptor where the device has TMA
    (`GemmConfig.tma`): tiled weights only, and a box stays inside one 128 x 128 block (BLOCK_N <= 128; the stacked
    swap-AB gate/up tile loads two row ranges)."""
    return config.tma and tiled and config.block_n <= FP8_WEIGHT_BLOCK and not (config.swap_ab and swiglu)


# CUDA's limit on a grid's second dimension (HIP's is about the same), where `n_fastest` puts the row blocks.
MAX_GRID_Y = 65535


def launch_grid(config: GemmConfig, n_rows: int, n_out: int) -> tuple[tuple[int, int, int], bool]:
    """The grid of a `grouped_gemm` launch, and whether its first axis is the column tiles (`GemmConfig.n_fastest`;
    not where the row blocks would overflow the grid's second axis, which then keeps the row blocks first)."""
    row_blocks, col_tiles = triton.cdiv(n_rows, config.block_m), n_out // config.block_n
    if config.n_fastest and row_blocks <= MAX_GRID_Y:
        return (col_tiles, row_blocks, config.split_k), True
    return (row_blocks, col_tiles, config.split_k), False


def grouped_gemm(
    a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor, *,
    layout: MoeLayout | None, config: GemmConfig, swiglu: bool, numerics_fmt: str | FP8Format,
    act_block: int, topk: int = 1, gather: bool = False, topk_weights: torch.Tensor | None = None,
    limit: float = float("inf"), gate_up_bf16: bool = True, arrivals: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One grouped (or, with `layout=None`, plain) block-FP8 GEMM launch; shapes are validated by the caller.

    Args:
        a: A operand: [T, K] token rows (`gather`: row of slot s is `s // topk`), or [n_rows, K] rows in
            layout order; FP8 (with `a_scale` [.., K / act_block] fp32, any strides) or bf16 (EXACT, no scale).
        w, w_scale: [E, 2N or N, K] FP8, or the same tiled ([E, ., K / 128, 128, 128]: `optimized.moe.tile_experts`),
            and [E, ., K / 128] fp32 (E = 1 for the shared expert).
        layout: expert-sorted rows from `permute(..., align=config.block_m)`; None: rows = a's rows, expert 0.
        config: tiles.
        swiglu: gate/up GEMM with the fused epilogue (output width N = w.shape[1] / 2), else down GEMM.
        numerics_fmt: FP8 format of the epilogue's quantization (and of a, w).
        act_block: activation quantization block (128 or 32).
        topk: k, for `gather`.
        topk_weights: [T * k] fp32 routing weights by slot (gate/up GEMM of routed experts), or None.
        limit: SwiGLU clamp (+inf: none).
        gate_up_bf16: round gate/up to bf16 before the clamp.
        arrivals: zeroed int32 counters, at least one per row block and quantization block (gate/up tiles narrower
            than `act_block`) or per output tile (split K); None: allocated here, zeroed (a memset launch).

    Returns:
        out: gate/up: [rows, N] FP8 (bf16 when `a` is bf16); down: [rows, N] bf16.
        out_scale: [rows, N / act_block] fp32 (gate/up with FP8 output), else None.
    """
    prepare_interpreter()
    fmt = fp8_format(numerics_fmt)
    a_fp8 = a.dtype == fmt.dtype
    if layout is not None and layout.align != config.block_m:
        raise ValueError(f"layout: rows aligned to {layout.align}, but the GEMM's BLOCK_M is {config.block_m}")
    n_rows = layout.n_rows if layout is not None else a.shape[0]
    tiled = w.dim() == 5
    w_rows, k_dim = (w.shape[1] * w.shape[3], w.shape[2] * w.shape[4]) if tiled else (w.shape[1], w.shape[2])
    n_out = w_rows // 2 if swiglu else w_rows
    out_fp8 = swiglu and a_fp8
    out = torch.empty((n_rows, n_out), dtype=fmt.dtype if out_fp8 else torch.bfloat16, device=a.device)
    out_scale = (torch.empty((n_rows, n_out // act_block), dtype=torch.float32, device=a.device)
                 if out_fp8 else None)
    if n_rows == 0:
        return out, out_scale
    dummy = out
    block_k = act_block if a_fp8 else FP8_WEIGHT_BLOCK
    split = config.split_k
    if split < 1 or k_dim % (split * block_k):
        raise ValueError(f"config: split_k = {split} must divide the {k_dim // block_k} K blocks of {block_k}")
    grid, n_fastest = launch_grid(config, n_rows, n_out)
    parts = block_parts(config, act_block) if out_fp8 else 1
    if parts > 1 and split > 1:
        raise ValueError(f"config: a split K (split_k = {split}) needs tiles of whole quantization blocks "
                         f"(block_n = {config.block_n} < act_block = {act_block})")
    if parts > 1 and act_block % config.block_n:
        raise ValueError(f"config: block_n = {config.block_n} must divide act_block = {act_block}")
    # one arrival counter per row block and quantization block (parts), or per output tile (split K)
    n_counters = grid[0] * grid[1] // parts if parts > 1 or split > 1 else 0
    if arrivals is None:
        arrivals = torch.zeros(n_counters, dtype=torch.int32, device=a.device) if n_counters else dummy
    elif arrivals.dtype != torch.int32 or arrivals.numel() < n_counters:
        raise ValueError(f"arrivals: expected at least {n_counters} int32 counters, got {arrivals.numel()} "
                         f"{arrivals.dtype}")
    if split > 1:
        # fp32 partial sums of each slice (gate and up side by side)
        partial = torch.empty((split, n_rows, 2 * n_out if swiglu else n_out), dtype=torch.float32, device=a.device)
    elif parts > 1:
        # each tile's SwiGLU output, read back by the last of its quantization block's tiles
        partial = torch.empty((n_rows, n_out), dtype=torch.float32, device=a.device)
    else:
        partial = dummy
    w_tma = weight_tma(config, tiled, swiglu) and tma_loads(w)
    w_arg = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, 1, 1, config.block_n, block_k]) if w_tma else w
    _grouped_gemm_kernel[grid](
        a, a_scale if a_fp8 else dummy, w_arg, w_scale, out, out_scale if out_fp8 else dummy,
        layout.sorted_slot if layout is not None else dummy, layout.row_expert if layout is not None else dummy,
        topk_weights if topk_weights is not None else dummy, partial, arrivals,
        n_rows, float(limit), partial.stride(0) if split > 1 else 0,
        a.stride(0), a_scale.stride(0) if a_fp8 else 0, a_scale.stride(1) if a_fp8 else 0,
        w.stride(0), w.stride(1) // FP8_WEIGHT_BLOCK if tiled else w.stride(1), w.stride(2) if tiled else 0,
        w_scale.stride(0), w_scale.stride(1), w_scale.stride(2),
        out.stride(0), out_scale.stride(0) if out_fp8 else 0, out_scale.stride(1) if out_fp8 else 0,
        K=k_dim, N=n_out, TOPK=topk, GROUPED=layout is not None, GATHER=gather, SWIGLU=swiglu,
        HAS_WEIGHT=topk_weights is not None, A_FP8=a_fp8, OUT_FP8=out_fp8, GATE_UP_BF16=gate_up_bf16,
        ACT_BLOCK=act_block, BLOCK_K=block_k, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, **fp8_constants(fmt), SPLIT_K=split, W_TILED=tiled, SWAP_AB=config.swap_ab,
        PARTS=parts, N_FASTEST=n_fastest, W_TMA=w_tma, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch(),
    )
    return out, out_scale


@triton.jit
def _swiglu_quant_kernel(
    h_ptr, slot_row_ptr, topk_w_ptr, out_ptr, out_scale_ptr,
    n_slots, limit, rows_per_group,
    stride_h, stride_o, stride_os_g, stride_os_m, stride_os_k,
    N: tl.constexpr, GROUPED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr, PDL: tl.constexpr = False,
):
    """For each slot's row: gate/up bf16 -> SwiGLU * weight -> bf16 -> FP8 + scale (MN-major, by group)."""
    pdl_wait(PDL)
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    slots = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    weight = tl.zeros([BLOCK_S], dtype=tl.float32)
    if GROUPED:
        row = tl.load(slot_row_ptr + slots, mask=slots < n_slots, other=-1)
        valid = row >= 0
        weight = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    else:
        row = slots
        valid = slots < n_slots
    row = row.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ptrs = h_ptr + row[:, None] * stride_h + cols[None, :]
    gate = tl.load(h_ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
    up = tl.load(h_ptrs + N, mask=valid[:, None], other=0.0).to(tl.float32)
    act = _bf16(_swiglu(gate, up, limit, weight, False, GROUPED))
    q, scale = _quantize_rows(act, BLOCK_S, BLOCK_N, BLOCK_N, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO)
    tl.store(out_ptr + row[:, None] * stride_o + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    group = row // rows_per_group
    s_ptrs = out_scale_ptr + group * stride_os_g + (row - group * rows_per_group) * stride_os_m + pid_n * stride_os_k
    tl.store(s_ptrs[:, None], scale, mask=valid[:, None])


def swiglu_quant(
    h: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor, *, fmt: str | FP8Format, limit: float,
    layout: MoeLayout | None = None, topk_weights: torch.Tensor | None = None,
) -> None:
    """The gate/up GEMM's epilogue as a kernel: bf16 gate | up rows -> FP8 down-projection input + scales.

    Args:
        h: [rows, 2N] bf16 (gate columns 0..N-1, up N..2N-1), contiguous last dim; with `layout` the rows
            of the layout (the masked layout's [E, capacity, 2N] viewed as [E * capacity, 2N]).
        out: [rows, N] FP8 (or [E, capacity, N]), written at the rows that hold a slot.
        out_scale: [rows, N / 128] or [E, capacity, N / 128] fp32, any strides (DeepGEMM's MN-major).
        fmt: FP8 format.
        limit: SwiGLU clamp (+inf: none).
        layout, topk_weights: routed experts: the slot -> row map and the [T * k] routing weights;
            None: the shared expert (row = token, weight 1).
    """
    prepare_interpreter()
    f = fp8_format(fmt)
    n_half = h.shape[-1] // 2
    n_slots = layout.slot_row.numel() if layout is not None else h.shape[0]
    if n_slots == 0:
        return
    grouped = out_scale.dim() == 3
    rows_per_group = out_scale.shape[1] if grouped else max(h.shape[0], 1)
    s_strides = out_scale.stride() if grouped else (0, *out_scale.stride())
    flat_out = out.reshape(-1, n_half)
    grid = (triton.cdiv(n_slots, SWIGLU_BLOCK_S), n_half // FP8_WEIGHT_BLOCK)
    _swiglu_quant_kernel[grid](
        h, layout.slot_row if layout is not None else h, topk_weights if topk_weights is not None else h,
        flat_out, out_scale, n_slots, float(limit), rows_per_group, h.stride(0), flat_out.stride(0), *s_strides,
        N=n_half, GROUPED=layout is not None, BLOCK_S=SWIGLU_BLOCK_S, BLOCK_N=FP8_WEIGHT_BLOCK, **fp8_constants(f),
        **pdl_launch(),
    )


def _gemm_signature(a: str) -> dict[str, str]:
    return {
        "a_ptr": a, "a_scale_ptr": "*fp32", "w_ptr": "*{fp8}", "w_scale_ptr": "*fp32", "out_ptr": "*{fp8}",
        "out_scale_ptr": "*fp32", "sorted_slot_ptr": "*i32", "row_expert_ptr": "*i32", "topk_w_ptr": "*fp32",
        "partial_ptr": "*fp32", "arrivals_ptr": "*i32", "n_rows": "i32", "limit": "fp32", "stride_ps": "i32",
        **{k: "i32" for k in ("stride_am", "stride_asm", "stride_ask", "stride_we", "stride_wn", "stride_wkb",
                              "stride_wse", "stride_wsn", "stride_wsk", "stride_om", "stride_osm", "stride_osk")},
    }


def _aot_gemm(name: str, config: GemmConfig, k: int, n: int, swiglu: bool, grouped: bool,
              act_block: int = 128, targets: tuple[str, ...] = ALL_TARGETS, tiled: bool = False) -> AotSpec:
    signature = _gemm_signature("*{fp8}")
    if not swiglu:
        signature["out_ptr"] = "*bf16"
    w_tma = weight_tma(config, tiled, swiglu) and all(t.startswith("sm_") for t in targets)
    if w_tma:
        signature["w_ptr"] = f"tensordesc<{{fp8}}[1, 1, 1, {config.block_n}, {act_block}]>"
    aligned = ("a_ptr", "a_scale_ptr", "w_ptr", "w_scale_ptr", "out_ptr", "out_scale_ptr", "sorted_slot_ptr",
               "row_expert_ptr", "topk_w_ptr", "stride_am", "stride_asm", "stride_we", "stride_wn", "stride_wkb",
               "stride_wse", "stride_wsn", "stride_om", "stride_osm")
    return AotSpec(
        name, _grouped_gemm_kernel, signature,
        {"K": k, "N": n, "TOPK": 6 if grouped else 1, "GROUPED": grouped, "GATHER": grouped and swiglu,
         "SWIGLU": swiglu, "HAS_WEIGHT": grouped and swiglu, "A_FP8": True, "OUT_FP8": swiglu, "GATE_UP_BF16": True,
         "ACT_BLOCK": act_block, "BLOCK_K": act_block, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
         "SPLIT_K": config.split_k, "W_TILED": tiled, "SWAP_AB": config.swap_ab,
         "PARTS": block_parts(config, act_block) if swiglu else 1, "N_FASTEST": config.n_fastest, "W_TMA": w_tma},
        fp8=True, num_warps=config.num_warps, num_stages=config.num_stages, aligned=aligned, targets=targets,
    )


def _per_platform(name: str, label: str, rows_per_expert: int, k: int, n: int, swiglu: bool, grouped: bool,
                  act_block: int = 128, tiled: bool = False) -> list[AotSpec]:
    """The launch at `rows_per_expert` with each platform's tiles, on that platform's targets."""
    return [_aot_gemm(f"{name}[{label},{platform}]",
                      choose_config(rows_per_expert, n, swiglu, platform=platform, tiled=tiled), k,
                      n, swiglu, grouped, act_block, targets, tiled)
            for platform, targets in PLATFORM_TARGETS.items()]


# FLASH shapes (D 4096, I 2048): decode and prefill tiles of both GEMMs, routed and shared.
AOT_SPECS = [
    *_per_platform("moe_gate_up", "rows/expert=1", 1, 4096, 2048, True, True),
    _aot_gemm("moe_down[rows/expert=1]", choose_config(1, 4096, False), 2048, 4096, False, True),
    *_per_platform("moe_gate_up", "rows/expert=128", 128, 4096, 2048, True, True),
    *_per_platform("moe_down", "rows/expert=128", 128, 2048, 4096, False, True),
    *_per_platform("moe_shared_gate_up", "T=4096", 4096, 4096, 2048, True, False),
    # the decode shared expert's split-K launches by NVIDIA's rule (8 and 4 slices), and AMD's decode tiles with the
    # same slices, which AMD does not launch yet: they prove the arrival atomics and L1-bypassing loads lower there
    _aot_gemm("moe_shared_gate_up[T=1,split=8,nvidia]",
              split_k_for(choose_config(1, 2048, True), 1, 2048, 4096, 132, True), 4096, 2048, True, False,
              targets=PLATFORM_TARGETS["nvidia"]),
    _aot_gemm("moe_shared_gate_up[T=1,split=8,amd]",
              dataclasses.replace(choose_config(1, 2048, True, platform="amd"), split_k=8), 4096, 2048, True, False,
              targets=PLATFORM_TARGETS["amd"]),
    _aot_gemm("moe_shared_down[T=1,split=4]", split_k_for(choose_config(1, 4096, False), 1, 4096, 2048, 132, False),
              2048, 4096, False, False),
    *_per_platform("moe_gate_up", "rows/expert=128,act_block=32", 128, 4096, 2048, True, True, act_block=32),
    # tiled experts (`optimized.moe.tile_experts`): decode and prefill tiles of both routed GEMMs
    *_per_platform("moe_gate_up", "rows/expert=1,tiled", 1, 4096, 2048, True, True, tiled=True),
    # NVIDIA's T = 1 gate/up tile, 32 columns whose last of four finishes each quantization block
    _aot_gemm("moe_gate_up[T=1,tiled,narrow,nvidia]", narrow_gate_up_for(choose_config(1, 2048, True), 96, 2048, 128,
                                                                          132),
              4096, 2048, True, True, targets=PLATFORM_TARGETS["nvidia"], tiled=True),
    *_per_platform("moe_down", "rows/expert=1,tiled", 1, 2048, 4096, False, True, tiled=True),
    *_per_platform("moe_gate_up", "rows/expert=128,tiled", 128, 4096, 2048, True, True, tiled=True),
    *_per_platform("moe_down", "rows/expert=128,tiled", 128, 2048, 4096, False, True, tiled=True),
    AotSpec(
        "moe_swiglu_quant", _swiglu_quant_kernel,
        {"h_ptr": "*bf16", "slot_row_ptr": "*i32", "topk_w_ptr": "*fp32", "out_ptr": "*{fp8}",
         "out_scale_ptr": "*fp32", "n_slots": "i32", "limit": "fp32", "rows_per_group": "i32",
         **{k: "i32" for k in ("stride_h", "stride_o", "stride_os_g", "stride_os_m", "stride_os_k")}},
        {"N": 2048, "GROUPED": True, "BLOCK_S": SWIGLU_BLOCK_S, "BLOCK_N": FP8_WEIGHT_BLOCK},
        fp8=True, aligned=("h_ptr", "slot_row_ptr", "topk_w_ptr", "out_ptr", "out_scale_ptr", "stride_h", "stride_o"),
    ),
]
