"""The machine's ceilings, measured in the same run as the benchmarks, and the roofline floor of a piece of work.

Measured, not taken from a datasheet (clocks, power and the driver move them by 10-20 %):
  * bf16 matmul rate: one `8192 x 8192 x 8192` bf16 `torch.matmul` (cuBLAS), 2 * 8192^3 FLOP per call.
  * FP8 matmul rate: the same shape through `torch._scaled_mm` with per-tensor scales and fast accumulation
    (cuBLAS's fastest FP8 path, so the ceiling no block-scaled kernel can beat). FP8 ops are held against
    this one; where it cannot run, twice the bf16 rate (the H100/H200 datasheet ratio) stands in, and the
    report says so.
  * copy bandwidth: a 1 GiB device-to-device `copy_`, counting the bytes read plus the bytes written.

Roofline floor of a piece of work = max(FLOPs / compute ceiling, bytes / copy bandwidth); the "fraction
of the roofline" reported for a measurement is floor / measured time (1.0 = at the ceiling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from benchmarks.timing import Timer

MATMUL_N = 8192
COPY_BYTES = 2**30
# CPU smoke mode: the same code paths at sizes that take milliseconds (not a measurement).
SMOKE_MATMUL_N = 256
SMOKE_COPY_BYTES = 2**23
# Dense FP8 / bf16 tensor-core rate on Hopper (datasheet: 1979 / 989 TFLOP/s): the stand-in ratio.
FP8_OVER_BF16 = 2.0


@dataclass(frozen=True)
class Work:
    """What one call of an op must do, counted from its shapes (not from what a kernel happens to do).

    Attributes:
        flops: useful floating-point operations (2 per multiply-add; padding and recomputation excluded).
        bytes: the minimal HBM traffic: every input read once, every output written once.
        math: the compute ceiling that applies: `"fp8"` (FP8 tensor cores), `"bf16"`, or `"none"` (no
            matmul: the op is held against the copy bandwidth alone).
        weight_bytes: the part of `bytes` that is weights (the MoE decode target streams these).
        parts: the pieces of a composite op, each with its own compute ceiling (`math` is then the label of
            the piece with the most FLOP); empty for a single op.
    """

    flops: float
    bytes: float
    math: str = "fp8"
    weight_bytes: float = 0.0
    parts: tuple[Work, ...] = ()

    def __post_init__(self) -> None:
        if self.math not in ("fp8", "bf16", "none"):
            raise ValueError(f"math: expected 'fp8', 'bf16' or 'none', got {self.math!r}")

    def __add__(self, other: Work) -> Work:
        """Work of two ops run one after the other: FLOP, bytes and weights add, each part keeps its ceiling."""
        parts = (self.parts or (self,)) + (other.parts or (other,))
        heaviest = max(parts, key=lambda p: p.flops)
        return Work(self.flops + other.flops, self.bytes + other.bytes, heaviest.math,
                    self.weight_bytes + other.weight_bytes, parts)

    def with_bytes(self, total: float) -> Work:
        """The same work with a corrected byte count (an intermediate counted twice by `+`, say)."""
        return replace(self, bytes=total)

    def compute_s(self, peak: Callable[[str], float]) -> float:
        """Time of the FLOP at the ceilings `peak(math)`, piece by piece."""
        if self.parts:
            return sum(p.compute_s(peak) for p in self.parts)
        return self.flops / peak(self.math) if self.flops else 0.0


@dataclass(frozen=True)
class Roofline:
    """Ceilings measured on this machine.

    Attributes:
        bf16_flops: bf16 matmul rate, FLOP/s.
        fp8_flops: FP8 matmul rate, FLOP/s (measured, or `FP8_OVER_BF16` x bf16 when `fp8_note` says so).
        copy_bytes: device-to-device copy bandwidth, bytes/s (read + write).
        fp8_note: empty when `fp8_flops` was measured; else why it is a stand-in.
        smoke: measured at CPU smoke sizes (not a measurement of anything).
    """

    bf16_flops: float
    fp8_flops: float
    copy_bytes: float
    fp8_note: str = ""
    smoke: bool = False

    def peak(self, math: str) -> float:
        """The compute ceiling for `math` ("fp8" or "bf16"), FLOP/s; inf for "none"."""
        return {"fp8": self.fp8_flops, "bf16": self.bf16_flops, "none": float("inf")}[math]

    def floor_s(self, work: Work) -> float:
        """The roofline time of `work`: max(compute time at the ceilings, traffic time at the copy bandwidth)."""
        return max(work.compute_s(self.peak), work.bytes / self.copy_bytes)

    def bound(self, work: Work) -> str:
        """`"compute"` or `"memory"`: which side of the roofline `work` sits on."""
        return "compute" if work.compute_s(self.peak) > work.bytes / self.copy_bytes else "memory"

    def as_dict(self) -> dict[str, float | str | bool]:
        return {"bf16_tflops": self.bf16_flops / 1e12, "fp8_tflops": self.fp8_flops / 1e12,
                "copy_tbps": self.copy_bytes / 1e12, "fp8_note": self.fp8_note, "smoke": self.smoke}


def measure(timer: Timer, *, smoke: bool = False) -> Roofline:
    """Measure the bf16 and FP8 matmul rates and the copy bandwidth on `timer.device`."""
    device = timer.device
    n = SMOKE_MATMUL_N if smoke else MATMUL_N
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), generator=gen, device=device, dtype=torch.bfloat16)
    b = torch.randn((n, n), generator=gen, device=device, dtype=torch.bfloat16)
    flops = 2.0 * n**3
    bf16 = flops / timer.time(lambda: torch.matmul(a, b)).median_s

    fp8_note = ""
    try:
        if device != "cuda":
            raise RuntimeError("no GPU (CPU smoke run)")
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn)  # [N, K] row-major: b8.t() is the column-major operand cuBLAS wants
        one = torch.ones((), device=device, dtype=torch.float32)
        fp8 = flops / timer.time(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                           out_dtype=torch.bfloat16, use_fast_accum=True)).median_s
    except Exception as exc:  # an unsupported FP8 path is reported, not fatal
        fp8 = FP8_OVER_BF16 * bf16
        fp8_note = f"FP8 matmul not measured ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); " \
                   f"{FP8_OVER_BF16:g} x the bf16 rate stands in"

    size = SMOKE_COPY_BYTES if smoke else COPY_BYTES
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = 2.0 * size / timer.time(lambda: dst.copy_(src)).median_s
    return Roofline(bf16, fp8, copy, fp8_note, smoke)
