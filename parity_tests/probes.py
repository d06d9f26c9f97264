"""Probes: seeded inputs for one public op and how to call it, for the suites that run an op several
times on the same inputs (golden results, determinism, batch invariance, CUDA graphs, custom ops).

A `Probe` separates weights (seeded by `seed`, the same for every variant) from activations (seeded per
variant): variant 0 is the probe's own inputs, variant 1 "other tokens / sequences" of the same layer (any
count; `join` puts variants 0 and 1 into one batch and returns a function that cuts variant 0's output back
out), variant 2 other values in exactly variant 0's shapes (what a CUDA graph replays on). Every call goes
through the public `optimized` API with `backend=`; `backend="reference"` is the
reference itself (that is what the golden results record).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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
        seed: weights seed (activations are seeded per variant, see the module docstring).
        make: (device, variant) -> the call's inputs.
        call: (inputs, backend) -> output tensor or tuple of tensors.
        fmt: FP8 format of the inputs.
        join: (inputs_a, inputs_b) -> (inputs of one call over both, extract); `extract(output)` is the part
            of the joint output that belongs to `inputs_a`. None: the op has no batch dimension.
        decode: a decode-path call (the CUDA-graph suite captures it).
        golden: recorded in `parity_tests/golden/`.
        only: the backends that implement this call (None: every backend registered for `op`); the others
            report it as not run, with `only_reason`.
        only_reason: why the other backends do not implement it.
        prepare: (inputs, backend) -> inputs: a per-backend setup that is not part of the call (a decode
            step's cache, filled by a prefill on that backend); runs before `call`, outside any capture.
        invariance: used by the determinism, batch-invariance and CUDA-graph suites (False where another probe
            runs the same kernels, to spare the Triton interpreter).
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
    only: tuple[str, ...] | None = None
    only_reason: str = ""
    prepare: Callable[[Inputs, str | None], Inputs] | None = field(default=None, compare=False, repr=False)
    invariance: bool = True

    @property
    def id(self) -> str:
        return f"{self.op}[{self.config},{self.shape},{self.fmt},seed={self.seed}]"

    def inputs(self, backend: str | None, device: str, variant: int = 0) -> Inputs:
        """Fresh inputs of `variant`, prepared for `backend`."""
        return self.ready(self.make(device, variant), backend)

    def ready(self, inputs: Inputs, backend: str | None) -> Inputs:
        """`inputs` after the per-backend `prepare` step (unchanged without one)."""
        return inputs if self.prepare is None else self.prepare(inputs, backend)

    def run(self, backend: str | None, device: str, variant: int = 0) -> list[torch.Tensor]:
        """The op's outputs on fresh inputs, as a flat list of tensors."""
        return as_tensors(self.call(self.inputs(backend, device, variant), backend))

    def require(self, backend: str) -> None:
        """NotRun unless `backend` implements this call."""
        from parity_tests.cases import NotRun

        if self.only is not None and backend not in self.only:
            raise NotRun(f"{backend}: {self.only_reason or f'implements {self.op} only on {self.only}'}")


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
    only = {"bf16": (("reference",), "the optimized backends implement wo_a='fp8' (the official bf16 einsum is "
                                     "the reference's)"), "fp8": (None, "")}
    return [Probe("output_projection", config, f"t={t},wo_a={numerics.wo_a}", 31, make_for(t),
                  call_with(numerics.replace(fp8_format=fmt)), fmt, decode=t <= 128, golden=config == "TINY",
                  only=only[numerics.wo_a][0], only_reason=only[numerics.wo_a][1])
            for t in tokens for numerics in (OFFICIAL, VLLM_NVIDIA)]


def _fp8_linear_probes(config: str, device: str) -> list[Probe]:
    from reference.config import get_config
    from reference.numerics import OFFICIAL
    from reference.weights import random_fp8_weight

    cfg = get_config(config)
    fmt = _native_fmt(device)
    numerics = OFFICIAL.replace(fp8_format=fmt)
    n, k = cfg.q_lora_rank, cfg.dim  # wq_a's shape

    def make_for(t: int) -> Callable[[str, int], Inputs]:
        def make(dev: str, variant: int) -> Inputs:
            return {"x": _randn((t, k), _gen(41 + 1000 * (variant + 1)), dev),
                    "weight": random_fp8_weight(n, k, fmt=fmt, generator=_gen(41), device=dev)}
        return make

    def call(inputs: Inputs, backend: str | None) -> Outputs:
        import optimized

        return optimized.fp8_linear(inputs["x"], inputs["weight"], numerics, backend=backend)

    tokens = _EINSUM_TOKENS[config] if config == "TINY" or device != "cpu" else ()
    return [Probe("fp8_linear", config, f"t={t},n={n},k={k}", 41, make_for(t), call, fmt, decode=t <= 128,
                  golden=config == "TINY") for t in tokens]


probes_for("fp8_einsum")(_einsum_probes)
probes_for("quantize_attn_output")(_quantize_attn_output_probes)
probes_for("output_projection")(_output_projection_probes)
probes_for("fp8_linear")(_fp8_linear_probes)


# ------------------------------------------------------------------------------------------------
# MoE (spec §5): route, experts, moe
# ------------------------------------------------------------------------------------------------

_MOE_TOKENS = {"TINY": (7,), "FLASH": (64, 512), "PRO": (64, 512)}
_OTHER_TOKENS = 5  # tokens of the other batch members in a batch-invariance join (placed first)


@functools.lru_cache(maxsize=2)
def _moe_weights(config: str, layer: int, expert_format: str, fmt: str, device: str) -> Any:
    """Random MoE weights, drawn on `device` (FLASH / PRO experts are 6.4 G / 25 G parameters), cached."""
    from reference.config import get_config
    from reference.moe import random_moe_weights

    g = torch.Generator(device=device).manual_seed(51)
    return random_moe_weights(get_config(config), layer, expert_format=expert_format, fmt=fmt, generator=g,
                              device=device)


def _tokens(config: str, t: int, seed: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] bf16 ~ N(0, 1) (a unit-RMS ffn_norm output) and token ids [T] int64."""
    from reference.config import get_config

    cfg = get_config(config)
    g = _gen(seed)
    return _randn((t, cfg.dim), g, dev), torch.randint(0, cfg.vocab_size, (t,), generator=g).to(dev)


def _join_rows(keys: tuple[str, ...]) -> Callable[[Inputs, Inputs], tuple[Inputs, Callable[[Outputs], Outputs]]]:
    """Join two variants by putting the other one's rows (tokens) first in each of `keys`; the extract cuts the
    first one's rows back out of every output."""

    def join(mine: Inputs, other: Inputs) -> tuple[Inputs, Callable[[Outputs], Outputs]]:
        n = other[keys[0]].shape[0]
        joined = dict(mine, **{k: torch.cat((other[k], mine[k])) for k in keys})
        return joined, lambda out: [t[n:] for t in as_tensors(out)]

    return join


def _moe_probes(config: str, device: str) -> list[Probe]:
    """route / experts / moe on a non-hash layer (FP8 experts) and a hash layer (MXFP4 experts). Decode-path
    probes are the non-hash ones: a hash layer reads its token-id check back to the host (`optimized.moe`)."""
    from reference.config import get_config
    from reference.numerics import OFFICIAL

    cfg = get_config(config)
    fmt = _native_fmt(device)
    numerics = OFFICIAL.replace(fp8_format=fmt)
    topk_layer, hash_layer = cfg.n_hash_layers, 0
    probes = []
    for t in _MOE_TOKENS[config]:
        for layer, expert_format in ((topk_layer, "fp8"), (hash_layer, "fp4")):
            kind = "hash" if layer == hash_layer else "topk"

            def make(dev: str, variant: int, t: int = t, layer: int = layer, ef: str = expert_format) -> Inputs:
                from reference.moe import route

                n = _OTHER_TOKENS if variant == 1 else t
                x, token_ids = _tokens(config, n, 61 + 1000 * (variant + 1), dev)
                w = _moe_weights(config, layer, ef, fmt, dev)
                ids, weights = route(x, w.gate, w.bias, token_ids=token_ids if w.tid2eid is not None else None,
                                     tid2eid=w.tid2eid, cfg=cfg)
                return {"x": x, "token_ids": token_ids if w.tid2eid is not None else None, "weights": w,
                        "topk_ids": ids, "topk_weights": weights}

            def call_route(i: Inputs, backend: str | None) -> Outputs:
                import optimized

                w = i["weights"]
                return optimized.route(i["x"], w.gate, w.bias, token_ids=i["token_ids"], tid2eid=w.tid2eid, cfg=cfg,
                                       backend=backend)

            def call_experts(i: Inputs, backend: str | None) -> Outputs:
                import optimized

                w = i["weights"]
                return optimized.experts(i["x"], i["topk_ids"], i["topk_weights"], w.w13, w.w2,
                                         swiglu_limit=cfg.swiglu_limit, numerics=numerics, backend=backend)

            def call_moe(i: Inputs, backend: str | None) -> Outputs:
                import optimized

                return optimized.moe(i["x"], i["weights"], token_ids=i["token_ids"], cfg=cfg, numerics=numerics,
                                     backend=backend)

            token_keys = ("x",) if kind == "topk" else ("x", "token_ids")
            label = f"T={t},{kind}"
            probes += [
                # no join for route: the claim is about the layer's output (moe). The Triton router's fp32
                # weights change in the last bits with the batch in the interpreter (15 of 84 at T=7 + 5), which
                # the bf16 layer output absorbs; the reference router is batch-invariant (fp64 accumulation).
                Probe("route", config, label, 61, make, call_route, fmt, decode=kind == "topk" and t <= 128,
                      golden=config == "TINY"),
                # on the CPU the moe probes run the same expert kernels (interpreter time)
                Probe("experts", config, f"{label},{expert_format}", 61, make, call_experts, fmt,
                      _join_rows(("x", "topk_ids", "topk_weights")), golden=config == "TINY",
                      invariance=device != "cpu"),
                Probe("moe", config, f"{label},{expert_format}", 61, make, call_moe, fmt, _join_rows(token_keys),
                      decode=kind == "topk" and t <= 128, golden=config == "TINY"),
            ]
    return probes


for _op in ("route", "experts", "moe"):
    probes_for(_op)(lambda config, device, _op=_op: [p for p in _moe_probes(config, device) if p.op == _op])


# ------------------------------------------------------------------------------------------------
# Real checkpoints: the layer cases on a checkpoint's weights (`dsv4-parity --checkpoint DIR --layer N`)
# ------------------------------------------------------------------------------------------------

CHECKPOINT_TOKENS = {"cpu": 16, "cuda": 64}
CHECKPOINT_OPS = ("attention", "moe")


def checkpoint_config(path: str | Path) -> Any:
    """The `DSv4Config` of a checkpoint folder (its Hugging Face `config.json`)."""
    from reference.config import from_hf_config

    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(f"checkpoint: {config} not found (a DeepSeek V4 checkpoint folder holds config.json)")
    return from_hf_config(json.loads(config.read_text()))


@functools.lru_cache(maxsize=1)
def _checkpoint_layer(path: str, layer: int, device: str) -> Any:
    from reference.weights import load_layer, open_checkpoint

    return load_layer(open_checkpoint(path), checkpoint_config(path), layer, device=device)


def _checkpoint_moe(path: str, layer: int, backend: str, device: str) -> list[Any]:
    """The MoE layer on the checkpoint's weights vs the reference, with the MoE parity checks (`ops.moe`)."""
    import optimized
    from parity_tests.cases import Check
    from parity_tests.ops.moe import output_checks, route_agreement
    from parity_tests.tolerances import ROUTE_SETS
    from reference.linear import rms_norm
    from reference.moe import moe, router_scores
    from reference.numerics import EXACT, OFFICIAL

    cfg = checkpoint_config(path)
    weights = _checkpoint_layer(path, layer, device)
    w = weights.moe
    g = _gen(71)
    x = rms_norm(_randn((CHECKPOINT_TOKENS[torch.device(device).type], cfg.dim), g, device), weights.ffn_norm,
                 cfg.norm_eps)
    token_ids = torch.randint(0, cfg.vocab_size, (x.shape[0],), generator=g).to(device) if w.is_hash else None
    ref = moe(x, w, token_ids=token_ids, cfg=cfg, numerics=OFFICIAL)
    ref_exact = moe(x, w, token_ids=token_ids, cfg=cfg, numerics=EXACT)
    ref_ids, ref_weights = optimized.route(x, w.gate, w.bias, token_ids=token_ids, tid2eid=w.tid2eid, cfg=cfg,
                                           backend="reference")
    cand_ids, _ = optimized.route(x, w.gate, w.bias, token_ids=token_ids, tid2eid=w.tid2eid, cfg=cfg,
                                  backend=backend)
    keys = None if w.is_hash else router_scores(x, w.gate) + w.bias
    agree = route_agreement(ref_ids, ref_weights, cand_ids, keys, cfg.n_routed_experts)
    cand = optimized.moe(x, w, token_ids=token_ids, cfg=cfg, numerics=OFFICIAL, backend=backend)
    sets = Check("expert sets (candidate router)", ROUTE_SETS, int(agree.unexplained.sum()),
                 f"{int(agree.near_tie.sum())} near-tie tokens left out of the output comparison")
    return [sets, *output_checks(cand, ref, ref_exact, rows=~agree.near_tie)]


def _checkpoint_attention(path: str, layer: int, backend: str, device: str) -> list[Any]:
    """The attention layer (one prompt from position 0) on the checkpoint's weights vs the reference layer, with
    the numerics every backend implements (FP8 output einsum, fp32 indexer scores) and the layer bound."""
    import optimized
    from parity_tests.cases import Check
    from parity_tests.metrics import calc_diff, max_abs_error, worst_position
    from parity_tests.tolerances import ATTENTION_LAYER_SIMULATED
    from reference.attention import Attention
    from reference.linear import rms_norm

    cfg = checkpoint_config(path)
    weights = _checkpoint_layer(path, layer, device)
    numerics = _attention_numerics("e4m3fn")
    n = CHECKPOINT_TOKENS[torch.device(device).type]
    x = rms_norm(_randn((n, cfg.dim), _gen(73), device), weights.attn_norm, cfg.norm_eps)
    positions = torch.arange(n, device=device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    expected = Attention(cfg, layer, weights.attention, numerics)(x, positions, cu).float()
    out = optimized.Attention(cfg, layer, weights.attention, numerics, backend=backend)(x, positions, cu).float()
    return [Check("layer vs reference (prefill)", ATTENTION_LAYER_SIMULATED, calc_diff(out, expected),
                  f"max_abs={max_abs_error(out, expected):.3g} at {worst_position(out, expected)}")]


def checkpoint_tasks(path: str | Path, layer: int, device: str, ops: list[str] | None,
                     backends: list[str] | None) -> list[Any]:
    """One task per (layer op, backend) on the weights of layer `layer` of the checkpoint at `path`."""
    from optimized.backends import BACKENDS
    from parity_tests.report import Task

    cfg = checkpoint_config(path)
    if not 0 <= layer <= cfg.n_layers:
        raise ValueError(f"--layer: expected 0..{cfg.n_layers} ({cfg.n_layers} is the MTP layer), got {layer}")
    runners = {"attention": _checkpoint_attention, "moe": _checkpoint_moe}
    shape = f"layer={layer},{cfg.layer_kind(layer)},T={CHECKPOINT_TOKENS[torch.device(device).type]}"
    return [Task("checkpoint", op, cfg.name, shape, "e4m3fn", 71, backend,
                 functools.partial(runners[op], str(path), layer, backend, device), registry_op=op)
            for op in CHECKPOINT_OPS if not ops or op in ops
            for backend in BACKENDS if backend != "reference" and (backends is None or backend in backends)]


# ------------------------------------------------------------------------------------------------
# Attention (spec §3): sparse attention, and the layer at prefill and at a decode step
# ------------------------------------------------------------------------------------------------

# (layer, prompt lengths of the sequences, decode) per config; the other batch of a join is one sequence.
_ATTENTION_LAYERS = {"TINY": 1, "FLASH": 2, "PRO": 2}  # CSA layers (window + indexer top-k + compressor)
_ATTENTION_PROMPTS = {"TINY": (9, 6), "FLASH": (300, 517), "PRO": (300, 517)}
_ATTENTION_DECODE = {"TINY": (2,), "FLASH": (8, 64), "PRO": (8, 64)}  # sequences per decode batch


@functools.lru_cache(maxsize=2)
def _attention_weights(config: str, layer: int, fmt: str, device: str) -> Any:
    from reference.attention import random_attention_weights
    from reference.config import get_config

    return random_attention_weights(get_config(config), layer, fmt=fmt, generator=_gen(81), device=device)


def _attention_numerics(fmt: str) -> Any:
    """What every backend implements: the FP8 output einsum, fp32 indexer scores (vLLM / DeepGEMM numerics)."""
    from reference.numerics import VLLM_NVIDIA

    return VLLM_NVIDIA.replace(fp8_format=fmt)


def _sequences(config: str, lengths: tuple[int, ...], seed: int, dev: str) -> Inputs:
    """x [T, D] bf16, positions [T] int64 (each sequence from 0) and cu_seqlens [B + 1] int32."""
    from reference.config import get_config

    cfg = get_config(config)
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"x": _randn((int(cu[-1]), cfg.dim), _gen(seed), dev), "positions": positions.to(dev),
            "cu_seqlens": cu.to(dev)}


def _join_sequences(keys: tuple[str, ...] = ("",)) -> Callable[[Inputs, Inputs],
                                                                tuple[Inputs, Callable[[Outputs], Outputs]]]:
    """Put the other batch's sequences first, for each group `prefix` in `keys` (x / positions / cu_seqlens
    under `prefix + name`); the extract cuts the first batch's tokens back out."""

    def join(mine: Inputs, other: Inputs) -> tuple[Inputs, Callable[[Outputs], Outputs]]:
        joined = dict(mine)
        for prefix in keys:
            a, b = other, mine
            joined[prefix + "x"] = torch.cat((a[prefix + "x"], b[prefix + "x"]))
            joined[prefix + "positions"] = torch.cat((a[prefix + "positions"], b[prefix + "positions"]))
            cu_b = b[prefix + "cu_seqlens"][1:] + a[prefix + "cu_seqlens"][-1]
            joined[prefix + "cu_seqlens"] = torch.cat((a[prefix + "cu_seqlens"], cu_b))
        n = other["x"].shape[0]
        return joined, lambda out: [t[n:] for t in as_tensors(out)]

    return join


def _attention_probes(config: str, device: str) -> list[Probe]:
    from reference.config import get_config

    cfg = get_config(config)
    fmt = _native_fmt(device)
    numerics = _attention_numerics(fmt)
    layer = _ATTENTION_LAYERS[config]

    def module(i: Inputs, backend: str | None) -> Any:
        import optimized

        return optimized.Attention(cfg, layer, i["weights"], numerics, backend=backend)

    def make_prefill(dev: str, variant: int) -> Inputs:
        lengths = (5,) if variant == 1 else _ATTENTION_PROMPTS[config]
        return {**_sequences(config, lengths, 91 + 1000 * variant, dev),
                "weights": _attention_weights(config, layer, fmt, dev)}

    def call_prefill(i: Inputs, backend: str | None) -> Outputs:
        return module(i, backend)(i["x"], i["positions"], i["cu_seqlens"])

    def make_decode_for(batch: int) -> Callable[[str, int], Inputs]:
        def make(dev: str, variant: int) -> Inputs:
            prompts = _ATTENTION_PROMPTS[config]
            lengths = (5,) if variant == 1 else tuple(prompts[b % len(prompts)] + b for b in range(batch))
            prompt = _sequences(config, lengths, 95 + 1000 * variant, dev)
            step = _sequences(config, (1,) * len(lengths), 97 + 1000 * variant, dev)
            step["positions"] = torch.tensor(lengths, device=dev)
            # host metadata, as a serving engine keeps it: a decode step then never reads the device
            step["cu_seqlens"] = step["cu_seqlens"].cpu()
            return {**{f"prompt_{k}": v for k, v in prompt.items()}, **step,
                    "weights": _attention_weights(config, layer, fmt, dev)}
        return make

    def prepare_decode(i: Inputs, backend: str | None) -> Inputs:
        """The layer module of `backend` and its cache after the prompts (the decode step is the call)."""
        import optimized
        from reference.cache import AttentionCache as ReferenceCache

        layer_module = module(i, backend)
        batch = i["prompt_cu_seqlens"].shape[0] - 1
        dev = i["x"].device
        if layer_module.backend == "reference":
            cache = ReferenceCache.empty(cfg, layer, batch, dev)
        else:
            cache = optimized.AttentionCache.empty(cfg, layer, batch, dev, packed=numerics.kv_fp8_sim)
        layer_module(i["prompt_x"], i["prompt_positions"], i["prompt_cu_seqlens"], cache)
        return {**i, "module": layer_module, "cache": cache}

    def call_decode(i: Inputs, backend: str | None) -> Outputs:
        return i["module"](i["x"], i["positions"], i["cu_seqlens"], i["cache"])

    prompts = "+".join(map(str, _ATTENTION_PROMPTS[config]))
    kind = cfg.layer_kind(layer)
    probes = [Probe("attention", config, f"{kind},prefill,T={prompts}", 91, make_prefill, call_prefill, fmt,
                    _join_sequences(), golden=config == "TINY")]
    for batch in _ATTENTION_DECODE[config]:
        probes.append(Probe("attention", config, f"{kind},decode,B={batch}", 95, make_decode_for(batch),
                            call_decode, fmt, _join_sequences(("", "prompt_")), decode=True,
                            golden=config == "TINY", prepare=prepare_decode))
    return probes


def _sparse_attention_probes(config: str, device: str) -> list[Probe]:
    """Sparse attention over a pool of bf16 rows and over the same rows packed as the 584-byte FP8 cache."""
    from reference.cache import pack_kv
    from reference.config import get_config

    cfg = get_config(config)
    fmt = _native_fmt(device)
    tokens = {"TINY": (5,), "FLASH": (64, 512), "PRO": (64, 512)}[config]
    pool = {"TINY": 300, "FLASH": 4096, "PRO": 4096}[config]
    k = cfg.window_size + cfg.index_topk

    def make_for(t: int, packed: bool) -> Callable[[str, int], Inputs]:
        def make(dev: str, variant: int) -> Inputs:
            g = _gen(101)
            kv = _randn((pool, cfg.head_dim), g, "cpu")
            sink = torch.randn(cfg.n_heads, generator=g)
            gt = _gen(102 + 1000 * variant)
            n = _OTHER_TOKENS if variant == 1 else t
            q = _randn((n, cfg.n_heads, cfg.head_dim), gt, dev)
            indices = torch.stack([torch.randperm(pool, generator=gt)[:k] for _ in range(n)]).to(torch.int32)
            indices[:, -3:] = -1  # empty slots
            if n:
                indices[0] = -1  # a token without any slot: defined as 0
            return {"q": q, "kv": (pack_kv(kv, fmt) if packed else kv).to(dev), "indices": indices.to(dev),
                    "sink": sink.to(dev)}
        return make

    def call_for(packed: bool) -> Callable[[Inputs, str | None], Outputs]:
        def call(i: Inputs, backend: str | None) -> Outputs:
            import optimized

            return optimized.sparse_attention(i["q"], i["kv"], i["indices"], i["sink"], cfg.head_dim**-0.5,
                                              fmt=fmt, backend=backend)
        return call

    return [Probe("sparse_attention", config, f"T={t},K={k},{'packed' if packed else 'bf16'}", 101,
                  make_for(t, packed), call_for(packed), fmt, _join_rows(("q", "indices")), decode=t <= 128,
                  golden=config == "TINY") for t in tokens for packed in (False, True)]


probes_for("attention")(_attention_probes)
probes_for("sparse_attention")(_sparse_attention_probes)
