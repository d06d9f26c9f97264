"""Where one step of the whole attention layer spends its time: wall clock, kernels, launches, syncs.

    python -m benchmarks.profile_attention --out DIR                  # GPU: FLASH CSA layer, decode batch 64, 32768
    python -m benchmarks.profile_attention --out DIR --prefill 8192   # GPU: the same layer, one 8192-token prompt
    python -m benchmarks.profile_attention --out DIR --smoke          # CPU (TRITON_INTERPRET=1): TINY, proves the code

The layer at decode is host-bound (hundreds of small launches per step, see README), so this reports what a
kernel benchmark cannot: per backend, with `cu_seqlens` on the device and value checks on (the default) and with
`cu_seqlens` on the host and value checks off (a serving loop), the wall time per step (mean of `STEPS` eager
steps after `STEPS` warm ones, no L2 flush: the step is host-bound), the kernels launched and their summed GPU
time, the host-device syncs and copies, and the costliest kernels (torch.profiler over one step). Each step
continues the caches of `benchmarks.ops_attention` (filled to the benchmark's decode context). With `--prefill T`
each step is instead the benchmark's prefill point (one fresh prompt of T tokens, no cache: host `cu_seqlens`, value
checks off), profiled once. Writes `DIR/profile_attention.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

STEPS = 4
BATCH = 64
SMOKE_BATCH = 2
SMOKE_PREFILL = 16
MODES = ("device cu_seqlens, checks on", "host cu_seqlens, checks off")
TOP_KERNELS = 12


def profile_step(step: Any, device: str) -> dict[str, Any]:
    """Counts and times of one call of `step` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]

    def count(*keys: str) -> int:
        return sum(e.count for e in events if e.key in keys)

    return {"kernels": sum(e.count for e in kernels),
            "kernel_ms": round(sum(e.device_time_total for e in kernels) / 1e3, 3),
            "launches": count("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"),
            "syncs": count("cudaStreamSynchronize", "cudaDeviceSynchronize"), "copies": count("cudaMemcpyAsync"),
            "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
            "top_kernels": [(e.key[:60], e.count, round(e.device_time_total / 1e3, 3))
                            for e in sorted(kernels, key=lambda e: -e.device_time_total)[:TOP_KERNELS]]}


def decode_step(ctx: Any, env: Any, backend: str, host: bool, batch: int) -> Any:
    """The next decode step of `batch` sequences continuing filled caches (each call one more token)."""
    import optimized
    from benchmarks import ops_attention
    from optimized.backends import value_checks

    device = env.device
    cache = ops_attention._filled_cache(ctx, env, batch, reference=False)
    layer = optimized.Attention(env.cfg, ctx.layer_id, ctx.weights, ctx.numerics, backend=backend)
    x = env.randn(batch, env.cfg.dim, salt=1)
    cu_seqlens = torch.arange(batch + 1, dtype=torch.int32, device="cpu" if host else device)
    seq0 = cache.sequences[0]

    def step() -> torch.Tensor:
        positions = torch.full((batch,), seq0.next_position, dtype=torch.int64, device=device)
        with value_checks(not host):
            return layer(x, positions, cu_seqlens, cache)

    return step


def prefill_step(ctx: Any, env: Any, backend: str, tokens: int) -> Any:
    """The benchmark's prefill point: one fresh prompt of `tokens` tokens."""
    from benchmarks import ops_attention

    candidate = next(c for c in ops_attention.attention_point(ctx, env, tokens).candidates if c.name == backend)
    if candidate.build is None:
        raise RuntimeError(f"{backend}: {candidate.na}")
    return candidate.build()


def profile_mode(step: Any, device: str, steps: int) -> dict[str, Any]:
    """Wall time per step (after `steps` warm ones) and the profile of one more step."""
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return {"wall_ms": round((time.perf_counter() - started) / steps * 1e3, 2), **profile_step(step, device)}


def run(config: str, device: str, batch: int, backends: list[str], smoke: bool, prefill: int = 0) -> dict[str, Any]:
    from benchmarks import ops_attention
    from benchmarks.suite import Env
    from reference.config import get_config

    env = Env(get_config(config), device, smoke=smoke)
    ctx = ops_attention.setup(env)
    results: dict[str, Any] = {}
    steps = 1 if smoke else STEPS
    for backend in backends:
        modes = MODES[1:] if prefill or smoke else MODES
        for mode in modes:
            step = (prefill_step(ctx, env, backend, prefill) if prefill
                    else decode_step(ctx, env, backend, mode.startswith("host"), batch))
            row = profile_mode(step, device, steps)
            results[f"{backend}: {mode}"] = row
            print(f"{backend:9s} {mode:30s} {row['wall_ms']:8.2f} ms wall, {row['kernels']} kernels "
                  f"({row['kernel_ms']} ms), {row['syncs']} syncs, {row['copies']} copies", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for profile_attention.json")
    p.add_argument("--config", default="FLASH", help="model config (default FLASH)")
    p.add_argument("--batch", type=int, default=BATCH, help=f"sequences, one token each (default {BATCH})")
    p.add_argument("--backends", default="triton,deepgemm", help="comma-separated optimized backends")
    p.add_argument("--prefill", type=int, default=0, metavar="T",
                   help="profile the prefill of one T-token prompt instead of a decode step (smoke: 16)")
    p.add_argument("--smoke", action="store_true", help="CPU: TINY, batch 2, host metadata, one step, no CUDA counts")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        config, device, batch, backends = "TINY", "cpu", SMOKE_BATCH, ["triton"]
    elif not torch.cuda.is_available():
        print("profile_attention needs a CUDA GPU (use --smoke on the CPU)", file=sys.stderr)
        return 2
    else:
        config, device, batch, backends = args.config, "cuda", args.batch, args.backends.split(",")
    prefill = min(args.prefill, SMOKE_PREFILL) if args.smoke else args.prefill
    results = run(config, device, batch, backends, args.smoke, prefill)
    meta = {"config": config, "batch": batch, "prefill": prefill,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "steps": 1 if args.smoke else STEPS}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_attention.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
