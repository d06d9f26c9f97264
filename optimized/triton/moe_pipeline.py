"""The Triton backend of the MoE ops (spec §5): `route`, `experts`, `moe`, built from the kernels of
`moe_routing`, `moe_permute`, `moe_gemm` and the activation quantization of `quant`.

    route:    router_logits -> router_topk
    experts:  act_quant(x) once per token -> permute -> gate/up GEMM (gathers token rows; SwiGLU, clamp,
              routing weight and the FP8 quantization in its epilogue) -> down GEMM -> combine
    moe:      route -> experts' rows + the shared expert (the same two GEMMs, ungrouped, on the same
              quantized x; at decode split over K, `moe_gemm.split_k_for`) -> combine (the shared output added
              in fp32 before the one bf16 cast)

Inputs are validated by `optimized.moe` (the public API) before these run; every function here
returns without launching a kernel when T = 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from optimized.backends import detect
from optimized.triton.aot import tile_platform
from optimized.triton.einsum import num_sms
from optimized.triton.moe_gemm import (
    GemmConfig,
    block_parts,
    choose_config,
    grouped_gemm,
    narrow_gate_up_for,
    split_k_for,
)
from optimized.triton.moe_permute import MoeLayout, combine, compact_rows, permute
from optimized.triton.moe_routing import router_logits, router_topk
from optimized.triton.quant import quantize_per_token
from reference.config import DSv4Config
from reference.moe import MoEWeights
from reference.numerics import Numerics
from reference.weights import Fp4Weight, Fp8Weight

if TYPE_CHECKING:
    from optimized.moe import TiledFp8Weight


def clamp_limit(swiglu_limit: float) -> float:
    """The SwiGLU clamp the kernels take: `swiglu_limit`, or +inf for `<= 0` (no clamp, as the reference)."""
    return swiglu_limit if swiglu_limit > 0 else float("inf")


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, *, token_ids: torch.Tensor | None,
    tid2eid: torch.Tensor | None, cfg: DSv4Config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.moe.route` in two Triton kernels: ids [T, k] int32, weights [T, k] fp32."""
    k = cfg.n_activated_experts
    if x.shape[0] == 0:
        return (torch.empty((0, k), dtype=torch.int32, device=x.device),
                torch.empty((0, k), dtype=torch.float32, device=x.device))
    logits = router_logits(x, gate_weight)
    return router_topk(logits, bias, topk=k, route_scale=cfg.route_scale,
                       token_ids=token_ids if tid2eid is not None else None, tid2eid=tid2eid)


def activation(x: torch.Tensor, numerics: Numerics, scale_layout: str = "row_major") -> tuple[torch.Tensor,
                                                                                             torch.Tensor | None]:
    """The experts' A operand: `act_quant(x, act_block)` (FP8 + scales), or x itself (bf16) in EXACT numerics."""
    if not numerics.act_quant:
        return x, None
    return quantize_per_token(x, numerics.act_block, numerics.fp8_format, scale_layout=scale_layout)


Shape = tuple[int, ...]


def _tiles(rows_per_expert: float, w13: Shape, w2: Shape, tiled: bool = False) -> tuple[GemmConfig, GemmConfig]:
    """The gate/up and down GEMMs' tiles (`choose_config`) for weights of logical shapes [.., 2I, D] and [.., D, I],
    tiled (`optimized.moe.tile_experts`) or not."""
    interpret, platform = detect().interpret, tile_platform()
    return (choose_config(rows_per_expert, w13[-2] // 2, True, interpret=interpret, platform=platform, tiled=tiled),
            choose_config(rows_per_expert, w2[-2], False, interpret=interpret, platform=platform, tiled=tiled))


def _split_k(gate_up: GemmConfig, down: GemmConfig, n_rows: int, w13: Shape, w2: Shape,
             device: torch.device) -> tuple[GemmConfig, GemmConfig]:
    """Both tiles with `split_k_for`'s K split for a grid of `n_rows` rows (weights of logical shapes w13, w2)."""
    platform, sms = tile_platform(), num_sms(device)
    return (split_k_for(gate_up, n_rows, w13[-2] // 2, w13[-1], sms, True, platform),
            split_k_for(down, n_rows, w2[-2], w2[-1], sms, False, platform))


def routed_rows(
    a: torch.Tensor, a_scale: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: Fp8Weight | TiledFp8Weight, w2: Fp8Weight | TiledFp8Weight, *, swiglu_limit: float, numerics: Numerics,
) -> tuple[torch.Tensor, MoeLayout]:
    """The routed experts' outputs, one bf16 row per (token, slot) in the expert-sorted layout.

    Args:
        a, a_scale: the activation of `activation(x)`.
        topk_ids: [T, k] int32 contiguous; topk_weights: [T, k] fp32 contiguous.
        w13, w2: [E, 2I, D] and [E, D, I] FP8 experts in `numerics.fp8_format`, row-major or tiled.

    Returns:
        y [n_rows, D] bf16 and the layout that maps slots to its rows.
    """
    n_tokens, topk = topk_ids.shape
    n_experts = w13.data.shape[0]
    n_slots = n_tokens * topk
    rows_per_expert = n_slots / max(min(n_experts, n_slots), 1)
    gate_up, down = _tiles(rows_per_expert, w13.shape, w2.shape, tiled=w13.data.dim() == 5)
    n_out = w13.shape[-2] // 2
    if numerics.act_quant:
        gate_up = narrow_gate_up_for(gate_up, compact_rows(n_slots, n_experts, gate_up.block_m), n_out,
                                     numerics.act_block, num_sms(a.device), tile_platform())
    # gate/up tiles narrower than a quantization block count their arrivals per row block and block (`grouped_gemm`)
    narrow = numerics.act_quant and block_parts(gate_up, numerics.act_block) > 1
    layout = permute(topk_ids, n_experts, align=gate_up.block_m,
                     arrivals_per_block=n_out // numerics.act_block if narrow else 0)
    gate_up, down = _split_k(gate_up, down, layout.n_rows, w13.shape, w2.shape, a.device)
    common = {"layout": layout, "numerics_fmt": numerics.fp8_format, "act_block": numerics.act_block}
    h, h_scale = grouped_gemm(a, a_scale, w13.data, w13.scale, config=gate_up, swiglu=True, topk=topk, gather=True,
                              topk_weights=topk_weights.reshape(-1), limit=clamp_limit(swiglu_limit),
                              gate_up_bf16=numerics.gate_up_bf16, arrivals=layout.arrivals, **common)
    y, _ = grouped_gemm(h, h_scale, w2.data, w2.scale, config=down, swiglu=False, **common)
    return y, layout


def shared_rows(
    a: torch.Tensor, a_scale: torch.Tensor | None, w13: Fp8Weight, w2: Fp8Weight, *, swiglu_limit: float,
    numerics: Numerics,
) -> torch.Tensor:
    """The shared expert (`reference.moe.shared_expert`) on the quantized tokens: [T, D] bf16."""
    n_tokens = a.shape[0]
    limit = clamp_limit(swiglu_limit if numerics.shared_expert_clamp else 0.0)
    common = {"layout": None, "numerics_fmt": numerics.fp8_format, "act_block": numerics.act_block}
    gate_up, down = _split_k(*_tiles(n_tokens, w13.shape, w2.shape), n_tokens, w13.shape, w2.shape, a.device)
    h, h_scale = grouped_gemm(a, a_scale, w13.data[None], w13.scale[None], config=gate_up, swiglu=True, limit=limit,
                              gate_up_bf16=numerics.gate_up_bf16, **common)
    y, _ = grouped_gemm(h, h_scale, w2.data[None], w2.scale[None], config=down, swiglu=False, **common)
    return y


def experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Fp8Weight | Fp4Weight | TiledFp8Weight,
    w2: Fp8Weight | Fp4Weight | TiledFp8Weight, *, swiglu_limit: float, numerics: Numerics,
) -> torch.Tensor:
    """`reference.moe.experts` on Triton kernels: [T, D] bf16."""
    from optimized.moe import fp8_experts

    if x.shape[0] == 0:
        return torch.empty_like(x)
    w13, w2 = fp8_experts(w13, w2, numerics.fp8_format)
    ids = topk_ids.to(torch.int32).contiguous()
    a, a_scale = activation(x, numerics)
    y, layout = routed_rows(a, a_scale, ids, topk_weights.float().contiguous(), w13, w2,
                            swiglu_limit=swiglu_limit, numerics=numerics)
    return combine(y, layout, ids)


def moe(
    x: torch.Tensor, weights: MoEWeights, *, token_ids: torch.Tensor | None, cfg: DSv4Config, numerics: Numerics,
    routed: tuple[TiledFp8Weight, TiledFp8Weight] | None = None,
) -> torch.Tensor:
    """`reference.moe.moe` on Triton kernels: route, routed experts, shared expert; [T, D] bf16.

    routed: the routed experts of `weights` tiled (`optimized.moe.tile_experts`), used in their place.
    """
    from optimized.moe import fp8_experts

    if x.shape[0] == 0:
        return torch.empty_like(x)
    w13, w2 = routed if routed is not None else fp8_experts(weights.w13, weights.w2, numerics.fp8_format)
    ids, topk_weights = route(x, weights.gate, weights.bias, token_ids=token_ids, tid2eid=weights.tid2eid, cfg=cfg)
    a, a_scale = activation(x, numerics)
    y, layout = routed_rows(a, a_scale, ids, topk_weights, w13, w2, swiglu_limit=cfg.swiglu_limit, numerics=numerics)
    shared = shared_rows(a, a_scale, weights.shared_w13, weights.shared_w2, swiglu_limit=cfg.swiglu_limit,
                         numerics=numerics)
    return combine(y, layout, ids, shared)
