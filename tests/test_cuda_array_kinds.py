"""Kinds of device array (moagen.targets.cuda.arrays.KINDS) through the emulation: a call on
pycuda GPUArrays gets GPUArrays back. pycuda cannot be installed where there is no CUDA
driver, so `pycuda.gpuarray` here is a stand-in module with what moagen uses of pycuda
2026.1's (read from its source): `empty = GPUArray`, GPUArray(shape, dtype, order="C")
allocating the memory itself, and its `__cuda_array_interface__` (shape, strides, data,
typestr, stream None, version 3); its memory is the emulation's device memory. Everything
else is the real code: the kind found by the type's module and name, the outputs allocated
through arrays.KINDS' pycuda entry (which imports `pycuda.gpuarray`), checked by the device
and returned as they were made. On a GPU the same runs with pycuda itself
(tests/test_pycuda_gpu.py)."""
import sys
import types

import numpy as np
import pytest

from moagen import runtime, verify
from moagen.kernels import get_kernel
from moagen.request import resolve
from moagen.targets.cuda.arrays import DeviceArray, array_kind, device_view, to_device
from moagen.targets.cuda.emulated import HostDevice
from moagen.targets.cuda.loader import bind_on


def stand_in_gpuarray(device):
    """A module `pycuda.gpuarray` whose GPUArrays live in `device`'s memory."""
    module = types.ModuleType("pycuda.gpuarray")

    class GPUArray:
        def __init__(self, shape, dtype, order="C"):
            self._memory = DeviceArray(device, tuple(shape), dtype, order)  # its allocation
            self.shape, self.dtype = self._memory.shape, self._memory.dtype
            self.strides = self._memory.strides
            module.allocated += 1

        @property
        def __cuda_array_interface__(self):
            return {"shape": self.shape, "strides": self.strides,
                    "data": (self._memory.ptr, False), "typestr": self.dtype.str,
                    "stream": None, "version": 3}

        def get(self):
            return self._memory.get()

    GPUArray.__module__ = "pycuda.gpuarray"
    module.GPUArray = module.empty = GPUArray
    module.allocated = 0

    def to_gpu(host):
        array = GPUArray(host.shape, host.dtype)
        device.copy_in(device_view(array), np.ascontiguousarray(host))
        return array

    module.to_gpu = to_gpu
    return module


@pytest.fixture
def gpu():
    return HostDevice()


@pytest.fixture
def gpuarray(gpu, monkeypatch):
    module = stand_in_gpuarray(gpu)
    package = types.ModuleType("pycuda")
    package.gpuarray = module
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.gpuarray", module)
    return module


def _kernel(gpu, kernel, variant, dtype="float64"):
    loaded = runtime.load(kernel, variant, "cuda-emulated", dtype)
    return bind_on(gpu, runtime.library(resolve(kernel, variant, "cuda-emulated")), loaded.signature,
                   get_kernel(kernel).validate)


def _case(fn, kernel):
    check = get_kernel(kernel).check
    sizes = check.sizes[1]
    scalars = verify.call_scalars(kernel, sizes)
    inputs = verify.make_inputs(fn.signature, sizes, scalars, check, np.random.default_rng(4))
    expected = check.references["numpy"](*(a.astype(np.float64) for a in inputs), **scalars)
    return inputs, scalars, expected if isinstance(expected, tuple) else (expected,)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpuarrays_in_gpuarrays_out(gpu, gpuarray, dtype):
    fn = _kernel(gpu, "attention_fwd", "online", dtype)
    inputs, scalars, expected = _case(fn, "attention_fwd")
    outputs = fn(*(gpuarray.to_gpu(a) for a in inputs), **scalars)
    assert gpuarray.allocated == len(inputs) + len(outputs)  # the outputs pycuda's own
    assert all(type(o) is gpuarray.GPUArray for o in outputs)
    for ours, ref in zip(outputs, expected):
        assert verify.normwise_error(ours.get(), ref) <= verify.TOLERANCE[dtype]


def test_mixed_kinds_and_out_get_what_they_always_got(gpu, gpuarray):
    """A GPUArray next to a DeviceArray: DeviceArrays back; out=: the caller's arrays."""
    fn = _kernel(gpu, "rmsnorm_fwd", "dnf")
    (x, weight), scalars, expected = _case(fn, "rmsnorm_fwd")
    mixed = fn(gpuarray.to_gpu(x), to_device(gpu, weight), **scalars)
    assert all(isinstance(o, DeviceArray) for o in mixed)
    theirs = tuple(gpuarray.GPUArray(e.shape, e.dtype) for e in expected)
    assert all(a is b for a, b in zip(fn(gpuarray.to_gpu(x), gpuarray.to_gpu(weight), **scalars,
                                         out=theirs), theirs))
    for mine, other in zip(theirs, mixed):
        np.testing.assert_array_equal(mine.get(), other.get())


def test_an_output_outside_the_devices_memory_is_refused(gpu, gpuarray):
    """The kind's allocation is checked as an input is: here pycuda's memory is another
    device's (on a GPU: another context's)."""
    fn = _kernel(gpu, "rmsnorm_fwd", "dnf")
    (x, weight), scalars, _ = _case(fn, "rmsnorm_fwd")
    inputs = gpuarray.to_gpu(x), gpuarray.to_gpu(weight)
    gpuarray.empty = stand_in_gpuarray(HostDevice()).GPUArray
    with pytest.raises(ValueError, match=r"rmsnorm_fwd\w*: out 'z' \(allocated by pycuda\): its "
                                         "pointer 0x[0-9a-f]+ is not device memory"):
        fn(*inputs, **scalars)


def test_kinds_are_told_by_type_without_importing_their_library(gpu):
    if "pycuda" in sys.modules:
        pytest.skip("pycuda is imported already")
    array = DeviceArray(gpu, (3,), np.float64)
    assert array_kind([array]) is None
    fn = _kernel(gpu, "rmsnorm_fwd", "dnf")
    (x, weight), scalars, _ = _case(fn, "rmsnorm_fwd")
    assert all(isinstance(o, DeviceArray)
               for o in fn(to_device(gpu, x), to_device(gpu, weight), **scalars))
    assert "pycuda" not in sys.modules

    class GPUArray:  # the name without pycuda's module is no GPUArray
        __cuda_array_interface__ = array.__cuda_array_interface__

    assert array_kind([device_view(GPUArray())]) is None
    subclass = type("Mine", (stand_in_gpuarray(gpu).GPUArray,), {})
    assert array_kind([device_view(subclass((3,), np.float64))]).name == "pycuda"
