"""Rotary position embedding of DSv4: GPT-J interleaved pairs on the last 64 dims, YaRN per layer.

Spec §2.8. Every RoPE in a layer (query, window KV, compressed KV, indexer q and k, and the
inverse RoPE on the attention output) uses that layer's frequencies: theta 10000 without YaRN on
SWA-only layers, theta 160000 with YaRN on CSA and HCA layers. No attention-temperature term.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from reference.config import DSv4Config


def yarn_frequencies(cfg: DSv4Config, compress_ratio: int) -> torch.Tensor:
    """Rotation frequencies `f_i`, i = 0..rope_head_dim/2 - 1, of a layer with `compress_ratio`.

    Official `precompute_freqs_cis`: `f_i = theta^(-2i/d)`; on compressed layers (ratio > 0) theta is
    `compress_rope_theta` and YaRN blends `f_i / factor` into the high dims with a linear ramp between
    the correction dims of `beta_fast` and `beta_slow`.

    Returns:
        [rope_head_dim / 2] fp32.
    """
    d = cfg.rope_head_dim
    theta = cfg.compress_rope_theta if compress_ratio > 0 else cfg.rope_theta
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if compress_ratio == 0:
        return freqs

    def correction_dim(n_rotations: float) -> float:
        return d * math.log(cfg.original_seq_len / (n_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # official guards the division the same way
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return freqs / cfg.rope_factor * ramp + freqs * (1 - ramp)


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles `p * f_i` in fp32.

    Args:
        positions: [T] int absolute positions.
        freqs: [d/2] fp32 from `yarn_frequencies`.

    Returns:
        cos, sin: [T, d/2] fp32.
    """
    angles = positions.to(torch.float32)[:, None] * freqs.to(positions.device)[None, :]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last `2 * len(freqs)` dims of x by `+p * f_i` (or `-p * f_i` when `inverse`).

    Pairs are interleaved (GPT-J): `(x[2i], x[2i+1])` of the RoPE slice. Computed in fp32, returned
    in x's dtype (official: complex multiply in fp32, written back to bf16).
      forward: x_e' = x_e cos - x_o sin,  x_o' = x_o cos + x_e sin
      inverse: x_e' = x_e cos + x_o sin,  x_o' = x_o cos - x_e sin

    Args:
        x: [T, ..., D] activations; token axis first.
        positions: [T] int.
        freqs: [d/2] fp32.

    Returns:
        [T, ..., D] in x's dtype; dims before the RoPE slice unchanged.
    """
    rd = 2 * freqs.numel()
    if x.shape[0] != positions.shape[0]:
        raise ValueError(f"positions: expected {x.shape[0]} entries (x's token axis), got {positions.shape[0]}")
    cos, sin = rope_cos_sin(positions, freqs)
    # broadcast [T, d/2] over the middle axes of x
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    pairs = rearrange(x[..., -rd:].float(), "... (i two) -> ... i two", two=2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    rotated = rearrange(rotated, "... i two -> ... (i two)")
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)
