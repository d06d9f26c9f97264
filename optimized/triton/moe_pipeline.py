"""The Triton backend of the MoE ops (spec §5): `route`, `experts`, `moe`, built from the kernels of
`moe_routing`, `moe_permute`, `moe_gemm` and the activation quantization of `quant`.

    route:    router_logits -> router_topk (at decode one launch, `router_decode`)
    experts:  act_quant(x) once per token -> permute -> gate/up GEMM (gathers token rows; SwiGLU, clamp,
              routing weight and the FP8 quantization in its epilogue) -> down GEMM -> combine
    moe:      route -> experts' rows + the shared expert (the same two GEMMs, ungrouped, on the same
              quantized x; at decode split over K, `moe_gemm.split_k_for`) -> combine (the shared output added
              in fp32 before the one bf16 cast)

Decode steps (at most `COMBINE_TOKENS` tokens, one permute chunk, FP8 activations) launch fewer kernels, with the
same arithmetic: one launch quantizes x, permutes the slots and zeroes the step's arrival counters
(`moe_permute.quantize_and_permute`), the shared expert runs before the routed GEMMs, and the routed down GEMM
combines the rows itself (`moe_gemm.FusedCombine`): no combine launch and no counter memsets.

Inputs are validated by `optimized.moe` (the public API) before these run; every function here
returns without launching a kernel when T = 0.
"""

from __future__ import annotations

import torch

from optimized.backends import detect
from optimized.triton.aot import tile_platform
from optimized.triton.einsum import num_sms
from optimized.triton.moe_gemm import (
    COMBINE_TOKENS,
    FusedCombine,
    GemmConfig,
    arrival_count,
    choose_config,
    grouped_gemm,
    split_k_for,
)
from optimized.triton.moe_permute import (
    QUANT_PERMUTE_SLOTS,
    MoeLayout,
    combine,
    compact_rows,
    permute,
    quantize_and_permute,
)
from optimized.triton.moe_routing import LOGITS_BLOCK_T, router_decode, router_logits, router_topk
from optimized.triton.quant import quant_job, quantize_per_token
from reference.config import DSv4Config
from reference.moe import MoEWeights
from reference.numerics import Numerics
from reference.weights import Fp4Weight, Fp8Weight


def clamp_limit(swiglu_limit: float) -> float:
    """The SwiGLU clamp the kernels take: `swiglu_limit`, or +inf for `<= 0` (no clamp, as the reference)."""
    return swiglu_limit if swiglu_limit > 0 else float("inf")


def _router_in_one_launch(n_tokens: int) -> bool:
    """Decode routing (at most LOGITS_BLOCK_T tokens) runs as one launch (`moe_routing.router_decode`)."""
    return n_tokens <= LOGITS_BLOCK_T


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, *, token_ids: torch.Tensor | None,
    tid2eid: torch.Tensor | None, cfg: DSv4Config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.moe.route` in two Triton kernels (one at decode): ids [T, k] int32, weights [T, k] fp32."""
    k = cfg.n_activated_experts
    if x.shape[0] == 0:
        return (torch.empty((0, k), dtype=torch.int32, device=x.device),
                torch.empty((0, k), dtype=torch.float32, device=x.device))
    if _router_in_one_launch(x.shape[0]):
        return router_decode(x, gate_weight, bias, topk=k, route_scale=cfg.route_scale,
                             token_ids=token_ids if tid2eid is not None else None, tid2eid=tid2eid)
    logits = router_logits(x, gate_weight)
    return router_topk(logits, bias, topk=k, route_scale=cfg.route_scale,
                       token_ids=token_ids if tid2eid is not None else None, tid2eid=tid2eid)


def activation(x: torch.Tensor, numerics: Numerics, scale_layout: str = "row_major") -> tuple[torch.Tensor,
                                                                                             torch.Tensor | None]:
    """The experts' A operand: `act_quant(x, act_block)` (FP8 + scales), or x itself (bf16) in EXACT numerics."""
    if not numerics.act_quant:
        return x, None
    return quantize_per_token(x, numerics.act_block, numerics.fp8_format, scale_layout=scale_layout)


def _tiles(rows_per_expert: float, w13: torch.Tensor, w2: torch.Tensor) -> tuple[GemmConfig, GemmConfig]:
    """The gate/up and down GEMMs' tiles (`choose_config`) for weights [.., 2I, D] and [.., D, I]."""
    interpret, platform = detect().interpret, tile_platform()
    return (choose_config(rows_per_expert, w13.shape[-2] // 2, swiglu=True, interpret=interpret, platform=platform),
            choose_config(rows_per_expert, w2.shape[-2], swiglu=False, interpret=interpret, platform=platform))


def _split_k(gate_up: GemmConfig, down: GemmConfig, n_rows: int, w13: torch.Tensor, w2: torch.Tensor,
             device: torch.device) -> tuple[GemmConfig, GemmConfig]:
    """Both tiles with `split_k_for`'s K split for a grid of `n_rows` rows."""
    platform, sms = tile_platform(), num_sms(device)
    return (split_k_for(gate_up, n_rows, w13.shape[-2] // 2, w13.shape[-1], sms, True, platform),
            split_k_for(down, n_rows, w2.shape[-2], w2.shape[-1], sms, False, platform))


def _rows_per_expert(n_slots: int, n_experts: int) -> float:
    return n_slots / max(min(n_experts, n_slots), 1)


def routed_rows(
    a: torch.Tensor, a_scale: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    w13: Fp8Weight, w2: Fp8Weight, *, swiglu_limit: float, numerics: Numerics,
) -> tuple[torch.Tensor, MoeLayout]:
    """The routed experts' outputs, one bf16 row per (token, slot) in the expert-sorted layout.

    Args:
        a, a_scale: the activation of `activation(x)`.
        topk_ids: [T, k] int32 contiguous; topk_weights: [T, k] fp32 contiguous.
        w13, w2: [E, 2I, D] and [E, D, I] FP8 experts in `numerics.fp8_format`.

    Returns:
        y [n_rows, D] bf16 and the layout that maps slots to its rows.
    """
    n_experts = w13.data.shape[0]
    gate_up, _ = _tiles(_rows_per_expert(topk_ids.numel(), n_experts), w13.data, w2.data)
    layout = permute(topk_ids, n_experts, align=gate_up.block_m)
    return _routed_gemms(a, a_scale, layout, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit,
                         numerics=numerics), layout


def _routed_gemms(
    a: torch.Tensor, a_scale: torch.Tensor | None, layout: MoeLayout, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, *, swiglu_limit: float, numerics: Numerics,
    combine_into: FusedCombine | None = None, arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gate/up and down GEMMs on `layout`'s rows: y [n_rows, D] bf16 (with `combine_into`, also its combine)."""
    gate_up, down = _routed_tiles(topk_ids.shape, w13, w2, a.device)
    common = {"layout": layout, "numerics_fmt": numerics.fp8_format, "act_block": numerics.act_block}
    h, h_scale = grouped_gemm(a, a_scale, w13.data, w13.scale, config=gate_up, swiglu=True, topk=topk_ids.shape[1],
                              gather=True, topk_weights=topk_weights.reshape(-1), limit=clamp_limit(swiglu_limit),
                              gate_up_bf16=numerics.gate_up_bf16, **common)
    y, _ = grouped_gemm(h, h_scale, w2.data, w2.scale, config=down, swiglu=False, topk=topk_ids.shape[1],
                        combine=combine_into, arrivals=arrivals, **common)
    return y


def _routed_tiles(ids_shape: torch.Size, w13: Fp8Weight, w2: Fp8Weight,
                  device: torch.device) -> tuple[GemmConfig, GemmConfig]:
    """The routed GEMMs' tiles, with their K split, for topk_ids of `ids_shape` (a function of shapes alone)."""
    n_slots, n_experts = ids_shape[0] * ids_shape[1], w13.data.shape[0]
    gate_up, down = _tiles(_rows_per_expert(n_slots, n_experts), w13.data, w2.data)
    return _split_k(gate_up, down, compact_rows(n_slots, n_experts, gate_up.block_m), w13.data, w2.data, device)


def _shared_tiles(n_tokens: int, w13: Fp8Weight, w2: Fp8Weight, device: torch.device) -> tuple[GemmConfig, GemmConfig]:
    return _split_k(*_tiles(n_tokens, w13.data, w2.data), n_tokens, w13.data, w2.data, device)


def shared_rows(
    a: torch.Tensor, a_scale: torch.Tensor | None, w13: Fp8Weight, w2: Fp8Weight, *, swiglu_limit: float,
    numerics: Numerics, arrivals: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The shared expert (`reference.moe.shared_expert`) on the quantized tokens: [T, D] bf16.

    `arrivals`: zeroed counters of the gate/up and down launches (`arrival_count`), or None (memsets)."""
    n_tokens = a.shape[0]
    limit = clamp_limit(swiglu_limit if numerics.shared_expert_clamp else 0.0)
    common = {"layout": None, "numerics_fmt": numerics.fp8_format, "act_block": numerics.act_block}
    gate_up, down = _shared_tiles(n_tokens, w13, w2, a.device)
    h, h_scale = grouped_gemm(a, a_scale, w13.data[None], w13.scale[None], config=gate_up, swiglu=True, limit=limit,
                              gate_up_bf16=numerics.gate_up_bf16, arrivals=arrivals[0] if arrivals else None, **common)
    y, _ = grouped_gemm(h, h_scale, w2.data[None], w2.scale[None], config=down, swiglu=False,
                        arrivals=arrivals[1] if arrivals else None, **common)
    return y


def _fused_decode(topk_ids: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, numerics: Numerics) -> bool:
    """Whether the step takes the decode launches (module docstring): FP8 activations, at most COMBINE_TOKENS
    tokens and `QUANT_PERMUTE_SLOTS` slots, and a routed down GEMM without a K split."""
    n_tokens, topk = topk_ids.shape
    return (numerics.act_quant and n_tokens <= COMBINE_TOKENS
            and n_tokens * topk <= QUANT_PERMUTE_SLOTS[tile_platform()]
            and _routed_tiles(topk_ids.shape, w13, w2, topk_ids.device)[1].split_k == 1)


def _step(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, *,
    swiglu_limit: float, numerics: Numerics, shared: tuple[Fp8Weight, Fp8Weight] | None = None,
) -> torch.Tensor:
    """Routed experts (+ the shared expert) of non-empty x: [T, D] bf16."""
    if not _fused_decode(topk_ids, w13, w2, numerics):
        a, a_scale = activation(x, numerics)
        y, layout = routed_rows(a, a_scale, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit,
                                numerics=numerics)
        shared_y = (shared_rows(a, a_scale, *shared, swiglu_limit=swiglu_limit, numerics=numerics)
                    if shared is not None else None)
        return combine(y, layout, topk_ids, shared_y)
    n_tokens, topk = topk_ids.shape
    n_experts, dim = w13.data.shape[0], w2.data.shape[1]
    gate_up, down = _routed_tiles(topk_ids.shape, w13, w2, x.device)
    n_rows = compact_rows(n_tokens * topk, n_experts, gate_up.block_m)
    counts = [arrival_count(n_rows, dim, down, combine=True)]
    if shared is not None:
        s_gate_up, s_down = _shared_tiles(n_tokens, *shared, x.device)
        counts += [arrival_count(n_tokens, shared[0].data.shape[0] // 2, s_gate_up, combine=False),
                   arrival_count(n_tokens, dim, s_down, combine=False)]
    zeroed = torch.empty(sum(counts), dtype=torch.int32, device=x.device)  # by the quantize-and-permute launch
    counters = zeroed.split(counts)
    job = quant_job(x, numerics.act_block, numerics.fp8_format)
    layout = quantize_and_permute(job, topk_ids, n_experts, align=gate_up.block_m, zero=zeroed)
    a, a_scale = job.tensors[1], job.tensors[2]
    shared_y = (shared_rows(a, a_scale, *shared, swiglu_limit=swiglu_limit, numerics=numerics,
                            arrivals=(counters[1], counters[2])) if shared is not None else None)
    out = torch.empty((n_tokens, dim), dtype=torch.bfloat16, device=x.device)
    _routed_gemms(a, a_scale, layout, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, numerics=numerics,
                  combine_into=FusedCombine(topk_ids, out, shared_y), arrivals=counters[0])
    return out


def experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Fp8Weight | Fp4Weight,
    w2: Fp8Weight | Fp4Weight, *, swiglu_limit: float, numerics: Numerics,
) -> torch.Tensor:
    """`reference.moe.experts` on Triton kernels: [T, D] bf16."""
    from optimized.moe import fp8_experts

    if x.shape[0] == 0:
        return torch.empty_like(x)
    w13, w2 = fp8_experts(w13, w2, numerics.fp8_format)
    return _step(x, topk_ids.to(torch.int32).contiguous(), topk_weights.float().contiguous(), w13, w2,
                 swiglu_limit=swiglu_limit, numerics=numerics)


def moe(
    x: torch.Tensor, weights: MoEWeights, *, token_ids: torch.Tensor | None, cfg: DSv4Config, numerics: Numerics,
) -> torch.Tensor:
    """`reference.moe.moe` on Triton kernels: route, routed experts, shared expert; [T, D] bf16."""
    from optimized.moe import fp8_experts

    if x.shape[0] == 0:
        return torch.empty_like(x)
    w13, w2 = fp8_experts(weights.w13, weights.w2, numerics.fp8_format)
    ids, topk_weights = route(x, weights.gate, weights.bias, token_ids=token_ids, tid2eid=weights.tid2eid, cfg=cfg)
    return _step(x, ids, topk_weights, w13, w2, swiglu_limit=cfg.swiglu_limit, numerics=numerics,
                 shared=(weights.shared_w13, weights.shared_w2))
