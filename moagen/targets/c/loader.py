"""Load C kernels with cffi in ABI mode: dlopen the built library, no compiler at load time."""
from pathlib import Path

import cffi

from moagen.targets.abi import KernelCallable, flat_view
from moagen.targets.c.printer import C_TYPE as CTYPES  # the printer's, so the two agree


def element_types(signature):
    """Each array's C element type: the kernel's float, or an integer or bool input's own."""
    return [CTYPES[a.dtype(signature.dtype)] for a in signature.arrays]


def declaration(signature, result="void", trailing=()):
    """The cdef of a kernel's exported function (cffi's parser takes no `restrict`);
    trailing: the types of parameters after the signature's (a CUDA launcher's stream)."""
    ctype = CTYPES[signature.dtype]
    params = [f"const {element} *" if a.intent == "in" else f"{element} *"
              for a, element in zip(signature.arrays, element_types(signature))]
    params += ["int64_t"] * len(signature.sizes) + [ctype] * len(signature.scalars)
    params += trailing
    return f"{result} {signature.name}({', '.join(params)});"


def dlopen(ffi, path):
    """Load a built library for good: unloading it at interpreter exit while OpenMP worker
    threads may still be returning into it can crash the process."""
    return ffi.dlopen(str(path), ffi.RTLD_NOW | ffi.RTLD_NODELETE)


def load(path):
    """The library bind() takes: its path. Each bind dlopens it with an FFI of its own, since
    one FFI declares a name once and the f64 and f32 variants are bound separately."""
    return Path(path)


def bind(library, signature, validate=None):
    native_call, address_call = host_calls(library, signature)
    return KernelCallable(signature, native_call, validate, address_call=address_call)


def host_calls(library, signature):
    """The kernel's exported function over host arrays: (arrays, sizes, scalars) -> its
    result, the arrays handed over as pointers to their memory; and its twin taking each
    array as its address (an int)."""
    ffi = cffi.FFI()
    ffi.cdef(declaration(signature))
    function = getattr(dlopen(ffi, library), signature.name)
    elements = element_types(signature)
    buffer_types = [ffi.typeof(element + "[]") for element in elements]
    n_arrays = len(signature.arrays)
    writable = [a.intent != "in" for a in signature.arrays]
    # a row-layout call's arrays are C-contiguous (KernelCallable checked), which the buffer
    # protocol takes as they are; an F-contiguous array goes through its flat view
    as_buffer = flat_view if signature.layout == "col" else None

    def native_call(*args):
        arrays = [ffi.from_buffer(t, as_buffer(a) if as_buffer else a, w)
                  for t, w, a in zip(buffer_types, writable, args[:n_arrays])]
        return function(*arrays, *args[n_arrays:])

    pointer_types = [ffi.typeof(element + " *") for element in elements]

    def address_call(*args):
        return function(*(ffi.cast(t, a) for t, a in zip(pointer_types, args[:n_arrays])),
                        *args[n_arrays:])

    return native_call, address_call
