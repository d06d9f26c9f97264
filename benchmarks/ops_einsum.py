"""Benchmarks of the output-projection family (issue #2): the FP8 einsum, its activation quantization, the whole
output projection, and the block-FP8 linears.

Shapes (spec §3.6, §4; DeepGEMM letters for the einsum): `o [T, H, 512]` bf16, `G = o_groups` groups of
`r = 4096` (8 heads x 512), `d = o_lora_rank = 1024`; `wo_a` `[G*1024, 4096]` and `wo_b` `[D, G*1024]` block FP8.
Work is counted from these shapes:
  * fp8_einsum: 2*T*G*r*d FLOP; bytes = A (fp8) + its scales + B (fp8) + its scales + Z (bf16).
  * quantize_attn_output: no matmul; bytes = o (bf16) + o_fp8 + scales.
  * quant+einsum (the deepgemm target's "including activation quantization"): the einsum's FLOP; bytes =
    o (bf16) + B + Z (the FP8 intermediate is not minimal traffic).
  * output_projection: einsum + `wo_b` GEMM FLOP; bytes = o + wo_a + wo_b + out.
  * fp8_linear: 2*T*N*K FLOP; bytes = x (bf16) + W (fp8) + scales + y (bf16), for `wq_b` `[H*512, q_lora]` and
    `wo_b` `[D, G*1024]`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from benchmarks.baselines import check_close, deep_gemm, deepgemm_scales, scaled_mm_blockwise
from benchmarks.roofline import Work
from benchmarks.suite import Env, Family, OpBench, Point, backend_candidates, baseline, implemented
from reference.formats import dequantize_per_token, quantize_per_token
from reference.numerics import OFFICIAL, VLLM_NVIDIA
from reference.rope import yarn_frequencies
from reference.weights import Fp8Weight

EXPR = "bhr,hdr->bhd"
FP32 = 4  # bytes of an fp32 scale
BF16 = 2


@dataclass
class EinsumContext:
    """One config's weights for the family, built once.

    Attributes:
        wo_a: [G*R, 4096] block FP8; wo_b: [D, G*R]; wq_b: [H*512, q_lora].
        freqs: [32] fp32 RoPE frequencies of a compressed layer (the inverse RoPE of the output).
        bf16: dequantized bf16 copies for the torch bf16 baselines, by name.
    """

    wo_a: Fp8Weight
    wo_b: Fp8Weight
    wq_b: Fp8Weight
    freqs: torch.Tensor
    bf16: dict[str, torch.Tensor]

    def einsum_b(self, env: Env) -> tuple[torch.Tensor, torch.Tensor]:
        """`wo_a` as the einsum's B operand: ([G, R, r] fp8, [G, R/128, r/128] fp32)."""
        g, r = env.cfg.o_groups, env.cfg.o_lora_rank
        return self.wo_a.data.view(g, r, -1), self.wo_a.scale.view(g, r // 128, -1)


def setup(env: Env) -> EinsumContext:
    cfg = env.cfg
    wo_a = env.fp8_weight(cfg.o_groups * cfg.o_lora_rank, cfg.o_group_dim, salt=1)
    wo_b = env.fp8_weight(cfg.dim, cfg.o_groups * cfg.o_lora_rank, salt=2)
    wq_b = env.fp8_weight(cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, salt=3)
    bf16 = {
        "wo_a": wo_a.dequantize().to(torch.bfloat16).view(cfg.o_groups, cfg.o_lora_rank, cfg.o_group_dim),
        "wo_b": wo_b.dequantize().to(torch.bfloat16),
        "wq_b": wq_b.dequantize().to(torch.bfloat16),
    }
    return EinsumContext(wo_a, wo_b, wq_b, yarn_frequencies(cfg, 4).to(env.device), bf16)


# ------------------------------------------------------------------------------------------------
# Work
# ------------------------------------------------------------------------------------------------


def _fp8_weight_bytes(w: Fp8Weight) -> float:
    return w.data.numel() + w.scale.numel() * FP32


def einsum_work(env: Env, tokens: int, *, quantized_input: bool = True) -> Work:
    cfg = env.cfg
    g, r, d = cfg.o_groups, cfg.o_group_dim, cfg.o_lora_rank
    weights = g * d * r + g * (d // 128) * (r // 128) * FP32
    a_bytes = tokens * g * r * (1 + FP32 / 128) if quantized_input else tokens * cfg.n_heads * cfg.head_dim * BF16
    return Work(2.0 * tokens * g * r * d, a_bytes + weights + tokens * g * d * BF16, "fp8", weights)


def quantize_work(env: Env, tokens: int) -> Work:
    cfg = env.cfg
    o = tokens * cfg.n_heads * cfg.head_dim
    return Work(0.0, o * BF16 + o * (1 + FP32 / 128), "none")


def linear_work(tokens: int, w: Fp8Weight) -> Work:
    n, k = w.shape
    return Work(2.0 * tokens * n * k, tokens * k * BF16 + _fp8_weight_bytes(w) + tokens * n * BF16, "fp8",
                _fp8_weight_bytes(w))


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def _einsum_shape(env: Env, tokens: int) -> str:
    cfg = env.cfg
    return f"b={tokens},h={cfg.o_groups},r={cfg.o_group_dim},d={cfg.o_lora_rank}"


def _attn_output(env: Env, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o [T, H, 512] bf16 (unit Gaussian, like softmax-weighted sums of normed rows) and positions [T]."""
    cfg = env.cfg
    o = env.randn(tokens, cfg.n_heads, cfg.head_dim, salt=100 + tokens)
    return o, torch.arange(tokens, device=env.device, dtype=torch.int64)


def _quantized_a(ctx: EinsumContext, env: Env, o: torch.Tensor, positions: torch.Tensor,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The einsum's A operand as `backend`'s own quantization kernel lays it out (its scale layout included);
    the reference's per-token quantization where that backend has no quantization kernel."""
    import optimized

    if implemented("quantize_attn_output"):
        try:
            return optimized.quantize_attn_output(o, positions, ctx.freqs, n_groups=env.cfg.o_groups, fmt=env.fmt,
                                                  backend=backend)
        except (ValueError, RuntimeError):
            pass  # that backend has no quantization kernel: feed it the reference layout
    return quantize_per_token(o.reshape(o.shape[0], env.cfg.o_groups, -1), 128, env.fmt)


# ------------------------------------------------------------------------------------------------
# Points
# ------------------------------------------------------------------------------------------------


def fp8_einsum_point(ctx: EinsumContext, env: Env, tokens: int) -> Point:
    import optimized

    cfg = env.cfg
    o, positions = _attn_output(env, tokens)
    b = ctx.einsum_b(env)

    def call(backend: str):
        a = _quantized_a(ctx, env, o, positions, backend)
        return lambda: optimized.fp8_einsum(EXPR, a, b, backend=backend)

    cands = backend_candidates("fp8_einsum", call)
    # Baselines on the same quantized operands (row-major per-token scales), checked against the fp32 einsum of them.
    a_q, a_s = quantize_per_token(o.reshape(tokens, cfg.o_groups, -1), 128, env.fmt)
    want = functools.cache(lambda: torch.einsum(EXPR, dequantize_per_token(a_q, a_s),
                                                ctx.wo_a.dequantize().view(*b[0].shape)))
    cands.append(baseline("torch bf16 einsum", lambda: _torch_bf16_einsum(ctx, o)))
    cands.append(baseline("torch _scaled_mm block-wise, per group", lambda: _scaled_mm_groups(a_q, a_s, b, want())))
    cands.append(baseline("DeepGEMM fp8_einsum (raw, aligned scales)",
                          lambda: _deepgemm_einsum(a_q, a_s, b, want())))
    return Point("fp8_einsum", cfg.name, tokens, _einsum_shape(env, tokens), einsum_work(env, tokens), cands,
                 note="inputs pre-quantized by each backend's own quantization kernel")


def quant_einsum_point(ctx: EinsumContext, env: Env, tokens: int) -> Point:
    import optimized

    cfg = env.cfg
    o, positions = _attn_output(env, tokens)
    b = ctx.einsum_b(env)

    def call(backend: str):
        def run() -> torch.Tensor:
            a = optimized.quantize_attn_output(o, positions, ctx.freqs, n_groups=cfg.o_groups, fmt=env.fmt,
                                               backend=backend)
            return optimized.fp8_einsum(EXPR, a, b, backend=backend)
        return run

    cands = backend_candidates(("quantize_attn_output", "fp8_einsum"), call)
    cands.append(baseline("torch bf16 einsum", lambda: _torch_bf16_einsum(ctx, o)))
    return Point("quant+einsum", cfg.name, tokens, _einsum_shape(env, tokens),
                 einsum_work(env, tokens, quantized_input=False), cands,
                 note="quantize_attn_output (inverse RoPE + FP8) then fp8_einsum; FLOP of the einsum")


def quantize_point(ctx: EinsumContext, env: Env, tokens: int) -> Point:
    import optimized

    cfg = env.cfg
    o, positions = _attn_output(env, tokens)

    def call(backend: str):
        return lambda: optimized.quantize_attn_output(o, positions, ctx.freqs, n_groups=cfg.o_groups, fmt=env.fmt,
                                                      backend=backend)

    return Point("quantize_attn_output", cfg.name, tokens, f"T={tokens},H={cfg.n_heads},G={cfg.o_groups}",
                 quantize_work(env, tokens), backend_candidates("quantize_attn_output", call),
                 note="no baseline: the eager reference is the torch implementation")


def output_projection_point(ctx: EinsumContext, env: Env, tokens: int) -> Point:
    import optimized

    cfg = env.cfg
    o, positions = _attn_output(env, tokens)
    numerics = VLLM_NVIDIA.replace(fp8_format=env.fmt)

    def call(backend: str):
        return lambda: optimized.output_projection(o, positions, ctx.freqs, ctx.wo_a, ctx.wo_b, numerics,
                                                   backend=backend)

    weights = _fp8_weight_bytes(ctx.wo_a) + _fp8_weight_bytes(ctx.wo_b)
    flops = 2.0 * tokens * (ctx.wo_a.shape[0] * ctx.wo_a.shape[1] + ctx.wo_b.shape[0] * ctx.wo_b.shape[1])
    work = Work(flops, tokens * cfg.n_heads * cfg.head_dim * BF16 + weights + tokens * cfg.dim * BF16, "fp8", weights)
    cands = backend_candidates("output_projection", call)
    cands.append(baseline("torch bf16 einsum + matmul", lambda: _torch_bf16_projection(ctx, o)))
    return Point("output_projection", cfg.name, tokens, f"T={tokens},G={cfg.o_groups},D={cfg.dim}", work, cands,
                 note="numerics VLLM_NVIDIA (FP8 wo_a einsum) for every backend")


def linear_point(name: str):
    """The `fp8_linear` point maker for weight `name` ("wq_b" or "wo_b")."""

    def make(ctx: EinsumContext, env: Env, tokens: int) -> Point:
        import optimized

        w: Fp8Weight = getattr(ctx, name)
        n, k = w.shape
        x = env.randn(tokens, k, salt=200 + tokens)
        numerics = OFFICIAL.replace(fp8_format=env.fmt)

        def call(backend: str):
            return lambda: optimized.fp8_linear(x, w, numerics, backend=backend)

        cands = backend_candidates("fp8_linear", call)
        w_bf16 = ctx.bf16[name]
        cands.append(baseline("torch bf16 matmul", lambda: lambda: x @ w_bf16.T))
        xq, xs = quantize_per_token(x, 128, env.fmt)
        want = functools.cache(lambda: dequantize_per_token(xq, xs) @ w.dequantize().T)
        cands.append(baseline("torch _scaled_mm block-wise (pre-quantized x)",
                              lambda: scaled_mm_blockwise(xq, xs, w.data, w.scale, want())))
        cands.append(baseline("DeepGEMM fp8_gemm_nt (raw, pre-quantized x)",
                              lambda: _deepgemm_gemm(xq, xs, w, want())))
        return Point(f"fp8_linear[{name}]", env.cfg.name, tokens, f"M={tokens},N={n},K={k}", linear_work(tokens, w),
                     cands, note="OFFICIAL numerics: x quantized per token per 128 inside the op")

    return make


# ------------------------------------------------------------------------------------------------
# Baselines
# ------------------------------------------------------------------------------------------------


def _torch_bf16_einsum(ctx: EinsumContext, o: torch.Tensor):
    x = o.reshape(o.shape[0], ctx.bf16["wo_a"].shape[0], -1)
    w = ctx.bf16["wo_a"]
    return lambda: torch.einsum(EXPR, x, w)


def _torch_bf16_projection(ctx: EinsumContext, o: torch.Tensor):
    x = o.reshape(o.shape[0], ctx.bf16["wo_a"].shape[0], -1)
    wa, wb = ctx.bf16["wo_a"], ctx.bf16["wo_b"]
    return lambda: torch.einsum(EXPR, x, wa).flatten(1) @ wb.T


def _scaled_mm_groups(a_q: torch.Tensor, a_s: torch.Tensor, b: tuple[torch.Tensor, torch.Tensor],
                      want: torch.Tensor):
    """One block-scaled `_scaled_mm` per group (torch has no batched block-scaled FP8 GEMM); operands split per
    group before timing."""
    groups = []
    for g in range(b[0].shape[0]):
        groups.append(scaled_mm_blockwise(a_q[:, g].contiguous(), a_s[:, g].contiguous(), b[0][g], b[1][g], want[:, g]))
    return lambda: [call() for call in groups]


def _deepgemm_einsum(a_q: torch.Tensor, a_s: torch.Tensor, b: tuple[torch.Tensor, torch.Tensor], want: torch.Tensor):
    dg = deep_gemm()
    # DeepGEMM permutes A to [h, b, r] (stored that way here, as the deepgemm backend's quantization stores it) and
    # its scales to [h, b, r/128], which it wants MN-major and TMA-aligned.
    a_q = a_q.transpose(0, 1).contiguous().transpose(0, 1)
    sfa = deepgemm_scales(a_s.permute(1, 0, 2).contiguous()).permute(1, 0, 2)
    out = torch.empty(want.shape, dtype=torch.bfloat16, device=want.device)
    dg.fp8_einsum(EXPR, (a_q, sfa), b, out)
    check_close("DeepGEMM fp8_einsum", out, want)
    return lambda: dg.fp8_einsum(EXPR, (a_q, sfa), b, out)


def _deepgemm_gemm(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, want: torch.Tensor):
    dg = deep_gemm()
    sfa = deepgemm_scales(xs)
    out = torch.empty(want.shape, dtype=torch.bfloat16, device=want.device)
    dg.fp8_gemm_nt((xq, sfa), (w.data, w.scale), out)
    check_close("DeepGEMM fp8_gemm_nt", out, want)
    return lambda: dg.fp8_gemm_nt((xq, sfa), (w.data, w.scale), out)


FAMILY = Family(
    name="einsum",
    setup=setup,
    ops=(
        OpBench("fp8_einsum", "grouped FP8 einsum 'bhr,hdr->bhd' (wo_a), pre-quantized activations", fp8_einsum_point),
        OpBench("quantize_attn_output", "inverse RoPE + per-128 FP8 quantization of the attention output",
                quantize_point),
        OpBench("quant+einsum", "quantize_attn_output then fp8_einsum (the deepgemm target's path)",
                quant_einsum_point),
        OpBench("output_projection", "inverse RoPE, FP8 quantization, wo_a einsum, wo_b linear",
                output_projection_point),
        OpBench("fp8_linear[wq_b]", "block-FP8 linear q_lora -> H*512 (activation quantization included)",
                linear_point("wq_b")),
        OpBench("fp8_linear[wo_b]", "block-FP8 linear G*1024 -> D (activation quantization included)",
                linear_point("wo_b")),
    ),
)
