# make parity  — the main job: the parity check on whatever hardware is present (exits non-zero on failure)
# make test    — the test suite (CPU: reference self-checks, Triton kernels in the interpreter, AOT compile)
# make bench   — benchmarks (real figures on a GPU; a seconds-long smoke run on a CPU)
# Each target sets up the python it needs through .ci/setup.sh.

SHELL := /bin/bash
PY = $(shell bash .ci/setup.sh)
# Triton kernels run on the CPU interpreter when there is no GPU.
GPU = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))")
INTERPRET = $(if $(filter 1,$(GPU)),0,1)
PARITY_ARGS ?=
TEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: parity test bench lint clean

parity:
	OPENBLAS_NUM_THREADS=1 TRITON_INTERPRET=$(INTERPRET) $(PY) -m parity_tests $(PARITY_ARGS)

# One BLAS thread: NumPy's (the interpreter's) and torch's thread pools otherwise fight on small CPUs.
test:
	OPENBLAS_NUM_THREADS=1 TRITON_INTERPRET=$(INTERPRET) $(PY) -m pytest -q $(TEST_ARGS)

bench:
	TRITON_INTERPRET=$(INTERPRET) $(PY) -m benchmarks $(BENCH_ARGS)

lint:
	$(PY) -m ruff check .

clean:
	rm -rf .venv .venv-triton-latest .venv-torch-min .pytest_cache build *.egg-info
