"""Decode against a KV cache, grouped-query attention, split over keys, and appending to
the cache in place: values, the rewrites' equivalence, and the errors a caller meets."""
import numpy as np
import pytest

from moagen import reference, runtime
from moagen.pipeline import onf_of
from moagen.kernels import get_kernel
from moagen.moa.dnf import psi_reduce
from moagen.onf.interpret import run_onf
from moagen.onf.realize import initial_onf

RNG = np.random.default_rng(5)


def _decode_inputs(batch=2, q_heads=6, kv_heads=2, cap=13, d=5):
    return (RNG.standard_normal((batch, q_heads, d)), RNG.standard_normal((batch, kv_heads, cap, d)),
            RNG.standard_normal((batch, kv_heads, cap, d)))


@pytest.mark.parametrize("variant", ["dnf", "online", "split", "grouped"])
@pytest.mark.parametrize("n", [1, 3, 9])  # fewer valid rows than slices, and a full cache
def test_every_rewrite_of_decode_keeps_the_value(variant, n):
    """Each schedule step (OnlineSoftmax, SplitKeys included), run by the interpreter; the
    literal DNF recomputes the max inside the sum, so the sizes stay tiny."""
    q, K, V = _decode_inputs(batch=1, q_heads=4, kv_heads=2, cap=9, d=3)
    # w: grouped's keys a warp, in 32s (the other variants take none); w > 1 is run by
    # test_decode_gpu on the emulated kernel
    arrays, scalars = {"q": q, "K": K, "V": V}, {"scale": 0.4, "n": n, "w": 1}
    kernel = get_kernel("attention_decode")
    onf = initial_onf(psi_reduce(kernel.spec), variant)
    want = reference.attention_decode_numpy(q, K, V, 0.4, n)
    for step in kernel.variant(variant).steps() + (None,):
        got = run_onf(onf if step else onf_of("attention_decode", variant), arrays, scalars)
        np.testing.assert_allclose(got["O"], want[0], rtol=1e-12, atol=1e-13, err_msg=str(step))
        np.testing.assert_allclose(got["lse"], want[1], rtol=1e-12, err_msg=str(step))
        if step:
            onf = step(onf)


def test_split_decode_keeps_only_per_slice_state():
    onf = onf_of("attention_decode", "split")
    temps = {b.name: b.shape for b in onf.temps}
    assert set(temps) == {"row_max_part", "row_sum_part", "O_part"}
    assert not any(str(dim) == "n" or str(dim) == "cap" for shape in temps.values() for dim in shape)
    partial = next(n for n in onf.nests if n.label == "heads.partial")
    assert partial.body[0].parallel == 3  # batch, head and slice in parallel


@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_decode_refuses_sizes_it_cannot_honour(lang):
    decode = runtime.load("attention_decode", "split", lang)
    q, K, V = _decode_inputs(q_heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="kv_heads = 4 does not divide q_heads = 6"):
        decode(q, K, V, scale=0.5, n=3)
    q, K, V = _decode_inputs()
    with pytest.raises(ValueError, match="n = 14 valid rows exceed the cache's capacity of 13"):
        decode(q, K, V, scale=0.5, n=14)
    with pytest.raises(ValueError, match="at least 1"):
        decode(q, K, V, scale=0.5, n=0)


@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_kv_append_writes_row_n_only_and_never_past_the_cache(lang):
    append = runtime.load("kv_append", "dnf", lang)
    K, V = RNG.standard_normal((2, 3, 7, 5)), RNG.standard_normal((2, 3, 7, 5))
    k_new, v_new = RNG.standard_normal((2, 3, 5)), RNG.standard_normal((2, 3, 5))
    before = K.copy(), V.copy()
    assert append(K, V, k_new, v_new, n=4) is None
    for cache, old, row in ((K, before[0], k_new), (V, before[1], v_new)):
        np.testing.assert_array_equal(cache[:, :, 4], row)
        np.testing.assert_array_equal(np.delete(cache, 4, axis=2), np.delete(old, 4, axis=2))
    full = K.copy(), V.copy()
    with pytest.raises(ValueError, match="the cache is full: row n = 7 is beyond its capacity"):
        append(K, V, k_new, v_new, n=7)
    np.testing.assert_array_equal(K, full[0])
    np.testing.assert_array_equal(V, full[1])


def test_a_cache_filled_a_row_a_call_is_written_and_checked_at_each_calls_n():
    """n changes every call of a decode loop, the shapes do not: each call writes its own
    row and is checked at its own n, the shapes' fit worked out once."""
    append = runtime.load("kv_append", "dnf", "c")
    K, V = np.zeros((1, 2, 4, 3)), np.zeros((1, 2, 4, 3))
    rows = RNG.standard_normal((4, 1, 2, 3))
    for n, row in enumerate(rows):
        append(K, V, row, 2 * row, n=n)
    np.testing.assert_array_equal(K.transpose(2, 0, 1, 3), rows)
    np.testing.assert_array_equal(V.transpose(2, 0, 1, 3), 2 * rows)
    assert len(append._fits) == 1
    with pytest.raises(ValueError, match="row n = 4 is beyond its capacity of 4"):
        append(K, V, rows[0], rows[0], n=4)
    with pytest.raises(ValueError, match="size n must be >= 0, got -1"):
        append(K, V, rows[0], rows[0], n=-1)


def test_kv_append_refuses_a_read_only_or_aliased_cache():
    append = runtime.load("kv_append", "dnf", "c")
    K, k_new = np.zeros((1, 1, 3, 2)), np.ones((1, 1, 2))
    frozen = K.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="argument 'K' is read-only"):
        append(frozen, K.copy(), k_new, k_new.copy(), n=0)
    with pytest.raises(ValueError, match="shares memory"):
        append(K, K, k_new, k_new.copy(), n=0)


def test_kv_append_is_o_of_d():
    """The in-place ONF has no loop over the cache's rows: it writes one row per head."""
    onf = onf_of("kv_append", "dnf")
    assert onf.outputs == () and onf.inout == ("K", "V")
    loops = {str(s.var) for n in onf.nests for s in _walk(n.body) if hasattr(s, "var")}
    assert loops == {"b", "g", "c"}


def _walk(stmts):
    for s in stmts:
        yield s
        yield from _walk(getattr(s, "body", ()))
