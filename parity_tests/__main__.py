"""`python -m parity_tests` (installed as `dsv4-parity`): the parity suite on whatever hardware is here.

Runs, for every case of `cases.all_cases` and every available backend, the backend against the reference,
plus the suites that make it a regression gate: golden results of the reference, determinism and batch
invariance per backend, the bad-input corpus, and CUDA-graph capture of the decode paths. Prints a table,
writes a JSON report and JUnit XML, and exits 1 when anything failed (a case that cannot run here is
reported as "not run: <reason>", which is not a failure). Exit code 2 is a usage error.

    python -m parity_tests                          # TINY on a CPU, FLASH on a GPU; every suite
    python -m parity_tests --config FLASH,PRO --ops fp8_einsum --backends deepgemm
    python -m parity_tests --golden update          # re-record the golden results (after a deliberate change)
    python -m parity_tests --compare old.json new.json --threshold 0.1
    python -m parity_tests --checkpoint /path/to/DeepSeek-V4-Flash --layer 3
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from parity_tests import report
from parity_tests.report import Result, Task, shape_matches

SUITES = ("parity", "golden", "determinism", "batch_invariance", "bad_input", "cuda_graph", "checkpoint")
DEFAULT_SUITES = ("parity", "golden", "determinism", "batch_invariance", "bad_input", "cuda_graph")
DEFAULT_OUT = Path("build/parity")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from optimized.backends import BACKENDS

    p = argparse.ArgumentParser(prog="dsv4-parity", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=_csv, default=None,
                   help="comma-separated configs (TINY, FLASH, PRO); default TINY on a CPU, FLASH on a GPU")
    p.add_argument("--ops", type=_csv, default=None, help="only these ops (comma-separated)")
    p.add_argument("--backends", type=_csv, default=None, help=f"only these backends, of {', '.join(BACKENDS)}")
    p.add_argument("--shapes", type=_csv, default=None,
                   help="only shapes matching these patterns (substring, or glob with * ?), comma-separated")
    p.add_argument("--suites", type=_csv, default=None,
                   help=f"suites to run, of {', '.join(SUITES)}; default all but checkpoint "
                        "(checkpoint only, with --checkpoint)")
    p.add_argument("--golden", choices=("check", "update", "off"), default="check",
                   help="check the reference against parity_tests/golden (default), re-record it, or skip it")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report folder (default {DEFAULT_OUT})")
    p.add_argument("--json", type=Path, default=None, help="JSON report path (default OUT/report.json)")
    p.add_argument("--junit", type=Path, default=None, help="JUnit XML path (default OUT/junit.xml)")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), type=Path, default=None,
                   help="diff two JSON reports; exit 1 when a case regressed or a check grew past --threshold")
    p.add_argument("--threshold", type=float, default=report.DEFAULT_THRESHOLD,
                   help="with --compare: a check is worse when it grew by more than this fraction of its bound "
                        f"(default {report.DEFAULT_THRESHOLD})")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="a DeepSeek V4 checkpoint folder (config.json + *.safetensors): run the layer cases on "
                        "its weights")
    p.add_argument("--layer", type=int, default=None, help="with --checkpoint: the layer to load")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="show a progress bar (default: only when stdout is a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--verbose", "-v", action="store_true", help="table rows for every result, not only failures")
    p.add_argument("--list", action="store_true", help="list the tasks that would run, run nothing")
    p.add_argument("--bounds", action="store_true", help="print every tier and bound with its reason, run nothing")
    args = p.parse_args(argv)
    if args.backends:
        bad = sorted(set(args.backends) - set(BACKENDS))
        if bad:
            p.error(f"--backends: unknown {bad}; expected of {list(BACKENDS)}")
    if args.suites:
        bad = sorted(set(args.suites) - set(SUITES))
        if bad:
            p.error(f"--suites: unknown {bad}; expected of {list(SUITES)}")
    if (args.checkpoint is None) != (args.layer is None):
        p.error("--checkpoint and --layer go together")
    if args.config:
        from reference.config import CONFIGS

        bad = sorted({c.upper() for c in args.config} - set(CONFIGS))
        if bad:
            p.error(f"--config: unknown {bad}; expected of {sorted(CONFIGS)}")
        args.config = [c.upper() for c in args.config]
    return args


# ------------------------------------------------------------------------------------------------
# collecting tasks
# ------------------------------------------------------------------------------------------------


def parity_tasks(configs: list[str], device: str, ops: list[str] | None, backends: list[str] | None,
                 shapes: list[str] | None) -> list[Task]:
    """One task per (case, backend) of `cases.all_cases`."""
    from parity_tests.cases import all_cases, providers

    known = set(providers())
    wanted = None if ops is None else [op for op in ops if op in known]
    if wanted == []:
        return []
    tasks = []
    for config in configs:
        for case in all_cases(config, device, wanted):
            if not shape_matches(case.shape, shapes):
                continue
            for backend in case.backends:
                if backends is None or backend in backends:
                    tasks.append(Task("parity", case.op, case.config, case.shape, case.fmt, case.seed, backend,
                                      functools.partial(case.run, backend), registry_op=case.op))
    return tasks


def known_ops() -> set[str]:
    """Every op any suite knows, for validating `--ops`."""
    from optimized.backends import registry
    from parity_tests import bad_inputs, probes
    from parity_tests.cases import providers

    return set(providers()) | set(registry()) | set(probes.probe_providers()) | {e.op for e in bad_inputs.CORPUS}


def collect(args: argparse.Namespace, device: str, configs: list[str], suites: list[str]) -> tuple[
        list[Task], list[Result]]:
    """The tasks of every requested suite. A suite whose collection raises (an op module that does not
    import, say) becomes one error result and the others still run."""
    from parity_tests import bad_inputs, golden, invariance, probes

    probe_suites = [s for s in suites if s in invariance.SUITES]
    builders: dict[str, Callable[[], list[Task]]] = {
        "parity": lambda: parity_tasks(configs, device, args.ops, args.backends, args.shapes),
        "golden": lambda: golden.tasks(args.ops, args.shapes),
        "invariance": lambda: invariance.tasks(probe_suites, configs, device, args.ops, args.backends, args.shapes),
        "bad_input": lambda: bad_inputs.tasks(device, args.ops, args.backends),
        "checkpoint": lambda: probes.checkpoint_tasks(args.checkpoint, args.layer, device, args.ops, args.backends),
    }
    groups = [s for s in suites if s not in invariance.SUITES] + (["invariance"] if probe_suites else [])
    tasks: list[Task] = []
    errors: list[Result] = []
    for group in groups:
        try:
            tasks.extend(builders[group]())
        except Exception as exc:  # reported, and the run goes on with the other suites
            errors.append(Result(group, "(collect)", ",".join(configs), "-", "-", 0, "-", "error",
                                 reason=f"collecting the {group} suite(s) failed: {type(exc).__name__}: {exc}"))
    return tasks, errors


def run_tasks(tasks: list[Task], console: Console, show_progress: bool,
              partial: Callable[[list[Result]], None] | None = None) -> list[Result]:
    """Execute every task: a progress bar when asked, else one line per finished task (CI logs).

    `partial` is called with the results so far after each task, so a run killed by a time limit still
    leaves its report behind.
    """
    results: list[Result] = []
    if not show_progress:
        for t in tasks:
            r = report.execute(t)
            results.append(r)
            console.print(f"{r.status:8s} {r.suite} {r.op}[{r.config},{r.shape},{r.fmt}] {r.backend} "
                          f"{r.seconds:.2f} s {r.reason[:100]}", markup=False, highlight=False)
            if partial is not None:
                partial(results)
        return results
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("parity", total=len(tasks))
        for t in tasks:
            progress.update(bar, description=f"{t.suite} {t.op}[{t.config},{t.shape}] {t.backend}")
            results.append(report.execute(t))
            progress.advance(bar)
    return results


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    if "--distributed" in (sys.argv[1:] if argv is None else argv):  # sharded parity under torchrun (issue #7)
        from parity_tests.distributed import main as distributed_main

        return distributed_main(argv)
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)  # CI logs: no terminal, wide rows

    if args.compare is not None:
        try:
            (_, old), (_, new) = report.read_json(args.compare[0]), report.read_json(args.compare[1])
            comparison = report.compare(old, new, args.threshold)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            console.print(f"[red]--compare: {exc}")
            return 2
        report.print_comparison(comparison, console, args.threshold)
        return int(bool(comparison.worse))

    if args.bounds:
        report.print_bounds(console)
        return 0

    from optimized.backends import BACKENDS, backend_status, detect

    hw = detect()
    device = hw.torch_device

    if args.golden == "update":
        from parity_tests import golden

        for line in golden.update(args.ops):
            console.print(line)
        return 0

    if args.ops:
        unknown = sorted(set(args.ops) - known_ops())
        if unknown:
            console.print(f"[red]--ops: unknown {unknown}; known: {sorted(known_ops())}")
            return 2

    if args.checkpoint is not None:
        from parity_tests.probes import checkpoint_config

        configs = [checkpoint_config(args.checkpoint).name]
        suites = args.suites or ["checkpoint"]
    else:
        configs = args.config or (["TINY"] if device == "cpu" else ["FLASH"])
        suites = [s for s in (args.suites or DEFAULT_SUITES) if s != "checkpoint"]
    if args.golden == "off":
        suites = [s for s in suites if s != "golden"]

    console.print(f"dsv4-parity: {hw.device} ({hw.name}, {hw.arch}), configs {','.join(configs)}, "
                  f"suites {','.join(suites)}")
    for name in BACKENDS:
        ok, why = backend_status(name)
        console.print(f"  {name:9s} {'available' if ok else 'not available'}: {why}")

    tasks, results = collect(args, device, configs, suites)
    if args.list:
        for t in tasks:
            console.print(f"{t.suite:16s} {t.op}[{t.config},{t.shape},{t.fmt},seed={t.seed}] {t.backend}",
                          markup=False, highlight=False)
        for r in results:
            console.print(f"[red]{r.suite}: {r.reason}", markup=True)
        return report.exit_code(results)

    show_progress = sys.stdout.isatty() if args.progress is None else args.progress
    header = report.make_header(["dsv4-parity", *(sys.argv[1:] if argv is None else argv)])
    json_path = args.json or args.out / "report.json"
    junit_path = args.junit or args.out / "junit.xml"
    collected = list(results)

    def write_partial(done: list[Result]) -> None:
        report.write_json(json_path, collected + done, {**header, "partial": f"{len(done)} of {len(tasks)} tasks"})

    results += run_tasks(tasks, console, show_progress, write_partial)
    report.write_json(json_path, results, header)
    report.write_junit(junit_path, results, header)
    report.print_table(results, console, verbose=args.verbose)
    console.print(f"reports: {json_path}, {junit_path}")
    code = report.exit_code(results)
    console.print("[bold red]FAILED" if code else "[bold green]OK (nothing failed)")
    return code


if __name__ == "__main__":
    sys.exit(main())
