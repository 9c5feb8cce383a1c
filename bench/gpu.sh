#!/bin/bash
# The GPU checks of moagen, on a machine with an NVIDIA GPU and no network (an H200: python3
# 3.12 with numpy, torch, cupy, cuda-python, nvcc 13 and gcc 13.3; no cffi, no pycuda). In
# under 8 minutes (DEADLINE, below):
#   1. every CUDA kernel, variant and dtype verified on the device against numpy and PyTorch,
#      and the device-resident calls (torch tensors, cupy arrays) tested (tests/test_cuda_gpu.py);
#      moagen.torch on CUDA tensors tested (tests/test_torch_cuda.py); pycuda built from its
#      source (carried) and kernels called with its GPUArrays (tests/test_pycuda_gpu.py);
#      the tiny language model (examples/train_tiny_lm.py) trained on the GPU with moagen's
#      operators and PyTorch's, and each operator's forward + backward timed against
#      PyTorch's (its --operators);
#   2. the atomics experiment (paper V, result 1) in CUDA: fused atomic vs owner vs separate;
#   3. `moagen bench --lang cuda` against PyTorch's SDPA on the same GPU, by CUDA events on
#      device-resident arrays, at batch 1 and 8 heads: d 64, the online variant and the flash
#      one moagen.torch runs on CUDA tensors, float32 and float64, n 1024, 4096, 16384; d 128,
#      the flash variant alone, float32 at the same n, float64 at n 1024 and 4096 (the sweep
#      shrunk to fit: at 4 heads, d 64 the first run took 0.52 s (float32) and 0.70 s
#      (float64) a call of online at n 16384, 6 calls a size; 8 heads and d 128 are four
#      times that); the backward, flash (dQ a pass of its own) and dq_atomic (dQ by atomics
#      from the key tiles), float32 d 64 at n 1024 and 4096, against SDPA's autograd; and
#      decode (flash-decoding's split) against SDPA and the device's copy
#      bandwidth; and the tiled MLP's forward and backward against PyTorch's;
#   4. OpenACC C, C without restrict and Fortran verified on the device and timed next to
#      CUDA, built with a carried gcc 12 (below: the machine has neither gfortran nor gcc's
#      nvptx offloading); a probe first says the regions run on the GPU (libgomp falls back
#      to the host silently), then GOMP_DEBUG's launch lines; the C-vs-Fortran CPU half with
#      the same compilers; and ncu's stall reasons for the widest Fortran / C gap, where ncu
#      may read the counters;
# results, summaries and plots under WORK, packed into one archive in OUT
# (gpu-results.tar.gz) next to the machine, verification, atomics and bench summaries: a
# device machine hands back a few files of OUT, not a tree.
#
#   bench/gpu.sh prepare            # here, with network: the wheels the GPU machine lacks
#   OUT=/some/dir bench/gpu.sh      # there: carry wheelhouse/ with the working tree
#   bench/gpu.sh --dry-run          # here, no GPU: every step on the CUDA emulation, small sizes
#   ONLY='openacc|c-vs-fortran' bench/gpu.sh   # only the steps whose names match (a regex)
#
# Each step is a function, run under a time limit of its own (a new step: a function, and
# its line in main), cut to the time left before the script's DEADLINE; the script goes on
# after a failed step (what it measured stays in its JSON lines), skips the steps there is no
# time left for (the last, least needed), then exits non-zero if any step failed or was
# skipped.
#
# What is carried (wheelhouse/, made by prepare, with the working tree: 64 MiB at most in
# all): cffi and pycparser (0.3 MiB), and in wheelhouse/pycuda/ pycuda 2026.1's source
# (1.6 MiB) with the wheels it needs to build and run that the machine lacks: pure Python
# (pytools, platformdirs, mako, typing_extensions, setuptools, wheel, packaging) but for two
# small binary ones for its Python 3.12 (markupsafe, siphash24), 1.4 MiB; and in
# wheelhouse/toolchain/ gcc 12 with nvptx offloading (tools/openacc-toolchain.sh: Debian
# bookworm's gcc-12, gfortran-12, gcc-12-offload-nvptx, nvptx-tools and their runtimes, 51 MB
# of .deb, unpacked and pruned to 117 MiB, xz -9: 18.3 MiB; its MANIFEST lists each package),
# unpacked into WORK there, where it takes binutils, glibc and the compilers' libraries from
# the machine's gcc 13. wheelhouse/: 21.6 MiB; with the tracked files (39.0 MiB) 60.6 MiB on
# 2026-12-08 (`bench/gpu.sh prepare` prints it).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=wheelhouse
TOOLCHAIN=$WHEELS/toolchain/gcc12-openacc.tar.xz  # tools/openacc-toolchain.sh
PY=${PYTHON:-python3}
FAILED=()

prepare() {
    local pyver=${PYVER:-3.12}  # the GPU machine's Python
    mkdir -p "$WHEELS"
    local binary=(--no-deps --only-binary=:all: --python-version "$pyver" --implementation cp
                  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
                  --platform manylinux2014_x86_64)
    mkdir -p "$WHEELS/pycuda"
    "$PY" -m pip download "${binary[@]}" -d "$WHEELS" cffi==2.0.0 pycparser==2.23 || return
    # pycuda's source, built there against the driver (it links libcuda); what it imports
    # (pytools: platformdirs, siphash24, typing_extensions; mako: markupsafe) and what
    # building it takes besides the machine's numpy (setuptools, wheel: packaging)
    "$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation -d "$WHEELS/pycuda" \
        pycuda==2026.1 || return
    "$PY" -m pip download "${binary[@]}" -d "$WHEELS/pycuda" pytools==2026.1.1 \
        platformdirs==4.14.9 siphash24==1.9 typing_extensions==4.16.0 mako==1.4.3 \
        markupsafe==3.0.4 setuptools==84.2.1 wheel==0.48.0 packaging==26.4 || return
    # gcc 12 with nvptx offloading (about 2 minutes of xz on 2 cores; delete it to remake)
    [ -e "$TOOLCHAIN" ] || tools/openacc-toolchain.sh "$TOOLCHAIN" || return
    du -sh "$WHEELS" "$WHEELS/pycuda" "$TOOLCHAIN"
    echo "what travels: $(travels)"
    echo "wheels and the toolchain in $WHEELS; carry it to the GPU machine"
}

# MiB that travel to the GPU machine: the tracked files and wheelhouse/ (64 MiB at most)
travels() {
    { git ls-files -z | du -cb --files0-from=- | tail -n 1; du -sb "$WHEELS"; } |
        awk '{ bytes += $1 } END { printf "%.1f MiB\n", bytes / 2^20 }'
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

# step NAME SECONDS FUNCTION [ARGS...]: one step under its limit (no later than DEADLINE
# seconds into the script), its output in WORK/NAME.txt
step() {
    local name=$1 limit=$(($2 * LIMIT_SCALE)) start=$SECONDS left=$((DEADLINE - SECONDS))
    shift 2
    [[ $name =~ ${ONLY:-.} ]] || return 0
    if [ "$left" -lt 10 ]; then
        echo "== $name: SKIPPED, ${left}s left before the deadline"
        FAILED+=("$name(skipped)")
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
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
      "$PY" -m pip list 2>/dev/null | grep -iE '^(cuda-bindings|cupy[-a-z0-9]*|cffi|pycuda|setuptools) ' || true
    } > "$WORK/machine.txt" 2>&1
    cat "$WORK/machine.txt"
}

# every kernel variant (of VERIFY_KERNELS), both dtypes, a process each, in parallel: the
# nvcc builds are most of the time; each variant's table printed as it is done
verify_cuda() {
    "$PY" -c "import sys; from moagen.kernels import get_kernel
for k in sys.argv[1:]: print(*(f'{k} {v}' for v in get_kernel(k).variants_on('cuda')), sep='\n')" \
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

# pycuda built from the carried source (bench/build_pycuda.py: setuptools' build with every
# core compiling), installed offline into SITE with what it imports that the machine lacks,
# then kernels called with its GPUArrays; in a dry run (no libcuda to link against, minutes
# of C++ on 2 cores) the carried files are checked, the install resolved offline, and the
# same tests run (they skip without a GPU) next to the GPUArray kind on the emulation
pycuda_arrays() {
    local dir=$WHEELS/pycuda sdist build_site=$WORK/pycuda-build-site wheel
    sdist=$(ls "$dir"/pycuda-2026.1.tar.gz 2>/dev/null) ||
        { echo "no pycuda source in $dir: run 'bench/gpu.sh prepare' where there is network"; return 2; }
    local limit=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 60)
    if [ -n "$DRY_RUN" ]; then
        # the source's metadata, and what it needs resolved from the carried wheels alone for
        # the GPU machine's Python
        "$PY" -m pip install --dry-run --no-deps --ignore-installed --no-index \
            --no-build-isolation "$sdist" || return
        "$PY" -m pip install --dry-run --target "$WORK/pycuda-dry-run" --no-index \
            --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
            --platform manylinux_2_17_x86_64 --find-links "$dir" pytools platformdirs mako \
            setuptools wheel || return
        "$PY" -m pytest -v -p no:cacheprovider tests/test_cuda_array_kinds.py tests/test_pycuda_gpu.py
        return
    fi
    "$PY" -m pip install -q --no-index --no-deps --target "$build_site" \
        "$dir"/setuptools-*.whl "$dir"/wheel-*.whl "$dir"/packaging-*.whl || return
    PYTHONPATH="$build_site:$PYTHONPATH" "$PY" bench/build_pycuda.py "$sdist" "$WORK/pycuda-wheel" ||
        { echo "pycuda did not build from $sdist"; return 1; }
    wheel=$(ls "$WORK"/pycuda-wheel/pycuda-*.whl) || return
    local module wanted=("$wheel")  # only what the machine lacks: a newer torch's own stays
    for module in pytools platformdirs siphash24 typing_extensions mako markupsafe; do
        "$PY" -c "import $module" 2>/dev/null || wanted+=("$(ls "$dir/$module"-*.whl)")
    done
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${wanted[@]}" || return
    "$PY" -c "import pycuda, pycuda.autoprimaryctx as p; print('pycuda', pycuda.VERSION_TEXT, 'on', p.device.name())" ||
        return
    "$PY" -m pytest -v -p no:cacheprovider "${limit[@]}" tests/test_pycuda_gpu.py
}

# the tiny model's training on the GPU, moagen's operators and PyTorch's in lockstep: float64
# losses equal to 1e-9 at every step (the example exits non-zero otherwise), the step times
tiny_lm() {
    "$PY" examples/train_tiny_lm.py --device "$LM_DEVICE" --steps $LM_STEPS $LM_SIZES \
        --dtype float64 float32 --out "$WORK/tiny-lm"
}

# each moagen.torch operator's forward + backward against PyTorch's, at the tiny LM's sizes
operator_times() {
    "$PY" examples/train_tiny_lm.py --device "$LM_DEVICE" --operators $LM_OPERATOR_CALLS \
        $LM_SIZES --dtype float64 float32 --out "$WORK/tiny-lm"
}

atomics() {
    "$PY" -m moagen.cli bench atomics --lang "$CUDA" --n $ATOMICS_N $DRY_RUN \
        --out "$WORK/atomics.jsonl"
}

# attention against SDPA (its autograd for a backward) on the same GPU, batch 1 and
# BENCH_HEADS heads: bench_vs_sdpa DTYPE D "KERNEL:VARIANT..." "N..." [NAME]
bench_vs_sdpa() {
    "$PY" -m moagen.cli bench --lang "$CUDA" --kernels $3 --dtype "$1" --size batch=1 \
        --size heads="$BENCH_HEADS" --size d="$2" --n $4 --threads "$JOBS" --baselines torch \
        --untuned $DRY_RUN --out "$WORK/bench-${5:-$1-d$2}.jsonl"
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

# gcc 12 with nvptx offloading, carried (tools/openacc-toolchain.sh: the machine has gcc 13
# but neither gfortran nor offloading), unpacked into WORK; each step that builds C or
# Fortran sources its env.sh in its own shell (CC, FC, and LD_LIBRARY_PATH with the libgomp
# its nvptx plugin was built with), so the CUDA steps keep the machine's libgomp
acc_env() {
    source "$WORK/gcc12-openacc/env.sh"
}

# unpacked, and a probe built with moagen's offload flags (-misa=sm_80) and run: on the GPU
# its region must run on the device, as GOMP_DEBUG's launch line says (libgomp falls back to
# the host silently); in a dry run, no GPU here, on the host
openacc_toolchain() {
    [ -e "$TOOLCHAIN" ] || { echo "no $TOOLCHAIN: run 'bench/gpu.sh prepare' where there is network"; return 2; }
    tar -xJf "$TOOLCHAIN" -C "$WORK" && acc_env || return
    "$CC" --version | head -n 1
    "$FC" --version | head -n 1
    local probe=$WORK/openacc-probe
    "$CC" -O2 -no-pie $("$PY" -c "from moagen.targets.toolchain import OFFLOAD; print(*OFFLOAD)") \
        bench/openacc_probe.c -o "$probe" || return
    ACC_DEVICE_TYPE=$ACC_DEVICE GOMP_DEBUG=1 "$probe" > "$probe.txt" 2>&1
    local status=$?
    grep -v '^ ' "$probe.txt" | grep -m 5 -E "nvidia devices|libgomp|GOACC_parallel"
    [ "$status" -eq 0 ] || return
    if grep -q -E "$ACC_LAUNCH" "$probe.txt"; then
        echo "the probe's region launched where it should ($ACC_DEVICE: /$ACC_LAUNCH/)"
    else
        echo "no /$ACC_LAUNCH/ in GOMP_DEBUG's output: the region did not run on $ACC_DEVICE"
        return 1
    fi
}

# result 3's CPU half with the carried gcc and gfortran 12 (the machine has no gfortran),
# every core
cpu_c_vs_fortran() {
    acc_env || return
    "$PY" -m moagen.cli bench c-vs-fortran $CPU_C_VS_FORTRAN --out "$WORK/c-vs-fortran-cpu.jsonl"
}

# result 3 on the GPU (docs/OPENACC.md): OpenACC C, C without restrict and Fortran, built with
# the carried gcc 12's nvptx offloading (-misa=sm_80: CUDA 13's ptxas refuses gcc 12's
# default sm_35), verified with ACC_DEVICE_TYPE=nvidia (libgomp then fails rather than run on
# the host) and their launches counted in GOMP_DEBUG's output, timed next to the CUDA kernel of
# the same variant; and their device code. A dry run verifies on the host (no GPU here) and
# cannot time: timing refuses the host fallback
openacc_c_vs_fortran() {
    acc_env || return
    local debug=$WORK/openacc-gomp-debug.txt
    ACC_DEVICE_TYPE=$ACC_DEVICE GOMP_DEBUG=1 "$PY" -m moagen.cli verify --lang openacc-c \
        --lang openacc-fortran rmsnorm_bwd mlp_bwd 2> "$debug" || { tail -n 20 "$debug"; return 1; }
    echo "GOMP_DEBUG: $(grep -c -E "$ACC_LAUNCH" "$debug") region launches on $ACC_DEVICE (/$ACC_LAUNCH/)"
    grep -q -E "$ACC_LAUNCH" "$debug" || return
    gzip "$debug"
    if [ -n "$DRY_RUN" ]; then
        echo "dry run: no GPU here, so no times (bench c-vs-fortran --target openacc refuses the host)"
        return 0
    fi
    ACC_DEVICE_TYPE=nvidia "$PY" -m moagen.cli bench c-vs-fortran --target openacc \
        --out "$WORK/openacc.jsonl" || return
    PATH=/usr/local/cuda/bin:$PATH "$PY" -m moagen.cli bench c-vs-fortran --target openacc --ptx \
        --kernels mlp_bwd mlp_fwd --out "$WORK/openacc-ptx.jsonl"
}

# why the OpenACC kernel with the largest Fortran / C gap stalls (ncu's warp states, C and
# Fortran's regions alike, gcc names them *_omp_fn*): where ncu is there and may read the
# counters; its refusal (ERR_NVGPUCTRPERM) is logged, not a failure
openacc_stalls() {
    acc_env || return
    if [ -n "$DRY_RUN" ]; then echo "dry run: no GPU here, no ncu"; return 0; fi
    local ncu
    ncu=$(PATH=/usr/local/cuda/bin:$PATH command -v ncu) || { echo "no ncu on this machine"; return 0; }
    local widest
    widest=$("$PY" -c "import json, math, sys
from moagen.bench.c_vs_fortran_plan import median_times
t = median_times([json.loads(line) for line in open(sys.argv[1])], ('openacc-c', 'openacc-fortran'))
k, v, n = max(t, key=lambda key: abs(math.log(t[key]['openacc-fortran'] / t[key]['openacc-c'])))
print(f'{k}:{v} {n}')" "$WORK/openacc.jsonl") || { echo "no OpenACC times to pick from"; return 1; }
    echo "the widest Fortran / C gap: $widest"
    set -- $widest
    ACC_DEVICE_TYPE=nvidia "$ncu" --target-processes all --section WarpStateStats \
        --section SchedulerStats -k regex:_omp_fn --launch-count 40 \
        "$PY" -m moagen.cli bench c-vs-fortran --target openacc --kernels "$1" --n "$2" \
        --repeats 1 --out "$WORK/openacc-ncu.jsonl" > "$WORK/openacc-stalls.txt" 2>&1
    local status=$?
    if grep -q ERR_NVGPUCTRPERM "$WORK/openacc-stalls.txt"; then
        echo "ncu refused: no permission for the GPU's performance counters (ERR_NVGPUCTRPERM)"
        return 0
    fi
    grep -E "_omp_fn|Stall|Warp Cycles|Issued" "$WORK/openacc-stalls.txt" | head -n 80
    return "$status"
}

# summaries and plots of whatever was measured (a step cut short writes none itself), then
# into OUT: one archive of everything, and the texts to read first
pack() {
    local results
    for results in "$WORK"/*.jsonl; do
        [ -e "$results" ] && "$PY" -m moagen.cli report "$results" > /dev/null
    done
    tar -czf "$OUT/gpu-results.tar.gz" -C "$WORK" .
    cp "$WORK"/machine.txt "$WORK"/verify-cuda.txt "$WORK"/device-arrays.txt "$WORK"/pycuda.txt \
        "$WORK"/tiny-lm.txt \
        "$WORK"/operators.txt "$WORK"/atomics.txt "$WORK"/openacc-toolchain.txt \
        "$WORK"/openacc.txt "$WORK"/openacc-stalls.txt "$OUT"/ 2>/dev/null
    cat "$WORK"/bench-*/summary.md > "$OUT/bench-summary.md" 2>/dev/null
    echo "results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}

main() {
    export OUT=${OUT:-bench-results/gpu} WORK=${WORK:-/tmp/moagen-gpu} PY
    export SITE=${SITE:-/tmp/moagen-site} WHEELS TOOLCHAIN
    export JOBS=$(nproc)
    rm -rf "$WORK"
    mkdir -p "$OUT" "$WORK/verify"
    local d64 d128 d128_f64
    if [ "${1:-}" = --dry-run ]; then
        # the CUDA emulation in the GPU's place (the tiny LM on the host's C kernels); the
        # same commands, sizes a 2-core machine runs
        export CUDA=cuda-emulated DRY_RUN=--dry-run ATOMICS_N="16" DECODE_N="40" MLP_N="16"
        export LM_DEVICE=cpu LM_STEPS=1 LM_OPERATOR_CALLS=1 BENCH_HEADS=2
        export LM_SIZES="--batch 2 --context 8 --d-model 16 --heads 2 --kv-heads 1 --d-ff 24
            --layers 1 --chars 2000 --generate 4 --threads 1"
        # OpenACC's regions on the host, which GOMP_DEBUG shows as GOACC_parallel_keyed
        export ACC_DEVICE=host ACC_LAUNCH="GOACC_parallel_keyed"
        export CPU_C_VS_FORTRAN="--kernels rmsnorm_fwd mlp_bwd:tiled --n 64 --repeats 1"
        LIMIT_SCALE=4  # a shared 2-core machine running a GPU's threads
        DEADLINE=${DEADLINE:-1500}
        local kernels="rmsnorm_fwd attention_decode"  # all: make verify-cuda-emulated
        d64="32 64" d128="32" d128_f64="32" bwd_n="32"
    else
        export CUDA=cuda DRY_RUN= ATOMICS_N="256 1024 2048" DECODE_N="8192 32768" MLP_N="1024 4096"
        export LM_DEVICE=cuda LM_STEPS=60 LM_OPERATOR_CALLS=30 LM_SIZES= BENCH_HEADS=8
        # the nvptx plugin's launch line (plugin-nvptx.c: "kernel NAME: launch gangs=...")
        export ACC_DEVICE=nvidia ACC_LAUNCH="kernel .*: launch"
        export CPU_C_VS_FORTRAN="--kernels attention_bwd rmsnorm_fwd mlp_bwd --repeats 3"
        LIMIT_SCALE=1
        # 8 minutes from here; the limits below add up to more (each is what its step may
        # need), so the last steps are the ones a slow run gives up
        DEADLINE=${DEADLINE:-465}
        local kernels=all
        d64="1024 4096 16384" d128="1024 4096 16384" d128_f64="1024 4096" bwd_n="1024 4096"
    fi
    local both="attention_fwd:online attention_fwd:flash" flash=attention_fwd:flash
    local backward="attention_bwd:flash attention_bwd:dq_atomic"  # dQ: its pass, or atomics
    setup_python
    export -f acc_env
    [ "$kernels" != all ] || kernels=$("$PY" -c "from moagen.kernels import KERNELS; print(*KERNELS)")
    export VERIFY_KERNELS=$kernels
    record_machine
    # what each step took on the H200 (2026-12-04, docs/results/h200-2026-12-04/) or is
    # estimated to take: verify-cuda 74 s; device-arrays about 100 s (it ran past 90 s once);
    # pycuda's build about 40 s on 16 cores (its longest C++ files; 112 s of g++ in all on a
    # 2-core EPYC, where it built against a stand-in libcuda), its tests 10 s; the tiny
    # LM 30 s, operators 10 s; atomics 15 s (0.4 s a round at n 2048); the four attention
    # benches 15, 20, 35 and 15 s of kernel time (6 calls a size) and 10 s each to start
    # and build; the backward's (estimated) 20; decode and the MLP 10 s each: 7.9 minutes
    step verify-cuda 100 verify_cuda
    step device-arrays 130 device_arrays
    step pycuda 90 pycuda_arrays
    step tiny-lm 40 tiny_lm
    step operators 20 operator_times
    step atomics 30 atomics
    step bench-float32-d64 40 bench_vs_sdpa float32 64 "$both" "$d64"
    step bench-float64-d64 45 bench_vs_sdpa float64 64 "$both" "$d64"
    step bench-float32-d128 55 bench_vs_sdpa float32 128 "$flash" "$d128"
    step bench-float64-d128 35 bench_vs_sdpa float64 128 "$flash" "$d128_f64"
    step bench-bwd-float32-d64 30 bench_vs_sdpa float32 64 "$backward" "$bwd_n" bwd-float32-d64
    step bench-decode 20 bench_decode
    step bench-mlp 25 bench_mlp
    # the OpenACC steps come last and a full run's 8 minutes may not reach them:
    # ONLY='openacc|c-vs-fortran' runs them alone (their limits: 290 s; not yet timed on a GPU)
    step openacc-toolchain 30 openacc_toolchain
    step openacc 180 openacc_c_vs_fortran
    step c-vs-fortran-cpu 40 cpu_c_vs_fortran
    step openacc-stalls 40 openacc_stalls
    pack
    echo "done in $SECONDS s"
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
