#!/usr/bin/env bash
# Prints the python to use for this project, setting it up first when needed.
#  - DSV4_PYTHON set: use it as it is.
#  - a python3 whose torch sees a GPU (the H200 image, a ROCm box): use it; install this project into
#    it without touching its torch / triton (no registry is needed).
#  - otherwise: a local .venv with the CPU torch wheel, Triton (for the interpreter and the
#    ahead-of-time compile checks) and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "[setup] $*" >&2; }

if [ -n "${DSV4_PYTHON:-}" ]; then echo "$DSV4_PYTHON"; exit 0; fi

if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY=$(python3 -c "import sys; print(sys.executable)")
  if ! "$PY" -c "import reference, optimized, parity_tests" 2>/dev/null; then
    log "GPU python $PY: installing the project (editable, no dependencies)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >&2
  fi
  echo "$PY"; exit 0
fi

VENV=${DSV4_VENV:-.venv}
PY="$VENV/bin/python"
STAMP="$VENV/.dsv4-setup"
if [ ! -x "$PY" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV" >&2
fi
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  # The CPU build of torch: pip takes the 2.13.0 file that lies on this kind of machine; elsewhere set
  # TORCH_SPEC (e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
  log "installing ${TORCH_SPEC:-torch==2.13.0}, ${TRITON_SPEC:-triton==3.6.0} and the project's test dependencies"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q ${TORCH_SPEC:-torch==2.13.0} >&2
  # Triton pinned to the H200's version so the interpreter and the AOT compile check see its compiler;
  # TRITON_SPEC=triton takes the newest release instead (the second CI step: we support triton >= 3.6).
  "$PY" -m pip install -q -e ".[test,bench]" "${TRITON_SPEC:-triton==3.6.0}" >&2
  touch "$STAMP"
fi
echo "$PY"
