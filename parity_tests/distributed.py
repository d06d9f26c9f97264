"""Sharded parity: the backends run sharded over W ranks and are compared with the unsharded reference
(issue #7; what each rank computes is `reference/sharding.py`).

    torchrun --nproc-per-node W -m parity_tests --distributed [--config TINY] [--ops moe_ep,moe_ep_dispatch]
                                                              [--backends reference,triton] [--out DIR]
    python -m parity_tests --distributed          # without torchrun: a world of one rank

Every rank builds the same seeded weights and inputs, keeps its shard (`reference.sharding`), runs it through
one backend (`backend=`: the reference, or the optimized public API), and the ranks combine their outputs
(an all-reduce of fp32 partials, or all-to-all dispatch and combine); rank 0 compares the result with the
unsharded reference layer, prints a table and writes a
JSON report and JUnit XML (`parity_tests.report`'s formats, suite "sharded"); every rank exits with rank 0's
code (1 when any check failed or a case raised; "not run" is not a failure). Process group: NCCL with one
GPU per rank (`LOCAL_RANK`) when CUDA is available and the Triton interpreter is off (under `TRITON_INTERPRET=1` the
Triton backend takes CPU tensors), else gloo on the CPU; NCCL's NVLink multicast is kept off (`MULTICAST_OFF`,
set before the process group exists).

Ops:
  * moe_ep: expert parallelism. Routing replicated (every rank routes every token), rank r runs its
    experts [r*E/W, (r+1)*E/W) on the (token, slot) pairs routed to them, the fp32 partials are all-reduced,
    the replicated shared expert is added after the reduction. The optimized backends run it through the
    public `optimized.route` / `optimized.experts` (the MegaMoE boundary, which returns bf16: their
    per-rank partials are bf16-rounded, like MegaMoE's and DeepEP's combine); their shared expert is
    `experts` with one expert, weight 1, on every token (the same SwiGLU, spec §5.3).
  * moe_ep_dispatch: expert parallelism with dispatch and combine (DeepEP, MegaMoE; data-parallel attention
    in front): the tokens are split evenly over the ranks, each rank routes its own, sends every (token, slot)
    to its expert's owner (`all_to_all_single`: rows, expert ids, routing weights), the owner runs the rows
    through the expert (reference, or `optimized.experts` with one slot per row), the rows come back, and
    each token's k outputs are summed in fp32 in ascending expert id, plus the shared expert, bf16 once
    (`reference.sharding.combine_dispatched`). The reference result is bitwise the unsharded layer's.
  * attention_tp: tensor parallelism. Rank r runs the unchanged attention layer (reference or
    `optimized.Attention`) with its heads and `wo_a` groups (`shard_attention_weights`): a prefill
    of a batch of sequences of different lengths, then one decode step per sequence from its own cache. The
    numerics take the FP8 `wo_a` path (the optimized layer implements that one) on both sides.
    W must divide `o_groups`; where the config's groups are too few (TINY has 2), the case runs on
    `attention_config(cfg, W)`: the config with `o_groups = W` and as many heads per group as before.

Checks (rank 0, per case and backend):
  * "reduced vs unsharded reference": calc_diff of the all-reduced, combined output against the unsharded
    reference layer with the same numerics: `SHARDED_FP32_PARTIALS` (reference MoE: official fp32
    partials) or `SHARDED_BF16_PARTIALS` (attention; optimized MoE), plus the backend's own bound for its
    kernels (`tolerances.sharded_bound`). Tokens whose expert set differs from the reference router's by a
    near tie are left out and counted (spec §7.1 pitfall 5).
  * "W = 1 equals the unsharded layer" (reference backend, one rank): bitwise.
  * moe_ep_dispatch: "combined vs unsharded reference" bitwise for the reference, `MOE_SIMULATED` for the
    optimized backends (no partial sums: each row is one expert's output); "every (token, slot) received once
    by its expert's owner": bitwise.
  * "per shard vs reference shard" (optimized backends): each rank's partial against the reference's rank
    output on the same shard and the same routing, the op's own bound; the worst rank is reported.
  * moe_ep: "routing identical on every rank" and "each (token, slot) on exactly one rank": bitwise.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from rich.console import Console

from parity_tests import report
from parity_tests.cases import Check, NotRun, generator
from parity_tests.metrics import calc_diff, worst_position
from parity_tests.ops.moe import route_agreement
from parity_tests.report import Result, Task
from parity_tests.tolerances import (
    ATTENTION_LAYER_SIMULATED,
    BITWISE,
    MOE_SIMULATED,
    ROUTE_SETS,
    SHARDED_BF16_PARTIALS,
    SHARDED_FP32_PARTIALS,
    Bound,
    sharded_bound,
)
from reference.attention import Attention, AttentionWeights, random_attention_weights
from reference.cache import AttentionCache
from reference.config import DSv4Config, get_config
from reference.moe import MoEWeights, expert_sum, moe, random_moe_weights, route, router_scores, shared_expert
from reference.numerics import PRESETS, Numerics
from reference.sharding import (
    DispatchPlan,
    MoEShard,
    attention_rank_output,
    combine_attention,
    combine_dispatched,
    combine_moe,
    dispatched_expert_outputs,
    local_expert_ids,
    moe_rank_output,
    plan_dispatch,
    shard_attention_weights,
    shard_moe_weights,
)
from reference.weights import Fp8Weight

# NCCL's NVLink SHARP / multicast paths stay off (issue #7): set before the process group is created.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# How long a rank waits in a collective for the others (a crashed rank must not hang the run for gloo's
# default 30 minutes); DSV4_DIST_TIMEOUT overrides it, in seconds.
COLLECTIVE_TIMEOUT_S = 600
OPS = ("moe_ep", "moe_ep_dispatch", "attention_tp")
BACKENDS = ("reference", "triton", "deepgemm")
SUITE = "sharded"
WEIGHT_SEED = 0
DEFAULT_OUT = Path("build/parity")

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------
# The process group
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """This process's place in the process group and the collectives the cases use.

    Attributes:
        rank, size: this rank and W.
        device: where this rank's tensors live (`cuda:LOCAL_RANK` under NCCL, else the CPU).
    """

    rank: int
    size: int
    device: torch.device

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t` (a new tensor; the order of the sum is the backend's)."""
        out = t.contiguous().clone()
        dist.all_reduce(out)
        return out

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """`t` of every rank, in rank order (same shape and dtype on every rank)."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t)
        return out

    def all_to_all(self, t: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Send rows `[sum(send_counts[:d]), sum(send_counts[:d+1]))` of `t` to rank d; returns the rows received
        (from rank 0 first) and how many came from each rank. bf16 travels as fp32 (exact both ways; gloo's
        all-to-all has no 2-byte types)."""
        counts = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)
        recv_counts = received.tolist()
        wire = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).contiguous()
        out = wire.new_empty((sum(recv_counts), *wire.shape[1:]))
        dist.all_to_all_single(out, wire, output_split_sizes=recv_counts, input_split_sizes=list(send_counts))
        return out.to(t.dtype), recv_counts

    def gather_floats(self, value: float) -> list[float]:
        """A Python float of every rank, in rank order."""
        return [float(v) for v in self.all_gather(torch.tensor([value], dtype=torch.float64, device=self.device))]

    def agree(self, ok: bool) -> bool:
        """True on every rank iff `ok` is True on every rank."""
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def together(self, fn: Callable[[], T]) -> T:
        """Run this rank's local work; raise on every rank if it raised on any, so that no rank is left
        waiting in the next collective. A rank re-raises its own exception (e.g. `NotRun`); the others
        raise a RuntimeError that points at it."""
        try:
            value, error = fn(), None
        except Exception as exc:  # re-raised below, after the other ranks know
            value, error = None, exc
        if not self.agree(error is None):
            if error is not None:
                raise error
            raise RuntimeError("another rank failed in its local computation (its error is in its report line)")
        return value  # type: ignore[return-value]


def init_world() -> World:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or form a
    world of one without torchrun. NCCL on CUDA (one GPU per rank), gloo on the CPU (no GPU, or the Triton
    interpreter, whose kernels take CPU tensors); multicast off. Raises RuntimeError when a rank has no GPU."""
    from optimized.backends import detect

    os.environ.update(MULTICAST_OFF)
    timeout = datetime.timedelta(seconds=float(os.environ.get("DSV4_DIST_TIMEOUT", COLLECTIVE_TIMEOUT_S)))
    cuda = torch.cuda.is_available() and not detect().interpret
    device = torch.device("cpu")
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank}: this machine has {torch.cuda.device_count()} GPU(s), one per "
                               "rank is needed; start fewer ranks per node, or set TRITON_INTERPRET=1 for gloo on the "
                               "CPU")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return World(dist.get_rank(), dist.get_world_size(), device)


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedSpec:
    """One sharded case.

    Attributes:
        op: one of `OPS`.
        config: "TINY", "FLASH" or "PRO".
        layer_id: the layer (MoE: 0 is a hash layer, `n_hash_layers` the first top-k one; attention: its kind).
        lengths: prefill tokens of each sequence (MoE: one entry, the token count).
        fmt: FP8 format of weights and activations.
        numerics: preset name (the numerics of both sides).
        expert_format: "fp8" or "fp4" (MoE).
        decode: attention: one decode step per sequence after the prefill, from the cache.
    """

    op: str
    config: str
    layer_id: int
    lengths: tuple[int, ...]
    fmt: str = "e4m3fn"
    numerics: str = "official"
    expert_format: str = "fp8"
    decode: bool = True

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def seed(self) -> int:
        return 2000 + 100 * self.layer_id + self.tokens

    def label(self, world: int) -> str:
        parts = [f"W={world}", f"layer={self.layer_id}"]
        if self.op.startswith("moe"):
            parts += [f"T={self.tokens}", self.expert_format]
            return ",".join([*parts, self.numerics])
        parts += ["seqs=" + "+".join(map(str, self.lengths)), *(["+decode"] if self.decode else [])]
        return ",".join([*parts, f"{self.numerics}+fp8_wo_a"])


def specs(config: str) -> list[ShardedSpec]:
    """The sharded cases of `config`: TINY ones cheap enough for the CPU interpreter at W = 4 on two cores;
    FLASH / PRO ones at real shapes (prefill and decode token counts) for GPUs."""
    cfg = get_config(config)
    hash_layer, topk_layer = 0, cfg.n_hash_layers
    csa = next(i for i in range(cfg.n_layers) if cfg.layer_kind(i) == "csa")
    hca = next(i for i in range(cfg.n_layers) if cfg.layer_kind(i) == "hca")
    s = functools.partial(ShardedSpec, config=cfg.name)
    if cfg.name == "TINY":
        return [
            s(op="moe_ep", layer_id=topk_layer, lengths=(8,)),
            s(op="moe_ep", layer_id=hash_layer, lengths=(8,), fmt="e4m3fnuz", expert_format="fp4"),
            s(op="moe_ep_dispatch", layer_id=topk_layer, lengths=(8,)),
            s(op="attention_tp", layer_id=csa, lengths=(3, 6)),
        ]
    return [
        s(op="moe_ep", layer_id=topk_layer, lengths=(64,)),
        s(op="moe_ep", layer_id=topk_layer, lengths=(4096,), expert_format="fp4"),
        s(op="moe_ep", layer_id=hash_layer, lengths=(512,)),
        s(op="moe_ep_dispatch", layer_id=topk_layer, lengths=(512,), expert_format="fp4"),
        s(op="moe_ep_dispatch", layer_id=hash_layer, lengths=(64,)),
        s(op="attention_tp", layer_id=csa, lengths=(2100, 40)),
        s(op="attention_tp", layer_id=hca, lengths=(1100, 5), numerics="vllm_nvidia"),
    ]


def attention_config(cfg: DSv4Config, world: int) -> DSv4Config:
    """`cfg` when `world` divides its `o_groups`; else a named variant with `o_groups = world` and the same
    heads per group (tensor parallelism keeps whole `wo_a` groups on a rank)."""
    if cfg.o_groups % world == 0:
        return cfg
    return cfg.replace(name=f"{cfg.name}-G{world}", o_groups=world, n_heads=world * cfg.heads_per_group)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    """CPU cases draw on the CPU; GPU cases draw on the GPU (FLASH/PRO experts are 6.4 G / 25 G parameters).
    Every rank seeds the same stream, so every rank holds the same values."""
    if device.type == "cpu":
        return generator(seed)
    return torch.Generator(device=device).manual_seed(seed)


def _numerics(spec: ShardedSpec) -> Numerics:
    """The preset in the case's FP8 format; attention cases take the FP8 `wo_a` output path (vLLM / DeepGEMM),
    the one the optimized layer implements (both sides run the same numerics)."""
    numerics = PRESETS[spec.numerics].replace(fp8_format=spec.fmt)
    return numerics.replace(wo_a="fp8") if spec.op == "attention_tp" else numerics


def _require(spec: ShardedSpec, backend: str, world: World) -> None:
    """NotRun for combinations that cannot run here by design (the same on every rank)."""
    if spec.config != "TINY" and world.device.type != "cuda":
        raise NotRun(f"{spec.config}-shaped sharded cases run on GPUs (NCCL), not on {world.device.type}")
    if backend == "deepgemm" and spec.fmt != "e4m3fn":
        raise NotRun("DeepGEMM supports e4m3fn only")
    experts = get_config(spec.config).n_routed_experts
    if spec.op.startswith("moe") and experts % world.size:
        raise NotRun(f"expert parallelism needs W to divide the {experts} routed experts; W = {world.size}")


def _mismatches(tensors: list[torch.Tensor]) -> int:
    """Elements of each rank's tensor that differ (bitwise) from rank 0's, summed."""
    first = tensors[0].view(torch.uint8) if tensors[0].is_floating_point() else tensors[0]
    total = 0
    for t in tensors[1:]:
        other = t.view(torch.uint8) if t.is_floating_point() else t
        total += int((other != first).sum())
    return total


def _worst_rank(values: list[float]) -> int:
    """The rank with the largest value (a NaN counts as the largest)."""
    return max(range(len(values)), key=lambda r: math.inf if math.isnan(values[r]) else values[r])


def _bitwise(name: str, cand: torch.Tensor, ref: torch.Tensor) -> Check:
    differ = int((cand.view(torch.int16) != ref.view(torch.int16)).sum())
    return Check(name, BITWISE, differ, f"{differ} of {ref.numel()} elements differ")


def _output_check(name: str, bound: Bound, cand: torch.Tensor, ref: torch.Tensor, detail: str = "") -> Check:
    value = calc_diff(cand, ref)
    where = f"worst element {worst_position(cand, ref)}" if value != 0 else ""
    return Check(name, bound, value, "; ".join(t for t in (detail, where) if t))


# ---------------------------------------------------------------------------------- MoE (EP)


def _moe_inputs(spec: ShardedSpec, cfg: DSv4Config, device: torch.device) -> tuple[MoEWeights, torch.Tensor,
                                                                                   torch.Tensor]:
    weights = random_moe_weights(cfg, spec.layer_id, expert_format=spec.expert_format, fmt=spec.fmt,
                                 generator=_generator(WEIGHT_SEED, device), device=device)
    g = generator(spec.seed)
    x = torch.randn((spec.tokens, cfg.dim), generator=g).to(torch.bfloat16).to(device)
    token_ids = torch.randint(0, cfg.vocab_size, (spec.tokens,), generator=g).to(device)
    return weights, x, token_ids


def _one_expert(w: Fp8Weight) -> Fp8Weight:
    """A 2-d FP8 weight as a stack of one expert [1, N, K]."""
    return Fp8Weight(w.data[None], w.scale[None])


def _route(x: torch.Tensor, token_ids: torch.Tensor, shard: MoEShard, cfg: DSv4Config, backend: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int32, topk_weights [T, k] fp32) of `backend`'s router (the replicated gate)."""
    if backend == "reference":
        return route(x, shard.gate, shard.bias, token_ids=token_ids, tid2eid=shard.tid2eid, cfg=cfg)
    import optimized

    return optimized.route(x, shard.gate, shard.bias, token_ids=token_ids, tid2eid=shard.tid2eid, cfg=cfg,
                           backend=backend)


def _shared(x: torch.Tensor, shard: MoEShard, cfg: DSv4Config, numerics: Numerics, backend: str) -> torch.Tensor:
    """The shared expert on `x`, [T, D] bf16. The optimized backends have no shared-expert op of its own: it is
    the routed SwiGLU with weight 1 on every token (spec §5.3), i.e. `experts` with one expert and one slot."""
    if backend == "reference":
        return shared_expert(x, shard.shared_w13, shard.shared_w2, swiglu_limit=cfg.swiglu_limit, numerics=numerics)
    import optimized

    n_tokens = x.shape[0]
    return optimized.experts(x, torch.zeros((n_tokens, 1), dtype=torch.int32, device=x.device),
                             torch.ones((n_tokens, 1), dtype=torch.float32, device=x.device),
                             _one_expert(shard.shared_w13), _one_expert(shard.shared_w2),
                             swiglu_limit=cfg.swiglu_limit if numerics.shared_expert_clamp else 0.0,
                             numerics=numerics, backend=backend)


def _route_checks(x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, cfg: DSv4Config,
                  candidate_ids: torch.Tensor) -> tuple[list[Check], torch.Tensor]:
    """The candidate router's expert sets against the reference's (near ties allowed, spec §7.1 pitfall 5), and
    the tokens whose sets agree (the ones whose outputs are compared)."""
    ref_ids, ref_weights = route(x, weights.gate, weights.bias, token_ids=token_ids, tid2eid=weights.tid2eid, cfg=cfg)
    keys = None if weights.bias is None else router_scores(x, weights.gate) + weights.bias
    agree = route_agreement(ref_ids, ref_weights, candidate_ids, keys, cfg.n_routed_experts)
    check = Check("expert sets vs reference router", ROUTE_SETS, int(agree.unexplained.sum()),
                  f"{int(agree.near_tie.sum())} near-tie tokens left out of the output comparison")
    return [check], agree.same


@dataclass(frozen=True)
class _MoELocal:
    ids: torch.Tensor  # [T, k] int32, this rank's routing (global expert ids)
    weights: torch.Tensor  # [T, k] fp32
    partial: torch.Tensor  # [T, D] fp32, this rank's contribution to the all-reduce
    shared: torch.Tensor  # [T, D] bf16, the replicated shared expert
    reference_partial: torch.Tensor | None  # [T, D] fp32, the reference's rank output on the same routing


def _moe_local(x: torch.Tensor, token_ids: torch.Tensor, shard: MoEShard, cfg: DSv4Config, numerics: Numerics,
               backend: str) -> _MoELocal:
    ids, weights = _route(x, token_ids, shard, cfg, backend)
    shared = _shared(x, shard, cfg, numerics, backend)
    if backend == "reference":
        partial = moe_rank_output(x, shard, token_ids=token_ids, cfg=cfg, numerics=numerics)
        return _MoELocal(ids, weights, partial, shared, None)
    import optimized

    local_ids = local_expert_ids(ids, shard.expert_start, shard.expert_stop)
    limit = cfg.swiglu_limit
    partial = optimized.experts(x, local_ids, weights, shard.w13, shard.w2, swiglu_limit=limit, numerics=numerics,
                                backend=backend).float()
    reference_partial = expert_sum(x, local_ids, weights, shard.w13, shard.w2, swiglu_limit=limit, numerics=numerics)
    return _MoELocal(ids, weights, partial, shared, reference_partial)


def run_moe_ep(spec: ShardedSpec, backend: str, world: World) -> list[Check]:
    """One expert-parallel MoE case (replicated tokens, all-reduce) on every rank; the checks on rank 0."""
    _require(spec, backend, world)
    cfg, numerics = get_config(spec.config), _numerics(spec)
    weights, x, token_ids = _moe_inputs(spec, cfg, world.device)
    shard = shard_moe_weights(weights, cfg, world.rank, world.size)
    local = world.together(lambda: _moe_local(x, token_ids, shard, cfg, numerics, backend))

    all_ids, all_weights = world.all_gather(local.ids), world.all_gather(local.weights)
    owners = world.all_reduce((local_expert_ids(local.ids, shard.expert_start, shard.expert_stop) >= 0).int())
    shard_diffs = world.gather_floats(calc_diff(local.partial, local.reference_partial)
                                      if local.reference_partial is not None else 0.0)
    out = combine_moe(world.all_reduce(local.partial), local.shared)
    if world.rank != 0:
        return []

    ref = moe(x, weights, token_ids=token_ids, cfg=cfg, numerics=numerics)
    checks, rows = _route_checks(x, token_ids, weights, cfg, local.ids)
    checks += [
        Check("routing identical on every rank", BITWISE, _mismatches(all_ids) + _mismatches(all_weights),
              f"topk_ids and topk_weights of {world.size} ranks against rank 0's"),
        Check("each (token, slot) on exactly one rank", BITWISE, int((owners != 1).sum()),
              f"{owners.numel()} slots over experts split {cfg.n_routed_experts // world.size} per rank"),
    ]
    if backend == "reference":
        bound = SHARDED_FP32_PARTIALS
    else:
        bound = sharded_bound(MOE_SIMULATED, SHARDED_BF16_PARTIALS)
        worst = _worst_rank(shard_diffs)
        checks.append(Check("per shard vs reference shard", MOE_SIMULATED, shard_diffs[worst],
                            f"worst of {world.size} ranks: rank {worst} (same routing on both sides)"))
    checks.append(_output_check("reduced vs unsharded reference", bound, out[rows], ref[rows],
                                f"{int(rows.sum())} of {spec.tokens} tokens"))
    if backend == "reference" and world.size == 1:
        checks.append(_bitwise("W = 1 equals the unsharded layer", out, ref))
    return checks


def _dispatched_rows(rows: torch.Tensor, experts: torch.Tensor, route_weights: torch.Tensor, shard: MoEShard,
                     cfg: DSv4Config, numerics: Numerics, backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The expert owner's work on the rows it received: (the backend's y rows [n, D] fp32, the reference's on the
    same rows or None)."""
    reference = dispatched_expert_outputs(rows, experts, route_weights, shard, cfg=cfg, numerics=numerics)
    if backend == "reference":
        return reference, None
    import optimized

    local = local_expert_ids(experts[:, None], shard.expert_start, shard.expert_stop)
    y = optimized.experts(rows, local, route_weights[:, None].float().contiguous(), shard.w13, shard.w2,
                          swiglu_limit=cfg.swiglu_limit, numerics=numerics, backend=backend)
    return y.float(), reference


def run_moe_ep_dispatch(spec: ShardedSpec, backend: str, world: World) -> list[Check]:
    """One expert-parallel MoE case with dispatch and combine (tokens split over the ranks, two all-to-alls) on
    every rank; the checks on rank 0."""
    _require(spec, backend, world)
    if spec.tokens % world.size:
        raise NotRun(f"the case splits its {spec.tokens} tokens evenly over the ranks; W = {world.size}")
    cfg, numerics = get_config(spec.config), _numerics(spec)
    weights, x_all, token_ids_all = _moe_inputs(spec, cfg, world.device)
    mine = slice(world.rank * spec.tokens // world.size, (world.rank + 1) * spec.tokens // world.size)
    x, token_ids = x_all[mine], token_ids_all[mine]
    shard = shard_moe_weights(weights, cfg, world.rank, world.size)

    def plan() -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
        ids, route_weights = _route(x, token_ids, shard, cfg, backend)
        return ids, route_weights, plan_dispatch(ids, cfg.n_routed_experts, world.size)

    ids, route_weights, sends = world.together(plan)
    rows, received = world.all_to_all(x[sends.token], sends.counts)  # dispatch
    experts, _ = world.all_to_all(sends.expert, sends.counts)
    row_weights, _ = world.all_to_all(route_weights[sends.token, sends.slot], sends.counts)
    y_rows, reference_rows = world.together(
        lambda: _dispatched_rows(rows, experts, row_weights, shard, cfg, numerics, backend))
    y_back, _ = world.all_to_all(y_rows, received)  # combine: every row returns to its token's rank
    shared = world.together(lambda: _shared(x, shard, cfg, numerics, backend))
    out = torch.cat(world.all_gather(combine_dispatched(y_back, sends, ids, shared)))

    misrouted = int(((experts < shard.expert_start) | (experts >= shard.expert_stop)).sum())
    counts = world.gather_floats(float(len(experts)))
    misrouted_all = world.gather_floats(float(misrouted))
    shard_diffs = world.gather_floats(calc_diff(y_rows, reference_rows) if reference_rows is not None else 0.0)
    all_ids = torch.cat(world.all_gather(ids))
    if world.rank != 0:
        return []

    ref = moe(x_all, weights, token_ids=token_ids_all, cfg=cfg, numerics=numerics)
    checks, rows_ok = _route_checks(x_all, token_ids_all, weights, cfg, all_ids)
    checks.append(Check("every (token, slot) received once by its expert's owner", BITWISE,
                        abs(sum(counts) - all_ids.numel()) + sum(misrouted_all),
                        f"{int(sum(counts))} rows received for {all_ids.numel()} slots; per rank "
                        f"{[int(c) for c in counts]}"))
    if backend == "reference":
        checks.append(_bitwise("combined vs unsharded reference", out, ref))
    else:
        worst = _worst_rank(shard_diffs)
        checks.append(Check("per shard vs reference shard", MOE_SIMULATED, shard_diffs[worst],
                            f"worst of {world.size} ranks: rank {worst} (the rows it received)"))
        checks.append(_output_check("combined vs unsharded reference", MOE_SIMULATED, out[rows_ok], ref[rows_ok],
                                    f"{int(rows_ok.sum())} of {spec.tokens} tokens"))
    return checks


# ---------------------------------------------------------------------------------- attention (TP)


@dataclass(frozen=True)
class _AttentionInputs:
    x: torch.Tensor  # [T, D] bf16, the prefill of every sequence
    positions: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [B + 1] int32
    x_decode: torch.Tensor  # [B, D] bf16, one more token per sequence
    positions_decode: torch.Tensor  # [B] int64
    cu_decode: torch.Tensor  # [B + 1] int32


def _attention_inputs(spec: ShardedSpec, cfg: DSv4Config, device: torch.device) -> _AttentionInputs:
    g = generator(spec.seed)
    lengths = torch.tensor(spec.lengths)
    batch = len(spec.lengths)
    x = torch.randn((spec.tokens, cfg.dim), generator=g).to(torch.bfloat16)
    positions = torch.cat([torch.arange(n) for n in spec.lengths])
    cu = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))).to(torch.int32)
    x_decode = torch.randn((batch, cfg.dim), generator=g).to(torch.bfloat16)
    return _AttentionInputs(x.to(device), positions.to(device), cu.to(device), x_decode.to(device),
                            lengths.to(device), torch.arange(batch + 1, dtype=torch.int32).to(device))


def _attention_steps(layer: Callable[..., torch.Tensor], cache: object, inp: _AttentionInputs, decode: bool
                     ) -> torch.Tensor:
    """The prefill, then (when `decode`) one decode step from the updated cache: outputs concatenated [T (+B), D]."""
    outs = [layer(inp.x, inp.positions, inp.cu_seqlens, cache)]
    if decode:
        outs.append(layer(inp.x_decode, inp.positions_decode, inp.cu_decode, cache))
    return torch.cat(outs)


def _attention_local(inp: _AttentionInputs, local_weights: AttentionWeights, local_cfg: DSv4Config, layer_id: int,
                     numerics: Numerics, backend: str, decode: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(this rank's partial [T (+B), D] fp32, the reference's partial on the same shard or None)."""
    batch = inp.cu_seqlens.numel() - 1

    def reference_partial() -> torch.Tensor:
        def rank_layer(x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                       cache: AttentionCache) -> torch.Tensor:
            return attention_rank_output(x, positions, cu_seqlens, local_weights, local_cfg, layer_id, numerics,
                                         cache=cache)

        return _attention_steps(rank_layer, AttentionCache.empty(local_cfg, layer_id, batch, inp.x.device), inp,
                                decode)

    if backend == "reference":
        return reference_partial(), None
    import optimized as opt

    layer = opt.Attention(local_cfg, layer_id, local_weights, numerics, backend=backend)
    cache = opt.AttentionCache.empty(local_cfg, layer_id, batch, inp.x.device, packed=numerics.kv_fp8_sim)
    return _attention_steps(layer, cache, inp, decode).float(), reference_partial()


def run_attention_tp(spec: ShardedSpec, backend: str, world: World) -> list[Check]:
    """One tensor-parallel attention case on every rank; the checks on rank 0 (see the module docstring)."""
    _require(spec, backend, world)
    cfg, numerics = attention_config(get_config(spec.config), world.size), _numerics(spec)
    weights = random_attention_weights(cfg, spec.layer_id, fmt=spec.fmt, generator=generator(WEIGHT_SEED),
                                       device=world.device)
    inp = _attention_inputs(spec, cfg, world.device)
    local_weights, local_cfg = shard_attention_weights(weights, cfg, world.rank, world.size)
    partial, reference_partial = world.together(
        lambda: _attention_local(inp, local_weights, local_cfg, spec.layer_id, numerics, backend, spec.decode))

    shard_diffs = world.gather_floats(calc_diff(partial, reference_partial) if reference_partial is not None else 0.0)
    out = combine_attention(world.all_reduce(partial))
    if world.rank != 0:
        return []

    full = Attention(cfg, spec.layer_id, weights, numerics)
    ref = _attention_steps(full, AttentionCache.empty(cfg, spec.layer_id, len(spec.lengths), world.device), inp,
                           spec.decode)
    detail = f"{cfg.name}: {cfg.n_heads} heads, {cfg.o_groups} groups, {local_cfg.n_heads} heads per rank"
    if backend == "reference":
        checks = [_output_check("reduced vs unsharded reference", SHARDED_BF16_PARTIALS, out, ref, detail)]
        if world.size == 1:
            checks.append(_bitwise("W = 1 equals the unsharded layer", out, ref))
        return checks
    worst = _worst_rank(shard_diffs)
    return [
        Check("per shard vs reference shard", ATTENTION_LAYER_SIMULATED, shard_diffs[worst],
              f"worst of {world.size} ranks: rank {worst}"),
        _output_check("reduced vs unsharded reference", sharded_bound(ATTENTION_LAYER_SIMULATED,
                                                                      SHARDED_BF16_PARTIALS), out, ref, detail),
    ]


RUNNERS: dict[str, Callable[[ShardedSpec, str, World], list[Check]]] = {
    "moe_ep": run_moe_ep,
    "moe_ep_dispatch": run_moe_ep_dispatch,
    "attention_tp": run_attention_tp,
}


def tasks(world: World, configs: list[str], ops: list[str] | None, backends: list[str] | None) -> list[Task]:
    """One task per (case, backend); the same list, in the same order, on every rank."""
    out = []
    for config in configs:
        for spec in specs(config):
            if ops and spec.op not in ops:
                continue
            for backend in BACKENDS:
                if backends is None or backend in backends:
                    out.append(Task(SUITE, spec.op, spec.config, spec.label(world.size), spec.fmt, spec.seed, backend,
                                    functools.partial(RUNNERS[spec.op], spec, backend, world)))
    return out


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsv4-parity --distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--distributed", action="store_true", help="this mode (the flag that selects it)")
    p.add_argument("--config", type=_csv, default=None,
                   help="comma-separated configs (TINY, FLASH, PRO); default TINY on a CPU, FLASH on GPUs")
    p.add_argument("--ops", type=_csv, default=None, help=f"only these, of {', '.join(OPS)}")
    p.add_argument("--backends", type=_csv, default=None, help=f"only these, of {', '.join(BACKENDS)}")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report folder (default {DEFAULT_OUT})")
    p.add_argument("--json", type=Path, default=None, help="JSON report path (default OUT/sharded-wW.json)")
    p.add_argument("--junit", type=Path, default=None, help="JUnit XML path (default OUT/sharded-wW.xml)")
    p.add_argument("--list", action="store_true", help="list the tasks, run nothing")
    args = p.parse_args(argv)
    for name, known in (("ops", OPS), ("backends", BACKENDS)):
        bad = sorted(set(getattr(args, name) or ()) - set(known))
        if bad:
            p.error(f"--{name}: unknown {bad}; expected of {list(known)}")
    if args.config:
        from reference.config import CONFIGS

        args.config = [c.upper() for c in args.config]
        bad = sorted(set(args.config) - set(CONFIGS))
        if bad:
            p.error(f"--config: unknown {bad}; expected of {sorted(CONFIGS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the sharded cases on this rank; rank 0 reports. Returns the exit code (the same on every rank)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = init_world()
    try:
        console = Console() if sys.stdout.isatty() else Console(width=200)
        configs = args.config or (["TINY"] if world.device.type == "cpu" else ["FLASH"])
        todo = tasks(world, configs, args.ops, args.backends)
        lead = world.rank == 0
        if lead:
            console.print(f"dsv4-parity --distributed: {world.size} rank(s), {dist.get_backend()} on "
                          f"{world.device.type}, configs {','.join(configs)}; "
                          + ", ".join(f"{k}={os.environ[k]}" for k in MULTICAST_OFF))
        if args.list:
            if lead:
                for t in todo:
                    console.print(f"{t.op}[{t.config},{t.shape},{t.fmt},seed={t.seed}] {t.backend}", markup=False)
            return 0
        results: list[Result] = [report.execute(t) for t in todo]
        code = report.exit_code(results)
        if lead:
            header = {**report.make_header(["dsv4-parity", *(sys.argv[1:] if argv is None else argv)]),
                      "world_size": world.size, "process_group": dist.get_backend(), "multicast": MULTICAST_OFF}
            json_path = args.json or args.out / f"sharded-w{world.size}.json"
            junit_path = args.junit or args.out / f"sharded-w{world.size}.xml"
            report.write_json(json_path, results, header)
            report.write_junit(junit_path, results, header)
            report.print_table(results, console, verbose=True)
            console.print(f"reports: {json_path}, {junit_path}")
            console.print("[bold red]FAILED" if code else "[bold green]OK (nothing failed)")
        flag = torch.tensor([code], dtype=torch.int32, device=world.device)
        dist.broadcast(flag, src=0)  # every rank exits with rank 0's verdict
        return int(flag.item())
    finally:
        dist.destroy_process_group()
