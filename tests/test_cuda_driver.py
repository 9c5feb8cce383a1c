"""The GPU binding's use of cuda-python (moagen.targets.cuda.driver.Driver) without a GPU: a
stand-in for `cuda.bindings.driver` with its calling convention (every call returns a
tuple, CUresult first; pointers wrapped in CUdeviceptr) whose "device memory" is host
memory, and the emulated kernels as the GPU. This checks our side of the API (context,
allocations, copies, pointer checks, events, errors), not the driver: that runs in
tests/test_cuda_gpu.py on a GPU."""
import ctypes
import enum
import sys
import time
import types

import numpy as np
import pytest

from moagen import runtime, verify
from moagen.request import resolve
from moagen.targets.cuda.loader import bind_on
from moagen.targets.cuda.arrays import DeviceArray, device_view, to_device
from moagen.targets.cuda.driver import Driver
from moagen.errors import DeviceUnavailable
from moagen.kernels import get_kernel


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NO_DEVICE = 100


class Handle:
    """CUdeviceptr, CUstream: an integer in a wrapper."""

    def __init__(self, value=0):
        self.value = int(value)

    def __int__(self):
        return self.value


def stand_in(devices=1):
    """A module with the driver calls Driver makes, over host memory."""
    ok = (CUresult.CUDA_SUCCESS,)
    memory, calls = {}, []
    primary = Handle(0xC0)
    contexts = {}  # an allocation's start -> the context it was made in, where not the primary

    def allocation(ptr):
        return next(((start, len(buf)) for start, buf in memory.items()
                     if start <= ptr < start + len(buf)), None)

    def alloc(n):
        buf = np.empty(n, np.uint8)
        memory[buf.ctypes.data] = buf
        return ok + (Handle(buf.ctypes.data),)

    def attribute(kind, ptr):
        found = allocation(int(ptr))
        if found is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        if kind == "context" and contexts.get(found[0]) == "unknown":
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        return ok + ({"start": found[0], "size": found[1], "ordinal": 0,
                      "context": contexts.get(found[0], primary)}[kind],)

    def record(event, stream):
        event["t"] = time.perf_counter()
        return ok

    def copy(dst, src, n):
        ctypes.memmove(int(dst), int(src), n)
        calls.append("copy")
        return ok

    module = types.SimpleNamespace(
        CUresult=CUresult, CUdeviceptr=Handle, CUstream=Handle,
        CUevent_flags=types.SimpleNamespace(CU_EVENT_DEFAULT=0),
        CUpointer_attribute=types.SimpleNamespace(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR="start",
                                                  CU_POINTER_ATTRIBUTE_RANGE_SIZE="size",
                                                  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL="ordinal",
                                                  CU_POINTER_ATTRIBUTE_CONTEXT="context"),
        cuInit=lambda flags: ok, cuDeviceGetCount=lambda: ok + (devices,),
        cuDeviceGet=lambda i: ok + (i,), cuDeviceGetName=lambda n, dev: ok + (b"Stand-in\0\0",),
        CUdevice_attribute=types.SimpleNamespace(
            CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT="multiprocessors"),
        cuDeviceGetAttribute=lambda attribute, dev: ok + ({"multiprocessors": 132}[attribute],),
        cuDevicePrimaryCtxRetain=lambda dev: ok + (primary,),
        cuCtxSetCurrent=lambda ctx: ok, cuCtxSynchronize=lambda: ok,
        cuMemAlloc=alloc, cuMemFree=lambda p: (memory.pop(int(p)), ok)[1],
        cuMemcpyHtoD=copy, cuMemcpyDtoH=copy, cuMemcpyDtoD=copy,
        cuPointerGetAttribute=attribute,
        cuStreamSynchronize=lambda s: (calls.append(("wait", int(s))), ok)[1],
        cuEventCreate=lambda flags: ok + ({},), cuEventRecord=record,
        cuEventSynchronize=lambda e: ok, cuEventDestroy=lambda e: ok,
        cuEventElapsedTime=lambda a, b: ok + ((b["t"] - a["t"]) * 1e3,),
        cuGetErrorString=lambda err: ok + (b"stand-in error",))
    for name, function in vars(module).items():
        if name.startswith("cu"):
            function.__name__ = name  # as the real functions are named in our errors
    module.contexts = contexts
    return module, memory, calls


@pytest.fixture
def driver(monkeypatch):
    module, memory, calls = stand_in()
    package = types.ModuleType("cuda.bindings")
    package.driver = module
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", module)
    gpu = Driver()
    return gpu, memory, calls


def test_a_kernel_runs_on_driver_memory_with_numpy_and_device_arrays(driver):
    gpu, memory, calls = driver
    assert gpu.name == "Stand-in" and gpu.multiprocessors == 132  # what chosen sizes fit
    loaded = runtime.load("attention_decode", "split", "cuda-emulated")
    fn = bind_on(gpu, runtime.library(resolve("attention_decode", "split", "cuda-emulated")),
                 loaded.signature, get_kernel("attention_decode").validate)
    check = get_kernel("attention_decode").check
    scalars = verify.call_scalars("attention_decode", check.sizes[1])
    inputs = verify.make_inputs(fn.signature, check.sizes[1], scalars, check, np.random.default_rng(3))
    expected = check.references["numpy"](*inputs, **scalars)

    on_host = fn(*inputs, **scalars)
    for ours, ref in zip(on_host, expected):
        assert verify.normwise_error(ours, ref) <= 1e-12
    assert calls.count("copy") == len(inputs) + len(on_host)
    resident = [to_device(gpu, a) for a in inputs]
    del calls[:]
    on_device = fn(*resident, **scalars)
    assert calls == [] and all(isinstance(o, DeviceArray) for o in on_device)
    for ours, host in zip(on_device, on_host):
        np.testing.assert_array_equal(ours.get(), host)
    kept = len(memory)  # inputs, outputs and the scratch kept for the next call
    del on_device, resident
    assert len(memory) < kept  # freed with their arrays
    assert 0 <= gpu.elapsed(lambda: fn(*inputs, **scalars)) < 60


def test_pointers_outside_its_memory_are_refused(driver):
    gpu, _, _ = driver
    array = DeviceArray(gpu, (4, 3), np.float64)
    gpu.check(array, "x")
    host = np.zeros(12)
    with pytest.raises(ValueError, match=r"x: its pointer 0x[0-9a-f]+ is not CUDA device memory "
                                         r"\(cuPointerGetAttribute: CUDA_ERROR_INVALID_VALUE"):
        gpu.check(device_view(_Interface(host.ctypes.data, (12,))), "x")
    with pytest.raises(ValueError, match="run past the end of its allocation"):
        gpu.check(device_view(_Interface(array.ptr + 8, (12,))), "x")


def test_memory_of_another_context_is_refused(driver):
    """pycuda.autoinit's arrays live in a context of pycuda's own, which a kernel launched in
    the primary context would fault on; a pointer whose context the driver will not name is
    judged by its range alone."""
    gpu, _, _ = driver
    module = sys.modules["cuda.bindings.driver"]
    array = DeviceArray(gpu, (4, 3), np.float64)
    module.contexts[array.ptr] = Handle(0xD0)
    with pytest.raises(ValueError, match=r"x: it was allocated in a CUDA context of its own, not "
                                         r"the device's primary context .*pycuda.autoprimaryctx"):
        gpu.check(array, "x")
    module.contexts[array.ptr] = "unknown"
    gpu.check(array, "x")


def test_other_streams_are_waited_for(driver):
    gpu, _, calls = driver
    for stream in (None, 1):  # nothing pending; the legacy default stream, ours too
        gpu.wait_for(stream)
    gpu.wait_for(0xABC)
    gpu.wait_for(0xABC, 0xABC)  # the launch's own stream orders it
    gpu.wait_for(1, 0xABC)  # the legacy default stream, before a launch on another
    assert calls == [("wait", 0xABC), ("wait", 1)]


def test_no_device_is_device_unavailable(monkeypatch):
    module, _, _ = stand_in(devices=0)
    package = types.ModuleType("cuda.bindings")
    package.driver = module
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", module)
    with pytest.raises(DeviceUnavailable, match="no CUDA device found"):
        Driver()


class _Interface:
    def __init__(self, ptr, shape):
        self.__cuda_array_interface__ = dict(shape=shape, typestr="<f8", data=(ptr, False),
                                             version=3)
