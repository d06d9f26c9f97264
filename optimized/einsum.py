"""Public ops of the output projection: `fp8_einsum`, `quantize_attn_output`, `output_projection`.

Same signatures as `reference.einsum` plus `backend=`. Inputs are validated here, once, before dispatch: the
public op calls the backend's `<name>_checked` entry (`optimized.linear.resolve`, cached per backend), which
checks only what that backend alone needs before it launches anything. Backends:
  * reference — `reference.einsum`: every expression and recipe.
  * triton    — `'bhr,hdr->bhd'`, recipes (1, 128, 128) and (1, 1, 128), e4m3fn and e4m3fnuz.
  * deepgemm  — `deep_gemm.fp8_einsum` (`'bhr,hdr->bhd'`, (1, 128, 128), e4m3fn); the quantization is
    the Triton kernel writing DeepGEMM's scale layout; `wo_b` runs on `deep_gemm.fp8_gemm_nt`.
"""

from __future__ import annotations

from functools import partial

import torch

from optimized.backends import register
from optimized.linear import resolve
from reference.einsum import (
    check_attn_output_args,
    check_fp8_einsum_args,
    check_output_projection_args,
    grouped_wo_a,
)
from reference.numerics import Numerics
from reference.weights import Fp8Weight

_EINSUM_NOTE = "rerun-deterministic, not batch-invariant (tiles / split-K depend on b)"
register("fp8_einsum", "reference", "reference.einsum:fp8_einsum")
register("fp8_einsum", "triton", "optimized.triton.einsum:fp8_einsum",
         note=f"'bhr,hdr->bhd', recipes (1,128,128) and (1,1,128); {_EINSUM_NOTE}")
register("fp8_einsum", "deepgemm", "optimized.deepgemm.einsum:fp8_einsum",
         note="'bhr,hdr->bhd', recipe (1,128,128), e4m3fn (DeepGEMM SM90)")
register("quantize_attn_output", "reference", "reference.einsum:quantize_attn_output")
register("quantize_attn_output", "triton", "optimized.triton.quant:quantize_attn_output")
register("quantize_attn_output", "deepgemm", "optimized.deepgemm.einsum:quantize_attn_output",
         note="Triton kernel (DeepGEMM has none), scales in DeepGEMM's SM90 layout")
register("output_projection", "reference", "reference.einsum:output_projection")
register("output_projection", "triton", "optimized.einsum:output_projection_triton",
         note=f"numerics.wo_a='fp8' only; {_EINSUM_NOTE}")
register("output_projection", "deepgemm", "optimized.einsum:output_projection_deepgemm",
         note="numerics.wo_a='fp8' only; Triton quantization + DeepGEMM einsum and wo_b GEMM")


def fp8_einsum(
    expr: str,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    recipe: tuple[int, int, int] = (1, 128, 128),
    backend: str | None = None,
) -> torch.Tensor:
    """Block-scaled FP8 einsum (see `reference.einsum.fp8_einsum` for the expressions and scale layouts)."""
    check_fp8_einsum_args(expr, a, b, out, recipe)
    return resolve("fp8_einsum", backend, ("a", a[0]))[1](expr, a, b, out, recipe=recipe)


def quantize_attn_output(
    o: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    *,
    n_groups: int,
    fmt: str = "e4m3fn",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse RoPE + per-128 FP8 quantization of the attention output (see `reference.einsum`).

    The scale layout depends on the backend (row-major for triton and reference, DeepGEMM's MN-major
    TMA-aligned layout for deepgemm); the logical shape and values are the same.
    """
    check_attn_output_args(o, positions, freqs, n_groups, fmt)
    return resolve("quantize_attn_output", backend, ("o", o))[1](o, positions, freqs, n_groups=n_groups, fmt=fmt)


def _check_optimized_numerics(numerics: Numerics, backend: str) -> None:
    if numerics.wo_a != "fp8":
        raise ValueError(f"numerics: wo_a={numerics.wo_a!r} (official bf16 einsum) is implemented by the reference "
                         f"backend only; the {backend} backend implements wo_a='fp8'")
    if not numerics.act_quant:
        raise ValueError(f"numerics: act_quant=False is implemented by the reference backend only, not {backend}")
    if backend == "deepgemm" and (numerics.fp8_format != "e4m3fn" or numerics.act_block != 128):
        raise ValueError(f"numerics: DeepGEMM needs fp8_format 'e4m3fn' and act_block 128, got "
                         f"{numerics.fp8_format!r} and {numerics.act_block}")


def _compose_output_projection(
    backend: str,
    o: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    wo_a: Fp8Weight,
    wo_b: Fp8Weight,
    numerics: Numerics,
) -> torch.Tensor:
    """`quantize_attn_output` -> `fp8_einsum('bhr,hdr->bhd')` -> `fp8_linear(wo_b)`, each on `backend`."""
    check_output_projection_args(o, positions, freqs, wo_a, wo_b, numerics)
    _check_optimized_numerics(numerics, backend)
    return _compose_output_projection_checked(backend, o, positions, freqs, wo_a, wo_b, numerics)


def _compose_output_projection_checked(
    backend: str,
    o: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    wo_a: Fp8Weight,
    wo_b: Fp8Weight,
    numerics: Numerics,
) -> torch.Tensor:
    """The composition for arguments that already passed `check_output_projection_args` and the numerics check.

    The reference's "fp8" path step for step, through each step's `_checked` entry (the arguments are validated once, by
    the caller); on deepgemm the activation scales come out of the quantization in DeepGEMM's layout, so neither
    GEMM re-lays them out.
    """
    groups = o.shape[1] * o.shape[2] // wo_a.data.shape[1]
    o_fp8, o_scale = resolve("quantize_attn_output", backend, ("o", o))[1](o, positions, freqs, n_groups=groups,
                                                                           fmt=numerics.fp8_format)
    return project_quantized(backend, o_fp8, o_scale, wo_a, wo_b, numerics)


def project_quantized(backend: str, o_fp8: torch.Tensor, o_scale: torch.Tensor, wo_a: Fp8Weight, wo_b: Fp8Weight,
                      numerics: Numerics) -> torch.Tensor:
    """The composition after the quantization: `fp8_einsum` with `wo_a`, then `fp8_linear(wo_b)`, on `backend`,
    for `quantize_attn_output`'s outputs in `backend`'s scale layout (the layer's fused path passes those of
    `sparse_attention_quantized`)."""
    groups = o_fp8.shape[1]
    z = resolve("fp8_einsum", backend, ("o_fp8", o_fp8))[1]("bhr,hdr->bhd", (o_fp8, o_scale),
                                                            grouped_wo_a(wo_a, groups))
    return resolve("fp8_linear", backend, ("o_fp8", o_fp8))[1](z.flatten(1), wo_b, numerics)


output_projection_triton = partial(_compose_output_projection, "triton")
output_projection_deepgemm = partial(_compose_output_projection, "deepgemm")
output_projection_triton_checked = partial(_compose_output_projection_checked, "triton")
output_projection_deepgemm_checked = partial(_compose_output_projection_checked, "deepgemm")


def output_projection(
    o: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    wo_a: Fp8Weight,
    wo_b: Fp8Weight,
    numerics: Numerics,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention output -> hidden state: inverse RoPE, grouped `wo_a`, `wo_b` (see `reference.einsum`).

    The optimized backends implement the FP8 path (`numerics.wo_a == "fp8"`, vLLM / DeepGEMM numerics).
    """
    check_output_projection_args(o, positions, freqs, wo_a, wo_b, numerics)
    name, run = resolve("output_projection", backend, ("o", o))
    if name != "reference":
        _check_optimized_numerics(numerics, name)
    return run(o, positions, freqs, wo_a, wo_b, numerics)
