"""Benchmarks of the attention family (issue #4): sparse attention (bf16 rows and the 584-byte FP8 cache), the
indexer, the compressor, and the whole attention layer, at the first CSA layer of the config.

Token counts: prefill T in {512, 4096, 8192} is one sequence of T tokens (positions 0..T-1); decode T in
{1, 8, 64, 128} is a batch of T sequences, one new token each, at position `DECODE_CONTEXT` (32768): its window
of 128 rows and its (p+1)//4 = 8192 visible compressed entries, of which the indexer keeps `index_topk`.
Candidate sets are laid out by `reference.attention.candidate_indices` with a random top-k of the visible
entries (`reference.indexer.indexer_topk` of random scores), so every backend attends over identical rows.

Work (spec §3):
  * sparse attention: 4*H*512 FLOP per valid (token, slot) (Q K^T and P V; bf16 tensor cores); bytes = q + out
    + indices + every KV row some token needs, once (1024 bytes as bf16, 584 in the FP8 cache): for decode,
    exactly "the cache rows it needs".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.baselines import check_close
from benchmarks.roofline import Work
from benchmarks.suite import DECODE_TOKENS, Env, Family, OpBench, Point, backend_candidates, baseline
from reference.attention import AttentionWeights, candidate_indices
from reference.attention import sparse_attention as reference_sparse_attention
from reference.cache import KV_PACKED_BYTES, pack_kv, unpack_kv
from reference.compressor import random_compressor_weights
from reference.indexer import INDEXER_RATIO, IndexerWeights, indexer_topk
from reference.numerics import VLLM_NVIDIA, Numerics
from reference.rope import yarn_frequencies

BF16, FP32, INT32 = 2, 4, 4
# Context of every decode sequence (issue #4: decode batch 64 with 32768-token contexts); TINY smoke: 512.
DECODE_CONTEXT = 32768
SMOKE_DECODE_CONTEXT = 512
# Tokens per chunk of the torch baseline's gather (bounds its [chunk, K, 512] workspace to ~0.7 GB).
BASELINE_TOKEN_CHUNK = 1024
CHECK_TOKENS = 16


@dataclass
class AttentionContext:
    """One config's CSA layer, built once.

    Attributes:
        layer_id: the first CSA layer of the config.
        weights: its `AttentionWeights` on the device.
        numerics: VLLM_NVIDIA (FP8 wo_a einsum, fp32 indexer logits: the fast path) in the run's FP8 format.
        freqs: [32] fp32 RoPE frequencies of the layer.
    """

    layer_id: int
    weights: AttentionWeights
    numerics: Numerics
    freqs: torch.Tensor


def setup(env: Env) -> AttentionContext:
    cfg = env.cfg
    layer_id = next(i for i in range(cfg.n_layers) if cfg.layer_kind(i) == "csa")
    return AttentionContext(layer_id, _weights(env, layer_id), VLLM_NVIDIA.replace(fp8_format=env.fmt),
                            yarn_frequencies(cfg, cfg.compress_ratio(layer_id)).to(env.device))


def _weights(env: Env, layer_id: int) -> AttentionWeights:
    """`random_attention_weights`'s statistics with the FP8 linears drawn on the device (the reference constructor
    draws the ~300 M FP8 values of a PRO layer on the CPU, which takes longer than the whole GPU run may)."""
    cfg = env.cfg
    h, d, q, g, r = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    cpu = torch.Generator().manual_seed(env.seed + 21)  # the bf16 compressor weights are small: CPU draws

    def norm(n: int, salt: int) -> torch.Tensor:
        return (1 + 0.1 * env.randn(n, salt=salt, dtype=torch.float32)).to(torch.bfloat16)

    indexer = IndexerWeights(
        wq_b=env.fp8_weight(cfg.index_n_heads * cfg.index_head_dim, q, salt=27),
        weights_proj=env.randn(cfg.index_n_heads, cfg.dim, salt=28, std=cfg.dim**-0.5),
        compressor=random_compressor_weights(cfg.dim, INDEXER_RATIO, cfg.index_head_dim, generator=cpu,
                                             device=env.device),
    )
    return AttentionWeights(
        wq_a=env.fp8_weight(q, cfg.dim, salt=21), q_norm=norm(q, 22), wq_b=env.fp8_weight(h * d, q, salt=23),
        wkv=env.fp8_weight(d, cfg.dim, salt=24), kv_norm=norm(d, 25),
        wo_a=env.fp8_weight(g * r, cfg.o_group_dim, salt=26),
        wo_b=env.fp8_weight(cfg.dim, g * r, salt=29), attn_sink=env.randn(h, salt=30, dtype=torch.float32),
        compressor=random_compressor_weights(cfg.dim, cfg.compress_ratio(layer_id), d, generator=cpu,
                                             device=env.device),
        indexer=indexer,
    )


# ------------------------------------------------------------------------------------------------
# Candidate sets
# ------------------------------------------------------------------------------------------------


@dataclass
class Candidates:
    """The inputs of sparse attention at one point.

    Attributes:
        q: [T, H, 512] bf16; kv: [N, 512] bf16 pool; indices: [T, K] int32 (-1 = empty);
        label: the shape label; decode: one token per sequence at position `context`.
    """

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    label: str
    decode: bool


def decode_context(env: Env) -> int:
    return SMOKE_DECODE_CONTEXT if env.smoke else DECODE_CONTEXT


def candidates(env: Env, tokens: int) -> Candidates:
    """Decode (`tokens` in DECODE_TOKENS): `tokens` sequences at position `decode_context`; prefill: one sequence
    of `tokens` tokens."""
    cfg = env.cfg
    win, topk = cfg.window_size, cfg.index_topk
    decode = tokens in DECODE_TOKENS
    if decode:
        p = decode_context(env)
        batch, positions = tokens, torch.full((tokens,), p, dtype=torch.int64, device=env.device)
        cu_seqlens = torch.arange(tokens + 1, dtype=torch.int32, device=env.device)
        n_entries = (p + 1) // INDEXER_RATIO
        window_rows = [env.randn(win, cfg.head_dim, salt=500 + b) for b in range(batch)]
        window_first = [p - win + 1] * batch
        compressed = [env.randn(n_entries, cfg.head_dim, salt=600 + b) for b in range(batch)]
        label = f"batch={tokens},context={p},H={cfg.n_heads},topk={topk}"
    else:
        positions = torch.arange(tokens, dtype=torch.int64, device=env.device)
        cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=env.device)
        n_entries = tokens // INDEXER_RATIO
        window_rows, window_first = [env.randn(tokens, cfg.head_dim, salt=500)], [0]
        compressed = [env.randn(n_entries, cfg.head_dim, salt=600)]
        label = f"T={tokens},H={cfg.n_heads},topk={topk}"
    scores = env.randn(tokens, max(n_entries, 1), salt=700 + tokens, dtype=torch.float32)
    selection = indexer_topk(scores, (positions + 1) // INDEXER_RATIO, topk)
    kv, indices = candidate_indices(window_rows, window_first, compressed, selection, positions, cu_seqlens, win)
    q = env.randn(tokens, cfg.n_heads, cfg.head_dim, salt=800 + tokens)
    return Candidates(q, kv, indices, label, decode)


def sparse_work(c: Candidates, row_bytes: int) -> Work:
    t, h, d = c.q.shape
    valid = c.indices >= 0
    rows = int(torch.unique(c.indices[valid]).numel())
    bytes_ = 2 * t * h * d * BF16 + c.indices.numel() * INT32 + h * FP32 + rows * row_bytes
    return Work(4.0 * h * d * int(valid.sum()), bytes_, "bf16")


# ------------------------------------------------------------------------------------------------
# Points
# ------------------------------------------------------------------------------------------------


def sparse_attention_point(ctx: AttentionContext, env: Env, tokens: int) -> Point:
    import optimized

    c = candidates(env, tokens)
    sink, scale = ctx.weights.attn_sink, env.cfg.head_dim**-0.5

    def call(backend: str):
        return lambda: optimized.sparse_attention(c.q, c.kv, c.indices, sink, scale, backend=backend)

    cands = backend_candidates("sparse_attention", call)
    cands.append(baseline("torch bf16 gather + matmul", lambda: _checked_torch_sparse(c, sink, scale, packed=None)))
    return Point("sparse_attention", env.cfg.name, tokens, c.label, sparse_work(c, c.kv.shape[1] * BF16), cands,
                 note="bf16 KV rows; decode: batch of sequences at a 32768-token context")


def sparse_attention_fp8_point(ctx: AttentionContext, env: Env, tokens: int) -> Point:
    import optimized

    c = candidates(env, tokens)
    packed = pack_kv(c.kv, env.fmt)
    c.kv = unpack_kv(packed, env.fmt)  # the rows the cache holds (exact), for the baseline's check
    sink, scale = ctx.weights.attn_sink, env.cfg.head_dim**-0.5

    def call(backend: str):
        return lambda: optimized.sparse_attention(c.q, packed, c.indices, sink, scale, backend=backend)

    cands = backend_candidates("sparse_attention", call)
    cands.append(baseline("torch: unpack FP8 rows + bf16 gather + matmul",
                          lambda: _checked_torch_sparse(c, sink, scale, packed=(packed, env.fmt))))
    return Point("sparse_attention_fp8", env.cfg.name, tokens, c.label, sparse_work(c, KV_PACKED_BYTES), cands,
                 note="KV rows read from the 584-byte FP8 cache layout")


# ------------------------------------------------------------------------------------------------
# Baselines
# ------------------------------------------------------------------------------------------------


def _torch_sparse(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float,
                  packed: tuple[torch.Tensor, str] | None):
    """Sparse attention in plain torch: gather each token's rows (dequantizing FP8 cache rows when `packed`), bf16
    matmuls, fp32 softmax with the sink, in token chunks."""

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        for s in range(0, q.shape[0], BASELINE_TOKEN_CHUNK):
            idx = indices[s:s + BASELINE_TOKEN_CHUNK]
            valid = idx >= 0
            flat = idx.clamp(min=0).reshape(-1)
            rows = (unpack_kv(packed[0][flat], packed[1]) if packed is not None else kv[flat]).view(*idx.shape, -1)
            logits = torch.matmul(q[s:s + BASELINE_TOKEN_CHUNK], rows.transpose(1, 2)).float() * scale
            logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
            row_max = torch.maximum(logits.amax(dim=-1), sink[None, :])
            weight = torch.exp(logits - row_max[..., None])
            denominator = weight.sum(dim=-1) + torch.exp(sink[None, :] - row_max)
            out[s:s + BASELINE_TOKEN_CHUNK] = (torch.matmul(weight.to(torch.bfloat16), rows).float()
                                               / denominator[..., None]).to(torch.bfloat16)
        return out

    return run


def _checked_torch_sparse(c: Candidates, sink: torch.Tensor, scale: float, packed: tuple[torch.Tensor, str] | None):
    n = min(CHECK_TOKENS, c.q.shape[0])
    got = _torch_sparse(c.q[:n], c.kv, c.indices[:n], sink, scale, packed)()
    check_close("torch sparse attention", got, reference_sparse_attention(c.q[:n], c.kv, c.indices[:n], sink, scale))
    return _torch_sparse(c.q, c.kv, c.indices, sink, scale, packed)


FAMILY = Family(
    name="attention",
    setup=setup,
    ops=(
        OpBench("sparse_attention", "sparse attention with sink over window + top-k compressed rows (bf16 KV)",
                sparse_attention_point),
        OpBench("sparse_attention_fp8", "sparse attention reading the 584-byte FP8 KV cache (decode)",
                sparse_attention_fp8_point, tokens=DECODE_TOKENS),
    ),
)
