#!/usr/bin/env bash
# One call on the lent H200 (see README "GPU runs"): install the carried DeepGEMM wheel, print the capability
# table, run the GPU pytest tests, the parity matrix at FLASH and PRO, and the benchmarks. Everything it
# writes goes under $OUT (at most 8 files come back).
#   usage: bash .ci/h200.sh [parity-args...]     env: STEPS="caps pytest parity bench" BENCH_ARGS=... PYTEST_ARGS=...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=$PWD/.dg-cache TRITON_CACHE_DIR=$PWD/.triton-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-"caps pytest parity bench"}
ls .device/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps --no-index .device/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
rc=0
for step in $STEPS; do
  start=$(date +%s)
  case $step in
    caps)   { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -m optimized; } \
              2>&1 | tee "$OUT/caps.txt" ;;
    pytest) timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q --maxfail=10 -m "${PYTEST_MARK:-not slow}" \
              -p no:cacheprovider ${PYTEST_ARGS:-parity_tests} 2>&1 | tee "$OUT/pytest.log"
            rc=$((rc | ${PIPESTATUS[0]})) ;;
    parity) timeout "${PARITY_TIMEOUT:-400}" python3 -m parity_tests --config "${PARITY_CONFIG:-FLASH,PRO}" --out "$OUT" \
              --no-progress "$@" 2>&1 | tee "$OUT/parity.log"
            rc=$((rc | ${PIPESTATUS[0]})) ;;
    sweep)  timeout 150 python3 -m benchmarks.sweep_einsum --out "$OUT" 2>&1 | tail -60 | tee "$OUT/sweep.log" ;;
    sweep_attention) timeout 220 python3 -m benchmarks.sweep_attention --out "$OUT" > "$OUT/sweep_attention.log" 2>&1
            tail -8 "$OUT/sweep_attention.log" ;;
    sweep_moe) timeout 180 python3 -m benchmarks.sweep_moe --out "$OUT" --workers 4 > "$OUT/sweep_moe.log" 2>&1
            tail -8 "$OUT/sweep_moe.log" ;;
    bench)  python3 -m benchmarks --config FLASH,PRO --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
            rc=$((rc | ${PIPESTATUS[0]})) ;;
  esac
  echo "[h200] step $step took $(( $(date +%s) - start )) s (rc so far $rc)"
done
exit $rc
