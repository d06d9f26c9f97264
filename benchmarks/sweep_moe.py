"""Sweep of the Triton grouped-GEMM launch configurations at decode token counts (issue #3's weight-streaming target).

    python -m benchmarks.sweep_moe --out DIR            # GPU: FLASH
    python -m benchmarks.sweep_moe --out DIR --smoke    # CPU (TRITON_INTERPRET=1): TINY, proves the code paths

At T in {1, 8, 64} (rows per active expert <= 16: `moe_gemm.choose_config`'s decode row) times the two
`moe_gemm.grouped_gemm` launches of the routed experts, gate/up (gather, SwiGLU, routing weight, FP8 epilogue)
and down, with every candidate `GemmConfig` (BLOCK_N, warps, stages, swap-AB; BLOCK_M stays 16, the permute
alignment; gate/up also 32 and 64 columns, whose quantization blocks are finished through the layout's counters),
plus the whole Triton `experts` call with the defaults (gate/up: `choose_config`, then `narrow_gate_up_for`). The
experts are in the layout `optimized.MoE` runs them in on this device (tiled on NVIDIA GPUs,
`optimized.moe.tiling_helps`). Writes `DIR/sweep_moe.json` and prints a table.

Timing is `benchmarks.sweeping.time_graph`. The calls rotate over `ROTATIONS` routings that pick other
experts, so the expert weights a call reads stream from HBM (T = 1 reads 6 experts, ~150 MB at FLASH) as they do
in a model. Each candidate's output is checked against the default config's under `MOE_SIMULATED` (down) or
against its dequantized values (gate/up: FP8 output, the same bound); a candidate that fails is never chosen.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch

from benchmarks.sweeping import device_and_config, drive, error_text, parser, time_graph, write_report

TOKENS = (1, 8, 64)
SMOKE_TOKENS = (2,)
ROTATIONS = 8
DEFAULT_BUDGET_S = 120.0


@dataclasses.dataclass(frozen=True)
class Job:
    """One launch to time: `gemm` is "gate_up", "down" or "experts" (the whole call, defaults)."""

    gemm: str
    tokens: int
    config: Any = None

    @property
    def label(self) -> str:
        c = self.config
        if c is None:
            return "default"
        return f"n={c.block_n},w={c.num_warps},s={c.num_stages}" + (",swap_ab" if c.swap_ab else "")


def all_jobs(smoke: bool) -> list[Job]:
    from optimized.triton.moe_gemm import GemmConfig as C

    gate_up = [C(16, 128, w, st, swap_ab=swap) for swap in (False, True) for w in (4, 8) for st in (2, 3, 4, 5, 6)]
    gate_up += [C(16, n, 4, st) for n in (32, 64) for st in (3, 4, 5)]
    down = [C(16, n, w, st, swap_ab=swap) for swap in (False, True) for n in (32, 64, 128) for w in (4, 8)
            for st in (2, 3, 4, 5)]
    if smoke:  # a 128-column and a narrow gate/up tile
        gate_up, down = gate_up[:1] + gate_up[-1:], down[:1]
    jobs = []
    for t in SMOKE_TOKENS if smoke else TOKENS:
        jobs += [Job("experts", t), Job("gate_up", t)] + [Job("gate_up", t, c) for c in gate_up]
        jobs += [Job("down", t)] + [Job("down", t, c) for c in down]
    return jobs


class Inputs:
    """FLASH (TINY) FP8 experts and, per token count, `ROTATIONS` routings with their layouts and gate/up outputs."""

    def __init__(self, config: str, device: str) -> None:
        from optimized.moe import tile_experts, tiling_helps
        from reference.config import get_config
        from reference.moe import random_moe_weights
        from reference.numerics import OFFICIAL

        self.cfg = get_config(config)
        self.device = device
        self.numerics = OFFICIAL
        weights = random_moe_weights(self.cfg, 0, expert_format="fp8", fmt="e4m3fn",
                                     generator=torch.Generator(device=device).manual_seed(11), device=device)
        w13, w2 = weights.w13, weights.w2
        # the routed experts as `optimized.MoE` holds them on this device (the row-major copy is not kept)
        self.w13, self.w2 = ((tile_experts(w13, "e4m3fn"), tile_experts(w2, "e4m3fn"))
                             if tiling_helps(torch.device(device)) else (w13, w2))
        self._held: tuple[int, list[dict[str, Any]]] | None = None

    def get(self, tokens: int) -> list[dict[str, Any]]:
        if self._held is None or self._held[0] != tokens:
            from optimized.triton.moe_pipeline import activation

            self._held = None
            cfg, g = self.cfg, torch.Generator(device=self.device).manual_seed(tokens)
            sets = []
            for _ in range(ROTATIONS):
                x = torch.randn(tokens, cfg.dim, generator=g, device=self.device).to(torch.bfloat16)
                ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g, device=self.device)
                                   [:cfg.n_activated_experts] for _ in range(tokens)]).to(torch.int32)
                weights = torch.rand(tokens, cfg.n_activated_experts, generator=g, device=self.device)
                a, a_scale = activation(x, self.numerics)
                sets.append({"x": x, "ids": ids, "weights": weights, "a": a, "a_scale": a_scale})
            self._held = (tokens, sets)
        return self._held[1]


def default_config(gemm: str, tokens: int, inputs: Inputs) -> Any:
    """The tile `moe_pipeline.routed_rows` launches for `gemm` at `tokens` tokens (decode rows per expert)."""
    from optimized.triton.einsum import num_sms
    from optimized.triton.moe_gemm import choose_config, narrow_gate_up_for
    from optimized.triton.moe_permute import compact_rows

    cfg = inputs.cfg
    config = choose_config(1.0, 0, swiglu=gemm == "gate_up")
    if gemm != "gate_up":
        return config
    rows = compact_rows(tokens * cfg.n_activated_experts, cfg.n_routed_experts, config.block_m)
    return narrow_gate_up_for(config, rows, cfg.moe_inter_dim, inputs.numerics.act_block,
                              num_sms(torch.device(inputs.device)))


def _gemm(job: Job, s: dict[str, Any], inputs: Inputs, config: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    from optimized.triton.moe_gemm import grouped_gemm
    from optimized.triton.moe_permute import permute

    w13, w2, fmt = inputs.w13, inputs.w2, inputs.numerics.fp8_format
    if "layout" not in s:  # with the counters of narrow gate/up tiles (each launch leaves them zeroed)
        s["layout"] = permute(s["ids"], w13.data.shape[0], align=16,
                              arrivals_per_block=inputs.cfg.moe_inter_dim // inputs.numerics.act_block)
    common = {"layout": s["layout"], "numerics_fmt": fmt, "act_block": inputs.numerics.act_block}
    if job.gemm == "gate_up":
        return grouped_gemm(s["a"], s["a_scale"], w13.data, w13.scale, config=config, swiglu=True,
                            topk=s["ids"].shape[1], gather=True, topk_weights=s["weights"].reshape(-1),
                            limit=inputs.cfg.swiglu_limit, arrivals=s["layout"].arrivals, **common)
    if "h" not in s:
        s["h"] = _gemm(dataclasses.replace(job, gemm="gate_up"), s, inputs,
                       default_config("gate_up", job.tokens, inputs))
    return grouped_gemm(*s["h"], w2.data, w2.scale, config=config, swiglu=False, **common)


def run_job(job: Job, inputs: Inputs, timed: bool, expected: torch.Tensor | None) -> tuple[dict[str, Any], Any]:
    """Run, check against `expected` (the default's output) and, when `timed`, time one job; never raises."""
    from optimized.triton.moe_pipeline import experts
    from parity_tests.metrics import calc_diff
    from parity_tests.tolerances import MOE_SIMULATED

    row: dict[str, Any] = {"gemm": job.gemm, "tokens": job.tokens, "config": job.label}
    out = None
    try:
        sets = inputs.get(job.tokens)
        config = job.config or default_config(job.gemm, job.tokens, inputs)

        def call(i: int) -> Any:
            s = sets[i % len(sets)]
            if job.gemm == "experts":
                return experts(s["x"], s["ids"], s["weights"], inputs.w13, inputs.w2,
                               swiglu_limit=inputs.cfg.swiglu_limit, numerics=inputs.numerics)
            return _gemm(job, s, inputs, config)

        result = call(0)
        if job.gemm == "experts":
            out = result.float()
        else:  # the rows that hold a slot (padding rows are never written)
            data, scale = result
            out = data.float() if scale is None else data.float() * scale.repeat_interleave(
                inputs.numerics.act_block, 1)
            out = out[sets[0]["layout"].sorted_slot >= 0]
        if expected is not None:
            row["calc_diff"] = calc_diff(out, expected)
            row["ok"] = row["calc_diff"] <= MOE_SIMULATED.value
        else:
            row["ok"] = True
        if timed and row["ok"]:
            for i in range(len(sets)):  # layouts and gate/up inputs built before capture
                call(i)
            seconds, row["timing"] = time_graph(call)
            row["us"] = round(seconds * 1e6, 2)
            per_expert = {"gate_up": inputs.w13.data[0].numel(), "down": inputs.w2.data[0].numel(),
                          "experts": inputs.w13.data[0].numel() + inputs.w2.data[0].numel()}[job.gemm]
            active = int(torch.unique(sets[0]["ids"]).numel())
            row["weight_gbs"] = round(active * per_expert * (1 + 4 / 128**2) / seconds / 1e9, 1)
            row["experts_per_call"] = active
    except Exception as exc:  # a config that does not compile or run is a result, not a crash
        row.update(ok=False, error=error_text(exc))
    return row, out


def main(argv: list[str] | None = None) -> int:
    args = parser("sweep_moe", __doc__.split("\n\n")[0], DEFAULT_BUDGET_S,
                  "CPU: TINY shapes, one config per GEMM, nothing timed").parse_args(argv)
    started = time.perf_counter()
    where = device_and_config(args, "sweep_moe")
    if where is None:
        return 2
    device, config = where
    jobs = all_jobs(args.smoke)
    inputs = Inputs(config, device)
    expected: dict[str, torch.Tensor | None] = {}  # each GEMM's default output at the current token count

    def run(job: Job, timed: bool) -> dict[str, Any]:
        row, out = run_job(job, inputs, timed, expected=expected.get(job.gemm) if job.config else None)
        if job.config is None:
            expected[job.gemm] = out
        print(f"{row['gemm']:8s} {row['tokens']:4d} {row.get('us', float('nan')):9.2f} us "
              f"{row.get('weight_gbs', 0):7.0f} GB/s  {row.get('calc_diff', 0):.1e}  {row['config']}  "
              f"{row.get('error', '')}", flush=True)
        return row

    # warm-up shards: each config once, at the first token count
    rows = drive(args, "sweep_moe", started, jobs, [j for j in jobs if j.tokens == jobs[0].tokens], run,
                 lambda job: {"gemm": job.gemm, "tokens": job.tokens, "config": job.label})
    if rows is None:
        return 0
    best = {}
    for key in sorted({(r["gemm"], r["tokens"]) for r in rows}):
        timed = [r for r in rows if (r["gemm"], r["tokens"]) == key and "us" in r]
        if timed:
            b = min(timed, key=lambda r: r["us"])
            default = next((r for r in timed if r["config"] == "default"), None)
            best[f"{key[0]}/{key[1]}"] = {"best": b, "default": default}
            print(f"best {key[0]} T={key[1]}: {b['config']} {b['us']} us (default {default and default['us']} us)")
    meta = {"config": config,
            "note": "CUDA-graph timing, no L2 flush (routings rotate over other experts); ranks configs"}
    write_report(args.out, "sweep_moe", device, meta, {"best": best, "results": rows}, started, len(rows))
    return 0 if all(r.get("ok") for r in rows if r["config"] == "default") else 1


if __name__ == "__main__":
    sys.exit(main())
