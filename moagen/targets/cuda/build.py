"""CUDA built with nvcc (host launchers, cubins for the GPUs we target) or with g++ for the
host emulation."""
import os
import re
from dataclasses import dataclass
from pathlib import Path

from moagen.cuda_archs import BUILT_ARCHS
from moagen.targets.toolchain import (INSTALL_CUDA, INSTALL_CXX, Toolchain, cached, require, run,
                                     shared_library, write)
from moagen.templates import ROOT as TEMPLATES


# the GPUs every CUDA kernel is compiled for, with or without one present (the one table)
CUDA_ARCHS = BUILT_ARCHS

# the stand-in for the CUDA runtime header that runs CUDA source on the host
CUDA_EMULATION = TEMPLATES / "cuda" / "emulation"


@dataclass(frozen=True)
class CubinResult:
    cubin: Path
    ptxas_report: str  # nvcc's output: its warnings, and ptxas -v's registers, shared
    # memory and spills per kernel

    def warnings(self):
        """The compile's warning lines (nvcc's front end: `x.cu(12): warning #177-D: ...`;
        ptxas': `ptxas warning : ...`): the generated code is to compile without any."""
        return [line for line in self.ptxas_report.splitlines()
                if re.search(r"\bwarning\s*(#\d+(-D)?)?\s*:", line)]


def build_cuda(source, stem, toolchain=None):
    """Build CUDA source into a shared library of host launchers; returns its path."""
    tc = toolchain or Toolchain()

    def command(src, library):
        nvcc = require(tc.nvcc, "CUDA compiler", INSTALL_CUDA)
        return [nvcc, *tc.nvccflags, *tc.nvccldflags, "-o", str(library), str(src)]

    return shared_library(source, stem, "cu", ("cuda", source, tc.nvcc, tc.nvccflags, tc.nvccldflags),
                           command)


# the environment variable that builds the emulation with its race check (MOAGEN_RACECHECK=1;
# `moagen verify --emulate --racecheck` sets it)
RACECHECK_ENV = "MOAGEN_RACECHECK"


def racecheck_requested() -> bool:
    return os.environ.get(RACECHECK_ENV, "") not in ("", "0")


def build_cuda_emulated(source, stem, toolchain=None, racecheck=None):
    """Build CUDA source for the host, each block's threads an OpenMP team (the stand-in
    runtime header in CUDA_EMULATION), into a shared library of launchers over host
    pointers; returns its path. racecheck (None: as MOAGEN_RACECHECK says): with the
    header's race check over shared memory (-DMOAGEN_RACECHECK), a launch it fails
    returning moagenErrorCheckFailed."""
    tc = toolchain or Toolchain()
    header = (CUDA_EMULATION / "cuda_runtime.h").read_text()
    racecheck = racecheck_requested() if racecheck is None else racecheck
    defines = ("-DMOAGEN_RACECHECK",) if racecheck else ()

    def command(src, library):
        cxx = require(tc.cxx, "C++ compiler (to run CUDA on the host)", INSTALL_CXX)
        return [cxx, "-x", "c++", f"-I{CUDA_EMULATION}", *defines, *tc.cxxflags, "-o",
                str(library), str(src), *tc.cxxldflags]

    key = ("cuda-emulated", source, header, defines, tc.cxx, tc.cxxflags, tc.cxxldflags)
    return shared_library(source, stem, "cu", key, command)


def compile_cuda(source, stem, arch, toolchain=None):
    """Compile CUDA source to a cubin for `arch` (e.g. "sm_90"), keeping ptxas' report."""
    tc = toolchain or Toolchain()
    key = ("cubin", arch, source, tc.nvcc, tc.nvccflags)

    def build(folder, name):
        nvcc = require(tc.nvcc, "CUDA compiler", INSTALL_CUDA)
        src = write(folder / f"{stem}.cu", source)
        report = run([nvcc, *tc.nvccflags, f"-arch={arch}", "-cubin", "-Xptxas", "-v",
                       "-o", str(folder / f"{stem}.cubin"), str(src)], src)
        write(folder / "ptxas.txt", report)

    folder = cached(stem, key, build)
    return CubinResult(folder / f"{stem}.cubin", (folder / "ptxas.txt").read_text())
