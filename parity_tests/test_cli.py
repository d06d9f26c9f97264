"""The parity CLI and its reports, driven by fake providers (every status a case can end in)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from parity_tests import __main__ as cli
from parity_tests import cases, report
from parity_tests.cases import Case, Check, NotRun
from parity_tests.tolerances import FP8_END_TO_END

REPO = Path(__file__).resolve().parent.parent


def _case(shape: str, value: float | None = None, not_run: str = "", crash: str = "") -> Case:
    def run(backend: str) -> list[Check]:
        if not_run:
            raise NotRun(not_run)
        if crash:
            raise RuntimeError(crash)
        return [Check("calc_diff", FP8_END_TO_END, value if value is not None else 0.0, detail=f"on {backend}")]

    return Case("fake_op", "TINY", shape, "e4m3fn", 0, "cpu", run, backends=("reference",))


@pytest.fixture
def fake_matrix(monkeypatch: pytest.MonkeyPatch) -> list[Case]:
    """Replace the real op modules by one fake provider with a pass, a fail, a not-run and a crash."""
    matrix = [_case("ok", 1e-4), _case("bad", 5e-3), _case("skip", not_run="needs a GPU"),
              _case("boom", crash="kernel exploded")]
    monkeypatch.setattr(cases, "OP_MODULES", ())
    monkeypatch.setattr(cases, "_PROVIDERS", {"fake_op": lambda config, device: list(matrix)})
    return matrix


def _run(tmp_path: Path, *args: str) -> tuple[int, dict, ET.Element]:
    code = cli.main(["--suites", "parity", "--out", str(tmp_path), "--no-progress", *args])
    data = json.loads((tmp_path / "report.json").read_text())
    return code, data, ET.parse(tmp_path / "junit.xml").getroot()


def test_every_status_is_reported_and_failures_set_the_exit_code(fake_matrix: list[Case], tmp_path: Path) -> None:
    code, data, junit = _run(tmp_path)
    assert code == 1
    status = {r["shape"]: r["status"] for r in data["results"]}
    assert status == {"ok": "pass", "bad": "fail", "skip": "not_run", "boom": "error"}
    by_shape = {r["shape"]: r for r in data["results"]}
    assert by_shape["skip"]["reason"] == "needs a GPU"
    assert "RuntimeError: kernel exploded" in by_shape["boom"]["reason"]
    check = by_shape["bad"]["checks"][0]
    assert check == {"name": "calc_diff", "tier": "end_to_end", "metric": "calc_diff", "value": 5e-3,
                     "bound": 1e-3, "passed": False, "detail": "on reference"}
    assert set(data["header"]) >= {"hardware", "versions", "date", "git_commit"}
    counts = (junit.get("tests"), junit.get("failures"), junit.get("errors"), junit.get("skipped"))
    assert counts == ("4", "1", "1", "1")
    cases_xml = {tc.get("name").split("[")[1].split(",")[1]: tc for tc in junit.iter("testcase")}
    assert cases_xml["skip"].find("skipped").get("message") == "not run: needs a GPU"
    assert cases_xml["bad"].find("failure") is not None and cases_xml["boom"].find("error") is not None


def test_not_run_alone_is_not_a_failure(fake_matrix: list[Case], tmp_path: Path) -> None:
    code, data, _ = _run(tmp_path, "--shapes", "ok,skip")
    assert code == 0
    assert sorted(r["status"] for r in data["results"]) == ["not_run", "pass"]


def test_shape_filter_takes_globs_and_substrings() -> None:
    assert report.shape_matches("b=128,h=8", ["b=1*"]) and report.shape_matches("b=128,h=8", ["h=8"])
    assert not report.shape_matches("b=128,h=8", ["b=1"+"?,*"]) and report.shape_matches("x", None)


def test_unknown_backend_op_or_config_is_a_usage_error(fake_matrix: list[Case], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--backends", "cuda"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["--config", "ULTRA"])
    assert cli.main(["--suites", "parity", "--ops", "no_such_op", "--out", str(tmp_path)]) == 2


def test_unavailable_backend_is_reported_not_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    case = Case("fake_op", "TINY", "x", "e4m3fn", 0, "cpu", lambda b: [], backends=("deepgemm",))
    monkeypatch.setattr(cases, "OP_MODULES", ())
    monkeypatch.setattr(cases, "_PROVIDERS", {"fake_op": lambda config, device: [case]})
    monkeypatch.setattr(report, "unavailable", lambda backend, op: f"backend {backend!r} unavailable: no GPU")
    code, data, _ = _run(tmp_path)
    assert code == 0 and data["results"][0]["status"] == "not_run"
    assert data["results"][0]["reason"] == "backend 'deepgemm' unavailable: no GPU"


def test_a_suite_that_cannot_be_collected_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cases, "OP_MODULES", ("parity_tests.ops.no_such_module",))
    code, data, _ = _run(tmp_path)
    assert code == 1
    assert data["results"][0]["status"] == "error" and "no_such_module" in data["results"][0]["reason"]


def _result(shape: str, status: str, value: float) -> report.Result:
    check = report.CheckRecord("calc_diff", "end_to_end", "calc_diff", value, 1e-3, value <= 1e-3)
    return report.Result("parity", "fake_op", "TINY", shape, "e4m3fn", 0, "triton", status, (check,))


def test_compare_reports_regressions_past_the_threshold(tmp_path: Path) -> None:
    old = [_result("a", "pass", 1e-4), _result("b", "pass", 1e-4), _result("c", "pass", 5e-4),
           _result("d", "pass", 1e-4)]
    new = [_result("a", "pass", 1.5e-4), _result("b", "pass", 4e-4), _result("c", "fail", 2e-3),
           _result("e", "pass", 0.0)]
    header = report.make_header([])
    report.write_json(tmp_path / "old.json", old, header)
    report.write_json(tmp_path / "new.json", new, header)
    cmp = report.compare(report.read_json(tmp_path / "old.json")[1], report.read_json(tmp_path / "new.json")[1],
                         threshold=0.1)
    kinds = {(c.key[3], c.kind) for c in cmp.changes}
    # a: +0.05 of the bound (under the threshold); b: +0.3 (worse); c: regressed and worse; d: gone; e: new
    assert kinds == {("b", "worse"), ("c", "regressed"), ("c", "worse"), ("d", "lost"), ("e", "new")}
    worse_b = next(c for c in cmp.changes if c.key[3] == "b")
    assert worse_b.growth == pytest.approx(0.3)
    assert cli.main(["--compare", str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 1
    assert cli.main(["--compare", str(tmp_path / "old.json"), str(tmp_path / "old.json")]) == 0


def test_json_report_round_trips_non_finite_values(tmp_path: Path) -> None:
    results = [_result("nan", "fail", float("nan")), _result("inf", "fail", float("inf"))]
    report.write_json(tmp_path / "r.json", results, {"x": 1})
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    _, back = report.read_json(tmp_path / "r.json")
    assert [r.checks[0].value for r in back][1] == float("inf") and back[0].checks[0].value != back[0].checks[0].value


def test_module_entry_point_lists_tasks_without_running_them() -> None:
    out = subprocess.run([sys.executable, "-m", "parity_tests", "--list", "--suites", "bad_input", "--no-progress"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bad_input" in out.stdout
