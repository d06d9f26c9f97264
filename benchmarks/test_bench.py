"""Tests of the benchmark code: the CPU smoke run end to end (CI), the runner's and the targets' rules on
synthetic timings, and pytest-benchmark timings of every op at FLASH shapes (GPU only)."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import families
from benchmarks.roofline import Roofline, Work
from benchmarks.suite import (
    BACKEND,
    BACKEND_NAMES,
    BASELINE,
    REF_MIN_RUNS,
    REF_SLOW_S,
    Candidate,
    Env,
    Family,
    OpBench,
    Point,
    Result,
    Runner,
)
from benchmarks.targets import TARGETS, Target, evaluate, reference_points
from benchmarks.timing import Timer, Timing

REPO = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------
# CPU smoke run (the CI check that the benchmark code works)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--cpu-smoke", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, out


def test_cpu_smoke_run_exits_zero_and_writes_the_reports(smoke_run) -> None:
    proc, out = smoke_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    md = (out / "BENCHMARKS.md").read_text()
    assert "CPU smoke run" in md and "## Speed targets" in md
    data = json.loads((out / "bench.json").read_text())
    assert data["smoke"] is True
    assert {"gpu", "driver", "torch", "triton", "deep_gemm", "command", "date"} <= set(data["environment"])
    assert len(data["targets"]) == len(TARGETS)
    assert len(list(out.iterdir())) <= 8
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for family in families():
        if any(r["family"] == family.name and r["status"] == "ok" for r in data["results"]):
            assert (out / f"bench_{family.name}.png").stat().st_size > 0


def test_cpu_smoke_run_reports_every_candidate_of_every_op(smoke_run) -> None:
    """Every op at every smoke token count has a row per backend (ran, or n/a / skipped with a reason), none
    raised, and every op the optimized package implements ran on the reference and on Triton (interpreter)."""
    from optimized.backends import registry

    _, out = smoke_run
    results = json.loads((out / "bench.json").read_text())["results"]
    errors = [r for r in results if r["status"] == "error"]
    assert not errors, errors
    impls = registry()
    for family in families():
        for op in family.ops:
            for tokens in op.smoke_tokens:
                rows = {r["candidate"]: r for r in results if r["op"] == op.name and r["tokens"] == tokens}
                assert set(BACKEND_NAMES) <= set(rows), (op.name, tokens, sorted(rows))
                for row in rows.values():
                    assert row["status"] == "ok" or row["reason"], row
    ran = {(r["op"], r["candidate"]) for r in results if r["status"] == "ok"}
    for family in families():
        for op in family.ops:
            point_ops = _public_ops(op.name)
            if all(o in impls and {"reference", "triton"} <= set(impls[o]) for o in point_ops):
                assert {(op.name, "reference"), (op.name, "triton")} <= ran, op.name


def _public_ops(bench_op: str) -> tuple[str, ...]:
    """The public optimized ops a benchmark row calls."""
    return {"quant+einsum": ("quantize_attn_output", "fp8_einsum"), "routed_moe": ("route", "experts")}.get(
        bench_op, (bench_op.split("[")[0],))


def test_cli_rejects_unknown_ops_with_exit_code_2() -> None:
    from benchmarks.__main__ import main

    assert main(["--cpu-smoke", "--ops", "no_such_op"]) == 2


def test_timer_rejects_an_unknown_l2_flush() -> None:
    with pytest.raises(ValueError, match="l2_flush: expected one of"):
        Timer("cpu", l2_flush="evict")


def test_cli_warm_up_processes_run_before_the_timed_phase(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from benchmarks.__main__ import main

    ops = "indexer_topk,quantize_attn_output"
    assert main(["--cpu-smoke", "--warmup-workers", "2", "--ops", ops, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[warm-up] attention/TINY: done" in out and "[warm-up] einsum/TINY: done" in out
    assert out.index("[warm-up]") < out.index("[bench] ceilings")


# ------------------------------------------------------------------------------------------------
# Runner, roofline and target rules on synthetic timings
# ------------------------------------------------------------------------------------------------


class ScriptedTimer(Timer):
    """A timer that returns scripted times per candidate name instead of running anything timed."""

    def __init__(self, seconds: dict[str, float]) -> None:
        super().__init__("cpu")
        self.seconds = seconds
        self.calls: list[str] = []
        self.min_runs: dict[str, int] = {}

    def time(self, fn, *, max_runs=None, slow_s=None, graph=False, min_runs=1) -> Timing:
        name = fn()
        self.calls.append(name)
        self.min_runs[name] = min_runs
        t = self.seconds[name]
        return Timing(t, 1, t, t, t, cold=slow_s is not None and t > slow_s)


ROOF = Roofline(bf16_flops=1e15, fp8_flops=2e15, copy_bytes=4e12)


def _family(make_candidates) -> Family:
    def make(ctx, env, tokens: int) -> Point:
        return Point("op", env.cfg.name, tokens, f"T={tokens}", Work(2e12 * tokens, 4e9, "fp8"), make_candidates())

    return Family("fam", lambda env: None, (OpBench("op", "test op", make, tokens=(1, 2, 4)),))


def _env() -> Env:
    from reference.config import TINY

    return Env(TINY, "cpu")


def test_runner_times_the_reference_past_512_tokens_only_at_target_points() -> None:
    timer = ScriptedTimer({"reference": 0.1, "triton": 1e-3})
    cands = lambda: [Candidate("reference", BACKEND, build=lambda: lambda: "reference")]
    fam = _family(cands)
    runner = Runner(timer, ROOF, reference_points=frozenset({("op", "TINY", 8192)}), log=lambda s: None)
    results = runner.run([fam], [_env()], tokens=(512, 4096, 8192))
    assert [r.status for r in results] == ["ok", "skipped", "ok"]
    assert "T=512" in results[1].reason


def test_runner_skips_a_slow_reference_at_larger_token_counts_except_target_points() -> None:
    timer = ScriptedTimer({"reference": REF_SLOW_S * 2, "triton": 1e-3})
    cands = lambda: [Candidate("reference", BACKEND, build=lambda: lambda: "reference"),
                     Candidate("triton", BACKEND, build=lambda: lambda: "triton")]
    runner = Runner(timer, ROOF, reference_points=frozenset({("op", "TINY", 4)}), log=lambda s: None)
    results = runner.run([_family(cands)], [_env()])
    ref = {r.tokens: r for r in results if r.candidate == "reference"}
    assert ref[1].status == "ok" and ref[1].cold
    assert ref[2].status == "skipped" and "timed only where a target needs it" in ref[2].reason
    assert ref[4].status == "ok"  # a target point is timed whatever it costs
    assert timer.calls == ["reference", "triton", "triton", "reference", "triton"]


def test_runner_reports_na_and_errors_and_computes_speedups() -> None:
    def boom() -> str:
        raise RuntimeError("kernel exploded")

    timer = ScriptedTimer({"reference": 1.0, "triton": 0.01, "torch bf16": 0.02})
    cands = lambda: [Candidate("reference", BACKEND, build=lambda: lambda: "reference"),
                     Candidate("triton", BACKEND, build=lambda: lambda: "triton"),
                     Candidate("deepgemm", BACKEND, na="no GPU"),
                     Candidate("torch bf16", BASELINE, build=lambda: lambda: "torch bf16"),
                     Candidate("broken", BASELINE, build=lambda: boom)]
    results = Runner(timer, ROOF, log=lambda s: None).run([_family(cands)], [_env()], tokens=(1,))
    by = {r.candidate: r for r in results}
    assert by["deepgemm"].status == "n/a" and by["deepgemm"].reason == "no GPU"
    assert by["broken"].status == "error" and "kernel exploded" in by["broken"].reason
    assert by["triton"].vs_reference == pytest.approx(100.0)
    assert by["triton"].vs_baseline == pytest.approx(2.0) and by["triton"].best_baseline == "torch bf16"
    # 2 TFLOP at 2 PFLOP/s = 1 ms vs 4 GB at 4 TB/s = 1 ms: the floor is 1 ms, triton takes 10 ms.
    assert by["triton"].roofline == pytest.approx(0.1)
    assert by["triton"].tflops == pytest.approx(200.0)
    # the reference, a speed-up's baseline, is a median of several runs; kernels take what the budget allows
    assert timer.min_runs["reference"] == REF_MIN_RUNS > 1 and timer.min_runs["triton"] == 1


def test_warm_up_runner_calls_each_kernel_candidate_once_and_skips_reference_and_baselines() -> None:
    timer = ScriptedTimer({"triton": 1e-3, "deepgemm": 1e-3})
    cands = lambda: [Candidate("reference", BACKEND, build=lambda: lambda: "reference"),
                     Candidate("triton", BACKEND, build=lambda: lambda: "triton"),
                     Candidate("deepgemm", BACKEND, build=lambda: lambda: "deepgemm"),
                     Candidate("torch bf16", BASELINE, build=lambda: lambda: "torch bf16")]
    results = Runner(timer, ROOF, warm_only=True, log=lambda s: None).run([_family(cands)], [_env()], tokens=(1,))
    assert timer.calls == ["triton", "deepgemm"]
    assert {r.candidate for r in results if r.status == "skipped"} == {"reference", "torch bf16"}


def test_runner_reports_points_past_the_budget_as_skipped() -> None:
    timer = ScriptedTimer({"triton": 1e-3})
    cands = lambda: [Candidate("triton", BACKEND, build=lambda: lambda: "triton")]
    results = Runner(timer, ROOF, budget_s=0.0, log=lambda s: None).run([_family(cands)], [_env()])
    assert results and all(r.status == "skipped" and "budget" in r.reason for r in results)


def test_roofline_floor_is_the_slower_of_compute_and_traffic() -> None:
    assert ROOF.floor_s(Work(4e15, 4e9, "fp8")) == pytest.approx(2.0)
    assert ROOF.floor_s(Work(4e15, 4e9, "bf16")) == pytest.approx(4.0)
    assert ROOF.floor_s(Work(0.0, 8e12, "none")) == pytest.approx(2.0)
    assert ROOF.bound(Work(1.0, 8e12, "fp8")) == "memory"
    mixed = Work(2e15, 2, "bf16", 1) + Work(2e15, 4, "fp8", 2)  # each piece at its own ceiling: 2 s + 1 s
    assert (mixed.flops, mixed.bytes, mixed.weight_bytes) == (4e15, 6, 3)
    assert ROOF.floor_s(mixed) == pytest.approx(3.0)


def _result(op: str, cand: str, t: float, **kw) -> Result:
    r = Result("fam", op, "FLASH", 4096, "", cand, BACKEND, "ok", time_s=t, flops=kw.pop("flops", 0.0),
               bytes=kw.pop("bytes", 0.0), math="fp8", bound="compute", floor_s=kw.pop("floor_s", 1e-3))
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_targets_mark_met_not_met_and_not_measured() -> None:
    targets = (
        Target("#x", "tflops", "a", "FLASH", 4096, ("triton", "deepgemm"), "tflops", 1000, True),
        Target("#x", "ratio", "a", "FLASH", 4096, ("triton",), "ratio", 1.25, False, other="deepgemm"),
        Target("#x", "absent", "b", "FLASH", 4096, ("triton",), "time_us", 16, False),
        Target("#x", "speedup", "a", "FLASH", 4096, ("triton",), "speedup_vs_reference", 20, True),
    )
    results = [_result("a", "triton", 2e-3, tflops=900.0, flops=1.8e12, vs_reference=10.0),
               _result("a", "deepgemm", 1e-3, tflops=1800.0, flops=1.8e12)]
    v = {x.target.text: x for x in evaluate(results, ROOF, targets)}
    assert v["tflops"].met is True and v["tflops"].value == pytest.approx(1800.0)  # the fastest candidate counts
    assert v["ratio"].met is False and v["ratio"].value == pytest.approx(2.0) and "roofline" in v["ratio"].limit
    assert v["absent"].met is None and "not part of this run" in v["absent"].figure
    assert v["speedup"].met is False and v["speedup"].value == pytest.approx(10.0)


def test_every_target_names_a_benchmarked_op() -> None:
    ops = {op.name for f in families() for op in f.ops}
    missing = sorted({t.op for t in TARGETS} - ops)
    pending = {"sparse_attention", "sparse_attention_fp8", "attention"} - ops  # the attention family lands last
    assert set(missing) <= pending, missing
    assert ("moe", "FLASH", 4096) in reference_points()


def test_timer_calls_warm_up_then_timed_runs() -> None:
    calls = []
    timing = Timer("cpu", max_runs=3, budget_s=10.0).time(lambda: calls.append(1))
    assert timing.runs == 3 and len(calls) == 4 and not timing.cold
    calls.clear()
    # a zero budget allows one run; min_runs asks for more, max_runs caps them
    assert Timer("cpu", budget_s=0.0).time(lambda: calls.append(1), min_runs=3).runs == 3
    assert Timer("cpu", max_runs=2, budget_s=0.0).time(lambda: calls.append(1), min_runs=3).runs == 2
    assert Timer("cpu", budget_s=0.0).time(lambda: calls.append(1)).runs == 1
    calls.clear()
    timing = Timer("cpu").time(lambda: calls.append(1), slow_s=-1.0)  # every call is "slow": the warm-up is the figure
    assert timing.cold and timing.runs == 1 and len(calls) == 1
    calls.clear()
    timing = Timer("cpu", single_call=True).time(lambda: calls.append(1))
    assert timing.runs == 1 and len(calls) == 1


# ------------------------------------------------------------------------------------------------
# pytest-benchmark at FLASH shapes (GPU)
# ------------------------------------------------------------------------------------------------

GPU_TOKENS = (128, 4096)
_OPS = [(f.name, op.name) for f in families() for op in f.ops]


@functools.cache
def _gpu_context(family_name: str):
    from optimized.backends import detect
    from reference.config import FLASH

    family = next(f for f in families() if f.name == family_name)
    env = Env(FLASH, "cuda", fmt=detect().fp8_format)
    return family, env, family.setup(env)


@functools.lru_cache(maxsize=1)  # the backends of one point run one after the other: build its inputs once
def _gpu_point(family_name: str, op_name: str, tokens: int) -> Point:
    family, env, ctx = _gpu_context(family_name)
    return next(o for o in family.ops if o.name == op_name).make(ctx, env, tokens)


# The kernel backends only: the eager reference takes seconds per call at these shapes and is timed by dsv4-bench
# (where the budget rules apply). Marked slow too: they compile every kernel, so `-m "not slow"` leaves them out
# of a quick GPU test run.
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU: the benchmarks time real FLASH shapes")
@pytest.mark.parametrize("backend", ("triton", "deepgemm"))
@pytest.mark.parametrize("tokens", GPU_TOKENS)
@pytest.mark.parametrize("family_name,op_name", _OPS, ids=[op for _, op in _OPS])
def test_benchmark_flash(benchmark, family_name: str, op_name: str, tokens: int, backend: str) -> None:
    point = _gpu_point(family_name, op_name, tokens)
    cand = next(c for c in point.candidates if c.kind == BACKEND and c.name == backend)
    if cand.build is None:
        pytest.skip(f"n/a: {cand.na}")
    timer = Timer("cuda")
    fn = cand.build()

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    benchmark.extra_info.update(op=op_name, config="FLASH", tokens=tokens, flops=point.work.flops,
                                bytes=point.work.bytes)
    benchmark.pedantic(run, setup=timer.flush_l2, rounds=10, warmup_rounds=1, iterations=1)


def test_markdown_shows_figures_bold_fastest_and_lists_na_reasons() -> None:
    from benchmarks import report
    from benchmarks.suite import _compare

    fam = Family("fam", lambda env: None, (OpBench("a", "op a", lambda ctx, env, t: None, tokens=(4096,)),))
    rows = [_result("a", "triton", 2e-3, tflops=900.0), _result("a", "deepgemm", 1e-3, tflops=1800.0),
            Result("fam", "a", "FLASH", 4096, "", "torch _scaled_mm", BASELINE, "n/a", "unsupported here"),
            Result("fam", "a", "FLASH", 4096, "", "reference", BACKEND, "skipped", "reference took 9 s")]
    _compare(rows)
    env = {"command": "dsv4-bench", "date": "today", "commit": "abc", "gpu": "H200", "arch": "sm90", "driver": "1",
           "cuda": "13", "torch": "2.11", "triton": "3.6", "deep_gemm": "2.8.2", "python": "3.12"}
    md = report.markdown(env=env, roofline=ROOF, families=[fam], results=rows, verdicts=evaluate(rows, ROOF, ()),
                         plots={}, plot_note="", smoke=False)
    assert "| FLASH | 4096 |  | **deepgemm** | 1000.0 e | 1800 |" in md  # e: timed eagerly (no graph)
    assert "- n/a: torch _scaled_mm — unsupported here (FLASH T=4096)" in md
    assert "- skipped: reference — reference took 9 s (FLASH T=4096)" in md
    assert "2000 TFLOP/s" in md  # the measured FP8 ceiling is printed
    assert "after a 256 MB write (as Triton's do_bench" in md  # a bench.json from before --l2-flush: a write
    md = report.markdown(env={**env, "l2_flush": "read"}, roofline=ROOF, families=[fam], results=rows,
                         verdicts=evaluate(rows, ROOF, ()), plots={}, plot_note="", smoke=False)
    assert "after a 256 MB read (no dirty lines" in md


@pytest.mark.parametrize(("module", "args"), [("sweep_einsum", []), ("sweep_attention", []), ("sweep_moe", []),
                                             ("profile_attention", []), ("profile_attention", ["--prefill", "16"]),
                                             ("fused_output_quant", [])],
                         ids=["sweep_einsum", "sweep_attention", "sweep_moe", "profile_decode", "profile_prefill",
                              "fused_output_quant"])
def test_tile_sweeps_and_the_layer_profile_run_in_cpu_smoke_mode(module: str, args: list[str], tmp_path: Path) -> None:
    """The H200 scripts behind the tile tables, the layer diagnosis and the fused quantization's A/B run their code
    paths on the CPU (TINY, interpreter; nothing timed): every candidate they try there runs and matches."""
    main = importlib.import_module(f"benchmarks.{module}").main
    assert main(["--out", str(tmp_path), "--smoke", *args]) == 0
    report = json.loads((tmp_path / f"{module}.json").read_text())
    if module == "profile_attention":
        assert report["results"] and all(r["wall_ms"] > 0 and r["aten_ops"] > 0 for r in report["results"].values())
    elif module == "fused_output_quant":  # the quantized paths' bytes agree (on the CPU both are two kernels)
        assert report["results"] and all(r["bitwise"] for r in report["results"].values()), report["results"]
    else:
        assert report["results"] and all(r["ok"] for r in report["results"]), report["results"]


def _bench_json(path: Path, rows: list[tuple[str, int, float, bool]], copy_tbps: float = 4.2) -> Path:
    """A minimal bench.json: (op, tokens, seconds, graph) rows of the triton candidate at FLASH."""
    results = [{"op": op, "config": "FLASH", "tokens": t, "shape": f"T={t}", "candidate": "triton", "status": "ok",
                "time_s": s, "graph": graph} for op, t, s, graph in rows]
    path.write_text(json.dumps({"roofline": {"copy_tbps": copy_tbps}, "results": results}))
    return path


def test_compare_gates_on_graph_timings_slower_past_the_threshold_only(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    from benchmarks.__main__ import main

    old = _bench_json(tmp_path / "old.json", [("a", 1, 100e-6, True), ("b", 1, 100e-6, True), ("c", 1, 100e-6, False),
                                              ("d", 1, 5e-6, True), ("gone", 1, 1e-3, True)])
    same = _bench_json(tmp_path / "same.json", [("a", 1, 105e-6, True), ("b", 1, 80e-6, True),
                                                ("c", 1, 300e-6, False), ("d", 1, 6.5e-6, True)])
    assert main(["--compare", str(old), str(same)]) == 0  # 5 % noise, a speed-up, eager drift, +1.5 us on 5 us
    out = capsys.readouterr().out
    assert "faster by more than 10%" in out and "not gating" in out and "slower by more than" not in out
    slower = _bench_json(tmp_path / "slower.json", [("a", 1, 120e-6, True)], copy_tbps=3.0)
    assert main(["--compare", str(old), str(slower)]) == 1
    out = capsys.readouterr().out
    assert "a FLASH T=1 triton" in out and "1.20x" in out and "ceiling copy_tbps" in out
    assert main(["--compare", str(old), str(slower), "--threshold", "0.25"]) == 0
    assert main(["--compare", str(old), str(tmp_path / "missing.json")]) == 2
    assert main(["--threshold", "0.2"]) == 2  # --threshold without --compare
