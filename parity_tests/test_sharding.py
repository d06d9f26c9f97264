"""Sharded parity (issue #7): what each rank computes sums to the unsharded layer (`reference/sharding.py`),
single-process at TINY for W in {1, 2, 4}, and the torch.distributed runner under torchrun with gloo for
W in {2, 4} (`parity_tests/distributed.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity_tests.distributed import attention_config
from parity_tests.metrics import calc_diff
from parity_tests.tolerances import SHARDED_BF16_PARTIALS, SHARDED_FP32_PARTIALS
from reference.attention import Attention, AttentionWeights, project_q, random_attention_weights
from reference.cache import AttentionCache
from reference.config import TINY
from reference.moe import MoEWeights, moe, random_moe_weights, route, shared_expert
from reference.numerics import OFFICIAL, VLLM_NVIDIA, Numerics
from reference.rope import yarn_frequencies
from reference.sharding import (
    attention_rank_output,
    combine_attention,
    combine_dispatched,
    combine_moe,
    dispatched_expert_outputs,
    fp8_columns,
    fp8_rows,
    local_expert_ids,
    moe_rank_output,
    plan_dispatch,
    shard_attention_weights,
    shard_moe_weights,
    tp_attention_config,
)

REPO = Path(__file__).resolve().parent.parent
WORLDS = (1, 2, 4)
MOE_TOKENS = 24
CSA_LAYER, HCA_LAYER = 1, 2  # TINY's layer kinds: 0 SWA, 1 CSA, 2 HCA, 3 CSA
HASH_LAYER, TOPK_LAYER = 0, TINY.n_hash_layers
PREFILL = (5, 9)  # two sequences of different lengths, then one decode step each


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


# ------------------------------------------------------------------------------------------------
# MoE, expert parallel
# ------------------------------------------------------------------------------------------------


def _moe_case(layer_id: int, expert_format: str) -> tuple[MoEWeights, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer_id)
    weights = random_moe_weights(TINY, layer_id, expert_format=expert_format, generator=g)
    x = torch.randn((MOE_TOKENS, TINY.dim), generator=g).to(torch.bfloat16)
    token_ids = torch.randint(0, TINY.vocab_size, (MOE_TOKENS,), generator=g)
    return weights, x, token_ids


def _sharded_moe(weights: MoEWeights, x: torch.Tensor, token_ids: torch.Tensor, world: int) -> torch.Tensor:
    partials = [moe_rank_output(x, shard_moe_weights(weights, TINY, r, world), token_ids=token_ids, cfg=TINY,
                                numerics=OFFICIAL) for r in range(world)]
    shared = shared_expert(x, weights.shared_w13, weights.shared_w2, swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
    return combine_moe(torch.stack(partials).sum(dim=0), shared)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("layer_id", "expert_format"), [(TOPK_LAYER, "fp8"), (HASH_LAYER, "fp4")],
                         ids=["topk-fp8", "hash-fp4"])
def test_moe_expert_shards_sum_to_the_unsharded_layer(world: int, layer_id: int, expert_format: str) -> None:
    weights, x, token_ids = _moe_case(layer_id, expert_format)
    ref = moe(x, weights, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
    out = _sharded_moe(weights, x, token_ids, world)
    if world == 1:
        assert torch.equal(_bits(out), _bits(ref))
    assert SHARDED_FP32_PARTIALS.passes(calc_diff(out, ref))


def test_moe_bf16_rounded_partials_fail_the_fp32_partial_bound() -> None:
    """The bound tells official fp32 partials from bf16-rounded ones (a change of reduction numerics)."""
    weights, x, token_ids = _moe_case(TOPK_LAYER, "fp8")
    ref = moe(x, weights, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
    partials = [moe_rank_output(x, shard_moe_weights(weights, TINY, r, 2), token_ids=token_ids, cfg=TINY,
                                numerics=OFFICIAL) for r in range(2)]
    shared = shared_expert(x, weights.shared_w13, weights.shared_w2, swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
    rounded = combine_moe(sum(p.to(torch.bfloat16).float() for p in partials), shared)
    assert not SHARDED_FP32_PARTIALS.passes(calc_diff(rounded, ref))
    assert SHARDED_BF16_PARTIALS.passes(calc_diff(rounded, ref))


@pytest.mark.parametrize("world", (2, 4))
def test_moe_missing_rank_fails_the_bound(world: int) -> None:
    weights, x, token_ids = _moe_case(TOPK_LAYER, "fp8")
    ref = moe(x, weights, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
    partials = [moe_rank_output(x, shard_moe_weights(weights, TINY, r, world), token_ids=token_ids, cfg=TINY,
                                numerics=OFFICIAL) for r in range(1, world)]
    shared = shared_expert(x, weights.shared_w13, weights.shared_w2, swiglu_limit=TINY.swiglu_limit, numerics=OFFICIAL)
    assert not SHARDED_BF16_PARTIALS.passes(calc_diff(combine_moe(sum(partials), shared), ref))


@pytest.mark.parametrize("world", WORLDS)
def test_every_routed_slot_is_owned_by_exactly_one_rank(world: int) -> None:
    weights, x, _ = _moe_case(TOPK_LAYER, "fp8")
    ids, _ = route(x, weights.gate, weights.bias, token_ids=None, tid2eid=None, cfg=TINY)
    owners = torch.zeros_like(ids)
    for r in range(world):
        shard = shard_moe_weights(weights, TINY, r, world)
        local = local_expert_ids(ids, shard.expert_start, shard.expert_stop)
        assert shard.w13.shape[0] == shard.expert_stop - shard.expert_start == TINY.n_routed_experts // world
        owned = local >= 0
        assert torch.equal(local[owned] + shard.expert_start, ids[owned])
        owners += owned.int()
    assert torch.equal(owners, torch.ones_like(ids))


def test_moe_sharding_rejects_bad_worlds() -> None:
    weights, _, _ = _moe_case(TOPK_LAYER, "fp8")
    with pytest.raises(ValueError, match="world: 3 ranks must divide the 16 routed experts"):
        shard_moe_weights(weights, TINY, 0, 3)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world = 2, got 2"):
        shard_moe_weights(weights, TINY, 2, 2)
    with pytest.raises(ValueError, match="world: expected >= 1"):
        shard_moe_weights(weights, TINY, 0, 0)
    with pytest.raises(ValueError, match="hold 16 experts, cfg TINY-E8 has 8"):
        shard_moe_weights(weights, TINY.replace(name="TINY-E8", n_routed_experts=8), 0, 1)


# ------------------------------------------------------------------------------------------------
# Attention, tensor parallel
# ------------------------------------------------------------------------------------------------


def _attention_case(layer_id: int, world: int) -> tuple[AttentionWeights, list[tuple[torch.Tensor, ...]]]:
    """Weights of `attention_config(TINY, world)` and two steps: a prefill of two sequences, one decode step each."""
    cfg = attention_config(TINY, world)
    g = torch.Generator().manual_seed(10 + layer_id)
    weights = random_attention_weights(cfg, layer_id, generator=g)
    lengths = torch.tensor(PREFILL)
    prefill = (torch.randn((sum(PREFILL), cfg.dim), generator=g).to(torch.bfloat16),
               torch.cat([torch.arange(n) for n in PREFILL]),
               torch.tensor([0, PREFILL[0], sum(PREFILL)], dtype=torch.int32))
    decode = (torch.randn((len(PREFILL), cfg.dim), generator=g).to(torch.bfloat16), lengths,
              torch.arange(len(PREFILL) + 1, dtype=torch.int32))
    return weights, [prefill, decode]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("layer_id", "numerics"), [(CSA_LAYER, OFFICIAL), (HCA_LAYER, VLLM_NVIDIA)],
                         ids=["csa-official", "hca-vllm"])
def test_attention_head_shards_sum_to_the_unsharded_layer(world: int, layer_id: int, numerics: Numerics) -> None:
    """Prefill then decode from per-rank caches: the reduced partials equal the unsharded layer (bitwise at W = 1)."""
    cfg = attention_config(TINY, world)
    weights, steps = _attention_case(layer_id, world)
    full, full_cache = Attention(cfg, layer_id, weights, numerics), AttentionCache.empty(cfg, layer_id, 2)
    shards = [shard_attention_weights(weights, cfg, r, world) for r in range(world)]
    caches = [AttentionCache.empty(local_cfg, layer_id, 2) for _, local_cfg in shards]
    for x, positions, cu_seqlens in steps:
        ref = full(x, positions, cu_seqlens, full_cache)
        partials = [attention_rank_output(x, positions, cu_seqlens, local_w, local_cfg, layer_id, numerics, cache=c)
                    for (local_w, local_cfg), c in zip(shards, caches)]
        out = combine_attention(torch.stack(partials).sum(dim=0))
        if world == 1:
            assert torch.equal(_bits(out), _bits(ref))
        assert SHARDED_BF16_PARTIALS.passes(calc_diff(out, ref)), calc_diff(out, ref)


def test_attention_missing_rank_fails_the_bound() -> None:
    weights, [(x, positions, cu_seqlens), _] = _attention_case(CSA_LAYER, 2)
    ref = Attention(TINY, CSA_LAYER, weights, OFFICIAL)(x, positions, cu_seqlens)
    local_w, local_cfg = shard_attention_weights(weights, TINY, 1, 2)
    alone = combine_attention(attention_rank_output(x, positions, cu_seqlens, local_w, local_cfg, CSA_LAYER, OFFICIAL))
    assert not SHARDED_BF16_PARTIALS.passes(calc_diff(alone, ref))


def test_tp_rank_holds_its_heads_and_the_unsharded_kv_cache() -> None:
    """Rank r's queries are the unsharded heads [r*H/W, (r+1)*H/W) bit for bit, and its cache (window ring,
    compressed entries, indexer keys: all replicated) equals the unsharded layer's."""
    world = 2
    weights, [(x, positions, cu_seqlens), _] = _attention_case(CSA_LAYER, world)
    freqs = yarn_frequencies(TINY, TINY.compress_ratio(CSA_LAYER))
    q_full, _ = project_q(x, weights, TINY, positions, freqs, OFFICIAL)
    full_cache = AttentionCache.empty(TINY, CSA_LAYER, 2)
    Attention(TINY, CSA_LAYER, weights, OFFICIAL)(x, positions, cu_seqlens, full_cache)
    heads = TINY.n_heads // world
    for r in range(world):
        local_w, local_cfg = shard_attention_weights(weights, TINY, r, world)
        q, _ = project_q(x, local_w, local_cfg, positions, freqs, OFFICIAL)
        assert torch.equal(_bits(q), _bits(q_full[:, r * heads:(r + 1) * heads]))
        cache = AttentionCache.empty(local_cfg, CSA_LAYER, 2)
        attention_rank_output(x, positions, cu_seqlens, local_w, local_cfg, CSA_LAYER, OFFICIAL, cache=cache)
        for mine, theirs in zip(cache.sequences, full_cache.sequences):
            for name in ("window", "compressed", "indexer_keys"):
                assert torch.equal(_bits(getattr(mine, name)), _bits(getattr(theirs, name))), name


def test_tp_config_keeps_heads_per_group_and_replicates_the_indexer() -> None:
    local = tp_attention_config(TINY, 2)
    assert (local.n_heads, local.o_groups, local.heads_per_group) == (4, 1, TINY.heads_per_group)
    assert (local.index_n_heads, local.dim, local.o_lora_rank) == (TINY.index_n_heads, TINY.dim, TINY.o_lora_rank)
    assert tp_attention_config(TINY, 1) is TINY
    wide = attention_config(TINY, 4)
    assert (wide.o_groups, wide.heads_per_group) == (4, TINY.heads_per_group)


def test_attention_sharding_rejects_worlds_that_split_a_group() -> None:
    weights = random_attention_weights(TINY, 0, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="world: 4 ranks must divide the 2 wo_a groups"):
        shard_attention_weights(weights, TINY, 0, 4)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world = 2, got -1"):
        shard_attention_weights(weights, TINY, -1, 2)


def test_fp8_slices_keep_their_scale_blocks_and_reject_splitting_one() -> None:
    w = random_attention_weights(TINY, 0, generator=torch.Generator().manual_seed(0)).wo_b  # [256, 512]
    rows, cols = fp8_rows(w, 128, 256, "wo_b"), fp8_columns(w, 256, 512, "wo_b")
    assert torch.equal(rows.dequantize(), w.dequantize()[128:256])
    assert torch.equal(cols.dequantize(), w.dequantize()[:, 256:512])
    with pytest.raises(ValueError, match=r"wo_b: a shard boundary at 64\.\.256 would split a 128x128 scale block"):
        fp8_columns(w, 64, 256, "wo_b")


# ------------------------------------------------------------------------------------------------
# The runner under torchrun (gloo, CPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", (2, 4))
def test_torchrun_gloo_sharded_parity_passes(world: int, tmp_path: Path) -> None:
    """`torchrun --nproc-per-node W -m parity_tests --distributed --config TINY` exits 0; every MoE (all-reduce and
    dispatch/combine) and attention case ran and passed for the reference and the Triton backend (interpreter);
    DeepGEMM is reported not run."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "parity_tests", "--distributed", "--config", "TINY", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / f"sharded-w{world}.json").read_text())["results"]
    ran = {(r["op"], r["backend"]) for r in results if r["status"] == "pass"}
    assert ran == {(op, b) for op in ("moe_ep", "moe_ep_dispatch", "attention_tp") for b in ("reference", "triton")}, \
        results
    assert all(r["status"] == "pass" or (r["backend"] == "deepgemm" and r["status"] == "not_run") for r in results)
    assert all(f"W={world}" in r["shape"] for r in results)


def test_distributed_mode_without_torchrun_is_a_world_of_one(capsys: pytest.CaptureFixture[str]) -> None:
    """A world of one, on the process group this machine gets: NCCL on a GPU (not interpreted), gloo on the CPU; the
    default configs follow it (FLASH on a GPU, TINY on the CPU)."""
    from optimized.backends import detect
    from parity_tests.__main__ import main

    gpu = torch.cuda.is_available() and not detect().interpret
    assert main(["--distributed", "--list", "--ops", "moe_ep", "--backends", "reference"]) == 0
    out = capsys.readouterr().out
    assert f"1 rank(s), {'nccl' if gpu else 'gloo'}" in out and "NCCL_NVLS_ENABLE=0" in out
    assert f"configs {'FLASH' if gpu else 'TINY'}" in out
    assert main(["--distributed", "--list", "--config", "TINY", "--ops", "moe_ep", "--backends", "reference"]) == 0
    assert capsys.readouterr().out.count("moe_ep[TINY,W=1,") == 2


def _dispatch_combine(weights: MoEWeights, x: torch.Tensor, token_ids: torch.Tensor, world: int) -> torch.Tensor:
    """EP with dispatch and combine, the two all-to-alls played in one process: rank r holds token chunk r."""
    shards = [shard_moe_weights(weights, TINY, r, world) for r in range(world)]
    xs, ids = x.tensor_split(world), token_ids.tensor_split(world)
    routes = [route(xs[r], weights.gate, weights.bias, token_ids=ids[r], tid2eid=weights.tid2eid, cfg=TINY)
              for r in range(world)]
    plans = [plan_dispatch(topk_ids, TINY.n_routed_experts, world) for topk_ids, _ in routes]

    def sent(src: int, dst: int) -> slice:  # the pairs `src` sends to `dst`: a run of its plan
        counts = plans[src].counts
        return slice(sum(counts[:dst]), sum(counts[:dst + 1]))

    # dispatch: rank d receives from every rank, in rank order, the rows, experts and weights of its pairs
    outputs = []
    for d in range(world):
        parts = [(plans[s].token[sent(s, d)], plans[s].slot[sent(s, d)], s) for s in range(world)]
        rows = torch.cat([xs[s][tok] for tok, _, s in parts])
        experts = torch.cat([plans[s].expert[sent(s, d)] for _, _, s in parts])
        route_weights = torch.cat([routes[s][1][tok, slot] for tok, slot, s in parts])
        y = dispatched_expert_outputs(rows, experts, route_weights, shards[d], cfg=TINY, numerics=OFFICIAL)
        outputs.append(y.split([len(tok) for tok, _, _ in parts]))
    # combine: rank s gets its rows back from every rank, in rank order, i.e. in its plan's send order
    out = []
    for s in range(world):
        shared = shared_expert(xs[s], weights.shared_w13, weights.shared_w2, swiglu_limit=TINY.swiglu_limit,
                               numerics=OFFICIAL)
        y_rows = torch.cat([outputs[d][s] for d in range(world)])
        out.append(combine_dispatched(y_rows, plans[s], routes[s][0], shared))
    return torch.cat(out)


@pytest.mark.parametrize(("layer_id", "expert_format", "world"), [(TOPK_LAYER, "fp8", 4), (HASH_LAYER, "fp4", 2)],
                         ids=["topk-fp8-4", "hash-fp4-2"])
def test_moe_dispatch_combine_equals_the_unsharded_layer_bitwise(layer_id: int, expert_format: str, world: int
                                                                 ) -> None:
    """Tokens split over the ranks, each (token, slot) sent to its expert's owner and back, summed in ascending
    expert id on the token's rank: bitwise the unsharded layer (no partial sums are formed)."""
    weights, x, token_ids = _moe_case(layer_id, expert_format)
    ref = moe(x, weights, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL)
    assert torch.equal(_bits(_dispatch_combine(weights, x, token_ids, world)), _bits(ref))


def test_dispatch_plan_sends_every_slot_to_its_experts_owner_once() -> None:
    weights, x, _ = _moe_case(TOPK_LAYER, "fp8")
    topk_ids, _ = route(x, weights.gate, weights.bias, token_ids=None, tid2eid=None, cfg=TINY)
    plan = plan_dispatch(topk_ids, TINY.n_routed_experts, 4)
    assert sum(plan.counts) == topk_ids.numel()
    assert torch.equal(plan.expert, topk_ids[plan.token, plan.slot].long())
    owners = torch.repeat_interleave(torch.arange(4), torch.tensor(plan.counts))
    assert torch.equal(plan.expert // (TINY.n_routed_experts // 4), owners)
    seen = torch.zeros_like(topk_ids)
    seen[plan.token, plan.slot] += 1
    assert torch.equal(seen, torch.ones_like(topk_ids))
