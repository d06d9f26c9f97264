"""Sparse attention with a per-head sink over gathered KV rows (spec §3.5), bf16 rows or the 584-byte FP8 cache.

For token t and head h: `o = sum_i e^{z_i - M} kv_i / (sum_i e^{z_i - M} + e^{sink_h - M})` over the rows
`kv[indices[t, :]]` (`-1` = empty slot), `z_i = scale * q_h . kv_i`. DSv4 has one KV head (MQA) shared by all
query heads, and the same row is the key and the value, so one program loads a tile of gathered rows once and
uses it for a block of heads, first as K (`S = Q K^T`, M = heads, N = rows, K = 512) and then as V (`O += P V`).

Numerics (the official TileLang kernel's): logits and the online softmax in fp32, the probabilities rounded to
bf16 before `P V`, fp32 accumulation, bf16 output, the sink added to the denominator at the end (not scaled),
rows whose slots are all empty give 0. The softmax is online (the running maximum rescales the accumulator),
so P is rounded relative to the running maximum rather than the global one: the same function, with
bf16 roundings in other places than the reference's (compared under the torch-relative tier).

Packed cache rows (`reference.cache` layout, 584 bytes per token): 448 FP8 NoPE values, 64 bf16 RoPE values
(128 bytes), 7 UE8M0 scale bytes (one per 64 NoPE dims), 1 pad byte. The kernel gathers a row tile, decodes
`fp8 * 2^(e - 127)` in fp32 (exact: the product of an E4M3 value and a power of two is a bf16 value) and uses
the bf16 tile as above, so reading the packed cache equals reading its unpacked bf16 rows.

On sm_90 GPUs every launch of 64-head programs (prefill, and decode from 33 tokens at FLASH; bf16 or packed
rows, with or without split-KV) runs the same loop as a warp-specialized Gluon kernel: a producer warpgroup
gathers (and decodes) the rows, and the two consumer warpgroups split S between them (`sparse_attention_sm90`).

Decode has few tokens, so the candidates of each (token, head block) can be split over several programs
(split-KV); each writes its unnormalised fp32 accumulator and its (max, sum) pair, and a second kernel merges the
splits in a fixed order with the sink. No atomics: results are bitwise reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from optimized.backends import detect
from optimized.triton import quant
from optimized.triton import sparse_attention_sm90 as sm90
from optimized.triton._fp8 import prepare_interpreter
from optimized.triton._pdl import pdl_launch, pdl_wait
from optimized.triton.aot import ALL_TARGETS, PLATFORM_TARGETS, AotSpec, tile_platform

HEAD_DIM = 512
NOPE_DIM = 448
KV_SCALE_BLOCK = 64  # NoPE dims per UE8M0 scale byte
PACKED_ROW_BYTES = 584  # 448 fp8 + 128 (64 bf16) + 7 scales + 1 pad
PACKED_ROPE_OFFSET = 448  # bytes
PACKED_SCALE_OFFSET = 576  # bytes


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch.

    Attributes:
        block_h: query heads per program (the MMA's M); fewer heads are padded to 16, tl.dot's smallest M
            (the official kernel pads local heads to 16 too).
        block_n: gathered rows per step (N of S = Q K^T, K of O += P V).
        num_warps, num_stages: Triton launch options.
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


# Tiles (any tiling computes the same function). 64 heads per program fill a Hopper warpgroup MMA (M = 64) and
# share each gathered tile; 16 heads (tl.dot's smallest M) when the tokens are too few to fill the SMs.
# NVIDIA: the fastest spill-free tiles of the H200 sweep (`python -m benchmarks.sweep_attention`, results in
# docs/h200/sweep-attention.json): 64 rows per step instead of 16 took FLASH prefill of 8192 tokens from 6.09 to
# 3.29 ms and decode of batch 64 over the FP8 cache from 258 to 55 us. With packed rows 2 stages spill on sm_90,
# 3 do not. On gfx942 / gfx950 the 64 x 64 tiles spill (the fp32 [64, 512] accumulator and a [64, 512] bf16
# tile exceed 256 VGPRs), so 64 heads keep 16 rows per step there (not measured: no ROCm GPU here). The 16-head
# tile is spill-free on all three targets (`python -m optimized.triton.aot`).
WIDE = {  # 64 heads per program: by platform (`tile_platform()`), then by packed rows or not
    "nvidia": {False: LaunchConfig(64, 64, 8, 2), True: LaunchConfig(64, 64, 8, 3)},
    "amd": {False: LaunchConfig(64, 16, 8, 2), True: LaunchConfig(64, 16, 8, 2)},
}
NARROW = LaunchConfig(16, 64, 8, 1)
# The CPU interpreter pays per operation, not per element: fewer, wider steps (same function; the online
# softmax then rescales at other places, within the same bf16-P tolerance).
INTERPRETER_BLOCK_N = 128
BLOCK_H_MIN = 16
# Decode has few tokens. When the 64-head programs would fill less than 1 / NARROW_BELOW of the SMs, the heads of
# a token are spread over 4x more programs (each reads the token's rows, the repeats hit L2), NARROW's 16 heads
# each; if there are still fewer programs than SMs, the candidates are split over floor(SMs / programs) programs
# (split-KV: every split writes a [heads, 512] fp32 partial), each split keeping at least MIN_ROWS_PER_SPLIT
# candidates. The H200 sweep's best per decode batch follows this rule: FLASH batch 64 -> 64 heads, 2 splits;
# batch 128 -> 64 heads, none; batch 8 -> 16 heads, 4 splits; batch 1 -> 16 heads, 5 splits.
NARROW_BELOW = 4
MIN_ROWS_PER_SPLIT = 128
MAX_SPLITS = 32
# The merge reads every split's [heads, 512] fp32 partial once: a memory-bound pass, cut into [8 heads, 128
# columns] programs (8 fp32 values per thread per split) so that there are enough of them to keep the loads in
# flight (FLASH decode of batch 64, 2 splits: 2048 programs). Same-run A/B on an H100 (bitwise equal outputs,
# docs/h200/ab-sparse-attention-merge-tile-h100.json): against the previous [16 heads, 512 columns] programs,
# decode over the packed cache at batch 1 26.3 -> 21.3 us, batch 8 30.8 -> 26.9, batch 64 42.7 -> 41.4;
# [16, 64] and [16, 128] are within 0.5 us of it everywhere.
MERGE_BLOCK_H = 8
MERGE_BLOCK_D = 128
MERGE_NUM_WARPS = 4


@triton.jit
def _load_kv_tile(kv_ptr, kv_rope_ptr, kv_scale_ptr, rows, valid, stride_kv,
                  PACKED: tl.constexpr, N_CHUNKS: tl.constexpr, NOPE_CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                  ROW_BYTES: tl.constexpr, ROPE_OFFSET: tl.constexpr, SCALE_OFFSET: tl.constexpr):
    """Gather the rows `rows` (int64, masked by `valid`) as a `[BLOCK_N, N_CHUNKS * 64]` bf16 tile; empty slots
    load zeros."""
    if PACKED:
        # Packed rows have the constant stride ROW_BYTES (a constexpr, so the compiler knows every row is
        # 8-byte aligned and vectorizes the gathers). The NoPE bytes are loaded as [rows, chunks, 64]; chunk 7
        # takes the 64 bf16 RoPE values instead. The product of an E4M3 value and a power of two is a bf16
        # value, so the dequantized tile is exact.
        chunks = tl.arange(0, N_CHUNKS)
        cols = tl.arange(0, CHUNK)
        is_nope = chunks < NOPE_CHUNKS
        nope_ok = valid[:, None, None] & is_nope[None, :, None]
        nope = tl.load(kv_ptr + rows[:, None, None] * ROW_BYTES + chunks[None, :, None] * CHUNK
                       + cols[None, None, :], mask=nope_ok, other=0.0)
        # one UE8M0 byte e per 64 NoPE dims: 2^(e - 127) is the fp32 with exponent field e (e >= 1 always)
        e = tl.load(kv_scale_ptr + rows[:, None] * ROW_BYTES + SCALE_OFFSET + chunks[None, :],
                    mask=valid[:, None] & is_nope[None, :], other=127)
        scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        rope = tl.load(kv_rope_ptr + rows[:, None] * (ROW_BYTES // 2) + ROPE_OFFSET // 2 + cols[None, :],
                       mask=valid[:, None], other=0.0)
        nope = (nope.to(tl.float32) * scale[:, :, None]).to(tl.bfloat16)
        tile = tl.where(is_nope[None, :, None], nope, rope[:, None, :])
        tile = tl.reshape(tile, (tile.shape[0], N_CHUNKS * CHUNK))
    else:
        cols = tl.arange(0, N_CHUNKS * CHUNK)
        tile = tl.load(kv_ptr + rows[:, None] * stride_kv + cols[None, :], mask=valid[:, None], other=0.0)
    return tile


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, kv_rope_ptr, kv_scale_ptr, idx_ptr, sink_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    T, H, K, rows_per_split, scale,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
    PACKED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, NOPE_DIM: tl.constexpr, CHUNK: tl.constexpr,
    ROW_BYTES: tl.constexpr, ROPE_OFFSET: tl.constexpr, SCALE_OFFSET: tl.constexpr,
):
    """One program = one token x one block of heads x one split of the token's candidates."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    cols = tl.arange(0, HEAD_DIM)
    t64 = t.to(tl.int64)

    # the block of queries: [BLOCK_H, 512] bf16
    q = tl.load(q_ptr + t64 * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                mask=head_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    # a NaN logit (NaN in q or in a selected kv row) makes the head's output NaN, as in the reference;
    # tracked apart because max/where can drop NaN on GPUs
    nan_i = tl.zeros([BLOCK_H], tl.int32)

    k_begin = s * rows_per_split
    k_end = tl.minimum(k_begin + rows_per_split, K)
    for start in range(k_begin, k_end, BLOCK_N):
        # gather the tile's row indices; -1 (and the tail past k_end) are empty slots
        slots = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t64 * stride_it + slots, mask=slots < k_end, other=-1)
        valid = idx >= 0
        rows = idx.to(tl.int64)
        kv = _load_kv_tile(kv_ptr, kv_rope_ptr, kv_scale_ptr, rows, valid, stride_kv, PACKED,
                           HEAD_DIM // CHUNK, NOPE_DIM // CHUNK, CHUNK, ROW_BYTES, ROPE_OFFSET, SCALE_OFFSET)

        # S = scale * Q K^T in fp32, empty slots at -inf
        z = tl.dot(q, tl.trans(kv)) * scale
        z = tl.where(valid[None, :], z, float("-inf"))
        nan_i = tl.maximum(nan_i, tl.max((z != z).to(tl.int32), axis=1))

        # online softmax: new running max; a row with nothing valid yet keeps exp base 0 (no inf - inf)
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_base)
        p = tl.exp(z - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # the same rows as V; P rounded to bf16 before P V, fp32 accumulation
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), kv)
        m_i = m_new

    if SPLIT:
        # partial results of this split: unnormalised accumulator and (max, sum)
        part = (s.to(tl.int64) * T + t64) * H + heads
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + cols[None, :], acc, mask=head_ok[:, None])
        tl.store(part_ml_ptr + part * 2, tl.where(nan_i > 0, float("nan"), m_i), mask=head_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_ok)
    else:
        # the sink joins the denominator only: o = acc / (l + e^(sink - M)); no valid slot -> 0
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0)
        any_valid = m_i != float("-inf")
        denom = l_i + tl.exp(sink - tl.where(any_valid, m_i, 0.0))
        o = tl.where(any_valid[:, None], tl.math.div_rn(acc, denom[:, None]), 0.0)
        o = tl.where(nan_i[:, None] > 0, float("nan"), o)
        tl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + cols[None, :], o.to(tl.bfloat16),
                 mask=head_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, sink_ptr, out_ptr, T, H, n_splits, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge the splits of one (token, head block, BLOCK_D output columns) in split order, then apply the sink.

    Launched with PDL on sm_90+ (`_pdl`): its programs may be scheduled as the attention kernel's end, and wait for
    its partials before they read them."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    t64 = t.to(tl.int64)

    # global max over the splits
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_H], tl.int32)  # a split that saw a NaN logit stored NaN as its max
    for s in range(0, n_splits):
        part = (s * T + t64) * H + heads
        m_s = tl.load(part_ml_ptr + part * 2, mask=head_ok, other=float("-inf"))
        nan = tl.maximum(nan, (m_s != m_s).to(tl.int32))
        m = tl.maximum(m, tl.where(m_s != m_s, float("-inf"), m_s))
    any_valid = m != float("-inf")
    m_base = tl.where(any_valid, m, 0.0)

    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    for s in range(0, n_splits):
        part = (s * T + t64) * H + heads
        m_s = tl.load(part_ml_ptr + part * 2, mask=head_ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=head_ok, other=0.0)
        w = tl.exp(m_s - m_base)  # 0 for a split with no valid slot
        acc += w[:, None] * tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + cols[None, :],
                                    mask=head_ok[:, None], other=0.0)
        l += w * l_s

    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0)
    denom = l + tl.exp(sink - m_base)
    o = tl.where(any_valid[:, None], tl.math.div_rn(acc, denom[:, None]), 0.0)
    o = tl.where(nan[:, None] > 0, float("nan"), o)
    tl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + cols[None, :], o.to(tl.bfloat16),
             mask=head_ok[:, None])


def _sm_count() -> int | None:
    if not torch.cuda.is_available():
        return None  # the interpreter: one program at a time, nothing to fill
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def plan(n_tokens: int, n_heads: int, n_candidates: int, packed: bool, platform: str | None = None
         ) -> tuple[LaunchConfig, int]:
    """(tiles, candidate splits) of a launch, by the rule above (`platform`: `tile_platform()` when None)."""
    config = WIDE[platform or tile_platform()][packed]
    n_sms = _sm_count()
    if n_sms is None:
        return config, 1
    if n_tokens * triton.cdiv(n_heads, config.block_h) * NARROW_BELOW < n_sms:
        config = NARROW
    programs = n_tokens * triton.cdiv(n_heads, config.block_h)
    splits = max(1, min(n_sms // programs, n_candidates // MIN_ROWS_PER_SPLIT, MAX_SPLITS))
    return config, splits


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float,
    *, splits: int | None = None, config: LaunchConfig | None = None, sm90_kernel: bool | None = None,
) -> torch.Tensor:
    """Triton sparse attention with sink over bf16 rows (inputs validated by `optimized.attention`).

    Args:
        q: [T, H, 512] bf16, last dim contiguous.
        kv: [N, 512] bf16, last dim contiguous.
        indices: [T, K] int32 rows of kv, -1 = empty slot; last dim contiguous.
        sink: [H] fp32.
        scale: logit scale (512^-0.5).
        splits: split-KV factor; None = `plan`'s.
        config: override the tiles (sweeps and tests); None = `plan`'s.
        sm90_kernel: run the warp-specialized sm_90 kernel (`sparse_attention_sm90`; needs an sm_90 GPU and
            64-head programs of 64 rows, else ValueError) or not (False: this module's portable kernel); None = it
            runs where it can, unless `config` is given (then the portable kernel runs those tiles).

    Returns:
        [T, H, 512] bf16.
    """
    return _launch(q, (kv, kv, kv), indices, sink, scale, packed=False, splits=splits, config=config,
                   sm90_kernel=sm90_kernel)


def sparse_attention_packed(
    q: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float,
    *, fp8_dtype: torch.dtype, splits: int | None = None, config: LaunchConfig | None = None,
    sm90_kernel: bool | None = None,
) -> torch.Tensor:
    """As `sparse_attention`, over [N, 584] uint8 packed cache rows (contiguous) whose NoPE bytes are `fp8_dtype`."""
    views = (packed.view(fp8_dtype), packed.view(torch.bfloat16), packed)
    return _launch(q, views, indices, sink, scale, packed=True, splits=splits, config=config, sm90_kernel=sm90_kernel)


def sparse_attention_quantized(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float,
    positions: torch.Tensor, freqs: torch.Tensor, *, n_groups: int, scale_layout: str = "deepgemm",
    packed_fp8_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant.quantize_attn_output_checked(attention, positions, freqs, n_groups=n_groups, fmt="e4m3fn",
    scale_layout=scale_layout)` of this module's attention output, the output projection's FP8 input.

    Where the launch runs the sm_90 kernel without split-KV (prefill of DSv4's 512 / 64 heads), its programs store
    their heads quantized (`sparse_attention_sm90._store_quantized`): the bf16 output never goes to memory.
    Elsewhere, the attention then the quantization kernel. The same bytes either way.

    Args:
        q, kv, indices, sink, scale: as `sparse_attention`; `kv` [N, 584] uint8 packed cache rows when
            `packed_fp8_dtype` (their NoPE bytes' dtype) is given, else [N, 512] bf16 rows.
        positions: [T] int64; freqs: [32] fp32 (`quantize_attn_output`'s).
        n_groups, scale_layout: as `quant.quantize_attn_output`.

    Returns:
        (o_fp8 [T, G, H/G*512] e4m3fn, o_scale [T, G, H/G*4] fp32), as `quant.quantize_attn_output`.
    """
    n_tokens, n_heads, head_dim = q.shape
    if n_groups < 1 or n_heads % n_groups or (n_heads // n_groups * head_dim) % quant.SCALE_BLOCK:
        raise ValueError(f"n_groups: must split the {n_heads} heads of {head_dim} into groups of whole "
                         f"{quant.SCALE_BLOCK}-channel blocks, got {n_groups}")
    padding: list[torch.Tensor] = []

    def quantized_output() -> sm90.QuantizedOutput:
        # built only where the launch fuses (the fallback's quantization kernel allocates its own)
        o_fp8, o_scale, rows = quant.attn_output_buffers(n_tokens, n_groups, n_heads * head_dim // n_groups,
                                                         torch.float8_e4m3fn, q.device, scale_layout)
        padding.append(rows)
        table = quant.rope_table(positions, freqs)
        return sm90.QuantizedOutput(o_fp8, o_scale, table[0], table[1], n_heads // n_groups)

    views = (kv, kv, kv) if packed_fp8_dtype is None else (kv.view(packed_fp8_dtype), kv.view(torch.bfloat16), kv)
    out = _launch(q, views, indices, sink, scale, packed=packed_fp8_dtype is not None, splits=None, config=None,
                  sm90_kernel=None, quantized=quantized_output if 2 * freqs.shape[0] == sm90.ROPE_DIM else None)
    if isinstance(out, torch.Tensor):
        return quant.quantize_attn_output_checked(out, positions, freqs, n_groups=n_groups, fmt="e4m3fn",
                                                  scale_layout=scale_layout)
    padding[0].zero_()  # the DeepGEMM layout's padding rows, which the quantization kernel writes as 0
    return out.o_fp8, out.o_scale


def _launch(
    q: torch.Tensor, kv_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor], indices: torch.Tensor,
    sink: torch.Tensor, scale: float, *, packed: bool, splits: int | None, config: LaunchConfig | None,
    sm90_kernel: bool | None, quantized: Callable[[], sm90.QuantizedOutput] | None = None,
) -> torch.Tensor | sm90.QuantizedOutput:
    """The launch(es) of one sparse attention: [T, H, 512] bf16, or, where `quantized` was given and the sm_90
    kernel runs with one split (DSv4's heads), the `quantized()` it stored the output in instead."""
    prepare_interpreter()
    n_tokens, n_heads, _ = q.shape
    n_candidates = indices.shape[1]
    if n_tokens == 0:
        return torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    planned, planned_splits = plan(n_tokens, n_heads, n_candidates, packed)
    launch = config or planned
    splits = planned_splits if splits is None else splits
    heads_per_program = max(BLOCK_H_MIN, min(launch.block_h, triton.next_power_of_2(n_heads)))
    n_head_blocks = triton.cdiv(n_heads, heads_per_program)
    block_n = INTERPRETER_BLOCK_N if detect().interpret and config is None else launch.block_n
    # candidates per split: whole BLOCK_N tiles; then drop splits that would be empty
    rows_per_split = triton.cdiv(triton.cdiv(max(n_candidates, 1), max(splits, 1)), block_n) * block_n
    splits = triton.cdiv(max(n_candidates, 1), rows_per_split)
    if splits > 1:
        part_acc = torch.empty((splits, n_tokens, n_heads, HEAD_DIM), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, n_tokens, n_heads, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = sink  # not read or written without splits
    constexprs = _attention_constexprs(packed, splits > 1, heads_per_program, block_n)
    # the Gluon kernel where asked for, or by default where no explicit tiles are (the device is queried only then)
    wanted = config is None if sm90_kernel is None else sm90_kernel
    use_sm90 = wanted and not detect().interpret and sm90.supported(q, heads_per_program, block_n)
    if sm90_kernel and not use_sm90:
        raise ValueError(f"sm90_kernel: needs an sm_90 GPU and programs of {sm90.BLOCK_H} heads x {sm90.BLOCK_N} "
                         f"rows; this launch has {heads_per_program} x {block_n} on {q.device}")
    fused = quantized() if quantized is not None and use_sm90 and splits == 1 else None
    # the bf16 output only where it is written (the fused launch stores into `fused`)
    out = fused.o_fp8 if fused is not None else torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    if use_sm90:
        sm90.launch(q, kv_views, indices, sink, scale, out, part_acc, part_ml, rows_per_split, splits, constexprs,
                    fused)
        if fused is not None:
            return fused
    else:
        kv_main, kv_rope, kv_scale = kv_views
        _sparse_attention_kernel[(n_tokens, n_head_blocks, splits)](
            q, kv_main, kv_rope, kv_scale, indices, sink, out, part_acc, part_ml,
            n_tokens, n_heads, n_candidates, rows_per_split, float(scale),
            q.stride(0), q.stride(1), kv_main.stride(0), indices.stride(0), out.stride(0), out.stride(1),
            **constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages,
        )
    if splits > 1:
        _merge_splits_kernel[(n_tokens, triton.cdiv(n_heads, MERGE_BLOCK_H), HEAD_DIM // MERGE_BLOCK_D)](
            part_acc, part_ml, sink, out, n_tokens, n_heads, splits, out.stride(0), out.stride(1),
            BLOCK_H=MERGE_BLOCK_H, BLOCK_D=MERGE_BLOCK_D, HEAD_DIM=HEAD_DIM, num_warps=MERGE_NUM_WARPS,
            **pdl_launch(),
        )
    return out


def _attention_signature(fp8: bool) -> dict[str, str]:
    kv = "*{fp8}" if fp8 else "*bf16"
    return {
        "q_ptr": "*bf16", "kv_ptr": kv, "kv_rope_ptr": "*bf16", "kv_scale_ptr": "*u8" if fp8 else "*bf16",
        "idx_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
        "part_ml_ptr": "*fp32", "T": "i32", "H": "i32", "K": "i32", "rows_per_split": "i32", "scale": "fp32",
        "stride_qt": "i32", "stride_qh": "i32", "stride_kv": "i32",
        "stride_it": "i32", "stride_ot": "i32", "stride_oh": "i32",
    }


def _attention_constexprs(packed: bool, split: bool, heads_per_program: int, block_n: int) -> dict[str, int | bool]:
    return {"PACKED": packed, "SPLIT": split, "BLOCK_H": heads_per_program, "BLOCK_N": block_n,
            "HEAD_DIM": HEAD_DIM, "NOPE_DIM": NOPE_DIM, "CHUNK": KV_SCALE_BLOCK, "ROW_BYTES": PACKED_ROW_BYTES,
            "ROPE_OFFSET": PACKED_ROPE_OFFSET, "SCALE_OFFSET": PACKED_SCALE_OFFSET}


_ALIGNED = ("q_ptr", "kv_ptr", "kv_rope_ptr", "kv_scale_ptr", "idx_ptr", "sink_ptr", "out_ptr", "part_acc_ptr",
            "part_ml_ptr", "T", "H", "K", "rows_per_split", "stride_qt", "stride_qh", "stride_kv", "stride_it",
            "stride_ot", "stride_oh")



def _attention_spec(config: LaunchConfig, packed: bool, split: bool, targets: tuple[str, ...]) -> AotSpec:
    return AotSpec(f"sparse_attention[{'packed' if packed else 'bf16'},BLOCK_H={config.block_h},"
                   f"BLOCK_N={config.block_n},split={split}]",
                   _sparse_attention_kernel, _attention_signature(packed),
                   _attention_constexprs(packed, split, config.block_h, config.block_n),
                   num_warps=config.num_warps, num_stages=config.num_stages, aligned=_ALIGNED, targets=targets)


# Every launch `plan` makes, bf16 or packed rows, with and without split-KV: the 64-head tiles on their
# platform's targets (prefill; decode of >= 33 tokens at FLASH, split below 132), the 16-head tile on all three.
AOT_SPECS = [
    *(_attention_spec(WIDE[platform][packed], packed, split, targets)
      for platform, targets in PLATFORM_TARGETS.items() for packed in (False, True) for split in (False, True)),
    *(_attention_spec(NARROW, packed, split, ALL_TARGETS) for packed in (False, True) for split in (False, True)),
    # the same launches of 64-head programs as the warp-specialized sm_90 kernel (`sm90.supported`)
    *(sm90.aot_spec(_attention_signature(packed), _attention_constexprs(packed, split, sm90.BLOCK_H, sm90.BLOCK_N),
                    _ALIGNED) for packed in (False, True) for split in (False, True)),
    # ... and prefill with the output projection's quantization fused (`sparse_attention_quantized`)
    *(sm90.aot_spec(_attention_signature(packed), _attention_constexprs(packed, False, sm90.BLOCK_H, sm90.BLOCK_N),
                    _ALIGNED, quantized=True) for packed in (False, True)),
    AotSpec("sparse_attention_merge", _merge_splits_kernel,
            {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
             "T": "i32", "H": "i32", "n_splits": "i32", "stride_ot": "i32", "stride_oh": "i32"},
            {"BLOCK_H": MERGE_BLOCK_H, "BLOCK_D": MERGE_BLOCK_D, "HEAD_DIM": HEAD_DIM}, num_warps=MERGE_NUM_WARPS,
            aligned=("part_acc_ptr", "part_ml_ptr", "sink_ptr", "out_ptr", "T", "H", "stride_ot", "stride_oh")),
]
