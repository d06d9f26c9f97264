"""Backend detection, the registry of which backend implements which op, and backend selection.

Backends:
  * `triton`   — portable Triton kernels: ROCm (gfx942 e4m3fnuz, gfx950 e4m3fn), any CUDA GPU, and
                 the CPU through `TRITON_INTERPRET=1` (slow, exact enough for TINY shapes).
  * `deepgemm` — DeepGEMM kernels on NVIDIA SM90/SM100, with Triton glue for what DeepGEMM lacks
                 (each such op says so in the capability table).
  * `reference` — the eager PyTorch reference itself (always available; what parity compares to).

Selection: the `backend=` argument > the `DSV4_BACKEND` environment variable > the best available
backend for that op (deepgemm, then triton, then reference). Op modules register their
implementations with `register(...)` at import, by dotted path, so nothing heavy (triton,
deep_gemm) is imported until a kernel is actually called.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BACKENDS = ("deepgemm", "triton", "reference")


@dataclass(frozen=True)
class Hardware:
    """What this machine offers.

    Attributes:
        device: `"cuda"`, `"rocm"` or `"cpu"`.
        name: GPU name, or `"cpu"`.
        arch: `"sm90"`, `"sm100"`, `"gfx942"`, ... or `"cpu"`.
        triton: Triton version, or None when not importable.
        deep_gemm: DeepGEMM version, or None when not importable (or not an NVIDIA GPU).
        deep_gemm_error: why DeepGEMM is unavailable, when it is.
        interpret: `TRITON_INTERPRET=1` is set (Triton kernels run on the CPU interpreter).
        fp8_format: the FP8 format native to this hardware (`e4m3fnuz` on gfx942, else `e4m3fn`).
    """

    device: str
    name: str
    arch: str
    triton: str | None
    deep_gemm: str | None
    deep_gemm_error: str | None
    interpret: bool
    fp8_format: str

    def nvidia_sm(self, sm: int) -> bool:
        """An NVIDIA GPU of compute capability `sm` (89 = sm_89, 90 = sm_90) or later."""
        return self.device == "cuda" and int(self.arch.removeprefix("sm")) >= sm

    @property
    def torch_device(self) -> str:
        """The torch device string tensors for this hardware live on (`cuda` for ROCm too)."""
        return "cpu" if self.device == "cpu" else "cuda"


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _detect(interpret: bool) -> Hardware:
    import torch

    triton_version = None
    if importlib.util.find_spec("triton") is not None:
        try:
            import triton

            triton_version = triton.__version__
        except Exception:  # a broken install is reported as missing
            triton_version = None

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if torch.version.hip is not None:
            arch = props.gcnArchName.split(":")[0]
            device = "rocm"
        else:
            arch = f"sm{props.major}{props.minor}"
            device = "cuda"
        name = props.name
    else:
        device, name, arch = "cpu", "cpu", "cpu"

    deep_gemm_version, deep_gemm_error = None, None
    if device != "cuda":
        deep_gemm_error = "DeepGEMM needs an NVIDIA GPU (SM90 or SM100)"
    elif arch not in ("sm90", "sm100", "sm103"):
        deep_gemm_error = f"DeepGEMM supports SM90 and SM100, this GPU is {arch}"
    else:
        try:
            deep_gemm = importlib.import_module("deep_gemm")
            deep_gemm_version = getattr(deep_gemm, "__version__", "unknown")
        except Exception as exc:
            deep_gemm_error = (f"`import deep_gemm` failed ({type(exc).__name__}: {exc}); build and install "
                               "DeepGEMM >= 2.8 from its source")

    return Hardware(
        device=device,
        name=name,
        arch=arch,
        triton=triton_version,
        deep_gemm=deep_gemm_version,
        deep_gemm_error=deep_gemm_error,
        interpret=interpret,
        fp8_format="e4m3fnuz" if arch == "gfx942" else "e4m3fn",
    )


def detect() -> Hardware:
    """Detect the hardware once per `TRITON_INTERPRET` setting."""
    return _detect(_interpret())


def backend_status(backend: str) -> tuple[bool, str]:
    """Whether `backend` can run on this machine, and if not, why (with how to get it)."""
    hw = detect()
    if backend == "reference":
        return True, "eager PyTorch"
    if backend == "triton":
        if hw.triton is None:
            return False, "Triton is not installed (`pip install 'triton>=3.6'`)"
        if hw.device == "cpu" and not hw.interpret:
            return False, "no GPU; set TRITON_INTERPRET=1 to run the Triton kernels on the CPU interpreter"
        where = "CPU interpreter" if hw.interpret else hw.arch
        return True, f"Triton {hw.triton} on {where}"
    if backend == "deepgemm":
        if hw.deep_gemm is None:
            return False, hw.deep_gemm_error or "DeepGEMM unavailable"
        if hw.interpret:
            return False, "TRITON_INTERPRET=1 is set; DeepGEMM's glue kernels need a real GPU"
        return True, f"DeepGEMM {hw.deep_gemm} on {hw.arch}"
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


@dataclass(frozen=True)
class Implementation:
    """One registry entry.

    Attributes:
        op: public op name (`"fp8_einsum"`).
        backend: `"triton"`, `"deepgemm"` or `"reference"`.
        target: `"module.path:function"`, imported on first use.
        deterministic: bitwise-equal outputs for equal inputs (reruns and batch composition).
        note: what the capability table shows (e.g. "Triton kernel: DeepGEMM has none").
    """

    op: str
    backend: str
    target: str
    deterministic: bool = True
    note: str = ""

    def load(self) -> Callable[..., Any]:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[str, dict[str, Implementation]] = {}


def register(op: str, backend: str, target: str, *, deterministic: bool = True, note: str = "") -> None:
    """Declare that `backend` implements `op` by the function at `target` ("module:function")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    _REGISTRY.setdefault(op, {})[backend] = Implementation(op, backend, target, deterministic, note)


def registry() -> dict[str, dict[str, Implementation]]:
    """op -> backend -> implementation (a copy)."""
    _load_ops()
    return {op: dict(impls) for op, impls in _REGISTRY.items()}


def _load_ops() -> None:
    importlib.import_module("optimized")  # the op modules register themselves on import


def device_status(backend: str, device: torch.device) -> tuple[bool, str]:
    """Whether `backend` takes tensors on `device` here, and if not, why: the GPU backends take GPU tensors, and
    Triton takes CPU tensors only under `TRITON_INTERPRET=1`."""
    if backend == "reference" or device.type == "cuda" or (backend == "triton" and detect().interpret):
        return True, ""
    if backend == "triton":
        return False, ("the triton backend takes CPU tensors only under TRITON_INTERPRET=1 (the CPU interpreter); "
                       "move the inputs to the GPU, or use backend='reference'")
    return False, "DeepGEMM takes CUDA tensors; move the inputs to the GPU, or use backend='reference'"


def select(op: str, backend: str | None = None, inputs: tuple[str, torch.device] | None = None) -> Implementation:
    """Pick the implementation of `op`: `backend` > `DSV4_BACKEND` > best available (for the inputs' device).

    `inputs` is (argument name, device) of the call's tensors: a requested backend that cannot take them is an
    error naming that argument; without a request the best backend that can take them is chosen (CPU tensors on a
    GPU machine: the reference).

    Raises:
        ValueError: unknown op or backend name, a backend that does not implement `op`, or one that cannot take
            tensors on the inputs' device.
        RuntimeError: the requested backend is not available on this machine (with the reason).
    """
    _load_ops()
    if op not in _REGISTRY:
        raise ValueError(f"op: unknown op {op!r}; known: {sorted(_REGISTRY)}")
    impls = _REGISTRY[op]
    requested = backend or os.environ.get("DSV4_BACKEND") or None
    if requested is not None:
        if requested not in BACKENDS:
            source = "backend" if backend else "DSV4_BACKEND"
            raise ValueError(f"{source}: expected one of {BACKENDS}, got {requested!r}")
        if requested not in impls:
            raise ValueError(f"backend: {requested!r} does not implement {op!r} (it has: {sorted(impls)})")
        ok, why = backend_status(requested)
        if not ok:
            raise RuntimeError(f"backend {requested!r} is not available on this machine: {why}")
        if inputs is not None:
            ok, why = device_status(requested, inputs[1])
            if not ok:
                raise ValueError(f"{inputs[0]}: on {inputs[1]}; {why}")
        return impls[requested]
    for name in BACKENDS:
        if name in impls and backend_status(name)[0] and (inputs is None or device_status(name, inputs[1])[0]):
            return impls[name]
    raise RuntimeError(f"no backend available for {op!r}")  # reference is always registered in practice


_VALUE_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar("dsv4_value_checks", default=True)


def checking_values(t: Any) -> bool:
    """Whether value-dependent input checks (indices in range, token ids in the vocabulary) may read `t`.

    They read the device once per call, which a CUDA graph capture forbids. While a graph is being captured
    they are skipped: the standard capture recipe runs the same calls eagerly first (warm-up), where they
    were checked. Inside `value_checks(False)` they are skipped too (a serving loop that validated its
    inputs elsewhere). Shape, dtype, device and layout checks always run.
    """
    import torch

    if not _VALUE_CHECKS.get():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Turn the value-dependent input checks (the only ones that read the device) on or off in a block."""
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def host_sync(fn: Callable[[], object]) -> str | None:
    """Run `fn` once eagerly with `torch.cuda.set_sync_debug_mode("error")`: the message of the synchronizing call
    it made (a device read, which CUDA-graph capture forbids), or None. Value checks are off, as under capture.
    Needs a CUDA device (sync-debug mode is a CUDA setting)."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with value_checks(False):
            fn()
    except RuntimeError as exc:  # "called a synchronizing CUDA operation"
        return str(exc)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def capability_rows() -> list[dict[str, str]]:
    """One row per op: for each backend `yes`/`no`/`-` (not implemented) plus notes."""
    rows = []
    for op, impls in sorted(registry().items()):
        row = {"op": op}
        notes = []
        for name in BACKENDS:
            if name not in impls:
                row[name] = "-"
                continue
            ok, _ = backend_status(name)
            impl = impls[name]
            row[name] = ("yes" if ok else "no") + ("" if impl.deterministic else " (non-det.)")
            if impl.note:
                notes.append(f"{name}: {impl.note}")
        row["notes"] = "; ".join(notes)
        rows.append(row)
    return rows
