"""Thin adapters over `deep_gemm` (imported lazily: nothing here imports it at module load)."""

from __future__ import annotations

import importlib
from types import ModuleType


def deep_gemm() -> ModuleType:
    """The `deep_gemm` module, or a RuntimeError saying why it cannot be used here."""
    from optimized.backends import backend_status

    ok, why = backend_status("deepgemm")
    if not ok:
        raise RuntimeError(f"backend 'deepgemm' is not available on this machine: {why}")
    return importlib.import_module("deep_gemm")
