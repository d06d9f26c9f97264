"""Sweep of the Triton launch configurations of the output-projection path (issue #2's speed targets).

    python -m benchmarks.sweep_einsum --out DIR            # GPU: FLASH, ~80 s including Triton JIT
    python -m benchmarks.sweep_einsum --out DIR --smoke    # CPU (TRITON_INTERPRET=1): TINY, proves the code paths

Times, at FLASH shapes, every candidate `EinsumConfig` of `optimized.triton.einsum` (BLOCK_M / BLOCK_N / BLOCK_K,
warps, stages, split-K) at b in {1, 8, 128, 4096}, and every candidate `QuantConfig` of
`optimized.triton.quant.quantize_attn_output` (rows of 128 channels per program, warps) at T in {1, 128, 4096},
plus DeepGEMM's raw `fp8_einsum` and the two quant+einsum pipelines (deepgemm, triton) with the default configs.
Writes `DIR/sweep_einsum.json` (every result, the best config per point, and the `TILE_TABLE` / `QUANT_TABLE` rows
to paste) and prints a table.

How it times: each candidate is captured in a CUDA graph of `CALLS` back-to-back calls; the graph is replayed
`REPLAYS` times, each replay bracketed by CUDA events; the figure is the median replay time / `CALLS`. Host
overhead is therefore not in these figures (this sweep ranks kernels; `python -m benchmarks` measures the
eager calls). The L2 is not flushed between calls: instead the calls of one graph rotate over enough copies of
the operands (>= `ROTATE_BYTES` in all, 3x the H200's 50 MB L2) that the weights stream from HBM as they do
in a model, where other layers' weights evict them. Back-to-back calls overlap a kernel's tail with the next
one's start, so the figures are slightly optimistic against the L2-flushed `python -m benchmarks` ones; they
are meant for ranking configs against each other.

The einsum candidates read DeepGEMM's MN-major activation scales (`scale_layout="deepgemm"`, the layout the
deepgemm pipeline writes); the Triton backend's own path in `python -m benchmarks` reads row-major scales, so a
config's gain here can be smaller there (2026-12-03: the prefill tile 542 -> 383 us here, 400 -> 392 us there).

Every candidate's output is checked before it is timed: the einsum against the fp32 einsum of the same
quantized operands (`FP8_GEMM_SIMULATED`), the quantization bitwise against the reference. A candidate that
fails to compile, to run or to match is reported with its error and never chosen.

JIT: the candidates are first compiled by `--workers` parallel processes (each runs its share once, nothing
timed), so that this process finds them in Triton's (and DeepGEMM's) on-disk caches.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.sweeping import (
    CALLS,
    REPLAYS,
    device_and_config,
    drive,
    error_text,
    parser,
    time_graph,
    write_report,
)

ROTATE_BYTES = 150 * 2**20
EINSUM_TOKENS = (1, 8, 128, 4096)
QUANT_TOKENS = (1, 128, 4096)
SMOKE_TOKENS = (1, 5)
DEFAULT_BUDGET_S = 85.0
EXPR = "bhr,hdr->bhd"
# Host overhead: eager public calls at T = 1 (GPU time a few us), back to back, wall clock per call.
HOST_OPS = ("fp8_einsum", "quantize_attn_output", "fp8_linear", "output_projection", "triton_einsum_launch",
            "triton_quant_launch")
HOST_BACKENDS = ("triton", "deepgemm")
HOST_CALLS = 200


@dataclasses.dataclass(frozen=True)
class Job:
    """One thing to time: `kind` is "einsum", "quant", "deepgemm" (raw einsum) or "pipeline"."""

    kind: str
    tokens: int
    config: Any = None  # EinsumConfig / QuantConfig / pipeline backend name

    @property
    def label(self) -> str:
        if self.config is None:
            return "default"
        if isinstance(self.config, str):
            return self.config
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self.config).items())


# ------------------------------------------------------------------------------------------------
# Candidates
# ------------------------------------------------------------------------------------------------


def einsum_candidates(b: int) -> list[Any]:
    """EinsumConfigs tried at token count b (FLASH: h = 8, r = 4096, d = 1024)."""
    from optimized.triton.einsum import EinsumConfig as C

    if b <= 16:  # weight streaming: BLOCK_M 16, more programs through split-K
        tiles = [C(16, bn, 1, 4, 4, bk) for bn in (32, 64, 128) for bk in (64, 128)]
        return ([dataclasses.replace(t, split_k=s) for t in tiles for s in (2, 4, 8)]
                + [C(16, 64, 4, 4, st) for st in (3, 6)] + [C(16, 32, 1, 4, 4), C(16, 64, 1, 4, 4)])
    if b <= 256:
        tiles = [C(64, 32, 1, 4, 4), C(64, 64, 1, 4, 4), C(64, 128, 1, 4, 4), C(128, 32, 1, 4, 4),
                 C(128, 64, 1, 4, 4), C(128, 64, 1, 8, 3), C(128, 128, 1, 8, 3)]
        return [dataclasses.replace(t, split_k=s) for t in tiles for s in (1, 2, 4)]
    # compute-bound: 128 x 128 with 8 warps (larger tiles or 4 warps spill: two fp32 accumulators)
    return [C(128, 128, 1, 8, 3), C(128, 128, 1, 8, 4), C(128, 128, 1, 8, 5), C(128, 128, 1, 8, 4, 64),
            C(128, 128, 1, 8, 6, 64), C(128, 64, 1, 8, 4), C(128, 64, 1, 4, 4), C(64, 128, 1, 4, 4)]


def quant_candidates() -> list[Any]:
    from optimized.triton.quant import QuantConfig as Q

    return [Q(rows, warps) for rows in (4, 8, 16, 32, 64, 128) for warps in (1, 2, 4, 8)
            if 2 <= rows * 128 // (32 * warps) <= 64]  # 2..64 elements per thread


def all_jobs(smoke: bool) -> list[Job]:
    jobs: list[Job] = []
    einsum_tokens, quant_tokens = (SMOKE_TOKENS, SMOKE_TOKENS) if smoke else (EINSUM_TOKENS, QUANT_TOKENS)
    for b in einsum_tokens:
        cands = einsum_candidates(b)
        jobs += [Job("einsum", b, None)] + [Job("einsum", b, c) for c in (cands[:2] if smoke else cands)]
    for t in quant_tokens:
        cands = quant_candidates()
        jobs += [Job("quant", t, None)] + [Job("quant", t, c) for c in (cands[:2] if smoke else cands)]
    if not smoke:
        jobs += [Job("deepgemm", b) for b in EINSUM_TOKENS]
        jobs += [Job("pipeline", b, backend) for b in EINSUM_TOKENS for backend in ("deepgemm", "triton")]
    jobs += [Job("host", 1, f"{op}/{backend}") for op in HOST_OPS for backend in HOST_BACKENDS
             if not (smoke and backend == "deepgemm")]
    return jobs


# ------------------------------------------------------------------------------------------------
# Inputs and calls
# ------------------------------------------------------------------------------------------------


class Inputs:
    """Operands of one config, built once per token count on `device` (and rotated copies of them)."""

    def __init__(self, config: str, device: str) -> None:
        from reference.config import get_config
        from reference.formats import quantize_per_block
        from reference.rope import yarn_frequencies

        self.cfg = get_config(config)
        self.device = device
        cfg = self.cfg
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(cfg.o_groups * cfg.o_lora_rank, cfg.o_group_dim, generator=g, device=device)
        data, scale = quantize_per_block(w * cfg.o_group_dim**-0.5, 128, "e4m3fn")
        self.weight = (data.view(cfg.o_groups, cfg.o_lora_rank, -1),
                       scale.view(cfg.o_groups, cfg.o_lora_rank // 128, -1))
        self.freqs = yarn_frequencies(cfg, 4).to(device)
        self._cache: dict[int, dict[str, Any]] = {}

    def tokens(self, t: int) -> dict[str, Any]:
        """o, positions, their quantization (deepgemm layout) and the einsum oracle for t tokens."""
        if t not in self._cache:
            from optimized.triton.quant import quantize_attn_output

            cfg = self.cfg
            g = torch.Generator(device=self.device).manual_seed(t)
            o = torch.randn(t, cfg.n_heads, cfg.head_dim, generator=g, device=self.device).to(torch.bfloat16)
            positions = torch.randint(0, 1 << 20, (t,), generator=g, device=self.device)
            a = quantize_attn_output(o, positions, self.freqs, n_groups=cfg.o_groups, scale_layout="deepgemm")
            self._cache.clear()  # one token count at a time holds device memory
            self._cache[t] = {"o": o, "positions": positions, "a": a}
        return self._cache[t]

    def wo_b(self) -> Any:
        """A block-FP8 `wo_b` [D, G*R] (for the host-overhead calls of the linear and the projection)."""
        from reference.formats import quantize_per_block
        from reference.weights import Fp8Weight

        k = self.cfg.o_groups * self.cfg.o_lora_rank
        w = torch.randn(self.cfg.dim, k, device=self.device) * k**-0.5
        return Fp8Weight(*quantize_per_block(w, 128, "e4m3fn"))

    def einsum_oracle(self, t: int) -> torch.Tensor:
        entry = self.tokens(t)
        if "oracle" not in entry:
            (a, sa), (w, sw) = entry["a"], self.weight
            a32 = a.float() * sa.repeat_interleave(128, -1)
            w32 = w.float() * sw.repeat_interleave(128, 1).repeat_interleave(128, 2)
            entry["oracle"] = torch.einsum(EXPR, a32, w32)
        return entry["oracle"]

    def copies(self, what: str, t: int, n: int) -> list[Any]:
        """`n` copies (same strides) of the weight or of token-count t's quantized activations / attention output."""
        base = {"weight": lambda: self.weight, "a": lambda: self.tokens(t)["a"],
                "o": lambda: self.tokens(t)["o"]}[what]()
        return [base] + [_clone(base) for _ in range(n - 1)]


def _clone(x: Any) -> Any:
    """A copy with x's strides (`clone` would compact the DeepGEMM scale layout's padded views)."""
    if isinstance(x, tuple):
        return tuple(_clone(t) for t in x)
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return y.copy_(x)


def _rotation(bytes_per_call: int) -> int:
    return max(1, min(CALLS, -(-ROTATE_BYTES // max(bytes_per_call, 1))))


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def build(job: Job, inputs: Inputs) -> tuple[Callable[[int], Any], Callable[[Any], dict[str, Any]]]:
    """(call(i) running the job on the i-th operand copy, check(output) -> {"ok", "calc_diff"|"bitwise"})."""
    from optimized.triton.einsum import block_scaled_matmul
    from optimized.triton.quant import quantize_attn_output_checked
    from parity_tests.metrics import calc_diff
    from parity_tests.tolerances import FP8_GEMM_SIMULATED
    from reference import einsum as ref

    cfg, t = inputs.cfg, job.tokens
    entry = inputs.tokens(t)
    w_copies = inputs.copies("weight", t, _rotation(_nbytes(*inputs.weight)))

    def check_einsum(out: torch.Tensor) -> dict[str, Any]:
        diff = calc_diff(out.float(), inputs.einsum_oracle(t))
        return {"ok": diff <= FP8_GEMM_SIMULATED.value, "calc_diff": diff}

    def quantize(o: torch.Tensor, config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_attn_output_checked(o, entry["positions"], inputs.freqs, n_groups=cfg.o_groups,
                                            scale_layout="deepgemm", config=config)

    if job.kind == "host":
        return _host_call(job, inputs), lambda out: {"ok": True}
    if job.kind == "einsum":
        a_copies = inputs.copies("a", t, _rotation(_nbytes(*entry["a"])))

        def call(i: int) -> torch.Tensor:
            (a, sa), (w, sw) = a_copies[i % len(a_copies)], w_copies[i % len(w_copies)]
            out = torch.empty((t, cfg.o_groups, cfg.o_lora_rank), dtype=torch.bfloat16, device=inputs.device)
            return block_scaled_matmul(a, sa, w, sw, out, a_block_k=128, b_gran_n=128, config=job.config)

        return call, check_einsum
    if job.kind == "quant":
        o_copies = inputs.copies("o", t, _rotation(_nbytes(entry["o"])))
        expected = ref.quantize_attn_output(entry["o"], entry["positions"], inputs.freqs, n_groups=cfg.o_groups)

        def check_quant(out: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
            same = (torch.equal(out[0].view(torch.uint8), expected[0].view(torch.uint8))
                    and torch.equal(out[1], expected[1]))
            return {"ok": same, "bitwise": same}

        return (lambda i: quantize(o_copies[i % len(o_copies)], job.config)), check_quant
    from optimized.deepgemm import deep_gemm

    dg = deep_gemm() if job.kind == "deepgemm" or job.config == "deepgemm" else None
    if job.kind == "deepgemm":
        a = entry["a"]

        def raw(i: int) -> torch.Tensor:
            out = torch.empty((t, cfg.o_groups, cfg.o_lora_rank), dtype=torch.bfloat16, device=inputs.device)
            dg.fp8_einsum(EXPR, a, w_copies[i % len(w_copies)], out)
            return out

        return raw, check_einsum
    o_copies = inputs.copies("o", t, _rotation(_nbytes(entry["o"]) + _nbytes(*inputs.weight)))

    def pipeline(i: int) -> torch.Tensor:
        a = quantize(o_copies[i % len(o_copies)])
        w = w_copies[i % len(w_copies)]
        out = torch.empty((t, cfg.o_groups, cfg.o_lora_rank), dtype=torch.bfloat16, device=inputs.device)
        if dg is not None:
            dg.fp8_einsum(EXPR, a, w, out)
            return out
        return block_scaled_matmul(a[0], a[1], w[0], w[1], out, a_block_k=128, b_gran_n=128)

    return pipeline, lambda out: {"ok": True}  # its parts are checked by the other jobs


def _host_call(job: Job, inputs: Inputs) -> Callable[[int], Any]:
    """The eager call of a host-overhead job: a public op on one backend, or one bare Triton kernel launch."""
    import optimized
    from optimized.triton import einsum as triton_einsum
    from optimized.triton import quant
    from reference.numerics import OFFICIAL, VLLM_NVIDIA
    from reference.weights import Fp8Weight

    cfg, entry = inputs.cfg, inputs.tokens(1)
    op, backend = job.config.split("/")
    w, nb = inputs.weight, cfg.o_group_dim // 128
    wo_a = Fp8Weight(w[0].reshape(-1, w[0].shape[-1]), w[1].reshape(-1, w[1].shape[-1]))
    wo_b = inputs.wo_b()
    x = torch.randn(1, wo_b.shape[1], device=inputs.device).to(torch.bfloat16)
    o, positions, freqs = entry["o"], entry["positions"], inputs.freqs
    if op == "fp8_einsum":
        a = entry["a"] if backend == "deepgemm" else tuple(t.contiguous() for t in entry["a"])
        return lambda i: optimized.fp8_einsum(EXPR, a, w, backend=backend)
    if op == "quantize_attn_output":
        return lambda i: optimized.quantize_attn_output(o, positions, freqs, n_groups=cfg.o_groups, backend=backend)
    if op == "fp8_linear":
        return lambda i: optimized.fp8_linear(x, wo_b, OFFICIAL, backend=backend)
    if op == "output_projection":
        return lambda i: optimized.output_projection(o, positions, freqs, wo_a, wo_b, VLLM_NVIDIA, backend=backend)
    # bare launches: the kernel alone, arguments prepared once (Triton's own launcher cost; backend unused)
    if op == "triton_einsum_launch":
        a, sa = entry["a"]
        out = torch.empty((1, cfg.o_groups, cfg.o_lora_rank), dtype=torch.float32, device=inputs.device)
        c = triton_einsum.choose_config(1, cfg.o_groups, cfg.o_lora_rank, nb, triton_einsum.num_sms(a.device))
        grid = (cfg.o_lora_rank // c.block_n, cfg.o_groups, 1)
        args = (a, sa, w[0], w[1], out, 1, cfg.o_lora_rank, nb, *a.stride()[:2], *sa.stride(), *w[0].stride()[:2],
                *w[1].stride(), 0, *out.stride())
        kw = {"SCALE_K": 128, "GRAN_N": 128, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
              "TMA": False, "num_warps": c.num_warps, "num_stages": c.num_stages}  # b = 1: pointer loads
        return lambda i: triton_einsum._fp8_einsum_kernel[grid](*args, **kw)
    q, s = entry["a"]
    table = torch.zeros((2, 1, freqs.shape[0]), device=inputs.device)
    config = quant.choose_quant_config(1)
    heads = quant.program_heads(config, cfg.head_dim)
    args = (o, table[0], table[1], q, s, 1, cfg.n_heads, cfg.n_heads, *o.stride()[:2], *q.stride()[:2], *s.stride())
    kw = {"HEADS_PER_GROUP": cfg.heads_per_group, "HEAD_DIM": cfg.head_dim, "ROPE_DIM": 2 * freqs.shape[0],
          "BLOCK": 128, "HEADS": heads, "EPS": quant.ATTN_OUT_EPS,
          **quant.fp8_constants("e4m3fn"), "NATIVE_CAST": quant.native_fp8_cast("e4m3fn", o.device),
          "num_warps": config.num_warps, "enable_fp_fusion": False}
    return lambda i: quant._inv_rope_quant_heads_kernel[(-(-cfg.n_heads // heads),)](*args, **kw)


def time_host(call: Callable[[int], Any]) -> float:
    """Wall seconds per eager call over `HOST_CALLS` back-to-back calls (host-bound when the kernels are tiny)."""
    for i in range(10):
        call(i)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(HOST_CALLS):
        call(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / HOST_CALLS


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def work(job: Job, inputs: Inputs) -> tuple[float, float]:
    """(FLOP, minimal bytes) of one call."""
    cfg, t = inputs.cfg, job.tokens
    g, r, d = cfg.o_groups, cfg.o_group_dim, cfg.o_lora_rank
    weight = g * d * r * (1 + 4 / 128**2)
    o_bytes = t * cfg.n_heads * cfg.head_dim * 2
    quant_out = t * g * r * (1 + 4 / 128)
    if job.kind == "quant":
        return 0.0, o_bytes + quant_out
    flop = 2.0 * t * g * r * d
    if job.kind == "pipeline":
        return flop, o_bytes + weight + t * g * d * 2
    return flop, quant_out + weight + t * g * d * 2


def run_job(job: Job, inputs: Inputs, timed: bool) -> dict[str, Any]:
    """Run (check) and, when `timed`, time one job; never raises."""
    row: dict[str, Any] = {"kind": job.kind, "tokens": job.tokens, "config": job.label,
                           "params": dataclasses.asdict(job.config) if dataclasses.is_dataclass(job.config) else None}
    try:
        call, check = build(job, inputs)
        started = time.perf_counter()
        out = call(0)
        if inputs.device == "cuda":
            torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - started, 3)
        row.update(check(out))
        if timed and row["ok"] and job.kind == "host":
            row["us"], row["timing"] = round(time_host(call) * 1e6, 2), "eager wall clock"
        elif timed and row["ok"]:
            seconds, row["timing"] = time_graph(call)
            flop, nbytes = work(job, inputs)
            row["us"] = round(seconds * 1e6, 2)
            row["tflops"] = round(flop / seconds / 1e12, 1)
            row["gbs"] = round(nbytes / seconds / 1e9, 1)
    except Exception as exc:  # a config that does not compile or run is a result, not a crash
        row.update(ok=False, error=error_text(exc))
    return row


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best and default per (kind, tokens), and the table rows to paste into the kernel modules."""
    best: dict[str, dict[str, Any]] = {}
    for kind in ("einsum", "quant", "deepgemm", "pipeline", "host"):
        for t in sorted({r["tokens"] for r in rows if r["kind"] == kind}):
            timed = [r for r in rows if r["kind"] == kind and r["tokens"] == t and "us" in r]
            if not timed:
                continue
            entry = {"best": min(timed, key=lambda r: r["us"])}
            default = [r for r in timed if r["config"] == "default"]
            if default:
                entry["default"] = default[0]
                entry["speedup_over_default"] = round(default[0]["us"] / entry["best"]["us"], 2)
            if kind in ("pipeline", "host"):
                entry = {r["config"]: r for r in timed}
            best[f"{kind}/{t}"] = entry
    suggestions = {}
    for kind, table in (("einsum", "TILE_TABLE"), ("quant", "QUANT_TABLE")):
        lines = [f"b/T <= {key.split('/')[1]}: {value['best']['config']}  ({value['best']['us']} us, default "
                 f"{value.get('default', {}).get('us')} us)"
                 for key, value in best.items() if key.startswith(kind + "/")]
        suggestions[table] = lines
    ratio = None
    if "einsum/4096" in best and "deepgemm/4096" in best:
        ratio = round(best["einsum/4096"]["best"]["us"] / best["deepgemm/4096"]["best"]["us"], 2)
    return {"best": best, "suggested": suggestions, "triton_over_deepgemm_at_4096": ratio}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'kind':9s} {'tokens':>6s} {'us':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} {'check':>10s}  config")
    for r in rows:
        check = "ok" if r.get("ok") else "FAIL"
        if "calc_diff" in r:
            check = f"{r['calc_diff']:.1e}" if r["ok"] else f"FAIL {r['calc_diff']:.1e}"
        print(f"{r['kind']:9s} {r['tokens']:6d} {r.get('us', float('nan')):9.2f} {r.get('tflops', 0):8.1f} "
              f"{r.get('gbs', 0):7.0f} {check:>10s}  {r['config']}  {r.get('error', '')}")


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parser("sweep_einsum", __doc__.split("\n\n")[0], DEFAULT_BUDGET_S,
                  "CPU: TINY shapes, two configs per point, nothing timed").parse_args(argv)
    started = time.perf_counter()
    where = device_and_config(args, "sweep_einsum")
    if where is None:
        return 2
    device, config = where
    jobs = all_jobs(args.smoke)
    inputs = Inputs(config, device)
    # warm-up shards take whole token counts' worth of a kind in turn, so each holds one token count's inputs;
    # host overhead is timed first (quick), then the largest token counts: the budget cuts the least important
    rows = drive(args, "sweep_einsum", started,
                 sorted(jobs, key=lambda j: (j.kind != "host", -j.tokens, j.kind)),
                 sorted(jobs, key=lambda j: (j.tokens, j.kind)), lambda job, timed: run_job(job, inputs, timed),
                 lambda job: {"kind": job.kind, "tokens": job.tokens, "config": job.label})
    if rows is None:
        return 0
    print_table(rows)
    summary = summarize(rows)
    for table, lines in summary["suggested"].items():
        print(f"\nbest per point ({table}):")
        print("\n".join(f"  {line}" for line in lines))
    meta = {"config": config, "calls_per_graph": CALLS, "replays": REPLAYS, "rotate_bytes": ROTATE_BYTES,
            "note": "CUDA-graph timing, no L2 flush (operands rotate over >= rotate_bytes); ranks configs"}
    write_report(args.out, "sweep_einsum", device, meta, summary | {"results": rows}, started, len(rows))
    failed = [r for r in rows if not r.get("ok") and r["kind"] in ("einsum", "quant") and r["config"] == "default"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
