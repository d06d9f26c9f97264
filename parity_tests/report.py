"""Parity reports: one `Result` per (case, backend); a rich table, JSON, JUnit XML, and report diffs.

JSON schema (`write_json`):

    {"schema": 1,
     "header": {"hardware": {...}, "versions": {...}, "date": "...", "git_commit": "...", "argv": [...]},
     "results": [{"suite", "op", "config", "shape", "fmt", "seed", "backend",
                  "status": "pass" | "fail" | "error" | "not_run",
                  "checks": [{"name", "tier", "metric", "value", "bound", "passed", "detail"}],
                  "reason", "seconds"}]}

Non-finite numbers are written as the strings "nan", "inf", "-inf" (strict JSON has no NaN).
A `not_run` result is not a failure; `fail` (a check out of its bound) and `error` (an exception in
the case) are. `compare` diffs two reports of the same matrix (two commits of a kernel).
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import math
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from parity_tests.cases import Check, NotRun

STATUSES = ("pass", "fail", "error", "not_run")
FAILING = ("fail", "error")
SCHEMA_VERSION = 1
_REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CheckRecord:
    """A `Check` as reports hold it (the bound flattened into tier / metric / bound)."""

    name: str
    tier: str
    metric: str
    value: float
    bound: float
    passed: bool
    detail: str = ""

    @classmethod
    def of(cls, check: Check) -> CheckRecord:
        return cls(check.name, check.bound.tier, check.bound.metric, float(check.value), float(check.bound.value),
                   check.passed, check.detail)

    @property
    def budget_used(self) -> float:
        """value / bound (inf when a zero bound is exceeded, 0 when both are 0)."""
        if self.bound > 0:
            return self.value / self.bound
        return 0.0 if self.value <= 0 else math.inf


@dataclass(frozen=True)
class Result:
    """The outcome of one case for one backend.

    Attributes:
        suite: "parity", "golden", "determinism", "batch_invariance", "bad_input", "cuda_graph",
            "checkpoint".
        op, config, shape, fmt, seed: what was run (as in `cases.Case`).
        backend: "triton", "deepgemm" or "reference".
        status: "pass", "fail", "error" or "not_run".
        checks: every measured quantity with its bound.
        reason: why it did not run, or the exception of an error, or the failing checks.
        seconds: wall time of the case.
    """

    suite: str
    op: str
    config: str
    shape: str
    fmt: str
    seed: int
    backend: str
    status: str
    checks: tuple[CheckRecord, ...] = ()
    reason: str = ""
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status: expected one of {STATUSES}, got {self.status!r}")

    @property
    def key(self) -> tuple[str, str, str, str, str, int, str]:
        """What identifies a result across two reports of the same matrix."""
        return (self.suite, self.op, self.config, self.shape, self.fmt, self.seed, self.backend)

    @property
    def case_id(self) -> str:
        return f"{self.op}[{self.config},{self.shape},{self.fmt},seed={self.seed}]"

    @property
    def failed(self) -> bool:
        return self.status in FAILING

    def worst_check(self) -> CheckRecord | None:
        """The failing check that uses most of its bound, else the check closest to its bound."""
        if not self.checks:
            return None
        failing = [c for c in self.checks if not c.passed]
        pool = failing or list(self.checks)
        return max(pool, key=lambda c: (math.inf if math.isnan(c.value) else c.budget_used))


def result_from_checks(meta: dict[str, Any], checks: Iterable[Check], seconds: float) -> Result:
    """A pass / fail result from the checks of one case (`meta`: suite, op, config, shape, fmt, seed, backend)."""
    records = tuple(CheckRecord.of(c) for c in checks)
    if not records:
        return Result(**meta, status="error", reason="the case returned no checks", seconds=seconds)
    failing = [c for c in records if not c.passed]
    reason = "; ".join(f"{c.name}: {_fmt(c.value)} > {_fmt(c.bound)} ({c.tier} {c.metric})" for c in failing)
    return Result(**meta, status="fail" if failing else "pass", checks=records, reason=reason, seconds=seconds)


# ------------------------------------------------------------------------------------------------
# running: a Task is one (case, backend) of any suite; `execute` turns it into a Result
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One unit of work of any suite.

    Attributes:
        suite, op, config, shape, fmt, seed, backend: what it is (as in `Result`).
        run: () -> checks; raises `NotRun(reason)` when it cannot run here. Any other exception is an error.
        registry_op: the `optimized` op whose registration says whether `backend` implements it (None: no
            such check, e.g. a case over several ops).
    """

    suite: str
    op: str
    config: str
    shape: str
    fmt: str
    seed: int
    backend: str
    run: Callable[[], list[Check]] = field(compare=False, repr=False)
    registry_op: str | None = None

    @property
    def meta(self) -> dict[str, Any]:
        return {"suite": self.suite, "op": self.op, "config": self.config, "shape": self.shape, "fmt": self.fmt,
                "seed": self.seed, "backend": self.backend}


def shape_matches(shape: str, patterns: list[str] | None) -> bool:
    """The `--shapes` filter: a pattern with `*`, `?` or `[` is a glob over the shape label, else a substring."""
    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(shape, p) if any(ch in p for ch in "*?[") else p in shape for p in patterns)


def unavailable(backend: str, registry_op: str | None) -> str | None:
    """Why `backend` cannot run `registry_op` on this machine, or None when it can."""
    from optimized.backends import backend_status, registry

    ok, why = backend_status(backend)
    if not ok:
        return f"backend {backend!r} unavailable: {why}"
    if registry_op is not None:
        impls = registry().get(registry_op)
        if impls is not None and backend not in impls:
            return f"backend {backend!r} does not implement {registry_op!r} (it has: {sorted(impls)})"
    return None


def execute(task: Task) -> Result:
    """Run one task: not_run when the backend is unavailable or the case raises NotRun, error on any other
    exception (with its message and the end of the traceback), else pass / fail from its checks."""
    why = unavailable(task.backend, task.registry_op)
    if why is not None:
        return Result(**task.meta, status="not_run", reason=why)
    start = time.perf_counter()
    try:
        checks = task.run()
    except NotRun as exc:
        return Result(**task.meta, status="not_run", reason=str(exc) or "not run",
                      seconds=time.perf_counter() - start)
    except Exception as exc:  # a crashing case is a failure of that case, never of the run
        tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
        return Result(**task.meta, status="error", reason=f"{type(exc).__name__}: {exc}\n{tail}",
                      seconds=time.perf_counter() - start)
    return result_from_checks(task.meta, checks, time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------
# header
# ------------------------------------------------------------------------------------------------


def git_commit() -> str | None:
    """HEAD of this checkout, with "-dirty" when tracked files differ from it (None outside git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                           capture_output=True, text=True, timeout=10)
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def make_header(argv: list[str] | None = None) -> dict[str, Any]:
    """Hardware, versions, date and git commit of this run."""
    import torch

    from optimized.backends import detect

    hw = detect()
    return {
        "hardware": asdict(hw),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "hip": torch.version.hip,
            "triton": hw.triton,
            "deep_gemm": hw.deep_gemm,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "argv": list(sys.argv if argv is None else argv),
    }


# ------------------------------------------------------------------------------------------------
# JSON
# ------------------------------------------------------------------------------------------------


def _num(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _unnum(x: float | str) -> float:
    return float(x)  # float("nan") / float("inf") / float("-inf") parse the strings back


def to_json(results: list[Result], header: dict[str, Any]) -> dict[str, Any]:
    """The report as a JSON-able dict."""
    rows = []
    for r in results:
        row = asdict(r)
        row["checks"] = [{**asdict(c), "value": _num(c.value), "bound": _num(c.bound)} for c in r.checks]
        row["seconds"] = round(r.seconds, 4)
        rows.append(row)
    return {"schema": SCHEMA_VERSION, "header": header, "results": rows}


def write_json(path: str | Path, results: list[Result], header: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(results, header), indent=1, allow_nan=False) + "\n")


def read_json(path: str | Path) -> tuple[dict[str, Any], list[Result]]:
    """(header, results) of a report written by `write_json`."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: not a dsv4-parity report of schema {SCHEMA_VERSION}")
    results = []
    for row in data["results"]:
        checks = tuple(CheckRecord(**{**c, "value": _unnum(c["value"]), "bound": _unnum(c["bound"])})
                       for c in row["checks"])
        results.append(Result(**{**row, "checks": checks}))
    return data["header"], results


# ------------------------------------------------------------------------------------------------
# JUnit XML
# ------------------------------------------------------------------------------------------------


def _check_lines(r: Result) -> str:
    return "\n".join(f"{'ok  ' if c.passed else 'FAIL'} {c.name}: {c.metric} = {_fmt(c.value)} "
                     f"(bound {_fmt(c.bound)}, {c.tier}){' ' + c.detail if c.detail else ''}" for c in r.checks)


def to_junit(results: list[Result], header: dict[str, Any]) -> ET.ElementTree:
    """One <testsuite> per (suite, op), one <testcase> per (case, backend); not_run is <skipped>."""
    counts = Counter(r.status for r in results)
    root = ET.Element("testsuites", name="dsv4-parity", tests=str(len(results)), failures=str(counts["fail"]),
                      errors=str(counts["error"]), skipped=str(counts["not_run"]),
                      time=f"{sum(r.seconds for r in results):.3f}")
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.suite, r.op), []).append(r)
    hw = header.get("hardware", {})
    for (suite, op), rows in groups.items():
        c = Counter(r.status for r in rows)
        ts = ET.SubElement(root, "testsuite", name=f"{suite}.{op}", tests=str(len(rows)), failures=str(c["fail"]),
                           errors=str(c["error"]), skipped=str(c["not_run"]),
                           time=f"{sum(r.seconds for r in rows):.3f}", timestamp=str(header.get("date", "")),
                           hostname=platform.node())
        props = ET.SubElement(ts, "properties")
        for name, value in (("device", hw.get("device")), ("arch", hw.get("arch")),
                            ("git_commit", header.get("git_commit")),
                            *((f"version.{k}", v) for k, v in header.get("versions", {}).items())):
            ET.SubElement(props, "property", name=name, value=str(value))
        for r in rows:
            tc = ET.SubElement(ts, "testcase", classname=f"dsv4_parity.{suite}.{op}",
                               name=f"{r.case_id} [{r.backend}]", time=f"{r.seconds:.3f}")
            if r.status == "not_run":
                ET.SubElement(tc, "skipped", message=f"not run: {r.reason}")
            elif r.status == "fail":
                ET.SubElement(tc, "failure", message=r.reason, type="parity").text = _check_lines(r)
            elif r.status == "error":
                first = r.reason.splitlines()[0] if r.reason else "error"
                ET.SubElement(tc, "error", message=first, type="exception").text = r.reason
            if r.checks and r.status == "pass":  # a failure element already holds the check lines
                ET.SubElement(tc, "system-out").text = _check_lines(r)
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(path: str | Path, results: list[Result], header: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_junit(results, header).write(path, encoding="utf-8", xml_declaration=True)


# ------------------------------------------------------------------------------------------------
# terminal table
# ------------------------------------------------------------------------------------------------

_STYLE = {"pass": "green", "fail": "bold red", "error": "bold magenta", "not_run": "yellow"}


def _fmt(x: float) -> str:
    if x != x or math.isinf(x):
        return str(x)
    if x == int(x) and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.3g}"


def _status_text(r: Result) -> str:
    if r.status == "not_run":
        return f"not run: {r.reason}"
    if r.status == "error":
        return f"error: {r.reason.splitlines()[0] if r.reason else ''}"
    return r.status


def _check_text(r: Result) -> str:
    c = r.worst_check()
    if c is None:
        return ""
    return f"{c.name}: {_fmt(c.value)} / {_fmt(c.bound)} ({c.tier})"


def print_table(results: list[Result], console: Console, verbose: bool = False) -> None:
    """Every parity row and every row of another suite that did not pass (all rows with `verbose`), then a
    summary by suite and status. Without `verbose`, not-run rows of one suite and backend that share their
    reason are folded into one row listing the cases."""
    shown = [r for r in results if verbose or r.suite == "parity" or r.status != "pass"]
    rows: list[tuple[str, str, str, str, str, str]] = []
    folded: dict[tuple[str, str, str], list[Result]] = {}
    for r in shown:
        if r.status == "not_run" and not verbose:
            folded.setdefault((r.suite, r.backend, r.reason), []).append(r)
            if len(folded[(r.suite, r.backend, r.reason)]) > 1:
                continue
        rows.append((r.suite, r.case_id, r.backend, f"[{_STYLE[r.status]}]{_escape(_status_text(r))}[/]",
                     _escape(_check_text(r)), f"{r.seconds:.2f}"))
    for (suite, backend, reason), group in folded.items():
        if len(group) > 1:
            i = next(k for k, row in enumerate(rows) if row[0] == suite and row[2] == backend
                     and row[1] == group[0].case_id)
            names = ", ".join(r.case_id for r in group[:3]) + (", ..." if len(group) > 3 else "")
            rows[i] = (suite, _escape(f"{len(group)} cases: {names}"), backend,
                       f"[{_STYLE['not_run']}]{_escape('not run: ' + reason)}[/]", "", "")
    if rows:
        table = Table(title="dsv4-parity: backends vs the reference", show_lines=False)
        for col in ("suite", "case", "backend", "status", "worst check (value / bound)", "s"):
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    summary = Table(title="summary")
    summary.add_column("suite")
    for s in STATUSES:
        summary.add_column(s, justify="right")
    by_suite: dict[str, Counter[str]] = {}
    for r in results:
        by_suite.setdefault(r.suite, Counter())[r.status] += 1
    for suite, c in by_suite.items():
        summary.add_row(suite, *(str(c[s]) for s in STATUSES))
    total = Counter(r.status for r in results)
    summary.add_row("[bold]total", *(f"[bold]{total[s]}" for s in STATUSES))
    console.print(summary)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def print_bounds(console: Console) -> None:
    """Every `Bound` of `tolerances.py`: name, tier, metric, value and the reason it is that value."""
    from parity_tests import tolerances

    table = Table(title="tiers and bounds (parity_tests/tolerances.py)")
    for col in ("bound", "tier", "metric", "value", "why"):
        table.add_column(col, overflow="fold")
    for name, b in vars(tolerances).items():
        if isinstance(b, tolerances.Bound):
            table.add_row(name, b.tier, _escape(b.metric), f"{b.value:g}", _escape(b.reason))
    console.print(table)


def exit_code(results: list[Result]) -> int:
    """1 when any result failed or errored, else 0 (not_run is not a failure)."""
    return int(any(r.failed for r in results))


# ------------------------------------------------------------------------------------------------
# report diffs
# ------------------------------------------------------------------------------------------------

# Default of `--threshold`: a check counts as worse when its value grew by more than this fraction of its
# bound. Measured values far below their bound can double from run to run of different commits without
# meaning anything (1e-7 -> 2e-7 against a 1e-5 bound); a tenth of the bound is a change worth a look.
DEFAULT_THRESHOLD = 0.1


@dataclass(frozen=True)
class Change:
    """One entry of a report diff.

    Attributes:
        key: the result's key (suite, op, config, shape, fmt, seed, backend).
        kind: "regressed" (pass -> fail/error), "lost" (ran before, not now), "worse" (a check grew past the
            threshold), "improved", "fixed" (fail/error -> pass), "new" (only in the new report).
        check: the check's name, for "worse" / "improved".
        old, new: the status or the check value before and after.
        growth: (new - old) / bound for checks.
    """

    key: tuple[str, str, str, str, str, int, str]
    kind: str
    check: str = ""
    old: str | float = ""
    new: str | float = ""
    growth: float = 0.0

    @property
    def is_worse(self) -> bool:
        return self.kind in ("regressed", "lost", "worse")


@dataclass
class Comparison:
    changes: list[Change] = field(default_factory=list)
    matched: int = 0

    @property
    def worse(self) -> list[Change]:
        return [c for c in self.changes if c.is_worse]


def compare(old: list[Result], new: list[Result], threshold: float = DEFAULT_THRESHOLD) -> Comparison:
    """What changed from report `old` to report `new` (results matched by key)."""
    if threshold < 0:
        raise ValueError(f"threshold: expected >= 0, got {threshold}")
    old_by, new_by = {r.key: r for r in old}, {r.key: r for r in new}
    out = Comparison()
    for key, o in old_by.items():
        n = new_by.get(key)
        if n is None:
            if o.status != "not_run":
                out.changes.append(Change(key, "lost", old=o.status, new="missing"))
            continue
        out.matched += 1
        if o.status == "pass" and n.failed:
            out.changes.append(Change(key, "regressed", old=o.status, new=n.status))
        elif o.status != "not_run" and n.status == "not_run":
            out.changes.append(Change(key, "lost", old=o.status, new=f"not_run: {n.reason}"))
        elif o.failed and n.status == "pass":
            out.changes.append(Change(key, "fixed", old=o.status, new=n.status))
        old_checks = {c.name: c for c in o.checks}
        for c in n.checks:
            before = old_checks.get(c.name)
            if before is None:
                continue
            growth = _growth(before.value, c.value, c.bound)
            if growth > threshold:
                out.changes.append(Change(key, "worse", c.name, before.value, c.value, growth))
            elif growth < -threshold:
                out.changes.append(Change(key, "improved", c.name, before.value, c.value, growth))
    out.changes.extend(Change(key, "new", new=r.status) for key, r in new_by.items() if key not in old_by)
    return out


def _growth(old: float, new: float, bound: float) -> float:
    """(new - old) / bound; a NaN appearing is infinitely worse; with a zero bound any increase is infinite."""
    old_nan, new_nan = math.isnan(old), math.isnan(new)
    if old_nan or new_nan:
        return 0.0 if old_nan == new_nan else (math.inf if new_nan else -math.inf)
    if new == old:
        return 0.0
    if bound > 0 and math.isfinite(new) and math.isfinite(old):
        return (new - old) / bound
    return math.inf if new > old else -math.inf


def print_comparison(cmp: Comparison, console: Console, threshold: float) -> None:
    table = Table(title=f"report diff ({cmp.matched} matched results; a check is worse when it grew by more than "
                        f"{threshold:g} of its bound)")
    for col in ("change", "suite", "case", "backend", "check", "old", "new", "x", "growth / bound"):
        table.add_column(col, overflow="fold")
    order = {"regressed": 0, "lost": 1, "worse": 2, "fixed": 3, "improved": 4, "new": 5}
    for c in sorted(cmp.changes, key=lambda c: (order[c.kind], -c.growth)):
        suite, op, config, shape, fmt, seed, backend = c.key
        ratio = ""
        if isinstance(c.old, float) and isinstance(c.new, float) and c.old != 0 and math.isfinite(c.old):
            ratio = f"{c.new / c.old:.3g}"
        style = "bold red" if c.is_worse else "green" if c.kind in ("fixed", "improved") else ""
        table.add_row(f"[{style}]{c.kind}[/]" if style else c.kind, suite,
                      _escape(f"{op}[{config},{shape},{fmt},seed={seed}]"), backend, c.check,
                      _escape(_fmt(c.old) if isinstance(c.old, float) else str(c.old)),
                      _escape(_fmt(c.new) if isinstance(c.new, float) else str(c.new)), ratio,
                      "" if c.kind not in ("worse", "improved") else f"{c.growth:+.3g}")
    console.print(table)
    console.print(f"{len(cmp.worse)} worse, "
                  f"{sum(c.kind in ('fixed', 'improved') for c in cmp.changes)} better, "
                  f"{sum(c.kind == 'new' for c in cmp.changes)} new")
