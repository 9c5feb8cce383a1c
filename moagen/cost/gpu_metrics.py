"""A CUDA variant's launched kernels judged without a GPU, at given sizes, for one GPU model
(moagen.cost.gpu): per `__global__` kernel (one per ONF nest) its launch (blocks, waves,
threads a block), ptxas' resources, the occupancy they allow, its innermost loops'
instruction mix (moagen.cost.sass_loops), the global bytes and flops of its nest (the
traffic and flop models over the counting view of the CUDA ONF), and a roofline bound;
for the call, the bounds added, beside PyTorch's measured time where one matches."""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import sympy

from moagen.cost import gpu_measured
from moagen.cost.flops import FLOP, count_ops
from moagen.cost.gpu import H200, GpuModel, Occupancy, occupancy, waves
from moagen.cost.model import SizeError, value
from moagen.cost.sass_loops import LoopSummary, summarize
from moagen.cost.traffic import nest_traffic
from moagen.cost.view import counting_view
from moagen.errors import MoagenError
from moagen.onf.loops import Loop, Mma, walk

# what the bytes assume on a GPU (the traffic model's cache assumption, with the GPU's caches)
GPU_TRAFFIC = ("each kernel one pass over HBM; what its nest reuses (a K/V block, a row of "
               "a weight) hits in L1 / shared memory / the 50 MB L2 (the traffic model's "
               "assumption, moagen.cost.traffic)")


@dataclass(frozen=True)
class KernelMetrics:
    name: str
    nest: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    static_shared: int  # bytes, ptxas
    dynamic_shared: int  # bytes, the launch's
    occupancy: Occupancy
    waves: float
    loops: LoopSummary
    bytes: Optional[int]  # global bytes its nest moves (None: no number at these sizes)
    flops: Optional[int]
    bound_s: Optional[float]  # max(bytes / bandwidth, flops / peak)
    bound_by: str  # "memory", "compute" or "" (no number)

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


@dataclass(frozen=True)
class CallMetrics:
    kernel: str
    variant: str
    dtype: str
    sizes: Dict[str, int]
    gpu: GpuModel
    kernels: Tuple[KernelMetrics, ...]
    measured: Optional[gpu_measured.Measured]  # PyTorch's time at these sizes, if measured

    @property
    def bytes(self) -> Optional[int]:
        return _sum(k.bytes for k in self.kernels)

    @property
    def flops(self) -> Optional[int]:
        return _sum(k.flops for k in self.kernels)

    @property
    def bound_s(self) -> Optional[float]:
        """The launches' bounds added (they run one after another)."""
        return _sum(k.bound_s for k in self.kernels)


def gpu_metrics(kernel: str, variant: str, dtype: str, sizes: Dict[str, int],
                gpu: GpuModel = H200, reports=None) -> CallMetrics:
    """The metrics of the variant's CUDA kernels at `sizes` (every size of the kernel, by
    name); reports: moagen.cost.sass.inspect's for gpu.arch, when already at hand."""
    from moagen.cost.sass import inspect
    from moagen.pipeline import onf_of
    from moagen.targets import get_target
    from moagen.targets.cuda.printer import CudaPrinter

    onf = onf_of(kernel, variant, target=get_target("cuda").kind, dtype=dtype)
    records = CudaPrinter(onf, dtype).kernels()
    if reports is None:
        reports = inspect(kernel, onf.variant, dtype, archs=(gpu.arch,))
    reports = {r.name: r for r in reports if r.arch == gpu.arch}
    view = counting_view(onf)
    if not len(records) == len(onf.nests) == len(view.nests):
        raise MoagenError(f"{kernel} {onf.variant}: {len(records)} CUDA kernels for "
                          f"{len(onf.nests)} nests ({len(view.nests)} counted)")
    itemsize = np.dtype(dtype).itemsize
    out = []
    for record, nest, counted in zip(records, onf.nests, view.nests):
        r = reports[record["name"] + _instance(record, sizes)]
        grid = tuple(_number(g, sizes) for g in record["grid"])
        block = tuple(int(b) for b in record["block"])
        dynamic = _number(record["dynamic_shared_bytes"], sizes)
        occ = occupancy(block[0] * block[1] * block[2], r.registers, r.shared_bytes + dynamic, gpu)
        moved = nest_traffic([counted])
        nbytes = _value(itemsize * sum((m.read + m.written for m in moved.values()),
                                       sympy.Integer(0)), sizes)
        flops = _value(count_ops([counted]).get(FLOP, sympy.Integer(0)), sizes)
        bound_s, bound_by = None, ""
        if nbytes is not None and flops is not None:
            # a nest whose sum is on tensor cores (WarpMma) at their peak
            mma = next((lp.gpu.precision for lp in walk(nest.body)
                        if isinstance(lp, Loop) and isinstance(lp.gpu, Mma)), None)
            peak = gpu.tensor_flops[mma] if mma else gpu.peak_flops[dtype]
            memory, compute = nbytes / gpu.hbm_bytes_per_s, flops / peak
            bound_s, bound_by = max(memory, compute), "memory" if memory >= compute else \
                "compute" + (f" ({mma})" if mma else "")
        out.append(KernelMetrics(
            name=r.name, nest=nest.label, grid=grid, block=block, registers=r.registers,
            spill_stores=r.spill_stores, spill_loads=r.spill_loads, static_shared=r.shared_bytes,
            dynamic_shared=dynamic, occupancy=occ,
            waves=waves(grid[0] * grid[1] * grid[2], occ.blocks, gpu), loops=summarize(list(r.loops)),
            bytes=nbytes, flops=flops, bound_s=bound_s, bound_by=bound_by))
    return CallMetrics(kernel=onf.name, variant=onf.variant, dtype=dtype, sizes=dict(sizes),
                       gpu=gpu, kernels=tuple(out),
                       measured=gpu_measured.torch_time(onf.name, dtype, {
                           k: v for k, v in sizes.items() if k not in dict(onf.chosen)}))


def _instance(record, sizes) -> str:
    """The template arguments of the kernel a tiled launch runs at the sizes ("" if none)."""
    for condition, arguments in record.get("instances", ()):
        if sympy.sympify(condition).xreplace(
                {s: sympy.Integer(v) for s, v in _env(condition, sizes).items()}) == sympy.true:
            return arguments
    if record.get("instances"):
        raise SizeError(f"{record['name']}: no compiled bound holds the sizes {sizes}")
    return ""


def _env(expr, sizes):
    return {s: sizes[s.name] for s in sympy.sympify(expr).free_symbols if s.name in sizes}


def _number(expr, sizes) -> int:
    """A launch's dimension at the sizes (the printer's expressions: exact)."""
    v = value(expr, _env(expr, sizes))
    if not isinstance(v, int):
        raise SizeError(f"the launch dimension {expr} is {v} at {sizes}, not a whole number")
    return v


def _value(expr, sizes) -> Optional[int]:
    """A model count at the sizes, or None where the model has no number for it there."""
    try:
        v = value(expr, _env(expr, sizes))
    except SizeError:
        return None
    return int(round(v))


def _sum(values):
    values = list(values)
    return None if any(v is None for v in values) else sum(values)
