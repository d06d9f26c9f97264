"""Public op `fp8_linear` (block-scaled FP8 linear, spec §2.5) and the backend lookup the public ops share.

Same signature as `reference.linear.fp8_linear` plus `backend=`. Backends: reference; triton (per-token
quant + the einsum kernel with one group; e4m3fn and e4m3fnuz, act_block 128 or 32); deepgemm (Triton
quant writing DeepGEMM's scale layout + `deep_gemm.fp8_gemm_nt`; e4m3fn, act_block 128).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import torch

from optimized.backends import Implementation, register, select
from reference.formats import fp8_format
from reference.numerics import Numerics
from reference.weights import FP8_WEIGHT_BLOCK, Fp8Weight

register("fp8_linear", "reference", "reference.linear:fp8_linear")
register("fp8_linear", "triton", "optimized.triton.linear:fp8_linear",
         note="rerun-deterministic, not batch-invariant (tiles / split-K depend on the token count)")
register("fp8_linear", "deepgemm", "optimized.deepgemm.linear:fp8_linear",
         note="Triton act quant (DeepGEMM's scale layout) + fp8_gemm_nt; e4m3fn, act_block 128")


def implementation(op: str, backend: str | None, inputs: tuple[str, object] | None = None) -> Implementation:
    """`backends.select` for a call whose tensors are `inputs` = (argument name, value; its device counts when it
    is a tensor), with an unavailable backend reported as a ValueError naming `backend`."""
    on = (inputs[0], inputs[1].device) if inputs is not None and isinstance(inputs[1], torch.Tensor) else None
    try:
        return select(op, backend, on)
    except RuntimeError as exc:
        raise ValueError(f"backend: {exc}") from exc


# (op, backend, DSV4_BACKEND, TRITON_INTERPRET, device type) -> (backend name, function); see `resolve`.
_RESOLVED: dict[tuple[str, str | None, str | None, str | None, str], tuple[str, Callable[..., Any]]] = {}


def resolve(op: str, backend: str | None, inputs: tuple[str, torch.Tensor]) -> tuple[str, Callable[..., Any]]:
    """The backend that runs `op` on `inputs` (argument name, tensor) and the function a public op calls after
    validating its arguments.

    That function is the registered one's `<name>_checked` sibling where the backend module has one (it skips
    the generic argument checks the public op has just run, keeping only the backend's own), else the
    registered function. The lookup is cached per (op, backend, `DSV4_BACKEND`, `TRITON_INTERPRET`, the inputs'
    device type): it depends on nothing else (hardware detection is cached too), and errors are never cached.
    """
    key = (op, backend, os.environ.get("DSV4_BACKEND"), os.environ.get("TRITON_INTERPRET"), inputs[1].device.type)
    hit = _RESOLVED.get(key)
    if hit is None:
        impl = implementation(op, backend, inputs)
        module_name, _, attr = impl.target.partition(":")
        module = importlib.import_module(module_name)
        hit = _RESOLVED[key] = (impl.backend, getattr(module, f"{attr}_checked", None) or getattr(module, attr))
    return hit


def check_fp8_linear_args(x: object, weight: object, numerics: object) -> None:
    """Validate an `fp8_linear` call for the optimized backends (raises ValueError / TypeError naming the argument)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected bfloat16 activations, got {x.dtype}")
    if not isinstance(weight, Fp8Weight):
        raise TypeError(f"weight: expected an Fp8Weight, got {type(weight).__name__}")
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics: expected a Numerics, got {type(numerics).__name__}")
    if weight.data.dim() != 2:
        raise ValueError(f"weight: expected a 2-d [N, K] weight, got shape {tuple(weight.data.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x: last dim must be the weight's K = {weight.shape[-1]}, got shape {tuple(x.shape)}")
    if x.shape[-1] % FP8_WEIGHT_BLOCK:
        raise ValueError(f"x: K = {x.shape[-1]} must be a multiple of {FP8_WEIGHT_BLOCK} for the optimized backends")
    if not numerics.act_quant:
        raise ValueError("numerics: act_quant=False (unquantized activations) is implemented by the reference "
                         "backend only; the optimized FP8 linear quantizes its input")
    if weight.data.dtype != fp8_format(numerics.fp8_format).dtype:
        raise TypeError(f"weight: stored as {weight.data.dtype}, but numerics.fp8_format is "
                        f"{numerics.fp8_format!r}; the FP8 GEMM needs one format for both operands")
    for name, t in (("weight", weight.data), ("weight", weight.scale)):
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, expected x's device {x.device}")


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, numerics: Numerics, *, backend: str | None = None) -> torch.Tensor:
    """`y = x W^T` with W block-FP8 and x quantized per token (see `reference.linear.fp8_linear`).

    Args:
        x: [..., K] bf16.
        weight: `Fp8Weight` [N, K].
        numerics: act-quant switches; the optimized backends need `act_quant` on and the weight in
            `numerics.fp8_format`.

    Returns:
        [..., N] bf16.
    """
    check_fp8_linear_args(x, weight, numerics)
    return resolve("fp8_linear", backend, ("x", x))[1](x, weight, numerics)
