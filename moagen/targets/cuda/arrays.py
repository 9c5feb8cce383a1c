"""Arrays in GPU memory, as the CUDA bindings see them.

Any object with `__cuda_array_interface__` (a CUDA torch tensor, a cupy array, a
DeviceArray) is read as a DeviceView: its pointer, shape, dtype and layout, which
KernelCallable checks as it checks a numpy array's before the pointer reaches a launcher.
A DeviceArray is the memory a binding allocates itself (outputs, scratch); it exports the
same interface, so torch.as_tensor(array, device="cuda") or cupy.asarray(array) use it
without a copy, and get() copies it to a numpy array.

A device (moagen.targets.cuda.driver.Driver on a GPU, moagen.targets.cuda.emulated.HostDevice in
the emulation) allocates, copies and checks pointers; these classes only describe memory.

The kinds of device array a call's outputs come back as are known here and only here
(KINDS): a call whose device arrays are all of one kind gets its new outputs allocated as
that kind (a pycuda GPUArray's outputs are GPUArrays), every other call DeviceArrays. A
kind is recognised by the module and name of its type, so its library is imported only
once one of its arrays has been passed.
"""
import math
from dataclasses import dataclass

import numpy as np

# the interface's version this module writes; it reads 0 to 3
INTERFACE_VERSION = 3
# the stream numbers of the interface (version 3) that name CUDA's default streams
LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM = 1, 2


@dataclass(frozen=True)
class Flags:
    """The part of numpy's flags the checks read."""
    c_contiguous: bool
    f_contiguous: bool
    aligned: bool
    writeable: bool


class DeviceView:
    """A device array's pointer and layout. obj: the object it describes (returned to the
    caller as given), None for itself; stream: the stream its producer's work is queued on,
    None when the producer says nothing is pending."""

    def __init__(self, obj, ptr, shape, dtype, strides, readonly, stream=None):
        self._obj, self.ptr, self.shape, self.dtype = obj, ptr, tuple(shape), np.dtype(dtype)
        self.strides = tuple(strides)
        self.stream = stream
        self.ndim, self.size = len(self.shape), math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        itemsize = self.dtype.itemsize
        self.flags = Flags(_same_layout(self.shape, self.strides, _strides(self.shape, itemsize, "C")),
                           _same_layout(self.shape, self.strides, _strides(self.shape, itemsize, "F")),
                           ptr % itemsize == 0, not readonly)

    @property
    def obj(self):
        # not stored for itself: a reference cycle would keep GPU memory until the
        # garbage collector's next pass
        return self if self._obj is None else self._obj

    def overlaps(self, other) -> bool:
        """Whether the two spans of memory meet (exact for contiguous arrays)."""
        if not self.nbytes or not other.nbytes:
            return False
        return self.ptr < other.ptr + other.nbytes and other.ptr < self.ptr + self.nbytes

    def __repr__(self):
        return f"<{type(self).__name__} {self.dtype} {self.shape} at {self.ptr:#x}>"


def device_view(obj, what="array"):
    """obj's `__cuda_array_interface__` as a DeviceView, or None when it has none; a
    malformed or unsupported interface is a ValueError naming `what`."""
    if isinstance(obj, DeviceView):
        return obj
    try:
        interface = obj.__cuda_array_interface__
    except AttributeError:
        return None
    try:
        shape = tuple(interface["shape"])
        typestr, (ptr, readonly) = interface["typestr"], interface["data"]
        strides, version = interface.get("strides"), interface.get("version", 0)
        mask, stream = interface.get("mask"), interface.get("stream")
    except (TypeError, KeyError, ValueError) as error:
        raise ValueError(f"{what}: malformed __cuda_array_interface__ ({error!r}): it needs "
                         "shape, typestr and data=(pointer, read-only)") from error
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{what}: __cuda_array_interface__ shape {shape} is not a tuple of sizes")
    if not isinstance(ptr, int) or ptr < 0:
        raise ValueError(f"{what}: __cuda_array_interface__ data pointer {ptr!r} is not an address")
    if not isinstance(version, int) or version > INTERFACE_VERSION:
        raise ValueError(f"{what}: __cuda_array_interface__ version {version!r}; moagen reads "
                         f"versions 0 to {INTERFACE_VERSION}")
    if mask is not None:
        raise ValueError(f"{what}: a masked device array is not supported")
    if stream == 0 or not (stream is None or isinstance(stream, int)):
        raise ValueError(f"{what}: __cuda_array_interface__ stream {stream!r} is no stream "
                         "(0 is disallowed by the interface; None, 1, 2 or a handle)")
    try:
        dtype = np.dtype(typestr)
    except TypeError as error:
        raise ValueError(f"{what}: unknown __cuda_array_interface__ typestr {typestr!r}") from error
    if not dtype.isnative:
        raise ValueError(f"{what}: byte order {typestr!r} is not the GPU's")
    if strides is None:
        strides = _strides(shape, dtype.itemsize, "C")
    elif len(strides) != len(shape) or not all(isinstance(s, int) for s in strides):
        raise ValueError(f"{what}: __cuda_array_interface__ strides {strides!r} do not match "
                         f"shape {shape}")
    return DeviceView(obj, ptr, shape, dtype, strides, bool(readonly), stream)


class DeviceArray(DeviceView):
    """Memory a device allocated for `shape` and `dtype`, freed when the last reference to
    this goes. order: "C" or "F", as the kernel's layout."""

    def __init__(self, device, shape, dtype, order="C"):
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        ptr, self._allocation = device.allocate(nbytes)
        super().__init__(None, ptr, shape, dtype, _strides(tuple(shape), dtype.itemsize, order),
                         readonly=False)
        self.device = device

    @property
    def __cuda_array_interface__(self):
        strides = None if self.flags.c_contiguous else self.strides
        return dict(shape=self.shape, typestr=self.dtype.str, data=(self.ptr, False),
                    strides=strides, version=INTERFACE_VERSION, stream=None)

    def get(self) -> np.ndarray:
        """A numpy copy, in the same layout."""
        host = np.empty(self.shape, self.dtype, order="C" if self.flags.c_contiguous else "F")
        self.device.copy_out(host, self)
        return host


@dataclass(frozen=True)
class ArrayKind:
    """One library's device arrays. module, type_name: where their type (or a base of it) is
    defined; empty(shape, dtype, order): a new array of that kind, in the memory the library
    allocates (the caller checks that it is the kernels' device's)."""
    name: str
    module: str
    type_name: str
    empty: object

    def matches(self, cls) -> bool:
        return any(c.__name__ == self.type_name and c.__module__ == self.module
                   for c in cls.__mro__)


def _pycuda_empty(shape, dtype, order):
    # a GPUArray was passed, so pycuda is imported already; it allocates in its current
    # context, which must be the kernels' (the primary: pycuda.autoprimaryctx)
    from pycuda import gpuarray
    return gpuarray.empty(shape, dtype, order=order)


KINDS = (ArrayKind("pycuda", "pycuda.gpuarray", "GPUArray", _pycuda_empty),)
_KIND_OF_TYPE = {}  # type -> its ArrayKind or None, as first looked up


def array_kind(views):
    """The ArrayKind all these DeviceViews' objects are of, or None (none, mixed kinds, or
    objects no kind knows: DeviceArrays come back)."""
    kinds = set()
    for view in views:
        cls = type(view.obj)
        try:
            kind = _KIND_OF_TYPE[cls]
        except KeyError:
            kind = _KIND_OF_TYPE[cls] = next((k for k in KINDS if k.matches(cls)), None)
        kinds.add(kind)
    return kinds.pop() if len(kinds) == 1 else None


def to_device(device, host) -> DeviceArray:
    """A contiguous numpy array's copy on the device."""
    array = DeviceArray(device, host.shape, host.dtype, "C" if host.flags.c_contiguous else "F")
    device.copy_in(array, host)
    return array


def _strides(shape, itemsize, order):
    """The byte strides of a contiguous array in `order` ("C": last axis fastest)."""
    axes = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
    strides, step = [0] * len(shape), itemsize
    for axis in axes:
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides)


def _same_layout(shape, strides, contiguous):
    """Whether `strides` lay the array out as `contiguous` does; a dimension of one element
    may have any stride (numpy's rule)."""
    return math.prod(shape) == 0 or all(n == 1 or s == c for n, s, c in zip(shape, strides, contiguous))
