"""Calling moagen's kernels on torch tensors: the checks a PyTorch user expects (device,
dtype, shapes, by the names of the torch-level arguments), then the kernel on the tensors'
memory (no copy of a contiguous tensor; a tensor the kernel writes in place must be
contiguous).

On CPU tensors `lang` picks the kernels' language. A C kernel takes the tensors' addresses
and writes new tensors, or the ones it updates in place (KernelCallable.call_at); a Fortran
kernel, whose f2py binding takes numpy arrays, takes numpy views of them, its outputs handed
back as tensors over the arrays it wrote (no copy either). Both check the shapes against the
kernel's signature; a model makes many small calls, and the first way costs each less
Python (docs/PERFORMANCE.md, "moagen.torch's calls").

On CUDA tensors the kernel is the CUDA one, whatever `lang` names: it takes the tensors as
device arrays (moagen.targets.cuda.loader), its outputs are tensors from PyTorch's allocator, and it
is queued on PyTorch's current stream, as a PyTorch operator is, so that the caching
allocator's reuse of the memory and the next operation are ordered after it. Nothing is
copied between host and device.

The checks run in the operators' fake implementations too, so that torch.compile reports
a bad call while it traces, not later in native code."""
import math
from functools import lru_cache

import numpy as np
import torch

import moagen

LANGS = ("c", "fortran")  # the CPU kernels' languages
DTYPES = {torch.float64: "float64", torch.float32: "float32"}
# the torch dtype of an integer or bool input's element type (moagen.moa.expr.ELEMENTS)
ELEMENTS = {"int64": torch.int64, "bool": torch.bool}


def check_lang(op, lang):
    if lang not in LANGS:
        cuda = (": CUDA tensors run moagen's CUDA kernels whatever lang names; lang picks the "
                "CPU kernels' language" if lang == "cuda" else "")
        raise ValueError(f"{op}: lang must be one of {', '.join(map(repr, LANGS))}, got "
                         f"{lang!r}{cuda}")


def check_tensors(op, **tensors):
    """Every tensor float32 or float64, all of one dtype, and on one device, the CPU or a
    CUDA GPU, or all on meta (shapes only: the fake implementations run); returns the dtype's
    name. A meta tensor among real ones is refused: the kernels would read memory it does
    not have."""
    dtypes, devices = {}, {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.is_cpu or t.is_cuda or t.is_meta):  # meta: shape-only tracing
            raise ValueError(f"{op}: {name} is on {t.device}; moagen's kernels run on CPU "
                             "and CUDA tensors")
        if t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; moagen's kernels take "
                             "torch.float32 or torch.float64 (no implicit casting)")
        dtypes[name], devices[name] = t.dtype, t.device
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n}: {d}" for n, d in dtypes.items())
        raise ValueError(f"{op}: the tensors must share one dtype, got {listed}")
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n}: {d}" for n, d in devices.items())
        raise ValueError(f"{op}: the tensors must be on one device, got {listed}")
    return DTYPES[next(iter(dtypes.values()))]


def check_dims(op, name, t, ndim, meaning):
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimensions {meaning}, got shape "
                         f"{tuple(t.shape)}")


def check_size(op, what, got, expected):
    if got != expected:
        raise ValueError(f"{op}: {what} must be {expected}, got {got}")


def int_list(op, name, values, count=None, held="ints") -> list:
    """A 1-D integer tensor's or a sequence's values as a list of ints; ValueError unless
    they are ints (`count` of them where given), saying that `name` must hold `held`."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or \
                values.dtype == torch.bool or values.dim() != 1:
            raise ValueError(f"{op}: {name} must be a 1-D integer tensor or a sequence of ints, "
                             f"got a tensor of dtype {values.dtype} and shape "
                             f"{tuple(values.shape)}")
        values = values.tolist()
    values = list(values)
    if count is not None and len(values) != count or \
            not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        raise ValueError(f"{op}: {name} must hold {held}, got {values!r}")
    return values


@lru_cache(maxsize=None)
def kernel(name, variant, lang, dtype, params=()):
    """A loaded kernel, once per process (moagen.load builds and binds); params: schedule
    parameters as (name, value) pairs, () for the defaults (or this machine's tuning)."""
    return moagen.load(name, variant, lang=lang, dtype=dtype, params=dict(params) or None)


def _address(kernel_name, t, dtype):
    """The address of a contiguous tensor's values, after what makes it mean what the
    kernel reads: CPU memory, the kernel's dtype, aligned to it."""
    if not t.is_cpu or t.dtype != dtype:
        raise ValueError(f"{kernel_name}: expected a CPU tensor of {dtype}, got one of "
                         f"{t.dtype} on {t.device}")
    address = t.data_ptr()
    if address % t.element_size():
        raise ValueError(f"{kernel_name}: a tensor's data at {address:#x} is not aligned to "
                         f"its dtype {t.dtype}; pass a copy (.clone())")
    return address


def _allocator(dtype, shapes=None):
    """call_at's allocate: a new tensor per output, of its shape in shapes where given (None
    or absent: the kernel's). The memory is numpy's, wrapped without a copy: torch.empty's
    argument parsing costs twice as much a call."""
    finals = iter(shapes or ())
    numpy_dtype = DTYPES[dtype]

    def allocate(shape):
        final = next(finals, None)
        if final is not None:
            if math.prod(final) != math.prod(shape):
                raise ValueError(f"an output of shape {tuple(shape)} cannot be seen as {final}")
            shape = final
        t = torch.from_numpy(np.empty(shape, numpy_dtype))
        return t, t.data_ptr()

    return allocate


_ALLOCATE = {dtype: _allocator(dtype) for dtype in DTYPES}


def _seen(kernel_name, array):
    """(tensor, shape) for an argument of call: a tensor as it is, or a pair as given after
    checking that the shape holds as many values."""
    if not isinstance(array, tuple):
        return array, array.shape
    t, shape = array
    if math.prod(shape) != t.numel():
        raise ValueError(f"{kernel_name}: a tensor of shape {tuple(t.shape)} cannot be seen as "
                         f"{tuple(shape)}")
    return t, shape


def call(name, variant, lang, *arrays, params=(), out_shapes=None, **scalars):
    """The kernel on the arrays: tensors of one float dtype on one device (the torch-level
    checks are the caller's), or (tensor, shape) pairs, a tensor's values seen in order under
    another shape (the kernel's, as a reshape would see them, without making one). Its
    outputs as tensors (a tuple when it has several), each of its shape in out_shapes where
    given (None: the kernel's). params: as kernel's, for the CPU kernels (a CUDA kernel runs
    at its target's defaults)."""
    seen = [_seen(name, a) for a in arrays]
    dtype = seen[0][0].dtype
    if seen[0][0].is_cuda:
        return _call_cuda(name, variant, seen, out_shapes, scalars)
    fn = kernel(name, variant, lang, DTYPES[dtype], tuple(sorted(params)))
    _check_in_place(name, fn, seen)
    # the contiguous tensors are held until the kernel returns: a copy made here would
    # otherwise be freed while the kernel reads it
    held = [(t.contiguous(), shape) for t, shape in seen]
    if fn.takes_addresses:
        allocate = _ALLOCATE[dtype] if out_shapes is None else _allocator(dtype, out_shapes)
        # an integer input (offsets) of its own dtype, the others of the kernel's
        return fn.call_at([(_address(name, t, ELEMENTS[e] if e else dtype), shape)
                           for (t, shape), e in zip(held, fn.input_elements)],
                          allocate, **scalars)
    result = fn(*(t.detach().numpy().reshape(shape) for t, shape in held), **scalars)
    if result is None:
        return None
    return _results(result if isinstance(result, tuple) else (result,), out_shapes,
                    lambda a, shape: torch.from_numpy(a if shape is None else a.reshape(shape)))


def _call_cuda(name, variant, seen, out_shapes, scalars):
    """call's work on CUDA tensors (see the module's docstring)."""
    first = seen[0][0]
    fn = kernel(name, variant, "cuda", DTYPES[first.dtype])
    _check_in_place(name, fn, seen)
    # detached: a tensor that requires grad does not export __cuda_array_interface__
    held = [t.detach().contiguous().view(shape) for t, shape in seen]
    outputs = tuple(torch.empty(shape, dtype=first.dtype, device=first.device)
                    for shape in fn.output_shapes([t.shape for t in held], **scalars))
    fn(*held, **scalars, out=outputs[0] if len(outputs) == 1 else outputs or None,
       stream=torch.cuda.current_stream(first.device).cuda_stream)
    if not outputs:
        return None
    return _results(outputs, out_shapes, lambda t, shape: t if shape is None else t.view(shape))


def _results(outputs, out_shapes, as_tensor):
    """The kernel's outputs as call returns them: as_tensor(output, shape) each, shape its
    entry in out_shapes (None where out_shapes gives none); one, or a tuple."""
    shapes = list(out_shapes or ()) + [None] * len(outputs)
    tensors = tuple(as_tensor(a, shape) for a, shape in zip(outputs, shapes))
    return tensors[0] if len(tensors) == 1 else tensors


def _check_in_place(name, fn, seen):
    for k in fn.inout:  # written in place: a contiguous copy would take the writes
        if not seen[k][0].is_contiguous():
            raise ValueError(f"{name}: {fn.signature.inputs[k].name} is written in place and "
                             f"must be contiguous, got strides {seen[k][0].stride()}")


def causal_name(kernel: str, causal: bool) -> str:
    """The kernel's causal twin's name where causal (attention_fwd -> attention_fwd_causal)."""
    return kernel + "_causal" if causal else kernel
