"""Measured counterparts for CUDA without a GPU: each `__global__` kernel (one per nest) of a
variant compiled for the GPUs moagen targets, with ptxas' registers, shared memory and
spills, and the atomic instructions in its SASS (cuobjdump, from the pip packages
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm), next to the ONF's atomic updates in the
nest the kernel runs, and its innermost loops' instruction mix (moagen.cost.sass_loops)."""
import os
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

import sympy

from moagen.cost.sass_loops import LoopMix, innermost_loops
from moagen.cost.view import counting_view
from moagen.targets.cuda.build import CUDA_ARCHS, compile_cuda
from moagen.targets.cuda.printer import CudaPrinter
from moagen.emit import emit, stem
from moagen.pipeline import onf_of
from moagen.errors import CompilerNotFound, MoagenError
from moagen.onf.count import atomic_updates
from moagen.targets import get_target

INSTALL_CUOBJDUMP = "pip install nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37"
# global atomics (ATOM, ATOMG; RED, REDG when the old value is unused) and shared ones
ATOMIC = re.compile(r"\b(ATOMG?|REDG?|ATOMS)\.")


@dataclass(frozen=True)
class KernelReport:
    arch: str
    name: str  # the __global__ function
    nest: str  # the ONF nest it runs
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    sass_atomics: int  # atomic instructions in its SASS (static count)
    onf_atomics: Dict[str, sympy.Expr]  # atomic updates per array of its nest, per call
    loops: Tuple[LoopMix, ...] = ()  # its SASS's innermost loops (moagen.cost.sass_loops)


def inspect(kernel: str, variant: str = None, dtype: str = "float64",
            archs: Tuple[str, ...] = CUDA_ARCHS):
    """One KernelReport per __global__ kernel of the variant's `dtype` launcher, per arch."""
    # the ONF emit prints for the dtype
    onf = onf_of(kernel, variant, target=get_target("cuda").kind, dtype=dtype)
    # one per nest, in order: a tiled kernel's, one per compiled bound (kernel<64>, ...)
    names = [[k["name"] + arguments for _, arguments, _ in k["launches"]] if k["tiled"]
             else [k["name"]] for k in CudaPrinter(onf, dtype).kernels()]
    source = emit(kernel, onf.variant, "cuda")
    reports = []
    for arch in archs:
        result = compile_cuda(source, stem(kernel, onf.variant), arch)
        ptxas = ptxas_resources(result.ptxas_report)
        bodies = sass_by_function(result.cubin)
        for name, nest in ((name, nest) for instances, nest in zip(names, onf.nests)
                           for name in instances):
            if name not in ptxas or name not in bodies:
                raise MoagenError(f"{result.cubin} has no kernel {name}")
            reports.append(KernelReport(arch, name, nest.label, **ptxas[name],
                                        sass_atomics=len(ATOMIC.findall(bodies[name])),
                                        onf_atomics=_nest_atomics(onf, nest),
                                        loops=tuple(innermost_loops(bodies[name]))))
    return reports


def _nest_atomics(onf, nest) -> Dict[str, sympy.Expr]:
    """The nest's atomic updates in closed form, as the cost model counts them (its
    counting view: whole key blocks)."""
    return atomic_updates(counting_view(onf.with_nests([nest])).nests)


def ptxas_resources(report: str) -> Dict[str, dict]:
    """ptxas -v's resources per entry function, by unmangled name."""
    out = {}
    for part in re.split(r"Compiling entry function '", report)[1:]:
        name = _unmangle(part.split("'", 1)[0])
        number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, part)) else 0
        out[name] = dict(registers=number(r"Used (\d+) registers"),
                         shared_bytes=number(r"(\d+) bytes smem"),
                         stack_bytes=number(r"(\d+) bytes stack frame"),
                         spill_stores=number(r"(\d+) bytes spill stores"),
                         spill_loads=number(r"(\d+) bytes spill loads"))
    return out


def sass_by_function(cubin: Path) -> Dict[str, str]:
    """The cubin's SASS, per function (by unmangled name)."""
    tool, env = cuobjdump()
    done = subprocess.run([tool, "-sass", str(cubin)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise MoagenError(f"cuobjdump -sass {cubin} failed:\n{done.stderr}")
    parts = re.split(r"Function : (\S+)", done.stdout)[1:]
    return {_unmangle(name): body for name, body in zip(parts[::2], parts[1::2])}


def tools_available() -> bool:
    """Whether what reading a kernel's SASS takes is here: nvcc (the toolchain's) and
    cuobjdump with nvdisasm."""
    from moagen.targets.toolchain import Toolchain
    try:
        cuobjdump()
    except CompilerNotFound:
        return False
    return shutil.which(Toolchain().nvcc) is not None


def cuobjdump():
    """cuobjdump, with nvdisasm (which it runs) on its PATH: the pip packages' or the
    CUDA toolkit's."""
    pip_bin = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin"
    path = f"{pip_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    tool = shutil.which("cuobjdump", path=path)
    if tool is None or shutil.which("nvdisasm", path=path) is None:
        raise CompilerNotFound(f"cuobjdump and nvdisasm not found; install them with: {INSTALL_CUOBJDUMP}")
    return tool, {**os.environ, "PATH": path}


def _unmangle(symbol: str) -> str:
    """The function name of a mangled C++ symbol (_Z<length><name><parameters>), with its
    integer template arguments where it has them (_Z..rowsILi64EEv..: rows<64>)."""
    m = re.match(r"_Z(\d+)", symbol)
    if not m:
        return symbol
    end = m.end() + int(m.group(1))
    template = re.match(r"I((?:Li-?\d+E)+)E", symbol[end:])
    values = re.findall(r"Li(-?\d+)E", template.group(1)) if template else ()
    return symbol[m.end():end] + (f"<{', '.join(values)}>" if values else "")
