"""`dsv4-bench` (also `python -m benchmarks`, `make bench`): time every backend of every op, write the report.

    dsv4-bench                                  # GPU: FLASH and PRO, all ops, all token counts
    dsv4-bench --ops einsum,routed_moe --config FLASH --tokens 128,4096
    dsv4-bench --cpu-smoke                      # TINY on the CPU (Triton interpreter): proves the code paths

Without a GPU the smoke mode is chosen by itself. Writes BENCHMARKS.md, bench.json and one PNG per op family
into `--out`. Exits 0 when every candidate ran or was reported n/a / skipped with its reason (targets that are
not met are reported, not failures); 1 when any candidate raised (an error); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

DEFAULT_CONFIGS = ("FLASH", "PRO")
# Wall-clock budget of a GPU run: the whole suite must finish inside one 10-minute command, report included.
GPU_BUDGET_S = 450.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="", help="comma-separated op or family names (default: all)")
    p.add_argument("--config", default=",".join(DEFAULT_CONFIGS), help="comma-separated configs: FLASH, PRO")
    p.add_argument("--tokens", default="", help="comma-separated token counts (default: 1,8,64,128,512,4096,8192)")
    p.add_argument("--out", default="out/bench", type=Path, help="directory for BENCHMARKS.md, bench.json, PNGs")
    p.add_argument("--cpu-smoke", action="store_true", help="TINY shapes on the CPU: proves the code, measures nothing")
    p.add_argument("--runs", type=int, default=20, help="most timed runs per candidate (default 20)")
    p.add_argument("--budget-s", type=float, default=GPU_BUDGET_S,
                   help=f"wall-clock budget; points left after it are reported skipped (default {GPU_BUDGET_S:g})")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    if smoke:
        # The Triton backend runs in the CPU interpreter; the kernels read this when they are first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from benchmarks import families
    from benchmarks import report as report_mod
    from benchmarks.roofline import measure
    from benchmarks.suite import Env, Runner
    from benchmarks.targets import evaluate, reference_points
    from benchmarks.timing import Timer
    from optimized.backends import detect
    from reference.config import get_config

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
    except ValueError as exc:
        print(f"dsv4-bench: {exc}", file=sys.stderr)
        return 2
    if smoke:
        print("[bench] CPU smoke run: TINY shapes, Triton in the interpreter; no figure is a measurement")

    device = "cpu" if smoke else "cuda"
    hw = detect()
    timer = Timer(device, max_runs=args.runs, single_call=smoke)
    started = time.perf_counter()
    roofline = measure(timer, smoke=smoke)
    print(f"[bench] ceilings: bf16 {roofline.bf16_flops / 1e12:.1f} TFLOP/s, FP8 {roofline.fp8_flops / 1e12:.1f} "
          f"TFLOP/s{' (' + roofline.fp8_note + ')' if roofline.fp8_note else ''}, copy "
          f"{roofline.copy_bytes / 1e12:.2f} TB/s" + (" (smoke: not a measurement)" if smoke else ""))
    runner = Runner(timer, roofline, reference_points(), budget_s=float("inf") if smoke else args.budget_s)
    envs = [Env(cfg, device, fmt=hw.fp8_format, smoke=smoke) for cfg in configs]
    results = runner.run(fams, envs, ops, tokens)
    verdicts = evaluate(results, roofline)
    command = "dsv4-bench" + ("" if not argv else " " + " ".join(argv))
    paths = report_mod.write(args.out, env=report_mod.environment(command), roofline=roofline, families=fams,
                             results=results, verdicts=verdicts, family_seconds=runner.family_seconds, smoke=smoke)

    for v in verdicts:
        status = {True: "met", False: "NOT MET", None: "not measured"}[v.met]
        print(f"[target] {v.target.issue} {v.target.text}: {status}: {v.figure}")
    errors = [r for r in results if r.status == "error"]
    print(f"[bench] {len(results)} results, {len(errors)} errors, {time.perf_counter() - started:.0f} s; wrote "
          + ", ".join(str(p) for p in paths))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
