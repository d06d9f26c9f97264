"""DSv4's MoE layer: router, routed experts, shared expert (spec §5).

Per token `x` (bf16 `[D]`, the `ffn_norm` output):

    l = x W_gate^T                      fp32                                   (§5.1)
    s = sqrt(softplus(l))               "sqrtsoftplus"
    ids = topk_k(s + b)  or  tid2eid[token_id]    (bias steers selection only; hash layers use the token id)
    w = route_scale * s[ids] / sum(s[ids])        (weights from the *unbiased* scores, renormalized)
    y = sum_i  W2_e( bf16( w_i * silu(min(g, L)) * clamp(u, -L, L) ) )     fp32 sum over the k experts
        with [g | u] = W13_e(x) (bf16)                                       (§5.2)
    out = bf16( y + shared(x) )                                              (§5.2, §5.3)

`experts(...)` is the MegaMoE boundary: it takes the routing result and does not route. Every linear is
the block-FP8 (or FP8 x MXFP4) linear of `reference.linear`, with the activation quantization switched by
`Numerics`. The loop over experts mirrors the official `MoE.forward`: experts that receive no token are
never read, and the fp32 sum is accumulated expert by expert in ascending expert id. Every matmul
(router logits, expert linears) accumulates in fp64 and rounds once to fp32 (`reference.invariant`), so a
token's result does not depend on which other tokens share the call or an expert.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from reference.config import DSv4Config
from reference.formats import E4M3FN, FP8Format, pack_fp4, quantize_fp4, quantize_per_block
from reference.invariant import linear_fp32
from reference.linear import act_quant_dequant
from reference.numerics import OFFICIAL, Numerics
from reference.weights import FP8_WEIGHT_BLOCK, Fp4Weight, Fp8Weight

ExpertWeight = Fp8Weight | Fp4Weight

# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEWeights:
    """One MoE layer's weights, in the checkpoint's formats (spec §1.1).

    Attributes:
        gate: [E, D] bf16 router weight.
        bias: [E] fp32 selection bias (`e_score_correction_bias`) of a non-hash layer, else None.
        tid2eid: [vocab, k] int token id -> expert ids of a hash layer, else None.
        w13: [E, 2I, D] routed experts' w1 (rows 0..I-1, gate) and w3 (rows I..2I-1, up), as
            `Fp8Weight` (128x128 blocks) or `Fp4Weight` (MXFP4, the official checkpoint format).
        w2: [E, D, I] routed experts' down projection, same format as `w13`.
        shared_w13: [2I, D] shared expert's w1 | w3, `Fp8Weight`.
        shared_w2: [D, I] shared expert's w2, `Fp8Weight`.
    """

    gate: torch.Tensor
    bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    w13: ExpertWeight
    w2: ExpertWeight
    shared_w13: Fp8Weight
    shared_w2: Fp8Weight

    def __post_init__(self) -> None:
        if self.gate.dim() != 2 or self.gate.dtype != torch.bfloat16:
            raise ValueError(f"gate: expected [E, D] bf16, got {tuple(self.gate.shape)} {self.gate.dtype}")
        n_experts, dim = self.gate.shape
        if (self.bias is None) == (self.tid2eid is None):
            raise ValueError("bias, tid2eid: a layer has exactly one of them (bias: non-hash layers, "
                             f"tid2eid: hash layers), got bias={_describe(self.bias)}, "
                             f"tid2eid={_describe(self.tid2eid)}")
        if self.bias is not None and (self.bias.shape != (n_experts,) or self.bias.dtype != torch.float32):
            raise ValueError(f"bias: expected [{n_experts}] fp32, got {_describe(self.bias)}")
        if self.tid2eid is not None and (self.tid2eid.dim() != 2 or self.tid2eid.is_floating_point()):
            raise ValueError(f"tid2eid: expected [vocab, k] integer, got {_describe(self.tid2eid)}")
        for name in ("w13", "w2", "shared_w13", "shared_w2"):
            weight = getattr(self, name)
            allowed = (Fp8Weight,) if name.startswith("shared") else (Fp8Weight, Fp4Weight)
            if not isinstance(weight, allowed):
                raise TypeError(f"{name}: expected {' or '.join(t.__name__ for t in allowed)}, "
                                f"got {type(weight).__name__}")
        inter = self.w2.shape[-1]
        _check_shape("w13", self.w13.shape, (n_experts, 2 * inter, dim))
        _check_shape("w2", self.w2.shape, (n_experts, dim, inter))
        if type(self.w13) is not type(self.w2):
            raise TypeError(f"w13, w2: expected the same format, got {type(self.w13).__name__} and "
                            f"{type(self.w2).__name__}")
        shared_inter = self.shared_w2.shape[-1]
        _check_shape("shared_w13", self.shared_w13.shape, (2 * shared_inter, dim))
        _check_shape("shared_w2", self.shared_w2.shape, (dim, shared_inter))

    @property
    def is_hash(self) -> bool:
        """Hash layer: experts chosen by token id (spec §5.1)."""
        return self.tid2eid is not None

    @property
    def expert_format(self) -> str:
        """`"fp8"` or `"fp4"`: the routed experts' weight format."""
        return "fp8" if isinstance(self.w13, Fp8Weight) else "fp4"

    def to(self, device: torch.device | str) -> MoEWeights:
        """A copy on `device`."""
        return MoEWeights(
            gate=self.gate.to(device),
            bias=None if self.bias is None else self.bias.to(device),
            tid2eid=None if self.tid2eid is None else self.tid2eid.to(device),
            w13=self.w13.to(device),
            w2=self.w2.to(device),
            shared_w13=self.shared_w13.to(device),
            shared_w2=self.shared_w2.to(device),
        )

    def to_fp8_experts(self, fmt: str | FP8Format = E4M3FN) -> MoEWeights:
        """A copy whose MXFP4 routed experts are re-encoded as 128x128 block FP8 without changing a value
        (spec §2.6, official `convert.py --expert-dtype fp8`; raises where that would not be lossless).
        FP8 experts are returned unchanged."""
        if isinstance(self.w13, Fp8Weight):
            return self
        return replace(self, w13=self.w13.to_fp8(fmt), w2=self.w2.to_fp8(fmt))


def _describe(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)} {t.dtype}"


def _check_shape(name: str, got: tuple[int, ...] | torch.Size, expect: tuple[int, ...]) -> None:
    if tuple(got) != expect:
        raise ValueError(f"{name}: expected shape {expect}, got {tuple(got)}")


# Statistics of the random weights. Router logits of a unit-RMS input spread over a few units: with std 2
# the selected experts' logits mostly lie between 2.5 and 6 (scores 1.6..2.5) and the tail reaches
# l ~ -6 (score ~0.05), so the renormalized weights are uneven but none dominates.
GATE_LOGIT_STD = 2.0
# Flash's correction biases are all near 8.08 (vLLM notes it); the spread around it reorders experts
# whose scores are within ~0.1, like load-balancing biases do.
BIAS_CENTER, BIAS_SPREAD = 8.08, 0.1
# w1/w3 std 3/sqrt(D): gate/up values of a unit-RMS input have std 3, so ~0.1 % of them pass
# swiglu_limit = 10 and the clamp is exercised (it exists because real experts produce such values).
GATE_UP_STD = 3.0


def _gaussian(shape: tuple[int, ...], std: float, generator: torch.Generator | None,
              device: torch.device | str) -> torch.Tensor:
    """N(0, std^2) fp32, drawn on the generator's device (so FLASH/PRO-sized weights are drawn on the GPU)."""
    where = generator.device if generator is not None else torch.device(device)
    return torch.randn(shape, generator=generator, device=where, dtype=torch.float32) * std


def random_router_weights(
    cfg: DSv4Config, layer_id: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Random `(gate [E, D] bf16, bias [E] fp32 | None, tid2eid [vocab, k] int32 | None)` of layer `layer_id`.

    Non-hash layers get a bias near 8.08 plus small noise; hash layers get a `tid2eid` whose rows are
    `k` distinct experts. The first draws of `random_moe_weights` with the same generator.
    """
    n_experts, dim = cfg.n_routed_experts, cfg.dim
    gate = _gaussian((n_experts, dim), GATE_LOGIT_STD * dim**-0.5, generator, device).to(torch.bfloat16)
    bias, tid2eid = None, None
    if cfg.is_hash_layer(layer_id):
        shuffled = torch.rand((cfg.vocab_size, n_experts), generator=generator, device=gate.device).argsort(dim=-1)
        tid2eid = shuffled[:, : cfg.n_activated_experts].to(torch.int32)
    else:
        bias = BIAS_CENTER + _gaussian((n_experts,), BIAS_SPREAD, generator, device)
    return tuple(None if t is None else t.to(device) for t in (gate, bias, tid2eid))  # type: ignore[return-value]


def _random_weight(n: int, k: int, std: float, expert_format: str, fmt: str | FP8Format,
                   generator: torch.Generator | None, device: torch.device | str) -> ExpertWeight:
    w = _gaussian((n, k), std, generator, device)
    if expert_format == "fp8":
        q, s = quantize_per_block(w, FP8_WEIGHT_BLOCK, fmt)
        return Fp8Weight(q.to(device), s.to(device))
    codes, s = quantize_fp4(w)
    return Fp4Weight(pack_fp4(codes).to(device), s.to(device))


def _parts(weight: ExpertWeight) -> tuple[torch.Tensor, torch.Tensor]:
    return (weight.data, weight.scale) if isinstance(weight, Fp8Weight) else (weight.packed, weight.scale)


def _empty_stack(like: ExpertWeight, n_experts: int) -> ExpertWeight:
    """Uninitialized [E, N, K] storage of `like`'s format, filled expert by expert (one copy in memory)."""
    return type(like)(*(torch.empty((n_experts, *t.shape), dtype=t.dtype, device=t.device) for t in _parts(like)))


def random_moe_weights(
    cfg: DSv4Config, layer_id: int, *, expert_format: str = "fp8", fmt: str | FP8Format = "e4m3fn",
    generator: torch.Generator | None = None, device: torch.device | str = "cpu",
) -> MoEWeights:
    """Random weights of MoE layer `layer_id` with realistic statistics.

    Router as in `random_router_weights`; experts Gaussian (w1/w3 std `3/sqrt(D)`, w2 std `1/sqrt(I)`),
    quantized expert by expert to 128x128 block FP8 in `fmt` (`expert_format="fp8"`) or to MXFP4
    (`"fp4"`, the official checkpoint format); the shared expert always FP8. The same generator state
    gives the same underlying Gaussian weights in both expert formats. Draws happen on the generator's
    device: pass a CUDA generator for FLASH/PRO shapes (6.4 G / 25 G expert parameters).
    """
    if expert_format not in ("fp8", "fp4"):
        raise ValueError(f"expert_format: expected 'fp8' or 'fp4', got {expert_format!r}")
    gate, bias, tid2eid = random_router_weights(cfg, layer_id, generator=generator, device=device)
    dim, inter, n_experts = cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts
    w13: ExpertWeight | None = None
    w2: ExpertWeight | None = None
    for e in range(n_experts):
        w13_e = _random_weight(2 * inter, dim, GATE_UP_STD * dim**-0.5, expert_format, fmt, generator, device)
        w2_e = _random_weight(dim, inter, inter**-0.5, expert_format, fmt, generator, device)
        if w13 is None or w2 is None:
            w13, w2 = _empty_stack(w13_e, n_experts), _empty_stack(w2_e, n_experts)
        for stacked, one in ((w13, w13_e), (w2, w2_e)):
            for dst, src in zip(_parts(stacked), _parts(one)):
                dst[e] = src
    shared_w13 = _random_weight(2 * inter, dim, GATE_UP_STD * dim**-0.5, "fp8", fmt, generator, device)
    shared_w2 = _random_weight(dim, inter, inter**-0.5, "fp8", fmt, generator, device)
    return MoEWeights(gate, bias, tid2eid, w13, w2, shared_w13, shared_w2)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# Router (spec §5.1)
# ------------------------------------------------------------------------------------------------

# Below this logit, softplus(l) = log1p(e^l) equals e^l to fp32 precision (the next term, e^(2l)/2, is
# under 2^-29 relative), so sqrt(softplus(l)) = e^(l/2) exactly enough; e^(l/2) stays a normal fp32
# number down to l ~ -174, whereas e^l is subnormal below l ~ -87 and 0 below l ~ -104.
SOFTPLUS_TAIL = -20.0


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    """The "sqrtsoftplus" score `sqrt(log(1 + e^l))`, accurate for every fp32 logit.

    For `l >= -20` this is the official `F.softplus(l).sqrt()` bit for bit (torch's softplus returns
    `l` above 20, so large logits give `sqrt(l)`, never inf); below -20 it is `e^(l/2)`, which does not
    underflow (a naive `log(1 + exp(l))` in fp32 is 0 from l ~ -16.6 on). NaN stays NaN.

    Args:
        logits: [...] fp32.

    Returns:
        [...] fp32, > 0 for every finite logit above ~ -206.
    """
    return torch.where(logits < SOFTPLUS_TAIL, torch.exp(logits * 0.5), F.softplus(logits).sqrt())


def select_topk(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest keys per row, largest first; exact ties go to the lower index.

    A stable descending sort keeps equal keys in index order, which fixes the tie rule (`torch.topk`
    leaves it unspecified). NaN sorts above every number.

    Args:
        keys: [T, E] fp32.

    Returns:
        [T, k] int64.
    """
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]


def router_scores(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Unbiased expert scores `sqrt_softplus(x W_gate^T)`, logits in fp32 (official upcasts both operands;
    here the sum is accumulated in fp64 and rounded once, so it is independent of the batch).

    Args:
        x: [T, D] bf16; gate_weight: [E, D].

    Returns:
        [T, E] fp32.
    """
    return sqrt_softplus(linear_fp32(x, gate_weight))


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, *, token_ids: torch.Tensor | None,
    tid2eid: torch.Tensor | None, cfg: DSv4Config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose `k = cfg.n_activated_experts` experts per token and their weights (spec §5.1).

    Logits in fp32 (official upcasts both operands), score `sqrt_softplus`; non-hash layers select the
    top-k of `score + bias` (ties -> lower expert id), hash layers (`tid2eid` given) take
    `tid2eid[token_ids]`. Weights are the *unbiased* scores of the selected experts divided by their
    sum (official divides without a floor) times `cfg.route_scale`.

    Args:
        x: [T, D] bf16.
        gate_weight: [E, D] (bf16 in the checkpoint).
        bias: [E] fp32 for non-hash layers; None for hash layers.
        token_ids: [T] int, required by hash layers (rows of `tid2eid`).
        tid2eid: [vocab, k] int for hash layers; None otherwise.
        cfg: model config (`n_routed_experts`, `n_activated_experts`, `route_scale`).

    Returns:
        topk_ids: [T, k] int32 (non-hash: by decreasing `score + bias`; hash: `tid2eid` order).
        topk_weights: [T, k] fp32, each row summing to `route_scale` (up to rounding).
    """
    _check_route_inputs(x, gate_weight, bias, token_ids, tid2eid, cfg)
    scores = router_scores(x, gate_weight)
    if tid2eid is not None:
        topk_ids = tid2eid[token_ids.long()].long()  # type: ignore[union-attr]
        if topk_ids.numel() and bool(((topk_ids < 0) | (topk_ids >= cfg.n_routed_experts)).any()):
            raise ValueError(f"tid2eid: rows of these tokens hold expert ids outside [0, {cfg.n_routed_experts})")
    else:
        topk_ids = select_topk(scores + bias, cfg.n_activated_experts)  # bias steers selection only
    weights = scores.gather(1, topk_ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)  # renormalize: the score is not a softmax
    weights = weights * cfg.route_scale
    return topk_ids.to(torch.int32), weights


def _check_route_inputs(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None,
                        token_ids: torch.Tensor | None, tid2eid: torch.Tensor | None, cfg: DSv4Config) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: expected [T, D] floating point, got {_describe(x)}")
    expect = (cfg.n_routed_experts, x.shape[1])
    if tuple(gate_weight.shape) != expect:
        raise ValueError(f"gate_weight: expected shape {expect} (n_routed_experts, D), got {tuple(gate_weight.shape)}")
    if tid2eid is None:
        if bias is None or tuple(bias.shape) != (cfg.n_routed_experts,):
            raise ValueError(f"bias: a non-hash layer needs [{cfg.n_routed_experts}] fp32, got {_describe(bias)}")
        return
    if bias is not None:
        raise ValueError("bias: hash layers (tid2eid given) have no selection bias; pass bias=None")
    if tid2eid.dim() != 2 or tid2eid.shape[1] != cfg.n_activated_experts or tid2eid.is_floating_point():
        raise ValueError(f"tid2eid: expected [vocab, {cfg.n_activated_experts}] integer, got {_describe(tid2eid)}")
    if token_ids is None:
        raise ValueError("token_ids: hash layers route by token id; got None")
    if token_ids.shape != (x.shape[0],) or token_ids.is_floating_point():
        raise ValueError(f"token_ids: expected [{x.shape[0]}] integer, got {_describe(token_ids)}")
    vocab = tid2eid.shape[0]
    if token_ids.numel() and bool(((token_ids < 0) | (token_ids >= vocab)).any()):
        raise ValueError(f"token_ids: every id must be in [0, {vocab}) (the rows of tid2eid), got min "
                         f"{int(token_ids.min())}, max {int(token_ids.max())}")


# ------------------------------------------------------------------------------------------------
# Experts (spec §5.2, §5.3)
# ------------------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """`silu(min(gate, L)) * clamp(up, -L, L)` in fp32; the gate is clamped only from above.

    `swiglu_limit <= 0` means no clamp (official `if self.swiglu_limit > 0`).
    """
    gate, up = gate.float(), up.float()
    if swiglu_limit > 0:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def _linear_fp32(x: torch.Tensor, weight: ExpertWeight, numerics: Numerics) -> torch.Tensor:
    """`fp8_linear` / `fp4_linear` (spec §2.5, §2.6) before their bf16 output cast: [n, K] bf16 -> [n, N] fp32."""
    return linear_fp32(act_quant_dequant(x, numerics), weight.dequantize())


def expert_forward(
    x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, route_weight: torch.Tensor | None, *,
    swiglu_limit: float, numerics: Numerics,
) -> torch.Tensor:
    """One SwiGLU expert on its tokens, in the official order (spec §5.2; official `Expert.forward`).

    `[g | u] = x W13^T` (rounded to bf16 when `numerics.gate_up_bf16`, as the official bf16 linear
    outputs are), `a = swiglu(g, u)` in fp32, times the routing weight *before* the down projection,
    then `y = bf16(a) W2^T` (its input re-quantized per `numerics.act_block`), bf16.

    Args:
        x: [n, D] bf16.
        w13: [2I, D] `Fp8Weight` or `Fp4Weight` (rows 0..I-1 gate, I..2I-1 up).
        w2: [D, I] same format.
        route_weight: [n] fp32, or None (shared expert: weight 1, no multiply).

    Returns:
        [n, D] bf16.
    """
    inter = w13.shape[-2] // 2
    h = _linear_fp32(x, w13, numerics)  # [n, 2I]
    if numerics.gate_up_bf16:
        h = h.to(torch.bfloat16).float()
    a = swiglu(h[:, :inter], h[:, inter:], swiglu_limit)  # [n, I] fp32
    if route_weight is not None:
        a = a * route_weight.float()[:, None]
    return _linear_fp32(a.to(torch.bfloat16), w2, numerics).to(torch.bfloat16)


def _expert(weight: ExpertWeight, e: int) -> ExpertWeight:
    """Expert `e`'s slice [N, K] of a stacked [E, N, K] weight."""
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(weight.data[e], weight.scale[e])
    return Fp4Weight(weight.packed[e], weight.scale[e])


def expert_sum(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, *,
    swiglu_limit: float, numerics: Numerics,
) -> torch.Tensor:
    """The routed experts' outputs summed over the top-k in fp32: `experts` before its bf16 cast.

    This is the partial sum that expert parallelism all-reduces (spec §5.2) and that `moe` adds the
    shared expert to. Summation order: expert by expert in ascending id (official `MoE.forward`).

    Args, Returns: as `experts`, but the result is [T, D] fp32.
    """
    _check_expert_inputs(x, topk_ids, topk_weights, w13, w2)
    ids = topk_ids.long()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    counts = torch.bincount(ids[ids >= 0], minlength=w13.shape[0]).tolist()
    for e, count in enumerate(counts):
        if count == 0:
            continue  # an expert without tokens is never read
        tokens, slots = torch.where(ids == e)
        y_e = expert_forward(x[tokens], _expert(w13, e), _expert(w2, e), topk_weights[tokens, slots],
                             swiglu_limit=swiglu_limit, numerics=numerics)
        y.index_add_(0, tokens, y_e.float())
    return y


def experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, *,
    swiglu_limit: float, numerics: Numerics,
) -> torch.Tensor:
    """The routed experts for given routing (the MegaMoE boundary: no routing inside), spec §5.2.

    Each (token, slot) runs `expert_forward` of expert `topk_ids[t, j]` with routing weight
    `topk_weights[t, j]`; the k results are summed in fp32 and cast to bf16 once. A slot with id -1
    is skipped (contributes nothing); a repeated id in one row counts once per slot.

    Args:
        x: [T, D] bf16.
        topk_ids: [T, k] int, values in [-1, E).
        topk_weights: [T, k] fp32.
        w13: [E, 2I, D] `Fp8Weight` or `Fp4Weight`.
        w2: [E, D, I] same format.
        swiglu_limit: the clamp `L` (`cfg.swiglu_limit`, 10 for Flash and Pro; <= 0: no clamp).
        numerics: activation quantization (`act_quant`, `act_block`, `fp8_format`) and `gate_up_bf16`.

    Returns:
        [T, D] bf16.
    """
    return expert_sum(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit,
                      numerics=numerics).to(torch.bfloat16)


def _check_expert_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w13: ExpertWeight, w2: ExpertWeight) -> None:
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, (Fp8Weight, Fp4Weight)):
            raise TypeError(f"{name}: expected Fp8Weight or Fp4Weight, got {type(w).__name__}")
        if len(w.shape) != 3:
            raise ValueError(f"{name}: expected a stacked [E, N, K] weight, got logical shape {tuple(w.shape)}")
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected [T, D] bf16, got {_describe(x)}")
    n_experts, two_inter, dim = w13.shape
    _check_shape("w13", w13.shape, (n_experts, two_inter, x.shape[1]))
    _check_shape("w2", w2.shape, (n_experts, dim, two_inter // 2))
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids: expected [{x.shape[0]}, k] integer, got {_describe(topk_ids)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights: expected {tuple(topk_ids.shape)} floating point (as topk_ids), "
                         f"got {_describe(topk_weights)}")
    if topk_ids.numel() and bool(((topk_ids < -1) | (topk_ids >= n_experts)).any()):
        raise ValueError(f"topk_ids: expected values in [-1, {n_experts}) (-1 = skip), got min "
                         f"{int(topk_ids.min())}, max {int(topk_ids.max())}")


def shared_expert(
    x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, *, swiglu_limit: float, numerics: Numerics,
) -> torch.Tensor:
    """The shared expert: the routed experts' SwiGLU with FP8 weights and routing weight 1 (spec §5.3).

    Clamped by `swiglu_limit` in the current official revision; `numerics.shared_expert_clamp=False`
    gives the initial release (no clamp).

    Args:
        x: [T, D] bf16.
        w13: [2I, D] `Fp8Weight`; w2: [D, I] `Fp8Weight`.

    Returns:
        [T, D] bf16.
    """
    limit = swiglu_limit if numerics.shared_expert_clamp else 0.0
    return expert_forward(x, w13, w2, None, swiglu_limit=limit, numerics=numerics)


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------


def moe(
    x: torch.Tensor, weights: MoEWeights, *, token_ids: torch.Tensor | None, cfg: DSv4Config, numerics: Numerics,
) -> torch.Tensor:
    """DSv4's MoE layer: route, routed experts, shared expert (spec §5).

    The routed experts' fp32 sum plus the shared expert's bf16 output are added in fp32 and cast to
    bf16 once (official `y += self.shared_experts(x); return y.type_as(x)`).

    Args:
        x: [T, D] bf16 (the `ffn_norm` output).
        weights: the layer's `MoEWeights`.
        token_ids: [T] int, required by hash layers.
        cfg: model config.
        numerics: quantization simulation switches.

    Returns:
        [T, D] bf16.
    """
    topk_ids, topk_weights = route(x, weights.gate, weights.bias, token_ids=token_ids, tid2eid=weights.tid2eid,
                                   cfg=cfg)
    routed = expert_sum(x, topk_ids, topk_weights, weights.w13, weights.w2, swiglu_limit=cfg.swiglu_limit,
                        numerics=numerics)
    shared = shared_expert(x, weights.shared_w13, weights.shared_w2, swiglu_limit=cfg.swiglu_limit,
                           numerics=numerics)
    return (routed + shared.float()).to(torch.bfloat16)


class MoE(nn.Module):
    """DSv4's MoE layer as a module: holds the weights, config and numerics; `forward` calls `moe`."""

    def __init__(self, weights: MoEWeights, cfg: DSv4Config, numerics: Numerics = OFFICIAL) -> None:
        super().__init__()
        self.weights = weights
        self.cfg = cfg
        self.numerics = numerics

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, D] bf16, token_ids: [T] int (hash layers) -> [T, D] bf16."""
        return moe(x, self.weights, token_ids=token_ids, cfg=self.cfg, numerics=self.numerics)
