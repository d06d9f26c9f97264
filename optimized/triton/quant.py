"""Activation FP8 quantization kernels: per-token 1 x B blocks, and the attention output's fused inverse RoPE.

Two kernels, one per-block recipe (spec §2.1-§2.3): amax of the block -> power-of-two scale computed on
the bits (`_fp8.ue8m0_scale`) -> `x * (1 / s)` (exact: `1 / s` is a power of two built from the scale's
exponent) -> exact RNE onto the E4M3 grid (`_fp8.round_to_fp8_grid`) -> store. The bytes equal the
reference's (`reference.formats.quantize_per_token`, `reference.einsum.quantize_attn_output`) in both
FP8 formats, on the GPU and in the CPU interpreter — NaN and Inf included (a block holding a NaN gets the
reference's scale 2^127 and keeps its NaN; an Inf saturates to the format's max).

Scale layouts (`scale_layout`):
  * `"row_major"`: `s [M, K/B]` contiguous (`[T, G, K/B]` for the attention output).
  * `"deepgemm"`: DeepGEMM's SM90 layout for activation scales, MN-major and TMA-aligned, so DeepGEMM
    uses them as they are instead of re-laying them out on every call (its
    `get_mn_major_tma_aligned_tensor` returns its input unchanged when the strides below hold). The
    storage is `[K/B, M4]` (`[G, K/B, T4]` for the attention output) with `M4` = M rounded up to 4
    fp32 = 16 bytes (TMA's alignment); padding rows hold scale 0. The function returns the logical
    `[M, K/B]` view (strides `(1, M4)`), resp. `[T, G, K/B]` (strides `(1, K/B*T4, T4)`).

Why the fused kernel disables FP contraction: the inverse RoPE's `x_e cos + x_o sin` must round each
product and the sum separately to match the reference bit for bit (an FMA rounds once);
`enable_fp_fusion=False` makes the compiler keep them apart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.triton._fp8 import fp8_constants, prepare_interpreter, round_to_fp8_grid, ue8m0_scale
from optimized.triton.aot import AotSpec
from reference.einsum import ATTN_OUT_EPS, SCALE_BLOCK, check_attn_output_args
from reference.formats import ACT_EPS, FP8Format, fp8_format
from reference.rope import rope_cos_sin

SCALE_LAYOUTS = ("row_major", "deepgemm")
TMA_ALIGN_FP32 = 4  # TMA needs 16-byte aligned strides: 4 fp32 scales
# Elements per program of the per-token kernel: BLOCK_M rows x one scale block (4096 values, 8 KB bf16).
_TILE_ELEMENTS = 4096


@triton.jit
def _block_scale(x, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    """Power-of-two scale of each row of `x` [rows, BLOCK] (fp32). A row holding a NaN gets 2^127, as in the
    reference: torch's amax propagates the NaN and the UE8M0 exponent clamps at 254 (Triton's max drops NaN)."""
    scale = ue8m0_scale(tl.max(tl.abs(x), axis=1), FP8_MAX, EPS)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    return tl.where(has_nan, 2.0**127, scale)


@triton.jit
def _quantize_rows(x, scale, out_dtype: tl.constexpr, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
                   HAS_NEG_ZERO: tl.constexpr):
    """`x / scale` (one scale per row) rounded onto the FP8 grid and cast to `out_dtype`; NaN stays NaN.

    `1 / scale` is built from the scale's exponent bits (exact: a power of two; 2^-127 is subnormal). The
    clamps of `round_to_fp8_grid` would turn a NaN into +-FP8_MAX, so NaN elements get the format's NaN
    byte (0x7F e4m3fn, 0x80 e4m3fnuz) by bitcast, which every backend and the interpreter store as is.
    """
    exponent = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    inverse = tl.where(exponent == 254, 2.0**-127, ((254 - exponent) << 23).to(tl.float32, bitcast=True))
    xs = x * inverse[:, None]
    q = round_to_fp8_grid(xs, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO).to(out_dtype)
    nan = tl.full(xs.shape, 0x7F if HAS_NEG_ZERO else 0x80, tl.uint8).to(out_dtype, bitcast=True)
    return tl.where(xs != xs, nan, q)


@triton.jit
def _quant_per_token_kernel(
    x_ptr, q_ptr, s_ptr,
    M, M_PAD, stride_xm, stride_qm, stride_sm, stride_sk,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, EPS: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr,
):
    """One program = BLOCK_M rows x one block of BLOCK channels: load, amax, scale, round, store."""
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    valid = rows < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    scale = _block_scale(x, FP8_MAX, EPS)
    q = _quantize_rows(x, scale, q_ptr.dtype.element_ty, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=valid[:, None])
    # padding rows (M <= row < M_PAD) of the DeepGEMM layout get scale 0
    tl.store(s_ptr + rows * stride_sm + kb * stride_sk, tl.where(valid, scale, 0.0), mask=rows < M_PAD)


@triton.jit
def _inv_rope_quant_kernel(
    o_ptr, cos_ptr, sin_ptr, q_ptr, s_ptr,
    T, stride_ot, stride_oh, stride_qt, stride_qg, stride_st, stride_sg, stride_sk,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, BLOCKS_POW2: tl.constexpr, BLOCK: tl.constexpr, EPS: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr,
):
    """One program = one (token, group): the group's HEADS_PER_GROUP x HEAD_DIM values as [blocks, BLOCK].

    Programs with t >= T (padding rows of the DeepGEMM scale layout) only write scale 0.
    """
    t = tl.program_id(0)
    g = tl.program_id(1)
    token_ok = t < T
    block = tl.arange(0, BLOCKS_POW2)
    col = block[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # position in the group's vector
    ok = token_ok & (block[:, None] < NUM_BLOCKS)
    head = col // HEAD_DIM
    d = col % HEAD_DIM
    src = o_ptr + t.to(tl.int64) * stride_ot + (g * HEADS_PER_GROUP + head) * stride_oh + d
    x = tl.load(src, mask=ok, other=0.0).to(tl.float32)

    # inverse GPT-J RoPE on the last ROPE_DIM dims of each head, in fp32 (spec §2.8):
    #   x_e' = x_e cos + x_o sin,  x_o' = x_o cos - x_e sin;  the partner of dim d is d ^ 1
    nope = HEAD_DIM - ROPE_DIM
    is_rope = ok & (d >= nope)
    pair = tl.maximum(d - nope, 0) // 2
    cos = tl.load(cos_ptr + t * (ROPE_DIM // 2) + pair, mask=is_rope, other=1.0)
    sin = tl.load(sin_ptr + t * (ROPE_DIM // 2) + pair, mask=is_rope, other=0.0)
    is_even = (d % 2) == 0
    partner = tl.load(src + tl.where(is_even, 1, -1), mask=is_rope, other=0.0).to(tl.float32)
    rotated = tl.where(is_even, x * cos + partner * sin, x * cos - partner * sin)
    x = tl.where(is_rope, rotated, x)

    # per-BLOCK amax -> power-of-two scale -> exact FP8 rounding
    scale = _block_scale(x, FP8_MAX, EPS)
    q = _quantize_rows(x, scale, q_ptr.dtype.element_ty, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO)
    dst = q_ptr + t.to(tl.int64) * stride_qt + g * stride_qg + col
    tl.store(dst, q, mask=ok)
    s_dst = s_ptr + t * stride_st + g * stride_sg + block * stride_sk
    tl.store(s_dst, tl.where(token_ok, scale, 0.0), mask=block < NUM_BLOCKS)


def check_fp8_support(fmt: FP8Format, device: torch.device, name: str) -> None:
    """Raise a ValueError naming `name` when Triton cannot use `fmt` on `device`.

    float8_e4m3fnuz is gfx942's format: Triton compiles it for ROCm (and the CPU interpreter runs it),
    but has no e4m3fnuz conversion or dot on NVIDIA GPUs.
    """
    if fmt.name == "e4m3fnuz" and device.type == "cuda" and torch.version.hip is None:
        raise ValueError(f"{name}: float8_e4m3fnuz (gfx942's format) has no Triton support on NVIDIA GPUs; "
                         "use e4m3fn there (e4m3fnuz runs on ROCm and in the CPU interpreter)")


def _check_layout(scale_layout: str) -> None:
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout: expected one of {SCALE_LAYOUTS}, got {scale_layout!r}")


def _aligned(n: int) -> int:
    return -(-n // TMA_ALIGN_FP32) * TMA_ALIGN_FP32


def quantize_per_token(
    x: torch.Tensor,
    block: int = 128,
    fmt: str | FP8Format = "e4m3fn",
    scale_layout: str = "row_major",
    eps: float = ACT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1 x `block` FP8 quantization (official `act_quant`); bytes equal the reference's.

    The parity oracle is `reference.formats.quantize_per_token` (same eps, same format).

    Args:
        x: [M, K] bf16, fp16 or fp32, last dim contiguous, K a multiple of `block`; any M (0 included).
        block: channels per scale: 32, 64 or 128.
        fmt: FP8 format (`"e4m3fn"` / `"e4m3fnuz"` or its dtype).
        scale_layout: `"row_major"` or `"deepgemm"` (see the module docstring).
        eps: amax floor of the scale (official / DeepGEMM: 1e-4).

    Returns:
        q: [M, K] FP8, contiguous.
        s: [M, K / block] fp32 powers of two, in `scale_layout`.
    """
    f = fp8_format(fmt)
    _check_layout(scale_layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x: expected bfloat16, float16 or float32, got {x.dtype}")
    if block not in (32, 64, 128):
        raise ValueError(f"block: expected 32, 64 or 128, got {block!r}")
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if k % block:
        raise ValueError(f"x: K = {k} is not a multiple of the block size {block}")
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"x: the last dim must be contiguous (stride 1), got strides {tuple(x.stride())}")
    if not eps > 0:
        raise ValueError(f"eps: expected a positive amax floor, got {eps!r}")
    check_fp8_support(f, x.device, "fmt")
    q = torch.empty((m, k), dtype=f.dtype, device=x.device)
    nb = k // block
    if scale_layout == "deepgemm":
        m_pad = _aligned(m)
        s = torch.empty((nb, m_pad), dtype=torch.float32, device=x.device).t()[:m]
        stride_sm, stride_sk = 1, m_pad
    else:
        m_pad = m
        s = torch.empty((m, nb), dtype=torch.float32, device=x.device)
        stride_sm, stride_sk = nb, 1
    if m_pad == 0 or nb == 0:
        return q, s
    prepare_interpreter()
    block_m = _TILE_ELEMENTS // block
    grid = (triton.cdiv(m_pad, block_m), nb)
    _quant_per_token_kernel[grid](
        x, q, s, m, m_pad, x.stride(0), k, stride_sm, stride_sk,
        BLOCK=block, BLOCK_M=block_m, EPS=eps, **fp8_constants(f),
        num_warps=4, enable_fp_fusion=False,
    )
    return q, s


def quantize_attn_output(
    o: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    n_groups: int,
    fmt: str | FP8Format = "e4m3fn",
    scale_layout: str = "row_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused inverse RoPE + per-128 FP8 quantization of the attention output; bytes equal
    `reference.einsum.quantize_attn_output`.

    cos / sin come from `reference.rope.rope_cos_sin` (torch, on o's device) rather than from the
    kernel's own `cos`/`sin`, which are not bitwise equal to torch's; the table is [T, rope_dim/2] fp32.

    Args:
        o: [T, H, head_dim] bf16, last dim contiguous.
        positions: [T] int.
        freqs: [rope_dim / 2] fp32.
        n_groups: G.
        fmt: FP8 format.
        scale_layout: `"row_major"` or `"deepgemm"` (see the module docstring).

    Returns:
        o_fp8: [T, G, H/G*head_dim] FP8, a transposed view of a contiguous [G, T, H/G*head_dim] tensor
            (DeepGEMM needs `o_fp8.permute(1, 0, 2)` to have a unit last stride; per group the rows
            are contiguous, which the Triton einsum's A tiles like too).
        o_scale: [T, G, H/G*head_dim/128] fp32 in `scale_layout`.
    """
    t, h, head_dim = check_attn_output_args(o, positions, freqs, n_groups, fmt)
    _check_layout(scale_layout)
    if o.stride(2) != 1:
        raise ValueError(f"o: the last dim must be contiguous (stride 1), got strides {tuple(o.stride())}")
    f = fp8_format(fmt)
    check_fp8_support(f, o.device, "fmt")
    heads_per_group = h // n_groups
    group_dim = heads_per_group * head_dim
    nb = group_dim // SCALE_BLOCK
    o_fp8 = torch.empty((n_groups, t, group_dim), dtype=f.dtype, device=o.device).transpose(0, 1)
    if scale_layout == "deepgemm":
        t_pad = _aligned(t)
        storage = torch.empty((n_groups, nb, t_pad), dtype=torch.float32, device=o.device)
        o_scale = storage.permute(2, 0, 1)[:t]  # [T, G, nb], strides (1, nb * T4, T4)
        stride_st, stride_sg, stride_sk = 1, nb * t_pad, t_pad
    else:
        t_pad = t
        o_scale = torch.empty((t, n_groups, nb), dtype=torch.float32, device=o.device)
        stride_st, stride_sg, stride_sk = n_groups * nb, nb, 1
    if t_pad == 0:
        return o_fp8, o_scale
    prepare_interpreter()
    cos, sin = rope_cos_sin(positions, freqs)
    _inv_rope_quant_kernel[(t_pad, n_groups)](
        o, cos.contiguous(), sin.contiguous(), o_fp8, o_scale,
        t, o.stride(0), o.stride(1), o_fp8.stride(0), o_fp8.stride(1), stride_st, stride_sg, stride_sk,
        HEADS_PER_GROUP=heads_per_group, HEAD_DIM=head_dim, ROPE_DIM=2 * freqs.numel(),
        NUM_BLOCKS=nb, BLOCKS_POW2=triton.next_power_of_2(nb), BLOCK=SCALE_BLOCK, EPS=ATTN_OUT_EPS,
        **fp8_constants(f), num_warps=8 if nb >= 32 else 4, enable_fp_fusion=False,
    )
    return o_fp8, o_scale


# Launch configurations compiled ahead of time (optimized.triton.aot): the attention output of FLASH and
# PRO (8 heads x 512 per group = 32 blocks of 128), and the per-token kernel at its three block sizes.
AOT_SPECS = [
    AotSpec(
        name="inv_rope_quant[hpg=8,head=512]",
        kernel=_inv_rope_quant_kernel,
        signature={"o_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": "*{fp8}", "s_ptr": "*fp32",
                   **{k: "i32" for k in ("T", "stride_ot", "stride_oh", "stride_qt", "stride_qg", "stride_st",
                                         "stride_sg", "stride_sk")}},
        constexprs={"HEADS_PER_GROUP": 8, "HEAD_DIM": 512, "ROPE_DIM": 64, "NUM_BLOCKS": 32, "BLOCKS_POW2": 32,
                    "BLOCK": SCALE_BLOCK, "EPS": ATTN_OUT_EPS},
        fp8=True,
        num_warps=8,
        aligned=("o_ptr", "cos_ptr", "sin_ptr", "q_ptr", "s_ptr", "stride_ot", "stride_oh", "stride_qt", "stride_qg"),
    ),
    *(
        AotSpec(
            name=f"quant_per_token[block={block}]",
            kernel=_quant_per_token_kernel,
            signature={"x_ptr": "*bf16", "q_ptr": "*{fp8}", "s_ptr": "*fp32",
                       **{k: "i32" for k in ("M", "M_PAD", "stride_xm", "stride_qm", "stride_sm", "stride_sk")}},
            constexprs={"BLOCK": block, "BLOCK_M": _TILE_ELEMENTS // block, "EPS": ACT_EPS},
            fp8=True,
            aligned=("x_ptr", "q_ptr", "s_ptr", "stride_xm", "stride_qm"),
        )
        for block in (32, 64, 128)
    ),
]
