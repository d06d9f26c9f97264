"""The case matrix: op x config x shape x FP8 format x seed, and the registry the op modules fill.

Each op module in `parity_tests/ops/` registers a provider with `@provider("op_name")`: a function
`(config_name, device) -> list[Case]`. A `Case` knows how to run itself for one backend and returns
its `Check`s; a case that cannot run on this hardware raises `NotRun(reason)`, which reports show as
"not run: <reason>" (never silently skipped).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from parity_tests.tolerances import Bound

# The op modules whose providers make up the matrix, in report order.
OP_MODULES = ("parity_tests.ops.einsum", "parity_tests.ops.moe", "parity_tests.ops.attention")

# Decode and prefill token counts of the GPU matrix; TINY uses small ones of its own.
DECODE_TOKENS = (1, 8, 64, 128)
PREFILL_TOKENS = (512, 4096, 8192)
FP8_FORMATS = ("e4m3fn", "e4m3fnuz")
# Where the TINY cases run: the GPU when there is one (Triton compiles for it), else the CPU (interpreter).
TINY_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class NotRun(Exception):
    """A case that cannot run here; the message is the reason."""


@dataclass(frozen=True)
class Check:
    """One measured quantity against one bound."""

    name: str
    bound: Bound
    value: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.bound.passes(self.value)


@dataclass(frozen=True)
class Case:
    """One parity case.

    Attributes:
        op: public op name ("fp8_einsum").
        config: "TINY", "FLASH" or "PRO".
        shape: a short label of the shape ("b=128,h=8").
        fmt: FP8 format ("e4m3fn" / "e4m3fnuz").
        seed: the RNG seed of the inputs.
        device: "cpu" or "cuda".
        run: backend name -> checks (raises NotRun).
        backends: which backends this case compares against the reference.
        params: anything else the runner needs (for filters and reports).
    """

    op: str
    config: str
    shape: str
    fmt: str
    seed: int
    device: str
    run: Callable[[str], list[Check]] = field(compare=False, repr=False)
    backends: tuple[str, ...] = ("triton", "deepgemm")
    params: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def id(self) -> str:
        return f"{self.op}[{self.config},{self.shape},{self.fmt}]"


Provider = Callable[[str, str], list[Case]]
_PROVIDERS: dict[str, Provider] = {}


def provider(op: str) -> Callable[[Provider], Provider]:
    """Register the case provider of `op`."""

    def wrap(fn: Provider) -> Provider:
        _PROVIDERS[op] = fn
        return fn

    return wrap


def providers() -> dict[str, Provider]:
    """op -> provider, after importing every op module."""
    for module in OP_MODULES:
        importlib.import_module(module)
    return dict(_PROVIDERS)


def all_cases(config: str, device: str, ops: list[str] | None = None) -> list[Case]:
    """Every case of `config` on `device`, optionally only for `ops`."""
    found = providers()
    unknown = sorted(set(ops or ()) - set(found))
    if unknown:
        raise ValueError(f"ops: unknown {unknown}; known: {sorted(found)}")
    return [case for op, make in found.items() if not ops or op in ops for case in make(config, device)]


def require(device: str, fmt: str, backend: str) -> None:
    """Raise `NotRun` when this machine or `backend` cannot run a case on `device` in FP8 format `fmt`."""
    from optimized.backends import backend_status, device_status

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise NotRun("needs a GPU")
    ok, why = backend_status(backend)
    if not ok:
        raise NotRun(why)
    ok, why = device_status(backend, torch.device(device))
    if not ok:
        raise NotRun(f"a {device} case: {why}")
    if backend == "deepgemm" and fmt != "e4m3fn":
        raise NotRun("DeepGEMM supports e4m3fn only")
    if (backend == "triton" and fmt == "e4m3fnuz" and torch.device(device).type == "cuda"
            and torch.version.hip is None):
        raise NotRun("Triton has no e4m3fnuz (gfx942's format) on NVIDIA GPUs")


def generator(seed: int, device: str = "cpu") -> torch.Generator:
    """A seeded CPU generator (inputs are drawn on the CPU and moved, so every device sees the same data)."""
    del device
    return torch.Generator().manual_seed(seed)
