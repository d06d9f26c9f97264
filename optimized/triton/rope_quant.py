"""Row-wise fused norm + RoPE + quantization kernels of the attention projections (spec §3.2-§3.4).

One kernel covers every "finish a row" step of the attention layer; each use is a set of constexpr switches:

| use                          | rows          | norm                 | RoPE at       | then                        |
|------------------------------|---------------|----------------------|---------------|-----------------------------|
| queries (`project_q`)        | T*H of 512    | per head, bf16 arith | p             | -                           |
| window KV (`project_kv`)     | T of 512      | RMSNorm(kv_norm)     | p             | QD_fp8 64 NoPE, or pack 584 |
| main compressor entries      | n_c of 512    | RMSNorm(norm) of u   | j*m           | QD_fp8 64 NoPE, or pack 584 |
| indexer queries (`indexer_q`)| T*Hi of 128   | -                    | p             | Hadamard, QD_fp4 32         |
| indexer compressor entries   | n_c of 128    | RMSNorm(norm) of u   | j*m           | Hadamard, QD_fp4 32         |

Every step rounds where the reference rounds (`reference.attention.project_q` / `project_kv`,
`reference.compressor.finish_entries`, `reference.indexer.indexer_q`): the normalized row to bf16, the RoPE
output to bf16, the Hadamard output to bf16, the quant-dequantized values to bf16. RoPE uses the reference's
own cos/sin tables (`reference.rope.rope_cos_sin`, computed by torch on the same device) and runs without
FMA contraction (`enable_fp_fusion=False`), so its products and differences round exactly as torch's do;
every division is `div_rn` (Triton's `/` is the approximate `div.full.f32` on NVIDIA), except divisions by a power of
two, which multiply by its exact reciprocal (`pow2_reciprocal`).
What can differ from the reference: the fp32 order of the norm's sum of squares (and the Hadamard's sums
when a row spans more than 16 binades), which moves a bf16 rounding now and then by one bf16 ulp, and
downstream of it an FP8/FP4 rounding by one step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from optimized.backends import detect
from optimized.triton._fp8 import (
    fp8_constants,
    pow2_reciprocal,
    prepare_interpreter,
    round_to_fp8_grid,
    ue8m0_scale,
)
from optimized.triton.aot import AotSpec
from reference.formats import fp8_format
from reference.hadamard import sylvester_hadamard

PACKED_ROW_BYTES = 584  # reference.cache layout: 448 FP8 | 64 bf16 RoPE (bytes 448..575) | 7 UE8M0 | 1 pad

# NORM modes
NORM_NONE, NORM_WEIGHTED, NORM_HEAD_BF16 = 0, 1, 2
# QUANT modes
QUANT_NONE, QUANT_FP8, QUANT_PACKED, QUANT_FP4 = 0, 1, 2, 3
ROWS_PER_PROGRAM = {512: 4, 128: 16}
# the CPU interpreter pays per operation, not per element: many rows per program
INTERPRETER_ROWS_PER_PROGRAM = {512: 64, 128: 128}
NUM_WARPS = 4


@triton.jit
def round_to_fp4_grid(x):
    """Round fp32 `x` (|x| <= 6) to the nearest E2M1 value, ties to even, in fp32; zero comes out +0.

    E2M1 has one mantissa bit: in the binade [2^e, 2^(e+1)) the step is 2^(e-1); below 1 (the smallest
    normal) the step stays 0.5. `x / step` is an exact fp32 and `+- 1.5 * 2^23` rounds it to nearest even.
    """
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, 0)
    step = ((exponent - 1 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((128 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(1-e), exact
    magic = 12582912.0  # 1.5 * 2^23
    y = ((x * inv_step + magic) - magic) * step
    return tl.where(y == 0.0, 0.0, y)


@triton.jit
def _block_amax(y, R: tl.constexpr, D: tl.constexpr, B: tl.constexpr):
    """Per-row, per-B-wide-block absolute max of `y` [R, D], broadcast back to [R, D]."""
    blocks = tl.reshape(tl.abs(y), (R, D // B, B))
    amax = tl.max(blocks, axis=2)
    return tl.reshape(tl.broadcast_to(amax[:, :, None], (R, D // B, B)), (R, D))


@triton.jit
def _rope_quant_kernel(
    x_ptr, norm_ptr, cos_ptr, sin_ptr, hadamard_ptr, out_ptr, packed_fp8_ptr, packed_u8_ptr,
    n_rows, rows_per_position, stride_x, stride_out, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, ROUND_INPUT: tl.constexpr, NORM: tl.constexpr,
    HADAMARD: tl.constexpr, QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr,
):
    """One program = BLOCK_R rows of D values: [round] -> [norm] -> RoPE (last 64 dims) -> [Hadamard] -> [quant]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    r64 = rows.to(tl.int64)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    if ROUND_INPUT:
        x = x.to(tl.bfloat16).to(tl.float32)  # official: the pooled entry is rounded to bf16 before its norm

    # ---- norm -> bf16
    if NORM == 1:
        # reference.linear.rms_norm: w * x * rsqrt(mean(x^2) + eps) in fp32
        mean = tl.sum(x * x, axis=1) / D
        inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))
        w = tl.load(norm_ptr + cols).to(tl.float32)
        x = (x * inv_rms[:, None] * w[None, :]).to(tl.bfloat16).to(tl.float32)
    elif NORM == 2:
        # official per-head query norm in bf16 arithmetic: square, mean, + eps, rsqrt and product each round
        square = (x * x).to(tl.bfloat16).to(tl.float32)
        mean = (tl.sum(square, axis=1) / D).to(tl.bfloat16).to(tl.float32)
        inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn((mean + eps).to(tl.bfloat16).to(tl.float32)))
        inv_rms = inv_rms.to(tl.bfloat16).to(tl.float32)
        x = (x * inv_rms[:, None]).to(tl.bfloat16).to(tl.float32)
    else:
        x = x.to(tl.bfloat16).to(tl.float32)

    # ---- GPT-J RoPE on the last 64 dims (pairs 2i, 2i+1); the other pairs rotate by cos 1, sin 0 (exact)
    pairs = tl.arange(0, D // 2)
    first_rope_pair: tl.constexpr = (D - 64) // 2
    is_rope = pairs >= first_rope_pair
    position = r64 // rows_per_position
    angle = position[:, None] * 32 + tl.maximum(pairs - first_rope_pair, 0)[None, :]
    rope_ok = row_ok[:, None] & is_rope[None, :]
    cos = tl.load(cos_ptr + angle, mask=rope_ok, other=1.0)
    sin = tl.load(sin_ptr + angle, mask=rope_ok, other=0.0)
    even, odd = tl.split(tl.reshape(x, (BLOCK_R, D // 2, 2)))
    x = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BLOCK_R, D))
    x = x.to(tl.bfloat16).to(tl.float32)

    # ---- Hadamard rotation (x H / sqrt(D), bf16 out); the ±1 sums of bf16 values are exact in fp32
    if HADAMARD:
        h = tl.load(hadamard_ptr + cols[:, None] * D + cols[None, :])
        x = tl.dot(x.to(tl.bfloat16), h, out_dtype=tl.float32)
        x = (x * (1.0 / math.sqrt(D))).to(tl.bfloat16).to(tl.float32)

    # ---- quantization simulation / packing
    if QUANT == 1 or QUANT == 2:
        # QD_fp8 of the NoPE dims in blocks of 64 with UE8M0 scales, amax floor 1e-4 (reference.formats.ACT_EPS);
        # the RoPE dims stay bf16
        nope = (cols < D - 64)[None, :]
        scale = ue8m0_scale(_block_amax(tl.where(nope, x, 0.0), BLOCK_R, D, 64), FP8_MAX, 1e-4)
        q = round_to_fp8_grid(x * pow2_reciprocal(scale), FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO)
        if QUANT == 1:
            y = tl.where(nope, q * scale, x)
            tl.store(out_ptr + r64[:, None] * stride_out + cols[None, :], y.to(tl.bfloat16), mask=row_ok[:, None])
        else:
            # the 584-byte row: 448 FP8 | 64 bf16 RoPE | 7 UE8M0 exponent bytes | pad 0
            row_bytes = r64[:, None] * 584
            tl.store(packed_fp8_ptr + row_bytes + cols[None, :], q.to(packed_fp8_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & nope)
            rope_elems = r64[:, None] * 292 + 224 + (cols[None, :] - (D - 64))
            tl.store(out_ptr + rope_elems, x.to(tl.bfloat16), mask=row_ok[:, None] & ~nope)
            block = tl.arange(0, 8)
            block_scale = tl.max(tl.reshape(scale, (BLOCK_R, D // 64, 64)), axis=2)  # [R, 8], block 7 unused
            exponent = ((block_scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
            exponent = tl.where(block[None, :] < 7, exponent, 0)  # byte 583 is the pad
            tl.store(packed_u8_ptr + r64[:, None] * 584 + 576 + block[None, :], exponent, mask=row_ok[:, None])
    elif QUANT == 3:
        # QD_fp4 in blocks of 32 with UE8M0 scales, qmax 6, amax floor 6 * 2^-126 (reference.formats.FP4_EPS)
        scale = ue8m0_scale(_block_amax(x, BLOCK_R, D, 32), 6.0, 7.052966104933725e-38)
        y = round_to_fp4_grid(tl.minimum(tl.maximum(x * pow2_reciprocal(scale), -6.0), 6.0)) * scale
        tl.store(out_ptr + r64[:, None] * stride_out + cols[None, :], y.to(tl.bfloat16), mask=row_ok[:, None])
    else:
        tl.store(out_ptr + r64[:, None] * stride_out + cols[None, :], x.to(tl.bfloat16), mask=row_ok[:, None])


_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    """The ±1 Sylvester matrix in bf16 (exact), cached per device."""
    key = (n, str(device))
    if key not in _HADAMARD:
        _HADAMARD[key] = sylvester_hadamard(n, device).to(torch.bfloat16).contiguous()
    return _HADAMARD[key]


def rope_quant(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, norm: str, norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6, round_input: bool = False, hadamard: bool = False, quant: str = "none",
    fmt: str = "e4m3fn",
) -> torch.Tensor:
    """Finish rows: [bf16 round] -> [norm] -> RoPE on the last 64 dims -> [Hadamard] -> [quantization].

    Args:
        x: [R, D] bf16 or fp32 rows (D = 512 or 128), last dim contiguous; `R = P * k` rows where the
            `k` consecutive rows of position `i` share `cos[i]`, `sin[i]` (k = heads for queries, else 1).
        cos, sin: [P, 32] fp32 from `reference.rope.rope_cos_sin` (the positions each row rotates by).
        norm: `"none"`, `"weighted"` (`reference.linear.rms_norm` with `norm_weight`, fp32) or
            `"head_bf16"` (`reference.attention.head_rms_norm`, bf16 arithmetic, no weight).
        norm_weight: [D] bf16 for `"weighted"`.
        eps: norm epsilon.
        round_input: round x to bf16 first (official compressed-entry norm input).
        hadamard: apply the Hadamard rotation (D = 128 indexer rows).
        quant: `"none"`, `"fp8"` (QD_fp8 64 of the NoPE dims), `"packed"` (the 584-byte FP8 cache rows,
            D = 512) or `"fp4"` (QD_fp4 32 of every dim).
        fmt: FP8 format for `"fp8"` / `"packed"`.

    Returns:
        [R, D] bf16, or [R, 584] uint8 for `"packed"`.
    """
    prepare_interpreter()
    n_rows, d = x.shape
    rows_per_position = n_rows // max(cos.shape[0], 1)
    if quant == "packed":
        out = torch.zeros((n_rows, PACKED_ROW_BYTES), dtype=torch.uint8, device=x.device)
        values, fp8_view, u8_view, stride_out = out.view(torch.bfloat16), out.view(fp8_format(fmt).dtype), out, 0
    else:
        values = torch.empty((n_rows, d), dtype=torch.bfloat16, device=x.device)
        fp8_view = u8_view = values
        stride_out = values.stride(0)
    if n_rows == 0:
        return out if quant == "packed" else values
    block_r = (INTERPRETER_ROWS_PER_PROGRAM if detect().interpret else ROWS_PER_PROGRAM)[d]
    _rope_quant_kernel[(triton.cdiv(n_rows, block_r),)](
        x, norm_weight if norm_weight is not None else cos, cos, sin,
        _hadamard(d, x.device) if hadamard else cos, values, fp8_view, u8_view,
        n_rows, rows_per_position, x.stride(0), stride_out, float(eps),
        D=d, BLOCK_R=block_r, ROUND_INPUT=round_input,
        NORM={"none": NORM_NONE, "weighted": NORM_WEIGHTED, "head_bf16": NORM_HEAD_BF16}[norm],
        HADAMARD=hadamard,
        QUANT={"none": QUANT_NONE, "fp8": QUANT_FP8, "packed": QUANT_PACKED, "fp4": QUANT_FP4}[quant],
        **fp8_constants(fmt), num_warps=NUM_WARPS, enable_fp_fusion=False,
    )
    return out if quant == "packed" else values


def _signature(x_dtype: str) -> dict[str, str]:
    return {
        "x_ptr": x_dtype, "norm_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "hadamard_ptr": "*bf16",
        "out_ptr": "*bf16", "packed_fp8_ptr": "*{fp8}", "packed_u8_ptr": "*u8", "n_rows": "i32",
        "rows_per_position": "i32", "stride_x": "i32", "stride_out": "i32", "eps": "fp32",
    }


# The five uses of the table above (main KV in both its bf16-simulated and packed forms).
AOT_SPECS = [
    AotSpec(f"rope_quant[{name}]", _rope_quant_kernel, _signature(x_dtype),
            {"D": d, "BLOCK_R": ROWS_PER_PROGRAM[d], "ROUND_INPUT": round_input, "NORM": norm_mode,
             "HADAMARD": hadamard, "QUANT": quant_mode}, fp8=True, num_warps=NUM_WARPS)
    for name, x_dtype, d, round_input, norm_mode, hadamard, quant_mode in (
        ("q", "*bf16", 512, False, NORM_HEAD_BF16, False, QUANT_NONE),
        ("kv", "*bf16", 512, False, NORM_WEIGHTED, False, QUANT_FP8),
        ("kv_packed", "*bf16", 512, False, NORM_WEIGHTED, False, QUANT_PACKED),
        ("compressed_packed", "*fp32", 512, True, NORM_WEIGHTED, False, QUANT_PACKED),
        ("indexer_q", "*bf16", 128, False, NORM_NONE, True, QUANT_FP4),
        ("indexer_k", "*fp32", 128, True, NORM_WEIGHTED, True, QUANT_FP4),
    )
]

