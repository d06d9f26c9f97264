"""Lightning-indexer logits and the top-k selection over them (spec §3.4), as Triton kernels.

Logits: `I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])` with fp32 dot products and an fp32 sum over the
heads in head order; in official numerics (`round_bf16`) the dot, each weighted term and the sum are rounded
to bf16, as `reference.indexer.indexer_scores` evaluates them. Each token
reads the keys of its own sequence: row `t` covers pool rows `k_start[t] .. k_end[t]` and is written
relative to `k_start[t]` (`out[t, j]` is pool row `k_start[t] + j`), the layout DeepGEMM's `fp8_fp4_mqa_logits`
uses, so both backends feed the same top-k kernel.

Top-k: per row, the `topk` largest of the first `n_visible[t]` scores, ties broken toward the lower index,
written in ascending index order and padded with -1 (`k = min(topk, n_visible)`). The kernel finds the
`topk`-th largest value exactly by a 32-step bitwise search over order-preserving integer keys of the fp32
scores (no sort, no atomics), then writes every index above it and the lowest-indexed ties at it with a
prefix sum. Deterministic; `-0.0` counts as `+0.0` (they compare equal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.triton._fp8 import prepare_interpreter
from optimized.triton.aot import AotSpec

# logits tiles: BLOCK_T tokens x BLOCK_N keys, looping over the heads (K = head_dim = 128 per MMA)
LOGITS_BLOCK_T = 64
LOGITS_BLOCK_N = 64
LOGITS_NUM_WARPS = 8
# Decode: a tile of the pool holds one sequence's keys, which only that sequence's few tokens score, so a tile of
# 64 tokens spanning 64 sequences computes 64 dots for each useful one. Tiles of 16 tokens (tl.dot's smallest M)
# where no sequence has more than DECODE_MAX_TOKENS new tokens (design note 36; H100, batch 64 x 8192 keys:
# 1968 -> 836 us, the same logits: docs/h200/ab-indexer-decode-tiles-h100.json).
DECODE_BLOCK_T = 16
DECODE_NUM_WARPS = 4
DECODE_MAX_TOKENS = 32
# top-k: a row of at most TOPK_SINGLE_BLOCK scores is held in registers for all 32 search steps; longer rows
# are streamed in TOPK_BLOCK_N chunks per step (from L2).
TOPK_SINGLE_BLOCK = 2048
TOPK_BLOCK_N = 4096
TOPK_NUM_WARPS = 8


@triton.jit
def _indexer_logits_kernel(
    q_ptr, k_ptr, w_ptr, k_start_ptr, k_end_ptr, out_ptr, T, N, n_heads,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_ot,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """One program = BLOCK_T tokens x BLOCK_N pool rows; skipped when no token of the tile sees the rows."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < T
    k_start = tl.load(k_start_ptr + tokens, mask=token_ok, other=0)
    k_end = tl.load(k_end_ptr + tokens, mask=token_ok, other=0)
    n0 = tl.program_id(1) * BLOCK_N
    first = tl.min(tl.where(token_ok, k_start, N), axis=0)
    if (tl.max(k_end, axis=0) > n0) & (first < n0 + BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        k = tl.load(k_ptr + rows[:, None].to(tl.int64) * stride_kn + dims[None, :], mask=(rows < N)[:, None],
                    other=0.0)
        t64 = tokens.to(tl.int64)
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for h in range(0, n_heads):
            q = tl.load(q_ptr + t64[:, None] * stride_qt + h * stride_qh + dims[None, :],
                        mask=token_ok[:, None], other=0.0)
            w = tl.load(w_ptr + t64 * stride_wt + h, mask=token_ok, other=0.0)
            s = tl.dot(q, tl.trans(k))  # fp32
            if ROUND_BF16:
                # official bf16 evaluation: the dot, the weighted term and the head sum each round to bf16
                s = s.to(tl.bfloat16).to(tl.float32)
                acc += (tl.maximum(s, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32)
            else:
                acc += tl.maximum(s, 0.0) * w[:, None]
        if ROUND_BF16:
            acc = acc.to(tl.bfloat16).to(tl.float32)
        seen = token_ok[:, None] & (rows[None, :] >= k_start[:, None]) & (rows[None, :] < k_end[:, None])
        tl.store(out_ptr + t64[:, None] * stride_ot + (rows[None, :] - k_start[:, None]), acc, mask=seen)


@triton.jit
def _order_keys(scores_ptr, offs, n_visible):
    """fp32 scores -> int64 keys in [0, 2^32) ordered like the floats; positions >= n_visible -> -1."""
    visible = offs < n_visible
    x = tl.load(scores_ptr + offs, mask=visible, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    return tl.where(visible, ordered.to(tl.int64) + 2147483648, -1)


@triton.jit
def _count_at_least(scores_ptr, keys, n_visible, bound, SINGLE: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many visible keys are >= bound (`keys` holds the whole row when SINGLE)."""
    if SINGLE:
        count = tl.sum((keys >= bound).to(tl.int32), axis=0)
    else:
        count = 0
        for start in range(0, n_visible, BLOCK_N):
            chunk = _order_keys(scores_ptr, start + tl.arange(0, BLOCK_N), n_visible)
            count += tl.sum((chunk >= bound).to(tl.int32), axis=0)
    return count


@triton.jit
def _topk_kernel(
    scores_ptr, n_visible_ptr, offset_ptr, out_ptr, N, TOPK, stride_st, stride_ot,
    BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, HAS_OFFSET: tl.constexpr,
):
    """One program = one row: exact threshold by bitwise search, then an index-ordered write."""
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * stride_st
    out = out_ptr + t * stride_ot
    n_visible = tl.minimum(tl.load(n_visible_ptr + t).to(tl.int32), N)
    offset = 0
    if HAS_OFFSET:
        offset = tl.load(offset_ptr + t).to(tl.int32)
    lanes = tl.arange(0, BLOCK_N)
    keys = lanes.to(tl.int64)  # unused unless SINGLE
    if SINGLE:
        keys = _order_keys(row, lanes, n_visible)

    # threshold: the TOPK-th largest key, built bit by bit from the top (-1 = take every visible entry)
    threshold = tl.full([], -1, tl.int64)
    if n_visible > TOPK:
        threshold = tl.full([], 0, tl.int64)
        for i in range(0, 32):
            candidate = threshold | (tl.full([], 1, tl.int64) << (31 - i))
            if _count_at_least(row, keys, n_visible, candidate, SINGLE, BLOCK_N) >= TOPK:
                threshold = candidate
    # entries above the threshold all go in; the rest of the TOPK slots go to the lowest-indexed ties
    ties_wanted = TOPK - _count_at_least(row, keys, n_visible, threshold + 1, SINGLE, BLOCK_N)

    written = 0
    ties_seen = 0
    for start in range(0, n_visible, BLOCK_N):
        offs = start + lanes
        if SINGLE:
            chunk = keys
        else:
            chunk = _order_keys(row, offs, n_visible)
        tie = (chunk == threshold) & (offs < n_visible)
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) + ties_seen  # 1-based among the row's ties
        take = (chunk > threshold) | (tie & (tie_rank <= ties_wanted))
        slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out + slot, offs + offset, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
    for start in range(written, TOPK, BLOCK_N):
        slots = start + lanes
        tl.store(out + slots, tl.full([BLOCK_N], -1, tl.int32), mask=slots < TOPK)


def indexer_logits(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor,
    max_len: int, *, round_bf16: bool, tokens_per_sequence: int | None = None,
) -> torch.Tensor:
    """Logits of each token over its own range of the key pool.

    Args:
        q: [T, Hi, 128] bf16 indexer queries.
        k: [N, 128] bf16 key pool (compressed indexer keys of every sequence).
        weights: [T, Hi] fp32 head weights.
        k_start, k_end: [T] int32: token t scores pool rows k_start[t] .. k_end[t] - 1.
        max_len: columns of the output (>= max(k_end - k_start)).
        round_bf16: the official bf16 evaluation (dots, terms and sums rounded to bf16).
        tokens_per_sequence: the most new tokens of one sequence in the batch, where the caller knows it (the
            layer): at most DECODE_MAX_TOKENS takes the decode tiles. None: the prefill tiles.

    Returns:
        [T, max_len] fp32; `out[t, j]` scores pool row `k_start[t] + j` for `j < k_end[t] - k_start[t]`;
        the rest of the row is not written.
    """
    prepare_interpreter()
    n_tokens, n_heads, head_dim = q.shape
    out = torch.empty((n_tokens, max(max_len, 1)), dtype=torch.float32, device=q.device)
    if n_tokens == 0 or k.shape[0] == 0:
        return out[:, :max_len]
    decode = tokens_per_sequence is not None and tokens_per_sequence <= DECODE_MAX_TOKENS
    block_t, num_warps = (DECODE_BLOCK_T, DECODE_NUM_WARPS) if decode else (LOGITS_BLOCK_T, LOGITS_NUM_WARPS)
    grid = (triton.cdiv(n_tokens, block_t), triton.cdiv(k.shape[0], LOGITS_BLOCK_N))
    _indexer_logits_kernel[grid](
        q, k, weights, k_start, k_end, out, n_tokens, k.shape[0], n_heads,
        q.stride(0), q.stride(1), k.stride(0), weights.stride(0), out.stride(0),
        HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_N=LOGITS_BLOCK_N, ROUND_BF16=round_bf16, num_warps=num_warps,
    )
    return out[:, :max_len]


def topk_indices(
    scores: torch.Tensor, n_visible: torch.Tensor, topk: int, offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row, the indices of the `topk` largest among the first `n_visible[t]` scores.

    Args:
        scores: [T, N] fp32 (rows may be strided).
        n_visible: [T] int: row t considers columns 0 .. n_visible[t] - 1 (clamped to N).
        topk: how many to keep.
        offsets: [T] int32 added to every written index (pool offsets of relative logits), or None.

    Returns:
        [T, topk] int32, ascending indices, ties toward the lower index, padded with -1.
    """
    prepare_interpreter()
    n_tokens, n = scores.shape
    out = torch.empty((n_tokens, topk), dtype=torch.int32, device=scores.device)
    if n_tokens == 0 or topk == 0:
        return out
    single = n <= TOPK_SINGLE_BLOCK
    block = triton.next_power_of_2(max(n, 16)) if single else TOPK_BLOCK_N
    _topk_kernel[(n_tokens,)](
        scores, n_visible, offsets if offsets is not None else n_visible, out, n, topk,
        scores.stride(0), out.stride(0),
        BLOCK_N=block, SINGLE=single, HAS_OFFSET=offsets is not None, num_warps=TOPK_NUM_WARPS,
    )
    return out


def indexer_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, head_weights: torch.Tensor, *,
                   round_bf16: bool) -> torch.Tensor:
    """`[T, N]` scores of every token against every key (the reference's `indexer_scores`)."""
    n_tokens, n = q_idx.shape[0], k_idx.shape[0]
    zeros = torch.zeros(n_tokens, dtype=torch.int32, device=q_idx.device)
    return indexer_logits(q_idx, k_idx, head_weights, zeros, zeros + n, n, round_bf16=round_bf16)


def indexer_topk(scores: torch.Tensor, n_visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The reference's `indexer_topk`: `[T, topk]` int32 (ascending indices here; sets are what count)."""
    return topk_indices(scores, n_visible.to(torch.int32), topk)


_LOGITS_SIGNATURE = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "k_start_ptr": "*i32", "k_end_ptr": "*i32",
    "out_ptr": "*fp32", "T": "i32", "N": "i32", "n_heads": "i32", "stride_qt": "i32", "stride_qh": "i32",
    "stride_kn": "i32", "stride_wt": "i32", "stride_ot": "i32",
}
_TOPK_SIGNATURE = {
    "scores_ptr": "*fp32", "n_visible_ptr": "*i32", "offset_ptr": "*i32", "out_ptr": "*i32", "N": "i32",
    "TOPK": "i32", "stride_st": "i32", "stride_ot": "i32",
}

AOT_SPECS = [
    AotSpec(f"indexer_logits[BLOCK_T={block_t},round_bf16={rb}]", _indexer_logits_kernel, _LOGITS_SIGNATURE,
            {"HEAD_DIM": 128, "BLOCK_T": block_t, "BLOCK_N": LOGITS_BLOCK_N, "ROUND_BF16": rb},
            num_warps=num_warps)
    for rb in (True, False)
    for block_t, num_warps in ((LOGITS_BLOCK_T, LOGITS_NUM_WARPS), (DECODE_BLOCK_T, DECODE_NUM_WARPS))
] + [
    # FLASH prefill 8192 tokens: 2048 entries per row (single block); decode at 32768: 8192; longer: streamed
    AotSpec(f"indexer_topk[BLOCK_N={block},single={single}]", _topk_kernel, _TOPK_SIGNATURE,
            {"BLOCK_N": block, "SINGLE": single, "HAS_OFFSET": True}, num_warps=TOPK_NUM_WARPS)
    for block, single in ((256, True), (TOPK_SINGLE_BLOCK, True), (TOPK_BLOCK_N, False))
]
