"""Opt-in custom ops: schemas and fake implementations hold (`torch.library.opcheck`), eager results equal the
direct calls, and `torch.compile(fullgraph=True)` traces a function that calls them."""

from __future__ import annotations

import pytest
import torch

from optimized import custom_ops
from optimized.backends import backend_status
from parity_tests import probes
from parity_tests.probes import Probe
from parity_tests.testing import KERNEL_DEVICE

custom_ops.register()

# The flattened custom-op call of each probe's op: (probe inputs, backend) -> args of torch.ops.dsv4.<op>.
PROBES = {p.op: p for p in probes.all_probes("TINY", "cpu") if p.only is None}


def _args(probe: Probe, backend: str, device: str = "cpu") -> tuple[object, ...]:
    """The probe's inputs on `device` as the custom op's arguments."""
    i = probe.make(device, 0)
    if probe.op == "fp8_einsum":
        return ("bhr,hdr->bhd", *i["a"], *i["b"], [1, 128, 128], backend)
    if probe.op == "quantize_attn_output":
        from reference.config import TINY

        return (i["o"], i["positions"], i["freqs"], TINY.o_groups, probe.fmt, backend)
    if probe.op == "output_projection":
        from reference.numerics import VLLM_NVIDIA

        return (i["o"], i["positions"], i["freqs"], i["wo_a"].data, i["wo_a"].scale, i["wo_b"].data, i["wo_b"].scale,
                custom_ops.numerics_to_str(VLLM_NVIDIA), backend)
    if probe.op == "fp8_linear":
        from reference.numerics import OFFICIAL

        return (i["x"], i["weight"].data, i["weight"].scale, custom_ops.numerics_to_str(OFFICIAL), backend)
    if probe.op in ("route", "experts", "moe"):
        from reference.config import TINY
        from reference.numerics import OFFICIAL

        w, cfg, numerics = i["weights"], custom_ops.config_to_str(TINY), custom_ops.numerics_to_str(OFFICIAL)
        if probe.op == "route":
            return (i["x"], w.gate, w.bias, i["token_ids"], w.tid2eid, cfg, backend)
        experts = (*custom_ops.weight_tensors(w.w13), *custom_ops.weight_tensors(w.w2))
        if probe.op == "experts":
            return (i["x"], i["topk_ids"], i["topk_weights"], *experts, TINY.swiglu_limit, numerics, backend)
        shared = (*custom_ops.weight_tensors(w.shared_w13), *custom_ops.weight_tensors(w.shared_w2))
        return (i["x"], i["token_ids"], w.gate, w.bias, w.tid2eid, *experts, *shared, cfg, numerics, backend)
    if probe.op == "sparse_attention":
        return (i["q"], i["kv"], i["indices"], i["sink"], 512**-0.5, probe.fmt, backend)
    raise KeyError(probe.op)


OPS = sorted(op for op in PROBES if op in ("fp8_einsum", "quantize_attn_output", "output_projection", "fp8_linear",
                                           "route", "experts", "moe", "sparse_attention"))


def test_register_is_idempotent_and_covers_the_public_ops() -> None:
    custom_ops.register()
    for op in ("fp8_einsum", "quantize_attn_output", "output_projection", "fp8_linear", "route", "experts", "moe",
               "sparse_attention"):
        assert hasattr(torch.ops.dsv4, op)


@pytest.mark.parametrize("op", OPS)
def test_fake_implementations_match_the_real_ops(op: str) -> None:
    """Fake tensors (shapes, dtypes, strides) and AOT dispatch of each op (reference backend). opcheck's schema
    test is left out: it multiplies the inputs, which CPU torch does not implement for FP8 tensors."""
    torch.library.opcheck(getattr(torch.ops.dsv4, op).default, _args(PROBES[op], "reference"),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("op", OPS)
def test_custom_op_equals_the_direct_call(op: str) -> None:
    probe = PROBES[op]
    direct = probe.run("reference", "cpu")
    via_op = probes.as_tensors(getattr(torch.ops.dsv4, op)(*_args(probe, "reference")))
    assert len(direct) == len(via_op)
    for a, b in zip(direct, via_op):
        assert probes.bitwise_mismatches(a, b) == 0


def test_torch_compile_fullgraph_traces_a_function_calling_the_ops() -> None:
    """Attention output -> FP8 einsum -> wo_b linear, as a compiled function without graph breaks."""
    from reference.config import TINY
    from reference.einsum import grouped_wo_a
    from reference.numerics import VLLM_NVIDIA

    i = PROBES["output_projection"].make("cpu", 0)
    w, w_scale = grouped_wo_a(i["wo_a"], TINY.o_groups)

    def project(o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, s = custom_ops.quantize_attn_output(o, positions, i["freqs"], n_groups=TINY.o_groups, backend="reference")
        z = custom_ops.fp8_einsum("bhr,hdr->bhd", (q, s), (w, w_scale), backend="reference")
        return custom_ops.fp8_linear(z.flatten(1), i["wo_b"], VLLM_NVIDIA, backend="reference")

    compiled = torch.compile(project, fullgraph=True, backend="aot_eager")
    expect = project(i["o"], i["positions"])
    got = compiled(i["o"], i["positions"])
    assert probes.bitwise_mismatches(got, expect) == 0
    reference = PROBES["output_projection"].call(i, "reference")  # the same math, one direct call
    assert probes.bitwise_mismatches(got, reference) == 0


def test_torch_compile_fullgraph_traces_moe_and_sparse_attention() -> None:
    from reference.config import TINY
    from reference.numerics import OFFICIAL

    moe_in = next(p for p in probes.all_probes("TINY", "cpu", ["moe"]) if "topk" in p.shape).make("cpu", 0)
    attn = PROBES["sparse_attention"]
    attn_in = attn.make("cpu", 0)

    def layer(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = custom_ops.moe(x, moe_in["weights"], token_ids=None, cfg=TINY, numerics=OFFICIAL, backend="reference")
        o = custom_ops.sparse_attention(q, attn_in["kv"], attn_in["indices"], attn_in["sink"], 512**-0.5,
                                        fmt=attn.fmt, backend="reference")
        return y * 2, o

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(moe_in["x"], attn_in["q"])
    expect = layer(moe_in["x"], attn_in["q"])
    assert all(probes.bitwise_mismatches(a, b) == 0 for a, b in zip(got, expect))


@pytest.mark.skipif(not backend_status("triton")[0], reason=f"triton unavailable: {backend_status('triton')[1]}")
def test_triton_backend_through_the_custom_op_equals_the_direct_call() -> None:
    probe = PROBES["fp8_linear"]
    direct = probe.run("triton", KERNEL_DEVICE)[0]
    via_op = torch.ops.dsv4.fp8_linear(*_args(probe, "triton", KERNEL_DEVICE))
    assert probes.bitwise_mismatches(direct, via_op) == 0
