"""The FP8 output einsum end to end (spec §3.6, §4): reference self-checks, the Triton kernels against the
reference (CPU: `TRITON_INTERPRET=1`, TINY shapes, both FP8 formats), the FLASH / PRO matrix on a GPU for
triton and deepgemm, and every malformed argument of the public functions.

Parity cases and their bounds live in `parity_tests/ops/einsum.py` and `parity_tests/tolerances.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from einops import rearrange

import optimized
from optimized.backends import backend_status, detect, registry
from optimized.deepgemm import einsum as dg_einsum
from optimized.deepgemm import linear as dg_linear
from parity_tests.cases import FP8_FORMATS, TINY_DEVICE, Case, all_cases, generator
from parity_tests.metrics import calc_diff
from parity_tests.ops.einsum import GPU_CONFIGS, OPS
from parity_tests.testing import KERNEL_DEVICE, KERNEL_FP8_FORMATS, assert_case_passes
from parity_tests.tolerances import FP8_END_TO_END, FP8_GEMM_SIMULATED, fp8_quant_dequant_bound
from reference import einsum as ref
from reference.config import TINY
from reference.formats import fp8_format, quantize_per_block, quantize_per_token
from reference.invariant import einsum_fp32
from reference.linear import fp8_linear as ref_fp8_linear
from reference.numerics import EXACT, OFFICIAL, VLLM_NVIDIA
from reference.rope import yarn_frequencies
from reference.weights import Fp8Weight, random_fp8_weight

TRITON_OK, TRITON_WHY = backend_status("triton")
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=f"triton backend unavailable: {TRITON_WHY}")


# ------------------------------------------------------------------------------------------------
# Parity cases
# ------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("case", all_cases("TINY", TINY_DEVICE, ops=list(OPS)), ids=lambda case: case.id)
def test_triton_matches_the_reference_on_tiny_cases(case: Case) -> None:
    assert_case_passes(case, "triton")


_GPU = [(case, backend) for config in GPU_CONFIGS for case in all_cases(config, "cuda", ops=list(OPS))
        for backend in case.backends]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FLASH / PRO shapes)")
@pytest.mark.parametrize(("case", "backend"), _GPU, ids=[f"{case.id}-{backend}" for case, backend in _GPU])
def test_backends_match_the_reference_at_flash_and_pro_shapes(case: Case, backend: str) -> None:
    assert_case_passes(case, backend)


def test_every_einsum_op_is_registered_for_every_backend() -> None:
    reg = registry()
    for op in OPS:
        assert set(reg[op]) == {"reference", "triton", "deepgemm"}, op


# ------------------------------------------------------------------------------------------------
# Reference self-checks
# ------------------------------------------------------------------------------------------------


def _fp8_operand(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], fmt: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 data and random power-of-two scales (2^-4 .. 2^3) of the given shapes."""
    g = generator(seed)
    f = fp8_format(fmt)
    data = (torch.randn(shape, generator=g) * 8).clamp(-f.max, f.max).to(f.dtype)
    scale = torch.exp2(torch.randint(-4, 4, scale_shape, generator=g).float())
    return data, scale


def test_reference_einsum_equals_the_per_block_promotion_formula() -> None:
    """spec §4.1: Z[b,h,d] = bf16( sum_kb sA[b,h,kb] * sB[h,d//128,kb] * sum_{r in kb} A[b,h,r] B[h,d,r] )."""
    b, h, r, d = 3, 2, 384, 256
    a = _fp8_operand((b, h, r), (b, h, r // 128), "e4m3fn", 0)
    w = _fp8_operand((h, d, r), (h, d // 128, r // 128), "e4m3fn", 1)
    z = torch.zeros(b, h, d)
    for kb in range(r // 128):
        block = slice(128 * kb, 128 * (kb + 1))
        partial = torch.einsum("bhr,hdr->bhd", a[0][..., block].float(), w[0][..., block].float())
        sb = w[1][:, :, kb].repeat_interleave(128, dim=1)  # [h, d]
        z += partial * a[1][:, :, kb, None] * sb[None]
    out = ref.fp8_einsum("bhr,hdr->bhd", a, w)
    assert out.dtype == torch.bfloat16
    assert calc_diff(out, z.to(torch.bfloat16)) <= FP8_GEMM_SIMULATED.value


def _expand(scale: torch.Tensor, index: Callable[..., Any], shape: tuple[int, ...]) -> torch.Tensor:
    """scale[index(i0, i1, i2)] for every element index of a tensor of `shape` (explicit DeepGEMM layout)."""
    grids = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    return scale[index(*grids)]


# DeepGEMM's scale layouts written as index maps of each data element (reference.einsum's table, independently).
_LAYOUTS: dict[tuple[str, tuple[int, int, int]], tuple[Callable[..., Any], Callable[..., Any]]] = {
    ("bhr,hdr->bhd", (1, 128, 128)): (lambda b, h, r: (b, h, r // 128), lambda h, d, r: (h, d // 128, r // 128)),
    ("bhr,hdr->bhd", (1, 1, 128)): (lambda b, h, r: (b, h, r // 128), lambda h, d, r: (h, d, r // 128)),
    ("bhd,hdr->bhr", (1, 128, 128)): (lambda b, h, d: (b, h, d // 128), lambda h, d, r: (h, d // 128, r // 128)),
    ("bhd,hdr->bhr", (1, 1, 128)): (lambda b, h, d: (b, h, d // 128), lambda h, d, r: (h, d // 128, r)),
    ("bhd,bhr->hdr", (1, 128, 128)): (lambda b, h, d: (b // 128, h, d), lambda b, h, r: (b // 128, h, r // 128)),
    ("bhd,bhr->hdr", (1, 1, 128)): (lambda b, h, d: (b // 128, h, d), lambda b, h, r: (b // 128, h, r)),
}


@pytest.mark.parametrize(("expr", "recipe"), list(_LAYOUTS), ids=[f"{e}-{r}" for e, r in _LAYOUTS])
def test_reference_einsum_follows_deepgemm_scale_layouts(expr: str, recipe: tuple[int, int, int]) -> None:
    nb, h, d, r = 130, 2, 256, 384  # nb not a multiple of 128: the token-blocked scales round up
    a_shape, b_shape = {"bhr,hdr->bhd": ((nb, h, r), (h, d, r)), "bhd,hdr->bhr": ((nb, h, d), (h, d, r)),
                        "bhd,bhr->hdr": ((nb, h, d), (nb, h, r))}[expr]
    a_index, b_index = _LAYOUTS[(expr, recipe)]

    def scale_shape(shape: tuple[int, ...], index: Callable[..., Any]) -> tuple[int, ...]:
        return tuple(int(i) + 1 for i in index(*(n - 1 for n in shape)))

    a = _fp8_operand(a_shape, scale_shape(a_shape, a_index), "e4m3fn", 2)
    b = _fp8_operand(b_shape, scale_shape(b_shape, b_index), "e4m3fn", 3)
    expected = einsum_fp32(expr, a[0].float() * _expand(a[1], a_index, a_shape),
                           b[0].float() * _expand(b[1], b_index, b_shape))
    out = ref.fp8_einsum(expr, a, b, torch.empty(expected.shape), recipe=recipe)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_quantize_attn_output_at_position_zero_is_plain_per_token_quantization(fmt: str) -> None:
    o = torch.randn(5, TINY.n_heads, TINY.head_dim, generator=generator(4)).to(torch.bfloat16)
    freqs = yarn_frequencies(TINY, 4)
    q, s = ref.quantize_attn_output(o, torch.zeros(5, dtype=torch.long), freqs, n_groups=TINY.o_groups, fmt=fmt)
    grouped = rearrange(o.float(), "t (g h) d -> t g (h d)", g=TINY.o_groups)
    rq, rs = quantize_per_token(grouped, 128, fmt, eps=ref.ATTN_OUT_EPS)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_quantize_attn_output_dequantizes_to_the_inverse_rotation_within_half_an_fp8_step(fmt: str) -> None:
    """The RoPE dims come back un-rotated in fp32 (forward RoPE of an fp32 vector, then the quantizer's inverse
    RoPE): every value within half an FP8 step (at its block scale) plus the fp32 rotation error."""
    t = 7
    x = torch.randn(t, TINY.n_heads, TINY.head_dim, generator=generator(5))
    positions = torch.randint(0, 1 << 20, (t,), generator=generator(6))
    freqs = yarn_frequencies(TINY, 4)
    from reference.rope import apply_rope

    o = apply_rope(x, positions, freqs).to(torch.bfloat16)
    q, s = ref.quantize_attn_output(o, positions, freqs, n_groups=TINY.o_groups, fmt=fmt)
    got = rearrange(ref.dequantize_operand(q, s, (1, 1, 128)), "t g (h d) -> t (g h) d", d=TINY.head_dim)
    # what the quantizer saw: o (bf16) rotated back in fp32; compare against it, not against x (bf16-rounded)
    unrotated = apply_rope(o.float(), positions, freqs, inverse=True)
    scale = s.repeat_interleave(128, -1).view(t, -1, TINY.head_dim)
    step = fp8_format(fmt).step(got / scale) * scale  # the E4M3 spacing at each stored value, scaled
    assert bool(((got - unrotated).abs() <= fp8_quant_dequant_bound(1.0) * step).all())
    # and the rotation really was undone: the RoPE dims match x up to bf16 and FP8 rounding
    assert calc_diff(got[..., -64:], x[..., -64:]) <= FP8_END_TO_END.value


def test_output_projection_bf16_path_is_a_per_group_matmul() -> None:
    """spec §3.6: z_g = W^a_g o_g per group (official bf16 path), then wo_b; checked group by group."""
    t, g = 5, TINY.o_groups
    o = torch.randn(t, TINY.n_heads, TINY.head_dim, generator=generator(7)).to(torch.bfloat16)
    positions = torch.randint(0, 1 << 16, (t,), generator=generator(8))
    freqs = yarn_frequencies(TINY, 4)
    rank = g * TINY.o_lora_rank
    wo_a = random_fp8_weight(rank, TINY.o_group_dim, generator=generator(9))
    wo_b = random_fp8_weight(TINY.dim, rank, generator=generator(10))
    from reference.rope import apply_rope

    rotated = apply_rope(o, positions, freqs, inverse=True)  # bf16
    w = wo_a.dequantize().to(torch.bfloat16).float()
    heads = TINY.heads_per_group
    z = torch.cat([(rotated[:, k * heads:(k + 1) * heads].reshape(t, -1).float()
                    @ w[k * TINY.o_lora_rank:(k + 1) * TINY.o_lora_rank].T).to(torch.bfloat16) for k in range(g)], -1)
    expected = ref_fp8_linear(z, wo_b, EXACT)
    out = ref.output_projection(o, positions, freqs, wo_a, wo_b, EXACT)
    assert calc_diff(out, expected) <= FP8_GEMM_SIMULATED.value


@pytest.mark.parametrize("numerics", [OFFICIAL, VLLM_NVIDIA, EXACT], ids=lambda n: n.name)
def test_reference_output_projection_of_a_token_does_not_depend_on_the_batch(numerics: object) -> None:
    """Decode (one token) equals prefill (all tokens) bit for bit: every sum accumulates in fp64."""
    t, rank = 6, TINY.o_groups * TINY.o_lora_rank
    o = torch.randn(t, TINY.n_heads, TINY.head_dim, generator=generator(28)).to(torch.bfloat16)
    positions = torch.randint(0, 1 << 20, (t,), generator=generator(29))
    freqs = yarn_frequencies(TINY, 4)
    wo_a = random_fp8_weight(rank, TINY.o_group_dim, generator=generator(30))
    wo_b = random_fp8_weight(TINY.dim, rank, generator=generator(31))
    batch = ref.output_projection(o, positions, freqs, wo_a, wo_b, numerics)
    for i in (0, t - 1):
        one = ref.output_projection(o[i:i + 1], positions[i:i + 1], freqs, wo_a, wo_b, numerics)
        assert torch.equal(one, batch[i:i + 1]), i


# ------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on the CPU)
# ------------------------------------------------------------------------------------------------


def _awkward_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows spanning 1e-7 .. 1e4 in magnitude, with an all-zero row, a row of -0.0, a row under the eps floor,
    a NaN (its block keeps the NaN, scale 2^127), an Inf (saturates) and a row of exact ties between FP8 values
    (amax 448: scale 1; normal ties 1 + 1/16 -> 1 and 1 + 3/16 -> 1.25, subnormal ties 2^-10 -> 0 and
    3 * 2^-10 -> 2^-8, a negative tie to zero -> -0: round-to-nearest-even, whichever path rounds)."""
    x = torch.randn(m, k, generator=generator(seed)) * torch.logspace(-7, 4, m)[:, None]
    x[1] = 0.0
    x[2] = -0.0
    x[3] = 1e-6
    x[4, 5] = float("nan")
    x[5, 40] = -float("inf")
    x[6, :8] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, -1.1875, 2.0**-10, 3 * 2.0**-10, -(2.0**-10)])
    return x.to(KERNEL_DEVICE, torch.bfloat16)


def _same_fp8(q: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal bytes, except that a NaN may carry either sign (torch's own cast sets it by code path)."""
    nan, expected_nan = q.float().isnan(), expected.float().isnan()
    return torch.equal(nan, expected_nan) and torch.equal(q.view(torch.uint8)[~nan], expected.view(torch.uint8)[~nan])


@needs_triton
@pytest.mark.parametrize("fmt", KERNEL_FP8_FORMATS)
@pytest.mark.parametrize("block", [32, 64, 128])
def test_triton_quantize_per_token_bytes_equal_the_reference(block: int, fmt: str) -> None:
    from optimized.triton.quant import quantize_per_token as triton_quantize

    x = _awkward_rows(37, 256, block)
    expect_q, expect_s = quantize_per_token(x, block, fmt)
    for layout in ("row_major", "deepgemm"):
        q, s = triton_quantize(x, block, fmt, layout)
        assert _same_fp8(q, expect_q), layout
        assert torch.equal(s, expect_s), layout


@needs_triton
def test_triton_quantize_per_token_writes_deepgemm_scales_mn_major_aligned_with_zero_padding() -> None:
    from optimized.triton.quant import quantize_per_token as triton_quantize

    m, k = 37, 512
    _, s = triton_quantize(_awkward_rows(m, k, 0).float(), 128, "e4m3fn", "deepgemm")
    m4 = 40
    assert s.shape == (m, k // 128) and s.stride() == (1, m4)
    storage = s.as_strided((k // 128, m4), (m4, 1))
    assert bool((storage[:, m:] == 0).all())


@needs_triton
@pytest.mark.parametrize("fmt", KERNEL_FP8_FORMATS)
def test_triton_quantize_attn_output_deepgemm_layout_has_the_same_values(fmt: str) -> None:
    from optimized.triton.quant import quantize_attn_output as triton_quantize

    t = 5
    o = torch.randn(t, TINY.n_heads, TINY.head_dim, generator=generator(11)).to(KERNEL_DEVICE, torch.bfloat16)
    o[2, 3] = 0.0  # an all-zero head takes the 1e-10 eps floor
    positions = torch.randint(0, 1 << 20, (t,), generator=generator(12)).to(KERNEL_DEVICE)
    freqs = yarn_frequencies(TINY, 128).to(KERNEL_DEVICE)
    rq, rs = ref.quantize_attn_output(o, positions, freqs, n_groups=TINY.o_groups, fmt=fmt)
    q, s = triton_quantize(o, positions, freqs, n_groups=TINY.o_groups, fmt=fmt, scale_layout="deepgemm")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    g, nb, t4 = TINY.o_groups, TINY.o_group_dim // 128, 8
    assert q.permute(1, 0, 2).is_contiguous()  # DeepGEMM's A.permute(1, 0, 2).stride(-1) == 1, no copy
    assert s.stride() == (1, nb * t4, t4)  # [G, nb, T4] storage, MN-major per group
    assert bool((s.as_strided((g, nb, t4), (nb * t4, t4, 1))[..., t:] == 0).all())


def _awkward_heads(t: int, h: int, head_dim: int, seed: int) -> torch.Tensor:
    """Attention output spanning 1e-6 .. 1e3 across tokens, with an all-zero head, a head of -0.0, NaN in a NoPE and
    in a RoPE dim (the NaN spreads to its pair's partner), +-Inf in both (the rotation makes Inf - Inf = NaN)."""
    o = torch.randn(t, h, head_dim, generator=generator(seed)) * torch.logspace(-6, 3, t)[:, None, None]
    o[0, 1] = 0.0
    o[0, 2] = -0.0
    o[1, 3 % h, head_dim - 12] = float("nan")
    o[1, 4 % h, 10] = float("nan")
    o[t - 1, 5 % h, head_dim - 52] = float("inf")
    o[t - 1, 6 % h, 3] = -float("inf")
    return o.to(KERNEL_DEVICE, torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("fmt", KERNEL_FP8_FORMATS)
@pytest.mark.parametrize(("heads", "head_dim", "rope_dim", "groups", "rows"),
                         [(8, 512, 64, 2, 32), (8, 512, 64, 2, 64), (8, 512, 64, 2, 4), (4, 256, 128, 1, 8),
                          (8, 64, 16, 2, 32), (4, 256, 256, 2, 8)],
                         ids=["dsv4-8-heads-a-program", "dsv4-2-tokens-a-program", "dsv4-1-head",
                              "rope-fills-the-block", "2-heads-a-block", "rope-spans-blocks"])
def test_triton_quantize_attn_output_bytes_equal_the_reference_on_awkward_heads(
    heads: int, head_dim: int, rope_dim: int, groups: int, rows: int, fmt: str
) -> None:
    """Both kernels: the head-tiled one (whole 128-blocks per head, RoPE in the last) on the first four shapes (16
    heads a program take two tokens of 8 heads), the block-tiled one where a block holds two heads or the RoPE dims
    span blocks; T = 5 leaves the last program partly empty and pads the DeepGEMM layout to 8 rows."""
    from optimized.triton.quant import QuantConfig, head_kernel_fits
    from optimized.triton.quant import quantize_attn_output as triton_quantize

    assert head_kernel_fits(head_dim, rope_dim) == (head_dim % 128 == 0 and rope_dim <= 128)
    t = 5
    o = _awkward_heads(t, heads, head_dim, 19)
    positions = torch.randint(0, 1 << 20, (t,), generator=generator(20)).to(KERNEL_DEVICE)
    freqs = (torch.rand(rope_dim // 2, generator=generator(21)) * 0.1).to(KERNEL_DEVICE)
    rq, rs = ref.quantize_attn_output(o, positions, freqs, n_groups=groups, fmt=fmt)
    assert bool(rs.eq(2.0**127).any()), "the NaN blocks must be in the case"
    for layout in ("row_major", "deepgemm"):
        q, s = triton_quantize(o, positions, freqs, n_groups=groups, fmt=fmt, scale_layout=layout,
                               config=QuantConfig(rows, 4))
        assert _same_fp8(q, rq), layout
        assert torch.equal(s, rs), layout


@needs_triton
@pytest.mark.parametrize(("head_dim", "rope_dim", "kernel", "other"),
                         [(512, 64, "_inv_rope_quant_heads_kernel", "_inv_rope_quant_kernel"),
                          (64, 16, "_inv_rope_quant_kernel", "_inv_rope_quant_heads_kernel")],
                         ids=["dsv4-heads", "two-heads-a-block"])
def test_triton_quantize_attn_output_launches_the_kernel_for_its_shape(
    head_dim: int, rope_dim: int, kernel: str, other: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DSv4's heads take the head-tiled kernel (the fast path must not fall back silently), other shapes the
    block-tiled one."""
    from optimized.triton import quant

    launched = []

    class Spy:
        def __init__(self, name: str) -> None:
            self.name, self.kernel = name, getattr(quant, name)

        def __getitem__(self, grid: object) -> Callable[..., None]:
            launched.append(self.name)
            return self.kernel[grid]

    for name in (kernel, other):
        monkeypatch.setattr(quant, name, Spy(name))
    o = torch.randn(2, 8, head_dim, generator=generator(22)).to(KERNEL_DEVICE, torch.bfloat16)
    freqs = torch.rand(rope_dim // 2, generator=generator(23)).to(KERNEL_DEVICE)
    quant.quantize_attn_output(o, torch.arange(2, device=KERNEL_DEVICE), freqs, n_groups=2)
    assert launched == [kernel]


Pair = tuple[torch.Tensor, torch.Tensor]


def _einsum_inputs(b: int, fmt: str, recipe: tuple[int, int, int] = (1, 128, 128), seed: int = 13) -> tuple[Pair, Pair]:
    h, r, d = TINY.o_groups, TINY.o_group_dim, TINY.o_lora_rank
    g = generator(seed)
    a = quantize_per_token(torch.randn(b, h, r, generator=g).to(KERNEL_DEVICE, torch.bfloat16), 128, fmt)
    w, sw = quantize_per_block((torch.randn(h, d, r, generator=g) * r**-0.5).to(KERNEL_DEVICE), 128, fmt)
    if recipe == (1, 1, 128):
        sw = sw.repeat_interleave(128, dim=1)
    return a, (w, sw)


@needs_triton
@pytest.mark.parametrize("recipe", ref.RECIPES, ids=str)
@pytest.mark.parametrize("tma", [False, True], ids=["pointer_loads", "tma_loads"])
@pytest.mark.parametrize("split_k", [1, 4], ids=["full_k", "split_k"])
def test_triton_einsum_variants_match_the_reference(split_k: int, tma: bool, recipe: tuple[int, int, int]) -> None:
    from optimized.triton.einsum import EinsumConfig
    from optimized.triton.einsum import fp8_einsum as triton_einsum

    a, b = _einsum_inputs(5, "e4m3fn", recipe)
    config = EinsumConfig(block_m=16, block_n=64, split_k=split_k, num_warps=4, num_stages=2, tma=tma)
    out = triton_einsum("bhr,hdr->bhd", a, b, recipe=recipe, config=config)
    assert calc_diff(out, ref.fp8_einsum("bhr,hdr->bhd", a, b, recipe=recipe)) <= FP8_GEMM_SIMULATED.value


@needs_triton
@pytest.mark.parametrize("t", [5, 70], ids=["rows_past_m", "two_m_tiles"])
def test_triton_einsum_tma_loads_equal_pointer_loads_bit_for_bit(t: int) -> None:
    """The TMA descriptors read the same tiles (zeros past M and N) into the same dots: the same bits. The N tail
    (d = 96 against 64-wide tiles) and a transposed [G, T, r] A exercise the descriptors' bounds and strides."""
    from optimized.triton.einsum import EinsumConfig, block_scaled_matmul, tma_loads

    g = generator(31)
    h, d, r = 2, 96, 256
    a, sa = quantize_per_token(torch.randn(h, t, r, generator=g).to(KERNEL_DEVICE), 128, "e4m3fn")
    a, sa = a.transpose(0, 1), sa.transpose(0, 1)  # [t, h, r] views of [h, t, r] storage
    w, sw = quantize_per_block((torch.randn(h * 128, r, generator=g) * r**-0.5).to(KERNEL_DEVICE), 128, "e4m3fn")
    w, sw = w.view(h, 128, r)[:, :d], sw.view(h, 1, r // 128)  # the first 96 rows of each group's 128
    hw = detect()
    assert tma_loads(a, w) == (hw.interpret or hw.arch in ("sm90", "sm100", "sm103"))
    outs = []
    for tma in (False, True):
        out = torch.empty((t, h, d), dtype=torch.bfloat16, device=KERNEL_DEVICE)
        config = EinsumConfig(block_m=64, block_n=64, split_k=1, num_warps=4, num_stages=2, tma=tma)
        outs.append(block_scaled_matmul(a, sa, w, sw, out, a_block_k=128, b_gran_n=128, config=config))
    assert torch.equal(*outs)


@needs_triton
def test_triton_einsum_falls_back_to_pointer_loads_for_operands_tma_cannot_address() -> None:
    """TMA needs 16-byte aligned bases and strides: an A that starts 8 bytes into its buffer is read by pointers
    (same result as an aligned copy of it), not refused."""
    from optimized.triton.einsum import EinsumConfig, fp8_einsum, tma_loads

    a, b = _einsum_inputs(5, "e4m3fn")
    buffer = torch.empty(a[0].numel() + 8, dtype=a[0].dtype, device=KERNEL_DEVICE)
    shifted = buffer[8:].view(a[0].shape)
    shifted.copy_(a[0])
    assert not tma_loads(shifted, b[0])
    config = EinsumConfig(block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=2, tma=True)
    assert torch.equal(fp8_einsum("bhr,hdr->bhd", (shifted, a[1]), b, config=config),
                       fp8_einsum("bhr,hdr->bhd", a, b, config=config))


@needs_triton
def test_triton_split_k_einsum_is_bitwise_reproducible_and_writes_the_given_out() -> None:
    from optimized.triton.einsum import EinsumConfig
    from optimized.triton.einsum import fp8_einsum as triton_einsum

    a, b = _einsum_inputs(3, "e4m3fn")
    config = EinsumConfig(block_m=16, block_n=64, split_k=8, num_warps=4, num_stages=2)
    first = triton_einsum("bhr,hdr->bhd", a, b, config=config)
    out = torch.full((TINY.o_groups, 3, TINY.o_lora_rank), float("nan"), device=KERNEL_DEVICE).transpose(0, 1)
    again = triton_einsum("bhr,hdr->bhd", a, b, out, config=config)
    assert again is out
    assert torch.equal(out.to(torch.bfloat16), first)


@needs_triton
def test_triton_einsum_reads_the_quantizers_transposed_data_and_deepgemm_scales() -> None:
    from optimized.triton.quant import quantize_attn_output as triton_quantize

    t = 6
    o = torch.randn(t, TINY.n_heads, TINY.head_dim, generator=generator(14)).to(KERNEL_DEVICE, torch.bfloat16)
    positions = torch.randint(0, 1 << 20, (t,), generator=generator(15)).to(KERNEL_DEVICE)
    freqs = yarn_frequencies(TINY, 4).to(KERNEL_DEVICE)
    q, s = triton_quantize(o, positions, freqs, n_groups=TINY.o_groups, scale_layout="deepgemm")
    _, b = _einsum_inputs(1, "e4m3fn")
    out = optimized.fp8_einsum("bhr,hdr->bhd", (q, s), b, backend="triton")
    expected = ref.fp8_einsum("bhr,hdr->bhd", (q.contiguous(), s.contiguous()), b)
    assert calc_diff(out, expected) <= FP8_GEMM_SIMULATED.value


@needs_triton
@pytest.mark.parametrize("fmt", KERNEL_FP8_FORMATS)
def test_triton_fp8_linear_with_per_32_activation_scales_matches_the_reference(fmt: str) -> None:
    numerics = OFFICIAL.replace(fp8_format=fmt, act_block=32)
    weight = random_fp8_weight(384, 256, fmt=fmt, generator=generator(16), device=KERNEL_DEVICE)
    x = torch.randn(2, 3, 256, generator=generator(17)).to(KERNEL_DEVICE, torch.bfloat16)  # leading dims flattened
    out = optimized.fp8_linear(x, weight, numerics, backend="triton")
    assert out.shape == (2, 3, 384)
    assert calc_diff(out, ref_fp8_linear(x, weight, numerics)) <= FP8_GEMM_SIMULATED.value


def test_split_k_fills_the_gpu_at_decode_and_slices_k_evenly() -> None:
    from optimized.triton.einsum import DEFAULT_NUM_SMS, PROGRAMS_PER_SM, choose_config

    for h in (8, 16):  # FLASH, PRO
        for b, platforms in ((1, ("nvidia", "amd")), (8, ("nvidia", "amd")), (32, ("nvidia", "amd")), (64, ("amd",))):
            for platform in platforms:
                c = choose_config(b, h, 1024, 32, DEFAULT_NUM_SMS, platform)
                tiles = h * -(-b // c.block_m) * (1024 // c.block_n)
                assert 32 % c.split_k == 0
                assert tiles * c.split_k >= PROGRAMS_PER_SM * DEFAULT_NUM_SMS, (h, b, c)
        # NVIDIA from b = 33 on: the TMA tile, whole (measured faster than split pointer loads at b = 64)
        for b in (33, 64, 128, 4096, 8192):
            c = choose_config(b, h, 1024, 32, DEFAULT_NUM_SMS, "nvidia")
            assert c.tma and c.split_k == 1, (h, b, c)
        for b in (128, 4096, 8192):
            assert choose_config(b, h, 1024, 32, DEFAULT_NUM_SMS, "amd").split_k == 1
        # NVIDIA: the 64 x 64 tile up to b = 128, the 64 x 128 prefill tile from b = 129 (ab-einsum-mid-b.json)
        assert (choose_config(128, h, 1024, 32, DEFAULT_NUM_SMS, "nvidia").block_n,
                choose_config(129, h, 1024, 32, DEFAULT_NUM_SMS, "nvidia").block_n) == (64, 128)


# ------------------------------------------------------------------------------------------------
# Bad input: every argument of every public function, rejected before any kernel launch
# ------------------------------------------------------------------------------------------------


class _NoLaunch:
    """Stands in for a @triton.jit kernel: launching it fails the test."""

    def __getitem__(self, grid: object) -> None:
        raise AssertionError("a kernel was launched before the arguments were validated")


@pytest.fixture
def no_kernel_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from optimized.triton import einsum as triton_einsum
    from optimized.triton import quant

    for module, name in ((quant, "_quant_per_token_kernel"), (quant, "_inv_rope_quant_kernel"),
                         (quant, "_inv_rope_quant_heads_kernel"), (triton_einsum, "_fp8_einsum_kernel"),
                         (triton_einsum, "_split_k_reduce_kernel")):
        monkeypatch.setattr(module, name, _NoLaunch())


def _good_einsum() -> dict[str, Any]:
    a, b = _einsum_inputs(2, "e4m3fn", seed=18)
    return {"expr": "bhr,hdr->bhd", "a": a, "b": b, "out": None, "recipe": (1, 128, 128)}


def _einsum_call(backend: str = "triton", **changes: Any) -> Callable[[], Any]:
    args = {**_good_einsum(), **changes}
    return lambda: optimized.fp8_einsum(args["expr"], args["a"], args["b"], args["out"], recipe=args["recipe"],
                                        backend=backend)


def _with(pair: tuple[torch.Tensor, torch.Tensor], index: int, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(value if i == index else t for i, t in enumerate(pair))


_A, _B = _good_einsum()["a"], _good_einsum()["b"]
_META = "meta"  # a second device on any machine: the checks compare devices before touching data
# A backend this machine lacks (deepgemm on a CPU), for the "backend unavailable" entries.
_UNAVAILABLE = next((name for name in ("deepgemm", "triton") if not backend_status(name)[0]), "deepgemm")

EINSUM_BAD = {
    "expr_unknown": (_einsum_call(expr="bhr,hrd->bhd"), ValueError, "expr"),
    "expr_not_in_triton": (_einsum_call(expr="bhd,hdr->bhr",
                                        a=(torch.zeros(2, 2, 256, dtype=torch.float8_e4m3fn, device=KERNEL_DEVICE),
                                           torch.ones(2, 2, 2, device=KERNEL_DEVICE)),
                                        b=(torch.zeros(2, 256, 384, dtype=torch.float8_e4m3fn, device=KERNEL_DEVICE),
                                           torch.ones(2, 2, 3, device=KERNEL_DEVICE))),
                           ValueError, "expr"),
    "recipe_unknown": (_einsum_call(recipe=(1, 128, 64)), ValueError, "recipe"),
    "recipe_list": (_einsum_call(recipe=[1, 128, 128]), ValueError, "recipe"),
    "a_not_pair": (_einsum_call(a=_A[0]), TypeError, "a:"),
    "a_data_bf16": (_einsum_call(a=_with(_A, 0, _A[0].to(torch.bfloat16))), TypeError, "a[0]"),
    "a_scale_fp16": (_einsum_call(a=_with(_A, 1, _A[1].half())), TypeError, "a[1]"),
    "a_data_2d": (_einsum_call(a=(_A[0][0], _A[1][0])), ValueError, "a[0]"),
    "b_other_format": (_einsum_call(b=_with(_B, 0, _B[0].view(torch.uint8).view(torch.float8_e4m3fnuz))),
                       TypeError, "b[0]"),
    "b_wrong_r": (_einsum_call(b=(_B[0][..., :128], _B[1][..., :1])), ValueError, "b[0]"),
    "a_scale_shape": (_einsum_call(a=_with(_A, 1, _A[1][..., :3])), ValueError, "a[1]"),
    "b_scale_for_other_recipe": (_einsum_call(recipe=(1, 1, 128)), ValueError, "b[1]"),
    "b_other_device": (_einsum_call(b=_with(_B, 0, _B[0].to(_META))), ValueError, "b[0]"),
    "out_shape": (_einsum_call(out=torch.empty(2, 2, 128, dtype=torch.bfloat16)), ValueError, "out"),
    "out_fp16": (_einsum_call(out=torch.empty(2, 2, 256, dtype=torch.float16)), TypeError, "out"),
    "out_not_tensor": (_einsum_call(out=[0.0]), TypeError, "out"),
    "a_strided_k": (_einsum_call(a=_with(_A, 0, torch.zeros(2, 2, 2048 * 2, dtype=torch.float8_e4m3fn)[..., ::2])),
                    ValueError, "a[0]"),
    "backend_unknown": (_einsum_call(backend="cuda"), ValueError, "backend"),
    "backend_unavailable": (_einsum_call(backend=_UNAVAILABLE), ValueError, "backend"),
}


def _attn_args() -> dict[str, Any]:
    return {"o": torch.zeros(3, TINY.n_heads, TINY.head_dim, dtype=torch.bfloat16),
            "positions": torch.arange(3), "freqs": yarn_frequencies(TINY, 4), "n_groups": TINY.o_groups,
            "fmt": "e4m3fn"}


def _quantize_call(backend: str = "triton", **changes: Any) -> Callable[[], Any]:
    args = {**_attn_args(), **changes}
    return lambda: optimized.quantize_attn_output(args["o"], args["positions"], args["freqs"],
                                                  n_groups=args["n_groups"], fmt=args["fmt"], backend=backend)


QUANTIZE_BAD = {
    "o_not_tensor": (_quantize_call(o=[[0.0]]), TypeError, "o:"),
    "o_fp32": (_quantize_call(o=torch.zeros(3, 8, 512)), TypeError, "o:"),
    "o_2d": (_quantize_call(o=torch.zeros(3, 4096, dtype=torch.bfloat16)), ValueError, "o:"),
    "o_strided_dim": (_quantize_call(o=torch.zeros(3, 8, 1024, dtype=torch.bfloat16)[..., ::2]), ValueError, "o:"),
    "positions_float": (_quantize_call(positions=torch.zeros(3)), TypeError, "positions"),
    "positions_length": (_quantize_call(positions=torch.arange(4)), ValueError, "positions"),
    "positions_device": (_quantize_call(positions=torch.arange(3, device=_META)), ValueError, "positions"),
    "freqs_fp64": (_quantize_call(freqs=torch.ones(32, dtype=torch.float64)), TypeError, "freqs"),
    "freqs_too_long": (_quantize_call(freqs=torch.ones(257)), ValueError, "freqs"),
    "n_groups_not_dividing": (_quantize_call(n_groups=3), ValueError, "n_groups"),
    "n_groups_bool": (_quantize_call(n_groups=True), ValueError, "n_groups"),
    "fmt_unknown": (_quantize_call(fmt="e5m2"), ValueError, "fmt"),
    "backend_unknown": (_quantize_call(backend="rocm"), ValueError, "backend"),
    "backend_unavailable": (_quantize_call(backend=_UNAVAILABLE), ValueError, "backend"),
}


def _projection_args() -> dict[str, Any]:
    rank = TINY.o_groups * TINY.o_lora_rank
    return {**_attn_args(), "wo_a": random_fp8_weight(rank, TINY.o_group_dim, generator=generator(19)),
            "wo_b": random_fp8_weight(TINY.dim, rank, generator=generator(20)), "numerics": VLLM_NVIDIA}


def _on_kernel_device(args: dict[str, Any]) -> dict[str, Any]:
    """`args` with its tensors and weights where the triton backend takes them (the GPU, or the CPU interpreter): a
    backend-specific check is reached only after the device check."""
    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(KERNEL_DEVICE)
        return Fp8Weight(v.data.to(KERNEL_DEVICE), v.scale.to(KERNEL_DEVICE)) if isinstance(v, Fp8Weight) else v
    return {k: move(v) for k, v in args.items()}


def _projection_call(backend: str = "triton", **changes: Any) -> Callable[[], Any]:
    args = {**_projection_args(), **changes}
    return lambda: optimized.output_projection(args["o"], args["positions"], args["freqs"], args["wo_a"],
                                               args["wo_b"], args["numerics"], backend=backend)


_WO_A = _projection_args()["wo_a"]

PROJECTION_BAD = {
    "o_fp32": (_projection_call(o=torch.zeros(3, 8, 512)), TypeError, "o:"),
    "positions_float": (_projection_call(positions=torch.zeros(3)), TypeError, "positions"),
    "freqs_2d": (_projection_call(freqs=torch.ones(2, 32)), ValueError, "freqs"),
    "numerics_name": (_projection_call(numerics="vllm_nvidia"), TypeError, "numerics"),
    "numerics_bf16_wo_a_on_triton": (_projection_call(**_on_kernel_device(
        {**_projection_args(), "numerics": OFFICIAL})), ValueError, "numerics"),
    "numerics_no_act_quant_on_triton": (_projection_call(**_on_kernel_device(
        {**_projection_args(), "numerics": VLLM_NVIDIA.replace(act_quant=False)})), ValueError, "numerics"),
    "wo_a_tensor": (_projection_call(wo_a=_WO_A.data), TypeError, "wo_a"),
    "wo_a_batched": (_projection_call(wo_a=Fp8Weight(_WO_A.data[None], _WO_A.scale[None])), ValueError, "wo_a"),
    "wo_a_k": (_projection_call(wo_a=random_fp8_weight(512, 1536, generator=generator(21))), ValueError, "wo_a"),
    "wo_a_format": (_projection_call(wo_a=random_fp8_weight(512, 2048, fmt="e4m3fnuz", generator=generator(22))),
                    TypeError, "wo_a"),
    "wo_b_k": (_projection_call(wo_b=random_fp8_weight(256, 384, generator=generator(23))), ValueError, "wo_b"),
    "wo_b_tensor": (_projection_call(wo_b=None), TypeError, "wo_b"),
    "backend_unknown": (_projection_call(backend="cpu"), ValueError, "backend"),
    "backend_unavailable": (_projection_call(backend=_UNAVAILABLE), ValueError, "backend"),
}


def _linear_call(backend: str = "triton", **changes: Any) -> Callable[[], Any]:
    args = {"x": torch.zeros(3, 256, dtype=torch.bfloat16),
            "weight": random_fp8_weight(128, 256, generator=generator(24)), "numerics": OFFICIAL, **changes}
    return lambda: optimized.fp8_linear(args["x"], args["weight"], args["numerics"], backend=backend)


LINEAR_BAD = {
    "x_not_tensor": (_linear_call(x=1.0), TypeError, "x:"),
    "x_fp32": (_linear_call(x=torch.zeros(3, 256)), TypeError, "x:"),
    "x_wrong_k": (_linear_call(x=torch.zeros(3, 384, dtype=torch.bfloat16)), ValueError, "x:"),
    "weight_tensor": (_linear_call(weight=torch.zeros(128, 256)), TypeError, "weight"),
    "weight_batched": (_linear_call(weight=random_fp8_weight(128, 256, generator=generator(25), batch=(2,))),
                       ValueError, "weight"),
    "weight_format": (_linear_call(weight=random_fp8_weight(128, 256, fmt="e4m3fnuz", generator=generator(26))),
                      TypeError, "weight"),
    "weight_device": (_linear_call(weight=random_fp8_weight(128, 256, generator=generator(27)).to(_META)),
                      ValueError, "weight"),
    "numerics_dict": (_linear_call(numerics={}), TypeError, "numerics"),
    "numerics_no_act_quant": (_linear_call(numerics=EXACT), ValueError, "numerics"),
    "backend_unknown": (_linear_call(backend="gpu"), ValueError, "backend"),
    "backend_unavailable": (_linear_call(backend=_UNAVAILABLE), ValueError, "backend"),
}


def _triton_quant_call(**changes: Any) -> Callable[[], Any]:
    from optimized.triton.quant import quantize_per_token as triton_quantize

    args = {"x": torch.zeros(4, 256, dtype=torch.bfloat16), "block": 128, "fmt": "e4m3fn",
            "scale_layout": "row_major", "eps": 1e-4, **changes}
    return lambda: triton_quantize(args["x"], args["block"], args["fmt"], args["scale_layout"], args["eps"])


PER_TOKEN_BAD = {
    "x_int": (_triton_quant_call(x=torch.zeros(4, 256, dtype=torch.int32)), TypeError, "x:"),
    "x_3d": (_triton_quant_call(x=torch.zeros(2, 2, 256, dtype=torch.bfloat16)), ValueError, "x:"),
    "x_k_not_multiple": (_triton_quant_call(x=torch.zeros(4, 200, dtype=torch.bfloat16)), ValueError, "x:"),
    "x_strided_k": (_triton_quant_call(x=torch.zeros(4, 512, dtype=torch.bfloat16)[:, ::2]), ValueError, "x:"),
    "block_16": (_triton_quant_call(block=16), ValueError, "block"),
    "fmt_unknown": (_triton_quant_call(fmt="fp8"), ValueError, "fmt"),
    "scale_layout_unknown": (_triton_quant_call(scale_layout="column_major"), ValueError, "scale_layout"),
    "eps_zero": (_triton_quant_call(eps=0.0), ValueError, "eps"),
}


def _deepgemm_checks() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    """DeepGEMM's own limits, checked on the CPU through the adapters' validation functions."""
    a, b = _good_einsum()["a"], _good_einsum()["b"]
    fnuz = (a[0].view(torch.uint8).view(torch.float8_e4m3fnuz), a[1])
    return {
        "expr": (lambda: dg_einsum.check_supported("bhd,hdr->bhr", (1, 128, 128), a, b, None), ValueError, "expr"),
        "recipe": (lambda: dg_einsum.check_supported("bhr,hdr->bhd", (1, 1, 128), a, b, None), ValueError, "recipe"),
        "fnuz": (lambda: dg_einsum.check_supported("bhr,hdr->bhd", (1, 128, 128), fnuz, b, None), TypeError, "a[0]"),
        "out_fp32": (lambda: dg_einsum.check_supported("bhr,hdr->bhd", (1, 128, 128), a, b, torch.empty(2, 2, 256)),
                     TypeError, "out"),
        "b_scale_strided": (lambda: dg_einsum.check_supported("bhr,hdr->bhd", (1, 128, 128), a,
                                                              (b[0], b[1].transpose(1, 2).contiguous().transpose(1, 2)),
                                                              None), ValueError, "b[1]"),
        "quant_fnuz": (lambda: dg_einsum.quantize_attn_output(*list(_attn_args().values())[:3], n_groups=2,
                                                              fmt="e4m3fnuz"), ValueError, "fmt"),
        "linear_fnuz": (lambda: dg_linear.check_supported(random_fp8_weight(128, 256), OFFICIAL.replace(
            fp8_format="e4m3fnuz")), ValueError, "numerics"),
        "linear_block_32": (lambda: dg_linear.check_supported(random_fp8_weight(128, 256), OFFICIAL.replace(
            act_block=32)), ValueError, "numerics"),
    }


def _config_split_not_dividing() -> Any:
    from optimized.triton.einsum import EinsumConfig
    from optimized.triton.einsum import fp8_einsum as triton_einsum

    a, b = _einsum_inputs(2, "e4m3fn")
    return triton_einsum("bhr,hdr->bhd", a, b, config=EinsumConfig(16, 64, 3, 4, 2))


BAD = {
    **{f"fp8_einsum/{k}": v for k, v in EINSUM_BAD.items()},
    **{f"quantize_attn_output/{k}": v for k, v in QUANTIZE_BAD.items()},
    **{f"output_projection/{k}": v for k, v in PROJECTION_BAD.items()},
    **{f"fp8_linear/{k}": v for k, v in LINEAR_BAD.items()},
    **{f"triton.quantize_per_token/{k}": v for k, v in PER_TOKEN_BAD.items()},
    **{f"deepgemm/{k}": v for k, v in _deepgemm_checks().items()},
    "triton.fp8_einsum/config_split_k": (_config_split_not_dividing, ValueError, "config"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_naming_the_argument_before_any_kernel_launch(name: str, no_kernel_launch: None) -> None:
    call, error, fragment = BAD[name]
    if name.endswith("backend_unavailable") and backend_status(_UNAVAILABLE)[0]:
        pytest.skip("every backend is available on this machine")
    if not TRITON_OK and not name.startswith("deepgemm/") and "backend_" not in name:
        pytest.skip(f"the call goes to the triton backend: {TRITON_WHY}")
    with pytest.raises(error, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        call()


# ------------------------------------------------------------------------------------------------
# DeepGEMM layout contract (GPU only)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not backend_status("deepgemm")[0], reason=f"deepgemm unavailable: {backend_status('deepgemm')[1]}")
def test_deepgemm_uses_the_quantizers_scales_without_a_relayout() -> None:
    """DeepGEMM's `get_mn_major_tma_aligned_tensor` returns its input untouched when the layout is already the one
    its kernels read; then neither `fp8_einsum` nor `fp8_gemm_nt` copies the activation scales."""
    from optimized.deepgemm import deep_gemm

    dg = deep_gemm()
    t = 37
    o = torch.randn(t, 64, 512, device="cuda").to(torch.bfloat16)
    positions = torch.arange(t, device="cuda")
    _, s = optimized.quantize_attn_output(o, positions, yarn_frequencies(TINY, 4).cuda(), n_groups=8,
                                          backend="deepgemm")
    per_group = s.permute(1, 0, 2)  # what fp8_einsum hands to the layout transform
    assert dg.get_mn_major_tma_aligned_tensor(per_group).data_ptr() == per_group.data_ptr()
    from optimized.triton.quant import quantize_per_token as triton_quantize

    _, sz = triton_quantize(torch.randn(t, 8192, device="cuda").to(torch.bfloat16), 128, "e4m3fn", "deepgemm")
    assert dg.get_mn_major_tma_aligned_tensor(sz).data_ptr() == sz.data_ptr()
