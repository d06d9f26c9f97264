"""Golden results: the reference matches its stored outputs, a changed formula does not, summation order does."""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from parity_tests import golden, probes
from parity_tests.cases import NotRun
from parity_tests.probes import Probe

GOLDEN = golden.golden_probes()


def _checks_on_the_recording_platform(probe: Probe) -> list[golden.Check]:
    """`golden.check(probe)`, or a skip with its reason where the golden results were recorded on another platform
    (another torch rounds fp32 differently: `golden.check` raises NotRun there, and the CPU CI, the recording
    platform, runs these tests)."""
    try:
        return golden.check(probe)
    except NotRun as exc:
        pytest.skip(f"not run: {exc}")


@pytest.mark.parametrize("probe", GOLDEN, ids=[p.id for p in GOLDEN])
def test_reference_matches_its_golden_results(probe: Probe) -> None:
    checks = _checks_on_the_recording_platform(probe)
    assert {c.name for c in checks} == {"golden_structure", "golden_stats", "golden_values", "golden_moved"}
    failed = [f"{c.name}: {c.value:.3g} > {c.bound.value:.3g} ({c.detail})" for c in checks if not c.passed]
    assert not failed, failed


def test_every_golden_entry_on_disk_has_a_probe() -> None:
    """A stale entry (a renamed shape, a removed probe) would never be checked again."""
    wanted = {(p.op, golden.entry_key(p)) for p in GOLDEN}
    stored = {(path.stem, key) for path in golden.GOLDEN_DIR.glob("*.json")
              for key in json.loads(path.read_text())["entries"]}
    assert stored == wanted


# ------------------------------------------------------------------------------------------------
# the comparison itself, on synthetic outputs
# ------------------------------------------------------------------------------------------------


def _metrics(old: torch.Tensor, new: torch.Tensor) -> dict[str, float]:
    a, b = golden.summarize(old, "k"), golden.summarize(new, "k")
    return {name: value for name, (value, _) in golden.compare_summary(a, b).items()}


def _bf16_output(n: int = 4096) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _next_bf16(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x with the values at `positions` moved one bf16 ULP away from zero."""
    bits = x.view(torch.int16).clone()
    bits[positions] += 1
    return bits.view(torch.bfloat16)


def test_one_ulp_flip_of_a_few_elements_passes() -> None:
    """What a different BLAS summation order can do: rare one-ULP flips of a bf16 output."""
    x = _bf16_output()
    m = _metrics(x, _next_bf16(x, torch.arange(0, 4096, 997)))  # 5 of 4096 elements
    assert m["structure"] == 0
    assert m["stats"] <= golden.GOLDEN_STATS.value
    assert m["values"] <= golden.GOLDEN_VALUES.value
    assert m["moved"] <= golden.GOLDEN_MOVED.value


def test_systematic_sub_ulp_change_fails() -> None:
    """A formula change too small to move any value by two ULPs still moves many sampled values by one."""
    x = _bf16_output()
    m = _metrics(x, _next_bf16(x, torch.arange(0, 4096, 3)))  # a third of the elements
    assert m["values"] <= golden.GOLDEN_VALUES.value
    assert m["moved"] > golden.GOLDEN_MOVED.value


def test_scaled_output_fails_stats_and_values() -> None:
    x = _bf16_output()
    m = _metrics(x, (x.float() * 1.01).to(torch.bfloat16))
    assert m["stats"] > golden.GOLDEN_STATS.value and m["values"] > golden.GOLDEN_VALUES.value


def test_changed_shape_dtype_or_nan_count_fails_structure() -> None:
    x = _bf16_output()
    assert _metrics(x, x[:-1])["structure"] > 0
    assert _metrics(x, x.float())["structure"] > 0
    nan = x.clone()
    nan[7] = float("nan")
    assert _metrics(x, nan)["structure"] > 0


def test_integer_outputs_must_match_exactly() -> None:
    ids = torch.arange(64, dtype=torch.int32)
    changed = ids.clone()
    changed[5] = 6
    assert _metrics(ids, ids)["values"] == 0
    assert math.isinf(_metrics(ids, changed)["values"])


# ------------------------------------------------------------------------------------------------
# update -> check round trip, with a fake probe in a temporary golden folder
# ------------------------------------------------------------------------------------------------


def _fake_probe(transform: Callable[[torch.Tensor], torch.Tensor]) -> Probe:
    def make(device: str, variant: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(8, 256, generator=torch.Generator().manual_seed(variant)).to(torch.bfloat16)}

    return Probe("fake_op", "TINY", "t=8", 0, make, lambda inputs, backend: transform(inputs["x"]), golden=True)


@pytest.fixture
def fake_golden(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[[Probe], None]]:
    monkeypatch.setattr(golden, "GOLDEN_DIR", tmp_path)

    def install(probe: Probe) -> None:
        monkeypatch.setattr(probes, "_PROBES", {"fake_op": lambda config, device: [probe] if config == "TINY" else []})

    yield install


def test_update_records_and_check_detects_a_changed_formula(fake_golden: Callable[[Probe], None]) -> None:
    fake_golden(_fake_probe(lambda x: (x.float() * 2).to(torch.bfloat16)))
    assert golden.update() == ["golden new       fake_op TINY/t=8/e4m3fn/seed=0"]
    assert all(c.passed for c in golden.check(golden.golden_probes()[0]))
    assert golden.update() == ["golden unchanged fake_op TINY/t=8/e4m3fn/seed=0"]

    fake_golden(_fake_probe(lambda x: (x.float() * 2 + 0.01).to(torch.bfloat16)))
    failed = {c.name for c in golden.check(golden.golden_probes()[0]) if not c.passed}
    assert {"golden_stats", "golden_values"} <= failed


def test_missing_golden_entry_is_an_error_not_a_pass(fake_golden: Callable[[Probe], None]) -> None:
    fake_golden(_fake_probe(lambda x: x))
    with pytest.raises(LookupError, match="--golden update"):
        golden.check(golden.golden_probes()[0])


def test_golden_of_another_platform_is_reported_not_run(fake_golden: Callable[[Probe], None],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_golden(_fake_probe(lambda x: x))
    golden.update()
    monkeypatch.setattr(golden, "current_platform", lambda: {"machine": "aarch64", "cpu_kernels": "simd",
                                                             "torch": "2.11"})
    with pytest.raises(NotRun, match="recorded on"):
        golden.check(golden.golden_probes()[0])


# ------------------------------------------------------------------------------------------------
# a deliberately broken reference formula must fail its golden results
# ------------------------------------------------------------------------------------------------


def _forward_instead_of_inverse_rope(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda x, positions, freqs, *, inverse=False: original(x, positions, freqs, inverse=not inverse)


def _scale_one_binade_too_small(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The float-log2 bug of spec §7.1 pitfall 1 everywhere: block maxima clip at the format's max."""
    return lambda amax, qmax, eps=1e-4: original(amax, qmax, eps) / 2


def _softplus_without_sqrt(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda logits: torch.nn.functional.softplus(logits)


def _sink_scaled_like_a_logit(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Spec §7.1 pitfall 11: the sink is not multiplied by the softmax scale."""
    return lambda q, kv, indices, sink, scale: original(q, kv, indices, sink * scale, scale)


BREAKS = {
    # module, attribute, (original -> broken), an op whose golden results must fail
    "output inverse RoPE rotates forward": ("reference.einsum", "apply_rope", _forward_instead_of_inverse_rope,
                                             "quantize_attn_output"),
    "UE8M0 scale one binade too small": ("reference.formats", "ue8m0_scale", _scale_one_binade_too_small,
                                         "fp8_linear"),
    "router score softplus without sqrt": ("reference.moe", "sqrt_softplus", _softplus_without_sqrt, "moe"),
    "attention sink scaled by 512^-0.5": ("reference.attention", "_attend", _sink_scaled_like_a_logit,
                                          "sparse_attention"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_a_broken_reference_formula_fails_its_golden_results(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module_name, attr, breaker, op = BREAKS[name]
    module = importlib.import_module(module_name)
    monkeypatch.setattr(module, attr, breaker(getattr(module, attr)))
    verdicts = [all(c.passed for c in _checks_on_the_recording_platform(p)) for p in golden.golden_probes([op])]
    assert verdicts and not any(verdicts), f"{name}: golden results of {op} still pass"
