"""Run CUDA kernels: the nvcc-built library's host launchers take device pointers; pycuda
moves the arrays. pycuda is imported when a library is loaded, never at module import, so
everything else works on machines without it."""
from pathlib import Path

import cffi

from ..errors import DeviceUnavailable
from .abi import KernelCallable, flat_view
from .c import CTYPES, declaration, dlopen


def load(path):
    """The library bind() takes (its path), once a device is known to be there."""
    _gpuarray()
    return Path(path)


def bind(library, signature, validate=None):
    gpuarray = _gpuarray()
    ffi = cffi.FFI()
    ffi.cdef(declaration(signature, result="int"))
    launcher = getattr(dlopen(ffi, library), signature.name)
    pointer_type = CTYPES[signature.dtype] + " *"
    n_inputs, n_arrays = len(signature.inputs), len(signature.arrays)

    def native_call(*args):
        host = [flat_view(a) for a in args[:n_arrays]]
        device = [gpuarray.to_gpu(a) for a in host[:n_inputs]]
        device += [gpuarray.empty(a.shape, a.dtype) for a in host[n_inputs:]]
        code = launcher(*(ffi.cast(pointer_type, int(d.gpudata)) for d in device), *args[n_arrays:])
        check_launch(signature.name, code)
        written = [k for k, a in enumerate(signature.arrays) if a.intent in ("inout", "out")]
        for k in written:
            device[k].get(ary=host[k])  # into the caller's memory; scratch stays on the device

    return KernelCallable(signature, native_call, validate)


def check_launch(name, code):
    """A launcher's result: 0, or the cudaError_t of its first failure, raised."""
    if code != 0:
        raise RuntimeError(f"{name}: the CUDA launcher returned cudaError_t {code}")


def available() -> bool:
    """Whether CUDA kernels can run here (pycuda imports and a GPU answers)."""
    try:
        _gpuarray()
    except DeviceUnavailable:
        return False
    return True


def _gpuarray():
    """pycuda.gpuarray on the device's primary context, which the launchers' runtime API
    calls use too; DeviceUnavailable when there is no pycuda or no GPU."""
    try:
        import pycuda.driver as driver
    except ImportError as error:
        raise DeviceUnavailable(f"CUDA kernels need pycuda, which cannot be imported ({error}); "
                                "install it on a machine with a CUDA driver: pip install pycuda") from error
    try:
        driver.init()
        if driver.Device.count() == 0:
            raise DeviceUnavailable("no CUDA device found")
        import pycuda.autoprimaryctx  # noqa: F401  (makes the primary context current)
        import pycuda.gpuarray
    except driver.Error as error:
        raise DeviceUnavailable(f"no usable CUDA device: {error}") from error
    return pycuda.gpuarray
