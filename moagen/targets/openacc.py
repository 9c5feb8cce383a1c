"""OpenACC C and OpenACC Fortran: the C and Fortran of the CPU targets with their parallel
loops as OpenACC compute constructs (moagen.codegen.openacc), built with gcc's nvptx
offloading, loaded and bound as C (cffi) and Fortran (f90wrap) are. Where no GPU is found
the regions run on the host, so both run and are verified on any machine; and C without
`restrict`, the bench's ablation, offloaded too. Not in generated/: variants of C and
Fortran for the GPU half of the C-vs-Fortran experiment (moagen.bench.offload)."""
import ctypes
import ctypes.util
from dataclasses import replace
from functools import lru_cache, partial

from moagen import build
from moagen.codegen.c import emit_c
from moagen.codegen.openacc import OpenAccC, OpenAccCPlainPointers, OpenAccFortran
from moagen.targets import c, fortran


ACC_DEVICE_NVIDIA = 5  # openacc.h's acc_device_t


@lru_cache(maxsize=None)
def devices() -> int:
    """The NVIDIA GPUs libgomp's OpenACC runtime finds: none without a GPU, its driver or
    libgomp's nvptx plugin, and then the regions run on the host."""
    library = ctypes.util.find_library("gomp")
    return ctypes.CDLL(library).acc_get_num_devices(ACC_DEVICE_NVIDIA) if library else 0


def _on_gpu() -> bool:
    return devices() > 0


# they run on any machine (`moagen verify --lang openacc-c`), on the host where no GPU is;
# runs_here says whether on a GPU, which is what the bench times
ON_GPU = dict(runs_here=_on_gpu, missing="no OpenACC device (an NVIDIA GPU, its driver and "
                                         "libgomp's nvptx plugin): the regions would run on "
                                         "the host")


def _build_c(source, stem, toolchain=None):
    return build.build_c(source, stem, (toolchain or build.Toolchain()).openacc())


def _build_fortran(source, stem, toolchain=None):
    return fortran.build_module(source, stem, (toolchain or build.Toolchain()).openacc())


C = replace(c.TARGET, name="openacc-c", kind="openacc", emit=partial(emit_c, printer=OpenAccC),
            build=_build_c, toolchain="openacc-c", variant_of="c", **ON_GPU)
C_NO_RESTRICT = replace(C, name="openacc-c-norestrict",
                        emit=partial(emit_c, printer=OpenAccCPlainPointers))
FORTRAN = replace(fortran.TARGET, name="openacc-fortran", kind="openacc",
                  emit=partial(fortran.emit, printer=OpenAccFortran), build=_build_fortran,
                  toolchain="openacc-fortran", variant_of="fortran", **ON_GPU)
