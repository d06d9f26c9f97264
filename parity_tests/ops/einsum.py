"""Parity cases of the output-projection ops (spec §3.6, §4): `fp8_einsum`, `quantize_attn_output`,
`output_projection` and `fp8_linear`.

Each case runs `optimized.<op>(..., backend=b)` and the reference on identical inputs:
  * fp8_einsum           — `'bhr,hdr->bhd'`, recipe (1, 128, 128), on the same quantized operands:
                           `FP8_GEMM_SIMULATED` against `reference.einsum.fp8_einsum`; `FP8_END_TO_END`
                           against the fp32 einsum of the unquantized inputs.
  * quantize_attn_output — bitwise: FP8 bytes and scales equal the reference's (values; the scale layout
                           differs by backend).
  * output_projection    — `numerics.wo_a = "fp8"` (VLLM_NVIDIA in the case's format): `OUTPUT_PROJECTION_SIMULATED`
                           against the reference with the same numerics, `FP8_END_TO_END` against EXACT.
  * fp8_linear           — OFFICIAL numerics in the case's format: `FP8_GEMM_SIMULATED` against the reference,
                           `FP8_END_TO_END` against EXACT (unquantized activations, same FP8 weight).
Shapes: h = o_groups, r = o_group_dim (4096 on FLASH / PRO), d = o_lora_rank; the linear is `wo_b`
(K = o_groups * o_lora_rank, N = dim). TINY cases (CPU, Triton interpreter, both FP8 formats) use
b in {1, 5, 33} (odd sizes catch masking bugs); FLASH (h = 8) and PRO (h = 16) cases need a GPU and use
b in {1, 8, 128, 4096, 8192}, both formats (e4m3fnuz only runs where the backend supports it: Triton on
ROCm; DeepGEMM never). Inputs are drawn on the case's device from seed `Case.seed`.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from optimized import fp8_einsum, fp8_linear, output_projection, quantize_attn_output
from parity_tests.cases import FP8_FORMATS, Case, Check, provider, require
from parity_tests.metrics import calc_diff, max_abs_error, worst_position
from parity_tests.tolerances import BITWISE, FP8_END_TO_END, FP8_GEMM_SIMULATED, OUTPUT_PROJECTION_SIMULATED, Bound
from reference import einsum as ref
from reference.config import DSv4Config, get_config
from reference.formats import quantize_per_block, quantize_per_token
from reference.linear import fp8_linear as ref_fp8_linear
from reference.numerics import EXACT, OFFICIAL, VLLM_NVIDIA
from reference.rope import yarn_frequencies
from reference.weights import Fp8Weight

TINY_TOKENS = (1, 5, 33)
GPU_TOKENS = (1, 8, 128, 4096, 8192)
GPU_CONFIGS = ("FLASH", "PRO")
OPS = ("fp8_einsum", "quantize_attn_output", "output_projection", "fp8_linear")
# Positions are drawn in [0, MAX_POSITION): DSv4's context length, so that RoPE angles reach 1M rad.
MAX_POSITION = 1 << 20
# The layer whose RoPE the output projection inverts: CSA (theta 160000 with YaRN), the common kind.
ROPE_COMPRESS_RATIO = 4


@dataclass(frozen=True)
class EinsumSpec:
    """What one case runs.

    Attributes:
        op: one of `OPS`.
        config: "TINY", "FLASH" or "PRO".
        tokens: b (= T, or M for the linear).
        fmt: FP8 format of every operand.
        device: "cpu" or "cuda".
    """

    op: str
    config: str
    tokens: int
    fmt: str
    device: str

    @property
    def seed(self) -> int:
        return 2000 + self.tokens

    def label(self, cfg: DSv4Config) -> str:
        if self.op == "fp8_linear":
            return f"M={self.tokens},K={cfg.o_groups * cfg.o_lora_rank},N={cfg.dim}"
        if self.op == "fp8_einsum":
            return f"b={self.tokens},h={cfg.o_groups},r={cfg.o_group_dim},d={cfg.o_lora_rank}"
        return f"T={self.tokens},H={cfg.n_heads},G={cfg.o_groups}"

    def case(self) -> Case:
        cfg = get_config(self.config)
        return Case(op=self.op, config=self.config, shape=self.label(cfg), fmt=self.fmt, seed=self.seed,
                    device=self.device, run=functools.partial(_RUNNERS[self.op], self), params=asdict(self))


def _specs(op: str, config: str, device: str) -> list[EinsumSpec]:
    name = config.upper()
    tokens = TINY_TOKENS if name == "TINY" else GPU_TOKENS
    return [EinsumSpec(op, name, t, fmt, device) for fmt in FP8_FORMATS for t in tokens]


def _cases(op: str, config: str, device: str) -> list[Case]:
    if config.upper() not in ("TINY", *GPU_CONFIGS):
        raise ValueError(f"config: expected TINY, FLASH or PRO, got {config!r}")
    return [spec.case() for spec in _specs(op, config, device)]


@provider("fp8_einsum")
def fp8_einsum_cases(config: str, device: str) -> list[Case]:
    """Grouped FP8 einsum cases of `config` on `device`."""
    return _cases("fp8_einsum", config, device)


@provider("quantize_attn_output")
def quantize_attn_output_cases(config: str, device: str) -> list[Case]:
    """Fused inverse-RoPE FP8 quantization cases."""
    return _cases("quantize_attn_output", config, device)


@provider("output_projection")
def output_projection_cases(config: str, device: str) -> list[Case]:
    """Whole output projection (o -> wo_a -> wo_b) cases."""
    return _cases("output_projection", config, device)


@provider("fp8_linear")
def fp8_linear_cases(config: str, device: str) -> list[Case]:
    """Block-FP8 linear cases at the `wo_b` shape."""
    return _cases("fp8_linear", config, device)


# ------------------------------------------------------------------------------------------------
# Running a case
# ------------------------------------------------------------------------------------------------


def _require(spec: EinsumSpec, backend: str) -> None:
    """NotRun when this machine or backend cannot run the case."""
    require(spec.device, spec.fmt, backend)


def _generator(spec: EinsumSpec) -> torch.Generator:
    return torch.Generator(device=spec.device).manual_seed(spec.seed)


def _randn(shape: tuple[int, ...], g: torch.Generator, device: str) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device)


def _diff_check(name: str, bound: Bound, out: torch.Tensor, expected: torch.Tensor) -> Check:
    return Check(name, bound, calc_diff(out, expected),
                 f"max_abs={max_abs_error(out, expected):.3g} at {worst_position(out, expected)}")


def _mismatch_check(name: str, out: torch.Tensor, expected: torch.Tensor) -> Check:
    if out.shape != expected.shape or out.dtype != expected.dtype:
        return Check(name, BITWISE, float("inf"), f"{out.dtype}{tuple(out.shape)} vs "
                     f"{expected.dtype}{tuple(expected.shape)}")
    if out.element_size() == 1:
        out, expected = out.view(torch.uint8), expected.view(torch.uint8)
    bad = out != expected
    where = tuple(int(i) for i in bad.nonzero()[0]) if bool(bad.any()) else ()
    return Check(name, BITWISE, float(bad.sum()), f"first mismatch at {where}" if where else "")


def _attention_inputs(
    spec: EinsumSpec, cfg: DSv4Config, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o = _randn((spec.tokens, cfg.n_heads, cfg.head_dim), g, spec.device).to(torch.bfloat16)
    positions = torch.randint(0, MAX_POSITION, (spec.tokens,), generator=g, device=spec.device)
    freqs = yarn_frequencies(cfg, ROPE_COMPRESS_RATIO).to(spec.device)
    return o, positions, freqs


def _run_fp8_einsum(spec: EinsumSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    g = _generator(spec)
    h, r, d = cfg.o_groups, cfg.o_group_dim, cfg.o_lora_rank
    x = _randn((spec.tokens, h, r), g, spec.device).to(torch.bfloat16)
    y = _randn((h, d, r), g, spec.device) * r**-0.5
    a = quantize_per_token(x, ref.SCALE_BLOCK, spec.fmt)
    b = quantize_per_block(y, ref.SCALE_BLOCK, spec.fmt)
    out = fp8_einsum("bhr,hdr->bhd", a, b, backend=backend)
    expected = ref.fp8_einsum("bhr,hdr->bhd", a, b)
    unquantized = torch.einsum("bhr,hdr->bhd", x.float(), y)
    return [_diff_check("vs reference, same FP8 inputs", FP8_GEMM_SIMULATED, out, expected),
            _diff_check("vs unquantized fp32 einsum", FP8_END_TO_END, out, unquantized)]


def _run_quantize_attn_output(spec: EinsumSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    o, positions, freqs = _attention_inputs(spec, cfg, _generator(spec))
    q, s = quantize_attn_output(o, positions, freqs, n_groups=cfg.o_groups, fmt=spec.fmt, backend=backend)
    rq, rs = ref.quantize_attn_output(o, positions, freqs, n_groups=cfg.o_groups, fmt=spec.fmt)
    return [_mismatch_check("FP8 bytes equal the reference's", q, rq),
            _mismatch_check("scales equal the reference's", s, rs)]


def _fp8_weight(spec: EinsumSpec, n: int, k: int, g: torch.Generator) -> Fp8Weight:
    """A [N, K] Gaussian weight with std 1/sqrt(K) (as `reference.weights.random_linear`), drawn on the
    case's device and quantized to 128x128 block FP8."""
    return Fp8Weight(*quantize_per_block(_randn((n, k), g, spec.device) * k**-0.5, fmt=spec.fmt))


def _run_output_projection(spec: EinsumSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    g = _generator(spec)
    o, positions, freqs = _attention_inputs(spec, cfg, g)
    rank = cfg.o_groups * cfg.o_lora_rank
    wo_a, wo_b = _fp8_weight(spec, rank, cfg.o_group_dim, g), _fp8_weight(spec, cfg.dim, rank, g)
    numerics = VLLM_NVIDIA.replace(fp8_format=spec.fmt)
    out = output_projection(o, positions, freqs, wo_a, wo_b, numerics, backend=backend)
    expected = ref.output_projection(o, positions, freqs, wo_a, wo_b, numerics)
    exact = ref.output_projection(o, positions, freqs, wo_a, wo_b, EXACT)
    return [_diff_check("vs reference, same numerics", OUTPUT_PROJECTION_SIMULATED, out, expected),
            _diff_check("vs EXACT reference", FP8_END_TO_END, out, exact)]


def _run_fp8_linear(spec: EinsumSpec, backend: str) -> list[Check]:
    _require(spec, backend)
    cfg = get_config(spec.config)
    g = _generator(spec)
    wo_b = _fp8_weight(spec, cfg.dim, cfg.o_groups * cfg.o_lora_rank, g)
    x = _randn((spec.tokens, wo_b.shape[1]), g, spec.device).to(torch.bfloat16)
    numerics = OFFICIAL.replace(fp8_format=spec.fmt)
    out = fp8_linear(x, wo_b, numerics, backend=backend)
    return [_diff_check("vs reference, same numerics", FP8_GEMM_SIMULATED, out, ref_fp8_linear(x, wo_b, numerics)),
            _diff_check("vs EXACT reference", FP8_END_TO_END, out, ref_fp8_linear(x, wo_b, EXACT))]


_RUNNERS = {
    "fp8_einsum": _run_fp8_einsum,
    "quantize_attn_output": _run_quantize_attn_output,
    "output_projection": _run_output_projection,
    "fp8_linear": _run_fp8_linear,
}
