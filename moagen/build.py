"""Build generated kernel sources with the system compilers, caching the artifacts.

Each artifact lives in `<build dir>/<stem>-<hash>/`, the hash taken over everything that
decides the output (language, source text, compiler and flags). A folder there is complete:
it is built in a private folder and renamed into place in one step, so a cache hit needs no
compiler and two processes building the same kernel at once both end up with one artifact.
"""
import ast
import ctypes.util
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from .errors import CompileError, CompilerNotFound

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# What to install when a tool is missing: the Debian package, or the pinned pip package.
INSTALL_C = "apt-get install gcc"
INSTALL_FORTRAN = "apt-get install gfortran"
INSTALL_CXX = "apt-get install g++"
INSTALL_CUDA = "the CUDA toolkit: apt-get install nvidia-cuda-toolkit (or NVIDIA's cuda package)"
INSTALL_OFFLOAD = "apt-get install gcc-12-offload-nvptx"
INSTALL_F90WRAP = "pip install f90wrap==0.3.0"
INSTALL_MPI = "apt-get install openmpi-bin libopenmpi-dev"

# the GPUs every CUDA kernel is compiled for, with or without one present
CUDA_ARCHS = ("sm_80", "sm_90")

# the stand-in for the CUDA runtime header that runs CUDA source on the host
CUDA_EMULATION = PROJECT_ROOT / "templates" / "cuda" / "emulation"


def _libmvec():
    """(compile flags, link flags) that give generated C glibc's vector exponentials, where
    the library exists (templates/c/kernel.c.j2)."""
    if ctypes.util.find_library("mvec"):
        return ("-DMOAGEN_LIBMVEC",), ("-lmvec",)
    return (), ()


LIBMVEC = _libmvec()

# Leave to reassociate: without it gcc and gfortran 12 end every `omp simd` sum by adding
# the vector accumulator's lanes one at a time through the stack, with it in a short tree in
# registers (docs/PERFORMANCE.md, "Build flags"). It moves sums by rounding only;
# infinities and NaNs keep their meaning (no -ffinite-math-only).
REASSOCIATE = ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")

# OpenACC offloaded to NVIDIA GPUs (gcc-12-offload-nvptx; gfortran shares it). gcc 12 writes
# PTX for sm_35 by default, which the CUDA 12+ ptxas (the driver's JIT too) no longer takes.
# Where no GPU is found at run time the regions run on the host.
PTX_ARCH = "sm_80"
OFFLOAD = ("-fopenacc", "-foffload=nvptx-none", f"-foffload-options=nvptx-none=-misa={PTX_ARCH}",
           "-foffload-options=nvptx-none=-lm")  # exp and sqrt on the device: its libm
ACC_LDFLAGS = ("-shared", "-lm")


def _env(name, default):
    return lambda: os.environ.get(name, default)


def _env_flags(name, default):
    return lambda: tuple(shlex.split(os.environ[name])) if name in os.environ else default


@dataclass(frozen=True)
class Toolchain:
    """Compilers and flags for every language. Defaults come from the environment (CC, FC,
    NVCC, CXX, MOAGEN_CFLAGS, MOAGEN_FFLAGS, MOAGEN_NVCCFLAGS, MOAGEN_CXXFLAGS) when the
    Toolchain is made."""

    cc: str = field(default_factory=_env("CC", "gcc"))
    cflags: tuple = field(
        # -std=c99 turns off fused multiply-adds, which gfortran makes by default: contract
        # in both languages, so that they compute (and cost) the same. No kernel reads errno:
        # without it exp is a pure function gcc may vectorize, as gfortran does.
        default_factory=_env_flags("MOAGEN_CFLAGS", ("-O3", "-march=native", "-fopenmp", "-fPIC",
                                                     "-std=c99", "-ffp-contract=fast",
                                                     "-fno-math-errno", *REASSOCIATE)
                                   + LIBMVEC[0]))
    cldflags: tuple = ("-shared", "-lm") + LIBMVEC[1]
    fc: str = field(default_factory=_env("FC", "gfortran"))
    fflags: tuple = field(
        default_factory=_env_flags("MOAGEN_FFLAGS", ("-O3", "-march=native", "-fopenmp", "-fPIC",
                                                     *REASSOCIATE)))
    fldflags: tuple = ("-lgomp",)  # the f2py extension links the OpenMP runtime itself
    # what the f2py extension is linked with besides: OpenACC's
    # device code is made at link time, from the offload flags
    fsharedflags: tuple = ()
    # C and Fortran for OpenACC (openacc()): the CPU flags, OpenMP and libmvec swapped for
    # the offload flags
    acc_cflags: tuple = field(
        default_factory=_env_flags("MOAGEN_ACC_CFLAGS", ("-O3", "-march=native", "-fPIC",
                                                         "-std=c99", "-ffp-contract=fast",
                                                         "-fno-math-errno", *REASSOCIATE,
                                                         *OFFLOAD)))
    acc_fflags: tuple = field(
        default_factory=_env_flags("MOAGEN_ACC_FFLAGS", ("-O3", "-march=native", "-fPIC",
                                                         *REASSOCIATE, *OFFLOAD)))
    nvcc: str = field(default_factory=_env("NVCC", "nvcc"))
    nvccflags: tuple = field(default_factory=_env_flags("MOAGEN_NVCCFLAGS", ("-O3",)))
    nvccldflags: tuple = ("-Xcompiler", "-fPIC", "-shared")  # the runnable library only
    # CUDA run on the host (build_cuda_emulated): checked, not timed, so -O2 compiles fast
    cxx: str = field(default_factory=_env("CXX", "g++"))
    cxxflags: tuple = field(
        default_factory=_env_flags("MOAGEN_CXXFLAGS", ("-O2", "-fopenmp", "-fPIC", "-std=c++17")))
    cxxldflags: tuple = ("-shared",)

    def describe(self):
        """Compiler versions and flags, for benchmark records."""
        return {
            "c": {"compiler": self.cc, "version": _version(self.cc),
                  "flags": list(self.cflags), "link": list(self.cldflags)},
            "fortran": {"compiler": self.fc, "version": _version(self.fc),
                        "flags": list(self.fflags), "link": list(self.fldflags),
                        "f90wrap": _package_version("f90wrap")},
            "cuda": {"compiler": self.nvcc, "version": _version(self.nvcc),
                     "flags": list(self.nvccflags), "link": list(self.nvccldflags)},
            "cuda-emulated": {"compiler": self.cxx, "version": _version(self.cxx),
                              "flags": list(self.cxxflags), "link": list(self.cxxldflags)},
            "openacc-c": {"compiler": self.cc, "version": _version(self.cc),
                          "flags": list(self.acc_cflags), "link": list(ACC_LDFLAGS)},
            "openacc-fortran": {"compiler": self.fc, "version": _version(self.fc),
                                "flags": list(self.acc_fflags),
                                "link": list(self.fldflags + self.acc_fflags)},
        }

    def targets_avx512(self, record: str) -> bool:
        """Whether a language's compiler, with its flags, builds for AVX-512 (-march=native
        does on a machine that has it); record: "c" or "fortran", as in describe()."""
        compiler, flags = {"c": (self.cc, self.cflags), "fortran": (self.fc, self.fflags)}[record]
        return _enables(compiler, flags, "-mavx512f")

    def openacc(self):
        """This toolchain building OpenACC: C and Fortran with the offload flags."""
        return replace(self, cflags=self.acc_cflags, cldflags=ACC_LDFLAGS,
                       fflags=self.acc_fflags, fsharedflags=self.acc_fflags)


@lru_cache(maxsize=None)
def _enables(compiler, flags, option) -> bool:
    """Whether gcc or gfortran with these flags enables a target option (-Q --help=target
    lists each with [enabled] or [disabled]); False where the compiler cannot say (missing:
    the build then says so)."""
    try:
        listed = subprocess.run([compiler, *flags, "-Q", "--help=target"], capture_output=True,
                                text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.split() == [option, "[enabled]"] for line in listed.splitlines())


@dataclass(frozen=True)
class CubinResult:
    cubin: Path
    ptxas_report: str  # ptxas -v: registers, shared memory, spills per kernel


def build_dir():
    return Path(os.environ.get("MOAGEN_BUILD_DIR", PROJECT_ROOT / "build"))


def build_c(source, stem, toolchain=None):
    """Build C source into a shared library (for cffi dlopen); returns its path."""
    tc = toolchain or Toolchain()

    def command(src, library):
        cc = _require(tc.cc, "C compiler", INSTALL_C)
        return [cc, *tc.cflags, "-o", str(library), str(src), *tc.cldflags]

    return _shared_library(source, stem, "c", ("c", source, tc.cc, tc.cflags, tc.cldflags), command)


def build_program(source: Path, library: Path, exe: Path, toolchain=None) -> Path:
    """Compile a C program (a measurement driver) linked to a built kernel library."""
    tc = toolchain or Toolchain()
    cc = _require(tc.cc, "C compiler", INSTALL_C)
    _run([cc, "-O2", "-std=c99", "-o", str(exe), str(source), str(library),
          f"-Wl,-rpath,{library.parent}"], source)
    return exe


def build_fortran(source, stem, module, toolchain=None):
    """Build Fortran source defining `module` into an f2py/f90wrap extension module; returns
    the extension's path. Its import name is the file name up to the first dot, unique to
    this build so that several kernels load into one process."""
    if not re.search(rf"^\s*module\s+{re.escape(module)}\s*$", source, re.IGNORECASE | re.MULTILINE):
        raise ValueError(f"Fortran source for {stem!r} defines no module {module!r}")
    tc = toolchain or Toolchain()
    key = ("fortran", source, tc.fc, tc.fflags, tc.fldflags) + \
        ((tc.fsharedflags,) if tc.fsharedflags else ())  # the keys of CPU builds unchanged

    def build(folder, name):
        fc = _require(tc.fc, "Fortran compiler", INSTALL_FORTRAN)
        cc = _require(tc.cc, "C compiler (f2py's C wrapper)", INSTALL_C)
        f90wrap, f2py = _script("f90wrap"), _script("f2py-f90wrap")
        src = _write(folder / f"{stem}.f90", source)
        _run([fc, *tc.fflags, "-c", src.name, "-o", f"{stem}.o"], src, cwd=folder)
        _run([f90wrap, "-m", stem, src.name], src, cwd=folder)
        # f2py writes the extension's C source (and Fortran wrappers, maybe empty); the
        # compilers build it here, as f2py's meson backend would, without setting up a meson
        # project for each kernel (most of a small kernel's build: docs/PERFORMANCE.md,
        # "Build flags")
        module = f"_{name}"
        _run([f2py, "-m", module, "--lower", f"f90wrap_{stem}.f90"], src, cwd=folder)
        glue_flags, runtime = _f2py_glue()
        _run([cc, *glue_flags, "-c", f"{module}module.c", runtime], src, cwd=folder)
        wrappers = [f"f90wrap_{stem}.f90"] + sorted(p.name for p in folder.glob(f"{module}-f2pywrappers*"))
        _run([fc, *tc.fflags, "-c", *wrappers], src, cwd=folder)
        objects = [f"{module}module.o", "fortranobject.o", f"{stem}.o",
                   *(Path(w).with_suffix(".o").name for w in wrappers)]
        _run([fc, "-shared", "-o", module + sysconfig.get_config_var("EXT_SUFFIX"), *objects,
              *tc.fldflags, *tc.fsharedflags], src, cwd=folder)

    folder = _cached(stem, key, build)
    return folder / f"_{folder.name.replace('-', '_')}{sysconfig.get_config_var('EXT_SUFFIX')}"


@lru_cache(maxsize=None)
def _f2py_glue():
    """The compile flags and the runtime source (fortranobject.c) of an f2py extension's C
    glue: numpy's and Python's headers, -fno-strict-aliasing as f2py's own build adds, and
    -O0: the glue of a kernel with many arrays runs to thousands of lines, which an
    optimizing compile takes seconds over, and a call through it is no slower unoptimized
    (docs/PERFORMANCE.md, "Build flags")."""
    import numpy.f2py  # only a Fortran build needs it

    include = numpy.f2py.get_include()
    flags = ("-O0", "-fPIC", "-fno-strict-aliasing", f"-I{numpy.get_include()}", f"-I{include}",
             f"-I{sysconfig.get_paths()['include']}")
    return flags, str(Path(include) / "fortranobject.c")


def build_mpi(sources, stem, lang, toolchain=None):
    """Build C or Fortran sources that call MPI into one shared library (for cffi dlopen),
    with MPI's compiler wrappers (mpicc, mpifort: they add MPI's headers, Fortran modules
    and libraries) over the language's flags; sources: file name -> text, compiled in that
    order (a Fortran module before the files that use it). Returns the library's path."""
    tc = toolchain or Toolchain()
    wrapper, flags, link = {"c": ("mpicc", tc.cflags, tc.cldflags),
                            "fortran": ("mpifort", tc.fflags, ("-shared",))}[lang]
    key = ("mpi", lang, sorted(sources.items()), wrapper, flags, link)

    def build(folder, name):
        paths = [_write(folder / filename, text) for filename, text in sources.items()]
        modules = [f"-J{folder}"] if lang == "fortran" else []
        _run([_require(wrapper, "MPI compiler wrapper", INSTALL_MPI), *flags, *modules, "-o",
              str(folder / f"lib{stem}.so"), *map(str, paths), *link], paths[-1], cwd=folder)

    return _cached(stem, key, build) / f"lib{stem}.so"


def build_cuda(source, stem, toolchain=None):
    """Build CUDA source into a shared library of host launchers; returns its path."""
    tc = toolchain or Toolchain()

    def command(src, library):
        nvcc = _require(tc.nvcc, "CUDA compiler", INSTALL_CUDA)
        return [nvcc, *tc.nvccflags, *tc.nvccldflags, "-o", str(library), str(src)]

    return _shared_library(source, stem, "cu", ("cuda", source, tc.nvcc, tc.nvccflags, tc.nvccldflags),
                           command)


def build_cuda_emulated(source, stem, toolchain=None):
    """Build CUDA source for the host, each block's threads an OpenMP team (the stand-in
    runtime header in CUDA_EMULATION), into a shared library of launchers over host
    pointers; returns its path."""
    tc = toolchain or Toolchain()
    header = (CUDA_EMULATION / "cuda_runtime.h").read_text()

    def command(src, library):
        cxx = _require(tc.cxx, "C++ compiler (to run CUDA on the host)", INSTALL_CXX)
        return [cxx, "-x", "c++", f"-I{CUDA_EMULATION}", *tc.cxxflags, "-o", str(library),
                str(src), *tc.cxxldflags]

    key = ("cuda-emulated", source, header, tc.cxx, tc.cxxflags, tc.cxxldflags)
    return _shared_library(source, stem, "cu", key, command)


def compile_cuda(source, stem, arch, toolchain=None):
    """Compile CUDA source to a cubin for `arch` (e.g. "sm_90"), keeping ptxas' report."""
    tc = toolchain or Toolchain()
    key = ("cubin", arch, source, tc.nvcc, tc.nvccflags)

    def build(folder, name):
        nvcc = _require(tc.nvcc, "CUDA compiler", INSTALL_CUDA)
        src = _write(folder / f"{stem}.cu", source)
        report = _run([nvcc, *tc.nvccflags, f"-arch={arch}", "-cubin", "-Xptxas", "-v",
                       "-o", str(folder / f"{stem}.cubin"), str(src)], src)
        _write(folder / "ptxas.txt", report)

    folder = _cached(stem, key, build)
    return CubinResult(folder / f"{stem}.cubin", (folder / "ptxas.txt").read_text())


@dataclass(frozen=True)
class OffloadResult:
    ptx: Path  # the device code gcc made for a source's OpenACC regions
    cubin: Path  # ptxas' machine code of it for PTX_ARCH (relocatable: libm calls unlinked)
    ptxas_report: str  # ptxas -v on it: registers and spills per region


def offload_ptx(source, stem, extension, toolchain=None):
    """The PTX that gcc or gfortran (extension "c" or "f90") makes for the OpenACC regions
    of `source` with the OpenACC flags, as a built library embeds it (mkoffload keeps it as
    C strings in *.xnvptx-none.c under -save-temps), and ptxas' report on it."""
    tc = toolchain or Toolchain()
    compiler, flags = (tc.cc, tc.acc_cflags) if extension == "c" else (tc.fc, tc.acc_fflags)
    key = ("offload-ptx", extension, source, compiler, flags)

    def build(folder, name):
        _require(compiler, "C or Fortran compiler", INSTALL_FORTRAN if extension == "f90" else INSTALL_C)
        ptxas = _require("ptxas", "PTX assembler (CUDA toolkit)", INSTALL_CUDA)
        src = _write(folder / f"{stem}.{extension}", source)
        _run([compiler, *flags, "-save-temps", "-o", f"lib{stem}.so", src.name, *ACC_LDFLAGS],
             src, cwd=folder)
        embedded = folder / f"lib{stem}.so.xnvptx-none.c"
        if not embedded.is_file():
            raise CompilerNotFound(f"{compiler} made no nvptx offload code; install it with: "
                                   f"{INSTALL_OFFLOAD}")
        ptx = _write(folder / f"{stem}.ptx", embedded_ptx(embedded.read_text()))
        # -c: the module alone, its calls into the device's libm left to the link
        _write(folder / "ptxas.txt", _run([ptxas, f"-arch={PTX_ARCH}", "-c", "-v", "-o",
                                           str(folder / f"{stem}.cubin"), str(ptx)], src))

    folder = _cached(stem, key, build)
    return OffloadResult(folder / f"{stem}.ptx", folder / f"{stem}.cubin",
                         (folder / "ptxas.txt").read_text())


def embedded_ptx(text):
    """The source's own PTX in mkoffload's C source: of the modules there (string literals
    of its ptx_code_K arrays), the ones with entry points; the rest are the device's C and
    math libraries."""
    arrays = re.findall(r"static const char ptx_code_\d+\[\] =\n((?:\s*\".*\"\n)+)", text)
    modules = ["".join(ast.literal_eval(s) for s in re.findall(r'"(?:[^"\\]|\\.)*"', a))
               for a in arrays]
    return "".join(m for m in modules if re.search(r"^\.entry ", m, re.MULTILINE))


def _shared_library(source, stem, extension, key, command):
    """The shared library built from `source` (cached by `key`); command(source path,
    library path) is the compile command, asked for only when it must run."""
    def build(folder, name):
        src = _write(folder / f"{stem}.{extension}", source)
        _run(command(src, folder / f"lib{stem}.so"), src)

    return _cached(stem, key, build) / f"lib{stem}.so"


def _cached(stem, key, build):
    """The artifact folder for `key`, running build(private folder, final folder name) first
    when it does not exist yet."""
    if not re.fullmatch(r"[A-Za-z_]\w*", stem):
        raise ValueError(f"kernel stem must be an identifier, got {stem!r}")
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    final = build_dir() / f"{stem}-{digest}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    private.chmod(0o755)  # mkdtemp's 0700 would hide the artifact from other users
    build(private, final.name.replace("-", "_"))  # on failure the folder stays, for inspection
    try:
        os.rename(private, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(private)  # another process won the race: use its artifact
    return final


def _run(command, source, cwd=None, env=None):
    """Run one build step; returns its output (stdout and stderr interleaved)."""
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        where = f"cd {shlex.quote(str(cwd))} && " if cwd else ""
        raise CompileError(f"compile failed (exit status {done.returncode})\n"
                           f"command: {where}{shlex.join(command)}\n"
                           f"source: {source}\n"
                           f"output:\n{done.stdout}")
    return done.stdout


def _require(program, what, install):
    if shutil.which(program) is None:
        raise CompilerNotFound(f"{what} {program!r} not found on PATH; install it with: {install}")
    return program


def _script(name):
    """A console script of this Python environment (f90wrap installs them next to python)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise CompilerNotFound(f"{name} not found next to {sys.executable}; install it with: {INSTALL_F90WRAP}")
    return str(path)


def _write(path, text):
    path.write_text(text)
    return path


def _version(program):
    """The first line of `program --version` that carries a version number."""
    if shutil.which(program) is None:
        return "not found"
    text = subprocess.run([program, "--version"], capture_output=True, text=True).stdout
    return next((line for line in text.splitlines() if re.search(r"\d+\.\d+", line)), text.strip())


def _package_version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"
