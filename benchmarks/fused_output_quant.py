"""What fusing the output projection's activation quantization into the sparse attention saves (#2's path).

    python -m benchmarks.fused_output_quant --out DIR                  # GPU: FLASH prefill, 4096 and 8192 tokens
    python -m benchmarks.fused_output_quant --out DIR --smoke          # CPU (TRITON_INTERPRET=1): TINY, proves the code

Per token count, over the benchmark's prefill inputs (`benchmarks.sweep_attention.Inputs`: bf16 rows), times the
sparse attention alone, the attention then `quantize_attn_output` (two kernels), `sparse_attention_quantized` (the
sm_90 kernel storing its output quantized, design note 35; elsewhere the same two kernels), and each of the two
quantized paths followed by the einsum with `wo_a` (DeepGEMM where installed, else Triton). Alternating rounds of
CUDA-graph replays after the L2 flush; the fused bytes and scales are compared with the two-step path's. #2's path
is counted as (fused + einsum) - attention: what the layer pays for the quantization and the einsum together.
Writes `DIR/fused_output_quant.json`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROUNDS = 2
TOKENS = (4096, 8192)
SMOKE_TOKENS = (12,)  # not a decode batch of the attention benchmark (DECODE_TOKENS)
EXPR = "bhr,hdr->bhd"


def run(config: str, device: str, tokens: tuple[int, ...], smoke: bool) -> dict[str, Any]:
    import optimized
    import optimized.triton.quant as quant
    import optimized.triton.sparse_attention as tsa
    from benchmarks.ops_einsum import setup
    from benchmarks.sweep_attention import Inputs
    from benchmarks.timing import Timer
    from optimized.backends import backend_status
    from reference.rope import yarn_frequencies

    inputs = Inputs(config, device, smoke)
    cfg = inputs.env.cfg
    freqs = yarn_frequencies(cfg, 4).to(device)
    wo_a = setup(inputs.env).einsum_b(inputs.env)
    einsum_backend = "deepgemm" if backend_status("deepgemm")[0] else "triton"
    timer = Timer(device, max_runs=30, budget_s=1.0, single_call=smoke)  # smoke: one untimed call per job
    results: dict[str, Any] = {}
    for t in tokens:
        e = inputs.get(t)
        q, kv, idx = e["q"], e["kv"], e["indices"][0]
        pos = torch.arange(t, device=device) + 100

        def attention(q=q, kv=kv, idx=idx) -> torch.Tensor:
            return tsa.sparse_attention(q, kv, idx, inputs.sink, inputs.scale)

        def two_step(q=q, kv=kv, idx=idx, pos=pos) -> tuple[torch.Tensor, torch.Tensor]:
            o = tsa.sparse_attention(q, kv, idx, inputs.sink, inputs.scale)
            return quant.quantize_attn_output_checked(o, pos, freqs, n_groups=cfg.o_groups, scale_layout="deepgemm")

        def fused(q=q, kv=kv, idx=idx, pos=pos) -> tuple[torch.Tensor, torch.Tensor]:
            return tsa.sparse_attention_quantized(q, kv, idx, inputs.sink, inputs.scale, pos, freqs,
                                                  n_groups=cfg.o_groups)

        a, b = two_step(), fused()
        row: dict[str, Any] = {"bitwise": bool(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
                                               and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))),
                               "einsum_backend": einsum_backend, "us": {}}
        jobs = {"attention": attention, "attention+quant": two_step, "fused": fused,
                "attention+quant+einsum": lambda: optimized.fp8_einsum(EXPR, two_step(), wo_a, backend=einsum_backend),
                "fused+einsum": lambda: optimized.fp8_einsum(EXPR, fused(), wo_a, backend=einsum_backend),
                "einsum": lambda a=a: optimized.fp8_einsum(EXPR, a, wo_a, backend=einsum_backend)}
        for r in range(1 if smoke else ROUNDS):
            for name, fn in (jobs.items() if r % 2 == 0 else reversed(list(jobs.items()))):
                row["us"].setdefault(name, []).append(timer.time(fn, graph=not smoke, min_runs=5).median_s * 1e6)
        med = {name: statistics.median(v) for name, v in row["us"].items()}
        row["median_us"] = med
        path_us = med["fused+einsum"] - med["attention"]
        row["path_us"] = path_us
        row["path_tflops"] = 2 * t * cfg.o_groups * cfg.o_lora_rank * cfg.o_group_dim / max(path_us, 1e-9) / 1e6
        results[str(t)] = row
        print(f"{t:6d} tokens: bitwise {row['bitwise']}, " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f" us; path (fused + einsum - attention) {path_us:.1f} us = {row['path_tflops']:.0f} TFLOP/s",
              flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sweeping import device_and_config, write_report

    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_output_quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for fused_output_quant.json")
    p.add_argument("--config", default="FLASH", help="model config (default FLASH)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated prefill token counts")
    p.add_argument("--smoke", action="store_true", help="CPU: TINY, 12 tokens, one untimed round")
    args = p.parse_args(argv)
    started = time.perf_counter()
    where = device_and_config(args, "fused_output_quant")
    if where is None:
        return 2
    device, config = where
    tokens = SMOKE_TOKENS if args.smoke else tuple(int(t) for t in args.tokens.split(","))
    results = run(config, device, tokens, args.smoke)
    write_report(args.out, "fused_output_quant", device, {"config": config, "rounds": 1 if args.smoke else ROUNDS},
                 {"results": results}, started, len(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
