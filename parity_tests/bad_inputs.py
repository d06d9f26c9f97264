"""The bad-input corpus: malformed calls of the public API and what each must do.

Every entry is one malformed call (wrong dtype, shape, device, layout, scale layout, FP8 format, empty
tensors, NaN / Inf inputs, out-of-range positions and indices, an unsupported backend) with either the
exact error type and a fragment of its message (the argument's name and what was expected), or the
output the API defines for it (NaN confined to the token that carried it, say). Errors must come from
the public function's checks, before any kernel launch; `test_bad_inputs.py` runs every entry, and the
CLI runs the corpus as the `bad_input` suite.

Entries that expect an error run once, through the best available backend (validation happens before
dispatch, so every backend shares it). Entries with a defined output run on every backend, since the
output comes from the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from parity_tests.cases import Check, NotRun
from parity_tests.report import Task
from parity_tests.tolerances import BAD_INPUT_CONTRACT

CATEGORIES = ("dtype", "shape", "device", "layout", "scale_layout", "fp8_format", "empty", "nonfinite", "range",
              "backend", "value")


@dataclass(frozen=True)
class BadInput:
    """One malformed call.

    Attributes:
        id: unique name ("fp8_einsum/a_not_fp8").
        op: the public op it calls (a registry op name, or the reference helper's name).
        category: one of CATEGORIES.
        call: (backend, device) -> output; builds its inputs on `device`.
        raises: the exact exception type expected (subclasses do not count), or None for a defined output.
        match: a fragment the message must contain.
        expect: for a defined output: output -> None when it is as documented, else what is wrong.
        optimized_only: the rule concerns the optimized backends (not run where only the reference is).
    """

    id: str
    op: str
    category: str
    call: Callable[[str | None, str], Any]
    raises: type[Exception] | None = None
    match: str = ""
    expect: Callable[[Any], str | None] | None = None
    optimized_only: bool = False

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category: expected one of {CATEGORIES}, got {self.category!r}")
        if (self.raises is None) == (self.expect is None):
            raise ValueError(f"{self.id}: give exactly one of raises / expect")

    @property
    def per_backend(self) -> bool:
        """A defined output comes from the kernel, so it is checked on every backend."""
        return self.expect is not None


def violation(entry: BadInput, backend: str | None, device: str) -> str | None:
    """None when the call behaves as the entry says, else what it did instead."""
    try:
        out = entry.call(backend, device)
    except NotRun:
        raise
    except Exception as exc:
        if entry.raises is None:
            return f"raised {type(exc).__name__}: {exc}; expected a defined output"
        if type(exc) is not entry.raises:
            return f"raised {type(exc).__name__}: {exc}; expected {entry.raises.__name__} ({entry.match!r})"
        if entry.match not in str(exc):
            return f"{type(exc).__name__} message {str(exc)!r} lacks {entry.match!r}"
        return None
    if entry.raises is not None:
        return f"returned normally; expected {entry.raises.__name__} ({entry.match!r})"
    assert entry.expect is not None
    return entry.expect(out)


def check(entry: BadInput, backend: str | None, device: str) -> list[Check]:
    if entry.optimized_only and backend == "reference":
        raise NotRun("concerns the optimized backends; none is available here")
    problem = violation(entry, backend, device)
    expected = (f"{entry.raises.__name__}: ...{entry.match}..." if entry.raises is not None
                else "the defined output")
    return [Check(f"bad_input/{entry.category}", BAD_INPUT_CONTRACT, int(problem is not None),
                  problem or f"as documented: {expected}")]


# ------------------------------------------------------------------------------------------------
# helpers for building entries
# ------------------------------------------------------------------------------------------------


def other_device(device: str) -> str:
    """A device the op's other tensors are not on: "meta" on a CPU-only machine, the CPU on a GPU one."""
    return "meta" if device == "cpu" else "cpu"


def nan_confined_to_rows(rows: list[int], dim: int = 0) -> Callable[[Any], str | None]:
    """Expectation: every output tensor is NaN-free outside index `rows` of `dim` (tokens), and each row in
    `rows` holds at least one NaN in the first output."""

    def expect(out: Any) -> str | None:
        from parity_tests.probes import as_tensors

        tensors = [t for t in as_tensors(out) if t.is_floating_point()]
        if not tensors:
            return "no floating-point output"
        for i, t in enumerate(tensors):
            bad = ~t.float().isfinite()
            other = bad.clone()
            other.index_fill_(dim, torch.tensor(rows, device=t.device), False)
            if bool(other.any()):
                where = other.nonzero()[0].tolist()
                return f"output {i}: a non-finite value outside rows {rows} (at {where})"
        first = ~tensors[0].float().isfinite()
        flagged = first.index_select(dim, torch.tensor(rows, device=first.device))
        if not bool(flagged.flatten(1).any(dim=1).all() if flagged.dim() > 1 else flagged.all()):
            return f"rows {rows} carry NaN in but none out"
        return None

    return expect


def all_finite(out: Any) -> str | None:
    """Expectation: every floating-point output is finite."""
    from parity_tests.probes import as_tensors

    for i, t in enumerate(as_tensors(out)):
        if t.is_floating_point() and not bool(t.float().isfinite().all()):
            return f"output {i} has non-finite values"
    return None


def empty_output(shape: tuple[int, ...]) -> Callable[[Any], str | None]:
    """Expectation: the (first) output has exactly `shape` (an empty tensor)."""

    def expect(out: Any) -> str | None:
        from parity_tests.probes import as_tensors

        got = tuple(as_tensors(out)[0].shape)
        return None if got == shape else f"output shape {got}, expected {shape}"

    return expect


# ------------------------------------------------------------------------------------------------
# the corpus
# ------------------------------------------------------------------------------------------------


def _formats_entries() -> list[BadInput]:
    from reference import formats
    from reference.weights import Fp4Weight, Fp8Weight

    def fp8(shape: tuple[int, ...], device: str) -> torch.Tensor:
        return torch.zeros(shape, device=device).to(torch.float8_e4m3fn)

    return [
        BadInput("formats/unknown_fp8_format", "quantize_per_token", "fp8_format",
                 lambda b, d: formats.quantize_per_token(torch.ones(2, 128, device=d), 128, "e5m2"),
                 ValueError, "fmt: expected one of"),
        BadInput("formats/act_quant_block_does_not_divide", "quantize_per_token", "shape",
                 lambda b, d: formats.quantize_per_token(torch.ones(2, 100, device=d), 128),
                 ValueError, "x: last dim 100 is not a multiple of the block size 128"),
        BadInput("formats/fp8_weight_scale_shape", "Fp8Weight", "scale_layout",
                 lambda b, d: Fp8Weight(fp8((256, 256), d), torch.ones(2, 3, device=d)),
                 ValueError, "scale: expected shape (2, 2)"),
        BadInput("formats/fp8_weight_scale_dtype", "Fp8Weight", "scale_layout",
                 lambda b, d: Fp8Weight(fp8((256, 256), d), torch.ones(2, 2, device=d, dtype=torch.bfloat16)),
                 TypeError, "scale: expected float32"),
        BadInput("formats/fp8_weight_not_fp8", "Fp8Weight", "dtype",
                 lambda b, d: Fp8Weight(torch.ones(256, 256, device=d), torch.ones(2, 2, device=d)),
                 ValueError, "got torch.float32"),
        BadInput("formats/fp4_weight_packed_dtype", "Fp4Weight", "dtype",
                 lambda b, d: Fp4Weight(torch.zeros(4, 16, device=d, dtype=torch.uint8), torch.ones(4, 1, device=d)),
                 TypeError, "packed: expected int8"),
        BadInput("formats/e8m0_nan_byte", "ue8m0_to_fp32", "nonfinite",
                 lambda b, d: formats.ue8m0_to_fp32(torch.tensor([127, 255], dtype=torch.uint8, device=d)),
                 ValueError, "0xFF is NaN"),
        BadInput("formats/scale_not_power_of_two", "fp32_to_ue8m0", "value",
                 lambda b, d: formats.fp32_to_ue8m0(torch.tensor([0.75], device=d)),
                 ValueError, "positive power of two"),
        BadInput("formats/nan_block_confined_to_its_token", "quantize_per_token", "nonfinite",
                 lambda b, d: formats.quant_dequant_fp8(
                     torch.ones(3, 256, device=d).index_fill_(0, torch.tensor([1], device=d), float("nan")), 128),
                 expect=nan_confined_to_rows([1])),
    ]


def _backend_entries() -> list[BadInput]:
    import os

    from optimized import backends

    def with_env(value: str) -> Any:
        old = os.environ.get("DSV4_BACKEND")
        os.environ["DSV4_BACKEND"] = value
        try:
            return backends.select("fp8_einsum")
        finally:
            if old is None:
                del os.environ["DSV4_BACKEND"]
            else:
                os.environ["DSV4_BACKEND"] = old

    return [
        BadInput("backends/unknown_backend_name", "backend_status", "backend",
                 lambda b, d: backends.backend_status("cuda"), ValueError, "backend: expected one of"),
        BadInput("backends/unknown_op", "select", "backend",
                 lambda b, d: backends.select("no_such_op"), ValueError, "op: unknown op 'no_such_op'"),
        BadInput("backends/bad_DSV4_BACKEND", "select", "backend", lambda b, d: with_env("rocm"),
                 ValueError, "DSV4_BACKEND: expected one of"),
    ]


# ------------------------------------------------------------------------------------------------
# FP8 einsum, attention-output quantization, output projection, FP8 linear (TINY shapes)
# ------------------------------------------------------------------------------------------------


def _einsum_inputs(d: str, fmt: str = "e4m3fn", tokens: int = 3) -> dict[str, Any]:
    """Valid TINY `fp8_einsum('bhr,hdr->bhd')` operands on device `d`."""
    from reference.config import TINY
    from reference.formats import quantize_per_token
    from reference.weights import random_fp8_weight

    g = torch.Generator().manual_seed(0)
    h, r, n = TINY.o_groups, TINY.o_group_dim, TINY.o_lora_rank
    w = random_fp8_weight(n, r, fmt=fmt, generator=g, batch=(h,))
    a, sa = quantize_per_token(torch.randn(tokens, h, r, generator=g).to(torch.bfloat16), 128, fmt)
    return {"a": a.to(d), "sa": sa.to(d), "w": w.data.to(d), "sw": w.scale.to(d)}


def _einsum(backend: str | None, d: str, *, expr: str = "bhr,hdr->bhd", recipe: Any = (1, 128, 128),
            out: torch.Tensor | None = None, **change: Any) -> Any:
    import optimized

    i = {**_einsum_inputs(d), **change}
    return optimized.fp8_einsum(expr, (i["a"], i["sa"]), (i["w"], i["sw"]), out, recipe=recipe, backend=backend)


def _einsum_entries() -> list[BadInput]:
    def nan_scale(d: str) -> torch.Tensor:
        sa = _einsum_inputs(d)["sa"].clone()
        sa[1] = float("nan")
        return sa

    def mixed_formats(d: str) -> dict[str, Any]:
        fnuz = _einsum_inputs(d, "e4m3fnuz")
        return {"w": fnuz["w"], "sw": fnuz["sw"]}

    op = "fp8_einsum"
    return [
        BadInput("fp8_einsum/a_not_fp8", op, "dtype",
                 lambda b, d: _einsum(b, d, a=_einsum_inputs(d)["a"].to(torch.bfloat16)),
                 TypeError, "a[0]: expected float8_e4m3fn or float8_e4m3fnuz data"),
        BadInput("fp8_einsum/scale_not_fp32", op, "scale_layout",
                 lambda b, d: _einsum(b, d, sa=_einsum_inputs(d)["sa"].to(torch.bfloat16)),
                 TypeError, "a[1]: expected float32 power-of-two scales"),
        BadInput("fp8_einsum/scale_per_64_not_128", op, "scale_layout",
                 lambda b, d: _einsum(b, d, sa=_einsum_inputs(d)["sa"].repeat_interleave(2, dim=-1)),
                 ValueError, "a[1]: expected scale shape (3, 2, 16)"),
        BadInput("fp8_einsum/weight_scale_per_row", op, "scale_layout",
                 lambda b, d: _einsum(b, d, sw=_einsum_inputs(d)["sw"].repeat_interleave(128, dim=1)),
                 ValueError, "b[1]: expected scale shape (2, 2, 16)"),
        BadInput("fp8_einsum/mixed_fp8_formats", op, "fp8_format",
                 lambda b, d: _einsum(b, d, **mixed_formats(d)),
                 TypeError, "b[0]: expected the same FP8 format as a[0]"),
        BadInput("fp8_einsum/unknown_expression", op, "shape",
                 lambda b, d: _einsum(b, d, expr="bhr,hrd->bhd"), ValueError, "expr: expected one of"),
        BadInput("fp8_einsum/unknown_recipe", op, "scale_layout",
                 lambda b, d: _einsum(b, d, recipe=(1, 128, 64)), ValueError, "recipe: expected one of"),
        BadInput("fp8_einsum/reduction_dims_differ", op, "shape",
                 lambda b, d: _einsum(b, d, w=_einsum_inputs(d)["w"][..., :1024],
                                      sw=_einsum_inputs(d)["sw"][..., :8]),
                 ValueError, "b[0]: expected shape (2, 256, 2048)"),
        BadInput("fp8_einsum/a_not_a_pair", op, "layout",
                 lambda b, d: __import__("optimized").fp8_einsum("bhr,hdr->bhd", _einsum_inputs(d)["a"],
                                                                 (_einsum_inputs(d)["w"], _einsum_inputs(d)["sw"]),
                                                                 backend=b),
                 TypeError, "a: expected a (data, scale) pair of tensors"),
        BadInput("fp8_einsum/weight_on_another_device", op, "device",
                 lambda b, d: _einsum(b, d, w=_einsum_inputs(other_device(d))["w"],
                                      sw=_einsum_inputs(other_device(d))["sw"]),
                 ValueError, "b[0]: on "),
        BadInput("fp8_einsum/out_fp16", op, "dtype",
                 lambda b, d: _einsum(b, d, out=torch.empty(3, 2, 256, dtype=torch.float16, device=d)),
                 TypeError, "out: expected bfloat16 or float32"),
        BadInput("fp8_einsum/unsupported_backend_name", op, "backend",
                 lambda b, d: _einsum("cuda", d), ValueError, "backend: expected one of"),
        BadInput("fp8_einsum/empty_batch", op, "empty",
                 lambda b, d: _einsum(b, d, a=_einsum_inputs(d)["a"][:0], sa=_einsum_inputs(d)["sa"][:0]),
                 expect=empty_output((0, 2, 256))),
        BadInput("fp8_einsum/nan_scale_confined_to_its_token", op, "nonfinite",
                 lambda b, d: _einsum(b, d, sa=nan_scale(d)), expect=nan_confined_to_rows([1])),
    ]


def _attn_output_inputs(d: str, tokens: int = 4) -> dict[str, Any]:
    from reference.config import TINY
    from reference.rope import yarn_frequencies

    g = torch.Generator().manual_seed(1)
    return {"o": torch.randn(tokens, TINY.n_heads, TINY.head_dim, generator=g).to(torch.bfloat16).to(d),
            "positions": torch.arange(100, 100 + tokens).to(d), "freqs": yarn_frequencies(TINY, 4).to(d)}


def _with_nan_token(o: torch.Tensor, token: int) -> torch.Tensor:
    o = o.clone()
    o[token, 0, 0] = float("nan")
    return o


def _quantize_attn_output(b: str | None, d: str, *, n_groups: int = 2, fmt: str = "e4m3fn", **change: Any) -> Any:
    import optimized

    i = {**_attn_output_inputs(d), **change}
    return optimized.quantize_attn_output(i["o"], i["positions"], i["freqs"], n_groups=n_groups, fmt=fmt, backend=b)


def _quantize_attn_output_entries() -> list[BadInput]:
    op = "quantize_attn_output"
    o = lambda d: _attn_output_inputs(d)["o"]
    return [
        BadInput("quantize_attn_output/o_fp32", op, "dtype", lambda b, d: _quantize_attn_output(b, d, o=o(d).float()),
                 TypeError, "o: expected bfloat16 attention output"),
        BadInput("quantize_attn_output/o_2d", op, "shape", lambda b, d: _quantize_attn_output(b, d, o=o(d)[0]),
                 ValueError, "o: expected [T, H, head_dim]"),
        BadInput("quantize_attn_output/positions_float", op, "dtype",
                 lambda b, d: _quantize_attn_output(b, d, positions=torch.zeros(4, device=d)),
                 TypeError, "positions: expected int32 or int64"),
        BadInput("quantize_attn_output/positions_one_short", op, "shape",
                 lambda b, d: _quantize_attn_output(b, d, positions=torch.arange(3, device=d)),
                 ValueError, "positions: expected shape (4,)"),
        BadInput("quantize_attn_output/groups_do_not_divide_heads", op, "shape",
                 lambda b, d: _quantize_attn_output(b, d, n_groups=3),
                 ValueError, "n_groups: expected a positive int dividing the 8 heads"),
        BadInput("quantize_attn_output/fp8_format_e5m2", op, "fp8_format",
                 lambda b, d: _quantize_attn_output(b, d, fmt="e5m2"), ValueError, "fmt: expected one of"),
        BadInput("quantize_attn_output/freqs_on_another_device", op, "device",
                 lambda b, d: _quantize_attn_output(b, d, freqs=_attn_output_inputs(other_device(d))["freqs"]),
                 ValueError, "freqs: on "),
        BadInput("quantize_attn_output/empty_tokens", op, "empty",
                 lambda b, d: _quantize_attn_output(b, d, o=o(d)[:0], positions=torch.arange(0, device=d)),
                 expect=empty_output((0, 2, 2048))),
        BadInput("quantize_attn_output/nan_confined_to_its_token", op, "nonfinite",
                 lambda b, d: _quantize_attn_output(b, d, o=_with_nan_token(o(d), 2)),
                 expect=nan_confined_to_rows([2])),
    ]


def _weights(d: str, fmt: str = "e4m3fn") -> tuple[Any, Any]:
    from reference.config import TINY
    from reference.weights import random_fp8_weight

    g = torch.Generator().manual_seed(2)
    n = TINY.o_groups * TINY.o_lora_rank
    return (random_fp8_weight(n, TINY.o_group_dim, fmt=fmt, generator=g, device=d),
            random_fp8_weight(TINY.dim, n, fmt=fmt, generator=g, device=d))


def _output_projection(b: str | None, d: str, *, numerics: Any = None, **change: Any) -> Any:
    import optimized
    from reference.numerics import VLLM_NVIDIA

    wo_a, wo_b = _weights(d)
    i = {**_attn_output_inputs(d), "wo_a": wo_a, "wo_b": wo_b, **change}
    return optimized.output_projection(i["o"], i["positions"], i["freqs"], i["wo_a"], i["wo_b"],
                                       VLLM_NVIDIA if numerics is None else numerics, backend=b)


def _output_projection_entries() -> list[BadInput]:
    from reference.numerics import OFFICIAL, VLLM_NVIDIA

    op = "output_projection"
    return [
        BadInput("output_projection/wo_a_plain_tensor", op, "dtype",
                 lambda b, d: _output_projection(b, d, wo_a=_weights(d)[0].dequantize()),
                 TypeError, "wo_a: expected an Fp8Weight"),
        BadInput("output_projection/numerics_by_name", op, "value",
                 lambda b, d: _output_projection(b, d, numerics="vllm_nvidia"),
                 TypeError, "numerics: expected a Numerics"),
        BadInput("output_projection/wo_b_k_mismatch", op, "shape",
                 lambda b, d: _output_projection(b, d, wo_b=_weights(d)[1].__class__(
                     _weights(d)[1].data[:, :256], _weights(d)[1].scale[:, :2])),
                 ValueError, "wo_b: expected K = G*R = 512"),
        BadInput("output_projection/wo_a_fnuz_with_e4m3fn_numerics", op, "fp8_format",
                 lambda b, d: _output_projection(b, d, wo_a=_weights(d, "e4m3fnuz")[0]),
                 TypeError, "wo_a: stored as torch.float8_e4m3fnuz"),
        BadInput("output_projection/official_bf16_einsum_on_an_optimized_backend", op, "value",
                 lambda b, d: _output_projection(b, d, numerics=OFFICIAL.replace(fp8_format=VLLM_NVIDIA.fp8_format)),
                 ValueError, "is implemented by the reference backend only", optimized_only=True),
        BadInput("output_projection/nan_confined_to_its_token", op, "nonfinite",
                 lambda b, d: _output_projection(b, d, o=_with_nan_token(_attn_output_inputs(d)["o"], 1)),
                 expect=nan_confined_to_rows([1])),
    ]


def _fp8_linear(b: str | None, d: str, *, numerics: Any = None, **change: Any) -> Any:
    import optimized
    from reference.numerics import OFFICIAL
    from reference.weights import random_fp8_weight

    g = torch.Generator().manual_seed(3)
    i = {"x": torch.randn(4, 256, generator=g).to(torch.bfloat16).to(d),
         "weight": random_fp8_weight(128, 256, generator=g, device=d), **change}
    return optimized.fp8_linear(i["x"], i["weight"], OFFICIAL if numerics is None else numerics, backend=b)


def _fp8_linear_entries() -> list[BadInput]:
    from reference.numerics import OFFICIAL
    from reference.weights import random_fp8_weight

    op = "fp8_linear"
    x = lambda d: torch.randn(4, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(d)

    def nan_row(d: str) -> torch.Tensor:
        out = x(d)
        out[3, 17] = float("nan")
        return out

    return [
        BadInput("fp8_linear/x_fp32", op, "dtype", lambda b, d: _fp8_linear(b, d, x=x(d).float()),
                 TypeError, "x: expected bfloat16 activations"),
        BadInput("fp8_linear/weight_plain_tensor", op, "dtype",
                 lambda b, d: _fp8_linear(b, d, weight=torch.zeros(128, 256, device=d)),
                 TypeError, "weight: expected an Fp8Weight"),
        BadInput("fp8_linear/k_mismatch", op, "shape", lambda b, d: _fp8_linear(b, d, x=x(d)[:, :128]),
                 ValueError, "x: last dim must be the weight's K = 256"),
        BadInput("fp8_linear/weight_fnuz_with_e4m3fn_numerics", op, "fp8_format",
                 lambda b, d: _fp8_linear(b, d, weight=random_fp8_weight(128, 256, fmt="e4m3fnuz", device=d)),
                 TypeError, "weight: stored as torch.float8_e4m3fnuz"),
        BadInput("fp8_linear/unquantized_activations_on_an_optimized_backend", op, "value",
                 lambda b, d: _fp8_linear(b, d, numerics=OFFICIAL.replace(act_quant=False)),
                 ValueError, "numerics: act_quant=False", optimized_only=True),
        BadInput("fp8_linear/weight_on_another_device", op, "device",
                 lambda b, d: _fp8_linear(b, d, weight=random_fp8_weight(128, 256, device=other_device(d))),
                 ValueError, "weight: on "),
        BadInput("fp8_linear/nan_confined_to_its_token", op, "nonfinite",
                 lambda b, d: _fp8_linear(b, d, x=nan_row(d)), expect=nan_confined_to_rows([3])),
    ]


# ------------------------------------------------------------------------------------------------
# MoE: route, experts, moe (TINY; layer 3 routes by biased top-k, layer 0 by token id)
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _moe_weights(layer: int, expert_format: str, fmt: str, device: str) -> Any:
    from reference.config import TINY
    from reference.moe import random_moe_weights

    return random_moe_weights(TINY, layer, expert_format=expert_format, fmt=fmt,
                              generator=torch.Generator().manual_seed(5), device=device)


def _moe_x(d: str, tokens: int = 4) -> torch.Tensor:
    return torch.randn(tokens, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(d)


def _route(backend: str | None, d: str, *, layer: int = 3, **change: Any) -> Any:
    import optimized
    from reference.config import TINY

    w = _moe_weights(layer, "fp8", "e4m3fn", d)
    token_ids = torch.tensor([1, 2, 3, 4], device=d) if layer == 0 else None
    i = {"x": _moe_x(d), "gate": w.gate, "bias": w.bias, "token_ids": token_ids, "tid2eid": w.tid2eid,
         "cfg": TINY, **change}
    return optimized.route(i["x"], i["gate"], i["bias"], token_ids=i["token_ids"], tid2eid=i["tid2eid"],
                           cfg=i["cfg"], backend=backend)


def _experts(backend: str | None, d: str, *, numerics: Any = None, **change: Any) -> Any:
    import optimized
    from reference.numerics import OFFICIAL

    w = _moe_weights(3, "fp8", "e4m3fn", d)
    i = {"x": _moe_x(d), "ids": _experts_ids(d), "weights": torch.full((4, 6), 0.25, device=d), "w13": w.w13,
         "w2": w.w2, **change}
    return optimized.experts(i["x"], i["ids"], i["weights"], i["w13"], i["w2"], swiglu_limit=10.0,
                             numerics=OFFICIAL if numerics is None else numerics, backend=backend)


def _moe(backend: str | None, d: str, *, layer: int = 3, expert_format: str = "fp8", **change: Any) -> Any:
    import optimized
    from reference.config import TINY
    from reference.numerics import OFFICIAL

    i = {"x": _moe_x(d), "weights": _moe_weights(layer, expert_format, "e4m3fn", d),
         "token_ids": torch.tensor([1, 2, 3, 4], device=d) if layer == 0 else None, "cfg": TINY, **change}
    return optimized.moe(i["x"], i["weights"], token_ids=i["token_ids"], cfg=i["cfg"], numerics=OFFICIAL,
                         backend=backend)


def _moe_entries() -> list[BadInput]:
    from reference.weights import Fp8Weight

    def w(d: str, layer: int = 3, expert_format: str = "fp8", fmt: str = "e4m3fn") -> Any:
        return _moe_weights(layer, expert_format, fmt, d)

    def nan_token(d: str) -> torch.Tensor:
        x = _moe_x(d)
        x[2, 5] = float("nan")
        return x

    def strided_w13(d: str) -> Any:  # same values, data no longer contiguous
        data = w(d).w13.data
        return Fp8Weight(data.transpose(1, 2).contiguous().transpose(1, 2), w(d).w13.scale)

    def all_skipped_row(d: str) -> torch.Tensor:
        ids = _experts_ids(d).clone()
        ids[1] = -1
        return ids

    def token_one_is_zero(out: Any) -> str | None:
        return None if bool((out[1] == 0).all()) else "a token whose every slot is -1 has a non-zero output"

    return [
        BadInput("route/x_fp32", "route", "dtype", lambda b, d: _route(b, d, x=_moe_x(d).float()),
                 ValueError, "x: expected [T, D] bf16"),
        BadInput("route/x_last_dim_strided", "route", "layout",
                 lambda b, d: _route(b, d, x=_moe_x(d).t().contiguous().t()),
                 ValueError, "x: the last dim must be contiguous"),
        BadInput("route/gate_shape", "route", "shape", lambda b, d: _route(b, d, gate=w(d).gate[:8]),
                 ValueError, "gate_weight: expected shape (16, 256)"),
        BadInput("route/gate_on_another_device", "route", "device",
                 lambda b, d: _route(b, d, gate=w(d).gate.to(other_device(d))),
                 ValueError, "gate_weight: expected a tensor on"),
        BadInput("route/non_hash_layer_without_bias", "route", "value", lambda b, d: _route(b, d, bias=None),
                 ValueError, "bias: a non-hash layer needs [16] fp32"),
        BadInput("route/hash_layer_without_token_ids", "route", "value",
                 lambda b, d: _route(b, d, layer=0, token_ids=None),
                 ValueError, "token_ids: hash layers route by token id"),
        BadInput("route/token_id_outside_the_vocabulary", "route", "range",
                 lambda b, d: _route(b, d, layer=0, token_ids=torch.tensor([1, 2, 512, 4], device=d)),
                 ValueError, "token_ids: every id must be in [0, 512)"),
        BadInput("route/tid2eid_float", "route", "dtype",
                 lambda b, d: _route(b, d, layer=0, tid2eid=w(d, 0).tid2eid.float()),
                 ValueError, "tid2eid: expected [vocab, 6] int32/int64"),
        BadInput("route/tid2eid_expert_out_of_range", "route", "range",
                 lambda b, d: _route(b, d, layer=0, tid2eid=w(d, 0).tid2eid + 16),
                 ValueError, "tid2eid: rows of these tokens hold expert ids outside [0, 16)"),
        BadInput("experts/expert_id_out_of_range", "experts", "range",
                 lambda b, d: _experts(b, d, ids=_experts_ids(d) + 4),
                 ValueError, "topk_ids: expected values in [-1, 16)"),
        BadInput("experts/weights_shape", "experts", "shape",
                 lambda b, d: _experts(b, d, weights=torch.full((4, 5), 0.25, device=d)),
                 ValueError, "topk_weights: expected (4, 6) floating point"),
        BadInput("experts/mixed_expert_formats", "experts", "dtype",
                 lambda b, d: _experts(b, d, w2=w(d, 3, "fp4").w2), TypeError, "w13, w2: expected the same format"),
        BadInput("experts/fnuz_weights_with_e4m3fn_numerics", "experts", "fp8_format",
                 lambda b, d: _experts(b, d, w13=w(d, 3, "fp8", "e4m3fnuz").w13, w2=w(d, 3, "fp8", "e4m3fnuz").w2),
                 ValueError, "w13: FP8 weights in torch.float8_e4m3fnuz do not match numerics.fp8_format"),
        BadInput("experts/weight_not_contiguous", "experts", "layout", lambda b, d: _experts(b, d, w13=strided_w13(d)),
                 ValueError, "w13.data: expected a contiguous tensor"),
        BadInput("experts/all_slots_skipped_gives_zero", "experts", "range",
                 lambda b, d: _experts(b, d, ids=all_skipped_row(d)), expect=token_one_is_zero),
        BadInput("moe/weights_not_moe_weights", "moe", "dtype", lambda b, d: _moe(b, d, weights=w(d).w13),
                 TypeError, "weights: expected MoEWeights"),
        BadInput("moe/cfg_by_name", "moe", "value", lambda b, d: _moe(b, d, cfg="TINY"),
                 TypeError, "cfg: expected DSv4Config"),
        BadInput("moe/empty_tokens", "moe", "empty", lambda b, d: _moe(b, d, x=_moe_x(d)[:0]),
                 expect=empty_output((0, 256))),
        BadInput("moe/nan_confined_to_its_token", "moe", "nonfinite", lambda b, d: _moe(b, d, x=nan_token(d)),
                 expect=nan_confined_to_rows([2])),
        BadInput("moe/nan_confined_to_its_token_hash_layer_fp4", "moe", "nonfinite",
                 lambda b, d: _moe(b, d, layer=0, expert_format="fp4", x=nan_token(d)),
                 expect=nan_confined_to_rows([2])),
    ]


# ------------------------------------------------------------------------------------------------
# Attention: sparse attention, projections, indexer, compressor, the layer (TINY; layer 1 is CSA)
# ------------------------------------------------------------------------------------------------

_CSA = 1


@functools.lru_cache(maxsize=2)
def _attention_weights(device: str, fmt: str = "e4m3fn") -> Any:
    from reference.attention import random_attention_weights
    from reference.config import TINY

    return random_attention_weights(TINY, _CSA, fmt=fmt, generator=torch.Generator().manual_seed(7), device=device)


def _sparse_inputs(d: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(8)
    indices = torch.stack([torch.randperm(40, generator=g)[:12] for _ in range(3)]).to(torch.int32)
    indices[:, -2:] = -1
    return {"q": torch.randn(3, 8, 512, generator=g).to(torch.bfloat16).to(d),
            "kv": torch.randn(40, 512, generator=g).to(torch.bfloat16).to(d), "indices": indices.to(d),
            "sink": torch.randn(8, generator=g).to(d), "scale": 512**-0.5}


def _sparse_attention(backend: str | None, d: str, **change: Any) -> Any:
    import optimized

    i = {**_sparse_inputs(d), **change}
    return optimized.sparse_attention(i["q"], i["kv"], i["indices"], i["sink"], i["scale"], backend=backend)


def _layer_numerics() -> Any:
    from reference.numerics import VLLM_NVIDIA

    return VLLM_NVIDIA


def _projection(op: str, backend: str | None, d: str, **change: Any) -> Any:
    import optimized
    from reference.config import TINY
    from reference.rope import yarn_frequencies

    i = {"x": _moe_x(d), "w": _attention_weights(d), "cfg": TINY, "positions": torch.arange(4, device=d),
         "freqs": yarn_frequencies(TINY, 4).to(d), "numerics": _layer_numerics(), **change}
    return getattr(optimized, op)(i["x"], i["w"], i["cfg"], i["positions"], i["freqs"], i["numerics"],
                                  backend=backend)


def _indexer_topk(backend: str | None, d: str, **change: Any) -> Any:
    import optimized

    g = torch.Generator().manual_seed(9)
    i = {"scores": torch.randn(4, 10, generator=g).to(d), "n_visible": torch.tensor([0, 3, 10, 10], device=d),
         "topk": 8, **change}
    return optimized.indexer_topk(i["scores"], i["n_visible"], i["topk"], backend=backend)


def _compress(backend: str | None, d: str, **change: Any) -> Any:
    import optimized
    from reference.config import TINY
    from reference.rope import yarn_frequencies

    i = {"x": torch.randn(9, 256, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16).to(d),
         "positions": torch.arange(9, device=d), "weights": _attention_weights(d).compressor, "ratio": 4,
         "head_dim": 512, **change}
    return optimized.compress(i["x"], i["positions"], i["weights"], ratio=i["ratio"], head_dim=i["head_dim"],
                              freqs=yarn_frequencies(TINY, 4).to(d), numerics=_layer_numerics(), rotate="main",
                              backend=backend)


def _layer(backend: str | None, d: str, **change: Any) -> Any:
    import optimized
    from reference.config import TINY

    i = {"x": torch.randn(5, 256, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16).to(d),
         "positions": torch.arange(5, device=d), "cu_seqlens": torch.tensor([0, 5], dtype=torch.int32, device=d),
         **change}
    layer = optimized.Attention(TINY, _CSA, _attention_weights(d), _layer_numerics(), backend=backend)
    return layer(i["x"], i["positions"], i["cu_seqlens"])


def _runs_tiny_layer(backend: str | None) -> str | None:
    """`backend`, where it can run the TINY layer at all (a defined output needs a layer that runs)."""
    if backend == "deepgemm":  # the error-contract entries do run on it: their checks come before any kernel
        raise NotRun("DeepGEMM's MQA logits take 32 or 64 index heads; the TINY layer has 4 (its FLASH and PRO "
                     "layers are checked in the parity suite)")
    return backend


def _attention_entries() -> list[BadInput]:
    def sparse(name: str) -> Any:
        return lambda d: _sparse_inputs(d)[name]

    def duplicate_row(d: str) -> torch.Tensor:
        indices = _sparse_inputs(d)["indices"].clone()
        indices[2, 1] = indices[2, 0]
        return indices

    def nan_query(d: str) -> torch.Tensor:
        q = _sparse_inputs(d)["q"].clone()
        q[1, 3, 7] = float("nan")
        return q

    def all_empty_token(d: str) -> torch.Tensor:
        indices = _sparse_inputs(d)["indices"].clone()
        indices[0] = -1
        return indices

    def token_zero_is_zero(out: Any) -> str | None:
        return None if bool((out[0] == 0).all()) else "a token without any slot has a non-zero output"

    def nan_in_head_only(out: Any) -> str | None:  # a NaN query element poisons its own (token, head) only
        bad = ~out.float().isfinite()
        others = bad.clone()
        others[1, 3] = False
        if bool(others.any()):
            return f"non-finite outside token 1 head 3 (at {others.nonzero()[0].tolist()})"
        return None if bool(bad[1, 3].any()) else "token 1 head 3 carries NaN in but none out"

    return [
        BadInput("sparse_attention/q_fp32", "sparse_attention", "dtype",
                 lambda b, d: _sparse_attention(b, d, q=sparse("q")(d).float()), TypeError, "q: expected bfloat16"),
        BadInput("sparse_attention/head_dim_448", "sparse_attention", "shape",
                 lambda b, d: _sparse_attention(b, d, q=sparse("q")(d)[..., :448].contiguous()),
                 ValueError, "q: expected [T, H, 512]"),
        BadInput("sparse_attention/kv_fp8_without_packing", "sparse_attention", "fp8_format",
                 lambda b, d: _sparse_attention(b, d, kv=sparse("kv")(d).to(torch.float8_e4m3fn)),
                 TypeError, "kv: expected bf16 rows [N, 512] or packed FP8 cache rows [N, 584] uint8"),
        BadInput("sparse_attention/kv_not_contiguous", "sparse_attention", "layout",
                 lambda b, d: _sparse_attention(b, d, kv=sparse("kv")(d)[::2]),
                 ValueError, "kv: expected contiguous [N, 512]"),
        BadInput("sparse_attention/indices_int64", "sparse_attention", "dtype",
                 lambda b, d: _sparse_attention(b, d, indices=sparse("indices")(d).long()),
                 TypeError, "indices: expected int32"),
        BadInput("sparse_attention/index_past_the_pool", "sparse_attention", "range",
                 lambda b, d: _sparse_attention(b, d, indices=sparse("indices")(d).clamp(min=0) + 30),
                 ValueError, "indices: expected values in -1..39"),
        BadInput("sparse_attention/a_row_selected_twice", "sparse_attention", "range",
                 lambda b, d: _sparse_attention(b, d, indices=duplicate_row(d)),
                 ValueError, "indices: row 2 selects a kv row twice"),
        BadInput("sparse_attention/sink_per_token", "sparse_attention", "shape",
                 lambda b, d: _sparse_attention(b, d, sink=torch.zeros(3, 8, device=d)),
                 ValueError, "sink: expected contiguous [8]"),
        BadInput("sparse_attention/negative_scale", "sparse_attention", "value",
                 lambda b, d: _sparse_attention(b, d, scale=-1.0), ValueError, "scale: expected a positive float"),
        BadInput("sparse_attention/kv_on_another_device", "sparse_attention", "device",
                 lambda b, d: _sparse_attention(b, d, kv=sparse("kv")(other_device(d))), ValueError, "kv: on "),
        BadInput("sparse_attention/token_without_slots_gives_zero", "sparse_attention", "empty",
                 lambda b, d: _sparse_attention(b, d, indices=all_empty_token(d)), expect=token_zero_is_zero),
        BadInput("sparse_attention/nan_query_confined_to_its_head", "sparse_attention", "nonfinite",
                 lambda b, d: _sparse_attention(b, d, q=nan_query(d)), expect=nan_in_head_only),
        BadInput("project_q/weights_of_the_wrong_type", "project_q", "dtype",
                 lambda b, d: _projection("project_q", b, d, w=_attention_weights(d).wq_a), TypeError,
                 "w: expected AttentionWeights"),
        BadInput("project_q/freqs_of_64_dims", "project_q", "shape",
                 lambda b, d: _projection("project_q", b, d, freqs=torch.ones(64, device=d)), ValueError,
                 "freqs: expected [32] float32"),
        BadInput("project_kv/fnuz_weights_with_e4m3fn_numerics", "project_kv", "fp8_format",
                 lambda b, d: _projection("project_kv", b, d, w=_attention_weights(d, "e4m3fnuz")), TypeError,
                 "w.wkv: stored as torch.float8_e4m3fnuz"),
        BadInput("project_kv/positions_float", "project_kv", "dtype",
                 lambda b, d: _projection("project_kv", b, d, positions=torch.zeros(4, device=d)), ValueError,
                 "positions: expected [4] int"),
        BadInput("indexer_q/weights_of_the_wrong_type", "indexer_q", "dtype",
                 lambda b, d: __import__("optimized").indexer_q(torch.zeros(4, 128, dtype=torch.bfloat16, device=d),
                                                                _moe_x(d), _attention_weights(d), torch.arange(4),
                                                                torch.ones(32), _layer_numerics(), backend=b),
                 TypeError, "w: expected IndexerWeights"),
        BadInput("indexer_scores/head_dim_not_a_power_of_two", "indexer_scores", "shape",
                 lambda b, d: __import__("optimized").indexer_scores(
                     torch.zeros(4, 4, 96, dtype=torch.bfloat16, device=d),
                     torch.zeros(10, 96, dtype=torch.bfloat16, device=d), torch.ones(4, 4, device=d),
                     _layer_numerics(), backend=b),
                 ValueError, "q_idx: head dim must be a power of two >= 16"),
        BadInput("indexer_scores/head_weights_bf16", "indexer_scores", "dtype",
                 lambda b, d: __import__("optimized").indexer_scores(
                     torch.zeros(4, 4, 128, dtype=torch.bfloat16, device=d),
                     torch.zeros(10, 128, dtype=torch.bfloat16, device=d),
                     torch.ones(4, 4, dtype=torch.bfloat16, device=d), _layer_numerics(), backend=b),
                 TypeError, "head_weights: expected torch.float32"),
        BadInput("indexer_topk/more_visible_than_entries", "indexer_topk", "range",
                 lambda b, d: _indexer_topk(b, d, n_visible=torch.tensor([0, 3, 10, 11], device=d)),
                 ValueError, "n_visible: expected values in 0..10"),
        BadInput("indexer_topk/topk_zero", "indexer_topk", "value", lambda b, d: _indexer_topk(b, d, topk=0),
                 ValueError, "topk: expected an int >= 1"),
        BadInput("compress/positions_not_from_zero", "compress", "range",
                 lambda b, d: _compress(b, d, positions=torch.arange(1, 10, device=d)),
                 ValueError, "positions: the prefill form takes one sequence at positions 0 .. T-1"),
        BadInput("compress/ratio_of_another_layer", "compress", "value", lambda b, d: _compress(b, d, ratio=128),
                 ValueError, "weights: hold a ratio-4 compressor with head dim 512"),
        BadInput("attention/positions_not_consecutive", "attention", "range",
                 lambda b, d: _layer(b, d, positions=torch.tensor([0, 1, 2, 4, 5], device=d)),
                 ValueError, "positions: expected non-negative positions increasing by 1 within each sequence"),
        BadInput("attention/negative_position", "attention", "range",
                 lambda b, d: _layer(b, d, positions=torch.arange(-1, 4, device=d)),
                 ValueError, "positions: expected non-negative positions"),
        BadInput("attention/cu_seqlens_past_the_tokens", "attention", "shape",
                 lambda b, d: _layer(b, d, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32, device=d)),
                 ValueError, "cu_seqlens: expected [B + 1] non-decreasing offsets from 0 to T = 5"),
        BadInput("attention/cu_seqlens_int64", "attention", "dtype",
                 lambda b, d: _layer(b, d, cu_seqlens=torch.tensor([0, 5], device=d)),
                 TypeError, "cu_seqlens: expected int32"),
        BadInput("attention/empty_batch", "attention", "empty",
                 lambda b, d: _layer(_runs_tiny_layer(b), d, x=torch.zeros(0, 256, dtype=torch.bfloat16, device=d),
                                     positions=torch.zeros(0, dtype=torch.int64, device=d),
                                     cu_seqlens=torch.tensor([0, 0], dtype=torch.int32, device=d)),
                 expect=empty_output((0, 256))),
    ]


def _experts_ids(d: str) -> torch.Tensor:
    return torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 0, 1], [2, 4, 6, 8, 10, 12]],
                        dtype=torch.int32, device=d)


def _corpus() -> list[BadInput]:
    entries = [*_formats_entries(), *_backend_entries(), *_einsum_entries(), *_quantize_attn_output_entries(),
               *_output_projection_entries(), *_fp8_linear_entries(), *_moe_entries(), *_attention_entries()]
    ids = [e.id for e in entries]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"bad-input ids must be unique: {duplicates}")
    return entries


CORPUS: list[BadInput] = _corpus()


def backends_for(entry: BadInput) -> tuple[str, ...]:
    """Every backend that implements the op, for a defined output of a registered op; else the one backend a
    plain call would use here (reference for helpers outside the registry)."""
    from optimized.backends import registry, select

    impls = registry().get(entry.op)
    if impls is None:
        return ("reference",)
    if entry.per_backend:
        return tuple(impls)
    try:
        return (select(entry.op).backend,)
    except RuntimeError:  # nothing available: the task reports the reference as the fallback
        return ("reference",)


def tasks(device: str, ops: list[str] | None, backends: list[str] | None) -> list[Task]:
    out = []
    for e in CORPUS:
        if ops and e.op not in ops:
            continue
        for backend in backends_for(e):
            if backends is None or backend in backends or not e.per_backend:
                out.append(Task("bad_input", e.op, "-", e.id, e.category, 0, backend,
                                functools.partial(check, e, backend, device), registry_op=e.op))
    return out
