"""Activation FP8 quantization kernels: per-token 1 x B blocks, and the attention output's fused inverse RoPE.

The attention output has two kernels: a head-tiled one for heads of whole 128-blocks with their RoPE dims in the
last (DSv4's 512 / 64; the rotation touches those dims alone and a token's heads share one cos / sin load), and a
block-tiled one for every other shape the op accepts (a block holding several heads, RoPE dims across blocks),
which rotates every (even, odd) pair under a mask. Both produce the same bytes.

One per-block recipe (spec §2.1-§2.3): amax of the block -> power-of-two scale computed on
the bits (`_fp8.ue8m0_scale`) -> `x * (1 / s)` (exact: `1 / s` is a power of two built from the scale's
exponent) -> exact RNE onto the E4M3 grid (`_fp8.cast_to_fp8`: the device's own cast where it rounds so)
-> store. The bytes equal the reference's (`reference.formats.quantize_per_token`,
`reference.einsum.quantize_attn_output`) in both FP8 formats, on the GPU and in the CPU interpreter — NaN and
Inf included (a block holding a NaN gets the reference's scale 2^127 and keeps its NaN; an Inf saturates to
the format's max).

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from optimized.triton._fp8 import (
    cast_to_fp8,
    fp8_constants,
    native_fp8_cast,
    pow2_reciprocal,
    prepare_interpreter,
    ue8m0_scale,
)
from optimized.triton._pdl import pdl_launch, pdl_wait
from optimized.triton.aot import AotSpec
from reference.einsum import ATTN_OUT_EPS, SCALE_BLOCK, check_attn_output_args
from reference.formats import ACT_EPS, FP8Format, fp8_format

SCALE_LAYOUTS = ("row_major", "deepgemm")
TMA_ALIGN_FP32 = 4  # TMA needs 16-byte aligned strides: 4 fp32 scales
# Elements per program of the per-token kernel: BLOCK_M rows x one scale block (4096 values, 8 KB bf16).
_TILE_ELEMENTS = 4096


@triton.jit
def _amax(x, axis: tl.constexpr):
    """max |x| along `axis`, +inf where the run holds a NaN (`tl.max` drops NaN, on GPUs and in the interpreter;
    a NaN-propagating `tl.reduce` would run element by element in the interpreter). `ue8m0_scale` gives +inf and
    NaN the same scale, 2^127 (the exponent byte clamps at 254): the reference's NaN-block scale."""
    a = tl.abs(x)
    return tl.max(tl.where(a != a, float("inf"), a), axis)


@triton.jit
def _block_scale(x, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    """Power-of-two scale of each row of `x` [rows, BLOCK] (fp32)."""
    return ue8m0_scale(_amax(x, 1), FP8_MAX, EPS)


@triton.jit
def _to_fp8(xs, out_dtype: tl.constexpr, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
            HAS_NEG_ZERO: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """Scaled values `xs` rounded onto the FP8 grid and cast to `out_dtype`; NaN stays NaN.

    The native cast writes NaN as 0x7F itself. The clamps of `round_to_fp8_grid` would turn a NaN into +-FP8_MAX,
    so there NaN elements get the format's NaN byte (0x7F e4m3fn, 0x80 e4m3fnuz) by bitcast, which every backend
    and the interpreter store as is.
    """
    q = cast_to_fp8(xs, out_dtype, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO, NATIVE_CAST)
    if NATIVE_CAST:
        return q
    nan = tl.full(xs.shape, 0x7F if HAS_NEG_ZERO else 0x80, tl.uint8).to(out_dtype, bitcast=True)
    return tl.where(xs != xs, nan, q)


@triton.jit
def _quantize_rows(x, scale, out_dtype: tl.constexpr, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
                   HAS_NEG_ZERO: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """`x / scale` (one scale per row; `1 / scale` built from the scale's exponent bits by `pow2_reciprocal`:
    exact) as FP8 (`_to_fp8`)."""
    xs = x * pow2_reciprocal(scale)[:, None]
    return _to_fp8(xs, out_dtype, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO, NATIVE_CAST)


@triton.jit
def _quant_per_token_kernel(
    x_ptr, q_ptr, s_ptr,
    M, M_PAD, stride_xm, stride_qm, stride_sm, stride_sk,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, EPS: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr, NATIVE_CAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program = BLOCK_M rows x one block of BLOCK channels: load, amax, scale, round, store."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    valid = rows < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    scale = _block_scale(x, FP8_MAX, EPS)
    q = _quantize_rows(x, scale, q_ptr.dtype.element_ty, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO, NATIVE_CAST)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=valid[:, None])
    # padding rows (M <= row < M_PAD) of the DeepGEMM layout get scale 0
    tl.store(s_ptr + rows * stride_sm + kb * stride_sk, tl.where(valid, scale, 0.0), mask=rows < M_PAD)


@triton.jit(do_not_specialize=["T", "ROWS_TOTAL"])
def _inv_rope_quant_kernel(
    o_ptr, cos_ptr, sin_ptr, q_ptr, s_ptr,
    T, ROWS_TOTAL, GROUPS, stride_ot, stride_oh, stride_qt, stride_qg, stride_st, stride_sg, stride_sk,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, EPS: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr, NATIVE_CAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program = ROWS consecutive scale blocks of the flattened (token, group, block) space, as a
    [ROWS, BLOCK] tile: load, inverse RoPE, amax, scale, round, store.

    Rows of tokens t >= T (padding rows of the DeepGEMM scale layout) only write scale 0. When a head is a
    whole number of blocks each row is one contiguous run of `o`, so loads and stores are 16-byte vectors.
    DSv4's heads take `_inv_rope_quant_heads_kernel` instead.
    """
    pdl_wait(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t = rows // (GROUPS * NUM_BLOCKS)
    g = (rows // NUM_BLOCKS) % GROUPS
    kb = rows % NUM_BLOCKS
    in_space = rows < ROWS_TOTAL
    valid = in_space & (t < T)
    c = tl.arange(0, BLOCK)
    if HEAD_DIM % BLOCK == 0:
        head = kb // (HEAD_DIM // BLOCK)
        d0 = (kb % (HEAD_DIM // BLOCK)) * BLOCK
        src = o_ptr + (t * stride_ot + (g * HEADS_PER_GROUP + head) * stride_oh + d0)[:, None] + c[None, :]
    else:  # a block spans heads: per-element head and dim
        col = kb[:, None] * BLOCK + c[None, :]
        src = o_ptr + t[:, None] * stride_ot + (g[:, None] * HEADS_PER_GROUP + col // HEAD_DIM) * stride_oh \
            + col % HEAD_DIM
    x = tl.load(src, mask=valid[:, None], other=0.0).to(tl.float32)

    # inverse GPT-J RoPE on the last ROPE_DIM dims of each head, in fp32 (spec §2.8), on (even, odd) pairs:
    #   x_e' = x_e cos + x_o sin,  x_o' = x_o cos - x_e sin  (a head's dim count is even: pairs never straddle)
    even, odd = tl.split(tl.reshape(x, (ROWS, BLOCK // 2, 2)))
    d_even = (kb[:, None] * BLOCK + 2 * tl.arange(0, BLOCK // 2)[None, :]) % HEAD_DIM
    is_rope = valid[:, None] & (d_even >= HEAD_DIM - ROPE_DIM)
    pair = t[:, None] * (ROPE_DIM // 2) + tl.maximum(d_even - (HEAD_DIM - ROPE_DIM), 0) // 2
    cos = tl.load(cos_ptr + pair, mask=is_rope, other=1.0)
    sin = tl.load(sin_ptr + pair, mask=is_rope, other=0.0)
    even_rot = tl.where(is_rope, even * cos + odd * sin, even)
    odd_rot = tl.where(is_rope, odd * cos - even * sin, odd)
    x = tl.reshape(tl.join(even_rot, odd_rot), (ROWS, BLOCK))

    # per-row (= per-block) amax -> power-of-two scale -> exact FP8 rounding
    scale = _block_scale(x, FP8_MAX, EPS)
    q = _quantize_rows(x, scale, q_ptr.dtype.element_ty, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO, NATIVE_CAST)
    dst = q_ptr + (t * stride_qt + g * stride_qg + kb * BLOCK)[:, None] + c[None, :]
    tl.store(dst, q, mask=valid[:, None])
    tl.store(s_ptr + t * stride_st + g * stride_sg + kb * stride_sk, tl.where(valid, scale, 0.0), mask=in_space)


@triton.jit(do_not_specialize=["T", "HEAD_ROWS"])
def _inv_rope_quant_heads_kernel(
    o_ptr, cos_ptr, sin_ptr, q_ptr, s_ptr,
    T, HEAD_ROWS, N_HEADS, stride_ot, stride_oh, stride_qt, stride_qg, stride_st, stride_sg, stride_sk,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HEADS: tl.constexpr, EPS: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr, NATIVE_CAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program = HEADS consecutive (token, head) rows of `o`, each a power-of-two number of whole scale
    blocks with all its RoPE dims in the last block (DSv4: 512 = 4 x 128, RoPE dims 448..511): the same
    bytes as `_inv_rope_quant_kernel` with the rotation done on the RoPE dims alone.

    The head is loaded as a [HEADS, NB, BLOCK] tile and its RoPE dims a second time as one [HEADS, ROPE_DIM] run
    (from L1 / L2), split into (even, odd) pairs whose cos / sin every head of the token shares. The tile's own
    copy of those dims only fills the amax with zeros and is not stored. Rows of tokens t >= T (padding rows of the
    DeepGEMM scale layout) only write scale 0.
    """
    pdl_wait(PDL)
    NB: tl.constexpr = HEAD_DIM // BLOCK
    NOPE_DIM: tl.constexpr = HEAD_DIM - ROPE_DIM
    HALF: tl.constexpr = ROPE_DIM // 2
    r = tl.program_id(0).to(tl.int64) * HEADS + tl.arange(0, HEADS)
    t = r // N_HEADS
    h = r % N_HEADS
    in_space = r < HEAD_ROWS
    valid = in_space & (t < T)
    b = tl.arange(0, NB)
    col = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [NB, BLOCK] dim within the head
    src = o_ptr + t * stride_ot + h * stride_oh
    x = tl.load(src[:, None, None] + col[None, :, :], mask=valid[:, None, None], other=0.0).to(tl.float32)
    pairs = tl.load(src[:, None] + NOPE_DIM + tl.arange(0, ROPE_DIM)[None, :], mask=valid[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(pairs.to(tl.float32), (HEADS, HALF, 2)))
    angle = t[:, None] * HALF + tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + angle, mask=valid[:, None], other=1.0)
    sin = tl.load(sin_ptr + angle, mask=valid[:, None], other=0.0)
    # inverse GPT-J RoPE in fp32 (spec §2.8): x_e' = x_e cos + x_o sin,  x_o' = x_o cos - x_e sin
    even_rot = even * cos + odd * sin
    odd_rot = odd * cos - even * sin

    # per-block amax -> power-of-two scale; the last block's amax takes the rotated dims in place of its copy
    is_rope = (col >= NOPE_DIM)[None, :, :]
    block_amax = _amax(tl.where(is_rope, 0.0, x), 2)  # [HEADS, NB]
    is_last = (b == NB - 1)[None, :]
    # the last block: its NoPE amax (already |x|, NaN-free) and its rotated pairs' amaxes
    last_amax = tl.maximum(tl.maximum(tl.max(tl.where(is_last, block_amax, 0.0), 1), _amax(even_rot, 1)),
                           _amax(odd_rot, 1))  # [HEADS]
    scale = ue8m0_scale(tl.where(is_last, last_amax[:, None], block_amax), FP8_MAX, EPS)
    last_inverse = pow2_reciprocal(ue8m0_scale(last_amax, FP8_MAX, EPS))[:, None]

    out_dtype: tl.constexpr = q_ptr.dtype.element_ty
    g = h // HEADS_PER_GROUP
    dst = q_ptr + t * stride_qt + g * stride_qg + (h % HEADS_PER_GROUP) * HEAD_DIM
    q = _to_fp8(x * pow2_reciprocal(scale)[:, :, None], out_dtype, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO, NATIVE_CAST)
    tl.store(dst[:, None, None] + col[None, :, :], q, mask=valid[:, None, None] & ~is_rope)
    q_even = _to_fp8(even_rot * last_inverse, out_dtype, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO, NATIVE_CAST)
    q_odd = _to_fp8(odd_rot * last_inverse, out_dtype, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO, NATIVE_CAST)
    q_pairs = tl.reshape(tl.join(q_even, q_odd), (HEADS, ROPE_DIM))
    tl.store(dst[:, None] + NOPE_DIM + tl.arange(0, ROPE_DIM)[None, :], q_pairs, mask=valid[:, None])
    dst_scale = s_ptr + t * stride_st + g * stride_sg + (h % HEADS_PER_GROUP) * NB * stride_sk
    tl.store(dst_scale[:, None] + b[None, :] * stride_sk, tl.where(valid[:, None], scale, 0.0),
             mask=in_space[:, None])


@dataclass(frozen=True)
class QuantConfig:
    """Launch configuration of the attention-output quantization.

    Attributes:
        rows: scale blocks (rows of 128 channels) per program; a power of two. The head-tiled kernel takes
            `rows / (head_dim / 128)` whole heads (at least one).
        num_warps: Triton launch option.
    """

    rows: int
    num_warps: int


# (largest T, config) rows, first match wins; `python -m benchmarks.sweep_einsum` times the alternatives.
QUANT_TABLE: tuple[tuple[int, QuantConfig], ...] = (
    (16, QuantConfig(8, 2)),  # decode: a few hundred blocks, spread them over the SMs
    # 16 whole heads (16 KB of bf16) per program: H100 T = 4096 145.2 us against 149.0 with 8 heads and 167.5 with 4
    # (design note 33); eight 16-byte loads per thread
    (1 << 62, QuantConfig(64, 4)),
)


def head_kernel_fits(head_dim: int, rope_dim: int) -> bool:
    """Whether `_inv_rope_quant_heads_kernel` takes heads of `head_dim` with `rope_dim` RoPE dims: a power-of-two
    number of whole scale blocks, the RoPE dims (a power of two) inside the last one. DSv4 (512, 64) does."""
    blocks = head_dim // SCALE_BLOCK
    return (head_dim % SCALE_BLOCK == 0 and blocks & (blocks - 1) == 0 and rope_dim <= SCALE_BLOCK
            and rope_dim & (rope_dim - 1) == 0)


def program_heads(config: QuantConfig, head_dim: int) -> int:
    """Heads per program of `_inv_rope_quant_heads_kernel` under `config`: its `rows` scale blocks as whole heads
    (at least one)."""
    return max(1, config.rows // (head_dim // SCALE_BLOCK))


def choose_quant_config(t: int) -> QuantConfig:
    """The row of `QUANT_TABLE` for T tokens."""
    return next(config for bound, config in QUANT_TABLE if t <= bound)


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


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (`triton.cdiv` goes through Triton's constexpr wrapper: ~10 us a call)."""
    return -(-a // b)


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
    k = x.shape[1]
    if k % block:
        raise ValueError(f"x: K = {k} is not a multiple of the block size {block}")
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"x: the last dim must be contiguous (stride 1), got strides {tuple(x.stride())}")
    if not eps > 0:
        raise ValueError(f"eps: expected a positive amax floor, got {eps!r}")
    check_fp8_support(f, x.device, "fmt")
    return quantize_per_token_checked(x, block, f, scale_layout, eps)


def quantize_per_token_checked(
    x: torch.Tensor,
    block: int,
    fmt: str | FP8Format,
    scale_layout: str = "row_major",
    eps: float = ACT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token` for callers that have validated its arguments (the FP8 linears: a 2-d bf16 x with a
    unit last stride, K a multiple of 128, a Numerics act_block, a format the device supports)."""
    f = fp8_format(fmt)
    m, k = x.shape
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
    grid = (cdiv(m_pad, block_m), nb)
    _quant_per_token_kernel[grid](
        x, q, s, m, m_pad, x.stride(0), k, stride_sm, stride_sk,
        BLOCK=block, BLOCK_M=block_m, EPS=eps, **fp8_constants(f), NATIVE_CAST=native_fp8_cast(f, x.device),
        num_warps=4, enable_fp_fusion=False,
        **pdl_launch(),
    )
    return q, s


def check_attn_output_supported(o: torch.Tensor, fmt: str | FP8Format, scale_layout: str) -> FP8Format:
    """What the Triton kernel needs beyond `check_attn_output_args` (raises ValueError naming the argument)."""
    _check_layout(scale_layout)
    if o.stride(2) != 1:
        raise ValueError(f"o: the last dim must be contiguous (stride 1), got strides {tuple(o.stride())}")
    if o.shape[2] % 2:
        raise ValueError(f"o: the triton kernel rotates (even, odd) pairs of a head and needs an even head_dim, "
                         f"got {o.shape[2]}")
    f = fp8_format(fmt)
    check_fp8_support(f, o.device, "fmt")
    return f


def quantize_attn_output(
    o: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    n_groups: int,
    fmt: str | FP8Format = "e4m3fn",
    scale_layout: str = "row_major",
    config: QuantConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused inverse RoPE + per-128 FP8 quantization of the attention output; bytes equal
    `reference.einsum.quantize_attn_output`.

    cos / sin are a torch table computed as the reference computes them (`fp32(p) * f`, then torch's `cos`
    and `sin`) rather than the kernel's own `cos`/`sin`, which are not bitwise equal to torch's: [2, T,
    rope_dim/2] fp32, three small torch ops.

    Args:
        o: [T, H, head_dim] bf16, last dim contiguous, head_dim even.
        positions: [T] int.
        freqs: [rope_dim / 2] fp32.
        n_groups: G.
        fmt: FP8 format.
        scale_layout: `"row_major"` or `"deepgemm"` (see the module docstring).
        config: rows per program and warps; `choose_quant_config(T)` when None (benchmarks and sweeps).

    Returns:
        o_fp8: [T, G, H/G*head_dim] FP8, a transposed view of a contiguous [G, T, H/G*head_dim] tensor
            (DeepGEMM needs `o_fp8.permute(1, 0, 2)` to have a unit last stride; per group the rows
            are contiguous, which the Triton einsum's A tiles like too).
        o_scale: [T, G, H/G*head_dim/128] fp32 in `scale_layout`.
    """
    check_attn_output_args(o, positions, freqs, n_groups, fmt)
    return quantize_attn_output_checked(o, positions, freqs, n_groups=n_groups, fmt=fmt, scale_layout=scale_layout,
                                        config=config)


def attn_output_buffers(t: int, n_groups: int, group_dim: int, dtype: torch.dtype, device: torch.device,
                        scale_layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of `quantize_attn_output` (see there), and the scale layout's padding rows.

    Returns:
        o_fp8: [T, G, group_dim] view of [G, T, group_dim] storage.
        o_scale: [T, G, group_dim / 128] fp32 in `scale_layout`.
        padding: [align(T, 4) - T, G, group_dim / 128], the DeepGEMM layout's padding rows (whoever writes
            `o_scale` writes 0 there); empty for row-major scales.
    """
    nb = group_dim // SCALE_BLOCK
    o_fp8 = torch.empty((n_groups, t, group_dim), dtype=dtype, device=device).transpose(0, 1)
    if scale_layout == "deepgemm":
        storage = torch.empty((n_groups, nb, _aligned(t)), dtype=torch.float32, device=device)
        rows = storage.permute(2, 0, 1)  # [T4, G, nb], strides (1, nb * T4, T4)
        return o_fp8, rows[:t], rows[t:]
    o_scale = torch.empty((t, n_groups, nb), dtype=torch.float32, device=device)
    return o_fp8, o_scale, o_scale[t:]


def rope_table(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """[2, T, d/2] fp32: the reference's `rope_cos_sin` (fp32(p) * f: the int -> fp32 promotion of torch.mul
    rounds as .to does), cos then sin, each contiguous."""
    table = torch.empty((2, positions.shape[0], freqs.shape[0]), dtype=torch.float32, device=positions.device)
    angles = torch.mul(positions[:, None], freqs)
    torch.cos(angles, out=table[0])
    torch.sin(angles, out=table[1])
    return table


def quantize_attn_output_checked(
    o: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    n_groups: int,
    fmt: str | FP8Format = "e4m3fn",
    scale_layout: str = "row_major",
    config: QuantConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_attn_output` for arguments that already passed `check_attn_output_args` (the public op's
    validation); runs only the Triton-specific checks before it launches."""
    f = check_attn_output_supported(o, fmt, scale_layout)
    t, h, head_dim = o.shape
    heads_per_group = h // n_groups
    group_dim = heads_per_group * head_dim
    nb = group_dim // SCALE_BLOCK
    o_fp8, o_scale, padding = attn_output_buffers(t, n_groups, group_dim, f.dtype, o.device, scale_layout)
    t_pad = t + padding.shape[0]
    stride_st, stride_sg, stride_sk = o_scale.stride()
    if t_pad == 0:
        return o_fp8, o_scale
    if config is None:
        config = choose_quant_config(t)
    prepare_interpreter()
    table = rope_table(positions, freqs)
    half = freqs.shape[0]
    fp8_kwargs = {**fp8_constants(f), "NATIVE_CAST": native_fp8_cast(f, o.device), "EPS": ATTN_OUT_EPS,
                  **pdl_launch()}
    if head_kernel_fits(head_dim, 2 * half):
        heads = program_heads(config, head_dim)
        _inv_rope_quant_heads_kernel[(-(-t_pad * h // heads),)](
            o, table[0], table[1], o_fp8, o_scale,
            t, t_pad * h, h, o.stride(0), o.stride(1), o_fp8.stride(0), o_fp8.stride(1),
            stride_st, stride_sg, stride_sk,
            HEADS_PER_GROUP=heads_per_group, HEAD_DIM=head_dim, ROPE_DIM=2 * half, BLOCK=SCALE_BLOCK, HEADS=heads,
            **fp8_kwargs, num_warps=config.num_warps, enable_fp_fusion=False,
        )
        return o_fp8, o_scale
    rows_total = t_pad * n_groups * nb
    _inv_rope_quant_kernel[(-(-rows_total // config.rows),)](
        o, table[0], table[1], o_fp8, o_scale,
        t, rows_total, n_groups, o.stride(0), o.stride(1), o_fp8.stride(0), o_fp8.stride(1),
        stride_st, stride_sg, stride_sk,
        HEADS_PER_GROUP=heads_per_group, HEAD_DIM=head_dim, ROPE_DIM=2 * half,
        NUM_BLOCKS=nb, BLOCK=SCALE_BLOCK, ROWS=config.rows, **fp8_kwargs, num_warps=config.num_warps,
        enable_fp_fusion=False,
    )
    return o_fp8, o_scale


# Launch configurations compiled ahead of time (optimized.triton.aot): the attention output of FLASH and
# PRO (8 heads x 512 per group, 64 RoPE dims: the head-tiled kernel), the block-tiled kernel on heads of 64 dims
# (two to a scale block), and the per-token kernel at its three block sizes.
_ATTN_SIGNATURE = {"o_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": "*{fp8}", "s_ptr": "*fp32"}
_ATTN_ALIGNED = ("o_ptr", "cos_ptr", "sin_ptr", "q_ptr", "s_ptr", "stride_ot", "stride_oh", "stride_qt", "stride_qg")
AOT_SPECS = [
    *(
        AotSpec(
            name=f"inv_rope_quant_heads[hpg=8,head=512,heads={program_heads(config, 512)}]",
            kernel=_inv_rope_quant_heads_kernel,
            signature={**_ATTN_SIGNATURE,
                       **dict.fromkeys(("T", "HEAD_ROWS", "N_HEADS", "stride_ot", "stride_oh", "stride_qt", "stride_qg",
                                        "stride_st", "stride_sg", "stride_sk"), "i32")},
            constexprs={"HEADS_PER_GROUP": 8, "HEAD_DIM": 512, "ROPE_DIM": 64, "BLOCK": SCALE_BLOCK,
                        "HEADS": program_heads(config, 512), "EPS": ATTN_OUT_EPS},
            fp8=True,
            num_warps=config.num_warps,
            aligned=_ATTN_ALIGNED,
        )
        for _, config in QUANT_TABLE
    ),
    AotSpec(
        name="inv_rope_quant[hpg=8,head=64,rows=32]",
        kernel=_inv_rope_quant_kernel,
        signature={**_ATTN_SIGNATURE,
                   **dict.fromkeys(("T", "ROWS_TOTAL", "GROUPS", "stride_ot", "stride_oh", "stride_qt", "stride_qg",
                                    "stride_st", "stride_sg", "stride_sk"), "i32")},
        constexprs={"HEADS_PER_GROUP": 8, "HEAD_DIM": 64, "ROPE_DIM": 16, "NUM_BLOCKS": 4, "BLOCK": SCALE_BLOCK,
                    "ROWS": 32, "EPS": ATTN_OUT_EPS},
        fp8=True,
        aligned=_ATTN_ALIGNED,
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
