"""Timing of one callable: median of warm runs with the L2 cache flushed before each (Triton `do_bench` style).

On a GPU every run is bracketed by CUDA events recorded on the current stream, right after a pass over a
256 MB buffer that evicts whatever the previous run left in L2 (the H200 has 50 MB of L2, so nothing
survives); the flush itself lies outside the events. The first call is timed separately by the wall
clock (it includes Triton / DeepGEMM JIT compilation and is reported as such, never as the figure).

The flush reads that buffer (`l2_flush="read"`, the default) rather than writing it (`"write"`, what Triton's
`do_bench` does). Both leave none of the operands in L2, but a write leaves the L2 full of dirty lines of the
flush buffer (up to ~50 MB), which the timed call must write back to HBM as its own reads evict them: a
memory-bound call is charged for the harness's write-back, up to ~12 us at 4.2 TB/s. After a read the L2 holds
clean lines only, as in a serving step, whose preceding kernels mostly read (weights, the KV cache) and write
little. Design note 14 has the H200 measurement of the difference.

Where a call can be captured in a CUDA graph (no host synchronization, no CPU-side work that must
rerun), the figure is the median of graph replays, bracketed the same way: that is what a serving engine
running decode under CUDA graphs pays, without Python and launch overhead. The eager median (host
overhead included whenever it exceeds the GPU time) is kept beside it. Calls that cannot be captured
(the eager reference, host-synchronizing paths) are timed eagerly and marked so.

On the CPU the same procedure runs with `time.perf_counter` and no flush. It exists only to prove the
benchmark code paths in CI; no CPU figure is ever reported as a measurement. There `single_call=True` makes
every candidate run exactly once (the Triton interpreter takes about a second per kernel launch).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Bytes passed over between runs to flush the L2: 5x the H200's 50 MB L2 (Triton's do_bench uses 256 MB too).
L2_FLUSH_BYTES = 256 * 2**20
# How the flush passes over its buffer (see the module docstring).
L2_FLUSHES = ("read", "write")
# Defaults: at most this many timed runs per point, or fewer when they would take longer than the budget (the
# whole suite, ~1200 candidates at FLASH and PRO, has to fit one 10-minute command: 20 runs of anything up to
# 2.5 ms, at least 1 of anything slower).
MAX_RUNS = 20
RUN_BUDGET_S = 0.05


@dataclass(frozen=True)
class Timing:
    """What one `Timer.time` call measured.

    Attributes:
        median_s: median time of the timed runs, seconds.
        runs: how many timed runs the median is over.
        first_call_s: wall time of the first (warm-up) call, JIT compilation included.
        min_s, max_s: fastest and slowest timed run.
        cold: the figure is the first call itself (it took longer than `slow_s`; see `Timer.time`).
        graph: the figure is the median of CUDA-graph replays of the call (else of eager calls).
        eager_s: the eager median when `graph` (host overhead included), else None.
    """

    median_s: float
    runs: int
    first_call_s: float
    min_s: float
    max_s: float
    cold: bool = False
    graph: bool = False
    eager_s: float | None = None


class Timer:
    """Times callables on one device (`"cuda"` or `"cpu"`)."""

    def __init__(self, device: str, *, max_runs: int = MAX_RUNS, budget_s: float = RUN_BUDGET_S,
                 flush_bytes: int = L2_FLUSH_BYTES, l2_flush: str = "read", single_call: bool = False) -> None:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
        if l2_flush not in L2_FLUSHES:
            raise ValueError(f"l2_flush: expected one of {L2_FLUSHES}, got {l2_flush!r}")
        if max_runs < 1:
            raise ValueError(f"max_runs: expected >= 1, got {max_runs}")
        self.device = device
        self.max_runs = max_runs
        self.budget_s = budget_s
        self.single_call = single_call
        self.l2_flush = l2_flush
        self._flush = torch.zeros(flush_bytes // 4, dtype=torch.int32, device="cuda") if device == "cuda" else None
        self._flush_sum = torch.zeros((), dtype=torch.int64, device="cuda") if device == "cuda" else None

    def flush_l2(self) -> None:
        """Read (or overwrite) the flush buffer so the next run starts with a cold L2 (no-op on the CPU)."""
        if self._flush is None:
            return
        if self.l2_flush == "read":
            torch.sum(self._flush, dim=0, dtype=torch.int64, out=self._flush_sum)
        else:
            self._flush.zero_()

    def time(self, fn: Callable[[], object], *, max_runs: int | None = None, slow_s: float | None = None,
             graph: bool = False, min_runs: int = 1) -> Timing:
        """Call `fn` once to warm up, then time it `n` times and return the median.

        `n` = `max_runs`, or fewer so that the timed runs take about `budget_s`, but at least `min_runs` (capped
        by `max_runs`).
        When the warm-up call alone takes longer than `slow_s` (the eager reference at large shapes), that
        call is the figure (`cold=True`): an upper bound, since it includes first-call overheads.
        With `graph` (CUDA only), the call is also captured in a CUDA graph and the replays are the figure;
        if the capture fails (a host sync inside), the eager figure stands.
        """
        max_runs = self.max_runs if max_runs is None else max_runs
        first = self._wall(fn)
        if self.single_call:
            return Timing(first, 1, first, first, first)
        if slow_s is not None and first > slow_s:
            return Timing(first, 1, first, first, first, cold=True)
        estimate = self._timed_runs(fn, 1)[0]
        n = min(max_runs, max(min_runs, 1, math.floor(self.budget_s / max(estimate, 1e-9))))
        samples = [estimate, *self._timed_runs(fn, n - 1)] if n > 1 else [estimate]
        eager = Timing(statistics.median(samples), len(samples), first, min(samples), max(samples))
        if not (graph and self.device == "cuda"):
            return eager
        replay = self._capture(fn)
        if replay is None:
            return eager
        replays = self._timed_runs(replay, n)
        return Timing(statistics.median(replays), n, first, min(replays), max(replays), graph=True,
                      eager_s=eager.median_s)

    @staticmethod
    def _capture(fn: Callable[[], object]) -> Callable[[], object] | None:
        """`fn` captured in a CUDA graph (on a side stream, after a warm call there), or None if it cannot be.

        A call that synchronizes with the host (a device read, such as DeepGEMM's contiguous-layout row count) is
        found by one eager call in sync-debug "error" mode (`optimized.backends.host_sync`) and is never
        captured. Failed captures are what we avoid: in the H200 run of 2026-12-02, after
        the MoE family's failed captures, the process held 137 GB "reserved but unallocated" that empty_cache
        could not return, and every later point ran out of memory (a graph's private pool is released when its
        capture has ended; one that failed inside the capture apparently never is).
        """
        from optimized.backends import host_sync

        if host_sync(fn) is not None:  # time it eagerly
            return None
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph, stream=stream):
                fn()
        except Exception:  # an uncapturable op: time it eagerly
            torch.cuda.synchronize()
            return None
        torch.cuda.synchronize()
        return graph.replay

    def _wall(self, fn: Callable[[], object]) -> float:
        self._sync()
        start = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - start

    def _timed_runs(self, fn: Callable[[], object], n: int) -> list[float]:
        if n <= 0:
            return []
        if self.device == "cpu":
            return [self._wall(fn) for _ in range(n)]
        events = []
        for _ in range(n):
            self.flush_l2()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return [start.elapsed_time(end) * 1e-3 for start, end in events]

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
