"""Self-checks of the MoE reference (spec §5) and of the MoE parity checks themselves.

Tolerances come from `parity_tests.tolerances`; properties that hold exactly are tested bitwise. The
reference's matmuls accumulate in fp64 and round once to fp32 (`reference.invariant`), so a token's result
does not depend on which tokens share a call: formulations that batch tokens differently agree bitwise.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from parity_tests.metrics import calc_diff, ulp_distance
from parity_tests.ops.moe import (
    COLD_EXPERT,
    HOT_EXPERT,
    hot_ids,
    output_checks,
    route_checks,
    tie_pairs,
    with_extreme_logits,
    with_ties,
)
from parity_tests.tolerances import MOE_END_TO_END, MOE_SIMULATED, ROUTE_NEAR_TIE_GAP, SQRT_SOFTPLUS_ULPS
from reference.config import TINY
from reference.invariant import linear_fp32
from reference.moe import (
    BIAS_CENTER,
    BIAS_SPREAD,
    SOFTPLUS_TAIL,
    MoE,
    MoEWeights,
    expert_forward,
    expert_sum,
    experts,
    moe,
    random_moe_weights,
    route,
    router_scores,
    shared_expert,
    sqrt_softplus,
    swiglu,
)
from reference.numerics import EXACT, MEGAMOE, OFFICIAL, PRESETS
from reference.weights import Fp8Weight

HASH_LAYER, TOPK_LAYER = 0, TINY.n_hash_layers
K, E = TINY.n_activated_experts, TINY.n_routed_experts


@functools.cache
def _weights(layer: int, expert_format: str = "fp8", fmt: str = "e4m3fn") -> MoEWeights:
    return random_moe_weights(TINY, layer, expert_format=expert_format, fmt=fmt,
                              generator=torch.Generator().manual_seed(7))


def _x(n_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, TINY.dim, generator=g).to(torch.bfloat16)
    return x, torch.randint(0, TINY.vocab_size, (n_tokens,), generator=g)


def _route(w: MoEWeights, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return route(x, w.gate, w.bias, token_ids=token_ids, tid2eid=w.tid2eid, cfg=TINY)


def _experts(w: MoEWeights, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, numerics=OFFICIAL):
    return experts(x, ids, weights, w.w13, w.w2, swiglu_limit=TINY.swiglu_limit, numerics=numerics)


def _failed(checks):
    return [c.name for c in checks if not c.passed]


# ------------------------------------------------------------------------------------------------
# Router
# ------------------------------------------------------------------------------------------------


def test_sqrt_softplus_is_official_above_the_tail_and_accurate_below() -> None:
    body = torch.linspace(SOFTPLUS_TAIL, 80.0, 20001)
    assert torch.equal(sqrt_softplus(body), F.softplus(body).sqrt())
    tail = torch.cat([torch.linspace(-200.0, SOFTPLUS_TAIL - 1e-3, 20001), torch.tensor([-30.0])])
    truth = torch.log1p(torch.exp(tail.double())).sqrt().float()
    assert ulp_distance(sqrt_softplus(tail), truth) <= SQRT_SOFTPLUS_ULPS.value
    extreme = sqrt_softplus(torch.tensor([-30.0, 30.0, -100.0, float("nan")]))
    assert extreme[0] > 0 and extreme[2] > 0 and extreme[1] == torch.tensor(30.0).sqrt()
    assert torch.isnan(extreme[3])


@pytest.mark.parametrize("layer", [TOPK_LAYER, HASH_LAYER], ids=["topk", "hash"])
def test_route_matches_the_official_gate(layer: int) -> None:
    """Transcription of the official `Gate.forward` (torch.topk; random data has no ties), its fp32 logits
    accumulated in fp64 as the reference's are (`reference.invariant`)."""
    w = _weights(layer)
    x, token_ids = _x(64)
    scores = F.softplus(linear_fp32(x, w.gate)).sqrt()
    if w.is_hash:
        indices = w.tid2eid[token_ids].long()
    else:
        indices = (scores + w.bias).topk(K, dim=-1)[1]
    weights = scores.gather(1, indices)
    weights /= weights.sum(dim=-1, keepdim=True)
    weights *= TINY.route_scale
    ids, topk_weights = _route(w, x, token_ids)
    assert ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    assert torch.equal(ids.long(), indices) and torch.equal(topk_weights, weights)


def test_route_breaks_exact_ties_toward_the_lower_expert_id() -> None:
    w = _weights(TOPK_LAYER)
    gate, bias = with_ties(w.gate, w.bias)
    x, _ = _x(256)
    keys = router_scores(x, gate) + bias
    ids, _ = route(x, gate, bias, token_ids=None, tid2eid=None, cfg=TINY)
    member = torch.zeros(x.shape[0], E, dtype=torch.bool).scatter_(1, ids.long(), True)
    straddles = 0
    for lo, hi in tie_pairs(E):
        assert torch.equal(keys[:, lo], keys[:, hi])
        assert not (member[:, hi] & ~member[:, lo]).any()
        straddles += int((member[:, lo] & ~member[:, hi]).sum())
    assert straddles > 0  # the tie decided the selection at least once


def test_bias_steers_selection_but_weights_come_from_unbiased_scores() -> None:
    w = _weights(TOPK_LAYER)
    x, _ = _x(32)
    bias = w.bias.clone()
    bias[3] = 100.0
    ids, weights = route(x, w.gate, bias, token_ids=None, tid2eid=None, cfg=TINY)
    assert bool((ids == 3).any(dim=-1).all())
    chosen = router_scores(x, w.gate).gather(1, ids.long())
    assert torch.equal(weights, chosen / chosen.sum(dim=-1, keepdim=True) * TINY.route_scale)


@pytest.mark.parametrize("layer", [TOPK_LAYER, HASH_LAYER], ids=["topk", "hash"])
def test_logits_of_plus_minus_30_give_finite_positive_weights(layer: int) -> None:
    w = _weights(layer)
    x, token_ids = _x(8)
    x, gate, bias, tid2eid = with_extreme_logits(x, w.gate, w.bias, w.tid2eid, token_ids)
    logits = x.float() @ gate.float().T
    assert bool((logits[:, HOT_EXPERT] == 30).all() and (logits[:, COLD_EXPERT] == -30).all())
    ids, weights = route(x, gate, bias, token_ids=token_ids, tid2eid=tid2eid, cfg=TINY)
    cold = weights[ids == COLD_EXPERT]
    hot = weights[ids == HOT_EXPERT]
    assert cold.numel() == hot.numel() == x.shape[0]
    assert bool(torch.isfinite(weights).all() and (cold > 0).all() and (cold < hot).all())


def test_hash_routing_reads_tid2eid_and_rejects_unknown_token_ids() -> None:
    w = _weights(HASH_LAYER)
    x, token_ids = _x(16)
    ids, _ = _route(w, x, token_ids)
    assert torch.equal(ids, w.tid2eid[token_ids].to(torch.int32))
    for bad in (TINY.vocab_size, -1):
        wrong = token_ids.clone()
        wrong[5] = bad
        with pytest.raises(ValueError, match="token_ids"):
            _route(w, x, wrong)
    with pytest.raises(ValueError, match="token_ids"):
        route(x, w.gate, None, token_ids=None, tid2eid=w.tid2eid, cfg=TINY)
    with pytest.raises(ValueError, match="bias"):
        route(x, w.gate, torch.zeros(E), token_ids=token_ids, tid2eid=w.tid2eid, cfg=TINY)


def test_route_input_errors_name_the_argument() -> None:
    w = _weights(TOPK_LAYER)
    x, _ = _x(4)
    with pytest.raises(ValueError, match="gate_weight"):
        route(x, w.gate[:-1], w.bias, token_ids=None, tid2eid=None, cfg=TINY)
    with pytest.raises(ValueError, match="bias"):
        route(x, w.gate, None, token_ids=None, tid2eid=None, cfg=TINY)
    with pytest.raises(ValueError, match="x"):
        route(x[0], w.gate, w.bias, token_ids=None, tid2eid=None, cfg=TINY)


# ------------------------------------------------------------------------------------------------
# Experts
# ------------------------------------------------------------------------------------------------


def test_swiglu_clamps_the_gate_from_above_only_and_up_both_ways() -> None:
    gate = torch.tensor([-50.0, 12.0, 3.0, 12.0])
    up = torch.tensor([2.0, 2.0, -15.0, float("nan")])
    got = swiglu(gate, up, 10.0)
    want = F.silu(torch.tensor([-50.0, 10.0, 3.0, 10.0])) * torch.tensor([2.0, 2.0, -10.0, float("nan")])
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.isnan(got[3])
    assert torch.equal(swiglu(gate, up, 0.0).nan_to_num(), (F.silu(gate) * up).nan_to_num())


def _dense_oracle(w: MoEWeights, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Every expert on every token and every slot, each slot keeping the rows routed to that expert: no
    gather, no scatter. A token's k outputs are added in ascending expert id, as `experts` adds them."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(E):
        w13, w2 = Fp8Weight(w.w13.data[e], w.w13.scale[e]), Fp8Weight(w.w2.data[e], w.w2.scale[e])
        for slot in range(ids.shape[1]):
            rows = ids[:, slot] == e
            if rows.any():
                y_e = expert_forward(x, w13, w2, weights[:, slot], swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
                y += torch.where(rows[:, None], y_e.float(), 0.0)
    return y.to(torch.bfloat16)


@pytest.mark.parametrize("pattern", ["routed", "hot", "skip"])
def test_experts_equal_a_dense_per_slot_formulation(pattern: str) -> None:
    """Bitwise: the reference's matmuls do not depend on how many tokens share them. "hot": every token
    routed to the same k experts (the others get none); "skip": ids of -1 contribute nothing."""
    w = _weights(TOPK_LAYER)
    x, token_ids = _x(24)
    ids, weights = _route(w, x, token_ids)
    if pattern == "hot":
        ids = hot_ids(x.shape[0], K, "cpu")
    elif pattern == "skip":
        ids = ids.clone()
        ids[::3, 1] = -1
        ids[5] = -1
    got = _experts(w, x, ids, weights)
    assert torch.equal(got, _dense_oracle(w, x, ids, weights))
    if pattern == "skip":
        assert torch.equal(got[5], torch.zeros_like(got[5]))


def test_experts_that_get_no_token_are_never_read() -> None:
    w = _weights(TOPK_LAYER)
    x, _ = _x(8)
    ids = hot_ids(x.shape[0], K, "cpu")
    weights = torch.full(ids.shape, 0.25)
    poisoned_scale = w.w13.scale.clone()
    poisoned_scale[K:] = float("nan")
    poisoned = Fp8Weight(w.w13.data, poisoned_scale)
    got = experts(x, ids, weights, poisoned, w.w2, swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
    assert torch.equal(got, _experts(w, x, ids, weights)) and bool(torch.isfinite(got).all())


def test_a_nan_token_stays_in_its_own_row() -> None:
    w = _weights(TOPK_LAYER)
    x, token_ids = _x(12)
    ids, weights = _route(w, x, token_ids)
    clean = _experts(w, x, ids, weights)
    x_nan = x.clone()
    x_nan[4, 17] = float("nan")
    dirty = _experts(w, x_nan, ids, weights)
    others = torch.arange(x.shape[0]) != 4
    assert bool(torch.isnan(dirty[4]).all()) and torch.equal(dirty[others], clean[others])
    layer = moe(x_nan, w, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
    assert bool(torch.isnan(layer[4]).all() and torch.isfinite(layer[others]).all())


@pytest.mark.parametrize("layer", [TOPK_LAYER, HASH_LAYER], ids=["topk", "hash"])
def test_a_tokens_output_does_not_depend_on_the_batch(layer: int) -> None:
    w = _weights(layer)
    x, token_ids = _x(9)
    batch = moe(x, w, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
    for i in (0, 4, 8):
        alone = moe(x[i:i + 1], w, token_ids=token_ids[i:i + 1], cfg=TINY, numerics=OFFICIAL)
        assert torch.equal(alone[0], batch[i])


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_fp4_experts_equal_their_lossless_fp8_reencode(fmt: str) -> None:
    w4 = _weights(TOPK_LAYER, "fp4", fmt)
    w8 = w4.to_fp8_experts(fmt)
    assert w4.expert_format == "fp4" and w8.expert_format == "fp8"
    x, token_ids = _x(16)
    numerics = OFFICIAL.replace(fp8_format=fmt)
    ids, weights = _route(w4, x, token_ids)
    assert torch.equal(_experts(w4, x, ids, weights, numerics), _experts(w8, x, ids, weights, numerics))
    assert torch.equal(moe(x, w4, token_ids=token_ids, cfg=TINY, numerics=numerics),
                       moe(x, w8, token_ids=token_ids, cfg=TINY, numerics=numerics))


def test_zero_tokens_give_empty_outputs() -> None:
    for layer in (TOPK_LAYER, HASH_LAYER):
        w = _weights(layer)
        x, token_ids = _x(0)
        ids, weights = _route(w, x, token_ids)
        assert ids.shape == (0, K) and ids.dtype == torch.int32 and weights.shape == (0, K)
        out = moe(x, w, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
        assert out.shape == (0, TINY.dim) and out.dtype == torch.bfloat16


def test_random_weights_exercise_the_swiglu_clamp() -> None:
    w = _weights(TOPK_LAYER)
    x, token_ids = _x(64)
    ids, weights = _route(w, x, token_ids)
    clamped = _experts(w, x, ids, weights)
    unclamped = experts(x, ids, weights, w.w13, w.w2, swiglu_limit=0.0, numerics=OFFICIAL)
    assert calc_diff(clamped, unclamped) > MOE_SIMULATED.value


def test_shared_expert_clamp_follows_the_checkpoint_revision() -> None:
    w = _weights(TOPK_LAYER)
    x, _ = _x(64)
    current = shared_expert(x, w.shared_w13, w.shared_w2, swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
    initial = shared_expert(x, w.shared_w13, w.shared_w2, swiglu_limit=TINY.swiglu_limit,
                            numerics=OFFICIAL.replace(shared_expert_clamp=False))
    assert torch.equal(initial, expert_forward(x, w.shared_w13, w.shared_w2, None, swiglu_limit=0.0,
                                               numerics=OFFICIAL))
    assert calc_diff(current, initial) > MOE_SIMULATED.value


@pytest.mark.parametrize("expert_format", ["fp8", "fp4"])
@pytest.mark.parametrize("numerics", [OFFICIAL, MEGAMOE], ids=lambda n: n.name)
def test_quantized_numerics_stay_within_the_end_to_end_bound_of_exact(numerics, expert_format: str) -> None:
    w = _weights(TOPK_LAYER, expert_format)
    x, token_ids = _x(48)
    quantized = moe(x, w, token_ids=token_ids, cfg=TINY, numerics=numerics)
    exact = moe(x, w, token_ids=token_ids, cfg=TINY, numerics=EXACT)
    assert MOE_SIMULATED.value < calc_diff(quantized, exact) <= MOE_END_TO_END.value


def test_moe_is_the_fp32_sum_of_routed_and_shared_experts_rounded_once() -> None:
    w = _weights(HASH_LAYER)
    x, token_ids = _x(16)
    ids, weights = _route(w, x, token_ids)
    routed = expert_sum(x, ids, weights, w.w13, w.w2, swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
    shared = shared_expert(x, w.shared_w13, w.shared_w2, swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
    layer = moe(x, w, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
    assert torch.equal(layer, (routed + shared.float()).to(torch.bfloat16))
    assert torch.equal(MoE(w, TINY, OFFICIAL)(x, token_ids), layer)
    assert torch.equal(_experts(w, x, ids, weights), routed.to(torch.bfloat16))


def test_megamoe_preset_quantizes_per_32_with_bf16_gate_up() -> None:
    assert PRESETS["megamoe"] is MEGAMOE
    assert MEGAMOE.act_block == 32 and MEGAMOE.act_quant and MEGAMOE.gate_up_bf16 and MEGAMOE.shared_expert_clamp


def test_experts_input_errors_name_the_argument() -> None:
    w = _weights(TOPK_LAYER)
    x, token_ids = _x(4)
    ids, weights = _route(w, x, token_ids)
    bad_ids = ids.clone()
    bad_ids[0, 0] = E
    cases = [
        ("topk_ids", dict(topk_ids=bad_ids)),
        ("topk_ids", dict(topk_ids=ids[:, :-1].float())),
        ("topk_weights", dict(topk_weights=weights[:, :-1])),
        ("x", dict(x=x.float())),
        ("w13", dict(w13=w.w13.data)),
    ]
    for name, change in cases:
        args = dict(x=x, topk_ids=ids, topk_weights=weights, w13=w.w13, w2=w.w2) | change
        with pytest.raises((ValueError, TypeError), match=name):
            experts(**args, swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)


def test_moe_weights_reject_inconsistent_layers() -> None:
    w = _weights(TOPK_LAYER)
    with pytest.raises(ValueError, match="tid2eid"):
        dataclasses.replace(w, tid2eid=torch.zeros(8, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="w2"):
        dataclasses.replace(w, w2=Fp8Weight(w.w2.data[:, :128], w.w2.scale[:, :1]))
    with pytest.raises(ValueError, match="gate"):
        dataclasses.replace(w, gate=w.gate.float())


def test_random_weights_have_the_documented_structure() -> None:
    topk, hashed = _weights(TOPK_LAYER), _weights(HASH_LAYER)
    assert topk.bias is not None and topk.tid2eid is None and hashed.bias is None
    assert bool(((topk.bias - BIAS_CENTER).abs() < 6 * BIAS_SPREAD).all())
    rows = hashed.tid2eid.long()
    assert rows.shape == (TINY.vocab_size, K) and bool(((rows >= 0) & (rows < E)).all())
    assert bool((rows.sort(dim=-1).values.diff(dim=-1) > 0).all())  # k distinct experts per token id


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reference_on_the_gpu_agrees_with_the_cpu() -> None:
    w = _weights(TOPK_LAYER)
    x, token_ids = _x(33)
    cpu = moe(x, w, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
    gpu = moe(x.cuda(), w.to("cuda"), token_ids=token_ids.cuda(), cfg=TINY, numerics=OFFICIAL)
    assert calc_diff(gpu.cpu(), cpu) <= MOE_SIMULATED.value


# ------------------------------------------------------------------------------------------------
# The parity checks can fail
# ------------------------------------------------------------------------------------------------


def _route_case(layer: int = TOPK_LAYER, n_tokens: int = 48):
    w = _weights(layer)
    x, token_ids = _x(n_tokens)
    ids, weights = _route(w, x, token_ids)
    keys = None if w.is_hash else router_scores(x, w.gate) + w.bias
    return (ids, weights), keys


def test_route_checks_fail_a_swapped_expert_and_pass_a_near_tie() -> None:
    ref, keys = _route_case()
    assert not _failed(route_checks(ref, ref, keys, E))
    ids, weights = ref
    outside = int((torch.arange(E)[None, :] != ids[0, :, None].long()).all(dim=0).nonzero()[0])
    swapped = ids.clone()
    swapped[0, -1] = outside
    assert _failed(route_checks(ref, (swapped, weights), keys, E)) == ["expert sets"]
    # the same swap is a near tie when the reference's keys of the two experts are that close
    close = keys.clone()
    close[0, outside] = keys[0, ids[0, -1]] - ROUTE_NEAR_TIE_GAP / 2
    assert not _failed(route_checks(ref, (swapped, weights), close, E))
    assert _failed(route_checks(ref, (ids, weights + 1e-3), keys, E)) == ["weights"]
    assert _failed(route_checks(ref, (ids.long(), weights), keys, E)) == ["layout"]


def test_route_checks_fail_a_tie_broken_toward_the_higher_id() -> None:
    w = _weights(TOPK_LAYER)
    gate, bias = with_ties(w.gate, w.bias)
    x, _ = _x(256)
    ref = route(x, gate, bias, token_ids=None, tid2eid=None, cfg=TINY)
    keys = router_scores(x, gate) + bias
    flipped = ref[0].clone()
    for lo, hi in tie_pairs(E):
        was_lo, was_hi = flipped == lo, flipped == hi
        flipped[was_lo], flipped[was_hi] = hi, lo
    assert not _failed(route_checks(ref, ref, keys, E, pairs=tie_pairs(E)))
    assert _failed(route_checks(ref, (flipped, ref[1]), keys, E, pairs=tie_pairs(E))) == [
        "exact ties -> lower expert id"]


def test_hash_route_checks_allow_no_near_ties() -> None:
    ref, keys = _route_case(HASH_LAYER)
    ids, weights = ref[0].clone(), ref[1].clone()
    ids[3], weights[3] = ids[3].roll(1), weights[3].roll(1)  # the same set in another order is fine
    assert not _failed(route_checks(ref, (ids, weights), keys, E))
    other = ref[0].clone()
    other[3, 0] = int((torch.arange(E)[None, :] != other[3, :, None].long()).all(dim=0).nonzero()[0])
    assert "expert sets" in _failed(route_checks(ref, (other, ref[1]), keys, E))


def test_output_checks_fail_late_routing_weights_and_leaked_nans() -> None:
    w = _weights(TOPK_LAYER)
    x, token_ids = _x(32)
    ids, weights = _route(w, x, token_ids)
    ref, exact = _experts(w, x, ids, weights), _experts(w, x, ids, weights, EXACT)
    assert not _failed(output_checks(ref, ref, exact))
    # the routing weight applied to the down projection's output instead of its input
    ones = torch.ones_like(weights)
    late = torch.zeros(x.shape)
    for slot in range(K):
        unit = experts(x, ids[:, slot:slot + 1], ones[:, slot:slot + 1], w.w13, w.w2,
                       swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
        late += unit.float() * weights[:, slot:slot + 1]
    assert "vs reference, same numerics" in _failed(output_checks(late.to(torch.bfloat16), ref, exact))
    leaked = ref.clone()
    leaked[7, 0] = float("nan")
    assert "non-finite positions" in _failed(output_checks(leaked, ref, exact))
    assert _failed(output_checks(ref.float(), ref, exact)) == ["layout"]
