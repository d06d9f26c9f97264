"""Every entry of the bad-input corpus (`bad_inputs.CORPUS`) behaves as documented: the exact error type with
its message fragment, raised before any kernel, or the defined output (checked on every backend)."""

from __future__ import annotations

import pytest
import torch

from optimized.backends import backend_status, registry
from parity_tests import bad_inputs
from parity_tests.bad_inputs import CATEGORIES, CORPUS, BadInput
from parity_tests.cases import NotRun

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _params() -> list[object]:
    params = []
    for entry in CORPUS:
        for backend in bad_inputs.backends_for(entry):
            params.append(pytest.param(entry, backend, id=f"{entry.id}[{backend}]"))
    return params


@pytest.mark.parametrize(("entry", "backend"), _params())
def test_bad_input_behaves_as_documented(entry: BadInput, backend: str) -> None:
    ok, why = backend_status(backend)
    if not ok:
        pytest.skip(f"backend {backend!r} unavailable: {why}")
    try:
        [result] = bad_inputs.check(entry, backend, DEVICE)
    except NotRun as exc:
        pytest.skip(str(exc))
    assert result.passed, result.detail


def test_corpus_covers_every_public_op_and_category() -> None:
    """At least 40 entries; every optimized op and every category of malformed call has some."""
    assert len(CORPUS) >= 40
    assert {e.category for e in CORPUS} == set(CATEGORIES)
    assert set(registry()) <= {e.op for e in CORPUS}
