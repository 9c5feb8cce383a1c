# moagen: emit, build, verify and test the generated kernels.
# Everything runs in .venv, created on first use with the pinned dependencies.
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
MOAGEN := $(VENV)/bin/moagen
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: all generated build verify verify-cuda-emulated build-openacc verify-openacc ptx-openacc verify-ranks gpu-dry-run test bench example-lm clean

all: generated build

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

.PHONY: all generated build verify verify-cuda-emulated build-openacc verify-openacc ptx-openacc verify-ranks gpu-dry-run test bench clean

test: $(VENV)/.installed
	$(PYTHON) -m pytest -q -n auto --dist loadfile  # every core, a file's tests on one

bench: $(VENV)/.installed  # the full sweep; BENCH_ARGS=--quick for a sanity run
	$(MOAGEN) bench $(BENCH_ARGS)

example-lm: $(VENV)/.installed  # moagen.torch on a tiny char LM against PyTorch (minutes)
	$(PYTHON) examples/train_tiny_lm.py $(EXAMPLE_ARGS)
	$(PYTHON) examples/train_tiny_lm.py --memory 2048 4096

clean:
	rm -rf build
