"""Run CUDA kernels: the nvcc-built library's host launchers take device pointers, a device
(cuda_driver.Driver, through cuda-python) holds the memory. A kernel takes numpy arrays,
copied to the GPU and the results back, or device arrays (anything with
`__cuda_array_interface__`: a CUDA torch tensor, a cupy array, a pycuda GPUArray, a
DeviceArray), used where they are with no copy; its outputs are then DeviceArrays (pycuda
GPUArrays where the inputs were: arrays.KINDS), unless `out` names the caller's.
A call on device arrays is queued on a stream (`stream=`, a cudaStream_t as an int; the
legacy default stream unless given) and returns without waiting for the kernel, as CUDA
libraries do; a call on numpy arrays runs on the legacy default stream and returns when
their results are copied back.
The emulation (cuda_emulated) binds its host-built launchers through the same code."""
from pathlib import Path

import cffi

from moagen.errors import DeviceUnavailable, EmulationCheckError, SharedMemoryLimit
from moagen.targets.abi import KernelCallable, flat_view
from moagen.targets.c.loader import declaration, dlopen, element_types
from moagen.targets.cuda.arrays import DeviceArray, DeviceView, to_device
from moagen.targets.cuda.driver import device


def load(path):
    """The library bind() takes (its path), once a device is known to be there."""
    device()
    return Path(path)


def bind(library, signature, validate=None):
    return bind_on(device(), library, signature, validate)


def bind_on(gpu, library, signature, validate=None):
    """The kernel of `library` (a path) whose launcher `signature` describes, run on `gpu`."""
    ffi = cffi.FFI()
    ffi.cdef(declaration(signature, result="int", trailing=("void *",)))
    ffi.cdef(EMULATION_ERROR)
    ffi.cdef(LAUNCH_ERROR)
    lib = dlopen(ffi, library)
    launcher = getattr(lib, signature.name)
    pointer_types = [element + " *" for element in element_types(signature)]
    n_arrays = len(signature.arrays)
    intents = [a.intent for a in signature.arrays]

    def native_call(*args, stream=0):
        gpu.activate()
        arrays = [_on_device(gpu, a, intent) for a, intent in zip(args[:n_arrays], intents)]
        for array in arrays:
            gpu.wait_for(array.stream, stream)
        pointers = (ffi.cast(t, a.ptr) for t, a in zip(pointer_types, arrays))
        check_launch(signature.name, launcher(*pointers,
                                              *args[n_arrays:], ffi.cast("void *", stream)),
                     lambda: emulation_error(ffi, lib),
                     lambda: ffi.string(lib.moagen_launch_error()).decode(errors="replace"))
        for host, array, intent in zip(args, arrays, intents):  # numpy arrays' results back
            if intent in ("inout", "out") and not isinstance(host, DeviceView):
                gpu.copy_out(flat_view(host), array)

    return KernelCallable(signature, native_call, validate, device=gpu)


def _on_device(gpu, array, intent):
    """A device array as it is; a numpy array's copy on the device (for what the kernel
    reads), or memory of its size (for what it only writes)."""
    if isinstance(array, DeviceView):
        return array
    if intent in ("in", "inout"):
        return to_device(gpu, flat_view(array))
    return DeviceArray(gpu, (array.size,), array.dtype)


# what the emulation's launchers return when one of its checks failed a launch (the race
# check's, a shuffle's: templates/cuda/emulation/cuda_runtime.h), and the function that says which
EMULATION_CHECK_FAILED = 9999
EMULATION_ERROR = "const char *moagen_emulation_error(void);"
# what a tiled kernel's launcher returns when a block asks more shared memory than the
# device allows (templates/cuda/kernel.cu.j2), and the function that says how much
SHARED_OVER_LIMIT = 9998
LAUNCH_ERROR = "const char *moagen_launch_error(void);"


def emulation_error(ffi, lib) -> str:
    """The emulation's message for its last failed launch (lib: a library cdef'd with
    EMULATION_ERROR)."""
    return ffi.string(lib.moagen_emulation_error()).decode(errors="replace")


def check_launch(name, code, message=None, launch_message=None):
    """A launcher's result: 0, or the cudaError_t of its first failure, raised; the
    emulation's failed check as EmulationCheckError, with message() (what it says); a block
    over the device's shared memory as SharedMemoryLimit, with launch_message()."""
    if code == EMULATION_CHECK_FAILED and message is not None:
        raise EmulationCheckError(f"{name}: {message()}")
    if code == SHARED_OVER_LIMIT and launch_message is not None:
        raise SharedMemoryLimit(f"{name}: {launch_message()}")
    if code != 0:
        raise RuntimeError(f"{name}: the CUDA launcher returned cudaError_t {code}")


def available() -> bool:
    """Whether CUDA kernels can run here (cuda-python imports and a GPU answers)."""
    try:
        device()
    except DeviceUnavailable:
        return False
    return True
