"""Load Fortran kernels from the f2py extension that f90wrap's wrappers were built into."""
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from moagen.targets.abi import KernelCallable, flat_view

BYTES = np.dtype(np.int8)


@dataclass(frozen=True)
class FortranLibrary:
    extension: ModuleType
    module: str  # the Fortran module: f90wrap names each wrapper f90wrap_<module>__<routine>


def load(path, module):
    """Import the extension built by moagen.targets.fortran.build.build_fortran; its import name (the file
    name up to the first dot) is unique to the build, so several kernels coexist."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    return FortranLibrary(extension, module)


def bind(library, signature, validate=None):
    function = getattr(library.extension, f"f90wrap_{library.module}__{signature.name}".lower())
    n_arrays = len(signature.arrays)
    # a bool mask's bytes as int8, the integer(c_int8_t) f2py takes: a view, where f2py would
    # copy a bool array into int8
    views = [BYTES if a.element == "bool" else None for a in signature.arrays]

    def native_call(*args):
        # f2py writes the intent(inout) outputs in place: they must be views of the caller's arrays.
        function(*(flat_view(a) if v is None else flat_view(a).view(v)
                   for v, a in zip(views, args[:n_arrays])), *args[n_arrays:])

    return KernelCallable(signature, native_call, validate)
