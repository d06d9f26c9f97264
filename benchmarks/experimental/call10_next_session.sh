#!/usr/bin/env bash
# For the next session (run on branch gluon-sparse-attention): GPU tests of the Gluon sparse-attention kernel,
# attention parity FLASH + PRO, the attention benchmark, and the v1b / v1c prototypes (.device/gluon_test.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=$PWD/.dg-cache TRITON_CACHE_DIR=$PWD/.triton-cache PYTHONPATH=$PWD
python3 -m pip install -q --no-deps --no-index .device/*.whl 2>&1 | grep -v WARNING | tail -2
W=$PWD/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $PWD w; }
step() { name=$1; t=$2; shift 2; s=$(date +%s); timeout -k 5 $t "$@" > $W/$name.log 2>&1
  echo "step $name rc=$? $(( $(date +%s) - s )) s" | tee -a $W/steps.txt; pack; }
step pytest 90 python3 -m pytest -q -p no:cacheprovider parity_tests/test_attention.py -k "sm90 or tiling or split or slot or sink or packed"
step gluon 160 python3 .device/gluon_test.py $W/gluon.json
step bench 120 python3 -m benchmarks --config FLASH --ops attention --tokens 64,8192 --out $W/bench_attn --budget-s 100
step par 240 python3 -m parity_tests --no-progress --out $W/par --config FLASH,PRO --suites parity --ops sparse_attention,attention
tail -3 $W/pytest.log; grep -v Warn $W/gluon.log | tail -12 | cut -c1-300
grep -cE "^pass" $W/par.log; grep -E "^(FAIL|fail|error)" $W/par.log | head
grep -A 14 "Speed targets" $W/bench_attn/BENCHMARKS.md | grep "#4" | cut -c1-200
