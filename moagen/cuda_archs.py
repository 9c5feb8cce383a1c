"""The CUDA architectures every .cu is built for, and what each allows a thread block: one
table, below the steps that check a tiled kernel's shared memory against it
(moagen.steps.gpu.closing) and the CUDA target that compiles for it
(moagen.targets.cuda.build). A launcher still asks the device its own limit at run time."""

# the dynamic shared memory a block may opt into (cudaFuncSetAttribute), in bytes: 163 KB
# on sm_80 (A100), 227 KB on sm_90 (H100, H200); the CUDA C Programming Guide's tables
SHARED_OPT_IN = {"sm_80": 166_912, "sm_90": 232_448}

# the GPUs every CUDA kernel is compiled for, with or without one present
BUILT_ARCHS = tuple(SHARED_OPT_IN)

# threads a warp on every one of them: a warp shuffle's lanes
WARP = 32


def tightest_shared_limit():
    """(arch, bytes): the built architecture that allows a block the least shared memory,
    which every instance of a tiled kernel must fit."""
    return min(SHARED_OPT_IN.items(), key=lambda arch_bytes: arch_bytes[1])
