"""pycuda's wheel built from its source distribution, its C++ compiled on every core:

    python bench/build_pycuda.py SDIST WHEEL_DIR

bench/gpu.sh runs this on the GPU machine (pycuda links against the driver's libcuda, which
only a GPU machine has), then installs the wheel with pip, offline. setuptools compiles an
extension's sources one after another, and pycuda's _driver is Boost.Python and its
wrappers, some 40 files of template-heavy C++: minutes on one core. Here each source is one
job of a pool of threads (each runs g++), the rest is setuptools' PEP 517 build as pip runs
it with --no-build-isolation (setuptools, wheel and numpy importable).

aksetup, pycuda's configuration, reads siteconf.py in the source tree: this writes one with
the CUDA toolkit nvcc belongs to (CUDA_ROOT; a PATH whose nvcc is a link outside the toolkit
would give the wrong one), the directories where the linker finds libcuda.so
(CUDADRV_LIB_DIR), and CURAND off (moagen does not use it; the toolkit may not ship it)."""
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from multiprocessing.pool import ThreadPool


def compile_in_parallel(jobs):
    """setuptools' Compiler.compile with its loop over sources run on `jobs` threads."""
    from setuptools._distutils import ccompiler

    def compile(self, sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            if obj in build:
                src, ext = build[obj]
                self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPool(jobs) as pool:
            pool.map(one, objects, chunksize=1)
        return objects

    ccompiler.CCompiler.compile = compile


def cuda_root():
    """The toolkit: the first of nvcc's own folder's parent, $CUDA_HOME, $CUDA_PATH and
    /usr/local/cuda that has include/cuda.h (an nvcc on PATH may be a wrapper elsewhere)."""
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates += [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, candidates):
        if os.path.exists(os.path.join(root, "include", "cuda.h")):
            return os.path.realpath(root)
    raise SystemExit(f"no CUDA toolkit with include/cuda.h among {candidates}")


def libcuda_dirs(root, scratch):
    """Where `-lcuda` finds libcuda.so: the toolkit's lib64 and its stubs, and where the
    driver's libcuda.so.1 is when no unversioned link is there (a link made in scratch)."""
    dirs = [os.path.join(root, d) for d in ("lib64", "lib64/stubs", "targets/x86_64-linux/lib",
                                            "targets/x86_64-linux/lib/stubs")]
    dirs = [d for d in dirs if os.path.isdir(d)]
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        listing = ""
    found = [line.rsplit("=>", 1)[1].strip() for line in listing.splitlines()
             if "libcuda.so" in line and "=>" in line and "x86-64" in line]
    for path in found:
        here = os.path.dirname(path)
        if os.path.exists(os.path.join(here, "libcuda.so")):
            return [here] + dirs
    for path in found:
        if path.endswith("libcuda.so.1"):
            os.symlink(path, os.path.join(scratch, "libcuda.so"))
            return [scratch] + dirs
    return dirs


def main(sdist, wheel_dir):
    wheel_dir = os.path.abspath(wheel_dir)
    os.makedirs(wheel_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="pycuda-build-")
    with tarfile.open(sdist) as archive:
        archive.extractall(scratch, filter="data")
    source = next(p for p in glob.glob(os.path.join(scratch, "pycuda-*")) if os.path.isdir(p))
    root = cuda_root()
    lib_dirs = libcuda_dirs(root, scratch)
    with open(os.path.join(source, "siteconf.py"), "w") as conf:
        conf.write(f"CUDA_ROOT = {root!r}\nCUDA_ENABLE_CURAND = False\n"
                   f"CUDADRV_LIB_DIR = {lib_dirs!r}\nCUDART_LIB_DIR = {lib_dirs!r}\n")
    print(f"pycuda from {sdist}: CUDA_ROOT {root}, libcuda from {lib_dirs}", flush=True)
    compile_in_parallel(os.cpu_count() or 1)
    os.chdir(source)
    sys.path.insert(0, source)  # setup.py imports aksetup_helper from its own folder
    from setuptools import build_meta
    name = build_meta.build_wheel(wheel_dir)
    print(f"built {os.path.join(wheel_dir, name)}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    main(*sys.argv[1:])
