"""Benchmarks of the DSv4 ops: every backend of the optimized package plus torch and DeepGEMM baselines, at
DSv4-Flash and -Pro shapes, against the roofline of the machine measured in the same run.

`python -m benchmarks` / `dsv4-bench` writes BENCHMARKS.md, bench.json and PNG plots; `benchmarks/test_bench.py`
holds the pytest-benchmark tests (GPU) and the CPU smoke test (CI). Layout:
  timing.py    median of warm runs with the L2 flushed (CUDA events)
  roofline.py  measured ceilings (bf16 and FP8 matmul, copy bandwidth) and `Work` (counted FLOP and bytes)
  suite.py     families, points, candidates, the runner and its budget rules
  baselines.py torch bf16, torch `_scaled_mm`, DeepGEMM raw-kernel baselines
  ops_*.py     one family each: its weights, its ops' inputs and counted work
  targets.py   the issues' speed targets and their evaluation
  report.py    markdown, JSON and plots
"""

from __future__ import annotations

from benchmarks.suite import Family


def families() -> list[Family]:
    """Every op family, in report order (importing them imports nothing heavy beyond torch)."""
    from benchmarks import ops_attention, ops_einsum, ops_moe

    return [ops_einsum.FAMILY, ops_moe.FAMILY, ops_attention.FAMILY]
