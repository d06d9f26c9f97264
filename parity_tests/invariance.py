"""Determinism, batch invariance and CUDA-graph capture, per backend, over the probes of `probes.py`.

* determinism: the same inputs twice give bitwise-equal outputs (spec §7.1 pitfall 15), unless the
  backend registered the op with `deterministic=False` (then the case is "not run: <its note>").
* batch invariance: a probe's outputs do not change, bit for bit, when other tokens / sequences are put
  in the same call (`Probe.join`): no split-K, tile shape or reduction order that depends on the batch
  (unless the capability table's note declares the op "not batch-invariant", with the reason).
* CUDA graphs: a decode-path probe makes no host synchronization (`torch.cuda.set_sync_debug_mode`; the value checks,
  which read the device by design and are skipped under capture, switched off),
  can be captured in a `torch.cuda.CUDAGraph`, and the replay gives the eager result bit for bit; a
  second replay after copying new inputs into the captured buffers gives their eager result. Needs a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from optimized.backends import BACKENDS, host_sync
from parity_tests.cases import Check, NotRun
from parity_tests.probes import Probe, all_probes, as_tensors, bitwise_mismatches
from parity_tests.report import Task, shape_matches
from parity_tests.tolerances import BITWISE


def _mismatches(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, str]:
    if len(a) != len(b):
        return max(len(a), len(b)), f"{len(a)} vs {len(b)} outputs"
    counts = [bitwise_mismatches(x, y) for x, y in zip(a, b)]
    total = sum(x.numel() for x in a)
    return sum(counts), f"{sum(counts)} of {total} elements differ over {len(a)} outputs"


# The capability table's note that waives the batch-invariance claim (the registry has one `deterministic` flag,
# for reruns; owners say "rerun-deterministic, not batch-invariant (<why>)" in the note when tiles or split-K
# follow the batch).
NOT_BATCH_INVARIANT = "not batch-invariant"


def _require_deterministic(probe: Probe, backend: str, batch: bool = False) -> None:
    from optimized.backends import registry

    impl = registry().get(probe.op, {}).get(backend)
    if impl is not None and not impl.deterministic:
        raise NotRun(f"{backend} registers {probe.op} as non-deterministic ({impl.note or 'no reason given'})")
    if batch and impl is not None and NOT_BATCH_INVARIANT in impl.note:
        raise NotRun(f"{backend} declares {probe.op} not batch-invariant in the capability table: {impl.note}")


@functools.lru_cache(maxsize=1)
def _first_run(probe: Probe, backend: str, device: str) -> tuple[torch.Tensor, ...]:
    """The probe's outputs on its own inputs, shared by the determinism and batch checks of one probe (they run
    back to back; the Triton interpreter makes every call count)."""
    return tuple(t.clone() for t in probe.run(backend, device))


def _require_shape_fits(probe: Probe, device: str) -> None:
    if probe.config != "TINY" and torch.device(device).type == "cpu":
        raise NotRun(f"{probe.config}-shaped probes run on a GPU (device cuda), not {device}")


def check_rerun(probe: Probe, backend: str, device: str) -> list[Check]:
    """The same inputs twice (built afresh each time, so stateful calls start equal): bitwise equal."""
    _require_shape_fits(probe, device)
    probe.require(backend)
    _require_deterministic(probe, backend)
    first = list(_first_run(probe, backend, device))
    second = probe.run(backend, device)
    n, detail = _mismatches(first, second)
    return [Check("rerun_bitwise_equal", BITWISE, n, detail)]


def check_batch(probe: Probe, backend: str, device: str) -> list[Check]:
    """The probe alone vs the probe joined with other tokens / sequences: its outputs bitwise equal."""
    if probe.join is None:
        raise NotRun(f"{probe.op} has no batch dimension")
    _require_shape_fits(probe, device)
    probe.require(backend)
    _require_deterministic(probe, backend, batch=True)
    alone = list(_first_run(probe, backend, device))
    joined, extract = probe.join(probe.make(device, 0), probe.make(device, 1))
    together = as_tensors(extract(probe.call(probe.ready(joined, backend), backend)))
    n, detail = _mismatches(alone, together)
    return [Check("batch_invariant_bitwise_equal", BITWISE, n, detail)]


def _copy_into(static: object, fresh: object) -> bool:
    """Copy every tensor of `fresh` into the same place in `static` (dicts, sequences, dataclasses, plain
    objects); False when the two differ in anything but tensor values (then nothing is guaranteed)."""
    if isinstance(static, torch.Tensor):
        if not isinstance(fresh, torch.Tensor) or fresh.shape != static.shape or fresh.dtype != static.dtype:
            return False
        static.copy_(fresh)
        return True
    if isinstance(static, dict):
        return (isinstance(fresh, dict) and static.keys() == fresh.keys()
                and all(_copy_into(static[k], fresh[k]) for k in static))
    if isinstance(static, (list, tuple)):
        return (type(static) is type(fresh) and len(static) == len(fresh)
                and all(_copy_into(s, f) for s, f in zip(static, fresh)))
    if dataclasses.is_dataclass(static) and not isinstance(static, type):
        return type(static) is type(fresh) and all(
            _copy_into(getattr(static, f.name), getattr(fresh, f.name)) for f in dataclasses.fields(static))
    if hasattr(static, "__dict__") and not callable(static):
        return type(static) is type(fresh) and _copy_into(vars(static), vars(fresh))
    return bool(static == fresh)


def check_cuda_graph(probe: Probe, backend: str, device: str) -> list[Check]:
    """No host sync in an eager call; capture, replay == eager; new inputs copied in, replay == their eager."""
    if device != "cuda" or not torch.cuda.is_available():
        raise NotRun("CUDA-graph capture needs a GPU (torch.cuda.is_available() is False)")
    probe.require(backend)
    eager = [t.clone() for t in probe.run(backend, device)]  # also compiles every kernel (warm-up)
    torch.cuda.synchronize()

    inputs = probe.inputs(backend, device, 0)
    # The value checks (index ranges, token ids) read the device by design and are skipped under capture;
    # what must not sync is the op itself.
    sync = host_sync(lambda: probe.call(inputs, backend))
    syncs, sync_detail = (0, "no synchronizing call") if sync is None else (1, f"host synchronization: {sync}")
    checks = [Check("no_host_sync", BITWISE, syncs, sync_detail)]
    if syncs:
        return checks  # a call that reads the device back cannot be captured: capture not attempted

    static = probe.inputs(backend, device, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
        probe.run(backend, device)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = as_tensors(probe.call(static, backend))
    except RuntimeError as exc:
        return [*checks, Check("graph_capture", BITWISE, 1, f"capture failed: {exc}")]
    graph.replay()
    torch.cuda.synchronize()
    n, detail = _mismatches(eager, captured)
    checks.append(Check("graph_replay_equals_eager", BITWISE, n, detail))

    fresh = probe.inputs(backend, device, 2)
    if _copy_into(static, fresh):  # stateless calls: replay on new data in the same buffers
        expect = [t.clone() for t in probe.run(backend, device, variant=2)]
        graph.replay()
        torch.cuda.synchronize()
        n, detail = _mismatches(expect, captured)
        checks.append(Check("graph_replay_new_inputs_equals_eager", BITWISE, n, detail))
    return checks


# suite -> (check, which probes it applies to, which backends)
SUITES: dict[str, tuple[Callable[[Probe, str, str], list[Check]], Callable[[Probe], bool], tuple[str, ...]]] = {
    "determinism": (check_rerun, lambda p: True, BACKENDS),
    "batch_invariance": (check_batch, lambda p: p.join is not None, BACKENDS),
    # the reference is free to synchronize (it is eager PyTorch); the claim is about the optimized backends
    "cuda_graph": (check_cuda_graph, lambda p: p.decode, ("triton", "deepgemm")),
}


def tasks(suites: list[str], configs: list[str], device: str, ops: list[str] | None, backends: list[str] | None,
          shapes: list[str] | None) -> list[Task]:
    """The tasks of `suites` (of SUITES), probe by probe and backend by backend, so that the checks of one probe
    on one backend run back to back (they share its first run)."""
    out = []
    for config in configs:
        for probe in all_probes(config, device, ops):
            if not probe.invariance or not shape_matches(probe.shape, shapes):
                continue
            for backend in BACKENDS:
                if backends is not None and backend not in backends:
                    continue
                for suite in suites:
                    check, keep, candidates = SUITES[suite]
                    if keep(probe) and backend in candidates:
                        out.append(Task(suite, probe.op, probe.config, probe.shape, probe.fmt, probe.seed, backend,
                                        functools.partial(check, probe, backend, device), registry_op=probe.op))
    return out
