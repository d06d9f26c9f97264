"""CUDA graphs: the decode paths of the optimized ops make no host synchronization, can be captured in a
`torch.cuda.CUDAGraph`, and replay with the eager result bit for bit (needs a GPU; on a CPU `dsv4-parity`
reports these cases as not run, which `test_cuda_graph_cases_are_reported_not_run_without_a_gpu` checks)."""

from __future__ import annotations

import pytest
import torch

from optimized.backends import backend_status, checking_values, host_sync
from parity_tests import invariance, probes
from parity_tests.cases import NotRun
from parity_tests.probes import Probe

GPU = torch.cuda.is_available()
DECODE = [p for p in probes.all_probes("FLASH", "cuda") if p.decode] if GPU else []


@pytest.mark.skipif(not GPU, reason="CUDA-graph capture needs a GPU")
@pytest.mark.parametrize("backend", ("triton", "deepgemm"))
@pytest.mark.parametrize("probe", DECODE, ids=lambda p: p.id)
def test_decode_path_is_captured_and_replays_equal_to_eager(probe: Probe, backend: str) -> None:
    ok, why = backend_status(backend)
    if not ok:
        pytest.skip(f"backend {backend!r} unavailable: {why}")
    try:
        checks = invariance.check_cuda_graph(probe, backend, "cuda")
    except NotRun as exc:
        pytest.skip(str(exc))
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    assert not failed, failed
    assert {c.name for c in checks} >= {"no_host_sync", "graph_replay_equals_eager"}


@pytest.mark.skipif(not GPU, reason="sync-debug mode needs a GPU")
def test_host_sync_names_a_device_read_and_passes_a_pure_kernel() -> None:
    x = torch.ones(4, device="cuda")
    assert host_sync(lambda: x * 2) is None
    assert host_sync(lambda: x.sum().item()) is not None
    seen = []
    host_sync(lambda: seen.append(checking_values(x)))
    assert seen == [False] and checking_values(x)  # value checks off inside, as under capture; restored after


def test_decode_paths_of_moe_and_attention_are_in_the_suite() -> None:
    decode_ops = {p.op for p in probes.all_probes("FLASH", "cuda") if p.decode}
    assert {"moe", "attention", "sparse_attention"} <= decode_ops


@pytest.mark.skipif(GPU, reason="checks the CPU report")
def test_cuda_graph_cases_are_reported_not_run_without_a_gpu() -> None:
    probe = next(p for p in probes.all_probes("TINY", "cpu") if p.decode)
    with pytest.raises(NotRun, match="needs a GPU"):
        invariance.check_cuda_graph(probe, "triton", "cpu")


def test_new_inputs_are_copied_into_the_captured_buffers_only_when_everything_else_matches() -> None:
    a = {"x": torch.zeros(3), "pair": (torch.zeros(2), torch.ones(2)), "n": 4}
    b = {"x": torch.arange(3.0), "pair": (torch.ones(2), torch.zeros(2)), "n": 4}
    assert invariance._copy_into(a, b) and torch.equal(a["x"], b["x"]) and torch.equal(a["pair"][0], b["pair"][0])
    assert not invariance._copy_into(a, {**b, "n": 5})  # Python-side state differs: no replay on it
    assert not invariance._copy_into(a, {**b, "x": torch.zeros(4)})  # shapes differ
