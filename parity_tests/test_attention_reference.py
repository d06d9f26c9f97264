"""Self-checks of the attention reference (spec §3) and its bad-input contract.

Properties: decode step by step, chunked prefill and a batch's other sequences leave every token's
result bitwise unchanged (for SWA, CSA and HCA layers, with positions crossing 3/4, 31/32 (= 4 x
index_topk at TINY), 127/128 (window full, first HCA entry) and 511/512, and prompts shorter than 4,
32 and 128); the layer attends to exactly the per-position candidate set; sparse attention equals dense
attention when every key is selected; the incremental compressor equals the prefill compressor and the
per-entry definition; the 584-byte KV layout round-trips; bad inputs raise before any computation.
"""

from __future__ import annotations

import copy
from itertools import pairwise

import pytest
import torch

from parity_tests.cases import FP8_FORMATS, generator
from parity_tests.metrics import calc_diff
from parity_tests.tolerances import ATTENTION_UNROUNDED_P
from reference.attention import (
    Attention,
    AttentionWeights,
    candidate_indices,
    project_kv,
    project_q,
    random_attention_weights,
    sparse_attention,
)
from reference.cache import KV_PACKED_BYTES, AttentionCache, pack_kv, unpack_kv
from reference.compressor import (
    CompressorState,
    compress,
    compress_chunk,
    compress_step,
    compressor_projections,
    finish_entries,
    pool,
    random_compressor_weights,
)
from reference.config import FLASH, TINY
from reference.einsum import output_projection
from reference.formats import fp8_format, quant_dequant_fp8, ue8m0_to_fp32
from reference.hadamard import hadamard_rotate, sylvester_hadamard
from reference.indexer import indexer_q, indexer_scores, indexer_topk
from reference.invariant import einsum_fp32
from reference.numerics import EXACT, OFFICIAL, VLLM_NVIDIA
from reference.rope import yarn_frequencies

CFG = TINY
LAYERS = {"swa": 0, "csa": 1, "hca": 2}  # TINY's layer kinds
BF16 = torch.bfloat16

# The batch every module test runs: final lengths, and the prompts the decode test starts from (each
# then takes DECODE_STEPS tokens). Decoded positions cross 511/512 (ring wraps, HCA entry 3, CSA entry
# 127), 127/128 (window full, HCA entry 0), 31/32 (CSA n_c reaches index_topk = 8), 3/4 (CSA entry 0),
# and one sequence decodes from an empty cache. Prompts are shorter than 4, 32 and 128.
DECODE_STEPS = 6
PROMPTS = (509, 125, 29, 2, 0)
LENGTHS = tuple(n + DECODE_STEPS for n in PROMPTS)


def _cu(lengths: list[int] | tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _flat(per_sequence: list[torch.Tensor], starts: list[int], ends: list[int]) -> torch.Tensor:
    """Concatenate the [starts[b], ends[b]) token slices of every sequence."""
    return torch.cat([t[s:e] for t, s, e in zip(per_sequence, starts, ends)])


class Batch:
    """One layer with random weights, the tokens of every sequence, the prefill of all of them, and the
    cache after prefilling only the prompts (tests continue from a copy of it)."""

    def __init__(self, kind: str, numerics=OFFICIAL):
        layer = LAYERS[kind]
        g = generator(100 + layer)
        self.attn = Attention(CFG, layer, random_attention_weights(CFG, layer, generator=g), numerics)
        self.x = [torch.randn(n, CFG.dim, generator=g).to(BF16) for n in LENGTHS]
        self.positions = [torch.arange(n) for n in LENGTHS]
        self.o = self.attn.attend(torch.cat(self.x), torch.cat(self.positions), _cu(LENGTHS))
        self._prompt_cache = AttentionCache.empty(CFG, layer, len(LENGTHS))
        self.o_prompts, _ = self.run([0] * len(LENGTHS), list(PROMPTS), self._prompt_cache)

    def prompt_cache(self) -> AttentionCache:
        return copy.deepcopy(self._prompt_cache)

    def rows(self, starts: list[int], ends: list[int]) -> torch.Tensor:
        """Rows of the prefill output for token slices [starts[b], ends[b]) of each sequence."""
        offsets = _cu(LENGTHS).tolist()
        return torch.cat([self.o[offsets[b] + s: offsets[b] + e] for b, (s, e) in enumerate(zip(starts, ends))])

    def inputs(self, starts: list[int], ends: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, positions, cu_seqlens of one call over token slices [starts[b], ends[b])."""
        x, positions = _flat(self.x, starts, ends), _flat(self.positions, starts, ends)
        return x, positions, _cu([e - s for s, e in zip(starts, ends)])

    def run(self, starts: list[int], ends: list[int], cache: AttentionCache) -> tuple[torch.Tensor, torch.Tensor]:
        """attend() over token slices [starts[b], ends[b]); returns the output and the positions."""
        x, positions, cu = self.inputs(starts, ends)
        return self.attn.attend(x, positions, cu, cache), positions


_BATCHES: dict[str, Batch] = {}


@pytest.fixture(params=list(LAYERS))
def batch(request: pytest.FixtureRequest) -> Batch:
    if request.param not in _BATCHES:
        _BATCHES[request.param] = Batch(request.param)
    return _BATCHES[request.param]


# ------------------------------------------------------------------------------------------------
# The module: decode, chunked prefill, batching, candidate sets
# ------------------------------------------------------------------------------------------------


def test_prefill_of_the_prompts_equals_the_prefill_of_the_whole_sequences(batch: Batch) -> None:
    assert torch.equal(batch.o_prompts, batch.rows([0] * len(LENGTHS), list(PROMPTS)))


def test_decode_step_by_step_equals_prefill(batch: Batch) -> None:
    cache = batch.prompt_cache()
    for step in range(DECODE_STEPS - 1):
        starts = [p + step for p in PROMPTS]
        ends = [s + 1 for s in starts]
        o, positions = batch.run(starts, ends, cache)
        assert torch.equal(o, batch.rows(starts, ends)), f"decode step {step} (positions {positions.tolist()})"
    # The last step through forward(): the output projection (a per-token function, applied here with the
    # decode call's batch shape) of rows equal to the prefill's.
    starts, ends = list(LENGTHS[b] - 1 for b in range(len(LENGTHS))), list(LENGTHS)
    x, positions, cu = batch.inputs(starts, ends)
    y = batch.attn(x, positions, cu, cache)
    w = batch.attn.weights
    expect = output_projection(batch.rows(starts, ends), positions, batch.attn.freqs, w.wo_a, w.wo_b,
                               batch.attn.numerics)
    assert y.dtype == BF16 and torch.equal(y, expect)
    assert [s.next_position for s in cache.sequences] == list(LENGTHS)


def test_chunked_prefill_equals_prefill(batch: Batch) -> None:
    # After the prompts (chunk 1: 509, 125, 29, 2, 0 tokens), two chunks of 3 tokens per sequence: chunk
    # boundaries at 512 and 128 (block ends), 32 and 5 (inside blocks), 0 (an empty first chunk).
    cache = batch.prompt_cache()
    for c in range(2):
        starts = [p + 3 * c for p in PROMPTS]
        ends = [s + 3 for s in starts]
        o, _ = batch.run(starts, ends, cache)
        assert torch.equal(o, batch.rows(starts, ends)), f"chunk {c + 2}"


def test_a_sequence_alone_equals_it_inside_a_batch(batch: Batch) -> None:
    b = 1  # crosses 127/128
    alone = batch.attn.attend(batch.x[b], batch.positions[b], _cu([LENGTHS[b]]))
    starts, ends = [0] * len(LENGTHS), [0] * len(LENGTHS)
    ends[b] = LENGTHS[b]
    assert torch.equal(alone, batch.rows(starts, ends))


def test_prefill_attends_to_the_per_position_candidate_set(batch: Batch) -> None:
    """Indices built by a per-token loop straight from the definition (spec §3.5) give the same output."""
    attn, b = batch.attn, 2  # 35 tokens: crosses 3/4 and 31/32
    x, positions, n = batch.x[b], batch.positions[b], LENGTHS[b]
    q, kv_pool, indices = attn.attention_inputs(x, positions, _cu([n]))
    w, numerics, freqs = attn.weights, attn.numerics, attn.freqs
    rows = project_kv(x, w, CFG, positions, freqs, numerics)  # the window rows of the sequence
    entries = torch.zeros(0, CFG.head_dim, dtype=BF16)
    if attn.ratio:
        entries = compress(x, positions, w.compressor, ratio=attn.ratio, head_dim=CFG.head_dim, freqs=freqs,
                           numerics=numerics, rotate="main")
    if attn.kind == "csa":
        keys = compress(x, positions, w.indexer.compressor, ratio=4, head_dim=CFG.index_head_dim, freqs=freqs,
                        numerics=numerics, rotate="indexer")
        _, c_q = project_q(x, w, CFG, positions, freqs, numerics)
        q_idx, head_weights = indexer_q(c_q, x, w.indexer, positions, freqs, numerics)
        scores = indexer_scores(q_idx, keys, head_weights, numerics)
    pool = torch.cat((rows, entries))
    direct = torch.full((n, n + entries.shape[0]), -1, dtype=torch.int32)
    for t in range(n):
        p = int(positions[t])
        window = list(range(max(0, p - CFG.window_size + 1), p + 1))
        visible = (p + 1) // attn.ratio if attn.ratio else 0
        if attn.kind == "csa":
            top = torch.sort(scores[t, :visible], descending=True, stable=True).indices[: CFG.index_topk]
            chosen = top.tolist()
        else:
            chosen = list(range(visible))
        ids = window + [n + j for j in chosen]
        direct[t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    expect = sparse_attention(q, pool, direct, w.attn_sink, attn.softmax_scale)
    assert torch.equal(sparse_attention(q, kv_pool, indices, w.attn_sink, attn.softmax_scale), expect)
    assert torch.equal(attn.attend(x, positions, _cu([n])), expect)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: FLASH shapes")
@pytest.mark.parametrize("layer", [0, 2, 3], ids=["swa", "csa", "hca"])  # FLASH's layer kinds
def test_decode_equals_prefill_at_flash_shapes_on_gpu(layer: int) -> None:
    """The reference at real shapes on the GPU: two sequences (2100 > 4 x index_topk, so the CSA
    selection is a real top-k of 512, and 300), prompts then two decode steps, bitwise."""
    cfg, device, g = FLASH, torch.device("cuda"), generator(layer)
    attn = Attention(cfg, layer, random_attention_weights(cfg, layer, generator=g, device=device))
    lengths, steps = (2100, 300), 2
    x = torch.randn(sum(lengths), cfg.dim, generator=g).to(BF16).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    full = attn.attend(x, positions, _cu(lengths).to(device))
    assert full.isfinite().all()
    offsets = _cu(lengths).tolist()
    cache = AttentionCache.empty(cfg, layer, len(lengths), device)
    for s in range(steps + 1):
        # step 0: the prompts (all but the last `steps` tokens); then one token per sequence
        ranges = [(0, n - steps) if s == 0 else (n - steps + s - 1, n - steps + s) for n in lengths]
        rows = torch.cat([torch.arange(offsets[b] + a, offsets[b] + e) for b, (a, e) in enumerate(ranges)]).to(device)
        cu = _cu([e - a for a, e in ranges]).to(device)
        o = attn.attend(x[rows], positions[rows], cu, cache)
        assert torch.equal(o, full[rows]), f"call {s}"


@pytest.mark.parametrize("numerics", [VLLM_NVIDIA, EXACT], ids=lambda n: n.name)
def test_chunked_csa_equals_prefill_under_other_numerics(numerics) -> None:
    layer = LAYERS["csa"]
    g = generator(7)
    attn = Attention(CFG, layer, random_attention_weights(CFG, layer, generator=g), numerics)
    x = torch.randn(70, CFG.dim, generator=g).to(BF16)
    positions = torch.arange(70)
    full = attn.attend(x, positions, _cu([70]))
    cache = AttentionCache.empty(CFG, layer, 1)
    parts = [attn.attend(x[s:e], positions[s:e], _cu([e - s]), cache) for s, e in ((0, 33), (33, 34), (34, 70))]
    assert torch.equal(torch.cat(parts), full)


def test_candidate_indices_lay_out_window_then_selected_entries() -> None:
    rows = [torch.randn(5, 512).to(BF16), torch.randn(3, 512).to(BF16)]
    entries = [torch.randn(2, 512).to(BF16), torch.randn(1, 512).to(BF16)]
    positions = torch.tensor([3, 4, 0, 1, 2])  # sequence 0: window rows of positions 0..4; sequence 1: 0..2
    selection = torch.tensor([[1, -1], [0, 1], [-1, -1], [-1, -1], [0, -1]], dtype=torch.int32)
    kv, idx = candidate_indices(rows, [0, 0], entries, selection, positions, _cu([2, 3]), window_size=3)
    assert torch.equal(kv, torch.cat((rows[0], entries[0], rows[1], entries[1])))
    assert idx.tolist() == [
        [1, 2, 3, 6, -1],    # positions 1..3, entry 1 (pool row 5 + 1)
        [2, 3, 4, 5, 6],     # positions 2..4, entries 0 and 1
        [-1, -1, 7, -1, -1],  # sequence 1 starts at pool row 7
        [-1, 7, 8, -1, -1],
        [7, 8, 9, 10, -1],   # entry 0 of sequence 1 is pool row 7 + 3
    ]


# ------------------------------------------------------------------------------------------------
# Sparse attention
# ------------------------------------------------------------------------------------------------


def _attention_inputs(t: int, h: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = generator(seed)
    q = torch.randn(t, h, 512, generator=g).to(BF16)
    kv = torch.randn(n, 512, generator=g).to(BF16)
    sink = torch.randn(h, generator=g) + 2  # a visible share of the denominator
    return q, kv, sink


def _dense_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Every key for every token, written as matrices (no gather, no index lists), same numerics."""
    logits = einsum_fp32("thd,nd->thn", q, kv) * scale
    m = logits.amax(dim=-1, keepdim=True)
    e = torch.exp(logits - m)
    denominator = e.double().sum(-1, keepdim=True).float() + torch.exp(sink[None, :, None] - m)
    return (einsum_fp32("thn,nd->thd", e.to(BF16), kv) / denominator).to(BF16)


def test_sparse_attention_equals_dense_attention_when_every_key_is_selected() -> None:
    q, kv, sink = _attention_inputs(6, 4, 40, seed=1)
    scale = 512**-0.5
    g = generator(2)
    # every key once per token, in a different order per token, with empty slots mixed in
    indices = torch.full((6, 50), -1, dtype=torch.int32)
    for t in range(6):
        slots = torch.randperm(50, generator=g)[:40]
        indices[t, slots] = torch.randperm(40, generator=g).to(torch.int32)
    sparse = sparse_attention(q, kv, indices, sink, scale)
    assert torch.equal(sparse, _dense_attention(q, kv, sink, scale))
    # and it is the softmax with the sink as one more logit (probabilities unrounded, fp32)
    logits = torch.cat((torch.einsum("thd,nd->thn", q.float(), kv.float()) * scale,
                        sink[None, :, None].expand(6, 4, 1)), dim=-1)
    plain = torch.einsum("thn,nd->thd", torch.softmax(logits, dim=-1)[..., :-1], kv.float())
    assert ATTENTION_UNROUNDED_P.passes(calc_diff(sparse, plain))


def test_sparse_attention_rows_without_candidates_are_zero() -> None:
    q, kv, sink = _attention_inputs(3, 4, 8, seed=3)
    kv[5] = float("nan")  # never selected: must not leak
    indices = torch.tensor([[-1, -1, -1], [0, 1, -1], [-1, -1, -1]], dtype=torch.int32)
    for s in (sink, torch.full_like(sink, float("-inf"))):  # -inf: vLLM's padded heads
        o = sparse_attention(q, kv, indices, s, 512**-0.5)
        assert not o.isnan().any()
        assert torch.equal(o[[0, 2]], torch.zeros_like(o[[0, 2]]))
        assert o[1].abs().sum() > 0


def test_sparse_attention_does_not_read_rows_it_did_not_select() -> None:
    q, kv, sink = _attention_inputs(2, 4, 8, seed=4)
    indices = torch.tensor([[2, -1, 6], [-1, 3, 1]], dtype=torch.int32)
    o = sparse_attention(q, kv, indices, sink, 512**-0.5)
    poisoned = kv.clone()
    poisoned[[0, 4, 5, 7]] = float("nan")
    assert torch.equal(sparse_attention(q, poisoned, indices, sink, 512**-0.5), o)


def test_sparse_attention_sink_is_one_more_unscaled_logit_in_the_denominator() -> None:
    # One key with small-integer q and k, so z = scale * q.k is exact: o = bf16(1) k / (1 + e^{sink - z}).
    g = generator(5)
    q = torch.randint(-2, 3, (1, 2, 512), generator=g).to(BF16)
    kv = torch.randint(-2, 3, (1, 512), generator=g).to(BF16)
    idx, scale = torch.zeros(1, 1, dtype=torch.int32), 0.125
    z = float((q[0, 0].double() @ kv[0].double()) * scale)
    assert torch.equal(sparse_attention(q, kv, idx, torch.full((2,), float("-inf")), scale)[0], kv.expand(2, 512))
    half = sparse_attention(q, kv, idx, torch.tensor([z, z]), scale)[0, 0]  # the sink as large as the logit
    assert torch.equal(half, (kv[0].float() / 2).to(BF16))


# ------------------------------------------------------------------------------------------------
# Compressor
# ------------------------------------------------------------------------------------------------

COMPRESSORS = [(4, 512, "main"), (128, 512, "main"), (4, 128, "indexer")]


def _compressor(ratio: int, head_dim: int, seed: int):
    g = generator(seed)
    return random_compressor_weights(CFG.dim, ratio, head_dim, generator=g), yarn_frequencies(CFG, ratio), g


@pytest.mark.parametrize(("ratio", "head_dim", "rotate"), COMPRESSORS)
def test_incremental_compressor_equals_prefill_compressor(ratio: int, head_dim: int, rotate: str) -> None:
    w, freqs, g = _compressor(ratio, head_dim, seed=ratio + head_dim)
    n = 2 * ratio + 3 if ratio == 128 else 23
    x, positions = torch.randn(n, CFG.dim, generator=g).to(BF16), torch.arange(n)
    kw = dict(freqs=freqs, numerics=OFFICIAL, rotate=rotate)
    prefill = compress(x, positions, w, ratio=ratio, head_dim=head_dim, **kw)
    assert prefill.shape == (n // ratio, head_dim)
    # token by token (for ratio 128: around the block ends, the rest in chunks)
    state = CompressorState.empty(ratio, head_dim)
    stepped = set(range(n)) if ratio == 4 else {p for p in range(n) if p % ratio in (0, 1, ratio - 2, ratio - 1)}
    entries, p = [], 0
    while p < n:
        if p in stepped:
            entry = compress_step(x[p], p, state, w, **kw)
            assert (entry is not None) == ((p + 1) % ratio == 0), f"position {p}"
            entries += [] if entry is None else [entry[None]]
            p += 1
        else:
            end = min(q for q in [*stepped, n] if q > p)
            entries.append(compress_chunk(x[p:end], positions[p:end], state, w, **kw))
            p = end
    assert torch.equal(torch.cat(entries), prefill)
    # and in uneven chunks
    state = CompressorState.empty(ratio, head_dim)
    cuts = [0, 1, ratio - 1, ratio + 2, n]
    chunks = [compress_chunk(x[s:e], positions[s:e], state, w, **kw) for s, e in pairwise(cuts)]
    assert torch.equal(torch.cat(chunks), prefill)
    assert state.next_position == n


@pytest.mark.parametrize(("ratio", "head_dim", "rotate"), COMPRESSORS[:2])
def test_compressor_matches_the_per_entry_definition(ratio: int, head_dim: int, rotate: str) -> None:
    """Slots built entry by entry from spec §3.3: block j (and for ratio 4 block j-1's other half)."""
    w, freqs, g = _compressor(ratio, head_dim, seed=3 * ratio)
    n = 2 * ratio + 1 if ratio == 128 else 14
    x, positions = torch.randn(n, CFG.dim, generator=g).to(BF16), torch.arange(n)
    a, b = compressor_projections(x, positions, w)
    d, entries = head_dim, []
    for j in range(n // ratio):
        block = slice(j * ratio, (j + 1) * ratio)
        if ratio == 4:
            prev = slice((j - 1) * ratio, j * ratio)
            prev_a = a[prev, :d] if j else torch.zeros(ratio, d)
            prev_b = b[prev, :d] if j else torch.full((ratio, d), float("-inf"))
            slots_a, slots_b = torch.cat((prev_a, a[block, d:])), torch.cat((prev_b, b[block, d:]))
        else:
            slots_a, slots_b = a[block], b[block]
        entries.append(pool(slots_a[None], slots_b[None])[0])
    u = torch.stack(entries)
    expect = finish_entries(u, torch.arange(len(entries)), w, freqs=freqs, numerics=OFFICIAL, rotate=rotate,
                            norm_eps=CFG.norm_eps)
    got = compress(x, positions, w, ratio=ratio, head_dim=head_dim, freqs=freqs, numerics=OFFICIAL, rotate=rotate)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("slots", [8, 128])
def test_pooling_is_a_softmax_over_the_slots_of_each_channel(slots: int) -> None:
    g = generator(slots)
    kv = torch.randn(2, slots, 64, generator=g)
    # equal scores: every slot weighs exactly 1 / slots (a power of two), so u is the exact mean
    assert torch.equal(pool(kv, torch.zeros_like(kv)), (kv.double().sum(1) / slots).float())
    # channel c sees only slot c mod slots: u[c] is that slot's value
    channel = torch.arange(64)
    only = torch.full_like(kv, float("-inf"))
    only[:, channel % slots, channel] = 0.0
    assert torch.equal(pool(kv, only), kv[:, channel % slots, channel])


# ------------------------------------------------------------------------------------------------
# Indexer and Hadamard
# ------------------------------------------------------------------------------------------------


def test_indexer_topk_takes_visible_entries_lower_index_first_on_ties() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 9.0, 9.0],
                           [5.0, 5.0, 5.0, 5.0, 5.0, 5.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    n_visible = torch.tensor([4, 6, 1])
    top = indexer_topk(scores, n_visible, topk=3)
    assert top.dtype == torch.int32
    assert top.tolist() == [[1, 2, 3], [0, 1, 2], [0, -1, -1]]
    # more (invisible) entries or a larger topk do not change a token's selection
    wider = torch.cat((scores, torch.full((3, 4), 99.0)), dim=1)
    assert torch.equal(indexer_topk(wider, n_visible, topk=3), top)
    assert indexer_topk(scores, n_visible, topk=8)[:, :3].tolist() == [[1, 2, 3], [0, 1, 2], [0, -1, -1]]
    assert (indexer_topk(scores, n_visible, topk=8)[0, 4:] == -1).all()


@pytest.mark.parametrize("numerics", [OFFICIAL, VLLM_NVIDIA], ids=lambda n: n.name)
def test_indexer_scores_are_head_weighted_relu_dot_products(numerics) -> None:
    # small integers and power-of-two weights: every step is exact, so any order gives the formula
    g = generator(11)
    q = torch.randint(-3, 4, (5, 4, 128), generator=g).to(BF16)
    k = torch.randint(-3, 4, (7, 128), generator=g).to(BF16)
    w = torch.tensor([0.5, 0.25, 0.0, 2.0]).expand(5, 4).contiguous()
    expect = (torch.einsum("thd,nd->thn", q.double(), k.double()).relu() * w[..., None].double()).sum(1)
    assert torch.equal(indexer_scores(q, k, w, numerics), expect.float().to(BF16).float()
                       if numerics.indexer_scores_bf16 else expect.float())


def test_hadamard_is_the_sylvester_matrix_and_orthonormal() -> None:
    h = torch.ones(1, 1)
    while h.shape[0] < 128:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    assert torch.equal(sylvester_hadamard(128), h)
    assert torch.equal(h @ h, 128 * torch.eye(128))
    scale = torch.tensor(128**-0.5, dtype=torch.float32)
    one_hot = torch.eye(128)[:3].to(BF16)
    assert torch.equal(hadamard_rotate(one_hot), (h[:3] * scale).to(BF16))
    assert torch.equal(hadamard_rotate(h[:3].to(BF16)), (128 * torch.eye(128)[:3] * scale).to(BF16))


# ------------------------------------------------------------------------------------------------
# 584-byte KV layout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_pack_then_unpack_of_quantized_kv_rows_is_bitwise_identity(fmt: str) -> None:
    g = generator(21)
    kv = (torch.randn(9, 512, generator=g) * torch.logspace(-6, 3, 9)[:, None]).to(BF16)
    kv[3] = 0  # an all-zero row takes the amax floor
    kv = torch.cat((quant_dequant_fp8(kv[:, :448], 64, fmt), kv[:, 448:]), dim=1)
    packed = pack_kv(kv, fmt)
    assert packed.shape == (9, KV_PACKED_BYTES) and packed.dtype == torch.uint8
    assert torch.equal(unpack_kv(packed, fmt), kv)


def test_packed_kv_byte_layout() -> None:
    g = generator(22)
    kv = torch.randn(4, 512, generator=g).to(BF16)
    packed = pack_kv(kv)
    nope = packed[:, :448].contiguous().view(fp8_format("e4m3fn").dtype).float()
    scales = ue8m0_to_fp32(packed[:, 576:583].contiguous())  # 2^(byte - 127)
    assert torch.equal((nope.view(4, 7, 64) * scales[..., None]).view(4, 448).to(BF16),
                       quant_dequant_fp8(kv[:, :448], 64))
    assert torch.equal(packed[:, 448:576].contiguous().view(BF16), kv[:, 448:])  # RoPE dims, bf16 bytes
    assert (packed[:, 583] == 0).all()


# ------------------------------------------------------------------------------------------------
# Bad inputs: a clear error naming the argument, before anything is computed
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hca() -> Attention:
    layer = LAYERS["hca"]
    return Attention(CFG, layer, random_attention_weights(CFG, layer, generator=generator(0)))


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(n, CFG.dim, generator=generator(1)).to(BF16), torch.arange(n), _cu([n])


def test_bad_positions_raise(hca: Attention) -> None:
    x, positions, cu = _tokens(6)
    with pytest.raises(ValueError, match="positions"):
        hca(x, torch.tensor([0, 1, 2, 2, 3, 4]), cu)  # not increasing
    with pytest.raises(ValueError, match="positions"):
        hca(x, torch.tensor([0, 1, 2, 4, 5, 6]), cu)  # a gap
    with pytest.raises(ValueError, match="positions"):
        hca(x, positions + 3, cu)  # a prompt must start at 0 without a cache
    with pytest.raises(TypeError, match="positions"):
        hca(x, positions.int(), cu)
    with pytest.raises(ValueError, match="positions"):
        hca(x, positions[:5], cu)
    # two sequences: positions restart at the boundary, but not inside a sequence
    hca(x, torch.tensor([0, 1, 2, 0, 1, 2]), _cu([3, 3]))
    with pytest.raises(ValueError, match="positions"):
        hca(x, torch.tensor([0, 1, 2, 0, 1, 2]), _cu([2, 4]))


def test_cu_seqlens_inconsistent_with_tokens_raise(hca: Attention) -> None:
    x, positions, _ = _tokens(6)
    for bad in ([0, 5], [1, 6], [0, 4, 2, 6], [0]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            hca(x, positions, torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens"):
        hca(x, positions, torch.tensor([0, 6]))
    with pytest.raises(TypeError, match="x"):
        hca(x.float(), positions, _cu([6]))


def test_wrong_cache_raises(hca: Attention) -> None:
    x, positions, cu = _tokens(6)
    with pytest.raises(ValueError, match="cache: belongs to layer 1"):
        hca(x, positions, cu, AttentionCache.empty(CFG, LAYERS["csa"], 1))
    with pytest.raises(ValueError, match="cache: holds 2 sequences"):
        hca(x, positions, cu, AttentionCache.empty(CFG, LAYERS["hca"], 2))
    cache = AttentionCache.empty(CFG, LAYERS["hca"], 1)
    cache.sequences[0].window = cache.sequences[0].window[:64]
    with pytest.raises(ValueError, match=r"cache.sequences\[0\].window"):
        hca(x, positions, cu, cache)
    cache = AttentionCache.empty(CFG, LAYERS["hca"], 1)
    hca(x, positions, cu, cache)
    with pytest.raises(ValueError, match="continues at 6"):
        hca(x[:1], torch.tensor([7]), _cu([1]), cache)
    with pytest.raises(TypeError, match="cache"):
        hca(x, positions, cu, cache=[cache])


def test_weights_of_another_layer_kind_raise() -> None:
    hca_weights = random_attention_weights(CFG, LAYERS["hca"], generator=generator(0))
    with pytest.raises(ValueError, match=r"weights\.compressor: expected ratio 4"):
        Attention(CFG, LAYERS["csa"], hca_weights)
    with pytest.raises(ValueError, match=r"weights\.compressor: a swa layer needs none"):
        Attention(CFG, LAYERS["swa"], hca_weights)
    csa_weights = random_attention_weights(CFG, LAYERS["csa"], generator=generator(0))
    with pytest.raises(ValueError, match=r"weights\.indexer: a csa layer needs one"):
        Attention(CFG, LAYERS["csa"], AttentionWeights(**{**csa_weights.__dict__, "indexer": None}))
    with pytest.raises(ValueError, match=r"weights\.wq_b"):
        Attention(CFG, LAYERS["csa"], AttentionWeights(**{**csa_weights.__dict__, "wq_b": csa_weights.wq_a}))


def test_bad_sparse_attention_inputs_raise() -> None:
    q, kv, sink = _attention_inputs(2, 4, 8, seed=0)
    ok = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)
    sparse_attention(q, kv, ok, sink, 0.1)
    for bad, message in (([[0, 8, -1], [2, 3, 4]], "indices: expected values in -1..7"),
                         ([[0, -2, -1], [2, 3, 4]], "indices: expected values in -1..7"),
                         ([[0, 1, -1], [2, 3, 3]], "row 1 selects a kv row twice")):
        with pytest.raises(ValueError, match=message):
            sparse_attention(q, kv, torch.tensor(bad, dtype=torch.int32), sink, 0.1)
    with pytest.raises(ValueError, match="indices"):
        sparse_attention(q, kv, ok.long(), sink, 0.1)
    with pytest.raises(ValueError, match="sink"):
        sparse_attention(q, kv, ok, sink[:3], 0.1)
    with pytest.raises(ValueError, match="q"):
        sparse_attention(q.float(), kv, ok, sink, 0.1)
    with pytest.raises(ValueError, match="kv"):
        sparse_attention(q, kv[:, :448], ok, sink, 0.1)


def test_bad_compressor_and_indexer_inputs_raise() -> None:
    w, freqs, g = _compressor(4, 512, seed=0)
    x = torch.randn(8, CFG.dim, generator=g).to(BF16)
    kw = dict(freqs=freqs, numerics=OFFICIAL, rotate="main")
    with pytest.raises(ValueError, match="positions"):
        compress(x, torch.arange(1, 9), w, ratio=4, head_dim=512, **kw)
    with pytest.raises(ValueError, match="weights"):
        compress(x, torch.arange(8), w, ratio=128, head_dim=512, **kw)
    with pytest.raises(ValueError, match=r"state\.kv"):
        compress_step(x[0], 0, CompressorState.empty(128, 512), w, **kw)
    with pytest.raises(ValueError, match="n_visible"):
        indexer_topk(torch.zeros(2, 3), torch.tensor([1, 4]), topk=2)
    with pytest.raises(ValueError, match="packed"):
        unpack_kv(torch.zeros(2, 576, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kv"):
        pack_kv(torch.zeros(2, 512))
