"""FP8 helpers shared by the Triton kernels: UE8M0 scales on the bits, exact RNE onto the E4M3 grid.

Why round by hand: a kernel's fp32 -> fp8 cast is round-to-nearest-even on NVIDIA (`cvt.rn.satfinite`)
and on AMD, but Triton's CPU interpreter (3.6) truncates the mantissa and rounds half away, and
cannot represent `float8_e4m3fnuz` at all. Rounding onto the FP8 grid in fp32 first makes the
final cast exact everywhere, so the interpreter runs the same arithmetic the GPU does. It costs
~15 integer and float ops per element; the quantization kernels, which do little else per element,
became issue-bound on it (the attention output's 268 M values at FLASH prefill 8192: ~500 us against a
~190 us memory floor), so where the final cast alone is exact (`native_fp8_cast`: e4m3fn on NVIDIA
sm_89+) `cast_to_fp8` skips it. Kernels that compute with the rounded fp32 value (the quantization
simulations) keep `round_to_fp8_grid`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.backends import detect
from reference.formats import FP8Format, fp8_format


@triton.jit
def ue8m0_scale(amax, QMAX: tl.constexpr, EPS: tl.constexpr):
    """`2^ceil(log2(max(amax, EPS) / QMAX))` from the exponent and mantissa bits, exponent byte in [1, 254]."""
    # NaN amax must give the reference's NaN-block scale (exponent byte 254): keep NaN through the floor.
    # `/` is the approximate div.full.f32 on NVIDIA; div_rn is the exact division the reference does.
    ratio = tl.math.div_rn(tl.maximum(amax, EPS, propagate_nan=tl.PropagateNan.ALL), QMAX)
    bits = ratio.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    exponent = tl.minimum(tl.maximum(exponent, 1), 254)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_reciprocal(scale):
    """`1 / scale` for a UE8M0 scale (a power of two, exponent byte in [1, 254]), built from its exponent: exact,
    so `x * pow2_reciprocal(s)` equals the reference's `x / s` bit for bit (2^-127, the reciprocal of the
    NaN-block scale 2^127, is subnormal and spelled out)."""
    exponent = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where(exponent == 254, 2.0**-127, ((254 - exponent) << 23).to(tl.float32, bitcast=True))


@triton.jit
def round_to_fp8_grid(x, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, HAS_NEG_ZERO: tl.constexpr):
    """Clamp fp32 `x` to +-FP8_MAX and round it to the nearest E4M3 value (ties to even), in fp32.

    E4M3 has 3 mantissa bits: in the binade [2^e, 2^(e+1)) the step is 2^(e-3); below the smallest
    normal 2^MIN_NORMAL_EXP the step stays 2^(MIN_NORMAL_EXP-3) (subnormals). `x / step` is then an
    exact fp32 in [0, 16) and adding and subtracting 1.5 * 2^23 rounds it to an integer with the FPU's
    own round-to-nearest-even. A result of zero keeps x's sign where the format has a negative zero
    (e4m3fn, as torch's cast does) and is +0 where it has none (e4m3fnuz: 0x80 is NaN).
    """
    # NaN must survive the clamp (min/max drop NaN on GPUs by default): the reference keeps it
    x = tl.maximum(x, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    x = tl.minimum(x, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_NORMAL_EXP)
    # step = 2^(e-3) and its reciprocal 2^(3-e) are normal fp32 for every e here (NaN: e = 128), so `x * (1 / step)`
    # is the exact `x / step` without a division (div_rn is ~10x the instructions and made quantization
    # kernels issue-bound)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((130 - exponent) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    units = (x * inv_step + magic) - magic
    y = units * step
    if HAS_NEG_ZERO:
        return tl.where(y == 0.0, x * 0.0, y)
    return tl.where(y == 0.0, 0.0, y)


@triton.jit
def cast_to_fp8(x, out_dtype: tl.constexpr, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
                HAS_NEG_ZERO: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """fp32 `x` (|x| <= FP8_MAX or +-Inf or NaN) rounded to nearest-even onto the FP8 grid, as `out_dtype`.

    With NATIVE_CAST (`native_fp8_cast`), the cast alone: NVIDIA's `cvt.rn.satfinite.e4m3x2.f32` rounds to
    nearest-even, keeps subnormals and the sign of zero, saturates +-Inf to +-448 and writes NaN as 0x7F, the
    bytes of `round_to_fp8_grid` + cast, in one instruction per two values instead of ~15 integer and float
    operations per value. Elsewhere (ROCm, e4m3fnuz, the CPU interpreter, whose numpy conversion truncates) the
    value is first put on the grid, so that the cast is exact.
    """
    if NATIVE_CAST:
        return x.to(out_dtype, fp_downcast_rounding="rtne")
    return round_to_fp8_grid(x, FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO).to(out_dtype)


def native_fp8_cast(fmt: str | FP8Format, device: torch.device) -> bool:
    """Whether `cast_to_fp8` may cast directly: e4m3fn on an NVIDIA GPU of sm_89 or later, not interpreted
    (from the cached `optimized.backends.detect()`: one dict lookup per launch)."""
    hw = detect()
    return fp8_format(fmt).name == "e4m3fn" and device.type == "cuda" and hw.nvidia_sm(89) and not hw.interpret


def fp8_constants(fmt: str | FP8Format) -> dict[str, float | int]:
    """Constexpr kwargs for a kernel that quantizes into `fmt`: FP8_MAX, MIN_NORMAL_EXP, HAS_NEG_ZERO."""
    f = fp8_format(fmt)
    return {"FP8_MAX": f.max, "MIN_NORMAL_EXP": f.min_normal_exp, "HAS_NEG_ZERO": f.name == "e4m3fn"}


def _patch_interpreter_fnuz() -> None:
    """Teach Triton 3.6's interpreter the `fp8e4b8` (e4m3fnuz) type: its builder has the type getter
    but the `dtype.to_ir` it installs for each launch misses the mapping, so any cast to or store of
    e4m3fnuz fails. Values written through `round_to_fp8_grid` are exact, so the interpreter's
    bit-level conversion is then exact too.
    """
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang_core, "_dsv4_fnuz", False):
        return
    original_patch = interpreter._patch_lang_core

    def patch_lang_core(lang, scope):
        original_patch(lang, scope)
        to_ir = lang.dtype.to_ir

        def to_ir_with_fnuz(self, builder):
            if self.name == "fp8e4b8":
                return builder.get_fp8e4b8_ty()
            return to_ir(self, builder)

        lang.dtype.to_ir = to_ir_with_fnuz  # the scope restores Triton's own method after the launch

    patch_lang_core._dsv4_fnuz = True  # type: ignore[attr-defined]
    interpreter._patch_lang_core = patch_lang_core


def _patch_interpreter_scalar_index() -> None:
    """Let a runtime scalar bound a loop (`for i in range(0, n)`) under NumPy >= 2.4: Triton 3.6's interpreter
    holds kernel scalars as 1-element arrays and converts them with `int(array)`, which NumPy 2.4 rejects for
    arrays with ndim > 0.
    """
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang_tensor, "_dsv4_index", False):
        return
    original_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._dsv4_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_interpreter_dot_operands() -> None:
    """Make `tl.dot` of bf16 and FP8 operands multiply values in fp32. Triton 3.6's interpreter stores bf16
    as uint16 and hands those integers to `np.matmul` (wrong), and upcasts FP8 to fp16 for a NumPy fp16
    matmul (right but ~1000x slower than fp32). bf16 -> fp32 and FP8 -> fp32 are exact, and so is every
    product of two such values in fp32, as in the GPU's MMA.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_dsv4_fp32", False):
        return
    original_dot = builder.create_dot

    def as_fp32(handle):
        if handle.dtype == tl.bfloat16:
            return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        if handle.dtype.is_floating() and handle.dtype.primitive_bitwidth == 8:
            data = interpreter._convert_float(handle.data, handle.dtype, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    create_dot._dsv4_fp32 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


def _patch_interpreter_bf16_rounding() -> None:
    """Round fp32 -> bf16 casts to nearest even, as the GPU does: Triton 3.6's interpreter truncates the
    mantissa, which biases every bf16 result (outputs, P before P V) toward zero.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_dsv4_rne", False):
        return
    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            quiet_nan = ((bits >> 16) | 0x40).astype(np.uint16)
            return interpreter.TensorHandle(np.where(np.isnan(src.data), quiet_nan, rounded), tl.bfloat16)
        return original_cast(self, src, dst_type)

    cast_impl._dsv4_rne = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl


def prepare_interpreter() -> None:
    """Apply the interpreter fixes when `TRITON_INTERPRET=1` (a no-op on GPUs)."""
    from optimized.backends import detect

    if detect().interpret:
        _patch_interpreter_fnuz()
        _patch_interpreter_scalar_index()
        _patch_interpreter_dot_operands()
        _patch_interpreter_bf16_rounding()
