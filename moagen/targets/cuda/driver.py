"""The GPU's memory and clock through CUDA's driver API, as cuda-python (the cuda-bindings
package) exposes it: allocations, copies, pointer checks and event timing on device 0's
primary context, the context the launchers' runtime API calls use too (and PyTorch's and
CuPy's), so that their arrays' pointers are valid in our kernels and theirs in ours.

cuda-python is imported when the device is first asked for, never at module import, so
everything else works on machines without it or without a GPU."""
from functools import lru_cache

from moagen.errors import DeviceUnavailable
from moagen.targets.cuda.arrays import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM

INSTALL = "pip install cuda-bindings (cuda-python's driver API), on a machine with a CUDA driver"


class CudaError(RuntimeError):
    """A driver API call that failed; the message names the call and CUDA's error."""


@lru_cache(maxsize=None)
def device():
    """The one Driver of this process; DeviceUnavailable where there is no GPU to use."""
    return Driver()


class Driver:
    ordinal = 0  # the GPU the launchers run on (the runtime's current device)

    def __init__(self):
        try:
            from cuda.bindings import driver
        except ImportError as error:
            raise DeviceUnavailable(f"CUDA kernels need cuda-python, which cannot be imported "
                                    f"({error}); {INSTALL}") from error
        self._driver = driver
        try:
            self._call(driver.cuInit, 0)
            if self._call(driver.cuDeviceGetCount) == 0:
                raise DeviceUnavailable("no CUDA device found")
            handle = self._call(driver.cuDeviceGet, self.ordinal)
            self.name = self._call(driver.cuDeviceGetName, 256, handle).split(b"\0")[0].decode()
            # what a kernel's chosen sizes fit their grid to (GivenSize)
            self.multiprocessors = self._call(
                driver.cuDeviceGetAttribute,
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, handle)
            self._context = self._call(driver.cuDevicePrimaryCtxRetain, handle)
            self._context_handle = _handle(self._context)
            self.activate()
        except RuntimeError as error:  # no libcuda (no driver), no device, a broken one
            raise DeviceUnavailable(f"no usable CUDA device: {error}") from error

    def activate(self):
        """Make the primary context current on the calling thread (per-thread state)."""
        self._call(self._driver.cuCtxSetCurrent, self._context)

    def allocate(self, nbytes):
        """(pointer, what keeps the memory alive: it is freed when that goes)."""
        if nbytes == 0:
            return 0, None
        ptr = int(self._call(self._driver.cuMemAlloc, nbytes))
        return ptr, _Allocation(self._driver, ptr)

    def copy_in(self, view, host):
        if view.nbytes:
            self._call(self._driver.cuMemcpyHtoD, self._driver.CUdeviceptr(view.ptr),
                       host.ctypes.data, view.nbytes)

    def copy_out(self, host, view):
        if view.nbytes:
            self._call(self._driver.cuMemcpyDtoH, host.ctypes.data,
                       self._driver.CUdeviceptr(view.ptr), view.nbytes)

    def copy(self, destination, source):
        """Device to device, the bytes of `source` (no larger than `destination`)."""
        if source.nbytes:
            self._call(self._driver.cuMemcpyDtoD, self._driver.CUdeviceptr(destination.ptr),
                       self._driver.CUdeviceptr(source.ptr), source.nbytes)

    def check(self, view, where):
        """That the view's bytes lie in one allocation on our GPU: a host pointer, or one
        into another GPU's memory, would fault in the kernel."""
        if not view.nbytes:
            return
        attribute = self._driver.CUpointer_attribute
        pointer = self._driver.CUdeviceptr(view.ptr)
        try:
            start = int(self._call(self._driver.cuPointerGetAttribute,
                                   attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, pointer))
            size = int(self._call(self._driver.cuPointerGetAttribute,
                                  attribute.CU_POINTER_ATTRIBUTE_RANGE_SIZE, pointer))
            ordinal = int(self._call(self._driver.cuPointerGetAttribute,
                                     attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pointer))
        except CudaError as error:
            raise ValueError(f"{where}: its pointer {view.ptr:#x} is not CUDA device memory "
                             f"({error})") from error
        if ordinal != self.ordinal:
            raise ValueError(f"{where}: it is on GPU {ordinal}; the kernels run on GPU {self.ordinal}")
        context = self._context_of(pointer)
        if None not in (context, self._context_handle) and context != self._context_handle:
            raise ValueError(f"{where}: it was allocated in a CUDA context of its own, not the "
                             "device's primary context the kernels run in (pycuda.autoinit makes "
                             "one: import pycuda.autoprimaryctx instead)")
        if view.ptr + view.nbytes > start + size:
            raise ValueError(f"{where}: its {view.nbytes} bytes run past the end of its allocation")

    def _context_of(self, pointer):
        """The handle (an int) of the context an allocation was made in; None where the
        driver names none or will not say (then only the range checks judge it)."""
        try:
            context = self._call(self._driver.cuPointerGetAttribute,
                                 self._driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT,
                                 pointer)
        except CudaError:
            return None
        return _handle(context)

    def wait_for(self, stream, launch_stream=0):
        """Wait for the work queued on an array's stream (interface version 3) before a
        launch on launch_stream, unless that is the same stream (1, the interface's legacy
        default stream, is the launchers' 0)."""
        if stream in (None, launch_stream) or (stream, launch_stream) == (LEGACY_DEFAULT_STREAM, 0):
            return
        if stream == PER_THREAD_DEFAULT_STREAM:  # some thread's: wait for every stream
            self._call(self._driver.cuCtxSynchronize)
        else:  # a handle, or 1: CUDA's CU_STREAM_LEGACY
            self._call(self._driver.cuStreamSynchronize, self._driver.CUstream(stream))

    def elapsed(self, fn) -> float:
        """Seconds of GPU time fn() queues on the legacy default stream (where the
        launchers and PyTorch's default stream run), between two events; for a kernel
        called with device arrays, no transfer is inside."""
        driver = self._driver
        start, stop = (self._call(driver.cuEventCreate, driver.CUevent_flags.CU_EVENT_DEFAULT)
                       for _ in range(2))
        try:
            self._call(driver.cuEventRecord, start, driver.CUstream(0))
            fn()
            self._call(driver.cuEventRecord, stop, driver.CUstream(0))
            self._call(driver.cuEventSynchronize, stop)
            return self._call(driver.cuEventElapsedTime, start, stop) / 1e3
        finally:
            for event in (start, stop):
                driver.cuEventDestroy(event)

    def synchronize(self):
        self._call(self._driver.cuCtxSynchronize)

    def torch_tensor(self, array):
        """A CUDA torch tensor over a DeviceArray's memory (no copy)."""
        import torch
        return torch.as_tensor(array, device=f"cuda:{self.ordinal}")

    def _call(self, function, *args):
        """A driver call's value; its error as a CudaError."""
        err, *values = function(*args)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            _, text = self._driver.cuGetErrorString(err)
            raise CudaError(f"{function.__name__}: {err.name}: "
                            f"{text.decode() if isinstance(text, bytes) else text}")
        return values[0] if len(values) == 1 else tuple(values) or None


def _handle(context):
    """A CUcontext's address as an int (None for the null context, or where the binding
    will not say)."""
    try:
        return int(context) or None
    except (TypeError, ValueError):
        return None


class _Allocation:
    """Frees one cuMemAlloc when collected."""

    def __init__(self, driver, ptr):
        self._driver, self._ptr = driver, ptr

    def __del__(self):
        self._driver.cuMemFree(self._driver.CUdeviceptr(self._ptr))
