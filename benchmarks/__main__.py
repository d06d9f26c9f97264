"""`dsv4-bench` (also `python -m benchmarks`, `make bench`): time every backend of every op, write the report.

    dsv4-bench                                  # GPU: FLASH and PRO, all ops, all token counts
    dsv4-bench --ops einsum,routed_moe --config FLASH --tokens 128,4096
    dsv4-bench --cpu-smoke                      # TINY on the CPU (Triton interpreter): proves the code paths
    dsv4-bench --compare OLD/bench.json NEW/bench.json   # what got slower / faster (benchmarks.compare)

Without a GPU the smoke mode is chosen by itself. Writes BENCHMARKS.md, bench.json and one PNG per op family
into `--out`. Exits 0 when every candidate ran or was reported n/a / skipped with its reason (targets that are
not met are reported, not failures); 1 when any candidate raised (an error); 2 on bad arguments.

On a GPU the run has two phases. First, warm-up: one process per (op family, config) calls every Triton and
DeepGEMM candidate once at every point, in parallel, so that their JIT compilations (seconds each, one CPU core
each) land in the on-disk caches (Triton's and DeepGEMM's `DG_JIT_CACHE_DIR`) concurrently instead of one after
the other; nothing is timed there. Second, this process measures the ceilings and times every point, finding
the kernels compiled. A warm-up process that fails or runs out of its time only leaves compilation to the second
phase (its log is kept in a temporary folder, named in the output).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

# Before torch touches CUDA: with the default allocator the H100 run of 2026-12-02 held 77 GB "reserved but
# unallocated" in segments split by live buffers, which empty_cache cannot return, and the MoE and attention
# families ran out of memory; expandable segments map and unmap pages instead (workers inherit the setting).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

from benchmarks.timing import L2_FLUSHES

DEFAULT_CONFIGS = ("FLASH", "PRO")
# Wall-clock budget of a GPU run: the whole suite must finish inside one 10-minute command, report included; the
# point running when it is spent still completes (the slowest, the eager reference layer at 8192 tokens, takes
# on the order of a minute), so it stays well under 600 s.
GPU_BUDGET_S = 420.0
# The warm-up phase may use at most this share of the budget; its processes are stopped after it.
WARMUP_SHARE = 0.5
# At most this many warm-up processes at once (each holds one config's weights of one family on the GPU).
MAX_WARMUP_WORKERS = 6


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="", help="comma-separated op or family names (default: all)")
    p.add_argument("--config", default=",".join(DEFAULT_CONFIGS), help="comma-separated configs: FLASH, PRO")
    p.add_argument("--tokens", default="", help="comma-separated token counts (default: 1,8,64,128,512,4096,8192)")
    p.add_argument("--out", default="out/bench", type=Path, help="directory for BENCHMARKS.md, bench.json, PNGs")
    p.add_argument("--cpu-smoke", action="store_true", help="TINY shapes on the CPU: proves the code, measures nothing")
    p.add_argument("--l2-flush", choices=L2_FLUSHES, default="read",
                   help="how the L2 is flushed before each timed run: read a 256 MB buffer (default) or write it, "
                        "as Triton's do_bench does (charges memory-bound calls for the write-back)")
    p.add_argument("--runs", type=int, default=20, help="most timed runs per candidate (default 20)")
    p.add_argument("--budget-s", type=float, default=GPU_BUDGET_S,
                   help=f"wall-clock budget; points left after it are reported skipped (default {GPU_BUDGET_S:g})")
    p.add_argument("--warmup-workers", type=int, default=None,
                   help=f"parallel JIT warm-up processes before timing (default: one per family and config, at most "
                        f"{MAX_WARMUP_WORKERS}, on a GPU; 0 in the CPU smoke mode)")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), type=Path, default=None,
                   help="compare two bench.json reports instead of running; exit 1 when a CUDA-graph timing got "
                        "slower by more than --threshold")
    p.add_argument("--threshold", type=float, default=None,
                   help="with --compare: the slowdown that fails, as a fraction (default 0.10; why in "
                        "benchmarks/compare.py)")
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)  # a warm-up process
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.compare:
        from benchmarks.compare import DEFAULT_THRESHOLD, compare

        try:
            return compare(*args.compare, threshold=DEFAULT_THRESHOLD if args.threshold is None else args.threshold)
        except ValueError as exc:
            print(f"dsv4-bench: {exc}", file=sys.stderr)
            return 2
    if args.threshold is not None:
        print("dsv4-bench: --threshold goes with --compare", file=sys.stderr)
        return 2
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    if smoke:
        # The Triton backend runs in the CPU interpreter; the kernels read this when they are first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from benchmarks import families
    from benchmarks import report as report_mod
    from benchmarks.roofline import Roofline, measure
    from benchmarks.suite import Env, Runner
    from benchmarks.targets import evaluate, reference_points
    from benchmarks.timing import Timer
    from optimized.backends import detect
    from reference.config import get_config

    started = time.perf_counter()
    fams = families()
    known = {f.name for f in fams} | {op.name for f in fams for op in f.ops}
    ops = {s.strip() for s in args.ops.split(",") if s.strip()} or None
    try:
        if ops and ops - known:
            raise ValueError(f"--ops: unknown {sorted(ops - known)}; known: {sorted(known)}")
        tokens = tuple(int(s) for s in args.tokens.split(",") if s.strip()) or None
        if tokens and min(tokens) < 1:
            raise ValueError(f"--tokens: expected positive token counts, got {tokens}")
        names = ["TINY"] if smoke else [c.strip() for c in args.config.split(",") if c.strip()]
        configs = [get_config(name) for name in names]
        if args.runs < 1:
            raise ValueError(f"--runs: expected >= 1, got {args.runs}")
        if args.warmup_workers is not None and args.warmup_workers < 0:
            raise ValueError(f"--warmup-workers: expected >= 0, got {args.warmup_workers}")
    except ValueError as exc:
        print(f"dsv4-bench: {exc}", file=sys.stderr)
        return 2
    if smoke:
        print("[bench] CPU smoke run: TINY shapes, Triton in the interpreter; no figure is a measurement")

    device = "cpu" if smoke else "cuda"
    hw = detect()
    envs = [Env(cfg, device, fmt=hw.fp8_format, smoke=smoke) for cfg in configs]
    if args.warm_only:
        # A warm-up process: every Triton / DeepGEMM candidate once; no ceilings, no timings, no report.
        runner = Runner(Timer(device, single_call=True), Roofline(1.0, 1.0, 1.0), warm_only=True)
        results = runner.run(fams, envs, ops, tokens)
        return 1 if any(r.status == "error" for r in results) else 0

    workers = args.warmup_workers if args.warmup_workers is not None else (0 if smoke else MAX_WARMUP_WORKERS)
    if workers:
        jobs = [(f.name, cfg.name, _family_ops(f, ops)) for cfg in configs for f in fams if _family_ops(f, ops)]
        warm_up(jobs, workers=workers, tokens=args.tokens, cpu_smoke=smoke, timeout_s=WARMUP_SHARE * args.budget_s)

    timer = Timer(device, max_runs=args.runs, l2_flush=args.l2_flush, single_call=smoke)
    roofline = measure(timer, smoke=smoke)
    print(f"[bench] ceilings: bf16 {roofline.bf16_flops / 1e12:.1f} TFLOP/s, FP8 {roofline.fp8_flops / 1e12:.1f} "
          f"TFLOP/s{' (' + roofline.fp8_note + ')' if roofline.fp8_note else ''}, copy "
          f"{roofline.copy_bytes / 1e12:.2f} TB/s" + (" (smoke: not a measurement)" if smoke else ""))
    budget = float("inf") if smoke else args.budget_s - (time.perf_counter() - started)
    runner = Runner(timer, roofline, reference_points(), budget_s=budget)
    results = runner.run(fams, envs, ops, tokens)
    verdicts = evaluate(results, roofline)
    command = "dsv4-bench" + ("" if not argv else " " + " ".join(argv))
    env = {**report_mod.environment(command), "l2_flush": args.l2_flush}
    paths = report_mod.write(args.out, env=env, roofline=roofline, families=fams,
                             results=results, verdicts=verdicts, family_seconds=runner.family_seconds, smoke=smoke)

    for v in verdicts:
        status = {True: "met", False: "NOT MET", None: "not measured"}[v.met]
        print(f"[target] {v.target.issue} {v.target.text}: {status}: {v.figure}")
    errors = [r for r in results if r.status == "error"]
    print(f"[bench] {len(results)} results, {len(errors)} errors, {time.perf_counter() - started:.0f} s; wrote "
          + ", ".join(str(p) for p in paths))
    return 1 if errors else 0


def _family_ops(family, ops: set[str] | None) -> str:
    """The `--ops` value selecting `family`'s part of the selection `ops` ("" when none of it is selected)."""
    if ops is None or family.name in ops:
        return family.name
    return ",".join(op.name for op in family.ops if op.name in ops)


def warm_up(jobs: list[tuple[str, str, str]], *, workers: int, tokens: str, cpu_smoke: bool, timeout_s: float) -> None:
    """Run `dsv4-bench --warm-only` for every (family, config, ops) job, `workers` at a time, within `timeout_s`."""
    logs = Path(tempfile.mkdtemp(prefix="dsv4-bench-warmup-"))
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
    started = time.perf_counter()
    pending = list(jobs)
    running: list[tuple[str, subprocess.Popen, IO[str], float]] = []
    print(f"[warm-up] {len(jobs)} JIT warm-up processes, {workers} at a time (logs in {logs})")
    while pending or running:
        while pending and len(running) < workers:
            family, config, selection = pending.pop(0)
            cmd = [sys.executable, "-m", "benchmarks", "--warm-only", "--ops", selection, "--config", config]
            cmd += ["--tokens", tokens] if tokens else []
            cmd += ["--cpu-smoke"] if cpu_smoke else []
            log = (logs / f"{family}-{config}.log").open("w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((f"{family}/{config}", proc, log, time.perf_counter()))
        time.sleep(0.2)
        out_of_time = time.perf_counter() - started > timeout_s
        for job in list(running):
            name, proc, log, t0 = job
            if proc.poll() is None and not out_of_time:
                continue
            if proc.poll() is None:  # past the warm-up share of the budget: the timed phase compiles the rest
                proc.kill()
                proc.wait()
            log.close()
            running.remove(job)
            status = "done" if proc.returncode == 0 else f"exit {proc.returncode}"
            print(f"[warm-up] {name}: {status} after {time.perf_counter() - t0:.0f} s")
        if out_of_time:
            for family, config, _ in pending:
                print(f"[warm-up] {family}/{config}: not started (warm-up time of {timeout_s:.0f} s spent)")
            pending.clear()
    print(f"[warm-up] {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
