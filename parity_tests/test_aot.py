"""Every Triton kernel compiles ahead of time for sm_90, gfx942 (e4m3fnuz) and gfx950, without spills and
within the target's shared memory (LDS) — how the ROCm path is checked without ROCm hardware (design §3).

`python -m optimized.triton.aot` runs in a subprocess with `TRITON_INTERPRET` removed from the environment
(the interpreter replaces `@triton.jit` functions, so nothing would compile in this process when the rest
of the suite runs under `TRITON_INTERPRET=1`). The resource table is printed (`pytest -s` shows it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def aot_rows() -> list[dict]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "optimized.triton.aot"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, f"python -m optimized.triton.aot failed:\n{done.stderr[-4000:]}"
    rows = json.loads(done.stdout)
    _print_table(rows)
    return rows


def _print_table(rows: list[dict]) -> None:
    print(f"\n{'kernel':56s} {'target':7s} {'fmt':9s} {'regs':>9s} {'shared':>7s} {'spills':>6s}  ok")
    for r in rows:
        regs = r.get("registers", f"{r.get('vgprs', '-')}/{r.get('sgprs', '-')}")
        print(f"{r['kernel']:56s} {r['target']:7s} {r['fmt']:9s} {regs!s:>9s} {r.get('shared', '-')!s:>7s} "
              f"{r.get('spills', '-')!s:>6s}  {'ok' if r['ok'] else 'FAIL ' + r.get('error', '')}")


def test_every_kernel_is_compiled_for_all_three_targets(aot_rows: list[dict]) -> None:
    """Each spec on its targets; each Triton kernel function on all three (a platform's tiles cover its targets).
    Gluon kernels set one target's layouts by hand and serve only that target (`AotSpec.gluon`): each is compiled
    for its own target(s), and the portable Triton kernel it stands in for covers all three."""
    from optimized.triton.aot import ALL_TARGETS, all_specs

    specs = all_specs()
    names = [spec.name for spec in specs]
    assert len(names) == len(set(names)), "AOT spec names must be unique"
    compiled = {(r["kernel"], r["target"]) for r in aot_rows}
    assert compiled == {(spec.name, target) for spec in specs for target in spec.targets}
    for kernel in {spec.kernel for spec in specs if not spec.gluon}:
        covered = {t for spec in specs if spec.kernel is kernel for t in spec.targets}
        assert covered == set(ALL_TARGETS), f"{kernel.__name__} is compiled for {sorted(covered)} only"


def test_no_kernel_fails_spills_or_exceeds_shared_memory(aot_rows: list[dict]) -> None:
    bad = [f"{r['kernel']} on {r['target']}: {r.get('error') or ''} spills={r.get('spills')} shared={r.get('shared')}"
           for r in aot_rows if not r["ok"]]
    assert not bad, "\n".join(bad)


def test_tma_and_dependent_launch_are_compiled_in_exactly_where_launches_ask_for_them(aot_rows: list[dict]) -> None:
    """The einsum's `TMA` launches read through TMA on sm_90 and its pointer launches do not; every kernel with a `PDL`
    constexpr waits on its predecessor (`griddepcontrol.wait`) on sm_90, as `_pdl.pdl_launch` launches it there; no
    other sm_90 kernel does, and no AMD kernel has either (a silent fallback of either feature would pass every
    numeric test). Likewise the arrival counter of the split-K GEMMs and of the gate/up tiles narrower than a
    quantization block: an acquire-release atomic at GPU scope on sm_90 exactly where SPLIT_K > 1 or PARTS > 1 (a
    relaxed one would race only now and then). And the MoE GEMMs run Hopper's native FP8 wgmma on sm_90 exactly where
    the tile puts 64 or more rows on the MMA's M side (BLOCK_M >= 64, or the weight rows of a swap-AB tile), which is
    what swap-AB is for (`moe_gemm._block_dot`); the 16-row decode tiles lower to mma.sync. Their prefill tiles on
    tiled weights read them through TMA (`GemmConfig.tma`), and no other MoE GEMM launch does."""
    from optimized.triton import einsum, moe_gemm
    from optimized.triton.aot import all_specs

    specs = {spec.name: spec for spec in all_specs()}
    for r in aot_rows:
        spec, nvidia = specs[r["kernel"]], r["target"] == "sm_90"
        if spec.kernel is einsum._fp8_einsum_kernel:
            assert r["tma"] == (nvidia and spec.constexprs["TMA"]), r
        assert r["pdl"] == (nvidia and "PDL" in spec.kernel.arg_names), r
        counters = spec.constexprs.get("SPLIT_K", 1) > 1 or spec.constexprs.get("PARTS", 1) > 1
        assert r["acq_rel"] == (nvidia and counters), r
        if spec.kernel is moe_gemm._grouped_gemm_kernel:
            c = spec.constexprs
            assert r["wgmma"] == (nvidia and (c["SWAP_AB"] or c["BLOCK_M"] >= 64)), r
            assert r["tma"] == (nvidia and c["W_TMA"]), r
