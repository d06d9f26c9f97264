"""Parity cases of the attention ops (spec §3): sparse attention, indexer scores and top-k, compressor,
projections, and the whole layer, each through `optimized.<op>(..., backend=b)` against the reference.

  * sparse_attention — the same q, KV pool, index lists and sinks on both sides; index lists laid out by
    `reference.attention.candidate_indices` (window + selected entries of several sequences, -1 slots);
    KV as bf16 rows and as 584-byte FP8 cache rows (the kernel dequantizes in-kernel). Checks:
    `SPARSE_ATTENTION_SIMULATED` against the reference, FlashAttention's torch-relative rule against the
    formula with unrounded probabilities (fp64), and tokens without slots exactly 0.
  * indexer          — the same index queries, keys and head weights: scores (`INDEXER_SCORES_*`), and each
    side's top-k of its own scores against the reference's: sets equal except swaps at near ties (entries
    whose reference scores lie within the measured score error of the row's threshold), and the top-k of the
    reference scores themselves bitwise as sets. The deepgemm backend (FP8 logits) is compared in vLLM
    numerics (fp32 scores) under FP8_END_TO_END.
  * compress         — the prefill compressor on the same tokens (`COMPRESS_SIMULATED`), main (ratio 4 and 128,
    head 512) and indexer (ratio 4, head 128).
  * project_q / project_kv / indexer_q — the projections (`PROJECTION_SIMULATED`).
  * attention        — the layer: prefill of a batch of sequences of different lengths (prompts shorter than 4
    and than 4 * index_topk, positions crossing 3/4 and 31/32 at TINY), and decode steps continuing
    caches built by the reference (positions crossing 127/128, the HCA boundary, and 511/512). Per step: the
    output against the reference computed on the layer's own top-k selection (`ATTENTION_LAYER_SIMULATED`),
    the selection against the reference's as sets up to near ties (CSA), window / HCA indices bitwise.
TINY cases run on the CPU (Triton interpreter, both FP8 formats); FLASH and PRO cases need a GPU: prefill up
to 8192 tokens (the reference evaluated on a sample of the tokens where it would take minutes — every op here
is independent per token), decode of a batch of 64 sequences with contexts up to 32768 (synthetic caches).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

import torch

import optimized
from parity_tests.cases import FP8_FORMATS, Case, Check, NotRun, provider, require
from parity_tests.metrics import calc_diff, max_abs_error, worst_position
from parity_tests.tolerances import (
    ATTENTION_LAYER_SIMULATED,
    BITWISE,
    COMPRESS_INDEXER_SIMULATED,
    COMPRESS_SIMULATED,
    FP8_END_TO_END,
    INDEXER_SCORES_BF16,
    INDEXER_SCORES_FP32,
    PROJECTION_SIMULATED,
    SELECTION_NEAR_TIES,
    SPARSE_ATTENTION_SIMULATED,
    SPARSE_ATTENTION_TORCH_RELATIVE,
    Bound,
)
from reference import attention as ref
from reference import compressor as ref_comp
from reference import indexer as ref_idx
from reference.cache import AttentionCache as RefCache
from reference.cache import pack_kv
from reference.config import DSv4Config, get_config
from reference.einsum import output_projection
from reference.formats import quant_dequant_fp4, quant_dequant_fp8
from reference.numerics import OFFICIAL, VLLM_NVIDIA, Numerics
from reference.rope import yarn_frequencies

GPU_CONFIGS = ("FLASH", "PRO")
OPS = ("sparse_attention", "indexer", "compress", "project_q", "project_kv", "indexer_q", "attention")
# GPU cases evaluate the reference on at most this many tokens (sampled evenly, first and last included).
REFERENCE_TOKENS = 256


def _numerics(fmt: str, base: Numerics = OFFICIAL) -> Numerics:
    """The case's numerics: the optimized layer implements the FP8 `wo_a` (vLLM / DeepGEMM) output path."""
    return base.replace(fp8_format=fmt, wo_a="fp8")


def layer_of_kind(cfg: DSv4Config, kind: str) -> int:
    """The first layer of `kind` ("swa", "csa", "hca") of `cfg` (the MTP layer counts)."""
    return next(i for i in range(cfg.n_layers + 1) if cfg.layer_kind(i) == kind)


@dataclass(frozen=True)
class AttentionSpec:
    """One case.

    Attributes:
        op: one of `OPS`.
        config: "TINY", "FLASH" or "PRO".
        fmt: FP8 format.
        device: "cpu" or "cuda".
        kind: layer kind ("swa", "csa", "hca") the inputs come from.
        lengths: tokens per sequence of the call.
        starts: position of each sequence's first token (0 = a fresh prompt).
        variant: op-specific ("bf16" / "packed" rows, "official" / "vllm" numerics, "main" / "indexer", ...).
        steps: decode steps after the cache is built (attention decode cases).
    """

    op: str
    config: str
    fmt: str
    device: str
    kind: str
    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    variant: str = ""
    steps: int = 0

    @property
    def seed(self) -> int:
        return 4000 + sum(self.lengths) + 7 * sum(self.starts) + OPS.index(self.op)

    def label(self) -> str:
        parts = [self.kind, f"T={'+'.join(map(str, self.lengths)) if len(self.lengths) <= 4 else self.lengths[0]}"]
        if len(self.lengths) > 4:
            parts.append(f"B={len(self.lengths)}")
        if any(self.starts):
            lo, hi = min(self.starts), max(self.starts)
            parts.append(f"from={hi}" if lo == hi else f"from={lo}..{hi}")
        if self.variant:
            parts.append(self.variant)
        if self.steps:
            parts.append(f"steps={self.steps}")
        return ",".join(parts)

    def case(self) -> Case:
        backends = ("triton", "deepgemm")
        return Case(op=self.op, config=self.config, shape=self.label(), fmt=self.fmt, seed=self.seed,
                    device=self.device, run=functools.partial(_RUNNERS[self.op], self), backends=backends,
                    params={"kind": self.kind, "lengths": self.lengths, "starts": self.starts,
                            "variant": self.variant, "steps": self.steps})


# ------------------------------------------------------------------------------------------------
# The case matrix
# ------------------------------------------------------------------------------------------------


def _tiny_specs(op: str) -> list[AttentionSpec]:
    both = FP8_FORMATS
    s = functools.partial(AttentionSpec, op, "TINY", device="cpu")
    if op == "sparse_attention":
        # a prompt of 3 (shorter than 4: no compressed entry) and one crossing 3/4 and 7/8, window + top-k
        return [s(fmt, kind="csa", lengths=(3, 9), starts=(0, 0), variant=v) for fmt in both
                for v in ("bf16", "packed")] + [s("e4m3fn", kind="hca", lengths=(2,), starts=(300,), variant="packed")]
    if op == "indexer":
        return [s(fmt, kind="csa", lengths=(5, 30), starts=(0, 40), variant=v) for fmt, v in
                (("e4m3fn", "official"), ("e4m3fn", "vllm"))]
    if op == "compress":
        return [s(fmt, kind="csa", lengths=(13,), starts=(0,), variant="main") for fmt in both] + [
            s("e4m3fn", kind="csa", lengths=(13,), starts=(0,), variant="indexer"),
            s("e4m3fn", kind="hca", lengths=(130,), starts=(0,), variant="main")]
    if op in ("project_q", "indexer_q"):
        return [s("e4m3fn", kind="csa", lengths=(7,), starts=(125,))]
    if op == "project_kv":
        return [s(fmt, kind="csa", lengths=(7,), starts=(125,)) for fmt in both]
    # attention: prefill of prompts shorter than 4 and crossing 4 * index_topk = 32; decode crossing 127/128
    # (HCA) and 511/512 from reference-built caches
    return [s(fmt, kind=kind, lengths=(3, 35), starts=(0, 0)) for kind, fmt in
            (("csa", "e4m3fn"), ("swa", "e4m3fn"), ("hca", "e4m3fnuz"))] + [
        s("e4m3fn", kind=kind, lengths=(1, 1), starts=(126, 510), steps=3) for kind in ("csa", "hca")]


def _gpu_specs(op: str, config: str) -> list[AttentionSpec]:
    """FLASH / PRO cases. The reference runs in fp64 on the GPU (~60 TFLOP/s): ops that are independent per token
    evaluate it on a sample of the tokens; the projections, the compressor and the layer at 8192 tokens cost it
    tens of seconds each, so those run at the shapes the speed targets name (FLASH CSA) and smaller elsewhere."""
    s = functools.partial(AttentionSpec, op, config, "e4m3fn", "cuda")
    flash = config == "FLASH"
    decode_batch = 64
    mixed = tuple(int(c) for c in torch.linspace(1024, 32768, decode_batch).round().tolist())
    full = (32768,) * decode_batch
    if op == "sparse_attention":
        return [s(kind="csa", lengths=(t,), starts=(0,), variant="bf16") for t in (512, 4096, 8192)] + [
            s(kind=kind, lengths=(1,) * decode_batch, starts=ctx, variant="packed")
            for kind in ("csa", "hca") for ctx in (mixed, full)]
    if op == "indexer":
        return [s(kind="csa", lengths=(t,), starts=(0,), variant=v) for t in (4096, 8192)
                for v in ("official", "vllm")] + [
            s(kind="csa", lengths=(1,) * decode_batch, starts=full, variant="vllm")]
    if op == "compress":
        return [s(kind=kind, lengths=(t,), starts=(0,), variant=v) for kind, v, t in (
            ("csa", "main", 8192 if flash else 4096), ("csa", "indexer", 4096), ("hca", "main", 4096))]
    if op in ("project_q", "project_kv", "indexer_q"):
        return [s(kind="csa", lengths=(t,), starts=(0,)) for t in (64, 512)]
    prefill = [("csa", 512), ("csa", 8192 if flash else 4096), ("swa", 512), ("hca", 4096)]
    return [s(kind=kind, lengths=(t,), starts=(0,)) for kind, t in prefill] + [
        s(kind=kind, lengths=(1,) * decode_batch, starts=ctx, steps=1)
        for kind in ("csa", "hca") for ctx in (mixed, full)]


def _cases(op: str, config: str, device: str) -> list[Case]:
    name = config.upper()
    if name not in ("TINY", *GPU_CONFIGS):
        raise ValueError(f"config: expected TINY, FLASH or PRO, got {config!r}")
    specs = _tiny_specs(op) if name == "TINY" else _gpu_specs(op, name)
    return [spec.case() for spec in specs]


@provider("sparse_attention")
def sparse_attention_cases(config: str, device: str) -> list[Case]:
    """Sparse attention with sink on identical inputs (bf16 rows and packed FP8 cache rows)."""
    return _cases("sparse_attention", config, device)


@provider("indexer")
def indexer_cases(config: str, device: str) -> list[Case]:
    """Indexer scores and top-k selection on identical queries and keys."""
    return _cases("indexer", config, device)


@provider("compress")
def compress_cases(config: str, device: str) -> list[Case]:
    """The compressor's prefill form (main and indexer compressors)."""
    return _cases("compress", config, device)


@provider("project_q")
def project_q_cases(config: str, device: str) -> list[Case]:
    """Query projection (FP8 linears, per-head norm, RoPE)."""
    return _cases("project_q", config, device)


@provider("project_kv")
def project_kv_cases(config: str, device: str) -> list[Case]:
    """Window KV projection (FP8 linear, norm, RoPE, FP8 simulation of the NoPE dims)."""
    return _cases("project_kv", config, device)


@provider("indexer_q")
def indexer_q_cases(config: str, device: str) -> list[Case]:
    """Index queries (FP8 linear, RoPE, Hadamard, FP4 simulation) and head weights."""
    return _cases("indexer_q", config, device)


@provider("attention")
def attention_cases(config: str, device: str) -> list[Case]:
    """The whole layer: prefill of a batch of sequences, and decode steps from reference-built caches."""
    return _cases("attention", config, device)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def _require(spec: AttentionSpec, backend: str) -> None:
    """NotRun when this machine or backend cannot run the case."""
    require(spec.device, spec.fmt, backend)


def _generator(spec: AttentionSpec) -> torch.Generator:
    return torch.Generator(device=spec.device).manual_seed(spec.seed)


def _positions(spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64 and cu_seqlens [B + 1] int32 of the spec's sequences."""
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(spec.starts, spec.lengths)])
    cu = torch.tensor([0, *torch.tensor(spec.lengths).cumsum(0).tolist()], dtype=torch.int32)
    return positions.to(spec.device), cu.to(spec.device)


def _kv_rows(n: int, numerics: Numerics, g: torch.Generator, device: str) -> torch.Tensor:
    """[n, 512] bf16 rows like `project_kv`'s: RMS-normalized values, NoPE dims through the FP8 simulation."""
    rows = torch.randn((n, 512), generator=g, device=device).to(torch.bfloat16)
    if numerics.kv_fp8_sim:
        rows = torch.cat((quant_dequant_fp8(rows[:, :448], 64, numerics.fp8_format), rows[:, 448:]), dim=1)
    return rows


def _index_keys(n: int, numerics: Numerics, g: torch.Generator, device: str) -> torch.Tensor:
    """[n, 128] bf16 index keys like the indexer compressor's (FP4-simulated when the numerics say so)."""
    keys = torch.randn((n, 128), generator=g, device=device).to(torch.bfloat16)
    return quant_dequant_fp4(keys, 32) if numerics.indexer_fp4_sim else keys


def _attention_pool(
    spec: AttentionSpec, cfg: DSv4Config, numerics: Numerics, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer-like KV pool, index lists and positions: every sequence's window rows and compressed entries
    (random QD'd rows), each token's selection a random subset of its visible entries (CSA, top-k) or all of
    them (HCA), laid out by `reference.attention.candidate_indices`."""
    positions, cu = _positions(spec)
    ratio = cfg.compress_ratio(layer_of_kind(cfg, spec.kind))
    window_rows, window_first, compressed = [], [], []
    for start, n in zip(spec.starts, spec.lengths):
        first = max(0, start - cfg.window_size + 1)
        window_rows.append(_kv_rows(start + n - first, numerics, g, spec.device))
        window_first.append(first)
        compressed.append(_kv_rows((start + n) // ratio if ratio else 0, numerics, g, spec.device))
    width = max((c.shape[0] for c in compressed), default=0)
    visible = ref.visible_entries(positions, ratio, width) if ratio else positions.new_zeros(len(positions), 0)
    if spec.kind == "csa" and width:
        # a random top-k of the visible entries: random keys, invisible ones at -inf
        keys = torch.rand(visible.shape, generator=g, device=spec.device).masked_fill(visible < 0, -1.0)
        k = min(cfg.index_topk, width)
        chosen = keys.topk(k, dim=1)
        selection = torch.where(chosen.values >= 0, chosen.indices, -1).to(torch.int32)
    else:
        selection = visible
    kv, indices = ref.candidate_indices(window_rows, window_first, compressed, selection, positions, cu,
                                        cfg.window_size)
    return kv, indices, positions


def _sample_tokens(n_tokens: int, device: str) -> torch.Tensor:
    """Tokens the reference is evaluated on: all of them, or REFERENCE_TOKENS evenly spaced (first, last in)."""
    if n_tokens <= REFERENCE_TOKENS:
        return torch.arange(n_tokens, device=device)
    return torch.linspace(0, n_tokens - 1, REFERENCE_TOKENS, device=device).round().long().unique()


def _diff_check(name: str, bound: Bound, out: torch.Tensor, expected: torch.Tensor) -> Check:
    out, expected = out.float(), expected.float()
    return Check(name, bound, calc_diff(out, expected),
                 f"max_abs={max_abs_error(out, expected):.3g} at {worst_position(out, expected)}")


# ------------------------------------------------------------------------------------------------
# sparse_attention
# ------------------------------------------------------------------------------------------------


def unrounded_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The spec §3.5 formula in fp64 with unrounded probabilities: FlashAttention's high-precision oracle
    for the torch-relative rule (the reference rounds P to bf16, as the kernels do).

    Returns:
        [T, H, 512] fp64.
    """
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for start in range(0, q.shape[0], ref.ATTENTION_TOKEN_CHUNK):
        chunk = slice(start, start + ref.ATTENTION_TOKEN_CHUNK)
        valid = indices[chunk] >= 0
        rows = torch.cat((kv, kv.new_zeros(1, kv.shape[1])))[torch.where(valid, indices[chunk], kv.shape[0]).long()]
        z = torch.einsum("thd,tkd->thk", q[chunk].double(), rows.double()) * scale
        z = z.masked_fill(~valid[:, None, :], float("-inf"))
        m = z.amax(dim=-1)
        m = torch.where(torch.isneginf(m), 0.0, m)
        p = torch.exp(z - m[..., None])
        o = torch.einsum("thk,tkd->thd", p, rows.double())
        o = o / (p.sum(dim=-1) + torch.exp(sink.double()[None, :] - m))[..., None]
        out[chunk] = torch.where(valid.any(dim=-1)[:, None, None], o, 0.0)
    return out


def _run_sparse_attention(spec: AttentionSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    numerics = _numerics(spec.fmt)
    g = _generator(spec)
    kv, indices, _ = _attention_pool(spec, cfg, numerics, g)
    t = indices.shape[0]
    q = torch.randn((t, cfg.n_heads, cfg.head_dim), generator=g, device=spec.device).to(torch.bfloat16)
    sink = torch.randn(cfg.n_heads, generator=g, device=spec.device)
    if spec.device == "cpu":
        indices[0, :] = -1  # a token without any slot (a padding token): defined as 0
    scale = cfg.head_dim**-0.5
    rows = pack_kv(kv, spec.fmt) if spec.variant == "packed" else kv
    out = optimized.sparse_attention(q, rows, indices, sink, scale, fmt=spec.fmt, backend=backend)
    sample = _sample_tokens(t, spec.device)
    expected = ref.sparse_attention(q[sample], kv, indices[sample], sink, scale)
    oracle = unrounded_attention(q[sample], kv, indices[sample], sink, scale)
    got = out[sample]
    reference_error = max_abs_error(expected, oracle)
    # floor: half a bf16 ulp of the largest output, what the output rounding alone costs
    floor = 2.0 ** (math.floor(math.log2(max(float(oracle.abs().max()), 1e-30))) - 8)
    ratio = max_abs_error(got, oracle) / max(reference_error, floor)
    empty = (indices < 0).all(dim=1)
    checks = [_diff_check("vs reference, same inputs", SPARSE_ATTENTION_SIMULATED, got, expected),
              Check("max error vs unrounded-P fp64 / reference's", SPARSE_ATTENTION_TORCH_RELATIVE, ratio,
                    f"reference error {reference_error:.3g}")]
    if bool(empty.any()):
        checks.append(Check("tokens without slots are exactly 0", BITWISE, float((out[empty] != 0).sum())))
    return checks


# ------------------------------------------------------------------------------------------------
# indexer: scores and top-k
# ------------------------------------------------------------------------------------------------


def _near_tie_violations(selected: torch.Tensor, expected: torch.Tensor, ref_scores: torch.Tensor,
                         allowance: torch.Tensor) -> float:
    """Tokens whose selected set differs from the reference's beyond near ties.

    An entry in one set but not the other is a near tie when its reference score lies within `allowance[t]`
    of the reference's k-th largest visible score of that token (both sides' scores of such entries can
    cross over by the score error). Sets are compared as sets (order and -1 padding ignored).
    """
    width = max(selected.shape[1], expected.shape[1])
    selected, expected = (torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in (selected, expected))
    same = (selected.sort(dim=1).values == expected.sort(dim=1).values).all(dim=1)
    rows = (~same).nonzero().flatten().tolist()  # only tokens whose sets differ are looked at one by one
    selected, expected, ref_scores, allowance = (t.cpu() for t in (selected, expected, ref_scores, allowance))
    bad = 0
    for t in rows:
        a = {int(i) for i in selected[t] if i >= 0}
        b = {int(i) for i in expected[t] if i >= 0}
        if a == b:
            continue
        if len(a) != len(b):
            bad += 1
            continue
        threshold = float(ref_scores[t, list(b)].min())
        if any(abs(float(ref_scores[t, j]) - threshold) > float(allowance[t]) for j in a ^ b):
            bad += 1
    return float(bad)


def _run_indexer(spec: AttentionSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    numerics = _numerics(spec.fmt, OFFICIAL if spec.variant == "official" else VLLM_NVIDIA)
    if backend == "deepgemm":
        if numerics.indexer_scores_bf16:
            raise NotRun("DeepGEMM's FP8 logits are fp32: compared in vLLM numerics (the 'vllm' cases)")
        if cfg.index_n_heads not in (32, 64):
            raise NotRun("DeepGEMM's SM90 MQA logits need 32 or 64 index heads")
    g = _generator(spec)
    positions, _ = _positions(spec)
    n_keys = int(positions.max()) + 1 if positions.numel() else 0
    n_keys //= ref_idx.INDEXER_RATIO
    t = positions.shape[0]
    q = torch.randn((t, cfg.index_n_heads, cfg.index_head_dim), generator=g, device=spec.device)
    q = quant_dequant_fp4(q.to(torch.bfloat16), 32) if numerics.indexer_fp4_sim else q.to(torch.bfloat16)
    keys = _index_keys(n_keys, numerics, g, spec.device)
    head_weights = torch.randn((t, cfg.index_n_heads), generator=g, device=spec.device)
    head_weights = head_weights * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
    if numerics.indexer_scores_bf16:
        head_weights = head_weights.to(torch.bfloat16).float()
    n_visible = (positions + 1) // ref_idx.INDEXER_RATIO
    sample = _sample_tokens(t, spec.device)
    scores = optimized.indexer_scores(q, keys, head_weights, numerics, backend=backend)
    expected = ref_idx.indexer_scores(q[sample], keys, head_weights[sample], numerics)
    got = scores[sample]
    visible = torch.arange(n_keys, device=spec.device)[None, :] < n_visible[sample, None]
    bound = FP8_END_TO_END if backend == "deepgemm" else (
        INDEXER_SCORES_BF16 if numerics.indexer_scores_bf16 else INDEXER_SCORES_FP32)
    checks = [_diff_check("scores vs reference (visible entries)", bound, got[visible], expected[visible])]

    selected = optimized.indexer_topk(scores, n_visible, cfg.index_topk, backend=backend)[sample]
    expected_sel = ref_idx.indexer_topk(expected, n_visible[sample], cfg.index_topk)
    error = torch.where(visible, (got - expected).abs(), 0.0).amax(dim=1) if n_keys else n_visible[sample] * 0.0
    checks.append(Check("top-k of own scores = reference's, up to near ties", SELECTION_NEAR_TIES,
                        _near_tie_violations(selected, expected_sel, expected, 2 * error)))
    same_scores = optimized.indexer_topk(expected, n_visible[sample], cfg.index_topk, backend=backend)
    checks.append(Check("top-k of the reference scores: same sets", BITWISE,
                        _near_tie_violations(same_scores, expected_sel, expected, torch.zeros_like(error))))
    return checks


# ------------------------------------------------------------------------------------------------
# compress and the projections
# ------------------------------------------------------------------------------------------------


def _layer_weights(spec: AttentionSpec, cfg: DSv4Config, g: torch.Generator) -> tuple[int, ref.AttentionWeights]:
    """Random weights of the spec's layer kind, drawn on the CPU with the case's seed (then moved)."""
    layer_id = layer_of_kind(cfg, spec.kind)
    cpu = torch.Generator().manual_seed(spec.seed)
    del g
    return layer_id, ref.random_attention_weights(cfg, layer_id, fmt=spec.fmt, generator=cpu, device=spec.device)


def _tokens(spec: AttentionSpec, cfg: DSv4Config, g: torch.Generator) -> torch.Tensor:
    return torch.randn((sum(spec.lengths), cfg.dim), generator=g, device=spec.device).to(torch.bfloat16)


def _run_compress(spec: AttentionSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    numerics = _numerics(spec.fmt)
    g = _generator(spec)
    layer_id, weights = _layer_weights(spec, cfg, g)
    w = weights.compressor if spec.variant == "main" else weights.indexer.compressor
    x = _tokens(spec, cfg, g)
    positions, _ = _positions(spec)
    freqs = yarn_frequencies(cfg, cfg.compress_ratio(layer_id)).to(spec.device)
    kwargs = dict(ratio=w.ratio, head_dim=w.head_dim, freqs=freqs, numerics=numerics, rotate=spec.variant,
                  norm_eps=cfg.norm_eps)
    out = optimized.compress(x, positions, w, backend=backend, **kwargs)
    expected = ref_comp.compress(x, positions, w, **kwargs)
    bound = COMPRESS_INDEXER_SIMULATED if spec.variant == "indexer" else COMPRESS_SIMULATED
    return [_diff_check("vs reference, same tokens", bound, out, expected)]


def _run_projection(spec: AttentionSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    numerics = _numerics(spec.fmt)
    g = _generator(spec)
    layer_id, w = _layer_weights(spec, cfg, g)
    x = _tokens(spec, cfg, g)
    positions, _ = _positions(spec)
    freqs = yarn_frequencies(cfg, cfg.compress_ratio(layer_id)).to(spec.device)
    if spec.op == "project_kv":
        out = optimized.project_kv(x, w, cfg, positions, freqs, numerics, backend=backend)
        return [_diff_check("kv vs reference", PROJECTION_SIMULATED, out,
                            ref.project_kv(x, w, cfg, positions, freqs, numerics))]
    q, c_q = optimized.project_q(x, w, cfg, positions, freqs, numerics, backend=backend)
    rq, rc_q = ref.project_q(x, w, cfg, positions, freqs, numerics)
    if spec.op == "project_q":
        return [_diff_check("q vs reference", PROJECTION_SIMULATED, q, rq),
                _diff_check("c_q vs reference", PROJECTION_SIMULATED, c_q, rc_q)]
    # indexer_q on the reference's c_q, so that only this op's differences show
    q_idx, head_weights = optimized.indexer_q(rc_q, x, w.indexer, positions, freqs, numerics, backend=backend)
    rq_idx, rhead_weights = ref_idx.indexer_q(rc_q, x, w.indexer, positions, freqs, numerics)
    return [_diff_check("index queries vs reference", PROJECTION_SIMULATED, q_idx, rq_idx),
            _diff_check("head weights vs reference", PROJECTION_SIMULATED, head_weights, rhead_weights)]


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------


def synthetic_cache(cfg: DSv4Config, layer_id: int, contexts: tuple[int, ...], numerics: Numerics,
                    g: torch.Generator, device: str) -> RefCache:
    """A reference cache as if each sequence had seen `contexts[b]` tokens, with random contents of the right
    statistics (RMS-normalized rows through the FP8 simulation, FP4-simulated index keys, compressor states
    holding the current block's tokens) — for decode cases at contexts a prefill would take too long to build."""
    cache = RefCache.empty(cfg, layer_id, len(contexts), device)
    win = cfg.window_size
    for seq, context in zip(cache.sequences, contexts):
        seq.next_position = context
        n_window = min(context, win)
        positions = torch.arange(context - n_window, context, device=device)
        seq.window[positions % win] = _kv_rows(n_window, numerics, g, device)
        if cache.ratio:
            seq.compressed = _kv_rows(context // cache.ratio, numerics, g, device)
        states = [(seq.compressor, cfg.head_dim)]
        if cache.kind == "csa":
            seq.indexer_keys = _index_keys(context // cache.ratio, numerics, g, device)
            states.append((seq.indexer_compressor, cfg.index_head_dim))
        for state, _ in (st for st in states if st[0] is not None):
            coff = ref_comp.overlap_factor(cache.ratio)
            current = (coff - 1) * cache.ratio
            filled = (list(range(cache.ratio)) if coff == 2 and context >= cache.ratio else []) + list(
                range(current, current + context % cache.ratio))
            rows = torch.tensor(filled, dtype=torch.long, device=device)
            state.kv[rows] = torch.randn((len(filled), state.kv.shape[1]), generator=g, device=device)
            state.score[rows] = torch.randn((len(filled), state.kv.shape[1]), generator=g, device=device)
            state.next_position = context
    return cache


def _index_scores(layer: ref.Attention | optimized.Attention, x: torch.Tensor, positions: torch.Tensor,
                  backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One side's index queries and head weights (`backend` None: the reference's), as its layer computes them."""
    cfg, w, numerics = layer.cfg, layer.weights, layer.numerics
    if backend is None:
        _, c_q = ref.project_q(x, w, cfg, positions, layer.freqs, numerics)
        return ref_idx.indexer_q(c_q, x, w.indexer, positions, layer.freqs, numerics)
    _, c_q = optimized.project_q(x, w, cfg, positions, layer.freqs, numerics, backend=backend)
    return optimized.indexer_q(c_q, x, w.indexer, positions, layer.freqs, numerics, backend=backend)


def _selection_check(reference: ref.Attention, layer: optimized.Attention, x: torch.Tensor, positions: torch.Tensor,
                     bounds: list[int], ref_cache: RefCache, cache: optimized.AttentionCache, ref_indices: torch.Tensor,
                     indices: torch.Tensor) -> Check:
    """CSA: the layer's top-k sets against the reference's, as sets, up to swaps at near ties.

    Upstream of the indexer the two layers differ by GEMM-order roundings that the FP4 simulation of the index
    queries amplifies (PROJECTION_SIMULATED), so their scores differ by more than on identical inputs (the
    `indexer` cases). The allowance of a token is therefore the score difference its own inputs explain:
    2 x max |s_layer - s_reference| over its visible entries, both scored by the reference formula (the
    scores kernel itself is checked on identical inputs by the `indexer` cases). Entries are recovered from
    the pool indices: within a sequence, pool row = entry + a per-sequence offset.
    """
    win, k, numerics = reference.cfg.window_size, reference.cfg.index_topk, reference.numerics
    rq, rw = _index_scores(reference, x, positions, None)
    oq, ow = _index_scores(layer, x, positions, layer.backend)
    bad = 0.0
    for b, (ref_seq, seq) in enumerate(zip(ref_cache.sequences, cache.sequences)):
        tokens = slice(bounds[b], bounds[b + 1])
        n_visible = (positions[tokens] + 1) // ref_idx.INDEXER_RATIO
        expected_scores = ref_idx.indexer_scores(rq[tokens], ref_seq.indexer_keys, rw[tokens], numerics)
        own_scores = ref_idx.indexer_scores(oq[tokens], seq.indexer_keys, ow[tokens], numerics)
        expected = ref_idx.indexer_topk(expected_scores, n_visible, k)
        if not expected.numel() or bool((expected < 0).all()):
            continue
        mapped = ref_indices[tokens, win:]
        valid = expected >= 0
        offset = int((mapped[valid] - expected[valid]).flatten()[0])
        selected = torch.where(indices[tokens, win:] >= 0, indices[tokens, win:] - offset, -1)
        visible = torch.arange(expected_scores.shape[1], device=x.device)[None, :] < n_visible[:, None]
        error = torch.where(visible, (own_scores - expected_scores).abs(), 0.0).amax(dim=1)
        bad += _near_tie_violations(selected, expected, expected_scores, 2 * error)
    return Check("top-k sets vs reference, up to near ties", SELECTION_NEAR_TIES, bad)


def _layer_step(reference: ref.Attention, layer: optimized.Attention, x: torch.Tensor, positions: torch.Tensor,
                cu: torch.Tensor, ref_cache: RefCache, cache: optimized.AttentionCache, what: str) -> list[Check]:
    """One call of both layers on the same tokens and cache states (caches updated).

    The layer's output is compared with the reference's computation *on the layer's own compressed selection*
    (ATTENTION_LAYER_SIMULATED), and, on CSA layers, that selection with the reference's (near ties allowed):
    the top-k of the FP4-simulated index scores may legitimately swap entries at the cut, and a swapped entry
    moves a token's output by far more than any rounding does, so a direct output comparison could not tell a
    legitimate swap from a bug. The window columns and the HCA columns must agree exactly (BITWISE).
    """
    snapshot = copy.deepcopy(cache)
    out = layer(x, positions, cu, cache)
    _, _, indices = layer.attention_inputs(x, positions, cu, snapshot)
    q, kv, ref_indices = reference.attention_inputs(x, positions, cu, ref_cache)
    win = reference.cfg.window_size
    same = ref_indices if reference.kind != "csa" else ref_indices[:, :win]
    differing = float((indices[:, :same.shape[1]] != same).any(dim=1).sum()) if same.numel() else 0.0
    checks = [Check(f"window{'' if reference.kind == 'csa' else ' and compressed'} indices = reference's", BITWISE,
                    differing)]
    on_selection = torch.cat((ref_indices[:, :win], indices[:, win:]), dim=1)
    w = reference.weights
    o = ref.sparse_attention(q, kv, on_selection, w.attn_sink, reference.softmax_scale)
    expected = output_projection(o, positions, reference.freqs, w.wo_a, w.wo_b, reference.numerics)
    checks.append(_diff_check(f"{what} vs reference on the layer's selection", ATTENTION_LAYER_SIMULATED, out,
                              expected))
    if reference.kind == "csa":
        checks.append(_selection_check(reference, layer, x, positions, cu.tolist(), ref_cache, snapshot, ref_indices,
                                       indices))
    return checks


def _run_attention(spec: AttentionSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    numerics = _numerics(spec.fmt)
    g = _generator(spec)
    layer_id, w = _layer_weights(spec, cfg, g)
    reference = ref.Attention(cfg, layer_id, w, numerics)
    layer = optimized.Attention(cfg, layer_id, w, numerics, backend=backend)
    batch = len(spec.lengths)
    if not spec.steps:
        # prefill: fresh prompts (empty caches, so that both sides' index keys can be read afterwards)
        x = _tokens(spec, cfg, g)
        positions, cu = _positions(spec)
        ref_cache = RefCache.empty(cfg, layer_id, batch, spec.device)
        cache = optimized.AttentionCache.empty(cfg, layer_id, batch, spec.device, packed=numerics.kv_fp8_sim)
        return _layer_step(reference, layer, x, positions, cu, ref_cache, cache, "layer (prefill)")
    # decode: a reference cache at the start positions (a reference prefill at TINY, synthetic on the GPU),
    # the same state in the optimized layout, then `steps` steps of one token per sequence on both
    if spec.device == "cpu":
        ref_cache = RefCache.empty(cfg, layer_id, len(spec.starts), spec.device)
        prompt = AttentionSpec(spec.op, spec.config, spec.fmt, spec.device, spec.kind, spec.starts,
                               (0,) * len(spec.starts))
        positions, cu = _positions(prompt)
        reference(_tokens(prompt, cfg, g), positions, cu, ref_cache)
    else:
        ref_cache = synthetic_cache(cfg, layer_id, spec.starts, numerics, g, spec.device)
    cache = optimized.AttentionCache.from_reference(ref_cache, packed=numerics.kv_fp8_sim, fmt=spec.fmt)
    checks = []
    starts = torch.tensor(spec.starts, device=spec.device)
    cu = torch.arange(len(spec.starts) + 1, dtype=torch.int32, device=spec.device)
    for step in range(spec.steps):
        x = torch.randn((len(spec.starts), cfg.dim), generator=g, device=spec.device).to(torch.bfloat16)
        checks += _layer_step(reference, layer, x, starts + step, cu, ref_cache, cache, f"decode step {step}")
    return checks


_RUNNERS = {
    "sparse_attention": _run_sparse_attention,
    "indexer": _run_indexer,
    "compress": _run_compress,
    "project_q": _run_projection,
    "project_kv": _run_projection,
    "indexer_q": _run_projection,
    "attention": _run_attention,
}
