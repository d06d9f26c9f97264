"""The attention state kept between calls, and the 584-byte FP8 KV layout (spec §3.5, §3.8).

`AttentionCache` holds, per sequence, what the next call of the same layer needs: the last
`window_size` KV rows (a ring, row `p mod window_size` for position `p`, like the official decode
cache), the compressor states, the compressed entries and the indexer keys, and the next position.
The reference keeps KV rows as bf16 (after the QD_fp8 simulation when `Numerics.kv_fp8_sim`), which is
exactly what the 584-byte layout stores: `unpack_kv(pack_kv(kv)) == kv` bitwise for such rows.

584-byte layout of one KV row (FlashMLA "MODEL1" / vLLM `fp8_ds_mla`, spec §3.8), per token:

    bytes   0 .. 447   448 FP8 values of the NoPE dims 0..447, in 7 blocks of 64
    bytes 448 .. 575   the 64 RoPE dims 448..511 as bf16, little-endian (2 bytes each)
    bytes 576 .. 582   7 UE8M0 scale bytes (2^(e-127)), one per NoPE block, in block order
    byte  583          0 (pad)

FlashMLA's paged cache stores a block's `[bs, 576]` data rows and then its `[bs, 8]` scale rows; the
bytes of one token are the same as here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reference.compressor import CompressorState
from reference.config import DSv4Config, LayerKind
from reference.formats import (
    E4M3FN,
    FP8Format,
    dequantize_per_token,
    fp8_format,
    fp32_to_ue8m0,
    quantize_per_token,
    ue8m0_to_fp32,
)

KV_DIM = 512  # head_dim: one shared KV head, used as K and V
KV_ROPE_DIMS = 64
KV_NOPE_DIMS = KV_DIM - KV_ROPE_DIMS  # 448
KV_QUANT_BLOCK = 64
KV_SCALES = KV_NOPE_DIMS // KV_QUANT_BLOCK  # 7
KV_PACKED_BYTES = KV_NOPE_DIMS + 2 * KV_ROPE_DIMS + KV_SCALES + 1  # 448 + 128 + 7 + 1 = 584
_ROPE_BYTES = slice(KV_NOPE_DIMS, KV_NOPE_DIMS + 2 * KV_ROPE_DIMS)
_SCALE_BYTES = slice(KV_NOPE_DIMS + 2 * KV_ROPE_DIMS, KV_PACKED_BYTES - 1)


def pack_kv(kv: torch.Tensor, fmt: str | FP8Format = E4M3FN) -> torch.Tensor:
    """KV rows -> the 584-byte layout: NoPE dims quantized to FP8 per 64 with UE8M0 scales (the
    official `act_quant(., 64)`, amax floor 1e-4), RoPE dims copied as bf16 bytes.

    Args:
        kv: [N, 512] bf16.
        fmt: FP8 format of the NoPE bytes (`"e4m3fn"`, or `"e4m3fnuz"` on gfx942).

    Returns:
        [N, 584] uint8.
    """
    if kv.dim() != 2 or kv.shape[1] != KV_DIM or kv.dtype != torch.bfloat16:
        raise ValueError(f"kv: expected [N, {KV_DIM}] bf16, got {kv.dtype} {list(kv.shape)}")
    q, s = quantize_per_token(kv[:, :KV_NOPE_DIMS], KV_QUANT_BLOCK, fmt)
    rope = kv[:, KV_NOPE_DIMS:].contiguous().view(torch.uint8)
    scales = fp32_to_ue8m0(s).view(torch.uint8)
    pad = torch.zeros(kv.shape[0], 1, dtype=torch.uint8, device=kv.device)
    return torch.cat((q.view(torch.uint8), rope, scales, pad), dim=1)


def unpack_kv(packed: torch.Tensor, fmt: str | FP8Format = E4M3FN) -> torch.Tensor:
    """The 584-byte layout -> KV rows: `bf16(fp8 * 2^(e-127))` for the NoPE dims (exact), the RoPE
    bytes as bf16.

    Args:
        packed: [N, 584] uint8.
        fmt: FP8 format the NoPE bytes were written in.

    Returns:
        [N, 512] bf16.
    """
    if packed.dim() != 2 or packed.shape[1] != KV_PACKED_BYTES or packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected [N, {KV_PACKED_BYTES}] uint8, got {packed.dtype} {list(packed.shape)}")
    f = fp8_format(fmt)
    q = packed[:, :KV_NOPE_DIMS].contiguous().view(f.dtype)
    s = ue8m0_to_fp32(packed[:, _SCALE_BYTES].contiguous())
    nope = dequantize_per_token(q, s, KV_QUANT_BLOCK).to(torch.bfloat16)
    rope = packed[:, _ROPE_BYTES].contiguous().view(torch.bfloat16)
    return torch.cat((nope, rope), dim=1)


@dataclass
class SequenceCache:
    """One sequence's state for one attention layer.

    Attributes:
        next_position: position of the sequence's next token (= tokens seen so far).
        window: [window_size, 512] bf16 ring — row `p mod window_size` holds the KV row of position
            `p` for the last `min(next_position, window_size)` positions; other rows are zero.
        compressor: main compressor state (CSA, HCA) or None (SWA).
        compressed: [n_c, 512] bf16 — main compressed entries `0 .. n_c - 1`, `n_c = next_position // ratio`.
        indexer_compressor: the indexer compressor's state (CSA) or None.
        indexer_keys: [n_c, 128] bf16 — index keys (CSA; empty otherwise).
    """

    window: torch.Tensor
    compressed: torch.Tensor
    indexer_keys: torch.Tensor
    compressor: CompressorState | None = None
    indexer_compressor: CompressorState | None = None
    next_position: int = 0


@dataclass
class AttentionCache:
    """Per-sequence state of one attention layer for a batch of sequences (decode and chunked prefill).

    Use `AttentionCache.empty(cfg, layer_id, batch, device)`; `Attention.forward` updates it in place.

    Attributes:
        layer_id: the layer this cache belongs to.
        kind: `"swa"`, `"csa"` or `"hca"`.
        ratio: compression ratio (0, 4 or 128).
        window_size: rows of the window ring.
        index_head_dim: head dim of the indexer keys.
        sequences: one `SequenceCache` per sequence, in `cu_seqlens` order.
    """

    layer_id: int
    kind: LayerKind
    ratio: int
    window_size: int
    index_head_dim: int
    sequences: list[SequenceCache] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: DSv4Config, layer_id: int, batch: int, device: torch.device | str = "cpu") -> AttentionCache:
        """The state before any token of `batch` sequences at layer `layer_id`."""
        if batch < 0:
            raise ValueError(f"batch: expected >= 0 sequences, got {batch}")
        kind, ratio = cfg.layer_kind(layer_id), cfg.compress_ratio(layer_id)

        def sequence() -> SequenceCache:
            return SequenceCache(
                window=torch.zeros(cfg.window_size, cfg.head_dim, dtype=torch.bfloat16, device=device),
                compressed=torch.zeros(0, cfg.head_dim, dtype=torch.bfloat16, device=device),
                indexer_keys=torch.zeros(0, cfg.index_head_dim, dtype=torch.bfloat16, device=device),
                compressor=CompressorState.empty(ratio, cfg.head_dim, device) if ratio else None,
                indexer_compressor=(CompressorState.empty(ratio, cfg.index_head_dim, device)
                                    if kind == "csa" else None),
            )

        return cls(layer_id, kind, ratio, cfg.window_size, cfg.index_head_dim, [sequence() for _ in range(batch)])

    def check(self, cfg: DSv4Config, layer_id: int, batch: int, device: torch.device) -> None:
        """Raise `ValueError` unless this cache fits layer `layer_id` of `cfg` with `batch` sequences on `device`."""
        kind = cfg.layer_kind(layer_id)
        if (self.layer_id, self.kind) != (layer_id, kind):
            raise ValueError(f"cache: belongs to layer {self.layer_id} ({self.kind}), used at layer {layer_id} "
                             f"({kind})")
        if (self.ratio, self.window_size, self.index_head_dim) != (cfg.compress_ratio(layer_id), cfg.window_size,
                                                                   cfg.index_head_dim):
            raise ValueError(f"cache: built for ratio {self.ratio}, window {self.window_size}, index head dim "
                             f"{self.index_head_dim}; the layer has {cfg.compress_ratio(layer_id)}, "
                             f"{cfg.window_size}, {cfg.index_head_dim}")
        if len(self.sequences) != batch:
            raise ValueError(f"cache: holds {len(self.sequences)} sequences, cu_seqlens describes {batch}")
        for b, seq in enumerate(self.sequences):
            expect = {
                "window": (self.window_size, cfg.head_dim),
                "compressed": (seq.next_position // self.ratio if self.ratio else 0, cfg.head_dim),
                "indexer_keys": (seq.next_position // self.ratio if kind == "csa" else 0, cfg.index_head_dim),
            }
            for name, shape in expect.items():
                t = getattr(seq, name)
                if tuple(t.shape) != shape or t.dtype != torch.bfloat16 or t.device != device:
                    raise ValueError(f"cache.sequences[{b}].{name}: expected bf16 {list(shape)} on {device} "
                                     f"(next_position {seq.next_position}), got {t.dtype} {list(t.shape)} on "
                                     f"{t.device}")
            for name, present in (("compressor", self.ratio > 0), ("indexer_compressor", kind == "csa")):
                state = getattr(seq, name)
                if (state is not None) != present:
                    raise ValueError(f"cache.sequences[{b}].{name}: expected {'a' if present else 'no'} "
                                     f"CompressorState for a {kind} layer")
                if state is not None and state.next_position != seq.next_position:
                    raise ValueError(f"cache.sequences[{b}].{name}: at position {state.next_position}, the "
                                     f"sequence at {seq.next_position}")
