"""DSv4 attention: projections, the candidate set of each token, sparse attention with a sink, and
the `Attention` module for prefill, chunked prefill and decode (spec §3).

The per-position definition (spec §3.5), which every execution order must reproduce: token `t` of a
sequence, at position `p`, attends with each query head to the union of
  - `W(t)`: the window KV rows of the same sequence at positions `max(0, p - 127) .. p`;
  - `C(t)`: compressed entries of the same sequence — CSA: the indexer's top-k of the visible entries;
    HCA: every visible entry; SWA-only: none. Entry `j` is visible when `j < (p + 1) // ratio`.
The same 512-d row is the key and the value. Output: inverse RoPE, grouped `wo_a`, `wo_b`
(`reference.einsum.output_projection`).

Execution. Tokens are flattened (`x [T, D]`, `positions [T]`, sequences by `cu_seqlens [B+1]`).
`Attention.forward` treats every call the same way: each sequence continues from its cache (an empty
one for a plain prefill) — compressors advance over the new tokens, the window ring and compressed
entries grow — and `candidate_indices` lays out one KV pool for the whole batch with a `[T, K]` index
list per token; `sparse_attention` then evaluates the formula. Every reduction accumulates in fp64 and
rounds once to fp32 (`reference.invariant`), so a token's result does not depend on the batch it is in
or on the padding of its index list: decode, chunked prefill and prefill agree bitwise by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from einops import rearrange
from torch import nn

from reference.cache import AttentionCache
from reference.compressor import (
    KV_QUANT_BLOCK,
    ROPE_DIMS,
    CompressorWeights,
    compress_chunk,
    random_compressor_weights,
)
from reference.config import DSv4Config
from reference.einsum import output_projection
from reference.formats import E4M3FN, FP8Format, quant_dequant_fp8
from reference.indexer import (
    INDEXER_RATIO,
    IndexerWeights,
    indexer_q,
    indexer_scores,
    indexer_topk,
    random_indexer_weights,
)
from reference.invariant import einsum_fp32, sum_fp32
from reference.linear import fp8_linear, rms_norm
from reference.numerics import OFFICIAL, Numerics
from reference.rope import apply_rope, yarn_frequencies
from reference.weights import Fp8Weight, random_fp8_weight

# Tokens per gather in `sparse_attention`: bounds the [chunk, K, 512] fp64 workspace (~300 MB at
# K = 1152, DSv4-Pro's window + top-1024). Tokens are independent, so the chunking changes nothing.
ATTENTION_TOKEN_CHUNK = 64


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionWeights:
    """Weights of one attention layer (checkpoint names `attn.*`, spec §1.1).

    Attributes:
        wq_a: `Fp8Weight` [q_lora_rank, D].
        q_norm: [q_lora_rank] bf16.
        wq_b: `Fp8Weight` [H * 512, q_lora_rank].
        wkv: `Fp8Weight` [512, D].
        kv_norm: [512] bf16.
        wo_a: `Fp8Weight` [G * o_lora_rank, (H / G) * 512].
        wo_b: `Fp8Weight` [D, G * o_lora_rank].
        attn_sink: [H] fp32 — per-head sink logit (not scaled by 512^-0.5).
        compressor: main `CompressorWeights` (ratio 4 or 128, head dim 512), None on SWA layers.
        indexer: `IndexerWeights` on CSA layers, else None.
    """

    wq_a: Fp8Weight
    q_norm: torch.Tensor
    wq_b: Fp8Weight
    wkv: Fp8Weight
    kv_norm: torch.Tensor
    wo_a: Fp8Weight
    wo_b: Fp8Weight
    attn_sink: torch.Tensor
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None

    def check(self, cfg: DSv4Config, layer_id: int) -> None:
        """Raise `ValueError` unless every shape matches layer `layer_id` of `cfg`."""
        h, d, q, g, r = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
        expect = {
            "wq_a": (q, cfg.dim), "q_norm": (q,), "wq_b": (h * d, q), "wkv": (d, cfg.dim), "kv_norm": (d,),
            "wo_a": (g * r, cfg.o_group_dim), "wo_b": (cfg.dim, g * r), "attn_sink": (h,),
        }
        for name, shape in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"weights.{name}: expected {list(shape)} for layer {layer_id} of {cfg.name}, "
                                 f"got {list(got)}")
        if self.attn_sink.dtype != torch.float32:
            raise TypeError(f"weights.attn_sink: expected float32, got {self.attn_sink.dtype}")
        ratio, kind = cfg.compress_ratio(layer_id), cfg.layer_kind(layer_id)
        if (self.compressor is None) != (ratio == 0):
            raise ValueError(f"weights.compressor: a {kind} layer needs {'none' if ratio == 0 else 'one'}")
        if self.compressor is not None and (self.compressor.ratio, self.compressor.head_dim) != (ratio, d):
            raise ValueError(f"weights.compressor: expected ratio {ratio} and head dim {d}, got "
                             f"{self.compressor.ratio} and {self.compressor.head_dim}")
        if (self.indexer is None) != (kind != "csa"):
            raise ValueError(f"weights.indexer: a {kind} layer needs {'one' if kind == 'csa' else 'none'}")
        if self.indexer is not None and (self.indexer.n_heads, self.indexer.head_dim) != (cfg.index_n_heads,
                                                                                         cfg.index_head_dim):
            raise ValueError(f"weights.indexer: expected {cfg.index_n_heads} heads of {cfg.index_head_dim}, got "
                             f"{self.indexer.n_heads} of {self.indexer.head_dim}")

    def to(self, device: torch.device | str) -> AttentionWeights:
        return AttentionWeights(
            self.wq_a.to(device), self.q_norm.to(device), self.wq_b.to(device), self.wkv.to(device),
            self.kv_norm.to(device), self.wo_a.to(device), self.wo_b.to(device), self.attn_sink.to(device),
            None if self.compressor is None else self.compressor.to(device),
            None if self.indexer is None else self.indexer.to(device),
        )


def random_attention_weights(
    cfg: DSv4Config, layer_id: int, *, fmt: str | FP8Format = E4M3FN, generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> AttentionWeights:
    """Random weights of layer `layer_id`: FP8 linears as checkpoints store them, norm weights around 1,
    sinks ~ N(0, 1) (the scale of the attention logits, so the sink takes a visible share)."""
    h, d, q, g, r = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    ratio, kind = cfg.compress_ratio(layer_id), cfg.layer_kind(layer_id)

    def fp8(n: int, k: int) -> Fp8Weight:
        return random_fp8_weight(n, k, fmt=fmt, generator=generator)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=generator)).to(torch.bfloat16)

    return AttentionWeights(
        wq_a=fp8(q, cfg.dim), q_norm=norm(q), wq_b=fp8(h * d, q), wkv=fp8(d, cfg.dim), kv_norm=norm(d),
        wo_a=fp8(g * r, cfg.o_group_dim), wo_b=fp8(cfg.dim, g * r),
        attn_sink=torch.randn(h, generator=generator),
        compressor=random_compressor_weights(cfg.dim, ratio, d, generator=generator) if ratio else None,
        indexer=random_indexer_weights(cfg, fmt=fmt, generator=generator) if kind == "csa" else None,
    ).to(device)


# ------------------------------------------------------------------------------------------------
# Projections (spec §3.2)
# ------------------------------------------------------------------------------------------------


def head_rms_norm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm without weight, in bf16 arithmetic as the official code evaluates it.

    Official: `q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)` on the bf16 tensor, so the
    square, the mean (accumulated in fp32), `+ eps`, the rsqrt and the product each round to bf16.
    We reproduce that (vLLM's fused kernel normalizes in fp32; the difference is the bf16 rounding of
    the per-head factor, at most 2^-9 relative).

    Args:
        q: [T, H, d] bf16.

    Returns:
        [T, H, d] bf16.
    """
    bf16 = torch.bfloat16
    square = q.float().square().to(bf16)
    mean = (sum_fp32(square, dim=-1, keepdim=True) / q.shape[-1]).to(bf16)
    inv_rms = torch.rsqrt((mean.float() + eps).to(bf16).float()).to(bf16)
    return (q.float() * inv_rms.float()).to(bf16)


def project_q(
    x: torch.Tensor, w: AttentionWeights, cfg: DSv4Config, positions: torch.Tensor, freqs: torch.Tensor,
    numerics: Numerics,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries: `c_q = q_norm(wq_a(x))`, `q = wq_b(c_q)` per head, per-head RMSNorm, RoPE (spec §3.2).

    Args:
        x: [T, D] bf16.
        positions: [T] int.
        freqs: [32] fp32 RoPE frequencies of the layer.

    Returns:
        q: [T, H, 512] bf16.
        c_q: [T, q_lora_rank] bf16 — the query latent, also the indexer's input.
    """
    c_q = rms_norm(fp8_linear(x, w.wq_a, numerics), w.q_norm, cfg.norm_eps)
    q = rearrange(fp8_linear(c_q, w.wq_b, numerics), "t (h d) -> t h d", h=cfg.n_heads)
    q = apply_rope(head_rms_norm(q, cfg.norm_eps), positions, freqs)
    return q, c_q


def project_kv(
    x: torch.Tensor, w: AttentionWeights, cfg: DSv4Config, positions: torch.Tensor, freqs: torch.Tensor,
    numerics: Numerics,
) -> torch.Tensor:
    """Window KV rows: `kv_norm(wkv(x))`, RoPE on the last 64 dims, `QD_fp8(.; 64)` of the 448 NoPE
    dims when `numerics.kv_fp8_sim` (what the FP8 cache stores; spec §3.2).

    Args:
        x: [T, D] bf16.
        positions: [T] int.

    Returns:
        [T, 512] bf16 — one shared head, used as K and V.
    """
    kv = rms_norm(fp8_linear(x, w.wkv, numerics), w.kv_norm, cfg.norm_eps)
    kv = apply_rope(kv, positions, freqs)
    if numerics.kv_fp8_sim:
        nope = quant_dequant_fp8(kv[:, :-ROPE_DIMS], KV_QUANT_BLOCK, numerics.fp8_format)
        kv = torch.cat((nope, kv[:, -ROPE_DIMS:]), dim=-1)
    return kv


# ------------------------------------------------------------------------------------------------
# Candidate set (spec §3.5)
# ------------------------------------------------------------------------------------------------


def visible_entries(positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """HCA's compressed selection: every visible entry `j < (p + 1) // ratio`, padded with -1.

    Args:
        positions: [T] int.
        ratio: compression ratio.
        width: number of columns (at least the largest visible count).

    Returns:
        [T, width] int32.
    """
    j = torch.arange(width, device=positions.device)
    return torch.where(j[None, :] < (positions[:, None] + 1) // ratio, j[None, :], -1).to(torch.int32)


def candidate_indices(
    window_rows: Sequence[torch.Tensor], window_first: Sequence[int], compressed: Sequence[torch.Tensor],
    selection: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, window_size: int, *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay out one KV pool for a batch and the index list `S(t) = W(t) ∪ C(t)` of each token.

    Pool layout: for each sequence `b` in order, its window rows (positions `window_first[b] ..`)
    then its compressed entries. Index list of a token at position `p` of sequence `b`: first
    `window_size` columns for the window positions `p - window_size + 1 .. p` in ascending order (-1
    below position 0), then one column per column of `selection` (entry ids within the sequence,
    -1 = none) mapped into the pool.

    Args:
        window_rows: per sequence, [n_w_b, 512] bf16 — KV rows of consecutive positions, covering
            `max(0, p - window_size + 1) .. p` for every token `p` of the sequence in this batch.
        window_first: per sequence, the position of `window_rows[b][0]`.
        compressed: per sequence, [n_c_b, 512] bf16 compressed entries (0 rows on SWA layers).
        selection: [T, k] int32 — each token's compressed entries (CSA: `indexer_topk`; HCA:
            `visible_entries`; SWA: k = 0).
        positions: [T] int.
        cu_seqlens: [B + 1] int32, on the CPU or on the device.
        window_size: window length (128).
        validate: check that the window rows cover the tokens' windows and that the selection is in range
            (reads the device; the optimized layers turn it off under CUDA-graph capture).

    Returns:
        kv: [N, 512] bf16 — the pool.
        indices: [T, window_size + k] int32 — rows of `kv`, -1 = empty slot.
    """
    bounds = cu_seqlens.tolist()
    pool, window_cols, compressed_cols = [], [], []
    base = 0
    offsets = torch.arange(-window_size + 1, 1, device=positions.device)
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        rows, first, entries = window_rows[b], window_first[b], compressed[b]
        window_pos = positions[start:end, None] + offsets[None, :]  # [T_b, window_size]
        if validate and end > start and (int(window_pos[:, -1].max()) >= first + rows.shape[0]
                            or int(window_pos.clamp(min=0)[:, 0].min()) < first):
            raise ValueError(f"window_rows[{b}]: positions {first}..{first + rows.shape[0] - 1} do not cover the "
                             f"windows of the sequence's tokens")
        window_cols.append(torch.where(window_pos >= 0, base + window_pos - first, -1))
        sel = selection[start:end].long()
        if validate and sel.numel() and (int(sel.min()) < -1 or int(sel.max()) >= entries.shape[0]):
            raise ValueError(f"selection: sequence {b} has {entries.shape[0]} entries, selects "
                             f"{int(sel.min())}..{int(sel.max())} (-1 = none)")
        compressed_cols.append(torch.where(sel >= 0, base + rows.shape[0] + sel, -1))
        pool += [rows, entries]
        base += rows.shape[0] + entries.shape[0]
    indices = torch.cat((torch.cat(window_cols), torch.cat(compressed_cols)), dim=1)
    return torch.cat(pool), indices.to(torch.int32)


# ------------------------------------------------------------------------------------------------
# Sparse attention with sink (spec §3.5)
# ------------------------------------------------------------------------------------------------


def _check_sparse_attention_args(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> None:
    if q.dim() != 3 or q.dtype != torch.bfloat16:
        raise ValueError(f"q: expected [T, H, D] bf16, got {q.dtype} {list(q.shape)}")
    t, h, d = q.shape
    if kv.dim() != 2 or kv.shape[1] != d or kv.dtype != torch.bfloat16:
        raise ValueError(f"kv: expected [N, {d}] bf16, got {kv.dtype} {list(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != t or indices.dtype != torch.int32:
        raise ValueError(f"indices: expected [{t}, K] int32, got {indices.dtype} {list(indices.shape)}")
    if sink.shape != (h,) or sink.dtype != torch.float32:
        raise ValueError(f"sink: expected [{h}] fp32, got {sink.dtype} {list(sink.shape)}")
    for name, tensor in (("kv", kv), ("indices", indices), ("sink", sink)):
        if tensor.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), got {tensor.device}")
    if not scale > 0:
        raise ValueError(f"scale: expected a positive float, got {scale}")
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= kv.shape[0]:
            raise ValueError(f"indices: expected values in -1..{kv.shape[0] - 1} (rows of kv, -1 = empty), "
                             f"got {lo}..{hi}")
        ordered = indices.sort(dim=-1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if bool(repeated.any()):
            row = int(repeated.any(dim=-1).nonzero()[0])
            raise ValueError(f"indices: row {row} selects a kv row twice; each row may appear once per token")


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of each token over its own KV rows, with a per-head sink (spec §3.5).

    For token t and head h, over the slots i with `indices[t, i] >= 0` (the row `kv[indices[t, i]]` is
    the key and the value):
        z_i = scale * q_h . k_i                  (fp32)
        M   = max_i z_i
        o_h = sum_i bf16(e^{z_i - M}) k_i / (sum_i e^{z_i - M} + e^{sink_h - M})
    The probabilities are rounded to bf16 before the P V product, as the official TileLang kernel does
    (it rounds them relative to its running maximum, which equals M from the block holding the maximum
    on); the denominator uses the fp32 values; the sink is not scaled. Slots `-1` are ignored; a row may appear
    at most once per token (duplicates would count twice; they raise). Tokens without any slot give 0.

    Args:
        q: [T, H, 512] bf16.
        kv: [N, 512] bf16.
        indices: [T, K] int32, values in -1..N-1.
        sink: [H] fp32.
        scale: logit scale (`512^-0.5`).

    Returns:
        [T, H, 512] bf16.
    """
    _check_sparse_attention_args(q, kv, indices, sink, scale)
    if indices.shape[1] == 0:  # K = 0: no token has a slot
        return torch.zeros_like(q)
    # an empty slot reads an all-zero row appended to kv, so nothing (not even a NaN) leaks into it
    kv_or_zero = torch.cat((kv, kv.new_zeros(1, kv.shape[1])))
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], ATTENTION_TOKEN_CHUNK):
        chunk = slice(start, start + ATTENTION_TOKEN_CHUNK)
        out[chunk] = _attend(q[chunk], kv_or_zero, indices[chunk], sink, scale)
    return out


def _attend(
    q: torch.Tensor, kv_or_zero: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """`sparse_attention` for a few tokens; `kv_or_zero` is kv with a zero row appended."""
    valid = indices >= 0  # [t, K]
    rows = kv_or_zero[torch.where(valid, indices, kv_or_zero.shape[0] - 1).long()].double()  # [t, K, d]
    logits = einsum_fp32("thd,tkd->thk", q, rows) * scale  # z_i, fp32
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    row_max = logits.amax(dim=-1)  # M, [t, H]; -inf for a token without slots (its output is 0 below)
    row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
    weight = torch.exp(logits - row_max[..., None])  # e^{z_i - M}, 0 on empty slots
    denominator = sum_fp32(weight, dim=-1) + torch.exp(sink[None, :] - row_max)
    o = einsum_fp32("thk,tkd->thd", weight.to(torch.bfloat16), rows) / denominator[..., None]
    has_slots = valid.any(dim=-1)[:, None, None]
    return torch.where(has_slots, o, 0.0).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# The module
# ------------------------------------------------------------------------------------------------


def check_continuation(positions: torch.Tensor, bounds: list[int], sequences: Sequence[Any]) -> None:
    """Each sequence's first new token continues its cache (`sequences[b].next_position`); raises ValueError."""
    started = [b for b in range(len(sequences)) if bounds[b + 1] > bounds[b]]
    firsts = positions[[bounds[b] for b in started]].tolist()  # one device read for the whole batch
    for b, first in zip(started, firsts):
        if first != sequences[b].next_position:
            raise ValueError(f"positions: sequence {b} starts at {first}, its cache continues at "
                             f"{sequences[b].next_position}")


def check_tokens(
    x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, dim: int, *, validate_positions: bool = True
) -> list[int]:
    """Validate a flattened batch; return the sequence bounds `cu_seqlens.tolist()`.

    Raises `TypeError`/`ValueError` naming the argument unless `x` is [T, dim] bf16, `positions` [T]
    int64 on x's device, `cu_seqlens` [B + 1] int32 (on the CPU, or on the device: then reading it waits
    for the device) starting at 0, non-decreasing, ending at T, and the positions of each sequence are
    consecutive and increasing (`validate_positions`: this check reads the device; the optimized layers
    skip it under CUDA-graph capture).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"x: expected [T, {dim}], got {list(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected bfloat16, got {x.dtype}")
    if positions.dtype != torch.int64:
        raise TypeError(f"positions: expected int64, got {positions.dtype}")
    if positions.shape != (x.shape[0],) or positions.device != x.device:
        raise ValueError(f"positions: expected [{x.shape[0]}] on {x.device} (one per token of x), "
                         f"got {list(positions.shape)} on {positions.device}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens: expected int32, got {cu_seqlens.dtype}")
    bounds = cu_seqlens.tolist()
    if cu_seqlens.dim() != 1 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != x.shape[0] or any(
            b > c for b, c in pairwise(bounds)):
        raise ValueError(f"cu_seqlens: expected [B + 1] non-decreasing offsets from 0 to T = {x.shape[0]}, "
                         f"got {bounds}")
    if validate_positions and x.shape[0]:
        # every step between neighbouring tokens is +1, except where a new sequence starts (one device read)
        starts = torch.zeros(x.shape[0], dtype=torch.bool)
        starts[[b for b in bounds[1:-1] if b < x.shape[0]]] = True
        bad_step = (positions[1:] - positions[:-1] != 1) & ~starts[1:].to(x.device)
        if bool(bad_step.any() | (positions.min() < 0)):
            raise ValueError("positions: expected non-negative positions increasing by 1 within each sequence")
    return bounds


class Attention(nn.Module):
    """One DSv4 attention layer (SWA, CSA or HCA by `cfg.compress_ratios[layer_id]`).

    `forward(x, positions, cu_seqlens, cache=None)`: without a cache every sequence is a fresh prompt
    (positions from 0); with an `AttentionCache` each sequence continues where its cache left off
    (chunked prefill, or decode with one or a few tokens per sequence) and the cache is updated.
    """

    def __init__(self, cfg: DSv4Config, layer_id: int, weights: AttentionWeights, numerics: Numerics = OFFICIAL):
        super().__init__()
        weights.check(cfg, layer_id)
        self.cfg, self.layer_id, self.weights, self.numerics = cfg, layer_id, weights, numerics
        self.kind = cfg.layer_kind(layer_id)
        self.ratio = cfg.compress_ratio(layer_id)
        self.freqs = yarn_frequencies(cfg, self.ratio).to(weights.attn_sink.device)
        self.softmax_scale = cfg.head_dim**-0.5

    def attention_inputs(
        self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, cache: AttentionCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before the attention core: queries, the batch's KV pool and each token's
        candidate indices (exactly what `sparse_attention` receives). Updates `cache`.

        Args:
            x: [T, D] bf16.
            positions: [T] int64.
            cu_seqlens: [B + 1] int32.
            cache: `AttentionCache` of this layer with B sequences, or None (fresh prompts).

        Returns:
            q: [T, H, 512] bf16; kv: [N, 512] bf16; indices: [T, window_size + k] int32.
        """
        cfg, w, numerics = self.cfg, self.weights, self.numerics
        bounds = check_tokens(x, positions, cu_seqlens, cfg.dim)
        batch = len(bounds) - 1
        if cache is None:
            cache = AttentionCache.empty(cfg, self.layer_id, batch, x.device)
        elif not isinstance(cache, AttentionCache):
            raise TypeError(f"cache: expected an AttentionCache or None, got {type(cache).__name__}")
        cache.check(cfg, self.layer_id, batch, x.device)
        check_continuation(positions, bounds, cache.sequences)

        q, c_q = project_q(x, w, cfg, positions, self.freqs, numerics)
        kv = project_kv(x, w, cfg, positions, self.freqs, numerics)
        if self.kind == "csa":
            q_idx, head_weights = indexer_q(c_q, x, w.indexer, positions, self.freqs, numerics)

        win = cfg.window_size
        window_rows, window_first, compressed, selections = [], [], [], []
        for b, seq in enumerate(cache.sequences):
            tokens = slice(bounds[b], bounds[b + 1])
            start = seq.next_position
            # window rows: the ring's last positions before this chunk, then the chunk's own rows
            first = max(0, start - win + 1)
            history = seq.window[torch.arange(first, start, device=x.device) % win]
            window_rows.append(torch.cat((history, kv[tokens])))
            window_first.append(first)
            if self.ratio:
                new = compress_chunk(x[tokens], positions[tokens], seq.compressor, w.compressor, freqs=self.freqs,
                                     numerics=numerics, rotate="main", norm_eps=cfg.norm_eps)
                seq.compressed = torch.cat((seq.compressed, new))
            if self.kind == "csa":
                new = compress_chunk(x[tokens], positions[tokens], seq.indexer_compressor, w.indexer.compressor,
                                     freqs=self.freqs, numerics=numerics, rotate="indexer", norm_eps=cfg.norm_eps)
                seq.indexer_keys = torch.cat((seq.indexer_keys, new))
                scores = indexer_scores(q_idx[tokens], seq.indexer_keys, head_weights[tokens], numerics)
                n_visible = (positions[tokens] + 1) // INDEXER_RATIO
                selections.append(indexer_topk(scores, n_visible, cfg.index_topk))
            compressed.append(seq.compressed)
            last = slice(max(tokens.start, tokens.stop - win), tokens.stop)  # rows that stay in the ring
            seq.window[positions[last] % win] = kv[last]
            seq.next_position = start + tokens.stop - tokens.start
        if self.kind == "csa":
            selection = torch.cat(selections)
        elif self.kind == "hca":
            width = max((e.shape[0] for e in compressed), default=0)
            selection = visible_entries(positions, self.ratio, width)
        else:
            selection = torch.zeros(x.shape[0], 0, dtype=torch.int32, device=x.device)
        kv_pool, indices = candidate_indices(window_rows, window_first, compressed, selection, positions, cu_seqlens,
                                             win)
        return q, kv_pool, indices

    def attend(
        self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, cache: AttentionCache | None = None
    ) -> torch.Tensor:
        """The attention output before the output projection: [T, H, 512] bf16. Updates `cache`."""
        q, kv, indices = self.attention_inputs(x, positions, cu_seqlens, cache)
        return sparse_attention(q, kv, indices, self.weights.attn_sink, self.softmax_scale)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, cache: AttentionCache | None = None
    ) -> torch.Tensor:
        """x [T, D] bf16 -> [T, D] bf16 (see the class docstring). Updates `cache`."""
        o = self.attend(x, positions, cu_seqlens, cache)
        return output_projection(o, positions, self.freqs, self.weights.wo_a, self.weights.wo_b, self.numerics)
