"""Probes: seeded inputs for one public op and how to call it, for the suites that run an op several
times on the same inputs (golden results, determinism, batch invariance, CUDA graphs, custom ops).

A `Probe` separates weights (seeded by `seed`, the same for every variant) from activations (seeded by
`seed + variant`), so that `variant=1` is "other tokens / sequences" for the same layer, and `join`
puts two variants into one batch and returns a function that cuts the first variant's output back
out. Every call goes through the public `optimized` API with `backend=`; `backend="reference"` is the
reference itself (that is what the golden results record).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Inputs = dict[str, Any]
Outputs = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class Probe:
    """One op at one shape with fixed seeds.

    Attributes:
        op: the public op name (as registered in `optimized.backends`).
        config: "TINY", "FLASH" or "PRO".
        shape: short shape label ("b=4").
        seed: weights seed; activations of variant `v` use `seed + 1000 * v`.
        make: (device, variant) -> the call's inputs.
        call: (inputs, backend) -> output tensor or tuple of tensors.
        fmt: FP8 format of the inputs.
        join: (inputs_a, inputs_b) -> (inputs of one call over both, extract); `extract(output)` is the part
            of the joint output that belongs to `inputs_a`. None: the op has no batch dimension.
        decode: a decode-path call (the CUDA-graph suite captures it).
        golden: recorded in `parity_tests/golden/`.
    """

    op: str
    config: str
    shape: str
    seed: int
    make: Callable[[str, int], Inputs] = field(compare=False, repr=False)
    call: Callable[[Inputs, str | None], Outputs] = field(compare=False, repr=False)
    fmt: str = "e4m3fn"
    join: Callable[[Inputs, Inputs], tuple[Inputs, Callable[[Outputs], Outputs]]] | None = field(
        default=None, compare=False, repr=False)
    decode: bool = False
    golden: bool = False

    @property
    def id(self) -> str:
        return f"{self.op}[{self.config},{self.shape},{self.fmt},seed={self.seed}]"

    def run(self, backend: str | None, device: str, variant: int = 0) -> list[torch.Tensor]:
        """The op's outputs on fresh inputs, as a flat list of tensors."""
        return as_tensors(self.call(self.make(device, variant), backend))


ProbeProvider = Callable[[str, str], list[Probe]]
_PROBES: dict[str, ProbeProvider] = {}


def probes_for(op: str) -> Callable[[ProbeProvider], ProbeProvider]:
    """Register the probe provider of `op`: `(config_name, device) -> list[Probe]`."""

    def wrap(fn: ProbeProvider) -> ProbeProvider:
        _PROBES[op] = fn
        return fn

    return wrap


def probe_providers() -> dict[str, ProbeProvider]:
    return dict(_PROBES)


def all_probes(config: str, device: str, ops: list[str] | None = None) -> list[Probe]:
    """Every probe of `config` on `device`, optionally only for `ops` (unknown ops are ignored: other
    suites may know them)."""
    return [p for op, make in _PROBES.items() if not ops or op in ops for p in make(config, device)]


def as_tensors(out: Outputs) -> list[torch.Tensor]:
    """An op's output as a flat list of tensors (None entries dropped)."""
    if isinstance(out, torch.Tensor):
        return [out]
    flat: list[torch.Tensor] = []
    for item in out:
        if item is None:
            continue
        flat.extend(as_tensors(item) if not isinstance(item, torch.Tensor) else [item])
    return flat


def bitwise_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bytes differ (NaN payloads and the sign of zero included); every element when the shapes
    or dtypes differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    if a.is_floating_point() and a.element_size() > 1:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(ints), b.contiguous().view(ints)
    elif a.is_floating_point():
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return int((a != b).sum())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _native_fmt(device: str) -> str:
    """The FP8 format of the probes: e4m3fn on the CPU (what the golden files hold), else the hardware's own."""
    if device == "cpu":
        return "e4m3fn"
    from optimized.backends import detect

    return detect().fp8_format


def _randn(shape: tuple[int, ...], g: torch.Generator, device: str, dtype: torch.dtype = torch.bfloat16,
           std: float = 1.0) -> torch.Tensor:
    """Gaussian values drawn on the CPU (the same on every device), then moved."""
    return (torch.randn(shape, generator=g) * std).to(dtype).to(device)


# ------------------------------------------------------------------------------------------------
# FP8 einsum, attention-output quantization, output projection (spec §3.6, §4)
# ------------------------------------------------------------------------------------------------

# Token counts: TINY uses 5 (not a multiple of the 4-row scale alignment); the GPU configs a decode batch
# and a prefill chunk.
_EINSUM_TOKENS = {"TINY": (5,), "FLASH": (128, 4096), "PRO": (128, 4096)}
_GOLDEN_FLASH_TOKENS = 4  # one FLASH-shape golden entry per op (cheap on a CPU)


def _einsum_probes(config: str, device: str) -> list[Probe]:
    from reference.config import get_config
    from reference.formats import quantize_per_token
    from reference.weights import random_fp8_weight

    cfg = get_config(config)
    h, r, d = cfg.o_groups, cfg.o_group_dim, cfg.o_lora_rank

    fmt = _native_fmt(device)

    def make_for(b: int, seed: int) -> Callable[[str, int], Inputs]:
        def make(dev: str, variant: int) -> Inputs:
            w = random_fp8_weight(d, r, fmt=fmt, generator=_gen(seed), batch=(h,), device=dev)
            a, sa = quantize_per_token(_randn((b, h, r), _gen(seed + 1000 * (variant + 1)), "cpu"), 128, fmt)
            return {"a": (a.to(dev), sa.to(dev)), "b": (w.data, w.scale)}
        return make

    def call(inputs: Inputs, backend: str | None) -> Outputs:
        import optimized

        return optimized.fp8_einsum("bhr,hdr->bhd", inputs["a"], inputs["b"], backend=backend)

    tokens = _EINSUM_TOKENS[config]
    probes = [Probe("fp8_einsum", config, f"b={b},h={h}", 11, make_for(b, 11), call, fmt, decode=b <= 128,
                    golden=config == "TINY") for b in tokens]
    if config == "FLASH" and device == "cpu":
        b = _GOLDEN_FLASH_TOKENS
        probes = [Probe("fp8_einsum", config, f"b={b},h={h}", 11, make_for(b, 11), call, golden=True)]
    return probes


def _attn_output_inputs(cfg_name: str, t: int, seed: int, dev: str, variant: int) -> Inputs:
    from reference.config import get_config
    from reference.rope import yarn_frequencies

    cfg = get_config(cfg_name)
    g = _gen(seed + 1000 * (variant + 1))
    o = _randn((t, cfg.n_heads, cfg.head_dim), g, dev)
    # positions straddle the 65536 YaRN original length so both ends of the ramp rotate visibly
    positions = torch.randint(0, 2 * cfg.original_seq_len, (t,), generator=g).to(dev)
    return {"o": o, "positions": positions, "freqs": yarn_frequencies(cfg, 4).to(dev)}


def _quantize_attn_output_probes(config: str, device: str) -> list[Probe]:
    from reference.config import get_config

    cfg = get_config(config)
    fmt = _native_fmt(device)

    def call(inputs: Inputs, backend: str | None) -> Outputs:
        import optimized

        return optimized.quantize_attn_output(inputs["o"], inputs["positions"], inputs["freqs"],
                                              n_groups=cfg.o_groups, fmt=fmt, backend=backend)

    tokens = (_GOLDEN_FLASH_TOKENS,) if config == "FLASH" and device == "cpu" else _EINSUM_TOKENS[config]
    return [Probe("quantize_attn_output", config, f"t={t}", 21,
                  lambda dev, v, t=t: _attn_output_inputs(config, t, 21, dev, v), call, fmt, decode=t <= 128,
                  golden=device == "cpu") for t in tokens]


def _output_projection_probes(config: str, device: str) -> list[Probe]:
    from reference.config import get_config
    from reference.numerics import OFFICIAL, VLLM_NVIDIA
    from reference.weights import random_fp8_weight

    cfg = get_config(config)
    n = cfg.o_groups * cfg.o_lora_rank
    fmt = _native_fmt(device)

    def make_for(t: int) -> Callable[[str, int], Inputs]:
        def make(dev: str, variant: int) -> Inputs:
            inputs = _attn_output_inputs(config, t, 31, dev, variant)
            g = _gen(31)
            inputs["wo_a"] = random_fp8_weight(n, cfg.o_group_dim, fmt=fmt, generator=g, device=dev)
            inputs["wo_b"] = random_fp8_weight(cfg.dim, n, fmt=fmt, generator=g, device=dev)
            return inputs
        return make

    def call_with(numerics: object) -> Callable[[Inputs, str | None], Outputs]:
        def call(inputs: Inputs, backend: str | None) -> Outputs:
            import optimized

            return optimized.output_projection(inputs["o"], inputs["positions"], inputs["freqs"], inputs["wo_a"],
                                               inputs["wo_b"], numerics, backend=backend)
        return call

    tokens = _EINSUM_TOKENS[config] if config == "TINY" or device != "cpu" else ()
    return [Probe("output_projection", config, f"t={t},wo_a={numerics.wo_a}", 31, make_for(t),
                  call_with(numerics.replace(fp8_format=fmt)), fmt, decode=t <= 128, golden=config == "TINY")
            for t in tokens for numerics in (OFFICIAL, VLLM_NVIDIA)]


probes_for("fp8_einsum")(_einsum_probes)
probes_for("quantize_attn_output")(_quantize_attn_output_probes)
probes_for("output_projection")(_output_projection_probes)
