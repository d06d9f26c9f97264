"""Weight containers and random initialisation with realistic statistics.

Quantized weights travel as `(data, scale)` pairs, the layout DSv4 checkpoints and DeepGEMM use:
`Fp8Weight` (E4M3 values, fp32 power-of-two scale per 128x128 tile) and `Fp4Weight` (two E2M1
values per int8, fp32 power-of-two scale per 1x32). Module-specific weight sets (attention, MoE)
live beside their modules; loading from checkpoint names lives here.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reference.formats import (
    E4M3FN,
    FP4_BLOCK,
    FP8Format,
    dequantize_fp4,
    dequantize_per_block,
    fp8_format,
    mxfp4_to_fp8,
    pack_fp4,
    quantize_fp4,
    quantize_per_block,
    ue8m0_to_fp32,
    unpack_fp4,
)

if TYPE_CHECKING:  # the module weight sets import this file; they are imported where they are needed
    from reference.attention import AttentionWeights
    from reference.compressor import CompressorWeights
    from reference.config import DSv4Config
    from reference.moe import MoEWeights

FP8_WEIGHT_BLOCK = 128


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight `[N, K]` as FP8 with one fp32 power-of-two scale per 128x128 tile.

    Attributes:
        data: [..., N, K] float8_e4m3fn or float8_e4m3fnuz.
        scale: [..., N / 128, K / 128] fp32.
    """

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        fp8_format(self.data.dtype)  # raises on a non-FP8 dtype
        n, k = self.data.shape[-2:]
        expect = (*self.data.shape[:-2], -(-n // FP8_WEIGHT_BLOCK), -(-k // FP8_WEIGHT_BLOCK))
        if tuple(self.scale.shape) != expect:
            raise ValueError(f"scale: expected shape {expect} for data {tuple(self.data.shape)}, "
                             f"got {tuple(self.scale.shape)}")
        if self.scale.dtype != torch.float32:
            raise TypeError(f"scale: expected float32 power-of-two values, got {self.scale.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        """[..., N, K] fp32."""
        return dequantize_per_block(self.data, self.scale, FP8_WEIGHT_BLOCK)

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device))


@dataclass(frozen=True)
class Fp4Weight:
    """A linear weight `[N, K]` as MXFP4: int8 with two E2M1 values (low nibble = even k) and one fp32
    power-of-two scale per 1x32.

    Attributes:
        packed: [..., N, K / 2] int8.
        scale: [..., N, K / 32] fp32.
    """

    packed: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.int8:
            raise TypeError(f"packed: expected int8 packed E2M1, got {self.packed.dtype}")
        expect = (*self.packed.shape[:-1], self.packed.shape[-1] * 2 // FP4_BLOCK)
        if tuple(self.scale.shape) != expect:
            raise ValueError(f"scale: expected shape {expect} for packed {tuple(self.packed.shape)}, "
                             f"got {tuple(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., N, K]."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self) -> torch.Tensor:
        """[..., N, K] fp32."""
        return dequantize_fp4(unpack_fp4(self.packed), self.scale)

    def to_fp8(self, fmt: str | FP8Format = E4M3FN) -> Fp8Weight:
        """Lossless re-encode to 128x128 block FP8 (raises where it would not be lossless)."""
        if self.packed.dim() == 2:
            return Fp8Weight(*mxfp4_to_fp8(self.packed, self.scale, fmt))
        if len(self.packed) == 0:
            raise ValueError(f"packed: no experts to re-encode (shape {tuple(self.packed.shape)})")
        # stacked experts one at a time, into the result (no second copy of all of them: PRO's w13 is 16 GB in FP8)
        q0, s0 = mxfp4_to_fp8(self.packed[0], self.scale[0], fmt)
        q = q0.new_empty((len(self.packed), *q0.shape))
        s = s0.new_empty((len(self.packed), *s0.shape))
        q[0], s[0] = q0, s0
        for e in range(1, len(self.packed)):
            q[e], s[e] = mxfp4_to_fp8(self.packed[e], self.scale[e], fmt)
        return Fp8Weight(q, s)

    def to(self, device: torch.device | str) -> Fp4Weight:
        return Fp4Weight(self.packed.to(device), self.scale.to(device))


def random_linear(
    n: int, k: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu",
    batch: tuple[int, ...] = (), std: float | None = None,
) -> torch.Tensor:
    """[*batch, N, K] fp32 Gaussian weight with std `1/sqrt(K)` (unit-variance outputs for unit inputs)."""
    std = k**-0.5 if std is None else std
    w = torch.randn((*batch, n, k), generator=generator, dtype=torch.float32)
    return (w * std).to(device)


def random_fp8_weight(
    n: int, k: int, *, fmt: str | FP8Format = E4M3FN, generator: torch.Generator | None = None,
    device: torch.device | str = "cpu", batch: tuple[int, ...] = (),
) -> Fp8Weight:
    """A random `[*batch, N, K]` weight quantized to 128x128 block FP8, as checkpoints store it."""
    q, s = quantize_per_block(random_linear(n, k, generator=generator, batch=batch), FP8_WEIGHT_BLOCK, fmt)
    return Fp8Weight(q.to(device), s.to(device))


def random_fp4_weight(
    n: int, k: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu",
    batch: tuple[int, ...] = (),
) -> Fp4Weight:
    """A random `[*batch, N, K]` weight quantized to MXFP4 (per-32 UE8M0 scales), as the experts ship."""
    codes, s = quantize_fp4(random_linear(n, k, generator=generator, batch=batch))
    return Fp4Weight(pack_fp4(codes).to(device), s.to(device))


# ------------------------------------------------------------------------------------------------
# Loading one layer from DeepSeek's checkpoint names (spec §1.1)
# ------------------------------------------------------------------------------------------------
#
# Names are the official inference names, under `layers.{i}.` (official files) or `model.layers.{i}.`:
#   attn_norm.weight, ffn_norm.weight                       [D] bf16
#   attn.{wq_a, wq_b, wkv, wo_a, wo_b}.weight + .scale      FP8 E4M3 + UE8M0 128x128 scales
#   attn.{q_norm, kv_norm}.weight                           bf16;  attn.attn_sink [H] fp32
#   attn.compressor.{wkv, wgate}.weight, .ape, .norm.weight bf16, fp32, bf16 (ratio > 0 layers)
#   attn.indexer.wq_b.weight + .scale, .weights_proj.weight, .compressor.*   (ratio 4 layers)
#   ffn.gate.weight [E, D] bf16; ffn.gate.bias [E] fp32 (HF: e_score_correction_bias) or
#   ffn.gate.tid2eid [vocab, k] int (hash layers)
#   ffn.experts.{e}.{w1, w3, w2}.weight + .scale            MXFP4: int8 [N, K/2] + UE8M0 [N, K/32]
#                                                           (or FP8 + 128x128 scales: expert_dtype fp8)
#   ffn.shared_experts.{w1, w3, w2}.weight + .scale         FP8 + 128x128
# Scales may be float8_e8m0fnu bytes (as shipped), uint8 exponent bytes, or fp32 powers of two
# (`.weight_scale_inv` is accepted for `.scale`). Plain bf16 / fp16 / fp32 weights without a scale are
# accepted under the same names and quantized on load to 128x128 block FP8 in `fmt` (the format the
# reference's linears take; experts too, which keeps them closer to the plain values than MXFP4 would).

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Every tensor of a folder's `*.safetensors` files (or of one file), read by name on access.

    Reads the safetensors format directly (an 8-byte little-endian header length, a JSON header of
    `{name: {dtype, shape, data_offsets}}`, then the raw bytes), so it needs no extra package; only the
    bytes of the tensors asked for are read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"path: no *.safetensors file in {path}")
        self._index: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for file in files:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for name, info in header.items():
                if name != "__metadata__":
                    self._index[name] = (file, 8 + length, info)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, base, info = self._index[name]
        if info["dtype"] not in _DTYPES:
            raise TypeError(f"{name}: unsupported safetensors dtype {info['dtype']}")
        start, end = info["data_offsets"]
        with file.open("rb") as f:
            f.seek(base + start)
            raw = bytearray(f.read(end - start))
        dtype = _DTYPES[info["dtype"]]
        if not raw:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(info["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


@dataclass(frozen=True)
class _Layer:
    """Name resolution and typed reads for one layer of a checkpoint."""

    source: Mapping[str, torch.Tensor]
    prefix: str
    fmt: FP8Format

    @classmethod
    def of(cls, source: Mapping[str, torch.Tensor], layer_id: int, fmt: str | FP8Format) -> _Layer:
        for prefix in (f"layers.{layer_id}.", f"model.layers.{layer_id}."):
            if any(name.startswith(prefix) for name in source):
                return cls(source, prefix, fp8_format(fmt))
        raise ValueError(f"source: no tensor named 'layers.{layer_id}.*' or 'model.layers.{layer_id}.*' "
                         f"({len(source)} tensors)")

    def has(self, name: str) -> bool:
        return self.prefix + name in self.source

    def get(self, name: str, *aliases: str) -> torch.Tensor:
        for candidate in (name, *aliases):
            if self.has(candidate):
                return self.source[self.prefix + candidate]
        raise ValueError(f"source: tensor {self.prefix + name!r} is missing")

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, *aliases: str) -> torch.Tensor:
        """A plain tensor of `shape`, cast to `dtype` (floats from any float dtype, ints from any int dtype)."""
        t = self.get(name, *aliases)
        if tuple(t.shape) != shape:
            raise ValueError(f"{self.prefix + name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.is_floating_point() != dtype.is_floating_point:
            raise TypeError(f"{self.prefix + name}: expected a {'float' if dtype.is_floating_point else 'integer'} "
                            f"tensor, got {t.dtype}")
        return t.to(dtype)

    def linear(self, name: str, n: int, k: int, *, fp4: bool = False) -> Fp8Weight | Fp4Weight:
        """`name.weight` (+ `name.scale`) of logical shape [n, k]: FP8 + 128x128 scales, MXFP4 (int8 packed +
        per-32 scales; only where `fp4`), or a plain float weight quantized to block FP8."""
        key = self.prefix + name
        data = self.get(f"{name}.weight")
        scale = None
        for suffix in (".scale", ".weight_scale_inv"):
            if self.has(name + suffix):
                scale = ue8m0_to_fp32(self.source[key + suffix])
        if data.dtype in _PLAIN:
            if scale is not None:
                raise ValueError(f"{key}.weight: a {data.dtype} weight with a scale tensor (expected FP8 or MXFP4)")
            if tuple(data.shape) != (n, k):
                raise ValueError(f"{key}.weight: expected shape {(n, k)}, got {tuple(data.shape)}")
            return Fp8Weight(*quantize_per_block(data, FP8_WEIGHT_BLOCK, self.fmt))
        if scale is None:
            raise ValueError(f"{key}.scale: missing (a {data.dtype} weight needs its scales)")
        if data.dtype == torch.int8 and fp4:
            if tuple(data.shape) != (n, k // 2) or tuple(scale.shape) != (n, k // FP4_BLOCK):
                raise ValueError(f"{key}: expected MXFP4 weight {(n, k // 2)} int8 and scale {(n, k // FP4_BLOCK)}, "
                                 f"got {tuple(data.shape)} and {tuple(scale.shape)}")
            return Fp4Weight(data, scale)
        if data.dtype != torch.float8_e4m3fn:
            allowed = "float8_e4m3fn, int8 (MXFP4)" if fp4 else "float8_e4m3fn"
            raise TypeError(f"{key}.weight: expected {allowed} or a plain float weight, got {data.dtype}")
        if tuple(data.shape) != (n, k):
            raise ValueError(f"{key}.weight: expected shape {(n, k)}, got {tuple(data.shape)}")
        return Fp8Weight(data, scale)


def open_checkpoint(path: str | os.PathLike[str]) -> SafetensorsCheckpoint:
    """A folder of `*.safetensors` shards (or one file) as a mapping of name -> tensor."""
    return SafetensorsCheckpoint(path)


def _rows(parts: list[Fp8Weight | Fp4Weight]) -> Fp8Weight | Fp4Weight:
    """Stack weights of the same format along the output rows ([N1, K] + [N2, K] -> [N1 + N2, K])."""
    if all(isinstance(p, Fp8Weight) for p in parts):
        return Fp8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]))
    if all(isinstance(p, Fp4Weight) for p in parts):
        return Fp4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]))
    raise TypeError(f"weights: mixed formats {[type(p).__name__ for p in parts]}")


def _experts(parts: list[Fp8Weight | Fp4Weight], name: str) -> Fp8Weight | Fp4Weight:
    """Stack per-expert weights into [E, N, K] (every expert in the same format)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        raise TypeError(f"{name}: experts in mixed formats {sorted(k.__name__ for k in kinds)}")
    if isinstance(parts[0], Fp8Weight):
        return Fp8Weight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]))
    return Fp4Weight(torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts]))


def load_moe_weights(
    source: Mapping[str, torch.Tensor], cfg: DSv4Config, layer_id: int, *, fmt: str | FP8Format = E4M3FN,
    device: torch.device | str = "cpu",
) -> MoEWeights:
    """Layer `layer_id`'s MoE weights from checkpoint names (see the table above this function).

    Args:
        source: name -> tensor (`open_checkpoint(path)`, a `safetensors` dict, a state dict).
        cfg: the model config (shapes are checked against it; hash layers need `tid2eid`, others `bias`).
        layer_id: the layer (`cfg.n_layers` is the MTP layer).
        fmt: FP8 format that plain float weights are quantized into.
        device: where the weights go.

    Raises:
        ValueError / TypeError naming the tensor when one is missing, mis-shaped or of a wrong dtype.
    """
    from reference.moe import MoEWeights

    layer = _Layer.of(source, layer_id, fmt)
    e, d, inter = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
    gate = layer.tensor("ffn.gate.weight", (e, d), torch.bfloat16)
    bias = tid2eid = None
    if cfg.is_hash_layer(layer_id):
        tid2eid = layer.tensor("ffn.gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), torch.int64)
        if bool(((tid2eid < 0) | (tid2eid >= e)).any()):
            raise ValueError(f"{layer.prefix}ffn.gate.tid2eid: expert ids must lie in [0, {e})")
    else:
        bias = layer.tensor("ffn.gate.bias", (e,), torch.float32, "ffn.gate.e_score_correction_bias")
    w13, w2 = [], []
    for i in range(e):
        expert = f"ffn.experts.{i}"
        w13.append(_rows([layer.linear(f"{expert}.w1", inter, d, fp4=True),
                          layer.linear(f"{expert}.w3", inter, d, fp4=True)]))
        w2.append(layer.linear(f"{expert}.w2", d, inter, fp4=True))
    shared = "ffn.shared_experts"
    shared_w13 = _rows([layer.linear(f"{shared}.w1", inter, d), layer.linear(f"{shared}.w3", inter, d)])
    shared_w2 = layer.linear(f"{shared}.w2", d, inter)
    weights = MoEWeights(gate, bias, tid2eid, _experts(w13, "ffn.experts.*.w1|w3"),
                         _experts(w2, "ffn.experts.*.w2"), shared_w13, shared_w2)  # type: ignore[arg-type]
    return weights.to(device)


def _compressor(layer: _Layer, name: str, dim: int, ratio: int, head_dim: int) -> CompressorWeights:
    from reference.compressor import CompressorWeights, overlap_factor

    rows = overlap_factor(ratio) * head_dim
    return CompressorWeights(
        wkv=layer.tensor(f"{name}.wkv.weight", (rows, dim), torch.bfloat16),
        wgate=layer.tensor(f"{name}.wgate.weight", (rows, dim), torch.bfloat16),
        ape=layer.tensor(f"{name}.ape", (ratio, rows), torch.float32),
        norm=layer.tensor(f"{name}.norm.weight", (head_dim,), torch.bfloat16),
    )


def load_attention_weights(
    source: Mapping[str, torch.Tensor], cfg: DSv4Config, layer_id: int, *, fmt: str | FP8Format = E4M3FN,
    device: torch.device | str = "cpu",
) -> AttentionWeights:
    """Layer `layer_id`'s attention weights from checkpoint names (`attn.*`; arguments as `load_moe_weights`).

    The compressor is read on CSA and HCA layers, the indexer (with its own ratio-4 compressor) on CSA
    layers. `wo_a` may be FP8 + scales (as shipped) or bf16 (after the official `convert.py`, which
    dequantizes it): the bf16 values are FP8 values times powers of two, so re-quantizing them on load
    gives back the same values.
    """
    from reference.attention import AttentionWeights
    from reference.indexer import INDEXER_RATIO, IndexerWeights

    layer = _Layer.of(source, layer_id, fmt)
    h, d, q, g, r = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    ratio, kind = cfg.compress_ratio(layer_id), cfg.layer_kind(layer_id)
    indexer = None
    if kind == "csa":
        indexer = IndexerWeights(
            wq_b=layer.linear("attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, q),  # type: ignore[arg-type]
            weights_proj=layer.tensor("attn.indexer.weights_proj.weight", (cfg.index_n_heads, cfg.dim), torch.bfloat16),
            compressor=_compressor(layer, "attn.indexer.compressor", cfg.dim, INDEXER_RATIO, cfg.index_head_dim),
        )
    weights = AttentionWeights(
        wq_a=layer.linear("attn.wq_a", q, cfg.dim),  # type: ignore[arg-type]
        q_norm=layer.tensor("attn.q_norm.weight", (q,), torch.bfloat16),
        wq_b=layer.linear("attn.wq_b", h * d, q),  # type: ignore[arg-type]
        wkv=layer.linear("attn.wkv", d, cfg.dim),  # type: ignore[arg-type]
        kv_norm=layer.tensor("attn.kv_norm.weight", (d,), torch.bfloat16),
        wo_a=layer.linear("attn.wo_a", g * r, cfg.o_group_dim),  # type: ignore[arg-type]
        wo_b=layer.linear("attn.wo_b", cfg.dim, g * r),  # type: ignore[arg-type]
        attn_sink=layer.tensor("attn.attn_sink", (h,), torch.float32),
        compressor=_compressor(layer, "attn.compressor", cfg.dim, ratio, d) if ratio else None,
        indexer=indexer,
    )
    weights.check(cfg, layer_id)
    return weights.to(device)


@dataclass(frozen=True)
class LayerWeights:
    """One transformer layer's attention and MoE weights with their input norms.

    Attributes:
        attn_norm: [D] bf16 (`attn_norm.weight`), the RMSNorm in front of the attention.
        attention: `AttentionWeights`.
        ffn_norm: [D] bf16 (`ffn_norm.weight`), the RMSNorm in front of the MoE.
        moe: `MoEWeights`.
    """

    attn_norm: torch.Tensor
    attention: AttentionWeights
    ffn_norm: torch.Tensor
    moe: MoEWeights


def load_layer(
    source: Mapping[str, torch.Tensor], cfg: DSv4Config, layer_id: int, *, fmt: str | FP8Format = E4M3FN,
    device: torch.device | str = "cpu",
) -> LayerWeights:
    """Layer `layer_id`'s weights from checkpoint names (arguments as `load_moe_weights`)."""
    layer = _Layer.of(source, layer_id, fmt)
    return LayerWeights(
        attn_norm=layer.tensor("attn_norm.weight", (cfg.dim,), torch.bfloat16).to(device),
        attention=load_attention_weights(source, cfg, layer_id, fmt=fmt, device=device),
        ffn_norm=layer.tensor("ffn_norm.weight", (cfg.dim,), torch.bfloat16).to(device),
        moe=load_moe_weights(source, cfg, layer_id, fmt=fmt, device=device),
    )
