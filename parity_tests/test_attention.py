"""The attention kernels and `optimized.Attention` (spec §3): the parity cases of `parity_tests/ops/attention.py`
(triton on the CPU interpreter at TINY, both FP8 formats; triton and deepgemm at FLASH / PRO on a GPU), unit
properties of each kernel on identical inputs, and every malformed argument of the public attention ops.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
import torch

import optimized
from optimized import attention as oa
from optimized.backends import backend_status, registry
from parity_tests.cases import TINY_DEVICE, Case, all_cases, generator
from parity_tests.metrics import calc_diff
from parity_tests.ops.attention import GPU_CONFIGS, OPS, layer_of_kind
from parity_tests.testing import KERNEL_DEVICE, KERNEL_FP8_FORMATS, assert_case_passes
from parity_tests.tolerances import (
    ATTENTION_LAYER_SIMULATED,
    COMPRESS_SIMULATED,
    FP8_END_TO_END,
    INDEXER_SCORES_BF16,
    INDEXER_SCORES_FP32,
    SPARSE_ATTENTION_SIMULATED,
)
from reference import attention as ref
from reference import compressor as ref_comp
from reference.attention import head_rms_norm
from reference.cache import pack_kv, unpack_kv
from reference.config import TINY
from reference.formats import fp8_format, quant_dequant_fp4, quant_dequant_fp8
from reference.hadamard import hadamard_rotate
from reference.linear import rms_norm
from reference.numerics import OFFICIAL, VLLM_NVIDIA
from reference.rope import apply_rope, rope_cos_sin, yarn_frequencies

TRITON_OK, TRITON_WHY = backend_status("triton")
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=f"triton backend unavailable: {TRITON_WHY}")
DEEPGEMM_OK, DEEPGEMM_WHY = backend_status("deepgemm")
ATTENTION_OPS = ("sparse_attention", "indexer_scores", "indexer_topk", "compress", "project_q", "project_kv",
                 "indexer_q", "attention")


# ------------------------------------------------------------------------------------------------
# Parity cases
# ------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("case", all_cases("TINY", TINY_DEVICE, ops=list(OPS)), ids=lambda case: case.id)
def test_triton_matches_the_reference_on_tiny_cases(case: Case) -> None:
    assert_case_passes(case, "triton")


_GPU = [(case, backend) for config in GPU_CONFIGS for case in all_cases(config, "cuda", ops=list(OPS))
        for backend in case.backends]


# slow: the fp64 reference at FLASH / PRO shapes takes minutes in all; `python -m parity_tests --config FLASH,PRO`
# runs the same cases (the H200 script's parity step), this is the pytest entry to them.
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FLASH / PRO shapes)")
@pytest.mark.parametrize(("case", "backend"), _GPU, ids=[f"{case.id}-{backend}" for case, backend in _GPU])
def test_backends_match_the_reference_at_flash_and_pro_shapes(case: Case, backend: str) -> None:
    assert_case_passes(case, backend)


def test_every_attention_op_is_registered_for_every_backend() -> None:
    reg = registry()
    for op in ATTENTION_OPS:
        assert set(reg[op]) == {"reference", "triton", "deepgemm"}, op


# ------------------------------------------------------------------------------------------------
# Sparse attention kernel
# ------------------------------------------------------------------------------------------------


def _attention_inputs(fmt: str, *, tokens: int = 4, heads: int = 8, rows: int = 200, slots: int = 40, seed: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, 512], kv rows through the FP8 simulation, distinct indices per token with -1 slots, sinks
    (drawn on the CPU, on KERNEL_DEVICE)."""
    g = generator(seed)
    q = torch.randn(tokens, heads, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(rows, 512, generator=g).to(torch.bfloat16)
    kv = torch.cat((quant_dequant_fp8(kv[:, :448], 64, fmt), kv[:, 448:]), dim=1)
    indices = torch.stack([torch.randperm(rows, generator=g)[:slots] for _ in range(tokens)]).to(torch.int32)
    indices[:, ::5] = -1
    sink = torch.randn(heads, generator=g)
    return q.to(KERNEL_DEVICE), kv.to(KERNEL_DEVICE), indices.to(KERNEL_DEVICE), sink.to(KERNEL_DEVICE)


@needs_triton
@pytest.mark.parametrize("fmt", KERNEL_FP8_FORMATS)
def test_packed_cache_rows_give_bitwise_the_attention_of_their_unpacked_rows(fmt: str) -> None:
    from optimized.triton import sparse_attention as tsa

    q, kv, indices, sink = _attention_inputs(fmt)
    packed = pack_kv(kv, fmt)
    assert torch.equal(unpack_kv(packed, fmt), kv)
    from_rows = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5)
    from_packed = tsa.sparse_attention_packed(q, packed, indices, sink, 512**-0.5, fp8_dtype=fp8_format(fmt).dtype)
    assert torch.equal(from_rows, from_packed)


@needs_triton
@pytest.mark.parametrize("heads", [8, 12])
def test_split_kv_merges_to_the_single_pass_result_and_reruns_bitwise(heads: int) -> None:
    """12 heads: the merge's last 8-head block is partly masked."""
    from optimized.triton import sparse_attention as tsa

    q, kv, indices, sink = _attention_inputs("e4m3fn", heads=heads, slots=150)
    single = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, splits=1)
    split = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, splits=3)
    assert calc_diff(split.float(), single.float()) <= SPARSE_ATTENTION_SIMULATED.value
    assert torch.equal(split, tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, splits=3))


@needs_triton
def test_asking_for_the_sm90_kernel_where_it_cannot_run_names_the_argument() -> None:
    """8 heads make 16-head programs, which the Gluon kernel cannot run on any device (and the interpreter runs
    no Gluon): asking for it raises; `sm90_kernel=False` is the default launch there."""
    from optimized.triton import sparse_attention as tsa

    q, kv, indices, sink = _attention_inputs("e4m3fn")
    with pytest.raises(ValueError, match="sm90_kernel"):
        tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, sm90_kernel=True)
    assert torch.equal(tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, sm90_kernel=False),
                       tsa.sparse_attention(q, kv, indices, sink, 512**-0.5))


@needs_triton
def test_every_gpu_tiling_of_the_candidates_matches_the_reference() -> None:
    """The interpreter runs 128 rows per step; the GPU tiles (16 or 64 rows per step, 16 or 64 heads per
    program, every platform's) rescale the online softmax at other places: still within the sparse-attention
    bound, packed or not."""
    from optimized.triton import sparse_attention as tsa

    q, kv, indices, sink = _attention_inputs("e4m3fn", tokens=3, heads=64, slots=150)
    expected = ref.sparse_attention(q, kv, indices, sink, 512**-0.5)
    tilings = {tsa.NARROW, *(c for table in tsa.WIDE.values() for c in table.values())}
    assert {c.block_n for c in tilings} == {16, 64}
    for config in tilings:
        for packed in (False, True):
            if packed:
                out = tsa.sparse_attention_packed(q, pack_kv(kv), indices, sink, 512**-0.5, config=config,
                                                  fp8_dtype=torch.float8_e4m3fn)
            else:
                out = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, config=config)
            assert calc_diff(out.float(), expected.float()) <= SPARSE_ATTENTION_SIMULATED.value, (config, packed)


@needs_triton
@pytest.mark.parametrize("splits", [1, 2])
def test_tokens_without_any_slot_give_zero_and_no_nan(splits: int) -> None:
    q, kv, indices, sink = _attention_inputs("e4m3fn", slots=40)
    indices[1] = -1
    out = optimized.sparse_attention(q, kv, indices, sink, 512**-0.5, backend="triton")
    assert bool(out.isfinite().all()) and bool((out[1] == 0).all())
    from optimized.triton import sparse_attention as tsa

    no_slot_column = indices[:, :0].contiguous()  # K = 0
    none = tsa.sparse_attention(q, kv, no_slot_column, sink, 512**-0.5, splits=splits)
    assert bool((none == 0).all())
    assert torch.equal(ref.sparse_attention(q, kv, no_slot_column, sink, 512**-0.5), none)


@needs_triton
def test_sink_only_enters_the_denominator_unscaled() -> None:
    """One slot: o = v e^z / (e^z + e^sink) exactly as the reference (the sink is not multiplied by the scale)."""
    q, kv, indices, sink = _attention_inputs("e4m3fn", slots=1)
    indices[:] = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)[:, None]
    out = optimized.sparse_attention(q, kv, indices, sink * 4, 512**-0.5, backend="triton")
    expected = ref.sparse_attention(q, kv, indices, sink * 4, 512**-0.5)
    assert calc_diff(out.float(), expected.float()) <= SPARSE_ATTENTION_SIMULATED.value


SM90 = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU (the Gluon kernel of sparse_attention_sm90)")
@pytest.mark.parametrize(("heads", "slots", "splits"),
                         [(64, 100, 1), (128, 640, 1), (64, 1, 1), (64, 0, 1), (64, 640, 3), (128, 300, 2)])
def test_sm90_kernel_matches_the_portable_kernel_and_the_reference(heads: int, slots: int, splits: int) -> None:
    """The Gluon kernel, over bf16 rows and over the packed cache, with and without split-KV, on the cases the
    portable kernel's tests cover: -1 slots, a token without any slot (2), a NaN query (its head only), K not a
    multiple of 64, one and two 64-head blocks, no valid slot at all, no slot column at all (K = 0: every output
    0). Packed rows decode to the bf16 rows' tile, so both give the same bits."""
    from optimized.triton import sparse_attention as tsa

    q, kv, indices, sink = _attention_inputs("e4m3fn", tokens=6, heads=heads, rows=700, slots=slots)
    indices[2] = -1
    q[4, 3, 10] = float("nan")
    expected = ref.sparse_attention(q, kv, indices, sink, 512**-0.5)
    wide, wide_packed = tsa.WIDE["nvidia"][False], tsa.WIDE["nvidia"][True]
    out = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, splits=splits, config=wide, sm90_kernel=True)
    from_packed = tsa.sparse_attention_packed(q, pack_kv(kv), indices, sink, 512**-0.5, splits=splits,
                                              config=wide_packed, fp8_dtype=fp8_format("e4m3fn").dtype,
                                              sm90_kernel=True)
    portable = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, splits=splits, config=wide, sm90_kernel=False)
    assert torch.equal(from_packed.view(torch.int16), out.view(torch.int16))  # bits: NaN heads compare equal
    assert torch.equal(out.isnan(), expected.isnan())
    assert bool((out[2] == 0).all()) and (slots > 0 or bool((out == 0).all()))
    finite = expected.isfinite()
    assert calc_diff(out[finite].float(), expected[finite].float()) <= SPARSE_ATTENTION_SIMULATED.value
    assert calc_diff(out[finite].float(), portable[finite].float()) <= SPARSE_ATTENTION_SIMULATED.value


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU (the Gluon kernel of sparse_attention_sm90)")
def test_launches_of_64_head_programs_run_the_sm90_kernel() -> None:
    """Enough tokens for 64-head programs (`plan`): prefill over bf16 rows and decode over the packed cache with
    the planned split-KV run the Gluon kernel; an explicit `config` runs the portable kernel's tiles; asking for
    the Gluon kernel where it cannot run names the argument."""
    from optimized.triton import sparse_attention as tsa

    q, kv, indices, sink = _attention_inputs("e4m3fn", tokens=160, heads=64, rows=700, slots=100)
    assert tsa.plan(160, 64, 100, packed=False) == (tsa.WIDE["nvidia"][False], 1)
    direct = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, sm90_kernel=True)
    assert torch.equal(tsa.sparse_attention(q, kv, indices, sink, 512**-0.5), direct)
    q, kv, indices, sink = _attention_inputs("e4m3fn", tokens=64, heads=64, rows=2000, slots=640)
    packed, dtype = pack_kv(kv), fp8_format("e4m3fn").dtype
    assert tsa.plan(64, 64, 640, packed=True)[1] > 1  # split-KV on an H100 / H200 (132 SMs)
    direct = tsa.sparse_attention_packed(q, packed, indices, sink, 512**-0.5, fp8_dtype=dtype, sm90_kernel=True)
    assert torch.equal(tsa.sparse_attention_packed(q, packed, indices, sink, 512**-0.5, fp8_dtype=dtype), direct)
    portable = tsa.sparse_attention_packed(q, packed, indices, sink, 512**-0.5, fp8_dtype=dtype,
                                           config=tsa.WIDE["nvidia"][True])
    assert torch.equal(portable, tsa.sparse_attention_packed(q, packed, indices, sink, 512**-0.5, fp8_dtype=dtype,
                                                             sm90_kernel=False))
    with pytest.raises(ValueError, match="sm90_kernel"):
        tsa.sparse_attention(q[:, :16], kv, indices, sink[:16], 512**-0.5, sm90_kernel=True)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU (the Gluon kernel of sparse_attention_sm90)")
@pytest.mark.parametrize("scale_layout", ["deepgemm", "row_major"])
@pytest.mark.parametrize("heads", [64, 128])
def test_sm90_kernel_stores_its_output_quantized_with_the_quantization_kernels_bytes(
        heads: int, scale_layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sparse_attention_quantized` on the sm_90 kernel (prefill: one split) quantizes in the kernel's epilogue:
    the same FP8 bytes and scales as the attention then `quantize_attn_output`, over bf16 rows and the packed
    cache, with a NaN query head, a token without any slot (0 output: the EPS scale), 201 tokens (the DeepGEMM
    layout's 3 padding rows), one and two 64-head programs. The quantization kernel must not run. (Enough tokens
    that the launch plan is prefill's: a few tokens are split-KV or 16-head programs, which the kernel does not
    fuse.)"""
    from optimized.triton import quant
    from optimized.triton import sparse_attention as tsa

    tokens = 201
    q, kv, indices, sink = _attention_inputs("e4m3fn", tokens=tokens, heads=heads, rows=700, slots=300)
    assert tsa.plan(tokens, heads, 300, packed=False)[1] == 1 and tsa.plan(tokens, heads, 300, packed=True)[1] == 1
    indices[2] = -1
    q[4, 3, 10] = float("nan")
    positions = torch.arange(tokens, device=q.device) * 331
    positions[:4] = torch.tensor([3, 4095, 4096, 65000])
    freqs = yarn_frequencies(TINY, 4).to(q.device)
    groups = heads // 8
    o = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5, splits=1)
    want = quant.quantize_attn_output_checked(o, positions, freqs, n_groups=groups, scale_layout=scale_layout)

    def no_quantization_kernel(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the fused path ran the quantization kernel")

    monkeypatch.setattr(quant, "quantize_attn_output_checked", no_quantization_kernel)
    dtype = fp8_format("e4m3fn").dtype
    for got in (tsa.sparse_attention_quantized(q, kv, indices, sink, 512**-0.5, positions, freqs, n_groups=groups,
                                               scale_layout=scale_layout),
                tsa.sparse_attention_quantized(q, pack_kv(kv), indices, sink, 512**-0.5, positions, freqs,
                                               n_groups=groups, scale_layout=scale_layout, packed_fp8_dtype=dtype)):
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
        assert got[1].stride() == want[1].stride()
        if scale_layout == "deepgemm":  # the padding rows of the 201 tokens' scales are 0, as the kernel writes them
            pad = got[1].as_strided((204 - tokens, groups, 32), got[1].stride(), got[1].storage_offset() + tokens)
            assert bool((pad == 0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU (the Gluon kernel of sparse_attention_sm90)")
@pytest.mark.parametrize("backend", ["triton", "deepgemm"])
def test_the_layers_fused_output_quantization_gives_the_unfused_layers_bits(backend: str) -> None:
    """FLASH CSA layer, a fresh prompt of 300 tokens (prefill: one split, the fused epilogue) then one decode token
    (split-KV: attention then the quantization kernel): bitwise the output of the layer without the fused path."""
    if backend == "deepgemm" and not DEEPGEMM_OK:
        pytest.skip(f"deepgemm unavailable: {DEEPGEMM_WHY}")
    from reference.config import FLASH

    layer_id = layer_of_kind(FLASH, "csa")
    weights = ref.random_attention_weights(FLASH, layer_id, generator=generator(21), device="cuda")
    x = torch.randn(301, FLASH.dim, generator=generator(22)).to("cuda", torch.bfloat16)
    positions = torch.arange(301, device="cuda")
    outs = []
    for fused in (True, False):
        layer = optimized.Attention(FLASH, layer_id, weights, VLLM_NVIDIA, backend=backend)
        assert layer._fused_quant
        layer._fused_quant = fused
        cache = optimized.AttentionCache.empty(FLASH, layer_id, 1, "cuda", packed=True)
        prompt = layer(x[:300], positions[:300], torch.tensor([0, 300], dtype=torch.int32, device="cuda"), cache)
        step = layer(x[300:], positions[300:], torch.tensor([0, 1], dtype=torch.int32, device="cuda"), cache)
        outs.append(torch.cat((prompt, step)))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@needs_triton
def test_sparse_attention_quantized_names_bad_groups_and_falls_back_off_sm90() -> None:
    """Groups that do not split the heads into whole 128-channel blocks name `n_groups`; where the sm_90 kernel
    does not run (here: the CPU interpreter, 8-head programs), the result is the attention then the quantization
    kernel, in either scale layout."""
    from optimized.triton import quant
    from optimized.triton import sparse_attention as tsa

    q, kv, indices, sink = _attention_inputs("e4m3fn", tokens=3, heads=8)
    positions = torch.tensor([0, 5, 130], device=q.device)
    freqs = yarn_frequencies(TINY, 4).to(q.device)
    with pytest.raises(ValueError, match="n_groups"):
        tsa.sparse_attention_quantized(q, kv, indices, sink, 512**-0.5, positions, freqs, n_groups=3)
    o = tsa.sparse_attention(q, kv, indices, sink, 512**-0.5)
    for layout in ("deepgemm", "row_major"):
        want = quant.quantize_attn_output_checked(o, positions, freqs, n_groups=2, scale_layout=layout)
        got = tsa.sparse_attention_quantized(q, kv, indices, sink, 512**-0.5, positions, freqs, n_groups=2,
                                             scale_layout=layout)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------------------------
# Indexer top-k
# ------------------------------------------------------------------------------------------------


def _stable_topk_sets(scores: torch.Tensor, n_visible: torch.Tensor, k: int) -> list[list[int]]:
    """The definition: the min(k, n) visible entries with the largest scores, ties to the lower index."""
    out = []
    for row, n in zip(scores.tolist(), n_visible.tolist()):
        order = sorted(range(n), key=lambda j: (-row[j], j))[:k]
        out.append(sorted(order))
    return out


@needs_triton
@pytest.mark.parametrize("n", [40, 2100])
def test_topk_selects_the_largest_visible_scores_with_ties_to_the_lower_index(n: int) -> None:
    g = generator(3)
    rows = 6
    scores = torch.randn(rows, n, generator=g).to(torch.bfloat16).float()  # bf16 values: many exact ties
    scores[0] = 1.0  # all tied
    scores[1, ::2] = -0.0  # -0.0 ties +0.0
    scores[1, 1::2] = 0.0
    n_visible = torch.tensor([n, n - 3, 0, 5, 17, n // 2])
    k = 16
    got = optimized.indexer_topk(scores.to(KERNEL_DEVICE), n_visible.to(KERNEL_DEVICE), k, backend="triton")
    want = _stable_topk_sets(scores, n_visible, k)
    for t in range(rows):
        kept = sorted(int(i) for i in got[t] if i >= 0)
        assert kept == want[t], t
        assert int((got[t] == -1).sum()) == k - len(want[t])


@needs_triton
def test_topk_of_the_reference_scores_equals_the_reference_selection() -> None:
    g = generator(4)
    scores = torch.randn(9, 30, generator=g).to(KERNEL_DEVICE)
    n_visible = (torch.arange(9) * 30 // 8).to(KERNEL_DEVICE)
    got = optimized.indexer_topk(scores, n_visible, 8, backend="triton")
    expected = ref.indexer_topk(scores, n_visible, 8)
    assert torch.equal(got.sort(dim=1).values, expected.sort(dim=1).values)


# ------------------------------------------------------------------------------------------------
# The fused norm / RoPE / quantization kernel on identical inputs
# ------------------------------------------------------------------------------------------------


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@needs_triton
@pytest.mark.parametrize("fmt", KERNEL_FP8_FORMATS)
def test_fused_kv_finish_is_bitwise_the_reference_steps_and_packs_its_bytes(fmt: str) -> None:
    from optimized.triton.rope_quant import rope_quant

    g = generator(5)
    kv = (torch.randn(9, 512, generator=g) * 3).to(KERNEL_DEVICE, torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(512, generator=g)).to(KERNEL_DEVICE, torch.bfloat16)
    positions = torch.arange(120, 129, device=KERNEL_DEVICE)
    freqs = yarn_frequencies(TINY, 4)
    cos, sin = rope_cos_sin(positions, freqs)
    roped = apply_rope(rms_norm(kv, weight, 1e-6), positions, freqs)
    expected = torch.cat((quant_dequant_fp8(roped[:, :448], 64, fmt), roped[:, 448:]), dim=1)
    got = rope_quant(kv, cos, sin, norm="weighted", norm_weight=weight, quant="fp8", fmt=fmt)
    assert _same_bits(got, expected)
    packed = rope_quant(kv, cos, sin, norm="weighted", norm_weight=weight, quant="packed", fmt=fmt)
    assert torch.equal(packed, pack_kv(roped, fmt))


@needs_triton
def test_fused_query_finish_is_bitwise_the_official_bf16_head_norm_and_rope() -> None:
    from optimized.triton.rope_quant import rope_quant

    g = generator(6)
    q = (torch.randn(5, 8, 512, generator=g) * 4).to(KERNEL_DEVICE, torch.bfloat16)
    positions = torch.tensor([0, 1, 127, 128, 70000], device=KERNEL_DEVICE)
    freqs = yarn_frequencies(TINY, 0)
    cos, sin = rope_cos_sin(positions, freqs)
    got = rope_quant(q.view(-1, 512), cos, sin, norm="head_bf16").view(q.shape)
    assert _same_bits(got, apply_rope(head_rms_norm(q, 1e-6), positions, freqs))


@needs_triton
@pytest.mark.parametrize("hadamard", [True, False])
def test_fused_index_finish_is_bitwise_rope_hadamard_and_fp4(hadamard: bool) -> None:
    from optimized.triton.rope_quant import rope_quant

    g = generator(7)
    u = (torch.randn(6, 128, generator=g) * 3).to(KERNEL_DEVICE)  # pooled fp32 entries
    weight = (1 + 0.1 * torch.randn(128, generator=g)).to(KERNEL_DEVICE, torch.bfloat16)
    positions = torch.arange(6, device=KERNEL_DEVICE) * 4
    freqs = yarn_frequencies(TINY, 4)
    cos, sin = rope_cos_sin(positions, freqs)
    k = apply_rope(rms_norm(u.to(torch.bfloat16), weight, 1e-6), positions, freqs)
    expected = quant_dequant_fp4(hadamard_rotate(k) if hadamard else k, 32)
    got = rope_quant(u, cos, sin, norm="weighted", norm_weight=weight, round_input=True, hadamard=hadamard,
                     quant="fp4")
    assert _same_bits(got, expected)


# ------------------------------------------------------------------------------------------------
# Compressor and layer state
# ------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize(("ratio", "rotate"), [(4, "main"), (4, "indexer")])
def test_compressor_fed_in_chunks_equals_the_prefill_form(ratio: int, rotate: str) -> None:
    weights = ref.random_attention_weights(TINY, 1, generator=generator(8), device=KERNEL_DEVICE)
    w = weights.compressor if rotate == "main" else weights.indexer.compressor
    x = torch.randn(11, TINY.dim, generator=generator(9)).to(KERNEL_DEVICE, torch.bfloat16)
    positions = torch.arange(11, device=KERNEL_DEVICE)
    numerics = OFFICIAL
    freqs = yarn_frequencies(TINY, ratio).to(KERNEL_DEVICE)
    kwargs = dict(freqs=freqs, numerics=numerics, rotate=rotate, norm_eps=TINY.norm_eps)
    whole = optimized.compress(x, positions, w, ratio=ratio, head_dim=w.head_dim, backend="triton", **kwargs)
    state = ref_comp.CompressorState.empty(ratio, w.head_dim, KERNEL_DEVICE)
    pieces = [oa.compress_chunks(x[a:b], positions[a:b], [0, b - a], [state], w, **kwargs)[0]
              for a, b in ((0, 3), (3, 4), (4, 9), (9, 11))]
    assert calc_diff(torch.cat(pieces).float(), whole.float()) <= COMPRESS_SIMULATED.value
    assert state.next_position == 11


def test_the_layers_batched_pool_and_indices_equal_the_reference_layout() -> None:
    """`optimized.attention.pool_and_indices` is `reference.attention.candidate_indices` for a whole batch: the same
    pool and indices, bit for bit, with window rows given as pieces (a wrapped ring) and an empty sequence."""
    g = generator(41)
    win, lengths, firsts = 4, [3, 0, 1, 5], [2, 0, 5, 0]
    starts = [first + (win - 1 if first else 0) for first in firsts]  # each sequence's cache position
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    pieces = [tuple(torch.randn(k, 8, generator=g).to(torch.bfloat16) for k in split)
              for split in ([1, 2, 3], [0], [2, 1, 1], [5])]  # rows first .. start - 1 (ring views), new rows
    entries = [torch.randn(k, 8, generator=g).to(torch.bfloat16) for k in (2, 0, 3, 1)]
    selection = torch.randint(-1, 3, (sum(lengths), 2), generator=g, dtype=torch.int32)
    for b, (start, end) in enumerate(pairwise(bounds)):
        selection[start:end] = selection[start:end].clamp(max=entries[b].shape[0] - 1)
    want_kv, want_idx = ref.candidate_indices([torch.cat(p) for p in pieces], firsts, entries, selection, positions,
                                              torch.tensor(bounds, dtype=torch.int32), win)
    kv, idx = oa.pool_and_indices(pieces, firsts, entries, selection, positions, bounds, win)
    assert torch.equal(kv, want_kv) and torch.equal(idx, want_idx) and idx.dtype == torch.int32


def test_cache_from_the_reference_holds_the_same_rows_packed() -> None:
    cfg, layer_id = TINY, layer_of_kind(TINY, "csa")
    weights = ref.random_attention_weights(cfg, layer_id, generator=generator(10))
    cache = ref.AttentionCache.empty(cfg, layer_id, 2)
    x = torch.randn(13, cfg.dim, generator=generator(11)).to(torch.bfloat16)
    positions = torch.cat((torch.arange(5), torch.arange(8)))
    ref.Attention(cfg, layer_id, weights, OFFICIAL)(x, positions, torch.tensor([0, 5, 13], dtype=torch.int32),
                                                   cache)
    packed = optimized.AttentionCache.from_reference(cache, packed=True)
    for seq, other in zip(cache.sequences, packed.sequences):
        assert torch.equal(unpack_kv(other.window), seq.window)
        assert torch.equal(unpack_kv(other.compressed), seq.compressed)
        assert torch.equal(other.indexer_keys, seq.indexer_keys)
        assert other.next_position == seq.next_position
        assert torch.equal(other.compressor.score, seq.compressor.score)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_the_layer_fed_in_chunks_and_single_tokens_equals_one_prefill(kind: str) -> None:
    """A chunk longer than the window (the ring wraps inside one call; it completes the first ratio-128 block),
    single decode tokens across a ratio-4 block end, then a chunk again: the same outputs as one prefill. The
    kernels see other token counts per call (other GEMM tiles and splits), so the bound is the layer's
    (ATTENTION_LAYER_SIMULATED)."""
    cfg, layer_id = TINY, layer_of_kind(TINY, kind)
    weights = ref.random_attention_weights(cfg, layer_id, generator=generator(12), device=KERNEL_DEVICE)
    layer = optimized.Attention(cfg, layer_id, weights, VLLM_NVIDIA, backend="triton")
    n = cfg.window_size + 20
    x = torch.randn(n, cfg.dim, generator=generator(13)).to(KERNEL_DEVICE, torch.bfloat16)
    positions = torch.arange(n, device=KERNEL_DEVICE)
    whole = layer(x, positions, torch.tensor([0, n], dtype=torch.int32, device=KERNEL_DEVICE))
    cache = optimized.AttentionCache.empty(cfg, layer_id, 1, KERNEL_DEVICE)
    cuts = [0, cfg.window_size + 2, cfg.window_size + 3, cfg.window_size + 4, cfg.window_size + 5, n]
    pieces = [layer(x[a:b], positions[a:b], torch.tensor([0, b - a], dtype=torch.int32, device=KERNEL_DEVICE), cache)
              for a, b in pairwise(cuts)]
    assert calc_diff(torch.cat(pieces).float(), whole.float()) <= ATTENTION_LAYER_SIMULATED.value
    assert cache.sequences[0].next_position == n


def test_a_cache_that_does_not_match_its_positions_is_rejected_on_the_host() -> None:
    cfg, layer_id = TINY, layer_of_kind(TINY, "csa")
    weights = ref.random_attention_weights(cfg, layer_id, generator=generator(14))
    layer = optimized.Attention(cfg, layer_id, weights, VLLM_NVIDIA, backend="triton")
    cache = optimized.AttentionCache.empty(cfg, layer_id, 1)
    cache.sequences[0].next_position = 8  # claims 8 tokens, holds no entries
    x = torch.randn(1, cfg.dim, generator=generator(15)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="cache: sequence 0 at position 8 holds compressed 0, expected 2"):
        layer(x, torch.tensor([8]), torch.tensor([0, 1], dtype=torch.int32), cache)


# ------------------------------------------------------------------------------------------------
# DeepGEMM indexer adapter (GPU)
# ------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("round_bf16", [True, False])
def test_indexer_logits_decode_tiles_give_the_prefill_tiles_logits(round_bf16: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode batch (sequences of 1-2 new tokens, each scoring only its own keys, contexts of 1 to 200 keys):
    the 16-token decode tiles give the 64-token tiles' logits up to the fp32 summation order of the dots (the
    interpreter's matmul of another M, as the GPU's MMA of another M may), and the reference's per sequence;
    `tokens_per_sequence` <= DECODE_MAX_TOKENS picks them."""
    from optimized.triton import indexer as ti
    from reference.indexer import indexer_scores

    g = generator(31)
    contexts, new_tokens = [200, 1, 65, 130, 17], [1, 2, 1, 1, 2]
    keys = [torch.randn(n, 128, generator=g).to(torch.bfloat16) for n in contexts]
    n_tokens = sum(new_tokens)
    q = torch.randn(n_tokens, 8, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(n_tokens, 8, generator=g) * 128**-0.5 * 8**-0.5
    starts = torch.tensor([0, *torch.tensor(contexts).cumsum(0).tolist()[:-1]])
    k_start = torch.repeat_interleave(starts, torch.tensor(new_tokens)).to(torch.int32)
    k_end = k_start + torch.repeat_interleave(torch.tensor(contexts), torch.tensor(new_tokens)).to(torch.int32)
    args = [t.to(KERNEL_DEVICE) for t in (q, torch.cat(keys), w, k_start, k_end)]
    launched = []
    kernel = ti._indexer_logits_kernel

    class Spy:
        def __getitem__(self, grid: tuple[int, int]) -> Callable[..., None]:
            def run(*a: Any, **kw: Any) -> None:
                launched.append(kw["BLOCK_T"])
                kernel[grid](*a, **kw)
            return run

    monkeypatch.setattr(ti, "_indexer_logits_kernel", Spy())
    decode = ti.indexer_logits(*args, max(contexts), round_bf16=round_bf16, tokens_per_sequence=max(new_tokens))
    prefill = ti.indexer_logits(*args, max(contexts), round_bf16=round_bf16)
    assert launched == [ti.DECODE_BLOCK_T, ti.LOGITS_BLOCK_T]
    numerics = VLLM_NVIDIA.replace(indexer_fp4_sim=False, indexer_scores_bf16=round_bf16)
    bound = (INDEXER_SCORES_BF16 if round_bf16 else INDEXER_SCORES_FP32).value
    for t in range(n_tokens):
        n = int(k_end[t] - k_start[t])
        assert calc_diff(decode[t, :n], prefill[t, :n]) <= bound
        b = int(torch.searchsorted(starts, k_start[t], right=True)) - 1
        expected = indexer_scores(q[t:t + 1], keys[b], w[t:t + 1], numerics)[0]
        assert calc_diff(decode[t, :n].cpu(), expected.float()) <= bound


@pytest.mark.gpu
@pytest.mark.skipif(not DEEPGEMM_OK, reason=f"deepgemm unavailable: {DEEPGEMM_WHY}")
def test_deepgemm_paged_logits_equal_its_flat_logits_and_the_reference() -> None:
    from optimized.deepgemm import indexer as dgi
    from reference.indexer import indexer_scores

    g = torch.Generator(device="cuda").manual_seed(12)
    contexts = [700, 64, 1, 2049]
    keys = [torch.randn(n, 128, generator=g, device="cuda").to(torch.bfloat16) for n in contexts]
    q = torch.randn(len(contexts), 64, 128, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(len(contexts), 64, generator=g, device="cuda") * 128**-0.5 * 64**-0.5
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    paged = dgi.paged_mqa_logits(q, keys, w, lens.view(-1, 1), max(contexts))
    starts = torch.tensor([0, *torch.tensor(contexts).cumsum(0).tolist()[:-1]], dtype=torch.int32, device="cuda")
    flat = dgi.mqa_logits(q, torch.cat(keys), w, starts, starts + lens, max(contexts))
    numerics = VLLM_NVIDIA.replace(indexer_fp4_sim=False)
    for b, n in enumerate(contexts):
        expected = indexer_scores(q[b:b + 1], keys[b], w[b:b + 1], numerics)[0]
        assert calc_diff(paged[b, :n], flat[b, :n]) <= INDEXER_SCORES_FP32.value
        assert calc_diff(flat[b, :n], expected) <= FP8_END_TO_END.value


# ------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before any kernel launch
# ------------------------------------------------------------------------------------------------


class _NoLaunch:
    def __getitem__(self, grid: Any) -> Callable[..., None]:
        raise AssertionError("a kernel was launched for a malformed call")


@pytest.fixture
def no_kernel_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from optimized.triton import compressor, indexer, rope_quant, sparse_attention

    for module, name in ((sparse_attention, "_sparse_attention_kernel"), (sparse_attention, "_merge_splits_kernel"),
                         (indexer, "_indexer_logits_kernel"), (indexer, "_topk_kernel"),
                         (rope_quant, "_rope_quant_kernel"), (compressor, "_projection_kernel"),
                         (compressor, "_pool_kernel")):
        monkeypatch.setattr(module, name, _NoLaunch())


def _sparse_call(**changes: Any) -> Callable[[], Any]:
    q, kv, indices, sink = _attention_inputs("e4m3fn", tokens=2, rows=40, slots=8, seed=13)
    args = {"q": q, "kv": kv, "indices": indices, "sink": sink, "scale": 512**-0.5, "fmt": "e4m3fn",
            "backend": "triton", **changes}
    return lambda: optimized.sparse_attention(**args)


def _indices_with_duplicate() -> torch.Tensor:
    _, _, indices, _ = _attention_inputs("e4m3fn", tokens=2, rows=40, slots=8, seed=13)
    indices[1, 3] = indices[1, 2] = 7
    return indices


def _sparse_bad() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    q, kv, indices, sink = _attention_inputs("e4m3fn", tokens=2, rows=40, slots=8, seed=13)
    return {
        "q_dtype": (_sparse_call(q=q.float()), TypeError, "q"),
        "q_head_dim": (_sparse_call(q=q[..., :256]), ValueError, "q"),
        "kv_dtype": (_sparse_call(kv=kv.float()), TypeError, "kv"),
        "kv_packed_width": (_sparse_call(kv=pack_kv(kv)[:, :576]), ValueError, "kv"),
        "kv_not_contiguous": (_sparse_call(kv=kv.t().contiguous().t()), ValueError, "kv"),
        "indices_dtype": (_sparse_call(indices=indices.long()), TypeError, "indices"),
        "indices_rows": (_sparse_call(indices=indices[:1]), ValueError, "indices"),
        "indices_range": (_sparse_call(indices=indices + 40), ValueError, "indices"),
        "indices_below_minus_one": (_sparse_call(indices=indices - 2), ValueError, "indices"),
        "indices_duplicate": (_sparse_call(indices=_indices_with_duplicate()), ValueError, "twice"),
        "sink_shape": (_sparse_call(sink=sink[:4]), ValueError, "sink"),
        "sink_dtype": (_sparse_call(sink=sink.double()), TypeError, "sink"),
        "scale": (_sparse_call(scale=0.0), ValueError, "scale"),
        "fmt": (_sparse_call(fmt="e5m2"), ValueError, "fmt"),
        "device": (_sparse_call(sink=sink.to("meta")), ValueError, "sink"),
        "backend": (_sparse_call(backend="cuda"), ValueError, "backend"),
    }


def _indexer_bad() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    g = generator(14)
    q = torch.randn(3, 4, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(10, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 4, generator=g)
    scores = torch.randn(3, 10, generator=g)
    n_visible = torch.tensor([1, 5, 10])

    def scores_call(**changes: Any) -> Callable[[], Any]:
        args = {"q_idx": q, "k_idx": k, "head_weights": w, "numerics": OFFICIAL, "backend": "triton", **changes}
        return lambda: optimized.indexer_scores(**args)

    def topk_call(**changes: Any) -> Callable[[], Any]:
        args = {"scores": scores, "n_visible": n_visible, "topk": 4, "backend": "triton", **changes}
        return lambda: optimized.indexer_topk(**args)

    return {
        "scores/q_dtype": (scores_call(q_idx=q.float()), TypeError, "q_idx"),
        "scores/head_dim": (scores_call(q_idx=q[..., :96].contiguous(), k_idx=k[:, :96].contiguous()), ValueError,
                            "head dim"),
        "scores/weights_shape": (scores_call(head_weights=w[:, :2]), ValueError, "head_weights"),
        "scores/numerics": (scores_call(numerics="official"), TypeError, "numerics"),
        "topk/scores_dtype": (topk_call(scores=scores.double()), ValueError, "scores"),
        "topk/n_visible_range": (topk_call(n_visible=n_visible + 1), ValueError, "n_visible"),
        "topk/topk": (topk_call(topk=0), ValueError, "topk"),
    }


def _layer_bad() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    cfg, layer_id = TINY, layer_of_kind(TINY, "csa")
    weights = ref.random_attention_weights(cfg, layer_id, generator=generator(15))
    numerics = OFFICIAL.replace(wo_a="fp8")
    x = torch.randn(4, cfg.dim, generator=generator(16)).to(torch.bfloat16)
    positions = torch.arange(4)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    freqs = yarn_frequencies(cfg, 4)
    w = weights.compressor

    def attend(**changes: Any) -> Callable[[], Any]:
        args = {"x": x, "positions": positions, "cu_seqlens": cu, "cache": None, **changes}
        return lambda: optimized.Attention(cfg, layer_id, weights, numerics, backend="triton")(**args)

    return {
        "attention/wo_a_bf16": (lambda: optimized.Attention(cfg, layer_id, weights, OFFICIAL, backend="triton"),
                                ValueError, "wo_a"),
        "attention/act_quant": (lambda: optimized.Attention(cfg, layer_id, weights, numerics.replace(act_quant=False),
                                                            backend="triton"), ValueError, "act_quant"),
        "attention/weights_layer": (lambda: optimized.Attention(cfg, 0, weights, numerics, backend="triton"),
                                    ValueError, "weights"),
        "attention/x_dtype": (attend(x=x.float()), TypeError, "x"),
        "attention/positions_order": (attend(positions=positions.flip(0)), ValueError, "positions"),
        "attention/cu_seqlens": (attend(cu_seqlens=torch.tensor([0, 3], dtype=torch.int32)), ValueError,
                                 "cu_seqlens"),
        "attention/cache_type": (attend(cache=ref.AttentionCache.empty(cfg, layer_id, 1)), TypeError, "cache"),
        "attention/cache_layer": (attend(cache=optimized.AttentionCache.empty(cfg, 2, 1)), ValueError, "cache"),
        "attention/cache_rows": (attend(cache=optimized.AttentionCache.empty(cfg, layer_id, 1, packed=False)),
                                 ValueError, "cache"),
        "attention/cache_position": (attend(positions=positions + 3,
                                            cache=optimized.AttentionCache.empty(cfg, layer_id, 1)), ValueError,
                                     "positions"),
        "cache/batch": (lambda: optimized.AttentionCache.empty(cfg, layer_id, -1), ValueError, "batch"),
        "project_q/freqs": (lambda: optimized.project_q(x, weights, cfg, positions, freqs[:16], numerics,
                                                        backend="triton"), ValueError, "freqs"),
        "project_q/fp8_format": (lambda: optimized.project_q(x, weights, cfg, positions, freqs, numerics.replace(
            fp8_format="e4m3fnuz"), backend="triton"), TypeError, "w.wq_a"),
        "project_kv/x_shape": (lambda: optimized.project_kv(x[:, :128], weights, cfg, positions, freqs, numerics,
                                                            backend="triton"), ValueError, "x"),
        "indexer_q/x_rows": (lambda: optimized.indexer_q(torch.zeros(4, cfg.q_lora_rank, dtype=torch.bfloat16), x[:2],
                                                         weights.indexer, positions, freqs, numerics,
                                                         backend="triton"), ValueError, "x"),
        "compress/positions": (lambda: optimized.compress(x, positions + 1, w, ratio=4, head_dim=512, freqs=freqs,
                                                          numerics=numerics, rotate="main", backend="triton"),
                               ValueError, "positions"),
        "compress/ratio": (lambda: optimized.compress(x, positions, w, ratio=128, head_dim=512, freqs=freqs,
                                                      numerics=numerics, rotate="main", backend="triton"),
                           ValueError, "weights"),
        "compress/rotate": (lambda: optimized.compress(x, positions, w, ratio=4, head_dim=512, freqs=freqs,
                                                       numerics=numerics, rotate="both", backend="triton"),
                            ValueError, "rotate"),
    }


BAD = {
    **{f"sparse_attention/{k}": v for k, v in _sparse_bad().items()},
    **{f"indexer/{k}": v for k, v in _indexer_bad().items()},
    **_layer_bad(),
}


@needs_triton
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_naming_the_argument_before_any_kernel_launch(name: str, no_kernel_launch: None) -> None:
    call, error, fragment = BAD[name]
    with pytest.raises(error, match=fragment):
        call()


def test_deepgemm_indexer_rejects_the_official_bf16_scores() -> None:
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    k = torch.zeros(3, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="numerics"):
        oa._check_indexer_scores_args(q, k, torch.zeros(2, 64), OFFICIAL, "deepgemm")
