"""The Hadamard rotation of the lightning indexer (spec §2.9, official `rotate_activation`).

`rotate(x) = x H_n / sqrt(n)` with `H_n` the Sylvester Walsh-Hadamard matrix
(`H_n[i, j] = (-1)^popcount(i & j)`, symmetric, `H_n H_n = n I`), so the rotation is orthonormal and
its own inverse. Official calls `fast_hadamard_transform.hadamard_transform(x, scale=n^-0.5)` on bf16
(`n = 128`): butterflies in fp32, times the scale, bf16 out. Here the ±1 sums are accumulated in fp64
(exact for bf16 inputs), rounded to fp32, multiplied by the fp32 scale and rounded to bf16; the
butterfly's fp32 partial sums are exact too unless the 128 inputs span more than ~16 binades, so the
two agree except in that case (by one bf16 rounding at most).
"""

from __future__ import annotations

import math

import torch

from reference.invariant import einsum_fp32


def sylvester_hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The `n x n` Sylvester Walsh-Hadamard matrix of ±1 (n a power of two), fp32."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n}")
    i = torch.arange(n, device=device)
    parity = torch.zeros(n, n, dtype=torch.int64, device=device)
    bits = i[:, None] & i[None, :]
    for _ in range(n.bit_length()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(torch.float32)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """`x H_n / sqrt(n)` along the last dim (n = x.shape[-1], a power of two).

    Args:
        x: [..., n] bf16.

    Returns:
        [..., n] bf16.
    """
    n = x.shape[-1]
    h = sylvester_hadamard(n, x.device)
    return (einsum_fp32("...i,ij->...j", x, h) * (1.0 / math.sqrt(n))).to(x.dtype)
