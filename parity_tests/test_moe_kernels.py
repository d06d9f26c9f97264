"""Unit tests of the MoE kernels (`optimized/triton/moe_*.py`, `optimized/deepgemm/moe.py`) and the public
MoE API (`optimized/moe.py`), each against a small torch oracle built from `reference.moe` on identical inputs.

On the CPU the Triton kernels run under `TRITON_INTERPRET=1` at shapes smaller than TINY (D 256, I 256, 8
experts, top-4): two K blocks in every GEMM (so the per-block scale promotion is exercised), few programs
(these CPU-tensor tests run only in the interpreter).
The whole-op parity at TINY / FLASH / PRO shapes lives in `test_moe.py` (cases of `parity_tests/ops/moe.py`).
The GPU tests at the end run the Triton GPU tile configurations and DeepGEMM's two grouped layouts.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import re

import pytest
import torch

from optimized.backends import backend_status, detect
from parity_tests.cases import generator
from parity_tests.metrics import calc_diff, max_abs_error, max_rel_error
from parity_tests.ops.moe import route_agreement
from parity_tests.tolerances import (
    BITWISE,
    MOE_SIMULATED,
    ROUTE_EXTREME_WEIGHTS,
    ROUTE_SETS,
    ROUTE_WEIGHTS,
    ROUTER_LOGIT_ERROR,
)
from reference import moe as ref
from reference.config import FLASH, TINY
from reference.formats import dequantize_per_token, quantize_per_token
from reference.numerics import EXACT, MEGAMOE, OFFICIAL, Numerics

# the module (`optimized.moe`, the attribute, is the function `moe` that the package re-exports)
omoe = importlib.import_module("optimized.moe")
triton_ok, triton_why = backend_status("triton")
# The unit tests build CPU tensors, which reach the Triton kernels in the interpreter only; on a GPU the tests at
# the end run the GPU tiles, and `test_moe.py` the FLASH / PRO cases.
needs_triton = pytest.mark.skipif(
    not triton_ok or not detect().interpret,
    reason=f"triton backend unavailable: {triton_why}" if not triton_ok else
    "a CPU-tensor unit test of the Triton kernels: runs under TRITON_INTERPRET=1 (the GPU tests below run on a GPU)")
any_triton = pytest.mark.skipif(not triton_ok, reason=f"triton backend unavailable: {triton_why}")

SMALL = TINY.replace(n_routed_experts=8, n_activated_experts=4)
HASH_LAYER, TOPK_LAYER = 0, SMALL.n_hash_layers


def _weights(layer: int = TOPK_LAYER, fmt: str = "e4m3fn", expert_format: str = "fp8", cfg=SMALL) -> ref.MoEWeights:
    return ref.random_moe_weights(cfg, layer, expert_format=expert_format, fmt=fmt, generator=generator(7))


def _x(tokens: int, seed: int = 1, dim: int = SMALL.dim) -> torch.Tensor:
    return torch.randn(tokens, dim, generator=generator(seed)).to(torch.bfloat16)


def _assert_bitwise(mismatches: int, what: str) -> None:
    assert BITWISE.passes(mismatches), f"{what}: {mismatches} mismatches ({BITWISE.reason})"


def _assert_simulated(cand: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = calc_diff(cand, want)
    assert MOE_SIMULATED.passes(diff), f"{what}: calc_diff {diff:.3g} > {MOE_SIMULATED.value} ({MOE_SIMULATED.reason})"


# ------------------------------------------------------------------------------------------------
# Routing (moe_routing)
# ------------------------------------------------------------------------------------------------


@needs_triton
def test_router_topk_selects_like_the_reference_with_ties_to_the_lower_id_and_extreme_logits() -> None:
    from optimized.triton.moe_routing import router_topk

    n_tokens, n_experts, k = 24, 16, 6
    logits = torch.randn(n_tokens, n_experts, generator=generator(3)) * 2
    logits[:, 9] = logits[:, 3]  # exact ties: same logit, same bias -> expert 3 must win
    logits[0, :] = torch.tensor([30.0, -30.0, -100.0, 100.0] * 4)  # scores neither underflow nor overflow
    logits[1, :] = -90.0  # scores of e^-45: the bias alone decides
    bias = torch.randn(n_experts, generator=generator(4)) * 0.1
    bias[9] = bias[3]
    ids, weights = router_topk(logits[None], bias, topk=k, route_scale=2.5)

    scores = ref.sqrt_softplus(logits)
    want_ids = ref.select_topk(scores + bias, k)
    want_weights = scores.gather(1, want_ids)
    want_weights = want_weights / want_weights.sum(-1, keepdim=True) * 2.5
    _assert_bitwise(int((ids.long() != want_ids).sum()), "expert ids (same logits)")
    err = max_rel_error(weights, want_weights, floor=1e-30)
    assert ROUTE_EXTREME_WEIGHTS.passes(err), f"weights: max rel error {err:.3g} ({ROUTE_EXTREME_WEIGHTS.reason})"
    assert bool((weights > 0).all()), "a score underflowed to 0"


@needs_triton
def test_router_logits_split_over_the_hidden_dim_sum_to_the_fp32_logits() -> None:
    from optimized.triton.moe_routing import router_logits, router_topk

    x, gate = _x(19), _weights().gate
    want = x.float() @ gate.float().T
    for n_split in (1, 2):
        parts = router_logits(x, gate, n_split=n_split)
        assert parts.shape == (n_split, 19, SMALL.n_routed_experts)
        err = max_abs_error(parts.sum(0), want)
        assert err <= ROUTER_LOGIT_ERROR, f"n_split={n_split}: logit error {err:.3g} > {ROUTER_LOGIT_ERROR}"
    # the top-k kernel adds the partial sums in order: the same selection as on their sum
    parts = router_logits(x, gate, n_split=2)
    ids, _ = router_topk(parts, None, topk=4, route_scale=1.0)
    _assert_bitwise(int((ids.long() != ref.select_topk(ref.sqrt_softplus(parts[0] + parts[1]), 4)).sum()),
                    "ids from split logits")


@any_triton
def test_router_logits_of_a_token_do_not_depend_on_the_batch_tiles() -> None:
    """Decode batches (<= DECODE_TOKENS) use 16 experts per program, prefill 128: the same logits, bit for bit."""
    from optimized.triton.moe_routing import DECODE_TOKENS, router_logits

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the tiles that matter are the GPU's
    x, gate = _x(DECODE_TOKENS + 3).to(device), _weights().gate.to(device)
    batch = router_logits(x, gate, n_split=2)
    for t in (0, DECODE_TOKENS + 2):
        alone = router_logits(x[t:t + 1], gate, n_split=2)
        _assert_bitwise(int((alone[:, 0] != batch[:, t]).sum()), f"token {t}: logits alone vs in a prefill batch")


@any_triton
def test_router_logits_in_256_wide_dot_steps_equal_128_wide_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """`logits_step`: 256-wide K steps where they divide a split (FLASH 4096 / 8 = 512), else 128 (PRO's 896). On the
    GPU each step adds its dot into one fp32 accumulator in k order, so the bits equal 128-wide steps; the CPU
    interpreter's numpy dot may sum a 256-wide step in another order, so there the logits stay within the fp32 bound."""
    from optimized.triton import moe_routing
    from optimized.triton.moe_routing import logits_step, router_logits

    assert (logits_step(512), logits_step(896), logits_step(256), logits_step(128)) == (256, 128, 256, 128)
    assert logits_step(512, "amd") == 128  # gfx942's LDS: see LOGITS_STEP_D
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, gate = _x(5).to(device), _weights().gate.to(device)  # D = 256: one 256-wide step against two 128-wide ones
    for n_split in (1, 2):
        wide = router_logits(x, gate, n_split=n_split)
        monkeypatch.setattr(moe_routing, "LOGITS_STEP_D", 128)
        narrow = router_logits(x, gate, n_split=n_split)
        monkeypatch.setattr(moe_routing, "LOGITS_STEP_D", 256)
        if device == "cuda":
            _assert_bitwise(int((wide != narrow).sum()), f"n_split={n_split}: 256- vs 128-wide steps")
        else:
            assert max_abs_error(wide, narrow) <= ROUTER_LOGIT_ERROR


@needs_triton
@pytest.mark.parametrize("layer", [TOPK_LAYER, HASH_LAYER], ids=["topk", "hash"])
def test_route_matches_the_reference_and_a_nan_token_keeps_valid_ids(layer: int) -> None:
    w = _weights(layer)
    x = _x(13)
    x[5, 7] = float("nan")
    token_ids = torch.randint(0, SMALL.vocab_size, (13,), generator=generator(2))
    kw = dict(token_ids=token_ids, tid2eid=w.tid2eid, cfg=SMALL)
    ids, weights = omoe.route(x, w.gate, w.bias, **kw, backend="triton")
    want_ids, want_weights = ref.route(x, w.gate, w.bias, **kw)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert bool(((ids >= 0) & (ids < SMALL.n_routed_experts)).all()), "a NaN token must still get valid ids"
    finite = torch.arange(13) != 5
    _assert_bitwise(int((ids[finite].sort(-1).values != want_ids[finite].sort(-1).values).sum()), "expert sets")
    assert bool(weights[5].isnan().all()) and bool(weights[finite].isfinite().all())
    err = max_abs_error(weights[finite], want_weights[finite])
    assert ROUTE_WEIGHTS.passes(err), f"weights: {err:.3g} ({ROUTE_WEIGHTS.reason})"


# ------------------------------------------------------------------------------------------------
# Permute, gather, combine (moe_permute)
# ------------------------------------------------------------------------------------------------


def _random_ids(n_tokens: int, n_experts: int, k: int, seed: int) -> torch.Tensor:
    """[T, k] int32 distinct ids per row, some -1 slots, and expert n_experts - 1 never chosen."""
    g = generator(seed)
    ids = torch.stack([torch.randperm(n_experts - 1, generator=g)[:k] for _ in range(n_tokens)]).to(torch.int32)
    ids[torch.rand(ids.shape, generator=g) < 0.05] = -1
    return ids


def _layout_oracle(ids: torch.Tensor, n_experts: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slot_row [T * k] and expert_start [E + 1] of the compact layout, by a stable sort in torch."""
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat[flat >= 0], minlength=n_experts)
    padded = (counts + align - 1) // align * align
    start = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    slot_row = torch.full_like(flat, -1)
    order = torch.sort(torch.where(flat >= 0, flat, n_experts), stable=True).indices
    for e in range(n_experts):
        slots = order[flat[order] == e]
        slot_row[slots] = start[e] + torch.arange(slots.numel())
    return slot_row, start


@needs_triton
@pytest.mark.parametrize("tokens", [700, 21], ids=["33-chunks", "one-chunk"])
def test_permute_places_each_slot_once_in_slot_order_inside_its_aligned_expert_segment(tokens: int) -> None:
    from optimized.triton.moe_permute import permute

    n_experts, align = 16, 64
    # 700 x 6 = 4200 slots: 33 chunks, two steps of the prefix-sum loop; 21 x 6 = 126: the one-program kernel
    ids = _random_ids(tokens, n_experts, 6, seed=5)
    layout = permute(ids, n_experts, align=align)
    want_rows, want_start = _layout_oracle(ids, n_experts, align)
    _assert_bitwise(int((layout.slot_row.long() != want_rows).sum()), "slot -> row")
    _assert_bitwise(int((layout.expert_start.long() != want_start).sum()), "segment starts")
    placed = want_rows >= 0
    rows = want_rows[placed]
    flat = ids.reshape(-1).long()
    _assert_bitwise(int((layout.sorted_slot[rows].long() != placed.nonzero().flatten()).sum()), "row -> slot")
    _assert_bitwise(int((layout.row_expert[rows].long() != flat[placed]).sum()), "row -> expert")
    padding = torch.ones(layout.n_rows, dtype=torch.bool)
    padding[rows] = False
    assert bool((layout.sorted_slot[padding] == -1).all()) and bool((layout.row_expert[padding] == -1).all())
    assert layout.n_rows >= int(want_start[-1]) and layout.n_rows % align == 0
    assert int(layout.expert_count[-1]) == 0, "the unused expert owns no rows"


@needs_triton
def test_masked_layout_gives_each_expert_its_capacity_and_marks_the_overflow() -> None:
    from optimized.triton.moe_permute import OVERFLOW, SKIPPED, permute

    ids = torch.tensor([[2, 0, -1], [2, 1, 0], [2, 2, 1]], dtype=torch.int32)  # expert 2 four times, capacity 3
    layout = permute(ids, 4, capacity=3, write_rows=False)
    want = torch.tensor([2 * 3 + 0, 0, SKIPPED.value, 2 * 3 + 1, 3, 1, 2 * 3 + 2, OVERFLOW.value, 3 + 1],
                        dtype=torch.int32)
    _assert_bitwise(int((layout.slot_row != want).sum()), "slot -> row of the masked layout")
    _assert_bitwise(int((layout.expert_count != torch.tensor([2, 2, 3, 0], dtype=torch.int32)).sum()), "masked_m")
    assert layout.sorted_slot is None and layout.n_rows == 12


@needs_triton
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_gather_rows_copies_each_slots_token_row_and_scales_into_the_mn_major_layout(masked: bool) -> None:
    from optimized.deepgemm.moe import _mn_major_scales
    from optimized.triton.moe_permute import gather_rows, permute

    n_tokens, k, n_experts, dim = 9, 3, 5, 512
    ids = _random_ids(n_tokens, n_experts, k, seed=8)
    q, s = quantize_per_token(_x(n_tokens, dim=dim), 128, "e4m3fnuz")
    if masked:
        layout = permute(ids, n_experts, capacity=12, write_rows=False)
        out = torch.zeros((n_experts, 12, dim), dtype=q.dtype)
        out_scale = _mn_major_scales((n_experts,), 12, dim, q.device).fill_(-1)
    else:
        layout = permute(ids, n_experts, align=8)
        out = torch.zeros((layout.n_rows, dim), dtype=q.dtype)
        out_scale = _mn_major_scales((), layout.n_rows, dim, q.device).fill_(-1)
    gather_rows(q, s, layout, k, out, out_scale)
    rows = layout.slot_row.long()
    placed = rows >= 0
    tokens = torch.arange(n_tokens * k)[placed] // k
    flat_out, flat_scale = out.reshape(-1, dim), out_scale.reshape(-1, dim // 128)
    _assert_bitwise(int((flat_out[rows[placed]].view(torch.uint8) != q[tokens].view(torch.uint8)).sum()), "rows")
    _assert_bitwise(int((flat_scale[rows[placed]] != s[tokens]).sum()), "scales")
    assert out_scale.stride()[-2:] == (1, out_scale.shape[-2]), "scales are MN-major"


@needs_triton
def test_combine_sums_slots_in_ascending_expert_id_in_fp32_and_poisons_overflow() -> None:
    from optimized.triton.moe_permute import OVERFLOW, MoeLayout, combine

    n_tokens, k, dim = 5, 4, 64
    ids = torch.tensor([[3, 1, 2, 0], [0, 0, 5, -1], [7, 6, 5, 4], [1, 2, 3, 4], [2, 1, 0, 3]], dtype=torch.int32)
    n_rows = n_tokens * k
    slot_row = torch.randperm(n_rows, generator=generator(9)).to(torch.int32)
    slot_row[7] = -1  # the -1 slot
    slot_row[4 * k + 2] = OVERFLOW.value
    layout = MoeLayout(slot_row, None, None, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                       n_rows, 1, 0)
    y = (torch.randn(n_rows, dim, generator=generator(10)) * 8).to(torch.bfloat16)
    shared = torch.randn(n_tokens, dim, generator=generator(11)).to(torch.bfloat16)
    out = combine(y, layout, ids, shared)

    want = torch.zeros(n_tokens, dim)
    for t in range(n_tokens):
        for j in sorted(range(k), key=lambda j: (int(ids[t, j]), j)):  # ascending expert id, then slot
            row = int(slot_row[t * k + j])
            if row >= 0:
                want[t] += y[row].float()
    want = (want + shared.float()).to(torch.bfloat16)
    _assert_bitwise(int((out[:4] != want[:4]).sum()), "fp32 sum in expert order, shared added, one bf16 cast")
    assert bool(out[4].isnan().all()), "an overflowing slot makes its token NaN, never a silent drop"


# ------------------------------------------------------------------------------------------------
# Grouped GEMMs and the SwiGLU epilogue (moe_gemm)
# ------------------------------------------------------------------------------------------------


def _reference_rows(x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, w: ref.MoEWeights,
                    numerics: Numerics, cfg=SMALL) -> torch.Tensor:
    """[T * k, D] bf16: reference `expert_forward` of each slot on its own (rows of -1 slots are zero)."""
    rows = torch.zeros(ids.numel(), x.shape[1], dtype=torch.bfloat16)
    k = ids.shape[1]
    for s, e in enumerate(ids.reshape(-1).tolist()):
        if e >= 0:
            t, j = divmod(s, k)
            rows[s] = ref.expert_forward(x[t:t + 1], ref._expert(w.w13, e), ref._expert(w.w2, e),
                                         topk_weights[t, j:j + 1], swiglu_limit=cfg.swiglu_limit,
                                         numerics=numerics)[0]
    return rows


@needs_triton
@pytest.mark.parametrize("numerics", [OFFICIAL, OFFICIAL.replace(fp8_format="e4m3fnuz"), MEGAMOE, EXACT],
                         ids=["official", "e4m3fnuz", "megamoe_act_block_32", "exact_bf16"])
def test_routed_rows_equal_the_reference_expert_of_each_slot(numerics: Numerics) -> None:
    from optimized.triton.moe_pipeline import activation, routed_rows

    w = _weights(fmt=numerics.fp8_format)
    x = _x(6)
    ids, topk_weights = ref.route(x, w.gate, w.bias, token_ids=None, tid2eid=None, cfg=SMALL)
    a, a_scale = activation(x, numerics)
    y, layout = routed_rows(a, a_scale, ids, topk_weights, w.w13, w.w2, swiglu_limit=SMALL.swiglu_limit,
                            numerics=numerics)
    cand = y[layout.slot_row.long()]
    _assert_simulated(cand, _reference_rows(x, ids, topk_weights, w, numerics), f"{numerics.name} rows")


@needs_triton
@pytest.mark.parametrize("clamp", [True, False], ids=["clamped", "initial_release_no_clamp"])
def test_shared_rows_equal_the_reference_shared_expert(clamp: bool) -> None:
    from optimized.triton.moe_pipeline import activation, shared_rows

    numerics = OFFICIAL.replace(shared_expert_clamp=clamp)
    w, x = _weights(), _x(70)  # 70 rows: two row blocks, the second partial
    a, a_scale = activation(x, numerics)
    cand = shared_rows(a, a_scale, w.shared_w13, w.shared_w2, swiglu_limit=SMALL.swiglu_limit, numerics=numerics)
    want = ref.shared_expert(x, w.shared_w13, w.shared_w2, swiglu_limit=SMALL.swiglu_limit, numerics=numerics)
    _assert_simulated(cand, want, "shared expert")


class _GemmCase:
    """D 1024 (8 K blocks), 5 tokens: the weights, the reference routing and quantized activation, and the reference
    outputs of the routed slots and the shared expert, built once; `run` launches both GEMMs of each with given
    `moe_gemm.GemmConfig`s."""

    def __init__(self, numerics: Numerics) -> None:
        from optimized.triton.moe_pipeline import activation

        self.numerics, self.cfg = numerics, SMALL.replace(dim=1024)
        cfg, x = self.cfg, _x(5, dim=self.cfg.dim)
        self.w = w = _weights(fmt=numerics.fp8_format, cfg=cfg)
        ids, topk_weights = ref.route(x, w.gate, w.bias, token_ids=None, tid2eid=None, cfg=cfg)
        self.ids, self.topk_weights = ids, topk_weights
        self.a, self.a_scale = activation(x, numerics)
        self.want_rows = _reference_rows(x, ids, topk_weights, w, numerics, cfg)
        self.want_shared = ref.shared_expert(x, w.shared_w13, w.shared_w2, swiglu_limit=cfg.swiglu_limit,
                                             numerics=numerics)
        self.common = {"numerics_fmt": numerics.fp8_format, "act_block": numerics.act_block}

    def run(self, gate_up, down, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed rows in slot order, shared expert output), each checked against the reference (MOE_SIMULATED)."""
        from optimized.triton import moe_gemm
        from optimized.triton.moe_permute import permute
        from optimized.triton.moe_pipeline import clamp_limit

        w, cfg, a, a_scale, common = self.w, self.cfg, self.a, self.a_scale, self.common
        # tiles narrower than a quantization block take their counters from the permute (the shared expert's below
        # are allocated by `grouped_gemm`)
        narrow = self.numerics.act_quant and moe_gemm.block_parts(gate_up, self.numerics.act_block) > 1
        layout = permute(self.ids, cfg.n_routed_experts, align=gate_up.block_m,
                         arrivals_per_block=cfg.moe_inter_dim // self.numerics.act_block if narrow else 0)
        h, h_scale = moe_gemm.grouped_gemm(a, a_scale, w.w13.data, w.w13.scale, config=gate_up, swiglu=True,
                                           layout=layout, topk=self.ids.shape[1], gather=True,
                                           topk_weights=self.topk_weights.reshape(-1),
                                           limit=clamp_limit(cfg.swiglu_limit), arrivals=layout.arrivals, **common)
        y, _ = moe_gemm.grouped_gemm(h, h_scale, w.w2.data, w.w2.scale, config=down, swiglu=False, layout=layout,
                                     **common)
        shared_limit = clamp_limit(cfg.swiglu_limit if self.numerics.shared_expert_clamp else 0)
        hs, hs_scale = moe_gemm.grouped_gemm(a, a_scale, w.shared_w13.data[None], w.shared_w13.scale[None],
                                             config=gate_up, swiglu=True, layout=None, limit=shared_limit, **common)
        ys, _ = moe_gemm.grouped_gemm(hs, hs_scale, w.shared_w2.data[None], w.shared_w2.scale[None], config=down,
                                      swiglu=False, layout=None, **common)
        rows = y[layout.slot_row.long()]
        _assert_simulated(rows, self.want_rows, f"routed rows, {what}")
        _assert_simulated(ys, self.want_shared, f"shared expert, {what}")
        return rows, ys


@needs_triton
@pytest.mark.parametrize("numerics", [OFFICIAL, MEGAMOE, EXACT], ids=["official", "megamoe_act_block_32", "exact_bf16"])
def test_split_k_gemms_add_their_slices_in_order_and_equal_the_whole_k_loop(numerics: Numerics) -> None:
    """Split-K (`GemmConfig.split_k`: each program runs one K slice, the tile's last program to arrive adds the
    slices in order and runs the epilogue) on both GEMMs of the routed and the shared expert, D 1024 (8 K blocks).

    Against the whole-K launch: the slices only regroup the fp32 sum of the per-block partial products (the
    per-block products, scales and epilogue are the same), so outputs differ at most by fp32 reassociation, which a
    bf16 output (and the FP8 quantization of the SwiGLU output) hides almost always; the bound is MOE_SIMULATED
    against the reference, and calc_diff <= 1e-9 against the whole-K launch (measured 0 here; reassociating an fp32
    sum of 8 terms moves it by a few 2^-24 relative, calc_diff ~1e-14, far below one bf16 rounding flip per
    thousands of values, ~1e-7). A slice that is dropped or added twice costs calc_diff > 0.1."""
    from optimized.triton import moe_gemm

    case = _GemmCase(numerics)
    whole = None
    for split in (1, 2, 8):
        # the down GEMM's K is I = 256: two K blocks, split 2
        outputs = case.run(moe_gemm.GemmConfig(16, 128, 4, 1, split), moe_gemm.GemmConfig(16, 128, 4, 1, min(split, 2)),
                           f"split {split}")
        if whole is None:
            whole = outputs
        for got, want in zip(outputs, whole):
            assert calc_diff(got, want) <= 1e-9, f"split {split}: not the whole-K sum up to fp32 reassociation"
    w = case.w
    with pytest.raises(ValueError, match=re.escape("config: split_k = 3 must divide the")):
        moe_gemm.grouped_gemm(case.a, case.a_scale, w.shared_w13.data[None], w.shared_w13.scale[None],
                              config=moe_gemm.GemmConfig(16, 128, 4, 1, 3), swiglu=True, layout=None, **case.common)


@needs_triton
@pytest.mark.parametrize("numerics", [OFFICIAL, MEGAMOE, EXACT], ids=["official", "megamoe_act_block_32", "exact_bf16"])
def test_swap_ab_gemms_compute_the_same_products_transposed(numerics: Numerics) -> None:
    """Swap-AB tiles (`GemmConfig.swap_ab`: `dot(w^T, a^T)`, the weight rows on the MMA's M side; the gate/up GEMM
    stacks a tile's gate rows over its up rows for one dot) on both GEMMs of the routed and the shared expert, with
    split-K on top and a narrow gate/up tile that finishes its quantization blocks through counters, against the
    reference (MOE_SIMULATED) and against the
    unswapped tiles: the same per-block products, scales and epilogue, so what may differ is the order in which the
    MMA sums the 128 (32) products of a block, fp32 reassociation; the bound is the split-K test's 1e-9 (on the H200,
    where wgmma and mma.sync really differ, the whole routed MoE moved by calc_diff ~1e-6 after the FP8 re-quantization
    of the SwiGLU output: design note 25, a GPU-only figure). A transposed operand or a scale applied on the wrong axis
    costs calc_diff > 0.1."""
    from optimized.triton import moe_gemm

    case = _GemmCase(numerics)
    plain = case.run(moe_gemm.GemmConfig(16, 128, 4, 1), moe_gemm.GemmConfig(16, 128, 4, 1), "unswapped")
    narrow = 16 if numerics.act_block == 32 else 32  # a quarter of a quantization block (`PARTS` = 4)
    for block_n, split in ((128, 1), (128, 2), (narrow, 1)):
        what = f"swap-AB, gate/up {block_n} columns, split {split}"
        swapped = case.run(moe_gemm.GemmConfig(16, block_n, 4, 1, split, swap_ab=True),
                           moe_gemm.GemmConfig(16, 64, 4, 1, split, swap_ab=True), what)
        for got, want in zip(swapped, plain):
            assert calc_diff(got, want) <= 1e-9, f"{what}: not the unswapped products"


@needs_triton
@pytest.mark.parametrize("numerics", [OFFICIAL, MEGAMOE, EXACT], ids=["official", "megamoe_act_block_32", "exact_bf16"])
def test_gate_up_tiles_narrower_than_a_quantization_block_quantize_it_in_its_last_tile(numerics: Numerics) -> None:
    """Gate/up tiles of 64 and 32 columns (16 for MegaMoE's 32-wide blocks), where 2 or 4 tiles share each
    quantization block of the SwiGLU output: each stores its bf16 values, the block's last tile to arrive (an
    acquire-release counter) reads them back and quantizes the whole block. Against the 128-column tiles: each
    column's K loop, SwiGLU and bf16 rounding are the same, and the block is quantized from the same values, so the
    outputs are the same bits (a tile that quantized only its own part would take another scale: calc_diff > 0).
    The routed launch uses the permute's counters, the shared expert's come from `grouped_gemm`; a second launch on
    the same layout proves the counters are reset. EXACT numerics (bf16 output, no quantization) runs them as plain
    narrow tiles. The interpreter runs the programs one after another, so the order of arrival is fixed here; the
    concurrent launch was compared bitwise with 128-column tiles on the GPU (FLASH, design note 28) and runs in the
    GPU tests at T = 1."""
    from optimized.triton import moe_gemm
    from optimized.triton.moe_permute import permute

    case = _GemmCase(numerics)
    down = moe_gemm.GemmConfig(16, 128, 4, 1)
    whole = case.run(moe_gemm.GemmConfig(16, 128, 4, 1), down, "128-column gate/up")
    for block_n in (16,) if numerics.act_block == 32 else (64, 32):
        narrow = case.run(moe_gemm.GemmConfig(16, block_n, 4, 1), down, f"{block_n}-column gate/up")
        for got, want in zip(narrow, whole):
            assert torch.equal(got, want), f"{block_n}-column gate/up tiles: not the 128-column tiles' bits"
    if not numerics.act_quant:
        return
    layout = permute(case.ids, case.cfg.n_routed_experts, align=16,
                     arrivals_per_block=case.cfg.moe_inter_dim // numerics.act_block)
    gate_up_args = (case.a, case.a_scale, case.w.w13.data, case.w.w13.scale)
    gate_up_kwargs = {"config": moe_gemm.GemmConfig(16, 64 if numerics.act_block == 128 else 16, 4, 1),
                      "swiglu": True, "layout": layout, "topk": case.ids.shape[1], "gather": True,
                      "topk_weights": case.topk_weights.reshape(-1), "arrivals": layout.arrivals, **case.common}
    first = moe_gemm.grouped_gemm(*gate_up_args, **gate_up_kwargs)
    assert int(layout.arrivals.abs().sum()) == 0, "the counters are not reset after the launch"
    second = moe_gemm.grouped_gemm(*gate_up_args, **gate_up_kwargs)
    rows = layout.slot_row.long()  # padding rows are never written
    assert all(torch.equal(x[rows].float(), y[rows].float()) for x, y in zip(first, second)), "second launch"
    with pytest.raises(ValueError, match=re.escape("arrivals: expected at least")):
        moe_gemm.grouped_gemm(*gate_up_args, **{**gate_up_kwargs, "arrivals": layout.arrivals[:1]})
    with pytest.raises(ValueError, match=re.escape("config: a split K (split_k = 2) needs tiles of whole")):
        moe_gemm.grouped_gemm(*gate_up_args, **{**gate_up_kwargs, "config": moe_gemm.GemmConfig(16, 16, 4, 1, 2),
                                                "arrivals": None})
    with pytest.raises(ValueError, match=re.escape("arrivals_per_block: only for the compact layout")):
        permute(case.ids, case.cfg.n_routed_experts, capacity=8, arrivals_per_block=2)
    # more slots than one permute chunk: the counters come zeroed from a fill, one per row block and block
    many = permute(torch.arange(200 * 4, dtype=torch.int32).reshape(200, 4) % case.cfg.n_routed_experts,
                   case.cfg.n_routed_experts, align=16, arrivals_per_block=3)
    assert many.arrivals.shape == (many.n_rows // 16 * 3,) and int(many.arrivals.abs().sum()) == 0


@needs_triton
def test_launch_order_of_the_tiles_does_not_change_a_bit() -> None:
    """Row blocks first or column tiles first (`GemmConfig.n_fastest`, an L2 matter: design note 30): every program
    computes the same tile either way, including the split-K slices and the narrow tiles, whose counters are indexed
    by (row block, tile), not by launch order; so the outputs are the same bits. A program that took its row block
    and column tile from the wrong grid axis would compute another tile (calc_diff > 0.1)."""
    from optimized.triton import moe_gemm

    case = _GemmCase(OFFICIAL)
    for gate_up in (moe_gemm.GemmConfig(16, 128, 4, 1, 2), moe_gemm.GemmConfig(16, 32, 4, 1)):
        outputs = [case.run(dataclasses.replace(gate_up, n_fastest=order),
                            moe_gemm.GemmConfig(16, 64, 4, 1, 2, n_fastest=order), f"n_fastest={order}")
                   for order in (False, True)]
        assert all(torch.equal(x, y) for x, y in zip(*outputs)), f"{gate_up}: the launch order changed the outputs"
    # the row blocks go on the grid's second axis only while they fit it (65535)
    tile = moe_gemm.GemmConfig(64, 128, 8, 4)
    assert moe_gemm.launch_grid(tile, 64 * 65535, 2048) == ((16, 65535, 1), True)
    assert moe_gemm.launch_grid(tile, 64 * 65536, 2048) == ((65536, 16, 1), False)
    assert moe_gemm.launch_grid(dataclasses.replace(tile, n_fastest=False), 64, 2048) == ((1, 16, 1), False)


def test_split_k_rule_splits_only_grids_that_leave_sms_idle() -> None:
    """`split_k_for` at FLASH (D 4096, I 2048) on the H200's 132 SMs: the decode shared expert splits (16 gate/up
    tiles: 8 ways; 64 down tiles: 4 ways), the routed decode grid (6 experts x 16 tiles at T = 1) and prefill do not,
    and neither does AMD (not measured)."""
    from optimized.triton.moe_gemm import choose_config, split_k_for

    def splits(rows: int, rows_per_expert: float, platform: str = "nvidia") -> tuple[int, int]:
        gate_up = choose_config(rows_per_expert, 2048, True, platform=platform)
        down = choose_config(rows_per_expert, 4096, False, platform=platform)
        return (split_k_for(gate_up, rows, 2048, 4096, 132, True, platform).split_k,
                split_k_for(down, rows, 4096, 2048, 132, False, platform).split_k)

    assert splits(1, 1) == (8, 4)  # shared expert, T = 1
    assert splits(16, 16) == (8, 4)  # shared expert, T = 16: the last token count of the decode tiles
    assert splits(64, 64) == (1, 1)  # shared expert, T = 64: 64-row tiles stay whole (measured no faster)
    assert splits(96, 1) == (1, 1)  # routed, T = 1: 6 experts x 16 rows
    assert splits(4096, 4096) == (1, 1)
    assert splits(1, 1, platform="amd") == (1, 1)


def test_narrow_gate_up_rule_narrows_only_decode_grids_under_one_wave_of_official_numerics() -> None:
    """`narrow_gate_up_for` at FLASH (I 2048: 16 tiles of 128 columns per row block) on the H100 / H200's 132 SMs:
    the routed T = 1 grid (6 row blocks, 96 tiles) takes 32-column tiles; T = 2 (12 row blocks, 192 tiles), the
    prefill tiles, AMD, MegaMoE's 32-wide activation blocks and a split tile keep theirs; a narrow tile is never
    split (`split_k_for`: its quantization blocks are finished through counters)."""
    import dataclasses

    from optimized.triton.moe_gemm import GemmConfig, choose_config, narrow_gate_up_for, split_k_for

    decode = choose_config(1, 2048, True)
    narrow = narrow_gate_up_for(decode, 96, 2048, 128, 132)
    assert narrow == GemmConfig(16, 32, 4, 4)
    assert narrow_gate_up_for(decode, 192, 2048, 128, 132) == decode
    assert narrow_gate_up_for(choose_config(128, 2048, True), 128, 2048, 128, 132).block_n == 128
    assert narrow_gate_up_for(choose_config(1, 2048, True, platform="amd"), 96, 2048, 128, 132, "amd").block_n == 128
    assert narrow_gate_up_for(decode, 96, 2048, 32, 132) == decode
    assert narrow_gate_up_for(dataclasses.replace(decode, split_k=2), 16, 2048, 128, 132).block_n == 128
    assert split_k_for(narrow, 16, 2048, 4096, 132, True) == narrow


@needs_triton
def test_swiglu_quant_equals_the_reference_swiglu_then_act_quant_and_keeps_nan_in_its_row() -> None:
    from optimized.deepgemm.moe import _mn_major_scales
    from optimized.triton.moe_gemm import swiglu_quant
    from optimized.triton.moe_permute import permute

    n_tokens, k, n_experts, inter, limit = 6, 2, 4, 256, 10.0
    ids = _random_ids(n_tokens, n_experts, k, seed=12)
    layout = permute(ids, n_experts, align=16)
    # gate/up rows as a grouped GEMM would write them: bf16, a quarter of them beyond +-limit
    h = (torch.randn(layout.n_rows, 2 * inter, generator=generator(13)) * 8).to(torch.bfloat16)
    nan_slot = 3
    h[int(layout.slot_row[nan_slot]), 5] = float("nan")
    weights = torch.rand(n_tokens * k, generator=generator(14)) + 0.5
    q = torch.zeros((layout.n_rows, inter), dtype=torch.float8_e4m3fn)
    s = _mn_major_scales((), layout.n_rows, inter, q.device)
    swiglu_quant(h, q, s, fmt="e4m3fn", limit=limit, layout=layout, topk_weights=weights)

    rows = layout.slot_row.long()
    placed = (rows >= 0).nonzero().flatten()
    a = ref.swiglu(h[rows[placed], :inter], h[rows[placed], inter:], limit) * weights[placed, None]
    want = dequantize_per_token(*quantize_per_token(a.to(torch.bfloat16), 128, "e4m3fn"), 128)
    cand = dequantize_per_token(q[rows[placed]], s[rows[placed]], 128)
    finite = placed != nan_slot
    _assert_simulated(cand[finite], want[finite], "SwiGLU + weight + bf16 + FP8 per 128")
    nan_row = cand[~finite][0]
    assert bool(nan_row[:128].isnan().all()) and bool(nan_row[128:].isfinite().all()), \
        "a NaN makes its own 128-block NaN (NaN scale), nothing else"


# ------------------------------------------------------------------------------------------------
# The public API (optimized.moe) on the Triton backend
# ------------------------------------------------------------------------------------------------


def _experts_both(x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, w: ref.MoEWeights,
                  numerics: Numerics = OFFICIAL) -> tuple[torch.Tensor, torch.Tensor]:
    kw = dict(swiglu_limit=SMALL.swiglu_limit, numerics=numerics)
    return (omoe.experts(x, ids, topk_weights, w.w13, w.w2, **kw, backend="triton"),
            ref.experts(x, ids, topk_weights, w.w13, w.w2, **kw))


@needs_triton
def test_experts_edge_cases_no_token_one_token_one_hot_expert_set_skips_and_repeats() -> None:
    w = _weights()
    k = SMALL.n_activated_experts
    empty = omoe.experts(_x(0), torch.zeros((0, k), dtype=torch.int32), torch.zeros(0, k), w.w13, w.w2,
                         swiglu_limit=SMALL.swiglu_limit, numerics=OFFICIAL, backend="triton")
    assert empty.shape == (0, SMALL.dim) and empty.dtype == torch.bfloat16

    x = _x(9)
    weights = torch.rand(9, k, generator=generator(15)) + 0.1
    one = torch.tensor([[5, 0, 2, 7]], dtype=torch.int32)
    hot = ((torch.arange(k)[None, :] + torch.arange(9)[:, None]) % k).to(torch.int32)  # experts 4..7 get none
    skips_and_repeats = hot.clone()
    skips_and_repeats[0, 1] = -1
    skips_and_repeats[1] = 3  # one token, four slots of expert 3: counted once per slot
    for name, x_, ids, tw in (("T=1", x[:1], one, weights[:1]), ("hot", x, hot, weights),
                              ("skips+repeats", x, skips_and_repeats, weights)):
        cand, want = _experts_both(x_, ids, tw, w)
        _assert_simulated(cand, want, name)


@needs_triton
def test_a_nan_token_stays_nan_and_reaches_no_other_token() -> None:
    w = _weights()
    x = _x(7)
    x[4, 100] = float("nan")
    ids, topk_weights = ref.route(x, w.gate, w.bias, token_ids=None, tid2eid=None, cfg=SMALL)
    cand, want = _experts_both(x, ids, topk_weights, w)
    assert bool(cand[4].isnan().all()) and bool(cand[torch.arange(7) != 4].isfinite().all())
    _assert_simulated(cand[:4], want[:4], "other tokens")

    out = omoe.moe(x, w, token_ids=None, cfg=SMALL, numerics=OFFICIAL, backend="triton")
    assert bool(out[4].isnan().all()) and bool(out[torch.arange(7) != 4].isfinite().all())


@needs_triton
@pytest.mark.parametrize(("layer", "expert_format"), [(TOPK_LAYER, "fp8"), (HASH_LAYER, "fp4")],
                         ids=["topk_fp8", "hash_fp4"])
def test_moe_equals_the_reference_and_the_module_equals_the_function(layer: int, expert_format: str) -> None:
    w = _weights(layer, expert_format=expert_format)
    x = _x(11)
    token_ids = torch.randint(0, SMALL.vocab_size, (11,), generator=generator(16))
    cand = omoe.moe(x, w, token_ids=token_ids, cfg=SMALL, numerics=OFFICIAL, backend="triton")
    _assert_simulated(cand, ref.moe(x, w, token_ids=token_ids, cfg=SMALL, numerics=OFFICIAL), "moe")
    layer_module = omoe.MoE(w, SMALL, OFFICIAL, backend="triton")
    _assert_bitwise(int((layer_module(x, token_ids) != cand).sum()), "MoE module vs moe()")


@needs_triton
@pytest.mark.parametrize("numerics", [OFFICIAL, MEGAMOE, EXACT], ids=["official", "megamoe_act_block_32", "exact_bf16"])
def test_tiled_experts_hold_the_same_blocks_and_give_the_row_layouts_outputs_bitwise(numerics: Numerics) -> None:
    """`tile_experts`: block (i, j) of expert e is `data[e, i, j]`, stored K-block-major, the scales are the weight's,
    an MXFP4 weight is tiled from its lossless FP8 re-encode. The Triton GEMMs read the same values and scales in the
    same order from the row layout and from either block order (only the addresses differ), so `experts` and the
    `MoE` module give the same bits."""
    fmt = numerics.fp8_format
    w = _weights(fmt=fmt)
    t13, t2 = omoe.tile_experts(w.w13, fmt), omoe.tile_experts(w.w2, fmt)
    assert t13.data.transpose(1, 2).is_contiguous() and not t13.data.is_contiguous(), "K-block-major storage"
    assert t13.shape == tuple(w.w13.shape) and t2.shape == tuple(w.w2.shape)
    assert torch.equal(t13.data[3, 2, 1], w.w13.data[3, 256:384, 128:256]), "block (2, 1) of expert 3"
    assert torch.equal(t2.data[5, 1, 0], w.w2.data[5, 128:256, :128]), "block (1, 0) of expert 5"
    assert torch.equal(t13.scale, w.w13.scale)
    w4 = _weights(expert_format="fp4", fmt=fmt)
    assert torch.equal(omoe.tile_experts(w4.w13, fmt).data, omoe.tile_experts(w4.w13.to_fp8(fmt), fmt).data)

    x = _x(9)
    ids, topk_weights = ref.route(x, w.gate, w.bias, token_ids=None, tid2eid=None, cfg=SMALL)
    common = {"swiglu_limit": SMALL.swiglu_limit, "numerics": numerics, "backend": "triton"}
    rows = omoe.experts(x, ids, topk_weights, w.w13, w.w2, **common)
    _assert_bitwise(int((omoe.experts(x, ids, topk_weights, t13, t2, **common) != rows).sum()), "tiled experts")
    n13, n2 = (omoe.TiledFp8Weight(t.data.contiguous(), t.scale) for t in (t13, t2))  # N-block-major storage
    _assert_bitwise(int((omoe.experts(x, ids, topk_weights, n13, n2, **common) != rows).sum()),
                    "tiled experts, N-block-major")
    # TMA descriptor loads of the tiled blocks (NVIDIA's prefill tiles; the interpreter runs descriptors too), with
    # 128-column tiles (a box stays inside one block): the same values in the same order
    from optimized.triton import moe_pipeline

    tiles = moe_pipeline.choose_config
    try:
        moe_pipeline.choose_config = lambda *a, **k: dataclasses.replace(tiles(*a, **k), block_n=128, tma=True)
        for w13, w2, order in ((t13, t2, "K-block-major"), (n13, n2, "N-block-major")):
            _assert_bitwise(int((omoe.experts(x, ids, topk_weights, w13, w2, **common) != rows).sum()),
                            f"tiled experts through TMA, {order}")
    finally:
        moe_pipeline.choose_config = tiles
    layer = omoe.MoE(w, SMALL, numerics, backend="triton")
    assert layer.tiled is None, "MoE tiles on NVIDIA GPUs only (where it was measured)"
    want = layer(x)
    layer.tiled = (t13, t2)
    _assert_bitwise(int((layer(x) != want).sum()), "MoE module on tiled experts")


def test_fp4_experts_are_reencoded_once_per_weight_and_released_with_it() -> None:
    w = _weights(expert_format="fp4")
    first = omoe.fp8_expert_weight(w.w13, "e4m3fn")
    assert omoe.fp8_expert_weight(w.w13, "e4m3fn") is first, "a second call must hit the cache"
    assert omoe.fp8_expert_weight(w.w13, "e4m3fnuz") is not first, "the cache is per FP8 format"
    assert torch.equal(first.dequantize(), w.w13.dequantize()), "the re-encode is lossless"
    tiled = omoe.tile_experts(w.w13, "e4m3fn")
    assert tiled.scale.data_ptr() == first.scale.data_ptr(), "tiling must reuse the cached re-encode, not make another"
    del tiled
    omoe.tile_experts(w.w2, "e4m3fn")
    assert (id(w.w2), "e4m3fn") not in omoe._FP8_CACHE, "tiling an uncached weight must not keep its re-encode"
    key = (id(w.w13), "e4m3fn")
    del w, first
    gc.collect()
    assert key not in omoe._FP8_CACHE, "the FP8 copy must not outlive its FP4 weight"


# ------------------------------------------------------------------------------------------------
# Bad inputs: checked before any kernel
# ------------------------------------------------------------------------------------------------


def _bad_calls() -> list[tuple[str, object, type[Exception], str]]:
    w, wh, w_fnuz = _weights(), _weights(HASH_LAYER), _weights(fmt="e4m3fnuz")
    x = _x(4)
    ids = torch.zeros((4, 4), dtype=torch.int32)
    tw = torch.ones(4, 4)
    tok = torch.arange(4)
    t13, t2 = omoe.tile_experts(w.w13, "e4m3fn"), omoe.tile_experts(w.w2, "e4m3fn")

    def experts(**kw):
        args = dict(x=x, topk_ids=ids, topk_weights=tw, w13=w.w13, w2=w.w2)
        args.update(kw)
        return lambda: omoe.experts(args["x"], args["topk_ids"], args["topk_weights"], args["w13"], args["w2"],
                                    swiglu_limit=10.0, numerics=kw.get("numerics", OFFICIAL),
                                    backend=kw.get("backend"))

    def route(**kw):
        args = dict(x=x, gate=w.gate, bias=w.bias, token_ids=None, tid2eid=None, cfg=SMALL)
        args.update(kw)
        return lambda: omoe.route(args["x"], args["gate"], args["bias"], token_ids=args["token_ids"],
                                  tid2eid=args["tid2eid"], cfg=args["cfg"])

    return [
        ("x_fp32", experts(x=x.float()), ValueError, "x: expected [T, D] bf16"),
        ("x_not_a_tensor", experts(x=[1.0]), TypeError, "x: expected a tensor"),
        ("x_dim_not_a_multiple_of_128", experts(x=_x(4, dim=200)), ValueError, "multiple of 128"),
        ("x_last_dim_strided", experts(x=_x(4, dim=512)[:, ::2]), ValueError, "x: the last dim must be contiguous"),
        ("topk_ids_float", experts(topk_ids=ids.float()), ValueError, "topk_ids: expected [4, k] int32/int64"),
        ("topk_ids_out_of_range", experts(topk_ids=ids + 8), ValueError, "topk_ids: expected values in [-1, 8)"),
        ("topk_ids_below_minus_one", experts(topk_ids=ids - 2), ValueError, "topk_ids: expected values in [-1, 8)"),
        ("topk_weights_shape", experts(topk_weights=tw[:, :2]), ValueError, "topk_weights: expected (4, 4)"),
        ("topk_ids_other_device", experts(topk_ids=ids.to("meta")), ValueError, "topk_ids: expected a tensor on cpu"),
        ("w13_not_a_weight", experts(w13=w.w13.data), TypeError, "w13: expected Fp8Weight, Fp4Weight or TiledFp8"),
        ("tiled_experts_on_the_reference", experts(w13=t13, w2=t2, backend="reference"), TypeError,
         "w13: TiledFp8Weight experts run on the triton backend only"),
        ("tiled_w13_with_row_w2", experts(w13=t13), TypeError, "the same format"),
        ("tile_experts_not_stacked", lambda: omoe.tile_experts(w.shared_w13, "e4m3fn"), ValueError,
         "weight: expected stacked [E, N, K] experts"),
        ("tile_experts_other_format", lambda: omoe.tile_experts(w.w13, "e4m3fnuz"), ValueError,
         "weight: FP8 data in torch.float8_e4m3fn, expected 'e4m3fnuz'"),
        ("tile_experts_not_a_weight", lambda: omoe.tile_experts(w.w13.data, "e4m3fn"), TypeError,
         "weight: expected Fp8Weight or Fp4Weight"),
        ("tiled_weight_scale_shape", lambda: omoe.TiledFp8Weight(t13.data, t13.scale[:, :1]), ValueError,
         "scale: expected (8, 4, 2) fp32 (one per block of data)"),
        ("tiled_weight_not_blocks", lambda: omoe.TiledFp8Weight(w.w13.data, w.w13.scale), ValueError,
         "data: expected [E, N / 128, K / 128, 128, 128] FP8 blocks"),
        ("tiled_weight_blocks_not_contiguous", lambda: omoe.TiledFp8Weight(t13.data.transpose(3, 4), t13.scale),
         ValueError, "data: expected contiguous blocks, N-block-major (contiguous) or K-block-major"),
        ("w2_wrong_shape", experts(w2=w.w13), ValueError, "w2: expected shape"),
        ("fp8_format_mismatch", experts(numerics=OFFICIAL.replace(fp8_format="e4m3fnuz")), ValueError,
         "do not match numerics.fp8_format"),
        ("mixed_fp8_fp4_experts", experts(w2=_weights(expert_format="fp4").w2), TypeError, "the same format"),
        ("numerics_not_numerics", experts(numerics="official"), TypeError, "numerics: expected Numerics"),
        ("w13_other_format_weights", experts(w13=w_fnuz.w13, w2=w_fnuz.w2), ValueError, "do not match"),
        ("gate_fp32", route(gate=w.gate.float()), ValueError, "gate_weight: expected bf16"),
        ("gate_wrong_experts", route(gate=w.gate[:4]), ValueError, "gate_weight: expected shape"),
        ("bias_missing", route(bias=None), ValueError, "bias: a non-hash layer needs"),
        ("bias_on_hash_layer", route(tid2eid=wh.tid2eid, token_ids=tok), ValueError, "bias: hash layers"),
        ("token_ids_missing", route(bias=None, tid2eid=wh.tid2eid), ValueError, "token_ids: hash layers route"),
        ("token_ids_out_of_vocab", route(bias=None, tid2eid=wh.tid2eid, token_ids=tok + SMALL.vocab_size),
         ValueError, "token_ids: every id must be in"),
        ("tid2eid_float", route(bias=None, tid2eid=wh.tid2eid.float(), token_ids=tok), ValueError,
         "tid2eid: expected [vocab, 4] int32/int64"),
        ("tid2eid_expert_out_of_range", route(bias=None, tid2eid=wh.tid2eid + SMALL.n_routed_experts, token_ids=tok),
         ValueError, "tid2eid: rows of these tokens"),
        ("cfg_not_a_config", route(cfg={"dim": 256}), TypeError, "cfg: expected DSv4Config"),
        ("moe_weights_not_moe_weights", lambda: omoe.moe(x, w.w13, token_ids=None, cfg=SMALL, numerics=OFFICIAL),
         TypeError, "weights: expected MoEWeights"),
    ]


@pytest.mark.parametrize(("name", "call", "error", "match"), _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_public_api_rejects_bad_inputs_by_name_before_any_kernel(name: str, call, error: type[Exception],
                                                                 match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        call()


def test_deepgemm_backend_rejects_what_sm90_deepgemm_cannot_run_and_picks_the_layout_by_token_count() -> None:
    from optimized.deepgemm import moe as dg

    for numerics, match in ((OFFICIAL.replace(fp8_format="e4m3fnuz"), "fp8_format 'e4m3fn' only"),
                            (EXACT, "act_quant=True"), (MEGAMOE, "act_block 128"),
                            (OFFICIAL.replace(gate_up_bf16=False), "gate_up_bf16")):
        with pytest.raises(ValueError, match=match):
            dg.check_supported(numerics)
    assert dg._layout(dg.MASKED_MAX_TOKENS, None) == "masked"
    assert dg._layout(dg.MASKED_MAX_TOKENS + 1, None) == "contiguous"
    assert dg._layout(1, "contiguous") == "contiguous"
    with pytest.raises(ValueError, match="layout: expected one of"):
        dg._layout(1, "psum")


# ------------------------------------------------------------------------------------------------
# GPU: the Triton GPU tiles and DeepGEMM's two layouts at FLASH's D and I (fewer experts)
# ------------------------------------------------------------------------------------------------

GPU_CFG = FLASH.replace(n_routed_experts=32)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_backends() -> list[tuple[str, str | None]]:
    return [("triton", None), ("triton", "tiled"), ("deepgemm", "masked"), ("deepgemm", "contiguous")]


def _gpu_layer(backend: str, tokens: int, seed: int) -> tuple[ref.MoEWeights, torch.Tensor]:
    """Random `GPU_CFG` MoE weights and `tokens` bf16 inputs on the GPU (seeds `seed`, `seed + 1`); skips the test
    when `backend` is unavailable."""
    ok, why = backend_status(backend)
    if not ok:
        pytest.skip(f"backend {backend!r} unavailable: {why}")
    w = ref.random_moe_weights(GPU_CFG, GPU_CFG.n_hash_layers, generator=torch.Generator("cuda").manual_seed(seed),
                               device="cuda")
    x = torch.randn(tokens, GPU_CFG.dim, generator=torch.Generator("cuda").manual_seed(seed + 1), device="cuda")
    return w, x.bfloat16()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
@pytest.mark.parametrize(("backend", "layout"), _gpu_backends(), ids=["triton", "triton_tiled_experts",
                                                                       "deepgemm_masked", "deepgemm_contiguous"])
def test_gpu_experts_match_the_reference_are_deterministic_and_confine_nan(tokens: int, backend: str,
                                                                           layout: str | None) -> None:
    device, cfg = "cuda", GPU_CFG
    w, x = _gpu_layer(backend, tokens, seed=0)
    nan_token = tokens // 2
    x[nan_token, 11] = float("nan")
    ids, topk_weights = ref.route(x, w.gate, w.bias, token_ids=None, tid2eid=None, cfg=cfg)
    kw = dict(swiglu_limit=cfg.swiglu_limit, numerics=OFFICIAL)
    if backend == "deepgemm":
        from optimized.deepgemm import moe as dg

        def run() -> torch.Tensor:
            return dg.experts(x, ids, topk_weights, w.w13, w.w2, **kw, layout=layout)
    else:
        # "tiled": the experts in `tile_experts`' layout, which must give the row layout's bits
        w13, w2 = ((omoe.tile_experts(w.w13, "e4m3fn"), omoe.tile_experts(w.w2, "e4m3fn")) if layout == "tiled"
                   else (w.w13, w.w2))

        def run() -> torch.Tensor:
            return omoe.experts(x, ids, topk_weights, w13, w2, **kw, backend=backend)
    cand = run()
    if layout == "tiled":
        rows = omoe.experts(x, ids, topk_weights, w.w13, w.w2, **kw, backend=backend)
        _assert_bitwise(int((rows.view(torch.int16) != cand.view(torch.int16)).sum()), "tiled vs row layout")
    _assert_bitwise(int((run().view(torch.int16) != cand.view(torch.int16)).sum()), "rerun")
    want = ref.experts(x, ids, topk_weights, w.w13, w.w2, **kw)
    others = torch.arange(tokens, device=device) != nan_token
    assert bool(cand[nan_token].isnan().all()) and bool(cand[others].isfinite().all()), "NaN stays in its token"
    _assert_simulated(cand[others], want[others], f"{backend} {layout or ''} T={tokens}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "deepgemm"])
@pytest.mark.parametrize("tokens", [8, 512])
def test_gpu_moe_and_route_match_the_reference(backend: str, tokens: int) -> None:
    cfg = GPU_CFG
    w, x = _gpu_layer(backend, tokens, seed=2)
    ids, weights = omoe.route(x, w.gate, w.bias, token_ids=None, tid2eid=None, cfg=cfg, backend=backend)
    want_ids, want_weights = ref.route(x, w.gate, w.bias, token_ids=None, tid2eid=None, cfg=cfg)
    keys = ref.router_scores(x, w.gate) + w.bias
    agree = route_agreement(want_ids, want_weights, ids, keys, cfg.n_routed_experts)
    unexplained = int(agree.unexplained.sum())
    assert ROUTE_SETS.passes(unexplained), f"{unexplained} expert sets differ beyond near ties ({ROUTE_SETS.reason})"
    same = agree.same
    err = max_abs_error(weights[same].gather(1, ids[same].long().sort(-1).indices),
                        want_weights[same].gather(1, want_ids[same].long().sort(-1).indices))
    assert ROUTE_WEIGHTS.passes(err), f"route weights {err:.3g} ({ROUTE_WEIGHTS.reason})"
    cand = omoe.moe(x, w, token_ids=None, cfg=cfg, numerics=OFFICIAL, backend=backend)
    want = ref.moe(x, w, token_ids=None, cfg=cfg, numerics=OFFICIAL)
    _assert_simulated(cand[same], want[same], f"moe {backend} T={tokens}")


def test_programmatic_dependent_launch_only_where_the_gpu_has_it() -> None:
    """PDL's griddepcontrol instructions are PTX of sm_90+: no PDL in the interpreter, on the CPU, on ROCm or on
    older NVIDIA GPUs (the kernels then compile exactly as without it)."""
    from optimized.backends import detect
    from optimized.triton._pdl import pdl_launch

    hw = detect()
    nvidia_sm90 = hw.device == "cuda" and not hw.interpret and int(hw.arch.removeprefix("sm")) >= 90
    assert pdl_launch() == ({"PDL": True, "launch_pdl": True} if nvidia_sm90 else {"PDL": False})


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "deepgemm"])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_gpu_moe_chain_with_dependent_launches_equals_it_without_them(backend: str, tokens: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chain kernel waits for its predecessor before it reads memory, so the output is the same bit for bit
    with PDL on and off, eagerly and replayed from a CUDA graph (the decode step's mode) where the path can be
    captured (DeepGEMM's contiguous layout reads a row count on the host)."""
    from optimized.backends import host_sync
    from optimized.triton import moe_gemm, moe_permute, moe_routing, quant

    cfg = GPU_CFG
    w, x = _gpu_layer(backend, tokens, seed=4)

    def run() -> torch.Tensor:
        return omoe.moe(x, w, token_ids=None, cfg=cfg, numerics=OFFICIAL, backend=backend)

    with_pdl = run()
    replayed = with_pdl
    if host_sync(run) is None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = run()
        graph.replay()
        torch.cuda.synchronize()
    for module in (moe_gemm, moe_permute, moe_routing, quant):
        monkeypatch.setattr(module, "pdl_launch", lambda: {"PDL": False})
    without = run()
    assert torch.equal(with_pdl.view(torch.int16), without.view(torch.int16))
    assert torch.equal(replayed.view(torch.int16), without.view(torch.int16))
