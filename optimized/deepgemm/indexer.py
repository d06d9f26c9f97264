"""Indexer logits on DeepGEMM's FP8 MQA-logits kernels (SM90), as vLLM runs DSv4's indexer on NVIDIA (spec §3.8).

Numerics (vLLM's SM90 path, not the official bf16 one): every index query head is quantized to FP8 with one
UE8M0 scale over its 128 dims and that scale is folded into the head weight (`relu(s q.k) = s relu(q.k)` for
`s > 0`); every key row is quantized to FP8 with one fp32 power-of-two scale. DeepGEMM then computes
`I[t, j] = sum_h w'[t, h] * relu(q_fp8[t, h] . k_fp8[j] * s_k[j])` in fp32. The inputs are the bf16 index
queries and keys of the reference's numerics (Hadamard / FP4 simulation already applied or not), so the
result approximates the reference's fp32 scores (`Numerics.indexer_scores_bf16 = False`) with the error of one
extra FP8 quantization of q and k: compared under the end_to_end FP8 bound, and top-k sets with the near-tie
allowance.

- Prefill and chunks: `fp8_fp4_mqa_logits(q, (k, s_k), w', ks, ke, max_seqlen_k)` over the flat pool of every
  sequence's keys; token t scores pool rows `ks[t] .. ke[t]` and DeepGEMM writes them relative to `ks[t]`.
- Decode (every sequence has the same 1 or 2 new tokens): `fp8_fp4_paged_mqa_logits` over a paged cache of
  64-key blocks, each `[64 x 128 FP8 | 64 fp32 scales]` (DeepGEMM's fused SM90 layout), built here from
  the sequences' keys.
DeepGEMM's SM90 kernels need 32 or 64 index heads and head dim 32, 64 or 128 (FLASH and PRO: 64 x 128).
"""

from __future__ import annotations

import torch

from optimized.backends import detect
from optimized.deepgemm import deep_gemm
from optimized.triton.quant import quantize_per_token

PAGE_KV = 64  # DeepGEMM's SM90 paged MQA logits take 64-key blocks
SUPPORTED_HEADS = (32, 64)
SUPPORTED_HEAD_DIMS = (32, 64, 128)
# decode = every sequence brings this many tokens at most (DeepGEMM's SM90 paged kernel takes next_n 1 or 2)
MAX_PAGED_NEXT_N = 2


def check_supported(n_heads: int, head_dim: int) -> None:
    """Raise a ValueError unless DeepGEMM's SM90 FP8 MQA logits can run these shapes on this GPU."""
    hw = detect()
    if hw.arch != "sm90":
        raise ValueError(f"backend: DeepGEMM's FP8 indexer logits are the SM90 kernels (SM100 takes MXFP4/MXFP8 "
                         f"operands with packed scales, not implemented here); this GPU is {hw.arch}")
    if n_heads not in SUPPORTED_HEADS or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q_idx: DeepGEMM's SM90 MQA logits need {SUPPORTED_HEADS} heads of {SUPPORTED_HEAD_DIMS} "
                         f"dims, got {n_heads} x {head_dim}")


def _quantize_queries(q_idx: torch.Tensor, head_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] bf16 -> (FP8 [T, H, D], weights with the per-(token, head) scale folded in, fp32 [T, H]).

    The weights' rows are padded to 16 bytes (DeepGEMM loads them with TMA); the returned tensor is the
    unpadded view.
    """
    n_tokens, n_heads, head_dim = q_idx.shape
    q_fp8, scale = quantize_per_token(q_idx.reshape(-1, head_dim), head_dim, "e4m3fn")
    padded = -(-n_heads // 4) * 4
    weights = torch.zeros((n_tokens, padded), dtype=torch.float32, device=q_idx.device)[:, :n_heads]
    weights.copy_(head_weights * scale.view(n_tokens, n_heads))
    return q_fp8.view(n_tokens, n_heads, head_dim), weights


def _quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [N, D] bf16 -> (FP8 [N, D], fp32 power-of-two scale [N])."""
    k_fp8, scale = quantize_per_token(keys, keys.shape[1], "e4m3fn")
    return k_fp8, scale.reshape(-1).contiguous()


def mqa_logits(
    q_idx: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, k_start: torch.Tensor,
    k_end: torch.Tensor, max_len: int,
) -> torch.Tensor:
    """Logits of each token over its range of a flat key pool (`fp8_fp4_mqa_logits`).

    Args:
        q_idx: [T, H, D] bf16; keys: [N, D] bf16; head_weights: [T, H] fp32.
        k_start, k_end: [T] int32 — token t scores pool rows k_start[t] .. k_end[t] - 1.
        max_len: at least max(k_end - k_start).

    Returns:
        [T, max_len] fp32 relative to k_start (columns past a token's range are not written).
    """
    check_supported(q_idx.shape[1], q_idx.shape[2])
    if q_idx.shape[0] == 0 or max_len == 0 or keys.shape[0] == 0:
        return torch.empty((q_idx.shape[0], max_len), dtype=torch.float32, device=q_idx.device)
    q_fp8, weights = _quantize_queries(q_idx, head_weights)
    k_fp8, k_scale = _quantize_keys(keys)
    return deep_gemm().fp8_fp4_mqa_logits((q_fp8, None), (k_fp8, k_scale), weights, k_start.int().contiguous(),
                                          k_end.int().contiguous(), max_len)


def paged_key_cache(keys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences' keys -> DeepGEMM's fused SM90 paged FP8 cache and its block table.

    Args:
        keys: per sequence, [n_b, D] bf16.

    Returns:
        cache: [num_blocks, 64, 1, D + 4] uint8 — per block the 64 keys' FP8 bytes, then their 64 fp32 scales.
        block_table: [B, max_blocks] int32 — sequence b's keys are blocks block_table[b, :ceil(n_b / 64)].
    """
    head_dim = keys[0].shape[1]
    device = keys[0].device
    blocks = [-(-k.shape[0] // PAGE_KV) for k in keys]
    n_blocks = max(sum(blocks), 1)
    values = torch.zeros((n_blocks * PAGE_KV, head_dim), dtype=torch.float8_e4m3fn, device=device)
    scales = torch.ones(n_blocks * PAGE_KV, dtype=torch.float32, device=device)
    table = torch.zeros((len(keys), max(max(blocks, default=0), 1)), dtype=torch.int32, device=device)
    first = 0
    for b, (k, nb) in enumerate(zip(keys, blocks)):
        if nb:
            k_fp8, k_scale = _quantize_keys(k)
            rows = slice(first * PAGE_KV, first * PAGE_KV + k.shape[0])
            values[rows], scales[rows] = k_fp8, k_scale
            table[b, :nb] = torch.arange(first, first + nb, dtype=torch.int32, device=device)
        first += nb
    fused = torch.cat((values.view(torch.uint8).view(n_blocks, PAGE_KV * head_dim),
                       scales.view(torch.uint8).view(n_blocks, PAGE_KV * 4)), dim=1)
    return fused.view(n_blocks, PAGE_KV, 1, head_dim + 4), table


def paged_mqa_logits(
    q_idx: torch.Tensor, keys: list[torch.Tensor], head_weights: torch.Tensor, context_lens: torch.Tensor,
    max_visible: int,
) -> torch.Tensor:
    """Decode logits (`fp8_fp4_paged_mqa_logits`): B sequences with next_n new tokens each.

    Args:
        q_idx: [B * next_n, H, D] bf16, sequence-major.
        keys: per sequence, [n_b, D] bf16.
        head_weights: [B * next_n, H] fp32.
        context_lens: [B, next_n] int32 — visible keys of each token (<= n_b).
        max_visible: the largest of `context_lens`, known on the host (0: no token sees a key, nothing to score);
            passed in so that the call never reads the device (CUDA-graph capture).

    Returns:
        [B * next_n, max_len] fp32 (columns past a token's context length are not meaningful).
    """
    n_seqs, next_n = context_lens.shape
    _, n_heads, head_dim = q_idx.shape
    check_supported(n_heads, head_dim)
    dg = deep_gemm()
    cache, table = paged_key_cache(keys)
    max_len = table.shape[1] * PAGE_KV
    if max_visible == 0:
        return torch.empty((q_idx.shape[0], max_len), dtype=torch.float32, device=q_idx.device)
    q_fp8, weights = _quantize_queries(q_idx, head_weights)
    lens = context_lens.int().contiguous()
    schedule = dg.get_paged_mqa_logits_metadata(lens, PAGE_KV, dg.get_num_sms())
    return dg.fp8_fp4_paged_mqa_logits((q_fp8.view(n_seqs, next_n, n_heads, head_dim), None), cache, weights,
                                       lens, table, schedule, max_len)


def indexer_scores(
    q_idx: torch.Tensor, k_idx: torch.Tensor, head_weights: torch.Tensor, numerics: object
) -> torch.Tensor:
    """`[T, N]` FP8 scores of every token against every key (the reference's `indexer_scores` shape)."""
    del numerics  # validated by optimized.attention: DeepGEMM's logits are fp32 (indexer_scores_bf16 False)
    n_tokens, n = q_idx.shape[0], k_idx.shape[0]
    zeros = torch.zeros(n_tokens, dtype=torch.int32, device=q_idx.device)
    return mqa_logits(q_idx, k_idx, head_weights, zeros, zeros + n, n)
