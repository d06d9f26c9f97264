"""Which quantization simulations the reference applies, as one explicit object (spec §8.1).

The reference can play two oracles: DeepSeek's official inference numerics (quant-dequant
simulations exactly where the official code has them) and the numerics of the vLLM / DeepGEMM
kernels, plus an `EXACT` mode with no simulation at all (the "unquantized math" of the
`end_to_end` parity tier). Every site that quantizes reads one field of this object; nothing is
switched by a global.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal


@dataclass(frozen=True)
class Numerics:
    """Quantization simulation switches.

    Attributes:
        name: preset name, shown in reports.
        fp8_format: `"e4m3fn"` (OCP; NVIDIA, gfx950) or `"e4m3fnuz"` (gfx942).
        act_quant: quantize activations in front of FP8 / FP4 linears (`act_quant(x, act_block)`);
            False = multiply bf16/fp32 activations by the dequantized weights.
        act_block: per-token block of that activation quantization: 128 (official) or 32 (MegaMoE).
        kv_fp8_sim: KV NoPE dims quant-dequant through FP8 in 64-blocks (spec §3.2, current revision).
        indexer_hadamard: Hadamard rotation of indexer q and k (official; vLLM has none).
        indexer_fp4_sim: indexer q and k quant-dequant through MXFP4 in 32-blocks (official).
        indexer_scores_bf16: indexer scores rounded to bf16 (official evaluates them in bf16).
        compressed_norm_input: `"bf16"` (official rounds the pooled entry before its RMSNorm) or
            `"fp32"` (vLLM normalizes the fp32 value).
        wo_a: `"bf16"` (official: bf16 einsum with the dequantized weight) or `"fp8"` (vLLM NVIDIA and
            DeepGEMM: activations quantized per 128 channels after an fp32 inverse RoPE).
        gate_up_bf16: round MoE gate/up GEMM outputs to bf16 before the SwiGLU clamp (official and
            MegaMoE both do; EXACT keeps fp32).
        shared_expert_clamp: clamp the shared expert's SwiGLU by `swiglu_limit` (current revision
            True; the initial release had no clamp).
    """

    name: str
    fp8_format: Literal["e4m3fn", "e4m3fnuz"] = "e4m3fn"
    act_quant: bool = True
    act_block: int = 128
    kv_fp8_sim: bool = True
    indexer_hadamard: bool = True
    indexer_fp4_sim: bool = True
    indexer_scores_bf16: bool = True
    compressed_norm_input: Literal["bf16", "fp32"] = "bf16"
    wo_a: Literal["bf16", "fp8"] = "bf16"
    gate_up_bf16: bool = True
    shared_expert_clamp: bool = True

    def __post_init__(self) -> None:
        if self.fp8_format not in ("e4m3fn", "e4m3fnuz"):
            raise ValueError(f"fp8_format: expected 'e4m3fn' or 'e4m3fnuz', got {self.fp8_format!r}")
        if self.act_block not in (32, 128):
            raise ValueError(f"act_block: expected 32 or 128, got {self.act_block}")
        if self.compressed_norm_input not in ("bf16", "fp32"):
            raise ValueError(f"compressed_norm_input: expected 'bf16' or 'fp32', got {self.compressed_norm_input!r}")
        if self.wo_a not in ("bf16", "fp8"):
            raise ValueError(f"wo_a: expected 'bf16' or 'fp8', got {self.wo_a!r}")

    def replace(self, **changes: Any) -> Numerics:
        """A copy with some switches changed."""
        return replace(self, **changes)


# DeepSeek's current official inference code (HF commit 60d8d70).
OFFICIAL = Numerics(name="official")

# What vLLM computes on NVIDIA with DeepGEMM: FP8 wo_a einsum, no Hadamard, fp32 indexer logits,
# compressed entries normalized in fp32.
VLLM_NVIDIA = Numerics(
    name="vllm_nvidia",
    indexer_hadamard=False,
    indexer_scores_bf16=False,
    compressed_norm_input="fp32",
    wo_a="fp8",
)

# No quantization simulation anywhere: the "unquantized math" of the end_to_end parity tier.
EXACT = Numerics(
    name="exact",
    act_quant=False,
    kv_fp8_sim=False,
    indexer_hadamard=False,
    indexer_fp4_sim=False,
    indexer_scores_bf16=False,
    compressed_norm_input="fp32",
    wo_a="bf16",
    gate_up_bf16=False,
)

# DeepGEMM MegaMoE's expert numerics (spec §5.4), so the reference can stand in for that kernel: the
# expert inputs quantized per token per 32 channels (ue8m0, amax floor 1e-4), gate/up rounded to bf16
# before the clamp. Attention fields stay official (this preset is about the MoE block; its shared
# expert, which MegaMoE does not run, is quantized per 32 as well). Not
# simulated: MegaMoE quantizes the fp32 SwiGLU output straight to FP8 (no bf16 rounding, no amax
# floor) and uses fast-math silu; the reference keeps the official bf16 cast before the down
# projection, as the Triton/DeepGEMM MoE backends of this package do.
MEGAMOE = Numerics(name="megamoe", act_block=32)

PRESETS: dict[str, Numerics] = {n.name: n for n in (OFFICIAL, VLLM_NVIDIA, EXACT, MEGAMOE)}
