"""Tensor and expert parallelism of one layer: what rank `r` of `W` holds and computes (spec §3.4 TP note,
§3.6 TP, §5.2).

torchtitan style: `reference/attention.py` and `reference/moe.py` stay single-device; this file slices a
layer's weights for one rank and says what that rank produces *before* the reduction. Sum the ranks'
outputs (the all-reduce), apply the post-reduction step here, and you get the unsharded layer — bitwise
for W = 1, within the bounds below for W > 1.

Attention, tensor parallel (official `Attention`: `wq_b`/`wo_a` are `ColumnParallelLinear`, `wo_b` is
`RowParallelLinear`; vLLM the same):

| weight                          | rank r holds                                                   |
|---------------------------------|----------------------------------------------------------------|
| wq_a, q_norm, wkv, kv_norm      | everything (replicated): every rank computes c_q and the KV    |
| wq_b [H*512, q]                 | the rows of its heads [r*H/W, (r+1)*H/W) (column parallel)     |
| attn_sink [H]                   | the same heads                                                 |
| wo_a [G*R, (H/G)*512]           | the rows of its groups [r*G/W, (r+1)*G/W) (whole groups)       |
| wo_b [D, G*R]                   | the columns of those groups (row parallel)                     |
| compressor, indexer             | everything (replicated)                                        |

Heads must keep whole `wo_a` groups, so W must divide G (and then H: heads per group is H/G). Because the
single KV head, the compressor and the indexer are replicated, the rank-local layer is the unchanged
`Attention` with `n_heads = H/W`, `o_groups = G/W` (`tp_attention_config`): its window ring, compressed
entries and cache are the unsharded layer's, bitwise (the projections accumulate order-independently,
`reference.invariant`), and its query heads are the unsharded layer's heads `[r*H/W, (r+1)*H/W)`, bitwise.
The indexer: official shards its 64 heads over the ranks and all-reduces the scores `I` before the top-k;
vLLM replicates them. We replicate, so every rank selects exactly the unsharded layer's entries. (Sharding
it would add partial sums of bf16-rounded per-head scores — official evaluates the scores in bf16 — and
could move near-tied entries across the top-k boundary.)

Where the bf16 roundings sit (official `RowParallelLinear.forward`: `y = linear(x, w)` — the FP8 GEMM's bf16
output — then `y.float()`, `all_reduce`, `y.type_as(x)`):
    unsharded:  out = bf16( sum_{c < G*R} z[c] wo_b[:, c] )                   one rounding
    rank r:     p_r = bf16( sum_{c in its groups} z[c] wo_b[:, c] )          (`attention_rank_output`)
    sharded:    out = bf16( sum_r float(p_r) )                                W + 1 roundings
The activation quantization of `wo_b` (per token, per 128 channels) is unchanged: a group is R = 1024
channels (TINY: 256), so no 128-block straddles two ranks. Hence W = 1 is bitwise, and for W > 1 the
sharded output differs from the unsharded one by the W partial roundings and the final one (each at most
half a bf16 ulp of its value): not bitwise; `tolerances.SHARDED_BF16_PARTIALS`.

MoE, expert parallel (official `MoE`):
  * rank r holds routed experts [r*E/W, (r+1)*E/W) (contiguous), W must divide E;
  * routing is replicated: every rank holds the gate (and bias / tid2eid) and routes every token, so all
    ranks select the same experts; each rank runs only the (token, slot) pairs whose expert it holds;
  * the shared expert is replicated and computed in full on every rank *after* the all-reduce (official
    `y += self.shared_experts(x)` after `dist.all_reduce(y)`; its `Expert` uses plain `Linear`s). vLLM
    instead splits the shared expert's intermediate dim like a TP MLP and folds its partial into the
    reduction; we follow official.
Where the roundings sit:
    rank r:     p_r = sum_{e in its experts, ascending} float(y_e)            fp32 (`moe_rank_output`)
    sharded:    out = bf16( sum_r p_r + float(shared) )                        (`combine_moe`)
    unsharded:  out = bf16( sum_{e ascending} float(y_e) + float(shared) )      (`reference.moe.moe`)
Every y_e (bf16) is the same on both sides; only the fp32 association of the <= k terms per token differs.
W = 1 is bitwise; for W > 1 the fp32 sums differ in the last bits, and the bf16 results are equal except
where that moves a sum across a bf16 rounding boundary (one bf16 ulp on rare elements):
`tolerances.SHARDED_FP32_PARTIALS`. The all-reduce's own order (NCCL ring / tree, gloo) is unspecified;
it is one more fp32 association and changes nothing above.

MoE, expert parallel with dispatch and combine (DeepEP, MegaMoE; data-parallel attention in front): the
tokens are split over the ranks instead of replicated. Each rank routes its own tokens, sends every
(token, slot) to the rank that owns the slot's expert (`plan_dispatch`; the token's row, expert id and
routing weight travel), the owner runs each received row through that expert (`dispatched_expert_outputs`:
`y_e`, bf16), the rows travel back, and the token's rank sums its k outputs in fp32 in ascending expert id,
adds its shared expert and casts once (`combine_dispatched`). Every y_e is computed exactly as unsharded (the
expert linears accumulate order-independently, `reference.invariant`, so a row's result does not depend on
the other rows of its batch) and summed in the unsharded order: the result is bitwise the unsharded layer's,
for every W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.attention import Attention, AttentionWeights
from reference.cache import AttentionCache
from reference.config import DSv4Config
from reference.moe import ExpertWeight, MoEWeights, expert_sum, route
from reference.numerics import Numerics
from reference.weights import FP8_WEIGHT_BLOCK, Fp4Weight, Fp8Weight


def shard_range(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """The contiguous block `[r*n/W, (r+1)*n/W)` of `n` items (heads, groups, experts) that rank `r` owns.

    Raises:
        ValueError: unless `world >= 1`, `0 <= rank < world` and `world` divides `n` (named `what`).
    """
    for name, value in (("rank", rank), ("world", world)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if world < 1:
        raise ValueError(f"world: expected >= 1 ranks, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world = {world}, got {rank}")
    if n % world:
        raise ValueError(f"world: {world} ranks must divide the {n} {what}")
    per = n // world
    return rank * per, (rank + 1) * per


def _block_slice(start: int, stop: int, name: str) -> slice:
    """The 128x128 scale blocks of the rows / columns [start, stop) of a block-FP8 weight."""
    if start % FP8_WEIGHT_BLOCK or stop % FP8_WEIGHT_BLOCK:
        raise ValueError(f"{name}: a shard boundary at {start}..{stop} would split a {FP8_WEIGHT_BLOCK}x"
                         f"{FP8_WEIGHT_BLOCK} scale block")
    return slice(start // FP8_WEIGHT_BLOCK, stop // FP8_WEIGHT_BLOCK)


def fp8_rows(w: Fp8Weight, start: int, stop: int, name: str) -> Fp8Weight:
    """Rows (output features) [start, stop) of a 2-d block-FP8 weight [N, K], with their scales (contiguous)."""
    blocks = _block_slice(start, stop, name)
    return Fp8Weight(w.data[start:stop].contiguous(), w.scale[blocks].contiguous())


def fp8_columns(w: Fp8Weight, start: int, stop: int, name: str) -> Fp8Weight:
    """Columns (input features) [start, stop) of a 2-d block-FP8 weight [N, K], with their scales (contiguous)."""
    blocks = _block_slice(start, stop, name)
    return Fp8Weight(w.data[:, start:stop].contiguous(), w.scale[:, blocks].contiguous())


def expert_slice(w: ExpertWeight, start: int, stop: int) -> ExpertWeight:
    """Experts [start, stop) of a stacked [E, N, K] expert weight (FP8 or MXFP4), contiguous."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.data[start:stop].contiguous(), w.scale[start:stop].contiguous())
    return Fp4Weight(w.packed[start:stop].contiguous(), w.scale[start:stop].contiguous())


# ------------------------------------------------------------------------------------------------
# Attention: tensor parallel over heads and wo_a groups (spec §3.6 TP)
# ------------------------------------------------------------------------------------------------


def tp_attention_config(cfg: DSv4Config, world: int) -> DSv4Config:
    """The config every rank's attention runs with: `n_heads = H/W`, `o_groups = G/W` (8 heads per group for
    Flash and Pro stay 8), everything else unchanged (the indexer keeps all its heads: replicated).

    Raises:
        ValueError: unless `world` divides `o_groups` (heads keep whole `wo_a` groups).
    """
    shard_range(cfg.o_groups, 0, world, "wo_a groups (o_groups); heads must keep whole groups")
    if world == 1:
        return cfg
    return cfg.replace(name=f"{cfg.name}-tp{world}", n_heads=cfg.n_heads // world, o_groups=cfg.o_groups // world)


def shard_attention_weights(
    weights: AttentionWeights, cfg: DSv4Config, rank: int, world: int
) -> tuple[AttentionWeights, DSv4Config]:
    """Rank `rank`'s slice of one attention layer's weights, and the config it runs them with.

    Heads [r*H/W, (r+1)*H/W) (rows of `wq_b`, entries of `attn_sink`), groups [r*G/W, (r+1)*G/W) (rows of
    `wo_a`, columns of `wo_b`); `wq_a`, `q_norm`, `wkv`, `kv_norm`, compressor and indexer replicated.

    Args:
        weights: the whole layer's `AttentionWeights` (shapes of `cfg`).
        cfg: the model config.
        rank, world: this rank and the tensor-parallel size (W must divide `o_groups`).

    Returns:
        (local weights, `tp_attention_config(cfg, world)`); `Attention(local_cfg, layer_id, local_weights)`
        is rank r's layer.
    """
    g0, g1 = shard_range(cfg.o_groups, rank, world, "wo_a groups (o_groups); heads must keep whole groups")
    h0, h1 = g0 * cfg.heads_per_group, g1 * cfg.heads_per_group
    d, r = cfg.head_dim, cfg.o_lora_rank
    local = AttentionWeights(
        wq_a=weights.wq_a,
        q_norm=weights.q_norm,
        wq_b=fp8_rows(weights.wq_b, h0 * d, h1 * d, "wq_b"),
        wkv=weights.wkv,
        kv_norm=weights.kv_norm,
        wo_a=fp8_rows(weights.wo_a, g0 * r, g1 * r, "wo_a"),
        wo_b=fp8_columns(weights.wo_b, g0 * r, g1 * r, "wo_b"),
        attn_sink=weights.attn_sink[h0:h1].contiguous(),
        compressor=weights.compressor,
        indexer=weights.indexer,
    )
    return local, tp_attention_config(cfg, world)


def attention_rank_output(
    x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, local_weights: AttentionWeights,
    local_cfg: DSv4Config, layer_id: int, numerics: Numerics, cache: AttentionCache | None = None,
) -> torch.Tensor:
    """What rank r contributes to the attention all-reduce: its heads' attention, its groups' `wo_a`, its
    columns of `wo_b`, with `wo_b`'s bf16 output upcast to fp32 (official `RowParallelLinear`).

    Args:
        x: [T, D] bf16 (replicated: every rank sees every token).
        positions: [T] int64.
        cu_seqlens: [B + 1] int32.
        local_weights, local_cfg: from `shard_attention_weights`.
        layer_id: the layer.
        numerics: quantization simulation switches.
        cache: this rank's `AttentionCache` (built with `local_cfg`; its contents equal the unsharded
            layer's), or None for fresh prompts. Updated in place.

    Returns:
        [T, D] fp32 — bf16 values; `combine_attention` of their sum over ranks is the layer's output.
    """
    layer = Attention(local_cfg, layer_id, local_weights, numerics)
    return layer(x, positions, cu_seqlens, cache).float()


def combine_attention(reduced: torch.Tensor) -> torch.Tensor:
    """After the all-reduce: `y.type_as(x)` of official `RowParallelLinear` — [T, D] fp32 -> [T, D] bf16."""
    return reduced.to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# MoE: expert parallel (spec §5.2)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEShard:
    """What one rank holds of an MoE layer under expert parallelism.

    Attributes:
        rank, world: this rank and the expert-parallel size.
        expert_start, expert_stop: the routed experts [start, stop) this rank owns.
        gate, bias, tid2eid: the router, replicated (as in `MoEWeights`).
        w13: [E/W, 2I, D] the owned experts' w1 | w3 (`Fp8Weight` or `Fp4Weight`).
        w2: [E/W, D, I] their w2.
        shared_w13, shared_w2: the shared expert, replicated.
    """

    rank: int
    world: int
    expert_start: int
    expert_stop: int
    gate: torch.Tensor
    bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    w13: ExpertWeight
    w2: ExpertWeight
    shared_w13: Fp8Weight
    shared_w2: Fp8Weight

    @property
    def n_experts(self) -> int:
        """E, the number of routed experts of the whole layer."""
        return self.gate.shape[0]


def shard_moe_weights(weights: MoEWeights, cfg: DSv4Config, rank: int, world: int) -> MoEShard:
    """Rank `rank`'s share of one MoE layer: routed experts [r*E/W, (r+1)*E/W); router and shared expert replicated.

    Raises:
        ValueError: unless `world` divides `cfg.n_routed_experts` and the weights hold that many experts.
    """
    if weights.gate.shape[0] != cfg.n_routed_experts:
        raise ValueError(f"weights: hold {weights.gate.shape[0]} experts, cfg {cfg.name} has {cfg.n_routed_experts}")
    start, stop = shard_range(cfg.n_routed_experts, rank, world, "routed experts (n_routed_experts)")
    return MoEShard(rank, world, start, stop, weights.gate, weights.bias, weights.tid2eid,
                    expert_slice(weights.w13, start, stop), expert_slice(weights.w2, start, stop),
                    weights.shared_w13, weights.shared_w2)


def local_expert_ids(topk_ids: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Global expert ids -> this rank's local ids: `id - start` for ids in [start, stop), -1 (skip) for the rest.

    Args:
        topk_ids: [T, k] int, values in [0, E).

    Returns:
        [T, k] int32, values in [-1, stop - start).
    """
    owned = (topk_ids >= start) & (topk_ids < stop)
    return torch.where(owned, topk_ids - start, -1).to(torch.int32)


def moe_rank_output(
    x: torch.Tensor, shard: MoEShard, *, token_ids: torch.Tensor | None, cfg: DSv4Config, numerics: Numerics
) -> torch.Tensor:
    """What rank r contributes to the MoE all-reduce: route every token (replicated), then the fp32 sum of its
    own experts' outputs, expert by expert in ascending id (official `MoE.forward` before `all_reduce`).

    Args:
        x: [T, D] bf16 (replicated).
        shard: this rank's `MoEShard`.
        token_ids: [T] int, required by hash layers.
        cfg: model config.
        numerics: quantization simulation switches.

    Returns:
        [T, D] fp32 — `combine_moe` of its sum over ranks (plus the shared expert) is the layer's output.
    """
    topk_ids, topk_weights = route(x, shard.gate, shard.bias, token_ids=token_ids, tid2eid=shard.tid2eid, cfg=cfg)
    local_ids = local_expert_ids(topk_ids, shard.expert_start, shard.expert_stop)
    return expert_sum(x, local_ids, topk_weights, shard.w13, shard.w2, swiglu_limit=cfg.swiglu_limit,
                      numerics=numerics)


def combine_moe(reduced: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """After the all-reduce: add the (replicated) shared expert's bf16 output in fp32 and cast once.

    Args:
        reduced: [T, D] fp32 — the sum over ranks of `moe_rank_output`.
        shared: [T, D] bf16 — `reference.moe.shared_expert(x, ...)`, computed on every rank.

    Returns:
        [T, D] bf16.
    """
    return (reduced + shared.float()).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# MoE: expert parallel with dispatch and combine (DeepEP / MegaMoE)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchPlan:
    """Where one rank sends its (token, slot) pairs: grouped by destination rank, in rank order.

    Attributes:
        token: [n] int64 — the pair's token (row of this rank's x), in send order.
        slot: [n] int64 — its top-k slot.
        expert: [n] int64 — its global expert id.
        counts: pairs sent to each rank (len W); the first `counts[0]` pairs go to rank 0, and so on.
    """

    token: torch.Tensor
    slot: torch.Tensor
    expert: torch.Tensor
    counts: list[int]


def plan_dispatch(topk_ids: torch.Tensor, n_experts: int, world: int) -> DispatchPlan:
    """Group this rank's (token, slot) pairs by the rank that owns their expert (rank `e // (E/W)`); within a
    destination, token-major order (a stable sort, so the plan is deterministic).

    Args:
        topk_ids: [T, k] int, values in [0, E) (this rank's tokens' routing).
        n_experts: E. world: W (must divide E).

    Returns:
        The `DispatchPlan`.
    """
    shard_range(n_experts, 0, world, "routed experts (n_routed_experts)")  # raises unless W divides E
    expert = topk_ids.long().flatten()
    owner = expert // (n_experts // world)
    order = torch.sort(owner, stable=True).indices
    k = topk_ids.shape[1]
    counts = torch.bincount(owner, minlength=world).tolist()
    return DispatchPlan(order // k, order % k, expert[order], counts)


def dispatched_expert_outputs(
    x_rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, shard: MoEShard, *, cfg: DSv4Config,
    numerics: Numerics,
) -> torch.Tensor:
    """What an expert owner computes for the rows it received: each row through its expert with its routing
    weight (`expert_forward`: gate/up, SwiGLU, weight before the down projection), bf16 values.

    Args:
        x_rows: [n, D] bf16 — one row per received (token, slot).
        experts: [n] int — global expert ids, all owned by this rank.
        weights: [n] fp32 — the routing weights.
        shard: this rank's `MoEShard`.

    Returns:
        [n, D] fp32 (exact bf16 values y_e), to send back.
    """
    local = local_expert_ids(experts[:, None], shard.expert_start, shard.expert_stop)
    if bool((local < 0).any()):
        raise ValueError(f"experts: rank {shard.rank} owns experts [{shard.expert_start}, {shard.expert_stop}), "
                         "received rows for others")
    return expert_sum(x_rows, local, weights[:, None].float(), shard.w13, shard.w2, swiglu_limit=cfg.swiglu_limit,
                      numerics=numerics)


def combine_dispatched(
    y_rows: torch.Tensor, plan: DispatchPlan, topk_ids: torch.Tensor, shared: torch.Tensor
) -> torch.Tensor:
    """Back on the tokens' rank: each token's k expert outputs summed in fp32 in ascending expert id (the
    unsharded order), plus the shared expert in fp32, cast to bf16 once.

    Args:
        y_rows: [n, D] fp32 — the expert outputs, in the plan's send order (as they come back).
        plan: this rank's `DispatchPlan`.
        topk_ids: [T, k] int — this rank's routing.
        shared: [T, D] bf16 — the shared expert on this rank's tokens.

    Returns:
        [T, D] bf16.
    """
    n_tokens, k = topk_ids.shape
    per_slot = torch.zeros((n_tokens, k, y_rows.shape[1]), dtype=torch.float32, device=y_rows.device)
    per_slot[plan.token, plan.slot] = y_rows
    order = torch.sort(topk_ids.long(), dim=1, stable=True).indices  # each token's slots by ascending expert id
    routed = torch.zeros((n_tokens, y_rows.shape[1]), dtype=torch.float32, device=y_rows.device)
    for j in range(k):
        routed = routed + per_slot[torch.arange(n_tokens, device=y_rows.device), order[:, j]]
    return (routed + shared.float()).to(torch.bfloat16)
