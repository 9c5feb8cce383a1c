"""A GPU's documented limits as one record, and the occupancy and wave arithmetic over them:
how many thread blocks of a kernel an SM holds at once, what limits that, and how many
rounds of the whole machine the grid takes."""
import math
from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class GpuModel:
    name: str
    arch: str  # what nvcc compiles for it
    sms: int
    registers_per_sm: int  # 32-bit registers
    register_unit: int  # registers are allocated to a warp in units of this many
    max_registers_per_thread: int
    shared_per_sm: int  # bytes, with the largest carveout
    shared_per_block: int  # bytes a block may use (static + dynamic)
    shared_reserved_per_block: int  # bytes the runtime keeps for each resident block
    shared_unit: int  # a block's shared memory is allocated in units of this many bytes
    warps_per_sm: int
    blocks_per_sm: int
    threads_per_block: int
    hbm_bytes_per_s: float
    peak_flops: Dict[str, float]  # SIMT FLOP/s by dtype (a fused multiply-add is 2)
    # the tensor cores' FLOP/s by WarpMma's precision (moagen.onf.loops.Mma): of the
    # products a kernel counts, so 3xTF32's a third of TF32's (three products each)
    tensor_flops: Dict[str, float] = None


# sm_90 as the CUDA C Programming Guide's compute capability 9.0 table and the occupancy
# calculator state them; the H200's SM count, HBM3e bandwidth, SIMT and tensor-core peaks
# (dense: FP64 tensor 67, TF32 tensor 495 TFLOP/s) from its datasheet
H200 = GpuModel(name="H200", arch="sm_90", sms=132, registers_per_sm=64 * 1024, register_unit=256,
                max_registers_per_thread=255, shared_per_sm=228 * 1024,
                shared_per_block=227 * 1024, shared_reserved_per_block=1024, shared_unit=128,
                warps_per_sm=64, blocks_per_sm=32, threads_per_block=1024,
                hbm_bytes_per_s=4.8e12, peak_flops={"float64": 34e12, "float32": 67e12},
                tensor_flops={"f64": 67e12, "tf32": 495e12, "3xtf32": 165e12})

OCCUPANCY_ROUNDING = ("registers a warp rounded up to a multiple of 256, whole warps per SM; "
                      "shared memory a block = static + dynamic + 1 KB the runtime reserves, "
                      "rounded up to 128 bytes, out of the 228 KB carveout")


@dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks an SM
    warps: int  # resident warps an SM
    limiter: str  # the limits that give `blocks`, "registers, warps" where two tie
    limits: Dict[str, int]  # blocks an SM by each limit: registers, shared, warps, blocks
    max_warps: int  # the SM's warp slots

    @property
    def fraction(self) -> float:
        """Resident warps over the SM's maximum (the "occupancy")."""
        return self.warps / self.max_warps


def occupancy(threads: int, registers: int, shared_bytes: int, gpu: GpuModel = H200) -> Occupancy:
    """Resident blocks and warps an SM for blocks of `threads` threads, `registers` registers
    a thread and `shared_bytes` (static + dynamic) of shared memory a block: the least of
    what the register file, the shared memory, the warp slots and the block slots allow
    (rounded as OCCUPANCY_ROUNDING says). A block the SM cannot hold at all is 0 blocks."""
    if threads < 1:
        raise ValueError(f"a block of {threads} threads")
    warps = math.ceil(threads / 32)
    limits = {}
    if registers > gpu.max_registers_per_thread or threads > gpu.threads_per_block:
        limits["registers"] = 0
    else:
        per_warp = _round_up(max(registers, 1) * 32, gpu.register_unit)
        limits["registers"] = (gpu.registers_per_sm // per_warp) // warps
    if shared_bytes > gpu.shared_per_block:
        limits["shared"] = 0
    else:
        per_block = _round_up(shared_bytes + gpu.shared_reserved_per_block, gpu.shared_unit)
        limits["shared"] = gpu.shared_per_sm // per_block
    limits["warps"] = gpu.warps_per_sm // warps
    limits["blocks"] = gpu.blocks_per_sm
    blocks = min(limits.values())
    limiter = ", ".join(k for k, v in limits.items() if v == blocks)
    return Occupancy(blocks=blocks, warps=blocks * warps, limiter=limiter, limits=limits,
                     max_warps=gpu.warps_per_sm)


def waves(blocks: int, resident_blocks: int, gpu: GpuModel = H200) -> float:
    """Rounds of the whole GPU the grid takes: blocks / (SMs x blocks resident an SM); under
    1, part of the GPU idles (inf where no block fits)."""
    if resident_blocks <= 0:
        return math.inf
    return blocks / (gpu.sms * resident_blocks)


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit
