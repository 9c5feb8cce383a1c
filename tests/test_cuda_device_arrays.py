"""Device-resident calls of CUDA kernels, through the emulation (whose device memory is host
memory a HostDevice allocated): the real binding's code (moagen.targets.cuda.loader.bind_on) with
the emulation's device. A kernel takes device arrays (anything with
`__cuda_array_interface__`) and runs on them with no copy; numpy arrays are copied in and
out; shapes, dtypes, layouts and pointers are checked before the launch. On a GPU the same
calls run through cuda-python on CUDA torch tensors and cupy arrays (tests/gpu/)."""
import numpy as np
import pytest

from moagen import runtime, verify
from moagen.request import resolve
from moagen.targets.cuda.loader import bind_on
from moagen.targets.cuda.arrays import DeviceArray, device_view, to_device
from moagen.targets.cuda.emulated import HostDevice
from moagen.kernels import get_kernel


class CountingDevice(HostDevice):
    """The emulation's device, counting the copies between host and device and the
    allocations, and recording the waits for other streams' work."""

    def __init__(self):
        super().__init__()
        self.copies_in = self.copies_out = self.allocations = 0
        self.waits = []

    def allocate(self, nbytes):
        self.allocations += 1
        return super().allocate(nbytes)

    def wait_for(self, stream, launch_stream=0):
        self.waits.append((stream, launch_stream))

    def copy_in(self, view, host):
        self.copies_in += 1
        super().copy_in(view, host)

    def copy_out(self, host, view):
        self.copies_out += 1
        super().copy_out(host, view)


class Foreign:
    """Another library's device array (a CUDA tensor, say): an interface and nothing else."""

    def __init__(self, array, **changes):
        self.memory = array  # its owner keeps the memory, as a tensor does
        self.__cuda_array_interface__ = dict(array.__cuda_array_interface__, **changes)


@pytest.fixture
def gpu():
    return CountingDevice()


def _kernel(gpu, kernel, variant, dtype="float64"):
    """The kernel's emulated library bound on `gpu`."""
    loaded = runtime.load(kernel, variant, "cuda-emulated", dtype)
    return bind_on(gpu, runtime.library(resolve(kernel, variant, "cuda-emulated")), loaded.signature,
                   get_kernel(kernel).validate)


def _case(fn, kernel):
    """Inputs and scalars at the kernel's second verification sizes, and its numpy reference."""
    check = get_kernel(kernel).check
    sizes = check.sizes[1]  # odd sizes, none of them 1
    scalars = verify.call_scalars(kernel, sizes)
    inputs = verify.make_inputs(fn.signature, sizes, scalars, check, np.random.default_rng(1))
    return inputs, scalars, check.references["numpy"]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_device_arrays_run_where_they_are_and_numpy_arrays_are_copied(gpu, dtype):
    """attention_decode split: outputs, scratch on the device, and a size given as an argument."""
    fn = _kernel(gpu, "attention_decode", "split", dtype)
    inputs, scalars, reference = _case(fn, "attention_decode")
    expected = reference(*(a.astype(np.float64) for a in inputs), **scalars)

    on_host = fn(*inputs, **scalars)  # numpy in, numpy out
    assert (gpu.copies_in, gpu.copies_out) == (len(inputs), len(on_host))
    assert all(isinstance(o, np.ndarray) for o in on_host)
    for ours, ref in zip(on_host, expected):
        assert verify.normwise_error(ours, ref) <= verify.TOLERANCE[dtype]

    resident = [to_device(gpu, a) for a in inputs]
    gpu.copies_in = gpu.copies_out = 0
    on_device = fn(*resident, **scalars)
    assert (gpu.copies_in, gpu.copies_out) == (0, 0)  # no transfer at all
    assert all(isinstance(o, DeviceArray) and o.device is gpu for o in on_device)
    for ours, host in zip(on_device, on_host):
        np.testing.assert_array_equal(ours.get(), host)


def test_out_takes_the_callers_device_arrays_and_returns_them(gpu):
    fn = _kernel(gpu, "rmsnorm_fwd", "dnf")
    inputs, scalars, _ = _case(fn, "rmsnorm_fwd")
    expected = fn(*inputs, **scalars)
    theirs = [Foreign(DeviceArray(gpu, e.shape, e.dtype)) for e in expected]
    returned = fn(*(Foreign(to_device(gpu, a)) for a in inputs), **scalars, out=tuple(theirs))
    assert all(r is t for r, t in zip(returned, theirs))  # the caller's objects, as given
    for mine, e in zip(theirs, expected):
        np.testing.assert_array_equal(_host(gpu, mine), e)


def test_inout_device_arrays_are_updated_in_place(gpu):
    fn = _kernel(gpu, "kv_append", "dnf")
    inputs, scalars, reference = _case(fn, "kv_append")
    expected = reference(*(a.copy() for a in inputs), **scalars)
    caches = [to_device(gpu, a) for a in inputs]
    assert fn(*caches, **scalars) is None
    for cache, e in zip(caches, expected):
        np.testing.assert_array_equal(cache.get(), e)


def test_a_call_is_queued_on_the_stream_it_names_with_scratch_of_its_own(gpu):
    """Calls on two streams may run at once: each stream has its own scratch (the online
    forward's `probs`), kept for that stream's next call; an array made on another stream is
    waited for first."""
    fn = _kernel(gpu, "attention_fwd", "online")
    inputs, scalars, reference = _case(fn, "attention_fwd")
    on_device = [to_device(gpu, a) for a in inputs]
    expected = fn(*inputs, **scalars)
    allocated = []
    for stream in (0xABC, 0xABC, 0xDEF):
        before = gpu.allocations
        outputs = fn(*on_device, **scalars, stream=stream)
        allocated.append(gpu.allocations - before)
        for ours, e in zip(outputs, expected):
            np.testing.assert_array_equal(ours.get(), e)
    n_outputs = len(fn.signature.outputs)
    assert allocated == [n_outputs + 1, n_outputs, n_outputs + 1]
    del gpu.waits[:]
    made_elsewhere = Foreign(on_device[0], stream=0xABC)
    fn(made_elsewhere, *on_device[1:], **scalars, stream=0xABC)
    fn(made_elsewhere, *on_device[1:], **scalars, stream=0xDEF)
    assert (0xABC, 0xABC) in gpu.waits and (0xABC, 0xDEF) in gpu.waits  # the device decides


def test_bad_streams_are_refused(rmsnorm, gpu):
    fn, (x, weight), scalars = rmsnorm
    with pytest.raises(ValueError, match=r"stream must be a CUDA stream handle \(an int"):
        fn(x, weight, **scalars, stream="default")
    with pytest.raises(ValueError, match="stream= orders work on device arrays; numpy arrays"):
        fn(x.get(), weight.get(), **scalars, stream=0xABC)
    host = runtime.load("rmsnorm_fwd", "dnf", "c")
    with pytest.raises(ValueError, match="stream= is for a kernel that runs on a GPU"):
        host(x.get(), weight.get(), **scalars, stream=0)


def test_output_shapes_are_a_calls_before_it_is_made(gpu):
    fn = _kernel(gpu, "kv_append", "dnf")
    assert fn.output_shapes([(2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 4), (2, 3, 4)], n=1) == ()
    with pytest.raises(ValueError, match="size n must be given"):
        fn.output_shapes([(2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 4), (2, 3, 4)])
    fn = _kernel(gpu, "rmsnorm_fwd", "dnf")
    assert fn.output_shapes([(2, 7, 5), (5,)], eps=0.1) == ((2, 7, 5), (2, 7))
    with pytest.raises(ValueError, match="'weight': expected shape"):
        fn.output_shapes([(2, 7, 5), (4,)])


def _host(gpu, foreign):
    view = device_view(foreign)
    host = np.empty(view.shape, view.dtype)
    gpu.copy_out(host, view)
    return host


@pytest.fixture
def rmsnorm(gpu):
    fn = _kernel(gpu, "rmsnorm_fwd", "dnf")
    inputs, scalars, _ = _case(fn, "rmsnorm_fwd")
    return fn, [to_device(gpu, a) for a in inputs], scalars


@pytest.mark.parametrize("change, message", [
    (dict(typestr="<f4"), r"'x': expected dtype float64, got float32"),
    (dict(typestr=">f8"), r"'x': byte order '>f8' is not the GPU's"),
    (dict(shape=(2, 3)), r"'x': expected 3 dimensions"),
    (dict(strides=(8, 8, 8)), r"'x': expected a C-contiguous array"),
    (dict(mask=object()), r"'x': a masked device array is not supported"),
    (dict(version=9), r"'x': __cuda_array_interface__ version 9"),
    (dict(stream=0), r"'x': __cuda_array_interface__ stream 0 is no stream"),
    (dict(data=(None, False)), r"'x': __cuda_array_interface__ data pointer None"),
    (dict(shape=None), r"'x': malformed __cuda_array_interface__"),
])
def test_bad_device_arrays_are_refused_before_the_launch(rmsnorm, change, message):
    fn, (x, weight), scalars = rmsnorm
    with pytest.raises(ValueError, match=message):
        fn(Foreign(x, **change), weight, **scalars)


def test_a_pointer_that_is_not_device_memory_is_refused(rmsnorm):
    fn, (x, weight), scalars = rmsnorm
    host = np.zeros(x.shape)
    with pytest.raises(ValueError, match=r"'x': its pointer 0x[0-9a-f]+ is not device memory"):
        fn(Foreign(x, data=(host.ctypes.data, False)), weight, **scalars)
    past_the_end = Foreign(x, data=(x.ptr + 8, False))  # its last element lies beyond x
    with pytest.raises(ValueError, match="is not device memory"):
        fn(past_the_end, weight, **scalars)


def test_numpy_and_device_arrays_do_not_mix(rmsnorm):
    fn, (x, weight), scalars = rmsnorm
    with pytest.raises(ValueError, match=r"'x' is a device array but argument 'weight' is a numpy"):
        fn(x, weight.get(), **scalars)
    z = np.empty(x.shape)
    with pytest.raises(ValueError, match=r"a device array but out 'z' is a numpy array"):
        fn(x, weight, **scalars, out=(z, np.empty(x.shape[:-1])))


def test_outputs_that_are_read_only_or_alias_an_input_are_refused(rmsnorm, gpu):
    fn, (x, weight), scalars = rmsnorm
    inv_rms = DeviceArray(gpu, x.shape[:-1], x.dtype)
    z = DeviceArray(gpu, x.shape, x.dtype)
    with pytest.raises(ValueError, match=r"out 'z' is read-only"):
        fn(x, weight, **scalars, out=(Foreign(z, data=(z.ptr, True)), inv_rms))
    with pytest.raises(ValueError, match=r"out 'z' shares memory with another argument"):
        fn(x, weight, **scalars, out=(Foreign(x), inv_rms))


def test_host_kernels_refuse_device_arrays(gpu):
    fn = runtime.load("rmsnorm_fwd", "dnf", "c")
    inputs, scalars, _ = _case(fn, "rmsnorm_fwd")
    with pytest.raises(ValueError, match=r"'x': got a device array \(DeviceArray\), but this "
                                         "kernel runs on the host"):
        fn(to_device(gpu, inputs[0]), inputs[1], **scalars)


def test_the_interface_is_read_as_numpy_reads_its_own():
    """Layout flags from strides (any stride for a dimension of one), alignment, the
    interface a DeviceArray exports."""
    gpu = HostDevice()
    array = DeviceArray(gpu, (3, 1, 4), np.float32, order="F")
    view = device_view(Foreign(array))
    assert view.flags.f_contiguous and not view.flags.c_contiguous and view.flags.aligned
    assert array.__cuda_array_interface__["strides"] == (4, 12, 12)
    squeezed = device_view(Foreign(array, shape=(1, 5), strides=(999, 4)))
    assert squeezed.flags.c_contiguous and squeezed.nbytes == 20
    assert not device_view(Foreign(array, data=(array.ptr + 2, False))).flags.aligned
    assert device_view(np.zeros(3)) is None
    host = np.arange(12.0).reshape(3, 4)
    assert (to_device(gpu, host).get() == host).all()
