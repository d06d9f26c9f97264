"""The grouped FP8 output einsum of DSv4 and the output projection around it (spec §3.6, §4).

`fp8_einsum` follows DeepGEMM's calling convention: each operand is a `(data, scale)` pair of an FP8
tensor and its fp32 power-of-two scales, `out` is optional, `recipe = (gran_mn_a, gran_mn_b, gran_k)`.
Because every scale is a power of two, dequantizing both operands and doing one einsum is the same
function as the kernels' per-128-block promotion (spec §4.1). The einsum accumulates in fp64 and rounds
once to fp32 (`reference.invariant`), so a token's result does not depend on how many tokens share the
call; the kernels differ from it only in their fp32 summation order and the hardware FP8 accumulator
(spec §7.1 pitfall 8).

Scale layouts (DeepGEMM's, derived from the operand permutations of `fp8_einsum` in its
`csrc/apis/einsum.hpp`; `/` is a ceiling division). `gran` below is the block size of one scale along
each dim of the data tensor.

| expr           | recipe      | a = (A, sfa)               | b = (B, sfb)                   | out     |
|----------------|-------------|----------------------------|--------------------------------|---------|
| `bhr,hdr->bhd` | (1,128,128) | A [b,h,r], sfa [b,h,r/128] | B [h,d,r], sfb [h,d/128,r/128] | [b,h,d] |
| `bhr,hdr->bhd` | (1,1,128)   | same                       | B [h,d,r], sfb [h,d,r/128]     | [b,h,d] |
| `bhd,hdr->bhr` | (1,128,128) | A [b,h,d], sfa [b,h,d/128] | B [h,d,r], sfb [h,d/128,r/128] | [b,h,r] |
| `bhd,hdr->bhr` | (1,1,128)   | same                       | B [h,d,r], sfb [h,d/128,r]     | [b,h,r] |
| `bhd,bhr->hdr` | (1,128,128) | A [b,h,d], sfa [b/128,h,d] | B [b,h,r], sfb [b/128,h,r/128] | [h,d,r] |
| `bhd,bhr->hdr` | (1,1,128)   | same                       | B [b,h,r], sfb [b/128,h,r]     | [h,d,r] |

The first expression is DSv4's `wo_a` product (DeepGEMM letters: `r` = 4096 is the reduction, `d` =
`o_lora_rank` the output; SM90 and SM100). The other two are DeepGEMM's SM100-only forms (the second is
the transposed product, the third a weight gradient whose reduction runs over tokens `b`, so its
scales are per channel per 128 tokens). The reference implements all six; the optimized backends
implement `bhr,hdr->bhd`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import rearrange

from reference.formats import fp8_format, quantize_per_token
from reference.invariant import einsum_fp32
from reference.linear import fp8_linear
from reference.numerics import Numerics
from reference.rope import apply_rope
from reference.weights import FP8_WEIGHT_BLOCK, Fp8Weight

EXPRESSIONS = ("bhr,hdr->bhd", "bhd,hdr->bhr", "bhd,bhr->hdr")
RECIPES = ((1, 128, 128), (1, 1, 128))
SCALE_BLOCK = 128  # gran_k of both recipes; DeepGEMM's SM90 kernels require it

# (expr, recipe) -> block size of one scale along each dim of A and of B (see the module docstring).
_GRANULARITY: dict[tuple[str, tuple[int, int, int]], tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    ("bhr,hdr->bhd", (1, 128, 128)): ((1, 1, 128), (1, 128, 128)),
    ("bhr,hdr->bhd", (1, 1, 128)): ((1, 1, 128), (1, 1, 128)),
    ("bhd,hdr->bhr", (1, 128, 128)): ((1, 1, 128), (1, 128, 128)),
    ("bhd,hdr->bhr", (1, 1, 128)): ((1, 1, 128), (1, 128, 1)),
    ("bhd,bhr->hdr", (1, 128, 128)): ((128, 1, 1), (128, 1, 128)),
    ("bhd,bhr->hdr", (1, 1, 128)): ((128, 1, 1), (128, 1, 1)),
}

# amax floor of the attention-output quantization. vLLM's fused inverse-RoPE quant uses 1e-10 (not the
# 1e-4 of `act_quant`, spec §7.1 pitfall 1); we keep vLLM's value so small-magnitude blocks keep their
# resolution. It only matters for blocks whose amax is below it (all-zero heads).
ATTN_OUT_EPS = 1e-10


class EinsumDims(NamedTuple):
    """Sizes of one `fp8_einsum` call, in DeepGEMM's letters."""

    b: int
    h: int
    d: int
    r: int
    out_shape: tuple[int, int, int]


def _expected_scale_shape(shape: tuple[int, ...], gran: tuple[int, int, int]) -> tuple[int, ...]:
    return tuple(-(-n // g) for n, g in zip(shape, gran))


def _check_pair(pair: object, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(t, torch.Tensor) for t in pair)):
        raise TypeError(f"{name}: expected a (data, scale) pair of tensors, got {type(pair).__name__}")
    data, scale = pair
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise TypeError(f"{name}[0]: expected float8_e4m3fn or float8_e4m3fnuz data, got {data.dtype}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}[1]: expected float32 power-of-two scales, got {scale.dtype}")
    if data.dim() != 3:
        raise ValueError(f"{name}[0]: expected a 3-d tensor, got shape {tuple(data.shape)}")
    return data, scale


def check_fp8_einsum_args(
    expr: str, a: object, b: object, out: torch.Tensor | None, recipe: object
) -> EinsumDims:
    """Validate an `fp8_einsum` call (every backend runs this first) and return its sizes.

    Raises:
        ValueError / TypeError naming the argument: unknown expression or recipe, non-FP8 data, non-fp32
        scales, mismatched FP8 formats, shapes or scale shapes that do not fit `expr` x `recipe`, tensors
        on different devices, or an `out` of the wrong shape or dtype.
    """
    if expr not in EXPRESSIONS:
        raise ValueError(f"expr: expected one of {EXPRESSIONS}, got {expr!r}")
    if not isinstance(recipe, tuple) or recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    a_data, a_scale = _check_pair(a, "a")
    b_data, b_scale = _check_pair(b, "b")
    if b_data.dtype != a_data.dtype:
        raise TypeError(f"b[0]: expected the same FP8 format as a[0] ({a_data.dtype}), got {b_data.dtype}")
    if expr == "bhr,hdr->bhd":
        nb, h, r = a_data.shape
        want_b, d = (h, b_data.shape[1], r), b_data.shape[1]
        out_shape = (nb, h, d)
    elif expr == "bhd,hdr->bhr":
        nb, h, d = a_data.shape
        want_b, r = (h, d, b_data.shape[2]), b_data.shape[2]
        out_shape = (nb, h, r)
    else:
        nb, h, d = a_data.shape
        want_b, r = (nb, h, b_data.shape[2]), b_data.shape[2]
        out_shape = (h, d, r)
    if tuple(b_data.shape) != want_b:
        raise ValueError(f"b[0]: expected shape {want_b} for {expr!r} with a[0] of shape {tuple(a_data.shape)}, "
                         f"got {tuple(b_data.shape)}")
    gran_a, gran_b = _GRANULARITY[(expr, recipe)]
    for name, data, scale, gran in (("a", a_data, a_scale, gran_a), ("b", b_data, b_scale, gran_b)):
        want = _expected_scale_shape(tuple(data.shape), gran)
        if tuple(scale.shape) != want:
            raise ValueError(f"{name}[1]: expected scale shape {want} (blocks {gran} of {name}[0] "
                             f"{tuple(data.shape)}) for {expr!r} with recipe {recipe}, got {tuple(scale.shape)}")
    for name, t in (("a[1]", a_scale), ("b[0]", b_data), ("b[1]", b_scale)):
        if t.device != a_data.device:
            raise ValueError(f"{name}: on {t.device}, expected a[0]'s device {a_data.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out: expected shape {out_shape} for {expr!r}, got {tuple(out.shape)}")
        if out.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"out: expected bfloat16 or float32, got {out.dtype}")
        if out.device != a_data.device:
            raise ValueError(f"out: on {out.device}, expected a[0]'s device {a_data.device}")
    return EinsumDims(b=nb, h=h, d=d, r=r, out_shape=out_shape)


def dequantize_operand(data: torch.Tensor, scale: torch.Tensor, gran: tuple[int, ...]) -> torch.Tensor:
    """`data * scale` in fp32 with each scale broadcast over its block (`gran` elements along each dim).

    Args:
        data: [n0, n1, n2] FP8.
        scale: [n0/g0, n1/g1, n2/g2] fp32 (ceiling divisions).

    Returns:
        [n0, n1, n2] fp32.
    """
    full = scale.float()
    for dim, g in enumerate(gran):
        if g > 1:
            full = full.repeat_interleave(g, dim=dim).narrow(dim, 0, data.shape[dim])
    return data.float() * full


def fp8_einsum(
    expr: str,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    recipe: tuple[int, int, int] = (1, 128, 128),
) -> torch.Tensor:
    """Block-scaled FP8 einsum: dequantize both operands per their scale layout, einsum, cast (spec §4.1).

    Args:
        expr: one of `EXPRESSIONS`.
        a, b: `(data, scale)` pairs laid out as the module docstring's table says for `expr` x `recipe`.
        out: optional bf16 or fp32 output of the expression's output shape; written and returned.
        recipe: `(1, 128, 128)` (A per row per 128 K, B per 128x128 block) or `(1, 1, 128)` (both per row).

    Returns:
        `out`, or a new tensor: bf16 for the first two expressions, fp32 for the weight-gradient form
        `bhd,bhr->hdr` (DeepGEMM writes it in fp32).
    """
    dims = check_fp8_einsum_args(expr, a, b, out, recipe)
    gran_a, gran_b = _GRANULARITY[(expr, recipe)]
    z = einsum_fp32(expr, dequantize_operand(*a, gran_a), dequantize_operand(*b, gran_b))
    if out is None:
        dtype = torch.float32 if expr == "bhd,bhr->hdr" else torch.bfloat16
        out = torch.empty(dims.out_shape, dtype=dtype, device=z.device)
    out.copy_(z)
    return out


# ------------------------------------------------------------------------------------------------
# Output projection (spec §3.6, §4.2)
# ------------------------------------------------------------------------------------------------


def _check_o(o: object) -> tuple[int, int, int]:
    if not isinstance(o, torch.Tensor):
        raise TypeError(f"o: expected a tensor, got {type(o).__name__}")
    if o.dtype != torch.bfloat16:
        raise TypeError(f"o: expected bfloat16 attention output, got {o.dtype}")
    if o.dim() != 3:
        raise ValueError(f"o: expected [T, H, head_dim], got shape {tuple(o.shape)}")
    t, h, head_dim = o.shape
    return t, h, head_dim


def check_attn_output_args(
    o: object, positions: object, freqs: object, n_groups: object, fmt: object
) -> tuple[int, int, int]:
    """Validate the `quantize_attn_output` inputs (also run by `output_projection`); returns (T, H, head_dim).

    Raises:
        ValueError / TypeError naming the argument.
    """
    t, h, head_dim = _check_o(o)
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions: expected a tensor, got {type(positions).__name__}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions: expected int32 or int64, got {positions.dtype}")
    if tuple(positions.shape) != (t,):
        raise ValueError(f"positions: expected shape ({t},) (one per token of o), got {tuple(positions.shape)}")
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"freqs: expected a tensor, got {type(freqs).__name__}")
    if freqs.dtype != torch.float32:
        raise TypeError(f"freqs: expected float32 frequencies, got {freqs.dtype}")
    if freqs.dim() != 1 or not 0 < 2 * freqs.numel() <= head_dim:
        raise ValueError(f"freqs: expected [rope_dim / 2] with rope_dim <= head_dim ({head_dim}), "
                         f"got shape {tuple(freqs.shape)}")
    for name, tensor in (("positions", positions), ("freqs", freqs)):
        if tensor.device != o.device:  # type: ignore[union-attr]
            raise ValueError(f"{name}: on {tensor.device}, expected o's device {o.device}")  # type: ignore[union-attr]
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups <= 0 or h % n_groups:
        raise ValueError(f"n_groups: expected a positive int dividing the {h} heads of o, got {n_groups!r}")
    if (h // n_groups * head_dim) % SCALE_BLOCK:
        raise ValueError(f"n_groups: a group of {h // n_groups} heads x {head_dim} = {h // n_groups * head_dim} "
                         f"values is not a multiple of the {SCALE_BLOCK}-channel scale block")
    fp8_format(fmt)  # raises ValueError("fmt: ...")
    return t, h, head_dim


def quantize_attn_output(
    o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *, n_groups: int, fmt: str = "e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse RoPE + per-token per-128-channel FP8 quantization of the attention output (vLLM, spec §4.2).

    The inverse RoPE runs in fp32 and is **not** rounded back to bf16 (vLLM's fused kernel; the official
    bf16 path rounds, see `output_projection`). Heads are grouped head-major (`o_g` = heads 8g..8g+7
    concatenated), and each run of 128 channels gets the power-of-two scale
    `2^ceil(log2(max(amax, 1e-10) / fmt.max))`, computed on the float's bits (`formats.ue8m0_scale`) —
    vLLM computes it with a float `log2`, which can come out one binade low just above a power of two
    (spec §7.1 pitfall 1). eps = `ATTN_OUT_EPS` (vLLM's 1e-10).

    Args:
        o: [T, H, head_dim] bf16 attention output (RoPE'd dims last).
        positions: [T] int positions of the tokens.
        freqs: [rope_dim / 2] fp32 frequencies of the layer (`rope.yarn_frequencies`).
        n_groups: G, the number of `wo_a` groups.
        fmt: FP8 format name.

    Returns:
        o_fp8: [T, G, H/G*head_dim] FP8.
        o_scale: [T, G, H/G*head_dim/128] fp32 powers of two.
    """
    check_attn_output_args(o, positions, freqs, n_groups, fmt)
    rotated = apply_rope(o.float(), positions, freqs, inverse=True)  # fp32 in -> fp32 out, no bf16 round
    grouped = rearrange(rotated, "t (g h) d -> t g (h d)", g=n_groups)
    return quantize_per_token(grouped, SCALE_BLOCK, fmt, eps=ATTN_OUT_EPS)


def grouped_wo_a(wo_a: Fp8Weight, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`wo_a` [G*R, K] as DeepGEMM's einsum operand: data [G, R, K], scale [G, R/128, K/128] (views)."""
    (n, k), (sn, sk) = wo_a.data.shape, wo_a.scale.shape
    return wo_a.data.view(n_groups, n // n_groups, k), wo_a.scale.view(n_groups, sn // n_groups, sk)


def check_output_projection_args(
    o: object, positions: object, freqs: object, wo_a: object, wo_b: object, numerics: object
) -> tuple[int, int]:
    """Validate the `output_projection` inputs; returns (G, R) = (groups, o_lora_rank).

    G is implied by the shapes: `wo_a` is [G*R, H/G*head_dim], so G = H*head_dim / wo_a's K.

    Raises:
        ValueError / TypeError naming the argument.
    """
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics: expected a Numerics, got {type(numerics).__name__}")
    if not isinstance(wo_a, Fp8Weight):
        raise TypeError(f"wo_a: expected an Fp8Weight, got {type(wo_a).__name__}")
    if not isinstance(wo_b, Fp8Weight):
        raise TypeError(f"wo_b: expected an Fp8Weight, got {type(wo_b).__name__}")
    for name, w in (("wo_a", wo_a), ("wo_b", wo_b)):
        if w.data.dim() != 2:
            raise ValueError(f"{name}: expected a 2-d [N, K] weight, got shape {tuple(w.data.shape)}")
    _, h, head_dim = _check_o(o)
    n, k = wo_a.data.shape
    if k == 0 or (h * head_dim) % k or h % ((h * head_dim) // k):
        raise ValueError(f"wo_a: its K = {k} must be a whole number of o's heads ({head_dim} each) splitting the "
                         f"{h} heads into equal groups; got wo_a of shape {(n, k)}")
    groups = h * head_dim // k
    if n % (groups * FP8_WEIGHT_BLOCK):
        raise ValueError(f"wo_a: its N = {n} must be G x R with R a multiple of {FP8_WEIGHT_BLOCK} (G = {groups})")
    check_attn_output_args(o, positions, freqs, groups, numerics.fp8_format)
    if wo_b.data.shape[1] != n:
        raise ValueError(f"wo_b: expected K = G*R = {n} (wo_a's N), got shape {tuple(wo_b.data.shape)}")
    if numerics.wo_a == "fp8" and wo_a.data.dtype != fp8_format(numerics.fp8_format).dtype:
        raise TypeError(f"wo_a: stored as {wo_a.data.dtype}, but the FP8 einsum needs "
                        f"numerics.fp8_format ({numerics.fp8_format!r}) on both operands")
    for name, w in (("wo_a", wo_a), ("wo_b", wo_b)):
        if w.data.device != o.device or w.scale.device != o.device:  # type: ignore[union-attr]
            raise ValueError(f"{name}: on {w.data.device}, expected o's device {o.device}")  # type: ignore[union-attr]
    return groups, n // groups


def output_projection(
    o: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor,
    wo_a: Fp8Weight,
    wo_b: Fp8Weight,
    numerics: Numerics,
) -> torch.Tensor:
    """Attention output -> hidden state: inverse RoPE, grouped low-rank `wo_a`, then `wo_b` (spec §3.6).

    `numerics.wo_a == "bf16"` is the official path: inverse RoPE rounded to bf16, bf16 einsum with the
    dequantized (bf16) `wo_a`, bf16 z. `"fp8"` is the vLLM / DeepGEMM path: `quantize_attn_output` then
    `fp8_einsum('bhr,hdr->bhd')` with recipe (1, 128, 128). Both end in the block-FP8 linear `wo_b`.

    Args:
        o: [T, H, head_dim] bf16.
        positions: [T] int.
        freqs: [rope_dim / 2] fp32 (the layer's frequencies).
        wo_a: `Fp8Weight` [G*R, H/G*head_dim].
        wo_b: `Fp8Weight` [D, G*R].
        numerics: which quantization the product simulates.

    Returns:
        [T, D] bf16.
    """
    groups, _ = check_output_projection_args(o, positions, freqs, wo_a, wo_b, numerics)
    w, w_scale = grouped_wo_a(wo_a, groups)
    if numerics.wo_a == "bf16":
        rotated = apply_rope(o, positions, freqs, inverse=True)  # official: bf16 out
        grouped = rearrange(rotated, "t (g h) d -> t g (h d)", g=groups)
        w_bf16 = dequantize_operand(w, w_scale, (1, FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK)).to(torch.bfloat16)
        z = einsum_fp32("tgk,grk->tgr", grouped, w_bf16).to(torch.bfloat16)
    else:
        o_fp8, o_scale = quantize_attn_output(o, positions, freqs, n_groups=groups, fmt=numerics.fp8_format)
        z = fp8_einsum("bhr,hdr->bhd", (o_fp8, o_scale), (w, w_scale), recipe=(1, 128, 128))
    return fp8_linear(z.flatten(1), wo_b, numerics)
