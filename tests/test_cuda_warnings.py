"""Every generated .cu compiles with no warning (#66): nvcc, with the flags moagen builds
with and its warnings as errors, takes each file for every GPU we target.

Only through nvcc's front end (--ptx with NVVM's optimizer off, -Xcicc -O0): nvcc's
numbered warnings (#177, a variable never referenced, and the like) come from it, and it
reported the same ones, file by file, as `nvcc -O3 -c` did on generated/ before #66's fix
(1,346 a GPU), at a tenth of the CPU time. ptxas' own warnings are not checked here."""
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from moagen.commands.common import GENERATED
from moagen.targets.cuda.build import CUDA_ARCHS
from moagen.targets.toolchain import Toolchain

NVCC = shutil.which(Toolchain().nvcc)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the generated CUDA "
                                                     "is not compiled")


def complaints(source, arch):
    """nvcc's output where it fails `source` for `arch` (a warning counts), else ""."""
    done = subprocess.run([NVCC, *Toolchain().nvccflags, f"-arch={arch}", "--ptx", "-Xcicc",
                           "-O0", "-Werror", "all-warnings", "-o", os.devnull, str(source)],
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stdout + done.stderr


@needs_nvcc
def test_a_warning_fails_the_check(tmp_path):
    source = tmp_path / "unused.cu"
    source.write_text("__global__ void k(float *x) { const int i = 0; x[0] = 1.0f; }\n")
    assert "#177" in complaints(source, CUDA_ARCHS[0])


@needs_nvcc
def test_every_generated_cu_compiles_without_warnings():
    jobs = [(source, arch) for source in sorted(GENERATED.glob("*.cu")) for arch in CUDA_ARCHS]
    assert jobs
    with ThreadPoolExecutor(2) as pool:  # nvcc is a process each: two at once halve the time
        failed = [f"{source.name} ({arch}):\n{out}" for (source, arch), out
                  in zip(jobs, pool.map(lambda job: complaints(*job), jobs)) if out]
    assert not failed, "\n".join(failed)
