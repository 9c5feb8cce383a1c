"""OpenACC C and OpenACC Fortran: the C and Fortran of the CPU targets with their parallel
loops as OpenACC compute constructs (moagen.targets.openacc.printer), built with gcc's nvptx
offloading, loaded and bound as C (cffi) and Fortran (f90wrap) are. Where no GPU is found
the regions run on the host, so both run and are verified on any machine; and C without
`restrict`, the bench's ablation, offloaded too. Not in generated/: variants of C and
Fortran for the GPU half of the C-vs-Fortran experiment (moagen.bench.offload)."""
import ctypes
from dataclasses import replace
from functools import lru_cache, partial

from moagen.targets.c import target as c
from moagen.targets.c.build import build_c
from moagen.targets.c.printer import emit_c
from moagen.targets.fortran import target as fortran
from moagen.targets.openacc.printer import OpenAccC, OpenAccCPlainPointers, OpenAccFortran
from moagen.targets.toolchain import Toolchain


ACC_DEVICE_NVIDIA = 5  # openacc.h's acc_device_t


@lru_cache(maxsize=None)
def devices() -> int:
    """The NVIDIA GPUs libgomp's OpenACC runtime finds: none without a GPU, its driver or
    libgomp's nvptx plugin, and then the regions run on the host. The libgomp asked is the
    one the built kernels load, by their soname (LD_LIBRARY_PATH first: a carried gcc's, as
    tools/openacc-toolchain.sh's env.sh sets it, even where the machine has none)."""
    try:
        return ctypes.CDLL("libgomp.so.1").acc_get_num_devices(ACC_DEVICE_NVIDIA)
    except OSError:
        return 0


def _on_gpu() -> bool:
    return devices() > 0


# they run on any machine (`moagen verify --lang openacc-c`), on the host where no GPU is;
# runs_here says whether on a GPU, which is what the bench times
ON_GPU = dict(runs_here=_on_gpu, missing="no OpenACC device (an NVIDIA GPU, its driver and "
                                         "libgomp's nvptx plugin): the regions would run on "
                                         "the host")


def _build_c(source, stem, toolchain=None):
    return build_c(source, stem, (toolchain or Toolchain()).openacc())


def _build_fortran(source, stem, toolchain=None):
    return fortran.build_module(source, stem, (toolchain or Toolchain()).openacc())


C = replace(c.TARGET, name="openacc-c", kind="openacc", emit=partial(emit_c, printer=OpenAccC),
            build=_build_c, toolchain="openacc-c", variant_of="c", **ON_GPU)
C_NO_RESTRICT = replace(C, name="openacc-c-norestrict",
                        emit=partial(emit_c, printer=OpenAccCPlainPointers))
FORTRAN = replace(fortran.TARGET, name="openacc-fortran", kind="openacc",
                  emit=partial(fortran.emit, printer=OpenAccFortran), build=_build_fortran,
                  toolchain="openacc-fortran", variant_of="fortran", **ON_GPU)
