"""Cross-program hand-off inside one launch: the last program to arrive at a counter finishes the shared work.

Used where a tile's result needs several programs (split-K slices of the MoE GEMMs, the decode down GEMM's fused
combine, the decode router's top-k): each program stores its part, then counts itself in; the one that gets
count - 1 back reads the others' parts (past L1: `.cg` loads) and finishes. No program waits for another, so no
launch order can deadlock. The counters must be zero before the launch (a zeroed buffer of the call, or zeroed by
an earlier kernel of the same chain).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def arrive(counter_ptr):
    """Count this program in at its tile's counter, once all its threads have stored their partial sums; returns
    the count before it (the last of S programs gets S - 1).

    The pattern of CUTLASS's split-K semaphore: a CTA barrier, then one thread's atomic with release semantics at
    GPU scope (Triton runs a scalar atomic in one thread and broadcasts the result), so every store of the program
    is visible to the program that acquires the count; acquire makes the other programs' stores visible to this one.
    """
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
