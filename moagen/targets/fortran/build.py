"""Fortran built with f90wrap and f2py into an extension module."""
import hashlib
import re
import sys
import sysconfig
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

from moagen.errors import CompilerNotFound
from moagen.targets.toolchain import (INSTALL_C, INSTALL_F90WRAP, INSTALL_FORTRAN, Toolchain, cached,
                                     require, run, write)

WRAP = Path(__file__).with_name("wrap.py")  # run as a script: f90wrap's and f2py's sources


def build_fortran(source, stem, module, toolchain=None):
    """Build Fortran source defining `module` into an f2py/f90wrap extension module; returns
    the extension's path. Its import name is the file name up to the first dot, unique to
    this build so that several kernels load into one process."""
    if not re.search(rf"^\s*module\s+{re.escape(module)}\s*$", source, re.IGNORECASE | re.MULTILINE):
        raise ValueError(f"Fortran source for {stem!r} defines no module {module!r}")
    tc = toolchain or Toolchain()
    key = ("fortran", source, tc.fc, tc.fflags, tc.fldflags, tc.fsharedflags,
           _runtime_key(tc.cc))  # a new runtime relinks every extension

    def build(folder, name):
        fc = require(tc.fc, "Fortran compiler", INSTALL_FORTRAN)
        cc = require(tc.cc, "C compiler (f2py's C wrapper)", INSTALL_C)
        _require_f90wrap()
        src = write(folder / f"{stem}.f90", source)
        run([fc, *tc.fflags, "-c", src.name, "-o", f"{stem}.o"], src, cwd=folder)
        # f90wrap's wrappers, then f2py's C source of the extension (and Fortran wrappers,
        # maybe empty), one interpreter for both (wrap.py); the compilers build them here,
        # as f2py's meson backend would, without setting up a meson project for each kernel
        # (most of a small kernel's build: docs/PERFORMANCE.md, "Build flags")
        module = f"_{name}"
        run([sys.executable, str(WRAP), stem, module, src.name], src, cwd=folder)
        run([cc, *_f2py_glue()[0], "-c", f"{module}module.c"], src, cwd=folder)
        wrappers = [f"f90wrap_{stem}.f90"] + sorted(p.name for p in folder.glob(f"{module}-f2pywrappers*"))
        run([fc, *tc.fflags, "-c", *wrappers], src, cwd=folder)
        objects = [f"{module}module.o", str(_f2py_runtime(cc)), f"{stem}.o",
                   *(Path(w).with_suffix(".o").name for w in wrappers)]
        run([fc, "-shared", "-o", module + sysconfig.get_config_var("EXT_SUFFIX"), *objects,
              *tc.fldflags, *tc.fsharedflags], src, cwd=folder)

    folder = cached(stem, key, build)
    return folder / f"_{folder.name.replace('-', '_')}{sysconfig.get_config_var('EXT_SUFFIX')}"


def _require_f90wrap():
    """f90wrap must be installed where wrap.py runs: this interpreter's environment."""
    if find_spec("f90wrap") is None:
        raise CompilerNotFound(f"f90wrap not found by {sys.executable}; install it with: "
                               f"{INSTALL_F90WRAP}")


def _f2py_runtime(cc):
    """f2py's runtime (numpy's fortranobject.c) compiled with the glue's flags, the same
    object linked into every Fortran extension; built once per build folder and key
    (_runtime_key), as a kernel is, so that concurrent builds agree on one object."""
    flags, source = _f2py_glue()

    def build(folder, name):
        run([cc, *flags, "-c", source, "-o", str(folder / "fortranobject.o")], source,
            cwd=folder)

    return cached("fortranobject", _runtime_key(cc), build) / "fortranobject.o"


@lru_cache(maxsize=None)
def _runtime_key(cc):
    """What decides the runtime's object: the C compiler, the glue's flags (Python's and
    numpy's headers among them), numpy's version and the runtime's own source and header."""
    import numpy  # only a Fortran build needs it

    flags, source = _f2py_glue()
    texts = [path.read_bytes() for path in sorted(Path(source).parent.glob("fortranobject.*"))]
    return ("f2py-runtime", cc, flags, source, numpy.__version__,
            hashlib.sha256(b"\0".join(texts)).hexdigest())


@lru_cache(maxsize=None)
def _f2py_glue():
    """The compile flags and the runtime source (fortranobject.c) of an f2py extension's C
    glue: numpy's and Python's headers, -fno-strict-aliasing as f2py's own build adds, and
    -O0: the glue of a kernel with many arrays runs to thousands of lines, which an
    optimizing compile takes seconds over, and a call through it is no slower unoptimized
    (docs/PERFORMANCE.md, "Build flags")."""
    import numpy.f2py  # only a Fortran build needs it

    include = numpy.f2py.get_include()
    # f2py names an integer(c_int8_t) array's C type (a bool mask's) signed_char but defines
    # that type for scalars only
    flags = ("-O0", "-fPIC", "-fno-strict-aliasing", f"-I{numpy.get_include()}", f"-I{include}",
             f"-I{sysconfig.get_paths()['include']}", "-Dsigned_char=signed char")
    return flags, str(Path(include) / "fortranobject.c")
