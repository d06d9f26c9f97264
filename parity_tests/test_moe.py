"""Parity of the optimized MoE backends (`optimized.route`, `optimized.experts`, `optimized.moe`) against
`reference.moe`, over the cases of `parity_tests/ops/moe.py`.

On the CPU: the TINY cases for the Triton backend under `TRITON_INTERPRET=1` (both FP8 formats). On a GPU:
the FLASH and PRO cases for every backend a case compares (triton, deepgemm). Bounds and their derivations
are in `parity_tests/tolerances.py`; a case that a backend cannot run by design (DeepGEMM and e4m3fnuz or
per-32 activation blocks) reports why instead of passing.
"""

from __future__ import annotations

import pytest
import torch

from optimized.backends import backend_status
from parity_tests.cases import TINY_DEVICE, Case, generator
from parity_tests.ops.moe import GPU_CONFIGS, experts_cases, moe_cases, route_cases
from parity_tests.testing import assert_case_passes
from reference.config import TINY
from reference.moe import random_moe_weights
from reference.numerics import OFFICIAL


def _cases(config: str, device: str) -> list[Case]:
    return route_cases(config, device) + experts_cases(config, device) + moe_cases(config, device)


def _run(case: Case, backend: str) -> None:
    ok, why = backend_status(backend)
    if not ok:
        pytest.skip(f"backend {backend!r} unavailable: {why}")
    assert_case_passes(case, backend)


@pytest.mark.parametrize("case", _cases("TINY", TINY_DEVICE), ids=lambda case: case.id)
def test_triton_matches_the_reference_on_tiny_cases(case: Case) -> None:
    _run(case, "triton")


_GPU = [(case, backend) for config in GPU_CONFIGS for case in _cases(config, "cuda") for backend in case.backends]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FLASH/PRO shapes)")
@pytest.mark.parametrize(("case", "backend"), _GPU, ids=[f"{case.id}-{backend}" for case, backend in _GPU])
def test_backends_match_the_reference_at_flash_and_pro_shapes(case: Case, backend: str) -> None:
    _run(case, backend)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_hash_routing_rejects_token_ids_outside_the_vocabulary(backend: str) -> None:
    import optimized

    ok, why = backend_status(backend)
    if not ok:
        pytest.skip(f"backend {backend!r} unavailable: {why}")
    weights = random_moe_weights(TINY, 0, generator=generator(0))
    x = torch.randn(4, TINY.dim, generator=generator(1)).to(torch.bfloat16)
    for bad in (TINY.vocab_size, -1):
        token_ids = torch.tensor([3, bad, 5, 7])
        with pytest.raises(ValueError, match="token_ids"):
            optimized.route(x, weights.gate, None, token_ids=token_ids, tid2eid=weights.tid2eid, cfg=TINY,
                            backend=backend)
        with pytest.raises(ValueError, match="token_ids"):
            optimized.moe(x, weights, token_ids=token_ids, cfg=TINY, numerics=OFFICIAL, backend=backend)
