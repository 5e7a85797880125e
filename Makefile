# Two commands on a fresh machine: `make run` and `make test`. Each creates or refreshes the
# local virtualenv (.venv) with MPI (mpich, mpi4py) from the package index, builds the native
# module, then runs the training job or the test suite. `make docs` builds the documentation.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
NP     ?= 4
DEPS   := mpich mpi4py numpy pytest hypothesis ml_dtypes==0.6.0 scikit-learn torch==2.13.0 matplotlib \
          scikit-build-core pybind11 ninja cmake deepspeed==0.19.8 sphinx myst-parser
# ml_dtypes pinned: 0.7.0 takes 0.53 s to import (numpy 2.4), 0.6.0 0.056 s, and a test run
# imports it in about 120 processes (every rank of a pool, the torch workers).
# oneCCL, a peer of `pycoll-bench --compare`: its C++ packages and the Intel runtimes they load.
# --no-deps: oneccl-cpu 2022.2 names a libfabric the index does not have (its MPI transport
# needs none), and the impi-rt that older releases pull in would replace MPICH's libmpi.so.12.
PEER_DEPS := oneccl-cpu==2022.2.0 oneccl-cpu-devel==2022.2.0 intel-cmplr-lib-rt==2026.2.0 \
             intel-openmp==2026.2.0
LINT_DEPS := ruff clang-format
# With an NVIDIA driver present, cupy too: `make run` then trains on the GPU.
GPU_DEPS := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cupy-cuda13x)
# The CUDA transport's kernels for the GPU that is here (CMake reads CUDAARCHS; compute
# capability 9.0 -> 90). Without a GPU they are only compiled, to show they build: for one
# architecture instead of the plain install's two, half of nvcc's share of the build (the
# longest step). A GPU whose capability the driver does not report gets the plain default.
GPU_ARCH := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | \
              head -n1 | tr -d . | grep -E '^[0-9]+$$')
CUDA_ARCHS := $(if $(GPU_DEPS),$(GPU_ARCH),90)
ifneq ($(CUDA_ARCHS),)
export CUDAARCHS ?= $(CUDA_ARCHS)
endif

.PHONY: run test test-quick gpu-test lint format bench install clean coverage docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps: $(BIN)/python Makefile pyproject.toml
	$(BIN)/pip install -q --disable-pip-version-check $(DEPS) $(GPU_DEPS)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(PEER_DEPS)
	touch $@

# Editable install: the package imports from this tree; the native module is rebuilt
# incrementally (build/) whenever csrc/ changes. A checkout's build carries the emulated device
# (pycollectives._emu, the CUDA step kernel compiled for the host), which the tests run; a
# plain pip install leaves it out.
export PYCOLL_EMULATOR := ON
install: $(VENV)/.deps
	$(BIN)/pip install -q --disable-pip-version-check --no-build-isolation -e .

# DeepSpeed's shared-memory op (a peer of `pycoll-bench --compare deepspeed`), built ahead as
# DeepSpeed's installs with DS_BUILD_OPS do, into torch's extension cache: the tests and the
# benchmarks load it from there instead of compiling it on their first run (a minute). The cache
# lives in the virtualenv, beside the stamp that says it is built (another checkout's build would
# replace the op in the shared ~/.cache/torch_extensions).
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
$(VENV)/.peer-ops: $(VENV)/.deps
	PATH="$(CURDIR)/$(BIN):$$PATH" DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator \
	    import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" >/dev/null
	touch $@

run: install
	$(BIN)/mpiexec -n $(NP) $(BIN)/python -m pycollectives.examples.train

# The 15 slowest tests are listed at the end: the suite has a time budget (docs/architecture.md).
test: install $(VENV)/.peer-ops
	$(BIN)/python -m pytest -q --durations=15 tests

# Every collective once on 2 ranks, in under a minute: for the inner loop while developing.
test-quick: install
	$(BIN)/python -m pytest -q -m quick tests

gpu-test: install
	$(BIN)/python -m pytest -q -m gpu tests

# The documentation (docs/: Markdown pages, and the API reference from the docstrings of the
# installed package) as HTML in docs/_build/html; a warning is an error. The suite builds it
# the same way (tests/unit/test_docs.py) and runs its code (tests/ranks/test_readme.py).
docs: install
	$(BIN)/python -m sphinx -b html -q -W --keep-going docs docs/_build/html

bench: install $(VENV)/.peer-ops
	bash benchmarks/bench_sweep.sh

# Line coverage of the suite: the native modules built again with gcov instrumentation (in
# build/coverage/native), the suite run with Python coverage in every process (a .pth file
# starts it wherever COVERAGE_PROCESS_START is set), then line coverage per folder of csrc/ and
# per module of pycollectives/ (tools/coverage/report.py). The normal build is put back after.
COV_DEPS := coverage gcovr
COV := $(CURDIR)/build/coverage
coverage: $(VENV)/.deps
	$(BIN)/pip install -q --disable-pip-version-check $(COV_DEPS)
	rm -rf $(COV) && mkdir -p $(COV)/python
	PYCOLL_COVERAGE=ON $(BIN)/pip install -q --disable-pip-version-check --no-build-isolation \
	    -C build-dir=$(COV)/native -e .
	pth=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/pycoll_coverage.pth; \
	echo "import coverage; coverage.process_startup()" > $$pth; \
	COVERAGE_PROCESS_START=$(CURDIR)/tools/coverage/coveragerc COVERAGE_DATA_DIR=$(COV)/python \
	    $(BIN)/python -m pytest -q tests; suite=$$?; \
	rm -f $$pth; \
	COVERAGE_DATA_DIR=$(COV)/python $(BIN)/coverage combine -q --rcfile=tools/coverage/coveragerc \
	&& COVERAGE_DATA_DIR=$(COV)/python COVERAGE_RCFILE=tools/coverage/coveragerc \
	    $(BIN)/python tools/coverage/report.py $(COV)/native --json $(COV)/figures.json; \
	report=$$?; \
	$(BIN)/pip install -q --disable-pip-version-check --no-build-isolation -e .; \
	echo "suite exit status under coverage: $$suite"; \
	test $$suite -eq 0 -a $$report -eq 0

$(VENV)/.lint-deps: $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check $(LINT_DEPS)
	touch $@

lint: $(VENV)/.lint-deps
	$(BIN)/ruff check pycollectives tests benchmarks tools
	$(BIN)/ruff format --check pycollectives tests benchmarks tools
	$(BIN)/clang-format --dry-run -Werror $$(find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh')

format: $(VENV)/.lint-deps
	$(BIN)/ruff format pycollectives tests benchmarks tools
	$(BIN)/ruff check --fix pycollectives tests benchmarks tools
	$(BIN)/clang-format -i $$(find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh')

clean:
	rm -rf build $(VENV) .pytest_cache docs/_build
