"""Run CUDA kernels built for the host (moagen.build.build_cuda_emulated): their launchers
take host pointers, so they are loaded and bound as C is, and their cudaError_t is checked
as on a GPU."""
from . import c
from .abi import KernelCallable
from .cuda import check_launch

load = c.load


def bind(library, signature, validate=None):
    launch = c.host_call(library, signature, result="int")

    def native_call(*args):
        check_launch(signature.name, launch(*args))

    return KernelCallable(signature, native_call, validate)
