"""The lightning indexer of CSA layers: which compressed entries each token attends to (spec §3.4).

Per token `t` at position `p`, `n_c(p) = (p + 1) // 4` compressed entries are visible.
1. `qI = indexer.wq_b(c_q)` viewed as `[Hi, 128]`, RoPE on the last 64 of each head's 128 dims, then
   the Hadamard rotation and `QD_fp4(.; 32)` (official; `Numerics.indexer_hadamard`, `indexer_fp4_sim`).
2. `w_t = weights_proj(x_t) * (128^-0.5 * Hi^-0.5)` — one weight per index head.
3. `kI_j` from the indexer's own compressor (ratio 4, `d = 128`, Hadamard + FP4 per `Numerics`).
4. `I[t, j] = sum_h w_t[h] * ReLU(qI_{t,h} . kI_j)`; the official code evaluates this in bf16
   (`Numerics.indexer_scores_bf16`), so scores tie often.
5. `C(t)` = the `min(index_topk, n_c(p))` visible entries with the largest scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from reference.compressor import FP4_QUANT_BLOCK, CompressorWeights, random_compressor_weights
from reference.config import DSv4Config
from reference.formats import E4M3FN, FP8Format, quant_dequant_fp4
from reference.hadamard import hadamard_rotate
from reference.invariant import einsum_fp32, linear_fp32, sum_fp32
from reference.linear import fp8_linear
from reference.numerics import Numerics
from reference.rope import apply_rope
from reference.weights import Fp8Weight, random_fp8_weight

INDEXER_RATIO = 4  # only CSA layers have an indexer


@dataclass(frozen=True)
class IndexerWeights:
    """Weights of one layer's lightning indexer (checkpoint names `indexer.*`).

    Attributes:
        wq_b: `Fp8Weight` [Hi * 128, q_lora_rank] — index queries from `c_q`.
        weights_proj: [Hi, D] bf16 — per-head weights from `x`.
        compressor: `CompressorWeights` of ratio 4 with head dim 128 (the index keys).
    """

    wq_b: Fp8Weight
    weights_proj: torch.Tensor
    compressor: CompressorWeights

    def __post_init__(self) -> None:
        n_heads, head_dim = self.weights_proj.shape[0], self.compressor.head_dim
        if self.wq_b.shape[0] != n_heads * head_dim:
            raise ValueError(f"wq_b: expected {n_heads * head_dim} rows ({n_heads} heads x {head_dim}), "
                             f"got {self.wq_b.shape[0]}")
        if self.compressor.ratio != INDEXER_RATIO:
            raise ValueError(f"compressor: the indexer's compressor has ratio {INDEXER_RATIO}, "
                             f"got {self.compressor.ratio}")

    @property
    def n_heads(self) -> int:
        return self.weights_proj.shape[0]

    @property
    def head_dim(self) -> int:
        return self.compressor.head_dim

    def to(self, device: torch.device | str) -> IndexerWeights:
        return IndexerWeights(self.wq_b.to(device), self.weights_proj.to(device), self.compressor.to(device))


def random_indexer_weights(
    cfg: DSv4Config, *, fmt: str | FP8Format = E4M3FN, generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> IndexerWeights:
    """Random indexer weights of `cfg`'s shapes (FP8 `wq_b` as checkpoints store it)."""
    weights_proj = torch.randn(cfg.index_n_heads, cfg.dim, generator=generator) * cfg.dim**-0.5
    return IndexerWeights(
        wq_b=random_fp8_weight(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, fmt=fmt,
                               generator=generator),
        weights_proj=weights_proj.to(torch.bfloat16),
        compressor=random_compressor_weights(cfg.dim, INDEXER_RATIO, cfg.index_head_dim, generator=generator),
    ).to(device)


def indexer_q(
    c_q: torch.Tensor, x: torch.Tensor, w: IndexerWeights, positions: torch.Tensor, freqs: torch.Tensor,
    numerics: Numerics,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries and per-head weights of each token (spec §3.4 steps 1-2).

    Args:
        c_q: [T, q_lora_rank] bf16 — the normalized query latent (`project_q`'s second output).
        x: [T, D] bf16 — the attention input.
        w: `IndexerWeights`.
        positions: [T] int.
        freqs: [32] fp32 RoPE frequencies of the layer.
        numerics: Hadamard / FP4 / bf16-score switches.

    Returns:
        q_idx: [T, Hi, 128] bf16.
        head_weights: [T, Hi] fp32 — `weights_proj(x) * 128^-0.5 * Hi^-0.5`, rounded to bf16 when
        `numerics.indexer_scores_bf16` (official multiplies the bf16 projection in bf16).
    """
    q = rearrange(fp8_linear(c_q, w.wq_b, numerics), "t (h d) -> t h d", h=w.n_heads)
    q = apply_rope(q, positions, freqs)
    if numerics.indexer_hadamard:
        q = hadamard_rotate(q)
    if numerics.indexer_fp4_sim:
        q = quant_dequant_fp4(q, FP4_QUANT_BLOCK)
    projected = linear_fp32(x, w.weights_proj).to(torch.bfloat16)  # a bf16 linear (official dtype)
    head_weights = projected.float() * (w.head_dim**-0.5 * w.n_heads**-0.5)
    if numerics.indexer_scores_bf16:
        head_weights = head_weights.to(torch.bfloat16).float()
    return q, head_weights


def indexer_scores(
    q_idx: torch.Tensor, k_idx: torch.Tensor, head_weights: torch.Tensor, numerics: Numerics
) -> torch.Tensor:
    """Index scores `I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j])` of every token against every
    entry (visibility is applied by `indexer_topk`).

    With `numerics.indexer_scores_bf16` the official bf16 evaluation is reproduced: the dot products,
    the weighted terms and the head sum are each rounded to bf16 (every product accumulates in fp32
    first). Otherwise everything stays fp32.

    Args:
        q_idx: [T, Hi, d] bf16.
        k_idx: [N, d] bf16.
        head_weights: [T, Hi] fp32.

    Returns:
        [T, N] fp32.
    """
    if q_idx.dim() != 3 or k_idx.dim() != 2 or q_idx.shape[-1] != k_idx.shape[-1]:
        raise ValueError(f"q_idx, k_idx: expected [T, Hi, d] and [N, d], got {list(q_idx.shape)} and "
                         f"{list(k_idx.shape)}")
    if head_weights.shape != q_idx.shape[:2]:
        raise ValueError(f"head_weights: expected {list(q_idx.shape[:2])}, got {list(head_weights.shape)}")
    logits = einsum_fp32("thd,nd->thn", q_idx, k_idx)
    if numerics.indexer_scores_bf16:
        terms = (logits.to(torch.bfloat16).relu().float() * head_weights[..., None]).to(torch.bfloat16)
        return sum_fp32(terms, dim=1).to(torch.bfloat16).float()
    return sum_fp32(logits.relu() * head_weights[..., None], dim=1)


def indexer_topk(scores: torch.Tensor, n_visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The selected entries of each token: the `min(topk, n_visible[t])` largest visible scores.

    Entries `j >= n_visible[t]` are invisible (scored `-inf`). Among equal scores the lower entry index
    comes first (a stable sort), so the selection of a token does not depend on how many entries
    exist past its visible ones. Output order: by descending score; the order does not matter to
    attention.

    Args:
        scores: [T, N] fp32.
        n_visible: [T] int — visible entries per token, `(p + 1) // 4` (at most N).
        topk: selection size (`index_topk`).

    Returns:
        [T, topk] int32 entry indices, padded with -1.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores: expected [T, N], got {list(scores.shape)}")
    if n_visible.shape != scores.shape[:1]:
        raise ValueError(f"n_visible: expected [{scores.shape[0]}], got {list(n_visible.shape)}")
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    if n_visible.numel() and (int(n_visible.min()) < 0 or int(n_visible.max()) > scores.shape[1]):
        raise ValueError(f"n_visible: expected values in 0..{scores.shape[1]} (the number of entries), "
                         f"got {int(n_visible.min())}..{int(n_visible.max())}")
    entry = torch.arange(scores.shape[1], device=scores.device)
    visible = entry[None, :] < n_visible[:, None].to(scores.device)
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    # pad with -1 up to topk columns, then drop every rank at or past the token's visible count
    pad = torch.full((scores.shape[0], max(0, topk - scores.shape[1])), -1, dtype=order.dtype, device=order.device)
    selected = torch.cat((order, pad), dim=-1)[:, :topk]
    rank = torch.arange(topk, device=scores.device)
    return torch.where(rank[None, :] < n_visible[:, None].to(scores.device), selected, -1).to(torch.int32)
