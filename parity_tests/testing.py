"""pytest helpers shared by the parity test files."""

from __future__ import annotations

import pytest
import torch

from optimized.backends import detect
from parity_tests.cases import FP8_FORMATS, TINY_DEVICE, Case, NotRun

# The tensors of the kernel unit tests: the CPU under TRITON_INTERPRET=1, else the GPU the Triton kernels run on.
KERNEL_DEVICE = "cpu" if detect().interpret else TINY_DEVICE
# The FP8 formats Triton has there: e4m3fnuz (gfx942's) only in the interpreter and on ROCm.
KERNEL_FP8_FORMATS = [f for f in FP8_FORMATS if f == "e4m3fn" or KERNEL_DEVICE == "cpu" or torch.version.hip]


def assert_case_passes(case: Case, backend: str) -> None:
    """Run `case` on `backend`: skip with the reason when it cannot run here, fail listing every failed check."""
    try:
        checks = case.run(backend)
    except NotRun as exc:
        pytest.skip(f"not run: {exc}")
    failed = [f"{c.name}: {c.value:.3g} > {c.bound.value:g} ({c.bound.tier}: {c.bound.reason}) {c.detail}"
              for c in checks if not c.passed]
    assert not failed, f"{case.id} on {backend}:\n" + "\n".join(failed)
