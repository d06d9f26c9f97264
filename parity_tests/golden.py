"""Golden results: the reference's outputs for fixed seeds, stored small, and the check that it has not drifted.

For every probe marked `golden` (TINY shapes and a few FLASH shapes), `parity_tests/golden/<op>.json`
holds, per output tensor: shape, dtype, counts of NaN / +inf / -inf, mean, mean |x| and RMS (fp64 over
the whole tensor), the amax, and 128 values at fixed pseudo-random positions. `check` re-runs the
reference on the CPU and compares with the bounds `GOLDEN_STATS`, `GOLDEN_VALUES` and `GOLDEN_MOVED`
of `tolerances.py` (their derivation is written there): any change to the reference's math shows up,
a different BLAS summation order does not. `dsv4-parity --golden update` re-records the files after a
deliberate change (review the diff of `parity_tests/golden/` in the same commit).

Platform. A file records the platform it was made on: CPU architecture, torch's CPU kernel class (SIMD or
scalar) and torch's major.minor version. On x86-64, thread count, AVX2 vs AVX-512 and MKL's instruction
set give bit-identical reference outputs (measured); torch's scalar kernels, another architecture or
another torch release round some fp32 transcendentals and sums differently, and the reference's FP8
re-quantizations amplify one such flip into changes past the golden bound (measured: calc_diff 2e-5 on the
FP8 output projection). On such a platform the golden check reports "not run" with the reason; the CPU CI
(the recording platform) is where it gates.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import zlib
from pathlib import Path
from typing import Any

import torch

from parity_tests.cases import Check, NotRun
from parity_tests.probes import Probe, all_probes
from parity_tests.report import Task, shape_matches
from parity_tests.tolerances import BITWISE, GOLDEN_MOVED, GOLDEN_STATS, GOLDEN_VALUES

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
GOLDEN_CONFIGS = ("TINY", "FLASH")  # FLASH probes are recorded only where they are marked golden
N_SAMPLES = 128
GOLDEN_DEVICE = "cpu"  # the reference is recorded and checked on the CPU, on every machine
_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10,
                  torch.float8_e4m3fn: 3, torch.float8_e4m3fnuz: 3}


def _float(x: float | str) -> float:
    return float(x)


def _enc(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def golden_probes(ops: list[str] | None = None) -> list[Probe]:
    """Every probe recorded in the golden files."""
    return [p for config in GOLDEN_CONFIGS for p in all_probes(config, GOLDEN_DEVICE, ops) if p.golden]


def entry_key(probe: Probe) -> str:
    return f"{probe.config}/{probe.shape}/{probe.fmt}/seed={probe.seed}"


def _sample_positions(key: str, numel: int) -> list[int]:
    """N_SAMPLES fixed positions (all of them for small tensors), from a generator seeded by the entry key."""
    if numel <= N_SAMPLES:
        return list(range(numel))
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return sorted(torch.randperm(numel, generator=g)[:N_SAMPLES].tolist())


def summarize(t: torch.Tensor, key: str) -> dict[str, Any]:
    """The stored summary of one output tensor."""
    t = t.detach().cpu()
    flat = t.reshape(-1).double()
    finite = flat[flat.isfinite()]
    positions = _sample_positions(key, flat.numel())
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "nan": int(flat.isnan().sum()),
        "posinf": int(flat.isposinf().sum()),
        "neginf": int(flat.isneginf().sum()),
        "mean": float(finite.mean()) if finite.numel() else 0.0,
        "mean_abs": float(finite.abs().mean()) if finite.numel() else 0.0,
        "rms": float(finite.square().mean().sqrt()) if finite.numel() else 0.0,
        "amax": float(finite.abs().max()) if finite.numel() else 0.0,
        "positions": positions,
        "values": [_enc(float(flat[i])) for i in positions],
    }


def _ulp(value: float, dtype: torch.dtype) -> float:
    """One unit in the last place of `dtype` at |value| (0 for integer dtypes)."""
    bits = _MANTISSA_BITS.get(dtype)
    if bits is None:
        return 0.0
    finfo = torch.finfo(dtype)
    exponent = math.floor(math.log2(max(abs(value), finfo.smallest_normal)))
    return 2.0 ** (exponent - bits)


def compare_summary(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """metric name -> (value, detail) for one output: structure mismatches, stats error, values error, moved."""
    structure = [k for k in ("shape", "dtype", "nan", "posinf", "neginf", "positions") if old[k] != new[k]]
    if structure:
        detail = "; ".join(f"{k}: golden {old[k]} now {new[k]}" for k in structure if k != "positions")
        return {"structure": (len(structure), detail or "sample positions differ")}
    dtype = getattr(torch, old["dtype"])
    rms = _float(old["rms"])
    scale = rms if rms > 0 else 1.0
    stats = {k: abs(_float(new[k]) - _float(old[k])) / scale for k in ("mean", "mean_abs", "rms")}
    worst_stat = max(stats, key=stats.__getitem__)
    floor = 1e-5 * rms if dtype.is_floating_point else 0.0  # integer outputs (indices) must match exactly

    def units(a: float, b: float) -> float:
        if a == b or (math.isnan(a) and math.isnan(b)):
            return 0.0
        tol = max(_ulp(a, dtype), floor)
        return math.inf if tol == 0 or not math.isfinite(b - a) else abs(b - a) / tol

    pairs = [(_float(a), _float(b)) for a, b in zip(old["values"], new["values"])]
    sample_units = [units(a, b) for a, b in pairs]
    amax_units = units(_float(old["amax"]), _float(new["amax"]))
    worst = max([*sample_units, amax_units, 0.0])
    moved = sum(u >= 0.5 for u in sample_units)
    return {
        "structure": (0, "shape, dtype, non-finite counts equal"),
        "stats": (stats[worst_stat], f"worst {worst_stat}: golden {old[worst_stat]} now {new[worst_stat]}"),
        "values": (worst, f"largest move {worst:.3g} tol over {len(pairs)} samples and amax"),
        "moved": (moved / max(len(pairs), 1), f"{moved} of {len(pairs)} sampled values moved"),
    }


def current_platform() -> dict[str, str]:
    """What decides whether this machine reproduces the reference bit for bit (see the module docstring)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"machine": platform.machine(), "cpu_kernels": "scalar" if capability == "DEFAULT" else "simd",
            "torch": ".".join(torch.__version__.split(".")[:2])}


def _path(op: str) -> Path:
    return GOLDEN_DIR / f"{op}.json"


def _load(op: str) -> dict[str, Any]:
    """The file of `op` ({} when there is none)."""
    path = _path(op)
    return json.loads(path.read_text()) if path.exists() else {}


def _dump(op: str, entries: dict[str, Any]) -> str:
    """The file text: one line per output summary, so a diff shows which output of which entry changed."""
    bounds = {b.metric: b.value for b in (GOLDEN_STATS, GOLDEN_VALUES, GOLDEN_MOVED)}
    lines = ["{", f' "op": {json.dumps(op)},',
             ' "about": "reference outputs for fixed seeds (summary + sampled values); see parity_tests/golden.py",',
             f' "platform": {json.dumps(current_platform())},', f' "bounds": {json.dumps(bounds)},', ' "entries": {']
    keys = sorted(entries)
    for i, key in enumerate(keys):
        outputs = entries[key]["outputs"]
        lines.append(f'  {json.dumps(key)}: {{"outputs": [')
        lines += [f"   {json.dumps(o, allow_nan=False)}{',' if j < len(outputs) - 1 else ''}"
                  for j, o in enumerate(outputs)]
        lines.append(f"  ]}}{',' if i < len(keys) - 1 else ''}")
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def record(probe: Probe) -> dict[str, Any]:
    """The golden entry of `probe`: the reference's outputs, summarized."""
    key = entry_key(probe)
    outputs = probe.run("reference", GOLDEN_DEVICE)
    return {"outputs": [summarize(t, f"{key}#{i}") for i, t in enumerate(outputs)]}


def check(probe: Probe) -> list[Check]:
    """The reference now vs its golden entry (NotRun on a platform other than the recording one)."""
    doc = _load(probe.op)
    stored = doc.get("entries", {}).get(entry_key(probe))
    if stored is None:
        raise LookupError(f"no golden entry {entry_key(probe)!r} in {_path(probe.op)}; record it with "
                          "`python -m parity_tests --golden update` and commit the file")
    here = current_platform()
    if doc["platform"] != here:
        raise NotRun(f"golden results were recorded on {doc['platform']}, this is {here}: other fp32 kernels "
                     "round differently and FP8 re-quantization amplifies that past the golden bound; the "
                     "recording platform (the CPU CI) checks them")
    now = record(probe)
    if len(now["outputs"]) != len(stored["outputs"]):
        return [Check("golden_structure", BITWISE, 1,
                      f"golden has {len(stored['outputs'])} outputs, the reference now {len(now['outputs'])}")]
    per_output = [compare_summary(o, n) for o, n in zip(stored["outputs"], now["outputs"])]
    checks = []
    for metric, bound in (("structure", BITWISE), ("stats", GOLDEN_STATS), ("values", GOLDEN_VALUES),
                          ("moved", GOLDEN_MOVED)):
        measured = [(i, m[metric]) for i, m in enumerate(per_output) if metric in m]
        if not measured:
            continue
        i, (value, detail) = max(measured, key=lambda item: item[1][0])
        checks.append(Check(f"golden_{metric}", bound, value, f"output {i}: {detail}"))
    return checks


def tasks(ops: list[str] | None, shapes: list[str] | None) -> list[Task]:
    return [Task("golden", p.op, p.config, p.shape, p.fmt, p.seed, "reference", functools.partial(check, p))
            for p in golden_probes(ops) if shape_matches(p.shape, shapes)]


def update(ops: list[str] | None = None) -> list[str]:
    """Re-record every golden entry of `ops` (or of all ops) on this platform, dropping entries that no probe
    makes any more; returns one line per entry saying whether it changed."""
    lines = []
    by_op: dict[str, list[Probe]] = {}
    for p in golden_probes(ops):
        by_op.setdefault(p.op, []).append(p)
    GOLDEN_DIR.mkdir(exist_ok=True)
    for op, probes in by_op.items():
        old_entries = _load(op).get("entries", {})
        entries = {}
        for p in probes:
            new = record(p)
            old = old_entries.get(entry_key(p))
            state = "new" if old is None else "unchanged" if old == new else "CHANGED"
            entries[entry_key(p)] = new
            lines.append(f"golden {state:9s} {op} {entry_key(p)}")
        _path(op).write_text(_dump(op, entries))
    return lines
