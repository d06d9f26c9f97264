"""Programmatic dependent launch (PDL) for chains of small kernels (Hopper and later).

A decode step runs a chain of short kernels (the MoE step at T = 1: router logits, top-k, activation
quantization, permute, two grouped GEMMs, combine). Between two of them the GPU normally drains the first
grid, then launches the second. With PDL a kernel launched with `launch_pdl=True` may be scheduled while its
predecessor still runs; its programs first execute `griddepcontrol.wait`, which returns once the predecessor
has completed and its writes are visible, then `griddepcontrol.launch_dependents`, which lets the next kernel
of the chain be scheduled in turn. Every kernel waits before it touches memory, so a kernel completes only
after its predecessor did: everything earlier in the stream is complete and visible too (nothing is read
before the wait, so the chain keeps stream order). Under CUDA-graph capture the launches become programmatic
graph edges.

Only on NVIDIA sm_90+ GPUs, not interpreted (the instructions are PTX); elsewhere `PDL` is False and the
kernels compile exactly as before.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from optimized.backends import detect


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of a chain kernel: wait for the predecessor, then release the successor (no-op without PDL)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch() -> dict[str, bool]:
    """Launch kwargs of a chain kernel: `PDL` (its constexpr) and Triton's `launch_pdl` where the GPU supports it."""
    hw = detect()
    if hw.nvidia_sm(90) and not hw.interpret:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
