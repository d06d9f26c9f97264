"""Determinism and batch invariance per backend, on the TINY probes (spec §7.1 pitfall 15).

Every backend here: the same inputs twice give bitwise-equal outputs, and a sequence's outputs do not change
when other tokens / sequences join its batch (attention, MoE). A backend that registers an op as
non-deterministic is reported not run with its reason, by the same checks `dsv4-parity` runs. On the CPU the
Triton kernels run in the interpreter (the GPU's own tile choices are checked by the CLI on the GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from optimized.backends import backend_status
from parity_tests import invariance, probes
from parity_tests.cases import Check, NotRun
from parity_tests.probes import Probe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = "FLASH" if DEVICE == "cuda" else "TINY"
BACKENDS = ("reference", "triton", "deepgemm")


def _first_per_op(keep: bool | None = None) -> list[Probe]:
    """One probe per op (the first of its provider), so every op is covered at interpreter cost."""
    seen: dict[str, Probe] = {}
    for p in probes.all_probes(CONFIG, DEVICE):
        if p.invariance and p.op not in seen and (keep is None or (p.join is not None) == keep):
            seen[p.op] = p
    return list(seen.values())


def _run(check: Callable[[Probe, str, str], list[Check]], probe: Probe, backend: str) -> None:
    ok, why = backend_status(backend)
    if not ok:
        pytest.skip(f"backend {backend!r} unavailable: {why}")
    try:
        results = check(probe, backend, DEVICE)
    except NotRun as exc:
        pytest.skip(str(exc))
    failed = [f"{c.name}: {c.detail}" for c in results if not c.passed]
    assert not failed, failed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("probe", _first_per_op(), ids=lambda p: p.id)
def test_same_inputs_twice_give_bitwise_equal_outputs(probe: Probe, backend: str) -> None:
    _run(invariance.check_rerun, probe, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("probe", _first_per_op(keep=True), ids=lambda p: p.id)
def test_outputs_do_not_change_when_other_sequences_join_the_batch(probe: Probe, backend: str) -> None:
    _run(invariance.check_batch, probe, backend)


def test_batch_invariance_covers_attention_and_moe() -> None:
    assert {"attention", "sparse_attention", "moe"} <= {p.op for p in _first_per_op(keep=True)}


def test_a_changed_output_is_caught() -> None:
    """The bitwise comparison sees a single flipped bit, NaN payloads and the sign of zero."""
    x = torch.randn(64, dtype=torch.float32)
    y = x.clone()
    y.view(torch.int32)[7] ^= 1
    assert probes.bitwise_mismatches(x, y) == 1
    assert probes.bitwise_mismatches(torch.tensor([0.0]), torch.tensor([-0.0])) == 1
    assert probes.bitwise_mismatches(x.to(torch.float8_e4m3fn), x.to(torch.float8_e4m3fn)) == 0
    assert probes.bitwise_mismatches(x, x[:-1]) == 64
