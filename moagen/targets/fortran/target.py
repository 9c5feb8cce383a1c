"""Fortran with OpenMP: one module of bind(C) routines, built with f90wrap and f2py into an
extension module, loaded from it."""
from functools import partial

from moagen.targets.fortran import loader
from moagen.targets.fortran.build import build_fortran
from moagen.targets.fortran.printer import FortranPrinter, emit_fortran
from moagen.onf.signature import signature
from moagen.errors import SpecError
from moagen.targets.target import Target

# One name for the Fortran module of every generated file: f90wrap names each wrapper
# f90wrap_<module>__<routine> and mangles names past Fortran's 63 characters, so the module
# name is kept short and the routine names are checked against the limit.
MODULE = "moagen_kernels"
NAME_LIMIT = 63 - len(f"f90wrap_{MODULE}__")


def emit(pairs, banner, printer=FortranPrinter) -> str:
    for dtype, onf in pairs:
        name = signature(onf, dtype).name
        if len(name) > NAME_LIMIT:
            raise SpecError(f"{name} is longer than the {NAME_LIMIT} characters a Fortran "
                            f"routine wrapped by f90wrap may have; shorten the kernel name")
    return emit_fortran(pairs, banner, MODULE, printer)


def build_module(source, stem, toolchain=None):
    return build_fortran(source, stem, MODULE, toolchain)


TARGET = Target("fortran", extension="f90", kind="cpu", emit=emit, build=build_module,
                load=partial(loader.load, module=MODULE), bind=loader.bind, toolchain="fortran")
