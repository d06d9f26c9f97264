"""The DeepGEMM backend of the MoE ops (spec §5, §5.6): DeepGEMM's grouped FP8 GEMMs for the experts, the
Triton kernels for everything DeepGEMM has no kernel for (routing, permute, SwiGLU, combine).

    x -> act_quant (Triton, per 128, scales in DeepGEMM's MN-major layout), once per token
      -> permute (Triton) -> gather the token rows into the grouped layout (Triton)
      -> gate/up: m_grouped_fp8_gemm_nt_{masked | contiguous}  -> bf16 [rows, 2I]
      -> swiglu_quant (Triton): clamp, silu * up, * routing weight, bf16, FP8 per 128 -> [rows, I] + scales
      -> down:    m_grouped_fp8_gemm_nt_{masked | contiguous}  -> bf16 [rows, D]
      -> combine (Triton): fp32 sum over the k slots in ascending expert id (+ shared) -> bf16
    shared expert: fp8_gemm_nt -> swiglu_quant -> fp8_gemm_nt on the same quantized x.

Two grouped layouts (DeepGEMM 2.8.2, SM90 1D2D kernels: A e4m3fn K-major with fp32 per-128 scales,
MN-major and TMA-aligned; B the experts' [E, N, K] e4m3fn with [E, N/128, K/128] fp32 scales; D bf16):
  * masked (`m_grouped_fp8_gemm_nt_masked`), T <= MASKED_MAX_TOKENS: A is [E, capacity, K] with expert e's
    rows at [e, 0:count_e); `masked_m` = the counts stay on the device, so the step never waits for the
    host (and can be captured in a CUDA graph). capacity = T rounded up to MASKED_ROW_ALIGN: DeepGEMM
    stores whole BLOCK_M row tiles, so a capacity that is not a multiple of its BLOCK_M (64 or 128) would
    let one expert's tile overwrite the next expert's rows. Rows hold distinct tokens, so a routing row
    that repeats an expert id needs the contiguous layout (`optimized.moe` picks it then).
  * contiguous (`m_grouped_fp8_gemm_nt_contiguous`), larger T: rows of expert e packed after e - 1's, each
    segment padded to `get_mk_alignment_for_contiguous_layout()` (128 on SM90), `grouped_layout` = the
    expert of each row, -1 on padding. The row count is read back from the device once per call: DeepGEMM
    loads A and B tiles even for blocks it skips, so trailing empty blocks must not be passed to it.

MASKED_MAX_TOKENS is where the layouts cross, from `dsv4-bench --ops experts` (both layouts timed at every T
through `experts(..., layout=...)`, the benchmark hook). FLASH on the H100, 2026-12-02, graph replays, masked
vs contiguous: T=8 450 vs 1267 us, T=64 1810 vs 2269, T=128 2196 vs 2724, T=512 2425 vs 3203, T=4096 2902 vs
3598. Masked wins at every T, but its buffers grow as E x T rows (A FP8, gate/up and down outputs bf16:
~20 GB at T=4096 on FLASH, ~2.5 GB at 512), and at T=8192 it does not fit next to the weights. 512 keeps it
to a few GB; above, the contiguous layout (memory ~ T x k rows) takes over.
"""

from __future__ import annotations

import torch

from optimized.deepgemm import deep_gemm
from optimized.triton.moe_gemm import swiglu_quant
from optimized.triton.moe_permute import MoeLayout, combine, gather_rows, permute
from optimized.triton.moe_pipeline import activation, clamp_limit, route
from reference.config import DSv4Config
from reference.moe import MoEWeights
from reference.numerics import Numerics
from reference.weights import FP8_WEIGHT_BLOCK, Fp4Weight, Fp8Weight

# Largest token count that runs on the masked layout (decode); above it, the contiguous layout (prefill).
MASKED_MAX_TOKENS = 512
# The masked layout's capacity per expert is T rounded up to this (a multiple of every BLOCK_M DeepGEMM's
# SM90 masked kernel picks: 64 or 128), so its whole-tile stores stay inside the expert's rows.
MASKED_ROW_ALIGN = 128
# TMA needs 16-byte aligned strides: an MN-major fp32 scale column is padded to a multiple of 4 rows.
TMA_ALIGN_FP32 = 4
LAYOUTS = ("masked", "contiguous")


def check_supported(numerics: Numerics) -> None:
    """What DeepGEMM's SM90 FP8 GEMMs need beyond `optimized.moe`'s checks (ValueError naming the argument);
    the weights' FP8 format equals `numerics.fp8_format` there."""
    if numerics.fp8_format != "e4m3fn":
        raise ValueError(f"numerics: DeepGEMM supports fp8_format 'e4m3fn' only, got {numerics.fp8_format!r}")
    if not numerics.act_quant:
        raise ValueError("numerics: DeepGEMM runs FP8 activations only (act_quant=True); EXACT numerics need the "
                         "triton or reference backend")
    if numerics.act_block != 128:
        raise ValueError(f"numerics: DeepGEMM's SM90 FP8 GEMMs need act_block 128 (gran_k), got {numerics.act_block}")
    if not numerics.gate_up_bf16:
        raise ValueError("numerics: DeepGEMM writes gate/up in bf16; gate_up_bf16=False needs the triton backend")


def _mn_major_scales(lead: tuple[int, ...], rows: int, k: int, device: torch.device) -> torch.Tensor:
    """Empty fp32 scales [*lead, rows, k / 128] in DeepGEMM's MN-major TMA-aligned layout (rows contiguous,
    each column padded to a multiple of 4 rows)."""
    blocks = k // FP8_WEIGHT_BLOCK
    padded = -(-rows // TMA_ALIGN_FP32) * TMA_ALIGN_FP32
    storage = torch.empty((*lead, blocks, padded), dtype=torch.float32, device=device)
    return storage.transpose(-1, -2)[..., :rows, :]


def routed_rows(
    q: torch.Tensor, q_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Fp8Weight,
    w2: Fp8Weight, *, swiglu_limit: float, layout: str,
) -> tuple[torch.Tensor, MoeLayout]:
    """The routed experts' bf16 outputs, one row per placed (token, slot), and the slot -> row layout.

    Args:
        q, q_scale: [T, D] e4m3fn token rows and their [T, D / 128] fp32 scales (any strides).
        topk_ids: [T, k] int32 contiguous; topk_weights: [T, k] fp32 contiguous.
        w13, w2: [E, 2I, D] and [E, D, I] e4m3fn experts.
        swiglu_limit: the clamp (<= 0: none).
        layout: "masked" or "contiguous".
    """
    dg = deep_gemm()
    n_tokens, topk = topk_ids.shape
    n_experts, two_inter, dim = w13.data.shape
    inter = two_inter // 2
    device = q.device
    weights = topk_weights.reshape(-1)
    limit = clamp_limit(swiglu_limit)
    if layout == "masked":
        capacity = -(-n_tokens // MASKED_ROW_ALIGN) * MASKED_ROW_ALIGN
        rows = permute(topk_ids, n_experts, capacity=capacity, write_rows=False)
        n_slots = n_tokens * topk
        expected_m = max(1, -(-n_slots // min(n_experts, n_slots)))  # mean rows of an active expert
        a = torch.empty((n_experts, capacity, dim), dtype=q.dtype, device=device)
        a_scale = _mn_major_scales((n_experts,), capacity, dim, device)
        gather_rows(q, q_scale, rows, topk, a, a_scale)
        gate_up = torch.empty((n_experts, capacity, two_inter), dtype=torch.bfloat16, device=device)
        dg.m_grouped_fp8_gemm_nt_masked((a, a_scale), (w13.data, w13.scale), gate_up, rows.expert_count, expected_m)
        h = torch.empty((n_experts, capacity, inter), dtype=q.dtype, device=device)
        h_scale = _mn_major_scales((n_experts,), capacity, inter, device)
        swiglu_quant(gate_up.view(-1, two_inter), h, h_scale, fmt="e4m3fn", limit=limit, layout=rows,
                     topk_weights=weights)
        y = torch.empty((n_experts, capacity, dim), dtype=torch.bfloat16, device=device)
        dg.m_grouped_fp8_gemm_nt_masked((h, h_scale), (w2.data, w2.scale), y, rows.expert_count, expected_m)
        return y.view(-1, dim), rows
    rows = permute(topk_ids, n_experts, align=dg.get_mk_alignment_for_contiguous_layout())
    n_rows = int(rows.expert_start[n_experts])  # the one device read (see the module docstring)
    y = torch.empty((n_rows, dim), dtype=torch.bfloat16, device=device)
    if n_rows == 0:
        return y, rows
    grouped_layout = rows.row_expert[:n_rows]
    a = torch.empty((n_rows, dim), dtype=q.dtype, device=device)
    a_scale = _mn_major_scales((), n_rows, dim, device)
    gather_rows(q, q_scale, rows, topk, a, a_scale)
    gate_up = torch.empty((n_rows, two_inter), dtype=torch.bfloat16, device=device)
    dg.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w13.data, w13.scale), gate_up, grouped_layout)
    h = torch.empty((n_rows, inter), dtype=q.dtype, device=device)
    h_scale = _mn_major_scales((), n_rows, inter, device)
    swiglu_quant(gate_up, h, h_scale, fmt="e4m3fn", limit=limit, layout=rows, topk_weights=weights)
    dg.m_grouped_fp8_gemm_nt_contiguous((h, h_scale), (w2.data, w2.scale), y, grouped_layout)
    return y, rows


def shared_rows(q: torch.Tensor, q_scale: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, *,
                swiglu_limit: float) -> torch.Tensor:
    """The shared expert on the quantized tokens (`fp8_gemm_nt` twice, SwiGLU between): [T, D] bf16.

    q_scale must already be in DeepGEMM's MN-major layout (`activation(..., scale_layout="deepgemm")`).
    """
    dg = deep_gemm()
    n_tokens = q.shape[0]
    two_inter, dim = w13.data.shape
    gate_up = torch.empty((n_tokens, two_inter), dtype=torch.bfloat16, device=q.device)
    dg.fp8_gemm_nt((q, q_scale), (w13.data, w13.scale), gate_up)
    h = torch.empty((n_tokens, two_inter // 2), dtype=q.dtype, device=q.device)
    h_scale = _mn_major_scales((), n_tokens, two_inter // 2, q.device)
    swiglu_quant(gate_up, h, h_scale, fmt="e4m3fn", limit=clamp_limit(swiglu_limit))
    y = torch.empty((n_tokens, dim), dtype=torch.bfloat16, device=q.device)
    dg.fp8_gemm_nt((h, h_scale), (w2.data, w2.scale), y)
    return y


def _layout(n_tokens: int, layout: str | None) -> str:
    if layout is None:
        return "masked" if n_tokens <= MASKED_MAX_TOKENS else "contiguous"
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS} or None, got {layout!r}")
    return layout


def experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Fp8Weight | Fp4Weight,
    w2: Fp8Weight | Fp4Weight, *, swiglu_limit: float, numerics: Numerics, layout: str | None = None,
) -> torch.Tensor:
    """`reference.moe.experts` on DeepGEMM's grouped GEMMs: [T, D] bf16.

    `layout`: "masked", "contiguous", or None (masked for T <= MASKED_MAX_TOKENS) — the benchmark hook.
    """
    from optimized.moe import fp8_experts

    kind = _layout(x.shape[0], layout)
    check_supported(numerics)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    w13, w2 = fp8_experts(w13, w2, numerics.fp8_format)
    ids = topk_ids.to(torch.int32).contiguous()
    q, q_scale = activation(x, numerics, scale_layout="deepgemm")
    y, rows = routed_rows(q, q_scale, ids, topk_weights.float().contiguous(), w13, w2, swiglu_limit=swiglu_limit,
                          layout=kind)
    return combine(y, rows, ids)


def moe(
    x: torch.Tensor, weights: MoEWeights, *, token_ids: torch.Tensor | None, cfg: DSv4Config, numerics: Numerics,
    layout: str | None = None,
) -> torch.Tensor:
    """`reference.moe.moe` with DeepGEMM's GEMMs (routing in Triton): [T, D] bf16. `layout` as in `experts`."""
    from optimized.moe import fp8_experts

    kind = _layout(x.shape[0], layout)
    check_supported(numerics)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    w13, w2 = fp8_experts(weights.w13, weights.w2, numerics.fp8_format)
    ids, topk_weights = route(x, weights.gate, weights.bias, token_ids=token_ids, tid2eid=weights.tid2eid, cfg=cfg)
    q, q_scale = activation(x, numerics, scale_layout="deepgemm")
    y, rows = routed_rows(q, q_scale, ids, topk_weights, w13, w2, swiglu_limit=cfg.swiglu_limit, layout=kind)
    shared_limit = cfg.swiglu_limit if numerics.shared_expert_clamp else 0.0
    shared = shared_rows(q, q_scale, weights.shared_w13, weights.shared_w2, swiglu_limit=shared_limit)
    return combine(y, rows, ids, shared)
