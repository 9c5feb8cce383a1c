"""Run CUDA kernels built for the host (moagen.targets.cuda.build.build_cuda_emulated): their launchers
take host pointers, so the emulation's device memory is host memory, and they are bound
through the CUDA binding itself (moagen.targets.cuda.loader.bind_on): numpy arrays are copied in and
out, device arrays used where they are, cudaError_t checked, as on a GPU."""
import ctypes
import time
import weakref

import numpy as np

from moagen.cost.gpu import H200
from moagen.targets.c import loader as c
from moagen.targets.cuda.loader import bind_on

load = c.load


class HostDevice:
    """The emulation's GPU: its memory is host memory it allocated and remembers, so that
    a pointer into any other memory is refused, as a GPU's driver refuses a host pointer;
    launches are synchronous, so there are no streams to wait for; its clock is the host's."""

    name = "CUDA emulated on the host"
    multiprocessors = H200.sms  # the modelled GPU's, which moagen cost reports on too

    def __init__(self):
        self._live = {}  # pointer -> bytes, of the allocations not yet freed

    def activate(self):
        pass  # no context

    def allocate(self, nbytes):
        memory = np.empty(max(nbytes, 1), np.uint8)
        ptr = memory.ctypes.data
        self._live[ptr] = nbytes
        weakref.finalize(memory, self._live.pop, ptr, None)
        return ptr, memory

    def copy_in(self, view, host):
        ctypes.memmove(view.ptr, host.ctypes.data, view.nbytes)

    def copy_out(self, host, view):
        ctypes.memmove(host.ctypes.data, view.ptr, view.nbytes)

    def copy(self, destination, source):
        ctypes.memmove(destination.ptr, source.ptr, source.nbytes)

    def check(self, view, where):
        if view.nbytes and not any(start <= view.ptr and view.ptr + view.nbytes <= start + size
                                   for start, size in self._live.items()):
            raise ValueError(f"{where}: its pointer {view.ptr:#x} is not device memory (in the "
                             "emulation: memory this process's HostDevice allocated)")

    def wait_for(self, stream, launch_stream=0):
        pass

    def elapsed(self, fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def synchronize(self):
        pass

    def torch_tensor(self, array):
        """A CPU torch tensor over the array's (host) memory, no copy: what a CUDA tensor
        is on a GPU."""
        import torch
        buffer = (ctypes.c_char * array.nbytes).from_address(array.ptr)
        host = np.frombuffer(buffer, array.dtype).reshape(array.shape,
                                                           order="C" if array.flags.c_contiguous else "F")
        return torch.from_numpy(host)


DEVICE = HostDevice()


def device():
    return DEVICE


def bind(library, signature, validate=None):
    return bind_on(DEVICE, library, signature, validate)
