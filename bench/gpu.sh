#!/bin/bash
# The GPU checks of moagen, on a machine with an NVIDIA GPU and no network (an H200: python3
# 3.12 with torch, cupy, cuda-python and nvcc 13; no cffi). In under 9 minutes:
#   1. every CUDA kernel, variant and dtype verified on the device against numpy and PyTorch,
#      and the device-resident calls (torch tensors, cupy arrays) tested (tests/test_cuda_gpu.py);
#      moagen.torch on CUDA tensors tested (tests/test_torch_cuda.py), the tiny language
#      model (examples/train_tiny_lm.py) trained on the GPU with moagen's operators and PyTorch's,
#      and each operator's forward + backward timed against PyTorch's (its --operators);
#   2. the atomics experiment (paper V, result 1) in CUDA: fused atomic vs owner vs separate;
#   3. `moagen bench --lang cuda` against PyTorch's SDPA on the same GPU, float32 and float64,
#      d 64, n 1024 to 16384, by CUDA events on device-resident arrays (the online variant, and
#      the flash one moagen.torch runs on CUDA tensors); and decode
#      (flash-decoding's split) against SDPA and the device's copy bandwidth; and the tiled
#      MLP's forward and backward against PyTorch's;
#   4. OpenACC C, C without restrict and Fortran timed next to CUDA, where gcc offloads there;
# results, summaries and plots under WORK, packed into one archive in OUT
# (gpu-results.tar.gz) next to the machine, verification, atomics and bench summaries: a
# device machine hands back a few files of OUT, not a tree.
#
#   bench/gpu.sh prepare            # here, with network: the wheels the GPU machine lacks
#   OUT=/some/dir bench/gpu.sh      # there: carry wheelhouse/ with the working tree
#   bench/gpu.sh --dry-run          # here, no GPU: every step on the CUDA emulation, small sizes
#
# Each step is a function, run under a time limit of its own (a new step: a function, and
# its line in main); the script goes on after a failed step (what it measured stays in its
# JSON lines), then exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=wheelhouse
PY=${PYTHON:-python3}
FAILED=()

prepare() {
    local pyver=${PYVER:-3.12}  # the GPU machine's Python
    mkdir -p "$WHEELS"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" cffi==2.0.0 pycparser==2.23
    echo "wheels in $WHEELS; carry it to the GPU machine"
}

# moagen from this checkout, and the wheels the machine lacks, in a private site folder
setup_python() {
    if ! "$PY" -c "import cffi" 2>/dev/null; then
        [ -d "$WHEELS" ] || { echo "no cffi and no $WHEELS/: run 'bench/gpu.sh prepare' where there is network" >&2; exit 2; }
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    fi
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    export MOAGEN_BUILD_DIR=${MOAGEN_BUILD_DIR:-$PWD/build/gpu}
    # machine code for the H200 itself (nvcc's default target is older, JIT-compiled PTX)
    export MOAGEN_NVCCFLAGS=${MOAGEN_NVCCFLAGS:--O3 -arch=sm_90}
}

# step NAME SECONDS FUNCTION [ARGS...]: one step under its limit, its output in WORK/NAME.txt
step() {
    local name=$1 limit=$(($2 * LIMIT_SCALE)) start=$SECONDS
    shift 2
    echo "== $name (limit ${limit}s): $*"
    export -f "$1"
    if timeout "$limit" bash -c '"$@"' step "$@" > "$WORK/$name.txt" 2>&1; then
        echo "   ok in $((SECONDS - start)) s"
    else
        echo "   FAILED ($?) after $((SECONDS - start)) s; the end of $WORK/$name.txt:"
        tail -n 25 "$WORK/$name.txt" | sed 's/^/   | /'
        FAILED+=("$name")
    fi
}

record_machine() {
    { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
      nvcc --version | tail -n 2 || true
      "$PY" -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"
      "$PY" -m pip list 2>/dev/null | grep -iE '^(cuda-bindings|cupy|cffi) ' || true
    } > "$WORK/machine.txt" 2>&1
    cat "$WORK/machine.txt"
}

# every kernel variant (of VERIFY_KERNELS), both dtypes, a process each, in parallel: the
# nvcc builds are most of the time; each variant's table printed as it is done
verify_cuda() {
    "$PY" -c "import sys; from moagen.kernels import get_kernel
for k in sys.argv[1:]: print(*(f'{k} {v}' for v in get_kernel(k).variants), sep='\n')" \
        $VERIFY_KERNELS |
        xargs -P "$JOBS" -L 1 sh -c '"$0" -m moagen.cli verify --lang "$CUDA" "$1" --variant "$2" \
            > "$WORK/verify/$1-$2.txt" 2>&1 || echo "$1 $2" >> "$WORK/verify/failed"
            cat "$WORK/verify/$1-$2.txt"' "$PY"
    [ ! -e "$WORK/verify/failed" ]
}

# each test named as it ends (a step cut off still says which ran), each under a limit of
# its own where pytest-timeout is there (the GPU machine's image has it)
device_arrays() {
    local limit=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 60)
    "$PY" -m pytest -v -p no:cacheprovider "${limit[@]}" --durations=0 tests/test_cuda_gpu.py \
        tests/test_torch_cuda.py
}

# the tiny model's training on the GPU, moagen's operators and PyTorch's in lockstep: float64
# losses equal to 1e-9 at every step (the example exits non-zero otherwise), the step times
tiny_lm() {
    "$PY" examples/train_tiny_lm.py --device cuda --steps $LM_STEPS --dtype float64 float32 \
        --out "$WORK/tiny-lm"
}

# each moagen.torch operator's forward + backward against PyTorch's, at the tiny LM's sizes
operator_times() {
    "$PY" examples/train_tiny_lm.py --device cuda --operators 30 --dtype float64 float32 \
        --out "$WORK/tiny-lm"
}

atomics() {
    "$PY" -m moagen.cli bench atomics --lang "$CUDA" --n $ATOMICS_N $DRY_RUN \
        --out "$WORK/atomics.jsonl"
}

# attention forward against SDPA on the same GPU: bench_vs_sdpa DTYPE D
bench_vs_sdpa() {
    "$PY" -m moagen.cli bench --lang "$CUDA" --kernels $BENCH_KERNELS --dtype "$1" --size d="$2" \
        --n $BENCH_N --threads "$JOBS" --baselines torch --untuned $DRY_RUN \
        --out "$WORK/bench-$1-d$2.jsonl"
}

# decode, a memory-bound kernel: its GB/s against the device's copy bandwidth (% copy)
bench_decode() {
    "$PY" -m moagen.cli bench --lang "$CUDA" --kernels attention_decode:split --dtype float32 \
        --n $DECODE_N --threads "$JOBS" --baselines torch --untuned $DRY_RUN \
        --out "$WORK/bench-decode.jsonl"
}

# the register-tiled products, a GPU thread per tile, against PyTorch's matmuls and silu
bench_mlp() {
    "$PY" -m moagen.cli bench --lang "$CUDA" --kernels mlp_fwd:tiled mlp_bwd:tiled --dtype float32 \
        --n $MLP_N --threads "$JOBS" --baselines torch --untuned $DRY_RUN \
        --out "$WORK/bench-mlp.jsonl"
}

# result 3 on the GPU (docs/OPENACC.md): OpenACC C, C without restrict and Fortran, built with
# gcc's nvptx offloading there (gcc-12-offload-nvptx, or gcc-N-offload-nvptx; libgomp's nvptx
# plugin runs them), timed next to the CUDA kernel of the same variant; and their device code
openacc_c_vs_fortran() {
    if ! "$PY" -c "from moagen.targets.openacc import devices; raise SystemExit(devices() == 0)"; then
        echo "OpenACC: libgomp finds no GPU (no libgomp-plugin-nvptx?): skipped"
        return 0
    fi
    "$PY" -m moagen.cli verify --lang openacc-c --lang openacc-fortran rmsnorm_bwd mlp_bwd
    "$PY" -m moagen.cli bench c-vs-fortran --target openacc --out "$WORK/openacc.jsonl"
    PATH=/usr/local/cuda/bin:$PATH "$PY" -m moagen.cli bench c-vs-fortran --target openacc --ptx \
        --kernels mlp_bwd mlp_fwd --out "$WORK/openacc-ptx.jsonl"
}

# summaries and plots of whatever was measured (a step cut short writes none itself), then
# into OUT: one archive of everything, and the texts to read first
pack() {
    local results
    for results in "$WORK"/*.jsonl; do
        [ -e "$results" ] && "$PY" -m moagen.cli report "$results" > /dev/null
    done
    tar -czf "$OUT/gpu-results.tar.gz" -C "$WORK" .
    cp "$WORK"/machine.txt "$WORK"/verify-cuda.txt "$WORK"/device-arrays.txt "$WORK"/tiny-lm.txt \
        "$WORK"/operators.txt "$WORK"/atomics.txt "$OUT"/ 2>/dev/null
    cat "$WORK"/bench-*/summary.md > "$OUT/bench-summary.md" 2>/dev/null
    echo "results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}

main() {
    export OUT=${OUT:-bench-results/gpu} WORK=${WORK:-/tmp/moagen-gpu} PY
    SITE=${SITE:-/tmp/moagen-site}
    export JOBS=$(nproc)
    rm -rf "$WORK"
    mkdir -p "$OUT" "$WORK/verify"
    if [ "${1:-}" = --dry-run ]; then
        # the CUDA emulation in the GPU's place; the same commands, sizes a 2-core machine runs
        export CUDA=cuda-emulated DRY_RUN=--dry-run ATOMICS_N="16" BENCH_N="32 64" DECODE_N="40"
        export LM_STEPS=0 MLP_N="16"
        LIMIT_SCALE=4  # a shared 2-core machine running a GPU's threads
        local kernels="rmsnorm_fwd attention_decode"  # all: make verify-cuda-emulated
        local sizes="float32:16 float64:16"
    else
        export CUDA=cuda DRY_RUN= ATOMICS_N="256 1024 2048" BENCH_N="1024 4096 16384"
        export DECODE_N="8192 32768" LM_STEPS=60 MLP_N="1024 4096"
        LIMIT_SCALE=1
        local kernels=all
        local sizes="float32:64 float64:64"
    fi
    export BENCH_KERNELS="attention_fwd:online attention_fwd:flash"
    setup_python
    [ "$kernels" != all ] || kernels=$("$PY" -c "from moagen.kernels import KERNELS; print(*KERNELS)")
    export VERIFY_KERNELS=$kernels
    record_machine
    # limits that add up to 8.6 minutes (verify-cuda took 74 s on the H200)
    step verify-cuda 110 verify_cuda
    [ -n "$DRY_RUN" ] || step device-arrays 150 device_arrays
    [ -n "$DRY_RUN" ] || step tiny-lm 45 tiny_lm
    [ -n "$DRY_RUN" ] || step operators 20 operator_times
    step atomics 35 atomics
    local size
    for size in $sizes; do
        step "bench-${size/:/-d}" 45 bench_vs_sdpa "${size%:*}" "${size#*:}"
    done
    step bench-decode 25 bench_decode
    step bench-mlp 30 bench_mlp
    step openacc 10 openacc_c_vs_fortran
    pack
    if [ ${#FAILED[@]} -gt 0 ]; then
        echo "failed steps: ${FAILED[*]}"
        exit 1
    fi
}

if [ "${1:-}" = prepare ]; then
    prepare
else
    main "$@"
fi
