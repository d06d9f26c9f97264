"""The KV compressor of CSA and HCA layers: gated softmax pooling of `ratio` tokens into one entry
(spec §3.3).

Per token `t` at position `p`, in fp32: `a_t = x_t Wkv^T`, `b_t = x_t Wgate^T + ape[p mod m]`
(`[coff * d]` each; `m` = ratio, `d` = head dim, `coff = 2` when `m = 4`). Block `j` holds positions
`jm .. jm+m-1`; entry `j` exists once position `jm+m-1` has been processed.

- `m = 128` (HCA, no overlap): `u_j[c] = sum_{t in block j} softmax_t(b_t[c]) a_t[c]`, a softmax over
  the block's tokens for every channel `c` separately.
- `m = 4` (CSA, overlap): the first `d` channels of a token feed the *next* entry, the last `d` its
  own. Entry `j` pools 8 slots per channel: the 4 tokens of block `j-1` with `(a[:d], b[:d])` and the
  4 tokens of block `j` with `(a[d:], b[d:])`. Entry 0 has no previous block: those slots are
  `a = 0, b = -inf` (they get zero weight).

Then `k_j = RMSNorm(u_j)` (official rounds `u_j` to bf16 before the norm; `Numerics.compressed_norm_input`),
RoPE on its last 64 dims at the block's first position `j*m`, and either `QD_fp8(.; 64)` of the NoPE
dims (the main compressor, like the window KV) or the Hadamard rotation and `QD_fp4(.; 32)` (the
indexer's compressor, `d = 128`), each as `Numerics` says.

One function does the work, `compress_chunk`: it continues a sequence from a `CompressorState` over
any number of new tokens. The prefill form `compress` is a chunk from the empty state (it is the
official prefill: all blocks at once, `overlap_transform`, pooling); the incremental form
`compress_step` is a chunk of one token (the official decode). The state holds what the official
decode holds — fp32 `kv_state` / `score_state` of the last `coff * m` tokens, `score` already
including `ape` — so both forms see the same slot values and give bitwise identical entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from einops import rearrange

from reference.formats import quant_dequant_fp4, quant_dequant_fp8
from reference.hadamard import hadamard_rotate
from reference.invariant import linear_fp32, sum_fp32
from reference.linear import rms_norm
from reference.numerics import Numerics
from reference.rope import apply_rope

Rotate = Literal["main", "indexer"]
ROPE_DIMS = 64  # the last 64 dims of every entry carry RoPE (spec §2.8)
KV_QUANT_BLOCK = 64  # QD_fp8 block of the NoPE dims (spec §3.2)
FP4_QUANT_BLOCK = 32  # QD_fp4 block of the indexer keys (spec §3.4)


def overlap_factor(ratio: int) -> int:
    """`coff`: 2 for the overlapping ratio-4 compressor, 1 for ratio 128."""
    if ratio not in (4, 128):
        raise ValueError(f"ratio: expected 4 (CSA) or 128 (HCA), got {ratio}")
    return 2 if ratio == 4 else 1


@dataclass(frozen=True)
class CompressorWeights:
    """Weights of one compressor (checkpoint names `compressor.{wkv, wgate, ape, norm}`).

    Attributes:
        wkv: [coff * d, D] bf16 — value projection (official holds an fp32 copy; same values).
        wgate: [coff * d, D] bf16 — gate (score) projection.
        ape: [m, coff * d] fp32 — additive position embedding of the score, by `p mod m`.
        norm: [d] bf16 — RMSNorm weight of the pooled entry.
    """

    wkv: torch.Tensor
    wgate: torch.Tensor
    ape: torch.Tensor
    norm: torch.Tensor

    def __post_init__(self) -> None:
        ratio, d = self.ape.shape[0], self.norm.shape[-1]
        coff = overlap_factor(ratio)
        for name in ("wkv", "wgate"):
            w = getattr(self, name)
            if w.dim() != 2 or w.shape[0] != coff * d or w.shape != self.wkv.shape:
                raise ValueError(f"{name}: expected [{coff * d}, D] (coff {coff} x head dim {d}) like wkv, "
                                 f"got {tuple(w.shape)}")
        if tuple(self.ape.shape) != (ratio, coff * d):
            raise ValueError(f"ape: expected [{ratio}, {coff * d}], got {tuple(self.ape.shape)}")
        if self.ape.dtype != torch.float32:
            raise TypeError(f"ape: expected float32, got {self.ape.dtype}")

    @property
    def ratio(self) -> int:
        return self.ape.shape[0]

    @property
    def head_dim(self) -> int:
        return self.norm.shape[-1]

    def to(self, device: torch.device | str) -> CompressorWeights:
        return CompressorWeights(self.wkv.to(device), self.wgate.to(device), self.ape.to(device),
                                 self.norm.to(device))


def random_compressor_weights(
    dim: int, ratio: int, head_dim: int, *, generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> CompressorWeights:
    """Random compressor weights: projections with unit-variance outputs, a gate `ape` of std 0.5 (so
    positions in a block get visibly different weights), norm weights around 1."""
    n = overlap_factor(ratio) * head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    return CompressorWeights(
        wkv=(randn(n, dim) * dim**-0.5).to(torch.bfloat16),
        wgate=(randn(n, dim) * dim**-0.5).to(torch.bfloat16),
        ape=randn(ratio, n) * 0.5,
        norm=(1 + 0.1 * randn(head_dim)).to(torch.bfloat16),
    ).to(device)


@dataclass
class CompressorState:
    """What one sequence's compressor carries between calls (official `kv_state` / `score_state`).

    Row layout (rows are tokens, columns the `coff * d` projected channels):
      - ratio 4: rows `0..3` hold the previous *complete* block (its `a[:d], b[:d]` halves feed the
        next entry; before entry 0 they are `a = 0, b = -inf`), rows `4 + (p mod 4)` the tokens of the
        current incomplete block.
      - ratio 128: row `p mod 128` holds the tokens of the current incomplete block.
    Rows past the current block's tokens are `a = 0, b = -inf` (never read).

    Attributes:
        kv: [coff * m, coff * d] fp32 — `a_t`.
        score: [coff * m, coff * d] fp32 — `b_t` including `ape`.
        next_position: position of the next token of this sequence (= tokens consumed).
    """

    kv: torch.Tensor
    score: torch.Tensor
    next_position: int = 0

    @classmethod
    def empty(cls, ratio: int, head_dim: int, device: torch.device | str = "cpu") -> CompressorState:
        coff = overlap_factor(ratio)
        shape = (coff * ratio, coff * head_dim)
        return cls(torch.zeros(shape, dtype=torch.float32, device=device),
                   torch.full(shape, float("-inf"), dtype=torch.float32, device=device))

    def check(self, weights: CompressorWeights, name: str = "state") -> None:
        """Raise if this state does not belong to a compressor with `weights`."""
        coff = overlap_factor(weights.ratio)
        expect = (coff * weights.ratio, coff * weights.head_dim)
        for field in ("kv", "score"):
            t = getattr(self, field)
            if tuple(t.shape) != expect or t.dtype != torch.float32:
                raise ValueError(f"{name}.{field}: expected fp32 {list(expect)} for a ratio-{weights.ratio} "
                                 f"compressor with head dim {weights.head_dim}, got {t.dtype} {list(t.shape)}")


def compressor_projections(
    x: torch.Tensor, positions: torch.Tensor, weights: CompressorWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """`a_t = x_t Wkv^T` and `b_t = x_t Wgate^T + ape[p_t mod m]`, in fp32 (spec §3.3).

    Args:
        x: [T, D] bf16.
        positions: [T] int.

    Returns:
        kv, score: [T, coff * d] fp32 each.
    """
    kv = linear_fp32(x, weights.wkv)
    score = linear_fp32(x, weights.wgate) + weights.ape[positions % weights.ratio]
    return kv, score


def pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Gated pooling of the slots of each entry: a softmax over the slots, per channel (fp32).

    `u[n, c] = sum_s softmax_s(score[n, :, c])[s] * kv[n, s, c]`; slots with score `-inf` get weight 0.

    Args:
        kv: [n, S, d] fp32 (S = 8 for ratio 4, 128 for ratio 128).
        score: [n, S, d] fp32.

    Returns:
        [n, d] fp32.
    """
    weight = torch.exp(score - score.amax(dim=1, keepdim=True))
    weight = weight / sum_fp32(weight, dim=1, keepdim=True)
    return sum_fp32(weight * kv, dim=1)


def finish_entries(
    u: torch.Tensor, entry_ids: torch.Tensor, weights: CompressorWeights, *, freqs: torch.Tensor,
    numerics: Numerics, rotate: Rotate, norm_eps: float,
) -> torch.Tensor:
    """Pooled entries -> what the cache holds: RMSNorm, RoPE at `j * m`, then the quantization
    simulation of the main compressor (QD_fp8 64 of the NoPE dims) or of the indexer (Hadamard,
    QD_fp4 32).

    Args:
        u: [n, d] fp32 pooled entries.
        entry_ids: [n] int entry indices `j`.

    Returns:
        [n, d] bf16.
    """
    if numerics.compressed_norm_input == "bf16":
        u = u.to(torch.bfloat16)  # official rounds the pooled entry to bf16 before its norm
    k = rms_norm(u, weights.norm, norm_eps).to(torch.bfloat16)
    k = apply_rope(k, entry_ids * weights.ratio, freqs)  # RoPE position = the block's first token
    if rotate == "main":
        if numerics.kv_fp8_sim:
            nope = quant_dequant_fp8(k[:, :-ROPE_DIMS], KV_QUANT_BLOCK, numerics.fp8_format)
            k = torch.cat((nope, k[:, -ROPE_DIMS:]), dim=-1)
        return k
    if numerics.indexer_hadamard:
        k = hadamard_rotate(k)
    if numerics.indexer_fp4_sim:
        k = quant_dequant_fp4(k, FP4_QUANT_BLOCK)
    return k


def _check_chunk(x: torch.Tensor, positions: torch.Tensor, start: int, weights: CompressorWeights) -> None:
    if x.dim() != 2 or x.shape[1] != weights.wkv.shape[1]:
        raise ValueError(f"x: expected [T, {weights.wkv.shape[1]}], got {list(x.shape)}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions: expected [{x.shape[0]}] (one per token of x), got {list(positions.shape)}")
    expect = torch.arange(start, start + x.shape[0], device=positions.device)
    if not torch.equal(positions.long(), expect):
        raise ValueError(f"positions: expected consecutive positions {start}..{start + x.shape[0] - 1} "
                         f"continuing the compressor state, got {positions.tolist()[:8]}...")


def compress_chunk(
    x: torch.Tensor, positions: torch.Tensor, state: CompressorState, weights: CompressorWeights, *,
    freqs: torch.Tensor, numerics: Numerics, rotate: Rotate, norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Feed the next tokens of one sequence to its compressor; return the entries they complete.

    Updates `state` in place.

    Args:
        x: [T, D] bf16, the tokens at positions `state.next_position ..` (T may be 0).
        positions: [T] int, those positions.
        state: the sequence's `CompressorState`.
        weights: `CompressorWeights` (its `ape` rows give the ratio, `norm` the head dim d).
        freqs: [32] fp32 RoPE frequencies of the layer.
        numerics: quantization simulation switches.
        rotate: `"main"` (QD_fp8 64 of the NoPE dims) or `"indexer"` (Hadamard + QD_fp4 32).
        norm_eps: RMSNorm epsilon.

    Returns:
        [n_new, d] bf16: entries `next_position // m ..`, one per block completed by these tokens.
    """
    if rotate not in ("main", "indexer"):
        raise ValueError(f"rotate: expected 'main' or 'indexer', got {rotate!r}")
    state.check(weights)
    start = state.next_position
    _check_chunk(x, positions, start, weights)
    m, d = weights.ratio, weights.head_dim
    coff = overlap_factor(m)
    kv, score = compressor_projections(x, positions, weights)

    # The current block's tokens so far (positions start - r .. start - 1), then the new ones.
    r = start % m
    current = (coff - 1) * m  # first state row of the current block
    kv_run = torch.cat((state.kv[current:current + r], kv))
    score_run = torch.cat((state.score[current:current + r], score))
    n_new = kv_run.shape[0] // m
    blocks_kv = rearrange(kv_run[: n_new * m], "(n m) c -> n m c", m=m)
    blocks_score = rearrange(score_run[: n_new * m], "(n m) c -> n m c", m=m)

    if coff == 2:
        # Entry j: slots = block j-1 with its first d channels, then block j with its last d.
        # The block before the first new one is in the state (zeros / -inf before entry 0).
        prev_kv = torch.cat((state.kv[None, :m], blocks_kv))[:n_new]
        prev_score = torch.cat((state.score[None, :m], blocks_score))[:n_new]
        slots_kv = torch.cat((prev_kv[..., :d], blocks_kv[..., d:]), dim=1)
        slots_score = torch.cat((prev_score[..., :d], blocks_score[..., d:]), dim=1)
    else:
        slots_kv, slots_score = blocks_kv, blocks_score
    entry_ids = torch.arange(start // m, start // m + n_new, device=x.device)
    entries = finish_entries(pool(slots_kv, slots_score), entry_ids, weights, freqs=freqs, numerics=numerics,
                             rotate=rotate, norm_eps=norm_eps)

    # New state: the last complete block (ratio 4) and the tokens of the new incomplete block.
    if coff == 2 and n_new > 0:
        state.kv[:m], state.score[:m] = blocks_kv[-1], blocks_score[-1]
    tail = kv_run.shape[0] - n_new * m
    state.kv[current:], state.score[current:] = 0.0, float("-inf")
    state.kv[current:current + tail] = kv_run[n_new * m:]
    state.score[current:current + tail] = score_run[n_new * m:]
    state.next_position = start + x.shape[0]
    return entries


def compress(
    x: torch.Tensor, positions: torch.Tensor, weights: CompressorWeights, *, ratio: int, head_dim: int,
    freqs: torch.Tensor, numerics: Numerics, rotate: Rotate, norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Prefill form: every entry of one sequence whose tokens are at positions `0 .. T-1`.

    Entry `j` exists iff `j < T // ratio` (its last token, `j*m + m - 1`, is in the prompt); the
    remainder tokens only matter to later entries (use `compress_chunk` with a state to keep them).

    Args:
        x: [T, D] bf16.
        positions: [T] int, `0 .. T-1`.
        weights: `CompressorWeights` of that ratio and head dim.
        ratio, head_dim: m and d; checked against `weights`.

    Returns:
        [T // ratio, head_dim] bf16.
    """
    if (weights.ratio, weights.head_dim) != (ratio, head_dim):
        raise ValueError(f"weights: hold a ratio-{weights.ratio} compressor with head dim {weights.head_dim}, "
                         f"called with ratio {ratio} and head_dim {head_dim}")
    state = CompressorState.empty(ratio, head_dim, x.device)
    return compress_chunk(x, positions, state, weights, freqs=freqs, numerics=numerics, rotate=rotate,
                          norm_eps=norm_eps)


def compress_step(
    x_t: torch.Tensor, p_t: int, state: CompressorState, weights: CompressorWeights, *, freqs: torch.Tensor,
    numerics: Numerics, rotate: Rotate, norm_eps: float = 1e-6,
) -> torch.Tensor | None:
    """Incremental form: one token of one sequence; the entry it completes, if any.

    Args:
        x_t: [D] bf16, the token at position `p_t == state.next_position`.
        p_t: its position.
        state: updated in place.

    Returns:
        [d] bf16 entry `p_t // m` when `(p_t + 1) % m == 0`, else None.
    """
    positions = torch.tensor([p_t], device=x_t.device)
    entries = compress_chunk(x_t[None], positions, state, weights, freqs=freqs, numerics=numerics, rotate=rotate,
                             norm_eps=norm_eps)
    return entries[0] if entries.shape[0] else None
