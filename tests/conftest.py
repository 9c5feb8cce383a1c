import os
import types

# OpenMP's threads sleep at a barrier instead of spinning: the workers share the cores with
# each other and the compilers, where a spinning thread holds a core another process
# needs (test_verify's small calls 2-3x slower). Read by libgomp when first loaded: before
# the imports below, which may load torch's.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest
import sympy

from moagen.onf.signature import ArrayParam, Signature
from moagen.targets.fortran.target import MODULE

# A tiny kernel written by the generator's conventions, Y[i, j] = alpha * s[i] * X[i, j],
# in both dtypes per source; REAL and SFX are filled in per dtype.
_C = """
void scale_rows_SFX(const REAL *restrict X, const REAL *restrict s, REAL *restrict Y,
                    int64_t m, int64_t n, REAL alpha)
{
    #pragma omp parallel for
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++)
            Y[i * n + j] = alpha * s[i] * X[i * n + j];
}
"""
_FORTRAN = """
  subroutine scale_rows_SFX(X, s, Y, m, n, alpha) bind(C, name="scale_rows_SFX")
    integer(c_int64_t), value, intent(in) :: m, n
    real(REAL), value, intent(in) :: alpha
    real(REAL), intent(in) :: X(0:m*n - 1), s(0:m - 1)
    real(REAL), intent(out) :: Y(0:m*n - 1)
    integer(c_int64_t) :: i, j
    !$omp parallel do private(j)
    do i = 0, m - 1
      do j = 0, n - 1
        Y(i*n + j) = (alpha * s(i)) * X(i*n + j)
      end do
    end do
  end subroutine scale_rows_SFX
"""
_CUDA_LAUNCHER = """
extern "C" int scale_rows_SFX(const REAL *X, const REAL *s, REAL *Y, int64_t m, int64_t n, REAL alpha)
{
    scale_rows_kernel<<<(unsigned)((m * n + 255) / 256), 256>>>(X, s, Y, m, n, alpha);
    return (int)cudaGetLastError();
}
"""
_CUDA_KERNEL = """
template <typename T>
__global__ void scale_rows_kernel(const T *__restrict__ X, const T *__restrict__ s, T *__restrict__ Y,
                                  int64_t m, int64_t n, T alpha)
{
    int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (k < m * n)
        Y[k] = alpha * s[k / n] * X[k];
}
"""


def _both(template, f64, f32):
    return "".join(template.replace("REAL", real).replace("SFX", sfx)
                   for real, sfx in ((f64, "f64"), (f32, "f32")))


SOURCES = {
    "c": "#include <stdint.h>\n" + _both(_C, "double", "float"),
    # the module every Fortran kernel defines (moagen.targets.fortran.target)
    "fortran": (f"module {MODULE}\n  use iso_c_binding\n  implicit none\ncontains"
                + _both(_FORTRAN, "c_double", "c_float") + f"end module {MODULE}\n"),
    "cuda": "#include <stdint.h>\n" + _CUDA_KERNEL + _both(_CUDA_LAUNCHER, "double", "float"),
}


def signature(dtype="float64", layout="row"):
    m, n = sympy.symbols("m n", integer=True, positive=True)
    return Signature(
        name="scale_rows_" + {"float64": "f64", "float32": "f32"}[dtype],
        arrays=(ArrayParam("X", (m, n), "in"), ArrayParam("s", (m,), "in"), ArrayParam("Y", (m, n), "out")),
        sizes=(m, n), scalars=("alpha",), dtype=dtype, layout=layout)


@pytest.fixture(scope="session")
def scale_rows():
    """The scale_rows kernel: .sources by language, .signature(dtype, layout)."""
    return types.SimpleNamespace(sources=SOURCES, signature=signature)


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory):
    """A folder every test of this run shares, each pytest-xdist worker's too (a worker's
    base folder is one of the run's)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="session", autouse=True)
def session_build_dir(run_folder):
    """One build directory for every test, so that each kernel builds once a run (a test
    that loaded kernels without it built them into build/ as well: a fresh checkout
    compiled a quarter of the kernels twice); the workers' builds are atomic renames."""
    path = run_folder / "build"
    path.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOAGEN_BUILD_DIR", str(path))
        yield path
