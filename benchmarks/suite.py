"""The benchmark model and runner: families of ops, points (op x config x token count), candidates, results.

A *family* (`ops_einsum`, `ops_moe`, `ops_attention`) builds the weights of one config once (`setup`) and
lists its ops. For each token count an op builds a *point*: the inputs, the counted `Work`, and the
*candidates* to time on identical inputs: every backend of the optimized package (`reference`, `triton`,
`deepgemm`) through the public API, plus baselines (torch bf16, torch `_scaled_mm`, DeepGEMM's raw kernel).
A candidate that cannot run here carries the reason instead of a function, and is reported
"n/a: <reason>", never dropped.

Budget rules (one H200 run of the whole suite must fit in one 10-minute command):
  * each candidate: one warm-up call (JIT included), then up to `MAX_RUNS` timed runs or ~50 ms of them;
  * the eager reference: timed up to `REF_MAX_TOKENS` tokens, and once one call of it takes longer than
    `REF_SLOW_S` at some token count, skipped at the larger token counts of that op; in both cases except at
    the points a speed target needs (`targets.reference_points`); the skip is reported in the table;
  * a run-time budget: points left when it is spent are reported as skipped, so the report is always written.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.roofline import Roofline, Work
from benchmarks.timing import Timer
from reference.config import DSv4Config
from reference.formats import quantize_per_block
from reference.weights import Fp8Weight

# Decode and prefill token counts (issue #6); attention decode contexts go up to 32768.
DECODE_TOKENS = (1, 8, 64, 128)
PREFILL_TOKENS = (512, 4096, 8192)
TOKENS = DECODE_TOKENS + PREFILL_TOKENS
# CPU smoke mode: TINY at one small token count (the Triton interpreter takes seconds per MoE call); ops whose
# decode and prefill inputs differ (attention) add one decode count.
SMOKE_TOKENS = (12,)
SMOKE_DECODE_TOKENS = (1, 12)
# The eager reference (fp64 accumulation: tens of seconds per call at 8192 prefill tokens) is timed up to this
# many tokens, and at larger counts only where a target needs it; it is also skipped at larger token counts once
# one call takes longer than REF_SLOW_S.
REF_MAX_TOKENS = 512
REF_SLOW_S = 2.0
# A reference call slower than this is timed by its one (warm-up) call alone, flagged "cold".
REF_COLD_S = 0.5
# Faster references are the baseline of "x times the reference" targets: the median of at least this many warm
# runs (one run of the 150 ms FLASH prefill layer varied from 146 to 203 ms between sessions), at most
# REF_COLD_S * REF_MIN_RUNS = 1.5 s per point.
REF_MIN_RUNS = 3
# Exceptions by which a candidate's setup says "not supported here" (n/a); any other exception is an error.
UNSUPPORTED = (ValueError, RuntimeError, NotImplementedError)
BACKEND_NAMES = ("reference", "triton", "deepgemm")

# Candidate kinds: a backend of the public API; a baseline (what a user would call without this package); a
# variant (a backend forced onto one of its internal paths, e.g. DeepGEMM's masked vs contiguous MoE layout, so
# the lead can place the switch between them): variants count neither as baselines nor for the targets.
BACKEND, BASELINE, VARIANT = "backend", "baseline", "variant"


@dataclass(frozen=True)
class Env:
    """Where and how a family builds its inputs.

    Attributes:
        cfg: the model config (FLASH, PRO, or TINY in smoke mode).
        device: "cuda" or "cpu".
        fmt: FP8 format name of weights and activations.
        seed: base seed of every random input.
        smoke: CPU smoke mode (the same code paths at TINY; nothing reported as a figure).
    """

    cfg: DSv4Config
    device: str
    fmt: str = "e4m3fn"
    seed: int = 0
    smoke: bool = False

    def generator(self, salt: int = 0) -> torch.Generator:
        """A generator on `device` seeded from `seed` and `salt` (inputs are drawn where they live)."""
        return torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + salt)

    def randn(self, *shape: int, salt: int = 0, dtype: torch.dtype = torch.bfloat16, std: float = 1.0) -> torch.Tensor:
        """A Gaussian tensor drawn on `device`."""
        x = torch.randn(shape, generator=self.generator(salt), device=self.device, dtype=torch.float32)
        return (x * std).to(dtype)

    def fp8_weight(self, n: int, k: int, *, salt: int = 0) -> Fp8Weight:
        """A random `[N, K]` block-FP8 weight with the statistics of `reference.weights.random_fp8_weight`
        (Gaussian, std 1/sqrt(K), quantized by `reference.formats.quantize_per_block`), drawn on `device`.

        The reference constructor draws on the CPU: at PRO sizes (~300 M values per attention layer) that takes
        longer than the whole GPU run may, so the same recipe runs on the device here.
        """
        w = self.randn(n, k, salt=salt, dtype=torch.float32, std=k**-0.5)
        return Fp8Weight(*quantize_per_block(w, 128, self.fmt))


@dataclass
class Candidate:
    """One thing to time at a point.

    Attributes:
        name: backend name (`reference`, `triton`, `deepgemm`) or baseline label.
        kind: `BACKEND`, `BASELINE` or `VARIANT`.
        build: prepares the zero-argument call to time (run by the runner just before timing it, so a skipped
            candidate costs nothing); raising one of `UNSUPPORTED` makes the candidate n/a with the message.
        na: the reason it cannot run here (then `build` is None).
    """

    name: str
    kind: str
    build: Callable[[], Callable[[], object]] | None = None
    na: str | None = None


@dataclass
class Point:
    """One op at one config and token count: its work and its candidates (inputs live in the closures)."""

    op: str
    config: str
    tokens: int
    shape: str
    work: Work
    candidates: list[Candidate]
    note: str = ""


@dataclass(frozen=True)
class OpBench:
    """One benchmarked op of a family.

    Attributes:
        name: row label ("fp8_einsum", "fp8_linear[wo_b]", "routed_moe", ...).
        description: one line for the report.
        make: (family context, env, tokens) -> Point.
        tokens: the token counts it runs at (default: decode + prefill).
        smoke_tokens: the token counts of the CPU smoke run.
    """

    name: str
    description: str
    make: Callable[[Any, Env, int], Point]
    tokens: tuple[int, ...] = TOKENS
    smoke_tokens: tuple[int, ...] = SMOKE_TOKENS

    def token_counts(self, env: Env) -> tuple[int, ...]:
        return self.smoke_tokens if env.smoke else self.tokens


@dataclass(frozen=True)
class Family:
    """A group of ops sharing one config's weights (built once by `setup`)."""

    name: str
    setup: Callable[[Env], Any]
    ops: tuple[OpBench, ...]


@dataclass
class Result:
    """One candidate at one point. `status`: "ok", "n/a" (cannot run here, with `reason`), "skipped"
    (budget rules, with `reason`) or "error" (raised: a bug, with `reason`)."""

    family: str
    op: str
    config: str
    tokens: int
    shape: str
    candidate: str
    kind: str
    status: str
    reason: str = ""
    time_s: float | None = None
    runs: int = 0
    first_call_s: float | None = None
    cold: bool = False
    graph: bool = False
    eager_time_s: float | None = None
    flops: float = 0.0
    bytes: float = 0.0
    weight_bytes: float = 0.0
    math: str = "none"
    bound: str = ""
    floor_s: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    weight_gbps: float | None = None
    roofline: float | None = None
    vs_reference: float | None = None
    vs_baseline: float | None = None
    best_baseline: str = ""
    note: str = ""


# ------------------------------------------------------------------------------------------------
# Candidates of the optimized package
# ------------------------------------------------------------------------------------------------


def backend_candidates(op: str | tuple[str, ...], call: Callable[[str], Callable[[], object]],
                       backends: Iterable[str] = BACKEND_NAMES) -> list[Candidate]:
    """One candidate per backend of the public op `op` (or of every op of a tuple, for a pipeline of ops):
    `call(backend)` returns the zero-argument call.

    A backend that does not implement an op, or cannot run on this machine, becomes an n/a candidate
    with the reason (the op not yet in `optimized`, no registration, the backend's own reason).
    """
    from optimized.backends import backend_status, registry

    ops = (op,) if isinstance(op, str) else op
    impls = registry()
    out = []
    for name in backends:
        missing = [o for o in ops if o not in impls]
        unregistered = [o for o in ops if o in impls and name not in impls[o]]
        ok, why = backend_status(name)
        if missing:
            out.append(Candidate(name, BACKEND, na=f"`optimized.{missing[0]}` is not implemented yet"))
        elif unregistered:
            out.append(Candidate(name, BACKEND, na=f"no {name} implementation of {unregistered[0]} registered"))
        elif not ok:
            out.append(Candidate(name, BACKEND, na=why))
        else:
            out.append(Candidate(name, BACKEND, build=lambda name=name: call(name)))
    return out


def implemented(op: str) -> bool:
    """Whether `optimized` registers `op` (for inputs that another op of the package prepares)."""
    from optimized.backends import registry

    return op in registry()


def baseline(name: str, build: Callable[[], Callable[[], object]], kind: str = BASELINE) -> Candidate:
    """A baseline (or variant) candidate whose call `build()` prepares (checked against an oracle there)."""
    return Candidate(name, kind, build=build)


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


# ------------------------------------------------------------------------------------------------
# Runner
# ------------------------------------------------------------------------------------------------


@dataclass
class Runner:
    """Runs families over configs and token counts, timing every candidate.

    Attributes:
        timer: the device timer.
        roofline: the ceilings measured in this run.
        reference_points: (op, config, tokens) where the reference is timed whatever it costs.
        budget_s: wall-clock budget of the whole run; points left after it are reported as skipped.
        warm_only: call every backend and variant once (JIT compilation into the on-disk caches) and skip the
            reference and the baselines; used by the parallel warm-up processes of `dsv4-bench`.
        log: progress printer.
    """

    timer: Timer
    roofline: Roofline
    reference_points: frozenset[tuple[str, str, int]] = frozenset()
    budget_s: float = float("inf")
    warm_only: bool = False
    log: Callable[[str], None] = print
    results: list[Result] = field(default_factory=list)
    family_seconds: dict[str, float] = field(default_factory=dict)
    _start: float = field(default_factory=time.perf_counter)

    def run(self, families: Iterable[Family], envs: Iterable[Env], ops: set[str] | None = None,
            tokens: tuple[int, ...] | None = None) -> list[Result]:
        """Every selected op of every family at every env (config), in that order."""
        families = list(families)
        for env in envs:
            for family in families:
                selected = [op for op in family.ops if ops is None or op.name in ops or family.name in ops]
                if selected:
                    started = time.perf_counter()
                    self._run_family(family, env, selected, tokens)
                    key = f"{family.name}/{env.cfg.name}"
                    self.family_seconds[key] = time.perf_counter() - started
                    self.log(f"[bench] {key}: {self.family_seconds[key]:.1f} s")
        return self.results

    def _over_budget(self) -> bool:
        return time.perf_counter() - self._start > self.budget_s

    def _run_family(self, family: Family, env: Env, ops: list[OpBench], tokens: tuple[int, ...] | None) -> None:
        cfg = env.cfg.name
        if self._over_budget():
            for op in ops:
                for t in tokens or op.token_counts(env):
                    self._record_all(family, op, cfg, t, "skipped", f"run-time budget of {self.budget_s:.0f} s spent")
            return
        try:
            ctx = family.setup(env)
        except Exception as exc:
            self.log(f"[bench] {family.name}/{cfg} setup failed:\n{traceback.format_exc()}")
            for op in ops:
                for t in tokens or op.token_counts(env):
                    self._record_all(family, op, cfg, t, "error", f"family setup failed: {_describe(exc)}")
            return
        for op in ops:
            slow_ref: tuple[int, float] | None = None
            for t in sorted(tokens or op.token_counts(env)):
                if self._over_budget():
                    self._record_all(family, op, cfg, t, "skipped", f"run-time budget of {self.budget_s:.0f} s spent")
                    continue
                slow_ref = self._run_point(family, op, env, ctx, t, slow_ref)
        del ctx
        self._free()
        if self.timer.device == "cuda":  # what a family leaves behind is what the next one cannot use
            self.log(f"[bench] {family.name}/{cfg} done: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
                     f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved")

    def _record_all(self, family: Family, op: OpBench, cfg: str, tokens: int, status: str, reason: str) -> None:
        self.results.append(Result(family.name, op.name, cfg, tokens, "", "*", "", status, reason))

    def _run_point(self, family: Family, op: OpBench, env: Env, ctx: Any, tokens: int,
                   slow_ref: tuple[int, float] | None) -> tuple[int, float] | None:
        cfg = env.cfg.name
        try:
            point = op.make(ctx, env, tokens)
        except Exception as exc:
            self.log(f"[bench] {op.name}/{cfg}/T={tokens} setup failed:\n{traceback.format_exc()}")
            self._record_all(family, op, cfg, tokens, "error", f"point setup failed: {_describe(exc)}")
            self._free()
            return slow_ref
        point_results = []
        for cand in point.candidates:
            res = Result(family.name, op.name, cfg, tokens, point.shape, cand.name, cand.kind, "ok",
                         flops=point.work.flops, bytes=point.work.bytes, weight_bytes=point.work.weight_bytes,
                         math=point.work.math, bound=self.roofline.bound(point.work), note=point.note)
            is_ref = cand.name == "reference" and cand.kind == BACKEND
            if cand.build is None:
                res.status, res.reason = "n/a", cand.na or "unavailable"
            elif self.warm_only and (is_ref or cand.kind == BASELINE):
                res.status, res.reason = "skipped", "warm-up run: JIT kernels only"
            elif is_ref and tokens > REF_MAX_TOKENS and (op.name, cfg, tokens) not in self.reference_points:
                res.status = "skipped"
                res.reason = f"reference timed up to T={REF_MAX_TOKENS} and where a target needs it (run-time budget)"
            elif is_ref and slow_ref is not None and (op.name, cfg, tokens) not in self.reference_points:
                res.status = "skipped"
                res.reason = (f"reference took {slow_ref[1]:.1f} s per call at T={slow_ref[0]} (> {REF_SLOW_S:g} s); "
                              "timed only where a target needs it")
            else:
                self._measure(cand, res, point.work)
                if is_ref and res.time_s is not None and res.time_s > REF_SLOW_S and slow_ref is None:
                    slow_ref = (tokens, res.time_s)
            point_results.append(res)
            self.log(f"[bench] {cfg:5s} {op.name:28s} T={tokens:<5d} {cand.name:34s} {_short(res)}")
        _compare(point_results)
        self.results.extend(point_results)
        del point
        self._free()
        return slow_ref

    def _measure(self, cand: Candidate, res: Result, work: Work) -> None:
        assert cand.build is not None
        is_ref = cand.name == "reference" and cand.kind == BACKEND
        try:
            fn = cand.build()
        except UNSUPPORTED as exc:
            res.status, res.reason = "n/a", (f"setup failed: {_describe(exc)}" if cand.kind == BACKEND
                                             else _describe(exc))
            self._free()
            return
        except Exception as exc:
            res.status, res.reason = "error", f"setup raised {_describe(exc)}"
            where = f"{res.op}/{res.config}/T={res.tokens}/{cand.name}"
            self.log(f"[bench] {where} setup raised:\n{traceback.format_exc()}")
            self._free()
            return
        try:
            timing = (self.timer.time(fn, slow_s=REF_COLD_S, min_runs=REF_MIN_RUNS) if is_ref
                      else self.timer.time(fn, graph=True))
        except torch.cuda.OutOfMemoryError as exc:
            res.status = "error" if cand.kind == BACKEND and not is_ref else "n/a"
            res.reason = f"out of GPU memory ({_describe(exc)[:120]})"
            self._free()
            return
        except Exception as exc:
            res.status = "error"
            res.reason = _describe(exc)
            self.log(f"[bench] {res.op}/{res.config}/T={res.tokens}/{cand.name} raised:\n{traceback.format_exc()}")
            self._free()
            return
        del fn  # the candidate's buffers (and a captured graph's pool) go before the next candidate is built
        self._free()
        t = timing.median_s
        res.time_s, res.runs, res.first_call_s, res.cold = t, timing.runs, timing.first_call_s, timing.cold
        res.graph, res.eager_time_s = timing.graph, timing.eager_s
        res.tflops = work.flops / t / 1e12 if work.flops else None
        res.gbps = work.bytes / t / 1e9
        res.weight_gbps = work.weight_bytes / t / 1e9 if work.weight_bytes else None
        res.floor_s = self.roofline.floor_s(work)
        res.roofline = res.floor_s / t

    def _free(self) -> None:
        """Return what the last candidate held: on the H200 run of 2026-12-02 the MoE family ran out of its
        139 GB at T=4096 with nothing freed between candidates."""
        if self.timer.device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


def _compare(results: list[Result]) -> None:
    """Fill the speedups of each result over the reference and over the fastest baseline of the point."""
    timed = [r for r in results if r.status == "ok" and r.time_s]
    ref = next((r for r in timed if r.candidate == "reference" and r.kind == BACKEND), None)
    baselines = [r for r in timed if r.kind == BASELINE]
    best = min(baselines, key=lambda r: r.time_s or 0.0) if baselines else None
    for r in timed:
        assert r.time_s is not None
        if ref is not None and ref.time_s:
            r.vs_reference = ref.time_s / r.time_s
        if best is not None and best.time_s and r is not best:
            r.vs_baseline, r.best_baseline = best.time_s / r.time_s, best.candidate


def _short(res: Result) -> str:
    if res.status != "ok" or res.time_s is None:
        return f"{res.status}: {res.reason}"
    eager = f"  (eager {res.eager_time_s * 1e6:.1f} us)" if res.eager_time_s is not None else "  (eager)"
    return (f"{res.time_s * 1e6:10.1f} us  roofline {res.roofline or 0:.0%}" + ("  (cold call)" if res.cold else "")
            + eager)
