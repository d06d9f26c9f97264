"""DSv4's MoE layer, optimized (spec §5): `route`, `experts`, `moe` and the `MoE` module, with the
signatures of `reference.moe` plus `backend=`.

Backends:
  * `triton`    — every step in Triton (`optimized.triton.moe_pipeline`): routing, permute, grouped
                  block-FP8 GEMMs with the SwiGLU epilogue fused, combine. Any FP8 format, act_block 128
                  or 32, and EXACT numerics (bf16 activations, fp32 products).
  * `deepgemm`  — DeepGEMM's grouped GEMMs (`optimized.deepgemm.moe`; masked for decode token counts,
                  contiguous for prefill) with the Triton routing, permute, SwiGLU and combine kernels.
                  e4m3fn, act_block 128, FP8 activations only (SM90 DeepGEMM).
  * `reference` — `reference.moe`.

Checks happen here, before any kernel: types, shapes, dtypes, devices, contiguity, formats. The value
checks the reference makes (token ids inside the vocabulary, expert ids inside [-1, E)) read one flag
back from the device, on the calls that take ids from the caller: `experts`, and `route` / `moe` of a
hash layer. A non-hash `moe` takes its ids from its own router and reads nothing back.

Tiled experts (`tile_experts` -> `TiledFp8Weight`, triton backend only): the same FP8 values and scales stored one
128 x 128 weight block after another, so each K step of a Triton GEMM tile reads one 16 KB run instead of 128 runs
of 128 bytes 4 KB apart (design note 24), the blocks K-block-major (design note 28). `MoE(...)` tiles its routed
experts at construction on NVIDIA GPUs.

MXFP4 experts (the checkpoint format) run on the FP8 kernels after a lossless re-encode to 128x128
block FP8 (`Fp4Weight.to_fp8`, spec §2.6; SM90 has no FP4 MMA). The re-encoded weight is cached per
weight object and format (`fp8_experts`), so only the first call pays for it; `MoE(...)` does it at
construction. The cache holds the FP8 copy (twice the FP4 bytes) for as long as the FP4 weight lives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from optimized.backends import checking_values, detect, register, select
from reference.config import DSv4Config
from reference.formats import FP8Format, fp8_format
from reference.moe import MoEWeights
from reference.numerics import OFFICIAL, Numerics
from reference.weights import FP8_WEIGHT_BLOCK, Fp4Weight, Fp8Weight


@dataclass(frozen=True)
class TiledFp8Weight:
    """Stacked FP8 expert weights of logical shape [E, N, K], stored one 128 x 128 weight block after another
    (`tile_experts`): the triton backend's layout for the routed experts; DeepGEMM and the reference read rows.

    Attributes:
        data: [E, N / 128, K / 128, 128, 128] FP8; data[e, i, j] is rows 128 i .. 128 i + 127, columns
            128 j .. 128 j + 127 of expert e (row-major inside the block). Each block is contiguous; the blocks are
            stored in either order: contiguous (N-block-major), or K-block-major (`tile_experts`: the view
            `[E, K / 128, N / 128, 128, 128].permute(0, 2, 1, 3, 4)` of a contiguous tensor).
        scale: [E, N / 128, K / 128] fp32, block (i, j)'s scale (as `Fp8Weight.scale`).
    """

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        fp8_format(self.data.dtype)  # raises on a non-FP8 dtype
        b = FP8_WEIGHT_BLOCK
        if self.data.dim() != 5 or tuple(self.data.shape[3:]) != (b, b):
            raise ValueError(f"data: expected [E, N / {b}, K / {b}, {b}, {b}] FP8 blocks, got {tuple(self.data.shape)}")
        if not (self.data.is_contiguous() or self.data.transpose(1, 2).is_contiguous()):
            raise ValueError(f"data: expected contiguous blocks, N-block-major (contiguous) or K-block-major (a "
                             f"transposed view of dims 1, 2), got strides {tuple(self.data.stride())}")
        if tuple(self.scale.shape) != tuple(self.data.shape[:3]) or self.scale.dtype != torch.float32:
            raise ValueError(f"scale: expected {tuple(self.data.shape[:3])} fp32 (one per block of data), got "
                             f"{tuple(self.scale.shape)} {self.scale.dtype}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """Logical shape [E, N, K]."""
        e, n_blocks, k_blocks, rows, cols = self.data.shape
        return (e, n_blocks * rows, k_blocks * cols)


ExpertWeight = Fp8Weight | Fp4Weight | TiledFp8Weight

_TRITON = "optimized.triton.moe_pipeline"
_DEEPGEMM = "optimized.deepgemm.moe"
_GLUE = "Triton kernel (DeepGEMM has none)"
register("route", "triton", f"{_TRITON}:route")
register("route", "deepgemm", f"{_TRITON}:route", note=_GLUE)
register("route", "reference", "reference.moe:route")
for _op in ("experts", "moe"):
    register(_op, "triton", f"{_TRITON}:{_op}")
    register(_op, "deepgemm", f"{_DEEPGEMM}:{_op}",
             note="DeepGEMM grouped GEMMs (masked at decode sizes, contiguous above); routing, permute, SwiGLU "
                  "and combine in Triton")
    register(_op, "reference", f"reference.moe:{_op}")


# ------------------------------------------------------------------------------------------------
# MXFP4 -> FP8 re-encode cache
# ------------------------------------------------------------------------------------------------

_FP8_CACHE: dict[tuple[int, str], tuple[weakref.ref[Fp4Weight], Fp8Weight]] = {}


def fp8_expert_weight(weight: ExpertWeight, fmt: str | FP8Format, cache: bool = True) -> Fp8Weight | TiledFp8Weight:
    """`weight` as 128x128 block FP8 in `fmt`: FP8 weights (rows or tiled) as they are; MXFP4 ones re-encoded
    losslessly (spec §2.6), once per weight object and format (cached while the FP4 weight is alive; `cache=False`
    uses a cached copy but does not keep a new one)."""
    if isinstance(weight, (Fp8Weight, TiledFp8Weight)):
        return weight
    name = fp8_format(fmt).name
    key = (id(weight), name)
    hit = _FP8_CACHE.get(key)
    if hit is not None and hit[0]() is weight:
        return hit[1]
    encoded = weight.to_fp8(name)
    if cache:
        _FP8_CACHE[key] = (weakref.ref(weight, lambda _, key=key: _FP8_CACHE.pop(key, None)), encoded)
    return encoded


def fp8_experts(w13: ExpertWeight, w2: ExpertWeight,
                fmt: str | FP8Format) -> tuple[Fp8Weight | TiledFp8Weight, Fp8Weight | TiledFp8Weight]:
    """Both expert weights through `fp8_expert_weight`."""
    return fp8_expert_weight(w13, fmt), fp8_expert_weight(w2, fmt)


def tile_experts(weight: Fp8Weight | Fp4Weight, fmt: str | FP8Format) -> TiledFp8Weight:
    """Stacked [E, N, K] expert weights in the tiled layout (`TiledFp8Weight`): a copy, made once at load time.

    The blocks are stored K-block-major ([E, K / 128, N / 128, 128, 128] in memory): at each K step the adjacent
    column tiles of an expert read neighbouring blocks (design notes 26 and 28: routed MoE T = 1 1.0-1.9 % faster
    than the N-block-major order on an H100, T = 64 0.2-0.8 % slower).

    MXFP4 weights are re-encoded to FP8 in `fmt` first (losslessly, spec §2.6): `fp8_expert_weight`'s cached copy
    where there is one (`MoE` makes it anyway; at PRO a second one would not fit an 80 GB GPU beside it and the
    tiles), else a re-encode freed after tiling; FP8 weights must be in `fmt` already. N and K must be multiples of
    128.
    """
    if not isinstance(weight, (Fp8Weight, Fp4Weight)):
        raise TypeError(f"weight: expected Fp8Weight or Fp4Weight, got {type(weight).__name__}")
    if len(weight.shape) != 3 or weight.shape[1] % FP8_WEIGHT_BLOCK or weight.shape[2] % FP8_WEIGHT_BLOCK:
        raise ValueError(f"weight: expected stacked [E, N, K] experts with N, K multiples of {FP8_WEIGHT_BLOCK}, "
                         f"got logical shape {tuple(weight.shape)}")
    name = fp8_format(fmt).name
    fp8 = fp8_expert_weight(weight, name, cache=False)
    if fp8.data.dtype != fp8_format(name).dtype:
        raise ValueError(f"weight: FP8 data in {fp8.data.dtype}, expected {name!r} (fmt)")
    e, n, k = fp8.data.shape
    b = FP8_WEIGHT_BLOCK
    data = fp8.data.view(e, n // b, b, k // b, b).permute(0, 3, 1, 2, 4).contiguous()  # [E, K / b, N / b, b, b]
    return TiledFp8Weight(data.transpose(1, 2), fp8.scale.contiguous())


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {t.dtype} on {t.device}"
    return type(t).__name__


def _check_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (x's device), got one on {t.device}")
    return t


def _check_x(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected [T, D] bf16, got {_describe(x)}")
    if x.shape[1] % FP8_WEIGHT_BLOCK:
        raise ValueError(f"x: D = {x.shape[1]} must be a multiple of {FP8_WEIGHT_BLOCK} (the FP8 block)")
    if x.stride(1) != 1:
        raise ValueError(f"x: the last dim must be contiguous (stride 1), got strides {tuple(x.stride())}")
    return x


def _check_router(x: torch.Tensor, gate_weight: object, bias: object, token_ids: object, tid2eid: object,
                  cfg: DSv4Config) -> bool:
    """Router inputs (and, on hash layers, the id values); returns whether tid2eid rows of these tokens repeat
    an expert id."""
    if not isinstance(cfg, DSv4Config):
        raise TypeError(f"cfg: expected DSv4Config, got {type(cfg).__name__}")
    n_experts, topk = cfg.n_routed_experts, cfg.n_activated_experts
    gate_weight = _check_tensor("gate_weight", gate_weight, x.device)
    if tuple(gate_weight.shape) != (n_experts, x.shape[1]):
        raise ValueError(f"gate_weight: expected shape {(n_experts, x.shape[1])} (n_routed_experts, D), "
                         f"got {tuple(gate_weight.shape)}")
    if gate_weight.dtype != torch.bfloat16 or gate_weight.stride(1) != 1:
        raise ValueError(f"gate_weight: expected bf16 with a contiguous last dim, got {gate_weight.dtype}, "
                         f"strides {tuple(gate_weight.stride())}")
    if not 0 < topk <= n_experts:
        raise ValueError(f"cfg: n_activated_experts = {topk} must lie in [1, n_routed_experts = {n_experts}]")
    if tid2eid is None:
        if bias is None:
            raise ValueError(f"bias: a non-hash layer needs [{n_experts}] fp32, got None")
        bias = _check_tensor("bias", bias, x.device)
        if tuple(bias.shape) != (n_experts,) or bias.dtype != torch.float32 or bias.stride(0) != 1:
            raise ValueError(f"bias: a non-hash layer needs [{n_experts}] fp32 (contiguous), got {_describe(bias)}")
        return False
    if bias is not None:
        raise ValueError("bias: hash layers (tid2eid given) have no selection bias; pass bias=None")
    tid2eid = _check_tensor("tid2eid", tid2eid, x.device)
    if (tid2eid.dim() != 2 or tid2eid.shape[1] != topk or tid2eid.dtype not in (torch.int32, torch.int64)
            or tid2eid.stride(1) != 1):
        raise ValueError(f"tid2eid: expected [vocab, {topk}] int32/int64 with a contiguous last dim, "
                         f"got {_describe(tid2eid)}")
    if token_ids is None:
        raise ValueError("token_ids: hash layers route by token id; got None")
    token_ids = _check_tensor("token_ids", token_ids, x.device)
    if tuple(token_ids.shape) != (x.shape[0],) or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_ids: expected [{x.shape[0]}] int32/int64, got {_describe(token_ids)}")
    if token_ids.numel() == 0 or not checking_values(token_ids):
        return False  # under CUDA-graph capture: routing tables hold distinct ids per row
    vocab = tid2eid.shape[0]
    bad_token = ((token_ids < 0) | (token_ids >= vocab)).any()
    rows = tid2eid[token_ids.clamp(0, max(vocab - 1, 0)).long()]
    bad_expert = ((rows < 0) | (rows >= n_experts)).any()
    token_bad, expert_bad, repeated = torch.stack((bad_token, bad_expert, _rows_repeat(rows))).tolist()  # one read
    if token_bad:
        raise ValueError(f"token_ids: every id must be in [0, {vocab}) (the rows of tid2eid)")
    if expert_bad:
        raise ValueError(f"tid2eid: rows of these tokens hold expert ids outside [0, {n_experts})")
    return bool(repeated)


def _check_weight(name: str, w: object, shape: tuple[int, ...], device: torch.device, numerics: Numerics,
                  allow_fp4: bool) -> None:
    """An `Fp8Weight` (in numerics' FP8 format) or, where allowed (routed experts), `Fp4Weight` or `TiledFp8Weight` of
    logical `shape` on `device`."""
    allowed = (Fp8Weight, Fp4Weight, TiledFp8Weight) if allow_fp4 else (Fp8Weight,)
    if not isinstance(w, allowed):
        raise TypeError(f"{name}: expected {' or '.join(t.__name__ for t in allowed)}, got {type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(w.shape)}")
    if shape[-2] % FP8_WEIGHT_BLOCK or shape[-1] % FP8_WEIGHT_BLOCK:
        raise ValueError(f"{name}: dims {shape[-2:]} must be multiples of {FP8_WEIGHT_BLOCK} (the FP8 weight block)")
    parts = {"packed": w.packed, "scale": w.scale} if isinstance(w, Fp4Weight) else {"data": w.data, "scale": w.scale}
    for part, t in parts.items():
        if t.device != device:
            raise ValueError(f"{name}.{part}: expected a tensor on {device} (x's device), got one on {t.device}")
        if part == "data" and isinstance(w, TiledFp8Weight):
            continue  # the block order is checked by TiledFp8Weight itself
        if not t.is_contiguous():
            raise ValueError(f"{name}.{part}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if not isinstance(w, Fp4Weight) and w.data.dtype != fp8_format(numerics.fp8_format).dtype:
        raise ValueError(f"{name}: FP8 weights in {w.data.dtype} do not match numerics.fp8_format "
                         f"{numerics.fp8_format!r} (the activations' format)")


def _check_expert_pair(x: torch.Tensor, w13: object, w2: object, numerics: Numerics) -> int:
    """The routed experts' [E, 2I, D] and [E, D, I] weights; returns E."""
    if not isinstance(w13, (Fp8Weight, Fp4Weight, TiledFp8Weight)):
        raise TypeError(f"w13: expected Fp8Weight, Fp4Weight or TiledFp8Weight, got {type(w13).__name__}")
    if len(w13.shape) != 3:
        raise ValueError(f"w13: expected a stacked [E, 2I, D] weight, got logical shape {tuple(w13.shape)}")
    n_experts, two_inter, dim = w13.shape[0], w13.shape[1], x.shape[1]
    _check_weight("w13", w13, (n_experts, two_inter, dim), x.device, numerics, True)
    _check_weight("w2", w2, (n_experts, dim, two_inter // 2), x.device, numerics, True)
    if type(w13) is not type(w2):
        raise TypeError(f"w13, w2: expected the same format, got {type(w13).__name__} and {type(w2).__name__}")
    return n_experts


def tiling_helps(device: torch.device) -> bool:
    """Whether `MoE` tiles its routed experts on `device`: NVIDIA GPUs, where it was measured (design note 24)."""
    return device.type == "cuda" and detect().device == "cuda"


def _check_tiled_backend(backend: str, w13: object) -> None:
    """`TiledFp8Weight` experts run on the triton backend only (DeepGEMM and the reference read [E, N, K] rows)."""
    if isinstance(w13, TiledFp8Weight) and backend != "triton":
        raise TypeError(f"w13: TiledFp8Weight experts run on the triton backend only, got backend {backend!r}; pass "
                        "the Fp8Weight they were tiled from")


def _rows_repeat(ids: torch.Tensor) -> torch.Tensor:
    """0-d bool: some row of [T, k] `ids` names an expert (>= 0) twice."""
    ordered = ids.sort(dim=1).values
    return ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()


def _check_numerics(numerics: object) -> Numerics:
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics: expected Numerics, got {type(numerics).__name__}")
    return numerics


def _check_experts(x: torch.Tensor, topk_ids: object, topk_weights: object, w13: object, w2: object,
                   numerics: Numerics) -> bool:
    """Shapes, formats and id values of an `experts` call; returns whether a row repeats an expert id."""
    n_experts = _check_expert_pair(x, w13, w2, numerics)
    topk_ids = _check_tensor("topk_ids", topk_ids, x.device)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected [{x.shape[0]}, k] int32/int64, got {_describe(topk_ids)}")
    topk_weights = _check_tensor("topk_weights", topk_weights, x.device)
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights: expected {tuple(topk_ids.shape)} floating point (as topk_ids), "
                         f"got {_describe(topk_weights)}")
    if topk_ids.numel() == 0 or not checking_values(topk_ids):
        return False  # under CUDA-graph capture: a router's top-k ids are distinct per row
    out_of_range = ((topk_ids < -1) | (topk_ids >= n_experts)).any()
    bad, repeated = torch.stack((out_of_range, _rows_repeat(topk_ids))).tolist()  # the one device read
    if bad:
        raise ValueError(f"topk_ids: expected values in [-1, {n_experts}) (-1 = skip), got min "
                         f"{int(topk_ids.min())}, max {int(topk_ids.max())}")
    return bool(repeated)


def _check_moe(x: torch.Tensor, weights: object, token_ids: object, cfg: DSv4Config, numerics: Numerics) -> bool:
    """Everything a `moe` call takes; returns whether a hash layer's tid2eid rows repeat an expert id."""
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights: expected MoEWeights, got {type(weights).__name__}")
    repeated = _check_router(x, weights.gate, weights.bias, token_ids, weights.tid2eid, cfg)
    _check_expert_pair(x, weights.w13, weights.w2, numerics)
    dim, shared_inter = x.shape[1], weights.shared_w2.shape[-1]
    _check_weight("shared_w13", weights.shared_w13, (2 * shared_inter, dim), x.device, numerics, False)
    _check_weight("shared_w2", weights.shared_w2, (dim, shared_inter), x.device, numerics, False)
    return repeated


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, *, token_ids: torch.Tensor | None,
    tid2eid: torch.Tensor | None, cfg: DSv4Config, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose `k = cfg.n_activated_experts` experts per token and their weights (spec §5.1).

    Same math as `reference.moe.route`: fp32 logits, sqrtsoftplus scores, top-k of `score + bias` with ties
    to the lower expert id (or `tid2eid[token_ids]` on hash layers), weights = the selected unbiased
    scores over their sum times `cfg.route_scale`. The Triton logits are a bf16 x bf16 -> fp32 GEMM: the
    products are exact, only the fp32 summation order differs from the reference's fp32 matmul.

    Args:
        x: [T, D] bf16, last dim contiguous.
        gate_weight: [E, D] bf16.
        bias: [E] fp32 for non-hash layers; None for hash layers.
        token_ids: [T] int32/int64, hash layers only (rows of `tid2eid`).
        tid2eid: [vocab, k] int32/int64 for hash layers; None otherwise.
        cfg: model config (`n_routed_experts`, `n_activated_experts`, `route_scale`).
        backend: "triton", "deepgemm" (the same Triton kernels), "reference", or None (best available).

    Returns:
        topk_ids: [T, k] int32, by decreasing `score + bias` (hash layers: `tid2eid` order).
        topk_weights: [T, k] fp32.
    """
    x = _check_x(x)
    _check_router(x, gate_weight, bias, token_ids, tid2eid, cfg)
    impl = select("route", backend, ("x", x.device)).load()
    return impl(x, gate_weight, bias, token_ids=token_ids, tid2eid=tid2eid, cfg=cfg)


def experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, *,
    swiglu_limit: float, numerics: Numerics, backend: str | None = None,
) -> torch.Tensor:
    """The routed experts for given routing (the MegaMoE boundary), spec §5.2; `reference.moe.experts`.

    Per (token, slot): `[g | u] = act_quant(x) W13^T` (bf16 when `numerics.gate_up_bf16`),
    `a = silu(min(g, L)) * clamp(u, -L, L) * w` in fp32, `y = act_quant(bf16(a)) W2^T` in bf16; the k
    outputs of a token are summed in fp32 in ascending expert id and cast to bf16 once. A slot with id
    -1 is skipped; a repeated id in one row counts once per slot.

    Args:
        x: [T, D] bf16, last dim contiguous.
        topk_ids: [T, k] int32/int64, values in [-1, E).
        topk_weights: [T, k] floating point.
        w13: [E, 2I, D] `Fp8Weight` (in `numerics.fp8_format`), `Fp4Weight` (re-encoded to FP8, cached) or
            `TiledFp8Weight` (triton backend only).
        w2: [E, D, I], the same format.
        swiglu_limit: the clamp L (<= 0: none).
        numerics: `act_quant`, `act_block`, `fp8_format`, `gate_up_bf16`.
        backend: "triton", "deepgemm", "reference", or None.

    Returns:
        [T, D] bf16.
    """
    x = _check_x(x)
    numerics = _check_numerics(numerics)
    repeated = _check_experts(x, topk_ids, topk_weights, w13, w2, numerics)
    impl = select("experts", backend, ("x", x.device))
    _check_tiled_backend(impl.backend, w13)
    # DeepGEMM's masked layout (decode) gives each expert T rows: a row that repeats an id needs the contiguous one
    extra = {"layout": "contiguous"} if impl.backend == "deepgemm" and repeated else {}
    return impl.load()(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, numerics=numerics, **extra)


def moe(
    x: torch.Tensor, weights: MoEWeights, *, token_ids: torch.Tensor | None, cfg: DSv4Config, numerics: Numerics,
    backend: str | None = None,
) -> torch.Tensor:
    """DSv4's MoE layer (spec §5): route, routed experts, shared expert; `reference.moe.moe`.

    The routed experts' fp32 sum and the shared expert's bf16 output are added in fp32 and cast to
    bf16 once.

    Args:
        x: [T, D] bf16 (the `ffn_norm` output), last dim contiguous.
        weights: the layer's `MoEWeights` (FP8 weights in `numerics.fp8_format`, or MXFP4 experts; routed experts
            may be `TiledFp8Weight` on the triton backend).
        token_ids: [T] int32/int64, required by hash layers.
        cfg: model config.
        numerics: quantization simulation switches.
        backend: "triton", "deepgemm", "reference", or None.

    Returns:
        [T, D] bf16.
    """
    return _moe(_check_x(x), weights, token_ids, cfg, _check_numerics(numerics), backend, None)


def _moe(x: torch.Tensor, weights: MoEWeights, token_ids: torch.Tensor | None, cfg: DSv4Config, numerics: Numerics,
         backend: str | None, tiled: tuple[TiledFp8Weight, TiledFp8Weight] | None) -> torch.Tensor:
    """`moe` after its argument checks; `tiled`: the routed experts of `weights` tiled (`MoE` on the triton backend)."""
    repeated = _check_moe(x, weights, token_ids, cfg, numerics)
    impl = select("moe", backend, ("x", x.device))
    extra = {"layout": "contiguous"} if impl.backend == "deepgemm" and repeated else {}
    if tiled is not None and impl.backend == "triton":
        extra = {"routed": tiled}
    return impl.load()(x, weights, token_ids=token_ids, cfg=cfg, numerics=numerics, **extra)


class MoE(nn.Module):
    """DSv4's MoE layer as a module: holds the weights, config, numerics and backend; `forward` calls `moe`.

    At construction (unless the backend is the reference) MXFP4 experts are re-encoded to FP8 once; on the triton
    backend of an NVIDIA GPU the routed experts are tiled (`tile_experts`) into a copy the module holds (`tile=False`
    keeps the row layout and no copy). `forward` on another backend (`backend=None` resolving elsewhere) uses the
    rows of `weights`.
    """

    def __init__(self, weights: MoEWeights, cfg: DSv4Config, numerics: Numerics = OFFICIAL,
                 backend: str | None = None, tile: bool = True) -> None:
        super().__init__()
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"weights: expected MoEWeights, got {type(weights).__name__}")
        self.weights = weights
        self.cfg = cfg
        self.numerics = _check_numerics(numerics)
        self.backend = backend
        self.tiled: tuple[TiledFp8Weight, TiledFp8Weight] | None = None
        chosen = select("moe", backend, ("weights", weights.gate.device)).backend
        if chosen != "reference":
            fp8_experts(weights.w13, weights.w2, numerics.fp8_format)
        if tile and chosen == "triton" and tiling_helps(weights.gate.device):
            self.tiled = (tile_experts(weights.w13, numerics.fp8_format), tile_experts(weights.w2, numerics.fp8_format))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, D] bf16, token_ids: [T] int (hash layers) -> [T, D] bf16."""
        return _moe(_check_x(x), self.weights, token_ids, self.cfg, self.numerics, self.backend, self.tiled)
