"""The bad-input corpus: malformed calls of the public API and what each must do.

Every entry is one malformed call (wrong dtype, shape, device, layout, scale layout, FP8 format, empty
tensors, NaN / Inf inputs, out-of-range positions and indices, an unsupported backend) with either the
exact error type and a fragment of its message (the argument's name and what was expected), or the
output the API defines for it (NaN confined to the token that carried it, say). Errors must come from
the public function's checks, before any kernel launch; `test_bad_inputs.py` runs every entry, and the
CLI runs the corpus as the `bad_input` suite.

Entries that expect an error run once, through the best available backend (validation happens before
dispatch, so every backend shares it). Entries with a defined output run on every backend, since the
output comes from the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from parity_tests.cases import Check
from parity_tests.report import Task
from parity_tests.tolerances import BAD_INPUT_CONTRACT

CATEGORIES = ("dtype", "shape", "device", "layout", "scale_layout", "fp8_format", "empty", "nonfinite", "range",
              "backend", "value")


@dataclass(frozen=True)
class BadInput:
    """One malformed call.

    Attributes:
        id: unique name ("fp8_einsum/a_not_fp8").
        op: the public op it calls (a registry op name, or the reference helper's name).
        category: one of CATEGORIES.
        call: (backend, device) -> output; builds its inputs on `device`.
        raises: the exact exception type expected (subclasses do not count), or None for a defined output.
        match: a fragment the message must contain.
        expect: for a defined output: output -> None when it is as documented, else what is wrong.
    """

    id: str
    op: str
    category: str
    call: Callable[[str | None, str], Any]
    raises: type[Exception] | None = None
    match: str = ""
    expect: Callable[[Any], str | None] | None = None

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category: expected one of {CATEGORIES}, got {self.category!r}")
        if (self.raises is None) == (self.expect is None):
            raise ValueError(f"{self.id}: give exactly one of raises / expect")

    @property
    def per_backend(self) -> bool:
        """A defined output comes from the kernel, so it is checked on every backend."""
        return self.expect is not None


def violation(entry: BadInput, backend: str | None, device: str) -> str | None:
    """None when the call behaves as the entry says, else what it did instead."""
    try:
        out = entry.call(backend, device)
    except Exception as exc:
        if entry.raises is None:
            return f"raised {type(exc).__name__}: {exc}; expected a defined output"
        if type(exc) is not entry.raises:
            return f"raised {type(exc).__name__}: {exc}; expected {entry.raises.__name__} ({entry.match!r})"
        if entry.match not in str(exc):
            return f"{type(exc).__name__} message {str(exc)!r} lacks {entry.match!r}"
        return None
    if entry.raises is not None:
        return f"returned normally; expected {entry.raises.__name__} ({entry.match!r})"
    assert entry.expect is not None
    return entry.expect(out)


def check(entry: BadInput, backend: str | None, device: str) -> list[Check]:
    problem = violation(entry, backend, device)
    expected = (f"{entry.raises.__name__}: ...{entry.match}..." if entry.raises is not None
                else "the defined output")
    return [Check(f"bad_input/{entry.category}", BAD_INPUT_CONTRACT, int(problem is not None),
                  problem or f"as documented: {expected}")]


# ------------------------------------------------------------------------------------------------
# helpers for building entries
# ------------------------------------------------------------------------------------------------


def other_device(device: str) -> str:
    """A device the op's other tensors are not on: "meta" on a CPU-only machine, the CPU on a GPU one."""
    return "meta" if device == "cpu" else "cpu"


def nan_confined_to_rows(rows: list[int], dim: int = 0) -> Callable[[Any], str | None]:
    """Expectation: every output tensor is NaN-free outside index `rows` of `dim` (tokens), and each row in
    `rows` holds at least one NaN in the first output."""

    def expect(out: Any) -> str | None:
        from parity_tests.probes import as_tensors

        tensors = [t for t in as_tensors(out) if t.is_floating_point()]
        if not tensors:
            return "no floating-point output"
        for i, t in enumerate(tensors):
            bad = ~t.float().isfinite()
            other = bad.clone()
            other.index_fill_(dim, torch.tensor(rows, device=t.device), False)
            if bool(other.any()):
                where = other.nonzero()[0].tolist()
                return f"output {i}: a non-finite value outside rows {rows} (at {where})"
        first = ~tensors[0].float().isfinite()
        flagged = first.index_select(dim, torch.tensor(rows, device=first.device))
        if not bool(flagged.flatten(1).any(dim=1).all() if flagged.dim() > 1 else flagged.all()):
            return f"rows {rows} carry NaN in but none out"
        return None

    return expect


def all_finite(out: Any) -> str | None:
    """Expectation: every floating-point output is finite."""
    from parity_tests.probes import as_tensors

    for i, t in enumerate(as_tensors(out)):
        if t.is_floating_point() and not bool(t.float().isfinite().all()):
            return f"output {i} has non-finite values"
    return None


def empty_output(shape: tuple[int, ...]) -> Callable[[Any], str | None]:
    """Expectation: the (first) output has exactly `shape` (an empty tensor)."""

    def expect(out: Any) -> str | None:
        from parity_tests.probes import as_tensors

        got = tuple(as_tensors(out)[0].shape)
        return None if got == shape else f"output shape {got}, expected {shape}"

    return expect


# ------------------------------------------------------------------------------------------------
# the corpus
# ------------------------------------------------------------------------------------------------


def _formats_entries() -> list[BadInput]:
    from reference import formats
    from reference.weights import Fp4Weight, Fp8Weight

    def fp8(shape: tuple[int, ...], device: str) -> torch.Tensor:
        return torch.zeros(shape, device=device).to(torch.float8_e4m3fn)

    return [
        BadInput("formats/unknown_fp8_format", "quantize_per_token", "fp8_format",
                 lambda b, d: formats.quantize_per_token(torch.ones(2, 128, device=d), 128, "e5m2"),
                 ValueError, "fmt: expected one of"),
        BadInput("formats/act_quant_block_does_not_divide", "quantize_per_token", "shape",
                 lambda b, d: formats.quantize_per_token(torch.ones(2, 100, device=d), 128),
                 ValueError, "x: last dim 100 is not a multiple of the block size 128"),
        BadInput("formats/fp8_weight_scale_shape", "Fp8Weight", "scale_layout",
                 lambda b, d: Fp8Weight(fp8((256, 256), d), torch.ones(2, 3, device=d)),
                 ValueError, "scale: expected shape (2, 2)"),
        BadInput("formats/fp8_weight_scale_dtype", "Fp8Weight", "scale_layout",
                 lambda b, d: Fp8Weight(fp8((256, 256), d), torch.ones(2, 2, device=d, dtype=torch.bfloat16)),
                 TypeError, "scale: expected float32"),
        BadInput("formats/fp8_weight_not_fp8", "Fp8Weight", "dtype",
                 lambda b, d: Fp8Weight(torch.ones(256, 256, device=d), torch.ones(2, 2, device=d)),
                 ValueError, "got torch.float32"),
        BadInput("formats/fp4_weight_packed_dtype", "Fp4Weight", "dtype",
                 lambda b, d: Fp4Weight(torch.zeros(4, 16, device=d, dtype=torch.uint8), torch.ones(4, 1, device=d)),
                 TypeError, "packed: expected int8"),
        BadInput("formats/e8m0_nan_byte", "ue8m0_to_fp32", "nonfinite",
                 lambda b, d: formats.ue8m0_to_fp32(torch.tensor([127, 255], dtype=torch.uint8, device=d)),
                 ValueError, "0xFF is NaN"),
        BadInput("formats/scale_not_power_of_two", "fp32_to_ue8m0", "value",
                 lambda b, d: formats.fp32_to_ue8m0(torch.tensor([0.75], device=d)),
                 ValueError, "positive power of two"),
        BadInput("formats/nan_block_confined_to_its_token", "quantize_per_token", "nonfinite",
                 lambda b, d: formats.quant_dequant_fp8(
                     torch.ones(3, 256, device=d).index_fill_(0, torch.tensor([1], device=d), float("nan")), 128),
                 expect=nan_confined_to_rows([1])),
    ]


def _backend_entries() -> list[BadInput]:
    from optimized import backends

    return [
        BadInput("backends/unknown_backend_name", "backend_status", "backend",
                 lambda b, d: backends.backend_status("cuda"), ValueError, "backend: expected one of"),
        BadInput("backends/unknown_op", "select", "backend",
                 lambda b, d: backends.select("no_such_op"), ValueError, "op: unknown op 'no_such_op'"),
    ]


def _corpus() -> list[BadInput]:
    entries = [*_formats_entries(), *_backend_entries()]
    ids = [e.id for e in entries]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"bad-input ids must be unique: {duplicates}")
    return entries


CORPUS: list[BadInput] = _corpus()


def backends_for(entry: BadInput) -> tuple[str, ...]:
    """Every backend that implements the op, for a defined output of a registered op; else the one backend a
    plain call would use here (reference for helpers outside the registry)."""
    from optimized.backends import registry, select

    impls = registry().get(entry.op)
    if impls is None:
        return ("reference",)
    if entry.per_backend:
        return tuple(impls)
    try:
        return (select(entry.op).backend,)
    except RuntimeError:  # nothing available: the task reports the reference as the fallback
        return ("reference",)


def tasks(device: str, ops: list[str] | None, backends: list[str] | None) -> list[Task]:
    out = []
    for e in CORPUS:
        if ops and e.op not in ops:
            continue
        for backend in backends_for(e):
            if backends is None or backend in backends or not e.per_backend:
                out.append(Task("bad_input", e.op, "-", e.id, e.category, 0, backend,
                                functools.partial(check, e, backend, device), registry_op=e.op))
    return out
