"""Ahead-of-time compile of every Triton kernel for sm_90, gfx942 and gfx950 — no GPU needed.

This is how the ROCm path is checked without ROCm hardware: each kernel module lists `AOT_SPECS`
(the signatures and constexprs it is launched with), and `compile_all()` runs `triton.compile` with
a `GPUTarget` for each target, then reports registers (or VGPRs/SGPRs), shared memory (LDS) and
spills. Kernels must be compiled with `TRITON_INTERPRET` unset (the interpreter replaces `@triton.jit`
functions), so `python -m optimized.triton.aot` is the entry point tests call in a subprocess.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, TypeVar

from optimized.triton._fp8 import fp8_constants

T = TypeVar("T")

# Modules that define AOT_SPECS. Add yours here.
KERNEL_MODULES: tuple[str, ...] = ("optimized.triton.quant", "optimized.triton.einsum", "optimized.triton.moe_routing",
                                   "optimized.triton.moe_permute", "optimized.triton.moe_gemm",
                                   "optimized.triton.sparse_attention", "optimized.triton.indexer",
                                   "optimized.triton.rope_quant", "optimized.triton.compressor")

# (name, backend, arch, warp size, FP8 format native to the target)
TARGETS = (
    ("sm_90", "cuda", 90, 32, "e4m3fn"),
    ("gfx942", "hip", "gfx942", 64, "e4m3fnuz"),
    ("gfx950", "hip", "gfx950", 64, "e4m3fn"),
)
_TRITON_FP8 = {"e4m3fn": "fp8e4nv", "e4m3fnuz": "fp8e4b8"}
ALL_TARGETS = tuple(t[0] for t in TARGETS)
# Where tiles differ by platform (the H200's fastest tiles spill on AMD or overflow gfx942's 64 KB of LDS), a
# kernel module keeps one table per platform, picks it with `tile_platform()`, and lists each table's launches
# for that platform's targets only.
PLATFORM_TARGETS = {"nvidia": ("sm_90",), "amd": ("gfx942", "gfx950")}

# Budgets the report checks. Spills are a failure; the register/LDS caps are what the hardware allows.
MAX_SHARED_BYTES = {"sm_90": 232448, "gfx942": 65536, "gfx950": 163840}


@dataclass(frozen=True)
class AotSpec:
    """One launch configuration of one kernel.

    Attributes:
        name: label in reports ("fp8_einsum[BLOCK_M=64]").
        kernel: the `@triton.jit` function.
        signature: Triton signature; `"*{fp8}"` stands for the target's native FP8 pointer type.
        constexprs: constexpr values (do not include the FP8 constants; see `fp8`).
        fp8: add `FP8_MAX`, `MIN_NORMAL_EXP`, `HAS_NEG_ZERO` of the target's FP8 format to constexprs.
        num_warps, num_stages: launch options.
        aligned: arguments (pointers, strides) that are multiples of 16 at the real launches. The JIT
            specializes on that (`tt.divisibility = 16`) and only then vectorizes and pipelines loads; an
            AOT compile without it reports scalar loads, no pipelining and inflated registers.
        targets: the targets this launch happens on (a platform's tiles: `PLATFORM_TARGETS`).
        gluon: the kernel is a `@gluon.jit` function (Triton's layout-explicit dialect; one target's layouts).
    """

    name: str
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    fp8: bool = False
    num_warps: int = 4
    num_stages: int = 2
    aligned: tuple[str, ...] = ()
    targets: tuple[str, ...] = ALL_TARGETS
    gluon: bool = False


def tile_platform() -> str:
    """Which tile table a launch uses: "amd" on ROCm, else "nvidia" (the CPU interpreter included, so a CPU run
    picks the configurations an H200 picks for the same shapes)."""
    from optimized.backends import detect

    return "amd" if detect().device == "rocm" else "nvidia"


def by_token_count(n_tokens: int, decode_max: int, *, interpret: T, decode: T, prefill: T) -> T:
    """A launch shape by token count: the CPU interpreter's (few, large programs: it pays per operation), the decode
    shape up to `decode_max` tokens, else the prefill shape."""
    from optimized.backends import detect

    if detect().interpret:
        return interpret
    return decode if n_tokens <= decode_max else prefill


def all_specs() -> list[AotSpec]:
    """AOT_SPECS of every kernel module."""
    return [spec for module in KERNEL_MODULES for spec in importlib.import_module(module).AOT_SPECS]


def _resources(kernel: Any, target: str) -> dict[str, int]:
    """Registers / shared memory / spills from the compiled binary's metadata or assembly."""
    shared = int(kernel.metadata.shared)
    if target.startswith("gfx"):
        asm = kernel.asm["amdgcn"]

        def field_of(key: str) -> int:
            m = re.search(rf"\.{key}:\s+(\d+)", asm)
            return int(m.group(1)) if m else 0

        return {"vgprs": field_of("vgpr_count"), "sgprs": field_of("sgpr_count"), "shared": shared,
                "spills": field_of("vgpr_spill_count") + field_of("sgpr_spill_count")}
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill_stores = re.search(r"(\d+) bytes spill stores", out)
    spill_loads = re.search(r"(\d+) bytes spill loads", out)
    return {"registers": int(regs.group(1)) if regs else 0, "shared": shared,
            "spills": (int(spill_stores.group(1)) if spill_stores else 0)
            + (int(spill_loads.group(1)) if spill_loads else 0)}


def compile_one(spec: AotSpec, target: tuple[str, str, Any, int, str]) -> dict[str, Any]:
    """Compile `spec` for one target; returns a report row (with `error` on failure)."""
    import triton
    from triton.backends.compiler import GPUTarget

    name, backend, arch, warp, fmt = target
    signature = {k: v.replace("{fp8}", _TRITON_FP8[fmt]) for k, v in spec.signature.items()}
    constexprs = dict(spec.constexprs)
    if spec.fp8:
        constexprs.update(fp8_constants(fmt))
    if "NATIVE_CAST" in spec.kernel.arg_names:  # the device's own FP8 cast where it rounds like the reference
        constexprs["NATIVE_CAST"] = backend == "cuda" and fmt == "e4m3fn"
    if "PDL" in spec.kernel.arg_names:  # programmatic dependent launch on NVIDIA (`_pdl.pdl_launch`)
        constexprs["PDL"] = backend == "cuda"
    for key in constexprs:
        signature[key] = "constexpr"
    row: dict[str, Any] = {"kernel": spec.name, "target": name, "fmt": fmt}
    try:
        attrs = {(spec.kernel.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in spec.aligned}
        if spec.gluon:
            from triton.experimental.gluon._runtime import GluonASTSource

            src = GluonASTSource(spec.kernel, signature, constexprs, attrs)
        else:
            src = triton.compiler.ASTSource(fn=spec.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget(backend, arch, warp),
                                options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
        row.update(_resources(kernel, name))
        # features that must really be compiled in where a launch asks for them (PTX of NVIDIA targets only)
        ptx = kernel.asm.get("ptx", "") if backend == "cuda" else ""
        row["tma"] = "cp.async.bulk.tensor" in ptx  # TMA tile loads (the einsum's `TMA`)
        row["pdl"] = "griddepcontrol.wait" in ptx  # programmatic dependent launch (`_pdl.pdl_wait`)
        # the split-K arrival counter's atomic with acquire-release semantics at GPU scope (`moe_gemm._arrive`)
        row["acq_rel"] = "atom.global.gpu.acq_rel" in ptx
        row["wgmma"] = "wgmma.mma_async" in ptx  # Hopper's native FP8 MMA (the swap-AB tiles, `moe_gemm._block_dot`)
        row["ok"] = row["spills"] == 0 and row["shared"] <= MAX_SHARED_BYTES[name]
    except Exception as exc:  # reported, and fails the check
        row["ok"] = False
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return row


def compile_all() -> list[dict[str, Any]]:
    """Every spec on each of its targets."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: run the AOT compile in a process without it")
    return [compile_one(spec, target) for spec in all_specs() for target in TARGETS if target[0] in spec.targets]


def main() -> None:
    rows = compile_all()
    json.dump(rows, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
