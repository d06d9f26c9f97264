"""Block-scaled FP8 GEMM in Triton: the grouped einsum `'bhr,hdr->bhd'` (and, with h = 1, the FP8 linear).

Math (spec §2.5, §4.1): for each 128-wide K block, an FP8 `tl.dot` into an fp32 block accumulator, scaled
by `sa[m, kb] * sb[n // GRAN_N, kb]` and added into the fp32 main accumulator — DeepGEMM's SM90
"promotion". The FP8 format is the operands' dtype (e4m3fn on NVIDIA and gfx950, e4m3fnuz on gfx942).

Two variants, picked by `choose_config` from the token count b:
  * full-K: one program per (h, M tile, N tile) runs the whole K loop and stores bf16 (or fp32).
  * split-K (decode: b <= 32 on NVIDIA, b <= 64 elsewhere): at small b the op is a stream over the weight
    (FLASH: 33.5 MB, ~8 us of HBM at b = 1), and one program per output tile gives h * d / BLOCK_N = 128
    programs — fewer than the GPU's SMs. Each program then runs a slice of K and writes fp32 partial sums to a workspace
    [split, b, h, d]; a second kernel adds the slices in a fixed order. No atomics: results are
    bitwise reproducible run to run (they are not batch-invariant: tiles and splits depend on b).

Operand loads: pointer loads everywhere, or (`EinsumConfig.tma`, NVIDIA sm_90+ and the interpreter) Hopper's
TMA through Triton tensor descriptors over A [M, H, K] and B [H, N, K]: the copy engine fetches whole tiles
into shared memory with no address arithmetic in registers, rows past M or N read as zeros. Same dots, same
order, the same output bit for bit. On AMD Triton lowers descriptors to plain loads, which spill at the tiles
that matter (an AOT compile of descriptor variants: this kernel's 128 x 128 tile spills on gfx950, the MoE gate/up
tile goes from 148 to 390 VGPRs on gfx942), so the AMD tables keep pointer loads.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from optimized.backends import detect
from optimized.triton._fp8 import prepare_interpreter
from optimized.triton.aot import ALL_TARGETS, PLATFORM_TARGETS, AotSpec, tile_platform
from optimized.triton.quant import cdiv, check_fp8_support
from reference.einsum import SCALE_BLOCK, check_fp8_einsum_args
from reference.formats import fp8_format

SUPPORTED_EXPR = "bhr,hdr->bhd"
SUPPORTED_RECIPES = ((1, 128, 128), (1, 1, 128))
# Below this many programs per SM the full-K grid leaves the GPU under-filled; split-K aims for it.
PROGRAMS_PER_SM = 2
# SM count used when no GPU is present (the CPU interpreter): the H200's, so that a CPU run picks the
# same configurations as the H200 for the same shapes.
DEFAULT_NUM_SMS = 132
# A split gets at least this many 128-wide K blocks (fewer makes the workspace traffic dominate).
MIN_K_BLOCKS_PER_SPLIT = 2
# Split-K only while the fp32 workspace (split x b x h x d x 4 bytes) stays small next to the weight.
MAX_SPLIT_K_TOKENS = 64
_REDUCE_BLOCK = 1024  # outputs per program of the split-K reduction


@dataclass(frozen=True)
class EinsumConfig:
    """Tile configuration of one launch.

    Attributes:
        block_m, block_n: output tile (tokens x output channels).
        split_k: number of K slices (1 = full-K variant).
        num_warps, num_stages: Triton launch options.
        block_k: K of one `tl.dot` (64 or 128, at most the activation scale block; the dots of one scale
            block add into one fp32 block accumulator before its promotion).
        tma: load A and B tiles through TMA tensor descriptors where the device has TMA (NVIDIA sm_90+; the
            interpreter runs them too) and the operands meet its 16-byte alignment; pointer loads otherwise.
    """

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    block_k: int = 128
    tma: bool = False


# The tile tables of `choose_config`, by platform (`tile_platform()`): (largest b, tiles) rows, first match wins.
# `python -m benchmarks.sweep_einsum` times the alternatives on the GPU and prints the winners. No row spills
# (the AOT compile; sm_90 registers from 80 per thread at BLOCK_M = 16 to ~230 at 128 x 128: two fp32
# accumulators). The NVIDIA prefill row is from the H200 sweep of 2026-12-03 (docs/h200/sweep-einsum.json):
# 128 x 64 tiles with 4 stages took b = 4096 from 542 to 383 us with DeepGEMM's MN-major activation scales (the
# sweep's input), and from 400 to 392 us in `python -m benchmarks` (row-major scales). Those 4 stages take 72 KB
# of shared memory, over gfx942's 64 KB LDS: AMD keeps 128 x 128 with 3 stages (not measured: no ROCm GPU here).
# NVIDIA rows (H200 same-run A/Bs, outputs bitwise equal in each):
#   * b <= 32: split-K pointer tiles. TMA was no faster there (b = 1: 16.1 us pointer, 16.9 TMA;
#     docs/h200/ab-tma-einsum.json).
#   * b = 33..128: the 64 x 64 TMA tile, whole K (b = 64: 21.4 us split two ways with pointer loads, 18.4 us whole;
#     b = 128 23.4 -> 19.6 us against pointer loads, and no other tile or split beat it there;
#     docs/h200/ab-einsum-b128.json, ab-tma-einsum.json).
#   * b >= 129: the 64 x 128 TMA tile with 4 stages (b = 160 30.7 -> 23.3 us, 200 45.4 -> 26.3, 256 42.2 -> 24.1
#     against 64 x 64, which stays at b = 128: 19.7 against 20.2 us; docs/h200/ab-einsum-mid-b.json; b = 4096
#     386 -> 331 us and 8192 756 -> 650 us against pointer loads).
# Triton's automatic warp specialization (`tl.range(warp_specialize=True)`) was slower or equal at every tile
# (docs/h200/ab-tma-ws.json).
_DECODE_ROWS: tuple[tuple[int, EinsumConfig], ...] = (
    (16, EinsumConfig(16, 64, 1, 4, 4)),  # decode: smallest dot tile, weight streaming
    (32, EinsumConfig(32, 64, 1, 4, 4)),
)
TILE_TABLE: dict[str, tuple[tuple[int, EinsumConfig], ...]] = {
    "nvidia": (*_DECODE_ROWS,
               (128, EinsumConfig(64, 64, 1, 4, 4, tma=True)),  # 2 * h * d / 64 programs (256 on FLASH)
               (1 << 62, EinsumConfig(64, 128, 1, 4, 4, tma=True))),  # from b = 129: TMA-fed pipeline
    "amd": (*_DECODE_ROWS,
            (64, EinsumConfig(64, 64, 1, 4, 3)),
            (256, EinsumConfig(128, 64, 1, 8, 3)),  # one wave of h * d / 64 programs (128 on FLASH)
            (1 << 62, EinsumConfig(128, 128, 1, 8, 3))),  # compute-bound: large tiles, A reuse
}


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) of `device` (queried once per device); `DEFAULT_NUM_SMS` on the CPU."""
    if device.type == "cuda":
        return _device_sms(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_NUM_SMS


@functools.lru_cache(maxsize=1024)
def choose_config(b: int, h: int, d: int, k_blocks: int, sms: int, platform: str = "nvidia") -> EinsumConfig:
    """The platform's `TILE_TABLE` (by token count b) and the split-K rule (cached: a pure function of sizes).

    Split-K (b <= MAX_SPLIT_K_TOKENS only, and only where the table row says split_k = 1 and loads through
    pointers: the TMA rows measured faster whole, see `_DECODE_ROWS`): when the full-K
    grid has fewer than PROGRAMS_PER_SM * sms programs, K is cut into enough equal slices to reach that (the
    smallest divisor of the number of 128-wide K blocks that does, with at least MIN_K_BLOCKS_PER_SPLIT blocks
    per slice). FLASH b = 1: 128 tiles -> 4 slices of 8 K blocks -> 512 programs. A row with split_k > 1 sets
    the split itself (capped to a divisor of the K blocks).
    """
    config = next(row for bound, row in TILE_TABLE[platform] if b <= bound)
    divisors = [s for s in range(1, k_blocks // MIN_K_BLOCKS_PER_SPLIT + 1) if k_blocks % s == 0] or [1]
    if config.split_k > 1:
        split = max(s for s in divisors if s <= config.split_k)
        return dataclasses.replace(config, split_k=split)
    tiles = h * cdiv(b, config.block_m) * cdiv(d, config.block_n)
    target = PROGRAMS_PER_SM * sms
    if b <= MAX_SPLIT_K_TOKENS and tiles < target and not config.tma:
        wanted = cdiv(target, tiles)
        split = next((s for s in divisors if s >= wanted), divisors[-1])
        config = dataclasses.replace(config, split_k=split)
    return config


@triton.jit(do_not_specialize=["M"])
def _fp8_einsum_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr,
    M, N, SCALE_BLOCKS_PER_SPLIT,
    stride_am, stride_ah, stride_sam, stride_sah, stride_sak,
    stride_bh, stride_bn, stride_sbh, stride_sbn, stride_sbk,
    stride_cs, stride_cm, stride_ch, stride_cn,
    SCALE_K: tl.constexpr, GRAN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
):
    """C[split, m, h, n] = sum over this split's K blocks of sa * sb * dot(A[m, h, kb], B[h, n, kb]).

    SCALE_K is the K granularity of A's scales (128 for the einsum; the act-quant block for the linear),
    BLOCK_K (dividing it) the K of one dot; B's scales are per 128 K (`// 128`) and per GRAN_N rows (128
    or 1). When an N tile lies inside one GRAN_N block, B's scale is one scalar per K block and the
    promotion is a single multiply-add per element. C is bf16 / fp32 (the output, stride_cs = 0) or the
    fp32 split-K workspace. M is not specialized (b = 1 and b = 8 share one compiled kernel). With TMA, a_ptr
    and b_ptr are tensor descriptors over A [M, H, K] (block [BLOCK_M, 1, BLOCK_K]) and B [H, N, K] (block
    [1, BLOCK_N, BLOCK_K]), and their strides are unused.
    """
    pid = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if not TMA:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + h.to(tl.int64) * stride_ah + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + h.to(tl.int64) * stride_bh + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    sa_ptrs = sa_ptr + h * stride_sah + offs_m * stride_sam
    TILE_SHARES_SB: tl.constexpr = GRAN_N % BLOCK_N == 0
    if TILE_SHARES_SB:
        sb_ptrs = sb_ptr + h * stride_sbh + (pid_n * BLOCK_N // GRAN_N) * stride_sbn
    else:
        sb_ptrs = sb_ptr + h * stride_sbh + (offs_n // GRAN_N) * stride_sbn

    kb_start = split * SCALE_BLOCKS_PER_SPLIT  # the slices cut K evenly
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, SCALE_BLOCKS_PER_SPLIT):
        k0 = (kb_start + i) * SCALE_K
        # FP8 x FP8 -> fp32 over one scale block of K (one dot, or SCALE_K / BLOCK_K of them)
        block_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in tl.static_range(0, SCALE_K, BLOCK_K):
            if TMA:  # rows past M or N come back as zeros
                a = a_ptr.load([pid_m * BLOCK_M, h, k0 + kk]).reshape(BLOCK_M, BLOCK_K)
                b = b_ptr.load([h, pid_n * BLOCK_N, k0 + kk]).reshape(BLOCK_N, BLOCK_K)
            else:
                a = tl.load(a_ptrs + (k0 + kk), mask=m_ok[:, None], other=0.0)
                b = tl.load(b_ptrs + (k0 + kk), mask=n_ok[:, None], other=0.0)
            block_acc = tl.dot(a, tl.trans(b), block_acc)
        sa = tl.load(sa_ptrs + (kb_start + i) * stride_sak, mask=m_ok, other=0.0)
        # B's scale block of this K block. Its index stays an affine function of the loop counter: Triton's pipeliner
        # then prefetches the scale load with the tiles, whereas `k0 // 128` left its latency exposed every iteration
        # (H200, b = 4096: 332 -> 302 us; docs/h200/ab-einsum-variants.json)
        if SCALE_K == 128:
            sb_k = kb_start + i
        else:  # finer activation blocks (the linear's act_block): 128 / SCALE_K of them per B scale block
            sb_k = (kb_start + i) // (128 // SCALE_K)
        # promotion into the fp32 main accumulator (power-of-two scales: the products are exact)
        if TILE_SHARES_SB:
            sb = tl.load(sb_ptrs + sb_k * stride_sbk)
            acc += block_acc * (sa * sb)[:, None]
        else:
            sb = tl.load(sb_ptrs + sb_k * stride_sbk, mask=n_ok, other=0.0)
            acc += block_acc * (sa[:, None] * sb[None, :])

    c_ptrs = (c_ptr + split.to(tl.int64) * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm
              + h.to(tl.int64) * stride_ch + offs_n[None, :] * stride_cn)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tma_loads(*operands: torch.Tensor) -> bool:
    """Whether the kernel can read `operands` through TMA descriptors: the interpreter or an NVIDIA GPU of sm_90+,
    and every operand 16-byte aligned (base address and every stride but the last; TMA's rule)."""
    hw = detect()
    if not (hw.interpret or hw.nvidia_sm(90)):
        return False
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
               for t in operands)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr, out_ptr, TOTAL, H, N, SPLITS, stride_om, stride_oh, stride_on, BLOCK: tl.constexpr,
):
    """out[m, h, n] = sum_{s = 0..SPLITS-1} ws[s, m, h, n], in that order (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < TOTAL
    ws_ptrs = ws_ptr + offs
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(SPLITS):
        acc += tl.load(ws_ptrs, mask=ok, other=0.0)
        ws_ptrs += TOTAL
    m = offs // (H * N)
    hn = offs % (H * N)
    dst = out_ptr + m * stride_om + (hn // N) * stride_oh + (hn % N) * stride_on
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok)


def block_scaled_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    a_block_k: int,
    b_gran_n: int,
    config: EinsumConfig | None = None,
) -> torch.Tensor:
    """Launch `out[m, h, n] = sum_k A[m, h, k] B[h, n, k]` with block scales (shapes already validated).

    Args:
        a: [M, H, K] FP8, unit last stride; a_scale: [M, H, K / a_block_k] fp32, any strides.
        b: [H, N, K] FP8 (same format), unit last stride; b_scale: [H, N / b_gran_n, K / 128] fp32.
        out: [M, H, N] bf16 or fp32, any strides; written and returned.
        a_block_k: K granularity of A's scales (32, 64 or 128; K must be a multiple of 128).
        b_gran_n: N granularity of B's scales (128 or 1).
        config: tiles and split-K; `choose_config` when None.
    """
    m, h, k = a.shape
    n = b.shape[1]
    if m == 0 or h == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    k_blocks = k // SCALE_BLOCK
    if config is None:
        config = choose_config(m, h, n, k_blocks, num_sms(a.device), tile_platform())
    splits = config.split_k
    if splits < 1 or k_blocks % splits:
        raise ValueError(f"config: split_k = {splits} must divide the {k_blocks} 128-wide K blocks")
    block_k = min(config.block_k, a_block_k)
    if block_k not in (32, 64, 128) or a_block_k % block_k:
        raise ValueError(f"config: block_k = {config.block_k} must be 32, 64 or 128 (dividing {a_block_k})")
    scale_blocks_per_split = k_blocks // splits * (SCALE_BLOCK // a_block_k)
    prepare_interpreter()
    if splits > 1:
        target = torch.empty((splits, m, h, n), dtype=torch.float32, device=a.device)
        c_strides = (m * h * n, h * n, n, 1)
    else:
        target = out
        c_strides = (0, *out.stride())
    grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n), h, splits)
    tma = config.tma and tma_loads(a, b)
    a_arg, b_arg = ((TensorDescriptor(a, list(a.shape), list(a.stride()), [config.block_m, 1, block_k]),
                     TensorDescriptor(b, list(b.shape), list(b.stride()), [1, config.block_n, block_k]))
                    if tma else (a, b))
    _fp8_einsum_kernel[grid](
        a_arg, a_scale, b_arg, b_scale, target,
        m, n, scale_blocks_per_split,
        a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1), a_scale.stride(2),
        b.stride(0), b.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        *c_strides,
        SCALE_K=a_block_k, GRAN_N=b_gran_n,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, TMA=tma,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        total = m * h * n
        _split_k_reduce_kernel[(cdiv(total, _REDUCE_BLOCK),)](
            target, out, total, h, n, splits, *out.stride(), BLOCK=_REDUCE_BLOCK, num_warps=4,
        )
    return out


def check_supported(expr: str, recipe: tuple[int, int, int], a: tuple[torch.Tensor, torch.Tensor],
                    b: tuple[torch.Tensor, torch.Tensor]) -> None:
    """What the Triton kernel needs beyond `check_fp8_einsum_args` (raises ValueError naming the argument)."""
    if expr != SUPPORTED_EXPR:
        raise ValueError(f"expr: the triton backend implements only {SUPPORTED_EXPR!r}, got {expr!r} "
                         "(the reference implements all three; DeepGEMM has the other two on SM100 only)")
    if recipe not in SUPPORTED_RECIPES:
        raise ValueError(f"recipe: the triton backend implements {SUPPORTED_RECIPES}, got {recipe!r}")
    check_fp8_support(fp8_format(a[0].dtype), a[0].device, "a[0]")
    r = a[0].shape[2]
    if r % SCALE_BLOCK:
        raise ValueError(f"a[0]: the triton backend needs r (= {r}) to be a multiple of {SCALE_BLOCK}")
    for name, t in (("a[0]", a[0]), ("b[0]", b[0])):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")


def fp8_einsum(
    expr: str,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    recipe: tuple[int, int, int] = (1, 128, 128),
    config: EinsumConfig | None = None,
) -> torch.Tensor:
    """Triton `fp8_einsum` for `'bhr,hdr->bhd'` with recipe (1, 128, 128) or (1, 1, 128).

    Same contract as `reference.einsum.fp8_einsum` (scale layouts in its table). Any strides with a unit
    last stride for the data (e.g. the [G, T, K]-transposed `o_fp8` of `quantize_attn_output`), any
    strides for the scales (row-major or DeepGEMM's MN-major layout) and for `out`.

    Args:
        config: override the tile / split-K choice (benchmarks and tests); `choose_config` when None.
    """
    check_fp8_einsum_args(expr, a, b, out, recipe)
    return fp8_einsum_checked(expr, a, b, out, recipe=recipe, config=config)


def fp8_einsum_checked(
    expr: str,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    recipe: tuple[int, int, int] = (1, 128, 128),
    config: EinsumConfig | None = None,
) -> torch.Tensor:
    """`fp8_einsum` for arguments that already passed `check_fp8_einsum_args` (the public op's validation);
    runs only the Triton-specific checks before it launches."""
    check_supported(expr, recipe, a, b)
    if out is None:
        out = torch.empty((a[0].shape[0], a[0].shape[1], b[0].shape[1]), dtype=torch.bfloat16, device=a[0].device)
    return block_scaled_matmul(a[0], a[1], b[0], b[1], out, a_block_k=SCALE_BLOCK, b_gran_n=recipe[1],
                               config=config)


# Arguments that are multiples of 16 at the DSv4 launches (the JIT specializes on it; see `AotSpec.aligned`).
_ALIGNED_ARGS = ("a_ptr", "sa_ptr", "b_ptr", "sb_ptr", "c_ptr", "N", "stride_am", "stride_ah", "stride_bh", "stride_bn",
                 "stride_cs", "stride_cm", "stride_ch")


def _einsum_spec(config: EinsumConfig, out: str, targets: tuple[str, ...] = ALL_TARGETS) -> AotSpec:
    ints = ("M", "N", "SCALE_BLOCKS_PER_SPLIT", "stride_am", "stride_ah", "stride_sam", "stride_sah", "stride_sak",
            "stride_bh", "stride_bn", "stride_sbh", "stride_sbn", "stride_sbk",
            "stride_cs", "stride_cm", "stride_ch", "stride_cn")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    operands = ({"a_ptr": f"tensordesc<{{fp8}}[{bm}, 1, {bk}]>", "b_ptr": f"tensordesc<{{fp8}}[1, {bn}, {bk}]>"}
                if config.tma else {"a_ptr": "*{fp8}", "b_ptr": "*{fp8}"})
    return AotSpec(
        name=f"fp8_einsum[BM={bm},BN={bn},warps={config.num_warps},stages={config.num_stages},"
             f"split={config.split_k > 1},tma={config.tma},out={out}]",
        kernel=_fp8_einsum_kernel,
        signature={"a_ptr": operands["a_ptr"], "sa_ptr": "*fp32", "b_ptr": operands["b_ptr"], "sb_ptr": "*fp32",
                   "c_ptr": f"*{out}", **dict.fromkeys(ints, "i32")},
        constexprs={"SCALE_K": SCALE_BLOCK, "GRAN_N": 128, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                    "TMA": config.tma},
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        aligned=tuple(arg for arg in _ALIGNED_ARGS if not (config.tma and arg in ("a_ptr", "b_ptr"))),
        targets=targets,
    )


# The launch configurations of `choose_config` at the DSv4 shape (r = 4096): decode split-K at the decode tiles
# (fp32 workspace) on every target, and AMD's b <= 64 tile on its targets; b = 128 (NVIDIA's tile from b = 33 on)
# and prefill full-K (bf16 out) with each platform's tiles on its targets (TMA descriptors on sm_90); the split-K
# reduction.
AOT_SPECS = [
    *(_einsum_spec(choose_config(b, 8, 1024, 32, DEFAULT_NUM_SMS), "fp32") for b in (1, 32)),
    _einsum_spec(choose_config(64, 8, 1024, 32, DEFAULT_NUM_SMS, "amd"), "fp32", PLATFORM_TARGETS["amd"]),
    *(_einsum_spec(choose_config(b, 8, 1024, 32, DEFAULT_NUM_SMS, platform), "bf16", targets)
      for b in (128, 4096) for platform, targets in PLATFORM_TARGETS.items()),
    AotSpec(
        name="split_k_reduce",
        kernel=_split_k_reduce_kernel,
        signature={"ws_ptr": "*fp32", "out_ptr": "*bf16",
                   **dict.fromkeys(("TOTAL", "H", "N", "SPLITS", "stride_om", "stride_oh", "stride_on"), "i32")},
        constexprs={"BLOCK": _REDUCE_BLOCK},
        aligned=("ws_ptr", "out_ptr", "TOTAL", "N", "stride_om", "stride_oh"),
    ),
]
