"""Comparison metrics used by the parity tiers (spec §7.2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's `1 - 2<x, y> / (|x|^2 + |y|^2)` in fp64: 0 for equal tensors, scale-free.

    Two all-zero tensors give 0. NaN anywhere gives NaN (which fails every bound).
    """
    if x.shape != y.shape:
        raise ValueError(f"calc_diff: shapes differ, {tuple(x.shape)} vs {tuple(y.shape)}")
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


def cosine_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """`1 - cos(x, y)` in fp64 (FlashMLA's cosine check)."""
    x, y = x.double().flatten(), y.double().flatten()
    norm = x.norm() * y.norm()
    return 0.0 if norm == 0 else float(1 - (x @ y) / norm)


def max_abs_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y| in fp64 (NaN where either side has one)."""
    if x.numel() == 0:
        return 0.0
    return float((x.double() - y.double()).abs().max())


def max_rel_error(x: torch.Tensor, y: torch.Tensor, floor: float = 1e-6) -> float:
    """max |x - y| / max(|y|, floor)."""
    if x.numel() == 0:
        return 0.0
    return float(((x.double() - y.double()).abs() / y.double().abs().clamp(min=floor)).max())


def worst_position(x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
    """Index of the largest |x - y| (FlashMLA prints it; so do our reports)."""
    if x.numel() == 0:
        return ()
    flat = int((x.double() - y.double()).abs().nan_to_num(float("inf")).flatten().argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape))


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Map a float tensor's bit patterns to integers that are ordered like the floats."""
    width = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    if x.dtype in width:
        bits = x.view(width[x.dtype]).to(torch.int64)
        sign_mask = 1 << (torch.iinfo(width[x.dtype]).bits - 1)
    elif x.element_size() == 1:
        bits = x.view(torch.uint8).to(torch.int64)
        bits = torch.where(bits >= 128, bits - 256, bits)  # as signed int8
        sign_mask = 1 << 7
    else:
        raise TypeError(f"ulp_distance: unsupported dtype {x.dtype}")
    return torch.where(bits < 0, -(bits + sign_mask), bits)


def ulp_distance(x: torch.Tensor, y: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype tensors (bf16, fp16, fp32, fp8)."""
    if x.dtype != y.dtype:
        raise TypeError(f"ulp_distance: dtypes differ, {x.dtype} vs {y.dtype}")
    if x.numel() == 0:
        return 0
    return int((_ordered_bits(x) - _ordered_bits(y)).abs().max())


def nonfinite_positions_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """NaN positions equal and +-inf positions equal (with sign)."""
    xf, yf = x.float(), y.float()
    return bool(torch.equal(xf.isnan(), yf.isnan()) and torch.equal(xf.isposinf(), yf.isposinf())
                and torch.equal(xf.isneginf(), yf.isneginf()))


@dataclass(frozen=True)
class Summary:
    """All metrics of one comparison, for reports."""

    calc_diff: float
    cosine_diff: float
    max_abs: float
    max_rel: float
    worst: tuple[int, ...]
    nonfinite_equal: bool


def summarize(x: torch.Tensor, y: torch.Tensor) -> Summary:
    """Every metric of candidate `x` against reference `y`."""
    finite = x.isfinite() & y.isfinite()
    xs, ys = x[finite], y[finite]
    return Summary(
        calc_diff=calc_diff(xs, ys),
        cosine_diff=cosine_diff(xs, ys),
        max_abs=max_abs_error(xs, ys),
        max_rel=max_rel_error(xs, ys),
        worst=worst_position(x.float().nan_to_num(), y.float().nan_to_num()),
        nonfinite_equal=nonfinite_positions_equal(x, y),
    )
