"""Parity cases of the MoE ops (spec §5): `route`, `experts` (the MegaMoE boundary) and the layer `moe`.

Each case runs `optimized.<op>(..., backend=b)` and `reference.moe` on identical inputs:
  * route   — expert sets equal as sets, except swaps between experts whose reference keys (score + bias)
              are within `ROUTE_NEAR_TIE_GAP` (spec §7.1 pitfall 5); hash routing equal outright; weights of
              the tokens with equal sets within `ROUTE_WEIGHTS`. Patterns built on purpose: exact ties
              (duplicated gate rows and biases: the lower expert id must win), logits of exactly +-30
              (one-hot inputs; weights must neither underflow nor overflow), a NaN token.
  * experts — on the reference router's `topk_ids` / `topk_weights`: `MOE_SIMULATED` against the reference
              with the same numerics (OFFICIAL: activations per 128; MEGAMOE: per 32), `MOE_END_TO_END`
              against EXACT. Patterns: every token routed to the same k experts (the others get none), a NaN
              token (it must stay NaN and reach no other token).
  * moe     — the whole layer, same two tiers; tokens whose candidate routing differs by a near tie are left
              out of the output comparison (and counted).
Weights come from `random_moe_weights` (seed `WEIGHT_SEED`, drawn on the case's device: a CUDA generator for
FLASH/PRO); `Case.seed` seeds the inputs. TINY cases run on the CPU (Triton interpreter, both FP8 formats);
FLASH and PRO cases need a GPU and use e4m3fn (the H200's format), FP8 and MXFP4 experts (the optimized
backends run MXFP4 through the lossless FP8 re-encode), hash and non-hash layers, T in {1, 8, 64, 512, 4096}.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from parity_tests.cases import Case, Check, NotRun, generator, provider, require
from parity_tests.metrics import calc_diff, max_abs_error, max_rel_error, nonfinite_positions_equal, worst_position
from parity_tests.tolerances import (
    BITWISE,
    MOE_END_TO_END,
    MOE_SIMULATED,
    ROUTE_EXTREME_WEIGHTS,
    ROUTE_NEAR_TIE_GAP,
    ROUTE_SETS,
    ROUTE_WEIGHTS,
    moe_simulated,
)
from reference.config import DSv4Config, get_config
from reference.moe import (
    MoEWeights,
    experts,
    moe,
    random_moe_weights,
    random_router_weights,
    route,
    router_scores,
)
from reference.numerics import EXACT, PRESETS, Numerics

WEIGHT_SEED = 0
TINY_TOKENS = (0, 1, 7, 33)
GPU_TOKENS = (1, 8, 64, 512, 4096)
GPU_CONFIGS = ("FLASH", "PRO")
ROUTE_FMT = "fp32"  # the router has no FP8 operand; this labels its cases' format column

# Patterns: "routed" (plain inputs), "ties" (duplicated gate rows), "extreme" (logits of +-30), "nan" (one NaN
# in one token), "hot" (every token routed to the same k experts).
PATTERNS = ("routed", "ties", "extreme", "nan", "hot")


@dataclass(frozen=True)
class MoESpec:
    """What one MoE parity case runs.

    Attributes:
        op: "route", "experts" or "moe".
        config: "TINY", "FLASH" or "PRO".
        tokens: T.
        hash_layer: route by token id (layer 0) or by biased top-k (layer `n_hash_layers`).
        fmt: FP8 format of weights and activations.
        expert_format: "fp8" (128x128 blocks) or "fp4" (MXFP4).
        numerics: preset name: "official" or "megamoe" (the simulated tier's numerics).
        pattern: one of `PATTERNS`.
        device: "cpu" or "cuda".
        module: (moe only) also run `optimized.MoE` and require it to equal `optimized.moe` bitwise.
    """

    op: str
    config: str
    tokens: int
    hash_layer: bool
    fmt: str = "e4m3fn"
    expert_format: str = "fp8"
    numerics: str = "official"
    pattern: str = "routed"
    device: str = "cpu"
    module: bool = False

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern: expected one of {PATTERNS}, got {self.pattern!r}")

    @property
    def label(self) -> str:
        parts = [f"T={self.tokens}", "hash" if self.hash_layer else "topk"]
        if self.op != "route":
            parts += [self.expert_format, self.numerics]
        if self.pattern != "routed":
            parts.append(self.pattern)
        if self.module:
            parts.append("module")
        return ",".join(parts)

    @property
    def seed(self) -> int:
        """Seed of the inputs (x, token ids)."""
        return 1000 + self.tokens

    def case(self) -> Case:
        return Case(op=self.op, config=self.config, shape=self.label, fmt=ROUTE_FMT if self.op == "route" else self.fmt,
                    seed=self.seed, device=self.device, run=functools.partial(_RUNNERS[self.op], self),
                    params=asdict(self))


# ------------------------------------------------------------------------------------------------
# The case matrix
# ------------------------------------------------------------------------------------------------


def _tiny_specs(device: str) -> list[MoESpec]:
    """Few, varied cases: each value of every axis appears, and each TINY token count, in a few seconds of
    the Triton interpreter per op."""
    s = functools.partial(MoESpec, config="TINY", device=device)
    routes = [s(op="route", tokens=t, hash_layer=h) for t in TINY_TOKENS for h in (False, True)]
    routes += [s(op="route", tokens=33, hash_layer=False, pattern="ties"),
               s(op="route", tokens=7, hash_layer=False, pattern="extreme"),
               s(op="route", tokens=7, hash_layer=True, pattern="extreme"),
               s(op="route", tokens=7, hash_layer=False, pattern="nan")]
    experts_ = [
        s(op="experts", tokens=0, hash_layer=False),
        s(op="experts", tokens=1, hash_layer=True, fmt="e4m3fnuz", expert_format="fp4", numerics="megamoe"),
        s(op="experts", tokens=7, hash_layer=True, fmt="e4m3fnuz", pattern="nan"),
        s(op="experts", tokens=33, hash_layer=True, numerics="megamoe"),
        s(op="experts", tokens=33, hash_layer=False, fmt="e4m3fnuz", expert_format="fp4"),
        s(op="experts", tokens=33, hash_layer=False, expert_format="fp4", numerics="megamoe", pattern="hot"),
    ]
    layers = [
        s(op="moe", tokens=0, hash_layer=False),
        s(op="moe", tokens=1, hash_layer=True, fmt="e4m3fnuz", expert_format="fp4", numerics="megamoe", module=True),
        s(op="moe", tokens=7, hash_layer=True, pattern="nan"),
        s(op="moe", tokens=33, hash_layer=False, expert_format="fp4"),
    ]
    return routes + experts_ + layers


def _gpu_specs(config: str, device: str) -> list[MoESpec]:
    """FLASH / PRO: every T for hash and non-hash layers, FP8 and MXFP4 experts (e4m3fn); MegaMoE numerics
    and the built patterns at a few T. Ordered so that consecutive cases share one set of weights."""
    s = functools.partial(MoESpec, config=config, device=device)
    specs = [s(op="route", tokens=t, hash_layer=h) for h in (False, True) for t in GPU_TOKENS]
    specs += [s(op="route", tokens=4096, hash_layer=False, pattern="ties"),
              s(op="route", tokens=64, hash_layer=False, pattern="extreme"),
              s(op="route", tokens=64, hash_layer=True, pattern="extreme"),
              s(op="route", tokens=64, hash_layer=False, pattern="nan")]
    for op in ("experts", "moe"):
        for h in (False, True):
            for ef in ("fp8", "fp4"):
                specs += [s(op=op, tokens=t, hash_layer=h, expert_format=ef, module=op == "moe" and t == 64)
                          for t in GPU_TOKENS]
                if not h:
                    specs += [s(op=op, tokens=t, hash_layer=h, expert_format=ef, numerics="megamoe")
                              for t in (64, 4096)]
        specs += [s(op=op, tokens=64, hash_layer=True, expert_format="fp4", pattern="nan")]
    specs += [s(op="experts", tokens=4096, hash_layer=False, expert_format="fp4", pattern="hot")]
    return specs


def _cases(op: str, config: str, device: str) -> list[Case]:
    specs = _tiny_specs(device) if config.upper() == "TINY" else _gpu_specs(config.upper(), device)
    return [spec.case() for spec in specs if spec.op == op]


@provider("route")
def route_cases(config: str, device: str) -> list[Case]:
    """Router parity cases of `config` on `device`."""
    return _cases("route", config, device)


@provider("experts")
def experts_cases(config: str, device: str) -> list[Case]:
    """Routed-experts parity cases (identical routing on both sides)."""
    return _cases("experts", config, device)


@provider("moe")
def moe_cases(config: str, device: str) -> list[Case]:
    """Whole-layer parity cases."""
    return _cases("moe", config, device)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def _generator(seed: int, device: str) -> torch.Generator:
    """CPU cases draw on the CPU (`cases.generator`); GPU cases draw on the GPU (FLASH/PRO expert weights are
    6.4 G / 25 G parameters)."""
    if torch.device(device).type == "cpu":
        return generator(seed)
    return torch.Generator(device=device).manual_seed(seed)


def _layer_id(cfg: DSv4Config, hash_layer: bool) -> int:
    return 0 if hash_layer else cfg.n_hash_layers  # layer 0 routes by token id; n_hash_layers is the first top-k


_WEIGHTS: dict[tuple[str, bool, str, str, str], MoEWeights] = {}


def _layer_weights(config: str, hash_layer: bool, expert_format: str, fmt: str, device: str) -> MoEWeights:
    """One layer's weights, kept while consecutive cases use them. The previous set (and everything cached
    from it) is released before the next is built: PRO's experts alone are 25 GB in FP8."""
    key = (config, hash_layer, expert_format, fmt, device)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        _expert_inputs.cache_clear()
        cfg = get_config(config)
        _WEIGHTS[key] = random_moe_weights(cfg, _layer_id(cfg, hash_layer), expert_format=expert_format, fmt=fmt,
                                           generator=_generator(WEIGHT_SEED, device), device=device)
    return _WEIGHTS[key]


@functools.lru_cache(maxsize=1)
def _router_weights(config: str, hash_layer: bool, device: str) -> tuple[torch.Tensor, Any, Any]:
    """The router of `_layer_weights` (its first draws) without building the experts."""
    cfg = get_config(config)
    return random_router_weights(cfg, _layer_id(cfg, hash_layer), generator=_generator(WEIGHT_SEED, device),
                                 device=device)


def _inputs(spec: MoESpec, cfg: DSv4Config) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] bf16 ~ N(0, 1) (a unit-RMS ffn_norm output) and token ids [T]; pattern "nan" puts one NaN
    into token T // 2."""
    g = _generator(spec.seed, spec.device)
    x = torch.randn((spec.tokens, cfg.dim), generator=g, device=g.device).to(torch.bfloat16).to(spec.device)
    token_ids = torch.randint(0, cfg.vocab_size, (spec.tokens,), generator=g, device=g.device).to(spec.device)
    if spec.pattern == "nan" and spec.tokens:
        x[spec.tokens // 2, 3] = float("nan")
    return x, token_ids


def tie_pairs(n_experts: int) -> tuple[tuple[int, int], ...]:
    """(lower, higher) expert ids made identical by the "ties" pattern."""
    return (1, n_experts // 2 + 1), (4, 5), (6, n_experts - 1)


def with_ties(gate: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies where each pair of `tie_pairs` has the same gate row and bias: their keys tie exactly."""
    gate, bias = gate.clone(), bias.clone()
    for lo, hi in tie_pairs(gate.shape[0]):
        gate[hi], bias[hi] = gate[lo], bias[lo]
    return gate, bias


# Experts given logits of exactly +30 and -30 by the "extreme" pattern.
HOT_EXPERT, COLD_EXPERT = 1, 2


def with_extreme_logits(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                        token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """One-hot inputs and gate rows of +30 / -30, so that every token's logits are exactly representable
    (l = gate[e, channel]) and experts HOT_EXPERT / COLD_EXPERT sit at +30 / -30. Both are selected: COLD_EXPERT
    through a bias of 100 (selection only: its weight keeps the score e^-15) or through `tid2eid`."""
    n_tokens, dim = x.shape
    one_hot = torch.zeros_like(x)
    one_hot[torch.arange(n_tokens, device=x.device), torch.arange(n_tokens, device=x.device) % dim] = 1.0
    gate = gate.clone()
    gate[HOT_EXPERT], gate[COLD_EXPERT] = 30.0, -30.0
    if bias is not None:
        bias = bias.clone()
        bias[COLD_EXPERT] = 100.0
    else:
        assert tid2eid is not None
        k = tid2eid.shape[1]
        tid2eid = tid2eid.clone()
        row = torch.tensor([HOT_EXPERT, COLD_EXPERT, *range(3, 3 + k - 2)], dtype=tid2eid.dtype, device=x.device)
        tid2eid[token_ids.long()] = row
    return one_hot, gate, bias, tid2eid


def hot_ids(n_tokens: int, k: int, device: str) -> torch.Tensor:
    """[T, k] int32: every token routed to experts 0..k-1 (slot order rotated per token); the rest get none."""
    return ((torch.arange(k)[None, :] + torch.arange(n_tokens)[:, None]) % k).to(torch.int32).to(device)


def _numerics(spec: MoESpec) -> Numerics:
    return PRESETS[spec.numerics].replace(fp8_format=spec.fmt)


def _exact(spec: MoESpec) -> Numerics:
    return EXACT.replace(fp8_format=spec.fmt)


def _require(spec: MoESpec, backend: str) -> None:
    """NotRun for combinations a backend cannot run by design (said in the report)."""
    if spec.config != "TINY" and torch.device(spec.device).type != "cuda":
        raise NotRun(f"{spec.config}-shaped MoE cases run on a GPU (device cuda), not {spec.device}")
    require(spec.device, spec.fmt, backend)


def _candidate(spec: MoESpec, backend: str, call: Callable[[], Any]) -> Any:
    """Run the candidate; a backend that rejects MegaMoE's per-32 activation blocks (DeepGEMM on SM90 needs
    128) by a ValueError naming `act_block` is not run, not failed."""
    try:
        return call()
    except ValueError as exc:
        if spec.numerics == "megamoe" and "act_block" in str(exc):
            raise NotRun(f"{backend}: {exc}") from exc
        raise


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteAgreement:
    """Per token: candidate expert set equal to the reference's, different by a near tie, or different."""

    same: torch.Tensor  # [T] bool
    near_tie: torch.Tensor  # [T] bool
    unexplained: torch.Tensor  # [T] bool, only over tokens with finite reference weights


def _membership(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] bool set membership of each row's ids, and [T] bool: the row holds k distinct valid ids."""
    ids = ids.long()
    valid = (ids >= 0) & (ids < n_experts)
    member = torch.zeros((ids.shape[0], n_experts + 1), dtype=torch.bool, device=ids.device)
    member.scatter_(1, torch.where(valid, ids, n_experts), True)
    member = member[:, :n_experts]
    return member, valid.all(dim=-1) & (member.sum(dim=-1) == ids.shape[1])


def route_agreement(ref_ids: torch.Tensor, ref_weights: torch.Tensor, cand_ids: torch.Tensor,
                    keys: torch.Tensor | None, n_experts: int) -> RouteAgreement:
    """Compare expert sets per token. `keys` [T, E] are the reference's selection keys (score + bias) of a
    non-hash layer, None for hash routing (no near ties: a table lookup must match)."""
    in_ref, _ = _membership(ref_ids, n_experts)
    in_cand, cand_ok = _membership(cand_ids, n_experts)
    same = cand_ok & (in_ref == in_cand).all(dim=-1)
    near_tie = torch.zeros_like(same)
    if keys is not None:
        only_ref, only_cand = in_ref & ~in_cand, in_cand & ~in_ref
        highest_dropped = keys.masked_fill(~only_ref, float("-inf")).amax(dim=-1)
        lowest_added = keys.masked_fill(~only_cand, float("inf")).amin(dim=-1)
        near_tie = cand_ok & ~same & (highest_dropped - lowest_added <= ROUTE_NEAR_TIE_GAP)
    finite = torch.isfinite(ref_weights).all(dim=-1)
    return RouteAgreement(same, near_tie, finite & ~same & ~near_tie)


def _route_layout(ids: torch.Tensor, weights: torch.Tensor, n_tokens: int, k: int) -> str | None:
    want = (n_tokens, k)
    if tuple(ids.shape) != want or ids.dtype != torch.int32:
        return f"topk_ids: expected {want} int32, got {tuple(ids.shape)} {ids.dtype}"
    if tuple(weights.shape) != want or weights.dtype != torch.float32:
        return f"topk_weights: expected {want} fp32, got {tuple(weights.shape)} {weights.dtype}"
    return None


def route_checks(ref: tuple[torch.Tensor, torch.Tensor], cand: tuple[torch.Tensor, torch.Tensor],
                 keys: torch.Tensor | None, n_experts: int, *, pairs: tuple[tuple[int, int], ...] = (),
                 extreme: bool = False) -> list[Check]:
    """Checks of a candidate router output against the reference's (see the module docstring)."""
    (ref_ids, ref_w), (cand_ids, cand_w) = ref, cand
    bad_layout = _route_layout(cand_ids, cand_w, *ref_ids.shape)
    if bad_layout:
        return [Check("layout", BITWISE, 1, bad_layout)]
    agree = route_agreement(ref_ids, ref_w, cand_ids, keys, n_experts)
    finite = torch.isfinite(ref_w).all(dim=-1)
    checks = [
        Check("layout", BITWISE, 0, "topk_ids [T, k] int32, topk_weights [T, k] fp32"),
        Check("expert sets", ROUTE_SETS, int(agree.unexplained.sum()),
              f"{int(agree.near_tie.sum())} near-tie swaps of {int(finite.sum())} finite tokens"),
        Check("non-finite weights", BITWISE, 0 if nonfinite_positions_equal(cand_w, ref_w) else 1,
              f"{int((~finite).sum())} tokens with non-finite reference weights"),
    ]
    rows = finite & agree.same
    ref_order, cand_order = ref_ids.long().sort(dim=-1).indices, cand_ids.long().sort(dim=-1).indices
    ref_sorted, cand_sorted = ref_w.gather(1, ref_order)[rows], cand_w.gather(1, cand_order)[rows]
    if extreme:
        checks.append(Check("weights (extreme logits)", ROUTE_EXTREME_WEIGHTS,
                            max_rel_error(cand_sorted, ref_sorted, floor=1e-30),
                            f"smallest reference weight {float(ref_sorted.min()) if ref_sorted.numel() else 0:.3e}"))
    else:
        checks.append(Check("weights", ROUTE_WEIGHTS, max_abs_error(cand_sorted, ref_sorted),
                            f"over {int(rows.sum())} tokens with equal sets"))
    if pairs:
        in_ref, _ = _membership(ref_ids, n_experts)
        in_cand, _ = _membership(cand_ids, n_experts)
        violations = sum(int((finite & in_cand[:, hi] & ~in_cand[:, lo]).sum()) for lo, hi in pairs)
        straddles = sum(int((in_ref[:, lo] & ~in_ref[:, hi]).sum()) for lo, hi in pairs)
        checks.append(Check("exact ties -> lower expert id", BITWISE, violations,
                            f"{straddles} tokens where a tied pair straddles the top-k boundary"))
    return checks


def output_checks(cand: torch.Tensor, ref: torch.Tensor, ref_exact: torch.Tensor,
                  rows: torch.Tensor | None = None, slot_inter: int | None = None) -> list[Check]:
    """Checks of a candidate [T, D] bf16 output: layout, NaN/Inf positions, `MOE_SIMULATED` against `ref`
    (same numerics; `moe_simulated` of the compared tokens x `slot_inter` = k x I when given) and
    `MOE_END_TO_END` against `ref_exact`, over the finite rows (and `rows`)."""
    if tuple(cand.shape) != tuple(ref.shape) or cand.dtype != torch.bfloat16 or cand.device != ref.device:
        return [Check("layout", BITWISE, 1, f"expected {tuple(ref.shape)} bf16 on {ref.device}, got "
                                            f"{tuple(cand.shape)} {cand.dtype} on {cand.device}")]
    finite = torch.isfinite(ref.float()).all(dim=-1)
    keep = finite if rows is None else finite & rows
    c, r, e = cand[keep], ref[keep], ref_exact[keep]
    where = worst_position(c, r)
    return [
        Check("layout", BITWISE, 0, "[T, D] bf16"),
        Check("non-finite positions", BITWISE, 0 if nonfinite_positions_equal(cand, ref) else 1,
              f"{int((~finite).sum())} tokens with non-finite reference output"),
        Check("vs reference, same numerics",
              MOE_SIMULATED if slot_inter is None else moe_simulated(int(keep.sum()) * slot_inter), calc_diff(c, r),
              f"{int(keep.sum())} tokens; worst element {where}" if where else f"{int(keep.sum())} tokens"),
        Check("vs EXACT reference", MOE_END_TO_END, calc_diff(c, e)),
    ]


# ------------------------------------------------------------------------------------------------
# Runners
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _route_inputs(spec: MoESpec) -> dict[str, Any]:
    """Inputs and reference result of a route case (shared by the backends of one case)."""
    cfg = get_config(spec.config)
    gate, bias, tid2eid = _router_weights(spec.config, spec.hash_layer, spec.device)
    x, token_ids = _inputs(spec, cfg)
    if spec.pattern == "ties":
        gate, bias = with_ties(gate, bias)
    elif spec.pattern == "extreme":
        x, gate, bias, tid2eid = with_extreme_logits(x, gate, bias, tid2eid, token_ids)
    kw = dict(token_ids=token_ids, tid2eid=tid2eid, cfg=cfg)
    ref = route(x, gate, bias, **kw)
    keys = None if spec.hash_layer else router_scores(x, gate) + bias
    return dict(x=x, gate=gate, bias=bias, kw=kw, ref=ref, keys=keys)


def _run_route(spec: MoESpec, backend: str) -> list[Check]:
    import optimized

    _require(spec, backend)
    inp = _route_inputs(spec)
    cand = optimized.route(inp["x"], inp["gate"], inp["bias"], **inp["kw"], backend=backend)
    cfg = get_config(spec.config)
    pairs = tie_pairs(cfg.n_routed_experts) if spec.pattern == "ties" else ()
    return route_checks(inp["ref"], cand, inp["keys"], cfg.n_routed_experts, pairs=pairs,
                        extreme=spec.pattern == "extreme")


@functools.lru_cache(maxsize=1)
def _expert_inputs(spec: MoESpec) -> dict[str, Any]:
    """Weights, inputs, routing and the two reference outputs of an experts or moe case."""
    cfg = get_config(spec.config)
    weights = _layer_weights(spec.config, spec.hash_layer, spec.expert_format, spec.fmt, spec.device)
    x, token_ids = _inputs(spec, cfg)
    ids, topk_weights = route(x, weights.gate, weights.bias, token_ids=token_ids, tid2eid=weights.tid2eid, cfg=cfg)
    if spec.pattern == "hot":
        ids = hot_ids(spec.tokens, cfg.n_activated_experts, spec.device)
    inp: dict[str, Any] = dict(cfg=cfg, weights=weights, x=x, token_ids=token_ids, ids=ids, topk_weights=topk_weights)
    if spec.op == "experts":
        run = functools.partial(experts, x, ids, topk_weights, weights.w13, weights.w2, swiglu_limit=cfg.swiglu_limit)
    else:
        run = functools.partial(moe, x, weights, token_ids=token_ids, cfg=cfg)
        inp["keys"] = None if spec.hash_layer else router_scores(x, weights.gate) + weights.bias
    inp["ref"], inp["ref_exact"] = run(numerics=_numerics(spec)), run(numerics=_exact(spec))
    return inp


def _run_experts(spec: MoESpec, backend: str) -> list[Check]:
    import optimized

    _require(spec, backend)
    inp = _expert_inputs(spec)
    w = inp["weights"]
    cand = _candidate(spec, backend, lambda: optimized.experts(
        inp["x"], inp["ids"], inp["topk_weights"], w.w13, w.w2, swiglu_limit=inp["cfg"].swiglu_limit,
        numerics=_numerics(spec), backend=backend))
    cfg = inp["cfg"]
    return output_checks(cand, inp["ref"], inp["ref_exact"], slot_inter=cfg.n_activated_experts * cfg.moe_inter_dim)


def _run_moe(spec: MoESpec, backend: str) -> list[Check]:
    import optimized

    _require(spec, backend)
    inp = _expert_inputs(spec)
    cfg, w, x = inp["cfg"], inp["weights"], inp["x"]
    cand_ids, cand_weights = optimized.route(x, w.gate, w.bias, token_ids=inp["token_ids"], tid2eid=w.tid2eid,
                                             cfg=cfg, backend=backend)
    bad_layout = _route_layout(cand_ids, cand_weights, *inp["ids"].shape)
    if bad_layout:
        return [Check("candidate router layout", BITWISE, 1, bad_layout)]
    agree = route_agreement(inp["ids"], inp["topk_weights"], cand_ids, inp["keys"], cfg.n_routed_experts)
    cand = _candidate(spec, backend, lambda: optimized.moe(x, w, token_ids=inp["token_ids"], cfg=cfg,
                                                           numerics=_numerics(spec), backend=backend))
    sets = Check("expert sets (candidate router)", ROUTE_SETS, int(agree.unexplained.sum()),
                 f"{int(agree.near_tie.sum())} near-tie tokens left out of the output comparison")
    checks = [sets, *output_checks(cand, inp["ref"], inp["ref_exact"], rows=~agree.near_tie,
                                   slot_inter=cfg.n_activated_experts * cfg.moe_inter_dim)]
    if spec.module:
        layer = optimized.MoE(w, cfg, _numerics(spec), backend=backend)
        same = torch.equal(layer(x, inp["token_ids"]), cand)
        checks.append(Check("MoE module equals moe()", BITWISE, 0 if same else 1, "same inputs, same backend"))
    return checks


_RUNNERS: dict[str, Callable[[MoESpec, str], list[Check]]] = {
    "route": _run_route,
    "experts": _run_experts,
    "moe": _run_moe,
}
