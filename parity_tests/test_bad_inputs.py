"""Every entry of the bad-input corpus (`bad_inputs.CORPUS`) behaves as documented: the exact error type with
its message fragment, raised before any kernel, or the defined output (checked on every backend)."""

from __future__ import annotations

import pytest
import torch

from optimized.backends import backend_status, registry
from parity_tests import bad_inputs
from parity_tests.bad_inputs import CATEGORIES, CORPUS, BadInput
from parity_tests.cases import NotRun

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _params() -> list[object]:
    params = []
    for entry in CORPUS:
        for backend in bad_inputs.backends_for(entry):
            params.append(pytest.param(entry, backend, id=f"{entry.id}[{backend}]"))
    return params


@pytest.mark.parametrize(("entry", "backend"), _params())
def test_bad_input_behaves_as_documented(entry: BadInput, backend: str) -> None:
    ok, why = backend_status(backend)
    if not ok:
        pytest.skip(f"backend {backend!r} unavailable: {why}")
    try:
        [result] = bad_inputs.check(entry, backend, DEVICE)
    except NotRun as exc:
        pytest.skip(str(exc))
    assert result.passed, result.detail


def test_corpus_covers_every_public_op_and_category() -> None:
    """At least 40 entries; every optimized op and every category of malformed call has some."""
    assert len(CORPUS) >= 40
    assert {e.category for e in CORPUS} == set(CATEGORIES)
    assert set(registry()) <= {e.op for e in CORPUS}


def test_nvidia_compute_capability_rule_of_the_device_features() -> None:
    """`Hardware.nvidia_sm` (the native FP8 cast from sm_89, TMA and programmatic dependent launch from sm_90): NVIDIA
    only, by compute capability, never ROCm or the CPU."""
    import dataclasses

    from optimized import backends

    hw = backends.detect()
    for device, arch, at_89, at_90 in (("cuda", "sm89", True, False), ("cuda", "sm90", True, True),
                                       ("cuda", "sm100", True, True), ("cuda", "sm80", False, False),
                                       ("rocm", "gfx942", False, False), ("cpu", "cpu", False, False)):
        sim = dataclasses.replace(hw, device=device, arch=arch)
        assert (sim.nvidia_sm(89), sim.nvidia_sm(90)) == (at_89, at_90), arch


def test_cpu_tensors_on_a_gpu_machine_name_the_argument_or_select_the_reference(monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """On a GPU machine without TRITON_INTERPRET the GPU backends cannot take CPU tensors: a requested one is a
    ValueError naming the argument (not Triton's launch error), and automatic selection picks the reference."""
    import dataclasses

    import optimized
    from optimized import backends, linear
    from reference.numerics import VLLM_NVIDIA
    from reference.weights import random_fp8_weight

    gpu = dataclasses.replace(backends.detect(), device="cuda", name="a GPU", arch="sm90", triton="3.6.0",
                              deep_gemm="2.8.2", deep_gemm_error=None, interpret=False)
    monkeypatch.setattr(backends, "detect", lambda: gpu)
    monkeypatch.setattr(linear, "_RESOLVED", {})  # selections cached under the real hardware
    q, kv = torch.zeros(2, 8, 512, dtype=torch.bfloat16), torch.zeros(4, 512, dtype=torch.bfloat16)
    indices, sink = torch.zeros(2, 1, dtype=torch.int32), torch.zeros(8)
    with pytest.raises(ValueError, match=r"^q: on cpu; the triton backend takes CPU tensors only under TRITON_INT"):
        optimized.sparse_attention(q, kv, indices, sink, 0.1, backend="triton")
    x, weight = torch.zeros(3, 256, dtype=torch.bfloat16), random_fp8_weight(128, 256)
    with pytest.raises(ValueError, match=r"^x: on cpu; DeepGEMM takes CUDA tensors"):
        optimized.fp8_linear(x, weight, VLLM_NVIDIA, backend="deepgemm")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for op in ("sparse_attention", "fp8_linear", "experts", "moe", "attention"):
        assert backends.select(op, None, ("x", cpu)).backend == "reference", op
        assert backends.select(op, None, ("x", cuda)).backend == "deepgemm", op
