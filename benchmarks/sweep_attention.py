"""Sweep of the Triton sparse-attention launch configurations (issue #4's speed targets).

    python -m benchmarks.sweep_attention --out DIR            # GPU: FLASH
    python -m benchmarks.sweep_attention --out DIR --smoke    # CPU (TRITON_INTERPRET=1): TINY, proves the code paths

Times `optimized.triton.sparse_attention` with every candidate `LaunchConfig` (heads per program, rows per
step, warps, stages) and split-KV factor at the benchmark's own inputs (`benchmarks.ops_attention.candidates`):
prefill of 8192 tokens over bf16 rows, and decode (batch 1, 8, 64, 128 at a 32768-token context) over the
584-byte FP8 cache. Writes `DIR/sweep_attention.json` (every result and the best per point) and prints a table.

Timing is `benchmarks.sweeping.time_graph` (CUDA graph of back-to-back calls, median replay). Decode calls
rotate over index sets shifted through the whole KV pool, so each call gathers rows that the previous calls
did not leave in L2 (one step of batch 64 reads ~24 MB, less than the 50 MB L2); prefill's rows are shared by
all its tokens and stay in L2 in a real prefill too, so they are not rotated.

Every candidate's output is checked against the default configuration's (the same function: the online softmax
rescales at other places) under `SPARSE_ATTENTION_SIMULATED`; a candidate that fails to compile, run or match
is reported with its error and never chosen. The default configuration is the op's own dispatch: on an sm_90
GPU its 64-head launches run the warp-specialized Gluon kernel (`sparse_attention_sm90`), while an explicit
`LaunchConfig` always times the portable kernel's tiles.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch

from benchmarks.sweeping import device_and_config, drive, error_text, parser, time_graph, write_report

PREFILL_TOKENS = 8192
DECODE_TOKENS = (1, 8, 64, 128)
SMOKE_TOKENS = (8,)  # a decode count: packed rows
DECODE_ROTATIONS = 6
DEFAULT_BUDGET_S = 150.0


@dataclasses.dataclass(frozen=True)
class Job:
    """One launch to time: `config` None is the default (`plan`'s tiles and splits)."""

    tokens: int
    packed: bool
    config: Any = None
    splits: int | None = None

    @property
    def label(self) -> str:
        if self.config is None:
            return "default"
        c = self.config
        return f"h={c.block_h},n={c.block_n},w={c.num_warps},s={c.num_stages},splits={self.splits}"


def candidates(tokens: int, smoke: bool) -> list[Job]:
    """Prefill: 64 heads per program (one Hopper warpgroup MMA) and 16..64 rows per step; decode: 16 or 64 heads,
    16..64 rows, with split-KV over the candidates. Configurations that spill on sm_90 are left out."""
    from optimized.triton.sparse_attention import LaunchConfig as C

    if smoke:
        return [Job(tokens, True), Job(tokens, True, C(16, 16, 4, 1), 2)]
    if tokens not in DECODE_TOKENS:
        return [Job(tokens, False)] + [Job(tokens, False, C(64, n, 8, st), 1) for n in (16, 32, 64) for st in (1, 2, 3)]
    configs = [C(16, n, w, st) for n in (16, 32, 64) for w in (4, 8) for st in (1, 2, 3) if (n, w) != (64, 4)]
    configs += [C(64, n, 8, st) for n in (16, 32) for st in (1, 2)] + [C(64, 64, 8, 3)]
    return [Job(tokens, True)] + [Job(tokens, True, c, s) for c in configs for s in (1, 2, 4, 5, 10)]


class Inputs:
    """The benchmark's sparse-attention inputs at each token count (one count held at a time)."""

    def __init__(self, config: str, device: str, smoke: bool) -> None:
        from benchmarks.suite import Env
        from reference.config import get_config

        self.env = Env(get_config(config), device, smoke=smoke)
        self.sink = self.env.randn(self.env.cfg.n_heads, salt=30, dtype=torch.float32)
        self.scale = self.env.cfg.head_dim**-0.5
        self._held: tuple[int, dict[str, Any]] | None = None

    def get(self, tokens: int) -> dict[str, Any]:
        if self._held is None or self._held[0] != tokens:
            from benchmarks.ops_attention import candidates as attention_candidates
            from reference.cache import pack_kv

            self._held = None
            c = attention_candidates(self.env, tokens)
            entry: dict[str, Any] = {"q": c.q, "kv": c.kv, "indices": [c.indices]}
            if c.decode:
                entry["kv"] = pack_kv(c.kv, self.env.fmt)
                n_rows, shift = c.kv.shape[0], c.kv.shape[0] // DECODE_ROTATIONS
                entry["indices"] += [torch.where(c.indices >= 0, (c.indices + i * shift) % n_rows, -1).to(torch.int32)
                                     for i in range(1, DECODE_ROTATIONS)]
            self._held = (tokens, entry)
        return self._held[1]


def run_job(job: Job, inputs: Inputs, timed: bool, expected: torch.Tensor | None) -> tuple[dict[str, Any], Any]:
    """Run, check against `expected` (the default's output) and, when `timed`, time one job; never raises."""
    from optimized.triton import sparse_attention as tsa
    from parity_tests.metrics import calc_diff
    from parity_tests.tolerances import SPARSE_ATTENTION_SIMULATED
    from reference.formats import fp8_format

    row: dict[str, Any] = {"tokens": job.tokens, "packed": job.packed, "config": job.label}
    out = None
    try:
        entry = inputs.get(job.tokens)
        q, kv, index_sets = entry["q"], entry["kv"], entry["indices"]

        def call(i: int) -> torch.Tensor:
            indices = index_sets[i % len(index_sets)]
            if job.packed:
                return tsa.sparse_attention_packed(q, kv, indices, inputs.sink, inputs.scale, splits=job.splits,
                                                   config=job.config, fp8_dtype=fp8_format(inputs.env.fmt).dtype)
            return tsa.sparse_attention(q, kv, indices, inputs.sink, inputs.scale, splits=job.splits,
                                        config=job.config)

        out = call(0)
        if expected is not None:
            row["calc_diff"] = calc_diff(out.float(), expected.float())
            row["ok"] = row["calc_diff"] <= SPARSE_ATTENTION_SIMULATED.value
        else:
            row["ok"] = bool(out.isfinite().all())
        if timed and row["ok"]:
            seconds, row["timing"] = time_graph(call)
            row["us"] = round(seconds * 1e6, 2)
            valid = int((index_sets[0] >= 0).sum())
            row["tflops"] = round(4.0 * q.shape[1] * q.shape[2] * valid / seconds / 1e12, 1)
    except Exception as exc:  # a config that does not compile or run is a result, not a crash
        row.update(ok=False, error=error_text(exc))
    return row, out


def main(argv: list[str] | None = None) -> int:
    args = parser("sweep_attention", __doc__.split("\n\n")[0], DEFAULT_BUDGET_S,
                  "CPU: TINY shapes, two configs, nothing timed").parse_args(argv)
    started = time.perf_counter()
    where = device_and_config(args, "sweep_attention")
    if where is None:
        return 2
    device, config = where
    token_counts = SMOKE_TOKENS if args.smoke else (PREFILL_TOKENS, *reversed(DECODE_TOKENS))
    jobs = [job for t in token_counts for job in candidates(t, args.smoke)]
    inputs = Inputs(config, device, args.smoke)
    expected: torch.Tensor | None = None  # the default config's output at the current token count

    def run(job: Job, timed: bool) -> dict[str, Any]:
        nonlocal expected
        row, out = run_job(job, inputs, timed, expected=None if job.config is None else expected)
        if job.config is None:
            expected = out
        print(f"{row['tokens']:6d} {'fp8' if row['packed'] else 'bf16':4s} {row.get('us', float('nan')):9.2f} us "
              f"{row.get('tflops', 0):7.1f} TFLOP/s  {row.get('calc_diff', 0):.1e}  {row['config']}  "
              f"{row.get('error', '')}", flush=True)
        return row

    # warm-up shards: one launch per distinct compiled kernel (batch 64 covers every decode kernel)
    rows = drive(args, "sweep_attention", started, jobs, [j for j in jobs if j.tokens == 64 or not j.packed], run,
                 lambda job: {"tokens": job.tokens, "packed": job.packed, "config": job.label})
    if rows is None:
        return 0
    best = {}
    for t in token_counts:
        timed = [r for r in rows if r["tokens"] == t and "us" in r]
        if timed:
            default = next((r for r in timed if r["config"] == "default"), None)
            best[str(t)] = {"best": min(timed, key=lambda r: r["us"]), "default": default}
            print(f"best at {t}: {best[str(t)]['best']['config']} {best[str(t)]['best']['us']} us "
                  f"(default {default and default['us']} us)")
    meta = {"config": config,
            "note": "CUDA-graph timing, no L2 flush (decode indices rotate through the KV pool); ranks configs"}
    write_report(args.out, "sweep_attention", device, meta, {"best": best, "results": rows}, started, len(rows))
    return 0 if all(r.get("ok") for r in rows if r["config"] == "default") else 1


if __name__ == "__main__":
    sys.exit(main())
