"""Build generated kernel sources with the system compilers, caching the artifacts.

Each artifact lives in `<build dir>/<stem>-<hash>/`, the hash taken over everything that
decides the output (language, source text, compiler and flags). A folder there is complete:
it is built in a private folder and renamed into place in one step, so a cache hit needs no
compiler and two processes building the same kernel at once both end up with one artifact.
"""
import ctypes.util
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from moagen.errors import CompileError, CompilerNotFound

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# What to install when a tool is missing: the Debian package, or the pinned pip package.
INSTALL_C = "apt-get install gcc"
INSTALL_FORTRAN = "apt-get install gfortran"
INSTALL_CXX = "apt-get install g++"
INSTALL_CUDA = "the CUDA toolkit: apt-get install nvidia-cuda-toolkit (or NVIDIA's cuda package)"
INSTALL_OFFLOAD = ("apt-get install gcc-12-offload-nvptx, or without root: source env.sh of the "
                   "archive tools/openacc-toolchain.sh makes (it sets CC and FC)")
INSTALL_F90WRAP = "pip install f90wrap==0.3.0"
INSTALL_MPI = "apt-get install openmpi-bin libopenmpi-dev"


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


# Where the compiler targets AVX-512, gcc 12 still writes 256-bit vectors unless told
# otherwise (its tuning for Intel's cores): the AVX-512 register tiles, sized for 32 512-bit
# registers, spilled. Told, on the Intel Xeon: the flash forward 0.61-0.72x the time, the
# MLP's tiles 0.75-0.92x, decode 0.73-0.81x (docs/PERFORMANCE.md, "Build flags"). x86 only;
# without AVX-512 it changes nothing.
WIDE_VECTORS = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") \
    else ()


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
                                                     "-fno-math-errno", *REASSOCIATE,
                                                     *WIDE_VECTORS)
                                   + LIBMVEC[0]))
    cldflags: tuple = ("-shared", "-lm") + LIBMVEC[1]
    fc: str = field(default_factory=_env("FC", "gfortran"))
    fflags: tuple = field(
        default_factory=_env_flags("MOAGEN_FFLAGS", ("-O3", "-march=native", "-fopenmp", "-fPIC",
                                                     *REASSOCIATE, *WIDE_VECTORS)))
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


def build_dir():
    return Path(os.environ.get("MOAGEN_BUILD_DIR", PROJECT_ROOT / "build"))


def build_program(source: Path, library: Path, exe: Path, toolchain=None) -> Path:
    """Compile a C program (a measurement driver) linked to a built kernel library."""
    tc = toolchain or Toolchain()
    cc = require(tc.cc, "C compiler", INSTALL_C)
    run([cc, "-O2", "-std=c99", "-o", str(exe), str(source), str(library),
          f"-Wl,-rpath,{library.parent}"], source)
    return exe


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
        paths = [write(folder / filename, text) for filename, text in sources.items()]
        modules = [f"-J{folder}"] if lang == "fortran" else []
        run([require(wrapper, "MPI compiler wrapper", INSTALL_MPI), *flags, *modules, "-o",
              str(folder / f"lib{stem}.so"), *map(str, paths), *link], paths[-1], cwd=folder)

    return cached(stem, key, build) / f"lib{stem}.so"


def shared_library(source, stem, extension, key, command):
    """The shared library built from `source` (cached by `key`); command(source path,
    library path) is the compile command, asked for only when it must run."""
    def build(folder, name):
        src = write(folder / f"{stem}.{extension}", source)
        run(command(src, folder / f"lib{stem}.so"), src)

    return cached(stem, key, build) / f"lib{stem}.so"


def cached(stem, key, build):
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


def run(command, source, cwd=None, env=None):
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


def require(program, what, install):
    if shutil.which(program) is None:
        raise CompilerNotFound(f"{what} {program!r} not found on PATH; install it with: {install}")
    return program


def write(path, text):
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
