"""The speed targets of the einsum (#2), MoE (#3) and attention (#4) issues, and their evaluation on a run's results.

Each target names the op, config and token count it is measured at, which candidates count ("the fastest of"),
the metric and the threshold. `evaluate` marks it met / not met with the measured figure and, from the roofline,
what limits it; a target whose point was not measured says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.roofline import Roofline
from benchmarks.suite import Result

OPTIMIZED = ("triton", "deepgemm")


@dataclass(frozen=True)
class Target:
    """One speed target.

    Attributes:
        issue: "#2", "#3" or "#4".
        text: the target as the issue states it.
        op, config, tokens: the point it is measured at.
        candidates: the candidates that count; the fastest of them is the figure.
        metric: "tflops" (TFLOP/s), "time_us", "seconds", "ratio" (time of `candidates[0]` / time of `other`),
            "speedup_vs_reference", "weight_bw" (weight bytes / time as a fraction of the measured copy bandwidth)
            or "bytes_bw" (all counted bytes / time, same fraction).
        threshold: the bound on the metric.
        at_least: True when the metric must be >= threshold, False when <=.
        other: the candidate of the denominator of "ratio".
    """

    issue: str
    text: str
    op: str
    config: str
    tokens: int
    candidates: tuple[str, ...]
    metric: str
    threshold: float
    at_least: bool
    other: str = ""

    @property
    def needs_reference(self) -> bool:
        return self.metric == "speedup_vs_reference" or "reference" in self.candidates


TARGETS: tuple[Target, ...] = (
    Target("#2", "deepgemm path incl. activation quantization, b=4096 FLASH >= 1100 TFLOP/s",
           "quant+einsum", "FLASH", 4096, ("deepgemm",), "tflops", 1100, True),
    Target("#2", "Triton einsum at b=4096 <= 1.25x DeepGEMM's einsum time",
           "fp8_einsum", "FLASH", 4096, ("triton",), "ratio", 1.25, False, other="deepgemm"),
    Target("#2", "einsum at b=128: fastest backend <= 16 us",
           "fp8_einsum", "FLASH", 128, OPTIMIZED, "time_us", 16, False),
    Target("#3", "FLASH T=4096 routed MoE (routing to combine) >= 900 TFLOP/s-equiv. on deepgemm",
           "routed_moe", "FLASH", 4096, ("deepgemm",), "tflops", 900, True),
    Target("#3", "FLASH T=4096 routed MoE (routing to combine) >= 650 TFLOP/s-equiv. on triton",
           "routed_moe", "FLASH", 4096, ("triton",), "tflops", 650, True),
    *(Target("#3", f"T={t}: expert weights stream at >= 60% of copy bandwidth (fastest backend)",
             "routed_moe", "FLASH", t, OPTIMIZED, "weight_bw", 0.60, True) for t in (1, 8, 64)),
    Target("#3", "reference MoE at FLASH T=4096 < 5 s",
           "moe", "FLASH", 4096, ("reference",), "seconds", 5.0, False),
    Target("#4", "FLASH CSA prefill 8192: Triton sparse-attention kernel >= 400 TFLOP/s",
           "sparse_attention", "FLASH", 8192, ("triton",), "tflops", 400, True),
    Target("#4", "FLASH CSA prefill 8192: optimized attention layer >= 20x faster than the reference",
           "attention", "FLASH", 8192, OPTIMIZED, "speedup_vs_reference", 20, True),
    Target("#4", "decode batch 64, 32768-token contexts: sparse attention reads its FP8 cache rows at >= 50% of "
           "copy bandwidth", "sparse_attention_fp8", "FLASH", 64, OPTIMIZED, "bytes_bw", 0.50, True),
)


def reference_points(targets: tuple[Target, ...] = TARGETS) -> frozenset[tuple[str, str, int]]:
    """(op, config, tokens) where the reference must be timed whatever it costs."""
    return frozenset((t.op, t.config, t.tokens) for t in targets if t.needs_reference)


@dataclass(frozen=True)
class Verdict:
    """A target's outcome: `met` is None when it could not be measured (`figure` says why)."""

    target: Target
    met: bool | None
    value: float | None
    figure: str
    limit: str


def _metric(t: Target, r: Result, results: dict[tuple[str, str, int, str], Result],
            roofline: Roofline) -> tuple[float | None, str]:
    assert r.time_s is not None
    if t.metric == "tflops":
        return r.tflops, f"{r.tflops:.0f} TFLOP/s ({r.candidate}, {r.time_s * 1e6:.1f} us)" if r.tflops else "no FLOP"
    if t.metric == "time_us":
        return r.time_s * 1e6, f"{r.time_s * 1e6:.1f} us ({r.candidate})"
    if t.metric == "seconds":
        cold = ", one cold call" if r.cold else ""
        return r.time_s, f"{r.time_s:.2f} s ({r.candidate}{cold})"
    if t.metric == "ratio":
        other = results.get((t.op, t.config, t.tokens, t.other))
        if other is None or other.status != "ok" or not other.time_s:
            why = other.reason if other is not None else "not measured"
            return None, f"{t.other} not measured ({why})"
        ratio = r.time_s / other.time_s
        return ratio, f"{ratio:.2f}x ({r.candidate} {r.time_s * 1e6:.1f} us / {t.other} {other.time_s * 1e6:.1f} us)"
    if t.metric == "speedup_vs_reference":
        if r.vs_reference is None:
            ref = results.get((t.op, t.config, t.tokens, "reference"))
            return None, f"reference not measured ({ref.reason if ref is not None else 'no result'})"
        return r.vs_reference, f"{r.vs_reference:.2f}x ({r.candidate} {r.time_s * 1e3:.2f} ms)"
    if t.metric in ("weight_bw", "bytes_bw"):
        counted = r.weight_bytes if t.metric == "weight_bw" else r.bytes
        frac = counted / r.time_s / roofline.copy_bytes
        return frac, (f"{frac:.0%} of {roofline.copy_bytes / 1e12:.2f} TB/s ({counted / r.time_s / 1e9:.0f} GB/s, "
                      f"{r.candidate}, {r.time_s * 1e6:.1f} us)")
    raise ValueError(f"metric: unknown {t.metric!r}")


def _limit(r: Result) -> str:
    """What the roofline says about a measurement: how far from the floor, and which ceiling."""
    floor = r.floor_s or 0.0
    compute_ceiling = "FP8 matmul rate" if r.math == "fp8" else "bf16 matmul rate"
    ceiling = compute_ceiling if r.bound == "compute" else "copy bandwidth"
    frac = floor / r.time_s if r.time_s else 0.0
    return f"{frac:.0%} of its roofline ({r.bound}-bound: floor {floor * 1e6:.1f} us at the measured {ceiling})"


def evaluate(results: list[Result], roofline: Roofline, targets: tuple[Target, ...] = TARGETS) -> list[Verdict]:
    """Mark every target met / not met (or not measured, with the reason) from a run's results."""
    by_key = {(r.op, r.config, r.tokens, r.candidate): r for r in results}
    verdicts = []
    for t in targets:
        cands = [by_key.get((t.op, t.config, t.tokens, c)) for c in t.candidates]
        timed = [r for r in cands if r is not None and r.status == "ok" and r.time_s]
        if not timed:
            reasons = [f"{c}: {r.status} ({r.reason})" for c, r in zip(t.candidates, cands) if r is not None]
            whole = by_key.get((t.op, t.config, t.tokens, "*"))
            if whole is not None:
                reasons = [f"{whole.status}: {whole.reason}"]
            if not reasons:
                reasons = [f"{t.op} at {t.config} T={t.tokens} was not part of this run"]
            verdicts.append(Verdict(t, None, None, "; ".join(reasons), ""))
            continue
        best = min(timed, key=lambda r: r.time_s or 0.0)
        value, figure = _metric(t, best, by_key, roofline)
        if value is None:
            verdicts.append(Verdict(t, None, None, figure, ""))
            continue
        met = value >= t.threshold if t.at_least else value <= t.threshold
        verdicts.append(Verdict(t, met, value, figure, "" if met else _limit(best)))
    return verdicts
