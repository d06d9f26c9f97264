"""Loading a layer from DeepSeek's checkpoint names, and the shipped Flash / Pro `config.json` files.

The checkpoints here are synthetic: random TINY layers written by the tests in the official format (names
of spec §1.1, FP8 + UE8M0 `float8_e8m0fnu` scales, MXFP4 experts as int8 + per-32 scales, bf16 norms and
gate, fp32 sink / bias / ape, int64 tid2eid).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from optimized.backends import detect
from parity_tests.probes import CHECKPOINT_TOKENS
from reference.attention import AttentionWeights, random_attention_weights
from reference.compressor import CompressorWeights
from reference.config import FLASH, PRO, TINY, DSv4Config, from_hf_config
from reference.formats import dequantize_per_block, fp32_to_ue8m0, quantize_per_block
from reference.moe import MoEWeights, random_moe_weights
from reference.weights import (
    Fp4Weight,
    Fp8Weight,
    SafetensorsCheckpoint,
    load_attention_weights,
    load_layer,
    load_moe_weights,
    open_checkpoint,
)

DATA = Path(__file__).resolve().parent / "data"
HASH_LAYER, BIASED_LAYER = 0, 3  # TINY: layers 0..2 route by token id, layer 3 by biased top-k


@pytest.mark.parametrize(("name", "preset"), [("deepseek-v4-flash", FLASH), ("deepseek-v4-pro", PRO)])
def test_shipped_hf_configs_read_as_the_presets(name: str, preset: DSv4Config) -> None:
    hf = json.loads((DATA / f"{name}.config.json").read_text())
    assert from_hf_config(hf) == preset


def hf_config(cfg: DSv4Config) -> dict[str, object]:
    """`cfg` as a Hugging Face config.json dict (the keys `from_hf_config` reads)."""
    return {
        "model_type": "deepseek_v4", "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.n_heads, "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank, "sliding_window": cfg.window_size,
        "compress_ratios": list(cfg.compress_ratios), "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk, "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.n_activated_experts, "moe_intermediate_size": cfg.moe_inter_dim,
        "routed_scaling_factor": cfg.route_scale, "num_hash_layers": cfg.n_hash_layers,
    }


# ------------------------------------------------------------------------------------------------
# writing a layer in the official format
# ------------------------------------------------------------------------------------------------


def _fp8_tensors(name: str, w: Fp8Weight) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": w.data, f"{name}.scale": fp32_to_ue8m0(w.scale)}


def _expert_tensors(name: str, w: Fp8Weight | Fp4Weight) -> dict[str, torch.Tensor]:
    if isinstance(w, Fp8Weight):
        return _fp8_tensors(name, w)
    return {f"{name}.weight": w.packed, f"{name}.scale": fp32_to_ue8m0(w.scale)}


def _row_slice(w: Fp8Weight | Fp4Weight, start: int, stop: int) -> Fp8Weight | Fp4Weight:
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.data[start:stop], w.scale[start // 128: stop // 128])
    return Fp4Weight(w.packed[start:stop], w.scale[start:stop])


def _expert(w: Fp8Weight | Fp4Weight, e: int) -> Fp8Weight | Fp4Weight:
    return Fp8Weight(w.data[e], w.scale[e]) if isinstance(w, Fp8Weight) else Fp4Weight(w.packed[e], w.scale[e])


def moe_tensors(weights: MoEWeights, layer: int, prefix: str = "layers.",
                bias_name: str = "bias") -> dict[str, torch.Tensor]:
    """The MoE part of layer `layer` under the official names."""
    p = f"{prefix}{layer}.ffn."
    inter = weights.w2.shape[-1]
    out = {f"{p}gate.weight": weights.gate}
    if weights.bias is not None:
        out[f"{p}gate.{bias_name}"] = weights.bias
    if weights.tid2eid is not None:
        out[f"{p}gate.tid2eid"] = weights.tid2eid.to(torch.int64)  # int64 in the checkpoint
    for e in range(weights.gate.shape[0]):
        w13 = _expert(weights.w13, e)
        out |= _expert_tensors(f"{p}experts.{e}.w1", _row_slice(w13, 0, inter))
        out |= _expert_tensors(f"{p}experts.{e}.w3", _row_slice(w13, inter, 2 * inter))
        out |= _expert_tensors(f"{p}experts.{e}.w2", _expert(weights.w2, e))
    out |= _fp8_tensors(f"{p}shared_experts.w1", _row_slice(weights.shared_w13, 0, inter))
    out |= _fp8_tensors(f"{p}shared_experts.w3", _row_slice(weights.shared_w13, inter, 2 * inter))
    out |= _fp8_tensors(f"{p}shared_experts.w2", weights.shared_w2)
    return out


def _compressor_tensors(name: str, c: CompressorWeights) -> dict[str, torch.Tensor]:
    return {f"{name}.wkv.weight": c.wkv, f"{name}.wgate.weight": c.wgate, f"{name}.ape": c.ape,
            f"{name}.norm.weight": c.norm}


def attention_tensors(w: AttentionWeights, layer: int) -> dict[str, torch.Tensor]:
    """The attention part of layer `layer` under the official names."""
    p = f"layers.{layer}.attn."
    out = {f"{p}q_norm.weight": w.q_norm, f"{p}kv_norm.weight": w.kv_norm, f"{p}attn_sink": w.attn_sink}
    for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
        out |= _fp8_tensors(p + name, getattr(w, name))
    if w.compressor is not None:
        out |= _compressor_tensors(f"{p}compressor", w.compressor)
    if w.indexer is not None:
        out |= _fp8_tensors(f"{p}indexer.wq_b", w.indexer.wq_b)
        out[f"{p}indexer.weights_proj.weight"] = w.indexer.weights_proj
        out |= _compressor_tensors(f"{p}indexer.compressor", w.indexer.compressor)
    return out


def _attention(layer: int, seed: int = 0) -> AttentionWeights:
    return random_attention_weights(TINY, layer, generator=torch.Generator().manual_seed(seed))


def layer_tensors(layer: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A whole synthetic TINY layer in the official format (norms, attention, MoE with MXFP4 experts)."""
    g = torch.Generator().manual_seed(seed + 1)
    norms = {f"layers.{layer}.{n}.weight": (1 + 0.1 * torch.randn(TINY.dim, generator=g)).to(torch.bfloat16)
             for n in ("attn_norm", "ffn_norm")}
    return norms | attention_tensors(_attention(layer, seed), layer) | moe_tensors(_moe(layer, seed=seed), layer)


def _moe(layer: int, expert_format: str = "fp4", seed: int = 0) -> MoEWeights:
    return random_moe_weights(TINY, layer, expert_format=expert_format, generator=torch.Generator().manual_seed(seed))


def _tensors_of(obj: object) -> list[torch.Tensor | None]:
    """Every tensor of a weight container, in field order (nested containers flattened)."""
    if obj is None or isinstance(obj, torch.Tensor):
        return [obj]
    return [t for f in dataclasses.fields(obj) for t in _tensors_of(getattr(obj, f.name))]  # type: ignore[arg-type]


def assert_same_weights(a: object, b: object) -> None:
    assert type(a) is type(b)
    for x, y in zip(_tensors_of(a), _tensors_of(b), strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y)


# ------------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [HASH_LAYER, BIASED_LAYER])
def test_moe_layer_loads_bit_exact_from_official_names(layer: int) -> None:
    weights = _moe(layer)
    loaded = load_moe_weights(moe_tensors(weights, layer), TINY, layer)
    assert loaded.expert_format == "fp4" and loaded.is_hash == TINY.is_hash_layer(layer)
    assert loaded.tid2eid is None or loaded.tid2eid.dtype == torch.int64
    expected = weights if weights.tid2eid is None else dataclasses.replace(weights, tid2eid=weights.tid2eid.long())
    assert_same_weights(loaded, expected)


def test_fp8_experts_hf_prefix_and_bias_alias_load() -> None:
    weights = _moe(BIASED_LAYER, expert_format="fp8")
    source = moe_tensors(weights, BIASED_LAYER, prefix="model.layers.", bias_name="e_score_correction_bias")
    loaded = load_moe_weights(source, TINY, BIASED_LAYER)
    assert loaded.expert_format == "fp8"
    assert_same_weights(loaded, weights)


def test_plain_float_weights_load_as_block_fp8() -> None:
    """bf16 / fp32 weights under the same names (no scales) are quantized on load, as checkpoints were made."""
    weights = _moe(BIASED_LAYER, expert_format="fp8")
    official = moe_tensors(weights, BIASED_LAYER)
    plain = {}
    for key, value in official.items():
        if key.endswith(".scale"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            scale = official[key.removesuffix(".weight") + ".scale"]
            value = dequantize_per_block(value, scale.view(torch.uint8).float().sub(127).exp2()).to(torch.bfloat16)
        plain[key] = value
    loaded = load_moe_weights(plain, TINY, BIASED_LAYER)
    w1 = plain[f"layers.{BIASED_LAYER}.ffn.experts.5.w1.weight"]
    q, s = quantize_per_block(w1, 128)
    assert torch.equal(loaded.w13.data[5, : TINY.moe_inter_dim].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(loaded.w13.scale[5, : TINY.moe_inter_dim // 128], s)
    # FP8 values times a power of two are exact in bf16, so the re-quantized weights hold the same values
    assert torch.equal(loaded.w13.dequantize(), weights.w13.dequantize())
    assert torch.equal(loaded.shared_w2.dequantize(), weights.shared_w2.dequantize())


def test_safetensors_shards_load_like_the_mapping(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    weights = _moe(BIASED_LAYER)
    tensors = moe_tensors(weights, BIASED_LAYER)
    names = sorted(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):  # two shards, like a real checkpoint
        safetensors_torch.save_file({k: tensors[k].contiguous() for k in part},
                                    str(tmp_path / f"model-0000{i + 1}-of-00002.safetensors"))
    source = open_checkpoint(tmp_path)
    assert isinstance(source, SafetensorsCheckpoint) and len(source) == len(tensors)
    assert source[names[0]].dtype == tensors[names[0]].dtype
    assert_same_weights(load_moe_weights(source, TINY, BIASED_LAYER), weights)


def test_checkpoint_errors_name_the_tensor() -> None:
    weights = _moe(HASH_LAYER)
    source = moe_tensors(weights, HASH_LAYER)
    missing = {k: v for k, v in source.items() if "experts.3.w2" not in k}
    with pytest.raises(ValueError, match=r"'layers\.0\.ffn\.experts\.3\.w2\.weight' is missing"):
        load_moe_weights(missing, TINY, HASH_LAYER)
    wrong = dict(source, **{"layers.0.ffn.gate.weight": weights.gate[:, :128]})
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.gate\.weight: expected shape \(16, 256\)"):
        load_moe_weights(wrong, TINY, HASH_LAYER)
    out_of_range = dict(source, **{"layers.0.ffn.gate.tid2eid": source["layers.0.ffn.gate.tid2eid"] + 16})
    with pytest.raises(ValueError, match=r"tid2eid: expert ids must lie in \[0, 16\)"):
        load_moe_weights(out_of_range, TINY, HASH_LAYER)
    no_scale = {k: v for k, v in source.items() if k != "layers.0.ffn.shared_experts.w1.scale"}
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.shared_experts\.w1\.scale: missing"):
        load_moe_weights(no_scale, TINY, HASH_LAYER)
    with pytest.raises(ValueError, match=r"no tensor named 'layers\.2\.\*'"):
        load_moe_weights(source, TINY, 2)


# ------------------------------------------------------------------------------------------------
# attention and whole layers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["swa", "csa", "hca"])
def test_attention_layer_loads_bit_exact_from_official_names(layer: int) -> None:
    weights = _attention(layer)
    loaded = load_attention_weights(attention_tensors(weights, layer), TINY, layer)
    assert_same_weights(loaded, weights)
    assert (loaded.compressor is None, loaded.indexer is None) == (layer == 0, layer != 1)


def test_wo_a_dequantized_to_bf16_by_convert_py_loads_with_the_same_values() -> None:
    weights = _attention(1)
    source = attention_tensors(weights, 1)
    del source["layers.1.attn.wo_a.scale"]
    source["layers.1.attn.wo_a.weight"] = weights.wo_a.dequantize().to(torch.bfloat16)
    loaded = load_attention_weights(source, TINY, 1)
    assert torch.equal(loaded.wo_a.dequantize(), weights.wo_a.dequantize())


def test_whole_layer_loads_norms_attention_and_moe() -> None:
    source = layer_tensors(3)
    loaded = load_layer(source, TINY, 3)
    assert torch.equal(loaded.attn_norm, source["layers.3.attn_norm.weight"])
    assert torch.equal(loaded.ffn_norm, source["layers.3.ffn_norm.weight"])
    assert_same_weights(loaded.attention, _attention(3))
    assert_same_weights(loaded.moe, _moe(3))


def test_attention_weights_of_the_wrong_layer_kind_are_rejected() -> None:
    source = attention_tensors(_attention(0), 0)  # SWA: no compressor
    renamed = {k.replace("layers.0.", "layers.2."): v for k, v in source.items()}  # HCA needs one
    with pytest.raises(ValueError, match=r"'layers\.2\.attn\.compressor\.wkv\.weight' is missing"):
        load_attention_weights(renamed, TINY, 2)


def test_cli_runs_the_layer_cases_on_checkpoint_weights(tmp_path: Path) -> None:
    """`dsv4-parity --checkpoint DIR --layer N` on a synthetic checkpoint folder (config.json + safetensors)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from parity_tests import __main__ as cli

    layer = BIASED_LAYER
    safetensors_torch.save_file({k: v.contiguous() for k, v in layer_tensors(layer).items()},
                                str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(TINY)))
    out = tmp_path / "report"
    code = cli.main(["--checkpoint", str(tmp_path), "--layer", str(layer), "--backends", "triton", "--out", str(out),
                     "--no-progress"])
    results = json.loads((out / "report.json").read_text())["results"]
    assert [(r["suite"], r["op"], r["backend"], r["status"]) for r in results] == [
        ("checkpoint", "attention", "triton", "pass"), ("checkpoint", "moe", "triton", "pass")], results
    tokens = CHECKPOINT_TOKENS[detect().torch_device]  # the CLI runs on the GPU when there is one
    assert results[0]["shape"] == f"layer={layer},csa,T={tokens}" and code == 0
