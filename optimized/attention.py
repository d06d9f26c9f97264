"""Public attention ops and `optimized.Attention` (spec §3): the reference's names and signatures plus `backend=`.

Ops (each validates its inputs here, before anything is launched, then dispatches):
  * `sparse_attention(q, kv, indices, sink, scale, *, fmt="e4m3fn")` — kv as bf16 rows `[N, 512]` or as the
    584-byte FP8 cache rows `[N, 584]` uint8 (`reference.cache` layout, NoPE bytes in `fmt`), which the Triton
    kernel dequantizes in-kernel (the reference backend unpacks them first).
  * `project_q`, `project_kv`, `indexer_q` — the projections: FP8 linears (`optimized.fp8_linear` of the same
    backend) and the fused norm + RoPE + quantization kernel (`optimized.triton.rope_quant`).
  * `compress` — the compressor (prefill form): Triton projection GEMM + pooling + the fused finish.
  * `indexer_scores`, `indexer_topk` — Triton logits and top-k; on `deepgemm` the logits are DeepGEMM's FP8
    MQA logits (vLLM's SM90 numerics: FP8 q and k, fp32 logits; needs `numerics.indexer_scores_bf16 = False`).
Backends: `reference`; `triton`; `deepgemm` = DeepGEMM FP8 GEMMs and indexer logits with the Triton kernels for
what DeepGEMM has none of (sparse attention, compressor, norm/RoPE/quant, top-k).

`Attention(cfg, layer_id, weights, numerics, backend=None)` computes the reference layer
(`reference.attention.Attention`) with these ops for prefill, chunked prefill and decode. Its cache
(`optimized.AttentionCache`) keeps the window ring and the compressed entries as 584-byte FP8 rows when
`numerics.kv_fp8_sim` (what the reference's bf16 rows hold after the FP8 simulation, bitwise), bf16 rows
otherwise; compressor states and index keys as the reference keeps them. The output projection is
`optimized.output_projection`, which implements `numerics.wo_a = "fp8"` (the optimized backends raise for the
official bf16 einsum). Window / candidate bookkeeping follows the reference's index functions
(`check_tokens`, `visible_entries`, and `candidate_indices` as `pool_and_indices`, the same layout built for the
whole batch in a few launches instead of several per sequence): a per-call KV pool of the batch's rows is
gathered from the cache (a copy of the sequences' rows each call; the kernels read only the rows each token
selects).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, pairwise

import torch
from torch import nn

from optimized.backends import checking_values, detect, register, value_checks
from optimized.einsum import output_projection, project_quantized
from optimized.linear import fp8_linear, implementation
from reference import attention as ref
from reference.attention import AttentionWeights, check_continuation, check_tokens, visible_entries
from reference.cache import KV_PACKED_BYTES, pack_kv, unpack_kv
from reference.cache import AttentionCache as ReferenceCache
from reference.compressor import CompressorState, CompressorWeights, overlap_factor
from reference.config import DSv4Config
from reference.formats import fp8_format
from reference.indexer import INDEXER_RATIO, IndexerWeights
from reference.linear import rms_norm
from reference.numerics import OFFICIAL, Numerics
from reference.rope import rope_cos_sin, yarn_frequencies

HEAD_DIM = 512
ROPE_PAIRS = 32
_NO_DEEPGEMM = "Triton kernel (DeepGEMM has none)"
_GLUE = "DeepGEMM FP8 GEMMs + Triton norm/RoPE/quant kernel"

register("sparse_attention", "reference", "optimized.attention:sparse_attention_reference")
_SPLIT_NOTE = "rerun-deterministic; not batch-invariant (heads per program and split-KV follow the token count)"
register("sparse_attention", "triton", "optimized.attention:sparse_attention_triton", note=_SPLIT_NOTE)
register("sparse_attention", "deepgemm", "optimized.attention:sparse_attention_triton",
         note=f"{_NO_DEEPGEMM}; {_SPLIT_NOTE}")
register("indexer_scores", "reference", "reference.indexer:indexer_scores")
register("indexer_scores", "triton", "optimized.attention:indexer_scores_triton")
register("indexer_scores", "deepgemm", "optimized.deepgemm.indexer:indexer_scores",
         note="fp8_fp4_mqa_logits: FP8 q and k, fp32 logits (vLLM SM90 numerics; not the official bf16 scores)")
register("indexer_topk", "reference", "reference.indexer:indexer_topk")
register("indexer_topk", "triton", "optimized.triton.indexer:indexer_topk")
register("indexer_topk", "deepgemm", "optimized.triton.indexer:indexer_topk", note=_NO_DEEPGEMM)
register("compress", "reference", "reference.compressor:compress")
register("compress", "triton", "optimized.attention:compress_triton")
register("compress", "deepgemm", "optimized.attention:compress_triton", note=_NO_DEEPGEMM)
for _op in ("project_q", "project_kv", "indexer_q"):
    register(_op, "reference", f"reference.attention:{_op}" if _op != "indexer_q" else "reference.indexer:indexer_q")
    register(_op, "triton", f"optimized.attention:{_op}_triton")
    register(_op, "deepgemm", f"optimized.attention:{_op}_deepgemm", note=_GLUE)
register("attention", "reference", "reference.attention:Attention")
_LAYER_NOTE = "rerun-deterministic; not batch-invariant (GEMM tiles, split-KV)"
register("attention", "triton", "optimized.attention:Attention", note=_LAYER_NOTE)
register("attention", "deepgemm", "optimized.attention:Attention",
         note="DeepGEMM GEMMs and indexer logits; Triton sparse attention, compressor, norm/RoPE/quant, top-k; "
              + _LAYER_NOTE)


# ------------------------------------------------------------------------------------------------
# Validation (runs before any kernel)
# ------------------------------------------------------------------------------------------------


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    return t


def _same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device} (the device of the other inputs)")


def check_sparse_attention_args(
    q: object, kv: object, indices: object, sink: object, scale: object, fmt: object
) -> bool:
    """Validate a `sparse_attention` call; returns whether kv holds packed FP8 rows.

    Raises:
        TypeError / ValueError naming the argument: q [T, H, 512] bf16 (last dim contiguous); kv [N, 512] bf16 or
        [N, 584] uint8, contiguous; indices [T, K] int32 with values in -1 .. N-1 and no row twice in a token's
        list; sink [H] fp32; scale > 0; fmt an FP8 format; all on q's device.
    """
    q, kv, indices, sink = _tensor("q", q), _tensor("kv", kv), _tensor("indices", indices), _tensor("sink", sink)
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q: expected bfloat16, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] != HEAD_DIM or (q.numel() and q.stride(2) != 1):
        raise ValueError(f"q: expected [T, H, {HEAD_DIM}] with a contiguous last dim, got shape {list(q.shape)} "
                         f"strides {list(q.stride())}")
    n_tokens, n_heads, _ = q.shape
    packed = kv.dtype == torch.uint8
    if kv.dtype not in (torch.bfloat16, torch.uint8):
        raise TypeError(f"kv: expected bf16 rows [N, {HEAD_DIM}] or packed FP8 cache rows [N, {KV_PACKED_BYTES}] "
                        f"uint8, got {kv.dtype}")
    width = KV_PACKED_BYTES if packed else HEAD_DIM
    if kv.dim() != 2 or kv.shape[1] != width or not kv.is_contiguous():
        raise ValueError(f"kv: expected contiguous [N, {width}] {kv.dtype} rows, got shape {list(kv.shape)}"
                         f"{'' if kv.is_contiguous() else ' (not contiguous)'}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices: expected int32, got {indices.dtype}")
    if indices.dim() != 2 or indices.shape[0] != n_tokens or (indices.numel() and indices.stride(1) != 1):
        raise ValueError(f"indices: expected [{n_tokens}, K] with a contiguous last dim, got shape "
                         f"{list(indices.shape)}")
    if sink.dtype != torch.float32:
        raise TypeError(f"sink: expected float32, got {sink.dtype}")
    if tuple(sink.shape) != (n_heads,) or not sink.is_contiguous():
        raise ValueError(f"sink: expected contiguous [{n_heads}] (one per head of q), got shape {list(sink.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale: expected a positive float, got {scale!r}")
    fp8_format(fmt)  # raises ValueError("fmt: ...")
    _same_device(q.device, kv=kv, indices=indices, sink=sink)
    if indices.numel() and checking_values(indices):
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= kv.shape[0]:
            raise ValueError(f"indices: expected values in -1..{kv.shape[0] - 1} (rows of kv, -1 = empty), "
                             f"got {lo}..{hi}")
        ordered = indices.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if bool(repeated.any()):
            row = int(repeated.any(dim=1).nonzero()[0])
            raise ValueError(f"indices: row {row} selects a kv row twice; each row may appear once per token")
    return packed


def _check_numerics(numerics: object, backend: str) -> Numerics:
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics: expected a Numerics, got {type(numerics).__name__}")
    if backend != "reference" and not numerics.act_quant:
        raise ValueError(f"numerics: act_quant=False (unquantized activations) is implemented by the reference "
                         f"backend only, not {backend}")
    if backend == "deepgemm" and (numerics.fp8_format != "e4m3fn" or numerics.act_block != 128):
        raise ValueError(f"numerics: DeepGEMM needs fp8_format 'e4m3fn' and act_block 128, got "
                         f"{numerics.fp8_format!r} and {numerics.act_block}")
    return numerics


def _check_rows(x: object, positions: object, freqs: object, dim: int, name: str = "x") -> torch.Tensor:
    x = _tensor(name, x)
    positions, freqs = _tensor("positions", positions), _tensor("freqs", freqs)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name}: expected bfloat16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"{name}: expected [T, {dim}], got shape {list(x.shape)}")
    if positions.dtype not in (torch.int32, torch.int64) or tuple(positions.shape) != (x.shape[0],):
        raise ValueError(f"positions: expected [{x.shape[0]}] int (one per token), got {positions.dtype} "
                         f"{list(positions.shape)}")
    if freqs.dtype != torch.float32 or tuple(freqs.shape) != (ROPE_PAIRS,):
        raise ValueError(f"freqs: expected [{ROPE_PAIRS}] float32 (rope.yarn_frequencies), got {freqs.dtype} "
                         f"{list(freqs.shape)}")
    _same_device(x.device, positions=positions, freqs=freqs)
    return x


def _check_fp8_weight(name: str, w: object, shape: tuple[int, int], numerics: Numerics, device: torch.device) -> None:
    if not hasattr(w, "data") or not hasattr(w, "scale"):
        raise TypeError(f"{name}: expected an Fp8Weight, got {type(w).__name__}")
    if tuple(w.data.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(w.data.shape)}")
    if w.data.dtype != fp8_format(numerics.fp8_format).dtype:
        raise TypeError(f"{name}: stored as {w.data.dtype}, numerics.fp8_format is {numerics.fp8_format!r}")
    _same_device(device, **{name: w.data})


def _check_projection(
    x: object, w: object, cfg: object, positions: object, freqs: object, numerics: object, backend: str,
    parts: tuple[str, ...],
) -> tuple[torch.Tensor, AttentionWeights, DSv4Config, Numerics]:
    if not isinstance(cfg, DSv4Config):
        raise TypeError(f"cfg: expected a DSv4Config, got {type(cfg).__name__}")
    if not isinstance(w, AttentionWeights):
        raise TypeError(f"w: expected AttentionWeights, got {type(w).__name__}")
    numerics = _check_numerics(numerics, backend)
    x = _check_rows(x, positions, freqs, cfg.dim)
    shapes = {"wq_a": (cfg.q_lora_rank, cfg.dim), "wq_b": (cfg.n_heads * HEAD_DIM, cfg.q_lora_rank),
              "wkv": (HEAD_DIM, cfg.dim)}
    for part in parts:
        _check_fp8_weight(f"w.{part}", getattr(w, part), shapes[part], numerics, x.device)
    return x, w, cfg, numerics


# ------------------------------------------------------------------------------------------------
# Sparse attention
# ------------------------------------------------------------------------------------------------


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float, *,
    fmt: str = "e4m3fn", backend: str | None = None,
) -> torch.Tensor:
    """Sparse attention with a per-head sink (see `reference.attention.sparse_attention`).

    Args:
        q: [T, H, 512] bf16.
        kv: [N, 512] bf16 rows, or [N, 584] uint8 packed FP8 cache rows (`reference.cache.pack_kv` layout).
        indices: [T, K] int32 rows of kv, -1 = empty slot, no row twice per token.
        sink: [H] fp32.
        scale: logit scale (512^-0.5).
        fmt: FP8 format of packed rows' NoPE bytes (ignored for bf16 rows).

    Returns:
        [T, H, 512] bf16.
    """
    check_sparse_attention_args(q, kv, indices, sink, scale, fmt)
    return implementation("sparse_attention", backend, ("q", q)).load()(q, kv, indices, sink, float(scale), fmt=fmt)


def sparse_attention_reference(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float, *, fmt: str
) -> torch.Tensor:
    """The reference, over packed rows through `reference.cache.unpack_kv` (exact)."""
    rows = unpack_kv(kv, fmt) if kv.dtype == torch.uint8 else kv
    return ref.sparse_attention(q, rows, indices, sink, scale)


def sparse_attention_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float, *, fmt: str
) -> torch.Tensor:
    """The Triton kernel, bf16 or packed rows."""
    from optimized.triton import sparse_attention as tsa

    if kv.dtype == torch.uint8:
        return tsa.sparse_attention_packed(q, kv, indices, sink, scale, fp8_dtype=fp8_format(fmt).dtype)
    return tsa.sparse_attention(q, kv, indices, sink, scale)


# ------------------------------------------------------------------------------------------------
# Projections
# ------------------------------------------------------------------------------------------------


def _rope_quant(*args: object, **kwargs: object) -> torch.Tensor:
    """`optimized.triton.rope_quant.rope_quant`, imported on first use (Triton loads only when a kernel runs)."""
    from optimized.triton.rope_quant import rope_quant

    return rope_quant(*args, **kwargs)


RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 32] fp32 of `_cos_sin`


def _cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> RopeTables:
    """The reference's cos / sin tables (`rope.rope_cos_sin`), contiguous for the kernel."""
    cos, sin = rope_cos_sin(positions, freqs)
    return cos.contiguous(), sin.contiguous()


def _project_q(
    backend: str, x: torch.Tensor, w: AttentionWeights, cfg: DSv4Config, positions: torch.Tensor,
    freqs: torch.Tensor, numerics: Numerics, *, rope: RopeTables | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope`: the tables `_cos_sin(positions, freqs)` where the caller has them (the layer computes them once)."""
    # the latent's RMSNorm (weighted, fp32) is the reference's own: a few elementwise ops on [T, q_lora]
    c_q = rms_norm(fp8_linear(x, w.wq_a, numerics, backend=backend), w.q_norm, cfg.norm_eps)
    q = fp8_linear(c_q, w.wq_b, numerics, backend=backend)
    cos, sin = rope or _cos_sin(positions, freqs)
    q = _rope_quant(q.view(-1, HEAD_DIM), cos, sin, norm="head_bf16", eps=cfg.norm_eps)
    return q.view(x.shape[0], cfg.n_heads, HEAD_DIM), c_q


def _project_kv(
    backend: str, x: torch.Tensor, w: AttentionWeights, cfg: DSv4Config, positions: torch.Tensor,
    freqs: torch.Tensor, numerics: Numerics, *, packed: bool = False, rope: RopeTables | None = None,
) -> torch.Tensor:
    """[T, 512] bf16 rows, or with `packed` (needs `numerics.kv_fp8_sim`) the [T, 584] uint8 FP8 cache rows."""
    kv = fp8_linear(x, w.wkv, numerics, backend=backend)
    cos, sin = rope or _cos_sin(positions, freqs)
    quant = "packed" if packed else ("fp8" if numerics.kv_fp8_sim else "none")
    return _rope_quant(kv, cos, sin, norm="weighted", norm_weight=w.kv_norm, eps=cfg.norm_eps, quant=quant,
                      fmt=numerics.fp8_format)


def _indexer_q(
    backend: str, c_q: torch.Tensor, x: torch.Tensor, w: IndexerWeights, positions: torch.Tensor,
    freqs: torch.Tensor, numerics: Numerics, *, rope: RopeTables | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q = fp8_linear(c_q, w.wq_b, numerics, backend=backend)
    cos, sin = rope or _cos_sin(positions, freqs)
    q = _rope_quant(q.view(-1, w.head_dim), cos, sin, norm="none", hadamard=numerics.indexer_hadamard,
                   quant="fp4" if numerics.indexer_fp4_sim else "none")
    # the per-head weights: a bf16 linear (fp32 accumulation, bf16 out, as the reference's), then the scale
    projected = torch.nn.functional.linear(x, w.weights_proj)
    head_weights = projected.float() * (w.head_dim**-0.5 * w.n_heads**-0.5)
    if numerics.indexer_scores_bf16:
        head_weights = head_weights.to(torch.bfloat16).float()
    return q.view(x.shape[0], w.n_heads, w.head_dim), head_weights


def project_q(
    x: torch.Tensor, w: AttentionWeights, cfg: DSv4Config, positions: torch.Tensor, freqs: torch.Tensor,
    numerics: Numerics, *, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries `[T, H, 512]` bf16 and the latent `c_q` `[T, q_lora_rank]` (see `reference.attention.project_q`)."""
    impl = implementation("project_q", backend, ("x", x))
    _check_projection(x, w, cfg, positions, freqs, numerics, impl.backend, ("wq_a", "wq_b"))
    return impl.load()(x, w, cfg, positions, freqs, numerics)


def project_kv(
    x: torch.Tensor, w: AttentionWeights, cfg: DSv4Config, positions: torch.Tensor, freqs: torch.Tensor,
    numerics: Numerics, *, backend: str | None = None,
) -> torch.Tensor:
    """Window KV rows `[T, 512]` bf16 (see `reference.attention.project_kv`)."""
    impl = implementation("project_kv", backend, ("x", x))
    _check_projection(x, w, cfg, positions, freqs, numerics, impl.backend, ("wkv",))
    return impl.load()(x, w, cfg, positions, freqs, numerics)


def indexer_q(
    c_q: torch.Tensor, x: torch.Tensor, w: IndexerWeights, positions: torch.Tensor, freqs: torch.Tensor,
    numerics: Numerics, *, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries `[T, Hi, 128]` bf16 and head weights `[T, Hi]` fp32 (see `reference.indexer.indexer_q`)."""
    impl = implementation("indexer_q", backend, ("c_q", c_q))
    numerics = _check_numerics(numerics, impl.backend)
    if not isinstance(w, IndexerWeights):
        raise TypeError(f"w: expected IndexerWeights, got {type(w).__name__}")
    c_q = _check_rows(c_q, positions, freqs, w.wq_b.shape[1], name="c_q")
    x = _tensor("x", x)
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape != (c_q.shape[0], w.weights_proj.shape[1]):
        raise ValueError(f"x: expected [{c_q.shape[0]}, {w.weights_proj.shape[1]}] bf16 (one row per token of c_q), "
                         f"got {x.dtype} {list(x.shape)}")
    _same_device(c_q.device, x=x, weights_proj=w.weights_proj)
    _check_fp8_weight("w.wq_b", w.wq_b, tuple(w.wq_b.shape), numerics, c_q.device)
    return impl.load()(c_q, x, w, positions, freqs, numerics)


project_q_triton = partial(_project_q, "triton")
project_q_deepgemm = partial(_project_q, "deepgemm")
project_kv_triton = partial(_project_kv, "triton")
project_kv_deepgemm = partial(_project_kv, "deepgemm")
indexer_q_triton = partial(_indexer_q, "triton")
indexer_q_deepgemm = partial(_indexer_q, "deepgemm")


# ------------------------------------------------------------------------------------------------
# Indexer scores and top-k
# ------------------------------------------------------------------------------------------------


def _check_indexer_scores_args(q_idx: object, k_idx: object, head_weights: object, numerics: object,
                               backend: str) -> None:
    q_idx, k_idx, head_weights = _tensor("q_idx", q_idx), _tensor("k_idx", k_idx), _tensor("head_weights",
                                                                                          head_weights)
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics: expected a Numerics, got {type(numerics).__name__}")
    for name, t, dtype in (("q_idx", q_idx, torch.bfloat16), ("k_idx", k_idx, torch.bfloat16),
                           ("head_weights", head_weights, torch.float32)):
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected {dtype}, got {t.dtype}")
    if q_idx.dim() != 3 or k_idx.dim() != 2 or q_idx.shape[2] != k_idx.shape[1]:
        raise ValueError(f"q_idx, k_idx: expected [T, Hi, d] and [N, d], got {list(q_idx.shape)} and "
                         f"{list(k_idx.shape)}")
    d = q_idx.shape[2]
    if d < 16 or d & (d - 1):
        raise ValueError(f"q_idx: head dim must be a power of two >= 16 for the kernels, got {d}")
    if tuple(head_weights.shape) != tuple(q_idx.shape[:2]):
        raise ValueError(f"head_weights: expected {list(q_idx.shape[:2])}, got {list(head_weights.shape)}")
    for name, t in (("q_idx", q_idx), ("k_idx", k_idx), ("head_weights", head_weights)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dim")
    _same_device(q_idx.device, k_idx=k_idx, head_weights=head_weights)
    if backend == "deepgemm" and numerics.indexer_scores_bf16:
        raise ValueError("numerics: indexer_scores_bf16=True (the official bf16 scores) is not what DeepGEMM's FP8 "
                         "logits compute; use the triton or reference backend, or fp32 scores (VLLM_NVIDIA)")


def indexer_scores(
    q_idx: torch.Tensor, k_idx: torch.Tensor, head_weights: torch.Tensor, numerics: Numerics, *,
    backend: str | None = None,
) -> torch.Tensor:
    """Scores `[T, N]` fp32 of every token against every key (see `reference.indexer.indexer_scores`)."""
    impl = implementation("indexer_scores", backend, ("q_idx", q_idx))
    _check_indexer_scores_args(q_idx, k_idx, head_weights, numerics, impl.backend)
    return impl.load()(q_idx, k_idx, head_weights, numerics)


def indexer_scores_triton(
    q_idx: torch.Tensor, k_idx: torch.Tensor, head_weights: torch.Tensor, numerics: Numerics
) -> torch.Tensor:
    from optimized.triton import indexer as ti

    return ti.indexer_scores(q_idx, k_idx, head_weights, round_bf16=numerics.indexer_scores_bf16)


def indexer_topk(
    scores: torch.Tensor, n_visible: torch.Tensor, topk: int, *, backend: str | None = None
) -> torch.Tensor:
    """`[T, topk]` int32 selected entries, -1 padded (see `reference.indexer.indexer_topk`; the order of the
    indices differs by backend — the reference sorts by score, Triton by index — the sets are what count)."""
    scores, n_visible = _tensor("scores", scores), _tensor("n_visible", n_visible)
    if scores.dtype != torch.float32 or scores.dim() != 2 or (scores.numel() and scores.stride(1) != 1):
        raise ValueError(f"scores: expected [T, N] float32 with a contiguous last dim, got {scores.dtype} "
                         f"{list(scores.shape)}")
    if n_visible.dtype not in (torch.int32, torch.int64) or tuple(n_visible.shape) != (scores.shape[0],):
        raise ValueError(f"n_visible: expected [{scores.shape[0]}] int, got {n_visible.dtype} "
                         f"{list(n_visible.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected an int >= 1, got {topk!r}")
    _same_device(scores.device, n_visible=n_visible)
    in_range = not (n_visible.numel() and checking_values(n_visible)) or (
        int(n_visible.min()) >= 0 and int(n_visible.max()) <= scores.shape[1])
    if not in_range:
        raise ValueError(f"n_visible: expected values in 0..{scores.shape[1]} (the number of entries), got "
                         f"{int(n_visible.min())}..{int(n_visible.max())}")
    return implementation("indexer_topk", backend, ("scores", scores)).load()(scores, n_visible, topk)


# ------------------------------------------------------------------------------------------------
# Compressor
# ------------------------------------------------------------------------------------------------


def _finish_mode(rotate: str, numerics: Numerics, packed: bool) -> dict[str, object]:
    """rope_quant switches of `reference.compressor.finish_entries` for the main or the indexer compressor."""
    if rotate == "main":
        quant = "packed" if packed else ("fp8" if numerics.kv_fp8_sim else "none")
        return {"hadamard": False, "quant": quant, "fmt": numerics.fp8_format}
    return {"hadamard": numerics.indexer_hadamard, "quant": "fp4" if numerics.indexer_fp4_sim else "none"}


def compress_chunks(
    x: torch.Tensor, positions: torch.Tensor, bounds: list[int], states: list[CompressorState],
    weights: CompressorWeights, *, freqs: torch.Tensor, numerics: Numerics, rotate: str, norm_eps: float,
    packed: bool = False, w_cat: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """`reference.compressor.compress_chunk` for every sequence of a batch at once (updates `states`).

    One projection GEMM for all tokens, one pooling launch for every completed entry, one finishing launch.
    The slot rows of sequence b are its state rows (the previous complete block for ratio 4, then the current
    block's earlier tokens) followed by its new tokens, exactly the rows the reference pools.

    Args:
        x: [T, D] bf16, positions [T], sequences `bounds` (cu_seqlens as a list), `states` one per sequence.
        packed: main compressor entries as 584-byte FP8 rows (needs `numerics.kv_fp8_sim`).
        w_cat: `cat(wkv, wgate)` if the caller keeps one.

    Returns:
        Per sequence, its new entries: [n_b, d] bf16, or [n_b, 584] uint8 when packed.
    """
    from optimized.triton import compressor as tc

    m, d = weights.ratio, weights.head_dim
    coff = overlap_factor(m)
    w_cat = torch.cat((weights.wkv, weights.wgate)) if w_cat is None else w_cat
    proj = tc.projections(x, w_cat, weights.ape, positions)
    buffers, entry_rows, entry_ids, counts = [], [], [], []
    base = 0
    current = (coff - 1) * m
    for b, state in enumerate(states):
        start = state.next_position
        n_tokens = bounds[b + 1] - bounds[b]
        state.next_position = start + n_tokens
        if start % m + n_tokens < m:
            # no block completes (most decode steps): the tokens join the open block's rows; the rows past them
            # stay a = 0, b = -inf (the state's invariant), nothing is pooled
            if n_tokens:
                rows = slice(current + start % m, current + start % m + n_tokens)
                new = proj[bounds[b]:bounds[b + 1]]
                state.kv[rows], state.score[rows] = new[:, :coff * d], new[:, coff * d:]
            counts.append(0)
            continue
        state_rows = torch.cat((state.kv, state.score), dim=1)
        # the rows this chunk pools from, in one copy: [the previous complete block (overlap)], the open block's
        # earlier tokens, the new tokens; `run` is the view from the open block on
        pieces = (state_rows[current:current + start % m], proj[bounds[b]:bounds[b + 1]])
        buffer = torch.cat((state_rows[:m], *pieces) if coff == 2 else pieces)
        run = buffer[m:] if coff == 2 else buffer
        n_new = run.shape[0] // m
        buffers.append(buffer)
        entry_rows.append(base + m * torch.arange(n_new, device=x.device))
        entry_ids.append(start // m + torch.arange(n_new, device=x.device))
        counts.append(n_new)
        base += buffer.shape[0]
        # the state after the chunk (reference.compressor.compress_chunk): last complete block, then the tail
        if coff == 2 and n_new > 0:
            last = run[(n_new - 1) * m:n_new * m]
            state.kv[:m], state.score[:m] = last[:, :coff * d], last[:, coff * d:]
        tail = run[n_new * m:]
        state.kv[current:], state.score[current:] = 0.0, float("-inf")
        state.kv[current:current + tail.shape[0]] = tail[:, :coff * d]
        state.score[current:current + tail.shape[0]] = tail[:, coff * d:]
    if not buffers:  # no sequence completed a block
        empty = torch.empty((0, KV_PACKED_BYTES) if packed else (0, d),
                            dtype=torch.uint8 if packed else torch.bfloat16, device=x.device)
        return [empty] * len(states)
    ids = torch.cat(entry_ids)
    u = tc.pool(buffers[0] if len(buffers) == 1 else torch.cat(buffers), torch.cat(entry_rows).to(torch.int32),
                ratio=m, head_dim=d)
    cos, sin = _cos_sin(ids * m, freqs)  # RoPE at the block's first position
    entries = _rope_quant(u, cos, sin, norm="weighted", norm_weight=weights.norm, eps=norm_eps,
                         round_input=numerics.compressed_norm_input == "bf16", **_finish_mode(rotate, numerics, packed))
    return list(entries.split(counts))


def compress(
    x: torch.Tensor, positions: torch.Tensor, weights: CompressorWeights, *, ratio: int, head_dim: int,
    freqs: torch.Tensor, numerics: Numerics, rotate: str, norm_eps: float = 1e-6, backend: str | None = None,
) -> torch.Tensor:
    """Prefill form of the compressor: `[T // ratio, head_dim]` bf16 entries of one sequence at positions
    0 .. T-1 (see `reference.compressor.compress`)."""
    impl = implementation("compress", backend, ("x", x))
    if not isinstance(weights, CompressorWeights):
        raise TypeError(f"weights: expected CompressorWeights, got {type(weights).__name__}")
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics: expected a Numerics, got {type(numerics).__name__}")
    x = _check_rows(x, positions, freqs, weights.wkv.shape[1])
    if (weights.ratio, weights.head_dim) != (ratio, head_dim):
        raise ValueError(f"weights: hold a ratio-{weights.ratio} compressor with head dim {weights.head_dim}, "
                         f"called with ratio {ratio} and head_dim {head_dim}")
    if rotate not in ("main", "indexer"):
        raise ValueError(f"rotate: expected 'main' or 'indexer', got {rotate!r}")
    if head_dim not in (128, 512):
        raise ValueError(f"head_dim: the kernels finish entries of 128 or 512 dims, got {head_dim}")
    if not torch.equal(positions.cpu().long(), torch.arange(x.shape[0])):
        raise ValueError("positions: the prefill form takes one sequence at positions 0 .. T-1")
    _same_device(x.device, wkv=weights.wkv, wgate=weights.wgate, ape=weights.ape, norm=weights.norm)
    return impl.load()(x, positions, weights, ratio=ratio, head_dim=head_dim, freqs=freqs, numerics=numerics,
                       rotate=rotate, norm_eps=norm_eps)


def compress_triton(
    x: torch.Tensor, positions: torch.Tensor, weights: CompressorWeights, *, ratio: int, head_dim: int,
    freqs: torch.Tensor, numerics: Numerics, rotate: str, norm_eps: float = 1e-6,
) -> torch.Tensor:
    state = CompressorState.empty(ratio, head_dim, x.device)
    return compress_chunks(x, positions, [0, x.shape[0]], [state], weights, freqs=freqs, numerics=numerics,
                           rotate=rotate, norm_eps=norm_eps)[0]


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------


@dataclass
class SequenceCache:
    """One sequence's state for one layer (`reference.cache.SequenceCache` with FP8 rows when packed).

    Attributes:
        window: [window_size, 584] uint8 (packed) or [window_size, 512] bf16 ring, row `p mod window_size`.
        compressed: [n_c, 584] uint8 or [n_c, 512] bf16 main compressed entries.
        indexer_keys: [n_c, 128] bf16 index keys (CSA).
        compressor, indexer_compressor: `reference.compressor.CompressorState` or None.
        next_position: position of the next token.
    """

    window: torch.Tensor
    compressed: torch.Tensor
    indexer_keys: torch.Tensor
    compressor: CompressorState | None = None
    indexer_compressor: CompressorState | None = None
    next_position: int = 0


@dataclass
class AttentionCache:
    """Per-sequence decode state of one layer for `optimized.Attention` (the reference's `AttentionCache`
    contents, with the KV rows in the 584-byte FP8 layout when `packed`).

    Use `AttentionCache.empty(cfg, layer_id, batch, device, packed=True)`; `Attention.forward` updates it.
    """

    layer_id: int
    kind: str
    ratio: int
    packed: bool
    sequences: list[SequenceCache] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: DSv4Config, layer_id: int, batch: int, device: torch.device | str = "cpu", *,
              packed: bool = True) -> AttentionCache:
        """The state before any token of `batch` sequences at layer `layer_id`; `packed` = FP8 KV rows."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise ValueError(f"batch: expected an int >= 0, got {batch!r}")
        kind, ratio = cfg.layer_kind(layer_id), cfg.compress_ratio(layer_id)
        row_shape, row_dtype = ((KV_PACKED_BYTES,), torch.uint8) if packed else ((cfg.head_dim,), torch.bfloat16)

        def sequence() -> SequenceCache:
            return SequenceCache(
                window=torch.zeros((cfg.window_size, *row_shape), dtype=row_dtype, device=device),
                compressed=torch.zeros((0, *row_shape), dtype=row_dtype, device=device),
                indexer_keys=torch.zeros(0, cfg.index_head_dim, dtype=torch.bfloat16, device=device),
                compressor=CompressorState.empty(ratio, cfg.head_dim, device) if ratio else None,
                indexer_compressor=CompressorState.empty(ratio, cfg.index_head_dim, device) if kind == "csa" else None,
            )

        return cls(layer_id, kind, ratio, packed, [sequence() for _ in range(batch)])

    @classmethod
    def from_reference(cls, cache: ReferenceCache, *, packed: bool = True, fmt: str = "e4m3fn") -> AttentionCache:
        """The same state as a reference cache (rows packed with `reference.cache.pack_kv` in `fmt`, which is
        exact for rows that went through the FP8 simulation); states and keys copied."""
        if not isinstance(cache, ReferenceCache):
            raise TypeError(f"cache: expected a reference.cache.AttentionCache, got {type(cache).__name__}")

        def rows(t: torch.Tensor) -> torch.Tensor:
            return pack_kv(t, fmt) if packed else t.clone()

        def state(st: CompressorState | None) -> CompressorState | None:
            return None if st is None else CompressorState(st.kv.clone(), st.score.clone(), st.next_position)

        return cls(cache.layer_id, cache.kind, cache.ratio, packed, [
            SequenceCache(rows(s.window), rows(s.compressed), s.indexer_keys.clone(), state(s.compressor),
                          state(s.indexer_compressor), s.next_position) for s in cache.sequences])

    def check(self, cfg: DSv4Config, layer_id: int, batch: int, packed: bool) -> None:
        """Raise `ValueError` unless this cache fits layer `layer_id` with `batch` sequences and this row format."""
        kind = cfg.layer_kind(layer_id)
        if (self.layer_id, self.kind, self.ratio) != (layer_id, kind, cfg.compress_ratio(layer_id)):
            raise ValueError(f"cache: belongs to layer {self.layer_id} ({self.kind}), used at layer {layer_id} "
                             f"({kind})")
        if self.packed != packed:
            raise ValueError(f"cache: holds {'packed FP8' if self.packed else 'bf16'} rows, the layer's numerics "
                             f"(kv_fp8_sim={packed}) need {'packed FP8' if packed else 'bf16'} rows")
        if len(self.sequences) != batch:
            raise ValueError(f"cache: holds {len(self.sequences)} sequences, cu_seqlens describes {batch}")
        # what each sequence holds must match the positions it has seen (host-side: no device read)
        ratio, row = cfg.compress_ratio(layer_id), (KV_PACKED_BYTES,) if packed else (cfg.head_dim,)
        for b, seq in enumerate(self.sequences):
            p = seq.next_position
            held = {"window": (tuple(seq.window.shape), (cfg.window_size, *row)),
                    "compressed": (seq.compressed.shape[0], p // ratio if ratio else 0),
                    "indexer_keys": (seq.indexer_keys.shape[0], p // INDEXER_RATIO if kind == "csa" else 0)}
            for name, state in (("compressor", seq.compressor), ("indexer_compressor", seq.indexer_compressor)):
                if state is not None:
                    held[f"{name} state at"] = (state.next_position, p)
            for what, (got, expected) in held.items():
                if got != expected:
                    raise ValueError(f"cache: sequence {b} at position {p} holds {what} {got}, expected {expected}")


def _per_token(values: list[tuple[int, ...]], bounds: list[int], device: torch.device,
               dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[T, len(values[b])]: sequence b's values repeated over its tokens (`bounds`), one fill per sequence and value.

    The values become constants of the fill kernels and nothing is copied from the host, so the host never waits
    for the device and a captured CUDA graph replays them (a host-to-device copy in a graph would read its host
    buffer again at every replay).
    """
    out = torch.empty((bounds[-1], len(values[0])), dtype=dtype, device=device)
    for (start, end), row in zip(pairwise(bounds), values):
        if end > start:
            for j, value in enumerate(row):
                out[start:end, j].fill_(value)
    return out


def pool_and_indices(
    window_rows: list[tuple[torch.Tensor, ...]], window_first: list[int], compressed: list[torch.Tensor],
    selection: torch.Tensor, positions: torch.Tensor, bounds: list[int], window_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.attention.candidate_indices` (validate=False) for the whole batch at once: the same pool (per
    sequence its window rows, then its entries) and the same indices [T, window_size + k] int32, from one index
    computation over all tokens instead of several launches per sequence (with the ring views below, one TINY
    decode step of 16 sequences runs 277 instead of 461 of the ops that launch kernels on a GPU: CPU profiler).
    A sequence's window rows come as pieces (ring views and new rows) that the pool's one copy puts together.

    Each token's window column is `pool row of its sequence's first window position + (position - that position)`
    and each selected entry `pool row of its sequence's entry 0 + entry id` (`_per_token` lays the two
    per-sequence offsets out per token).
    """
    offsets, base = [], 0
    for pieces, first, entries in zip(window_rows, window_first, compressed):
        n_rows = sum(piece.shape[0] for piece in pieces)
        offsets.append((base - first, base + n_rows))
        base += n_rows + entries.shape[0]
    per_token = _per_token(offsets, bounds, positions.device)
    window_pos = positions[:, None] + torch.arange(-window_size + 1, 1, device=positions.device)[None, :]
    window_cols = torch.where(window_pos >= 0, per_token[:, :1] + window_pos, -1)
    sel = selection.long()
    compressed_cols = torch.where(sel >= 0, per_token[:, 1:] + sel, -1)
    pool = torch.cat([t for pieces, entries in zip(window_rows, compressed) for t in (*pieces, entries)])
    return pool, torch.cat((window_cols, compressed_cols), dim=1).to(torch.int32)


def _ring_rows(ring: torch.Tensor, first: int, end: int) -> tuple[torch.Tensor, ...]:
    """Views of the ring rows of positions `first .. end - 1` in position order (row p mod len(ring)): one slice,
    or two where the range wraps; at most len(ring) positions."""
    size = len(ring)
    lo, n = first % size, end - first
    if lo + n <= size:
        return (ring[lo:lo + n],)
    return ring[lo:], ring[:lo + n - size]


class Attention(nn.Module):
    """One DSv4 attention layer on the optimized ops (same math as `reference.attention.Attention`).

    `forward(x [T, D] bf16, positions [T] int64, cu_seqlens [B + 1] int32, cache=None) -> [T, D] bf16`:
    without a cache every sequence is a fresh prompt; with an `optimized.AttentionCache` each sequence
    continues where its cache left off (chunked prefill, decode) and the cache is updated. With
    `backend="reference"` the layer is `reference.attention.Attention` (and takes its cache type).
    """

    def __init__(self, cfg: DSv4Config, layer_id: int, weights: AttentionWeights, numerics: Numerics = OFFICIAL,
                 backend: str | None = None):
        super().__init__()
        if not isinstance(weights, AttentionWeights):
            raise TypeError(f"weights: expected AttentionWeights, got {type(weights).__name__}")
        weights.check(cfg, layer_id)
        self.backend = implementation("attention", backend, ("weights", weights.attn_sink)).backend
        _check_numerics(numerics, self.backend)
        # the reference backend is the reference layer itself (with the reference's cache type)
        self._reference = ref.Attention(cfg, layer_id, weights, numerics) if self.backend == "reference" else None
        if self.backend != "reference" and numerics.wo_a != "fp8":
            raise ValueError(f"numerics: wo_a={numerics.wo_a!r} (official bf16 einsum) has no {self.backend} output "
                             f"projection; the optimized backends implement wo_a='fp8'")
        self.cfg, self.layer_id, self.weights, self.numerics = cfg, layer_id, weights, numerics
        self.kind, self.ratio = cfg.layer_kind(layer_id), cfg.compress_ratio(layer_id)
        self.freqs = yarn_frequencies(cfg, self.ratio).to(weights.attn_sink.device)
        self.softmax_scale = cfg.head_dim**-0.5
        self.packed = numerics.kv_fp8_sim
        # the indexer's logits: DeepGEMM's FP8 MQA logits compute fp32 scores only
        self.indexer_backend = "deepgemm" if self.backend == "deepgemm" and not numerics.indexer_scores_bf16 \
            else "triton"
        compressors = (weights.compressor, None if weights.indexer is None else weights.indexer.compressor)
        self._w_cat, self._w_cat_indexer = (None if c is None else torch.cat((c.wkv, c.wgate)) for c in compressors)
        # `forward` asks for the attention output quantized (`sparse_attention_quantized`) where the sm_90 kernel
        # can store it so: e4m3fn (its native cast) on an sm_90 GPU, not interpreted
        device = weights.attn_sink.device
        self._fused_quant = (numerics.fp8_format == "e4m3fn" and device.type == "cuda" and torch.version.hip is None
                             and not detect().interpret and torch.cuda.get_device_capability(device) == (9, 0))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """x [T, D] bf16 -> [T, D] bf16. Updates `cache`."""
        if self._reference is not None:
            return self._reference(x, positions, cu_seqlens, cache)
        w = self.weights
        if self._fused_quant:
            # the sm_90 attention kernel stores its output quantized for `wo_a` where it runs without split-KV
            # (`sparse_attention_quantized`; elsewhere the attention then the quantization kernel): same bytes
            from optimized.triton import sparse_attention as tsa

            q, kv, indices = self.attention_inputs(x, positions, cu_seqlens, cache)
            packed = fp8_format(self.numerics.fp8_format).dtype if kv.dtype == torch.uint8 else None
            o_fp8, o_scale = tsa.sparse_attention_quantized(
                q, kv, indices, w.attn_sink, self.softmax_scale, positions, self.freqs, n_groups=self.cfg.o_groups,
                scale_layout="deepgemm" if self.backend == "deepgemm" else "row_major", packed_fp8_dtype=packed)
            return project_quantized(self.backend, o_fp8, o_scale, w.wo_a, w.wo_b, self.numerics)
        o = self.attend(x, positions, cu_seqlens, cache)
        return output_projection(o, positions, self.freqs, w.wo_a, w.wo_b, self.numerics, backend=self.backend)

    def attend(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
               cache: AttentionCache | None = None) -> torch.Tensor:
        """The attention output before the output projection, [T, H, 512] bf16. Updates `cache`."""
        q, kv, indices = self.attention_inputs(x, positions, cu_seqlens, cache)
        # The layer built `indices` itself (window and selection: in range and distinct by construction); the public
        # op's value checks would re-check that with a sort of every token's list and three device reads.
        with value_checks(False):
            return sparse_attention(q, kv, indices, self.weights.attn_sink, self.softmax_scale,
                                    fmt=self.numerics.fp8_format, backend=self.backend)

    def attention_inputs(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                         cache: AttentionCache | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, the batch's KV pool (packed or bf16 rows) and each token's candidate indices. Updates `cache`."""
        cfg, w, numerics, backend = self.cfg, self.weights, self.numerics, self.backend
        # The value checks read the device; under CUDA-graph capture they are skipped, and with `cu_seqlens` on the
        # CPU (host metadata, as serving engines keep it) a decode step never waits for the device.
        check = checking_values(positions)
        bounds = check_tokens(x, positions, cu_seqlens, cfg.dim, validate_positions=check)
        batch = len(bounds) - 1
        # Rows are kept in the 584-byte FP8 layout where a cache keeps them. Fresh prompts without a cache attend over
        # their FP8-simulated rows as bf16 instead: the same values (unpacking is exact), and the bf16 kernel skips
        # the per-tile dequantization (H200, FLASH CSA layer, prefill of 8192 tokens, same-call A/B: triton 11.8 ->
        # 11.1 ms, deepgemm 12.3 -> 11.4 ms, the same output bit for bit; docs/h200/ab-router-permute-bf16-*.json).
        packed = self.packed and cache is not None
        if cache is None:
            cache = AttentionCache.empty(cfg, self.layer_id, batch, x.device, packed=packed)
        elif not isinstance(cache, AttentionCache):
            raise TypeError(f"cache: expected an optimized.AttentionCache or None, got {type(cache).__name__}")
        cache.check(cfg, self.layer_id, batch, packed)
        if check:
            check_continuation(positions, bounds, cache.sequences)

        # the RoPE tables of the new tokens, shared by the queries, the KV rows and the indexer queries
        rope = _cos_sin(positions, self.freqs)
        q, c_q = _project_q(backend, x, w, cfg, positions, self.freqs, numerics, rope=rope)
        kv = _project_kv(backend, x, w, cfg, positions, self.freqs, numerics, packed=packed, rope=rope)
        seqs = cache.sequences
        if self.ratio:
            new = compress_chunks(x, positions, bounds, [s.compressor for s in seqs], w.compressor, freqs=self.freqs,
                                  numerics=numerics, rotate="main", norm_eps=cfg.norm_eps, packed=packed,
                                  w_cat=self._w_cat)
            for seq, entries in zip(seqs, new):
                if entries.shape[0]:
                    seq.compressed = torch.cat((seq.compressed, entries))
        if self.kind == "csa":
            selection = self._indexer_selection(x, c_q, positions, bounds, seqs, rope)
        elif self.kind == "hca":
            width = max((s.compressed.shape[0] for s in seqs), default=0)
            selection = visible_entries(positions, self.ratio, width)
        else:
            selection = torch.zeros(x.shape[0], 0, dtype=torch.int32, device=x.device)

        win = cfg.window_size
        # per sequence: the ring's rows of positions first .. start - 1 (row p mod win, as views), then the new rows
        window_rows, window_first = [], []
        for b, seq in enumerate(seqs):
            start = seq.next_position
            first = max(0, start - win + 1)
            window_rows.append((*_ring_rows(seq.window, first, start), kv[bounds[b]:bounds[b + 1]]))
            window_first.append(first)
        # The layer built the window rows and the selections itself, from a cache that `cache.check` validated on
        # the host (entries, keys and states match the positions): `candidate_indices`' device reads of `validate`
        # are not needed. The pool copies the ring views, so the rings are updated after it.
        pool, indices = pool_and_indices(window_rows, window_first, [s.compressed for s in seqs], selection,
                                         positions, bounds, win)
        for b, seq in enumerate(seqs):
            # the last min(n, win) new rows replace the ring rows of their positions mod win
            start, n = seq.next_position, bounds[b + 1] - bounds[b]
            keep = min(n, win)
            ring_views = _ring_rows(seq.window, start + n - keep, start + n)
            new_rows = kv[bounds[b + 1] - keep:bounds[b + 1]]
            for ring_view, rows in zip(ring_views, new_rows.split([v.shape[0] for v in ring_views])):
                ring_view.copy_(rows)
            seq.next_position = start + n
        return q, pool, indices

    def _indexer_selection(self, x: torch.Tensor, c_q: torch.Tensor, positions: torch.Tensor, bounds: list[int],
                           seqs: list[SequenceCache], rope: RopeTables) -> torch.Tensor:
        """CSA: index keys of the new tokens into the cache, then each token's top-k visible entries."""
        from optimized.triton import indexer as ti

        cfg, w, numerics = self.cfg, self.weights.indexer, self.numerics
        q_idx, head_weights = _indexer_q(self.backend, c_q, x, w, positions, self.freqs, numerics, rope=rope)
        new = compress_chunks(x, positions, bounds, [s.indexer_compressor for s in seqs], w.compressor,
                              freqs=self.freqs, numerics=numerics, rotate="indexer", norm_eps=cfg.norm_eps,
                              w_cat=self._w_cat_indexer)
        for seq, keys in zip(seqs, new):
            if keys.shape[0]:
                seq.indexer_keys = torch.cat((seq.indexer_keys, keys))
        n_visible = ((positions + 1) // INDEXER_RATIO).to(torch.int32)
        keys = [s.indexer_keys for s in seqs]
        lengths = [bounds[b + 1] - bounds[b] for b in range(len(seqs))]
        # Host-side from the cache (the tokens continue it: `check_continuation`): the most keys a token sees, and
        # where each token's sequence starts in the pooled keys; nothing here reads the device.
        max_len = max(((s.next_position + n) // INDEXER_RATIO for s, n in zip(seqs, lengths) if n), default=0)
        if self.indexer_backend == "deepgemm":
            from optimized.deepgemm import indexer as dgi

            decode = len(set(lengths)) == 1 and lengths[0] <= dgi.MAX_PAGED_NEXT_N
            if decode and lengths[0] > 0:
                logits = dgi.paged_mqa_logits(q_idx, keys, head_weights, n_visible.view(len(seqs), lengths[0]),
                                              max_len)
                return ti.topk_indices(logits, n_visible, cfg.index_topk)
        offsets = [0, *accumulate(k.shape[0] for k in keys)][:-1]
        k_start = _per_token([(offset,) for offset in offsets], bounds, x.device, torch.int32)[:, 0]
        pool = torch.cat(keys)
        if self.indexer_backend == "deepgemm":
            logits = dgi.mqa_logits(q_idx, pool, head_weights, k_start, k_start + n_visible, max_len)
        else:
            logits = ti.indexer_logits(q_idx, pool, head_weights, k_start, k_start + n_visible, max_len,
                                       round_bf16=numerics.indexer_scores_bf16, tokens_per_sequence=max(lengths))
        return ti.topk_indices(logits, n_visible, cfg.index_topk)
