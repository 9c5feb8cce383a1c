"""CUDA kernels on a GPU through cuda-python, called with CUDA torch tensors and cupy arrays
(used where they are: no copy between host and device) and with numpy arrays (copied);
bench/gpu.sh runs this on the GPU machine. Where there is no GPU every test skips: the
same binding code runs on every machine through the emulation
(tests/test_cuda_device_arrays.py)."""
import numpy as np
import pytest

from moagen import runtime, verify
from moagen.targets.cuda import loader as cuda
from moagen.kernels import get_kernel

pytestmark = pytest.mark.skipif(not cuda.available(), reason="no GPU (or no cuda-python) here")


@pytest.fixture
def counted(monkeypatch):
    """The driver's device, counting its host-device copies."""
    gpu = cuda.device()
    copies = {"in": 0, "out": 0}
    for way, method in (("in", "copy_in"), ("out", "copy_out")):
        original = getattr(gpu, method)
        monkeypatch.setattr(gpu, method, lambda *args, _o=original, _w=way:
                            copies.__setitem__(_w, copies[_w] + 1) or _o(*args))
    return copies


def _case(kernel, variant, dtype="float64"):
    fn = runtime.load(kernel, variant, "cuda", dtype, tuned=False)
    check = get_kernel(kernel).check
    sizes = check.sizes[-1]
    scalars = verify.call_scalars(kernel, sizes)
    inputs = verify.make_inputs(fn.signature, sizes, scalars, check, np.random.default_rng(2))
    expected = check.references["numpy"](*(a.astype(np.float64) for a in inputs), **scalars)
    return fn, inputs, scalars, expected if isinstance(expected, tuple) else (expected,)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_cuda_tensors_run_where_they_are(counted, dtype):
    torch = pytest.importorskip("torch")
    fn, inputs, scalars, expected = _case("attention_fwd", "online", dtype)
    tensors = [torch.from_numpy(a).cuda() for a in inputs]
    outputs = fn(*tensors, **scalars)
    assert counted == {"in": 0, "out": 0}
    for out, ref in zip(outputs, expected):
        ours = torch.as_tensor(out, device="cuda").cpu().numpy()  # no copy until .cpu()
        assert verify.normwise_error(ours, ref) <= verify.TOLERANCE[dtype]
    theirs = tuple(torch.empty(o.shape, dtype=getattr(torch, dtype), device="cuda") for o in outputs)
    assert all(a is b for a, b in zip(fn(*tensors, **scalars, out=theirs), theirs))
    for mine, out in zip(theirs, outputs):
        assert torch.equal(mine, torch.as_tensor(out, device="cuda"))


def test_cupy_arrays_and_numpy_arrays_agree(counted):
    cupy = pytest.importorskip("cupy")
    fn, inputs, scalars, expected = _case("attention_decode", "split")
    on_host = fn(*inputs, **scalars)
    assert counted == {"in": len(inputs), "out": len(on_host)}
    on_device = fn(*(cupy.asarray(a) for a in inputs), **scalars)
    for host, device in zip(on_host, on_device):
        np.testing.assert_array_equal(cupy.asnumpy(cupy.asarray(device)), host)


def test_a_tensor_made_on_another_stream_is_waited_for():
    torch = pytest.importorskip("torch")
    fn, inputs, scalars, expected = _case("rmsnorm_fwd", "dnf")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # queued there, maybe unfinished when the kernel starts
        tensors = [torch.from_numpy(a).cuda(non_blocking=True) * 1.0 for a in inputs]
        z, inv_rms = fn(*tensors, **scalars)
    np.testing.assert_allclose(z.get(), expected[0], rtol=1e-12, atol=1e-12)


def test_host_memory_and_another_shape_are_refused_before_the_launch():
    torch = pytest.importorskip("torch")
    fn, inputs, scalars, _ = _case("rmsnorm_fwd", "dnf")
    x, weight = (torch.from_numpy(a).cuda() for a in inputs)

    class HostPointer:
        __cuda_array_interface__ = dict(x.__cuda_array_interface__,
                                        data=(inputs[0].ctypes.data, False))

    with pytest.raises(ValueError, match="is not CUDA device memory"):
        fn(HostPointer(), weight, **scalars)
    with pytest.raises(ValueError, match="expected a C-contiguous array"):
        fn(x.transpose(0, 1), weight, **scalars)
    with pytest.raises(ValueError, match="expected dtype float64"):
        fn(x.float(), weight, **scalars)


def test_the_device_clock_times_a_kernel():
    torch = pytest.importorskip("torch")
    fn, inputs, scalars, _ = _case("attention_fwd", "online")
    tensors = [torch.from_numpy(a).cuda() for a in inputs]
    seconds = cuda.device().elapsed(lambda: fn(*tensors, **scalars))
    assert 0 < seconds < 10
