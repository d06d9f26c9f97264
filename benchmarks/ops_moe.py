"""Benchmarks of the MoE family (issue #3): routing, routed experts, routing + experts, the whole MoE layer.

Shapes (spec §1, §5): `x [T, D]` bf16, `E` routed experts, top `k = 6`, intermediate `I`; experts as 128x128
block FP8 (the H200 runs MXFP4 checkpoints through the lossless FP8 re-encode, spec §2.6, so FP8 is what its
kernels read), the first non-hash layer (`layer_id = n_hash_layers`, biased top-k routing). Numerics OFFICIAL
(activations quantized per token per 128). Work counted from the shapes and the actual routing of the point:
  * route: 2*T*D*E FLOP (the gate GEMM; bf16 ceiling: vLLM runs it as a bf16 GEMM with fp32 output); bytes =
    x + gate + bias + ids + weights.
  * experts: 6*T*k*D*I FLOP (gate/up and down GEMMs of every (token, slot); no padding); bytes = x + the weights
    of the experts the routing touches (`weight_bytes`: what a decode step must stream) + ids/weights + y.
  * routed_moe (route then experts, "routing to combine"): the sum, x counted once.
  * moe (+ the shared expert): adds 6*T*D*I FLOP and the shared expert's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from benchmarks.baselines import check_close, deep_gemm, deepgemm_scales
from benchmarks.roofline import Work
from benchmarks.suite import VARIANT, Env, Family, OpBench, Point, backend_candidates, baseline
from reference.formats import quantize_per_token
from reference.moe import MoEWeights, random_moe_weights
from reference.moe import experts as reference_experts
from reference.moe import route as reference_route
from reference.numerics import EXACT, OFFICIAL, Numerics
from reference.weights import Fp8Weight

if TYPE_CHECKING:
    from optimized.moe import ExpertWeight, TiledFp8Weight

FP32, BF16, INT32 = 4, 2, 4
# A baseline is checked against the reference on this many leading tokens (or experts) before it is timed.
CHECK_TOKENS = 16
CHECK_EXPERTS = 8


@dataclass
class MoEContext:
    """One config's MoE layer, built once.

    Attributes:
        weights: `MoEWeights` with FP8 experts on the device.
        numerics: OFFICIAL in the run's FP8 format.
        bf16: lazily built bf16 copies of the experts for the torch baseline ({"w13", "w2"}), or the reason
            they could not be built.
        tiled: the routed experts in `tile_experts`' layout, which the triton candidates read, as `optimized.MoE`
            does on NVIDIA GPUs (a copy made at setup, as a deployment makes it at load time); None elsewhere.
    """

    weights: MoEWeights
    numerics: Numerics
    bf16: dict[str, torch.Tensor] | str | None = None
    tiled: tuple[TiledFp8Weight, TiledFp8Weight] | None = None

    def routed_experts(self, backend: str) -> tuple[ExpertWeight, ExpertWeight]:
        """The routed experts a backend runs on: tiled for the triton backend where `MoE` would tile them."""
        if backend == "triton" and self.tiled is not None:
            return self.tiled
        return self.weights.w13, self.weights.w2

    def bf16_experts(self) -> dict[str, torch.Tensor]:
        if self.bf16 is None:
            try:
                w13, w2 = self.weights.w13, self.weights.w2
                assert isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight)
                self.bf16 = {"w13": _dequantize_bf16(w13), "w2": _dequantize_bf16(w2)}
            except torch.cuda.OutOfMemoryError as exc:
                self.bf16 = f"no memory for bf16 copies of the experts ({str(exc).splitlines()[0][:80]})"
                torch.cuda.empty_cache()
        if isinstance(self.bf16, str):
            raise RuntimeError(self.bf16)
        return self.bf16


def _dequantize_bf16(w: Fp8Weight) -> torch.Tensor:
    """[E, N, K] bf16, one expert at a time (bounds the fp32 temporaries)."""
    out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.data.device)
    for e in range(w.shape[0]):
        out[e] = Fp8Weight(w.data[e], w.scale[e]).dequantize().to(torch.bfloat16)
    return out


def setup(env: Env) -> MoEContext:
    cfg = env.cfg
    from optimized.moe import tile_experts, tiling_helps

    weights = random_moe_weights(cfg, cfg.n_hash_layers, expert_format="fp8", fmt=env.fmt,
                                 generator=env.generator(salt=11), device=env.device)
    tiled = None
    if tiling_helps(torch.device(env.device)):
        tiled = (tile_experts(weights.w13, env.fmt), tile_experts(weights.w2, env.fmt))
    return MoEContext(weights, OFFICIAL.replace(fp8_format=env.fmt), tiled=tiled)


# ------------------------------------------------------------------------------------------------
# Work
# ------------------------------------------------------------------------------------------------


def _expert_bytes(w13: Fp8Weight, w2: Fp8Weight) -> float:
    """Bytes of one expert's w13 and w2 (FP8 values + fp32 128x128 scales)."""
    per = 0.0
    for w in (w13, w2):
        per += (w.data.numel() + w.scale.numel() * FP32) / w.shape[0]
    return per


def route_work(env: Env, tokens: int) -> Work:
    cfg = env.cfg
    d, e, k = cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts
    return Work(2.0 * tokens * d * e, tokens * d * BF16 + e * d * BF16 + e * FP32 + tokens * k * (INT32 + FP32), "bf16")


def experts_work(ctx: MoEContext, env: Env, tokens: int, topk_ids: torch.Tensor) -> Work:
    cfg = env.cfg
    d, i, k = cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts
    w13, w2 = ctx.weights.w13, ctx.weights.w2
    assert isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight)
    active = int(torch.unique(topk_ids[topk_ids >= 0]).numel())
    weights = active * _expert_bytes(w13, w2)
    slots = int((topk_ids >= 0).sum())
    return Work(6.0 * slots * d * i, tokens * d * BF16 * 2 + tokens * k * (INT32 + FP32) + weights, "fp8", weights)


def shared_work(ctx: MoEContext, tokens: int) -> Work:
    w13, w2 = ctx.weights.shared_w13, ctx.weights.shared_w2
    weights = sum(w.data.numel() + w.scale.numel() * FP32 for w in (w13, w2))
    return Work(2.0 * tokens * (w13.data.numel() + w2.data.numel()), weights, "fp8", weights)


# ------------------------------------------------------------------------------------------------
# Points
# ------------------------------------------------------------------------------------------------


def _inputs(ctx: MoEContext, env: Env, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D] bf16 (unit Gaussian, like an ffn_norm output) and the reference routing of it."""
    x = env.randn(tokens, env.cfg.dim, salt=300 + tokens)
    w = ctx.weights
    topk_ids, topk_weights = reference_route(x, w.gate, w.bias, token_ids=None, tid2eid=w.tid2eid, cfg=env.cfg)
    return x, topk_ids, topk_weights


def route_point(ctx: MoEContext, env: Env, tokens: int) -> Point:
    import optimized

    x, _, _ = _inputs(ctx, env, tokens)
    w, cfg = ctx.weights, env.cfg

    def call(backend: str):
        return lambda: optimized.route(x, w.gate, w.bias, token_ids=None, tid2eid=w.tid2eid, cfg=cfg, backend=backend)

    cands = backend_candidates("route", call)
    cands.append(baseline("torch bf16 gate GEMM + topk", lambda: _torch_route(x, w, cfg)))
    return Point("route", cfg.name, tokens, f"T={tokens},E={cfg.n_routed_experts},D={cfg.dim}", route_work(env, tokens),
                 cands)


def experts_point(ctx: MoEContext, env: Env, tokens: int) -> Point:
    import optimized

    x, ids, tw = _inputs(ctx, env, tokens)
    cfg = env.cfg

    def call(backend: str):
        w13, w2 = ctx.routed_experts(backend)
        return lambda: optimized.experts(x, ids, tw, w13, w2, swiglu_limit=cfg.swiglu_limit,
                                         numerics=ctx.numerics, backend=backend)

    cands = backend_candidates("experts", call)
    cands.append(baseline("torch bf16 _grouped_mm (dequantized experts)", lambda: _checked_grouped_bf16(ctx, env, x,
                                                                                                         ids, tw)))
    cands.append(baseline("DeepGEMM m_grouped contiguous x2 (raw GEMMs only)",
                          lambda: _deepgemm_grouped(ctx, env, x, ids)))
    for layout in ("masked", "contiguous"):
        cands.append(baseline(f"deepgemm, {layout} layout", lambda layout=layout: _deepgemm_layout(ctx, env, x, ids, tw,
                                                                                                  layout), VARIANT))
    return Point("experts", cfg.name, tokens, _shape(env, tokens), experts_work(ctx, env, tokens, ids), cands,
                 note="identical routing for every candidate (the reference's)")


def routed_moe_point(ctx: MoEContext, env: Env, tokens: int) -> Point:
    import optimized

    x, ids, _ = _inputs(ctx, env, tokens)
    w, cfg = ctx.weights, env.cfg

    def call(backend: str):
        w13, w2 = ctx.routed_experts(backend)

        def run() -> torch.Tensor:
            topk_ids, topk_weights = optimized.route(x, w.gate, w.bias, token_ids=None, tid2eid=w.tid2eid, cfg=cfg,
                                                     backend=backend)
            return optimized.experts(x, topk_ids, topk_weights, w13, w2, swiglu_limit=cfg.swiglu_limit,
                                     numerics=ctx.numerics, backend=backend)
        return run

    work = route_work(env, tokens) + experts_work(ctx, env, tokens, ids)
    work = work.with_bytes(work.bytes - tokens * cfg.dim * BF16)  # x is read once
    cands = backend_candidates(("route", "experts"), call)
    return Point("routed_moe", cfg.name, tokens, _shape(env, tokens), work, cands,
                 note="route then experts with the same backend: routing to combine, no shared expert")


def moe_point(ctx: MoEContext, env: Env, tokens: int) -> Point:
    import optimized

    x, ids, _ = _inputs(ctx, env, tokens)
    w, cfg = ctx.weights, env.cfg

    def call(backend: str):
        # the module, with the routed experts the backend runs on (`MoEContext.routed_experts`)
        layer = optimized.MoE(w, cfg, ctx.numerics, backend=backend, tile=False)
        if backend == "triton":
            layer.tiled = ctx.tiled
        return lambda: layer(x)

    work = route_work(env, tokens) + experts_work(ctx, env, tokens, ids) + shared_work(ctx, tokens)
    work = work.with_bytes(work.bytes - tokens * cfg.dim * BF16)  # x is read once
    return Point("moe", cfg.name, tokens, _shape(env, tokens), work, backend_candidates("moe", call),
                 note="the whole layer: route, routed experts, shared expert")


def _shape(env: Env, tokens: int) -> str:
    cfg = env.cfg
    return f"T={tokens},E={cfg.n_routed_experts},k={cfg.n_activated_experts},D={cfg.dim},I={cfg.moe_inter_dim}"


# ------------------------------------------------------------------------------------------------
# Baselines
# ------------------------------------------------------------------------------------------------


def _torch_route(x: torch.Tensor, w: MoEWeights, cfg):
    """vLLM's torch fallback: bf16 gate GEMM with fp32 output, sqrt(softplus), top-k of score + bias."""
    assert w.bias is not None
    k = cfg.n_activated_experts

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.nn.functional.softplus((x @ w.gate.T).float()).sqrt()
        ids = torch.topk(scores + w.bias, k, dim=-1).indices
        weights = scores.gather(1, ids)
        return ids, weights / weights.sum(dim=-1, keepdim=True) * cfg.route_scale

    return run


def _sorted_slots(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token of each sorted slot, flat slot index, per-expert row counts) with slots sorted by expert."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=n_experts)
    return order // ids.shape[1], order, counts


def _grouped_bf16(ctx: MoEContext, env: Env, x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor):
    """The routed experts with `torch._grouped_mm` on bf16 weights: sort slots by expert, gate/up GEMM, clamped
    SwiGLU times the routing weight, down GEMM, scatter-add back (what torch offers without FP8 kernels)."""
    w = ctx.bf16_experts()
    limit = env.cfg.swiglu_limit
    inter = env.cfg.moe_inter_dim
    tokens, slots, counts = _sorted_slots(ids, w["w13"].shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    weight = tw.reshape(-1)[slots].unsqueeze(1)
    w13t, w2t = w["w13"].transpose(1, 2), w["w2"].transpose(1, 2)

    def run() -> torch.Tensor:
        h = torch._grouped_mm(x[tokens], w13t, offs=offs).float()
        gate, up = h[:, :inter].clamp(max=limit), h[:, inter:].clamp(-limit, limit)
        a = (torch.nn.functional.silu(gate) * up * weight).to(torch.bfloat16)
        y = torch._grouped_mm(a, w2t, offs=offs)
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, y.float()).to(x.dtype)

    return run


def _checked_grouped_bf16(ctx: MoEContext, env: Env, x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor):
    n = min(CHECK_TOKENS, x.shape[0])
    small = _grouped_bf16(ctx, env, x[:n], ids[:n], tw[:n])()
    w = ctx.weights
    want = reference_experts(x[:n], ids[:n], tw[:n], w.w13, w.w2, swiglu_limit=env.cfg.swiglu_limit,
                             numerics=EXACT.replace(fp8_format=env.fmt))
    check_close("torch bf16 _grouped_mm", small, want)
    return _grouped_bf16(ctx, env, x, ids, tw)


def _deepgemm_layout(ctx: MoEContext, env: Env, x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, layout: str):
    """The deepgemm backend forced onto one grouped layout (`optimized.deepgemm.moe.experts(layout=...)`, its
    benchmark hook): timing both at every T places `MASKED_MAX_TOKENS`, the switch between them."""
    from optimized.backends import backend_status

    ok, why = backend_status("deepgemm")
    if not ok:
        raise RuntimeError(why)
    from optimized.deepgemm import moe as dg_moe

    w, cfg = ctx.weights, env.cfg
    return lambda: dg_moe.experts(x, ids, tw, w.w13, w.w2, swiglu_limit=cfg.swiglu_limit, numerics=ctx.numerics,
                                  layout=layout)


def _deepgemm_grouped(ctx: MoEContext, env: Env, x: torch.Tensor, ids: torch.Tensor):
    """The two grouped GEMMs of the DeepGEMM path alone, on inputs already permuted into the contiguous layout
    (each expert's rows padded to DeepGEMM's M alignment, padding rows -1) and quantized, with scales in its
    MN-major TMA-aligned layout. The first GEMM is checked against an fp32 oracle before timing."""
    dg = deep_gemm()
    w13, w2 = ctx.weights.w13, ctx.weights.w2
    assert isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight)
    n_experts, inter = w13.shape[0], w2.shape[-1]
    align = dg.get_mk_alignment_for_contiguous_layout()
    tokens, _, counts = _sorted_slots(ids, n_experts)
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(n_experts, device=ids.device), counts)
    rows = starts[expert_of] + torch.arange(expert_of.numel(), device=ids.device) - first[expert_of]
    m = int(padded.sum())
    layout = torch.full((m,), -1, dtype=torch.int32, device=ids.device)
    layout[rows] = expert_of.to(torch.int32)
    a1 = torch.zeros((m, x.shape[1]), dtype=torch.bfloat16, device=x.device)
    a1[rows] = x[tokens]
    a1_q, a1_s = quantize_per_token(a1, 128, env.fmt)
    a2_q, a2_s = quantize_per_token(env.randn(m, inter, salt=400), 128, env.fmt)
    sfa1, sfa2 = deepgemm_scales(a1_s), deepgemm_scales(a2_s)
    d1 = torch.empty((m, w13.shape[1]), dtype=torch.bfloat16, device=x.device)
    d2 = torch.empty((m, w2.shape[1]), dtype=torch.bfloat16, device=x.device)

    def run() -> torch.Tensor:
        dg.m_grouped_fp8_gemm_nt_contiguous((a1_q, sfa1), (w13.data, w13.scale), d1, layout)
        dg.m_grouped_fp8_gemm_nt_contiguous((a2_q, sfa2), (w2.data, w2.scale), d2, layout)
        return d2

    run()
    a1_deq = a1_q.float() * a1_s.repeat_interleave(128, dim=1)
    for e in torch.unique(expert_of)[:CHECK_EXPERTS].tolist():
        sel = layout == e
        want = a1_deq[sel] @ Fp8Weight(w13.data[e], w13.scale[e]).dequantize().T
        check_close(f"DeepGEMM m_grouped_fp8_gemm_nt_contiguous (expert {e})", d1[sel], want)
    return run


FAMILY = Family(
    name="moe",
    setup=setup,
    ops=(
        OpBench("route", "router: fp32 logits, sqrt(softplus), biased top-k, renormalized weights", route_point),
        OpBench("experts", "routed experts on given routing (the MegaMoE boundary): FP8 GEMMs, clamped SwiGLU, "
                "weighted fp32 combine", experts_point),
        OpBench("routed_moe", "route then experts (the issue's 'whole routed MoE, routing to combine')",
                routed_moe_point),
        OpBench("moe", "the whole MoE layer: route, routed experts, shared expert", moe_point),
    ),
)
