#!/bin/bash
# The GPU checks of moagen, on a machine with an NVIDIA GPU: verify the CUDA kernels against
# numpy and PyTorch, then run the atomics experiment (paper V, result 1) in CUDA and C.
# Results are JSON lines in the format of `moagen bench` (run, result records), under OUT.
#
#   bench/gpu.sh prepare          # here, with network: wheels and pycuda's source into wheelhouse/
#   OUT=/some/dir bench/gpu.sh    # there (no network needed): install, verify, atomics,
#                                 # OpenACC C vs Fortran where gcc offloads to the GPU
#
# pycuda ships as source only and links against the CUDA driver (libcuda), so it is built
# on the GPU machine itself, from the source distribution `prepare` downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=wheelhouse
PYCUDA=pycuda==2026.1
PY=${PYTHON:-python3}

if [ "${1:-}" = prepare ]; then
    PYVER=${PYVER:-3.12}  # the GPU machine's Python
    mkdir -p "$WHEELS"
    "$PY" -m pip download --no-deps --no-binary :all: -d "$WHEELS" "$PYCUDA"
    # pycuda's build and run dependencies, and moagen's own (torch is there already)
    "$PY" -m pip download -d "$WHEELS" --only-binary :all: --python-version "$PYVER" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
        pytools platformdirs mako siphash24 setuptools wheel numpy==2.4.6 \
        jinja2==3.1.6 sympy==1.14.0 cffi==2.0.0 f90wrap==0.3.0 meson==1.12.1 ninja==1.13.2 \
        matplotlib==3.11.2 pytest==9.0.3
    echo "wheels in $WHEELS; carry it to the GPU machine"
    exit 0
fi

OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
if ! "$PY" -c "import pycuda.driver" 2>/dev/null; then
    [ -d "$WHEELS" ] || { echo "no pycuda and no $WHEELS/: run 'bench/gpu.sh prepare' where there is network" >&2; exit 2; }
    export PATH=/usr/local/cuda/bin:$PATH CUDA_ROOT=${CUDA_ROOT:-/usr/local/cuda}
    "$PY" -m pip install --no-index --find-links "$WHEELS" --no-build-isolation "$PYCUDA"
fi
"$PY" -m pip install --no-index --find-links "$WHEELS" --no-deps -e . 2>/dev/null \
    || "$PY" -m pip install --no-index --find-links "$WHEELS" -e .
export MOAGEN_BUILD_DIR=${MOAGEN_BUILD_DIR:-build-gpu}
# the CUDA kernels against numpy and PyTorch; a failure stops the script (set -e)
"$PY" -m moagen.cli verify --lang cuda | tee "$OUT/verify-cuda.txt"
# result 1 on the GPU: fused atomic vs owner vs separate, in CUDA next to C (OpenMP)
"$PY" -m moagen.cli bench atomics --lang cuda --lang c --n 256 1024 2048 --out "$OUT/atomics.jsonl" \
    | tee "$OUT/atomics.txt"

# result 3 on the GPU (docs/OPENACC.md): OpenACC C, C without restrict and Fortran, built with
# gcc's nvptx offloading there (gcc-12-offload-nvptx, or gcc-N-offload-nvptx; libgomp's nvptx
# plugin runs them), timed next to the CUDA kernel of the same variant; and their device code
openacc_c_vs_fortran() {
    if ! "$PY" -c "from moagen.targets.openacc import devices; raise SystemExit(devices() == 0)"; then
        echo "OpenACC: libgomp finds no GPU (no libgomp-plugin-nvptx?): skipped" | tee "$OUT/openacc.txt"
        return 0
    fi
    "$PY" -m moagen.cli verify --lang openacc-c --lang openacc-fortran rmsnorm_bwd mlp_bwd \
        | tee "$OUT/verify-openacc.txt"
    "$PY" -m moagen.cli bench c-vs-fortran --target openacc --out "$OUT/openacc.jsonl" \
        | tee "$OUT/openacc.txt"
    PATH=/usr/local/cuda/bin:$PATH "$PY" -m moagen.cli bench c-vs-fortran --target openacc --ptx \
        --kernels mlp_bwd mlp_fwd --out "$OUT/openacc-ptx.jsonl" | tee "$OUT/openacc-ptx.txt"
}
openacc_c_vs_fortran
echo "results in $OUT"
