# moagen: emit, build, verify and test the generated kernels.
# Everything runs in .venv, created on first use with the pinned dependencies.
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
MOAGEN := $(VENV)/bin/moagen
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: system-packages all generated build verify verify-cuda-emulated verify-cuda-racecheck build-openacc verify-openacc ptx-openacc verify-ranks gpu-dry-run test bench example-lm clean

all: generated build

system-packages:  # the compilers, OpenACC offloading, MPI, Slurm, valgrind (apt-get; root or sudo)
	tools/system-packages.sh

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $@

generated: $(VENV)/.installed
	$(MOAGEN) generate

build: $(VENV)/.installed
	$(MOAGEN) build

verify: $(VENV)/.installed
	$(MOAGEN) verify

verify-cuda-emulated: $(VENV)/.installed  # every CUDA kernel run on the host, no GPU needed
	$(MOAGEN) verify --lang cuda --emulate

verify-cuda-racecheck: $(VENV)/.installed  # the same, every shared-memory access race-checked
	$(MOAGEN) verify --lang cuda --emulate --racecheck

# OpenACC C and Fortran with gcc's nvptx offloading (apt-get install gcc-12-offload-nvptx),
# run on the host where there is no GPU; and their device code side by side (docs/OPENACC.md)
build-openacc: $(VENV)/.installed
	$(MOAGEN) build --lang openacc-c --lang openacc-fortran

verify-openacc: $(VENV)/.installed
	$(MOAGEN) verify --lang openacc-c --lang openacc-fortran

ptx-openacc: $(VENV)/.installed
	$(MOAGEN) bench c-vs-fortran --target openacc --ptx

# the distributed kernels on 1..4 MPI ranks (oversubscribed past the cores: one thread a
# rank), C and Fortran, both dtypes; OpenMPI refuses root unless told twice
RANKS ?= 1 2 3 4
verify-ranks: $(VENV)/.installed
	set -e; for p in $(RANKS); do \
	  OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	  mpirun --oversubscribe -np $$p $(MOAGEN) verify --ranks; done

gpu-dry-run: $(VENV)/.installed  # every step of bench/gpu.sh on the CUDA emulation (minutes)
	[ -e wheelhouse/pycuda/pycuda-2026.1.tar.gz ] && [ -e wheelhouse/toolchain/gcc12-openacc.tar.xz ] || \
	  PYTHON=$(PYTHON) bench/gpu.sh prepare
	PYTHON=$(PYTHON) OUT=bench-results/gpu-dry-run bench/gpu.sh --dry-run

test: $(VENV)/.installed
	$(PYTHON) -m pytest -q -n auto --dist worksteal  # every core: each worker its share of the tests in order, an idle one taking over the rest

bench: $(VENV)/.installed  # the full sweep; BENCH_ARGS=--quick for a sanity run
	$(MOAGEN) bench $(BENCH_ARGS)

example-lm: $(VENV)/.installed  # moagen.torch on a tiny char LM against PyTorch (minutes)
	$(PYTHON) examples/train_tiny_lm.py $(EXAMPLE_ARGS)
	$(PYTHON) examples/train_tiny_lm.py --memory 2048 4096

clean:
	rm -rf build
