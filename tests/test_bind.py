import weakref

import numpy as np
import pytest
import sympy

from moagen import runtime
from moagen.targets.abi import KernelCallable
from moagen.errors import DeviceUnavailable
from moagen.onf.signature import ArrayParam, Signature
from moagen.targets import get_target

M, N = 5, 7


def _inputs(dtype, order="C"):
    rng = np.random.default_rng(0)
    return (np.asarray(rng.standard_normal((M, N)), dtype=dtype, order=order),
            rng.standard_normal(M).astype(dtype))


def _reference(X, s, alpha):
    return X.dtype.type(alpha) * s[:, None] * X


@pytest.fixture(scope="module")
def libraries(scale_rows):
    return {lang: get_target(lang).library(scale_rows.sources[lang], "scale_rows")
            for lang in ("c", "fortran")}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_native_kernel_matches_numpy_exactly(libraries, scale_rows, lang, dtype):
    kernel = get_target(lang).bind(libraries[lang], scale_rows.signature(dtype))
    X, s = _inputs(dtype)
    Y = kernel(X, s, alpha=1.7)
    assert Y.dtype == dtype and Y.flags.c_contiguous
    np.testing.assert_array_equal(Y, _reference(X, s, 1.7))

    out = np.full((M, N), np.nan, dtype)
    assert kernel(s=s, X=X, alpha=-0.5, out=out) is out  # written in place, also by Fortran
    np.testing.assert_array_equal(out, _reference(X, s, -0.5))


def test_a_c_kernel_called_by_address_writes_what_its_array_call_does(libraries, scale_rows):
    """call_at: the caller's memory by address (moagen.torch's tensors), the caller's
    allocator for the outputs; the same numbers as the call on arrays."""
    kernel = get_target("c").bind(libraries["c"], scale_rows.signature("float64"))
    X, s = _inputs("float64")
    made = []

    def allocate(shape):
        made.append(np.full(shape, np.nan))
        return made[-1], made[-1].ctypes.data

    Y = kernel.call_at([(X.ctypes.data, X.shape), (s.ctypes.data, s.shape)], allocate, alpha=1.7)
    assert Y is made[0] and Y.shape == (M, N)
    np.testing.assert_array_equal(Y, kernel(X, s, 1.7))


def test_a_call_by_address_checks_shapes_and_scalars_and_who_may_take_it(libraries, scale_rows):
    c = get_target("c").bind(libraries["c"], scale_rows.signature("float64"))
    X, s = _inputs("float64")
    never = lambda shape: pytest.fail("allocated for a call that is refused")  # noqa: E731
    with pytest.raises(ValueError, match=r"argument 's': expected shape \(m,\) = \(5,\)"):
        c.call_at([(X.ctypes.data, X.shape), (s.ctypes.data, (4,))], never, alpha=1.0)
    with pytest.raises(ValueError, match="scalar 'alpha': expected a finite"):
        c.call_at([(X.ctypes.data, X.shape), (s.ctypes.data, s.shape)], never, alpha=np.inf)
    with pytest.raises(ValueError, match="missing argument"):
        c.call_at([(X.ctypes.data, X.shape), (s.ctypes.data, s.shape)], never)
    # f2py's binding takes numpy arrays only
    fortran = get_target("fortran").bind(libraries["fortran"], scale_rows.signature("float64"))
    assert c.takes_addresses and not fortran.takes_addresses
    with pytest.raises(ValueError, match="not called by address"):
        fortran.call_at([(X.ctypes.data, X.shape), (s.ctypes.data, s.shape)], never, alpha=1.0)


def test_an_in_place_kernel_called_by_address_writes_its_arguments():
    """kv_append writes row n of both caches, given by address as moagen.torch gives
    tensors; an argument written in place may share no memory with another (the kernel's
    pointers are restrict)."""
    kernel = runtime.load("kv_append", "dnf", "c", "float64")
    rng = np.random.default_rng(0)
    K, V = np.zeros((1, 2, 5, 3)), np.zeros((1, 2, 5, 3))
    k, v = rng.standard_normal((1, 2, 3)), rng.standard_normal((1, 2, 3))
    never = lambda shape: pytest.fail("allocated for a kernel with no outputs")  # noqa: E731
    at = lambda *arrays: [(a.ctypes.data, a.shape) for a in arrays]  # noqa: E731
    assert kernel.takes_addresses
    assert kernel.call_at(at(K, V, k, v), never, n=2) is None
    expected_K, expected_V = np.zeros_like(K), np.zeros_like(V)
    expected_K[:, :, 2], expected_V[:, :, 2] = k, v
    np.testing.assert_array_equal(K, expected_K)
    np.testing.assert_array_equal(V, expected_V)
    with pytest.raises(ValueError, match="argument 'K' shares memory with another argument"):
        kernel.call_at(at(K, K, k, v), never, n=3)
    with pytest.raises(ValueError, match="argument 'K' shares memory with another argument"):
        kernel.call_at(at(K, V, K[:, :, 4], v), never, n=3)  # K's row 4 as the new row
    with pytest.raises(ValueError, match="the cache is full"):
        kernel.call_at(at(K, V, k, v), never, n=5)
    np.testing.assert_array_equal(K, expected_K)  # the refused calls wrote nothing


def test_every_kernel_of_a_library_binds_separately(libraries, scale_rows):
    c = get_target("c")
    f64 = c.bind(libraries["c"], scale_rows.signature("float64"))
    f32 = c.bind(libraries["c"], scale_rows.signature("float32"))
    X, s = _inputs("float32")
    np.testing.assert_array_equal(f32(X, s, 2.0), _reference(X, s, 2.0))
    X, s = _inputs("float64")
    np.testing.assert_array_equal(f64(X, s, 2.0), _reference(X, s, 2.0))


def test_cuda_runs_or_skips_cleanly(scale_rows):
    try:
        library = get_target("cuda").library(scale_rows.sources["cuda"], "scale_rows")
    except DeviceUnavailable as error:
        pytest.skip(f"no CUDA device here: {error}")
    kernel = get_target("cuda").bind(library, scale_rows.signature("float64"))
    X, s = _inputs("float64")
    np.testing.assert_allclose(kernel(X, s, alpha=1.7), _reference(X, s, 1.7), rtol=1e-15)


class Stub:
    """A native_call that records its arguments instead of running anything."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_native_call_gets_arrays_sizes_and_scalars_in_abi_order(scale_rows):
    stub = Stub()
    kernel = KernelCallable(scale_rows.signature(), stub)
    X, s = _inputs("float64")
    Y = kernel(X, s, 3)
    (args,) = stub.calls
    assert args[0] is X and args[1] is s and args[2] is Y
    assert args[3:] == (M, N, 3.0)
    assert [type(a) for a in args[3:]] == [int, int, float]
    assert Y.shape == (M, N) and Y.dtype == np.float64 and Y.flags.c_contiguous
    assert kernel.signature == scale_rows.signature()


def test_col_layout_takes_and_allocates_fortran_order(scale_rows):
    stub = Stub()
    kernel = KernelCallable(scale_rows.signature(layout="col"), stub)
    X, s = _inputs("float64", order="F")
    assert kernel(X, s, alpha=1.0).flags.f_contiguous
    with pytest.raises(ValueError, match="F-contiguous"):
        kernel(np.ascontiguousarray(X), s, alpha=1.0)


def _bad_calls():
    """(what the message must say, the call) for every call that must fail before native code."""
    X, s = _inputs("float64")
    Y = np.zeros((M, N))
    read_only = Y.copy()
    read_only.flags.writeable = False
    return [
        (r"'X'.*numpy array of shape \(m, n\), got list", lambda k: k(X.tolist(), s, alpha=1.0)),
        (r"'s'.*1 dimensions \(m,\), got shape \(5, 1\)", lambda k: k(X, s[:, None], alpha=1.0)),
        (r"'X'.*dtype float64, got float32", lambda k: k(X.astype(np.float32), s, alpha=1.0)),
        (r"'X'.*dtype float64, got int64", lambda k: k(X.astype(np.int64), s, alpha=1.0)),
        (r"'X'.*C-contiguous", lambda k: k(np.asfortranarray(X), s, alpha=1.0)),
        (r"'X'.*C-contiguous", lambda k: k(np.empty((M, 2 * N))[:, ::2], s, alpha=1.0)),
        (r"'s'.*expected shape \(m,\) = \(5,\), got \(4,\)", lambda k: k(X, s[:4], alpha=1.0)),
        (r"size m must be >= 1, got 0", lambda k: k(X[:0], s[:0], alpha=1.0)),
        (r"size n must be >= 1, got 0", lambda k: k(X[:, :0].copy(), s, alpha=1.0)),
        (r"missing argument\(s\) alpha", lambda k: k(X, s)),
        (r"missing argument\(s\) s", lambda k: k(X, alpha=1.0)),
        (r"unexpected argument 'beta'", lambda k: k(X, s, alpha=1.0, beta=2.0)),
        (r"takes 3 arguments", lambda k: k(X, s, 1.0, 2.0)),
        (r"'alpha' given twice", lambda k: k(X, s, 1.0, alpha=1.0)),
        (r"'alpha'.*finite", lambda k: k(X, s, alpha=np.nan)),
        (r"'alpha'.*finite", lambda k: k(X, s, alpha=-np.inf)),
        (r"'alpha'.*real number, got str", lambda k: k(X, s, alpha="1.0")),
        (r"'alpha'.*real number, got bool", lambda k: k(X, s, alpha=True)),
        (r"out 'Y'.*expected shape \(m, n\) = \(5, 7\), got \(7, 5\)", lambda k: k(X, s, alpha=1.0, out=Y.T.copy())),
        (r"out 'Y'.*dtype float64, got float32", lambda k: k(X, s, alpha=1.0, out=Y.astype(np.float32))),
        (r"out 'Y'.*C-contiguous", lambda k: k(X, s, alpha=1.0, out=np.asfortranarray(Y))),
        (r"out 'Y'.*numpy array", lambda k: k(X, s, alpha=1.0, out=(Y,))),
        (r"out 'Y' is read-only", lambda k: k(X, s, alpha=1.0, out=read_only)),
        (r"out 'Y' shares memory", lambda k: k(X, s, alpha=1.0, out=X)),
        (r"rejected by validate", lambda k: k(X, s, alpha=-1.0)),
    ]


@pytest.mark.parametrize("message, call", _bad_calls(), ids=[m for m, _ in _bad_calls()])
def test_bad_call_raises_before_native_code(scale_rows, message, call):
    def validate(sizes, scalars):
        assert sizes == {"m": M, "n": N}
        if scalars["alpha"] < 0:
            raise ValueError("alpha rejected by validate")

    stub = Stub()
    with pytest.raises(ValueError, match=message):
        call(KernelCallable(scale_rows.signature(), stub, validate))
    assert stub.calls == []


def test_float32_scalar_must_be_finite_as_float32(scale_rows):
    stub = Stub()
    X, s = _inputs("float32")
    with pytest.raises(ValueError, match="finite float32"):
        KernelCallable(scale_rows.signature("float32"), stub)(X, s, alpha=1e300)
    assert stub.calls == []


def _two_outputs():
    n = sympy.Symbol("n")
    return Signature("split_f64", (ArrayParam("a", (n, 2), "in"), ArrayParam("lo", (n,), "out"),
                                   ArrayParam("hi", (n,), "out")), (n,), (), "float64")


def test_several_outputs_come_back_as_a_tuple():
    stub = Stub()
    kernel = KernelCallable(_two_outputs(), stub)
    a = np.ones((3, 2))
    lo, hi = kernel(a)
    assert lo.shape == hi.shape == (3,)
    out = (np.empty(3), np.empty(3))
    result = kernel(a=a, out=out)
    assert result[0] is out[0] and result[1] is out[1]


def test_several_outputs_are_checked():
    stub = Stub()
    kernel = KernelCallable(_two_outputs(), stub)
    a, both = np.ones((3, 2)), np.empty(6)
    with pytest.raises(ValueError, match="out must be a tuple of 2 arrays"):
        kernel(a, out=np.empty(3))
    with pytest.raises(ValueError, match="out 'hi' shares memory"):
        kernel(a, out=(both[:3], both[2:5]))
    assert stub.calls == []


def test_a_size_no_input_determines_is_an_integer_argument():
    n = sympy.Symbol("n")
    signature = Signature("double_f64", (ArrayParam("a", (2 * n,), "in"), ArrayParam("b", (n,), "out")),
                          (n,), (), "float64")
    stub = Stub()
    kernel = KernelCallable(signature, stub)
    with pytest.raises(ValueError, match="missing argument.*n"):
        kernel(np.ones(6))
    for bad, message in ((2.0, "must be an integer"), (True, "must be an integer"), (-1, ">= 0")):
        with pytest.raises(ValueError, match=message):
            kernel(np.ones(6), n=bad)
    with pytest.raises(ValueError, match=r"expected shape \(2\*n,\) = \(8,\)"):
        kernel(np.ones(6), n=4)
    assert stub.calls == []
    kernel(np.ones(6), n=3)
    assert len(stub.calls) == 1


def _with_scratch():
    n = sympy.Symbol("n")
    return Signature("work_f64", (ArrayParam("a", (n,), "in"), ArrayParam("b", (n,), "out"),
                                  ArrayParam("t", (n, n), "scratch")),
                     (n,), (), "float64")


def test_host_scratch_comes_from_the_threads_arena(monkeypatch):
    """Fresh memory costs page faults on every call: a thread's calls carve their scratch
    from one block every host kernel on the thread shares (the same arrays again for the
    same shapes), grown for a larger call; another thread has its own block; a call over
    the limit gets memory of its own and leaves the block as it was."""
    import threading
    import moagen.targets.abi as abi
    monkeypatch.setattr(abi, "_ARENA", threading.local())
    stub = Stub()
    kernel = KernelCallable(_with_scratch(), stub)
    kernel(np.ones(4))
    kernel(np.ones(4))
    first, second = (args[2] for args in stub.calls)
    assert first is second and first.shape == (4, 4) and first.flags.c_contiguous
    assert first.ctypes.data % abi.SCRATCH_ALIGNMENT == 0
    other = threading.Thread(target=kernel, args=(np.ones(4),))
    other.start()
    other.join()
    assert not np.shares_memory(stub.calls[2][2], first)
    another = Stub()
    KernelCallable(_with_scratch(), another)(np.ones(3))  # another kernel, the same block
    assert another.calls[0][2].shape == (3, 3) and np.shares_memory(another.calls[0][2], first)
    kernel(np.ones(5))
    grown = stub.calls[3][2]
    assert grown.shape == (5, 5) and not np.shares_memory(grown, first)
    monkeypatch.setattr(abi, "KEEP_HOST_SCRATCH", 8 * 25 + abi.SCRATCH_ALIGNMENT)
    kernel(np.ones(9))
    kernel(np.ones(9))
    assert not np.shares_memory(stub.calls[4][2], stub.calls[5][2])  # each call its own
    kernel(np.ones(5))
    assert stub.calls[6][2] is grown  # the block as it was


def test_a_column_major_kernels_scratch_is_column_major(monkeypatch):
    """Fortran's kernels index their scratch in column order: the arena's arrays for them
    are F-contiguous, and a row-major kernel's of the same shapes are not the same arrays."""
    import dataclasses
    import threading
    import moagen.targets.abi as abi
    monkeypatch.setattr(abi, "_ARENA", threading.local())
    col, row = Stub(), Stub()
    KernelCallable(dataclasses.replace(_with_scratch(), layout="col"), col)(np.ones(4))
    KernelCallable(_with_scratch(), row)(np.ones(4))
    (f_scratch, c_scratch) = col.calls[0][2], row.calls[0][2]
    assert f_scratch.flags.f_contiguous and not f_scratch.flags.c_contiguous
    assert c_scratch.flags.c_contiguous and c_scratch is not f_scratch


def test_a_call_by_address_holds_the_scratch_it_does_not_keep(monkeypatch):
    """Scratch over KEEP_HOST_SCRATCH is not kept between calls: a call by address, which
    hands the kernel addresses only, must hold the memory until the kernel returns."""
    import threading
    import moagen.targets.abi as abi
    monkeypatch.setattr(abi, "_ARENA", threading.local())
    monkeypatch.setattr(abi, "KEEP_HOST_SCRATCH", 0)
    made, seen = [], []
    kernel = KernelCallable(_with_scratch(), Stub(),
                            address_call=lambda *args: seen.append([r() for r in made]))
    new_buffer = abi._new_buffer
    monkeypatch.setattr(abi, "_new_buffer", lambda n: _remember(made, new_buffer(n)))
    a = np.ones(4)
    b = kernel.call_at([(a.ctypes.data, a.shape)], lambda shape: (np.empty(shape), 0))
    (alive,) = seen
    assert b.shape == (4,) and len(alive) == 1 and alive[0] is not None
    assert alive[0].nbytes >= 4 * 4 * 8


def _remember(made, array):
    made.append(weakref.ref(array))
    return array
