"""What the tile sweeps (`benchmarks.sweep_einsum`, `sweep_attention`, `sweep_moe`) share: the CUDA-graph timer, the
parallel JIT warm-up, the command line, error rows and the report file.

The sweeps rank launch configurations against each other; `python -m benchmarks` is what measures the ops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CALLS = 20
REPLAYS = 10
# Share of the budget the parallel JIT warm-up may take before the timed phase starts.
WARMUP_SHARE = 0.55


def parser(module: str, description: str, default_budget_s: float, smoke_help: str) -> argparse.ArgumentParser:
    """The sweeps' common command line: --out, --config, --budget-s, --workers, --smoke (and the hidden
    --warm-shard of the warm-up workers)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=description)
    p.add_argument("--out", type=Path, required=True, help=f"folder for {module}.json")
    p.add_argument("--config", default="FLASH", help="model config (default FLASH)")
    p.add_argument("--budget-s", type=float, default=default_budget_s, help="wall-clock budget, warm-up included")
    p.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="parallel JIT warm-up processes")
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p.add_argument("--warm-shard", type=str, default=None, help=argparse.SUPPRESS)  # "i/n": compile only
    return p


def device_and_config(args: argparse.Namespace, module: str) -> tuple[str, str] | None:
    """("cpu", "TINY") in smoke mode (the Triton interpreter), ("cuda", --config) on a GPU, None (with a message)
    when there is neither."""
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return "cpu", "TINY"
    if not torch.cuda.is_available():
        print(f"{module} needs a CUDA GPU (use --smoke on the CPU)", file=sys.stderr)
        return None
    return "cuda", args.config


def error_text(exc: Exception) -> str:
    """A config that does not compile or run is a result: its error, one line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def write_report(out: Path, module: str, device: str, meta: dict[str, Any], payload: dict[str, Any], started: float,
                 n_rows: int) -> None:
    """`out/module.json` with the run's metadata (device, torch, wall time) and the sweep's results."""
    meta = {**meta, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "wall_s": round(time.perf_counter() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{module}.json"
    path.write_text(json.dumps({"meta": meta, **payload}, indent=1, default=str))
    print(f"\n[sweep] {n_rows} jobs in {meta['wall_s']} s -> {path}")


def time_graph(call: Callable[[int], Any]) -> tuple[float, str]:
    """Median seconds per call over `REPLAYS` replays of a CUDA graph of `CALLS` calls; ("graph" or "eager")."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the allocator off the default stream, as capture wants
        for i in range(CALLS):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    mode = "graph"
    try:
        with torch.cuda.graph(graph):
            for i in range(CALLS):
                call(i)
        run = graph.replay
    except Exception:  # not capturable: time the eager calls, same bracketing
        torch.cuda.synchronize()
        mode = "eager"

        def run() -> None:
            for i in range(CALLS):
                call(i)
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    del graph
    return statistics.median(times), mode


def warm_up(module: str, argv: list[str], workers: int, deadline: float) -> None:
    """Compile every job's kernels in `workers` processes of `python -m module *argv --warm-shard i/n` (each runs
    its shard's jobs once, untimed), so that the timing process finds them in the on-disk JIT caches."""
    n = max(1, workers)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[1]),
                                                                      os.environ.get("PYTHONPATH"))))}
    procs = [subprocess.Popen([sys.executable, "-m", module, *argv, "--warm-shard", f"{i}/{n}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for i in range(n)]
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(f"[sweep] warm-up: {sum(p.returncode == 0 for p in procs)}/{n} processes finished")




def drive(args: argparse.Namespace, module: str, started: float, jobs: list[Any], shard_jobs: list[Any],
          run: Callable[[Any, bool], dict[str, Any]], label: Callable[[Any], dict[str, Any]]) -> list[dict] | None:
    """The sweeps' common driver. A warm-up worker (`--warm-shard i/n`) runs its share of `shard_jobs` once,
    untimed, and gets None. Otherwise: the parallel JIT warm-up (GPU), then `run(job, timed)` for each job in
    order until the budget is spent; the jobs left get `label(job)` marked skipped. Returns the rows."""
    if args.warm_shard is not None:
        index, count = (int(x) for x in args.warm_shard.split("/"))
        for job in shard_jobs[index::count]:
            run(job, False)
        return None
    if not args.smoke and args.workers > 0:
        warm_up(f"benchmarks.{module}", ["--out", str(args.out), "--config", args.config], args.workers,
                started + WARMUP_SHARE * args.budget_s)
    rows = []
    for job in jobs:
        if time.perf_counter() - started > args.budget_s:
            rows.append({**label(job), "ok": False, "error": "skipped: sweep budget spent"})
        else:
            rows.append(run(job, not args.smoke))
    return rows
