"""CUDA kernels on a GPU called with pycuda GPUArrays: used where they are, and the outputs
GPUArrays that pycuda allocated, in the primary context the kernels run in (pycuda's
autoprimaryctx). bench/gpu.sh builds pycuda from its source there and runs this; where
there is no pycuda or no GPU every test skips (the same code runs with a stand-in
pycuda.gpuarray on the emulation: tests/test_cuda_array_kinds.py)."""
import numpy as np
import pytest

from moagen import runtime, verify
from moagen.kernels import get_kernel
from moagen.targets.cuda import loader as cuda

pytestmark = pytest.mark.skipif(not cuda.available(), reason="no GPU (or no cuda-python) here")


@pytest.fixture(scope="module")
def pycuda():
    try:
        import pycuda.autoprimaryctx  # noqa: F401  (the primary context, pushed)
        import pycuda.driver
        import pycuda.gpuarray
    except ImportError as error:
        pytest.skip(f"no pycuda here ({error})")
    return pycuda


def _case(kernel, variant, dtype="float64"):
    fn = runtime.load(kernel, variant, "cuda", dtype, tuned=False)
    check = get_kernel(kernel).check
    sizes = check.sizes[-1]
    scalars = verify.call_scalars(kernel, sizes)
    inputs = verify.make_inputs(fn.signature, sizes, scalars, check, np.random.default_rng(5))
    expected = check.references["numpy"](*(a.astype(np.float64) for a in inputs), **scalars)
    return fn, inputs, scalars, expected if isinstance(expected, tuple) else (expected,)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpuarrays_in_gpuarrays_out(pycuda, dtype):
    gpuarray = pycuda.gpuarray
    fn, inputs, scalars, expected = _case("attention_fwd", "online", dtype)
    outputs = fn(*(gpuarray.to_gpu(a) for a in inputs), **scalars)
    assert all(isinstance(o, gpuarray.GPUArray) for o in outputs)
    for out, ref in zip(outputs, expected):
        assert out.dtype == np.dtype(dtype) and out.shape == ref.shape
        assert verify.normwise_error(out.get(), ref) <= verify.TOLERANCE[dtype]


def test_out_takes_gpuarrays_and_an_inout_kernel_updates_them(pycuda):
    gpuarray = pycuda.gpuarray
    fn, inputs, scalars, expected = _case("rmsnorm_fwd", "dnf")
    theirs = tuple(gpuarray.empty(e.shape, np.float64) for e in expected)
    returned = fn(*(gpuarray.to_gpu(a) for a in inputs), **scalars, out=theirs)
    assert all(r is t for r, t in zip(returned, theirs))
    for mine, ref in zip(theirs, expected):
        np.testing.assert_allclose(mine.get(), ref, rtol=1e-12, atol=1e-12)
    fn, inputs, scalars, expected = _case("kv_append", "dnf")
    caches = [gpuarray.to_gpu(a) for a in inputs]
    assert fn(*caches, **scalars) is None
    for cache, ref in zip(caches, expected):
        np.testing.assert_array_equal(cache.get(), ref)


def test_memory_of_another_context_is_refused(pycuda):
    """pycuda.autoinit's kind of context (one of pycuda's own): a kernel in the primary
    context would fault on its memory, so the call is refused before the launch. Last in
    this file: it pushes and pops a context."""
    drv, gpuarray = pycuda.driver, pycuda.gpuarray
    fn, inputs, scalars, _ = _case("rmsnorm_fwd", "dnf")
    context = drv.Device(0).make_context()
    try:
        x = gpuarray.to_gpu(inputs[0])
        weight = gpuarray.to_gpu(inputs[1])
    finally:
        context.pop()
    try:
        with pytest.raises(ValueError, match="allocated in a CUDA context of its own"):
            fn(x, weight, **scalars)
    finally:
        context.push()
        del x, weight
        context.pop()
        context.detach()
