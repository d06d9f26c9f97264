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
  * indexer_scores: 2*Hi*128 FLOP per (token, key) of the [T, N] score matrix the op returns (decode: N = the
    8192 keys of a 32768-token context, prefill: N = T/4); bytes = q + keys + head weights + scores (fp32).
  * indexer_topk: no matmul; bytes = scores + n_visible + the selection.
  * compress (the main ratio-4 compressor, prefill form over T tokens): the two projections, 2*T*D*(2*2*512)
    FLOP (bf16 GEMM, fp32 out); bytes = x + Wkv + Wgate (bf16) + ape + the T/4 entries.
  * attention (the layer): the sum over its pieces for the token positions of the point — FP8 linears (wq_a,
    wq_b, wkv, indexer wq_b, wo_a einsum, wo_b) on the FP8 ceiling; compressor and indexer projections, index
    scores over each token's visible keys, and sparse attention over its window + top-k on the bf16 ceiling;
    bytes = the weights + x + out + the KV rows and index keys the tokens read (cache rows at 584 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.baselines import check_close, deep_gemm
from benchmarks.roofline import Work
from benchmarks.suite import (
    DECODE_TOKENS,
    SMOKE_DECODE_TOKENS,
    Env,
    Family,
    OpBench,
    Point,
    backend_candidates,
    baseline,
)
from reference.attention import AttentionWeights, candidate_indices
from reference.attention import sparse_attention as reference_sparse_attention
from reference.cache import KV_PACKED_BYTES, pack_kv, unpack_kv
from reference.compressor import random_compressor_weights
from reference.formats import quantize_per_token
from reference.indexer import INDEXER_RATIO, IndexerWeights, indexer_topk
from reference.indexer import indexer_scores as reference_indexer_scores
from reference.numerics import VLLM_NVIDIA, Numerics
from reference.rope import yarn_frequencies
from reference.weights import Fp8Weight

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


# ------------------------------------------------------------------------------------------------
# Indexer and compressor
# ------------------------------------------------------------------------------------------------


def _index_inputs(env: Env, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """q_idx [T, Hi, 128] bf16, keys [N, 128] bf16, head weights [T, Hi] fp32 (decode: N = the keys of a
    32768-token context; prefill: N = T / 4)."""
    cfg = env.cfg
    n = (decode_context(env) + 1) // INDEXER_RATIO if tokens in DECODE_TOKENS else max(tokens // INDEXER_RATIO, 1)
    q = env.randn(tokens, cfg.index_n_heads, cfg.index_head_dim, salt=900 + tokens)
    k = env.randn(n, cfg.index_head_dim, salt=901 + tokens)
    w = env.randn(tokens, cfg.index_n_heads, salt=902 + tokens, dtype=torch.float32,
                  std=(cfg.index_head_dim * cfg.index_n_heads) ** -0.5)
    return q, k, w, f"T={tokens},N={n},Hi={cfg.index_n_heads}"


def indexer_scores_point(ctx: AttentionContext, env: Env, tokens: int) -> Point:
    import optimized

    q, k, w, label = _index_inputs(env, tokens)

    def call(backend: str):
        return lambda: optimized.indexer_scores(q, k, w, ctx.numerics, backend=backend)

    t, hi, d = q.shape
    n = k.shape[0]
    work = Work(2.0 * t * n * hi * d, (q.numel() + k.numel()) * BF16 + w.numel() * FP32 + t * n * FP32, "bf16")
    cands = backend_candidates("indexer_scores", call)
    cands.append(baseline("torch bf16 einsum + relu + weighted sum", lambda: _checked_torch_scores(q, k, w, ctx)))
    cands.append(baseline("DeepGEMM fp8_fp4_mqa_logits (raw, pre-quantized q, k)", lambda: _deepgemm_logits(q, k, w)))
    return Point("indexer_scores", env.cfg.name, tokens, label, work, cands,
                 note="VLLM_NVIDIA numerics (fp32 scores); deepgemm = FP8 q and k")


def indexer_topk_point(ctx: AttentionContext, env: Env, tokens: int) -> Point:
    import optimized

    del ctx
    cfg = env.cfg
    decode = tokens in DECODE_TOKENS
    n = (decode_context(env) + 1) // INDEXER_RATIO if decode else max(tokens // INDEXER_RATIO, 1)
    scores = env.randn(tokens, n, salt=903 + tokens, dtype=torch.float32)
    if decode:
        n_visible = torch.full((tokens,), n, dtype=torch.int32, device=env.device)
    else:
        n_visible = ((torch.arange(tokens, device=env.device) + 1) // INDEXER_RATIO).to(torch.int32)
    topk = cfg.index_topk

    def call(backend: str):
        return lambda: optimized.indexer_topk(scores, n_visible, topk, backend=backend)

    work = Work(0.0, scores.numel() * FP32 + tokens * (INT32 + topk * INT32), "none")
    cands = backend_candidates("indexer_topk", call)
    cands.append(baseline("torch masked topk", lambda: _torch_topk(scores, n_visible, topk)))
    return Point("indexer_topk", cfg.name, tokens, f"T={tokens},N={n},topk={topk}", work, cands)


def compress_point(ctx: AttentionContext, env: Env, tokens: int) -> Point:
    import optimized

    cfg = env.cfg
    w = ctx.weights.compressor
    assert w is not None
    x = env.randn(tokens, cfg.dim, salt=904 + tokens)
    positions = torch.arange(tokens, dtype=torch.int64, device=env.device)

    def call(backend: str):
        return lambda: optimized.compress(x, positions, w, ratio=w.ratio, head_dim=w.head_dim, freqs=ctx.freqs,
                                          numerics=ctx.numerics, rotate="main", norm_eps=cfg.norm_eps,
                                          backend=backend)

    weights = (w.wkv.numel() + w.wgate.numel()) * BF16 + w.ape.numel() * FP32 + w.norm.numel() * BF16
    entries = tokens // w.ratio * w.head_dim * BF16
    work = Work(2.0 * tokens * cfg.dim * (w.wkv.shape[0] + w.wgate.shape[0]), x.numel() * BF16 + weights + entries,
                "bf16", weights)
    return Point("compress", cfg.name, tokens, f"T={tokens},ratio={w.ratio},D={cfg.dim}", work,
                 backend_candidates("compress", call),
                 note="main CSA compressor, prefill form; no baseline: the eager reference is the torch implementation")


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------


def attention_point(ctx: AttentionContext, env: Env, tokens: int) -> Point:
    """Prefill: one fresh prompt of `tokens` tokens (host `cu_seqlens`, value checks off). Decode: `tokens`
    sequences, one new token each, continuing caches filled (with random rows, entries, keys and compressor
    states) up to `decode_context` positions."""
    import optimized
    from optimized.backends import value_checks

    cfg = env.cfg
    decode = tokens in DECODE_TOKENS
    x = env.randn(tokens, cfg.dim, salt=905 + tokens)
    if decode:
        cu_seqlens = torch.arange(tokens + 1, dtype=torch.int32, device=env.device)
        label = f"batch={tokens},context={decode_context(env)}"
    else:
        cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=env.device)
        label = f"T={tokens} (prefill)"

    def call(backend: str):
        layer = optimized.Attention(cfg, ctx.layer_id, ctx.weights, ctx.numerics, backend=backend)
        if not decode:
            # As a serving loop calls a prefill: sequence bounds on the host and inputs validated upstream (the
            # reference checks them anyway). Nothing then reads the device, so the harness times the optimized
            # layers as CUDA-graph replays (the eager time, host-bound, stays in bench.json as `eager_time_s`).
            positions = torch.arange(tokens, dtype=torch.int64, device=env.device)
            host_bounds = cu_seqlens.cpu()

            def prefill() -> torch.Tensor:
                with value_checks(False):
                    return layer(x, positions, host_bounds)

            return prefill
        cache = _filled_cache(ctx, env, tokens, reference=backend == "reference")
        seq0 = cache.sequences[0]

        def step() -> torch.Tensor:  # each call is the next decode step of every sequence
            positions = torch.full((tokens,), seq0.next_position, dtype=torch.int64, device=env.device)
            return layer(x, positions, cu_seqlens, cache)

        return step

    return Point("attention", cfg.name, tokens, label, layer_work(ctx, env, tokens, decode),
                 backend_candidates("attention", call),
                 note=f"CSA layer {ctx.layer_id}, VLLM_NVIDIA numerics; prefill with host cu_seqlens and value checks "
                      f"off; decode continues caches at a {decode_context(env)}-token context")


def _filled_cache(ctx: AttentionContext, env: Env, batch: int, *, reference: bool):
    """A cache of `batch` sequences that have seen `decode_context` tokens: random window rows, compressed entries
    and index keys, compressor states holding a random previous block (the context is a multiple of 4, so no
    block is open). The reference's cache type for the reference layer, `optimized.AttentionCache` (584-byte FP8
    rows) for the others."""
    from optimized.attention import AttentionCache as OptimizedCache
    from reference.cache import AttentionCache as ReferenceCache

    cfg, p = env.cfg, decode_context(env)
    cache = (ReferenceCache.empty(cfg, ctx.layer_id, batch, env.device) if reference
             else OptimizedCache.empty(cfg, ctx.layer_id, batch, env.device, packed=True))
    n_entries = p // cfg.compress_ratio(ctx.layer_id)
    for b, seq in enumerate(cache.sequences):
        window = env.randn(cfg.window_size, cfg.head_dim, salt=1000 + b)
        entries = env.randn(n_entries, cfg.head_dim, salt=2000 + b)
        seq.window = unpack_kv(pack_kv(window, env.fmt), env.fmt) if reference else pack_kv(window, env.fmt)
        seq.compressed = unpack_kv(pack_kv(entries, env.fmt), env.fmt) if reference else pack_kv(entries, env.fmt)
        seq.indexer_keys = env.randn(p // INDEXER_RATIO, cfg.index_head_dim, salt=3000 + b)
        for state in (seq.compressor, seq.indexer_compressor):
            ratio = state.kv.shape[0] // 2  # ratio 4 states hold the previous block, then the open one
            state.kv[:ratio] = env.randn(ratio, state.kv.shape[1], salt=4000 + b, dtype=torch.float32)
            state.score[:ratio] = env.randn(ratio, state.kv.shape[1], salt=5000 + b, dtype=torch.float32)
            state.next_position = p
        seq.next_position = p
    return cache


def _fp8_bytes(w: Fp8Weight) -> float:
    return w.data.numel() + w.scale.numel() * FP32


def layer_work(ctx: AttentionContext, env: Env, tokens: int, decode: bool) -> Work:
    """The CSA layer's work at the point's token positions (module docstring)."""
    cfg, w = env.cfg, ctx.weights
    assert w.compressor is not None and w.indexer is not None
    if decode:
        positions = torch.full((tokens,), decode_context(env), dtype=torch.float64)
    else:
        positions = torch.arange(tokens, dtype=torch.float64)
    visible = torch.floor((positions + 1) / INDEXER_RATIO)
    slots = float((torch.clamp(positions + 1, max=cfg.window_size) + torch.clamp(visible, max=cfg.index_topk)).sum())
    linears = (w.wq_a, w.wq_b, w.wkv, w.indexer.wq_b, w.wo_a, w.wo_b)
    fp8_flops = 2.0 * tokens * sum(lin.data.numel() for lin in linears)
    comp = (w.compressor, w.indexer.compressor)
    bf16_weights = sum((c.wkv.numel() + c.wgate.numel()) * BF16 for c in comp) + w.indexer.weights_proj.numel() * BF16
    bf16_flops = (2.0 * tokens * (sum(c.wkv.numel() + c.wgate.numel() for c in comp) + w.indexer.weights_proj.numel())
                  + 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(visible.sum())
                  + 4.0 * cfg.n_heads * cfg.head_dim * slots)
    weights = sum(_fp8_bytes(lin) for lin in linears) + bf16_weights
    kv_rows = slots * KV_PACKED_BYTES if decode else tokens * (1 + 1 / 4) * KV_PACKED_BYTES
    index_keys = float(visible.sum()) * cfg.index_head_dim * BF16 if decode else tokens / 4 * cfg.index_head_dim * BF16
    activations = 2 * tokens * cfg.dim * BF16
    fp8 = Work(fp8_flops, weights + activations + kv_rows + index_keys, "fp8", weights)
    return fp8 + Work(bf16_flops, 0.0, "bf16")


# ------------------------------------------------------------------------------------------------
# Baselines (indexer)
# ------------------------------------------------------------------------------------------------


def _torch_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor):
    """bf16 einsum, relu, head-weighted sum in fp32, in token chunks (the official code's eager ops)."""

    def run() -> torch.Tensor:
        out = torch.empty((q.shape[0], k.shape[0]), dtype=torch.float32, device=q.device)
        for s in range(0, q.shape[0], BASELINE_TOKEN_CHUNK):
            logits = torch.einsum("thd,nd->thn", q[s:s + BASELINE_TOKEN_CHUNK], k).relu()
            out[s:s + BASELINE_TOKEN_CHUNK] = torch.einsum("thn,th->tn", logits.float(), w[s:s + BASELINE_TOKEN_CHUNK])
        return out

    return run


def _checked_torch_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ctx: AttentionContext):
    n = min(CHECK_TOKENS, q.shape[0])
    check_close("torch indexer scores", _torch_scores(q[:n], k, w[:n])(),
                reference_indexer_scores(q[:n], k, w[:n], ctx.numerics))
    return _torch_scores(q, k, w)


def _deepgemm_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor):
    """`fp8_fp4_mqa_logits` on q and k already in FP8 (one power-of-two scale per query head, folded into the
    weights, and per key row): the kernel the deepgemm backend wraps, without its per-call quantization."""
    dg = deep_gemm()
    t, hi, d = q.shape
    q_fp8, q_scale = quantize_per_token(q.reshape(-1, d), d, "e4m3fn")
    k_fp8, k_scale = quantize_per_token(k, d, "e4m3fn")
    weights = (w * q_scale.view(t, hi)).contiguous()
    k_scale = k_scale.reshape(-1).contiguous()
    zeros = torch.zeros(t, dtype=torch.int32, device=q.device)
    ends = zeros + k.shape[0]

    def run() -> torch.Tensor:
        return dg.fp8_fp4_mqa_logits((q_fp8.view(t, hi, d), None), (k_fp8, k_scale), weights, zeros, ends, k.shape[0])

    n = min(CHECK_TOKENS, t)  # the fp32 oracle of the first tokens ([n, Hi, N] fp32)
    q_deq = q_fp8.float().view(t, hi, d)[:n] * q_scale.view(t, hi, 1)[:n]
    want = torch.einsum("thd,nd->thn", q_deq, k_fp8.float() * k_scale[:, None]).relu()
    check_close("DeepGEMM fp8_fp4_mqa_logits", run()[:n], torch.einsum("thn,th->tn", want, w[:n]))
    return run


def _torch_topk(scores: torch.Tensor, n_visible: torch.Tensor, topk: int):
    def run() -> torch.Tensor:
        visible = torch.arange(scores.shape[1], device=scores.device)[None, :] < n_visible[:, None]
        masked = scores.masked_fill(~visible, float("-inf"))
        idx = torch.topk(masked, min(topk, scores.shape[1]), dim=-1).indices
        rank = torch.arange(idx.shape[1], device=scores.device)[None, :]
        return torch.where(rank < n_visible[:, None], idx, -1)

    return run


FAMILY = Family(
    name="attention",
    setup=setup,
    ops=(
        OpBench("sparse_attention", "sparse attention with sink over window + top-k compressed rows (bf16 KV)",
                sparse_attention_point, smoke_tokens=SMOKE_DECODE_TOKENS),
        OpBench("sparse_attention_fp8", "sparse attention reading the 584-byte FP8 KV cache (decode)",
                sparse_attention_fp8_point, tokens=DECODE_TOKENS, smoke_tokens=(1,)),
        OpBench("indexer_scores", "lightning-indexer scores of every token against every key", indexer_scores_point,
                smoke_tokens=SMOKE_DECODE_TOKENS),
        OpBench("indexer_topk", "top-k of the visible entries' scores", indexer_topk_point,
                smoke_tokens=SMOKE_DECODE_TOKENS),
        OpBench("compress", "the CSA KV compressor (ratio 4, overlapping), prefill form", compress_point),
        OpBench("attention", "the whole CSA attention layer: projections, compressors, indexer, sparse attention, "
                "output projection", attention_point, smoke_tokens=SMOKE_DECODE_TOKENS),
    ),
)
