"""Opt-in `torch.library` custom ops of the optimized DSv4 ops, with fake implementations for `torch.compile`.

Ops: `fp8_einsum`, `quantize_attn_output`, `output_projection`, `fp8_linear`, `route`, `experts`, `moe`,
`sparse_attention`. The `Attention` module is not an op (it keeps Python-side state in its cache); compile it
around these ops.

Direct calls (`optimized.fp8_einsum(...)`) stay the default and are what the rest of the project uses. A
user who compiles a model calling these ops runs `register()` once and calls `torch.ops.dsv4.<op>` (or the
wrappers below, same arguments as the public ops): each op is then opaque to Dynamo and Inductor (no graph
break on the Triton launchers, DeepGEMM's JIT or the host-side argument checks), and its fake
implementation gives the output shapes, dtypes and devices without running anything.

A custom-op schema carries tensors, numbers and strings, so the arguments are flattened: `(data, scale)`
pairs and `Fp8Weight` / `Fp4Weight` become two tensors each, and `Numerics` / `DSv4Config` travel as JSON
strings of their fields. Outputs are returned contiguous (the deepgemm backend's MN-major activation
scales are copied once), because a fake implementation must predict the strides of the real output.
Argument checks run in the real implementation, before any kernel, as in a direct call.
"""

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch

import optimized
from reference.config import DSv4Config
from reference.moe import MoEWeights
from reference.numerics import Numerics
from reference.weights import Fp4Weight, Fp8Weight

NAMESPACE = "dsv4"
_REGISTERED: dict[str, Any] = {}


def numerics_to_str(numerics: Numerics) -> str:
    """A `Numerics` as the JSON string the custom ops take."""
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics: expected a Numerics, got {type(numerics).__name__}")
    return _json_of_fields(_NUMERICS_FIELDS, tuple(getattr(numerics, name) for name in _NUMERICS_FIELDS))


def numerics_from_str(text: str) -> Numerics:
    return Numerics(**json.loads(text))


def config_to_str(cfg: DSv4Config) -> str:
    """A `DSv4Config` as the JSON string the custom ops take."""
    if not isinstance(cfg, DSv4Config):
        raise TypeError(f"cfg: expected a DSv4Config, got {type(cfg).__name__}")
    return _json_of_fields(_CONFIG_FIELDS, tuple(getattr(cfg, name) for name in _CONFIG_FIELDS))


# Under torch.compile the dataclass's fields are read as constants and only those (str, int, float, bool, tuple)
# reach the JSON encoder, which runs once while tracing: torch 2.11's dynamo cannot pass a frozen dataclass
# instance to a constant-result function ("can't reconstruct arbitrary frozen dataclass instances"; 2.13 can).
_NUMERICS_FIELDS = tuple(f.name for f in dataclasses.fields(Numerics))
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(DSv4Config))


@torch.compiler.assume_constant_result  # evaluated once while tracing; the string is a graph constant
def _json_of_fields(names: tuple[str, ...], values: tuple[Any, ...]) -> str:
    return json.dumps(dict(zip(names, values)), sort_keys=True)


def config_from_str(text: str) -> DSv4Config:
    fields = json.loads(text)
    return DSv4Config(**{**fields, "compress_ratios": tuple(fields["compress_ratios"])})


def _weight(data: torch.Tensor, scale: torch.Tensor) -> Fp8Weight | Fp4Weight:
    """int8 data = packed MXFP4, anything else block FP8."""
    return Fp4Weight(data, scale) if data.dtype == torch.int8 else Fp8Weight(data, scale)


def weight_tensors(w: Fp8Weight | Fp4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight container as the two tensors the custom ops take: (FP8 data or packed MXFP4, scale)."""
    if isinstance(w, Fp8Weight):
        return w.data, w.scale
    if isinstance(w, Fp4Weight):
        return w.packed, w.scale
    raise TypeError(f"weight: expected an Fp8Weight or Fp4Weight, got {type(w).__name__}")


def _fmt_dtype(fmt: str) -> torch.dtype:
    from reference.formats import fp8_format

    return fp8_format(fmt).dtype


# ------------------------------------------------------------------------------------------------
# real and fake implementations (tensors in, tensors out)
# ------------------------------------------------------------------------------------------------


def _fp8_einsum(expr: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                recipe: list[int], backend: str | None) -> torch.Tensor:
    return optimized.fp8_einsum(expr, (a, a_scale), (b, b_scale), recipe=tuple(recipe), backend=backend).contiguous()


def _fp8_einsum_fake(expr: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     recipe: list[int], backend: str | None) -> torch.Tensor:
    from reference.einsum import check_fp8_einsum_args

    dims = check_fp8_einsum_args(expr, (a, a_scale), (b, b_scale), None, tuple(recipe))
    dtype = torch.float32 if expr == "bhd,bhr->hdr" else torch.bfloat16
    return a.new_empty(dims.out_shape, dtype=dtype)


def _quantize_attn_output(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, n_groups: int, fmt: str,
                          backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = optimized.quantize_attn_output(o, positions, freqs, n_groups=n_groups, fmt=fmt, backend=backend)
    return q.contiguous(), s.contiguous()


def _quantize_attn_output_fake(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, n_groups: int,
                               fmt: str, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    t, h, head_dim = o.shape
    width = h // n_groups * head_dim
    return (o.new_empty((t, n_groups, width), dtype=_fmt_dtype(fmt)),
            o.new_empty((t, n_groups, width // 128), dtype=torch.float32))


def _output_projection(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, wo_a: torch.Tensor,
                       wo_a_scale: torch.Tensor, wo_b: torch.Tensor, wo_b_scale: torch.Tensor, numerics: str,
                       backend: str | None) -> torch.Tensor:
    return optimized.output_projection(o, positions, freqs, Fp8Weight(wo_a, wo_a_scale), Fp8Weight(wo_b, wo_b_scale),
                                       numerics_from_str(numerics), backend=backend).contiguous()


def _output_projection_fake(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, wo_a: torch.Tensor,
                            wo_a_scale: torch.Tensor, wo_b: torch.Tensor, wo_b_scale: torch.Tensor, numerics: str,
                            backend: str | None) -> torch.Tensor:
    return o.new_empty((o.shape[0], wo_b.shape[0]), dtype=torch.bfloat16)


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, numerics: str,
                backend: str | None) -> torch.Tensor:
    return optimized.fp8_linear(x, Fp8Weight(weight, weight_scale), numerics_from_str(numerics),
                                backend=backend).contiguous()


def _fp8_linear_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, numerics: str,
                     backend: str | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.bfloat16)


def _route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, token_ids: torch.Tensor | None,
           tid2eid: torch.Tensor | None, cfg: str, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = optimized.route(x, gate, bias, token_ids=token_ids, tid2eid=tid2eid, cfg=config_from_str(cfg),
                                   backend=backend)
    return ids.contiguous(), weights.contiguous()


def _route_fake(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, token_ids: torch.Tensor | None,
                tid2eid: torch.Tensor | None, cfg: str, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    k = json.loads(cfg)["n_activated_experts"]
    return (x.new_empty((x.shape[0], k), dtype=torch.int32), x.new_empty((x.shape[0], k), dtype=torch.float32))


def _experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
             w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float, numerics: str,
             backend: str | None) -> torch.Tensor:
    return optimized.experts(x, topk_ids, topk_weights, _weight(w13, w13_scale), _weight(w2, w2_scale),
                             swiglu_limit=swiglu_limit, numerics=numerics_from_str(numerics),
                             backend=backend).contiguous()


def _experts_fake(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float,
                  numerics: str, backend: str | None) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _moe_weights(gate: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None, w13: torch.Tensor,
                 w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, shared_w13: torch.Tensor,
                 shared_w13_scale: torch.Tensor, shared_w2: torch.Tensor,
                 shared_w2_scale: torch.Tensor) -> MoEWeights:
    return MoEWeights(gate, bias, tid2eid, _weight(w13, w13_scale), _weight(w2, w2_scale),
                      Fp8Weight(shared_w13, shared_w13_scale), Fp8Weight(shared_w2, shared_w2_scale))


def _moe(x: torch.Tensor, token_ids: torch.Tensor | None, gate: torch.Tensor, bias: torch.Tensor | None,
         tid2eid: torch.Tensor | None, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
         w2_scale: torch.Tensor, shared_w13: torch.Tensor, shared_w13_scale: torch.Tensor, shared_w2: torch.Tensor,
         shared_w2_scale: torch.Tensor, cfg: str, numerics: str, backend: str | None) -> torch.Tensor:
    weights = _moe_weights(gate, bias, tid2eid, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale,
                           shared_w2, shared_w2_scale)
    return optimized.moe(x, weights, token_ids=token_ids, cfg=config_from_str(cfg),
                         numerics=numerics_from_str(numerics), backend=backend).contiguous()


def _moe_fake(x: torch.Tensor, token_ids: torch.Tensor | None, gate: torch.Tensor, bias: torch.Tensor | None,
              tid2eid: torch.Tensor | None, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
              w2_scale: torch.Tensor, shared_w13: torch.Tensor, shared_w13_scale: torch.Tensor,
              shared_w2: torch.Tensor, shared_w2_scale: torch.Tensor, cfg: str, numerics: str,
              backend: str | None) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float,
                      fmt: str, backend: str | None) -> torch.Tensor:
    return optimized.sparse_attention(q, kv, indices, sink, scale, fmt=fmt, backend=backend).contiguous()


def _sparse_attention_fake(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                           scale: float, fmt: str, backend: str | None) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# op name -> (real, fake, schema)
_OPS: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "fp8_einsum": (_fp8_einsum, _fp8_einsum_fake,
                   "(str expr, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, int[] recipe, str? backend) "
                   "-> Tensor"),
    "quantize_attn_output": (_quantize_attn_output, _quantize_attn_output_fake,
                             "(Tensor o, Tensor positions, Tensor freqs, int n_groups, str fmt, str? backend) "
                             "-> (Tensor, Tensor)"),
    "output_projection": (_output_projection, _output_projection_fake,
                          "(Tensor o, Tensor positions, Tensor freqs, Tensor wo_a, Tensor wo_a_scale, Tensor wo_b, "
                          "Tensor wo_b_scale, str numerics, str? backend) -> Tensor"),
    "fp8_linear": (_fp8_linear, _fp8_linear_fake,
                   "(Tensor x, Tensor weight, Tensor weight_scale, str numerics, str? backend) -> Tensor"),
    "route": (_route, _route_fake,
              "(Tensor x, Tensor gate, Tensor? bias, Tensor? token_ids, Tensor? tid2eid, str cfg, str? backend) "
              "-> (Tensor, Tensor)"),
    "experts": (_experts, _experts_fake,
                "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w13_scale, Tensor w2, "
                "Tensor w2_scale, float swiglu_limit, str numerics, str? backend) -> Tensor"),
    "moe": (_moe, _moe_fake,
            "(Tensor x, Tensor? token_ids, Tensor gate, Tensor? bias, Tensor? tid2eid, Tensor w13, Tensor w13_scale, "
            "Tensor w2, Tensor w2_scale, Tensor shared_w13, Tensor shared_w13_scale, Tensor shared_w2, "
            "Tensor shared_w2_scale, str cfg, str numerics, str? backend) -> Tensor"),
    "sparse_attention": (_sparse_attention, _sparse_attention_fake,
                         "(Tensor q, Tensor kv, Tensor indices, Tensor sink, float scale, str fmt, str? backend) "
                         "-> Tensor"),
}


def register() -> None:
    """Register every op as `torch.ops.dsv4.<name>` (idempotent)."""
    for name, (real, fake, schema) in _OPS.items():
        if name in _REGISTERED:
            continue
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", real, mutates_args=(), schema=schema)
        op.register_fake(fake)
        _REGISTERED[name] = op


def _op(name: str) -> Any:
    register()
    return getattr(getattr(torch.ops, NAMESPACE), name)


# ------------------------------------------------------------------------------------------------
# wrappers with the public ops' arguments
# ------------------------------------------------------------------------------------------------


def fp8_einsum(expr: str, a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], *,
               recipe: tuple[int, int, int] = (1, 128, 128), backend: str | None = None) -> torch.Tensor:
    """`optimized.fp8_einsum` as the custom op `dsv4::fp8_einsum` (no `out=`: the op returns a new tensor)."""
    return _op("fp8_einsum")(expr, a[0], a[1], b[0], b[1], list(recipe), backend)


def quantize_attn_output(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *, n_groups: int,
                         fmt: str = "e4m3fn", backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`optimized.quantize_attn_output` as `dsv4::quantize_attn_output` (contiguous scales)."""
    return _op("quantize_attn_output")(o, positions, freqs, n_groups, fmt, backend)


def output_projection(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, wo_a: Fp8Weight,
                      wo_b: Fp8Weight, numerics: Numerics, *, backend: str | None = None) -> torch.Tensor:
    """`optimized.output_projection` as `dsv4::output_projection`."""
    return _op("output_projection")(o, positions, freqs, *weight_tensors(wo_a), *weight_tensors(wo_b),
                                    numerics_to_str(numerics), backend)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, numerics: Numerics, *, backend: str | None = None) -> torch.Tensor:
    """`optimized.fp8_linear` as `dsv4::fp8_linear`."""
    return _op("fp8_linear")(x, *weight_tensors(weight), numerics_to_str(numerics), backend)


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, *, token_ids: torch.Tensor | None,
          tid2eid: torch.Tensor | None, cfg: DSv4Config,
          backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`optimized.route` as `dsv4::route`."""
    return _op("route")(x, gate, bias, token_ids, tid2eid, config_to_str(cfg), backend)


def experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Fp8Weight | Fp4Weight,
            w2: Fp8Weight | Fp4Weight, *, swiglu_limit: float, numerics: Numerics,
            backend: str | None = None) -> torch.Tensor:
    """`optimized.experts` as `dsv4::experts`."""
    return _op("experts")(x, topk_ids, topk_weights, *weight_tensors(w13), *weight_tensors(w2), float(swiglu_limit),
                          numerics_to_str(numerics), backend)


def moe(x: torch.Tensor, weights: MoEWeights, *, token_ids: torch.Tensor | None, cfg: DSv4Config, numerics: Numerics,
        backend: str | None = None) -> torch.Tensor:
    """`optimized.moe` as `dsv4::moe`."""
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights: expected MoEWeights, got {type(weights).__name__}")
    routed = (*weight_tensors(weights.w13), *weight_tensors(weights.w2))
    shared = (*weight_tensors(weights.shared_w13), *weight_tensors(weights.shared_w2))
    return _op("moe")(x, token_ids, weights.gate, weights.bias, weights.tid2eid, *routed, *shared, config_to_str(cfg),
                      numerics_to_str(numerics), backend)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float, *,
                     fmt: str = "e4m3fn", backend: str | None = None) -> torch.Tensor:
    """`optimized.sparse_attention` as `dsv4::sparse_attention` (bf16 rows or the 584-byte FP8 cache rows)."""
    return _op("sparse_attention")(q, kv, indices, sink, float(scale), fmt, backend)
