"""Sparse attention with sink on sm_90, over bf16 rows or the packed FP8 cache, as a Gluon kernel (Triton's
layout-explicit dialect).

Same function, numerics, launch grid and split-KV partials as `optimized.triton.sparse_attention` (one program =
one token x 64 heads x one split of its candidate rows; fp32 online softmax, P rounded to bf16 before P V, the sink
in the denominator, empty rows give 0, a NaN logit makes its head NaN; with split-KV each program writes its
unnormalised accumulator and (max, sum), and that module's merge kernel finishes), with the layouts and the work
split chosen by hand:

* S = Q K^T is split between the two consumer warpgroups (warps [4, 2]: 64 heads x BLOCK_N / 2 rows each).
  Triton's language gives a dot that feeds another dot all warps along M, so with 64 heads and 8 warps both
  warpgroups of the portable kernel compute the same S tile (docs/design-notes.md, item 13). P goes through
  shared memory into the operand layout of P V, which is split along the 512 output columns as before.
* A producer warpgroup (`gl.warp_specialize`, 4 warps) fills one of two shared-memory stages per tile and
  signals it on the stage's `ready` mbarrier. bf16 rows (56 registers per producer thread): cp.async gathers,
  every producer thread arrives when its copies land. Packed cache rows (96 registers): each thread loads its
  rows' FP8 NoPE bytes (all seven 64-dim blocks at once, 8-byte vectors: a 584-byte row is 8-byte aligned) and
  their scale bytes into registers, decodes `fp8 * 2^(e - 127)` to bf16 (exact, as the portable kernel does)
  and stores the tile; the RoPE dims go by cp.async; then a fence for the async proxy and one arrival. The
  consumers release a stage on its `empty` mbarrier once both warpgroups have finished P V on it; they never
  compute gather addresses, wait on index loads or decode FP8.
* The consumers load Q into shared memory themselves, while the producer gathers the first tiles (a program of
  decode has only five tiles, so the Q load is not negligible there): bitwise the same, 1.5-2 % faster at decode
  of batch 64 / 128 and 3 % at prefill of 8192 tokens on an H100
  (docs/h200/ab-sparse-attention-q-in-consumer-h100.json).
* With `QuantizedOutput` (prefill, one split) the epilogue stores the heads as the output projection's FP8 input
  (`_store_quantized`: inverse RoPE, per-128 UE8M0 scales, e4m3fn; the quantization kernel's bytes) instead of
  bf16: FLASH 4096 tokens 1223.8 us against 1232.8 for the bf16 store and 1374.3 with the separate quantization on
  an H100 (design note 35, docs/h200/ab-fused-out-quant-h100.json).

H200, FLASH, prefill of 8192 tokens over bf16 rows (CUDA-graph replays, L2 flushed;
docs/h200/gluon-sparse-attention.json): 2523 us against the portable kernel's 3319 us in the same run (245 vs
186 TFLOP/s). H100, FLASH decode of batch 64 at a 32768-token context over the packed cache, 2 splits
(docs/h200/ab-sparse-attention-sm90-decode-h100.json): 42.7 us against the portable kernel's 56.8 us; batch 128
(no split) 64.9 against 84.9 us. `sparse_attention._launch` runs it for every launch of 64-head programs on an
sm_90 GPU; the CPU interpreter cannot run Gluon, so elsewhere (ROCm, the interpreter, 16-head programs) the
portable kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from optimized.triton._fp8 import pow2_reciprocal, ue8m0_scale
from optimized.triton.aot import AotSpec
from optimized.triton.quant import _amax
from reference.einsum import ATTN_OUT_EPS


@dataclass(frozen=True)
class QuantizedOutput:
    """Where a launch stores its output quantized (`quant.quantize_attn_output`'s outputs, e4m3fn).

    Attributes:
        o_fp8: [T, G, H/G*512] e4m3fn, last dim contiguous.
        o_scale: [T, G, H/G*4] fp32 (either scale layout: any strides).
        cos, sin: [T, 32] fp32 contiguous, the tokens' RoPE tables (`quant.rope_table`).
        heads_per_group: H / G.
    """

    o_fp8: torch.Tensor
    o_scale: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    heads_per_group: int


BLOCK_H = 64  # heads per program (two warpgroups of wgmma M = 64 rows each: the heads are the M of both dots)
BLOCK_N = 64  # gathered rows per step
STAGES = 2  # Q (64 KB) + 2 x 64 KB of rows: 192 KB of sm_90's 227 KB of shared memory
CONSUMER_WARPS = 8  # the default partition: two warpgroups
PRODUCER_WARPS = 4  # one warpgroup of gathers
PRODUCER_REGS = 56  # registers per producer thread (addresses and masks only); the rest go to the consumers
PACKED_PRODUCER_REGS = 96  # packed rows: the producer also holds the FP8 bytes it decodes
COPY_CHUNK = 128  # columns per cp.async instruction of the producer (keeps its address registers few)
HEAD_DIM = 512
ROPE_DIM = 64  # the RoPE dims at the end of a head (the fused output quantization's inverse RoPE)
# Gluon names that changed (Triton 3.6 -> 3.9): the cp.async of a pointer tensor into shared memory
# (`async_copy_global_to_shared` -> `async_load`) and the CTA barrier (`thread_barrier` -> `barrier`)
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _gather_packed(kv_ptr, kv_rope_ptr, kv_scale_ptr, idx_ptr, stage, t64, stride_it, first, k_end,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NOPE_DIM: gl.constexpr, CHUNK: gl.constexpr,
                   ROW_BYTES: gl.constexpr, ROPE_OFFSET: gl.constexpr, SCALE_OFFSET: gl.constexpr,
                   PRODUCER_WARPS: gl.constexpr):
    """Decode one tile of packed cache rows into the bf16 `stage` ([BLOCK_N, 512]): each 64-dim NoPE chunk is
    `fp8 * 2^(e - 127)` in fp32 (exact in bf16, as in the portable kernel), the RoPE dims are copied; empty slots
    and the tail load zeros."""
    # [rows, 64] FP8 bytes in 8-byte vectors (a packed row is 8-byte aligned, not 16), [rows, 64] bf16 likewise
    NOPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [PRODUCER_WARPS, 1], [1, 0])
    slots = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, NOPE_L))
    idx = gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < k_end, other=-1)
    rows = idx.to(gl.int64)
    valid = idx >= 0
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, NOPE_L))
    nope_ok = valid[:, None] & (cols < CHUNK)[None, :]
    slots_r = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
    idx_r = gl.load(idx_ptr + t64 * stride_it + slots_r, mask=slots_r < k_end, other=-1)
    cols_r = gl.arange(0, HEAD_DIM - NOPE_DIM, layout=gl.SliceLayout(0, ROPE_L))
    # every load of the tile first (a tuple per NoPE chunk), so they are all in flight at once: a store to shared
    # memory between them would end in a barrier and serialize the gathers
    chunks = ()
    for c in gl.static_range(NOPE_DIM // CHUNK):
        nope = gl.load(kv_ptr + rows[:, None] * ROW_BYTES + c * CHUNK + cols[None, :], mask=nope_ok, other=0.0)
        chunks = chunks + (nope,)  # noqa: RUF005 (the JIT frontend builds tuples by concatenation)
    # a row's 7 scale bytes and its pad byte in one 8-byte load (each thread holds whole rows' bytes)
    j = gl.arange(0, ROW_BYTES - SCALE_OFFSET, layout=gl.SliceLayout(0, NOPE_L))
    e_row = gl.load(kv_scale_ptr + rows[:, None] * ROW_BYTES + SCALE_OFFSET + j[None, :],
                    mask=valid[:, None] & (j < ROW_BYTES - SCALE_OFFSET)[None, :], other=127)
    # the bf16 RoPE dims go straight to shared memory (cp.async, no registers)
    _async_load(stage.slice(NOPE_DIM, HEAD_DIM - NOPE_DIM, dim=1),
                kv_rope_ptr + idx_r.to(gl.int64)[:, None] * (ROW_BYTES // 2) + ROPE_OFFSET // 2 + cols_r[None, :],
                mask=(idx_r >= 0)[:, None] & (cols_r < HEAD_DIM - NOPE_DIM)[None, :])
    cp.commit_group()
    for c in gl.static_range(NOPE_DIM // CHUNK):
        # one UE8M0 byte e per 64 NoPE dims: 2^(e - 127) is the fp32 with exponent field e
        e = gl.max(gl.where(j[None, :] == c, e_row, 0), axis=1)
        scale = (e.to(gl.int32) << 23).to(gl.float32, bitcast=True)
        nope = chunks[c]
        stage.slice(c * CHUNK, CHUNK, dim=1).store((nope.to(gl.float32) * scale[:, None]).to(gl.bfloat16))
    cp.wait_group(0)


@gluon.jit
def _producer(kv_ptr, kv_rope_ptr, kv_scale_ptr, idx_ptr, kv_smem, ready, empty, t64, stride_it, stride_kv,
              k_begin, k_end, PACKED: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, COPY_CHUNK: gl.constexpr, NOPE_DIM: gl.constexpr, CHUNK: gl.constexpr,
              ROW_BYTES: gl.constexpr, ROPE_OFFSET: gl.constexpr, SCALE_OFFSET: gl.constexpr,
              PRODUCER_WARPS: gl.constexpr):
    """Fill stage i % STAGES with tile i's rows once it is empty; empty slots and the tail are zero-filled."""
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PRODUCER_WARPS, 1], [1, 0])  # [rows, COPY_CHUNK] bf16: 16 B
    for i in range(gl.cdiv(k_end - k_begin, BLOCK_N)):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first round passes (the previous phase)
        first = k_begin + i * BLOCK_N
        if PACKED:
            # loads into registers, the bf16 tile stored to shared memory: make the stores visible to the
            # consumers' wgmma (async proxy), then one arrival for the whole warpgroup
            _gather_packed(kv_ptr, kv_rope_ptr, kv_scale_ptr, idx_ptr, kv_smem.index(s), t64, stride_it, first,
                           k_end, BLOCK_N, HEAD_DIM, NOPE_DIM, CHUNK, ROW_BYTES, ROPE_OFFSET, SCALE_OFFSET,
                           PRODUCER_WARPS)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(ready.index(s), count=1)
        else:
            slots = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
            idx = gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < k_end, other=-1)
            cols = gl.arange(0, COPY_CHUNK, layout=gl.SliceLayout(0, LD))
            ptrs = kv_ptr + idx.to(gl.int64)[:, None] * stride_kv + cols[None, :]
            mask = (idx >= 0)[:, None] & (cols < COPY_CHUNK)[None, :]
            for c in gl.static_range(HEAD_DIM // COPY_CHUNK):
                _async_load(kv_smem.index(s).slice(c * COPY_CHUNK, COPY_CHUNK, dim=1), ptrs + c * COPY_CHUNK, mask=mask)
            cp.mbarrier_arrive(ready.index(s), increment_count=False)  # arrives when this thread's copies land


@gluon.jit
def _add_rn(a, b):
    """`a + b` in fp32, rounded once: PTX `add.rn` is never contracted with a product into an FMA, so the inverse
    RoPE rounds as the reference's (the Triton quantization kernels compile without FP fusion instead)."""
    return gl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _sub_rn(a, b):
    """`a - b` in fp32, rounded once (see `_add_rn`)."""
    return gl.inline_asm_elementwise("sub.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _store_quantized(o_smem, o, heads, head_ok, t64, cos_ptr, sin_ptr, of_ptr, os_ptr,
                     stride_ft, stride_fg, stride_st, stride_sg, stride_sk,
                     BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr, HEADS_PER_GROUP: gl.constexpr,
                     FP8_MAX: gl.constexpr, EPS: gl.constexpr):
    """The output projection's activation quantization of this program's heads, in place of the bf16 store:
    `quant.quantize_attn_output` of the bf16 output, fused (its head-tiled kernel's math and bytes: inverse
    GPT-J RoPE of the last 64 dims in fp32, per-128-channel UE8M0 scales, e4m3fn by the native cast).

    The bf16 output goes through shared memory (Q's buffer, which no wgmma reads any more), to be read back one
    128-channel block at a time ([heads, 128]: few registers), the last block as its 64 NoPE dims and its 32
    RoPE pairs ([heads, 64] each, a thread holding whole pairs).
    """
    ROPE_DIM: gl.constexpr = 64  # the module's ROPE_DIM
    BLOCK: gl.constexpr = 128
    NB: gl.constexpr = HEAD_DIM // BLOCK
    NOPE_DIM: gl.constexpr = HEAD_DIM - ROPE_DIM
    LAST: gl.constexpr = (NB - 1) * BLOCK
    f8: gl.constexpr = of_ptr.dtype.element_ty
    o_smem.store(o.to(gl.bfloat16))
    _cta_barrier()
    B_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])  # [heads, 128]: 16-byte rows
    R_L: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [8, 1], [1, 0])  # [heads, 64]: a thread holds a pair

    # whole NoPE blocks
    # int64 offsets: a group's stride is T x 4096 bytes
    hb_ = gl.convert_layout(heads, gl.SliceLayout(1, B_L)).to(gl.int64)
    ok_b = gl.convert_layout(head_ok, gl.SliceLayout(1, B_L))
    cb = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, B_L))
    out_b = of_ptr + t64 * stride_ft + (hb_ // HEADS_PER_GROUP) * stride_fg + (hb_ % HEADS_PER_GROUP) * HEAD_DIM
    scale_b = os_ptr + t64 * stride_st + (hb_ // HEADS_PER_GROUP) * stride_sg + (hb_ % HEADS_PER_GROUP) * NB * stride_sk
    for b in gl.static_range(NB - 1):
        x = o_smem.slice(b * BLOCK, BLOCK, dim=1).load(B_L).to(gl.float32)
        scale = ue8m0_scale(_amax(x, 1), FP8_MAX, EPS)
        gl.store(scale_b + b * stride_sk, scale, mask=ok_b)
        gl.store(out_b[:, None] + b * BLOCK + cb[None, :],
                 (x * pow2_reciprocal(scale)[:, None]).to(f8, fp_downcast_rounding="rtne"),
                 mask=ok_b[:, None] & (cb < BLOCK)[None, :])

    # the last block: its NoPE dims, and the RoPE pairs rotated back with the token's cos / sin (loaded per dim as
    # the pairs are, and split the same way)
    hr = gl.convert_layout(heads, gl.SliceLayout(1, R_L)).to(gl.int64)
    ok_r = gl.convert_layout(head_ok, gl.SliceLayout(1, R_L))
    cr = gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, R_L))
    x = o_smem.slice(LAST, NOPE_DIM - LAST, dim=1).load(R_L).to(gl.float32)
    pairs = o_smem.slice(NOPE_DIM, ROPE_DIM, dim=1).load(R_L).to(gl.float32)
    even, odd = gl.split(gl.reshape(pairs, [BLOCK_H, ROPE_DIM // 2, 2]))
    angle = t64 * (ROPE_DIM // 2) + (hr * 0)[:, None] + (cr // 2)[None, :]
    cos, _ = gl.split(gl.reshape(gl.load(cos_ptr + angle), [BLOCK_H, ROPE_DIM // 2, 2]))
    sin, _ = gl.split(gl.reshape(gl.load(sin_ptr + angle), [BLOCK_H, ROPE_DIM // 2, 2]))
    # inverse GPT-J RoPE (spec §2.8): x_e' = x_e cos + x_o sin,  x_o' = x_o cos - x_e sin
    even_rot = _add_rn(even * cos, odd * sin)
    odd_rot = _sub_rn(odd * cos, even * sin)
    rot_amax = gl.maximum(_amax(even_rot, 1), _amax(odd_rot, 1))
    scale = ue8m0_scale(gl.maximum(_amax(x, 1), gl.convert_layout(rot_amax, gl.SliceLayout(1, R_L))), FP8_MAX, EPS)
    out_r = of_ptr + t64 * stride_ft + (hr // HEADS_PER_GROUP) * stride_fg + (hr % HEADS_PER_GROUP) * HEAD_DIM
    gl.store(os_ptr + t64 * stride_st + (hr // HEADS_PER_GROUP) * stride_sg
             + ((hr % HEADS_PER_GROUP) * NB + NB - 1) * stride_sk, scale, mask=ok_r)
    inverse = pow2_reciprocal(scale)
    gl.store(out_r[:, None] + LAST + cr[None, :], (x * inverse[:, None]).to(f8, fp_downcast_rounding="rtne"),
             mask=ok_r[:, None] & (cr < ROPE_DIM)[None, :])
    inverse_p = gl.convert_layout(inverse, rot_amax.type.layout)[:, None]
    q_pairs = gl.join((even_rot * inverse_p).to(f8, fp_downcast_rounding="rtne"),
                      (odd_rot * inverse_p).to(f8, fp_downcast_rounding="rtne"))
    q_pairs = gl.convert_layout(gl.reshape(q_pairs, [BLOCK_H, ROPE_DIM]), R_L)
    gl.store(out_r[:, None] + NOPE_DIM + cr[None, :], q_pairs, mask=ok_r[:, None] & (cr < ROPE_DIM)[None, :])


@gluon.jit
def _consumer(q_ptr, q_smem, kv_smem, ready, empty, idx_ptr, sink_ptr, out_ptr, part_acc_ptr, part_ml_ptr, t64, hb,
              split, T, H, k_begin, k_end, scale, stride_qt, stride_qh, stride_it, stride_ot, stride_oh,
              cos_ptr, sin_ptr, scale_ptr, stride_og, stride_st, stride_sg, stride_sk,
              SPLIT: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, QUANT_OUT: gl.constexpr, HEADS_PER_GROUP: gl.constexpr,
              FP8_MAX: gl.constexpr, EPS: gl.constexpr):
    """Q into shared memory (while the producer gathers the first tiles), then S = Q K^T, the online softmax and
    P V over every tile of the split, then the sink and the store (or, with split-KV, the split's unnormalised
    accumulator and (max, sum) for the merge kernel)."""
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 2], [1, 0])  # [heads, 512] bf16: 16-byte vectors
    hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    cq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    q_smem.store(gl.load(q_ptr + t64 * stride_qt + hq[:, None] * stride_qh + cq[None, :], mask=(hq < H)[:, None],
                         other=0.0))
    fence_async_shared()  # visible to the wgmma (async proxy) ...
    _cta_barrier()  # ... once every consumer thread has stored its part
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, HEAD_DIM // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    nan_i = gl.zeros([BLOCK_H], gl.int32, layout=gl.SliceLayout(1, S_L))  # see the portable kernel
    acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, layout=O_L)
    for i in range(gl.cdiv(k_end - k_begin, BLOCK_N)):
        s = i % STAGES
        slots = k_begin + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        valid = gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < k_end, other=-1) >= 0
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        fence_async_shared()  # the landed rows are visible to the wgmma (async proxy)
        kv_t = kv_smem.index(s)
        sc = warpgroup_mma(q_smem, kv_t.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L),
                           use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))

        # S = scale * Q K^T in fp32, empty slots at -inf; online softmax as in the portable kernel
        z = gl.where(valid[None, :], sc * scale, float("-inf"))
        nan_i = gl.maximum(nan_i, gl.max((z != z).to(gl.int32), axis=1))
        m_new = gl.maximum(m_i, gl.max(z, axis=1))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m_i - m_base)
        p = gl.exp(z - m_base[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)

        # the same rows as V; P rounded to bf16, fp32 accumulation
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_L), kv_t, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()  # both consumer warpgroups are done with stage s ...
        mbarrier.arrive(empty.index(s), count=1)  # ... so the producer may refill it
        m_i = m_new

    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
    head_ok = heads < H
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    nan_o = gl.convert_layout(nan_i, gl.SliceLayout(1, O_L))
    if SPLIT:
        # partial results of this split, as the portable kernel writes them
        part = (split.to(gl.int64) * T + t64) * H + heads
        gl.store(part_acc_ptr + part[:, None] * HEAD_DIM + cols[None, :], acc,
                 mask=head_ok[:, None] & (cols < HEAD_DIM)[None, :])
        gl.store(part_ml_ptr + part * 2, gl.where(nan_o > 0, float("nan"), m_o), mask=head_ok)
        gl.store(part_ml_ptr + part * 2 + 1, l_o, mask=head_ok)
    else:
        # the sink joins the denominator only: o = acc / (l + e^(sink - M)); no valid slot -> 0
        sink = gl.load(sink_ptr + heads, mask=head_ok, other=0.0)
        any_valid = m_o != float("-inf")
        denom = l_o + gl.exp(sink - gl.where(any_valid, m_o, 0.0))
        o = gl.where(any_valid[:, None], gl.div_rn(acc, denom[:, None]), 0.0)
        o = gl.where(nan_o[:, None] > 0, float("nan"), o)
        if QUANT_OUT:
            # out_ptr: the FP8 [T, G, H/G*512] output (strides stride_ot, stride_og), scale_ptr its scales
            _store_quantized(q_smem, o, heads, head_ok, t64, cos_ptr, sin_ptr, out_ptr, scale_ptr, stride_ot,
                             stride_og, stride_st, stride_sg, stride_sk, BLOCK_H, HEAD_DIM, HEADS_PER_GROUP,
                             FP8_MAX, EPS)
        else:
            gl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + cols[None, :], o.to(gl.bfloat16),
                     mask=head_ok[:, None] & (cols < HEAD_DIM)[None, :])


@gluon.jit
def _sparse_attention_sm90_kernel(
    q_ptr, kv_ptr, kv_rope_ptr, kv_scale_ptr, idx_ptr, sink_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    T, H, K, rows_per_split, scale, stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
    cos_ptr, sin_ptr, scale_ptr, stride_og, stride_st, stride_sg, stride_sk,
    PACKED: gl.constexpr, SPLIT: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, COPY_CHUNK: gl.constexpr, NOPE_DIM: gl.constexpr,
    CHUNK: gl.constexpr, ROW_BYTES: gl.constexpr, ROPE_OFFSET: gl.constexpr, SCALE_OFFSET: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, QUANT_OUT: gl.constexpr = False,
    HEADS_PER_GROUP: gl.constexpr = 8, FP8_MAX: gl.constexpr = 448.0, EPS: gl.constexpr = 1e-4,
):
    """One program = one token x BLOCK_H heads x one split of the token's candidates (the portable kernel's grid):
    the shared memory and its barriers, then the producer and consumer partitions."""
    SM_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # a successor launched with PDL (the split merge) may be scheduled now, on the SMs this grid leaves free; it waits
    # for this grid to complete before it reads anything (`_pdl`)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
    t = gl.program_id(0)
    hb = gl.program_id(1)
    split = gl.program_id(2)
    t64 = t.to(gl.int64)
    k_begin = split * rows_per_split
    k_end = gl.minimum(k_begin + rows_per_split, K)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HEAD_DIM], SM_L)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], SM_L)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        # packed rows: one arrival after the producer's stores; bf16 rows: one per producer thread's cp.async
        mbarrier.init(ready.index(s), count=1 if PACKED else PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [(_consumer, (q_ptr, q_smem, kv_smem, ready, empty, idx_ptr, sink_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                      t64, hb, split, T, H, k_begin, k_end, scale, stride_qt, stride_qh, stride_it, stride_ot,
                      stride_oh, cos_ptr, sin_ptr, scale_ptr, stride_og, stride_st, stride_sg, stride_sk, SPLIT,
                      BLOCK_H, BLOCK_N, HEAD_DIM, STAGES, QUANT_OUT, HEADS_PER_GROUP, FP8_MAX, EPS)),
         (_producer, (kv_ptr, kv_rope_ptr, kv_scale_ptr, idx_ptr, kv_smem, ready, empty, t64, stride_it, stride_kv,
                      k_begin, k_end, PACKED, BLOCK_N, HEAD_DIM, STAGES, COPY_CHUNK, NOPE_DIM, CHUNK, ROW_BYTES,
                      ROPE_OFFSET, SCALE_OFFSET, PRODUCER_WARPS))],
        [PRODUCER_WARPS], [PRODUCER_REGS])


def supported(q: torch.Tensor, heads_per_program: int, rows_per_step: int) -> bool:
    """Whether this kernel can run the launch: 512-dim heads, programs of 64 heads x 64 rows, an sm_90 GPU."""
    return (q.is_cuda and torch.version.hip is None and q.shape[-1] == HEAD_DIM and heads_per_program == BLOCK_H
            and rows_per_step == BLOCK_N and torch.cuda.get_device_capability(q.device) == (9, 0))


def _own_constexprs(packed: bool) -> dict[str, int]:
    return {"STAGES": STAGES, "COPY_CHUNK": COPY_CHUNK, "PRODUCER_WARPS": PRODUCER_WARPS,
            "PRODUCER_REGS": PACKED_PRODUCER_REGS if packed else PRODUCER_REGS}


def launch(q: torch.Tensor, kv_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor], indices: torch.Tensor,
           sink: torch.Tensor, scale: float, out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor,
           rows_per_split: int, splits: int, constexprs: dict[str, int | bool],
           quantized: QuantizedOutput | None = None) -> None:
    """The portable kernel's launch (`sparse_attention._launch`: same arguments, grid and outputs, `constexprs`
    its `_attention_constexprs` with BLOCK_H = 64 and BLOCK_N = 64) as this kernel; with `quantized` (no split)
    the program stores its heads quantized for the output projection (`_store_quantized`) instead of `out`."""
    n_tokens, n_heads, _ = q.shape
    kv_main, kv_rope, kv_scale = kv_views
    if quantized is None:
        dst, quant_args, quant_constexprs = out, (sink, sink, sink, 0, 0, 0, 0), {}
    else:
        if splits != 1 or quantized.o_fp8.dtype != torch.float8_e4m3fn:
            raise ValueError("quantized: the fused output quantization needs one split and e4m3fn")
        dst = quantized.o_fp8
        quant_args = (quantized.cos, quantized.sin, quantized.o_scale, dst.stride(1), *quantized.o_scale.stride())
        quant_constexprs = {"QUANT_OUT": True, "HEADS_PER_GROUP": quantized.heads_per_group,
                            "FP8_MAX": torch.finfo(torch.float8_e4m3fn).max, "EPS": ATTN_OUT_EPS}
    _sparse_attention_sm90_kernel[(n_tokens, triton.cdiv(n_heads, BLOCK_H), splits)](
        q, kv_main, kv_rope, kv_scale, indices, sink, dst, part_acc, part_ml,
        n_tokens, n_heads, indices.shape[1], rows_per_split, float(scale),
        q.stride(0), q.stride(1), kv_main.stride(0), indices.stride(0), dst.stride(0), out.stride(1), *quant_args,
        **constexprs, **_own_constexprs(bool(constexprs["PACKED"])), **quant_constexprs, num_warps=CONSUMER_WARPS,
    )


_QUANT_SIGNATURE = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "scale_ptr": "*fp32",
                    **dict.fromkeys(("stride_og", "stride_st", "stride_sg", "stride_sk"), "i32")}


def aot_spec(signature: dict[str, str], constexprs: dict[str, int | bool], aligned: tuple[str, ...],
             quantized: bool = False) -> AotSpec:
    """This kernel's launch for the portable kernel's signature and constexprs (sm_90 only); `quantized`: the
    launch that stores its output quantized (DSv4's 8 heads per group)."""
    packed, split = bool(constexprs["PACKED"]), bool(constexprs["SPLIT"])
    extra: dict[str, int | bool | float] = {}
    signature = {**signature, **_QUANT_SIGNATURE}
    if quantized:
        signature["out_ptr"] = "*fp8e4nv"
        extra = {"QUANT_OUT": True, "HEADS_PER_GROUP": 8, "FP8_MAX": torch.finfo(torch.float8_e4m3fn).max,
                 "EPS": ATTN_OUT_EPS}
    return AotSpec(f"sparse_attention_sm90[gluon,{'packed' if packed else 'bf16'},BLOCK_H={BLOCK_H},"
                   f"BLOCK_N={BLOCK_N},split={split}{',quantized-out' if quantized else ''},warp-specialized]",
                   _sparse_attention_sm90_kernel, signature, {**constexprs, **_own_constexprs(packed), **extra},
                   num_warps=CONSUMER_WARPS, gluon=True, targets=("sm_90",), aligned=aligned)
