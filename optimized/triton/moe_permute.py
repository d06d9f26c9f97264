"""Triton kernels that move MoE tokens: sort (token, slot) pairs by expert, gather rows, combine outputs.

The routing result `topk_ids [T, k]` names, for every *slot* `s = t * k + j`, the expert it runs on.
The grouped GEMMs want the slots of one expert in consecutive *rows*, each expert's segment starting
at a multiple of the GEMM's block (or, for DeepGEMM's masked layout, at `e * capacity`). `permute`
computes that layout without atomics, so it is the same on every run:

  1. `_count_kernel`     per chunk of CHUNK slots, a histogram over the experts.
  2. `_offsets_kernel`   one program: prefix sums over the chunks (where each chunk's slots of expert e
                         start inside e's segment) and over the experts (where segment e starts).
  3. `_scatter_kernel`   per chunk: a slot's row = start of its expert + its chunk's base + its rank among
                         the chunk's earlier slots of the same expert. Rows follow slot order inside
                         each expert, so the layout is a function of `topk_ids` alone.

At most CHUNK slots (decode: FLASH T <= 21) take `_permute_chunk_kernel` instead: the same layout from one
program, which also writes the padding rows' -1, so a decode step launches one kernel where it launched four
(three and a fill).

Then `gather_rows` copies quantized token rows into that layout (DeepGEMM's A operand, with its
scales in DeepGEMM's MN-major TMA-aligned layout), and `combine` sums each token's k expert outputs in
fp32 in ascending expert id, the order of `reference.moe.expert_sum`, plus optionally the shared
expert's output, and casts to bf16 once.

Slot states in `slot_row`: a row >= 0; SKIPPED (-1) for an id of -1 (contributes nothing, as in the
reference); OVERFLOW (-2) for a slot that did not fit its expert's capacity (masked layout only, which
happens only when a row of `topk_ids` repeats an expert): combine turns it into NaN, never a silent drop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from optimized.triton._fp8 import prepare_interpreter
from optimized.triton._pdl import pdl_launch, pdl_wait
from optimized.triton.aot import AotSpec, by_token_count

SKIPPED = tl.constexpr(-1)
OVERFLOW = tl.constexpr(-2)
# Slots per count / scatter program; the scatter ranks a chunk with a [CHUNK, CHUNK] comparison.
CHUNK = 128
# Rows per step of the one-chunk kernel's fill of the row maps.
PERMUTE_BLOCK_R = 1024
# Chunks per step of the single-program prefix sum ([OFFSETS_BLOCK_C, E_PAD] tiles).
OFFSETS_BLOCK_C = 32
# Row copy tiles: slots x bytes per program.
GATHER_BLOCK_S = 16
GATHER_BLOCK_D = 512
# Combine tiles: tokens x hidden dims per program (on the CPU interpreter: few, large programs).
COMBINE_BLOCK_T = 8
COMBINE_BLOCK_D = 512
# Decode (at most DECODE_COMBINE_TOKENS tokens): one token and 256 dims per program, more programs with shorter
# dependent load chains (H200, FLASH routed MoE, same-run A/B of launch shapes, outputs bitwise equal:
# T = 1 70.8 -> 70.0 us, T = 8 309.1 -> 307.3 us; docs/h200/ab-moe-glue-launch.json).
DECODE_COMBINE_TOKENS = 64
DECODE_COMBINE_BLOCK_T = 1
DECODE_COMBINE_BLOCK_D = 256
# The one-chunk permute (at most CHUNK slots) ranks the slots padded to a power of two, at least
# PERMUTE_MIN_CHUNK: at T = 1 (6 slots) a 16-wide rank in 4 warps instead of a 128-wide one in 8 (same A/B:
# 70.8 -> 69.5 us). Chunks up to 64 take 4 warps; 128 keeps 8 (4 warps there spill on gfx942, the AOT check, and
# measured slower on the H200: 72.7 us).
PERMUTE_MIN_CHUNK = 16
PERMUTE_SMALL_CHUNK_WARPS = 4
PERMUTE_WARPS = 8  # the permute's kernels at full chunks (and the multi-chunk path)
INTERPRET_COMBINE_BLOCK_T = 64


def _permute_warps(chunk: int) -> int:
    """Warps of the one-chunk permute ranking `chunk` slots."""
    return PERMUTE_SMALL_CHUNK_WARPS if chunk < CHUNK else PERMUTE_WARPS


@dataclass(frozen=True)
class MoeLayout:
    """Where each (token, slot) sits in the expert-sorted row order of the grouped GEMMs.

    Attributes:
        slot_row: [T * k] int32: the row of slot `t * k + j`, or SKIPPED / OVERFLOW.
        sorted_slot: [n_rows] int32: the slot in each row, -1 for padding rows (None when not requested).
        row_expert: [n_rows] int32: the expert of each row, -1 for padding rows (DeepGEMM's contiguous
            `grouped_layout`; None when not requested).
        expert_start: [E + 1] int32: row where expert e's segment starts; `expert_start[E]` = rows used.
        expert_count: [E] int32: slots placed per expert (DeepGEMM's masked `masked_m`).
        n_rows: rows allocated (an upper bound of `expert_start[E]`, known without a device sync).
        align: every segment starts at a multiple of this (compact layout), or 0.
        capacity: rows per expert (masked layout), or 0.
        arrivals: [n] int32 zeros, or None: arrival counters for the grouped GEMM that runs on this layout
            (`moe_gemm.grouped_gemm(arrivals=)`), zeroed by the permute's own launch when it is one kernel.
    """

    slot_row: torch.Tensor
    sorted_slot: torch.Tensor | None
    row_expert: torch.Tensor | None
    expert_start: torch.Tensor
    expert_count: torch.Tensor
    n_rows: int
    align: int
    capacity: int
    arrivals: torch.Tensor | None = None


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, n_slots, n_experts, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
                  PDL: tl.constexpr = False):
    """counts[chunk, e] = slots of this chunk routed to expert e."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    slots = pid * CHUNK + tl.arange(0, CHUNK)
    eid = tl.load(ids_ptr + slots, mask=slots < n_slots, other=-1)
    ok = (eid >= 0) & (eid < n_experts)
    hist = tl.histogram(tl.where(ok, eid, 0), E_PAD, mask=ok)
    tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), hist)


@triton.jit
def _store_segments(expert_start_ptr, expert_count_ptr, total, n_experts, align, capacity, E_PAD: tl.constexpr):
    """From each expert's slot count `total` [E_PAD]: where its segment starts (aligned, or e * capacity) and how
    many slots it holds, stored with the rows used in all (`expert_start[E]`)."""
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < n_experts
    if capacity > 0:
        start = offs_e * capacity
        used = n_experts * capacity
        tl.store(expert_count_ptr + offs_e, tl.minimum(total, capacity), mask=e_ok)
    else:
        padded = (total + align - 1) // align * align
        start = tl.cumsum(padded, axis=0) - padded
        used = tl.sum(padded, axis=0)
        tl.store(expert_count_ptr + offs_e, total, mask=e_ok)
    tl.store(expert_start_ptr + offs_e, start, mask=e_ok)
    tl.store(expert_start_ptr + n_experts, used)


@triton.jit
def _rank_in_chunk(eid, ok, lane):
    """Each slot's rank among the chunk's earlier slots of the same expert (a [CHUNK, CHUNK] comparison)."""
    earlier = (eid[:, None] == eid[None, :]) & ok[None, :] & (lane[None, :] < lane[:, None])
    return tl.sum(earlier.to(tl.int32), axis=1)


@triton.jit
def _offsets_kernel(
    counts_ptr, chunk_base_ptr, expert_start_ptr, expert_count_ptr,
    n_chunks, n_experts, align, capacity,
    BLOCK_C: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """chunk_base[c, e] = slots of expert e in chunks before c; segment starts and per-expert counts."""
    pdl_wait(PDL)
    offs_e = tl.arange(0, E_PAD)
    carry = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, n_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        ptrs = chunks[:, None] * E_PAD + offs_e[None, :]
        c_ok = (chunks < n_chunks)[:, None]
        tile = tl.load(counts_ptr + ptrs, mask=c_ok, other=0)
        tl.store(chunk_base_ptr + ptrs, carry[None, :] + tl.cumsum(tile, axis=0) - tile, mask=c_ok)
        carry += tl.sum(tile, axis=0)
    _store_segments(expert_start_ptr, expert_count_ptr, carry, n_experts, align, capacity, E_PAD)


@triton.jit
def _scatter_kernel(
    ids_ptr, chunk_base_ptr, expert_start_ptr, slot_row_ptr, sorted_slot_ptr, row_expert_ptr,
    n_slots, n_experts, capacity,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, WRITE_ROWS: tl.constexpr, PDL: tl.constexpr = False,
):
    """slot_row[s] and, when WRITE_ROWS, sorted_slot[row] / row_expert[row] for this chunk's slots."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    slots = pid * CHUNK + lane
    in_range = slots < n_slots
    eid = tl.load(ids_ptr + slots, mask=in_range, other=-1)
    ok = in_range & (eid >= 0) & (eid < n_experts)
    e = tl.where(ok, eid, 0)
    within = tl.load(chunk_base_ptr + pid * E_PAD + e, mask=ok, other=0) + _rank_in_chunk(eid, ok, lane)
    # capacity 0 = unlimited. A `where`, not `scalar | block`: Triton 3.9's interpreter makes a scalar bool combined
    # with a block of bools an int32 array, which tl.store then rejects as a mask.
    placed = tl.where(capacity == 0, ok, ok & (within < capacity))
    row = tl.load(expert_start_ptr + e, mask=ok, other=0) + within
    state = tl.where(placed, row, tl.where(ok, OVERFLOW, SKIPPED))
    tl.store(slot_row_ptr + slots, state, mask=in_range)
    if WRITE_ROWS:
        tl.store(sorted_slot_ptr + row, slots, mask=placed)
        tl.store(row_expert_ptr + row, eid, mask=placed)


@triton.jit
def _permute_chunk_kernel(
    ids_ptr, expert_start_ptr, expert_count_ptr, slot_row_ptr, rows_ptr,
    n_slots, n_experts, n_rows, align, capacity, n_arrivals,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_R: tl.constexpr, WRITE_ROWS: tl.constexpr,
    ARRIVALS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """The three kernels above for a single chunk (chunk bases 0), in one program; with WRITE_ROWS, every row of
    `rows` = [sorted_slot; row_expert] ([2, n_rows], contiguous) is written (padding rows -1, as the fill before the
    three kernels), and with ARRIVALS the `n_arrivals` entries after them zeroed (the counters of the GEMM that
    follows; a constexpr, so that the launches without counters compile as before: at CHUNK = 128 the loop would
    cost gfx942 / gfx950 two spilled registers, and only NVIDIA's T = 1 launch has counters, `narrow_gate_up_for`)."""
    pdl_wait(PDL)
    lane = tl.arange(0, CHUNK)
    in_range = lane < n_slots
    eid = tl.load(ids_ptr + lane, mask=in_range, other=-1)
    ok = in_range & (eid >= 0) & (eid < n_experts)
    e = tl.where(ok, eid, 0)
    # counts and segments (`_offsets_kernel`)
    _store_segments(expert_start_ptr, expert_count_ptr, tl.histogram(e, E_PAD, mask=ok), n_experts, align, capacity,
                    E_PAD)
    # the program's own stores are visible to all its threads after the barrier (CUDA __syncthreads; on ROCm a
    # workgroup fence around s_barrier): each slot reads its expert's start back instead of a [CHUNK, E] pick
    tl.debug_barrier()
    # rows (`_scatter_kernel`): the start of the slot's expert plus its rank among the earlier slots of that expert
    rank = _rank_in_chunk(eid, ok, lane)
    own_start = tl.load(expert_start_ptr + e, mask=ok, other=0)
    placed = tl.where(capacity == 0, ok, ok & (rank < capacity))
    row = own_start + rank
    tl.store(slot_row_ptr + lane, tl.where(placed, row, tl.where(ok, OVERFLOW, SKIPPED)), mask=in_range)
    if WRITE_ROWS:
        # padding rows hold -1: fill every row, then (after a barrier: other threads wrote the fill) the placed ones
        for r0 in range(0, 2 * n_rows, BLOCK_R):
            entries = r0 + tl.arange(0, BLOCK_R)
            tl.store(rows_ptr + entries, tl.full([BLOCK_R], -1, tl.int32), mask=entries < 2 * n_rows)
        if ARRIVALS:  # the counters after the row maps
            for r0 in range(0, n_arrivals, BLOCK_R):
                entries = r0 + tl.arange(0, BLOCK_R)
                tl.store(rows_ptr + 2 * n_rows + entries, tl.zeros([BLOCK_R], tl.int32), mask=entries < n_arrivals)
        tl.debug_barrier()
        tl.store(rows_ptr + row, lane, mask=placed)
        tl.store(rows_ptr + n_rows + row, eid, mask=placed)


def compact_rows(n_slots: int, n_experts: int, align: int) -> int:
    """Rows `permute(align=align)` allocates for `n_slots` slots: each non-empty expert wastes at most align - 1."""
    return triton.cdiv(n_slots + min(n_experts, n_slots) * (align - 1), align) * align


def permute(
    topk_ids: torch.Tensor, n_experts: int, *, align: int = 0, capacity: int = 0, write_rows: bool = True,
    arrivals_per_block: int = 0,
) -> MoeLayout:
    """Expert-sorted row layout of the routing result (deterministic; no device sync).

    Args:
        topk_ids: [T, k] int32, contiguous; values in [-1, n_experts) (-1: skip the slot).
        n_experts: E.
        align: compact layout: each expert's segment is padded to a multiple of `align` rows (the
            grouped GEMM's BLOCK_M; DeepGEMM's `get_mk_alignment_for_contiguous_layout()`).
        capacity: masked layout: expert e owns rows [e * capacity, (e + 1) * capacity) (DeepGEMM's
            `m_grouped_fp8_gemm_nt_masked`). Exactly one of `align`, `capacity` is given.
        write_rows: also produce `sorted_slot` and `row_expert` (the row -> slot / expert maps).
        arrivals_per_block: compact layout: this many zeroed int32 counters per `align` rows in
            `MoeLayout.arrivals` (0: None); at one chunk the permute kernel zeroes them (no memset launch between
            it and the GEMM).

    Returns:
        The `MoeLayout`.
    """
    if (align > 0) == (capacity > 0):
        raise ValueError(f"align, capacity: give exactly one, got align={align}, capacity={capacity}")
    if arrivals_per_block and (capacity or not write_rows):
        raise ValueError("arrivals_per_block: only for the compact layout (align) with write_rows")
    prepare_interpreter()
    device = topk_ids.device
    n_slots = topk_ids.numel()
    n_rows = n_experts * capacity if capacity else compact_rows(n_slots, n_experts, align)
    arrivals = n_rows // align * arrivals_per_block if align else 0
    e_pad = triton.next_power_of_2(n_experts)
    n_chunks = triton.cdiv(n_slots, CHUNK)
    ids = topk_ids.reshape(-1)
    expert_start = torch.empty(n_experts + 1, dtype=torch.int32, device=device)
    expert_count = torch.empty(n_experts, dtype=torch.int32, device=device)
    slot_row = torch.empty(n_slots, dtype=torch.int32, device=device)
    if n_chunks == 1:
        # the row maps and, after them, the counters: one buffer, filled by the kernel
        buffer = torch.empty(2 * n_rows + arrivals, dtype=torch.int32, device=device) if write_rows else None
        rows = buffer[:2 * n_rows].view(2, n_rows) if buffer is not None else None
        counters = buffer[2 * n_rows:] if arrivals else None
        chunk = max(PERMUTE_MIN_CHUNK, triton.next_power_of_2(n_slots))
        _permute_chunk_kernel[(1,)](
            ids, expert_start, expert_count, slot_row, buffer if buffer is not None else slot_row,
            n_slots, n_experts, n_rows, align, capacity, arrivals,
            CHUNK=chunk, E_PAD=e_pad, BLOCK_R=PERMUTE_BLOCK_R, WRITE_ROWS=write_rows, ARRIVALS=arrivals > 0,
            num_warps=_permute_warps(chunk),
            **pdl_launch(),
        )
        return MoeLayout(slot_row, rows[0] if rows is not None else None, rows[1] if rows is not None else None,
                         expert_start, expert_count, n_rows, align, capacity, counters)
    counts = torch.empty((n_chunks, e_pad), dtype=torch.int32, device=device)
    chunk_base = torch.empty_like(counts)
    rows = torch.full((2, n_rows), -1, dtype=torch.int32, device=device) if write_rows else None
    counters = torch.zeros(arrivals, dtype=torch.int32, device=device) if arrivals else None
    if n_chunks:
        _count_kernel[(n_chunks,)](ids, counts, n_slots, n_experts, CHUNK=CHUNK, E_PAD=e_pad, **pdl_launch())
    _offsets_kernel[(1,)](counts, chunk_base, expert_start, expert_count, n_chunks, n_experts, align, capacity,
                          BLOCK_C=OFFSETS_BLOCK_C, E_PAD=e_pad, num_warps=PERMUTE_WARPS, **pdl_launch())
    if n_chunks:
        _scatter_kernel[(n_chunks,)](
            ids, chunk_base, expert_start, slot_row,
            rows[0] if rows is not None else slot_row, rows[1] if rows is not None else slot_row,
            n_slots, n_experts, capacity, CHUNK=CHUNK, E_PAD=e_pad, WRITE_ROWS=write_rows, num_warps=PERMUTE_WARPS,
            **pdl_launch(),
        )
    return MoeLayout(slot_row, rows[0] if rows is not None else None, rows[1] if rows is not None else None,
                     expert_start, expert_count, n_rows, align, capacity, counters)


@triton.jit
def _gather_rows_kernel(
    src_ptr, src_scale_ptr, slot_row_ptr, dst_ptr, dst_scale_ptr,
    n_slots, n_bytes, n_scales, rows_per_group,
    stride_src, stride_src_s_t, stride_src_s_k, stride_dst, stride_dst_s_g, stride_dst_s_m, stride_dst_s_k,
    TOPK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SCALES_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """dst[row(s)] = src[s // TOPK] (bytes) and its scales, for every placed slot s."""
    pdl_wait(PDL)
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    slots = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    row = tl.load(slot_row_ptr + slots, mask=slots < n_slots, other=SKIPPED)
    placed = row >= 0
    token = (slots // TOPK).to(tl.int64)
    row64 = row.to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = placed[:, None] & (cols < n_bytes)[None, :]
    data = tl.load(src_ptr + token[:, None] * stride_src + cols[None, :], mask=ok)
    tl.store(dst_ptr + row64[:, None] * stride_dst + cols[None, :], data, mask=ok)
    if pid_d == 0:
        kb = tl.arange(0, SCALES_PAD)
        s_ok = placed[:, None] & (kb < n_scales)[None, :]
        scale = tl.load(src_scale_ptr + token[:, None] * stride_src_s_t + kb[None, :] * stride_src_s_k, mask=s_ok)
        group = row64 // rows_per_group
        dst = group * stride_dst_s_g + (row64 - group * rows_per_group) * stride_dst_s_m
        tl.store(dst_scale_ptr + dst[:, None] + kb[None, :] * stride_dst_s_k, scale, mask=s_ok)


def gather_rows(
    q: torch.Tensor, scale: torch.Tensor, layout: MoeLayout, topk: int, out: torch.Tensor, out_scale: torch.Tensor,
) -> None:
    """Copy each placed slot's token row (FP8 values and scales) to its row of the expert-sorted layout.

    Rows that hold no slot are not written (the grouped GEMMs never read their results).

    Args:
        q: [T, K] FP8 token rows (contiguous last dim); scale: [T, K / 128] fp32, any strides.
        layout: from `permute`.
        topk: k (slot s belongs to token s // k).
        out: [n_rows, K] FP8 (or the masked layout's [E, capacity, K], contiguous).
        out_scale: [n_rows, K / 128] or [E, capacity, K / 128] fp32, any strides (DeepGEMM's MN-major).
    """
    prepare_interpreter()
    n_slots = layout.slot_row.numel()
    if n_slots == 0:
        return
    n_bytes = q.shape[1]
    grouped = out_scale.dim() == 3
    rows_per_group = out_scale.shape[1] if grouped else max(layout.n_rows, 1)
    s_strides = out_scale.stride() if grouped else (0, *out_scale.stride())
    src = q.view(torch.uint8)  # a pure byte copy: no FP8 arithmetic, any format
    dst = out.view(torch.uint8).reshape(-1, n_bytes)
    grid = (triton.cdiv(n_slots, GATHER_BLOCK_S), triton.cdiv(n_bytes, GATHER_BLOCK_D))
    _gather_rows_kernel[grid](
        src, scale, layout.slot_row, dst, out_scale, n_slots, n_bytes, scale.shape[1], rows_per_group,
        src.stride(0), scale.stride(0), scale.stride(1), dst.stride(0), *s_strides,
        TOPK=topk, BLOCK_S=GATHER_BLOCK_S, BLOCK_D=GATHER_BLOCK_D, SCALES_PAD=triton.next_power_of_2(scale.shape[1]),
        **pdl_launch(),
    )


@triton.jit
def _combine_kernel(
    y_ptr, slot_row_ptr, ids_ptr, shared_ptr, out_ptr,
    n_tokens, dim, stride_y, stride_shared, stride_out,
    TOPK: tl.constexpr, K_PAD: tl.constexpr, HAS_SHARED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """out[t] = bf16( sum over t's slots, in ascending expert id, of fp32 y[row] (+ fp32 shared[t]) )."""
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < n_tokens
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = cols < dim
    j = tl.arange(0, K_PAD)
    # order the slots by (expert id, slot): key = (id + 1) * K_PAD + j; padding lanes sort last
    eid = tl.load(ids_ptr + tokens[:, None] * TOPK + j[None, :], mask=t_ok[:, None] & (j < TOPK)[None, :], other=-1)
    eid = tl.minimum(tl.maximum(eid, -1), 1 << 20)
    key = tl.where((j < TOPK)[None, :], (eid + 1) * K_PAD + j[None, :], (1 << 21) * K_PAD)
    key = tl.sort(key, 1)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(TOPK):
        slot_j = tl.sum(tl.where(j[None, :] == i, key, 0), axis=1) % K_PAD
        row = tl.load(slot_row_ptr + tokens * TOPK + slot_j, mask=t_ok, other=SKIPPED)
        y = tl.load(y_ptr + row.to(tl.int64)[:, None] * stride_y + cols[None, :],
                    mask=(row >= 0)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.where((row == OVERFLOW)[:, None], float("nan"), y)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + tokens.to(tl.int64)[:, None] * stride_shared + cols[None, :],
                       mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(tl.bfloat16),
             mask=t_ok[:, None] & d_ok[None, :])


def combine(
    y: torch.Tensor, layout: MoeLayout, topk_ids: torch.Tensor, shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's routed expert outputs summed in fp32 (ascending expert id), plus `shared`, cast to bf16.

    Args:
        y: [n_rows, D] bf16 expert outputs in the layout's row order (contiguous last dim).
        layout: from `permute`.
        topk_ids: [T, k] int32 contiguous (only the order of the sum depends on it).
        shared: [T, D] bf16 shared expert output, or None.

    Returns:
        [T, D] bf16.
    """
    prepare_interpreter()
    n_tokens, topk = topk_ids.shape
    dim = y.shape[-1]
    out = torch.empty((n_tokens, dim), dtype=torch.bfloat16, device=y.device)
    if n_tokens == 0:
        return out
    block_t, block_d = by_token_count(n_tokens, DECODE_COMBINE_TOKENS,
                                      interpret=(INTERPRET_COMBINE_BLOCK_T, COMBINE_BLOCK_D),
                                      decode=(DECODE_COMBINE_BLOCK_T, DECODE_COMBINE_BLOCK_D),
                                      prefill=(COMBINE_BLOCK_T, COMBINE_BLOCK_D))
    grid = (triton.cdiv(n_tokens, block_t), triton.cdiv(dim, block_d))
    _combine_kernel[grid](
        y, layout.slot_row, topk_ids, shared if shared is not None else y, out,
        n_tokens, dim, y.stride(-2), shared.stride(0) if shared is not None else 0, out.stride(0),
        TOPK=topk, K_PAD=triton.next_power_of_2(topk), HAS_SHARED=shared is not None,
        BLOCK_T=block_t, BLOCK_D=block_d, **pdl_launch(),
    )
    return out


_I32 = "i32"
AOT_SPECS = [
    *(
        AotSpec(f"moe_count[E={e}]", _count_kernel,
                {"ids_ptr": "*i32", "counts_ptr": "*i32", "n_slots": _I32, "n_experts": _I32},
                {"CHUNK": CHUNK, "E_PAD": triton.next_power_of_2(e)}, aligned=("ids_ptr", "counts_ptr"))
        for e in (256, 384)
    ),
    *(
        AotSpec(f"moe_offsets[E={e}]", _offsets_kernel,
                {"counts_ptr": "*i32", "chunk_base_ptr": "*i32", "expert_start_ptr": "*i32",
                 "expert_count_ptr": "*i32", "n_chunks": _I32, "n_experts": _I32, "align": _I32, "capacity": _I32},
                {"BLOCK_C": OFFSETS_BLOCK_C, "E_PAD": triton.next_power_of_2(e)}, num_warps=PERMUTE_WARPS)
        for e in (256, 384)
    ),
    *(
        AotSpec(f"moe_scatter[E={e},rows={rows}]", _scatter_kernel,
                {"ids_ptr": "*i32", "chunk_base_ptr": "*i32", "expert_start_ptr": "*i32", "slot_row_ptr": "*i32",
                 "sorted_slot_ptr": "*i32", "row_expert_ptr": "*i32", "n_slots": _I32, "n_experts": _I32,
                 "capacity": _I32},
                {"CHUNK": CHUNK, "E_PAD": triton.next_power_of_2(e), "WRITE_ROWS": rows}, num_warps=PERMUTE_WARPS)
        for e in (256, 384) for rows in (True, False)
    ),
    *(
        AotSpec(f"moe_permute_chunk[E={e},rows={rows},chunk={chunk}{',arrivals' if arrivals else ''}]",
                _permute_chunk_kernel,
                {"ids_ptr": "*i32", "expert_start_ptr": "*i32", "expert_count_ptr": "*i32", "slot_row_ptr": "*i32",
                 "rows_ptr": "*i32", "n_slots": _I32, "n_experts": _I32, "n_rows": _I32,
                 "align": _I32, "capacity": _I32, "n_arrivals": _I32},
                {"CHUNK": chunk, "E_PAD": triton.next_power_of_2(e), "BLOCK_R": PERMUTE_BLOCK_R, "WRITE_ROWS": rows,
                 "ARRIVALS": arrivals},
                num_warps=_permute_warps(chunk), aligned=("ids_ptr", "slot_row_ptr", "rows_ptr"))
        for e in (256, 384) for rows in (True, False) for chunk in (PERMUTE_MIN_CHUNK, CHUNK // 2, CHUNK)
        # the T = 1 launch of the narrow gate/up tiles' counters (`narrow_gate_up_for`)
        for arrivals in ((False, True) if rows and chunk == PERMUTE_MIN_CHUNK else (False,))
    ),
    AotSpec("moe_gather_rows", _gather_rows_kernel,
            {"src_ptr": "*u8", "src_scale_ptr": "*fp32", "slot_row_ptr": "*i32", "dst_ptr": "*u8",
             "dst_scale_ptr": "*fp32", **{k: _I32 for k in (
                 "n_slots", "n_bytes", "n_scales", "rows_per_group", "stride_src", "stride_src_s_t", "stride_src_s_k",
                 "stride_dst", "stride_dst_s_g", "stride_dst_s_m", "stride_dst_s_k")}},
            {"TOPK": 6, "BLOCK_S": GATHER_BLOCK_S, "BLOCK_D": GATHER_BLOCK_D, "SCALES_PAD": 32},
            aligned=("src_ptr", "src_scale_ptr", "slot_row_ptr", "dst_ptr", "dst_scale_ptr", "stride_src",
                     "stride_dst")),
    *(
        AotSpec(f"moe_combine[shared={shared},block_t={block_t}]", _combine_kernel,
                {"y_ptr": "*bf16", "slot_row_ptr": "*i32", "ids_ptr": "*i32", "shared_ptr": "*bf16",
                 "out_ptr": "*bf16", "n_tokens": _I32, "dim": _I32, "stride_y": _I32, "stride_shared": _I32,
                 "stride_out": _I32},
                {"TOPK": 6, "K_PAD": 8, "HAS_SHARED": shared, "BLOCK_T": block_t, "BLOCK_D": block_d},
                aligned=("y_ptr", "slot_row_ptr", "ids_ptr", "shared_ptr", "out_ptr", "stride_y", "stride_shared",
                         "stride_out"))
        for shared in (True, False)
        for block_t, block_d in ((DECODE_COMBINE_BLOCK_T, DECODE_COMBINE_BLOCK_D), (COMBINE_BLOCK_T, COMBINE_BLOCK_D))
    ),
]
