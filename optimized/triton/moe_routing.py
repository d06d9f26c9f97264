"""Triton kernels of the MoE router (spec §5.1): fp32 logits, sqrtsoftplus, top-k selection, weights.

Two kernels:
  * `_router_logits_kernel` — `l = x W_gate^T` with fp32 accumulation. x and W_gate are bf16, so every
    product is exact in fp32 (8 + 8 significant bits) and a bf16 x bf16 -> fp32 `tl.dot` computes the
    official "upcast both to fp32, then matmul" up to the fp32 summation order. The hidden dim is split
    over programs (`n_split` partial sums, added in a fixed order by the next kernel: deterministic, no
    atomics), and for few tokens (decode) so are the experts, so the gate weight streams over many SMs.
  * `_router_topk_kernel` — per token: `s = sqrt(softplus(l))`, select the top-k of `s + bias` (ties ->
    lower expert id, as `reference.moe.route`), or take `tid2eid[token_id]` on hash layers; weights are
    the selected *unbiased* scores over their sum, times `route_scale`.

Invalid inputs that cannot be checked without a device sync (a token id outside the vocabulary, a
`tid2eid` entry outside [0, E)) give the id -1 and a NaN weight, so the MoE output of that token is NaN
instead of a silent out-of-bounds access.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.backends import detect
from optimized.triton._fp8 import prepare_interpreter
from optimized.triton._pdl import pdl_launch, pdl_wait
from optimized.triton.aot import PLATFORM_TARGETS, AotSpec, by_token_count, tile_platform

# Logits GEMM tiles. The hidden-dim split and the K steps are the same at every token count, so that a token's
# logits do not depend on the batch it is in (batch invariance, `parity_tests.invariance`: the H200 run of
# 2026-12-02 caught an earlier token-count-dependent split changing routing weights by an ulp): 16 tokens per
# program (the smallest `tl.dot` M), and the hidden dim split into LOGITS_SPLITS slices whose fp32 partial sums the
# top-k kernel adds in order. The experts per program do not change a logit (each output element is its own dot
# over the same K steps), so they follow the token count: up to DECODE_TOKENS tokens, 16 experts per program
# stream the gate weight (E x D bf16, 2-5.5 MB) with E/16 x 8 programs (FLASH: 128, one wave; `route` at T = 1 took
# 16.0 us with 128 experts per program, 16 programs, and 13.6 us so, in the H200 benchmarks of 2026-12-03, and the
# GPU test and batch-invariance suite found the logits unchanged across the switch); at prefill 128 experts per
# program read each token tile only E/128 times. The [8, T, E] fp32 partials (64 MB at T=8192 on FLASH) cost tens
# of microseconds next to a MoE step of milliseconds.
LOGITS_BLOCK_T = 16
LOGITS_SPLITS = 8
LOGITS_BLOCK_E = 128
DECODE_BLOCK_E = 16
DECODE_TOKENS = 64
LOGITS_BLOCK_D = 128  # the hidden-dim split's granularity
# K of one dot step where it divides a split's hidden dims (FLASH: 512 / 256; PRO's 896 keeps 128). Every step adds
# its dot into the same fp32 accumulator in k order, so the logits are the same bits as with 128-wide steps (H200,
# FLASH, T = 1, 8, 64, 100, and a token alone against the same token at T = 100: bitwise equal); router logits 7.7 ->
# 7.0 us at T = 1 and 9.6 -> 8.9 us at T = 100 (docs/h200/ab-router-logits-block-d.json; 512-wide steps were slower
# from T = 100 on). NVIDIA only: on gfx942 the 128-expert prefill tile's two stages of 256-wide steps take 72 KB of
# LDS, over its 64 KB (the AOT check), so AMD keeps 128-wide steps (not measured: no ROCm GPU here).
LOGITS_STEP_D = 256
LOGITS_WARPS, LOGITS_STAGES = 4, 2
# Tokens per top-k program (each holds a [BLOCK_T, next_pow2(E)] fp32 tile).
TOPK_BLOCK_T = 4
TOPK_WARPS = 4
# Decode (at most DECODE_TOKENS tokens): one token per top-k program, one warp (its reductions stay inside the warp):
# H200, FLASH routed MoE, same-run A/B, outputs bitwise equal: T = 1 70.8 -> 69.8 us, T = 8 309.1 -> 307.8 us,
# T = 64 unchanged (docs/h200/ab-moe-glue-launch.json).
DECODE_TOPK_BLOCK_T = 1
DECODE_TOPK_WARPS = 1
# On the CPU interpreter a program costs the same numpy calls whatever its size: few, large programs.
INTERPRET_BLOCK_T = 64
# Below this logit, softplus(l) = log1p(e^l) equals e^l to fp32 precision, and the score is computed as
# e^(l/2), which stays a normal fp32 number down to l ~ -174 (`reference.moe.SOFTPLUS_TAIL`, same switch).
SOFTPLUS_TAIL = tl.constexpr(-20.0)


@triton.jit
def _sqrt_softplus(logit):
    """`sqrt(softplus(l))` in fp32 for every logit (`reference.moe.sqrt_softplus`): `e^(l/2)` below -20,
    else `sqrt(max(l, 0) + log1p(e^-|l|))`.

    log1p(e) for e in (0, 1] is `e * log(1 + e) / ((1 + e) - 1)` (Goldberg): accurate to a few ulp where
    `log(1 + e)` alone would round `1 + e` to 1 and return 0. Above l = 20 the log1p term is below half an
    ulp of l, so the score is sqrt(l), as torch's softplus threshold gives.
    """
    e = tl.exp(-tl.abs(logit))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * tl.div_rn(e, u - 1.0))
    score = tl.sqrt_rn(tl.maximum(logit, 0.0) + log1p)
    return tl.where(logit < SOFTPLUS_TAIL, tl.exp(0.5 * tl.minimum(logit, SOFTPLUS_TAIL)), score)


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr,
    n_tokens, n_experts,
    stride_xt, stride_we, stride_os, stride_ot,
    D_PER_SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[split, t, e] = sum over the split's hidden dims of x[t, d] * w[e, d] (fp32)."""
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < n_tokens
    e_ok = offs_e < n_experts
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt
    w_cols = w_ptr + offs_e.to(tl.int64)[None, :] * stride_we
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    d_start = pid_s * D_PER_SPLIT
    for step in range(0, D_PER_SPLIT, BLOCK_D):
        d0 = d_start + step
        # load tile, accumulate (bf16 products are exact in fp32)
        x = tl.load(x_rows + (d0 + offs_d)[None, :], mask=t_ok[:, None], other=0.0)
        w = tl.load(w_cols + (d0 + offs_d)[:, None], mask=e_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
    out = out_ptr + pid_s * stride_os + offs_t[:, None] * stride_ot + offs_e[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _router_topk_kernel(
    logits_ptr, bias_ptr, token_ids_ptr, tid2eid_ptr, ids_ptr, weights_ptr,
    n_tokens, n_experts, vocab_size, route_scale,
    stride_ls, stride_lt, stride_hash,
    N_SPLIT: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASH: tl.constexpr, PDL: tl.constexpr = False,
):
    """ids[t, j], weights[t, j] for j < TOPK (spec §5.1)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_PAD)
    t_ok = offs_t < n_tokens
    e_ok = offs_e < n_experts
    ok = t_ok[:, None] & e_ok[None, :]

    # logits: the split partial sums, added in a fixed order
    ptrs = logits_ptr + offs_t[:, None] * stride_lt + offs_e[None, :]
    logit = tl.load(ptrs, mask=ok, other=0.0)
    for s in tl.static_range(1, N_SPLIT):
        logit += tl.load(ptrs + s * stride_ls, mask=ok, other=0.0)
    score = _sqrt_softplus(logit)

    if HASH:
        token = tl.load(token_ids_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
        token_ok = (token >= 0) & (token < vocab_size)
    else:
        selection = score
        if HAS_BIAS:
            selection += tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0)[None, :]
        # NaN never wins: a NaN token takes the lowest free ids, and its NaN weights keep its output NaN
        selection = tl.where(selection != selection, float("-inf"), selection)
        free = ok

    offs_k = tl.arange(0, K_PAD)
    chosen_id = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    chosen_score = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        if HASH:
            eid = tl.load(tid2eid_ptr + token * stride_hash + j, mask=t_ok & token_ok, other=-1).to(tl.int32)
            eid = tl.where((eid >= 0) & (eid < n_experts), eid, -1)
        else:
            # top-1 of the free experts; ties -> lower expert id
            best = tl.max(tl.where(free, selection, float("-inf")), axis=1)
            candidate = free & (selection == best[:, None])
            eid = tl.min(tl.where(candidate, offs_e[None, :], E_PAD), axis=1)
            free = free & (offs_e[None, :] != eid[:, None])
        hit = offs_e[None, :] == eid[:, None]
        s_j = tl.sum(tl.where(hit, score, 0.0), axis=1)
        s_j = tl.where(eid >= 0, s_j, float("nan"))
        total += s_j  # sum of the selected unbiased scores, in selection order
        chosen_id = tl.where(offs_k[None, :] == j, eid[:, None], chosen_id)
        chosen_score = tl.where(offs_k[None, :] == j, s_j[:, None], chosen_score)

    weight = tl.div_rn(chosen_score, total[:, None]) * route_scale
    out = offs_t[:, None] * TOPK + offs_k[None, :]
    store_ok = t_ok[:, None] & (offs_k[None, :] < TOPK)
    tl.store(ids_ptr + out, chosen_id, mask=store_ok)
    tl.store(weights_ptr + out, weight, mask=store_ok)


def logits_step(d_per_split: int, platform: str = "nvidia") -> int:
    """K of one dot step of the logits kernel for a split of `d_per_split` hidden dims on `platform`."""
    return LOGITS_STEP_D if platform == "nvidia" and d_per_split % LOGITS_STEP_D == 0 else LOGITS_BLOCK_D


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor, n_split: int | None = None) -> torch.Tensor:
    """Partial fp32 router logits.

    Args:
        x: [T, D] bf16, contiguous rows.
        gate_weight: [E, D] bf16, contiguous rows; D a multiple of `LOGITS_BLOCK_D`.
        n_split: hidden-dim slices (a divisor of D / LOGITS_BLOCK_D); None: the largest divisor that is at most
            LOGITS_SPLITS on a GPU (8 on FLASH and PRO), whatever the token count; 1 on the CPU interpreter.

    Returns:
        [n_split, T, E] fp32 partial sums over `D / n_split` hidden dims each (sum them in order).
    """
    prepare_interpreter()
    interpret = detect().interpret
    n_tokens, dim = x.shape
    n_experts = gate_weight.shape[0]
    block_t = INTERPRET_BLOCK_T if interpret else LOGITS_BLOCK_T
    block_e = DECODE_BLOCK_E if n_tokens <= DECODE_TOKENS else LOGITS_BLOCK_E
    t_blocks = triton.cdiv(n_tokens, block_t)
    e_blocks = triton.cdiv(n_experts, block_e)
    d_blocks = dim // LOGITS_BLOCK_D
    if n_split is None:
        n_split = 1 if interpret else max(s for s in range(1, LOGITS_SPLITS + 1) if d_blocks % s == 0)
    elif d_blocks % n_split:
        raise ValueError(f"n_split: {n_split} does not divide the {d_blocks} hidden-dim blocks of {LOGITS_BLOCK_D}")
    out = torch.empty((n_split, n_tokens, n_experts), dtype=torch.float32, device=x.device)
    _router_logits_kernel[(t_blocks, e_blocks, n_split)](
        x, gate_weight, out, n_tokens, n_experts,
        x.stride(0), gate_weight.stride(0), out.stride(0), out.stride(1),
        D_PER_SPLIT=dim // n_split, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_D=logits_step(dim // n_split, tile_platform()),
        num_warps=LOGITS_WARPS, num_stages=LOGITS_STAGES,
        **pdl_launch(),
    )
    return out


def router_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, *, topk: int, route_scale: float,
    token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert selection and weights from (partial) fp32 logits.

    Args:
        logits: [n_split, T, E] fp32 (from `router_logits`; [1, T, E] for plain logits), last dim contiguous.
        bias: [E] fp32 selection bias, or None. Ignored on hash layers (`tid2eid` given).
        topk: experts per token (k).
        route_scale: the weights' final factor.
        token_ids: [T] int32/int64, hash layers only.
        tid2eid: [vocab, k] int32/int64 with contiguous rows, hash layers only.

    Returns:
        ids [T, k] int32 and weights [T, k] fp32.
    """
    prepare_interpreter()
    n_split, n_tokens, n_experts = logits.shape
    ids = torch.empty((n_tokens, topk), dtype=torch.int32, device=logits.device)
    weights = torch.empty((n_tokens, topk), dtype=torch.float32, device=logits.device)
    hashed = tid2eid is not None
    dummy = logits  # never read when the matching constexpr is off
    block_t, warps = by_token_count(n_tokens, DECODE_TOKENS, interpret=(INTERPRET_BLOCK_T, TOPK_WARPS),
                                    decode=(DECODE_TOPK_BLOCK_T, DECODE_TOPK_WARPS), prefill=(TOPK_BLOCK_T, TOPK_WARPS))
    _router_topk_kernel[(triton.cdiv(n_tokens, block_t),)](
        logits, bias if bias is not None else dummy, token_ids if hashed else dummy,
        tid2eid if hashed else dummy, ids, weights,
        n_tokens, n_experts, tid2eid.shape[0] if hashed else 0, float(route_scale),
        logits.stride(0), logits.stride(1), tid2eid.stride(0) if hashed else 0,
        N_SPLIT=n_split, TOPK=topk, K_PAD=triton.next_power_of_2(topk), BLOCK_T=block_t,
        E_PAD=triton.next_power_of_2(n_experts), HAS_BIAS=bias is not None and not hashed, HASH=hashed,
        num_warps=warps, **pdl_launch(),
    )
    return ids, weights


AOT_SPECS = [
    *(
        AotSpec(
            f"router_logits[BLOCK_E={block_e},split={split},{platform}]", _router_logits_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "n_tokens": "i32", "n_experts": "i32",
             "stride_xt": "i32", "stride_we": "i32", "stride_os": "i32", "stride_ot": "i32"},
            {"D_PER_SPLIT": 4096 // split, "BLOCK_T": LOGITS_BLOCK_T, "BLOCK_E": block_e,
             "BLOCK_D": logits_step(4096 // split, platform)},
            num_warps=LOGITS_WARPS, num_stages=LOGITS_STAGES,
            aligned=("x_ptr", "w_ptr", "out_ptr", "stride_xt", "stride_we", "stride_os", "stride_ot"), targets=targets,
        )
        for block_e, split in ((DECODE_BLOCK_E, LOGITS_SPLITS), (LOGITS_BLOCK_E, LOGITS_SPLITS), (LOGITS_BLOCK_E, 1))
        for platform, targets in PLATFORM_TARGETS.items()
    ),
    *(
        AotSpec(
            f"router_topk[E={n_experts},hash={hashed},block_t={block_t}]", _router_topk_kernel,
            {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "token_ids_ptr": "*i64", "tid2eid_ptr": "*i64",
             "ids_ptr": "*i32", "weights_ptr": "*fp32", "n_tokens": "i32", "n_experts": "i32",
             "vocab_size": "i32", "route_scale": "fp32", "stride_ls": "i32", "stride_lt": "i32",
             "stride_hash": "i32"},
            {"N_SPLIT": 1, "TOPK": 6, "K_PAD": 8, "BLOCK_T": block_t, "E_PAD": triton.next_power_of_2(n_experts),
             "HAS_BIAS": not hashed, "HASH": hashed}, num_warps=warps,
            aligned=("logits_ptr", "bias_ptr", "token_ids_ptr", "tid2eid_ptr", "ids_ptr", "weights_ptr", "stride_ls",
                     "stride_lt"),
        )
        for n_experts in (256, 384) for hashed in (False, True)
        for block_t, warps in ((DECODE_TOPK_BLOCK_T, DECODE_TOPK_WARPS), (TOPK_BLOCK_T, TOPK_WARPS))
    ),
]
