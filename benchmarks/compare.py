"""Compare two benchmark runs (`bench.json` of `dsv4-bench`): which points got slower or faster.

    dsv4-bench --compare OLD/bench.json NEW/bench.json [--threshold 0.10]

Points are matched by (op, config, tokens, shape, candidate). Only figures that measure the device alone gate: both runs
timed the point as CUDA-graph replays. Eager figures include the host (Python, launches, device reads), which
varies with the machine a run lands on: two H200 calls of 2026-12-03 timed the same eager reference `experts` at
T=64 at 181 and 323 ms. They are listed, never gating. Exit status: 1 when a gated point is slower by more than
the threshold, else 0 (2 on unreadable input).

Why 10 %: the largest spread seen between timings of unchanged kernels on the H200 is 4.4 % (the Triton einsum at
b=8192, 764 vs 798 us, two timings in one call, `docs/h200/ab-einsum-scale-prefetch.jsonl`); the bound is twice
that, rounded up, so that noise does not fail a gate and a real 10 % regression does. Short kernels move by more
than that in relative terms: the unchanged Triton indexer top-k at T=512 took 6.1 and 6.9 us in two runs
(`docs/bench/bench.json`, `docs/h200/bench-flash-moe-attention.json`), so a change must also exceed MIN_DELTA_S,
twice that 0.8 us, rounded up. Across calls (different machines of the same kind) single points have moved more:
re-time a point that fails before trusting one run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_THRESHOLD = 0.10
MIN_DELTA_S = 2e-6
# Ceilings that differ by more than this between the runs mean different machines (or clocks): said in the output.
CEILING_DRIFT = 0.05
SHOWN = 15  # rows of each table


@dataclass(frozen=True)
class Change:
    """One point present in both runs."""

    op: str
    config: str
    tokens: int
    shape: str
    candidate: str
    old_s: float
    new_s: float
    gated: bool  # both figures are CUDA-graph replays

    @property
    def ratio(self) -> float:
        return self.new_s / self.old_s

    def moved(self, threshold: float) -> int:
        """+1 slower, -1 faster by more than `threshold` (and MIN_DELTA_S), else 0."""
        if abs(self.new_s - self.old_s) <= MIN_DELTA_S or abs(self.ratio - 1) <= threshold:
            return 0
        return 1 if self.ratio > 1 else -1

    @property
    def label(self) -> str:
        return f"{self.op} {self.config} {self.shape} {self.candidate}"


def load(path: Path) -> dict[str, Any]:
    """A `bench.json`; raises ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a bench.json ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{path}: not a dsv4-bench report (no 'results' list)")
    return data


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The points timed (status ok) in both runs."""
    def timed(data: dict[str, Any]) -> dict[tuple[str, str, int, str, str], dict[str, Any]]:
        return {(r["op"], r["config"], r["tokens"], r.get("shape", ""), r["candidate"]): r for r in data["results"]
                if r.get("status") == "ok" and r.get("time_s")}

    before, after = timed(old), timed(new)
    return [Change(*key, before[key]["time_s"], after[key]["time_s"],
                   bool(before[key].get("graph")) and bool(after[key].get("graph")))
            for key in sorted(before.keys() & after.keys())]


def ceiling_notes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The measured ceilings that moved by more than CEILING_DRIFT between the runs."""
    notes = []
    a, b = old.get("roofline") or {}, new.get("roofline") or {}
    for key in ("bf16_tflops", "fp8_tflops", "copy_tbps"):
        if a.get(key) and b.get(key) and abs(b[key] / a[key] - 1) > CEILING_DRIFT:
            notes.append(f"ceiling {key}: {a[key]:.4g} -> {b[key]:.4g} (another machine or clock: compare with care)")
    return notes


def compare(old_path: Path, new_path: Path, threshold: float = DEFAULT_THRESHOLD) -> int:
    """Print the comparison; return the exit status (1: a gated point regressed by more than `threshold`)."""
    from rich.console import Console
    from rich.table import Table

    if not threshold > 0:
        raise ValueError(f"threshold: expected a positive fraction, got {threshold}")
    old, new = load(old_path), load(new_path)
    rows = changes(old, new)
    console = Console(width=160)
    gated = [c for c in rows if c.gated]
    slower = sorted((c for c in gated if c.moved(threshold) > 0), key=lambda c: -c.ratio)
    faster = sorted((c for c in gated if c.moved(threshold) < 0), key=lambda c: c.ratio)
    eager = sorted((c for c in rows if not c.gated and c.moved(threshold)), key=lambda c: -abs(c.ratio - 1))
    for title, group in ((f"slower by more than {threshold:.0%} (CUDA-graph timings: gate)", slower),
                         (f"faster by more than {threshold:.0%} (CUDA-graph timings)", faster),
                         ("eager timings that moved (host-inclusive: not gating)", eager)):
        if not group:
            continue
        table = Table(title=title)
        for name in ("point", "old", "new", "new / old"):
            table.add_column(name, justify="left" if name == "point" else "right")
        for c in group[:SHOWN]:
            table.add_row(c.label, f"{c.old_s * 1e6:.1f} us", f"{c.new_s * 1e6:.1f} us", f"{c.ratio:.2f}x")
        if len(group) > SHOWN:
            table.caption = f"{len(group) - SHOWN} more"
        console.print(table)
    for note in ceiling_notes(old, new):
        console.print(note)
    console.print(f"{len(rows)} points in both runs, {len(gated)} gated: {len(slower)} slower, {len(faster)} faster "
                  f"by more than {threshold:.0%}; {len(rows) - len(gated)} eager, not gating")
    return 1 if slower else 0
