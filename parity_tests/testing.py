"""pytest helpers shared by the parity test files."""

from __future__ import annotations

import pytest

from parity_tests.cases import Case, NotRun


def assert_case_passes(case: Case, backend: str) -> None:
    """Run `case` on `backend`: skip with the reason when it cannot run here, fail listing every failed check."""
    try:
        checks = case.run(backend)
    except NotRun as exc:
        pytest.skip(f"not run: {exc}")
    failed = [f"{c.name}: {c.value:.3g} > {c.bound.value:g} ({c.bound.tier}: {c.bound.reason}) {c.detail}"
              for c in checks if not c.passed]
    assert not failed, f"{case.id} on {backend}:\n" + "\n".join(failed)
