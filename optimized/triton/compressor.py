"""The KV compressor as Triton kernels (spec §3.3): projections, then gated softmax pooling per channel.

`projections`: `[a | b] = x [Wkv; Wgate]^T` in one GEMM (bf16 operands, fp32 accumulation and output — the
products of bf16 values are exact, so this is `reference.compressor.compressor_projections`' fp32 linear up to
the summation order) with `ape[p mod m]` added to the score half in the epilogue.

`pool`: entry `e` pools the `coff * m` slot rows `entry_rows[e] ..` of a slot buffer (state rows followed by
the new tokens' rows): for ratio 4 the first 4 slots read the channels `[0, d)` of the previous block and the
last 4 the channels `[d, 2d)` of the entry's own block; for ratio 128 the 128 slots read channels `[0, d)`.
Per channel, a softmax over the slots (slots with score -inf weigh 0) weights the values:
`u = sum_s (e^{b_s - max} / sum e^{b - max}) a_s`, in the reference's order of operations (normalized
weights, then the weighted sum), all in fp32. The entries are finished (norm, RoPE, quantization) by
`optimized.triton.rope_quant.rope_quant`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.backends import detect
from optimized.triton._fp8 import prepare_interpreter
from optimized.triton.aot import AotSpec

# projection GEMM tiles
PROJ_BLOCK_M = 64
PROJ_BLOCK_N = 64
PROJ_BLOCK_K = 64
PROJ_NUM_WARPS = 4
PROJ_NUM_STAGES = 3
# pooling: channels per program (all slots of an entry are in one tile: 8 for ratio 4, 128 for ratio 128)
POOL_BLOCK_C = {4: 128, 128: 32}
POOL_NUM_WARPS = 4
# the CPU interpreter pays per operation, not per element: wide tiles
INTERPRETER_PROJ_BLOCK_N = 512


@triton.jit
def _projection_kernel(
    x_ptr, w_ptr, ape_ptr, pos_ptr, out_ptr, M, N, K, score_col, ratio,
    stride_xm, stride_wn, stride_ape, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k] (fp32), plus ape[pos[m] mod ratio, n - score_col] for n >= score_col."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    r64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + r64[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += tl.dot(a, tl.trans(b))
    # epilogue: the score half gets the additive position embedding of the token's slot in its block
    slot = tl.load(pos_ptr + rows, mask=row_ok, other=0) % ratio
    is_score = cols >= score_col
    ape = tl.load(ape_ptr + slot[:, None] * stride_ape + (cols - score_col)[None, :],
                  mask=row_ok[:, None] & (col_ok & is_score)[None, :], other=0.0)
    tl.store(out_ptr + r64[:, None] * stride_om + cols[None, :], acc + ape, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _pool_kernel(
    slots_ptr, entry_rows_ptr, out_ptr, n_entries, d, score_col, stride_s, stride_o,
    RATIO: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program = one entry x BLOCK_C channels: per-channel softmax over the entry's slots, weighted sum."""
    e = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < d
    n_slots: tl.constexpr = RATIO * (2 if OVERLAP else 1)
    slot = tl.arange(0, n_slots)
    first = tl.load(entry_rows_ptr + e).to(tl.int64)
    # overlap: slots [0, RATIO) are the previous block's first-d channels, [RATIO, 2 RATIO) the own block's last d
    if OVERLAP:
        col = chans[None, :] + tl.where(slot >= RATIO, d, 0)[:, None]
    else:
        col = chans[None, :] + tl.zeros_like(slot)[:, None]
    rows = first + slot
    mask = tl.broadcast_to(chan_ok[None, :], (n_slots, BLOCK_C))
    a = tl.load(slots_ptr + rows[:, None] * stride_s + col, mask=mask, other=0.0)
    b = tl.load(slots_ptr + rows[:, None] * stride_s + score_col + col, mask=mask, other=float("-inf"))
    b_max = tl.max(b, axis=0)
    weight = tl.exp(b - b_max[None, :])
    weight = tl.math.div_rn(weight, tl.sum(weight, axis=0)[None, :])
    u = tl.sum(weight * a, axis=0)
    tl.store(out_ptr + e.to(tl.int64) * stride_o + chans, u, mask=chan_ok)


def projections(x: torch.Tensor, w_cat: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`[a | b]` of every token: `x [Wkv; Wgate]^T` in fp32, `ape[p mod m]` added to `b`.

    Args:
        x: [T, D] bf16 (last dim contiguous).
        w_cat: [2C, D] bf16, `cat(wkv, wgate)` (C = coff * d).
        ape: [m, C] fp32.
        positions: [T] int.

    Returns:
        [T, 2C] fp32: columns [0, C) = a, [C, 2C) = b.
    """
    prepare_interpreter()
    n_tokens, dim = x.shape
    n_out = w_cat.shape[0]
    out = torch.empty((n_tokens, n_out), dtype=torch.float32, device=x.device)
    if n_tokens == 0:
        return out
    block_n = INTERPRETER_PROJ_BLOCK_N if detect().interpret else PROJ_BLOCK_N
    grid = (triton.cdiv(n_tokens, PROJ_BLOCK_M), triton.cdiv(n_out, block_n))
    _projection_kernel[grid](
        x, w_cat, ape, positions, out, n_tokens, n_out, dim, n_out // 2, ape.shape[0],
        x.stride(0), w_cat.stride(0), ape.stride(0), out.stride(0),
        BLOCK_M=PROJ_BLOCK_M, BLOCK_N=block_n, BLOCK_K=PROJ_BLOCK_K,
        num_warps=PROJ_NUM_WARPS, num_stages=PROJ_NUM_STAGES,
    )
    return out


def pool(slots: torch.Tensor, entry_rows: torch.Tensor, *, ratio: int, head_dim: int) -> torch.Tensor:
    """Pooled entries `u` [n, d] fp32 from a slot buffer.

    Args:
        slots: [R, 2C] fp32 rows `[a | b]` (state rows and new tokens, as laid out by the caller).
        entry_rows: [n] int32: entry e pools rows `entry_rows[e] .. + coff * ratio` of `slots`.
        ratio: 4 (overlapping, coff 2) or 128 (coff 1).
        head_dim: d.

    Returns:
        [n, d] fp32.
    """
    prepare_interpreter()
    n_entries = entry_rows.shape[0]
    out = torch.empty((n_entries, head_dim), dtype=torch.float32, device=slots.device)
    if n_entries == 0:
        return out
    block_c = triton.next_power_of_2(head_dim) if detect().interpret else POOL_BLOCK_C[ratio]
    _pool_kernel[(n_entries, triton.cdiv(head_dim, block_c))](
        slots, entry_rows, out, n_entries, head_dim, slots.shape[1] // 2, slots.stride(0), out.stride(0),
        RATIO=ratio, OVERLAP=ratio == 4, BLOCK_C=block_c, num_warps=POOL_NUM_WARPS,
    )
    return out


_PROJ_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*bf16", "ape_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": "*fp32", "M": "i32",
    "N": "i32", "K": "i32", "score_col": "i32", "ratio": "i32", "stride_xm": "i32", "stride_wn": "i32",
    "stride_ape": "i32", "stride_om": "i32",
}
_POOL_SIGNATURE = {
    "slots_ptr": "*fp32", "entry_rows_ptr": "*i32", "out_ptr": "*fp32", "n_entries": "i32", "d": "i32",
    "score_col": "i32", "stride_s": "i32", "stride_o": "i32",
}

AOT_SPECS = [
    AotSpec("compressor_projection", _projection_kernel, _PROJ_SIGNATURE,
            {"BLOCK_M": PROJ_BLOCK_M, "BLOCK_N": PROJ_BLOCK_N, "BLOCK_K": PROJ_BLOCK_K},
            num_warps=PROJ_NUM_WARPS, num_stages=PROJ_NUM_STAGES,
            aligned=("x_ptr", "w_ptr", "ape_ptr", "pos_ptr", "out_ptr", "M", "N", "K", "score_col",
                     "stride_xm", "stride_wn", "stride_ape", "stride_om")),
] + [
    AotSpec(f"compressor_pool[ratio={ratio}]", _pool_kernel, _POOL_SIGNATURE,
            {"RATIO": ratio, "OVERLAP": ratio == 4, "BLOCK_C": POOL_BLOCK_C[ratio]}, num_warps=POOL_NUM_WARPS,
            aligned=("slots_ptr", "entry_rows_ptr", "out_ptr", "d", "score_col", "stride_s", "stride_o"))
    for ratio in (4, 128)
]
